"""Train a transformers model on one or many GPUs with DistributedDataParallel (DDP).

    bash launch.sh                                  # every GPU of this machine (2 CPU processes without GPUs)
    torchrun --nproc_per_node 8 train_ddp.py train.max_steps=1000 optim.lr=3e-4

The story, top to bottom: 1. config (config.yaml + key=value overrides), 2. distributed init,
3. data (memory-mapped Arrow shards from preprocess.py, a sampler that depends only on
(seed, epoch)), 4. model (a transformers config or a local pretrained path), 5. optimizer,
6. checkpoint (full state, atomic, auto-resume), 7. training loop (bf16 autocast, gradient
accumulation with DDP's overlapped all-reduce, periodic validation, logging, export).
Read section 7 first if you want the training step; read `global_batch_plan` for the data split.
"""

import contextlib
import difflib
import json
import math
import os
import re
import shutil
import sys
import time
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pyarrow as pa
import torch
import torch.distributed as dist
import torch.nn.functional as F
import yaml
from tokenizers import Tokenizer
from torch.nn.parallel import DistributedDataParallel as DDP
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForMaskedLM, PreTrainedTokenizerFast
from transformers.models.auto.modeling_auto import MODEL_FOR_MASKED_LM_MAPPING_NAMES
from transformers.utils import logging as transformers_logging

IGNORE_INDEX = -100  # label value F.cross_entropy skips: padding and unmasked MLM positions


def die(message):
    """One clear line on rank 0, a non-zero exit on every rank: foreseeable mistakes get no traceback."""
    if int(os.environ.get("RANK", "0")) == 0:
        print(f"error: {message}", file=sys.stderr, flush=True)
    if dist.is_initialized():
        dist.destroy_process_group()
    sys.exit(2)


def log0(*values):
    if int(os.environ.get("RANK", "0")) == 0:
        print(*values, flush=True)


# ----------------------------------------------------------------------------- 1. config

CHOICES = {
    "model.task": ["auto", "causal", "mlm"],
    "model.attention": ["auto", "flash_attention_2", "sdpa", "eager"],
    "train.precision": ["auto", "bf16", "fp16", "fp32"],
    "train.compile": ["auto", "true", "false"],
    "dist.backend": ["auto", "nccl", "gloo"],
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
        flat = flatten(yaml.load(config_path.read_text(), Loader=ConfigLoader))
    except yaml.YAMLError as error:
        die(f"{config_path} is not valid YAML ({str(error).splitlines()[0]}) -> fix that line")
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
    cfg = SimpleNamespace(**{k: SimpleNamespace(**v) if isinstance(v, dict) else v for k, v in tree.items()})
    return cfg, flat


def main():
    args = sys.argv[1:]
    check_only = "--check" in args  # launch.sh validates the config before it starts any process
    args = [arg for arg in args if arg != "--check"]
    use_cuda = torch.cuda.is_available()
    cfg, flat_config = load_config(args, use_cuda)

    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    rank_batch_size = cfg.train.global_batch_size // world_size
    sequences_per_round = cfg.train.micro_batch_size * world_size
    if cfg.train.global_batch_size % sequences_per_round:
        nearest = max(1, round(cfg.train.global_batch_size / sequences_per_round)) * sequences_per_round
        die(f"train.global_batch_size={cfg.train.global_batch_size} is not a multiple of train.micro_batch_size "
            f"x world size = {cfg.train.micro_batch_size} x {world_size} -> use e.g. train.global_batch_size={nearest}")
    micro_batches_per_step = rank_batch_size // cfg.train.micro_batch_size
    for key in ["train.max_steps", "train.seq_len", "train.micro_batch_size", "train.eval_every", "train.eval_batches",
                "log.every", "checkpoint.every", "checkpoint.keep", "optim.lr", "dist.timeout_s"]:
        if flat_config[key] <= 0:
            die(f"{key}={flat_config[key]} must be positive -> give a value above 0")
    if check_only:
        for key in ["data.dir", "checkpoint.dir", "checkpoint.resume", "out_dir", "dist.timeout_s"]:
            print(f"{key}={flat_config[key]}")
        return

    # ------------------------------------------------------------------------- 2. distributed init
    device = torch.device("cuda", local_rank) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)  # without it every rank would build its NCCL communicator on GPU 0
    backend = cfg.dist.backend if cfg.dist.backend != "auto" else ("nccl" if use_cuda else "gloo")
    timeout = timedelta(seconds=cfg.dist.timeout_s)
    if "RANK" in os.environ:
        dist.init_process_group(backend, timeout=timeout, device_id=device if use_cuda else None)
    else:  # plain `python train_ddp.py`: a one-process group, so the code below has one path
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)

    precision = cfg.train.precision
    if precision == "auto":
        precision = "fp32" if not use_cuda else ("bf16" if torch.cuda.is_bf16_supported() else "fp16")
    if precision == "fp16" and not use_cuda:
        die("train.precision=fp16 needs a CUDA GPU (GradScaler) -> use train.precision=fp32 or bf16 on CPU")
    autocast_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)
    autocast = torch.autocast(device.type, dtype=autocast_dtype, enabled=autocast_dtype is not None)
    torch.set_float32_matmul_precision("high")  # TF32 matmuls: ~8x the fp32 rate on Ampere+ at bf16-level accuracy
    log0(
        f"world size {world_size} ({backend}, {device.type}), precision {precision}, "
        f"global batch {cfg.train.global_batch_size} sequences = {world_size} ranks x "
        f"{micro_batches_per_step} micro-batches x {cfg.train.micro_batch_size} sequences"
    )

    # ------------------------------------------------------------------------- 3. data
    data_dir = Path(cfg.data.dir)
    meta = read_meta(data_dir)
    model_type_is_mlm = cfg.model.task == "mlm" or (cfg.model.task == "auto" and is_masked_lm_type(cfg))
    task = "mlm" if model_type_is_mlm else "causal"
    special = meta["special_tokens"]
    train_data = ArrowTokens(data_dir, meta, "train", task, cfg.train.seq_len, special)
    val_data = ArrowTokens(data_dir, meta, "val", task, cfg.train.seq_len, special)
    for split, split_data in [("train", train_data), ("val", val_data)]:
        if len(split_data) == 0:
            die(f"the {split} split of {data_dir} has no {task} samples of seq_len {cfg.train.seq_len} -> "
                "prepare more text with preprocess.py, lower train.seq_len or raise data.val_fraction")
    log0(f"data {data_dir}: {task} samples train {len(train_data):,} val {len(val_data):,} "
         f"({meta['splits']['train']['tokens']:,} train tokens)")

    def make_rank_batches(split_data, position, seed):
        """This rank's micro-batches of the global batch that starts at `position` (in samples),
        and the number of input tokens in the whole global batch (every rank knows the plan)."""
        plan = global_batch_plan(position, cfg.train.global_batch_size, len(split_data), seed,
                                 cfg.train.micro_batch_size, world_size, split_data.length if task == "mlm" else None)
        global_tokens = sum(split_data.length(int(i)) for rank_plan in plan for ids, _ in rank_plan for i in ids)
        return [make_micro_batch(split_data, sample_ids, epochs, cfg, special, device)
                for sample_ids, epochs in plan[rank]], global_tokens

    # ------------------------------------------------------------------------- 4. model
    padded_vocab_size = math.ceil(meta["vocab_size"] / 64) * 64  # tensor cores want multiples of 64
    torch.manual_seed(cfg.train.seed)  # identical initial weights on every rank (DDP also broadcasts rank 0's)
    raw_model, attention = build_model(cfg, task, padded_vocab_size, special, use_cuda)
    raw_model.to(device)
    # model FLOPs per token, PaLM's formula (Chowdhery et al. 2022, app. B): 6N for the matmuls forward and
    # backward, plus attention's 12 x layers x width x sequence length
    attention_flops = 12 * raw_model.config.num_hidden_layers * raw_model.config.hidden_size * cfg.train.seq_len
    flops_per_token = 6 * count_matmul_params(raw_model) + attention_flops
    log0(f"model {cfg.model.type} ({task}), {sum(p.numel() for p in raw_model.parameters()) / 1e6:.1f}M parameters, "
         f"attention {attention}, vocab {meta['vocab_size']} padded to {padded_vocab_size}")
    model = DDP(raw_model, device_ids=[local_rank] if use_cuda else None, gradient_as_bucket_view=True)
    use_compile = cfg.train.compile == "true" or (cfg.train.compile == "auto" and use_cuda)
    # compile the DDP wrapper, not the bare model: then Dynamo splits the graph at DDP's buckets
    # and the all-reduce of one bucket overlaps with the backward of the next
    forward = torch.compile(model) if use_compile else model
    # dropout differs per rank on purpose (different data); seeded from (seed, rank) so a run is repeatable
    torch.manual_seed(int(np.random.SeedSequence([cfg.train.seed, rank]).generate_state(1)[0]))

    # ------------------------------------------------------------------------- 5. optimizer
    decay = [p for p in raw_model.parameters() if p.requires_grad and p.dim() >= 2]
    no_decay = [p for p in raw_model.parameters() if p.requires_grad and p.dim() < 2]  # biases, norm weights
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": cfg.optim.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=cfg.optim.lr, betas=(cfg.optim.beta1, cfg.optim.beta2), eps=cfg.optim.eps,
        fused=use_cuda,  # one kernel for all parameters instead of several per tensor
    )

    def lr_factor(step):
        """Linear warmup, then cosine decay to min_lr at max_steps (a multiplier of optim.lr)."""
        if step < cfg.optim.warmup_steps:
            return (step + 1) / cfg.optim.warmup_steps
        progress = min(1.0, (step - cfg.optim.warmup_steps) / max(1, cfg.train.max_steps - cfg.optim.warmup_steps))
        min_factor = cfg.optim.min_lr / cfg.optim.lr
        return min_factor + (1 - min_factor) * 0.5 * (1 + math.cos(math.pi * progress))

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor)
    scaler = torch.amp.GradScaler(device.type, enabled=precision == "fp16")  # fp16 gradients underflow without it

    # ------------------------------------------------------------------------- 6. checkpoint
    ckpt_dir = Path(cfg.checkpoint.dir)
    resume_dir = find_resume_checkpoint(ckpt_dir, cfg.checkpoint.resume)
    step, samples_seen, tokens_seen = 0, 0, 0
    if resume_dir is not None:
        train_state = load_checkpoint(resume_dir, raw_model, optimizer, scheduler, scaler, flat_config)
        step, samples_seen, tokens_seen = train_state["step"], train_state["samples_seen"], train_state["tokens_seen"]
        restore_rng(train_state["rng"], rank, cfg.train.seed, step)
        if train_state.get("data_fingerprint") != meta.get("fingerprint"):
            log0(f"warning: {data_dir} was rebuilt since {resume_dir} was written; the data position may not match")
        log0(f"resumed from {resume_dir}: step {step}, {samples_seen:,} samples, {tokens_seen:,} tokens seen")

    def save(step):
        rng_states = [None] * world_size
        dist.all_gather_object(rng_states, rng_state(use_cuda))
        error = None
        if rank == 0:
            try:
                save_checkpoint(ckpt_dir, step, cfg.checkpoint.keep, raw_model, optimizer, {
                    "step": step, "samples_seen": samples_seen, "tokens_seen": tokens_seen, "rng": rng_states,
                    "scheduler": scheduler.state_dict(), "scaler": scaler.state_dict(), "config": flat_config,
                    "data_fingerprint": meta.get("fingerprint"), "world_size": world_size,
                })
            except OSError as exc:
                error = f"cannot write checkpoint to {ckpt_dir} ({exc}) -> free disk space or set checkpoint.dir"
        verdict = [error]
        dist.broadcast_object_list(verdict, src=0)  # every rank stops together if rank 0 could not write
        if verdict[0]:
            die(verdict[0])
        log0(f"checkpoint {ckpt_dir / f'step_{step:06d}'} written")

    # ------------------------------------------------------------------------- 7. training loop
    out_dir = Path(cfg.out_dir)
    metrics_file = None
    if rank == 0:
        out_dir.mkdir(parents=True, exist_ok=True)
        metrics_file = open(out_dir / "metrics.jsonl", "a")  # append: a resumed run continues the same file
        start_record = {"kind": "start", "step": step, "world_size": world_size, "time": time.time()}
        metrics_file.write(json.dumps(start_record) + "\n")
    peak_flops = gpu_peak_flops(device) if use_cuda else None

    def evaluate():
        """Mean loss per token over the same validation batches every time, computed by all ranks together
        (a rank-0-only evaluation deadlocks the next collective)."""
        model.eval()
        totals = torch.zeros(2, device=device, dtype=torch.float64)
        with torch.no_grad():
            for batch_index in range(cfg.train.eval_batches):
                position = (batch_index * cfg.train.global_batch_size) % len(val_data)
                for batch in make_rank_batches(val_data, position, seed=None)[0]:
                    with autocast:
                        logits = forward(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
                    totals[0] += token_loss_sum(logits, batch["labels"])
                    totals[1] += batch["label_tokens"]
        dist.all_reduce(totals)
        model.train()
        return (totals[0] / totals[1]).item()

    def log_metrics(record):
        if metrics_file:
            metrics_file.write(json.dumps(record) + "\n")
            metrics_file.flush()

    if step == 0:
        val_loss = evaluate()
        log0(f"step 0 | val loss {val_loss:.4f}")
        log_metrics({"kind": "val", "step": 0, "val_loss": val_loss})

    model.train()
    interval_loss = torch.zeros(2, device=device, dtype=torch.float64)  # summed loss, label tokens
    interval_start, interval_steps, interval_tokens, paused_s = time.perf_counter(), 0, 0, 0.0
    while step < cfg.train.max_steps:
        micro_batches, step_tokens = make_rank_batches(train_data, samples_seen, seed=cfg.train.seed)
        # The step's gradient must be that of the mean loss over every label token of the global batch,
        # however the batch is split into ranks and micro-batches. Averaging per-micro-batch means
        # (the common recipe) over-weights short sequences. So count the tokens of the whole global
        # batch first, then each micro-batch contributes sum(loss) / global_tokens.
        global_label_tokens = torch.tensor(float(sum(b["label_tokens"] for b in micro_batches)), device=device)
        dist.all_reduce(global_label_tokens)
        global_label_tokens.clamp_(min=1)  # a masked LM batch with no masked token has zero loss, not NaN
        for index, batch in enumerate(micro_batches):
            is_last = index == len(micro_batches) - 1
            # no_sync: accumulate locally; only the last backward all-reduces, overlapped with compute
            with contextlib.nullcontext() if is_last else model.no_sync():
                with autocast:
                    logits = forward(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
                loss_sum = token_loss_sum(logits, batch["labels"])
                # DDP divides the summed gradient by world_size; multiplying by it undoes that mean
                scaler.scale(loss_sum * world_size / global_label_tokens).backward()
            interval_loss[0] += loss_sum.detach()
            interval_loss[1] += batch["label_tokens"]
        scaler.unscale_(optimizer)  # clip the true gradient, not the fp16-scaled one
        grad_norm = torch.nn.utils.clip_grad_norm_(raw_model.parameters(), cfg.optim.grad_clip or float("inf"))
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        scheduler.step()
        step += 1
        samples_seen += cfg.train.global_batch_size
        tokens_seen += step_tokens
        interval_steps += 1
        interval_tokens += step_tokens

        if step % cfg.log.every == 0 or step == cfg.train.max_steps:
            dist.all_reduce(interval_loss)  # loss over all ranks
            loss = (interval_loss[0] / interval_loss[1]).item()  # the interval's only wait for the GPU, so the
            elapsed = time.perf_counter() - interval_start - paused_s  # clock is read after the work is done
            tokens_per_sec = interval_tokens / elapsed
            record = {
                "kind": "train", "step": step, "loss": loss,
                "grad_norm": grad_norm.item(), "lr": scheduler.get_last_lr()[0],
                "tokens_per_sec": tokens_per_sec, "tokens_seen": tokens_seen,
                "eta_s": elapsed / interval_steps * (cfg.train.max_steps - step),
            }
            line = (f"step {step}/{cfg.train.max_steps} | loss {record['loss']:.4f} | lr {record['lr']:.2e} | "
                    f"grad {record['grad_norm']:.3f} | {tokens_per_sec / 1e3:.1f}k tok/s")
            if peak_flops:
                record["mfu"] = flops_per_token * tokens_per_sec / (peak_flops * world_size)
                line += f" | MFU {100 * record['mfu']:.1f}%"
            if use_cuda:
                gib = 2**30
                record["mem_alloc_gib"] = torch.cuda.memory_allocated() / gib
                record["mem_reserved_gib"] = torch.cuda.memory_reserved() / gib
                record["mem_peak_gib"] = torch.cuda.max_memory_allocated() / gib
                line += (f" | mem {record['mem_alloc_gib']:.1f}/{record['mem_reserved_gib']:.1f}/"
                         f"{record['mem_peak_gib']:.1f} GiB alloc/res/peak")
            log0(line + f" | ETA {format_seconds(record['eta_s'])}")
            log_metrics(record)
            interval_loss.zero_()
            interval_start, interval_steps, interval_tokens, paused_s = time.perf_counter(), 0, 0, 0.0

        pause_start = time.perf_counter()  # validation and checkpoints are not training throughput
        if step % cfg.train.eval_every == 0 or step == cfg.train.max_steps:
            val_loss = evaluate()
            log0(f"step {step} | val loss {val_loss:.4f}")
            log_metrics({"kind": "val", "step": step, "val_loss": val_loss})
        if step % cfg.checkpoint.every == 0 or step == cfg.train.max_steps:
            save(step)
        paused_s += time.perf_counter() - pause_start

    if rank == 0:
        export_final(raw_model, data_dir, meta, out_dir / "final", task, cfg, device)
        metrics_file.close()
    dist.barrier()  # without it gloo ranks that exit first made the others die with SIGABRT
    dist.destroy_process_group()


# ----------------------------------------------------------------------------- 3. data (helpers)

def read_meta(data_dir):
    meta_path = data_dir / "meta.json"
    if not meta_path.is_file():
        die(f"no prepared data in {data_dir} (meta.json missing) -> run: python preprocess.py --out {data_dir}")
    try:
        meta = json.loads(meta_path.read_text())
    except (OSError, json.JSONDecodeError) as error:
        die(f"{meta_path} is unreadable ({error}) -> rebuild it: python preprocess.py --out {data_dir} --force")
    if meta.get("format_version") != 1:
        die(f"{meta_path} has format version {meta.get('format_version')}, this trainer reads 1 -> rebuild with --force")
    return meta


class ArrowTokens:
    """Samples of one split, read straight from memory-mapped Arrow files (no copy, any corpus size).

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
            for chunk in table.column("input_ids").chunks:
                if len(chunk) == 0:
                    continue
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

    def document(self, index):
        piece = int(np.searchsorted(self.doc_starts, index, side="right")) - 1
        row = index - self.doc_starts[piece]
        begin, end = self.doc_offsets[piece][row], self.doc_offsets[piece][row + 1] - 1  # drop end-of-text
        return self.pieces[piece][begin:min(end, begin + self.seq_len - 2)]

    def length(self, index):
        """Input tokens of sample `index`, without reading its tokens."""
        if self.task == "causal":
            return self.seq_len
        piece = int(np.searchsorted(self.doc_starts, index, side="right")) - 1
        row = index - self.doc_starts[piece]
        return min(int(self.doc_offsets[piece][row + 1] - self.doc_offsets[piece][row]) - 1, self.seq_len - 2) + 2

    def sample(self, index):
        if self.task == "causal":
            return self.span(index * self.seq_len, self.seq_len + 1)
        doc = self.document(index).astype(np.int64)
        return np.concatenate([[self.special["cls"]], doc, [self.special["sep"]]])


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
    if length_of is not None:
        order = sorted(range(global_batch_size), key=lambda k: (length_of(sample_ids[k]), k))
        sample_ids, epochs = sample_ids[order], epochs[order]
    plan = [[] for _ in range(world_size)]
    for micro_index in range(global_batch_size // micro_batch_size):
        chosen = slice(micro_index * micro_batch_size, (micro_index + 1) * micro_batch_size)
        plan[micro_index % world_size].append((sample_ids[chosen], epochs[chosen]))
    return plan


def mask_tokens(tokens, seed, epoch, sample_id, special, vocab_size, probability):
    """BERT masking of one sample: a function of (seed, epoch, sample id) only, so the result does
    not depend on the rank or micro-batch that happens to process the sample."""
    rng = np.random.default_rng([seed, epoch, sample_id])
    inputs, labels = tokens.copy(), np.full_like(tokens, IGNORE_INDEX)
    candidates = np.arange(1, len(tokens) - 1)  # never [CLS] / [SEP]
    chosen = candidates[rng.random(len(candidates)) < probability]
    labels[chosen] = tokens[chosen]
    action = rng.random(len(chosen))
    inputs[chosen[action < 0.8]] = special["mask"]  # 80% [MASK]
    random_positions = chosen[(action >= 0.8) & (action < 0.9)]  # 10% a random token, 10% unchanged
    inputs[random_positions] = rng.integers(0, vocab_size, len(random_positions))
    return inputs, labels


def make_micro_batch(split_data, sample_ids, epochs, cfg, special, device):
    samples = [split_data.sample(int(i)) for i in sample_ids]
    if split_data.task == "causal":
        blocks = torch.from_numpy(np.stack(samples))
        input_ids, labels, attention_mask = blocks[:, :-1], blocks[:, 1:], None
    else:  # dynamic padding: pad to the longest sample of this micro-batch, not to seq_len
        longest = max(len(s) for s in samples)
        input_ids = torch.full((len(samples), longest), special["pad"], dtype=torch.long)
        labels = torch.full((len(samples), longest), IGNORE_INDEX, dtype=torch.long)
        attention_mask = torch.zeros((len(samples), longest), dtype=torch.long)
        for row, (tokens, sample_id, epoch) in enumerate(zip(samples, sample_ids, epochs)):
            masked, target = mask_tokens(tokens, cfg.train.seed, int(epoch), int(sample_id), special,
                                         split_data.vocab_size, cfg.train.mlm_probability)
            input_ids[row, :len(tokens)] = torch.from_numpy(masked)
            labels[row, :len(tokens)] = torch.from_numpy(target)
            attention_mask[row, :len(tokens)] = 1
        attention_mask = attention_mask.to(device, non_blocking=True)
    return {
        "input_ids": input_ids.to(device, non_blocking=True),
        "labels": labels.to(device, non_blocking=True),
        "attention_mask": attention_mask,
        "label_tokens": int((labels != IGNORE_INDEX).sum()),
    }


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
        die(f"cannot read a transformers config from model.pretrained={path} ({str(error).splitlines()[0][:150]}) "
            "-> give a local directory holding config.json and the weights")


def build_model(cfg, task, padded_vocab_size, special, use_cuda):
    """A new model from a transformers config, or a local pretrained one; fp32 master weights."""
    attention = cfg.model.attention
    if attention == "auto":
        attention = "flash_attention_2" if use_cuda and flash_attn_available() else "sdpa"
    elif attention == "flash_attention_2" and not (use_cuda and flash_attn_available()):
        die("model.attention=flash_attention_2 needs the flash_attn package and a CUDA GPU "
            "-> pip install flash-attn, or use model.attention=sdpa")
    if cfg.model.pretrained:
        config = load_pretrained_config(cfg.model.pretrained)
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
            die(f"model.type={cfg.model.type} is not a transformers model type ({str(error).splitlines()[0][:100]}) "
                "-> use e.g. gpt2, llama, bert or roberta")
        if hasattr(config, "intermediate_size"):  # models that have one default to their own, much larger size
            config.intermediate_size = 4 * cfg.model.n_embd
        if hasattr(config, "num_key_value_heads"):
            config.num_key_value_heads = cfg.model.n_head
    for name, value in config.to_dict().items():
        if ("dropout" in name or "pdrop" in name) and isinstance(value, float):
            setattr(config, name, cfg.model.dropout)
    model_class = AutoModelForMaskedLM if task == "mlm" else AutoModelForCausalLM
    if not cfg.model.pretrained:
        return model_class.from_config(config, attn_implementation=attention, dtype=torch.float32), attention
    try:
        model = model_class.from_pretrained(cfg.model.pretrained, config=config, dtype=torch.float32,
                                            attn_implementation=attention, local_files_only=True)
    except (OSError, ValueError) as error:
        die(f"cannot load model.pretrained={cfg.model.pretrained} ({str(error).splitlines()[0][:150]}) "
            "-> give a directory written by save_pretrained")
    if model.config.max_position_embeddings < cfg.train.seq_len:
        die(f"{cfg.model.pretrained} knows {model.config.max_position_embeddings} positions, "
            f"train.seq_len is {cfg.train.seq_len} -> lower train.seq_len")
    if model.get_input_embeddings().num_embeddings < padded_vocab_size:
        model.resize_token_embeddings(padded_vocab_size)  # the tokenizer has more tokens than the model
    return model, attention


def flash_attn_available():
    try:
        import flash_attn  # noqa: F401
        return True
    except ImportError:
        return False


def count_matmul_params(model):
    """Parameters that are multiplied with every token: all but embedding lookups, plus the output
    layer when it shares its weight with the input embedding (it is a matmul there)."""
    total = sum(p.numel() for p in model.parameters())
    embedding_weights = {id(m.weight): m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Embedding)}
    output = model.get_output_embeddings()
    tied_output = output.weight.numel() if output is not None and id(output.weight) in embedding_weights else 0
    return total - sum(embedding_weights.values()) + tied_output


# dense bf16 tensor-core peaks from NVIDIA's datasheets (without sparsity); longest name match wins
PEAK_BF16_TFLOPS = {"H100 PCIe": 756, "H100": 989, "H200": 989, "H800": 989, "GH200": 989, "B200": 2250,
                    "A100": 312, "A800": 312, "L40S": 362, "L4": 121, "A10": 125}


def gpu_peak_flops(device):
    name = torch.cuda.get_device_name(device)
    matches = [key for key in PEAK_BF16_TFLOPS if key in name]
    return PEAK_BF16_TFLOPS[max(matches, key=len)] * 1e12 if matches else None


# ----------------------------------------------------------------------------- 6. checkpoint (helpers)

CHECKPOINT_FILES = ["model.pt", "optimizer.pt", "train_state.pt"]


def is_complete(path):
    return path.is_dir() and all((path / name).is_file() for name in CHECKPOINT_FILES)


def find_resume_checkpoint(ckpt_dir, resume):
    """resume=auto: the newest complete checkpoint (the `latest` pointer, else a scan); never; or a path."""
    existing = sorted(p for p in ckpt_dir.glob("step_*") if is_complete(p)) if ckpt_dir.is_dir() else []
    if resume == "never":
        if existing:
            die(f"{ckpt_dir} already holds checkpoints ({existing[-1].name}) and checkpoint.resume=never would overwrite "
                "them -> continue with checkpoint.resume=auto or choose another checkpoint.dir")
        return None
    if resume == "auto":
        pointer = ckpt_dir / "latest"
        if pointer.is_file() and is_complete(ckpt_dir / pointer.read_text().strip()):
            return ckpt_dir / pointer.read_text().strip()
        return existing[-1] if existing else None
    if not is_complete(Path(resume)):
        die(f"checkpoint.resume={resume} is not a complete checkpoint directory (needs {', '.join(CHECKPOINT_FILES)}) "
            f"-> give a step_* directory, auto or never")
    newer = [p.name for p in existing if p.name > Path(resume).name]
    if newer:  # this run's checkpoints would interleave with them, and pruning could delete this run's
        die(f"{ckpt_dir} holds checkpoints newer than {resume} ({', '.join(newer)}) -> set checkpoint.dir to "
            "another directory for this run")
    return Path(resume)


def save_checkpoint(ckpt_dir, step, keep, raw_model, optimizer, train_state):
    """Write into a temporary directory, then rename: a crash mid-write never leaves a checkpoint that
    resume=auto would pick. The `latest` pointer moves only after the rename; old ones go last."""
    final = ckpt_dir / f"step_{step:06d}"
    temporary = ckpt_dir / f".tmp-step_{step:06d}-{os.getpid()}"
    temporary.mkdir(parents=True, exist_ok=True)
    for name, obj in [("model.pt", raw_model.state_dict()), ("optimizer.pt", optimizer.state_dict()),
                      ("train_state.pt", train_state)]:
        with open(temporary / name, "wb") as file:
            torch.save(obj, file)
            file.flush()
            os.fsync(file.fileno())  # the rename below must not reach the disk before the data
    (temporary / "config.yaml").write_text(yaml.safe_dump(train_state["config"], sort_keys=False))
    if final.exists():  # only an incomplete leftover can be there: resume refuses dirs with newer checkpoints
        shutil.rmtree(final)
    os.rename(temporary, final)
    pointer_temporary = ckpt_dir / f".latest-{os.getpid()}"
    pointer_temporary.write_text(final.name)
    os.replace(pointer_temporary, ckpt_dir / "latest")
    for old in sorted(p for p in ckpt_dir.glob("step_*") if is_complete(p))[:-keep]:
        shutil.rmtree(old)


def load_checkpoint(path, raw_model, optimizer, scheduler, scaler, flat_config):
    """weights_only=True: a checkpoint is data, loading it must never run pickled code."""
    try:
        train_state = torch.load(path / "train_state.pt", weights_only=True)
        saved_config = train_state["config"]
        for key in ["model.type", "model.task", "model.n_layer", "model.n_head", "model.n_embd", "model.pretrained"]:
            if saved_config.get(key) != flat_config[key]:
                die(f"checkpoint {path} was trained with {key}={saved_config.get(key)}, this run has "
                    f"{key}={flat_config[key]} -> pass {key}={saved_config.get(key)}, or use another checkpoint.dir")
        raw_model.load_state_dict(torch.load(path / "model.pt", weights_only=True, map_location="cpu"))
        optimizer.load_state_dict(torch.load(path / "optimizer.pt", weights_only=True, map_location="cpu"))
        scheduler.load_state_dict(train_state["scheduler"])
        scaler.load_state_dict(train_state["scaler"])
    except (OSError, RuntimeError, KeyError, ValueError, EOFError) as error:
        die(f"cannot load checkpoint {path} ({str(error).splitlines()[0][:200]}) -> "
            "point checkpoint.resume at another step_* directory, or use a new checkpoint.dir")
    return train_state


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

def format_seconds(seconds):
    minutes, seconds = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m" if hours else f"{minutes}m{seconds:02d}s"


def export_final(raw_model, data_dir, meta, final_dir, task, cfg, device):
    """save_pretrained + the tokenizer: loadable with AutoModelFor...from_pretrained(final_dir)."""
    transformers_logging.disable_progress_bar()  # a progress bar per one-file save is noise in a log
    tokenizer_core = Tokenizer.from_file(str(data_dir / meta["tokenizer_file"]))
    names = {key: tokenizer_core.id_to_token(token_id) for key, token_id in meta["special_tokens"].items()}
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer_core, eos_token=names["eot"], bos_token=names["eot"], pad_token=names["pad"],
        mask_token=names["mask"], cls_token=names["cls"], sep_token=names["sep"],
    )
    raw_model.save_pretrained(final_dir)
    tokenizer.save_pretrained(final_dir)
    print(f"exported the model and tokenizer to {final_dir}", flush=True)
    if task == "causal" and cfg.log.sample_prompt:
        raw_model.eval()
        prompt = torch.tensor([tokenizer.encode(cfg.log.sample_prompt)], device=device)
        new_tokens = min(cfg.log.sample_tokens, raw_model.config.max_position_embeddings - prompt.shape[1])
        with torch.no_grad():
            generated = raw_model.generate(prompt, max_new_tokens=new_tokens, do_sample=True, top_k=40,
                                           pad_token_id=meta["special_tokens"]["pad"])
        print("sample:\n" + tokenizer.decode(generated[0].tolist(), skip_special_tokens=True), flush=True)


if __name__ == "__main__":
    main()
