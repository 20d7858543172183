"""opt6 without a GPU: two Gloo processes under torchrun learn to equal weights; its launcher and device checks, each
rank's GPU and its share of the epoch (the longer multi-process runs: lab/test_torchrun.py)."""
import contextlib
import functools
import inspect
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import common
import machine
import opt5
import opt6
from conftest import (
    ALL_SCRIPTS, CHECKSUM_RANK, CPU, CPU_AMP_DTYPE, DDP_ARGS, NO_DATA, NO_NETWORK, ROOT, SMALL, TORCHRUN,
    VISIBLE_GPU, WHOLE_STEP, assert_one_error_line, assert_saved_weights_match_the_report, bare_plan, checksums,
    onecycle_lr_after, plan_the_epoch, read_json, run_on_fake_machine, run_python, shipped_optimizer, small_net)


@pytest.mark.floor
def test_opt6_two_processes_learn_print_once_and_end_with_identical_weights(tmp_path):
    json_path, weights, wrapper = tmp_path / "result.json", tmp_path / "weights.pt", tmp_path / "checksum_rank.py"
    wrapper.write_text(CHECKSUM_RANK.format(root=str(ROOT)))
    result = run_python(*TORCHRUN, wrapper, *DDP_ARGS, "--train-size", 1024, "--json", json_path, "--save", weights)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    # One log, rank 0's: each epoch's line once, and a progress line for each of its steps (PROGRESS_SECONDS is 0)
    assert [line.partition(":")[0] for line in lines if line.startswith("epoch ")] == ["epoch 1", "epoch 2"]
    assert sum(line.startswith("  epoch ") for line in lines) == 2 * 1024 // 32 and result.stdout.count("done:") == 1
    assert "world size 2: global batch 32" in result.stdout
    first, second = checksums(result.stderr)
    assert first == second, "the ranks' weights or BatchNorm statistics differ"
    report = read_json(json_path)
    assert report["world_size"] == 2 and report["final_test_accuracy"] > 0.5
    assert report["epochs"][0]["images"] == 1024, "images/s must count both ranks' images"
    # Twice the global batch: the peak rate grows by the square root of 2, and OneCycleLR ends relative to it (the
    # rate of the last step)
    steps, lr = 2 * 1024 // 32, report["settings"]["lr"]
    assert report["final_lr"] == pytest.approx(onecycle_lr_after(steps, lr * 2**0.5, steps=steps - 1), rel=1e-6)
    assert report["final_lr"] != pytest.approx(onecycle_lr_after(steps, lr, steps=steps - 1))
    assert_saved_weights_match_the_report(weights, report, opt6, transform=None)


def run_to_the_end(*args, timeout):
    """Run `python args...` offline in a process group of its own; returns the CompletedProcess, or fails the test
    naming the hang after killing torchrun and every rank, so no stuck rank outlives the test (or holds its output
    open, which would keep the test waiting for ever)."""
    process = subprocess.Popen([sys.executable, *map(str, args)], cwd=ROOT, env={**os.environ, **NO_NETWORK},
                               text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    try:
        output = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        # torchrun starts each rank in a session of its own (torch 2.6): kill each rank's group, then torchrun's
        for pid in [*child_pids(process.pid), process.pid]:
            with contextlib.suppress(ProcessLookupError):  # a rank that ended meanwhile
                os.killpg(os.getpgid(pid), signal.SIGKILL)
        output = process.communicate()
        pytest.fail(f"still running after {timeout} s, killed: {' '.join(map(str, args))}\n{output[0][-2000:]}")
    return subprocess.CompletedProcess(process.args, process.returncode, *output)


def child_pids(pid):
    """The pids of `pid`'s living children, read from /proc (Linux)."""
    children = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError):  # a process that ended meanwhile
            if int(stat.read_text().rpartition(")")[2].split()[1]) == pid:  # the field after the name: state, ppid
                children.append(int(stat.parent.name))
    return children


@pytest.mark.floor
def test_a_rank_that_hangs_fails_its_test_in_time_and_is_killed(tmp_path):
    # torch 2.6's torchrun starts each rank in a session of its own: killing torchrun's group alone left the rank
    # alive, holding the output open, and the test waited for it for ever
    # 15 s: torchrun has started its ranks well before (a few seconds on a loaded 2-core CPU), so the kill meets them
    hang, started = tmp_path / "hang.py", tmp_path / "started"
    hang.write_text(f"import os, time\nopen({str(started)!r} + os.environ['RANK'], 'w').close()\ntime.sleep(600)\n")
    start = time.monotonic()
    with pytest.raises(pytest.fail.Exception, match="still running after 15 s"):
        run_to_the_end(*TORCHRUN, hang, timeout=15)
    assert time.monotonic() - start < 60
    assert sorted(path.name for path in tmp_path.glob("started*")) == ["started0", "started1"], "the ranks ran"
    ranks_left = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        with contextlib.suppress(OSError):  # a process that ended meanwhile
            if str(hang).encode() in cmdline.read_bytes():
                ranks_left.append(cmdline.parent.name)
    assert ranks_left == []


@pytest.mark.floor
@pytest.mark.skipif(machine.torch_version() >= (2, 8), reason="the hang at exit was seen on torch 2.6 only")
def test_opt6_compiled_ends(tmp_path):
    # Each rank used to destroy its process group as soon as it was done: rank 1 at once, rank 0 after its report.
    # On torch 2.6, compiled, rank 0 then hung in Gloo's destructor in 2 of 6 runs, and torchrun waited for ever.
    # A barrier before it narrowed that, not closed it: once since, in CI, a rank's main thread, holding the GIL,
    # freed the process group and joined a Gloo worker thread that was waiting for the GIL to free a tensor of an
    # earlier all-reduce (gdb's stacks). The cause, and the test that keeps it fixed every time:
    # test_opt6_keeps_its_last_barriers_handle_until_its_process_group_is_destroyed. Here one compiled run, end to end,
    # at one image size and with AdamW: the fewest graphs a compiled rank makes (Muon's and a second size's take minutes
    # more to compile on torch 2.6 on 2 cores)
    result = run_to_the_end(*TORCHRUN, "opt6.py", *SMALL, "--epochs", 2, "--train-size", 256, "--batch-size", 16,
                            "--optimizer", "adamw", "--min-size", 32, "--compile", timeout=900)
    assert result.returncode == 0, result.stderr
    assert result.stdout.count("done:") == 1


@pytest.mark.parametrize("env, missing", [({"WORLD_SIZE": "2"}, "RANK, LOCAL_RANK, MASTER_ADDR, MASTER_PORT"),
                                          ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "localhost",
                                            "MASTER_PORT": "29500"}, "LOCAL_RANK")])
def test_opt6_started_without_torchrun_but_some_of_its_variables_exits_2_with_one_line(env, missing):
    # srun sets no LOCAL_RANK; a hand-set WORLD_SIZE alone is not a job either.
    # A run that missed the check would train (or wait for a rank 1 that never comes): cut it short.
    result = run_python("opt6.py", *DDP_ARGS, "--train-size", 256, env=env, timeout=60)
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr, result.stderr
    assert f"set but not {missing}: start opt6.py with torchrun" in result.stderr


def test_opt6_without_torchrun_on_several_gpus_points_to_torchrun(monkeypatch, capsys):
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setattr(sys, "argv", ["opt6.py"])  # the hint names the script that was started
    cuda = torch.device("cuda")
    assert opt6.setup_distributed(CPU) == (0, 1, CPU) and opt6.setup_distributed(cuda) == (0, 1, cuda)
    hint = "4 GPUs here, and one process uses one: to use them all, start torchrun --standalone --nproc_per_node=4 " \
           "opt6.py ...\n"
    for device, world_size, says in ((CPU, 1, ""), (cuda, 2, ""), (cuda, 1, hint)):
        opt6.point_to_torchrun(device, world_size)
        assert capsys.readouterr().out == says, (device, world_size)

    class SettingsLine(Exception):
        pass

    # opt6's main says it once the device is known, before the settings line (where this test stops it)
    monkeypatch.setattr(common, "pick_device", lambda args: cuda)
    monkeypatch.setattr(common, "print_settings", lambda *args: (_ for _ in ()).throw(SettingsLine()))
    with pytest.raises(SettingsLine):
        opt6.main()
    assert capsys.readouterr().out == hint


def test_opt6_a_local_rank_past_the_visible_gpus_exits_2_with_one_line():
    # Slurm's one task per GPU: every process sees one GPU, and torchrun's second process has LOCAL_RANK 1
    env = {"RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "9"}
    patches = VISIBLE_GPU.format(count=1, capability=90, name="NVIDIA H100 80GB HBM3")
    result = run_on_fake_machine(patches, "opt6.py", *NO_DATA, "--no-compile", env=env)
    assert_one_error_line(result, "local rank 1, but this process sees 1 GPU(s): start at most 1 per machine "
                                  "(--nproc_per_node=1)")


# In a fake torchrun rank on a machine of fake GPUs: every CUDA call recorded with the GPU it names (its current GPU
# where it names none), a tensor asked for on a GPU made on the CPU, torch.compile a no-op; the process group's start
# prints what was recorded and ends the process.
RECORD_CUDA_CALLS = """
import json, torch.distributed, torch.overrides
calls, current = [], [0]
def set_device(device):
    current[0] = device if isinstance(device, int) else torch.device(device).index
    calls.append(["set_device", current[0]])
class RecordCudaCalls(torch.overrides.TorchFunctionMode):
    def __torch_function__(self, function, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        device = torch.device(kwargs.get("device") or "cpu")
        if device.type == "cuda":
            calls.append([function.__name__, current[0] if device.index is None else device.index])
            kwargs["device"] = "cpu"
        return function(*args, **kwargs)
def init_process_group(backend, device_id=None, **kwargs):
    calls.append(["init_process_group", device_id.index])
    print(json.dumps(calls), file=sys.stderr)
    sys.exit(0)
real_capability = torch.cuda.get_device_capability
def get_device_capability(device=None):
    calls.append(["get_device_capability", current[0] if device is None else torch.device("cuda", device).index
                  if isinstance(device, int) else device.index])
    return real_capability(device)
torch.cuda.set_device, torch.cuda.current_device = set_device, lambda: current[0]
torch.cuda.get_device_capability = get_device_capability
torch.compile = lambda function, **options: function
torch.distributed.init_process_group = init_process_group
RecordCudaCalls().__enter__()
"""


def test_opt6_each_rank_sets_its_own_gpu_before_any_cuda_work_the_compiler_check_included():
    # torchrun's second process on a machine with 2 GPUs: everything it does on a GPU must be on GPU 1. Before it, the
    # architecture check reads each GPU's capability, and the compiler check the current GPU's, given no number
    # (properties, no work on a GPU); then opt6's setup makes GPU 1 current before the process group, its first CUDA
    # work
    env = {"RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "9"}
    patches = VISIBLE_GPU.format(count=2, capability=90, name="NVIDIA H100 80GB HBM3") + RECORD_CUDA_CALLS
    result = run_on_fake_machine(patches, "opt6.py", *NO_DATA, "--compile", env=env)
    assert result.returncode == 0, result.stderr
    calls = json.loads(result.stderr.strip().splitlines()[-1])
    assert calls == [["get_device_capability", 0], ["get_device_capability", 1], ["get_device_capability", None],
                     ["set_device", 1], ["init_process_group", 1]], calls


def test_under_torchrun_only_rank_0_prints_a_verdict_and_a_fatal_one_ends_every_rank(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    for rank, prints in (("0", True), ("1", False)):
        monkeypatch.setenv("RANK", rank)
        assert common.pick_device(SimpleNamespace(device="auto", compile=False)) == CPU
        assert ("torch sees no CUDA GPU: running on the CPU" in capsys.readouterr().out) == prints, rank
        with pytest.raises(SystemExit) as exit_:
            common.pick_device(SimpleNamespace(device="cuda", compile=False))
        assert exit_.value.code == 2 and "--device cuda: torch sees no CUDA GPU" in capsys.readouterr().err


@pytest.mark.parametrize("world_size, captured", [(1, True), (2, False)])
def test_opt6_captures_its_step_on_one_gpu_and_says_why_not_under_ddp(world_size, captured):
    optimizer = shipped_optimizer("opt6.py", small_net())
    why_not = opt6.capture_problem(torch.device("cuda", 0), torch.bfloat16, optimizer, world_size)
    assert (why_not is None) == captured and (captured or "DDP" in why_not)
    assert "CUDA" in opt6.capture_problem(CPU, torch.bfloat16, optimizer, 1)


@pytest.mark.parametrize("script", WHOLE_STEP)
def test_a_gpu_captures_the_step_uncompiled_and_a_cpu_runs_it_uncompiled(script, monkeypatch):
    # The path each device gets: --compile is off by default everywhere (on a 2-core CPU it saved nothing a step, for
    # 43 s: results/compile_cpu.log), and capture_problem decides the capture
    module, ranks = ALL_SCRIPTS[script], [1] if script == "opt6.py" else []
    optimizer = shipped_optimizer(script, small_net())
    if hasattr(module, "capture_problem"):  # opt5 on: what stops a capture besides the device (Muon's float16, DDP)
        assert module.capture_problem(torch.device("cuda", 0), torch.bfloat16, optimizer, *ranks) is None
        assert module.capture_problem(CPU, CPU_AMP_DTYPE, optimizer, *ranks) == "not captured: CUDA graphs are CUDA's"
    step = functools.partial(print, "a step")
    assert module.cuda_graph(step, CPU) is step  # off CUDA: the step as it is
    monkeypatch.setattr(sys, "argv", [script])
    assert module.parse_args().compile is False


def test_ddp_buffer_flag_is_named_as_this_torch_names_it(monkeypatch):
    keyword = opt6.broadcast_buffers_keyword()
    assert keyword in inspect.signature(opt6.DistributedDataParallel).parameters
    expected = "forward_sync_buffers" if machine.torch_version() >= (2, 13) else "broadcast_buffers"
    assert keyword == expected

    def ddp_before_2_13(module, device_ids=None, broadcast_buffers=True, gradient_as_bucket_view=False):
        pass

    monkeypatch.setattr(opt6, "DistributedDataParallel", ddp_before_2_13)
    assert opt6.broadcast_buffers_keyword() == "broadcast_buffers"


def test_opt6_rank_shares_are_disjoint_and_cover_the_epoch():
    def share(rank, world_size=2, batch_size=8, module=opt6):
        args = SimpleNamespace(batch_size=batch_size, accum_steps=1)
        run = SimpleNamespace(args=args, device=CPU, rank=rank, world_size=world_size,
                              plan=bare_plan(module, 6, batch_size),
                              generator=torch.Generator().manual_seed(0),  # every rank seeds alike
                              crop_padding=common.CROP_PADDING, schedule=torch.zeros(6))
        plan_the_epoch(module, run, 100, 1)
        return run.plan

    first, second = share(0), share(1)
    assert first.batches.shape == second.batches.shape == (6, 8)
    seen = first.batches.flatten().tolist() + second.batches.flatten().tolist()
    assert len(set(seen)) == 96, "no image twice; 100 - 96 left over for a full global batch of 16"
    assert not torch.equal(first.offsets, second.offsets), "each rank its own crops"
    # Each rank's share is its slice of every global batch of the one epoch that one process (opt5's) draws
    whole = share(0, world_size=1, batch_size=16, module=opt5)
    for name, dimension in (("batches", 1), ("offsets", 2), ("flips", 1)):
        shares = torch.cat([getattr(first, name), getattr(second, name)], dimension)
        assert torch.equal(shares, getattr(whole, name)), name
    assert all(torch.equal(getattr(share(0, 1, 16), name), getattr(whole, name)) for name in ("batches", "offsets"))


@pytest.mark.parametrize("given", ["cuda", "cuda:0", torch.device("cuda"), torch.device("cuda", 1)],
                         ids=["cuda", "cuda:0", "device cuda", "device cuda:1"])
@pytest.mark.parametrize("environment, rank, expected", [({}, 1, 1), ({}, 0, 0), ({"LOCAL_RANK": "1"}, 3, 1)],
                         ids=["spawn rank 1", "spawn rank 0", "torchrun's second machine, rank 3"])
def test_opt6_turns_a_gpu_given_any_way_into_the_ranks_own(given, environment, rank, expected, monkeypatch):
    # Two GPUs (mocked) and a process group the client's launcher started (mocked): torch.multiprocessing.spawn sets
    # no LOCAL_RANK (one machine: the rank is the local rank), torchrun does; either way the rank's own GPU, made current
    made_current = []
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "set_device", made_current.append)
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "get_rank", lambda group=None: rank)
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda group=None: 4)
    monkeypatch.setattr(torch.distributed, "init_process_group", lambda *args, **kwargs: pytest.fail("started twice"))
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    for name, value in environment.items():
        monkeypatch.setenv(name, value)
    assert opt6.setup_distributed(given) == (rank, 4, torch.device("cuda", expected))
    assert made_current == [torch.device("cuda", expected)]
    assert opt6.setup_distributed("cpu") == (rank, 4, CPU)  # a CPU stays the CPU


def test_opt6_data_first_on_rank_0_then_on_each_machines_first_process_without_torchruns_local_rank(monkeypatch):
    # Under torch.multiprocessing.spawn (no LOCAL_RANK): one machine, rank 0's turn first, then the others' together
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    monkeypatch.setattr(torch.distributed, "barrier", lambda *args, **kwargs: turns.append("barrier"))
    for rank, turn in ((0, 0), (1, 2)):
        turns = []
        monkeypatch.setattr(torch.distributed, "get_rank", lambda group=None: rank)
        with opt6.rank_zero_first(world_size=2):
            turns.append("body")
        assert turns.index("body") == turn and turns.count("barrier") == 3, (rank, turns)
