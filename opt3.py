"""opt3.py: opt2.py + bfloat16, fused AdamW, channels_last, the dataset kept on the device and
augmented there in whole batches, no host-device sync in the loop (CUDA graphs on GPU), and
flip test-time augmentation.

    python opt3.py --epochs 5               # CIFAR-10 in ./data, downloaded if missing
    python opt3.py --synthetic --epochs 2   # no download: measures speed only

Each optimization is marked `# opt3:` where it happens; read `diff -u opt2.py opt3.py`.
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
    parser.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True,
                        help="torch.compile the model; --no-compile runs eager (default: on)")
    parser.add_argument("--compile-mode", default=None,
                        choices=["default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"],
                        help="reduce-overhead replays CUDA graphs; max-autotune times kernel variants for "
                             "minutes, longer than a short run (default: reduce-overhead on CUDA, default on CPU)")
    parser.add_argument("--accum-steps", type=harness.positive_int, default=1,
                        help="micro-batches per optimizer step; effective batch = batch size x this (default: 1)")
    parser.add_argument("--label-smoothing", type=harness.fraction, default=0.1,
                        help="weight of the uniform target mixed into each label (default: 0.1)")
    args = parser.parse_args()
    return harness.check_args(args, images_per_step=args.batch_size * args.accum_steps)


def autocast_dtype(device):
    """The 16-bit type `device` runs natively, or float32 where it has none; and why, in words, for the log."""
    if device.type == "cuda":
        # opt3: bfloat16 where the GPU runs it natively (Ampere, sm_80, and newer): float32's range, so no
        # GradScaler and no skipped steps. Not is_bf16_supported() alone: it also counts GPUs that only
        # emulate bfloat16 (T4, sm_75), where inductor will not compile it and the model would run eager and slow
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


@functools.cache
def channel_statistics(device):
    """CIFAR-10's per-channel mean and std in uint8 units, made on `device` once, not copied per step."""
    statistics = torch.tensor([common.CIFAR10_MEAN, common.CIFAR10_STD], device=device) * 255
    return statistics.view(2, 1, 3, 1, 1)


def normalize(images):
    """uint8 images -> float32 with zero mean and unit variance per channel."""
    mean, std = channel_statistics(images.device)
    return (images.float() - mean) / std


def augment(images, generator):
    """Per image: a random crop of the reflect-padded image, as large as the image, and a random horizontal flip."""
    (batch, channels, height, width), device, pad = images.shape, images.device, common.CROP_PADDING
    padded = F.pad(images, (pad, pad, pad, pad), mode="reflect")
    top, left = torch.randint(0, 2 * pad + 1, (2, batch, 1), device=device, generator=generator)
    flip = torch.rand(batch, 1, device=device, generator=generator) < 0.5
    rows = top + torch.arange(height, device=device)
    pixels = torch.arange(width, device=device)
    columns = left + torch.where(flip, width - 1 - pixels, pixels)  # a flip reads the crop's columns backwards
    # One gather for the whole batch: image i, every channel, rows[i] x columns[i].
    image_index = torch.arange(batch, device=device).view(batch, 1, 1, 1)
    channel_index = torch.arange(channels, device=device).view(1, channels, 1, 1)
    return padded[image_index, channel_index, rows.view(batch, 1, height, 1), columns.view(batch, 1, 1, width)]


def epoch_batches(size, batch_size, generator, device):
    """One epoch's batches as rows of image indices: a fresh permutation cut into full batches.

    The few images left over change each epoch; every batch is full, so a compiled step sees one shape.
    """
    permutation = torch.randperm(size, device=device, generator=generator)
    return permutation[: size // batch_size * batch_size].view(-1, batch_size)


def train_one_epoch(run, train_data, epoch, monitor):
    """One pass over `train_data`; returns mean loss, accuracy, optimizer steps and images trained on."""
    run.model.train()
    all_images, all_labels = train_data
    # opt3: batches are gathered by index on the device: no loader, no workers, no host-to-device copy
    batches = epoch_batches(len(all_labels), run.args.batch_size, run.generator, run.device)
    # opt2: accumulating gradients of accum_steps micro-batches gives a big batch's step in less memory;
    # every step gets exactly accum_steps micro-batches, so a few left over at the end are skipped
    accum_steps = run.args.accum_steps
    steps = len(batches) // accum_steps
    # opt3: losses and correct counts stay on the device: reading them per step would wait for the GPU
    losses = torch.zeros(steps * accum_steps, device=run.device)
    correct = torch.zeros((), dtype=torch.long, device=run.device)
    for micro_step, indices in enumerate(batches[: steps * accum_steps]):
        # opt3: normalize, crop and flip the whole batch on the device; channels_last for the model
        images = augment(normalize(all_images[indices]), run.generator).contiguous(memory_format=torch.channels_last)
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
            # opt3: zero_grad() drops the gradients (set_to_none, the default); kept ones must stay put (see main)
            run.optimizer.zero_grad(set_to_none=not run.keep_gradients)
            run.scheduler.step()
            monitor.step()
        losses[micro_step] = loss.detach()
        correct += (outputs.argmax(1) == labels).sum()
    # opt3: the one wait for the device per epoch; a non-finite loss is found here, not at its step
    for micro_step, loss_value in enumerate(losses.tolist()):
        common.check_finite(loss_value, epoch, micro_step // accum_steps + 1)
    images_seen = len(losses) * run.args.batch_size
    return losses.mean().item(), correct.item() / images_seen, steps, images_seen


def evaluate(run, test_data):
    """Mean loss and accuracy of the model on `test_data`."""
    run.model.eval()
    all_images, all_labels = test_data
    batch_size = run.args.batch_size
    # opt3: the totals stay on the device: one read at the end, not one wait per batch
    total_loss = torch.zeros((), device=run.device)
    correct = torch.zeros((), dtype=torch.long, device=run.device)
    with torch.inference_mode():  # opt2: like no_grad, and also skips autograd's version tracking
        for start in range(0, len(all_labels), batch_size):
            images = normalize(all_images[start:start + batch_size])
            # opt1: the last batch padded with blank images to a full one (their outputs are dropped): one shape, so
            # one compiled evaluation graph, not another for the last few images
            images = F.pad(images, (0, 0, 0, 0, 0, 0, 0, batch_size - len(images)))
            images = images.contiguous(memory_format=torch.channels_last)
            labels = all_labels[start:start + batch_size]
            # opt1: 16-bit here too
            with torch.autocast(run.device.type, dtype=run.amp_dtype, enabled=run.amp_dtype != torch.float32):
                # opt3: average the logits of each image and its mirror (test-time augmentation), in one call
                outputs = run.model(torch.cat([images, images.flip(3)])).view(2, batch_size, -1).mean(0)[:len(labels)]
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

    # opt3: the whole dataset lives on the device as uint8 (180 MB): 4x less to move than float32,
    # and no loader, workers or host-to-device copy per step; normalize() and augment() run per batch
    train_set, test_set = common.load_data(args, train_transform=None, test_transform=None)
    train_data, test_data = load_to_device(train_set, device), load_to_device(test_set, device)
    generator = torch.Generator(device).manual_seed(args.seed)

    # opt1: cuDNN times its convolution algorithms once per input shape and keeps the fastest
    torch.backends.cudnn.benchmark = True
    # opt3: channels_last (NHWC) is the layout tensor cores and the CPU's oneDNN convolutions run fastest
    model = common.ResNet10().to(device, memory_format=torch.channels_last)
    if args.compile:
        # opt1: fuses operations into fewer kernels: less memory traffic and Python overhead
        # opt3: on CUDA, reduce-overhead replays the model's forward and backward as CUDA graphs, a launch each
        # instead of one per kernel (the loss, augmentation and optimizer still launch their kernels one by one)
        model.compile(mode=args.compile_mode or ("reduce-overhead" if device.type == "cuda" else "default"))
    # opt3: accumulating under CUDA graphs needs gradients that stay put: one that backward creates lives in the
    # graphs' memory pool, which the next micro-batch's forward overwrites; so allocate them once and zero them
    keep_gradients = args.accum_steps > 1
    if keep_gradients:
        for parameter in model.parameters():
            parameter.grad = torch.zeros_like(parameter)
    # opt2: label smoothing keeps the logits from growing without bound: better accuracy in few epochs
    criterion = nn.CrossEntropyLoss(label_smoothing=args.label_smoothing)
    # opt1: AdamW scales each weight's step by its recent gradients, so one rate suits every layer untuned
    # opt3: fused=True does AdamW's whole update in one pass over the weights (on a GPU, one kernel for many);
    # the default makes a pass per operation (foreach on a GPU: each over all weights; on a CPU, weight by weight)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.05, fused=True)
    scaler = torch.amp.GradScaler(device.type, enabled=amp_dtype == torch.float16)  # bfloat16 needs no scaling
    # opt2: one cycle of warm-up then annealing reaches a given accuracy in far fewer epochs than a
    # fixed rate; its length counts optimizer steps, not micro-batches
    total_steps = args.epochs * (len(train_data[1]) // args.batch_size // args.accum_steps)
    if total_steps < 5:
        common.fail(f"{total_steps} optimizer steps in all are too few for OneCycleLR's warm-up (it needs 5); "
                    "use more --epochs or --train-size")
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=args.lr, total_steps=total_steps, pct_start=0.25)
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
        keep_gradients=keep_gradients,
        generator=generator,
    )

    records = []
    start = common.now(device)
    for epoch in range(1, args.epochs + 1):
        with harness.step_monitor(epoch, args.profile if epoch == args.epochs else None, device) as monitor:
            epoch_start = common.now(device)
            train_figures = train_one_epoch(run, train_data, epoch, monitor)
            train_seconds = common.now(device) - epoch_start
        test_figures = evaluate(run, test_data)
        harness.record_epoch(records, train_figures, test_figures, train_seconds)
    harness.report(__file__, args, device, records, common.now(device) - start,
                  extra={"final_lr": optimizer.param_groups[0]["lr"]})
    if args.save:
        torch.save(model.state_dict(), args.save)


if __name__ == "__main__":
    main()
