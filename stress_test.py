"""Prove the cluster before the model goes in: do the collectives give exactly the right answers,
how fast are they, and do all ranks hold identical gradients after a DDP step?

Run (one process per GPU, NCCL; on a machine without GPUs, gloo on the CPU):
    torchrun --nproc_per_node 2 stress_test.py          # or: bash launch.sh stress_test.py
    torchrun --nproc_per_node 8 stress_test.py --sizes 1M,64M,1G --ops all_reduce_sum --duration 600

Read first: run_row() (one line of the table: fill, run, check, time) and the conventions under
"4. collectives", which are nccl-tests' so our table and all_reduce_perf's compare side by side.
Exit code: 0 only if every result was exact and all ranks ended with identical weights; 1 if not;
2 for a bad option (one `error:` line, printed by rank 0).
"""
import argparse
import datetime
import difflib
import functools
import json
import math
import os
import socket
import sys
import threading
import time
import warnings
from collections import Counter

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

# torch 2.13 renamed all_gather_into_tensor / reduce_scatter_tensor (*_single) and warns on every
# call; torch 2.11 on our GPU machines has only the old names, so we keep them and silence it.
warnings.filterwarnings(
    "ignore", message=r".*(all_gather_into_tensor|reduce_scatter_tensor)` is deprecated")

# ----------------------------------------------------------------------------- 1. config
OPS = ["all_reduce_sum", "all_reduce_max", "all_gather", "reduce_scatter", "broadcast"]
# torch writes their result into the input
IN_PLACE_OPS = {"all_reduce_sum", "all_reduce_max", "broadcast"}
BROADCAST_ROOT = 0  # nccl-tests' default root
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
          "int32": torch.int32}
# Every integer up to this is exact in the dtype. Our values and their sums over ranks stay below
# it, so each expected result is exact and compared with ==: a difference is an error, not rounding.
EXACT_INTEGER_LIMIT = {"float32": 2**24, "bfloat16": 2**8, "float16": 2**11, "int32": 2**31 - 1}
# binary, as nccl-tests' -b/-e
SIZE_UNITS = {"": 1, "K": 1024, "M": 1024**2, "G": 1024**3, "T": 1024**4}
# Default sweeps (min, max, factor): short enough for a quick default run; gloo on the CPU is far
# slower than NCCL on GPUs.
DEFAULT_SWEEP_GPU = ("8", "1G", 2)
DEFAULT_SWEEP_CPU = ("8", "2M", 4)
# elements checked at a time: checking 1 GiB takes 128 MiB of scratch, not 8 GiB
CHECK_CHUNK = 1 << 22
SEQ_LEN, SEQUENCES_PER_RANK, SEED = 32, 4, 1337  # of the gradient check's batch


def parse_size(text):
    """'8' -> 8, '1K' -> 1024, '64M', '1G', '2T': bytes, K/M/G/T binary as in nccl-tests.
    ValueError if not."""
    text = text.strip().upper()
    unit = text[-1] if text[-1:] in ("K", "M", "G", "T") else ""
    number = text[:-1] if unit else text
    if not number.isdigit() or int(number) == 0:
        raise ValueError(f"{text!r} is not a size: a positive whole number of bytes, "
                         "optionally with K, M, G or T")
    return int(number) * SIZE_UNITS[unit]


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], exit_on_error=False,
                                     allow_abbrev=False)
    parser.add_argument("--ops", default=",".join(OPS),
                        help="comma-separated (default all): " + ", ".join(OPS))
    parser.add_argument("--sizes",
                        help="bytes per row, e.g. 8,1K,1M,64M,1G; instead of the sweep below")
    parser.add_argument("--min-bytes", help="sweep start (default 8)")
    parser.add_argument("--max-bytes", help="sweep end (default 1G on GPUs, 2M on CPU)")
    parser.add_argument("--factor", type=int, help="sweep multiplier (default 2 on GPUs, 4 on CPU)")
    parser.add_argument("--dtype", default="float32", choices=list(DTYPES))
    parser.add_argument("--iters", type=int, default=100,
                        help="timed iterations per row (default 100)")
    parser.add_argument("--warmup", type=int, default=10,
                        help="untimed iterations before them (default 10)")
    parser.add_argument("--duration", type=float, default=0,
                        help="seconds of soak after the table; 0 = none")
    parser.add_argument("--timeout", type=float, default=300,
                        help="seconds without progress before we fail (300)")
    parser.add_argument("--json", help="write every figure to this file (rank 0)")
    model = parser.add_argument_group(
        "gradient check (a tiny transformers model, DDP, one AdamW step)")
    model.add_argument("--skip-grad-check", action="store_true")
    model.add_argument("--model-type", default="gpt2",
                       help="any causal LM type of transformers (gpt2)")
    model.add_argument("--n-layer", type=int, default=2)
    model.add_argument("--n-head", type=int, default=2)
    model.add_argument("--n-embd", type=int, default=64)
    model.add_argument("--vocab-size", type=int, default=512)
    tests = parser.add_argument_group("proving that the checkers can fail")
    tests.add_argument("--inject-corruption", type=int, default=-1, metavar="RANK",
                       help="that rank flips one element of the first row's result before "
                            "checking it")
    tests.add_argument("--inject-grad-corruption", type=int, default=-1, metavar="RANK",
                       help="that rank changes one gradient element after DDP's all-reduce")
    tests.add_argument("--inject-stall", type=int, default=-1, metavar="RANK",
                       help="that rank sleeps past --timeout before its first collective")
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        known = [option for action in parser._actions for option in action.option_strings]
        nearest = difflib.get_close_matches(unknown[0].split("=")[0], known, n=1)
        raise ValueError(f"unknown option {unknown[0]!r}"
                         + (f" -> did you mean {nearest[0]}?" if nearest else ""))
    return args


def load_config(argv, world_size):
    """Parse and check every option on every rank before any connects; returns (args, sizes)."""
    try:
        args = parse_args(argv)
    except (argparse.ArgumentError, ValueError) as error:
        die(f"{error}" + ("" if "->" in str(error) else " -> see: stress_test.py --help"))
    empty = [name for name in ("sizes", "min_bytes", "max_bytes", "json", "ops")
             if getattr(args, name) == ""]
    if empty:  # not the defaults: an unset shell variable is a mistake
        die(f'--{empty[0].replace("_", "-")} "" is an empty value -> give one, or leave it out')
    args.ops = [op.strip() for op in args.ops.split(",") if op.strip()]
    unknown_ops = [op for op in args.ops if op not in OPS]
    if unknown_ops or not args.ops:
        die(f"unknown collective {(unknown_ops or [''])[0]!r} in --ops "
            f"-> choose from {','.join(OPS)}")
    sweep_given = [args.min_bytes, args.max_bytes, args.factor] != [None] * 3
    if args.factor is not None and args.factor < 2:
        die(f"--factor {args.factor} would not grow the sweep -> give 2 or more")
    if args.sizes and sweep_given:
        die("--sizes and --min-bytes/--max-bytes/--factor both given -> use one of the two")
    try:
        if args.sizes:
            sizes = [parse_size(size) for size in args.sizes.split(",")]
        else:
            on_gpu = torch.cuda.is_available()
            default_min, default_max, default_factor = (DEFAULT_SWEEP_GPU if on_gpu
                                                        else DEFAULT_SWEEP_CPU)
            sizes = [parse_size(args.min_bytes or default_min)]
            max_bytes = parse_size(args.max_bytes or default_max)
            factor = args.factor or default_factor
            if factor < 2 or sizes[0] > max_bytes:
                die(f"no sweep from {sizes[0]} to {max_bytes} B by x{factor} "
                    "-> need --factor >= 2 and min <= max")
            while sizes[-1] * factor <= max_bytes:
                sizes.append(sizes[-1] * factor)
    except ValueError as error:
        die(f"{error} -> e.g. --sizes 8,1K,64M,1G or --min-bytes 8 --max-bytes 1G --factor 2")
    element_size = DTYPES[args.dtype].itemsize
    if min(sizes) < element_size:
        die(f"{min(sizes)} B is less than one {args.dtype} element "
            f"-> sizes of at least {element_size} B")
    if (args.iters < 1 or args.warmup < 0 or not 0 < args.timeout < math.inf
            or not 0 <= args.duration < math.inf):
        die("--iters must be >= 1, --warmup >= 0, --timeout > 0, --duration >= 0, both finite "
            "-> fix the option")
    for option in ("inject_corruption", "inject_grad_corruption", "inject_stall"):
        if not -1 <= getattr(args, option) < world_size:
            die(f"--{option.replace('_', '-')} {getattr(args, option)} is not a rank "
                f"-> give 0..{world_size - 1}")
    if args.inject_grad_corruption >= 0 and world_size < 2:
        die("--inject-grad-corruption needs 2 or more ranks: one rank has nothing to differ from "
            "-> launch 2 or more processes")
    if EXACT_INTEGER_LIMIT[args.dtype] // world_size < 2:
        die(f"sums over {world_size} ranks cannot be exact in {args.dtype} -> use --dtype float32")
    if not args.skip_grad_check:
        args.model = build_model(make_model_config(args), args)
    return args, sizes


def make_model_config(args):
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING
    for option in ("n_layer", "n_head", "n_embd", "vocab_size"):
        if getattr(args, option) < 1:
            die(f"--{option.replace('_', '-')} {getattr(args, option)} is not positive "
                "-> give 1 or more")
    if args.n_embd % args.n_head:
        die(f"--n-embd {args.n_embd} is not a multiple of --n-head {args.n_head} "
            "-> change one of them")
    # generic names work for every model type (gpt2 maps them to its n_layer, n_head, n_embd, ...)
    try:
        config = AutoConfig.for_model(args.model_type, num_hidden_layers=args.n_layer,
                                      hidden_size=args.n_embd, num_attention_heads=args.n_head,
                                      vocab_size=args.vocab_size, max_position_embeddings=SEQ_LEN,
                                      bos_token_id=None, eos_token_id=None)
    except (ValueError, KeyError):
        die(f"unknown --model-type {args.model_type!r} "
            "-> use a transformers model type such as gpt2 or llama")
    if type(config) not in MODEL_FOR_CAUSAL_LM_MAPPING:
        die(f"--model-type {args.model_type} has no causal LM in transformers "
            "-> use gpt2, llama, qwen2, ...")
    if hasattr(config, "intermediate_size"):
        config.intermediate_size = 4 * args.n_embd  # llama-like defaults (11008) would not be tiny
    return config


def build_model(config, args):
    """Built now, before any rank connects: some model types of transformers cannot be built this
    small, and that must end the run now, not after the whole table."""
    from transformers import AutoModelForCausalLM
    torch.manual_seed(SEED)  # the same initial weights on every rank
    try:
        return AutoModelForCausalLM.from_config(config)
    except Exception as error:  # transformers raises many kinds (ValueError, AssertionError, ...)
        reason = (str(error).strip() or "no message").splitlines()[0]
        die(f"--model-type {args.model_type} cannot be built with --n-layer {args.n_layer} "
            f"--n-head {args.n_head} --n-embd {args.n_embd} --vocab-size {args.vocab_size} "
            f"({type(error).__name__}: {reason}) -> use gpt2, llama, qwen2, ...")


def say(*values, file=None):
    """print, except that a reader who leaves early (`| head`) does not end the test."""
    try:
        print(*values, file=file, flush=True)
    except BrokenPipeError:  # later lines go nowhere
        os.dup2(os.open(os.devnull, os.O_WRONLY), (file or sys.stdout).fileno())


def die(message, exit_code=2):
    """One clear line, printed once by rank 0; every rank exits, as all reach the same verdict."""
    if int(os.environ.get("RANK", 0)) == 0:
        say(f"error: {message}", file=sys.stderr)
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    elif int(os.environ.get("RANK", 0)) != 0:
        # Before the group exists, exiting first could let torchrun stop rank 0 before its line is
        # printed; rank 0's exit ends this wait, as torchrun then stops the other ranks.
        time.sleep(10)
    sys.exit(exit_code)


# ----------------------------------------------------------------------------- 2. distributed init
def init_distributed(timeout_s):
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if torch.cuda.is_available():
        if local_rank >= torch.cuda.device_count():
            die(f"LOCAL_RANK {local_rank} but {torch.cuda.device_count()} GPUs "
                "-> --nproc_per_node at most that")
        torch.cuda.set_device(local_rank)
        device, backend = torch.device("cuda", local_rank), "nccl"
    else:
        device, backend = torch.device("cpu"), "gloo"
    # the backends' own timeouts are a backstop: start_watchdog() fires first, with a clearer line
    timeout = datetime.timedelta(seconds=timeout_s + 60)
    extra = {"device_id": device} if device.type == "cuda" else {}
    if "RANK" in os.environ:  # torchrun set RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT
        dist.init_process_group(backend, timeout=timeout, **extra)
    else:  # plain `python stress_test.py`: one rank needs no rendezvous
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1,
                                timeout=timeout, **extra)
    return device, dist.get_rank(), dist.get_world_size()


PROGRESS = {"time": time.monotonic(), "doing": "start"}


def beat(doing=None):
    """Progress, with what is being done now (None: the same as before)."""
    PROGRESS.update(time=time.monotonic(), doing=doing or PROGRESS["doing"])


def start_watchdog(timeout_s, rank):
    """End this rank with one line naming what it waited in once nothing finished for timeout_s:
    the backends' own timeout, 60 s longer, would end it too, without saying where."""
    beat("start")

    def watch():
        while True:
            time.sleep(min(1.0, timeout_s / 4))
            stalled_s = time.monotonic() - PROGRESS["time"]
            if stalled_s > timeout_s:
                say(f"error: rank {rank}: no collective finished for {stalled_s:.0f} s "
                    f"(--timeout {timeout_s:g}) during {PROGRESS['doing']} -> a rank died or "
                    "hangs, or the network is down; see the other ranks' lines",
                    file=sys.stderr)
                os._exit(1)
    threading.Thread(target=watch, daemon=True).start()


def all_reduce_floats(values, op, device):
    tensor = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(tensor, op=op)
    return tensor.tolist()


# ----------------------------------------------------------------------------- 3. data
def pattern(rank, index, modulus):
    """What `rank` writes at `index` of its buffer: 1..modulus, different per rank and per index, so
    a block from the wrong rank or at the wrong offset is caught (a constant fill would hide it)."""
    return (index + 37 * rank) % modulus + 1


def pattern_modulus(op, dtype, world_size):
    """The largest modulus (up to 1021, a prime) whose values, and sums over the ranks for the ops
    that add, stay exact in dtype: rank r and r + modulus write alike."""
    limit = EXACT_INTEGER_LIMIT[dtype]
    return min(1021, limit // world_size if op in ("all_reduce_sum", "reduce_scatter") else limit)


def fill_pattern(buffer, rank, modulus):
    for start in range(0, buffer.numel(), CHECK_CHUNK):
        index = torch.arange(start, min(start + CHECK_CHUNK, buffer.numel()), device=buffer.device)
        buffer[start:start + len(index)].copy_(pattern(rank, index, modulus))


def expected_values(op, index, rank, world_size, share, modulus):
    """What element `index` of this rank's result must hold, as exact int64."""
    every_rank = range(world_size)
    if op == "all_reduce_sum":
        return sum(pattern(r, index, modulus) for r in every_rank)
    if op == "all_reduce_max":
        return functools.reduce(torch.maximum, (pattern(r, index, modulus) for r in every_rank))
    if op == "all_gather":  # rank r's share lands at r * share
        return pattern(index // share, index % share, modulus)
    if op == "reduce_scatter":
        # this rank keeps the sum over ranks of the elements rank * share + index
        return sum(pattern(r, rank * share + index, modulus) for r in every_rank)
    return pattern(BROADCAST_ROOT, index, modulus)


def count_wrong(result, op, rank, world_size, share, modulus):
    wrong = torch.zeros((), dtype=torch.int64, device=result.device)
    for start in range(0, result.numel(), CHECK_CHUNK):
        index = torch.arange(start, min(start + CHECK_CHUNK, result.numel()), device=result.device)
        expected = expected_values(op, index, rank, world_size, share, modulus)
        # float64 holds every value here exactly, whatever the dtype; NaN never equals: it is wrong
        wrong += (result[start:start + len(index)].double() != expected.double()).sum()
    return int(wrong)


# ----------------------------------------------------------------------------- 4. collectives
# Conventions of nccl-tests (all_reduce_perf & co), so rows compare one to one:
#   size  = bytes of one rank's largest buffer: the buffer for all_reduce and broadcast, the
#           gathered output for all_gather, the input that is scattered for reduce_scatter
#   count = elements of the per-rank count NCCL is called with: the buffer for all_reduce and
#           broadcast, one rank's share for all_gather and reduce_scatter
#           (size = count x ranks x element size)
#   algbw = size / time in GB/s (1 GB = 1e9 B)
#   busbw = algbw x bus_factor(), comparable to link speed
#   time  = mean of the timed iterations on a rank, then the max over ranks (nccl-tests' `-a 3`;
#           its default `-a 1` averages the ranks, which would hide a slow one)
# nccl-tests also rounds a rank's share down to a multiple of 16 bytes; we don't, which only matters
# for sizes that are not a multiple of 16 x ranks bytes.
def bus_factor(op, world_size):
    if op.startswith("all_reduce"):
        return 2 * (world_size - 1) / world_size
    if op in ("all_gather", "reduce_scatter"):
        return (world_size - 1) / world_size
    return 1.0


def element_counts(op, size_bytes, element_size, world_size):
    """(count column, input elements, output elements) of a row."""
    count = size_bytes // element_size
    share = count // world_size
    if op == "all_gather":
        return share, share, share * world_size
    if op == "reduce_scatter":
        return share, share * world_size, share
    return count, count, count


def bytes_needed(op, size_bytes, element_size, world_size):
    _, input_count, output_count = element_counts(op, size_bytes, element_size, world_size)
    buffers = input_count + (0 if op in IN_PLACE_OPS else output_count)
    # the check's scratch: int64 index, expected, ...
    check_scratch = min(max(input_count, output_count), CHECK_CHUNK) * 8 * 4
    return buffers * element_size + check_scratch


def make_buffers(op, size_bytes, dtype, device, world_size):
    count, input_count, output_count = element_counts(op, size_bytes, dtype.itemsize, world_size)
    input_buffer = torch.empty(input_count, dtype=dtype, device=device)
    output_buffer = (input_buffer if op in IN_PLACE_OPS
                     else torch.empty(output_count, dtype=dtype, device=device))
    return count, input_buffer, output_buffer


def refill(input_buffer, output_buffer, rank, modulus):
    fill_pattern(input_buffer, rank, modulus)
    if output_buffer is not input_buffer:
        output_buffer.fill_(-1)  # an element the collective never writes stays -1: never expected


def run_collective(op, input_buffer, output_buffer):
    if op == "all_reduce_sum":
        dist.all_reduce(input_buffer, op=dist.ReduceOp.SUM)
    elif op == "all_reduce_max":
        dist.all_reduce(input_buffer, op=dist.ReduceOp.MAX)
    elif op == "all_gather":
        dist.all_gather_into_tensor(output_buffer, input_buffer)
    elif op == "reduce_scatter":
        dist.reduce_scatter_tensor(output_buffer, input_buffer, op=dist.ReduceOp.SUM)
    else:
        dist.broadcast(input_buffer, src=BROADCAST_ROOT)


def time_iterations(run_once, before_last, iters, device):
    """(mean seconds, seconds of each iteration); before_last() runs untimed before the last one."""
    if device.type == "cuda":
        # Mean as nccl-tests takes it: events around the whole batch, nothing between launches, so
        # the launch rate of small messages is not slowed by the timing itself.
        batch_start = torch.cuda.Event(enable_timing=True)
        batch_end = torch.cuda.Event(enable_timing=True)
        batch_start.record()
        for _ in range(iters):
            run_once()
        batch_end.record()
        batch_end.synchronize()
        mean_s = batch_start.elapsed_time(batch_end) / 1e3 / iters
        # Percentiles from a second batch, an event pair around each call: when the host launches
        # slower than the GPU runs (small messages), the pair also holds launch latency: p50 > mean.
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
        for i in range(iters):
            if i == iters - 1:
                before_last()
            starts[i].record()
            run_once()
            ends[i].record()
        torch.cuda.synchronize()
        return mean_s, [start.elapsed_time(end) / 1e3 for start, end in zip(starts, ends)]
    seconds = []
    for i in range(iters):  # gloo returns when the result is there: a wall clock per call is exact
        if i == iters - 1:
            before_last()
        started = time.perf_counter()
        run_once()
        seconds.append(time.perf_counter() - started)
        beat()  # a slow row that progresses is no hang
    return sum(seconds) / iters, seconds


def run_row(op, size_bytes, args, device, rank, world_size, corrupt):
    """One line of the table: check the first call, warm up, time, check the last timed call."""
    beat(f"{op} at {size_bytes} B")
    dtype, modulus = DTYPES[args.dtype], pattern_modulus(op, args.dtype, world_size)
    count, input_buffer, output_buffer = make_buffers(op, size_bytes, dtype, device, world_size)
    check = functools.partial(count_wrong, output_buffer, op, rank, world_size, count, modulus)
    refill(input_buffer, output_buffer, rank, modulus)
    run_collective(op, input_buffer, output_buffer)
    if corrupt:  # --inject-corruption: one bad element, which the check below must find
        middle = output_buffer.numel() // 2
        output_buffer[middle] = -output_buffer[middle]
    wrong = check()
    for _ in range(args.warmup):
        run_collective(op, input_buffer, output_buffer)
        beat()
    # all_reduce sums in place, so after many iterations the buffer holds huge numbers: refill
    # before the last one and check that its result is still exact
    mean_s, seconds = time_iterations(lambda: run_collective(op, input_buffer, output_buffer),
                                      lambda: refill(input_buffer, output_buffer, rank, modulus),
                                      args.iters, device)
    wrong += check()
    beat(f"{op} at {size_bytes} B")
    quantiles = torch.tensor([0.5, 0.95, 0.99]).double()
    percentiles = torch.tensor(seconds).double().quantile(quantiles).tolist()
    (wrong,) = all_reduce_floats([wrong], dist.ReduceOp.SUM, device)
    time_s, p50_s, p95_s, p99_s = all_reduce_floats([mean_s, *percentiles], dist.ReduceOp.MAX,
                                                    device)
    size_column = max(input_buffer.numel(), output_buffer.numel()) * dtype.itemsize
    algbw = size_column / time_s / 1e9 if time_s > 0 else 0.0
    return {"size": size_column, "count": count, "type": args.dtype, "op": op,
            "time_us": time_s * 1e6, "algbw": algbw, "busbw": algbw * bus_factor(op, world_size),
            "wrong": int(wrong), "p50_us": p50_s * 1e6, "p95_us": p95_s * 1e6,
            "p99_us": p99_s * 1e6}


def check_memory(args, sizes, device, world_size):
    """Refuse a size that cannot fit, before allocating: one line, not an out-of-memory crash."""
    element_size = DTYPES[args.dtype].itemsize
    needed, op, size = max((bytes_needed(op, size, element_size, world_size), op, size)
                           for op in args.ops for size in sizes)
    if device.type == "cuda":
        # NCCL's own buffers and the allocator need some
        free = torch.cuda.mem_get_info()[0] - (1 << 30)
    else:  # the ranks of one host share its memory
        with open("/proc/meminfo") as meminfo:
            available_kib = next(int(line.split()[1]) for line in meminfo
                                 if line.startswith("MemAvailable:"))
        free = available_kib * 1024 // int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    (free,) = all_reduce_floats([free], dist.ReduceOp.MIN, device)
    if needed > free:
        die(f"{op} of {size} B needs {needed / 2**30:.1f} GiB on each rank but only "
            f"{max(free, 0) / 2**30:.1f} GiB is free on some rank "
            "-> pass smaller --sizes or --max-bytes")


# ------------------------------------------------------------ 5. model: gradient consistency
def tensors_differ(tensors, device, world_size):
    """(max |difference| to rank 0, elements that differ, per-tensor checksums equal on all ranks),
    the same answer on every rank: each one compares, not only rank 0."""
    checksums = torch.stack([tensor.detach().double().sum() for tensor in tensors])
    every_checksum = torch.empty(world_size * len(tensors), dtype=torch.float64, device=device)
    dist.all_gather_into_tensor(every_checksum, checksums)
    checksums_equal = bool((every_checksum.view(world_size, -1) == checksums).all())
    mine = torch.cat([tensor.detach().reshape(-1).float() for tensor in tensors])
    reference = mine.clone()
    dist.broadcast(reference, src=0)
    differ = [(mine - reference).abs().max().item(), (mine != reference).sum().item(),
              float(not checksums_equal)]
    max_diff, elements, unequal = all_reduce_floats(differ, dist.ReduceOp.MAX, device)
    return max_diff, int(elements), unequal == 0


def check_gradients(args, device, rank, world_size):
    beat("gradient check")
    model = args.model.to(device)
    model.loss_type = "ForCausalLM"  # transformers 5 picks it anyway, but warns when it guesses
    ddp_model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    # different tokens on each rank: identical gradients then prove DDP's all-reduce, not equal data
    generator = torch.Generator().manual_seed(SEED + rank)
    tokens = torch.randint(0, args.vocab_size, (SEQUENCES_PER_RANK, SEQ_LEN),
                           generator=generator).to(device)
    loss = ddp_model(input_ids=tokens, labels=tokens).loss
    loss.backward()
    params = [param for param in model.parameters() if param.grad is not None]
    if rank == args.inject_grad_corruption:
        params[0].grad.view(-1)[0] += 1.0
    grads = [p.grad for p in params]
    grad_diff, grad_elements, grad_checksums_equal = tensors_differ(grads, device, world_size)
    torch.optim.AdamW(model.parameters(), lr=1e-3).step()
    param_diff, param_elements, param_checksums_equal = tensors_differ(params, device, world_size)
    losses = torch.empty(world_size, device=device)
    dist.all_gather_into_tensor(losses, loss.detach().float().reshape(1))
    beat("gradient check done")
    passed = grad_elements == param_elements == 0 and grad_checksums_equal and param_checksums_equal
    return {"passed": passed, "max_grad_diff": grad_diff, "grad_elements_differing": grad_elements,
            "max_param_diff": param_diff, "param_elements_differing": param_elements,
            "checksums_equal": grad_checksums_equal and param_checksums_equal,
            "parameters": sum(p.numel() for p in params), "losses_per_rank": losses.tolist()}


# ----------------------------------------------------------------------------- 6. soak
def run_soak(args, sizes, device, rank, world_size):
    """Repeat a mix of collectives for --duration s, check every result and keep, per rank, the wall
    time each collective took: the first rank to arrive waits for the last, so max - min over ranks
    is how late the last one came (the skew), and the rank that waited least is the straggler."""
    dtype = DTYPES[args.dtype]
    mix = [(op, size) for op in args.ops
           for size in sorted({sizes[0], sizes[len(sizes) // 2], sizes[-1]})
           if element_counts(op, size, dtype.itemsize, world_size)[0] > 0]
    waits, wrong, started = [], 0, time.monotonic()
    while True:
        for op, size in mix:
            count, input_buffer, output_buffer = make_buffers(op, size, dtype, device, world_size)
            modulus = pattern_modulus(op, args.dtype, world_size)
            refill(input_buffer, output_buffer, rank, modulus)
            if device.type == "cuda":
                torch.cuda.synchronize()  # so the wait below counts the collective, not the fill
            entered = time.perf_counter()
            run_collective(op, input_buffer, output_buffer)
            if device.type == "cuda":
                torch.cuda.synchronize()
            waits.append(time.perf_counter() - entered)
            wrong += count_wrong(output_buffer, op, rank, world_size, count, modulus)
            beat(f"soak: {op} at {size} B")
        # all ranks stop after the same round, or the rest would wait out --timeout in a collective
        time_up, wrong_so_far = all_reduce_floats(
            [time.monotonic() - started >= args.duration, wrong], dist.ReduceOp.SUM, device)
        if time_up or wrong_so_far:
            break
    every_wait = torch.empty(world_size * len(waits), dtype=torch.float64, device=device)
    dist.all_gather_into_tensor(every_wait, torch.tensor(waits, dtype=torch.float64, device=device))
    every_wait = every_wait.view(world_size, -1).cpu()
    skew = every_wait.max(0).values - every_wait.min(0).values
    last_to_arrive = Counter(every_wait.argmin(0).tolist()) if world_size > 1 else Counter()
    straggler, times_last = last_to_arrive.most_common(1)[0] if last_to_arrive else (0, 0)
    return {"seconds": time.monotonic() - started, "collectives": len(waits),
            "wrong": int(wrong_so_far), "skew_mean_us": skew.mean().item() * 1e6,
            "skew_p99_us": skew.quantile(0.99).item() * 1e6, "skew_max_us": skew.max().item() * 1e6,
            "straggler_rank": straggler, "straggler_share": times_last / len(waits),
            "mean_wait_us_per_rank": (every_wait.mean(1) * 1e6).tolist()}


# ----------------------------------------------------------------------------- 7. report
COLUMNS = "{:>12} {:>12} {:>9} {:>15} {:>10} {:>12} {:>12} {:>7} {:>10} {:>10} {:>10}"


def print_header(args, device, world_size):
    """Rank 0 prints what ran where; returns the same facts for --json (every rank must call it)."""
    hosts = [None] * world_size
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    dist.all_gather_object(hosts, f"{socket.gethostname()}: {device_name}")
    nccl = ".".join(map(str, torch.cuda.nccl.version())) if device.type == "cuda" else None
    run = {"world_size": world_size, "backend": dist.get_backend(), "torch": torch.__version__,
           "nccl": nccl, "devices": dict(Counter(hosts)), "dtype": args.dtype, "iters": args.iters,
           "warmup": args.warmup}
    if dist.get_rank() == 0:
        say(f"# stress_test: {world_size} ranks, backend {run['backend']}, "
            f"torch {torch.__version__}"
            + (f", NCCL {nccl}" if nccl else "")
            + f", {args.dtype}, {args.iters} timed iterations "
            f"after {args.warmup} warm-up per row")
        for host_device, ranks in run["devices"].items():
            say(f"#   {ranks} x {host_device}")
        say("#" + COLUMNS.format("size(B)", "count", "type", "op", "time(us)", "algbw(GB/s)",
                                 "busbw(GB/s)", "#wrong", "p50(us)", "p95(us)", "p99(us)")[1:])
    return run


def check_json_path(path, device):
    """Rank 0 writes --json at the very end: prove now that it can, so no run is lost to a typo.
    Only rank 0 looks (the path is on its host); every rank gets its verdict."""
    problem = ""
    if path and dist.get_rank() == 0:
        directory = os.path.dirname(os.path.abspath(path))
        if os.path.isdir(path):
            problem = "is a directory"
        elif os.path.exists(path) and not os.path.isfile(path):  # /dev/null would be replaced
            problem = "is not a regular file (a device, a pipe)"
        else:
            try:  # the very file the end writes, made and removed: the file at path stays
                open(json_partial(path), "x").close()
                os.remove(json_partial(path))
            except OSError as error:
                problem = f"cannot write into {directory}: {error.strerror}"
    (problems,) = all_reduce_floats([1.0 if problem else 0.0], dist.ReduceOp.SUM, device)
    if problems:
        die(f"--json {path} {problem} -> give a file path in an existing, writable directory "
            "(nothing was run)")


def json_partial(path):
    return f"{path}.tmp-{os.getpid()}"


def main():
    args, sizes = load_config(sys.argv[1:], world_size=int(os.environ.get("WORLD_SIZE", 1)))
    device, rank, world_size = init_distributed(args.timeout)
    check_json_path(args.json, device)
    start_watchdog(args.timeout, rank)
    check_memory(args, sizes, device, world_size)
    run = print_header(args, device, world_size)
    for _ in range(int(3 * args.timeout) if rank == args.inject_stall else 0):
        time.sleep(1)  # stalled but alive: the other ranks' watchdogs must catch it, not its own
        beat("--inject-stall")
    rows, skipped = [], []
    for op in args.ops:
        for size in sizes:
            if element_counts(op, size, DTYPES[args.dtype].itemsize, world_size)[0] == 0:
                skipped.append(f"{op} at {size} B")
                continue
            rows.append(run_row(op, size, args, device, rank, world_size,
                                corrupt=rank == args.inject_corruption and not rows))
            row = rows[-1]
            if rank == 0:
                speed = [f"{row[key]:.2f}" for key in ("time_us", "algbw", "busbw")]
                percentiles = [f"{row[key]:.2f}" for key in ("p50_us", "p95_us", "p99_us")]
                say(COLUMNS.format(row["size"], row["count"], args.dtype, op, *speed, row["wrong"],
                                   *percentiles))
    failures = [f"#wrong {row['wrong']} in {row['op']} at {row['size']} B"
                for row in rows if row["wrong"]]
    if rank == 0:
        if skipped:
            say(f"# skipped, less than one element per rank: {', '.join(skipped)}")
        for op in args.ops:
            best = max((row for row in rows if row["op"] == op), key=lambda row: row["busbw"],
                       default=None)
            if best:
                say(f"# peak busbw {op}: {best['busbw']:.2f} GB/s at {best['size']} B")

    grad = None if args.skip_grad_check else check_gradients(args, device, rank, world_size)
    if grad and not grad["passed"]:
        failures.append("gradients or parameters differ across ranks")
    if grad and rank == 0:
        say(f"grad check ({args.model_type}, {grad['parameters']:,} parameters, DDP, "
            f"one AdamW step): max |grad diff| = {grad['max_grad_diff']:g} "
            f"across {world_size} ranks ({grad['grad_elements_differing']} elements differ), "
            f"max |param diff| = {grad['max_param_diff']:g} "
            f"({grad['param_elements_differing']} differ), per-tensor checksums "
            f"{'equal' if grad['checksums_equal'] else 'DIFFER'} on every rank: "
            f"{'PASS' if grad['passed'] else 'FAIL'}")

    soak = run_soak(args, sizes, device, rank, world_size) if args.duration else None
    if soak and soak["wrong"]:
        failures.append(f"#wrong {soak['wrong']} in the soak")
    if soak and rank == 0:
        say(f"soak: {soak['collectives']} collectives in {soak['seconds']:.1f} s, "
            f"{soak['wrong']} wrong; arrival skew mean {soak['skew_mean_us']:.1f} us, "
            f"p99 {soak['skew_p99_us']:.1f} us, max {soak['skew_max_us']:.1f} us; "
            f"last to arrive most often: rank {soak['straggler_rank']} "
            f"({soak['straggler_share']:.0%} of collectives)")

    if rank == 0:
        if failures:  # the line launch.sh reports
            say(f"error: stress_test: FAIL ({'; '.join(failures)}) -> a wrong result is a fault "
                "of a GPU, a link or a driver: run on fewer nodes or GPUs to find it",
                file=sys.stderr)
        say(f"stress_test: FAIL ({'; '.join(failures)})" if failures else
            f"stress_test: PASS (0 wrong elements in {len(rows)} rows"
            + (f", grads identical across {world_size} ranks" if grad else "")
            + (f", soak of {soak['seconds']:.0f} s clean" if soak else "") + ")")
        if args.json:  # written beside, then renamed: a crash midway leaves the previous file whole
            partial = json_partial(args.json)
            with open(partial, "w") as out:
                json.dump({"argv": sys.argv, "run": run, "sizes": sizes, "rows": rows,
                           "grad_check": grad, "soak": soak, "passed": not failures,
                           "failures": failures}, out, indent=2)
            os.replace(partial, args.json)
    dist.destroy_process_group()
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    try:
        main()
    except dist.DistError as error:  # a peer vanished or timed out: one line, no C++ backtrace
        say(f"error: rank {os.environ.get('RANK', 0)}: collective failed: "
            f"{str(error).splitlines()[0]} -> a rank died or hangs, or the network is down; "
            "see the other ranks' lines", file=sys.stderr)
        os._exit(1)
