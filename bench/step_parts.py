"""Two parts of a training step timed alone on one GPU, forward and backward, bf16: the attention
kernel SDPA picks (flash, cuDNN, memory-efficient) and the output layer with its loss (whole, or in
chunks of the sequence). What a lever can gain at most before a trainer side is spent on it.

    python3 bench/step_parts.py            # micro-batches of 32 at sequence 1024, shapes A and B
    python3 bench/step_parts.py --attention-only   # the attention kernels and SDPA's own choice
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


if __name__ == "__main__":
    print(torch.__version__, torch.cuda.get_device_name(), "cuDNN", torch.backends.cudnn.version())
    attention_times()
    if "--attention-only" not in sys.argv:
        output_loss_times()
