"""opt4.py: opt3.py + the whole training step as one function on buffers at fixed addresses, which a GPU
captures once as a CUDA graph and replays: one launch a step instead of a Python call, a dispatch and a
launch for each of its hundreds of kernels.

    python opt4.py --epochs 5               # CIFAR-10 in ./data, downloaded if missing
    python opt4.py --synthetic --epochs 2   # no download: measures speed only

Each optimization is marked `# opt4:` where it happens; read `diff -u opt3.py opt4.py`.
"""
import argparse
import functools
from types import SimpleNamespace

import torch
import torch.nn as nn
import torch.nn.functional as F

import common
import harness


def parse_args():
    # opt2: a bigger batch keeps the GPU busy with fewer, larger kernels and fewer optimizer steps
    parser = harness.build_parser(__doc__, batch_size=128, lr=8e-3)
    # opt3: off by default: with the data on the device a short run trains in less time than compiling takes
    parser.add_argument("--compile", action=argparse.BooleanOptionalAction, default=False,
                        help="torch.compile the model; it pays only where the steps outlast its ~40 s of compiling "
                             "(default: off)")
    parser.add_argument("--accum-steps", type=harness.positive_int, default=1,
                        help="micro-batches per optimizer step; effective batch = batch size x this (default: 1)")
    parser.add_argument("--label-smoothing", type=harness.fraction, default=0.1,
                        help="weight of the uniform target mixed into each label (default: 0.1)")
    args = parser.parse_args()
    return harness.check_args(args, images_per_step=args.batch_size * args.accum_steps)


def autocast_dtype(device):
    """The 16-bit type `device` runs natively, or float32 where it has none; and why, in words, for the log."""
    if device.type == "cuda":
        # opt1: bfloat16 only where the GPU runs it natively (emulated it is slow): float32's range, so no GradScaler
        if torch.cuda.is_bf16_supported(including_emulation=False):
            return torch.bfloat16, "bfloat16 autocast: this GPU runs it natively, with float32's range"
        return torch.float16, "float16 autocast: no bfloat16 below sm_80; tensor cores (V100, T4) run it ~8x float32"
    unit = common.bfloat16_unit()
    if unit is not None:
        return torch.bfloat16, f"bfloat16 autocast: this CPU runs it natively ({unit})"
    return torch.float32, "float32: this CPU has no bfloat16 unit, and emulated bfloat16 runs ~12x slower"


def load_to_device(dataset, device):
    """A dataset's images (uint8, N x 3 x 32 x 32, channels_last in memory) and labels on `device`."""
    images = torch.as_tensor(dataset.data).permute(0, 3, 1, 2)  # the NHWC bytes are already channels_last
    return images.to(device), torch.as_tensor(dataset.targets).to(device)


def channel_statistics(device):
    """CIFAR-10's per-channel mean and std in uint8 units, as one tensor on `device`: made once (main), not per step."""
    statistics = torch.tensor([common.CIFAR10_MEAN, common.CIFAR10_STD], device=device) * 255
    return statistics.view(2, 1, 3, 1, 1)


def normalize(images, statistics):
    """uint8 images -> float32 with zero mean and unit variance per channel (`statistics`: channel_statistics)."""
    mean, std = statistics
    return (images.float() - mean) / std


def augment(images, offsets, flips, padding):
    """Per image: the crop of the image reflect-padded by `padding` pixels, as large as the image, whose corner is at
    `offsets` (top and left, 2 x batch x 1, each 0 to 2 x padding), mirrored where `flips` (batch x 1) is True."""
    (batch, channels, height, width), device = images.shape, images.device
    padded = F.pad(images, (padding, padding, padding, padding), mode="reflect")
    top, left = offsets
    rows = top + torch.arange(height, device=device)
    pixels = torch.arange(width, device=device)
    columns = left + torch.where(flips, width - 1 - pixels, pixels)  # a flip reads the crop's columns backwards
    # One gather for the whole batch: image i, every channel, rows[i] x columns[i].
    image_index = torch.arange(batch, device=device).view(batch, 1, 1, 1)
    channel_index = torch.arange(channels, device=device).view(1, channels, 1, 1)
    return padded[image_index, channel_index, rows.view(batch, 1, height, 1), columns.view(batch, 1, 1, width)]


def empty_plan(steps, args, device):
    """The buffers one epoch's steps read and write, on the device: each micro-batch's image indices, crop offsets and
    flips, each step's learning rate, the step counter, and each micro-batch's loss and the correct count."""
    rows, batch_size = steps * args.accum_steps, args.batch_size
    return SimpleNamespace(
        batches=torch.zeros(rows, batch_size, dtype=torch.long, device=device),
        offsets=torch.zeros(rows, 2, batch_size, 1, dtype=torch.long, device=device),
        flips=torch.zeros(rows, batch_size, 1, dtype=torch.bool, device=device),
        schedule=torch.zeros(steps, device=device),
        # 1 element, not 0-d: indexing by it gathers on the device, where a 0-d index would be read by the host
        step=torch.zeros(1, dtype=torch.long, device=device),
        losses=torch.zeros(rows, device=device),
        correct=torch.zeros((), dtype=torch.long, device=device),
    )


def draw_epoch(run, image_count):
    """One epoch of a training set of `image_count` images, drawn on the device: a fresh permutation cut into full
    micro-batches (the few images left over change each epoch; every batch is full, so the step sees one shape), and
    every image's crop offsets and flip."""
    args, generator, device = run.args, run.generator, run.device
    rows, batch_size = image_count // (args.batch_size * args.accum_steps) * args.accum_steps, args.batch_size
    permutation = torch.randperm(image_count, device=device, generator=generator)
    batches = permutation[:rows * batch_size].view(rows, batch_size)
    crop_offsets = 2 * run.crop_padding + 1
    offsets = torch.randint(0, crop_offsets, (rows, 2, batch_size, 1), device=device, generator=generator)
    flips = torch.rand((rows, batch_size, 1), device=device, generator=generator) < 0.5
    return batches, offsets, flips


def plan_epoch(run, image_count, epoch):
    """Draw `epoch` (draw_epoch) into the plan, with its rows of the schedule, and start its counters at 0."""
    plan, steps = run.plan, len(run.plan.schedule)
    batches, offsets, flips = draw_epoch(run, image_count)
    # opt4: copy_ writes into the buffers the captured step reads, at the addresses it was captured with
    for buffer, values in ((plan.batches, batches), (plan.offsets, offsets), (plan.flips, flips),
                           (plan.schedule, run.schedule[(epoch - 1) * steps:epoch * steps])):
        buffer.copy_(values)
    for counter in (plan.step, plan.losses, plan.correct):
        counter.zero_()


def onecycle_schedule(max_lr, total_steps, device):
    """OneCycleLR's rate for every step as a table on `device` (none baked into a captured step), from torch's own."""
    stand_in = torch.optim.AdamW([torch.zeros(1, requires_grad=True)], lr=max_lr)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(stand_in, max_lr=max_lr, total_steps=total_steps, pct_start=0.25,
                                                    cycle_momentum=False)  # opt2: beta1 kept: cycling it did not help
    rates = []
    for _ in range(total_steps):
        rates.append(stand_in.param_groups[0]["lr"])
        stand_in.step()  # it has no gradient: nothing moves, but the scheduler sees steps in their order
        scheduler.step()
    return torch.tensor(rates, device=device)


def adamw(parameters, lr, device):
    """torch's fused AdamW (weight decay 0.05) with its learning rate in a tensor on `device`."""
    # opt4: the rate a tensor the schedule writes in place (a graph keeps a float); capturable=True: torch captures it
    return torch.optim.AdamW(parameters, lr=torch.tensor(lr, device=device), weight_decay=0.05, fused=True,
                             capturable=True)


def micro_batch_loss(run, micro_batch):
    """The loss (over --accum-steps) of micro-batch `micro_batch` of the plan's current step, its images gathered,
    normalized, cropped and flipped on the device; its loss and correct count kept in the plan."""
    plan, (all_images, all_labels) = run.plan, run.train_data
    # opt4: the micro-batch's row indexed by the plan's device counter: a Python index would be baked into the graph
    row = plan.step * run.args.accum_steps + micro_batch
    indices, offsets, flips = plan.batches[row].squeeze(0), plan.offsets[row].squeeze(0), plan.flips[row].squeeze(0)
    # opt2: normalized inputs condition the optimization; random crops and flips add data for free
    # opt3: normalize, crop and flip the whole batch on the device; channels_last for the model
    images = augment(normalize(all_images[indices], run.statistics), offsets, flips, run.crop_padding)
    images = images.contiguous(memory_format=torch.channels_last)
    labels = all_labels[indices]
    # opt1: autocast runs convolutions in 16-bit where it is native: half the memory traffic, tensor cores
    # opt4: without autocast's cache of cast weights, which a CUDA graph capture must not keep
    with torch.autocast(run.device.type, dtype=run.amp_dtype, enabled=run.amp_dtype != torch.float32,
                        cache_enabled=False):
        outputs = run.model(images)
        loss = run.criterion(outputs, labels)
    plan.losses[row] = loss.detach()  # opt4: into the plan: every replay writes the same addresses
    plan.correct += (outputs.argmax(1) == labels).sum()
    return loss / run.args.accum_steps  # opt2: the mean over the effective batch


def optimizer_step(run):
    """The update that ends a step, at the plan's learning rate for it; then the plan's counter moves on."""
    plan = run.plan
    for group in run.optimizer.param_groups:
        group["lr"].copy_(plan.schedule[plan.step].squeeze(0))  # opt4: the schedule reaches the optimizer on the device
    run.scaler.step(run.optimizer)
    run.scaler.update()
    plan.step += 1


def train_step(run):
    """One optimizer step, whole: each micro-batch's augmentation, forward, loss and backward, then the update. It
    reads only the device (the plan, at its step counter) and reads nothing back: every call is the same work on the
    same addresses, so the host need not wait for it and a GPU can replay it as one CUDA graph."""
    # opt4: gradients dropped first: backward makes them in the graph's memory, and a retried capture starts clean
    run.model.zero_grad()
    for micro_batch in range(run.args.accum_steps):
        loss = micro_batch_loss(run, micro_batch)
        # opt1: float16 gradients can underflow to zero; GradScaler scales the loss up, then back
        run.scaler.scale(loss).backward()
    optimizer_step(run)


def cuda_graph(step, warmup_steps=3):
    """`step` (a function of no arguments) replayed as one CUDA graph: its first `warmup_steps` calls run on a side
    stream, as in PyTorch's whole-network capture (cuDNN's autotuning, the optimizer's first state), the next captures
    it, the rest replay it. A capture that fails says why in one line; that call and the rest run `step` as itself."""
    graph, calls, failed = torch.cuda.CUDAGraph(), 0, False

    def replay():
        nonlocal calls, failed
        calls += 1
        if failed:
            return step()
        if calls <= warmup_steps:
            side_stream = torch.cuda.Stream()
            side_stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side_stream):
                step()
            torch.cuda.current_stream().wait_stream(side_stream)
            return
        if calls == warmup_steps + 1:
            stream = torch.cuda.current_stream()
            try:
                with torch.cuda.graph(graph):  # records the step's kernels; runs none of them
                    step()
            except Exception as error:  # an op that cannot be captured: the run goes on uncaptured, not lost
                torch.cuda.set_stream(stream)  # a failed capture can leave its own stream current
                failed, cause = True, error.__context__ or error  # the op's error, not the failed capture_end's
                why = (str(cause).strip().splitlines() or [""])[0][:160]
                print(f"step: not captured ({type(cause).__name__}: {why}); this step and the rest run as a function")
                return step()  # the capture recorded this step but ran none of it
        graph.replay()
    return replay


def capture_problem(device, amp_dtype, optimizer):
    """Why the step cannot be replayed as a CUDA graph here, in words, or None where it can."""
    if device.type != "cuda":
        return "not captured: CUDA graphs are CUDA's"
    if amp_dtype == torch.float16 and not getattr(optimizer, "_step_supports_amp_scaling", False):
        # GradScaler hands a fused optimizer its found-inf flag on the device; for any other it reads it on the host
        return "not captured: float16's GradScaler reads on the host whether each step's gradients are finite"
    return None


def train_one_epoch(run, train_data, epoch, monitor):
    """One pass over `train_data`; returns mean loss, accuracy, optimizer steps and images trained on."""
    run.model.train()
    # opt2: accumulating the gradients of accum_steps micro-batches gives a big batch's step in less memory
    accum_steps = run.args.accum_steps
    # opt3: the epoch's batches, crops and flips drawn on the device at once: no loader, workers or host copies
    plan_epoch(run, len(train_data[1]), epoch)  # the step gathers its images from run.train_data
    # opt3: losses and correct counts stay on the device: reading them per step would wait for the GPU
    losses, correct = run.plan.losses, run.plan.correct
    # opt4: each step is one call that reads the plan: on a GPU, one graph replayed
    for _ in range(len(run.plan.schedule)):
        run.train_step()
        monitor.step()
    # opt3: the one wait for the device per epoch; a non-finite loss is found here, not at its step
    for micro_step, loss_value in enumerate(losses.tolist()):
        common.check_finite(loss_value, epoch, micro_step // accum_steps + 1)
    images_seen = len(losses) * run.args.batch_size
    return losses.mean().item(), correct.item() / images_seen, len(losses) // accum_steps, images_seen


def evaluate(run, test_data):
    """Mean loss and accuracy of the model on `test_data`."""
    run.model.eval()
    all_images, all_labels = test_data
    batch_size = run.args.batch_size  # opt3: slices of the test set on the device, no loader
    # opt3: the totals stay on the device: one read at the end, not one wait per batch
    total_loss = torch.zeros((), device=run.device)
    correct = torch.zeros((), dtype=torch.long, device=run.device)
    with torch.inference_mode():  # opt2: like no_grad, and also skips autograd's version tracking
        for start in range(0, len(all_labels), batch_size):
            images = normalize(all_images[start:start + batch_size], run.statistics)
            labels = all_labels[start:start + batch_size]
            # opt1: the last batch padded to full size (extra outputs dropped): one shape, so one compiled graph
            images = torch.cat([images, images.new_zeros(batch_size - len(images), *images.shape[1:])])
            images = images.contiguous(memory_format=torch.channels_last)  # opt3: the layout the model runs in
            # opt1: 16-bit here too
            with torch.autocast(run.device.type, dtype=run.amp_dtype, enabled=run.amp_dtype != torch.float32):
                outputs = run.model(images)[:len(labels)]
            total_loss += F.cross_entropy(outputs.float(), labels, reduction="sum")  # opt1: on float32 logits
            correct += (outputs.argmax(1) == labels).sum()
    return total_loss.item() / len(all_labels), correct.item() / len(all_labels)


def main():
    args = parse_args()
    device = harness.pick_device(args)
    harness.print_settings(__file__, device, args)
    # opt1: 16-bit math only where the hardware runs it: on a CPU without a bfloat16 unit it is emulated, and slow
    amp_dtype, why = autocast_dtype(device)
    print(f"precision: {why}")
    torch.manual_seed(args.seed)

    # opt3: the whole dataset on the device as uint8: 4x less to move than float32, and no loader or copy per step
    train_set, test_set = common.load_data(args, train_transform=None, test_transform=None)
    train_data, test_data = load_to_device(train_set, device), load_to_device(test_set, device)
    generator = torch.Generator(device).manual_seed(args.seed)

    # opt1: cuDNN times its convolution algorithms once per input shape and keeps the fastest
    torch.backends.cudnn.benchmark = True
    # opt3: channels_last (NHWC) is the layout tensor cores and the CPU's oneDNN convolutions run fastest
    model = common.ResNet10().to(device, memory_format=torch.channels_last)
    if args.compile:
        # opt1: fuses operations into fewer kernels: less memory traffic and Python overhead
        model.compile()
    # opt2: label smoothing keeps the logits from growing without bound: better accuracy in few epochs
    criterion = nn.CrossEntropyLoss(label_smoothing=args.label_smoothing)
    # opt1: AdamW scales each weight's step by its recent gradients, so one rate suits every layer untuned
    # opt3: fused: one op reads and writes each weight once (a few multi-tensor launches on a GPU), not a dozen passes
    optimizer = adamw(model.parameters(), args.lr, device)
    scaler = torch.amp.GradScaler(device.type, enabled=amp_dtype == torch.float16)  # bfloat16 needs no scaling
    # opt2: one cycle of warm-up then annealing reaches a given accuracy in far fewer epochs than a fixed rate
    steps_per_epoch = len(train_set) // args.batch_size // args.accum_steps
    total_steps = args.epochs * steps_per_epoch
    if total_steps < 5:
        common.fail(f"{total_steps} optimizer steps in all are too few for OneCycleLR's warm-up (it needs 5); "
                    "use more --epochs or --train-size")
    # What the functions above need besides their data, in one object (a setting is read as run.args.name)
    run = SimpleNamespace(
        args=args,
        device=device,
        amp_dtype=amp_dtype,
        model=model,
        criterion=criterion,
        optimizer=optimizer,
        scaler=scaler,
        generator=generator,
        train_data=train_data,
        statistics=channel_statistics(device),
        crop_padding=common.CROP_PADDING,
        # opt4: the schedule as a table on the device, and the plan: the buffers every step reads and writes
        schedule=onecycle_schedule(args.lr, total_steps, device),
        plan=empty_plan(steps_per_epoch, args, device),
    )
    run.train_step = functools.partial(train_step, run)
    why_not = capture_problem(device, amp_dtype, optimizer)
    if why_not is None:
        # opt4: on CUDA the whole step is captured once and replayed: one launch a step, however many kernels
        run.train_step = cuda_graph(run.train_step)
    print("step: captured as a CUDA graph and replayed" if why_not is None else f"step: run as a function, {why_not}")

    records = []
    start = common.now(device)
    for epoch in range(1, args.epochs + 1):
        with harness.step_monitor(epoch, args.profile if epoch == args.epochs else None, device) as monitor:
            epoch_start = common.now(device)
            train_figures = train_one_epoch(run, train_data, epoch, monitor)
            train_seconds = common.now(device) - epoch_start
        test_figures = evaluate(run, test_data)
        harness.record_epoch(records, train_figures, test_figures, train_seconds)
    harness.report(__file__, run, records, common.now(device) - start)
    if args.save:
        torch.save(model.state_dict(), args.save)


if __name__ == "__main__":
    main()
