"""ablation.py: opt5 with one technique switched per row (or a bundle of them), each row its own run, as data.

    python lab/ablation.py --data-dir ./data --rows shipped adamw smoothing-0    # appends to lab/results/recipe.jsonl
    python lab/ablation.py --rows shipped ema --synthetic --epochs 2 --train-size 2048 --json /tmp/ablation.jsonl
    python lab/plot.py --tables                                                  # the tables, with the other results

Each row runs opt5.py's own main() in a fresh process (launched as this one was) with one change applied from
outside, so opt5.py keeps only what earns its place. After training, every row scores its final weights on the
whole test set from 1 view per image, 2 (the image and its mirror: opt5's own evaluation) and 6 (both also
shifted one pixel up-left and down-right: flip + translate test-time augmentation). Any flag not listed below is
opt5.py's (see `python opt5.py --help`) and goes to every row; without such flags a row is opt5 as it ships (the
recipe: 20 epochs of batch 512, Muon) with its one change. The rows of lab/results/ablation.jsonl (the first 9, shipped
to nesterov) were measured before the recipe, with AdamW at 5 epochs of batch 128: give those names to --rows with
`--epochs 5 --batch-size 128 --lr 0.008 --optimizer adamw --json lab/results/ablation.jsonl` to run them again. The
rows run one after another: time them with nothing else running on the machine.

`twenty-epochs` is the recipe with every setting named. The time rows (TIME_ROWS) train as opt5 does, set up
differently, to cut its seconds before the steady steps; the bundles (BUNDLE_ROWS) do less work than the recipe
(<= 0.7x its modelled H200 seconds) with tricks of airbench94 and airbench94_muon, and name every setting they change.
screen.py runs them all in one call on a GPU (a recipe run there takes ~15 s) and decides by its rules.
"""
import argparse
import contextlib
import functools
import json
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

import root  # noqa: F401  (first: the repository's root on sys.path, for the scripts and common.py)
import accounting  # noqa: E402
import common  # noqa: E402
import opt5  # noqa: E402


# ------------------------------------------------------------------------- the techniques

def zero_init_residuals(patch):
    """Each block's last BatchNorm scale starts at 0, so each residual block starts as its shortcut alone."""
    build = common.ResNet10

    def model():
        network = build()
        for block in network.layers:
            nn.init.zeros_(block.bn2.weight)
        return network
    patch(common, "ResNet10", model)


def whitening_weights(images, eps=5e-4):
    """54 3x3 filters that whiten the images' 3x3 patches: the patch covariance's eigenvectors, each scaled by
    1/sqrt(its eigenvalue), and their negatives (so a ReLU after them loses nothing)."""
    channels = images.shape[1]
    patches = images.unfold(2, 3, 1).unfold(3, 3, 1).permute(0, 2, 3, 1, 4, 5).reshape(-1, channels * 9)
    eigenvalues, eigenvectors = torch.linalg.eigh(torch.cov(patches.T.double()))
    filters = (eigenvectors.T / (eigenvalues.clamp(min=0) + eps).sqrt().view(-1, 1)).view(-1, channels, 3, 3)
    return torch.cat([filters, -filters]).float()


def whitening_stem(patch, images_used=5000, frozen=True):
    """The stem's convolution starts with 54 filters that whiten 3x3 patches of training images (10 stay random), and
    stays so where `frozen`; else it trains from there."""
    load, build, loaded = opt5.load_to_device, common.ResNet10, []

    def load_and_keep(dataset, device):
        loaded.append(load(dataset, device))  # opt5 loads the training set first
        return loaded[-1]

    def model():
        network = build()
        stem = network.stem[0]
        images = loaded[0][0][:images_used]
        weights = whitening_weights(opt5.normalize(images, common.cifar10_statistics(images.device)).cpu())
        with torch.no_grad():
            stem.weight[:len(weights)] = weights.to(stem.weight.device)
        stem.weight.requires_grad_(not frozen)  # an optimizer skips a weight that gets no gradient
        return network
    patch(opt5, "load_to_device", load_and_keep)
    patch(common, "ResNet10", model)


def alternating_flip(patch):
    """Each image is mirrored in epoch 1 by a coin toss, then in every other epoch after it: over any two epochs
    each image is seen both ways, where independent coins show a quarter of them the same way twice."""
    plan_epoch, first_flips, epochs = opt5.plan_epoch, [], []

    def alternating(plan, draw, rates):
        plan_epoch(plan, draw, rates)  # opt5's batches and crops; its coin per position in a batch is replaced below
        image_count, device = len(plan.labels), plan.labels.device
        if not first_flips:
            generator = torch.Generator(device).manual_seed(torch.initial_seed())  # opt5 seeds torch with --seed
            first_flips.append(torch.rand(image_count, device=device, generator=generator) < 0.5)
        epochs.append(len(epochs) + 1)
        plan.flips.copy_((first_flips[0][plan.batches] ^ (epochs[-1] % 2 == 0)).unsqueeze(-1))
    patch(opt5, "plan_epoch", alternating)


def ema_of_the_weights(patch, decay=0.99):
    """An exponential moving average of the weights and BatchNorm statistics, updated after every optimizer step;
    the row scores the average, not the last weights (opt5's own per-epoch lines still show the last weights)."""
    train = opt5.train_one_epoch

    def train_one_epoch(run, train_data, epoch, monitor, size):
        if not hasattr(run, "average"):
            run.average = {name: tensor.detach().clone() for name, tensor in run.model.state_dict().items()
                           if tensor.is_floating_point()}
            current = {name: tensor for name, tensor in run.model.state_dict().items() if name in run.average}

            def update(*_):
                with torch.no_grad():
                    for name, average in run.average.items():
                        average.lerp_(current[name], 1 - decay)
            run.optimizers[-1].register_step_post_hook(update)  # the last optimizer a step steps
        return train(run, train_data, epoch, monitor, size)
    patch(opt5, "train_one_epoch", train_one_epoch)


def nesterov_sgd(patch):
    """SGD with Nesterov momentum 0.9 and weight decay 5e-4, the CIFAR-10 speed records' optimizer, in place of
    AdamW (with --lr 0.2). Its rate follows OneCycleLR's table; its momentum stays 0.9 (measured before opt4's table,
    OneCycleLR cycled it)."""
    def sgd(parameters, lr, device):
        return torch.optim.SGD(parameters, lr=torch.tensor(lr, device=device), momentum=0.9, nesterov=True,
                               weight_decay=5e-4)
    patch(opt5, "adamw", sgd)


def short_schedule(patch, warmup=0.05, peak=1.4):
    """OneCycleLR warmed up over 5 % of the steps (not 25 %) to 1.4 x the peak rate, then down to 0 in a straight
    line (not a cosine): a short run spends more of its steps near its peak."""
    one_cycle = torch.optim.lr_scheduler.OneCycleLR

    def shorter(optimizer, max_lr, total_steps, **settings):
        return one_cycle(optimizer, max_lr=max_lr * peak, total_steps=total_steps,
                         **{**settings, "pct_start": warmup, "anneal_strategy": "linear"})
    patch(torch.optim.lr_scheduler, "OneCycleLR", shorter)


def batchnorm_without_decay(patch, rate=2.0):
    """Every 1-D parameter (BatchNorm's scales and biases, the classifier's bias) in an AdamW group of its own, without
    weight decay and at `rate` x the schedule's rate; the other weights as before."""
    build = opt5.adamw

    def adamw(parameters, lr, device):
        parameters = list(parameters)
        vectors = [parameter for parameter in parameters if parameter.ndim == 1]
        others = [parameter for parameter in parameters if parameter.ndim != 1]
        own_rate = torch.tensor(lr, device=device)  # a tensor of its own, which the schedule writes too
        optimizer = build([{"params": others}, {"params": vectors, "lr": own_rate, "weight_decay": 0.0}], lr, device)
        def scale_the_rate(*_):  # the schedule writes its rate into every group before each step: scaled on the device
            own_rate.mul_(rate)
        optimizer.register_step_pre_hook(scale_the_rate)
        return optimizer
    patch(opt5, "adamw", adamw)


def whitening_at_each_size(patch, images_used=5000):
    """The frozen whitening stem (whitening_stem), its filters computed again from the training images shrunk to each
    new image size before its first epoch: a 16x16 image's 3x3 patches span more of it than a 32x32 one's."""
    whitening_stem(patch, images_used)
    train, whitened = opt5.train_one_epoch, {}

    def train_one_epoch(run, train_data, epoch, monitor, size):
        if whitened.get("size") != size:
            images = opt5.downscale(opt5.normalize(run.plan.images[:images_used], run.statistics), size)
            weights = whitening_weights(images.cpu())
            with torch.no_grad():
                run.model.stem[0].weight[:len(weights)].copy_(weights)  # in place: a captured step keeps its address
            whitened["size"] = size
        return train(run, train_data, epoch, monitor, size)
    patch(opt5, "train_one_epoch", train_one_epoch)


def batched_orthogonalize(matrices, steps, dtype):
    """opt5.orthogonalize on a batch of wide matrices (k x rows x columns, rows <= columns) at once."""
    a, b, c = 3.4445, -4.7750, 2.0315
    x = matrices.to(dtype)
    x = x / x.norm(dim=(-2, -1), keepdim=True).clamp(min=1e-7)
    for _ in range(steps):
        gram = x @ x.transpose(-2, -1)
        x = torch.baddbmm(x, torch.baddbmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x


def as_filter(matrix, update):
    """`matrix`, a wide view of `update`'s matrix (out x in*k*k, transposed if it is tall), in the filter's shape."""
    return (matrix.T if update.size(0) > update[0].numel() else matrix).view(update.shape)


def orthogonal_updates(updates, steps, dtype):
    """Each update (a filter's) orthogonalized as a matrix, in a few batches rather than one at a time: the matrices
    with as many rows (a tall one turned wide) stacked, each padded with zero columns to the widest. A zero column adds
    nothing to x x^T, so it stays zero and leaves the others as they would be alone: ResNet10's 12 filters take 5
    batches for 36 % more matmul work."""
    sides = [sorted((update.size(0), update[0].numel())) for update in updates]  # each matrix's rows, columns: wide
    orthogonal = [None] * len(updates)
    for rows in sorted({rows for rows, _ in sides}):
        members = [i for i, (its_rows, _) in enumerate(sides) if its_rows == rows]
        batch = updates[members[0]].new_zeros(len(members), rows, max(sides[i][1] for i in members), dtype=dtype)
        for j, i in enumerate(members):
            as_filter(batch[j, :, :sides[i][1]], updates[i]).copy_(updates[i])  # cast to `dtype` as it copies
        batch = batched_orthogonalize(batch, steps, dtype)
        for j, i in enumerate(members):
            orthogonal[i] = as_filter(batch[j, :, :sides[i][1]], updates[i])
    return orthogonal


def batched_muon(patch):
    """opt5's Muon with its update in foreach ops over all the filters and their orthogonalization in 5 zero-padded
    batches (orthogonal_updates): the same math as opt5's loop over filters, in fewer, larger ops (a CPU trace: 94 ops
    a step against the loop's more; which is faster on a GPU is what this row measures)."""
    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            filters = [parameter for parameter in group["params"] if parameter.grad is not None]
            if not filters:  # foreach ops refuse an empty list
                continue
            lr, momentum = group["lr"], group["momentum"]
            for filter_ in filters:  # made at the first step only: setdefault's zeros would run (in the graph) at each
                if "momentum" not in self.state[filter_]:
                    self.state[filter_]["momentum"] = torch.zeros_like(filter_)
            momenta = [self.state[filter_]["momentum"] for filter_ in filters]
            grads = [filter_.grad for filter_ in filters]
            torch._foreach_mul_(filters, 1 - lr * group["weight_decay"])
            torch._foreach_lerp_(momenta, grads, 1 - momentum)
            updates = torch._foreach_lerp(grads, momenta, momentum)
            for filter_, update in zip(filters, orthogonal_updates(updates, self.steps, self.dtype)):
                filter_.add_(update * lr, alpha=-0.2 * max(update.size(0), update[0].numel()) ** 0.5)
    patch(opt5.Muon, "step", step)


def cudnn_benchmark_off(patch):
    """cuDNN's autotuner off: no timing of each new shape's convolution algorithms (its heuristics pick one)."""
    build = common.ResNet10

    def model():
        torch.backends.cudnn.benchmark = False  # opt5 turns it on just before it builds the model
        return build()
    patch(common, "ResNet10", model)


def cudnn_benchmark_at_the_largest_size(patch):
    """cuDNN's autotuner on only in the epochs at the full image size, where a step costs most."""
    train = opt5.train_one_epoch

    def train_one_epoch(run, train_data, epoch, monitor, size):
        torch.backends.cudnn.benchmark = size == run.plan.images.shape[-1]
        return train(run, train_data, epoch, monitor, size)
    patch(opt5, "train_one_epoch", train_one_epoch)


def one_warmup_step(patch):
    """One warm-up step before each capture instead of opt5's 3."""
    patch(opt5, "cuda_graph", functools.partial(opt5.cuda_graph, warmup_steps=1))


def lookahead(patch, every=5, decay=0.95 ** 5):
    """Lookahead (as airbench94 uses it): every `every` steps an average of the weights and BatchNorm statistics moves
    towards them, by 1 - decay x (steps done / all steps)^3, and is copied back into them: early in training nearly a
    no-op, later a pull towards where they have been; after the last step the weights are the average. It runs
    between steps, outside a captured graph."""
    train = opt5.train_one_epoch

    def pull(run, weight):
        with torch.no_grad():
            for average, tensor in zip(run.lookahead["average"], run.lookahead["tensors"]):
                average.lerp_(tensor, 1 - weight)
                tensor.copy_(average)

    def counted(run, step):
        def step_and_pull():
            step()
            run.lookahead["steps"] += 1
            if run.lookahead["steps"] % every == 0:
                pull(run, decay * (run.lookahead["steps"] / len(run.schedule)) ** 3)
        return step_and_pull

    def train_one_epoch(run, train_data, epoch, monitor, size):
        if not hasattr(run, "lookahead"):
            tensors = [tensor for tensor in run.model.state_dict().values() if tensor.is_floating_point()]
            run.lookahead = {"tensors": tensors, "average": [tensor.clone() for tensor in tensors], "steps": 0}
            run.train_steps = {size: counted(run, step) for size, step in run.train_steps.items()}
        figures = train(run, train_data, epoch, monitor, size)
        if epoch == run.args.epochs:
            pull(run, 1.0)  # the weights become the average
        return figures
    patch(opt5, "train_one_epoch", train_one_epoch)


def batchnorm_biases_only(patch, rate=2.0):
    """BatchNorm without its scales (frozen at 1), its biases (and the classifier's) without weight decay at `rate` x
    the schedule's rate (batchnorm_without_decay)."""
    batchnorm_without_decay(patch, rate)
    build = common.ResNet10

    def model():
        network = build()
        for module in network.modules():
            if isinstance(module, nn.BatchNorm2d):
                module.weight.requires_grad_(False)
        return network
    patch(common, "ResNet10", model)


def epochs_at_each_size(patch, counts):
    """The epochs at 16, 24 and 32 px given as counts (say 8, 4, 3) instead of opt5's shares; --epochs must be their
    sum."""
    def image_sizes(epochs, min_size, full_size, full_share):
        if epochs != sum(counts):
            common.fail(f"this row trains {sum(counts)} epochs ({counts} at 16, 24, 32 px): drop --epochs {epochs}")
        return [size for size, count in zip((16, 24, 32), counts) for _ in range(count)]
    patch(opt5, "image_sizes", image_sizes)


# The recipe at 20 epochs: each row names all its settings, so it stays itself whatever opt5's defaults are
TWENTY_EPOCHS = ["--epochs", "20", "--batch-size", "512", "--lr", "0.016", "--full-size-share", "0.3"]
# Bundles doing less work, each <= 0.7x the recipe's modelled H200 seconds: 15 epochs of 512 (8, 4, 3 at 16, 24,
# 32 px: 0.67x), 14 of 512 (7, 4, 3: 0.64x), 16 of 1024 at lr 0.016 x sqrt(2) (8, 4, 4: 0.58x)
FIFTEEN = (["--epochs", "15", "--batch-size", "512", "--lr", "0.016", "--label-smoothing", "0.1"],
           functools.partial(epochs_at_each_size, counts=(8, 4, 3)))
FOURTEEN = (["--epochs", "14", "--batch-size", "512", "--lr", "0.016", "--label-smoothing", "0.1"],
            functools.partial(epochs_at_each_size, counts=(7, 4, 3)))
SIXTEEN_1024 = (["--epochs", "16", "--batch-size", "1024", "--lr", "0.0226", "--label-smoothing", "0.1"],
                functools.partial(epochs_at_each_size, counts=(8, 4, 4)))
SMOOTHING = ["--label-smoothing", "0.2"]  # after a bundle's own flags, so it wins
TRAINED_WHITENING = functools.partial(whitening_stem, frozen=False)
# zero-init is not among them: with BatchNorm's scales frozen, a scale started at 0 would stay 0
ALL_TRICKS = (lookahead, alternating_flip, TRAINED_WHITENING, batchnorm_biases_only)


def bundle(name, schedule, techniques, change, flags=()):
    """A ROWS entry of a bundle: `schedule` (FIFTEEN, ...) with `techniques` and any further opt5 flags."""
    schedule_flags, sizes = schedule
    return name, [*schedule_flags, *flags], (sizes, *techniques), change
# (row, opt5 flags, techniques, what it changes)
ROWS = [
    ("shipped", [], (), "opt5 as shipped"),
    ("no-resizing", ["--min-size", "32"], (), "progressive resizing off: 32x32 every epoch"),
    ("full-eval", ["--monitor-size", str(common.CIFAR10_TEST_SIZE)], (),
     "the whole test set after every epoch instead of the 1,000-image monitor"),
    ("zero-init", [], (zero_init_residuals,), "zero-init of each residual block's last BatchNorm scale"),
    ("whitening", [], (whitening_stem,), "frozen whitening stem (3x3 patch eigenvectors)"),
    ("smoothing-0.2", ["--label-smoothing", "0.2"], (), "label smoothing 0.2 instead of 0.1"),
    ("alternating-flip", [], (alternating_flip,), "alternating flip instead of a coin per image per epoch"),
    ("ema", [], (ema_of_the_weights,), "EMA of the weights (decay 0.99 per step), scored instead of the last weights"),
    ("nesterov", ["--optimizer", "adamw", "--lr", "0.2"], (nesterov_sgd,),
     "Nesterov SGD (lr 0.2, momentum 0.9, wd 5e-4) for every weight instead of Muon or AdamW"),
    ("adamw", ["--optimizer", "adamw"], (), "AdamW for the filters too instead of Muon"),
    ("smoothing-0", ["--label-smoothing", "0"], (), "no label smoothing instead of 0.1"),
    ("epochs-5-batch-128", ["--epochs", "5", "--batch-size", "128", "--lr", "0.008"], (),
     "5 epochs of batch 128 at lr 0.008 (opt5's defaults before the recipe) instead of 20 of 512 at 0.016"),
    ("twenty-epochs", TWENTY_EPOCHS, (), "the recipe: 20 epochs of batch 512 at lr 0.016, 7, 7 and 6 of them at 16, "
                                         "24 and 32 px"),
    # the time rows: opt5's training, set up differently
    ("cudnn-benchmark-off", [], (cudnn_benchmark_off,), "cuDNN's autotuner off"),
    ("cudnn-benchmark-largest-size", [], (cudnn_benchmark_at_the_largest_size,),
     "cuDNN's autotuner on only at the full image size"),
    ("one-warmup-step", [], (one_warmup_step,), "1 warm-up step before each capture instead of 3"),
    ("muon-other-form", [], (batched_muon,), "Muon's update batched (foreach ops, 5 zero-padded batches) instead of "
                                             "a loop over filters"),
    # the work bundles: less work than the recipe, with tricks of airbench94 and airbench94_muon
    bundle("fifteen-epochs", FIFTEEN, (), "15 epochs: 8, 4 and 3 at 16, 24 and 32 px"),
    bundle("fifteen-epochs+lookahead", FIFTEEN, (lookahead,), "fifteen-epochs with lookahead every 5 steps"),
    bundle("fifteen-epochs+lookahead+zero-init+alternating-flip", FIFTEEN,
           (lookahead, zero_init_residuals, alternating_flip),
           "fifteen-epochs with lookahead, zero-init residual scales and alternating flips"),
    bundle("fifteen-epochs+whitening", FIFTEEN, (whitening_stem,), "fifteen-epochs with a frozen whitening stem"),
    bundle("fifteen-epochs+whitening-trained+lookahead", FIFTEEN, (TRAINED_WHITENING, lookahead),
           "fifteen-epochs with a whitening stem that trains on, and lookahead"),
    bundle("fifteen-epochs+batchnorm-biases", FIFTEEN, (batchnorm_biases_only,),
           "fifteen-epochs with BatchNorm without scales, its biases at 2x the rate without weight decay"),
    bundle("fifteen-epochs+all", FIFTEEN, ALL_TRICKS,
           "fifteen-epochs with lookahead, alternating flips, a trained whitening stem, BatchNorm biases only, label "
           "smoothing 0.2", SMOOTHING),
    bundle("fourteen-epochs+lookahead+alternating-flip", FOURTEEN, (lookahead, alternating_flip),
           "14 epochs (7, 4, 3 at 16, 24, 32 px) with lookahead and alternating flips"),
    bundle("sixteen-epochs-1024+lookahead+alternating-flip", SIXTEEN_1024, (lookahead, alternating_flip),
           "16 epochs of batch 1024 at lr 0.0226 (8, 4, 4 at 16, 24, 32 px) with lookahead and alternating flips"),
    bundle("sixteen-epochs-1024+all", SIXTEEN_1024, ALL_TRICKS,
           "sixteen-epochs-1024 with every trick of fifteen-epochs+all", SMOOTHING),
]
ROW_NAMES = [name for name, *_ in ROWS]
# What the one-call screen (screen.py) runs besides the recipe: time rows, then bundles
TIME_ROWS = ["cudnn-benchmark-off", "cudnn-benchmark-largest-size", "one-warmup-step", "muon-other-form"]
BUNDLE_ROWS = [name for name in ROW_NAMES if name.startswith(("fifteen", "fourteen", "sixteen"))]


# ----------------------------------------------------------------------------- the scoring

def shifted(images, rows, columns):
    """The images moved by `rows` and `columns` pixels (-1, 0 or 1), the uncovered edge filled by reflection."""
    padded = F.pad(images, (1, 1, 1, 1), mode="reflect")
    height, width = images.shape[-2:]
    return padded[..., 1 - rows:1 - rows + height, 1 - columns:1 - columns + width]


def modelled_h200_extra_view_seconds(images, batch_size, side=32):
    """The 4 views beyond opt5's 2 on an H200, modelled: two more calls of a batch of `batch_size` (half of them
    mirrors) per half-batch of `images`, each a third of a training step of that batch by accounting's step model (a
    forward pass is about a third of forward and backward; its fixed part too, not measured)."""
    calls = 2 * -(-images // max(1, batch_size // 2))
    fixed, per_pixel = accounting.h200_step_fit()
    return calls * (fixed + per_pixel * batch_size * side ** 2) / 3


def score(run, test_data):
    """Accuracy on `test_data` from 1, 2 and 6 views per image, and the seconds the 4 views beyond opt5's 2 took.

    Views come in pairs (an image and its mirror) in one call, as in opt5's evaluate, so its 2 views are opt5's own.
    """
    run.model.eval()
    all_images, all_labels = test_data
    batch_size = max(1, run.args.batch_size // 2)  # with their mirrors, a batch of --batch-size, as opt5's evaluate
    one_view, pairs, seconds = [], [], []  # per shift: the image's logits, and the mean of it and its mirror's
    with torch.inference_mode():
        for rows, columns in [(0, 0), (-1, -1), (1, 1)]:  # as is, one pixel up-left, one pixel down-right
            start, firsts, means = common.now(run.device), [], []
            for first in range(0, len(all_labels), batch_size):
                images = opt5.normalize(all_images[first:first + batch_size], run.statistics)
                count = len(images)
                images = torch.cat([images, images.new_zeros(batch_size - count, *images.shape[1:])])  # as opt5 pads
                images = shifted(images, rows, columns)
                images = torch.cat([images, images.flip(3)]).contiguous(memory_format=torch.channels_last)
                with torch.autocast(run.device.type, dtype=run.amp_dtype, enabled=run.amp_dtype != torch.float32):
                    outputs = run.model(images).view(2, batch_size, -1)[:, :count].float()
                firsts.append(outputs[0])
                means.append(outputs.mean(0))  # the mean in float32, as opt5 takes it
            one_view.append(torch.cat(firsts))
            pairs.append(torch.cat(means))
            seconds.append(common.now(run.device) - start)

    def accuracy(logits):
        return (logits.argmax(1) == all_labels).float().mean().item()
    return {"1_view": accuracy(one_view[0]), "2_views": accuracy(pairs[0]),
            "6_views": accuracy(torch.stack(pairs).mean(0)), "extra_view_seconds": sum(seconds[1:])}


# -------------------------------------------------------------------------------- the runs

def parse_args():
    """ablation.py's own flags, and the rest: opt5.py's flags, which opt5's parser checks here, before any row."""
    # allow_abbrev=False: opt5's --seed must reach opt5, not be read as an abbreviation of --seeds
    parser = common.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                   allow_abbrev=False)
    parser.add_argument("--rows", nargs="+", choices=ROW_NAMES, default=ROW_NAMES, metavar="ROW",
                        help=f"the rows to run, in this order, from: {' '.join(ROW_NAMES)} (default: all)")
    parser.add_argument("--json", metavar="PATH", default="lab/results/recipe.jsonl",
                        help="append one JSON line per row: opt5's report and the row's scores "
                             "(default: lab/results/recipe.jsonl, with the recipe's other runs)")
    parser.add_argument("--seeds", nargs="+", type=int, metavar="SEED",
                        help="run every row once per seed, the rows of a seed before the next seed's (default: "
                             "opt5's --seed alone)")
    parser.add_argument("--row", choices=ROW_NAMES, help=argparse.SUPPRESS)  # one row, in this process
    args, opt5_flags = parser.parse_known_args()
    check_opt5_flags_and_json(opt5_flags, args.json)
    return args, opt5_flags


def check_opt5_flags_and_json(opt5_flags, json_path):
    """Exit 2 with one line, before any run, on a flag opt5's parser refuses or a --json file that cannot be appended."""
    command_line = sys.argv
    sys.argv = ["opt5.py", *opt5_flags]
    try:
        opt5.parse_args()  # a bad flag exits 2 with opt5's one line
    finally:
        sys.argv = command_line
    try:
        Path(json_path).open("a").close()
    except OSError as error:
        common.fail(f"cannot append to --json {json_path} ({error.strerror}); give a path in a folder that exists")


@contextlib.contextmanager
def keep_last_evaluation(timer=None):
    """Within the `with` block, opt5.evaluate keeps its last call's run and test data in the list the block gets: after
    opt5.main(), those of the evaluation of the whole test set after the last epoch. With `timer` (a function of the
    run that starts a clock and returns the function that stops it), every call is timed and the list keeps, third,
    what the last call's stop returned (warm_clock.py's final evaluation). After the block, opt5's evaluate again."""
    evaluate, last_evaluation = opt5.evaluate, []

    def evaluate_and_keep(run, test_data, size):
        last_evaluation[:] = [run, test_data]  # the last call evaluates the whole test set after training
        if timer is None:
            return evaluate(run, test_data, size)
        stop = timer(run)
        figures = evaluate(run, test_data, size)
        last_evaluation.append(stop())
        return figures
    opt5.evaluate = evaluate_and_keep
    try:
        yield last_evaluation
    finally:
        opt5.evaluate = evaluate


def run_row(name, opt5_flags, json_path):
    """Apply the row's technique in this process, run opt5's main(), score the final weights, append one line."""
    commit = accounting.commit_at_start()
    _, row_flags, techniques, change = ROWS[ROW_NAMES.index(name)]
    for technique in techniques:
        technique(setattr)
    with keep_last_evaluation() as last_evaluation, tempfile.TemporaryDirectory() as folder:
        report_path = Path(folder) / "opt5.jsonl"
        sys.argv = [sys.argv[0], *opt5_flags, *row_flags, "--json", str(report_path)]  # the row's flags win
        opt5.main()
        report = accounting.add_provenance(accounting.add_work(json.loads(report_path.read_text())), commit)
    run, test_data = last_evaluation
    if hasattr(run, "average"):
        run.model.load_state_dict(run.average, strict=False)
    scores = score(run, test_data)
    with_extra_views = report["launch_to_result_seconds"] + scores["extra_view_seconds"]
    modelled_views = modelled_h200_extra_view_seconds(len(test_data[1]), run.args.batch_size)
    print(f"row {name}: test acc {100 * scores['1_view']:.2f}% from 1 view, {100 * scores['2_views']:.2f}% from 2, "
          f"{100 * scores['6_views']:.2f}% from 6 (+{scores['extra_view_seconds']:.0f} s) | "
          f"{report['launch_to_result_seconds']:.0f} s from launch to result", flush=True)
    line = {**report, "command": shlex.join(["python", "lab/ablation.py", "--rows", name, *opt5_flags]), "row": name,
            "change": change, **scores, "launch_to_result_6_views_seconds": with_extra_views,
            "modelled_h200_6_views_seconds": report["modelled_h200_seconds"] + modelled_views}
    with open(json_path, "a") as file:
        file.write(json.dumps(line) + "\n")


def main():
    args, opt5_flags = parse_args()
    if args.row is not None:
        return run_row(args.row, opt5_flags, args.json)
    # Each row in a fresh process, launched as this one was: python and any wrapper script before ablation.py
    launcher = [sys.executable, *sys.orig_argv[1:len(sys.orig_argv) - len(sys.argv)]]
    runs = [(name, [*opt5_flags, *(["--seed", str(seed)] if seed is not None else [])])
            for seed in args.seeds or [None] for name in args.rows]
    for number, (name, flags) in enumerate(runs, 1):
        print(f"\n== row {number}/{len(runs)}: {name}: {ROWS[ROW_NAMES.index(name)][3]}", flush=True)
        returncode = subprocess.run([*launcher, __file__, "--row", name, "--json", args.json, *flags]).returncode
        if returncode != 0:
            common.fail(f"row {name} ended with exit code {returncode}; the rows before it are in {args.json}",
                        code=returncode)
    print(f"\n{len(runs)} rows appended to {args.json}; `python lab/plot.py --tables` prints them as a table")


if __name__ == "__main__":
    main()
