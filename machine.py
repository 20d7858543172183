"""What this machine and its torch can run, each verdict one line: a torch older than the floor, no usable CUDA GPU
(and why), a GPU this torch has no kernels for, and why torch.compile cannot work here. common.pick_device asks these
before any data loads; nothing here is a lesson or changes a setting of the run (compile_problem quiets one logger of
torch's import noise): each returns a problem in words, with its remedy, or None.
"""
import contextlib
import functools
import importlib.metadata
import io
import logging
import os
import re
import shutil
import sys
import warnings

import torch

# The oldest torch the scripts run right on: requirements.txt's floor, which CI trains every script on
OLDEST_TORCH = (2, 6)
# PyTorch's own index of CUDA 12.6 builds, which run on NVIDIA drivers from 525 on and, for Linux x86 and Windows, have
# kernels for sm_50 to sm_90: published for torch 2.6 to 2.14 (pytorch/pytorch's RELEASE.md; PyTorch's notice of
# 2026-09-04: no CUDA 12 builds from 2.15 on)
CUDA_12_INDEX = "https://download.pytorch.org/whl/cu126"
LAST_CUDA_12_TORCH = (2, 14)
LAST_CUDA_12_REQUIREMENTS = '"torch==2.14.*" "torchvision==0.29.*"'  # 2.14's torchvision is 0.29
# The oldest NVIDIA driver each CUDA major version runs on (with CUDA's minor version compatibility)
MIN_DRIVER = {11: 450, 12: 525, 13: 580}


def torch_version():
    """This torch's (major, minor): 2.6.0a0+git... (a container's build) is (2, 6)."""
    return tuple(int(number) for number in re.findall(r"\d+", torch.__version__)[:2])


def torch_too_old():
    """Where this torch is older than OLDEST_TORCH (a cluster's or a notebook's own, say), which no test runs on."""
    if torch_version() < OLDEST_TORCH:
        oldest = ".".join(map(str, OLDEST_TORCH))
        return (f"torch {torch.__version__} is older than {oldest}, the oldest these scripts run on: pip install "
                f"'torch>={oldest}' (a build for your GPU: https://pytorch.org/get-started/locally)")
    return None


def why_no_cuda():
    """(None, None) where torch can use a CUDA GPU, else (why not, what to do or None), in words for the log."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        available = torch.cuda.is_available()  # torch warns here when the driver is there but CUDA cannot start
    if available:
        return None, None
    if sys.platform == "darwin":
        return "macOS has no CUDA", None  # and the scripts do not use Apple's GPU (MPS)
    if torch.version.cuda is None and torch.version.hip is None and getattr(torch.version, "xpu", None) is None:
        build, command = cuda_12_build()
        remedy = f"for an NVIDIA GPU, install {build}: {command}"
        if torch_version() > LAST_CUDA_12_TORCH:  # this torch's CUDA 13 build, where the driver is 580 or newer
            remedy = ("for an NVIDIA GPU, install a CUDA build of this torch (https://pytorch.org/get-started/"
                      f"locally); for a driver older than 580, {build}: {command}")
        return f"this torch ({torch.__version__}) is a CPU-only build", remedy
    warning = next((str(w.message) for w in caught if "driver" in str(w.message).lower()), "")
    found = re.search(r"too old \(found version (\d+)\)", warning)
    if found:
        driver_cuda = int(found.group(1))  # the newest CUDA the driver runs, as 1000 x major + 10 x minor
        major = int(torch.version.cuda.split(".")[0])
        remedy = f"update the driver to {MIN_DRIVER.get(major, 'a newer one')} or newer"
        if major > 12:  # a CUDA 12 build runs on drivers from 525 on
            build, command = cuda_12_build()
            remedy += f", or install {build}: {command}"
        return (f"a GPU is here, but its NVIDIA driver is too old for this torch's CUDA {torch.version.cuda} "
                f"(it runs CUDA {driver_cuda // 1000}.{driver_cuda % 1000 // 10} at most)", remedy)
    return "torch sees no CUDA GPU", None


def cuda_12_build():
    """(which build, the pip command) for a CUDA 12.6 build: this torch's, or the last torch's that has one."""
    if torch_version() <= LAST_CUDA_12_TORCH:
        return "this torch's CUDA 12.6 build", f"pip install {this_torch()} --index-url {CUDA_12_INDEX}"
    last = ".".join(map(str, LAST_CUDA_12_TORCH))
    return (f"torch {last}'s CUDA 12.6 build (the last)",
            f"pip install {LAST_CUDA_12_REQUIREMENTS} --index-url {CUDA_12_INDEX}")


def this_torch():
    """This torch and torchvision as pip requirements, without the build tag: torch==2.14.1 torchvision==0.29.1."""
    versions = [importlib.metadata.version(name).split("+")[0] for name in ("torch", "torchvision")]
    return f"torch=={versions[0]} torchvision=={versions[1]}"


def gpu_without_kernels():
    """A visible GPU this torch has no kernels for (nor PTX to build them from), named with the remedy; else None."""
    architectures = torch.cuda.get_arch_list()  # e.g. sm_75 ... sm_120: kernels; compute_90: PTX the driver compiles
    if not architectures or torch.version.cuda is None:  # a build that does not say (ROCm, some source builds)
        return None
    builds = [(arch.split("_")[0], int(re.sub(r"\D", "", arch.split("_")[1]))) for arch in architectures]  # sm, 90
    for index in range(torch.cuda.device_count()):
        major, minor = torch.cuda.get_device_capability(index)
        capability = 10 * major + minor
        # A kernel built for sm_XY runs on sm_XZ for Z >= Y (not on Jetson's sm_53, 62, 72, 87, which torch.cuda's
        # DEVICE_REQUIREMENT sets apart and this check does not); PTX for compute_XY is compiled for any newer GPU.
        if any(kind == "sm" and number // 10 == major and number <= capability or
               kind == "compute" and number <= capability for kind, number in builds):
            continue
        build, command = cuda_12_build()
        remedy = (f"install {build}, with kernels for sm_50 to sm_90: {command}" if capability < 75 else
                  "install a newer torch built for it (https://pytorch.org/get-started/locally)")
        return (f"GPU {index} ({torch.cuda.get_device_name(index)}) is sm_{capability}, and this torch "
                f"({torch.__version__}) has kernels for {' '.join(architectures)} only: {remedy}; or use --device cpu")
    return None


# Why torch.compile failed, by the exception (or the words) that say so, and what to install
COMPILE_FAILURES = {
    "InvalidCxxCompiler": "no C++ compiler for its CPU kernels; install {compiler}",
    "CppCompileError": "the C++ compiler failed on its CPU kernels; install {compiler}",
    "TritonMissing": "no Triton for its GPU kernels (torch installs Triton with itself on Linux only); "
                     "on Windows use WSL2, elsewhere pip install triton",
    "GPUTooOldForTriton": "Triton builds GPU kernels for compute capability 7.0 (V100) and newer only",
    "Failed to find C compiler": "no C compiler for Triton's kernel launcher; install gcc",
}
CXX = {"linux": "g++ (Debian/Ubuntu: apt install g++)", "darwin": "Xcode's command line tools (xcode-select --install)",
       "win32": "Visual Studio's C++ build tools, and run from their Developer Command Prompt"}


@functools.cache
def compile_problem(device):
    """Why torch.compile cannot work on `device` here, with the remedy, or None.

    Read off what inductor needs: a C++ compiler for CPU kernels (found by inductor's own search); for GPU kernels,
    Triton, a GPU of compute capability 7.0 or newer and a C compiler for Triton's launcher. Compiling a trial
    function instead would add a compile before every run.
    """
    # Compiling imports cpp_extension: in a CUDA build of torch that finds a CUDA toolkit (CUDA_HOME or CUDA_PATH, nvcc,
    # /usr/local/cuda) but no GPU, it warns "No CUDA runtime is found, using CUDA_HOME=..." (a print in torch 2.6):
    # noise among a run's first lines, so import it quietly first
    logging.getLogger("torch.utils.cpp_extension").setLevel(logging.ERROR)
    with contextlib.redirect_stderr(io.StringIO()):
        import torch.utils.cpp_extension  # noqa: F401
    if device.type == "cuda":
        from torch.utils._triton import has_triton_package
        if not has_triton_package():
            return COMPILE_FAILURES["TritonMissing"]
        if torch.cuda.get_device_capability(device) < (7, 0):
            return COMPILE_FAILURES["GPUTooOldForTriton"]
        if not (os.environ.get("CC") or any(shutil.which(name) for name in ("gcc", "clang"))):  # Triton's search
            return COMPILE_FAILURES["Failed to find C compiler"]
        return None
    try:
        from torch._inductor import cpp_builder
        cpp_builder.get_cpp_compiler()
    except Exception as error:  # InvalidCxxCompiler, or whatever else stops the search
        return compile_failure(error)
    return None


def compile_failure(error):
    """The innermost cause of a failed compile (inductor wraps what went wrong), in words, with its remedy."""
    causes = []
    while error is not None and error not in causes:
        causes.append(error)
        error = getattr(error, "inner_exception", None) or error.__cause__ or error.__context__
    for cause in reversed(causes):
        for key, words in COMPILE_FAILURES.items():
            if key == type(cause).__name__ or key in str(cause):
                return words.format(compiler=CXX.get(sys.platform, "a C++ compiler"))
    first_line = (str(causes[-1]).strip().splitlines() or [""])[0][:150]
    return f"{type(causes[-1]).__name__}: {first_line}"
