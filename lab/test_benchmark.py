"""lab/benchmark.py: the chain, or the ladder, as one table. Its seeds and spread with fake scripts standing in for the
chain (seconds, not minutes); then the real chain at a toy size, by the README's command."""
import inspect
import json
import os
import re
import shlex
import statistics
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

import root  # noqa: F401  (first: the repository's root on sys.path, for the scripts and common.py)
import accounting  # noqa: E402
import benchmark  # noqa: E402
from conftest import ALL_SCRIPTS, ROOT, SMALL, copy_without_git, run_python, write_tiny_cifar10  # noqa: E402
from root import LAB  # noqa: E402

# A stand-in for a chain script: it logs its arguments and writes a --json row whose figures follow from its seed,
# with no torch import, so a round takes milliseconds.
FAKE_SCRIPT = '''import json, sys
argv = sys.argv[1:]
seed = int(argv[argv.index("--seed") + 1])
with open(__file__ + ".calls", "a") as calls:
    calls.write(json.dumps(argv) + "\\n")
report = {"script": __file__, "device": "cpu", "cpu": "Fake CPU", "threads": 2, "torch": "0.0", "data": "synthetic",
          "settings": {"batch_size": 64, "seed": seed, "data_dir": None, "synthetic": True},
          "steady_images_per_second": 100.0 + seed, "steady_ms_per_step": 1.0, "peak_memory_bytes": None,
          "final_test_accuracy": OFFSET + 0.01 * seed, "launch_to_result_seconds": 10.0 + seed ** 2,
          "total_seconds": 8.0, "epochs": [{"train_seconds": 3.0, "steps": 4, "images": 256},
                                           {"train_seconds": 2.0, "steps": 4, "images": 256}]}
with open(argv[argv.index("--json") + 1], "a") as rows:
    rows.write(json.dumps(report) + "\\n")
'''


def accuracy(name, seed):
    """What FAKE_SCRIPT written by fake_chain as `name` reports as its final test accuracy for `seed`."""
    return {"a.py": 0.5, "b.py": 0.8}[name] + 0.01 * seed


def fake_chain(tmp_path, monkeypatch):
    """Two fake scripts, a.py and b.py, where benchmark.py looks for the chain's, and one, broken.py, that fails."""
    for name in ("a.py", "b.py"):
        (tmp_path / name).write_text(FAKE_SCRIPT.replace("OFFSET", str(accuracy(name, 0))))
    (tmp_path / "broken.py").write_text('import sys\nsys.exit("broken.py: a bad flag")\n')
    monkeypatch.setattr(benchmark, "ROOT", tmp_path)


def run_benchmark(monkeypatch, capsys, *flags):
    """benchmark.main() in this process with `flags`; returns (exit code, stdout, stderr)."""
    monkeypatch.setattr(sys, "argv", ["benchmark.py", "--device", "cpu", *map(str, flags)])
    try:
        benchmark.main()
        code = 0
    except SystemExit as exit:
        code = exit.code
    output = capsys.readouterr()
    return code, output.out, output.err


def seeds_called(tmp_path, name):
    """The --seed each run of the fake script `name` was given, in order."""
    calls = [json.loads(line) for line in (tmp_path / f"{name}.calls").read_text().splitlines()]
    return [int(argv[argv.index("--seed") + 1]) for argv in calls]


def markdown_tables(text):
    """Each markdown table in `text` as a list of rows of stripped cells, without the header and its rule."""
    tables, previous = [], ""
    for line in text.splitlines():
        if line.startswith("|") and not previous.startswith("|"):  # a table's first line: a new table
            tables.append([])
        if line.startswith("|"):
            tables[-1].append([cell.strip() for cell in line.split("|")[1:-1]])
        previous = line
    return [table[2:] for table in tables]


def test_repeats_give_round_r_the_seed_plus_r_minus_1_and_the_summary_their_spread(tmp_path, monkeypatch, capsys):
    fake_chain(tmp_path, monkeypatch)
    json_path = tmp_path / "chain.jsonl"
    code, out, err = run_benchmark(monkeypatch, capsys, "--scripts", "a.py", "b.py", "--repeats", 3, "--seed", 5,
                                   "--json", json_path)
    assert code == 0, err
    assert seeds_called(tmp_path, "a.py") == seeds_called(tmp_path, "b.py") == [5, 6, 7]
    *runs, summary = [json.loads(line) for line in json_path.read_text().splitlines()]
    # each run's own row keeps its form: the script's report plus which run and round it was
    assert [(run["benchmark_run"], run["round"], run["settings"]["seed"]) for run in runs] == \
        [(name, round_number, 4 + round_number) for round_number in (1, 2, 3) for name in ("a.py", "b.py")]
    assert all(set(run) - set(runs[0]) == set() for run in runs) and "test_accuracy_mean" not in runs[0]
    assert summary["seeds"] == [5, 6, 7] and summary["settings"]["seed"] == 5
    for row in summary["rows"]:
        accuracies = [accuracy(row["name"], seed) for seed in (5, 6, 7)]
        seconds = [10.0 + seed ** 2 for seed in (5, 6, 7)]
        assert (row["n"], row["seeds"]) == (3, [5, 6, 7])
        assert row["test_accuracy_mean"] == pytest.approx(statistics.mean(accuracies))
        assert row["test_accuracy_std"] == pytest.approx(statistics.stdev(accuracies))  # 0.01: the sample std
        assert (row["test_accuracy_min"], row["test_accuracy_max"]) == pytest.approx((accuracies[0], accuracies[2]))
        assert row["launch_to_result_seconds_std"] == pytest.approx(statistics.stdev(seconds))
        assert (row["launch_to_result_seconds_mean"], row["launch_to_result_seconds_min"],
                row["launch_to_result_seconds_max"]) == pytest.approx((statistics.mean(seconds), 35.0, 59.0))
        assert row["test_accuracy"] == pytest.approx(statistics.median(accuracies)), "the median stays"
    assert "medians of 3 rounds, seeds 5 to 7" in out
    table, spread = markdown_tables(out)
    assert [cells[0] for cells in table] == ["a.py", "b.py"] and len(table[0]) == 9, "the medians' table as before"
    assert spread[0] == ["a.py", "3", "5, 6, 7", "56.00", "1.00", "55.00", "57.00", "46.7", "12.0", "35.0", "59.0"]
    assert spread[1][:7] == ["b.py", "3", "5, 6, 7", "86.00", "1.00", "85.00", "87.00"]


def test_the_rows_name_the_commit_read_as_benchmark_started_though_the_checkout_changes_during_the_runs(
        tmp_path, monkeypatch, capsys):
    # A git that answers aaaaaaa until a run checks out other code, bbbbbbb after: benchmark.py reads the commit before
    # any run, so its rows name the code the runs started with (a long benchmark outlives many checkouts)
    fake_chain(tmp_path, monkeypatch)
    (tmp_path / "bin").mkdir()
    git = tmp_path / "bin" / "git"
    git.write_text(f"#!/bin/sh\ncase \"$*\" in *rev-parse*) [ -e {tmp_path / 'checked-out'} ] && echo bbbbbbb || "
                   "echo aaaaaaa;; esac\n")
    git.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}:{os.environ['PATH']}")
    (tmp_path / "a.py").write_text((tmp_path / "a.py").read_text() + f"open({str(tmp_path / 'checked-out')!r}, 'w')\n")
    json_path = tmp_path / "chain.jsonl"
    code, out, err = run_benchmark(monkeypatch, capsys, "--scripts", "a.py", "b.py", "--json", json_path)
    assert code == 0, err
    assert (tmp_path / "checked-out").exists(), "the checkout changed during the runs"
    *runs, summary = [json.loads(line) for line in json_path.read_text().splitlines()]
    assert [run["commit"] for run in runs] == ["aaaaaaa", "aaaaaaa"] and summary["commit"] == "aaaaaaa"


def test_same_seed_gives_every_round_the_one_seed(tmp_path, monkeypatch, capsys):
    fake_chain(tmp_path, monkeypatch)
    json_path = tmp_path / "chain.jsonl"
    code, out, err = run_benchmark(monkeypatch, capsys, "--scripts", "a.py", "--repeats", 3, "--seed", 2,
                                   "--same-seed", "--json", json_path)
    assert code == 0, err
    assert seeds_called(tmp_path, "a.py") == [2, 2, 2]
    summary = json.loads(json_path.read_text().splitlines()[-1])
    assert summary["seeds"] == [2, 2, 2] and summary["rows"][0]["test_accuracy_std"] == 0.0
    assert "seed 2 in every round" in out and "round 3/3 a.py (seed 2)" in out


def test_one_round_has_no_spread_table_and_a_null_std(tmp_path, monkeypatch, capsys):
    fake_chain(tmp_path, monkeypatch)
    json_path = tmp_path / "chain.jsonl"
    code, out, err = run_benchmark(monkeypatch, capsys, "--scripts", "a.py", "b.py", "--json", json_path)
    assert code == 0, err
    assert seeds_called(tmp_path, "a.py") == [0], "--seed's default, passed on"
    assert len(markdown_tables(out)) == 1, "one round: its spread would repeat the table"
    summary = json.loads(json_path.read_text().splitlines()[-1])
    assert summary["seeds"] == [0]
    assert [(row["n"], row["test_accuracy_std"], row["launch_to_result_seconds_std"]) for row in summary["rows"]] == \
        [(1, None, None)] * 2


def test_a_failed_script_is_left_out_of_the_spread(tmp_path, monkeypatch, capsys):
    fake_chain(tmp_path, monkeypatch)
    monkeypatch.setattr(benchmark.tempfile, "tempdir", str(tmp_path))  # broken.py's log here, not in /tmp
    code, out, _ = run_benchmark(monkeypatch, capsys, "--scripts", "a.py", "broken.py", "--repeats", 2)
    assert code == 1
    table, spread = markdown_tables(out)
    assert table[1][0] == "broken.py" and table[1][1].startswith(f"failed (exit 1; its output in {tmp_path}")
    assert [cells[0] for cells in spread] == ["a.py"] and seeds_called(tmp_path, "a.py") == [0, 1]


def reports(accuracies, seconds):
    """Made-up chain reports, one a run, with the final test accuracies and launch-to-result seconds given."""
    return [{"steady_images_per_second": 100.0, "steady_ms_per_step": 1.0, "total_seconds": 5.0,
             "launch_to_result_seconds": second, "peak_memory_bytes": None, "final_test_accuracy": accuracy,
             "settings": {"batch_size": 128, "seed": seed}, "epochs": [{"train_seconds": 2.0}]}
            for seed, (accuracy, second) in enumerate(zip(accuracies, seconds))]


def test_chain_rows_spread_is_the_mean_sample_std_min_and_max_of_the_reports():
    accuracies, seconds = [0.91, 0.93, 0.92, 0.96], [61.0, 58.5, 70.0, 60.5]
    row, single = benchmark.chain_rows({"opt1.py": reports(accuracies, seconds), "opt2.py": reports([0.9], [40.0])})
    for name, values in (("test_accuracy", accuracies), ("launch_to_result_seconds", seconds)):
        assert row[f"{name}_mean"] == pytest.approx(statistics.mean(values))
        assert row[f"{name}_std"] == pytest.approx(statistics.stdev(values))
        assert row[f"{name}_std"] != pytest.approx(statistics.pstdev(values)), "n - 1, not n"
        assert (row[f"{name}_min"], row[f"{name}_max"]) == (min(values), max(values))
    assert (row["n"], row["seeds"]) == (4, [0, 1, 2, 3])
    assert (single["n"], single["test_accuracy_std"], single["test_accuracy_mean"], single["test_accuracy_max"]) == \
        (1, None, 0.9, 0.9)
    spread = markdown_tables(benchmark.spread_table({"opt2.py": reports([0.9], [40.0])}))[0]
    assert spread == [["opt2.py", "1", "0", "90.00", "-", "90.00", "90.00", "40.0", "-", "40.0", "40.0"]]


def test_round_seeds_count_up_in_the_chain_and_stay_in_the_ladder():
    def seeds(**given):
        return benchmark.round_seeds(SimpleNamespace(**{"ladder": False, "same_seed": False, **given}))

    assert seeds(seed=3, repeats=4) == [3, 4, 5, 6]
    assert seeds(seed=3, repeats=4, same_seed=True) == seeds(seed=3, repeats=4, ladder=True) == [3, 3, 3, 3]
    assert seeds(seed=0, repeats=1) == [0]


def test_the_ladder_passes_its_one_seed_to_every_rung(monkeypatch):
    called = []
    monkeypatch.setattr(benchmark.subprocess, "run", lambda command, **_: called.append(command) or
                        SimpleNamespace(returncode=1, stdout="", stderr=""))
    args = SimpleNamespace(epochs=2, batch_size=128, train_size=64, test_size=64, data_dir=None, device="cpu",
                           synthetic=False, ladder=True)
    assert benchmark.run_once("opt1.py", ["--no-compile"], args, "row.json", 7) == (None, "failed (exit 1)")
    assert called[0][called[0].index("--seed") + 1] == "7" and called[0][-1] == "--synthetic"


@pytest.mark.parametrize("flags, message", [
    (["--seed", "-1"], "argument --seed: must be 0 or more, got -1"),
    (["--ladder", "--same-seed"], "--same-seed is for the chain"),
])
def test_bad_seed_flags_exit_2_with_one_error_line(flags, message, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["benchmark.py", *flags])
    with pytest.raises(SystemExit) as exit:
        benchmark.parse_args()
    err = capsys.readouterr().err
    assert exit.value.code == 2 and len(err.splitlines()) == 1 and err.startswith("error: ") and message in err


def test_help_documents_every_flag_with_its_default(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["benchmark.py", "--help"])
    with pytest.raises(SystemExit) as exit:
        benchmark.parse_args()
    out = capsys.readouterr().out
    assert exit.value.code == 0 and "--seed" in out and "--same-seed" in out
    help_texts = out.split("options:")[1].split("\n  -")[2:]  # skip -h
    assert all("default" in text for text in help_texts), help_texts


def test_benchmark_functions_take_at_most_six_parameters_and_lines_fit_120_characters():
    functions = [value for value in vars(benchmark).values()
                 if inspect.isfunction(value) and value.__module__ == benchmark.__name__]
    parameters = {function.__name__: len(inspect.signature(function).parameters) for function in functions}
    assert "run_once" in parameters and {name: count for name, count in parameters.items() if count > 6} == {}
    for path in (LAB / "benchmark.py", Path(__file__)):
        assert [number for number, line in enumerate(path.read_text().splitlines(), 1) if len(line) > 120] == [], path


# ------------------------------------------------------------------------------------ benchmark

def test_benchmark_measures_the_chain_by_the_readmes_command_on_a_cpu(tmp_path):
    # The README's command, then what makes it small here: the last of a repeated flag wins
    command = re.search(r"^python lab/benchmark\.py [^#\n]*?(?=\s*(#|$))", (ROOT / "README.md").read_text(), re.M)[0]
    json_path = tmp_path / "chain.jsonl"
    # 515 images: 8 steps of 64, 4 of 128 and 1 of 512 an epoch, so 5 epochs for OneCycleLR's 5 steps at opt5's batch
    write_tiny_cifar10(tmp_path / "data", train_per_file=103, test_size=64)  # not the official bytes: none checks them
    result = run_python(*shlex.split(command)[1:], "--device", "cpu", "--train-size", 512, "--epochs", 5,
                        "--data-dir", tmp_path / "data", "--json", json_path, timeout=1800)
    assert result.returncode == 0, result.stderr
    table = [line.split("|")[1:-1] for line in result.stdout.splitlines() if line.startswith("| ")][1:]  # no header
    scripts = ["baseline.py", "opt1.py", "opt2.py", "opt3.py", "opt4.py", "opt5.py"]
    assert [cells[0].strip() for cells in table] == scripts and table[0][2].strip() == "1.00x"
    *runs, summary = [json.loads(line) for line in json_path.read_text().splitlines()]
    # each script's own --json line at its own batch size, named by the commit and the data it ran on
    fingerprint = accounting.data_fingerprint({"synthetic": False, "data_dir": tmp_path / "data"})
    assert [run["benchmark_run"] for run in runs] == [run["script"] for run in runs] == scripts
    assert [run["settings"]["batch_size"] for run in runs] == [64, 64, 128, 128, 128, 512]
    assert {(run["commit"], run["data_fingerprint"], run["device"]) for run in runs} == \
        {(accounting.git_commit(), fingerprint, "cpu")}
    assert summary["benchmark"] == "chain" and [row["name"] for row in summary["rows"]] == scripts
    opt1_row = summary["rows"][1]
    assert table[1][1].strip() == f"{opt1_row['images_per_second']['all']:,.0f}"
    assert table[1][4].strip() == f"{100 * runs[1]['final_test_accuracy']:.2f}"
    # opt5's 5 epochs train at 16, 16, 24, 32, 32 px: a steady speed at 16 and at 32 px, no single one to compare
    assert re.fullmatch(r"[\d,]+ at 16 px, [\d,]+ at 32 px", table[5][1].strip()) and table[5][2].strip() == "-"


def test_benchmark_marks_a_failed_script_runs_the_rest_and_exits_1(tmp_path):
    env = copy_without_git(tmp_path, "lab/benchmark.py", "lab/root.py", "lab/accounting.py", "baseline.py", "common.py",
                           "machine.py")
    (tmp_path / "broken.py").write_text('import sys\nsys.exit("broken.py: a bad flag")\n')
    (tmp_path / "silent.py").write_text("# exits 0 with no output and no row\n")
    json_path = tmp_path / "chain.jsonl"
    result = run_python(tmp_path / "lab" / "benchmark.py", "--scripts", "broken.py", "baseline.py", "silent.py", *SMALL,
                        "--epochs", 2, "--train-size", 64, "--json", json_path, env={**env, "TMPDIR": tmp_path})
    assert result.returncode == 1, result.stderr
    table = [[cell.strip() for cell in line.split("|")[1:-1]]
             for line in result.stdout.splitlines() if line.startswith("| ")][1:]  # no header
    assert [cells[0] for cells in table] == ["broken.py", "baseline.py", "silent.py"]
    log = re.fullmatch(r"failed \(exit 1; its output in (.+\.log)\)", table[0][1])
    assert log and "broken.py: a bad flag" in Path(log[1]).read_text() and table[0][2:] == ["-"] * 7
    assert table[1][2] == "1.00x", "the script after the failed one ran"
    assert table[2][1] == "failed (no row written)" and table[2][2:] == ["-"] * 7
    assert "commit unknown (not a git checkout)" in result.stdout
    assert "commit unknown: not a git checkout (or git is missing), so the rows' commit is null" in result.stdout
    *runs, summary = [json.loads(line) for line in json_path.read_text().splitlines()]
    assert [run["script"] for run in runs] == ["baseline.py"] and runs[0]["commit"] is None
    assert [row["name"] for row in summary["rows"]] == ["baseline.py"]
    assert summary["failed"] == {"broken.py": table[0][1], "silent.py": table[2][1]}


def test_benchmark_speedup_is_each_scripts_speed_over_baselines():
    def reports(images_per_second, sizes=None):
        epochs = [{"train_seconds": 10.0, "images": 1000, "steps": 10, "image_size": size} for size in sizes or []]
        return [{"steady_images_per_second": images_per_second, "steady_ms_per_step": 1.0, "total_seconds": 50.0,
                 "launch_to_result_seconds": 60.0, "peak_memory_bytes": 2**30, "final_test_accuracy": 0.5,
                 "settings": {"batch_size": 128}, "epochs": epochs or [{"train_seconds": 12.0}]}]

    results = {"baseline.py": reports(100.0), "opt1.py": reports(250.0), "opt2.py": reports(50.0),
               "opt5.py": reports(None, sizes=[16, 16, 24, 32, 32])}
    rows = [row.split("|")[1:-1] for row in benchmark.chain_table(results).splitlines()[2:]]
    assert [row[2].strip() for row in rows] == ["1.00x", "2.50x", "0.50x", "-"]
    # opt5: each size's epochs after its first; 24 px trained once, compiling, so it has none
    assert rows[3][1].strip() == "100 at 16 px, 100 at 32 px" and rows[3][3].strip() == "1000.0 at 16 px, 1000.0 at " \
        "32 px (128)"
    assert [cell.strip() for cell in rows[0][4:8]] == ["50.00", "60.0", "12.0", "10.0"]


def test_benchmark_ladder_compares_each_rung_with_the_one_it_adds_to():
    speeds = {"baseline": 100.0, "opt1 eager": 200.0, "opt1": 250.0, "opt2, 0 workers": 240.0,
              "opt2, 2 workers": 200.0, "opt3": 180.0, "opt4": 360.0, "opt4 + compile": 300.0}
    results = {rung: [{"steady_images_per_second": speed, "achieved_tflops": 0.1, "steady_ms_per_step": 1.0,
                       "warmup_seconds": 0.0, "peak_memory_bytes": 2**30, "final_test_accuracy": 0.5}]
               for rung, speed in speeds.items()}
    rows = [row.split("|")[1:-1] for row in benchmark.ladder_table(results, peak_tflops=1.0).splitlines()[2:]]
    by_rung = {row[0].strip(): [cell.strip() for cell in row] for row in rows}
    assert list(by_rung) == list(speeds)
    assert by_rung["opt1"][5:8] == ["opt1 eager", "1.25x", "2.50x"]
    assert by_rung["opt3"][5:8] == ["opt2, 0 workers", "0.75x", "1.80x"]
    assert by_rung["opt4"][5:8] == ["opt3", "2.00x", "3.60x"]
    assert by_rung["opt4"][3] == "no host sync; the step captured as one CUDA graph" and by_rung["opt1"][3] == "-"


def test_benchmark_ladder_marks_a_failed_rung_and_what_it_cannot_compare():
    results = {rung: [{"steady_images_per_second": 100.0, "achieved_tflops": 0.1, "steady_ms_per_step": 1.0,
                       "warmup_seconds": 0.0, "peak_memory_bytes": 2**30, "final_test_accuracy": 0.5}]
               for rung, *_ in benchmark.LADDER}
    results["opt1 eager"] = []
    table = benchmark.ladder_table(results, peak_tflops=1.0, failures={"opt1 eager": "failed (exit 1)"})
    by_rung = {cells[0]: cells for cells in ([cell.strip() for cell in row.split("|")[1:-1]]
                                             for row in table.splitlines()[2:])}
    assert list(by_rung) == [rung for rung, *_ in benchmark.LADDER]
    assert by_rung["opt1 eager"][4:] == ["failed (exit 1)"] + ["-"] * 7
    assert by_rung["opt1"][5:8] == ["opt1 eager", "-", "1.00x"], "no speedup over a rung that failed"


@pytest.mark.parametrize("rung, script, flags", [rung[:3] for rung in benchmark.LADDER])
def test_every_ladder_rung_is_a_command_its_script_accepts(rung, script, flags, monkeypatch):
    monkeypatch.setattr(sys, "argv", [script, *flags])
    args = ALL_SCRIPTS[script].parse_args()
    compiled_by_default = script in ("opt1.py", "opt2.py")  # opt4 on: off by default, the step captured uncompiled
    assert getattr(args, "compile", False) == ("--compile" in flags
                                               or compiled_by_default and "--no-compile" not in flags)


def test_benchmark_rejects_one_epoch():
    result = run_python("lab/benchmark.py", "--epochs", 1)
    assert result.returncode == 2 and "steady state excludes epoch 1" in result.stderr


def test_the_readmes_benchmark_command_runs_from_a_clone_on_generated_data(tmp_path):
    # `python lab/benchmark.py` from the repository's root, as the README gives it, at a toy size on generated data
    json_path = tmp_path / "chain.jsonl"
    result = run_python("lab/benchmark.py", "--device", "cpu", "--synthetic", "--scripts", "baseline.py", "--epochs", 2,
                        "--train-size", 128, "--test-size", 32, "--json", json_path)
    assert result.returncode == 0, result.stderr
    table = [line.split("|")[1:-1] for line in result.stdout.splitlines() if line.startswith("| ")][1:]
    assert [cells[0].strip() for cells in table] == ["baseline.py"] and table[0][2].strip() == "1.00x"
    run, summary = [json.loads(line) for line in json_path.read_text().splitlines()]
    assert run["data"] == "synthetic" and summary["command"].startswith("python lab/benchmark.py --device cpu")
