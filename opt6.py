"""opt6.py: opt5.py + data parallelism over many GPUs and machines: DistributedDataParallel under torchrun. Each
process trains on its share of every global batch at opt5's rate x sqrt(processes), the square-root rule again; with
more than one process the step runs uncaptured: DDP's hooks launch its all-reduce, which a graph would need set up to
hold (one process, under torchrun or not, captures it as opt5 does).

    torchrun --nproc_per_node=8 opt6.py                           # one machine, 8 GPUs
    torchrun --nnodes=2 --node_rank=0 --nproc_per_node=8 --rdzv_endpoint=HOST:29500 opt6.py
    torchrun --nproc_per_node=2 opt6.py --synthetic --epochs 2   # no download: measures speed only
    python opt6.py                                                # no torchrun: one process, as opt5.py

Each optimization is marked `# opt6:` where it happens; read `diff -u opt5.py opt6.py`.
"""
import argparse
import contextlib
import functools
import inspect
import os
import sys
from types import SimpleNamespace

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

import common


# opt5: the recipe, every setting named once, a flag's default where one sets it (lab/README.md: how it was picked)
RECIPE = dict(
    epochs=20,            # 20 epochs of 512 images a step: as many steps as 5 of 128 (opt4), each a 4x batch
    batch_size=512,       # a quarter of opt4's steps an epoch, each launching the same kernels on 4x the images
    lr=0.016,             # opt4's 0.008 x sqrt(512 / 128): the square-root rule for a 4x batch
    pct_start=0.25,       # OneCycleLR's warm-up: the first quarter of the steps, as opt2-opt4's
    min_size=16,          # the first epochs' image side; it grows in steps of 8 to 32
    full_size_share=0.3,  # the last 30 % of the epochs at 32 x 32
    monitor_size=1000,    # test images scored after each epoch but the last, which scores them all
    optimizer="muon",     # Muon for the filters, AdamW for the rest
    ns_steps=3,           # Newton-Schulz iterations a Muon update, as airbench94_muon.py; torch.optim.Muon's: 5
    muon_momentum=0.9,    # Muon's Nesterov momentum; airbench94_muon.py's is 0.6, torch.optim.Muon's 0.95
    weight_decay=0.05,    # AdamW's, as opt1-opt4's; Muon's the same, decoupled
    label_smoothing=0.1,  # as opt2-opt4's; so are the crops (common.CROP_PADDING, 2 px)
    # and, with no setting of its own, evaluate() scores each test image and its mirror: two views
)


def parse_args():
    parser = common.build_parser(__doc__, **{name: RECIPE[name] for name in ("batch_size", "lr", "epochs")})
    # opt3: off by default: with the data on the device a short run trains in less time than compiling takes
    parser.add_argument("--compile", action=argparse.BooleanOptionalAction, default=False,
                        help="torch.compile the model; it pays where the time it saves exceeds its compiling "
                             "(default: off)")
    parser.add_argument("--accum-steps", type=common.positive_int, default=1,
                        help="micro-batches per optimizer step; global batch = batch x this x ranks (default: 1)")
    parser.add_argument("--label-smoothing", type=common.fraction, default=RECIPE["label_smoothing"],
                        help=f"weight of a uniform target mixed into each label (default: {RECIPE['label_smoothing']})")
    parser.add_argument("--min-size", type=int, default=RECIPE["min_size"], choices=[8, 16, 24, 32],
                        help=f"smallest image side, the first epochs'; 32 by the last (too few epochs skip the sizes "
                             f"between) (default: {RECIPE['min_size']})")
    parser.add_argument("--full-size-share", type=common.fraction, default=RECIPE["full_size_share"],
                        help="share of the epochs at the full size, the last ones (at least one); the smaller sizes "
                             f"share the rest as evenly as they can (default: {RECIPE['full_size_share']})")
    parser.add_argument("--monitor-size", type=common.positive_int, default=RECIPE["monitor_size"],
                        help=f"test images evaluated after each epoch but the last (default: {RECIPE['monitor_size']})")
    parser.add_argument("--optimizer", choices=["muon", "adamw"], default=RECIPE["optimizer"],
                        help="muon: Muon for the convolution filters and AdamW for the rest; adamw: AdamW for all, "
                             f"as opt4 (default: {RECIPE['optimizer']})")
    parser.add_argument("--ns-steps", type=common.positive_int, default=RECIPE["ns_steps"],
                        help=f"Newton-Schulz iterations in each Muon update (default: {RECIPE['ns_steps']})")
    args = parser.parse_args()
    world_size = int(os.environ["WORLD_SIZE"]) if started_by_torchrun() else 1  # opt6: processes in the job
    return common.check_args(args, images_per_step=args.batch_size * args.accum_steps * world_size)


def started_by_torchrun():
    """Whether torchrun started this process (RANK, LOCAL_RANK or WORLD_SIZE set); exit 2 if one is and any other of
    the five torchrun sets is missing."""
    ranks = [name for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE") if name in os.environ]
    missing = [name for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
               if name not in os.environ]
    if ranks and missing:
        common.fail(f"{', '.join(ranks)} set but not {', '.join(missing)}: start {os.path.basename(sys.argv[0])} with "
                    f"torchrun, which sets them all (srun does not), or unset {', '.join(ranks)} to run one process")
    return bool(ranks)


def point_to_torchrun(device, world_size):
    """Say how to start torchrun where one process (world_size 1) on `device` leaves GPUs of this machine idle."""
    gpus = torch.cuda.device_count() if torch.device(device).type == "cuda" else 0
    if world_size == 1 and gpus > 1:
        print(f"{gpus} GPUs here, and one process uses one: to use them all, start "
              f"torchrun --standalone --nproc_per_node={gpus} {os.path.basename(sys.argv[0])} ...")


def local_rank():
    """This process's index among its machine's: LOCAL_RANK where the launcher sets it (torchrun does), else its rank in
    the process group (torch.multiprocessing.spawn sets none: one machine), as dist.get_node_local_rank's fallback."""
    return int(os.environ["LOCAL_RANK"]) if "LOCAL_RANK" in os.environ else dist.get_rank()  # opt6: picks the GPU


def setup_distributed(device):
    """(rank, world size, device), the ranks the process group's: one the client started (torch.multiprocessing.spawn
    and other launchers), or, under torchrun, one started here; neither: (0, 1, device). A GPU, as "cuda", "cuda:0"
    or a torch.device, becomes this rank's own, torch.device("cuda", local rank); torch.autocast takes its .type."""
    device = torch.device(device)  # or the string a script may hold
    # opt6: ranks from a process group: torchrun's environment, or a group another launcher's process started
    if not dist.is_initialized() and "WORLD_SIZE" not in os.environ:
        return 0, 1, device
    if device.type == "cuda":
        index, gpus = local_rank(), torch.cuda.device_count()
        if index >= gpus:  # Slurm or MIG often shows each process one GPU
            common.fail(f"local rank {index}, but this process sees {gpus} GPU(s): start at most {gpus} per machine "
                        f"(--nproc_per_node={gpus}), or let every process see every GPU of its machine (Slurm: one "
                        "torchrun per node, not one per GPU)")
        device = torch.device("cuda", index)  # opt6: each rank its own GPU, whatever index it was given
        # opt6: made current before any CUDA work: each process opens its CUDA context on its own GPU, not GPU 0
        torch.cuda.set_device(device)
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size(), device
    if device.type == "cuda":
        # opt6: NCCL moves the gradients GPU to GPU (NVLink, InfiniBand); naming the GPU binds its communicator to it
        dist.init_process_group("nccl", device_id=device)
    else:
        dist.init_process_group("gloo")  # opt6: Gloo all-reduces between CPU processes
    return dist.get_rank(), dist.get_world_size(), device


def average_batchnorm_buffers(model, world_size):
    """Average BatchNorm's running means and variances over the ranks, so that every rank evaluates the same model:
    each rank's follow its own share of the data, and DDP does not broadcast rank 0's (see main)."""
    if world_size == 1:
        return
    for buffer in model.buffers():
        if buffer.is_floating_point():  # num_batches_tracked counts the same steps on every rank
            dist.all_reduce(buffer)
            buffer /= world_size


@contextlib.contextmanager
def rank_zero_first(world_size):
    """Runs the body on rank 0, then on the first process of every other machine, then on the rest: one download
    per machine, and never two at once into a folder that machines share (NFS, Lustre), which would corrupt it."""
    if world_size == 1:
        yield
        return
    turn = 0 if dist.get_rank() == 0 else 1 if local_rank() == 0 else 2
    for this_turn in range(3):
        if this_turn == turn:
            yield
        dist.barrier()  # the next turn starts once this one's processes have the data


def broadcast_buffers_keyword():
    """The name of DDP's keyword that turns its broadcast of rank 0's buffers before every forward on or off."""
    parameters = inspect.signature(DistributedDataParallel).parameters
    return "forward_sync_buffers" if "forward_sync_buffers" in parameters else "broadcast_buffers"  # torch 2.13 on


def leave_process_group():
    """Wait for every rank, then destroy the process group while still holding the barrier's handle (without it,
    torch 2.6's Gloo hung at exit: lab/README.md)."""
    barrier = dist.barrier(async_op=True)
    barrier.wait()
    dist.destroy_process_group()


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


def load_to_device(dataset, device):
    """A dataset's images (uint8, N x 3 x 32 x 32) and labels on `device`."""
    images = torch.as_tensor(dataset.data).permute(0, 3, 1, 2)  # N x H x W x 3 seen as N x 3 x H x W: a view, no copy
    return images.to(device), torch.as_tensor(dataset.targets).to(device)


def normalize(images, statistics):
    """uint8 images -> float32 with zero mean and unit variance per channel (`statistics`: their mean and std)."""
    mean, std = statistics
    return (images.float() - mean) / std


def augment(images, offsets, flips, padding):
    """Per image: the crop of the image reflect-padded by `padding` pixels, as large as the image, whose corner is at
    `offsets` (top and left, 2 x batch x 1, each 0 to 2 x padding), mirrored where `flips` (batch x 1) is True."""
    (batch, channels, height, width), device = images.shape, images.device
    padded = F.pad(images, (padding, padding, padding, padding), mode="reflect")
    top, left = offsets
    rows = top + torch.arange(height, device=device)
    pixels = torch.arange(width, device=device)
    columns = left + torch.where(flips, width - 1 - pixels, pixels)  # a flip reads the crop's columns backwards
    # One gather for the whole batch: image i, every channel, rows[i] x columns[i].
    image_index = torch.arange(batch, device=device).view(batch, 1, 1, 1)
    channel_index = torch.arange(channels, device=device).view(1, channels, 1, 1)
    return padded[image_index, channel_index, rows.view(batch, 1, height, 1), columns.view(batch, 1, 1, width)]


def image_sizes(epochs, min_size=16, full_size=32, full_share=0.3):
    """Each epoch's image side, from min_size up in steps of 8: the last full_share of the epochs (at least one) at
    full_size, the smaller sides the rest, equally (the smallest any left over; too few epochs skip some): 16 x4,
    24 x3, 32 x5 for 12 and 0.4."""
    smaller = range(min_size, full_size, 8)
    at_full = max(1, round(full_share * epochs)) if smaller else epochs
    rest = epochs - at_full
    return [smaller[epoch * len(smaller) // rest] for epoch in range(rest)] + [full_size] * at_full


def downscale(images, size):
    """Shrink a batch of square images to size x size; each new pixel the mean of the pixels its area touches (from 32:
    exact blocks at 16 and 8, overlapping windows at 24)."""
    return images if size == images.shape[-1] else F.interpolate(images, size=(size, size), mode="area")


def draw_epoch(image_count, batch_size, padding, generator, accum_steps=1):
    """An epoch of `image_count` images drawn on `generator`'s device: a permutation cut into full micro-batches of
    `batch_size` (steps of `accum_steps`; the few left over change each epoch), each image's crop offsets (augment's
    `padding`) and flip: batches, offsets, flips, micro-batches x batch_size, x 2 x batch_size x 1, x batch_size x 1."""
    device = generator.device
    micro_batches = image_count // (batch_size * accum_steps) * accum_steps
    permutation = torch.randperm(image_count, device=device, generator=generator)
    batches = permutation[:micro_batches * batch_size].view(micro_batches, batch_size)
    offsets = torch.randint(0, 2 * padding + 1, (micro_batches, 2, batch_size, 1), device=device, generator=generator)
    flips = torch.rand((micro_batches, batch_size, 1), device=device, generator=generator) < 0.5
    return batches, offsets, flips


def rank_share(draw, rank, batch_size):
    """This rank's slice of each global micro-batch of `draw` (draw_epoch's, drawn alike on every rank from one seed):
    the ranks' shares are disjoint, and together they are the global batches."""
    share = slice(rank * batch_size, (rank + 1) * batch_size)
    batches, offsets, flips = draw
    return batches[:, share], offsets[:, :, share], flips[:, share]


def empty_plan(train_data, statistics, padding, steps, batch_size, accum_steps=1):
    """What an epoch of `steps` steps reads and writes, at fixed addresses on `train_data`'s device: images, labels,
    statistics, padding, accum_steps as given; batches, offsets, flips and rates (plan_epoch's); cursor (the next
    step); losses, correct; steps_left (of plan_epoch's epoch, counted where the step runs uncaptured: not in a
    capture, nor in replays)."""
    (images, labels), micro_batches = train_data, steps * accum_steps
    device = images.device
    return SimpleNamespace(
        images=images, labels=labels, statistics=statistics, padding=padding, accum_steps=accum_steps,
        batches=torch.zeros(micro_batches, batch_size, dtype=torch.long, device=device),
        offsets=torch.zeros(micro_batches, 2, batch_size, 1, dtype=torch.long, device=device),
        flips=torch.zeros(micro_batches, batch_size, 1, dtype=torch.bool, device=device),
        rates=torch.zeros(steps, device=device),
        # 1 element, not 0-d: indexing by it gathers on the device, where a 0-d index would be read by the host
        cursor=torch.zeros(1, dtype=torch.long, device=device),
        losses=torch.zeros(micro_batches, device=device),
        correct=torch.zeros((), dtype=torch.long, device=device),
        steps_left=0,
    )


def plan_epoch(plan, draw, rates):
    """Write an epoch into the plan: `draw` (draw_epoch's) and `rates` (each step's); cursor and tallies back to 0."""
    # opt4: copy_ writes into the buffers the captured step reads, at the addresses it was captured with
    for buffer, values in zip((plan.batches, plan.offsets, plan.flips, plan.rates), (*draw, rates)):
        buffer.copy_(values)
    for counter in (plan.cursor, plan.losses, plan.correct):
        counter.zero_()
    plan.steps_left = len(plan.rates)


def onecycle_schedule(max_lr, total_steps, device, pct_start=RECIPE["pct_start"]):
    """OneCycleLR's rate for every step as a table on `device` (none baked into a captured step), from torch's own."""
    stand_in = torch.optim.AdamW([torch.zeros(1, requires_grad=True)], lr=max_lr)
    # opt2: one cycle of warm-up then annealing to near zero (not measured here against a fixed rate)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(stand_in, max_lr, total_steps=total_steps, pct_start=pct_start,
                                                    cycle_momentum=False)  # opt2: beta1 fixed: only the rate cycles
    rates = []
    for _ in range(total_steps):
        rates.append(stand_in.param_groups[0]["lr"])
        stand_in.step()  # it has no gradient: nothing moves, but the scheduler sees steps in their order
        scheduler.step()
    return torch.tensor(rates, device=device)


def adamw(parameters, lr, device, weight_decay=RECIPE["weight_decay"]):  # opt5: the recipe's, stated once
    """torch's fused AdamW with its learning rate in a tensor on `device`."""
    # opt1: AdamW scales each weight's step by its recent gradients, so one rate suits every layer untuned
    # opt3: fused: one op reads and writes each weight once (a few multi-tensor launches on a GPU), not some 8 passes
    # opt4: the rate a tensor the schedule writes in place (a graph keeps a float); capturable=True, or no capture
    return torch.optim.AdamW(parameters, lr=torch.tensor(lr, device=device), weight_decay=weight_decay, fused=True,
                             capturable=True)


def orthogonalize(matrix, steps, dtype):
    """Roughly the semi-orthogonal matrix nearest `matrix` (U V^T of its SVD) by `steps` Newton-Schulz iterations in
    `dtype`, matmuls only: Keller Jordan's coefficients take the singular values above a few % of the largest to
    about 0.7-1.2 in 3 steps (torch.optim.Muon's docstring: 0.5-1.5)."""
    a, b, c = 3.4445, -4.7750, 2.0315
    tall = matrix.size(0) > matrix.size(1)
    x = (matrix.T if tall else matrix).to(dtype)  # wide: x x^T is the smaller Gram matrix
    x = x / x.norm().clamp(min=1e-7)  # the Frobenius norm bounds the largest singular value: now all are at most 1
    for _ in range(steps):
        gram = x @ x.T
        # a x + b x^3 + c x^5 on each singular value; addmm rounds its sum once, not once per term
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if tall else x


class Muon(torch.optim.Optimizer):
    """Muon (Keller Jordan, 2024) for convolution filters; every other parameter goes to a second optimizer (AdamW). A
    filter's step is its Nesterov momentum as a matrix (out x in*k*k), orthogonalized: every direction not far below
    the strongest a step of about one size, so the rare ones a gradient step all but ignores learn about as fast.
    Scaled by 0.2 sqrt(max(out, in*k*k)), it matches AdamW's size (Moonlight, Liu et al., 2025): its rate is an AdamW
    rate (the recipe's 0.016 at batch 512 for ResNet10), its own beside any optimizer (an SGD's 0.1 is some six times
    it), and AdamW's weight decay carries over if passed as weight_decay (none by default; the recipe passes it)."""

    def __init__(self, filters, lr, weight_decay=0.0, momentum=0.9, steps=3, dtype=None):
        # capturable, as torch names a step safe to capture in a CUDA graph: tensor ops alone, nothing read on the host
        super().__init__(filters, dict(lr=lr, weight_decay=weight_decay, momentum=momentum, capturable=True))
        device = self.param_groups[0]["params"][0].device
        native = device.type == "cuda" and torch.cuda.is_bf16_supported(including_emulation=False)
        # Newton-Schulz iterations, and the type they run in: by default bfloat16 where a GPU runs it, else float32
        self.steps, self.dtype = steps, dtype or (torch.bfloat16 if native else torch.float32)

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            lr, momentum = group["lr"], group["momentum"]  # lr may be a tensor (see adamw): read without a host wait
            for filter_ in (parameter for parameter in group["params"] if parameter.grad is not None):
                state = self.state[filter_]
                if not state:
                    state["momentum"] = torch.zeros_like(filter_)
                filter_.mul_(1 - lr * group["weight_decay"])  # decoupled weight decay, as AdamW's
                state["momentum"].lerp_(filter_.grad, 1 - momentum)
                update = filter_.grad.lerp(state["momentum"], momentum)  # Nesterov: the gradient, moved to the momentum
                matrix = orthogonalize(update.flatten(1), self.steps, self.dtype)
                filter_.add_(matrix.view_as(filter_) * lr, alpha=-0.2 * max(matrix.shape) ** 0.5)


def micro_batch_loss(model, criterion, plan, micro_batch, amp_dtype, size):  # opt5: the side it trains at
    """The loss (over the plan's accum_steps) of micro-batch `micro_batch` of the step at the plan's cursor, its images
    gathered, normalized, cropped, flipped and shrunk to size x size on the device; loss, correct count in the plan."""
    # opt4: the micro-batch found by the plan's cursor on the device: a Python index would be baked into the graph
    micro_step = plan.cursor * plan.accum_steps + micro_batch
    indices, offsets, flips = (buffer[micro_step].squeeze(0) for buffer in (plan.batches, plan.offsets, plan.flips))
    # opt2: normalized inputs condition the optimization; random crops and flips vary each image every epoch
    # opt3: normalize, crop and flip the whole batch on the device; channels_last for the model
    images = augment(normalize(plan.images[indices], plan.statistics), offsets, flips, plan.padding)
    # opt5: progressive resizing: a convolution's work scales with the pixels; global pooling takes any size
    images = downscale(images, size).contiguous(memory_format=torch.channels_last)
    labels = plan.labels[indices]
    # opt1: autocast runs convolutions in 16-bit where it is native: half the memory traffic, tensor cores
    # opt4: without autocast's cache of cast weights, as torch's make_graphed_callables asks of a captured region
    with torch.autocast(images.device.type, dtype=amp_dtype, enabled=amp_dtype != torch.float32, cache_enabled=False):
        outputs = model(images)
        loss = criterion(outputs, labels)
    plan.losses[micro_step] = loss.detach()  # opt4: into the plan: every replay writes the same addresses
    plan.correct += (outputs.argmax(1) == labels).sum()
    return loss / plan.accum_steps  # opt2: the mean over the effective batch


def optimizer_step(optimizers, plan, scaler):
    """Each optimizer's update at the plan's rate (times a group's "lr_scale", if any); then the cursor moves on."""
    for optimizer in optimizers:
        for group in optimizer.param_groups:
            rate = plan.rates[plan.cursor].squeeze(0)  # opt4: the schedule reaches it on the device
            group["lr"].copy_(rate * group["lr_scale"] if "lr_scale" in group else rate)
        scaler.step(optimizer)
    scaler.update()
    plan.cursor.add_(1).remainder_(len(plan.rates))


def make_train_step(model, criterion, optimizers, plan, amp_dtype=torch.float32, scaler=None):
    """Makes the training step: a function whose every call is one optimizer step over `plan`, whole, reading only the
    device and nothing back, the same work on the same addresses each call, so a GPU can replay it as one CUDA graph.
    It asks for plan_epoch before each epoch, and of `optimizers` (one or a list) each rate a float32 tensor on its
    weights' device, read there: torch's Adam or AdamW with capturable=True, its SGD with fused=True, or one whose
    defaults say capturable=True (Muon's); any other it refuses on every device, so a CPU run fails as a GPU's would."""
    optimizers = [optimizers] if isinstance(optimizers, torch.optim.Optimizer) else list(optimizers)
    for optimizer, group in ((optimizer, group) for optimizer in optimizers for group in optimizer.param_groups):
        # opt4: each rate a tensor the step writes (a graph keeps a float) and the optimizer reads on the device
        name, rate, device = type(optimizer).__name__, group["lr"], group["params"][0].device
        flag = "fused" if "fused" in group and "capturable" not in group else "capturable"  # SGD's; Adam's, AdamW's
        use = f"{name}(..., lr=torch.tensor(rate, device=device), {flag}=True)"
        if not (isinstance(rate, torch.Tensor) and rate.dtype == torch.float32 and rate.device == device):
            raise TypeError(f"{name}'s learning rate must be a float32 tensor on its weights' device ({device}), which "
                            f"each step writes in place: {use}")
        if flag not in group:
            raise TypeError(f"{name} does not say its step reads its rate on the device: use torch's AdamW with "
                            "capturable=True or SGD with fused=True, or give yours a default capturable=True if so")
        if not group[flag]:
            why = "torch refuses to capture it otherwise" if flag == "capturable" else "it reads the rate on the host"
            raise TypeError(f"{name} needs {flag}=True in a CUDA graph ({why}): {use}")
    cast = {parameter.dtype for parameter in model.parameters()} - {torch.float32}
    if cast:  # opt4: the step feeds float32 images, and autocast (amp_dtype) runs the 16-bit math on float32 weights
        raise TypeError(f"the model's weights are {', '.join(map(str, cast))}, not float32: drop the cast (a "
                        "model.half()) and pass amp_dtype=torch.float16 or torch.bfloat16 for 16-bit math")
    scaler = scaler or torch.amp.GradScaler(enabled=False)  # disabled: scale, step and update pass straight through
    distributed = isinstance(model, DistributedDataParallel)  # opt6: DDP changes how a step zeroes and syncs

    def step(size):  # opt5: the side of the images it trains on
        if plan.steps_left == 0:  # uncaptured only: a replayed graph runs no Python, so it cannot check
            raise RuntimeError("the plan has no step left: call plan_epoch(plan, draw, rates) before each epoch")
        # opt4: gradients dropped first: backward makes them in the graph's memory; a failed capture is not retried,
        # the step reruns uncaptured and backward makes them anew
        model.zero_grad(set_to_none=not distributed)  # opt6: under DDP zeroed, not dropped: views of its buckets
        for micro_batch in range(plan.accum_steps):
            # opt6: DDP all-reduces in the backward of a step's last micro-batch only: no_sync() skips it in the others
            accumulating = distributed and micro_batch + 1 < plan.accum_steps
            with model.no_sync() if accumulating else contextlib.nullcontext():
                # opt5: the micro-batch at the step's image size
                loss = micro_batch_loss(model, criterion, plan, micro_batch, amp_dtype, size)
                # opt1: float16 gradients can underflow to zero; GradScaler scales the loss up, then back
                scaler.scale(loss).backward()
        optimizer_step(optimizers, plan, scaler)
        # opt4: counted where the step runs: a capture, failed or not, records its kernels and runs none of them
        if not (torch.cuda.is_initialized() and torch.cuda.is_current_stream_capturing()):
            plan.steps_left -= 1
    return step


def cuda_graph(step, device, warmup_steps=3):
    """`step` (of no arguments, its work on `device`) as one CUDA graph, as PyTorch's whole-network capture: its first
    `warmup_steps` calls run on a side stream (cuDNN's autotuning, the optimizer's first state), the next captures it,
    the rest replay it. Off CUDA, or where the capture fails, it says why in one line and runs `step` as itself."""
    try:
        inspect.signature(step).bind()  # a graph replays one call as captured: nothing can be passed to it
    except TypeError:
        raise TypeError("cuda_graph replays a step of no arguments: bind them: functools.partial(step, size)") from None
    if torch.device(device).type != "cuda":
        print("step: run as a function, not captured: CUDA graphs are CUDA's")
        return step
    graph, calls = torch.cuda.CUDAGraph(), 0

    def graphed_step():
        nonlocal graph, calls
        calls += 1
        if graph is None:  # the capture failed
            return step()
        if calls <= warmup_steps:
            side_stream = torch.cuda.Stream()
            side_stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side_stream):
                step()
            return torch.cuda.current_stream().wait_stream(side_stream)
        if calls == warmup_steps + 1:
            stream = torch.cuda.current_stream()
            try:
                with torch.cuda.graph(graph):  # records the step's kernels; runs none of them
                    step()
            except Exception as error:  # an op that cannot be captured: the run goes on uncaptured, not lost
                torch.cuda.set_stream(stream)  # a failed capture can leave its own stream current
                graph, cause = None, error.__context__ or error  # the op's error, not the failed capture_end's
                why = (str(cause).strip().splitlines() or [""])[0][:160]
                print(f"step: not captured ({type(cause).__name__}: {why}); this step and the rest run as a function")
                return step()  # the capture recorded this step's kernels but ran none
            print(f"step: captured as a CUDA graph after {warmup_steps} warm-up calls, replayed from here on")
        graph.replay()
    return graphed_step


def capture_problem(device, amp_dtype, optimizers, world_size):
    """Why the step cannot be captured as a CUDA graph, in words, or None where it can."""
    if device.type != "cuda":
        return "not captured: CUDA graphs are CUDA's"
    if world_size > 1:  # opt6: capturing DDP's all-reduce needs settings and a warm-up of its own
        # uncaptured, adamw's capturable=True may cost speed (torch: it "can impair ungraphed performance"; unmeasured)
        return "not captured: under DDP the step runs as a function, its all-reduce launched by DDP's hooks"
    supports_amp_scaling = (getattr(optimizer, "_step_supports_amp_scaling", False) for optimizer in optimizers)
    if amp_dtype == torch.float16 and not all(supports_amp_scaling):
        # opt5: GradScaler hands a fused optimizer its found-inf flag on the device; it reads Muon's on the host
        return "not captured: float16's GradScaler reads on the host whether each step's gradients are finite"
    return None


def train_one_epoch(run, train_data, epoch, monitor, size):
    """One pass over `train_data` (the plan's); returns mean loss, accuracy, optimizer steps and images trained on."""
    run.model.train()
    # opt2: accumulating the gradients of accum_steps micro-batches: one step for all of them in less memory, a big
    # batch's step where no BatchNorm is (BatchNorm normalizes each micro-batch by its own statistics)
    accum_steps = run.args.accum_steps
    # opt3: the epoch's batches, crops and flips drawn on the device at once: no loader, workers or host copies
    batch_size, padding, generator = run.args.batch_size, run.crop_padding, run.generator
    # opt6: every rank draws the same global batches (one seed) and keeps its own slice of each: disjoint shares
    draw = draw_epoch(len(train_data[1]), batch_size * run.world_size, padding, generator, accum_steps)
    draw = rank_share(draw, run.rank, batch_size)
    steps = len(run.plan.rates)
    plan_epoch(run.plan, draw, run.schedule[(epoch - 1) * steps:epoch * steps])  # opt4: with the epoch's rates
    # opt3: losses and correct counts stay on the device: reading them per step would wait for the GPU
    losses, correct = run.plan.losses, run.plan.correct
    # opt4: each step is one call that reads the plan: on a GPU, one graph replayed
    for _ in range(steps):
        run.train_steps[size]()
        monitor.step()
    # opt3: the one wait for the device per epoch; a non-finite loss is found here, not at its step
    for micro_step, loss_value in enumerate(losses.tolist()):
        common.check_finite(loss_value, epoch, micro_step // accum_steps + 1)
    totals = torch.stack([losses.sum(), correct.to(losses.dtype)])
    if run.world_size > 1:
        dist.all_reduce(totals)  # opt6: loss, accuracy and images/s count every rank's share
    loss_sum, correct_sum = totals.tolist()
    images_seen = len(losses) * run.args.batch_size * run.world_size
    return loss_sum / (len(losses) * run.world_size), correct_sum / images_seen, len(losses) // accum_steps, images_seen


# opt5: eager even with --compile: compiled, it would compile again at each image size, for seconds it saves none of
@torch.compiler.set_stance("force_eager")
def evaluate(run, test_data, size):
    """Mean loss and accuracy of the model on `test_data` at size x size, each image scored with its mirror."""
    run.model.eval()
    test_count = len(test_data[1])
    # opt6: each rank evaluates its own slice of the test set; the slices' sums are added up at the end
    share = slice(run.rank * test_count // run.world_size, (run.rank + 1) * test_count // run.world_size)
    all_images, all_labels = (data[share] for data in test_data)
    # opt5: each image and its mirror in one batch of --batch-size (if even): the shape trained on
    batch_size = max(1, run.args.batch_size // 2)
    # opt3: the totals stay on the device: read at the end, not waited for per batch
    total_loss = torch.zeros((), device=run.device)
    correct = torch.zeros((), dtype=torch.long, device=run.device)
    with torch.inference_mode():  # opt2: like no_grad, and also skips autograd's version tracking
        for start in range(0, len(all_labels), batch_size):  # opt3: slices of the test set on the device, no loader
            images = normalize(all_images[start:start + batch_size], run.statistics)
            labels = all_labels[start:start + batch_size]
            # opt5: the last batch padded to full size (extra outputs dropped): the view below takes two whole halves
            images = torch.cat([images, images.new_zeros(batch_size - len(images), *images.shape[1:])])
            images = torch.cat([images, images.flip(3)])  # opt5: each image's mirror beside it, in the same call
            # opt5: at the size just trained on: its BatchNorm statistics are of images that size
            images = downscale(images, size).contiguous(memory_format=torch.channels_last)
            # opt1: 16-bit here too
            with torch.autocast(run.device.type, dtype=run.amp_dtype, enabled=run.amp_dtype != torch.float32):
                # opt5: the mean of the logits of each image and its mirror (test-time augmentation), in one call
                outputs = run.model(images).view(2, batch_size, -1).float().mean(0)[:len(labels)]
            total_loss += F.cross_entropy(outputs.float(), labels, reduction="sum")  # opt1: on float32 logits
            correct += (outputs.argmax(1) == labels).sum()
    totals = torch.stack([total_loss, correct.to(total_loss.dtype)])
    if run.world_size > 1:
        dist.all_reduce(totals)  # opt6: the whole test set's loss and correct count
    loss_sum, correct_sum = totals.tolist()
    return loss_sum / test_count, correct_sum / test_count


def main():
    args = parse_args()
    rank, world_size, device = setup_distributed(common.pick_device(args))
    point_to_torchrun(device, world_size)  # opt6: where one process leaves GPUs of this machine idle, say torchrun
    if rank != 0:
        sys.stdout = open(os.devnull, "w")  # opt6: one log: only rank 0 prints
    common.print_settings(__file__, device, args)
    # opt1: 16-bit math only where the hardware runs it: on a CPU without a bfloat16 unit it is emulated, and slow
    amp_dtype, why = autocast_dtype(device)
    print(f"precision: {why}")
    # opt6: world_size times the batch of one process averages away noise: the peak rate grows by its square root
    max_lr = args.lr * world_size ** 0.5
    print(f"world size {world_size}: global batch {world_size * args.batch_size * args.accum_steps} "
          f"(--batch-size x world size x --accum-steps), peak rate {max_lr:g} (--lr {args.lr:g} x sqrt(world size))")
    torch.manual_seed(args.seed)

    with rank_zero_first(world_size):  # opt6: one download per machine, each after rank 0's
        # opt3: the whole dataset on the device as uint8: 4x less to move than float32, and no loader or copy per step
        train_set, test_set = common.load_data(args, train_transform=None, test_transform=None)
    train_data, test_data = load_to_device(train_set, device), load_to_device(test_set, device)
    generator = torch.Generator(device).manual_seed(args.seed)
    statistics = common.cifar10_statistics(device)

    # opt1: cuDNN times its convolution algorithms once per input shape and keeps the fastest
    torch.backends.cudnn.benchmark = True
    # opt3: channels_last (NHWC) is the layout tensor cores and the CPU's oneDNN convolutions run fastest
    model = common.ResNet10().to(device, memory_format=torch.channels_last)
    train_model = model
    if world_size > 1:
        # opt6: DDP averages the gradients over the ranks in buckets, each sent once ready: overlapped with the backward
        train_model = DistributedDataParallel(
            model, device_ids=[device] if device.type == "cuda" else None,
            gradient_as_bucket_view=True,  # opt6: the gradients are views of the buckets: none copied into them
            # opt6: no broadcast of rank 0's BatchNorm statistics before every forward: averaged once per evaluation
            **{broadcast_buffers_keyword(): False})
    if args.compile:
        # opt1: fuses operations into fewer kernels: less memory traffic and Python overhead
        # opt5: dynamic=False: a graph for each image size (dynamic=True traced one a size too: lab/README.md)
        # opt6: DDP's wrapper compiled: Dynamo splits the graph where it estimates DDP's buckets end, to overlap them
        train_model.compile(dynamic=False)
    # opt2: label smoothing keeps the logits from growing without bound; in opt5's recipe its gain is within seed noise
    criterion = nn.CrossEntropyLoss(label_smoothing=args.label_smoothing)
    if args.optimizer == "muon":
        # opt5: Muon for the filters, AdamW for the rest: more accuracy per epoch; Newton-Schulz in autocast's type
        filters = [parameter for parameter in model.parameters() if parameter.ndim == 4]
        others = adamw([parameter for parameter in model.parameters() if parameter.ndim != 4], max_lr, device)
        muon = Muon(filters, torch.tensor(max_lr, device=device), others.defaults["weight_decay"],
                    momentum=RECIPE["muon_momentum"], steps=args.ns_steps, dtype=amp_dtype)
        optimizers = [muon, others]
    else:
        optimizers = [adamw(model.parameters(), max_lr, device)]
    scaler = torch.amp.GradScaler(device.type, enabled=amp_dtype == torch.float16)  # bfloat16 needs no scaling
    steps_per_epoch = len(train_set) // (args.batch_size * world_size) // args.accum_steps
    full_size = train_set.data.shape[1]  # opt5: CIFAR-10's 32 x 32, the size the last epochs train on
    sizes = image_sizes(args.epochs, args.min_size, full_size, args.full_size_share)
    total_steps = args.epochs * steps_per_epoch
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
        optimizers=optimizers,
        scaler=scaler,
        generator=generator,
        rank=rank,
        world_size=world_size,
        statistics=statistics,
        crop_padding=common.CROP_PADDING,
        # opt4: the schedule as a table on the device, and the plan: the buffers every step reads and writes
        schedule=onecycle_schedule(max_lr, total_steps, device),
        plan=empty_plan(train_data, statistics, common.CROP_PADDING, steps_per_epoch, args.batch_size,
                        args.accum_steps),
    )
    step = make_train_step(train_model, criterion, optimizers, run.plan, amp_dtype, scaler)
    run.train_steps = {size: functools.partial(step, size) for size in sizes}
    why_not = capture_problem(device, amp_dtype, optimizers, world_size)
    if why_not is None:
        # opt4: on CUDA the whole step is captured once and replayed: one launch a step, however many kernels
        # opt5: a graph for each image size: a graph replays the shapes it was captured with
        run.train_steps = {size: cuda_graph(step, device) for size, step in run.train_steps.items()}
    else:
        print(f"step: run as a function, {why_not}")

    # opt5: between epochs a fixed random test subset (random: all classes) shows the curve cheaply; the last tests all
    subset = torch.randperm(len(test_set), generator=torch.Generator().manual_seed(args.seed))[:args.monitor_size]
    subset_data = [data[subset.to(device)] for data in test_data]
    records = []
    start = common.now(device)
    for epoch, size in enumerate(sizes, 1):
        profile_dir = args.profile if epoch == args.epochs and rank == 0 else None  # opt6: rank 0's trace alone
        with common.step_monitor(epoch, profile_dir, device) as monitor:
            epoch_start = common.now(device)
            train_figures = train_one_epoch(run, train_data, epoch, monitor, size)
            train_seconds = common.now(device) - epoch_start
        average_batchnorm_buffers(model, world_size)  # opt6: every rank evaluates the model rank 0 saves
        evaluated = test_data if epoch == args.epochs else subset_data
        test_figures = evaluate(run, evaluated, size)
        common.record_epoch(records, train_figures, test_figures, train_seconds, image_size=size,
                            test_images=len(evaluated[1]))
    if rank == 0:  # opt6: rank 0 alone writes the report and the weights
        common.report(__file__, run, records, common.now(device) - start)
        if args.save:
            torch.save(model.state_dict(), args.save)
    if dist.is_initialized():  # a group of one too: torchrun with one process
        leave_process_group()  # opt6: the ranks end together, and then their process group


if __name__ == "__main__":
    main()
