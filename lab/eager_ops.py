"""Count the kernel-launching ops a traced training step runs outside compiled code.

    python lab/eager_ops.py TRACE

TRACE is what a script's `--profile DIR` wrote (torch.profiler's tensorboard_trace_handler, Chrome trace JSON): the
folder DIR (its newest trace is read), or one trace file, `.json` or gzipped `.json.gz`.

The rule. Within each `ProfilerStep#N` span, take the aten ops on each thread that no compiled code encloses, and of
those only the outermost (an op called inside another counts with it, not on its own). Compiled code is an inductor
graph's call (a `## Call CompiledFxGraph ...` span) and, on a GPU, a CUDA graph's replay (a span whose name holds
`CUDAGraph` or `cudaGraphLaunch`). Count an outermost op if it, or an aten op nested in it, launches a kernel: anything
but views and metadata (METADATA below). So a `contiguous()` or `to()` that copies counts, one that returns its input
does not. A region compiled with backend="eager" or "aot_eager" runs aten ops, and they count.

Prints the count per step and the most frequent op names. Standard library only.
"""
import collections
import gzip
import json
import os
import sys

# aten ops that launch no kernel: views, aliases, allocation without a fill, and shape or metadata queries
METADATA = {
    "_has_compatible_shallow_copy_type", "_reshape_alias", "_unsafe_view", "alias", "as_strided", "chunk",
    "contiguous", "detach", "detach_", "diagonal", "dim", "empty", "empty_like", "empty_strided", "expand",
    "expand_as", "flatten", "is_nonzero", "lift_fresh", "narrow", "numpy_T", "permute", "reshape", "resolve_conj",
    "resolve_neg", "result_type", "select", "set_", "size", "slice", "split", "split_with_sizes", "squeeze",
    "stride", "t", "to", "transpose", "type_as", "unbind", "unflatten", "unsqueeze", "view", "view_as",
}
TRACE_ENDINGS = (".json", ".json.gz")


def fail(message):
    """One line on stderr, exit status 2."""
    print(f"eager_ops.py: {message}", file=sys.stderr)
    sys.exit(2)


def trace_file(path):
    """`path` itself, or the newest trace file under the folder `path`."""
    if not os.path.isdir(path):
        return path
    found = [os.path.join(folder, name) for folder, _, names in os.walk(path) for name in names
             if name.endswith(TRACE_ENDINGS)]
    if not found:
        fail(f"no .json or .json.gz trace under {path}")
    return max(found, key=os.path.getmtime)


def complete_events(path):
    """The trace's complete events (phase "X": a name, a thread, a start and a duration)."""
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as file:
        events = json.load(file)["traceEvents"]
    return [event for event in events if event.get("ph") == "X" and "dur" in event]


def within(inner, outer):
    """Whether `inner` runs on `outer`'s thread, inside its span."""
    return (inner["tid"] == outer["tid"] and outer["ts"] <= inner["ts"]
            and inner["ts"] + inner["dur"] <= outer["ts"] + outer["dur"])


def is_compiled(event):
    name = event["name"]
    return name.startswith("## Call CompiledFxGraph") or "CUDAGraph" in name or "cudaGraphLaunch" in name


def launches_a_kernel(op):
    return op["name"][len("aten::"):] not in METADATA


def counted_ops(events):
    """The traced steps, and the outermost aten ops outside compiled code in them that launch a kernel."""
    steps = [event for event in events if event["name"].startswith("ProfilerStep#")]
    compiled = [event for event in events if is_compiled(event)]
    ops = [event for event in events if event.get("cat") == "cpu_op" and event["name"].startswith("aten::")
           and any(within(event, step) for step in steps) and not any(within(event, call) for call in compiled)]
    ops.sort(key=lambda op: (op["tid"], op["ts"], -op["dur"]))  # each op after the ops that enclose it
    outermost, nested = [], collections.defaultdict(list)
    for op in ops:
        if outermost and within(op, outermost[-1]):
            nested[id(outermost[-1])].append(op)
        else:
            outermost.append(op)
    counted = [op for op in outermost if launches_a_kernel(op) or any(map(launches_a_kernel, nested[id(op)]))]
    return steps, counted


def main():
    if len(sys.argv) != 2 or sys.argv[1] in ("-h", "--help"):
        print(__doc__.strip())
        sys.exit(0 if len(sys.argv) == 2 else 2)
    path = sys.argv[1]
    if not os.path.exists(path):
        fail(f"no such file or folder: {path}")
    path = trace_file(path)
    steps, counted = counted_ops(complete_events(path))
    if not steps:
        fail(f"no ProfilerStep spans in {path}: not a --profile trace of training steps")
    per_step = [sum(within(op, step) for op in counted) for step in steps]
    names = collections.Counter(op["name"] for op in counted)
    most = ", ".join(f"{name} {count / len(steps):g}" for name, count in names.most_common(8))
    print(f"{path}: {len(steps)} steps traced")
    print(f"kernel-launching ops a step outside compiled code: {sum(per_step) / len(steps):.1f} "
          f"(each step: {', '.join(map(str, per_step))})")
    print(f"most frequent, a step: {most or 'none'}")


if __name__ == "__main__":
    main()
