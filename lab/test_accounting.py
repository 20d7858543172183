"""lab/accounting.py: the FLOPs, the modelled H200 time, the commit and the data's fingerprint a row gets."""
import hashlib
import importlib.util
import inspect
import re
import shutil
import subprocess
import sys

import pytest
import torch
import torchvision

import root  # noqa: F401  (first: the repository's root on sys.path, for the scripts and common.py)
import ablation  # noqa: E402
import accounting  # noqa: E402
import baseline  # noqa: E402
import benchmark  # noqa: E402
import common  # noqa: E402
import opt4  # noqa: E402
import opt5  # noqa: E402
import opt6  # noqa: E402
import plot  # noqa: E402
from conftest import CPU, ROOT, read_json, write_tiny_cifar10  # noqa: E402


def test_rows_name_their_data_by_the_md5s_of_its_files(tmp_path):
    write_tiny_cifar10(tmp_path)
    settings, folder = {"synthetic": False, "data_dir": str(tmp_path)}, tmp_path / "cifar-10-batches-py"
    names = [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]
    copy = accounting.data_fingerprint(settings)
    assert copy == accounting.fingerprint([hashlib.md5((folder / name).read_bytes()).hexdigest() for name in names])
    # The official files are those whose md5s torchvision checks, so theirs follows from its list; the results page
    # says it
    official = accounting.fingerprint([md5 for _, md5 in torchvision.datasets.CIFAR10.train_list
                                      + torchvision.datasets.CIFAR10.test_list])
    assert re.fullmatch(r"[0-9a-f]{12}", copy) and copy != official
    assert f"`{official}`" in (ROOT / "lab/README.md").read_text()
    data = bytearray((folder / "test_batch").read_bytes())
    data[-1] ^= 1  # one bit of one file
    (folder / "test_batch").write_bytes(data)
    assert accounting.data_fingerprint(settings) not in (copy, official)
    assert accounting.data_fingerprint({"synthetic": True, "data_dir": None}) == "synthetic"
    assert accounting.data_fingerprint({"synthetic": False, "data_dir": str(tmp_path / "none")}) is None


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
def test_rows_name_the_commit_and_say_when_the_code_differs_from_it(tmp_path):
    (tmp_path / "lab").mkdir()
    for name in ("common.py", "machine.py", "lab/root.py", "lab/accounting.py"):
        (tmp_path / name).write_text((ROOT / name).read_text())
    spec = importlib.util.spec_from_file_location("copied_accounting", tmp_path / "lab" / "accounting.py")
    copied = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(copied)  # its git_commit() asks the git checkout it sits in
    assert copied.git_commit() is None, "not in a git checkout"

    def git(*words):
        return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *words], cwd=tmp_path,
                              capture_output=True, text=True, check=True).stdout.strip()

    git("init", "-q")
    git("add", ".")
    git("commit", "-q", "-m", "the scripts")
    commit = git("rev-parse", "--short", "HEAD")
    (tmp_path / "notes.py").write_text("# not tracked: not the code that ran\n")
    assert copied.git_commit() == commit
    with open(tmp_path / "common.py", "a") as file:
        file.write("# a change\n")
    assert copied.git_commit() == f"{commit}+changes"


def test_resnet10_shape_and_flop_count():
    model = common.ResNet10()
    assert sum(p.numel() for p in model.parameters()) == 4_903_242
    assert model(torch.randn(2, 3, 32, 32)).shape == (2, 10)
    # Forward is ~0.25 GMAC = 0.5 GFLOP per image; backward costs about twice the forward.
    assert 1.3e9 < accounting.training_flops_per_image() < 1.7e9


def test_each_epochs_work_is_counted_at_its_size_and_batch_and_modelled_on_an_h200():
    update = accounting.muon_update_flops(3)
    # Newton-Schulz on the 12 filters one at a time, as opt5's Muon runs it (37.1 GFLOP in 5 zero-padded batches, as
    # ablation.py's muon-other-form row runs it), lab/README.md
    assert update == pytest.approx(27.3e9, rel=0.01)
    at = {size: accounting.training_flops_per_image(size) for size in (16, 24, 32)}
    assert at[16] == pytest.approx(at[32] / 4, rel=0.01) and at[24] == pytest.approx(at[32] * 9 / 16, rel=0.01)
    # The H200 model: least squares over the measured steps, a fixed part and one per image x pixel
    fixed, per_pixel = accounting.h200_step_fit()
    assert (fixed, per_pixel) == (pytest.approx(0.864e-3, abs=1e-6), pytest.approx(7.55e-9, rel=1e-3))
    residuals = [ms / 1000 - accounting.modelled_h200_step_seconds(images, side, muon=False)
                 for images, side, ms in accounting.H200_MEASURED_STEPS]
    assert sum(residuals) == pytest.approx(0, abs=1e-9) and max(map(abs, residuals)) < 0.1e-3
    # 5 epochs of batch 128 at 16, 16, 24, 24, 32 px, with Muon: each step its fit at its size, plus Muon's 0.6 ms
    records = [{"image_size": size, "steps": 390, "images": 390 * 128} for size in (16, 16, 24, 24, 32)]
    work = accounting.count_work(records, update, muon=True)
    assert work["modelled_h200_seconds"] == pytest.approx(
        sum(390 * (fixed + per_pixel * 128 * size ** 2 + 0.6e-3) for size in (16, 16, 24, 24, 32)))
    assert records[4]["training_flops"] == pytest.approx(390 * (128 * at[32] + update))
    # Without Muon, a 32-px epoch at batch 512: 97 steps of the fit alone
    big = [{"steps": 97, "images": 97 * 512}]
    assert accounting.count_work(big, 0, muon=False)["modelled_h200_seconds"] == pytest.approx(
        97 * (fixed + per_pixel * 512 * 32 ** 2))


@pytest.mark.parametrize("script", ["opt5.py", "opt6.py"])
def test_the_recipes_defaults_take_as_many_steps_as_five_epochs_of_128_in_7_3_modelled_h200_seconds(
        script, monkeypatch):
    module = {"opt5.py": opt5, "opt6.py": opt6}[script]
    monkeypatch.setattr(sys, "argv", [script])
    args = module.parse_args()
    assert {name: getattr(args, name) for name in plot.RECIPE} == plot.RECIPE == {  # plot.py's tables
        "epochs": 20, "batch_size": 512, "lr": 0.016, "optimizer": "muon", "ns_steps": 3, "min_size": 16,
        "full_size_share": 0.3, "label_smoothing": 0.1, "accum_steps": 1, "train_size": None}
    sizes = module.image_sizes(args.epochs, args.min_size, 32, args.full_size_share)
    assert [(size, sizes.count(size)) for size in (16, 24, 32)] == [(16, 7), (24, 7), (32, 6)]
    steps = common.CIFAR10_TRAIN_SIZE // args.batch_size
    records = [{"image_size": size, "steps": steps, "images": steps * args.batch_size} for size in sizes]
    work = accounting.count_work(records, accounting.muon_update_flops(args.ns_steps), muon=True)
    assert steps * args.epochs == 1940 and 5 * (common.CIFAR10_TRAIN_SIZE // 128) == 1950
    assert 7.3 < work["modelled_h200_seconds"] < 7.4  # lab/README.md, "The modelled H200 time"


def modelled_bundle_seconds(row):
    """An ablation.py row's modelled H200 seconds on the whole training set, from the sizes opt5 gives it with the
    row's techniques applied (epochs_at_each_size replaces opt5.image_sizes) and its one batch at every size."""
    _, flags, techniques, _ = ablation.ROWS[ablation.ROW_NAMES.index(row)]
    with pytest.MonkeyPatch.context() as patch:
        for technique in techniques:
            technique(patch.setattr)
        patch.setattr(sys, "argv", ["opt5.py", *flags])
        args = opt5.parse_args()
        sizes = opt5.image_sizes(args.epochs, args.min_size, 32, args.full_size_share)
    steps = common.CIFAR10_TRAIN_SIZE // args.batch_size
    # accounting.count_work's modelled seconds, without the FLOP counts it also makes (a ResNet10 pass per epoch)
    return sum(steps * accounting.modelled_h200_step_seconds(args.batch_size, size, muon=args.optimizer == "muon")
               for size in sizes)


def test_every_ablation_bundle_models_to_at_most_0_7_of_the_recipes_h200_time():
    twenty = modelled_bundle_seconds("twenty-epochs")
    shares = {row: modelled_bundle_seconds(row) / twenty for row in ablation.BUNDLE_ROWS}
    assert 7.3 < twenty < 7.4 and len(shares) == 10 and max(shares.values()) <= 0.7, shares
    # ablation.py's figures: 15 epochs of 512 (8, 4, 3 by size), 14 of 512 (7, 4, 3), 16 of 1024 (8, 4, 4)
    assert {round(share, 2) for share in shares.values()} == {0.67, 0.64, 0.58}
    assert shares["fifteen-epochs+all"] == shares["fifteen-epochs"], "the tricks add no epochs"


def test_the_update_is_counted_on_a_copy_and_the_runs_weights_do_not_move():
    model = common.ResNet10()
    parameters = list(model.parameters())
    optimizer = opt5.Muon([p for p in parameters if p.ndim == 4], torch.tensor(1e-3), dtype=torch.float32, steps=3)
    adamw = opt5.adamw([p for p in parameters if p.ndim != 4], 1e-3, CPU)
    before = [parameter.detach().clone() for parameter in parameters]
    hooks_run = []
    for hooked in (optimizer, adamw):  # as ablation.py's EMA row hooks the last
        hooked.register_step_pre_hook(lambda *_: hooks_run.append("pre"))
        hooked.register_step_post_hook(lambda *_: hooks_run.append("post"))
    assert accounting.update_flops(optimizer) > 0 and all(parameter.grad is None for parameter in parameters)
    assert accounting.update_flops(adamw) == 0  # elementwise: FlopCounterMode counts none
    assert hooks_run == [], "the copy's step ran the run's hooks"
    assert all(torch.equal(old, parameter) for old, parameter in zip(before, parameters))
    assert all(not state for state in (*optimizer.state.values(), *adamw.state.values())), "the run's took no step"
    assert accounting.update_flops(torch.optim.SGD(parameters, lr=0.1)) == 0
    stem = model.stem[0].weight
    alone = opt5.Muon([stem], torch.tensor(1e-3), dtype=torch.float32, steps=3)
    every, stem_update = accounting.update_flops(optimizer), accounting.update_flops(alone)
    stem.requires_grad_(False)  # as ablation.py's whitening row freezes it: no gradient, so a step skips it
    assert stem_update > 0 and accounting.update_flops(optimizer) == every - stem_update


def test_a_row_gets_its_data_by_the_md5s_of_its_files_and_the_commit_it_is_given(tmp_path, monkeypatch):
    write_tiny_cifar10(tmp_path)
    json_path = tmp_path / "result.json"
    monkeypatch.setattr(sys, "argv", ["baseline.py", "--data-dir", str(tmp_path), "--device", "cpu",
                                      "--epochs", "1", "--batch-size", "16", "--json", str(json_path)])
    baseline.main()
    report = read_json(json_path)
    md5s = [hashlib.md5((tmp_path / "cifar-10-batches-py" / name).read_bytes()).hexdigest()
            for name in [f"data_batch_{number}" for number in range(1, 6)] + ["test_batch"]]
    files = hashlib.md5("".join(md5s).encode()).hexdigest()[:12]
    assert accounting.add_provenance(report, "abc1234") == {**report, "commit": "abc1234", "data_fingerprint": files}


def test_a_rows_achieved_tflops_are_its_steady_images_per_second_times_a_training_images_flops():
    records = [{"train_seconds": seconds, "images": 1000, "steps": 10, "test_accuracy": 0.5, "launch_seconds": 9.0}
               for seconds in (100.0, 10.0, 10.0)]
    summary = common.summarize(records, total_seconds=125.0, peak_memory=1)
    row = {"settings": {}, "epochs": [dict(record) for record in records], **summary}
    assert accounting.add_work(row)["achieved_tflops"] == pytest.approx(100.0 * accounting.training_flops_per_image()
                                                                         / 1e12)


def test_accounting_counts_muons_update_and_time_from_a_row_as_the_report_writes_it():
    records = []
    for size in (16, 32):
        common.record_epoch(records, (1.0, 0.5, 4, 128), (1.0, 0.5), 2.0, image_size=size, test_images=64)
    summary = common.summarize(records, total_seconds=4.0, peak_memory=1)
    # the lab counts the work from the row: Muon's update (opt5's, on ResNet10) in every step, and its time
    row = {"settings": {"optimizer": "muon", "ns_steps": 3}, **summary, "epochs": records}
    update, counted = accounting.muon_update_flops(3), accounting.add_work(row)
    expected = accounting.count_work([dict(record) for record in records], update, muon=True)
    assert counted["training_flops"] == expected["training_flops"] and "training_flops" not in records[0]
    assert counted["modelled_h200_seconds"] == pytest.approx(expected["modelled_h200_seconds"])
    alone = accounting.add_work({**row, "settings": {"optimizer": "adamw"}})
    assert alone["training_flops"] == expected["training_flops"] - 8 * update
    assert counted["modelled_h200_seconds"] == pytest.approx(alone["modelled_h200_seconds"]
                                                             + 8 * accounting.H200_MUON_STEP_SECONDS)


@pytest.mark.parametrize("module", [accounting, benchmark], ids=["lab/accounting.py", "lab/benchmark.py"])
def test_no_function_of_the_lab_takes_more_than_six_parameters(module):
    functions = [value for value in vars(module).values()
                 if inspect.isfunction(value) and value.__module__ == module.__name__]
    assert {function.__name__ for function in functions
            if len(inspect.signature(function).parameters) > 6} == set()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_counting_the_update_of_a_captured_steps_optimizer_leaves_the_run_untouched():
    weight = torch.zeros(8, 8, device="cuda", requires_grad=True)
    optimizer = opt4.adamw([weight], 0.01, torch.device("cuda"))
    assert accounting.update_flops(optimizer) == 0  # AdamW's update: elementwise ops, no matmul
    assert weight.grad is None and not optimizer.state  # the run's optimizer and weights untouched
