"""The user's machine: one line for each setup the scripts cannot use (torch too old, an old driver, a CPU-only build,
a GPU without kernels, no compiler), with what to do."""
import re
import sys
import warnings

import pytest
import torch

import machine
from conftest import (
    NO_DATA, ROOT, SMALL, VISIBLE_GPU, assert_one_error_line, read_json, run_on_fake_machine, run_python)


# What torch 2.14's c10 warns, once, when cudaGetDeviceCount fails on an old driver (then is_available() is False)
OLD_DRIVER = """
def is_available():
    warnings.warn("CUDA initialization: The NVIDIA driver on your system is too old (found version 12040). Please "
                  "update your GPU driver by downloading and installing a new version from the URL: "
                  "http://www.nvidia.com/Download/index.aspx Alternatively, go to: https://pytorch.org to install a "
                  "PyTorch version that has been compiled with your version of the CUDA driver.")
    return False
torch.cuda.is_available, torch.version.cuda = is_available, "13.0"
"""
CPU_ONLY_BUILD = """
torch.cuda.is_available, torch.version.cuda, torch.version.hip = lambda: False, None, None
"""


@pytest.mark.floor
def test_a_torch_older_than_the_floor_exits_2_with_one_line_and_the_floor_is_requirements_txts():
    result = run_on_fake_machine('torch.__version__ = "2.4.1+cu121"', "opt2.py", *NO_DATA)
    assert_one_error_line(result, "torch 2.4.1+cu121 is older than 2.6, the oldest these scripts run on")
    floor = re.search(r"^torch>=([\d.]+)$", (ROOT / "requirements.txt").read_text(), re.MULTILINE).group(1)
    assert tuple(map(int, floor.split("."))) == machine.OLDEST_TORCH


def test_a_containers_pre_release_build_of_the_floor_is_the_floor(monkeypatch):
    monkeypatch.setattr(torch, "__version__", "2.6.0a0+ecf3bae40a")  # as NVIDIA's containers name theirs
    assert machine.torch_too_old() is None


@pytest.mark.floor
def test_an_old_driver_says_a_gpu_is_there_and_both_remedies_then_trains_on_the_cpu():
    result = run_on_fake_machine(OLD_DRIVER, "opt1.py", "--synthetic", *NO_DATA, "--no-compile")
    assert result.returncode == 0, result.stderr
    first_line = result.stdout.splitlines()[0]
    assert first_line.startswith("a GPU is here, but its NVIDIA driver is too old for this torch's CUDA 13.0 "
                                 "(it runs CUDA 12.4 at most): running on the CPU"), first_line
    assert "update the driver to 580 or newer" in first_line
    assert first_line.endswith(machine.cuda_12_build()[1])  # this torch's CUDA 12.6 build, or 2.14's after it
    assert first_line.endswith("--index-url https://download.pytorch.org/whl/cu126")
    assert "no CUDA GPU" not in result.stdout and "opt1.py on cpu" in result.stdout


def test_an_old_driver_with_device_cuda_exits_2_with_the_remedies():
    result = run_on_fake_machine(OLD_DRIVER, "opt4.py", *NO_DATA, "--device", "cuda")
    assert_one_error_line(result, "--device cuda: a GPU is here, but its NVIDIA driver is too old",
                          "update the driver to 580 or newer", "whl/cu126, or use --device cpu")


def test_a_driver_too_old_for_a_cuda_12_build_is_told_to_update_the_driver_only(monkeypatch):
    def is_available():  # a CUDA 11.4 driver (470) under a CUDA 12.4 build, such as torch 2.6's
        warnings.warn("CUDA initialization: The NVIDIA driver on your system is too old (found version 11040).")
        return False

    monkeypatch.setattr(torch.cuda, "is_available", is_available)
    monkeypatch.setattr(torch.version, "cuda", "12.4")
    assert machine.why_no_cuda() == ("a GPU is here, but its NVIDIA driver is too old for this torch's CUDA 12.4 (it "
                                    "runs CUDA 11.4 at most)", "update the driver to 525 or newer")


def test_a_cpu_only_torch_build_says_so_and_how_to_get_a_cuda_build():
    result = run_on_fake_machine(CPU_ONLY_BUILD, "baseline.py", "--synthetic", *NO_DATA)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[0].startswith(f"this torch ({torch.__version__}) is a CPU-only build: running "
                                                    f"on the CPU (slow; the scripts target CUDA); for an NVIDIA GPU, "
                                                    f"install ")
    result = run_on_fake_machine(CPU_ONLY_BUILD, "baseline.py", *NO_DATA, "--device", "cuda")
    assert_one_error_line(result, "is a CPU-only build", "--index-url https://download.pytorch.org/whl/cu126")


@pytest.mark.parametrize("version, build, command", [
    ("2.6.0+cu124", "this torch's CUDA 12.6 build", "pip install torch==2.6.0 torchvision==0.21.0"),
    ("2.14.1+cu130", "this torch's CUDA 12.6 build", "pip install torch==2.14.1 torchvision==0.29.1"),
    # PyTorch published CUDA 12.6 builds for torch 2.6 to 2.14 only: a newer torch is pointed to 2.14's
    ("2.15.0+cu130", "torch 2.14's CUDA 12.6 build (the last)", 'pip install "torch==2.14.*" "torchvision==0.29.*"'),
])
def test_the_cuda_12_remedy_names_a_build_that_exists_for_this_torch(version, build, command, monkeypatch):
    torchvision = {"2.6.0+cu124": "0.21.0", "2.14.1+cu130": "0.29.1", "2.15.0+cu130": "0.30.0"}[version]
    installed = {"torch": version, "torchvision": torchvision}
    monkeypatch.setattr(torch, "__version__", version)
    monkeypatch.setattr(machine.importlib.metadata, "version", installed.get)
    assert machine.cuda_12_build() == (build, f"{command} --index-url https://download.pytorch.org/whl/cu126")
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: (7, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=None: "Tesla V100-SXM2-16GB")
    monkeypatch.setattr(torch.cuda, "get_arch_list", lambda: ["sm_75", "sm_80", "sm_90"])
    assert f"install {build}, with kernels for sm_50 to sm_90: {command} --index-url" in machine.gpu_without_kernels()
    # a CPU-only build of that torch: this torch's CUDA 12.6 build, or after 2.14 its own CUDA build first
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(sys, "platform", "linux")
    monkeypatch.setattr(torch.version, "cuda", None)
    monkeypatch.setattr(torch.version, "hip", None)
    remedy = machine.why_no_cuda()[1]
    assert remedy.endswith(f"{build}: {command} --index-url https://download.pytorch.org/whl/cu126")
    assert ("a CUDA build of this torch" in remedy) == (version == "2.15.0+cu130")


def test_an_intel_gpu_build_is_not_called_cpu_only(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(sys, "platform", "linux")
    for name, value in {"cuda": None, "hip": None, "xpu": "20250101"}.items():
        monkeypatch.setattr(torch.version, name, value, raising=False)
    assert machine.why_no_cuda() == ("torch sees no CUDA GPU", None)


def test_macos_says_it_has_no_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(sys, "platform", "darwin")
    assert machine.why_no_cuda() == ("macOS has no CUDA", None)


@pytest.mark.parametrize("script", ["baseline.py", "opt5.py"])
def test_a_gpu_the_build_has_no_kernels_for_exits_2_naming_it_and_the_remedy(script):
    patches = VISIBLE_GPU.format(count=1, capability=70, name="Tesla V100-SXM2-16GB")
    result = run_on_fake_machine(patches, script, *NO_DATA)  # --device auto: the GPU is there, so no CPU fallback
    assert_one_error_line(result, "GPU 0 (Tesla V100-SXM2-16GB) is sm_70", "has kernels for sm_75 sm_80 sm_86 sm_90 "
                          "sm_100 sm_120 only",
                          "install this torch's CUDA 12.6 build, with kernels for sm_50 to sm_90",
                          "--index-url https://download.pytorch.org/whl/cu126; or use --device cpu")


@pytest.mark.parametrize("capability, architectures, runs", [
    (86, ["sm_80"], True),          # a kernel for sm_80 runs on sm_86 (same major version)
    (80, ["sm_86"], False),         # but not the other way round
    (90, ["sm_80", "sm_86"], False),  # nor across major versions
    (120, ["sm_90", "compute_90"], True),  # PTX is compiled for any newer GPU
    (75, ["compute_80"], False),    # but not an older one
    (100, ["sm_90a", "sm_100a"], True),
])
def test_gpu_architecture_check_follows_cudas_compatibility_rules(capability, architectures, runs, monkeypatch):
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: divmod(capability, 10))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=None: "GPU")
    monkeypatch.setattr(torch.cuda, "get_arch_list", lambda: architectures)
    assert (machine.gpu_without_kernels() is None) == runs


def fake_compile_failure(*names):
    """An exception as inductor raises it: the first name wraps the next, down to the cause."""
    error = None
    for name in reversed(names):
        wrapper = type(name, (RuntimeError,), {})(f"{name} happened")
        wrapper.__cause__ = error
        error = wrapper
    return error


@pytest.mark.parametrize("names, says", [
    (["InductorError", "InvalidCxxCompiler"], "no C++ compiler for its CPU kernels; install g++"),
    (["BackendCompilerFailed", "TritonMissing"], "no Triton for its GPU kernels"),
    (["InductorError", "GPUTooOldForTriton"], "compute capability 7.0 (V100) and newer only"),
    (["BackendCompilerFailed", "RuntimeError"], "RuntimeError: RuntimeError happened"),
])
def test_a_failed_compile_is_named_by_its_innermost_cause(names, says, monkeypatch):
    monkeypatch.setattr(sys, "platform", "linux")
    assert says in machine.compile_failure(fake_compile_failure(*names))
    # Inductor's InductorError keeps the cause in inner_exception, not __cause__
    error = fake_compile_failure(names[0])
    error.inner_exception = fake_compile_failure(*names[1:])
    assert says in machine.compile_failure(error)


def test_a_gpu_without_triton_is_told_why_it_runs_eager_in_one_line_before_the_data(tmp_path):
    # As on Windows with a GPU: torch installs Triton with itself on Linux only
    patches = VISIBLE_GPU.format(name="NVIDIA H100", capability=90, count=1) + """
import torch.utils._triton
torch.utils._triton.has_triton_package = lambda: False
"""
    result = run_on_fake_machine(patches, "opt2.py", *NO_DATA)
    assert result.stdout.splitlines()[0] == (
        "torch.compile cannot work here: no Triton for its GPU kernels (torch installs Triton with itself on Linux "
        "only); on Windows use WSL2, elsewhere pip install triton; running eager instead (as --no-compile)")
    assert "compile False" in result.stdout.splitlines()[1], "the settings line says it runs eager"
    assert result.returncode == 2 and "CIFAR-10 is not in" in result.stderr  # the data, after the verdict


@pytest.mark.parametrize("capability, on_path, says", [((6, 1), {"gcc"}, "compute capability 7.0 (V100)"),
                                                       ((9, 0), set(), "no C compiler for Triton's kernel launcher"),
                                                       # Triton looks for CC, gcc and clang alone (runtime/build.py)
                                                       ((9, 0), {"cc"}, "no C compiler for Triton's kernel launcher"),
                                                       ((9, 0), {"gcc"}, None), ((9, 0), {"clang"}, None)])
def test_inductors_needs_on_a_gpu_are_checked_without_compiling(capability, on_path, says, monkeypatch):
    machine.compile_problem.cache_clear()
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(sys.modules["torch.utils._triton"], "has_triton_package", lambda: True)
    monkeypatch.setattr(machine.shutil, "which", lambda name: f"/usr/bin/{name}" if name in on_path else None)
    monkeypatch.delenv("CC", raising=False)
    monkeypatch.setattr(torch, "compile", lambda *args, **kwargs: pytest.fail("a trial compile"))
    problem = machine.compile_problem(torch.device("cuda", 0))
    machine.compile_problem.cache_clear()
    assert (problem is None) if says is None else (says in problem), problem


@pytest.mark.floor
@pytest.mark.skipif(sys.platform != "linux", reason="the compiler inductor looks for is Linux's g++")
def test_a_machine_without_a_compiler_runs_eager_and_says_why_and_torch_keeps_its_cuda_home_notice_to_itself(tmp_path):
    # No compiler on the PATH, and a cache of compiled kernels of its own, so none from an earlier run is reused.
    # CUDA_HOME set on a machine without a GPU: importing torch's cpp_extension (compiling does) says so, unasked.
    env = {"PATH": str(tmp_path / "empty"), "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "cache"),
           "CUDA_HOME": str(tmp_path)}
    control = run_python("-c", "import torch.utils.cpp_extension", env=env)
    assert "No CUDA runtime is found" in control.stderr, "the noise this test is about must happen here"
    json_path = tmp_path / "result.json"
    result = run_python("opt1.py", *SMALL, "--epochs", "1", "--train-size", "64", "--batch-size", "32",
                        "--json", json_path, env=env)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[0] == (
        "torch.compile cannot work here: no C++ compiler for its CPU kernels; install g++ (Debian/Ubuntu: apt install "
        "g++); running eager instead (as --no-compile)")
    assert "No CUDA runtime is found" not in result.stdout + result.stderr
    assert "Traceback" not in result.stderr
    assert read_json(json_path)["settings"]["compile"] is False
