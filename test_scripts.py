"""Tests for the fast-cifar scripts. CPU only, tiny data, no network: `python -m pytest -q`."""
import contextlib
import inspect
import json
import os
import pickle
import re
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn as nn
import torchvision
from torch.utils.data import DataLoader, TensorDataset

import baseline
import common
import opt1
import opt2
import opt3
import opt4

ROOT = Path(__file__).resolve().parent
SCRIPTS = {"baseline.py": baseline, "opt1.py": opt1, "opt2.py": opt2, "opt3.py": opt3}
CPU = torch.device("cpu")
# Point downloads at a closed local port, so "no network" fails at once on any machine.
NO_NETWORK = {"http_proxy": "http://127.0.0.1:9", "https_proxy": "http://127.0.0.1:9"}
SMALL = ["--synthetic", "--device", "cpu", "--test-size", "256"]


def run_script(*args, timeout=600):
    """Run `python args...` in a fresh process, offline; returns the CompletedProcess."""
    env = {**os.environ, **NO_NETWORK}
    return subprocess.run([sys.executable, *map(str, args)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


def call(function, **available):
    """Call a script's function with the arguments its signature names (they differ along the chain)."""
    names = inspect.signature(function).parameters
    return function(**{name: available[name] for name in names})


def script_evaluate(module, model, dataset):
    """A script's own evaluate() on `dataset`, fed the way that script feeds it."""
    loader = DataLoader(dataset, batch_size=64)
    test_data = opt3.load_to_device(dataset, CPU)
    return call(module.evaluate, model=model, loader=loader, test_data=test_data, batch_size=64,
                amp_dtype=torch.bfloat16, device=CPU)  # bfloat16: what opt1 onwards use on the CPU


def read_json(path):
    lines = Path(path).read_text().splitlines()
    assert len(lines) == 1
    return json.loads(lines[0])


# ------------------------------------------------------------------------- end to end, per script

LEARN_ARGS = {
    "baseline.py": ["--batch-size", "32", "--train-size", "1024"],
    "opt1.py": ["--batch-size", "32", "--train-size", "1024", "--no-compile"],
    # The one compiled run: it also proves saved weights carry no torch.compile prefix.
    "opt2.py": ["--batch-size", "32", "--train-size", "1024", "--workers", "2"],
    "opt3.py": ["--batch-size", "32", "--train-size", "1024", "--no-compile"],
}
EVAL_TRANSFORM = {"baseline.py": common.plain_transform, "opt1.py": common.plain_transform,
                  "opt2.py": common.normalized_transform, "opt3.py": None}
SUMMARY_FIELDS = {"total_seconds", "warmup_seconds", "steady_images_per_second", "steady_ms_per_step",
                  "achieved_tflops", "final_test_accuracy", "peak_memory_bytes", "training_flops_per_image",
                  "final_lr", "script", "device", "torch", "data", "settings", "epochs"}
EPOCH_FIELDS = {"epoch", "train_loss", "train_accuracy", "test_loss", "test_accuracy", "train_seconds",
                "images_per_second", "ms_per_step", "steps", "images"}


@pytest.mark.parametrize("script", SCRIPTS)
def test_script_learns_reports_and_saves(script, tmp_path):
    json_path, weights = tmp_path / "result.json", tmp_path / "weights.pt"
    result = run_script(script, *SMALL, "--epochs", 2, *LEARN_ARGS[script],
                        "--json", json_path, "--save", weights)
    assert result.returncode == 0, result.stderr
    assert "says nothing about CIFAR-10" in result.stdout
    assert "epoch 1:" in result.stdout and "(includes compile/warm-up)" in result.stdout
    assert "steady state (epochs 2+)" in result.stdout

    report = read_json(json_path)
    assert SUMMARY_FIELDS <= report.keys()
    assert [set(epoch) for epoch in report["epochs"]] == [EPOCH_FIELDS, EPOCH_FIELDS]
    assert report["data"] == "synthetic" and report["settings"]["batch_size"] == 32
    assert report["final_test_accuracy"] > 0.5, "chance is 0.1: the loop does not learn"
    assert report["epochs"][1]["train_loss"] < report["epochs"][0]["train_loss"]
    assert all(value is not None for value in report.values())

    model = common.ResNet10()
    model.load_state_dict(torch.load(weights))  # strict: fails on an `_orig_mod.` prefix
    transform = EVAL_TRANSFORM[script] and EVAL_TRANSFORM[script]()
    test_set = common.synthetic_cifar10(256, train=False, transform=transform)
    _, accuracy = script_evaluate(SCRIPTS[script], model, test_set)
    assert accuracy == pytest.approx(report["final_test_accuracy"], abs=0.01)


@pytest.mark.parametrize("script", SCRIPTS)
def test_help_documents_every_flag_with_its_default(script):
    result = run_script(script, "--help")
    assert result.returncode == 0
    flags = ["--epochs", "--batch-size", "--lr", "--data-dir", "--device", "--seed", "--synthetic",
             "--train-size", "--test-size", "--json", "--save", "--profile"]
    if script != "baseline.py":
        flags.append("--compile")
    if script in ("opt2.py", "opt3.py"):
        flags += ["--accum-steps", "--label-smoothing"]
    for flag in flags:
        assert flag in result.stdout
    help_texts = result.stdout.split("options:")[1].split("\n  -")[2:]  # skip -h
    assert all("default" in text for text in help_texts), help_texts


def test_settings_line_shows_zero_and_off_values(capsys):
    args = SimpleNamespace(seed=0, label_smoothing=0.0, compile=False, json=None)
    common.print_settings("opt2.py", CPU, args)
    assert capsys.readouterr().out == "opt2.py on cpu: seed 0, label_smoothing 0.0, compile False\n"


# ----------------------------------------------------------------------------------- bad input

@pytest.mark.parametrize("args, says", [
    (["--epochs", "0"], "--epochs: must be a positive integer"),
    (["--batch-size", "0"], "--batch-size: must be a positive integer"),
    (["--lr", "-0.1"], "--lr: must be a positive number"),
    (["--lr", "nan"], "--lr: must be a positive number"),
    (["--device", "tpu"], "--device: invalid choice"),
    (["--unknown-flag"], "unrecognized arguments: --unknown-flag"),
    (["--batch-size", "1"], "BatchNorm needs 2 images"),
    (["--train-size", "60000", "--synthetic"], "--train-size 60000 is larger than the 50000 train images"),
    (["--train-size", "10", "--synthetic"], "smaller than one optimizer step"),
    (["--data-dir", "{empty}"], "the download failed"),
])
def test_bad_input_exits_2_with_one_line(args, says, tmp_path):
    args = [arg.replace("{empty}", str(tmp_path)) for arg in args]
    result = run_script("baseline.py", "--device", "cpu", *args)
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr, result.stderr
    assert result.stderr.startswith("error: ") and says in result.stderr


@pytest.mark.parametrize("args, says", [
    (["--workers", "-1"], "--workers: must be 0 or more"),
    (["--label-smoothing", "1"], "--label-smoothing: must be at least 0 and below 1"),
    (["--accum-steps", "0"], "--accum-steps: must be a positive integer"),
])
def test_opt2_flags_are_checked_too(args, says):
    result = run_script("opt2.py", *args)
    assert result.returncode == 2 and says in result.stderr


def test_missing_data_message_says_where_and_what_to_do(tmp_path):
    result = run_script("opt2.py", "--data-dir", tmp_path / "nowhere", "--device", "cpu")
    assert result.returncode == 2
    assert str(tmp_path / "nowhere") in result.stderr and "--synthetic" in result.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_asked_for_without_a_gpu_exits_2():
    result = run_script("opt1.py", "--device", "cuda", "--synthetic")
    assert result.returncode == 2 and "sees no CUDA GPU" in result.stderr


def test_accum_steps_must_fit_in_the_training_set():
    result = run_script("opt2.py", *SMALL, "--train-size", "64", "--batch-size", "32", "--accum-steps", "3")
    assert result.returncode == 2 and "(96 images)" in result.stderr


def test_too_few_optimizer_steps_for_onecycle_exit_2():
    result = run_script("opt2.py", *SMALL, "--train-size", "64", "--batch-size", "32", "--epochs", "2")
    assert result.returncode == 2 and "too few for OneCycleLR" in result.stderr, result.stderr


def test_a_last_batch_of_one_image_does_not_crash_batchnorm(tmp_path):
    json_path = tmp_path / "result.json"
    result = run_script("baseline.py", *SMALL, "--epochs", 1, "--train-size", 2 * 16 + 1,
                        "--batch-size", 16, "--json", json_path)
    assert result.returncode == 0, result.stderr
    assert read_json(json_path)["epochs"][0]["steps"] == 2


class NaNModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(1))

    def forward(self, images):
        return self.weight * torch.full((len(images), 10), float("nan"))


@pytest.mark.parametrize("script", SCRIPTS)
def test_a_non_finite_loss_stops_the_run_naming_epoch_and_step(script, capsys):
    model = NaNModel()
    images, labels = torch.randint(0, 256, (8, 3, 32, 32), dtype=torch.uint8), torch.zeros(8, dtype=torch.long)
    loader = DataLoader(TensorDataset(images.float(), labels), batch_size=4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    with pytest.raises(SystemExit) as exit_info:
        call(SCRIPTS[script].train_one_epoch, model=model, loader=loader, train_data=(images, labels),
             criterion=nn.CrossEntropyLoss(), optimizer=optimizer, scheduler=scheduler,
             scaler=torch.amp.GradScaler("cpu", enabled=False), amp_dtype=torch.bfloat16, accum_steps=1,
             batch_size=4, generator=torch.Generator().manual_seed(0), device=CPU, epoch=3,
             profiler=SimpleNamespace(step=lambda: None))
    assert exit_info.value.code == 1
    assert "loss is nan at epoch 3, step 1" in capsys.readouterr().err
    if script != "opt3.py":  # opt3 reads its losses once per epoch, after the steps
        assert model.weight.item() == 1.0, "the bad step must not reach the weights"


# --------------------------------------------------------------------------------- real data path

def write_tiny_cifar10(root, train_per_file=20, test_size=30):
    """A few random images in torchvision's on-disk CIFAR-10 layout; returns the first train image."""
    folder = root / "cifar-10-batches-py"
    folder.mkdir(parents=True)
    rng = np.random.default_rng(0)
    names = [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]
    for name in names:
        size = test_size if name == "test_batch" else train_per_file
        batch = {"data": rng.integers(0, 256, (size, 3072), dtype=np.uint8),
                 "labels": rng.integers(0, 10, size).tolist()}
        with open(folder / name, "wb") as file:
            pickle.dump(batch, file)
        if name == "data_batch_1":
            first = batch["data"][0].reshape(3, 32, 32)
    with open(folder / "batches.meta", "wb") as file:
        pickle.dump({"label_names": [f"class{i}" for i in range(10)]}, file)
    return first


def test_real_cifar10_path_reads_torchvision_layout(tmp_path, monkeypatch):
    first_image = write_tiny_cifar10(tmp_path)
    # Our files are not the official bytes: skip torchvision's md5 checks, as ../shared/cifar10/run_local.py does.
    monkeypatch.setattr(torchvision.datasets.CIFAR10, "_check_integrity", lambda self: True)
    monkeypatch.setattr(torchvision.datasets.cifar, "check_integrity", lambda path, md5=None: os.path.isfile(path))

    args = SimpleNamespace(synthetic=False, data_dir=str(tmp_path), train_size=None, test_size=None)
    train_set, test_set = common.load_data(args, common.plain_transform(), common.plain_transform())
    assert (len(train_set), len(test_set)) == (100, 30)
    image, _ = train_set[0]
    assert torch.equal((image * 255).round().to(torch.uint8), torch.from_numpy(first_image))

    json_path = tmp_path / "result.json"
    monkeypatch.setattr(sys, "argv", ["baseline.py", "--data-dir", str(tmp_path), "--device", "cpu",
                                      "--epochs", "1", "--batch-size", "16", "--json", str(json_path)])
    baseline.main()
    report = read_json(json_path)
    assert report["data"] == "cifar10" and report["epochs"][0]["images"] == 6 * 16


# ------------------------------------------------------------------------ gradient accumulation

def accumulated_weights(batch_size, accum_steps, monkeypatch):
    """Weights of a small BatchNorm-free net after one opt2 epoch of 24 images."""
    monkeypatch.setattr(torch, "autocast", lambda *args, **kwargs: contextlib.nullcontext())  # float32
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 30 * 30, 10))
    torch.manual_seed(1)
    data = TensorDataset(torch.randn(24, 3, 32, 32), torch.randint(0, 10, (24,)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    _, _, steps, images = opt2.train_one_epoch(
        model, DataLoader(data, batch_size=batch_size), nn.CrossEntropyLoss(), optimizer, scheduler,
        torch.amp.GradScaler("cpu", enabled=False), torch.float32, accum_steps, CPU, 1,
        SimpleNamespace(step=lambda: None))
    return torch.nn.utils.parameters_to_vector(model.parameters()).detach(), steps, images


def test_accumulating_k_micro_batches_equals_one_big_batch(monkeypatch):
    big_batch, steps, _ = accumulated_weights(12, 1, monkeypatch)
    accumulated, accumulated_steps, images = accumulated_weights(4, 3, monkeypatch)
    assert (steps, accumulated_steps, images) == (2, 2, 24)
    assert torch.allclose(accumulated, big_batch, atol=1e-6)
    one_step, _, _ = accumulated_weights(24, 1, monkeypatch)
    assert not torch.allclose(one_step, big_batch, atol=1e-3), "the comparison must be able to fail"


def onecycle_lr_after(total_steps, max_lr):
    """The learning rate after total_steps steps of a OneCycleLR set up as opt2 sets it up."""
    optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=max_lr)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=max_lr, total_steps=total_steps, pct_start=0.25)
    for _ in range(total_steps):
        optimizer.step()
        scheduler.step()
    return optimizer.param_groups[0]["lr"]


@pytest.mark.parametrize("accum_steps", [1, 3])
def test_onecycle_length_counts_optimizer_steps(accum_steps, tmp_path):
    json_path = tmp_path / "result.json"
    # 10 batches per epoch: not divisible by 3, so micro-batches and optimizer steps differ.
    result = run_script("opt2.py", *SMALL, "--epochs", 2, "--train-size", 160, "--batch-size", 16,
                        "--accum-steps", accum_steps, "--no-compile", "--workers", 0, "--json", json_path)
    assert result.returncode == 0, result.stderr
    report = read_json(json_path)
    assert [epoch["steps"] for epoch in report["epochs"]] == [10 // accum_steps] * 2
    assert [epoch["images"] for epoch in report["epochs"]] == [10 // accum_steps * accum_steps * 16] * 2
    # The rate after the run tells how long the schedule was: counting micro-batches would leave it high.
    optimizer_steps = 2 * (10 // accum_steps)
    assert report["final_lr"] == pytest.approx(onecycle_lr_after(optimizer_steps, report["settings"]["lr"]))
    if accum_steps > 1:
        assert report["final_lr"] != pytest.approx(onecycle_lr_after(2 * 10, report["settings"]["lr"]))


# ---------------------------------------------------------------------------- timing and model

def test_clock_measures_a_known_sleep():
    start = common.now(CPU)
    time.sleep(0.2)
    assert 0.19 < common.now(CPU) - start < 0.3


def test_steady_state_excludes_the_first_epoch():
    def record(seconds, images=1000, steps=10):
        return {"train_seconds": seconds, "images": images, "steps": steps, "test_accuracy": 0.5}

    records = [record(100.0), record(10.0), record(10.0)]
    summary = common.summarize(records, total_seconds=125.0, peak_memory=1, flops_per_image=1e9)
    assert summary["steady_images_per_second"] == pytest.approx(100.0)
    assert summary["steady_ms_per_step"] == pytest.approx(1000.0)
    assert summary["warmup_seconds"] == pytest.approx(90.0)
    assert summary["achieved_tflops"] == pytest.approx(100.0 * 1e9 / 1e12)
    no_slower = common.summarize([record(10.0), record(10.5)], total_seconds=25.0, peak_memory=1, flops_per_image=1e9)
    assert no_slower["warmup_seconds"] == 0.0, "machine noise must not show as negative warm-up"
    one_epoch = common.summarize(records[:1], total_seconds=100.0, peak_memory=1, flops_per_image=1e9)
    assert one_epoch["steady_images_per_second"] is None and one_epoch["warmup_seconds"] is None


def test_resnet10_shape_and_flop_count():
    model = common.ResNet10()
    assert sum(p.numel() for p in model.parameters()) == 4_903_242
    assert model(torch.randn(2, 3, 32, 32)).shape == (2, 10)
    # Forward is ~0.25 GMAC = 0.5 GFLOP per image; backward costs about twice the forward.
    assert 1.3e9 < common.training_flops_per_image() < 1.7e9


def test_synthetic_data_is_deterministic_and_shares_class_images():
    first = common.synthetic_cifar10(64, train=True, transform=common.plain_transform())
    again = common.synthetic_cifar10(64, train=True, transform=common.plain_transform())
    test = common.synthetic_cifar10(64, train=False, transform=common.plain_transform())
    assert np.array_equal(first.data, again.data) and first.targets == again.targets
    assert not np.array_equal(first.data, test.data)
    # Images of one class are closer to each other than to images of another class.
    data, targets = first.data.astype(np.float32), np.array(first.targets)
    a, b = np.flatnonzero(targets == targets[0])[:2]
    other = np.flatnonzero(targets != targets[0])[0]
    assert np.abs(data[a] - data[b]).mean() < np.abs(data[a] - data[other]).mean()


def test_profile_writes_a_trace(tmp_path):
    result = run_script("baseline.py", *SMALL, "--epochs", 1, "--train-size", 6 * 8, "--batch-size", 8,
                        "--test-size", 8, "--profile", tmp_path / "trace")
    assert result.returncode == 0, result.stderr
    assert list((tmp_path / "trace").glob("*.pt.trace.json"))


# -------------------------------------------------------------------- opt3's on-device data path

def test_opt3_augment_crops_a_translate_of_the_padded_image_and_flips_a_mirror():
    images = torch.rand(32, 3, 32, 32)
    pad = common.CROP_PADDING
    padded = torch.nn.functional.pad(images, (pad, pad, pad, pad), mode="reflect")
    augmented = opt3.augment(images, torch.Generator().manual_seed(0))
    found = set()
    shifts = range(2 * pad + 1)
    for i in range(len(images)):
        matches = [(top, left, flip) for top in shifts for left in shifts for flip in (False, True)
                   if torch.equal(augmented[i], (lambda crop: crop.flip(2) if flip else crop)(
                       padded[i, :, top:top + 32, left:left + 32]))]
        assert matches, f"image {i} is not a crop of its padded image, plain or mirrored"
        found.update(matches)
    assert len(found) > 10 and {flip for _, _, flip in found} == {False, True}, "not random"


def test_opt3_epoch_batches_show_every_image_once():
    generator = torch.Generator().manual_seed(0)
    batches = opt3.epoch_batches(96, 16, generator, CPU)
    assert batches.shape == (6, 16) and sorted(batches.flatten().tolist()) == list(range(96))
    with_remainder = opt3.epoch_batches(100, 16, generator, CPU).flatten()
    assert len(with_remainder) == 96 and len(set(with_remainder.tolist())) == 96  # 4 left over, none twice
    assert not torch.equal(opt3.epoch_batches(96, 16, generator, CPU), batches), "a fresh order per epoch"


def test_opt3_flip_tta_equals_plain_evaluation_on_mirror_symmetric_images(monkeypatch):
    monkeypatch.setattr(torch, "autocast", lambda *args, **kwargs: contextlib.nullcontext())  # float32
    torch.manual_seed(0)
    model = common.ResNet10().eval()
    half = torch.randint(0, 256, (16, 3, 32, 16), dtype=torch.uint8)
    symmetric = torch.cat([half, half.flip(3)], dim=3)
    labels = torch.randint(0, 10, (16,))

    def plain_loss(images):
        with torch.no_grad():
            return torch.nn.functional.cross_entropy(model(opt3.normalize(images)), labels).item()

    def tta_loss(images):
        loss, _ = opt3.evaluate(model, (images, labels), torch.float32, 8, CPU)
        return loss

    assert tta_loss(symmetric) == pytest.approx(plain_loss(symmetric), rel=1e-5)
    asymmetric = torch.cat([half, half], dim=3)
    assert tta_loss(asymmetric) != pytest.approx(plain_loss(asymmetric), rel=1e-5), "the test must be able to fail"


# ------------------------------------------------------------------------------------ benchmark

def test_benchmark_prints_a_row_per_script():
    result = run_script("benchmark.py", "--repeats", 1, "--epochs", 2, "--train-size", 48, "--test-size", 16,
                        "--batch-size", 16, "--device", "cpu", "--no-compile")
    assert result.returncode == 0, result.stderr
    table = result.stdout[result.stdout.index("| script"):].splitlines()
    assert len(table) == 2 + 4 and re.search(r"bf16 [\d.]+ TFLOP/s, float32 [\d.]+ TFLOP/s", result.stdout)
    assert [row.split("|")[1].strip() for row in table[2:]] == ["baseline.py", "opt1.py", "opt2.py", "opt3.py"]
    assert table[2].split("|")[3].strip() == "1.00x"


def test_benchmark_rejects_one_epoch():
    result = run_script("benchmark.py", "--epochs", 1)
    assert result.returncode == 2 and "steady state excludes epoch 1" in result.stderr


# ------------------------------------------------------------------------- opt4: DDP under torchrun

TORCHRUN = ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]  # for run_script
DDP_ARGS = [*SMALL, "--epochs", "2", "--batch-size", "16", "--no-compile"]


def checksums(stderr):
    return sorted(line.split("weights checksum ")[1] for line in stderr.splitlines() if "weights checksum" in line)


def test_opt4_two_processes_learn_print_once_and_end_with_identical_weights(tmp_path):
    json_path = tmp_path / "result.json"
    result = run_script(*TORCHRUN, "opt4.py", *DDP_ARGS, "--train-size", 1024, "--json", json_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.count("epoch 1:") == 1 and result.stdout.count("done:") == 1
    assert "world size 2: global batch 32" in result.stdout
    first, second = checksums(result.stderr)
    assert first == second, "the ranks' weights differ"
    report = read_json(json_path)
    assert report["world_size"] == 2 and report["final_test_accuracy"] > 0.5
    assert report["epochs"][0]["images"] == 1024, "images/s must count both ranks' images"


def test_opt4_without_torchrun_runs_as_one_process(tmp_path):
    json_path = tmp_path / "result.json"
    result = run_script("opt4.py", *DDP_ARGS, "--train-size", 256, "--json", json_path)
    assert result.returncode == 0, result.stderr
    assert "world size 1: global batch 16" in result.stdout and len(checksums(result.stderr)) == 1
    assert read_json(json_path)["world_size"] == 1


def test_opt4_rank_shares_are_disjoint_and_cover_the_epoch():
    def share(rank):
        generator = torch.Generator().manual_seed(0)  # every rank seeds alike
        return opt4.epoch_batches(100, 8, generator, CPU, rank, world_size=2)

    first, second = share(0), share(1)
    assert first.shape == second.shape == (6, 8)
    seen = first.flatten().tolist() + second.flatten().tolist()
    assert len(set(seen)) == 96, "no image twice; 100 - 96 left over for a full global batch of 16"


FAILING_RANK = """
import os, sys
sys.path.insert(0, {root!r})
import opt4

if os.environ["RANK"] == "1":  # rank 1 dies in its third step while rank 0 waits in an all-reduce
    calls, real_augment = [], opt4.augment
    def augment(images, generator):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("injected failure on rank 1")
        return real_augment(images, generator)
    opt4.augment = augment
sys.argv[0] = "opt4.py"
opt4.main()
"""


def test_opt4_a_failing_rank_ends_the_whole_job_with_its_message(tmp_path):
    wrapper = tmp_path / "fail_on_rank_1.py"
    wrapper.write_text(FAILING_RANK.format(root=str(ROOT)))
    start = time.monotonic()
    result = run_script(*TORCHRUN, wrapper, *DDP_ARGS, "--train-size", 1024, timeout=300)
    assert result.returncode != 0
    assert "injected failure on rank 1" in result.stderr
    assert time.monotonic() - start < 240, "torchrun should stop the waiting rank, not hang"
