"""accounting.py: what the lab counts about a run, outside the run: its training FLOPs, its time on an H200 by a
model fitted to measured steps, the commit its code came from and which data it read.

A script's --json row holds what the run measured (settings, each epoch's seconds, steps and accuracy); benchmark.py,
lab/ablation.py and lab/warm_clock.py add these fields to the rows they write (add_work, add_provenance), and
lab/plot.py adds the work to older rows that lack it, so a training run never spends its seconds counting.
"""
import collections
import copy
import functools
import hashlib
import statistics
import subprocess
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

import root  # noqa: F401  (first: the repository's root on sys.path, for the scripts and common.py)
import common  # noqa: E402


# ------------------------------------------------------------------------------------------ FLOPs

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
    it and its parameters, every gradient 1 but a frozen parameter's (none: a step skips it): the weights it was
    given do not move."""
    # every attribute copied (copy.deepcopy of an optimizer keeps only its state and groups, losing a subclass's own)
    optimizer, original = object.__new__(type(optimizer)), optimizer
    optimizer.__dict__.update(copy.deepcopy(original.__dict__))
    # and none of its step hooks (an EMA's would move a run's average one step towards the weights)
    optimizer._optimizer_step_pre_hooks = collections.OrderedDict()
    optimizer._optimizer_step_post_hooks = collections.OrderedDict()
    for group in optimizer.param_groups:
        for parameter in group["params"]:
            parameter.grad = torch.ones_like(parameter) if parameter.requires_grad else None
    with FlopCounterMode(display=False) as counter:
        optimizer.step()
    return counter.get_total_flops()


@functools.cache
def muon_update_flops(steps):
    """FLOPs of one step of opt5's two optimizers on ResNet10 (Muon with `steps` Newton-Schulz steps for the filters,
    AdamW for the rest), counted by torch's FlopCounterMode."""
    import opt5
    parameters, cpu = list(common.ResNet10().parameters()), torch.device("cpu")
    others = opt5.adamw([parameter for parameter in parameters if parameter.ndim != 4], 1e-3, cpu)
    muon = opt5.Muon([parameter for parameter in parameters if parameter.ndim == 4], torch.tensor(1e-3),
                     dtype=torch.float32, steps=steps)
    return update_flops(muon) + update_flops(others)


def step_update_flops(settings):
    """FLOPs of one optimizer step of a run with these --json settings: Muon's matmuls where it ran Muon, else none
    (SGD's and AdamW's updates are elementwise)."""
    if settings.get("optimizer") != "muon":
        return 0
    return muon_update_flops(settings.get("ns_steps", 5))  # runs before --ns-steps had 5


# ------------------------------------------------------------------------------ the modelled H200

# A GPU's training time, modelled (how the recipe work is counted): a step costs a fixed part (its launch, the
# update, the kernels too small to fill the GPU) plus a part for each image x pixel it trains on, fitted by least
# squares to steps measured on an H200: (images a step, image side, ms a step). PROVISIONAL: these are the probe's
# uncompiled step captured with AdamW alone (lab/results/h200-d264298/capture-probe-2.log), not the recipe script's own
# default path, and a step with Muon adds H200_MUON_STEP_SECONDS, the gap between this fit and the steps compiled
# with Muon (lab/README.md, "The modelled H200 time")
H200_MEASURED_STEPS = [(128, 32, 1.806), (512, 16, 1.862), (512, 24, 3.157), (512, 32, 4.793)]
H200_MUON_STEP_SECONDS = 0.6e-3
H200_MODEL = "provisional: fitted to the uncompiled step captured with AdamW alone, +0.6 ms a step with Muon"


@functools.cache
def h200_step_fit(measured=tuple(H200_MEASURED_STEPS)):
    """(fixed seconds, seconds per image x pixel) of a step, least squares over `measured` (images a step, side, ms)."""
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


def add_work(row):
    """`row` (a script's --json row) with what its run did counted: each epoch's and the run's training FLOPs and
    modelled H200 seconds, FLOPs per image at 32 x 32, the steady TFLOP/s achieved, and the model's name."""
    row = dict(row, epochs=[dict(record) for record in row["epochs"]])
    settings, per_image, speed = row["settings"], training_flops_per_image(), row.get("steady_images_per_second")
    row.update(count_work(row["epochs"], step_update_flops(settings), muon=settings.get("optimizer") == "muon"),
               training_flops_per_image=per_image, modelled_h200=H200_MODEL,
               achieved_tflops=speed and speed * per_image / 1e12)
    return row


# ------------------------------------------------------------------------- where a row came from

def git_commit():
    """The commit of the checkout the scripts are in, "+changes" after it where their tracked .py files differ from
    it; None outside a git checkout (or without git)."""
    def git(*words):
        # the checkout this file is in: git finds it from lab/ as from the root
        return subprocess.run(["git", *words], cwd=Path(__file__).parent, capture_output=True, text=True, timeout=30)
    try:
        commit, changes = git("rev-parse", "--short", "HEAD"), git("status", "--porcelain", "--", ":(top)*.py")
    except (OSError, subprocess.SubprocessError):
        return None
    if commit.returncode != 0:
        return None
    changed = any(not line.startswith("??") for line in changes.stdout.splitlines())
    return commit.stdout.strip() + ("+changes" if changed else "")


def commit_at_start():
    """git_commit(), read as a tool starts, before it runs anything, so that its rows name the code they started
    with; where it is unknown, one line says so."""
    commit = git_commit()
    if commit is None:
        print("commit unknown: not a git checkout (or git is missing), so the rows' commit is null")
    return commit


def fingerprint(file_md5s):
    """12 hex digits of the md5 of the files' md5s, in order."""
    return hashlib.md5("".join(file_md5s).encode()).hexdigest()[:12]


def official_cifar10():
    """The official CIFAR-10 files' names and md5s, as torchvision checks them, in its order."""
    import torchvision
    return torchvision.datasets.CIFAR10.train_list + torchvision.datasets.CIFAR10.test_list


def data_fingerprint(settings):
    """What data a run with these --json settings read: "synthetic", or the fingerprint of the CIFAR-10 files in its
    data_dir (their md5s, so the official files always give fingerprint() of torchvision's list, and a copy anything
    else); None if absent."""
    if settings.get("synthetic"):
        return "synthetic"
    folder = Path(settings.get("data_dir") or "./data") / "cifar-10-batches-py"
    try:
        return fingerprint([hashlib.md5((folder / name).read_bytes()).hexdigest() for name, _ in official_cifar10()])
    except OSError:
        return None


def add_provenance(row, commit):
    """`row` with the commit its code came from (`commit`, read when the tool started) and its data's fingerprint."""
    return {**row, "commit": commit, "data_fingerprint": data_fingerprint(row["settings"])}


def shown(value, spec):
    """`value` formatted by `spec`, or n/a where it was not measured (a bf16 peak without a bf16 unit, say)."""
    return "n/a" if value is None else format(value, spec)
