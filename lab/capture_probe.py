"""The project's ResNet10 training step on a GPU, eager uncaptured vs eager captured as one CUDA graph (no
torch.compile) vs compiled and captured, at a few batch sizes and image sizes: the probe behind
h200-d264298/capture-probe-2.log. Prints one JSON line per configuration: seconds from the model's creation to a steady
step (compile, cuDNN autotuning, warm-up, capture) and the steady ms a step (median of 5 chunks of 40 steps, CUDA
events). The step is opt4's in outline (a batch gathered from uint8 images on the GPU and normalized, bfloat16
autocast, channels_last, label smoothing 0.1, fused AdamW with its rate in a tensor), not opt4's own code.

    python lab/capture_probe.py [--compiled]

On a CPU it runs one tiny configuration uncaptured, as a rehearsal.
"""
import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F

import root  # noqa: F401  (first: the repository's root on sys.path, for the scripts and common.py)
import common  # noqa: E402


def make_step(model, optimizer, images, labels, statistics_, batch, size, gen):
    mean, std = statistics_

    def step():
        idx = torch.randint(0, images.shape[0], (batch,), device=images.device)  # default generator: capture-safe
        x = (images[idx].float() - mean) / std
        if size != x.shape[-1]:
            x = F.interpolate(x, size=(size, size), mode="bilinear", antialias=True, align_corners=False)
        x = x.contiguous(memory_format=torch.channels_last)
        with torch.autocast(images.device.type, dtype=torch.bfloat16, cache_enabled=False):
            out = model(x)
            loss = F.cross_entropy(out, labels[idx], label_smoothing=0.1)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)
    return step


def probe(mode, batch, size, device, chunks=5, per_chunk=40):
    torch.manual_seed(0)
    t0 = time.perf_counter()
    images = torch.randint(0, 256, (50_000, 3, 32, 32), dtype=torch.uint8, device=device)
    labels = torch.randint(0, 10, (50_000,), device=device)
    stats = (torch.tensor([common.CIFAR10_MEAN, common.CIFAR10_STD], device=device) * 255).view(2, 1, 3, 1, 1)
    model = common.ResNet10().to(device, memory_format=torch.channels_last)
    if mode == "compiled+graph":
        model.compile()
    lr = torch.tensor(1e-3, device=device) if device.type == "cuda" else 1e-3
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.05,
                                  fused=device.type == "cuda", capturable=device.type == "cuda")
    gen = torch.Generator(device).manual_seed(0)
    step = make_step(model, optimizer, images, labels, stats, batch, size, gen)
    # grads exist before capture (zero_grad(set_to_none=False) keeps them at their addresses)
    if device.type == "cuda" and mode != "eager":
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(3):
                step()
        torch.cuda.current_stream().wait_stream(s)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step()
        run = graph.replay
    else:
        for _ in range(3):
            step()
        run = step
    run()
    if device.type == "cuda":
        torch.cuda.synchronize()
    setup = time.perf_counter() - t0
    times = []
    for _ in range(chunks):
        if device.type == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            for _ in range(per_chunk):
                run()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) / per_chunk)
        else:
            t = time.perf_counter()
            for _ in range(per_chunk):
                run()
            times.append((time.perf_counter() - t) * 1000 / per_chunk)
    return {"mode": mode, "batch": batch, "size": size, "setup_s": round(setup, 2),
            "ms_per_step": round(statistics.median(times), 3), "chunks_ms": [round(t, 3) for t in times],
            "img_per_s": round(batch / statistics.median(times) * 1000)}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--compiled", action="store_true", help="also the compiled+graph configurations (cold compiles)")
    a = p.parse_args()
    device = torch.device(a.device)
    torch.backends.cudnn.benchmark = True
    if device.type != "cuda":
        print(json.dumps(probe("eager", 16, 32, device, chunks=2, per_chunk=2)))
        return
    print(json.dumps({"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__}))
    configs = [("eager", 128, 32), ("eager+graph", 128, 32), ("eager+graph", 512, 32), ("eager+graph", 512, 16),
               ("eager+graph", 512, 24), ("eager", 512, 32)]
    if a.compiled:
        configs += [("compiled+graph", 128, 32), ("compiled+graph", 512, 32)]
    for mode, batch, size in configs:
        try:
            print(json.dumps(probe(mode, batch, size, device)), flush=True)
        except Exception as e:  # a probe that fails says so and the rest go on
            print(json.dumps({"mode": mode, "batch": batch, "size": size, "error": repr(e)[:300]}), flush=True)


if __name__ == "__main__":
    main()
