"""CIFAR-10's two sets loaded as the scripts load them (common.cifar10 reads the pickled batches itself) against
torchvision's constructor, which md5s all six files for each set at every load. With a copy whose bytes are not the
official ones (as here) torchvision's check would fail: each md5 is computed, then taken as a pass.

    python lab/data_load.py DATA_DIR
"""
import sys
import time

import torch  # noqa: F401  (imported first, as by every script)

import root  # noqa: F401  (first: the repository's root on sys.path, for the scripts and common.py)
import common  # noqa: E402

start = time.perf_counter()
import torchvision  # noqa: E402
import_seconds = time.perf_counter() - start
from torchvision.datasets import cifar, utils  # noqa: E402


def md5_then_pass(path, md5=None):
    utils.calculate_md5(path)
    return True


cifar.check_integrity = md5_then_pass
data_dir = sys.argv[1] if len(sys.argv) == 2 else sys.exit("usage: data_load.py DATA_DIR")
print(f"torch {torch.__version__}, torchvision {torchvision.__version__}; import torchvision after torch: "
      f"{import_seconds:.2f} s")
for _ in range(3):
    start = time.perf_counter()
    sets = torchvision.datasets.CIFAR10(data_dir, train=True), torchvision.datasets.CIFAR10(data_dir, train=False)
    theirs = time.perf_counter() - start
    start = time.perf_counter()
    ours_sets = common.cifar10(data_dir, True, None), common.cifar10(data_dir, False, None)
    ours = time.perf_counter() - start
    # the images each read: the same count from both, or the two timings are not of the same work
    counts = " + ".join(f"{len(a):,}" if len(a) == len(b) else f"{len(a):,} (common.cifar10: {len(b):,})"
                        for a, b in zip(sets, ours_sets))
    print(f"both sets ({counts} images): torchvision's constructor {theirs:.2f} s, common.cifar10 {ours:.2f} s")
