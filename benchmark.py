"""benchmark.py: run the chain side by side and print one markdown table of speed and accuracy.

    python benchmark.py                                   # synthetic data, quick (minutes on a CPU)
    python benchmark.py --ladder                          # what each optimization buys, one rung at a time
    python benchmark.py --data-dir ./data --train-size 50000 --test-size 10000
    python benchmark.py --device cuda --train-size 50000 --test-size 10000 --epochs 3   # on a GPU

Every run gets the same settings and its own process. The runs take turns (A B C D, A B C D, ...)
for --repeats rounds, so slow drift of the machine hits all of them alike, and the table shows each
figure's median over the rounds. Speedup is steady-state images/s over baseline.py's.
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

import common
import harness

ROOT = Path(__file__).resolve().parent
SCRIPTS = ["baseline.py", "opt1.py", "opt2.py", "opt3.py"]
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
    ("opt3 eager", "opt3.py", ["--no-compile"], "opt2, 0 workers",
     "data on the device, channels_last, the step on device buffers, no host sync, flip TTA; minus torch.compile",
     "no host sync; the step captured as one CUDA graph"),
    ("opt3", "opt3.py", [], "opt3 eager", "torch.compile (the step's two halves and the evaluation)", ""),
]


def parse_args():
    parser = harness.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add = parser.add_argument
    add("--scripts", nargs="+", default=SCRIPTS, help=f"scripts to compare (default: {' '.join(SCRIPTS)})")
    add("--ladder", action="store_true",
        help="run the ladder instead: one rung per optimization group, switched by the scripts' own flags "
             "(default: off)")
    add("--repeats", type=harness.positive_int, default=3, help="rounds over all scripts (default: 3)")
    add("--epochs", type=int, default=2, help="epochs per run; steady state needs 2 or more (default: 2)")
    add("--batch-size", type=harness.positive_int, default=128, help="the same for every script (default: 128)")
    add("--train-size", type=harness.positive_int, default=2048, help="training images per epoch (default: 2048)")
    add("--test-size", type=harness.positive_int, default=1024, help="test images (default: 1024)")
    add("--data-dir", default=None, help="real CIFAR-10 here instead of synthetic data (default: synthetic)")
    add("--device", choices=["auto", "cuda", "cpu"], default="auto", help="passed to every script (default: auto)")
    add("--compile", action=argparse.BooleanOptionalAction, default=True,
        help="let the scripts that have --compile use it; the ladder sets it per rung (default: on)")
    add("--json", metavar="PATH", default=None,
        help="append every run's report and one summary line with the table's medians (default: off)")
    args = parser.parse_args()
    if args.epochs < 2:
        common.fail("--epochs must be at least 2: steady state excludes epoch 1")
    for script in args.scripts:
        if not (ROOT / script).is_file():
            common.fail(f"no script {script} next to benchmark.py; choose from {' '.join(SCRIPTS)}")
    return args


def runs_to_compare(args):
    """(name, script, flags) per run: the ladder's rungs, or each script with --compile as asked."""
    if args.ladder:
        return [(rung, script, flags) for rung, script, flags, *_ in LADDER]
    # baseline never compiles, so it has no such flag
    return [(script, script, [] if args.compile or script == "baseline.py" else ["--no-compile"])
            for script in args.scripts]


def run_once(script, flags, args, json_path):
    """Run one script once; returns its --json report."""
    command = [sys.executable, str(ROOT / script), "--epochs", args.epochs, "--batch-size", args.batch_size,
               "--train-size", args.train_size, "--test-size", args.test_size, "--device", args.device,
               "--json", json_path, *flags]
    command += ["--data-dir", args.data_dir] if args.data_dir else ["--synthetic"]
    result = subprocess.run([str(part) for part in command], capture_output=True, text=True)
    if result.returncode != 0:
        common.fail(f"{script} failed (exit {result.returncode}): {result.stderr.strip()[-500:]}", code=1)
    return json.loads(Path(json_path).read_text().splitlines()[-1])


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


def markdown_table(results, peak_tflops):
    """One row per script: medians over its runs."""
    baseline_speed = median(results["baseline.py"], "steady_images_per_second") if "baseline.py" in results else None
    lines = ["| script | images/s | speedup | ms/step | warm-up s | peak memory GiB | TFLOP/s | % of bf16 peak "
             "| test acc % |", "|---|---|---|---|---|---|---|---|---|"]
    for row in medians(results, peak_tflops):
        speedup = f"{row['images_per_second'] / baseline_speed:.2f}x" if baseline_speed else "n/a"
        lines.append(
            f"| {row['name']} | {row['images_per_second']:.0f} | {speedup} | {row['ms_per_step']:.1f} "
            f"| {row['warmup_seconds']:.1f} | {harness.shown(row['peak_memory_gib'], '.2f')} | {row['tflops']:.3f} "
            f"| {harness.shown(row['percent_of_bf16_peak'], '.0f')} | {100 * row['test_accuracy']:.1f} |")
    return "\n".join(lines)


def ladder_table(results, peak_tflops):
    """One row per rung: medians over its runs, its speedup over the rung it adds to and over baseline."""
    rows = {row["name"]: row for row in medians(results, peak_tflops)}
    lines = ["| rung | flags | adds | acts only on a GPU | images/s | vs | speedup | vs baseline | ms/step "
             "| warm-up s | peak memory GiB | % of bf16 peak |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for rung, script, flags, compared_with, adds, gpu_only in LADDER:
        row = rows[rung]
        speedup = f"{row['images_per_second'] / rows[compared_with]['images_per_second']:.2f}x" if compared_with else ""
        lines.append(
            f"| {rung} | `{' '.join([script, *flags])}` | {adds} | {gpu_only or '-'} "
            f"| {row['images_per_second']:.0f} | {compared_with or ''} | {speedup} "
            f"| {row['images_per_second'] / rows['baseline']['images_per_second']:.2f}x | {row['ms_per_step']:.1f} "
            f"| {row['warmup_seconds']:.1f} | {harness.shown(row['peak_memory_gib'], '.2f')} "
            f"| {harness.shown(row['percent_of_bf16_peak'], '.0f')} |")
    return "\n".join(lines)


def main():
    args = parse_args()
    runs = runs_to_compare(args)
    results = {name: [] for name, _, _ in runs}
    peaks = {torch.bfloat16: [], torch.float32: []}
    with tempfile.TemporaryDirectory() as folder:
        for round_number in range(1, args.repeats + 1):
            for run_number, (name, script, flags) in enumerate(runs):
                report = run_once(script, flags, args, Path(folder) / f"{run_number}.{round_number}.json")
                results[name].append(report)
                print(f"round {round_number}/{args.repeats} {name}: {report['steady_images_per_second']:.0f} img/s, "
                      f"test acc {100 * report['final_test_accuracy']:.1f}%", flush=True)
                if args.json:
                    with open(args.json, "a") as file:
                        file.write(json.dumps({**report, "benchmark_run": name, "round": round_number}) + "\n")
            # the peak drifts with the machine too, so it is measured every round and the best is kept
            device = torch.device(report["device"])
            for dtype, measured in peaks.items():
                # bfloat16 only where it is native: emulated, its matmuls take minutes and say nothing of a peak
                if dtype == torch.float32 or device.type == "cuda" or common.bfloat16_unit() is not None:
                    measured.append(matmul_peak_tflops(device, dtype))
    first = next(iter(results.values()))[0]
    peak_tflops, float32_peak_tflops = max(peaks[torch.bfloat16], default=None), max(peaks[torch.float32])
    data = f"CIFAR-10 in {args.data_dir}" if args.data_dir else "synthetic data"
    machine = first["cpu"] if first["device"] == "cpu" else first["device_name"]
    print(f"\n{machine}, {first['threads']} threads, torch {first['torch']}; {data}, "
          f"{args.train_size} training images x {args.epochs} epochs, batch {args.batch_size}, "
          f"medians of {args.repeats} rounds; peak = the best 4096x4096 matmul of all rounds: "
          f"bf16 {harness.shown(peak_tflops, '.2f')} TFLOP/s, float32 {float32_peak_tflops:.2f} TFLOP/s"
          f"{' (bf16 not measured: no bfloat16 unit, so the scripts run float32)' if peak_tflops is None else ''}\n")
    print(ladder_table(results, peak_tflops) if args.ladder else markdown_table(results, peak_tflops))
    if args.json:
        summary = {"benchmark": "ladder" if args.ladder else "chain",
                   "date": datetime.datetime.now().isoformat(timespec="seconds"),
                   "command": shlex.join(["python", "benchmark.py", *sys.argv[1:]]), "machine": machine,
                   "threads": first["threads"], "torch": first["torch"], "settings": vars(args),
                   "bf16_peak_tflops": peak_tflops, "float32_peak_tflops": float32_peak_tflops,
                   "rows": medians(results, peak_tflops)}
        with open(args.json, "a") as file:
            file.write(json.dumps(summary) + "\n")


if __name__ == "__main__":
    main()
