"""The README's "What to copy first" table and its copy page (docs/copy.md), applied to someone else's training script.

The client is a small training script of this file's own, in the shape of PyTorch's CIFAR-10 tutorial: its own small
CNN with a classifier sized for 32 x 32 images, a plain loop, a standard optimizer. A second client, as the most
copied CIFAR scripts are, holds its device as a string ("cpu"), has a classifier on a fixed 5 x 5 grid, its SGD and
its own test transform. Each row of the table is applied to it as the row says: exactly the names the row lists are
copied (a name it does not list is missing, and the copy fails), from the file it names, into a fresh module that
imports only what the row's block on the copy page imports; the client gives the pieces what the row's third column
asks, and the test checks what the row promises. The page itself is read as a client reads it: a block for each row,
copying the row's names, every name its file uses defined, every import needed. Here each row is applied alone;
lab/test_pieces_together.py applies them one after another, runs each block of the page in a fresh process, and the
data-parallelism block under torchrun and torch.multiprocessing.spawn. A row of settings, not code, says "settings"
and is exempt. On the CPU; the captured step also under `-m cuda`.
"""
import ast
import builtins
import functools
import os
import re
import symtable
import types
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

from conftest import cuda_test, free_port

ROOT = Path(__file__).resolve().parent
PAGE = ROOT / "docs" / "copy.md"  # the copy page: a block of code for each row of the table
YOUR_SCRIPT = "Your script"  # the page's first block: it stands in for the client's script
COPY_LINE = re.compile(r"^# copy from (\S+): (.+)$", re.M)
CPU = torch.device("cpu")


# ------------------------------------------------------------------------------------ the table and the page, read

def copy_table():
    """{optimization: (what to copy, what the client must give)} of each row of "What to copy first", in order."""
    readme = (ROOT / "README.md").read_text()
    table = readme[readme.index("## What to copy first"):].split("\n\n")[1].splitlines()[2:]
    return {cells[0]: (cells[1], cells[2]) for cells in ([c.strip() for c in row.split("|")[1:4]] for row in table)}


def row_names(optimization):
    """(alone, replacements): the (file, names) a row says to copy, and the (file, names) that replace earlier rows'
    pieces where the rows are applied in sequence ("with the row above, ..."). Settings segments name no code."""
    rows = list(copy_table())
    alone, replacements = [], []
    for segment in copy_table()[optimization][0].split("; "):
        if segment.startswith("settings"):
            continue
        source = "common.py" if segment.startswith("common.py") else re.search(r"\b(opt\d)\b", segment)[1] + ".py"
        names = re.findall(r"`(\w+)`", segment)
        above = row_names(rows[rows.index(optimization) - 1])[0] if "the row above's" in segment else []
        # the row above's names: its script's from this row's file (a later copy of them), common.py's as they are
        names += [name for file, above_names in above if file.startswith("opt") for name in above_names]
        (replacements if segment.startswith("with the row above") else alone).append((source, names))
        alone += [(file, above_names) for file, above_names in above if not file.startswith("opt")]
    return alone, replacements


def page_sections():
    """{heading: its text} of the copy page, in order."""
    sections = re.split(r"^## (.+)\n", PAGE.read_text(), flags=re.M)[1:]
    return dict(zip(sections[::2], sections[1::2]))


def copy_page():
    """{heading: the code of its block} of the copy page, in order: the client's script, then one for each row."""
    return {title: re.search(r"```python\n(.*?)```", body, re.S)[1] for title, body in page_sections().items()}


GRAPH_ROW = "the whole step on device buffers, one CUDA graph"
MUON = "Muon for the convolution filters, at its own rate"


def captured_blocks():
    """{heading: its second block} of the rows that have one: the lines that take the row's place with the captured
    step, after the graph row's block."""
    blocks = {title: re.findall(r"```python\n(.*?)```", body, re.S) for title, body in page_sections().items()}
    return {title: found[1] for title, found in blocks.items() if len(found) > 1}


EPOCHS_LINE = "# the epochs"  # where the graph row's block begins its epochs, which a captured-step block replaces


def graph_head():
    """The graph row's block up to its epochs: the plan, the step, the rates and the generator."""
    block = copy_page()[GRAPH_ROW]
    return block[:block.index(EPOCHS_LINE)]


def captured_source(optimization):
    """The graph row's block up to its epochs, then a row's block for the captured step, each with its pieces pasted
    in."""
    return block_source(graph_head()) + "\n\n" + block_source(captured_blocks()[optimization])


def prose_code(body):
    """The inline code of a section's prose that is a statement or a call: code a client would write."""
    prose = re.sub(r"```.*?```", "", body, flags=re.S)
    return [span for span in re.findall(r"`([^`\n]+)`", prose) if re.search(r"\(|\[|=", span)]


def block_copies(block):
    """[(file, names), ...] of a block's `# copy from file: name, name` lines, in order."""
    return [(file, [name.strip() for name in names.split(",")]) for file, names in COPY_LINE.findall(block)]


def block_imports(block):
    """The import lines at the top level of a block (its own, all a copied piece may lean on)."""
    lines = block.splitlines()
    return "".join(lines[node.lineno - 1] + "\n" for node in ast.parse(block).body
                   if isinstance(node, (ast.Import, ast.ImportFrom)))


def definitions(source):
    """{name: (first line, last line)} of `source`'s top-level functions, classes (decorators included) and
    assignments."""
    text = (ROOT / source).read_text()
    found = {}
    for node in ast.parse(text).body:
        first = min([node.lineno, *(d.lineno for d in getattr(node, "decorator_list", []))])
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            found[node.name] = (first, node.end_lineno)
        elif isinstance(node, ast.Assign):
            for target in node.targets:
                found.update({name.id: (first, node.end_lineno) for name in ast.walk(target)
                              if isinstance(name, ast.Name)})
    return text.splitlines(), found


def pieces_source(*pieces):
    """The source of exactly the named definitions, [(file, names), ...] in the order given, a later copy of a name
    replacing an earlier one; calls of common.py's copied names lose their `common.`, as the page says."""
    code, from_common = {}, set()
    for source, names in pieces:
        lines, found = definitions(source)
        missing = [name for name in names if name not in found]
        assert not missing, f"{source} defines no {missing}"
        for name in names:
            first, last = found[name]
            code[name] = "\n".join(lines[first - 1:last])
        from_common |= set(names) if source == "common.py" else set()
    source_code = "\n\n\n".join(code.values())
    for name in from_common:
        source_code = re.sub(rf"\bcommon\.{name}\b", name, source_code)
    return source_code + "\n"


def block_source(block):
    """A block as a client file holds it: its `# copy from` lines replaced, where the first stands, by the definitions
    they name."""
    lines = block.splitlines(True)
    at = next((index for index, line in enumerate(lines) if COPY_LINE.match(line)), len(lines))
    rest = [line for line in lines[at:] if not COPY_LINE.match(line)]
    return "".join(lines[:at]) + (pieces_source(*block_copies(block)) if at < len(lines) else "") + "".join(rest)


def row_source(*optimizations, replaced=False):
    """The imports of the rows' blocks (each once) and the pieces the rows name, applied in the order given (with
    `replaced`, a later row's copies of earlier pieces replacing them, as "with the row above" says)."""
    imports, pieces = [], []
    for optimization in optimizations:
        imports += [line for line in block_imports(copy_page()[optimization]).splitlines(True) if line not in imports]
        alone, replacements = row_names(optimization)
        pieces += alone + (replacements if replaced else [])
    return "".join(sorted(imports, key=lambda line: (line.startswith("from"), line))) + "\n\n" + pieces_source(*pieces)


def copied(*optimizations, replaced=False):
    """A fresh module of the rows' imports and exactly the pieces they name (row_source's)."""
    module = types.ModuleType("client_pieces")
    exec(compile(row_source(*optimizations, replaced=replaced), "<copied pieces>", "exec"), module.__dict__)
    return module


def undefined_names(source, known=()):
    """The global names `source` reads anywhere, in every function and class, on every path, that it neither defines
    nor imports, builtins and `known` aside: each a NameError on the path that reaches it."""
    table = symtable.symtable(source, "<client file>", "exec")
    defined = {symbol.get_name() for symbol in table.get_symbols() if symbol.is_assigned() or symbol.is_imported()}

    def read(scope):
        names = {symbol.get_name() for symbol in scope.get_symbols()
                 if symbol.is_referenced() and (scope.get_type() == "module" or symbol.is_global())}
        return names.union(*(read(child) for child in scope.get_children()))
    return sorted(read(table) - defined - set(dir(builtins)) - set(known))


def assigned_names(source):
    """The names `source` defines at its top level for the code after it (its imports are its own)."""
    table = symtable.symtable(source, "<client file>", "exec")
    return {symbol.get_name() for symbol in table.get_symbols() if symbol.is_assigned() and not symbol.is_imported()}


def your_names():
    """The names the stand-in for the client's script defines for the blocks after it."""
    return assigned_names(copy_page()[YOUR_SCRIPT])


# ------------------------------------------------------------------------------------ the client

class TutorialNet(nn.Module):
    """The tutorial's net, smaller: two convolutions with max-pooling, then a classifier sized for 32 x 32 images
    (16 x 5 x 5 inputs); with `global_pooling`, what the resizing row asks, one that takes any image size."""

    def __init__(self, global_pooling=False):
        super().__init__()
        torch.manual_seed(0)
        self.conv1, self.conv2 = nn.Conv2d(3, 6, 5), nn.Conv2d(6, 16, 5)
        self.pool = nn.AdaptiveAvgPool2d(1) if global_pooling else nn.Identity()
        self.fc = nn.Linear(16 if global_pooling else 16 * 5 * 5, 4)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        return self.fc(self.pool(x).flatten(1))


class GridNet(TutorialNet):
    """The second client's net: its classifier wants a 5 x 5 grid, which `nn.AdaptiveAvgPool2d(5)` before it gives
    at any image size (the resizing row's other way than global pooling)."""

    def __init__(self):
        super().__init__()
        self.pool = nn.AdaptiveAvgPool2d(5)


SECOND_CLIENT_DEVICE = "cpu"  # the second client's device, a string as `device = "cuda" if ... else "cpu"` makes it


def client_dataset(count=128, side=32, seed=0):
    """The client's data, CIFAR-10's layout: `data`, uint8 N x H x W x 3, and `targets`; 4 classes, learnable (each
    a brightness band)."""
    generator = np.random.default_rng(seed)
    labels = generator.integers(0, 4, count)
    images = (generator.integers(0, 40, (count, side, side, 3)) + 60 * labels[:, None, None, None]).astype(np.uint8)
    return types.SimpleNamespace(data=images, targets=labels.tolist())


def client_batches(dataset, batch_size=16):
    """The tutorial's loader, reduced: float batches in [0, 1], N x 3 x H x W, in order."""
    images = torch.as_tensor(dataset.data).permute(0, 3, 1, 2).float() / 255
    labels = torch.as_tensor(dataset.targets)
    return [(images[start:start + batch_size], labels[start:start + batch_size])
            for start in range(0, len(labels), batch_size)]


def client_loop(model, optimizers, batches, epochs=4, prepare=lambda images, epoch: images):
    """The tutorial's loop: forward, loss, backward, step, for each batch; each epoch's mean loss."""
    losses = []
    for epoch in range(epochs):
        total = 0.0
        for images, labels in batches:
            loss = F.cross_entropy(model(prepare(images, epoch)), labels)
            loss.backward()
            for optimizer in optimizers:
                optimizer.step()
                optimizer.zero_grad()
            total += loss.item()
        losses.append(total / len(batches))
    return losses


def learned(losses):
    return losses[-1] < 0.8 * losses[0]


# ------------------------------------------------------------------------------------ each row, alone

def autocast_row(pieces):
    """The client's forward and loss in the 16-bit type its hardware runs natively, float16's through GradScaler."""
    dtype, why = pieces.autocast_dtype(CPU)
    assert dtype in (torch.bfloat16, torch.float32) and why
    assert pieces.autocast_dtype(SECOND_CLIENT_DEVICE) == (dtype, why), "the second client's string device"
    model = TutorialNet()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    scaler = torch.amp.GradScaler("cpu", enabled=dtype == torch.float16)
    losses = []
    for _ in range(4):
        total = 0.0
        for images, labels in client_batches(client_dataset()):
            with torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32):
                loss = F.cross_entropy(model(images), labels)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad()
            total += loss.item()
        losses.append(total)
    assert learned(losses), losses


class ClientImages(torch.utils.data.Dataset):
    """The client's dataset of PIL images, as torchvision's datasets give them to a transform."""

    def __init__(self, dataset, transform):
        self.dataset, self.transform = dataset, transform

    def __len__(self):
        return len(self.dataset.targets)

    def __getitem__(self, index):
        from PIL import Image
        return self.transform(Image.fromarray(self.dataset.data[index])), self.dataset.targets[index]


def transforms_row(pieces):
    """The client's loader with the row's crop, flip and normalization; OneCycleLR and label smoothing as its lines."""
    loader = torch.utils.data.DataLoader(ClientImages(client_dataset(), pieces.augmented_transform()), batch_size=16)
    model = TutorialNet()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=0.01, total_steps=4 * len(loader),
                                                    pct_start=0.25, cycle_momentum=False)
    criterion = nn.CrossEntropyLoss(label_smoothing=0.1)
    losses = []
    for _ in range(4):
        total = 0.0
        for images, labels in loader:
            assert images.shape == (16, 3, 32, 32) and abs(images.mean()) < 3  # normalized
            loss = criterion(model(images), labels)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            scheduler.step()
            total += loss.item()
        losses.append(total)
    assert learned(losses), losses
    # the test images through the row's normalized_transform sit on the training inputs' scale; through the second
    # client's own test transform (its own mean and std) they would not, and it would lose accuracy without a word
    from torchvision import transforms
    own = transforms.Compose([transforms.ToTensor(), transforms.Normalize((0.5, 0.5, 0.5), (0.5, 0.5, 0.5))])
    test_set = client_dataset(64, seed=1)  # the same images through each: the training one crops and flips them
    trained, row_test, own_test = (torch.stack([image for image, _ in ClientImages(test_set, transform)])
                                   for transform in (pieces.augmented_transform(), pieces.normalized_transform(), own))
    assert (row_test.mean() - trained.mean()).abs() < 0.1 and (row_test.std() / trained.std() - 1).abs() < 0.1
    assert (own_test.std() / trained.std() - 1).abs() > 0.4, "the tutorial's (0.5, 0.5): half the scale trained on"


def data_row(pieces):
    """The client's loop fed from the device: uint8 images there, normalized, cropped and flipped a batch at a time,
    the epoch drawn at once and iterated like a loader; the losses kept on the device, read once an epoch."""
    images, labels = pieces.load_to_device(client_dataset(), SECOND_CLIENT_DEVICE)  # a string device works too
    assert images.dtype == torch.uint8 and images.shape == (128, 3, 32, 32)
    statistics = pieces.channel_statistics(images)
    pixels = images.transpose(0, 1).flatten(1).double()
    assert torch.allclose(statistics.flatten(), torch.cat([pixels.mean(1), pixels.std(1, correction=0)]).float())
    # the crop at the centre, unflipped, is the normalized image itself: labels stay with their images
    centred = pieces.augment(pieces.normalize(images[:8], statistics), torch.full((2, 8, 1), 2),
                             torch.zeros(8, 1, dtype=torch.bool), 2)
    assert torch.equal(centred, pieces.normalize(images[:8], statistics))
    # the crop at the top-left corner reads reflected pixels, not zeros: the row changes a zero-padding client's crops
    image = images[:1].float()
    corner = pieces.augment(image, torch.zeros(2, 1, 1, dtype=torch.long), torch.zeros(1, 1, dtype=torch.bool), 2)[0]
    assert torch.equal(corner[:, 0, 2:], image[0, :, 2, :30]) and torch.equal(corner[:, 2:, 2:], image[0, :, :30, :30])
    # full batches only: 130 images in batches of 16 are 8 batches, 2 images left out of each epoch
    batches, _, _ = pieces.draw_epoch(130, 16, 2, torch.Generator().manual_seed(0))
    assert batches.shape == (8, 16) and len(set(batches.flatten().tolist())) == 128
    model = TutorialNet()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    generator, epoch_losses = torch.Generator().manual_seed(0), []
    for _ in range(8):
        losses = []
        for indices, offsets, flips in zip(*pieces.draw_epoch(len(labels), 16, 2, generator)):
            batch = pieces.augment(pieces.normalize(images[indices], statistics), offsets, flips, 2)
            loss = F.cross_entropy(model(batch), labels[indices])
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.detach())  # on the device: no wait a step
        epoch_losses.append(torch.stack(losses).mean().item())  # the one read an epoch
    assert learned(epoch_losses), epoch_losses
    # the test images normalized with the training statistics, as the row says; the client's own [0, 1] test
    # transform would feed the model inputs it never saw, and lose accuracy without a word
    test_images, test_labels = pieces.load_to_device(client_dataset(64, seed=1), SECOND_CLIENT_DEVICE)
    with torch.no_grad():
        same = (model(pieces.normalize(test_images, statistics)).argmax(1) == test_labels).float().mean().item()
        own = (model(test_images.float() / 255).argmax(1) == test_labels).float().mean().item()
    assert same > 0.9 and own < same - 0.3, (same, own)


def capturable_adamw(parameters, lr=0.01, device=CPU):
    """The optimizer the graph row asks for: its rate a tensor on the device, updated in tensor ops."""
    return torch.optim.AdamW(parameters, lr=torch.tensor(lr, device=device), fused=True, capturable=True)


def step_epochs(pieces, model, optimizers, device=CPU, epochs=4, sizes=None):
    """The client's training as the graph row makes it: a plan on the device, the step built and (on CUDA) captured,
    plan_epoch before each epoch, the step called once a step; each epoch's mean loss."""
    images, labels = pieces.load_to_device(client_dataset(), device)
    statistics = pieces.channel_statistics(images)
    steps, generator = len(labels) // 16, torch.Generator(device).manual_seed(0)
    plan = pieces.empty_plan((images, labels), statistics, 2, steps, 16)
    amp_dtype = pieces.autocast_dtype(device)[0] if hasattr(pieces, "autocast_dtype") else torch.float32
    step = pieces.make_train_step(model, nn.CrossEntropyLoss(), optimizers, plan, amp_dtype)
    if sizes is None:
        graphed = {None: pieces.cuda_graph(step, device)}
    else:  # the resizing row's step takes an image size: bound, one graph per size
        graphed = {size: pieces.cuda_graph(functools.partial(step, size), device) for size in set(sizes)}
    if hasattr(pieces, "onecycle_schedule"):  # the recipe row's table: each epoch its slice
        rates = pieces.onecycle_schedule(0.01, epochs * steps, device).view(epochs, steps)
    else:
        rates = torch.linspace(0.01, 0.001, steps, device=device).expand(epochs, steps)
    losses = []
    for epoch in range(epochs):
        pieces.plan_epoch(plan, pieces.draw_epoch(len(labels), 16, 2, generator), rates[epoch])
        for _ in range(steps):
            graphed[None if sizes is None else sizes[epoch]]()
        losses.append(plan.losses.mean().item())
    return losses, plan


def graph_row(pieces, capsys):
    """The client's step as one function over a plan, uncaptured on the CPU (one line says so); each of its demands
    said where it bites, each a clear error where a piece can check it."""
    model = TutorialNet()
    losses, plan = step_epochs(pieces, model, [capturable_adamw(model.parameters())])
    assert learned(losses), losses
    assert capsys.readouterr().out.count("step: run as a function, not captured: CUDA graphs are CUDA's") == 1
    assert plan.cursor.item() == 0, "the epoch's last step wraps the cursor to its first"
    float_rate = torch.optim.SGD(model.parameters(), lr=0.01)
    with pytest.raises(TypeError, match=r"SGD's learning rate must be a float32 tensor.*: SGD\(\.\.\., "
                                        r"lr=torch\.tensor\(rate, device=device\), fused=True\)"):
        pieces.make_train_step(model, nn.CrossEntropyLoss(), [float_rate], plan)
    # the second client: a string device, the row's adamw, and a step that takes the image size
    second = GridNet()
    images, labels = pieces.load_to_device(client_dataset(), SECOND_CLIENT_DEVICE)
    plan = pieces.empty_plan((images, labels), pieces.channel_statistics(images), 2, 8, 16)
    adamw = pieces.adamw(second.parameters(), 0.01, SECOND_CLIENT_DEVICE)
    adamw.param_groups[0]["lr_scale"] = 0.5  # an optimizer at half the plan's rate
    step = pieces.make_train_step(second, nn.CrossEntropyLoss(), [adamw], plan)
    with pytest.raises(RuntimeError, match="plan_epoch"):
        step()  # no epoch in the plan yet
    pieces.plan_epoch(plan, pieces.draw_epoch(len(labels), 16, 2, torch.Generator().manual_seed(0)),
                      torch.full((8,), 0.02))
    graphed = pieces.cuda_graph(step, SECOND_CLIENT_DEVICE)
    for _ in range(8):
        graphed()
    assert adamw.param_groups[0]["lr"].item() == pytest.approx(0.01), "the plan's rate x the group's lr_scale"
    with pytest.raises(RuntimeError, match="no step left: call plan_epoch"):
        graphed()  # a ninth step of an 8-step epoch, uncaptured: a replayed graph could not tell
    with pytest.raises(TypeError, match=r"functools\.partial\(step, size\)"):
        pieces.cuda_graph(lambda size: step(), SECOND_CLIENT_DEVICE)  # on every device, before any capture


def test_the_graph_rows_step_follows_the_clients_own_loop_for_its_nchw_model_converted_as_the_row_says():
    # The client's NCHW model and its images both in channels_last, as the row says: the step's weights stay within
    # 1e-6 of the client's own loop on the same batches, crops and flips, its SGD at a float rate
    pieces = copied(GRAPH_ROW)
    images, labels = pieces.load_to_device(client_dataset(), CPU)
    statistics = pieces.channel_statistics(images)
    plan = pieces.empty_plan((images, labels), statistics, 2, 8, 16)
    stepped, looped = (TutorialNet().to(memory_format=torch.channels_last) for _ in range(2))
    step = pieces.make_train_step(stepped, nn.CrossEntropyLoss(), client_sgd(stepped.parameters()), plan)
    client = torch.optim.SGD(looped.parameters(), lr=0.01, momentum=0.9, nesterov=True, weight_decay=5e-4)
    generator, losses = torch.Generator().manual_seed(0), []
    for _ in range(2):
        draw = pieces.draw_epoch(len(labels), 16, 2, generator)
        pieces.plan_epoch(plan, draw, torch.full((8,), 0.01))
        for indices, offsets, flips in zip(*draw):
            step()
            inputs = pieces.augment(pieces.normalize(images[indices], statistics), offsets, flips, 2)
            loss = F.cross_entropy(looped(inputs.contiguous(memory_format=torch.channels_last)), labels[indices])
            loss.backward()
            client.step()
            client.zero_grad()
            losses.append(loss.item())
    assert torch.allclose(plan.losses, torch.tensor(losses[8:]), rtol=1e-5, atol=1e-6), (plan.losses, losses[8:])
    differences = [(a - b).abs().max().item() for a, b in zip(stepped.parameters(), looped.parameters())]
    moved = max((a - b).abs().max().item() for a, b in zip(stepped.parameters(), TutorialNet().parameters()))
    assert max(differences) < 1e-6 and moved > 1e-3, (differences, moved)


def resizing_row(pieces):
    """Smaller images in the early epochs, the client's model made to take any size as the row says: global pooling,
    or pooling to the grid its classifier wants (the second client's)."""
    sizes = pieces.image_sizes(4)  # opt5's defaults: from 16 px, the last 30 % of the epochs at 32
    assert sizes == [16, 16, 24, 32] and sizes[-1] == 32, "evaluated at the size trained last: the full size"
    assert pieces.image_sizes(1) == [32] and pieces.image_sizes(2) == [16, 32], "the sizes go by epoch"
    batches = client_batches(client_dataset())
    with pytest.raises(RuntimeError, match="shapes cannot be multiplied"):  # a classifier sized for 32 x 32
        client_loop(TutorialNet(), [], batches, prepare=lambda images, epoch: pieces.downscale(images, sizes[epoch]))
    model = TutorialNet(global_pooling=True)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    losses = client_loop(model, [optimizer], batches, prepare=lambda images, epoch: pieces.downscale(images,
                                                                                                   sizes[epoch]))
    assert learned(losses), losses
    second = GridNet()  # its classifier kept: 16 x 5 x 5 inputs at every size
    optimizer = torch.optim.SGD(second.parameters(), lr=0.01, momentum=0.9)
    losses = client_loop(second, [optimizer], batches, prepare=lambda images, epoch: pieces.downscale(images,
                                                                                                    sizes[epoch]))
    assert learned(losses), losses


def muon_row(pieces):
    """Muon for the client's filters, AdamW for the rest: every filter moves and the loss falls."""
    model = TutorialNet()
    filters = [parameter for parameter in model.parameters() if parameter.ndim == 4]
    others = [parameter for parameter in model.parameters() if parameter.ndim != 4]
    muon = pieces.Muon(filters, lr=0.02)
    assert muon.dtype == torch.float32, "Newton-Schulz in float32 where no GPU runs bfloat16"
    before = [weight.detach().clone() for weight in filters]
    losses = client_loop(model, [muon, torch.optim.AdamW(others, lr=0.02)], client_batches(client_dataset()))
    assert learned(losses), losses
    assert all(not torch.equal(weight, old) for weight, old in zip(filters, before)), "every filter moved"
    singular_values = torch.linalg.svdvals(pieces.orthogonalize(torch.randn(8, 72), 5, torch.float32))
    assert singular_values.min() > 0.6 and singular_values.max() < 1.3
    second = GridNet()  # Muon beside the second client's own SGD, each at its own rate
    filters = [parameter for parameter in second.parameters() if parameter.ndim == 4]
    others = [parameter for parameter in second.parameters() if parameter.ndim != 4]
    optimizers = [pieces.Muon(filters, lr=0.02), torch.optim.SGD(others, lr=0.05, momentum=0.9)]
    assert learned(client_loop(second, optimizers, client_batches(client_dataset())))


def recipe_row(pieces):
    """The recipe's rate table for the second client's SGD at its own peak: OneCycleLR's rate at every step, warm-up a
    quarter of them; set before each step, it trains; each test image scored with its mirror."""
    assert (pieces.RECIPE["pct_start"], pieces.RECIPE["batch_size"], pieces.RECIPE["lr"]) == (0.25, 512, 0.016)
    batches = client_batches(client_dataset())
    schedule = pieces.onecycle_schedule(0.01, 8 * len(batches), SECOND_CLIENT_DEVICE)
    assert schedule.argmax().item() == 2 * len(batches) - 1 and schedule.max().item() == pytest.approx(0.01)  # warm-up
    model = GridNet()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, nesterov=True, weight_decay=5e-4)
    rates = iter(schedule.tolist())

    def at_the_tables_rate(images, epoch):
        optimizer.param_groups[0]["lr"] = next(rates)
        return images
    assert learned(client_loop(model, [optimizer], batches, epochs=8, prepare=at_the_tables_rate))
    test_images, test_labels = client_batches(client_dataset(64, seed=1), batch_size=64)[0]
    with torch.no_grad():
        two_views = model(test_images) + model(test_images.flip(3))
    assert (two_views.argmax(1) == test_labels).float().mean() > 0.9


def parallelism_row(pieces):
    """In a one-process gloo group started as torchrun starts it: the group, a DDP step, the BatchNorm buffers averaged;
    and two ranks' shares of one epoch drawn alike: disjoint, together the global batches."""
    port = free_port()
    torchrun = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    saved = {name: os.environ.get(name) for name in torchrun}
    os.environ.update(torchrun)
    try:
        assert pieces.started_by_torchrun()
        rank, world_size, device = pieces.setup_distributed(CPU)
        assert (rank, world_size, device) == (0, 1, CPU) and torch.distributed.get_backend() == "gloo"
        pieces.point_to_torchrun(device, world_size)  # one process on a CPU: nothing to say
        network = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.Flatten(), nn.LazyLinear(4))
        network(torch.rand(2, 3, 8, 8))
        with pieces.rank_zero_first(world_size):
            pass
        model = DistributedDataParallel(network, gradient_as_bucket_view=True,
                                        **{pieces.broadcast_buffers_keyword(): False})
        F.cross_entropy(model(torch.rand(8, 3, 8, 8)), torch.arange(8) % 4).backward()
        assert all(parameter.grad is not None for parameter in model.parameters())
        buffers = [buffer.clone() for buffer in model.buffers()]
        pieces.average_batchnorm_buffers(model, world_size)  # one rank: its own
        assert all(torch.equal(before, after) for before, after in zip(buffers, model.buffers()))
        pieces.leave_process_group()
        assert not torch.distributed.is_initialized()
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
        for name, value in saved.items():
            os.environ.pop(name) if value is None else os.environ.update({name: value})
    draws = [torch.randperm(64, generator=torch.Generator().manual_seed(0)).view(4, 16), torch.zeros(4, 2, 16, 1),
             torch.zeros(4, 16, 1)]
    shares = [pieces.rank_share(draws, rank, 8)[0] for rank in (0, 1)]
    assert torch.equal(torch.cat(shares, 1).flatten().sort().values, torch.arange(64))  # disjoint, all 64 images


ROWS = {"16-bit autocast where the hardware runs it, float32 elsewhere": autocast_row,
        "OneCycleLR, crop + flip, label smoothing": transforms_row,
        "the dataset on the device, batch augmentation": data_row,
        "the whole step on device buffers, one CUDA graph": graph_row,
        "progressive resizing (16, 24, then 32 px)": resizing_row,
        "Muon for the convolution filters, at its own rate": muon_row,
        "the recipe: 20 epochs of batch 512, lr 0.016": recipe_row,
        "data parallelism": parallelism_row}


def rows_of_code():
    return [optimization for optimization in copy_table() if row_names(optimization)[0]]


def test_every_row_of_code_has_a_client_test_and_says_what_it_needs():
    assert len(copy_table()) >= 8 and rows_of_code() == list(ROWS)
    for optimization, (copy, needs) in copy_table().items():
        assert needs, f"{optimization}: says nothing of what the client must give"
        assert copy.startswith("settings") or row_names(optimization)[0], f"{optimization}: no code, not settings"


@pytest.mark.parametrize("optimization", list(ROWS), ids=[name[:40] for name in ROWS])
def test_a_row_copied_alone_into_the_client_does_what_it_promises(optimization, capsys):
    pieces = copied(optimization)  # its block's imports and the names the row lists, nothing else
    exercise = ROWS[optimization]
    exercise(pieces, capsys) if exercise is graph_row else exercise(pieces)


def test_a_row_that_names_too_little_fails():
    source = row_source("the whole step on device buffers, one CUDA graph").replace("def micro_batch_loss(", "def _(")
    pieces = types.ModuleType("client_pieces")
    exec(compile(source, "<copied pieces>", "exec"), pieces.__dict__)
    with pytest.raises(NameError, match="micro_batch_loss"):
        step_epochs(pieces, TutorialNet(), [capturable_adamw(TutorialNet().parameters())], epochs=1)
    assert undefined_names(source) == ["micro_batch_loss"], "and the static check names it"


# The copy page's order: the transforms row or the data row (alternatives: a loader's transforms, or none), then the
# rest; the second client takes the data row's way, with the captured step
PAGE_ORDER = ["16-bit autocast where the hardware runs it, float32 elsewhere", "`torch.compile`",
              "the dataset on the device, batch augmentation", "the whole step on device buffers, one CUDA graph",
              "progressive resizing (16, 24, then 32 px)", "Muon for the convolution filters, at its own rate",
              "the recipe: 20 epochs of batch 512, lr 0.016"]


def sequence():
    """The pieces of the page's rows in its order (the data row's way), copied one row after another, a later row's
    copy of a piece replacing the earlier one."""
    return copied(*PAGE_ORDER, replaced=True)


# ------------------------------------------------------------------------------------ the page, read as a client does

def page_rows():
    return [title for title in copy_page() if title != YOUR_SCRIPT]


def test_the_page_has_a_block_for_each_row_in_the_tables_order_copying_the_names_the_row_lists():
    assert page_rows() == list(copy_table())
    for optimization in page_rows():
        listed = {(file, name) for file, names in row_names(optimization)[0] for name in names}
        copies = {(file, name) for file, names in block_copies(copy_page()[optimization]) for name in names}
        assert copies == listed, optimization
    order = [title for title in page_rows() if title in PAGE_ORDER or title.startswith("OneCycleLR")]
    assert [title for title in order if not title.startswith("OneCycleLR")] == PAGE_ORDER, "the page's order"


@pytest.mark.parametrize("optimization", page_rows(), ids=[name[:40] for name in page_rows()])
def test_every_name_a_blocks_client_file_uses_is_defined_by_the_block_or_your_script(optimization):
    # A client file: the block, its copy lines replaced by the pieces. A name neither its imports nor its pieces nor
    # the client's script define would be a NameError, on whatever path first reaches it (an error path too)
    assert undefined_names(block_source(copy_page()[optimization]), your_names()) == []


@pytest.mark.parametrize("optimization", page_rows(), ids=[name[:40] for name in page_rows()])
def test_a_block_without_any_one_of_its_imports_fails_the_check(optimization):
    block = copy_page()[optimization]
    imports = block_imports(block).splitlines(True)
    for line in imports:
        assert undefined_names(block_source(block.replace(line, "", 1)), your_names()) != [], f"unneeded: {line}"


CAPTURED = list(captured_blocks())


def test_code_a_client_writes_stands_in_the_pages_blocks_which_its_tests_run_not_in_its_prose():
    # The prose names things (`make_train_step`, `"lr_scale"`); a statement or a call to write is in a block
    assert {title: prose_code(body) for title, body in page_sections().items() if prose_code(body)} == {}
    assert prose_code("pass it: `functools.partial(step, size)`, `x = 1`, `rates[epoch]`; `amp_dtype`") == [
        "functools.partial(step, size)", "x = 1", "rates[epoch]"], "the check finds code in prose"
    assert CAPTURED == ["progressive resizing (16, 24, then 32 px)", MUON,
                        "the recipe: 20 epochs of batch 512, lr 0.016"]


@pytest.mark.parametrize("optimization", CAPTURED, ids=[name[:40] for name in CAPTURED])
def test_a_captured_step_block_uses_only_names_defined_before_it_and_needs_each_of_its_imports(optimization):
    # Its client file: your script, the graph row's block, then this one, each block's copy lines replaced by pieces
    assert undefined_names(captured_source(optimization), your_names()) == []
    before = your_names() | assigned_names(block_source(graph_head()))
    block = captured_blocks()[optimization]
    assert undefined_names(block_source(block), before) == []
    for line in block_imports(block).splitlines(True):
        assert undefined_names(block_source(block.replace(line, "", 1)), before) != [], f"unneeded: {line}"


def test_the_page_names_the_pasted_names_scripts_often_hold_and_a_whole_word_rename_keeps_the_clients_own(
        tmp_path, monkeypatch):
    # A client whose transform is held in `normalize`: the data row's block pasted as it stands replaces it, and the
    # client's next call of its transform fails naming the pasted function's arguments; renamed as the page says
    # (whole words, in the pasted lines), both work
    intro = PAGE.read_text().split("\n## ")[0]
    for name in ("normalize", "augment", "adamw", "fail", "local_rank", "optimizer_step", "setup_distributed", "Muon"):
        assert f"`{name}`" in intro, name
    monkeypatch.chdir(tmp_path)  # the client's checkpoint
    client = copy_page()[YOUR_SCRIPT] + "\nnormalize = transforms.Normalize(MEAN, STD)\n"
    block = block_source(copy_page()["the dataset on the device, batch augmentation"]).replace("epochs)", "1)")
    uses_its_transform = "\nnormalize(torch.rand(3, 32, 32))\n"
    with pytest.raises(TypeError, match=r"normalize\(\) missing 1 required positional argument: 'statistics'"):
        exec(compile(client + block + uses_its_transform, "<client file>", "exec"), {"__name__": "client"})
    renamed = re.sub(r"\bnormalize\b", "normalize_batch", block)
    (tmp_path / "checkpoint.pt").unlink()
    exec(compile(client + renamed + uses_its_transform, "<client file>", "exec"), {"__name__": "client"})


def test_your_script_on_the_page_defines_what_the_blocks_use_and_runs_alone():
    script = copy_page()[YOUR_SCRIPT]
    assert undefined_names(script) == []
    assert {"device", "model", "optimizer", "criterion", "train_set", "test_set", "train_loader"} <= your_names()
    assert re.search(r'^device = "cuda" if .* else "cpu"$', script, re.M), "a string device, as most scripts hold"


def client_sgd(parameters, lr=0.01, device=CPU):
    """The second client's SGD kept as the graph row asks: its rate a float32 tensor on the device, fused=True."""
    return torch.optim.SGD(parameters, lr=torch.tensor(lr, device=device), momentum=0.9, nesterov=True,
                           weight_decay=5e-4, fused=True)


@cuda_test
@pytest.mark.parametrize("in_sequence, optimizer", [(False, capturable_adamw), (False, client_sgd), (True, None)],
                         ids=["AdamW", "the client's SGD", "in sequence"])
def test_cuda_the_copied_step_replays_as_a_graph_with_host_syncs_forbidden(in_sequence, optimizer, capsys):
    gpu = torch.device("cuda")
    pieces = sequence() if in_sequence else copied("the whole step on device buffers, one CUDA graph")
    model = TutorialNet(global_pooling=True).to(gpu)
    filters = [parameter for parameter in model.parameters() if parameter.ndim == 4]
    others = [parameter for parameter in model.parameters() if parameter.ndim != 4]
    optimizers = [pieces.Muon(filters, torch.tensor(0.01, device=gpu)), capturable_adamw(others, device=gpu)] \
        if in_sequence else optimizer(model.parameters(), device=gpu)  # one optimizer, not in a list
    images, labels = pieces.load_to_device(client_dataset(), gpu)
    plan = pieces.empty_plan((images, labels), pieces.channel_statistics(images), 2, 8, 16)
    step = pieces.make_train_step(model, nn.CrossEntropyLoss(), optimizers, plan)
    graphed = pieces.cuda_graph((lambda: step(32)) if in_sequence else step, gpu)
    generator, rates, losses = torch.Generator(gpu).manual_seed(0), torch.full((8,), 0.01, device=gpu), []
    for epoch in range(4):
        pieces.plan_epoch(plan, pieces.draw_epoch(len(labels), 16, 2, generator), rates)
        torch.cuda.set_sync_debug_mode("error" if epoch else 0)  # epoch 1: the warm-up and the capture
        try:
            for _ in range(8):
                graphed()
        finally:
            torch.cuda.set_sync_debug_mode(0)
        losses.append(plan.losses.mean().item())
    assert "step: captured as a CUDA graph" in capsys.readouterr().out and losses[-1] < losses[0], losses


def test_the_pieces_copy_under_the_mit_license_the_table_and_the_page_name_and_muon_keeps_its_credit():
    license_text = (ROOT / "LICENSE").read_text()
    assert license_text.startswith("MIT License\n") and "Copyright (c) 2026 the fast-cifar authors" in license_text
    readme = (ROOT / "README.md").read_text()
    heading = next(line for line in readme.splitlines() if line.startswith("## What to copy first"))
    assert "(docs/copy.md)" in heading and "MIT" in heading and "(LICENSE)" in heading
    assert "MIT-licensed (see [LICENSE](../LICENSE))" in PAGE.read_text()
    for script in ("opt5.py", "opt6.py"):
        lines, found = definitions(script)
        muon, orthogonalize = ("\n".join(lines[found[name][0] - 1:found[name][1]])
                               for name in ("Muon", "orthogonalize"))
        assert "Muon (Keller Jordan, 2024)" in muon and "Keller Jordan's coefficients" in orthogonalize


def test_the_autocast_rows_own_words_run_on_the_string_device_the_row_says_it_takes():
    needs = copy_table()["16-bit autocast where the hardware runs it, float32 elsewhere"][1]
    words = re.search(r"`(torch\.autocast\(.*?\))`", needs)[1]
    for device in ("cpu", CPU):  # a string, as most scripts hold it, and a torch.device
        dtype = torch.bfloat16
        with eval(words, {"torch": torch, "device": device, "dtype": dtype}):
            assert torch.is_autocast_enabled("cpu")


def test_in_the_data_parallel_block_rank_0_alone_writes_files_as_its_row_says():
    tree = ast.parse(copy_page()["data parallelism"])
    saves = [node for node in ast.walk(tree) if isinstance(node, ast.Call) and ast.unparse(node.func) in (
        "torch.save", "save_checkpoint", "os.makedirs")]  # its files, its checkpoint, its folder
    on_rank_0 = [node for branch in ast.walk(tree) if isinstance(branch, ast.If) and ast.unparse(branch.test) ==
                 "rank == 0" for node in ast.walk(branch) if node in saves]
    assert saves and on_rank_0 == saves
    assert "rank 0 writes files" in copy_table()["data parallelism"][1]
