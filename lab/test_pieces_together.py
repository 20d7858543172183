"""The copy table's rows applied one after another to the client of test_pieces.py (a later row's version of an earlier
piece replacing it, as the row says); each block of the copy page run as a client file in a fresh process; and the
data-parallelism row's client under torchrun: two Gloo processes."""
import os
import re
import subprocess
import sys
import time

import pytest
import torch
import torch.nn as nn
from PIL import Image
from torchvision import transforms

import root  # noqa: F401  (first: the repository's root on sys.path, for the scripts and common.py)
from test_pieces import (  # noqa: E402
    YOUR_SCRIPT, GridNet, SECOND_CLIENT_DEVICE, TutorialNet, block_source, capturable_adamw, client_dataset,
    client_sgd, copy_page, free_port, learned, page_rows, row_source, sequence, step_epochs)


@pytest.mark.parametrize("optimization", page_rows(), ids=[name[:40] for name in page_rows()])
def test_a_block_of_the_copy_page_runs_as_a_client_file_in_a_fresh_process_and_learns(optimization, tmp_path):
    # The file a client ends with: its script (the page's stand-in), then the block, its copy lines replaced by the
    # definitions they name; nothing else, run where no file of this repository can be imported
    client = tmp_path / "client.py"
    client.write_text(copy_page()[YOUR_SCRIPT] + "\n\n" + block_source(copy_page()[optimization]))
    result = subprocess.run([sys.executable, str(client)], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                            env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ""})
    assert result.returncode == 0, result.stderr[-2000:]
    losses = [float(loss) for loss in re.findall(r"epoch \d+: loss (\d+\.\d+)", result.stdout)]
    assert len(losses) == 4 and losses[-1] < 0.8 * losses[0], result.stdout
    accuracy = re.findall(r"test accuracy (\d\.\d+)", result.stdout)
    assert all(float(value) > 0.9 for value in accuracy), result.stdout  # 4 classes: chance is 0.25


def test_the_rows_in_the_pages_order_train_the_second_client_its_sgd_beside_muon_and_score_its_test_images():
    # The second client (a string device, a 5 x 5-grid head, its SGD kept as the graph row asks) through the page's
    # rows in order: autocast, the data on the device, the captured step, resizing, Muon, the recipe's rate table
    pieces = sequence()
    model = GridNet()
    filters = [parameter for parameter in model.parameters() if parameter.ndim == 4]
    others = [parameter for parameter in model.parameters() if parameter.ndim != 4]
    sgd = client_sgd(others, device=SECOND_CLIENT_DEVICE)
    sgd.param_groups[0]["lr_scale"] = 10  # the client's SGD at 10x the plan's rates, Muon at them
    muon = pieces.Muon(filters, torch.tensor(0.01))
    losses, plan = step_epochs(pieces, model, [muon, sgd], device=SECOND_CLIENT_DEVICE, sizes=pieces.image_sizes(4))
    assert learned(losses), losses
    last_rate = plan.rates[-1].item()
    assert (muon.param_groups[0]["lr"].item(), sgd.param_groups[0]["lr"].item()) == (
        pytest.approx(last_rate), pytest.approx(10 * last_rate))
    # its test images as the data row says (the training statistics), each with its mirror (the recipe's two views),
    # against its own test transform (the tutorial's normalization), which the data row replaces
    test_set = client_dataset(64, seed=1)
    images, labels = pieces.load_to_device(test_set, SECOND_CLIENT_DEVICE)
    own = transforms.Compose([transforms.ToTensor(), transforms.Normalize((0.5, 0.5, 0.5), (0.5, 0.5, 0.5))])
    own_images = torch.stack([own(Image.fromarray(image)) for image in test_set.data])
    model.eval()
    with torch.no_grad():
        inputs = pieces.normalize(images, plan.statistics)
        row_way = ((model(inputs) + model(inputs.flip(3))).argmax(1) == labels).float().mean().item()
        own_way = (model(own_images).argmax(1) == labels).float().mean().item()
    assert row_way > 0.9 and own_way < row_way - 0.3, (row_way, own_way)


def test_the_rows_applied_one_after_another_train_the_client():
    pieces = sequence()
    model = TutorialNet(global_pooling=True)
    filters = [parameter for parameter in model.parameters() if parameter.ndim == 4]
    others = [parameter for parameter in model.parameters() if parameter.ndim != 4]
    optimizers = [pieces.Muon(filters, torch.tensor(0.01)), capturable_adamw(others)]
    before = [weight.detach().clone() for weight in filters]
    losses, _ = step_epochs(pieces, model, optimizers, sizes=pieces.image_sizes(4))
    assert learned(losses), losses
    assert all(not torch.equal(weight, old) for weight, old in zip(filters, before)), "every filter moved"


# The client's own data-parallel training, after the row's pieces: a tiny net, its data made alike on every rank
DDP_CLIENT = """
import torch.nn as nn
import torch.nn.functional as F


def main():
    world_size = int(os.environ["WORLD_SIZE"]) if started_by_torchrun() else 1
    rank, world_size, device = setup_distributed(torch.device("cpu"))
    point_to_torchrun(device, world_size)
    with rank_zero_first(world_size):  # the client's download, one machine at a time
        generator = torch.Generator().manual_seed(0)
        labels = torch.randint(0, 4, (64,), generator=generator)
        images = torch.rand(64, 3, 8, 8, generator=generator) + labels.view(-1, 1, 1, 1)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                          nn.Linear(8, 4))
    ddp = DistributedDataParallel(model, gradient_as_bucket_view=True, **{broadcast_buffers_keyword(): False})
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    for epoch in range(3):
        batches = torch.randperm(64, generator=generator).view(4, 16)  # the same global batches on every rank
        draw = (batches, torch.zeros(4, 2, 16, 1), torch.zeros(4, 16, 1, dtype=torch.bool))
        for indices in rank_share(draw, rank, 16 // world_size)[0]:
            F.cross_entropy(ddp(images[indices]), labels[indices]).backward()
            optimizer.step()
            optimizer.zero_grad()
        average_batchnorm_buffers(model, world_size)
    torch.save(model.state_dict(), sys.argv[1] + str(rank))
    if world_size > 1:
        leave_process_group()


main()
"""


def test_the_data_parallel_row_copied_into_a_client_file_trains_two_ranks_to_equal_weights(tmp_path):
    # torchrun's two processes, Gloo between them, each on its share of the same global batches: DDP's averaged
    # gradients and the averaged BatchNorm statistics leave both ranks with the same model
    client = tmp_path / "client_ddp.py"
    client.write_text(row_source("data parallelism") + DDP_CLIENT)
    port = free_port()
    started = time.monotonic()
    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
                             f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-backend=c10d", str(client),
                             str(tmp_path / "rank")], capture_output=True, text=True, timeout=120,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    seconds = time.monotonic() - started
    assert result.returncode == 0, result.stderr[-2000:]
    ranks = [torch.load(tmp_path / f"rank{rank}") for rank in (0, 1)]
    assert ranks[0].keys() == ranks[1].keys()
    assert all(torch.equal(ranks[0][name], ranks[1][name]) for name in ranks[0]), "the ranks' weights differ"
    assert not torch.equal(ranks[0]["0.weight"], (torch.manual_seed(0), nn.Conv2d(3, 8, 3))[1].weight), "it trained"
    assert seconds <= 30, f"{seconds:.0f} s"
