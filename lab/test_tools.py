"""The lab's probes: each is run in its own process at a toy size on the CPU, or shows its --help where a real run needs
a GPU or is tested in its own file, so a probe that breaks fails here and not when the results page's figures are
rerun. A new tool in lab/ fails test_every_tool_is_run_by_a_test until a test runs it."""
import gzip
import json
import os
import pickle
import re
import subprocess
import sys

import numpy as np
import pytest

import root  # noqa: F401  (first: the repository's root on sys.path, for the scripts and common.py)
from conftest import NO_NETWORK  # noqa: E402
from root import LAB, ROOT  # noqa: E402

# Each probe, by the test that runs it at a toy size here
RUN_AT_TOY_SIZE = {
    "capture_probe.py": "test_capture_probe_rehearses_one_tiny_configuration_on_the_cpu",
    "compile_cpu.py": "test_compile_cpu_times_opt4s_step_both_ways_and_projects_the_run_at_its_batch",
    "compile_sizes.py": "test_compile_sizes_counts_the_graphs_of_both_settings_at_two_sizes",
    "data_load.py": "test_data_load_times_both_loaders_on_a_toy_copy_of_cifar10",
    "eager_ops.py": "test_eager_ops_counts_the_outermost_kernel_launching_ops_outside_compiled_code",
    "evaluations.py": "test_evaluations_runs_opt5s_twenty_evaluations_eager_at_a_toy_size",
}
# Run at toy size by their own test files (test_ablation.py, test_benchmark.py...): here only their --help
HELP_ONLY = ("ablation.py", "benchmark.py", "plot.py", "screen.py", "warm_clock.py")
# Modules the tools import, no command of their own: accounting.py tested in test_accounting.py, root.py by every tool
IMPORTED_ONLY = ("accounting.py", "root.py")


def run_tool(script, *args, timeout=300):
    """`python script args...` from the repository root; its stdout, after asserting it exited 0."""
    result = subprocess.run([sys.executable, script, *map(str, args)], cwd=ROOT, env={**os.environ, **NO_NETWORK},
                            capture_output=True, text=True, timeout=timeout)
    output = result.stdout[-2000:] + result.stderr[-3000:]
    assert result.returncode == 0, f"{script} exited {result.returncode}:\n{output}"
    return result.stdout


def one_line(text):
    """`text` with each run of whitespace one space: argparse wraps its help to the terminal's width."""
    return " ".join(text.split())


def test_every_tool_is_run_by_a_test():
    tools = sorted(path.name for path in LAB.glob("*.py") if not path.name.startswith("test_"))
    untested = [name for name in tools if name not in (*RUN_AT_TOY_SIZE, *HELP_ONLY, *IMPORTED_ONLY)]
    assert not untested, f"add a test to test_tools.py for each of {untested} and name it in RUN_AT_TOY_SIZE"
    missing = [test for test in RUN_AT_TOY_SIZE.values() if not callable(globals().get(test))]
    assert not missing, f"RUN_AT_TOY_SIZE names tests that are not here: {missing}"


@pytest.mark.parametrize("name", [name for name in HELP_ONLY if (LAB / name).is_file()])
def test_help_of_a_tool_tested_elsewhere_exits_0_with_its_usage(name):
    assert run_tool(f"lab/{name}", "--help", timeout=120).startswith(f"usage: {name} ")


def test_capture_probe_rehearses_one_tiny_configuration_on_the_cpu():
    lines = run_tool("lab/capture_probe.py", "--device", "cpu").splitlines()
    assert len(lines) == 1, "one configuration on a CPU, no GPU line"
    row = json.loads(lines[0])
    assert (row["mode"], row["batch"], row["size"]) == ("eager", 16, 32)
    assert len(row["chunks_ms"]) == 2 and row["ms_per_step"] > 0 and row["setup_s"] > 0


def test_compile_cpus_defaults_are_opt4s():
    """At its defaults compile_cpu.py projects opt4's default run: batch 128 (1,950 steps in 5 epochs)."""
    usage = one_line(run_tool("lab/compile_cpu.py", "--help", timeout=120))
    for flag, default in [("--batch-size", 128), ("--steps-per-block", 8), ("--blocks", 6), ("--evaluated", 2000)]:
        assert re.search(rf"{flag} [A-Z_]+ [^-]*\(default: {default}\)", usage), f"{flag}'s default is {default}"
    assert "images per forward and backward pass, in each process (default: 128)" in \
        one_line(run_tool("opt4.py", "--help", timeout=120))


def test_compile_cpu_times_opt4s_step_both_ways_and_projects_the_run_at_its_batch():
    # torch.compile on the CPU: tens of seconds of compiling, a minute or more on a busy machine
    toy = ["--batch-size", "8", "--steps-per-block", "2", "--blocks", "2", "--evaluated", "16"]
    out = run_tool("lab/compile_cpu.py", *toy, timeout=900)
    for mode in ("eager", "compiled"):
        timing = re.search(rf"^{mode}: step (\d+) ms \(median of 2 blocks of 2: \d+, \d+\); evaluation of 16 images "
                           rf"([\d.]+) s; first block", out, re.M)
        projection = re.search(rf"^{mode}: compiling and warm-up ([\d.-]+) s; opt4 --epochs 5 --batch-size 8 "
                               rf"projected: (\d+) s", out, re.M)
        assert timing and projection, out
        step_ms, evaluation_s = map(float, timing.groups())
        compiling, projected = map(float, projection.groups())
        # 5 epochs of 50,000 // 8 steps and 5 evaluations of 10,000 images, from the printed figures: each is rounded
        # (half a ms a step, 5 ms an evaluation, 0.05 s of compiling, half a second projected), hence the slack
        expected = 5 * (50_000 // 8) * step_ms / 1000 + 5 * evaluation_s * 10_000 / 16 + compiling
        slack = 5 * 6250 * 0.5 / 1000 + 5 * 625 * 0.005 + 0.05 + 0.5
        assert projected == pytest.approx(expected, abs=slack), out
    assert re.search(r"^compiled / eager, ms a step: [\d.]+; projected run: [\d.]+$", out, re.M), out


def write_toy_cifar10(data_dir, per_batch, test_count):
    """CIFAR-10's pickled batches in torchvision's layout with a few random images each: data_batch_1..5 of
    `per_batch`, test_batch of `test_count`, and batches.meta (torchvision's constructor reads it)."""
    folder = data_dir / "cifar-10-batches-py"
    folder.mkdir(parents=True)
    generator = np.random.default_rng(0)
    names = [(f"data_batch_{number}", per_batch) for number in range(1, 6)] + [("test_batch", test_count)]
    for name, count in names:
        batch = {"data": generator.integers(0, 256, (count, 3072), dtype=np.uint8),
                 "labels": generator.integers(0, 10, count).tolist()}
        (folder / name).write_bytes(pickle.dumps(batch))
    label_names = ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"]
    (folder / "batches.meta").write_bytes(pickle.dumps({"label_names": label_names}))


def test_data_load_times_both_loaders_on_a_toy_copy_of_cifar10(tmp_path):
    write_toy_cifar10(tmp_path, per_batch=4, test_count=6)
    lines = run_tool("lab/data_load.py", tmp_path, timeout=120).splitlines()
    assert re.fullmatch(r"torch \S+, torchvision \S+; import torchvision after torch: [\d.]+ s", lines[0]), lines
    loads = [line for line in lines if line.startswith("both sets (20 + 6 images): torchvision's constructor ")]
    assert len(loads) == 3, lines


def complete_event(name, ts, dur, cat="cpu_op", tid=1):
    return {"ph": "X", "cat": cat, "name": name, "pid": 1, "tid": tid, "ts": ts, "dur": dur}


def test_eager_ops_counts_the_outermost_kernel_launching_ops_outside_compiled_code(tmp_path):
    step = "user_annotation"
    events = [
        complete_event("ProfilerStep#1", 0, 100, step),
        complete_event("aten::add", 10, 5),  # counted
        complete_event("aten::view", 20, 2),  # metadata: no kernel
        complete_event("aten::to", 30, 10), complete_event("aten::copy_", 32, 5),  # a to() that copies: counted once
        complete_event("aten::to", 45, 2),  # a to() that returns its input: not counted
        complete_event("## Call CompiledFxGraph fabc123", 50, 40, "python_function"),
        complete_event("aten::mm", 55, 10), complete_event("aten::add", 70, 5),  # inside the compiled graph
        complete_event("aten::mul", 150, 5),  # between the steps
        complete_event("ProfilerStep#2", 200, 100, step),
        complete_event("aten::add", 210, 5), complete_event("aten::mul", 220, 5), complete_event("aten::addmm", 230, 5),
        {"ph": "i", "name": "aten::add", "tid": 1, "ts": 240},  # not a complete event
    ]
    trace = tmp_path / "profile"
    trace.mkdir()
    decoy = trace / "older.pt.trace.json"  # no steps in it: read, it would fail the run
    decoy.write_text(json.dumps({"traceEvents": []}))
    os.utime(decoy, (1_000_000, 1_000_000))
    with gzip.open(trace / "worker.pt.trace.json.gz", "wt", encoding="utf-8") as file:
        json.dump({"traceEvents": events}, file)
    lines = run_tool("lab/eager_ops.py", trace, timeout=60).splitlines()
    assert lines == [f"{trace / 'worker.pt.trace.json.gz'}: 2 steps traced",
                     "kernel-launching ops a step outside compiled code: 2.5 (each step: 2, 3)",
                     "most frequent, a step: aten::add 1, aten::to 0.5, aten::mul 0.5, aten::addmm 0.5"]


def test_evaluations_runs_opt5s_twenty_evaluations_eager_at_a_toy_size():
    # 40 test images at batch 32 (16 images and their mirrors a call): the last call has 8, padded
    toy = ["--monitor-size", "16", "--test-size", "40", "--batch-size", "32"]
    lines = run_tool("lab/evaluations.py", "eager", *toy, timeout=300).splitlines()
    evaluations = [line for line in lines if line.startswith("eager: epoch ")]
    assert len(evaluations) == 20, lines
    assert evaluations[0].startswith("eager: epoch  1, 16 px, 16 images: ")
    assert evaluations[-1].startswith("eager: epoch 20, 32 px, 40 images: ")
    assert lines[-1].startswith("eager: the 20 evaluations: ")


def test_compile_sizes_counts_the_graphs_of_both_settings_at_two_sizes():
    lines = [json.loads(line) for line in run_tool("lab/compile_sizes.py", "--sizes", 8, 16, "--batch-size", 2,
                                                   timeout=1500).splitlines()]
    assert [(line["dynamic"], line["sizes"]) for line in lines] == [(False, [8, 16]), (True, [8, 16])]
    assert lines[0]["dynamo_graphs"] == 2, "dynamic=False: a graph for each size"
    assert all(line["compiled_graphs"] >= 1 for line in lines)
