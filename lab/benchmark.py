"""benchmark.py: the chain on your machine, as one table.

    python lab/benchmark.py --json my-gpu.jsonl   # each script at its defaults on CIFAR-10 (./data, downloaded)
    python lab/benchmark.py --ladder --device cuda --train-size 50000 --test-size 10000 --epochs 3

The chain (the default): baseline.py, opt1.py, ... opt5.py one after the other, each at its own defaults (batch,
learning rate, epochs: 5, and opt5's recipe 20) on real data, each in its own process: what `python optN.py` gives
you. The table has its steady images/s (epochs 2 on; per image size for opt5), the speedup over baseline.py's, its
test accuracy, the seconds from launch to result, the first epoch's seconds (compiling included) and the seconds
before the first step. With --json every script's own --json line is appended (the rows lab/results/ holds) with what
lab/accounting.py adds (the commit, the data's fingerprint, FLOPs and the modelled H200 time), then one line with
the table. A script that fails (exits non-zero or writes no row) is marked failed in the table, with where
its output is; the rest still run, and benchmark.py exits 1 after the table.

Seeds and the spread: with --repeats N the chain's round r runs every script with --seed S + r - 1 (S: --seed, 0
unless told), so the rounds are N trainings, not N copies of one; --same-seed gives every round S instead, for a
study of timing alone. The table shows medians over the rounds; from 2 rounds on a second table below it shows, per
script that ran, the mean, sample standard deviation (statistics.stdev: n - 1 in the denominator), minimum and maximum
of the final test accuracy and of the seconds from launch to result, with n and the seeds. The --json summary line
holds them for every n: each row's test_accuracy_mean, _std, _min, _max, the same four of launch_to_result_seconds,
n and seeds (the scripts' own), and the summary's seeds (one a round); with n = 1 the std is null.

The ladder (--ladder): what each optimization buys in speed alone. Every rung gets the same settings (batch 128, 2
epochs of 2,048 generated images unless told), each rung one more group of optimizations switched on by the scripts'
own flags; the rungs take turns (A B C, A B C, ...) for --repeats rounds, so slow drift of the machine hits all
alike, and the table shows medians. Speedup is steady-state images/s over baseline.py's. Every rung and round runs
--seed S: the rounds repeat one training, so their spread is the machine's.
"""
import argparse
import datetime
import json
import shlex
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

import root  # noqa: F401  (first: the repository's root on sys.path, for the scripts and common.py)
import accounting  # noqa: E402  (the FLOPs, the modelled H200 time, the commit and the data's fingerprint of a row)
import common  # noqa: E402
from root import ROOT  # noqa: E402  (where the scripts are)

SCRIPTS = ["baseline.py", "opt1.py", "opt2.py", "opt3.py", "opt4.py", "opt5.py"]  # the chain (opt6 runs under torchrun)
# The ladder: each rung switches on one group of optimizations with a flag the scripts already have.
# (rung, script, flags, the rung it is compared with, what it adds, what of that acts only on a GPU)
LADDER = [
    ("baseline", "baseline.py", [], None, "float32, eager, SGD, PIL loader", ""),
    ("opt1 eager", "opt1.py", ["--no-compile"], "baseline",
     "16-bit autocast where native (else float32), AdamW, cudnn.benchmark", "cudnn.benchmark"),
    ("opt1", "opt1.py", [], "opt1 eager", "torch.compile", ""),
    ("opt2, 0 workers", "opt2.py", ["--workers", "0"], "opt1",
     "OneCycleLR, normalize + crop + flip, label smoothing, inference_mode",
     "pinned memory, non_blocking copies"),
    ("opt2, 2 workers", "opt2.py", ["--workers", "2"], "opt2, 0 workers", "2 loader processes", ""),
    ("opt3", "opt3.py", [], "opt2, 0 workers",
     "data on the device, batch crops and flips, channels_last, fused AdamW, losses on the device, flip TTA; minus "
     "torch.compile", "bfloat16 autocast (sm_80 on)"),
    ("opt4", "opt4.py", [], "opt3", "the step as one function on fixed device buffers",
     "no host sync; the step captured as one CUDA graph"),
    ("opt4 + compile", "opt4.py", ["--compile"], "opt4", "torch.compile (the model, inside the step)", ""),
]


# The ladder's settings, where the command line gives none: the same for every rung. The chain's: each script's own.
LADDER_DEFAULTS = {"epochs": 2, "batch_size": 128, "train_size": 2048, "test_size": 1024, "repeats": 3}


def parse_args():
    parser = common.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add = parser.add_argument
    add("--ladder", action="store_true",
        help="run the ladder instead of the chain: one rung per optimization group, same settings (default: off)")
    add("--scripts", nargs="+", default=SCRIPTS, help=f"the chain's scripts, in order (default: {' '.join(SCRIPTS)})")
    add("--repeats", type=common.positive_int, default=None, help="rounds over all runs (default: chain 1, ladder 3)")
    add("--epochs", type=int, default=None,
        help="epochs per run; steady state needs 2 or more (default: chain each script's own, 5, opt5 20; ladder 2)")
    add("--batch-size", type=common.positive_int, default=None,
        help="the same for every run (default: chain each script's own; ladder 128)")
    add("--train-size", type=common.positive_int, default=None,
        help="training images per epoch (default: chain all 50,000; ladder 2,048)")
    add("--test-size", type=common.positive_int, default=None,
        help="test images (default: chain all 10,000; ladder 1,024)")
    add("--data-dir", default=None,
        help="where CIFAR-10 is, or downloads to (default: chain ./data; ladder generated data)")
    add("--synthetic", action="store_true", help="the chain on generated data: speed only (default: off)")
    add("--device", choices=["auto", "cuda", "cpu"], default="auto", help="passed to every script (default: auto)")
    add("--seed", type=common.non_negative_int, default=0,
        help="passed to every script as --seed: the chain's round r gets N + r - 1, the ladder's every round N "
             "(default: 0)")
    add("--same-seed", action="store_true",
        help="the chain: every round gets --seed itself, to time one training N times; the ladder does so always "
             "(default: off, each round its own seed)")
    add("--json", metavar="PATH", default=None,
        help="append every run's own --json line, then one line with the table (default: off)")
    args = parser.parse_args()
    if args.ladder:
        for name, value in LADDER_DEFAULTS.items():
            setattr(args, name, value if getattr(args, name) is None else getattr(args, name))
    args.repeats = args.repeats or 1
    if args.epochs is not None and args.epochs < 2:
        common.fail("--epochs must be at least 2: steady state excludes epoch 1")
    if args.synthetic and args.data_dir:
        common.fail("--synthetic and --data-dir exclude each other: choose one")
    if args.same_seed and args.ladder:
        common.fail("--same-seed is for the chain: the ladder gives every round --seed already")
    for script in args.scripts:
        if not (ROOT / script).is_file():
            common.fail(f"no script {script} next to benchmark.py; choose from {' '.join(SCRIPTS)}")
    return args


def runs_to_compare(args):
    """(name, script, flags) per run: the ladder's rungs, or each of the chain's scripts."""
    if args.ladder:
        return [(rung, script, flags) for rung, script, flags, *_ in LADDER]
    return [(script, script, []) for script in args.scripts]


def round_seeds(args):
    """The seed of each round, in order: --seed + r - 1 for the chain's round r; --seed throughout for the ladder or
    with --same-seed."""
    if args.ladder or args.same_seed:
        return [args.seed] * args.repeats
    return [args.seed + round_index for round_index in range(args.repeats)]


def run_once(script, flags, args, json_path, seed):
    """Run one script once with the settings given and --seed `seed` (the rest its own defaults); returns (its --json
    report, None), or (None, why it failed: the table's cell) where it exits non-zero or writes no row."""
    settings = {"--epochs": args.epochs, "--batch-size": args.batch_size, "--train-size": args.train_size,
                "--test-size": args.test_size, "--data-dir": args.data_dir}
    command = [sys.executable, str(ROOT / script), "--device", args.device, "--json", json_path, "--seed", seed,
               *flags]
    for flag, value in settings.items():
        command += [flag, value] if value is not None else []
    if args.synthetic or (args.ladder and args.data_dir is None):
        command.append("--synthetic")
    result = subprocess.run([str(part) for part in command], capture_output=True, text=True)
    if result.returncode == 0:
        try:
            return json.loads(Path(json_path).read_text().splitlines()[-1]), None
        except (OSError, IndexError, json.JSONDecodeError):
            pass
    why = f"exit {result.returncode}" if result.returncode != 0 else "no row written"
    if not result.stdout + result.stderr:
        return None, f"failed ({why})"
    # kept past this run: the temporary folder of the rows goes when the benchmark ends
    with tempfile.NamedTemporaryFile("w", prefix=f"benchmark-{Path(script).stem}-", suffix=".log", delete=False) as log:
        log.write(result.stdout + result.stderr)
    return None, f"failed ({why}; its output in {log.name})"


def matmul_peak_tflops(device, dtype=torch.bfloat16, size=4096, repeats=10):
    """The device's practical peak: TFLOP/s of a large square matmul, the best of `repeats`."""
    a, b = torch.randn(size, size, device=device, dtype=dtype), torch.randn(size, size, device=device, dtype=dtype)
    torch.matmul(a, b)  # warm-up: library initialization, kernel choice
    best = float("inf")
    for _ in range(repeats):
        start = common.now(device)
        torch.matmul(a, b)
        best = min(best, common.now(device) - start)
    return 2 * size**3 / best / 1e12


def median(reports, field):
    """The median of `field` over `reports`; None where a run could not measure it (peak memory on Windows)."""
    values = [report[field] for report in reports]
    return None if None in values else statistics.median(values)


def medians(results, peak_tflops):
    """One row of medians per run name; peak_tflops is None where bfloat16 is not native."""
    rows = []
    for name, reports in results.items():
        speed, tflops = median(reports, "steady_images_per_second"), median(reports, "achieved_tflops")
        peak_memory = median(reports, "peak_memory_bytes")
        rows.append({"name": name, "images_per_second": speed, "ms_per_step": median(reports, "steady_ms_per_step"),
                     "warmup_seconds": median(reports, "warmup_seconds"),
                     "peak_memory_gib": peak_memory and peak_memory / 2**30, "tflops": tflops,
                     "percent_of_bf16_peak": peak_tflops and 100 * tflops / peak_tflops,
                     "test_accuracy": median(reports, "final_test_accuracy")})
    return rows


def spread(reports, field):
    """{"mean", "std", "min", "max"} of `field` over `reports`; std is the sample standard deviation
    (statistics.stdev, n - 1), None for one report."""
    values = [report[field] for report in reports]
    return {"mean": statistics.mean(values), "std": statistics.stdev(values) if len(values) > 1 else None,
            "min": min(values), "max": max(values)}


def steady_by_size(report):
    """{image size: (images/s, ms/step)} of the steady epochs: epochs 2 on, or where the size changes (opt5), each
    size's epochs after its first (a size trained one epoch only, compiling, is left out); "all": one size
    throughout."""
    if report["steady_images_per_second"] is not None:
        return {"all": (report["steady_images_per_second"], report["steady_ms_per_step"])}
    seen, totals = set(), {}
    for record in report["epochs"]:
        size = record.get("image_size")
        if size in seen:
            images, seconds, steps = totals.get(size, (0, 0.0, 0))
            totals[size] = (images + record["images"], seconds + record["train_seconds"], steps + record["steps"])
        seen.add(size)
    return {size: (images / seconds, 1000 * seconds / steps) for size, (images, seconds, steps) in totals.items()}


def chain_rows(results):
    """One row per script of the chain: the medians over its runs of what the table shows, then the spread of its
    test accuracy and launch-to-result seconds (spread's), its n and the seeds its runs report."""
    rows = []
    for name, reports in results.items():
        by_size = [steady_by_size(report) for report in reports]
        sizes = sorted(set.intersection(*(set(speeds) for speeds in by_size)), key=str)
        peak_memory = median(reports, "peak_memory_bytes")
        rows.append({
            "name": name,
            "images_per_second": {size: statistics.median(speeds[size][0] for speeds in by_size) for size in sizes},
            "ms_per_step": {size: statistics.median(speeds[size][1] for speeds in by_size) for size in sizes},
            "batch_size": reports[0]["settings"]["batch_size"],
            "test_accuracy": median(reports, "final_test_accuracy"),
            "launch_to_result_seconds": median(reports, "launch_to_result_seconds"),
            "first_epoch_seconds": statistics.median(report["epochs"][0]["train_seconds"] for report in reports),
            # launch to result less the epochs (their evaluations included): imports, checks, data, model
            "before_first_epoch_seconds": statistics.median(
                report["launch_to_result_seconds"] - report["total_seconds"] for report in reports),
            "peak_memory_gib": peak_memory and peak_memory / 2**30})
        for figure, field in (("test_accuracy", "final_test_accuracy"),
                              ("launch_to_result_seconds", "launch_to_result_seconds")):
            rows[-1].update({f"{figure}_{statistic}": value for statistic, value in spread(reports, field).items()})
        rows[-1].update(n=len(reports), seeds=[report["settings"].get("seed") for report in reports])
    return rows


def per_size(values, spec):
    """One figure, or one per image size: "15,608 at 16 px, 15,812 at 24 px"."""
    figures = [format(value, spec) + (f" at {size} px" if size != "all" else "") for size, value in values.items()]
    return ", ".join(figures) or "-"


def chain_table(results, failures=None):
    """The chain's markdown table: one row per script, the speedup over baseline.py's steady images/s; a script in
    `failures` ({name: why}) gets why in its images/s cell and "-" in the rest."""
    failures = failures or {}
    rows = {row["name"]: row for row in chain_rows({name: reports for name, reports in results.items()
                                                    if name not in failures})}
    baseline = rows["baseline.py"]["images_per_second"].get("all") if "baseline.py" in rows else None
    lines = ["| script | images/s | speedup | ms/step (batch) | test acc % | launch to result s | first epoch s "
             "(compile) | before it s | peak memory GiB |", "|---|---|---|---|---|---|---|---|---|"]
    for name in results:
        if name in failures:
            lines.append(f"| {name} | {failures[name]} |" + " - |" * 7)
            continue
        row = rows[name]
        speed = row["images_per_second"].get("all")
        speedup = f"{speed / baseline:.2f}x" if speed and baseline else "-"
        lines.append(
            f"| {row['name']} | {per_size(row['images_per_second'], ',.0f')} | {speedup} "
            f"| {per_size(row['ms_per_step'], '.1f')} ({row['batch_size']}) | {100 * row['test_accuracy']:.2f} "
            f"| {row['launch_to_result_seconds']:.1f} | {row['first_epoch_seconds']:.1f} "
            f"| {row['before_first_epoch_seconds']:.1f} | {accounting.shown(row['peak_memory_gib'], '.2f')} |")
    return "\n".join(lines)


def spread_table(results):
    """The chain's spread over its rounds as a markdown table: one row per script in `results` (those that ran), its
    n and seeds, then mean, std, min and max of its test accuracy % and of its seconds from launch to result; a std
    of one run is "-"."""
    lines = ["| script | n | seeds | test acc % mean | std | min | max | launch to result s mean | std | min | max |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for row in chain_rows(results):
        cells = [row["name"], str(row["n"]), ", ".join(str(seed) for seed in row["seeds"])]
        for name, scale, spec in (("test_accuracy", 100, ".2f"), ("launch_to_result_seconds", 1, ".1f")):
            cells += ["-" if row[f"{name}_{statistic}"] is None else format(scale * row[f"{name}_{statistic}"], spec)
                      for statistic in ("mean", "std", "min", "max")]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def speedup_over(row, over):
    """row's images/s over `over`'s as "1.25x"; "-" where `over` failed (None)."""
    return f"{row['images_per_second'] / over['images_per_second']:.2f}x" if over else "-"


def ladder_table(results, peak_tflops, failures=None):
    """One row per rung: medians over its runs, its speedup over the rung it adds to and over baseline; a rung in
    `failures` ({rung: why}) gets why in its images/s cell and "-" in the rest."""
    failures = failures or {}
    rows = {row["name"]: row for row in medians({rung: reports for rung, reports in results.items()
                                                 if rung not in failures}, peak_tflops)}
    lines = ["| rung | flags | adds | acts only on a GPU | images/s | vs | speedup | vs baseline | ms/step "
             "| warm-up s | peak memory GiB | % of bf16 peak |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for rung, script, flags, compared_with, adds, gpu_only in LADDER:
        described = f"| {rung} | `{' '.join([script, *flags])}` | {adds} | {gpu_only or '-'} "
        if rung in failures:
            lines.append(f"{described}| {failures[rung]} |" + " - |" * 7)
            continue
        row = rows[rung]
        lines.append(
            f"{described}| {row['images_per_second']:.0f} | {compared_with or ''} "
            f"| {speedup_over(row, rows.get(compared_with)) if compared_with else ''} "
            f"| {speedup_over(row, rows.get('baseline'))} | {row['ms_per_step']:.1f} "
            f"| {row['warmup_seconds']:.1f} | {accounting.shown(row['peak_memory_gib'], '.2f')} "
            f"| {accounting.shown(row['percent_of_bf16_peak'], '.0f')} |")
    return "\n".join(lines)


def measure_peaks(peaks, device):
    """Add this round's best matmul TFLOP/s per dtype: the peak drifts with the machine too, so the best is kept."""
    for dtype, measured in peaks.items():
        # bfloat16 only where it is native: emulated, its matmuls take minutes and say nothing of a peak
        if dtype == torch.float32 or device.type == "cuda" or common.bfloat16_unit() is not None:
            measured.append(matmul_peak_tflops(device, dtype))


def seeds_said(seeds):
    """The rounds' seeds in words: "seed 0", "seed 0 in every round", "seeds 0 to 4"."""
    if len(set(seeds)) == 1:
        return f"seed {seeds[0]}" + (" in every round" if len(seeds) > 1 else "")
    return f"seeds {seeds[0]} to {seeds[-1]}"


def main():
    args = parse_args()
    commit = accounting.commit_at_start()
    runs, seeds = runs_to_compare(args), round_seeds(args)
    results, failures = {name: [] for name, _, _ in runs}, {}
    peaks = {torch.bfloat16: [], torch.float32: []}
    device = None  # the device the runs report, once one has
    with tempfile.TemporaryDirectory() as folder:
        for round_number in range(1, args.repeats + 1):
            for run_number, (name, script, flags) in enumerate(runs):
                seed = seeds[round_number - 1]
                # flushed now: a run takes minutes
                print(f"round {round_number}/{args.repeats} {name} (seed {seed}): ", end="", flush=True)
                if name in failures:  # it would fail again: its first failure is in the table
                    print("skipped, failed before", flush=True)
                    continue
                json_path = Path(folder) / f"{run_number}.{round_number}.json"
                report, failure = run_once(script, flags, args, json_path, seed)
                if failure:
                    failures[name] = failure
                    print(failure, flush=True)
                    continue
                report = accounting.add_provenance(accounting.add_work(report), commit)
                results[name].append(report)
                device = torch.device(report["device"])
                speeds = {size: speed for size, (speed, _) in steady_by_size(report).items()}
                print(f"{per_size(speeds, ',.0f')} img/s, test acc "
                      f"{100 * report['final_test_accuracy']:.2f}%, {report['launch_to_result_seconds']:.0f} s from "
                      f"launch to result", flush=True)
                if args.json:
                    with open(args.json, "a") as file:
                        file.write(json.dumps({**report, "benchmark_run": name, "round": round_number}) + "\n")
            if args.ladder and device is not None:
                measure_peaks(peaks, device)
    ran = {name: reports for name, reports in results.items() if name not in failures}
    summary = {"benchmark": "ladder" if args.ladder else "chain", "chain": common.CHAIN_NUMBERING,
               "date": datetime.datetime.now().isoformat(timespec="seconds"),
               "command": shlex.join(["python", "lab/benchmark.py", *sys.argv[1:]])}
    print()
    if ran:
        first = next(iter(ran.values()))[0]
        machine = first["cpu"] if first["device"] == "cpu" else first["device_name"]
        data = "generated data" if first["data"] == "synthetic" else \
            f"CIFAR-10 in {first['settings']['data_dir']} (fingerprint {first['data_fingerprint']})"
        print(f"{machine}, {first['threads']} threads, torch {first['torch']}, "
              f"commit {first['commit'] or 'unknown (not a git checkout)'}; {data}; "
              f"medians of {args.repeats} round{'s' * (args.repeats > 1)}, {seeds_said(seeds)}", end="")
        summary.update(machine=machine, threads=first["threads"], torch=first["torch"], commit=first["commit"],
                       data_fingerprint=first["data_fingerprint"])
    summary.update(settings=vars(args), seeds=seeds, failed=failures)
    if args.ladder:
        peak_tflops = max(peaks[torch.bfloat16], default=None)
        float32_peak_tflops = max(peaks[torch.float32], default=None)  # None where no run gave a device
        no_bf16 = " (bf16 not measured: no bfloat16 unit, so the scripts run float32)" if peak_tflops is None else ""
        if ran:
            print(f", {args.train_size} training images x {args.epochs} epochs, batch {args.batch_size}; peak = the "
                  f"best 4096x4096 matmul of all rounds: bf16 {accounting.shown(peak_tflops, '.2f')} TFLOP/s, float32 "
                  f"{float32_peak_tflops:.2f} TFLOP/s{no_bf16}\n")
        print(ladder_table(results, peak_tflops, failures))
        summary.update(bf16_peak_tflops=peak_tflops, float32_peak_tflops=float32_peak_tflops,
                       rows=medians(ran, peak_tflops))
    else:
        given = [f"--{name.replace('_', '-')} {value}" for name, value in vars(args).items()
                 if name in ("epochs", "batch_size", "train_size", "test_size") and value is not None]
        if ran:
            print(f"; each script at its defaults{' but ' + ' '.join(given) if given else ''}\n")
        print(chain_table(results, failures))
        if ran and args.repeats > 1:  # one round has no spread: its figures are the table's
            print(f"\nthe spread over the {args.repeats} rounds (std: sample, n - 1 in the denominator)\n")
            print(spread_table(ran))
        summary["rows"] = chain_rows(ran)
    if args.json:
        with open(args.json, "a") as file:
            file.write(json.dumps(summary) + "\n")
    if failures:
        sys.exit(1)  # after the whole table: the runs that worked are measured all the same


if __name__ == "__main__":
    main()
