"""Train a transformers model on one GPU, many GPUs or many machines with DistributedDataParallel.

    bash launch.sh                                   # every GPU here (2 CPU processes without GPUs)
    bash launch.sh train_ddp.py model.type=vit       # a ViT on images (the digits by default)
    torchrun --nproc_per_node 8 train_ddp.py train.max_steps=1000 optim.lr=3e-4

Read down to the line "below this, reference machinery you may skip": that is the lesson (main(),
train_step(), DDP and two reducers of ours that show what it does, then distributed init, the batch
plan, the checkpoint, validation). Optional parts stand in blocks at the end with their tagged lines
(# MLM, # images, # metrics, # tiered, # fp8, # FAULT); a # DDP line is this file's alone in a
definition train_fsdp.py otherwise shares word for word.
"""

import contextlib
import difflib
import fcntl
import functools
import gc
import json
import math
import operator
import os
import pickle
import re
import secrets
import shutil
import signal
import socket
import sys
import tempfile
import time
import zlib
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pyarrow as pa
import pyarrow.compute  # noqa: F401  (pa.compute)
import torch
import torch.distributed as dist
import torch.nn.functional as F
import transformers
import yaml
from safetensors import SafetensorError
from tokenizers import Tokenizer
from torch.nn.parallel import DistributedDataParallel as DDP
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerFast


@dataclass
class Run:
    """Where the run is: main() moves it on after each step, a checkpoint saves and restores it."""
    step: int = 0  # optimizer steps done
    position: int = 0  # samples of the shuffled stream trained on: the next step starts at this one
    tokens_seen: int = 0  # input tokens trained on
    bad_in_a_row: int = 0  # the latest steps skipped, one after another, for a non-finite gradient


@dataclass(frozen=True)
class Setup:
    """What stays fixed once main() has built the run; helpers read it (its timers still count)."""
    cfg: SimpleNamespace  # the settings: DEFAULTS, config.yaml, then the command line
    device: torch.device  # this rank's GPU, or the CPU
    autocast: torch.autocast  # the forward's mixed precision (disabled in fp32)
    raw_model: torch.nn.Module  # the model itself: what the optimizer and checkpoints hold
    train_data: object  # the train split's samples by index (ArrowTokens, ArrowImages)
    meta: dict  # the data's meta.json: vocabulary, fingerprint, classes
    parallel: SimpleNamespace  # sync(last) around each micro-batch: how gradients reach the ranks
    loss_of: object  # the summed loss of (logits, labels), compiled or not
    data_wait: "SpanTimer"  # the device's idle time while the host builds batches
    sync_wait: "SpanTimer"  # this rank's wait for the slowest at each step's verdict
    stop_requested: list  # the stop signal's name and time, once one came (catch_stop_signals)
    peak_flops: float | None  # FLOP/s at 100% MFU, None where unknown
    metrics: object  # metrics.jsonl, open for appending on rank 0 (None on the others)
    lock: object  # rank 0's lock on checkpoint.dir: an open file, the lock lasts as long as it
    exporters: SimpleNamespace = None  # TensorBoard, Prometheus and NVML of the metrics block


def main():
    # --------------------------------------------------------------------------------- 1. config
    use_cuda = torch.cuda.is_available()
    cfg = load_config([arg for arg in sys.argv[1:] if arg != "--check"], use_cuda)
    world_size, rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
    micro_batches = check_config(cfg, world_size)
    reader = ArrowTokens  # the task and the reader of its data: a causal LM on text
    reader = masked_lm_reader(cfg, reader)  # MLM
    reader = image_reader(cfg, reader)  # images
    if "--check" in sys.argv:  # launch.sh validates the config before it starts any process
        for key in ["data.dir", "checkpoint.dir", "checkpoint.resume", "out_dir", "dist.timeout_s"]:
            print(f"{key}={config_dict(cfg)[key]}")
        print(f"data.kind={reader.kind}")  # what launch.sh prepares where data.dir has none
        return

    # ----------------------------------------------------------------------- 2. distributed init
    device = init_distributed(cfg, world_size, rank, use_cuda)
    precision = choose_precision(cfg.train.precision, device)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16,
             "fp8": torch.bfloat16}.get(precision)  # bf16 autocast around float8 matmuls
    autocast = torch.autocast(device.type, dtype=dtype, enabled=dtype is not None)
    torch.set_float32_matmul_precision("high")  # let fp32 matmuls use TF32 tensor cores
    log0(f"world size {world_size} ({dist.get_backend()}, {device.type}), precision {precision}, "
         f"global batch {cfg.train.global_batch_size} samples = {world_size} ranks x "
         f"{micro_batches} micro-batches x {cfg.train.micro_batch_size} samples")

    # ----------------------------------------------------------------------------------- 3. data
    data_dir = Path(cfg.data.dir)
    meta = read_meta(data_dir, reader)
    train_data, val_data = (reader(data_dir, meta, split, cfg.train.seq_len)
                            for split in ("train", "val"))
    log0(f"data {data_dir}: {reader.task} samples train {len(train_data):,} val {len(val_data):,} "
         f"({train_data.summary})")

    # ---------------------------------------------------------------------------------- 4. model
    use_compile = cfg.train.compile == "true" or (cfg.train.compile == "auto" and use_cuda)
    torch.manual_seed(cfg.train.seed)  # the same initial weights on every rank
    raw_model, attention = build_model(cfg, reader, meta, device)
    tier_embedding(raw_model, data_dir, meta, cfg, precision, device)  # tiered
    train_in_fp8(raw_model, cfg, device, use_compile, sharded=False)  # fp8
    raw_model.to(device)
    residual_in_bf16(raw_model, dtype)  # in a bf16 step, the residual stream in bf16 too
    flops_of = reader.flops_counter(raw_model, attention, cfg)  # per step, for MFU
    log0(f"model {raw_model.config.model_type} ({reader.task}), "
         f"{sum(p.numel() for p in raw_model.parameters()) / 1e6:.1f}M parameters, attention "
         f"{attention}, {train_data.model_summary(raw_model.config)}")
    # dropout differs per rank on purpose (other data); seeded from (seed, rank): runs repeat
    torch.manual_seed(int(np.random.SeedSequence([cfg.train.seed, rank]).generate_state(1)[0]))

    # ------------------------------------------------------------------------------ 5. optimizer
    optimizer = make_optimizer(raw_model, cfg)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, cfg))
    scaler = torch.amp.GradScaler(device.type, enabled=precision == "fp16")  # fp16 underflows else
    predicted = memory_prediction(raw_model, device)

    # ----------------------------------------------------------------------------- 6. checkpoint
    ckpt_dir = Path(cfg.checkpoint.dir)
    # one run per directory: rank 0 holds a lock on it before it looks at any checkpoint
    lock = on_rank0(hold_directory, ckpt_dir, cfg.checkpoint.every > 0, share_result=False)
    if world_size > 1 and cfg.checkpoint.every > 0:  # every rank must see what rank 0 writes
        check_shared_directory(ckpt_dir)
    # rank 0 alone picks it: network filesystems cache listings, so ranks could see other files
    resume_dir = on_rank0(find_resume_checkpoint, ckpt_dir, cfg.checkpoint.resume)
    run = Run() if resume_dir is None else resume(resume_dir, raw_model, optimizer, scheduler,
                                                  scaler, cfg, meta)

    # -------------------------------------------------------------------------- 7. training loop
    # the loss compiled on its own: the fp32 upcast, log-softmax and gather fuse
    loss_of = torch.compile(token_loss_sum) if use_compile else token_loss_sum
    loss_of = masked_lm_loss(loss_of, cfg, reader)  # MLM: one graph for every length
    model, parallel = wrap_model(raw_model, cfg, device, use_compile)
    setup = Setup(cfg=cfg, device=device, autocast=autocast, raw_model=raw_model, meta=meta,
                  train_data=train_data, parallel=parallel, loss_of=loss_of,
                  data_wait=SpanTimer(device), sync_wait=SpanTimer(device), stop_requested=[],
                  peak_flops=peak_flops_per_gpu(device, cfg.log.peak_tflops),
                  metrics=on_rank0(open_metrics, Path(cfg.out_dir), run.step, share_result=False),
                  exporters=start_exporters(cfg, run.step, device),  # metrics
                  lock=lock)
    write_metrics(setup, {"kind": "start", "step": run.step, "world_size": world_size,
                          "time": time.time()})
    catch_stop_signals(setup.stop_requested)  # SIGTERM, SIGINT: finish the step, save, stop
    if run.step == 0:
        log0("step 0 | validation (the first steps include compilation)")
    if run.step in (0, cfg.train.max_steps):  # at max_steps: a stop came before its validation
        validate(model, val_data, setup, run.step)
    interval, batches = Interval(device), step_batches(setup, run.position)
    memory_step = min(run.step + 2, cfg.train.max_steps)  # AdamW makes its state in the first step
    while run.step < cfg.train.max_steps:
        result, batches = train_step(model, batches, optimizer, scheduler, scaler, setup, run)
        run.step, run.tokens_seen = run.step + 1, run.tokens_seen + result.input_tokens
        run.position += cfg.train.global_batch_size  # the data position: where the next step starts
        run.bad_in_a_row = result.bad_in_a_row
        interval.add_step(result, flops_of)
        last = run.step == cfg.train.max_steps
        if run.step == memory_step:
            report_memory(setup, run.step, optimizer, predicted)
        if run.step % cfg.log.every == 0 or last or result.stop:
            log_interval(interval, setup, run, result)
        validating = (run.step % cfg.train.eval_every == 0 or last) and not result.stop
        saving = cfg.checkpoint.every and (run.step % cfg.checkpoint.every == 0 or last
                                           or result.stop)
        with interval.paused(validating or saving):  # not training throughput
            if validating:
                validate(model, val_data, setup, run.step)
            if saving:
                save_checkpoint(setup, run, optimizer, scheduler, scaler)
        if result.stop:
            raise Stopped(stop_message(cfg, run.step))

    if cfg.export and not weights_are_finite(raw_model):
        die("the trained weights are not finite: not exported -> lower optim.lr")
    if setup.metrics:
        setup.metrics.close()
    stop_exporters(setup.exporters)  # metrics
    if rank == 0 and cfg.export:
        shutil.rmtree(Path(cfg.out_dir) / "final", ignore_errors=True)  # no earlier export's files
        reader.export(raw_model, data_dir, meta, Path(cfg.out_dir) / "final", cfg, device)
    dist.barrier()  # ranks leave together: one that leaves during rank 0's export can abort at exit


def train_step(model, batches, optimizer, scheduler, scaler, setup, run):
    """One optimizer step on this rank's micro-batches: the log's figures, next step's batches."""
    micro_batches, input_tokens, label_tokens, lengths = batches
    optimizer.zero_grad(set_to_none=True)  # here, not after the update: the memory report uses them
    # The gradient must be that of the mean loss over every label token of the global batch, however
    # it is split: each micro-batch adds sum(loss) / (label tokens of the global batch), counted on
    # the host from the shared plan. The reduction averages over ranks: the world_size undoes that.
    loss_scale = dist.get_world_size() / max(1, label_tokens)
    loss_sum = torch.zeros((), device=setup.device, dtype=torch.float64)
    for index, batch in enumerate(micro_batches):
        with setup.parallel.sync(last=index == len(micro_batches) - 1):  # only the last reduces
            with setup.autocast:
                logits = model(**batch["inputs"]).logits
            micro_loss = setup.loss_of(logits, batch["labels"])
            micro_loss = nan_fault(micro_loss, run.step + 1)  # FAULT
            scaler.scale(micro_loss * loss_scale).backward()
        del logits  # free now, not after the next forward
        loss_sum += micro_loss.detach()
    with setup.data_wait:  # the next step's batches, built while the GPU runs this backward
        fault_point(run.step + 1)  # FAULT
        next_batches = step_batches(setup, run.position + setup.cfg.train.global_batch_size)
    setup.parallel.finish()  # each gradient is now the mean over the ranks
    scaler.unscale_(optimizer)  # clip the true gradient, not the fp16-scaled one
    grad_norm = torch.nn.utils.clip_grad_norm_(setup.raw_model.parameters(),
                                               setup.cfg.optim.grad_clip or float("inf"))
    bad, stop, in_a_row = step_verdict(grad_norm, setup, run)  # every rank decides alike
    if not bad:  # a non-finite gradient: no update on any rank; the data and schedule move on
        optimizer.step()
    end_tiered_step(setup.raw_model, optimizer, bad)  # tiered
    scaler.update()
    lr = optimizer.param_groups[0]["lr"]  # the rate this step used: scheduler.step() sets the next
    scheduler.step()
    return SimpleNamespace(loss_sum=loss_sum, grad_norm=grad_norm, lr=lr, bad=bad, stop=stop,
                           bad_in_a_row=in_a_row, input_tokens=input_tokens,
                           label_tokens=label_tokens, lengths=lengths), next_batches


def step_verdict(grad_norm, setup, run):
    """Is the gradient non-finite, was some rank asked to stop (a signal may reach one rank only)?
    One all-reduce tells every rank; returns both and the bad steps in a row with this one."""
    # filled on the device: no copy from the host
    verdict = torch.full((2,), float(bool(setup.stop_requested)), device=setup.device)
    verdict[0] = grad_norm.isfinite().logical_not()
    with setup.sync_wait:  # how long this rank waits here for the slowest: step_time_skew
        dist.all_reduce(verdict, op=dist.ReduceOp.MAX)
    bad, stop = (value > 0 for value in verdict.tolist())  # the host waits here for the GPU
    in_a_row = run.bad_in_a_row + 1 if bad else 0
    if bad:
        log0(f"step {run.step + 1} | non-finite gradient: update skipped ({in_a_row} in a row)")
    if in_a_row >= setup.cfg.train.max_bad_steps:
        die(f"{in_a_row} steps in a row had a non-finite gradient (train.max_bad_steps="
            f"{setup.cfg.train.max_bad_steps}) -> lower optim.lr or raise optim.warmup_steps")
    return bad, stop, in_a_row


# ----------------------------------------------------------------------------- the parallelism

def wrap_model(raw_model, cfg, device, use_compile):
    """The model each step calls, and how gradients reach every rank (`parallel.sync`, `.finish`):
    DDP, InlineReducer or NaiveReducer (dist.reducer); one process needs none, and DDP would only
    split its compiled graph."""
    nothing = SimpleNamespace(sync=lambda last: contextlib.nullcontext(), finish=lambda: None)
    if dist.get_world_size() == 1:
        return torch.compile(raw_model) if use_compile else raw_model, nothing
    model, hook, inline = raw_model, None, cfg.dist.reducer == "inline"
    if cfg.dist.reducer == "torch":
        if use_compile and cfg.dist.bucket_mb < 1:
            die(f"dist.bucket_mb={cfg.dist.bucket_mb}: torch.compile's DDPOptimizer needs 1 MiB or "
                "more -> give 1 or more, or use dist.reducer=inline or train.compile=false")
        # broadcast_buffers=False: buffers are constants built alike on every rank: no collective
        model = ddp = DDP(raw_model, device_ids=[device.index] if device.type == "cuda" else None,
                          bucket_cap_mb=cfg.dist.bucket_mb, gradient_as_bucket_view=True,
                          broadcast_buffers=False)
        # no_sync: accumulate locally; DDP averages in the last backward, overlapped with it
        parallel = SimpleNamespace(finish=lambda: None, sync=lambda last: (
            contextlib.nullcontext() if last else ddp.no_sync()))
        hook = bf16_allreduce_hook if cfg.dist.grad_compression == "bf16" else None
    else:
        parallel = InlineReducer(raw_model, cfg) if inline else NaiveReducer(raw_model)
    hook = timed(parallel, hook)  # metrics
    if hook is not None:  # DDP calls it for each bucket in place of its own all-reduce
        ddp.register_comm_hook(None, hook)
    if use_compile and inline:
        # block by block: one compiled graph's gradients all appear at its end, overlapping nothing
        for block in repeated_blocks(raw_model) or [raw_model]:
            block.compile()
    # Dynamo splits DDP's graph at its buckets (DDPOptimizer): all-reduces overlap the backward
    return torch.compile(model) if use_compile and not inline else model, parallel


class NaiveReducer:
    """Data parallelism at its plainest (dist.reducer=naive): after the last backward, all-reduce
    every gradient, wait, divide. Nothing overlaps backward; InlineReducer's buckets do."""

    def __init__(self, model):
        self.params = [p for p in model.parameters() if p.requires_grad]
        # rank 0's weights on every rank, as DDP makes sure: else ranks would drift apart, silently
        for tensor in [*model.parameters(), *model.buffers()]:
            dist.broadcast(tensor.detach(), src=0)

    def sync(self, last):
        return contextlib.nullcontext()  # backward only accumulates; finish() communicates

    def finish(self):
        for param in self.params:  # every rank all-reduces every gradient, used or not
            param.grad = param.grad if param.grad is not None else torch.zeros_like(param)
        self.wait([self.all_reduce(param.grad) for param in self.params])  # all of it exposed
        for param in self.params:
            param.grad.div_(dist.get_world_size())

    def all_reduce(self, flat):  # starts the sum over the ranks, in place, and returns at once
        return dist.all_reduce(flat, async_op=True)

    def wait(self, works):
        # orders the sum before the optimizer reads it: the compute stream waits, or gloo's host
        for work in works:
            work.wait()


class InlineReducer(NaiveReducer):
    """What DDP does for you, in plain sight (dist.reducer=inline): parameters are grouped into
    buckets of dist.bucket_mb in reverse registration order (about backward's); in the step's last
    backward a bucket's all-reduce starts once all its gradients are there, while backward goes on.
    finish() waits, divides by the world size and hands the means to the optimizer as .grad."""

    def __init__(self, model, cfg):
        super().__init__(model)  # self.params, and rank 0's weights on every rank
        self.wire_dtype = torch.bfloat16 if cfg.dist.grad_compression == "bf16" else torch.float32
        self.buckets, filled = [[]], 0
        for param in reversed(self.params):
            if filled >= cfg.dist.bucket_mb * 2**20:  # DDP's rule: a bucket holds >= bucket_mb
                self.buckets.append([])
                filled = 0
            self.buckets[-1].append(param)
            filled += param.numel() * param.element_size()
            # runs once this backward's gradient is in param.grad (a tied weight: once, the sum)
            param.register_post_accumulate_grad_hook(
                functools.partial(self.gradient_ready, len(self.buckets) - 1))
        self.reduce_in_backward = False  # set by sync(): true on the step's last micro-batch
        self.missing = [len(bucket) for bucket in self.buckets]  # gradients each bucket waits for
        self.in_flight = []  # (work, flat bucket) of the buckets started this step, in bucket order

    def sync(self, last):
        self.reduce_in_backward = last
        return contextlib.nullcontext()

    def gradient_ready(self, bucket_index, param):
        if not self.reduce_in_backward:
            return  # accumulation: the gradient stays local until the step's last micro-batch
        self.missing[bucket_index] -= 1
        # Buckets start in bucket order on every rank, as DDP's do: ranks match collectives by their
        # order, so a rank that started bucket 3 before bucket 2 would add its bucket 3 to another
        # rank's bucket 2.
        while len(self.in_flight) < len(self.buckets) and self.missing[len(self.in_flight)] == 0:
            self.launch(len(self.in_flight))

    def launch(self, bucket_index):
        bucket = self.buckets[bucket_index]
        # A parameter this rank's backward did not reach adds zeros: a rank that skipped the bucket
        # would leave the others waiting in it. One no rank reached gets a zero gradient.
        flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).flatten()
                          for p in bucket]).to(self.wire_dtype)
        for param in bucket:
            param.grad = None  # the bucket holds it now: one copy of the gradients, not two
        self.in_flight.append((self.all_reduce(flat), flat))

    def finish(self):
        for bucket_index in range(len(self.in_flight), len(self.buckets)):
            self.launch(bucket_index)  # buckets still missing a gradient
        self.wait([work for work, _ in self.in_flight])  # the communication backward did not hide
        for bucket, (_, flat) in zip(self.buckets, self.in_flight):
            averaged = flat.float().div_(dist.get_world_size())  # bf16 travelled; divide in fp32
            for param, grad in zip(bucket, averaged.split([p.numel() for p in bucket])):
                param.grad = grad.view_as(param)  # a view of the bucket, as DDP's bucket views
        self.missing, self.in_flight = [len(bucket) for bucket in self.buckets], []


def bf16_allreduce_hook(process_group, bucket):
    """DDP's comm hook for dist.grad_compression=bf16: a bucket travels in bf16, its sum is divided
    in fp32. Not torch's bf16_compress_hook: that divides in bf16, and DDP takes a hook of that name
    only from a torch built with CUDA and NCCL."""
    buffer = bucket.buffer()
    work = dist.all_reduce(buffer.to(torch.bfloat16), group=process_group, async_op=True)
    return work.get_future().then(
        lambda future: buffer.copy_(future.value()[0]).div_(dist.get_world_size(process_group)))


# -------------------------------------------------------------------- distributed init (section 2)

def init_distributed(cfg, world_size, rank, use_cuda):
    """One process group for the run (NCCL on GPUs, gloo on CPUs); returns this rank's device."""
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if use_cuda else \
        torch.device("cpu")
    if use_cuda:  # without it every rank would build its NCCL communicator on GPU 0
        torch.cuda.set_device(device)
    backend = cfg.dist.backend if cfg.dist.backend != "auto" else ("nccl" if use_cuda else "gloo")
    timeout = timedelta(seconds=cfg.dist.timeout_s)
    if "RANK" not in os.environ:  # no torchrun: a group of one, so that the code has one path
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1,
                                timeout=timeout)
        return device
    # torchrun's store outlives restarts: a restarted rank could read an address a dead rank left
    # there. On one node every rank knows the attempt number, so each attempt gets keys of its own.
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"  # torchrun hosts it
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size,
                          is_master=rank == 0 and not agent_store, timeout=timeout)
    if int(os.environ.get("LOCAL_WORLD_SIZE", world_size)) == world_size:
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        store = dist.PrefixStore(f"attempt_{attempt}", store)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout,
                            device_id=device if use_cuda else None)
    return device


def on_rank0(function, *args, share_result=True):
    """Run `function` on rank 0 alone and give every rank its result (share_result=False: None);
    if it fails, every rank stops with its message, not waiting for rank 0 until the timeout."""
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
    """Run `function` on every rank; if it fails on any, every rank stops and rank 0 prints that
    rank's message (a file that only one node cannot read would otherwise be reported by nobody)."""
    result, error = None, None
    try:
        result = function(*args)
    except UserError as failure:
        error = str(failure)
    errors = [None] * dist.get_world_size()
    dist.all_gather_object(errors, error)
    failed = [(failed_rank, message) for failed_rank, message in enumerate(errors) if message]
    if failed:
        die(failed[0][1] if dist.get_world_size() == 1 else f"rank {failed[0][0]}: {failed[0][1]}")
    return result


# ---------------------------------------------------------------------- the batch plan (section 3)
# ArrowTokens, the causal reader below the line, plans a batch with global_batch() and deal()

_permutation_cache = {}


def epoch_permutation(seed, epoch, num_samples):
    """The sample order of one epoch: a function of (seed, epoch) alone, not of rank or world."""
    key = (seed, epoch, num_samples)
    if key not in _permutation_cache:
        _permutation_cache.clear()  # keep one epoch; a batch across two recomputes the previous
        _permutation_cache[key] = np.random.default_rng([seed, epoch]).permutation(num_samples)
    return _permutation_cache[key]


def global_batch(position, global_batch_size, num_samples, seed):
    """Sample ids and epochs of the global batch at `position`, counted over all ranks: a resumed
    run sees the same samples on any number of ranks. seed=None reads in order (validation)."""
    epochs, indices = np.divmod(np.arange(position, position + global_batch_size), num_samples)
    sample_ids = indices if seed is None else np.array(
        [epoch_permutation(seed, e, num_samples)[i] for e, i in zip(epochs, indices)])
    return sample_ids, epochs


def deal(sample_ids, epochs, micro_batch_size, world_size):
    """Dealt round-robin: plan[rank] = [(sample_ids, epochs), ...] in accumulation order."""
    micro_batches = [(sample_ids[k:k + micro_batch_size], epochs[k:k + micro_batch_size])
                     for k in range(0, len(sample_ids), micro_batch_size)]
    return [micro_batches[rank::world_size] for rank in range(world_size)]


def step_batches(setup, position):
    """This rank's micro-batches of the training step that starts at sample `position`."""
    batches = rank_batches(setup.train_data, position, setup.cfg.train.seed, setup.cfg,
                           dist.get_world_size(), dist.get_rank(), setup.device)
    stage_tiered(setup.raw_model, setup.train_data, position, batches, setup.cfg)  # tiered
    return batches


def rank_batches(split_data, position, shuffle_seed, cfg, world_size, rank, device):
    """This rank's micro-batches at sample `position`, and what every rank computes alike from the
    plan: the global batch's input and label token counts, each sample's length (for FLOPs)."""
    plan = split_data.plan(position, shuffle_seed, cfg, world_size)
    lengths = [[split_data.length(int(i)) for i in ids]
               for rank_plan in plan for ids, _ in rank_plan]
    micro_batches = [split_data.micro_batch(ids, epochs, cfg, device) for ids, epochs in plan[rank]]
    label_tokens = split_data.label_count(plan, lengths, cfg)
    return micro_batches, sum(map(sum, lengths)), label_tokens, lengths


def on_device(batch, device):
    """A micro-batch on the device: the model's inputs and labels, and the input ids on the host."""
    host_input_ids = batch["input_ids"]  # kept on the host: what it holds is known without a wait
    if device.type == "cuda":  # a copy from pinned memory does not make the host wait. Contiguous
        # first: a pinned view keeps its strides, and torch 2.11 copies those via pageable memory
        batch = {key: None if value is None else value.contiguous().pin_memory().to(
            device, non_blocking=True) for key, value in batch.items()}
    labels = batch.pop("labels")
    return {"inputs": batch, "labels": labels, "host_input_ids": host_input_ids}


# ---------------------------------------------------------------------- the checkpoint (section 6)

def save_checkpoint(setup, run, optimizer, scheduler, scaler):
    """Rank 0 writes the whole state: model, optimizer and train_state()."""
    state, ckpt_dir = train_state(setup, run, scheduler, scaler), Path(setup.cfg.checkpoint.dir)
    on_rank0(write_checkpoint, ckpt_dir, run.step, setup.cfg.checkpoint.keep, setup.raw_model,
             optimizer, state)
    log0(f"checkpoint {step_dir(ckpt_dir, run.step)} written")


def train_state(setup, run, scheduler, scaler):
    """All a run needs to go on exactly, beside the weights and the optimizer; collective."""
    if not weights_are_finite(setup.raw_model):  # skipped steps keep this from happening
        die(f"the weights are not finite at step {run.step}: not saved -> lower optim.lr")
    cuda = {"cuda": torch.cuda.get_rng_state()} if torch.cuda.is_available() else {}
    rng_states = [None] * dist.get_world_size()
    dist.all_gather_object(rng_states, {"torch": torch.get_rng_state(), **cuda})
    return {"step": run.step, "samples_seen": run.position, "rng": rng_states,
            "tokens_seen": run.tokens_seen, "config": config_dict(setup.cfg),
            "scheduler": scheduler.state_dict(), "scaler": scaler.state_dict(),
            "data_fingerprint": setup.meta.get("fingerprint"), "world_size": dist.get_world_size(),
            "classes": setup.meta.get("classes"),  # images
            "vocab_size": setup.meta.get("vocab_size")}


def write_checkpoint(ckpt_dir, step, keep, raw_model, optimizer, state):
    """To a temporary directory, then renamed: a crash mid-write leaves nothing resume picks."""
    final = step_dir(ckpt_dir, step)
    temporary = ckpt_dir / f".tmp-{final.name}-{os.getpid()}"
    parts = [("model.pt", raw_model.state_dict()), ("optimizer.pt", optimizer.state_dict()),
             ("train_state.pt", state)]
    try:
        temporary.mkdir(parents=True, exist_ok=True)
        for name, part in parts:
            with open(temporary / name, "wb") as file:
                torch.save(part, file)
                file.flush()
                os.fsync(file.fileno())  # the rename below must not reach the disk before the data
            save_fault(step)  # FAULT
        (temporary / "config.yaml").write_text(yaml.safe_dump(state["config"], sort_keys=False))
        write_checksums(temporary, ["model.pt", "optimizer.pt", "train_state.pt"])
        publish(temporary, final, keep)
    except (OSError, RuntimeError) as error:  # torch.save says "disk full" as a RuntimeError
        shutil.rmtree(temporary, ignore_errors=True)
        die(cannot_write(ckpt_dir, error, sum(tensor_bytes(part) for _, part in parts)))


def publish(temporary, final, keep):
    """Rename into place, point `latest` at it, make both durable, then delete all but `keep`."""
    fsync_dir(temporary)
    if final.exists():  # an incomplete leftover: resume refuses dirs with newer checkpoints
        shutil.rmtree(final)
    os.rename(temporary, final)
    pointer = final.parent / f".latest-{os.getpid()}"
    with open(pointer, "w") as file:
        file.write(final.name)
        file.flush()
        os.fsync(file.fileno())  # the rename below must not reach the disk before the name
    os.replace(pointer, final.parent / "latest")
    fsync_dir(final.parent)  # the new checkpoint and pointer are on disk before any old one goes
    for old in complete_checkpoints(final.parent)[:-keep]:
        shutil.rmtree(old)


def resume(resume_dir, raw_model, optimizer, scheduler, scaler, cfg, meta):
    """Load a checkpoint into the model, optimizer, schedule and scaler; returns its Run."""
    state = on_all_ranks(load_train_state, resume_dir, scheduler, scaler, cfg, meta)
    on_all_ranks(load_weights, resume_dir, raw_model, optimizer)
    run = Run(step=state["step"], position=state["samples_seen"], tokens_seen=state["tokens_seen"])
    if run.step > cfg.train.max_steps:
        die(f"{resume_dir} is at step {run.step}, past train.max_steps={cfg.train.max_steps} -> "
            "raise train.max_steps, or use a new checkpoint.dir")
    if run.step == cfg.train.max_steps:  # stopped before its end: validation, the export
        log0(f"note: {resume_dir} is at train.max_steps: no step left, the run's end follows")
    restore_rng(state["rng"], dist.get_rank(), cfg.train.seed, run.step)
    apply_settings(optimizer, scheduler, cfg, run.step)
    changed = changed_settings(state["config"], cfg)
    if changed:
        log0(f"note: changed since the checkpoint, this run's values apply: {', '.join(changed)}")
    if state.get("data_fingerprint") != meta.get("fingerprint"):
        log0(f"warning: {cfg.data.dir} was rebuilt since {resume_dir} was written; the data "
             "position may not match")
    log0(f"resumed from {resume_dir}: step {run.step}, {run.position:,} samples, "
         f"{run.tokens_seen:,} tokens seen")
    return run


def load_train_state(path, scheduler, scaler, cfg, meta):
    """Step, data position, RNG, schedule and grad scaler, once the model's shape is known to match.
    weights_only=True everywhere: a checkpoint is data, loading it must never run pickled code."""
    try:
        train_state = torch.load(path / "train_state.pt", weights_only=True)
        saved_config, this_config = train_state["config"], config_dict(cfg)
        vocab_size = train_state.get("vocab_size", meta.get("vocab_size"))
        check_classes(train_state, meta, path, cfg)  # images
        if vocab_size != meta.get("vocab_size"):
            die(f"checkpoint {path} was trained on data of {vocab_size:,} tokens' vocabulary, "
                f"{cfg.data.dir} has {meta['vocab_size']:,} -> give the data.dir it was trained "
                "on, or start afresh in another checkpoint.dir")
        for key, before_it_existed in MODEL_KEYS.items():
            saved = saved_config.get(key, before_it_existed)
            if saved != this_config[key] and (vocab_size or key != "train.seq_len"):  # text only
                die(f"checkpoint {path} was trained with {key}={saved}, this run has "
                    f"{key}={this_config[key]} -> pass {key}={saved}, or a new checkpoint.dir")
        scheduler.load_state_dict(train_state["scheduler"])
        scaler.load_state_dict(train_state["scaler"])
    except LOAD_ERRORS as error:
        die(f"cannot load checkpoint {path} ({unloadable(error)}) -> point checkpoint.resume at "
            "another step_* directory, or use a new checkpoint.dir")
    return train_state


def load_weights(path, raw_model, optimizer):
    try:
        for name, part in [("model.pt", raw_model), ("optimizer.pt", optimizer)]:
            part.load_state_dict(torch.load(path / name, weights_only=True, map_location="cpu"))
    except LOAD_ERRORS as error:
        die(f"cannot load checkpoint {path} ({unloadable(error)}) -> point checkpoint.resume at "
            "another step_* directory, or use a new checkpoint.dir")


# -------------------------------------------------------------------------- validation (section 7)

def validate(model, val_data, setup, step):
    """Mean loss per label and top-1 accuracy over the same batches each time, every rank its share:
    rank 0 alone would be slower, and hang the others if the forward communicates (FSDP)."""
    model.eval()
    batches = val_data.validation_batches(setup.cfg)
    global_batch = setup.cfg.train.global_batch_size
    sums = torch.zeros(3, device=setup.device, dtype=torch.float64)  # loss, correct, labels
    with torch.no_grad():
        for batch_index in range(batches):
            micro_batches = rank_batches(val_data, (batch_index * global_batch) % len(val_data),
                                         None, setup.cfg, dist.get_world_size(), dist.get_rank(),
                                         setup.device)[0]
            for batch in micro_batches:
                with setup.autocast:
                    logits = model(**batch["inputs"]).logits
                counted = batch["labels"] != IGNORE_INDEX
                sums[0] += token_loss_sum(logits, batch["labels"])
                sums[1] += ((logits.argmax(-1) == batch["labels"]) & counted).sum()
                sums[2] += counted.sum()
    dist.all_reduce(sums)
    model.train()
    loss_sum, correct, labels = sums.tolist()
    val_loss, val_accuracy = (loss_sum / labels, correct / labels) if labels else (None, None)
    log0(f"step {step} | val loss {val_loss:.4f} | accuracy {100 * val_accuracy:.2f}%" if labels
         else f"step {step} | val loss n/a: no label to predict in the validation batches")
    write_metrics(setup, {"kind": "val", "step": step, "val_loss": val_loss,
                          "val_accuracy": val_accuracy})


# ==================================================== below this, reference machinery you may skip
# (config parsing, errors, logging, exporters, the checkpoint protocol's safety details)


# ----------------------------------------------------------------------------- 1. config

# Every knob and its default (optional parts add theirs); config.yaml holds them with reasons.
DEFAULTS = {
    "out_dir": "out", "export": True,
    "model": dict(type="gpt2", pretrained="", n_layer=12, n_head=12, n_embd=768,
                  intermediate_size=0, dropout=0.0, attention="auto", tie_word_embeddings="auto",
                  embedding_gpu_rows=0),
    "data": dict(dir="data/stdlib", vocab_size=8192, val_fraction=0.02),
    "train": dict(seq_len=1024, global_batch_size=64, micro_batch_size=32, max_steps=300,
                  precision="auto", compile="auto", seed=1337, eval_every=100, eval_batches=8,
                  max_bad_steps=10),
    "optim": dict(lr=6e-4, min_lr=6e-5, warmup_steps=50, weight_decay=0.1, beta1=0.9, beta2=0.95,
                  eps=1e-8, grad_clip=1.0),
    "checkpoint": dict(dir="out/checkpoints", every=100, keep=2, resume="auto", async_save=False),
    "log": dict(every=10, sample_prompt="def ", sample_tokens=64, peak_tflops=0.0,
                tensorboard=True, prometheus_port=0, gpu_util=True),
    "fsdp": dict(reshard_after_forward=True, activation_checkpointing=False, cpu_offload=False),
    "dist": dict(backend="auto", timeout_s=600, reducer="torch", bucket_mb=25.0,
                 grad_compression="none"),
}
# without a CUDA GPU these replace the defaults the config left: a demo of minutes on a laptop
CPU_PRESET = {"model.n_layer": 2, "model.n_head": 4, "model.n_embd": 128, "train.seq_len": 128,
              "train.global_batch_size": 32, "train.micro_batch_size": 16, "train.max_steps": 200,
              "train.eval_every": 50, "train.eval_batches": 4, "optim.lr": 2e-3,
              "optim.min_lr": 2e-4, "optim.warmup_steps": 20, "checkpoint.every": 100}
PRESETS = {"cpu_preset": CPU_PRESET}  # the preset sections config.yaml may hold, built in
OTHER_TRAINER = "train_fsdp.py"  # its knobs, refused here unless at their defaults, and why
NOT_HERE = {"fsdp.reshard_after_forward": "an FSDP setting", "fsdp.cpu_offload": "an FSDP setting",
            "fsdp.activation_checkpointing": "an FSDP setting",
            "checkpoint.async_save": "sharded checkpoints are written in the background"}
IGNORE_INDEX = -100  # a label the loss and the accuracy skip (F.cross_entropy's default)
# Exit codes: 0 done; 1 a rank was lost (a restart may help); 2 a mistake to fix (no restart would)
EXIT_STOPPED = 3  # stopped by a signal after a checkpoint: run the same command again to go on
STOP_REPEAT_S = 60  # signals this soon after the first only repeat it: Slurm and torchrun both send


CHOICES = {
    "model.attention": ["auto", "flash_attention_2", "sdpa", "eager"],
    "model.tie_word_embeddings": ["auto", "true", "false"],
    "train.precision": ["auto", "bf16", "fp16", "fp32", "fp8"],
    "train.compile": ["auto", "true", "false"],
    "dist.backend": ["auto", "nccl", "gloo"],
    "dist.reducer": ["torch", "inline", "naive"],  # DDP
    "dist.grad_compression": ["none", "bf16"],  # DDP
}
# What each number may be, and finite: grad_clip=-1 would flip every gradient and still exit 0
RANGES = {
    **dict.fromkeys(["model.n_layer", "model.n_head", "model.n_embd", "train.global_batch_size",
                     "train.micro_batch_size", "train.max_steps", "train.eval_every", "log.every",
                     "train.eval_batches", "train.max_bad_steps", "checkpoint.keep",
                     "train.seq_len"], "at least 1"),
    **dict.fromkeys(["optim.min_lr", "optim.warmup_steps", "optim.weight_decay", "log.peak_tflops",
                     "model.intermediate_size", "model.embedding_gpu_rows", "optim.grad_clip",
                     "checkpoint.every", "log.sample_tokens"], "at least 0"),
    **dict.fromkeys(["model.dropout", "optim.beta1", "optim.beta2"], "at least 0 and below 1"),
    **dict.fromkeys(["optim.lr", "optim.eps", "dist.timeout_s"], "above 0"),
    "dist.bucket_mb": "above 0",  # DDP
    "log.prometheus_port": "at least 0 and at most 65535",
    "train.seed": "at least 0 and at most 4294967295",
}


class ConfigLoader(yaml.SafeLoader):
    """YAML as a config means it: 3e-4 a float, 010 and yes strings, a key given twice an error."""

    def construct_mapping(self, node, deep=False):
        seen_at = {}
        for key_node, _ in node.value:
            if isinstance(key_node, yaml.ScalarNode) and key_node.value != "<<":  # << merges
                if key_node.value in seen_at:
                    raise yaml.constructor.ConstructorError(
                        problem=f"'{key_node.value}' is given twice, first at line "
                                f"{seen_at[key_node.value]}", problem_mark=key_node.start_mark)
                seen_at[key_node.value] = key_node.start_mark.line + 1
        return super().construct_mapping(node, deep)


ConfigLoader.yaml_implicit_resolvers = {
    first: [(tag, pattern) for tag, pattern in resolvers
            if tag.rpartition(":")[2] not in ("bool", "int", "float")]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()}
for kind, pattern, first_chars in [
        ("bool", r"^(?:true|True|TRUE|false|False|FALSE)$", "tTfF"),
        ("int", r"^[-+]?(?:0|[1-9][0-9_]*)$", "-+0123456789"),
        ("float", r"^[-+]?(?:[0-9][0-9_]*\.[0-9_]*(?:[eE][-+]?[0-9]+)?|\.[0-9][0-9_]*"
                  r"(?:[eE][-+]?[0-9]+)?|[0-9][0-9_]*[eE][-+]?[0-9]+|\.(?:inf|Inf|INF))$"
                  r"|^\.(?:nan|NaN|NAN)$", "-+0123456789.")]:
    ConfigLoader.add_implicit_resolver(f"tag:yaml.org,2002:{kind}", re.compile(pattern),
                                       first_chars)
# the trainer's paths: ~ means the home directory there too, not a folder named ~
PATH_KEYS = ["out_dir", "model.pretrained", "data.dir", "checkpoint.dir", "checkpoint.resume"]
# what model.pretrained's config.json sets instead, by transformers' common names
SHAPE_KEYS = {"model.n_layer": "num_hidden_layers", "model.n_head": "num_attention_heads",
              "model.n_embd": "hidden_size", "model.intermediate_size": "intermediate_size"}
# preprocess.py's settings: the trainer reads the data as it was written
PREPROCESS_KEYS = {"data.vocab_size": "--vocab-size", "data.val_fraction": "--val-fraction"}


def load_config(args, use_cuda):
    """DEFAULTS, config.yaml (or a .yaml given first), key=value; a preset fills keys left alone."""
    defaults = flatten(DEFAULTS)
    flat, presets = dict(defaults), dict(PRESETS)
    config_path = Path(__file__).with_name("config.yaml")
    if args and args[0].endswith((".yaml", ".yml")):
        config_path, args = Path(args[0]), args[1:]
        if not config_path.is_file():
            die(f"config file {config_path} not found -> give the path of a config.yaml")
    if config_path.is_file():
        tree = read_yaml(config_path)
        for name, built_in in PRESETS.items():  # `section.key: value` lines; empty: no preset
            section = tree.pop(name, built_in)
            if not isinstance(section, (dict, type(None))):
                die(f"{name}: in {config_path} is not a section -> indent its `section.key: value` "
                    "lines below it")
            presets[name] = section or {}
            for key, value in flatten(presets[name]).items():  # a typo fails on any machine
                typed(flat, key, value, f" in {name}")
        for key, value in flatten(tree).items():
            if not (value is None and isinstance(DEFAULTS.get(key), dict)):  # an empty section
                flat[key] = typed(flat, key, value, " in the config file")
    for arg in args:
        if "=" not in arg:
            die(f"argument '{arg}' is not key=value -> write it like train.max_steps=100")
    given = dict(arg.split("=", 1) for arg in args)
    for key, text in given.items():
        if key in PREPROCESS_KEYS:
            log0(f"note: {key} is preprocess.py's ({PREPROCESS_KEYS[key]}): the trainer reads "
                 "data.dir as it was written")
        if key in flat and not isinstance(flat[key], str):
            with contextlib.suppress(yaml.YAMLError):
                text = yaml.load(text, Loader=ConfigLoader)
        flat[key] = typed(flat, key, text, "")
    preset_name, preset = ("cpu_preset", presets["cpu_preset"]) if not use_cuda else ("", {})
    preset_name, preset = image_preset(flat, preset_name, preset, presets, use_cuda)  # images
    applied = {}
    for key, value in flatten(preset).items():
        value = typed(flat, key, value, f" in {preset_name}")
        own_shape = flat["model.pretrained"] and key in SHAPE_KEYS  # a pretrained model has its own
        if flat[key] == defaults[key] and key not in given and not own_shape:  # file, arguments win
            flat[key] = applied[key] = value
    if applied:
        log0(f"preset {preset_name}: {', '.join(f'{k}={v}' for k, v in applied.items())} (keys "
             "left at their defaults; give one to override it)")
    return SimpleNamespace(**{  # `section.key` settings as cfg.section.key
        section: SimpleNamespace(**{name: flat[f"{section}.{name}"] for name in keys})
        if isinstance(keys, dict) else flat[section] for section, keys in DEFAULTS.items()})


def read_yaml(path):
    try:
        tree = yaml.load(path.read_text(), Loader=ConfigLoader)
    except UnicodeDecodeError as error:
        die(f"{path} is not UTF-8 text ({error.reason} at byte {error.start}) -> save it as UTF-8")
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}" if mark else "somewhere"
        die(f"{path} is not valid YAML at {where} ({getattr(error, 'problem', None) or error}) -> "
            "fix that line")
    if not isinstance(tree, dict):
        die(f"{path} does not hold `key: value` sections -> copy the repository's config.yaml")
    return tree


def typed(flat, key, value, where):
    """`value` with the type of key's default: a typo like lr=3e-4x fails now, not at step 1000."""
    if key not in flat:
        keys = [known for known in flat if known.startswith(f"{key}.")]
        if keys:
            die(f"'{key}'{where} is a section, not a value -> give its keys, like {keys[0]}="
                f"{flat[keys[0]]}")
        nearest = difflib.get_close_matches(key, flat, n=1, cutoff=0.0)[0]
        die(f"unknown config key '{key}'{where} -> did you mean '{nearest}'?")
    default = flat[key]
    if value is None or (value == "" and default and key in PATH_KEYS):  # "" would be "."
        die(f"{key} has no value{where} (YAML reads nothing and ~ as null) -> give one, like "
            f"{key}={json.dumps(default) if isinstance(default, str) else default}")
    if isinstance(default, float) and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if isinstance(default, str) and isinstance(value, bool) and key in CHOICES:
        value = str(value).lower()  # `compile: true` in the file means the choice "true"
    if type(value) is not type(default):
        kind = "number" if where and type(default) in (int, float) else type(default).__name__
        fix = f"put it in quotes: \"{value}\"" if isinstance(default, str) else \
            f"give a value like {key}={default}"
        die(f"{key}={value}{where} is not a {kind} -> {fix}")
    if key in CHOICES and value not in CHOICES[key]:
        die(f"{key}={value} is not one of {'|'.join(CHOICES[key])} -> pick one of those")
    return os.path.expanduser(value) if key in PATH_KEYS else value


def flatten(tree, prefix=""):
    flat = {}
    for key, value in tree.items():
        if not isinstance(key, str):  # `1: 2` or `true: 1` in a config file
            die(f"'{prefix}{key}' in the config file is not a key name -> use config.yaml's names")
        flat.update(flatten(value, f"{prefix}{key}.") if isinstance(value, dict) else
                    {prefix + key: value})
    return flat


def config_dict(cfg):
    """The config as flat `section.key: value` pairs, as a checkpoint stores them."""
    return flatten({key: vars(value) if isinstance(value, SimpleNamespace) else value
                    for key, value in vars(cfg).items()})


def not_at_default(cfg, keys):
    """(key, value, default) of each of `keys` (those this file has) set away from its default."""
    values, defaults = config_dict(cfg), flatten(DEFAULTS)
    return [(key, values[key], defaults[key]) for key in keys
            if key in values and values[key] != defaults[key]]


def check_config(cfg, world_size):
    """Every number in range, a global batch that splits evenly: the micro-batches of a step."""
    values = config_dict(cfg)
    relations = {"at least": operator.ge, "above": operator.gt, "at most": operator.le,
                 "below": operator.lt}
    for key, allowed in RANGES.items():
        for bound in allowed.split(" and "):
            relation, _, limit = bound.rpartition(" ")
            if not (relations[relation](values[key], float(limit)) and abs(values[key]) < math.inf):
                die(f"{key}={values[key]} is out of range -> give it a value {allowed}")
    for key, value, default in not_at_default(cfg, NOT_HERE):
        die(f"{key}={value} is {OTHER_TRAINER}'s ({NOT_HERE[key]}) -> use {OTHER_TRAINER}, or "
            f"leave {key} at {default}")
    if cfg.optim.min_lr > cfg.optim.lr:
        die(f"optim.min_lr={cfg.optim.min_lr} is above optim.lr={cfg.optim.lr} -> lower min_lr")
    if not cfg.model.pretrained and cfg.model.n_embd % cfg.model.n_head:
        die(f"model.n_embd={cfg.model.n_embd} is not divisible by model.n_head={cfg.model.n_head} "
            "-> change one of them")
    if cfg.dist.reducer == "naive" and cfg.dist.grad_compression != "none":  # DDP
        die("dist.reducer=naive sends fp32 gradients -> "  # DDP
            "dist.reducer=inline or torch for bf16 ones")  # DDP
    batch_size, micro_size = cfg.train.global_batch_size, cfg.train.micro_batch_size
    per_round = micro_size * world_size
    if batch_size % per_round:
        nearest = max(1, round(batch_size / per_round)) * per_round
        per_rank = batch_size / world_size
        smaller = max((m for m in range(1, micro_size) if per_rank % m == 0), default=0)
        keep = f"train.micro_batch_size={smaller} (the same global batch) or " if smaller else ""
        die(f"train.global_batch_size={batch_size} is not a multiple of train.micro_batch_size x "
            f"world size = {micro_size} x {world_size} -> use e.g. {keep}train.global_batch_size="
            f"{nearest}")
    return batch_size // per_round


# ----------------------------------------------------------------------------- 2. distributed init

def choose_precision(requested, device):
    if requested == "fp16" and device.type != "cuda":
        die("train.precision=fp16 needs a CUDA GPU (GradScaler) -> use fp32 or bf16 on a CPU")
    if requested != "auto":
        return requested
    # not torch.cuda.is_bf16_supported(): True on V100 and T4, which only emulate bf16
    if device.type != "cuda":
        return "fp32"
    return "bf16" if torch.cuda.get_device_capability(device) >= (8, 0) else "fp16"


class UserError(Exception):
    """A foreseeable mistake (bad config, missing data, unreadable checkpoint): one clear line."""


class Stopped(Exception):
    """A requested stop, not an error: the run ends after a checkpoint, and a new run goes on."""


def die(message):
    raise UserError(message)


def first_line(error):
    """An exception's first line (and the next, after a ':'), for a one-line message."""
    lines = [line.strip() for line in str(error).strip().splitlines()] or [type(error).__name__]
    return " ".join(lines[:2] if lines[0].endswith(":") else lines[:1])[:300]


def unloadable(error):
    if isinstance(error, pickle.UnpicklingError):  # weights_only=True met pickled code: never run
        return "it holds pickled objects other than tensors and plain data; loading refuses them"
    return first_line(error)


def log0(*values, file=None):
    if int(os.environ.get("RANK", "0")) == 0:
        try:
            print(*values, file=file, flush=True)
        except BrokenPipeError:  # its reader left (`| head`): train on, printing nowhere
            os.dup2(os.open(os.devnull, os.O_WRONLY), (file or sys.stdout).fileno())


# ----------------------------------------------------------------------------- 3. data

def prepare_command(data_dir):
    source = "" if str(data_dir) == DEFAULTS["data"]["dir"] else " --input YOUR_TEXT"
    return f"python preprocess.py{source} --out {data_dir}"


def read_meta(data_dir, reader):
    """data_dir/meta.json, checked, of the kind the reader reads (the reader checks the rest)."""
    prepare = reader.prepare_command(data_dir)
    path, rebuild = data_dir / "meta.json", f"{prepare} --force"
    if not path.is_file():
        die(f"no prepared data in {data_dir} (meta.json missing) -> run: {prepare}")
    try:
        meta = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as error:
        die(f"{path} is unreadable ({error}) -> rebuild it: {rebuild}")
    if not isinstance(meta, dict) or meta.get("format_version") != 1:
        version = meta.get("format_version") if isinstance(meta, dict) else None
        die(f"{path} has format version {version}, this trainer reads 1 -> rebuild it: {rebuild}")
    splits = meta.get("splits")
    if not all(isinstance(splits, dict) and isinstance(splits.get(s), dict)
               and isinstance(splits[s].get("files"), list) for s in ("train", "val")):
        die(f"{path} lacks splits.train/val.files -> rebuild it: {rebuild}")
    if meta.get("kind", "text") != reader.kind:
        die(f"{data_dir} holds {meta.get('kind', 'text')}, the model reads {reader.kind} -> "
            f"prepare {reader.kind}: {reader.prepare_command(Path('DIR'))}, and pass data.dir=DIR")
    return meta


class ArrowTokens:
    """A split's samples from memory-mapped Arrow files: sample i is stream[i*L : i*L + L + 1] of
    the token stream. A reader stands for its task (causal LM): model, batches, FLOPs, export."""
    task, kind, unit, model_class = "causal", "text", "tokens", AutoModelForCausalLM
    sdpa = "sdpa_causal"  # ours, without a mask: causal batches are never padded (choose_attention)
    prepare_command = staticmethod(prepare_command)
    model_config = staticmethod(lambda cfg, meta: text_config(cfg, meta))  # defined below
    export = staticmethod(lambda *args: export_final(*args))  # defined below: looked up on call

    def __init__(self, data_dir, meta, split, seq_len):
        special = meta.get("special_tokens")
        rebuild = f"-> rebuild: {prepare_command(data_dir)} --force"
        if not (isinstance(meta.get("vocab_size"), int) and isinstance(special, dict)
                and all(isinstance(special.get(role), int)
                        for role in ("eot", "pad", "mask", "cls", "sep"))):
            die(f"{data_dir / 'meta.json'} lacks vocab_size or special_tokens (eot, pad, mask, "
                f"cls, sep) {rebuild}")
        if not (data_dir / str(meta.get("tokenizer_file"))).is_file():  # the export saves it
            die(f"{data_dir} lacks its tokenizer file {meta.get('tokenizer_file')} {rebuild}")
        self.seq_len, self.vocab_size = seq_len, meta["vocab_size"]
        self.summary = f"{meta['splits'][split].get('tokens', 0):,} {split} tokens"
        self.chunks, self.pieces = [], []  # a chunk's row: a document
        for name in meta["splits"][split]["files"]:
            try:
                table = pa.ipc.open_file(pa.memory_map(str(data_dir / name))).read_all()
            except (OSError, pa.ArrowInvalid) as error:
                die(f"cannot read {data_dir / name} ({error}) {rebuild}")
            if "input_ids" not in table.column_names:
                die(f"{data_dir / name} has no input_ids column {rebuild}")
            for chunk in (chunk for chunk in table.column("input_ids").chunks if len(chunk)):
                largest = pa.compute.max(chunk.values).as_py()  # one pass, in Arrow's C++
                if largest is not None and largest >= self.vocab_size:
                    die(f"{data_dir / name} holds token id {largest}, but the vocabulary has "
                        f"{self.vocab_size} tokens {rebuild}")
                self.chunks.append(chunk)
                self.pieces.append(chunk.values.to_numpy(zero_copy_only=True))
        self.piece_starts = np.cumsum([0] + [len(piece) for piece in self.pieces])
        self.num_samples = self.count_samples(int(self.piece_starts[-1]))
        if self.num_samples == 0:  # the trainer's data.val_fraction would not change the data
            more = (f"rebuild it with a larger --val-fraction F: {prepare_command(data_dir)} "
                    "--val-fraction F --force") if split == "val" else "prepare more text"
            die(f"the {split} split of {data_dir} has no {self.task} samples of seq_len {seq_len} "
                f"-> lower train.seq_len, or {more}")

    def count_samples(self, stream_length):
        return max(0, stream_length - 1) // self.seq_len

    def __len__(self):
        return self.num_samples

    def model_summary(self, config):
        return f"vocab {self.vocab_size} padded to {config.vocab_size}"

    def span(self, start, length):
        out, filled = np.empty(length, dtype=np.int64), 0
        piece = int(np.searchsorted(self.piece_starts, start, side="right")) - 1
        while filled < length:
            offset = start + filled - self.piece_starts[piece]
            taken = self.pieces[piece][offset:offset + length - filled]
            out[filled:filled + len(taken)] = taken
            filled, piece = filled + len(taken), piece + 1
        return out

    def length(self, index):  # the input tokens of sample `index`, without reading its tokens
        return self.seq_len

    def sample(self, index):
        return self.span(index * self.seq_len, self.seq_len + 1)

    def plan(self, position, seed, cfg, world_size):
        sample_ids, epochs = global_batch(position, cfg.train.global_batch_size, len(self), seed)
        return deal(sample_ids, epochs, cfg.train.micro_batch_size, world_size)

    def micro_batch(self, sample_ids, epochs, cfg, device):
        blocks = torch.from_numpy(np.stack([self.sample(int(i)) for i in sample_ids]))
        return on_device({"input_ids": blocks[:, :-1], "labels": blocks[:, 1:],
                          "attention_mask": None}, device)

    def label_count(self, plan, lengths, cfg):  # the global batch's labels, alike on every rank
        return cfg.train.global_batch_size * self.seq_len  # every position

    def validation_batches(self, cfg):
        return cfg.train.eval_batches

    @staticmethod
    def adapt_pretrained(model, cfg, meta):  # the embedding grows to the data's larger vocabulary
        if model.get_input_embeddings().num_embeddings < padded_vocab(meta):
            model.resize_token_embeddings(padded_vocab(meta))

    @staticmethod
    def flops_counter(raw_model, attention, cfg):
        """model_flops_counter's: a causal query sees the keys up to itself, half of its block."""
        length = cfg.train.seq_len
        return model_flops_counter(raw_model, lambda lengths: (len(lengths) * length,
                                                               len(lengths) * length * length / 2))


def token_loss_sum(logits, labels):
    """Summed (not mean) cross-entropy, in fp32: the caller decides what to divide by."""
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1),
                           ignore_index=IGNORE_INDEX, reduction="sum")


# ----------------------------------------------------------------------------- 4. model

def load_pretrained_config(path):
    try:
        return AutoConfig.from_pretrained(path, local_files_only=True)  # offline: never the hub
    except (OSError, ValueError) as error:
        die(f"cannot read a transformers config from model.pretrained={path} ({first_line(error)}) "
            "-> give a local directory holding config.json and the weights")


def padded_vocab(meta):
    return math.ceil(meta["vocab_size"] / 64) * 64  # as nanoGPT: matmul-friendly sizes


def model_config(cfg, reader, meta):
    """The reader's model's transformers config, with model.*'s dropout and output-layer choices."""
    config = reader.model_config(cfg, meta)
    for name, value in config.to_dict().items():
        if ("dropout" in name or "pdrop" in name) and isinstance(value, float):
            setattr(config, name, cfg.model.dropout)
    config.tied_by_the_model = bool(getattr(config, "tie_word_embeddings", False))
    if cfg.model.tie_word_embeddings != "auto":  # auto: the model's own (gpt2, bert tie; llama not)
        config.tie_word_embeddings = cfg.model.tie_word_embeddings == "true"
    config.use_cache = False  # a key/value cache serves generation only; training would build one
    config.is_decoder = reader.task == "causal"  # else an encoder (BERT) as a causal LM sees ahead
    return config


def text_config(cfg, meta):
    """A language model's config: the pretrained model's, or a new one of the shape in model.*."""
    if cfg.model.pretrained:
        config = load_pretrained_config(cfg.model.pretrained)
        if cfg.model.type not in (DEFAULTS["model"]["type"], config.model_type):  # given, other
            die(f"model.type={cfg.model.type}, but model.pretrained={cfg.model.pretrained} is a "
                f"{config.model_type} -> leave model.type out with model.pretrained")
        if getattr(config, "max_position_embeddings", cfg.train.seq_len) < cfg.train.seq_len:
            die(f"{cfg.model.pretrained} knows {config.max_position_embeddings} positions, "
                f"train.seq_len is {cfg.train.seq_len} -> lower train.seq_len")
        theirs = Path(cfg.model.pretrained, "tokenizer.json")  # other ids, same text: noise
        if theirs.is_file() and Tokenizer.from_file(str(theirs)).get_vocab() != Tokenizer.from_file(
                str(Path(cfg.data.dir, meta["tokenizer_file"]))).get_vocab():
            die(f"{cfg.model.pretrained} has another tokenizer than {cfg.data.dir} -> prepare the "
                f"data with it: python preprocess.py --tokenizer {theirs} --out NEW_DIR")
        return config
    special = meta["special_tokens"]
    try:
        config = AutoConfig.for_model(
            cfg.model.type, vocab_size=padded_vocab(meta), hidden_size=cfg.model.n_embd,
            num_hidden_layers=cfg.model.n_layer, num_attention_heads=cfg.model.n_head,
            max_position_embeddings=cfg.train.seq_len, pad_token_id=special["pad"],
            bos_token_id=special["eot"], eos_token_id=special["eot"])
    except ValueError as error:
        die(f"model.type={cfg.model.type} is not a transformers model type "
            f"({first_line(error)}) -> use e.g. gpt2, llama, bert or roberta")
    except Exception as error:  # transformers' own checks of the values, as RoPE's of head_dim
        die(f"model.* make no valid {cfg.model.type} ({first_line(error)}) -> change what it names")
    mlp = next((name for name in ("intermediate_size", "n_inner") if hasattr(config, name)), "")
    if mlp:  # the MLP's width (GPT-2's n_inner): the models' own defaults ignore n_embd
        setattr(config, mlp, cfg.model.intermediate_size or 4 * cfg.model.n_embd)
    elif cfg.model.intermediate_size:  # refused: it would go unused
        die(f"model.type={cfg.model.type} has no intermediate_size -> leave "
            "model.intermediate_size at 0")
    if hasattr(config, "num_key_value_heads"):
        config.num_key_value_heads = cfg.model.n_head
    return config


def build_model(cfg, reader, meta, device):
    """A new model from a transformers config, or a local pretrained one; fp32 master weights."""
    config, model_class = model_config(cfg, reader, meta), reader.model_class
    for key, value, _ in not_at_default(cfg, SHAPE_KEYS) if cfg.model.pretrained else []:
        theirs = getattr(config, SHAPE_KEYS[key], "its own")
        if value != theirs:  # refused: it would go unused
            die(f"{key}={value}, but model.pretrained={cfg.model.pretrained} has {theirs} -> leave "
                f"{key} out: a pretrained model keeps its shape")
    architecture = model_class._model_mapping.get(type(config), None)
    if architecture is None:  # t5 as a causal LM, gpt2 as a masked LM
        die(f"transformers has no {model_class.__name__.removeprefix('AutoModelFor')} of type "
            f"{config.model_type} -> use a model.type that has one, like gpt2 or bert")
    attention = choose_attention(cfg.model.attention, device, reader.sdpa, architecture)
    if not cfg.model.pretrained:
        model = model_class.from_config(config, attn_implementation=attention, dtype=torch.float32)
        return model, attention
    try:
        model = model_class.from_pretrained(
            cfg.model.pretrained, config=config, dtype=torch.float32, local_files_only=True,
            attn_implementation=attention, ignore_mismatched_sizes=True)  # a head for other labels
    except (*LOAD_ERRORS, SafetensorError) as error:  # a damaged or foreign weights file too
        die(f"cannot load model.pretrained={cfg.model.pretrained} ({first_line(error)}) -> give a "
            "directory written by save_pretrained")
    reader.adapt_pretrained(model, cfg, meta)
    if config.tied_by_the_model and not config.tie_word_embeddings:
        # a tied checkpoint holds one table: transformers would leave the untied output layer random
        model.get_output_embeddings().weight.data.copy_(model.get_input_embeddings().weight.data)
        log0("untied the output layer from the input embedding (model.tie_word_embeddings=false): "
             "it starts as a copy")
    return model, attention


def choose_attention(requested, device, sdpa, architecture=None):
    """auto: FlashAttention-2 where flash_attn imports on a GPU of compute capability 8.0+; else the
    reader's sdpa; eager for model classes transformers runs without SDPA."""
    usable = device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 0) and \
        flash_attn_available() and getattr(architecture, "_supports_flash_attn", True)
    if requested == "auto" and usable:
        return "flash_attention_2"
    if requested == "auto" and not getattr(architecture, "_supports_sdpa", True):
        return "eager"
    if requested == "auto" and sdpa != "sdpa":
        # transformers' "sdpa" builds an all-true mask under torch.compile, and SDPA runs no flash
        # kernel with one: ours passes none
        # imported here, not at the top: it loads transformers' modeling code, seconds --check skips
        from transformers import AttentionInterface, AttentionMaskInterface
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        AttentionInterface.register(sdpa, sdpa_attention_forward)
        AttentionMaskInterface.register(sdpa, lambda *args, **kwargs: None)
        return sdpa
    if requested == "flash_attention_2" and not usable:
        die("model.attention=flash_attention_2 needs the flash_attn package and a GPU of compute "
            "capability 8.0 or newer -> pip install flash-attn, or use model.attention=sdpa")
    return "sdpa" if requested == "auto" else requested


def flash_attn_available():
    with contextlib.suppress(ImportError):
        import flash_attn  # noqa: F401
        return True
    return False


def repeated_blocks(model):
    """The members of the outermost nn.ModuleLists (blocks), none holding the input embedding."""
    embedding, blocks = model.get_input_embeddings(), []
    for module in model.modules():  # parents before children
        if isinstance(module, torch.nn.ModuleList) and not any(
                inner is module for block in blocks for inner in block.modules()):
            blocks += [block for block in module
                       if all(inner is not embedding for inner in block.modules())]
    return blocks


def residual_in_bf16(model, dtype):
    """In a bf16 step, each block's input cast to bf16: under autocast alone the residual stream
    stays fp32, as the embedding's output is, and its adds and norms move twice the bytes. Outside
    autocast (the export's sample) fp32 weights need fp32 inputs."""
    def cast(block, args, kwargs):  # the hidden states come first: GPT-2, Llama, BERT, ViT
        if args and torch.is_floating_point(args[0]) and \
                torch.is_autocast_enabled(args[0].device.type):
            return (args[0].to(torch.bfloat16), *args[1:]), kwargs
    if dtype is torch.bfloat16:  # fp16 and fp32 steps are left as they are
        for block in repeated_blocks(model):
            block.register_forward_pre_hook(cast, with_kwargs=True)


def model_flops_counter(raw_model, shape_of):
    """Micro-batches' sample lengths -> PaLM's model FLOPs: 6 per matmul weight and position,
    12 x width per query-key pair and layer; shape_of(lengths) gives (positions, pairs)."""
    matmul_params, config = count_matmul_params(raw_model), raw_model.config
    return lambda micro_batch_lengths: sum(
        6 * matmul_params * positions + 12 * config.num_hidden_layers * config.hidden_size * pairs
        for positions, pairs in map(shape_of, micro_batch_lengths))


def count_matmul_params(model):
    """Parameters multiplied with every token: all but lookups, plus a tied output layer."""
    lookups = [m for m in model.modules() if isinstance(m, torch.nn.Embedding)]
    embedding_weights = {id(p): p.numel() for m in [*lookups, model.get_input_embeddings()]
                         for p in m.parameters(recurse=False)}
    output = model.get_output_embeddings()
    tied = output is not None and id(output.weight) in embedding_weights
    tied = output.weight.numel() if tied else 0
    return sum(p.numel() for p in model.parameters()) - sum(embedding_weights.values()) + tied


# ----------------------------------------------------------------------------- 5. optimizer

def make_optimizer(raw_model, cfg):
    """AdamW, with weight decay on matrices and embeddings, never on biases and norm weights."""
    trained = [p for p in raw_model.parameters() if p.requires_grad]
    return torch.optim.AdamW(
        [{"params": [p for p in trained if p.dim() >= 2], "weight_decay": cfg.optim.weight_decay},
         {"params": [p for p in trained if p.dim() < 2], "weight_decay": 0.0}],
        lr=cfg.optim.lr, betas=(cfg.optim.beta1, cfg.optim.beta2), eps=cfg.optim.eps,
        fused=True)  # the whole update in one kernel (the default: a kernel per operation on CUDA)


def lr_factor(step, cfg):
    """Linear warmup, then cosine decay to min_lr at max_steps (a multiplier of optim.lr)."""
    if step < cfg.optim.warmup_steps:
        return (step + 1) / cfg.optim.warmup_steps
    decay_steps = max(1, cfg.train.max_steps - cfg.optim.warmup_steps)
    progress = min(1.0, (step - cfg.optim.warmup_steps) / decay_steps)
    min_factor = cfg.optim.min_lr / cfg.optim.lr
    return min_factor + (1 - min_factor) * 0.5 * (1 + math.cos(math.pi * progress))


def memory_prediction(raw_model, device):
    """Bytes held between steps: weights, a gradient per trained one, AdamW's two moments."""
    weights = trained = 0
    for parameter in raw_model.parameters():
        local = parameter.to_local() if hasattr(parameter, "to_local") else parameter  # FSDP
        if local.device.type == device.type:
            weights += local.numel() * local.element_size()
            trained += local.numel() * local.element_size() if parameter.requires_grad else 0
    mib = [size / 2**20 for size in (weights, trained, 2 * trained)]
    log0(f"memory per rank, predicted: weights {mib[0]:,.1f} MiB, gradients {mib[1]:,.1f} MiB, "
         f"AdamW state {mib[2]:,.1f} MiB on {device.type}; activations are measured at step 2")
    return {"weights": weights, "gradients": trained, "optimizer": 2 * trained}


def report_memory(setup, step, optimizer, predicted):
    """After an update: the prediction, its check from the tensors that exist, the allocator's."""
    def held(parameters):  # bytes by device type of each weight, its gradient and AdamW state
        sizes = {}
        for parameter in parameters:
            for tensor in [parameter, parameter.grad, *optimizer.state.get(parameter, {}).values()]:
                if torch.is_tensor(tensor) and tensor.dim() > 0:  # not AdamW's 0-d "step"
                    tensor = tensor.to_local() if hasattr(tensor, "to_local") else tensor  # FSDP
                    sizes[tensor.device.type] = sizes.get(tensor.device.type, 0) + \
                        tensor.numel() * tensor.element_size()
        return sizes

    memory = {"predicted_bytes": sum(predicted.values()),
              **{f"predicted_{key}_bytes": value for key, value in predicted.items()},
              "held_bytes": held(setup.raw_model.parameters()).get(setup.device.type, 0)}
    if setup.device.type == "cuda":
        memory.update(allocated_bytes=torch.cuda.memory_allocated(setup.device),
                      peak_bytes=torch.cuda.max_memory_allocated(setup.device),
                      reserved_bytes=torch.cuda.memory_reserved(setup.device))
    write_metrics(setup, {"kind": "memory", "step": step, **memory})
    mib = {key: value / 2**20 for key, value in memory.items()}
    line = (f"step {step} | memory per rank: weights + gradients + AdamW state predicted "
            f"{mib['predicted_bytes']:,.1f} MiB, held by those tensors "
            f"{mib['held_bytes']:,.1f} MiB")
    if "peak_bytes" in memory:
        activations = mib["peak_bytes"] - mib["predicted_bytes"]
        line += (f"; allocated {mib['allocated_bytes']:,.1f} MiB, peak {mib['peak_bytes']:,.1f} "
                 f"MiB (activations and temporaries: {activations:,.1f} MiB above the "
                 f"prediction), reserved {mib['reserved_bytes']:,.1f} MiB (the allocator's cache: "
                 f"{mib['reserved_bytes'] - mib['peak_bytes']:,.1f} MiB above the peak)")
    log0(line)
    embedding = held(setup.raw_model.get_input_embeddings().parameters())
    log0(f"step {step} | input embedding (weights, gradients, optimizer state): " + ", ".join(
        f"{size / 2**20:,.1f} MiB on {kind}" for kind, size in sorted(embedding.items())))


# -------------------------------------------------------------- 6. the checkpoint's safety details

CHECKPOINT_FILES = ["model.pt", "optimizer.pt", "train_state.pt", "checksums.json"]
# keys that shape the model, so a resumed run must share them, and the value before a key existed;
# train.seq_len too, for text: a new model has as many positions; the data position counts samples
MODEL_KEYS = {"model.type": None, "model.n_layer": None, "model.n_head": None,
              "model.n_embd": None, "model.pretrained": None, "model.intermediate_size": 0,
              "model.tie_word_embeddings": "auto", "model.embedding_gpu_rows": 0,
              "train.seq_len": None}
LOAD_ERRORS = (OSError, RuntimeError, KeyError, ValueError, EOFError, TypeError,
               pickle.UnpicklingError)


def cannot_write(ckpt_dir, error, needed):
    free = shutil.disk_usage(ckpt_dir).free if ckpt_dir.exists() else 0
    return (f"cannot write checkpoint to {ckpt_dir} ({first_line(error)}): {free / 2**20:,.1f} MiB "
            f"free there, a checkpoint needs about {needed / 2**20:,.1f} MiB -> free disk space or "
            "set checkpoint.dir; the newest complete checkpoint is untouched")


def tensor_bytes(state):
    if torch.is_tensor(state):
        return state.numel() * state.element_size()
    if isinstance(state, dict):
        state = list(state.values())
    return sum(tensor_bytes(part) for part in state) if isinstance(state, (list, tuple)) else 0


def hold_directory(ckpt_dir, writing):
    """Lock ckpt_dir/.lock so a second run stops; the open file returned holds it till exit."""
    if not writing and not ckpt_dir.is_dir():
        return None
    try:
        ckpt_dir.mkdir(parents=True, exist_ok=True)
        lock = open(ckpt_dir / ".lock", "a+")
    except OSError as error:
        die(f"cannot write to checkpoint.dir={ckpt_dir} ({error}) -> give a writable directory")
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = (ckpt_dir / ".lock").read_text().strip() or "holder unknown"
        die(f"{ckpt_dir} is in use by another run ({holder}) -> wait for it to end or stop it, or "
            "give this run another checkpoint.dir")
    except OSError as error:  # a filesystem without locks
        log0(f"warning: cannot lock {ckpt_dir} ({first_line(error)}): two runs on it at once would "
             "damage each other's checkpoints")
        return lock
    lock.truncate(0)
    lock.write(f"host {socket.gethostname()}, PID {os.getpid()}, since {time.strftime('%c')}\n")
    lock.flush()
    return lock


def find_resume_checkpoint(ckpt_dir, resume):
    """auto: the newest intact checkpoint (damaged ones skipped); never; a path."""
    for leftover in [*ckpt_dir.glob(".tmp-step_*"), *ckpt_dir.glob(".latest-*")]:
        log0(f"removing {leftover}, left by a run that stopped while writing a checkpoint")
        shutil.rmtree(leftover) if leftover.is_dir() else leftover.unlink()
    existing = complete_checkpoints(ckpt_dir)
    strange = [p for p in ckpt_dir.glob("step_*") if step_of(p) >= 0 and not is_complete(p)]
    if strange:  # a new checkpoint of its step would replace it
        die(f"{strange[0]} is not a complete checkpoint of this trainer ({OTHER_TRAINER}'s, or "
            f"damaged) -> resume it with the trainer that wrote it, or move it out of {ckpt_dir}")
    if resume == "never" and existing:
        die(f"{ckpt_dir} already holds checkpoints ({existing[-1].name}), checkpoint.resume=never "
            "would overwrite them -> use checkpoint.resume=auto, or another checkpoint.dir")
    if resume in ("auto", "never"):
        try:  # the name of the checkpoint written last, counted with the listing
            pointed = [ckpt_dir / (ckpt_dir / "latest").read_text().strip()]
        except (OSError, UnicodeDecodeError):
            pointed = []
        candidates = {p for p in pointed if p.parent == ckpt_dir and is_complete(p)} | {*existing}
        for candidate in sorted(candidates, key=step_of, reverse=True):
            if (damage := checksum_mismatch(candidate)) is None:
                return candidate
            log0(f"warning: {candidate} is damaged ({damage}); trying the next older checkpoint")
        if existing:
            die(f"every checkpoint in {ckpt_dir} is damaged -> move them away, or restore one")
        return None
    if not is_complete(Path(resume)):
        die(f"checkpoint.resume={resume} is not a complete checkpoint directory (needs "
            f"{', '.join(CHECKPOINT_FILES)}) -> give a step_* directory, auto or never")
    if damage := checksum_mismatch(Path(resume)):
        die(f"checkpoint.resume={resume} is damaged ({damage}) -> give another step_* directory")
    newer = [p.name for p in existing if step_of(p) > step_of(Path(resume))]
    if newer:  # this run's checkpoints would interleave with them, and pruning could delete them
        die(f"{ckpt_dir} holds checkpoints newer than {resume} ({', '.join(newer)}) -> set "
            "checkpoint.dir to another directory for this run")
    return Path(resume)


def step_dir(ckpt_dir, step):
    return ckpt_dir / f"step_{step:06d}"


def step_of(path):
    """A step_* directory's step as a number: as strings step_999900 sorts after step_1000000."""
    match = re.fullmatch(r"step_(\d+)", path.name)
    return int(match.group(1)) if match else -1


def is_complete(path):
    return path.is_dir() and all((path / name).is_file() for name in CHECKPOINT_FILES)


def complete_checkpoints(ckpt_dir):
    """The complete step_* directories of ckpt_dir, oldest first."""
    return sorted((p for p in ckpt_dir.glob("step_*") if step_of(p) >= 0 and is_complete(p)),
                  key=step_of)


def file_checksum(path):
    """CRC-32 of a file: it catches truncated and bit-flipped files, not forgery."""
    checksum = 0
    with open(path, "rb") as file:
        while piece := file.read(1 << 24):
            checksum = zlib.crc32(piece, checksum)
    return checksum


def write_checksums(directory, names, known=None):
    """checksums.json: the CRC-32 of each named file (known: ones computed elsewhere), synced."""
    with open(directory / "checksums.json", "w") as file:
        json.dump({**(known or {}), **{name: file_checksum(directory / name) for name in names}},
                  file)
        file.flush()
        os.fsync(file.fileno())


def checksum_mismatch(path):
    """None if every file listed in path/checksums.json has its checksum, else what is wrong."""
    try:
        for name, expected in json.loads((path / "checksums.json").read_text()).items():
            if not (path / name).is_file():
                return f"{name} is missing"
            if file_checksum(path / name) != expected:
                return f"{name} does not match its checksum"
    except (OSError, ValueError, AttributeError) as error:
        return f"checksums.json is unreadable: {first_line(error)}"
    return None


def fsync_dir(path):
    """A rename or a new file is durable only once its directory is synced too (POSIX)."""
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def check_shared_directory(ckpt_dir):
    """Rank 0 writes a file of random name and content into ckpt_dir; every rank must find it."""
    def write_marker():
        try:
            marker.write_text(token)  # into the directory hold_directory made
        except OSError as error:
            die(f"cannot write to checkpoint.dir={ckpt_dir} ({error}) -> give a writable directory")

    def check_marker():
        if not marker.is_file() or marker.read_text() != token:
            die(f"checkpoint.dir={ckpt_dir} is not the directory rank 0 writes to -> put it on a "
                "filesystem every node mounts at the same path")

    token = on_rank0(secrets.token_hex, 8)
    marker = ckpt_dir / f".shared-{token}"
    on_rank0(write_marker)
    on_all_ranks(check_marker)
    on_rank0(marker.unlink)


def apply_settings(optimizer, scheduler, cfg, step):
    """After a resume, this run's optimizer settings win over the checkpoint's."""
    for group, weight_decay in zip(optimizer.param_groups, [cfg.optim.weight_decay, 0.0]):
        group.update(betas=(cfg.optim.beta1, cfg.optim.beta2), eps=cfg.optim.eps,
                     initial_lr=cfg.optim.lr, weight_decay=weight_decay,
                     lr=cfg.optim.lr * lr_factor(step, cfg))
    scheduler.base_lrs = [cfg.optim.lr] * len(optimizer.param_groups)


def changed_settings(saved_config, cfg):
    """`key old -> new` for the training settings that differ from the checkpoint's."""
    not_a_change = ("out_dir", "export", "data.dir", "checkpoint.", "log.", "dist.")
    return [f"{key} {saved_config[key]} -> {value}" for key, value in config_dict(cfg).items()
            if saved_config.get(key, value) != value and not key.startswith(not_a_change)]


def weights_are_finite(raw_model):
    """One wait for the GPU; only before a checkpoint or the export."""
    return bool(torch.stack([torch.isfinite(p).all() for p in raw_model.parameters()]).all())


def restore_rng(saved_states, rank, seed, step):
    """Each rank continues its own dropout stream; ranks the old run did not have get a new seed."""
    if rank >= len(saved_states):
        new_seed = np.random.SeedSequence([seed, rank, step]).generate_state(1)[0]
        return torch.manual_seed(int(new_seed))
    torch.set_rng_state(saved_states[rank]["torch"].cpu())
    if "cuda" in saved_states[rank] and torch.cuda.is_available():
        torch.cuda.set_rng_state(saved_states[rank]["cuda"].cpu())


# ----------------------------------------------------------------------------- 7. training loop

class Interval:
    """The log line's sums since the last one; its clock skips validation and checkpoints."""

    def __init__(self, device):
        self.device = device
        self.loss_sum = torch.zeros((), device=device, dtype=torch.float64)  # stays on the device
        self.reset(time.perf_counter())

    def reset(self, now):
        self.steps = self.input_tokens = self.label_tokens = self.flops = self.skipped = 0
        self.start, self.paused_s = now, 0.0
        self.loss_sum.zero_()

    def add_step(self, result, flops_of):
        self.steps, self.input_tokens = self.steps + 1, self.input_tokens + result.input_tokens
        self.flops += flops_of(result.lengths)
        self.skipped += result.bad
        if not result.bad:  # a skipped step's loss is not in the log's
            self.loss_sum += result.loss_sum
            self.label_tokens += result.label_tokens

    @contextlib.contextmanager
    def paused(self, pausing):  # only a pause waits for the GPU: each wait idles it between steps
        if pausing and self.device.type == "cuda":
            torch.cuda.synchronize()  # the step's own GPU work counts as training time
        start = time.perf_counter()
        yield
        self.paused_s += time.perf_counter() - start


def log_interval(interval, setup, run, result):
    """One line for the steps since the last: to the console (rank 0) and to metrics.jsonl."""
    dist.all_reduce(interval.loss_sum)
    loss_sum = interval.loss_sum.item()  # waits for the GPU: the clock then counts finished work
    now = time.perf_counter()  # the next interval starts here: it pays for this line's work
    elapsed = now - interval.start - interval.paused_s
    # every rank's busy time (less its waits for the others) and its device's idle share
    mine = torch.tensor([elapsed - setup.sync_wait.total_s(), setup.data_wait.total_s() / elapsed],
                        dtype=torch.float64, device=setup.device)
    everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, mine)
    per_rank = torch.stack(everyone).tolist()  # the host waits for the all_gather
    busy = [busy_s for busy_s, _ in per_rank]
    cuda, gib, several = setup.device.type == "cuda", 2**30, len(per_rank) > 1
    record = {
        "kind": "train", "step": run.step, "grad_norm": result.grad_norm.item(), "lr": result.lr,
        "loss": loss_sum / interval.label_tokens if interval.label_tokens else None,  # all skipped
        f"{setup.train_data.unit}_per_sec": interval.input_tokens / elapsed,  # tokens, or images
        "steps_per_sec": interval.steps / elapsed,
        "mfu": (interval.flops / (elapsed * setup.peak_flops * len(per_rank)) if setup.peak_flops
                else None),
        "gpu_util": None,
        "mem_alloc_gib": torch.cuda.memory_allocated() / gib if cuda else None,
        "mem_reserved_gib": torch.cuda.memory_reserved() / gib if cuda else None,
        "mem_peak_gib": torch.cuda.max_memory_allocated() / gib if cuda else None,
        # times the caching allocator found no free block, released its cache and allocated again
        "alloc_retries": torch.cuda.memory_stats().get("num_alloc_retries", 0) if cuda else None,
        "comm_exposed_ms": None, "allreduce_p50_ms": None, "allreduce_p95_ms": None,  # DDP
        "data_wait_frac": max(frac for _, frac in per_rank),
        "step_time_skew": max(busy) / max(min(busy), 1e-9) if several else None,
        "slowest_rank": busy.index(max(busy)) if several else None,
        f"{setup.train_data.unit}_seen": run.tokens_seen, "skipped_steps": interval.skipped,
        "eta_s": elapsed / interval.steps * (setup.cfg.train.max_steps - run.step),
    }
    record = write_metrics(setup, record)
    log0(log_line(record, setup.cfg.train.max_steps))
    interval.reset(now)


def log_line(record, max_steps):
    r, known = record, {key for key, value in record.items() if value is not None}
    minutes, seconds = divmod(int(r["eta_s"]), 60)
    hours, minutes = divmod(minutes, 60)
    parts = [f"step {r['step']}/{max_steps}",
             f"loss {'n/a' if r['loss'] is None else format(r['loss'], '.4f')}",
             f"lr {r['lr']:.2e}", f"grad {r['grad_norm']:.3f}",
             "tokens_per_sec" in known and f"{r['tokens_per_sec'] / 1e3:.1f}k tok/s",
             "images_per_sec" in known and f"{r['images_per_sec']:.0f} img/s",  # images
             "mfu" in known and f"MFU {100 * r['mfu']:.1f}%",
             "mem_alloc_gib" in known and f"mem {r['mem_alloc_gib']:.1f}/"
             f"{r['mem_reserved_gib']:.1f}/{r['mem_peak_gib']:.1f} GiB alloc/res/peak",
             bool(r.get("alloc_retries")) and f"alloc retries {r['alloc_retries']}",
             "gpu_util" in known and f"gpu {r['gpu_util']:.0f}%",
             "comm_exposed_ms" in known and f"comm exposed {r['comm_exposed_ms']:.1f} "  # DDP
             "ms/step",  # DDP
             "allreduce_p50_ms" in known and f"all-reduce p50/p95 "  # DDP
             f"{r['allreduce_p50_ms']:.1f}/{r['allreduce_p95_ms']:.1f} ms",  # DDP
             f"data {100 * r['data_wait_frac']:.1f}%",
             "step_time_skew" in known and f"skew {r['step_time_skew']:.2f} "
             f"(rank {r['slowest_rank']})",
             f"ETA {f'{hours}h{minutes:02d}m' if hours else f'{minutes}m{seconds:02d}s'}"]
    return " | ".join(part for part in parts if part)


def stop_message(cfg, step):
    if not cfg.checkpoint.every:
        return (f"stopped at step {step} by a stop signal; no checkpoint (checkpoint.every=0) "
                "-> the same command trains these steps again; set checkpoint.every to keep them")
    # resume=never or an older step_* directory would refuse the checkpoint just written
    added = "" if cfg.checkpoint.resume == "auto" else " with checkpoint.resume=auto added"
    return (f"stopped at step {step} by a stop signal; checkpoint "
            f"{step_dir(Path(cfg.checkpoint.dir), step)} is written -> run the same command{added} "
            "to resume from the newest checkpoint")


def catch_stop_signals(requested):
    """SIGTERM and SIGINT: a clean stop after the same step on every rank, with a checkpoint."""

    def on_signal(number, frame):
        if requested and time.monotonic() - requested[0][1] > STOP_REPEAT_S:
            print(f"stopped at once by a second {signal.Signals(number).name}, "
                  f"{time.monotonic() - requested[0][1]:.0f} s after the first: no checkpoint of "
                  "this step; a new run resumes from the newest one", file=sys.stderr, flush=True)
            signal.signal(number, signal.SIG_DFL)
            os.kill(os.getpid(), number)
        if not requested:
            requested.append((signal.Signals(number).name, time.monotonic()))

    for number in (signal.SIGTERM, signal.SIGINT):
        signal.signal(number, on_signal)


def open_metrics(out_dir, step):
    """metrics.jsonl, kept across restarts less the records past `step`: those steps run again."""
    path = out_dir / "metrics.jsonl"
    if (out_dir / "final").exists() and not (out_dir / "final").is_dir():  # now, not after training
        die(f"{out_dir / 'final'} is a file, where the export goes -> move it, or set out_dir")
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        lock = open(out_dir / ".metrics.lock", "a")  # one run per out_dir: held with the metrics
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            die(f"{out_dir} is in use by another run -> wait for it to end, or set another out_dir")
        except OSError:  # a filesystem without locks
            pass
        if path.exists():
            kept, lines = [], path.read_text().splitlines()
            for line in lines:
                with contextlib.suppress(json.JSONDecodeError):  # a line cut short by a crash goes
                    record = json.loads(line)
                    if record.get("kind") == "start" or record.get("step", 0) <= step:
                        kept.append(line + "\n")
            if step == 0 and len(kept) < len(lines):
                kept, aside = [], out_dir / f"metrics-{time.strftime('%Y%m%d-%H%M%S')}.jsonl"
                shutil.copyfile(path, aside)
                log0(f"note: {path} held records past step 0 (an earlier run's): copied to {aside}")
            temporary = out_dir / f".metrics-{os.getpid()}.jsonl"
            temporary.write_text("".join(kept))
            os.replace(temporary, path)
        metrics = open(path, "a")
        metrics.lock = lock
        return metrics
    except OSError as error:
        die(f"cannot write {path} ({error}) -> set out_dir to a writable directory")


def write_metrics(setup, record):
    record = export_metrics(setup, record)  # metrics
    if setup.metrics:
        setup.metrics.write(json.dumps(record) + "\n")
        setup.metrics.flush()
    return record


class SpanTimer:
    """`with timer:` sums a span over a log interval without a host wait: on a GPU two CUDA events
    time it as the GPU runs it (the host runs ahead), on a CPU the host's clock."""

    def __init__(self, device):
        self.on_gpu, self.host_s, self.recorded, self.spare = device.type == "cuda", 0.0, [], []

    def __enter__(self):
        if self.on_gpu:
            self.events = self.spare.pop() if self.spare else [torch.cuda.Event(enable_timing=True)
                                                               for _ in range(2)]
            self.events[0].record()
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
        self.spare += self.recorded  # reused: two new events per span and step would cost more
        self.host_s, self.recorded = 0.0, []
        return total


# Dense bf16 peak TFLOP/s (NVIDIA's datasheets) by exact device name: "NVIDIA L40" is not an L4
PEAK_BF16_TFLOPS = {"NVIDIA H200": 989, "NVIDIA H100 80GB HBM3": 989, "NVIDIA H100 PCIe": 756,
                    "NVIDIA A100-SXM4-80GB": 312, "NVIDIA A100-SXM4-40GB": 312,
                    "NVIDIA A100 80GB PCIe": 312, "NVIDIA A100-PCIE-40GB": 312}


def peak_flops_per_gpu(device, peak_tflops):
    """FLOP/s that 100% MFU stands for, or None (no MFU shown) on CPUs and GPUs not in the table."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    if not peak_tflops and name not in PEAK_BF16_TFLOPS:
        return log0(f"note: no MFU: '{name}' is not in PEAK_BF16_TFLOPS -> set log.peak_tflops")
    return (peak_tflops or PEAK_BF16_TFLOPS[name]) * 1e12


def export_final(raw_model, data_dir, meta, final_dir, cfg, device):
    """save_pretrained and the tokenizer: AutoModelFor...from_pretrained(final_dir) loads them."""
    transformers.logging.disable_progress_bar()  # a bar per one-file save is noise in a log
    core = Tokenizer.from_file(str(data_dir / meta["tokenizer_file"]))
    names = {key: core.id_to_token(token_id) for key, token_id in meta["special_tokens"].items()}
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core, eos_token=names["eot"], bos_token=names["eot"],
        pad_token=names["pad"], mask_token=names["mask"], cls_token=names["cls"],
        sep_token=names["sep"], model_max_length=raw_model.config.max_position_embeddings)
    untier(raw_model, device)  # tiered
    raw_model.config.use_cache = True  # off for training (model_config); generation wants it
    if raw_model.config._attn_implementation == "sdpa_causal":  # ignores padding: not for others
        raw_model.set_attn_implementation("sdpa")
    raw_model.save_pretrained(final_dir)
    tokenizer.save_pretrained(final_dir)
    log0(f"exported the model and tokenizer to {final_dir}")
    if raw_model.can_generate() and cfg.log.sample_prompt:  # a causal LM: a sample of its text
        raw_model.eval()
        prompt = torch.tensor([tokenizer.encode(cfg.log.sample_prompt)], device=device)
        room = raw_model.config.max_position_embeddings - prompt.shape[1]
        new_tokens = min(cfg.log.sample_tokens, room)
        if new_tokens < 1:
            return log0(f"no sample: log.sample_tokens={cfg.log.sample_tokens}, and the prompt's "
                        f"{prompt.shape[1]} tokens leave {max(0, room)} of the model's positions")
        with torch.no_grad():
            generated = raw_model.generate(prompt, attention_mask=torch.ones_like(prompt), top_k=40,
                                           max_new_tokens=new_tokens, do_sample=True,
                                           pad_token_id=meta["special_tokens"]["pad"])
        sample = tokenizer.decode(generated[0].tolist(), skip_special_tokens=True)
        log0(f"sample:\n{sample}")


def report_lost_ranks(error):
    """A collective failed: one line saying so and, where the store tells, which fell silent."""
    rank, text = dist.get_rank(), first_line(error)
    if "timed out" not in text.lower() and "timeout" not in text.lower():
        print(f"error: rank {rank} lost contact with another rank ({text}) -> look above for the "
              "first rank that failed; launch.sh restarts from the last checkpoint",
              file=sys.stderr, flush=True)
        return
    silent = "unknown"
    with contextlib.suppress(Exception):  # the store may have gone with the failure: say nothing
        store = dist.distributed_c10d._get_default_store()  # ranks that timed out say so there
        store.set(f"timed_out/{rank}", "1")
        time.sleep(3)
        silent = [other for other in range(dist.get_world_size())
                  if not store.check([f"timed_out/{other}"])] or "none"
    print(f"error: rank {rank}: a collective waited longer than dist.timeout_s; ranks that stopped "
          f"answering: {silent} -> read their logs, or raise dist.timeout_s", file=sys.stderr)


# ======================================================================= sample draws: begin
# Per-sample random draws that # MLM and # images share: delete this block with the last of them.

def sample_uniforms(seed, epochs, sample_ids, positions, use):
    """A float in [0, 1) per (epoch, sample, position, use): a hash of them alone, so no rank or
    micro-batch changes a draw (uses: MLM 0 masked?, 1 how, 2 which token; images 3)."""
    shape = np.broadcast_shapes(np.shape(epochs), np.shape(sample_ids), np.shape(positions))
    mixed = np.full(shape, seed, dtype=np.uint64)
    for part in (epochs, sample_ids, np.asarray(positions) * 4 + use):
        mixed = splitmix64(mixed ^ np.asarray(part, dtype=np.uint64))
    return (splitmix64(mixed) >> np.uint64(11)).astype(np.float64) * 2.0**-53  # the top 53 bits


def splitmix64(values):
    values = values + np.uint64(0x9E3779B97F4A7C15)  # numpy's uint64 arithmetic wraps, as wanted
    values = (values ^ (values >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    values = (values ^ (values >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return values ^ (values >> np.uint64(31))
# ======================================================================= sample draws: end


# ============================================================================== MLM: begin
# Masked-LM models (BERT, RoBERTa, ...). Delete this block and the lines tagged # MLM.

# masked LMs' knobs, as config.yaml gives them (model.task=auto: a masked LM where the type has one)
DEFAULTS["model"]["task"], CHOICES["model.task"] = "auto", ["auto", "causal", "mlm"]
DEFAULTS["train"].update(mlm_probability=0.15, pad_to_multiple=0)
RANGES.update({"train.mlm_probability": "above 0 and below 1",
               "train.pad_to_multiple": "at least 0",
               "train.seq_len": "at least 3"})  # a masked-LM sample is [CLS] token [SEP]
MODEL_KEYS["model.task"] = None


def masked_lm_reader(cfg, reader):
    """MaskedTokens for model.task=mlm, or auto and a type transformers has a masked LM of."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_MASKED_LM_MAPPING_NAMES
    model_type = load_pretrained_config(cfg.model.pretrained).model_type if cfg.model.pretrained \
        else cfg.model.type
    masked = cfg.model.task == "auto" and model_type in MODEL_FOR_MASKED_LM_MAPPING_NAMES
    if cfg.model.task == "mlm" or masked:
        return MaskedTokens
    unused = not_at_default(cfg, ["train.mlm_probability", "train.pad_to_multiple"])
    for key, value, default in unused:  # refused, not silently ignored
        die(f"{key}={value} applies to masked LMs, and this run trains none -> leave it at "
            f"{default}")
    return reader


class MaskedTokens(ArrowTokens):
    """Sample i is document i, cut to L - 2 as [CLS] doc [SEP]; padded and masked as BERT's."""
    task, model_class, sdpa = "mlm", transformers.AutoModelForMaskedLM, "sdpa"  # sdpa: it masks
    export = staticmethod(lambda *args: export_masked_lm(*args))  # defined below

    def __init__(self, data_dir, meta, split, seq_len):
        super().__init__(data_dir, meta, split, seq_len)
        self.special = meta["special_tokens"]
        self.doc_offsets = [chunk.offsets.to_numpy() for chunk in self.chunks]
        self.doc_starts = np.cumsum([0] + [len(offsets) - 1 for offsets in self.doc_offsets])

    def count_samples(self, stream_length):
        return sum(len(chunk) for chunk in self.chunks)  # a sample per document

    def length(self, index):
        _, offsets, row = self.document(index)
        return min(int(offsets[row + 1] - offsets[row]) - 1, self.seq_len - 2) + 2

    def sample(self, index):
        piece, offsets, row = self.document(index)
        end = min(offsets[row + 1] - 1, offsets[row] + self.seq_len - 2)  # without end-of-text
        doc = self.pieces[piece][offsets[row]:end]
        return np.concatenate([[self.special["cls"]], doc, [self.special["sep"]]])

    def document(self, index):  # its piece, the piece's offsets and its row there
        piece = int(np.searchsorted(self.doc_starts, index, side="right")) - 1
        return piece, self.doc_offsets[piece], index - self.doc_starts[piece]

    def plan(self, position, seed, cfg, world_size):
        """Sorted by length before it is cut, so a micro-batch pads little; dealt round-robin."""
        sample_ids, epochs = global_batch(position, cfg.train.global_batch_size, len(self), seed)
        order = sorted(range(len(sample_ids)), key=lambda k: (self.length(sample_ids[k]), k))
        return deal(sample_ids[order], epochs[order], cfg.train.micro_batch_size, world_size)

    def micro_batch(self, sample_ids, epochs, cfg, device):
        """Padded to seq_len, or the longest rounded up to train.pad_to_multiple; BERT's masking."""
        samples = [self.sample(int(i)) for i in sample_ids]
        lengths = np.array([len(sample) for sample in samples])
        length = padded_length(lengths.max(), cfg.train.pad_to_multiple, self.seq_len)
        tokens = np.full((len(samples), length), self.special["pad"], dtype=np.int64)
        for row, sample in enumerate(samples):
            tokens[row, :len(sample)] = sample
        inputs, labels = mask_tokens(tokens, lengths, cfg.train.seed,
                                     np.asarray(epochs, dtype=np.int64),
                                     np.asarray(sample_ids, dtype=np.int64), self.special,
                                     self.vocab_size, cfg.train.mlm_probability)
        attention_mask = (np.arange(length) < lengths[:, None]).astype(np.int64)
        batch = on_device({"input_ids": torch.from_numpy(inputs), "labels": torch.from_numpy(
            labels), "attention_mask": torch.from_numpy(attention_mask)}, device)
        if 0 < cfg.train.pad_to_multiple < self.seq_len:
            for tensor in [*batch["inputs"].values(), batch["labels"]]:
                dynamic_length(tensor)
        return batch

    def label_count(self, plan, lengths, cfg):
        """The masked positions, drawn exactly as micro_batch will draw them."""
        pairs = [pair for rank_plan in plan for pair in rank_plan]
        ids, epochs = (np.concatenate([pair[k] for pair in pairs]) for k in (0, 1))
        masked = masked_positions(cfg.train.seed, epochs, ids, np.concatenate(lengths),
                                  self.seq_len, cfg.train.mlm_probability)
        return int(masked.sum())

    @staticmethod
    def flops_counter(raw_model, attention, cfg):
        """A query sees its micro-batch's padded positions; with FlashAttention-2 its own."""
        def shape_of(lengths):
            padded = padded_length(max(lengths), cfg.train.pad_to_multiple, cfg.train.seq_len)
            if attention == "flash_attention_2":
                return len(lengths) * padded, sum(length * length for length in lengths)
            return len(lengths) * padded, len(lengths) * padded * padded
        return model_flops_counter(raw_model, shape_of)


def export_masked_lm(raw_model, data_dir, meta, final_dir, cfg, device):
    """export_final, with a tokenizer that wraps text in [CLS] ... [SEP] as every sample was."""
    from tokenizers.processors import TemplateProcessing
    export_final(raw_model, data_dir, meta, final_dir, cfg, device)
    core, ids = Tokenizer.from_file(str(final_dir / "tokenizer.json")), meta["special_tokens"]
    cls, sep = core.id_to_token(ids["cls"]), core.id_to_token(ids["sep"])
    core.post_processor = TemplateProcessing(
        single=f"{cls} $A {sep}", pair=f"{cls} $A {sep} $B:1 {sep}:1",
        special_tokens=[(cls, ids["cls"]), (sep, ids["sep"])])
    core.save(str(final_dir / "tokenizer.json"))


def masked_lm_loss(loss_of, cfg, reader):
    """With dynamic padding, the loss given its logits' length as dynamic (dynamic_length)."""
    if reader is not MaskedTokens or not 0 < cfg.train.pad_to_multiple < cfg.train.seq_len:
        return loss_of
    return lambda logits, labels: loss_of(dynamic_length(logits), labels)


def dynamic_length(tensor):
    """Dimension 1 dynamic: one compiled graph for every padded length (maybe_: never fails)."""
    torch._dynamo.maybe_mark_dynamic(tensor, 1)
    return tensor


def padded_length(longest, pad_to_multiple, seq_len):
    """The longest sample rounded up to a multiple of pad_to_multiple (at most seq_len; 0: it)."""
    if pad_to_multiple == 0:
        return seq_len
    return min(-(-longest // pad_to_multiple) * pad_to_multiple, seq_len)


def mask_tokens(tokens, lengths, seed, epochs, sample_ids, special, vocab_size, probability):
    """BERT's masking of a padded micro-batch (a row of token ids per sample): inputs and labels."""
    chosen = masked_positions(seed, epochs, sample_ids, lengths, tokens.shape[1], probability)
    positions = np.arange(tokens.shape[1])
    uniforms = [sample_uniforms(seed, epochs[:, None], sample_ids[:, None], positions, use)
                for use in (1, 2)]
    inputs = np.where(chosen & (uniforms[0] < 0.8), special["mask"], tokens)  # 80% [MASK]
    replaced = chosen & (uniforms[0] >= 0.8) & (uniforms[0] < 0.9)  # 10% a random token, 10% kept
    inputs[replaced] = (uniforms[1][replaced] * vocab_size).astype(np.int64)
    return inputs, np.where(chosen, tokens, IGNORE_INDEX)


def masked_positions(seed, epochs, sample_ids, lengths, width, probability):
    """The positions BERT predicts: each with `probability`, never [CLS], [SEP] or padding."""
    positions = np.arange(width)
    candidates = (positions >= 1) & (positions <= lengths[:, None] - 2)
    uniforms = sample_uniforms(seed, epochs[:, None], sample_ids[:, None], positions, 0)
    return candidates & (uniforms < probability)
# ============================================================================== MLM: end


# ============================================================================== images: begin
# Image classification with ViT (`preprocess.py --images`). Delete it and the lines tagged # images.

# image models' knobs, as config.yaml gives them
DEFAULTS["model"]["patch_size"] = MODEL_KEYS["model.patch_size"] = 0
SHAPE_KEYS["model.patch_size"] = "patch_size"  # a pretrained ViT keeps its own
DEFAULTS["train"].update(crop_padding=4, hflip=False)
RANGES.update(dict.fromkeys(["model.patch_size", "train.crop_padding"], "at least 0"))
# a ViT without a GPU: more steps, no random crops, to reach 90% on the digits within minutes
CPU_PRESET_IMAGES = {"train.max_steps": 1000, "train.eval_every": 250, "train.crop_padding": 0,
                     "optim.lr": 3e-3, "optim.min_lr": 3e-4, "optim.warmup_steps": 50,
                     "checkpoint.every": 250}
DIGITS_DIR = "data/digits"  # where an image model's default data, the digits, is prepared
# a ViT on a GPU on the digits: small and not compiled (compiling takes longer than 1,000 steps)
GPU_PRESET_DIGITS = {"model.n_layer": 2, "model.n_head": 4, "model.n_embd": 128,
                     "train.global_batch_size": 32, "train.micro_batch_size": 32,
                     "train.max_steps": 1000, "train.eval_every": 500, "train.crop_padding": 0,
                     "train.compile": "false", "optim.lr": 3e-3, "optim.min_lr": 3e-4,
                     "optim.warmup_steps": 50, "checkpoint.every": 500}
PRESETS.update(cpu_preset_images=CPU_PRESET_IMAGES, gpu_preset_digits=GPU_PRESET_DIGITS)


def image_preset(flat, name, preset, presets, use_cuda):
    """An image model's preset and its name: cpu_preset_images, gpu_preset_digits or images."""
    if not image_model_type(flat["model.type"], flat["model.pretrained"]):
        return name, preset
    if flat["model.type"] == "vit" and not use_cuda:
        name, preset = "cpu_preset + cpu_preset_images", {**preset, **presets["cpu_preset_images"]}
    elif flat["model.type"] == "vit" and flat["data.dir"] in (DEFAULTS["data"]["dir"], DIGITS_DIR):
        name, preset = "gpu_preset_digits", presets["gpu_preset_digits"]
    return name or "images", {**preset, "data.dir": DIGITS_DIR}


def prepare_images_command(data_dir):
    source = "" if str(data_dir) == DIGITS_DIR else " YOUR_IMAGES"
    return f"python preprocess.py --images{source} --out {data_dir}"


def image_model_type(model_type, pretrained):
    """The model's type (model.pretrained's where given) if it classifies images, else None."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES
    model_type = load_pretrained_config(pretrained).model_type if pretrained else model_type
    return model_type if model_type in MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES else None


def image_reader(cfg, reader):
    """ArrowImages for a ViT, refusing what does not apply to images; else reader."""
    model_type = image_model_type(cfg.model.type, cfg.model.pretrained)
    if model_type is None:
        unused = not_at_default(cfg, ["model.patch_size", "train.crop_padding", "train.hflip"])
        for key, value, default in unused:  # refused, not silently ignored
            die(f"{key}={value} applies to image models, and this run trains none -> leave it at "
                f"{default}")
        return reader
    if model_type != "vit":
        die(f"model.type={model_type}: the image path trains ViT models -> use model.type=vit")
    reasons = {"model.task": "an image model classifies",  # the other parts' keys, where here
               "model.embedding_gpu_rows": "a ViT has no token embedding",
               "model.tie_word_embeddings": "a ViT has no token embedding"}
    for key, value, default in not_at_default(cfg, reasons):
        die(f"{key}={value} does not apply to images ({reasons[key]}) -> leave it at {default}")
    return ArrowImages


def vit_config(cfg, meta):
    """A ViT of model.*'s shape for meta.json's images and classes, or model.pretrained's."""
    size, classes = meta["image_size"], meta["classes"]
    if cfg.train.crop_padding > size:  # F.pad would make each image (size + 2 x padding)^2
        die(f"train.crop_padding={cfg.train.crop_padding} is more than the images' {size} pixels "
            f"-> give at most {size}")
    labels = dict(num_labels=len(classes), id2label=dict(enumerate(classes)),
                  label2id={name: i for i, name in enumerate(classes)})
    if cfg.model.pretrained:
        config = load_pretrained_config(cfg.model.pretrained)
        if config.image_size != size:
            die(f"{cfg.model.pretrained} was trained on {config.image_size}-pixel images, "
                f"{cfg.data.dir} holds {size}-pixel ones -> prepare them with --image-size "
                f"{config.image_size}")
        config.update(labels)
        return config
    # the largest patch up to 16 (ViT-B/16) that divides the images into 4 x 4 patches or more
    patch = cfg.model.patch_size or max(
        [side for side in range(1, min(16, size // 4) + 1) if size % side == 0], default=0)
    if patch == 0:
        die(f"the images are {size} pixels, too few for 4 x 4 patches -> prepare them with "
            "--image-size 4 or more")
    if size % patch:
        die(f"the images are {size} pixels, not a multiple of model.patch_size={patch} -> give a "
            "model.patch_size that divides it")
    return AutoConfig.for_model(
        "vit", hidden_size=cfg.model.n_embd, num_hidden_layers=cfg.model.n_layer,
        num_attention_heads=cfg.model.n_head, image_size=size, patch_size=patch,
        intermediate_size=cfg.model.intermediate_size or 4 * cfg.model.n_embd, **labels)


def keep_or_renew_classifier(model, cfg, meta):
    """A pretrained classifier stays for the same class names in order, else it starts anew."""
    pretrained = load_pretrained_config(cfg.model.pretrained)
    names, classes = [pretrained.id2label[i] for i in range(pretrained.num_labels)], meta["classes"]
    if names == classes:
        log0(f"the classifier of model.pretrained is kept: the same {len(classes)} classes")
        return
    with torch.no_grad():  # as ViT initialises a linear layer
        torch.nn.init.trunc_normal_(model.classifier.weight, std=model.config.initializer_range)
        torch.nn.init.zeros_(model.classifier.bias)
    same_count = ", other names" if len(names) == len(classes) else ""
    log0(f"a new classifier for {len(classes)} classes (model.pretrained has {len(names)}"
         f"{same_count}): it starts from random weights")


def vit_flops_counter(raw_model, attention, cfg):
    """A ViT's FLOPs per image as model_flops_counter counts them, over patches + 1 positions; the
    patch projection 4 per weight (the pixels need no gradient), the classifier one position."""
    config = raw_model.config
    patches = (config.image_size // config.patch_size) ** 2
    positions = patches + 1
    linear = sum(m.weight.numel() for block in repeated_blocks(raw_model) for m in block.modules()
                 if isinstance(m, torch.nn.Linear))
    projection = raw_model.vit.embeddings.patch_embeddings.projection.weight.numel()
    head = raw_model.classifier.weight.numel()
    per_image = (6 * linear * positions + 12 * config.num_hidden_layers * config.hidden_size *
                 positions ** 2 + 4 * projection * patches + 6 * head)
    return lambda lengths: per_image * sum(len(micro_batch) for micro_batch in lengths)


def export_image_model(raw_model, data_dir, meta, final_dir, cfg, device):
    """save_pretrained and an image processor that prepares images as preprocess.py did."""
    size = meta["image_size"]
    if raw_model.config._attn_implementation == "sdpa_unmasked":  # registered in this process only
        raw_model.set_attn_implementation("sdpa")
    raw_model.save_pretrained(final_dir)
    # load_image made it RGB; converting again (transformers 5.24) whitens a GIF's clear colour
    processor = {"image_processor_type": "BitImageProcessor", "do_convert_rgb": False,
                 "do_resize": True, "size": {"shortest_edge": size}, "resample": 3,
                 "do_center_crop": True, "crop_size": {"height": size, "width": size},
                 "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": True,
                 "image_mean": meta["mean"], "image_std": meta["std"]}
    (final_dir / "preprocessor_config.json").write_text(json.dumps(processor, indent=2) + "\n")
    log0(f"exported the model and its image processor to {final_dir}")


class ArrowImages:
    """A split's images, memory-mapped from Arrow files: sample i is image i (uint8 HxWxRGB) and its
    label, of "length" 1: the text path's token counts count images here."""
    task, kind, unit, seq_len, sdpa = "image", "images", "images", 1, "sdpa_unmasked"  # no mask
    model_class = transformers.AutoModelForImageClassification
    prepare_command, model_config = staticmethod(prepare_images_command), staticmethod(vit_config)
    adapt_pretrained = staticmethod(keep_or_renew_classifier)
    flops_counter, export = staticmethod(vit_flops_counter), staticmethod(export_image_model)
    plan, label_count = ArrowTokens.plan, ArrowTokens.label_count  # as text's, one label an image

    def __init__(self, data_dir, meta, split, seq_len):
        size, classes = meta.get("image_size"), meta.get("classes")
        rebuild = f"-> rebuild: {prepare_images_command(data_dir)} --force"
        if not (isinstance(size, int) and size > 0 and isinstance(classes, list)
                and len(classes) > 1 and meta.get("channels") == 3
                and all(isinstance(meta.get(key), list) and len(meta[key]) == 3
                        for key in ("mean", "std"))):
            die(f"{data_dir / 'meta.json'} lacks image_size, classes (two or more), channels=3, "
                f"mean or std {rebuild}")
        self.size, self.classes = meta["image_size"], list(meta["classes"])
        self.mean, self.std, self.on_device = meta["mean"], meta["std"], {}
        self.augment = split == "train"  # the val split is read as it is
        self.summary = f"{len(self.classes)} classes, {self.size}x{self.size} pixels"
        row_bytes, pieces, labels = self.size * self.size * 3, [], []
        for name in meta["splits"][split]["files"]:
            try:
                table = pa.ipc.open_file(pa.memory_map(str(data_dir / name))).read_all()
            except (OSError, pa.ArrowInvalid) as error:
                die(f"cannot read {data_dir / name} ({error}) {rebuild}")
            if not {"pixels", "label"} <= set(table.column_names) or table.schema.field(
                    "pixels").type != pa.binary(row_bytes):
                die(f"{data_dir / name} has no pixels column of {self.size}x{self.size} RGB "
                    f"images {rebuild}")
            for chunk in (chunk for chunk in table.column("pixels").chunks if len(chunk)):
                if chunk.null_count:
                    die(f"{data_dir / name} has images without pixels {rebuild}")
                flat = np.frombuffer(chunk.buffers()[1], dtype=np.uint8)  # no copy
                pieces.append(flat[chunk.offset * row_bytes:][:len(chunk) * row_bytes].reshape(
                    len(chunk), self.size, self.size, 3))
            labels.append(table.column("label").to_numpy().astype(np.int64))
        self.labels = np.concatenate(labels) if labels else np.zeros(0, dtype=np.int64)
        if len(self.labels) and not 0 <= self.labels.min() <= self.labels.max() < len(self.classes):
            die(f"the {split} split of {data_dir} has labels outside 0..{len(self.classes) - 1} "
                f"{rebuild}")
        self.pieces, self.piece_starts = pieces, np.cumsum([0] + [len(p) for p in pieces])
        if len(self.labels) == 0:
            more = (f"rebuild it with a larger --val-fraction F: "
                    f"{prepare_images_command(data_dir)} --val-fraction F --force") \
                if split == "val" else "prepare more images"
            die(f"the {split} split of {data_dir} has no images -> {more}")

    def __len__(self):
        return len(self.labels)

    def length(self, index):
        return 1

    def model_summary(self, config):
        patches = (config.image_size // config.patch_size) ** 2
        return f"{patches} patches of {config.patch_size}x{config.patch_size}, " \
               f"{config.num_labels} classes"

    def validation_batches(self, cfg):  # the whole split, each image once (micro_batch)
        return -(-len(self) // cfg.train.global_batch_size)

    def pixels(self, sample_ids):
        pieces = np.searchsorted(self.piece_starts, sample_ids, side="right") - 1
        out = np.empty((len(sample_ids), self.size, self.size, 3), dtype=np.uint8)
        for piece in np.unique(pieces):
            rows = pieces == piece
            out[rows] = self.pieces[piece][sample_ids[rows] - self.piece_starts[piece]]
        return out

    def micro_batch(self, sample_ids, epochs, cfg, device):
        """uint8 to the device, there cropped, flipped and normalised by hashes of (seed, epoch,
        sample); validation ignores the labels past the split's end (epochs > 0)."""
        sample_ids = np.asarray(sample_ids, dtype=np.int64)
        epochs = np.asarray(epochs, dtype=np.int64)
        pixels = torch.from_numpy(self.pixels(sample_ids))
        labels = torch.from_numpy(self.labels[sample_ids])
        if not self.augment:
            labels[torch.from_numpy(epochs > 0)] = IGNORE_INDEX
        size, pad = self.size, cfg.train.crop_padding if self.augment else 0
        uniforms = sample_uniforms(cfg.train.seed, epochs[:, None], sample_ids[:, None], [0, 1, 2],
                                   3)
        shifts = torch.from_numpy((uniforms[:, :2] * (2 * pad + 1)).astype(np.int64))  # 0..2 x pad
        flips = torch.from_numpy((uniforms[:, 2] < 0.5) & (self.augment and cfg.train.hflip))
        if device.type == "cuda":  # from pinned memory the copies do not make the host wait
            pixels, labels, shifts, flips = (tensor.pin_memory().to(device, non_blocking=True)
                                             for tensor in (pixels, labels, shifts, flips))
        images = pixels.permute(0, 3, 1, 2)  # batch x RGB x height x width, as the model reads them
        if pad or (cfg.train.hflip and self.augment):
            framed = F.pad(images, (pad, pad, pad, pad))
            steps = torch.arange(size, device=images.device)
            rows = shifts[:, 0, None] + steps
            cols = shifts[:, 1, None] + torch.where(flips[:, None], size - 1 - steps, steps)
            batch_index = torch.arange(len(images), device=images.device)[:, None, None, None]
            channels = torch.arange(3, device=images.device)[None, :, None, None]
            images = framed[batch_index, channels, rows[:, None, :, None], cols[:, None, None, :]]
        if device not in self.on_device:  # mean and 255 x std as (1, 3, 1, 1) tensors, made once
            self.on_device[device] = [torch.tensor(values, device=device).view(1, 3, 1, 1)
                                      for values in (self.mean, [255 * s for s in self.std])]
        mean, scale = self.on_device[device]
        pixel_values = (images.float() - 255 * mean) / scale  # (x / 255 - mean) / std
        return {"inputs": {"pixel_values": pixel_values}, "labels": labels, "host_input_ids": None}


def check_classes(train_state, meta, path, cfg):
    classes = train_state.get("classes", meta.get("classes"))
    if classes != meta.get("classes"):
        die(f"checkpoint {path} was trained on the classes {classes}, {cfg.data.dir} has "
            f"{meta.get('classes') or 'none (text)'} -> give its data.dir, or another "
            "checkpoint.dir")


# ============================================================================== images: end


# ============================================================================== metrics: begin
# TensorBoard, Prometheus, NVML's GPU utilisation, and the all-reduces timed. Delete this block and
# the lines tagged # metrics: metrics.jsonl stays.

def start_exporters(cfg, step, device):
    """Each exporter asked for, or None where its package is missing (said in one line)."""
    exporters, outputs = SimpleNamespace(tensorboard=None, prometheus=None), []
    if cfg.log.tensorboard and dist.get_rank() == 0:
        try:
            from torch.utils.tensorboard import SummaryWriter
            # a resumed run replays the steps after its checkpoint: purge_step hides the first run's
            exporters.tensorboard = SummaryWriter(Path(cfg.out_dir) / "tensorboard",
                                                  purge_step=step + 1 if step else None)
            outputs.append(f"TensorBoard {Path(cfg.out_dir) / 'tensorboard'}")
        except ImportError:
            log0("note: no TensorBoard logs: tensorboard is not installed -> pip install "
                 "tensorboard, or log.tensorboard=false")
    if cfg.log.prometheus_port:
        exporters.prometheus = on_all_ranks(start_prometheus, cfg.log.prometheus_port +
                                            int(os.environ.get("LOCAL_RANK", "0")))
        outputs += [f"Prometheus on port {cfg.log.prometheus_port} + local rank, every interface, "
                    "/metrics"] if exporters.prometheus else []
    exporters.gpu_util = gpu_util_reader(device, cfg.log.gpu_util) or (lambda: None)
    log0(f"metrics: {', '.join([str(Path(cfg.out_dir) / 'metrics.jsonl'), *outputs])}")
    return exporters


def start_prometheus(port):
    """prometheus_client's server for this process's gauges; its own registry, so a second run in
    one process does not register its gauges twice. None without the package."""
    try:
        import prometheus_client
    except ImportError:
        return log0("note: no Prometheus endpoint: prometheus_client is not installed -> pip "
                    "install prometheus_client")
    registry = prometheus_client.CollectorRegistry()
    try:
        server, _ = prometheus_client.start_http_server(port, registry=registry)
    except (OSError, OverflowError) as error:
        die(f"cannot serve Prometheus metrics on port {port} ({first_line(error)}) -> choose "
            "another log.prometheus_port (each process takes it + its local rank), or 0 for none")
    return SimpleNamespace(client=prometheus_client, registry=registry, server=server, gauges={})


def export_metrics(setup, record):
    """The record with this block's figures, each number to TensorBoard (rank 0) and a gauge."""
    exporters = setup.exporters
    if record["kind"] == "train":
        record = {**record, "gpu_util": exporters.gpu_util()}
        record.update(comm_figures(getattr(setup.parallel, "comm_times", None)))  # DDP
    numbers = {key: value for key, value in record.items()
               if isinstance(value, (int, float)) and not isinstance(value, bool) and key != "step"}
    if exporters.tensorboard and record["kind"] != "start":
        for key, value in numbers.items():
            exporters.tensorboard.add_scalar(f"{record['kind']}/{key}", value, record["step"])
    if exporters.prometheus and record["kind"] != "start":
        gauges = exporters.prometheus.gauges.setdefault(record["kind"], {})
        if record["kind"] == "train":
            numbers["step"] = record["step"]  # last: a scrape reading step N reads no older value
        for key in gauges.keys() - numbers.keys():  # null this time: NaN, not an old number
            gauges[key].set(float("nan"))
        for key, value in numbers.items():
            if key not in gauges:
                gauges[key] = exporters.prometheus.client.Gauge(
                    f"trainer_{key}", f"metrics.jsonl's {key} ({record['kind']} records)", ["rank"],
                    registry=exporters.prometheus.registry).labels(rank=str(dist.get_rank()))
            gauges[key].set(value)
    return record


def gpu_util_reader(device, enabled):
    """A function giving NVML's GPU utilisation (a waiting collective counts as busy), or None."""
    if device.type != "cuda" or not enabled:
        return None
    try:
        import pynvml
    except ImportError:
        return log0("note: no GPU utilisation: pynvml is not installed -> pip install "
                    "nvidia-ml-py, or log.gpu_util=false")
    try:
        pynvml.nvmlInit()
        # by UUID, not index: CUDA numbers the GPUs CUDA_VISIBLE_DEVICES leaves, NVML all by PCI bus
        uuid = torch.cuda.get_device_properties(device).uuid
        handle = pynvml.nvmlDeviceGetHandleByUUID(f"GPU-{uuid}")
        pynvml.nvmlDeviceGetUtilizationRates(handle)  # where NVML cannot tell, say so now
    except pynvml.NVMLError as error:
        return log0(f"note: no GPU utilisation: NVML: {first_line(error)}")

    def read():
        with contextlib.suppress(pynvml.NVMLError):
            return pynvml.nvmlDeviceGetUtilizationRates(handle).gpu

    return read


def stop_exporters(exporters):
    if exporters.tensorboard:
        exporters.tensorboard.close()
    if exporters.prometheus:
        exporters.prometheus.server.shutdown()
        exporters.prometheus.server.server_close()  # frees the port at once


def timed(parallel, hook):
    """Time the all-reduces and the communication backward did not hide, without a host wait: our
    reducers' calls wrapped, or for DDP the comm hook to register (`hook` or torch's own)."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
    times = parallel.comm_times = SimpleNamespace(allreduce=[], exposed=[])  # (start, end) each

    def ended(future, started, spans):
        future.then(lambda _: spans.append((started, time_stamp())))
        return future

    def timed_hook(state, bucket):
        backward_end = time_stamp() if bucket.is_last() else None  # ready as backward ends
        future = (hook or allreduce_hook)(state, bucket)
        ended(future, time_stamp(), times.allreduce)  # started: the hook has divided or cast
        return future if backward_end is None else ended(future, backward_end, times.exposed)

    def timed_all_reduce(flat):
        started, work = time_stamp(), all_reduce(flat)
        ended(work.get_future(), started, times.allreduce)
        return work

    def timed_wait(works):  # our reducers wait after backward: the whole wait is exposed
        started = time_stamp()
        wait(works)
        times.exposed.append((started, time_stamp()))

    if not isinstance(parallel, NaiveReducer):  # InlineReducer is one too
        return timed_hook
    all_reduce, wait = parallel.all_reduce, parallel.wait
    parallel.all_reduce, parallel.wait = timed_all_reduce, timed_wait
    return None


def time_stamp():
    """Now: on a GPU an event on the current stream, read at the log line; else the host clock."""
    if not torch.cuda.is_available():
        return time.perf_counter()
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return event


def comm_figures(times):
    """The interval's p50/p95 all-reduce ms and exposed communication per step (None: untimed)."""
    latency_ms = span_ms(times.allreduce) if times else []
    exposed_ms = [max(0.0, ms) for ms in span_ms(times.exposed)] if times else []
    percentile = {q: float(np.percentile(latency_ms, q)) if latency_ms else None for q in (50, 95)}
    return {"comm_exposed_ms": sum(exposed_ms) / len(exposed_ms) if exposed_ms else None,
            "allreduce_p50_ms": percentile[50], "allreduce_p95_ms": percentile[95]}


def span_ms(spans):
    """Each (start, end) of the list in ms, removed from it (one a late callback adds stays)."""
    count = len(spans)
    latency_ms = [1000 * (end - start) if isinstance(start, float) else
                  end.synchronize() or start.elapsed_time(end) for start, end in spans[:count]]
    del spans[:count]
    return latency_ms
# ============================================================================== metrics: end


# ============================================================================== tiered: begin
# model.embedding_gpu_rows=K: the input embedding's K most frequent tokens' rows on the GPU, the
# others in CPU memory. Delete this block and the lines tagged # tiered: one table on the GPU.

def tier_embedding(raw_model, data_dir, meta, cfg, precision, device):
    """A TieredEmbedding in place of the input embedding, before the model goes to the GPU."""
    if not cfg.model.embedding_gpu_rows:
        return
    embedding, output, rows = raw_model.get_input_embeddings(), raw_model.get_output_embeddings(), \
        cfg.model.embedding_gpu_rows
    rebuild = f"-> rebuild the data: {prepare_command(data_dir)} --force"
    if output is not None and output.weight is embedding.weight:
        die("model.embedding_gpu_rows needs an untied output layer (a tied one reads every row "
            "each step) -> set model.tie_word_embeddings=false")
    if precision == "fp16":
        die("model.embedding_gpu_rows does not train in fp16: the grad scaler would not see the "
            "gradient of the rows in CPU memory -> use train.precision=bf16 or fp32")
    if not isinstance(embedding, torch.nn.Embedding):
        die(f"model.embedding_gpu_rows splits a torch.nn.Embedding; this model's input embedding "
            f"is a {type(embedding).__name__} -> set model.embedding_gpu_rows=0")
    if rows >= embedding.num_embeddings:
        die(f"model.embedding_gpu_rows={rows} is not below the embedding's "
            f"{embedding.num_embeddings} rows -> set it lower, or 0 for one table")
    frequency_file = data_dir / meta.get("token_frequencies_file", "token_frequencies.npy")
    try:
        frequencies = np.load(frequency_file)
    except (OSError, ValueError) as error:
        die(f"model.embedding_gpu_rows needs the token frequencies of the data, and "
            f"{frequency_file} cannot be read ({first_line(error)}) {rebuild}")
    if frequencies.shape != (meta["vocab_size"],):
        die(f"{frequency_file} holds {frequencies.size} counts for a vocabulary of "
            f"{meta['vocab_size']} {rebuild}")
    user_set = {"PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"} & set(os.environ)
    if device.type == "cuda" and not user_set:
        # a step's CPU rows vary in number, so its GPU tensors change size at every step: with the
        # allocator's expandable segments (set before our first allocation) they do not fragment it
        torch.cuda.memory._set_allocator_settings("expandable_segments:True")
    hot_ids = hottest_token_ids(frequencies, embedding.num_embeddings, rows)
    tiered = TieredEmbedding(embedding, hot_ids, device)
    raw_model.set_input_embeddings(tiered)
    counted = hot_ids[hot_ids < len(frequencies)].numpy()
    covered = frequencies[counted].sum() / max(1, frequencies.sum())
    log0(f"input embedding tiered: the rows of the {len(hot_ids):,} most frequent tokens "
         f"({100 * covered:.1f}% of the train tokens) on {device.type}, the other "
         f"{len(tiered.cold_ids):,} in CPU memory (not counted below)")


def hottest_token_ids(frequencies, rows, count):
    """The `count` most frequent of `rows` token ids; a stable sort: every rank picks the same."""
    counts = np.zeros(rows, np.int64)
    counts[:min(rows, len(frequencies))] = frequencies[:rows]
    return torch.from_numpy(np.argsort(-counts, kind="stable")[:count].copy())


def stage_tiered(raw_model, split_data, position, batches, cfg):
    embedding = raw_model.get_input_embeddings()
    if isinstance(embedding, TieredEmbedding):
        embedding.stage(batches[0], step_input_ids(split_data, position, cfg, batches[0]))


def end_tiered_step(raw_model, optimizer, skipped):
    """After the optimizer's update: lazy AdamW on the step's CPU rows (TieredEmbedding.step)."""
    embedding = raw_model.get_input_embeddings()
    if isinstance(embedding, TieredEmbedding):
        embedding.updates += 1
        if embedding.updates == 2:  # the step's rows and the next step's are all there
            held = sorted(embedding.held_mib(optimizer).items())
            log0("input embedding tiered, held at its second step: "
                 + ", ".join(f"{mib:,.1f} MiB on {kind}" for kind, mib in held))
        group = optimizer.param_groups[0]
        embedding.step(group["lr"], group["betas"], group["eps"], group["weight_decay"], skipped)


def untier(raw_model, device):
    """One nn.Embedding in token id order again, as save_pretrained and from_pretrained expect."""
    embedding = raw_model.get_input_embeddings()
    if isinstance(embedding, TieredEmbedding):
        raw_model.set_input_embeddings(embedding.merged().to(device))


def step_input_ids(split_data, position, cfg, micro_batches):
    """Every input id of the global batch at `position`, all ranks' (from the shared plan)."""
    plan = split_data.plan(position, cfg.train.seed, cfg, dist.get_world_size())
    others = [split_data.micro_batch(ids, epochs, cfg, torch.device("cpu"))["inputs"]["input_ids"]
              for rank, rank_plan in enumerate(plan) if rank != dist.get_rank()
              for ids, epochs in rank_plan]
    others = [ids.flatten() for ids in others]
    return torch.cat([batch["host_input_ids"].flatten() for batch in micro_batches] + others)


class TieredEmbedding(torch.nn.Module):
    """An input embedding split by token frequency (docs/tiered-embedding.md): hot rows are the GPU
    parameter hot_weight; cold rows live in CPU memory with lazy AdamW state, and a step's go to
    the GPU once as `rows`, a parameter for that step. Id i is slot_of_id[i] of cat(hot, cold)."""

    def __init__(self, embedding, hot_ids, device):
        super().__init__()
        weight = embedding.weight.detach().cpu()
        self.width, self.padding_idx, self.device = weight.shape[1], embedding.padding_idx, device
        self.set_tiers(hot_ids, weight.shape[0])
        self.hot_weight = torch.nn.Parameter(weight[self.hot_ids].clone())
        self.rows = None  # this step's CPU rows on the GPU: a parameter from forward to step()
        # plain attributes: model.to() and DDP leave them be; get_extra_state saves them
        self.cold_weight = weight[self.cold_ids].clone()
        self.cold_exp_avg = torch.zeros_like(self.cold_weight)
        self.cold_exp_avg_sq = torch.zeros_like(self.cold_weight)
        self.cold_steps = torch.zeros(len(self.cold_ids), dtype=torch.long)  # a count per row
        # one side stream, made once: every copy goes on it, in order, beside the compute
        self.copy_stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.staged = self.current = self.written = None  # next step's, this step's, last written
        self.updates = 0  # steps ended in this process

    def set_tiers(self, hot_ids, vocab_rows):
        is_hot = torch.zeros(vocab_rows, dtype=torch.bool)
        is_hot[hot_ids] = True
        self.hot_ids, self.cold_ids = hot_ids, (~is_hot).nonzero().flatten()
        self.hot_rows = len(hot_ids)
        self.slot_of_id = torch.empty(vocab_rows, dtype=torch.long)
        self.slot_of_id[self.hot_ids] = torch.arange(self.hot_rows)
        self.slot_of_id[self.cold_ids] = torch.arange(self.hot_rows, vocab_rows)

    def cold_tables(self):
        return [self.cold_weight, self.cold_exp_avg, self.cold_exp_avg_sq, self.cold_steps]

    def stage(self, micro_batches, step_ids):
        """Start copying a step's cold rows (of step_ids, the global batch's) to the GPU; rows the
        step before holds come from its update on the GPU, which the CPU tables may lack yet."""
        self.write_to_tables()  # the last update, whose rows may be gathered below
        step_slots = self.slot_of_id[step_ids]
        slots = torch.unique(step_slots[step_slots >= self.hot_rows])  # sorted; alike on every rank
        table_indices = []  # per micro-batch, each position's row in cat([hot_weight, step's rows])
        for batch in micro_batches:
            index = self.slot_of_id[batch["host_input_ids"]]
            is_cold = index >= self.hot_rows
            index[is_cold] = self.hot_rows + torch.searchsorted(slots, index[is_cold])
            table_indices.append(index)
        previous = self.current.slots if self.current is not None else slots[:0]
        place = torch.searchsorted(previous, slots).clamp_(max=max(0, len(previous) - 1))
        carried = (previous[place] == slots if len(previous) else
                   torch.zeros(len(slots), dtype=torch.bool))
        fresh_rows, pin = slots[~carried] - self.hot_rows, self.copy_stream is not None
        fresh = [torch.index_select(table, 0, fresh_rows, out=torch.empty(
            (len(fresh_rows), *table.shape[1:]), dtype=table.dtype, pin_memory=pin))  # no host wait
            for table in self.cold_tables()]
        positions = [(~carried).nonzero().flatten(), carried.nonzero().flatten(), place[carried]]
        ready = None
        if self.copy_stream is not None:
            with torch.cuda.stream(self.copy_stream):
                table_indices, fresh, positions = (
                    [tensor.pin_memory().to(self.device, non_blocking=True) for tensor in tensors]
                    for tensors in (table_indices, fresh, positions))
                ready = torch.cuda.Event()
                ready.record()
        self.staged = SimpleNamespace(slots=slots, table_indices=table_indices, fresh=fresh,
                                      positions=positions, previous=self.current, ready=ready,
                                      padding_index=self.padding_index(slots))

    def padding_index(self, cold_slots):
        """padding_idx's row in cat([hot_weight, cold_slots' rows]) (no gradient reaches it)."""
        pad_slot = int(self.slot_of_id[self.padding_idx]) if self.padding_idx is not None else None
        if pad_slot is None or pad_slot < self.hot_rows:
            return pad_slot
        found = int(torch.searchsorted(cold_slots, pad_slot))
        present = found < len(cold_slots) and int(cold_slots[found]) == pad_slot
        return self.hot_rows + found if present else None

    @torch.no_grad()
    def start_step(self):
        """The staged rows as this step's GPU tensors; the compute stream waits for the copy."""
        staged, self.staged = self.staged, None
        fresh_at, carried_at, carried_from = staged.positions
        if staged.ready is not None:
            compute_stream = torch.cuda.current_stream(self.device)
            compute_stream.wait_event(staged.ready)
            # made on the side stream, read here: else freed memory could go to the next copy early
            for tensor in [*staged.table_indices, *staged.fresh, *staged.positions]:
                if tensor.numel():
                    tensor.record_stream(compute_stream)
        old = staged.previous
        carried = [old.rows, old.exp_avg, old.exp_avg_sq, old.steps] if old else []
        state = []
        for index, fresh in enumerate(staged.fresh):
            values = torch.empty((len(staged.slots), *fresh.shape[1:]), dtype=fresh.dtype,
                                 device=self.device)
            values[fresh_at] = fresh
            if len(carried_at):
                values[carried_at] = carried[index][carried_from]
            state.append(values)
        self.rows = torch.nn.Parameter(state[0])  # for the step: the gradient norm counts it
        self.rows.register_post_accumulate_grad_hook(self.gradient_ready)
        self.current = SimpleNamespace(slots=staged.slots, rows=self.rows, exp_avg=state[1],
                                       exp_avg_sq=state[2], steps=state[3], backwards=0,
                                       table_indices=staged.table_indices,
                                       micro_batches=len(staged.table_indices),
                                       padding_index=staged.padding_index)

    def gradient_ready(self, rows):
        """After the first backward write the last update to the CPU tables (the GPU is busy); after
        the last, average the gradient over the ranks, as DDP does the hot rows'."""
        self.current.backwards += 1
        if self.current.backwards == 1:
            self.write_to_tables()
        last = self.current.backwards == self.current.micro_batches
        if last and dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(rows.grad)  # every rank holds the same rows in the same order
            rows.grad.div_(dist.get_world_size())

    @torch.compiler.disable  # host work (a list, CPU tensors): the compiled graph breaks here
    def forward(self, input_ids):
        if torch.is_grad_enabled():  # training: the staged rows of this micro-batch
            if self.rows is None and self.staged is not None:
                self.start_step()  # the step's first micro-batch
            if self.rows is None or not self.current.table_indices:  # its rows would not be updated
                raise RuntimeError("TieredEmbedding: a training forward pass needs its micro-batch "
                                   "staged -> stage() its step first, as train_ddp.py does")
            table_index = self.current.table_indices.pop(0)
            if table_index.shape != input_ids.shape:
                raise RuntimeError(f"TieredEmbedding: staged a micro-batch of "
                                   f"{tuple(table_index.shape)}, got {tuple(input_ids.shape)}")
            return F.embedding(table_index, torch.cat([self.hot_weight, self.rows]),
                               padding_idx=self.current.padding_index)
        # validation and generate(): the rows from the CPU tables (one wait for the GPU per call)
        self.write_to_tables()
        slots = self.slot_of_id[input_ids.cpu()]
        is_cold = slots >= self.hot_rows
        cold_slots, position = torch.unique(slots[is_cold], return_inverse=True)
        slots[is_cold] = self.hot_rows + position
        rows = self.cold_weight[cold_slots - self.hot_rows].to(self.device)
        return F.embedding(slots.to(self.device), torch.cat([self.hot_weight, rows]),
                           padding_idx=self.padding_index(cold_slots))

    @torch.no_grad()
    def step(self, lr, betas, eps, weight_decay, skipped):
        """Lazy AdamW (torch's formula, a step count per row) on this step's CPU rows, on the GPU:
        an unused row keeps its weight and moments. The rows then go back on the side stream."""
        state, self.rows = self.current, None  # the parameter ends with the step
        if skipped:
            return
        weight = state.rows
        grad = weight.grad if weight.grad is not None else torch.zeros_like(weight)
        state.steps += 1
        weight.mul_(1 - lr * weight_decay)
        state.exp_avg.lerp_(grad, 1 - betas[0])
        state.exp_avg_sq.mul_(betas[1]).addcmul_(grad, grad, value=1 - betas[1])
        step_size = (lr / (1 - betas[0] ** state.steps.double())).float()[:, None]
        bias_correction2_sqrt = (1 - betas[1] ** state.steps.double()).sqrt().float()[:, None]
        denominator = state.exp_avg_sq.sqrt().div_(bias_correction2_sqrt).add_(eps)
        weight.sub_(torch.div(state.exp_avg, denominator).mul_(step_size))  # -step_size * m / denom
        updated, done = [weight.detach(), state.exp_avg, state.exp_avg_sq, state.steps], None
        if self.copy_stream is not None:
            self.copy_stream.wait_stream(torch.cuda.current_stream(self.device))  # after the update
            with torch.cuda.stream(self.copy_stream):
                host = [torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
                        for tensor in updated]
                for target, tensor in zip(host, updated):
                    target.copy_(tensor, non_blocking=True)
                    tensor.record_stream(self.copy_stream)  # may be freed before this copy ends
                done = torch.cuda.Event()
                done.record()
            updated = host
        # on a CPU the tensors themselves: start_step makes new ones, nothing writes these before
        self.written = SimpleNamespace(rows=state.slots - self.hot_rows, values=updated, done=done)

    def write_to_tables(self):
        """Put the rows the last step() updated into the CPU tables, once their copy is done."""
        written, self.written = self.written, None
        if written is not None:
            if written.done is not None:
                written.done.synchronize()
            for table, values in zip(self.cold_tables(), written.values):
                table.index_copy_(0, written.rows, values)

    def held_mib(self, optimizer):
        tensors = [self.hot_weight, self.hot_weight.grad, *self.cold_tables(),
                   *optimizer.state.get(self.hot_weight, {}).values()]
        if self.current is not None:
            tensors += [self.current.rows, self.current.rows.grad, self.current.exp_avg,
                        self.current.exp_avg_sq, self.current.steps]
        held = {}
        for tensor in tensors + (self.staged.fresh if self.staged is not None else []):
            if torch.is_tensor(tensor) and tensor.dim() > 0:
                held[tensor.device.type] = held.get(tensor.device.type, 0) + tensor.numel() * \
                    tensor.element_size() / 2**20
        return held

    def get_extra_state(self):
        """The cold rows, their lazy AdamW state and the tier map: in the state dict (model.pt)."""
        self.write_to_tables()
        return {"hot_ids": self.hot_ids, "cold_weight": self.cold_weight,
                "cold_exp_avg": self.cold_exp_avg, "cold_exp_avg_sq": self.cold_exp_avg_sq,
                "cold_steps": self.cold_steps}

    def set_extra_state(self, state):
        if state["cold_weight"].shape != self.cold_weight.shape:
            raise ValueError(f"its CPU embedding rows are {tuple(state['cold_weight'].shape)}, "
                             f"this model's {tuple(self.cold_weight.shape)}")
        # the checkpoint's tier map, not today's frequency file's: hot_weight holds these ids' rows
        self.set_tiers(state["hot_ids"], len(self.slot_of_id))
        self.cold_weight, self.cold_exp_avg = state["cold_weight"], state["cold_exp_avg"]
        self.cold_exp_avg_sq, self.cold_steps = state["cold_exp_avg_sq"], state["cold_steps"]
        self.staged = self.current = self.written = self.rows = None  # rows of the old tables

    def merged(self):
        """One nn.Embedding in token id order, as transformers' save_pretrained expects."""
        self.write_to_tables()
        weight = torch.empty((len(self.slot_of_id), self.width))
        weight[self.hot_ids] = self.hot_weight.detach().cpu()
        weight[self.cold_ids] = self.cold_weight
        return torch.nn.Embedding.from_pretrained(weight, freeze=False,
                                                  padding_idx=self.padding_idx)
# ============================================================================== tiered: end


# ============================================================================== fp8: begin
# train.precision=fp8: the blocks' linear layers multiply in float8 (torchao, tensorwise), the rest
# as bf16; weights stay fp32, so checkpoints and export are a bf16 run's. MFU: the bf16 peak.

def fp8_refusal(device, use_compile):
    """Why fp8 cannot pay here, or None: it needs float8 tensor cores, torch.compile and torchao."""
    import importlib.util

    if device.type != "cuda":
        return ("train.precision=fp8 needs an NVIDIA GPU with float8 tensor cores (compute "
                "capability 8.9 or later) -> use train.precision=bf16 or fp32 here")
    capability = torch.cuda.get_device_capability(device)
    if capability < (8, 9):
        return (f"train.precision=fp8 needs float8 tensor cores (compute capability 8.9 or later), "
                f"and {torch.cuda.get_device_name(device)} has {capability[0]}.{capability[1]} -> "
                "use train.precision=bf16")
    if not use_compile:
        return ("train.precision=fp8 needs torch.compile: eager, each float8 cast is a kernel of "
                "its own -> drop train.compile=false, or use train.precision=bf16")
    if importlib.util.find_spec("torchao") is None:
        return "train.precision=fp8 trains through torchao, not installed -> pip install torchao"
    return None


def fp8_layers(model):
    """The blocks' nn.Linear layers with sizes in multiples of 16 (what float8 matmuls take)."""
    in_blocks = {id(module) for block in repeated_blocks(model) for module in block.modules()}
    return [name for name, module in model.named_modules()
            if id(module) in in_blocks and isinstance(module, torch.nn.Linear)
            and module.in_features % 16 == 0 and module.out_features % 16 == 0]


def train_in_fp8(model, cfg, device, use_compile, sharded):
    """fp8_layers become torchao's Float8Linear before compile and sharding."""
    if cfg.train.precision != "fp8":
        return
    refusal = fp8_refusal(device, use_compile)
    if refusal:
        die(refusal)
    import dataclasses

    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    chosen = set(fp8_layers(model))
    if not chosen:
        die(f"train.precision=fp8: {model.config.model_type}'s blocks have no nn.Linear with sizes "
            "in multiples of 16 (GPT-2's are Conv1D) -> use model.type=llama, bert or vit, or "
            "train.precision=bf16")
    config = dataclasses.replace(Float8LinearConfig.from_recipe_name("tensorwise"),
                                 enable_fsdp_float8_all_gather=sharded)
    convert_to_float8_training(model, config=config,
                               module_filter_fn=lambda module, name: name in chosen)
    log0(f"fp8: {len(chosen)} linear layers multiply in float8 (torchao, tensorwise), the rest in "
         "bf16; MFU is counted against the bf16 peak")
    if model.config.hidden_size < 1280:  # the casts and scalings cost what narrow matmuls gain
        log0(f"fp8: width {model.config.hidden_size}; fp8 measured 1.2x bf16's tokens/s at width "
             "2048 and 1.08x at 1280 (bench/RESULTS.md), less the narrower: bf16 may be as fast")
# ============================================================================== fp8: end


# ============================================================================== faults: begin
# Fault injection for the tests: FAULT=kind:rank:step[,...], on a job's first attempt only. Delete
# this block and the lines tagged # FAULT: nothing else changes.

def fault(kind, step):
    specs = os.environ.get("FAULT")
    if not specs or os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
        return False
    try:
        here = (kind, int(os.environ.get("RANK", "0")), step)
        wanted = [spec.split(":") for spec in specs.split(",")]
        return any((kind_, int(rank_), int(step_)) == here for kind_, rank_, step_ in wanted)
    except ValueError:
        die(f"FAULT={specs} is not kind:rank:step[,...] -> e.g. FAULT=kill:1:7 (kinds: kill, "
            "kill-in-save, hang, nan, slow)")


def fault_point(step):
    """kill: SIGKILL this rank; hang: sleep for ever; slow: take 2 s more to build the batches."""
    if fault("kill", step):
        os.kill(os.getpid(), signal.SIGKILL)
    if fault("hang", step):
        time.sleep(10**6)
    if fault("slow", step):
        time.sleep(2)


def nan_fault(loss, step):
    return loss * float("nan") if fault("nan", step) else loss


def save_fault(step):
    if fault("kill-in-save", step):
        os.kill(os.getpid(), signal.SIGKILL)
# ============================================================================== faults: end


def ended_attempt(code=None, line=None):
    """A torchrun restart cannot undo a stop or a mistake: an attempt that ends so notes it in a
    file named after torchrun's PID, and the next attempt ends alike at once."""
    note = Path(tempfile.gettempdir()) / f"train-ended-{os.getppid()}.json"
    restarts = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "-1"))
    if code is not None and restarts >= 0:
        with contextlib.suppress(OSError):
            note.write_text(json.dumps({"code": code, "line": line}))
    elif restarts == 0:
        note.unlink(missing_ok=True)
    elif restarts > 0 and note.is_file():
        return json.loads(note.read_text())
    return None


if __name__ == "__main__":
    if ended := ended_attempt():  # this attempt is a restart after a stop or a mistake: end alike
        log0(ended["line"], file=sys.stderr)
        sys.exit(ended["code"])
    code, line = 0, None
    try:
        try:
            main()
        except (UserError, Stopped) as ending:
            code, line = (2, f"error: {ending}") if isinstance(ending, UserError) else (
                EXIT_STOPPED, str(ending))
        except KeyboardInterrupt:  # before catch_stop_signals: nothing trained, nothing to save
            code, line = 130, "stopped by Ctrl-C before the first step: nothing was saved"
        finally:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)  # leaving: a SIGTERM ends us at once
        # main()'s objects go first (an ending's traceback held them until here): DDP's reducer,
        # freed after the group is gone, can deadlock in its destructor with gloo
        gc.collect()
        if line:  # every rank has the same ending: rank 0 says it
            log0(line, file=sys.stderr)
            ended_attempt(code, line)
        if dist.is_initialized():  # not with --check
            dist.destroy_process_group()
        sys.exit(code)
    except (dist.DistError, RuntimeError) as error:
        # gloo reports a timeout or a lost peer as a plain RuntimeError; anything else is a bug
        if not dist.is_initialized() or not any(word in str(error) for word in
                                                ("gloo", "NCCL", "Timed out", "Connection")):
            raise
        report_lost_ranks(error)
        sys.exit(1)
