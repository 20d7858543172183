"""opt5.py: opt4.py + data parallelism over many GPUs and machines: DistributedDataParallel under torchrun.

    torchrun --nproc_per_node=8 opt5.py --epochs 5    # one machine, 8 GPUs
    torchrun --nnodes=2 --node_rank=0 --nproc_per_node=8 --rdzv_endpoint=HOST:29500 opt5.py --epochs 5
    torchrun --nproc_per_node=2 opt5.py --synthetic --epochs 2   # no download: measures speed only
    python opt5.py --epochs 5                          # no torchrun: one process, like opt4.py

Each optimization is marked `# opt5:` where it happens; read `diff -u opt4.py opt5.py`.
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
    parser = harness.build_parser(__doc__, batch_size=128, lr=8e-3)
    parser.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True,
                        help="torch.compile the model; --no-compile runs eager (default: on)")
    parser.add_argument("--compile-mode", default=None,
                        choices=["default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"],
                        help="reduce-overhead replays CUDA graphs; max-autotune times kernel variants for "
                             "minutes, longer than a short run (default: reduce-overhead on CUDA, default on CPU)")
    parser.add_argument("--accum-steps", type=harness.positive_int, default=1,
                        help="micro-batches per optimizer step; effective batch = batch size x this (default: 1)")
    parser.add_argument("--label-smoothing", type=harness.fraction, default=0.1,
                        help="weight of the uniform target mixed into each label (default: 0.1)")
    parser.add_argument("--min-size", type=int, default=16, choices=[8, 16, 24, 32],
                        help="image size of the first epoch; it grows to the full size (32) by the last (default: 16)")
    parser.add_argument("--monitor-size", type=harness.positive_int, default=1000,
                        help="test images evaluated after each epoch but the last, which evaluates them all "
                             "(default: 1000)")
    parser.add_argument("--optimizer", choices=["muon", "adamw"], default="muon",
                        help="muon: Muon for the convolution filters and AdamW for the rest; adamw: AdamW for all, "
                             "as opt3 (default: muon)")
    parser.add_argument("--ns-steps", type=harness.positive_int, default=3,
                        help="Newton-Schulz iterations in each Muon update: 3, as airbench94_muon.py (a CIFAR-10 "
                             "speed record) runs; 5, torch.optim.Muon's default, is 5/3 the matmul work (default: 3)")
    args = parser.parse_args()
    world_size = int(os.environ["WORLD_SIZE"]) if started_by_torchrun() else 1  # opt5: processes in the job
    return harness.check_args(args, images_per_step=args.batch_size * args.accum_steps * world_size)


def started_by_torchrun():
    """Whether torchrun started this process; exit 2 when only some of the variables it sets are there."""
    ranks = [name for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE") if name in os.environ]
    missing = [name for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
               if name not in os.environ]
    if ranks and missing:
        common.fail(f"{', '.join(ranks)} set but not {', '.join(missing)}: start opt5.py with torchrun, which sets "
                    f"them all (srun does not), or unset {', '.join(ranks)} to run one process")
    return bool(ranks)


def setup_distributed(device):
    """(rank, world size, device): torchrun's when it started us, else (0, 1, device) and no process group."""
    if not started_by_torchrun():
        gpus = torch.cuda.device_count() if device.type == "cuda" else 0
        if gpus > 1:
            print(f"{gpus} GPUs here, and one process uses one: to use them all, start "
                  f"torchrun --standalone --nproc_per_node={gpus} opt5.py ...")
        return 0, 1, device
    if device.type == "cuda":
        # opt5: one process per GPU, GPU LOCAL_RANK (harness.pick_device made it current before any CUDA work); NCCL
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
        # opt3: bfloat16 where the GPU runs it natively (Ampere, sm_80, and newer): float32's range, so no
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


@functools.cache
def channel_statistics(device):
    """CIFAR-10's per-channel mean and std in uint8 units, made on `device` once, not copied per step."""
    statistics = torch.tensor([common.CIFAR10_MEAN, common.CIFAR10_STD], device=device) * 255
    return statistics.view(2, 1, 3, 1, 1)


def normalize(images):
    """uint8 images -> float32 with zero mean and unit variance per channel."""
    mean, std = channel_statistics(images.device)
    return (images.float() - mean) / std


def augment(images, generator):
    """Per image: a random crop of the reflect-padded image, as large as the image, and a random horizontal flip."""
    (batch, channels, height, width), device, pad = images.shape, images.device, common.CROP_PADDING
    padded = F.pad(images, (pad, pad, pad, pad), mode="reflect")
    top, left = torch.randint(0, 2 * pad + 1, (2, batch, 1), device=device, generator=generator)
    flip = torch.rand(batch, 1, device=device, generator=generator) < 0.5
    rows = top + torch.arange(height, device=device)
    pixels = torch.arange(width, device=device)
    columns = left + torch.where(flip, width - 1 - pixels, pixels)  # a flip reads the crop's columns backwards
    # One gather for the whole batch: image i, every channel, rows[i] x columns[i].
    image_index = torch.arange(batch, device=device).view(batch, 1, 1, 1)
    channel_index = torch.arange(channels, device=device).view(1, channels, 1, 1)
    return padded[image_index, channel_index, rows.view(batch, 1, height, 1), columns.view(batch, 1, 1, width)]


def image_size(epoch, epochs, min_size, full_size):
    """The side of the images trained on in `epoch`, from min_size up in steps of 8: each size gets an equal share
    of the epochs (the smaller ones any left over) and the last epoch is at full_size: 16,16,24,24,32,32 for 6."""
    sizes = range(min_size, full_size + 1, 8)
    return sizes[(epoch - 1) * len(sizes) // epochs] if epoch < epochs else full_size


def downscale(images, size):
    """Shrink a batch of square images to size x size; each new pixel is the mean of the pixels it covers."""
    if size == images.shape[-1]:
        return images
    return F.interpolate(images, size=(size, size), mode="area")


def epoch_batches(size, batch_size, generator, device, rank, world_size):
    """This rank's share of one epoch's batches, as rows of image indices.

    Every rank draws the same permutation (same seed) and cuts it into global batches of
    world_size x batch_size; rank r takes the r-th slice of each, so the shares are disjoint.
    The few images left over change each epoch; every batch is full, so a compiled step sees one shape.
    """
    permutation = torch.randperm(size, device=device, generator=generator)
    global_batch = batch_size * world_size
    return permutation[: size // global_batch * global_batch].view(-1, world_size, batch_size)[:, rank]


def orthogonalize(matrix, steps, dtype):
    """Roughly the semi-orthogonal matrix nearest `matrix` (U V^T of its SVD), by `steps` Newton-Schulz iterations in
    `dtype`: matmuls only, no SVD. Keller Jordan's coefficients take each singular value above a threshold to 0.68-1.2
    (rather than to exactly 1 in many more steps, and that trains as well); each step multiplies a small one by about
    3.4, less as it grows, so the threshold is 1/56 of the matrix's Frobenius norm after 3 steps, 1/660 after 5."""
    a, b, c = 3.4445, -4.7750, 2.0315
    x = matrix.to(dtype)
    tall = x.shape[0] > x.shape[1]
    if tall:
        x = x.T  # x @ x.T is then the smaller of the two Gram matrices
    x = x / x.norm().clamp(min=1e-7)  # the Frobenius norm bounds the largest singular value: now all are at most 1
    for _ in range(steps):
        gram = x @ x.T
        # a x + b x^3 + c x^5 on each singular value; addmm rounds its sum once, not once per term
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if tall else x


class Muon(torch.optim.Optimizer):
    """Muon (Keller Jordan, 2024) for the convolution filters and AdamW for every other parameter, in one optimizer, so
    OneCycleLR cycles both rates and both momenta (betas[0]) and GradScaler and zero_grad see every parameter.

    A filter's step is its Nesterov momentum, seen as a matrix (out x in*k*k) and orthogonalized: every direction gets
    a step of the same size, so the rare directions that a gradient step all but ignores learn as fast as the common
    ones. Scaled by 0.2 sqrt(max(out, in*k*k)), its size matches AdamW's (Moonlight, Liu et al., 2025), so AdamW's
    rate and weight decay carry over. torch.optim.Muon (torch 2.9 and newer) takes 2-D weights only.
    """

    def __init__(self, parameters, lr, weight_decay, dtype, steps):
        parameters = list(parameters)
        groups = [{"params": [parameter for parameter in parameters if parameter.ndim == 4], "muon": True},
                  {"params": [parameter for parameter in parameters if parameter.ndim != 4], "muon": False}]
        super().__init__(groups, {"lr": lr, "weight_decay": weight_decay, "betas": (0.9, 0.999), "eps": 1e-8})
        self.dtype, self.steps = dtype, steps

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            lr, (beta1, beta2) = group["lr"], group["betas"]
            for parameter in group["params"]:
                if parameter.grad is None:
                    continue
                grad, state = parameter.grad, self.state[parameter]
                if not state:  # Muon keeps a momentum per filter, AdamW also a mean square per weight
                    state.update(step=0, exp_avg=torch.zeros_like(parameter))
                    if not group["muon"]:
                        state["exp_avg_sq"] = torch.zeros_like(parameter)
                state["step"] += 1
                parameter.mul_(1 - lr * group["weight_decay"])  # decoupled weight decay, as AdamW's
                momentum = state["exp_avg"].lerp_(grad, 1 - beta1)
                if group["muon"]:
                    update = grad.lerp(momentum, beta1).flatten(1)  # Nesterov momentum; the filter as a matrix
                    scale = 0.2 * max(update.shape) ** 0.5
                    update = orthogonalize(update, self.steps, self.dtype).reshape(parameter.shape)
                    parameter.add_(update, alpha=-lr * scale)
                else:
                    state["exp_avg_sq"].mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
                    denominator = (state["exp_avg_sq"] / (1 - beta2 ** state["step"])).sqrt_().add_(group["eps"])
                    parameter.addcdiv_(momentum, denominator, value=-lr / (1 - beta1 ** state["step"]))


def train_one_epoch(run, train_data, epoch, monitor, size):
    """One pass over `train_data`; returns mean loss, accuracy, optimizer steps and images trained on."""
    run.model.train()
    all_images, all_labels = train_data
    # opt3: batches are gathered by index on the device: no loader, no workers, no host-to-device copy
    batches = epoch_batches(len(all_labels), run.args.batch_size, run.generator, run.device, run.rank, run.world_size)
    # opt2: accumulating gradients of accum_steps micro-batches gives a big batch's step in less memory;
    # every step gets exactly accum_steps micro-batches, so a few left over at the end are skipped
    accum_steps = run.args.accum_steps
    steps = len(batches) // accum_steps
    # opt3: losses and correct counts stay on the device: reading them per step would wait for the GPU
    losses = torch.zeros(steps * accum_steps, device=run.device)
    correct = torch.zeros((), dtype=torch.long, device=run.device)
    for micro_step, indices in enumerate(batches[: steps * accum_steps]):
        # opt3: normalize, crop and flip the whole batch on the device; channels_last for the model
        images = augment(normalize(all_images[indices]), run.augment_generator)
        # opt4: progressive resizing: a convolution's work scales with the pixels, so a 16x16 epoch has a quarter of a
        # 32x32 one's; ResNet10 pools globally, so it takes any size, and the last epochs teach it 32x32
        images = downscale(images, size).contiguous(memory_format=torch.channels_last)
        labels = all_labels[indices]
        # opt5: DDP all-reduces the gradients in the backward of a step's last micro-batch only (as no_sync() does)
        run.model.require_backward_grad_sync = (micro_step + 1) % accum_steps == 0
        # opt1: autocast runs convolutions in 16-bit where it is native: half the memory traffic, tensor cores
        with torch.autocast(run.device.type, dtype=run.amp_dtype, enabled=run.amp_dtype != torch.float32):
            outputs = run.model(images)
            loss = run.criterion(outputs, labels)
        # opt1: float16 gradients can underflow to zero; GradScaler scales the loss up, then back
        run.scaler.scale(loss / accum_steps).backward()  # opt2: the mean over the effective batch
        if (micro_step + 1) % accum_steps == 0:
            run.scaler.step(run.optimizer)
            run.scaler.update()
            # opt3: zero_grad() drops the gradients (set_to_none, the default); kept ones must stay put (see main)
            run.optimizer.zero_grad(set_to_none=not run.keep_gradients)
            run.scheduler.step()
            monitor.step()
        losses[micro_step] = loss.detach()
        correct += (outputs.argmax(1) == labels).sum()
    # opt3: the one wait for the device per epoch (in float16 GradScaler adds one per Muon step, which it cannot
    # skip on the device as fused AdamW does); a non-finite loss is found here, not at its step
    for micro_step, loss_value in enumerate(losses.tolist()):
        common.check_finite(loss_value, epoch, micro_step // accum_steps + 1)
    totals = torch.stack([losses.sum(), correct.to(losses.dtype), torch.tensor(float(len(losses)), device=run.device)])
    if run.world_size > 1:
        dist.all_reduce(totals)  # opt5: loss, accuracy and images/s count every rank's share
    loss_sum, correct_sum, micro_batches = totals.tolist()
    images_seen = int(micro_batches) * run.args.batch_size
    return loss_sum / micro_batches, correct_sum / images_seen, steps, images_seen


def evaluate(run, test_data, size):
    """Mean loss and accuracy of the model on `test_data`, shown at size x size."""
    run.model.eval()
    test_size = len(test_data[1])
    # opt5: each rank evaluates its own slice of the test set; the slices' sums are added up at the end
    all_images, all_labels = (data[rank_slice(test_size, run.rank, run.world_size)] for data in test_data)
    batch_size = run.args.batch_size
    # opt3: the totals stay on the device: one read at the end, not one wait per batch
    total_loss = torch.zeros((), device=run.device)
    correct = torch.zeros((), dtype=torch.long, device=run.device)
    with torch.inference_mode():  # opt2: like no_grad, and also skips autograd's version tracking
        for start in range(0, len(all_labels), batch_size):
            images = normalize(all_images[start:start + batch_size])
            # opt1: the last batch padded with blank images to a full one (their outputs are dropped): one shape, so
            # one compiled evaluation graph, not another for the last few images
            images = F.pad(images, (0, 0, 0, 0, 0, 0, 0, batch_size - len(images)))
            # opt4: at the size just trained on: its BatchNorm statistics are of images that size
            images = downscale(images, size).contiguous(memory_format=torch.channels_last)
            labels = all_labels[start:start + batch_size]
            # opt1: 16-bit here too
            with torch.autocast(run.device.type, dtype=run.amp_dtype, enabled=run.amp_dtype != torch.float32):
                # opt3: average the logits of each image and its mirror (test-time augmentation), in one call
                outputs = run.model(torch.cat([images, images.flip(3)])).view(2, batch_size, -1).mean(0)[:len(labels)]
            total_loss += F.cross_entropy(outputs.float(), labels, reduction="sum")  # opt1: on float32 logits
            correct += (outputs.argmax(1) == labels).sum()
    totals = torch.stack([total_loss, correct.to(total_loss.dtype)])
    if run.world_size > 1:
        dist.all_reduce(totals)  # opt5: the whole test set's loss and correct count
    loss_sum, correct_sum = totals.tolist()
    return loss_sum / test_size, correct_sum / test_size


def main():
    args = parse_args()
    rank, world_size, device = setup_distributed(harness.pick_device(args))
    harness.check_ddp_cuda_graphs(args, device, world_size)
    train(args, rank, world_size, device)
    if world_size > 1:
        # opt5: the ranks leave together, and this thread keeps the barrier's handle until the process group is gone:
        # on torch 2.6 (Gloo), whichever thread lets go of it last frees the collectives still in flight when it began,
        # their tensors included; on Gloo's worker thread that waits for the GIL, which this thread holds while
        # destroy_process_group waits for that worker: both would wait for ever, and torchrun with them
        barrier = dist.barrier(async_op=True)
        barrier.wait()
        dist.destroy_process_group()


def train(args, rank, world_size, device):
    if rank != 0:
        sys.stdout = open(os.devnull, "w")  # opt5: one log: only rank 0 prints
    harness.print_settings(__file__, device, args)
    # opt1: 16-bit math only where the hardware runs it: on a CPU without a bfloat16 unit it is emulated, and slow
    amp_dtype, why = autocast_dtype(device)
    print(f"precision: {why}")
    print(f"world size {world_size}: global batch {world_size * args.batch_size * args.accum_steps} "
          f"(--batch-size x world size x --accum-steps)")
    torch.manual_seed(args.seed)

    # opt3: the whole dataset lives on the device as uint8 (180 MB): 4x less to move than float32,
    # and no loader, workers or host-to-device copy per step; normalize() and augment() run per batch
    with rank_zero_first(world_size):  # opt5: one download per machine, each after rank 0's
        train_set, test_set = common.load_data(args, train_transform=None, test_transform=None)
    train_data, test_data = load_to_device(train_set, device), load_to_device(test_set, device)
    generator = torch.Generator(device).manual_seed(args.seed)  # the same permutation on every rank
    augment_generator = torch.Generator(device).manual_seed(args.seed + rank)  # opt5: each rank its own crops

    # opt1: cuDNN times its convolution algorithms once per input shape and keeps the fastest
    torch.backends.cudnn.benchmark = True
    # opt3: channels_last (NHWC) is the layout tensor cores and the CPU's oneDNN convolutions run fastest
    model = common.ResNet10().to(device, memory_format=torch.channels_last)
    if args.compile:
        # opt1: fuses operations into fewer kernels: less memory traffic and Python overhead
        # opt3: on CUDA, reduce-overhead replays the model's forward and backward as CUDA graphs, a launch each
        # instead of one per kernel (the loss, augmentation and optimizer still launch their kernels one by one)
        # opt4: dynamic=False compiles a graph for each image size; by default the second size would recompile
        # into one graph with symbolic sizes, whose kernels are less specialized
        model.compile(mode=args.compile_mode or ("reduce-overhead" if device.type == "cuda" else "default"),
                      dynamic=False)
    # opt3: accumulating under CUDA graphs needs gradients that stay put: one that backward creates lives in the
    # graphs' memory pool, which the next micro-batch's forward overwrites; so allocate them once and zero them
    # opt5: and under DDP, where they are views of its all-reduce buckets: set to None, every step would copy them
    keep_gradients = args.accum_steps > 1 or world_size > 1
    if keep_gradients:
        for parameter in model.parameters():
            parameter.grad = torch.zeros_like(parameter)
    train_model = model
    if world_size > 1:
        # opt5: DDP averages gradients over the ranks in buckets, each sent as soon as its gradients are ready, so
        # communication overlaps the rest of the backward pass. ResNet10 has 19.6 MB of them: after the first step
        # DDP rebuilds its buckets in the order they became ready: layer 4's last conv and what follows it (10.0 MB:
        # the first bucket closes past 1 MiB), then the rest. Compiled, Dynamo's DDPOptimizer cuts the graph at the
        # same mark (before that conv), so the first all-reduce runs during the backward of all the layers before it,
        # most of the work; the second waits for the backward's end (read off torch 2.15, Gloo, 2 ranks). The kept
        # gradients are views of the buckets (no copy); no BatchNorm broadcast before every forward
        # (average_batchnorm_statistics)
        train_model = DistributedDataParallel(
            model, device_ids=[device] if device.type == "cuda" else None, gradient_as_bucket_view=True,
            **harness.no_buffer_broadcast())
    # opt2: label smoothing keeps the logits from growing without bound: better accuracy in few epochs
    criterion = nn.CrossEntropyLoss(label_smoothing=args.label_smoothing)
    # opt5: --lr is the rate for one process's step of --batch-size x --accum-steps images, as in opt4; world_size
    # processes make the global batch world_size times larger, averaging away noise: scale the rate by its square root
    max_lr = args.lr * world_size ** 0.5
    if args.optimizer == "muon":
        # opt4: Muon for the filters: more accuracy per epoch, for the cost of its update (see Muon);
        # Newton-Schulz in the 16-bit type the hardware runs natively, in float32 where it has none; 3 steps
        # (--ns-steps) are 3/5 of torch.optim.Muon's default work and trained as well here (results/README.md)
        optimizer = Muon(model.parameters(), lr=max_lr, weight_decay=0.05, dtype=amp_dtype,
                         steps=args.ns_steps)
    else:
        # opt1: AdamW scales each weight's step by its recent gradients, so one rate suits every layer untuned
        # opt3: fused=True does AdamW's whole update in one pass over the weights (on a GPU, one kernel for many);
        # the default makes a pass per operation (foreach on a GPU: each over all weights; on a CPU, weight by weight)
        optimizer = torch.optim.AdamW(model.parameters(), lr=max_lr, weight_decay=0.05, fused=True)
    scaler = torch.amp.GradScaler(device.type, enabled=amp_dtype == torch.float16)  # bfloat16 needs no scaling
    # opt2: one cycle of warm-up then annealing reaches a given accuracy in far fewer epochs than a
    # fixed rate; its length counts optimizer steps, not micro-batches
    total_steps = args.epochs * (len(train_data[1]) // (args.batch_size * world_size) // args.accum_steps)
    if total_steps < 5:
        common.fail(f"{total_steps} optimizer steps in all are too few for OneCycleLR's warm-up (it needs 5); "
                    "use more --epochs or --train-size")
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=max_lr, total_steps=total_steps, pct_start=0.25)
    # What the functions above need besides their data, in one object (a setting is read as run.args.name)
    run = SimpleNamespace(
        args=args,
        device=device,
        amp_dtype=amp_dtype,
        model=train_model,  # opt5: DDP's wrapper when distributed; without autograd (evaluate) it sends nothing
        criterion=criterion,
        optimizer=optimizer,
        scaler=scaler,
        scheduler=scheduler,
        keep_gradients=keep_gradients,
        generator=generator,
        augment_generator=augment_generator,
        rank=rank,
        world_size=world_size,
    )

    # opt4: after each epoch but the last, a fixed random subset of the test set shows the curve at a small cost
    # (1,000 images: about 1 % of a 32x32 epoch's work; the first 1,000 of a set stored by class would be one class);
    # the last epoch evaluates them all
    subset = torch.randperm(len(test_data[1]), generator=torch.Generator().manual_seed(args.seed))[:args.monitor_size]
    monitor_data = [data[subset.to(device)] for data in test_data]
    records = []
    start = common.now(device)
    for epoch in range(1, args.epochs + 1):
        size = image_size(epoch, args.epochs, args.min_size, full_size=train_data[0].shape[-1])
        profile_dir = args.profile if epoch == args.epochs and rank == 0 else None
        with harness.step_monitor(epoch, profile_dir, device) as monitor:
            epoch_start = common.now(device)
            train_figures = train_one_epoch(run, train_data, epoch, monitor, size)
            train_seconds = common.now(device) - epoch_start
        average_batchnorm_statistics(model, world_size)  # opt5: every rank evaluates the model rank 0 saves
        evaluated = test_data if epoch == args.epochs else monitor_data
        test_figures = evaluate(run, evaluated, size)
        harness.record_epoch(records, train_figures, test_figures, train_seconds, image_size=size,
                            test_images=len(evaluated[1]))
    if rank != 0:
        return  # opt5: rank 0 alone writes the report, the weights and the trace
    harness.report(__file__, args, device, records, common.now(device) - start,
                  extra={"final_lr": optimizer.param_groups[0]["lr"], "world_size": world_size})
    if args.save:
        torch.save(model.state_dict(), args.save)


if __name__ == "__main__":
    main()
