"""Our trainer against nanoGPT, the HF Trainer and variants of itself: same work, same call.

    python3 bench/bench.py                                  # every stage (*_2gpu: 2 GPUs)
    python3 bench/bench.py --stages shapeA_1gpu,hf_trainer  # some stages: the work over calls
    python3 bench/bench.py --stages metrics_cost_shapeA_1gpu  # the metrics on vs off
    python3 bench/bench.py --stages two_nodes_shapeA_2gpu   # 2 GPUs as 2 nodes: sockets vs NVLink
    python3 bench/bench.py --stages reference_shapeA_1gpu   # ours vs train_ddp.py of 850740a
    python3 bench/bench.py --stages vit_1gpu                # ViT-B/16: ours vs timm, HF Trainer
    python3 bench/bench.py --tiny                           # CPU plumbing check: tiny, fp32
    python3 bench/bench.py --record DIR [DIR ...]           # add earlier calls' results to bench/

A call is one run of this script; on the GPU machine here it may last 10 minutes, which bounds
the stages given to it. Each stage runs its sides one after the other, each in its own process
with its own timeout; a side that fails or times out is recorded as such and the next side and
stage still run. Written to $OUT (else bench/out): bench.log (every side's whole output),
stages.jsonl (one line of raw measurements per side), summary.md (the dated section for
bench/RESULTS.md) and results.jsonl (one line per figure). A GPU call also appends summary.md to
bench/RESULTS.md and results.jsonl to bench/results.jsonl (not with --tiny or --no-record).

nanoGPT is not part of this repository: its checkout is read from $NANOGPT_DIR (default
.baselines/nanoGPT, ignored by git):
    git clone https://github.com/karpathy/nanoGPT .baselines/nanoGPT
Nor is timm's benchmark.py (the timm package does not ship it): it is read from $TIMM_DIR (default
.baselines/timm), with its commit in a COMMIT file beside it:
    git clone https://github.com/huggingface/pytorch-image-models /tmp/timm &&
    mkdir -p .baselines/timm && cp /tmp/timm/benchmark.py .baselines/timm/ &&
    git -C /tmp/timm rev-parse HEAD > .baselines/timm/COMMIT

Read STAGES first (what runs), then run_ours, run_nanogpt, run_timm and hf_trainer_worker (how each
side is launched and read), then figures (what is compared, and how).
"""

import argparse
import contextlib
import importlib.util
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
from datetime import datetime, timezone
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
NANOGPT_DIR = Path(os.environ.get("NANOGPT_DIR", REPO / ".baselines" / "nanoGPT")).resolve()
TIMM_DIR = Path(os.environ.get("TIMM_DIR", REPO / ".baselines" / "timm")).resolve()
OUT = Path(os.environ.get("OUT") or REPO / "bench" / "out")
WORK_DIR = REPO / "out" / "bench"  # run directories and random-token data: large, so not under $OUT

# ----------------------------------------------------------------------------- 1. settings

# The shapes of the comparisons against nanoGPT. Both sides build the GPT-2 layout (learned
# positions, biases, tied output layer), with micro-batches of 16 unless a stage says otherwise.
SHAPES = {
    "A": {"n_layer": 12, "n_head": 12, "n_embd": 768},
    "B": {"n_layer": 36, "n_head": 20, "n_embd": 1280},
    "12B": {"n_layer": 40, "n_head": 40, "n_embd": 5120},  # GPT-3 13B's layout: 12.6B parameters
    "1.3B": {"n_layer": 24, "n_head": 16, "n_embd": 2048},  # the fp8 stages' Llama: 1.3B parameters
}
BATCH = {"vocab_size": 8192, "seq_len": 1024, "micro_batch_size": 16, "global_batch_size": 64}
# --tiny: the same plumbing on a CPU, in seconds to minutes per stage
TINY_SHAPES = {
    "A": {"n_layer": 2, "n_head": 4, "n_embd": 64},
    "B": {"n_layer": 3, "n_head": 4, "n_embd": 96},
}
TINY_BATCH = {"vocab_size": 8192, "seq_len": 64, "micro_batch_size": 4, "global_batch_size": 16}
SHAPE_STAGES = ("shapeA_1gpu", "shapeB_1gpu", "shapeA_2gpu", "shapeB_2gpu")  # the table vs nanoGPT
BERT_BATCH = {"seq_len": 512, "micro_batch_size": 32, "global_batch_size": 256}  # the bert_* stages
# The image stages: ViT-B/16 at 224 x 224, 1,000 classes, one micro-batch of 256 images a step.
# train_images: random_image_data's train split; the sides loop over it (a step does the same work
# on any images).
VIT_SHAPE = {"n_layer": 12, "n_head": 12, "n_embd": 768, "intermediate_size": 3072,
             "patch_size": 16, "image_size": 224, "classes": 1000}
VIT_BATCH = {"micro_batch_size": 256, "global_batch_size": 256, "train_images": 4096,
             "val_images": 512}
TINY_VIT_SHAPE = {"n_layer": 2, "n_head": 4, "n_embd": 64, "intermediate_size": 256,
                  "patch_size": 4, "image_size": 32, "classes": 10}
TINY_VIT_BATCH = {"micro_batch_size": 32, "global_batch_size": 32, "train_images": 1024,
                  "val_images": 256}

def fp8_pair(variant, shape, **settings):
    """A stage of a Llama on one GPU: trainer variant `variant` in bf16, then the same in fp8."""
    fp8 = f"variant:{variant}#fp8"
    return {"sides": [f"variant:{variant}", fp8], "shape": shape, "gpus": 1, "llama": True,
            "side_extra": {fp8: ["train.precision=fp8"]}, **settings}


# steps: optimizer steps each side runs; skip_steps: the first steps left out of the figures
# (compile, allocator warm-up), a multiple of log_every: a logged interval that straddles it would
# be left out whole. The window (skip_steps, steps] is the same for every side of a
# stage, sized for 20-30 s of steady state on an H200. timeout_s holds for each side on its own; a
# side of shape A takes 1-2 minutes in all, one of shape B about 3, mostly start-up and compiling.
# budget_s (GPU calls): the stage's sides together; each side's timeout is cut to what is left.
STAGES = {
    # config:micro32: ours with micro-batches of 32, the same global batch; nanogpt_micro32: nanoGPT
    # the same (its --batch_size=32, half the accumulation steps)
    "shapeA_1gpu": {"sides": ["ours", "nanogpt", "config:micro32", "nanogpt_micro32"], "shape": "A",
                    "gpus": 1, "steps": 150, "skip_steps": 20, "log_every": 10, "timeout_s": 240},
    "shapeB_1gpu": {"sides": ["ours", "nanogpt", "config:micro32"], "shape": "B", "gpus": 1,
                    "steps": 30, "skip_steps": 10, "log_every": 5, "timeout_s": 280},
    # ours_buckets: DDP's buckets of 100 MiB, so Dynamo splits the compiled graph into fewer pieces
    "shapeA_2gpu": {"sides": ["ours", "nanogpt", "config:micro32", "nanogpt_micro32",
                              "ours_buckets"], "shape": "A", "gpus": 2, "steps": 200,
                    "skip_steps": 30, "log_every": 10, "timeout_s": 240},
    "shapeB_2gpu": {"sides": ["ours", "nanogpt", "config:micro32"], "shape": "B", "gpus": 2,
                    "steps": 70, "skip_steps": 10, "log_every": 5, "timeout_s": 280},
    "hf_trainer": {"sides": ["hf_trainer"], "shape": "A", "gpus": 1, "steps": 200, "skip_steps": 20,
                   "log_every": 10, "timeout_s": 240},
    "hf_trainer_compiled": {"sides": ["hf_trainer_compiled"], "shape": "A", "gpus": 1, "steps": 200,
                            "skip_steps": 20, "log_every": 10, "timeout_s": 270},
    # train.precision=fp8 (torchao, needs it installed) against bf16 on a Llama of 1.3B parameters
    # and one of shape B, micro-batches of 16 (4 a step), the trainer as it is: the whole model
    # compiled on both sides (at 1.3B, cold on an H100: bf16's side took 172 s in all, fp8's 325 s)
    "fp8_llama1p3b_1gpu": {"sides": ["config:llama", "config:llama_fp8"], "shape": "1.3B",
                           "gpus": 1, "steps": 30, "skip_steps": 10, "log_every": 5,
                           "timeout_s": 400, "budget_s": 590},
    # the same with both sides' blocks compiled one by one (variant:compile_blocks)
    "fp8_blocks_llama1p3b_1gpu": fp8_pair("compile_blocks", "1.3B", steps=30, skip_steps=10,
                                          log_every=5, timeout_s=290, budget_s=580),
    "fp8_shapeB_1gpu": {"sides": ["config:llama", "config:llama_fp8"], "shape": "B", "gpus": 1,
                        "steps": 40, "skip_steps": 10, "log_every": 5, "timeout_s": 400,
                        "budget_s": 590},
    # eager (train.compile=false; the variant lifts fp8's refusal of it): what fp8 gains without
    # torch.compile, the reason for that refusal
    "fp8_eager_llama1p3b_1gpu": fp8_pair("fp8_eager", "1.3B", steps=16, skip_steps=6, log_every=2,
                                         timeout_s=150, budget_s=300,
                                         extra=["train.compile=false"]),
    # the loss after 300 steps on data/stdlib, fp8 against bf16: a global batch of 8 samples, so
    # that 300 steps fit a call; the validation loss over 4 batches (the whole validation split).
    # both sides' blocks compiled one by one: it compiles in a third of the time
    "fp8_loss_llama1p3b_1gpu": fp8_pair("compile_blocks", "1.3B", steps=300, skip_steps=25,
                                        log_every=25, timeout_s=280, budget_s=560,
                                        batch={"micro_batch_size": 8, "global_batch_size": 8},
                                        extra=["train.eval_batches=4"]),
    # the same for shape B's Llama
    "fp8_loss_shapeB_1gpu": fp8_pair("compile_blocks", "B", steps=300, skip_steps=25, log_every=25,
                                     timeout_s=280, budget_s=560,
                                     batch={"micro_batch_size": 8, "global_batch_size": 8},
                                     extra=["train.eval_batches=4"]),
    # shape B's Llama, both sides' blocks compiled one by one
    "fp8_blocks_shapeB_1gpu": fp8_pair("compile_blocks", "B", steps=40, skip_steps=10,
                                       log_every=5, timeout_s=220, budget_s=440),
    # the same with micro-batches of 32 (2 a step): larger matmuls for float8's casts to pay for
    "fp8_micro32_shapeB_1gpu": fp8_pair("compile_blocks", "B", steps=40, skip_steps=10,
                                        log_every=5, timeout_s=220, budget_s=440,
                                        batch={"micro_batch_size": 32}),
    # at 1.3B: fp8 each block compiled on its own (compile_blocks), then as the trainer compiles
    # it, the whole model
    "fp8_compile_llama1p3b_1gpu": {"sides": ["variant:compile_blocks#fp8", "ours#fp8"],
                                   "shape": "1.3B", "gpus": 1, "llama": True, "steps": 30,
                                   "skip_steps": 10, "log_every": 5, "timeout_s": 450,
                                   "budget_s": 585,
                                   "side_extra": {side: ["train.precision=fp8"] for side in [
                                       "ours#fp8", "variant:compile_blocks#fp8"]}},
    # shape B's Llama, every side's blocks compiled one by one: bf16, fp8,
    # fp8 for the MLP alone, fp8 rowwise
    "fp8_levers_shapeB_1gpu": {"sides": ["variant:compile_blocks", "variant:compile_blocks#fp8",
                                         "variant:fp8_mlp_only", "variant:fp8_rowwise"],
                               "shape": "B", "gpus": 1, "llama": True, "steps": 40,
                               "skip_steps": 10, "log_every": 5, "timeout_s": 150,
                               "budget_s": 560,
                               "side_extra": {side: ["train.precision=fp8"] for side in [
                                   "variant:compile_blocks#fp8", "variant:fp8_mlp_only",
                                   "variant:fp8_rowwise"]}},
    # GPT-2 of shape B (the nanoGPT comparison's) with its blocks compiled one by one
    "compile_blocks_shapeB_1gpu": {"sides": ["ours", "variant:compile_blocks"], "shape": "B",
                                   "gpus": 1, "steps": 30, "skip_steps": 10, "log_every": 5,
                                   "timeout_s": 240, "batch": {"micro_batch_size": 32}},
    # Levers against nanoGPT on shape A, one at a time, every side with micro-batches of 32: SDPA
    # limited to cuDNN's attention (already its choice on an H100 under torch 2.11: step_parts.py),
    # CUDA graphs (torch.compile's reduce-overhead), Python's garbage collector off in the loop;
    # then cuDNN's attention at head sizes 64 and 80, and micro-batches of 64 on both sides
    "levers_shapeA_1gpu": {"sides": ["ours", "nanogpt", "variant:sdpa_cudnn",
                                     "variant:cuda_graphs", "variant:gc_off"], "shape": "A",
                           "gpus": 1, "steps": 150, "skip_steps": 20, "log_every": 10,
                           "timeout_s": 200, "budget_s": 490, "batch": {"micro_batch_size": 32}},
    "attention_levers_shapeA_1gpu": {"sides": ["ours", "variant:sdpa_cudnn", "config:micro64",
                                               "nanogpt_micro64"], "shape": "A", "gpus": 1,
                                     "steps": 150, "skip_steps": 20, "log_every": 10,
                                     "timeout_s": 200, "budget_s": 580,
                                     "batch": {"micro_batch_size": 32}},
    "attention_head80_1gpu": {"sides": ["ours", "variant:sdpa_cudnn"], "shape": "A", "gpus": 1,
                              "steps": 150, "skip_steps": 20, "log_every": 10, "timeout_s": 200,
                              "batch": {"micro_batch_size": 32},
                              "extra": ["model.n_embd=960", "model.n_head=12"]},
    # the trainer as it ships against nanoGPT, both with the trainer's default GPU micro-batches
    "same_micro_shapeA_1gpu": {"sides": ["ours", "nanogpt"], "shape": "A", "gpus": 1,
                               "steps": 150, "skip_steps": 20, "log_every": 10, "timeout_s": 200,
                               "batch": {"micro_batch_size": 32}},
    "same_micro_shapeB_1gpu": {"sides": ["ours", "nanogpt"], "shape": "B", "gpus": 1, "steps": 30,
                               "skip_steps": 10, "log_every": 5, "timeout_s": 240,
                               "batch": {"micro_batch_size": 32}},
    # host-time and kernel levers on shapes A and B, one at a time, against the trainer and
    # nanoGPT
    "host_levers_shapeA_1gpu": {"sides": ["ours", "nanogpt", "variant:masked_update",
                                          "variant:linear_layout", "variant:inductor_tuned"],
                                "shape": "A", "gpus": 1, "steps": 150, "skip_steps": 20,
                                "log_every": 10, "timeout_s": 150, "budget_s": 520,
                                "batch": {"micro_batch_size": 32}},
    "host_levers_shapeB_1gpu": {"sides": ["ours", "nanogpt", "variant:compile_blocks",
                                          "variant:masked_update", "variant:inductor_tuned"],
                                "shape": "B", "gpus": 1, "steps": 30, "skip_steps": 10,
                                "log_every": 5, "timeout_s": 150, "budget_s": 560,
                                "batch": {"micro_batch_size": 32}},
    # CUDA graphs on shape A; on shape B: the blocks compiled one by one, and CUDA graphs
    "graphs_shapeA_1gpu": {"sides": ["ours", "variant:cuda_graphs"], "shape": "A", "gpus": 1,
                           "steps": 150, "skip_steps": 20, "log_every": 10, "timeout_s": 200,
                           "batch": {"micro_batch_size": 32}},
    # CUDA graphs: the whole step captured by hand; torch.compile's with every gradient made
    # before the first backward; and with the model and the loss in one graph
    "graphs2_shapeA_1gpu": {"sides": ["ours", "nanogpt", "variant:cuda_graphs_captured",
                                      "variant:cuda_graphs_grads_made",
                                      "variant:cuda_graphs_one_graph"], "shape": "A", "gpus": 1,
                            "steps": 150, "skip_steps": 20, "log_every": 10, "timeout_s": 150,
                            "budget_s": 480, "batch": {"micro_batch_size": 32}},
    # inductor's options on shape B: each kernel's launch parameters tuned, matmuls autotuned
    "inductor_shapeB_1gpu": {"sides": ["ours", "variant:inductor_tuned",
                                       "variant:max_autotune_gemm"], "shape": "B", "gpus": 1,
                             "steps": 30, "skip_steps": 10, "log_every": 5, "timeout_s": 280,
                             "budget_s": 580, "batch": {"micro_batch_size": 32}},
    # on shape A: each kernel's launch parameters tuned, given most of a call's time to compile
    "tuned_shapeA_1gpu": {"sides": ["ours", "variant:inductor_tuned"], "shape": "A", "gpus": 1,
                          "steps": 150, "skip_steps": 20, "log_every": 10, "timeout_s": 480,
                          "budget_s": 580, "batch": {"micro_batch_size": 32}},
    # and on shape B, where 40% of the kernel time was outside the matmuls (fp32 stream, profiled)
    "tuned_shapeB_1gpu": {"sides": ["ours", "variant:inductor_tuned"], "shape": "B", "gpus": 1,
                          "steps": 30, "skip_steps": 10, "log_every": 5, "timeout_s": 400,
                          "budget_s": 580, "batch": {"micro_batch_size": 32}},
    # shape B's AdamW and clipping took 19.1 ms a step (bf16 stream, profiled): the update compiled
    "optimizer_shapeB_1gpu": {"sides": ["ours", "nanogpt", "variant:compiled_optimizer"],
                              "shape": "B", "gpus": 1, "steps": 30, "skip_steps": 10,
                              "log_every": 5, "timeout_s": 300, "budget_s": 580,
                              "batch": {"micro_batch_size": 32}},
    # and with coordinate-descent tuning (1.01x on its own): the two together against the trainer
    "optimizer_tuned_shapeB_1gpu": {"sides": ["ours", "variant:tuned_compiled_optimizer"],
                                    "shape": "B", "gpus": 1, "steps": 30, "skip_steps": 10,
                                    "log_every": 5, "timeout_s": 420, "budget_s": 590,
                                    "batch": {"micro_batch_size": 32}},
    # on shape A: the captured step, alone and with each kernel's launch parameters tuned
    "captured_tuned_shapeA_1gpu": {"sides": ["ours", "nanogpt", "variant:cuda_graphs_captured",
                                             "variant:captured_tuned"], "shape": "A", "gpus": 1,
                                   "steps": 150, "skip_steps": 20, "log_every": 10,
                                   "timeout_s": 400, "budget_s": 580,
                                   "batch": {"micro_batch_size": 32}},
    # the residual stream in bf16 (the trainers' residual_in_bf16) against fp32, autocast's own
    # choice and nanoGPT's
    "residual_shapeA_1gpu": {"sides": ["ours", "nanogpt", "variant:fp32_residual"], "shape": "A",
                             "gpus": 1, "steps": 150, "skip_steps": 20, "log_every": 10,
                             "timeout_s": 200, "budget_s": 560, "batch": {"micro_batch_size": 32}},
    "residual_shapeB_1gpu": {"sides": ["ours", "nanogpt", "variant:fp32_residual"], "shape": "B",
                             "gpus": 1, "steps": 30, "skip_steps": 10, "log_every": 5,
                             "timeout_s": 200, "budget_s": 570, "batch": {"micro_batch_size": 32}},
    # and its loss: 300 steps on data/stdlib, validated on one global batch (it covers the split)
    "residual_loss_shapeA_1gpu": {"sides": ["ours", "variant:fp32_residual"], "shape": "A",
                                  "gpus": 1, "steps": 300, "skip_steps": 25, "log_every": 25,
                                  "timeout_s": 200, "budget_s": 420,
                                  "batch": {"micro_batch_size": 32}},
    # on shape A: matmuls autotuned, alone and with the captured step, against nanoGPT
    "inductor_shapeA_1gpu": {"sides": ["ours", "nanogpt", "variant:max_autotune_gemm",
                                       "variant:captured_autotuned"], "shape": "A", "gpus": 1,
                             "steps": 150, "skip_steps": 20, "log_every": 10, "timeout_s": 200,
                             "budget_s": 580, "batch": {"micro_batch_size": 32}},
    # the step's end: the trainer (waits for the GPU before validation and checkpoints only) against
    # nanoGPT and against a wait after every step; the update masked in the fused kernel (queued
    # before the verdict's read); the captured step with its verdict read a step late
    "step_end_shapeA_1gpu": {"sides": ["ours", "nanogpt", "variant:sync_every_step",
                                       "variant:masked_update", "variant:captured_ahead"],
                             "shape": "A", "gpus": 1, "steps": 150, "skip_steps": 20,
                             "log_every": 10, "timeout_s": 150, "budget_s": 520,
                             "batch": {"micro_batch_size": 32}},
    "step_end_shapeB_1gpu": {"sides": ["ours", "nanogpt", "variant:sync_every_step"],
                             "shape": "B", "gpus": 1, "steps": 30, "skip_steps": 10,
                             "log_every": 5, "timeout_s": 180, "budget_s": 540,
                             "batch": {"micro_batch_size": 32}},
    # what the trainer's process holds that nanoGPT's does not, one at a time: launch.sh and
    # torchrun (ours_python: started by python3 itself, as nanoGPT runs on one GPU), an NCCL
    # communicator (config:gloo: the process group on gloo), the verdict's all-reduce in one process
    "launcher_shapeA_1gpu": {"sides": ["ours", "nanogpt", "ours_python", "config:gloo",
                                       "variant:verdict_local"], "shape": "A", "gpus": 1,
                             "steps": 150, "skip_steps": 20, "log_every": 10, "timeout_s": 150,
                             "budget_s": 570, "batch": {"micro_batch_size": 32}},
    # the model and the loss in one compiled graph (variant:loss_in_graph), as nanoGPT compiles them
    "loss_graph_shapeA_1gpu": {"sides": ["ours", "nanogpt", "variant:loss_in_graph"], "shape": "A",
                               "gpus": 1, "steps": 150, "skip_steps": 20, "log_every": 10,
                               "timeout_s": 150, "budget_s": 400,
                               "batch": {"micro_batch_size": 32}},
    "loss_graph_shapeB_1gpu": {"sides": ["ours", "nanogpt", "variant:loss_in_graph"], "shape": "B",
                               "gpus": 1, "steps": 30, "skip_steps": 10, "log_every": 5,
                               "timeout_s": 200, "budget_s": 560,
                               "batch": {"micro_batch_size": 32}},
    # shape B: the captured step against the trainer and nanoGPT
    "graphs2_shapeB_1gpu": {"sides": ["ours", "nanogpt", "variant:cuda_graphs_captured"],
                            "shape": "B", "gpus": 1, "steps": 30, "skip_steps": 10,
                            "log_every": 5, "timeout_s": 180, "budget_s": 560,
                            "batch": {"micro_batch_size": 32}},
    # micro-batches of 64 on both sides (one a step on one GPU), and the captured step with them
    "micro64_shapeA_1gpu": {"sides": ["ours", "nanogpt", "variant:cuda_graphs_captured"],
                            "shape": "A", "gpus": 1, "steps": 150, "skip_steps": 20,
                            "log_every": 10, "timeout_s": 150, "budget_s": 450,
                            "batch": {"micro_batch_size": 64}},
    "levers_shapeB_1gpu": {"sides": ["ours", "variant:compile_blocks", "variant:cuda_graphs"],
                           "shape": "B", "gpus": 1, "steps": 30, "skip_steps": 10, "log_every": 5,
                           "timeout_s": 200, "budget_s": 270, "batch": {"micro_batch_size": 32}},
    # train_fsdp.py against train_ddp.py on one GPU, micro-batches of 32 (the GPU default)
    "fsdp_shapeA_1gpu": {"sides": ["ours", "ours_fsdp"], "shape": "A",
                         "gpus": 1, "steps": 150, "skip_steps": 30, "log_every": 10,
                         "timeout_s": 200, "batch": {"micro_batch_size": 32}},
    "fsdp_shapeB_1gpu": {"sides": ["ours", "ours_fsdp"], "shape": "B", "gpus": 1, "steps": 40,
                         "skip_steps": 10, "log_every": 5, "timeout_s": 280,
                         "batch": {"micro_batch_size": 32}},
    # FSDP against DDP on a model both hold (shape B), then on one that DDP cannot hold on a 141 GB
    # H200 (16 bytes per parameter: weights, gradients, AdamW): 12.6B parameters
    "fsdp_shapeB_2gpu": {"sides": ["ours", "ours_fsdp"], "shape": "B", "gpus": 2, "steps": 30,
                         "skip_steps": 10, "log_every": 5, "timeout_s": 280},
    "fsdp_12b_2gpu": {"sides": ["ours_fsdp"], "shape": "12B", "gpus": 2, "steps": 6,
                      "skip_steps": 2, "log_every": 1, "timeout_s": 300,
                      "batch": {"micro_batch_size": 4, "global_batch_size": 8},
                      "extra": ["fsdp.activation_checkpointing=true"],
                      "env": {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}},
    # what a change to train_ddp.py is worth: the trainer with one change undone at a time
    # (VARIANTS), and the trainer of commit 47acc78 (VARIANT_FILES)
    "ablation_shapeA_1gpu": {"sides": ["ours", "variant:ddp_at_world_size_1", "variant:plain_loss",
                                       "variant:at_47acc78"], "shape": "A", "gpus": 1, "steps": 80,
                             "skip_steps": 20, "log_every": 10, "timeout_s": 200},
    # transformers' "sdpa" (an explicit causal mask under compile) against our "sdpa_causal"
    "attention_shapeA_1gpu": {"sides": ["ours", "variant:sdpa_masked"], "shape": "A", "gpus": 1,
                              "steps": 70, "skip_steps": 20, "log_every": 10, "timeout_s": 200},
    # what the metrics cost: TensorBoard, Prometheus and NVML all on against all off (CONFIG_SIDES),
    # twice each in turns, so that a drift of the machine over the call falls on both
    "metrics_cost_shapeA_1gpu": {"sides": ["config:metrics_off#1", "config:metrics_on#1",
                                           "config:metrics_off#2", "config:metrics_on#2"],
                                 "shape": "A", "gpus": 1, "steps": 120, "skip_steps": 20,
                                 "log_every": 10, "timeout_s": 200},
    # syncs between host and GPU, counted by torch.cuda.set_sync_debug_mode over 40 steps
    "sync_check_shapeA_1gpu": {"sides": ["variant:sync_debug"], "shape": "A", "gpus": 1,
                               "steps": 40, "skip_steps": 20, "log_every": 20, "timeout_s": 200},
    # DDP's reducer ("ours") against InlineReducer ("ours_inline") and bf16 gradient compression
    # (SIDE_OVERRIDES). variant:no_comm all-reduces nothing (a clock, not training): DDP's exposed
    # communication is the step time "ours" has above it. One such stage per call.
    "reducer_shapeA_2gpu": {"sides": ["ours", "ours_inline", "variant:no_comm"], "shape": "A",
                            "gpus": 2, "steps": 120, "skip_steps": 20, "log_every": 10,
                            "timeout_s": 200},
    "compression_shapeA_2gpu": {"sides": ["ours_bf16"], "shape": "A", "gpus": 2, "steps": 120,
                                "skip_steps": 20, "log_every": 10, "timeout_s": 200},
    "reducer_shapeB_2gpu": {"sides": ["ours", "ours_inline"], "shape": "B", "gpus": 2, "steps": 30,
                            "skip_steps": 10, "log_every": 5, "timeout_s": 280},
    "compression_shapeB_2gpu": {"sides": ["variant:no_comm", "ours_inline_bf16"], "shape": "B",
                                "gpus": 2, "steps": 40, "skip_steps": 10, "log_every": 5,
                                "timeout_s": 280},
    # masked LM: BERT-base (shape A's size, model.type=bert) at seq_len 512 on data/stdlib,
    # micro-batches of 32 (as many positions as shape A's 16). Sides: ours (bf16, every batch padded
    # to 512: train.pad_to_multiple=0, the default), fp32 (TF32 matmuls), fp16 + GradScaler, and 64
    "bert_1gpu": {"sides": ["ours", "ours_fp32", "ours_fp16", "config:micro64"], "shape": "A",
                  "gpus": 1, "steps": 70, "skip_steps": 20, "log_every": 10, "timeout_s": 240,
                  "mlm": True, "batch": BERT_BATCH, "extra": ["model.type=bert"]},
    # padding alternatives, against bert_1gpu's ours (one static shape): dynamic padding (to 8, the
    # length marked dynamic); static buckets (multiples of 128: 4 lengths, a static graph each, 128
    # not 64 to bound the compiles); exact lengths, unmarked (each new length a new graph)
    "bert_padding_1gpu": {"sides": ["ours_dynamic", "variant:bert_static_buckets",
                                    "variant:bert_unmarked"], "shape": "A", "gpus": 1,
                          "steps": 70, "skip_steps": 20, "log_every": 10, "timeout_s": 300,
                          "mlm": True, "batch": BERT_BATCH, "extra": ["model.type=bert"],
                          "side_extra": {
                              "variant:bert_static_buckets": ["train.pad_to_multiple=128"],
                              "variant:bert_unmarked": ["train.pad_to_multiple=1"]}},
    "bert_2gpu": {"sides": ["ours", "ours_dynamic", "config:micro64"], "shape": "A", "gpus": 2,
                  "steps": 70, "skip_steps": 20, "log_every": 10, "timeout_s": 200, "mlm": True,
                  "batch": BERT_BATCH, "extra": ["model.type=bert"]},
    # GPT-2 against a Llama of the same size (CONFIG_SIDES: SwiGLU's three matrices 8/3 x width wide
    # hold what GPT-2's two 4 x width ones do)
    "llama_shapeA_1gpu": {"sides": ["ours", "config:llama"], "shape": "A", "gpus": 1, "steps": 80,
                          "skip_steps": 20, "log_every": 10, "timeout_s": 200},
    # torch.nn.DataParallel (one process drives both GPUs) against DDP (a process per GPU), both
    # eager: DataParallel copies the module to every GPU in each forward, which torch.compile does
    # not follow
    "dataparallel_shapeA_2gpu": {"sides": ["config:eager", "dataparallel"], "shape": "A", "gpus": 2,
                                 "steps": 50, "skip_steps": 10, "log_every": 10, "timeout_s": 200},
    # two "nodes" of one GPU each, joined by NCCL's socket transport (TWO_NODE_ENV): the all-reduce
    # table, then shape A over NVLink ("ours") and over sockets; the least needed side last
    "two_nodes_shapeA_2gpu": {"sides": ["stress", "two_nodes:stress", "ours", "two_nodes:ours",
                                        "two_nodes:ours_bf16", "two_nodes:ours_buckets",
                                        "two_nodes:ours_bf16_buckets"],
                              "shape": "A", "gpus": 2, "steps": 100, "skip_steps": 20,
                              "log_every": 10, "timeout_s": 160,
                              # each rank logs the transport of each channel: run_ours records them
                              "env": {"NCCL_DEBUG": "INFO", "NCCL_DEBUG_SUBSYS": "INIT"}},
    # the same two nodes, each in its own network namespace, joined by a veth pair (NETNS_HOSTS).
    # Needs root and iproute2; where namespaces cannot be made, the sides say so at no GPU time.
    "two_nodes_netns_shapeA_2gpu": {"sides": ["netns:stress", "netns:ours"], "shape": "A",
                                    "gpus": 2, "steps": 100, "skip_steps": 20, "log_every": 10,
                                    "timeout_s": 160,
                                    "env": {"NCCL_DEBUG": "INFO", "NCCL_DEBUG_SUBSYS": "INIT"}},
    # a 500k-token vocabulary, untied: the input embedding whole on the GPU against tiered (its
    # 32,768 most frequent rows on the GPU, the rest in CPU memory), on Zipf-distributed tokens.
    # Micro-batches of 8: the logits of 16 x 1024 x 500k would take 16 GB in bf16 alone.
    "tiered_embedding_1gpu": {"sides": ["ours", "ours_tiered"], "shape": "A", "gpus": 1,
                              "steps": 60, "skip_steps": 20, "log_every": 10, "timeout_s": 280,
                              "zipf_data": True,
                              "batch": {"vocab_size": 500_000, "micro_batch_size": 8},
                              "extra": ["model.tie_word_embeddings=false"],
                              "side_extra": {"ours_tiered": ["model.embedding_gpu_rows=32768"]},
                              "tiny": {"vocab_size": 50_000, "side_extra": {
                                  "ours_tiered": ["model.embedding_gpu_rows=2048"]}}},
    # host-GPU syncs of the tiered run (its step should add none), counted as in
    # sync_check_shapeA_1gpu; a stage of its own to keep tiered_embedding_1gpu short
    "tiered_sync_check_1gpu": {"sides": ["variant:sync_debug"], "shape": "A", "gpus": 1,
                               "steps": 40, "skip_steps": 20, "log_every": 20, "timeout_s": 240,
                               "zipf_data": True,
                               "batch": {"vocab_size": 500_000, "micro_batch_size": 8},
                               "extra": ["model.tie_word_embeddings=false",
                                         "model.embedding_gpu_rows=32768"],
                               "tiny": {"vocab_size": 50_000}},
    # the trainer ("ours") against train_ddp.py of commit 850740a (variant:reference), one GPU, the
    # trainer's default micro-batches of 32; variant:reference_same_step is that code reading each
    # step's verdict in the same step, not during the next (VARIANTS)
    "reference_shapeA_1gpu": {"sides": ["variant:reference", "variant:reference_same_step", "ours"],
                              "shape": "A", "gpus": 1, "steps": 150, "skip_steps": 20,
                              "log_every": 10, "timeout_s": 160, "batch": {"micro_batch_size": 32}},
    # a side of shape B takes about 3 minutes, the first (empty compile caches) the longest
    "reference_shapeB_1gpu": {"sides": ["variant:reference", "variant:reference_same_step", "ours"],
                              "shape": "B", "gpus": 1, "steps": 30, "skip_steps": 10,
                              "log_every": 5, "timeout_s": 240, "budget_s": 500,
                              "batch": {"micro_batch_size": 32}},
    "reference_bert_1gpu": {"sides": ["variant:reference", "ours"], "shape": "A", "gpus": 1,
                            "steps": 70, "skip_steps": 20, "log_every": 10, "timeout_s": 210,
                            "mlm": True, "batch": {**BERT_BATCH, "micro_batch_size": 64},
                            "extra": ["model.type=bert"]},
    # ViT-B/16 (VIT_SHAPE, VIT_BATCH), bf16, compiled, on random images (random_image_data): ours
    # against timm's own train benchmark (run_timm) and the HF Trainer on transformers'
    # ViTForImageClassification (hf_trainer_vit_worker)
    "vit_1gpu": {"sides": ["ours", "timm", "hf_trainer_vit"], "images": True, "gpus": 1,
                 "steps": 120, "skip_steps": 40, "log_every": 10, "timeout_s": 150,
                 "budget_s": 300},
    # the newcomer's ViT demo: `bash launch.sh train_ddp.py model.type=vit` in a fresh copy of the
    # repository's tracked files (no data/, no out/), wall time from the command to its exit
    "vit_demo_1gpu": {"sides": ["vit_demo"], "gpus": 1, "timeout_s": 170},
    # preprocess.py --images with a worker per core against a one-process Pillow loop on 20,000
    # JPEGs of 500 x 375 (bench_images.py); the loop times its first IMAGES_LOOP_SUBSET files
    "preprocess_images_1gpu": {"sides": ["preprocess_images"], "gpus": 1, "timeout_s": 240},
}
# the tiered run with the allocator's expandable segments: the number of cold rows a step holds
# varies, so its GPU tensors change size at every step, which can fragment the cache
STAGES["tiered_expandable_1gpu"] = {**STAGES["tiered_embedding_1gpu"], "sides": ["ours_tiered"],
                                    "env": {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}}
# Sides that run train_ddp.py with settings of their own (after the stage's: a later key=value wins)
SIDE_OVERRIDES = {
    "ours_inline": ["dist.reducer=inline"],
    "ours_bf16": ["dist.grad_compression=bf16"],
    "ours_inline_bf16": ["dist.reducer=inline", "dist.grad_compression=bf16"],
    "ours_inline_fp16": ["dist.reducer=inline", "train.precision=fp16"],  # the GradScaler path
    "ours_fp32": ["train.precision=fp32"],
    "ours_fp16": ["train.precision=fp16"],
    "ours_dynamic": ["train.pad_to_multiple=8"],  # masked LM: to the longest sample, up to 8
    "ours_buckets": ["dist.bucket_mb=100"],  # fewer, larger all-reduces (shape A: 351 MiB a step)
    "ours_bf16_buckets": ["dist.grad_compression=bf16", "dist.bucket_mb=100"],
}
# Sides "two_nodes:SIDE": SIDE as two torchrun nodes of this machine, one GPU each, whose NCCL
# talks over TCP sockets as two hosts without InfiniBand: no NVLink or PCIe peer access, no shared
# memory, no GPUDirect RDMA, loopback named (NCCL does not pick lo itself). Gloo ignores these.
TWO_NODE_ENV = {"NCCL_P2P_DISABLE": "1", "NCCL_SHM_DISABLE": "1", "NCCL_IB_DISABLE": "1",
                "NCCL_NET_GDR_LEVEL": "LOC", "NCCL_SOCKET_IFNAME": "lo"}
# Sides "netns:SIDE": as "two_nodes:SIDE", each node in a network namespace of its own:
# (address, namespace, interface)
NETNS_HOSTS = [("10.78.0.1", "bench_node0", "bench_veth0"),
               ("10.78.0.2", "bench_node1", "bench_veth1")]
# stress_test.py's all-reduce sweep: up to 256 MiB, about shape A's 351 MiB all-reduced at each step
STRESS_ARGS = ["--ops", "all_reduce_sum", "--min-bytes", "1M", "--max-bytes", "256M",
               "--factor", "4", "--iters", "20", "--warmup", "5", "--skip-grad-check"]
TINY_STRESS_ARGS = ["--ops", "all_reduce_sum", "--min-bytes", "4K", "--max-bytes", "1M", "--factor",
                    "4", "--iters", "5", "--warmup", "2", "--skip-grad-check"]
TINY_STEPS = {"steps": 12, "skip_steps": 4, "log_every": 2, "timeout_s": 240}

# Variants of train_ddp.py: each is the trainer with one change, made by replacing text (so each
# stays a single readable file); a replacement that no longer matches stops that side with an error.
# Pieces the CUDA-graph variants below share: torch.compile's CUDA graphs for the model, a new
# CUDA-graph step before each forward, the gradients zeroed in place rather than freed
REDUCE_OVERHEAD = ("        return torch.compile(raw_model) if use_compile else raw_model, "
                   "nothing\n",
                   "        return torch.compile(raw_model, mode=\"reduce-overhead\") "
                   "if use_compile else raw_model, nothing\n")
MARK_STEP = ("            with setup.autocast:\n                logits = model(",
             "            torch.compiler.cudagraph_mark_step_begin()\n"
             "            with setup.autocast:\n                logits = model(")
GRADS_ZEROED = ("    optimizer.zero_grad(set_to_none=True)",
                "    optimizer.zero_grad(set_to_none=False)")
CUDA_GRAPHS = [REDUCE_OVERHEAD, MARK_STEP, GRADS_ZEROED]
# and every gradient made before the first backward
GRADS_MADE = ("    predicted = memory_prediction(raw_model, device)\n",
              "    predicted = memory_prediction(raw_model, device)\n"
              "    for parameter in raw_model.parameters():\n"
              "        parameter.grad = torch.zeros_like(parameter)\n")
# A whole optimizer step captured by hand as one CUDA graph (one process, fixed shapes): from
# the fourth step on, train_step copies the batch into the graph's input tensors and replays
# forward, backward, clipping and the update. A non-finite gradient skips the update inside the
# fused AdamW kernel (found_inf), so nothing in the graph waits for the host; the learning rate is
# a tensor on the device that the scheduler fills. On a CPU the same step runs without a graph.
CAPTURED_STEP = """
def captured_step(model, batches, optimizer, scheduler, setup, run):
    micro_batches, input_tokens, label_tokens, lengths = batches
    held = captured_step.__dict__
    if "step" not in held:
        held["batches"] = micro_batches  # its tensors become the graph's inputs
        held["scale"] = torch.zeros((), device=setup.device)
        held["skip"] = torch.zeros((), device=setup.device)
        trained = [p for p in setup.raw_model.parameters() if p.requires_grad]

        def step():
            held["loss_sum"] = torch.zeros((), device=setup.device, dtype=torch.float64)
            for batch in held["batches"]:
                with setup.autocast:
                    logits = model(**batch["inputs"]).logits
                micro_loss = setup.loss_of(logits, batch["labels"])
                (micro_loss * held["scale"]).backward()
                held["loss_sum"] += micro_loss.detach()
            held["grad_norm"] = torch.nn.utils.clip_grad_norm_(
                trained, setup.cfg.optim.grad_clip or float("inf"))
            optimizer.found_inf = torch.maximum(
                held["grad_norm"].isfinite().logical_not().float(), held["skip"])
            optimizer.step()

        held["step"] = step
        if setup.device.type == "cuda":
            held["skip"].fill_(1)  # a warm-up on a side stream that changes no weight
            optimizer.zero_grad(set_to_none=True)
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                step()
            torch.cuda.current_stream().wait_stream(side)
            held["skip"].fill_(0)
            optimizer.zero_grad(set_to_none=True)  # the graph's backward makes them in its pool
            held["graph"] = torch.cuda.CUDAGraph()
            with torch.cuda.graph(held["graph"]):
                step()
    for static, batch in zip(held["batches"], micro_batches):
        if static is not batch:
            static["labels"].copy_(batch["labels"], non_blocking=True)
            for key, value in batch["inputs"].items():
                if value is not None:
                    static["inputs"][key].copy_(value, non_blocking=True)
    held["scale"].fill_(dist.get_world_size() / max(1, label_tokens))
    if "graph" in held:
        held["graph"].replay()
    else:
        optimizer.zero_grad(set_to_none=True)
        held["step"]()
    with setup.data_wait:
        next_batches = step_batches(setup, run.position + setup.cfg.train.global_batch_size)
    grad_norm = held["grad_norm"].clone()
    bad, stop, in_a_row = step_verdict(grad_norm, setup, run)
    lr = setup.cfg.optim.lr * lr_factor(run.step, setup.cfg)
    scheduler.step()
    return SimpleNamespace(loss_sum=held["loss_sum"].clone(), grad_norm=grad_norm, lr=lr,
                           bad=bad, stop=stop, bad_in_a_row=in_a_row, input_tokens=input_tokens,
                           label_tokens=label_tokens, lengths=lengths), next_batches


if __name__ == "__main__":
"""
CAPTURED = [
    ("    micro_batches, input_tokens, label_tokens, lengths = batches\n"
     "    optimizer.zero_grad(set_to_none=True)",
     "    if run.step >= 3:  # compiled, AdamW's state made: the rest replay one CUDA graph\n"
     "        return captured_step(model, batches, optimizer, scheduler, setup, run)\n"
     "    micro_batches, input_tokens, label_tokens, lengths = batches\n"
     "    optimizer.zero_grad(set_to_none=True)"),
    ("        lr=cfg.optim.lr, betas=",
     "        lr=torch.tensor(cfg.optim.lr, device=trained[0].device), capturable=True, betas="),
    ("    lr = optimizer.param_groups[0][\"lr\"]  # the rate",
     "    lr = float(optimizer.param_groups[0][\"lr\"])  # the rate"),
    ("\n\nif __name__ == \"__main__\":\n", CAPTURED_STEP)]
# The captured step with its verdict read a step late: on one process the stop request is the
# host's own and a non-finite gradient is already masked in the graph, so the host queues the next
# step before it waits for this one, and the GPU need not wait for the host between steps. A bad
# step is counted one step late (a clock, not the trainer's bookkeeping).
CAPTURED_AHEAD = [*CAPTURED, (
    "    bad, stop, in_a_row = step_verdict(grad_norm, setup, run)\n",  # captured_step's
    "    if setup.device.type != \"cuda\":\n"
    "        bad, stop, in_a_row = step_verdict(grad_norm, setup, run)\n"
    "    else:\n"
    "        if \"pending\" in held:  # the step before: done, while this one runs\n"
    "            held[\"pending\"][0].synchronize()\n"
    "            held[\"bad_before\"] = bool(held[\"pending\"][1])\n"
    "        flag = grad_norm.isfinite().logical_not().to(\"cpu\", non_blocking=True)\n"
    "        held[\"pending\"] = (torch.cuda.Event(), flag)\n"
    "        held[\"pending\"][0].record()\n"
    "        bad, stop = held.get(\"bad_before\", False), bool(setup.stop_requested)\n"
    "        in_a_row = run.bad_in_a_row + 1 if bad else 0\n")]


def inductor_option(name):
    """The replacement that turns on one of inductor's options at the start of main()."""
    return ("def main():\n", "def main():\n    import torch._inductor.config as inductor_config\n"
            f"    inductor_config.{name} = True\n")


AUTOTUNE_GEMM = inductor_option("max_autotune_gemm")  # alone, and with the captured step
COMPILE_BLOCKS = ("        return torch.compile(raw_model) if use_compile else raw_model, "
                  "nothing\n",
                  "        for block in repeated_blocks(raw_model) if use_compile else []:\n"
                  "            block.compile()\n"
                  "        return raw_model, nothing\n")  # alone, and in fp8_levers' sides
# the update as inductor's kernels: AdamW's default form compiled, its learning rate a tensor the
# schedule fills in place (a float is a constant of the graph: a recompile every step)
COMPILED_OPTIMIZER = [
    ("        lr=cfg.optim.lr, betas=", "        lr=torch.tensor(cfg.optim.lr), betas="),
    ("        fused=True)  # the whole update in one kernel (the default: a kernel per operation "
     "on CUDA)", "        )  # the default form: compiled_step compiles it"),
    ("        optimizer.step()\n", "        compiled_step(optimizer)\n"),
    ('    lr = optimizer.param_groups[0]["lr"]', '    lr = float(optimizer.param_groups[0]["lr"])'),
    ("def train_step(", "@torch.compile\ndef compiled_step(optimizer):\n"
                       "    optimizer.step()\n\n\ndef train_step(")]

VARIANTS = {
    "ddp_at_world_size_1": [("    if dist.get_world_size() == 1:\n        return torch.compile",
                             "    if False:\n        return torch.compile")],  # DDP on 1 process
    "no_comm": [("contextlib.nullcontext() if last else ddp.no_sync()",
                 "ddp.no_sync()")],  # never all-reduces: a clock, not training
    "plain_loss": [
        ("    loss_of = torch.compile(token_loss_sum) if use_compile else token_loss_sum",
         "    loss_of = token_loss_sum")],
    "use_cache": [("    config.use_cache = False", "    config.use_cache = True")],
    "sdpa_masked": [("    if requested == \"auto\" and sdpa != \"sdpa\":",
                     "    if False:")],  # transformers' own sdpa
    "sync_debug": [("def main():\n", "def main():\n    import warnings\n"
                    "    warnings.simplefilter('always')\n"
                    "    torch.cuda.set_sync_debug_mode('warn')\n")],
    # masked LM: no length marked dynamic (every call of maybe_mark_dynamic does nothing)
    "bert_unmarked": [("torch._dynamo.maybe_mark_dynamic(", "(lambda *unmarked: None)(")],
    # and one static graph per length: with train.pad_to_multiple=128, 4 lengths x train and eval =
    # 8 graphs of the model, Dynamo's default recompile_limit (64 leaves room)
    "bert_static_buckets": [("torch._dynamo.maybe_mark_dynamic(", "(lambda *unmarked: None)("),
                            ("def main():\n", "def main():\n"
                             "    torch._dynamo.config.automatic_dynamic_shapes = False\n"
                             "    torch._dynamo.config.recompile_limit = 64\n")],
    # one process compiles each repeated block on its own, not the whole model: a block's graph
    # once for all blocks (Dynamo reuses it), the outer forward eager
    "compile_blocks": [COMPILE_BLOCKS],
    # no garbage collection during the loop: its pauses land at random steps
    "gc_off": [("    memory_step = min(run.step + 2, cfg.train.max_steps)",
                "    gc.collect()\n    gc.freeze()\n    gc.disable()\n"
                "    memory_step = min(run.step + 2, cfg.train.max_steps)")],
    # one process: the compiled model's graphs replayed as CUDA graphs (fewer kernel launches),
    # each forward starting a new step of CUDA graph trees, the gradients zeroed rather than freed.
    # Under torch 2.11 it stops in the first backward (bench/RESULTS.md, graphs_shapeA_1gpu)
    "cuda_graphs": CUDA_GRAPHS,
    # the same with every gradient made before the first backward. Where a weight has no gradient
    # yet, autograd may keep the backward's output as the gradient without a copy (AccumulateGrad),
    # and that output would be a CUDA graph's memory, which the next replay overwrites: a guess at
    # the failure above (pytorch#169545). With the gradients made it runs, slower than without
    # CUDA graphs (bench/RESULTS.md, graphs2_shapeA_1gpu)
    "cuda_graphs_grads_made": [*CUDA_GRAPHS, GRADS_MADE],
    # and the model and the loss in one graph, so the logits never leave it
    "cuda_graphs_one_graph": [GRADS_ZEROED, GRADS_MADE, (
        "            with setup.autocast:\n"
        "                logits = model(**batch[\"inputs\"]).logits\n"
        "            micro_loss = setup.loss_of(logits, batch[\"labels\"])\n",
        "            torch.compiler.cudagraph_mark_step_begin()\n"
        "            micro_loss, logits = graphed_loss(setup, batch), None\n"), (
        "\nif __name__ == \"__main__\":\n",
        "\ndef graphed_loss(setup, batch):\n"
        "    if not hasattr(graphed_loss, \"compiled\"):\n"
        "        def model_loss(inputs, labels):\n"
        "            with setup.autocast:\n"
        "                logits = setup.raw_model(**inputs).logits\n"
        "            return token_loss_sum(logits, labels)\n"
        "        graphed_loss.compiled = torch.compile(model_loss, mode=\"reduce-overhead\")\n"
        "    return graphed_loss.compiled(batch[\"inputs\"], batch[\"labels\"])\n"
        "\n\nif __name__ == \"__main__\":\n")],
    # the whole step captured by hand as one CUDA graph (CAPTURED_STEP)
    "cuda_graphs_captured": CAPTURED,
    # and its verdict read a step late (CAPTURED_AHEAD)
    "captured_ahead": CAPTURED_AHEAD,
    # the host waits for the GPU after every step, not only before validation and checkpoints
    "sync_every_step": [("        with interval.paused(validating or saving):",
                         "        with interval.paused(True):")],
    # a non-finite gradient skips the update inside the fused AdamW kernel (its found_inf), so the
    # update is queued before the host reads the verdict, not after
    "masked_update": [(
        "    bad, stop, in_a_row = step_verdict(grad_norm, setup, run)  # every rank decides "
        "alike\n    if not bad:  # a non-finite gradient: no update on any rank; the data and "
        "schedule move on\n        optimizer.step()\n",
        "    optimizer.found_inf = grad_norm.isfinite().logical_not().float()\n"
        "    optimizer.step()\n"
        "    bad, stop, in_a_row = step_verdict(grad_norm, setup, run)\n")],
    # GPT-2's Conv1D layers (x @ W) as nn.Linear (x @ W.T, nanoGPT's layout): the matmuls' other
    # transposition
    "linear_layout": [("    raw_model, attention = build_model(cfg, reader, meta, device)\n",
                       "    raw_model, attention = build_model(cfg, reader, meta, device)\n"
                       "    from transformers.pytorch_utils import Conv1D\n"
                       "    for parent in list(raw_model.modules()):\n"
                       "        for name, child in list(parent.named_children()):\n"
                       "            if isinstance(child, Conv1D):\n"
                       "                linear = torch.nn.Linear(*child.weight.shape)\n"
                       "                linear.weight.data.copy_(child.weight.data.t())\n"
                       "                linear.bias.data.copy_(child.bias.data)\n"
                       "                setattr(parent, name, linear)\n")],
    # fp8 for the MLP's layers alone: at width 1280 the attention's square projections may gain
    # less than their casts cost (blocks compiled one by one, as fp8_levers' other sides)
    "fp8_mlp_only": [("module_filter_fn=lambda module, name: name in chosen)",
                      "module_filter_fn=lambda module, name: name in chosen and '.mlp.' in name)"),
                     COMPILE_BLOCKS],
    # torchao's rowwise recipe (a scale per row, not per tensor), blocks compiled one by one
    "fp8_rowwise": [("Float8LinearConfig.from_recipe_name(\"tensorwise\")",
                     "Float8LinearConfig.from_recipe_name(\"rowwise\")"), COMPILE_BLOCKS],
    # the residual stream left in fp32, as autocast alone leaves it
    "fp32_residual": [("    residual_in_bf16(raw_model, dtype)  # in a bf16 step, the residual "
                       "stream in bf16 too\n", "")],
    # the update compiled (COMPILED_OPTIMIZER), alone and with every generated kernel's launch
    # parameters tuned, the update's too
    "compiled_optimizer": COMPILED_OPTIMIZER,
    "tuned_compiled_optimizer": [inductor_option("coordinate_descent_tuning"),
                                 *COMPILED_OPTIMIZER],
    # inductor tunes each generated kernel's launch parameters (a longer compile)
    "inductor_tuned": [inductor_option("coordinate_descent_tuning")],
    # inductor benchmarks Triton matmul templates against cuBLAS for each matmul shape and keeps
    # the faster (a longer compile); CUDA graphs stay off
    "max_autotune_gemm": [AUTOTUNE_GEMM],
    # both levers that might add up: the captured step with its matmuls autotuned
    "captured_autotuned": [*CAPTURED, AUTOTUNE_GEMM],
    # the two that gained most on shape A, together: the captured step, its kernels tuned
    "captured_tuned": [*CAPTURED, inductor_option("coordinate_descent_tuning")],
    # SDPA through cuDNN's attention alone, not flash
    "sdpa_cudnn": [("def main():\n", "def main():\n"
                    "    torch.backends.cuda.enable_flash_sdp(False)\n"
                    "    torch.backends.cuda.enable_mem_efficient_sdp(False)\n"
                    "    torch.backends.cuda.enable_math_sdp(False)\n"
                    "    torch.backends.cuda.enable_cudnn_sdp(True)\n")],
    # the model and the loss compiled as one graph, as nanoGPT's (its forward returns the loss):
    # one compiled call a micro-batch forward and one backward, not two of each
    "loss_in_graph": [
        ("            with setup.autocast:\n                logits = model(**batch[\"inputs\"])"
         ".logits\n            micro_loss = setup.loss_of(logits, batch[\"labels\"])\n",
         "            logits = None  # inside the one graph\n"
         "            micro_loss = model_and_loss(setup)(batch[\"inputs\"], batch[\"labels\"])\n"),
        ("def train_step(", "def model_and_loss(setup, compiled={}):\n"
         "    device, dtype = setup.autocast.device, setup.autocast.fast_dtype\n"
         "    enabled = setup.autocast._enabled\n\n"
         "    def both(inputs, labels):\n"
         "        with torch.autocast(device, dtype=dtype, enabled=enabled):\n"
         "            logits = setup.raw_model(**inputs).logits\n"
         "        return token_loss_sum(logits, labels)\n"
         "    if not compiled:\n"
         "        compiled[0] = torch.compile(both) if setup.cfg.train.compile == \"true\" "
         "else both\n"
         "    return compiled[0]\n\n\n"
         "def train_step(")],
    # one process: the verdict not all-reduced (nothing to reduce), so no NCCL kernel in the step
    "verdict_local": [("        dist.all_reduce(verdict, op=dist.ReduceOp.MAX)\n",
                       "        if dist.get_world_size() > 1:\n"
                       "            dist.all_reduce(verdict, op=dist.ReduceOp.MAX)\n")],
    # fp8 without torch.compile, which the trainer refuses
    "fp8_eager": [("    if not use_compile:\n        return (\"train.precision=fp8 needs torch",
                   "    if False:\n        return (\"train.precision=fp8 needs torch")],
    # each step's verdict read in that step: the host waits there for the GPU to finish the step
    "reference_same_step": [("        verdicts.defer(step + 1, verdict, step_label_tokens)\n",
                             "        verdicts.defer(step + 1, verdict, step_label_tokens)\n"
                             "        verdicts.settle()\n")],
}
# Variants kept whole, outside the repository (.baselines/ is ignored by git): a folder holding a
# train_ddp.py and its config.yaml, made from a commit by
#   mkdir -p .baselines/at_47acc78 &&
#   git show 47acc78:train_ddp.py > .baselines/at_47acc78/train_ddp.py &&
#   git show 47acc78:config.yaml > .baselines/at_47acc78/config.yaml
# and for reference (REFERENCE_COMMIT)
#   mkdir -p .baselines/reference &&
#   git show 850740a:train_ddp.py > .baselines/reference/train_ddp.py &&
#   git show 850740a:config.yaml > .baselines/reference/config.yaml
REFERENCE_COMMIT = "850740a"  # the previous trainer, which a rewritten one is timed against
VARIANT_FILES = {"at_47acc78": REPO / ".baselines" / "at_47acc78",
                 "reference": REPO / ".baselines" / "reference"}
# the VARIANT_FILES folder a variant's replacements are made in; others: the repository's trainer
VARIANT_BASES = {"reference_same_step": "reference"}

# Sides "config:NAME" (a "#N" after the name only tells repeats apart): train_ddp.py with these
# overrides added. {prometheus_port}: the side's own port (MASTER_PORT + 5: two bench processes on
# one machine do not clash).
CONFIG_SIDES = {
    "metrics_off": ["log.tensorboard=false", "log.prometheus_port=0", "log.gpu_util=false"],
    "metrics_on": ["log.tensorboard=true", "log.prometheus_port={prometheus_port}",
                   "log.gpu_util=true"],
    "llama": ["model.type=llama", "model.intermediate_size={intermediate_size}"],
    "llama_fp8": ["model.type=llama", "model.intermediate_size={intermediate_size}",
                  "train.precision=fp8"],
    "eager": ["train.compile=false"],
    # fewer, larger micro-batches for the same global batch: fewer compiled-graph calls and kernel
    # launches on the host per token
    "micro32": ["train.micro_batch_size=32"],
    "micro64": ["train.micro_batch_size=64"],
    "gloo": ["dist.backend=gloo"],
}

DATA_WAIT_KEY = "data_wait_frac"  # a metrics.jsonl "train" key
COMM_KEYS = ["comm_exposed_ms", "allreduce_p50_ms", "allreduce_p95_ms"]  # None where not timed


# The trainer's config keys this script sets (config.yaml): change them here if the trainer
# renames one.
def our_overrides(shape, batch, steps, log_every, run_dir, tiny):
    if "patch_size" in shape:  # a ViT: the image size and the classes are the data's (meta.json)
        model = ["model.type=vit", f"model.n_layer={shape['n_layer']}",
                 f"model.n_head={shape['n_head']}", f"model.n_embd={shape['n_embd']}",
                 f"model.intermediate_size={shape['intermediate_size']}",
                 f"model.patch_size={shape['patch_size']}"]
    else:
        model = [
            f"model.n_layer={shape['n_layer']}", f"model.n_head={shape['n_head']}",
            f"model.n_embd={shape['n_embd']}",
            # not read by the trainer (the vocabulary is the data's): run_ours checks the logged one
            f"data.vocab_size={batch['vocab_size']}", f"train.seq_len={batch['seq_len']}"]
    return [
        *model, f"train.micro_batch_size={batch['micro_batch_size']}",
        f"train.global_batch_size={batch['global_batch_size']}", f"train.max_steps={steps}",
        # validation at steps 0 and `steps` only, outside the window (the trainer's clock skips it)
        f"train.eval_every={steps}", "train.eval_batches=1",
        "checkpoint.every=0", "export=false",  # a bench run leaves only metrics
        f"log.every={log_every}",
        f"out_dir={run_dir}", f"checkpoint.dir={run_dir}/ckpt",
        "train.compile=false" if tiny else "train.compile=true",
        "train.precision=fp32" if tiny else "train.precision=bf16",
    ]


def nanogpt_flags(shape, batch, steps, run_dir, data_dir, tiny):
    """nanoGPT's train.py reads --key=value for its module-level settings (configurator.py)."""
    return [
        f"--n_layer={shape['n_layer']}", f"--n_head={shape['n_head']}",
        f"--n_embd={shape['n_embd']}", f"--block_size={batch['seq_len']}", "--bias=True",
        "--dropout=0.0",
        f"--batch_size={batch['micro_batch_size']}",
        # the global count: train.py divides it by the world size, so 2 GPUs do 2 micro-batches each
        f"--gradient_accumulation_steps={batch['global_batch_size'] // batch['micro_batch_size']}",
        f"--max_iters={steps - 1}",  # it runs iterations 0..max_iters: `steps` steps, like ours
        # it evaluates whenever iter % eval_interval == 0: at iteration 0 only (unavoidable)
        f"--eval_interval={steps}", "--eval_iters=1", "--always_save_checkpoint=False",
        "--log_interval=1",  # its default: a time per iteration, so a window can start anywhere
        f"--dataset={data_dir}",  # absolute: os.path.join('data', dataset) returns it unchanged
        f"--out_dir={run_dir}",
        "--compile=False" if tiny else "--compile=True",
        "--dtype=float32" if tiny else "--dtype=bfloat16",
        *(["--device=cpu"] if tiny else []),
    ]


VIT_B16 = {"n_layer": 12, "n_head": 12, "n_embd": 768, "intermediate_size": 3072,
           "patch_size": 16, "image_size": 224}  # timm's vit_base_patch16_224


def timm_flags(shape, batch, steps, skip_steps, tiny):
    """timm's benchmark.py --bench train: skip_steps steps of warm-up (compiling), then the other
    steps timed by its own clock."""
    flags = ["--bench", "train", "--model", "vit_base_patch16_224",
             "--batch-size", str(batch["micro_batch_size"]), "--img-size", str(shape["image_size"]),
             "--num-classes", str(shape["classes"]),
             "--opt", "adamw",  # as ours; its default is SGD
             "--num-warm-iter", str(skip_steps), "--num-bench-iter", str(steps - skip_steps),
             "--no-retry"]  # else an out-of-memory batch is retried smaller
    if any(shape[key] != VIT_B16[key] for key in VIT_B16):  # --tiny's ViT: the same name, resized
        flags += ["--model-kwargs", f"depth={shape['n_layer']}", f"embed_dim={shape['n_embd']}",
                  f"num_heads={shape['n_head']}",
                  f"mlp_ratio={shape['intermediate_size'] / shape['n_embd']}",
                  f"patch_size={shape['patch_size']}", f"img_size={shape['image_size']}"]
    if tiny:
        return flags + ["--device", "cpu"]  # float32, eager
    return flags + ["--amp", "--amp-dtype", "bfloat16", "--torchcompile"]


# ----------------------------------------------------------------------------- 2. machine

def probe_machine():
    """Machine, versions, and the peak FLOP/s train_ddp.py divides by (from a child process, so that
    this one never holds a CUDA context while the sides run)."""
    cores = os.cpu_count()
    probe = (
        "import importlib.util, json, platform, sys, torch, transformers\n"
        "info = {'python': platform.python_version(), 'torch': torch.__version__,\n"
        "        'cuda': torch.version.cuda, 'transformers': transformers.__version__,\n"
        "        'nccl': None, 'peak_flops': None, 'gpu_names': [], 'timm': None}\n"
        "if importlib.util.find_spec('timm'):\n"
        "    import timm\n"
        "    info['timm'] = timm.__version__\n"
        "if torch.cuda.is_available():\n"
        "    info['nccl'] = '.'.join(map(str, torch.cuda.nccl.version()))\n"
        "    info['gpu_names'] = [torch.cuda.get_device_name(i)\n"
        "                         for i in range(torch.cuda.device_count())]\n"
        "    try:\n"  # a trainer without this table costs the MFU by our formula, not the GPUs
        "        import train_ddp\n"
        "        info['peak_flops'] = train_ddp.peak_flops_per_gpu(torch.device('cuda', 0), 0)\n"
        "    except Exception as error:\n"
        "        info['peak_flops_error'] = repr(error)\n"
        "print(json.dumps(info))\n"
    )
    result = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True,
                            timeout=120)
    try:
        info = json.loads(result.stdout.strip().splitlines()[-1])
    except (IndexError, json.JSONDecodeError):
        info = {"error": (result.stderr or result.stdout)[-500:], "gpu_names": [],
                "peak_flops": None}
    names = info["gpu_names"]
    info["gpus"] = len(names)
    info["machine"] = (f"{len(names)} × {names[0]}, {cores} cores" if names
                       else f"CPU only, {cores} cores")
    info["nanogpt_commit"] = nanogpt_commit()
    info["timm_commit"] = baseline_commit(TIMM_DIR)  # of benchmark.py; info["timm"]: the package
    # the GPU tool's copy of the tree can carry an older .git than the files: set BENCH_COMMIT there
    info["repo_commit"] = (os.environ.get("BENCH_COMMIT")
                           or git_output(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"])
                           or "unknown")
    if "BENCH_COMMIT" not in os.environ and info["repo_commit"] != "unknown" and git_output(
            ["git", "-C", str(REPO), "status", "--porcelain", "--", "."]):
        info["repo_commit"] += " + uncommitted changes"
    info["nccl_nvls_enable"] = os.environ.get("NCCL_NVLS_ENABLE")
    return info


def git_output(command):
    try:
        return subprocess.run(command, capture_output=True, text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return ""


def nanogpt_commit():
    return baseline_commit(NANOGPT_DIR)


def baseline_commit(folder):
    """A clone knows its commit; an exported snapshot (git archive) or a copied file carries it in a
    COMMIT file."""
    commit_file = folder / "COMMIT"
    if commit_file.is_file():
        return commit_file.read_text().strip()
    if not (folder / ".git").exists():  # git -C would answer with this repository's commit
        return "unknown"
    return git_output(["git", "-C", str(folder), "rev-parse", "HEAD"]) or "unknown"


# ----------------------------------------------------------------------------- 3. data

def random_token_data(batch, tiny):
    """train.bin/val.bin of uniform random uint16 tokens below vocab_size, and meta.pkl holding
    vocab_size (nanoGPT sizes its embedding from it). Token values do not change the work of a
    fixed-length causal step, so random tokens time the same as text."""
    import pickle  # only here: nanoGPT's format

    data_dir = WORK_DIR / ("random_tokens_tiny" if tiny else "random_tokens")
    # 16M: 200 HF Trainer steps of 65,536 tokens stay in one epoch
    train_tokens = 2**20 if tiny else 2**24
    if (data_dir / "meta.pkl").is_file():
        return data_dir
    data_dir.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(1337)
    for name, count in [("train.bin", train_tokens), ("val.bin", 2**16)]:
        rng.integers(0, batch["vocab_size"], count, dtype=np.uint16).tofile(data_dir / name)
    with open(data_dir / "meta.pkl", "wb") as file:  # last: once it is there, all is written
        pickle.dump({"vocab_size": batch["vocab_size"]}, file)
    return data_dir


def zipf_token_data(vocab_size, tiny):
    """preprocess.py's layout (meta.json, token_frequencies.npy, train-00000.arrow,
    val-00000.arrow) filled with random tokens whose frequencies follow Zipf's law, p(k-th most
    frequent) proportional to 1/k (word counts of text roughly do), the ranks shuffled over the ids
    so the frequent ones are not simply the low ids. For the tiered embedding, which puts the most
    frequent rows on the GPU: uniform tokens would touch nearly every row. Documents of 4096
    tokens, each followed by end-of-text (id 0), as preprocess.py writes them."""
    import pyarrow as pa  # only here: the trainer's data format

    data_dir = WORK_DIR / f"zipf_{vocab_size}{'_tiny' if tiny else ''}"
    if (data_dir / "meta.json").is_file():
        return data_dir
    data_dir.mkdir(parents=True, exist_ok=True)
    # where preprocess.py's tokenizers have them
    special = {"eot": 0, "pad": 1, "mask": 2, "cls": 3, "sep": 4}
    rng = np.random.default_rng(1337)
    probabilities = 1 / np.arange(1, vocab_size - len(special) + 1)
    probabilities /= probabilities.sum()
    id_of_rank = len(special) + rng.permutation(vocab_size - len(special))
    document_tokens, splits = 4096, {}
    for split, tokens in [("train", 2**20 if tiny else 2**23), ("val", 2**17)]:
        ranks = rng.choice(len(probabilities), size=tokens, p=probabilities)
        ids = id_of_rank[ranks].reshape(-1, document_tokens)
        rows = np.concatenate([ids, np.zeros((len(ids), 1), ids.dtype)], axis=1).astype(np.int32)
        offsets = np.arange(0, rows.size + 1, document_tokens + 1, dtype=np.int32)
        schema = pa.schema([("input_ids", pa.list_(pa.int32()))])
        documents = pa.ListArray.from_arrays(pa.array(offsets), pa.array(rows.ravel()))
        with pa.ipc.new_file(str(data_dir / f"{split}-00000.arrow"), schema) as writer:
            writer.write_batch(pa.record_batch([documents], schema=schema))
        splits[split] = {"files": [f"{split}-00000.arrow"], "documents": len(rows),
                         "tokens": int(rows.size)}
        if split == "train":
            np.save(data_dir / "token_frequencies.npy",
                    np.bincount(rows.ravel(), minlength=vocab_size))
    meta = {"format_version": 1, "vocab_size": vocab_size, "special_tokens": special,
            "token_dtype": "int32", "eot_appended": True, "splits": splits,
            "source": "bench.py zipf_token_data (random, Zipf's law)",
            "fingerprint": f"zipf-{vocab_size}-{tiny}",
            "token_frequencies_file": "token_frequencies.npy"}
    (data_dir / "meta.json").write_text(json.dumps(meta))  # last: once it is there, all is written
    return data_dir


def random_image_data(shape, batch):
    """preprocess.py's image layout: meta.json and Arrow IPC files train-00000.arrow and
    val-00000.arrow of uniform random uint8 RGB images (pixels: fixed_size_binary(size * size * 3),
    row-major height, width, channel) and uniform random labels (int32). A step of fixed size does
    the same work on any pixels."""
    import hashlib

    import pyarrow as pa  # only here: the trainer's data format

    size, classes = shape["image_size"], shape["classes"]
    image_bytes = size * size * 3
    options = {"image_size": size, "classes": classes, "train": batch["train_images"],
               "val": batch["val_images"], "seed": 1337}
    data_dir = WORK_DIR / f"random_images_{size}px_{classes}_{batch['train_images']}"
    if (data_dir / "meta.json").is_file():
        return data_dir
    data_dir.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(options["seed"])
    schema = pa.schema([("pixels", pa.binary(image_bytes)), ("label", pa.int32())])
    splits = {}
    for split in ["train", "val"]:
        images, name = options[split], f"{split}-00000.arrow"
        with pa.ipc.new_file(str(data_dir / name), schema) as writer:
            for first in range(0, images, 1024):  # in batches: 8,192 images at 224 px are 1.2 GB
                count = min(1024, images - first)
                pixels = rng.integers(0, 256, count * image_bytes, dtype=np.uint8)
                pixels = pa.FixedSizeBinaryArray.from_buffers(
                    pa.binary(image_bytes), count, [None, pa.py_buffer(pixels)])
                labels = pa.array(rng.integers(0, classes, count, dtype=np.int32))
                writer.write_batch(pa.record_batch([pixels, labels], schema=schema))
        splits[split] = {"files": [name], "images": images}
    meta = {"format_version": 1, "kind": "images", "image_size": size, "channels": 3,
            "classes": [f"class_{index}" for index in range(classes)],
            "mean": [0.5, 0.5, 0.5], "std": [0.29, 0.29, 0.29],  # uniform bytes: 0.5 and 0.29
            "splits": splits, "skipped": {"count": 0, "examples": []},
            "source": "bench.py random_image_data",
            "fingerprint": hashlib.sha256(json.dumps(options, sort_keys=True).encode()).hexdigest()}
    (data_dir / "meta.json").write_text(json.dumps(meta))  # last: once it is there, all is written
    return data_dir


def read_image_split(data_dir, split):
    """(pixels as uint8 [images, height, width, 3], labels as int64 [images]) of a split, read
    into memory."""
    import pyarrow as pa

    meta = json.loads((data_dir / "meta.json").read_text())
    size = meta["image_size"]
    pixels, labels = [], []
    for name in meta["splits"][split]["files"]:
        table = pa.ipc.open_file(pa.memory_map(str(data_dir / name))).read_all()
        for chunk in table.column("pixels").chunks:  # a fixed-size binary array: one flat buffer
            flat = np.frombuffer(chunk.buffers()[1], dtype=np.uint8)
            start = chunk.offset * size * size * 3
            pixels.append(flat[start:start + len(chunk) * size * size * 3])
        labels.append(table.column("label").to_numpy())
    pixels = np.concatenate(pixels).reshape(-1, size, size, 3)
    return pixels, np.concatenate(labels).astype(np.int64)


# ----------------------------------------------------------------------------- 4. running one side

class Log:
    """Everything printed goes to the console and to $OUT/bench.log."""

    def __init__(self, path):
        path.parent.mkdir(parents=True, exist_ok=True)
        self.file = open(path, "a")
        self.lock = threading.Lock()

    def __call__(self, text):
        with self.lock:
            print(text, flush=True)
            self.file.write(text + "\n")
            self.file.flush()


def run_process(command, cwd, env_extra, timeout_s, log):
    """Run one side in its own process group and copy its output into the log as it comes.
    Returns (status, output, seconds); status is 'ok', 'failed (exit N)' or 'timeout after Ns'."""
    status, outputs, seconds = run_processes(command, cwd, [env_extra], timeout_s, log)
    return status, outputs[0], seconds


# how long the other nodes of a side may run on after one failed: they would wait for it up to
# dist.timeout_s
FAILED_NODE_GRACE_S = 30


def run_processes(command, cwd, env_extras, timeout_s, log, prefixes=None):
    """The same command once per environment in env_extras (one per "node"), all at once, each in
    its own process group, after its entry of prefixes if given (e.g. ip netns exec NAME). Returns
    (status, [output of each], seconds); with several, each logged line says its node."""
    start = time.perf_counter()
    processes, outputs, readers = [], [], []
    for node, env_extra in enumerate(env_extras):
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **env_extra}
        process = subprocess.Popen([*(prefixes[node] if prefixes else []), *command], cwd=cwd,
                                   env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                   text=True, errors="replace", start_new_session=True)
        lines, prefix = [], f"[node {node}] " if len(env_extras) > 1 else ""

        def copy_output(process=process, lines=lines, prefix=prefix):
            for line in process.stdout:
                lines.append(line)
                log(prefix + line.rstrip("\n"))

        reader = threading.Thread(target=copy_output, daemon=True)
        reader.start()
        processes.append(process)
        outputs.append(lines)
        readers.append(reader)
    deadline, failed_at, status = start + timeout_s, None, None
    try:
        while any(process.poll() is None for process in processes):
            now = time.perf_counter()
            if failed_at is None and any(process.poll() not in (None, 0) for process in processes):
                failed_at = now
            if now > deadline or (failed_at is not None and now > failed_at + FAILED_NODE_GRACE_S):
                status = f"timeout after {timeout_s}s" if now > deadline else None
                break
            time.sleep(0.2)
    finally:  # a timeout, a failed node, Ctrl-C or SIGTERM (exit_on_sigterm): none left running
        stop_groups([process for process in processes if process.poll() is None])
    codes = [process.wait() for process in processes]
    if status is None:
        bad = [(node, code) for node, code in enumerate(codes) if code != 0]
        status = "ok" if not bad else "failed (" + ", ".join(
            (f"node {node}: " if len(codes) > 1 else "") + f"exit {code}"
            for node, code in bad) + ")"
    for reader in readers:
        reader.join(timeout=10)
    return status, ["".join(lines) for lines in outputs], time.perf_counter() - start


def stop_groups(processes):
    """SIGTERM to each whole group (torchrun's workers would otherwise keep their GPUs busy for the
    next side), SIGKILL to those still there 20 s later."""
    for process in processes:
        os.killpg(process.pid, signal.SIGTERM)
    for process in processes:
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


def exit_on_sigterm():
    """A SIGTERM (a shell's `timeout`, a job's time limit) exits through Python, so run_processes
    stops the side it runs: that side is in a process group of its own, which the signal misses, and
    would go on holding the GPU and its port, training into a closed pipe."""
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))


def shell_text(command, env_extra, cwd):
    """The command as one could paste it into a shell at the repository root."""
    prefix = f"cd {os.path.relpath(cwd, REPO)} && " if Path(cwd) != REPO else ""
    assignments = [f"{key}={shlex.quote(value)}" for key, value in env_extra.items()]
    return prefix + " ".join(assignments + [shlex.quote(part) for part in command])


ONLY_SIDES = set()  # --sides: a call's time goes to these sides alone
# two bench processes can share a machine of 2 GPUs, one each
GPU_OFFSET = int(os.environ.get("BENCH_FIRST_GPU", "0"))


def device_env(gpus, tiny):
    if tiny:
        return {"CUDA_VISIBLE_DEVICES": ""}
    return {"CUDA_VISIBLE_DEVICES": ",".join(str(GPU_OFFSET + i) for i in range(gpus))}


# ----------------------------------------------------------------------------- 5. the sides

def variant_script(name):
    """The path of variant `name`'s train_ddp.py, with its config.yaml beside it. A VARIANT_FILES
    variant is read where it lies; a VARIANTS one is written: its base (VARIANT_BASES, else the
    repository's trainer) with the replacements made."""
    if name in VARIANT_FILES:
        return variant_folder(name) / "train_ddp.py"
    base = variant_folder(VARIANT_BASES[name]) if name in VARIANT_BASES else REPO
    text = (base / "train_ddp.py").read_text()
    for old, new in VARIANTS[name]:
        if old not in text:
            raise ValueError(f"variant {name}: {old[:60]!r} is no longer in "
                             f"{base / 'train_ddp.py'}")
        text = text.replace(old, new)
    directory = WORK_DIR / "variants" / name
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.yaml").write_text((base / "config.yaml").read_text())
    (directory / "train_ddp.py").write_text(text)
    return directory / "train_ddp.py"


def variant_folder(name):
    folder = VARIANT_FILES[name]
    missing = [file for file in ["train_ddp.py", "config.yaml"] if not (folder / file).is_file()]
    if missing:
        raise FileNotFoundError(f"{folder} has no {' or '.join(missing)} -> make it as the comment "
                                "above VARIANT_FILES in bench/bench.py says")
    return folder


def launch_envs(side, stage, tiny, port):
    """launch.sh's environment for each process a side starts: one node of stage["gpus"]
    processes, or, for "two_nodes:..." sides, two nodes of one GPU each. Both nodes share this
    machine's files (out_dir, checkpoint.dir): only global rank 0 writes metrics.jsonl and
    checkpoints, and launch.sh names each node's log directory after its node rank and pid."""
    common = {"MASTER_PORT": str(port), **stage.get("env", {}),
              **({"LAUNCH_DEVICE": "cpu"} if tiny else {})}
    if not side.startswith(("two_nodes:", "netns:")):
        return [{**device_env(stage["gpus"], tiny), "NPROC_PER_NODE": str(stage["gpus"]), **common}]
    # each launch.sh would give its one process all cores: two of them would ask for twice the cores
    threads = str(max(1, (os.cpu_count() or 2) // 2))
    envs = [{"CUDA_VISIBLE_DEVICES": "" if tiny else str(GPU_OFFSET + node), "NPROC_PER_NODE": "1",
             "NNODES": "2", "NODE_RANK": str(node), "MASTER_ADDR": "127.0.0.1",
             "OMP_NUM_THREADS": threads, **TWO_NODE_ENV, **common} for node in range(2)]
    if side.startswith("netns:"):  # gloo needs it too: it would take the host name's address
        for env, (_, _, interface) in zip(envs, NETNS_HOSTS):
            env.update(MASTER_ADDR=NETNS_HOSTS[0][0], NCCL_SOCKET_IFNAME=interface,
                       GLOO_SOCKET_IFNAME=interface)
    return envs


def netns_prefixes(side):
    if not side.startswith("netns:"):
        return None
    return [["ip", "netns", "exec", namespace] for _, namespace, _ in NETNS_HOSTS]


def launch_text(command, env_extras, prefixes=None):
    """The side's command line(s) as one could paste them into a shell: several nodes start in the
    background."""
    texts = [(" ".join(prefixes[node]) + " env " if prefixes else "")
             + shell_text(command, env_extra, REPO) for node, env_extra in enumerate(env_extras)]
    return texts[0] if len(texts) == 1 else " & ".join(texts) + " & wait"


def make_two_hosts(hosts=NETNS_HOSTS):
    """Two network namespaces joined by a veth pair, each end with its address: `hosts` is
    [(address, namespace, interface)] for each (root and iproute2 needed; test_smoke.py's two_hosts
    fixture makes its own with this). Returns None, or why they could not be made."""
    remove_two_hosts(hosts)
    (_, ns_a, if_a), (_, ns_b, if_b) = hosts
    steps = [["netns", "add", ns_a], ["netns", "add", ns_b],
             ["link", "add", if_a, "type", "veth", "peer", "name", if_b],
             ["link", "set", if_a, "netns", ns_a], ["link", "set", if_b, "netns", ns_b]]
    for address, namespace, interface in hosts:
        steps += [["-n", namespace, "addr", "add", f"{address}/24", "dev", interface],
                  ["-n", namespace, "link", "set", "lo", "up"],
                  ["-n", namespace, "link", "set", interface, "up"]]
    for step in steps:
        try:
            done = subprocess.run(["ip", *step], capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.TimeoutExpired) as error:
            return f"ip {' '.join(step)}: {error}"
        if done.returncode != 0:
            remove_two_hosts(hosts)
            return f"ip {' '.join(step)}: {done.stderr.strip()}"
    return None


def remove_two_hosts(hosts=NETNS_HOSTS):
    """Ends whatever still runs in the namespaces, then deletes them; deleting a namespace also
    deletes the veth end inside it, and with it the other end (an end that never moved into its
    namespace is deleted by name)."""
    for _, namespace, interface in hosts:
        for pid in quiet_run(["ip", "netns", "pids", namespace]).split():
            with contextlib.suppress(ProcessLookupError):  # ended meanwhile
                os.kill(int(pid), signal.SIGKILL)
        quiet_run(["ip", "netns", "del", namespace])
        quiet_run(["ip", "link", "del", interface])


def quiet_run(command):
    """The command's output, or "" where it fails or cannot run (no such namespace, no `ip`)."""
    try:
        return subprocess.run(command, capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return ""


def nccl_transports(output):
    """The distinct transports NCCL_DEBUG=INFO reported for its channels: 'NET/Socket/0', ..."""
    return sorted(set(re.findall(r"NCCL INFO Channel .* via (\S+)", output))) or None


def run_ours(stage_name, stage, shape, batch, tiny, port, log, side="ours"):
    base_side = side.split(":", 1)[1] if side.startswith(("two_nodes:", "netns:")) else side
    base_side = base_side.split("#")[0]  # "#2": a stage's second turn of the same side
    if tiny and "train.precision=fp16" in SIDE_OVERRIDES.get(base_side, []):
        return {"status": "skipped: fp16 needs a GPU"}
    if tiny and side == "variant:sync_debug":  # torch.cuda.set_sync_debug_mode asserts without CUDA
        return {"status": "skipped: sync debug mode needs a GPU"}
    run_dir = WORK_DIR / stage_name / side.replace(":", "_").replace("#", "_")
    remove_tree(run_dir)  # a checkpoint left there would be resumed (checkpoint.resume=auto)
    env_extras = launch_envs(side, stage, tiny, port)
    overrides = our_overrides(shape, batch, stage["steps"], stage["log_every"],
                              run_dir.relative_to(REPO), tiny)
    data_dir = (zipf_token_data(batch["vocab_size"], tiny).relative_to(REPO)
                if stage.get("zipf_data") else None)
    if data_dir:
        overrides.append(f"data.dir={data_dir}")
    if stage.get("images"):
        overrides.insert(0, f"data.dir={random_image_data(shape, batch).relative_to(REPO)}")
    if side == "variant:at_47acc78":  # its config has no export key, and it checkpoints at the end
        overrides = [o for o in overrides if o not in ("checkpoint.every=0", "export=false")]
        overrides += [f"checkpoint.every={stage['steps']}", "log.sample_prompt="]
    script = {"ours": "train_ddp.py", "ours_tiered": "train_ddp.py", "ours_fsdp": "train_fsdp.py",
              "ours_python": "train_ddp.py",
              **{name: "train_ddp.py" for name in SIDE_OVERRIDES}}.get(base_side)
    if base_side.startswith("variant:"):
        script = str(variant_script(base_side.split(":", 1)[1]).relative_to(REPO))
    intermediate_size = round(8 / 3 * shape["n_embd"] / 64) * 64  # a Llama's MLP: 8/3 x width
    if stage.get("llama"):  # every side a Llama of the stage's shape
        overrides += ["model.type=llama", f"model.intermediate_size={intermediate_size}"]
    if base_side.startswith("config:"):
        script = "train_ddp.py"
        overrides += [o.format(prometheus_port=port + 5, intermediate_size=intermediate_size)
                      for o in CONFIG_SIDES[base_side.split(":", 1)[1]]]
    command = ["bash", "launch.sh", script, *overrides, *stage.get("extra", []),
               *SIDE_OVERRIDES.get(base_side, []), *stage.get("side_extra", {}).get(side, [])]
    if base_side == "ours_python":  # one process without launch.sh and torchrun; its cores as there
        command = [sys.executable, *command[2:]]
        env_extras = [{**env, "OMP_NUM_THREADS": str(os.cpu_count() or 1)} for env in env_extras]
    micro = [int(arg.split("=", 1)[1]) for arg in command
             if arg.startswith("train.micro_batch_size=")][-1]
    if tiny and batch["global_batch_size"] % (micro * stage["gpus"]):  # e.g. 32 in --tiny's 16
        return {"status": f"skipped: micro-batches of {micro} do not split --tiny's global batch "
                          f"of {batch['global_batch_size']}"}
    prefixes = netns_prefixes(side)
    status, outputs, seconds = run_processes(command, REPO, env_extras, stage["timeout_s"], log,
                                             prefixes)
    output = "".join(outputs)  # rank 0, which logs, runs on one of the nodes: torchrun picks which
    record = {"command": launch_text(command, env_extras, prefixes).replace(sys.executable,
                                                                           "python3"),
              "status": status, "seconds": round(seconds, 1), "nodes": len(env_extras),
              "transports": nccl_transports(output)}
    if data_dir:
        record["data_dir"] = str(data_dir)
    if side == "variant:sync_debug":  # warnings between the first and the last logged step
        logged = [m.start() for m in re.finditer(r"^step \d+/\d+ \|", output, re.MULTILINE)]
        if len(logged) >= 2:
            window = output[logged[0]:logged[-1]]
            record["syncs_between_logged_steps"] = len(re.findall(r"synchroniz", window,
                                                                  re.IGNORECASE))
            record["steps_between_logged_steps"] = stage["steps"] - stage["log_every"]
    parameters = re.search(r"model \S+ \(\w+\), ([\d.]+)M parameters", output)
    record["parameters_millions"] = float(parameters.group(1)) if parameters else None
    vocab = re.search(r"vocab (\d+) padded to (\d+)", output)
    attention = re.search(r"attention (\S+),", output)
    record["vocab"] = int(vocab.group(1)) if vocab else None
    # the trainer's count of what the input embedding holds per device; a tiered one's own count
    # adds its CPU tables and the step's CPU rows on the GPU
    held = (re.search(r"input embedding tiered, held at its second step \([^)]*\): (.*)", output)
            or re.search(r"input embedding \(weights, gradients, optimizer state\): (.*)", output))
    if held:
        record["embedding_mib"] = {kind: float(mib.replace(",", "")) for mib, kind in
                                   re.findall(r"([\d,.]+) MiB on (\w+)", held.group(1))}
    record["attention"] = attention.group(1) if attention else None
    # where the trainer says its metrics go
    outputs = re.search(r"^metrics: (.*)$", output, re.MULTILINE)
    record["metrics_outputs"] = outputs.group(1) if outputs else None
    metrics_path = run_dir / "metrics.jsonl"
    if metrics_path.is_file():
        records = [json.loads(line) for line in metrics_path.read_text().splitlines()
                   if line.strip()]
        record.update(read_our_metrics(
            records, stage["skip_steps"],
            batch["global_batch_size"] if stage.get("images") else None))
    elif status != "ok":
        record["note"] = failure_note(output)
    for name in ["ckpt", "final"]:  # shape B's checkpoint is ~9 GB; the next stage needs the disk
        remove_tree(run_dir / name)
    return record


def failure_note(output):
    """Why a side failed: the last one-line error of the trainer or launch.sh, else the last
    exception a traceback named."""
    errors = (re.findall(r"(?:^error: |\bFAIL: ).*$", output, re.MULTILINE)
              or re.findall(r"^\w+(?:Error|Exception): .*$", output, re.MULTILINE))
    return errors[-1][:300] if errors else None


def run_stress(stage_name, stage, shape, batch, tiny, port, log, side="stress"):
    """stress_test.py's all-reduce table (STRESS_ARGS) on the stage's GPUs: one node, or two
    ("two_nodes:stress", "netns:stress")."""
    run_dir = WORK_DIR / stage_name / side.replace(":", "_")
    remove_tree(run_dir)
    run_dir.mkdir(parents=True)
    env_extras = launch_envs(side, stage, tiny, port)
    command = ["bash", "launch.sh", "stress_test.py", *(TINY_STRESS_ARGS if tiny else STRESS_ARGS),
               "--json", str((run_dir / "stress.json").relative_to(REPO))]
    prefixes = netns_prefixes(side)
    status, outputs, seconds = run_processes(command, REPO, env_extras, stage["timeout_s"], log,
                                             prefixes)
    record = {"command": launch_text(command, env_extras, prefixes), "status": status,
              "seconds": round(seconds, 1), "nodes": len(env_extras),
              "transports": nccl_transports("".join(outputs))}
    if (run_dir / "stress.json").is_file():  # rank 0 writes it, on either node: both see it
        result = json.loads((run_dir / "stress.json").read_text())
        keys = ["size", "time_us", "algbw", "busbw", "wrong"]
        record["allreduce"] = [{key: row[key] for key in keys} for row in result["rows"]]
        record["backend"] = result["run"]["backend"]
        largest = max(result["rows"], key=lambda row: row["size"])
        record["busbw_largest"], record["size_largest"] = largest["busbw"], largest["size"]
    return record


def read_our_metrics(records, skip_steps, images_per_step=None):
    """tokens/s over the steps after skip_steps: the window's tokens over its wall time. Each
    "train" record covers the steps since the previous one; its time is its tokens over its
    tokens_per_sec. An image model (images_per_step given): images/s, the same way, each step's
    images being images_per_step."""
    rate_key = "images_per_sec" if images_per_step else "tokens_per_sec"
    train = [r for r in records if r.get("kind") == "train"]
    done = seconds = mfu_seconds = wait_seconds = 0.0
    previous_done = previous_step = steps = 0  # a fresh run: run_ours empties its run directory
    window, window_start, has_wait, comm = [], 0, True, {key: [] for key in COMM_KEYS}
    for r in train:
        seen = r["step"] * images_per_step if images_per_step else r["tokens_seen"]
        interval_done, previous_done = seen - previous_done, seen
        first_step = previous_step + 1  # of the steps this record covers
        interval_steps, previous_step = r["step"] - previous_step, r["step"]
        if first_step <= skip_steps:  # also one that straddles the window's start: it is left out
            continue
        interval_s = interval_done / r[rate_key]
        done += interval_done
        steps += interval_steps
        seconds += interval_s
        mfu_seconds += (r.get("mfu") or 0.0) * interval_s  # null where the trainer has no MFU
        has_wait = has_wait and r.get(DATA_WAIT_KEY) is not None
        wait_seconds += (r.get(DATA_WAIT_KEY) or 0.0) * interval_s
        window.append(r)
        window_start = window_start or first_step
        for key in COMM_KEYS:
            if r.get(key) is not None:
                comm[key].append(r[key])
    # the trainer's memory accounting at step 2: its prediction and the allocator's figures (bytes)
    memory = next((r for r in records if r.get("kind") == "memory"), None)
    if not seconds:
        return {rate_key: None, "note": f"no logged interval after step {skip_steps}",
                "memory": memory}

    def last(key):  # the value at the window's last log line that has one
        return next((r[key] for r in reversed(train) if r.get(key) is not None), None)

    gpu_utils = [r["gpu_util"] for r in window if r.get("gpu_util") is not None]
    interval_rates = [r[rate_key] for r in window]
    interval_mfus = [r["mfu"] for r in window if r.get("mfu")]
    return {
        rate_key: done / seconds,
        "steps_per_sec": steps / seconds,
        # how steady: the window's fastest interval over its slowest (1.0 = all alike). A masked
        # LM's tokens per step vary with the documents; MFU counts the padded work: the GPU's spread
        f"{rate_key}_max_over_min": max(interval_rates) / min(interval_rates),
        "mfu_max_over_min": max(interval_mfus) / min(interval_mfus) if interval_mfus else None,
        "mfu": mfu_seconds / seconds if any(r.get("mfu") is not None for r in train) else None,
        "data_wait_fraction": wait_seconds / seconds if has_wait else None,
        # NVML's figure at each log line
        "gpu_util_mean": sum(gpu_utils) / len(gpu_utils) if gpu_utils else None,
        "window": f"steps {window_start}-{window[-1]['step']}",
        "window_s": round(seconds, 2),
        "peak_mem_gib": max((r["mem_peak_gib"] for r in train if r.get("mem_peak_gib") is not None),
                            default=None),
        # memory_allocated at the last log line: weights and optimizer state (and, under DDP, the
        # gradient buckets); one process frees its gradients before that line
        "alloc_mem_gib": last("mem_alloc_gib"),
        # the caching allocator's retries (cudaFree, then cudaMalloc again): 0 = no fragmentation
        "alloc_retries": last("alloc_retries"),
        "loss_last": train[-1].get("loss"),
        "val_loss_last": next((r["val_loss"] for r in reversed(records)
                               if r.get("kind") == "val"), None),
        "memory": memory,
        # the mean of the window's intervals (an interval's p50/p95 are over its all-reduces)
        **{key: sum(values) / len(values) if values else None for key, values in comm.items()},
    }


NANOGPT_ITER_LINE = re.compile(r"^iter (\d+): loss \S+, time ([\d.]+)ms", re.MULTILINE)


def read_nanogpt_log(output, tokens_per_step, skip_steps):
    """nanoGPT prints `iter N: loss L, time Tms, mfu M%` per iteration; iteration N is step N + 1.
    tokens/s over steps after skip_steps: the window's tokens over the sum of its iteration times.
    Its clock is read before the iteration's loss.item(), so one time can end before the GPU is
    done; the sum telescopes, so only the offsets at the window's two ends remain."""
    times_ms = [(int(i), float(ms)) for i, ms in NANOGPT_ITER_LINE.findall(output)]
    window = [ms for iteration, ms in times_ms if iteration + 1 > skip_steps]
    if not window:
        return {"tokens_per_sec": None,
                "note": f"no iteration after step {skip_steps} in its output"}
    seconds = sum(window) / 1000
    last_step = max(iteration for iteration, _ in times_ms) + 1
    return {"tokens_per_sec": len(window) * tokens_per_step / seconds,
            "window": f"steps {skip_steps + 1}-{last_step}", "window_s": round(seconds, 2)}


def run_nanogpt(stage_name, stage, shape, batch, tiny, port, log, micro_batch_size=None):
    train_script = NANOGPT_DIR / "train.py"
    if not train_script.is_file():
        return {"status": "missing", "note": (
            f"no nanoGPT checkout at {NANOGPT_DIR} -> git clone "
            f"https://github.com/karpathy/nanoGPT {REPO / '.baselines' / 'nanoGPT'} (or set "
            "NANOGPT_DIR); an offline machine needs it carried there")}
    data_dir = random_token_data(batch, tiny)
    run_dir = WORK_DIR / stage_name / (f"nanogpt_micro{micro_batch_size}" if micro_batch_size
                                       else "nanogpt")
    remove_tree(run_dir)
    if micro_batch_size:  # nanogpt_micro32: micro-batches as large as ours, the same global batch
        if batch["global_batch_size"] % (micro_batch_size * stage["gpus"]):
            return {"status": f"skipped: micro-batches of {micro_batch_size} do not split the "
                              "global batch"}
        batch = {**batch, "micro_batch_size": micro_batch_size}
    flags = nanogpt_flags(shape, batch, stage["steps"], run_dir, data_dir, tiny)
    processes = stage["gpus"]
    note = None
    if tiny and processes > 1:  # its DDP path calls torch.cuda.set_device(f'cuda:{local_rank}')
        processes, note = 1, "CPU: nanoGPT's DDP path needs CUDA, so this side ran one process"
    # as launch.sh does for ours: the cores shared out between the processes
    env_extra = {**device_env(stage["gpus"], tiny),
                 "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 2) // processes))}
    if processes == 1:  # how its README runs one GPU: no torchrun, no DDP wrapper
        command = [sys.executable, "train.py", *flags]
    else:
        command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node",
                   str(processes), "--master-addr", "127.0.0.1", "--master-port", str(port),
                   "train.py", *flags]
    status, output, seconds = run_process(command, NANOGPT_DIR, env_extra, stage["timeout_s"], log)
    record = {"command": shell_text(command, env_extra, NANOGPT_DIR).replace(sys.executable,
                                                                             "python3"),
              "status": status, "seconds": round(seconds, 1)}
    record.update(read_nanogpt_log(output, tokens_per_step(batch), stage["skip_steps"]))
    record["note"] = "; ".join(n for n in [note, record.get("note")] if n) or None
    remove_tree(run_dir)
    return record


# benchmark.py run as it is, then the allocator's peak: its own output has no memory figure
TIMM_RUNNER = ('import runpy, sys, torch; sys.argv = sys.argv[1:]; '
               'runpy.run_path(sys.argv[0], run_name="__main__"); '
               'print("TIMM_PEAK_MEM_GIB", torch.cuda.max_memory_allocated() / 2**30 '
               'if torch.cuda.is_available() else None)')


def run_timm(stage_name, stage, shape, batch, tiny, port, log):
    """timm's own train benchmark (timm_flags): its create_model, the model compiled, bf16
    autocast, AdamW, one random input batch made on the GPU once and used at every step (no data
    loading), random labels, no gradient clipping."""
    if not (TIMM_DIR / "benchmark.py").is_file():
        return {"status": "missing", "note": (
            f"no benchmark.py in {TIMM_DIR} -> copy it from timm's repository as bench/bench.py's "
            "docstring says (or set TIMM_DIR); an offline machine needs it carried there")}
    if importlib.util.find_spec("timm") is None:
        return {"status": "skipped: the timm package is not installed (pip install timm)"}
    command = [sys.executable, "-c", TIMM_RUNNER, "benchmark.py",
               *timm_flags(shape, batch, stage["steps"], stage["skip_steps"], tiny)]
    env_extra = device_env(1, tiny)
    status, output, seconds = run_process(command, TIMM_DIR, env_extra, stage["timeout_s"], log)
    record = {"command": shell_text(command, env_extra, TIMM_DIR).replace(sys.executable,
                                                                          "python3"),
              "status": status, "seconds": round(seconds, 1)}
    record.update(read_timm_output(output, stage["skip_steps"], batch["micro_batch_size"]))
    if status != "ok":
        record["note"] = "; ".join(n for n in [record["note"], failure_note(output)] if n)
    return record


TIMM_INTERVAL_LINE = re.compile(r"^Train \[(\d+)/(\d+)\]\. ([\d.]+) samples/sec\. ([\d.]+) ms/step",
                                re.MULTILINE)
TIMM_DONE_LINE = re.compile(r"^Train benchmark of \S+ done\. ([\d.]+) samples/sec", re.MULTILINE)


def read_timm_output(output, skip_steps, batch_size):
    """benchmark.py logs `Train [i/n]. S samples/sec. T ms/step.` five times over its n timed steps
    (S: the images so far over the sum of their step times), then `Train benchmark of M done.`, then
    prints `--result` and a JSON object. Its train_samples_per_sec, the timed steps' images over
    their wall time, is the figure; the done line's is the same number, read if no JSON came."""
    intervals = [{"step": skip_steps + int(done), "samples_per_sec": float(rate),
                  "ms_per_step": float(ms)}
                 for done, _, rate, ms in TIMM_INTERVAL_LINE.findall(output)]
    result = {}
    if "\n--result" in output:
        with contextlib.suppress(json.JSONDecodeError):
            result = json.JSONDecoder().raw_decode(output.rsplit("\n--result", 1)[1].lstrip())[0]
    if isinstance(result, list):  # a list of models' results
        result = result[0] if result else {}
    done_lines = TIMM_DONE_LINE.findall(output)
    rate = result.get("train_samples_per_sec") or (float(done_lines[-1]) if done_lines else None)
    timed = [int(n) for _, n, _, _ in TIMM_INTERVAL_LINE.findall(output)]
    peak = re.findall(r"^TIMM_PEAK_MEM_GIB (\S+)$", output, re.MULTILINE)
    record = {"images_per_sec": rate, "timm_result": result or None, "timm_intervals": intervals,
              "peak_mem_gib": float(peak[-1]) if peak and peak[-1] != "None" else None}
    if rate and timed:
        record["window"] = f"steps {skip_steps + 1}-{skip_steps + timed[-1]}"
        record["window_s"] = round(timed[-1] * batch_size / rate, 2)
    notes = [f"timm: {result['error']}" if result.get("error") else None,
             f"timm ran batches of {result['train_batch_size']}, not {batch_size}"
             if result.get("train_batch_size") not in (None, batch_size) else None,
             None if rate else "no samples/sec in its output"]
    record["note"] = "; ".join(note for note in notes if note) or None
    return record


def gpt2_config(shape, batch):
    """The stage's GPT-2, built here (no download), as train_ddp.py builds it: no dropout, no
    key/value cache."""
    from transformers import GPT2Config
    return GPT2Config(vocab_size=batch["vocab_size"], n_positions=batch["seq_len"],
                      n_embd=shape["n_embd"], n_layer=shape["n_layer"], n_head=shape["n_head"],
                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False,
                      bos_token_id=0, eos_token_id=0)  # GPT-2's 50256 is outside the vocabulary


def run_hf_trainer(stage_name, stage, shape, batch, tiny, port, log):
    """The worker runs in a child process (see hf_trainer_worker, hf_trainer_vit_worker) so a
    timeout can end it like any side."""
    compiled = hf_compiles(stage, tiny)
    command = [sys.executable, "bench/bench.py", "--hf-trainer-worker", stage_name]
    if tiny:
        command.append("--tiny")
    # one GPU: with two visible, the Trainer would wrap the model in DataParallel
    env_extra = device_env(1, tiny)
    status, output, seconds = run_process(command, REPO, env_extra, stage["timeout_s"], log)
    record = {"command": shell_text(command, env_extra, REPO).replace(sys.executable, "python3"),
              "status": status, "seconds": round(seconds, 1), "compiled": compiled}
    result_lines = re.findall(r"^HF_TRAINER_RESULT (.*)$", output, re.MULTILINE)
    if result_lines:
        record.update(json.loads(result_lines[-1]))
    elif status != "ok":
        record["note"] = failure_note(output)
    return record


def hf_compiles(stage, tiny):
    """hf_trainer_compiled compiles, on a CPU too; the ViT side on a GPU only"""
    return not tiny if stage.get("images") else stage["sides"][0].endswith("compiled")


def window_clock(stage):
    """A Trainer callback that reads a CUDA-synchronized clock at the end of step skip_steps and of
    the last step: without the synchronization the clock would be read while the GPU still has
    queued work."""
    import torch
    from transformers import TrainerCallback

    class WindowClock(TrainerCallback):
        start = end = None

        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step in (stage["skip_steps"], stage["steps"]):
                if torch.cuda.is_available():
                    torch.cuda.synchronize()
                now = time.perf_counter()
                if state.global_step == stage["skip_steps"]:
                    self.start = now
                else:
                    self.end = now

    return WindowClock()


def hf_training_arguments(stage_name, stage, batch, tiny, **extra):
    """As ours: config.yaml's optim; bf16 on a GPU; no evaluation, saving or logging."""
    import torch
    from transformers import TrainingArguments

    on_gpu = torch.cuda.is_available() and not tiny
    return TrainingArguments(
        output_dir=str(WORK_DIR / stage_name / "hf_trainer"), max_steps=stage["steps"],
        per_device_train_batch_size=batch["micro_batch_size"],
        gradient_accumulation_steps=batch["global_batch_size"] // batch["micro_batch_size"],
        learning_rate=6e-4, weight_decay=0.1, adam_beta1=0.9, adam_beta2=0.95, max_grad_norm=1.0,
        lr_scheduler_type="cosine", warmup_steps=min(50, stage["steps"] // 4),
        bf16=on_gpu, tf32=True if on_gpu else None, torch_compile=hf_compiles(stage, tiny),
        use_cpu=not on_gpu, eval_strategy="no", save_strategy="no", logging_strategy="no",
        report_to="none", disable_tqdm=True, dataloader_drop_last=True, seed=1337, **extra)


def hf_trainer_worker(stage_name, tiny):
    """transformers.Trainer on the stage's shape and the random tokens: gpt2_config (no
    download), hf_training_arguments, timed by window_clock."""
    import torch
    from transformers import AutoModelForCausalLM, Trainer

    stage, shape, batch = stage_settings(stage_name, tiny)
    data_dir = random_token_data(batch, tiny)
    seq_len = batch["seq_len"]

    class TokenBlocks(torch.utils.data.Dataset):
        def __init__(self, path):
            self.tokens = np.memmap(path, dtype=np.uint16, mode="r")

        def __len__(self):
            return len(self.tokens) // seq_len

        def __getitem__(self, index):
            block = self.tokens[index * seq_len:(index + 1) * seq_len].astype(np.int64)
            block = torch.from_numpy(block)
            return {"input_ids": block, "labels": block}  # the model shifts labels itself

    config = gpt2_config(shape, batch)
    torch.manual_seed(1337)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    args = hf_training_arguments(stage_name, stage, batch, tiny)
    clock = window_clock(stage)
    trainer = Trainer(model=model, args=args, train_dataset=TokenBlocks(data_dir / "train.bin"),
                      callbacks=[clock])
    trainer.train()
    window_steps = stage["steps"] - stage["skip_steps"]
    seconds = clock.end - clock.start
    result = {"tokens_per_sec": window_steps * tokens_per_step(batch) / seconds,
              "window": f"steps {stage['skip_steps'] + 1}-{stage['steps']}",
              "window_s": round(seconds, 2),
              "optim": getattr(args.optim, "value", str(args.optim)), "attention": "sdpa"}
    print("HF_TRAINER_RESULT " + json.dumps(result), flush=True)


def vit_config(shape):
    """The stage's ViT as transformers' ViTConfig (no download), without dropout."""
    from transformers import ViTConfig
    return ViTConfig(hidden_size=shape["n_embd"], num_hidden_layers=shape["n_layer"],
                     num_attention_heads=shape["n_head"],
                     intermediate_size=shape["intermediate_size"], patch_size=shape["patch_size"],
                     image_size=shape["image_size"], num_channels=3, num_labels=shape["classes"],
                     hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)


def hf_trainer_vit_worker(stage_name, tiny):
    """transformers.Trainer on ViTForImageClassification of the stage's shape (vit_config), on
    random_image_data's train split through a torch Dataset: uint8 images go to the GPU, which
    makes them float and normalizes them by meta.json's mean and std (in the compiled forward).
    hf_training_arguments with 4 loader processes on a GPU, timed by window_clock."""
    import torch
    from transformers import Trainer, ViTForImageClassification

    stage, shape, batch = stage_settings(stage_name, tiny)
    data_dir = random_image_data(shape, batch)
    meta = json.loads((data_dir / "meta.json").read_text())
    pixels, labels = read_image_split(data_dir, "train")

    class Images(torch.utils.data.Dataset):
        def __len__(self):
            return len(labels)

        def __getitem__(self, index):
            return {"pixel_values": torch.from_numpy(pixels[index]), "labels": int(labels[index])}

    # the name ends as ViTForImageClassification's does: transformers picks the loss by it
    class ViTOnBytesForImageClassification(ViTForImageClassification):
        """Takes uint8 images [batch, height, width, 3]."""

        def forward(self, pixel_values, labels=None, **kwargs):
            images = pixel_values.permute(0, 3, 1, 2).float()
            images = (images - self.pixel_mean) / self.pixel_std
            return super().forward(pixel_values=images, labels=labels, **kwargs)

    torch.manual_seed(1337)
    config = vit_config(shape)
    config._attn_implementation = "sdpa"
    model = ViTOnBytesForImageClassification(config)
    for name, values in [("pixel_mean", meta["mean"]), ("pixel_std", meta["std"])]:
        model.register_buffer(name, 255 * torch.tensor(values).view(1, 3, 1, 1), persistent=False)
    on_gpu = torch.cuda.is_available() and not tiny
    args = hf_training_arguments(stage_name, stage, batch, tiny,
                                 dataloader_num_workers=4 if on_gpu else 0,
                                 dataloader_persistent_workers=on_gpu)
    clock = window_clock(stage)
    trainer = Trainer(model=model, args=args, train_dataset=Images(), callbacks=[clock])
    trainer.train()
    window_steps = stage["steps"] - stage["skip_steps"]
    seconds = clock.end - clock.start
    result = {"images_per_sec": window_steps * batch["global_batch_size"] / seconds,
              "window": f"steps {stage['skip_steps'] + 1}-{stage['steps']}",
              "window_s": round(seconds, 2), "optim": getattr(args.optim, "value", str(args.optim)),
              "attention": model.config._attn_implementation,
              "parameters_millions": round(sum(p.numel() for p in model.parameters()) / 1e6, 1),
              "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30 if on_gpu else None}
    print("HF_TRAINER_RESULT " + json.dumps(result), flush=True)


def run_dataparallel(stage_name, stage, shape, batch, tiny, port, log):
    command = [sys.executable, "bench/bench.py", "--dataparallel-worker", stage_name,
               *(["--tiny"] if tiny else [])]
    env_extra = device_env(stage["gpus"], tiny)
    status, output, seconds = run_process(command, REPO, env_extra, stage["timeout_s"], log)
    record = {"command": shell_text(command, env_extra, REPO).replace(sys.executable, "python3"),
              "status": status, "seconds": round(seconds, 1)}
    result_lines = re.findall(r"^DATAPARALLEL_RESULT (.*)$", output, re.MULTILINE)
    if result_lines:
        record.update(json.loads(result_lines[-1]))
    return record


def dataparallel_worker(stage_name, tiny):
    """torch.nn.DataParallel over every visible GPU: the model train_ddp.py builds for the stage's
    shape (GPT-2, its sdpa_causal attention, no cache), bf16 autocast on a GPU, fused AdamW, the
    global batch as micro-batches of micro_batch_size sequences per GPU, random tokens.
    DataParallel splits each micro-batch across the GPUs, runs a copy of the module on each (copied
    from GPU 0 in every forward), gathers the losses on GPU 0 and sums the gradients there in
    backward. The clock: CUDA-synchronized at the ends of step skip_steps and the last."""
    import torch
    from transformers import AutoModelForCausalLM
    sys.path.insert(0, str(REPO))
    import train_ddp

    stage, shape, batch = stage_settings(stage_name, tiny)
    on_gpu = torch.cuda.is_available() and not tiny
    device = torch.device("cuda", 0) if on_gpu else torch.device("cpu")
    gpus = torch.cuda.device_count() if on_gpu else 1
    seq_len, micro = batch["seq_len"], batch["micro_batch_size"] * gpus
    accumulation = batch["global_batch_size"] // micro
    config = gpt2_config(shape, batch)
    torch.manual_seed(1337)
    attention = train_ddp.choose_attention("auto", device, train_ddp.ArrowTokens.sdpa)
    model = AutoModelForCausalLM.from_config(config, attn_implementation=attention).to(device)
    parallel = torch.nn.DataParallel(model) if on_gpu else model
    optimizer = torch.optim.AdamW(model.parameters(), lr=6e-4, betas=(0.9, 0.95), weight_decay=0.1,
                                  fused=on_gpu)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=on_gpu)
    torch.set_float32_matmul_precision("high")
    tokens = np.memmap(random_token_data(batch, tiny) / "train.bin", dtype=np.uint16, mode="r")
    blocks = len(tokens) // seq_len
    start = None
    for step in range(1, stage["steps"] + 1):
        for index in range(accumulation):
            first = ((step * accumulation + index) * micro) % (blocks - micro)
            ids = tokens[first * seq_len:(first + micro) * seq_len].astype(np.int64)
            ids = torch.from_numpy(ids).view(micro, seq_len).to(device, non_blocking=True)
            with autocast:  # one loss per GPU, gathered on GPU 0
                loss = parallel(input_ids=ids, labels=ids).loss.mean()
            (loss / accumulation).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if step in (stage["skip_steps"], stage["steps"]):
            if on_gpu:
                torch.cuda.synchronize()
            if step == stage["skip_steps"]:
                start = time.perf_counter()
            else:
                seconds = time.perf_counter() - start
    window_steps = stage["steps"] - stage["skip_steps"]
    peak = [torch.cuda.max_memory_allocated(i) / 2**30 for i in range(gpus)] if on_gpu else None
    result = {"tokens_per_sec": window_steps * tokens_per_step(batch) / seconds,
              "window": f"steps {stage['skip_steps'] + 1}-{stage['steps']}",
              "window_s": round(seconds, 2), "gpus": gpus, "attention": attention,
              "loss_last": loss.item(), "peak_mem_gib_per_gpu": peak}
    print("DATAPARALLEL_RESULT " + json.dumps(result), flush=True)


def run_vit_demo(stage_name, stage, shape, batch, tiny, port, log):
    """The quick start's ViT line in a copy of the tracked files: its wall time, and the last
    validation accuracy and the images/s of its metrics.jsonl."""
    copy = WORK_DIR / stage_name / "repo"
    remove_tree(copy)
    copy.mkdir(parents=True)
    tracked = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True,
                             text=True, check=True).stdout.split("\0")
    for name in filter(None, tracked):
        if (REPO / name).is_file():
            (copy / name).parent.mkdir(parents=True, exist_ok=True)
            (copy / name).write_bytes((REPO / name).read_bytes())
    command = ["bash", "launch.sh", "train_ddp.py", "model.type=vit"]
    if tiny:
        command += ["train.max_steps=20", "train.eval_every=10"]
    env_extra = {**device_env(1, tiny), "MASTER_PORT": str(port)}
    start, lines = time.perf_counter(), []  # each line with its time: where the wall time goes
    process = subprocess.Popen(command, cwd=copy, env={**os.environ, "PYTHONUNBUFFERED": "1",
                                                       **env_extra},
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               errors="replace", start_new_session=True)
    timer = threading.Timer(stage["timeout_s"], lambda: stop_groups([process]))
    timer.start()
    for line in process.stdout:
        lines.append(f"{time.perf_counter() - start:6.1f}s {line.rstrip()}")
        log(lines[-1])
    code, seconds = process.wait(), time.perf_counter() - start
    timer.cancel()
    status = "ok" if code == 0 else (f"timeout after {stage['timeout_s']}s"
                                     if seconds >= stage["timeout_s"] else f"failed (exit {code})")
    output = "\n".join(lines)
    metrics = copy / "out" / "metrics.jsonl"
    records = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()] \
        if metrics.is_file() else []
    val = [r for r in records if r.get("kind") == "val"]
    train = [r for r in records if r.get("kind") == "train"]
    preset = re.search(r"model vit \(image\), ([\d.]+)M parameters", output)
    phases = {name: float(found[-1]) for name, pattern in [  # the last line of each kind
        ("data_ready", r"^ *([\d.]+)s data +ok"), ("launching", r"^ *([\d.]+)s launching:"),
        ("first_validation", r"^ *([\d.]+)s step 0 \| val loss"),
        ("last_step", r"^ *([\d.]+)s step \d+/\d+ \|"), ("exported", r"^ *([\d.]+)s exported")]
        if (found := re.findall(pattern, output, re.MULTILINE))}
    record = {"command": shell_text(command, env_extra, copy), "phases_s": phases,
              "status": status, "seconds": round(seconds, 1), "wall_s": round(seconds, 1),
              "val_accuracy": val[-1].get("val_accuracy") if val else None,
              "steps": train[-1]["step"] if train else None,
              "images_per_sec": train[-1].get("images_per_sec") if train else None,
              "parameters_millions": float(preset.group(1)) if preset else None,
              "exported": (copy / "out" / "final" / "config.json").is_file()}
    if status != "ok":
        record["note"] = failure_note(output)
    remove_tree(copy)
    return record


IMAGES_LOOP_SUBSET = 4000
IMAGES_RESULT = re.compile(r"^RESULT (\{.*\})$", re.MULTILINE)


def run_preprocess_images(stage_name, stage, shape, batch, tiny, port, log):
    """bench_images.py: preprocess.py --images with a worker per core against the Pillow loop."""
    images = 200 if tiny else 20_000
    command = [sys.executable, "bench/bench_images.py", "--images", str(images), "--rounds", "1",
               "--loop-images", str(min(images, IMAGES_LOOP_SUBSET)), "--dir",
               str((WORK_DIR / "jpegs").relative_to(REPO)), "--json", "--skip-one-worker"]
    status, output, seconds = run_process(command, REPO, {}, stage["timeout_s"], log)
    found = IMAGES_RESULT.findall(output)
    result = json.loads(found[-1]) if found else {}
    record = {"command": shell_text(command, {}, REPO).replace(sys.executable, "python3"),
              "status": status, "seconds": round(seconds, 1), **result}
    if status != "ok" or not found:
        record["note"] = failure_note(output) or "no RESULT line"
    return record


SIDE_RUNNERS = {"dataparallel": run_dataparallel, "ours": run_ours, "ours_fsdp": run_ours,
                "ours_tiered": run_ours, "nanogpt": run_nanogpt,
                "nanogpt_micro32": lambda *args: run_nanogpt(*args, micro_batch_size=32),
                "nanogpt_micro64": lambda *args: run_nanogpt(*args, micro_batch_size=64),
                "hf_trainer": run_hf_trainer, "hf_trainer_compiled": run_hf_trainer,
                "hf_trainer_vit": run_hf_trainer, "timm": run_timm, "vit_demo": run_vit_demo,
                "preprocess_images": run_preprocess_images}


# ----------------------------------------------------------------------------- 6. figures

def tokens_per_step(batch):
    return batch["global_batch_size"] * batch["seq_len"]


def flops_per_token(shape, batch):
    """train_ddp.py's count (ArrowTokens.flops_counter) for a causal batch: 6 x the parameters
    multiplied with every token + 6 x layers x width x seq_len (attention's 12 x layers x width per
    query-key pair, a causal query seeing half the sequence on average). For this GPT-2 layout those
    parameters are all but the position embedding (the token embedding is the output layer too):
    per layer 12 d^2 + 13 d (four weight matrices, their biases, two LayerNorms), the final
    LayerNorm 2 d, the output layer vocab x d. nanoGPT's estimate_mfu counts the same parameters
    (get_num_params) but full attention (12 x layers x width x T)."""
    layers, width = shape["n_layer"], shape["n_embd"]
    matmul_params = (layers * (12 * width**2 + 13 * width) + 2 * width
                     + batch["vocab_size"] * width)
    return 6 * matmul_params + 6 * layers * width * batch["seq_len"]


def mfu_by_our_formula(record, shape, batch, gpus, peak_flops):
    if not (record.get("tokens_per_sec") and peak_flops):
        return None
    return flops_per_token(shape, batch) * record["tokens_per_sec"] / (peak_flops * gpus)


def ratio(value, baseline_value):
    return value / baseline_value if value and baseline_value else None


def sides_by_stage(stage_records):
    by_stage = {}
    for r in stage_records:
        by_stage.setdefault(r["stage"], {})[r["side"]] = r
    return by_stage


def losses(side, baseline):
    return (f"last logged loss {number(side.get('loss_last'), 4)} vs "
            f"{number(baseline.get('loss_last'), 4)}")


# stages that pair the trainer with nanoGPT, both with micro-batches of 32, the first found used
SAME_MICRO_STAGES = ["same_micro", "step_end", "host_levers", "graphs2", "inductor", "residual"]
# and every stage that ran the trainer at micro-batches of 32 on shape B: its MFU, nanoGPT or not
MFU_STAGES = [*SAME_MICRO_STAGES, "tuned", "optimizer", "optimizer_tuned"]


def figures(stage_records):
    """One results.jsonl row per figure; ratio is always value / baseline_value."""
    by_stage = sides_by_stage(stage_records)
    rows = []

    def row(metric, value, unit, baseline, baseline_value, command, baseline_command=None,
            source=None, note=None):
        source = source or {}
        rows.append({"date": source.get("date"), "machine": source.get("machine"),
                     "metric": metric, "value": value, "unit": unit, "baseline": baseline,
                     "baseline_value": baseline_value, "ratio": ratio(value, baseline_value),
                     "command": command, "baseline_command": baseline_command, "note": note,
                     "tiny": source.get("tiny", False)})

    def nanogpt_label(r):
        return f"nanoGPT train.py @{r.get('nanogpt_commit', 'unknown')[:7]}, same shape, same call"

    for name in SHAPE_STAGES:
        sides = by_stage.get(name, {})
        ours, theirs = sides.get("ours"), sides.get("nanogpt") or {}
        micro32 = sides.get("config:micro32")  # ours at config.yaml's 32; "ours" at nanoGPT's 16
        if micro32:
            row(f"{name}_micro32_tokens_per_sec", micro32.get("tokens_per_sec"),
                "tokens/s (ours: micro-batches of 32, config.yaml's default; nanoGPT: its 16)",
                nanogpt_label(micro32), theirs.get("tokens_per_sec"), micro32.get("command"),
                theirs.get("command"), micro32,
                note="ours with micro-batches of 16 in this call: "
                     f"{number((ours or {}).get('tokens_per_sec'), 0)} tokens/s")
            their32 = sides.get("nanogpt_micro32")
            if their32:
                row(f"{name}_micro32_vs_nanogpt_micro32_tokens_per_sec",
                    micro32.get("tokens_per_sec"), "tokens/s (both with micro-batches of 32)",
                    nanogpt_label(micro32) + ", micro-batches of 32", their32.get("tokens_per_sec"),
                    micro32.get("command"), their32.get("command"), micro32)
            if name == "shapeB_1gpu":
                row("shapeB_1gpu_micro32_mfu", micro32.get("mfu"),
                    "fraction of peak dense bf16 FLOP/s, micro-batches of 32",
                    nanogpt_label(micro32) + ", MFU by our formula",
                    theirs.get("mfu_by_our_formula"), micro32.get("command"),
                    theirs.get("command"), micro32)
        if not ours:
            continue
        row(f"{name}_tokens_per_sec", ours.get("tokens_per_sec"), "tokens/s", nanogpt_label(ours),
            theirs.get("tokens_per_sec"), ours.get("command"), theirs.get("command"), ours,
            note=" ".join(n for n in [ours.get("note"), theirs.get("note")] if n) or None)
        if name == "shapeB_1gpu":
            row("shapeB_1gpu_mfu", ours.get("mfu"),
                "fraction of peak dense bf16 FLOP/s (train_ddp.py's table)",
                nanogpt_label(ours) + ", MFU by our formula", theirs.get("mfu_by_our_formula"),
                ours.get("command"), theirs.get("command"), ours)
    for shape in ["A", "B"]:  # the trainer and nanoGPT both with micro-batches of 32
        sides = next((by_stage[f"{stage}_shape{shape}_1gpu"] for stage in SAME_MICRO_STAGES
                      if "nanogpt" in by_stage.get(f"{stage}_shape{shape}_1gpu", {})), {})
        ours, theirs = sides.get("ours"), sides.get("nanogpt") or {}
        if ours:
            row(f"shape{shape}_1gpu_vs_nanogpt_same_micro_tokens_per_sec",
                ours.get("tokens_per_sec"), "tokens/s (both with micro-batches of 32)",
                nanogpt_label(ours) + ", micro-batches of 32", theirs.get("tokens_per_sec"),
                ours.get("command"), theirs.get("command"), ours,
                note=f"max/min over the window ours {ours.get('tokens_per_sec_max_over_min')}")
        if shape == "B" and not ours:  # nanoGPT's MFU beside it only from the same call
            sides = next((by_stage[f"{stage}_shapeB_1gpu"] for stage in MFU_STAGES
                          if "ours" in by_stage.get(f"{stage}_shapeB_1gpu", {})), {})
            ours, theirs = sides.get("ours"), sides.get("nanogpt") or {}
        if ours and shape == "B":
            row("shapeB_1gpu_mfu", ours.get("mfu"),
                "fraction of peak dense bf16 FLOP/s (train_ddp.py's table), micro-batches of 32",
                nanogpt_label(ours) + ", MFU by our formula" if theirs else None,
                theirs.get("mfu_by_our_formula"), ours.get("command"), theirs.get("command"), ours)
    sides = by_stage.get("micro64_shapeA_1gpu", {})
    ours, theirs = sides.get("ours"), sides.get("nanogpt") or {}
    if ours:
        row("shapeA_1gpu_vs_nanogpt_micro64_tokens_per_sec", ours.get("tokens_per_sec"),
            "tokens/s (both with micro-batches of 64)",
            nanogpt_label(ours) + ", micro-batches of 64",
            theirs.get("tokens_per_sec"), ours.get("command"), theirs.get("command"), ours)
    for shape in ["A", "B"]:
        one, two = by_stage.get(f"shape{shape}_1gpu", {}), by_stage.get(f"shape{shape}_2gpu", {})
        if "config:micro32" in one and "config:micro32" in two:
            one32, two32 = one["config:micro32"], two["config:micro32"]
            row(f"shape{shape}_micro32_scaling_1to2",
                ratio(two32.get("tokens_per_sec"), one32.get("tokens_per_sec")),
                "x (2-GPU tokens/s / 1-GPU tokens/s), micro-batches of 32", None, None,
                f"{one32.get('command')} ; {two32.get('command')}", None, two32)
        if "ours" in one and "ours" in two:
            ours_scaling = ratio(two["ours"].get("tokens_per_sec"),
                                 one["ours"].get("tokens_per_sec"))
            their_scaling = ratio((two.get("nanogpt") or {}).get("tokens_per_sec"),
                                  (one.get("nanogpt") or {}).get("tokens_per_sec"))
            same_machine = one["ours"].get("machine") == two["ours"].get("machine")
            note = None if same_machine else "1 and 2 GPUs ran on different machines"
            row(f"shape{shape}_scaling_1to2", ours_scaling, "x (2-GPU tokens/s / 1-GPU tokens/s)",
                "nanoGPT's own 1 -> 2 GPU scaling", their_scaling,
                f"{one['ours'].get('command')} ; {two['ours'].get('command')}", None, two["ours"],
                note)
    fsdp_b = by_stage.get("fsdp_shapeB_2gpu", {})
    if "ours_fsdp" in fsdp_b:
        fsdp, ddp = fsdp_b["ours_fsdp"], fsdp_b.get("ours") or {}
        row("fsdp_shapeB_2gpu_tokens_per_sec", fsdp.get("tokens_per_sec"), "tokens/s",
            "train_ddp.py, same shape, same call", ddp.get("tokens_per_sec"), fsdp.get("command"),
            ddp.get("command"), fsdp)
    for shape in ["A", "B"]:
        stage = by_stage.get(f"fsdp_shape{shape}_1gpu", {})
        fsdp, ddp = stage.get("ours_fsdp"), stage.get("ours") or {}
        if fsdp:
            row(f"fsdp_vs_ddp_shape{shape}_1gpu_tokens_per_sec", fsdp.get("tokens_per_sec"),
                "tokens/s", "train_ddp.py, same shape and batch, same call",
                ddp.get("tokens_per_sec"), fsdp.get("command"), ddp.get("command"), fsdp,
                note=f"max/min over the window FSDP {fsdp.get('tokens_per_sec_max_over_min')}, "
                     f"DDP {ddp.get('tokens_per_sec_max_over_min')}; peak GiB FSDP "
                     f"{fsdp.get('peak_mem_gib')}, DDP {ddp.get('peak_mem_gib')}")
    for name, label, sides in [
            ("fp8_llama1p3b_1gpu", "llama1p3b", ("config:llama_fp8", "config:llama")),
            ("fp8_shapeB_1gpu", "shapeB", ("config:llama_fp8", "config:llama")),
            ("fp8_blocks_llama1p3b_1gpu", "llama1p3b_blocks",
             ("variant:compile_blocks#fp8", "variant:compile_blocks")),
            ("fp8_eager_llama1p3b_1gpu", "llama1p3b_eager",
             ("variant:fp8_eager#fp8", "variant:fp8_eager")),
            ("fp8_loss_llama1p3b_1gpu", "llama1p3b_global8",
             ("variant:compile_blocks#fp8", "variant:compile_blocks")),
            ("fp8_loss_shapeB_1gpu", "shapeB_global8",
             ("variant:compile_blocks#fp8", "variant:compile_blocks")),
            ("fp8_blocks_shapeB_1gpu", "shapeB_blocks",
             ("variant:compile_blocks#fp8", "variant:compile_blocks")),
            ("fp8_micro32_shapeB_1gpu", "shapeB_micro32",
             ("variant:compile_blocks#fp8", "variant:compile_blocks"))]:
        stage = by_stage.get(name, {})
        fp8, bf16 = stage.get(sides[0]), stage.get(sides[1]) or {}
        if fp8:
            row(f"fp8_vs_bf16_{label}_1gpu_tokens_per_sec", fp8.get("tokens_per_sec"), "tokens/s",
                "the same model in bf16, same call", bf16.get("tokens_per_sec"),
                fp8.get("command"), bf16.get("command"), fp8,
                note=f"peak GiB fp8 {fp8.get('peak_mem_gib')}, bf16 {bf16.get('peak_mem_gib')}; "
                     f"loss at the last step fp8 {fp8.get('loss_last')}, bf16 "
                     f"{bf16.get('loss_last')}; MFU (against the bf16 peak) fp8 {fp8.get('mfu')}, "
                     f"bf16 {bf16.get('mfu')}")
    compiled = by_stage.get("fp8_compile_llama1p3b_1gpu", {})
    whole, blocks = compiled.get("ours#fp8"), compiled.get("variant:compile_blocks#fp8") or {}
    if whole:
        row("fp8_whole_vs_blocks_llama1p3b_1gpu_tokens_per_sec", whole.get("tokens_per_sec"),
            "tokens/s", "fp8 with each block compiled on its own, same call",
            blocks.get("tokens_per_sec"), whole.get("command"), blocks.get("command"), whole,
            note=f"seconds in all (compile included) whole {whole.get('seconds')}, blocks "
                 f"{blocks.get('seconds')}; peak GiB whole {whole.get('peak_mem_gib')}, blocks "
                 f"{blocks.get('peak_mem_gib')}")
    launched = by_stage.get("launcher_shapeA_1gpu", {})
    bare, ours = launched.get("ours_python"), launched.get("ours") or {}
    if bare:
        row("ours_python_vs_launch_shapeA_1gpu_tokens_per_sec", bare.get("tokens_per_sec"),
            "tokens/s", "the trainer under launch.sh and torchrun, same call",
            ours.get("tokens_per_sec"), bare.get("command"), ours.get("command"), bare)
    for label in ["llama1p3b", "shapeB"]:
        losses = by_stage.get(f"fp8_loss_{label}_1gpu", {})
        fp8 = losses.get("variant:compile_blocks#fp8") or {}
        bf16 = losses.get("variant:compile_blocks") or {}
        if fp8.get("val_loss_last") and bf16.get("val_loss_last"):
            row(f"fp8_vs_bf16_{label}_loss_ratio", fp8["val_loss_last"], "validation loss after "
                "300 steps (data/stdlib, the whole validation split)",
                "the same model in bf16, same call", bf16["val_loss_last"], fp8.get("command"),
                bf16.get("command"), fp8, note=f"last logged training loss fp8 "
                f"{fp8.get('loss_last')}, bf16 {bf16.get('loss_last')}")
    big = by_stage.get("fsdp_12b_2gpu", {}).get("ours_fsdp")
    if big:
        row("fsdp_12b_2gpu_tokens_per_sec", big.get("tokens_per_sec"), "tokens/s", None, None,
            big.get("command"), None, big,
            note=f"{big.get('parameters_millions')}M parameters, peak "
                 f"{big.get('peak_mem_gib')} GiB per GPU, MFU {big.get('mfu')}")
    cost = by_stage.get("metrics_cost_shapeA_1gpu", {})
    on_sides = [r for side, r in cost.items() if side.startswith("config:metrics_on")]
    off_sides = [r for side, r in cost.items() if side.startswith("config:metrics_off")]
    on = [r.get("tokens_per_sec") for r in on_sides]
    off = [r.get("tokens_per_sec") for r in off_sides]
    if on and off:
        complete = None not in on + off
        row("metrics_on_vs_off_shapeA_1gpu_tokens_per_sec", sum(on) / len(on) if complete else None,
            "tokens/s, mean of the 'on' sides",
            "the same with TensorBoard, Prometheus and NVML off, same call",
            sum(off) / len(off) if complete else None, on_sides[0].get("command"),
            off_sides[0].get("command"), on_sides[0],
            note=f"on: {[round(x) for x in on]}, off: {[round(x) for x in off]}; outputs of the "
                 f"'on' runs: {on_sides[0].get('metrics_outputs')}, NVML GPU utilisation mean "
                 f"{on_sides[0].get('gpu_util_mean')}")
    tiered_stage = by_stage.get("tiered_embedding_1gpu", {})
    whole, tiered = tiered_stage.get("ours") or {}, tiered_stage.get("ours_tiered")
    if tiered:
        whole_gpu = (whole.get("embedding_mib") or {}).get("cuda")
        tiered_gpu = (tiered.get("embedding_mib") or {}).get("cuda")
        row("tiered_embedding_gpu_mib", tiered_gpu,
            "MiB on the GPU for the input embedding (weights, gradients, optimizer state), counted "
            "from its tensors by train_ddp.py", "the whole embedding on the GPU, same call",
            whole_gpu, tiered.get("command"), whole.get("command"), tiered,
            note=f"saved {100 * (1 - tiered_gpu / whole_gpu):.1f}%; memory_allocated at the last "
                 f"log line {tiered.get('alloc_mem_gib')} vs {whole.get('alloc_mem_gib')} GiB"
            if tiered_gpu is not None and whole_gpu else None)
        tiered_tps, whole_tps = tiered.get("tokens_per_sec"), whole.get("tokens_per_sec")
        # data_wait_fraction: the share of the step the GPU sat idle while the host built the next
        # step's batches and (tiered) staged its CPU rows: the tiered host work not hidden
        row("tiered_embedding_step_time_ratio", ratio(whole_tps, tiered_tps),
            "x (step time tiered / whole)", "the whole embedding on the GPU, same call",
            1.0 if whole_tps else None, tiered.get("command"), whole.get("command"), tiered,
            note=f"data_wait_fraction {number(tiered.get('data_wait_fraction'), 4)} tiered vs "
                 f"{number(whole.get('data_wait_fraction'), 4)} whole")
    for stage_name, sides in by_stage.items():  # the start-up prediction against the allocator
        memory = (sides.get("ours") or {}).get("memory") or {}
        if memory.get("allocated_bytes"):
            above = (memory["peak_bytes"] - memory["predicted_bytes"]) / 2**20
            row(f"{stage_name}_memory_predicted_vs_allocated", memory["predicted_bytes"] / 2**20,
                "MiB: weights + gradients + AdamW state, predicted at start-up from the "
                "parameters' counts and dtypes",
                "torch.cuda.memory_allocated after step 2's update",
                memory["allocated_bytes"] / 2**20, sides["ours"].get("command"), None,
                sides["ours"],
                f"max_memory_allocated {memory['peak_bytes'] / 2**20:,.0f} MiB: activations and "
                f"temporaries {above:,.0f} MiB above the prediction; reserved "
                f"{memory['reserved_bytes'] / 2**20:,.0f} MiB")
    llama_stage = by_stage.get("llama_shapeA_1gpu", {})
    if llama_stage.get("config:llama"):
        llama, gpt2 = llama_stage["config:llama"], llama_stage.get("ours") or {}
        row("llama_vs_gpt2_shapeA_1gpu_tokens_per_sec", llama.get("tokens_per_sec"), "tokens/s",
            "GPT-2 (the default model.type), same shape, same call", gpt2.get("tokens_per_sec"),
            llama.get("command"), gpt2.get("command"), llama,
            f"parameters {llama.get('parameters_millions')}M vs "
            f"{gpt2.get('parameters_millions')}M; "
            f"MFU {number(llama.get('mfu'), 3)} vs {number(gpt2.get('mfu'), 3)}; "
            + losses(llama, gpt2))
    parallel_stage = by_stage.get("dataparallel_shapeA_2gpu", {})
    if parallel_stage.get("dataparallel"):
        parallel, ddp = parallel_stage["dataparallel"], parallel_stage.get("config:eager") or {}
        row("dataparallel_vs_ddp_shapeA_2gpu_tokens_per_sec", parallel.get("tokens_per_sec"),
            "tokens/s", "DDP (train_ddp.py, train.compile=false), same model and batch, same call",
            ddp.get("tokens_per_sec"), parallel.get("command"), ddp.get("command"), parallel,
            f"peak memory per GPU: DataParallel {parallel.get('peak_mem_gib_per_gpu')} GiB, DDP "
            f"(rank 0) {ddp.get('peak_mem_gib')} GiB")
    ours_a = by_stage.get("shapeA_1gpu", {}).get("ours")
    if ours_a:
        wait = ours_a.get("data_wait_fraction")
        row("data_wait_fraction", wait, "fraction of step time", None, None, ours_a.get("command"),
            None, ours_a, None if wait is not None
            else f"train_ddp.py does not report '{DATA_WAIT_KEY}' in metrics.jsonl")
    for name, metric in [("hf_trainer", "hf_trainer_shapeA_tokens_per_sec"),
                         ("hf_trainer_compiled", "hf_trainer_shapeA_compiled_tokens_per_sec")]:
        hf = by_stage.get(name, {}).get(name)
        if hf:
            row(metric, hf.get("tokens_per_sec"), "tokens/s", "ours: train_ddp.py shape A, 1 GPU"
                + ("" if ours_a else " (not run with it: no baseline)"),
                (ours_a or {}).get("tokens_per_sec"), hf.get("command"),
                (ours_a or {}).get("command"), hf)
    reducer_figures(by_stage, row)
    bert_figures(by_stage, row)
    two_node_figures(by_stage.get("two_nodes_shapeA_2gpu", {}), row)
    over_veth, over_lo = (by_stage.get(name, {}).get(side) for name, side in [
        ("two_nodes_netns_shapeA_2gpu", "netns:ours"), ("two_nodes_shapeA_2gpu", "two_nodes:ours")])
    if over_veth:
        over_lo = over_lo or {}
        other_day = over_lo and over_veth.get("date") != over_lo.get("date")
        row("two_nodes_netns_shapeA_tokens_per_sec", over_veth.get("tokens_per_sec"), "tokens/s",
            "two nodes over loopback (two_nodes_shapeA_2gpu)", over_lo.get("tokens_per_sec"),
            over_veth.get("command"), over_lo.get("command"), over_veth,
            f"each node in its own network namespace, NCCL via {transports_text(over_veth)}"
            + ("; the baseline ran on another day" if other_day else ""))
    reference_figures(by_stage, row)
    vit_figures(by_stage.get("vit_1gpu", {}), row)
    demo = by_stage.get("vit_demo_1gpu", {}).get("vit_demo")
    if demo:
        for metric, key, unit in [("vit_demo_1gpu_val_accuracy", "val_accuracy",
                                   "fraction of the digits' validation images"),
                                  ("vit_demo_1gpu_wall_s", "wall_s",
                                   "s from the command to its exit, preparation and export in")]:
            row(metric, demo.get(key), unit, None, None, demo.get("command"), None, demo,
                demo.get("note"))
    images = by_stage.get("preprocess_images_1gpu", {}).get("preprocess_images")
    if images:
        row(f"preprocess_images_vs_pillow_loop_{images.get('cpus')}cores",
            images.get("pipeline_images_per_sec"), "images/s",
            f"a one-process Pillow loop of open, convert, resize and crop, on the first "
            f"{images.get('loop_images')} of the same files, same call",
            images.get("loop_images_per_sec"), images.get("command"), images.get("command"),
            images, images.get("note"))
    return rows


def timm_label(record):
    return (f"timm's benchmark.py @{(record.get('timm_commit') or 'unknown')[:7]} (timm "
            f"{record.get('timm')}), vit_base_patch16_224, same batch, same call")


def hf_vit_label(record):
    return ("HF Trainer, transformers' ViTForImageClassification of the same shape, same batch"
            + (", torch_compile=True" if record.get("compiled") else "") + ", same call")


def vit_figures(sides, row):
    """ViT-B/16 on one GPU: ours against timm's benchmark and the HF Trainer, images/s and peak
    memory, and ours' MFU."""
    if not sides:
        return
    ours, timm, hf = (sides.get(name) or {} for name in ["ours", "timm", "hf_trainer_vit"])
    source = ours or timm or hf
    timm_note = ("timm: one random input batch made on its device, reused at every step (no data "
                 "loading), no gradient clipping")
    for name, baseline, label, note in [("timm", timm, timm_label(source), timm_note),
                                        ("hf_trainer", hf, hf_vit_label(hf), None)]:
        row(f"vit_b16_1gpu_vs_{name}_images_per_sec", ours.get("images_per_sec"), "images/s",
            label, baseline.get("images_per_sec"), ours.get("command"), baseline.get("command"),
            source, "; ".join(n for n in [note, ours.get("note"), baseline.get("note")] if n)
            or None)
        row(f"vit_b16_1gpu_vs_{name}_peak_mem_gib", ours.get("peak_mem_gib"),
            "GiB (torch.cuda.max_memory_allocated)", label, baseline.get("peak_mem_gib"),
            ours.get("command"), baseline.get("command"), source,
            None if baseline.get("peak_mem_gib") is not None else f"{name} reported no peak")
    row("vit_b16_1gpu_mfu", ours.get("mfu"),
        "fraction of peak dense bf16 FLOP/s (train_ddp.py's count)", None, None,
        ours.get("command"), None, source)


def vit_table(by_stage):
    sides = by_stage.get("vit_1gpu", {})
    if not sides:
        return []
    ours_ips = (sides.get("ours") or {}).get("images_per_sec")
    first = next(iter(sides.values()))
    shape, batch = (TINY_VIT_SHAPE, TINY_VIT_BATCH) if first.get("tiny") else (VIT_SHAPE,
                                                                                VIT_BATCH)
    lines = ["", f"ViT of {shape['n_layer']} layers, width {shape['n_embd']}, patches of "
             f"{shape['patch_size']} at {shape['image_size']} x {shape['image_size']}, "
             f"{shape['classes']:,} classes, batches of {batch['global_batch_size']} images, "
             + ("fp32, eager, on a CPU" if first.get("tiny") else "bf16, compiled, 1 GPU")
             + ". images/s: the images of the steps after the warm-up window / their wall time "
             "(ours: its metrics.jsonl intervals; timm: "
             f"{timm_label(first)}, its own clock; HF Trainer: a CUDA-synchronized clock at two "
             "step ends). Ours and the HF Trainer read random uint8 images (bench.py "
             "random_image_data); timm makes one random batch on its device. Peak memory: "
             "torch.cuda.max_memory_allocated (timm: read after its run ends).", "",
             "| side | window | images/s | ours / side | MFU (reported) | peak mem GiB | status |",
             "|---|---|---|---|---|---|---|"]
    for name, r in sides.items():
        lines.append(f"| {name} | {r.get('window', '—')} | {number(r.get('images_per_sec'))} "
                     f"| {number(ratio(ours_ips, r.get('images_per_sec')), 3)} "
                     f"| {percent(r.get('mfu'))} | {number(r.get('peak_mem_gib'), 1)} "
                     f"| {r.get('status')}{'; ' + r['note'] if r.get('note') else ''} |")
    return lines


def reference_figures(by_stage, row):
    """On one GPU: ours against train_ddp.py of REFERENCE_COMMIT, and on that code each step's
    verdict read during the next step (as it is there) against read in the same step."""
    for stage_name, prefix in [("reference_shapeA_1gpu", "shapeA_1gpu"),
                               ("reference_shapeB_1gpu", "shapeB_1gpu"),
                               ("reference_bert_1gpu", "bert_1gpu")]:
        sides = by_stage.get(stage_name, {})
        ours, reference = sides.get("ours"), sides.get("variant:reference")
        same_step = sides.get("variant:reference_same_step")
        if ours:
            reference = reference or {}
            row(f"{prefix}_vs_{REFERENCE_COMMIT}_tokens_per_sec", ours.get("tokens_per_sec"),
                "tokens/s", f"train_ddp.py of commit {REFERENCE_COMMIT} (variant:reference), same "
                "shape, same call", reference.get("tokens_per_sec"), ours.get("command"),
                reference.get("command"), ours, losses(ours, reference))
        if reference and same_step:
            row(f"verdict_late_vs_same_step_{prefix}_tokens_per_sec",
                reference.get("tokens_per_sec"),
                f"tokens/s (train_ddp.py of commit {REFERENCE_COMMIT}: each step's verdict read "
                "during the next step)", "the same code reading it in the same step "
                "(variant:reference_same_step), same call", same_step.get("tokens_per_sec"),
                reference.get("command"), same_step.get("command"), reference,
                losses(reference, same_step))


def is_reference_row(row):
    return (f"_vs_{REFERENCE_COMMIT}_" in row["metric"]
            or row["metric"].startswith("verdict_late_vs_same_step_"))


def reducer_figures(by_stage, row):
    """The gradient reducers and bf16 compression on 2 GPUs, each shape's sides from its two stages.
    DDP's own all-reduce is not timed: its exposed communication is its step time minus that of
    variant:no_comm, which all-reduces nothing."""
    for shape in ["A", "B"]:
        sides = {**by_stage.get(f"compression_shape{shape}_2gpu", {}),
                 **by_stage.get(f"reducer_shape{shape}_2gpu", {})}
        prefix = f"shape{shape}_2gpu"
        for name, baseline_name, label in [
                ("ours_inline", "ours", "DDP (dist.reducer=torch)"),
                ("ours_bf16", "ours", "DDP, uncompressed"),
                ("ours_inline_bf16", "ours_inline", "inline reducer, uncompressed")]:
            side, baseline = sides.get(name), sides.get(baseline_name) or {}
            if side:
                row(f"{prefix}_{name}_tokens_per_sec", side.get("tokens_per_sec"), "tokens/s",
                    label + ", same shape", baseline.get("tokens_per_sec"), side.get("command"),
                    baseline.get("command"), side, losses(side, baseline))
        no_comm = sides.get("variant:no_comm")
        for name in ["ours", "ours_inline", "ours_bf16", "ours_inline_bf16"]:
            side = sides.get(name)
            if side and no_comm and side.get("tokens_per_sec") and no_comm.get("tokens_per_sec"):
                step_ms = 1000 * tokens_per_step(TINY_BATCH if side.get("tiny") else BATCH)
                exposed = step_ms / side["tokens_per_sec"] - step_ms / no_comm["tokens_per_sec"]
                row(f"{prefix}_{name}_comm_exposed_ms", exposed,
                    "ms per step: its step time minus variant:no_comm's", None, None,
                    side.get("command"), no_comm.get("command"), side,
                    "measured by the trainer (time in wait()): "
                    f"{number(side.get('comm_exposed_ms'), 2)}; all-reduce p50/p95 "
                    f"{number(side.get('allreduce_p50_ms'), 2)}/"
                    f"{number(side.get('allreduce_p95_ms'), 2)} ms")


# a figure reported elsewhere for BERT on 2 PCIe GPUs, not measured here: what the 1 -> 2 GPU
# speedups are set beside
PCIE_BERT_SPEEDUP = ("1.81x, reported for BERT on 2 PCIe GPUs (not measured here)", 1.81)


def bert_figures(by_stage, row):
    """The masked-LM figures: bert_1gpu's "ours" is the baseline of every comparison."""
    one_gpu, padding = by_stage.get("bert_1gpu", {}), by_stage.get("bert_padding_1gpu", {})
    ours = one_gpu.get("ours")
    one_64, two_64 = (one_gpu.get("config:micro64"),
                      by_stage.get("bert_2gpu", {}).get("config:micro64"))
    if one_64:  # fewer, larger micro-batches: 4 of 64 per step on 1 GPU, 2 per rank on 2
        row("bert_1gpu_micro64_tokens_per_sec", one_64.get("tokens_per_sec"),
            "tokens/s (micro-batches of 64)", "ours, micro-batches of 32, same call",
            (ours or {}).get("tokens_per_sec"), one_64.get("command"), (ours or {}).get("command"),
            one_64, note=f"MFU {number(one_64.get('mfu'), 3)}; tokens/s max/min "
                         f"{number(one_64.get('tokens_per_sec_max_over_min'), 3)}")
    if one_64 and two_64:
        row("bert_micro64_speedup_1to2",
            ratio(two_64.get("steps_per_sec"), one_64.get("steps_per_sec")),
            "x (2-GPU steps/s / 1-GPU steps/s, micro-batches of 64)", *PCIE_BERT_SPEEDUP,
            f"{one_64.get('command')} ; {two_64.get('command')}", None, two_64)
    if not ours:
        return
    label = "ours: bf16, every batch padded to seq_len (train.pad_to_multiple=0; bert_1gpu)"
    row("bert_1gpu_tokens_per_sec", ours.get("tokens_per_sec"),
        "tokens/s (input tokens; padding not counted)", None, None, ours.get("command"),
        source=ours, note=f"{number(ours.get('steps_per_sec'), 2)} steps/s, peak memory "
                          f"{number(ours.get('peak_mem_gib'), 1)} GiB, "
                          f"{ours.get('seconds')} s in all")
    row("bert_1gpu_mfu", ours.get("mfu"),
        "fraction of peak dense bf16 FLOP/s (padded positions counted)", None, None,
        ours.get("command"), source=ours)
    row("bert_steadiness_max_over_min", ours.get("tokens_per_sec_max_over_min"),
        "x (the window's fastest log interval / its slowest, tokens/s)", None, None,
        ours.get("command"), source=ours,
        note=f"MFU max/min {number(ours.get('mfu_max_over_min'), 3)}")
    for side, precision in [("ours_fp32", "fp32"), ("ours_fp16", "fp16")]:
        other = one_gpu.get(side)
        if other:
            row(f"bert_{precision}_vs_bf16_tokens_per_sec", other.get("tokens_per_sec"),
                "tokens/s", label, ours.get("tokens_per_sec"), other.get("command"),
                ours.get("command"), other)
            row(f"bert_{precision}_vs_bf16_peak_mem_gib", other.get("peak_mem_gib"),
                "GiB (torch.cuda.max_memory_allocated)", label, ours.get("peak_mem_gib"),
                other.get("command"), ours.get("command"), other)
    for side, metric in [
            ("ours_dynamic", "bert_dynamic_vs_padding_tokens_per_sec"),
            ("variant:bert_static_buckets", "bert_static_buckets_vs_padding_tokens_per_sec"),
            ("variant:bert_unmarked", "bert_unmarked_vs_padding_tokens_per_sec")]:
        other = padding.get(side)
        if other:
            elsewhere = ("" if other.get("machine") == ours.get("machine")
                         else "; ran on another machine")
            row(metric, other.get("tokens_per_sec"), "tokens/s", label, ours.get("tokens_per_sec"),
                other.get("command"), ours.get("command"), other,
                note=f"tokens/s max/min {number(other.get('tokens_per_sec_max_over_min'), 2)} vs "
                     f"{number(ours.get('tokens_per_sec_max_over_min'), 2)}; "
                     f"{other.get('seconds')} s in all, compiles included, vs "
                     f"{ours.get('seconds')} s" + elsewhere)
    two = by_stage.get("bert_2gpu", {}).get("ours")
    if two:
        row("bert_speedup_1to2", ratio(two.get("steps_per_sec"), ours.get("steps_per_sec")),
            "x (2-GPU steps/s / 1-GPU steps/s, the same global batch)", *PCIE_BERT_SPEEDUP,
            f"{ours.get('command')} ; {two.get('command')}", None, two,
            note=None if two.get("machine") == ours.get("machine")
            else "1 and 2 GPUs ran on different machines")


def two_node_figures(sides, row):
    """Shape A over sockets against NVLink, what bf16 gradients and larger buckets win back, and
    the all-reduce bandwidth of each link, each through row(). Gap figures use step times (tokens
    per step / tokens/s), which add up where tokens/s do not."""
    if not sides:
        return
    nvlink, sockets = sides.get("ours") or {}, sides.get("two_nodes:ours") or {}
    batch = TINY_BATCH if (sockets or nvlink).get("tiny") else BATCH

    def step_ms(side):
        if not side.get("tokens_per_sec"):
            return None
        return 1000 * tokens_per_step(batch) / side["tokens_per_sec"]

    stress_nvlink, stress_sockets = sides.get("stress") or {}, sides.get("two_nodes:stress") or {}
    gpus = STAGES["two_nodes_shapeA_2gpu"]["gpus"]

    def allreduce_ms(parameters_millions, bytes_per_value):
        """The step's gradients all-reduced at the stress table's largest-size bus bandwidth,
        nothing overlapped: a ring all-reduce moves 2(n-1)/n of the data through each GPU's link,
        and busbw = that / time."""
        busbw = stress_sockets.get("busbw_largest")
        if not (busbw and parameters_millions):
            return None
        moved = parameters_millions * 1e6 * bytes_per_value * 2 * (gpus - 1) / gpus
        return 1000 * moved / (busbw * 1e9)

    plain_ms, nvlink_ms = step_ms(sockets), step_ms(nvlink)
    if sockets:
        predicted = allreduce_ms(sockets.get("parameters_millions"), 4)
        row("two_nodes_shapeA_tokens_per_sec", sockets.get("tokens_per_sec"), "tokens/s",
            "one node, 2 GPUs over NVLink (ours), same call", nvlink.get("tokens_per_sec"),
            sockets.get("command"), nvlink.get("command"), sockets,
            f"step {number(plain_ms, 1)} ms vs {number(nvlink_ms, 1)} ms over NVLink; the fp32 "
            f"gradients ({number(sockets.get('parameters_millions'), 1)}M x 4 bytes) all-reduced "
            f"at the socket link's measured bus bandwidth take {number(predicted, 1)} ms if "
            f"nothing overlaps; NCCL via {transports_text(sockets)} vs {transports_text(nvlink)}")
    for name, metric, label in [  # label: the baseline, two_nodes:ours
            ("two_nodes:ours_bf16", "two_nodes_shapeA_bf16_tokens_per_sec",
             "two nodes, fp32 gradients"),
            ("two_nodes:ours_buckets", "two_nodes_shapeA_buckets_tokens_per_sec",
             "two nodes, 25 MiB buckets"),
            ("two_nodes:ours_bf16_buckets", "two_nodes_shapeA_bf16_buckets_tokens_per_sec",
             "two nodes, fp32 gradients in 25 MiB buckets")]:
        side = sides.get(name)
        if not side:
            continue
        side_ms = step_ms(side)
        recovered = ((plain_ms - side_ms) / (plain_ms - nvlink_ms)
                     if None not in (side_ms, plain_ms, nvlink_ms) and plain_ms > nvlink_ms
                     else None)
        row(metric, side.get("tokens_per_sec"), "tokens/s", label + ", same call",
            sockets.get("tokens_per_sec"), side.get("command"), sockets.get("command"), side,
            f"step {number(side_ms, 1)} ms vs {number(plain_ms, 1)} ms (NVLink "
            f"{number(nvlink_ms, 1)} ms): wins back {percent(recovered)} of the step time that "
            "sockets add; " + losses(side, sockets))
    if stress_sockets:
        size = stress_sockets.get("size_largest")
        same_size = next((r["busbw"] for r in stress_nvlink.get("allreduce") or []
                          if r["size"] == size), None)
        row("two_nodes_allreduce_busbw_gbps", stress_sockets.get("busbw_largest"),
            f"GB/s bus bandwidth of an fp32 all-reduce of {size} bytes (stress_test.py, "
            "nccl-tests' busbw)", "one node, 2 GPUs over NVLink, same size, same call", same_size,
            stress_sockets.get("command"), stress_nvlink.get("command"), stress_sockets,
            f"NCCL via {transports_text(stress_sockets)} vs {transports_text(stress_nvlink)}")


def transports_text(record):
    return " ".join(record.get("transports") or []) or "(no NCCL channel logged)"


def number(value, digits=0):
    if value is None:
        return "—"
    return f"{value:,.{digits}f}"


def percent(value):
    return "—" if value is None else f"{100 * value:.1f}%"


SUMMARY_OF_THEIR_OWN = ("vit_demo_1gpu", "preprocess_images_1gpu")  # no tokens, no steps


def demo_and_preprocess_table(stage_records):
    demos = [r for r in stage_records if r["stage"] == "vit_demo_1gpu"]
    images = [r for r in stage_records if r["stage"] == "preprocess_images_1gpu"]
    lines = []
    if demos:
        lines += ["", "The ViT demo as a newcomer runs it: `bash launch.sh train_ddp.py "
                  "model.type=vit` in a fresh copy of the tracked files (no data/, no out/), wall "
                  "time from the command to its exit, the digits' preparation and the export "
                  "included; phases: seconds since the command at the last line of each kind.", "",
                  "| run | wall s | val accuracy | steps | images/s | phases (s) | status |",
                  "|---|---|---|---|---|---|---|"]
        lines += [f"| {index} | {r.get('wall_s')} | {percent(r.get('val_accuracy'))} "
                  f"| {r.get('steps')} | {number(r.get('images_per_sec'))} | "
                  + ", ".join(f"{k} {v}" for k, v in (r.get("phases_s") or {}).items())
                  + f" | {r.get('status')} |" for index, r in enumerate(demos, 1)]
    if images:
        lines += ["", "preprocess.py --images with a worker per core against a one-process Pillow "
                  "loop (open, convert, resize, crop) in the same call, on JPEGs of 500 x 375 to "
                  "224 px (bench_images.py); the loop is timed on the first files, its rate the "
                  "figure.", "",
                  "| JPEGs | MB | cores | loop: images | loop images/s | pipeline s | "
                  "pipeline images/s | vs loop | status |", "|---|---|---|---|---|---|---|---|---|"]
        lines += [f"| {number(r.get('images'))} | {number(r.get('megabytes'))} | {r.get('cpus')} "
                  f"| {number(r.get('loop_images'))} | {number(r.get('loop_images_per_sec'))} "
                  f"| {r.get('pipeline_seconds')} | {number(r.get('pipeline_images_per_sec'))} "
                  f"| {number(r.get('vs_loop'), 2)}x | {r.get('status')} |"
                  for r in [{**r, "vs_loop": ratio(r.get("pipeline_images_per_sec"),
                                                   r.get("loop_images_per_sec"))} for r in images]]
    return lines


def summary_markdown(stage_records, rows):
    """The dated section for RESULTS.md: how it was measured, tables, figures, commands."""
    first = stage_records[0]
    machines = " / ".join(sorted({r["machine"] for r in stage_records}))
    stages = ", ".join(dict.fromkeys(r["stage"] for r in stage_records))
    invocations = "`; `".join(dict.fromkeys(r.get("invocation") or "python3 bench/bench.py"
                                            for r in stage_records))
    lines = [
        f"## {first['date']} — {machines}: {stages}"
        + (" (--tiny: CPU plumbing check, not a measurement)" if first.get("tiny") else ""),
        "",
        f"torch {first.get('torch')}, CUDA {first.get('cuda')}, NCCL {first.get('nccl')}, "
        f"transformers {first.get('transformers')}, Python {first.get('python')}. "
        f"`{invocations}` at commit {first.get('repo_commit')}; nanoGPT "
        f"karpathy/nanoGPT@{first.get('nanogpt_commit')} "
        f"(NCCL_NVLS_ENABLE={first.get('nccl_nvls_enable')}). "
        + ("" if all(STAGES.get(r["stage"], {}).get("images") or r["stage"] in SUMMARY_OF_THEIR_OWN
                     for r in stage_records) else  # no tokens in these
        "Every side: the same steps, tokens/s = the tokens of the steps after the warm-up window / "
        "their wall time (ours: its metrics.jsonl intervals; nanoGPT: its per-iteration "
        "`time ...ms`; HF Trainer: a CUDA-synchronized clock at two step ends). "
        "MFU = (6 x matmul parameters + 6 x layers x width x seq_len) x tokens/s / (peak x GPUs), "
        "train_ddp.py's count (causal attention: half the scores of full attention); nanoGPT's by "
        "the same formula from its tokens/s. ratio = ours / baseline. Data: ours reads data/stdlib "
        "(launch.sh prepares it), nanoGPT and the HF Trainer read uniform random tokens of the "
        "same vocabulary (out/bench/random_tokens); a causal step of fixed length does the same "
        "work on either."),
    ]
    by_stage = sides_by_stage(stage_records)
    lines += nanogpt_table(by_stage)
    lines += sides_table([r for r in stage_records if r["stage"] not in SHAPE_STAGES
                          and not r["stage"].startswith("hf_")
                          and not STAGES.get(r["stage"], {}).get("images")
                          and r["stage"] not in SUMMARY_OF_THEIR_OWN])
    lines += hf_trainer_table(by_stage)
    lines += vit_table(by_stage)
    lines += demo_and_preprocess_table(stage_records)
    lines += row_list("Gradient reducers and bf16 compression, 2 GPUs",
                      [row for row in rows
                       if row["metric"].startswith(("shapeA_2gpu_ours_", "shapeB_2gpu_ours_"))],
                      lambda row: 1)
    lines += row_list("Masked LM, BERT-base at seq_len 512",
                      [row for row in rows
                       if row["metric"].startswith("bert_") and not is_reference_row(row)],
                      lambda row: 3 if row["value"] and row["value"] < 10 else 0)
    lines += row_list(f"Against train_ddp.py of commit {REFERENCE_COMMIT}, and its verdict read a "
                      "step late vs in the same step, 1 GPU",
                      [row for row in rows if is_reference_row(row)], lambda row: 0)
    lines += row_list("Two nodes of one GPU each over NCCL's socket transport (bench.py "
                      "TWO_NODE_ENV)",
                      [row for row in rows if row["metric"].startswith("two_nodes_")],
                      lambda row: 2 if "busbw" in row["metric"] else 0)
    lines += allreduce_table(by_stage.get("two_nodes_shapeA_2gpu", {}))
    lines += ["", "Commands (from the repository root; each side's seconds include start-up, "
              "compile, the unavoidable evaluations, ours' final checkpoint and export):", ""]
    lines += [f"- {r['stage']} / {r['side']} ({r.get('seconds')} s): `{r['command']}`"
              for r in stage_records if r.get("command")]
    notes = summary_notes(stage_records, rows, by_stage)
    if notes:
        lines += ["", "Notes:", "", *notes]
    return "\n".join(lines) + "\n"


def sides_against_nanogpt(name, sides):
    """ours, and in a shape stage also ours' other sides (config:micro32, ours_buckets), each
    against nanoGPT"""
    if name in SHAPE_STAGES:
        return [side for side in sides if not side.startswith("nanogpt")]
    stage = STAGES.get(name, {})
    if "ours" not in sides or stage.get("zipf_data") or stage.get("mlm") or stage.get("images"):
        return []
    return ["ours"]


def nanogpt_table(by_stage):
    table = []
    for name, sides in by_stage.items():
        for side in sides_against_nanogpt(name, sides):
            ours, theirs = sides[side], sides.get("nanogpt", {})
            ours_tps, their_tps = ours.get("tokens_per_sec"), theirs.get("tokens_per_sec")
            table.append(
                f"| {name}{'' if side == 'ours' else ' / ' + side} | {ours.get('gpus')} "
                f"| {ours.get('window', '—')} | {number(ours_tps)} | {number(their_tps)} "
                f"| {number(ratio(ours_tps, their_tps), 2)} "
                f"| {percent(ours.get('mfu'))} / {percent(ours.get('mfu_by_our_formula'))} "
                f"| {percent(theirs.get('mfu_by_our_formula'))} "
                f"| {number(ours.get('peak_mem_gib'), 1)} "
                f"| {ours.get('status')} / {theirs.get('status', '—')} |")
    if not table:
        return []
    return ["", "| stage | GPUs | window | ours tokens/s | nanoGPT tokens/s | ratio "
            "| ours MFU (reported / formula) | nanoGPT MFU (formula) | ours peak mem GiB "
            "| status ours / nanoGPT |", "|---|---|---|---|---|---|---|---|---|---|", *table]


def sides_table(records):
    if not records:
        return []
    lines = ["", "| stage | side | GPUs | parameters | window | tokens/s | MFU (reported) "
             "| peak mem GiB | status |", "|---|---|---|---|---|---|---|---|---|"]
    for r in records:
        extra = (f", {r['syncs_between_logged_steps']} syncs in "
                 f"{r['steps_between_logged_steps']} steps"
                 if "syncs_between_logged_steps" in r else "")
        if r.get("comm_exposed_ms") is not None:
            extra += f", comm exposed {r['comm_exposed_ms']:.1f} ms/step"
        if r.get("allreduce_p50_ms") is not None:
            extra += (f", all-reduce p50/p95 {r['allreduce_p50_ms']:.1f}/"
                      f"{r['allreduce_p95_ms']:.1f} ms")
        if STAGES.get(r["stage"], {}).get("mlm") and r.get("steps_per_sec") is not None:
            extra += (f", {r['steps_per_sec']:.2f} steps/s, tokens/s max/min "
                      f"{number(r.get('tokens_per_sec_max_over_min'), 2)}")
        if r.get("busbw_largest") is not None:
            extra += (f", all-reduce busbw {r['busbw_largest']:.2f} GB/s at "
                      f"{r['size_largest']:,} B")
        if r.get("nodes", 1) > 1:
            extra += f", {r['nodes']} nodes"
        if r.get("transports"):
            extra += f", NCCL via {' '.join(r['transports'])}"
        if r.get("embedding_mib"):
            extra += ", input embedding " + " + ".join(
                f"{mib:,.0f} MiB on {kind}" for kind, mib in sorted(r["embedding_mib"].items()))
        lines.append(f"| {r['stage']} | {r['side']} | {r.get('gpus')} "
                     f"| {number(r.get('parameters_millions'), 1)}M | {r.get('window', '—')} "
                     f"| {number(r.get('tokens_per_sec'))} | {percent(r.get('mfu'))} "
                     f"| {number(r.get('peak_mem_gib'), 1)} | {r.get('status')}{extra} |")
    return lines


def hf_trainer_table(by_stage):
    hf_sides = [sides[name] for name, sides in by_stage.items()
                if name.startswith("hf_") and name in sides]
    if not hf_sides:
        return []
    ours_tps = by_stage.get("shapeA_1gpu", {}).get("ours", {}).get("tokens_per_sec")
    lines = ["", "| HF Trainer, shape A, 1 GPU | window | tokens/s | vs ours (shapeA_1gpu) "
             "| status |", "|---|---|---|---|---|"]
    for hf in hf_sides:
        lines.append(f"| {hf['side']} | {hf.get('window', '—')} "
                     f"| {number(hf.get('tokens_per_sec'))} "
                     f"| {number(ratio(hf.get('tokens_per_sec'), ours_tps), 2)} "
                     f"| {hf.get('status')} |")
    return lines


def row_list(title, rows, digits):
    """A titled list of figure rows; digits(row): the decimals of its value and baseline."""
    if not rows:
        return []
    lines = ["", f"{title} (ratio = value / baseline):", ""]
    for row in rows:
        line = f"- {row['metric']}: {number(row['value'], digits(row))} {row['unit']}"
        if row["baseline"]:
            line += (f"; {row['baseline']}: {number(row['baseline_value'], digits(row))}, ratio "
                     f"{number(row['ratio'], 3)}")
        lines.append(line + (f"; {row['note']}" if row["note"] else ""))
    return lines


def allreduce_table(sides):
    tables = {side: {r["size"]: r for r in sides.get(side, {}).get("allreduce") or []}
              for side in ["stress", "two_nodes:stress"]}
    if not any(tables.values()):
        return []
    lines = ["", "| all-reduce fp32, bytes | one node (NVLink): time us, busbw GB/s "
             "| two nodes (sockets): time us, busbw GB/s | #wrong |", "|---|---|---|---|"]
    for size in sorted(set(tables["stress"]) | set(tables["two_nodes:stress"])):
        one, two = tables["stress"].get(size, {}), tables["two_nodes:stress"].get(size, {})
        lines.append(f"| {size:,} | {number(one.get('time_us'), 1)}, {number(one.get('busbw'), 2)} "
                     f"| {number(two.get('time_us'), 1)}, {number(two.get('busbw'), 2)} "
                     f"| {one.get('wrong', '—')} / {two.get('wrong', '—')} |")
    return lines


def summary_notes(stage_records, rows, by_stage):
    notes = [f"- {r['stage']} / {r['side']}: {r['note']}" for r in stage_records if r.get("note")]
    notes += [f"- {row['metric']}: {row['note']}" for row in rows
              if row["metric"] == "data_wait_fraction" and row["note"]]
    notes += ["- what the metrics cost (TensorBoard, Prometheus, NVML on vs off, shape A, 1 GPU): "
              f"{number(row['value'])} vs {number(row['baseline_value'])} tokens/s = "
              f"{number(row['ratio'], 4)}x; {row['note']}" for row in rows
              if row["metric"] == "metrics_on_vs_off_shapeA_1gpu_tokens_per_sec"]
    notes += [f"- {name}: every side reads {r.get('data_dir')} (random tokens whose frequencies "
              "follow Zipf's law, bench.py zipf_token_data), not data/stdlib"
              for name, sides in by_stage.items() for r in list(sides.values())[:1]
              if r.get("data_dir") and STAGES.get(name, {}).get("zipf_data")]
    notes += [f"- {row['metric']}: {number(row['value'], 3)} (baseline "
              f"{number(row['baseline_value'], 3)})" + (f"; {row['note']}" if row["note"] else "")
              for row in rows if row["metric"].startswith("tiered_")]
    notes += [f"- {r['stage']} / ours: data/stdlib's vocabulary is {r['vocab']}, not "
              f"{BATCH['vocab_size']}" for r in stage_records
              if r["side"] == "ours" and not r.get("tiny")
              and r.get("vocab") not in (None, BATCH["vocab_size"])
              and not STAGES.get(r["stage"], {}).get("zipf_data")]
    return notes


def record_in_repo(summary, rows):
    """RESULTS.md lists newest first: the section goes before the first dated one."""
    results_md = REPO / "bench" / "RESULTS.md"
    text = results_md.read_text()
    cut = text.find("\n## ")
    text = text[:cut + 1] + summary + "\n" + text[cut + 1:] if cut >= 0 else text + "\n" + summary
    results_md.write_text(text)
    with open(REPO / "bench" / "results.jsonl", "a") as file:
        for row in rows:
            file.write(json.dumps(row) + "\n")
    print(f"appended to {results_md} and {REPO / 'bench' / 'results.jsonl'}")


def write_outputs(stage_records, record):
    rows = figures(stage_records)
    summary = summary_markdown(stage_records, rows)
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "summary.md").write_text(summary)
    with open(OUT / "results.jsonl", "w") as file:
        for row in rows:
            file.write(json.dumps(row) + "\n")
    print("\n" + summary)
    if record:
        record_in_repo(summary, rows)


# ----------------------------------------------------------------------------- 7. main

def remove_tree(path):
    subprocess.run(["rm", "-rf", str(path)], check=False)


def stage_settings(stage_name, tiny):
    stage = dict(STAGES[stage_name])
    if tiny:
        stage.update(TINY_STEPS)
    if stage.get("images"):
        return stage, dict(TINY_VIT_SHAPE if tiny else VIT_SHAPE), dict(
            TINY_VIT_BATCH if tiny else VIT_BATCH)
    shape = (TINY_SHAPES if tiny else SHAPES)[stage.get("shape", "A") if not tiny else "A"]
    batch = dict(TINY_BATCH if tiny else BATCH)
    if not tiny:
        batch.update(stage.get("batch", {}))
    elif "tiny" in stage:  # a stage's own smaller sizes for the CPU check
        batch["vocab_size"] = stage["tiny"].get("vocab_size", batch["vocab_size"])
        stage["side_extra"] = stage["tiny"].get("side_extra", stage.get("side_extra", {}))
    return stage, shape, batch


MACHINE_KEYS = ["machine", "torch", "cuda", "nccl", "transformers", "python", "nanogpt_commit",
                "timm", "timm_commit", "repo_commit", "nccl_nvls_enable", "invocation"]


def run_stage(stage_name, tiny, machine, timeout_s, port, log, keep):
    stage, shape, batch = stage_settings(stage_name, tiny)
    if timeout_s:
        stage["timeout_s"] = timeout_s
    base = {"stage": stage_name, "date": machine["date"], "tiny": tiny, "gpus": stage.get("gpus"),
            "shape": shape, "steps": stage.get("steps"), "skip_steps": stage.get("skip_steps"),
            **{key: machine.get(key) for key in MACHINE_KEYS}}
    if not tiny and machine["gpus"] < stage["gpus"]:
        log(f"=== {stage_name}: skipped, needs {stage['gpus']} GPUs, {machine['gpus']} visible")
        return [keep({**base, "side": side, "status": f"skipped: {machine['gpus']} GPUs visible"})
                for side in stage["sides"]]
    records = []
    budget_s = None if tiny else stage.get("budget_s")  # the sides together
    deadline = time.perf_counter() + budget_s if budget_s else None
    for index, side in enumerate(stage["sides"]):
        if ONLY_SIDES and side not in ONLY_SIDES:
            continue
        timeout = stage["timeout_s"]
        if deadline is not None:
            timeout = min(timeout, int(deadline - time.perf_counter()))
        if timeout <= 0:
            status = f"skipped: the stage's budget_s of {budget_s} s is spent"
            log(f"=== {stage_name} / {side}: {status}")
            records.append(keep({**base, "side": side, "status": status}))
            continue
        log(f"=== {stage_name} / {side}: " + (f"{stage['steps']} steps, window after step "
            f"{stage['skip_steps']}, " if "steps" in stage else "") + f"timeout {timeout}s")
        side_stage, side_port = {**stage, "timeout_s": timeout}, port + index
        try:
            base_side = side.split(":", 1)[1] if side.startswith(("two_nodes:", "netns:")) else side
            problem = make_two_hosts() if side.startswith("netns:") else None
            arguments = (stage_name, side_stage, shape, batch, tiny, side_port, log)
            if problem:
                record = {"status": f"skipped: cannot make network namespaces ({problem})"}
            elif base_side.startswith(("variant:", "config:", "ours")):
                record = run_ours(*arguments, side)
            elif base_side == "stress":
                record = run_stress(*arguments, side)
            else:
                record = SIDE_RUNNERS[side](*arguments)
        except Exception as error:  # one broken side must not cost the figures of the others
            record = {"status": f"error: {type(error).__name__}: {error}"}
        finally:
            if side.startswith("netns:"):
                remove_two_hosts()
        record = {**base, "side": side, **record}
        # the formula counts a causal step of fixed length: a masked LM or a ViT has the trainer's
        # MFU only
        record["mfu_by_our_formula"] = (
            None if stage.get("mlm") or stage.get("images")
            else mfu_by_our_formula(record, shape, batch, stage["gpus"], machine["peak_flops"]))
        unit = "images" if stage.get("images") else "tokens"
        log(f"=== {stage_name} / {side}: {record['status']}, {unit}/s "
            f"{number(record.get(f'{unit}_per_sec'))} ({record.get('window', 'no window')}), "
            f"{record.get('seconds')} s in all")
        records.append(keep(record))
    return records


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stages", default="all",
                        help=f"comma-separated, or all: {','.join(STAGES)}")
    parser.add_argument("--tiny", action="store_true", help="CPU plumbing check: tiny shapes, "
                        "fp32; only the HF Trainer's compiled side compiles")
    parser.add_argument("--timeout-s", type=int, default=0,
                        help="per-side timeout for every stage (default: STAGES)")
    parser.add_argument("--no-record", action="store_true",
                        help="write $OUT only, not bench/RESULTS.md")
    parser.add_argument("--record", nargs="+", metavar="DIR",
                        help="append DIR/stages.jsonl (earlier calls) to bench/")
    parser.add_argument("--sides", default="",
                        help="comma-separated: run only these sides of the stages")
    parser.add_argument("--hf-trainer-worker", metavar="STAGE", help=argparse.SUPPRESS)
    parser.add_argument("--dataparallel-worker", metavar="STAGE", help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.hf_trainer_worker:
        worker = (hf_trainer_vit_worker if STAGES[args.hf_trainer_worker].get("images")
                  else hf_trainer_worker)
        worker(args.hf_trainer_worker, args.tiny)
        return
    if args.dataparallel_worker:
        dataparallel_worker(args.dataparallel_worker, args.tiny)
        return
    if args.record:
        stage_records = [json.loads(line) for directory in args.record
                         for line in (Path(directory) / "stages.jsonl").read_text().splitlines()
                         if line.strip()]
        if any(r.get("tiny") for r in stage_records):
            sys.exit("error: --tiny results are plumbing checks, not measurements -> record only "
                     "GPU calls")
        rows = figures(stage_records)
        record_in_repo(summary_markdown(stage_records, rows), rows)
        return

    exit_on_sigterm()
    ONLY_SIDES.update(side.strip() for side in args.sides.split(",") if side.strip())
    stage_names = (list(STAGES) if args.stages == "all"
                   else [s.strip() for s in args.stages.split(",") if s.strip()])
    unknown = [s for s in stage_names if s not in STAGES]
    if unknown:
        sys.exit(f"error: unknown stage {', '.join(unknown)} -> choose from {','.join(STAGES)}")
    # NVLink multicast stays off, as the GPU machines here require, also if a shell lost the
    # variables
    for key, value in {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
                       "NVSHMEM_DISABLE_NVLS": "1"}.items():
        os.environ.setdefault(key, value)
    OUT.mkdir(parents=True, exist_ok=True)
    # this call's alone: --record reads a whole stages.jsonl
    for name in ["bench.log", "stages.jsonl"]:
        (OUT / name).unlink(missing_ok=True)
    log = Log(OUT / "bench.log")
    machine = probe_machine()
    machine["date"] = datetime.now(timezone.utc).strftime("%Y-%m-%d")
    machine["invocation"] = " ".join(["python3 bench/bench.py", *map(shlex.quote, sys.argv[1:])])
    log(f"{datetime.now(timezone.utc):%Y-%m-%d %H:%M UTC} {machine['invocation']}")
    log(json.dumps(machine))
    if args.tiny:
        machine["peak_flops"] = None  # no GPU: no MFU

    stage_records = []

    def keep(record):  # written side by side: a call killed at its time limit keeps the sides done
        stage_records.append(record)
        with open(OUT / "stages.jsonl", "a") as file:
            file.write(json.dumps(record) + "\n")
        return record

    for index, stage_name in enumerate(stage_names):
        started = time.perf_counter()
        port = 29600 + 200 * GPU_OFFSET + 10 * index
        try:
            run_stage(stage_name, args.tiny, machine, args.timeout_s, port, log, keep)
        except Exception as error:
            keep({"stage": stage_name, "side": "stage",
                  "status": f"error: {type(error).__name__}: {error}", "date": machine["date"],
                  "machine": machine["machine"], "tiny": args.tiny})
        log(f"=== {stage_name}: {time.perf_counter() - started:.0f} s")
    write_outputs(stage_records, record=not (args.tiny or args.no_record))


if __name__ == "__main__":
    main()
