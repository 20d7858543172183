"""`--compile` at a toy size: one graph for training and one for evaluation, no recompile, no graph break; the default
path compiles nothing; the eager step launches the same ops every step (counted by lab/eager_ops.py). Slow on a CPU:
inductor compiles."""
import collections
import contextlib
import io
import statistics
import sys

import pytest
import torch

import root  # noqa: F401  (first: the repository's root on sys.path, for the scripts and common.py)
import common  # noqa: E402
import eager_ops  # noqa: E402
from conftest import ALL_SCRIPTS, CPU, SMALL, WHOLE_STEP, plan_the_epoch, read_json, small_net, step_of  # noqa: E402


# ------------------------------------------------------------ --compile: one graph, no recompile, no graph break

def compiled_run(script, flags, folder):
    """`script`'s main() compiled, in this process; returns the dynamo counters and the line printed after each
    epoch, and the report. For opt4, from epoch 2 on a recompile is an error (the compiler's fail_on_recompile
    stance), so a value baked into a graph (a learning rate, a step count) fails the run."""
    from torch._dynamo.utils import counters
    torch._dynamo.reset()
    counters.clear()
    after_each_epoch, real_record_epoch = [], common.record_epoch

    def record_epoch(*args, **kwargs):
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            real_record_epoch(*args, **kwargs)
        after_each_epoch.append({"graphs": counters["stats"]["unique_graphs"], "frames": sum(counters["frames"].values()),
                                 "graph_breaks": sum(counters["graph_break"].values()), "line": printed.getvalue()})
        # warm from here on (opt5 compiles again at each new image size; its test counts the graphs instead)
        torch.compiler.set_stance("fail_on_recompile" if script == "opt4.py" else "default")

    json_path = folder / "result.json"
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(common, "record_epoch", record_epoch)
        # 40 test images in batches of 16: the evaluation ends on a partial batch.
        patch.setattr(sys, "argv", [script, *SMALL, "--train-size", "96", "--batch-size", "16", "--test-size", "40",
                                    *flags, "--json", str(json_path)])
        try:
            ALL_SCRIPTS[script].main()
        finally:
            torch.compiler.set_stance("default")
    return after_each_epoch, read_json(json_path)


@pytest.fixture(scope="module")
def compiled_opt4_run(tmp_path_factory):
    return compiled_run("opt4.py", ["--epochs", "3", "--compile"], tmp_path_factory.mktemp("opt4"))


@pytest.fixture(scope="module")
def eager_opt4_run(tmp_path_factory):
    """opt4 at its defaults (uncompiled: on a GPU its step is then captured), with a trace of its last epoch."""
    folder = tmp_path_factory.mktemp("opt4-eager")
    flags = ["--epochs", "2", "--profile", str(folder / "trace")]
    return (*compiled_run("opt4.py", flags, folder), folder / "trace")


def test_opt4_compiles_its_model_once_for_training_and_once_for_evaluation_and_never_recompiles(compiled_opt4_run):
    after_each_epoch, report = compiled_opt4_run
    assert report["settings"]["compile"] and len(after_each_epoch) == 3
    # fail_on_recompile from epoch 2 on, while the learning rate changes at every step: the run ended. Only the model
    # is compiled (its training graph, and its evaluation graph: the partial last test batch is padded to one shape),
    # with no graph break; later epochs reuse both graphs of epoch 1
    assert [epoch["graph_breaks"] for epoch in after_each_epoch] == [0, 0, 0]
    assert [epoch["graphs"] for epoch in after_each_epoch] == [2, 2, 2]


@pytest.mark.parametrize("default_run", ["eager_opt4_run", "eager_opt5_run"])  # opt6 runs opt5's step
def test_the_default_path_compiles_nothing(default_run, request):
    # On a GPU the step is captured uncompiled; Dynamo's counters (cleared first) see every frame it would compile
    after_each_epoch, report, _ = request.getfixturevalue(default_run)
    assert report["settings"]["compile"] is False and len(after_each_epoch) == 2
    assert [(epoch["frames"], epoch["graphs"]) for epoch in after_each_epoch] == [(0, 0), (0, 0)]


def eager_ops_per_step(trace_folder):
    """Kernel-launching ops each traced training step runs outside compiled code, from a --profile trace, by the rule
    of lab/eager_ops.py (the counter the results page uses). Returns each step's count and its ops by name."""
    steps, counted = eager_ops.counted_ops(eager_ops.complete_events(eager_ops.trace_file(str(trace_folder))))
    by_step = [collections.Counter(op["name"] for op in counted if eager_ops.within(op, step)) for step in steps]
    return [sum(names.values()) for names in by_step], by_step


def test_opt4_eager_step_launches_the_same_ops_every_step(eager_opt4_run):
    # What a CUDA graph records once and replays: the step must be the same work every time, nothing decided on the
    # host per step. On a GPU the whole of it is one graph launch; here, traced eagerly, each op is counted
    per_step, names = eager_ops_per_step(eager_opt4_run[2])
    print(f"opt4, torch {torch.__version__}: {statistics.mean(per_step):.0f} kernel-launching ops a step, "
          f"uncompiled: {names[0]}")
    assert len(per_step) == 3 and all(counted == names[0] for counted in names) and per_step[0] > 50


@pytest.mark.parametrize("script", ["opt1.py", "opt2.py"])
def test_opt1_and_opt2_compile_one_graph_for_training_and_one_for_evaluation(script, tmp_path):
    # 40 test images in batches of 16: unpadded, the last batch of 8 would compile a third graph.
    after_each_epoch, report = compiled_run(script, ["--epochs", "2"], tmp_path)
    assert report["settings"]["compile"]
    assert [epoch["graph_breaks"] for epoch in after_each_epoch] == [0, 0]
    assert [epoch["graphs"] for epoch in after_each_epoch] == [2, 2]


@pytest.fixture(scope="module")
def compiled_opt5_run(tmp_path_factory):
    # --min-size 8 over 7 epochs, one at the full size: 8, 8, 16, 16, 24, 24, 32, as many sizes as any flags give
    with pytest.MonkeyPatch.context() as patch:
        # Past torch's recompile_limit, dynamo would run the frame eager with a warning: make it an error here.
        patch.setattr(torch._dynamo.config, "fail_on_recompile_limit_hit", True)
        return compiled_run("opt5.py", ["--epochs", "7", "--min-size", "8", "--full-size-share", "0", "--compile"],
                            tmp_path_factory.mktemp("opt5"))


@pytest.fixture(scope="module")
def eager_opt5_run(tmp_path_factory):
    """opt5 at its defaults (uncompiled), with a trace of its last epoch, at 32x32."""
    folder = tmp_path_factory.mktemp("opt5-eager")
    flags = ["--epochs", "2", "--min-size", "24", "--profile", str(folder / "trace")]
    return (*compiled_run("opt5.py", flags, folder), folder / "trace")


def test_opt5_compiles_its_model_once_per_image_size_evaluates_eagerly_and_stays_under_the_recompile_limit(
        compiled_opt5_run):
    after_each_epoch, report = compiled_opt5_run
    assert [epoch["image_size"] for epoch in report["epochs"]] == [8, 8, 16, 16, 24, 24, 32]
    assert [epoch["graph_breaks"] for epoch in after_each_epoch] == [0] * 7
    # The model's training graph at each new size, and nothing for the evaluation (40 test images in batches of 16,
    # so two shapes a size); a second epoch at a size reuses it
    graphs = [epoch["graphs"] for epoch in after_each_epoch]
    assert graphs == [1, 1, 2, 2, 3, 3, 4], graphs
    assert graphs[-1] <= torch._dynamo.config.recompile_limit
    # Each epoch that compiled says so, not only the first.
    warm_up = ["(includes warm-up, and compiling where on)" in epoch["line"] for epoch in after_each_epoch]
    assert warm_up == [True, False, True, False, True, False, True], warm_up


def test_opt5_with_muon_launches_the_same_ops_every_step(eager_opt5_run, eager_opt4_run):
    per_step, names = eager_ops_per_step(eager_opt5_run[2])
    opt4_ops = statistics.mean(eager_ops_per_step(eager_opt4_run[2])[0])
    print(f"opt5 (Muon), torch {torch.__version__}: {statistics.mean(per_step):.0f} kernel-launching ops a step, "
          f"uncompiled (opt4: {opt4_ops:.0f}): {names[0]}")
    assert eager_opt5_run[1]["settings"]["optimizer"] == "muon"
    assert len(per_step) == 3 and all(counted == names[0] for counted in names) and per_step[0] > opt4_ops


@pytest.mark.parametrize("script", WHOLE_STEP)
def test_the_compiled_step_computes_what_the_step_run_eagerly_does_in_float32(script, monkeypatch):
    monkeypatch.setattr(torch, "autocast", lambda *args, **kwargs: contextlib.nullcontext())  # float32
    dataset = common.synthetic_cifar10(128, train=True, transform=None)

    def after_two_epochs(compiled):
        run, step = step_of(script, small_net(), dataset, CPU, compiled=compiled)
        for epoch in (1, 2):
            plan_the_epoch(ALL_SCRIPTS[script], run, 128, epoch)
            for _ in range(len(run.plan.rates)):
                step()
        return torch.nn.utils.parameters_to_vector(run.model.parameters()).detach(), run.plan.losses

    (compiled, compiled_losses), (eager, eager_losses) = after_two_epochs(True), after_two_epochs(False)
    moved = (eager - torch.nn.utils.parameters_to_vector(small_net().parameters())).norm()
    # 8 steps apart by rounding only (the compiled kernels sum in another order): Adam's step is about the rate for
    # any gradient not near 0, so a gradient within rounding of 0 can step either way; bounded by 1 % of the distance
    print(f"{script}: compiled and eager weights {(compiled - eager).norm() / moved:.2e} of the distance moved apart")
    assert (compiled - eager).norm() <= 0.01 * moved and moved > 0.1
    assert torch.allclose(compiled_losses, eager_losses, rtol=1e-4)
