"""opt6 under torchrun at length: two nodes on one machine, accumulation under DDP, disjoint shares, the barrier's
handle, the data's turn, a failing rank: several Gloo processes each, so in the lab's tier."""
import collections
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import root  # noqa: F401  (first: the repository's root on sys.path, for the scripts and common.py)
import common  # noqa: E402
import opt4  # noqa: E402
import opt6  # noqa: E402
from conftest import (  # noqa: E402
    CHECKSUM_RANK, CPU, DDP_ARGS, NO_NETWORK, PRINT_WEIGHTS_CHECKSUM, ROOT, SMALL, TORCHRUN, WEIGHTS_CHECKSUM,
    bn_free_net, call, checksums, finish, free_port, image_hash, read_json, run_python, start, stop)


def run_two_nodes(script, processes_per_node, *args, timeout=300):
    """Two torchrun 'nodes' on this machine, as opt6's docstring starts them; returns both CompletedProcesses."""
    port, env = free_port(), {**os.environ, **NO_NETWORK}
    nodes = [start([sys.executable, "-m", "torch.distributed.run", "--nnodes=2", f"--node_rank={node}",
                    f"--nproc_per_node={processes_per_node}", f"--rdzv-endpoint=127.0.0.1:{port}",
                    *map(str, [script, *args])], cwd=ROOT, env=env) for node in (0, 1)]
    try:
        return [finish(node, timeout) for node in nodes]
    finally:
        for node in nodes:
            if node.poll() is None:  # the other node, where one timed out
                stop(node)


DATA_TURN = """
import json, os, sys, time
sys.path.insert(0, {root!r})
import torch.distributed as dist
import opt6

dist.init_process_group("gloo")
with opt6.rank_zero_first(dist.get_world_size()):
    start = time.time()
    time.sleep(0.5)  # a download
    end = time.time()
with open({out!r} + os.environ["RANK"], "w") as file:
    json.dump([start, end], file)
dist.destroy_process_group()
"""


def test_opt6_data_on_two_nodes_rank_0_first_then_the_other_nodes_first_process_then_the_rest(tmp_path):
    script = tmp_path / "data_turn.py"
    script.write_text(DATA_TURN.format(root=str(ROOT), out=str(tmp_path / "rank")))
    for node in run_two_nodes(script, processes_per_node=2):
        assert node.returncode == 0, node.stderr
    # Node 0 runs ranks 0 and 1, node 1 ranks 2 and 3; each node's first process is its local rank 0.
    (start_0, end_0), (start_1, end_1), (start_2, end_2), (start_3, end_3) = (
        json.loads((tmp_path / f"rank{rank}").read_text()) for rank in range(4))
    assert end_0 <= start_2, "node 1 prepared the data while rank 0 was still writing it"
    assert end_2 <= min(start_1, start_3), "a process read the data before its node's first process had it"


def test_opt6_two_nodes_on_one_machine_finish_with_identical_weights_and_one_report(tmp_path):
    json_path, wrapper = tmp_path / "result.json", tmp_path / "checksum_rank.py"
    wrapper.write_text(CHECKSUM_RANK.format(root=str(ROOT)))
    nodes = run_two_nodes(wrapper, 1, *DDP_ARGS, "--train-size", 256, "--test-size", 64, "--json", json_path)
    for node in nodes:
        assert node.returncode == 0, node.stderr
    first, second = checksums(nodes[0].stderr + nodes[1].stderr)
    assert first == second, "the nodes' weights or BatchNorm statistics differ"
    assert [node.stdout.count("done:") for node in nodes] == [1, 0], "one report, from rank 0"
    progress = [sum(line.startswith("  epoch ") for line in node.stdout.splitlines()) for node in nodes]
    assert progress == [2 * 256 // 32, 0], "a progress line for each step, from rank 0 alone"
    report = read_json(json_path)
    assert report["world_size"] == 2 and report["epochs"][0]["images"] == 256, "one report of both nodes' images"


INSTRUMENTED_RANK = """
import contextlib, hashlib, inspect, json, os, sys, time
sys.path.insert(0, {root!r})
import torch, torch.distributed as dist, torch.nn as nn
import common, opt6

rank, out = os.environ["RANK"], sys.argv.pop(1)
record = {{"shares": [], "allreduce_at_micro_batch": [], "load": None, "evaluated": [], "exit": [], "ddp": None}}
micro_batches = [0]


class BatchNormFreeNet(nn.Sequential):  # float32 and no BatchNorm: accumulation is exact
    def __init__(self):
        super().__init__(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 30 * 30, 10))

    def forward(self, images):
        micro_batches[0] += self.training
        return super().forward(images)


common.ResNet10 = BatchNormFreeNet
torch.autocast = lambda *args, **kwargs: contextlib.nullcontext()
opt6.augment = lambda images, *crops_and_flips: images  # crops differ per micro-batch: leave images as they are

real_plan_epoch, real_load_data, RealDDP = opt6.plan_epoch, common.load_data, opt6.DistributedDataParallel
real_normalize = opt6.normalize


def plan_epoch(plan, *args):
    real_plan_epoch(plan, *args)
    record["shares"].append(plan.batches.flatten().tolist())


def load_data(*args, **kwargs):
    start = time.time()
    if rank == "0":
        time.sleep(1)  # a slow download: the other rank must wait for it
    result = real_load_data(*args, **kwargs)
    record["load"] = [start, time.time()]
    return result


class CountingDDP(RealDDP):  # a subclass: opt6's step asks isinstance(model, DistributedDataParallel)
    def __init__(self, *args, **kwargs):
        record["ddp"] = {{name: value for name, value in kwargs.items() if isinstance(value, bool)}}
        super().__init__(*args, **kwargs)

        def hook(state, bucket):  # DDP's all-reduce of a bucket (the mean of the ranks' gradients), counted
            record["allreduce_at_micro_batch"].append(micro_batches[0])
            # In this thread: torch's allreduce_hook chains a Python callback that Gloo's worker thread runs and
            # frees, and with it this wrapper's rank 1 twice aborted at exit in CI ("terminate called without an
            # active exception"); no run with DDP's built-in all-reduce ever did
            dist.all_reduce(bucket.buffer().div_(dist.get_world_size()))
            future = torch.futures.Future()
            future.set_result(bucket.buffer())
            return future

        self.register_comm_hook(None, hook)


CountingDDP.__signature__ = inspect.signature(RealDDP)  # DDP's keywords, as opt6's broadcast_buffers_keyword reads them


def normalize(images, statistics):
    if torch.is_inference_mode_enabled():  # evaluating: note which test images this rank scores
        record["evaluated"] += [hashlib.sha256(image.numpy().tobytes()).hexdigest()[:16] for image in images]
    return real_normalize(images, statistics)


class BarrierHandle:  # a barrier's handle (Work), noting when Python lets go of it
    def __init__(self, work):
        self.work = work

    def wait(self):
        return self.work.wait()

    def __del__(self):
        record["exit"].append("barrier handle freed")


def barrier(*args, async_op=False, **kwargs):
    handle = BarrierHandle(real_barrier(*args, async_op=True, **kwargs))
    if async_op:
        return handle
    handle.wait()


def destroy_process_group(*args, **kwargs):
    record["exit"].append("process group destroyed")
    real_destroy_process_group(*args, **kwargs)


opt6.plan_epoch, common.load_data, opt6.DistributedDataParallel = plan_epoch, load_data, CountingDDP
opt6.normalize = normalize
real_barrier, real_destroy_process_group = dist.barrier, dist.destroy_process_group
dist.barrier, dist.destroy_process_group = barrier, destroy_process_group
""" + WEIGHTS_CHECKSUM + """
sys.argv[0] = "opt6.py"
try:
    opt6.main()
finally:
    with open(out + ".rank" + rank + ".json", "w") as file:
        json.dump(record, file)
""" + PRINT_WEIGHTS_CHECKSUM


@pytest.fixture(scope="module")
def accumulating_ddp_runs(tmp_path_factory):
    """opt6 under torchrun on 2 CPU processes, instrumented: a batch of 12, and 3 accumulated micro-batches of 4."""
    folder = tmp_path_factory.mktemp("ddp")
    wrapper = folder / "instrumented_rank.py"
    wrapper.write_text(INSTRUMENTED_RANK.format(root=str(ROOT)))
    runs = {}
    for accum_steps, batch_size in [(1, 12), (3, 4)]:
        out = folder / f"accum{accum_steps}"
        # 120 images = 5 steps of 2 ranks x 12, enough for OneCycleLR
        result = run_python(*TORCHRUN, wrapper, out, *SMALL, "--epochs", 1, "--train-size", 120, "--test-size", 16,
                            "--batch-size", batch_size, "--accum-steps", accum_steps, "--no-compile",
                            "--save", f"{out}.pt", "--json", f"{out}.json", timeout=300)
        assert result.returncode == 0, result.stderr
        ranks = [json.loads(Path(f"{out}.rank{rank}.json").read_text()) for rank in (0, 1)]
        runs[accum_steps] = SimpleNamespace(result=result, ranks=ranks, weights=torch.load(f"{out}.pt"),
                                            report=read_json(f"{out}.json"))
    return runs


def test_opt6_accumulating_under_ddp_equals_one_big_batch(accumulating_ddp_runs):
    big_batch, accumulated = accumulating_ddp_runs[1], accumulating_ddp_runs[3]
    for run in (big_batch, accumulated):
        first, second = checksums(run.result.stderr)
        assert first == second, "the ranks' weights differ"
    for name, weight in big_batch.weights.items():
        assert torch.allclose(accumulated.weights[name], weight, atol=1e-5), name
    # The weights moved: equal untrained weights would prove nothing.
    assert not torch.allclose(big_batch.weights["0.weight"], bn_free_net()[0].weight.detach(), atol=1e-4)


def test_opt6_all_reduces_once_per_optimizer_step_not_per_micro_batch(accumulating_ddp_runs):
    for accum_steps, run in accumulating_ddp_runs.items():
        for rank in run.ranks:
            # DDP builds its buckets anew after the first step, so count from step 2 on.
            later = [micro_batch for micro_batch in rank["allreduce_at_micro_batch"] if micro_batch > accum_steps]
            assert later and all(micro_batch % accum_steps == 0 for micro_batch in later), later
            per_step = collections.Counter(later)
            assert sorted(per_step) == [accum_steps * step for step in range(2, 6)]
            assert len(set(per_step.values())) == 1, "the same buckets every step"


def test_opt6_wraps_the_model_with_gradients_in_ddps_buckets_and_no_buffer_broadcast_before_each_forward(
        accumulating_ddp_runs):
    # The BatchNorm statistics are averaged once per evaluation instead (the ranks' checksums cover the buffers)
    for run in accumulating_ddp_runs.values():
        for rank in run.ranks:
            assert rank["ddp"] == {"gradient_as_bucket_view": True, opt6.broadcast_buffers_keyword(): False}


def test_opt6_ranks_train_on_disjoint_shares_that_cover_the_epoch(accumulating_ddp_runs):
    for run in accumulating_ddp_runs.values():
        first, second = (rank["shares"][0] for rank in run.ranks)
        assert len(first) == len(second) == 60 and not set(first) & set(second)
        assert set(first) | set(second) == set(range(120))


def test_opt6_ranks_evaluate_disjoint_slices_that_cover_the_test_set_and_score_as_one_process(accumulating_ddp_runs):
    test_data = opt4.load_to_device(common.synthetic_cifar10(16, train=False, transform=None), CPU)
    every_test_image = sorted(image_hash(image) for image in test_data[0])
    assert len(set(every_test_image)) == 16, "the test must be able to tell the images apart"
    for run in accumulating_ddp_runs.values():
        first, second = (rank["evaluated"] for rank in run.ranks)
        assert len(first) == len(second) == 8 and not set(first) & set(second), "each rank its own half"
        assert sorted(first + second) == every_test_image
        # The report's figures are the whole test set's: one process scoring the saved weights gets the same.
        model = bn_free_net()
        model.load_state_dict(run.weights)
        loss, accuracy = call(opt6.evaluate, model=model, test_data=test_data, amp_dtype=torch.float32, batch_size=4,
                              device=CPU, size=32, rank=0, world_size=1)
        assert loss == pytest.approx(run.report["epochs"][-1]["test_loss"], rel=1e-5)
        assert accuracy == pytest.approx(run.report["final_test_accuracy"], abs=1e-9)


def test_opt6_keeps_its_last_barriers_handle_until_its_process_group_is_destroyed(accumulating_ddp_runs):
    # The hang opt6.leave_process_group keeps away, made to happen every time (torch 2.6, Gloo, 2 ranks, not project code): a
    # rank starts an all-reduce, drops its tensor, starts a barrier and drops the barrier's handle, then destroys the
    # process group: 5 hangs in 5 runs, gdb showing the main thread in ~ProcessGroupGloo joining a worker thread
    # that waits for the GIL in ~TensorImpl; with the handle kept past destroy_process_group, 4 ends in 4
    for rank in accumulating_ddp_runs[1].ranks:
        assert rank["exit"][-2:] == ["process group destroyed", "barrier handle freed"], rank["exit"]


def test_opt6_the_first_rank_on_a_machine_loads_the_data_before_the_others(accumulating_ddp_runs):
    for run in accumulating_ddp_runs.values():
        (_, first_done), (second_start, _) = (rank["load"] for rank in run.ranks)
        assert second_start >= first_done, "rank 1 read the data before rank 0 had it"

FAILING_RANK = """
import os, sys
sys.path.insert(0, {root!r})
import opt6

if os.environ["RANK"] == "1":  # rank 1 dies in its third step while rank 0 waits in an all-reduce
    calls, real_augment = [], opt6.augment
    def augment(*args):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("injected failure on rank 1")
        return real_augment(*args)
    opt6.augment = augment
sys.argv[0] = "opt6.py"
opt6.main()
"""


def test_opt6_a_failing_rank_ends_the_whole_job_with_its_message(tmp_path):
    wrapper = tmp_path / "fail_on_rank_1.py"
    wrapper.write_text(FAILING_RANK.format(root=str(ROOT)))
    began = time.monotonic()
    result = run_python(*TORCHRUN, wrapper, *DDP_ARGS, "--train-size", 1024, timeout=300)
    assert result.returncode != 0
    assert "injected failure on rank 1" in result.stderr
    assert time.monotonic() - began < 240, "torchrun should stop the waiting rank, not hang"


SLEEPING_RANK = """
import os, sys, time
with open(sys.argv[1] + os.environ["RANK"], "w") as file:
    file.write(str(os.getpid()))
time.sleep(600)
"""


def test_a_torchrun_past_its_tests_deadline_is_stopped_with_its_ranks(tmp_path):
    # The tests' runs (conftest's run_python, finish) stop a run past its deadline: torchrun's ranks, in sessions of
    # their own, must not outlive it to slow the tests after it
    script, pid_files = tmp_path / "sleeps.py", [tmp_path / f"rank{rank}" for rank in (0, 1)]
    script.write_text(SLEEPING_RANK)
    process = start([sys.executable, *TORCHRUN, script, tmp_path / "rank"], cwd=ROOT, env={**os.environ, **NO_NETWORK})
    deadline = time.monotonic() + 240
    while not all(path.is_file() and path.read_text() for path in pid_files):
        assert process.poll() is None and time.monotonic() < deadline, "torchrun did not start both ranks"
        time.sleep(0.5)
    with pytest.raises(subprocess.TimeoutExpired):
        finish(process, timeout=1)
    assert [pid for pid in map(int, (path.read_text() for path in pid_files)) if running(pid)] == []


def running(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_opt6_under_torchrun_with_one_process_trains_and_leaves_its_group_of_one():
    # The CPU twin of test_cuda's one-process run: torchrun starts a group of one, which opt6 now leaves at its end
    one_process = [arg.replace("--nproc_per_node=2", "--nproc_per_node=1") for arg in TORCHRUN]
    result = run_python(*one_process, "opt6.py", *DDP_ARGS, "--train-size", 256, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "world size 1" in result.stdout and "step: run as a function" in result.stdout, result.stdout
