"""Tests for screen.py: its phases and rules on made-up rows, its commands on the CPU.

    python -m pytest -q test_screen.py
"""
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

import root  # noqa: F401  (first: the repository's root on sys.path, for the scripts and common.py)
import common  # noqa: E402
import screen  # noqa: E402
# The CPU's tiny runs: AdamW, as Muon's update takes seconds a step on a small CPU; 3 steps an epoch, 2 epochs at 32 px
TINY = ["--synthetic", "--device", "cpu", "--epochs", "2", "--min-size", "32", "--train-size", "48", "--batch-size",
        "16", "--test-size", "16", "--monitor-size", "16", "--optimizer", "adamw"]


def made_up_row(name, seed=0, validation=5000, accuracy=90.0, excess=3.0, steady=7.3):
    """An ablation.py line of a run with these figures: 3 epochs at 16 px and 3 at 32 (10 steps each), half the
    steady seconds and half the excess at each size, 3.3 s before the first step and 0.5 s of evaluations."""
    epochs = []
    for size in (16, 32):
        for epoch in range(3):
            seconds = steady / 6 + (excess / 2 if epoch == 0 else 0.0)
            epochs.append({"epoch": len(epochs) + 1, "image_size": size, "train_seconds": seconds, "steps": 10,
                           "images": 5120, "ms_per_step": 100 * seconds, "test_accuracy": accuracy / 100})
    return {"script": "opt5.py", "row": name, "settings": {"seed": seed, "validation": validation},
            "setup_seconds": 3.3, "launch_to_result_seconds": 3.3 + excess + steady + 0.5,
            "final_test_accuracy": accuracy / 100, "epochs": epochs}


def recipe_rows(accuracy=(90.4, 90.6), excess=3.0, steady=7.3):
    """The recipe's two held-out runs (seeds 0 and 1)."""
    return [made_up_row("shipped", seed, accuracy=value, excess=excess, steady=steady)
            for seed, value in enumerate(accuracy)]


def test_phases_cut_a_run_into_setup_first_epoch_excess_steady_steps_and_the_rest():
    epochs = [(16, 2.0, 10), (16, 1.0, 10), (16, 1.1, 10), (16, 1.6, 10),  # the steady median 1.1 s (mean 1.23)
              (32, 4.0, 5), (32, 2.0, 5)]
    row = {"setup_seconds": 3.0, "launch_to_result_seconds": 20.0, "final_test_accuracy": 0.9012,
           "epochs": [{"image_size": size, "train_seconds": seconds, "steps": steps}
                      for size, seconds, steps in epochs]}
    phases = screen.phases(row)
    assert phases["excess_by_size"] == pytest.approx({16: 2.0 - 1.1, 32: 4.0 - 2.0})
    assert phases["first_epoch_excess"] == pytest.approx(2.9)
    assert phases["steady"] == pytest.approx((1.0 + 1.1 + 1.6 + 1.1) + (2.0 + 2.0)), "each first epoch at its rate"
    assert phases["evaluations_and_rest"] == pytest.approx(20.0 - 3.0 - 11.7)
    assert phases["accuracy"] == pytest.approx(90.12) and phases["sizes_without_steady"] == []
    assert phases["setup"] + phases["first_epoch_excess"] + phases["steady"] + phases["evaluations_and_rest"] == \
        pytest.approx(phases["launch_to_result"]), "the phases add up to launch to result"
    made_up = screen.phases(made_up_row("shipped", excess=3.0, steady=7.3))
    assert (made_up["first_epoch_excess"], made_up["steady"]) == pytest.approx((3.0, 7.3))


def test_phases_of_a_size_with_one_epoch_are_not_measured():
    row = made_up_row("shipped")
    row["epochs"] = row["epochs"][:4]  # 3 epochs at 16 px, 1 at 32
    phases = screen.phases(row)
    assert phases["first_epoch_excess"] is None and phases["steady"] is None and phases["sizes_without_steady"] == [32]
    lines, _ = screen.decisions([row, made_up_row("shipped", seed=1), made_up_row("one-warmup-step")],
                                ["one-warmup-step"], [])
    assert "time row one-warmup-step: not decided: the recipe (shipped) held out: no steady epoch at 32 px" in lines[-1]


@pytest.mark.parametrize("excess, steady, accuracy, kept", [
    (2.4, 7.3, 90.5, True),  # 0.6 s less excess, same steady seconds and accuracy
    (2.6, 7.3, 90.5, False),  # 0.4 s less: not enough
    (2.0, 7.6, 90.5, False),  # steady seconds +4.1 %
    (2.0, 7.5, 90.5, True),  # +2.7 %
    (2.0, 7.3, 90.0, False),  # 0.5 points less accurate
    (2.0, 7.3, 90.2, True),  # 0.3 points less
])
def test_time_rule_keeps_a_row_that_cuts_the_first_epochs_at_the_same_steps_and_accuracy(excess, steady, accuracy,
                                                                                          kept):
    recipe = screen.mean_phases(recipe_rows())
    row = screen.mean_phases([made_up_row("one-warmup-step", accuracy=accuracy, excess=excess, steady=steady)])
    assert screen.time_rule(row, recipe)[0] is kept
    lines, _ = screen.decisions([*recipe_rows(), made_up_row("one-warmup-step", accuracy=accuracy, excess=excess,
                                                             steady=steady)], ["one-warmup-step"], [])
    assert lines[-1].startswith(f"time row one-warmup-step: {'kept' if kept else 'dropped'}: first-epoch excess 3.0 s")


def test_time_rule_line_shows_the_figures_behind_it():
    recipe = screen.mean_phases(recipe_rows())
    row = screen.mean_phases([made_up_row("one-warmup-step", accuracy=90.45, excess=2.3, steady=7.32)])
    assert screen.time_rule(row, recipe) == (True, "first-epoch excess 3.0 s -> 2.3 s (-0.7, needs <= -0.5), steady "
                                                   "7.30 -> 7.32 s (+0.3 %, needs <= +3 %), accuracy 90.45 vs 90.50 % "
                                                   "(-0.05, needs >= -0.40)")


def test_stage_two_takes_the_best_two_bundles_within_half_a_point_ties_to_fewer_steady_seconds():
    bundles = {"bundle-1": (90.1, 5.0), "bundle-2": (89.9, 4.0), "bundle-3": (90.3, 5.5), "bundle-4": (90.3, 5.1),
               "bundle-5": (89.95, 3.0)}  # the recipe: 90.5 %, so 90.0 % passes
    rows = recipe_rows() + [made_up_row(name, accuracy=accuracy, steady=steady)
                            for name, (accuracy, steady) in bundles.items()]
    recipe = screen.mean_phases(recipe_rows())
    assert [screen.stage_two_rule(screen.mean_phases(screen.runs_of(rows, name, 1)), recipe)[0]
            for name in bundles] == [True, False, True, True, False]
    lines, finalists = screen.decisions(rows, [], list(bundles))
    assert finalists == ["bundle-4", "bundle-3"], "equal accuracy: the fewer steady seconds first"
    said = {line.split(":")[0]: line for line in lines if line.startswith("bundle ") and "adoption" not in line}
    assert said["bundle bundle-4"].startswith("bundle bundle-4: to stage 2 (finalist 1 of 2): held-out accuracy "
                                              "90.30 vs 90.50 % (-0.20, needs >= -0.50), steady 5.10 vs 7.30 s (0.70x)")
    assert said["bundle bundle-1"].endswith("but bundle-4 and bundle-3 did better")
    assert said["bundle bundle-2"].startswith("bundle bundle-2: not to stage 2: held-out accuracy 89.90 vs 90.50 % "
                                              "(-0.60, needs >= -0.50)")
    assert lines[-2:] == [f"bundle {name}: not decided for adoption: its test-set runs: 0 runs, the rule needs 5"
                          for name in ("bundle-3", "bundle-4")], "the finalists, in the bundles' order"


def stage_two_rows(name, accuracies, steady=5.0):
    """A bundle's test-set runs, seeds 0 on."""
    return [made_up_row(name, seed, validation=0, accuracy=accuracy, steady=steady)
            for seed, accuracy in enumerate(accuracies)]


@pytest.mark.parametrize("accuracies, steady, says", [
    ([90.3, 90.4, 90.2, 90.35, 90.25], 5.0, "adopted: test-set accuracy 90.30 vs 90.39 % (-0.09, needs >= -0.10), "
                                            "steady 0.68x the recipe's (needs <= 0.7x); over seeds 0, 1, 2, 3, 4 "
                                            "against --recipe-mean 90.39, steady seconds from stage 1"),
    ([90.2, 90.3, 90.2, 90.3, 90.2], 5.0, "not adopted: test-set accuracy 90.24 vs 90.39 % (-0.15"),
    ([90.5] * 5, 5.2, "not adopted: test-set accuracy 90.50 vs 90.39 % (+0.11, needs >= -0.10), steady 0.71x"),
    ([90.5] * 4, 5.0, "not decided for adoption: its test-set runs: 4 runs (seeds 0, 1, 2, 3), the rule needs 5"),
])
def test_adoption_needs_five_test_set_seeds_near_the_recipes_mean_at_under_70_percent_of_its_steps(accuracies, steady,
                                                                                                      says):
    # the bundle's held-out run at 5.0 s, the recipe's at 7.3 s: 0.68x in stage 1, where only both have runs
    rows = [*recipe_rows(), made_up_row("bundle-1", steady=steady), *stage_two_rows("bundle-1", accuracies, steady)]
    lines, _ = screen.decisions(rows, [], ["bundle-1"])
    assert lines[-1].startswith(f"bundle bundle-1: {says}"), lines[-1]


def test_adoption_compares_steady_seconds_in_stage_two_and_the_recipes_own_seeds_once_it_changed():
    # on the test set (more images) the recipe's steps take 8.0 s, the bundle's 5.8 s: 0.725x, where stage 1 says 0.68x
    rows = [*recipe_rows(), made_up_row("bundle-1", steady=5.0), *stage_two_rows("bundle-1", [90.0] * 5, steady=5.8),
            *stage_two_rows("shipped", [90.0, 90.1, 89.9, 90.0, 90.0], steady=8.0)]
    lines, _ = screen.decisions(rows, [], ["bundle-1"], recipe_changed=True)
    assert lines[-1] == ("bundle bundle-1: not adopted: test-set accuracy 90.00 vs 90.00 % (+0.00, needs >= -0.10), "
                         "steady 0.72x the recipe's (needs <= 0.7x); over seeds 0, 1, 2, 3, 4 against the recipe's "
                         "test-set runs, steady seconds from stage 2")
    lines, _ = screen.decisions(rows[:-1], [], ["bundle-1"], recipe_changed=True)
    assert lines[-1] == ("bundle bundle-1: not decided for adoption: the recipe (shipped) on the test set "
                         "(--recipe-changed): 4 runs (seeds 0, 1, 2, 3), the rule needs 5")


def test_rows_with_too_few_runs_are_not_decided():
    rows = [recipe_rows()[0], made_up_row("one-warmup-step"), made_up_row("bundle-1")]
    lines, finalists = screen.decisions(rows, ["one-warmup-step", "muon-other-form"], ["bundle-1"])
    assert finalists == []
    assert "time row one-warmup-step: not decided: the recipe (shipped) held out: 1 run (seeds 0), the rule needs 2" \
        in lines
    lines, _ = screen.decisions(recipe_rows() + rows[1:], ["one-warmup-step", "muon-other-form"], ["bundle-1"])
    assert "time row muon-other-form: not decided: its held-out runs: 0 runs, the rule needs 1" in lines


def test_a_run_again_replaces_the_one_before_at_its_seed_and_stage():
    rows = [made_up_row("shipped", accuracy=80.0), *recipe_rows(), made_up_row("shipped", validation=0, accuracy=70.0)]
    assert [row["final_test_accuracy"] for row in screen.runs_of(rows, "shipped", 1)] == pytest.approx([0.904, 0.906])
    assert screen.mean_phases(screen.runs_of(rows, "shipped", 1))["accuracy"] == pytest.approx(90.5)


# ------------------------------------------------------------------------------------ the commands

LAUNCH_CLOCK = common.seconds_since_launch


def run_screen_here(monkeypatch, capfd, *args):
    """screen.py's main() in this process with `args` (a fresh process costs seconds of imports); returns (its exit
    code, its output and its runs', its error output)."""
    monkeypatch.setattr(sys, "argv", ["screen.py", *map(str, args)])
    if common.seconds_since_launch is LAUNCH_CLOCK:  # no clock of the test's own: the deadline counts from this call,
        started = time.perf_counter()              # as from screen.py's start, not from the test session's
        monkeypatch.setattr(common, "seconds_since_launch", lambda: time.perf_counter() - started)
    try:
        screen.main()
        code = 0
    except SystemExit as exit:
        code = exit.code
    output = capfd.readouterr()
    return code, output.out, output.err


def test_no_function_takes_more_than_six_parameters():
    functions = [value for value in vars(screen).values()
                 if callable(value) and getattr(value, "__module__", None) == "screen"]
    assert {function.__name__: function.__code__.co_argcount for function in functions
            if function.__code__.co_argcount > 6} == {}


def test_decide_prints_the_phases_and_a_line_per_decision(tmp_path, monkeypatch, capfd):
    rows = [*recipe_rows(), made_up_row("one-warmup-step", accuracy=90.5, excess=2.0),
            made_up_row("bundle-1", accuracy=90.2), made_up_row("zero-init")]
    path = tmp_path / "screen.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    code, output, errors = run_screen_here(monkeypatch, capfd, "decide", path, "--time-rows", "one-warmup-step",
                                           "--bundles", "bundle-1")
    assert code == 0, errors
    lines = output.splitlines()
    assert lines[0].startswith("shipped, 2 held-out runs (seeds 0, 1): before the first step 3.30 s, first-epoch "
                               "excess 3.00 s, steady steps 7.30 s, evaluations and the rest 0.50 s, launch to result "
                               "14.10 s, accuracy 90.50 %")
    assert lines[3].startswith("time row one-warmup-step: kept: first-epoch excess 3.0 s -> 2.0 s (-1.0")
    assert lines[4].startswith("bundle bundle-1: to stage 2 (finalist 1 of 2)")
    assert lines[5] == "bundle bundle-1: not decided for adoption: its test-set runs: 0 runs, the rule needs 5"
    assert lines[6] == "not read by any rule (neither --time-rows nor --bundles): zero-init"


@pytest.mark.parametrize("args, says", [
    (["decide", "{tmp}/missing.jsonl"], "cannot read"),
    (["decide", "{tmp}/bad.jsonl"], "line 2 of"),
    (["run", "--json", "{tmp}/out.jsonl", "--bundles", "no-such-row"], "ablation.py has no row"),
    (["run", "--json", "{tmp}/out.jsonl", "--time-rows", "--bundles", "zero-init", "--seed", "1"],
     "--seed: the screen"),
    (["run", "--json", "{tmp}/out.jsonl", "--time-rows", "--bundles", "--epochs", "0"], "--epochs: must be a positive"),
])
def test_bad_input_ends_with_one_error_line_and_exit_code_2(args, says, tmp_path, monkeypatch, capfd):
    (tmp_path / "bad.jsonl").write_text(json.dumps(made_up_row("shipped")) + "\nnot json\n")
    code, output, errors = run_screen_here(monkeypatch, capfd, *[arg.replace("{tmp}", str(tmp_path)) for arg in args])
    assert code == 2 and output == "", output
    assert errors.count("\n") == 1 and errors.startswith("error: ") and says in errors, errors
    assert not (tmp_path / "out.jsonl").exists() or (tmp_path / "out.jsonl").read_text() == ""


# A stand-in for ablation.py: appends the line made up for its row, seed and --validation (in its .json), after the
# seconds asked there, and the flags it was given
STAND_IN = """
import json, sys, time
flags = sys.argv[1:]
def value(flag, default=None):
    return flags[flags.index(flag) + 1] if flag in flags else default
made_up = json.load(open(sys.argv[0] + ".json"))
key = f"{value('--row')} {value('--seed')} {value('--validation', '0')}"
time.sleep(made_up["sleep"].get(key, 0))
with open(value("--json"), "a") as file:
    file.write(json.dumps({**made_up["lines"][key], "flags": flags}) + "\\n")
"""


def stand_in_ablation(folder, lines, sleep=None):
    """Write the stand-in for ablation.py to `folder`, with its lines ({"row seed validation": line}); its path."""
    path = folder / "ablation_stand_in.py"
    path.write_text(STAND_IN)
    Path(f"{path}.json").write_text(json.dumps({"lines": lines, "sleep": sleep or {}}))
    return path


def screen_lines(bundles, validation=5000):
    """Every line a screen of the recipe, one time row and `bundles` ({name: held-out accuracy}) may write, the test
    set's at 90.4 % for the bundles and 90.0 % for the recipe."""
    rows = [*recipe_rows(), made_up_row("full-eval", accuracy=90.5, excess=2.0),
            *[made_up_row(name, accuracy=accuracy, steady=5.0) for name, accuracy in bundles.items()]]
    rows += [row for name in bundles for row in stage_two_rows(name, [90.4] * 5)]
    rows += stage_two_rows("shipped", [90.0] * 5, steady=7.3)
    for row in rows:
        row["settings"]["validation"] = row["settings"]["validation"] and validation
    return {f"{row['row']} {row['settings']['seed']} {row['settings']['validation']}": row for row in rows}


def test_run_screens_stage_one_then_the_best_two_bundles_on_the_test_set_and_decides(tmp_path, monkeypatch, capfd):
    bundles = {"zero-init": 90.3, "smoothing-0": 89.5, "ema": 90.2}
    monkeypatch.setattr(screen, "ABLATION", stand_in_ablation(tmp_path, screen_lines(bundles)))
    out = tmp_path / "screen.jsonl"
    out.write_text(json.dumps(made_up_row("zero-init", seed=7, accuracy=10.0)) + "\n")  # an earlier call's row
    code, output, _ = run_screen_here(monkeypatch, capfd, "run", "--json", out, "--time-rows", "full-eval", "--bundles",
                                   *bundles, "--device", "cpu", "--synthetic")
    assert code == 0, output
    rows = [json.loads(line) for line in out.read_text().splitlines()[1:]]
    assert [(row["row"], row["settings"]["seed"], row["settings"]["validation"]) for row in rows] == [
        ("shipped", 0, 5000), ("shipped", 1, 5000), ("full-eval", 0, 5000), ("zero-init", 0, 5000),
        ("smoothing-0", 0, 5000), ("ema", 0, 5000), *[("zero-init", seed, 0) for seed in range(5)],
        *[("ema", seed, 0) for seed in range(5)]]
    assert rows[0]["flags"] == ["--row", "shipped", "--seed", "0", "--validation", "5000", "--json", str(out),
                                "--device", "cpu", "--synthetic"], "opt5's flags go to every run"
    assert "--validation" not in rows[-1]["flags"], "stage 2: the test set"
    decided = output[output.index("== screen: the decisions"):].splitlines()
    assert "time row full-eval: kept" in output and "bundle smoothing-0: not to stage 2" in output
    assert decided[-2].startswith("bundle zero-init: adopted: test-set accuracy 90.40 vs 90.39 %")
    assert decided[-1].startswith("bundle ema: adopted")
    assert "(complete)" in decided[0] and "zero-init, 1 held-out run" in output, "the earlier call's row is not read"


def test_run_with_the_recipe_changed_runs_its_test_set_seeds_beside_the_best_bundles(tmp_path, monkeypatch, capfd):
    bundles = {"zero-init": 90.3}
    monkeypatch.setattr(screen, "ABLATION", stand_in_ablation(tmp_path, screen_lines(bundles, validation=16)))
    out = tmp_path / "screen.jsonl"
    code, output, _ = run_screen_here(monkeypatch, capfd, "run", "--json", out, "--time-rows", "--bundles", *bundles,
                                   "--recipe-changed", "--validation", 16, "--test-seeds", 0, 1, 2, 3, 4)
    assert code == 0, output
    rows = [(row["row"], row["settings"]["seed"], row["settings"]["validation"])
            for row in map(json.loads, out.read_text().splitlines())]
    assert rows[3:] == [(name, seed, 0) for seed in range(5) for name in ("shipped", "zero-init")]
    assert output.splitlines()[-1].startswith("bundle zero-init: adopted: test-set accuracy 90.40 vs 90.00 %")


def test_run_stops_before_a_run_that_would_end_past_the_deadline_and_says_what_it_skipped(tmp_path, monkeypatch,
                                                                                          capfd):
    bundles = {"zero-init": 90.3, "ema": 90.2}
    lines = screen_lines(bundles)
    del lines["ema 0 5000"]  # this run fails: the screen goes on without it, and exits 1 at the end
    monkeypatch.setattr(screen, "ABLATION", stand_in_ablation(tmp_path, lines))
    clock, run_one = [0.0], screen.run_one

    def run_for_30_seconds(command, seconds_left):
        clock[0] += 30
        return run_one(command, seconds_left)
    monkeypatch.setattr(common, "seconds_since_launch", lambda: clock[0])
    monkeypatch.setattr(screen, "run_one", run_for_30_seconds)
    out = tmp_path / "screen.jsonl"
    code, output, _ = run_screen_here(monkeypatch, capfd, "run", "--json", out, "--time-rows", "--bundles", *bundles,
                                   "--deadline", 130)
    assert code == 1, output
    # at 0 s the first estimate (20 s) fits, then 30 s a run: 4 runs by 120 s, then 120 + 30 > 130
    assert [json.loads(line)["row"] for line in out.read_text().splitlines()] == ["shipped", "shipped", "zero-init"]
    assert "screen: ema seed 0 failed (exit code 1)" in output
    assert "screen: deadline: 10 s left of 130, a run takes up to 30 s: skipped zero-init seed 0, zero-init seed 1, " \
           "zero-init seed 2, zero-init seed 3, zero-init seed 4" in output
    assert "(cut by the deadline)" in output and "bundle ema: not decided for stage 2" in output
    assert output.splitlines()[-1] == "screen: failed: ema seed 0; their output is above"


def test_a_run_past_the_deadline_is_stopped_with_the_process_it_started():
    started = time.monotonic()
    child = "import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']);" \
            "print(flush=True); time.sleep(60)"
    code = screen.run_one([sys.executable, "-c", child], seconds_left=1.0)
    assert code is None and time.monotonic() - started < 10
    survivors = subprocess.run(["pgrep", "-f", "time.sleep\\(60\\)"], capture_output=True, text=True).stdout.split()
    assert not [pid for pid in survivors if int(pid) != os.getpid()], "the row's own process is stopped too"


def test_run_end_to_end_on_the_cpu_with_ablation_py(tmp_path, monkeypatch, capfd):
    """The real ablation.py, once (on a loaded 2-core CPU a run costs ~20 s): the recipe at one seed, then the
    deadline skips the time row, and the rules say why they cannot decide. The stand-in above runs the rest."""
    monkeypatch.setattr(screen, "RECIPE_SEEDS", [0])
    clock, run_one = [0.0], screen.run_one

    def run_as_if_for_200_seconds(command, seconds_left):
        code = run_one(command, seconds_left)
        clock[0] += 200
        return code
    monkeypatch.setattr(common, "seconds_since_launch", lambda: clock[0])  # not pytest's age
    monkeypatch.setattr(screen, "run_one", run_as_if_for_200_seconds)
    out = tmp_path / "screen.jsonl"
    code, output, errors = run_screen_here(monkeypatch, capfd, "run", "--json", out, "--time-rows", "full-eval",
                                           "--bundles", "--validation", 16, "--deadline", 300, *TINY)
    assert code == 0, errors
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(row["row"], row["settings"]["seed"], row["settings"]["validation"]) for row in rows] == [
        ("shipped", 0, 16)]
    assert rows[0]["command"].startswith("python lab/ablation.py --rows shipped --seed 0 --validation 16")
    phases = screen.phases(rows[0])
    assert phases["steady"] > 0 and phases["sizes_without_steady"] == []
    assert "screen: deadline: 100 s left of 300, a run takes up to 200 s: skipped full-eval seed 0" in output
    assert output.splitlines()[-2].startswith("shipped, 1 held-out run (seeds 0): before the first step")
    assert output.splitlines()[-1] == "time row full-eval: not decided: its held-out runs: 0 runs, the rule needs 1"
