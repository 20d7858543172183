"""The README's "What to copy first" table: each piece of code it names, copied alone, works.

A row names a script and its functions or classes in backticks. The test takes them and every other function or class
of that script they call (found from the source, so the table cannot drift from the code), puts that alone in a fresh
module that imports only the standard library, torch, torch.nn, torch.nn.functional and torch.distributed, and runs it
on a small model on the CPU. A row of settings, not code, says "settings" and is exempt.
"""
import ast
import os
import re
import socket
import sys
import types
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel

ROOT = Path(__file__).resolve().parent
# All a copied piece may lean on besides the standard library: torch's modules a training script imports anyway
TORCH_IMPORTS = """\
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
"""
CPU = torch.device("cpu")


def copy_table():
    """(optimization, where) of each row of the README's "What to copy first" table."""
    readme = (ROOT / "README.md").read_text()
    table = readme[readme.index("## What to copy first"):].split("\n\n")[1].splitlines()[2:]
    return [tuple(cell.strip() for cell in row.split("|")[1:3]) for row in table]


def named_code(where):
    """(script, the names in backticks it defines) of a row's "where", or None for a row of settings."""
    if where.startswith("settings"):
        return None
    script = re.search(r"\b(opt\d)\b", where)[1] + ".py"
    return script, re.findall(r"`(\w+)`", where)


def piece(script, names):
    """The source of `names` in `script` and of every other top-level function or class of it they use, in the
    script's order, decorators included."""
    source = (ROOT / script).read_text()
    tree = ast.parse(source)
    defined = {node.name: node for node in tree.body if isinstance(node, (ast.FunctionDef, ast.ClassDef))}
    missing = [name for name in names if name not in defined]
    assert not missing, f"{script} defines no {missing}"
    wanted, frontier = set(names), list(names)
    while frontier:
        for node in ast.walk(defined[frontier.pop()]):
            if isinstance(node, ast.Name) and node.id in defined and node.id not in wanted:
                wanted.add(node.id)
                frontier.append(node.id)
    lines = source.splitlines()
    chosen = sorted((defined[name] for name in wanted), key=lambda node: node.lineno)
    return "\n\n\n".join("\n".join(lines[min([node.lineno, *(d.lineno for d in node.decorator_list)]) - 1:
                                         node.end_lineno]) for node in chosen)


def standard_library_imports(script):
    """`script`'s import lines of standard-library modules (argparse, functools, types...)."""
    lines = (ROOT / script).read_text().splitlines()
    imports = [node for node in ast.parse("\n".join(lines)).body if isinstance(node, (ast.Import, ast.ImportFrom))]
    return "".join(lines[node.lineno - 1] + "\n" for node in imports
                   if (node.module if isinstance(node, ast.ImportFrom) else node.names[0].name).split(".")[0]
                   in sys.stdlib_module_names)


def load_piece(script, names):
    """`names` of `script` and what they use, alone in a fresh module."""
    code = piece(script, names)
    assert not re.search(r"\b(common|harness)\.", code), f"{script}'s {names} lean on common.py or harness.py"
    module = types.ModuleType(f"copied_from_{Path(script).stem}")
    source = standard_library_imports(script) + TORCH_IMPORTS + code
    exec(compile(source, f"<{script}: {', '.join(names)}>", "exec"), module.__dict__)
    return module


def small_cnn():
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU(),
                         nn.Conv2d(8, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU(),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 4))


def tiny_dataset(count=64, side=32):
    """A CIFAR-10-shaped dataset: uint8 N x H x W x 3 images, labels 0-3, learnable (label = a brightness band)."""
    generator = np.random.default_rng(0)
    labels = generator.integers(0, 4, count)
    images = (generator.integers(0, 40, (count, side, side, 3)) + 60 * labels[:, None, None, None]).astype(np.uint8)
    return SimpleNamespace(data=images, targets=labels.tolist())


STATISTICS = torch.tensor([[120.0, 120.0, 120.0], [70.0, 70.0, 70.0]]).view(2, 1, 3, 1, 1)  # mean, std in uint8 units


def the_dataset_on_the_device(module):
    images, labels = module.load_to_device(tiny_dataset(), CPU)
    assert images.dtype == torch.uint8 and images.shape == (64, 3, 32, 32) and labels.tolist() == tiny_dataset().targets
    indices = torch.randperm(64)[:16]
    offsets, flips = torch.randint(0, 9, (2, 16, 1)), torch.rand(16, 1) < 0.5
    augmented = module.augment(module.normalize(images[indices], STATISTICS), offsets, flips, 4)
    assert augmented.shape == (16, 3, 32, 32) and augmented.dtype == torch.float32
    # the crop at the centre, unflipped, is the normalized image itself: labels stay with their images
    centred = module.augment(module.normalize(images[indices], STATISTICS), torch.full((2, 16, 1), 4),
                             torch.zeros(16, 1, dtype=torch.bool), 4)
    assert torch.equal(centred, module.normalize(images[indices], STATISTICS))
    assert labels[indices].tolist() == [tiny_dataset().targets[i] for i in indices.tolist()]


def the_captured_step_run_uncaptured(module):
    """The step on a plan of 4 steps of 16 images, run as a function (capturing needs a GPU): its loss falls."""
    dataset = tiny_dataset()
    images, labels = torch.as_tensor(dataset.data).permute(0, 3, 1, 2), torch.as_tensor(dataset.targets)
    args = SimpleNamespace(batch_size=16, accum_steps=1)
    model = small_cnn()
    optimizer = torch.optim.AdamW(model.parameters(), lr=torch.tensor(0.01), fused=True)
    run = SimpleNamespace(args=args, device=CPU, amp_dtype=torch.float32, model=model, optimizer=optimizer,
                          criterion=nn.CrossEntropyLoss(), scaler=torch.amp.GradScaler("cpu", enabled=False),
                          train_data=(images, labels), statistics=STATISTICS, crop_padding=4,
                          plan=module.empty_plan(4, args, CPU))
    first_losses = None
    for _ in range(5):  # epochs
        run.plan.batches.copy_(torch.randperm(64).view(4, 16))
        run.plan.offsets.fill_(4)
        run.plan.schedule.fill_(0.01)
        for counter in (run.plan.step, run.plan.losses, run.plan.correct):
            counter.zero_()
        for _ in range(4):
            module.train_step(run)
        assert run.plan.step.item() == 4  # the counter on the device moved one step a call
        first_losses = run.plan.losses.clone() if first_losses is None else first_losses
    assert run.plan.losses.mean() < 0.8 * first_losses.mean()
    assert callable(module.cuda_graph)  # copied whole; it wraps a step only where CUDA runs


def progressive_resizing(module):
    sizes = module.image_sizes(20, 16, 32, 0.3)
    assert [sizes.count(size) for size in (16, 24, 32)] == [7, 7, 6] and sizes == sorted(sizes)
    images = torch.rand(4, 3, 32, 32)
    assert module.downscale(images, 16).shape == (4, 3, 16, 16) and module.downscale(images, 32) is images
    assert torch.allclose(module.downscale(images, 16).mean(), images.mean(), atol=1e-6)  # a mean of each 2x2


def muon(module):
    """Muon for the filters of a small CNN and torch's AdamW for the rest: a few steps lower its loss."""
    model = small_cnn()
    filters = [parameter for parameter in model.parameters() if parameter.ndim == 4]
    others = [parameter for parameter in model.parameters() if parameter.ndim != 4]
    optimizers = [module.Muon(filters, lr=0.02, dtype=torch.float32), torch.optim.AdamW(others, lr=0.02)]
    images, labels = torch.rand(32, 3, 16, 16), torch.arange(32) % 4
    images += labels.view(-1, 1, 1, 1) * 0.5
    losses = []
    for _ in range(10):
        loss = nn.functional.cross_entropy(model(images), labels)
        losses.append(loss.item())
        loss.backward()
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()
    assert losses[-1] < 0.7 * losses[0], losses
    singular_values = torch.linalg.svdvals(module.orthogonalize(torch.randn(8, 72), 5, torch.float32))
    assert singular_values.min() > 0.6 and singular_values.max() < 1.3


def data_parallelism(module):
    """In a one-process gloo group started as torchrun starts it: the group, a DDP step, the statistics averaged; and
    two ranks' shares of an epoch, drawn apart: disjoint, together the global batches."""
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    torchrun = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    saved = {name: os.environ.get(name) for name in torchrun}
    os.environ.update(torchrun)
    try:
        rank, world_size, device = module.setup_distributed(CPU)
        assert (rank, world_size, device) == (0, 1, CPU) and torch.distributed.get_backend() == "gloo"
        model = DistributedDataParallel(small_cnn(), gradient_as_bucket_view=True)
        nn.functional.cross_entropy(model(torch.rand(8, 3, 16, 16)), torch.arange(8) % 4).backward()
        assert all(parameter.grad is not None for parameter in model.parameters())
        statistics = [buffer.clone() for buffer in model.buffers()]
        module.average_batchnorm_statistics(model, world_size)  # one rank: its own statistics
        assert all(torch.equal(before, after) for before, after in zip(statistics, model.buffers()))
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
        for name, value in saved.items():
            os.environ.pop(name) if value is None else os.environ.update({name: value})
    shares = []
    for rank in (0, 1):
        run = SimpleNamespace(args=SimpleNamespace(batch_size=8, accum_steps=1), device=CPU, crop_padding=4,
                              generator=torch.Generator().manual_seed(0), rank=rank, world_size=2)
        batches, offsets, flips = module.draw_epoch(run, 64)
        assert batches.shape == (4, 8) and offsets.shape == (4, 2, 8, 1) and flips.shape == (4, 8, 1)
        shares.append(batches)
    assert torch.equal(torch.cat(shares, 1).flatten().sort().values, torch.arange(64))  # disjoint, all 64 images


EXERCISES = {"load_to_device": the_dataset_on_the_device, "train_step": the_captured_step_run_uncaptured,
             "image_sizes": progressive_resizing, "Muon": muon, "setup_distributed": data_parallelism}


def rows_of_code():
    return [(optimization, *code) for optimization, where in copy_table() if (code := named_code(where))]


def test_the_copy_table_names_code_in_most_rows_and_settings_in_the_rest():
    rows = copy_table()
    assert len(rows) >= 8
    for optimization, where in rows:
        assert where.startswith("settings") or named_code(where)[1], f"{optimization}: names no code, says no settings"
    assert len(rows_of_code()) >= 5


@pytest.mark.parametrize("optimization, script, names", rows_of_code(), ids=[row[0][:40] for row in rows_of_code()])
def test_a_row_of_the_copy_table_copies_alone_and_works(optimization, script, names):
    module = load_piece(script, names)
    exercise = next((EXERCISES[name] for name in names if name in EXERCISES), None)
    assert exercise is not None, f"{optimization}: no exercise for {names}"
    exercise(module)
