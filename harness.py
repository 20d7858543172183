"""The fast-cifar scripts' harness: the command line, the checks of your machine (torch version, GPU, driver,
compiler) that each end in one line, and the timing report and --json. Nothing the chain teaches is here: you need
not open this file to learn it.
"""
import argparse
import collections
import contextlib
import copy
import datetime
import functools
import hashlib
import importlib.metadata
import inspect
import io
import json
import logging
import math
import os
import platform
import re
import shlex
import shutil
import statistics
import subprocess
import sys
import time
import warnings
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel
from torch.utils.flop_counter import FlopCounterMode

import common
from common import fail

# torch warns once when an optimizer built capturable=True (opt4 on: a CUDA graph replays its update) steps uncaptured,
# as it does by design here: the warm-up steps before the capture, a step under DDP, update_flops' copy of it
warnings.filterwarnings("ignore", message=".*capturable=True.*")

try:
    import resource  # Unix only: peak memory of this process
except ImportError:  # Windows
    resource = None


# Which numbering of the chain a --json row's "script" uses (see report)
CHAIN_NUMBERING = 2
# A long epoch (minutes on a CPU) prints a progress line this often.
PROGRESS_SECONDS = 30
# Where the launch clock starts on systems without /proc: when the first script imports this module.
IMPORTED_AT = time.perf_counter()


# -------------------------------------------------------------------------------- command line

class ArgumentParser(argparse.ArgumentParser):
    """argparse, but a bad flag ends with one line and exit code 2 instead of the usage text."""

    def error(self, message):
        fail(f"{message} (see --help)")


def positive_int(text):
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def non_negative_int(text):
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {text}")
    return value


def fraction(text):
    value = float(text)
    if not 0 <= value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 0 and below 1, got {text}")
    return value


def positive_float(text):
    value = float(text)
    if not value > 0 or math.isinf(value):
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text}")
    return value


def build_parser(description, batch_size, lr, epochs=5):
    """The flags every script has; a script adds its own and passes its defaults."""
    parser = ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    add = parser.add_argument
    add("--epochs", type=positive_int, default=epochs, help=f"passes over the training set (default: {epochs})")
    add("--batch-size", type=positive_int, default=batch_size,
        help=f"images per training step (default: {batch_size})")
    add("--lr", type=positive_float, default=lr, help=f"learning rate (default: {lr})")
    add("--data-dir", default="./data", help="CIFAR-10 location; downloaded there if missing (default: ./data)")
    add("--device", choices=["auto", "cuda", "cpu"], default="auto",
        help="auto = cuda if available, else cpu (default: auto)")
    add("--seed", type=int, default=0, help="random seed for weights and shuffling (default: 0)")
    add("--synthetic", action="store_true",
        help="learnable random data made in memory, no download: for speed, not accuracy (default: off)")
    add("--train-size", type=positive_int, default=None,
        help="train on the first N training images only (default: all 50,000)")
    add("--test-size", type=positive_int, default=None,
        help="evaluate on the first N test images only (default: all 10,000)")
    add("--validation", metavar="N", type=non_negative_int, default=0,
        help="hold out the last N training images and score on them instead of the test set, to choose settings "
             "without looking at it; --train-size and --test-size then cut the rest and the held-out images "
             "(default: 0, off)")
    add("--json", metavar="PATH", default=None,
        help="append one JSON line with the settings and every reported figure (default: off)")
    add("--save", metavar="PATH", default=None, help="save the final weights (a state_dict) here (default: off)")
    add("--profile", metavar="DIR", default=None,
        help="write a torch.profiler trace of 3 steps of the last epoch to DIR; that epoch's timing "
             "includes the profiler's overhead (default: off)")
    return parser


def check_args(args, images_per_step):
    """Settings that argparse cannot check alone; returns args."""
    train_size = args.train_size or common.CIFAR10_TRAIN_SIZE - args.validation
    if train_size < images_per_step:
        fail(f"--train-size {train_size} is smaller than one optimizer step ({images_per_step} images); "
             f"use a larger --train-size or a smaller --batch-size")
    return args


def print_settings(script, device, args):
    """One line naming the script, the device and every setting, so a log says what produced it."""
    settings = ", ".join(f"{name} {value}" for name, value in vars(args).items() if value is not None)
    print(f"{Path(script).name} on {device}: {settings}")


# ------------------------------------------------ the machine and its torch: GPU, driver, compiler

# The oldest torch the scripts run right on: requirements.txt's floor, which CI trains every script on
OLDEST_TORCH = (2, 6)
# PyTorch's own index of CUDA 12.6 builds: they run on NVIDIA drivers from 525 on and have kernels for sm_50 to sm_90
CUDA_12_INDEX = "https://download.pytorch.org/whl/cu126"
# The oldest NVIDIA driver each CUDA major version runs on (with CUDA's minor version compatibility)
MIN_DRIVER = {11: 450, 12: 525, 13: 580}


def pick_device(args):
    """torch.device for --device, once this machine is known to run the script as asked.

    Each verdict is one line, before any data is loaded: a torch older than the floor ends the run (exit 2); auto
    falls back to the CPU and says why (no GPU, a CPU-only torch, a driver too old for this torch's CUDA) and what to
    do; a GPU this torch has no kernels for ends the run; under torchrun, the device is the process's own GPU
    (LOCAL_RANK), and a machine without it ends the run; a script that compiles (--compile) checks that inductor has
    what it needs and, where it has not, says why and runs eager (args.compile becomes False, so the report says
    so). Under torchrun only rank 0 prints the verdicts that do not end the run.
    """
    check_torch_version()
    name = args.device
    if name in ("auto", "cuda"):
        reason, remedy = why_no_cuda()
        if reason is None:
            name = "cuda"
            check_gpu_architectures()
        elif name == "cuda":
            fail(f"--device cuda: {reason}; {remedy + ', or ' if remedy else ''}use --device cpu")
        else:
            name = "cpu"
            say(f"{reason}: running on the CPU (slow; the scripts target CUDA)" + (f"; {remedy}" if remedy else ""))
    device = torch.device(name)
    if device.type == "cuda" and "LOCAL_RANK" in os.environ:
        device = own_gpu()
    if getattr(args, "compile", False):
        problem = compile_problem(device)
        if problem is not None:
            say(f"torch.compile cannot work here: {problem}; running eager instead (as --no-compile)")
            args.compile = False
    return device


def say(line):
    """Print a verdict once per job: under torchrun, on global rank 0 only."""
    if os.environ.get("RANK", "0") == "0":
        print(line)


def torch_version():
    """This torch's (major, minor): 2.6.0a0+git... (a container's build) is (2, 6)."""
    return tuple(int(number) for number in re.findall(r"\d+", torch.__version__)[:2])


def check_torch_version():
    """Exit 2 on a torch older than OLDEST_TORCH (a cluster's or a notebook's own, say), which would fail mid-run."""
    if torch_version() < OLDEST_TORCH:
        oldest = ".".join(map(str, OLDEST_TORCH))
        fail(f"torch {torch.__version__} is older than {oldest}, the oldest these scripts run on: pip install "
             f"'torch>={oldest}' (a build for your GPU: https://pytorch.org/get-started/locally)")


def own_gpu():
    """Under torchrun, GPU LOCAL_RANK, this process's own (opt6 makes it current); exit 2 where there is no such GPU."""
    local_rank, gpus = int(os.environ["LOCAL_RANK"]), torch.cuda.device_count()
    if local_rank >= gpus:  # Slurm or MIG often shows each task one GPU
        fail(f"LOCAL_RANK is {local_rank}, but this process sees {gpus} GPU(s): start at most {gpus} per machine "
             f"(--nproc_per_node={gpus}), or let every process see every GPU of its machine (Slurm: one torchrun per "
             f"node, not one per GPU)")
    return torch.device("cuda", local_rank)


def why_no_cuda():
    """(None, None) where torch can use a CUDA GPU, else (why not, what to do or None), in words for the log."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        available = torch.cuda.is_available()  # torch warns here when the driver is there but CUDA cannot start
    if available:
        return None, None
    if sys.platform == "darwin":
        return "macOS has no CUDA", None  # and the scripts do not use Apple's GPU (MPS)
    if torch.version.cuda is None and torch.version.hip is None:
        return (f"this torch ({torch.__version__}) is a CPU-only build",
                f"for an NVIDIA GPU, install a CUDA build: pip install {this_torch()} --index-url {CUDA_12_INDEX}")
    warning = next((str(w.message) for w in caught if "driver" in str(w.message).lower()), "")
    found = re.search(r"too old \(found version (\d+)\)", warning)
    if found:
        driver_cuda = int(found.group(1))  # the newest CUDA the driver runs, as 1000 x major + 10 x minor
        major = int(torch.version.cuda.split(".")[0])
        remedy = f"update the driver to {MIN_DRIVER.get(major, 'a newer one')} or newer"
        if major > 12:  # a CUDA 12 build of the same torch runs on drivers from 525 on
            remedy += (f", or install the CUDA 12 build of this torch: pip install {this_torch()} "
                       f"--index-url {CUDA_12_INDEX}")
        return (f"a GPU is here, but its NVIDIA driver is too old for this torch's CUDA {torch.version.cuda} "
                f"(it runs CUDA {driver_cuda // 1000}.{driver_cuda % 1000 // 10} at most)", remedy)
    return "torch sees no CUDA GPU", None


def this_torch():
    """This torch and torchvision as pip requirements, without the build tag: torch==2.15.0 torchvision==0.29.2."""
    versions = [importlib.metadata.version(name).split("+")[0] for name in ("torch", "torchvision")]
    return f"torch=={versions[0]} torchvision=={versions[1]}"


def check_gpu_architectures():
    """Exit 2 naming a visible GPU this torch has no kernels for (nor PTX to build them from), and the remedy."""
    architectures = torch.cuda.get_arch_list()  # e.g. sm_75 ... sm_120: kernels; compute_90: PTX the driver compiles
    if not architectures or torch.version.cuda is None:  # a build that does not say (ROCm, some source builds)
        return
    builds = [(arch.split("_")[0], int(re.sub(r"\D", "", arch.split("_")[1]))) for arch in architectures]  # sm, 90
    for index in range(torch.cuda.device_count()):
        major, minor = torch.cuda.get_device_capability(index)
        capability = 10 * major + minor
        # A kernel built for sm_XY runs on sm_XZ for Z >= Y; PTX for compute_XY is compiled for any newer GPU.
        if any(kind == "sm" and number // 10 == major and number <= capability or
               kind == "compute" and number <= capability for kind, number in builds):
            continue
        remedy = (f"install the CUDA 12.6 build of this torch, which has sm_50 to sm_90: pip install {this_torch()} "
                  f"--index-url {CUDA_12_INDEX}" if capability < 75 else
                  "install a newer torch built for it (https://pytorch.org/get-started/locally)")
        fail(f"GPU {index} ({torch.cuda.get_device_name(index)}) is sm_{capability}, and this torch "
             f"({torch.__version__}) has kernels for {' '.join(architectures)} only: {remedy}; or use --device cpu")


# Why torch.compile failed, by the exception (or the words) that say so, and what to install
COMPILE_FAILURES = {
    "InvalidCxxCompiler": "no C++ compiler for its CPU kernels; install {compiler}",
    "CppCompileError": "the C++ compiler failed on its CPU kernels; install {compiler}",
    "TritonMissing": "no Triton for its GPU kernels (torch installs Triton with itself on Linux only); "
                     "on Windows use WSL2, elsewhere pip install triton",
    "GPUTooOldForTriton": "Triton builds GPU kernels for compute capability 7.0 (V100) and newer only",
    "Failed to find C compiler": "no C compiler for Triton's kernel launcher; install gcc",
}
CXX = {"linux": "g++ (Debian/Ubuntu: apt install g++)", "darwin": "Xcode's command line tools (xcode-select --install)",
       "win32": "Visual Studio's C++ build tools, and run from their Developer Command Prompt"}


@functools.cache
def compile_problem(device):
    """Why torch.compile cannot work on `device` here, with the remedy, or None.

    Read off what inductor needs: a C++ compiler for CPU kernels (found by inductor's own search); for GPU kernels,
    Triton, a GPU of compute capability 7.0 or newer and a C compiler for Triton's launcher. Compiling a trial
    function instead would cost seconds before every run.
    """
    # Inductor's modules import cpp_extension, which on a machine with nvcc and no GPU warns "No CUDA runtime is
    # found, using CUDA_HOME=..." (a print in torch 2.6): noise among a run's first lines, so import it quietly first
    logging.getLogger("torch.utils.cpp_extension").setLevel(logging.ERROR)
    with contextlib.redirect_stderr(io.StringIO()):
        import torch.utils.cpp_extension  # noqa: F401
    if device.type == "cuda":
        from torch.utils._triton import has_triton_package
        if not has_triton_package():
            return COMPILE_FAILURES["TritonMissing"]
        if torch.cuda.get_device_capability(device) < (7, 0):
            return COMPILE_FAILURES["GPUTooOldForTriton"]
        if not (os.environ.get("CC") or any(shutil.which(name) for name in ("clang", "gcc", "cc"))):
            return COMPILE_FAILURES["Failed to find C compiler"]
        return None
    try:
        from torch._inductor import cpp_builder
        cpp_builder.get_cpp_compiler()
    except Exception as error:  # InvalidCxxCompiler, or whatever else stops the search
        return compile_failure(error)
    return None


def compile_failure(error):
    """The innermost cause of a failed compile (inductor wraps what went wrong), in words, with its remedy."""
    causes = []
    while error is not None and error not in causes:
        causes.append(error)
        error = getattr(error, "inner_exception", None) or error.__cause__ or error.__context__
    for cause in reversed(causes):
        for key, words in COMPILE_FAILURES.items():
            if key == type(cause).__name__ or key in str(cause):
                return words.format(compiler=CXX.get(sys.platform, "a C++ compiler"))
    first_line = (str(causes[-1]).strip().splitlines() or [""])[0][:150]
    return f"{type(causes[-1]).__name__}: {first_line}"


# ------------------------------------------------------- torchrun: the job around opt6's processes

def started_by_torchrun():
    """Whether torchrun started this process; exit 2 when only some of the variables it sets are there."""
    ranks = [name for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE") if name in os.environ]
    missing = [name for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
               if name not in os.environ]
    if ranks and missing:
        fail(f"{', '.join(ranks)} set but not {', '.join(missing)}: start {Path(sys.argv[0]).name} with torchrun, "
             f"which sets them all (srun does not), or unset {', '.join(ranks)} to run one process")
    return bool(ranks)


def point_to_torchrun(device, world_size):
    """Say how to start torchrun where one process (world_size 1) on `device` leaves GPUs of this machine idle."""
    gpus = torch.cuda.device_count() if device.type == "cuda" else 0
    if world_size == 1 and gpus > 1:
        print(f"{gpus} GPUs here, and one process uses one: to use them all, start "
              f"torchrun --standalone --nproc_per_node={gpus} {Path(sys.argv[0]).name} ...")


@contextlib.contextmanager
def rank_zero_first(world_size):
    """Runs the body on rank 0, then on the first process of every other machine, then on the rest: one download
    per machine, and never two at once into a folder that machines share (NFS, Lustre), which would corrupt it."""
    if world_size == 1:
        yield
        return
    turn = 0 if dist.get_rank() == 0 else 1 if int(os.environ["LOCAL_RANK"]) == 0 else 2
    for this_turn in range(3):
        if this_turn == turn:
            yield
        dist.barrier()  # the next turn starts once this one's processes have the data


def broadcast_buffers_keyword():
    """The name of DDP's keyword that turns its broadcast of rank 0's buffers before every forward on or off."""
    parameters = inspect.signature(DistributedDataParallel).parameters
    return "forward_sync_buffers" if "forward_sync_buffers" in parameters else "broadcast_buffers"


def leave_process_group():
    """Wait for every rank, then destroy the process group while still holding the barrier's handle (Gloo needs it)."""
    barrier = dist.barrier(async_op=True)
    barrier.wait()
    dist.destroy_process_group()


# ----------------------------------------------------------------------- timing and reporting
def seconds_since_launch():
    """Wall seconds since this process started: Python's start-up, imports and data loading included.

    Linux: from the kernel's record of the process start (10 ms ticks). Elsewhere: since harness.py was
    imported, which misses the interpreter's start-up and the import of torch (a few seconds).
    """
    try:
        with open("/proc/uptime") as uptime, open("/proc/self/stat") as stat:
            seconds_since_boot = float(uptime.read().split()[0])
            start_ticks = int(stat.read().rpartition(")")[2].split()[19])  # field 22, starttime, after the name
        return seconds_since_boot - start_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, AttributeError):
        return time.perf_counter() - IMPORTED_AT


def cpu_name():
    """The CPU's model name and its bfloat16 unit, on any operating system."""
    name = common.cpu_capabilities().get("cpu_name") or platform.processor() or "unknown CPU"
    return f"{name} ({common.bfloat16_unit() or 'no bf16 unit'})"


def peak_memory_bytes(device):
    """GPU: the most memory tensors ever held. CPU: peak resident memory of this process (None on Windows)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    if resource is None:
        return None
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # macOS reports bytes, Linux KiB


@functools.cache
def training_flops_per_image(size=32):
    """FLOPs of one forward and backward pass of ResNet10 per image of size x size (optimizer update not counted)."""
    model = common.ResNet10()
    images = torch.randn(2, 3, size, size)
    with FlopCounterMode(display=False) as counter:
        F.cross_entropy(model(images), torch.tensor([0, 1])).backward()
    return counter.get_total_flops() / len(images)


def update_flops(optimizer):
    """FLOPs of one step of `optimizer` (its matmuls: FlopCounterMode counts no elementwise op), counted on a copy of
    it and its parameters, every gradient 1 but a frozen parameter's (none: a step skips it): the run's own weights
    do not move."""
    # every attribute copied (copy.deepcopy of an optimizer keeps only its state and groups, losing a subclass's own)
    optimizer, original = object.__new__(type(optimizer)), optimizer
    optimizer.__dict__.update(copy.deepcopy(original.__dict__))
    # and none of the run's step hooks (an EMA's would move the run's average one step towards the weights)
    optimizer._optimizer_step_pre_hooks = collections.OrderedDict()
    optimizer._optimizer_step_post_hooks = collections.OrderedDict()
    for group in optimizer.param_groups:
        for parameter in group["params"]:
            parameter.grad = torch.ones_like(parameter) if parameter.requires_grad else None
    with FlopCounterMode(display=False) as counter:
        optimizer.step()
    return counter.get_total_flops()


# A GPU's training time, modelled (how the recipe work is counted): a step costs a fixed part (its launch, the
# update, the kernels too small to fill the GPU) plus a part for each image x pixel it trains on, fitted by least
# squares to steps measured on an H200: (images a step, image side, ms a step). PROVISIONAL: these are the probe's
# uncompiled step captured with AdamW alone (results/h200-d264298/capture-probe-2.log), not the recipe script's own
# default path, and a step with Muon adds H200_MUON_STEP_SECONDS, the gap between this fit and the steps compiled
# with Muon (results/README.md, "The modelled H200 time")
H200_MEASURED_STEPS = [(128, 32, 1.806), (512, 16, 1.862), (512, 24, 3.157), (512, 32, 4.793)]
H200_MUON_STEP_SECONDS = 0.6e-3
H200_MODEL = "provisional: fitted to the uncompiled step captured with AdamW alone, +0.6 ms a step with Muon"


@functools.cache
def h200_step_fit(measured=H200_MEASURED_STEPS):
    """(fixed seconds, seconds per image x pixel) of a step, least squares over `measured`: (images a step, side, ms)."""
    pixels = [images * side ** 2 for images, side, _ in measured]
    per_pixel, fixed = statistics.linear_regression(pixels, [ms / 1000 for _, _, ms in measured])
    return fixed, per_pixel


def modelled_h200_step_seconds(images_per_step, side, muon):
    """An H200 step's seconds by the model above: `images_per_step` images of side x side, with Muon or not."""
    fixed, per_pixel = h200_step_fit()
    return fixed + per_pixel * images_per_step * side ** 2 + H200_MUON_STEP_SECONDS * muon


def count_work(records, step_update_flops, muon):
    """Add each epoch's training FLOPs (forward, backward and update, at its image size) and its modelled H200
    seconds (with Muon or not) to its record; returns both summed over the run."""
    for record in records:
        images_per_step, side = record["images"] / record["steps"], record.get("image_size") or 32
        record["training_flops"] = record["steps"] * (images_per_step * training_flops_per_image(side) +
                                                      step_update_flops)
        record["modelled_h200_seconds"] = record["steps"] * modelled_h200_step_seconds(images_per_step, side, muon)
    return {name: sum(record[name] for record in records) for name in ("training_flops", "modelled_h200_seconds")}


@contextlib.contextmanager
def step_monitor(epoch, profile_dir, device, clock=time.monotonic):
    """Watches one epoch's training steps; the loop calls the yielded object's step() once per optimizer step.

    A long epoch prints a progress line every PROGRESS_SECONDS, so a log shows the run is alive. It
    prints Python numbers only: reading a tensor would make the host wait for the GPU. With
    `profile_dir`, torch.profiler also traces steps 3-5 into that folder.
    """
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


def shown(value, spec):
    """`value` formatted by `spec`, or n/a where it was not measured (a bf16 peak without a bf16 unit, say)."""
    return "n/a" if value is None else format(value, spec)


def record_epoch(records, train, test, train_seconds, image_size=None, test_images=None):
    """Append one epoch's figures to `records` as a dict, and print them as one line.

    `train` is what train_one_epoch returns (loss, accuracy, optimizer steps, images), `test` what evaluate
    returns (loss, accuracy). `image_size` and `test_images` are for scripts that train on smaller images or
    evaluate part of the test set. The first epoch at each image size includes compiling and warming up for it.
    """
    (train_loss, train_accuracy, steps, images), (test_loss, test_accuracy) = train, test
    record = {
        "epoch": len(records) + 1,
        "train_loss": train_loss,
        "train_accuracy": train_accuracy,
        "test_loss": test_loss,
        "test_accuracy": test_accuracy,
        "train_seconds": train_seconds,
        "images_per_second": images / train_seconds,
        "ms_per_step": 1000 * train_seconds / steps,
        "steps": steps,
        "images": images,
        "launch_seconds": seconds_since_launch(),  # the test accuracy is known this long after the launch
    }
    size_note = test_note = ""
    if image_size is not None:
        record["image_size"] = image_size
        size_note = f" ({image_size}x{image_size})"
    if test_images is not None:
        record["test_images"] = test_images
        test_note = f" ({test_images} images)"
    first_at_its_size = all(earlier.get("image_size") != image_size for earlier in records)
    note = "  (includes compile/warm-up)" if first_at_its_size else ""
    print(f"epoch {record['epoch']}: train{size_note} loss {train_loss:.4f} acc {100 * train_accuracy:.2f}% | "
          f"test{test_note} loss {test_loss:.4f} acc {100 * test_accuracy:.2f}% | "
          f"{train_seconds:.1f} s, {record['images_per_second']:.0f} img/s, "
          f"{record['ms_per_step']:.1f} ms/step | {record['launch_seconds']:.0f} s since launch{note}", flush=True)
    records.append(record)


def git_commit():
    """The commit of the checkout these scripts are in, "+changes" after it where their tracked .py files differ from
    it; None outside a git checkout (or without git)."""
    def git(*words):
        return subprocess.run(["git", *words], cwd=Path(__file__).resolve().parent, capture_output=True, text=True,
                              timeout=30)
    try:
        commit, changes = git("rev-parse", "--short", "HEAD"), git("status", "--porcelain", "--", "*.py")
    except (OSError, subprocess.SubprocessError):
        return None
    if commit.returncode != 0:
        return None
    changed = any(not line.startswith("??") for line in changes.stdout.splitlines())
    return commit.stdout.strip() + ("+changes" if changed else "")


# Read at launch (this module's import), so a long run's row names the code that ran, not the checkout at its end
COMMIT_AT_LAUNCH = git_commit()


def fingerprint(file_md5s):
    """12 hex digits of the md5 of the files' md5s, in order."""
    return hashlib.md5("".join(file_md5s).encode()).hexdigest()[:12]


def official_cifar10():
    """The official CIFAR-10 files' names and md5s, as torchvision checks them, in its order."""
    import torchvision
    return torchvision.datasets.CIFAR10.train_list + torchvision.datasets.CIFAR10.test_list


def data_fingerprint(args):
    """What data a run read: "synthetic", or the fingerprint of the CIFAR-10 files in --data-dir (their md5s, so
    the official files always give fingerprint() of torchvision's list, and a copy anything else); None if absent."""
    if args.synthetic:
        return "synthetic"
    folder = Path(args.data_dir) / "cifar-10-batches-py"
    try:
        return fingerprint([hashlib.md5((folder / name).read_bytes()).hexdigest() for name, _ in official_cifar10()])
    except OSError:
        return None


def summarize(records, total_seconds, peak_memory, flops_per_image):
    """Whole-run figures. Steady state = epochs after the first, so compile/warm-up is excluded.

    Where epochs train on different image sizes their speeds do not add up, and steady state is not measured.
    """
    one_size = len({record.get("image_size") for record in records}) == 1
    steady = records[1:] if one_size else []
    summary = {
        "total_seconds": total_seconds,
        "warmup_seconds": None,
        "steady_images_per_second": None,
        "steady_ms_per_step": None,
        "achieved_tflops": None,
        "final_test_accuracy": records[-1]["test_accuracy"],
        "launch_to_result_seconds": records[-1]["launch_seconds"],
        "peak_memory_bytes": peak_memory,
        "training_flops_per_image": flops_per_image,
    }
    if steady:
        seconds = sum(r["train_seconds"] for r in steady)
        images_per_second = sum(r["images"] for r in steady) / seconds
        first = records[0]
        summary.update(
            steady_images_per_second=images_per_second,
            steady_ms_per_step=1000 * seconds / sum(r["steps"] for r in steady),
            # Warm-up: what epoch 1 took beyond its images at the steady-state rate (0 if it was no slower).
            warmup_seconds=max(0.0, first["train_seconds"] - first["images"] / images_per_second),
            achieved_tflops=images_per_second * flops_per_image / 1e12,
        )
    return summary


def report(script, run, records, total_seconds):
    """Print the run's summary and, with --json, append it with every setting and epoch (the optimizer's last
    learning rate, each epoch's FLOPs and modelled H200 time, and opt6's number of processes included)."""
    args, device = run.args, run.device
    optimizers = getattr(run, "optimizers", None) or [run.optimizer]  # opt5 on: Muon's and AdamW's, or AdamW's
    # The clock started just before the first epoch's first step: what came before it is setup (imports, checks,
    # data, model, schedule)
    setup_seconds = seconds_since_launch() - total_seconds
    summary = summarize(records, total_seconds, peak_memory_bytes(device), training_flops_per_image())
    summary["setup_seconds"] = setup_seconds
    muon = any(type(optimizer).__name__ == "Muon" for optimizer in optimizers)  # it adds to the step (H200_MODEL)
    step_flops = sum(update_flops(optimizer) for optimizer in optimizers)
    summary.update(count_work(records, step_flops, muon), modelled_h200=H200_MODEL,
                   final_lr=float(optimizers[-1].param_groups[0]["lr"]))
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
              f"{summary['steady_ms_per_step']:.1f} ms/step, {summary['achieved_tflops']:.3f} TFLOP/s | "
              f"warm-up {summary['warmup_seconds']:.1f} s")
    if args.json:
        if COMMIT_AT_LAUNCH is None:
            print("commit unknown: not a git checkout (or git is missing), so the row's commit is null")
        result = {
            "script": Path(script).name,
            "date": datetime.datetime.now().isoformat(timespec="seconds"),
            "command": shlex.join(["python", Path(sys.argv[0]).name, *sys.argv[1:]]),
            "torch": torch.__version__,
            "device": str(device),
            "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "cpu": cpu_name(),
            "threads": torch.get_num_threads(),
            "data": "synthetic" if args.synthetic else "cifar10",
            # which files: the official CIFAR-10's fingerprint is fingerprint() of torchvision's md5s
            "data_fingerprint": data_fingerprint(args),
            "commit": COMMIT_AT_LAUNCH,  # null where unknown: the summary above says so
            # the scripts' numbering: 2 since opt3 was split in two (opt3.py the data on the device, opt4.py the
            # captured step); a row without it names the scripts as before (results/README.md reads it through a table)
            "chain": CHAIN_NUMBERING,
            "settings": vars(args),
            **summary,
            **({"world_size": run.world_size} if hasattr(run, "world_size") else {}),
            "epochs": records,
        }
        with open(args.json, "a") as file:
            file.write(json.dumps(result) + "\n")
    return summary
