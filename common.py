"""What the fast-cifar scripts share and none is about: the command line, the device choice, the ResNet10 model, the
transforms, the data (real CIFAR-10 or a learnable synthetic stand-in), the clock and the run's report (the epoch
lines, the summary, --json). The optimizations live in the scripts. machine.py holds the checks of your machine that
pick_device asks (torch version, GPU, driver, compiler): verdicts in one line, nothing to learn there.
"""
import argparse
import contextlib
import datetime
import json
import math
import os
import pickle
import platform
import re
import shlex
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from PIL import Image

import machine

try:
    import resource  # Unix only: peak memory of this process
except ImportError:  # Windows
    resource = None

# Per-channel statistics of the 50,000 CIFAR-10 training images.
CIFAR10_MEAN = (0.4914, 0.4822, 0.4465)
CIFAR10_STD = (0.2470, 0.2435, 0.2616)


def cifar10_statistics(device):
    """CIFAR-10's channel mean and std in uint8 units, as one 2 x 1 x 3 x 1 x 1 tensor on `device`: what the scripts'
    normalize takes (channel_statistics computes the same from any images)."""
    return torch.tensor([CIFAR10_MEAN, CIFAR10_STD], device=device).view(2, 1, 3, 1, 1) * 255


def channel_statistics(images):
    """The per-channel mean and std of uint8 `images` (N x 3 x H x W) in uint8 units, as cifar10_statistics gives
    them: for a dataset other than CIFAR-10."""
    std, mean = torch.std_mean(images.transpose(0, 1).flatten(1).float(), dim=1, correction=0)
    return torch.stack([mean, std]).view(2, 1, 3, 1, 1)


# Random crops shift an image by at most this many pixels: 2, milder than the usual 4 (4 not measured against it)
CROP_PADDING = 2
CIFAR10_TRAIN_SIZE = 50_000
CIFAR10_TEST_SIZE = 10_000


# The chain's numbering a --json row's "script" uses: 2 since opt3 was split in two (lab/README.md)
CHAIN_NUMBERING = 2
# A long epoch (minutes on a CPU) prints a progress line this often.
PROGRESS_SECONDS = 30
# Where the launch clock starts on systems without /proc: when the first script imports this module.
IMPORTED_AT = time.perf_counter()


# ----------------------------------------------------------------------------------- command line

class ArgumentParser(argparse.ArgumentParser):
    """argparse, but a bad flag ends with one line and exit code 2 instead of the usage text."""

    def error(self, message):
        fail(f"{message} (see --help)")


def bounded(name, convert, accept, words):
    """An argparse type called `name`: `convert` of the text, refused ("must be `words`") unless `accept` takes it."""
    def parse(text):
        value = convert(text)
        if not accept(value):
            raise argparse.ArgumentTypeError(f"must be {words}, got {text}")
        return value
    parse.__name__ = name  # argparse names it in "invalid positive_int value: 'x'"
    return parse


positive_int = bounded("positive_int", int, lambda value: value >= 1, "a positive integer")
non_negative_int = bounded("non_negative_int", int, lambda value: value >= 0, "0 or more")
fraction = bounded("fraction", float, lambda value: 0 <= value < 1, "at least 0 and below 1")
positive_float = bounded("positive_float", float, lambda value: 0 < value < math.inf, "a positive number")


def build_parser(description, batch_size, lr, epochs=5):
    """The flags every script has; a script adds its own and passes its defaults."""
    parser = ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    add = parser.add_argument
    add("--epochs", type=positive_int, default=epochs, help=f"passes over the training set (default: {epochs})")
    add("--batch-size", type=positive_int, default=batch_size,
        help=f"images per forward and backward pass, in each process (default: {batch_size})")
    add("--lr", type=positive_float, default=lr,
        help=f"learning rate; a one-cycle schedule's peak, where a script has one; one that scales it prints the rate "
             f"it uses (default: {lr})")
    add("--data-dir", default="./data", help="CIFAR-10 location; downloaded there if missing (default: ./data)")
    add("--device", choices=["auto", "cuda", "cpu"], default="auto",
        help="auto = cuda if available, else cpu (default: auto)")
    add("--seed", type=int, default=0,
        help="random seed for the weights, the images' order and any augmentation (default: 0)")
    add("--synthetic", action="store_true",
        help="learnable random data made in memory, no download: for speed, not accuracy (default: off)")
    add("--train-size", type=positive_int, default=None,
        help="train on the first N training images only (default: all 50,000)")
    add("--test-size", type=positive_int, default=None,
        help="evaluate on the first N test images only (default: all 10,000)")
    add("--validation", metavar="N", type=non_negative_int, default=0,
        help="score on the last N training images, held out, instead of the test set, to choose settings without "
             "looking at it; --train-size and --test-size then cut the rest and those (default: 0, off)")
    add("--json", metavar="PATH", default=None,
        help="append one JSON line with the settings and every reported figure (default: off)")
    add("--save", metavar="PATH", default=None, help="save the final weights (a state_dict) here (default: off)")
    add("--profile", metavar="DIR", default=None,
        help="write a torch.profiler trace of 3 steps of the last epoch to DIR; that epoch's timing "
             "includes the profiler's overhead (default: off)")
    return parser


def check_args(args, images_per_step):
    """Settings that argparse cannot check alone; returns args."""
    train_size = args.train_size or CIFAR10_TRAIN_SIZE - args.validation
    if train_size < images_per_step:
        fail(f"--train-size {train_size} is smaller than one optimizer step ({images_per_step} images); "
             f"use a larger --train-size or a smaller --batch-size")
    return args


def print_settings(script, device, args):
    """One line naming the script, the device and every setting, so a log says what produced it."""
    settings = ", ".join(f"{name} {value}" for name, value in vars(args).items() if value is not None)
    print(f"{Path(script).name} on {device}: {settings}")


# ------------------------------------------------------------------------------------------- device

def pick_device(args):
    """torch.device for --device once machine.py's checks (one line each, before data loads) pass: a problem ends the
    run (exit 2); auto falls back to the CPU saying why; --compile off where it can't."""
    fail_on(machine.torch_too_old())
    name = args.device
    if name in ("auto", "cuda"):
        reason, remedy = machine.why_no_cuda()
        if reason is None:
            name = "cuda"
            fail_on(machine.gpu_without_kernels())
        elif name == "cuda":
            fail(f"--device cuda: {reason}; {remedy + ', or ' if remedy else ''}use --device cpu")
        else:
            name = "cpu"
            say(f"{reason}: running on the CPU (slow; the scripts target CUDA)" + (f"; {remedy}" if remedy else ""))
    device = torch.device(name)  # a rank's own GPU is opt6's choice
    if getattr(args, "compile", False):
        problem = machine.compile_problem(device)
        if problem is not None:
            say(f"torch.compile cannot work here: {problem}; running eager instead (as --no-compile)")
            args.compile = False
    return device


def say(line):  # a verdict once per job: under torchrun, on global rank 0 only
    if os.environ.get("RANK", "0") == "0":
        print(line)


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

# torchvision is imported where it is used: it imports torch.compile's machinery, seconds that --help, a bad flag or a
# verdict on the machine need not wait for.

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
    """uint8 images (N, 32, 32, 3) and labels served as (transform(PIL image), label), with the attributes of
    torchvision's CIFAR10 (`data`, `targets`, `transform`), so code that reads one reads the other."""

    def __init__(self, data, targets, transform):
        self.data, self.targets, self.transform = data, targets, transform

    def __len__(self):
        return len(self.data)

    def __getitem__(self, index):
        return self.transform(Image.fromarray(self.data[index])), self.targets[index]


def synthetic_cifar10(size, train, transform, noise=0.45):
    """A learnable CIFAR-shaped dataset: each class a fixed random image (one seed, both splits), each sample noisy."""
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
    reads them, but without its md5 check of all six files (180 MB) for each set at every load and without
    importing torchvision; exit 2 on a file that is not a dict of `data` (N x 3,072 bytes) and `labels`."""
    batches = []
    for name in names:
        try:
            with open(folder / name, "rb") as file:
                batch = pickle.load(file, encoding="latin1")
            batches.append((batch["data"].reshape(-1, 3, 32, 32), batch["labels"]))
        except (pickle.UnpicklingError, EOFError, ValueError, KeyError, TypeError, IndexError,
                AttributeError) as error:  # what a file of other bytes, or of another pickle, raises here
            fail(f"{folder / name} is not a CIFAR-10 batch ({type(error).__name__}: {str(error)[:80]}); delete "
                 f"{folder} to download it again")
    data = np.concatenate([images for images, _ in batches]).transpose(0, 2, 3, 1)
    return ImageArrayDataset(data, [label for _, labels in batches for label in labels], transform)


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
    """End the run with one line on stderr and exit code `code` (2 by default: a flag, the data or the machine)."""
    print(f"error: {message}", file=sys.stderr)
    sys.exit(code)


def fail_on(problem):  # exit 2 where a check of machine.py found a problem, given in words; go on where it is None
    if problem is not None:
        fail(problem)


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
    """torch.cpu.get_capabilities(); on a torch without it (2.6), the keys read here, from torch and /proc/cpuinfo."""
    if hasattr(torch.cpu, "get_capabilities"):
        return torch.cpu.get_capabilities()
    cpuinfo = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").is_file() else ""  # Linux: Arm's features too
    return {"cpu_name": next(iter(re.findall(r"model name\s*:\s*(.*)", cpuinfo)), ""),
            "amx_bf16": torch.cpu._is_amx_tile_supported(), "avx512_bf16": torch.cpu._is_avx512_bf16_supported(),
            "sve_bf16": "svebf16" in cpuinfo.split(), "bf16": "bf16" in cpuinfo.split()}


def bfloat16_unit():
    """The name of this CPU's bfloat16 hardware, or None where it has none (bfloat16 runs there without a unit)."""
    capabilities = cpu_capabilities()
    units = [("amx_bf16", "AMX-BF16"), ("avx512_bf16", "AVX-512 BF16"), ("sve_bf16", "SVE BF16"), ("bf16", "Arm BF16")]
    return next((name for key, name in units if capabilities.get(key)), None)


def cpu_name():
    """The CPU's model name and its bfloat16 unit, on any operating system."""
    name = cpu_capabilities().get("cpu_name") or platform.processor() or "unknown CPU"
    return f"{name} ({bfloat16_unit() or 'no bf16 unit'})"


def seconds_since_launch():
    """Wall seconds since this process started (Linux: the kernel's record, 10 ms ticks), Python's start-up, imports
    and data loading included; elsewhere since common.py's import, which misses start-up and torch's import."""
    try:
        with open("/proc/uptime") as uptime, open("/proc/self/stat") as stat:
            seconds_since_boot = float(uptime.read().split()[0])
            start_ticks = int(stat.read().rpartition(")")[2].split()[19])  # field 22, starttime, after the name
        return seconds_since_boot - start_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, AttributeError):
        return time.perf_counter() - IMPORTED_AT


def peak_memory_bytes(device):
    """GPU: the most memory tensors ever held. CPU: peak resident memory of this process (None on Windows)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    if resource is None:
        return None
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # macOS reports bytes, Linux KiB


@contextlib.contextmanager
def step_monitor(epoch, profile_dir, device, clock=time.monotonic):
    """Watches one epoch's training steps; the loop calls the yielded object's step() once per optimizer step. A
    long epoch prints a progress line every PROGRESS_SECONDS (Python numbers only: reading a tensor would make the
    host wait for the GPU). With `profile_dir`, torch.profiler also traces steps 3-5 into that folder."""
    trace = contextlib.nullcontext(SimpleNamespace(step=lambda: None))
    if profile_dir is not None:
        activities = [torch.profiler.ProfilerActivity.CPU]
        if device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        trace = torch.profiler.profile(
            activities=activities,
            schedule=torch.profiler.schedule(wait=1, warmup=1, active=3, repeat=1),
            on_trace_ready=torch.profiler.tensorboard_trace_handler(profile_dir),
        )
    start = last_print = clock()
    steps = 0

    def step():
        nonlocal steps, last_print
        steps += 1
        profiler.step()
        seconds = clock()
        if seconds - last_print >= PROGRESS_SECONDS:
            last_print = seconds
            print(f"  epoch {epoch}: {steps} steps in {seconds - start:.0f} s", flush=True)

    with trace as profiler:
        yield SimpleNamespace(step=step)


def record_epoch(records, train, test, train_seconds, image_size=None, test_images=None):
    """Append one epoch's figures to `records` as a dict, and print them as one line. `train` is what
    train_one_epoch returns (loss, accuracy, optimizer steps, images), `test` what evaluate returns (loss, accuracy);
    `image_size` and `test_images` for scripts that train on smaller images or score part of the test set."""
    (train_loss, train_accuracy, steps, images), (test_loss, test_accuracy) = train, test
    record = {"epoch": len(records) + 1, "train_loss": train_loss, "train_accuracy": train_accuracy,
              "test_loss": test_loss, "test_accuracy": test_accuracy, "train_seconds": train_seconds,
              "images_per_second": images / train_seconds, "ms_per_step": 1000 * train_seconds / steps,
              "steps": steps, "images": images,
              "launch_seconds": seconds_since_launch()}  # the test accuracy is known this long after the launch
    size_note = test_note = ""
    if image_size is not None:
        record["image_size"] = image_size
        size_note = f" ({image_size}x{image_size})"
    if test_images is not None:
        record["test_images"] = test_images
        test_note = f" ({test_images} images)"
    first_at_its_size = all(earlier.get("image_size") != image_size for earlier in records)
    note = "  (includes warm-up, and compiling where on)" if first_at_its_size else ""
    print(f"epoch {record['epoch']}: train{size_note} loss {train_loss:.4f} acc {100 * train_accuracy:.2f}% | "
          f"test{test_note} loss {test_loss:.4f} acc {100 * test_accuracy:.2f}% | "
          f"{train_seconds:.1f} s, {record['images_per_second']:.0f} img/s, "
          f"{record['ms_per_step']:.1f} ms/step | {record['launch_seconds']:.0f} s since launch{note}", flush=True)
    records.append(record)


def summarize(records, total_seconds, peak_memory):
    """Whole-run figures. Steady state = epochs after the first, so compile/warm-up is excluded; where epochs train
    on different image sizes their speeds do not add up, and it is not measured."""
    one_size = len({record.get("image_size") for record in records}) == 1
    steady = records[1:] if one_size else []
    summary = {"total_seconds": total_seconds, "warmup_seconds": None, "steady_images_per_second": None,
               "steady_ms_per_step": None, "final_test_accuracy": records[-1]["test_accuracy"],
               "launch_to_result_seconds": records[-1]["launch_seconds"], "peak_memory_bytes": peak_memory}
    if steady:
        seconds = sum(r["train_seconds"] for r in steady)
        images_per_second = sum(r["images"] for r in steady) / seconds
        first = records[0]
        summary.update(
            steady_images_per_second=images_per_second,
            steady_ms_per_step=1000 * seconds / sum(r["steps"] for r in steady),
            # Warm-up: what epoch 1 took beyond its images at the steady-state rate (0 if it was no slower).
            warmup_seconds=max(0.0, first["train_seconds"] - first["images"] / images_per_second),
        )
    return summary


def report(script, run, records, total_seconds):
    """Print the run's summary and, with --json, append it with every setting and epoch (the optimizer's last
    learning rate and opt6's number of processes included)."""
    args, device = run.args, run.device
    optimizers = getattr(run, "optimizers", None) or [run.optimizer]  # opt4 on: a list (opt5: Muon's and AdamW's)
    # The clock started just before the first epoch's first step: what came before it is setup (imports, checks,
    # data, model, schedule)
    setup_seconds = seconds_since_launch() - total_seconds
    summary = summarize(records, total_seconds, peak_memory_bytes(device))
    summary.update(setup_seconds=setup_seconds, final_lr=float(optimizers[-1].param_groups[0]["lr"]))
    memory_kind = "GPU max allocated" if device.type == "cuda" else "CPU peak RSS"
    peak = summary["peak_memory_bytes"]
    memory = f"{peak / 2**30:.2f} GiB ({memory_kind})" if peak is not None else "not measured on this system"
    print(f"done: {total_seconds:.1f} s of epochs, {summary['launch_to_result_seconds']:.0f} s from launch to result "
          f"({setup_seconds:.1f} s of it before the first step) | "
          f"final test acc {100 * summary['final_test_accuracy']:.2f}% | "
          f"peak memory {memory}")
    if summary["steady_images_per_second"] is None:
        why = "it excludes epoch 1, so it needs --epochs 2 or more" if len(records) == 1 else \
            "the epochs train on different image sizes; each epoch's line has its speed"
        print(f"steady state: not measured ({why})")
    else:
        print(f"steady state (epochs 2+): {summary['steady_images_per_second']:.0f} img/s, "
              f"{summary['steady_ms_per_step']:.1f} ms/step | warm-up {summary['warmup_seconds']:.1f} s")
    if args.json:
        result = {"script": Path(script).name, "date": datetime.datetime.now().isoformat(timespec="seconds"),
                  "command": shlex.join(["python", Path(sys.argv[0]).name, *sys.argv[1:]]), "torch": torch.__version__,
                  "device": str(device),
                  "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                  "cpu": cpu_name(), "threads": torch.get_num_threads(),
                  "data": "synthetic" if args.synthetic else "cifar10", "chain": CHAIN_NUMBERING,
                  "settings": vars(args), **summary,
                  **({"world_size": run.world_size} if hasattr(run, "world_size") else {}), "epochs": records}
        with open(args.json, "a") as file:
            file.write(json.dumps(result) + "\n")
    return summary
