"""lab/ablation.py: each row changes the recipe in what it names, runs in its own process, and scores three ways."""
import contextlib
import functools
import inspect
import json
import re
import shlex
import sys
from types import SimpleNamespace

import pytest
import torch
import torch.nn as nn

import root  # noqa: F401  (first: the repository's root on sys.path, for the scripts and common.py)
import ablation  # noqa: E402
import accounting  # noqa: E402
import common  # noqa: E402
import opt5  # noqa: E402
import plot  # noqa: E402
from conftest import CPU, NO_MONITOR, ROOT, SMALL, bare_plan, drawn_plan, plan_the_epoch, run_python  # noqa: E402


def test_muons_batched_form_steps_resnet10s_filters_as_opt5s_loop_in_float64(monkeypatch):
    # ablation.py's "muon-other-form" row (batched_muon): opt5's Muon step in foreach ops, the orthogonalizations in 5
    # zero-padded batches (a zero column adds nothing to x x^T: the rest is as it would be alone), the same math
    torch.manual_seed(0)
    # every filter shape of ResNet10, channels_last as in the scripts: wide ones, tall ones (the stem, the 1x1
    # shortcuts: their matrices turned wide) and several of one shape
    start = [torch.randn(parameter.shape, dtype=torch.float64).contiguous(memory_format=torch.channels_last)
             for parameter in common.ResNet10().parameters() if parameter.ndim == 4]
    loop_filters, batched_filters = ([nn.Parameter(filter_.clone()) for filter_ in start] for _ in range(2))
    loop_step, batches = opt5.Muon.step, []
    ablation.batched_muon(monkeypatch.setattr)
    assert opt5.Muon.step is not loop_step
    batched_orthogonalize = ablation.batched_orthogonalize

    def counted(matrices, *rest):
        batches.append(tuple(matrices.shape))
        return batched_orthogonalize(matrices, *rest)
    monkeypatch.setattr(ablation, "batched_orthogonalize", counted)
    loop, batched = (opt5.Muon(filters, torch.tensor(0.01, dtype=torch.float64), dtype=torch.float64, steps=3)
                     for filters in (loop_filters, batched_filters))
    for _ in range(3):
        for ours, theirs in zip(loop_filters, batched_filters):
            ours.grad = torch.randn_like(ours)
            theirs.grad = ours.grad.clone()
        loop_step(loop)
        batched.step()
    # one batch per row count, each as wide as its widest matrix, at every step
    assert batches == [(1, 27, 64), (3, 64, 576), (3, 128, 1152), (3, 256, 2304), (2, 512, 4608)] * 3
    for ours, theirs, first in zip(loop_filters, batched_filters, start):
        torch.testing.assert_close(theirs.detach(), ours.detach(), rtol=0, atol=1e-12)
        # and each filter stepped: 3 orthogonalized steps of 0.01 x 0.2 sqrt(its matrix's longer side)
        assert (ours - first).norm() > 0.01 * 0.2 * max(first.size(0), first[0].numel()) ** 0.5


# ---------------------------------------------------------------------------------- ablation.py

def test_ablation_zero_init_starts_every_residual_block_as_its_shortcut(monkeypatch):
    ablation.zero_init_residuals(monkeypatch.setattr)
    model = common.ResNet10()
    assert all(torch.equal(block.bn2.weight, torch.zeros(block.bn2.num_features)) for block in model.layers)
    assert model.stem[1].weight.eq(1).all(), "only the blocks' last BatchNorm changes"
    block, x = model.layers[0].eval(), torch.randn(2, 64, 8, 8)
    assert torch.equal(block(x), torch.relu(x)), "the first block (identity shortcut) passes its input on"


def test_ablation_whitening_filters_whiten_the_images_3x3_patches():
    mix = torch.tensor([[1.0, 0.0, 0.0], [0.8, 0.6, 0.0], [0.5, 0.5, 0.7]])  # correlated channels
    images = torch.einsum("dc,nchw->ndhw", mix, torch.randn(64, 3, 16, 16)).cumsum(-1) / 3  # correlated pixels
    weights = ablation.whitening_weights(images, eps=0.0)
    assert weights.shape == (54, 3, 3, 3) and torch.equal(weights[27:], -weights[:27])
    outputs = nn.functional.conv2d(images, weights[:27])  # each output pixel: one 3x3 patch, projected
    covariance = torch.cov(outputs.permute(1, 0, 2, 3).reshape(27, -1))
    assert torch.allclose(covariance, torch.eye(27), atol=1e-3)


def test_ablation_whitening_stem_is_frozen_and_made_from_the_training_images(monkeypatch):
    ablation.whitening_stem(monkeypatch.setattr, images_used=64)
    train_set, _ = common.load_data(SimpleNamespace(synthetic=True, data_dir=None, train_size=256, test_size=64),
                                    None, None)
    train_images, _ = opt5.load_to_device(train_set, CPU)
    model = common.ResNet10()
    expected = ablation.whitening_weights(opt5.normalize(train_images[:64], common.cifar10_statistics(CPU)))
    assert torch.equal(model.stem[0].weight[:54], expected) and not model.stem[0].weight.requires_grad


def test_ablation_trained_whitening_stem_starts_from_the_whitening_filters_and_trains_on(monkeypatch):
    ablation.TRAINED_WHITENING(monkeypatch.setattr, images_used=64)
    train_set, _ = common.load_data(SimpleNamespace(synthetic=True, data_dir=None, train_size=256, test_size=64),
                                    None, None)
    train_images, _ = opt5.load_to_device(train_set, CPU)
    model = common.ResNet10()
    stem = model.stem[0].weight
    expected = ablation.whitening_weights(opt5.normalize(train_images[:64], common.cifar10_statistics(CPU)))
    assert torch.equal(stem[:54], expected) and stem.requires_grad and stem.is_leaf
    model(torch.randn(2, 3, 16, 16)).square().sum().backward()
    assert stem.grad is not None and stem.grad[:54].abs().sum() > 0, "a gradient reaches the whitening filters"
    opt5.Muon([stem], torch.tensor(0.01), dtype=torch.float32).step()  # opt5's Muon steps it as a filter
    assert not torch.equal(stem[:54], expected)


def test_ablation_alternating_flip_mirrors_each_image_every_other_epoch(monkeypatch):
    ablation.alternating_flip(monkeypatch.setattr)
    run = drawn_plan(size=96, batch_size=16, epochs=3)
    torch.manual_seed(0)  # opt5 seeds torch with --seed: the row draws its first coins from it
    flips = {}
    for epoch in (1, 2, 3):
        plan_the_epoch(opt5, run, 96, epoch)
        by_image = torch.zeros(96, dtype=torch.bool)
        by_image[run.plan.batches.flatten()] = run.plan.flips.flatten()
        flips[epoch] = by_image
    assert 30 < flips[1].sum() < 66, "epoch 1: a coin per image"
    assert torch.equal(flips[2], ~flips[1]) and torch.equal(flips[3], flips[1])


def test_ablation_ema_averages_the_weights_and_batchnorm_statistics_after_every_step(monkeypatch):
    def three_steps(run, train_data, epoch, monitor, size):
        for _ in range(3):
            run.model(torch.randn(8, 4)).square().mean().backward()
            for optimizer in run.optimizers:  # as opt5's optimizer_step: Muon's, then AdamW's
                optimizer.step()

    monkeypatch.setattr(opt5, "train_one_epoch", three_steps)
    ablation.ema_of_the_weights(monkeypatch.setattr, decay=0.5)
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    # the first optimizer steps the Linear's weight, the last the rest: the average sees both steps
    run = SimpleNamespace(model=model, optimizers=[torch.optim.SGD([model[0].weight], lr=0.1),
                                                   torch.optim.SGD(list(model.parameters())[1:], lr=0.1)])
    states = [{name: tensor.clone() for name, tensor in model.state_dict().items()}]
    record = run.optimizers[-1].register_step_post_hook(lambda *_: states.append(
        {name: tensor.clone() for name, tensor in model.state_dict().items()}))
    opt5.train_one_epoch(run, None, 1, NO_MONITOR, 32)
    record.remove()
    for name in ("0.weight", "0.bias", "1.running_mean", "1.running_var"):
        expected = states[0][name]
        for state in states[1:]:
            expected = 0.5 * expected + 0.5 * state[name]
        assert torch.allclose(run.average[name], expected), name
    assert "1.num_batches_tracked" not in run.average


def test_ablation_nesterov_row_builds_sgd_where_opt5_builds_adamw(monkeypatch):
    ablation.nesterov_sgd(monkeypatch.setattr)
    optimizer = opt5.adamw([nn.Parameter(torch.zeros(2))], 0.2, CPU)
    assert isinstance(optimizer, torch.optim.SGD) and optimizer.defaults["lr"].item() == pytest.approx(0.2)
    settings = {name: optimizer.defaults[name] for name in ("momentum", "nesterov", "weight_decay")}
    assert settings == {"momentum": 0.9, "nesterov": True, "weight_decay": 5e-4}
    run = SimpleNamespace(optimizers=[optimizer], scaler=torch.amp.GradScaler("cpu", enabled=False),
                          plan=bare_plan(opt5, 1, 8))
    run.plan.rates.copy_(torch.tensor([0.1]))
    optimizer.param_groups[0]["params"][0].grad = torch.ones(2)
    opt5.optimizer_step(run.optimizers, run.plan, run.scaler)  # opt5's own update step takes it, at the table's rate
    assert optimizer.param_groups[0]["lr"].item() == pytest.approx(0.1)


@pytest.mark.parametrize("row, changed", [
    ("shipped", {}), ("no-resizing", {"min_size": 32}), ("smoothing-0.2", {"label_smoothing": 0.2}),
    ("nesterov", {"optimizer": "adamw", "lr": 0.2}), ("adamw", {"optimizer": "adamw"}),
    ("smoothing-0", {"label_smoothing": 0.0}), ("epochs-5-batch-128", {"epochs": 5, "batch_size": 128, "lr": 0.008}),
    ("twenty-epochs", {}),  # every setting named: the recipe whatever the defaults
    ("one-warmup-step", {}),  # a time row: opt5's training, set up differently
    # a bundle: its schedule's flags, then its own (label smoothing 0.2 after the schedule's 0.1)
    ("fifteen-epochs+all", {"epochs": 15, "label_smoothing": 0.2}),
    ("sixteen-epochs-1024+lookahead+alternating-flip", {"epochs": 16, "batch_size": 1024, "lr": 0.0226}),
])
def test_ablation_rows_flags_change_the_recipe_in_what_they_name_and_win_over_the_flags_given(row, changed,
                                                                                              monkeypatch):
    _, row_flags, _, _ = ablation.ROWS[ablation.ROW_NAMES.index(row)]
    for given in ([], ["--optimizer", "muon", "--label-smoothing", "0.1", "--epochs", "20"]):
        monkeypatch.setattr(sys, "argv", ["opt5.py", *given, *row_flags])  # as run_row puts them
        args = opt5.parse_args()
        assert {name: getattr(args, name) for name in plot.RECIPE if getattr(args, name) != plot.RECIPE[name]} == \
            changed


@pytest.mark.parametrize("short_schedule, peak", [(ablation.short_schedule, 1.4),  # its default peak
                                                  (functools.partial(ablation.short_schedule, peak=1), 1)])
def test_ablation_short_schedule_warms_up_over_5_percent_and_decays_in_a_line_to_0(short_schedule, peak,
                                                                                    monkeypatch):
    short_schedule(monkeypatch.setattr)
    rates = opt5.onecycle_schedule(1.0, 100, CPU)
    assert rates.argmax().item() == 4 and rates.max().item() == pytest.approx(peak)  # the 5th of 100 steps
    assert rates[-1].item() < 1e-3 and rates[0].item() == pytest.approx(peak / 25)
    steps = rates[4:].diff()
    assert torch.allclose(steps, steps.mean().expand_as(steps), atol=1e-6), "a straight line down"


def test_ablation_batchnorm_row_steps_vectors_at_twice_the_rate_without_weight_decay(monkeypatch):
    ablation.batchnorm_without_decay(monkeypatch.setattr)
    model = common.ResNet10()
    parameters = list(model.parameters())
    filters = [p for p in parameters if p.ndim == 4]
    # as opt5's main() builds them: Muon for the filters, AdamW (here the row's) for the rest
    optimizers = [opt5.Muon(filters, torch.tensor(0.01), dtype=torch.float32, steps=3),
                  opt5.adamw([p for p in parameters if p.ndim != 4], 0.01, CPU)]
    vectors, matrices = optimizers[1].param_groups[1]["params"], optimizers[1].param_groups[0]["params"]
    assert vectors and all(p.ndim == 1 for p in vectors) and [p.ndim for p in matrices] == [2]
    run = SimpleNamespace(optimizers=optimizers, scaler=torch.amp.GradScaler("cpu", enabled=False),
                          plan=bare_plan(opt5, 2, 8))
    run.plan.rates.copy_(torch.tensor([0.004, 0.002]))
    before = [p.detach().clone() for p in (*vectors, *matrices)]
    for step in range(2):
        for parameter in parameters:
            parameter.grad = torch.zeros_like(parameter)  # no gradient: only weight decay moves a weight
        opt5.optimizer_step(run.optimizers, run.plan, run.scaler)  # the table's rate into every group, then the step
        rates = [group["lr"].item() for optimizer in optimizers for group in optimizer.param_groups]
        assert rates == pytest.approx([0.004, 0.004, 0.008] if step == 0 else [0.002, 0.002, 0.004])
    assert all(torch.equal(p, b) for p, b in zip(vectors, before)), "no weight decay on the vectors"
    assert torch.allclose(matrices[0], before[-1] * (1 - 0.004 * 0.05) * (1 - 0.002 * 0.05))


def test_ablation_whitening_at_each_size_computes_the_stem_again_at_each_new_size(monkeypatch):
    trained = []
    monkeypatch.setattr(opt5, "train_one_epoch", lambda run, train_data, epoch, monitor, size: trained.append(size))
    ablation.whitening_at_each_size(monkeypatch.setattr, images_used=64)
    train_set, _ = common.load_data(SimpleNamespace(synthetic=True, data_dir=None, train_size=128, test_size=64),
                                    None, None)
    images, labels = opt5.load_to_device(train_set, CPU)
    run = SimpleNamespace(plan=SimpleNamespace(images=images, labels=labels), statistics=common.cifar10_statistics(CPU),
                          model=common.ResNet10())
    normalized = opt5.normalize(images[:64], run.statistics)
    computed = []
    for epoch, size in enumerate([16, 16, 24, 32], 1):
        opt5.train_one_epoch(run, (images, labels), epoch, None, size)
        expected = ablation.whitening_weights(opt5.downscale(normalized, size))
        assert torch.equal(run.model.stem[0].weight[:54], expected), size
        computed.append(expected)
    assert trained == [16, 16, 24, 32] and not torch.equal(computed[0], computed[2])


def test_ablation_batched_muon_steps_as_opt5s_muon_does_filter_by_filter(monkeypatch):
    per_filter = opt5.Muon.step  # opt5's own, before the row replaces it
    ablation.batched_muon(monkeypatch.setattr)
    torch.manual_seed(0)
    models = [common.ResNet10().double() for _ in range(2)]
    models[1].load_state_dict(models[0].state_dict())  # a copy: the same weights
    filters = [[p for p in model.parameters() if p.ndim == 4] for model in models]
    # float64 and one Newton-Schulz iteration a step (3 would run the same code on 3x the matmuls): ResNet10's 12
    # filters, tall (the stem's) and wide, 1x1 and 3x3, in the row's 5 zero-padded batches
    shipped, batched = (opt5.Muon(these, torch.tensor(0.02, dtype=torch.float64), steps=1, dtype=torch.float64)
                        for these in filters)
    stem, start = (filters[0][i].detach().clone() for i in (0, 1))
    for step in range(3):
        for mine, its in zip(*filters):
            mine.grad = torch.randn_like(mine)
            its.grad = mine.grad.clone()
        for these in filters:
            these[0].grad = None  # a filter without a gradient (a frozen stem) is skipped by both
        per_filter(shipped)
        batched.step()
        assert max((mine - its).abs().max().item() for mine, its in zip(*filters)) < 1e-12, f"step {step + 1}"
        # the momenta made at the first step only: a captured step would zero fresh copies of them at every replay
        monkeypatch.setattr(torch, "zeros_like", lambda *args, **kwargs: pytest.fail("momenta made again"))
    assert not torch.equal(filters[1][1], start), "the filters moved"
    assert torch.equal(filters[0][0], stem) and torch.equal(filters[1][0], stem), "no gradient, no step"
    assert len(batched.state) == 11 and all(torch.equal(batched.state[its]["momentum"], shipped.state[mine][
        "momentum"]) for mine, its in zip(filters[0][1:], filters[1][1:]))


def test_ablation_cudnn_benchmark_off_turns_the_autotuner_off_after_opt5_turns_it_on(monkeypatch):
    source = inspect.getsource(opt5.main)  # opt5 turns it on just before it builds the model: the row's moment
    assert source.index("torch.backends.cudnn.benchmark = True") < source.index("common.ResNet10()")
    ablation.cudnn_benchmark_off(monkeypatch.setattr)
    torch.backends.cudnn.benchmark = True
    model = common.ResNet10()
    assert torch.backends.cudnn.benchmark is False and sum(p.numel() for p in model.parameters()) == 4_903_242


def test_ablation_cudnn_benchmark_at_the_largest_size_turns_it_on_only_in_the_full_size_epochs(monkeypatch):
    seen = []
    monkeypatch.setattr(opt5, "train_one_epoch", lambda run, train_data, epoch, monitor, size: seen.append(
        (size, torch.backends.cudnn.benchmark)))
    ablation.cudnn_benchmark_at_the_largest_size(monkeypatch.setattr)
    train_data = torch.zeros(4, 3, 32, 32, dtype=torch.uint8), torch.zeros(4, dtype=torch.long)
    run = SimpleNamespace(plan=SimpleNamespace(images=train_data[0], labels=train_data[1]))
    torch.backends.cudnn.benchmark = True  # as opt5 leaves it
    sizes = opt5.image_sizes(20, 16, 32, 0.3)
    for epoch, size in enumerate(sizes, 1):
        opt5.train_one_epoch(run, train_data, epoch, NO_MONITOR, size)
    assert seen == [(size, size == 32) for size in sizes] and sizes.count(32) == 6


def test_ablation_one_warmup_step_captures_the_step_at_its_second_call(monkeypatch):
    where, seen = {"stream": "default"}, []

    @contextlib.contextmanager
    def on(stream):  # torch.cuda.stream and torch.cuda.graph: the step inside runs there
        before, where["stream"] = where["stream"], stream
        try:
            yield
        finally:
            where["stream"] = before

    stream = SimpleNamespace(wait_stream=lambda other: None)
    monkeypatch.setattr(torch.cuda, "Stream", lambda: stream)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda: stream)
    monkeypatch.setattr(torch.cuda, "stream", lambda side_stream: on("warm-up"))
    monkeypatch.setattr(torch.cuda, "graph", lambda graph: on("capture"))
    monkeypatch.setattr(torch.cuda, "CUDAGraph", lambda: SimpleNamespace(replay=lambda: seen.append("replay")))
    shipped = opt5.cuda_graph
    ablation.one_warmup_step(monkeypatch.setattr)
    calls = {}
    for name, cuda_graph in (("opt5", shipped), ("row", opt5.cuda_graph)):
        seen.clear()
        step = cuda_graph(lambda: seen.append(where["stream"]), torch.device("cuda"))
        for _ in range(5):
            step()
        calls[name] = list(seen)
    # a capture runs none of the step's kernels: the graph replays them, at once
    assert calls["row"] == ["warm-up", "capture", "replay", "replay", "replay", "replay"]
    assert calls["opt5"] == ["warm-up"] * 3 + ["capture", "replay", "replay"]


def test_ablation_lookahead_pulls_the_weights_to_their_average_every_5_steps_and_ends_on_it(monkeypatch):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    before, after = [], []  # the weights and BatchNorm statistics at each step's start and end

    def floats():
        return [tensor.clone() for tensor in model.state_dict().values() if tensor.is_floating_point()]

    def step():  # a step: the weights and the BatchNorm statistics move
        before.append(floats())
        sgd.zero_grad()
        model(torch.randn(8, 4)).square().mean().backward()
        sgd.step()
        after.append(floats())

    def four_steps(run, train_data, epoch, monitor, size):
        for _ in range(4):
            run.train_steps[size]()

    monkeypatch.setattr(opt5, "train_one_epoch", four_steps)
    ablation.lookahead(monkeypatch.setattr)
    run = SimpleNamespace(model=model, args=SimpleNamespace(epochs=2), schedule=torch.zeros(8), train_steps={32: step})
    start = floats()
    for epoch in (1, 2):
        opt5.train_one_epoch(run, None, epoch, NO_MONITOR, 32)
        if epoch == 1:
            assert all(torch.equal(*pair) for pair in zip(floats(), after[3])), "no pull in the first 4 steps"

    def same(these, those):
        return all(torch.allclose(this, that, atol=1e-7) for this, that in zip(these, those))
    weight = 0.95 ** 5 * (5 / 8) ** 3  # decay x (steps done / all steps)^3, after the 5th of 8 steps
    pulled = [weight * first + (1 - weight) * fifth for first, fifth in zip(start, after[4])]
    assert same(before[5], pulled) and not same(before[5], after[4]), "the 6th step starts from the pulled weights"
    assert all(same(before[i], after[i - 1]) for i in (1, 2, 3, 4, 6, 7)), "no pull at other steps"
    assert same(floats(), pulled) and same(run.lookahead["average"], pulled), "the last epoch ends on the average"
    assert not same(floats(), after[7])


def test_ablation_batchnorm_biases_only_freezes_every_scale_and_steps_biases_at_twice_the_rate_without_decay(
        monkeypatch):
    ablation.batchnorm_biases_only(monkeypatch.setattr)
    torch.manual_seed(0)
    model = common.ResNet10()
    batchnorms = [module for module in model.modules() if isinstance(module, nn.BatchNorm2d)]
    assert len(batchnorms) == 12 and all(not bn.weight.requires_grad and bn.bias.requires_grad for bn in batchnorms)
    parameters = list(model.parameters())
    optimizers = [opt5.Muon([p for p in parameters if p.ndim == 4], torch.tensor(0.01), dtype=torch.float32),
                  opt5.adamw([p for p in parameters if p.ndim != 4], 0.01, CPU)]  # as opt5's main() builds them
    no_decay = optimizers[1].param_groups[1]
    biases = [bn.bias for bn in batchnorms] + [model.fc.bias]
    assert no_decay["weight_decay"] == 0 and {id(p) for p in biases} <= {id(p) for p in no_decay["params"]}
    run = SimpleNamespace(optimizers=optimizers, scaler=torch.amp.GradScaler("cpu", enabled=False),
                          plan=bare_plan(opt5, 1, 4))
    run.plan.rates.copy_(torch.tensor([0.004]))
    started = [bias.detach().clone() for bias in biases]
    nn.functional.cross_entropy(model(torch.randn(4, 3, 16, 16)), torch.arange(4)).backward()
    for parameter in parameters:
        if parameter.ndim == 4:
            parameter.grad = None  # Muon skips the filters: seconds of Newton-Schulz on a CPU, and not the row's change
    opt5.optimizer_step(run.optimizers, run.plan, run.scaler)
    assert [group["lr"].item() for optimizer in optimizers for group in optimizer.param_groups] == \
        pytest.approx([0.004, 0.004, 0.008])
    assert all(bn.weight.grad is None and bn.weight.eq(1).all() for bn in batchnorms), "the scales stay 1"
    assert all(not torch.equal(bias, start) for bias, start in zip(biases, started)), "every bias steps"


def test_ablation_epochs_at_each_size_trains_the_counts_and_exits_2_with_one_line_on_other_epochs(monkeypatch,
                                                                                                 capsys):
    ablation.epochs_at_each_size(monkeypatch.setattr, counts=(8, 4, 3))
    assert opt5.image_sizes(15, 16, 32, 0.3) == [16] * 8 + [24] * 4 + [32] * 3
    with pytest.raises(SystemExit) as exit_info:
        opt5.image_sizes(20, 16, 32, 0.3)
    stderr = capsys.readouterr().err
    assert exit_info.value.code == 2 and stderr.count("\n") == 1, stderr
    assert "trains 15 epochs" in stderr and "drop --epochs 20" in stderr


def test_ablation_runs_its_rows_once_per_seed(tmp_path):
    out = tmp_path / "seeds.jsonl"
    result = run_python("lab/ablation.py", "--rows", "shipped", "--seeds", 3, 4, "--json", out, "--epochs", 2,
                        "--train-size", 256, "--batch-size", 64, *SMALL)
    assert result.returncode == 0, result.stderr
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert [line["settings"]["seed"] for line in lines] == [3, 4] and "2 rows appended" in result.stdout
    assert lines[0]["command"].endswith("--seed 3")
    assert lines[0]["epochs"][0]["train_loss"] != lines[1]["epochs"][0]["train_loss"], "other weights, other batches"


def test_ablation_shifts_move_the_image_one_pixel_and_reflect_the_edge():
    images = torch.arange(16.0).view(1, 1, 4, 4)
    up_left, down_right = ablation.shifted(images, -1, -1), ablation.shifted(images, 1, 1)
    assert torch.equal(up_left[..., :3, :3], images[..., 1:, 1:])
    assert torch.equal(down_right[..., 1:, 1:], images[..., :3, :3])
    assert torch.equal(ablation.shifted(images, 0, 0), images)


def test_ablation_runs_each_row_in_its_own_process_and_scores_three_ways(tmp_path):
    out = tmp_path / "ablation.jsonl"
    result = run_python("lab/ablation.py", "--rows", "shipped", "ema", "smoothing-0", "--json", out, "--epochs", 2,
                        "--train-size", 1024, "--batch-size", 64, "--label-smoothing", 0.2, "--no-compile", *SMALL, timeout=1200)
    assert result.returncode == 0, result.stderr
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert [line["row"] for line in lines] == ["shipped", "ema", "smoothing-0"]
    # opt5 as it ships (Muon) with the flags given, and a row's own flag over them
    assert [(line["settings"]["optimizer"], line["settings"]["label_smoothing"]) for line in lines] == \
        [("muon", 0.2), ("muon", 0.2), ("muon", 0.0)]
    shipped = lines[0]
    assert shipped["2_views"] == shipped["final_test_accuracy"], "2 views is opt5's own evaluation"
    assert shipped["2_views"] > 0.3, "it learns (10 classes)"
    for line in lines:
        assert line["command"].startswith(f"python lab/ablation.py --rows {line['row']} --epochs 2")
        assert all(0 <= line[views] <= 1 for views in ("1_view", "2_views", "6_views"))
        assert line["launch_to_result_6_views_seconds"] == line["launch_to_result_seconds"] + \
            line["extra_view_seconds"] > line["launch_to_result_seconds"]
        # 256 test images in half-batches of 32: 8 calls of 64 images a view pair, 16 more for 2 more pairs
        assert line["modelled_h200_6_views_seconds"] == pytest.approx(line["modelled_h200_seconds"] + 16 * (
            accounting.modelled_h200_step_seconds(64, 32, muon=False) / 3))
        assert len(line["epochs"]) == 2 and line["epochs"][0]["test_images"] == 256
    assert result.stdout.count("row shipped: test acc") == 1 and "3 rows appended" in result.stdout


# ablation.py launched through this wrapper, which puts a stand-in for ResNet10 (its stem and classifier, no blocks)
# in common: main() launches each row as it was launched, so every row's process trains the stand-in, and a bundle's
# 15 epochs of its batch of 512 take seconds on a CPU, not minutes
STEM_ONLY = """
import runpy, sys
sys.path[:0] = [{root!r}, {lab!r}]  # as `python lab/ablation.py` finds the chain and the lab
import torch.nn as nn
import common


class StemOnly(nn.Module):
    def __init__(self, num_classes=10):
        super().__init__()
        # ResNet10's stem filters (a whitening stem sets 54 of them), at stride 4: a 16th of the pixels after them
        self.stem = nn.Sequential(nn.Conv2d(3, 64, 3, stride=4, padding=1, bias=False), nn.BatchNorm2d(64), nn.ReLU())
        self.layers = nn.Sequential()  # no residual blocks
        self.fc = nn.Linear(64, num_classes)

    def forward(self, x):
        return self.fc(nn.functional.adaptive_avg_pool2d(self.layers(self.stem(x)), 1).flatten(1))


common.ResNet10 = StemOnly
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def test_ablation_runs_a_time_row_and_a_bundle_each_with_its_own_flags_over_the_flags_given(tmp_path):
    out, weights, wrapper = tmp_path / "screen.jsonl", tmp_path / "weights.pt", tmp_path / "stem_only.py"
    wrapper.write_text(STEM_ONLY.format(root=str(ROOT), lab=str(ROOT / "lab")))
    given = ["--epochs", "2", "--batch-size", "16", "--label-smoothing", "0", "--train-size", "512",
             "--monitor-size", "16", "--save", str(weights), *SMALL, "--test-size", "64"]
    # one thread: the stand-in's ops take microseconds, and threads of one op wait on each other on a busy machine
    result = run_python(wrapper, "lab/ablation.py", "--rows", "one-warmup-step", "fifteen-epochs+all", "--json", out,
                        *given, env={"OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert [line["row"] for line in lines] == ["one-warmup-step", "fifteen-epochs+all"]
    assert [line["command"] for line in lines] == [f"python lab/ablation.py --rows {line['row']} {shlex.join(given)}"
                                                   for line in lines]
    settings = [{name: line["settings"][name] for name in ("epochs", "batch_size", "lr", "label_smoothing")}
                for line in lines]
    # the time row runs the flags given; the bundle its own schedule (15 epochs of 512) and smoothing over them
    assert settings == [{"epochs": 2, "batch_size": 16, "lr": 0.016, "label_smoothing": 0.0},
                        {"epochs": 15, "batch_size": 512, "lr": 0.016, "label_smoothing": 0.2}]
    assert [epoch["image_size"] for epoch in lines[0]["epochs"]] == [16, 32]
    assert [epoch["image_size"] for epoch in lines[1]["epochs"]] == [16] * 8 + [24] * 4 + [32] * 3  # (8, 4, 3)
    assert [epoch["steps"] for epoch in lines[1]["epochs"]] == [1] * 15
    assert all(0 <= line[views] <= 1 for line in lines for views in ("1_view", "2_views", "6_views"))
    # the bundle's last weights (--save, the last row's): BatchNorm's scales frozen at 1, its biases trained
    state = torch.load(weights)
    assert state["stem.1.weight"].eq(1).all() and state["stem.1.bias"].ne(0).any()
    assert "2 rows appended" in result.stdout and "step: run as a function" in result.stdout


@pytest.mark.parametrize("args, says", [
    (["--rows", "nope"], "--rows: invalid choice: 'nope'"),
    (["--epochs", "0"], "--epochs: must be a positive integer"),
    (["--min-size", "12"], "--min-size: invalid choice: 12"),
    (["--json", "{missing}/ablation.jsonl"], "cannot append to --json"),
])
def test_ablation_bad_input_exits_2_with_one_line_before_any_row(args, says, tmp_path):
    args = [arg.replace("{missing}", str(tmp_path / "missing")) for arg in args]
    result = run_python("lab/ablation.py", *args, "--json", tmp_path / "out.jsonl", *SMALL) if "--json" not in args \
        else run_python("lab/ablation.py", *args, *SMALL)
    assert result.returncode == 2 and result.stdout == "", result.stdout
    assert result.stderr.count("\n") == 1 and says in result.stderr, result.stderr


def test_ablation_help_names_every_row_and_its_flags_defaults():
    result = run_python("lab/ablation.py", "--help")
    assert result.returncode == 0
    text = re.sub(r"-\s+", "-", " ".join(result.stdout.split()))  # argparse wraps lines at hyphens
    assert all(name in text for name in ablation.ROW_NAMES)
    assert "--rows" in result.stdout and "(default: lab/results/recipe.jsonl, with the recipe's other runs)" in text
    assert "--row " not in result.stdout, "the per-process flag is internal"
