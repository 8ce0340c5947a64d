"""Train a transformers model on one or many GPUs with fully sharded data parallelism (FSDP2, `fully_shard`).

    bash launch.sh train_fsdp.py                    # every GPU of this machine (2 CPU processes without GPUs)
    torchrun --nproc_per_node 8 train_fsdp.py train.max_steps=1000 optim.lr=3e-4

This is train_ddp.py with the parallelism swapped; `diff train_ddp.py train_fsdp.py` shows all that FSDP
changes. Each rank keeps 1/world_size of the parameters, gradients and optimizer state: a transformer block's
weights are all-gathered just before its forward (and again before its backward) and freed after, and its
gradients are reduce-scattered, so each rank ends a step with the gradient of its own shard only. The model
is built on the meta device and filled from rank 0, so it never has to fit on one GPU. Checkpoints are
sharded (torch.distributed.checkpoint): every rank writes its own part, and a checkpoint loads on any number
of ranks. Pick FSDP when the weights, gradients and AdamW state (16 bytes per parameter) do not fit on one GPU.

`main()` tells the whole story in seven numbered sections: 1. config (config.yaml + key=value overrides),
2. distributed init, 3. data (memory-mapped Arrow shards from preprocess.py, a sampler that depends only on
(seed, epoch)), 4. model (a transformers config or a local pretrained path), 5. optimizer, 6. checkpoint
(full state, atomic, auto-resume), 7. training loop (bf16 autocast, gradient accumulation with DDP's
sharded gradient reduce-scatter, periodic validation, logging, export). The helpers follow `main()`, grouped under the
same section numbers. Read section 7 first if you want the training step, `global_batch_plan` for the data split.
Lines marked `# MLM` serve only masked-LM models (BERT): delete them for a causal-only trainer.
Lines marked `# tiered` serve only train_ddp.py's model.embedding_gpu_rows, which this script refuses
(FSDP shards the embedding already).
"""

import difflib
import gc
import json
import math
import os
import pickle
import re
import secrets
import shutil
import signal
import sys
import time
import zlib
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pyarrow as pa
import pyarrow.compute  # noqa: F401  (pa.compute)
import torch
import torch.distributed as dist
import torch.nn.functional as F
import yaml
from tokenizers import Tokenizer
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import CheckpointException
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict, get_state_dict,
                                                     set_model_state_dict, set_state_dict)
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from transformers import (AttentionInterface, AttentionMaskInterface, AutoConfig, AutoModelForCausalLM,
                          AutoModelForMaskedLM, PreTrainedTokenizerFast)
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.models.auto.modeling_auto import MODEL_FOR_MASKED_LM_MAPPING_NAMES
from transformers.utils import logging as transformers_logging

IGNORE_INDEX = -100  # label value F.cross_entropy skips: padding and unmasked MLM positions


class UserError(Exception):
    """A foreseeable mistake (bad config, missing data, unreadable checkpoint): one clear line, no traceback."""


def die(message):
    raise UserError(message)


def unloadable(error):
    if isinstance(error, pickle.UnpicklingError):  # weights_only=True met a class or function: it is never run
        return "it holds pickled objects other than tensors and plain data; loading refuses them"
    return first_line(error)


def first_line(error):
    """An exception's first line, for a one-line message (some exceptions have an empty text)."""
    return (str(error).strip().splitlines() or [type(error).__name__])[0][:200]


def log0(*values):
    if int(os.environ.get("RANK", "0")) == 0:
        print(*values, flush=True)


def fault(kind, step):
    """Test-only fault injection, off unless FAULT=kind:rank:step is set: true where that rank should
    misbehave at that step (kill, kill-in-save, hang, nan, slow: 2 s more to build its batches), on a job's
    first attempt only (torchrun counts restarts in TORCHELASTIC_RESTART_COUNT), so a restarted job runs
    clean. Several faults: FAULT=slow:1:3,hang:0:5."""
    specs = os.environ.get("FAULT")
    if not specs or os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
        return False
    try:
        here = (kind, int(os.environ.get("RANK", "0")), step)
        return any((want_kind, int(want_rank), int(want_step)) == here
                   for want_kind, want_rank, want_step in (spec.split(":") for spec in specs.split(",")))
    except ValueError:
        die(f"FAULT={specs} is not kind:rank:step[,...] -> e.g. FAULT=kill:1:7 (kinds: kill, kill-in-save, hang, "
            "nan, slow)")


def main():
    # ------------------------------------------------------------------------- 1. config
    args = sys.argv[1:]
    check_only = "--check" in args  # launch.sh validates the config before it starts any process
    use_cuda = torch.cuda.is_available()
    cfg = load_config([arg for arg in args if arg != "--check"], use_cuda)
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    micro_batches_per_step = check_config(cfg, world_size)
    if cfg.model.embedding_gpu_rows:
        die("model.embedding_gpu_rows is train_ddp.py's: FSDP shards the embedding over the ranks already -> set "
            "model.embedding_gpu_rows=0, and fsdp.cpu_offload=true to keep the shards in CPU memory (CPUOffloadPolicy)")
    if cfg.dist.reducer != "torch" or cfg.dist.grad_compression != "none":
        die(f"dist.reducer={cfg.dist.reducer} and dist.grad_compression={cfg.dist.grad_compression} are train_ddp.py's: "
            "FSDP reduce-scatters its gradients itself, in fp32 (MixedPrecisionPolicy) -> leave them at torch and none, "
            "or use train_ddp.py")
    if check_only:
        for key in ["data.dir", "checkpoint.dir", "checkpoint.resume", "out_dir", "dist.timeout_s"]:
            print(f"{key}={config_dict(cfg)[key]}")
        return

    # ------------------------------------------------------------------------- 2. distributed init
    device = torch.device("cuda", local_rank) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)  # without it every rank would build its NCCL communicator on GPU 0
    backend = cfg.dist.backend if cfg.dist.backend != "auto" else ("nccl" if use_cuda else "gloo")
    timeout = timedelta(seconds=cfg.dist.timeout_s)
    if "RANK" in os.environ:
        # torchrun keeps its store (MASTER_PORT) across restarts, and ranks read each other's addresses from
        # it: a restarted rank can read one a dead rank left there and fail to connect (measured with gloo: 3
        # of 5 restarts). On one node every rank knows the attempt number, so each attempt gets its own keys.
        # On several nodes torchrun counts restarts per node, so there the keys stay as torch sets them.
        agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"  # torchrun's agent hosts it
        store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size,
                              is_master=rank == 0 and not agent_store, timeout=timeout)
        if int(os.environ.get("LOCAL_WORLD_SIZE", world_size)) == world_size:
            store = dist.PrefixStore(f"attempt_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout,
                                device_id=device if use_cuda else None)
    else:  # plain `python train_fsdp.py`: a one-process group, so the code below has one path
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)

    precision = choose_precision(cfg.train.precision, device)
    if precision == "fp16":
        die("train_fsdp.py does not train in fp16: fp16 needs loss scaling whose inf/NaN check agrees across "
            "ranks, and each rank here sees only its shard of the gradients (FSDP1 had ShardedGradScaler for this) "
            "-> use train.precision=bf16 (GPUs of compute capability 8.0+) or fp32, or train_ddp.py")
    autocast_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)
    autocast = torch.autocast(device.type, dtype=autocast_dtype, enabled=autocast_dtype is not None)
    # fp32 matmuls (all of an fp32 run, what autocast leaves in fp32) may use TF32 tensor cores: 10 mantissa
    # bits instead of 23 (bf16 has 7); NVIDIA's A100 datasheet gives 156 TF32 vs 19.5 fp32 TFLOP/s
    torch.set_float32_matmul_precision("high")
    log0(
        f"world size {world_size} ({backend}, {device.type}), precision {precision}, "
        f"global batch {cfg.train.global_batch_size} sequences = {world_size} ranks x "
        f"{micro_batches_per_step} micro-batches x {cfg.train.micro_batch_size} sequences"
    )

    # ------------------------------------------------------------------------- 3. data
    data_dir = Path(cfg.data.dir)
    meta = read_meta(data_dir)
    task = "mlm" if cfg.model.task == "mlm" or (cfg.model.task == "auto" and is_masked_lm_type(cfg)) else "causal"
    special = meta["special_tokens"]
    train_data = ArrowTokens(data_dir, meta, "train", task, cfg.train.seq_len, special)
    val_data = ArrowTokens(data_dir, meta, "val", task, cfg.train.seq_len, special)
    for split, split_data in [("train", train_data), ("val", val_data)]:
        if len(split_data) == 0:
            die(f"the {split} split of {data_dir} has no {task} samples of seq_len {cfg.train.seq_len} -> "
                "prepare more text with preprocess.py, lower train.seq_len or raise data.val_fraction")
    log0(f"data {data_dir}: {task} samples train {len(train_data):,} val {len(val_data):,} "
         f"({meta['splits']['train']['tokens']:,} train tokens)")

    # ------------------------------------------------------------------------- 4. model
    padded_vocab_size = math.ceil(meta["vocab_size"] / 64) * 64  # as nanoGPT does: matmul-friendly sizes
    torch.manual_seed(cfg.train.seed)  # the same initial weights on every rank
    tiered = None  # train_ddp.py's tiered embedding: refused in section 1, FSDP shards the table instead
    # Only rank 0 builds the whole model, in CPU memory: new weights from the seed, or the pretrained ones.
    # Every rank builds it again on the meta device (shapes, no memory), shards it and fills its shards from
    # rank 0's: the model never has to fit on one GPU, and its first weights are the same on any world size.
    source_model = on_rank0(lambda: build_model(cfg, task, padded_vocab_size, special, device)[0], share_result=False)
    with torch.device("meta"):
        raw_model, attention = build_model(cfg, task, padded_vocab_size, special, device, shapes_only=True)
    use_compile = cfg.train.compile == "true" or (cfg.train.compile == "auto" and use_cuda)
    shard_model(raw_model, source_model, cfg, autocast_dtype, use_compile, device)
    del source_model
    parameters_per_rank = [None] * world_size
    dist.all_gather_object(parameters_per_rank, sum(p.to_local().numel() for p in raw_model.parameters()))
    flops_of = model_flops_counter(raw_model, task, attention, cfg)  # FLOPs of the micro-batches of a step, for MFU
    log0(f"model {raw_model.config.model_type} ({task}), {sum(p.numel() for p in raw_model.parameters()) / 1e6:.1f}M "
         f"parameters, attention {attention}, vocab {meta['vocab_size']} padded to {padded_vocab_size}")
    log0(f"sharded over {world_size} ranks (reshard_after_forward={cfg.fsdp.reshard_after_forward}, activation "
         f"checkpointing {cfg.fsdp.activation_checkpointing}, CPU offload {cfg.fsdp.cpu_offload}): "
         f"parameters per rank {parameters_per_rank}")
    # dropout differs per rank on purpose (different data); seeded from (seed, rank) so a run is repeatable
    torch.manual_seed(int(np.random.SeedSequence([cfg.train.seed, rank]).generate_state(1)[0]))

    # ------------------------------------------------------------------------- 5. optimizer
    decay = [p for p in raw_model.parameters() if p.requires_grad and p.dim() >= 2]
    no_decay = [p for p in raw_model.parameters() if p.requires_grad and p.dim() < 2]  # biases, norm weights
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": cfg.optim.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=cfg.optim.lr, betas=(cfg.optim.beta1, cfg.optim.beta2), eps=cfg.optim.eps,
        # fused: the whole update in one multi-tensor kernel (the default, foreach, runs one per operation; CPUs
        # have one since torch 2.4), and only the fused step reads optimizer.found_inf, which skips a bad step
        # on the device, with no wait for the host (section 7)
        fused=True,
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, cfg))
    scaler = torch.amp.GradScaler(device.type, enabled=False)  # fp16 is refused above: kept so the loop reads as DDP's
    predicted = memory_prediction(raw_model, device)
    log0(f"memory per rank, predicted from the parameters' counts and dtypes: weights "
         f"{predicted['weights'] / 2**20:,.1f} MiB, gradients {predicted['gradients'] / 2**20:,.1f} MiB, AdamW state "
         f"{predicted['optimizer'] / 2**20:,.1f} MiB on {device.type}; activations are measured at step 2")

    # ------------------------------------------------------------------------- 6. checkpoint
    ckpt_dir = Path(cfg.checkpoint.dir)
    if world_size > 1 and cfg.checkpoint.every > 0:  # every rank must see the directory rank 0 writes
        token = on_rank0(write_marker, ckpt_dir)
        on_all_ranks(check_marker, ckpt_dir, token)
        on_rank0(remove_marker, ckpt_dir, token)
    # Rank 0 alone picks the checkpoint: ranks that list the directory themselves can see different files
    # (network filesystems cache directory listings) and would then train different weights, silently.
    resume_dir = on_rank0(find_resume_checkpoint, ckpt_dir, cfg.checkpoint.resume)
    step, samples_seen, tokens_seen = 0, 0, 0
    if resume_dir is not None:
        train_state = on_all_ranks(load_train_state, resume_dir, scheduler, scaler, cfg)
        load_weights(resume_dir, raw_model, optimizer)  # collective: DCP raises on every rank alike
        step, samples_seen, tokens_seen = train_state["step"], train_state["samples_seen"], train_state["tokens_seen"]
        if step >= cfg.train.max_steps:
            die(f"{resume_dir} is at step {step}, train.max_steps is {cfg.train.max_steps}: nothing left to train -> "
                "raise train.max_steps to go on, or start afresh in a new checkpoint.dir (or checkpoint.resume=never)")
        restore_rng(train_state["rng"], rank, cfg.train.seed, step)
        apply_settings(optimizer, scheduler, cfg, step)
        changed = changed_settings(train_state["config"], cfg)
        if changed:
            log0(f"note: changed since the checkpoint, this run's values apply: {', '.join(changed)}")
        if train_state.get("data_fingerprint") != meta.get("fingerprint"):
            log0(f"warning: {data_dir} was rebuilt since {resume_dir} was written; the data position may not match")
        log0(f"resumed from {resume_dir}: step {step}, {samples_seen:,} samples, {tokens_seen:,} tokens seen")

    # ------------------------------------------------------------------------- 7. training loop
    # where the time goes, read at each log line (SpanTimer): building the next batches, waiting at the step's
    # sync for the slowest rank
    data_wait, sync_wait = SpanTimer(device), SpanTimer(device)
    model = raw_model  # sharded in place by fully_shard, its blocks compiled there (section 4)
    # dcp.async_save writes in a background thread and needs a process group with a CPU backend
    async_group = dist.new_group(backend="gloo") if cfg.checkpoint.async_save else None
    checkpoint_in_flight = None  # an async checkpoint still being written: published before the next one
    # the loss in its own compiled graph: the fp32 upcast, log-softmax and gather fuse into few kernels
    loss_of = torch.compile(token_loss_sum) if use_compile else token_loss_sum
    out_dir = Path(cfg.out_dir)
    metrics_log = open_metrics_log(cfg, out_dir, step, rank, local_rank)
    metrics_log.write({"kind": "start", "step": step, "world_size": world_size, "time": time.time()})
    peak_flops = peak_flops_per_gpu(device, cfg.log.peak_tflops)
    read_gpu_util = gpu_util_reader(device, cfg.log.gpu_util)
    if step == 0:
        log0(f"step 0 | validation on {cfg.train.eval_batches} global batches (the first steps include compilation)")
        val_loss = evaluate(model, val_data, cfg, world_size, rank, device, autocast)
        log0(f"step 0 | val loss {val_loss:.4f}")
        metrics_log.write({"kind": "val", "step": 0, "val_loss": val_loss})

    stop_requested = catch_stop_signals()  # SIGTERM or SIGINT: finish the step, write a checkpoint, stop
    model.train()
    interval_loss_sum = torch.zeros((), device=device, dtype=torch.float64)  # this rank's, stays on the GPU
    interval_steps, interval_input_tokens, interval_flops = 0, 0, 0
    interval_start, paused_s = time.perf_counter(), 0.0
    verdicts = StepVerdicts(cfg.train.max_bad_steps)  # each step's verdict, read one step late; the interval's counts
    # AdamW creates its state in the first update, so the second step of a run is the first whose peak holds
    # everything: weights, gradients, optimizer state and the activations of backward
    memory_report_step = min(step + 2, cfg.train.max_steps)
    with data_wait:
        next_batches = rank_batches(train_data, samples_seen, cfg.train.seed, cfg, world_size, rank, device)
        if tiered:  # tiered: the first step's CPU rows, on their way to the GPU
            tiered.stage(next_batches[0], step_input_ids(train_data, samples_seen, cfg, world_size, rank, next_batches[0]))
    while step < cfg.train.max_steps:
        micro_batches, step_input_tokens, step_label_tokens, step_lengths = next_batches
        if tiered:  # tiered: the step's CPU rows on the GPU: as staged, or as the last step updated them there
            tiered.start_step()
        if fault("kill", step + 1):  # FAULT
            os.kill(os.getpid(), signal.SIGKILL)  # FAULT
        if fault("hang", step + 1):  # FAULT
            time.sleep(10**6)  # FAULT
        # The step's gradient must be that of the mean loss over every label token of the global batch, however
        # the batch is split into ranks and micro-batches. The common recipe (the mean of each micro-batch,
        # divided by the number of micro-batches) over-weights tokens of short micro-batches. So each micro-batch
        # contributes sum(loss) / (label tokens of the whole global batch), a count every rank makes on the host
        # from the shared batch plan: no communication, no wait for the GPU. The gradient reduction then
        # averages over ranks; the factor world_size undoes that mean.
        loss_scale = world_size / max(1, step_label_tokens)
        step_loss_sum = torch.zeros((), device=device, dtype=torch.float64)
        for index, batch in enumerate(micro_batches):
            is_last = index == len(micro_batches) - 1
            # accumulate unsharded gradients locally (memory: a full gradient per rank until the last micro-batch);
            # only the last backward reduce-scatters, overlapped with compute
            raw_model.set_requires_gradient_sync(is_last)
            with autocast:
                logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
            if task == "mlm" and 0 < cfg.train.pad_to_multiple < cfg.train.seq_len:  # MLM: dynamic padding:
                torch._dynamo.maybe_mark_dynamic(logits, 1)  # MLM: the loss's graph serves every length too
            loss_sum = loss_of(logits, batch["labels"])
            if fault("nan", step + 1):  # FAULT
                loss_sum = loss_sum * float("nan")  # FAULT
            scaler.scale(loss_sum * loss_scale).backward()
            # backward has freed what it saved; the name alone would keep these logits (shape A: 16 x 1024 x 8192
            # in bf16, 256 MiB) alive through the next micro-batch's forward or the update (measured on an H200:
            # allocated after the update 1,736 MiB with the name kept, against 1,406 MiB of weights and state)
            del logits
            step_loss_sum += loss_sum.detach()
            if index == 0:  # the host waits for the last step's work now, while the GPU has this micro-batch to run:
                verdicts.settle()  # that step's verdict
                if tiered:  # tiered: and the rows it updated, into the CPU tables (not at the step's end with stage())
                    tiered.write_to_tables()
        # the next step's batches, built on the host while the GPU still runs this step's backward; data_wait
        # counts what that costs the device: on a GPU only the time it sits idle waiting for them
        with data_wait:
            if fault("slow", step + 1):  # FAULT
                time.sleep(2)  # FAULT
            next_batches = rank_batches(train_data, samples_seen + cfg.train.global_batch_size, cfg.train.seed, cfg,
                                        world_size, rank, device)
            if tiered:  # tiered: and its CPU rows, gathered and on their way to the GPU
                tiered.stage(next_batches[0], step_input_ids(train_data, samples_seen + cfg.train.global_batch_size,
                                                             cfg, world_size, rank, next_batches[0]))
        scaler.unscale_(optimizer)  # clip the true gradient, not the fp16-scaled one
        # tiered: the gradient of the step's CPU rows, from every rank, counted into the one global norm
        cold_rows = tiered.reduce_gradients(world_size) if tiered else []
        # the norm over all shards (a DTensor); full_tensor() gives every rank the same plain tensor
        grad_norm = torch.nn.utils.clip_grad_norm_([*raw_model.parameters(), *cold_rows],
                                                   cfg.optim.grad_clip or float("inf")).full_tensor()
        # The step's verdict: is the gradient finite, and was any rank asked to stop? All-reduced, so that every
        # rank takes the same decision at the same step (a NaN on one rank reaches all through the gradient
        # reduction; a signal may reach one rank only). It is built, reduced and applied on the device: the host
        # does not wait for it here, where the GPU would then idle while the host queues the update and the next
        # step's forward, but reads it during the next step's first micro-batch or before anything that must
        # know it (StepVerdicts). torch.full passes the value to its fill kernel (FillKernel.cu in PyTorch's
        # aten/src/ATen/native/cuda): no copy from the host, which torch.tensor([...], device=...) would make.
        verdict = torch.full((2,), float(bool(stop_requested)), device=device)
        verdict[0] = grad_norm.isfinite().logical_not()
        with sync_wait:  # how long this rank waits here for the slowest one: step_time_skew
            dist.all_reduce(verdict, op=dist.ReduceOp.MAX)
        skip = verdict[0]  # 1.0: a non-finite gradient: no update on any rank; the data and the schedule move on
        # A fused AdamW skips the update of weights, moments and step counts where found_inf is 1 (GradScaler's
        # protocol: _fused_adam in torch/optim/adam.py). Not scaler.step(): with a fused optimizer it puts its
        # own found_inf in place of ours (step() in torch/amp/grad_scaler.py). The gradients are unscaled already
        # (unscale_ above), and ours holds the fp16 overflow: an inf or NaN in any gradient makes the norm non-finite.
        # fsdp.cpu_offload: the update runs on the host, which must wait for the verdict: the fused step would
        # copy it there with non_blocking=True (torch/optim/adam.py), and a tensor copied to the host that way
        # may be read before it has arrived (PyTorch's tutorial on non_blocking and pin_memory)
        optimizer.found_inf = skip.cpu() if cfg.fsdp.cpu_offload else skip
        optimizer.step()
        if tiered:  # tiered: lazy AdamW on the CPU rows of this step (on the GPU), at this step's learning rate
            tiered.step(optimizer.param_groups[0]["lr"], cfg.optim, skip)
        interval_loss_sum += step_loss_sum.masked_fill(skip > 0, 0.0)  # a skipped step's loss: not in the log's
        verdicts.defer(step + 1, verdict, step_label_tokens)
        if step + 1 == memory_report_step:  # before zero_grad: the gradients still exist
            memory = memory_measured(raw_model, optimizer, device, predicted)
            metrics_log.write({"kind": "memory", "step": step + 1, **memory})
            log0(memory_line(step + 1, memory))
            held = embedding_memory(raw_model, optimizer)
            log0(f"step {step + 1} | input embedding (weights, gradients, optimizer state): "
                 + ", ".join(f"{mib:,.1f} MiB on {kind}" for kind, mib in sorted(held.items())))
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        step_lr = optimizer.param_groups[0]["lr"]  # the rate this step used: scheduler.step() sets the next one's
        scheduler.step()
        step += 1
        samples_seen += cfg.train.global_batch_size
        tokens_seen += step_input_tokens
        interval_steps += 1
        interval_input_tokens += step_input_tokens
        interval_flops += flops_of(step_lengths)

        log_now = step % cfg.log.every == 0 or step == cfg.train.max_steps
        evaluate_now = step % cfg.train.eval_every == 0 or step == cfg.train.max_steps
        save_now = cfg.checkpoint.every > 0 and (step % cfg.checkpoint.every == 0 or step == cfg.train.max_steps)
        if log_now or evaluate_now or save_now or verdicts.stop:  # these must know this step's verdict
            verdicts.settle()
        stop_now = verdicts.stop  # a stop learned at this step's first micro-batch ends this step, as any other

        if log_now or stop_now:
            dist.all_reduce(interval_loss_sum)
            loss_sum_value = interval_loss_sum.item()  # waits for the GPU: the clock below then counts finished work
            loss = loss_sum_value / verdicts.label_tokens if verdicts.label_tokens else None  # None: all skipped
            now = time.perf_counter()  # the next interval starts here: it pays for this log line's work
            elapsed = now - interval_start - paused_s
            tokens_per_sec = interval_input_tokens / elapsed
            # Every rank's busy time (the interval less its waits for the others at the step's sync) and the
            # share of the interval its device sat idle while its host built batches, in one small all_gather
            # per interval: the slowest rank holds up all, so the skew and the largest data wait are logged.
            busy_s, data_wait_frac = elapsed - sync_wait.total_s(), data_wait.total_s() / elapsed
            per_rank = gather_floats([busy_s, data_wait_frac], device)
            rank_busy_s = [busy for busy, _ in per_rank]
            gib = 2**30
            record = {
                "kind": "train", "step": step, "loss": loss, "grad_norm": grad_norm.item(), "lr": step_lr,
                "tokens_per_sec": tokens_per_sec, "steps_per_sec": interval_steps / elapsed,
                "mfu": interval_flops / (elapsed * peak_flops * world_size) if peak_flops else None,
                "gpu_util": read_gpu_util() if read_gpu_util else None,
                "mem_alloc_gib": torch.cuda.memory_allocated() / gib if use_cuda else None,
                "mem_reserved_gib": torch.cuda.memory_reserved() / gib if use_cuda else None,
                "mem_peak_gib": torch.cuda.max_memory_allocated() / gib if use_cuda else None,
                # times since the start the caching allocator found no free block it could use, released its
                # cache (cudaFree) and called cudaMalloc again: fragmentation, and slow (c10/cuda/CUDACachingAllocator.cpp)
                "alloc_retries": torch.cuda.memory_stats().get("num_alloc_retries", 0) if use_cuda else None,
                # FSDP's all-gathers and reduce-scatters run inside fully_shard's hooks: not timed
                "comm_exposed_ms": None, "allreduce_p50_ms": None, "allreduce_p95_ms": None,
                "data_wait_frac": max(frac for _, frac in per_rank),
                "step_time_skew": max(rank_busy_s) / max(min(rank_busy_s), 1e-9) if world_size > 1 else None,
                "slowest_rank": rank_busy_s.index(max(rank_busy_s)) if world_size > 1 else None,
                "tokens_seen": tokens_seen, "skipped_steps": verdicts.skipped,
                "eta_s": elapsed / interval_steps * (cfg.train.max_steps - step),
            }
            metrics_log.write(record)
            log0(log_line(record, cfg.train.max_steps))
            interval_loss_sum.zero_()
            interval_steps, interval_input_tokens, verdicts.label_tokens, verdicts.skipped = 0, 0, 0, 0
            interval_flops, interval_start, paused_s = 0, now, 0.0

        evaluate_now = evaluate_now and not stop_now
        save_now = save_now or (cfg.checkpoint.every > 0 and stop_now)
        if evaluate_now or save_now:  # validation and checkpoints are not training throughput
            if use_cuda:
                torch.cuda.synchronize()  # the step's own GPU work counts as training time, not as the pause
            pause_start = time.perf_counter()
            if evaluate_now:
                val_loss = evaluate(model, val_data, cfg, world_size, rank, device, autocast)
                log0(f"step {step} | val loss {val_loss:.4f}")
                metrics_log.write({"kind": "val", "step": step, "val_loss": val_loss})
            if save_now:
                if not weights_are_finite(raw_model):  # the skipped steps above keep this from happening
                    die(f"the weights are not finite at step {step}: no checkpoint written -> lower optim.lr")
                rng_states = [None] * world_size
                dist.all_gather_object(rng_states, rng_state(use_cuda))
                train_state = {
                    "step": step, "samples_seen": samples_seen, "tokens_seen": tokens_seen, "rng": rng_states,
                    "scheduler": scheduler.state_dict(), "scaler": scaler.state_dict(), "config": config_dict(cfg),
                    "data_fingerprint": meta.get("fingerprint"), "world_size": world_size,
                }
                if checkpoint_in_flight:
                    finish_checkpoint(checkpoint_in_flight, ckpt_dir, cfg.checkpoint.keep)
                checkpoint_in_flight = start_checkpoint(ckpt_dir, step, raw_model, optimizer, train_state, async_group)
                if async_group is None:
                    finish_checkpoint(checkpoint_in_flight, ckpt_dir, cfg.checkpoint.keep)
                    checkpoint_in_flight = None
            paused_s += time.perf_counter() - pause_start
        if stop_now:
            saved = f"checkpoint {ckpt_dir / f'step_{step:06d}'} is written" if save_now else "no checkpoint (checkpoint.every=0)"
            die(f"stopped at step {step} by a stop signal (SIGTERM or SIGINT); {saved} -> run the same command "
                "again to resume from the newest checkpoint")

    if cfg.export and not weights_are_finite(raw_model):
        die("the trained weights are not finite: not exported -> lower optim.lr")
    if checkpoint_in_flight:
        finish_checkpoint(checkpoint_in_flight, ckpt_dir, cfg.checkpoint.keep)
    metrics_log.close()
    if cfg.export:  # every rank sends its shards; only rank 0 holds the whole model, in CPU memory
        full_model = gather_full_model(raw_model, cfg, task, padded_vocab_size, special, device)
    if rank == 0 and cfg.export:
        export_final(full_model, data_dir, meta, out_dir / "final", task, cfg, torch.device("cpu"))
    # Ranks leave together. Seen once here (gloo, 3 ranks, a loaded 2-core machine): a rank that left while
    # rank 0 was still exporting died at exit with "terminate called without an active exception" (SIGABRT),
    # failing a finished run. The others wait here at most dist.timeout_s for the export.
    dist.barrier()
    # the process group is destroyed after main() has returned: see the end of this file


# ----------------------------------------------------------------------------- 1. config (helpers)

CHOICES = {
    "model.task": ["auto", "causal", "mlm"],
    "model.attention": ["auto", "flash_attention_2", "sdpa", "eager"],
    "model.tie_word_embeddings": ["auto", "true", "false"],
    "train.precision": ["auto", "bf16", "fp16", "fp32"],
    "train.compile": ["auto", "true", "false"],
    "dist.backend": ["auto", "nccl", "gloo"],
    "dist.reducer": ["torch", "inline"],
    "dist.grad_compression": ["none", "bf16"],
}

# What each number may be. A value of the right type can still train wrongly and exit 0: grad_clip=-1 flips
# every gradient (clip_grad_norm_ multiplies by max_norm / norm), warmup_steps=-5 starts with a negative rate.
AT_LEAST_1 = (lambda v: v >= 1, "of at least 1")
RANGES = {
    "model.n_layer": AT_LEAST_1,
    "model.n_head": AT_LEAST_1,
    "model.n_embd": AT_LEAST_1,
    "model.dropout": (lambda v: 0 <= v < 1, "from 0 up to (not including) 1"),
    "model.intermediate_size": (lambda v: v >= 0, "of at least 0 (0 = 4 x model.n_embd)"),
    "model.embedding_gpu_rows": (lambda v: v >= 0, "of at least 0 (0 = the whole input embedding on the GPU)"),
    "train.seq_len": (lambda v: v >= 3, "of at least 3 (a masked LM sample is [CLS] token [SEP])"),
    "train.global_batch_size": AT_LEAST_1,
    "train.micro_batch_size": AT_LEAST_1,
    "train.max_steps": AT_LEAST_1,
    "train.eval_every": AT_LEAST_1,
    "train.eval_batches": AT_LEAST_1,
    "train.mlm_probability": (lambda v: 0 < v < 1, "between 0 and 1"),
    "train.pad_to_multiple": (lambda v: v >= 0, "of at least 0 (0 = pad every masked-LM batch to train.seq_len)"),
    "train.max_bad_steps": AT_LEAST_1,
    "optim.lr": (lambda v: v > 0, "above 0"),
    "optim.min_lr": (lambda v: v >= 0, "of at least 0"),
    "optim.warmup_steps": (lambda v: v >= 0, "of at least 0"),
    "optim.weight_decay": (lambda v: v >= 0, "of at least 0"),
    "optim.beta1": (lambda v: 0 <= v < 1, "from 0 up to (not including) 1"),
    "optim.beta2": (lambda v: 0 <= v < 1, "from 0 up to (not including) 1"),
    "optim.eps": (lambda v: v > 0, "above 0"),
    "optim.grad_clip": (lambda v: v >= 0, "of at least 0 (0 = no clipping)"),
    "checkpoint.every": (lambda v: v >= 0, "of at least 0 (0 = no checkpoints)"),
    "checkpoint.keep": AT_LEAST_1,
    "log.every": AT_LEAST_1,
    "log.sample_tokens": (lambda v: v >= 0, "of at least 0"),
    "log.peak_tflops": (lambda v: v >= 0, "of at least 0 (0 = look the GPU up)"),
    "log.prometheus_port": (lambda v: 0 <= v <= 65535, "from 0 (off) to 65535"),
    "dist.timeout_s": (lambda v: v > 0, "above 0"),
    "dist.bucket_mb": (lambda v: v > 0, "above 0"),
}


def flatten(tree, prefix=""):
    flat = {}
    for key, value in tree.items():
        if isinstance(value, dict) and key != "cpu_preset":
            flat.update(flatten(value, f"{prefix}{key}."))
        else:
            flat[prefix + key] = value
    return flat


class ConfigLoader(yaml.SafeLoader):
    """YAML that reads 3e-4 as a float: PyYAML follows YAML 1.1, where a float needs a dot, so a
    learning rate written 3e-4 would silently become the string '3e-4'."""


ConfigLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$|^[-+]?(?:[0-9][0-9_]*)?\.[0-9_]+(?:[eE][-+]?[0-9]+)?$"),
    list("-+0123456789."),
)


def parse_value(key, text, default):
    """Give an override the type of its default: a typo such as lr=3e-4x fails here, not at step 1000."""
    if isinstance(default, str):
        value = text
    else:
        try:
            value = yaml.load(text, Loader=ConfigLoader)
        except yaml.YAMLError:
            value = text
        if isinstance(default, float) and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if type(value) is not type(default):
            die(f"{key}={text} is not a {type(default).__name__} -> give a value like {key}={default}")
    if key in CHOICES and value not in CHOICES[key]:
        die(f"{key}={text} is not one of {'|'.join(CHOICES[key])} -> pick one of those")
    return value


def load_config(args, use_cuda):
    """config.yaml, then the CPU preset when there is no GPU, then the command line's key=value."""
    config_path = Path(__file__).with_name("config.yaml")
    if args and args[0].endswith((".yaml", ".yml")):
        config_path, args = Path(args[0]), args[1:]
    if not config_path.is_file():
        die(f"config file {config_path} not found -> pass the path of a config.yaml as first argument")
    try:
        tree = yaml.load(config_path.read_text(), Loader=ConfigLoader)
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}" if mark else "somewhere"
        die(f"{config_path} is not valid YAML at {where} ({getattr(error, 'problem', None) or error}) -> fix that line")
    if not isinstance(tree, dict):
        die(f"{config_path} does not hold `key: value` sections -> start again from the config.yaml of this repository")
    flat = flatten(tree)
    cpu_preset = flat.pop("cpu_preset", None) or {}
    overrides = {}
    if not use_cuda:
        overrides.update({key: str(value) for key, value in cpu_preset.items()})
    for arg in args:
        key, sep, text = arg.partition("=")
        if not sep:
            die(f"argument '{arg}' is not key=value -> write it like train.max_steps=100")
        overrides[key] = text
    for key, text in overrides.items():
        if key not in flat:
            nearest = difflib.get_close_matches(key, flat, n=1, cutoff=0.0)
            die(f"unknown config key '{key}' -> did you mean '{nearest[0]}'?")
        flat[key] = parse_value(key, text, flat[key])
    tree = {}
    for key, value in flat.items():
        *sections, name = key.split(".")
        node = tree
        for section in sections:
            node = node.setdefault(section, {})
        node[name] = value
    return SimpleNamespace(**{k: SimpleNamespace(**v) if isinstance(v, dict) else v for k, v in tree.items()})


def config_dict(cfg):
    """The config as flat `section.key: value` pairs: what a checkpoint stores and --check prints."""
    return flatten({key: vars(value) if isinstance(value, SimpleNamespace) else value for key, value in vars(cfg).items()})


def check_config(cfg, world_size):
    """Every number in its range and a global batch that splits evenly; returns micro-batches per step."""
    values = config_dict(cfg)
    for key, (is_valid, allowed) in RANGES.items():
        value = values.get(key)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            die(f"{key}={value} in the config file is not a number -> give it a value {allowed}")
        if not is_valid(value):
            die(f"{key}={value} is out of range -> give it a value {allowed}")
    if cfg.optim.min_lr > cfg.optim.lr:
        die(f"optim.min_lr={cfg.optim.min_lr} is above optim.lr={cfg.optim.lr} -> the decay ends at min_lr: lower it")
    sequences_per_round = cfg.train.micro_batch_size * world_size
    if cfg.train.global_batch_size % sequences_per_round:
        nearest = max(1, round(cfg.train.global_batch_size / sequences_per_round)) * sequences_per_round
        per_rank = cfg.train.global_batch_size // world_size if cfg.train.global_batch_size % world_size == 0 else 0
        smaller = max((m for m in range(1, cfg.train.micro_batch_size) if per_rank % m == 0), default=0) if per_rank else 0
        keep_batch = f"train.micro_batch_size={smaller} (the same global batch) or " if smaller else ""
        die(f"train.global_batch_size={cfg.train.global_batch_size} is not a multiple of train.micro_batch_size "
            f"x world size = {cfg.train.micro_batch_size} x {world_size} -> use e.g. {keep_batch}"
            f"train.global_batch_size={nearest}")
    return cfg.train.global_batch_size // sequences_per_round


# ----------------------------------------------------------------------------- 2. distributed init (helpers)

def choose_precision(requested, device):
    if requested == "fp16" and device.type != "cuda":
        die("train.precision=fp16 needs a CUDA GPU (GradScaler) -> use train.precision=fp32 or bf16 on CPU")
    if requested != "auto":
        return requested
    if device.type != "cuda":
        return "fp32"
    # Not torch.cuda.is_bf16_supported(): it also says True on V100 and T4 (bf16 emulated, no bf16 tensor
    # cores), so fp16 with its GradScaler would never run where it is needed. bf16 tensor cores start with
    # compute capability 8.0 (Ampere).
    return "bf16" if torch.cuda.get_device_capability(device) >= (8, 0) else "fp16"


def on_rank0(function, *args, share_result=True):
    """Run `function` on rank 0 alone and hand its result to every rank (share_result=False: only rank 0
    gets it, the others None); if it fails, every rank stops with its message (a failure on rank 0 alone
    would leave the others waiting in their next collective until the timeout)."""
    result, outcome = None, [None, None]
    if dist.get_rank() == 0:
        try:
            result = function(*args)
        except UserError as error:
            outcome[1] = str(error)
        outcome[0] = result if share_result else None
    dist.broadcast_object_list(outcome, src=0)
    if outcome[1]:
        die(outcome[1])
    return result if dist.get_rank() == 0 else outcome[0]


def on_all_ranks(function, *args):
    """Run `function` on every rank; if it fails on any rank, every rank stops, and rank 0 prints that rank's
    message (a file only one node cannot read would otherwise be reported by nobody)."""
    result, error = None, None
    try:
        result = function(*args)
    except UserError as failure:
        error = str(failure)
    errors = [None] * dist.get_world_size()
    dist.all_gather_object(errors, error)
    failed = [(failed_rank, message) for failed_rank, message in enumerate(errors) if message]
    if failed:
        failed_rank, message = failed[0]
        die(message if dist.get_world_size() == 1 else f"rank {failed_rank}: {message}")
    return result


# ----------------------------------------------------------------------------- 3. data (helpers)

def read_meta(data_dir):
    meta_path = data_dir / "meta.json"
    if not meta_path.is_file():
        die(f"no prepared data in {data_dir} (meta.json missing) -> run: python preprocess.py --out {data_dir}")
    try:
        meta = json.loads(meta_path.read_text())
    except (OSError, json.JSONDecodeError) as error:
        die(f"{meta_path} is unreadable ({error}) -> rebuild it: python preprocess.py --out {data_dir} --force")
    if not isinstance(meta, dict) or meta.get("format_version") != 1:
        version = meta.get("format_version") if isinstance(meta, dict) else None
        die(f"{meta_path} has format version {version}, this trainer reads 1 -> rebuild with --force")
    splits, special = meta.get("splits"), meta.get("special_tokens")
    if (not isinstance(splits, dict) or not all(isinstance(splits.get(name), dict) and isinstance(splits[name].get("files"), list)
                                                for name in ("train", "val"))
            or not isinstance(meta.get("vocab_size"), int) or not isinstance(special, dict)
            or not all(isinstance(special.get(role), int) for role in ("eot", "pad", "mask", "cls", "sep"))):
        die(f"{meta_path} lacks splits.train/val.files, vocab_size or special_tokens (eot, pad, mask, cls, sep) -> "
            f"rebuild it: python preprocess.py --out {data_dir} --force")
    return meta


class ArrowTokens:
    """Samples of one split, read straight from memory-mapped Arrow files: the tokens are never copied into
    memory as a whole (the epoch permutation, though, holds 8 bytes per sample on every rank).

    Causal LM: every row already ends with end-of-text, so the column's flat values are the
    concatenated token stream; sample i is the block stream[i*L : i*L + L + 1] (inputs and shifted labels).
    Masked LM: sample i is document i, truncated to L - 2 and framed as [CLS] doc [SEP].
    """

    def __init__(self, data_dir, meta, split, task, seq_len, special):
        self.task, self.seq_len, self.special, self.vocab_size = task, seq_len, special, meta["vocab_size"]
        self.pieces, self.piece_starts, self.doc_offsets = [], [], []
        stream_length = 0
        for name in meta["splits"][split]["files"]:
            try:
                table = pa.ipc.open_file(pa.memory_map(str(data_dir / name))).read_all()
            except (OSError, pa.ArrowInvalid) as error:
                die(f"cannot read {data_dir / name} ({error}) -> rebuild: python preprocess.py --out {data_dir} --force")
            if "input_ids" not in table.column_names:
                die(f"{data_dir / name} has no input_ids column -> rebuild: python preprocess.py --out {data_dir} --force")
            for chunk in table.column("input_ids").chunks:
                if len(chunk) == 0:
                    continue
                largest = pa.compute.max(chunk.values).as_py()  # one pass over the tokens, in Arrow's C++
                if largest is not None and largest >= self.vocab_size:
                    die(f"{data_dir / name} holds token id {largest}, but the vocabulary has {self.vocab_size} "
                        f"tokens -> rebuild the data with its tokenizer: python preprocess.py --out {data_dir} --force")
                self.pieces.append(chunk.values.to_numpy(zero_copy_only=True))
                self.doc_offsets.append(chunk.offsets.to_numpy())
                self.piece_starts.append(stream_length)
                stream_length += len(self.pieces[-1])
        self.doc_starts = np.cumsum([0] + [len(offsets) - 1 for offsets in self.doc_offsets])
        self.num_samples = (max(0, stream_length - 1) // seq_len) if task == "causal" else int(self.doc_starts[-1])

    def __len__(self):
        return self.num_samples

    def span(self, start, length):
        """length tokens of the stream from start, crossing shard boundaries if needed."""
        out = np.empty(length, dtype=np.int64)
        filled = 0
        piece = int(np.searchsorted(self.piece_starts, start, side="right")) - 1
        while filled < length:
            offset = start + filled - self.piece_starts[piece]
            taken = self.pieces[piece][offset:offset + length - filled]
            out[filled:filled + len(taken)] = taken
            filled += len(taken)
            piece += 1
        return out

    def document(self, index):  # MLM
        piece = int(np.searchsorted(self.doc_starts, index, side="right")) - 1
        row = index - self.doc_starts[piece]
        begin, end = self.doc_offsets[piece][row], self.doc_offsets[piece][row + 1] - 1  # drop end-of-text
        return self.pieces[piece][begin:min(end, begin + self.seq_len - 2)]

    def length(self, index):
        """Input tokens of sample `index`, without reading its tokens."""
        if self.task == "causal":
            return self.seq_len
        piece = int(np.searchsorted(self.doc_starts, index, side="right")) - 1  # MLM
        row = index - self.doc_starts[piece]  # MLM
        return min(int(self.doc_offsets[piece][row + 1] - self.doc_offsets[piece][row]) - 1, self.seq_len - 2) + 2  # MLM

    def sample(self, index):
        if self.task == "causal":
            return self.span(index * self.seq_len, self.seq_len + 1)
        doc = self.document(index).astype(np.int64)  # MLM
        return np.concatenate([[self.special["cls"]], doc, [self.special["sep"]]])  # MLM


_permutation_cache = {}


def epoch_permutation(seed, epoch, num_samples):
    """The sample order of one epoch: a function of (seed, epoch) only, never of rank or world size."""
    key = (seed, epoch, num_samples)
    if key not in _permutation_cache:
        _permutation_cache.clear()  # keep one epoch; a batch spanning two epochs recomputes the previous
        _permutation_cache[key] = np.random.default_rng([seed, epoch]).permutation(num_samples)
    return _permutation_cache[key]


def global_batch_plan(position, global_batch_size, num_samples, seed, micro_batch_size, world_size, length_of=None):
    """Split the global batch that starts at `position` (samples consumed so far, over all epochs)
    into micro-batches: returns plan[rank] = [(sample_ids, epochs), ...] in accumulation order.

    The position counts global samples, so a run resumed on a different number of ranks continues
    with exactly the samples the old run would have seen. seed=None reads samples in order
    (validation). With length_of (masked LM), the batch is sorted by length before it is cut into
    micro-batches, so each one pads little; micro-batches are dealt round-robin so every rank gets
    a mix of short and long ones.
    """
    positions = np.arange(position, position + global_batch_size)
    epochs, indices = np.divmod(positions, num_samples)
    if seed is None:
        sample_ids = indices
    else:
        sample_ids = np.array([epoch_permutation(seed, e, num_samples)[i] for e, i in zip(epochs, indices)])
    if length_of is not None:  # MLM
        order = sorted(range(global_batch_size), key=lambda k: (length_of(sample_ids[k]), k))  # MLM
        sample_ids, epochs = sample_ids[order], epochs[order]  # MLM
    plan = [[] for _ in range(world_size)]
    for micro_index in range(global_batch_size // micro_batch_size):
        chosen = slice(micro_index * micro_batch_size, (micro_index + 1) * micro_batch_size)
        plan[micro_index % world_size].append((sample_ids[chosen], epochs[chosen]))
    return plan


def rank_batches(split_data, position, shuffle_seed, cfg, world_size, rank, device):
    """This rank's micro-batches of the global batch that starts at sample `position`; the input and label
    token counts of the whole global batch, and the sample lengths of each of its micro-batches (for its
    FLOPs), which every rank computes alike from the shared plan."""
    is_mlm = split_data.task == "mlm"
    plan = global_batch_plan(position, cfg.train.global_batch_size, len(split_data), shuffle_seed,
                             cfg.train.micro_batch_size, world_size, split_data.length if is_mlm else None)
    every_sample = [(int(i), int(e)) for rank_plan in plan for ids, epochs in rank_plan for i, e in zip(ids, epochs)]
    micro_batch_lengths = [[split_data.length(int(i)) for i in ids] for rank_plan in plan for ids, _ in rank_plan]
    input_tokens = sum(map(sum, micro_batch_lengths))
    label_tokens = len(every_sample) * split_data.seq_len  # causal LM: every position is predicted
    if is_mlm:  # MLM: the masked positions, drawn exactly as make_micro_batch will draw them
        sample_ids, epochs = (np.array(column, dtype=np.int64) for column in zip(*every_sample))
        lengths = np.array([length for lengths in micro_batch_lengths for length in lengths])
        label_tokens = int(masked_positions(cfg.train.seed, epochs, sample_ids, lengths, split_data.seq_len,
                                            cfg.train.mlm_probability).sum())
    micro_batches = [make_micro_batch(split_data, ids, epochs, cfg, split_data.special, device)
                     for ids, epochs in plan[rank]]
    return micro_batches, input_tokens, label_tokens, micro_batch_lengths


def mlm_uniforms(seed, epochs, sample_ids, positions, use):  # MLM
    """One float in [0, 1) per (epoch, sample, position), the three broadcast against each other, for one use
    (0: is the position masked, 1: what replaces it, 2: which random token): a hash of (seed, epoch, sample,
    position, use) alone, so the masking does not depend on the rank or micro-batch that happens to process a
    sample, and a whole micro-batch is drawn in a few vectorised operations (a numpy Generator per sample took
    38 us to make on our CPU machine, and BERT-base's bench step would need 256 of them on every rank for the
    label count alone). The hash: splitmix64's mixing function (Steele, Lea and Flood, OOPSLA 2014)
    after each part; the top 53 bits of the last make the float."""
    mixed = np.full(np.broadcast_shapes(np.shape(epochs), np.shape(sample_ids), np.shape(positions)), seed,
                    dtype=np.uint64)
    for part in (epochs, sample_ids, np.asarray(positions) * 4 + use):
        mixed = splitmix64(mixed ^ np.asarray(part, dtype=np.uint64))
    return (splitmix64(mixed) >> np.uint64(11)).astype(np.float64) * 2.0**-53


def splitmix64(values):  # MLM
    values = values + np.uint64(0x9E3779B97F4A7C15)  # numpy's uint64 arrays wrap around, as the hash wants
    values = (values ^ (values >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    values = (values ^ (values >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return values ^ (values >> np.uint64(31))


def masked_positions(seed, epochs, sample_ids, lengths, width, probability):  # MLM
    """Which positions BERT predicts, one row per sample (`width` columns): never [CLS] (position 0), [SEP]
    (length - 1) or the padding after it; each other position with `probability`."""
    positions = np.arange(width)
    candidates = (positions >= 1) & (positions <= lengths[:, None] - 2)
    return candidates & (mlm_uniforms(seed, epochs[:, None], sample_ids[:, None], positions, 0) < probability)


def mask_tokens(tokens, lengths, seed, epochs, sample_ids, special, vocab_size, probability):  # MLM
    """BERT's masking of a padded micro-batch (a row of token ids per sample): the inputs and the labels."""
    chosen = masked_positions(seed, epochs, sample_ids, lengths, tokens.shape[1], probability)
    labels = np.where(chosen, tokens, IGNORE_INDEX)
    positions = np.arange(tokens.shape[1])
    action = mlm_uniforms(seed, epochs[:, None], sample_ids[:, None], positions, 1)
    inputs = np.where(chosen & (action < 0.8), special["mask"], tokens)  # 80% [MASK]
    replaced = chosen & (action >= 0.8) & (action < 0.9)  # 10% a random token, 10% unchanged
    random_tokens = mlm_uniforms(seed, epochs[:, None], sample_ids[:, None], positions, 2) * vocab_size
    inputs[replaced] = random_tokens[replaced].astype(np.int64)
    return inputs, labels


def make_micro_batch(split_data, sample_ids, epochs, cfg, special, device):
    samples = [split_data.sample(int(i)) for i in sample_ids]
    if split_data.task == "causal":
        blocks = torch.from_numpy(np.stack(samples))
        input_ids, labels, attention_mask = blocks[:, :-1], blocks[:, 1:], None
    else:  # MLM: to seq_len (train.pad_to_multiple=0), or to the longest sample of this micro-batch, rounded up
        lengths = np.array([len(sample) for sample in samples])
        length = padded_length(lengths.max(), cfg.train.pad_to_multiple, split_data.seq_len)
        tokens = np.full((len(samples), length), special["pad"], dtype=np.int64)
        for row, sample in enumerate(samples):
            tokens[row, :len(sample)] = sample
        masked, target = mask_tokens(tokens, lengths, cfg.train.seed, np.asarray(epochs, dtype=np.int64),
                                     np.asarray(sample_ids, dtype=np.int64), special, split_data.vocab_size,
                                     cfg.train.mlm_probability)
        input_ids, labels = torch.from_numpy(masked), torch.from_numpy(target)
        attention_mask = torch.from_numpy((np.arange(length) < lengths[:, None]).astype(np.int64))
    batch = {"input_ids": input_ids, "labels": labels, "attention_mask": attention_mask}
    if device.type == "cuda":  # a copy from pageable memory makes the host wait for the GPU; from pinned it does not
        batch = {key: value.pin_memory().to(device, non_blocking=True) if value is not None else None
                 for key, value in batch.items()}
    if split_data.task == "mlm" and 0 < cfg.train.pad_to_multiple < split_data.seq_len:  # MLM
        # One compiled graph for all lengths from the first step. Unmarked, Dynamo compiles the model and the loss
        # for the first length alone and again at the second, then with the length dynamic (automatic dynamic
        # shapes): 5 graphs instead of 3, counted on CPU (test_masked_lm_compiles_one_graph_for_all_padded_lengths
        # checks the 3). Guards that vary with the length (on CUDA maybe length % 8: see config.yaml) add graphs
        # per function up to torch._dynamo.config.recompile_limit (8 in torch 2.13); past it Dynamo runs that
        # function eagerly (one warning). maybe_: a torch that specializes the length anyway recompiles instead of
        # stopping the run.
        for key in ("input_ids", "labels", "attention_mask"):
            torch._dynamo.maybe_mark_dynamic(batch[key], 1)
    batch["host_input_ids"] = input_ids  # tiered: the host picks the CPU rows to copy without asking the GPU
    return batch


def padded_length(longest, pad_to_multiple, seq_len):  # MLM
    """The length a masked-LM micro-batch is padded to: its longest sample rounded up to a multiple of
    train.pad_to_multiple, at most seq_len; seq_len itself with 0."""
    if pad_to_multiple == 0:
        return seq_len
    return min(-(-longest // pad_to_multiple) * pad_to_multiple, seq_len)


def token_loss_sum(logits, labels):
    """Summed (not mean) cross-entropy, in fp32: the caller decides what to divide by."""
    return F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX, reduction="sum")


# ----------------------------------------------------------------------------- 4. model (helpers)

def is_masked_lm_type(cfg):
    model_type = cfg.model.type
    if cfg.model.pretrained:
        model_type = load_pretrained_config(cfg.model.pretrained).model_type
    return model_type in MODEL_FOR_MASKED_LM_MAPPING_NAMES


def load_pretrained_config(path):
    try:
        return AutoConfig.from_pretrained(path, local_files_only=True)  # no hub download: offline machines
    except (OSError, ValueError) as error:
        die(f"cannot read a transformers config from model.pretrained={path} ({first_line(error)}) "
            "-> give a local directory holding config.json and the weights")


def build_model(cfg, task, padded_vocab_size, special, device, shapes_only=False):
    """A new model from a transformers config, or a local pretrained one; fp32 master weights.
    shapes_only: the modules without loading pretrained weights (under torch.device("meta"): no memory)."""
    attention = choose_attention(cfg.model.attention, device, task)
    if cfg.model.pretrained:
        config = load_pretrained_config(cfg.model.pretrained)
        if getattr(config, "max_position_embeddings", cfg.train.seq_len) < cfg.train.seq_len:
            die(f"{cfg.model.pretrained} knows {config.max_position_embeddings} positions, "
                f"train.seq_len is {cfg.train.seq_len} -> lower train.seq_len")
    else:
        if cfg.model.n_embd % cfg.model.n_head:
            die(f"model.n_embd={cfg.model.n_embd} is not divisible by model.n_head={cfg.model.n_head} "
                "-> change one of them")
        try:
            config = AutoConfig.for_model(
                cfg.model.type, vocab_size=padded_vocab_size, hidden_size=cfg.model.n_embd,
                num_hidden_layers=cfg.model.n_layer, num_attention_heads=cfg.model.n_head,
                max_position_embeddings=cfg.train.seq_len, pad_token_id=special["pad"],
                bos_token_id=special["eot"], eos_token_id=special["eot"],
            )
        except ValueError as error:
            die(f"model.type={cfg.model.type} is not a transformers model type ({first_line(error)}) "
                "-> use e.g. gpt2, llama, bert or roberta")
        if hasattr(config, "intermediate_size"):  # models that have one default to their own, much larger size
            config.intermediate_size = cfg.model.intermediate_size or 4 * cfg.model.n_embd
        if hasattr(config, "num_key_value_heads"):
            config.num_key_value_heads = cfg.model.n_head
    for name, value in config.to_dict().items():
        if ("dropout" in name or "pdrop" in name) and isinstance(value, float):
            setattr(config, name, cfg.model.dropout)
    tied_by_the_model = bool(getattr(config, "tie_word_embeddings", False))
    if str(cfg.model.tie_word_embeddings).lower() != "auto":  # auto: the model's own (gpt2, bert tie; llama does not)
        config.tie_word_embeddings = str(cfg.model.tie_word_embeddings).lower() == "true"
    config.use_cache = False  # a key/value cache serves generation only; training would build one every forward
    model_class = AutoModelForMaskedLM if task == "mlm" else AutoModelForCausalLM
    if shapes_only:  # rank 0 gives a pretrained model with a smaller vocabulary padded_vocab_size rows
        config.vocab_size = max(config.vocab_size, padded_vocab_size)
    if not cfg.model.pretrained or shapes_only:
        return model_class.from_config(config, attn_implementation=attention, dtype=torch.float32), attention
    try:
        model = model_class.from_pretrained(cfg.model.pretrained, config=config, dtype=torch.float32,
                                            attn_implementation=attention, local_files_only=True)
    except (OSError, ValueError) as error:
        die(f"cannot load model.pretrained={cfg.model.pretrained} ({first_line(error)}) "
            "-> give a directory written by save_pretrained")
    if tied_by_the_model and not config.tie_word_embeddings:
        # a tied checkpoint holds one table: transformers leaves the untied output layer random (and warns);
        # it starts as the copy it was while tied
        model.get_output_embeddings().weight.data.copy_(model.get_input_embeddings().weight.data)
        log0("untied the output layer from the input embedding (model.tie_word_embeddings=false): it starts as a copy")
    if model.get_input_embeddings().num_embeddings < padded_vocab_size:
        model.resize_token_embeddings(padded_vocab_size)  # the tokenizer has more tokens than the model
    return model, attention


def shard_model(raw_model, source_model, cfg, param_dtype, use_compile, device):
    """fully_shard each transformer block, then the root (what is left: embeddings, final norm, output layer);
    then fill the shards from rank 0's source_model."""
    if cfg.fsdp.activation_checkpointing:  # before compile and sharding, as torchtitan orders them
        raw_model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    # transformers lists each model's blocks in _no_split_modules (modules that must stay on one device), so
    # any transformers model is sharded block by block without a hand-written list. A block holding the input
    # embedding stays in the root: a tied output layer shares its weight, and one weight cannot belong to two
    # FSDP units.
    block_names = set(raw_model._no_split_modules or [])
    embedding = raw_model.get_input_embeddings()
    blocks = [module for module in raw_model.modules() if type(module).__name__ in block_names
              and not any(inner is embedding for inner in module.modules())]
    if not blocks:
        die(f"found no blocks to shard in {type(raw_model).__name__} (its _no_split_modules: {block_names}) "
            "-> use a transformers model that lists its layers in _no_split_modules, or train_ddp.py")
    # bf16 weights for compute (half the all-gather traffic), gradients reduced and kept in fp32
    mixed_precision = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    offload = CPUOffloadPolicy(pin_memory=device.type == "cuda") if cfg.fsdp.cpu_offload else OffloadPolicy()
    for block in blocks:
        if use_compile:
            block.compile()  # per block: FSDP's hooks at block boundaries would break a whole-model graph anyway
        fully_shard(block, reshard_after_forward=cfg.fsdp.reshard_after_forward, mp_policy=mixed_precision,
                    offload_policy=offload)
    fully_shard(raw_model, reshard_after_forward=cfg.fsdp.reshard_after_forward, mp_policy=mixed_precision,
                offload_policy=offload)
    raw_model.to_empty(device="cpu" if cfg.fsdp.cpu_offload else device)  # memory for this rank's shards only
    full_state = source_model.state_dict() if source_model is not None else {}
    set_model_state_dict(raw_model, full_state, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    # Buffers are not sharded, and non-persistent ones (rotary frequencies, position ids) are in no state dict:
    # to_empty left them uninitialised, so they come from rank 0's model too.
    source_buffers = dict(source_model.named_buffers()) if source_model is not None else {}
    for name, buffer in list(raw_model.named_buffers()):
        value = source_buffers[name].to(device) if source_model is not None else torch.empty_like(buffer, device=device)
        dist.broadcast(value, src=0)
        owner, _, buffer_name = name.rpartition(".")
        setattr(raw_model.get_submodule(owner), buffer_name, value)


def choose_attention(requested, device, task):
    # FlashAttention-2 runs on compute capability 8.0 and newer only (its README: Ampere, Ada, Hopper): on an
    # older GPU where flash_attn imports, picking it would fail at the first forward pass
    usable = device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 0) and flash_attn_available()
    if requested == "auto" and usable:
        return "flash_attention_2"
    if requested == "auto" and task == "causal":
        # transformers' "sdpa" builds an explicit causal mask whenever torch.compile traces it (masking_utils.py,
        # _ignore_causal_mask_sdpa: with torch before 2.14), and PyTorch's SDPA runs no flash kernel with an
        # explicit mask. Our causal batches are never padded, so this one passes no mask and SDPA is_causal=True.
        AttentionInterface.register("sdpa_causal", sdpa_attention_forward)
        AttentionMaskInterface.register("sdpa_causal", lambda *args, **kwargs: None)
        return "sdpa_causal"
    if requested == "auto":
        return "sdpa"
    if requested == "flash_attention_2" and not usable:
        die("model.attention=flash_attention_2 needs the flash_attn package and a GPU of compute capability 8.0 or "
            "newer -> pip install flash-attn, or use model.attention=sdpa")
    return requested


def flash_attn_available():
    try:
        import flash_attn  # noqa: F401
        return True
    except ImportError:
        return False


def model_flops_counter(raw_model, task, attention, cfg):
    """A function from the sample lengths of each micro-batch to their model FLOPs: what MFU divides by peak."""
    matmul_params = count_matmul_params(raw_model)
    layers, width = raw_model.config.num_hidden_layers, raw_model.config.hidden_size
    # FlashAttention-2 removes a masked batch's padding before attention (transformers' _upad_input); SDPA and
    # eager compute every padded position and zero the masked scores afterwards
    attention_unpads = attention == "flash_attention_2"
    return lambda micro_batch_lengths: model_flops(micro_batch_lengths, matmul_params, layers, width,
                                                   task == "causal", attention_unpads, cfg.train.pad_to_multiple,
                                                   cfg.train.seq_len)


def model_flops(micro_batch_lengths, matmul_params, layers, width, causal, attention_unpads, pad_to_multiple,
                seq_len):
    """Model FLOPs of forward + backward of micro-batches, one list of sample lengths each (the FLOPs MFU counts).

    PaLM's count (Chowdhery et al. 2022, app. B), with attention counted as computed here:
    - matmuls: 2 FLOPs per multiply-add, forward; backward computes two products of the same size (gradients of
      the input and of the weight): 6 x matmul_params per position. Every position of a micro-batch is computed,
      padding included (a masked-LM micro-batch is padded to its longest sample, rounded up: padded_length).
    - attention scores Q K^T and their weighted sum of V: 2 x 2 x width FLOPs per query-key pair per layer
      forward, x3 with backward: 12 x layers x width per pair. A causal query sees the keys up to itself: half
      the pairs of full attention (FlashAttention-2 skips the blocks above the diagonal: Dao 2023, sec. 3.1.1).
      A masked-LM query sees every padded position, or only its own sample's with attention_unpads.
    Not counted: norms, activations, softmax, embedding lookups, the loss, and recomputation (activation
    checkpointing: MFU counts the model's FLOPs, not the hardware's). 6 x matmul_params counts biases and norm
    weights as if multiplied: 13 / (12 x width) too much for a GPT-2 block (0.14% at width 768).
    """
    total = 0
    for lengths in micro_batch_lengths:
        padded = padded_length(max(lengths), pad_to_multiple, seq_len)  # causal: seq_len
        positions = len(lengths) * padded
        if causal:
            query_key_pairs = positions * padded / 2
        elif attention_unpads:  # MLM
            query_key_pairs = sum(length * length for length in lengths)  # MLM
        else:  # MLM
            query_key_pairs = positions * padded  # MLM
        total += 6 * matmul_params * positions + 12 * layers * width * query_key_pairs
    return total


def count_matmul_params(model):
    """Parameters that are multiplied with every token: all but embedding lookups, plus the output
    layer when it shares its weight with the input embedding (it is a matmul there)."""
    total = sum(p.numel() for p in model.parameters())
    embedding_weights = {id(p): p.numel() for m in model.modules()
                         if isinstance(m, (torch.nn.Embedding, TieredEmbedding)) for p in m.parameters(recurse=False)}
    output = model.get_output_embeddings()
    tied_output = output.weight.numel() if output is not None and id(output.weight) in embedding_weights else 0
    return total - sum(embedding_weights.values()) + tied_output


def hottest_token_ids(frequencies, rows, count):  # tiered
    """The `count` most frequent of `rows` token ids, most frequent first. Equal counts go to the lower id (a
    stable sort), so that every rank and every run picks the same rows; ids past the frequency table (the rows
    that pad the vocabulary to a multiple of 64) count 0."""
    counts = np.zeros(rows, np.int64)
    counts[:min(rows, len(frequencies))] = frequencies[:rows]
    return torch.from_numpy(np.argsort(-counts, kind="stable")[:count].copy())


def tier_embedding(raw_model, data_dir, meta, cfg, precision, device):  # tiered
    """Put a TieredEmbedding in place of the model's input embedding, its GPU rows those of the
    model.embedding_gpu_rows most frequent tokens of the train split (counted by preprocess.py)."""
    embedding, output = raw_model.get_input_embeddings(), raw_model.get_output_embeddings()
    if output is not None and output.weight is embedding.weight:
        die("model.embedding_gpu_rows needs an output layer of its own, and this model ties it to the input embedding: "
            "the output layer multiplies every row at every step, so no row could stay in CPU memory -> set "
            "model.tie_word_embeddings=false (the output layer then has weights of its own: vocabulary x width more)")
    if precision == "fp16":
        die("model.embedding_gpu_rows does not train in fp16: the grad scaler would not see the gradient of the rows "
            "in CPU memory -> use train.precision=bf16 or fp32, or model.embedding_gpu_rows=0")
    if not isinstance(embedding, torch.nn.Embedding):
        die(f"model.embedding_gpu_rows splits a torch.nn.Embedding; this model's input embedding is a "
            f"{type(embedding).__name__} -> set model.embedding_gpu_rows=0")
    if cfg.model.embedding_gpu_rows >= embedding.num_embeddings:
        die(f"model.embedding_gpu_rows={cfg.model.embedding_gpu_rows} is not below the embedding's "
            f"{embedding.num_embeddings} rows, so no row would stay in CPU memory -> set it lower, or 0 for one table")
    frequency_file = data_dir / meta.get("token_frequencies_file", "token_frequencies.npy")
    try:
        frequencies = np.load(frequency_file)
    except (OSError, ValueError) as error:
        die(f"model.embedding_gpu_rows needs the token frequencies of the data, and {frequency_file} cannot be read "
            f"({first_line(error)}; data prepared by an older preprocess.py has none) -> rebuild the data: "
            f"python preprocess.py --out {data_dir} --force")
    if frequencies.shape != (meta["vocab_size"],):
        die(f"{frequency_file} holds {frequencies.shape[0] if frequencies.ndim else 0} counts for a vocabulary of "
            f"{meta['vocab_size']} -> rebuild the data: python preprocess.py --out {data_dir} --force")
    hot_ids = hottest_token_ids(frequencies, embedding.num_embeddings, cfg.model.embedding_gpu_rows)
    tiered = TieredEmbedding(embedding, hot_ids, device)
    raw_model.set_input_embeddings(tiered)
    covered = frequencies[hot_ids[hot_ids < len(frequencies)].numpy()].sum() / max(1, frequencies.sum())
    log0(f"input embedding tiered: the rows of the {len(hot_ids):,} most frequent tokens ({100 * covered:.1f}% of the "
         f"train tokens) on {device.type}, the other {len(tiered.cold_ids):,} in CPU memory (not counted below)")
    return tiered


class TieredEmbedding(torch.nn.Module):  # tiered
    """An input embedding split by token frequency (model.embedding_gpu_rows; README: tiered embedding).

    Hot rows (the most frequent ids) form one GPU parameter, `hot_weight`: DDP reduces its gradient and the
    trainer's AdamW updates it, as any weight. Cold rows (all others) live in CPU memory with their lazy AdamW
    state. A step's cold rows, those of every id in the global batch (all ranks'), go to the GPU once per step:
    `stage` gathers them on the host while the GPU still runs the step before, `start_step` makes them one GPU
    tensor `rows` (with their moments and step counts) that every micro-batch's forward reads and whose .grad
    the backward passes fill; `reduce_gradients` all-reduces that gradient as DDP does the hot rows'; `step`
    applies lazy AdamW to them on the GPU and copies them back to the host on the side stream, and
    `write_to_tables` puts them into the CPU tables during the next step. The tier map: token id i is row
    slot_of_id[i] of hot_weight if that is below hot_rows, else row slot_of_id[i] - hot_rows of the CPU tables.
    """

    def __init__(self, embedding, hot_ids, device):
        super().__init__()
        weight = embedding.weight.detach().cpu()
        self.width, self.padding_idx, self.device = weight.shape[1], embedding.padding_idx, device
        self.set_tiers(hot_ids, weight.shape[0])
        self.hot_weight = torch.nn.Parameter(weight[self.hot_ids].clone())
        # Plain attributes, not parameters or buffers: model.to(device) leaves them in CPU memory, DDP neither
        # reduces nor broadcasts them, and the state dict gets them from get_extra_state. Ordinary memory, not
        # pinned: copies read and write the pinned buffers the rows are gathered into, never the tables.
        self.cold_weight = weight[self.cold_ids].clone()
        self.cold_exp_avg = torch.zeros_like(self.cold_weight)
        self.cold_exp_avg_sq = torch.zeros_like(self.cold_weight)
        self.cold_steps = torch.zeros(len(self.cold_ids), dtype=torch.long)  # lazy AdamW: each row counts its own
        # one side stream, made once: every copy goes on it, in order, beside the compute on the main stream
        self.copy_stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.staged = None  # the next step's rows, on their way to the GPU (stage -> start_step)
        self.current = None  # this step's rows on the GPU (start_step), updated there by step
        self.written = None  # the rows step last updated, copied back to the host, not yet in the CPU tables

    def set_tiers(self, hot_ids, vocab_rows):
        is_hot = torch.zeros(vocab_rows, dtype=torch.bool)
        is_hot[hot_ids] = True
        self.hot_ids, self.cold_ids, self.hot_rows = hot_ids, (~is_hot).nonzero().flatten(), len(hot_ids)
        self.slot_of_id = torch.empty(vocab_rows, dtype=torch.long)
        self.slot_of_id[self.hot_ids] = torch.arange(self.hot_rows)
        self.slot_of_id[self.cold_ids] = torch.arange(self.hot_rows, vocab_rows)

    def cold_tables(self):
        return [self.cold_weight, self.cold_exp_avg, self.cold_exp_avg_sq, self.cold_steps]

    def stage(self, micro_batches, step_ids):
        """Start copying the cold rows of the next step to the GPU: `micro_batches` are this rank's (their ids
        still in CPU memory), `step_ids` every input id of the global batch (step_input_ids). Called while the
        GPU runs the step before, so the host work and the copies overlap it. Rows that step also holds are not
        copied: start_step takes them from the GPU after that step's update, which the CPU tables do not have yet."""
        self.write_to_tables()  # if not done yet: the last update, whose rows may be gathered below
        step_slots = self.slot_of_id[step_ids]
        slots = torch.unique(step_slots[step_slots >= self.hot_rows])  # sorted; the same on every rank
        table_indices = []  # per micro-batch and position: its row in cat([hot_weight, this step's cold rows])
        for batch in micro_batches:
            index = self.slot_of_id[batch["host_input_ids"]]
            is_cold = index >= self.hot_rows
            index[is_cold] = self.hot_rows + torch.searchsorted(slots, index[is_cold])
            table_indices.append(index)
        previous = self.current.slots if self.current is not None else slots[:0]
        place = torch.searchsorted(previous, slots).clamp_(max=max(0, len(previous) - 1))
        carried = previous[place] == slots if len(previous) else torch.zeros(len(slots), dtype=torch.bool)
        fresh_rows = slots[~carried] - self.hot_rows
        pin = self.copy_stream is not None  # a copy from pageable memory would make the host wait for it
        fresh = [torch.index_select(table, 0, fresh_rows, out=torch.empty((len(fresh_rows), *table.shape[1:]),
                                                                          dtype=table.dtype, pin_memory=pin))
                 for table in self.cold_tables()]
        positions = [(~carried).nonzero().flatten(), carried.nonzero().flatten(), place[carried]]
        ready = None
        if self.copy_stream is not None:
            # A pinned buffer freed here while its copy may still run is reused only after that copy: the caching
            # host allocator records an event with each copy (PyTorch's aten/src/ATen/cuda/CachingHostAllocator.h).
            # GPU memory allocated on the side stream is marked with record_stream in start_step, where it is read.
            with torch.cuda.stream(self.copy_stream):
                table_indices, fresh, positions = ([tensor.pin_memory().to(self.device, non_blocking=True)
                                                    for tensor in tensors] for tensors in (table_indices, fresh, positions))
                ready = torch.cuda.Event()
                ready.record()
        self.staged = SimpleNamespace(slots=slots, table_indices=table_indices, fresh=fresh, positions=positions,
                                      previous=self.current, padding_index=self.padding_index(slots), ready=ready)

    def padding_index(self, cold_slots):
        """The row of padding_idx in cat([hot_weight, the rows of cold_slots]), or None where it is absent:
        nn.Embedding(padding_idx=) sends no gradient to that row, and neither does this module."""
        if self.padding_idx is None:
            return None
        pad_slot = int(self.slot_of_id[self.padding_idx])
        if pad_slot < self.hot_rows:
            return pad_slot
        found = int(torch.searchsorted(cold_slots, pad_slot))
        return self.hot_rows + found if found < len(cold_slots) and int(cold_slots[found]) == pad_slot else None

    @torch.no_grad()
    def start_step(self):
        """Make the staged rows this step's GPU tensors: the copied ones, and those the step before also held
        taken from its updated tensors on the GPU. No wait for the host: the compute stream waits for the copy."""
        staged, self.staged = self.staged, None
        fresh_at, carried_at, carried_from = staged.positions
        if staged.ready is not None:
            compute_stream = torch.cuda.current_stream(self.device)
            compute_stream.wait_event(staged.ready)
            # allocated on the side stream and read here: without record_stream the allocator could give this
            # memory to the next copy as soon as it is freed, while kernels queued here still read it
            for tensor in [*staged.table_indices, *staged.fresh, *staged.positions]:
                if tensor.numel():  # an empty tensor has no memory
                    tensor.record_stream(compute_stream)
        previous = staged.previous
        carried_state = [previous.rows, previous.exp_avg, previous.exp_avg_sq, previous.steps] if previous else []
        state = []
        for index, fresh in enumerate(staged.fresh):
            values = torch.empty((len(staged.slots), *fresh.shape[1:]), dtype=fresh.dtype, device=self.device)
            values[fresh_at] = fresh
            if len(carried_at):
                values[carried_at] = carried_state[index][carried_from]
            state.append(values)
        rows, exp_avg, exp_avg_sq, steps = state
        rows.requires_grad_()  # a leaf: the backward passes of the step's micro-batches sum its gradient in rows.grad
        self.current = SimpleNamespace(slots=staged.slots, rows=rows, exp_avg=exp_avg, exp_avg_sq=exp_avg_sq,
                                       steps=steps, table_indices=staged.table_indices,
                                       padding_index=staged.padding_index)

    @torch.compiler.disable  # host work (a list, CPU tensors) Dynamo cannot trace: the compiled graph breaks here
    def forward(self, input_ids):
        if self.current is not None and self.current.table_indices:  # a micro-batch of the step, staged
            table_index = self.current.table_indices.pop(0)
            if table_index.shape != input_ids.shape:
                raise RuntimeError(f"TieredEmbedding: staged a micro-batch of {tuple(table_index.shape)}, "
                                   f"got one of {tuple(input_ids.shape)}")
            return F.embedding(table_index, torch.cat([self.hot_weight, self.current.rows]),
                               padding_idx=self.current.padding_index)
        if torch.is_grad_enabled():  # its cold rows would get no gradient and no update
            raise RuntimeError("TieredEmbedding: a training forward pass needs its micro-batch staged -> call "
                               "stage(micro_batches, step_ids) and start_step() before the step, as train_ddp.py does")
        # validation and generate(): the rows of this batch from the CPU tables, which first get the last update;
        # waits for the GPU once per call
        self.write_to_tables()
        slots = self.slot_of_id[input_ids.cpu()]
        is_cold = slots >= self.hot_rows
        cold_slots, position = torch.unique(slots[is_cold], return_inverse=True)
        slots[is_cold] = self.hot_rows + position
        rows = self.cold_weight[cold_slots - self.hot_rows].to(self.device)
        return F.embedding(slots.to(self.device), torch.cat([self.hot_weight, rows]),
                           padding_idx=self.padding_index(cold_slots))

    def reduce_gradients(self, world_size):
        """The gradient of this step's cold rows, summed over micro-batches (by autograd) and ranks and divided by
        world_size, as DDP averages the hot rows' gradient. Every rank holds the same rows in the same order, so
        one all_reduce does it, on the GPU, with no wait for the host. Returns [the rows], whose .grad that is,
        so that clip_grad_norm_ counts it into the one global norm."""
        rows = self.current.rows
        if rows.grad is None:  # a step without cold rows
            rows.grad = torch.zeros_like(rows)
        if world_size > 1 and rows.numel():  # every rank has the same row count: all skip alike
            dist.all_reduce(rows.grad)
            rows.grad.div_(world_size)
        return [rows]

    @torch.no_grad()
    def step(self, lr, optim, skip):
        """Lazy AdamW, on the GPU: torch.optim.AdamW's formula (decoupled weight decay, both moments, bias
        correction) on the cold rows of this step, each row a parameter of its own with its own step count. A
        row used at every step is updated as AdamW updates a dense table; an unused row keeps its weight and
        moments, where dense AdamW would decay both at every step, which would touch every row. Where `skip` (a
        0-dim device tensor) is 1, the rows, moments and step counts stay as they were, as the fused AdamW's
        do with found_inf: decided on the GPU, with no wait for the host. Then the rows go back to the host on
        the side stream, for write_to_tables."""
        state = self.current
        weight, grad = state.rows, state.rows.grad
        before = [tensor.clone() for tensor in (weight, state.exp_avg, state.exp_avg_sq, state.steps)]
        state.steps += 1
        weight.mul_(1 - lr * optim.weight_decay)
        state.exp_avg.lerp_(grad, 1 - optim.beta1)
        state.exp_avg_sq.mul_(optim.beta2).addcmul_(grad, grad, value=1 - optim.beta2)
        step_size = (lr / (1 - optim.beta1 ** state.steps.double())).float()[:, None]
        bias_correction2_sqrt = (1 - optim.beta2 ** state.steps.double()).sqrt().float()[:, None]
        denominator = state.exp_avg_sq.sqrt().div_(bias_correction2_sqrt).add_(optim.eps)
        weight.sub_(torch.div(state.exp_avg, denominator).mul_(step_size))  # AdamW: - step_size * m / denom
        updated = [weight.detach(), state.exp_avg, state.exp_avg_sq, state.steps]
        for tensor, old in zip(updated, before):  # torch.where, not a multiplication: 0 x NaN is NaN
            tensor.copy_(torch.where(skip > 0, old, tensor))
        done = None
        if self.copy_stream is not None:
            self.copy_stream.wait_stream(torch.cuda.current_stream(self.device))  # after the update
            with torch.cuda.stream(self.copy_stream):
                host = [torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True) for tensor in updated]
                for target, tensor in zip(host, updated):
                    target.copy_(tensor, non_blocking=True)
                    tensor.record_stream(self.copy_stream)  # freed by the next start_step, maybe before this copy ends
                done = torch.cuda.Event()
                done.record()
            updated = host
        # on a CPU the tensors themselves: start_step builds new ones, so nothing writes these before they are read
        self.written = SimpleNamespace(rows=state.slots - self.hot_rows, values=updated, done=done)

    def write_to_tables(self):
        """Put the rows the last step() updated into the CPU tables, waiting for their copy (queued behind that
        update). train_ddp.py calls it once the next step's first micro-batch is queued, so the GPU has work
        meanwhile; stage(), validation, checkpoints and the export call it too, before they read the tables."""
        written, self.written = self.written, None
        if written is None:
            return
        if written.done is not None:
            written.done.synchronize()
        for table, values in zip(self.cold_tables(), written.values):
            table.index_copy_(0, written.rows, values)

    def held_tensors(self):
        """Every tensor the module holds beside hot_weight: the CPU tables, and the rows of the step and the next
        on the GPU and their copies back (for embedding_memory)."""
        held = self.cold_tables()
        if self.current is not None:
            held += [self.current.rows, self.current.exp_avg, self.current.exp_avg_sq, self.current.steps]
            held += [self.current.rows.grad] if self.current.rows.grad is not None else []
        if self.staged is not None:
            held += self.staged.fresh
        if self.written is not None and self.written.done is not None:
            held += self.written.values
        return held

    def get_extra_state(self):
        """The cold rows, their lazy AdamW state and the tier map go into the model's state dict (model.pt)."""
        self.write_to_tables()
        return {"hot_ids": self.hot_ids, "cold_weight": self.cold_weight, "cold_exp_avg": self.cold_exp_avg,
                "cold_exp_avg_sq": self.cold_exp_avg_sq, "cold_steps": self.cold_steps}

    def set_extra_state(self, state):
        if state["cold_weight"].shape != self.cold_weight.shape:
            raise ValueError(f"its CPU embedding rows are {tuple(state['cold_weight'].shape)}, this model's "
                             f"{tuple(self.cold_weight.shape)}")
        # the checkpoint's tier map, not one from today's frequency file: hot_weight holds the rows of these ids
        self.set_tiers(state["hot_ids"], len(self.slot_of_id))
        self.cold_weight, self.cold_exp_avg = state["cold_weight"], state["cold_exp_avg"]
        self.cold_exp_avg_sq, self.cold_steps = state["cold_exp_avg_sq"], state["cold_steps"]
        self.staged = self.current = self.written = None  # rows of the old tables: not to be carried over

    def merged(self):
        """One nn.Embedding in token id order, as transformers' save_pretrained and from_pretrained expect."""
        self.write_to_tables()
        weight = torch.empty((len(self.slot_of_id), self.width))
        weight[self.hot_ids] = self.hot_weight.detach().cpu()
        weight[self.cold_ids] = self.cold_weight
        return torch.nn.Embedding.from_pretrained(weight, freeze=False, padding_idx=self.padding_idx)


def step_input_ids(split_data, position, cfg, world_size, rank, micro_batches):  # tiered
    """Every input id of the global batch at `position`, all ranks', flat: the rows a tiered step updates.
    `micro_batches` are this rank's, built already; each rank builds the other ranks' input ids from the shared
    plan itself (no communication, no wait for the GPU), as make_micro_batch does for them."""
    plan = global_batch_plan(position, cfg.train.global_batch_size, len(split_data), cfg.train.seed,
                             cfg.train.micro_batch_size, world_size, split_data.length if split_data.task == "mlm" else None)
    return torch.cat([batch["host_input_ids"].flatten() for batch in micro_batches]
                     + [make_micro_batch(split_data, ids, epochs, cfg, split_data.special, torch.device("cpu"))
                        ["input_ids"].flatten()
                        for other_rank, rank_plan in enumerate(plan) if other_rank != rank for ids, epochs in rank_plan])


def embedding_memory(raw_model, optimizer):
    """MiB the input embedding holds, per device type: weights, gradients and optimizer state (tiered: also the
    CPU rows and their lazy AdamW state), summed from the tensors themselves."""
    embedding = raw_model.get_input_embeddings()
    tensors = list(state_tensors(embedding.parameters(), optimizer))
    if isinstance(embedding, TieredEmbedding):  # tiered
        tensors += embedding.held_tensors()
    held = {}
    for tensor in tensors:
        held[tensor.device.type] = held.get(tensor.device.type, 0) + tensor.numel() * tensor.element_size() / 2**20
    return held


def state_tensors(parameters, optimizer):
    """Each parameter, its gradient and its optimizer state's tensors, as this rank holds them."""
    for parameter in parameters:
        for tensor in [parameter, parameter.grad, *optimizer.state.get(parameter, {}).values()]:
            if torch.is_tensor(tensor):
                yield tensor.to_local() if hasattr(tensor, "to_local") else tensor  # FSDP: this rank's shard


# ----------------------------------------------------------------------------- 5. optimizer (helpers)

def memory_prediction(raw_model, device):
    """Bytes this rank holds between steps, from the parameters' counts and dtypes: the weights, a gradient of
    the same dtype for each trained one, and AdamW's two moments (exp_avg, exp_avg_sq), which torch.optim.AdamW
    creates like the parameter (torch.zeros_like). Only this device's tensors: not a tiered table's CPU rows."""
    weights = trained = 0
    for parameter in raw_model.parameters():
        local = parameter.to_local() if hasattr(parameter, "to_local") else parameter  # FSDP: this rank's shard
        if local.device.type == device.type:
            weights += local.numel() * local.element_size()
            trained += local.numel() * local.element_size() if parameter.requires_grad else 0
    return {"weights": weights, "gradients": trained, "optimizer": 2 * trained}


def memory_measured(raw_model, optimizer, device, predicted):
    """After an update, before zero_grad: the prediction, the same three summed from the tensors that exist
    (its check), and on a GPU the caching allocator's figures: allocated now, the peak since start (forward and
    backward's activations and temporaries on top of what stays) and reserved (allocated plus its cache)."""
    # AdamW's "step" is a 0-d tensor per parameter (4 bytes): not part of the prediction's state
    held = sum(tensor.numel() * tensor.element_size() for tensor in state_tensors(raw_model.parameters(), optimizer)
               if tensor.dim() > 0 and tensor.device.type == device.type)
    memory = {"predicted_bytes": sum(predicted.values()), **{f"predicted_{k}_bytes": v for k, v in predicted.items()},
              "held_bytes": held}
    if device.type == "cuda":
        memory.update(allocated_bytes=torch.cuda.memory_allocated(device),
                      peak_bytes=torch.cuda.max_memory_allocated(device),
                      reserved_bytes=torch.cuda.memory_reserved(device))
    return memory


def memory_line(step, memory):
    mib = {key: value / 2**20 for key, value in memory.items()}
    line = (f"step {step} | memory per rank: weights + gradients + AdamW state predicted {mib['predicted_bytes']:,.1f} "
            f"MiB, held by those tensors {mib['held_bytes']:,.1f} MiB")
    if "peak_bytes" in memory:
        line += (f"; allocated {mib['allocated_bytes']:,.1f} MiB, peak {mib['peak_bytes']:,.1f} MiB (activations "
                 f"and temporaries: {mib['peak_bytes'] - mib['predicted_bytes']:,.1f} MiB above the prediction), "
                 f"reserved {mib['reserved_bytes']:,.1f} MiB (the allocator's cache: "
                 f"{mib['reserved_bytes'] - mib['peak_bytes']:,.1f} MiB above the peak)")
    return line


def lr_factor(step, cfg):
    """Linear warmup, then cosine decay to min_lr at max_steps (a multiplier of optim.lr)."""
    if step < cfg.optim.warmup_steps:
        return (step + 1) / cfg.optim.warmup_steps
    progress = min(1.0, (step - cfg.optim.warmup_steps) / max(1, cfg.train.max_steps - cfg.optim.warmup_steps))
    min_factor = cfg.optim.min_lr / cfg.optim.lr
    return min_factor + (1 - min_factor) * 0.5 * (1 + math.cos(math.pi * progress))


# ----------------------------------------------------------------------------- 6. checkpoint (helpers)

CHECKPOINT_FILES = [".metadata", "train_state.pt", "checksums.json"]  # DCP writes .metadata after every shard
# config keys that checkpoints written before them lack, with the value those runs had
SINCE_CHECKPOINTS_HAD_THEM = {"model.tie_word_embeddings": "auto", "model.embedding_gpu_rows": 0,
                              "model.intermediate_size": 0}


def is_complete(path):
    return path.is_dir() and all((path / name).is_file() for name in CHECKPOINT_FILES)


def step_of(path):
    """The step number of a step_* directory: compared as numbers, since as strings step_999900 sorts after
    step_1000000, and pruning would then delete the newest checkpoints."""
    match = re.fullmatch(r"step_(\d+)", path.name)
    return int(match.group(1)) if match else -1


def complete_checkpoints(ckpt_dir):
    """The complete step_* directories of ckpt_dir, oldest first."""
    found = [p for p in ckpt_dir.glob("step_*") if step_of(p) >= 0 and is_complete(p)] if ckpt_dir.is_dir() else []
    return sorted(found, key=step_of)


def find_resume_checkpoint(ckpt_dir, resume):
    """resume=auto: the newest intact checkpoint (the `latest` pointer first, then newest to oldest: a damaged
    one is passed over, and the log says so); never; or a path, which must be intact."""
    for leftover in list(ckpt_dir.glob(".tmp-step_*")) + list(ckpt_dir.glob(".latest-*")) if ckpt_dir.is_dir() else []:
        log0(f"removing {leftover}, left by a run that stopped while writing a checkpoint")
        shutil.rmtree(leftover) if leftover.is_dir() else leftover.unlink()
    existing = complete_checkpoints(ckpt_dir)
    if resume == "never":
        if existing:
            die(f"{ckpt_dir} already holds checkpoints ({existing[-1].name}) and checkpoint.resume=never would overwrite "
                "them -> continue with checkpoint.resume=auto or choose another checkpoint.dir")
        return None
    if resume == "auto":
        pointer = ckpt_dir / "latest"
        pointed = [ckpt_dir / pointer.read_text().strip()] if pointer.is_file() else []
        for candidate in [p for p in pointed if is_complete(p)] + existing[::-1]:
            damage = checksum_mismatch(candidate)
            if damage is None:
                return candidate
            log0(f"warning: {candidate} is damaged ({damage}); trying the next older checkpoint")
        if existing:
            die(f"every checkpoint in {ckpt_dir} is damaged -> move them away to start afresh, or restore one")
        return None
    if not is_complete(Path(resume)):
        die(f"checkpoint.resume={resume} is not a complete checkpoint directory (needs {', '.join(CHECKPOINT_FILES)}) "
            f"-> give a step_* directory, auto or never")
    damage = checksum_mismatch(Path(resume))
    if damage:
        die(f"checkpoint.resume={resume} is damaged ({damage}) -> give another step_* directory")
    newer = [p.name for p in existing if step_of(p) > step_of(Path(resume))]
    if newer:  # this run's checkpoints would interleave with them, and pruning could delete this run's
        die(f"{ckpt_dir} holds checkpoints newer than {resume} ({', '.join(newer)}) -> set checkpoint.dir to "
            "another directory for this run")
    return Path(resume)


def file_checksum(path):
    """CRC-32 of a file, read in 16 MiB pieces: catches truncated and bit-flipped files (not forgery: what
    protects against a malicious file is that loading never runs pickled code, weights_only=True)."""
    checksum = 0
    with open(path, "rb") as file:
        while piece := file.read(1 << 24):
            checksum = zlib.crc32(piece, checksum)
    return checksum


def write_checksums(directory, names, known=None):
    """checksums.json: the CRC-32 of each named file (known: ones computed elsewhere), synced to disk."""
    checksums = {**(known or {}), **{name: file_checksum(directory / name) for name in names}}
    with open(directory / "checksums.json", "w") as file:
        json.dump(checksums, file, indent=1)
        file.flush()
        os.fsync(file.fileno())


def checksum_mismatch(path):
    """None if every file listed in path/checksums.json has its checksum, else what is wrong."""
    try:
        checksums = json.loads((path / "checksums.json").read_text())
        for name, expected in checksums.items():
            if not (path / name).is_file():
                return f"{name} is missing"
            if file_checksum(path / name) != expected:
                return f"{name} does not match its checksum"
    except (OSError, ValueError, AttributeError) as error:
        return f"checksums.json is unreadable: {first_line(error)}"
    return None


def write_marker(ckpt_dir):
    """A file with a random name and content in checkpoint.dir; check_marker on every rank must find it."""
    token = secrets.token_hex(8)
    try:
        ckpt_dir.mkdir(parents=True, exist_ok=True)
        (ckpt_dir / f".shared-{token}").write_text(token)
    except OSError as error:
        die(f"cannot write to checkpoint.dir={ckpt_dir} ({error}) -> set checkpoint.dir to a writable directory")
    return token


def check_marker(ckpt_dir, token):
    marker = ckpt_dir / f".shared-{token}"
    if not marker.is_file() or marker.read_text() != token:
        die(f"checkpoint.dir={ckpt_dir} is not the directory rank 0 writes to (its marker file is not there) -> put "
            "checkpoint.dir on a filesystem that every node mounts at the same path")


def remove_marker(ckpt_dir, token):
    (ckpt_dir / f".shared-{token}").unlink(missing_ok=True)


def fsync_dir(path):
    """A rename or a new file is durable only once its directory is synced (POSIX fsync on the directory)."""
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def start_checkpoint(ckpt_dir, step, raw_model, optimizer, train_state, async_group):
    """Every rank writes its shards of the model and optimizer into one temporary directory (DCP), rank 0
    the train state; finish_checkpoint makes it a checkpoint. With async_group, the shards are copied to CPU
    memory here and written by a background thread while training goes on."""
    temporary = ckpt_dir / f".tmp-step_{step:06d}"  # the same name on every rank: they all write into it
    on_rank0(write_train_state, temporary, train_state)
    model_state, optimizer_state = get_state_dict(raw_model, optimizer)
    state = {"model": model_state, "optimizer": optimizer_state}
    try:
        if async_group is not None:
            return dcp.async_save(state, checkpoint_id=temporary, process_group=async_group), temporary
        dcp.save(state, checkpoint_id=temporary)
    except CheckpointException as error:  # raised on every rank when any rank fails
        die(f"cannot write checkpoint to {ckpt_dir} ({first_line(error)}) -> free disk space or set checkpoint.dir")
    if fault("kill-in-save", step):  # FAULT
        os.kill(os.getpid(), signal.SIGKILL)  # FAULT
    return None, temporary


def write_train_state(temporary, train_state):
    try:
        if temporary.exists():  # a leftover of a crashed save
            shutil.rmtree(temporary)
        temporary.mkdir(parents=True)
        with open(temporary / "train_state.pt", "wb") as file:
            torch.save(train_state, file)
            file.flush()
            os.fsync(file.fileno())  # the rename in publish_checkpoint must not reach the disk before the data
        (temporary / "config.yaml").write_text(yaml.safe_dump(train_state["config"], sort_keys=False))
    except OSError as error:
        die(f"cannot write checkpoint to {temporary.parent} ({error}) -> free disk space or set checkpoint.dir")


def finish_checkpoint(saving, ckpt_dir, keep):
    """Wait until every rank's shards are written, then rank 0 renames the directory into place."""
    future, temporary = saving
    if future is not None:
        on_all_ranks(wait_for_write, future, ckpt_dir)
    # each rank checksums the shard files it wrote (DCP names them __<rank>_<n>.distcp); rank 0 lists them all
    shard_checksums = [None] * dist.get_world_size()
    dist.all_gather_object(shard_checksums, {path.name: file_checksum(path)
                                             for path in temporary.glob(f"__{dist.get_rank()}_*.distcp")})
    on_rank0(publish_checkpoint, temporary, ckpt_dir, keep, {k: v for part in shard_checksums for k, v in part.items()})
    log0(f"checkpoint {ckpt_dir / temporary.name.replace('.tmp-', '')} written")


def wait_for_write(future, ckpt_dir):
    try:
        future.result()
    except Exception as error:  # DCP's background thread re-raises whatever stopped it
        die(f"cannot write checkpoint to {ckpt_dir} ({first_line(error)}) -> free disk space or set checkpoint.dir")


def publish_checkpoint(temporary, ckpt_dir, keep, shard_checksums):
    """Rename: a crash mid-write never leaves a checkpoint that resume=auto would pick. The `latest` pointer
    moves only after the rename; old ones go last. DCP fsyncs each file it writes (FileSystemWriter's
    sync_files, on by default)."""
    final = ckpt_dir / temporary.name.replace(".tmp-", "")
    try:
        write_checksums(temporary, [".metadata", "train_state.pt"], known=shard_checksums)
        fsync_dir(temporary)
        if final.exists():  # only an incomplete leftover can be there: resume refuses dirs with newer checkpoints
            shutil.rmtree(final)
        os.rename(temporary, final)
        pointer_temporary = ckpt_dir / f".latest-{os.getpid()}"
        pointer_temporary.write_text(final.name)
        os.replace(pointer_temporary, ckpt_dir / "latest")
        fsync_dir(ckpt_dir)  # the new checkpoint and pointer are on disk before any old checkpoint goes
        for old in complete_checkpoints(ckpt_dir)[:-keep]:
            shutil.rmtree(old)
    except OSError as error:
        die(f"cannot write checkpoint to {ckpt_dir} ({error}) -> free disk space or set checkpoint.dir")


def load_train_state(path, scheduler, scaler, cfg):
    """Step, data position, RNG, schedule and grad scaler, after checking the model shape matches.
    weights_only=True everywhere: a checkpoint is data, loading it must never run pickled code."""
    try:
        train_state = torch.load(path / "train_state.pt", weights_only=True)
        saved_config, this_config = train_state["config"], config_dict(cfg)
        for key in ["model.type", "model.task", "model.n_layer", "model.n_head", "model.n_embd", "model.pretrained",
                    "model.intermediate_size", "model.tie_word_embeddings", "model.embedding_gpu_rows"]:
            saved = saved_config.get(key, SINCE_CHECKPOINTS_HAD_THEM.get(key))
            if saved != this_config[key]:
                die(f"checkpoint {path} was trained with {key}={saved}, this run has "
                    f"{key}={this_config[key]} -> pass {key}={saved}, or use another checkpoint.dir")
        scheduler.load_state_dict(train_state["scheduler"])
        scaler.load_state_dict(train_state["scaler"])
    except (OSError, RuntimeError, KeyError, ValueError, EOFError, TypeError, pickle.UnpicklingError) as error:
        die(f"cannot load checkpoint {path} ({unloadable(error)}) -> "
            "point checkpoint.resume at another step_* directory, or use a new checkpoint.dir")
    return train_state


def weights_are_finite(raw_model):
    """Each rank checks its shards, then all agree; one wait for the GPU, only before a checkpoint or the export."""
    finite = torch.stack([torch.isfinite(p.to_local()).all() for p in raw_model.parameters()]).all().float()
    dist.all_reduce(finite, op=dist.ReduceOp.MIN)
    return bool(finite)


def load_weights(path, raw_model, optimizer):
    """Sharded model and optimizer state from a DCP checkpoint written on any number of ranks: each rank reads
    the pieces its shards need. A collective: every rank must call it."""
    model_state, optimizer_state = get_state_dict(raw_model, optimizer)
    state = {"model": model_state, "optimizer": optimizer_state}
    try:
        dcp.load(state, checkpoint_id=path)
    except CheckpointException as error:  # raised on every rank when any rank fails
        die(f"cannot load checkpoint {path} ({first_line(error)}) -> "
            "point checkpoint.resume at another step_* directory, or use a new checkpoint.dir")
    set_state_dict(raw_model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])


def apply_settings(optimizer, scheduler, cfg, step):
    """After a resume, this run's optimizer settings win over the checkpoint's (load_state_dict restored those)."""
    for group, weight_decay in zip(optimizer.param_groups, [cfg.optim.weight_decay, 0.0]):
        group.update(betas=(cfg.optim.beta1, cfg.optim.beta2), eps=cfg.optim.eps, weight_decay=weight_decay,
                     initial_lr=cfg.optim.lr, lr=cfg.optim.lr * lr_factor(step, cfg))
    scheduler.base_lrs = [cfg.optim.lr] * len(optimizer.param_groups)


def changed_settings(saved_config, cfg):
    """`key old -> new` for the training settings that differ from the checkpoint's."""
    where_not_a_change = ("out_dir", "export", "data.dir", "checkpoint.", "log.", "dist.")
    return [f"{key} {saved_config[key]} -> {value}" for key, value in config_dict(cfg).items()
            if key in saved_config and saved_config[key] != value and not key.startswith(where_not_a_change)]


def rng_state(use_cuda):
    state = {"torch": torch.get_rng_state()}
    if use_cuda:
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def restore_rng(saved_states, rank, seed, step):
    """Each rank continues its own dropout stream; ranks the old run did not have get a fresh seed."""
    if rank < len(saved_states):
        torch.set_rng_state(saved_states[rank]["torch"].cpu())
        if "cuda" in saved_states[rank] and torch.cuda.is_available():
            torch.cuda.set_rng_state(saved_states[rank]["cuda"].cpu())
    else:
        torch.manual_seed(int(np.random.SeedSequence([seed, rank, step]).generate_state(1)[0]))


# ----------------------------------------------------------------------------- 7. training loop (helpers)

def evaluate(model, val_data, cfg, world_size, rank, device, autocast):
    """Mean loss per label token over the same validation batches every time, each rank computing its share.
    Rank 0 alone would be world_size times slower, and would hang the others if the forward pass itself
    communicates (DDP broadcasts buffers in forward when the model has any; FSDP all-gathers weights) or
    outlasts dist.timeout_s."""
    model.eval()
    loss_sum, label_tokens = torch.zeros((), device=device, dtype=torch.float64), 0
    with torch.no_grad():
        for batch_index in range(cfg.train.eval_batches):
            position = (batch_index * cfg.train.global_batch_size) % len(val_data)
            micro_batches, _, batch_label_tokens, _ = rank_batches(val_data, position, None, cfg, world_size, rank, device)
            label_tokens += batch_label_tokens
            for batch in micro_batches:
                with autocast:
                    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
                loss_sum += token_loss_sum(logits, batch["labels"])
    dist.all_reduce(loss_sum)
    model.train()
    return loss_sum.item() / max(1, label_tokens)


class StepVerdicts:
    """Each step's verdict (its gradient non-finite on some rank, a stop asked of some rank: a tensor on the
    device, all-reduced) as the host learns it, one step late: the update needs no host (optimizer.found_inf),
    so main() reads it (settle) during the next step's first micro-batch, while the GPU runs that, or before a
    log line, validation, a checkpoint and the last step's end. Counts the log interval's skipped steps and the
    label tokens of its updated steps (the loss's divisor)."""

    def __init__(self, max_bad_steps):
        self.max_bad_steps = max_bad_steps
        self.pending = None  # (step, verdict, label tokens) of the step not read yet
        self.bad_in_a_row, self.skipped, self.label_tokens = 0, 0, 0
        self.stop = False  # a rank was asked to stop: every rank learns it at the same step, from the same verdict

    def defer(self, step, verdict, label_tokens):
        self.pending = (step, verdict, label_tokens)

    def settle(self):
        """Read the pending verdict: waits for the GPU to finish that step's gradient and all-reduce."""
        if self.pending is None:
            return
        (step, verdict, label_tokens), self.pending = self.pending, None
        bad_gradient, stop = (value > 0 for value in verdict.tolist())
        self.stop = self.stop or stop
        if not bad_gradient:
            self.bad_in_a_row = 0
            self.label_tokens += label_tokens
            return
        self.bad_in_a_row += 1
        self.skipped += 1
        log0(f"step {step} | non-finite gradient: update skipped ({self.bad_in_a_row} in a row)")
        if self.bad_in_a_row >= self.max_bad_steps:
            die(f"{self.bad_in_a_row} steps in a row had a non-finite gradient (train.max_bad_steps="
                f"{self.max_bad_steps}); no update was made from them and no checkpoint holds them -> "
                "lower optim.lr or raise optim.warmup_steps, and check the data")


def catch_stop_signals():
    """SIGTERM (a scheduler's preemption notice; torchrun passes one on to every worker, then kills them 30 s
    later by default: torch 2.13 reads TORCH_ELASTIC_SHUTDOWN_TIMEOUT, added by pytorch PR #172596, which older
    versions may lack) and SIGINT (Ctrl-C) ask for a clean stop: the list returned gets the signal's name, and
    the training loop stops every rank at the end of the same step (the one after the step whose verdict first
    carries it, where that verdict is read late: StepVerdicts), after a checkpoint. A second signal stops at once."""
    requested = []

    def on_signal(number, frame):
        if requested:
            signal.signal(number, signal.SIG_DFL)
            os.kill(os.getpid(), number)
        requested.append(signal.Signals(number).name)

    for number in (signal.SIGTERM, signal.SIGINT):
        signal.signal(number, on_signal)
    return requested


def open_metrics(out_dir, step):
    """metrics.jsonl, kept across restarts. Records past `step`, the checkpoint this run resumes from, go:
    those steps run again, and would otherwise appear twice."""
    path = out_dir / "metrics.jsonl"
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        if path.exists():
            kept = []
            for line in path.read_text().splitlines():
                try:
                    record = json.loads(line)
                except json.JSONDecodeError:
                    continue  # a line cut short by a crash
                if record.get("kind") == "start" or record.get("step", 0) <= step:
                    kept.append(line + "\n")
            temporary = out_dir / f".metrics-{os.getpid()}.jsonl"
            temporary.write_text("".join(kept))
            os.replace(temporary, path)
        return open(path, "a")
    except OSError as error:
        die(f"cannot write {path} ({error}) -> set out_dir to a writable directory")


def open_metrics_log(cfg, out_dir, step, rank, local_rank):
    """metrics.jsonl and TensorBoard on rank 0, a Prometheus endpoint on every rank: each optional piece that
    is missing says so in one line and the run goes on."""
    metrics_file = on_rank0(open_metrics, out_dir, step, share_result=False)
    tensorboard, prometheus, outputs = None, None, [f"{out_dir / 'metrics.jsonl'}"]
    if cfg.log.tensorboard and rank == 0:
        try:
            from torch.utils.tensorboard import SummaryWriter
            # a resumed run replays the steps after its checkpoint: purge_step hides their first-run events
            tensorboard = SummaryWriter(out_dir / "tensorboard", purge_step=step + 1 if step else None)
            outputs.append(f"TensorBoard {out_dir / 'tensorboard'}")
        except ImportError:
            log0("note: no TensorBoard logs: tensorboard is not installed -> pip install tensorboard, "
                 "or log.tensorboard=false")
    if cfg.log.prometheus_port:
        prometheus = on_all_ranks(start_prometheus, cfg.log.prometheus_port + local_rank)
        if prometheus is None:
            log0("note: no Prometheus endpoint: prometheus_client is not installed -> pip install prometheus_client")
        else:
            outputs.append(f"Prometheus on port {cfg.log.prometheus_port} + local rank, every interface, /metrics")
    log0(f"metrics: {', '.join(outputs)}")
    return MetricsLog(metrics_file, tensorboard, prometheus, rank)


def start_prometheus(port):
    """prometheus_client's HTTP server for this process's gauges, in a thread of its own; None without the
    package. Its own registry: the default one is global, and a second run in one process (the tests) would
    register its gauges twice there."""
    try:
        import prometheus_client
    except ImportError:
        return None
    registry = prometheus_client.CollectorRegistry()
    try:
        server, _ = prometheus_client.start_http_server(port, registry=registry)
    except (OSError, OverflowError) as error:
        die(f"cannot serve Prometheus metrics on port {port} ({first_line(error)}) -> choose another "
            "log.prometheus_port (each process takes it + its local rank), or log.prometheus_port=0 for none")
    return SimpleNamespace(client=prometheus_client, registry=registry, server=server, gauges={})


class MetricsLog:
    """Where each record goes: rank 0 appends it to metrics.jsonl and TensorBoard; every rank sets its
    Prometheus gauges. Any number the record holds is exported, under its own name: a key that is null
    (None) today appears in TensorBoard and Prometheus as soon as it holds a number."""

    def __init__(self, metrics_file, tensorboard, prometheus, rank):
        self.metrics_file, self.tensorboard, self.prometheus, self.rank = metrics_file, tensorboard, prometheus, rank

    def write(self, record):
        if self.metrics_file:
            self.metrics_file.write(json.dumps(record) + "\n")
            self.metrics_file.flush()
        if record["kind"] == "start":
            return
        numbers = {key: value for key, value in record.items()
                   if isinstance(value, (int, float)) and not isinstance(value, bool) and key != "step"}
        if self.tensorboard:
            for key, value in numbers.items():
                self.tensorboard.add_scalar(f"{record['kind']}/{key}", value, record["step"])
        if self.prometheus:
            gauges = self.prometheus.gauges.setdefault(record["kind"], {})
            if record["kind"] == "train":
                numbers["step"] = record["step"]  # last: a scrape that reads step N reads no value older than N's
            for key in gauges.keys() - numbers.keys():  # null this time: NaN rather than an old number
                gauges[key].set(float("nan"))
            for key, value in numbers.items():
                if key not in gauges:
                    gauges[key] = self.prometheus.client.Gauge(
                        f"trainer_{key}", f"metrics.jsonl's {key} ({record['kind']} records)", ["rank"],
                        registry=self.prometheus.registry).labels(rank=str(self.rank))
                gauges[key].set(value)

    def close(self):
        if self.metrics_file:
            self.metrics_file.close()
        if self.tensorboard:
            self.tensorboard.close()
        if self.prometheus:
            self.prometheus.server.shutdown()
            self.prometheus.server.server_close()  # frees the port at once (shutdown alone leaves it bound)


class SpanTimer:
    """The time of one recurring part of a step (building the next batches, waiting for the other ranks),
    summed over a log interval without making the host wait for the GPU. Used as `with timer:` around it.

    On a GPU the host runs ahead, and what counts is what the GPU does meanwhile: two CUDA events on its
    stream time the span as the GPU lives it (from the end of the work queued before the span to the end
    of the work queued in it, idle time included). They are read at the log line, after its wait for the
    GPU, when every recorded event has happened. On a CPU each operation ends before the next one starts,
    so the host's clock tells the same."""

    def __init__(self, device):
        self.on_gpu = device.type == "cuda"
        self.host_s, self.recorded, self.spare = 0.0, [], []

    def __enter__(self):
        if self.on_gpu:
            self.events = self.spare.pop() if self.spare else [torch.cuda.Event(enable_timing=True) for _ in range(2)]
            self.events[0].record()
        else:
            self.started = time.perf_counter()

    def __exit__(self, *exception):
        if self.on_gpu:
            self.events[1].record()
            self.recorded.append(self.events)
        else:
            self.host_s += time.perf_counter() - self.started

    def total_s(self):
        """Seconds since the last call (on a GPU: call it only after waiting for the GPU)."""
        total = self.host_s + sum(start.elapsed_time(end) for start, end in self.recorded) / 1e3
        self.spare += self.recorded  # events are reused: creating two per span and step would cost more
        self.host_s, self.recorded = 0.0, []
        return total


def gather_floats(values, device):
    """Every rank's list of floats, in rank order (one small all_gather; waits for the GPU)."""
    mine = torch.tensor(values, dtype=torch.float64, device=device)
    everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, mine)
    return torch.stack(everyone).tolist()


def gpu_util_reader(device, enabled):
    """A function returning this GPU's utilisation in percent, NVML's own figure: the share of its last
    sample period (between 1/6 s and 1 s by product, says NVML's nvmlDeviceGetUtilizationRates) in which a
    kernel ran, whatever the kernel (a collective waiting for another rank counts as busy). None without a
    GPU, without pynvml (pip install nvidia-ml-py), or where NVML cannot tell (a MIG slice, for one)."""
    if device.type != "cuda" or not enabled:
        return None
    try:
        import pynvml
    except ImportError:
        log0("note: no GPU utilisation: pynvml is not installed -> pip install nvidia-ml-py, or log.gpu_util=false")
        return None
    try:
        pynvml.nvmlInit()
        # By UUID, not by index: CUDA numbers the GPUs CUDA_VISIBLE_DEVICES leaves, in its order (fastest first
        # without CUDA_DEVICE_ORDER=PCI_BUS_ID); NVML numbers all GPUs of the machine by PCI bus.
        handle = pynvml.nvmlDeviceGetHandleByUUID(f"GPU-{torch.cuda.get_device_properties(device).uuid}")
        pynvml.nvmlDeviceGetUtilizationRates(handle)  # where NVML cannot tell, say so now, not at every log line
    except pynvml.NVMLError as error:
        log0(f"note: no GPU utilisation: NVML: {first_line(error)}")
        return None

    def read_gpu_util():
        try:
            return pynvml.nvmlDeviceGetUtilizationRates(handle).gpu
        except pynvml.NVMLError:
            return None

    return read_gpu_util


def log_line(record, max_steps):
    """The console's compact line: each figure only where it exists."""
    loss = "n/a" if record["loss"] is None else f"{record['loss']:.4f}"
    line = (f"step {record['step']}/{max_steps} | loss {loss} | lr {record['lr']:.2e} | grad {record['grad_norm']:.3f} "
            f"| {record['tokens_per_sec'] / 1e3:.1f}k tok/s")
    if record["mfu"] is not None:
        line += f" | MFU {100 * record['mfu']:.1f}%"
    if record["mem_alloc_gib"] is not None:
        line += (f" | mem {record['mem_alloc_gib']:.1f}/{record['mem_reserved_gib']:.1f}/"
                 f"{record['mem_peak_gib']:.1f} GiB alloc/res/peak")
    if record["alloc_retries"]:
        line += f" | alloc retries {record['alloc_retries']}"
    if record["gpu_util"] is not None:
        line += f" | gpu {record['gpu_util']:.0f}%"
    if record["comm_exposed_ms"] is not None:
        line += f" | comm exposed {record['comm_exposed_ms']:.1f} ms/step"
    if record["allreduce_p50_ms"] is not None:
        line += f" | all-reduce p50/p95 {record['allreduce_p50_ms']:.1f}/{record['allreduce_p95_ms']:.1f} ms"
    line += f" | data {100 * record['data_wait_frac']:.1f}%"
    if record["step_time_skew"] is not None:
        line += f" | skew {record['step_time_skew']:.2f} (rank {record['slowest_rank']})"
    return line + f" | ETA {format_seconds(record['eta_s'])}"


# Dense bf16 tensor-core peak per GPU (no sparsity), TFLOP/s, from NVIDIA's datasheets, keyed by the exact name
# torch.cuda.get_device_name() reports. Exact names only: a substring match reads "NVIDIA L40" as an L4 and
# an H100 NVL as an SXM part. For any other GPU set log.peak_tflops.
PEAK_BF16_TFLOPS = {
    "NVIDIA H200": 989,  # the SXM part; our H200 machines report this name
    "NVIDIA H100 80GB HBM3": 989,  # SXM5
    "NVIDIA H100 PCIe": 756,
    "NVIDIA A100-SXM4-80GB": 312,
    "NVIDIA A100-SXM4-40GB": 312,
    "NVIDIA A100 80GB PCIe": 312,
    "NVIDIA A100-PCIE-40GB": 312,
}


def peak_flops_per_gpu(device, peak_tflops):
    """FLOP/s that 100% MFU stands for, or None (no MFU shown) on CPU and unknown GPUs."""
    if device.type != "cuda":
        return None
    if peak_tflops:
        return peak_tflops * 1e12
    name = torch.cuda.get_device_name(device)
    if name not in PEAK_BF16_TFLOPS:
        log0(f"note: no MFU: the bf16 peak of '{name}' is not in PEAK_BF16_TFLOPS -> set log.peak_tflops")
        return None
    return PEAK_BF16_TFLOPS[name] * 1e12


def format_seconds(seconds):
    minutes, seconds = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m" if hours else f"{minutes}m{seconds:02d}s"


def gather_full_model(raw_model, cfg, task, padded_vocab_size, special, device):
    """The whole trained model on rank 0, in CPU memory (None on the other ranks): every rank sends its shards
    one tensor at a time, so no rank holds the full model on its GPU."""
    full_state = get_model_state_dict(raw_model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if dist.get_rank() != 0:
        return None
    with torch.device("meta"):
        full_model, _ = build_model(cfg, task, padded_vocab_size, special, device, shapes_only=True)
    full_model.load_state_dict(full_state, assign=True)
    full_model.tie_weights()  # assign=True gives the input embedding and a tied output layer separate tensors
    for name, buffer in raw_model.named_buffers():  # non-persistent buffers are in no state dict
        owner, _, buffer_name = name.rpartition(".")
        setattr(full_model.get_submodule(owner), buffer_name, buffer.cpu())
    return full_model


def export_final(raw_model, data_dir, meta, final_dir, task, cfg, device):
    """save_pretrained + the tokenizer: loadable with AutoModelFor...from_pretrained(final_dir)."""
    transformers_logging.disable_progress_bar()  # a progress bar per one-file save is noise in a log
    tokenizer_core = Tokenizer.from_file(str(data_dir / meta["tokenizer_file"]))
    names = {key: tokenizer_core.id_to_token(token_id) for key, token_id in meta["special_tokens"].items()}
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer_core, eos_token=names["eot"], bos_token=names["eot"], pad_token=names["pad"],
        mask_token=names["mask"], cls_token=names["cls"], sep_token=names["sep"],
    )
    if isinstance(raw_model.get_input_embeddings(), TieredEmbedding):  # tiered: one table in token id order again
        raw_model.set_input_embeddings(raw_model.get_input_embeddings().merged().to(device))
    raw_model.config.use_cache = True  # off for training (build_model); generation wants it back
    if raw_model.config._attn_implementation == "sdpa_causal":  # ours ignores padding: not for other users
        raw_model.set_attn_implementation("sdpa")
    raw_model.save_pretrained(final_dir)
    tokenizer.save_pretrained(final_dir)
    print(f"exported the model and tokenizer to {final_dir}", flush=True)
    if task == "causal" and cfg.log.sample_prompt:
        raw_model.eval()
        prompt = torch.tensor([tokenizer.encode(cfg.log.sample_prompt)], device=device)
        new_tokens = min(cfg.log.sample_tokens, raw_model.config.max_position_embeddings - prompt.shape[1])
        with torch.no_grad():
            generated = raw_model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=new_tokens,
                                           do_sample=True, top_k=40,
                                           pad_token_id=meta["special_tokens"]["pad"])
        print("sample:\n" + tokenizer.decode(generated[0].tolist(), skip_special_tokens=True), flush=True)


def report_lost_ranks(error):
    """A collective failed (a rank stopped answering for dist.timeout_s, or died): one line saying which
    timeout fired and, where the others can tell, which ranks stopped answering."""
    rank, text = dist.get_rank(), first_line(error)
    if "timed out" not in text.lower() and "timeout" not in text.lower():
        print(f"error: rank {rank} lost contact with another rank ({text}) -> look above for the first rank that "
              "failed; launch.sh restarts the job from the last checkpoint (MAX_RESTARTS)", file=sys.stderr, flush=True)
        return
    silent = "unknown"
    try:  # the ranks that timed out say so in torchrun's store; the others are the ones that stopped answering
        store = dist.distributed_c10d._get_default_store()
        store.set(f"timed_out/{rank}", "1")
        time.sleep(3)
        silent = [other for other in range(dist.get_world_size()) if not store.check([f"timed_out/{other}"])] or "none"
    except Exception:  # the store went with the failure: say nothing about ranks rather than something wrong
        pass
    print(f"error: rank {rank}: a collective waited longer than dist.timeout_s; ranks that stopped answering: "
          f"{silent} -> look at "
          "their logs (a hang, a deadlock, a dead node); raise dist.timeout_s if they are only slow",
          file=sys.stderr, flush=True)


if __name__ == "__main__":
    try:
        try:
            main()
            # Not at the end of main(): seen once (gdb on a rank hung at exit, gloo), DDP's reducer, freed with
            # main()'s objects after the group had been destroyed, ran the group's destructor itself, holding
            # Python's GIL while it waited for a gloo thread that was waiting for the GIL. Freed first (gc for
            # reference cycles), while the group is still registered, the reducer no longer holds its last reference.
            gc.collect()
            if dist.is_initialized():  # not with --check
                dist.destroy_process_group()
        finally:
            # leaving: torchrun's SIGTERM must end this process at once again (seen: a rank whose group
            # teardown waited for a rank already gone kept running in our stop-at-step-end handler until
            # torchrun's SIGKILL 30 s later)
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
    except UserError as error:
        if int(os.environ.get("RANK", "0")) == 0:  # every rank raised the same error; rank 0 says it once
            print(f"error: {error}", file=sys.stderr, flush=True)
        if dist.is_initialized():
            dist.destroy_process_group()
        sys.exit(2)
    except (dist.DistError, RuntimeError) as error:
        # gloo reports a timeout or a lost peer as a plain RuntimeError; anything else is a bug: traceback
        if not dist.is_initialized() or not any(word in str(error) for word in ("gloo", "NCCL", "Timed out", "Connection")):
            raise
        report_lost_ranks(error)
        sys.exit(1)
