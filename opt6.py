"""opt6.py: opt5.py + data parallelism over many GPUs and machines: DistributedDataParallel under torchrun.

    torchrun --nproc_per_node=8 opt6.py --epochs 5    # one machine, 8 GPUs
    torchrun --nnodes=2 --node_rank=0 --nproc_per_node=8 --rdzv_endpoint=HOST:29500 opt6.py --epochs 5
    torchrun --nproc_per_node=2 opt6.py --synthetic --epochs 2   # no download: measures speed only
    python opt6.py --epochs 5                          # no torchrun: one process, like opt5.py

Each optimization is marked `# opt6:` where it happens; read `diff -u opt5.py opt6.py`.
"""
import argparse
import contextlib
import functools
import os
import sys
from types import SimpleNamespace

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

import common
import harness


def parse_args():
    # opt2: a bigger batch keeps the GPU busy with fewer, larger kernels and fewer optimizer steps
    # opt5: the recipe, chosen on 5,000 held-out training images: 20 epochs of batch 512 are as many steps as 5 of
    # 128 (1,940), and a GPU's small step costs its fixed per-step time, not its images: 90.5 % on the test set
    # (5 epochs of 128: 86.4 %) in 7.3 s of H200 steps, modelled (results/README.md); lr 0.016 = 0.008 x sqrt(4)
    parser = harness.build_parser(__doc__, batch_size=512, lr=0.016, epochs=20)
    # opt3: off by default: on an H200 compiling took ~38 s with an empty cache, more than all 1,950 steps of a
    # 5-epoch run take uncompiled (~7 ms each); on a 2-core CPU it saved nothing a step
    # opt4: captured, a step took 1.81 ms uncompiled, 1.40 compiled whole (older code): ~38 s, won back in ~90,000
    parser.add_argument("--compile", action=argparse.BooleanOptionalAction, default=False,
                        help="torch.compile the model, a graph per image size, inside the captured step; it pays only "
                             "where the steps outlast its compiling (~80 s for the recipe's 3 sizes) (default: off)")
    parser.add_argument("--compile-mode", default="default", choices=["default", "max-autotune-no-cudagraphs"],
                        help="max-autotune-no-cudagraphs times kernel variants for minutes, longer than a short run; "
                             "the modes that capture CUDA graphs themselves are not offered: the script captures the "
                             "whole step (default: default)")
    parser.add_argument("--accum-steps", type=harness.positive_int, default=1,
                        help="micro-batches per optimizer step; effective batch = batch size x this (default: 1)")
    parser.add_argument("--label-smoothing", type=harness.fraction, default=0.1,
                        help="weight of the uniform target mixed into each label (default: 0.1)")
    parser.add_argument("--min-size", type=int, default=16, choices=[8, 16, 24, 32],
                        help="image size of the first epoch; it grows to the full size (32) by the last (default: 16)")
    parser.add_argument("--full-size-share", type=harness.fraction, default=0.3,
                        help="share of the epochs at the full size, the last ones (at least one); the smaller sizes "
                             "share the rest equally (default: 0.3)")
    parser.add_argument("--min-size-batch", type=harness.positive_int,
                        help="images per step in the epochs at --min-size, if below the full size: a small image's "
                             "step is cheap, so its fixed cost weighs most (default: --batch-size)")
    parser.add_argument("--monitor-size", type=harness.positive_int, default=1000,
                        help="test images evaluated after each epoch but the last, which evaluates them all "
                             "(default: 1000)")
    parser.add_argument("--optimizer", choices=["muon", "adamw"], default="muon",
                        help="muon: Muon for the convolution filters and AdamW for the rest; adamw: AdamW for all, "
                             "as opt4 (default: muon)")
    parser.add_argument("--ns-steps", type=harness.positive_int, default=3,
                        help="Newton-Schulz iterations in each Muon update: 3, as airbench94_muon.py (a CIFAR-10 "
                             "speed record) runs; 5, torch.optim.Muon's default, is 5/3 the matmul work (default: 3)")
    args = parser.parse_args()
    world_size = int(os.environ["WORLD_SIZE"]) if started_by_torchrun() else 1  # opt6: processes in the job
    largest_batch = max(args.batch_size, args.min_size_batch or 0)
    return harness.check_args(args, images_per_step=largest_batch * args.accum_steps * world_size)


def started_by_torchrun():
    """Whether torchrun started this process; exit 2 when only some of the variables it sets are there."""
    ranks = [name for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE") if name in os.environ]
    missing = [name for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
               if name not in os.environ]
    if ranks and missing:
        common.fail(f"{', '.join(ranks)} set but not {', '.join(missing)}: start opt6.py with torchrun, which sets "
                    f"them all (srun does not), or unset {', '.join(ranks)} to run one process")
    return bool(ranks)


def setup_distributed(device):
    """(rank, world size, device): torchrun's when it started us, else (0, 1, device) and no process group."""
    if not started_by_torchrun():
        gpus = torch.cuda.device_count() if device.type == "cuda" else 0
        if gpus > 1:
            print(f"{gpus} GPUs here, and one process uses one: to use them all, start "
                  f"torchrun --standalone --nproc_per_node={gpus} opt6.py ...")
        return 0, 1, device
    if device.type == "cuda":
        # opt6: one process per GPU, GPU LOCAL_RANK (harness.pick_device made it current before any CUDA work); NCCL
        # moves gradients GPU to GPU (NVLink, InfiniBand), Gloo on CPUs; naming the GPU binds the communicator to it
        dist.init_process_group("nccl", device_id=device)
    else:
        dist.init_process_group("gloo")
    return dist.get_rank(), dist.get_world_size(), device


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


def average_batchnorm_statistics(model, world_size):
    """Average BatchNorm's running means and variances over the ranks, so every rank evaluates the same model.

    Each rank's statistics follow its own share of the data. Averaging them once per evaluation
    replaces DDP's broadcast of rank 0's before every forward (off: harness.no_buffer_broadcast()).
    """
    if world_size == 1:
        return
    for buffer in model.buffers():
        if buffer.is_floating_point():  # num_batches_tracked counts the same steps on every rank
            dist.all_reduce(buffer)
            buffer /= world_size


def rank_slice(size, rank, world_size):
    """This rank's part of `size` items split into world_size consecutive, disjoint parts of near-equal size."""
    return slice(rank * size // world_size, (rank + 1) * size // world_size)


def autocast_dtype(device):
    """The 16-bit type `device` runs natively, or float32 where it has none; and why, in words, for the log."""
    if device.type == "cuda":
        # opt1: bfloat16 where the GPU runs it natively (Ampere, sm_80, and newer): float32's range, so no
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


def channel_statistics(device):
    """CIFAR-10's per-channel mean and std in uint8 units, as one tensor on `device`: made once (main), not per step."""
    statistics = torch.tensor([common.CIFAR10_MEAN, common.CIFAR10_STD], device=device) * 255
    return statistics.view(2, 1, 3, 1, 1)


def normalize(images, statistics):
    """uint8 images -> float32 with zero mean and unit variance per channel (`statistics`: channel_statistics)."""
    mean, std = statistics
    return (images.float() - mean) / std


def augment(images, offsets, flips):
    """Per image: the crop of the reflect-padded image, as large as the image, whose corner is at `offsets` (top and
    left, 2 x batch x 1), mirrored where `flips` (batch x 1) is True."""
    (batch, channels, height, width), device, pad = images.shape, images.device, common.CROP_PADDING
    padded = F.pad(images, (pad, pad, pad, pad), mode="reflect")
    top, left = offsets
    rows = top + torch.arange(height, device=device)
    pixels = torch.arange(width, device=device)
    columns = left + torch.where(flips, width - 1 - pixels, pixels)  # a flip reads the crop's columns backwards
    # One gather for the whole batch: image i, every channel, rows[i] x columns[i].
    image_index = torch.arange(batch, device=device).view(batch, 1, 1, 1)
    channel_index = torch.arange(channels, device=device).view(1, channels, 1, 1)
    return padded[image_index, channel_index, rows.view(batch, 1, height, 1), columns.view(batch, 1, 1, width)]


def image_sizes(epochs, min_size, full_size, full_share):
    """The side of the images trained on in each epoch, from min_size up in steps of 8: the last full_share of the
    epochs (rounded, at least one) at full_size, the smaller sizes an equal share of the rest each (the smaller ones
    any left over): 16,16,16,16,24,24,24,32,32,32,32,32 for 12 epochs and a share of 0.4."""
    smaller = range(min_size, full_size, 8)
    at_full = max(1, round(full_share * epochs)) if smaller else epochs
    rest = epochs - at_full
    return [smaller[epoch * len(smaller) // rest] for epoch in range(rest)] + [full_size] * at_full


def downscale(images, size):
    """Shrink a batch of square images to size x size; each new pixel is the mean of the pixels it covers."""
    if size == images.shape[-1]:
        return images
    return F.interpolate(images, size=(size, size), mode="area")


def empty_plan(steps, batch_size, args, device):
    """The buffers one epoch's steps of `batch_size` images read and write, on the device (opt5: one plan per image
    size): each micro-batch's image indices, crop offsets and flips, each step's learning rate, the step counter, and
    each micro-batch's loss and the correct count."""
    rows = steps * args.accum_steps
    return SimpleNamespace(
        batches=torch.zeros(rows, batch_size, dtype=torch.long, device=device),
        offsets=torch.zeros(rows, 2, batch_size, 1, dtype=torch.long, device=device),
        flips=torch.zeros(rows, batch_size, 1, dtype=torch.bool, device=device),
        schedule=torch.zeros(steps, device=device),
        # 1 element, not 0-d: indexing by it gathers on the device, where a 0-d index would be read by the host
        step=torch.zeros(1, dtype=torch.long, device=device),
        losses=torch.zeros(rows, device=device),
        correct=torch.zeros((), dtype=torch.long, device=device),
    )


def draw_epoch(run, image_count):
    """One epoch of a training set of `image_count` images, drawn on the device: a fresh permutation cut into full
    micro-batches (the few images left over change each epoch; every batch is full, so the step sees one shape), and
    every image's crop offsets and flip."""
    args, generator, device = run.args, run.generator, run.device
    # opt6: every rank draws the same permutation (same seed) and cuts it into global batches of world_size x
    # batch_size; rank r takes the r-th slice of each, so the shares are disjoint
    batch_size = run.plan.batches.shape[1]  # opt5: the batch of this epoch's image size
    global_batch = batch_size * run.world_size
    rows = image_count // (global_batch * args.accum_steps) * args.accum_steps
    permutation = torch.randperm(image_count, device=device, generator=generator)
    batches = permutation[:rows * global_batch].view(rows, run.world_size, batch_size)[:, run.rank]
    crop_offsets = 2 * common.CROP_PADDING + 1
    # opt6: each rank its own crops and flips
    offsets = torch.randint(0, crop_offsets, (rows, 2, batch_size, 1), device=device, generator=run.augment_generator)
    flips = torch.rand((rows, batch_size, 1), device=device, generator=run.augment_generator) < 0.5
    return batches, offsets, flips


def plan_epoch(run, image_count, epoch):
    """Draw `epoch` (draw_epoch) into the plan, with its rows of the schedule, and start its counters at 0."""
    plan = run.plan
    batches, offsets, flips = draw_epoch(run, image_count)
    # opt5: run.schedule holds each epoch's rows of the table (their step counts differ by image size)
    # opt4: copy_ writes into the buffers the captured step reads, at the addresses it was captured with
    for buffer, values in ((plan.batches, batches), (plan.offsets, offsets), (plan.flips, flips),
                           (plan.schedule, run.schedule[epoch - 1])):
        buffer.copy_(values)
    for counter in (plan.step, plan.losses, plan.correct):
        counter.zero_()


def onecycle_schedule(max_lr, total_steps, device):
    """OneCycleLR's learning rate for every optimizer step, on `device`: torch's own scheduler, stepped here once on a
    stand-in optimizer, so none runs on the host between steps and no rate is baked into a captured step."""
    stand_in = torch.optim.AdamW([torch.zeros(1, requires_grad=True)], lr=max_lr)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(stand_in, max_lr=max_lr, total_steps=total_steps, pct_start=0.25,
                                                    cycle_momentum=False)
    rates = []
    for _ in range(total_steps):
        rates.append(stand_in.param_groups[0]["lr"])
        stand_in.step()  # it has no gradient: nothing moves, but the scheduler sees steps in their order
        scheduler.step()
    return torch.tensor(rates, device=device)


def adamw(parameters, lr, device):
    """torch's fused AdamW (weight decay 0.05) with its learning rate in a tensor on `device`."""
    # opt4: the rate in a tensor, which the schedule writes in place: a float would be baked into the captured step.
    # capturable: without it torch refuses to capture the update (fused AdamW computes the same either way)
    return torch.optim.AdamW(parameters, lr=torch.tensor(lr, device=device), weight_decay=0.05, fused=True,
                             capturable=True)


def orthogonalize(matrices, steps, dtype):
    """Roughly the semi-orthogonal matrix nearest each of `matrices` (a batch, k x rows x columns: U V^T of each one's
    SVD), by `steps` Newton-Schulz iterations in `dtype`: matmuls only, no SVD. Keller Jordan's coefficients take each
    singular value above a threshold to 0.68-1.2 (rather than to exactly 1 in many more steps, and that trains as
    well); each step multiplies a small one by about 3.4, less as it grows, so the threshold is 1/56 of the matrix's
    Frobenius norm after 3 steps, 1/660 after 5. Wide matrices (rows <= columns) take the smaller Gram matrix."""
    a, b, c = 3.4445, -4.7750, 2.0315
    x = matrices.to(dtype)
    # the Frobenius norm bounds the largest singular value: now all are at most 1
    x = x / x.norm(dim=(-2, -1), keepdim=True).clamp(min=1e-7)
    for _ in range(steps):
        gram = x @ x.transpose(-2, -1)
        # a x + b x^3 + c x^5 on each singular value; baddbmm rounds its sum once, not once per term
        x = torch.baddbmm(x, torch.baddbmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x


def as_filter(matrix, update):
    """`matrix`, a wide view of `update`'s matrix (out x in*k*k, transposed if it is tall), seen in the filter's
    shape."""
    return (matrix.T if update.size(0) > update[0].numel() else matrix).view(update.shape)


def orthogonal_updates(updates, steps, dtype):
    """Each update (a filter's, out x in x k x k) orthogonalized as a matrix (out x in*k*k), in a few batches rather
    than one at a time: the matrices with as many rows (a tall one turned wide) stacked, each padded with zero columns
    to the widest. A zero column adds nothing to x x^T, so it stays zero and leaves the others as they would be alone:
    ResNet10's 12 filters take 5 batches (Muon's step: 94 ops, not 173) for 36 % more matmul work."""
    sides = [sorted((update.size(0), update[0].numel())) for update in updates]  # each matrix's rows, columns: wide
    orthogonal = [None] * len(updates)
    for rows in sorted({rows for rows, _ in sides}):
        members = [i for i, (its_rows, _) in enumerate(sides) if its_rows == rows]
        batch = updates[members[0]].new_zeros(len(members), rows, max(sides[i][1] for i in members), dtype=dtype)
        for j, i in enumerate(members):
            as_filter(batch[j, :, :sides[i][1]], updates[i]).copy_(updates[i])  # cast to `dtype` as it copies
        batch = orthogonalize(batch, steps, dtype)
        for j, i in enumerate(members):
            orthogonal[i] = as_filter(batch[j, :, :sides[i][1]], updates[i])
    return orthogonal


class Muon(torch.optim.Optimizer):
    """Muon (Keller Jordan, 2024) for the convolution filters, with an AdamW for every other parameter inside it: one
    optimizer, so the step's schedule writes both groups' learning rate, and GradScaler and zero_grad see
    every parameter.

    A filter's step is its Nesterov momentum, seen as a matrix (out x in*k*k) and orthogonalized: every direction gets
    a step of the same size, so the rare directions that a gradient step all but ignores learn as fast as the common
    ones. Scaled by 0.2 sqrt(max(out, in*k*k)), its size matches AdamW's (Moonlight, Liu et al., 2025), so AdamW's
    rate and weight decay carry over. torch.optim.Muon (torch 2.9 and newer) takes 2-D weights only.
    """

    def __init__(self, filters, adamw, dtype, steps):
        super().__init__(filters, {name: adamw.defaults[name] for name in ("lr", "betas", "weight_decay")})
        self.param_groups += adamw.param_groups  # the same dicts: a write to one is a write to the other
        self.adamw, self.dtype, self.steps = adamw, dtype, steps
        # a momentum for each filter, zero before the first step
        for parameter in self.param_groups[0]["params"]:
            self.state[parameter]["momentum"] = torch.zeros_like(parameter)

    @torch.no_grad()
    def step(self):
        group = self.param_groups[0]
        filters = [parameter for parameter in group["params"] if parameter.grad is not None]
        if not filters:  # no filter has a gradient (all frozen, say): foreach ops refuse an empty list
            return self.adamw.step()
        grads = [parameter.grad for parameter in filters]
        momenta = [self.state[parameter]["momentum"] for parameter in filters]
        lr, beta1 = group["lr"], group["betas"][0]  # lr a tensor (see adamw): foreach ops take it without a host read
        # opt5: each update below is one foreach op over all the filters, not one op per filter
        torch._foreach_mul_(filters, 1 - lr * group["weight_decay"])  # decoupled weight decay, as AdamW's
        torch._foreach_lerp_(momenta, grads, 1 - beta1)  # beta1 x momentum + (1 - beta1) x gradient, in one op
        # Nesterov momentum: the gradient moved a beta1 of the way to the new momentum
        updates = torch._foreach_lerp(grads, momenta, beta1)
        # opt5: each filter as a matrix, orthogonalized: in a few batches, not a dozen launches a filter
        for filter_, update in zip(filters, orthogonal_updates(updates, self.steps, self.dtype)):
            # scaled to AdamW's step size, times the rate: one op a filter (a bfloat16 update and a float32 filter
            # would take foreach's one op a tensor anyway)
            filter_.addcmul_(update, lr, value=-0.2 * max(update.size(0), update[0].numel()) ** 0.5)
        self.adamw.step()


def micro_batch_loss(run, micro_batch, size):
    """Micro-batch `micro_batch` of the step the plan's counter is at: its images gathered from the dataset on the
    device, normalized, cropped, flipped and shrunk to size x size, the model's loss over them (divided by
    --accum-steps), and its loss and correct count kept on the device."""
    plan, (all_images, all_labels) = run.plan, run.train_data
    # opt4: the micro-batch's row found on the device, by the plan's counter: a Python index would be baked into the
    # captured step. The row is a 1-element tensor, so each gather keeps a leading dimension of 1: squeeze(0)
    row = plan.step * run.args.accum_steps + micro_batch
    indices, offsets, flips = plan.batches[row].squeeze(0), plan.offsets[row].squeeze(0), plan.flips[row].squeeze(0)
    # opt2: normalized inputs condition the optimization; random crops and flips add data for free
    # opt3: normalize, crop and flip the whole batch on the device; channels_last for the model
    images = augment(normalize(all_images[indices], run.statistics), offsets, flips)
    # opt5: progressive resizing: a convolution's work scales with the pixels, so a 16x16 epoch has a quarter of a
    # 32x32 one's; ResNet10 pools globally, so it takes any size, and the last epochs teach it 32x32
    images = downscale(images, size).contiguous(memory_format=torch.channels_last)
    labels = all_labels[indices]
    # opt1: autocast runs convolutions in 16-bit where it is native: half the memory traffic, tensor cores
    # opt4: without autocast's cache of cast weights, which a CUDA graph capture must not keep
    with torch.autocast(run.device.type, dtype=run.amp_dtype, enabled=run.amp_dtype != torch.float32,
                        cache_enabled=False):
        outputs = run.model(images)
        loss = run.criterion(outputs, labels)
    plan.losses[row] = loss.detach()  # opt4: into the plan: every replay writes the same addresses
    plan.correct += (outputs.argmax(1) == labels).sum()
    return loss / run.args.accum_steps  # opt2: the mean over the effective batch


def optimizer_step(run):
    """The update that ends a step, at the plan's learning rate for it; then the plan's counter moves on."""
    plan = run.plan
    for group in run.optimizer.param_groups:
        group["lr"].copy_(plan.schedule[plan.step].squeeze(0))  # opt4: the schedule reaches the optimizer on the device
    run.scaler.step(run.optimizer)
    run.scaler.update()
    plan.step += 1


def train_step(run, size):
    """One optimizer step, whole: each micro-batch's augmentation, forward, loss and backward, then the update. It
    reads only the device (the plan, at its step counter) and reads nothing back: every call is the same work on the
    same addresses, so the host need not wait for it and a GPU can replay it as one CUDA graph."""
    # opt4: the gradients dropped at the start, as in PyTorch's whole-network capture: backward then makes them in the
    # graph's own memory, and a step run again after a failed capture starts without the half-recorded ones
    # opt6: but zeroed under DDP, whose kept gradients are views of its all-reduce buckets (see train)
    run.model.zero_grad(set_to_none=run.world_size == 1)
    for micro_batch in range(run.args.accum_steps):
        # opt6: DDP all-reduces the gradients in the backward of a step's last micro-batch only (as no_sync() does)
        run.model.require_backward_grad_sync = micro_batch + 1 == run.args.accum_steps
        loss = micro_batch_loss(run, micro_batch, size)
        # opt1: float16 gradients can underflow to zero; GradScaler scales the loss up, then back
        run.scaler.scale(loss).backward()
    optimizer_step(run)


def cuda_graph(step, warmup_steps=3):
    """`step` (a function of no arguments) replayed as one CUDA graph: its first `warmup_steps` calls run on a side
    stream, as in PyTorch's whole-network capture (cuDNN's autotuning, the optimizer's first state), the next captures
    it, the rest replay it. A capture that fails says why in one line; that call and the rest run `step` as itself."""
    graph, calls, failed = torch.cuda.CUDAGraph(), 0, False

    def replay():
        nonlocal calls, failed
        calls += 1
        if failed:
            return step()
        if calls <= warmup_steps:
            side_stream = torch.cuda.Stream()
            side_stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side_stream):
                step()
            torch.cuda.current_stream().wait_stream(side_stream)
            return
        if calls == warmup_steps + 1:
            stream = torch.cuda.current_stream()
            try:
                with torch.cuda.graph(graph):  # records the step's kernels; runs none of them
                    step()
            except Exception as error:  # an op that cannot be captured: the run goes on uncaptured, not lost
                torch.cuda.set_stream(stream)  # a failed capture can leave its own stream current
                failed, cause = True, error.__context__ or error  # the op's error, not the failed capture_end's
                why = (str(cause).strip().splitlines() or [""])[0][:160]
                print(f"step: not captured ({type(cause).__name__}: {why}); this step and the rest run as a function")
                return step()  # the capture recorded this step but ran none of it
        graph.replay()
    return replay


def capture_problem(device, amp_dtype, optimizer, world_size):
    """Why the step cannot be replayed as a CUDA graph here, in words, or None where it can."""
    if device.type != "cuda":
        return "not captured: CUDA graphs are CUDA's"
    if world_size > 1:  # opt6
        # capturing DDP's all-reduce needs settings and a warm-up of its own (PyTorch's CUDA graphs notes)
        return "not captured: under DDP the step runs as a function, its all-reduce launched by DDP's hooks"
    if amp_dtype == torch.float16 and not getattr(optimizer, "_step_supports_amp_scaling", False):
        # GradScaler hands a fused optimizer its found-inf flag on the device; for any other it reads it on the host
        return "not captured: float16's GradScaler reads on the host whether each step's gradients are finite"
    return None


def train_one_epoch(run, train_data, epoch, monitor, size):
    """One pass over `train_data`; returns mean loss, accuracy, optimizer steps and images trained on."""
    run.model.train()
    # opt2: accumulating gradients of accum_steps micro-batches gives a big batch's step in less memory;
    # every step gets exactly accum_steps micro-batches, so a few left over at the end are skipped
    accum_steps = run.args.accum_steps
    # opt5: each image size has its own batch, so its own plan: its captured step reads that plan's addresses
    run.plan = run.plans[size]
    # opt3: the epoch's batches are drawn on the device at once and gathered there by index: no loader, no workers,
    # no host-to-device copy; its crops and flips likewise
    plan_epoch(run, len(train_data[1]), epoch)  # the step gathers its images from run.train_data
    # opt3: losses and correct counts stay on the device: reading them per step would wait for the GPU
    losses, correct = run.plan.losses, run.plan.correct
    # opt4: each step is one call that reads the plan: on a GPU, one graph replayed
    for _ in range(len(run.plan.schedule)):
        run.train_steps[size]()
        monitor.step()
    # opt3: the one wait for the device per epoch; a non-finite loss is found here, not at its step
    for micro_step, loss_value in enumerate(losses.tolist()):
        common.check_finite(loss_value, epoch, micro_step // accum_steps + 1)
    micro_batches = torch.tensor(float(len(losses)), device=run.device)
    totals = torch.stack([losses.sum(), correct.to(losses.dtype), micro_batches])
    if run.world_size > 1:
        dist.all_reduce(totals)  # opt6: loss, accuracy and images/s count every rank's share
    loss_sum, correct_sum, micro_batches = totals.tolist()
    images_seen = int(micro_batches) * run.plan.batches.shape[1]  # opt5: this size's batch
    return loss_sum / micro_batches, correct_sum / images_seen, len(losses) // accum_steps, images_seen


# opt5: eager even with --compile: compiled, it compiled again at each image size, about 15 s of the H200's 128-s run;
# eager, the recipe's 20 evaluations cost a CPU no more than compiled (results/)
@torch.compiler.set_stance("force_eager")
def evaluate(run, test_data, size):
    """Mean loss and accuracy of the model on `test_data`, shown at size x size."""
    run.model.eval()
    test_size = len(test_data[1])
    # opt6: each rank evaluates its own slice of the test set; the slices' sums are added up at the end
    all_images, all_labels = (data[rank_slice(test_size, run.rank, run.world_size)] for data in test_data)
    # opt3: each image and its mirror in one batch of --batch-size (if even): the shape cuDNN's autotuner timed in
    # training, so it times no new one here
    batch_size = max(1, run.batch_sizes[size] // 2)  # opt5: the batch trained on at this size
    # opt3: the totals stay on the device: one read at the end, not one wait per batch
    total_loss = torch.zeros((), device=run.device)
    correct = torch.zeros((), dtype=torch.long, device=run.device)
    with torch.inference_mode():  # opt2: like no_grad, and also skips autograd's version tracking
        for start in range(0, len(all_labels), batch_size):
            images = normalize(all_images[start:start + batch_size], run.statistics)
            labels = all_labels[start:start + batch_size]
            # opt1: the last batch padded with blank images to a full one (their outputs are dropped): one shape, so
            # one compiled evaluation graph, not another for the last few images
            images = torch.cat([images, images.new_zeros(batch_size - len(images), *images.shape[1:])])
            images = torch.cat([images, images.flip(3)])
            # opt5: at the size just trained on: its BatchNorm statistics are of images that size
            images = downscale(images, size).contiguous(memory_format=torch.channels_last)
            # opt1: 16-bit here too
            with torch.autocast(run.device.type, dtype=run.amp_dtype, enabled=run.amp_dtype != torch.float32):
                # opt3: average the logits of each image and its mirror (test-time augmentation), in one call
                outputs = run.model(images).view(2, batch_size, -1).float().mean(0)[:len(labels)]
            total_loss += F.cross_entropy(outputs.float(), labels, reduction="sum")  # opt1: on float32 logits
            correct += (outputs.argmax(1) == labels).sum()
    totals = torch.stack([total_loss, correct.to(total_loss.dtype)])
    if run.world_size > 1:
        dist.all_reduce(totals)  # opt6: the whole test set's loss and correct count
    loss_sum, correct_sum = totals.tolist()
    return loss_sum / test_size, correct_sum / test_size


def main():
    args = parse_args()
    rank, world_size, device = setup_distributed(harness.pick_device(args))
    train(args, rank, world_size, device)
    if world_size > 1:
        # opt6: the ranks leave together; this thread holds the barrier's handle until the process group is gone
        # (letting go of it first could hang Gloo's shutdown on torch 2.6)
        barrier = dist.barrier(async_op=True)
        barrier.wait()
        dist.destroy_process_group()


def train(args, rank, world_size, device):
    if rank != 0:
        sys.stdout = open(os.devnull, "w")  # opt6: one log: only rank 0 prints
    harness.print_settings(__file__, device, args)
    # opt1: 16-bit math only where the hardware runs it: on a CPU without a bfloat16 unit it is emulated, and slow
    amp_dtype, why = autocast_dtype(device)
    print(f"precision: {why}")
    print(f"world size {world_size}: global batch {world_size * args.batch_size * args.accum_steps} "
          f"(--batch-size x world size x --accum-steps)")
    torch.manual_seed(args.seed)

    # opt3: the whole dataset lives on the device as uint8 (180 MB): 4x less to move than float32,
    # and no loader, workers or host-to-device copy per step; normalize() and augment() run per batch
    with rank_zero_first(world_size):  # opt6: one download per machine, each after rank 0's
        train_set, test_set = common.load_data(args, train_transform=None, test_transform=None)
    train_data, test_data = load_to_device(train_set, device), load_to_device(test_set, device)
    generator = torch.Generator(device).manual_seed(args.seed)  # the same permutation on every rank
    augment_generator = torch.Generator(device).manual_seed(args.seed + rank)  # opt6: each rank its own crops

    # opt1: cuDNN times its convolution algorithms once per input shape and keeps the fastest
    torch.backends.cudnn.benchmark = True
    # opt3: channels_last (NHWC) is the layout tensor cores and the CPU's oneDNN convolutions run fastest
    model = common.ResNet10().to(device, memory_format=torch.channels_last)
    # opt6: under DDP the gradients are kept and zeroed, not dropped: they are views of its all-reduce buckets, and
    # set to None every step would copy them
    if world_size > 1:
        for parameter in model.parameters():
            parameter.grad = torch.zeros_like(parameter)
    train_model = model
    if world_size > 1:
        # opt6: DDP averages gradients over the ranks in buckets, each sent as soon as its gradients are ready, so
        # communication overlaps the rest of the backward pass; the kept gradients are views of the buckets (no copy).
        # broadcast_buffers=False (forward_sync_buffers=False from torch 2.13, as harness.no_buffer_broadcast names it
        # for this torch): no broadcast of rank 0's BatchNorm statistics before every forward, which
        # average_batchnorm_statistics replaces
        train_model = DistributedDataParallel(
            model, device_ids=[device] if device.type == "cuda" else None, gradient_as_bucket_view=True,
            **harness.no_buffer_broadcast())
    # opt6: off under DDP too, where the step is not captured: whether compiling pays there is not measured
    if args.compile:
        # opt5: dynamic=False: a graph for each image size; with symbolic sizes (dynamic=True) inductor still
        # recompiles at each one (its convolution backward specializes on it, torch 2.14), with less specialized kernels
        # opt6: DDP's wrapper compiled, not the model inside it: Dynamo's DDPOptimizer then splits the graph at DDP's
        # buckets, so each bucket's all-reduce overlaps the backward of the layers before it
        # opt1: fuses operations into fewer kernels: less memory traffic and Python overhead
        train_model.compile(mode=args.compile_mode, dynamic=False)
    # opt2: label smoothing keeps the logits from growing without bound: better accuracy in few epochs
    criterion = nn.CrossEntropyLoss(label_smoothing=args.label_smoothing)
    # opt6: --lr is the rate for one process's step of --batch-size x --accum-steps images, as in opt5; world_size
    # processes make the global batch world_size times larger, averaging away noise: scale the rate by its square root
    max_lr = args.lr * world_size ** 0.5
    # opt1: AdamW scales each weight's step by its recent gradients, so one rate suits every layer untuned
    # opt3: fused: one op reads and writes each weight once (a few multi-tensor launches on a GPU), not a dozen passes
    if args.optimizer == "muon":
        # opt5: Muon for the filters: more accuracy per epoch, for the cost of its update (see Muon);
        # Newton-Schulz in the 16-bit type the hardware runs natively, in float32 where it has none; 3 steps
        # (--ns-steps) are 3/5 of torch.optim.Muon's default work and trained as well here (results/README.md)
        parameters = list(model.parameters())
        filters, others = [p for p in parameters if p.ndim == 4], [p for p in parameters if p.ndim != 4]
        optimizer = Muon(filters, adamw(others, max_lr, device), dtype=amp_dtype, steps=args.ns_steps)
    else:
        optimizer = adamw(model.parameters(), max_lr, device)
    scaler = torch.amp.GradScaler(device.type, enabled=amp_dtype == torch.float16)  # bfloat16 needs no scaling
    full_size = train_set.data.shape[1]  # opt5: CIFAR-10's 32 x 32, the size the last epochs train on
    sizes = image_sizes(args.epochs, args.min_size, full_size, args.full_size_share)
    # opt5: a bigger batch at the smallest size (--min-size-batch): fewer steps, so less of the fixed cost each pays
    batch_sizes = {size: args.batch_size for size in sizes}
    if args.min_size_batch and args.min_size < full_size:
        batch_sizes[args.min_size] = args.min_size_batch
    # opt2: one cycle of warm-up then annealing reaches a given accuracy in far fewer epochs than a
    # fixed rate; its length counts optimizer steps, not micro-batches. beta1 stays AdamW's 0.9 (cycle_momentum=False):
    # cycling it bought no accuracy here, and a fixed one is a plain number that a captured step can keep (opt4)
    epoch_steps = [len(train_set) // (batch_sizes[size] * world_size) // args.accum_steps for size in sizes]
    total_steps = sum(epoch_steps)
    if total_steps < 5:
        common.fail(f"{total_steps} optimizer steps in all are too few for OneCycleLR's warm-up (it needs 5); "
                    "use more --epochs or --train-size")
    # What the functions above need besides their data, in one object (a setting is read as run.args.name)
    run = SimpleNamespace(
        args=args,
        device=device,
        amp_dtype=amp_dtype,
        model=train_model,  # opt6: DDP's wrapper when distributed; without autograd (evaluate) it sends nothing
        criterion=criterion,
        optimizer=optimizer,
        scaler=scaler,
        generator=generator,
        augment_generator=augment_generator,
        rank=rank,
        world_size=world_size,
        train_data=train_data,
        statistics=channel_statistics(device),
        # opt4: the schedule as a table on the device, and the plan: the buffers every step reads and writes
        # opt5: the table cut into each epoch's rows, and a plan for each image size's batch
        schedule=onecycle_schedule(max_lr, total_steps, device).split(epoch_steps),
        plans={size: empty_plan(steps, batch_sizes[size], args, device)
               for size, steps in dict(zip(sizes, epoch_steps)).items()},
        batch_sizes=batch_sizes,
    )
    run.train_steps = {size: functools.partial(train_step, run, size) for size in sizes}
    why_not = capture_problem(device, amp_dtype, optimizer, world_size)
    if why_not is None:
        # opt4: on CUDA the whole step is captured once and replayed: one launch a step, however many kernels
        # opt5: a graph for each image size: a graph replays the shapes it was captured with
        run.train_steps = {size: cuda_graph(step) for size, step in run.train_steps.items()}
    print("step: captured as a CUDA graph and replayed" if why_not is None else f"step: run as a function, {why_not}")

    # opt5: after each epoch but the last, a fixed random subset of the test set shows the curve at a small cost
    # (1,000 images: about 1 % of a 32x32 epoch's work; the first 1,000 of a set stored by class would be one class);
    # the last epoch evaluates them all
    subset = torch.randperm(len(test_set), generator=torch.Generator().manual_seed(args.seed))[:args.monitor_size]
    monitor_data = [data[subset.to(device)] for data in test_data]
    records = []
    start = common.now(device)
    for epoch, size in enumerate(sizes, 1):
        profile_dir = args.profile if epoch == args.epochs and rank == 0 else None
        with harness.step_monitor(epoch, profile_dir, device) as monitor:
            epoch_start = common.now(device)
            train_figures = train_one_epoch(run, train_data, epoch, monitor, size)
            train_seconds = common.now(device) - epoch_start
        average_batchnorm_statistics(model, world_size)  # opt6: every rank evaluates the model rank 0 saves
        evaluated = test_data if epoch == args.epochs else monitor_data
        test_figures = evaluate(run, evaluated, size)
        harness.record_epoch(records, train_figures, test_figures, train_seconds, image_size=size,
                            test_images=len(evaluated[1]))
    if rank != 0:
        return  # opt6: rank 0 alone writes the report, the weights and the trace
    harness.report(__file__, run, records, common.now(device) - start)
    if args.save:
        torch.save(model.state_dict(), args.save)


if __name__ == "__main__":
    main()
