"""opt3.py: opt2.py + the dataset kept on the device and normalized, cropped and flipped there a whole
batch at a time, the losses kept there too, fused AdamW, channels_last, and torch.compile off by default.

    python opt3.py --epochs 5               # CIFAR-10 in ./data, downloaded if missing
    python opt3.py --synthetic --epochs 2   # no download: measures speed only

Each optimization is marked `# opt3:` where it happens; read `diff -u opt2.py opt3.py`.
"""
import argparse
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


def train_one_epoch(run, train_data, epoch, monitor):
    """One pass over `train_data`; returns mean loss, accuracy, optimizer steps and images trained on."""
    run.model.train()
    all_images, all_labels = train_data
    # opt2: accumulating the gradients of accum_steps micro-batches: one step for all of them in less memory, a big
    # batch's step where no BatchNorm is (BatchNorm normalizes each micro-batch by its own statistics)
    accum_steps = run.args.accum_steps
    # opt3: the epoch's batches, crops and flips drawn on the device at once: no loader, workers or host copies
    batch_size, padding, generator = run.args.batch_size, run.crop_padding, run.generator
    batches, offsets, flips = draw_epoch(len(all_labels), batch_size, padding, generator, accum_steps)
    # opt3: losses and correct counts stay on the device: reading them per step would wait for the GPU
    losses = torch.zeros(len(batches), device=run.device)
    correct = torch.zeros((), dtype=torch.long, device=run.device)
    for micro_step, indices in enumerate(batches):
        # opt2: normalized inputs condition the optimization; random crops and flips vary each image every epoch
        # opt3: normalize, crop and flip the whole batch on the device; channels_last for the model
        images = normalize(all_images[indices], run.statistics)
        images = augment(images, offsets[micro_step], flips[micro_step], run.crop_padding)
        images = images.contiguous(memory_format=torch.channels_last)
        labels = all_labels[indices]
        # opt1: autocast runs convolutions in 16-bit where it is native: half the memory traffic, tensor cores
        with torch.autocast(run.device.type, dtype=run.amp_dtype, enabled=run.amp_dtype != torch.float32):
            outputs = run.model(images)
            loss = run.criterion(outputs, labels)
        # opt1: float16 gradients can underflow to zero; GradScaler scales the loss up, then back
        run.scaler.scale(loss / accum_steps).backward()  # opt2: the mean over the effective batch
        if (micro_step + 1) % accum_steps == 0:
            run.scaler.step(run.optimizer)
            run.scaler.update()
            run.optimizer.zero_grad()
            run.scheduler.step()
            monitor.step()
        losses[micro_step] = loss.detach()
        correct += (outputs.argmax(1) == labels).sum()
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
    # opt1: AdamW scales each weight's step by its recent gradients, so one rate suits every layer untuned
    # opt3: fused: one op reads and writes each weight once (a few multi-tensor launches on a GPU), not some 8 passes
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.05, fused=True)
    scaler = torch.amp.GradScaler(device.type, enabled=amp_dtype == torch.float16)  # bfloat16 needs no scaling
    steps_per_epoch = len(train_set) // args.batch_size // args.accum_steps
    total_steps = args.epochs * steps_per_epoch
    if total_steps < 5:
        common.fail(f"{total_steps} optimizer steps in all are too few for OneCycleLR's warm-up (it needs 5); "
                    "use more --epochs or --train-size")
    # opt2: one cycle of warm-up then annealing to near zero (not measured here against a fixed rate)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=args.lr, total_steps=total_steps, pct_start=0.25,
                                                    cycle_momentum=False)  # opt2: beta1 fixed: only the rate cycles
    # What the functions above need besides their data, in one object (a setting is read as run.args.name)
    run = SimpleNamespace(
        args=args,
        device=device,
        amp_dtype=amp_dtype,
        model=model,
        criterion=criterion,
        optimizer=optimizer,
        scaler=scaler,
        scheduler=scheduler,
        generator=generator,
        statistics=statistics,
        crop_padding=common.CROP_PADDING,
    )

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
