"""baseline.py: ResNet10 on CIFAR-10 as a careful newcomer writes it: float32, eager, default loader.

    python baseline.py --epochs 5               # CIFAR-10 in ./data, downloaded if missing
    python baseline.py --synthetic --epochs 2   # no download: measures speed only

Every later script is this one plus its own optimizations: read `diff -u baseline.py opt1.py`.
"""
from types import SimpleNamespace

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader

import common


def parse_args():
    parser = common.build_parser(__doc__, batch_size=64, lr=0.01)
    args = parser.parse_args()
    return common.check_args(args, images_per_step=args.batch_size)


def train_one_epoch(run, loader, epoch, monitor):
    """One pass over `loader`; returns mean loss, accuracy, optimizer steps and images trained on."""
    run.model.train()
    total_loss, correct, images_seen = 0.0, 0, 0
    for step, (images, labels) in enumerate(loader, start=1):
        images, labels = images.to(run.device), labels.to(run.device)
        outputs = run.model(images)
        loss = run.criterion(outputs, labels)
        common.check_finite(loss.item(), epoch, step)
        loss.backward()
        run.optimizer.step()
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
            outputs = run.model(images)
            total_loss += F.cross_entropy(outputs, labels, reduction="sum").item()
            correct += (outputs.argmax(1) == labels).sum().item()
    return total_loss / len(loader.dataset), correct / len(loader.dataset)


def main():
    args = parse_args()
    device = common.pick_device(args)
    common.print_settings(__file__, device, args)
    torch.manual_seed(args.seed)

    train_set, test_set = common.load_data(args, common.plain_transform(), common.plain_transform())
    # drop_last: every step trains on a full batch; a small last one is a noisy step (and, compiled, a new shape)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, shuffle=True, drop_last=True)
    test_loader = DataLoader(test_set, batch_size=args.batch_size)

    model = common.ResNet10().to(device)
    criterion = nn.CrossEntropyLoss()
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, weight_decay=5e-4)
    # What the functions above need besides their data, in one object (a setting is read as run.args.name)
    run = SimpleNamespace(
        args=args,
        device=device,
        model=model,
        criterion=criterion,
        optimizer=optimizer,
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
