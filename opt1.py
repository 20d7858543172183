"""opt1.py: baseline.py + mixed precision, torch.compile (a padded last test batch), AdamW and the cuDNN autotuner.

16-bit autocast, torch.compile and the autotuner speed up the GPU's own work. On an H200 opt1 was not reliably faster
than baseline (two pairs of runs of the same code disagree; float16 there, whose GradScaler reads a flag on the host
each step) and was slower from launch to result (compiling). Our guess, not profiled: the GPU waits on baseline's
DataLoader, which opt2 and opt3 feed faster.

    python opt1.py --epochs 5               # CIFAR-10 in ./data, downloaded if missing
    python opt1.py --synthetic --epochs 2   # no download: measures speed only

Each optimization is marked `# opt1:` where it happens; read `diff -u baseline.py opt1.py`.
"""
import argparse
from types import SimpleNamespace

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader

import common


def parse_args():
    # opt1: AdamW's usual rate: its steps are normalized per weight, so it needs a smaller rate than SGD's 0.01
    parser = common.build_parser(__doc__, batch_size=64, lr=1e-3)
    parser.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True,
                        help="torch.compile the model; --no-compile runs eager (default: on)")
    args = parser.parse_args()
    return common.check_args(args, images_per_step=args.batch_size)


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


def train_one_epoch(run, loader, epoch, monitor):
    """One pass over `loader`; returns mean loss, accuracy, optimizer steps and images trained on."""
    run.model.train()
    total_loss, correct, images_seen = 0.0, 0, 0
    for step, (images, labels) in enumerate(loader, start=1):
        images, labels = images.to(run.device), labels.to(run.device)
        # opt1: autocast runs convolutions in 16-bit where it is native: half the memory traffic, tensor cores
        with torch.autocast(run.device.type, dtype=run.amp_dtype, enabled=run.amp_dtype != torch.float32):
            outputs = run.model(images)
            loss = run.criterion(outputs, labels)
        common.check_finite(loss.item(), epoch, step)
        # opt1: float16 gradients can underflow to zero; GradScaler scales the loss up, then back
        run.scaler.scale(loss).backward()
        run.scaler.step(run.optimizer)
        run.scaler.update()
        run.optimizer.zero_grad()
        monitor.step()
        total_loss += loss.item() * len(labels)
        correct += (outputs.argmax(1) == labels).sum().item()
        images_seen += len(labels)
    return total_loss / images_seen, correct / images_seen, step, images_seen


def evaluate(run, loader):
    """Mean loss and accuracy of the model on `loader`."""
    run.model.eval()
    total_loss, correct = 0.0, 0
    with torch.no_grad():
        for images, labels in loader:
            images, labels = images.to(run.device), labels.to(run.device)
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
    common.print_settings(__file__, device, args)
    # opt1: 16-bit math only where the hardware runs it: on a CPU without a bfloat16 unit it is emulated, and slow
    amp_dtype, why = autocast_dtype(device)
    print(f"precision: {why}")
    torch.manual_seed(args.seed)

    train_set, test_set = common.load_data(args, common.plain_transform(), common.plain_transform())
    # drop_last: every step trains on a full batch; a small last one is a noisy step (and, compiled, a new shape)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, shuffle=True, drop_last=True)
    test_loader = DataLoader(test_set, batch_size=args.batch_size)

    # opt1: cuDNN times its convolution algorithms once per input shape and keeps the fastest
    torch.backends.cudnn.benchmark = True
    model = common.ResNet10().to(device)
    if args.compile:
        model.compile()  # opt1: fuses operations into fewer kernels: less memory traffic and Python overhead
    criterion = nn.CrossEntropyLoss()
    # opt1: AdamW scales each weight's step by its recent gradients, so one rate suits every layer untuned
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.05)
    scaler = torch.amp.GradScaler(device.type, enabled=amp_dtype == torch.float16)  # bfloat16 needs no scaling
    # What the functions above need besides their data, in one object (a setting is read as run.args.name)
    run = SimpleNamespace(
        args=args,
        device=device,
        amp_dtype=amp_dtype,
        model=model,
        criterion=criterion,
        optimizer=optimizer,
        scaler=scaler,
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
