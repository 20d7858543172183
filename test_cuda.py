"""On a CUDA GPU: `python -m pytest -m cuda -q` (skipped elsewhere): every script learns, the step is captured and
replayed with host syncs forbidden, float16 with GradScaler where bfloat16 is missing, DDP over NCCL."""
import contextlib
import functools
import sys
import warnings

import pytest
import torch
from torch.utils.data import DataLoader

import common
import opt2
import opt4
from conftest import (
    ALL_SCRIPTS, LEARN_ARGS, TORCHRUN, checksums, cuda_test, optimizers_of, plan_tensors, plan_the_epoch, read_json,
    run_python, small_net, step_of)


# ------------------------------------------------- on a CUDA GPU: `python -m pytest -m cuda -q`
# Written without a GPU to run them on: here they are skipped. Each one checks a claim that only a GPU can.

GPU_ARGS = ["--synthetic", "--device", "cuda", "--epochs", "2", "--train-size", "2048", "--test-size", "512"]


@cuda_test
@pytest.mark.parametrize("script", ALL_SCRIPTS)
def test_cuda_every_script_learns(script, tmp_path):
    # the CPU learn test's arguments (test_script_learns_reports_and_saves): what starves a script there fails in CI
    json_path = tmp_path / "result.json"
    result = run_python(script, "--synthetic", "--device", "cuda", "--test-size", 256, "--epochs", 2,
                        *LEARN_ARGS[script], "--json", json_path)
    assert result.returncode == 0, result.stderr
    report = read_json(json_path)
    assert report["device"] == "cuda" and report["final_test_accuracy"] > 0.5


@cuda_test
def test_cuda_opt2_loader_pins_memory(monkeypatch):
    loaders = []

    def recording_loader(*args, **kwargs):
        loaders.append(DataLoader(*args, **kwargs))
        return loaders[-1]

    monkeypatch.setattr(opt2, "DataLoader", recording_loader)
    monkeypatch.setattr(sys, "argv", ["opt2.py", *GPU_ARGS, "--epochs", "1", "--no-compile"])
    opt2.main()
    images, _ = next(iter(loaders[0]))
    assert loaders[0].pin_memory and images.is_pinned()


@cuda_test
def test_cuda_opt4_captures_its_step_and_never_syncs_after_warm_up(monkeypatch, capsys):
    real_train_one_epoch, syncs = opt4.train_one_epoch, []

    def train_one_epoch(*args):
        if args[-2] == 1:  # epoch 1: the warm-up, cuDNN's autotuning and the capture happen here
            return real_train_one_epoch(*args)
        torch.cuda.set_sync_debug_mode("warn")
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                result = real_train_one_epoch(*args)
        finally:
            torch.cuda.set_sync_debug_mode(0)
        syncs.extend(str(warning.message) for warning in caught if "synchroniz" in str(warning.message))
        return result

    monkeypatch.setattr(opt4, "train_one_epoch", train_one_epoch)
    monkeypatch.setattr(sys, "argv", ["opt4.py", *GPU_ARGS])
    opt4.main()
    assert "step: captured as a CUDA graph after 3 warm-up calls, replayed from here on" in capsys.readouterr().out
    # losses.tolist(), losses.mean().item() and correct.item(): the fixed reads at the end of the epoch
    assert len(syncs) == 3, syncs


@cuda_test
@pytest.mark.parametrize("script", ["opt4.py", "opt5.py"])
def test_cuda_the_captured_step_replays_what_the_step_computes(script, monkeypatch):
    # The same 2 epochs twice, float32, uncompiled as a GPU runs them by default: the step called as itself, and
    # captured after 3 steps and replayed. cuDNN deterministic and not autotuned: the in-process main() of another test
    # in this worker turns the autotuner on, and two of its picks may sum in another order
    monkeypatch.setattr(torch, "autocast", lambda *args, **kwargs: contextlib.nullcontext())
    monkeypatch.setattr(torch.backends.cudnn, "benchmark", False)
    monkeypatch.setattr(torch.backends.cudnn, "deterministic", True)
    gpu, dataset = torch.device("cuda"), common.synthetic_cifar10(256, train=True, transform=None)

    def weights_after_two_epochs(captured):
        model = small_net().to(gpu)
        run, step = step_of(script, model, dataset, gpu)
        if captured:
            step = opt4.cuda_graph(step, gpu)
        addresses = [tensor.data_ptr() for tensor in [*model.parameters(), *plan_tensors(run.plan).values()]]
        for epoch in (1, 2):
            plan_the_epoch(ALL_SCRIPTS[script], run, 256, epoch)
            for _ in range(len(run.plan.rates)):
                step()
        assert addresses == [tensor.data_ptr() for tensor in [*model.parameters(), *plan_tensors(run.plan).values()]]
        return torch.nn.utils.parameters_to_vector(model.parameters()).detach(), run.plan.losses.clone()

    (captured, captured_losses) = weights_after_two_epochs(captured=True)
    (called, called_losses) = weights_after_two_epochs(captured=False)
    assert torch.allclose(captured, called, rtol=1e-4, atol=1e-5) and torch.allclose(captured_losses, called_losses)
    assert not torch.equal(captured, torch.nn.utils.parameters_to_vector(small_net().parameters()).to(gpu))


@cuda_test
@pytest.mark.parametrize("script", ["opt4.py", "opt5.py"])
def test_cuda_the_uncompiled_step_is_captured_and_replayed_with_syncs_forbidden(script, capsys):
    # After its warm-up, the step as main() builds it (fused AdamW, or Muon with it; no compiler) captures and replays
    # with any host sync an error: the proof, on a GPU, of what the CPU tests count
    gpu = torch.device("cuda")
    run, step = step_of(script, common.ResNet10().to(gpu, memory_format=torch.channels_last),
                        common.synthetic_cifar10(256, train=True, transform=None), gpu)
    plan_the_epoch(ALL_SCRIPTS[script], run, 256, 1)
    step = opt4.cuda_graph(step, gpu)
    for _ in range(3):
        step()  # warm-up, on a side stream
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(len(run.plan.rates) - 3):
            step()  # the first captures, every one replays
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert run.plan.cursor.item() == 0, "the epoch's last step wraps the cursor to its first"
    assert "not captured" not in capsys.readouterr().out, "captured, not run as a function after a failed capture"


@cuda_test
def test_cuda_a_capture_that_fails_runs_the_step_uncaptured_with_no_step_lost_or_doubled(monkeypatch, capsys):
    # A real capture error, after the whole step was recorded: a host read is not allowed while a stream captures.
    # The recorded step ran none of its kernels, so the fallback must run it (gradients, weights, counter) once
    monkeypatch.setattr(torch, "autocast", lambda *args, **kwargs: contextlib.nullcontext())  # float32
    monkeypatch.setattr(torch.backends.cudnn, "benchmark", False)
    monkeypatch.setattr(torch.backends.cudnn, "deterministic", True)
    gpu, dataset = torch.device("cuda"), common.synthetic_cifar10(256, train=True, transform=None)

    def weights_after_an_epoch(wrap):
        run, step = step_of("opt4.py", small_net().to(gpu), dataset, gpu)

        def step_then_a_host_read_while_capturing():
            step()
            if torch.cuda.is_current_stream_capturing():
                run.plan.losses.sum().item()
        plan_the_epoch(opt4, run, 256, 1)
        wrapped = wrap(step_then_a_host_read_while_capturing)
        for _ in range(len(run.plan.rates)):  # 8 steps: 3 warm-up, the capture that fails, 4 more
            wrapped()
        steps_taken = next(iter(optimizers_of(run)[0].state.values()))["step"].item()  # AdamW's count of its steps
        return torch.nn.utils.parameters_to_vector(run.model.parameters()).detach(), steps_taken

    wrap = functools.partial(opt4.cuda_graph, device=gpu)
    (fell_back, fell_back_steps), out = weights_after_an_epoch(wrap), capsys.readouterr().out
    called, called_steps = weights_after_an_epoch(lambda step: step)
    assert "step: not captured (" in out and "not permitted when stream is capturing" in out, out
    assert fell_back_steps == called_steps == 8 and torch.allclose(fell_back, called, rtol=1e-4, atol=1e-5)


@cuda_test
def test_cuda_a_run_prints_no_warning_of_its_capturable_optimizer_stepping_uncaptured(tmp_path):
    # the warm-up steps before the capture step adamw uncaptured; torch built it with its warn-once flag set
    result = run_python("opt4.py", *GPU_ARGS)
    assert result.returncode == 0 and "capturable" not in result.stderr, result.stderr


@cuda_test
def test_cuda_opt4_accumulates_under_cuda_graphs(tmp_path):
    json_path = tmp_path / "result.json"
    result = run_python("opt4.py", *GPU_ARGS, "--accum-steps", 2, "--json", json_path)
    assert result.returncode == 0, result.stderr  # torch's "gradient ... overwritten" error would end it here
    report = read_json(json_path)
    assert report["settings"]["accum_steps"] == 2 and report["final_test_accuracy"] > 0.5


@cuda_test
def test_cuda_float16_with_grad_scaler_on_a_card_without_bfloat16(monkeypatch, tmp_path, capsys):
    chosen = []
    real_autocast_dtype = opt4.autocast_dtype
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: False)
    monkeypatch.setattr(opt4, "autocast_dtype", lambda device: chosen.append(real_autocast_dtype(device)) or chosen[-1])
    json_path = tmp_path / "result.json"
    monkeypatch.setattr(sys, "argv", ["opt4.py", *GPU_ARGS, "--json", str(json_path)])
    opt4.main()
    assert [dtype for dtype, _ in chosen] == [torch.float16] and read_json(json_path)["final_test_accuracy"] > 0.5
    # fused AdamW takes GradScaler's found-inf flag on the device: the float16 step is captured too
    assert "step: captured as a CUDA graph after 3 warm-up calls" in capsys.readouterr().out


@cuda_test
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
def test_cuda_opt6_two_gpus_with_nccl_end_with_identical_weights(tmp_path):
    json_path = tmp_path / "result.json"
    result = run_python(*TORCHRUN, "opt6.py", *GPU_ARGS, "--json", json_path)
    assert result.returncode == 0, result.stderr
    first, second = checksums(result.stderr)
    assert first == second and read_json(json_path)["world_size"] == 2


@cuda_test
def test_cuda_opt6_under_torchrun_with_one_process_captures_its_step():
    # opt6's docstring: uncaptured only with more than one process; one process under torchrun captures as opt5
    one_process = [arg.replace("--nproc_per_node=2", "--nproc_per_node=1") for arg in TORCHRUN]
    result = run_python(*one_process, "opt6.py", *GPU_ARGS)
    assert result.returncode == 0, result.stderr
    assert "step: captured as a CUDA graph" in result.stdout and "world size 1" in result.stdout, result.stdout
