"""plot.py: draw the README's figure from the measured data in results/.

    python plot.py            # results/{chain-5-epochs,ladder,convergence}.jsonl -> results/chain.png
    python plot.py --tables   # the same data as the markdown tables of results/README.md

Three panels: test accuracy per epoch of each script on real CIFAR-10; steady images/s of each
rung of the ladder (benchmark.py --ladder), with the machine's bf16 matmul peak for reference; and
opt3's and opt4's test accuracy against minutes since launch, which shows speed and learning together.
Needs matplotlib (the training scripts do not).
"""
import argparse
import json
import shlex
import statistics
from pathlib import Path

import common

CHAIN = ["baseline.py", "opt1.py", "opt2.py", "opt3.py"]
CONVERGENCE = ["opt3.py", "opt4.py"]  # the step opt4 takes, and the rung it is measured against


def parse_args():
    parser = common.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", default="results/chain-5-epochs.jsonl",
                        help="the scripts' --json lines of real-data runs (default: results/chain-5-epochs.jsonl)")
    parser.add_argument("--ladder", default="results/ladder.jsonl",
                        help="benchmark.py --ladder --json output (default: results/ladder.jsonl)")
    parser.add_argument("--convergence", default="results/convergence.jsonl",
                        help="real-data runs of opt3.py and opt4.py with their launch times "
                             "(default: results/convergence.jsonl)")
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


def convergence_runs(lines):
    """Every real-CIFAR-10 run of opt3 and opt4 that records its launch-to-result time, in file order."""
    runs = [line for line in lines if line.get("data") == "cifar10" and line.get("script") in CONVERGENCE
            and line.get("launch_to_result_seconds") is not None]
    if not runs:
        common.fail("no real-CIFAR-10 run of opt3.py or opt4.py with launch_to_result_seconds in --convergence")
    return runs


def flags(run):
    """The run's command-line flags, less where the data and the JSON went."""
    words, shown_words = shlex.split(run["command"])[2:], []
    while words:
        word = words.pop(0)
        if word in ("--data-dir", "--json"):
            words.pop(0)
        else:
            shown_words.append(word)
    return " ".join(shown_words) or "(defaults)"


def latest_ladder(lines):
    """The last ladder summary line of benchmark.py."""
    summaries = [line for line in lines if line.get("benchmark") == "ladder"]
    if not summaries:
        common.fail("no `benchmark.py --ladder --json` summary line in --ladder")
    return summaries[-1]


def markdown_tables(runs, ladder, convergence):
    """Accuracy per epoch of each script's run, each ladder rung's steady speed, and the convergence runs."""
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
    opt3_minutes = [run["launch_to_result_seconds"] / 60 for run in convergence if run["script"] == "opt3.py"]
    reference = statistics.mean(opt3_minutes) if opt3_minutes else None
    lines += ["", "| script | flags | image sizes per epoch | test acc % | launch to result min | of opt3's |",
              "|---|---|---|---|---|---|"]
    for run in convergence:
        sizes = ", ".join(str(record.get("image_size", 32)) for record in run["epochs"])
        minutes = run["launch_to_result_seconds"] / 60
        share = common.shown(reference and minutes / reference, ".0%")
        lines.append(f"| `{run['script']}` | `{flags(run)}` | {sizes} | {100 * run['final_test_accuracy']:.1f} "
                     f"| {minutes:.1f} | {share} |")
    return "\n".join(lines)


def draw(runs, ladder, convergence, out):
    import matplotlib
    matplotlib.use("Agg")  # files only, no window
    import matplotlib.pyplot as plt

    figure, (accuracy_axis, speed_axis, time_axis) = plt.subplots(1, 3, figsize=(15, 4.2), dpi=100)
    for run in runs:
        epochs = [record["epoch"] for record in run["epochs"]]
        accuracy = [100 * record["test_accuracy"] for record in run["epochs"]]
        accuracy_axis.plot(epochs, accuracy, marker="o", label=run["script"])
    accuracy_axis.set(title="Test accuracy, real CIFAR-10", xlabel="epoch", ylabel="test accuracy %")
    accuracy_axis.set_xticks(range(1, max(len(run["epochs"]) for run in runs) + 1))
    for run in convergence:
        minutes = [record["launch_seconds"] / 60 for record in run["epochs"]]
        accuracy = [100 * record["test_accuracy"] for record in run["epochs"]]
        time_axis.plot(minutes, accuracy, marker="o", label=f"{run['script']} {flags(run)}")
    time_axis.set_title(f"Accuracy against minutes since launch, {convergence[0]['cpu']}\n"
                        "(opt4 before its last epoch: a 1,000-image subset)", fontsize=9)
    time_axis.set(xlabel="minutes since launch", ylabel="test accuracy %")
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
    figure.suptitle(f"fast-cifar: ResNet10, torch {first['torch']}; left and middle: {machine}", fontsize=10,
                    y=0.995)
    figure.tight_layout()
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(out)


def main():
    args = parse_args()
    runs = latest_run_per_script(read_lines(args.runs))
    ladder = latest_ladder(read_lines(args.ladder))
    convergence = convergence_runs(read_lines(args.convergence))
    if args.tables:
        print(markdown_tables(runs, ladder, convergence))
        return
    try:
        import matplotlib  # noqa: F401  (imported here so a missing install is one clear line)
    except ImportError:
        common.fail("plot.py needs matplotlib: pip install matplotlib==3.11.2 (or pip install -r requirements.txt)")
    draw(runs, ladder, convergence, args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
