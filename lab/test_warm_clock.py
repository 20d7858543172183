"""lab/warm_clock.py: opt5's recipe on airbench's clock (plot.py's skipping of its rows: test_plot.py). CPU, toy size,
no network."""
import contextlib
import io
import json
import os
import statistics
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest
import torch

import root  # noqa: F401  (first: the repository's root on sys.path, for the scripts and common.py)
import ablation  # noqa: E402
import common  # noqa: E402
import opt5  # noqa: E402
import plot  # noqa: E402
import warm_clock  # noqa: E402
from root import ROOT  # noqa: E402

TEST_SIZE, MONITOR_SIZE, EPOCHS = 16, 8, 3  # the subset (8 images) and the whole test set (16) tell the calls apart
TOY = ["--synthetic", "--device", "cpu", "--train-size", "16", "--test-size", str(TEST_SIZE), "--monitor-size",
       str(MONITOR_SIZE), "--epochs", str(EPOCHS), "--batch-size", "8"]  # 2 steps an epoch: 6 in all (5 needed)
SEED = 5
DELAY = 0.5  # seconds a delayed call sleeps
# The delays, by the seed of the run they are added to: the warm-up and run 1 (seed 5) sleep in what the clock leaves
# out (the data load, the per-epoch subset evaluations), run 2 (seed 6) in each epoch's training, run 3 (seed 7) nowhere
LEFT_OUT, COUNTED = SEED, SEED + 1
# How far the clock may be from the work the test measures itself (the calls' wrappers, a preemption): well below DELAY
TOLERANCE = 0.1


@pytest.fixture(scope="module")
def warm(tmp_path_factory):
    """warm_clock.main() with --runs 3 --seed 5 --json and TOY, in this process, with DELAY added where the seeds above
    say. The test's own wrappers, inside warm_clock's, time the work of each training epoch and evaluation without
    the delays (time.perf_counter). Returns the rows, the JSON lines, what it printed, the seed of each opt5.main()
    call, and each opt5 run's calls as [(kind, seconds)] in the order of the runs."""
    out = tmp_path_factory.mktemp("warm") / "warm.jsonl"
    seeds, calls = [], []  # calls: [run, kind, seconds] in order; a run is opt5's namespace, new in each main()
    main, load, train, evaluate = opt5.main, common.load_data, opt5.train_one_epoch, opt5.evaluate

    def counted_main():
        seeds.append(opt5.parse_args().seed)
        return main()

    def slow_load(args, *rest, **settings):
        if args.seed == LEFT_OUT:
            time.sleep(DELAY)
        return load(args, *rest, **settings)

    def slow_train(run, *rest):
        if run.args.seed == COUNTED:
            time.sleep(DELAY)
        start = time.perf_counter()
        figures = train(run, *rest)
        calls.append([run, "train", time.perf_counter() - start])
        return figures

    def slow_evaluate(run, test_data, size):
        kind = "final" if len(test_data[1]) == TEST_SIZE else "subset"
        if run.args.seed == LEFT_OUT and kind == "subset":
            time.sleep(DELAY)
        start = time.perf_counter()
        figures = evaluate(run, test_data, size)
        calls.append([run, kind, time.perf_counter() - start])
        return figures

    printed = io.StringIO()
    with pytest.MonkeyPatch.context() as patch, contextlib.redirect_stdout(printed):
        patch.setattr(opt5, "main", counted_main)
        patch.setattr(common, "load_data", slow_load)
        patch.setattr(opt5, "train_one_epoch", slow_train)
        patch.setattr(opt5, "evaluate", slow_evaluate)
        rows, summary = warm_clock.main(["--runs", "3", "--seed", str(SEED), "--json", str(out), *TOY])
        assert (opt5.train_one_epoch, opt5.evaluate) == (slow_train, slow_evaluate), "restored after each run"
    runs = []
    for run, kind, seconds in calls:
        if not runs or runs[-1][0] is not run:
            runs.append((run, []))
        runs[-1][1].append((kind, seconds))
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    return dict(rows=rows, summary=summary, lines=lines, printed=printed.getvalue(), seeds=seeds,
                calls=[run_calls for _, run_calls in runs], out=out)


def work(run_calls, kinds=("train", "final")):
    """The seconds of a run's calls of `kinds`, as the test timed them (no delays)."""
    return sum(seconds for kind, seconds in run_calls if kind in kinds)


def test_runs_opt5_once_untimed_then_each_seed_and_writes_a_row_per_run_and_a_summary(warm):
    assert warm["seeds"] == [SEED, SEED, SEED + 1, SEED + 2], "a warm-up with the first seed, then seeds 5, 6, 7"
    assert [kinds for kinds in ([kind for kind, _ in run_calls] for run_calls in warm["calls"])] == \
        [["train", "subset", "train", "subset", "train", "final"]] * 4, "opt5's own calls, the last on the test set"
    rows, summary = warm["lines"][:-1], warm["lines"][-1]
    assert rows == warm["rows"] and len(rows) == 3, "the warm-up is not reported"
    assert [row["settings"]["seed"] for row in rows] == [SEED, SEED + 1, SEED + 2]
    assert [row["warm_run"] for row in rows] == [1, 2, 3]
    for row in rows:
        assert row["script"] == "opt5.py" and row["clock"] == "warm" and len(row["epochs"]) == EPOCHS
        assert row["warm_seconds"] == pytest.approx(row["warm_train_seconds"] + row["warm_final_evaluation_seconds"])
        assert row["warm_train_seconds"] == pytest.approx(sum(row["warm_epoch_train_seconds"]))
        assert row["warm_final_evaluation_images"] == TEST_SIZE and row["warmup_seed"] == SEED
        assert row["warm_timer"] == "the device's clock (common.now)"
        assert row["command"] == (f"python lab/warm_clock.py --runs 3 --seed {SEED} --json {warm['out']} "
                                  + " ".join(TOY))
    seconds = [row["warm_seconds"] for row in rows]
    accuracies = [row["final_test_accuracy"] for row in rows]
    assert summary["clock"] == "warm" and summary["summary"] is True and summary["runs"] == 3
    assert summary["seeds"] == [SEED, SEED + 1, SEED + 2]
    assert summary["warm_seconds_mean"] == pytest.approx(statistics.mean(seconds))
    assert summary["warm_seconds_std"] == pytest.approx(statistics.stdev(seconds))  # n - 1
    assert (summary["warm_seconds_min"], summary["warm_seconds_max"]) == (min(seconds), max(seconds))
    assert summary["final_test_accuracy_mean"] == pytest.approx(statistics.mean(accuracies))
    assert summary["final_test_accuracy_std"] == pytest.approx(statistics.stdev(accuracies))
    assert summary == warm["summary"]
    printed = warm["printed"]
    assert "warm-up: seed 5, untimed, not reported" in printed
    assert f"n=3 runs (std: statistics.stdev, n-1): seconds mean {statistics.mean(seconds):.3f} s" in printed
    for row in rows:
        assert f"run {row['warm_run']} (seed {row['settings']['seed']}): {row['warm_seconds']:.3f} s" in printed


def test_the_data_load_and_the_per_epoch_evaluations_are_left_out_of_the_clock(warm):
    run, run_calls = warm["rows"][0], warm["calls"][1]  # run 1 (seed 5), slowed by 3 x DELAY where the clock is not
    assert run["settings"]["seed"] == LEFT_OUT
    assert run["warm_seconds"] == pytest.approx(work(run_calls), abs=TOLERANCE)
    assert run["warm_final_evaluation_seconds"] == pytest.approx(work(run_calls, ["final"]), abs=TOLERANCE)
    # opt5's own clock (its epochs) does count the subset evaluations: the delays happened
    assert run["total_seconds"] > work(run_calls) + (EPOCHS - 1) * DELAY


def test_each_epochs_training_is_counted(warm):
    run, run_calls = warm["rows"][1], warm["calls"][2]  # run 2 (seed 6), slowed by DELAY in each epoch's training
    assert run["settings"]["seed"] == COUNTED
    assert run["warm_train_seconds"] == pytest.approx(work(run_calls, ["train"]) + EPOCHS * DELAY, abs=TOLERANCE)
    assert run["warm_seconds"] == pytest.approx(work(run_calls) + EPOCHS * DELAY, abs=TOLERANCE)
    assert all(seconds >= DELAY for seconds in run["warm_epoch_train_seconds"])
    undelayed = warm["rows"][2], warm["calls"][3]  # run 3 (seed 7): the clock is the work alone
    assert undelayed[0]["warm_seconds"] == pytest.approx(work(undelayed[1]), abs=TOLERANCE)


def test_a_run_has_the_losses_of_an_opt5_process_with_its_flags_and_seed(warm, tmp_path):
    """The last run (seed 7, after the warm-up and two runs in this process) against opt5.py in a fresh process, both
    on this CPU in whatever precision opt5 picks for it (the same). Exactly equal: the same ops on the same data."""
    out = tmp_path / "opt5.jsonl"
    result = subprocess.run([sys.executable, "opt5.py", *TOY, "--seed", str(SEED + 2), "--json", str(out)], cwd=ROOT,
                            env={**os.environ, "http_proxy": "http://127.0.0.1:9", "https_proxy": "http://127.0.0.1:9"},
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr
    alone, warm_run = json.loads(out.read_text()), warm["rows"][2]
    assert warm_run["settings"]["seed"] == alone["settings"]["seed"] == SEED + 2

    def losses(row):
        return [(epoch["train_loss"], epoch["test_loss"], epoch["test_accuracy"]) for epoch in row["epochs"]]
    assert losses(warm_run) == losses(alone)
    assert warm_run["final_test_accuracy"] == alone["final_test_accuracy"]
    # and plot.py reads the opt5 row of a file that has the warm ones too, and only it
    mixed = tmp_path / "mixed.jsonl"
    mixed.write_text(out.read_text() + warm["out"].read_text())
    assert [row["date"] for row in plot.read_lines(mixed)] == [alone["date"]]


@pytest.mark.parametrize("flags, said", [
    (["--runs", "0"], "argument --runs: must be a positive integer, got 0"),
    (["--seed", "x"], "argument --seed: invalid int value"),
    (["--epochs", "0"], "argument --epochs: must be a positive integer, got 0"),  # opt5's flag, opt5's parser
    (["--json", "/no/such/folder/warm.jsonl"], "cannot append to --json /no/such/folder/warm.jsonl"),
])
def test_bad_input_exits_2_with_one_line_before_any_run(flags, said, monkeypatch, capsys):
    monkeypatch.setattr(opt5, "main", lambda: pytest.fail("a run started"))
    with pytest.raises(SystemExit) as exit_:
        warm_clock.main([*flags, *TOY])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and len(err.splitlines()) == 1 and err.startswith("error: ") and said in err


def test_help_says_what_it_times_and_how_it_differs_from_launch_to_result(capsys):
    with pytest.raises(SystemExit) as exit_:
        warm_clock.main(["--help"])
    text = capsys.readouterr().out
    assert exit_.value.code == 0
    for words in ("--runs", "--seed", "--json", "warm-up", "launch to result", "CUDA events", "common.now"):
        assert words in text


def test_the_shared_evaluation_wrapper_keeps_the_last_call_and_restores_opt5s(monkeypatch):
    seen = []
    monkeypatch.setattr(opt5, "evaluate", lambda run, test_data, size: seen.append(size) or (1.0, 0.5))
    shipped = opt5.evaluate
    with ablation.keep_last_evaluation() as kept:
        assert opt5.evaluate(1, "subset", 16) == (1.0, 0.5) and kept == [1, "subset"]
        opt5.evaluate(2, "all", 32)
    assert kept == [2, "all"] and seen == [16, 32] and opt5.evaluate is shipped
    ticks = iter(range(10))
    with ablation.keep_last_evaluation(lambda run: (lambda start: lambda: next(ticks) - start)(next(ticks))) as kept:
        opt5.evaluate(1, "subset", 16)
        opt5.evaluate(2, "all", 32)
    assert kept == [2, "all", 1] and opt5.evaluate is shipped  # the last call's clock: started at 2, stopped at 3


def test_on_a_gpu_the_clock_is_cuda_events_on_the_devices_stream_with_no_wait(monkeypatch):
    """start_clock's CUDA branch with stand-ins for CUDA's events (no GPU here): an event recorded on the device's
    current stream at the start and one at the stop, read as milliseconds / 1000 afterwards; no synchronize."""
    recorded = []

    class Event:
        def __init__(self, enable_timing=False):
            assert enable_timing
            self.at = None

        def record(self, stream):
            self.at = stream["now"]
            recorded.append(stream["device"])

        def elapsed_time(self, end):
            return end.at - self.at  # milliseconds, as CUDA's

    stream = {"device": "cuda:1", "now": 1000.0}
    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device: stream if str(device) == "cuda:1" else None)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *args: pytest.fail("a wait for the GPU"))
    monkeypatch.setattr(common, "now", lambda device: pytest.fail("the host's clock"))
    stop = warm_clock.start_clock(SimpleNamespace(device=torch.device("cuda:1")))
    stream["now"] = 1250.0
    seconds = stop()
    assert recorded == ["cuda:1", "cuda:1"] and seconds() == pytest.approx(0.25)
