"""How many graphs torch.compile makes of ResNet10 trained at opt5's image sizes, with dynamic=False (opt5's choice)
and dynamic=True (symbolic sizes): the graphs Dynamo traced, and those AOTAutograd compiled for inductor.

    python lab/compile_sizes.py                      # ResNet10, batch 8, sizes 16 24 32, both settings
    python lab/compile_sizes.py --sizes 16 24 --batch-size 2

Each setting in its own process with an empty inductor cache, so a cached graph counts as compiled.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

import torch

import root  # noqa: F401  (first: the repository's root on sys.path, for the scripts and common.py)
import common  # noqa: E402


def count_graphs(dynamic, sizes, batch_size):
    """Train ResNet10 a step at each size under model.compile(dynamic=dynamic): the graphs Dynamo traced, and those
    AOTAutograd compiled (each a forward and its backward) for inductor."""
    from torch._dynamo.utils import counters
    model = common.ResNet10().to(memory_format=torch.channels_last)
    model.compile(dynamic=dynamic)
    for size in sizes:
        images = torch.rand(batch_size, 3, size, size).contiguous(memory_format=torch.channels_last)
        model(images).sum().backward()
    return {"dynamic": dynamic, "sizes": sizes, "dynamo_graphs": counters["stats"]["unique_graphs"],
            "compiled_graphs": counters["aot_autograd"]["total"],
            "torch": torch.__version__}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[16, 24, 32], help="image sides (default: 16 24 32)")
    parser.add_argument("--batch-size", type=int, default=8, help="images a step (default: 8)")
    parser.add_argument("--setting", choices=["false", "true"], help=argparse.SUPPRESS)  # one setting, in a child
    args = parser.parse_args()
    if args.setting:
        print(json.dumps(count_graphs(args.setting == "true", args.sizes, args.batch_size)))
        return
    for setting in ("false", "true"):
        with tempfile.TemporaryDirectory() as cache:
            command = [sys.executable, __file__, "--setting", setting, "--batch-size", str(args.batch_size),
                       "--sizes", *map(str, args.sizes)]
            child = subprocess.run(command, capture_output=True, text=True,
                                   env={**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache})
        if child.returncode != 0:
            common.fail(f"the dynamic={setting.title()} run failed: {child.stderr.strip().splitlines()[-1]}")
        print(child.stdout.strip().splitlines()[-1])


if __name__ == "__main__":
    main()
