"""benchmark.py: run the chain side by side and print one markdown table of speed and accuracy.

    python benchmark.py                                   # synthetic data, quick (minutes on a CPU)
    python benchmark.py --data-dir ./data --train-size 50000 --test-size 10000

Every script gets the same settings and runs in its own process. The scripts take turns
(A B C D, A B C D, ...) for --repeats rounds, so slow drift of the machine hits all of them alike,
and the table shows each figure's median over the rounds. Speedup is steady-state images/s over
baseline.py's.
"""
import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

import common

ROOT = Path(__file__).resolve().parent
SCRIPTS = ["baseline.py", "opt1.py", "opt2.py", "opt3.py"]


def parse_args():
    parser = common.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add = parser.add_argument
    add("--scripts", nargs="+", default=SCRIPTS, help=f"scripts to compare (default: {' '.join(SCRIPTS)})")
    add("--repeats", type=common.positive_int, default=3, help="rounds over all scripts (default: 3)")
    add("--epochs", type=int, default=2, help="epochs per run; steady state needs 2 or more (default: 2)")
    add("--batch-size", type=common.positive_int, default=128, help="the same for every script (default: 128)")
    add("--train-size", type=common.positive_int, default=2048, help="training images per epoch (default: 2048)")
    add("--test-size", type=common.positive_int, default=1024, help="test images (default: 1024)")
    add("--data-dir", default=None, help="real CIFAR-10 here instead of synthetic data (default: synthetic)")
    add("--device", choices=["auto", "cuda", "cpu"], default="auto", help="passed to every script (default: auto)")
    add("--compile", action=argparse.BooleanOptionalAction, default=True,
        help="let the scripts that have --compile use it (default: on)")
    args = parser.parse_args()
    if args.epochs < 2:
        common.fail("--epochs must be at least 2: steady state excludes epoch 1")
    for script in args.scripts:
        if not (ROOT / script).is_file():
            common.fail(f"no script {script} next to benchmark.py; choose from {' '.join(SCRIPTS)}")
    return args


def run_once(script, args, json_path):
    """Run one script once; returns its --json report."""
    command = [sys.executable, str(ROOT / script), "--epochs", args.epochs, "--batch-size", args.batch_size,
               "--train-size", args.train_size, "--test-size", args.test_size, "--device", args.device,
               "--json", json_path]
    command += ["--data-dir", args.data_dir] if args.data_dir else ["--synthetic"]
    if not args.compile and script != "baseline.py":  # baseline never compiles, so it has no such flag
        command.append("--no-compile")
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
    return statistics.median(report[field] for report in reports)


def markdown_table(results, peak_tflops):
    """One row per script: medians over its runs."""
    baseline_speed = median(results["baseline.py"], "steady_images_per_second") if "baseline.py" in results else None
    lines = ["| script | images/s | speedup | ms/step | warm-up s | peak memory GiB | TFLOP/s | % of bf16 peak "
             "| test acc % |", "|---|---|---|---|---|---|---|---|---|"]
    for script, reports in results.items():
        speed, tflops = median(reports, "steady_images_per_second"), median(reports, "achieved_tflops")
        speedup = f"{speed / baseline_speed:.2f}x" if baseline_speed else "n/a"
        lines.append(
            f"| {script} | {speed:.0f} | {speedup} | {median(reports, 'steady_ms_per_step'):.1f} "
            f"| {median(reports, 'warmup_seconds'):.1f} | {median(reports, 'peak_memory_bytes') / 2**30:.2f} "
            f"| {tflops:.3f} | {100 * tflops / peak_tflops:.0f} | {100 * median(reports, 'final_test_accuracy'):.1f} |")
    return "\n".join(lines)


def main():
    args = parse_args()
    results = {script: [] for script in args.scripts}
    peaks = {torch.bfloat16: [], torch.float32: []}
    with tempfile.TemporaryDirectory() as folder:
        for round_number in range(1, args.repeats + 1):
            for script in args.scripts:
                report = run_once(script, args, Path(folder) / f"{script}.{round_number}.json")
                results[script].append(report)
                print(f"round {round_number}/{args.repeats} {script}: {report['steady_images_per_second']:.0f} img/s, "
                      f"test acc {100 * report['final_test_accuracy']:.1f}%", flush=True)
            # the peak drifts with the machine too, so it is measured every round and the best is kept
            for dtype, measured in peaks.items():
                measured.append(matmul_peak_tflops(torch.device(report["device"]), dtype))
    first = next(iter(results.values()))[0]
    peak_tflops, float32_peak_tflops = max(peaks[torch.bfloat16]), max(peaks[torch.float32])
    data = f"CIFAR-10 in {args.data_dir}" if args.data_dir else "synthetic data"
    print(f"\n{first['device_name']}, {first['threads']} threads, torch {first['torch']}; {data}, "
          f"{args.train_size} training images x {args.epochs} epochs, batch {args.batch_size}, "
          f"medians of {args.repeats} rounds; peak = the best 4096x4096 matmul of all rounds: "
          f"bf16 {peak_tflops:.2f} TFLOP/s, float32 {float32_peak_tflops:.2f} TFLOP/s\n")
    print(markdown_table(results, peak_tflops))


if __name__ == "__main__":
    main()
