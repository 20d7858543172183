"""What --compile buys opt4 on this CPU: its training step and its evaluation with the model compiled or not, timed in
one process, in alternating blocks (so whatever else the machine does falls on both alike), and what compiling costs
the first time (run it with an empty inductor cache, as a first run meets it):

    TORCHINDUCTOR_CACHE_DIR=$(mktemp -d) python lab/compile_cpu.py

Random images and a random ResNet10 at opt4's defaults (batch 128, bfloat16 where the CPU has a unit for it): the work
does not depend on the values. The last line projects opt4's default run (--epochs 5: 1,950 steps, 5 evaluations of
the 10,000 test images) both ways. Its flags shrink it for a quick check (a test runs it at batch 8); at another
--batch-size the projection is of opt4 --epochs 5 at that batch size.
"""
import argparse
import statistics
import time
from types import SimpleNamespace

import torch
import torch.nn as nn

import root  # noqa: F401  (first: the repository's root on sys.path, for the scripts and common.py)
import common  # noqa: E402
import opt4  # noqa: E402


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add = parser.add_argument
    add("--batch-size", type=common.positive_int, default=128, help="images a step, opt4's default (default: 128)")
    add("--steps-per-block", type=common.positive_int, default=8,
        help="training steps in each timed block, one epoch of as many batches (default: 8)")
    add("--blocks", type=common.positive_int, default=6,
        help="timed blocks each way after the first, whose median is the steady figure (default: 6)")
    add("--evaluated", type=common.positive_int, default=2000,
        help="random test images each timed evaluation scores (default: 2000)")
    return parser.parse_args()


args = parse_args()
BLOCKS, STEPS_PER_BLOCK, EVALUATED = args.blocks, args.steps_per_block, args.evaluated
device, batch_size = torch.device("cpu"), args.batch_size
amp_dtype, _ = opt4.autocast_dtype(device)
images = torch.randint(0, 256, (STEPS_PER_BLOCK * batch_size, 3, 32, 32), dtype=torch.uint8)
labels = torch.randint(0, 10, (len(images),))
test_data = (torch.randint(0, 256, (EVALUATED, 3, 32, 32), dtype=torch.uint8), torch.randint(0, 10, (EVALUATED,)))


def build(compiled):
    """opt4's run as its main() builds it, the model compiled or not, and its training step."""
    torch.manual_seed(0)
    model = common.ResNet10().to(device, memory_format=torch.channels_last)
    if compiled:
        model.compile()
    args = SimpleNamespace(batch_size=batch_size, accum_steps=1)
    statistics = common.cifar10_statistics(device)  # opt4's
    optimizers = [opt4.adamw(model.parameters(), 8e-3, device)]
    run = SimpleNamespace(args=args, device=device, amp_dtype=amp_dtype, model=model, optimizers=optimizers,
                          generator=torch.Generator().manual_seed(0), statistics=statistics,
                          schedule=opt4.onecycle_schedule(8e-3, 1000 * STEPS_PER_BLOCK, device),
                          plan=opt4.empty_plan((images, labels), statistics, common.CROP_PADDING, STEPS_PER_BLOCK,
                                               batch_size))
    criterion = nn.CrossEntropyLoss(label_smoothing=0.1)
    return run, opt4.make_train_step(model, criterion, optimizers, run.plan, amp_dtype)


def timed(function):
    start = time.perf_counter()
    function()
    return time.perf_counter() - start


def block(run, step, epoch):
    """One epoch of STEPS_PER_BLOCK steps, as train_one_epoch runs them (the plan drawn first)."""
    run.model.train()
    draw = opt4.draw_epoch(len(images), batch_size, common.CROP_PADDING, run.generator)
    opt4.plan_epoch(run.plan, draw, run.schedule[(epoch - 1) * STEPS_PER_BLOCK:epoch * STEPS_PER_BLOCK])
    for _ in range(STEPS_PER_BLOCK):
        step()


print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {amp_dtype} (bfloat16 unit: "
      f"{common.bfloat16_unit()})")
runs = {"eager": build(False), "compiled": build(True)}
first = {mode: timed(lambda: block(*runs[mode], 1)) for mode in runs}  # compiling happens here
first_evaluation = {mode: timed(lambda: opt4.evaluate(runs[mode][0], test_data)) for mode in runs}
step_ms, evaluation_s = {mode: [] for mode in runs}, {mode: [] for mode in runs}
for epoch in range(2, BLOCKS + 2):
    for mode in (runs if epoch % 2 else reversed(runs)):  # alternating which goes first
        step_ms[mode].append(1000 * timed(lambda: block(*runs[mode], epoch)) / STEPS_PER_BLOCK)
        evaluation_s[mode].append(timed(lambda: opt4.evaluate(runs[mode][0], test_data)))
for mode in runs:
    print(f"{mode}: step {statistics.median(step_ms[mode]):.0f} ms (median of {BLOCKS} blocks of {STEPS_PER_BLOCK}: "
          f"{', '.join(f'{ms:.0f}' for ms in step_ms[mode])}); evaluation of {EVALUATED:,} images "
          f"{statistics.median(evaluation_s[mode]):.2f} s; first block {first[mode]:.1f} s, first evaluation "
          f"{first_evaluation[mode]:.1f} s")
# opt4's default run, --epochs 5 (1,950 steps at batch 128), or that run at the --batch-size given
projected, run_steps = {}, 5 * (common.CIFAR10_TRAIN_SIZE // batch_size)
projected_run = "opt4 --epochs 5" + ("" if batch_size == 128 else f" --batch-size {batch_size}")
for mode in runs:
    steady_block = statistics.median(step_ms[mode]) * STEPS_PER_BLOCK / 1000
    steady_evaluation = statistics.median(evaluation_s[mode])
    compiling = first[mode] - steady_block + first_evaluation[mode] - steady_evaluation
    projected[mode] = (run_steps * statistics.median(step_ms[mode]) / 1000
                       + 5 * steady_evaluation * common.CIFAR10_TEST_SIZE / EVALUATED + compiling)
    print(f"{mode}: compiling and warm-up {compiling:.1f} s; {projected_run} projected: {projected[mode]:.0f} s of "
          f"steps, evaluations and compiling")
step_ratio = statistics.median(step_ms['compiled']) / statistics.median(step_ms['eager'])
print(f"compiled / eager, ms a step: {step_ratio:.3f}; projected run: {projected['compiled'] / projected['eager']:.3f}")
