"""Parts of a training step timed alone on one GPU: forward and backward in bf16 of the attention
kernel SDPA picks (flash, cuDNN, memory-efficient) and of the output layer with its loss (whole, or
in chunks of the sequence); and the update, AdamW over shape B's parameters (fused, foreach,
compiled) with the gradient clipping. What a lever can gain at most before a trainer side is spent
on it.

    python3 bench/step_parts.py            # micro-batches of 32 at sequence 1024, shapes A and B
    python3 bench/step_parts.py --attention-only   # the attention kernels and SDPA's own choice
    python3 bench/step_parts.py --optimizer-only   # the update alone
"""
import contextlib
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

MICRO, SEQ, VOCAB = 32, 1024, 8192
# (name, heads, head size): shape A, shape B, and a head size of 80
ATTENTION = [("A 12 x 64", 12, 64), ("B 20 x 64", 20, 64), ("A 12 x 80", 12, 80)]
BACKENDS = {"default": None, "flash": SDPBackend.FLASH_ATTENTION,
            "cudnn": SDPBackend.CUDNN_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION}


def milliseconds(fn, repeats=20):
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / repeats


def attention_times():
    for name, heads, head_size in ATTENTION:
        q, k, v = (torch.randn(MICRO, heads, SEQ, head_size, device="cuda", dtype=torch.bfloat16,
                               requires_grad=True) for _ in range(3))
        grad = torch.randn_like(q)
        # the layout GPT-2 hands SDPA: heads split from one (batch, sequence, 3 x width) tensor
        qkv = torch.randn(MICRO, SEQ, 3 * heads * head_size, device="cuda", dtype=torch.bfloat16)
        split = [t.view(MICRO, SEQ, heads, head_size).transpose(1, 2)
                 for t in qkv.split(heads * head_size, dim=2)]
        names = {backend.value: name for name, backend in SDPBackend.__members__.items()}
        choices = [names[torch._fused_sdp_choice(*tensors, is_causal=True)]
                   for tensors in [(q, k, v), split]]
        print(f"attention {name}: SDPA's default choice {choices} "
              "(contiguous heads, GPT-2's split)", flush=True)
        flops = 4 * MICRO * heads * SEQ * SEQ * head_size / 2 * 3.5  # causal; backward 2.5x
        row = []
        for backend, kind in BACKENDS.items():
            def step():
                with sdpa_kernel(kind) if kind else contextlib.nullcontext():
                    out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
                out.backward(grad)
            try:
                ms = milliseconds(step)
                row.append(f"{backend} {ms:.3f} ms ({flops / ms / 1e9:.0f} TFLOP/s)")
            except RuntimeError as error:
                row.append(f"{backend} failed: {str(error).splitlines()[0][:80]}")
        print(f"attention {name}, micro {MICRO}: " + "; ".join(row), flush=True)


def output_loss(hidden, weight, labels, chunks):
    total = 0
    for h, y in zip(hidden.chunk(chunks, dim=1), labels.chunk(chunks, dim=1)):
        logits = F.linear(h, weight)
        total = total + F.cross_entropy(logits.float().flatten(0, 1), y.flatten(), reduction="sum")
    return total


def output_loss_times():
    for name, width in [("A", 768), ("B", 1280)]:
        hidden = torch.randn(MICRO, SEQ, width, device="cuda", dtype=torch.bfloat16,
                             requires_grad=True)
        weight = torch.randn(VOCAB, width, device="cuda", dtype=torch.bfloat16,
                             requires_grad=True)
        labels = torch.randint(0, VOCAB, (MICRO, SEQ), device="cuda")
        row = []
        for chunks in (1, 4, 8):
            compiled = torch.compile(output_loss)
            def step():
                compiled(hidden, weight, labels, chunks).backward()
            torch.cuda.reset_peak_memory_stats()
            ms = milliseconds(step)
            peak = torch.cuda.max_memory_allocated() / 2**30
            row.append(f"{chunks} chunk(s) {ms:.3f} ms, peak {peak:.2f} GiB")
        print(f"output layer + loss {name} (width {width}), micro {MICRO}: " + "; ".join(row),
              flush=True)


def shape_b_parameters(device="cuda", layers=36, width=1280):
    """GPT-2 shape B's parameters as the trainers hold them, fp32, each with a random gradient:
    720.2M values in 436 tensors."""
    shapes = [(VOCAB, width), (SEQ, width)]
    for _ in range(layers):
        shapes += [(width,), (width,), (width, 3 * width), (3 * width,), (width, width), (width,),
                   (width,), (width,), (width, 4 * width), (4 * width,), (4 * width, width),
                   (width,)]
    params = [torch.randn(shape, device=device, requires_grad=True)
              for shape in shapes + [(width,), (width,)]]
    for param in params:
        param.grad = torch.randn_like(param)
    return params


def update(params, form):
    """One AdamW step as a function, weight decay on matrices only, as the trainers group it."""
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    if form == "compiled":  # the rate a tensor, as a schedule needs it: a float is recompiled
        optimizer = torch.optim.AdamW(groups, lr=torch.tensor(1e-4))
        return torch.compile(lambda: optimizer.step())
    return torch.optim.AdamW(groups, lr=1e-4, **{form: True}).step


def copy_bandwidth(count):
    """TB/s of a copy of `count` fp32 values: a read and a write of 4 bytes each."""
    source, target = torch.empty(count, device="cuda"), torch.empty(count, device="cuda")
    return 8 * count / milliseconds(lambda: target.copy_(source)) / 1e9


def optimizer_times():
    params = shape_b_parameters()
    count = sum(p.numel() for p in params)
    bandwidth = copy_bandwidth(count)
    row = [f"clipping {milliseconds(lambda: torch.nn.utils.clip_grad_norm_(params, 1.0)):.2f} ms"]
    for form in ("fused", "foreach", "compiled"):
        row.append(f"AdamW {form} {milliseconds(update(params, form)):.2f} ms")
    # AdamW reads a parameter, its gradient and two moments and writes three: 28 bytes
    print(f"update, shape B ({count / 1e6:.1f}M parameters in {len(params)} tensors): "
          + "; ".join(row) + f"; at a copy's {bandwidth:.2f} TB/s AdamW would take "
          f"{28 * count / bandwidth / 1e9:.2f} ms", flush=True)


if __name__ == "__main__":
    print(torch.__version__, torch.cuda.get_device_name(), "cuDNN", torch.backends.cudnn.version())
    if "--optimizer-only" not in sys.argv:
        attention_times()
    if not {"--attention-only", "--optimizer-only"} & set(sys.argv):
        output_loss_times()
    if "--attention-only" not in sys.argv:
        optimizer_times()
