"""What the chain's tests share: the scripts as modules, a script run in a fresh process, a script's functions called
with what main() would give them. The lab's tests (lab/) use them too."""
import contextlib
import functools
import hashlib
import inspect
import json
import os
import pickle
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn as nn
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.data import DataLoader

import baseline
import common
import opt1
import opt2
import opt3
import opt4
import opt5
import opt6


ROOT = Path(__file__).resolve().parent
SCRIPTS = {"baseline.py": baseline, "opt1.py": opt1, "opt2.py": opt2, "opt3.py": opt3, "opt4.py": opt4}
ALL_SCRIPTS = {**SCRIPTS, "opt5.py": opt5, "opt6.py": opt6}
WHOLE_STEP = ("opt4.py", "opt5.py", "opt6.py")  # opt4 onwards: the training step as one function
CPU = torch.device("cpu")
# Point downloads at a closed local port, so "no network" fails at once on any machine.
NO_NETWORK = {"http_proxy": "http://127.0.0.1:9", "https_proxy": "http://127.0.0.1:9"}
SMALL = ["--synthetic", "--device", "cpu", "--test-size", "256"]
NO_MONITOR = SimpleNamespace(step=lambda: None)  # what common.step_monitor yields, minus progress and profiling
# What opt1 onwards run on this machine's CPU: bfloat16 where it has a bfloat16 unit, else float32.
CPU_AMP_DTYPE = opt1.autocast_dtype(CPU)[0]


@pytest.fixture(autouse=True)
def cudnn_settings_restored():
    """A script's main() run in this process turns cuDNN's autotuner on for the whole process: off again after each
    test, so a test that compares two runs on a GPU gets the same convolution algorithms in both."""
    saved = torch.backends.cudnn.benchmark, torch.backends.cudnn.deterministic
    yield
    torch.backends.cudnn.benchmark, torch.backends.cudnn.deterministic = saved


def cuda_test(test):
    """Marks a test `cuda` and skips it on a machine without a CUDA GPU."""
    return pytest.mark.cuda(pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")(test))


def run_python(*args, timeout=600, env=None):
    """Run `python args...` in a fresh process, offline, with `env` added to the environment; returns the
    CompletedProcess."""
    env = {**os.environ, **NO_NETWORK, **(env or {})}
    return finish(start([sys.executable, *map(str, args)], cwd=ROOT, env=env), timeout)


def start(command, cwd, env):
    """`command` started in a session of its own, its output captured: what it starts, `finish` can stop."""
    return subprocess.Popen(command, cwd=cwd, env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            start_new_session=True)


def finish(process, timeout):
    """`process`'s CompletedProcess once it ends. Past `timeout` seconds (or on Ctrl-C) its whole process group is
    stopped, as torchrun is stopped: SIGTERM, which torchrun passes on to its ranks (in sessions of their own), then
    SIGKILL a minute later; so no rank outlives the test to slow the next ones."""
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    except BaseException as error:
        stop(process)
        if isinstance(error, subprocess.TimeoutExpired):
            raise subprocess.TimeoutExpired(process.args, timeout) from None
        raise
    return subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)


def stop(process):
    with contextlib.suppress(ProcessLookupError):  # the group may have ended already
        os.killpg(process.pid, signal.SIGTERM)
    try:
        process.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.communicate()


def free_port():
    """A port on 127.0.0.1 that nothing listens on, for a process group's rendezvous."""
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        return free.getsockname()[1]


def call(function, **available):
    """Call a script's function with the arguments its signature names (they differ along the chain).

    `run`, the object main() gathers what the functions need in, is made of everything `available`, with
    `batch_size` and `accum_steps` as its settings (run.args); opt6 runs as one process unless told otherwise. From
    opt5 on the run holds a list of optimizers (run.optimizers): `optimizer` may be one optimizer or that list.
    """
    args = SimpleNamespace(batch_size=available.get("batch_size"), accum_steps=available.get("accum_steps"))
    module = sys.modules[function.__module__]
    if takes_optimizers(module) and "optimizer" in available:
        optimizer = available.pop("optimizer")
        available.setdefault("optimizers", optimizer if isinstance(optimizer, list) else [optimizer])
    available["run"] = SimpleNamespace(args=args, **{"rank": 0, "world_size": 1, "crop_padding": common.CROP_PADDING,
                                                     **available})
    if hasattr(module, "normalize") and "statistics" not in available:
        available["run"].statistics = common.cifar10_statistics(available.get("device", CPU))
    if hasattr(module, "make_train_step") and "train_data" in available:
        assemble_the_step(module, available["run"], epochs=available.get("epoch", 1))
    names = inspect.signature(function).parameters
    return function(**{name: available[name] for name in names})


def takes_optimizers(module):
    """Whether `module`'s run holds a list of optimizers, run.optimizers (opt4 on; opt5 on: Muon's and AdamW's)."""
    return "optimizers" in inspect.signature(getattr(module, "optimizer_step", lambda optimizer: None)).parameters


def optimizers_of(run):
    """The optimizers a run steps: run.optimizers (opt5 on), or run.optimizer alone."""
    return getattr(run, "optimizers", None) or [run.optimizer]


def assemble_the_step(module, run, epochs):
    """What main() adds to `run` for opt4's whole step (opt4 onwards), uncaptured: the plan's buffers for
    run.train_data, a constant schedule (the last optimizer's rate) for `epochs` epochs, and the step (opt5 on: one
    for each image size, all of them over the one plan)."""
    run.criterion = getattr(run, "criterion", None) or nn.CrossEntropyLoss()
    steps = len(run.train_data[1]) // (run.args.batch_size * run.world_size) // run.args.accum_steps
    rate = optimizers_of(run)[-1].param_groups[0]["lr"]  # a tensor from opt4 on: read without a host read
    run.schedule = rate.repeat(steps * epochs)
    run.plan = module.empty_plan(run.train_data, run.statistics, run.crop_padding, steps, run.args.batch_size,
                                 run.args.accum_steps)
    step = module.make_train_step(run.model, run.criterion, optimizers_of(run), run.plan,
                                  getattr(run, "amp_dtype", torch.float32), getattr(run, "scaler", None))
    if "size" in inspect.signature(module.micro_batch_loss).parameters:  # opt5 onwards: a step per image size
        run.train_steps = {size: functools.partial(step, size) for size in (8, 16, 24, 32)}
    else:
        run.train_step = step


def plan_the_epoch(module, run, image_count, epoch):
    """What train_one_epoch does before an epoch's steps (opt4 on): the epoch drawn (in opt6, each rank's share of it)
    into run.plan, with the epoch's rows of run.schedule."""
    world_size, batch_size = getattr(run, "world_size", 1), run.args.batch_size
    draw = module.draw_epoch(image_count, batch_size * world_size, run.crop_padding, run.generator,
                             run.args.accum_steps)
    if hasattr(module, "rank_share"):
        draw = module.rank_share(draw, getattr(run, "rank", 0), batch_size)
    steps = len(run.plan.rates)
    module.plan_epoch(run.plan, draw, run.schedule[(epoch - 1) * steps:epoch * steps])


def script_evaluate(module, model, dataset):
    """A script's own evaluate() on `dataset`, fed the way that script feeds it, in the precision it picks here."""
    loader = DataLoader(dataset, batch_size=64)
    test_data = opt4.load_to_device(dataset, CPU)
    return call(module.evaluate, model=model, loader=loader, test_data=test_data, batch_size=64,
                amp_dtype=CPU_AMP_DTYPE, device=CPU, size=32, statistics=common.cifar10_statistics(CPU))


def read_json(path):
    lines = Path(path).read_text().splitlines()
    assert len(lines) == 1
    return json.loads(lines[0])


# ------------------------------------------------------------------------- end to end, per script

# Each script's short run that must learn on synthetic data, shared by the CPU test (CI runs it) and the cuda test:
# 2 epochs with the steps each script needs (the recipe's batch of 512 would get 1 step an epoch of 512 images),
# so a change of defaults that would starve a script fails on the CPU too.
LEARN_ARGS = {
    "baseline.py": ["--batch-size", "32", "--train-size", "512"],
    "opt1.py": ["--batch-size", "32", "--train-size", "512", "--no-compile"],
    "opt2.py": ["--batch-size", "32", "--train-size", "512", "--workers", "2", "--no-compile"],
    # opt3 onwards at their defaults: uncompiled; opt5 and opt6 16x16, then 32x32
    "opt3.py": ["--batch-size", "16", "--train-size", "512"],
    "opt4.py": ["--batch-size", "16", "--train-size", "512"],
    "opt5.py": ["--batch-size", "16", "--train-size", "512"],
    "opt6.py": ["--batch-size", "16", "--train-size", "512"],
}
EVAL_TRANSFORM = {"baseline.py": common.plain_transform, "opt1.py": common.plain_transform,
                  "opt2.py": common.normalized_transform, "opt3.py": None, "opt4.py": None, "opt5.py": None, "opt6.py": None}


def assert_saved_weights_match_the_report(weights, report, module, transform):
    """The saved state_dict loads into a fresh ResNet10 and scores what the run reported for its last epoch."""
    model = common.ResNet10()
    model.load_state_dict(torch.load(weights))  # strict: fails on an `_orig_mod.` prefix
    test_set = common.synthetic_cifar10(256, train=False, transform=transform and transform())
    loss, accuracy = script_evaluate(module, model, test_set)
    # Accuracy reaches 100 % early on this data; the test loss still moves every epoch, so it names the epoch.
    first_loss, last_loss = report["epochs"][0]["test_loss"], report["epochs"][-1]["test_loss"]
    assert loss == pytest.approx(last_loss, rel=0.03)
    assert first_loss != pytest.approx(last_loss, rel=0.03), "the comparison must be able to tell the epochs apart"
    assert accuracy == pytest.approx(report["final_test_accuracy"], abs=0.01)


# ------------------------------------------------- the user's machine: one line for each setup the scripts can't use
# Each setup is made on this CPU by replacing torch's view of the machine in the script's own process, then running
# the script: FAKE_MACHINE's `patches` run first. The data directory is empty and there is no network, so a verdict
# that came after loading the data would read "CIFAR-10 is not in ..." instead.

FAKE_MACHINE = """
import runpy, sys, warnings
import torch, torchvision  # torchvision first: on import it checks that its CUDA version is torch's
{patches}
sys.argv = {argv!r}
runpy.run_path({script!r}, run_name="__main__")
"""
# A GPU that torch sees: {name}, sm_{capability}, {count} of them, and a CUDA 13.0 build's architectures
VISIBLE_GPU = """
torch.version.cuda = "13.0"
torch.cuda.is_available = lambda: True
torch.cuda.device_count = lambda: {count}
torch.cuda.get_device_capability = lambda index=None: ({capability} // 10, {capability} % 10)
torch.cuda.get_device_name = lambda index=None: {name!r}
torch.cuda.get_arch_list = lambda: ["sm_75", "sm_80", "sm_86", "sm_90", "sm_100", "sm_120"]
torch.cuda.is_bf16_supported = lambda including_emulation=True: including_emulation or {capability} >= 80
"""
# A data folder that is not there (torchvision's failed download makes it empty: in the temp folder, not the repository)
NO_DATA = ["--data-dir", str(Path(tempfile.gettempdir()) / "fast-cifar-no-such-folder"), "--epochs", "1",
           "--train-size", "64", "--test-size", "64", "--batch-size", "32"]


def run_on_fake_machine(patches, script, *args, env=None):
    code = FAKE_MACHINE.format(patches=patches, argv=[script, *map(str, args)], script=script)
    return run_python("-c", code, env=env, timeout=300)


def assert_one_error_line(result, *says):
    assert result.returncode == 2, result.stderr
    assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr, result.stderr
    assert all(words in result.stderr for words in says), result.stderr
    assert "CIFAR-10 is not in" not in result.stderr, "the verdict must come before the data"


# --------------------------------------------------------------------------------- real data path

def write_tiny_cifar10(root, train_per_file=20, test_size=30):
    """A few random images in torchvision's on-disk CIFAR-10 layout; returns the first train image."""
    folder = root / "cifar-10-batches-py"
    folder.mkdir(parents=True)
    rng = np.random.default_rng(0)
    names = [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]
    for name in names:
        size = test_size if name == "test_batch" else train_per_file
        batch = {"data": rng.integers(0, 256, (size, 3072), dtype=np.uint8),
                 "labels": rng.integers(0, 10, size).tolist()}
        with open(folder / name, "wb") as file:
            pickle.dump(batch, file)
        if name == "data_batch_1":
            first = batch["data"][0].reshape(3, 32, 32)
    with open(folder / "batches.meta", "wb") as file:
        pickle.dump({"label_names": [f"class{i}" for i in range(10)]}, file)
    return first


def copy_without_git(folder, *names):
    """The named files of this checkout copied into `folder`, as a source archive unpacks them: no .git above."""
    for name in names:
        (folder / name).parent.mkdir(exist_ok=True)
        shutil.copy(ROOT / name, folder / name)
    # git looks no higher than `folder`, wherever the temporary folders are
    return {"GIT_CEILING_DIRECTORIES": str(folder.parent)}


def onecycle_lr_after(total_steps, max_lr, steps=None):
    """The learning rate after `steps` (default: all total_steps) steps of a OneCycleLR set up as opt2 sets it up."""
    optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=max_lr)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=max_lr, total_steps=total_steps, pct_start=0.25)
    for _ in range(total_steps if steps is None else steps):
        optimizer.step()
        scheduler.step()
    return optimizer.param_groups[0]["lr"]


def drawn_plan(size=100, batch_size=16, epochs=2, accum_steps=1, seed=0):
    """opt4's plan for a training set of `size` images, and the run it belongs to, before any epoch is drawn."""
    args = SimpleNamespace(batch_size=batch_size, accum_steps=accum_steps)
    steps = size // batch_size // accum_steps
    train_data = torch.zeros(size, 3, 32, 32, dtype=torch.uint8), torch.zeros(size, dtype=torch.long)
    statistics = common.cifar10_statistics(CPU)
    plan = opt4.empty_plan(train_data, statistics, common.CROP_PADDING, steps, batch_size, accum_steps)
    run = SimpleNamespace(args=args, device=CPU, generator=torch.Generator().manual_seed(seed),
                          crop_padding=common.CROP_PADDING, plan=plan,
                          schedule=opt4.onecycle_schedule(0.01, steps * epochs, CPU))
    return run


def bare_plan(module, steps, batch_size):
    """`module`'s plan of `steps` steps of `batch_size` over a training set of zeros, for a test of the update alone."""
    train_data = torch.zeros(steps * batch_size, 3, 32, 32, dtype=torch.uint8), torch.zeros(steps * batch_size)
    return module.empty_plan(train_data, common.cifar10_statistics(CPU), common.CROP_PADDING, steps, batch_size)


def plan_tensors(plan):
    """The plan's tensors by name: its buffers and the data it gathers from (not its settings or its steps left)."""
    return {name: value for name, value in vars(plan).items() if torch.is_tensor(value)}


# ------------------------------------------------------ float16 + GradScaler: a GPU path, run on the CPU


def small_net():
    """A conv net with BatchNorm, small enough for float16 on the CPU (slow there) to take a second."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 16, 3, padding=1, bias=False), nn.BatchNorm2d(16), nn.ReLU(),
                         nn.AdaptiveAvgPool2d(8), nn.Flatten(), nn.Linear(16 * 64, 10))


def constant_schedule(optimizer):
    """A scheduler that keeps `optimizer`'s rate, for the scripts that step one (opt1-opt3); None for a list of them
    (opt5 on: the step reads its rate off the run's table, as opt4's does)."""
    return None if isinstance(optimizer, list) else torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)


def shipped_optimizer(script, model, lr=1e-2, dtype=torch.float16, device=CPU):
    """The optimizer as `script` builds it: AdamW, fused from opt3 on, its rate in a tensor from opt4 on; opt5 and opt6
    a list, run.optimizers: Muon for the filters, its rate a tensor and its Newton-Schulz matmuls in `dtype` (float16:
    as on a GPU without bfloat16), then that AdamW for the rest (AdamW's alone for a model without filters)."""
    module = ALL_SCRIPTS[script]
    if module is opt3:  # built in its main()
        return torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.05, fused=True)
    if takes_optimizers(module):
        parameters = list(model.parameters())
        filters, others = [p for p in parameters if p.ndim == 4], [p for p in parameters if p.ndim != 4]
        if not filters or not hasattr(module, "Muon"):  # opt4: AdamW alone, in a list
            return [module.adamw(parameters, lr, device)]
        adamw = module.adamw(others, lr, device)
        muon = module.Muon(filters, torch.tensor(lr, device=device), adamw.defaults["weight_decay"], steps=3,
                           dtype=dtype)
        return [muon, adamw]
    if hasattr(module, "adamw"):
        return module.adamw(model.parameters(), lr, device)
    return torch.optim.AdamW(model.parameters(), lr=lr)


def step_of(script, model, dataset, device, compiled=False):
    """`script`'s run, assembled as its main() does (float32, batches of 32, 2 epochs, seed 0), and its training step at
    32x32: the step main() would capture on a GPU, with the model compiled as --compile does or not at all."""
    module = ALL_SCRIPTS[script]
    if compiled:
        model.compile(dynamic=False)
    optimizer = shipped_optimizer(script, model, dtype=torch.float32, device=device)
    run = SimpleNamespace(args=SimpleNamespace(batch_size=32, accum_steps=1), rank=0, world_size=1, device=device,
                          model=model, **{"optimizers" if takes_optimizers(module) else "optimizer": optimizer},
                          crop_padding=common.CROP_PADDING,
                          scaler=torch.amp.GradScaler(device.type, enabled=False), amp_dtype=torch.float32,
                          generator=torch.Generator(device).manual_seed(0),
                          augment_generator=torch.Generator(device).manual_seed(0),
                          train_data=opt4.load_to_device(dataset, device), statistics=common.cifar10_statistics(device))
    assemble_the_step(module, run, epochs=2)
    return run, run.train_steps[32] if hasattr(run, "train_steps") else run.train_step  # opt5 on: a step per size


# --------------------------------------------------- gradient accumulation in opt4 and opt6, one process

def bn_free_net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 30 * 30, 10))


# ------------------------------------------------------------------------- opt6: DDP under torchrun

TORCHRUN = ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]  # for run_python
DDP_ARGS = [*SMALL, "--epochs", "2", "--batch-size", "16", "--no-compile"]


# In a rank's process: opt6.evaluate wrapped to hash the bytes of every parameter and buffer of the model just
# evaluated (a hash, not the model: DDP's wrapper must not outlive the process group), and the last hash printed
# on stderr after opt6.main(). The ranks are in step when their hashes are equal.
WEIGHTS_CHECKSUM = """
import hashlib
checksums, real_evaluate = [], opt6.evaluate


def evaluate(run, *args):
    result = real_evaluate(run, *args)
    digest = hashlib.sha256()
    for tensor in [*run.model.parameters(), *run.model.buffers()]:
        digest.update(tensor.detach().cpu().reshape(-1).view(torch.uint8).numpy().tobytes())
    checksums.append(digest.hexdigest()[:16])
    return result


opt6.evaluate = evaluate
"""
PRINT_WEIGHTS_CHECKSUM = """
print(f"rank {{os.environ.get('RANK', 0)}}: weights checksum {{checksums[-1]}}", file=sys.stderr)
"""

CHECKSUM_RANK = """
import os, sys
sys.path.insert(0, {root!r})
import torch
import common, opt6
common.PROGRESS_SECONDS = 0  # a progress line after every step where a rank prints: a count, not a clock's
""" + WEIGHTS_CHECKSUM + """
sys.argv[0] = "opt6.py"
opt6.main()
""" + PRINT_WEIGHTS_CHECKSUM


def checksums(stderr):
    # Found anywhere, not per line: two ranks writing to stderr at once can share a line.
    return sorted(re.findall(r"weights checksum ([0-9a-f]{16})", stderr))


def image_hash(image):
    """A short hash of one uint8 image's pixels, as INSTRUMENTED_RANK names the test images a rank evaluates."""
    return hashlib.sha256(image.numpy().tobytes()).hexdigest()[:16]


# ------------------------------------------------------------------------------------ host reads

HOST_READS = {"item", "tolist", "cpu", "numpy", "__bool__", "__float__", "__int__", "__index__", "__format__",
              "__repr__"}


class CountHostReads(TorchFunctionMode):
    """Counts the tensor calls that copy a value to the host; on a GPU each one waits for the device."""

    def __init__(self):
        super().__init__()
        self.reads = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", None) in HOST_READS:
            self.reads.append(func.__name__)
        return func(*args, **(kwargs or {}))


class CountScalarReads(TorchDispatchMode):
    """Counts aten._local_scalar_dense, the op under .item() and a tensor's bool() or float(), as the dispatcher sees
    it: it also sees what torch's own Python code reads, but not a C++ kernel's reads nor .tolist()."""

    def __init__(self):
        super().__init__()
        self.reads = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.reads += func is torch.ops.aten._local_scalar_dense.default
        return func(*args, **(kwargs or {}))
