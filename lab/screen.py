"""screen.py: one device call screens the recipe's next seconds: ablation.py's rows in two stages under one deadline,
then the rules below decide, by themselves, what is kept.

    python lab/screen.py run --device cuda --data-dir ./data --json lab/results/screen-gpu.jsonl   # one GPU call, ~8 min
    python lab/screen.py decide lab/results/screen-gpu.jsonl                                  # the rules, again, later

Where the recipe's seconds go on an H200 (opt5's defaults: 20 epochs of batch 512, 7/7/6 at 16/24/32 px, Muon):
~15 s from launch, of which 3.3 s before the first step, ~4 s in the first epoch at each image size above its steady
epochs (cuDNN autotuning new shapes, the capture's warm-up), 7.3 s of steady steps and the rest evaluations and
exit. Each run is cut into those phases from its own --json line (phases()):
- before the first step: setup_seconds;
- first-epoch excess: at each image size, what its first epoch took above its steps at that size's steady rate (the
  median seconds a step of its other epochs: with equal steps, the first epoch minus their median), summed over sizes;
- steady steps: every step at its size's steady rate (the steady epochs, and each first epoch counted at that rate);
- evaluations and the rest: launch to result minus setup and all epochs' training;
- launch to result, and the accuracy (final_test_accuracy, opt5's own 2-view score), in %.
The phases add up to launch to result. A size with a single epoch has no steady rate: such a run is not decided.

The stages. Stage 1 scores on 5,000 held-out training images (--validation 5000), seed 0: the recipe (row `shipped`)
twice (seeds 0 and 1; "the recipe" below is the mean of these two), each time row once, each bundle once. Stage 2 runs
on the test set: the best two bundles of stage 1 at seeds 0-4 each (stage 1's seed 0 was
scored on held-out images, and adoption needs 5 test-set seeds, so seed 0 runs again on the test set: 10 runs, ~26 in
all). Stage 2 runs the best finalist's seeds first: where the deadline cuts it, the second finalist's go. A row's stage
is in its own settings: validation > 0 is stage 1, 0 (the test set) stage 2. Where a row, seed and stage ran more than
once, the last run counts.

The rules (each a function below; the thresholds are the constants under RULES):
1. A time row (TIME_ROWS: changes meant to cut seconds, not work) is kept where its first-epoch excess falls by
   >= 0.5 s against the recipe's, its steady seconds rise by <= 3 %, and its held-out accuracy is >= the recipe's
   - 0.4 points.
2. A bundle (BUNDLE_ROWS: changes of the work) goes to stage 2 where its held-out accuracy is >= the recipe's - 0.5
   points; the best two such by accuracy, ties to the fewer steady seconds.
3. A bundle is adopted where the mean of its 5 test-set seeds is >= the recipe's test-set mean - 0.1 point, at
   <= 0.7x the recipe's steady seconds. The recipe's test-set mean is RECIPE_TEST_MEAN (90.39 %, five GPU runs at
   4faed98) while the recipe's training is unchanged since; otherwise give --recipe-changed: stage 2 then also runs
   the recipe at the 5 test-set seeds and the bundles are compared with that mean. The steady seconds are compared
   within a stage (the test set trains on 50,000 images, stage 1 on 45,000): stage 2's where both have runs there,
   else stage 1's.
A rule with too few runs (the recipe's 2 held-out runs, a row's run, a bundle's 5 test-set seeds) says "not decided"
and why, rather than guess.

On a GPU, in one call: `python lab/screen.py run --device cuda --data-dir ./data --json lab/results/screen-gpu.jsonl`.
Each run is one `lab/ablation.py --row NAME --seed S [--validation 5000] --json OUT` process (the row in that
process: one start of Python and torch a run), most valuable first, and each appends ablation.py's own line to OUT;
flags screen.py does not know go to every run (opt5's: --device, --data-dir, ...). Before each run it checks the run
fits in the time left to --deadline (seconds since screen.py started, default 480: a 10-minute call with room to
spare), by the longest run so far (20 s before the first); when not, it stops and names what it skipped, and a run
still going at the deadline is stopped. It prints a line before each run, the runs' own output, then the phases of
every row and one line per decision: kept, dropped or not decided, with the figures behind it (from this call's rows:
OUT may hold earlier ones). A run that fails is named and the screen goes on without it, then exits 1. Bring OUT
back; `python lab/screen.py decide OUT` prints the decisions from all its rows (with --recipe-mean or
--recipe-changed if the recipe moved on, --time-rows and --bundles if the run named other rows).
"""
import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
from pathlib import Path

import root  # noqa: F401  (first: the repository's root on sys.path, for the scripts and common.py)
import ablation  # noqa: E402
import common  # noqa: E402
from root import LAB  # noqa: E402

ABLATION = LAB / "ablation.py"

# The rows: ablation.py's
RECIPE_ROW = "shipped"
TIME_ROWS, BUNDLE_ROWS = ablation.TIME_ROWS, ablation.BUNDLE_ROWS
RECIPE_SEEDS = [0, 1]  # stage 1: the recipe twice, so the rules compare with a mean, not one draw
ROW_SEED = 0  # stage 1: every other row once
TEST_SEEDS = [0, 1, 2, 3, 4]  # stage 2: each finalist on the test set
VALIDATION = 5000  # stage 1's held-out training images
DEADLINE_SECONDS = 480
FIRST_RUN_ESTIMATE_SECONDS = 20  # a recipe run from launch on an H200 is ~15 s
# The recipe's mean test-set accuracy on an H200, five runs at 4faed98 (90.44, 90.26, 90.26, 90.37, 90.60: the first
# three in lab/results/h200-4faed98/chain.jsonl, the other two printed there, lab/README.md); valid while opt5's
# training is unchanged since, else --recipe-changed
RECIPE_TEST_MEAN = 90.39

# RULES (see the docstring)
EXCESS_FALL_SECONDS = 0.5  # a time row: its first-epoch excess falls by at least this
STEADY_RISE = 0.03  # ... its steady seconds rise by at most this share
TIME_ROW_POINTS = 0.4  # ... its accuracy falls by at most this many points
STAGE_TWO_POINTS = 0.5  # a bundle goes to stage 2 within this many points of the recipe's held-out accuracy
FINALISTS = 2
ADOPTION_POINTS = 0.1  # a bundle is adopted within this many points of the recipe's test-set mean
ADOPTION_STEADY_RATIO = 0.7  # ... at most this share of the recipe's steady seconds
ADOPTION_SEEDS = 5
PHASES = ["setup", "first_epoch_excess", "steady", "evaluations_and_rest", "launch_to_result", "accuracy"]


# ------------------------------------------------------------------------------------ phases

def phases(row):
    """The row's seconds cut into the phases the rules compare (see the docstring), and its accuracy in %. Where an
    image size has a single epoch its steady rate is unknown: first_epoch_excess and steady are None, and
    sizes_without_steady names those sizes."""
    epochs_by_size = {}
    for record in row["epochs"]:
        epochs_by_size.setdefault(record.get("image_size") or 32, []).append(record)
    excess_by_size, steady, without_steady = {}, 0.0, []
    for size, records in epochs_by_size.items():
        first, others = records[0], records[1:]
        if not others:
            without_steady.append(size)
            continue
        seconds_a_step = statistics.median(record["train_seconds"] / record["steps"] for record in others)
        excess_by_size[size] = first["train_seconds"] - first["steps"] * seconds_a_step
        steady += sum(record["train_seconds"] for record in others) + first["steps"] * seconds_a_step
    trained = sum(record["train_seconds"] for record in row["epochs"])
    return {"setup": row["setup_seconds"],
            "first_epoch_excess": None if without_steady else sum(excess_by_size.values()),
            "excess_by_size": excess_by_size,
            "steady": None if without_steady else steady,
            "evaluations_and_rest": row["launch_to_result_seconds"] - row["setup_seconds"] - trained,
            "launch_to_result": row["launch_to_result_seconds"],
            "accuracy": 100 * row["final_test_accuracy"],
            "sizes_without_steady": without_steady}


def mean_phases(rows):
    """Each phase's mean over `rows` (None where any run lacks it), so a rule compares one figure with one."""
    runs = [phases(row) for row in rows]
    means = {name: None if any(run[name] is None for run in runs) else statistics.fmean(run[name] for run in runs)
             for name in PHASES}
    means["sizes_without_steady"] = sorted({size for run in runs for size in run["sizes_without_steady"]})
    means["runs"] = len(runs)
    means["seeds"] = [row["settings"]["seed"] for row in rows]
    return means


def stage(row):
    """1 for a run scored on held-out training images (--validation), 2 for one on the test set."""
    return 1 if row["settings"].get("validation") else 2


def runs_of(rows, name, stage_number):
    """The row's runs in that stage, the last one of each seed (a run again replaces the one before), by seed."""
    last = {row["settings"]["seed"]: row for row in rows if row["row"] == name and stage(row) == stage_number}
    return [last[seed] for seed in sorted(last)]


def phases_line(name, stage_number, runs):
    """One line: a row's mean phases in a stage."""
    where = "held-out" if stage_number == 1 else "test-set"
    means = mean_phases(runs)

    def seconds(phase):
        return "n/a" if means[phase] is None else f"{means[phase]:.2f} s"
    return (f"{name}, {means['runs']} {where} run{'s' if means['runs'] != 1 else ''} (seeds "
            f"{', '.join(map(str, means['seeds']))}): before the first step {seconds('setup')}, first-epoch excess "
            f"{seconds('first_epoch_excess')}, steady steps {seconds('steady')}, evaluations and the rest "
            f"{seconds('evaluations_and_rest')}, launch to result {seconds('launch_to_result')}, "
            f"accuracy {means['accuracy']:.2f} %")


# ------------------------------------------------------------------------------------- rules

def time_rule(row, recipe):
    """Rule 1: (kept, the figures) for a time row's mean phases against the recipe's."""
    excess_change = row["first_epoch_excess"] - recipe["first_epoch_excess"]
    steady_change = row["steady"] / recipe["steady"] - 1
    accuracy_change = row["accuracy"] - recipe["accuracy"]
    kept = excess_change <= -EXCESS_FALL_SECONDS and steady_change <= STEADY_RISE and \
        accuracy_change >= -TIME_ROW_POINTS
    figures = (f"first-epoch excess {recipe['first_epoch_excess']:.1f} s -> {row['first_epoch_excess']:.1f} s "
               f"({excess_change:+.1f}, needs <= -{EXCESS_FALL_SECONDS}), steady {recipe['steady']:.2f} -> "
               f"{row['steady']:.2f} s ({100 * steady_change:+.1f} %, needs <= +{100 * STEADY_RISE:.0f} %), "
               f"accuracy {row['accuracy']:.2f} vs {recipe['accuracy']:.2f} % ({accuracy_change:+.2f}, needs >= "
               f"-{TIME_ROW_POINTS:.2f})")
    return kept, figures


def stage_two_rule(bundle, recipe):
    """Rule 2, its first half: (passes, the figures) for a bundle's held-out run against the recipe's mean."""
    accuracy_change = bundle["accuracy"] - recipe["accuracy"]
    figures = (f"held-out accuracy {bundle['accuracy']:.2f} vs {recipe['accuracy']:.2f} % ({accuracy_change:+.2f}, "
               f"needs >= -{STAGE_TWO_POINTS:.2f}), steady {bundle['steady']:.2f} vs {recipe['steady']:.2f} s "
               f"({bundle['steady'] / recipe['steady']:.2f}x)")
    return accuracy_change >= -STAGE_TWO_POINTS, figures


def best_bundles(passing):
    """Rule 2, its second half: the names of the best FINALISTS of `passing` ({name: mean phases}) by accuracy, ties
    to the fewer steady seconds."""
    ranked = sorted(passing, key=lambda name: (-passing[name]["accuracy"], passing[name]["steady"]))
    return ranked[:FINALISTS]


def adoption_rule(test_accuracy, recipe_accuracy, steady_ratio):
    """Rule 3: (adopted, the figures) for a bundle's test-set mean against the recipe's, and its steady seconds'
    share of the recipe's."""
    accuracy_change = test_accuracy - recipe_accuracy
    adopted = accuracy_change >= -ADOPTION_POINTS and steady_ratio <= ADOPTION_STEADY_RATIO
    figures = (f"test-set accuracy {test_accuracy:.2f} vs {recipe_accuracy:.2f} % ({accuracy_change:+.2f}, needs >= "
               f"-{ADOPTION_POINTS:.2f}), steady {steady_ratio:.2f}x the recipe's (needs <= {ADOPTION_STEADY_RATIO}x)")
    return adopted, figures


def why_undecided(runs, needed, what):
    """Why a rule cannot be applied to `runs` (`what` names them), or None where it can."""
    if len(runs) < needed:
        seeds = f" (seeds {', '.join(str(row['settings']['seed']) for row in runs)})" if runs else ""
        return f"{what}: {len(runs)} run{'s' if len(runs) != 1 else ''}{seeds}, the rule needs {needed}"
    sizes = mean_phases(runs)["sizes_without_steady"]
    if sizes:
        return f"{what}: no steady epoch at {', '.join(f'{size} px' for size in sizes)} (a size needs 2 epochs)"
    return None


def decisions(rows, time_rows, bundles, recipe_mean=RECIPE_TEST_MEAN, recipe_changed=False):
    """Every rule applied to `rows` (ablation.py's lines): (the lines to print, the bundles that go to stage 2)."""
    recipe_runs = runs_of(rows, RECIPE_ROW, 1)
    lines = [phases_line(name, number, runs_of(rows, name, number)) for name in [RECIPE_ROW, *time_rows, *bundles]
             for number in (1, 2) if runs_of(rows, name, number)]
    recipe_problem = why_undecided(recipe_runs, len(RECIPE_SEEDS), f"the recipe ({RECIPE_ROW}) held out")
    recipe = None if recipe_problem else mean_phases(recipe_runs)
    for name in time_rows:
        problem = recipe_problem or why_undecided(runs_of(rows, name, 1), 1, "its held-out runs")
        if problem:
            lines.append(f"time row {name}: not decided: {problem}")
            continue
        kept, figures = time_rule(mean_phases(runs_of(rows, name, 1)), recipe)
        lines.append(f"time row {name}: {'kept' if kept else 'dropped'}: {figures}")
    held_out = {}
    for name in bundles:
        problem = recipe_problem or why_undecided(runs_of(rows, name, 1), 1, "its held-out runs")
        held_out[name] = (None, problem) if problem else stage_two_rule(mean_phases(runs_of(rows, name, 1)), recipe)
    finalists = best_bundles({name: mean_phases(runs_of(rows, name, 1)) for name, (passes, _) in held_out.items()
                              if passes})
    for name, (passes, figures) in held_out.items():
        if passes is None:
            lines.append(f"bundle {name}: not decided for stage 2: {figures}")
        elif name in finalists:
            lines.append(f"bundle {name}: to stage 2 (finalist {finalists.index(name) + 1} of {FINALISTS}): {figures}")
        elif passes:
            lines.append(f"bundle {name}: not to stage 2: {figures}, but {' and '.join(finalists)} did better")
        else:
            lines.append(f"bundle {name}: not to stage 2: {figures}")
    lines += adoption_lines(rows, [name for name in bundles if name in finalists or runs_of(rows, name, 2)],
                            recipe_mean, recipe_changed)
    return lines, finalists


def steady_ratio(rows, name):
    """The bundle's steady seconds over the recipe's, both from stage 2 where both have runs there, else from stage
    1 (a stage trains on its own number of images); (ratio, the stage), or (None, None) where neither has both."""
    for number in (2, 1):
        both = [mean_phases(runs) for runs in (runs_of(rows, name, number), runs_of(rows, RECIPE_ROW, number)) if runs]
        if len(both) == 2 and None not in (both[0]["steady"], both[1]["steady"]):
            return both[0]["steady"] / both[1]["steady"], number
    return None, None


def adoption_lines(rows, bundles, recipe_mean, recipe_changed):
    """Rule 3 for each of `bundles`: a line each."""
    lines = []
    recipe_problem = None
    if recipe_changed:
        recipe_problem = why_undecided(runs_of(rows, RECIPE_ROW, 2), ADOPTION_SEEDS,
                                       f"the recipe ({RECIPE_ROW}) on the test set (--recipe-changed)")
        recipe_mean = None if recipe_problem else mean_phases(runs_of(rows, RECIPE_ROW, 2))["accuracy"]
    for name in bundles:
        test_runs = runs_of(rows, name, 2)
        ratio, ratio_stage = steady_ratio(rows, name)
        problem = recipe_problem or why_undecided(test_runs, ADOPTION_SEEDS, "its test-set runs") or \
            (None if ratio else "no steady seconds of it and the recipe in one stage")
        if problem:
            lines.append(f"bundle {name}: not decided for adoption: {problem}")
            continue
        adopted, figures = adoption_rule(mean_phases(test_runs)["accuracy"], recipe_mean, ratio)
        source = "the recipe's test-set runs" if recipe_changed else f"--recipe-mean {recipe_mean:.2f}"
        lines.append(f"bundle {name}: {'adopted' if adopted else 'not adopted'}: {figures}; over seeds "
                     f"{', '.join(str(row['settings']['seed']) for row in test_runs)} against {source}, steady "
                     f"seconds from stage {ratio_stage}")
    return lines


# ------------------------------------------------------------------------------------ reading

def read_rows(path, after=0):
    """ablation.py's lines in `path` after its first `after` lines; a missing file or a line that is not one ends with
    one error line."""
    try:
        text = Path(path).read_text()
    except OSError as error:
        common.fail(f"cannot read {path} ({error.strerror}); give ablation.py's --json file")
    rows = []
    for number, line in enumerate(text.splitlines()[after:], after + 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as error:
            common.fail(f"line {number} of {path} is not JSON ({error.msg})")
        if not isinstance(row, dict) or "row" not in row or "epochs" not in row:
            common.fail(f"line {number} of {path} is not an ablation.py row (it has no \"row\" or \"epochs\")")
        rows.append(row)
    return rows


def other_rows_line(rows, time_rows, bundles):
    """A line naming the rows no rule reads (neither the recipe, a time row nor a bundle), or None."""
    named = {RECIPE_ROW, *time_rows, *bundles}
    others = sorted({row["row"] for row in rows} - named)
    return f"not read by any rule (neither --time-rows nor --bundles): {', '.join(others)}" if others else None


def print_decisions(rows, args):
    """Print the phases and every decision for `rows`."""
    lines, _ = decisions(rows, args.time_rows, args.bundles, args.recipe_mean, args.recipe_changed)
    others = other_rows_line(rows, args.time_rows, args.bundles)
    print("\n".join([*lines, *([others] if others else [])]), flush=True)


# ----------------------------------------------------------------------------------- the runs

def run_plan(names_and_seeds, validation):
    """The runs of a stage: (row, seed, --validation: stage 1's held-out images, 0 for the test set)."""
    return [(name, seed, validation) for name, seed in names_and_seeds]


def stage_one(args):
    """Stage 1, most valuable first: the recipe twice (the rules' baseline), the time rows, the bundles."""
    return run_plan([*[(RECIPE_ROW, seed) for seed in RECIPE_SEEDS], *[(name, ROW_SEED) for name in args.time_rows],
                     *[(name, ROW_SEED) for name in args.bundles]], args.validation)


def stage_two(args, finalists):
    """Stage 2: the finalists at each test-set seed, the best one's first; with --recipe-changed the recipe's seeds
    alongside the best one's, as no bundle is decided without them."""
    runs = []
    for seed in args.test_seeds if finalists else []:
        runs += [(RECIPE_ROW, seed)] * args.recipe_changed + [(finalists[0], seed)]
    runs += [(name, seed) for name in finalists[1:] for seed in args.test_seeds]
    return run_plan(runs, 0)


def run_command(name, seed, validation, args, opt5_flags):
    """The one ablation.py process of a run: the row in that process (--row), not in a child of it, so a run starts
    Python and imports torch once."""
    held_out = ["--validation", str(validation)] if validation else []
    return [sys.executable, str(ABLATION), "--row", name, "--seed", str(seed), *held_out, "--json", args.json,
            *opt5_flags]


def run_one(command, seconds_left):
    """Run `command` in a process group of its own, stopped (the group: ablation.py's row process too) once
    `seconds_left` have passed or where this process is interrupted; returns its exit code, or None where the deadline
    stopped it. It runs in this process's folder, so relative paths in the flags mean what they mean here."""
    process = subprocess.Popen(command, start_new_session=True)  # a group of its own: stopped whole, row included
    try:
        return process.wait(timeout=max(seconds_left, 0))
    except subprocess.TimeoutExpired:
        return None
    finally:
        if process.poll() is None:  # the deadline, or Ctrl-C (which a new session's processes do not get)
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


def run_stage(runs, args, opt5_flags, longest):
    """Run `runs` one after another while the next fits before the deadline; returns (the longest run's seconds,
    whether the deadline stopped the stage, the runs that failed)."""
    failed = []
    for number, (name, seed, validation) in enumerate(runs, 1):
        elapsed = common.seconds_since_launch()
        estimate = longest or FIRST_RUN_ESTIMATE_SECONDS
        if elapsed + estimate > args.deadline:
            skipped = ", ".join(f"{name} seed {seed}" for name, seed, _ in runs[number - 1:])
            print(f"\nscreen: deadline: {args.deadline - elapsed:.0f} s left of {args.deadline:.0f}, a run takes up to "
                  f"{estimate:.0f} s: skipped {skipped}", flush=True)
            return longest, True, failed
        where = f"--validation {validation}" if validation else "the test set"
        print(f"\n== screen: {name} seed {seed} on {where} ({number}/{len(runs)} of the stage) at {elapsed:.0f} s, "
              f"{args.deadline - elapsed:.0f} s left", flush=True)
        code = run_one(run_command(name, seed, validation, args, opt5_flags), args.deadline - elapsed)
        longest = max(longest or 0, common.seconds_since_launch() - elapsed)
        if code is None:
            skipped = ", ".join(f"{name} seed {seed}" for name, seed, _ in runs[number:])
            print(f"\nscreen: deadline: {name} seed {seed} stopped at {args.deadline:.0f} s, no line written; skipped "
                  f"{skipped or 'nothing else'}", flush=True)
            return longest, True, failed
        if code != 0:
            print(f"screen: {name} seed {seed} failed (exit code {code}); the screen goes on without it", flush=True)
            failed.append(f"{name} seed {seed}")
    return longest, False, failed


def screen(args, opt5_flags):
    """`run`: stage 1, the rules on its rows, stage 2, all the rules; exit 1 where a run failed."""
    lines_before = len(Path(args.json).read_text().splitlines())
    first = stage_one(args)
    print(f"screen: stage 1: {len(first)} runs on {args.validation} held-out images, then stage 2: the best "
          f"{FINALISTS} bundles at seeds {', '.join(map(str, args.test_seeds))} on the test set; deadline "
          f"{args.deadline:.0f} s; rows to {args.json}", flush=True)
    longest, stopped, failed = run_stage(first, args, opt5_flags, None)
    if stopped:
        print("screen: stage 2 not run: the deadline cut stage 1", flush=True)
    else:
        print("\n== screen: stage 1 decided", flush=True)
        _, finalists = decisions(read_rows(args.json, after=lines_before), args.time_rows, args.bundles)
        second = stage_two(args, finalists)
        print(f"screen: stage 2: {', '.join(finalists) or 'no bundle passed'}"
              f"{' and the recipe' if args.recipe_changed else ''}: {len(second)} runs", flush=True)
        _, stopped, failed_later = run_stage(second, args, opt5_flags, longest)
        failed += failed_later
    print(f"\n== screen: the decisions, from this call's rows in {args.json} "
          f"({'cut by the deadline' if stopped else 'complete'})", flush=True)
    print_decisions(read_rows(args.json, after=lines_before), args)
    if failed:
        print(f"screen: failed: {', '.join(failed)}; their output is above", flush=True)
        sys.exit(1)


# ------------------------------------------------------------------------------- command line

def add_rule_flags(parser):
    """The flags both commands take: the rows and the recipe's test-set mean."""
    parser.add_argument("--time-rows", nargs="*", default=TIME_ROWS, metavar="ROW",
                        help=f"ablation.py's time rows (default: {' '.join(TIME_ROWS)})")
    parser.add_argument("--bundles", nargs="*", default=BUNDLE_ROWS, metavar="ROW",
                        help=f"ablation.py's bundle rows (default: {' '.join(BUNDLE_ROWS)})")
    parser.add_argument("--recipe-mean", type=common.positive_float, default=RECIPE_TEST_MEAN, metavar="PERCENT",
                        help=f"the recipe's test-set mean the bundles are adopted against (default: "
                             f"{RECIPE_TEST_MEAN}, five H200 runs at 4faed98)")
    parser.add_argument("--recipe-changed", action="store_true",
                        help="the recipe's training changed since --recipe-mean was measured: stage 2 also runs the "
                             "recipe at the test-set seeds, and the bundles are compared with their mean "
                             "(default: off)")


def parse_args():
    """The command and its flags; for `run`, the rest are opt5.py's flags, which opt5's parser checks here."""
    parser = common.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                   allow_abbrev=False)
    commands = parser.add_subparsers(dest="command", required=True, metavar="{run,decide}")
    run = commands.add_parser("run", allow_abbrev=False, help="run the screen (flags it does not know go to opt5.py)",
                              description="run the screen; flags not listed here go to opt5.py in every run")
    run.add_argument("--json", metavar="PATH", required=True, help="append ablation.py's line of every run here")
    run.add_argument("--deadline", type=common.positive_float, default=DEADLINE_SECONDS, metavar="SECONDS",
                     help=f"start no run that would end later than this many seconds after launch "
                          f"(default: {DEADLINE_SECONDS})")
    run.add_argument("--validation", type=common.positive_int, default=VALIDATION, metavar="N",
                     help=f"stage 1's held-out training images (default: {VALIDATION})")
    run.add_argument("--test-seeds", nargs="+", type=int, default=TEST_SEEDS, metavar="SEED",
                     help=f"stage 2's seeds on the test set; adoption needs {ADOPTION_SEEDS} "
                          f"(default: {' '.join(map(str, TEST_SEEDS))})")
    add_rule_flags(run)
    decide = commands.add_parser("decide", allow_abbrev=False, help="apply the rules to a screen's rows",
                                 description="apply the rules to a screen's rows and print the decisions")
    decide.add_argument("rows", metavar="ROWS.jsonl", help="ablation.py's lines, as `run` wrote them")
    add_rule_flags(decide)
    args, extra = parser.parse_known_args()
    if args.command == "decide":
        if extra:
            common.fail(f"unrecognized arguments: {' '.join(extra)} (see --help)")
        return args, []
    return args, check_run(args, extra)


def check_run(args, opt5_flags):
    """`run`'s checks before any run: the rows exist, the flags left are opt5's and leave the seeds to the screen,
    and --json can be appended to; returns opt5's flags."""
    named = [RECIPE_ROW, *args.time_rows, *args.bundles]
    unknown = [name for name in named if name not in ablation.ROW_NAMES]
    if unknown:
        common.fail(f"ablation.py has no row {', '.join(unknown)}; its rows: {' '.join(ablation.ROW_NAMES)} (name "
                    f"them with --time-rows and --bundles)")
    if len(set(named)) < len(named):
        common.fail(f"a row is named twice among the recipe ({RECIPE_ROW}), --time-rows and --bundles")
    taken = [flag for flag in opt5_flags if flag.split("=")[0] in ("--seed", "--seeds", "--rows", "--row")]
    if taken:
        common.fail(f"{taken[0]}: the screen sets the rows and seeds of every run (see --help)")
    ablation.check_opt5_flags_and_json([*opt5_flags, "--validation", str(args.validation)], args.json)
    return opt5_flags


def main():
    args, opt5_flags = parse_args()
    if args.command == "decide":
        print_decisions(read_rows(args.rows), args)
    else:
        screen(args, opt5_flags)


if __name__ == "__main__":
    main()
