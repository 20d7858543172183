"""warm_clock.py: opt5's recipe timed as airbench times itself: N runs in one warm process, after an untimed warm-up.

    python lab/warm_clock.py --device cuda --data-dir ./data                  # 5 runs, seeds 0-4, printed
    python lab/warm_clock.py --runs 3 --seed 10 --json /tmp/warm.jsonl --synthetic --epochs 2 --train-size 2048

What it measures: airbench (the CIFAR-10 speed records) times, inside one process that has already trained once,
each run's training epochs and its final (test-time-augmented) evaluation of the whole test set, and nothing else.
This does the same for opt5.py's recipe: a run's seconds are the sum over its epochs of opt5.train_one_epoch plus
the last opt5.evaluate call (the whole test set, after the last epoch). Not timed: the process start, imports, data
loading, the model, optimizers and schedule being built, the per-epoch evaluations of the test subset, the report.
The chain's scripts report launch to result instead (process start to final accuracy, one run per process: a cold
start, data loading and setup included), so the two clocks do not compare; plot.py leaves these rows out.

Each run is opt5's own main() in this process, unchanged, with --seed S, S+1, ..., S+N-1; before them one warm-up
run with seed S (the first timed run's work) that is neither timed nor reported: it loads the CUDA context, the
kernels and cuDNN's autotuning choices into the process. What opt5 does again in every run stays in its seconds: a run
builds its own model, so its CUDA graphs are captured (after their warm-up steps) in its first epoch at each size.
On a GPU the clock is CUDA events (recorded before and after each timed call, read after one synchronize at the end
of the run); elsewhere it is the device's clock, common.now(device) (on a CPU, time.perf_counter), not CUDA events.

Every flag not listed below is opt5.py's (see `python opt5.py --help`) and goes to every run. It prints each run's
seconds and test accuracy, then their mean and standard deviation (statistics.stdev, n - 1; none for one run), min
and max. With --json, one line per timed run: opt5's own --json row (its launch_to_result_seconds still counts from
this process's start, earlier runs included) with what lab/accounting.py adds (commit, data fingerprint, FLOPs),
"clock": "warm" and the run's warm seconds, then one summary line.
"""
import argparse
import contextlib
import datetime
import json
import os
import shlex
import statistics
import sys
import tempfile
from pathlib import Path

import torch

import root  # noqa: F401  (first: the repository's root on sys.path, for the scripts and common.py)
import ablation  # noqa: E402
import accounting  # noqa: E402
import common  # noqa: E402
import opt5  # noqa: E402


def parse_args(argv=None):
    """warm_clock.py's own flags, and the rest: opt5.py's, which opt5's parser checks here, before any run."""
    # allow_abbrev=False: opt5's flags must reach opt5, not be read as abbreviations of these
    parser = common.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                   allow_abbrev=False)
    parser.add_argument("--runs", type=common.positive_int, default=5,
                        help="timed runs, after the one untimed warm-up run (default: 5)")
    parser.add_argument("--seed", type=int, default=0,
                        help="the first timed run's seed (and the warm-up's); run k has seed + k - 1 (default: 0)")
    parser.add_argument("--json", metavar="PATH", default=None,
                        help="append one JSON line per timed run (opt5's report with the warm clock's fields) and "
                             "one summary line (default: off, printed only)")
    args, opt5_flags = parser.parse_known_args(argv)
    ablation.check_opt5_flags_and_json(opt5_flags, args.json or os.devnull)  # exit 2 with one line on a bad flag
    return args, opt5_flags


def start_clock(run):
    """Start timing the work queued on `run`'s device; returns stop(), which returns a function of no arguments giving
    the seconds between, to be read once the device has finished it (on a GPU: after a synchronize)."""
    device = run.device
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(torch.cuda.current_stream(device))

        def stop_events():
            end.record(torch.cuda.current_stream(device))
            return lambda: start.elapsed_time(end) / 1000  # milliseconds
        return stop_events
    started = common.now(device)

    def stop():
        seconds = common.now(device) - started
        return lambda: seconds
    return stop


@contextlib.contextmanager
def timed_training():
    """Within the `with` block each opt5.train_one_epoch call is timed (start_clock); the block gets the list of each
    epoch's seconds, as functions to read after the run. After the block, opt5's train_one_epoch again."""
    train, epochs = opt5.train_one_epoch, []

    def train_and_time(run, train_data, epoch, monitor, size):
        stop = start_clock(run)
        figures = train(run, train_data, epoch, monitor, size)
        epochs.append(stop())
        return figures
    opt5.train_one_epoch = train_and_time
    try:
        yield epochs
    finally:
        opt5.train_one_epoch = train


def timed_run(opt5_flags, seed):
    """opt5.main() with `opt5_flags` and --seed `seed` in this process, its epochs' training and its final evaluation
    timed. Returns opt5's --json row and the warm clock's fields."""
    command_line = sys.argv
    with ablation.keep_last_evaluation(start_clock) as last_evaluation, timed_training() as epochs, \
            tempfile.TemporaryDirectory() as folder:
        report_path = Path(folder) / "opt5.jsonl"
        sys.argv = [command_line[0], *opt5_flags, "--seed", str(seed), "--json", str(report_path)]
        try:
            opt5.main()
        finally:
            sys.argv = command_line
        report = json.loads(report_path.read_text())
    run, test_data, final_evaluation = last_evaluation
    if run.device.type == "cuda":
        torch.cuda.synchronize(run.device)  # the run's one wait: every event recorded has happened
    train_seconds = [seconds() for seconds in epochs]
    final_seconds = final_evaluation()
    return report, {"warm_seconds": sum(train_seconds) + final_seconds, "warm_train_seconds": sum(train_seconds),
                    "warm_final_evaluation_seconds": final_seconds, "warm_epoch_train_seconds": train_seconds,
                    "warm_final_evaluation_images": len(test_data[1]),
                    "warm_timer": "CUDA events" if run.device.type == "cuda" else "the device's clock (common.now)"}


def spread(values):
    """Mean, standard deviation (statistics.stdev, n - 1; None for one value), min and max of `values`."""
    return {"mean": statistics.mean(values), "std": statistics.stdev(values) if len(values) > 1 else None,
            "min": min(values), "max": max(values)}


def spread_words(figures, scale=1.0, unit=" s", digits=3):
    """`figures` (spread's) in words: mean +- std (min to max), scaled by `scale`."""
    def shown(value):
        return "n/a" if value is None else f"{scale * value:.{digits}f}{unit}"
    return f"mean {shown(figures['mean'])} +- {shown(figures['std'])} (min {shown(figures['min'])}, " \
           f"max {shown(figures['max'])})"


def append(path, row):
    with open(path, "a") as file:
        file.write(json.dumps(row) + "\n")


def summary_row(rows, args, command):
    """The one summary line: the timed runs' seconds and test accuracies, each as its spread."""
    seconds = spread([row["warm_seconds"] for row in rows])
    accuracy = spread([row["final_test_accuracy"] for row in rows])
    return {"clock": "warm", "summary": True, "script": "opt5.py",
            "date": datetime.datetime.now().isoformat(timespec="seconds"), "command": command,
            "device": rows[0]["device"], "device_name": rows[0]["device_name"], "warm_timer": rows[0]["warm_timer"],
            "runs": len(rows), "seeds": [row["settings"]["seed"] for row in rows], "warmup_seed": args.seed,
            **{f"warm_seconds_{name}": value for name, value in seconds.items()},
            **{f"final_test_accuracy_{name}": value for name, value in accuracy.items()}}


def main(argv=None):
    args, opt5_flags = parse_args(argv)
    commit = accounting.commit_at_start()
    given = sys.argv[1:] if argv is None else list(argv)
    command = shlex.join(["python", "lab/warm_clock.py", *given])
    print(f"== warm-up: seed {args.seed}, untimed, not reported", flush=True)
    timed_run(opt5_flags, args.seed)
    rows = []
    for number in range(1, args.runs + 1):
        seed = args.seed + number - 1
        print(f"\n== warm run {number}/{args.runs}: seed {seed}", flush=True)
        report, clock = timed_run(opt5_flags, seed)
        report = accounting.add_provenance(accounting.add_work(report), commit)
        rows.append({**report, "clock": "warm", **clock, "warm_run": number, "warm_runs": args.runs,
                     "warmup_seed": args.seed, "command": command})
        if args.json:
            append(args.json, rows[-1])
    print(f"\nwarm clock ({rows[0]['warm_timer']}): each run's training epochs + its final evaluation of "
          f"{rows[0]['warm_final_evaluation_images']} test images, after 1 untimed warm-up run (seed {args.seed})")
    for row in rows:
        print(f"run {row['warm_run']} (seed {row['settings']['seed']}): {row['warm_seconds']:.3f} s "
              f"(train {row['warm_train_seconds']:.3f} s + final evaluation {row['warm_final_evaluation_seconds']:.3f} "
              f"s) | test acc {100 * row['final_test_accuracy']:.2f}%")
    summary = summary_row(rows, args, command)
    seconds, accuracy = ({name: summary[f"{figure}_{name}"] for name in ("mean", "std", "min", "max")}
                         for figure in ("warm_seconds", "final_test_accuracy"))
    print(f"n={len(rows)} runs (std: statistics.stdev, n-1): seconds {spread_words(seconds)} | "
          f"test acc {spread_words(accuracy, scale=100, unit='%', digits=2)}")
    if args.json:
        append(args.json, summary)
        print(f"{len(rows)} runs and a summary line appended to {args.json}")
    return rows, summary


if __name__ == "__main__":
    main()
