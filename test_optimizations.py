"""Each optimization does what its `# optN:` tag says, on the CPU: accumulation, the data on the device, what each
script turns on, float16 with GradScaler, no host reads in the loop, the whole step, progressive resizing, Muon, and
the step's fallback when a capture fails."""
import contextlib
import functools
import inspect
import os
import sys
from types import SimpleNamespace

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils.data import DataLoader, TensorDataset

import common
import opt2
import opt3
import opt4
import opt5
import opt6
from conftest import (
    ALL_SCRIPTS, CPU, NO_MONITOR, ROOT, SMALL, WHOLE_STEP, CountHostReads, CountScalarReads,
    assert_saved_weights_match_the_report, bare_plan, bn_free_net, call, constant_schedule, drawn_plan, image_hash,
    onecycle_lr_after, optimizers_of, plan_tensors, plan_the_epoch, read_json, run_python, shipped_optimizer, small_net,
    step_of)


# ------------------------------------------------------------------------ gradient accumulation

def accumulated_weights(batch_size, accum_steps, monkeypatch, batchnorm=False):
    """Weights of a small net (BatchNorm-free unless `batchnorm`) after one opt2 epoch of 24 images."""
    monkeypatch.setattr(torch, "autocast", lambda *args, **kwargs: contextlib.nullcontext())  # float32
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), *[nn.BatchNorm2d(4)] * batchnorm, nn.ReLU(), nn.Flatten(),
                          nn.Linear(4 * 30 * 30, 10))
    torch.manual_seed(1)
    data = TensorDataset(torch.randn(24, 3, 32, 32), torch.randint(0, 10, (24,)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    _, _, steps, images = call(
        opt2.train_one_epoch, model=model, loader=DataLoader(data, batch_size=batch_size),
        criterion=nn.CrossEntropyLoss(), optimizer=optimizer, scheduler=scheduler,
        scaler=torch.amp.GradScaler("cpu", enabled=False), amp_dtype=torch.float32, accum_steps=accum_steps,
        device=CPU, epoch=1, monitor=NO_MONITOR)
    return torch.nn.utils.parameters_to_vector(model.parameters()).detach(), steps, images


def test_accumulating_k_micro_batches_equals_one_big_batch(monkeypatch):
    big_batch, steps, _ = accumulated_weights(12, 1, monkeypatch)
    accumulated, accumulated_steps, images = accumulated_weights(4, 3, monkeypatch)
    assert (steps, accumulated_steps, images) == (2, 2, 24)
    assert torch.allclose(accumulated, big_batch, atol=1e-6)
    one_step, _, _ = accumulated_weights(24, 1, monkeypatch)
    assert not torch.allclose(one_step, big_batch, atol=1e-3), "the comparison must be able to fail"


def test_with_batchnorm_accumulating_micro_batches_is_not_one_big_batch(monkeypatch):
    # What the accumulation tag says: BatchNorm normalizes each micro-batch of 4 by its own statistics, so the
    # accumulated step is not the step of the batch of 12
    big_batch, _, _ = accumulated_weights(12, 1, monkeypatch, batchnorm=True)
    accumulated, _, _ = accumulated_weights(4, 3, monkeypatch, batchnorm=True)
    assert not torch.allclose(accumulated, big_batch, atol=1e-4)


@pytest.mark.parametrize("script, accum_steps", [("opt2.py", 1), ("opt2.py", 3), ("opt3.py", 3), ("opt4.py", 3),
                                                       ("opt6.py", 3)])
def test_onecycle_length_counts_optimizer_steps(script, accum_steps, tmp_path, monkeypatch):
    json_path = tmp_path / "result.json"
    workers = ["--workers", "0"] if script == "opt2.py" else []
    # 10 batches per epoch: not divisible by 3, so micro-batches and optimizer steps differ.
    monkeypatch.setattr(sys, "argv", [script, *SMALL, "--epochs", "2", "--train-size", "160", "--test-size", "16",
                                      "--batch-size", "16", "--accum-steps", str(accum_steps), "--no-compile", *workers,
                                      "--json", str(json_path)])
    ALL_SCRIPTS[script].main()
    report = read_json(json_path)
    assert [epoch["steps"] for epoch in report["epochs"]] == [10 // accum_steps] * 2
    assert [epoch["images"] for epoch in report["epochs"]] == [10 // accum_steps * accum_steps * 16] * 2
    # The rate after the run tells how long the schedule was: counting micro-batches would leave it high.
    optimizer_steps = 2 * (10 // accum_steps)
    # opt2 reports the rate its scheduler left after the last step; opt4 onwards the rate the last step took
    last = optimizer_steps - (script in WHOLE_STEP)
    lr = report["settings"]["lr"]
    assert report["final_lr"] == pytest.approx(onecycle_lr_after(optimizer_steps, lr, steps=last), rel=1e-6)
    if accum_steps > 1:
        assert report["final_lr"] != pytest.approx(onecycle_lr_after(2 * 10, lr, steps=last))


def test_a_capturable_adamw_is_built_with_torchs_warn_once_flag_set_so_its_uncaptured_steps_warn_nothing():
    # torch warns that a capturable=True optimizer "can impair ungraphed performance" only where an instance's flag is
    # unset, and its Optimizer.__init__ sets it: adamw's warm-up steps before a capture (and opt6's uncaptured steps
    # under DDP) print no warning, so the scripts filter none. A copy made by copy.deepcopy has it unset: it warned in
    # the H200 logs of a report that stepped one, which the run no longer does.
    for module in (opt4, opt5, opt6):
        optimizer = module.adamw([torch.zeros(2, requires_grad=True)], 0.01, CPU)
        assert optimizer._warned_capturable_if_run_uncaptured is True
        assert not (ROOT / module.__file__).read_text().count("filterwarnings")


# -------------------------------------------------------------------- opt4's on-device data path

@pytest.mark.parametrize("height, width", [(32, 32), (64, 48)])  # CIFAR-10's size, and a copy-paste's
def test_opt4_augment_crops_the_padded_image_at_its_offsets_and_mirrors_where_told(height, width):
    images = torch.rand(32, 3, height, width)
    pad = common.CROP_PADDING
    padded = torch.nn.functional.pad(images, (pad, pad, pad, pad), mode="reflect")
    generator = torch.Generator().manual_seed(0)
    offsets = torch.randint(0, 2 * pad + 1, (2, 32, 1), generator=generator)
    flips = torch.rand(32, 1, generator=generator) < 0.5
    augmented = opt4.augment(images, offsets, flips, pad)
    assert augmented.shape == images.shape
    for i, ((top,), (left,), (flip,)) in enumerate(zip(offsets[0].tolist(), offsets[1].tolist(), flips.tolist())):
        crop = padded[i, :, top:top + height, left:left + width]
        assert torch.equal(augmented[i], crop.flip(2) if flip else crop), f"image {i}"
    assert len({(top, left) for top, left in zip(offsets[0].flatten().tolist(), offsets[1].flatten().tolist())}) > 10


def test_opt3_each_epoch_draws_every_image_once_with_fresh_crops_and_flips():
    generator = torch.Generator().manual_seed(0)
    batches, offsets, flips = opt3.draw_epoch(96, 16, common.CROP_PADDING, generator)
    assert batches.shape == (6, 16) and sorted(batches.flatten().tolist()) == list(range(96))
    assert offsets.shape == (6, 2, 16, 1) and flips.shape == (6, 16, 1)
    assert set(offsets.flatten().tolist()) == set(range(2 * common.CROP_PADDING + 1)) and 0 < flips.float().mean() < 1
    second, second_offsets, _ = opt3.draw_epoch(100, 16, common.CROP_PADDING, generator)
    images = second.flatten().tolist()
    assert len(images) == 96 and len(set(images)) == 96 and max(images) < 100  # 4 left over, none twice
    assert not torch.equal(second, batches) and not torch.equal(second_offsets, offsets)


def test_opt4_writes_each_epochs_draw_and_its_rates_into_the_plans_buffers_at_the_same_addresses():
    run = drawn_plan(size=100, batch_size=16)
    addresses = {name: tensor.data_ptr() for name, tensor in plan_tensors(run.plan).items()}
    for epoch, image_count in ((1, 96), (2, 100)):
        run.plan.cursor.fill_(5)
        before = run.generator.get_state()
        plan_the_epoch(opt4, run, image_count, epoch)
        after = run.generator.get_state()
        run.generator.set_state(before)
        drawn = opt4.draw_epoch(image_count, 16, common.CROP_PADDING, run.generator)  # again, from the same state
        assert torch.equal(run.generator.get_state(), after)
        assert all(torch.equal(buffer, values) for buffer, values in zip(
            (run.plan.batches, run.plan.offsets, run.plan.flips), drawn))
        assert torch.equal(run.plan.rates, run.schedule[(epoch - 1) * 6:epoch * 6]), "the epoch's rates"
        assert run.plan.cursor.item() == 0 and run.plan.correct.item() == 0
        assert {name: tensor.data_ptr() for name, tensor in plan_tensors(run.plan).items()} == addresses


def test_opt4_schedule_table_is_onecycles_learning_rate_at_every_step_and_beta1_stays_torchs():
    table = opt4.onecycle_schedule(0.02, 40, CPU)
    weight = torch.zeros(1, requires_grad=True)
    reference = torch.optim.AdamW([weight], lr=0.02)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(reference, max_lr=0.02, total_steps=40, pct_start=0.25)
    expected = []
    for _ in range(40):
        expected.append(reference.param_groups[0]["lr"])
        reference.step()
        scheduler.step()
    assert table.shape == (40,) and torch.allclose(table, torch.tensor(expected, dtype=torch.float64).float())
    assert table.argmax() == 9 and table[0] == pytest.approx(0.02 / 25) and table[-1] < 1e-6
    # fused AdamW takes beta1 as a number: it stays at torch's 0.9, where OneCycleLR would cycle it 0.95-0.85-0.95
    assert opt4.adamw([weight], 0.02, CPU).defaults["betas"] == (0.9, 0.999)


@pytest.mark.parametrize("script", ["opt3.py", "opt4.py", "opt5.py"])
def test_opt3_and_opt4_score_each_test_image_once_and_opt5_with_its_mirror(script, monkeypatch):
    # Flip test-time augmentation is opt5's (its recipe): the mean of the logits of each image and its mirror, in one
    # batch of --batch-size. opt3 and opt4 score each image once, --batch-size of them a batch
    monkeypatch.setattr(torch, "autocast", lambda *args, **kwargs: contextlib.nullcontext())  # float32
    torch.manual_seed(0)
    model = common.ResNet10().eval()
    images, labels = torch.randint(0, 256, (20, 3, 32, 32), dtype=torch.uint8), torch.randint(0, 10, (20,))
    with torch.no_grad():
        plain, mirrored = (model(opt4.normalize(shown, common.cifar10_statistics(CPU))) for shown in (images,
                                                                                                   images.flip(3)))
    with_mirrors = (plain + mirrored) / 2
    expected, other = (with_mirrors, plain) if script == "opt5.py" else (plain, with_mirrors)
    # batches of 8: opt3 and opt4 the last one 4 images padded; opt5 4 images and their 4 mirrors each
    loss, accuracy = call(ALL_SCRIPTS[script].evaluate, model=model, test_data=(images, labels),
                          amp_dtype=torch.float32, batch_size=8, device=CPU, size=32)
    assert loss == pytest.approx(nn.functional.cross_entropy(expected, labels).item(), rel=1e-5)
    assert accuracy == pytest.approx((expected.argmax(1) == labels).float().mean().item(), abs=1 / 20)
    assert loss != pytest.approx(nn.functional.cross_entropy(other, labels).item(), rel=1e-5), \
        "the test must be able to fail"


@pytest.mark.parametrize("script", ["opt5.py", "opt6.py"])
@pytest.mark.parametrize("size", [16, 32])
def test_opt5_evaluation_scores_each_image_once_whatever_its_last_batch(script, size):
    # opt5 evaluates eagerly, its last batch unpadded: batches of 16 over 40 images (the last one 8) score as one of 40,
    # in float32 (amp_dtype float32 turns autocast off)
    torch.manual_seed(0)
    model = common.ResNet10().eval()
    test_data = (torch.randint(0, 256, (40, 3, 32, 32), dtype=torch.uint8), torch.randint(0, 10, (40,)))

    def evaluate(batch_size):
        return call(ALL_SCRIPTS[script].evaluate, model=model, test_data=test_data, amp_dtype=torch.float32,
                    batch_size=batch_size, device=CPU, size=size)
    (loss, accuracy), (one_batch_loss, one_batch_accuracy) = evaluate(16), evaluate(40)
    assert loss == pytest.approx(one_batch_loss, rel=1e-5) and accuracy == one_batch_accuracy


# --------------------------------------------------------------- what each optimization turns on

def is_channels_last(tensor):
    return tensor.is_contiguous(memory_format=torch.channels_last) and not tensor.is_contiguous()


class RecordingResNet10(common.ResNet10):
    """ResNet10 that notes what its first training forward saw: input and weight layout, the logits' dtype."""
    seen = {}

    def forward(self, images):
        outputs = super().forward(images)
        if self.training and not RecordingResNet10.seen:
            weight = self.layers[0].conv1.weight
            RecordingResNet10.seen.update(channels_last=(is_channels_last(images), is_channels_last(weight)),
                                          logits_dtype=outputs.dtype)
        return outputs


# script: (channels_last (input, weights), optimizer, label smoothing)
IN_EFFECT = {
    "baseline.py": ((False, False), None, 0.0),
    "opt1.py": ((False, False), "AdamW", 0.0),
    "opt2.py": ((False, False), "AdamW", 0.1),
    "opt3.py": ((True, True), "AdamW, fused", 0.1),
    "opt4.py": ((True, True), "AdamW, fused, rate in a tensor", 0.1),
    "opt5.py": ((True, True), "Muon", 0.1),
    "opt6.py": ((True, True), "Muon", 0.1),
}


@pytest.mark.parametrize("bfloat16_unit", [None, "AMX-BF16"])
@pytest.mark.parametrize("script", ALL_SCRIPTS)
def test_each_scripts_optimizations_are_in_effect(script, bfloat16_unit, monkeypatch, capsys):
    if bfloat16_unit and not common.bfloat16_unit():
        pytest.skip("this CPU has no bfloat16 unit: emulated bfloat16 would take minutes")
    created = {}

    class AdamW(torch.optim.AdamW):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            # the first made: from opt4 on, OneCycleLR's table (onecycle_schedule) steps a stand-in of its own
            kind = "AdamW" + ", fused" * bool(self.defaults["fused"]) + \
                ", rate in a tensor" * torch.is_tensor(self.defaults["lr"])
            created.setdefault("optimizer", kind)

    class Muon(getattr(ALL_SCRIPTS[script], "Muon", torch.optim.Optimizer)):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            created.update(optimizer="Muon", newton_schulz_dtype=self.dtype, newton_schulz_steps=self.steps)

    class CrossEntropyLoss(nn.CrossEntropyLoss):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            created["label_smoothing"] = self.label_smoothing

    RecordingResNet10.seen.clear()
    monkeypatch.setattr(common, "bfloat16_unit", lambda: bfloat16_unit)
    monkeypatch.setattr(common, "ResNet10", RecordingResNet10)
    monkeypatch.setattr(torch.optim, "AdamW", AdamW)
    monkeypatch.setattr(nn, "CrossEntropyLoss", CrossEntropyLoss)
    if hasattr(ALL_SCRIPTS[script], "Muon"):
        monkeypatch.setattr(ALL_SCRIPTS[script], "Muon", Muon)
    flags = [] if script == "baseline.py" else ["--no-compile"]
    flags += ["--workers", "0"] if script == "opt2.py" else []
    monkeypatch.setattr(sys, "argv", [script, *SMALL, *flags, "--epochs", "1", "--train-size", "80",
                                      "--batch-size", "16", "--test-size", "16"])
    ALL_SCRIPTS[script].main()
    seen = RecordingResNet10.seen
    assert (seen["channels_last"], created.get("optimizer"), created["label_smoothing"]) == IN_EFFECT[script]
    # The 16-bit type where the CPU has a bfloat16 unit, else float32; the baseline is always float32.
    expected = torch.bfloat16 if bfloat16_unit and script != "baseline.py" else torch.float32
    assert seen["logits_dtype"] == expected
    if created.get("optimizer") == "Muon":  # its Newton-Schulz matmuls too: emulated bfloat16 would be ~12x slower
        assert created["newton_schulz_dtype"] == expected
        assert created["newton_schulz_steps"] == 3  # --ns-steps' default reaches the optimizer
    lines = capsys.readouterr().out.splitlines()
    if script != "baseline.py":  # the run says which precision it chose, and why, before it trains
        precision = next(index for index, line in enumerate(lines) if line.startswith("precision: "))
        assert precision < next(index for index, line in enumerate(lines) if line.startswith("epoch 1:"))
        assert lines[precision].startswith("precision: bfloat16" if bfloat16_unit else "precision: float32")


@pytest.mark.parametrize("script", ALL_SCRIPTS)
def test_the_test_loss_is_computed_on_float32_logits(script, monkeypatch):
    # bfloat16 logits summed into a loss lose ~0.4 % (676.0 against 678.53 for one batch): upcast them first.
    losses_on, real_cross_entropy = [], nn.functional.cross_entropy

    def cross_entropy(outputs, *args, **kwargs):
        losses_on.append(outputs.dtype)
        return real_cross_entropy(outputs, *args, **kwargs)

    monkeypatch.setattr(nn.functional, "cross_entropy", cross_entropy)
    torch.manual_seed(0)
    model = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(3, 10))  # tiny: bfloat16 is quick anywhere
    dataset = common.synthetic_cifar10(32, train=False, transform=common.plain_transform())
    loader = DataLoader(dataset, batch_size=16)
    call(ALL_SCRIPTS[script].evaluate, model=model, loader=loader, test_data=opt4.load_to_device(
        common.synthetic_cifar10(32, train=False, transform=None), CPU), batch_size=16, amp_dtype=torch.bfloat16,
        device=CPU, size=32)
    # 32 images in batches of 16: 2 batches; from opt5 on, 8 images and their mirrors a batch: 4
    assert losses_on == [torch.float32] * (4 if script in ("opt5.py", "opt6.py") else 2)


# What torch.cpu.get_capabilities() reports on each kind of CPU (the keys that matter here).
CAPABILITIES = {
    "Intel Xeon with AMX": ({"avx512_bf16": True, "amx_bf16": True}, torch.bfloat16, "AMX-BF16"),
    "AMD EPYC, Zen 4": ({"avx512_bf16": True, "amx_bf16": False}, torch.bfloat16, "AVX-512 BF16"),
    "AMD EPYC, AVX2 only": ({"avx2": True, "avx512_bf16": False, "amx_bf16": False}, torch.float32, None),
    "Arm with BF16 (Graviton 3)": ({"neon": True, "bf16": True, "sve_bf16": True}, torch.bfloat16, "SVE BF16"),
    "Arm with BF16, no SVE": ({"neon": True, "bf16": True, "sve": False}, torch.bfloat16, "Arm BF16"),
    "Arm without BF16 (Graviton 2)": ({"neon": True, "bf16": False}, torch.float32, None),
}


@pytest.mark.parametrize("cpu", CAPABILITIES)
def test_bfloat16_only_on_a_cpu_that_runs_it_natively(cpu, monkeypatch):
    capabilities, dtype, unit = CAPABILITIES[cpu]
    monkeypatch.setattr(torch.cpu, "get_capabilities", lambda: {"cpu_name": "Test CPU", **capabilities})
    assert common.bfloat16_unit() == unit
    assert common.cpu_name() == f"Test CPU ({unit or 'no bf16 unit'})"
    for script in ("opt1.py", "opt2.py", *WHOLE_STEP):
        chosen, why = ALL_SCRIPTS[script].autocast_dtype(CPU)
        assert chosen == dtype and why.startswith(str(dtype).removeprefix("torch."))
        assert (unit in why) if unit else ("no bfloat16 unit" in why)


def test_on_a_gpu_opt1_on_pick_bfloat16_only_where_it_is_native_and_float16_elsewhere(monkeypatch):
    gpu, scripts = torch.device("cuda", 0), [script for script in ALL_SCRIPTS if script != "baseline.py"]
    # An Ampere or newer GPU: bfloat16 in hardware, float32's range: no GradScaler.
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: True)
    chosen = [ALL_SCRIPTS[script].autocast_dtype(gpu) for script in scripts]
    assert [dtype for dtype, _ in chosen] == [torch.bfloat16] * 6
    assert all(why.startswith("bfloat16 autocast: this GPU runs it natively") for _, why in chosen)
    # A T4 (sm_75): bfloat16 only emulated, which is_bf16_supported() counts unless told not to.
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: including_emulation)
    chosen = [ALL_SCRIPTS[script].autocast_dtype(gpu) for script in scripts]
    assert [dtype for dtype, _ in chosen] == [torch.float16] * 6
    assert all(why.startswith("float16 autocast: no bfloat16 below sm_80") for _, why in chosen)


def test_opt2_loader_workers_default_to_none_on_the_cpu_and_to_the_cores_it_may_use_but_one_with_a_gpu(monkeypatch):
    monkeypatch.setattr(os, "cpu_count", lambda: 64)  # the machine's cores: not what a container or Slurm allows
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)), raising=False)
    assert opt2.default_workers(CPU) == 0
    assert opt2.default_workers(torch.device("cuda", 0)) == 15
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {3}, raising=False)
    assert opt2.default_workers(torch.device("cuda", 0)) == 1
    monkeypatch.delattr(os, "sched_getaffinity", raising=False)  # macOS and Windows: the machine's count
    assert opt2.default_workers(torch.device("cuda", 0)) == 63
    monkeypatch.setattr(sys, "argv", ["opt2.py"])
    assert opt2.parse_args().workers is None, "None: main() picks by device"


# ------------------------------------------------------ float16 + GradScaler: a GPU path, run on the CPU

def train_float16_epoch(script, model, optimizer, scaler, images=64):
    """One epoch of `script`'s own train_one_epoch in float16 with `scaler`, as a GPU without bfloat16 runs it."""
    torch.manual_seed(0)
    loader = DataLoader(common.synthetic_cifar10(images, train=True, transform=common.normalized_transform()),
                        batch_size=16, shuffle=True)
    train_data = opt4.load_to_device(common.synthetic_cifar10(images, train=True, transform=None), CPU)
    scheduler = constant_schedule(optimizer)
    return call(ALL_SCRIPTS[script].train_one_epoch, model=model, loader=loader, train_data=train_data,
                criterion=nn.CrossEntropyLoss(), optimizer=optimizer, scheduler=scheduler, scaler=scaler,
                amp_dtype=torch.float16, accum_steps=1, keep_gradients=False, batch_size=16,
                generator=torch.Generator().manual_seed(0), augment_generator=torch.Generator().manual_seed(1),
                rank=0, world_size=1, device=CPU, epoch=1, monitor=NO_MONITOR, size=32)


@pytest.mark.parametrize("script", ["opt1.py", "opt2.py", "opt3.py", "opt4.py", "opt5.py", "opt6.py"])
def test_float16_with_grad_scaler_learns_and_moves_the_scale(script):
    model = small_net()
    optimizer = shipped_optimizer(script, model)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8, growth_interval=1)  # grows after every good step
    first_loss = train_float16_epoch(script, model, optimizer, scaler)[0]
    for _ in range(4):
        last_loss, accuracy, _, _ = train_float16_epoch(script, model, optimizer, scaler)
    assert last_loss < 0.5 * first_loss and accuracy > 0.5, "float16 training does not learn"
    assert scaler.get_scale() != 2.0**8, "the loss scale never moved"


@pytest.mark.parametrize("script", ["opt1.py", "opt2.py", "opt3.py", "opt4.py", "opt5.py", "opt6.py"])
@pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step:UserWarning")  # a skipped step
def test_a_float16_step_with_infinite_gradients_is_skipped(script):
    model = small_net()
    before = torch.nn.utils.parameters_to_vector(model.parameters()).detach().clone()
    optimizer = shipped_optimizer(script, model)
    # A scale of 2^100 overflows every float16 gradient: each step's gradients hold inf.
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**100)
    _, _, steps, _ = train_float16_epoch(script, model, optimizer, scaler, images=32)
    assert steps == 2
    after = torch.nn.utils.parameters_to_vector(model.parameters()).detach()
    assert torch.equal(after, before), "a step with inf gradients reached the weights"
    assert scaler.get_scale() == 2.0**98, "each skipped step halves the scale"


# ------------------------------------------------------------- the whole step: fixed addresses, accumulation

def tensors_of_the_step(run):
    """Every tensor the step reads or writes, by name: data, plan, weights, buffers, the optimizer's state and rate."""
    tensors = {"images": run.train_data[0], "labels": run.train_data[1], "statistics": run.statistics,
               **{f"plan.{name}": tensor for name, tensor in plan_tensors(run.plan).items()},
               **{f"model.{name}": tensor for name, tensor in run.model.state_dict(keep_vars=True).items()}}
    for number, optimizer in enumerate(optimizers_of(run)):  # opt5 on: Muon's and AdamW's
        for index, group in enumerate(optimizer.param_groups):
            tensors[f"optimizer{number}.group{index}.lr"] = group["lr"]
        for index, state in enumerate(optimizer.state.values()):
            tensors.update({f"optimizer{number}.state{index}.{name}": value for name, value in state.items()
                            if torch.is_tensor(value)})
    return tensors


@pytest.mark.parametrize("script", WHOLE_STEP)
def test_every_tensor_the_step_touches_keeps_its_address_across_steps_and_epochs(script):
    # What a CUDA graph replays is addresses: a tensor the step reads from or writes to anew would be missed.
    run, step = step_of(script, small_net(), common.synthetic_cifar10(128, train=True, transform=None), CPU)
    plan_the_epoch(ALL_SCRIPTS[script], run, 128, 1)
    step()  # the optimizer's state is made in the first step: on a GPU, before the capture
    addresses = {name: tensor.data_ptr() for name, tensor in tensors_of_the_step(run).items()}
    for epoch in (1, 2):
        plan_the_epoch(ALL_SCRIPTS[script], run, 128, epoch)
        for _ in range(len(run.plan.rates)):
            step()
            assert {name: tensor.data_ptr() for name, tensor in tensors_of_the_step(run).items()} == addresses
    assert run.plan.cursor.item() == 0 and len(addresses) > 20  # the last step of the epoch wrapped it to 0


def a_step(module, optimizers, model=None, steps=2, batch_size=4):
    """`module`'s training step over a plan of `steps` steps of zeros, for `optimizers`; at 32 px from opt5 on."""
    model = model or bn_free_net()
    step = module.make_train_step(model, nn.CrossEntropyLoss(), optimizers, bare_plan(module, steps, batch_size))
    return functools.partial(step, 32) if "size" in inspect.signature(step).parameters else step


def rate(value=0.01, **options):
    return torch.tensor(value, **options)


@pytest.mark.parametrize("script", WHOLE_STEP)
def test_the_step_takes_one_optimizer_or_a_list_each_reading_its_rate_on_the_device(script):
    module, model = ALL_SCRIPTS[script], bn_free_net()
    accepted = [torch.optim.AdamW(model.parameters(), lr=rate(), fused=True, capturable=True),
                torch.optim.Adam(model.parameters(), lr=rate(), capturable=True),
                torch.optim.SGD(model.parameters(), lr=rate(), momentum=0.9, nesterov=True, weight_decay=5e-4,
                                fused=True)]
    if hasattr(module, "Muon"):
        filters = [parameter for parameter in model.parameters() if parameter.ndim == 4]
        accepted.append(module.Muon(filters, rate()))
    for optimizer in accepted:
        a_step(module, [optimizer], model)
    sgd = accepted[2]
    before = [parameter.detach().clone() for parameter in model.parameters()]
    images, labels = module.load_to_device(common.synthetic_cifar10(8, train=True, transform=None), CPU)
    plan = module.empty_plan((images, labels), common.channel_statistics(images), 2, 2, 4)
    step = module.make_train_step(model, nn.CrossEntropyLoss(), sgd, plan)  # one optimizer, not in a list
    if "size" in inspect.signature(step).parameters:
        step = functools.partial(step, 32)
    module.plan_epoch(plan, module.draw_epoch(8, 4, 2, torch.Generator().manual_seed(0)), torch.full((2,), 0.5))
    step()
    assert sgd.param_groups[0]["lr"].item() == 0.5, "the plan's rate written into the one optimizer"
    assert all(not torch.equal(old, new) for old, new in zip(before, model.parameters())), "every weight moved"


def moved_rate(optimizer, device):
    """`optimizer` with its rate on `device`, away from its weights (as a rate on the CPU for weights on a GPU)."""
    optimizer.param_groups[0]["lr"] = optimizer.param_groups[0]["lr"].to(device)
    return optimizer


class OwnOptimizer(torch.optim.Optimizer):
    """A client's optimizer that says nothing of where its step reads its rate."""

    def __init__(self, parameters, lr):
        super().__init__(parameters, dict(lr=lr))


@pytest.mark.parametrize("script", WHOLE_STEP)
@pytest.mark.parametrize("make, says", [
    (lambda weights: torch.optim.SGD(weights, lr=0.01, momentum=0.9, fused=True),
     r"SGD's learning rate must be a float32 tensor on its weights' device \(cpu\), which each step writes in place: "
     r"SGD\(\.\.\., lr=torch\.tensor\(rate, device=device\), fused=True\)$"),
    (lambda weights: torch.optim.SGD(weights, lr=rate(), momentum=0.9),
     r"^SGD needs fused=True in a CUDA graph \(it reads the rate on the host\): "
     r"SGD\(\.\.\., lr=torch\.tensor\(rate, device=device\), fused=True\)$"),
    (lambda weights: torch.optim.AdamW(weights, lr=rate(), fused=True),
     r"^AdamW needs capturable=True in a CUDA graph \(torch refuses to capture it otherwise\): "
     r"AdamW\(\.\.\., lr=torch\.tensor\(rate, device=device\), capturable=True\)$"),
    (lambda weights: torch.optim.Adam(weights, lr=rate(dtype=torch.float64), capturable=True),
     r"^Adam's learning rate must be a float32 tensor"),
    (lambda weights: moved_rate(torch.optim.AdamW(weights, lr=rate(), fused=True, capturable=True), "meta"),
     r"^AdamW's learning rate must be a float32 tensor on its weights' device \(cpu\)"),
    (lambda weights: OwnOptimizer(weights, lr=rate()),
     r"^OwnOptimizer does not say its step reads its rate on the device: use torch's AdamW with capturable=True or "
     r"SGD with fused=True, or give yours a default capturable=True if so$"),
], ids=["float rate", "SGD unfused", "AdamW uncapturable", "float64 rate", "rate elsewhere", "an optimizer unknown"])
def test_the_step_refuses_an_optimizer_a_graph_could_not_replay_in_one_line_naming_the_form_to_use(script, make, says):
    # on every device: a CPU run refuses what a GPU's capture would fail on (or, for a float rate, silently keep)
    model = bn_free_net()
    with pytest.raises(TypeError, match=says) as refused:
        a_step(ALL_SCRIPTS[script], [torch.optim.AdamW(model.parameters(), lr=rate(), fused=True, capturable=True),
                                     make(list(model.parameters()))], model)
    assert "\n" not in str(refused.value)


@pytest.mark.parametrize("script", WHOLE_STEP)
def test_a_clients_fused_sgd_through_the_step_ends_where_its_own_loop_with_a_float_rate_does(script):
    # A client's SGD kept (momentum, Nesterov, weight decay), its rate a tensor and fused=True as the step asks, fed
    # the plan's batches without crops or flips; its own loop takes the same batches with a float rate each step
    module, steps, batch_size = ALL_SCRIPTS[script], 8, 16
    dataset = common.synthetic_cifar10(steps * batch_size, train=True, transform=None)
    images, labels = module.load_to_device(dataset, CPU)
    statistics = common.channel_statistics(images)
    plan = module.empty_plan((images, labels), statistics, 2, steps, batch_size)
    rates = torch.linspace(0.05, 0.005, steps)

    def sgd(model, lr):
        return torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, nesterov=True, weight_decay=5e-4,
                               fused=isinstance(lr, torch.Tensor))

    # an NCHW model, converted as the graph row says: the model in channels_last, the layout of the step's images
    stepped, looped = (small_net().to(memory_format=torch.channels_last) for _ in range(2))
    step = module.make_train_step(stepped, nn.CrossEntropyLoss(), sgd(stepped, rate()), plan)
    step = functools.partial(step, 32) if "size" in inspect.signature(step).parameters else step
    client, generator, losses = sgd(looped, 0.05), torch.Generator().manual_seed(0), []
    for _ in range(2):
        batches = module.draw_epoch(len(labels), batch_size, 2, generator)[0]
        centred = torch.full((steps, 2, batch_size, 1), 2), torch.zeros(steps, batch_size, 1, dtype=torch.bool)
        module.plan_epoch(plan, (batches, *centred), rates)
        for indices, lr in zip(batches, rates.tolist()):
            step()
            client.param_groups[0]["lr"] = lr
            inputs = module.normalize(images[indices], statistics).contiguous(memory_format=torch.channels_last)
            loss = F.cross_entropy(looped(inputs), labels[indices])
            loss.backward()
            client.step()
            client.zero_grad()
            losses.append(loss.item())
    assert torch.allclose(plan.losses, torch.tensor(losses[steps:]), rtol=1e-4, atol=1e-5), (plan.losses, losses)
    differences = [(a - b).abs().max().item() for a, b in zip(stepped.state_dict().values(),
                                                                 looped.state_dict().values()) if a.is_floating_point()]
    moved = max((a - b).abs().max().item() for a, b in zip(stepped.state_dict().values(),
                                                          small_net().state_dict().values()) if a.is_floating_point())
    # the weights within 1e-6 of the loop's (2.8e-9 on a 2-core AMD EPYC, torch 2.14.1: fused and looped SGD sum in
    # another order), for a model and its images in channels_last, where they moved by more than 1e-2
    assert max(differences) < 1e-6 and moved > 1e-2, (differences, moved)
    assert losses[-1] < 0.8 * losses[0], "it trained"


@pytest.mark.parametrize("script", ["opt4.py", "opt6.py"])
def test_opt4_accumulating_k_micro_batches_equals_one_big_batch(script, monkeypatch):
    monkeypatch.setattr(torch, "autocast", lambda *args, **kwargs: contextlib.nullcontext())  # float32
    monkeypatch.setattr(ALL_SCRIPTS[script], "augment", lambda images, offsets, flips, padding: images)  # crops differ

    def weights_after_one_epoch(batch_size, accum_steps):
        model = bn_free_net()
        optimizer = shipped_optimizer(script, model, lr=1e-2)
        dataset = common.synthetic_cifar10(24, train=True, transform=None)
        _, _, steps, images = call(
            ALL_SCRIPTS[script].train_one_epoch, model=model, train_data=opt4.load_to_device(dataset, CPU),
            criterion=nn.CrossEntropyLoss(), optimizer=optimizer,
            scheduler=constant_schedule(optimizer),
            scaler=torch.amp.GradScaler("cpu", enabled=False), amp_dtype=torch.float32, accum_steps=accum_steps,
            keep_gradients=accum_steps > 1, batch_size=batch_size, generator=torch.Generator().manual_seed(0),
            augment_generator=None, rank=0, world_size=1, device=CPU, epoch=1, monitor=NO_MONITOR, size=32)
        return torch.nn.utils.parameters_to_vector(model.parameters()).detach(), steps, images

    big_batch, steps, _ = weights_after_one_epoch(12, 1)
    accumulated, accumulated_steps, images = weights_after_one_epoch(4, 3)
    assert (steps, accumulated_steps, images) == (2, 2, 24)
    assert torch.allclose(accumulated, big_batch, atol=1e-5)
    one_step, _, _ = weights_after_one_epoch(24, 1)
    assert not torch.allclose(one_step, big_batch, atol=1e-3), "the comparison must be able to fail"

# ---------------------------------------------------- opt5: progressive resizing, evaluation cadence

def test_opt5_image_sizes_end_with_the_full_sizes_share_and_split_the_rest_equally():
    sizes = {epochs: opt5.image_sizes(epochs, 16, 32, 0.3) for epochs in (1, 2, 3, 4, 5, 6, 7)}
    assert sizes == {1: [32], 2: [16, 32], 3: [16, 24, 32], 4: [16, 16, 24, 32], 5: [16, 16, 24, 32, 32],
                     6: [16, 16, 24, 24, 32, 32], 7: [16, 16, 16, 24, 24, 32, 32]}
    twenty = opt5.image_sizes(20, 16, 32, 0.3)  # the 20-epoch recipe: 7, 7 and 6 epochs
    assert [twenty.count(size) for size in (16, 24, 32)] == [7, 7, 6] and twenty == sorted(twenty)
    assert opt5.image_sizes(12, 16, 32, 0.4) == [16] * 4 + [24] * 3 + [32] * 5  # 5 of 12 is 42 %
    assert opt5.image_sizes(4, 8, 32, 0.3) == [8, 16, 24, 32]
    assert opt5.image_sizes(3, 32, 32, 0.3) == [32, 32, 32]
    assert opt5.image_sizes(3, 16, 32, 0) == [16, 24, 32], "the last epoch is always at the full size"
    assert opt5.image_sizes(5, 16, 64, 0.3) == [16, 32, 48, 64, 64]


def test_opt5_downscale_averages_each_pixels_area():
    stripes = torch.arange(32.0).remainder(2).expand(1, 3, 32, 32)  # columns 0, 1, 0, 1, ...: mean 0.5
    for size in (16, 24):
        small = opt5.downscale(stripes, size)
        assert small.shape == (1, 3, size, size)
        # Bilinear sampling would alias the stripes into a new pattern at 24x24 (0.17 to 0.83; antialiased 0.3 to 0.7).
        assert torch.equal(small, torch.full_like(small, 0.5)), size
    assert opt5.downscale(stripes, 32) is stripes
    assert opt5.downscale(torch.rand(1, 3, 64, 64), 32).shape == (1, 3, 32, 32), "images of any size"


def test_opt5_trains_every_size_on_its_one_batch_under_one_onecycle_table_sliced_per_epoch(monkeypatch, tmp_path):
    batches, schedules, json_path = {"train": [], "eval": []}, [], tmp_path / "result.json"

    class BatchRecordingResNet10(common.ResNet10):
        def forward(self, images):
            batches["train" if self.training else "eval"].append(tuple(images.shape[::3]))  # (images, side)
            return super().forward(images)

    plan_epoch = opt5.plan_epoch

    def recorded_plan_epoch(plan, draw, rates):
        plan_epoch(plan, draw, rates)
        schedules.append((plan.rates.clone(), plan.rates.data_ptr()))
    monkeypatch.setattr(common, "ResNet10", BatchRecordingResNet10)
    monkeypatch.setattr(opt5, "plan_epoch", recorded_plan_epoch)
    # 128 images: 4 steps of 32 at 16x16, at 24x24 and at 32x32, one OneCycleLR table of 12 steps, 4 rows an epoch
    monkeypatch.setattr(sys, "argv", ["opt5.py", *SMALL, "--epochs", "3", "--train-size", "128", "--batch-size", "32",
                                      "--monitor-size", "64", "--json", str(json_path)])
    opt5.main()
    assert batches["train"] == [(32, 16)] * 4 + [(32, 24)] * 4 + [(32, 32)] * 4
    # evaluated in the training batch's shape at each size: half a batch of images and their mirrors
    assert batches["eval"] == [(32, 16)] * 4 + [(32, 24)] * 4 + [(32, 32)] * 16
    assert torch.equal(torch.cat([rows for rows, _ in schedules]), opt5.onecycle_schedule(0.016, 12, CPU))
    assert len({address for _, address in schedules}) == 1, "one plan: every size's step reads the same buffers"
    report = read_json(json_path)
    assert [(epoch["steps"], epoch["images"]) for epoch in report["epochs"]] == [(4, 128)] * 3
    assert "min_size_batch" not in report["settings"]


@pytest.mark.parametrize("args, says", [
    (["--full-size-share", "1"], "--full-size-share: must be at least 0 and below 1"),
])
def test_opt5_resizing_flags_are_checked(args, says):
    result = run_python("opt5.py", *SMALL, *args)
    assert result.returncode == 2 and result.stderr.count("\n") == 1 and says in result.stderr, result.stderr


class SizeRecordingResNet10(common.ResNet10):
    """ResNet10 that records the side of every batch it sees, in training and in evaluation."""
    seen = {"train": [], "eval": []}

    def forward(self, images):
        SizeRecordingResNet10.seen["train" if self.training else "eval"].append(images.shape[-1])
        return super().forward(images)


def test_opt5_trains_each_epoch_on_its_image_size_and_evaluates_all_test_images_only_at_the_end(tmp_path,
                                                                                                   monkeypatch):
    for images in SizeRecordingResNet10.seen.values():
        images.clear()
    json_path, weights = tmp_path / "result.json", tmp_path / "weights.pt"
    monkeypatch.setattr(common, "ResNet10", SizeRecordingResNet10)
    evaluated, real_evaluate = [], opt5.evaluate
    monkeypatch.setattr(opt5, "evaluate", lambda run, test_data, size: evaluated.append(test_data) or
                        real_evaluate(run, test_data, size))
    # 4 steps of 32 images per epoch; 256 test images in batches of 32, 64 of them after epochs 1 and 2. AdamW: in
    # the warm-up of 12 steps its steps are larger than Muon's, which would leave the test loss where it was.
    monkeypatch.setattr(sys, "argv", ["opt5.py", *SMALL, "--no-compile", "--epochs", "3", "--train-size", "128",
                                      "--batch-size", "32", "--monitor-size", "64", "--optimizer", "adamw",
                                      "--json", str(json_path),
                                      "--save", str(weights)])
    opt5.main()
    seen = SizeRecordingResNet10.seen
    assert seen["train"] == [16] * 4 + [24] * 4 + [32] * 4
    # A 64-image subset at the size just trained on after epochs 1 and 2, all 256 at 32x32 after the last: 16 images
    # and their mirrors a batch, the training batch's shape
    assert seen["eval"] == [16] * 4 + [24] * 4 + [32] * 16
    report = read_json(json_path)
    assert [epoch["image_size"] for epoch in report["epochs"]] == [16, 24, 32]
    assert [epoch["test_images"] for epoch in report["epochs"]] == [64, 64, 256]
    # The subset is the same after every epoch, and random: the first 64 of a set stored by class would be one class.
    (first_images, first_labels), (second_images, _), (all_images, all_labels) = evaluated
    assert torch.equal(first_images, second_images)
    subset = [image_hash(image) for image in first_images]
    assert len(set(subset)) == 64 and set(subset) < {image_hash(image) for image in all_images}
    assert subset != [image_hash(image) for image in all_images[:64]]
    assert sorted(first_labels.tolist()) != sorted(all_labels[:64].tolist())
    assert report["steady_images_per_second"] is None, "the speeds of 16x16 and 32x32 epochs do not add up"
    launch = [epoch["launch_seconds"] for epoch in report["epochs"]]
    assert 0 < launch[0] < launch[1] < launch[2] == report["launch_to_result_seconds"]
    assert report["epochs"][-1]["train_loss"] < report["epochs"][0]["train_loss"]
    assert_saved_weights_match_the_report(weights, report, opt5, transform=None)


# ------------------------------------------------------------------- opt5: Muon for the convolution filters

@pytest.mark.skipif(not hasattr(torch.optim, "Muon"), reason="torch.optim.Muon arrived in torch 2.9")
@pytest.mark.parametrize("ns_steps", [3, 5])  # opt5's default, torch's
def test_opt5_muon_steps_a_filter_as_torch_optim_muon_steps_its_matrix(ns_steps):
    torch.manual_seed(0)
    filter_ = torch.randn(16, 8, 3, 3)
    # A 3x3 filter, channels_last as in the scripts; torch's Muon takes its 16 x 72 matrix (2-D weights only). A tall
    # one too (the stem's 64 x 27 is tall: orthogonalize turns it wide), as its transpose's 1x1 filter
    tall = torch.randn(72, 16, 1, 1)
    ours = [nn.Parameter(filter_.contiguous(memory_format=torch.channels_last)), nn.Parameter(tall.clone())]
    theirs = [nn.Parameter(filter_.flatten(1).clone()), nn.Parameter(tall.flatten(1).clone())]
    # its rate a float32 tensor, as main() builds it
    muon = opt5.Muon(ours, torch.tensor(0.01), weight_decay=0.05, dtype=torch.bfloat16, steps=ns_steps)
    # The same coefficients (torch's defaults, in bfloat16) and steps, Nesterov momentum 0.9, and the update scaled to
    # AdamW's size (Moonlight's 0.2 sqrt(max(rows, columns)))
    reference = torch.optim.Muon(theirs, lr=0.01, weight_decay=0.05, momentum=0.9, nesterov=True, ns_steps=ns_steps,
                                 adjust_lr_fn="match_rms_adamw")
    for _ in range(3):
        gradients = torch.randn(16, 8, 3, 3), torch.randn(72, 16, 1, 1)
        ours[0].grad = gradients[0].contiguous(memory_format=torch.channels_last)
        ours[1].grad, theirs[0].grad, theirs[1].grad = gradients[1].clone(), gradients[0].flatten(1), \
            gradients[1].flatten(1)
        muon.step()
        reference.step()
    for ours_, theirs_, start in zip(ours, theirs, (filter_.flatten(1), tall.flatten(1))):
        moved = (theirs_ - start).abs().mean()  # what 3 steps moved each weight, on average
        assert moved > 1e-3
        # Both orthogonalize in bfloat16, from weights that differ in float32's last bits (our rate is a float32
        # tensor, torch's 0.01 a double): an entry can round to the next bfloat16 value, 2^-8 of it, at each step
        step_size = 0.01 * 0.2 * 72 ** 0.5  # the rate scaled to AdamW's size: an orthogonalized entry is at most ~1
        torch.testing.assert_close(ours_.detach().flatten(1), theirs_.detach(), rtol=0, atol=3 * step_size * 2**-8)


@pytest.mark.parametrize("script", ["opt5.py", "opt6.py"])
def test_muon_leaves_a_filter_without_a_gradient_and_steps_the_others_as_without_it(script):
    # ablation.py's whitening row freezes the stem: a filter without a gradient is skipped, and gets no state
    torch.manual_seed(0)
    frozen, moving = nn.Parameter(torch.randn(16, 8, 3, 3)), nn.Parameter(torch.randn(32, 16, 3, 3))
    reference = nn.Parameter(moving.detach().clone())
    module = ALL_SCRIPTS[script]
    muon = module.Muon([frozen, moving], torch.tensor(0.01), dtype=torch.float32, steps=3)
    alone = module.Muon([reference], torch.tensor(0.01), dtype=torch.float32, steps=3)
    before, start = frozen.detach().clone(), moving.detach().clone()
    for _ in range(2):
        moving.grad = torch.randn(32, 16, 3, 3)
        reference.grad = moving.grad.clone()
        muon.step()
        alone.step()
    assert torch.equal(frozen, before) and not muon.state[frozen], "the frozen filter or its state moved"
    assert torch.equal(moving, reference) and not torch.equal(moving, start)


VIEWS = {"view", "reshape", "_reshape_alias", "t", "numpy_T", "transpose", "mT", "permute", "expand", "as_strided", "unsqueeze",
         "squeeze", "select", "slice", "alias", "_unsafe_view", "detach", "flatten", "unflatten", "narrow", "to",
         "view_as", "contiguous", "empty", "empty_like", "empty_strided", "split", "unbind", "lift_fresh"}


def launched_ops(step):
    """How many ops `step()` runs that launch a kernel: the outermost aten ops, each counted if it or an op inside it
    is not a view (a to() or flatten() that copies counts, one that returns a view does not)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        step()
    events = [event for event in profile.events() if event.name.startswith("aten::")]
    launches = lambda event: event.name[len("aten::"):] not in VIEWS or any(map(launches, event.cpu_children))
    outermost = [event for event in events if event.cpu_parent is None or not event.cpu_parent.name.startswith("aten::")]
    return sum(map(launches, outermost))


@pytest.mark.parametrize("script", ["opt5.py", "opt6.py"])
def test_muon_step_on_resnet10_launches_the_same_249_ops_every_step_and_reads_nothing_on_the_host(script):
    module = ALL_SCRIPTS[script]
    filters = [p for p in common.ResNet10().to(memory_format=torch.channels_last).parameters() if p.ndim == 4]
    for filter_ in filters:
        filter_.grad = torch.randn_like(filter_)
    # its rate a tensor, as main() builds it: read on the device, so a captured step keeps none baked in
    muon = module.Muon(filters, torch.tensor(0.01), dtype=torch.bfloat16, steps=3)
    first = launched_ops(muon.step)  # it makes each filter's momentum: 12 zeros_like
    later = [launched_ops(muon.step) for _ in range(2)]
    with CountHostReads() as counter, CountScalarReads() as scalars:
        muon.step()
    assert (counter.reads, scalars.reads) == ([], 0), "a host read would wait for the GPU at every step"
    # For each of the 12 filters: the decay factor (2 ops on the rate tensor), weight decay, momentum, Nesterov, the
    # cast to bfloat16, norm, clamp, divide, 3 Newton-Schulz steps of 3 matmuls, the rate times the update and the
    # add: 20; and the 9 3x3 filters' copies out of channels_last (a 1x1 filter's flatten is a view). The batched
    # form (ablation.py's muon-other-form) takes 94
    assert later == [12 * 20 + 9] * 2 == [249] * 2 and first == 249 + 12


@pytest.mark.parametrize("shape", [(64, 27), (27, 64), (128, 1152)])  # the stem, its transpose, a layer-2 filter
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("steps", [3, 5])
def test_opt5_orthogonalize_takes_every_singular_value_near_1(shape, dtype, steps):
    torch.manual_seed(0)
    matrix = torch.randn(shape) * torch.logspace(0, -1, shape[1])  # singular values spread over 10x
    result = opt5.orthogonalize(matrix, steps=steps, dtype=dtype)  # one 2-D matrix, wide or tall
    assert result.shape == shape and result.dtype == dtype
    singular_values = torch.linalg.svdvals(result.float())
    assert 0.6 < singular_values.min() and singular_values.max() < 1.25, singular_values.aminmax()
    # a tall matrix is orthogonalized as its wide transpose (the smaller Gram matrix), then turned back
    torch.testing.assert_close(opt5.orthogonalize(matrix.T, steps=steps, dtype=dtype), result.T)


@pytest.mark.parametrize("steps, reached", [(3, [False, False, True]), (5, [False, True, True])])
def test_opt5_orthogonalize_leaves_the_singular_values_under_its_threshold_below_1(steps, reached):
    # Singular values 1/1000, 1/100 and 1/10 of the Frobenius norm (a fourth makes the norm 1): 3 steps take those
    # above 1/56 of it to 0.68 or more, 5 steps those above 1/660, as orthogonalize's docstring says
    small = torch.tensor([1e-3, 1e-2, 1e-1], dtype=torch.float64)
    singular_values = torch.cat([small, (1 - small.square().sum()).sqrt().view(1)])
    basis, _ = torch.linalg.qr(torch.randn(64, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(0)))
    result = opt5.orthogonalize(basis * singular_values, steps=steps, dtype=torch.float64)
    # Orthogonal columns stay orthogonal: each column's length is its singular value after the steps
    assert [length > 0.68 for length in result.norm(dim=0)[:3].tolist()] == reached, result.norm(dim=0)


@pytest.mark.parametrize("optimizer", ["muon", "adamw"])
def test_opt5_optimizer_step_gives_each_optimizer_the_schedules_rate_and_steps_every_weight(optimizer):
    # run.optimizers: Muon's for the filters then AdamW's for the rest, or AdamW's alone (--optimizer adamw), each
    # weight in one of them; optimizer_step writes each group's rate tensor from the plan's row and steps them all
    model = small_net()
    parameters = list(model.parameters())
    optimizers = shipped_optimizer("opt5.py", model, dtype=torch.float32) if optimizer == "muon" else \
        [opt5.adamw(parameters, 0.01, CPU)]  # as main() builds them
    assert [type(each).__name__ for each in optimizers] == (["Muon", "AdamW"] if optimizer == "muon" else ["AdamW"])
    stepped = [parameter for each in optimizers for group in each.param_groups for parameter in group["params"]]
    assert sorted(map(id, stepped)) == sorted(map(id, parameters)), "each weight in exactly one optimizer"
    run = SimpleNamespace(optimizers=optimizers, scaler=torch.amp.GradScaler("cpu", enabled=False),
                          plan=bare_plan(opt5, 2, 8))
    run.plan.rates.copy_(torch.tensor([0.004, 0.002]))
    before = [parameter.detach().clone() for parameter in parameters]
    for step in range(2):
        for parameter in parameters:
            parameter.grad = torch.ones_like(parameter)
        opt5.optimizer_step(run.optimizers, run.plan, run.scaler)
        # each group of each optimizer, Muon's and AdamW's, stepped at this step's rate; the cursor wraps after step 2
        rates = {group["lr"].item() for each in optimizers for group in each.param_groups}
        assert rates == {run.plan.rates[step].item()} and run.plan.cursor.item() == (step + 1) % 2
    assert all(not torch.equal(parameter, old) for parameter, old in zip(parameters, before)), "every weight moved"


# ------------------------------------------ opt3 -> opt4: the same math, the mechanism changed; the step's fallback

def tiny_resnet():
    """A stand-in for ResNet10 with what matters here (convolutions, BatchNorm, a linear head), fast on a CPU."""
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU(),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 10))


@pytest.mark.parametrize("script", ["opt2.py", "opt3.py"])
def test_opt2_and_opt3_onecycle_moves_the_rate_and_keeps_beta1_at_adamws_0_9(script, monkeypatch):
    # cycle_momentum=False: beta1 a plain number, as opt4's captured step keeps it (OneCycleLR would cycle it 0.95-0.85)
    seen = []

    class AdamW(torch.optim.AdamW):
        def step(self, *args, **kwargs):
            seen.extend((group["betas"][0], float(group["lr"])) for group in self.param_groups)
            return super().step(*args, **kwargs)
    monkeypatch.setattr(common, "ResNet10", tiny_resnet)
    monkeypatch.setattr(torch.optim, "AdamW", AdamW)
    workers = ["--workers", "0"] if script == "opt2.py" else []
    monkeypatch.setattr(sys, "argv", [script, *SMALL, "--epochs", "2", "--train-size", "64", "--batch-size", "16",
                                      "--test-size", "16", "--no-compile", *workers])
    ALL_SCRIPTS[script].main()
    assert len(seen) >= 8 and {beta1 for beta1, _ in seen} == {0.9}
    assert len({rate for _, rate in seen}) >= 4, "the rate moves at every step"


def test_opt3s_loop_and_opt4s_step_give_the_same_losses_in_float32(monkeypatch, tmp_path):
    # 2 epochs of 2,048 images, as each script ships (beta1 fixed at AdamW's 0.9 in both, from opt2 on): the split
    # changed how the step runs (a loop on the host; one function on the plan's buffers), not what it computes
    monkeypatch.setattr(common, "ResNet10", tiny_resnet)

    def losses_and_weights(script):
        module, losses = ALL_SCRIPTS[script], []
        monkeypatch.setattr(module, "autocast_dtype", lambda device: (torch.float32, "float32"))
        monkeypatch.setattr(common, "check_finite", lambda loss, epoch, step: losses.append(loss))
        monkeypatch.setattr(sys, "argv", [script, *SMALL, "--epochs", "2", "--train-size", "2048", "--batch-size",
                                          "64", "--save", str(tmp_path / f"{script}.pt")])
        module.main()
        return torch.tensor(losses), torch.load(tmp_path / f"{script}.pt")

    (loop, loop_weights), (step, step_weights) = losses_and_weights("opt3.py"), losses_and_weights("opt4.py")
    assert len(loop) == len(step) == 64
    assert torch.allclose(loop, step, rtol=1e-4, atol=1e-5), (loop - step).abs().max()
    # the rate a float in one, a float32 tensor in the other: AdamW turns the rounding into steps of ~1e-4 at most
    assert all(torch.allclose(loop_weights[name].float(), step_weights[name].float(), atol=2e-4) for name in loop_weights)
    assert not torch.allclose(loop[1:], step[:-1], rtol=1e-4, atol=1e-5), "the comparison must be able to fail"


class ConvolutionShapes:
    """Records the input shape of every convolution a model runs, apart for training and for evaluation."""

    def __init__(self, model):
        self.training, self.evaluation = set(), set()
        for module in model.modules():
            if isinstance(module, nn.Conv2d):
                module.register_forward_pre_hook(self.record)

    def record(self, module, inputs):
        (self.training if module.training else self.evaluation).add((module.in_channels, *inputs[0].shape))


@pytest.mark.parametrize("script, flags", [("opt3.py", []), ("opt4.py", []),
                                           ("opt5.py", ["--epochs", "3", "--monitor-size", "40"])])
def test_the_evaluation_runs_only_the_convolution_shapes_training_ran(script, flags, monkeypatch):
    # cuDNN's autotuner times every new input shape once, ~1 s a shape on an H200: the evaluation's batches (the image
    # and its mirror, the last one padded) are the training batch's shape at each size, so it times nothing new
    shapes, resnet10 = [], common.ResNet10

    def recorded_resnet():
        model = resnet10()
        shapes.append(ConvolutionShapes(model))
        return model
    monkeypatch.setattr(common, "ResNet10", recorded_resnet)
    monkeypatch.setattr(sys, "argv", [script, *SMALL, "--epochs", "2", "--train-size", "128", "--test-size", "50",
                                      "--batch-size", "16", *flags])
    ALL_SCRIPTS[script].main()
    seen = shapes[0]  # the script's own model: the report counts FLOPs on models of its own
    assert seen.evaluation and seen.evaluation <= seen.training, seen.evaluation - seen.training
    assert {shape[1] for shape in seen.evaluation} == {16}


class FailingCapture(TorchFunctionMode):
    """A capture that fails at the step's first op: a real capture runs none of the step's kernels either."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        raise RuntimeError("CUDA error: operation not permitted when stream is capturing\nmore lines of it")


@pytest.mark.parametrize("script", WHOLE_STEP)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_the_step_refuses_a_model_cast_to_16_bits_in_one_line_that_says_to_pass_amp_dtype(script, dtype):
    # A client's model.half() behind a flag: without the check, a dtype mismatch deep in the first forward
    module, model = ALL_SCRIPTS[script], small_net()
    optimizer = torch.optim.AdamW(model.parameters(), lr=torch.tensor(0.01), fused=True, capturable=True)
    model.to(dtype)
    with pytest.raises(TypeError) as refused:
        module.make_train_step(model, nn.CrossEntropyLoss(), optimizer, bare_plan(module, 2, 4))
    message = str(refused.value)
    assert "\n" not in message and f"{dtype}, not float32" in message and "model.half()" in message, message
    assert "amp_dtype=torch.float16" in message
    module.make_train_step(model.float(), nn.CrossEntropyLoss(), optimizer, bare_plan(module, 2, 4))  # float32: taken


def stub_the_capture(monkeypatch, graph, current):
    """torch.cuda's graph calls, for cuda_graph on the CPU: `graph` as torch.cuda.graph, a replay that fails the test,
    and streams whose current one is current["stream"] (the side stream is the current one's)."""
    monkeypatch.setattr(torch.cuda, "CUDAGraph", lambda: SimpleNamespace(replay=lambda: pytest.fail("replayed")))
    monkeypatch.setattr(torch.cuda, "graph", graph)
    monkeypatch.setattr(torch.cuda, "Stream", lambda: current["stream"])
    monkeypatch.setattr(torch.cuda, "current_stream", lambda: current["stream"])
    monkeypatch.setattr(torch.cuda, "set_stream", lambda stream: current.update(stream=stream))
    monkeypatch.setattr(torch.cuda, "stream", lambda stream: contextlib.nullcontext())


def test_a_capture_that_fails_says_why_in_one_line_and_the_step_runs_uncaptured_with_no_step_lost(monkeypatch,
                                                                                               capsys):
    default, capturing = (SimpleNamespace(name=name, wait_stream=lambda stream: None) for name in ("default", "capture"))
    current = {"stream": default}

    @contextlib.contextmanager
    def failing_graph(graph):  # as torch.cuda.graph: its own stream, then capture_end fails and leaves it current
        current["stream"] = capturing
        try:
            with FailingCapture():
                yield
        except RuntimeError:
            raise RuntimeError("CUDA error: operation failed due to a previous error during capture")

    stub_the_capture(monkeypatch, failing_graph, current)
    monkeypatch.setattr(torch, "autocast", lambda *args, **kwargs: contextlib.nullcontext())  # float32
    dataset = common.synthetic_cifar10(256, train=True, transform=None)

    def weights_after_an_epoch(wrap):
        run, step = step_of("opt4.py", small_net(), dataset, CPU)
        step = wrap(step)
        plan_the_epoch(opt4, run, 256, 1)
        for _ in range(len(run.plan.rates)):  # 8 steps: 3 warm-up, the capture that fails, 4 more
            step()
        steps_taken = next(iter(optimizers_of(run)[0].state.values()))["step"].item()  # AdamW's count of its steps
        return torch.nn.utils.parameters_to_vector(run.model.parameters()).detach(), steps_taken

    wrapped, wrapped_steps = weights_after_an_epoch(lambda step: opt4.cuda_graph(step, torch.device("cuda")))
    lines = capsys.readouterr().out.splitlines()
    called, called_steps = weights_after_an_epoch(lambda step: step)
    # the op's error, not capture_end's after it; the stream current before the capture is current again
    assert lines == ["step: not captured (RuntimeError: CUDA error: operation not permitted when stream is capturing);"
                     " this step and the rest run as a function"]
    assert current["stream"] is default
    assert wrapped_steps == called_steps == 8 and torch.allclose(wrapped, called)


def device_tensors(run):
    """Every tensor a training step of `run` writes: weights and buffers, the optimizers' rates and state, the plan."""
    optimizers = optimizers_of(run)
    return [*run.model.parameters(), *run.model.buffers(), *plan_tensors(run.plan).values(),
            *(group["lr"] for optimizer in optimizers for group in optimizer.param_groups),
            *(value for optimizer in optimizers for state in optimizer.state.values() for value in state.values()
              if torch.is_tensor(value))]


@pytest.mark.parametrize("script", ["opt4.py", "opt5.py", "opt6.py"])
def test_a_capture_that_fails_after_recording_the_whole_step_counts_that_step_once(script, monkeypatch, capsys):
    # On a GPU an op that cannot be captured can fail the capture at its end, after the step's Python ran whole: its
    # kernels recorded, none of them run. Here the capture runs the step, then puts back every tensor the step wrote
    module, capturing = ALL_SCRIPTS[script], {"now": False}
    monkeypatch.setattr(torch, "autocast", lambda *args, **kwargs: contextlib.nullcontext())  # float32
    dataset = common.synthetic_cifar10(256, train=True, transform=None)
    run, step = step_of(script, small_net(), dataset, CPU)

    @contextlib.contextmanager
    def capture_that_fails_at_its_end(graph):
        tensors = device_tensors(run)
        before = [tensor.detach().clone() for tensor in tensors]
        capturing["now"] = True
        try:
            yield
        finally:
            capturing["now"] = False
            with torch.no_grad():
                for tensor, value in zip(tensors, before):  # recorded, not run: the device is as it was
                    tensor.copy_(value)
        raise RuntimeError("CUDA error: operation not permitted when stream is capturing")

    stub_the_capture(monkeypatch, capture_that_fails_at_its_end,
                     {"stream": SimpleNamespace(wait_stream=lambda stream: None)})
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: capturing["now"])
    captured = module.cuda_graph(step, torch.device("cuda"))
    plan_the_epoch(module, run, 256, 1)
    for _ in range(len(run.plan.rates)):  # 8 steps: 3 warm-up, the capture that fails and its step uncaptured, 4 more
        captured()
    assert "step: not captured (RuntimeError: CUDA error: operation not permitted" in capsys.readouterr().out
    assert run.plan.steps_left == 0 and run.plan.cursor.item() == 0, "8 steps counted, the cursor back to the first"
    weights = torch.nn.utils.parameters_to_vector(run.model.parameters()).detach()

    run, step = step_of(script, small_net(), dataset, CPU)
    plan_the_epoch(module, run, 256, 1)
    for _ in range(len(run.plan.rates)):
        step()
    assert torch.equal(weights, torch.nn.utils.parameters_to_vector(run.model.parameters()).detach())
