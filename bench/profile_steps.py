"""Where a training step's time goes: torch.profiler over a few steps of train_ddp.py or
train_fsdp.py.

    python3 bench/profile_steps.py train_fsdp.py NAME FIRST LAST -- --nproc_per_node 2 SCRIPT k=v
    python3 bench/profile_steps.py .baselines/nanoGPT/train.py NAME FIRST LAST -- --n_layer=12 ...

Writes a copy of the trainer to .baselines/prof/NAME/ (ignored by git) with a profiler window over
the steps after FIRST up to LAST, then runs it with torchrun (the arguments after `--`; SCRIPT
stands for the copy), or with python3 alone where `--` is followed by SCRIPT. nanoGPT's
train.py (the same window, its iterations counted from 0) runs with python3 in its own folder,
the arguments after `--` its own: one process, as bench.py runs it.
Each rank prints one `PROF` line: the window's wall time, how long the GPU ran any kernel (the
union of kernel intervals: 1 - busy/wall is the time the GPU sat idle), the union of non-NCCL
kernels, the sum of NCCL kernel times (an NCCL kernel also runs while it waits for the other rank,
so a large sum on one rank points at the other) and the count of GPU activities (kernels, copies
and memsets). Rank 0 also prints the top kernels and host calls, the operator chain above every
cudaMemcpyAsync, cudaStreamSynchronize, cudaEventSynchronize and cudaDeviceSynchronize, i.e. where
the host waited for the GPU; `KIND` lines: the kernel time a step by kind (matmul, attention,
inductor's fused kernels by what they hold, the optimizer); `TOP` lines: each kind's three
largest kernels; and `GAP` lines: the stretches in which the GPU sat idle, each charged to the
operators that launched the kernel ending it (where the host was late).
PROF_STACK=1 records Python stacks in the profile too. CUDA only.
A tiered run (model.embedding_gpu_rows): rank 0 also prints one `HOST` line per TieredEmbedding
method (stage, start_step, gradient_ready, step, write_to_tables): its calls and host time in the
window.
"""
import collections
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
ANCHOR = ("        result, batches = train_step(model, batches, optimizer, scheduler, scaler, "
          "setup, run)\n")
NANOGPT_ANCHOR = "    lr = get_lr(iter_num) if decay_lr else learning_rate\n"  # loop's first


class Window:
    """The profiler between two steps; the trainer's copy calls window.at(step, rank) each step."""

    def __init__(self, name, first, last):
        self.name, self.first, self.last = name, first, last

    def at(self, step, rank):
        if step == self.first:
            torch.cuda.synchronize()
            self.profile = torch.profiler.profile(
                activities=[torch.profiler.ProfilerActivity.CPU,
                            torch.profiler.ProfilerActivity.CUDA],
                with_stack=bool(os.environ.get("PROF_STACK")))
            self.profile.__enter__()
            self.start = time.perf_counter()
        if step == self.last:
            torch.cuda.synchronize()
            wall = time.perf_counter() - self.start
            self.profile.__exit__(None, None, None)
            self.report(wall, rank)

    def report(self, wall, rank):
        events = self.profile.events()
        kernels = sorted((e.time_range.start, e.time_range.end, e.name) for e in events
                         if e.device_type == torch.autograd.DeviceType.CUDA)
        busy = compute = nccl = 0
        busy_end = compute_end = -1
        for start, end, name in kernels:
            if end > busy_end:
                busy, busy_end = busy + end - max(start, busy_end), end
            if "nccl" in name.lower():
                nccl += end - start
            elif end > compute_end:
                compute, compute_end = compute + end - max(start, compute_end), end
        print(f"PROF rank {rank} {self.name}: wall {wall * 1e3:.1f} ms for "
              f"{self.last - self.first} steps, GPU busy (any kernel) {busy / 1e3:.1f} ms, "
              f"compute-kernel union {compute / 1e3:.1f} ms, nccl kernel sum {nccl / 1e3:.1f} ms, "
              f"{len(kernels)} GPU activities", flush=True)
        if rank != 0:
            return
        averages = self.profile.key_averages()
        for average in averages:
            if average.key.startswith("TieredEmbedding."):
                print(f"HOST {average.key}: {average.count} calls, "
                      f"{average.cpu_time_total / 1e3:.1f} ms", flush=True)
        print(averages.table(sort_by="self_cuda_time_total", row_limit=25), flush=True)
        print(averages.table(sort_by="self_cpu_time_total", row_limit=15), flush=True)
        chains = collections.Counter()
        for event in events:
            if event.name in ("cudaMemcpyAsync", "cudaStreamSynchronize", "cudaEventSynchronize",
                              "cudaDeviceSynchronize"):
                chain, parent = [], event.cpu_parent
                while parent is not None and len(chain) < 7:
                    chain.append(parent.name[:60])
                    parent = parent.cpu_parent
                chains[(event.name, " <- ".join(chain))] += 1
        for (name, chain), count in chains.most_common(25):
            print("CHAIN", name, count, chain, flush=True)
        steps = self.last - self.first
        for kind, (total, count) in kernel_kinds(kernels).items():
            print(f"KIND {kind}: {total / 1e3 / steps:.1f} ms a step, "
                  f"{100 * total / max(busy, 1):.1f}% of the GPU's busy time, {count} "
                  "activities", flush=True)
        for kind, names in largest_kernels(kernels).items():
            for name, (total, count) in names:
                print(f"TOP {kind}: {total / 1e3 / steps:.1f} ms a step, {count} activities, "
                      f"{name[:90]}", flush=True)
        gaps = idle_gaps(*launch_links(self.profile))
        print(f"GAP {sum(t for t, _ in gaps.values()) / 1e3:.1f} ms of GPU idle in "
              f"{sum(n for _, n in gaps.values())} gaps of {GAP_US} us or more, by the operators "
              "that launched the activity ending each:", flush=True)
        for chain, (total, count) in sorted(gaps.items(), key=lambda item: -item[1][0])[:15]:
            print(f"GAP {total / 1e3:.2f} ms {count} {chain}", flush=True)


GAP_US = 20  # a GPU idle this long or longer counts as a gap

# a GPU activity's kind, by the first pattern its name holds (lower case); inductor names its
# fused Triton kernels after the operators they hold
KINDS = (("matmul (cuBLAS, CUTLASS)", ("gemm", "nvjet", "xmma", "cutlass", "cublas")),
         ("attention", ("sdpa", "flash", "fmha", "attention")),
         ("nccl", ("nccl",)),
         ("optimizer (fused AdamW)", ("multi_tensor", "adam")),
         ("fused: loss (log_softmax, nll)", ("log_softmax", "nll")),
         ("fused: layer norm", ("layer_norm",)),
         ("fused: GELU", ("tanh", "gelu", "erf")),  # GPT-2's is tanh's, nanoGPT's erf's
         ("fused: other", ("triton",)),
         ("copies and memsets", ("memcpy", "memset")))


def kind_of(name):
    lower = name.lower()
    return next((kind for kind, patterns in KINDS if any(p in lower for p in patterns)),
                "other (ATen)")


def kernel_kinds(kernels):
    """{kind: (us, activities)} over (start, end, name) GPU activities, largest first."""
    kinds = {}
    for start, end, name in kernels:
        kind = kind_of(name)
        total, count = kinds.get(kind, (0, 0))
        kinds[kind] = (total + end - start, count + 1)
    return dict(sorted(kinds.items(), key=lambda item: -item[1][0]))


def largest_kernels(kernels, top=3):
    """{kind: [(name, (us, activities))]}: each kind's `top` kernels by their summed time, so
    that a kind's figure says which kernels make it."""
    by_name = {}
    for start, end, name in kernels:
        total, count = by_name.get(name, (0, 0))
        by_name[name] = (total + end - start, count + 1)
    largest = {}
    for name, figures in sorted(by_name.items(), key=lambda item: -item[1][0]):
        names = largest.setdefault(kind_of(name), [])
        if len(names) < top:
            names.append((name, figures))
    return largest


def launch_links(profile):
    """(kernels, operators): each GPU activity as (start us, end us, the id of the host operator
    that launched it), and the host operators by id. Read from the profiler's raw events: some
    torch versions (2.11) keep no launch link on the events that profile.events() returns."""
    results = profile.profiler.kineto_results
    origin = results.trace_start_ns()
    kernels, operator_keys = [], set()
    for event in results.events():
        start, end = (event.start_ns() - origin) / 1e3, (event.end_ns() - origin) / 1e3
        if event.device_type() == torch.autograd.DeviceType.CUDA:
            kernels.append((start, end, event.linked_correlation_id()))
        elif event.linked_correlation_id() == 0:  # an operator, not a runtime call
            operator_keys.add((event.correlation_id(), start))
    # a runtime call (cudaLaunchKernel) has CUPTI's id, which may equal an operator's: the start
    # time tells them apart
    operators = {e.id: e for e in profile.events() if (e.id, e.time_range.start) in operator_keys}
    return kernels, operators


def idle_gaps(kernels, operators):
    """{operator chain: (idle us, gaps)}: each stretch of at least GAP_US in which no GPU
    activity ran, charged to the host operators that launched the activity ending it (the host
    was late there)."""
    gaps, busy_end = {}, None
    for start, end, launched_by in sorted(kernels):
        if busy_end is not None and start - busy_end >= GAP_US:
            chain, operator = [], operators.get(launched_by)
            while operator is not None and len(chain) < 4:
                chain.append(operator.name[:50])
                operator = operator.cpu_parent
            key = " <- ".join(chain) or "(no operator)"
            total, count = gaps.get(key, (0, 0))
            gaps[key] = (total + start - busy_end, count + 1)
        busy_end = max(busy_end or 0, end)
    return gaps


def labelled(label, method):
    def run_labelled(*args, **kwargs):
        with torch.profiler.record_function(label):
            return method(*args, **kwargs)
    return run_labelled


def label_methods(namespace):
    """Give the tiered embedding's host work a name in the profile (a record_function per call)."""
    tiered_class = namespace.get("TieredEmbedding")
    for name in ("stage", "start_step", "gradient_ready", "step", "write_to_tables"):
        if hasattr(tiered_class, name):
            method = getattr(tiered_class, name)
            setattr(tiered_class, name, labelled(f"TieredEmbedding.{name}", method))


def instrument(text, nanogpt):
    """The trainer's text with the window's hook in its loop; None where its line moved."""
    anchor = NANOGPT_ANCHOR if nanogpt else ANCHOR
    if anchor not in text:
        return None
    if nanogpt:  # before the iteration: iter_num iterations done
        hook = "    __import__('profile_steps').Window.shared.at(iter_num, 0)\n"
        return text.replace(anchor, hook + anchor)
    text = text.replace(anchor, anchor + "        __import__('profile_steps').Window.shared.at("
                        "run.step, rank)\n")
    return text.replace('\nif __name__ == "__main__":\n',
                        '\n__import__("profile_steps").label_methods(globals())\n\n'
                        'if __name__ == "__main__":\n', 1)


def main():
    script, name, first, last = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    args = sys.argv[sys.argv.index("--") + 1:]
    nanogpt = (REPO / script).parent.joinpath("model.py").exists() and script.name == "train.py"
    text = instrument((REPO / script).read_text(), nanogpt)
    if text is None:
        sys.exit(f"error: {script} no longer has the line this script hooks into -> update "
                 f"{'NANOGPT_ANCHOR' if nanogpt else 'ANCHOR'}")
    copy_dir = REPO / ".baselines" / "prof" / name
    copy_dir.mkdir(parents=True, exist_ok=True)
    (copy_dir / script.name).write_text(text)
    paths = [REPO / "bench"]
    if nanogpt:  # its folder: configurator.py is read from there, model.py imported
        cwd = (REPO / script).parent
        command, paths = [sys.executable, str(copy_dir / script.name), *args], paths + [cwd]
    else:
        cwd = REPO
        (copy_dir / "config.yaml").write_text((REPO / "config.yaml").read_text())
        where = args.index("SCRIPT")  # nothing before it: one process started by python3 itself
        command = [*(["torchrun", *args[:where]] if where else [sys.executable]),
                   str(copy_dir / script.name), *args[where + 1:]]
    pythonpath = ":".join([*map(str, paths), os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "PYTHONPATH": pythonpath, "PROF_WINDOW": f"{name}:{first}:{last}"}
    print(" ".join(command), flush=True)
    sys.exit(subprocess.call(command, cwd=cwd, env=env))


if "PROF_WINDOW" in os.environ:  # imported by the trainer's copy
    _name, _first, _last = os.environ["PROF_WINDOW"].rsplit(":", 2)
    Window.shared = Window(_name, int(_first), int(_last))

if __name__ == "__main__":
    main()
