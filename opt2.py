"""opt2.py: opt1.py + OneCycleLR (its peak rate probed; beta1 fixed), gradient accumulation, a bigger batch,
pinned memory, loader workers, normalized and augmented data, label smoothing and inference_mode.

    python opt2.py --epochs 5               # CIFAR-10 in ./data, downloaded if missing
    python opt2.py --synthetic --epochs 2   # no download: measures speed only

Each optimization is marked `# opt2:` where it happens; read `diff -u opt1.py opt2.py`.
"""
import argparse
import itertools
import os
from types import SimpleNamespace

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader

import common


def parse_args():
    # opt2: a bigger batch keeps the GPU busy with fewer, larger kernels and fewer optimizer steps
    # opt2: 8e-3, the OneCycleLR peak that 5-epoch probes at batch 128 picked (lab/README.md)
    parser = common.build_parser(__doc__, batch_size=128, lr=8e-3)
    parser.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True,
                        help="torch.compile the model; --no-compile runs eager (default: on)")
    parser.add_argument("--accum-steps", type=common.positive_int, default=1,
                        help="micro-batches per optimizer step; effective batch = batch size x this (default: 1)")
    parser.add_argument("--workers", type=common.non_negative_int, default=None,
                        help="data loading processes (default: with a GPU, one per core this process may use but "
                             "one, to keep it fed; 0 on the CPU, where they would take cores from training)")
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


def default_workers(device):
    """Loader processes: with a GPU they prepare batches while it computes; on the CPU they would take
    cores from training (lab/README.md: the ladder's workers on 2 cores)."""
    if device.type != "cuda":
        return 0
    # opt2: a worker on every core this process may use (its affinity, not the machine's) but one, left to training
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, cores - 1)


def train_one_epoch(run, loader, epoch, monitor):
    """One pass over `loader`; returns mean loss, accuracy, optimizer steps and images trained on."""
    run.model.train()
    total_loss, correct, images_seen = 0.0, 0, 0
    # opt2: accumulating the gradients of accum_steps micro-batches: one step for all of them in less memory, a big
    # batch's step where no BatchNorm is (BatchNorm normalizes each micro-batch by its own statistics)
    accum_steps = run.args.accum_steps
    steps = len(loader) // accum_steps
    for micro_step, (images, labels) in enumerate(itertools.islice(loader, steps * accum_steps)):
        step = micro_step // accum_steps + 1
        # opt2: from pinned memory the copy is queued on the GPU's stream, the host goes on; each .item() below waits
        images, labels = images.to(run.device, non_blocking=True), labels.to(run.device, non_blocking=True)
        # opt1: autocast runs convolutions in 16-bit where it is native: half the memory traffic, tensor cores
        with torch.autocast(run.device.type, dtype=run.amp_dtype, enabled=run.amp_dtype != torch.float32):
            outputs = run.model(images)
            loss = run.criterion(outputs, labels)
        common.check_finite(loss.item(), epoch, step)
        # opt1: float16 gradients can underflow to zero; GradScaler scales the loss up, then back
        run.scaler.scale(loss / accum_steps).backward()  # opt2: the mean over the effective batch
        if (micro_step + 1) % accum_steps == 0:
            run.scaler.step(run.optimizer)
            run.scaler.update()
            run.optimizer.zero_grad()
            run.scheduler.step()
            monitor.step()
        total_loss += loss.item() * len(labels)
        correct += (outputs.argmax(1) == labels).sum().item()
        images_seen += len(labels)
    return total_loss / images_seen, correct / images_seen, step, images_seen


def evaluate(run, loader):
    """Mean loss and accuracy of the model on `loader`."""
    run.model.eval()
    total_loss, correct = 0.0, 0
    with torch.inference_mode():  # opt2: like no_grad, and also skips autograd's version tracking
        for images, labels in loader:
            images, labels = images.to(run.device, non_blocking=True), labels.to(run.device, non_blocking=True)
            # opt1: the last batch padded to full size (extra outputs dropped): one shape, so one graph if compiled
            # and, on CUDA, no new shape for cuDNN's autotuner to time
            images = torch.cat([images, images.new_zeros(loader.batch_size - len(images), *images.shape[1:])])
            # opt1: 16-bit here too
            with torch.autocast(run.device.type, dtype=run.amp_dtype, enabled=run.amp_dtype != torch.float32):
                outputs = run.model(images)[:len(labels)]
            total_loss += F.cross_entropy(outputs.float(), labels, reduction="sum").item()  # opt1: on float32 logits
            correct += (outputs.argmax(1) == labels).sum().item()
    return total_loss / len(loader.dataset), correct / len(loader.dataset)


def main():
    args = parse_args()
    device = common.pick_device(args)
    if args.workers is None:  # opt2: the loader's worker count suits the device
        args.workers = default_workers(device)
    common.print_settings(__file__, device, args)
    # opt1: 16-bit math only where the hardware runs it: on a CPU without a bfloat16 unit it is emulated, and slow
    amp_dtype, why = autocast_dtype(device)
    print(f"precision: {why}")
    torch.manual_seed(args.seed)

    # opt2: normalized inputs condition the optimization; random crops and flips vary each image every epoch
    train_set, test_set = common.load_data(args, common.augmented_transform(), common.normalized_transform())
    # opt2: workers (kept between epochs) prepare the next batches while the model trains; pinned memory: async copies
    loader_options = dict(num_workers=args.workers, persistent_workers=args.workers > 0,
                          pin_memory=device.type == "cuda")
    # drop_last: every step trains on a full batch; a small last one is a noisy step (and, compiled, a new shape)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, shuffle=True, drop_last=True, **loader_options)
    test_loader = DataLoader(test_set, batch_size=args.batch_size, **loader_options)

    # opt1: cuDNN times its convolution algorithms once per input shape and keeps the fastest
    torch.backends.cudnn.benchmark = True
    model = common.ResNet10().to(device)
    if args.compile:
        model.compile()  # opt1: fuses operations into fewer kernels: less memory traffic and Python overhead
    # opt2: label smoothing keeps the logits from growing without bound; in opt5's recipe its gain is within seed noise
    criterion = nn.CrossEntropyLoss(label_smoothing=args.label_smoothing)
    # opt1: AdamW scales each weight's step by its recent gradients, so one rate suits every layer untuned
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.05)
    scaler = torch.amp.GradScaler(device.type, enabled=amp_dtype == torch.float16)  # bfloat16 needs no scaling
    total_steps = args.epochs * (len(train_loader) // args.accum_steps)
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
    )

    records = []
    start = common.now(device)
    for epoch in range(1, args.epochs + 1):
        with common.step_monitor(epoch, args.profile if epoch == args.epochs else None, device) as monitor:
            epoch_start = common.now(device)
            train_figures = train_one_epoch(run, train_loader, epoch, monitor)
            train_seconds = common.now(device) - epoch_start
        test_figures = evaluate(run, test_loader)
        common.record_epoch(records, train_figures, test_figures, train_seconds)
    common.report(__file__, run, records, common.now(device) - start)
    if args.save:
        torch.save(model.state_dict(), args.save)


if __name__ == "__main__":
    main()
