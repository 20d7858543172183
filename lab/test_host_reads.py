"""No host read in the training loop from opt3 on: every tensor call that copies a value to the host, counted over an
epoch by instrumenting torch (slow: every op passes through Python twice), once per epoch, not per step."""

import pytest
import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset

import root  # noqa: F401  (first: the repository's root on sys.path, for the scripts and common.py)
import common  # noqa: E402
import opt4  # noqa: E402
from conftest import (  # noqa: E402
    ALL_SCRIPTS, CPU, CPU_AMP_DTYPE, NO_MONITOR, WHOLE_STEP, CountHostReads, CountScalarReads, call, shipped_optimizer,
    small_net)


def host_reads_in_one_epoch(script, images, amp_dtype=CPU_AMP_DTYPE, model=None):
    """The host reads of one `script` train_one_epoch over `images` synthetic images, in batches of 8, on the path a
    GPU takes (uncompiled, the optimizer as the script builds it), in `amp_dtype` (float16: with GradScaler on), of
    ResNet10 unless `model`: the tensor calls that read (CountHostReads) and how many scalars the dispatcher read
    (CountScalarReads)."""
    torch.manual_seed(0)
    model = model or common.ResNet10().to(memory_format=torch.channels_last)
    optimizer = shipped_optimizer(script, model, lr=1e-3, dtype=amp_dtype)
    # opt4 onwards read their schedule off a table on the device (assemble_the_step's)
    scheduler = None if script in WHOLE_STEP else torch.optim.lr_scheduler.OneCycleLR(optimizer, 1e-3, total_steps=100)
    dataset = common.synthetic_cifar10(images, train=True, transform=None)
    loader = DataLoader(as_tensor_dataset(dataset), batch_size=8)
    scaler = torch.amp.GradScaler("cpu", enabled=amp_dtype == torch.float16)
    with CountHostReads() as counter, CountScalarReads() as scalars:
        call(ALL_SCRIPTS[script].train_one_epoch, model=model, loader=loader,
             train_data=opt4.load_to_device(dataset, CPU), criterion=nn.CrossEntropyLoss(), optimizer=optimizer,
             scheduler=scheduler, scaler=scaler, amp_dtype=amp_dtype,
             accum_steps=1, keep_gradients=False, batch_size=8, generator=torch.Generator().manual_seed(0),
             augment_generator=torch.Generator().manual_seed(1), rank=0, world_size=1, device=CPU, epoch=1,
             monitor=NO_MONITOR, size=16)  # opt5 onwards: a 16x16 epoch, so downscaling is counted too
    return counter.reads, scalars.reads


def as_tensor_dataset(dataset):
    """The same images as float tensors in [0, 1], for the scripts that read a DataLoader."""
    return TensorDataset(torch.as_tensor(dataset.data).permute(0, 3, 1, 2).float() / 255,
                         torch.as_tensor(dataset.targets))


def test_the_host_read_counters_catch_baselines_reads_per_step():
    (many, many_scalars), (few, few_scalars) = host_reads_in_one_epoch("baseline.py", 32), \
        host_reads_in_one_epoch("baseline.py", 16)
    assert len(many) > len(few) >= 2 and many_scalars > few_scalars >= 2


# (tensor calls, scalars the dispatcher reads) at the end of an epoch: losses.tolist(), then .item() of the mean loss
# and of the correct count; opt6 reads its totals with one .tolist()
@pytest.mark.parametrize("script, end_of_epoch_reads", [("opt3.py", (3, 2)), ("opt4.py", (3, 2)), ("opt5.py", (3, 2)),
                                                        ("opt6.py", (2, 0))])
def test_opt3_on_read_from_the_device_once_per_epoch_not_per_step(script, end_of_epoch_reads):
    (two_steps, two_scalars), (four_steps, four_scalars) = host_reads_in_one_epoch(script, 16), \
        host_reads_in_one_epoch(script, 32)
    assert (len(two_steps), two_scalars) == (len(four_steps), four_scalars) == end_of_epoch_reads, \
        (two_steps, four_steps, two_scalars, four_scalars)


@pytest.mark.parametrize("script, captured", [("opt3.py", True), ("opt4.py", True), ("opt5.py", False),
                                              ("opt6.py", False)])
def test_in_float16_fused_adamw_takes_grad_scalers_flag_on_the_device_and_muon_has_it_read_on_the_host(script,
                                                                                                      captured):
    # GradScaler hands a fused optimizer the found-inf flag as a tensor; for any other (Muon) it reads the flag with
    # .item() before each step. capture_problem captures the first and not the second
    # small_net: float16 on a CPU is slow, and one filter is enough for Muon
    (two_steps, two_scalars), (four_steps, four_scalars) = host_reads_in_one_epoch(script, 16, torch.float16,
                                                                                    small_net()), \
        host_reads_in_one_epoch(script, 32, torch.float16, small_net())
    reads_per_step = (four_scalars - two_scalars) / 2
    assert reads_per_step == (0 if captured else 1) and (len(four_steps) - len(two_steps)) / 2 == reads_per_step
    if script in ("opt3.py", "opt4.py"):  # opt3: nothing captured yet; opt4: fused AdamW alone, always captured
        return
    optimizer = shipped_optimizer(script, small_net())
    why_not = ALL_SCRIPTS[script].capture_problem(torch.device("cuda"), torch.float16, optimizer,
                                                   *([1] if script == "opt6.py" else []))
    assert (why_not is None) == captured and (captured or "float16's GradScaler reads on the host" in why_not)
