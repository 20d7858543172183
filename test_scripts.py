"""Each script end to end, at a toy size on the CPU: it learns, reports each epoch's own figures, saves, and meets bad
input and a missing dataset with one line and exit code 2."""
import os
import pickle
import re
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
import opt2
import opt5
from conftest import (
    ALL_SCRIPTS, CPU, CPU_AMP_DTYPE, EVAL_TRANSFORM, LEARN_ARGS, NO_MONITOR, SMALL, WHOLE_STEP,
    assert_saved_weights_match_the_report, call, constant_schedule, read_json, run_python, shipped_optimizer,
    small_net, write_tiny_cifar10)


SUMMARY_FIELDS = {"total_seconds", "launch_to_result_seconds", "warmup_seconds", "steady_images_per_second",
                  "steady_ms_per_step", "final_test_accuracy", "peak_memory_bytes", "final_lr", "script", "date",
                  "command", "device", "device_name", "cpu", "threads", "torch", "data", "chain", "settings", "epochs",
                  "setup_seconds"}
EPOCH_FIELDS = {"epoch", "train_loss", "train_accuracy", "test_loss", "test_accuracy", "train_seconds",
                "images_per_second", "ms_per_step", "steps", "images", "launch_seconds"}


@pytest.mark.floor
@pytest.mark.parametrize("script", ALL_SCRIPTS)
def test_script_learns_reports_and_saves(script, tmp_path):
    json_path, weights = tmp_path / "result.json", tmp_path / "weights.pt"
    result = run_python(script, *SMALL, "--epochs", 2, *LEARN_ARGS[script],
                        "--json", json_path, "--save", weights)
    assert result.returncode == 0, result.stderr
    assert "says nothing about CIFAR-10" in result.stdout
    assert "epoch 1:" in result.stdout and "(includes warm-up, and compiling where on)" in result.stdout
    assert ("steady state (epochs 2+)" in result.stdout) == (script not in ("opt5.py", "opt6.py"))  # one size
    assert ("world size 1: global batch 16" in result.stdout) == (script == "opt6.py")  # no torchrun: one process

    report = read_json(json_path)
    assert report.keys() - {"world_size"} == SUMMARY_FIELDS, "the run's own figures: the tools add the lab's"
    sized = {"image_size", "test_images"} if script in ("opt5.py", "opt6.py") else set()
    assert [set(epoch) for epoch in report["epochs"]] == [EPOCH_FIELDS | sized, EPOCH_FIELDS | sized]
    assert [epoch.get("image_size", 32) for epoch in report["epochs"]] == [16 if sized else 32, 32]
    assert report["data"] == "synthetic" and report["settings"]["batch_size"] == int(LEARN_ARGS[script][1])
    assert report["settings"].get("compile", False) is False and report.get("world_size", 1) == 1
    assert report["final_test_accuracy"] > 0.5, "chance is 0.1: the loop does not learn"
    assert report["epochs"][1]["train_loss"] < report["epochs"][0]["train_loss"]
    # steady state is not measured where the epochs train on different image sizes (opt5, opt6)
    steady = {"warmup_seconds", "steady_images_per_second", "steady_ms_per_step"} if sized else set()
    assert all(value is not None for name, value in report.items() if name not in steady)

    assert_saved_weights_match_the_report(weights, report, ALL_SCRIPTS[script], EVAL_TRANSFORM[script])


@pytest.mark.parametrize("script", ALL_SCRIPTS)
def test_help_documents_every_flag_with_its_default(script, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", [script, "--help"])  # in this process: what `python script --help` prints
    with pytest.raises(SystemExit) as exit:
        ALL_SCRIPTS[script].parse_args()
    assert exit.value.code == 0
    printed = capsys.readouterr().out
    flags = ["--epochs", "--batch-size", "--lr", "--data-dir", "--device", "--seed", "--synthetic",
             "--train-size", "--test-size", "--json", "--save", "--profile"]
    if script != "baseline.py":
        flags.append("--compile")
    if script not in ("baseline.py", "opt1.py"):
        flags += ["--accum-steps", "--label-smoothing"]
    if script in ("opt5.py", "opt6.py"):
        flags += ["--min-size", "--monitor-size"]
    for flag in flags:
        assert flag in printed
    help_texts = printed.split("options:")[1].split("\n  -")[2:]  # skip -h
    assert all("default" in text for text in help_texts), help_texts


def test_settings_line_shows_zero_and_off_values(capsys):
    args = SimpleNamespace(seed=0, label_smoothing=0.0, compile=False, json=None)
    common.print_settings("opt2.py", CPU, args)
    assert capsys.readouterr().out == "opt2.py on cpu: seed 0, label_smoothing 0.0, compile False\n"


class CountingLoss(nn.CrossEntropyLoss):
    """The scripts' training loss, noting each call's loss, correct count and images in `calls` (evaluate() computes
    its loss with F.cross_entropy: only training is noted)."""
    calls = []

    def forward(self, outputs, labels):
        loss = super().forward(outputs, labels)
        CountingLoss.calls.append((loss.item(), (outputs.argmax(1) == labels).sum().item(), len(labels)))
        return loss


EPOCH_LINE = re.compile(r"^epoch (\d+): train(?: \(\d+x\d+\))? loss ([\d.]+) acc ([\d.]+)%", re.M)


@pytest.mark.parametrize("script", ALL_SCRIPTS)
def test_each_epochs_line_and_row_hold_that_epochs_own_loss_accuracy_and_images(script, tmp_path, monkeypatch,
                                                                                 capsys):
    """What a run reports for epoch k is the mean loss, the share correct and the count of the images trained on in
    epoch k alone: a tally carried over from an earlier epoch (plan.correct not zeroed, say) fails it."""
    module, calls, epoch_starts = ALL_SCRIPTS[script], [], []
    train_one_epoch = module.train_one_epoch

    def noting_where_the_epoch_starts(*args, **kwargs):
        epoch_starts.append(len(calls))
        return train_one_epoch(*args, **kwargs)

    monkeypatch.setattr(CountingLoss, "calls", calls)
    monkeypatch.setattr(nn, "CrossEntropyLoss", CountingLoss)
    monkeypatch.setattr(module, "train_one_epoch", noting_where_the_epoch_starts)
    flags = {"baseline.py": [], "opt2.py": ["--no-compile", "--workers", "0"]}.get(script, ["--no-compile"])
    json_path = tmp_path / "row.json"
    monkeypatch.setattr(sys, "argv", [script, *SMALL, *flags, "--epochs", "2", "--train-size", "96", "--batch-size",
                                      "16", "--test-size", "32", "--json", str(json_path)])
    module.main()
    printed = [(float(loss), float(accuracy)) for _, loss, accuracy in EPOCH_LINE.findall(capsys.readouterr().out)]
    epochs = read_json(json_path)["epochs"]
    assert len(printed) == len(epochs) == len(epoch_starts) == 2
    for epoch, start, end, (printed_loss, printed_accuracy) in zip(epochs, epoch_starts, [*epoch_starts[1:], None],
                                                                   printed):
        losses, correct, images = zip(*calls[start:end])
        assert epoch["images"] == sum(images) == 96
        assert epoch["train_loss"] == pytest.approx(sum(losses) / len(losses), rel=1e-5)  # full batches: a plain mean
        assert epoch["train_accuracy"] == sum(correct) / sum(images)
        assert printed_loss == pytest.approx(epoch["train_loss"], abs=5.1e-5)  # printed to 4 places
        assert printed_accuracy == pytest.approx(100 * epoch["train_accuracy"], abs=5.1e-3)


# ----------------------------------------------------------------------------------- bad input

@pytest.mark.parametrize("args, says", [
    (["--epochs", "0"], "--epochs: must be a positive integer"),
    (["--batch-size", "0"], "--batch-size: must be a positive integer"),
    (["--lr", "-0.1"], "--lr: must be a positive number"),
    (["--lr", "nan"], "--lr: must be a positive number"),
    (["--device", "tpu"], "--device: invalid choice"),
    (["--unknown-flag"], "unrecognized arguments: --unknown-flag"),
    (["--train-size", "60000", "--synthetic"], "--train-size 60000 is larger than the 50000 train images"),
    (["--train-size", "10", "--synthetic"], "smaller than one optimizer step"),
    (["--data-dir", "{empty}"], "the download failed"),
])
def test_bad_input_exits_2_with_one_line(args, says, tmp_path):
    args = [arg.replace("{empty}", str(tmp_path)) for arg in args]
    result = run_python("baseline.py", "--device", "cpu", *args)
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr, result.stderr
    assert result.stderr.startswith("error: ") and says in result.stderr


@pytest.mark.parametrize("args, says", [
    (["--workers", "-1"], "--workers: must be 0 or more"),
    (["--label-smoothing", "1"], "--label-smoothing: must be at least 0 and below 1"),
    (["--accum-steps", "0"], "--accum-steps: must be a positive integer"),
])
def test_opt2_flags_are_checked_too(args, says, monkeypatch, capsys):
    assert parsing_exits_2(opt2, args, monkeypatch, capsys).count(says) == 1


def parsing_exits_2(module, args, monkeypatch, capsys):
    """What `module`'s parser writes to stderr, in this process, as it exits with code 2 on `args`."""
    monkeypatch.setattr(sys, "argv", [Path(module.__file__).name, *args])
    with pytest.raises(SystemExit) as exit:
        module.parse_args()
    assert exit.value.code == 2
    return capsys.readouterr().err


@pytest.mark.parametrize("script", ["opt5.py", "opt6.py"])
def test_ns_steps_must_be_a_positive_integer(script, monkeypatch, capsys):
    stderr = parsing_exits_2(ALL_SCRIPTS[script], ["--ns-steps", "0"], monkeypatch, capsys)
    assert stderr.count("\n") == 1 and "--ns-steps: must be a positive integer" in stderr, stderr


def test_missing_data_message_says_where_and_what_to_do(tmp_path):
    result = run_python("opt2.py", "--data-dir", tmp_path / "nowhere", "--device", "cpu")
    assert result.returncode == 2
    assert str(tmp_path / "nowhere") in result.stderr and "--synthetic" in result.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_asked_for_without_a_gpu_exits_2():
    result = run_python("opt1.py", "--device", "cuda", "--synthetic")
    assert result.returncode == 2 and "torch sees no CUDA GPU; use --device cpu" in result.stderr


def test_accum_steps_must_fit_in_the_training_set():
    result = run_python("opt2.py", *SMALL, "--train-size", "64", "--batch-size", "32", "--accum-steps", "3")
    assert result.returncode == 2 and "(96 images)" in result.stderr


def test_too_few_optimizer_steps_for_onecycle_exit_2():
    result = run_python("opt2.py", *SMALL, "--train-size", "64", "--batch-size", "32", "--epochs", "2")
    assert result.returncode == 2 and "too few for OneCycleLR" in result.stderr, result.stderr


@pytest.mark.parametrize("script, flags", [("baseline.py", []), ("opt1.py", ["--no-compile"]),
                                           ("opt2.py", ["--no-compile", "--workers", "0"])])
def test_every_training_step_gets_a_full_batch(script, flags, tmp_path):
    json_path = tmp_path / "result.json"
    result = run_python(script, *SMALL, *flags, "--epochs", 1, "--train-size", 6 * 4 + 1, "--batch-size", 4,
                        "--test-size", 8, "--json", json_path)
    assert result.returncode == 0, result.stderr
    epoch = read_json(json_path)["epochs"][0]
    assert (epoch["steps"], epoch["images"]) == (6, 24), "the last image alone must not make a step"


class NaNModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(1))

    def forward(self, images):
        return self.weight * torch.full((len(images), 10), float("nan"))


@pytest.mark.parametrize("script", ALL_SCRIPTS)
def test_a_non_finite_loss_stops_the_run_naming_epoch_and_step(script, capsys):
    model = NaNModel()
    images, labels = torch.randint(0, 256, (8, 3, 32, 32), dtype=torch.uint8), torch.zeros(8, dtype=torch.long)
    loader = DataLoader(TensorDataset(images.float(), labels), batch_size=4)
    optimizer = shipped_optimizer(script, model)
    scheduler = constant_schedule(optimizer)
    with pytest.raises(SystemExit) as exit_info:
        call(ALL_SCRIPTS[script].train_one_epoch, model=model, loader=loader, train_data=(images, labels),
             criterion=nn.CrossEntropyLoss(), optimizer=optimizer, scheduler=scheduler,
             scaler=torch.amp.GradScaler("cpu", enabled=False), amp_dtype=CPU_AMP_DTYPE, accum_steps=1,
             keep_gradients=False, batch_size=4, generator=torch.Generator().manual_seed(0),
             augment_generator=torch.Generator().manual_seed(1), rank=0, world_size=1, device=CPU, epoch=3,
             monitor=NO_MONITOR, size=32)
    assert exit_info.value.code == 1
    assert "loss is nan at epoch 3, step 1" in capsys.readouterr().err
    if script not in ("opt3.py", *WHOLE_STEP):  # opt3 on read their losses once per epoch, after the steps
        assert model.weight.item() == 1.0, "the bad step must not reach the weights"


def test_real_cifar10_path_reads_torchvision_layout(tmp_path, monkeypatch):
    first_image = write_tiny_cifar10(tmp_path)
    args = SimpleNamespace(synthetic=False, data_dir=str(tmp_path), train_size=None, test_size=None)
    # Read as torchvision reads them (our files are not the official bytes: its md5 check, skipped here, would fail)
    monkeypatch.setattr(torchvision.datasets.CIFAR10, "_check_integrity", lambda self: True)
    monkeypatch.setattr(torchvision.datasets.cifar, "check_integrity", lambda path, md5=None: os.path.isfile(path))
    theirs = torchvision.datasets.CIFAR10(str(tmp_path), train=True)
    train_set, test_set = common.load_data(args, common.plain_transform(), common.plain_transform())
    assert (len(train_set), len(test_set)) == (100, 30)
    assert np.array_equal(train_set.data, theirs.data) and train_set.targets == theirs.targets
    image, _ = train_set[0]
    assert torch.equal((image * 255).round().to(torch.uint8), torch.from_numpy(first_image))

    json_path = tmp_path / "result.json"
    monkeypatch.setattr(sys, "argv", ["baseline.py", "--data-dir", str(tmp_path), "--device", "cpu",
                                      "--epochs", "1", "--batch-size", "16", "--json", str(json_path)])
    baseline.main()
    report = read_json(json_path)
    assert report["data"] == "cifar10" and report["epochs"][0]["images"] == 6 * 16
    # the run counts nothing about itself; the lab adds where its code and data came from (lab/test_accounting.py)
    assert not {"commit", "data_fingerprint", "training_flops", "modelled_h200_seconds"} & report.keys()


def test_a_cifar10_batch_that_does_not_unpickle_exits_2_with_one_line(tmp_path):
    write_tiny_cifar10(tmp_path)
    (tmp_path / "cifar-10-batches-py" / "test_batch").write_bytes(b"not a pickle")
    result = run_python("opt4.py", "--data-dir", tmp_path, "--device", "cpu", "--epochs", "1")
    assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr
    assert "test_batch is not a CIFAR-10 batch" in result.stderr and "to download it again" in result.stderr


@pytest.mark.parametrize("content", [{"labels": [0]}, [1, 2], np.arange(3),
                                     {"data": np.zeros((2, 10), np.uint8), "labels": [0, 1]}],
                         ids=["a dict without data", "a list", "an array", "images of 10 bytes"])
def test_a_pickle_that_is_not_a_cifar10_batch_exits_2_with_one_line(content, tmp_path, capsys):
    write_tiny_cifar10(tmp_path)
    folder = tmp_path / "cifar-10-batches-py"
    (folder / "test_batch").write_bytes(pickle.dumps(content))
    with pytest.raises(SystemExit) as ended:
        common.read_cifar10(folder, ["data_batch_1", "test_batch"], transform=None)
    stderr = capsys.readouterr().err
    assert ended.value.code == 2 and stderr.count("\n") == 1, stderr
    assert "test_batch is not a CIFAR-10 batch" in stderr and "to download it again" in stderr


# ---------------------------------------------------------------------------- timing and model

def test_clock_measures_a_known_sleep():
    start = common.now(CPU)
    time.sleep(0.2)
    # A sleep never ends early; a busy machine may end it late, but not by seconds.
    assert 0.2 <= common.now(CPU) - start < 2.0


def test_clock_waits_for_the_gpu_before_reading_the_time(monkeypatch):
    events = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: events.append(("synchronize", device)))
    monkeypatch.setattr(common.time, "perf_counter", lambda: events.append(("clock", None)) or 1.0)
    gpu = torch.device("cuda", 0)
    assert common.now(gpu) == 1.0
    assert events == [("synchronize", gpu), ("clock", None)]
    events.clear()
    common.now(CPU)
    assert events == [("clock", None)], "the CPU has nothing to wait for"


def test_progress_prints_a_line_every_30_seconds_of_a_long_epoch(capsys):
    seconds = iter([0, 10, 20, 31, 40, 62])  # the monitor's clock: at the start, then at each step
    with common.step_monitor(2, None, CPU, clock=lambda: next(seconds)) as monitor:
        for _ in range(5):
            monitor.step()
    assert capsys.readouterr().out == "  epoch 2: 3 steps in 31 s\n  epoch 2: 5 steps in 62 s\n"


def test_progress_is_silent_in_a_short_epoch(capsys):
    with common.step_monitor(1, None, CPU) as monitor:
        for _ in range(100):
            monitor.step()
    assert capsys.readouterr().out == ""


def test_steady_state_excludes_the_first_epoch():
    def record(seconds, images=1000, steps=10):
        return {"train_seconds": seconds, "images": images, "steps": steps, "test_accuracy": 0.5,
                "launch_seconds": 9.0}

    records = [record(100.0), record(10.0), record(10.0)]
    summary = common.summarize(records, total_seconds=125.0, peak_memory=1)
    assert summary["steady_images_per_second"] == pytest.approx(100.0)
    assert summary["steady_ms_per_step"] == pytest.approx(1000.0)
    assert summary["warmup_seconds"] == pytest.approx(90.0)
    no_slower = common.summarize([record(10.0), record(10.5)], total_seconds=25.0, peak_memory=1)
    assert no_slower["warmup_seconds"] == 0.0, "machine noise must not show as negative warm-up"
    one_epoch = common.summarize(records[:1], total_seconds=100.0, peak_memory=1)
    assert one_epoch["steady_images_per_second"] is None and one_epoch["warmup_seconds"] is None


def test_common_imports_without_resource_and_then_leaves_peak_memory_unmeasured():
    # Windows has no `resource` module: the scripts must still import and run, with peak memory "not measured".
    code = "import sys; sys.modules['resource'] = None; import common, torch; " \
           "print(common.peak_memory_bytes(torch.device('cpu')))"
    result = run_python("-c", code)
    assert result.returncode == 0 and result.stdout.strip() == "None", result.stderr


@pytest.mark.parametrize("platform, unit", [("linux", 1024), ("darwin", 1)])
def test_peak_memory_reads_kib_on_linux_and_bytes_on_macos(platform, unit, monkeypatch):
    monkeypatch.setattr(sys, "platform", platform)
    monkeypatch.setattr(common.resource, "getrusage", lambda who: SimpleNamespace(ru_maxrss=5000))
    assert common.peak_memory_bytes(CPU) == 5000 * unit


def test_the_report_gives_the_last_optimizers_rate_and_counts_no_work_of_its_own(capsys):
    # opt5 on: run.optimizers, Muon's then AdamW's (or AdamW's alone); before opt4: run.optimizer
    model = small_net()
    filters, others = [p for p in model.parameters() if p.ndim == 4], [p for p in model.parameters() if p.ndim != 4]
    muon, adamw = opt5.Muon(filters, torch.tensor(0.004), dtype=torch.float32, steps=3), opt5.adamw(others, 0.002, CPU)

    def reported(**optimizers):
        records = []
        for size in (16, 32):
            common.record_epoch(records, (1.0, 0.5, 4, 128), (1.0, 0.5), 2.0, image_size=size, test_images=64)
        run = SimpleNamespace(args=SimpleNamespace(json=None), device=CPU, **optimizers)
        return common.report("opt5.py", run, records, 4.0), records

    (summary, _), (as_opt3, _) = reported(optimizers=[muon, adamw]), reported(optimizer=adamw)
    assert summary["final_lr"] == as_opt3["final_lr"] == pytest.approx(0.002)
    assert not {"training_flops", "modelled_h200_seconds", "achieved_tflops", "commit"} & summary.keys()


def test_validation_holds_out_the_last_training_images_in_the_test_sets_place(tmp_path, monkeypatch, capsys):
    write_tiny_cifar10(tmp_path)  # 100 training images, 30 test
    args = SimpleNamespace(synthetic=False, data_dir=str(tmp_path), train_size=None, test_size=None, validation=0)
    every_image, _ = common.load_data(args, None, None)
    args.validation, args.train_size = 40, 50
    train_set, validation_set = common.load_data(args, None, common.plain_transform)
    assert "scoring on the last 40 training images" in capsys.readouterr().out
    assert np.array_equal(validation_set.data, every_image.data[-40:]) and len(train_set) == 50
    assert validation_set.targets == every_image.targets[-40:] and validation_set.transform is common.plain_transform
    assert np.array_equal(train_set.data, every_image.data[:50])
    args.validation = 100
    with pytest.raises(SystemExit) as exit_info:
        common.load_data(args, None, None)
    assert exit_info.value.code == 2 and "--validation 100 leaves no training images" in capsys.readouterr().err


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
    result = run_python("baseline.py", *SMALL, "--epochs", 1, "--train-size", 6 * 8, "--batch-size", 8,
                        "--test-size", 8, "--profile", tmp_path / "trace")
    assert result.returncode == 0, result.stderr
    assert list((tmp_path / "trace").glob("*.pt.trace.json"))
