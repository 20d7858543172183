"""The prose against the data: README.md's figures and lab/README.md's tables trace to the rows in lab/results/."""
import collections
import re
import statistics
import sys

import pytest

import root  # noqa: F401  (first: the repository's root on sys.path, for the scripts and common.py)
import ablation  # noqa: E402
import benchmark  # noqa: E402
import plot  # noqa: E402
from conftest import ALL_SCRIPTS, ROOT, run_python  # noqa: E402


# -------------------------------------------------------------- the front page against the data

def json_lines(name):
    """The rows of lab/results/`name` as plot.py reads them: each script by today's name."""
    return plot.read_lines(ROOT / "lab" / "results" / name)


def readme_chain_table():
    """The README's chain table: {script: its cells}, the script's name without the row's commit."""
    lines = (ROOT / "README.md").read_text().splitlines()
    return {cells[0].split("`")[1]: [cell.strip() for cell in cells]
            for cells in (line.split("|")[1:-1] for line in lines if line.startswith("| `")) if len(cells) == 5}


def spread(values, digits):
    """`values` as the README writes a spread: mean ± sample std, at `digits` decimals."""
    return f"{statistics.mean(values):.{digits}f} ± {statistics.stdev(values):.{digits}f}"


def h200_recipe_runs(commit):
    """The H200 runs of the recipe at its defaults at `commit`."""
    return [run for run in json_lines(f"h200-{commit}/chain.jsonl") if run["script"] == "opt5.py"
            and all(run["settings"].get(name) == value for name, value in plot.RECIPE.items())]


def test_readme_chain_table_is_the_gpus_rows_each_with_its_commit_and_says_whose_code_changed_since():
    readme, table = (ROOT / "README.md").read_text(), readme_chain_table()
    gpu = plot.at_defaults(plot.gpu_runs([ROOT / path for path in plot.GPU_RUNS]))
    rows = {row["name"]: row for row in benchmark.chain_rows(gpu)}
    commit = {name: runs[0]["commit"] for name, runs in gpu.items()}
    where_from = readme[readme.index("**Where the numbers come from:**"):readme.index("## Run")]
    assert all(row_commit in where_from for row_commit in plot.commits(gpu))
    assert list(table) == list(ALL_SCRIPTS) and "| H200 images/s" in readme
    recipe = h200_recipe_runs(commit["opt5.py"])
    for script, row in rows.items():
        name, _, speed, accuracy, launch_to_result = table[script]
        assert name == f"`{script}` ({commit[script]})", script
        assert speed == benchmark.per_size(row["images_per_second"], ",.0f"), script
        if script == "opt5.py":  # the recipe: every run of it at its defaults, as a mean and spread
            n = f" (n = {len(recipe)})"
            assert (accuracy, launch_to_result) == (
                spread([100 * run["final_test_accuracy"] for run in recipe], 2) + n,
                spread([run["launch_to_result_seconds"] for run in recipe], 1) + n)
        else:
            assert (accuracy, launch_to_result) == (f"{100 * row['test_accuracy']:.2f}",
                                                    f"{row['launch_to_result_seconds']:.1f}"), script
    assert table["opt6.py"][2] == "not run on a GPU"
    shown = [row["launch_to_result_seconds"] for script, row in rows.items() if script != "opt5.py"]  # the table's
    shown.append(statistics.mean(run["launch_to_result_seconds"] for run in recipe))  # cells: the recipe's mean
    assert f"the rows below add up to {sum(shown) / 60:.1f} minutes" in readme
    # What each optimization bought on the GPU, in "What to copy first": ratios and differences of the rows
    speed = {script: row["images_per_second"].get("all") for script, row in rows.items()}
    accuracy = {script: 100 * row["test_accuracy"] for script, row in rows.items()}
    launch_to_result = {script: row["launch_to_result_seconds"] for script, row in rows.items()}
    steps = {script: row["ms_per_step"].get("all") for script, row in rows.items()}
    compiled = next(run for run in json_lines(f"h200-{commit['opt4.py']}/chain.jsonl")
                    if run["script"] == "opt4.py" and run["settings"]["compile"])
    opt5 = gpu["opt5.py"][0]
    at_size = {size: min(epoch["ms_per_step"] for epoch in opt5["epochs"] if epoch["image_size"] == size)
               for size in (16, 32)}
    # the recipe's means over its runs (as the first screen gives them), against opt4's one run
    recipe = h200_recipe_runs(commit["opt5.py"])
    recipe_accuracy = statistics.mean(100 * run["final_test_accuracy"] for run in recipe)
    recipe_launch = statistics.mean(run["launch_to_result_seconds"] for run in recipe)
    earlier = plot.at_defaults(plot.gpu_runs([ROOT / "lab/results/h200-410ebec/chain-cold-cache.jsonl"]))
    earlier = {script: runs[0]["steady_images_per_second"] for script, runs in earlier.items()}
    for bought in (f"H200: with compile {speed['opt1.py'] / speed['baseline.py']:.2f}x images/s, "
                   f"{earlier['opt1.py'] / earlier['baseline.py']:.2f}x in an earlier pair of runs of the same code",
                   f"H200: +{accuracy['opt2.py'] - accuracy['opt1.py']:.2f} points after 5 epochs over opt1 (one run",
                   f"H200, at {commit['opt4.py']}: {speed['opt3.py'] / speed['opt2.py']:.1f}x opt2's images/s alone "
                   f"(opt3), {speed['opt4.py'] / speed['opt2.py']:.1f}x with the next row",
                   f"H200, opt4's model: {compiled['steady_ms_per_step'] / steps['opt4.py']:.2f}x its ms a step, "
                   f"{compiled['launch_to_result_seconds'] / launch_to_result['opt4.py']:.1f}x its seconds from launch "
                   f"({compiled['launch_to_result_seconds']:.1f} s)",
                   f"H200: +{recipe_accuracy - accuracy['opt4.py']:.1f} points for "
                   f"{100 * (recipe_launch / launch_to_result['opt4.py'] - 1):.0f} % more time from launch than opt4",
                   f"H200: {steps['opt4.py']:.2f} ms a step at batch 128, opt3's loop {steps['opt3.py']:.2f} "
                   f"({steps['opt3.py'] / steps['opt4.py']:.1f}x)",
                   f"H200: {at_size[16]:.2f} ms a 16-px step, {at_size[32]:.2f} ms a 32-px one (batch 512)"):
        assert bought in " ".join(readme.split()), bought
    changed = plot.changed_since_their_rows(gpu)
    if changed is None:
        pytest.skip("no git history here to tell which scripts changed since their rows' commits")
    changed = {script for scripts in changed.values() for script in scripts}
    sentence = " ".join(readme[readme.index("Changed since their rows:"):].split("\n\n")[0].split())
    named = {f"{name}.py" for name in re.findall(r"\b(opt\d)\b", sentence.split(": today's code")[0])}
    assert named == changed and "today's code not measured on a GPU" in sentence


# How the rows' CPUs are named in the README
CPU_WORDS = {"AMD EPYC (AVX-512 BF16)": "AMD EPYC with AVX-512 BF16", "Intel Xeon (AMX-BF16)": "Intel Xeon with AMX"}
AIRBENCH94_PUBLISHED = 94.01  # airbench94.py's mean on the official CIFAR-10, KellerJordan/cifar10-airbench's README


def test_readmes_settings_versions_and_peer_are_the_rows():
    readme = " ".join((ROOT / "README.md").read_text().split())
    gpu = plot.at_defaults(plot.gpu_runs([ROOT / path for path in plot.GPU_RUNS]))
    settings = {script: runs[0]["settings"] for script, runs in gpu.items()}
    recipe = h200_recipe_runs(gpu["opt5.py"][0]["commit"])
    torch_versions = {run["torch"] for runs in gpu.values() for run in runs + recipe}
    assert len(torch_versions) == 1 and f"one NVIDIA H200 (torch {torch_versions.pop()})" in readme
    cpu_rows = plot.recipe_runs(json_lines("recipe.jsonl")) + json_lines("tests.jsonl")[-2:]
    assert {row["torch"].split("+")[0] for row in cpu_rows} == {"2.14.1"} and "2-core CPUs (torch 2.14.1)" in readme
    # the ~5 s a process of compiling torch's sources: the profile of opt4's run on that image
    profile = (ROOT / "lab/results/h200-4faed98/opt4-epochs1-cprofile.txt").read_text()
    compiling = float(re.search(r"^\s*\d+\s+[\d.]+\s+[\d.]+\s+([\d.]+).*builtins\.compile\}", profile, re.M)[1])
    assert f"~{compiling:.0f} s a process of compiling torch's Python sources" in readme
    # the peer on the same JPEG copy: airbench94's test accuracy with its mirrors, each run's "eval" line
    log = (ROOT / "lab/results/h200-410ebec/airbench94.log").read_text()
    airbench = [100 * float(line.split("|")[-3]) for line in log.splitlines() if "|   eval  |" in line]
    assert f"~{AIRBENCH94_PUBLISHED - statistics.mean(airbench):.0f} points under the official data for a strong " \
           f"model (airbench94: {spread(airbench, 2)} % on the copy, n = {len(airbench)}, {AIRBENCH94_PUBLISHED} % " \
           "published)" in readme
    # what changed between opt1's row and opt2's, beside the transforms' +6.83 points
    opt1, opt2 = settings["opt1.py"], settings["opt2.py"]
    assert f"batch {opt2['batch_size']} for {opt1['batch_size']}, a peak rate of {opt2['lr']:.0e} for " \
           f"{opt1['lr']:.0e}".replace("e-0", "e-") in readme
    assert f"1.77 ms a step at batch {settings['opt4.py']['batch_size']}" in readme
    assert f"a 32-px one (batch {settings['opt5.py']['batch_size']})" in readme
    assert {(run["settings"]["epochs"], run["settings"]["batch_size"], run["settings"]["lr"]) for run in recipe} == \
        {(20, 512, 0.016)} and "the recipe: 20 epochs of batch 512, lr 0.016" in readme
    seeds = [str(run["settings"]["seed"]) for run in recipe]
    assert f"(opt5's three runs: seeds {', '.join(seeds[:-1])} and {seeds[-1]})" in readme
    for command in ("python -m pytest -q", "python -m pytest -q lab"):  # each tier's newest row, as the first screen
        tests = [row for row in json_lines("tests.jsonl") if row["command"] == command and row["alone"]][-1]
        assert f"min ({CPU_WORDS[tests['cpu']]}, at {tests['commit']}) |" in readme, command
    cpu_recipe = plot.recipe_runs(json_lines("recipe.jsonl"))
    assert {run["cpu"] for run in cpu_recipe} == {"AMD EPYC (AVX-512 BF16)"}
    assert f"min ({CPU_WORDS['AMD EPYC (AVX-512 BF16)']}) |" in readme
    assert f"min ({CPU_WORDS['Intel Xeon (AMX-BF16)']}; older code" in readme  # opt4's CPU runs (their rows' CPU: the first screen's test)


def test_readmes_zero_ops_outside_the_graph_is_the_h200_trace_counted_by_eager_ops():
    # 38c59a9's opt3.py was today's opt4.py (the captured step), compiled: every op inside the graph
    result = run_python("lab/eager_ops.py", "lab/results/h200-38c59a9/opt3-trace.json.gz")
    assert "outside compiled code: 0.0 (each step: 0, 0, 0, 0, 0, 0)" in result.stdout, result.stderr
    assert "0 ops a step outside the graph (38c59a9's trace, compiled)" in (ROOT / "README.md").read_text()


def test_readmes_first_screen_says_what_the_first_command_gives_on_the_h200_and_a_cpu():
    lines = (ROOT / "README.md").read_text().splitlines()
    first_screen = " ".join(lines[:40])
    first_command = next(line for line in lines if line.startswith("python ")).split("#")[0].strip()
    assert first_command == "python opt5.py"
    h200 = h200_recipe_runs(readme_chain_table()["opt5.py"][0].split("(")[1].rstrip(")"))
    cpu = plot.recipe_runs(json_lines("recipe.jsonl"))
    assert f"| `{first_command}` | **{spread([100 * run['final_test_accuracy'] for run in h200], 2)} % " \
           f"(n = {len(h200)}), {spread([run['launch_to_result_seconds'] for run in h200], 1)} s from launch** | " \
           f"{spread([100 * run['final_test_accuracy'] for run in cpu], 2)} % (n = {len(cpu)}), " \
           f"{spread([run['launch_to_result_seconds'] / 60 for run in cpu], 1)} min (AMD EPYC with AVX-512 BF16) |" \
           in first_screen
    opt4 = [run for name in ("curve.jsonl", "seeds.jsonl") for run in json_lines(name)
            if run["script"] == "opt4.py" and len(run["epochs"]) == 5]
    assert {run["cpu"] for run in opt4} == {"Intel Xeon (AMX-BF16)"}
    accuracies, minutes = ([100 * run["final_test_accuracy"] for run in opt4],
                           [run["launch_to_result_seconds"] / 60 for run in opt4])
    assert f"| `python opt4.py --epochs 5` | its row below | {spread(accuracies, 2)} % (n = {len(opt4)}), " \
           f"{spread(minutes, 1)} min" in first_screen
    for command in ("python -m pytest -q", "python -m pytest -q lab"):  # each tier's newest row
        tests = [row for row in json_lines("tests.jsonl") if row["command"] == command and row["alone"]][-1]
        assert f"| `{command}` | - | {tests['passed']} passed, {tests['skipped']} skipped in " \
               f"{tests['seconds'] / 60:.1f} min" in first_screen and tests["failed"] == 0, command


def test_readme_is_a_front_page_of_at_most_90_lines_its_copy_cells_short_and_each_figure_once():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 90
    copy_rows = text[text.index("## What to copy first"):].split("\n\n")[1].splitlines()[2:]
    for row in copy_rows:
        cells = [cell.strip() for cell in row.split("|")[1:-1]]
        assert all(len(cell.split()) <= 40 for cell in cells), cells[0]
        first = cells[3].split(";")[0]
        assert "H200" in first or "GPU" in first, f"{cells[0]}: the GPU figure first"
    # each figure of ours once; the first screen repeats the first command's row (the recipe's) alone
    prose = re.sub(r"```.*?```", "", text, flags=re.S)
    figures = collections.Counter(re.findall(r"(?<![\w.-])(\d[\d,]*\.\d+) ?(%|s\b|ms|min|x\b)", prose))
    repeated = {figure for (figure, _), count in figures.items() if count > 1}
    recipe = readme_chain_table()["opt5.py"]
    assert repeated <= set(re.findall(r"\d+\.\d+", recipe[3] + recipe[4])), repeated


def test_readme_cpu_figures_are_the_measured_data():
    def last_ladder(name):
        ladder = [line for line in json_lines(name) if line.get("benchmark") == "ladder"][-1]
        return {row["name"]: row["images_per_second"] for row in ladder["rows"]}

    readme = (ROOT / "README.md").read_text()
    bf16, float32 = last_ladder("ladder.jsonl"), last_ladder("ladder-avx2.jsonl")
    for bought in (f"CPU with a bfloat16 unit: {bf16['opt1 eager'] / bf16['baseline']:.2f}x (ladder)",
                   f"{bf16['opt1'] / bf16['opt1 eager']:.2f}x images/s (CPU with bfloat16), "
                   f"{float32['opt1'] / float32['opt1 eager']:.2f}x (CPU without)",
                   f"the ladder's opt4 (older code, compiled) over opt2 without workers: "
                   f"{bf16['opt4'] / bf16['opt2, 0 workers']:.2f}x, "
                   f"{float32['opt4'] / float32['opt2, 0 workers']:.2f}x |"):
        assert bought in readme, bought
    compile_log = (ROOT / "lab" / "results" / "compile_cpu.log").read_text()
    compiling = re.search(r"^compiled: compiling and warm-up ([\d.]+) s", compile_log, re.M)[1]
    assert f"opt4's step on the CPU: no gain, after {compiling} s of compiling" in readme
    curve = plot.convergence_runs(json_lines("curve.jsonl"))
    ahead = re.search(r"so opt5 is ([+-][\d.]+) points ahead", plot.curve_summary(curve)[0]).group(1)
    assert f"{ahead} points at equal time (CPU runs, AdamW)" in readme
    muon = plot.convergence_runs(json_lines("muon-xeon-amx.jsonl"))
    nearest = re.search(r"Muon at `--epochs \d` against AdamW at `--epochs \d`, the nearest in time, seed means: "
                        r"([+-][\d.]+) points in (\d+)% of AdamW's time", "\n".join(plot.optimizer_summary(muon)))
    assert f"{float(nearest[1]):+.1f} points in {nearest[2]} % of AdamW's time (CPU, means of 3 seeds)" in readme
    recipe = plot.recipe_runs(json_lines("recipe.jsonl"))
    accuracies = [100 * run["final_test_accuracy"] for run in recipe]
    mean = statistics.mean(accuracies)
    before = [100 * row["final_test_accuracy"] for row in json_lines("muon.jsonl")  # opt5's defaults before the recipe
              if row["settings"].get("optimizer") == "muon" and row["settings"]["epochs"] == 5]
    assert f"CPU: +{mean - statistics.mean(before):.2f} points over the 5 epochs of 128 before it " \
           f"({spread(before, 2)} %, n = {len(before)}) for as many steps" in readme
    no_resizing = [row for row in json_lines("recipe.jsonl")
                   if row.get("row") == "no-resizing" and plot.row_is_at_the_recipes_length(row)]
    assert len(no_resizing) == 1, "one seed: say the seeds' mean on the results page"
    assert f"in the recipe, {recipe[0]['modelled_h200_seconds']:.2f} modelled H200 s instead of " \
           f"{no_resizing[0]['modelled_h200_seconds']:.2f} for {100 * no_resizing[0]['2_views'] - mean:.2f} points " \
           "less (CPU, one seed)" in (ROOT / "lab/README.md").read_text()
    adamw = [row for row in json_lines("recipe.jsonl") if row.get("row") == "adamw" and
             plot.row_is_at_the_recipes_length(row)]
    assert len(adamw) == 1 and f"+{mean - 100 * adamw[0]['2_views']:.2f} points at the recipe's length (CPU, its " \
        f"{len(recipe)} seeds' mean over one AdamW run)" in readme
    data_parallel = json_lines("data-parallel.jsonl")[-1]
    assert data_parallel["script"] == "opt6.py" and data_parallel["world_size"] == 2  # it ran as opt5.py
    assert f"2 CPU processes end with the same weights, {100 * data_parallel['final_test_accuracy']:.1f} % " \
           "(AdamW, one run)" in readme
    for name in ("muon.jsonl", "muon-xeon-amx.jsonl"):  # what each CPU's runs say is on the results page
        for line in plot.optimizer_summary(plot.convergence_runs(json_lines(name))):
            assert line in (ROOT / "lab/README.md").read_text(), line


def readme_accuracies():
    """(the text around it, the figure) of every test-set accuracy the README states: a percentage with a decimal in
    a paragraph or a table row (read with its table's header), not a peer's (airbench's, named just before it)."""
    found = []
    for block in (ROOT / "README.md").read_text().split("\n\n"):
        lines = block.strip().splitlines()
        units = [lines[0] + " " + row for row in lines[2:]] if lines and lines[0].startswith("|") else \
            [" ".join(block.split())]
        for unit in units:
            for match in re.finditer(r"(\d+\.\d+)( ± [\d.]+)? %", unit):
                if "airbench" not in unit[max(0, match.start() - 90):match.start()]:
                    found.append((unit, match[0]))
    return found


def test_the_readme_gives_every_accuracy_of_ours_with_its_spread_and_n_or_as_one_run():
    accuracies = readme_accuracies()
    assert len(accuracies) >= 5
    bare = [(figure, text[:160]) for text, figure in accuracies
            if not ("±" in figure and re.search(r"\bn = \d", text)) and "one run" not in text]
    assert bare == []


def test_the_accuracy_check_catches_a_bare_figure(monkeypatch, tmp_path):
    (tmp_path / "README.md").write_text("opt5 reached 90.44 % on the H200.\n\nairbench94: 90.65 % a run.\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    assert readme_accuracies() == [("opt5 reached 90.44 % on the H200.", "90.44 %")]


def test_results_page_tables_are_plots_from_the_data():
    results_page = (ROOT / "lab/README.md").read_text()
    gpu_tables = []  # each script's newest rows on the H200, the chain at 38c59a9, and before the whole step
    for paths in (plot.GPU_RUNS, plot.GPU_RUNS[1:], plot.GPU_RUNS_BEFORE):
        gpu = plot.gpu_runs([ROOT / path for path in paths])
        gpu_tables += [f"{plot.gpu_words(gpu)}:", *plot.gpu_table(gpu).splitlines()]
    for line in [*gpu_tables, *plot.recipe_table(json_lines("recipe.jsonl")),
                 *plot.recipe_summary(json_lines("recipe.jsonl")), *plot.screen_table(json_lines("screen.jsonl"))]:
        assert line in results_page, line
    runs = {run["script"]: run for run in json_lines("chain-5-epochs.jsonl") if run["data"] == "cifar10"}
    for script, run in runs.items():
        accuracies = " | ".join(f"{100 * epoch['test_accuracy']:.1f}" for epoch in run["epochs"])
        assert f"| `{script}` | {accuracies} |" in results_page, script
    # The convergence table and the ablation's, the curves' table, what they and the seeds say, and what extra
    # test-time views buy, are plot.py's from the timed runs.
    ladder = [line for line in json_lines("ladder.jsonl") if line.get("benchmark") == "ladder"][-1]
    convergence = plot.convergence_runs(json_lines("convergence.jsonl"))
    curve, seeds = plot.convergence_runs(json_lines("curve.jsonl")), plot.convergence_runs(json_lines("seeds.jsonl"))
    ablation_rows = plot.ablation_rows(json_lines("ablation.jsonl"))
    tables = plot.markdown_tables(list(runs.values()), ladder, convergence, curve, seeds, ablation_rows).split("\n\n")
    assert {run["script"] for run in convergence} == {run["script"] for run in curve} == {"opt4.py", "opt5.py"}
    assert [row["row"] for row in ablation_rows] == ablation.ROW_NAMES[:9], "ablation.py's rows of then, in order"
    for line in "\n".join(tables[2:]).splitlines():
        assert line in results_page, line
    others = list(curve + seeds)
    for name in ("muon.jsonl", "muon-xeon-amx.jsonl"):
        muon = plot.convergence_runs(json_lines(name))
        others += muon
        for line in plot.timed_runs_table(muon, plot.opt4_default_minutes(muon)):
            assert line in results_page, line
    # the recipe's curve (after opt4's reference run) and its ablation
    recipe = json_lines("recipe.jsonl")
    for line in [*plot.recipe_curve(recipe, others), *plot.recipe_ablation(recipe)]:
        assert line in results_page, line


def test_the_setup_table_names_tests_that_exist_for_every_row():
    page = (ROOT / "docs/machines.md").read_text()
    section = page[page.index("## The setups"):page.index("## On a GPU")]
    rows = [line.split("|")[1:-1] for line in section.splitlines() if line.startswith("| ")][1:]  # not the header
    assert len(rows) == 11
    chain_tests = [path.read_text() for path in [*ROOT.glob("test_*.py"), *ROOT.glob("lab/test_*.py")]]
    tests = {name for text in chain_tests for name in re.findall(r"^def (test_\w+)", text, re.MULTILINE)}
    markers = {marker for text in chain_tests for marker in re.findall(r"pytest\.mark\.(\w+)", text)}
    for cells in rows:
        names = re.findall(r"`([^`]+)`", cells[-1])
        assert names, f"no test named for {cells[0]!r}"
        for name in names:
            if name.startswith("-m "):  # a marker: some test carries it
                assert name[3:] in markers, name
            else:
                assert any(name in test for test in tests), f"no test matches {name!r} ({cells[0]!r})"
