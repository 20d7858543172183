"""plot.py: draw the README's figures from the measured data in lab/results/.

    python lab/plot.py            # each script's newest H200 row (GPU_RUNS) -> lab/results/chain.png; CPU's: cpu.png
    python lab/plot.py --tables   # the same data, and ablation.py's rows, as the markdown tables of lab/README.md

chain.png, the GPU's: each script's steady images/s at its defaults, and where each run's seconds from launch to
result went (before the first epoch, the first epoch with its warm-up, the rest), with its test accuracy and commit.
cpu.png, three panels: test accuracy per epoch of each script on real CIFAR-10; steady images/s of each rung of
the ladder (benchmark.py --ladder); and the final test accuracy of opt4, and of opt5 with each optimizer, against
launch-to-result time as a share of opt4 --epochs 5's on the same CPU (one file of --muon per CPU), one point per
--epochs, the mean of its seeds, so that each is a curve and they compare at equal time. Needs matplotlib (the
training scripts do not).
"""
import argparse
import difflib
import importlib.util
import json
import re
import shlex
import statistics
import subprocess
from pathlib import Path

import root  # noqa: F401  (first: the repository's root on sys.path, for the scripts and common.py)
import ablation  # noqa: E402
import accounting  # noqa: E402
import benchmark  # noqa: E402
import common  # noqa: E402

CHAIN = ["baseline.py", "opt1.py", "opt2.py", "opt3.py", "opt4.py"]
CONVERGENCE = ["opt4.py", "opt5.py"]  # the step opt5 takes, and the rung it is measured against
DEFAULT_EPOCHS = 5  # opt4's --epochs default, and opt5's before the recipe: the runs the curve summary compares
OPTIMIZER_NAMES = {"opt5.py muon": "Muon", "opt5.py adamw": "AdamW"}
CHAIN_ORDER = {script: index for index, script in enumerate(benchmark.SCRIPTS)}
# The newest row of each script on an H200: today's code where it ran (4faed98), then the chain after the whole step
# moved onto the device (38c59a9) for the scripts that did not; and before it (--gpu gives those to --tables).
# Data files keep the names their runs had: h200-38c59a9/opt4-cold-cache.jsonl is today's opt5 (the recipe)
GPU_RUNS = ["lab/results/h200-4faed98/chain.jsonl",
            *(f"lab/results/h200-38c59a9/{name}.jsonl" for name in ("chain-cold-cache", "opt4-cold-cache"))]
GPU_RUNS_BEFORE = [f"lab/results/h200-410ebec/{name}.jsonl"
                   for name in ("chain-cold-cache", "warm-cache", "bigger-batch")]


def parse_args():
    parser = common.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gpu", nargs="+", default=GPU_RUNS,
                        help=f"the scripts' --json lines of real-data runs on a GPU, newest first: a script's run "
                             f"with the same flags in a later file is left out (default: {' '.join(GPU_RUNS)})")
    parser.add_argument("--runs", default="lab/results/chain-5-epochs.jsonl",
                        help="the scripts' --json lines of real-data runs (default: lab/results/chain-5-epochs.jsonl)")
    parser.add_argument("--ladder", default="lab/results/ladder.jsonl",
                        help="benchmark.py --ladder --json output (default: lab/results/ladder.jsonl)")
    parser.add_argument("--convergence", default="lab/results/convergence.jsonl",
                        help="real-data runs of opt4.py and opt5.py with their launch times "
                             "(default: lab/results/convergence.jsonl)")
    parser.add_argument("--curve", default="lab/results/curve.jsonl",
                        help="real-data runs of opt4.py and opt5.py at several --epochs, one CPU, one sitting "
                             "(default: lab/results/curve.jsonl)")
    parser.add_argument("--seeds", default="lab/results/seeds.jsonl",
                        help="real-data runs of opt4.py and opt5.py at their default --epochs with seeds other than "
                             "the curve's (default: lab/results/seeds.jsonl)")
    parser.add_argument("--muon", nargs="+", default=["lab/results/muon.jsonl", "lab/results/muon-xeon-amx.jsonl"],
                        help="real-data runs of opt4.py and of opt5.py with each --optimizer, one file per CPU "
                             "(default: lab/results/muon.jsonl lab/results/muon-xeon-amx.jsonl)")
    parser.add_argument("--recipe", default="lab/results/recipe.jsonl",
                        help="runs of the recipe work: opt5 with the flags tried, scored on held-out training images "
                             "(--validation) or the test set, and ablation.py's rows at its length, for --tables "
                             "(default: lab/results/recipe.jsonl)")
    parser.add_argument("--screen", default="lab/results/screen.jsonl",
                        help="ablation.py's bundle rows on held-out training images (--validation), for --tables "
                             "(default: lab/results/screen.jsonl)")
    parser.add_argument("--ablation", default="lab/results/ablation.jsonl",
                        help="ablation.py's rows from before the recipe (AdamW, 5 epochs of batch 128), for --tables "
                             "(default: lab/results/ablation.jsonl)")
    parser.add_argument("--out", default="lab/results/chain.png",
                        help="the GPU figure to write (default: lab/results/chain.png)")
    parser.add_argument("--cpu-out", default="lab/results/cpu.png",
                        help="the CPU figure to write (default: lab/results/cpu.png)")
    parser.add_argument("--tables", action="store_true", help="print markdown tables instead of drawing (default: off)")
    parser.add_argument("--step-table", metavar="PATH",
                        help="print the median ms a step at each batch and image size in PATH's rows (a GPU's, to fit "
                             "accounting.H200_MEASURED_STEPS to), and a fit, instead of drawing (default: off)")
    return parser.parse_args()


def gpu_runs(paths):
    """{name: [report]} of the newest real-data GPU run of each name in `paths`, in the chain's order. A name is the
    script and the flags it was given beyond the data, device, JSON and `--epochs 5`, and "warm cache" where the
    file's name says its compiler cache was. `paths` go newest first: a name a file has is not taken from a later one;
    within a file the latest row (by its date) of a name is taken.
    A run's commit is its folder's (lab/results/h200-38c59a9/: 38c59a9), the code the folder's runs measured: a row may name
    an older one (h200-410ebec/'s name none; h200-38c59a9/'s say ffd0304 and ffd0304+changes: its README says why)."""
    runs = {}
    for path in paths:
        commit, newest = Path(path).parent.name.rpartition("-")[2], {}
        for run in read_lines(path):
            if run.get("data") != "cifar10" or run.get("device", "").split(":")[0] != "cuda":
                continue
            shown = re.sub(rf"(^| )--epochs {DEFAULT_EPOCHS}\b", "",
                           flags(run, dropped=("--data-dir", "--json", "--device"))).strip()
            name = " ".join([run["script"], *([] if shown in ("(defaults)", "") else [shown])]) + \
                (", warm cache" if "warm" in Path(path).name else "")
            if name not in runs and run.get("date", "") >= newest.get(name, {}).get("date", ""):
                newest[name] = {**run, "commit": commit}
        runs.update(newest)
    if not runs:
        common.fail(f"no real-CIFAR-10 GPU run in {' '.join(map(str, paths))}")
    chain_order = sorted(runs, key=lambda name: CHAIN_ORDER.get(runs[name]["script"], len(CHAIN_ORDER)))
    return {name: [runs[name]] for name in chain_order}


def commits(runs):
    """{commit: [its scripts, shortened: "opt4"]} of `runs` (gpu_runs'), in the order of their first run."""
    scripts = {}
    for script_runs in runs.values():
        for run in script_runs:
            names = scripts.setdefault(run["commit"], [])
            if run["script"].removesuffix(".py") not in names:
                names.append(run["script"].removesuffix(".py"))
    return scripts


def gpu_words(runs):
    """The GPU, its host and software, and the code the runs measured: "NVIDIA H200, 16 threads of an Intel Xeon
    (AMX-BF16), torch 2.11.0+cu130, commit 410ebec"; where they differ, each commit with its scripts:
    "commits 4faed98 (opt2, opt3), 38c59a9 (baseline, opt1)"."""
    every = [run for script_runs in runs.values() for run in script_runs]
    torches = ", ".join(dict.fromkeys(run["torch"] for run in every))
    by_commit = commits(runs)
    code = f"commit {next(iter(by_commit))}" if len(by_commit) == 1 else \
        "commits " + ", ".join(f"{commit} ({', '.join(names)})" for commit, names in by_commit.items())
    # a run's threads are its own torch's (opt2 keeps 1 beside its loader workers): the host has the most of them
    return f"{every[0]['device_name']}, {max(run['threads'] for run in every)} threads of an {every[0]['cpu']}, " \
        f"torch {torches}, {code}"


def gpu_table(runs):
    """benchmark.chain_table of `runs` (gpu_runs') with each row's commit in a last column."""
    lines = benchmark.chain_table(runs).splitlines()
    return "\n".join([lines[0] + " commit |", lines[1] + "---|",
                      *(f"{line} {script_runs[0]['commit']} |" for line, script_runs in zip(lines[2:], runs.values()))])


# The call that writes a run's report: a script changed in it alone trains as it did
REPORT_CALL = re.compile(r"common\.report\(|^\s+extra=\{")


def as_today(lines):
    """A script's lines at an older commit, a module of the project since dissolved into common.py read as common:
    its import dropped, its functions called as common's (the training is the same)."""
    imported = re.findall(r"^import (\w+)$", "\n".join(lines), flags=re.MULTILINE)
    gone = {name for name in imported if importlib.util.find_spec(name) is None}
    if not gone:
        return lines
    dissolved = re.compile(rf"\b({'|'.join(gone)})\.")
    return [dissolved.sub("common.", line) for line in lines if line.removeprefix("import ") not in gone]


def changed_since(commit, names):
    """The scripts whose code today differs from `commit`'s in more than their report call; `names` gives each
    (today's name) its name at that commit, the one its rows ran under (`scripts_then`). None where git, the commit or
    the file then is not at hand (common.py and machine.py not counted: they hold no optimization; as_today reads a
    module since dissolved into common.py as common)."""
    changed, checkout = [], Path(__file__).resolve().parent.parent  # the checkout this file is in
    for script, then in names.items():
        try:  # git show, not git diff: the file may have had another name then
            old = subprocess.run(["git", "show", f"{commit}:{then}"], capture_output=True, text=True, cwd=checkout,
                                 timeout=30)
        except (OSError, subprocess.SubprocessError):
            return None
        if old.returncode != 0:
            return None
        before, now = as_today(old.stdout.splitlines()), (checkout / script).read_text().splitlines()
        matcher = difflib.SequenceMatcher(None, before, now, autojunk=False)
        lines = [line for tag, start, end, new_start, new_end in matcher.get_opcodes() if tag != "equal"
                 for line in before[start:end] + now[new_start:new_end]]
        if any(not REPORT_CALL.search(line) for line in lines):
            changed.append(script)
    return changed


def scripts_then(runs):
    """{today's name: the name it ran under} of the scripts of `runs` (gpu_runs')."""
    return {run["script"]: run["ran_as"] for script_runs in runs.values() for run in script_runs}


def at_defaults(runs):
    """The runs of `runs` (gpu_runs') of the chain's scripts at their defaults: the README's table and figure."""
    return {name: script_runs for name, script_runs in runs.items() if name in CHAIN + CONVERGENCE}


def changed_since_their_rows(runs):
    """{commit: the scripts of `runs` (gpu_runs') measured at it whose code changed since} (changed_since, each
    script against its own run's commit), or None where that is not known for some commit."""
    changed = {}
    for commit in commits(runs):
        at_commit = {name: script_runs for name, script_runs in runs.items() if script_runs[0]["commit"] == commit}
        changed[commit] = changed_since(commit, scripts_then(at_commit))
        if changed[commit] is None:
            return None
    return changed


def draw_gpu(runs, out, words):
    """Two panels: steady images/s of each chain script at its defaults; each one's launch to result in its three
    parts. Each is labelled with its run's commit."""
    import matplotlib
    matplotlib.use("Agg")  # files only, no window
    import matplotlib.pyplot as plt

    runs = at_defaults(runs)
    rows = benchmark.chain_rows(runs)
    commit = {name: script_runs[0]["commit"] for name, script_runs in runs.items()}
    figure, (speed_axis, time_axis) = plt.subplots(1, 2, figsize=(15, 5.6), dpi=100,
                                                    gridspec_kw={"width_ratios": [1, 1.6]})
    chain = rows
    baseline, shown = chain[0]["images_per_second"]["all"], []
    for index, row in enumerate(chain):
        speeds = row["images_per_second"]
        # opt5's epochs change image size: its bar is the speed at its largest steady size
        size, speed = max(speeds.items(), key=lambda item: str(item[0]))
        speed_axis.bar(index, speed, color="tab:blue" if size == "all" else "tab:green")
        shown.append(speed)
        label = f"{speed:,.0f}\n{speed / baseline:.1f}x" if size == "all" else f"{speed:,.0f}\nat {size} px"
        speed_axis.text(index, speed, label, ha="center", va="bottom", fontsize=8)
    speed_axis.set_xticks(range(len(chain)), [f"{row['name'].removesuffix('.py')}\n{commit[row['name']]}"
                                              for row in chain], fontsize=8)
    speed_axis.set(ylabel="training images/s (epochs 2 on)", ylim=(0, 1.2 * max(shown)))
    speed_axis.set_title("Steady training speed (epochs 2 on), each script at its defaults", fontsize=9)

    parts = [("before the first epoch", "before_first_epoch_seconds", "tab:gray"),
             ("first epoch (warm-up; compiling where on)", "first_epoch_seconds", "tab:orange")]
    for index, row in enumerate(rows):
        left = 0.0
        for label, field, color in parts:
            time_axis.barh(index, row[field], left=left, color=color, label=label if index == 0 else None)
            left += row[field]
        rest = row["launch_to_result_seconds"] - left
        time_axis.barh(index, rest, left=left, color="tab:blue",
                       label="the other epochs (opt5: a warm-up at each new size)" if index == 0 else None)
        time_axis.text(row["launch_to_result_seconds"] + 0.5, index, f"{100 * row['test_accuracy']:.2f} %",
                       va="center", fontsize=8)
    time_axis.set_yticks(range(len(rows)), [f"{row['name'].removesuffix('.py')} ({commit[row['name']]})"
                                            for row in rows], fontsize=8)
    time_axis.invert_yaxis()
    time_axis.set(xlabel="seconds from launch to the final test accuracy (5 epochs; opt5's recipe, 20)",
                  xlim=(0, 1.15 * max(row["launch_to_result_seconds"] for row in rows)))
    time_axis.set_title("Where a run's seconds go, and the test accuracy it ends at (JPEG copy of CIFAR-10)",
                        fontsize=9)
    time_axis.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.13), ncol=3)
    for axis in (speed_axis, time_axis):
        axis.grid(alpha=0.3, axis="x" if axis is time_axis else "y")
    changed = changed_since_their_rows(runs)
    changed_names = changed and [f"{name.removesuffix('.py')} ({commit})" for commit, names in changed.items()
                                 for name in names]
    since = "whether the scripts changed since their rows: not known (no git history)" if changed is None else \
        "each script's code is its row's" if not changed_names else \
        f"changed since their rows: {', '.join(changed_names)} (their current code is not measured on a GPU)"
    figure.suptitle(f"fast-cifar: ResNet10 on CIFAR-10 on one GPU: {words}\n{since}", fontsize=10, y=0.995)
    figure.tight_layout()
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(out)


# A row without "chain" (common.CHAIN_NUMBERING) names the scripts as they were before opt3 was split in two
# (lab/README.md): today's opt4 was opt3.py, the recipe opt4.py, DDP opt5.py
BEFORE_THE_SPLIT = {"opt3.py": "opt4.py", "opt4.py": "opt5.py", "opt5.py": "opt6.py"}
# and before e8e4e0a, committed at this time (a row's "date" is its machine's clock), opt4.py was the DDP script
OPT4_WAS_DDP_UNTIL = "2026-11-24T01:46:32"


def todays_name(script, row):
    """`script` ("opt3.py") as `row`, a --json line, names it, by today's name."""
    if row.get("chain", 1) >= 2:
        return script
    if script == "opt4.py" and row.get("date", OPT4_WAS_DDP_UNTIL) < OPT4_WAS_DDP_UNTIL:
        return "opt6.py"
    return BEFORE_THE_SPLIT.get(script, script)


def read_row(row):
    """A --json line with the scripts it names by today's names: its script (the one it ran kept as "ran_as"), and
    the words "optN" in an ablation row's change and a benchmark summary's rows; a script's row without its work
    counted (from chain 2's report on, the scripts count none) gets it from accounting.add_work. The file is never
    rewritten."""
    def today(words):
        return re.sub(r"\bopt\d\b", lambda word: todays_name(f"{word[0]}.py", row).removesuffix(".py"), words)

    row = dict(row)
    if "script" in row:
        row.update(script=todays_name(row["script"], row), ran_as=row["script"])
    if "change" in row:
        row["change"] = today(row["change"])
    if "rows" in row:
        row["rows"] = [{**summary_row, "name": today(summary_row["name"])} for summary_row in row["rows"]]
    if "epochs" in row and "settings" in row and "training_flops" not in row:
        row = accounting.add_work(row)
    if "modelled_h200_seconds" in row:
        row.update(modelled_today(row))
    return row


def modelled_today(row):
    """A row's epochs and its modelled H200 seconds by today's model (accounting.modelled_h200_step_seconds), whichever
    model wrote it: rows of every date compare on one rule."""
    muon = row["settings"].get("optimizer") == "muon"  # rows from before --optimizer ran AdamW
    epochs = [dict(record, modelled_h200_seconds=record["steps"] * accounting.modelled_h200_step_seconds(
        record["images"] / record["steps"], record.get("image_size") or 32, muon)) for record in row["epochs"]]
    return {"epochs": epochs, "modelled_h200_seconds": sum(record["modelled_h200_seconds"] for record in epochs)}


def read_lines(path):
    """Every JSON line of `path`, read through read_row, but warm_clock.py's ("clock": "warm": seconds on another
    clock than launch to result); exit 2 with one line if it is missing or not JSON lines."""
    try:
        rows = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
        return [read_row(row) for row in rows if row.get("clock") != "warm"]
    except (OSError, json.JSONDecodeError) as error:
        common.fail(f"cannot read {path} ({type(error).__name__}: {error}); make it with the scripts' --json")


def latest_run_per_script(lines):
    """The last real-CIFAR-10 report of each chain script, in chain order."""
    runs = {line["script"]: line for line in lines if line.get("data") == "cifar10" and line.get("script") in CHAIN}
    if not runs:
        common.fail(f"no real-CIFAR-10 run of {', '.join(CHAIN)} in --runs")
    return [runs[script] for script in CHAIN if script in runs]


def convergence_runs(lines):
    """Every real-CIFAR-10 run of opt4 and opt5 that records its launch-to-result time, in file order."""
    runs = [line for line in lines if line.get("data") == "cifar10" and line.get("script") in CONVERGENCE
            and line.get("launch_to_result_seconds") is not None]
    if not runs:
        common.fail("no real-CIFAR-10 run of opt4.py or opt5.py with launch_to_result_seconds in --convergence")
    return runs


def flags(run, dropped=("--data-dir", "--json")):
    """The run's command-line flags, less the `dropped` ones and their values (by default where the data and the JSON
    went)."""
    words, shown_words = shlex.split(run["command"])[2:], []
    while words:
        word = words.pop(0)
        if word in dropped:
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


def markdown_tables(runs, ladder, convergence, curve, seeds, ablation, muon=()):
    """Accuracy per epoch of each script's run, each ladder rung's steady speed, the convergence runs, the
    curves with what they and the other seeds say, and the ablation."""
    epochs = max(len(run["epochs"]) for run in runs)
    lines = ["| script | " + " | ".join(f"epoch {epoch}" for epoch in range(1, epochs + 1))
             + " | training minutes | steady images/s |", "|---" * (epochs + 3) + "|"]
    for run in runs:
        accuracies = [f"{100 * record['test_accuracy']:.1f}" for record in run["epochs"]]
        minutes = sum(record["train_seconds"] for record in run["epochs"]) / 60
        lines.append(f"| `{run['script']}` | " + " | ".join(accuracies) + f" | {minutes:.1f} "
                     f"| {run['steady_images_per_second']:.0f} |")
    lines += ["", "| ladder step | images/s | ms/step | warm-up s | peak memory GiB | TFLOP/s | % of bf16 peak |",
              "|---|---|---|---|---|---|---|"]
    for row in ladder["rows"]:
        lines.append(f"| {row['name']} | {row['images_per_second']:.0f} | {row['ms_per_step']:.1f} "
                     f"| {row['warmup_seconds']:.1f} | {accounting.shown(row['peak_memory_gib'], '.2f')} "
                     f"| {row['tflops']:.3f} | {accounting.shown(row['percent_of_bf16_peak'], '.0f')} |")
    opt4_minutes = [run["launch_to_result_seconds"] / 60 for run in convergence if run["script"] == "opt4.py"]
    lines += ["", *timed_runs_table(convergence, statistics.mean(opt4_minutes) if opt4_minutes else None)]
    lines += ["", *timed_runs_table(curve, opt4_default_minutes(curve)), "", *curve_summary(curve),
              *seeds_summary(curve, seeds)]
    lines += ["", *ablation_table(ablation), "", extra_views_summary(ablation, curve)]
    for runs_on_one_cpu in muon:
        lines += ["", f"{cpu_words(runs_on_one_cpu[0])}, Muon with {muon_steps(runs_on_one_cpu)} Newton-Schulz "
                      "steps:", "", *timed_runs_table(runs_on_one_cpu, opt4_default_minutes(runs_on_one_cpu)), "",
                  *optimizer_summary(runs_on_one_cpu)]
    return "\n".join(lines)


def ablation_rows(lines):
    """The last real-CIFAR-10 line of each ablation.py row, in the order the rows first appear."""
    rows = {line["row"]: line for line in lines if line.get("data") == "cifar10" and "row" in line}
    if "shipped" not in rows:
        common.fail("no real-CIFAR-10 `shipped` row in --ablation; make it with python lab/ablation.py")
    return list(rows.values())


def ablation_table(rows):
    """Markdown lines: each row's change, its accuracy three ways, its time and its monitor after each epoch."""
    shipped = next(row for row in rows if row["row"] == "shipped")
    lines = ["| row | change | test acc % (2 views, opt5's) | vs shipped | 1 view | 6 views | launch to result min "
             "| 6 views: + s | test acc % after each epoch but the last (images) |", "|---" * 9 + "|"]
    for row in rows:
        monitor = ", ".join(f"{100 * record['test_accuracy']:.1f}" for record in row["epochs"][:-1])
        lines.append(f"| {row['row']} | {row['change']} | {100 * row['2_views']:.2f} "
                     f"| {100 * (row['2_views'] - shipped['2_views']):+.2f} | {100 * row['1_view']:.2f} "
                     f"| {100 * row['6_views']:.2f} | {row['launch_to_result_seconds'] / 60:.1f} "
                     f"| {row['extra_view_seconds']:.0f} | {monitor} ({row['epochs'][0].get('test_images')}) |")
    return lines


def extra_views_summary(rows, curve):
    """One sentence: what flip + translate views buy opt5 as shipped, against the same seconds spent training
    (read off opt5's curve from its default --epochs)."""
    shipped = next(row for row in rows if row["row"] == "shipped")
    gain, seconds = 100 * (shipped["6_views"] - shipped["2_views"]), shipped["extra_view_seconds"]
    opt5 = curve_points(curve, "opt5.py")
    start = next((point for point in opt5 if point[2] == DEFAULT_EPOCHS), None)
    trained = start and interpolate(opt5, start[0] + seconds / 60)
    training = "not measured (opt5's curve does not reach that far)" if trained is None else \
        f"{trained - start[1]:+.1f} points (interpolated on opt5's curve from `--epochs {DEFAULT_EPOCHS}`)"
    return (f"- Flip + translate test-time views (6 per image instead of opt5's 2) add {gain:+.1f} points to opt5 as "
            f"shipped for {seconds:.0f} s; the same seconds spent training: {training}.")


def timed_runs_table(runs, reference_minutes):
    """Markdown lines: each run's flags, image sizes, final accuracy and launch-to-result minutes, also as a share
    of `reference_minutes` (opt4's)."""
    lines = ["| script | flags | image sizes per epoch | test acc % | launch to result min | of opt4's |",
             "|---|---|---|---|---|---|"]
    for run in runs:
        sizes = ", ".join(str(record.get("image_size", 32)) for record in run["epochs"])
        minutes = run["launch_to_result_seconds"] / 60
        share = accounting.shown(reference_minutes and minutes / reference_minutes, ".0%")
        lines.append(f"| `{run['script']}` | `{flags(run)}` | {sizes} | {100 * run['final_test_accuracy']:.1f} "
                     f"| {minutes:.1f} | {share} |")
    return lines


def size_runs(run):
    """The run's image sizes, each with its number of epochs: "16 x7, 24 x7, 32 x6"."""
    sizes = [record.get("image_size") or 32 for record in run["epochs"]]
    counts = {size: sizes.count(size) for size in sizes}
    return ", ".join(f"{size} x{count}" for size, count in counts.items())


def recipe_table(runs):
    """Markdown lines: each run of the recipe work with its flags, sizes, steps, FLOPs and modelled H200 seconds
    (accounting.count_work), what it was scored on and how long it took on its CPU."""
    lines = ["| flags | image sizes x epochs | steps | training PFLOP | modelled H200 s | scored on | acc % "
             "| launch to result min (CPU) |", "|---|---|---|---|---|---|---|---|"]
    for run in runs:
        held_out = run["settings"].get("validation")
        scored_on = f"validation ({held_out:,})" if held_out else f"test ({run['epochs'][-1]['test_images']:,})"
        lines.append(f"| `{flags(run)}` | {size_runs(run)} | {sum(record['steps'] for record in run['epochs'])} "
                     f"| {run['training_flops'] / 1e15:.2f} | {run['modelled_h200_seconds']:.2f} | {scored_on} "
                     f"| {100 * run['final_test_accuracy']:.2f} | {run['launch_to_result_seconds'] / 60:.1f} |")
    return lines


# opt5's defaults since the recipe work; a test checks opt5.py's parser gives them
RECIPE = {"epochs": 20, "batch_size": 512, "lr": 0.016, "optimizer": "muon", "ns_steps": 3, "min_size": 16,
          "full_size_share": 0.3, "label_smoothing": 0.1, "accum_steps": 1, "train_size": None}
# opt5's flags younger than some rows, with what those rows ran: 20 epochs split 7, 7, 6 by size, one batch; and
# --min-size-batch, which some rows ran (a batch of its own at the smallest size) and opt5 no longer has: a row that
# set it is not the recipe
ADDED_LATER = {"full_size_share": 0.3, "min_size_batch": None}
RECIPE_AS_A_ROW_SAYS = {**RECIPE, "min_size_batch": None}


def setting(run, name):
    """A run's setting `name`, or what opt5 ran before the flag existed; None where neither says."""
    return run["settings"].get(name, ADDED_LATER.get(name))


def on_the_test_set(run):
    """Whether the run trained on every real training image and scored its final weights on the whole test set."""
    # rows from before `test_images` have only their --test-size
    scored = run["epochs"][-1].get("test_images", run["settings"].get("test_size") or common.CIFAR10_TEST_SIZE)
    return (run.get("data") == "cifar10" and run["settings"].get("train_size") is None
            and not run["settings"].get("validation") and scored == common.CIFAR10_TEST_SIZE)


def last_per_seed(runs):
    """The last of `runs` with each seed, by seed."""
    return sorted({run["settings"]["seed"]: run for run in runs}.values(), key=lambda run: run["settings"]["seed"])


def recipe_runs(runs, epochs=RECIPE["epochs"]):
    """opt5's runs of its defaults (RECIPE, but for `epochs`) on the whole test set, the last of each seed: opt5.py's
    own and ablation.py's `shipped` rows, not its other rows (their change is not always in the settings)."""
    wanted = {**RECIPE_AS_A_ROW_SAYS, "epochs": epochs}
    return last_per_seed(run for run in runs if run["script"] == "opt5.py" and on_the_test_set(run)
                         and run.get("row", "shipped") == "shipped"
                         and all(setting(run, name) == value for name, value in wanted.items()))


def recipe_summary(runs):
    """One line: what opt5's defaults scored on the whole test set, the mean over its seeds and each seed's, and its
    modelled H200 seconds; [] before any such run."""
    finals = recipe_runs(runs)
    if not finals:
        return []
    accuracies = [100 * run["final_test_accuracy"] for run in finals]
    each = ", ".join(f"{accuracy:.2f}" for accuracy in accuracies)
    seeds = ", ".join(str(run["settings"]["seed"]) for run in finals)
    return [f"opt5's defaults (the recipe) on the test set: **{statistics.mean(accuracies):.2f} %**, the mean of "
            f"{len(finals)} seed{'s' * (len(finals) > 1)} ({seeds}: {each}), in "
            f"{statistics.mean(run['modelled_h200_seconds'] for run in finals):.2f} modelled H200 seconds"]


def curve_row(name, runs):
    """One markdown line of the recipe's curve: `runs` (one setting, its seeds), their accuracies' mean and each, their
    work (the same for each seed) and their mean launch-to-result minutes."""
    accuracies = [100 * run["final_test_accuracy"] for run in runs]
    minutes = statistics.mean(run["launch_to_result_seconds"] for run in runs) / 60
    return (f"| {name} | {size_runs(runs[0])} | {', '.join(str(run['settings']['seed']) for run in runs)} "
            f"| {statistics.mean(accuracies):.2f} ({', '.join(f'{accuracy:.2f}' for accuracy in accuracies)}) "
            f"| {sum(record['steps'] for record in runs[0]['epochs'])} | {runs[0]['training_flops'] / 1e15:.2f} "
            f"| {runs[0]['modelled_h200_seconds']:.2f} | {minutes:.1f} |")


def recipe_curve(recipe, others):
    """Markdown lines: the recipe at each length it ran on the whole test set (its other settings opt5's defaults) on
    the CPU of its default runs, after the reference point, opt4 `--epochs 5` on that CPU (from `others`, its work
    counted as opt5 counts its own); [] before any run of the defaults."""
    finals = recipe_runs(recipe)
    if not finals:
        return []
    cpu = finals[0]["cpu"]
    on_its_cpu = [run for run in recipe if run["cpu"] == cpu]
    opt4 = last_per_seed(dict(run, epochs=[dict(record) for record in run["epochs"]]) for run in others
                         if run["script"] == "opt4.py" and run["cpu"] == cpu and on_the_test_set(run)
                         and len(run["epochs"]) == DEFAULT_EPOCHS)
    for run in opt4:
        run.update(accounting.count_work(run["epochs"], 0, muon=False))  # on the copies: AdamW's update counts no matmul
    lines = ["| run | image sizes x epochs | seeds | test acc %, mean (each) | steps | training PFLOP "
             "| modelled H200 s | launch to result min (CPU) |", "|---" * 8 + "|"]
    if opt4:
        lines.append(curve_row(f"opt4 `--epochs {DEFAULT_EPOCHS}` (reference)", opt4))
    for epochs in sorted({run["settings"].get("epochs") for run in on_its_cpu} - {None}):
        runs = recipe_runs(on_its_cpu, epochs)
        if runs:
            lines.append(curve_row(f"opt5 `--epochs {epochs}`" + " (default)" * (epochs == RECIPE["epochs"]), runs))
    return lines


def row_is_at_the_recipes_length(row):
    """Whether an ablation.py row ran on the whole test set with opt5's defaults but for its own flags' settings."""
    _, row_flags, _, _ = ablation.ROWS[ablation.ROW_NAMES.index(row["row"])]
    own = {flag[2:].replace("-", "_") for flag in row_flags if flag.startswith("--")}
    return row["script"] == "opt5.py" and on_the_test_set(row) and all(
        setting(row, name) == value for name, value in RECIPE_AS_A_ROW_SAYS.items() if name not in own)


def recipe_ablation(recipe):
    """Markdown lines: ablation.py's rows at the recipe's length, each against the mean of the recipe's test-set
    seeds (opt5's 2 views), and what 1 and 6 views score; [] before any such row."""
    rows = [run for run in recipe if "row" in run and row_is_at_the_recipes_length(run)]
    finals = recipe_runs(recipe)
    if not rows or not finals:
        return []
    shipped = statistics.mean(run["final_test_accuracy"] for run in finals)
    lines = ["| row | change | seed | test acc % (2 views, opt5's) | vs the recipe's mean | 1 view | 6 views "
             "| modelled H200 s | launch to result min (CPU) |", "|---" * 9 + "|"]
    for row in rows:
        lines.append(f"| {row['row']} | {row['change']} | {row['settings']['seed']} | {100 * row['2_views']:.2f} "
                     f"| {100 * (row['2_views'] - shipped):+.2f} | {100 * row['1_view']:.2f} "
                     f"| {100 * row['6_views']:.2f} | {row['modelled_h200_seconds']:.2f} "
                     f"| {row['launch_to_result_seconds'] / 60:.1f} |")
    return lines


def step_table(rows):
    """[(images a step, side, ms)]: the median ms a step of each batch and image size in `rows`, over the epochs that
    are not the first at their size in their run (those include the warm-up, the capture or the compiling)."""
    times = {}
    for row in rows:
        seen = set()
        for record in row["epochs"]:
            point = (round(record["images"] / record["steps"]), record.get("image_size") or 32)
            if point in seen:
                times.setdefault(point, []).append(record["ms_per_step"])
            seen.add(point)
    return [(images, side, statistics.median(times[images, side])) for images, side in sorted(times)]


def step_table_lines(rows):
    """Markdown lines: the step table of `rows` (step_table), each point against the fit over them all."""
    table = step_table(rows)
    if len(table) < 2:
        return [f"{len(table)} batch and size points with a steady epoch: a fit needs 2"]
    fixed, per_pixel = accounting.h200_step_fit(tuple(table))
    lines = [f"Fit: {1000 * fixed:.3f} ms + {1e9 * per_pixel:.2f} ns per image x pixel a step", "",
             "| images a step | px | median ms | fitted ms | residual ms |", "|---|---|---|---|---|"]
    for images, side, ms in table:
        fitted = 1000 * (fixed + per_pixel * images * side ** 2)
        lines.append(f"| {images} | {side} | {ms:.3f} | {fitted:.3f} | {ms - fitted:+.3f} |")
    return lines


def modelled_with_6_views(row):
    """An ablation.py row's modelled H200 seconds with its 4 extra views' (ablation.py's model of them), by today's
    models, whichever wrote the row."""
    scored, batch_size = row["epochs"][-1]["test_images"], row["settings"]["batch_size"]
    return row["modelled_h200_seconds"] + ablation.modelled_h200_extra_view_seconds(scored, batch_size)


def screen_table(lines):
    """Markdown lines: each ablation.py row scored on held-out training images, over its seeds (the last line of each),
    against the twenty-epochs row's mean; [] before any such row."""
    rows = {}
    for line in lines:
        if "row" in line and line["settings"].get("validation"):
            # the shipped row of the 20-epoch recipe's days is twenty-epochs by another name
            recipe = line["row"] == "shipped" and all(setting(line, name) == value
                                                      for name, value in RECIPE_AS_A_ROW_SAYS.items())
            rows.setdefault("twenty-epochs" if recipe else line["row"], {})[line["settings"]["seed"]] = line
    if not rows:
        return []
    runs = {name: [by_seed[seed] for seed in sorted(by_seed)] for name, by_seed in rows.items()}
    reference = runs.get("twenty-epochs")
    reference_mean = statistics.mean(100 * run["2_views"] for run in reference) if reference else None
    lines = ["| row | seeds | held-out acc % (2 views), mean (each) | vs twenty-epochs | 6 views, mean "
             "| modelled H200 s (2 views / 6) | launch to result min (CPU) |", "|---" * 7 + "|"]
    for name, seeds in runs.items():
        accuracies = [100 * run["2_views"] for run in seeds]
        versus = f"{statistics.mean(accuracies) - reference_mean:+.2f}" if reference_mean is not None else "-"
        lines.append(f"| {name} | {', '.join(str(run['settings']['seed']) for run in seeds)} "
                     f"| {statistics.mean(accuracies):.2f} ({', '.join(f'{accuracy:.2f}' for accuracy in accuracies)}) "
                     f"| {versus} | {statistics.mean(100 * run['6_views'] for run in seeds):.2f} "
                     f"| {statistics.mean(run['modelled_h200_seconds'] for run in seeds):.2f} / "
                     f"{statistics.mean(map(modelled_with_6_views, seeds)):.2f} "
                     f"| {statistics.mean(run['launch_to_result_seconds'] for run in seeds) / 60:.1f} |")
    return lines


def curve_points(runs, script):
    """(launch-to-result minutes, final test accuracy %, epochs) of each run of `script` (or of a `variant`), fastest
    first."""
    return sorted((run["launch_to_result_seconds"] / 60, 100 * run["final_test_accuracy"], len(run["epochs"]))
                  for run in runs if script in (run["script"], variant(run)))


def ns_steps(run):
    """The Newton-Schulz steps of a Muon run: --ns-steps, or 5 for runs from before that flag."""
    return run["settings"].get("ns_steps", 5)


def muon_steps(runs):
    """The Newton-Schulz steps of the Muon runs among `runs`, in words: "3", or "3 and 5"."""
    return " and ".join(map(str, sorted({ns_steps(run) for run in runs if variant(run) == "opt5.py muon"})))


def variant(run):
    """The script, and for opt5 and opt6 the optimizer: "opt5.py muon" (runs from before --optimizer used AdamW)."""
    if run["script"] in ("opt5.py", "opt6.py"):
        return f"{run['script']} {run.get('settings', {}).get('optimizer', 'adamw')}"
    return run["script"]


def optimizer_summary(runs):
    """What the optimizer runs say: Muon against AdamW at equal time, the share of opt4's default run time Muon needs
    to reach its accuracy, and what a step costs at each image size, measured and in FLOPs."""
    curve = [run for run in runs if run["settings"]["seed"] == 0]  # other seeds: their own line below
    muon, adamw = curve_points(curve, "opt5.py muon"), curve_points(curve, "opt5.py adamw")
    opt4 = next((point for point in curve_points(curve, "opt4.py") if point[2] == DEFAULT_EPOCHS), None)
    lines = []
    for minutes, accuracy, epochs in muon:
        at_equal_time = interpolate(adamw, minutes)
        versus = "AdamW's curve does not span that time" if at_equal_time is None else \
            f"AdamW at the same time: {at_equal_time:.1f} % (interpolated): {accuracy - at_equal_time:+.1f} points"
        lines.append(f"- Muon, `--epochs {epochs}`, seed 0: {accuracy:.1f} % in {minutes:.1f} min; {versus}.")
    if opt4 is not None:
        reached = first_reach(muon, opt4[1])
        goal = f"opt4's `--epochs {DEFAULT_EPOCHS}` accuracy ({opt4[1]:.1f} % in {opt4[0]:.1f} min)"
        run = next((f"its `--epochs {epochs}` run" for minutes, _, epochs in muon if minutes == reached),
                   "interpolated")
        lines.append(f"- Muon does not reach {goal} within its runs." if reached is None else
                     f"- Muon reaches {goal} at {reached:.1f} min ({run}): {reached / opt4[0]:.0%} of opt4's time.")
    groups = seed_groups(runs)
    for (label, epochs), group in groups.items():
        listed = ", ".join(f"{accuracy:.2f}" for accuracy in group["accuracies"])
        lines.append(f"- {OPTIMIZER_NAMES[label]} at `--epochs {epochs}`, seeds "
                     f"{', '.join(map(str, group['seeds']))}: {listed} % (mean {group['mean']:.2f}, spread "
                     f"{group['spread']:.2f} points), {group['minutes']:.1f} min on average.")
    rivals = [(key, rival) for key, rival in groups.items() if key[0] == "opt5.py adamw"]
    for (label, epochs), group in groups.items():
        if label == "opt5.py muon" and rivals:
            (_, rival_epochs), rival = min(rivals, key=lambda item: abs(item[1]["minutes"] - group["minutes"]))
            lines.append(f"- Muon at `--epochs {epochs}` against AdamW at `--epochs {rival_epochs}`, the nearest in "
                         f"time, seed means: {group['mean'] - rival['mean']:+.2f} points in "
                         f"{group['minutes'] / rival['minutes']:.0%} of AdamW's time.")
    return lines + step_costs(runs)


def seed_groups(runs):
    """{(variant, epochs): the seeds, their accuracies %, mean, spread and mean minutes} of each opt5 optimizer's runs
    at an --epochs measured with more than one seed."""
    groups = {}
    for run in runs:
        if variant(run) in ("opt5.py muon", "opt5.py adamw"):
            groups.setdefault((variant(run), len(run["epochs"])), {})[run["settings"]["seed"]] = run
    summaries = {}
    for key, by_seed in sorted(groups.items(), key=lambda item: (item[0][0] != "opt5.py muon", item[0][1])):
        if len(by_seed) > 1:
            accuracies = [100 * by_seed[seed]["final_test_accuracy"] for seed in sorted(by_seed)]
            summaries[key] = {"seeds": sorted(by_seed), "accuracies": accuracies, "mean": statistics.mean(accuracies),
                              "spread": max(accuracies) - min(accuracies),
                              "minutes": statistics.mean(run["launch_to_result_seconds"] / 60
                                                         for run in by_seed.values())}
    return summaries


def step_costs(runs):
    """ms per training step at each image size with each optimizer, and the FLOPs of a step and of Muon's update.

    The fastest epoch at that size over the optimizer's runs, leaving out each run's first epoch at a size (it
    includes compiling) where another epoch at that size exists.
    """
    epochs = {"muon": {}, "adamw": {}}
    for run in runs:
        if run["script"] == "opt5.py":
            seen = set()
            for record in run["epochs"]:
                size = record["image_size"]
                epochs[variant(run).split()[1]].setdefault(size, []).append((size in seen, record["ms_per_step"]))
                seen.add(size)
    if not all(epochs.values()):
        return []
    costs = {optimizer: {size: min(ms for later, ms in records if later or not any(later for later, _ in records))
                         for size, records in sizes.items()} for optimizer, sizes in epochs.items()}
    sizes = sorted(costs["muon"].keys() & costs["adamw"].keys())
    compiling = {size for size in sizes if not all(any(later for later, _ in epochs[name][size]) for name in epochs)}
    batch = 128
    training = {size: accounting.training_flops_per_image() * batch * (size / 32) ** 2 / 1e9 for size in sizes}
    measured = "; ".join(f"{size}x{size}: {costs['adamw'][size]:.0f} and {costs['muon'][size]:.0f} ms "
                         f"(Muon's update {1 - costs['adamw'][size] / costs['muon'][size]:.0%} of its step"
                         f"{'; an epoch that includes compiling' if size in compiling else ''})" for size in sizes)
    flops = ", ".join(f"{training[size]:.0f} at {size}x{size}" for size in sizes)
    steps = ns_steps(next(run for run in runs if variant(run) == "opt5.py muon"))
    return [f"- ms per step with AdamW and with Muon, batch {batch}: {measured}.",
            f"- Muon's update with {steps} Newton-Schulz steps: {accounting.muon_update_flops(steps) / 1e9:.1f} GFLOP per step "
            f"(its matmuls, one filter at a time as today's opt5 takes them, counted by torch), "
            f"against the training step's {flops} GFLOP (forward and backward, "
            f"batch {batch})."]


def opt4_default_minutes(runs):
    """Launch-to-result minutes of opt4 at its default --epochs, or None if the curve has no such run."""
    return next((minutes for minutes, _, epochs in curve_points(runs, "opt4.py") if epochs == DEFAULT_EPOCHS), None)


def interpolate(points, x):
    """y at x on the polyline through `points` ((x, y, ...) sorted by x), or None outside it."""
    for (x0, y0, *_), (x1, y1, *_) in zip(points, points[1:]):
        if x0 <= x <= x1:
            return y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    return None


def first_reach(points, y):
    """The first x at which the polyline through `points` ((x, y, ...) sorted by x) reaches y, or None."""
    if points and points[0][1] >= y:
        return points[0][0]
    for (x0, y0, *_), (x1, y1, *_) in zip(points, points[1:]):
        if y0 < y <= y1:
            return x0 + (x1 - x0) * (y - y0) / (y1 - y0)
    return None


def curve_summary(runs):
    """Two sentences read off the curves: how far opt5 at its default --epochs is above opt4 trained for the same
    time, and what share of opt4's default run time opt5 needs to reach that run's accuracy."""
    opt4, opt5 = curve_points(runs, "opt4.py"), curve_points(runs, "opt5.py")
    opt5_default = next((point for point in opt5 if point[2] == DEFAULT_EPOCHS), None)
    opt4_default = next((point for point in opt4 if point[2] == DEFAULT_EPOCHS), None)
    if opt5_default is None or opt4_default is None:
        return [f"Curve summary: not measured (it needs opt4 and opt5 at --epochs {DEFAULT_EPOCHS})."]
    minutes, accuracy, _ = opt5_default
    at_equal_time = interpolate(opt4, minutes)
    if at_equal_time is None:
        ahead = f"opt4's curve ({opt4[0][0]:.1f}-{opt4[-1][0]:.1f} min) does not span that time"
    else:
        ahead = (f"opt4 trained for the same time: {at_equal_time:.1f} % (interpolated), so opt5 is "
                 f"{accuracy - at_equal_time:+.1f} points ahead")
    lines = [f"- At `--epochs {DEFAULT_EPOCHS}` (its default before the recipe), opt5 reaches {accuracy:.1f} % in "
             f"{minutes:.1f} min; {ahead}."]
    target_minutes, target, _ = opt4_default
    goal = f"opt4's `--epochs {DEFAULT_EPOCHS}` accuracy ({target:.1f} % in {target_minutes:.1f} min)"
    reached = first_reach(opt5, target)
    if reached is None:
        lines.append(f"- opt5 does not reach {goal} within its runs (up to `--epochs {max(p[2] for p in opt5)}`).")
    else:
        lines.append(f"- opt5 reaches {goal} at {reached:.1f} min (interpolated): {reached / target_minutes:.0%} of "
                     "opt4's time.")
    return lines


def seeds_summary(curve, seeds):
    """Two sentences: each script's accuracy at its default --epochs per seed, with mean and spread; and where
    opt5's seed-0 curve reaches opt4's mean."""
    means, parts = {}, []
    for script in CONVERGENCE:
        accuracies = {run["settings"]["seed"]: 100 * run["final_test_accuracy"] for run in curve + seeds
                      if run["script"] == script and len(run["epochs"]) == DEFAULT_EPOCHS}
        means[script] = statistics.mean(accuracies.values())
        listed = ", ".join(f"{accuracies[seed]:.2f}" for seed in sorted(accuracies))
        parts.append(f"{script[:-3]} {listed} % (seeds {', '.join(map(str, sorted(accuracies)))}: mean "
                     f"{means[script]:.2f}, spread {max(accuracies.values()) - min(accuracies.values()):.2f} points)")
    lines = [f"- At `--epochs {DEFAULT_EPOCHS}`: " + "; ".join(parts) + "."]
    target, opt4_minutes = means["opt4.py"], opt4_default_minutes(curve)
    reached = first_reach(curve_points(curve, "opt5.py"), target)
    if reached is None or opt4_minutes is None:
        lines.append(f"- opt5's seed-0 curve does not reach opt4's mean ({target:.2f} %) within its runs.")
    else:
        lines.append(f"- opt5's seed-0 curve reaches opt4's mean ({target:.2f} %) at {reached:.1f} min (interpolated): "
                     f"{reached / opt4_minutes:.0%} of opt4's seed-0 time.")
    return lines


def draw(runs, ladder, muon, out):
    import matplotlib
    matplotlib.use("Agg")  # files only, no window
    import matplotlib.pyplot as plt

    figure, (accuracy_axis, speed_axis, time_axis) = plt.subplots(1, 3, figsize=(15, 5.2), dpi=100)
    for run in runs:
        epochs = [record["epoch"] for record in run["epochs"]]
        accuracy = [100 * record["test_accuracy"] for record in run["epochs"]]
        accuracy_axis.plot(epochs, accuracy, marker="o", label=run["script"])
    accuracy_axis.set_title(f"Test accuracy after each epoch\n{cpu_words(runs[0])}", fontsize=9)
    accuracy_axis.set(xlabel="epoch", ylabel="test accuracy %")
    accuracy_axis.set_xticks(range(1, max(len(run["epochs"]) for run in runs) + 1))
    colors = {"opt4.py": "tab:gray", "opt5.py adamw": "tab:orange", "opt5.py muon": "tab:green"}
    for runs_on_one_cpu, line_style in zip(muon, ["--", "-", ":"]):
        opt4_minutes = opt4_default_minutes(runs_on_one_cpu)
        for label in colors:
            points = {}  # --epochs: [(share of opt4's time, accuracy %)] of each seed
            for run in runs_on_one_cpu:
                if variant(run) == label:
                    points.setdefault(len(run["epochs"]), []).append(
                        (run["launch_to_result_seconds"] / 60 / opt4_minutes, 100 * run["final_test_accuracy"]))
            if not points:
                continue
            every_run = [point for seeds in points.values() for point in seeds]
            time_axis.scatter(*zip(*every_run), s=10, color=colors[label], alpha=0.4)
            means = [(epochs, *map(statistics.mean, zip(*points[epochs]))) for epochs in sorted(points)]
            name = label.replace(".py", "") + (f", {muon_steps(runs_on_one_cpu)} NS steps" if label == "opt5.py muon"
                                                else "")
            time_axis.plot([share for _, share, _ in means], [accuracy for _, _, accuracy in means], line_style,
                           marker="o", color=colors[label],
                           label=f"{name}: {cpu_words(runs_on_one_cpu[0], short=True)}")
            for epochs, share, accuracy in means:
                time_axis.annotate(f"{epochs}", (share, accuracy), textcoords="offset points", xytext=(4, -10),
                                   fontsize=7)
    time_axis.set_title("Final test accuracy against time from launch, on CPUs\nlines: mean over seeds, dots: each "
                        "run, labels: --epochs", fontsize=9)
    time_axis.set(xlabel="launch to result, as a share of opt4 --epochs 5's (same CPU)", ylabel="test accuracy %")
    for axis in (accuracy_axis, time_axis):
        axis.grid(alpha=0.3)
    accuracy_axis.legend(fontsize=8)
    time_axis.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=2)

    rows = ladder["rows"]
    speeds = [row["images_per_second"] for row in rows]
    speed_axis.bar(range(len(rows)), speeds, color="tab:blue")
    for index, speed in enumerate(speeds):
        speed_axis.text(index, speed, f"{speed:.0f}", ha="center", va="bottom", fontsize=7)
    speed_axis.set_xticks(range(len(rows)), [row["name"] for row in rows], rotation=35, ha="right", fontsize=8)
    speed_axis.set_title(f"Training images/s, each script with one more group of optimizations\n"
                         f"{cpu_words({'cpu': ladder['machine'], 'threads': ladder['threads']})}, batch 128",
                         fontsize=9)
    speed_axis.set(ylabel="images/s", ylim=(0, 1.15 * max(speeds)))
    figure.suptitle(f"fast-cifar: ResNet10 on CIFAR-10, measured on 2-core CPUs (no GPU measured), torch "
                    f"{runs[0]['torch'].split('+')[0]}", fontsize=10, y=0.995)
    figure.tight_layout()
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(out)


def cpu_words(run, short=False):
    """The CPU a run was measured on, as the reader should read it: "AMD EPYC with AVX-512 BF16, 2 threads (CPU)",
    or short: "AMD EPYC, AVX-512 BF16"."""
    name, _, unit = run["cpu"].partition(" (")
    unit = unit.rstrip(")")
    if short:
        return f"{name}, {unit}"
    return f"{name} with {unit}, {run['threads']} threads (CPU)" if unit != "no bf16 unit" else \
        f"{name} without a bfloat16 unit, {run['threads']} threads (CPU)"


def main():
    args = parse_args()
    runs = latest_run_per_script(read_lines(args.runs))
    ladder = latest_ladder(read_lines(args.ladder))
    convergence = convergence_runs(read_lines(args.convergence))
    curve = convergence_runs(read_lines(args.curve))
    muon = [convergence_runs(read_lines(path)) for path in args.muon]  # one list of runs per CPU
    gpu = gpu_runs(args.gpu)
    if args.step_table:
        print("\n".join(step_table_lines(read_lines(args.step_table))))
        return
    if args.tables:
        seeds = convergence_runs(read_lines(args.seeds))
        print(f"{gpu_words(gpu)}:\n\n{gpu_table(gpu)}\n")
        recipe = read_lines(args.recipe)
        others = curve + seeds + [run for runs_on_one_cpu in muon for run in runs_on_one_cpu]
        curve_lines, ablation_lines = recipe_curve(recipe, others), recipe_ablation(recipe)
        screen_lines = screen_table(read_lines(args.screen)) if Path(args.screen).exists() else []
        print("\n".join(["Recipe runs:", "", *recipe_table(recipe), "", *recipe_summary(recipe), "",
                         *(["The screen, on held-out training images:", "", *screen_lines, ""] if screen_lines else []),
                         *(["The recipe's curve:", "", *curve_lines, ""] if curve_lines else []),
                         *(["The recipe's ablation:", "", *ablation_lines, ""] if ablation_lines else [])]))
        print(markdown_tables(runs, ladder, convergence, curve, seeds, ablation_rows(read_lines(args.ablation)), muon))
        return
    try:
        import matplotlib  # noqa: F401  (imported here so a missing install is one clear line)
    except ImportError:
        common.fail("plot.py needs matplotlib: pip install matplotlib==3.11.2 (or pip install -r requirements-dev.txt)")
    draw_gpu(gpu, args.out, gpu_words(at_defaults(gpu)))
    draw(runs, ladder, muon, args.cpu_out)
    print(f"wrote {args.out} and {args.cpu_out}")


if __name__ == "__main__":
    main()
