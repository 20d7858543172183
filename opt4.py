"""opt4.py: opt3.py + the whole training step as one function on buffers at fixed addresses, which a GPU captures
once as a CUDA graph and replays: one launch a step, not a Python call, a dispatch and a launch for each kernel.

    python opt4.py --epochs 5               # CIFAR-10 in ./data, downloaded if missing
    python opt4.py --synthetic --epochs 2   # no download: measures speed only

Each optimization is marked `# opt4:` where it happens; read `diff -u opt3.py opt4.py`.
"""
import argparse
import inspect
from types import SimpleNamespace

import torch
import torch.nn as nn
import torch.nn.functional as F

import common


def parse_args():
    # opt2: a bigger batch keeps the GPU busy with fewer, larger kernels and fewer optimizer steps
    # opt2: 8e-3, the OneCycleLR peak that 5-epoch probes at batch 128 picked (lab/README.md)
    parser = common.build_parser(__doc__, batch_size=128, lr=8e-3)
    # opt3: off by default: with the data on the device a short run trains in less time than compiling takes
    parser.add_argument("--compile", action=argparse.BooleanOptionalAction, default=False,
                        help="torch.compile the model; it pays where the time it saves exceeds its compiling "
                             "(default: off)")
    parser.add_argument("--accum-steps", type=common.positive_int, default=1,
                        help="micro-batches per optimizer step; effective batch = batch size x this (default: 1)")
    parser.add_argument("--label-smoothing", type=common.fraction, default=0.1,
                        help="weight of the uniform target mixed into each label (default: 0.1)")
    args = parser.parse_args()
    return common.check_args(args, images_per_step=args.batch_size * args.accum_steps)


def autocast_dtype(device):
    """The 16-bit type `device` runs natively, or float32 where it has none; and why, in words, for the log."""
    if torch.device(device).type == "cuda":  # a torch.device, or the string a script may hold
        # opt1: bfloat16 only where the GPU runs it natively (sm_80 on): float32's range, so no GradScaler
        if torch.cuda.is_bf16_supported(including_emulation=False):
            return torch.bfloat16, "bfloat16 autocast: this GPU runs it natively, with float32's range"
        return torch.float16, "float16 autocast: no bfloat16 below sm_80; the tensor cores of V100 and T4 run float16"
    unit = common.bfloat16_unit()
    if unit is not None:
        return torch.bfloat16, f"bfloat16 autocast: this CPU runs it natively ({unit})"
    return torch.float32, "float32: this CPU has no bfloat16 unit, and emulated bfloat16 runs slower than float32"


def load_to_device(dataset, device):
    """A dataset's images (uint8, N x 3 x 32 x 32) and labels on `device`."""
    images = torch.as_tensor(dataset.data).permute(0, 3, 1, 2)  # N x H x W x 3 seen as N x 3 x H x W: a view, no copy
    return images.to(device), torch.as_tensor(dataset.targets).to(device)


def normalize(images, statistics):
    """uint8 images -> float32 with zero mean and unit variance per channel (`statistics`: their mean and std)."""
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


def draw_epoch(image_count, batch_size, padding, generator, accum_steps=1):
    """An epoch of `image_count` images drawn on `generator`'s device: a permutation cut into full micro-batches of
    `batch_size` (steps of `accum_steps`; the few left over change each epoch), each image's crop offsets (augment's
    `padding`) and flip: batches, offsets, flips, micro-batches x batch_size, x 2 x batch_size x 1, x batch_size x 1."""
    device = generator.device
    micro_batches = image_count // (batch_size * accum_steps) * accum_steps
    permutation = torch.randperm(image_count, device=device, generator=generator)
    batches = permutation[:micro_batches * batch_size].view(micro_batches, batch_size)
    offsets = torch.randint(0, 2 * padding + 1, (micro_batches, 2, batch_size, 1), device=device, generator=generator)
    flips = torch.rand((micro_batches, batch_size, 1), device=device, generator=generator) < 0.5
    return batches, offsets, flips


def empty_plan(train_data, statistics, padding, steps, batch_size, accum_steps=1):
    """What an epoch of `steps` steps reads and writes, at fixed addresses on `train_data`'s device: images, labels,
    statistics, padding, accum_steps as given; batches, offsets, flips and rates (plan_epoch's); cursor (the next
    step); losses, correct; steps_left (of plan_epoch's epoch, counted where the step runs uncaptured: not in a
    capture, nor in replays)."""
    (images, labels), micro_batches = train_data, steps * accum_steps
    device = images.device
    return SimpleNamespace(
        images=images, labels=labels, statistics=statistics, padding=padding, accum_steps=accum_steps,
        batches=torch.zeros(micro_batches, batch_size, dtype=torch.long, device=device),
        offsets=torch.zeros(micro_batches, 2, batch_size, 1, dtype=torch.long, device=device),
        flips=torch.zeros(micro_batches, batch_size, 1, dtype=torch.bool, device=device),
        rates=torch.zeros(steps, device=device),
        # 1 element, not 0-d: indexing by it gathers on the device, where a 0-d index would be read by the host
        cursor=torch.zeros(1, dtype=torch.long, device=device),
        losses=torch.zeros(micro_batches, device=device),
        correct=torch.zeros((), dtype=torch.long, device=device),
        steps_left=0,
    )


def plan_epoch(plan, draw, rates):
    """Write an epoch into the plan: `draw` (draw_epoch's) and `rates` (each step's); cursor and tallies back to 0."""
    # opt4: copy_ writes into the buffers the captured step reads, at the addresses it was captured with
    for buffer, values in zip((plan.batches, plan.offsets, plan.flips, plan.rates), (*draw, rates)):
        buffer.copy_(values)
    for counter in (plan.cursor, plan.losses, plan.correct):
        counter.zero_()
    plan.steps_left = len(plan.rates)


def onecycle_schedule(max_lr, total_steps, device, pct_start=0.25):
    """OneCycleLR's rate for every step as a table on `device` (none baked into a captured step), from torch's own."""
    stand_in = torch.optim.AdamW([torch.zeros(1, requires_grad=True)], lr=max_lr)
    # opt2: one cycle of warm-up then annealing to near zero (not measured here against a fixed rate)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(stand_in, max_lr, total_steps=total_steps, pct_start=pct_start,
                                                    cycle_momentum=False)  # opt2: beta1 fixed: only the rate cycles
    rates = []
    for _ in range(total_steps):
        rates.append(stand_in.param_groups[0]["lr"])
        stand_in.step()  # it has no gradient: nothing moves, but the scheduler sees steps in their order
        scheduler.step()
    return torch.tensor(rates, device=device)


def adamw(parameters, lr, device, weight_decay=0.05):
    """torch's fused AdamW with its learning rate in a tensor on `device`."""
    # opt1: AdamW scales each weight's step by its recent gradients, so one rate suits every layer untuned
    # opt3: fused: one op reads and writes each weight once (a few multi-tensor launches on a GPU), not some 8 passes
    # opt4: the rate a tensor the schedule writes in place (a graph keeps a float); capturable=True, or no capture
    return torch.optim.AdamW(parameters, lr=torch.tensor(lr, device=device), weight_decay=weight_decay, fused=True,
                             capturable=True)


def micro_batch_loss(model, criterion, plan, micro_batch, amp_dtype):
    """The loss (over the plan's accum_steps) of micro-batch `micro_batch` of the step at the plan's cursor, its images
    gathered, normalized, cropped and flipped on the device; its loss and correct count kept in the plan."""
    # opt4: the micro-batch found by the plan's cursor on the device: a Python index would be baked into the graph
    micro_step = plan.cursor * plan.accum_steps + micro_batch
    indices, offsets, flips = (buffer[micro_step].squeeze(0) for buffer in (plan.batches, plan.offsets, plan.flips))
    # opt2: normalized inputs condition the optimization; random crops and flips vary each image every epoch
    # opt3: normalize, crop and flip the whole batch on the device; channels_last for the model
    images = augment(normalize(plan.images[indices], plan.statistics), offsets, flips, plan.padding)
    images = images.contiguous(memory_format=torch.channels_last)
    labels = plan.labels[indices]
    # opt1: autocast runs convolutions in 16-bit where it is native: half the memory traffic, tensor cores
    # opt4: without autocast's cache of cast weights, as torch's make_graphed_callables asks of a captured region
    with torch.autocast(images.device.type, dtype=amp_dtype, enabled=amp_dtype != torch.float32, cache_enabled=False):
        outputs = model(images)
        loss = criterion(outputs, labels)
    plan.losses[micro_step] = loss.detach()  # opt4: into the plan: every replay writes the same addresses
    plan.correct += (outputs.argmax(1) == labels).sum()
    return loss / plan.accum_steps  # opt2: the mean over the effective batch


def optimizer_step(optimizers, plan, scaler):
    """Each optimizer's update at the plan's rate (times a group's "lr_scale", if any); then the cursor moves on."""
    for optimizer in optimizers:
        for group in optimizer.param_groups:
            rate = plan.rates[plan.cursor].squeeze(0)  # opt4: the schedule reaches it on the device
            group["lr"].copy_(rate * group["lr_scale"] if "lr_scale" in group else rate)
        scaler.step(optimizer)
    scaler.update()
    plan.cursor.add_(1).remainder_(len(plan.rates))


def make_train_step(model, criterion, optimizers, plan, amp_dtype=torch.float32, scaler=None):
    """Makes the training step: a function whose every call is one optimizer step over `plan`, whole, reading only the
    device and nothing back, the same work on the same addresses each call, so a GPU can replay it as one CUDA graph.
    It asks for plan_epoch before each epoch, and of `optimizers` (one or a list) each rate a float32 tensor on its
    weights' device, read there: torch's Adam or AdamW with capturable=True, its SGD with fused=True, or one whose
    defaults say capturable=True (Muon's); any other it refuses on every device, so a CPU run fails as a GPU's would."""
    optimizers = [optimizers] if isinstance(optimizers, torch.optim.Optimizer) else list(optimizers)
    for optimizer, group in ((optimizer, group) for optimizer in optimizers for group in optimizer.param_groups):
        # opt4: each rate a tensor the step writes (a graph keeps a float) and the optimizer reads on the device
        name, rate, device = type(optimizer).__name__, group["lr"], group["params"][0].device
        flag = "fused" if "fused" in group and "capturable" not in group else "capturable"  # SGD's; Adam's, AdamW's
        use = f"{name}(..., lr=torch.tensor(rate, device=device), {flag}=True)"
        if not (isinstance(rate, torch.Tensor) and rate.dtype == torch.float32 and rate.device == device):
            raise TypeError(f"{name}'s learning rate must be a float32 tensor on its weights' device ({device}), which "
                            f"each step writes in place: {use}")
        if flag not in group:
            raise TypeError(f"{name} does not say its step reads its rate on the device: use torch's AdamW with "
                            "capturable=True or SGD with fused=True, or give yours a default capturable=True if so")
        if not group[flag]:
            why = "torch refuses to capture it otherwise" if flag == "capturable" else "it reads the rate on the host"
            raise TypeError(f"{name} needs {flag}=True in a CUDA graph ({why}): {use}")
    cast = {parameter.dtype for parameter in model.parameters()} - {torch.float32}
    if cast:  # opt4: the step feeds float32 images, and autocast (amp_dtype) runs the 16-bit math on float32 weights
        raise TypeError(f"the model's weights are {', '.join(map(str, cast))}, not float32: drop the cast (a "
                        "model.half()) and pass amp_dtype=torch.float16 or torch.bfloat16 for 16-bit math")
    scaler = scaler or torch.amp.GradScaler(enabled=False)  # disabled: scale, step and update pass straight through

    def step():
        if plan.steps_left == 0:  # uncaptured only: a replayed graph runs no Python, so it cannot check
            raise RuntimeError("the plan has no step left: call plan_epoch(plan, draw, rates) before each epoch")
        # opt4: gradients dropped first: backward makes them in the graph's memory; a failed capture is not retried,
        # the step reruns uncaptured and backward makes them anew
        model.zero_grad()
        for micro_batch in range(plan.accum_steps):
            loss = micro_batch_loss(model, criterion, plan, micro_batch, amp_dtype)
            # opt1: float16 gradients can underflow to zero; GradScaler scales the loss up, then back
            scaler.scale(loss).backward()
        optimizer_step(optimizers, plan, scaler)
        # opt4: counted where the step runs: a capture, failed or not, records its kernels and runs none of them
        if not (torch.cuda.is_initialized() and torch.cuda.is_current_stream_capturing()):
            plan.steps_left -= 1
    return step


def cuda_graph(step, device, warmup_steps=3):
    """`step` (of no arguments, its work on `device`) as one CUDA graph, as PyTorch's whole-network capture: its first
    `warmup_steps` calls run on a side stream (cuDNN's autotuning, the optimizer's first state), the next captures it,
    the rest replay it. Off CUDA, or where the capture fails, it says why in one line and runs `step` as itself."""
    try:
        inspect.signature(step).bind()  # a graph replays one call as captured: nothing can be passed to it
    except TypeError:
        raise TypeError("cuda_graph replays a step of no arguments: bind them: functools.partial(step, size)") from None
    if torch.device(device).type != "cuda":
        print("step: run as a function, not captured: CUDA graphs are CUDA's")
        return step
    graph, calls = torch.cuda.CUDAGraph(), 0

    def graphed_step():
        nonlocal graph, calls
        calls += 1
        if graph is None:  # the capture failed
            return step()
        if calls <= warmup_steps:
            side_stream = torch.cuda.Stream()
            side_stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side_stream):
                step()
            return torch.cuda.current_stream().wait_stream(side_stream)
        if calls == warmup_steps + 1:
            stream = torch.cuda.current_stream()
            try:
                with torch.cuda.graph(graph):  # records the step's kernels; runs none of them
                    step()
            except Exception as error:  # an op that cannot be captured: the run goes on uncaptured, not lost
                torch.cuda.set_stream(stream)  # a failed capture can leave its own stream current
                graph, cause = None, error.__context__ or error  # the op's error, not the failed capture_end's
                why = (str(cause).strip().splitlines() or [""])[0][:160]
                print(f"step: not captured ({type(cause).__name__}: {why}); this step and the rest run as a function")
                return step()  # the capture recorded this step's kernels but ran none
            print(f"step: captured as a CUDA graph after {warmup_steps} warm-up calls, replayed from here on")
        graph.replay()
    return graphed_step


def train_one_epoch(run, train_data, epoch, monitor):
    """One pass over `train_data` (the plan's); returns mean loss, accuracy, optimizer steps and images trained on."""
    run.model.train()
    # opt2: accumulating the gradients of accum_steps micro-batches: one step for all of them in less memory, a big
    # batch's step where no BatchNorm is (BatchNorm normalizes each micro-batch by its own statistics)
    accum_steps = run.args.accum_steps
    # opt3: the epoch's batches, crops and flips drawn on the device at once: no loader, workers or host copies
    batch_size, padding, generator = run.args.batch_size, run.crop_padding, run.generator
    draw = draw_epoch(len(train_data[1]), batch_size, padding, generator, accum_steps)
    steps = len(run.plan.rates)
    plan_epoch(run.plan, draw, run.schedule[(epoch - 1) * steps:epoch * steps])  # opt4: with the epoch's rates
    # opt3: losses and correct counts stay on the device: reading them per step would wait for the GPU
    losses, correct = run.plan.losses, run.plan.correct
    # opt4: each step is one call that reads the plan: on a GPU, one graph replayed
    for _ in range(steps):
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
    batch_size = run.args.batch_size
    # opt3: the totals stay on the device: read at the end, not waited for per batch
    total_loss = torch.zeros((), device=run.device)
    correct = torch.zeros((), dtype=torch.long, device=run.device)
    with torch.inference_mode():  # opt2: like no_grad, and also skips autograd's version tracking
        for start in range(0, len(all_labels), batch_size):  # opt3: slices of the test set on the device, no loader
            images = normalize(all_images[start:start + batch_size], run.statistics)
            labels = all_labels[start:start + batch_size]
            # opt1: the last batch padded to full size (extra outputs dropped): one shape, so one graph if compiled
            # and, on CUDA, no new shape for cuDNN's autotuner to time
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
    device = common.pick_device(args)
    common.print_settings(__file__, device, args)
    # opt1: 16-bit math only where the hardware runs it: on a CPU without a bfloat16 unit it is emulated, and slow
    amp_dtype, why = autocast_dtype(device)
    print(f"precision: {why}")
    torch.manual_seed(args.seed)

    # opt3: the whole dataset on the device as uint8: 4x less to move than float32, and no loader or copy per step
    train_set, test_set = common.load_data(args, train_transform=None, test_transform=None)
    train_data, test_data = load_to_device(train_set, device), load_to_device(test_set, device)
    generator = torch.Generator(device).manual_seed(args.seed)
    statistics = common.cifar10_statistics(device)

    # opt1: cuDNN times its convolution algorithms once per input shape and keeps the fastest
    torch.backends.cudnn.benchmark = True
    # opt3: channels_last (NHWC) is the layout tensor cores and the CPU's oneDNN convolutions run fastest
    model = common.ResNet10().to(device, memory_format=torch.channels_last)
    if args.compile:
        model.compile()  # opt1: fuses operations into fewer kernels: less memory traffic and Python overhead
    # opt2: label smoothing keeps the logits from growing without bound; in opt5's recipe its gain is within seed noise
    criterion = nn.CrossEntropyLoss(label_smoothing=args.label_smoothing)
    optimizers = [adamw(model.parameters(), args.lr, device)]  # a list: opt5 adds Muon beside it
    scaler = torch.amp.GradScaler(device.type, enabled=amp_dtype == torch.float16)  # bfloat16 needs no scaling
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
        optimizers=optimizers,
        scaler=scaler,
        generator=generator,
        statistics=statistics,
        crop_padding=common.CROP_PADDING,
        # opt4: the schedule as a table on the device, and the plan: the buffers every step reads and writes
        schedule=onecycle_schedule(args.lr, total_steps, device),
        plan=empty_plan(train_data, statistics, common.CROP_PADDING, steps_per_epoch, args.batch_size,
                        args.accum_steps),
    )
    # opt4: on CUDA the whole step is captured once and replayed: one launch a step, however many kernels
    run.train_step = cuda_graph(make_train_step(model, criterion, optimizers, run.plan, amp_dtype, scaler), device)

    records = []
    start = common.now(device)
    for epoch in range(1, args.epochs + 1):
        with common.step_monitor(epoch, args.profile if epoch == args.epochs else None, device) as monitor:
            epoch_start = common.now(device)
            train_figures = train_one_epoch(run, train_data, epoch, monitor)
            train_seconds = common.now(device) - epoch_start
        test_figures = evaluate(run, test_data)
        common.record_epoch(records, train_figures, test_figures, train_seconds)
    common.report(__file__, run, records, common.now(device) - start)
    if args.save:
        torch.save(model.state_dict(), args.save)


if __name__ == "__main__":
    main()
