"""lab/plot.py: the figures and the results page's tables, drawn from --json rows."""
import importlib.util
import json
import re
import shutil
import subprocess

import pytest

import root  # noqa: F401  (first: the repository's root on sys.path, for the scripts and common.py)
import ablation  # noqa: E402
import accounting  # noqa: E402
import plot  # noqa: E402
from conftest import ROOT, run_python  # noqa: E402


def test_plot_screen_table_groups_rows_by_seed_against_the_twenty_epoch_mean():
    def screened(row, seed, views, settings):
        epochs = [{"steps": 87, "images": 87 * 512, "image_size": 32, "test_images": 5000}]
        return plot.read_row({"script": "opt5.py", "chain": 2, "row": row, "settings": {
            **plot.RECIPE, "validation": 5000, "seed": seed, **settings}, "epochs": epochs,
            "launch_to_result_seconds": 600.0, "modelled_h200_seconds": 0.0, "2_views": views[0], "6_views": views[1]})
    twelve = {"epochs": 12, "batch_size": 1024}
    lines = plot.screen_table([screened("shipped", 0, (0.90, 0.91), {}),  # the defaults were the recipe's
                               screened("twelve-epochs", 0, (0.89, 0.90), twelve),
                               screened("twenty-epochs", 1, (0.91, 0.92), {}),
                               screened("twelve-epochs", 0, (0.895, 0.90), twelve),  # the last of a seed counts
                               screened("shipped", 2, (0.80, 0.81), twelve)])  # not the recipe: its own row
    rows = {line.split(" | ")[0][2:]: line.split(" | ")[1:] for line in lines[2:]}
    assert list(rows) == ["twenty-epochs", "twelve-epochs", "shipped"]
    assert rows["twenty-epochs"][:4] == ["0, 1", "90.50 (90.00, 91.00)", "+0.00", "91.50"]
    assert rows["twelve-epochs"][:3] == ["0", "89.50 (89.50)", "-1.00"]
    modelled = 87 * accounting.modelled_h200_step_seconds(512, 32, muon=True)
    extra = ablation.modelled_h200_extra_view_seconds(5000, 512)
    assert rows["twenty-epochs"][4] == f"{modelled:.2f} / {modelled + extra:.2f}"
    assert plot.screen_table([screened("shipped", 0, (0.9, 0.9), {"validation": 0})]) == [], "the test set: no"


def test_plot_step_table_takes_the_median_of_the_steady_epochs_at_each_batch_and_size():
    def epoch(images, side, ms):
        return {"steps": 10, "images": 10 * images, "image_size": side, "ms_per_step": ms}
    exact = {(2048, 16): 1.0 + 2048 * 256e-6, (1024, 24): 1.0 + 1024 * 576e-6, (1024, 32): 1.0 + 1024 * 1024e-6}
    rows = [{"epochs": [epoch(2048, 16, 50.0), epoch(2048, 16, exact[2048, 16]), epoch(1024, 24, 60.0),
                        epoch(1024, 24, exact[1024, 24]), epoch(1024, 32, 70.0), epoch(1024, 32, exact[1024, 32]),
                        epoch(1024, 32, exact[1024, 32] + 1)]},
            {"epochs": [epoch(1024, 32, 80.0), epoch(1024, 32, exact[1024, 32] - 1)]}]  # warm-ups: not counted
    assert plot.step_table(rows) == [(1024, 24, exact[1024, 24]), (1024, 32, exact[1024, 32]),
                                     (2048, 16, exact[2048, 16])]
    lines = plot.step_table_lines(rows)
    assert lines[0] == "Fit: 1.000 ms + 1.00 ns per image x pixel a step" and len(lines) == 4 + 3
    assert all(line.endswith(("| +0.000 |", "| -0.000 |")) for line in lines[4:]), "the points lie on a line"
    assert plot.step_table_lines(rows[1:]) == ["1 batch and size points with a steady epoch: a fit needs 2"]


# ------------------------------------------------------------------------------------ plot.py

def write_plot_fixture(folder):
    """Real-data reports, a ladder summary and timed opt4/opt5 runs, as the scripts and benchmark.py write them.

    Every row is of today's numbering ("chain": 2), so plot.py takes its names as they are (the older rows' table
    has its own test). Returns plot.py's flags that read them."""
    def run(script, accuracies):
        epochs = [{"epoch": epoch, "test_accuracy": accuracy, "train_seconds": 60.0}
                  for epoch, accuracy in enumerate(accuracies, start=1)]
        return {"script": script, "chain": 2, "data": "cifar10", "device": "cpu", "cpu": "Test CPU (AMX)",
                "threads": 2, "torch": "2.14.1", "steady_images_per_second": 100.0, "epochs": epochs}

    runs = [run("baseline.py", [0.4, 0.5]), run("opt4.py", [0.6, 0.8]), {**run("opt4.py", [0.1]), "data": "synthetic"}]
    rows = [{"name": name, "images_per_second": speed, "tflops": speed * 1.5e9 / 1e12, "ms_per_step": 1000.0,
             "warmup_seconds": 0.5, "peak_memory_gib": 1.0, "percent_of_bf16_peak": speed * 1.5e9 / 1.2e12 * 100}
            for name, speed in [("baseline", 100.0), ("opt4", 300.0)]]
    ladder = {"benchmark": "ladder", "chain": 2, "machine": "Test CPU (AMX)", "threads": 2, "bf16_peak_tflops": 1.2,
              "rows": rows}

    def timed_run(script, flags, sizes, launch_minutes, accuracy, seed=0, optimizer=None, cpu="Test CPU (AMX)",
                  **settings):
        epochs = [{"epoch": epoch, "test_accuracy": accuracy, "launch_seconds": 60 * minutes, "image_size": size,
                   "ms_per_step": size * (10 if optimizer == "muon" else 8), "steps": 390, "images": 50_000}
                  for epoch, (size, minutes) in enumerate(zip(sizes, launch_minutes), start=1)]
        settings = {"seed": seed, **({"optimizer": optimizer} if optimizer else {}), **settings}
        return {"script": script, "chain": 2, "data": "cifar10", "cpu": cpu, "threads": 2,
                "final_test_accuracy": accuracy, "settings": settings,
                "command": f"python {script} {flags} --data-dir /tmp/cifar10 --json results/convergence.jsonl",
                "launch_to_result_seconds": epochs[-1]["launch_seconds"], "epochs": epochs}

    convergence = [timed_run("opt4.py", "--epochs 2", [32, 32], [10.0, 20.0], 0.8),
                   timed_run("opt4.py", "--epochs 2 --seed 1", [32, 32], [11.0, 22.0], 0.8),
                   timed_run("opt5.py", "--epochs 2 --seed 1", [16, 32], [4.0, 10.5], 0.825)]
    # opt4 at --epochs 2 and 5, opt5 at 5 and 6, in the order a sitting might run them
    curve = [timed_run("opt5.py", "--epochs 6", [16, 16, 16, 24, 24, 32], [2, 4, 6, 10, 14, 18.0], 0.86),
             timed_run("opt4.py", "--epochs 2", [32] * 2, [5, 10.0], 0.75),
             timed_run("opt5.py", "--epochs 5", [16, 16, 24, 24, 32], [2, 4, 7, 10, 15.0], 0.82),
             timed_run("opt4.py", "--epochs 5", [32] * 5, [5, 10, 15, 20, 25.0], 0.85)]
    seeds = [timed_run("opt4.py", "--epochs 5 --seed 1", [32] * 5, [5, 10, 15, 20, 26.0], 0.84, seed=1),
             timed_run("opt5.py", "--epochs 5 --seed 1", [16, 16, 24, 24, 32], [2, 4, 7, 10, 15.0], 0.83, seed=1),
             timed_run("opt4.py", "--epochs 4 --seed 1", [32] * 4, [5, 10, 15, 20.0], 0.8, seed=1)]

    # One CPU: opt4 at its default; opt5 with AdamW (one run from before --optimizer: AdamW) and with Muon (from
    # before --ns-steps: 5 steps)
    muon = [timed_run("opt4.py", "--epochs 5", [32] * 5, [5, 10, 15, 20, 25.0], 0.85),
            timed_run("opt5.py", "--epochs 5", [16, 16, 24, 24, 32], [2, 4, 7, 10, 15.0], 0.82),
            timed_run("opt5.py", "--epochs 6", [16, 16, 24, 24, 32, 32], [2, 4, 7, 10, 15, 20.0], 0.84,
                      optimizer="adamw"),
            timed_run("opt5.py", "--epochs 4", [16, 16, 24, 32], [2.5, 5, 9, 16.0], 0.845, optimizer="muon"),
            timed_run("opt5.py", "--epochs 5", [16, 16, 24, 24, 32], [2.5, 5, 9, 13, 18.0], 0.865, optimizer="muon")]
    # Another: Muon with 3 steps at --epochs 4 and AdamW at 5, three seeds each
    other = {"cpu": "Other CPU (AVX-512 BF16)"}
    muon_other_cpu = [timed_run("opt4.py", "--epochs 5", [32] * 5, [4, 8, 12, 16, 20.0], 0.85, **other)]
    for seed, (muon_minutes, muon_accuracy, adamw_minutes, adamw_accuracy) in enumerate(
            [(12.0, 0.853, 12.6, 0.835), (12.5, 0.856, 12.9, 0.838), (13.0, 0.850, 13.2, 0.832)]):
        muon_other_cpu += [
            timed_run("opt5.py", f"--epochs 4 --seed {seed}", [16, 16, 24, 32], [2, 4, 8, muon_minutes],
                      muon_accuracy, seed=seed, optimizer="muon", ns_steps=3, **other),
            timed_run("opt5.py", f"--epochs 5 --seed {seed} --optimizer adamw", [16, 16, 24, 24, 32],
                      [2, 4, 7, 10, adamw_minutes], adamw_accuracy, seed=seed, optimizer="adamw", **other)]

    def ablation_row(row, change, views, monitor, synthetic=False):
        epochs = [{"test_accuracy": monitor, "test_images": 1000}, {"test_accuracy": views[1], "test_images": 10000}]
        return {"row": row, "chain": 2, "change": change, "data": "synthetic" if synthetic else "cifar10",
                "epochs": epochs,
                "1_view": views[0], "2_views": views[1], "6_views": views[2], "extra_view_seconds": 60.0,
                "launch_to_result_seconds": 900.0}

    ablation = [ablation_row("shipped", "opt5 as shipped", [0.81, 0.82, 0.83], 0.6),
                ablation_row("ema", "EMA of the weights", [0.8, 0.81, 0.82], 0.55),
                ablation_row("ema", "EMA of the weights", [0.1, 0.1, 0.1], 0.1, synthetic=True)]
    def gpu_run(script, flags, images_per_second, accuracy, sizes=(None,) * 3):
        epochs = [{"train_seconds": 5.0 if epoch == 1 else 1.0, "images": 50_000, "steps": 390, "image_size": size,
                   "test_accuracy": accuracy} for epoch, size in enumerate(sizes, start=1)]
        steady = images_per_second if sizes[0] is None else None
        return {"script": script, "chain": 2, "data": "cifar10", "device": "cuda", "device_name": "Test GPU",
                "threads": 16,
                "cpu": "Test CPU (AMX)", "torch": "2.11.0", "final_test_accuracy": accuracy,
                "command": f"python {script} {flags} --epochs 5 --data-dir /tmp/c10 --device cuda --json gpu.jsonl",
                "steady_images_per_second": steady, "steady_ms_per_step": steady and 6.4e4 / steady,
                "total_seconds": 20.0, "launch_to_result_seconds": 30.0, "peak_memory_bytes": 2**30,
                "settings": {"batch_size": 64 if script == "baseline.py" else 128}, "epochs": epochs}

    # Three runs on a GPU, before rows recorded their commit (its folder's name has it), the first run last; then
    # two at a newer commit, one of them twice (the later row counts), whose opt4 replaces the older one's
    (folder / "gpu-abc1234").mkdir()
    gpu = [gpu_run("opt4.py", "", 40_000.0, 0.85), gpu_run("baseline.py", "", 5_000.0, 0.75),
           gpu_run("opt5.py", "--optimizer adamw", None, 0.84, sizes=(16, 16, 32)),
           {**gpu_run("opt4.py", "", 1.0, 0.1), "data": "synthetic"}]
    (folder / "gpu-abc1234" / "chain.jsonl").write_text("".join(json.dumps(line) + "\n" for line in gpu))
    (folder / "gpu-def5678").mkdir()
    newer = [{**gpu_run("opt4.py", "", 64_000.0, 0.86), "date": "2026-11-28T05:00:00", "commit": "def5678"},
             {**gpu_run("opt3.py", "", 16_000.0, 0.83), "date": "2026-11-28T04:00:00", "commit": "def5678"},
             {**gpu_run("opt4.py", "", 2.0, 0.2), "date": "2026-11-28T04:30:00", "commit": "def5678"}]
    (folder / "gpu-def5678" / "chain.jsonl").write_text("".join(json.dumps(line) + "\n" for line in newer))
    recipe = [{**timed_run("opt5.py", "--epochs 3 --batch-size 512 --validation 5000", [16, 16, 32], [5, 10, 30.0],
                           0.9, validation=5000), "training_flops": 2.5e15, "modelled_h200_seconds": 1.234},
              {**timed_run("opt5.py", "--epochs 2", [16, 32], [5, 12.0], 0.85, validation=0),
               "training_flops": 1e15, "modelled_h200_seconds": 0.5}]
    # opt5's defaults, scored on the test set (seeds 1 and 0), on the held-out images, and on part of the test set
    for seed, validation, accuracy in [(1, 0, 0.905), (0, 0, 0.9), (0, 5000, 0.95), (2, 0, 0.5)]:
        recipe.append({**timed_run("opt5.py", f"--seed {seed}", [16, 16, 32], [5, 10, 30.0], accuracy, seed=seed,
                                   validation=validation, **plot.RECIPE),
                       "training_flops": 2.5e15, "modelled_h200_seconds": 4.08})
    for run, test_images in zip(recipe, [5000, 10000, 10000, 10000, 5000, 1000]):
        run["epochs"][-1]["test_images"] = test_images
        for record in run["epochs"]:
            record["steps"] = 390
    # ablation.py's rows: shipped (seed 2: a third seed of the defaults), a row that changes a flag, one that changes
    # code (its settings are the defaults'), a shipped row at 10 epochs (not at the recipe's length); the defaults
    # at 10 epochs, and at 15 on another CPU
    defaults = {**plot.RECIPE, "validation": 0}
    for row, accuracy, settings in [("shipped", 0.91, {}), ("adamw", 0.88, {"optimizer": "adamw"}), ("ema", 0.95, {}),
                                    ("shipped", 0.5, {"epochs": 10, "seed": 3})]:
        recipe.append({**timed_run("ablation.py", f"--rows {row} --seed 2", [16, 16, 32], [5, 10, 31.0], accuracy,
                                   **{**defaults, "seed": 2, **settings}), "script": "opt5.py", "row": row,
                       "change": f"{row} instead", "1_view": accuracy - 0.01, "2_views": accuracy,
                       "6_views": accuracy + 0.002, "training_flops": 2.5e15, "modelled_h200_seconds": 4.08})
    recipe += [{**timed_run("opt5.py", f"--epochs {epochs} --seed 0", [16, 24, 32], [3, 6, 15.0], 0.88, cpu=cpu,
                            **{**defaults, "epochs": epochs}), "training_flops": 1.2e15, "modelled_h200_seconds": 2.04}
               for epochs, cpu in [(10, "Test CPU (AMX)"), (15, "Other CPU (AVX-512 BF16)")]]
    for run in recipe[-6:]:
        run["epochs"][-1]["test_images"] = 10000
    (folder / "recipe.jsonl").write_text("".join(json.dumps(line) + "\n" for line in recipe))
    for name, lines in (("runs", runs), ("ladder", [ladder]), ("convergence", convergence), ("curve", curve),
                        ("seeds", seeds), ("ablation", ablation), ("muon", muon), ("muon-other-cpu", muon_other_cpu)):
        (folder / f"{name}.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    return ["--gpu", folder / "gpu-def5678" / "chain.jsonl", folder / "gpu-abc1234" / "chain.jsonl",
            "--recipe", folder / "recipe.jsonl",
            "--runs", folder / "runs.jsonl",
            "--ladder", folder / "ladder.jsonl",
            "--convergence", folder / "convergence.jsonl", "--curve", folder / "curve.jsonl",
            "--seeds", folder / "seeds.jsonl", "--ablation", folder / "ablation.jsonl",
            "--muon", folder / "muon.jsonl", folder / "muon-other-cpu.jsonl"]


@pytest.fixture(scope="module")
def tables(tmp_path_factory):
    """What `plot.py --tables` prints for the fixture's data (run once: each run counts Muon's FLOPs)."""
    result = run_python("lab/plot.py", "--tables", *write_plot_fixture(tmp_path_factory.mktemp("plot")))
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_plot_draws_the_figures_from_json_lines(tmp_path):
    pytest.importorskip("matplotlib", reason="plot.py needs matplotlib (pip install -r requirements-dev.txt)")
    data = write_plot_fixture(tmp_path)
    gpu, cpu = tmp_path / "figure.png", tmp_path / "cpu.png"
    result = run_python("lab/plot.py", *data, "--out", gpu, "--cpu-out", cpu)
    assert result.returncode == 0, result.stderr
    for out in (gpu, cpu):
        assert out.read_bytes().startswith(b"\x89PNG") and 10_000 < out.stat().st_size < 200_000


def modelled(sizes, muon):
    """The H200 model over a plot fixture run's epochs at `sizes` (390 steps of 50,000 images each), whatever the row
    stores: plot.py recomputes it (the model itself has its own test)."""
    return f"{sum(390 * accounting.modelled_h200_step_seconds(50_000 / 390, size, muon) for size in sizes):.2f}"


def test_plot_tables_the_recipe_runs_with_their_work_and_what_scored_them(tables):
    # the validation run: 3 epochs of 390 steps (the fixture's), its sizes counted, scored on the held-out images
    assert f"| `--epochs 3 --batch-size 512 --validation 5000` | 16 x2, 32 x1 | 1170 | 2.50 | " \
           f"{modelled([16, 16, 32], muon=False)} | validation (5,000) | 90.00 | 30.0 |" in tables
    assert f"| `--epochs 2` | 16 x1, 32 x1 | 780 | 1.00 | {modelled([16, 32], muon=False)} | test (10,000) | 85.00 " \
           "| 12.0 |" in tables
    # opt5's defaults on the whole test set: seeds 0 and 1, not the held-out run or the one on 1,000 test images
    # opt5's defaults on the whole test set: seeds 0 and 1 of opt5.py and ablation.py's shipped row (seed 2), not
    # its other rows (the ema row's settings are the defaults'), the held-out run or the one on 1,000 test images
    assert "opt5's defaults (the recipe) on the test set: **90.50 %**, the mean of 3 seeds (0, 1, 2: 90.00, 90.50, " \
           f"91.00), in {modelled([16, 16, 32], muon=True)} modelled H200 seconds" in tables


def test_plot_tables_the_recipes_curve_after_opt4s_reference_run_on_the_same_cpu(tables):
    curve = tables[tables.index("The recipe's curve:"):].split("\n\n")[1].splitlines()
    # opt4 --epochs 5 on the CPU of the recipe's runs, the last run of each seed (seed 0 is in two files), not its
    # --epochs 2 or another CPU's; its work counted as opt5 counts its own
    records = [{"steps": 390, "images": 50_000, "image_size": 32}] * 5
    work = accounting.count_work([dict(record) for record in records], 0, muon=False)
    assert curve[2:] == [
        f"| opt4 `--epochs 5` (reference) | 32 x5 | 0, 1 | 84.50 (85.00, 84.00) | 1950 "
        f"| {work['training_flops'] / 1e15:.2f} | {work['modelled_h200_seconds']:.2f} | 25.5 |",
        f"| opt5 `--epochs 10` | 16 x1, 24 x1, 32 x1 | 0, 3 | 69.00 (88.00, 50.00) | 1170 | 1.20 "
        f"| {modelled([16, 24, 32], muon=True)} | 23.0 |",
        f"| opt5 `--epochs 20` (default) | 16 x2, 32 x1 | 0, 1, 2 | 90.50 (90.00, 90.50, 91.00) | 1170 | 2.50 "
        f"| {modelled([16, 16, 32], muon=True)} | 30.3 |"]  # the 15-epoch run is the other CPU's


def test_plot_tables_the_recipes_ablation_rows_against_the_mean_of_its_seeds(tables):
    rows = tables[tables.index("The recipe's ablation:"):].split("\n\n")[1].splitlines()[2:]
    muon, adamw = modelled([16, 16, 32], muon=True), modelled([16, 16, 32], muon=False)
    assert rows == [f"| shipped | shipped instead | 2 | 91.00 | +0.50 | 90.00 | 91.20 | {muon} | 31.0 |",
                    f"| adamw | adamw instead | 2 | 88.00 | -2.50 | 87.00 | 88.20 | {adamw} | 31.0 |",
                    f"| ema | ema instead | 2 | 95.00 | +4.50 | 94.00 | 95.20 | {muon} | 31.0 |"]


def test_plot_tables_the_gpu_runs_in_the_chains_order_with_their_commit(tables):
    """The newest row of each script: a newer file's (its latest by date) before an older file's, each with its
    folder's commit, in the chain's order."""
    assert "Test GPU, 16 threads of an Test CPU (AMX), torch 2.11.0, commits abc1234 (baseline, opt5), " \
           "def5678 (opt3, opt4):" in tables
    assert "| baseline.py | 5,000 | 1.00x | 12.8 (64) | 75.00 | 30.0 | 5.0 | 10.0 | 1.00 | abc1234 |" in tables
    assert "| opt3.py | 16,000 | 3.20x | 4.0 (128) | 83.00 | 30.0 | 5.0 | 10.0 | 1.00 | def5678 |" in tables
    assert "| opt4.py | 64,000 | 12.80x | 1.0 (128) | 86.00 | 30.0 | 5.0 | 10.0 | 1.00 | def5678 |" in tables
    assert "| opt5.py --optimizer adamw | 50,000 at 16 px | - | 2.6 at 16 px (128) | 84.00 |" in tables
    assert "| opt4.py | 40,000 |" not in tables and "| opt4.py | 2 |" not in tables, \
        "the older file's opt4 and the newer file's earlier row: left out"
    assert tables.index("| baseline.py |") < tables.index("| opt3.py |") < tables.index("| opt4.py |") < \
        tables.index("| opt5.py --optimizer")
    assert "| peak memory GiB | commit |" in tables


def test_plot_draws_and_tables_a_ladder_from_a_cpu_without_a_bfloat16_unit(tmp_path):
    pytest.importorskip("matplotlib", reason="plot.py needs matplotlib (pip install -r requirements-dev.txt)")
    data = write_plot_fixture(tmp_path)
    ladder = json.loads((tmp_path / "ladder.jsonl").read_text())
    ladder.update(bf16_peak_tflops=None, float32_peak_tflops=0.18)  # what benchmark.py writes on such a CPU
    ladder["rows"] = [{**row, "percent_of_bf16_peak": None} for row in ladder["rows"]]
    (tmp_path / "ladder.jsonl").write_text(json.dumps(ladder) + "\n")
    tables = run_python("lab/plot.py", "--tables", *data)
    assert tables.returncode == 0, tables.stderr
    assert "| opt4 | 300 | 1000.0 | 0.5 | 1.00 | 0.450 | n/a |" in tables.stdout
    assert run_python("lab/plot.py", *data, "--out", tmp_path / "figure.png", "--cpu-out", tmp_path / "cpu.png"
                      ).returncode == 0


def test_plot_tables_print_the_latest_real_data_run_of_each_script(tables):
    assert "| `baseline.py` | 40.0 | 50.0 | 2.0 | 100 |" in tables
    assert "| `opt4.py` | 60.0 | 80.0 | 2.0 | 100 |" in tables  # the synthetic run is not the data
    assert "| opt4 | 300 | 1000.0 | 0.5 | 1.00 | 0.450 | 38 |" in tables
    # Each timed run against the mean of opt4's (21 minutes); the flags without the data and JSON paths
    assert "| `opt4.py` | `--epochs 2` | 32, 32 | 80.0 | 20.0 | 95% |" in tables
    assert "| `opt5.py` | `--epochs 2 --seed 1` | 16, 32 | 82.5 | 10.5 | 50% |" in tables


def test_plot_reads_opt5_against_opt4_at_equal_time_off_the_curves(tables):
    # Each curve run against opt4 --epochs 5 (25 minutes)
    assert "| `opt5.py` | `--epochs 6` | 16, 16, 16, 24, 24, 32 | 86.0 | 18.0 | 72% |" in tables
    # opt4 at opt5's 15 minutes: 75 + (85 - 75) x (15 - 10) / (25 - 10) = 78.3 %
    assert "opt5 reaches 82.0 % in 15.0 min; opt4 trained for the same time: 78.3 % (interpolated), so opt5 is " \
           "+3.7 points ahead." in tables
    # 85 % on opt5's curve: 15 + (18 - 15) x (85 - 82) / (86 - 82) = 17.25 minutes, 69 % of opt4's 25
    assert "opt5 reaches opt4's `--epochs 5` accuracy (85.0 % in 25.0 min) at 17.2 min (interpolated): 69% of " \
           "opt4's time." in tables


def test_plot_gives_each_scripts_seeds_their_mean_and_spread_and_reads_opt4s_mean_off_opt5s_curve(tables):
    # Only runs at --epochs 5 count: opt4 85 (seed 0) and 84 (seed 1), opt5 82 and 83
    assert "- At `--epochs 5`: opt4 85.00, 84.00 % (seeds 0, 1: mean 84.50, spread 1.00 points); opt5 82.00, " \
           "83.00 % (seeds 0, 1: mean 82.50, spread 1.00 points)." in tables
    # 84.5 % on opt5's seed-0 curve: 15 + (18 - 15) x (84.5 - 82) / (86 - 82) = 16.9 minutes, 68 % of opt4's 25
    assert "- opt5's seed-0 curve reaches opt4's mean (84.50 %) at 16.9 min (interpolated): 68% of opt4's seed-0 " \
           "time." in tables


def test_plot_tables_the_ablation_against_the_shipped_row_and_extra_views_against_training(tables):
    assert "| shipped | opt5 as shipped | 82.00 | +0.00 | 81.00 | 83.00 | 15.0 | 60 | 60.0 (1000) |" in tables
    assert "| ema | EMA of the weights | 81.00 | -1.00 | 80.00 | 82.00 | 15.0 | 60 | 55.0 (1000) |" in tables
    # 60 s more training from opt5 --epochs 5 (82 % at 15 min) on its curve to --epochs 6 (86 % at 18 min): +1.3
    assert "add +1.0 points to opt5 as shipped for 60 s; the same seconds spent training: +1.3 points" \
        in tables


def test_plot_curve_summary_says_what_the_curves_do_not_reach():
    def run(script, minutes, accuracy, epochs):
        return {"script": script, "launch_to_result_seconds": 60 * minutes, "final_test_accuracy": accuracy,
                "epochs": [{}] * epochs}

    slow_opt4 = [run("opt4.py", 20.0, 0.8, 4), run("opt4.py", 25.0, 0.85, 5)]
    low_opt5 = [run("opt5.py", 12.0, 0.8, 5), run("opt5.py", 15.0, 0.83, 6)]
    first, second = plot.curve_summary(slow_opt4 + low_opt5)
    assert "opt4's curve (20.0-25.0 min) does not span that time" in first
    assert "opt5 does not reach opt4's `--epochs 5` accuracy (85.0 % in 25.0 min) within its runs (up to " \
           "`--epochs 6`)" in second
    assert plot.curve_summary(low_opt5) == ["Curve summary: not measured (it needs opt4 and opt5 at --epochs 5)."]


def test_plot_reads_muon_against_adamw_at_equal_time_and_the_cost_of_its_step(tables):
    # Muon's 4 epochs end at 16 min, between AdamW's 5 (15 min, 82 %) and 6 (20 min, 84 %): 82.4 % there
    assert "- Muon, `--epochs 4`, seed 0: 84.5 % in 16.0 min; AdamW at the same time: 82.4 % (interpolated): " \
           "+2.1 points." in tables
    assert "- Muon, `--epochs 5`, seed 0: 86.5 % in 18.0 min; AdamW at the same time: 83.2 % (interpolated): " \
           "+3.3 points." in tables
    # opt4's 85 % in 25 min: on Muon's curve between 16 min (84.5 %) and 18 min (86.5 %)
    assert "- Muon reaches opt4's `--epochs 5` accuracy (85.0 % in 25.0 min) at 16.5 min (interpolated): 66% of " \
           "opt4's time." in tables
    # ms per step at each size from each optimizer's longest run; the update's FLOPs counted by torch
    assert "16x16: 128 and 160 ms (Muon's update 20% of its step); 24x24: 192 and 240 ms" in tables
    flops = re.findall(r"Muon's update with (\d) Newton-Schulz steps: ([\d.]+) GFLOP per step", tables)
    # Newton-Schulz on each of the 12 filters alone (opt5's loop); each step's work is the same
    assert [steps for steps, _ in flops] == ["5", "3"] and float(flops[0][1]) == pytest.approx(45.5, abs=0.1)
    assert float(flops[1][1]) == pytest.approx(45.5 * 3 / 5, rel=0.01)
    assert "the training step's 49 at 16x16, 109 at 24x24, 194 at 32x32 GFLOP" in tables


def test_plot_tables_each_cpus_muon_runs_with_the_seeds_means_at_equal_time(tables):
    first, second = tables.index("Test CPU with AMX, 2 threads (CPU), Muon with 5 Newton-Schulz steps:"), \
        tables.index("Other CPU with AVX-512 BF16, 2 threads (CPU), Muon with 3 Newton-Schulz steps:")
    assert first < second
    other_cpu = tables[second:]
    assert "| `opt5.py` | `--epochs 4 --seed 2` | 16, 16, 24, 32 | 85.0 | 13.0 | 65% |" in other_cpu  # of its opt4's
    assert "- Muon at `--epochs 4`, seeds 0, 1, 2: 85.30, 85.60, 85.00 % (mean 85.30, spread 0.60 points), " \
           "12.5 min on average." in other_cpu
    assert "- AdamW at `--epochs 5`, seeds 0, 1, 2: 83.50, 83.80, 83.20 % (mean 83.50, spread 0.60 points), " \
           "12.9 min on average." in other_cpu
    assert "- Muon at `--epochs 4` against AdamW at `--epochs 5`, the nearest in time, seed means: +1.80 points in " \
           "97% of AdamW's time." in other_cpu
    # Muon's seed-0 run is past opt4's accuracy in 60 % of its time: a run, not a point between two
    assert "- Muon reaches opt4's `--epochs 5` accuracy (85.0 % in 20.0 min) at 12.0 min (its `--epochs 4` run): 60% " \
           "of opt4's time." in other_cpu


def test_plot_without_matplotlib_says_how_to_install_it(tmp_path):
    data = write_plot_fixture(tmp_path)
    hide_matplotlib = "import runpy, sys; sys.modules['matplotlib'] = None; sys.argv = sys.argv[1:]; " \
                      "sys.path.insert(0, 'lab'); runpy.run_path('lab/plot.py', run_name='__main__')"
    result = run_python("-c", hide_matplotlib, "lab/plot.py", *data, "--out", tmp_path / "figure.png",
                        "--cpu-out", tmp_path / "cpu.png")
    assert result.returncode == 2 and result.stderr.count("\n") == 1
    assert "pip install matplotlib" in result.stderr


def test_plot_names_a_missing_data_file(tmp_path):
    result = run_python("lab/plot.py", "--runs", tmp_path / "none.jsonl")
    assert result.returncode == 2 and "none.jsonl" in result.stderr and "Traceback" not in result.stderr


def test_plot_reads_older_rows_by_todays_names_and_diffs_a_script_under_its_name_then(tmp_path):
    older = {"script": "opt3.py", "date": "2026-11-25T10:00:00", "change": "opt4 as shipped"}
    scripts = ["baseline.py", "opt3.py", "opt4.py", "opt5.py"]
    assert [plot.read_row({**older, "script": script})["script"] for script in scripts] == \
        ["baseline.py", "opt4.py", "opt5.py", "opt6.py"]
    assert plot.read_row(older)["ran_as"] == "opt3.py" and plot.read_row(older)["change"] == "opt5 as shipped"
    assert plot.read_row({**older, "script": "opt4.py", "date": "2026-11-23T12:00:00"})["script"] == "opt6.py", \
        "before e8e4e0a opt4.py was the DDP script"
    ladder = plot.read_row({"benchmark": "ladder", "rows": [{"name": "opt3 eager"}, {"name": "opt2, 0 workers"}]})
    assert [row["name"] for row in ladder["rows"]] == ["opt4 eager", "opt2, 0 workers"]
    today = plot.read_row({**older, "chain": 2})
    assert (today["script"], today["change"]) == ("opt3.py", "opt4 as shipped"), "a chain-2 row is taken as it is"

    if shutil.which("git") is None:
        pytest.skip("no git to diff a script against its commit")
    # A commit of the older numbering (opt3.py the captured step, opt4.py the recipe); today both moved up by one,
    # the captured step's report call changed, and a module it called then is gone, its function now common's
    git = ["git", "-c", "user.name=test", "-c", "user.email=test@example.com"]
    subprocess.run([*git, "init", "-q"], cwd=tmp_path, check=True)
    (tmp_path / "opt3.py").write_text("import lab_module_since_dissolved\nstep = 'captured'\n"
                                      "lab_module_since_dissolved.check(run)\nlab_module_since_dissolved.report(run)\n")
    (tmp_path / "opt4.py").write_text("step = 'recipe'\n")
    subprocess.run([*git, "add", "opt3.py", "opt4.py"], cwd=tmp_path, check=True)
    subprocess.run([*git, "commit", "-q", "-m", "older numbering"], cwd=tmp_path, check=True)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=tmp_path, capture_output=True,
                            text=True, check=True).stdout.strip()
    (tmp_path / "opt4.py").write_text("step = 'captured'\ncommon.check(run)\ncommon.report(run, extra={})\n")
    (tmp_path / "opt5.py").write_text("step = 'recipe'\n")
    (tmp_path / "lab").mkdir()  # changed_since reads git and the scripts in the folder above plot.py's
    shutil.copy(ROOT / "lab" / "plot.py", tmp_path / "lab" / "plot.py")
    spec = importlib.util.spec_from_file_location("plot_in_the_older_checkout", tmp_path / "lab" / "plot.py")
    plot_there = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(plot_there)
    assert plot_there.changed_since(commit, {"opt4.py": "opt3.py", "opt5.py": "opt4.py"}) == []
    assert plot_there.changed_since(commit, {"opt4.py": "opt4.py"}) == ["opt4.py"], "the same name then: the recipe"
    old_lines = ["import os", "import lab_module_since_dissolved", "os.x(lab_module_since_dissolved.y)"]
    assert plot_there.as_today(old_lines) == ["import os", "os.x(common.y)"], "os is still there: not read as common"
    assert plot_there.changed_since("0000000", {"opt4.py": "opt3.py"}) is None

    # Runs from two commits: each script against its own run's commit
    subprocess.run([*git, "add", "opt4.py", "opt5.py"], cwd=tmp_path, check=True)
    subprocess.run([*git, "commit", "-q", "-m", "today's numbering"], cwd=tmp_path, check=True)
    newer = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=tmp_path, capture_output=True,
                           text=True, check=True).stdout.strip()
    (tmp_path / "opt5.py").write_text("step = 'recipe, changed'\n")
    runs = {"opt4.py": [{"script": "opt4.py", "ran_as": "opt3.py", "commit": commit}],
            "opt5.py": [{"script": "opt5.py", "ran_as": "opt5.py", "commit": newer}]}
    assert plot_there.changed_since_their_rows(runs) == {commit: [], newer: ["opt5.py"]}
    assert plot_there.changed_since_their_rows({**runs, "opt4.py": [{**runs["opt4.py"][0], "commit": "0000000"}]}) \
        is None


def test_plot_skips_warm_rows(tmp_path):
    rows = [{"script": "opt5.py", "chain": 2, "date": "a"}, {"script": "opt5.py", "chain": 2, "clock": "warm"},
            {"clock": "warm", "summary": True}, {"script": "opt4.py", "chain": 2, "date": "b", "clock": "launch"}]
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    assert [row["date"] for row in plot.read_lines(path)] == ["a", "b"]
