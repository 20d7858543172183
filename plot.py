"""plot.py: draw the README's figure from the measured data in results/.

    python plot.py                      # results/chain-5-epochs.jsonl + results/ladder.jsonl -> results/chain.png
    python plot.py --tables             # the same data as the markdown tables of results/README.md

Three panels: test accuracy per epoch of each script on real CIFAR-10; steady images/s of each
rung of the ladder (benchmark.py --ladder), with the machine's bf16 matmul peak for reference; and
test accuracy against training seconds, which shows speed and learning together.
Needs matplotlib (the training scripts do not).
"""
import argparse
import json
from pathlib import Path

import common

CHAIN = ["baseline.py", "opt1.py", "opt2.py", "opt3.py"]


def parse_args():
    parser = common.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", default="results/chain-5-epochs.jsonl",
                        help="the scripts' --json lines of real-data runs (default: results/chain-5-epochs.jsonl)")
    parser.add_argument("--ladder", default="results/ladder.jsonl",
                        help="benchmark.py --ladder --json output (default: results/ladder.jsonl)")
    parser.add_argument("--out", default="results/chain.png", help="the PNG to write (default: results/chain.png)")
    parser.add_argument("--tables", action="store_true", help="print markdown tables instead of drawing (default: off)")
    return parser.parse_args()


def read_lines(path):
    """Every JSON line of `path`; exit 2 with one line if it is missing or not JSON lines."""
    try:
        return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    except (OSError, json.JSONDecodeError) as error:
        common.fail(f"cannot read {path} ({type(error).__name__}: {error}); make it with the scripts' --json")


def latest_run_per_script(lines):
    """The last real-CIFAR-10 report of each chain script, in chain order."""
    runs = {line["script"]: line for line in lines if line.get("data") == "cifar10" and line.get("script") in CHAIN}
    if not runs:
        common.fail("no real-CIFAR-10 run of baseline.py, opt1.py, opt2.py or opt3.py in --runs")
    return [runs[script] for script in CHAIN if script in runs]


def latest_ladder(lines):
    """The last ladder summary line of benchmark.py."""
    summaries = [line for line in lines if line.get("benchmark") == "ladder"]
    if not summaries:
        common.fail("no `benchmark.py --ladder --json` summary line in --ladder")
    return summaries[-1]


def markdown_tables(runs, ladder):
    """Accuracy per epoch of each script's run, and each ladder rung's steady speed, as markdown."""
    epochs = max(len(run["epochs"]) for run in runs)
    lines = ["| script | " + " | ".join(f"epoch {epoch}" for epoch in range(1, epochs + 1))
             + " | training minutes | steady images/s |", "|---" * (epochs + 3) + "|"]
    for run in runs:
        accuracies = [f"{100 * record['test_accuracy']:.1f}" for record in run["epochs"]]
        minutes = sum(record["train_seconds"] for record in run["epochs"]) / 60
        lines.append(f"| `{run['script']}` | " + " | ".join(accuracies) + f" | {minutes:.1f} "
                     f"| {run['steady_images_per_second']:.0f} |")
    lines += ["", "| rung | images/s | ms/step | warm-up s | peak memory GiB | TFLOP/s | % of bf16 peak |",
              "|---|---|---|---|---|---|---|"]
    for row in ladder["rows"]:
        lines.append(f"| {row['name']} | {row['images_per_second']:.0f} | {row['ms_per_step']:.1f} "
                     f"| {row['warmup_seconds']:.1f} | {common.shown(row['peak_memory_gib'], '.2f')} "
                     f"| {row['tflops']:.3f} | {common.shown(row['percent_of_bf16_peak'], '.0f')} |")
    return "\n".join(lines)


def draw(runs, ladder, out):
    import matplotlib
    matplotlib.use("Agg")  # files only, no window
    import matplotlib.pyplot as plt

    figure, (accuracy_axis, speed_axis, time_axis) = plt.subplots(1, 3, figsize=(15, 4.2), dpi=100)
    for run in runs:
        epochs = [record["epoch"] for record in run["epochs"]]
        accuracy = [100 * record["test_accuracy"] for record in run["epochs"]]
        accuracy_axis.plot(epochs, accuracy, marker="o", label=run["script"])
        seconds, elapsed = [], 0.0
        for record in run["epochs"]:
            elapsed += record["train_seconds"]
            seconds.append(elapsed / 60)
        time_axis.plot(seconds, accuracy, marker="o", label=run["script"])
    accuracy_axis.set(title="Test accuracy, real CIFAR-10", xlabel="epoch", ylabel="test accuracy %")
    accuracy_axis.set_xticks(range(1, max(len(run["epochs"]) for run in runs) + 1))
    time_axis.set(title="Accuracy against training time", xlabel="training minutes (evaluation excluded)",
                  ylabel="test accuracy %")
    for axis in (accuracy_axis, time_axis):
        axis.grid(alpha=0.3)
        axis.legend(fontsize=8)

    rows = ladder["rows"]
    names = [row["name"] for row in rows]
    tflops = [row["tflops"] for row in rows]
    speed_axis.bar(range(len(rows)), tflops, color="tab:blue")
    if ladder["bf16_peak_tflops"] is not None:  # None: a CPU without a bfloat16 unit, where the scripts run float32
        speed_axis.axhline(ladder["bf16_peak_tflops"], color="tab:red", linestyle="--",
                           label=f"bf16 matmul peak {ladder['bf16_peak_tflops']:.2f} TFLOP/s")
    if "float32_peak_tflops" in ladder:  # the reference for the float32 baseline
        speed_axis.axhline(ladder["float32_peak_tflops"], color="tab:gray", linestyle=":",
                           label=f"float32 matmul peak {ladder['float32_peak_tflops']:.2f} TFLOP/s")
    for index, row in enumerate(rows):
        speed_axis.text(index, row["tflops"], f"{row['images_per_second']:.0f}/s", ha="center", va="bottom",
                        fontsize=7)
    speed_axis.set_xticks(range(len(rows)), names, rotation=35, ha="right", fontsize=8)
    speed_axis.set(title="Steady speed per ladder rung, batch 128 (labels: images/s)", ylabel="achieved TFLOP/s",
                   ylim=(0, 1.15 * max(ladder["bf16_peak_tflops"] or 0, ladder.get("float32_peak_tflops", 0), *tflops)))
    speed_axis.legend(fontsize=8, loc="upper left")
    first = runs[0]
    machine = f"{first['cpu']}, {first['threads']} threads" if first["device"] == "cpu" else first["device_name"]
    figure.suptitle(f"fast-cifar: ResNet10 on {machine}, torch {first['torch']}", fontsize=10)
    figure.tight_layout()
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(out)


def main():
    args = parse_args()
    if args.tables:
        print(markdown_tables(latest_run_per_script(read_lines(args.runs)), latest_ladder(read_lines(args.ladder))))
        return
    try:
        import matplotlib  # noqa: F401  (imported here so a missing install is one clear line)
    except ImportError:
        common.fail("plot.py needs matplotlib: pip install matplotlib==3.11.2 (or pip install -r requirements.txt)")
    runs = latest_run_per_script(read_lines(args.runs))
    ladder = latest_ladder(read_lines(args.ladder))
    draw(runs, ladder, args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
