"""What opt5's evaluations cost a CPU, compiled (as opt5 did up to 33dad5d) or eager (as since): those of its 20-epoch
recipe, a 1,000-image test subset after epochs 1-19 at their sizes (16 px x7, 24 px x7, 32 px x5), then all
10,000 test images at 32 px, on a random ResNet10 and random images (the work does not depend on the values).

  compiled  the model compiled with dynamic=False, each last batch padded to a full one (one graph per size); opt5's
            evaluate without the stance that keeps it eager (its __wrapped__ function)
  eager     opt5's evaluate as it is: the model uncompiled, the last batch unpadded

One small compile runs first in both, as opt5's step compiles before any evaluation (inductor's start-up). Run each
mode in its own process with an empty inductor cache, as a first run meets it:
    TORCHINDUCTOR_CACHE_DIR=$(mktemp -d) python lab/evaluations.py compiled

Its flags shrink the sets and the batch for a quick check (a test runs eager at 16 and 40 images, batch 32).
"""
import argparse
import time
from types import SimpleNamespace

import torch

import root  # noqa: F401  (first: the repository's root on sys.path, for the scripts and common.py)
import common  # noqa: E402
import opt5  # noqa: E402

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("mode", choices=("compiled", "eager"), help="the model compiled, or opt5's evaluate as it is")
parser.add_argument("--monitor-size", type=common.positive_int, default=1000,
                    help="test images each evaluation of epochs 1-19 scores, opt5's default (default: 1000)")
parser.add_argument("--test-size", type=common.positive_int, default=10000,
                    help="test images the last evaluation scores, CIFAR-10's test set (default: 10000)")
parser.add_argument("--batch-size", type=common.positive_int, default=512,
                    help="opt5's --batch-size; its evaluate takes half that and each mirror (default: 512)")
args = parser.parse_args()
mode = args.mode
torch.manual_seed(0)
device, batch_size = torch.device("cpu"), args.batch_size
amp_dtype, _ = opt5.autocast_dtype(device)
model = common.ResNet10().to(device, memory_format=torch.channels_last)
if mode == "compiled":
    model.compile(dynamic=False)
statistics = common.cifar10_statistics(device)  # opt5's
run = SimpleNamespace(args=SimpleNamespace(batch_size=batch_size), model=model, device=device, amp_dtype=amp_dtype,
                      statistics=statistics)
torch.compile(lambda x: (x.relu() + 1).sum())(torch.randn(64))


def padded(count):
    """`count` random test images and labels, padded with blank ones to whole batches where compiled."""
    total = -(-count // batch_size) * batch_size if mode == "compiled" else count
    images = torch.zeros(total, 3, 32, 32, dtype=torch.uint8)
    images[:count] = torch.randint(0, 256, (count, 3, 32, 32), dtype=torch.uint8)
    return images, torch.randint(0, 10, (total,))


monitor, test = padded(args.monitor_size), padded(args.test_size)
print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {amp_dtype}, {mode}")
total = 0.0
for epoch, size in enumerate(opt5.image_sizes(20, 16, 32, full_share=0.3), 1):
    data = test if epoch == 20 else monitor
    start = time.perf_counter()
    (opt5.evaluate.__wrapped__ if mode == "compiled" else opt5.evaluate)(run, data, size)
    seconds = time.perf_counter() - start
    total += seconds
    print(f"{mode}: epoch {epoch:2d}, {size} px, {len(data[1]):,} images: {seconds:6.2f} s", flush=True)
print(f"{mode}: the 20 evaluations: {total:.1f} s")
