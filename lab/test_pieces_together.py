"""The copy table's rows applied one after another to the client of test_pieces.py (a later row's version of an earlier
piece replacing it, as the row says); each block of the copy page run as a client file in a fresh process; and the
data-parallelism row's client under torchrun: two Gloo processes."""
import os
import re
import sys

import pytest
import torch
from PIL import Image
from torchvision import transforms

import root  # noqa: F401  (first: the repository's root on sys.path, for the scripts and common.py)
from conftest import finish, free_port, start  # noqa: E402
from test_pieces import (  # noqa: E402
    CAPTURED, PAGE, YOUR_SCRIPT, GridNet, SECOND_CLIENT_DEVICE, TutorialNet, block_source, capturable_adamw,
    captured_source, client_dataset, client_sgd, copy_page, learned, page_rows, row_source, sequence,
    step_epochs)


def page_client(optimization):
    """The client file of a block of the copy page: the stand-in script, then the block with its pieces pasted in."""
    return copy_page()[YOUR_SCRIPT] + "\n\n" + block_source(copy_page()[optimization])


def run_client(client_text, folder, returncode=0, env=None):
    """Run a client file in `folder` (its checkpoint's too), in a fresh process where no file of this repository can
    be imported; returns its stdout."""
    folder.mkdir(exist_ok=True)
    client = folder / "client.py"
    client.write_text(client_text)
    result = finish(start([sys.executable, str(client)], cwd=folder,
                          env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": "", **(env or {})}), timeout=300)
    assert result.returncode == returncode, result.stderr[-2000:]
    return result.stdout


def torchrun(client_text, folder, env=None, timeout=180):
    """Run a client file in `folder` under torchrun, two Gloo processes on a free port; returns the CompletedProcess."""
    client, port = folder / "client.py", free_port()
    client.write_text(client_text)
    environment = {name: value for name, value in os.environ.items() if name not in ("LOCAL_RANK", "RANK")}
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
               f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-backend=c10d", str(client)]
    env = {**environment, "OMP_NUM_THREADS": "1", "PYTHONPATH": "", "MASTER_PORT": str(port), **(env or {})}
    return finish(start(command, cwd=folder, env=env), timeout)


SINGLE_PROCESS_ROWS = [title for title in page_rows() if title != "data parallelism"]  # its launchers: below


@pytest.mark.parametrize("optimization", SINGLE_PROCESS_ROWS, ids=[name[:40] for name in SINGLE_PROCESS_ROWS])
def test_a_block_of_the_copy_page_runs_as_a_client_file_in_a_fresh_process_and_learns(optimization, tmp_path):
    # The file a client ends with: its script (the page's stand-in), then the block, its copy lines replaced by the
    # definitions they name; nothing else, run where no file of this repository can be imported
    output = run_client(page_client(optimization), tmp_path)
    losses = [float(loss) for loss in re.findall(r"epoch \d+: loss (\d+\.\d+)", output)]
    assert len(losses) == 4 and losses[-1] < 0.8 * losses[0], output
    accuracy = re.findall(r"test accuracy (\d\.\d+)", output)
    assert all(float(value) > 0.9 for value in accuracy), output  # 4 classes: chance is 0.25


@pytest.mark.parametrize("optimization", CAPTURED, ids=[name[:40] for name in CAPTURED])
def test_a_captured_step_block_runs_in_place_of_the_graph_rows_epochs_in_a_fresh_process_and_learns(optimization,
                                                                                                  tmp_path):
    # Your script, the graph row's block up to its epochs, then the row's lines for the captured step
    output = run_client(copy_page()[YOUR_SCRIPT] + "\n\n" + captured_source(optimization), tmp_path)
    losses = [float(loss) for loss in re.findall(r"epoch \d+: loss (\d+\.\d+)", output)]
    assert len(losses) == 4 and losses[-1] < 0.8 * losses[0], output


# Each client file of the page that trains in one process: your script's own train(), each row's block, each row's
# block for the captured step
RESUMED = {YOUR_SCRIPT: "train()\n", **{title: None for title in page_rows() if title not in (
    "`torch.compile`", "data parallelism")}, **{f"{title}, captured": title for title in CAPTURED}}


def resumable_client(name):
    """The client file of `name` (RESUMED's), which exits (code 3) after saving the checkpoint of the epoch that
    BREAK_AFTER names, and saves its final weights in final.pt."""
    if name == YOUR_SCRIPT:
        body = RESUMED[name]
    elif name.endswith(", captured"):
        body = captured_source(RESUMED[name])
    else:
        body = block_source(copy_page()[name])
    lines = []
    for line in (copy_page()[YOUR_SCRIPT] + "\n\n" + body).splitlines():
        lines.append(line)
        saved = re.match(r"( *)save_checkpoint\(epoch \+ 1\b", line)
        if saved:  # a crash right after the checkpoint
            lines.append(f'{saved[1]}if os.environ.get("BREAK_AFTER") == str(epoch + 1): sys.exit(3)')
    assert any("BREAK_AFTER" in line for line in lines), f"{name}: no checkpoint saved"
    return "import sys\n" + "\n".join(lines) + '\ntorch.save(model.state_dict(), "final.pt")\n'


@pytest.mark.parametrize("name", list(RESUMED), ids=[name[:30] + (", captured" if name.endswith("captured") else "")
                                                      for name in RESUMED])
def test_a_client_file_broken_after_an_epoch_and_resumed_ends_with_the_weights_of_the_unbroken_run(name, tmp_path):
    client, cpu = resumable_client(name), {"CUDA_VISIBLE_DEVICES": ""}  # bitwise on the CPU: the stand-in takes it
    run_client(client, tmp_path / "unbroken", env=cpu)
    broken = run_client(client, tmp_path / "resumed", returncode=3, env={**cpu, "BREAK_AFTER": "1"})
    resumed = run_client(client, tmp_path / "resumed", env=cpu)
    assert re.findall(r"^epoch (\d+):", broken, re.M) == ["1"], broken
    assert re.findall(r"^epoch (\d+):", resumed, re.M) == ["2", "3", "4"], resumed
    unbroken, after_resuming = (torch.load(tmp_path / folder / "final.pt") for folder in ("unbroken", "resumed"))
    assert list(unbroken) == list(after_resuming)
    assert all(torch.equal(unbroken[key], after_resuming[key]) for key in unbroken), [
        key for key in unbroken if not torch.equal(unbroken[key], after_resuming[key])]


COUNT_GRAPHS = """
from torch._dynamo.utils import counters
print(f"graphs compiled: {counters['stats']['unique_graphs']}")
"""


@pytest.mark.parametrize("drop_last", [True, False])
def test_the_compile_blocks_client_compiles_the_graphs_the_page_names(drop_last, tmp_path):
    # 500 training images, batches of 32: a smaller last batch, which the block drops. The page names two graphs, the
    # training batches' and the evaluation's (no_grad); the last batch kept would be a third
    script = copy_page()[YOUR_SCRIPT].replace("Images(512, seed=0", "Images(500, seed=0")
    block = block_source(copy_page()["`torch.compile`"])
    assert block.count("drop_last=True") == 1 and "Your script meets two compiles" in PAGE.read_text()
    block = block if drop_last else block.replace("drop_last=True", "drop_last=False")
    output = run_client(script + "\n\n" + block + COUNT_GRAPHS, tmp_path)
    assert f"graphs compiled: {2 if drop_last else 3}" in output, output


MUON = "Muon for the convolution filters, at its own rate"
FINAL_TEST_LOSS = """
model.eval()
with torch.no_grad():
    test_loss = sum(criterion(model(images.to(device)), labels.to(device)).item() * len(labels)
                    for images, labels in test_loader) / len(test_set)
print(f"final test loss {test_loss:.4f}, test accuracy {test_accuracy():.3f}")
"""


def sgd_at_0_1(script, seed, with_batchnorm=False, epochs=8, batch_size=32, train_size=512):
    """The page's stand-in with its SGD at 0.1 (momentum 0.9, Nesterov), seeded `seed`; with `with_batchnorm`, a
    BatchNorm after each convolution, as the CIFAR scripts that run SGD at 0.1 have."""
    replacements = {"lr=0.01": "lr=0.1", "torch.manual_seed(0)": f"torch.manual_seed({seed})",
                    "epochs, batch_size = 4, 32": f"epochs, batch_size = {epochs}, {batch_size}",
                    "Images(512, seed=0": f"Images({train_size}, seed=0"}
    if with_batchnorm:
        replacements.update({"nn.Conv2d(3, 6, 5), nn.ReLU()": "nn.Conv2d(3, 6, 5), nn.BatchNorm2d(6), nn.ReLU()",
                             "nn.Conv2d(6, 16, 5), nn.ReLU()": "nn.Conv2d(6, 16, 5), nn.BatchNorm2d(16), nn.ReLU()"})
    for old, new in replacements.items():
        assert script.count(old) == 1, old
        script = script.replace(old, new)
    return script


def final_test_loss(client_text, tmp_path):
    output = run_client(client_text + FINAL_TEST_LOSS, tmp_path / f"run{len(list(tmp_path.iterdir()))}")
    loss, accuracy = re.search(r"final test loss (\S+), test accuracy (\S+)", output).groups()
    return float(loss), float(accuracy)


def muon_block(muon_rate=None):
    """The Muon block, beside the client's SGD at the client's 0.1; Muon at its own rate, or at `muon_rate`."""
    block = copy_page()[MUON]
    assert block.count("lr=0.01") == 1 and block.count("Muon(filters, lr=0.008") == 1
    block = block.replace("lr=0.01", "lr=0.1")
    return block_source(block if muon_rate is None else block.replace("lr=0.008", f"lr={muon_rate}"))


def test_muon_at_its_own_rate_beside_a_clients_sgd_at_0_1_ends_no_worse_than_that_sgd_alone(tmp_path):
    # The stand-in as a client at 0.1 runs: BatchNorm, batch 128, 2,048 images, 8 epochs (64 steps; in 4 epochs of 32
    # images a step, SGD alone ended at 50 % in one seed of two). SGD alone, its own train(), against the Muon block
    def client(seed):
        return sgd_at_0_1(copy_page()[YOUR_SCRIPT], seed, with_batchnorm=True, batch_size=128, train_size=2048)
    sgd = [final_test_loss(client(seed) + "\ntrain()\n", tmp_path) for seed in (0, 1)]
    muon = [final_test_loss(client(seed) + "\n" + muon_block(), tmp_path) for seed in (0, 1)]
    assert min(accuracy for _, accuracy in sgd) > 0.9, f"SGD alone well above chance (0.25): {sgd}"
    (sgd_0, _), (sgd_1, _), (muon_0, _), (muon_1, _) = *sgd, *muon
    spread = max(abs(sgd_0 - sgd_1), abs(muon_0 - muon_1))
    assert (muon_0 + muon_1) / 2 <= (sgd_0 + sgd_1) / 2 + spread, (sgd, muon)


def test_beside_sgd_at_0_1_muon_at_its_own_rate_learns_where_muon_at_the_sgds_rate_does_not(tmp_path):
    # The stand-in as it stands (no BatchNorm) with its SGD at 0.1: Muon at the SGD's rate, as the block once had it,
    # ends near chance; at its own rate it learns (the SGD alone, without Muon for the filters, collapses here)
    own, at_sgds = (final_test_loss(sgd_at_0_1(copy_page()[YOUR_SCRIPT], 0) + "\n" + muon_block(rate), tmp_path)
                    for rate in (None, 0.1))
    assert own[1] > 0.9 and at_sgds[1] < 0.75 and own[0] < at_sgds[0], (own, at_sgds)


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


@pytest.mark.parametrize("launcher", ["torchrun", "spawn"])
def test_the_data_parallel_blocks_client_trains_two_ranks_to_equal_weights_under_torchrun_and_under_spawn(
        launcher, tmp_path):
    # Two Gloo processes, each on its share of the same global batches: DDP's averaged gradients leave both ranks with
    # the same model; torchrun's environment, or none (spawn: the client starts the group; no LOCAL_RANK)
    if launcher == "torchrun":
        result = torchrun(page_client("data parallelism"), tmp_path)
    else:
        client = tmp_path / "client.py"
        client.write_text(page_client("data parallelism"))
        environment = {name: value for name, value in os.environ.items() if name not in ("LOCAL_RANK", "RANK")}
        result = finish(start([sys.executable, str(client)], cwd=tmp_path, env={
            **environment, "OMP_NUM_THREADS": "1", "PYTHONPATH": "", "MASTER_PORT": str(free_port())}), timeout=180)
    assert result.returncode == 0, result.stderr[-2000:]
    checksums = dict(re.findall(r"rank (\d): weights' checksum (\S+)", result.stdout))
    assert sorted(checksums) == ["0", "1"] and checksums["0"] == checksums["1"], result.stdout
    losses = [float(loss) for loss in re.findall(r"epoch \d+: loss (\d+\.\d+)", result.stdout)]
    assert len(losses) == 4 and losses[-1] < 0.8 * losses[0], result.stdout  # one log: rank 0's
    assert (tmp_path / "model.pt").is_file()


def test_a_two_rank_runs_checkpoint_resumes_in_one_process(tmp_path):
    # The data-parallel block's client under torchrun, broken after epoch 2 (rank 0 exits after its checkpoint; torchrun
    # ends rank 1); then your script alone, in one process, resumes from rank 0's checkpoint: the weights load by the
    # model's names, no "module." before them, and the last two epochs train
    result = torchrun(resumable_client("data parallelism"), tmp_path, env={"BREAK_AFTER": "2"}, timeout=300)
    assert result.returncode != 0 and re.findall(r"^epoch (\d+):", result.stdout, re.M) == ["1", "2"], result.stdout
    checkpoint = torch.load(tmp_path / "checkpoint.pt")
    assert checkpoint["epoch"] == 2 and not any(name.startswith("module.") for name in checkpoint["model"])
    resuming = '\ntrain()\nprint(f"test accuracy {test_accuracy():.3f}")\n'
    output = run_client(copy_page()[YOUR_SCRIPT] + resuming, tmp_path)
    assert re.findall(r"^epoch (\d+):", output, re.M) == ["3", "4"], output
    first_loss, resumed_loss = (float(re.search(r"^epoch \d+: loss (\S+)", run, re.M)[1])
                                for run in (result.stdout, output))
    assert resumed_loss < first_loss, "from the trained weights, not from the start"
    assert float(re.search(r"test accuracy (\S+)", output)[1]) > 0.5, output  # 4 classes: chance is 0.25


# A client of torch.multiprocessing.spawn: it starts the process group itself; each rank's BatchNorm sees other data
SPAWN_BATCHNORM = """
import torch.nn as nn


def spawned(rank, world_size, path):
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    rank, world_size, _ = setup_distributed("cpu")
    with rank_zero_first(world_size):
        torch.manual_seed(rank)
        images = torch.randn(16, 3, 8, 8) * (1 + rank) + rank  # each rank its own data: its own statistics
    norm = nn.BatchNorm2d(3)
    norm(images)
    before = [buffer.clone() for buffer in norm.buffers()]
    average_batchnorm_buffers(norm, world_size)
    torch.save({"world_size": world_size, "before": before, "after": list(norm.buffers())}, path + str(rank))
    leave_process_group()


if __name__ == "__main__":
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    torch.multiprocessing.spawn(spawned, args=(2, sys.argv[1]), nprocs=2)
"""


def test_under_spawn_the_ranks_batchnorm_buffers_are_averaged_across_the_process_group(tmp_path):
    client = tmp_path / "client_spawn.py"
    client.write_text(row_source("data parallelism") + SPAWN_BATCHNORM)
    result = finish(start([sys.executable, str(client), str(tmp_path / "rank")], cwd=None,
                          env={**os.environ, "OMP_NUM_THREADS": "1", "MASTER_PORT": str(free_port())}), timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    ranks = [torch.load(tmp_path / f"rank{rank}") for rank in (0, 1)]
    assert [rank["world_size"] for rank in ranks] == [2, 2], "the process group's size, not torchrun's (unset)"
    for index, name in enumerate(("running_mean", "running_var")):
        before = [rank["before"][index] for rank in ranks]
        assert not torch.allclose(before[0], before[1]), f"{name}: the ranks' own statistics must differ"
        assert all(torch.allclose(rank["after"][index], (before[0] + before[1]) / 2) for rank in ranks), name
    assert all(torch.equal(rank["after"][2], rank["before"][2]) for rank in ranks), "num_batches_tracked kept"
