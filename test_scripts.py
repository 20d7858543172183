"""Tests for the fast-cifar scripts. CPU only, tiny data, no network: `python -m pytest -q`."""
import ast
import collections
import contextlib
import functools
import hashlib
import importlib.util
import inspect
import io
import json
import os
import pickle
import re
import shlex
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import time
import warnings
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn as nn
import torchvision
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parent / "tools"))  # plot.py, ablation.py: the tools
import ablation  # noqa: E402
import accounting  # noqa: E402
import baseline  # noqa: E402
import benchmark  # noqa: E402
import common  # noqa: E402
import machine  # noqa: E402
import opt1  # noqa: E402
import opt2  # noqa: E402
import opt3  # noqa: E402
import opt4  # noqa: E402
import opt5  # noqa: E402
import opt6  # noqa: E402
import plot  # noqa: E402

ROOT = Path(__file__).resolve().parent
SCRIPTS = {"baseline.py": baseline, "opt1.py": opt1, "opt2.py": opt2, "opt3.py": opt3, "opt4.py": opt4}
ALL_SCRIPTS = {**SCRIPTS, "opt5.py": opt5, "opt6.py": opt6}
WHOLE_STEP = ("opt4.py", "opt5.py", "opt6.py")  # opt4 onwards: the training step as one function
CPU = torch.device("cpu")
# Point downloads at a closed local port, so "no network" fails at once on any machine.
NO_NETWORK = {"http_proxy": "http://127.0.0.1:9", "https_proxy": "http://127.0.0.1:9"}
SMALL = ["--synthetic", "--device", "cpu", "--test-size", "256"]
NO_MONITOR = SimpleNamespace(step=lambda: None)  # what common.step_monitor yields, minus progress and profiling
# What opt1 onwards run on this machine's CPU: bfloat16 where it has a bfloat16 unit, else float32.
CPU_AMP_DTYPE = opt1.autocast_dtype(CPU)[0]


@pytest.fixture(autouse=True)
def cudnn_settings_restored():
    """A script's main() run in this process turns cuDNN's autotuner on for the whole process: off again after each
    test, so a test that compares two runs on a GPU gets the same convolution algorithms in both."""
    saved = torch.backends.cudnn.benchmark, torch.backends.cudnn.deterministic
    yield
    torch.backends.cudnn.benchmark, torch.backends.cudnn.deterministic = saved


def run_script(*args, timeout=600, env=None):
    """Run `python args...` in a fresh process, offline, with `env` added to the environment; returns the
    CompletedProcess."""
    env = {**os.environ, **NO_NETWORK, **(env or {})}
    return subprocess.run([sys.executable, *map(str, args)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


def call(function, **available):
    """Call a script's function with the arguments its signature names (they differ along the chain).

    `run`, the object main() gathers what the functions need in, is made of everything `available`, with
    `batch_size` and `accum_steps` as its settings (run.args); opt6 runs as one process unless told otherwise. From
    opt5 on the run holds a list of optimizers (run.optimizers): `optimizer` may be one optimizer or that list.
    """
    args = SimpleNamespace(batch_size=available.get("batch_size"), accum_steps=available.get("accum_steps"))
    module = sys.modules[function.__module__]
    if takes_optimizers(module) and "optimizer" in available:
        optimizer = available.pop("optimizer")
        available.setdefault("optimizers", optimizer if isinstance(optimizer, list) else [optimizer])
    available["run"] = SimpleNamespace(args=args, **{"rank": 0, "world_size": 1, "crop_padding": common.CROP_PADDING,
                                                     **available})
    if hasattr(module, "normalize") and "statistics" not in available:
        available["run"].statistics = common.cifar10_statistics(available.get("device", CPU))
    if hasattr(module, "make_train_step") and "train_data" in available:
        assemble_the_step(module, available["run"], epochs=available.get("epoch", 1))
    names = inspect.signature(function).parameters
    return function(**{name: available[name] for name in names})


def takes_optimizers(module):
    """Whether `module`'s run holds a list of optimizers, run.optimizers (opt4 on; opt5 on: Muon's and AdamW's)."""
    return "optimizers" in inspect.signature(getattr(module, "optimizer_step", lambda optimizer: None)).parameters


def optimizers_of(run):
    """The optimizers a run steps: run.optimizers (opt5 on), or run.optimizer alone."""
    return getattr(run, "optimizers", None) or [run.optimizer]


def assemble_the_step(module, run, epochs):
    """What main() adds to `run` for opt4's whole step (opt4 onwards), uncaptured: the plan's buffers for
    run.train_data, a constant schedule (the last optimizer's rate) for `epochs` epochs, and the step (opt5 on: one
    for each image size, all of them over the one plan)."""
    run.criterion = getattr(run, "criterion", None) or nn.CrossEntropyLoss()
    steps = len(run.train_data[1]) // (run.args.batch_size * run.world_size) // run.args.accum_steps
    rate = optimizers_of(run)[-1].param_groups[0]["lr"]  # a tensor from opt4 on: read without a host read
    run.schedule = rate.repeat(steps * epochs)
    run.plan = module.empty_plan(run.train_data, run.statistics, run.crop_padding, steps, run.args.batch_size,
                                 run.args.accum_steps)
    step = module.make_train_step(run.model, run.criterion, optimizers_of(run), run.plan,
                                  getattr(run, "amp_dtype", torch.float32), getattr(run, "scaler", None))
    if "size" in inspect.signature(module.micro_batch_loss).parameters:  # opt5 onwards: a step per image size
        run.train_steps = {size: functools.partial(step, size) for size in (8, 16, 24, 32)}
    else:
        run.train_step = step


def plan_the_epoch(module, run, image_count, epoch):
    """What train_one_epoch does before an epoch's steps (opt4 on): the epoch drawn (in opt6, each rank's share of it)
    into run.plan, with the epoch's rows of run.schedule."""
    world_size, batch_size = getattr(run, "world_size", 1), run.args.batch_size
    draw = module.draw_epoch(image_count, batch_size * world_size, run.crop_padding, run.generator,
                             run.args.accum_steps)
    if hasattr(module, "rank_share"):
        draw = module.rank_share(draw, getattr(run, "rank", 0), batch_size)
    steps = len(run.plan.rates)
    module.plan_epoch(run.plan, draw, run.schedule[(epoch - 1) * steps:epoch * steps])


def script_evaluate(module, model, dataset):
    """A script's own evaluate() on `dataset`, fed the way that script feeds it, in the precision it picks here."""
    loader = DataLoader(dataset, batch_size=64)
    test_data = opt4.load_to_device(dataset, CPU)
    return call(module.evaluate, model=model, loader=loader, test_data=test_data, batch_size=64,
                amp_dtype=CPU_AMP_DTYPE, device=CPU, size=32, statistics=common.cifar10_statistics(CPU))


def read_json(path):
    lines = Path(path).read_text().splitlines()
    assert len(lines) == 1
    return json.loads(lines[0])


# ------------------------------------------------------------------------- end to end, per script

# Each script's short run that must learn on synthetic data, shared by the CPU test (CI runs it) and the cuda test:
# 2 epochs with the steps each script needs (the recipe's batch of 512 would get 1 step an epoch of 512 images),
# so a change of defaults that would starve a script fails on the CPU too.
LEARN_ARGS = {
    "baseline.py": ["--batch-size", "32", "--train-size", "512"],
    "opt1.py": ["--batch-size", "32", "--train-size", "512", "--no-compile"],
    "opt2.py": ["--batch-size", "32", "--train-size", "512", "--workers", "2", "--no-compile"],
    # opt3 onwards at their defaults: uncompiled; opt5 and opt6 16x16, then 32x32
    "opt3.py": ["--batch-size", "16", "--train-size", "512"],
    "opt4.py": ["--batch-size", "16", "--train-size", "512"],
    "opt5.py": ["--batch-size", "16", "--train-size", "512"],
    "opt6.py": ["--batch-size", "16", "--train-size", "512"],
}
EVAL_TRANSFORM = {"baseline.py": common.plain_transform, "opt1.py": common.plain_transform,
                  "opt2.py": common.normalized_transform, "opt3.py": None, "opt4.py": None, "opt5.py": None, "opt6.py": None}
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
    result = run_script(script, *SMALL, "--epochs", 2, *LEARN_ARGS[script],
                        "--json", json_path, "--save", weights)
    assert result.returncode == 0, result.stderr
    assert "says nothing about CIFAR-10" in result.stdout
    assert "epoch 1:" in result.stdout and "(includes compile/warm-up)" in result.stdout
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


def assert_saved_weights_match_the_report(weights, report, module, transform):
    """The saved state_dict loads into a fresh ResNet10 and scores what the run reported for its last epoch."""
    model = common.ResNet10()
    model.load_state_dict(torch.load(weights))  # strict: fails on an `_orig_mod.` prefix
    test_set = common.synthetic_cifar10(256, train=False, transform=transform and transform())
    loss, accuracy = script_evaluate(module, model, test_set)
    # Accuracy reaches 100 % early on this data; the test loss still moves every epoch, so it names the epoch.
    first_loss, last_loss = report["epochs"][0]["test_loss"], report["epochs"][-1]["test_loss"]
    assert loss == pytest.approx(last_loss, rel=0.03)
    assert first_loss != pytest.approx(last_loss, rel=0.03), "the comparison must be able to tell the epochs apart"
    assert accuracy == pytest.approx(report["final_test_accuracy"], abs=0.01)


@pytest.mark.parametrize("script", ALL_SCRIPTS)
def test_help_documents_every_flag_with_its_default(script):
    result = run_script(script, "--help")
    assert result.returncode == 0
    flags = ["--epochs", "--batch-size", "--lr", "--data-dir", "--device", "--seed", "--synthetic",
             "--train-size", "--test-size", "--json", "--save", "--profile"]
    if script != "baseline.py":
        flags.append("--compile")
    if script not in ("baseline.py", "opt1.py"):
        flags += ["--accum-steps", "--label-smoothing"]
    if script in ("opt5.py", "opt6.py"):
        flags += ["--min-size", "--monitor-size"]
    for flag in flags:
        assert flag in result.stdout
    help_texts = result.stdout.split("options:")[1].split("\n  -")[2:]  # skip -h
    assert all("default" in text for text in help_texts), help_texts


@pytest.mark.parametrize("module", [*ALL_SCRIPTS.values(), common, machine, accounting],
                         ids=[*ALL_SCRIPTS, "common.py", "machine.py", "tools/accounting.py"])
def test_no_function_takes_more_than_six_parameters(module):
    # Settings reach train_one_epoch and evaluate as one object, `run`: a signature names what the function works on.
    functions = [value for value in vars(module).values()
                 if inspect.isfunction(value) and value.__module__ == module.__name__]
    parameters = {function.__name__: len(inspect.signature(function).parameters) for function in functions}
    assert "train_one_epoch" in parameters or module in (common, machine, accounting)
    assert {name: count for name, count in parameters.items() if count > 6} == {}


def project_imports(path):
    """The top-level modules `path` imports, by the first part of each name."""
    tree = ast.parse(path.read_text())
    return {(node.module if isinstance(node, ast.ImportFrom) else alias.name).split(".")[0]
            for node in ast.walk(tree) if isinstance(node, (ast.Import, ast.ImportFrom))
            for alias in node.names}


@pytest.mark.parametrize("script", ALL_SCRIPTS)
def test_a_chain_script_imports_the_standard_library_torch_torchvision_and_common_alone(script):
    # A learner opens the script and common.py, nothing else: what the script teaches is in it
    imported = project_imports(ROOT / script) - set(sys.stdlib_module_names)
    assert imported <= {"torch", "torchvision", "common"}, imported
    assert "common" in imported


def test_common_calls_machine_which_imports_nothing_of_the_project_and_no_tool_is_imported_by_the_run():
    modules = {path.stem for path in ROOT.glob("*.py")} | {path.stem for path in (ROOT / "tools").glob("*.py")}
    assert project_imports(ROOT / "machine.py") & modules == set(), "machine.py: verdicts only, no circular import"
    assert project_imports(ROOT / "common.py") & modules == {"machine"}
    # tools/ and benchmark.py import the scripts, never the reverse
    assert "accounting" in project_imports(ROOT / "benchmark.py")
    for tool in ("plot", "ablation", "warm_clock"):
        assert "accounting" in project_imports(ROOT / "tools" / f"{tool}.py"), tool


def test_opt6_holds_torchruns_start_the_download_turns_ddps_keyword_and_the_exit_each_tagged_where_it_happens():
    tagged = [code for tag, code in tagged_lines("opt6.py") if tag.startswith("# opt6:")]
    for name in ("started_by_torchrun()", "point_to_torchrun(", "rank_zero_first(", "broadcast_buffers_keyword()",
                 "leave_process_group()"):
        assert any(name in code for code in tagged), f"{name} is not called on a line tagged # opt6:"
        assert f"def {name.split('(')[0]}(" in (ROOT / "opt6.py").read_text()


TAG = re.compile(r"# (opt\d): (.+)$")


def tagged_lines(script):
    """[(tag, the code line it marks)] of `script`: an inline `# optN:` tag marks its own line, one on a line of its own
    the next line of code (several above one line all mark it)."""
    pairs, waiting = [], []
    for line in (ROOT / script).read_text().splitlines():
        code, _, comment = line.partition("# ") if line.strip().startswith("#") else line.partition("  # ")
        if match := TAG.match("# " + comment):
            waiting.append(match[0])
        if code.strip():
            pairs += [(tag, code.strip()) for tag in waiting]
            waiting = []
    return pairs


@pytest.mark.parametrize("script", ALL_SCRIPTS)
def test_a_script_tags_only_its_own_and_earlier_lessons(script):
    number = list(ALL_SCRIPTS).index(script)  # baseline 0, opt1 1, ...
    assert tagged_lines(script) or script == "baseline.py"
    assert [tag for tag, _ in tagged_lines(script) if int(tag[5]) > number] == []


@pytest.mark.parametrize("earlier, later", list(zip(list(ALL_SCRIPTS)[1:], list(ALL_SCRIPTS)[2:])))
def test_a_later_script_keeps_an_earlier_tag_word_for_word_on_a_line_it_keeps(earlier, later):
    # A line kept (as often: a line that appears once in each) keeps its tags, or carries the later script's own
    # tag instead, where its reason changed there (opt5's padded evaluation batch)
    later_pairs = tagged_lines(later)
    later_lines, earlier_lines = (collections.Counter(line.partition("  # ")[0].strip() for line in
                                                      (ROOT / script).read_text().splitlines())
                                  for script in (later, earlier))
    dropped = []
    for tag, code in tagged_lines(earlier):
        tags_there = {later_tag for later_tag, later_code in later_pairs if later_code == code}
        own = {later_tag for later_tag in tags_there if later_tag[:6] == f"# {Path(later).stem}"}
        if later_lines[code] >= earlier_lines[code] > 0 and tag not in tags_there and not own:
            dropped.append((tag, code))
    assert dropped == []


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


@pytest.mark.parametrize("script", ["opt5.py", "opt6.py"])
def test_ns_steps_must_be_a_positive_integer(script):
    result = run_script(script, "--ns-steps", "0")
    assert result.returncode == 2 and result.stderr.count("\n") == 1
    assert "--ns-steps: must be a positive integer" in result.stderr, result.stderr


def test_missing_data_message_says_where_and_what_to_do(tmp_path):
    result = run_script("opt2.py", "--data-dir", tmp_path / "nowhere", "--device", "cpu")
    assert result.returncode == 2
    assert str(tmp_path / "nowhere") in result.stderr and "--synthetic" in result.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_asked_for_without_a_gpu_exits_2():
    result = run_script("opt1.py", "--device", "cuda", "--synthetic")
    assert result.returncode == 2 and "torch sees no CUDA GPU; use --device cpu" in result.stderr


# ------------------------------------------------- the user's machine: one line for each setup the scripts can't use
# Each setup is made on this CPU by replacing torch's view of the machine in the script's own process, then running
# the script: FAKE_MACHINE's `patches` run first. The data directory is empty and there is no network, so a verdict
# that came after loading the data would read "CIFAR-10 is not in ..." instead.

FAKE_MACHINE = """
import runpy, sys, warnings
import torch, torchvision  # torchvision first: on import it checks that its CUDA version is torch's
{patches}
sys.argv = {argv!r}
runpy.run_path({script!r}, run_name="__main__")
"""
# What torch 2.14's c10 warns, once, when cudaGetDeviceCount fails on an old driver (then is_available() is False)
OLD_DRIVER = """
def is_available():
    warnings.warn("CUDA initialization: The NVIDIA driver on your system is too old (found version 12040). Please "
                  "update your GPU driver by downloading and installing a new version from the URL: "
                  "http://www.nvidia.com/Download/index.aspx Alternatively, go to: https://pytorch.org to install a "
                  "PyTorch version that has been compiled with your version of the CUDA driver.")
    return False
torch.cuda.is_available, torch.version.cuda = is_available, "13.0"
"""
CPU_ONLY_BUILD = """
torch.cuda.is_available, torch.version.cuda, torch.version.hip = lambda: False, None, None
"""
# A GPU that torch sees: {name}, sm_{capability}, {count} of them, and a CUDA 13.0 build's architectures
VISIBLE_GPU = """
torch.version.cuda = "13.0"
torch.cuda.is_available = lambda: True
torch.cuda.device_count = lambda: {count}
torch.cuda.get_device_capability = lambda index=None: ({capability} // 10, {capability} % 10)
torch.cuda.get_device_name = lambda index=None: {name!r}
torch.cuda.get_arch_list = lambda: ["sm_75", "sm_80", "sm_86", "sm_90", "sm_100", "sm_120"]
torch.cuda.is_bf16_supported = lambda including_emulation=True: including_emulation or {capability} >= 80
"""
NO_DATA = ["--data-dir", "no-such-folder", "--epochs", "1", "--train-size", "64", "--test-size", "64",
           "--batch-size", "32"]


def run_on_fake_machine(patches, script, *args, env=None):
    code = FAKE_MACHINE.format(patches=patches, argv=[script, *map(str, args)], script=script)
    return run_script("-c", code, env=env, timeout=300)


def assert_one_error_line(result, *says):
    assert result.returncode == 2, result.stderr
    assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr, result.stderr
    assert all(words in result.stderr for words in says), result.stderr
    assert "CIFAR-10 is not in" not in result.stderr, "the verdict must come before the data"


@pytest.mark.floor
def test_a_torch_older_than_the_floor_exits_2_with_one_line_and_the_floor_is_requirements_txts():
    result = run_on_fake_machine('torch.__version__ = "2.4.1+cu121"', "opt2.py", *NO_DATA)
    assert_one_error_line(result, "torch 2.4.1+cu121 is older than 2.6, the oldest these scripts run on")
    floor = re.search(r"^torch>=([\d.]+)$", (ROOT / "requirements.txt").read_text(), re.MULTILINE).group(1)
    assert tuple(map(int, floor.split("."))) == machine.OLDEST_TORCH


def test_a_containers_pre_release_build_of_the_floor_is_the_floor(monkeypatch):
    monkeypatch.setattr(torch, "__version__", "2.6.0a0+ecf3bae40a")  # as NVIDIA's containers name theirs
    assert machine.torch_too_old() is None


@pytest.mark.floor
def test_an_old_driver_says_a_gpu_is_there_and_both_remedies_then_trains_on_the_cpu():
    result = run_on_fake_machine(OLD_DRIVER, "opt1.py", "--synthetic", *NO_DATA, "--no-compile")
    assert result.returncode == 0, result.stderr
    first_line = result.stdout.splitlines()[0]
    assert first_line.startswith("a GPU is here, but its NVIDIA driver is too old for this torch's CUDA 13.0 "
                                 "(it runs CUDA 12.4 at most): running on the CPU"), first_line
    assert "update the driver to 580 or newer" in first_line
    assert f"pip install torch=={torch.__version__.split('+')[0]} " in first_line
    assert first_line.endswith("--index-url https://download.pytorch.org/whl/cu126")
    assert "no CUDA GPU" not in result.stdout and "opt1.py on cpu" in result.stdout


def test_an_old_driver_with_device_cuda_exits_2_with_the_remedies():
    result = run_on_fake_machine(OLD_DRIVER, "opt4.py", *NO_DATA, "--device", "cuda")
    assert_one_error_line(result, "--device cuda: a GPU is here, but its NVIDIA driver is too old",
                          "update the driver to 580 or newer", "whl/cu126, or use --device cpu")


def test_a_driver_too_old_for_a_cuda_12_build_is_told_to_update_the_driver_only(monkeypatch):
    def is_available():  # a CUDA 11.4 driver (470) under a CUDA 12.4 build, such as torch 2.6's
        warnings.warn("CUDA initialization: The NVIDIA driver on your system is too old (found version 11040).")
        return False

    monkeypatch.setattr(torch.cuda, "is_available", is_available)
    monkeypatch.setattr(torch.version, "cuda", "12.4")
    assert machine.why_no_cuda() == ("a GPU is here, but its NVIDIA driver is too old for this torch's CUDA 12.4 (it "
                                    "runs CUDA 11.4 at most)", "update the driver to 525 or newer")


def test_a_cpu_only_torch_build_says_so_and_how_to_get_a_cuda_build():
    result = run_on_fake_machine(CPU_ONLY_BUILD, "baseline.py", "--synthetic", *NO_DATA)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[0].startswith(f"this torch ({torch.__version__}) is a CPU-only build: running "
                                                    f"on the CPU (slow; the scripts target CUDA); for an NVIDIA GPU, "
                                                    f"install a CUDA build: pip install torch==")
    result = run_on_fake_machine(CPU_ONLY_BUILD, "baseline.py", *NO_DATA, "--device", "cuda")
    assert_one_error_line(result, "is a CPU-only build", "--index-url https://download.pytorch.org/whl/cu126")


def test_macos_says_it_has_no_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(sys, "platform", "darwin")
    assert machine.why_no_cuda() == ("macOS has no CUDA", None)


@pytest.mark.parametrize("script", ["baseline.py", "opt5.py"])
def test_a_gpu_the_build_has_no_kernels_for_exits_2_naming_it_and_the_remedy(script):
    patches = VISIBLE_GPU.format(count=1, capability=70, name="Tesla V100-SXM2-16GB")
    result = run_on_fake_machine(patches, script, *NO_DATA)  # --device auto: the GPU is there, so no CPU fallback
    assert_one_error_line(result, "GPU 0 (Tesla V100-SXM2-16GB) is sm_70", "has kernels for sm_75 sm_80 sm_86 sm_90 "
                          "sm_100 sm_120 only", "the CUDA 12.6 build of this torch, which has sm_50 to sm_90",
                          "--index-url https://download.pytorch.org/whl/cu126; or use --device cpu")


@pytest.mark.parametrize("capability, architectures, runs", [
    (86, ["sm_80"], True),          # a kernel for sm_80 runs on sm_86 (same major version)
    (80, ["sm_86"], False),         # but not the other way round
    (90, ["sm_80", "sm_86"], False),  # nor across major versions
    (120, ["sm_90", "compute_90"], True),  # PTX is compiled for any newer GPU
    (75, ["compute_80"], False),    # but not an older one
    (100, ["sm_90a", "sm_100a"], True),
])
def test_gpu_architecture_check_follows_cudas_compatibility_rules(capability, architectures, runs, monkeypatch):
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: divmod(capability, 10))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=None: "GPU")
    monkeypatch.setattr(torch.cuda, "get_arch_list", lambda: architectures)
    assert (machine.gpu_without_kernels() is None) == runs


def fake_compile_failure(*names):
    """An exception as inductor raises it: the first name wraps the next, down to the cause."""
    error = None
    for name in reversed(names):
        wrapper = type(name, (RuntimeError,), {})(f"{name} happened")
        wrapper.__cause__ = error
        error = wrapper
    return error


@pytest.mark.parametrize("names, says", [
    (["InductorError", "InvalidCxxCompiler"], "no C++ compiler for its CPU kernels; install g++"),
    (["BackendCompilerFailed", "TritonMissing"], "no Triton for its GPU kernels"),
    (["InductorError", "GPUTooOldForTriton"], "compute capability 7.0 (V100) and newer only"),
    (["BackendCompilerFailed", "RuntimeError"], "RuntimeError: RuntimeError happened"),
])
def test_a_failed_compile_is_named_by_its_innermost_cause(names, says, monkeypatch):
    monkeypatch.setattr(sys, "platform", "linux")
    assert says in machine.compile_failure(fake_compile_failure(*names))
    # Inductor's InductorError keeps the cause in inner_exception, not __cause__
    error = fake_compile_failure(names[0])
    error.inner_exception = fake_compile_failure(*names[1:])
    assert says in machine.compile_failure(error)


def test_a_gpu_without_triton_is_told_why_it_runs_eager_in_one_line_before_the_data(tmp_path):
    # As on Windows with a GPU: torch installs Triton with itself on Linux only
    patches = VISIBLE_GPU.format(name="NVIDIA H100", capability=90, count=1) + """
import torch.utils._triton
torch.utils._triton.has_triton_package = lambda: False
"""
    result = run_on_fake_machine(patches, "opt2.py", *NO_DATA)
    assert result.stdout.splitlines()[0] == (
        "torch.compile cannot work here: no Triton for its GPU kernels (torch installs Triton with itself on Linux "
        "only); on Windows use WSL2, elsewhere pip install triton; running eager instead (as --no-compile)")
    assert "compile False" in result.stdout.splitlines()[1], "the settings line says it runs eager"
    assert result.returncode == 2 and "CIFAR-10 is not in" in result.stderr  # the data, after the verdict


@pytest.mark.parametrize("capability, c_compiler, says", [((6, 1), True, "compute capability 7.0 (V100)"),
                                                          ((9, 0), False, "no C compiler for Triton's kernel launcher"),
                                                          ((9, 0), True, None)])
def test_inductors_needs_on_a_gpu_are_checked_without_compiling(capability, c_compiler, says, monkeypatch):
    machine.compile_problem.cache_clear()
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(sys.modules["torch.utils._triton"], "has_triton_package", lambda: True)
    monkeypatch.setattr(machine.shutil, "which", lambda name: f"/usr/bin/{name}" if c_compiler else None)
    monkeypatch.delenv("CC", raising=False)
    monkeypatch.setattr(torch, "compile", lambda *args, **kwargs: pytest.fail("a trial compile"))
    problem = machine.compile_problem(torch.device("cuda", 0))
    machine.compile_problem.cache_clear()
    assert (problem is None) if says is None else (says in problem), problem


@pytest.mark.floor
@pytest.mark.skipif(sys.platform != "linux", reason="the compiler inductor looks for is Linux's g++")
def test_a_machine_without_a_compiler_runs_eager_and_says_why_and_torch_keeps_its_cuda_home_notice_to_itself(tmp_path):
    # No compiler on the PATH, and a cache of compiled kernels of its own, so none from an earlier run is reused.
    # CUDA_HOME set on a machine without a GPU: importing torch's cpp_extension (compiling does) says so, unasked.
    env = {"PATH": str(tmp_path / "empty"), "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "cache"),
           "CUDA_HOME": str(tmp_path)}
    control = run_script("-c", "import torch.utils.cpp_extension", env=env)
    assert "No CUDA runtime is found" in control.stderr, "the noise this test is about must happen here"
    json_path = tmp_path / "result.json"
    result = run_script("opt1.py", *SMALL, "--epochs", "1", "--train-size", "64", "--batch-size", "32",
                        "--json", json_path, env=env)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[0] == (
        "torch.compile cannot work here: no C++ compiler for its CPU kernels; install g++ (Debian/Ubuntu: apt install "
        "g++); running eager instead (as --no-compile)")
    assert "No CUDA runtime is found" not in result.stdout + result.stderr
    assert "Traceback" not in result.stderr
    assert read_json(json_path)["settings"]["compile"] is False


def test_accum_steps_must_fit_in_the_training_set():
    result = run_script("opt2.py", *SMALL, "--train-size", "64", "--batch-size", "32", "--accum-steps", "3")
    assert result.returncode == 2 and "(96 images)" in result.stderr


def test_too_few_optimizer_steps_for_onecycle_exit_2():
    result = run_script("opt2.py", *SMALL, "--train-size", "64", "--batch-size", "32", "--epochs", "2")
    assert result.returncode == 2 and "too few for OneCycleLR" in result.stderr, result.stderr


@pytest.mark.parametrize("script, flags", [("baseline.py", []), ("opt1.py", ["--no-compile"]),
                                           ("opt2.py", ["--no-compile", "--workers", "0"])])
def test_every_training_step_gets_a_full_batch(script, flags, tmp_path):
    json_path = tmp_path / "result.json"
    result = run_script(script, *SMALL, *flags, "--epochs", 1, "--train-size", 6 * 4 + 1, "--batch-size", 4,
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
    # the run counts nothing about itself; benchmark.py and the tools add where its code and data came from
    assert not {"commit", "data_fingerprint", "training_flops", "modelled_h200_seconds"} & report.keys()
    md5s = [hashlib.md5((tmp_path / "cifar-10-batches-py" / name).read_bytes()).hexdigest()
            for name in [f"data_batch_{number}" for number in range(1, 6)] + ["test_batch"]]
    files = hashlib.md5("".join(md5s).encode()).hexdigest()[:12]
    assert accounting.add_provenance(report, "abc1234") == {**report, "commit": "abc1234", "data_fingerprint": files}


def test_a_cifar10_batch_that_does_not_unpickle_exits_2_with_one_line(tmp_path):
    write_tiny_cifar10(tmp_path)
    (tmp_path / "cifar-10-batches-py" / "test_batch").write_bytes(b"not a pickle")
    result = run_script("opt4.py", "--data-dir", tmp_path, "--device", "cpu", "--epochs", "1")
    assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr
    assert "test_batch is not a CIFAR-10 batch" in result.stderr and "to download it again" in result.stderr


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
    assert f"`{official}`" in (ROOT / "results/README.md").read_text()
    data = bytearray((folder / "test_batch").read_bytes())
    data[-1] ^= 1  # one bit of one file
    (folder / "test_batch").write_bytes(data)
    assert accounting.data_fingerprint(settings) not in (copy, official)
    assert accounting.data_fingerprint({"synthetic": True, "data_dir": None}) == "synthetic"
    assert accounting.data_fingerprint({"synthetic": False, "data_dir": str(tmp_path / "none")}) is None


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
def test_rows_name_the_commit_and_say_when_the_code_differs_from_it(tmp_path):
    (tmp_path / "tools").mkdir()
    for name in ("common.py", "machine.py", "tools/accounting.py"):
        (tmp_path / name).write_text((ROOT / name).read_text())
    spec = importlib.util.spec_from_file_location("copied_accounting", tmp_path / "tools" / "accounting.py")
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


def copy_without_git(folder, *names):
    """The named files of this checkout copied into `folder`, as a source archive unpacks them: no .git above."""
    for name in names:
        (folder / name).parent.mkdir(exist_ok=True)
        shutil.copy(ROOT / name, folder / name)
    # git looks no higher than `folder`, wherever the temporary folders are
    return {"GIT_CEILING_DIRECTORIES": str(folder.parent)}


def test_a_chain_script_asks_git_nothing_and_imports_no_tool(tmp_path):
    # The run is the lesson: where its code came from is the tools' business (tools/accounting.py), read once as they
    # start. A git that leaves a mark on every call shows whether --help or a run asked it anything.
    (tmp_path / "bin").mkdir()
    fake_git = tmp_path / "bin" / "git"
    fake_git.write_text(f"#!/bin/sh\ntouch {tmp_path / 'asked'}\nexit 1\n")
    fake_git.chmod(0o755)
    env = {"PATH": f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}"}
    assert run_script("opt5.py", "--help", env=env).returncode == 0
    result = run_script("-X", "importtime", "baseline.py", *SMALL, "--epochs", 1, "--train-size", 64, "--json",
                        tmp_path / "row.json", env=env)
    assert result.returncode == 0, result.stderr
    assert not (tmp_path / "asked").exists(), "a chain script ran git"
    imported = set(re.findall(r"\|\s+(\w+)$", result.stderr, flags=re.MULTILINE))
    assert {"common", "machine"} <= imported and not imported & {"accounting", "benchmark", "plot"}


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
    _, _, steps, images = call(
        opt2.train_one_epoch, model=model, loader=DataLoader(data, batch_size=batch_size),
        criterion=nn.CrossEntropyLoss(), optimizer=optimizer, scheduler=scheduler,
        scaler=torch.amp.GradScaler("cpu", enabled=False), amp_dtype=torch.float32, accum_steps=accum_steps,
        device=CPU, epoch=1, monitor=NO_MONITOR)
    return torch.nn.utils.parameters_to_vector(model.parameters()).detach(), steps, images


def test_accumulating_k_micro_batches_equals_one_big_batch(monkeypatch):
    big_batch, steps, _ = accumulated_weights(12, 1, monkeypatch)
    accumulated, accumulated_steps, images = accumulated_weights(4, 3, monkeypatch)
    assert (steps, accumulated_steps, images) == (2, 2, 24)
    assert torch.allclose(accumulated, big_batch, atol=1e-6)
    one_step, _, _ = accumulated_weights(24, 1, monkeypatch)
    assert not torch.allclose(one_step, big_batch, atol=1e-3), "the comparison must be able to fail"


def onecycle_lr_after(total_steps, max_lr, steps=None):
    """The learning rate after `steps` (default: all total_steps) steps of a OneCycleLR set up as opt2 sets it up."""
    optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=max_lr)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=max_lr, total_steps=total_steps, pct_start=0.25)
    for _ in range(total_steps if steps is None else steps):
        optimizer.step()
        scheduler.step()
    return optimizer.param_groups[0]["lr"]


@pytest.mark.parametrize("script, accum_steps", [("opt2.py", 1), ("opt2.py", 3), ("opt3.py", 3), ("opt4.py", 3),
                                                       ("opt6.py", 3)])
def test_onecycle_length_counts_optimizer_steps(script, accum_steps, tmp_path):
    json_path = tmp_path / "result.json"
    workers = ["--workers", 0] if script == "opt2.py" else []
    # 10 batches per epoch: not divisible by 3, so micro-batches and optimizer steps differ.
    result = run_script(script, *SMALL, "--epochs", 2, "--train-size", 160, "--test-size", 16, "--batch-size", 16,
                        "--accum-steps", accum_steps, "--no-compile", *workers, "--json", json_path)
    assert result.returncode == 0, result.stderr
    report = read_json(json_path)
    assert [epoch["steps"] for epoch in report["epochs"]] == [10 // accum_steps] * 2
    assert [epoch["images"] for epoch in report["epochs"]] == [10 // accum_steps * accum_steps * 16] * 2
    # The rate after the run tells how long the schedule was: counting micro-batches would leave it high.
    optimizer_steps = 2 * (10 // accum_steps)
    # opt2 reports the rate its scheduler left after the last step; opt4 onwards the rate the last step took
    last = optimizer_steps - (script in WHOLE_STEP)
    lr = report["settings"]["lr"]
    assert report["final_lr"] == pytest.approx(onecycle_lr_after(optimizer_steps, lr, steps=last), rel=1e-6)
    if accum_steps > 1:
        assert report["final_lr"] != pytest.approx(onecycle_lr_after(2 * 10, lr, steps=last))


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
    row = {"settings": {}, "epochs": [dict(record) for record in records], **summary}
    assert accounting.add_work(row)["achieved_tflops"] == pytest.approx(100.0 * accounting.training_flops_per_image()
                                                                         / 1e12)
    no_slower = common.summarize([record(10.0), record(10.5)], total_seconds=25.0, peak_memory=1)
    assert no_slower["warmup_seconds"] == 0.0, "machine noise must not show as negative warm-up"
    one_epoch = common.summarize(records[:1], total_seconds=100.0, peak_memory=1)
    assert one_epoch["steady_images_per_second"] is None and one_epoch["warmup_seconds"] is None


def test_common_imports_without_resource_and_then_leaves_peak_memory_unmeasured():
    # Windows has no `resource` module: the scripts must still import and run, with peak memory "not measured".
    code = "import sys; sys.modules['resource'] = None; import common, torch; " \
           "print(common.peak_memory_bytes(torch.device('cpu')))"
    result = run_script("-c", code)
    assert result.returncode == 0 and result.stdout.strip() == "None", result.stderr


@pytest.mark.parametrize("platform, unit", [("linux", 1024), ("darwin", 1)])
def test_peak_memory_reads_kib_on_linux_and_bytes_on_macos(platform, unit, monkeypatch):
    monkeypatch.setattr(sys, "platform", platform)
    monkeypatch.setattr(common.resource, "getrusage", lambda who: SimpleNamespace(ru_maxrss=5000))
    assert common.peak_memory_bytes(CPU) == 5000 * unit


def test_resnet10_shape_and_flop_count():
    model = common.ResNet10()
    assert sum(p.numel() for p in model.parameters()) == 4_903_242
    assert model(torch.randn(2, 3, 32, 32)).shape == (2, 10)
    # Forward is ~0.25 GMAC = 0.5 GFLOP per image; backward costs about twice the forward.
    assert 1.3e9 < accounting.training_flops_per_image() < 1.7e9


def test_each_epochs_work_is_counted_at_its_size_and_batch_and_modelled_on_an_h200():
    update = accounting.muon_update_flops(3)
    # Newton-Schulz on the 12 filters one at a time, as opt5's Muon runs it (37.1 GFLOP in 5 zero-padded batches, as
    # ablation.py's muon-other-form row runs it), results/README.md
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
    assert 7.3 < work["modelled_h200_seconds"] < 7.4  # results/README.md, "The modelled H200 time"


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


def test_a_capturable_adamw_is_built_with_torchs_warn_once_flag_set_so_its_uncaptured_steps_warn_nothing():
    # torch warns that a capturable=True optimizer "can impair ungraphed performance" only where an instance's flag is
    # unset, and its Optimizer.__init__ sets it: adamw's warm-up steps before a capture (and opt6's uncaptured steps
    # under DDP) print no warning, so the scripts filter none. A copy made by copy.deepcopy has it unset: it warned in
    # the H200 logs of a report that stepped one, which the run no longer does.
    for module in (opt4, opt5, opt6):
        optimizer = module.adamw([torch.zeros(2, requires_grad=True)], 0.01, CPU)
        assert optimizer._warned_capturable_if_run_uncaptured is True
        assert not (ROOT / module.__file__).read_text().count("filterwarnings")


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


def test_the_report_gives_the_last_optimizers_rate_and_accounting_counts_muons_update_and_time(capsys):
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

    (summary, records), (as_opt3, _) = reported(optimizers=[muon, adamw]), reported(optimizer=adamw)
    assert summary["final_lr"] == as_opt3["final_lr"] == pytest.approx(0.002)
    assert not {"training_flops", "modelled_h200_seconds", "achieved_tflops", "commit"} & summary.keys()
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
    result = run_script("baseline.py", *SMALL, "--epochs", 1, "--train-size", 6 * 8, "--batch-size", 8,
                        "--test-size", 8, "--profile", tmp_path / "trace")
    assert result.returncode == 0, result.stderr
    assert list((tmp_path / "trace").glob("*.pt.trace.json"))


# -------------------------------------------------------------------- opt4's on-device data path

@pytest.mark.parametrize("height, width", [(32, 32), (64, 48)])  # CIFAR-10's size, and a copy-paste's
def test_opt4_augment_crops_the_padded_image_at_its_offsets_and_mirrors_where_told(height, width):
    images = torch.rand(32, 3, height, width)
    pad = common.CROP_PADDING
    padded = torch.nn.functional.pad(images, (pad, pad, pad, pad), mode="reflect")
    generator = torch.Generator().manual_seed(0)
    offsets = torch.randint(0, 2 * pad + 1, (2, 32, 1), generator=generator)
    flips = torch.rand(32, 1, generator=generator) < 0.5
    augmented = opt4.augment(images, offsets, flips, pad)
    assert augmented.shape == images.shape
    for i, ((top,), (left,), (flip,)) in enumerate(zip(offsets[0].tolist(), offsets[1].tolist(), flips.tolist())):
        crop = padded[i, :, top:top + height, left:left + width]
        assert torch.equal(augmented[i], crop.flip(2) if flip else crop), f"image {i}"
    assert len({(top, left) for top, left in zip(offsets[0].flatten().tolist(), offsets[1].flatten().tolist())}) > 10


def drawn_plan(size=100, batch_size=16, epochs=2, accum_steps=1, seed=0):
    """opt4's plan for a training set of `size` images, and the run it belongs to, before any epoch is drawn."""
    args = SimpleNamespace(batch_size=batch_size, accum_steps=accum_steps)
    steps = size // batch_size // accum_steps
    train_data = torch.zeros(size, 3, 32, 32, dtype=torch.uint8), torch.zeros(size, dtype=torch.long)
    statistics = common.cifar10_statistics(CPU)
    plan = opt4.empty_plan(train_data, statistics, common.CROP_PADDING, steps, batch_size, accum_steps)
    run = SimpleNamespace(args=args, device=CPU, generator=torch.Generator().manual_seed(seed),
                          crop_padding=common.CROP_PADDING, plan=plan,
                          schedule=opt4.onecycle_schedule(0.01, steps * epochs, CPU))
    return run


def bare_plan(module, steps, batch_size):
    """`module`'s plan of `steps` steps of `batch_size` over a training set of zeros, for a test of the update alone."""
    train_data = torch.zeros(steps * batch_size, 3, 32, 32, dtype=torch.uint8), torch.zeros(steps * batch_size)
    return module.empty_plan(train_data, common.cifar10_statistics(CPU), common.CROP_PADDING, steps, batch_size)


def plan_tensors(plan):
    """The plan's tensors by name: its buffers and the data it gathers from (not its settings or its steps left)."""
    return {name: value for name, value in vars(plan).items() if torch.is_tensor(value)}


def test_opt3_each_epoch_draws_every_image_once_with_fresh_crops_and_flips():
    generator = torch.Generator().manual_seed(0)
    batches, offsets, flips = opt3.draw_epoch(96, 16, common.CROP_PADDING, generator)
    assert batches.shape == (6, 16) and sorted(batches.flatten().tolist()) == list(range(96))
    assert offsets.shape == (6, 2, 16, 1) and flips.shape == (6, 16, 1)
    assert set(offsets.flatten().tolist()) == set(range(2 * common.CROP_PADDING + 1)) and 0 < flips.float().mean() < 1
    second, second_offsets, _ = opt3.draw_epoch(100, 16, common.CROP_PADDING, generator)
    images = second.flatten().tolist()
    assert len(images) == 96 and len(set(images)) == 96 and max(images) < 100  # 4 left over, none twice
    assert not torch.equal(second, batches) and not torch.equal(second_offsets, offsets)


def test_opt4_writes_each_epochs_draw_and_its_rates_into_the_plans_buffers_at_the_same_addresses():
    run = drawn_plan(size=100, batch_size=16)
    addresses = {name: tensor.data_ptr() for name, tensor in plan_tensors(run.plan).items()}
    for epoch, image_count in ((1, 96), (2, 100)):
        run.plan.cursor.fill_(5)
        before = run.generator.get_state()
        plan_the_epoch(opt4, run, image_count, epoch)
        after = run.generator.get_state()
        run.generator.set_state(before)
        drawn = opt4.draw_epoch(image_count, 16, common.CROP_PADDING, run.generator)  # again, from the same state
        assert torch.equal(run.generator.get_state(), after)
        assert all(torch.equal(buffer, values) for buffer, values in zip(
            (run.plan.batches, run.plan.offsets, run.plan.flips), drawn))
        assert torch.equal(run.plan.rates, run.schedule[(epoch - 1) * 6:epoch * 6]), "the epoch's rates"
        assert run.plan.cursor.item() == 0 and run.plan.correct.item() == 0
        assert {name: tensor.data_ptr() for name, tensor in plan_tensors(run.plan).items()} == addresses


def test_opt4_schedule_table_is_onecycles_learning_rate_at_every_step_and_beta1_stays_torchs():
    table = opt4.onecycle_schedule(0.02, 40, CPU)
    weight = torch.zeros(1, requires_grad=True)
    reference = torch.optim.AdamW([weight], lr=0.02)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(reference, max_lr=0.02, total_steps=40, pct_start=0.25)
    expected = []
    for _ in range(40):
        expected.append(reference.param_groups[0]["lr"])
        reference.step()
        scheduler.step()
    assert table.shape == (40,) and torch.allclose(table, torch.tensor(expected, dtype=torch.float64).float())
    assert table.argmax() == 9 and table[0] == pytest.approx(0.02 / 25) and table[-1] < 1e-6
    # fused AdamW takes beta1 as a number: it stays at torch's 0.9, where OneCycleLR would cycle it 0.95-0.85-0.95
    assert opt4.adamw([weight], 0.02, CPU).defaults["betas"] == (0.9, 0.999)


@pytest.mark.parametrize("script", ["opt3.py", "opt4.py", "opt5.py"])
def test_opt3_and_opt4_score_each_test_image_once_and_opt5_with_its_mirror(script, monkeypatch):
    # Flip test-time augmentation is opt5's (its recipe): the mean of the logits of each image and its mirror, in one
    # batch of --batch-size. opt3 and opt4 score each image once, --batch-size of them a batch
    monkeypatch.setattr(torch, "autocast", lambda *args, **kwargs: contextlib.nullcontext())  # float32
    torch.manual_seed(0)
    model = common.ResNet10().eval()
    images, labels = torch.randint(0, 256, (20, 3, 32, 32), dtype=torch.uint8), torch.randint(0, 10, (20,))
    with torch.no_grad():
        plain, mirrored = (model(opt4.normalize(shown, common.cifar10_statistics(CPU))) for shown in (images,
                                                                                                   images.flip(3)))
    with_mirrors = (plain + mirrored) / 2
    expected, other = (with_mirrors, plain) if script == "opt5.py" else (plain, with_mirrors)
    # batches of 8: opt3 and opt4 the last one 4 images padded; opt5 4 images and their 4 mirrors each
    loss, accuracy = call(ALL_SCRIPTS[script].evaluate, model=model, test_data=(images, labels),
                          amp_dtype=torch.float32, batch_size=8, device=CPU, size=32)
    assert loss == pytest.approx(nn.functional.cross_entropy(expected, labels).item(), rel=1e-5)
    assert accuracy == pytest.approx((expected.argmax(1) == labels).float().mean().item(), abs=1 / 20)
    assert loss != pytest.approx(nn.functional.cross_entropy(other, labels).item(), rel=1e-5), \
        "the test must be able to fail"


@pytest.mark.parametrize("script", ["opt5.py", "opt6.py"])
@pytest.mark.parametrize("size", [16, 32])
def test_opt5_evaluation_scores_each_image_once_whatever_its_last_batch(script, size):
    # opt5 evaluates eagerly, its last batch unpadded: batches of 16 over 40 images (the last one 8) score as one of 40,
    # in float32 (amp_dtype float32 turns autocast off)
    torch.manual_seed(0)
    model = common.ResNet10().eval()
    test_data = (torch.randint(0, 256, (40, 3, 32, 32), dtype=torch.uint8), torch.randint(0, 10, (40,)))

    def evaluate(batch_size):
        return call(ALL_SCRIPTS[script].evaluate, model=model, test_data=test_data, amp_dtype=torch.float32,
                    batch_size=batch_size, device=CPU, size=size)
    (loss, accuracy), (one_batch_loss, one_batch_accuracy) = evaluate(16), evaluate(40)
    assert loss == pytest.approx(one_batch_loss, rel=1e-5) and accuracy == one_batch_accuracy


# --------------------------------------------------------------- what each optimization turns on

def is_channels_last(tensor):
    return tensor.is_contiguous(memory_format=torch.channels_last) and not tensor.is_contiguous()


class RecordingResNet10(common.ResNet10):
    """ResNet10 that notes what its first training forward saw: input and weight layout, the logits' dtype."""
    seen = {}

    def forward(self, images):
        outputs = super().forward(images)
        if self.training and not RecordingResNet10.seen:
            weight = self.layers[0].conv1.weight
            RecordingResNet10.seen.update(channels_last=(is_channels_last(images), is_channels_last(weight)),
                                          logits_dtype=outputs.dtype)
        return outputs


# script: (channels_last (input, weights), optimizer, label smoothing)
IN_EFFECT = {
    "baseline.py": ((False, False), None, 0.0),
    "opt1.py": ((False, False), "AdamW", 0.0),
    "opt2.py": ((False, False), "AdamW", 0.1),
    "opt3.py": ((True, True), "AdamW, fused", 0.1),
    "opt4.py": ((True, True), "AdamW, fused, rate in a tensor", 0.1),
    "opt5.py": ((True, True), "Muon", 0.1),
    "opt6.py": ((True, True), "Muon", 0.1),
}


@pytest.mark.parametrize("bfloat16_unit", [None, "AMX-BF16"])
@pytest.mark.parametrize("script", ALL_SCRIPTS)
def test_each_scripts_optimizations_are_in_effect(script, bfloat16_unit, monkeypatch, capsys):
    if bfloat16_unit and not common.bfloat16_unit():
        pytest.skip("this CPU has no bfloat16 unit: emulated bfloat16 would take minutes")
    created = {}

    class AdamW(torch.optim.AdamW):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            # the first made: from opt4 on, OneCycleLR's table (onecycle_schedule) steps a stand-in of its own
            kind = "AdamW" + ", fused" * bool(self.defaults["fused"]) + \
                ", rate in a tensor" * torch.is_tensor(self.defaults["lr"])
            created.setdefault("optimizer", kind)

    class Muon(getattr(ALL_SCRIPTS[script], "Muon", torch.optim.Optimizer)):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            created.update(optimizer="Muon", newton_schulz_dtype=self.dtype, newton_schulz_steps=self.steps)

    class CrossEntropyLoss(nn.CrossEntropyLoss):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            created["label_smoothing"] = self.label_smoothing

    RecordingResNet10.seen.clear()
    monkeypatch.setattr(common, "bfloat16_unit", lambda: bfloat16_unit)
    monkeypatch.setattr(common, "ResNet10", RecordingResNet10)
    monkeypatch.setattr(torch.optim, "AdamW", AdamW)
    monkeypatch.setattr(nn, "CrossEntropyLoss", CrossEntropyLoss)
    if hasattr(ALL_SCRIPTS[script], "Muon"):
        monkeypatch.setattr(ALL_SCRIPTS[script], "Muon", Muon)
    flags = [] if script == "baseline.py" else ["--no-compile"]
    flags += ["--workers", "0"] if script == "opt2.py" else []
    monkeypatch.setattr(sys, "argv", [script, *SMALL, *flags, "--epochs", "1", "--train-size", "80",
                                      "--batch-size", "16", "--test-size", "16"])
    ALL_SCRIPTS[script].main()
    seen = RecordingResNet10.seen
    assert (seen["channels_last"], created.get("optimizer"), created["label_smoothing"]) == IN_EFFECT[script]
    # The 16-bit type where the CPU has a bfloat16 unit, else float32; the baseline is always float32.
    expected = torch.bfloat16 if bfloat16_unit and script != "baseline.py" else torch.float32
    assert seen["logits_dtype"] == expected
    if created.get("optimizer") == "Muon":  # its Newton-Schulz matmuls too: emulated bfloat16 would be ~12x slower
        assert created["newton_schulz_dtype"] == expected
        assert created["newton_schulz_steps"] == 3  # --ns-steps' default reaches the optimizer
    lines = capsys.readouterr().out.splitlines()
    if script != "baseline.py":  # the run says which precision it chose, and why, before it trains
        precision = next(index for index, line in enumerate(lines) if line.startswith("precision: "))
        assert precision < next(index for index, line in enumerate(lines) if line.startswith("epoch 1:"))
        assert lines[precision].startswith("precision: bfloat16" if bfloat16_unit else "precision: float32")


@pytest.mark.parametrize("script", ALL_SCRIPTS)
def test_the_test_loss_is_computed_on_float32_logits(script, monkeypatch):
    # bfloat16 logits summed into a loss lose ~0.4 % (676.0 against 678.53 for one batch): upcast them first.
    losses_on, real_cross_entropy = [], nn.functional.cross_entropy

    def cross_entropy(outputs, *args, **kwargs):
        losses_on.append(outputs.dtype)
        return real_cross_entropy(outputs, *args, **kwargs)

    monkeypatch.setattr(nn.functional, "cross_entropy", cross_entropy)
    torch.manual_seed(0)
    model = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(3, 10))  # tiny: bfloat16 is quick anywhere
    dataset = common.synthetic_cifar10(32, train=False, transform=common.plain_transform())
    loader = DataLoader(dataset, batch_size=16)
    call(ALL_SCRIPTS[script].evaluate, model=model, loader=loader, test_data=opt4.load_to_device(
        common.synthetic_cifar10(32, train=False, transform=None), CPU), batch_size=16, amp_dtype=torch.bfloat16,
        device=CPU, size=32)
    # 32 images in batches of 16: 2 batches; from opt5 on, 8 images and their mirrors a batch: 4
    assert losses_on == [torch.float32] * (4 if script in ("opt5.py", "opt6.py") else 2)


# What torch.cpu.get_capabilities() reports on each kind of CPU (the keys that matter here).
CAPABILITIES = {
    "Intel Xeon with AMX": ({"avx512_bf16": True, "amx_bf16": True}, torch.bfloat16, "AMX-BF16"),
    "AMD EPYC, Zen 4": ({"avx512_bf16": True, "amx_bf16": False}, torch.bfloat16, "AVX-512 BF16"),
    "AMD EPYC, AVX2 only": ({"avx2": True, "avx512_bf16": False, "amx_bf16": False}, torch.float32, None),
    "Arm with BF16 (Graviton 3)": ({"neon": True, "bf16": True, "sve_bf16": True}, torch.bfloat16, "SVE BF16"),
    "Arm with BF16, no SVE": ({"neon": True, "bf16": True, "sve": False}, torch.bfloat16, "Arm BF16"),
    "Arm without BF16 (Graviton 2)": ({"neon": True, "bf16": False}, torch.float32, None),
}


@pytest.mark.parametrize("cpu", CAPABILITIES)
def test_bfloat16_only_on_a_cpu_that_runs_it_natively(cpu, monkeypatch):
    capabilities, dtype, unit = CAPABILITIES[cpu]
    monkeypatch.setattr(torch.cpu, "get_capabilities", lambda: {"cpu_name": "Test CPU", **capabilities})
    assert common.bfloat16_unit() == unit
    assert common.cpu_name() == f"Test CPU ({unit or 'no bf16 unit'})"
    for script in ("opt1.py", "opt2.py", *WHOLE_STEP):
        chosen, why = ALL_SCRIPTS[script].autocast_dtype(CPU)
        assert chosen == dtype and why.startswith(str(dtype).removeprefix("torch."))
        assert (unit in why) if unit else ("no bfloat16 unit" in why)


def test_on_a_gpu_opt1_on_pick_bfloat16_only_where_it_is_native_and_float16_elsewhere(monkeypatch):
    gpu, scripts = torch.device("cuda", 0), [script for script in ALL_SCRIPTS if script != "baseline.py"]
    # An Ampere or newer GPU: bfloat16 in hardware, float32's range: no GradScaler.
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: True)
    chosen = [ALL_SCRIPTS[script].autocast_dtype(gpu) for script in scripts]
    assert [dtype for dtype, _ in chosen] == [torch.bfloat16] * 6
    assert all(why.startswith("bfloat16 autocast: this GPU runs it natively") for _, why in chosen)
    # A T4 (sm_75): bfloat16 only emulated, which is_bf16_supported() counts unless told not to.
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: including_emulation)
    chosen = [ALL_SCRIPTS[script].autocast_dtype(gpu) for script in scripts]
    assert [dtype for dtype, _ in chosen] == [torch.float16] * 6
    assert all(why.startswith("float16 autocast: no bfloat16 below sm_80") for _, why in chosen)


def test_opt2_loader_workers_default_to_none_on_the_cpu_and_to_the_cores_it_may_use_but_one_with_a_gpu(monkeypatch):
    monkeypatch.setattr(os, "cpu_count", lambda: 64)  # the machine's cores: not what a container or Slurm allows
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)), raising=False)
    assert opt2.default_workers(CPU) == 0
    assert opt2.default_workers(torch.device("cuda", 0)) == 15
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {3}, raising=False)
    assert opt2.default_workers(torch.device("cuda", 0)) == 1
    monkeypatch.delattr(os, "sched_getaffinity", raising=False)  # macOS and Windows: the machine's count
    assert opt2.default_workers(torch.device("cuda", 0)) == 63
    monkeypatch.setattr(sys, "argv", ["opt2.py"])
    assert opt2.parse_args().workers is None, "None: main() picks by device"


# ------------------------------------------------------ float16 + GradScaler: a GPU path, run on the CPU


def small_net():
    """A conv net with BatchNorm, small enough for float16 on the CPU (slow there) to take a second."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 16, 3, padding=1, bias=False), nn.BatchNorm2d(16), nn.ReLU(),
                         nn.AdaptiveAvgPool2d(8), nn.Flatten(), nn.Linear(16 * 64, 10))


def train_float16_epoch(script, model, optimizer, scaler, images=64):
    """One epoch of `script`'s own train_one_epoch in float16 with `scaler`, as a GPU without bfloat16 runs it."""
    torch.manual_seed(0)
    loader = DataLoader(common.synthetic_cifar10(images, train=True, transform=common.normalized_transform()),
                        batch_size=16, shuffle=True)
    train_data = opt4.load_to_device(common.synthetic_cifar10(images, train=True, transform=None), CPU)
    scheduler = constant_schedule(optimizer)
    return call(ALL_SCRIPTS[script].train_one_epoch, model=model, loader=loader, train_data=train_data,
                criterion=nn.CrossEntropyLoss(), optimizer=optimizer, scheduler=scheduler, scaler=scaler,
                amp_dtype=torch.float16, accum_steps=1, keep_gradients=False, batch_size=16,
                generator=torch.Generator().manual_seed(0), augment_generator=torch.Generator().manual_seed(1),
                rank=0, world_size=1, device=CPU, epoch=1, monitor=NO_MONITOR, size=32)


def constant_schedule(optimizer):
    """A scheduler that keeps `optimizer`'s rate, for the scripts that step one (opt1-opt3); None for a list of them
    (opt5 on: the step reads its rate off the run's table, as opt4's does)."""
    return None if isinstance(optimizer, list) else torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)


def shipped_optimizer(script, model, lr=1e-2, dtype=torch.float16, device=CPU):
    """The optimizer as `script` builds it: AdamW, fused from opt3 on, its rate in a tensor from opt4 on; opt5 and opt6
    a list, run.optimizers: Muon for the filters, its rate a tensor and its Newton-Schulz matmuls in `dtype` (float16:
    as on a GPU without bfloat16), then that AdamW for the rest (AdamW's alone for a model without filters)."""
    module = ALL_SCRIPTS[script]
    if module is opt3:  # built in its main()
        return torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.05, fused=True)
    if takes_optimizers(module):
        parameters = list(model.parameters())
        filters, others = [p for p in parameters if p.ndim == 4], [p for p in parameters if p.ndim != 4]
        if not filters or not hasattr(module, "Muon"):  # opt4: AdamW alone, in a list
            return [module.adamw(parameters, lr, device)]
        adamw = module.adamw(others, lr, device)
        muon = module.Muon(filters, torch.tensor(lr, device=device), adamw.defaults["weight_decay"], steps=3,
                           dtype=dtype)
        return [muon, adamw]
    if hasattr(module, "adamw"):
        return module.adamw(model.parameters(), lr, device)
    return torch.optim.AdamW(model.parameters(), lr=lr)


@pytest.mark.parametrize("script", ["opt1.py", "opt2.py", "opt3.py", "opt4.py", "opt5.py", "opt6.py"])
def test_float16_with_grad_scaler_learns_and_moves_the_scale(script):
    model = small_net()
    optimizer = shipped_optimizer(script, model)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8, growth_interval=1)  # grows after every good step
    first_loss = train_float16_epoch(script, model, optimizer, scaler)[0]
    for _ in range(4):
        last_loss, accuracy, _, _ = train_float16_epoch(script, model, optimizer, scaler)
    assert last_loss < 0.5 * first_loss and accuracy > 0.5, "float16 training does not learn"
    assert scaler.get_scale() != 2.0**8, "the loss scale never moved"


@pytest.mark.parametrize("script", ["opt1.py", "opt2.py", "opt3.py", "opt4.py", "opt5.py", "opt6.py"])
@pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step:UserWarning")  # a skipped step
def test_a_float16_step_with_infinite_gradients_is_skipped(script):
    model = small_net()
    before = torch.nn.utils.parameters_to_vector(model.parameters()).detach().clone()
    optimizer = shipped_optimizer(script, model)
    # A scale of 2^100 overflows every float16 gradient: each step's gradients hold inf.
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**100)
    _, _, steps, _ = train_float16_epoch(script, model, optimizer, scaler, images=32)
    assert steps == 2
    after = torch.nn.utils.parameters_to_vector(model.parameters()).detach()
    assert torch.equal(after, before), "a step with inf gradients reached the weights"
    assert scaler.get_scale() == 2.0**98, "each skipped step halves the scale"


def step_of(script, model, dataset, device, compiled=False):
    """`script`'s run, assembled as its main() does (float32, batches of 32, 2 epochs, seed 0), and its training step at
    32x32: the step main() would capture on a GPU, with the model compiled as --compile does or not at all."""
    module = ALL_SCRIPTS[script]
    if compiled:
        model.compile(dynamic=False)
    optimizer = shipped_optimizer(script, model, dtype=torch.float32, device=device)
    run = SimpleNamespace(args=SimpleNamespace(batch_size=32, accum_steps=1), rank=0, world_size=1, device=device,
                          model=model, **{"optimizers" if takes_optimizers(module) else "optimizer": optimizer},
                          crop_padding=common.CROP_PADDING,
                          scaler=torch.amp.GradScaler(device.type, enabled=False), amp_dtype=torch.float32,
                          generator=torch.Generator(device).manual_seed(0),
                          augment_generator=torch.Generator(device).manual_seed(0),
                          train_data=opt4.load_to_device(dataset, device), statistics=common.cifar10_statistics(device))
    assemble_the_step(module, run, epochs=2)
    return run, run.train_steps[32] if hasattr(run, "train_steps") else run.train_step  # opt5 on: a step per size


def tensors_of_the_step(run):
    """Every tensor the step reads or writes, by name: data, plan, weights, buffers, the optimizer's state and rate."""
    tensors = {"images": run.train_data[0], "labels": run.train_data[1], "statistics": run.statistics,
               **{f"plan.{name}": tensor for name, tensor in plan_tensors(run.plan).items()},
               **{f"model.{name}": tensor for name, tensor in run.model.state_dict(keep_vars=True).items()}}
    for number, optimizer in enumerate(optimizers_of(run)):  # opt5 on: Muon's and AdamW's
        for index, group in enumerate(optimizer.param_groups):
            tensors[f"optimizer{number}.group{index}.lr"] = group["lr"]
        for index, state in enumerate(optimizer.state.values()):
            tensors.update({f"optimizer{number}.state{index}.{name}": value for name, value in state.items()
                            if torch.is_tensor(value)})
    return tensors


@pytest.mark.parametrize("script", WHOLE_STEP)
def test_every_tensor_the_step_touches_keeps_its_address_across_steps_and_epochs(script):
    # What a CUDA graph replays is addresses: a tensor the step reads from or writes to anew would be missed.
    run, step = step_of(script, small_net(), common.synthetic_cifar10(128, train=True, transform=None), CPU)
    plan_the_epoch(ALL_SCRIPTS[script], run, 128, 1)
    step()  # the optimizer's state is made in the first step: on a GPU, before the capture
    addresses = {name: tensor.data_ptr() for name, tensor in tensors_of_the_step(run).items()}
    for epoch in (1, 2):
        plan_the_epoch(ALL_SCRIPTS[script], run, 128, epoch)
        for _ in range(len(run.plan.rates)):
            step()
            assert {name: tensor.data_ptr() for name, tensor in tensors_of_the_step(run).items()} == addresses
    assert run.plan.cursor.item() == 0 and len(addresses) > 20  # the last step of the epoch wrapped it to 0


@pytest.mark.parametrize("script", WHOLE_STEP)
def test_the_compiled_step_computes_what_the_step_run_eagerly_does_in_float32(script, monkeypatch):
    monkeypatch.setattr(torch, "autocast", lambda *args, **kwargs: contextlib.nullcontext())  # float32
    dataset = common.synthetic_cifar10(128, train=True, transform=None)

    def after_two_epochs(compiled):
        run, step = step_of(script, small_net(), dataset, CPU, compiled=compiled)
        for epoch in (1, 2):
            plan_the_epoch(ALL_SCRIPTS[script], run, 128, epoch)
            for _ in range(len(run.plan.rates)):
                step()
        return torch.nn.utils.parameters_to_vector(run.model.parameters()).detach(), run.plan.losses

    (compiled, compiled_losses), (eager, eager_losses) = after_two_epochs(True), after_two_epochs(False)
    moved = (eager - torch.nn.utils.parameters_to_vector(small_net().parameters())).norm()
    # 8 steps apart by rounding only (the compiled kernels sum in another order): Adam's step is about the rate for
    # any gradient not near 0, so a gradient within rounding of 0 can step either way; bounded by 1 % of the distance
    print(f"{script}: compiled and eager weights {(compiled - eager).norm() / moved:.2e} of the distance moved apart")
    assert (compiled - eager).norm() <= 0.01 * moved and moved > 0.1
    assert torch.allclose(compiled_losses, eager_losses, rtol=1e-4)


# ------------------------------------------------ opt3 on: no host sync; opt4 --compile: one graph, no recompile

def compiled_run(script, flags, folder):
    """`script`'s main() compiled, in this process; returns the dynamo counters and the line printed after each
    epoch, and the report. For opt4, from epoch 2 on a recompile is an error (the compiler's fail_on_recompile
    stance), so a value baked into a graph (a learning rate, a step count) fails the run."""
    from torch._dynamo.utils import counters
    torch._dynamo.reset()
    counters.clear()
    after_each_epoch, real_record_epoch = [], common.record_epoch

    def record_epoch(*args, **kwargs):
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            real_record_epoch(*args, **kwargs)
        after_each_epoch.append({"graphs": counters["stats"]["unique_graphs"], "frames": sum(counters["frames"].values()),
                                 "graph_breaks": sum(counters["graph_break"].values()), "line": printed.getvalue()})
        # warm from here on (opt5 compiles again at each new image size; its test counts the graphs instead)
        torch.compiler.set_stance("fail_on_recompile" if script == "opt4.py" else "default")

    json_path = folder / "result.json"
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(common, "record_epoch", record_epoch)
        # 40 test images in batches of 16: the evaluation ends on a partial batch.
        patch.setattr(sys, "argv", [script, *SMALL, "--train-size", "96", "--batch-size", "16", "--test-size", "40",
                                    *flags, "--json", str(json_path)])
        try:
            ALL_SCRIPTS[script].main()
        finally:
            torch.compiler.set_stance("default")
    return after_each_epoch, read_json(json_path)


@pytest.fixture(scope="module")
def compiled_opt4_run(tmp_path_factory):
    return compiled_run("opt4.py", ["--epochs", "3", "--compile"], tmp_path_factory.mktemp("opt4"))


@pytest.fixture(scope="module")
def eager_opt4_run(tmp_path_factory):
    """opt4 at its defaults (uncompiled: on a GPU its step is then captured), with a trace of its last epoch."""
    folder = tmp_path_factory.mktemp("opt4-eager")
    flags = ["--epochs", "2", "--profile", str(folder / "trace")]
    return (*compiled_run("opt4.py", flags, folder), folder / "trace")


def test_opt4_compiles_its_model_once_for_training_and_once_for_evaluation_and_never_recompiles(compiled_opt4_run):
    after_each_epoch, report = compiled_opt4_run
    assert report["settings"]["compile"] and len(after_each_epoch) == 3
    # fail_on_recompile from epoch 2 on, while the learning rate changes at every step: the run ended. Only the model
    # is compiled (its training graph, and its evaluation graph: the partial last test batch is padded to one shape),
    # with no graph break; later epochs reuse both graphs of epoch 1
    assert [epoch["graph_breaks"] for epoch in after_each_epoch] == [0, 0, 0]
    assert [epoch["graphs"] for epoch in after_each_epoch] == [2, 2, 2]


@pytest.mark.parametrize("default_run", ["eager_opt4_run", "eager_opt5_run"])  # opt6 runs opt5's step
def test_the_default_path_compiles_nothing(default_run, request):
    # On a GPU the step is captured uncompiled; Dynamo's counters (cleared first) see every frame it would compile
    after_each_epoch, report, _ = request.getfixturevalue(default_run)
    assert report["settings"]["compile"] is False and len(after_each_epoch) == 2
    assert [(epoch["frames"], epoch["graphs"]) for epoch in after_each_epoch] == [(0, 0), (0, 0)]


def eager_ops_per_step(trace_folder):
    """Kernel-launching ops each traced training step runs outside compiled code, from a --profile trace, by the rule
    of tools/eager_ops.py (the counter the results page uses). Returns each step's count and its ops by name."""
    spec = importlib.util.spec_from_file_location("eager_ops", ROOT / "tools" / "eager_ops.py")
    eager_ops = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(eager_ops)
    steps, counted = eager_ops.counted_ops(eager_ops.complete_events(eager_ops.trace_file(str(trace_folder))))
    by_step = [collections.Counter(op["name"] for op in counted if eager_ops.within(op, step)) for step in steps]
    return [sum(names.values()) for names in by_step], by_step


def test_opt4_eager_step_launches_the_same_ops_every_step(eager_opt4_run):
    # What a CUDA graph records once and replays: the step must be the same work every time, nothing decided on the
    # host per step. On a GPU the whole of it is one graph launch; here, traced eagerly, each op is counted
    per_step, names = eager_ops_per_step(eager_opt4_run[2])
    print(f"opt4, torch {torch.__version__}: {statistics.mean(per_step):.0f} kernel-launching ops a step, "
          f"uncompiled: {names[0]}")
    assert len(per_step) == 3 and all(counted == names[0] for counted in names) and per_step[0] > 50


@pytest.mark.parametrize("script", ["opt1.py", "opt2.py"])
def test_opt1_and_opt2_compile_one_graph_for_training_and_one_for_evaluation(script, tmp_path):
    # 40 test images in batches of 16: unpadded, the last batch of 8 would compile a third graph.
    after_each_epoch, report = compiled_run(script, ["--epochs", "2"], tmp_path)
    assert report["settings"]["compile"]
    assert [epoch["graph_breaks"] for epoch in after_each_epoch] == [0, 0]
    assert [epoch["graphs"] for epoch in after_each_epoch] == [2, 2]


HOST_READS = {"item", "tolist", "cpu", "numpy", "__bool__", "__float__", "__int__", "__index__", "__format__",
              "__repr__"}


class CountHostReads(TorchFunctionMode):
    """Counts the tensor calls that copy a value to the host; on a GPU each one waits for the device."""

    def __init__(self):
        super().__init__()
        self.reads = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", None) in HOST_READS:
            self.reads.append(func.__name__)
        return func(*args, **(kwargs or {}))


class CountScalarReads(TorchDispatchMode):
    """Counts aten._local_scalar_dense, the op under .item() and a tensor's bool() or float(), as the dispatcher sees
    it: it also sees what torch's own Python code reads, but not a C++ kernel's reads nor .tolist()."""

    def __init__(self):
        super().__init__()
        self.reads = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.reads += func is torch.ops.aten._local_scalar_dense.default
        return func(*args, **(kwargs or {}))


def host_reads_in_one_epoch(script, images, amp_dtype=CPU_AMP_DTYPE, model=None):
    """The host reads of one `script` train_one_epoch over `images` synthetic images, in batches of 8, on the path a
    GPU takes (uncompiled, the optimizer as the script builds it), in `amp_dtype` (float16: with GradScaler on), of
    ResNet10 unless `model`: the tensor calls that read (CountHostReads) and how many scalars the dispatcher read
    (CountScalarReads)."""
    torch.manual_seed(0)
    model = model or common.ResNet10().to(memory_format=torch.channels_last)
    optimizer = shipped_optimizer(script, model, lr=1e-3, dtype=amp_dtype)
    # opt4 onwards read their schedule off a table on the device (assemble_the_step's)
    scheduler = None if script in WHOLE_STEP else torch.optim.lr_scheduler.OneCycleLR(optimizer, 1e-3, total_steps=100)
    dataset = common.synthetic_cifar10(images, train=True, transform=None)
    loader = DataLoader(as_tensor_dataset(dataset), batch_size=8)
    scaler = torch.amp.GradScaler("cpu", enabled=amp_dtype == torch.float16)
    with CountHostReads() as counter, CountScalarReads() as scalars:
        call(ALL_SCRIPTS[script].train_one_epoch, model=model, loader=loader,
             train_data=opt4.load_to_device(dataset, CPU), criterion=nn.CrossEntropyLoss(), optimizer=optimizer,
             scheduler=scheduler, scaler=scaler, amp_dtype=amp_dtype,
             accum_steps=1, keep_gradients=False, batch_size=8, generator=torch.Generator().manual_seed(0),
             augment_generator=torch.Generator().manual_seed(1), rank=0, world_size=1, device=CPU, epoch=1,
             monitor=NO_MONITOR, size=16)  # opt5 onwards: a 16x16 epoch, so downscaling is counted too
    return counter.reads, scalars.reads


def as_tensor_dataset(dataset):
    """The same images as float tensors in [0, 1], for the scripts that read a DataLoader."""
    return TensorDataset(torch.as_tensor(dataset.data).permute(0, 3, 1, 2).float() / 255,
                         torch.as_tensor(dataset.targets))


def test_the_host_read_counters_catch_baselines_reads_per_step():
    (many, many_scalars), (few, few_scalars) = host_reads_in_one_epoch("baseline.py", 32), \
        host_reads_in_one_epoch("baseline.py", 16)
    assert len(many) > len(few) >= 2 and many_scalars > few_scalars >= 2


# (tensor calls, scalars the dispatcher reads) at the end of an epoch: losses.tolist(), then .item() of the mean loss
# and of the correct count; opt6 reads its totals with one .tolist()
@pytest.mark.parametrize("script, end_of_epoch_reads", [("opt3.py", (3, 2)), ("opt4.py", (3, 2)), ("opt5.py", (3, 2)),
                                                        ("opt6.py", (2, 0))])
def test_opt3_on_read_from_the_device_once_per_epoch_not_per_step(script, end_of_epoch_reads):
    (two_steps, two_scalars), (four_steps, four_scalars) = host_reads_in_one_epoch(script, 16), \
        host_reads_in_one_epoch(script, 32)
    assert (len(two_steps), two_scalars) == (len(four_steps), four_scalars) == end_of_epoch_reads, \
        (two_steps, four_steps, two_scalars, four_scalars)


@pytest.mark.parametrize("script, captured", [("opt3.py", True), ("opt4.py", True), ("opt5.py", False),
                                              ("opt6.py", False)])
def test_in_float16_fused_adamw_takes_grad_scalers_flag_on_the_device_and_muon_has_it_read_on_the_host(script,
                                                                                                      captured):
    # GradScaler hands a fused optimizer the found-inf flag as a tensor; for any other (Muon) it reads the flag with
    # .item() before each step. capture_problem captures the first and not the second
    # small_net: float16 on a CPU is slow, and one filter is enough for Muon
    (two_steps, two_scalars), (four_steps, four_scalars) = host_reads_in_one_epoch(script, 16, torch.float16,
                                                                                    small_net()), \
        host_reads_in_one_epoch(script, 32, torch.float16, small_net())
    reads_per_step = (four_scalars - two_scalars) / 2
    assert reads_per_step == (0 if captured else 1) and (len(four_steps) - len(two_steps)) / 2 == reads_per_step
    if script in ("opt3.py", "opt4.py"):  # opt3: nothing captured yet; opt4: fused AdamW alone, always captured
        return
    optimizer = shipped_optimizer(script, small_net())
    why_not = ALL_SCRIPTS[script].capture_problem(torch.device("cuda"), torch.float16, optimizer,
                                                   *([1] if script == "opt6.py" else []))
    assert (why_not is None) == captured and (captured or "float16's GradScaler reads on the host" in why_not)


# --------------------------------------------------- gradient accumulation in opt4 and opt6, one process

def bn_free_net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 30 * 30, 10))


@pytest.mark.parametrize("script", ["opt4.py", "opt6.py"])
def test_opt4_accumulating_k_micro_batches_equals_one_big_batch(script, monkeypatch):
    monkeypatch.setattr(torch, "autocast", lambda *args, **kwargs: contextlib.nullcontext())  # float32
    monkeypatch.setattr(ALL_SCRIPTS[script], "augment", lambda images, offsets, flips, padding: images)  # crops differ

    def weights_after_one_epoch(batch_size, accum_steps):
        model = bn_free_net()
        optimizer = shipped_optimizer(script, model, lr=1e-2)
        dataset = common.synthetic_cifar10(24, train=True, transform=None)
        _, _, steps, images = call(
            ALL_SCRIPTS[script].train_one_epoch, model=model, train_data=opt4.load_to_device(dataset, CPU),
            criterion=nn.CrossEntropyLoss(), optimizer=optimizer,
            scheduler=constant_schedule(optimizer),
            scaler=torch.amp.GradScaler("cpu", enabled=False), amp_dtype=torch.float32, accum_steps=accum_steps,
            keep_gradients=accum_steps > 1, batch_size=batch_size, generator=torch.Generator().manual_seed(0),
            augment_generator=None, rank=0, world_size=1, device=CPU, epoch=1, monitor=NO_MONITOR, size=32)
        return torch.nn.utils.parameters_to_vector(model.parameters()).detach(), steps, images

    big_batch, steps, _ = weights_after_one_epoch(12, 1)
    accumulated, accumulated_steps, images = weights_after_one_epoch(4, 3)
    assert (steps, accumulated_steps, images) == (2, 2, 24)
    assert torch.allclose(accumulated, big_batch, atol=1e-5)
    one_step, _, _ = weights_after_one_epoch(24, 1)
    assert not torch.allclose(one_step, big_batch, atol=1e-3), "the comparison must be able to fail"

# ---------------------------------------------------- opt5: progressive resizing, evaluation cadence

def test_opt5_image_sizes_end_with_the_full_sizes_share_and_split_the_rest_equally():
    sizes = {epochs: opt5.image_sizes(epochs, 16, 32, 0.3) for epochs in (1, 2, 3, 4, 5, 6, 7)}
    assert sizes == {1: [32], 2: [16, 32], 3: [16, 24, 32], 4: [16, 16, 24, 32], 5: [16, 16, 24, 32, 32],
                     6: [16, 16, 24, 24, 32, 32], 7: [16, 16, 16, 24, 24, 32, 32]}
    twenty = opt5.image_sizes(20, 16, 32, 0.3)  # the 20-epoch recipe: 7, 7 and 6 epochs
    assert [twenty.count(size) for size in (16, 24, 32)] == [7, 7, 6] and twenty == sorted(twenty)
    assert opt5.image_sizes(12, 16, 32, 0.4) == [16] * 4 + [24] * 3 + [32] * 5  # 5 of 12 is 42 %
    assert opt5.image_sizes(4, 8, 32, 0.3) == [8, 16, 24, 32]
    assert opt5.image_sizes(3, 32, 32, 0.3) == [32, 32, 32]
    assert opt5.image_sizes(3, 16, 32, 0) == [16, 24, 32], "the last epoch is always at the full size"
    assert opt5.image_sizes(5, 16, 64, 0.3) == [16, 32, 48, 64, 64]


def test_opt5_downscale_averages_each_pixels_area():
    stripes = torch.arange(32.0).remainder(2).expand(1, 3, 32, 32)  # columns 0, 1, 0, 1, ...: mean 0.5
    for size in (16, 24):
        small = opt5.downscale(stripes, size)
        assert small.shape == (1, 3, size, size)
        # Bilinear sampling would alias the stripes into a new pattern at 24x24 (0.17 to 0.83; antialiased 0.3 to 0.7).
        assert torch.equal(small, torch.full_like(small, 0.5)), size
    assert opt5.downscale(stripes, 32) is stripes
    assert opt5.downscale(torch.rand(1, 3, 64, 64), 32).shape == (1, 3, 32, 32), "images of any size"


def test_opt5_trains_every_size_on_its_one_batch_under_one_onecycle_table_sliced_per_epoch(monkeypatch, tmp_path):
    batches, schedules, json_path = {"train": [], "eval": []}, [], tmp_path / "result.json"

    class BatchRecordingResNet10(common.ResNet10):
        def forward(self, images):
            batches["train" if self.training else "eval"].append(tuple(images.shape[::3]))  # (images, side)
            return super().forward(images)

    plan_epoch = opt5.plan_epoch

    def recorded_plan_epoch(plan, draw, rates):
        plan_epoch(plan, draw, rates)
        schedules.append((plan.rates.clone(), plan.rates.data_ptr()))
    monkeypatch.setattr(common, "ResNet10", BatchRecordingResNet10)
    monkeypatch.setattr(opt5, "plan_epoch", recorded_plan_epoch)
    # 128 images: 4 steps of 32 at 16x16, at 24x24 and at 32x32, one OneCycleLR table of 12 steps, 4 rows an epoch
    monkeypatch.setattr(sys, "argv", ["opt5.py", *SMALL, "--epochs", "3", "--train-size", "128", "--batch-size", "32",
                                      "--monitor-size", "64", "--json", str(json_path)])
    opt5.main()
    assert batches["train"] == [(32, 16)] * 4 + [(32, 24)] * 4 + [(32, 32)] * 4
    # evaluated in the training batch's shape at each size: half a batch of images and their mirrors
    assert batches["eval"] == [(32, 16)] * 4 + [(32, 24)] * 4 + [(32, 32)] * 16
    assert torch.equal(torch.cat([rows for rows, _ in schedules]), opt5.onecycle_schedule(0.016, 12, CPU))
    assert len({address for _, address in schedules}) == 1, "one plan: every size's step reads the same buffers"
    report = read_json(json_path)
    assert [(epoch["steps"], epoch["images"]) for epoch in report["epochs"]] == [(4, 128)] * 3
    assert "min_size_batch" not in report["settings"]


@pytest.mark.parametrize("args, says", [
    (["--full-size-share", "1"], "--full-size-share: must be at least 0 and below 1"),
])
def test_opt5_resizing_flags_are_checked(args, says):
    result = run_script("opt5.py", *SMALL, *args)
    assert result.returncode == 2 and result.stderr.count("\n") == 1 and says in result.stderr, result.stderr


class SizeRecordingResNet10(common.ResNet10):
    """ResNet10 that records the side of every batch it sees, in training and in evaluation."""
    seen = {"train": [], "eval": []}

    def forward(self, images):
        SizeRecordingResNet10.seen["train" if self.training else "eval"].append(images.shape[-1])
        return super().forward(images)


def test_opt5_trains_each_epoch_on_its_image_size_and_evaluates_all_test_images_only_at_the_end(tmp_path,
                                                                                                   monkeypatch):
    for images in SizeRecordingResNet10.seen.values():
        images.clear()
    json_path, weights = tmp_path / "result.json", tmp_path / "weights.pt"
    monkeypatch.setattr(common, "ResNet10", SizeRecordingResNet10)
    evaluated, real_evaluate = [], opt5.evaluate
    monkeypatch.setattr(opt5, "evaluate", lambda run, test_data, size: evaluated.append(test_data) or
                        real_evaluate(run, test_data, size))
    # 4 steps of 32 images per epoch; 256 test images in batches of 32, 64 of them after epochs 1 and 2. AdamW: in
    # the warm-up of 12 steps its steps are larger than Muon's, which would leave the test loss where it was.
    monkeypatch.setattr(sys, "argv", ["opt5.py", *SMALL, "--no-compile", "--epochs", "3", "--train-size", "128",
                                      "--batch-size", "32", "--monitor-size", "64", "--optimizer", "adamw",
                                      "--json", str(json_path),
                                      "--save", str(weights)])
    opt5.main()
    seen = SizeRecordingResNet10.seen
    assert seen["train"] == [16] * 4 + [24] * 4 + [32] * 4
    # A 64-image subset at the size just trained on after epochs 1 and 2, all 256 at 32x32 after the last: 16 images
    # and their mirrors a batch, the training batch's shape
    assert seen["eval"] == [16] * 4 + [24] * 4 + [32] * 16
    report = read_json(json_path)
    assert [epoch["image_size"] for epoch in report["epochs"]] == [16, 24, 32]
    assert [epoch["test_images"] for epoch in report["epochs"]] == [64, 64, 256]
    # The subset is the same after every epoch, and random: the first 64 of a set stored by class would be one class.
    (first_images, first_labels), (second_images, _), (all_images, all_labels) = evaluated
    assert torch.equal(first_images, second_images)
    subset = [image_hash(image) for image in first_images]
    assert len(set(subset)) == 64 and set(subset) < {image_hash(image) for image in all_images}
    assert subset != [image_hash(image) for image in all_images[:64]]
    assert sorted(first_labels.tolist()) != sorted(all_labels[:64].tolist())
    assert report["steady_images_per_second"] is None, "the speeds of 16x16 and 32x32 epochs do not add up"
    launch = [epoch["launch_seconds"] for epoch in report["epochs"]]
    assert 0 < launch[0] < launch[1] < launch[2] == report["launch_to_result_seconds"]
    assert report["epochs"][-1]["train_loss"] < report["epochs"][0]["train_loss"]
    assert_saved_weights_match_the_report(weights, report, opt5, transform=None)


# ------------------------------------------------------------------- opt5: Muon for the convolution filters

@pytest.mark.skipif(not hasattr(torch.optim, "Muon"), reason="torch.optim.Muon arrived in torch 2.9")
@pytest.mark.parametrize("ns_steps", [3, 5])  # opt5's default, torch's
def test_opt5_muon_steps_a_filter_as_torch_optim_muon_steps_its_matrix(ns_steps):
    torch.manual_seed(0)
    filter_ = torch.randn(16, 8, 3, 3)
    # A 3x3 filter, channels_last as in the scripts; torch's Muon takes its 16 x 72 matrix (2-D weights only). A tall
    # one too (the stem's 64 x 27 is tall: orthogonalize turns it wide), as its transpose's 1x1 filter
    tall = torch.randn(72, 16, 1, 1)
    ours = [nn.Parameter(filter_.contiguous(memory_format=torch.channels_last)), nn.Parameter(tall.clone())]
    theirs = [nn.Parameter(filter_.flatten(1).clone()), nn.Parameter(tall.flatten(1).clone())]
    # its rate a float32 tensor, as main() builds it
    muon = opt5.Muon(ours, torch.tensor(0.01), weight_decay=0.05, dtype=torch.bfloat16, steps=ns_steps)
    # The same coefficients (torch's defaults, in bfloat16) and steps, Nesterov momentum 0.9, and the update scaled to
    # AdamW's size (Moonlight's 0.2 sqrt(max(rows, columns)))
    reference = torch.optim.Muon(theirs, lr=0.01, weight_decay=0.05, momentum=0.9, nesterov=True, ns_steps=ns_steps,
                                 adjust_lr_fn="match_rms_adamw")
    for _ in range(3):
        gradients = torch.randn(16, 8, 3, 3), torch.randn(72, 16, 1, 1)
        ours[0].grad = gradients[0].contiguous(memory_format=torch.channels_last)
        ours[1].grad, theirs[0].grad, theirs[1].grad = gradients[1].clone(), gradients[0].flatten(1), \
            gradients[1].flatten(1)
        muon.step()
        reference.step()
    for ours_, theirs_, start in zip(ours, theirs, (filter_.flatten(1), tall.flatten(1))):
        moved = (theirs_ - start).abs().mean()  # what 3 steps moved each weight, on average
        assert moved > 1e-3
        # Both orthogonalize in bfloat16, from weights that differ in float32's last bits (our rate is a float32
        # tensor, torch's 0.01 a double): an entry can round to the next bfloat16 value, 2^-8 of it, at each step
        step_size = 0.01 * 0.2 * 72 ** 0.5  # the rate scaled to AdamW's size: an orthogonalized entry is at most ~1
        torch.testing.assert_close(ours_.detach().flatten(1), theirs_.detach(), rtol=0, atol=3 * step_size * 2**-8)


@pytest.mark.parametrize("script", ["opt5.py", "opt6.py"])
def test_muon_leaves_a_filter_without_a_gradient_and_steps_the_others_as_without_it(script):
    # ablation.py's whitening row freezes the stem: a filter without a gradient is skipped, and gets no state
    torch.manual_seed(0)
    frozen, moving = nn.Parameter(torch.randn(16, 8, 3, 3)), nn.Parameter(torch.randn(32, 16, 3, 3))
    reference = nn.Parameter(moving.detach().clone())
    module = ALL_SCRIPTS[script]
    muon = module.Muon([frozen, moving], torch.tensor(0.01), dtype=torch.float32, steps=3)
    alone = module.Muon([reference], torch.tensor(0.01), dtype=torch.float32, steps=3)
    before, start = frozen.detach().clone(), moving.detach().clone()
    for _ in range(2):
        moving.grad = torch.randn(32, 16, 3, 3)
        reference.grad = moving.grad.clone()
        muon.step()
        alone.step()
    assert torch.equal(frozen, before) and not muon.state[frozen], "the frozen filter or its state moved"
    assert torch.equal(moving, reference) and not torch.equal(moving, start)


def test_muons_batched_form_steps_resnet10s_filters_as_opt5s_loop_in_float64(monkeypatch):
    # ablation.py's "muon-other-form" row (batched_muon): opt5's Muon step in foreach ops, the orthogonalizations in 5
    # zero-padded batches (a zero column adds nothing to x x^T: the rest is as it would be alone), the same math
    torch.manual_seed(0)
    # every filter shape of ResNet10, channels_last as in the scripts: wide ones, tall ones (the stem, the 1x1
    # shortcuts: their matrices turned wide) and several of one shape
    start = [torch.randn(parameter.shape, dtype=torch.float64).contiguous(memory_format=torch.channels_last)
             for parameter in common.ResNet10().parameters() if parameter.ndim == 4]
    loop_filters, batched_filters = ([nn.Parameter(filter_.clone()) for filter_ in start] for _ in range(2))
    loop_step, batches = opt5.Muon.step, []
    ablation.batched_muon(monkeypatch.setattr)
    assert opt5.Muon.step is not loop_step
    batched_orthogonalize = ablation.batched_orthogonalize

    def counted(matrices, *rest):
        batches.append(tuple(matrices.shape))
        return batched_orthogonalize(matrices, *rest)
    monkeypatch.setattr(ablation, "batched_orthogonalize", counted)
    loop, batched = (opt5.Muon(filters, torch.tensor(0.01, dtype=torch.float64), dtype=torch.float64, steps=3)
                     for filters in (loop_filters, batched_filters))
    for _ in range(3):
        for ours, theirs in zip(loop_filters, batched_filters):
            ours.grad = torch.randn_like(ours)
            theirs.grad = ours.grad.clone()
        loop_step(loop)
        batched.step()
    # one batch per row count, each as wide as its widest matrix, at every step
    assert batches == [(1, 27, 64), (3, 64, 576), (3, 128, 1152), (3, 256, 2304), (2, 512, 4608)] * 3
    for ours, theirs, first in zip(loop_filters, batched_filters, start):
        torch.testing.assert_close(theirs.detach(), ours.detach(), rtol=0, atol=1e-12)
        # and each filter stepped: 3 orthogonalized steps of 0.01 x 0.2 sqrt(its matrix's longer side)
        assert (ours - first).norm() > 0.01 * 0.2 * max(first.size(0), first[0].numel()) ** 0.5


VIEWS = {"view", "reshape", "_reshape_alias", "t", "numpy_T", "transpose", "mT", "permute", "expand", "as_strided", "unsqueeze",
         "squeeze", "select", "slice", "alias", "_unsafe_view", "detach", "flatten", "unflatten", "narrow", "to",
         "view_as", "contiguous", "empty", "empty_like", "empty_strided", "split", "unbind", "lift_fresh"}


def launched_ops(step):
    """How many ops `step()` runs that launch a kernel: the outermost aten ops, each counted if it or an op inside it
    is not a view (a to() or flatten() that copies counts, one that returns a view does not)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        step()
    events = [event for event in profile.events() if event.name.startswith("aten::")]
    launches = lambda event: event.name[len("aten::"):] not in VIEWS or any(map(launches, event.cpu_children))
    outermost = [event for event in events if event.cpu_parent is None or not event.cpu_parent.name.startswith("aten::")]
    return sum(map(launches, outermost))


@pytest.mark.parametrize("script", ["opt5.py", "opt6.py"])
def test_muon_step_on_resnet10_launches_the_same_249_ops_every_step_and_reads_nothing_on_the_host(script):
    module = ALL_SCRIPTS[script]
    filters = [p for p in common.ResNet10().to(memory_format=torch.channels_last).parameters() if p.ndim == 4]
    for filter_ in filters:
        filter_.grad = torch.randn_like(filter_)
    # its rate a tensor, as main() builds it: read on the device, so a captured step keeps none baked in
    muon = module.Muon(filters, torch.tensor(0.01), dtype=torch.bfloat16, steps=3)
    first = launched_ops(muon.step)  # it makes each filter's momentum: 12 zeros_like
    later = [launched_ops(muon.step) for _ in range(2)]
    with CountHostReads() as counter, CountScalarReads() as scalars:
        muon.step()
    assert (counter.reads, scalars.reads) == ([], 0), "a host read would wait for the GPU at every step"
    # For each of the 12 filters: the decay factor (2 ops on the rate tensor), weight decay, momentum, Nesterov, the
    # cast to bfloat16, norm, clamp, divide, 3 Newton-Schulz steps of 3 matmuls, the rate times the update and the
    # add: 20; and the 9 3x3 filters' copies out of channels_last (a 1x1 filter's flatten is a view). The batched
    # form (ablation.py's muon-other-form) takes 94
    assert later == [12 * 20 + 9] * 2 == [249] * 2 and first == 249 + 12


@pytest.mark.parametrize("shape", [(64, 27), (27, 64), (128, 1152)])  # the stem, its transpose, a layer-2 filter
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("steps", [3, 5])
def test_opt5_orthogonalize_takes_every_singular_value_near_1(shape, dtype, steps):
    torch.manual_seed(0)
    matrix = torch.randn(shape) * torch.logspace(0, -1, shape[1])  # singular values spread over 10x
    result = opt5.orthogonalize(matrix, steps=steps, dtype=dtype)  # one 2-D matrix, wide or tall
    assert result.shape == shape and result.dtype == dtype
    singular_values = torch.linalg.svdvals(result.float())
    assert 0.6 < singular_values.min() and singular_values.max() < 1.25, singular_values.aminmax()
    # a tall matrix is orthogonalized as its wide transpose (the smaller Gram matrix), then turned back
    torch.testing.assert_close(opt5.orthogonalize(matrix.T, steps=steps, dtype=dtype), result.T)


@pytest.mark.parametrize("steps, reached", [(3, [False, False, True]), (5, [False, True, True])])
def test_opt5_orthogonalize_leaves_the_singular_values_under_its_threshold_below_1(steps, reached):
    # Singular values 1/1000, 1/100 and 1/10 of the Frobenius norm (a fourth makes the norm 1): 3 steps take those
    # above 1/56 of it to 0.68 or more, 5 steps those above 1/660, as orthogonalize's docstring says
    small = torch.tensor([1e-3, 1e-2, 1e-1], dtype=torch.float64)
    singular_values = torch.cat([small, (1 - small.square().sum()).sqrt().view(1)])
    basis, _ = torch.linalg.qr(torch.randn(64, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(0)))
    result = opt5.orthogonalize(basis * singular_values, steps=steps, dtype=torch.float64)
    # Orthogonal columns stay orthogonal: each column's length is its singular value after the steps
    assert [length > 0.68 for length in result.norm(dim=0)[:3].tolist()] == reached, result.norm(dim=0)


@pytest.mark.parametrize("optimizer", ["muon", "adamw"])
def test_opt5_optimizer_step_gives_each_optimizer_the_schedules_rate_and_steps_every_weight(optimizer):
    # run.optimizers: Muon's for the filters then AdamW's for the rest, or AdamW's alone (--optimizer adamw), each
    # weight in one of them; optimizer_step writes each group's rate tensor from the plan's row and steps them all
    model = small_net()
    parameters = list(model.parameters())
    optimizers = shipped_optimizer("opt5.py", model, dtype=torch.float32) if optimizer == "muon" else \
        [opt5.adamw(parameters, 0.01, CPU)]  # as main() builds them
    assert [type(each).__name__ for each in optimizers] == (["Muon", "AdamW"] if optimizer == "muon" else ["AdamW"])
    stepped = [parameter for each in optimizers for group in each.param_groups for parameter in group["params"]]
    assert sorted(map(id, stepped)) == sorted(map(id, parameters)), "each weight in exactly one optimizer"
    run = SimpleNamespace(optimizers=optimizers, scaler=torch.amp.GradScaler("cpu", enabled=False),
                          plan=bare_plan(opt5, 2, 8))
    run.plan.rates.copy_(torch.tensor([0.004, 0.002]))
    before = [parameter.detach().clone() for parameter in parameters]
    for step in range(2):
        for parameter in parameters:
            parameter.grad = torch.ones_like(parameter)
        opt5.optimizer_step(run.optimizers, run.plan, run.scaler)
        # each group of each optimizer, Muon's and AdamW's, stepped at this step's rate; the cursor wraps after step 2
        rates = {group["lr"].item() for each in optimizers for group in each.param_groups}
        assert rates == {run.plan.rates[step].item()} and run.plan.cursor.item() == (step + 1) % 2
    assert all(not torch.equal(parameter, old) for parameter, old in zip(parameters, before)), "every weight moved"





@pytest.fixture(scope="module")
def compiled_opt5_run(tmp_path_factory):
    # --min-size 8 over 7 epochs, one at the full size: 8, 8, 16, 16, 24, 24, 32, as many sizes as any flags give
    with pytest.MonkeyPatch.context() as patch:
        # Past torch's recompile_limit, dynamo would run the frame eager with a warning: make it an error here.
        patch.setattr(torch._dynamo.config, "fail_on_recompile_limit_hit", True)
        return compiled_run("opt5.py", ["--epochs", "7", "--min-size", "8", "--full-size-share", "0", "--compile"],
                            tmp_path_factory.mktemp("opt5"))


@pytest.fixture(scope="module")
def eager_opt5_run(tmp_path_factory):
    """opt5 at its defaults (uncompiled), with a trace of its last epoch, at 32x32."""
    folder = tmp_path_factory.mktemp("opt5-eager")
    flags = ["--epochs", "2", "--min-size", "24", "--profile", str(folder / "trace")]
    return (*compiled_run("opt5.py", flags, folder), folder / "trace")


def test_opt5_compiles_its_model_once_per_image_size_evaluates_eagerly_and_stays_under_the_recompile_limit(
        compiled_opt5_run):
    after_each_epoch, report = compiled_opt5_run
    assert [epoch["image_size"] for epoch in report["epochs"]] == [8, 8, 16, 16, 24, 24, 32]
    assert [epoch["graph_breaks"] for epoch in after_each_epoch] == [0] * 7
    # The model's training graph at each new size, and nothing for the evaluation (40 test images in batches of 16,
    # so two shapes a size); a second epoch at a size reuses it
    graphs = [epoch["graphs"] for epoch in after_each_epoch]
    assert graphs == [1, 1, 2, 2, 3, 3, 4], graphs
    assert graphs[-1] <= torch._dynamo.config.recompile_limit
    # Each epoch that compiled says so, not only the first.
    warm_up = ["(includes compile/warm-up)" in epoch["line"] for epoch in after_each_epoch]
    assert warm_up == [True, False, True, False, True, False, True], warm_up


def test_opt5_with_muon_launches_the_same_ops_every_step(eager_opt5_run, eager_opt4_run):
    per_step, names = eager_ops_per_step(eager_opt5_run[2])
    opt4_ops = statistics.mean(eager_ops_per_step(eager_opt4_run[2])[0])
    print(f"opt5 (Muon), torch {torch.__version__}: {statistics.mean(per_step):.0f} kernel-launching ops a step, "
          f"uncompiled (opt4: {opt4_ops:.0f}): {names[0]}")
    assert eager_opt5_run[1]["settings"]["optimizer"] == "muon"
    assert len(per_step) == 3 and all(counted == names[0] for counted in names) and per_step[0] > opt4_ops


# ------------------------------------------ opt3 -> opt4: the same math, the mechanism changed; the step's fallback

def tiny_resnet():
    """A stand-in for ResNet10 with what matters here (convolutions, BatchNorm, a linear head), fast on a CPU."""
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU(),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 10))


@pytest.mark.parametrize("script", ["opt2.py", "opt3.py"])
def test_opt2_and_opt3_onecycle_moves_the_rate_and_keeps_beta1_at_adamws_0_9(script, monkeypatch):
    # cycle_momentum=False: beta1 a plain number, as opt4's captured step keeps it (OneCycleLR would cycle it 0.95-0.85)
    seen = []

    class AdamW(torch.optim.AdamW):
        def step(self, *args, **kwargs):
            seen.extend((group["betas"][0], float(group["lr"])) for group in self.param_groups)
            return super().step(*args, **kwargs)
    monkeypatch.setattr(common, "ResNet10", tiny_resnet)
    monkeypatch.setattr(torch.optim, "AdamW", AdamW)
    workers = ["--workers", "0"] if script == "opt2.py" else []
    monkeypatch.setattr(sys, "argv", [script, *SMALL, "--epochs", "2", "--train-size", "64", "--batch-size", "16",
                                      "--test-size", "16", "--no-compile", *workers])
    ALL_SCRIPTS[script].main()
    assert len(seen) >= 8 and {beta1 for beta1, _ in seen} == {0.9}
    assert len({rate for _, rate in seen}) >= 4, "the rate moves at every step"


def test_opt3s_loop_and_opt4s_step_give_the_same_losses_in_float32(monkeypatch, tmp_path):
    # 2 epochs of 2,048 images, as each script ships (beta1 fixed at AdamW's 0.9 in both, from opt2 on): the split
    # changed how the step runs (a loop on the host; one function on the plan's buffers), not what it computes
    monkeypatch.setattr(common, "ResNet10", tiny_resnet)

    def losses_and_weights(script):
        module, losses = ALL_SCRIPTS[script], []
        monkeypatch.setattr(module, "autocast_dtype", lambda device: (torch.float32, "float32"))
        monkeypatch.setattr(common, "check_finite", lambda loss, epoch, step: losses.append(loss))
        monkeypatch.setattr(sys, "argv", [script, *SMALL, "--epochs", "2", "--train-size", "2048", "--batch-size",
                                          "64", "--save", str(tmp_path / f"{script}.pt")])
        module.main()
        return torch.tensor(losses), torch.load(tmp_path / f"{script}.pt")

    (loop, loop_weights), (step, step_weights) = losses_and_weights("opt3.py"), losses_and_weights("opt4.py")
    assert len(loop) == len(step) == 64
    assert torch.allclose(loop, step, rtol=1e-4, atol=1e-5), (loop - step).abs().max()
    # the rate a float in one, a float32 tensor in the other: AdamW turns the rounding into steps of ~1e-4 at most
    assert all(torch.allclose(loop_weights[name].float(), step_weights[name].float(), atol=2e-4) for name in loop_weights)
    assert not torch.allclose(loop[1:], step[:-1], rtol=1e-4, atol=1e-5), "the comparison must be able to fail"


class ConvolutionShapes:
    """Records the input shape of every convolution a model runs, apart for training and for evaluation."""

    def __init__(self, model):
        self.training, self.evaluation = set(), set()
        for module in model.modules():
            if isinstance(module, nn.Conv2d):
                module.register_forward_pre_hook(self.record)

    def record(self, module, inputs):
        (self.training if module.training else self.evaluation).add((module.in_channels, *inputs[0].shape))


@pytest.mark.parametrize("script, flags", [("opt3.py", []), ("opt4.py", []),
                                           ("opt5.py", ["--epochs", "3", "--monitor-size", "40"])])
def test_the_evaluation_runs_only_the_convolution_shapes_training_ran(script, flags, monkeypatch):
    # cuDNN's autotuner times every new input shape once, ~1 s a shape on an H200: the evaluation's batches (the image
    # and its mirror, the last one padded) are the training batch's shape at each size, so it times nothing new
    shapes, resnet10 = [], common.ResNet10

    def recorded_resnet():
        model = resnet10()
        shapes.append(ConvolutionShapes(model))
        return model
    monkeypatch.setattr(common, "ResNet10", recorded_resnet)
    monkeypatch.setattr(sys, "argv", [script, *SMALL, "--epochs", "2", "--train-size", "128", "--test-size", "50",
                                      "--batch-size", "16", *flags])
    ALL_SCRIPTS[script].main()
    seen = shapes[0]  # the script's own model: the report counts FLOPs on models of its own
    assert seen.evaluation and seen.evaluation <= seen.training, seen.evaluation - seen.training
    assert {shape[1] for shape in seen.evaluation} == {16}


class FailingCapture(TorchFunctionMode):
    """A capture that fails at the step's first op: a real capture runs none of the step's kernels either."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        raise RuntimeError("CUDA error: operation not permitted when stream is capturing\nmore lines of it")


def test_a_capture_that_fails_says_why_in_one_line_and_the_step_runs_uncaptured_with_no_step_lost(monkeypatch,
                                                                                               capsys):
    default, capturing = (SimpleNamespace(name=name, wait_stream=lambda stream: None) for name in ("default", "capture"))
    current = {"stream": default}

    @contextlib.contextmanager
    def failing_graph(graph):  # as torch.cuda.graph: its own stream, then capture_end fails and leaves it current
        current["stream"] = capturing
        try:
            with FailingCapture():
                yield
        except RuntimeError:
            raise RuntimeError("CUDA error: operation failed due to a previous error during capture")

    monkeypatch.setattr(torch.cuda, "CUDAGraph", lambda: SimpleNamespace(replay=lambda: pytest.fail("replayed")))
    monkeypatch.setattr(torch.cuda, "graph", failing_graph)
    monkeypatch.setattr(torch.cuda, "Stream", lambda: default)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda: current["stream"])
    monkeypatch.setattr(torch.cuda, "set_stream", lambda stream: current.update(stream=stream))
    monkeypatch.setattr(torch.cuda, "stream", lambda stream: contextlib.nullcontext())
    monkeypatch.setattr(torch, "autocast", lambda *args, **kwargs: contextlib.nullcontext())  # float32
    dataset = common.synthetic_cifar10(256, train=True, transform=None)

    def weights_after_an_epoch(wrap):
        run, step = step_of("opt4.py", small_net(), dataset, CPU)
        step = wrap(step)
        plan_the_epoch(opt4, run, 256, 1)
        for _ in range(len(run.plan.rates)):  # 8 steps: 3 warm-up, the capture that fails, 4 more
            step()
        steps_taken = next(iter(optimizers_of(run)[0].state.values()))["step"].item()  # AdamW's count of its steps
        return torch.nn.utils.parameters_to_vector(run.model.parameters()).detach(), steps_taken

    wrapped, wrapped_steps = weights_after_an_epoch(lambda step: opt4.cuda_graph(step, torch.device("cuda")))
    lines = capsys.readouterr().out.splitlines()
    called, called_steps = weights_after_an_epoch(lambda step: step)
    # the op's error, not capture_end's after it; the stream current before the capture is current again
    assert lines == ["step: not captured (RuntimeError: CUDA error: operation not permitted when stream is capturing);"
                     " this step and the rest run as a function"]
    assert current["stream"] is default
    assert wrapped_steps == called_steps == 8 and torch.allclose(wrapped, called)


# ------------------------------------------------------------------------------------ benchmark

def test_benchmark_measures_the_chain_by_the_readmes_command_on_a_cpu(tmp_path):
    # The README's command, then what makes it small here: the last of a repeated flag wins
    command = re.search(r"^python benchmark\.py [^#\n]*?(?=\s*(#|$))", (ROOT / "README.md").read_text(), re.M)[0]
    json_path = tmp_path / "chain.jsonl"
    # 515 images: 8 steps of 64, 4 of 128 and 1 of 512 an epoch, so 5 epochs for OneCycleLR's 5 steps at opt5's batch
    write_tiny_cifar10(tmp_path / "data", train_per_file=103, test_size=64)  # not the official bytes: none checks them
    result = run_script(*shlex.split(command)[1:], "--device", "cpu", "--train-size", 512, "--epochs", 5,
                        "--data-dir", tmp_path / "data", "--json", json_path)
    assert result.returncode == 0, result.stderr
    table = [line.split("|")[1:-1] for line in result.stdout.splitlines() if line.startswith("| ")][1:]  # no header
    scripts = ["baseline.py", "opt1.py", "opt2.py", "opt3.py", "opt4.py", "opt5.py"]
    assert [cells[0].strip() for cells in table] == scripts and table[0][2].strip() == "1.00x"
    *runs, summary = [json.loads(line) for line in json_path.read_text().splitlines()]
    # each script's own --json line at its own batch size, named by the commit and the data it ran on
    fingerprint = accounting.data_fingerprint({"synthetic": False, "data_dir": tmp_path / "data"})
    assert [run["benchmark_run"] for run in runs] == [run["script"] for run in runs] == scripts
    assert [run["settings"]["batch_size"] for run in runs] == [64, 64, 128, 128, 128, 512]
    assert {(run["commit"], run["data_fingerprint"], run["device"]) for run in runs} == \
        {(accounting.git_commit(), fingerprint, "cpu")}
    assert summary["benchmark"] == "chain" and [row["name"] for row in summary["rows"]] == scripts
    opt1_row = summary["rows"][1]
    assert table[1][1].strip() == f"{opt1_row['images_per_second']['all']:,.0f}"
    assert table[1][4].strip() == f"{100 * runs[1]['final_test_accuracy']:.2f}"
    # opt5's 5 epochs train at 16, 16, 24, 32, 32 px: a steady speed at 16 and at 32 px, no single one to compare
    assert re.fullmatch(r"[\d,]+ at 16 px, [\d,]+ at 32 px", table[5][1].strip()) and table[5][2].strip() == "-"


def test_benchmark_marks_a_failed_script_runs_the_rest_and_exits_1(tmp_path):
    env = copy_without_git(tmp_path, "benchmark.py", "baseline.py", "common.py", "machine.py", "tools/accounting.py")
    (tmp_path / "broken.py").write_text('import sys\nsys.exit("broken.py: a bad flag")\n')
    (tmp_path / "silent.py").write_text("# exits 0 with no output and no row\n")
    json_path = tmp_path / "chain.jsonl"
    result = run_script(tmp_path / "benchmark.py", "--scripts", "broken.py", "baseline.py", "silent.py", *SMALL,
                        "--epochs", 2, "--train-size", 64, "--json", json_path, env={**env, "TMPDIR": tmp_path})
    assert result.returncode == 1, result.stderr
    table = [[cell.strip() for cell in line.split("|")[1:-1]]
             for line in result.stdout.splitlines() if line.startswith("| ")][1:]  # no header
    assert [cells[0] for cells in table] == ["broken.py", "baseline.py", "silent.py"]
    log = re.fullmatch(r"failed \(exit 1; its output in (.+\.log)\)", table[0][1])
    assert log and "broken.py: a bad flag" in Path(log[1]).read_text() and table[0][2:] == ["-"] * 7
    assert table[1][2] == "1.00x", "the script after the failed one ran"
    assert table[2][1] == "failed (no row written)" and table[2][2:] == ["-"] * 7
    assert "commit unknown (not a git checkout)" in result.stdout
    assert "commit unknown: not a git checkout (or git is missing), so the rows' commit is null" in result.stdout
    *runs, summary = [json.loads(line) for line in json_path.read_text().splitlines()]
    assert [run["script"] for run in runs] == ["baseline.py"] and runs[0]["commit"] is None
    assert [row["name"] for row in summary["rows"]] == ["baseline.py"]
    assert summary["failed"] == {"broken.py": table[0][1], "silent.py": table[2][1]}


def test_benchmark_speedup_is_each_scripts_speed_over_baselines():
    def reports(images_per_second, sizes=None):
        epochs = [{"train_seconds": 10.0, "images": 1000, "steps": 10, "image_size": size} for size in sizes or []]
        return [{"steady_images_per_second": images_per_second, "steady_ms_per_step": 1.0, "total_seconds": 50.0,
                 "launch_to_result_seconds": 60.0, "peak_memory_bytes": 2**30, "final_test_accuracy": 0.5,
                 "settings": {"batch_size": 128}, "epochs": epochs or [{"train_seconds": 12.0}]}]

    results = {"baseline.py": reports(100.0), "opt1.py": reports(250.0), "opt2.py": reports(50.0),
               "opt5.py": reports(None, sizes=[16, 16, 24, 32, 32])}
    rows = [row.split("|")[1:-1] for row in benchmark.chain_table(results).splitlines()[2:]]
    assert [row[2].strip() for row in rows] == ["1.00x", "2.50x", "0.50x", "-"]
    # opt5: each size's epochs after its first; 24 px trained once, compiling, so it has none
    assert rows[3][1].strip() == "100 at 16 px, 100 at 32 px" and rows[3][3].strip() == "1000.0 at 16 px, 1000.0 at " \
        "32 px (128)"
    assert [cell.strip() for cell in rows[0][4:8]] == ["50.00", "60.0", "12.0", "10.0"]


def test_benchmark_ladder_compares_each_rung_with_the_one_it_adds_to():
    speeds = {"baseline": 100.0, "opt1 eager": 200.0, "opt1": 250.0, "opt2, 0 workers": 240.0,
              "opt2, 2 workers": 200.0, "opt3": 180.0, "opt4": 360.0, "opt4 + compile": 300.0}
    results = {rung: [{"steady_images_per_second": speed, "achieved_tflops": 0.1, "steady_ms_per_step": 1.0,
                       "warmup_seconds": 0.0, "peak_memory_bytes": 2**30, "final_test_accuracy": 0.5}]
               for rung, speed in speeds.items()}
    rows = [row.split("|")[1:-1] for row in benchmark.ladder_table(results, peak_tflops=1.0).splitlines()[2:]]
    by_rung = {row[0].strip(): [cell.strip() for cell in row] for row in rows}
    assert list(by_rung) == list(speeds)
    assert by_rung["opt1"][5:8] == ["opt1 eager", "1.25x", "2.50x"]
    assert by_rung["opt3"][5:8] == ["opt2, 0 workers", "0.75x", "1.80x"]
    assert by_rung["opt4"][5:8] == ["opt3", "2.00x", "3.60x"]
    assert by_rung["opt4"][3] == "no host sync; the step captured as one CUDA graph" and by_rung["opt1"][3] == "-"


def test_benchmark_ladder_marks_a_failed_rung_and_what_it_cannot_compare():
    results = {rung: [{"steady_images_per_second": 100.0, "achieved_tflops": 0.1, "steady_ms_per_step": 1.0,
                       "warmup_seconds": 0.0, "peak_memory_bytes": 2**30, "final_test_accuracy": 0.5}]
               for rung, *_ in benchmark.LADDER}
    results["opt1 eager"] = []
    table = benchmark.ladder_table(results, peak_tflops=1.0, failures={"opt1 eager": "failed (exit 1)"})
    by_rung = {cells[0]: cells for cells in ([cell.strip() for cell in row.split("|")[1:-1]]
                                             for row in table.splitlines()[2:])}
    assert list(by_rung) == [rung for rung, *_ in benchmark.LADDER]
    assert by_rung["opt1 eager"][4:] == ["failed (exit 1)"] + ["-"] * 7
    assert by_rung["opt1"][5:8] == ["opt1 eager", "-", "1.00x"], "no speedup over a rung that failed"


@pytest.mark.parametrize("rung, script, flags", [rung[:3] for rung in benchmark.LADDER])
def test_every_ladder_rung_is_a_command_its_script_accepts(rung, script, flags, monkeypatch):
    monkeypatch.setattr(sys, "argv", [script, *flags])
    args = ALL_SCRIPTS[script].parse_args()
    compiled_by_default = script in ("opt1.py", "opt2.py")  # opt4 on: off by default, the step captured uncompiled
    assert getattr(args, "compile", False) == ("--compile" in flags or compiled_by_default and "--no-compile" not in flags)


def test_benchmark_rejects_one_epoch():
    result = run_script("benchmark.py", "--epochs", 1)
    assert result.returncode == 2 and "steady state excludes epoch 1" in result.stderr



# ---------------------------------------------------------------------------------- ablation.py

def test_ablation_zero_init_starts_every_residual_block_as_its_shortcut(monkeypatch):
    ablation.zero_init_residuals(monkeypatch.setattr)
    model = common.ResNet10()
    assert all(torch.equal(block.bn2.weight, torch.zeros(block.bn2.num_features)) for block in model.layers)
    assert model.stem[1].weight.eq(1).all(), "only the blocks' last BatchNorm changes"
    block, x = model.layers[0].eval(), torch.randn(2, 64, 8, 8)
    assert torch.equal(block(x), torch.relu(x)), "the first block (identity shortcut) passes its input on"


def test_ablation_whitening_filters_whiten_the_images_3x3_patches():
    mix = torch.tensor([[1.0, 0.0, 0.0], [0.8, 0.6, 0.0], [0.5, 0.5, 0.7]])  # correlated channels
    images = torch.einsum("dc,nchw->ndhw", mix, torch.randn(64, 3, 16, 16)).cumsum(-1) / 3  # correlated pixels
    weights = ablation.whitening_weights(images, eps=0.0)
    assert weights.shape == (54, 3, 3, 3) and torch.equal(weights[27:], -weights[:27])
    outputs = nn.functional.conv2d(images, weights[:27])  # each output pixel: one 3x3 patch, projected
    covariance = torch.cov(outputs.permute(1, 0, 2, 3).reshape(27, -1))
    assert torch.allclose(covariance, torch.eye(27), atol=1e-3)


def test_ablation_whitening_stem_is_frozen_and_made_from_the_training_images(monkeypatch):
    ablation.whitening_stem(monkeypatch.setattr, images_used=64)
    train_set, _ = common.load_data(SimpleNamespace(synthetic=True, data_dir=None, train_size=256, test_size=64),
                                    None, None)
    train_images, _ = opt5.load_to_device(train_set, CPU)
    model = common.ResNet10()
    expected = ablation.whitening_weights(opt5.normalize(train_images[:64], common.cifar10_statistics(CPU)))
    assert torch.equal(model.stem[0].weight[:54], expected) and not model.stem[0].weight.requires_grad


def test_ablation_trained_whitening_stem_starts_from_the_whitening_filters_and_trains_on(monkeypatch):
    ablation.TRAINED_WHITENING(monkeypatch.setattr, images_used=64)
    train_set, _ = common.load_data(SimpleNamespace(synthetic=True, data_dir=None, train_size=256, test_size=64),
                                    None, None)
    train_images, _ = opt5.load_to_device(train_set, CPU)
    model = common.ResNet10()
    stem = model.stem[0].weight
    expected = ablation.whitening_weights(opt5.normalize(train_images[:64], common.cifar10_statistics(CPU)))
    assert torch.equal(stem[:54], expected) and stem.requires_grad and stem.is_leaf
    model(torch.randn(2, 3, 16, 16)).square().sum().backward()
    assert stem.grad is not None and stem.grad[:54].abs().sum() > 0, "a gradient reaches the whitening filters"
    opt5.Muon([stem], torch.tensor(0.01), dtype=torch.float32).step()  # opt5's Muon steps it as a filter
    assert not torch.equal(stem[:54], expected)


def test_ablation_alternating_flip_mirrors_each_image_every_other_epoch(monkeypatch):
    ablation.alternating_flip(monkeypatch.setattr)
    run = drawn_plan(size=96, batch_size=16, epochs=3)
    torch.manual_seed(0)  # opt5 seeds torch with --seed: the row draws its first coins from it
    flips = {}
    for epoch in (1, 2, 3):
        plan_the_epoch(opt5, run, 96, epoch)
        by_image = torch.zeros(96, dtype=torch.bool)
        by_image[run.plan.batches.flatten()] = run.plan.flips.flatten()
        flips[epoch] = by_image
    assert 30 < flips[1].sum() < 66, "epoch 1: a coin per image"
    assert torch.equal(flips[2], ~flips[1]) and torch.equal(flips[3], flips[1])


def test_ablation_ema_averages_the_weights_and_batchnorm_statistics_after_every_step(monkeypatch):
    def three_steps(run, train_data, epoch, monitor, size):
        for _ in range(3):
            run.model(torch.randn(8, 4)).square().mean().backward()
            for optimizer in run.optimizers:  # as opt5's optimizer_step: Muon's, then AdamW's
                optimizer.step()

    monkeypatch.setattr(opt5, "train_one_epoch", three_steps)
    ablation.ema_of_the_weights(monkeypatch.setattr, decay=0.5)
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    # the first optimizer steps the Linear's weight, the last the rest: the average sees both steps
    run = SimpleNamespace(model=model, optimizers=[torch.optim.SGD([model[0].weight], lr=0.1),
                                                   torch.optim.SGD(list(model.parameters())[1:], lr=0.1)])
    states = [{name: tensor.clone() for name, tensor in model.state_dict().items()}]
    record = run.optimizers[-1].register_step_post_hook(lambda *_: states.append(
        {name: tensor.clone() for name, tensor in model.state_dict().items()}))
    opt5.train_one_epoch(run, None, 1, NO_MONITOR, 32)
    record.remove()
    for name in ("0.weight", "0.bias", "1.running_mean", "1.running_var"):
        expected = states[0][name]
        for state in states[1:]:
            expected = 0.5 * expected + 0.5 * state[name]
        assert torch.allclose(run.average[name], expected), name
    assert "1.num_batches_tracked" not in run.average


def test_ablation_nesterov_row_builds_sgd_where_opt5_builds_adamw(monkeypatch):
    ablation.nesterov_sgd(monkeypatch.setattr)
    optimizer = opt5.adamw([nn.Parameter(torch.zeros(2))], 0.2, CPU)
    assert isinstance(optimizer, torch.optim.SGD) and optimizer.defaults["lr"].item() == pytest.approx(0.2)
    settings = {name: optimizer.defaults[name] for name in ("momentum", "nesterov", "weight_decay")}
    assert settings == {"momentum": 0.9, "nesterov": True, "weight_decay": 5e-4}
    run = SimpleNamespace(optimizers=[optimizer], scaler=torch.amp.GradScaler("cpu", enabled=False),
                          plan=bare_plan(opt5, 1, 8))
    run.plan.rates.copy_(torch.tensor([0.1]))
    optimizer.param_groups[0]["params"][0].grad = torch.ones(2)
    opt5.optimizer_step(run.optimizers, run.plan, run.scaler)  # opt5's own update step takes it, at the table's rate
    assert optimizer.param_groups[0]["lr"].item() == pytest.approx(0.1)


@pytest.mark.parametrize("row, changed", [
    ("shipped", {}), ("no-resizing", {"min_size": 32}), ("smoothing-0.2", {"label_smoothing": 0.2}),
    ("nesterov", {"optimizer": "adamw", "lr": 0.2}), ("adamw", {"optimizer": "adamw"}),
    ("smoothing-0", {"label_smoothing": 0.0}), ("epochs-5-batch-128", {"epochs": 5, "batch_size": 128, "lr": 0.008}),
    ("twenty-epochs", {}),  # every setting named: the recipe whatever the defaults
    ("one-warmup-step", {}),  # a time row: opt5's training, set up differently
    # a bundle: its schedule's flags, then its own (label smoothing 0.2 after the schedule's 0.1)
    ("fifteen-epochs+all", {"epochs": 15, "label_smoothing": 0.2}),
    ("sixteen-epochs-1024+lookahead+alternating-flip", {"epochs": 16, "batch_size": 1024, "lr": 0.0226}),
])
def test_ablation_rows_flags_change_the_recipe_in_what_they_name_and_win_over_the_flags_given(row, changed,
                                                                                              monkeypatch):
    _, row_flags, _, _ = ablation.ROWS[ablation.ROW_NAMES.index(row)]
    for given in ([], ["--optimizer", "muon", "--label-smoothing", "0.1", "--epochs", "20"]):
        monkeypatch.setattr(sys, "argv", ["opt5.py", *given, *row_flags])  # as run_row puts them
        args = opt5.parse_args()
        assert {name: getattr(args, name) for name in plot.RECIPE if getattr(args, name) != plot.RECIPE[name]} == \
            changed


@pytest.mark.parametrize("short_schedule, peak", [(ablation.short_schedule, 1.4),  # its default peak
                                                  (functools.partial(ablation.short_schedule, peak=1), 1)])
def test_ablation_short_schedule_warms_up_over_5_percent_and_decays_in_a_line_to_0(short_schedule, peak,
                                                                                    monkeypatch):
    short_schedule(monkeypatch.setattr)
    rates = opt5.onecycle_schedule(1.0, 100, CPU)
    assert rates.argmax().item() == 4 and rates.max().item() == pytest.approx(peak)  # the 5th of 100 steps
    assert rates[-1].item() < 1e-3 and rates[0].item() == pytest.approx(peak / 25)
    steps = rates[4:].diff()
    assert torch.allclose(steps, steps.mean().expand_as(steps), atol=1e-6), "a straight line down"


def test_ablation_batchnorm_row_steps_vectors_at_twice_the_rate_without_weight_decay(monkeypatch):
    ablation.batchnorm_without_decay(monkeypatch.setattr)
    model = common.ResNet10()
    parameters = list(model.parameters())
    filters = [p for p in parameters if p.ndim == 4]
    # as opt5's main() builds them: Muon for the filters, AdamW (here the row's) for the rest
    optimizers = [opt5.Muon(filters, torch.tensor(0.01), dtype=torch.float32, steps=3),
                  opt5.adamw([p for p in parameters if p.ndim != 4], 0.01, CPU)]
    vectors, matrices = optimizers[1].param_groups[1]["params"], optimizers[1].param_groups[0]["params"]
    assert vectors and all(p.ndim == 1 for p in vectors) and [p.ndim for p in matrices] == [2]
    run = SimpleNamespace(optimizers=optimizers, scaler=torch.amp.GradScaler("cpu", enabled=False),
                          plan=bare_plan(opt5, 2, 8))
    run.plan.rates.copy_(torch.tensor([0.004, 0.002]))
    before = [p.detach().clone() for p in (*vectors, *matrices)]
    for step in range(2):
        for parameter in parameters:
            parameter.grad = torch.zeros_like(parameter)  # no gradient: only weight decay moves a weight
        opt5.optimizer_step(run.optimizers, run.plan, run.scaler)  # the table's rate into every group, then the step
        rates = [group["lr"].item() for optimizer in optimizers for group in optimizer.param_groups]
        assert rates == pytest.approx([0.004, 0.004, 0.008] if step == 0 else [0.002, 0.002, 0.004])
    assert all(torch.equal(p, b) for p, b in zip(vectors, before)), "no weight decay on the vectors"
    assert torch.allclose(matrices[0], before[-1] * (1 - 0.004 * 0.05) * (1 - 0.002 * 0.05))


def test_ablation_whitening_at_each_size_computes_the_stem_again_at_each_new_size(monkeypatch):
    trained = []
    monkeypatch.setattr(opt5, "train_one_epoch", lambda run, train_data, epoch, monitor, size: trained.append(size))
    ablation.whitening_at_each_size(monkeypatch.setattr, images_used=64)
    train_set, _ = common.load_data(SimpleNamespace(synthetic=True, data_dir=None, train_size=128, test_size=64),
                                    None, None)
    images, labels = opt5.load_to_device(train_set, CPU)
    run = SimpleNamespace(plan=SimpleNamespace(images=images, labels=labels), statistics=common.cifar10_statistics(CPU),
                          model=common.ResNet10())
    normalized = opt5.normalize(images[:64], run.statistics)
    computed = []
    for epoch, size in enumerate([16, 16, 24, 32], 1):
        opt5.train_one_epoch(run, (images, labels), epoch, None, size)
        expected = ablation.whitening_weights(opt5.downscale(normalized, size))
        assert torch.equal(run.model.stem[0].weight[:54], expected), size
        computed.append(expected)
    assert trained == [16, 16, 24, 32] and not torch.equal(computed[0], computed[2])


def test_ablation_batched_muon_steps_as_opt5s_muon_does_filter_by_filter(monkeypatch):
    per_filter = opt5.Muon.step  # opt5's own, before the row replaces it
    ablation.batched_muon(monkeypatch.setattr)
    torch.manual_seed(0)
    models = [common.ResNet10().double() for _ in range(2)]
    models[1].load_state_dict(models[0].state_dict())  # a copy: the same weights
    filters = [[p for p in model.parameters() if p.ndim == 4] for model in models]
    # float64 and one Newton-Schulz iteration a step (3 would run the same code on 3x the matmuls): ResNet10's 12
    # filters, tall (the stem's) and wide, 1x1 and 3x3, in the row's 5 zero-padded batches
    shipped, batched = (opt5.Muon(these, torch.tensor(0.02, dtype=torch.float64), steps=1, dtype=torch.float64)
                        for these in filters)
    stem, start = (filters[0][i].detach().clone() for i in (0, 1))
    for step in range(3):
        for mine, its in zip(*filters):
            mine.grad = torch.randn_like(mine)
            its.grad = mine.grad.clone()
        for these in filters:
            these[0].grad = None  # a filter without a gradient (a frozen stem) is skipped by both
        per_filter(shipped)
        batched.step()
        assert max((mine - its).abs().max().item() for mine, its in zip(*filters)) < 1e-12, f"step {step + 1}"
        # the momenta made at the first step only: a captured step would zero fresh copies of them at every replay
        monkeypatch.setattr(torch, "zeros_like", lambda *args, **kwargs: pytest.fail("momenta made again"))
    assert not torch.equal(filters[1][1], start), "the filters moved"
    assert torch.equal(filters[0][0], stem) and torch.equal(filters[1][0], stem), "no gradient, no step"
    assert len(batched.state) == 11 and all(torch.equal(batched.state[its]["momentum"], shipped.state[mine][
        "momentum"]) for mine, its in zip(filters[0][1:], filters[1][1:]))


def test_ablation_cudnn_benchmark_off_turns_the_autotuner_off_after_opt5_turns_it_on(monkeypatch):
    source = inspect.getsource(opt5.main)  # opt5 turns it on just before it builds the model: the row's moment
    assert source.index("torch.backends.cudnn.benchmark = True") < source.index("common.ResNet10()")
    ablation.cudnn_benchmark_off(monkeypatch.setattr)
    torch.backends.cudnn.benchmark = True
    model = common.ResNet10()
    assert torch.backends.cudnn.benchmark is False and sum(p.numel() for p in model.parameters()) == 4_903_242


def test_ablation_cudnn_benchmark_at_the_largest_size_turns_it_on_only_in_the_full_size_epochs(monkeypatch):
    seen = []
    monkeypatch.setattr(opt5, "train_one_epoch", lambda run, train_data, epoch, monitor, size: seen.append(
        (size, torch.backends.cudnn.benchmark)))
    ablation.cudnn_benchmark_at_the_largest_size(monkeypatch.setattr)
    train_data = torch.zeros(4, 3, 32, 32, dtype=torch.uint8), torch.zeros(4, dtype=torch.long)
    run = SimpleNamespace(plan=SimpleNamespace(images=train_data[0], labels=train_data[1]))
    torch.backends.cudnn.benchmark = True  # as opt5 leaves it
    sizes = opt5.image_sizes(20, 16, 32, 0.3)
    for epoch, size in enumerate(sizes, 1):
        opt5.train_one_epoch(run, train_data, epoch, NO_MONITOR, size)
    assert seen == [(size, size == 32) for size in sizes] and sizes.count(32) == 6


def test_ablation_one_warmup_step_captures_the_step_at_its_second_call(monkeypatch):
    where, seen = {"stream": "default"}, []

    @contextlib.contextmanager
    def on(stream):  # torch.cuda.stream and torch.cuda.graph: the step inside runs there
        before, where["stream"] = where["stream"], stream
        try:
            yield
        finally:
            where["stream"] = before

    stream = SimpleNamespace(wait_stream=lambda other: None)
    monkeypatch.setattr(torch.cuda, "Stream", lambda: stream)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda: stream)
    monkeypatch.setattr(torch.cuda, "stream", lambda side_stream: on("warm-up"))
    monkeypatch.setattr(torch.cuda, "graph", lambda graph: on("capture"))
    monkeypatch.setattr(torch.cuda, "CUDAGraph", lambda: SimpleNamespace(replay=lambda: seen.append("replay")))
    shipped = opt5.cuda_graph
    ablation.one_warmup_step(monkeypatch.setattr)
    calls = {}
    for name, cuda_graph in (("opt5", shipped), ("row", opt5.cuda_graph)):
        seen.clear()
        step = cuda_graph(lambda: seen.append(where["stream"]), torch.device("cuda"))
        for _ in range(5):
            step()
        calls[name] = list(seen)
    # a capture runs none of the step's kernels: the graph replays them, at once
    assert calls["row"] == ["warm-up", "capture", "replay", "replay", "replay", "replay"]
    assert calls["opt5"] == ["warm-up"] * 3 + ["capture", "replay", "replay"]


def test_ablation_lookahead_pulls_the_weights_to_their_average_every_5_steps_and_ends_on_it(monkeypatch):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    before, after = [], []  # the weights and BatchNorm statistics at each step's start and end

    def floats():
        return [tensor.clone() for tensor in model.state_dict().values() if tensor.is_floating_point()]

    def step():  # a step: the weights and the BatchNorm statistics move
        before.append(floats())
        sgd.zero_grad()
        model(torch.randn(8, 4)).square().mean().backward()
        sgd.step()
        after.append(floats())

    def four_steps(run, train_data, epoch, monitor, size):
        for _ in range(4):
            run.train_steps[size]()

    monkeypatch.setattr(opt5, "train_one_epoch", four_steps)
    ablation.lookahead(monkeypatch.setattr)
    run = SimpleNamespace(model=model, args=SimpleNamespace(epochs=2), schedule=torch.zeros(8), train_steps={32: step})
    start = floats()
    for epoch in (1, 2):
        opt5.train_one_epoch(run, None, epoch, NO_MONITOR, 32)
        if epoch == 1:
            assert all(torch.equal(*pair) for pair in zip(floats(), after[3])), "no pull in the first 4 steps"

    def same(these, those):
        return all(torch.allclose(this, that, atol=1e-7) for this, that in zip(these, those))
    weight = 0.95 ** 5 * (5 / 8) ** 3  # decay x (steps done / all steps)^3, after the 5th of 8 steps
    pulled = [weight * first + (1 - weight) * fifth for first, fifth in zip(start, after[4])]
    assert same(before[5], pulled) and not same(before[5], after[4]), "the 6th step starts from the pulled weights"
    assert all(same(before[i], after[i - 1]) for i in (1, 2, 3, 4, 6, 7)), "no pull at other steps"
    assert same(floats(), pulled) and same(run.lookahead["average"], pulled), "the last epoch ends on the average"
    assert not same(floats(), after[7])


def test_ablation_batchnorm_biases_only_freezes_every_scale_and_steps_biases_at_twice_the_rate_without_decay(
        monkeypatch):
    ablation.batchnorm_biases_only(monkeypatch.setattr)
    torch.manual_seed(0)
    model = common.ResNet10()
    batchnorms = [module for module in model.modules() if isinstance(module, nn.BatchNorm2d)]
    assert len(batchnorms) == 12 and all(not bn.weight.requires_grad and bn.bias.requires_grad for bn in batchnorms)
    parameters = list(model.parameters())
    optimizers = [opt5.Muon([p for p in parameters if p.ndim == 4], torch.tensor(0.01), dtype=torch.float32),
                  opt5.adamw([p for p in parameters if p.ndim != 4], 0.01, CPU)]  # as opt5's main() builds them
    no_decay = optimizers[1].param_groups[1]
    biases = [bn.bias for bn in batchnorms] + [model.fc.bias]
    assert no_decay["weight_decay"] == 0 and {id(p) for p in biases} <= {id(p) for p in no_decay["params"]}
    run = SimpleNamespace(optimizers=optimizers, scaler=torch.amp.GradScaler("cpu", enabled=False),
                          plan=bare_plan(opt5, 1, 4))
    run.plan.rates.copy_(torch.tensor([0.004]))
    started = [bias.detach().clone() for bias in biases]
    nn.functional.cross_entropy(model(torch.randn(4, 3, 16, 16)), torch.arange(4)).backward()
    for parameter in parameters:
        if parameter.ndim == 4:
            parameter.grad = None  # Muon skips the filters: seconds of Newton-Schulz on a CPU, and not the row's change
    opt5.optimizer_step(run.optimizers, run.plan, run.scaler)
    assert [group["lr"].item() for optimizer in optimizers for group in optimizer.param_groups] == \
        pytest.approx([0.004, 0.004, 0.008])
    assert all(bn.weight.grad is None and bn.weight.eq(1).all() for bn in batchnorms), "the scales stay 1"
    assert all(not torch.equal(bias, start) for bias, start in zip(biases, started)), "every bias steps"


def test_ablation_epochs_at_each_size_trains_the_counts_and_exits_2_with_one_line_on_other_epochs(monkeypatch,
                                                                                                 capsys):
    ablation.epochs_at_each_size(monkeypatch.setattr, counts=(8, 4, 3))
    assert opt5.image_sizes(15, 16, 32, 0.3) == [16] * 8 + [24] * 4 + [32] * 3
    with pytest.raises(SystemExit) as exit_info:
        opt5.image_sizes(20, 16, 32, 0.3)
    stderr = capsys.readouterr().err
    assert exit_info.value.code == 2 and stderr.count("\n") == 1, stderr
    assert "trains 15 epochs" in stderr and "drop --epochs 20" in stderr


def test_ablation_runs_its_rows_once_per_seed(tmp_path):
    out = tmp_path / "seeds.jsonl"
    result = run_script("tools/ablation.py", "--rows", "shipped", "--seeds", 3, 4, "--json", out, "--epochs", 2,
                        "--train-size", 256, "--batch-size", 64, *SMALL)
    assert result.returncode == 0, result.stderr
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert [line["settings"]["seed"] for line in lines] == [3, 4] and "2 rows appended" in result.stdout
    assert lines[0]["command"].endswith("--seed 3")
    assert lines[0]["epochs"][0]["train_loss"] != lines[1]["epochs"][0]["train_loss"], "other weights, other batches"


def test_plot_screen_table_groups_rows_by_seed_against_the_twenty_epoch_mean():
    def screened(row, seed, views, settings):
        epochs = [{"steps": 87, "images": 87 * 512, "image_size": 32, "test_images": 5000}]
        return plot.read_row({"script": "opt5.py", "chain": 2, "row": row, "settings": {
            **plot.RECIPE, "validation": 5000, "seed": seed, **settings}, "epochs": epochs,
            "launch_to_result_seconds": 600.0, "modelled_h200_seconds": 0.0, "2_views": views[0], "6_views": views[1]})
    twelve = {"epochs": 12, "batch_size": 1024}
    lines = plot.screen_table([screened("shipped", 0, (0.90, 0.91), {}),  # the defaults were the recipe's
                               screened("twelve-epochs", 0, (0.89, 0.90), twelve),
                               screened("twenty-epochs", 1, (0.91, 0.92), {}),
                               screened("twelve-epochs", 0, (0.895, 0.90), twelve),  # the last of a seed counts
                               screened("shipped", 2, (0.80, 0.81), twelve)])  # not the recipe: its own row
    rows = {line.split(" | ")[0][2:]: line.split(" | ")[1:] for line in lines[2:]}
    assert list(rows) == ["twenty-epochs", "twelve-epochs", "shipped"]
    assert rows["twenty-epochs"][:4] == ["0, 1", "90.50 (90.00, 91.00)", "+0.00", "91.50"]
    assert rows["twelve-epochs"][:3] == ["0", "89.50 (89.50)", "-1.00"]
    modelled = 87 * accounting.modelled_h200_step_seconds(512, 32, muon=True)
    extra = ablation.modelled_h200_extra_view_seconds(5000, 512)
    assert rows["twenty-epochs"][4] == f"{modelled:.2f} / {modelled + extra:.2f}"
    assert plot.screen_table([screened("shipped", 0, (0.9, 0.9), {"validation": 0})]) == [], "the test set: no"


def test_plot_step_table_takes_the_median_of_the_steady_epochs_at_each_batch_and_size():
    def epoch(images, side, ms):
        return {"steps": 10, "images": 10 * images, "image_size": side, "ms_per_step": ms}
    exact = {(2048, 16): 1.0 + 2048 * 256e-6, (1024, 24): 1.0 + 1024 * 576e-6, (1024, 32): 1.0 + 1024 * 1024e-6}
    rows = [{"epochs": [epoch(2048, 16, 50.0), epoch(2048, 16, exact[2048, 16]), epoch(1024, 24, 60.0),
                        epoch(1024, 24, exact[1024, 24]), epoch(1024, 32, 70.0), epoch(1024, 32, exact[1024, 32]),
                        epoch(1024, 32, exact[1024, 32] + 1)]},
            {"epochs": [epoch(1024, 32, 80.0), epoch(1024, 32, exact[1024, 32] - 1)]}]  # warm-ups: not counted
    assert plot.step_table(rows) == [(1024, 24, exact[1024, 24]), (1024, 32, exact[1024, 32]),
                                     (2048, 16, exact[2048, 16])]
    lines = plot.step_table_lines(rows)
    assert lines[0] == "Fit: 1.000 ms + 1.00 ns per image x pixel a step" and len(lines) == 4 + 3
    assert all(line.endswith(("| +0.000 |", "| -0.000 |")) for line in lines[4:]), "the points lie on a line"
    assert plot.step_table_lines(rows[1:]) == ["1 batch and size points with a steady epoch: a fit needs 2"]


def test_ablation_shifts_move_the_image_one_pixel_and_reflect_the_edge():
    images = torch.arange(16.0).view(1, 1, 4, 4)
    up_left, down_right = ablation.shifted(images, -1, -1), ablation.shifted(images, 1, 1)
    assert torch.equal(up_left[..., :3, :3], images[..., 1:, 1:])
    assert torch.equal(down_right[..., 1:, 1:], images[..., :3, :3])
    assert torch.equal(ablation.shifted(images, 0, 0), images)


def test_ablation_runs_each_row_in_its_own_process_and_scores_three_ways(tmp_path):
    out = tmp_path / "ablation.jsonl"
    result = run_script("tools/ablation.py", "--rows", "shipped", "ema", "smoothing-0", "--json", out, "--epochs", 2,
                        "--train-size", 1024, "--batch-size", 64, "--label-smoothing", 0.2, "--no-compile", *SMALL)
    assert result.returncode == 0, result.stderr
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert [line["row"] for line in lines] == ["shipped", "ema", "smoothing-0"]
    # opt5 as it ships (Muon) with the flags given, and a row's own flag over them
    assert [(line["settings"]["optimizer"], line["settings"]["label_smoothing"]) for line in lines] == \
        [("muon", 0.2), ("muon", 0.2), ("muon", 0.0)]
    shipped = lines[0]
    assert shipped["2_views"] == shipped["final_test_accuracy"], "2 views is opt5's own evaluation"
    assert shipped["2_views"] > 0.3, "it learns (10 classes)"
    for line in lines:
        assert line["command"].startswith(f"python tools/ablation.py --rows {line['row']} --epochs 2")
        assert all(0 <= line[views] <= 1 for views in ("1_view", "2_views", "6_views"))
        assert line["launch_to_result_6_views_seconds"] == line["launch_to_result_seconds"] + \
            line["extra_view_seconds"] > line["launch_to_result_seconds"]
        # 256 test images in half-batches of 32: 8 calls of 64 images a view pair, 16 more for 2 more pairs
        assert line["modelled_h200_6_views_seconds"] == pytest.approx(line["modelled_h200_seconds"] + 16 * (
            accounting.modelled_h200_step_seconds(64, 32, muon=False) / 3))
        assert len(line["epochs"]) == 2 and line["epochs"][0]["test_images"] == 256
    assert result.stdout.count("row shipped: test acc") == 1 and "3 rows appended" in result.stdout


# ablation.py launched through this wrapper, which puts a stand-in for ResNet10 (its stem and classifier, no blocks)
# in common: main() launches each row as it was launched, so every row's process trains the stand-in, and a bundle's
# 15 epochs of its batch of 512 take seconds on a CPU, not minutes
STEM_ONLY = """
import runpy, sys
sys.path.insert(0, {root!r})
import torch.nn as nn
import common


class StemOnly(nn.Module):
    def __init__(self, num_classes=10):
        super().__init__()
        # ResNet10's stem filters (a whitening stem sets 54 of them), at stride 4: a 16th of the pixels after them
        self.stem = nn.Sequential(nn.Conv2d(3, 64, 3, stride=4, padding=1, bias=False), nn.BatchNorm2d(64), nn.ReLU())
        self.layers = nn.Sequential()  # no residual blocks
        self.fc = nn.Linear(64, num_classes)

    def forward(self, x):
        return self.fc(nn.functional.adaptive_avg_pool2d(self.layers(self.stem(x)), 1).flatten(1))


common.ResNet10 = StemOnly
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def test_ablation_runs_a_time_row_and_a_bundle_each_with_its_own_flags_over_the_flags_given(tmp_path):
    out, weights, wrapper = tmp_path / "screen.jsonl", tmp_path / "weights.pt", tmp_path / "stem_only.py"
    wrapper.write_text(STEM_ONLY.format(root=str(ROOT)))
    given = ["--epochs", "2", "--batch-size", "16", "--label-smoothing", "0", "--train-size", "512",
             "--monitor-size", "16", "--save", str(weights), *SMALL, "--test-size", "64"]
    # one thread: the stand-in's ops take microseconds, and threads of one op wait on each other on a busy machine
    result = run_script(wrapper, "tools/ablation.py", "--rows", "one-warmup-step", "fifteen-epochs+all", "--json", out,
                        *given, env={"OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert [line["row"] for line in lines] == ["one-warmup-step", "fifteen-epochs+all"]
    assert [line["command"] for line in lines] == [f"python tools/ablation.py --rows {line['row']} {shlex.join(given)}"
                                                   for line in lines]
    settings = [{name: line["settings"][name] for name in ("epochs", "batch_size", "lr", "label_smoothing")}
                for line in lines]
    # the time row runs the flags given; the bundle its own schedule (15 epochs of 512) and smoothing over them
    assert settings == [{"epochs": 2, "batch_size": 16, "lr": 0.016, "label_smoothing": 0.0},
                        {"epochs": 15, "batch_size": 512, "lr": 0.016, "label_smoothing": 0.2}]
    assert [epoch["image_size"] for epoch in lines[0]["epochs"]] == [16, 32]
    assert [epoch["image_size"] for epoch in lines[1]["epochs"]] == [16] * 8 + [24] * 4 + [32] * 3  # (8, 4, 3)
    assert [epoch["steps"] for epoch in lines[1]["epochs"]] == [1] * 15
    assert all(0 <= line[views] <= 1 for line in lines for views in ("1_view", "2_views", "6_views"))
    # the bundle's last weights (--save, the last row's): BatchNorm's scales frozen at 1, its biases trained
    state = torch.load(weights)
    assert state["stem.1.weight"].eq(1).all() and state["stem.1.bias"].ne(0).any()
    assert "2 rows appended" in result.stdout and "step: run as a function" in result.stdout


@pytest.mark.parametrize("args, says", [
    (["--rows", "nope"], "--rows: invalid choice: 'nope'"),
    (["--epochs", "0"], "--epochs: must be a positive integer"),
    (["--min-size", "12"], "--min-size: invalid choice: 12"),
    (["--json", "{missing}/ablation.jsonl"], "cannot append to --json"),
])
def test_ablation_bad_input_exits_2_with_one_line_before_any_row(args, says, tmp_path):
    args = [arg.replace("{missing}", str(tmp_path / "missing")) for arg in args]
    result = run_script("tools/ablation.py", *args, "--json", tmp_path / "out.jsonl", *SMALL) if "--json" not in args \
        else run_script("tools/ablation.py", *args, *SMALL)
    assert result.returncode == 2 and result.stdout == "", result.stdout
    assert result.stderr.count("\n") == 1 and says in result.stderr, result.stderr


def test_ablation_help_names_every_row_and_its_flags_defaults():
    result = run_script("tools/ablation.py", "--help")
    assert result.returncode == 0
    text = re.sub(r"-\s+", "-", " ".join(result.stdout.split()))  # argparse wraps lines at hyphens
    assert all(name in text for name in ablation.ROW_NAMES)
    assert "--rows" in result.stdout and "(default: results/recipe.jsonl, with the recipe's other runs)" in text
    assert "--row " not in result.stdout, "the per-process flag is internal"


# ------------------------------------------------------------------------------------ plot.py

def write_plot_fixture(folder):
    """Real-data reports, a ladder summary and timed opt4/opt5 runs, as the scripts and benchmark.py write them.

    Every row is of today's numbering ("chain": 2), so plot.py takes its names as they are (the older rows' table
    has its own test). Returns plot.py's flags that read them."""
    def run(script, accuracies):
        epochs = [{"epoch": epoch, "test_accuracy": accuracy, "train_seconds": 60.0}
                  for epoch, accuracy in enumerate(accuracies, start=1)]
        return {"script": script, "chain": 2, "data": "cifar10", "device": "cpu", "cpu": "Test CPU (AMX)",
                "threads": 2, "torch": "2.14.1", "steady_images_per_second": 100.0, "epochs": epochs}

    runs = [run("baseline.py", [0.4, 0.5]), run("opt4.py", [0.6, 0.8]), {**run("opt4.py", [0.1]), "data": "synthetic"}]
    rows = [{"name": name, "images_per_second": speed, "tflops": speed * 1.5e9 / 1e12, "ms_per_step": 1000.0,
             "warmup_seconds": 0.5, "peak_memory_gib": 1.0, "percent_of_bf16_peak": speed * 1.5e9 / 1.2e12 * 100}
            for name, speed in [("baseline", 100.0), ("opt4", 300.0)]]
    ladder = {"benchmark": "ladder", "chain": 2, "machine": "Test CPU (AMX)", "threads": 2, "bf16_peak_tflops": 1.2,
              "rows": rows}

    def timed_run(script, flags, sizes, launch_minutes, accuracy, seed=0, optimizer=None, cpu="Test CPU (AMX)",
                  **settings):
        epochs = [{"epoch": epoch, "test_accuracy": accuracy, "launch_seconds": 60 * minutes, "image_size": size,
                   "ms_per_step": size * (10 if optimizer == "muon" else 8), "steps": 390, "images": 50_000}
                  for epoch, (size, minutes) in enumerate(zip(sizes, launch_minutes), start=1)]
        settings = {"seed": seed, **({"optimizer": optimizer} if optimizer else {}), **settings}
        return {"script": script, "chain": 2, "data": "cifar10", "cpu": cpu, "threads": 2,
                "final_test_accuracy": accuracy, "settings": settings,
                "command": f"python {script} {flags} --data-dir /tmp/cifar10 --json results/convergence.jsonl",
                "launch_to_result_seconds": epochs[-1]["launch_seconds"], "epochs": epochs}

    convergence = [timed_run("opt4.py", "--epochs 2", [32, 32], [10.0, 20.0], 0.8),
                   timed_run("opt4.py", "--epochs 2 --seed 1", [32, 32], [11.0, 22.0], 0.8),
                   timed_run("opt5.py", "--epochs 2 --seed 1", [16, 32], [4.0, 10.5], 0.825)]
    # opt4 at --epochs 2 and 5, opt5 at 5 and 6, in the order a sitting might run them
    curve = [timed_run("opt5.py", "--epochs 6", [16, 16, 16, 24, 24, 32], [2, 4, 6, 10, 14, 18.0], 0.86),
             timed_run("opt4.py", "--epochs 2", [32] * 2, [5, 10.0], 0.75),
             timed_run("opt5.py", "--epochs 5", [16, 16, 24, 24, 32], [2, 4, 7, 10, 15.0], 0.82),
             timed_run("opt4.py", "--epochs 5", [32] * 5, [5, 10, 15, 20, 25.0], 0.85)]
    seeds = [timed_run("opt4.py", "--epochs 5 --seed 1", [32] * 5, [5, 10, 15, 20, 26.0], 0.84, seed=1),
             timed_run("opt5.py", "--epochs 5 --seed 1", [16, 16, 24, 24, 32], [2, 4, 7, 10, 15.0], 0.83, seed=1),
             timed_run("opt4.py", "--epochs 4 --seed 1", [32] * 4, [5, 10, 15, 20.0], 0.8, seed=1)]

    # One CPU: opt4 at its default; opt5 with AdamW (one run from before --optimizer: AdamW) and with Muon (from
    # before --ns-steps: 5 steps)
    muon = [timed_run("opt4.py", "--epochs 5", [32] * 5, [5, 10, 15, 20, 25.0], 0.85),
            timed_run("opt5.py", "--epochs 5", [16, 16, 24, 24, 32], [2, 4, 7, 10, 15.0], 0.82),
            timed_run("opt5.py", "--epochs 6", [16, 16, 24, 24, 32, 32], [2, 4, 7, 10, 15, 20.0], 0.84,
                      optimizer="adamw"),
            timed_run("opt5.py", "--epochs 4", [16, 16, 24, 32], [2.5, 5, 9, 16.0], 0.845, optimizer="muon"),
            timed_run("opt5.py", "--epochs 5", [16, 16, 24, 24, 32], [2.5, 5, 9, 13, 18.0], 0.865, optimizer="muon")]
    # Another: Muon with 3 steps at --epochs 4 and AdamW at 5, three seeds each
    other = {"cpu": "Other CPU (AVX-512 BF16)"}
    muon_other_cpu = [timed_run("opt4.py", "--epochs 5", [32] * 5, [4, 8, 12, 16, 20.0], 0.85, **other)]
    for seed, (muon_minutes, muon_accuracy, adamw_minutes, adamw_accuracy) in enumerate(
            [(12.0, 0.853, 12.6, 0.835), (12.5, 0.856, 12.9, 0.838), (13.0, 0.850, 13.2, 0.832)]):
        muon_other_cpu += [
            timed_run("opt5.py", f"--epochs 4 --seed {seed}", [16, 16, 24, 32], [2, 4, 8, muon_minutes],
                      muon_accuracy, seed=seed, optimizer="muon", ns_steps=3, **other),
            timed_run("opt5.py", f"--epochs 5 --seed {seed} --optimizer adamw", [16, 16, 24, 24, 32],
                      [2, 4, 7, 10, adamw_minutes], adamw_accuracy, seed=seed, optimizer="adamw", **other)]

    def ablation_row(row, change, views, monitor, synthetic=False):
        epochs = [{"test_accuracy": monitor, "test_images": 1000}, {"test_accuracy": views[1], "test_images": 10000}]
        return {"row": row, "chain": 2, "change": change, "data": "synthetic" if synthetic else "cifar10",
                "epochs": epochs,
                "1_view": views[0], "2_views": views[1], "6_views": views[2], "extra_view_seconds": 60.0,
                "launch_to_result_seconds": 900.0}

    ablation = [ablation_row("shipped", "opt5 as shipped", [0.81, 0.82, 0.83], 0.6),
                ablation_row("ema", "EMA of the weights", [0.8, 0.81, 0.82], 0.55),
                ablation_row("ema", "EMA of the weights", [0.1, 0.1, 0.1], 0.1, synthetic=True)]
    def gpu_run(script, flags, images_per_second, accuracy, sizes=(None,) * 3):
        epochs = [{"train_seconds": 5.0 if epoch == 1 else 1.0, "images": 50_000, "steps": 390, "image_size": size,
                   "test_accuracy": accuracy} for epoch, size in enumerate(sizes, start=1)]
        steady = images_per_second if sizes[0] is None else None
        return {"script": script, "chain": 2, "data": "cifar10", "device": "cuda", "device_name": "Test GPU",
                "threads": 16,
                "cpu": "Test CPU (AMX)", "torch": "2.11.0", "final_test_accuracy": accuracy,
                "command": f"python {script} {flags} --epochs 5 --data-dir /tmp/c10 --device cuda --json gpu.jsonl",
                "steady_images_per_second": steady, "steady_ms_per_step": steady and 6.4e4 / steady,
                "total_seconds": 20.0, "launch_to_result_seconds": 30.0, "peak_memory_bytes": 2**30,
                "settings": {"batch_size": 64 if script == "baseline.py" else 128}, "epochs": epochs}

    # Three runs on a GPU, before rows recorded their commit (its folder's name has it), the first run last; then
    # two at a newer commit, one of them twice (the later row counts), whose opt4 replaces the older one's
    (folder / "gpu-abc1234").mkdir()
    gpu = [gpu_run("opt4.py", "", 40_000.0, 0.85), gpu_run("baseline.py", "", 5_000.0, 0.75),
           gpu_run("opt5.py", "--optimizer adamw", None, 0.84, sizes=(16, 16, 32)),
           {**gpu_run("opt4.py", "", 1.0, 0.1), "data": "synthetic"}]
    (folder / "gpu-abc1234" / "chain.jsonl").write_text("".join(json.dumps(line) + "\n" for line in gpu))
    (folder / "gpu-def5678").mkdir()
    newer = [{**gpu_run("opt4.py", "", 64_000.0, 0.86), "date": "2026-11-28T05:00:00", "commit": "def5678"},
             {**gpu_run("opt3.py", "", 16_000.0, 0.83), "date": "2026-11-28T04:00:00", "commit": "def5678"},
             {**gpu_run("opt4.py", "", 2.0, 0.2), "date": "2026-11-28T04:30:00", "commit": "def5678"}]
    (folder / "gpu-def5678" / "chain.jsonl").write_text("".join(json.dumps(line) + "\n" for line in newer))
    recipe = [{**timed_run("opt5.py", "--epochs 3 --batch-size 512 --validation 5000", [16, 16, 32], [5, 10, 30.0],
                           0.9, validation=5000), "training_flops": 2.5e15, "modelled_h200_seconds": 1.234},
              {**timed_run("opt5.py", "--epochs 2", [16, 32], [5, 12.0], 0.85, validation=0),
               "training_flops": 1e15, "modelled_h200_seconds": 0.5}]
    # opt5's defaults, scored on the test set (seeds 1 and 0), on the held-out images, and on part of the test set
    for seed, validation, accuracy in [(1, 0, 0.905), (0, 0, 0.9), (0, 5000, 0.95), (2, 0, 0.5)]:
        recipe.append({**timed_run("opt5.py", f"--seed {seed}", [16, 16, 32], [5, 10, 30.0], accuracy, seed=seed,
                                   validation=validation, **plot.RECIPE),
                       "training_flops": 2.5e15, "modelled_h200_seconds": 4.08})
    for run, test_images in zip(recipe, [5000, 10000, 10000, 10000, 5000, 1000]):
        run["epochs"][-1]["test_images"] = test_images
        for record in run["epochs"]:
            record["steps"] = 390
    # ablation.py's rows: shipped (seed 2: a third seed of the defaults), a row that changes a flag, one that changes
    # code (its settings are the defaults'), a shipped row at 10 epochs (not at the recipe's length); the defaults
    # at 10 epochs, and at 15 on another CPU
    defaults = {**plot.RECIPE, "validation": 0}
    for row, accuracy, settings in [("shipped", 0.91, {}), ("adamw", 0.88, {"optimizer": "adamw"}), ("ema", 0.95, {}),
                                    ("shipped", 0.5, {"epochs": 10, "seed": 3})]:
        recipe.append({**timed_run("ablation.py", f"--rows {row} --seed 2", [16, 16, 32], [5, 10, 31.0], accuracy,
                                   **{**defaults, "seed": 2, **settings}), "script": "opt5.py", "row": row,
                       "change": f"{row} instead", "1_view": accuracy - 0.01, "2_views": accuracy,
                       "6_views": accuracy + 0.002, "training_flops": 2.5e15, "modelled_h200_seconds": 4.08})
    recipe += [{**timed_run("opt5.py", f"--epochs {epochs} --seed 0", [16, 24, 32], [3, 6, 15.0], 0.88, cpu=cpu,
                            **{**defaults, "epochs": epochs}), "training_flops": 1.2e15, "modelled_h200_seconds": 2.04}
               for epochs, cpu in [(10, "Test CPU (AMX)"), (15, "Other CPU (AVX-512 BF16)")]]
    for run in recipe[-6:]:
        run["epochs"][-1]["test_images"] = 10000
    (folder / "recipe.jsonl").write_text("".join(json.dumps(line) + "\n" for line in recipe))
    for name, lines in (("runs", runs), ("ladder", [ladder]), ("convergence", convergence), ("curve", curve),
                        ("seeds", seeds), ("ablation", ablation), ("muon", muon), ("muon-other-cpu", muon_other_cpu)):
        (folder / f"{name}.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    return ["--gpu", folder / "gpu-def5678" / "chain.jsonl", folder / "gpu-abc1234" / "chain.jsonl",
            "--recipe", folder / "recipe.jsonl",
            "--runs", folder / "runs.jsonl",
            "--ladder", folder / "ladder.jsonl",
            "--convergence", folder / "convergence.jsonl", "--curve", folder / "curve.jsonl",
            "--seeds", folder / "seeds.jsonl", "--ablation", folder / "ablation.jsonl",
            "--muon", folder / "muon.jsonl", folder / "muon-other-cpu.jsonl"]


@pytest.fixture(scope="module")
def tables(tmp_path_factory):
    """What `plot.py --tables` prints for the fixture's data (run once: each run counts Muon's FLOPs)."""
    result = run_script("tools/plot.py", "--tables", *write_plot_fixture(tmp_path_factory.mktemp("plot")))
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_plot_draws_the_figures_from_json_lines(tmp_path):
    pytest.importorskip("matplotlib", reason="plot.py needs matplotlib (pip install -r requirements-dev.txt)")
    data = write_plot_fixture(tmp_path)
    gpu, cpu = tmp_path / "figure.png", tmp_path / "cpu.png"
    result = run_script("tools/plot.py", *data, "--out", gpu, "--cpu-out", cpu)
    assert result.returncode == 0, result.stderr
    for out in (gpu, cpu):
        assert out.read_bytes().startswith(b"\x89PNG") and 10_000 < out.stat().st_size < 200_000


def modelled(sizes, muon):
    """The H200 model over a plot fixture run's epochs at `sizes` (390 steps of 50,000 images each), whatever the row
    stores: plot.py recomputes it (the model itself has its own test)."""
    return f"{sum(390 * accounting.modelled_h200_step_seconds(50_000 / 390, size, muon) for size in sizes):.2f}"


def test_plot_tables_the_recipe_runs_with_their_work_and_what_scored_them(tables):
    # the validation run: 3 epochs of 390 steps (the fixture's), its sizes counted, scored on the held-out images
    assert f"| `--epochs 3 --batch-size 512 --validation 5000` | 16 x2, 32 x1 | 1170 | 2.50 | " \
           f"{modelled([16, 16, 32], muon=False)} | validation (5,000) | 90.00 | 30.0 |" in tables
    assert f"| `--epochs 2` | 16 x1, 32 x1 | 780 | 1.00 | {modelled([16, 32], muon=False)} | test (10,000) | 85.00 " \
           "| 12.0 |" in tables
    # opt5's defaults on the whole test set: seeds 0 and 1, not the held-out run or the one on 1,000 test images
    # opt5's defaults on the whole test set: seeds 0 and 1 of opt5.py and ablation.py's shipped row (seed 2), not
    # its other rows (the ema row's settings are the defaults'), the held-out run or the one on 1,000 test images
    assert "opt5's defaults (the recipe) on the test set: **90.50 %**, the mean of 3 seeds (0, 1, 2: 90.00, 90.50, " \
           f"91.00), in {modelled([16, 16, 32], muon=True)} modelled H200 seconds" in tables


def test_plot_tables_the_recipes_curve_after_opt4s_reference_run_on_the_same_cpu(tables):
    curve = tables[tables.index("The recipe's curve:"):].split("\n\n")[1].splitlines()
    # opt4 --epochs 5 on the CPU of the recipe's runs, the last run of each seed (seed 0 is in two files), not its
    # --epochs 2 or another CPU's; its work counted as opt5 counts its own
    records = [{"steps": 390, "images": 50_000, "image_size": 32}] * 5
    work = accounting.count_work([dict(record) for record in records], 0, muon=False)
    assert curve[2:] == [
        f"| opt4 `--epochs 5` (reference) | 32 x5 | 0, 1 | 84.50 (85.00, 84.00) | 1950 "
        f"| {work['training_flops'] / 1e15:.2f} | {work['modelled_h200_seconds']:.2f} | 25.5 |",
        f"| opt5 `--epochs 10` | 16 x1, 24 x1, 32 x1 | 0, 3 | 69.00 (88.00, 50.00) | 1170 | 1.20 "
        f"| {modelled([16, 24, 32], muon=True)} | 23.0 |",
        f"| opt5 `--epochs 20` (default) | 16 x2, 32 x1 | 0, 1, 2 | 90.50 (90.00, 90.50, 91.00) | 1170 | 2.50 "
        f"| {modelled([16, 16, 32], muon=True)} | 30.3 |"]  # the 15-epoch run is the other CPU's


def test_plot_tables_the_recipes_ablation_rows_against_the_mean_of_its_seeds(tables):
    rows = tables[tables.index("The recipe's ablation:"):].split("\n\n")[1].splitlines()[2:]
    muon, adamw = modelled([16, 16, 32], muon=True), modelled([16, 16, 32], muon=False)
    assert rows == [f"| shipped | shipped instead | 2 | 91.00 | +0.50 | 90.00 | 91.20 | {muon} | 31.0 |",
                    f"| adamw | adamw instead | 2 | 88.00 | -2.50 | 87.00 | 88.20 | {adamw} | 31.0 |",
                    f"| ema | ema instead | 2 | 95.00 | +4.50 | 94.00 | 95.20 | {muon} | 31.0 |"]


def test_plot_tables_the_gpu_runs_in_the_chains_order_with_their_commit(tables):
    """The newest row of each script: a newer file's (its latest by date) before an older file's, each with its
    folder's commit, in the chain's order."""
    assert "Test GPU, 16 threads of an Test CPU (AMX), torch 2.11.0, commits abc1234 (baseline, opt5), " \
           "def5678 (opt3, opt4):" in tables
    assert "| baseline.py | 5,000 | 1.00x | 12.8 (64) | 75.00 | 30.0 | 5.0 | 10.0 | 1.00 | abc1234 |" in tables
    assert "| opt3.py | 16,000 | 3.20x | 4.0 (128) | 83.00 | 30.0 | 5.0 | 10.0 | 1.00 | def5678 |" in tables
    assert "| opt4.py | 64,000 | 12.80x | 1.0 (128) | 86.00 | 30.0 | 5.0 | 10.0 | 1.00 | def5678 |" in tables
    assert "| opt5.py --optimizer adamw | 50,000 at 16 px | - | 2.6 at 16 px (128) | 84.00 |" in tables
    assert "| opt4.py | 40,000 |" not in tables and "| opt4.py | 2 |" not in tables, \
        "the older file's opt4 and the newer file's earlier row: left out"
    assert tables.index("| baseline.py |") < tables.index("| opt3.py |") < tables.index("| opt4.py |") < \
        tables.index("| opt5.py --optimizer")
    assert "| peak memory GiB | commit |" in tables


def test_plot_draws_and_tables_a_ladder_from_a_cpu_without_a_bfloat16_unit(tmp_path):
    pytest.importorskip("matplotlib", reason="plot.py needs matplotlib (pip install -r requirements-dev.txt)")
    data = write_plot_fixture(tmp_path)
    ladder = json.loads((tmp_path / "ladder.jsonl").read_text())
    ladder.update(bf16_peak_tflops=None, float32_peak_tflops=0.18)  # what benchmark.py writes on such a CPU
    ladder["rows"] = [{**row, "percent_of_bf16_peak": None} for row in ladder["rows"]]
    (tmp_path / "ladder.jsonl").write_text(json.dumps(ladder) + "\n")
    tables = run_script("tools/plot.py", "--tables", *data)
    assert tables.returncode == 0, tables.stderr
    assert "| opt4 | 300 | 1000.0 | 0.5 | 1.00 | 0.450 | n/a |" in tables.stdout
    assert run_script("tools/plot.py", *data, "--out", tmp_path / "figure.png", "--cpu-out", tmp_path / "cpu.png"
                      ).returncode == 0


def test_plot_tables_print_the_latest_real_data_run_of_each_script(tables):
    assert "| `baseline.py` | 40.0 | 50.0 | 2.0 | 100 |" in tables
    assert "| `opt4.py` | 60.0 | 80.0 | 2.0 | 100 |" in tables  # the synthetic run is not the data
    assert "| opt4 | 300 | 1000.0 | 0.5 | 1.00 | 0.450 | 38 |" in tables
    # Each timed run against the mean of opt4's (21 minutes); the flags without the data and JSON paths
    assert "| `opt4.py` | `--epochs 2` | 32, 32 | 80.0 | 20.0 | 95% |" in tables
    assert "| `opt5.py` | `--epochs 2 --seed 1` | 16, 32 | 82.5 | 10.5 | 50% |" in tables


def test_plot_reads_opt5_against_opt4_at_equal_time_off_the_curves(tables):
    # Each curve run against opt4 --epochs 5 (25 minutes)
    assert "| `opt5.py` | `--epochs 6` | 16, 16, 16, 24, 24, 32 | 86.0 | 18.0 | 72% |" in tables
    # opt4 at opt5's 15 minutes: 75 + (85 - 75) x (15 - 10) / (25 - 10) = 78.3 %
    assert "opt5 reaches 82.0 % in 15.0 min; opt4 trained for the same time: 78.3 % (interpolated), so opt5 is " \
           "+3.7 points ahead." in tables
    # 85 % on opt5's curve: 15 + (18 - 15) x (85 - 82) / (86 - 82) = 17.25 minutes, 69 % of opt4's 25
    assert "opt5 reaches opt4's `--epochs 5` accuracy (85.0 % in 25.0 min) at 17.2 min (interpolated): 69% of " \
           "opt4's time." in tables


def test_plot_gives_each_scripts_seeds_their_mean_and_spread_and_reads_opt4s_mean_off_opt5s_curve(tables):
    # Only runs at --epochs 5 count: opt4 85 (seed 0) and 84 (seed 1), opt5 82 and 83
    assert "- At `--epochs 5`: opt4 85.00, 84.00 % (seeds 0, 1: mean 84.50, spread 1.00 points); opt5 82.00, " \
           "83.00 % (seeds 0, 1: mean 82.50, spread 1.00 points)." in tables
    # 84.5 % on opt5's seed-0 curve: 15 + (18 - 15) x (84.5 - 82) / (86 - 82) = 16.9 minutes, 68 % of opt4's 25
    assert "- opt5's seed-0 curve reaches opt4's mean (84.50 %) at 16.9 min (interpolated): 68% of opt4's seed-0 " \
           "time." in tables


def test_plot_tables_the_ablation_against_the_shipped_row_and_extra_views_against_training(tables):
    assert "| shipped | opt5 as shipped | 82.00 | +0.00 | 81.00 | 83.00 | 15.0 | 60 | 60.0 (1000) |" in tables
    assert "| ema | EMA of the weights | 81.00 | -1.00 | 80.00 | 82.00 | 15.0 | 60 | 55.0 (1000) |" in tables
    # 60 s more training from opt5 --epochs 5 (82 % at 15 min) on its curve to --epochs 6 (86 % at 18 min): +1.3
    assert "add +1.0 points to opt5 as shipped for 60 s; the same seconds spent training: +1.3 points" \
        in tables


def test_plot_curve_summary_says_what_the_curves_do_not_reach():
    def run(script, minutes, accuracy, epochs):
        return {"script": script, "launch_to_result_seconds": 60 * minutes, "final_test_accuracy": accuracy,
                "epochs": [{}] * epochs}

    slow_opt4 = [run("opt4.py", 20.0, 0.8, 4), run("opt4.py", 25.0, 0.85, 5)]
    low_opt5 = [run("opt5.py", 12.0, 0.8, 5), run("opt5.py", 15.0, 0.83, 6)]
    first, second = plot.curve_summary(slow_opt4 + low_opt5)
    assert "opt4's curve (20.0-25.0 min) does not span that time" in first
    assert "opt5 does not reach opt4's `--epochs 5` accuracy (85.0 % in 25.0 min) within its runs (up to " \
           "`--epochs 6`)" in second
    assert plot.curve_summary(low_opt5) == ["Curve summary: not measured (it needs opt4 and opt5 at --epochs 5)."]


def test_plot_reads_muon_against_adamw_at_equal_time_and_the_cost_of_its_step(tables):
    # Muon's 4 epochs end at 16 min, between AdamW's 5 (15 min, 82 %) and 6 (20 min, 84 %): 82.4 % there
    assert "- Muon, `--epochs 4`, seed 0: 84.5 % in 16.0 min; AdamW at the same time: 82.4 % (interpolated): " \
           "+2.1 points." in tables
    assert "- Muon, `--epochs 5`, seed 0: 86.5 % in 18.0 min; AdamW at the same time: 83.2 % (interpolated): " \
           "+3.3 points." in tables
    # opt4's 85 % in 25 min: on Muon's curve between 16 min (84.5 %) and 18 min (86.5 %)
    assert "- Muon reaches opt4's `--epochs 5` accuracy (85.0 % in 25.0 min) at 16.5 min (interpolated): 66% of " \
           "opt4's time." in tables
    # ms per step at each size from each optimizer's longest run; the update's FLOPs counted by torch
    assert "16x16: 128 and 160 ms (Muon's update 20% of its step); 24x24: 192 and 240 ms" in tables
    flops = re.findall(r"Muon's update with (\d) Newton-Schulz steps: ([\d.]+) GFLOP per step", tables)
    # Newton-Schulz on each of the 12 filters alone (opt5's loop); each step's work is the same
    assert [steps for steps, _ in flops] == ["5", "3"] and float(flops[0][1]) == pytest.approx(45.5, abs=0.1)
    assert float(flops[1][1]) == pytest.approx(45.5 * 3 / 5, rel=0.01)
    assert "the training step's 49 at 16x16, 109 at 24x24, 194 at 32x32 GFLOP" in tables


def test_plot_tables_each_cpus_muon_runs_with_the_seeds_means_at_equal_time(tables):
    first, second = tables.index("Test CPU with AMX, 2 threads (CPU), Muon with 5 Newton-Schulz steps:"), \
        tables.index("Other CPU with AVX-512 BF16, 2 threads (CPU), Muon with 3 Newton-Schulz steps:")
    assert first < second
    other_cpu = tables[second:]
    assert "| `opt5.py` | `--epochs 4 --seed 2` | 16, 16, 24, 32 | 85.0 | 13.0 | 65% |" in other_cpu  # of its opt4's
    assert "- Muon at `--epochs 4`, seeds 0, 1, 2: 85.30, 85.60, 85.00 % (mean 85.30, spread 0.60 points), " \
           "12.5 min on average." in other_cpu
    assert "- AdamW at `--epochs 5`, seeds 0, 1, 2: 83.50, 83.80, 83.20 % (mean 83.50, spread 0.60 points), " \
           "12.9 min on average." in other_cpu
    assert "- Muon at `--epochs 4` against AdamW at `--epochs 5`, the nearest in time, seed means: +1.80 points in " \
           "97% of AdamW's time." in other_cpu
    # Muon's seed-0 run is past opt4's accuracy in 60 % of its time: a run, not a point between two
    assert "- Muon reaches opt4's `--epochs 5` accuracy (85.0 % in 20.0 min) at 12.0 min (its `--epochs 4` run): 60% " \
           "of opt4's time." in other_cpu


def test_plot_without_matplotlib_says_how_to_install_it(tmp_path):
    data = write_plot_fixture(tmp_path)
    hide_matplotlib = "import runpy, sys; sys.modules['matplotlib'] = None; sys.argv = sys.argv[1:]; " \
                      "runpy.run_path('tools/plot.py', run_name='__main__')"
    result = run_script("-c", hide_matplotlib, "tools/plot.py", *data, "--out", tmp_path / "figure.png",
                        "--cpu-out", tmp_path / "cpu.png")
    assert result.returncode == 2 and result.stderr.count("\n") == 1
    assert "pip install matplotlib" in result.stderr


def test_plot_names_a_missing_data_file(tmp_path):
    result = run_script("tools/plot.py", "--runs", tmp_path / "none.jsonl")
    assert result.returncode == 2 and "none.jsonl" in result.stderr and "Traceback" not in result.stderr


def test_plot_reads_older_rows_by_todays_names_and_diffs_a_script_under_its_name_then(tmp_path):
    older = {"script": "opt3.py", "date": "2026-11-25T10:00:00", "change": "opt4 as shipped"}
    scripts = ["baseline.py", "opt3.py", "opt4.py", "opt5.py"]
    assert [plot.read_row({**older, "script": script})["script"] for script in scripts] == \
        ["baseline.py", "opt4.py", "opt5.py", "opt6.py"]
    assert plot.read_row(older)["ran_as"] == "opt3.py" and plot.read_row(older)["change"] == "opt5 as shipped"
    assert plot.read_row({**older, "script": "opt4.py", "date": "2026-11-23T12:00:00"})["script"] == "opt6.py", \
        "before e8e4e0a opt4.py was the DDP script"
    ladder = plot.read_row({"benchmark": "ladder", "rows": [{"name": "opt3 eager"}, {"name": "opt2, 0 workers"}]})
    assert [row["name"] for row in ladder["rows"]] == ["opt4 eager", "opt2, 0 workers"]
    today = plot.read_row({**older, "chain": 2})
    assert (today["script"], today["change"]) == ("opt3.py", "opt4 as shipped"), "a chain-2 row is taken as it is"

    if shutil.which("git") is None:
        pytest.skip("no git to diff a script against its commit")
    # A commit of the older numbering (opt3.py the captured step, opt4.py the recipe); today both moved up by one,
    # the captured step's report call changed, and a module it called then is gone, its function now common's
    git = ["git", "-c", "user.name=test", "-c", "user.email=test@example.com"]
    subprocess.run([*git, "init", "-q"], cwd=tmp_path, check=True)
    (tmp_path / "opt3.py").write_text("import lab_module_since_dissolved\nstep = 'captured'\n"
                                      "lab_module_since_dissolved.check(run)\nlab_module_since_dissolved.report(run)\n")
    (tmp_path / "opt4.py").write_text("step = 'recipe'\n")
    subprocess.run([*git, "add", "opt3.py", "opt4.py"], cwd=tmp_path, check=True)
    subprocess.run([*git, "commit", "-q", "-m", "older numbering"], cwd=tmp_path, check=True)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=tmp_path, capture_output=True,
                            text=True, check=True).stdout.strip()
    (tmp_path / "opt4.py").write_text("step = 'captured'\ncommon.check(run)\ncommon.report(run, extra={})\n")
    (tmp_path / "opt5.py").write_text("step = 'recipe'\n")
    (tmp_path / "tools").mkdir()  # changed_since reads git and the scripts in the folder above plot.py's
    shutil.copy(ROOT / "tools" / "plot.py", tmp_path / "tools" / "plot.py")
    spec = importlib.util.spec_from_file_location("plot_in_the_older_checkout", tmp_path / "tools" / "plot.py")
    plot_there = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(plot_there)
    assert plot_there.changed_since(commit, {"opt4.py": "opt3.py", "opt5.py": "opt4.py"}) == []
    assert plot_there.changed_since(commit, {"opt4.py": "opt4.py"}) == ["opt4.py"], "the same name then: the recipe"
    old_lines = ["import os", "import lab_module_since_dissolved", "os.x(lab_module_since_dissolved.y)"]
    assert plot_there.as_today(old_lines) == ["import os", "os.x(common.y)"], "os is still there: not read as common"
    assert plot_there.changed_since("0000000", {"opt4.py": "opt3.py"}) is None

    # Runs from two commits: each script against its own run's commit
    subprocess.run([*git, "add", "opt4.py", "opt5.py"], cwd=tmp_path, check=True)
    subprocess.run([*git, "commit", "-q", "-m", "today's numbering"], cwd=tmp_path, check=True)
    newer = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=tmp_path, capture_output=True,
                           text=True, check=True).stdout.strip()
    (tmp_path / "opt5.py").write_text("step = 'recipe, changed'\n")
    runs = {"opt4.py": [{"script": "opt4.py", "ran_as": "opt3.py", "commit": commit}],
            "opt5.py": [{"script": "opt5.py", "ran_as": "opt5.py", "commit": newer}]}
    assert plot_there.changed_since_their_rows(runs) == {commit: [], newer: ["opt5.py"]}
    assert plot_there.changed_since_their_rows({**runs, "opt4.py": [{**runs["opt4.py"][0], "commit": "0000000"}]}) \
        is None


# -------------------------------------------------------------- the front page against the data

def json_lines(name):
    """The rows of results/`name` as plot.py reads them: each script by today's name."""
    return plot.read_lines(ROOT / "results" / name)


def readme_chain_table():
    """The README's chain table: {script: its cells}, the script's name without the row's commit."""
    lines = (ROOT / "README.md").read_text().splitlines()
    return {cells[0].split("`")[1]: [cell.strip() for cell in cells]
            for cells in (line.split("|")[1:-1] for line in lines if line.startswith("| `")) if len(cells) == 5}


def spread(values, digits):
    """`values` as the README writes a spread: mean ± sample std, at `digits` decimals."""
    return f"{statistics.mean(values):.{digits}f} ± {statistics.stdev(values):.{digits}f}"


def h200_recipe_runs(commit):
    """The H200 runs of the recipe at its defaults at `commit`."""
    return [run for run in json_lines(f"h200-{commit}/chain.jsonl") if run["script"] == "opt5.py"
            and all(run["settings"].get(name) == value for name, value in plot.RECIPE.items())]


def test_readme_chain_table_is_the_gpus_rows_each_with_its_commit_and_says_whose_code_changed_since():
    readme, table = (ROOT / "README.md").read_text(), readme_chain_table()
    gpu = plot.at_defaults(plot.gpu_runs([ROOT / path for path in plot.GPU_RUNS]))
    rows = {row["name"]: row for row in benchmark.chain_rows(gpu)}
    commit = {name: runs[0]["commit"] for name, runs in gpu.items()}
    where_from = readme[readme.index("**Where the numbers come from:**"):readme.index("## Run")]
    assert all(row_commit in where_from for row_commit in plot.commits(gpu))
    assert list(table) == list(ALL_SCRIPTS) and "| H200 images/s" in readme
    recipe = h200_recipe_runs(commit["opt5.py"])
    for script, row in rows.items():
        name, _, speed, accuracy, launch_to_result = table[script]
        assert name == f"`{script}` ({commit[script]})", script
        assert speed == benchmark.per_size(row["images_per_second"], ",.0f"), script
        if script == "opt5.py":  # the recipe: every run of it at its defaults, as a mean and spread
            n = f" (n = {len(recipe)})"
            assert (accuracy, launch_to_result) == (
                spread([100 * run["final_test_accuracy"] for run in recipe], 2) + n,
                spread([run["launch_to_result_seconds"] for run in recipe], 1) + n)
        else:
            assert (accuracy, launch_to_result) == (f"{100 * row['test_accuracy']:.2f}",
                                                    f"{row['launch_to_result_seconds']:.1f}"), script
    assert table["opt6.py"][2] == "not run on a GPU"
    assert f"the rows below add up to {sum(row['launch_to_result_seconds'] for row in rows.values()) / 60:.1f} " \
           "minutes" in readme
    # What each optimization bought on the GPU, in "What to copy first": ratios and differences of the rows
    speed = {script: row["images_per_second"].get("all") for script, row in rows.items()}
    accuracy = {script: 100 * row["test_accuracy"] for script, row in rows.items()}
    launch_to_result = {script: row["launch_to_result_seconds"] for script, row in rows.items()}
    steps = {script: row["ms_per_step"].get("all") for script, row in rows.items()}
    compiled = next(run for run in json_lines(f"h200-{commit['opt4.py']}/chain.jsonl")
                    if run["script"] == "opt4.py" and run["settings"]["compile"])
    opt5 = gpu["opt5.py"][0]
    at_size = {size: min(epoch["ms_per_step"] for epoch in opt5["epochs"] if epoch["image_size"] == size)
               for size in (16, 32)}
    for bought in (f"H200: with compile {speed['opt1.py'] / speed['baseline.py']:.2f}x images/s",
                   f"H200: +{accuracy['opt2.py'] - accuracy['opt1.py']:.2f} points after 5 epochs over opt1 (one run",
                   f"H200, at {commit['opt4.py']}: {speed['opt3.py'] / speed['opt2.py']:.1f}x opt2's images/s alone "
                   f"(opt3), {speed['opt4.py'] / speed['opt2.py']:.1f}x with the next row",
                   f"H200, opt4's model: {compiled['steady_ms_per_step'] / steps['opt4.py']:.2f}x its ms a step, "
                   f"{compiled['launch_to_result_seconds'] / launch_to_result['opt4.py']:.1f}x its seconds from launch "
                   f"({compiled['launch_to_result_seconds']:.1f} s)",
                   f"+{accuracy['opt5.py'] - accuracy['opt4.py']:.1f} points for "
                   f"{100 * (launch_to_result['opt5.py'] / launch_to_result['opt4.py'] - 1):.0f} % more time than opt4",
                   f"H200: {steps['opt4.py']:.2f} ms a step at batch 128, opt3's loop {steps['opt3.py']:.2f} "
                   f"({steps['opt3.py'] / steps['opt4.py']:.1f}x)",
                   f"H200: {at_size[16]:.2f} ms a 16-px step, {at_size[32]:.2f} ms a 32-px one (batch 512)"):
        assert bought in " ".join(readme.split()), bought
    changed = plot.changed_since_their_rows(gpu)
    if changed is None:
        pytest.skip("no git history here to tell which scripts changed since their rows' commits")
    changed = {script for scripts in changed.values() for script in scripts}
    sentence = " ".join(readme[readme.index("Changed since their rows:"):].split("\n\n")[0].split())
    named = {f"{name}.py" for name in re.findall(r"\b(opt\d)\b", sentence.split(": today's code")[0])}
    assert named == changed and "today's code not measured on a GPU" in sentence


def test_readmes_zero_ops_outside_the_graph_is_the_h200_trace_counted_by_eager_ops():
    # 38c59a9's opt3.py was today's opt4.py (the captured step), compiled: every op inside the graph
    result = run_script("tools/eager_ops.py", "results/h200-38c59a9/opt3-trace.json.gz")
    assert "outside compiled code: 0.0 (each step: 0, 0, 0, 0, 0, 0)" in result.stdout, result.stderr
    assert "0 ops a step outside the graph (38c59a9's trace, compiled)" in (ROOT / "README.md").read_text()


def test_readmes_first_screen_says_what_the_first_command_gives_on_the_h200_and_a_cpu():
    lines = (ROOT / "README.md").read_text().splitlines()
    first_screen = " ".join(lines[:40])
    first_command = next(line for line in lines if line.startswith("python ")).split("#")[0].strip()
    assert first_command == "python opt5.py"
    h200 = h200_recipe_runs(readme_chain_table()["opt5.py"][0].split("(")[1].rstrip(")"))
    cpu = plot.recipe_runs(json_lines("recipe.jsonl"))
    assert f"| `{first_command}` | **{spread([100 * run['final_test_accuracy'] for run in h200], 2)} % " \
           f"(n = {len(h200)}), {spread([run['launch_to_result_seconds'] for run in h200], 1)} s from launch** | " \
           f"{spread([100 * run['final_test_accuracy'] for run in cpu], 2)} % (n = {len(cpu)}), " \
           f"{spread([run['launch_to_result_seconds'] / 60 for run in cpu], 1)} min (AMD EPYC with AVX-512 BF16) |" \
           in first_screen
    opt4 = [run for name in ("curve.jsonl", "seeds.jsonl") for run in json_lines(name)
            if run["script"] == "opt4.py" and len(run["epochs"]) == 5]
    assert {run["cpu"] for run in opt4} == {"Intel Xeon (AMX-BF16)"}
    accuracies, minutes = ([100 * run["final_test_accuracy"] for run in opt4],
                           [run["launch_to_result_seconds"] / 60 for run in opt4])
    assert f"| `python opt4.py --epochs 5` | its row below | {spread(accuracies, 2)} % (n = {len(opt4)}), " \
           f"{spread(minutes, 1)} min" in first_screen
    tests = json_lines("tests.jsonl")[-1]
    assert f"{tests['passed']} passed, {tests['skipped']} skipped in {tests['seconds'] / 60:.1f} min" in first_screen


def test_readme_is_a_front_page_of_at_most_90_lines_its_copy_cells_short_and_each_figure_once():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 90
    copy_rows = text[text.index("## What to copy first"):].split("\n\n")[1].splitlines()[2:]
    for row in copy_rows:
        cells = [cell.strip() for cell in row.split("|")[1:-1]]
        assert all(len(cell.split()) <= 40 for cell in cells), cells[0]
        first = cells[3].split(";")[0]
        assert "H200" in first or "GPU" in first, f"{cells[0]}: the GPU figure first"
    # each figure of ours once; the first screen repeats the first command's row (the recipe's) alone
    prose = re.sub(r"```.*?```", "", text, flags=re.S)
    figures = collections.Counter(re.findall(r"(?<![\w.-])(\d[\d,]*\.\d+) ?(%|s\b|ms|min|x\b)", prose))
    repeated = {figure for (figure, _), count in figures.items() if count > 1}
    recipe = readme_chain_table()["opt5.py"]
    assert repeated <= set(re.findall(r"\d+\.\d+", recipe[3] + recipe[4])), repeated


def test_readme_cpu_figures_are_the_measured_data():
    def last_ladder(name):
        ladder = [line for line in json_lines(name) if line.get("benchmark") == "ladder"][-1]
        return {row["name"]: row["images_per_second"] for row in ladder["rows"]}

    readme = (ROOT / "README.md").read_text()
    bf16, float32 = last_ladder("ladder.jsonl"), last_ladder("ladder-avx2.jsonl")
    for bought in (f"CPU with a bfloat16 unit: {bf16['opt1 eager'] / bf16['baseline']:.2f}x (ladder)",
                   f"{bf16['opt1'] / bf16['opt1 eager']:.2f}x images/s (CPU with bfloat16), "
                   f"{float32['opt1'] / float32['opt1 eager']:.2f}x (CPU without)",
                   f"none on a CPU ({bf16['opt4'] / bf16['opt2, 0 workers']:.2f}x, "
                   f"{float32['opt4'] / float32['opt2, 0 workers']:.2f}x)"):
        assert bought in readme, bought
    curve = plot.convergence_runs(json_lines("curve.jsonl"))
    ahead = re.search(r"so opt5 is ([+-][\d.]+) points ahead", plot.curve_summary(curve)[0]).group(1)
    assert f"{ahead} points at equal time (CPU runs, AdamW)" in readme
    muon = plot.convergence_runs(json_lines("muon-xeon-amx.jsonl"))
    at_equal_time = re.search(r"Muon at `--epochs \d` against AdamW at `--epochs \d`, the nearest in time, seed "
                              r"means: ([+-][\d.]+) points", "\n".join(plot.optimizer_summary(muon)))
    assert f"{float(at_equal_time[1]):+.1f} points at equal time (CPU, means of 3 seeds)" in readme
    recipe = plot.recipe_runs(json_lines("recipe.jsonl"))
    accuracies = [100 * run["final_test_accuracy"] for run in recipe]
    mean = statistics.mean(accuracies)
    before = [100 * row["final_test_accuracy"] for row in json_lines("muon.jsonl")  # opt5's defaults before the recipe
              if row["settings"].get("optimizer") == "muon" and row["settings"]["epochs"] == 5]
    assert f"CPU: +{mean - statistics.mean(before):.2f} points over the 5 epochs of 128 before it " \
           f"({spread(before, 2)} %, n = {len(before)}) for as many steps" in readme
    no_resizing = [row for row in json_lines("recipe.jsonl")
                   if row.get("row") == "no-resizing" and plot.row_is_at_the_recipes_length(row)]
    assert len(no_resizing) == 1, "one seed: say the seeds' mean on the results page"
    assert f"in the recipe, {recipe[0]['modelled_h200_seconds']:.2f} modelled H200 s instead of " \
           f"{no_resizing[0]['modelled_h200_seconds']:.2f} for {100 * no_resizing[0]['2_views'] - mean:.2f} points " \
           "less (CPU, one seed)" in (ROOT / "results/README.md").read_text()
    adamw = [row for row in json_lines("recipe.jsonl") if row.get("row") == "adamw" and
             plot.row_is_at_the_recipes_length(row)]
    assert len(adamw) == 1 and f"+{mean - 100 * adamw[0]['2_views']:.2f} points at the recipe's length (CPU, one " \
        "seed)" in readme
    data_parallel = json_lines("data-parallel.jsonl")[-1]
    assert data_parallel["script"] == "opt6.py" and data_parallel["world_size"] == 2  # it ran as opt5.py
    assert f"2 CPU processes end with the same weights, {100 * data_parallel['final_test_accuracy']:.1f} % " \
           "(AdamW, one run)" in readme
    for name in ("muon.jsonl", "muon-xeon-amx.jsonl"):  # what each CPU's runs say is on the results page
        for line in plot.optimizer_summary(plot.convergence_runs(json_lines(name))):
            assert line in (ROOT / "results/README.md").read_text(), line


def readme_accuracies():
    """(the text around it, the figure) of every test-set accuracy the README states: a percentage with a decimal in
    a paragraph or a table row (read with its table's header), not a peer's (airbench's, named just before it)."""
    found = []
    for block in (ROOT / "README.md").read_text().split("\n\n"):
        lines = block.strip().splitlines()
        units = [lines[0] + " " + row for row in lines[2:]] if lines and lines[0].startswith("|") else \
            [" ".join(block.split())]
        for unit in units:
            for match in re.finditer(r"(\d+\.\d+)( ± [\d.]+)? %", unit):
                if "airbench" not in unit[max(0, match.start() - 90):match.start()]:
                    found.append((unit, match[0]))
    return found


def test_the_readme_gives_every_accuracy_of_ours_with_its_spread_and_n_or_as_one_run():
    accuracies = readme_accuracies()
    assert len(accuracies) >= 5
    bare = [(figure, text[:160]) for text, figure in accuracies
            if not ("±" in figure and re.search(r"\bn = \d", text)) and "one run" not in text]
    assert bare == []


def test_the_accuracy_check_catches_a_bare_figure(monkeypatch, tmp_path):
    (tmp_path / "README.md").write_text("opt5 reached 90.44 % on the H200.\n\nairbench94: 90.65 % a run.\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    assert readme_accuracies() == [("opt5 reached 90.44 % on the H200.", "90.44 %")]


def test_results_page_tables_are_plots_from_the_data():
    results_page = (ROOT / "results/README.md").read_text()
    gpu_tables = []  # each script's newest rows on the H200, the chain at 38c59a9, and before the whole step
    for paths in (plot.GPU_RUNS, plot.GPU_RUNS[1:], plot.GPU_RUNS_BEFORE):
        gpu = plot.gpu_runs([ROOT / path for path in paths])
        gpu_tables += [f"{plot.gpu_words(gpu)}:", *plot.gpu_table(gpu).splitlines()]
    for line in [*gpu_tables, *plot.recipe_table(json_lines("recipe.jsonl")),
                 *plot.recipe_summary(json_lines("recipe.jsonl")), *plot.screen_table(json_lines("screen.jsonl"))]:
        assert line in results_page, line
    runs = {run["script"]: run for run in json_lines("chain-5-epochs.jsonl") if run["data"] == "cifar10"}
    for script, run in runs.items():
        accuracies = " | ".join(f"{100 * epoch['test_accuracy']:.1f}" for epoch in run["epochs"])
        assert f"| `{script}` | {accuracies} |" in results_page, script
    # The convergence table and the ablation's, the curves' table, what they and the seeds say, and what extra
    # test-time views buy, are plot.py's from the timed runs.
    ladder = [line for line in json_lines("ladder.jsonl") if line.get("benchmark") == "ladder"][-1]
    convergence = plot.convergence_runs(json_lines("convergence.jsonl"))
    curve, seeds = plot.convergence_runs(json_lines("curve.jsonl")), plot.convergence_runs(json_lines("seeds.jsonl"))
    ablation_rows = plot.ablation_rows(json_lines("ablation.jsonl"))
    tables = plot.markdown_tables(list(runs.values()), ladder, convergence, curve, seeds, ablation_rows).split("\n\n")
    assert {run["script"] for run in convergence} == {run["script"] for run in curve} == {"opt4.py", "opt5.py"}
    assert [row["row"] for row in ablation_rows] == ablation.ROW_NAMES[:9], "ablation.py's rows of then, in order"
    for line in "\n".join(tables[2:]).splitlines():
        assert line in results_page, line
    others = list(curve + seeds)
    for name in ("muon.jsonl", "muon-xeon-amx.jsonl"):
        muon = plot.convergence_runs(json_lines(name))
        others += muon
        for line in plot.timed_runs_table(muon, plot.opt4_default_minutes(muon)):
            assert line in results_page, line
    # the recipe's curve (after opt4's reference run) and its ablation
    recipe = json_lines("recipe.jsonl")
    for line in [*plot.recipe_curve(recipe, others), *plot.recipe_ablation(recipe)]:
        assert line in results_page, line


def test_the_setup_table_names_tests_that_exist_for_every_row():
    page = (ROOT / "docs/machines.md").read_text()
    section = page[page.index("## The setups"):page.index("## On a GPU")]
    rows = [line.split("|")[1:-1] for line in section.splitlines() if line.startswith("| ")][1:]  # not the header
    assert len(rows) == 11
    tests = {name: test for name, test in globals().items() if name.startswith("test_")}
    for cells in rows:
        names = re.findall(r"`([^`]+)`", cells[-1])
        assert names, f"no test named for {cells[0]!r}"
        for name in names:
            if name.startswith("-m "):  # a marker: some test carries it
                assert any(mark.name == name[3:] for test in tests.values() for mark in getattr(test, "pytestmark", []))
            else:
                assert any(name in test for test in tests), f"no test matches {name!r} ({cells[0]!r})"


# ------------------------------------------------------------------------- opt6: DDP under torchrun

TORCHRUN = ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]  # for run_script
DDP_ARGS = [*SMALL, "--epochs", "2", "--batch-size", "16", "--no-compile"]


# In a rank's process: opt6.evaluate wrapped to hash the bytes of every parameter and buffer of the model just
# evaluated (a hash, not the model: DDP's wrapper must not outlive the process group), and the last hash printed
# on stderr after opt6.main(). The ranks are in step when their hashes are equal.
WEIGHTS_CHECKSUM = """
import hashlib
checksums, real_evaluate = [], opt6.evaluate


def evaluate(run, *args):
    result = real_evaluate(run, *args)
    digest = hashlib.sha256()
    for tensor in [*run.model.parameters(), *run.model.buffers()]:
        digest.update(tensor.detach().cpu().reshape(-1).view(torch.uint8).numpy().tobytes())
    checksums.append(digest.hexdigest()[:16])
    return result


opt6.evaluate = evaluate
"""
PRINT_WEIGHTS_CHECKSUM = """
print(f"rank {{os.environ.get('RANK', 0)}}: weights checksum {{checksums[-1]}}", file=sys.stderr)
"""

CHECKSUM_RANK = """
import os, sys
sys.path.insert(0, {root!r})
import torch
import opt6
""" + WEIGHTS_CHECKSUM + """
sys.argv[0] = "opt6.py"
opt6.main()
""" + PRINT_WEIGHTS_CHECKSUM


def checksums(stderr):
    # Found anywhere, not per line: two ranks writing to stderr at once can share a line.
    return sorted(re.findall(r"weights checksum ([0-9a-f]{16})", stderr))


@pytest.mark.floor
def test_opt6_two_processes_learn_print_once_and_end_with_identical_weights(tmp_path):
    json_path, weights, wrapper = tmp_path / "result.json", tmp_path / "weights.pt", tmp_path / "checksum_rank.py"
    wrapper.write_text(CHECKSUM_RANK.format(root=str(ROOT)))
    result = run_script(*TORCHRUN, wrapper, *DDP_ARGS, "--train-size", 1024, "--json", json_path, "--save", weights)
    assert result.returncode == 0, result.stderr
    assert result.stdout.count("epoch 1:") == 1 and result.stdout.count("done:") == 1
    assert "world size 2: global batch 32" in result.stdout
    first, second = checksums(result.stderr)
    assert first == second, "the ranks' weights or BatchNorm statistics differ"
    report = read_json(json_path)
    assert report["world_size"] == 2 and report["final_test_accuracy"] > 0.5
    assert report["epochs"][0]["images"] == 1024, "images/s must count both ranks' images"
    # Twice the global batch: the peak rate grows by the square root of 2, and OneCycleLR ends relative to it (the
    # rate of the last step)
    steps, lr = 2 * 1024 // 32, report["settings"]["lr"]
    assert report["final_lr"] == pytest.approx(onecycle_lr_after(steps, lr * 2**0.5, steps=steps - 1), rel=1e-6)
    assert report["final_lr"] != pytest.approx(onecycle_lr_after(steps, lr, steps=steps - 1))
    assert_saved_weights_match_the_report(weights, report, opt6, transform=None)


def run_to_the_end(*args, timeout):
    """Run `python args...` offline in a process group of its own; returns the CompletedProcess, or fails the test
    naming the hang after killing torchrun and every rank, so no stuck rank outlives the test (or holds its output
    open, which would keep the test waiting for ever)."""
    process = subprocess.Popen([sys.executable, *map(str, args)], cwd=ROOT, env={**os.environ, **NO_NETWORK},
                               text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    try:
        output = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        # torchrun starts each rank in a session of its own (torch 2.6): kill each rank's group, then torchrun's
        for pid in [*child_pids(process.pid), process.pid]:
            with contextlib.suppress(ProcessLookupError):  # a rank that ended meanwhile
                os.killpg(os.getpgid(pid), signal.SIGKILL)
        output = process.communicate()
        pytest.fail(f"still running after {timeout} s, killed: {' '.join(map(str, args))}\n{output[0][-2000:]}")
    return subprocess.CompletedProcess(process.args, process.returncode, *output)


def child_pids(pid):
    """The pids of `pid`'s living children, read from /proc (Linux)."""
    children = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError):  # a process that ended meanwhile
            if int(stat.read_text().rpartition(")")[2].split()[1]) == pid:  # the field after the name: state, ppid
                children.append(int(stat.parent.name))
    return children


@pytest.mark.floor
def test_a_rank_that_hangs_fails_its_test_in_time_and_is_killed(tmp_path):
    # torch 2.6's torchrun starts each rank in a session of its own: killing torchrun's group alone left the rank
    # alive, holding the output open, and the test waited for it for ever
    hang = tmp_path / "hang.py"
    hang.write_text("import time\ntime.sleep(600)\n")
    start = time.monotonic()
    with pytest.raises(pytest.fail.Exception, match="still running after 5 s"):
        run_to_the_end(*TORCHRUN, hang, timeout=5)
    assert time.monotonic() - start < 60
    ranks_left = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        with contextlib.suppress(OSError):  # a process that ended meanwhile
            if str(hang).encode() in cmdline.read_bytes():
                ranks_left.append(cmdline.parent.name)
    assert ranks_left == []


@pytest.mark.floor
@pytest.mark.skipif(machine.torch_version() >= (2, 8), reason="the hang at exit was seen on torch 2.6 only")
def test_opt6_compiled_ends(tmp_path):
    # Each rank used to destroy its process group as soon as it was done: rank 1 at once, rank 0 after its report.
    # On torch 2.6, compiled, rank 0 then hung in Gloo's destructor in 2 of 6 runs, and torchrun waited for ever.
    # A barrier before it narrowed that, not closed it: once since, in CI, a rank's main thread, holding the GIL,
    # freed the process group and joined a Gloo worker thread that was waiting for the GIL to free a tensor of an
    # earlier all-reduce (gdb's stacks). The cause, and the test that keeps it fixed every time:
    # test_opt6_keeps_its_last_barriers_handle_until_its_process_group_is_destroyed. Here one compiled run, end to end,
    # at one image size and with AdamW: the fewest graphs a compiled rank makes (Muon's and a second size's take minutes
    # more to compile on torch 2.6 on 2 cores)
    result = run_to_the_end(*TORCHRUN, "opt6.py", *SMALL, "--epochs", 2, "--train-size", 256, "--batch-size", 16,
                            "--optimizer", "adamw", "--min-size", 32, "--compile", timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.count("done:") == 1


@pytest.mark.parametrize("env, missing", [({"WORLD_SIZE": "2"}, "RANK, LOCAL_RANK, MASTER_ADDR, MASTER_PORT"),
                                          ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "localhost",
                                            "MASTER_PORT": "29500"}, "LOCAL_RANK")])
def test_opt6_started_without_torchrun_but_some_of_its_variables_exits_2_with_one_line(env, missing):
    # srun sets no LOCAL_RANK; a hand-set WORLD_SIZE alone is not a job either.
    # A run that missed the check would train (or wait for a rank 1 that never comes): cut it short.
    result = run_script("opt6.py", *DDP_ARGS, "--train-size", 256, env=env, timeout=60)
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr, result.stderr
    assert f"set but not {missing}: start opt6.py with torchrun" in result.stderr


def test_opt6_without_torchrun_on_several_gpus_points_to_torchrun(monkeypatch, capsys):
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setattr(sys, "argv", ["opt6.py"])  # the hint names the script that was started
    cuda = torch.device("cuda")
    assert opt6.setup_distributed(CPU) == (0, 1, CPU) and opt6.setup_distributed(cuda) == (0, 1, cuda)
    hint = "4 GPUs here, and one process uses one: to use them all, start torchrun --standalone --nproc_per_node=4 " \
           "opt6.py ...\n"
    for device, world_size, says in ((CPU, 1, ""), (cuda, 2, ""), (cuda, 1, hint)):
        opt6.point_to_torchrun(device, world_size)
        assert capsys.readouterr().out == says, (device, world_size)

    class SettingsLine(Exception):
        pass

    # opt6's main says it once the device is known, before the settings line (where this test stops it)
    monkeypatch.setattr(common, "pick_device", lambda args: cuda)
    monkeypatch.setattr(common, "print_settings", lambda *args: (_ for _ in ()).throw(SettingsLine()))
    with pytest.raises(SettingsLine):
        opt6.main()
    assert capsys.readouterr().out == hint


def test_opt6_a_local_rank_past_the_visible_gpus_exits_2_with_one_line():
    # Slurm's one task per GPU: every process sees one GPU, and torchrun's second process has LOCAL_RANK 1
    env = {"RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "9"}
    patches = VISIBLE_GPU.format(count=1, capability=90, name="NVIDIA H100 80GB HBM3")
    result = run_on_fake_machine(patches, "opt6.py", *NO_DATA, "--no-compile", env=env)
    assert_one_error_line(result, "LOCAL_RANK is 1, but this process sees 1 GPU(s): start at most 1 per machine "
                                  "(--nproc_per_node=1)")


# In a fake torchrun rank on a machine of fake GPUs: every CUDA call recorded with the GPU it names (its current GPU
# where it names none), a tensor asked for on a GPU made on the CPU, torch.compile a no-op; the process group's start
# prints what was recorded and ends the process.
RECORD_CUDA_CALLS = """
import json, torch.distributed, torch.overrides
calls, current = [], [0]
def set_device(device):
    current[0] = device if isinstance(device, int) else torch.device(device).index
    calls.append(["set_device", current[0]])
class RecordCudaCalls(torch.overrides.TorchFunctionMode):
    def __torch_function__(self, function, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        device = torch.device(kwargs.get("device") or "cpu")
        if device.type == "cuda":
            calls.append([function.__name__, current[0] if device.index is None else device.index])
            kwargs["device"] = "cpu"
        return function(*args, **kwargs)
def init_process_group(backend, device_id=None, **kwargs):
    calls.append(["init_process_group", device_id.index])
    print(json.dumps(calls), file=sys.stderr)
    sys.exit(0)
real_capability = torch.cuda.get_device_capability
def get_device_capability(device=None):
    calls.append(["get_device_capability", current[0] if device is None else torch.device("cuda", device).index
                  if isinstance(device, int) else device.index])
    return real_capability(device)
torch.cuda.set_device, torch.cuda.current_device = set_device, lambda: current[0]
torch.cuda.get_device_capability = get_device_capability
torch.compile = lambda function, **options: function
torch.distributed.init_process_group = init_process_group
RecordCudaCalls().__enter__()
"""


def test_opt6_each_rank_sets_its_own_gpu_before_any_cuda_work_the_compiler_check_included():
    # torchrun's second process on a machine with 2 GPUs: everything it does on a GPU must be on GPU 1. Before it, the
    # architecture check reads each GPU's capability, and the compiler check GPU 1's, by its number (properties, no
    # work on a GPU); then opt6's setup makes GPU 1 current before the process group, its first CUDA work
    env = {"RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "9"}
    patches = VISIBLE_GPU.format(count=2, capability=90, name="NVIDIA H100 80GB HBM3") + RECORD_CUDA_CALLS
    result = run_on_fake_machine(patches, "opt6.py", *NO_DATA, "--compile", env=env)
    assert result.returncode == 0, result.stderr
    calls = json.loads(result.stderr.strip().splitlines()[-1])
    assert calls == [["get_device_capability", 0], ["get_device_capability", 1], ["get_device_capability", 1],
                     ["set_device", 1], ["init_process_group", 1]], calls


def test_under_torchrun_only_rank_0_prints_a_verdict_and_a_fatal_one_ends_every_rank(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    for rank, prints in (("0", True), ("1", False)):
        monkeypatch.setenv("RANK", rank)
        assert common.pick_device(SimpleNamespace(device="auto", compile=False)) == CPU
        assert ("torch sees no CUDA GPU: running on the CPU" in capsys.readouterr().out) == prints, rank
        with pytest.raises(SystemExit) as exit_:
            common.pick_device(SimpleNamespace(device="cuda", compile=False))
        assert exit_.value.code == 2 and "--device cuda: torch sees no CUDA GPU" in capsys.readouterr().err


@pytest.mark.parametrize("world_size, captured", [(1, True), (2, False)])
def test_opt6_captures_its_step_on_one_gpu_and_says_why_not_under_ddp(world_size, captured):
    optimizer = shipped_optimizer("opt6.py", small_net())
    why_not = opt6.capture_problem(torch.device("cuda", 0), torch.bfloat16, optimizer, world_size)
    assert (why_not is None) == captured and (captured or "DDP" in why_not)
    assert "CUDA" in opt6.capture_problem(CPU, torch.bfloat16, optimizer, 1)


@pytest.mark.parametrize("script", WHOLE_STEP)
def test_a_gpu_captures_the_step_uncompiled_and_a_cpu_runs_it_uncompiled(script, monkeypatch):
    # The path each device gets: --compile is off by default everywhere (on a 2-core CPU it saved nothing a step, for
    # 43 s: results/compile_cpu.log), and capture_problem decides the capture
    module, ranks = ALL_SCRIPTS[script], [1] if script == "opt6.py" else []
    optimizer = shipped_optimizer(script, small_net())
    if hasattr(module, "capture_problem"):  # opt5 on: what stops a capture besides the device (Muon's float16, DDP)
        assert module.capture_problem(torch.device("cuda", 0), torch.bfloat16, optimizer, *ranks) is None
        assert module.capture_problem(CPU, CPU_AMP_DTYPE, optimizer, *ranks) == "not captured: CUDA graphs are CUDA's"
    step = functools.partial(print, "a step")
    assert module.cuda_graph(step, CPU) is step  # off CUDA: the step as it is
    monkeypatch.setattr(sys, "argv", [script])
    assert module.parse_args().compile is False


def test_ddp_buffer_flag_is_named_as_this_torch_names_it(monkeypatch):
    keyword = opt6.broadcast_buffers_keyword()
    assert keyword in inspect.signature(opt6.DistributedDataParallel).parameters
    expected = "forward_sync_buffers" if machine.torch_version() >= (2, 13) else "broadcast_buffers"
    assert keyword == expected

    def ddp_before_2_13(module, device_ids=None, broadcast_buffers=True, gradient_as_bucket_view=False):
        pass

    monkeypatch.setattr(opt6, "DistributedDataParallel", ddp_before_2_13)
    assert opt6.broadcast_buffers_keyword() == "broadcast_buffers"


def free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_two_nodes(script, processes_per_node, *args, timeout=300):
    """Two torchrun 'nodes' on this machine, as opt6's docstring starts them; returns both CompletedProcesses."""
    port, env = free_port(), {**os.environ, **NO_NETWORK}
    nodes = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes=2", f"--node_rank={node}",
                               f"--nproc_per_node={processes_per_node}", f"--rdzv-endpoint=127.0.0.1:{port}",
                               *map(str, [script, *args])], cwd=ROOT, env=env, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE) for node in (0, 1)]
    outputs = [node.communicate(timeout=timeout) for node in nodes]
    return [subprocess.CompletedProcess(node.args, node.returncode, *output) for node, output in zip(nodes, outputs)]


DATA_TURN = """
import json, os, sys, time
sys.path.insert(0, {root!r})
import torch.distributed as dist
import opt6

dist.init_process_group("gloo")
with opt6.rank_zero_first(dist.get_world_size()):
    start = time.time()
    time.sleep(0.5)  # a download
    end = time.time()
with open({out!r} + os.environ["RANK"], "w") as file:
    json.dump([start, end], file)
dist.destroy_process_group()
"""


def test_opt6_data_on_two_nodes_rank_0_first_then_the_other_nodes_first_process_then_the_rest(tmp_path):
    script = tmp_path / "data_turn.py"
    script.write_text(DATA_TURN.format(root=str(ROOT), out=str(tmp_path / "rank")))
    for node in run_two_nodes(script, processes_per_node=2):
        assert node.returncode == 0, node.stderr
    # Node 0 runs ranks 0 and 1, node 1 ranks 2 and 3; each node's first process is its local rank 0.
    (start_0, end_0), (start_1, end_1), (start_2, end_2), (start_3, end_3) = (
        json.loads((tmp_path / f"rank{rank}").read_text()) for rank in range(4))
    assert end_0 <= start_2, "node 1 prepared the data while rank 0 was still writing it"
    assert end_2 <= min(start_1, start_3), "a process read the data before its node's first process had it"


def test_opt6_two_nodes_on_one_machine_finish_with_identical_weights_and_one_report(tmp_path):
    json_path, wrapper = tmp_path / "result.json", tmp_path / "checksum_rank.py"
    wrapper.write_text(CHECKSUM_RANK.format(root=str(ROOT)))
    nodes = run_two_nodes(wrapper, 1, *DDP_ARGS, "--train-size", 256, "--test-size", 64, "--json", json_path)
    for node in nodes:
        assert node.returncode == 0, node.stderr
    first, second = checksums(nodes[0].stderr + nodes[1].stderr)
    assert first == second, "the nodes' weights or BatchNorm statistics differ"
    assert [node.stdout.count("done:") for node in nodes] == [1, 0], "one report, from rank 0"
    report = read_json(json_path)
    assert report["world_size"] == 2 and report["epochs"][0]["images"] == 256, "one report of both nodes' images"


def test_opt6_rank_shares_are_disjoint_and_cover_the_epoch():
    def share(rank, world_size=2, batch_size=8, module=opt6):
        args = SimpleNamespace(batch_size=batch_size, accum_steps=1)
        run = SimpleNamespace(args=args, device=CPU, rank=rank, world_size=world_size,
                              plan=bare_plan(module, 6, batch_size),
                              generator=torch.Generator().manual_seed(0),  # every rank seeds alike
                              crop_padding=common.CROP_PADDING, schedule=torch.zeros(6))
        plan_the_epoch(module, run, 100, 1)
        return run.plan

    first, second = share(0), share(1)
    assert first.batches.shape == second.batches.shape == (6, 8)
    seen = first.batches.flatten().tolist() + second.batches.flatten().tolist()
    assert len(set(seen)) == 96, "no image twice; 100 - 96 left over for a full global batch of 16"
    assert not torch.equal(first.offsets, second.offsets), "each rank its own crops"
    # Each rank's share is its slice of every global batch of the one epoch that one process (opt5's) draws
    whole = share(0, world_size=1, batch_size=16, module=opt5)
    for name, dimension in (("batches", 1), ("offsets", 2), ("flips", 1)):
        shares = torch.cat([getattr(first, name), getattr(second, name)], dimension)
        assert torch.equal(shares, getattr(whole, name)), name
    assert all(torch.equal(getattr(share(0, 1, 16), name), getattr(whole, name)) for name in ("batches", "offsets"))


INSTRUMENTED_RANK = """
import contextlib, hashlib, inspect, json, os, sys, time
sys.path.insert(0, {root!r})
import torch, torch.distributed as dist, torch.nn as nn
import common, opt6

rank, out = os.environ["RANK"], sys.argv.pop(1)
record = {{"shares": [], "allreduce_at_micro_batch": [], "load": None, "evaluated": [], "exit": [], "ddp": None}}
micro_batches = [0]


class BatchNormFreeNet(nn.Sequential):  # float32 and no BatchNorm: accumulation is exact
    def __init__(self):
        super().__init__(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 30 * 30, 10))

    def forward(self, images):
        micro_batches[0] += self.training
        return super().forward(images)


common.ResNet10 = BatchNormFreeNet
torch.autocast = lambda *args, **kwargs: contextlib.nullcontext()
opt6.augment = lambda images, *crops_and_flips: images  # crops differ per micro-batch: leave images as they are

real_plan_epoch, real_load_data, RealDDP = opt6.plan_epoch, common.load_data, opt6.DistributedDataParallel
real_normalize = opt6.normalize


def plan_epoch(plan, *args):
    real_plan_epoch(plan, *args)
    record["shares"].append(plan.batches.flatten().tolist())


def load_data(*args, **kwargs):
    start = time.time()
    if rank == "0":
        time.sleep(1)  # a slow download: the other rank must wait for it
    result = real_load_data(*args, **kwargs)
    record["load"] = [start, time.time()]
    return result


class CountingDDP(RealDDP):  # a subclass: opt6's step asks isinstance(model, DistributedDataParallel)
    def __init__(self, *args, **kwargs):
        record["ddp"] = {{name: value for name, value in kwargs.items() if isinstance(value, bool)}}
        super().__init__(*args, **kwargs)

        def hook(state, bucket):  # DDP's all-reduce of a bucket (the mean of the ranks' gradients), counted
            record["allreduce_at_micro_batch"].append(micro_batches[0])
            # In this thread: torch's allreduce_hook chains a Python callback that Gloo's worker thread runs and
            # frees, and with it this wrapper's rank 1 twice aborted at exit in CI ("terminate called without an
            # active exception"); no run with DDP's built-in all-reduce ever did
            dist.all_reduce(bucket.buffer().div_(dist.get_world_size()))
            future = torch.futures.Future()
            future.set_result(bucket.buffer())
            return future

        self.register_comm_hook(None, hook)


CountingDDP.__signature__ = inspect.signature(RealDDP)  # DDP's keywords, as opt6's broadcast_buffers_keyword reads them


def normalize(images, statistics):
    if torch.is_inference_mode_enabled():  # evaluating: note which test images this rank scores
        record["evaluated"] += [hashlib.sha256(image.numpy().tobytes()).hexdigest()[:16] for image in images]
    return real_normalize(images, statistics)


class BarrierHandle:  # a barrier's handle (Work), noting when Python lets go of it
    def __init__(self, work):
        self.work = work

    def wait(self):
        return self.work.wait()

    def __del__(self):
        record["exit"].append("barrier handle freed")


def barrier(*args, async_op=False, **kwargs):
    handle = BarrierHandle(real_barrier(*args, async_op=True, **kwargs))
    if async_op:
        return handle
    handle.wait()


def destroy_process_group(*args, **kwargs):
    record["exit"].append("process group destroyed")
    real_destroy_process_group(*args, **kwargs)


opt6.plan_epoch, common.load_data, opt6.DistributedDataParallel = plan_epoch, load_data, CountingDDP
opt6.normalize = normalize
real_barrier, real_destroy_process_group = dist.barrier, dist.destroy_process_group
dist.barrier, dist.destroy_process_group = barrier, destroy_process_group
""" + WEIGHTS_CHECKSUM + """
sys.argv[0] = "opt6.py"
try:
    opt6.main()
finally:
    with open(out + ".rank" + rank + ".json", "w") as file:
        json.dump(record, file)
""" + PRINT_WEIGHTS_CHECKSUM


def image_hash(image):
    """A short hash of one uint8 image's pixels, as INSTRUMENTED_RANK names the test images a rank evaluates."""
    return hashlib.sha256(image.numpy().tobytes()).hexdigest()[:16]


@pytest.fixture(scope="module")
def accumulating_ddp_runs(tmp_path_factory):
    """opt6 under torchrun on 2 CPU processes, instrumented: a batch of 12, and 3 accumulated micro-batches of 4."""
    folder = tmp_path_factory.mktemp("ddp")
    wrapper = folder / "instrumented_rank.py"
    wrapper.write_text(INSTRUMENTED_RANK.format(root=str(ROOT)))
    runs = {}
    for accum_steps, batch_size in [(1, 12), (3, 4)]:
        out = folder / f"accum{accum_steps}"
        # 120 images = 5 steps of 2 ranks x 12, enough for OneCycleLR
        result = run_script(*TORCHRUN, wrapper, out, *SMALL, "--epochs", 1, "--train-size", 120, "--test-size", 16,
                            "--batch-size", batch_size, "--accum-steps", accum_steps, "--no-compile",
                            "--save", f"{out}.pt", "--json", f"{out}.json", timeout=300)
        assert result.returncode == 0, result.stderr
        ranks = [json.loads(Path(f"{out}.rank{rank}.json").read_text()) for rank in (0, 1)]
        runs[accum_steps] = SimpleNamespace(result=result, ranks=ranks, weights=torch.load(f"{out}.pt"),
                                            report=read_json(f"{out}.json"))
    return runs


def test_opt6_accumulating_under_ddp_equals_one_big_batch(accumulating_ddp_runs):
    big_batch, accumulated = accumulating_ddp_runs[1], accumulating_ddp_runs[3]
    for run in (big_batch, accumulated):
        first, second = checksums(run.result.stderr)
        assert first == second, "the ranks' weights differ"
    for name, weight in big_batch.weights.items():
        assert torch.allclose(accumulated.weights[name], weight, atol=1e-5), name
    # The weights moved: equal untrained weights would prove nothing.
    assert not torch.allclose(big_batch.weights["0.weight"], bn_free_net()[0].weight.detach(), atol=1e-4)


def test_opt6_all_reduces_once_per_optimizer_step_not_per_micro_batch(accumulating_ddp_runs):
    for accum_steps, run in accumulating_ddp_runs.items():
        for rank in run.ranks:
            # DDP builds its buckets anew after the first step, so count from step 2 on.
            later = [micro_batch for micro_batch in rank["allreduce_at_micro_batch"] if micro_batch > accum_steps]
            assert later and all(micro_batch % accum_steps == 0 for micro_batch in later), later
            per_step = collections.Counter(later)
            assert sorted(per_step) == [accum_steps * step for step in range(2, 6)]
            assert len(set(per_step.values())) == 1, "the same buckets every step"


def test_opt6_wraps_the_model_with_gradients_in_ddps_buckets_and_no_buffer_broadcast_before_each_forward(
        accumulating_ddp_runs):
    # The BatchNorm statistics are averaged once per evaluation instead (the ranks' checksums cover the buffers)
    for run in accumulating_ddp_runs.values():
        for rank in run.ranks:
            assert rank["ddp"] == {"gradient_as_bucket_view": True, opt6.broadcast_buffers_keyword(): False}


def test_opt6_ranks_train_on_disjoint_shares_that_cover_the_epoch(accumulating_ddp_runs):
    for run in accumulating_ddp_runs.values():
        first, second = (rank["shares"][0] for rank in run.ranks)
        assert len(first) == len(second) == 60 and not set(first) & set(second)
        assert set(first) | set(second) == set(range(120))


def test_opt6_ranks_evaluate_disjoint_slices_that_cover_the_test_set_and_score_as_one_process(accumulating_ddp_runs):
    test_data = opt4.load_to_device(common.synthetic_cifar10(16, train=False, transform=None), CPU)
    every_test_image = sorted(image_hash(image) for image in test_data[0])
    assert len(set(every_test_image)) == 16, "the test must be able to tell the images apart"
    for run in accumulating_ddp_runs.values():
        first, second = (rank["evaluated"] for rank in run.ranks)
        assert len(first) == len(second) == 8 and not set(first) & set(second), "each rank its own half"
        assert sorted(first + second) == every_test_image
        # The report's figures are the whole test set's: one process scoring the saved weights gets the same.
        model = bn_free_net()
        model.load_state_dict(run.weights)
        loss, accuracy = call(opt6.evaluate, model=model, test_data=test_data, amp_dtype=torch.float32, batch_size=4,
                              device=CPU, size=32, rank=0, world_size=1)
        assert loss == pytest.approx(run.report["epochs"][-1]["test_loss"], rel=1e-5)
        assert accuracy == pytest.approx(run.report["final_test_accuracy"], abs=1e-9)


def test_opt6_keeps_its_last_barriers_handle_until_its_process_group_is_destroyed(accumulating_ddp_runs):
    # The hang opt6.leave_process_group keeps away, made to happen every time (torch 2.6, Gloo, 2 ranks, not project code): a
    # rank starts an all-reduce, drops its tensor, starts a barrier and drops the barrier's handle, then destroys the
    # process group: 5 hangs in 5 runs, gdb showing the main thread in ~ProcessGroupGloo joining a worker thread
    # that waits for the GIL in ~TensorImpl; with the handle kept past destroy_process_group, 4 ends in 4
    for rank in accumulating_ddp_runs[1].ranks:
        assert rank["exit"][-2:] == ["process group destroyed", "barrier handle freed"], rank["exit"]


def test_opt6_the_first_rank_on_a_machine_loads_the_data_before_the_others(accumulating_ddp_runs):
    for run in accumulating_ddp_runs.values():
        (_, first_done), (second_start, _) = (rank["load"] for rank in run.ranks)
        assert second_start >= first_done, "rank 1 read the data before rank 0 had it"

FAILING_RANK = """
import os, sys
sys.path.insert(0, {root!r})
import opt6

if os.environ["RANK"] == "1":  # rank 1 dies in its third step while rank 0 waits in an all-reduce
    calls, real_augment = [], opt6.augment
    def augment(*args):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("injected failure on rank 1")
        return real_augment(*args)
    opt6.augment = augment
sys.argv[0] = "opt6.py"
opt6.main()
"""


def test_opt6_a_failing_rank_ends_the_whole_job_with_its_message(tmp_path):
    wrapper = tmp_path / "fail_on_rank_1.py"
    wrapper.write_text(FAILING_RANK.format(root=str(ROOT)))
    start = time.monotonic()
    result = run_script(*TORCHRUN, wrapper, *DDP_ARGS, "--train-size", 1024, timeout=300)
    assert result.returncode != 0
    assert "injected failure on rank 1" in result.stderr
    assert time.monotonic() - start < 240, "torchrun should stop the waiting rank, not hang"


# ------------------------------------------------- on a CUDA GPU: `python -m pytest -m cuda -q`
# Written without a GPU to run them on: here they are skipped. Each one checks a claim that only a GPU can.

def cuda_test(test):
    """Marks a test `cuda` and skips it on a machine without a CUDA GPU."""
    return pytest.mark.cuda(pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")(test))


GPU_ARGS = ["--synthetic", "--device", "cuda", "--epochs", "2", "--train-size", "2048", "--test-size", "512"]


@cuda_test
@pytest.mark.parametrize("script", ALL_SCRIPTS)
def test_cuda_every_script_learns(script, tmp_path):
    # the CPU learn test's arguments (test_script_learns_reports_and_saves): what starves a script there fails in CI
    json_path = tmp_path / "result.json"
    result = run_script(script, "--synthetic", "--device", "cuda", "--test-size", 256, "--epochs", 2,
                        *LEARN_ARGS[script], "--json", json_path)
    assert result.returncode == 0, result.stderr
    report = read_json(json_path)
    assert report["device"] == "cuda" and report["final_test_accuracy"] > 0.5


@cuda_test
def test_cuda_opt2_loader_pins_memory(monkeypatch):
    loaders = []

    def recording_loader(*args, **kwargs):
        loaders.append(DataLoader(*args, **kwargs))
        return loaders[-1]

    monkeypatch.setattr(opt2, "DataLoader", recording_loader)
    monkeypatch.setattr(sys, "argv", ["opt2.py", *GPU_ARGS, "--epochs", "1", "--no-compile"])
    opt2.main()
    images, _ = next(iter(loaders[0]))
    assert loaders[0].pin_memory and images.is_pinned()


@cuda_test
def test_cuda_opt4_captures_its_step_and_never_syncs_after_warm_up(monkeypatch, capsys):
    real_train_one_epoch, syncs = opt4.train_one_epoch, []

    def train_one_epoch(*args):
        if args[-2] == 1:  # epoch 1: the warm-up, cuDNN's autotuning and the capture happen here
            return real_train_one_epoch(*args)
        torch.cuda.set_sync_debug_mode("warn")
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                result = real_train_one_epoch(*args)
        finally:
            torch.cuda.set_sync_debug_mode(0)
        syncs.extend(str(warning.message) for warning in caught if "synchroniz" in str(warning.message))
        return result

    monkeypatch.setattr(opt4, "train_one_epoch", train_one_epoch)
    monkeypatch.setattr(sys, "argv", ["opt4.py", *GPU_ARGS])
    opt4.main()
    assert "step: captured as a CUDA graph after 3 warm-up calls, replayed from here on" in capsys.readouterr().out
    # losses.tolist(), losses.mean().item() and correct.item(): the fixed reads at the end of the epoch
    assert len(syncs) == 3, syncs


@cuda_test
@pytest.mark.parametrize("script", ["opt4.py", "opt5.py"])
def test_cuda_the_captured_step_replays_what_the_step_computes(script, monkeypatch):
    # The same 2 epochs twice, float32, uncompiled as a GPU runs them by default: the step called as itself, and
    # captured after 3 steps and replayed. cuDNN deterministic and not autotuned: the in-process main() of another test
    # in this worker turns the autotuner on, and two of its picks may sum in another order
    monkeypatch.setattr(torch, "autocast", lambda *args, **kwargs: contextlib.nullcontext())
    monkeypatch.setattr(torch.backends.cudnn, "benchmark", False)
    monkeypatch.setattr(torch.backends.cudnn, "deterministic", True)
    gpu, dataset = torch.device("cuda"), common.synthetic_cifar10(256, train=True, transform=None)

    def weights_after_two_epochs(captured):
        model = small_net().to(gpu)
        run, step = step_of(script, model, dataset, gpu)
        if captured:
            step = opt4.cuda_graph(step, gpu)
        addresses = [tensor.data_ptr() for tensor in [*model.parameters(), *plan_tensors(run.plan).values()]]
        for epoch in (1, 2):
            plan_the_epoch(ALL_SCRIPTS[script], run, 256, epoch)
            for _ in range(len(run.plan.rates)):
                step()
        assert addresses == [tensor.data_ptr() for tensor in [*model.parameters(), *plan_tensors(run.plan).values()]]
        return torch.nn.utils.parameters_to_vector(model.parameters()).detach(), run.plan.losses.clone()

    (captured, captured_losses) = weights_after_two_epochs(captured=True)
    (called, called_losses) = weights_after_two_epochs(captured=False)
    assert torch.allclose(captured, called, rtol=1e-4, atol=1e-5) and torch.allclose(captured_losses, called_losses)
    assert not torch.equal(captured, torch.nn.utils.parameters_to_vector(small_net().parameters()).to(gpu))


@cuda_test
@pytest.mark.parametrize("script", ["opt4.py", "opt5.py"])
def test_cuda_the_uncompiled_step_is_captured_and_replayed_with_syncs_forbidden(script, capsys):
    # After its warm-up, the step as main() builds it (fused AdamW, or Muon with it; no compiler) captures and replays
    # with any host sync an error: the proof, on a GPU, of what the CPU tests count
    gpu = torch.device("cuda")
    run, step = step_of(script, common.ResNet10().to(gpu, memory_format=torch.channels_last),
                        common.synthetic_cifar10(256, train=True, transform=None), gpu)
    plan_the_epoch(ALL_SCRIPTS[script], run, 256, 1)
    step = opt4.cuda_graph(step, gpu)
    for _ in range(3):
        step()  # warm-up, on a side stream
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(len(run.plan.rates) - 3):
            step()  # the first captures, every one replays
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert run.plan.cursor.item() == 0, "the epoch's last step wraps the cursor to its first"
    assert "not captured" not in capsys.readouterr().out, "captured, not run as a function after a failed capture"


@cuda_test
def test_cuda_a_capture_that_fails_runs_the_step_uncaptured_with_no_step_lost_or_doubled(monkeypatch, capsys):
    # A real capture error, after the whole step was recorded: a host read is not allowed while a stream captures.
    # The recorded step ran none of its kernels, so the fallback must run it (gradients, weights, counter) once
    monkeypatch.setattr(torch, "autocast", lambda *args, **kwargs: contextlib.nullcontext())  # float32
    monkeypatch.setattr(torch.backends.cudnn, "benchmark", False)
    monkeypatch.setattr(torch.backends.cudnn, "deterministic", True)
    gpu, dataset = torch.device("cuda"), common.synthetic_cifar10(256, train=True, transform=None)

    def weights_after_an_epoch(wrap):
        run, step = step_of("opt4.py", small_net().to(gpu), dataset, gpu)

        def step_then_a_host_read_while_capturing():
            step()
            if torch.cuda.is_current_stream_capturing():
                run.plan.losses.sum().item()
        plan_the_epoch(opt4, run, 256, 1)
        wrapped = wrap(step_then_a_host_read_while_capturing)
        for _ in range(len(run.plan.rates)):  # 8 steps: 3 warm-up, the capture that fails, 4 more
            wrapped()
        steps_taken = next(iter(optimizers_of(run)[0].state.values()))["step"].item()  # AdamW's count of its steps
        return torch.nn.utils.parameters_to_vector(run.model.parameters()).detach(), steps_taken

    wrap = functools.partial(opt4.cuda_graph, device=gpu)
    (fell_back, fell_back_steps), out = weights_after_an_epoch(wrap), capsys.readouterr().out
    called, called_steps = weights_after_an_epoch(lambda step: step)
    assert "step: not captured (" in out and "not permitted when stream is capturing" in out, out
    assert fell_back_steps == called_steps == 8 and torch.allclose(fell_back, called, rtol=1e-4, atol=1e-5)


@cuda_test
def test_cuda_counting_the_update_of_a_captured_steps_optimizer_leaves_the_run_untouched():
    weight = torch.zeros(8, 8, device="cuda", requires_grad=True)
    optimizer = opt4.adamw([weight], 0.01, torch.device("cuda"))
    assert accounting.update_flops(optimizer) == 0  # AdamW's update: elementwise ops, no matmul
    assert weight.grad is None and not optimizer.state  # the run's optimizer and weights untouched


@cuda_test
def test_cuda_a_run_prints_no_warning_of_its_capturable_optimizer_stepping_uncaptured(tmp_path):
    # the warm-up steps before the capture step adamw uncaptured; torch built it with its warn-once flag set
    result = run_script("opt4.py", *GPU_ARGS)
    assert result.returncode == 0 and "capturable" not in result.stderr, result.stderr


@cuda_test
def test_cuda_opt4_accumulates_under_cuda_graphs(tmp_path):
    json_path = tmp_path / "result.json"
    result = run_script("opt4.py", *GPU_ARGS, "--accum-steps", 2, "--json", json_path)
    assert result.returncode == 0, result.stderr  # torch's "gradient ... overwritten" error would end it here
    report = read_json(json_path)
    assert report["settings"]["accum_steps"] == 2 and report["final_test_accuracy"] > 0.5


@cuda_test
def test_cuda_float16_with_grad_scaler_on_a_card_without_bfloat16(monkeypatch, tmp_path, capsys):
    chosen = []
    real_autocast_dtype = opt4.autocast_dtype
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: False)
    monkeypatch.setattr(opt4, "autocast_dtype", lambda device: chosen.append(real_autocast_dtype(device)) or chosen[-1])
    json_path = tmp_path / "result.json"
    monkeypatch.setattr(sys, "argv", ["opt4.py", *GPU_ARGS, "--json", str(json_path)])
    opt4.main()
    assert [dtype for dtype, _ in chosen] == [torch.float16] and read_json(json_path)["final_test_accuracy"] > 0.5
    # fused AdamW takes GradScaler's found-inf flag on the device: the float16 step is captured too
    assert "step: captured as a CUDA graph after 3 warm-up calls" in capsys.readouterr().out


@cuda_test
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
def test_cuda_opt6_two_gpus_with_nccl_end_with_identical_weights(tmp_path):
    json_path = tmp_path / "result.json"
    result = run_script(*TORCHRUN, "opt6.py", *GPU_ARGS, "--json", json_path)
    assert result.returncode == 0, result.stderr
    first, second = checksums(result.stderr)
    assert first == second and read_json(json_path)["world_size"] == 2
