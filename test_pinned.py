"""Today's training, pinned: opt3's, opt4's and opt5's losses at a toy size on the CPU, seed 0, must stay what they were
when these figures were recorded (commit 7d8fc91). A change that only moves or renames code passes; one that changes
what is trained (an augmentation drawn in another order, a rate, a default) fails.

Each script runs in this process through its command line and its --json row only, in float32 (its autocast_dtype
answers float32), so the figures are the same on a CPU with a bfloat16 unit and on one without. Float32 still rounds
differently on different CPUs (oneDNN picks its kernels per instruction set): the figures match to 1 part in 2,000,
far closer than a change of training comes (a different draw of batches moves these losses by several percent).
"""
import json
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))
TOY = ["--synthetic", "--device", "cpu", "--train-size", "128", "--test-size", "96", "--epochs", "3",
       "--batch-size", "32", "--lr", "0.0002", "--seed", "0"]
# (script, its flags beyond TOY): each epoch's mean training loss and test loss, recorded at 7d8fc91 in float32.
PINNED = {
    ("opt3.py", ()): [
        [2.333563804626465, 2.301875432332357],
        [2.2638258934020996, 2.300398508707682],
        [2.229752540588379, 2.3021424611409507]],
    ("opt4.py", ()): [
        [2.333563804626465, 2.301875432332357],
        [2.2638258934020996, 2.300398508707682],
        [2.229752540588379, 2.3021424611409507]],
    ("opt4.py", ("--accum-steps", "2")): [
        [2.347043514251709, 2.3018317222595215],
        [2.300997018814087, 2.3008979161580405],
        [2.277658700942993, 2.302858034769694]],
    ("opt5.py", ()): [
        [2.361056089401245, 2.302753289540609],
        [2.303116798400879, 2.3039538065592446],
        [2.30541729927063, 2.3077925046284995]],
    ("opt5.py", ("--optimizer", "adamw")): [
        [2.341590404510498, 2.3023791313171387],
        [2.2877357006073, 2.3022090593973794],
        [2.2870333194732666, 2.3047765096028647]],
}


def losses_of_a_run(script, flags, folder, monkeypatch):
    """(train loss, test loss) of each epoch of `script` run with TOY + `flags`, in float32, in this process."""
    module = __import__(Path(script).stem)
    monkeypatch.setattr(module, "autocast_dtype", lambda device: (torch.float32, "float32: pinned"))
    row = folder / "row.jsonl"
    monkeypatch.setattr(sys, "argv", [script, *TOY, *flags, "--json", str(row)])
    saved = torch.backends.cudnn.benchmark, torch.get_num_threads()
    try:
        module.main()
    finally:
        torch.backends.cudnn.benchmark = saved[0]
        torch.set_num_threads(saved[1])
    epochs = json.loads(row.read_text().splitlines()[-1])["epochs"]
    return [[epoch["train_loss"], epoch["test_loss"]] for epoch in epochs]


@pytest.mark.parametrize("script, flags", PINNED, ids=[" ".join((script, *flags)) for script, flags in PINNED])
def test_training_is_what_it_was(script, flags, tmp_path, monkeypatch):
    losses = losses_of_a_run(script, flags, tmp_path, monkeypatch)
    assert sum(losses, []) == pytest.approx(sum(PINNED[script, flags], []), rel=5e-4), losses


COMMON_DEFAULTS = {"data_dir": "./data", "device": "auto", "seed": 0, "synthetic": False, "train_size": None,
                   "test_size": None, "validation": 0, "json": None, "save": None, "profile": None, "compile": False,
                   "accum_steps": 1, "label_smoothing": 0.1}
RECIPE = {"epochs": 20, "batch_size": 512, "lr": 0.016, "min_size": 16, "full_size_share": 0.3, "monitor_size": 1000,
          "optimizer": "muon", "ns_steps": 3}
DEFAULTS = {"opt3.py": {"epochs": 5, "batch_size": 128, "lr": 0.008}, "opt4.py": {"epochs": 5, "batch_size": 128,
            "lr": 0.008}, "opt5.py": RECIPE, "opt6.py": RECIPE}


@pytest.mark.parametrize("script", DEFAULTS)
def test_every_default_is_what_it_was(script, monkeypatch):
    monkeypatch.setattr(sys, "argv", [script])
    assert vars(__import__(Path(script).stem).parse_args()) == {**COMMON_DEFAULTS, **DEFAULTS[script]}
