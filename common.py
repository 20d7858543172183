"""What the fast-cifar scripts' lessons use and none is about: the ResNet10 model, the transforms, the data (real
CIFAR-10 or a learnable synthetic stand-in), the clock, and what this CPU runs natively. The optimizations live in the
scripts; the command line, the checks of your machine and the reporting live in harness.py, which you need not read.
"""
import math
import pickle
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from PIL import Image

# Per-channel statistics of the 50,000 CIFAR-10 training images.
CIFAR10_MEAN = (0.4914, 0.4822, 0.4465)
CIFAR10_STD = (0.2470, 0.2435, 0.2616)


def cifar10_statistics(device):
    """CIFAR-10's channel mean and std in uint8 units, as one 2 x 1 x 3 x 1 x 1 tensor on `device`: what the scripts'
    normalize takes (their channel_statistics computes the same from any images)."""
    return torch.tensor([CIFAR10_MEAN, CIFAR10_STD], device=device).view(2, 1, 3, 1, 1) * 255


# Random crops shift an image by at most this many pixels: 2, milder than the usual 4, suits a 5-epoch budget
CROP_PADDING = 2
CIFAR10_TRAIN_SIZE = 50_000
CIFAR10_TEST_SIZE = 10_000


# ---------------------------------------------------------------------------------------- model

class BasicBlock(nn.Module):
    """Two 3x3 convolutions with a residual connection (He et al., 2016)."""

    def __init__(self, in_channels, out_channels, stride):
        super().__init__()
        # No conv bias: the BatchNorm right after it has its own shift.
        self.conv1 = nn.Conv2d(in_channels, out_channels, 3, stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(out_channels)
        self.conv2 = nn.Conv2d(out_channels, out_channels, 3, 1, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(out_channels)
        self.shortcut = nn.Sequential()
        if stride != 1 or in_channels != out_channels:
            self.shortcut = nn.Sequential(
                nn.Conv2d(in_channels, out_channels, 1, stride, bias=False),
                nn.BatchNorm2d(out_channels),
            )

    def forward(self, x):
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + self.shortcut(x))


class ResNet10(nn.Module):
    """ResNet with one BasicBlock per stage (widths 64-512) and a CIFAR stem: 4,903,242 parameters."""

    def __init__(self, num_classes=10):
        super().__init__()
        # CIFAR images are 32x32: a single 3x3 stride-1 stem, no 7x7 conv and no max-pool.
        self.stem = nn.Sequential(
            nn.Conv2d(3, 64, 3, 1, padding=1, bias=False),
            nn.BatchNorm2d(64),
            nn.ReLU(inplace=True),
        )
        self.layers = nn.Sequential(
            BasicBlock(64, 64, stride=1),
            BasicBlock(64, 128, stride=2),
            BasicBlock(128, 256, stride=2),
            BasicBlock(256, 512, stride=2),
        )
        self.fc = nn.Linear(512, num_classes)

    def forward(self, x):
        x = self.layers(self.stem(x))
        x = F.adaptive_avg_pool2d(x, 1).flatten(1)
        return self.fc(x)


# ----------------------------------------------------------------------------------- transforms

# torchvision is imported where it is used: it takes a second to import (it imports torch.compile's machinery),
# which --help, a bad flag or a verdict on the machine need not wait for.

def plain_transform():
    """PIL image -> float tensor in [0, 1]."""
    from torchvision import transforms
    return transforms.ToTensor()


def normalized_transform():
    """PIL image -> float tensor with zero mean and unit variance per channel."""
    from torchvision import transforms
    return transforms.Compose([transforms.ToTensor(), transforms.Normalize(CIFAR10_MEAN, CIFAR10_STD)])


def augmented_transform():
    """Random 32x32 crop of the padded image (CROP_PADDING pixels) and a random horizontal flip, then normalize."""
    from torchvision import transforms
    return transforms.Compose([
        transforms.RandomCrop(32, padding=CROP_PADDING, padding_mode="reflect"),
        transforms.RandomHorizontalFlip(),
        transforms.ToTensor(),
        transforms.Normalize(CIFAR10_MEAN, CIFAR10_STD),
    ])


# ----------------------------------------------------------------------------------------- data

class ImageArrayDataset(torch.utils.data.Dataset):
    """uint8 images (N, 32, 32, 3) and labels served as (transform(PIL image), label).

    The same attributes (`data`, `targets`, `transform`) as torchvision's CIFAR10, so code that
    reads one reads the other.
    """

    def __init__(self, data, targets, transform):
        self.data, self.targets, self.transform = data, targets, transform

    def __len__(self):
        return len(self.data)

    def __getitem__(self, index):
        return self.transform(Image.fromarray(self.data[index])), self.targets[index]


def synthetic_cifar10(size, train, transform, noise=0.45):
    """A learnable CIFAR-shaped dataset: each class is a fixed random image, each sample adds noise.

    The class images come from a fixed seed, so the train and test splits share them.
    """
    class_images = torch.rand(10, 32, 32, 3, generator=torch.Generator().manual_seed(0))
    generator = torch.Generator().manual_seed(1 if train else 2)
    targets = torch.randint(0, 10, (size,), generator=generator)
    data = torch.empty(size, 32, 32, 3, dtype=torch.uint8)
    for chunk in torch.arange(size).split(4096):  # in chunks: float copies of 50,000 images take 600 MB
        noise_images = torch.rand(len(chunk), 32, 32, 3, generator=generator)
        images = (1 - noise) * class_images[targets[chunk]] + noise * noise_images
        data[chunk] = (images * 255).round().to(torch.uint8)
    return ImageArrayDataset(data.numpy(), targets.tolist(), transform)


def cifar10(data_dir, train, transform):
    """CIFAR-10 from `data_dir` in torchvision's layout, downloaded there by torchvision if missing; exit 2 if that
    fails."""
    folder = Path(data_dir) / "cifar-10-batches-py"
    names = [f"data_batch_{number}" for number in range(1, 6)] if train else ["test_batch"]
    if all((folder / name).is_file() for name in names):
        return read_cifar10(folder, names, transform)
    import torchvision
    try:
        return torchvision.datasets.CIFAR10(data_dir, train=train, transform=transform, download=True)
    except Exception as error:  # any network or archive failure ends the same way
        fail(f"CIFAR-10 is not in {data_dir!r} and the download failed ({type(error).__name__}: "
             f"{str(error)[:120]}); put cifar-10-python.tar.gz or cifar-10-batches-py/ there, "
             f"or run with --synthetic")


def read_cifar10(folder, names, transform):
    """The images (N x 32 x 32 x 3 uint8) and labels of CIFAR-10's pickled batches `names` in `folder`, as torchvision
    reads them, but without its md5 check of all six files (180 MB) for each set at every load (the report
    fingerprints them instead) and without importing torchvision; exit 2 on a file that does not unpickle."""
    batches = []
    for name in names:
        try:
            with open(folder / name, "rb") as file:
                batches.append(pickle.load(file, encoding="latin1"))
        except (pickle.UnpicklingError, EOFError, ValueError, KeyError) as error:
            fail(f"{folder / name} is not a CIFAR-10 batch ({type(error).__name__}: {str(error)[:80]}); delete "
                 f"{folder} to download it again")
    data = np.concatenate([batch["data"] for batch in batches]).reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1)
    return ImageArrayDataset(data, [label for batch in batches for label in batch["labels"]], transform)


def load_data(args, train_transform, test_transform):
    """The training and test sets the flags ask for, cut to --train-size / --test-size. With --validation N the last N
    training images take the test set's place (with its transform), and training has the rest."""
    held_out = getattr(args, "validation", 0)
    if args.synthetic:
        print("synthetic data: accuracy only shows that the loop learns; it says nothing about CIFAR-10")
        train_size = min((args.train_size or CIFAR10_TRAIN_SIZE) + held_out, CIFAR10_TRAIN_SIZE)
        test_size = min(args.test_size or CIFAR10_TEST_SIZE, CIFAR10_TEST_SIZE)
        train_set = synthetic_cifar10(train_size, train=True, transform=train_transform)
        test_set = synthetic_cifar10(test_size, train=False, transform=test_transform)
    else:
        train_set = cifar10(args.data_dir, train=True, transform=train_transform)
        test_set = cifar10(args.data_dir, train=False, transform=test_transform)
    if held_out:
        if held_out >= len(train_set):
            fail(f"--validation {held_out} leaves no training images of the {len(train_set)}; hold out fewer")
        print(f"validation: scoring on the last {held_out} training images, held out from training, not the test set")
        test_set.data, test_set.targets = train_set.data[-held_out:], train_set.targets[-held_out:]
        train_set.data, train_set.targets = train_set.data[:-held_out], train_set.targets[:-held_out]
    for name, dataset, size in (("train", train_set, args.train_size), ("test", test_set, args.test_size)):
        if size is not None and size > len(dataset):
            fail(f"--{name}-size {size} is larger than the {len(dataset)} {name} images; use at most that")
        if size is not None:
            dataset.data, dataset.targets = dataset.data[:size], dataset.targets[:size]
    return train_set, test_set


def fail(message, code=2):
    """End the run with one line on stderr and exit code `code` (2: bad input)."""
    print(f"error: {message}", file=sys.stderr)
    sys.exit(code)


def check_finite(loss_value, epoch, step):
    """Stop the run with a clear message once the loss is NaN or infinite."""
    if not math.isfinite(loss_value):
        fail(f"loss is {loss_value} at epoch {epoch}, step {step}: training diverged; "
             f"try a lower --lr", code=1)


# ---------------------------------------------------------------------------------- the clock and the CPU

def now(device):
    """Seconds on a monotonic clock, read after all work queued on `device` has finished."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # CUDA runs asynchronously: without this we time the launches
    return time.perf_counter()


def cpu_capabilities():
    """torch.cpu.get_capabilities(); on a torch without it (2.6 has none), the keys this module reads."""
    if hasattr(torch.cpu, "get_capabilities"):
        return torch.cpu.get_capabilities()
    try:
        with open("/proc/cpuinfo") as cpuinfo:  # Linux: the model name, and Arm's feature flags
            fields = {key.strip(): value.strip() for key, _, value in (line.partition(":") for line in cpuinfo)}
    except OSError:
        fields = {}
    arm_features = fields.get("Features", "").split()
    return {
        "cpu_name": fields.get("model name", ""),
        "amx_bf16": torch.cpu._is_amx_tile_supported(),  # every CPU with AMX tiles has AMX-BF16
        "avx512_bf16": torch.cpu._is_avx512_bf16_supported(),
        "sve_bf16": "svebf16" in arm_features,
        "bf16": "bf16" in arm_features,
    }


def bfloat16_unit():
    """The name of this CPU's bfloat16 hardware, or None where it has none and oneDNN would emulate bfloat16."""
    capabilities = cpu_capabilities()
    units = [("amx_bf16", "AMX-BF16"), ("avx512_bf16", "AVX-512 BF16"), ("sve_bf16", "SVE BF16"), ("bf16", "Arm BF16")]
    return next((name for key, name in units if capabilities.get(key)), None)
