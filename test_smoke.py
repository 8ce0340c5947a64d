"""The tests: CPU only, gloo, tiny models, a process per rank where behaviour is distributed
(launch.sh and torchrun where they are what is tested, else ranks forked from this process: Ranks).

    python3 -m pytest -q test_smoke.py

The sections, in this order, each opened by a line `# ---- name ----`:
    shared helpers                        running commands, torchrun and trainers; reading output
    shared fixtures                       a tiny corpus, its prepared data, the 8-step run
    preprocess.py: text                   inputs, tokenizers, shards, val split, reruns, bad input
    preprocess.py: images                 folders, HF files, digits, broken files, reruns, bad input
    train_ddp.py: config                  overrides, ranges, the config file, the batch split
    train_ddp.py: distributed init        precision by compute capability, on_rank0, on_all_ranks
    train_ddp.py: data, sampler, masking  meta.json, token ids, the batch plan, MLM masking, padding
    train_ddp.py: model and attention     pretrained models, model settings, attention, FLOPs
    train_ddp.py: loss normalisation      the token mean; any split into ranks and micro-batches
    train_ddp.py: train_step              when the host waits for the device
    train_ddp.py: gradient reduction      DDP, InlineReducer, NaiveReducer, bf16, all-reduce timing
    train_ddp.py: checkpoints and resume  exact resume, pruning, damage, refusals, a shared dir
    train_ddp.py: validation              the 8-step run: val loss, log, schedule, memory, files
    train_ddp.py: export                  the export in transformers and as model.pretrained
    train_ddp.py: stops, signals, locks   stop signals, the directory lock, a full disk
    train_ddp.py: metrics and logging     the log line, TensorBoard, Prometheus, NVML, timers, MFU
    train_ddp.py: faults                  FAULT=kind:rank:step: killed, NaN, diverging, hung ranks
    train_ddp.py: tiered embedding        against a plain reference, resume, the tier map, refusals
    train_ddp.py: fp8                     the layers converted, the refusals, fp8 to bf16, export
    train_ddp.py: images (ViT)            the digits run, resume, FSDP, export, val, FLOPs, refusals
    train_fsdp.py                         DDP's losses, shards, fp16 scaler, checkpoints, refusals
    stress_test.py                        the table, injected faults, the soak, options
    launch.sh                             the torchrun command, each check, restarts, SIGTERM
    launch.sh: two hosts                  two network namespaces train one run together
    bench/                                bench.py's figures, summaries, nodes, variants, timm
    the scripts' form                     linter, fenced parts, copies alone, config.yaml, budgets
"""

import ast
import hashlib
import contextlib
import gc
import importlib.util
import io
import json
import math
import os
import random
import re
import runpy
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import types
import unittest.mock
import warnings
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from PIL import ExifTags, Image, ImageOps
from tokenizers import Tokenizer, models, pre_tokenizers, trainers

REPO = Path(__file__).resolve().parent
TRAINERS = ["train_ddp.py", "train_fsdp.py"]
sys.path.insert(0, str(REPO))
import preprocess  # noqa: E402
import train_ddp  # noqa: E402
from stress_test import OPS, parse_size  # noqa: E402

TINY_MODEL = ["model.n_layer=2", "model.n_head=2", "model.n_embd=32", "train.seq_len=64"]
# the 8-step run that the checkpoint and resume tests continue from (their own runs must match it)
EIGHT_STEPS = [*TINY_MODEL, "train.global_batch_size=16", "train.micro_batch_size=4",
               "train.max_steps=8", "checkpoint.every=4", "train.eval_every=4", "log.every=1",
               "optim.lr=1e-2", "optim.warmup_steps=2"]


# ---- shared helpers ------------------------------------------------------------------------------

def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def kill_process_tree(pid):
    """SIGKILL a process and all its descendants. torchrun starts its workers in sessions of their
    own, so killing torchrun's process group would leave them running."""
    children = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:  # the process ended meanwhile
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    doomed, index = [pid], 0
    while index < len(doomed):
        doomed += children.get(doomed[index], [])
        index += 1
    for victim in doomed:
        with contextlib.suppress(ProcessLookupError):
            os.kill(victim, signal.SIGKILL)


def run(command, env_extra=None, timeout=300, cwd=REPO):
    """Run a command; on timeout kill it and its descendants (torchrun's workers too: left running,
    they would slow every later test) and fail with what it printed, so a hang can be diagnosed."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **(env_extra or {})}
    process = subprocess.Popen(command, cwd=cwd, env=env, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_process_tree(process.pid)
        stdout, stderr = process.communicate()
        pytest.fail(f"timed out after {timeout} s: {' '.join(map(str, command))}\n"
                    f"{stdout[-4000:]}\n{stderr[-4000:]}")
    return subprocess.CompletedProcess(command, process.returncode, stdout, stderr)


def reader_leaves_after_one_line(command, timeout=300, env_extra=None):
    """Run a command whose stdout's reader leaves after the first line, as `| head -n 1` does:
    every later print meets a broken pipe. Returns (that line, exit code, stderr)."""
    process = subprocess.Popen(command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True, env={**os.environ, "OMP_NUM_THREADS": "1",
                                               **(env_extra or {})})
    first = process.stdout.readline()
    process.stdout.close()
    stderr = process.communicate(timeout=timeout)[1]
    return first, process.returncode, stderr


def with_timeout(script, args):
    """A hung collective fails (naming the lost ranks) before the test's timeout; a test's own
    dist.timeout_s comes later and wins."""
    return ("dist.timeout_s=120", *args) if str(script).startswith("train_") else args


def torchrun_command(nproc, script, *args, max_restarts=0):
    args = with_timeout(script, args)
    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
            "--max-restarts", str(max_restarts), "--master-addr", "127.0.0.1",
            "--master-port", str(free_port()), str(REPO / script), *args]


def torchrun(nproc, script, *args, timeout=300, must_pass=True, env_extra=None, max_restarts=0):
    """`torchrun --nproc-per-node NPROC SCRIPT ARGS`. Without restarts (torchrun's own part) it runs
    as forked_ranks: the same ranks, seconds sooner."""
    if not max_restarts:
        result = forked_ranks(nproc, script, *args, env_extra=env_extra, timeout=timeout)
    else:
        result = run(torchrun_command(nproc, script, *args, max_restarts=max_restarts),
                     env_extra=env_extra, timeout=timeout)
    if must_pass:
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result


def forked_ranks(nproc, script, *args, env_extra=None, timeout=300):
    """Ranks(...) run to their end: a CompletedProcess of every rank's output, rank 0's first."""
    return Ranks(nproc, script, *args, env_extra=env_extra).wait(timeout)


class Ranks:
    """What torchrun starts, without torchrun: NPROC ranks forked from this process (torch and the
    trainers imported already; a new interpreter spends seconds importing them), each running
    SCRIPT as `python SCRIPT ARGS` would, in torchrun's environment, its output in files. When a
    rank fails the others end as under torchrun: those still running 2 s later get SIGTERM, then
    SIGKILL after 30 s; the exit code is then 1. cwd: a directory the script is copied into, run
    there as alone: this repository off sys.path and its modules forgotten."""

    def __init__(self, nproc, script, *args, env_extra=None, cwd=REPO):
        self.script, self.args, self.codes = script, with_timeout(script, args), {}
        self.cwd = Path(cwd)
        self.logs, port = Path(tempfile.mkdtemp(prefix="ranks-")), free_port()
        self.pids = [self.fork(rank, nproc, port, env_extra or {}) for rank in range(nproc)]

    def fork(self, rank, nproc, port, env_extra):
        for name in ["out", "err"]:  # before the child runs: output() may read them at once
            (self.logs / f"{rank}.{name}").touch()
        pid = os.fork()
        if pid:
            return pid
        code = 1  # the child: never back into pytest
        try:
            for fd, name in [(1, "out"), (2, "err")]:
                os.dup2(os.open(self.logs / f"{rank}.{name}", os.O_WRONLY | os.O_CREAT), fd)
            sys.stdout = open(1, "w", buffering=1, closefd=False)
            sys.stderr = open(2, "w", buffering=1, closefd=False)
            os.environ.update({"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **env_extra,
                               "RANK": str(rank), "LOCAL_RANK": str(rank),
                               "WORLD_SIZE": str(nproc), "LOCAL_WORLD_SIZE": str(nproc),
                               "GROUP_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                               "MASTER_PORT": str(port)})
            torch.set_num_threads(1)
            os.chdir(self.cwd)
            if self.cwd != REPO:
                sys.path[:] = [entry for entry in sys.path if Path(entry or ".").resolve() != REPO]
                for name in ["train_ddp", "train_fsdp", "preprocess", "stress_test"]:
                    sys.modules.pop(name, None)
            sys.argv = [str(self.cwd / self.script), *map(str, self.args)]
            try:
                runpy.run_path(str(self.cwd / self.script), run_name="__main__")
                code = 0
            except SystemExit as ending:
                code = ending.code if isinstance(ending.code, int) else int(bool(ending.code))
                if isinstance(ending.code, str):
                    print(ending.code, file=sys.stderr)
        except BaseException:
            traceback.print_exc()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)

    def poll(self):
        """None while every rank runs, else the exit code so far (1 if any failed)."""
        for pid in self.pids:
            if pid not in self.codes and (status := os.waitpid(pid, os.WNOHANG))[0]:
                self.codes[pid] = os.waitstatus_to_exitcode(status[1])
        return int(any(self.codes.values())) if self.codes else None

    def output(self, name="out", rank=None):
        ranks = range(len(self.pids)) if rank is None else [rank]
        return "".join((self.logs / f"{r}.{name}").read_text(errors="replace") for r in ranks)

    def read_until(self, prefix, timeout=180):
        """Wait until rank 0 has printed a line starting with prefix."""
        deadline = time.monotonic() + timeout
        while not re.search(rf"^{re.escape(prefix)}", self.output(rank=0), re.MULTILINE):
            if time.monotonic() > deadline or len(self.codes) == len(self.pids):
                pytest.fail(self.output()[-3000:] + self.output("err")[-3000:])
            self.poll()
            time.sleep(0.05)

    def kill(self):
        for pid in set(self.pids) - set(self.codes):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        while len(self.codes) < len(self.pids):
            self.poll()
            time.sleep(0.02)

    def wait(self, timeout=300):
        deadline, failed_at, signalled = time.monotonic() + timeout, None, set()
        while len(self.codes) < len(self.pids):
            self.poll()
            now = time.monotonic()
            failed_at = failed_at or (now if any(self.codes.values()) else None)
            for pid in set(self.pids) - set(self.codes):
                if now > deadline or (failed_at and now > failed_at + 32):
                    os.kill(pid, signal.SIGKILL)
                elif failed_at and now > failed_at + 2 and pid not in signalled:
                    os.kill(pid, signal.SIGTERM)
                    signalled.add(pid)
            time.sleep(0.02)
        stdout, stderr = self.output(), self.output("err")
        shutil.rmtree(self.logs)
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout} s: {self.script} {self.args}\n"
                        f"{stdout[-4000:]}\n{stderr[-4000:]}")
        return subprocess.CompletedProcess(["forked", self.script, *self.args], self.poll(),
                                           stdout, stderr)


def assert_one_line_error(result, *fragments, under_torchrun=False):
    """Bad input: non-zero exit, a clear `error:` line, and no traceback. Under bare torchrun a
    failed worker is followed by torchrun's own ChildFailedError traceback; none may come from our
    scripts."""
    assert result.returncode != 0
    output = result.stdout + result.stderr
    if under_torchrun:
        assert not re.search(r'File ".*(train_ddp|train_fsdp|preprocess|stress_test)\.py", line',
                             output), output
    else:
        assert "Traceback" not in output, output
    error_lines = [line for line in output.splitlines() if line.startswith("error:")]
    assert error_lines, output
    for fragment in fragments:
        assert fragment in error_lines[0], error_lines[0]


def train_in_process(*args, env=None, trainer=train_ddp):
    """train_ddp.main() (or another trainer module's) in this process, as `python train_ddp.py ARGS`
    runs it, without the seconds a new interpreter spends importing torch and transformers. Returns
    (the error message or None, the printout). The `error:` line and exit code of a real process are
    tested by the subprocess tests."""
    given, scratch = {str(arg).partition("=")[0] for arg in args}, None
    if "--check" not in given:  # never a checkout's own out/: a run there would resume from it
        scratch = Path(tempfile.mkdtemp(prefix="train-in-process-"))
        args = (*args, *([f"out_dir={scratch}"] if "out_dir" not in given else []),
                *([f"checkpoint.dir={scratch}/ckpt"] if "checkpoint.dir" not in given else []))
    saved_argv, saved_env = sys.argv, dict(os.environ)
    saved_handlers = {number: signal.getsignal(number)
                      for number in (signal.SIGTERM, signal.SIGINT)}
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        os.environ.pop(key, None)
    os.environ.update(env or {})
    sys.argv = [Path(trainer.__file__).name, *map(str, args)]
    printed = io.StringIO()
    try:
        with contextlib.redirect_stdout(printed):
            trainer.main()
        error = None
    except trainer.UserError as failure:
        error = str(failure)
    finally:
        sys.argv = saved_argv
        os.environ.clear()
        os.environ.update(saved_env)
        for number, handler in saved_handlers.items():
            signal.signal(number, handler)
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
        if scratch:
            shutil.rmtree(scratch, ignore_errors=True)
    return error, printed.getvalue()


def read_metrics(out_dir, kind):
    lines = [json.loads(line)
             for line in (Path(out_dir) / "metrics.jsonl").read_text().splitlines()]
    return [line for line in lines if line["kind"] == kind]


def final_weights(ckpt_step_dir):
    return torch.load(Path(ckpt_step_dir) / "model.pt", weights_only=True)


def losses(out_dir):
    return {t["step"]: t["loss"] for t in read_metrics(out_dir, "train")}


SPECIAL_ROLES = ["eot", "pad", "mask", "cls", "sep"]


def kill_preprocess_midway(args, out, marker):
    """SIGKILL preprocess.py once its temporary directory holds `marker`: what it leaves must be
    nothing of out, or (if it finished first) all of it."""
    process = subprocess.Popen(args, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    temp_dir = out.with_name(f"{out.name}.tmp-preprocess-{process.pid}")
    while process.poll() is None and not (temp_dir / marker).exists():
        time.sleep(0.005)
    process.kill()
    process.wait()
    if out.exists():  # it finished before the kill: then it must be complete
        meta = json.loads((out / "meta.json").read_text())
        assert all((out / name).exists() for split in meta["splits"].values()
                   for name in split["files"])
    else:
        assert temp_dir.exists() and not (temp_dir / "meta.json").exists()


def run_preprocess(*args):
    return subprocess.run([sys.executable, "preprocess.py", *map(str, args)], cwd=REPO,
                          capture_output=True, text=True, timeout=120)


@contextlib.contextmanager
def monkeypatched_argv(argv):
    saved, sys.argv = sys.argv, argv
    try:
        yield
    finally:
        sys.argv = saved


@pytest.fixture()
def busy_port():
    with socket.socket() as listener:
        listener.bind(("", 0))
        listener.listen()
        yield listener.getsockname()[1]


def is_running(pid):
    """True while pid is a live process; a zombie has ended and only waits for its parent."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


def load_bench(name="bench"):
    """bench/NAME.py as a module (bench/ is not a package)."""
    spec = importlib.util.spec_from_file_location(name, REPO / "bench" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# ---- shared fixtures -----------------------------------------------------------------------------

@pytest.fixture(scope="session")
def corpus_dir(tmp_path_factory):
    """Code-like documents of very different lengths (a few tokens to a few hundred), so masked-LM
    batches really need dynamic padding and a causal model can learn something in a few steps."""
    directory = tmp_path_factory.mktemp("corpus")
    rng = random.Random(0)
    names = ["alpha", "beta", "gamma", "delta", "sum", "scale", "shift", "mean"]
    for doc_index in range(240):
        lines = []
        for function_index in range(rng.choice([1, 1, 2, 3, 8, 20])):
            name = rng.choice(names)
            lines.append(f"def {name}_{function_index}(x, y):\n"
                         f"    return x * {function_index} + y - {doc_index % 7}\n")
        (directory / f"doc_{doc_index:03d}.txt").write_text("\n".join(lines))
    return directory


@pytest.fixture(scope="session")
def data_dir(corpus_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("data") / "tiny"
    result = run([sys.executable, "preprocess.py", "--input", str(corpus_dir), "--out", str(out),
                  "--vocab-size", "400", "--val-fraction", "0.1"])
    assert result.returncode == 0, result.stderr
    return out


@pytest.fixture(scope="module")
def trained_run(data_dir, tmp_path_factory):
    """8 steps on 2 processes through launch.sh, checkpoints at steps 4 and 8."""
    out = tmp_path_factory.mktemp("run")
    result = run(["bash", "launch.sh", f"data.dir={data_dir}", *EIGHT_STEPS, "model.dropout=0.1",
                  f"out_dir={out}", f"checkpoint.dir={out}/ckpt"],
                 env_extra={"MASTER_PORT": str(free_port()), "LOG_DIR": f"{out}/logs"})
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return out, result


# ---- preprocess.py: text -------------------------------------------------------------------------

def make_corpus(root):
    """A directory of text files, a jsonl and a parquet file; returns them with their documents in
    order."""
    texts_dir = root / "texts"
    for i in range(30):
        path = texts_dir / f"part{i % 3}" / f"doc{i:02d}.{'md' if i % 4 == 0 else 'txt'}"
        path.parent.mkdir(parents=True, exist_ok=True)
        line = (f"Document {i}: def f{i}(x):\n"
                f"    return x * {i}  # naïve ünïcödé, 漢字, emoji 🐍\n")
        path.write_text(line * (i + 1))
    (texts_dir / "empty.txt").write_text("")  # skipped: no document
    (texts_dir / "notes.csv").write_text("not,taken")  # not in --ext
    (texts_dir / "contains_eot.txt").write_text("a literal <|endoftext|> is just text\n")
    (texts_dir / "latin1.txt").write_bytes("caf\xe9 cr\xe8me".encode("latin-1"))
    jsonl = root / "lines.jsonl"
    jsonl_texts = [f"jsonl line {i}\nwith\ttabs and  spaces {'x' * i}" for i in range(20)]
    jsonl.write_text("\n".join(json.dumps({"text": t, "id": i}) for i, t in enumerate(jsonl_texts))
                     + "\n")
    parquet = root / "table.parquet"
    parquet_texts = [f"parquet row {i} " + "word " * i for i in range(25)]
    pq.write_table(pa.table({"text": parquet_texts, "n": list(range(25))}), parquet,
                   row_group_size=7)

    documents = []  # (key, text) in the order preprocess.py must write them
    for path in sorted(texts_dir.rglob("*"), key=lambda p: p.relative_to(texts_dir).as_posix()):
        if path.suffix in (".txt", ".md") and path.stat().st_size:
            documents.append((path.relative_to(texts_dir).as_posix(),
                              path.read_bytes().decode("utf-8", "replace")))
    documents += [(f"lines.jsonl:{i + 1}", t) for i, t in enumerate(jsonl_texts)]
    documents += [(f"table.parquet:{i}", t) for i, t in enumerate(parquet_texts) if t]
    return [texts_dir, jsonl, parquet], documents


def in_val(key, val_fraction):
    h = int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "little")
    return h % 1_000_000 < round(val_fraction * 1_000_000)


def read_rows(out, split):
    meta = json.loads((out / "meta.json").read_text())
    rows = []
    for name in meta["splits"][split]["files"]:
        table = pa.ipc.open_file(pa.memory_map(str(out / name))).read_all()
        assert table.schema.field("input_ids").type == pa.list_(pa.uint16())
        rows += table.column("input_ids").to_pylist()
    return rows


def file_state(out):
    return {p.name: (p.stat().st_mtime_ns, p.read_bytes()) for p in sorted(out.iterdir())}


@pytest.fixture
def corpus(tmp_path):
    return make_corpus(tmp_path)


def test_preprocess_whose_stdout_reader_leaves_writes_its_data_all_the_same(corpus_dir, tmp_path):
    """`preprocess.py ... | head -n 1`: the lines after the first meet a broken pipe."""
    command = [sys.executable, "preprocess.py", "--input", str(corpus_dir), "--out",
               str(tmp_path / "out"), "--vocab-size", "400"]
    first, code, stderr = reader_leaves_after_one_line(command)
    assert first.startswith("training a 400-token") and code == 0, stderr
    assert "error" not in stderr and "Broken" not in stderr, stderr
    meta = json.loads((tmp_path / "out" / "meta.json").read_text())  # written last: complete
    assert meta["splits"]["train"]["documents"] > 0


def test_round_trip_decodes_every_row_to_its_document_and_meta_matches(tmp_path, corpus):
    inputs, documents = corpus
    out = tmp_path / "out"
    result = run_preprocess("--input", *inputs, "--out", out, "--vocab-size", 300,
                            "--val-fraction", 0.25)
    assert result.returncode == 0, result.stderr
    assert "invalid UTF-8 replaced by U+FFFD in 1 documents" in result.stdout
    meta = json.loads((out / "meta.json").read_text())
    tokenizer = Tokenizer.from_file(str(out / meta["tokenizer_file"]))
    eot = meta["special_tokens"]["eot"]
    assert meta["special_tokens"] == dict(zip(SPECIAL_ROLES, range(5)))
    assert meta["tokenizer_trained"] and meta["eot_appended"] and meta["token_dtype"] == "uint16"
    frequencies = np.load(out / meta["token_frequencies_file"])
    assert meta["vocab_size"] == tokenizer.get_vocab_size(with_added_tokens=True) \
        == len(frequencies)
    for split in ("train", "val"):
        expected = [text for key, text in documents if in_val(key, 0.25) == (split == "val")]
        rows = read_rows(out, split)
        assert len(rows) == len(expected) == meta["splits"][split]["documents"] > 0
        assert sum(map(len, rows)) == meta["splits"][split]["tokens"]
        for row, text in zip(rows, expected):
            assert row[-1] == eot and eot not in row[:-1]  # the literal "<|endoftext|>" stays text
            assert tokenizer.decode(row[:-1], skip_special_tokens=False) == text
    assert frequencies.sum() == meta["splits"]["train"]["tokens"]
    train_ids = np.concatenate([np.array(row) for row in read_rows(out, "train")])
    assert np.array_equal(frequencies, np.bincount(train_ids, minlength=len(frequencies)))
    utf8_bytes = sum(len(text.encode()) for key, text in documents if key != "latin1.txt")
    # the latin-1 file counts its bytes as read
    assert meta["bytes"] == utf8_bytes + len("café crème")


def test_same_inputs_give_identical_files(tmp_path, corpus):
    inputs, _ = corpus
    for out in ("a", "b"):
        assert run_preprocess("--input", *inputs, "--out", tmp_path / out,
                              "--vocab-size", 300).returncode == 0
    files_a, files_b = sorted((tmp_path / "a").iterdir()), sorted((tmp_path / "b").iterdir())
    assert [p.name for p in files_a] == [p.name for p in files_b]
    for a, b in zip(files_a, files_b):
        if a.name == "meta.json":
            meta_a, meta_b = json.loads(a.read_text()), json.loads(b.read_text())
            meta_a.pop("created"), meta_b.pop("created")
            assert meta_a == meta_b
        else:
            assert a.read_bytes() == b.read_bytes(), a.name


def test_default_corpus_is_the_sorted_stdlib_without_site_packages():
    sources = preprocess.stdlib_sources()
    relpaths = [path.relative_to(root).as_posix() for root, path in sources]
    # ~1,800 in a python.org/pyenv build; ~570 where Debian/Ubuntu ship the tests apart
    assert len(relpaths) > 300
    assert relpaths == sorted(relpaths)
    assert all(p.endswith(".py") and "site-packages" not in p.split("/") for p in relpaths)
    assert len({root for root, _ in sources}) == 1


def test_arrow_stream_files_as_written_by_hf_datasets_are_read(tmp_path):
    texts = [f"arrow row {i}" for i in range(12)]
    with pa.ipc.new_stream(str(tmp_path / "data.arrow"),
                           pa.schema([("content", pa.string())])) as writer:
        writer.write_table(pa.table({"content": texts}), max_chunksize=5)
    out = tmp_path / "out"
    result = run_preprocess("--input", tmp_path / "data.arrow", "--column", "content", "--out", out,
                            "--vocab-size", 300, "--val-fraction", 0)
    assert result.returncode == 0, result.stderr
    tokenizer = Tokenizer.from_file(str(out / "tokenizer.json"))
    assert [tokenizer.decode(row[:-1]) for row in read_rows(out, "train")] == texts


def test_existing_tokenizer_is_reused_without_training(tmp_path, corpus):
    inputs, _ = corpus
    first = tmp_path / "first"
    assert run_preprocess("--input", *inputs, "--out", first, "--vocab-size", 300).returncode == 0
    for tokenizer_arg in (first / "tokenizer.json", first):  # the file, or a directory holding it
        out = tmp_path / f"reuse_{tokenizer_arg.name}"
        result = run_preprocess("--input", *inputs, "--out", out, "--tokenizer", tokenizer_arg)
        assert result.returncode == 0, result.stderr
        assert "training a" not in result.stdout and "added" not in result.stdout
        meta = json.loads((out / "meta.json").read_text())
        assert not meta["tokenizer_trained"]
        assert (out / "tokenizer.json").read_bytes() == (first / "tokenizer.json").read_bytes()
        for split in ("train", "val"):
            assert read_rows(out, split) == read_rows(first, split)


def test_tokenizer_lacking_special_tokens_gets_them_added(tmp_path, corpus):
    inputs, documents = corpus
    plain = Tokenizer(models.BPE())
    plain.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    plain.train_from_iterator([text for _, text in documents], trainers.BpeTrainer(
        vocab_size=280, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    plain.save(str(tmp_path / "plain.json"))
    base_size = plain.get_vocab_size(with_added_tokens=True)

    out = tmp_path / "out"
    result = run_preprocess("--input", *inputs, "--out", out,
                            "--tokenizer", tmp_path / "plain.json")
    assert result.returncode == 0, result.stderr
    added_lines = [line for line in result.stdout.splitlines() if "added" in line]
    assert len(added_lines) == 1 and "<|endoftext|>" in added_lines[0]
    meta = json.loads((out / "meta.json").read_text())
    assert sorted(meta["special_tokens"].values()) == list(range(base_size, base_size + 5))
    saved = Tokenizer.from_file(str(out / "tokenizer.json"))
    assert saved.token_to_id("<|endoftext|>") == meta["special_tokens"]["eot"]
    assert all(row[-1] == meta["special_tokens"]["eot"] for row in read_rows(out, "train"))


def test_known_special_token_names_are_found_in_other_tokenizers(tmp_path, corpus):
    inputs, documents = corpus
    roberta_like = Tokenizer(models.BPE())
    roberta_like.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    roberta_like.train_from_iterator([text for _, text in documents], trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<s>", "<pad>", "</s>", "<mask>"], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    roberta_like.save(str(tmp_path / "roberta.json"))
    result = run_preprocess("--input", *inputs, "--out", tmp_path / "out",
                            "--tokenizer", tmp_path / "roberta.json")
    assert result.returncode == 0 and "added" not in result.stdout, result.stderr
    meta = json.loads((tmp_path / "out" / "meta.json").read_text())
    assert meta["special_tokens"] == {"eot": 2, "pad": 1, "mask": 3, "cls": 0, "sep": 2}


def test_tokenizer_with_truncation_and_padding_is_used_with_both_turned_off(tmp_path, corpus):
    """Pretrained tokenizer.json files often have them on; left on, every document would be cut to
    max_length tokens and padded with pad ids inside the token stream."""
    inputs, documents = corpus
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.train_from_iterator([text for _, text in documents], trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|endoftext|>", "<|pad|>"], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tokenizer.save(str(tmp_path / "plain.json"))
    tokenizer.enable_truncation(max_length=8)
    tokenizer.enable_padding(pad_id=1, pad_token="<|pad|>", length=16)
    tokenizer.save(str(tmp_path / "truncating.json"))

    plain, truncating = tmp_path / "from_plain", tmp_path / "from_truncating"
    assert run_preprocess("--input", *inputs, "--out", plain,
                          "--tokenizer", tmp_path / "plain.json").returncode == 0
    result = run_preprocess("--input", *inputs, "--out", truncating,
                            "--tokenizer", tmp_path / "truncating.json")
    assert result.returncode == 0, result.stderr
    said = [line for line in result.stdout.splitlines() if "turned off" in line]
    assert len(said) == 1 and "truncation to 8 tokens and padding enabled" in said[0], result.stdout
    for split in ("train", "val"):
        assert read_rows(truncating, split) == read_rows(plain, split)
    assert max(map(len, read_rows(truncating, "train"))) > 16  # long documents kept whole
    copied = Tokenizer.from_file(str(truncating / "tokenizer.json"))
    assert copied.truncation is None and copied.padding is None


def test_shards_hold_at_most_shard_tokens_and_empty_split_gets_one_empty_file(tmp_path, corpus):
    inputs, _ = corpus
    whole, sharded = tmp_path / "whole", tmp_path / "sharded"
    common = ["--input", *inputs, "--vocab-size", 300, "--val-fraction", 0]
    assert run_preprocess(*common, "--out", whole).returncode == 0
    assert run_preprocess(*common, "--out", sharded, "--shard-tokens", 400).returncode == 0
    meta = json.loads((sharded / "meta.json").read_text())
    assert len(meta["splits"]["train"]["files"]) > 3
    for name in meta["splits"]["train"]["files"]:
        shard = pa.ipc.open_file(pa.memory_map(str(sharded / name))).read_all()
        rows = shard.column("input_ids").to_pylist()
        assert sum(map(len, rows)) <= 400 or len(rows) == 1
    assert read_rows(sharded, "train") == read_rows(whole, "train")
    assert meta["splits"]["val"] == {"files": ["val-00000.arrow"], "documents": 0, "tokens": 0}
    val_shard = pa.ipc.open_file(pa.memory_map(str(sharded / "val-00000.arrow"))).read_all()
    assert val_shard.num_rows == 0


@pytest.mark.parametrize("val_fraction, warning", [(0, "the val split is empty"),
                                                   (0.05, "the val split is tiny"), (0.5, None)])
def test_an_empty_or_tiny_val_split_gets_one_warning_line_and_exit_0(tmp_path, val_fraction,
                                                                     warning):
    # 400 documents of ~80 tokens: 5% held out is tiny, 50% is not
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(
        json.dumps({"text": f"document {i}: " + " ".join(f"w{i * j % 97}" for j in range(30))})
        + "\n" for i in range(400)))
    result = run_preprocess("--input", corpus, "--out", tmp_path / "out", "--vocab-size", 300,
                            "--val-fraction", val_fraction)
    assert result.returncode == 0, result.stderr
    warnings = [line for line in result.stderr.splitlines() if line.startswith("warning:")]
    assert len(warnings) == (1 if warning else 0), result.stderr
    if warning:
        assert warnings[0].startswith(f"warning: {warning}") and " -> " in warnings[0]
    assert (tmp_path / "out" / "meta.json").exists()


def test_preprocess_reads_exponent_floats_from_the_config(tmp_path):
    config = tmp_path / "config.yaml"
    config.write_text("data:\n  val_fraction: 2e-2\n  vocab_size: 512\n")
    assert preprocess.read_data_config(str(config))["val_fraction"] == 0.02
    config.write_text("data:\n  vocab_size: lots\n")
    result = run_preprocess("--config", config, "--out", tmp_path / "out")
    assert result.returncode == 2 and result.stderr.startswith("error: data.vocab_size='lots'")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("text, expected", [
    # a key given twice: one line naming the key and both its lines
    ("data:\n  vocab_size: 512\n  dir: d\n  vocab_size: 1024\n",
     "at line 4, column 3 ('vocab_size' is given twice, first at line 2) -> "),
    ("data:\n  dir: a\ntrain:\n  max_steps: 9\ndata:\n  dir: b\n",
     "at line 5, column 1 ('data' is given twice, first at line 1) -> "),
    # YAML 1.1 reads these as other numbers or booleans
    ("data:\n  vocab_size: 010\n", "data.vocab_size='010' in "),
    ("data:\n  vocab_size: yes\n", "data.vocab_size='yes' in "),
    ("data:\n  dir: 010\n", {"dir": "010"}),
    ("data:\n  dir: off\n", {"dir": "off"}),
    ("data:\n  dir: data/mine\n  vocab_size: 1_024\n  val_fraction: 5e-2\n",
     {"dir": "data/mine", "vocab_size": 1024, "val_fraction": 0.05}),
])
def test_preprocess_reads_the_config_as_the_trainers_do_and_a_key_given_twice_is_an_error(
        tmp_path, capsys, text, expected):
    config = tmp_path / "config.yaml"
    config.write_text(text)
    if isinstance(expected, dict):
        assert {key: preprocess.read_data_config(str(config))[key] for key in expected} == expected
        trainers_view = preprocess.yaml.load(text, Loader=train_ddp.ConfigLoader)["data"]
        assert {key: trainers_view[key] for key in expected} == expected
        return
    with pytest.raises(SystemExit) as ended:
        preprocess.read_data_config(str(config))
    error = capsys.readouterr().err
    assert ended.value.code == 2 and error.count("\n") == 1, error
    assert error.startswith(f"error: {config}" if "twice" in expected else "error: "), error
    assert expected in error and str(config) in error and " -> " in error, error


def test_rerun_is_noop_changed_inputs_need_force(tmp_path, corpus):
    inputs, _ = corpus
    out = tmp_path / "out"
    args = ["--input", *inputs, "--out", out, "--vocab-size", 300]
    assert run_preprocess(*args).returncode == 0
    before = file_state(out)

    again = run_preprocess(*args)
    assert again.returncode == 0 and "up to date" in again.stdout \
        and "training a" not in again.stdout
    assert file_state(out) == before

    (inputs[0] / "part0" / "doc00.md").write_text("changed")
    changed = run_preprocess(*args)
    assert changed.returncode == 2 and changed.stderr.startswith("error:") \
        and "--force" in changed.stderr
    assert file_state(out) == before

    forced = run_preprocess(*args, "--force")
    assert forced.returncode == 0, forced.stderr
    meta_before, meta_after = json.loads(before["meta.json"][1]), \
        json.loads((out / "meta.json").read_text())
    assert meta_after["fingerprint"] != meta_before["fingerprint"]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["texts", "lines.jsonl",
                                                                 "table.parquet", "out"])


def test_a_rebuild_writes_through_a_link_and_never_deletes_what_preprocess_did_not_write(
        tmp_path, corpus, monkeypatch):
    inputs, _ = corpus
    args = ["--input", inputs[0], "--vocab-size", 300]
    # --out a link to a folder elsewhere (data -> /scratch): the data goes there, the link stays
    (tmp_path / "scratch").mkdir()
    (tmp_path / "linked").symlink_to(tmp_path / "scratch")
    linked = preprocess_in_process(*args, "--out", tmp_path / "linked")
    assert linked.returncode == 0, linked.stderr
    assert (tmp_path / "linked").is_symlink() and (tmp_path / "scratch" / "meta.json").is_file()
    # a folder of ours plus a file of the user's: --force refuses, and both stay as they were
    out = tmp_path / "out"
    assert preprocess_in_process(*args, "--out", out).returncode == 0
    (out / "NOTES.md").write_text("mine")
    before = file_state(out)
    forced = preprocess_in_process(*args, "--out", out, "--force")
    assert forced.returncode == 2 and "'NOTES.md'" in forced.stderr \
        and "did not write" in forced.stderr and file_state(out) == before
    # a meta.json alone does not make a folder ours
    (tmp_path / "proj").mkdir()
    (tmp_path / "proj" / "meta.json").write_text("{}")
    (tmp_path / "proj" / "notes.txt").write_text("mine")
    assert preprocess_in_process(*args, "--out", tmp_path / "proj", "--force").returncode == 2
    assert (tmp_path / "proj" / "notes.txt").read_text() == "mine"
    # a lost shard is rebuilt, not reported up to date; a user's out.old-2024 is not a leftover
    (out / "NOTES.md").unlink()
    (out / "train-00000.arrow").unlink()
    (tmp_path / "out.old-2024").mkdir()
    rebuilt = preprocess_in_process(*args, "--out", out)
    assert rebuilt.returncode == 0 and "lacks train-00000.arrow" in rebuilt.stdout, rebuilt.stderr
    assert (out / "train-00000.arrow").is_file() and (tmp_path / "out.old-2024").is_dir()
    # --out . from an empty folder, and a link loop: a result or one line, never a traceback
    (tmp_path / "here").mkdir()
    monkeypatch.chdir(tmp_path / "here")
    assert preprocess_in_process(*args, "--out", ".").returncode == 0
    assert (tmp_path / "here" / "meta.json").is_file()
    (tmp_path / "loop").symlink_to(tmp_path / "loop")
    loop = preprocess_in_process(*args, "--out", tmp_path / "loop")
    assert loop.returncode == 2 and "leads back to itself" in loop.stderr


def test_killed_run_leaves_no_partial_output_and_the_next_run_removes_its_leftovers(tmp_path):
    corpus = tmp_path / "big"
    corpus.mkdir()
    for i in range(40):  # ~4 MB: the tokenize stage lasts long enough to be caught in the middle
        (corpus / f"{i}.txt").write_text(" ".join(f"word{j * i % 9973}" for j in range(12_000)))
    out = tmp_path / "out"
    args = [sys.executable, "preprocess.py", "--input", corpus, "--out", out, "--vocab-size", "300"]
    kill_preprocess_midway(args, out, "tokenizer.json")
    result = run_preprocess("--input", corpus, "--out", out, "--vocab-size", 300)
    assert result.returncode == 0, result.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["big", "out"]


def test_tokenizer_training_cuts_a_word_at_long_run_characters_and_leaves_other_text_alone():
    """A 2 MB word without spaces (base64, DNA) would keep BPE training busy for many minutes."""
    normal = "def f(x):\n    return x  # " + "y" * (preprocess.LONG_RUN - 1)
    assert preprocess.cut_long_runs(normal) is normal
    long = "a " + "b" * (2 * preprocess.LONG_RUN + 5) + " c"
    cut = preprocess.cut_long_runs(long)
    assert cut.replace("\n", "") == long
    run = preprocess.LONG_RUN
    assert [len(word) for word in cut.split()] == [1, run, run, 5, 1]


def test_text_inputs_follow_links_once_say_what_they_leave_out_and_decode_as_their_files_say(
        tmp_path):
    corpus = tmp_path / "corpus"
    (corpus / "own").mkdir(parents=True)
    (corpus / "own" / "a.txt").write_text("alpha from a real folder")
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere" / "b.txt").write_text("beta behind a link")
    (corpus / "linked").symlink_to(tmp_path / "elsewhere")
    (corpus / "loop").symlink_to(corpus)  # would repeat every file, for ever
    (corpus / "gone.txt").symlink_to(tmp_path / "nowhere.txt")
    (corpus / ".cache").mkdir()
    (corpus / ".cache" / "c.txt").write_text("an editor's copy")
    (corpus / "utf16.txt").write_bytes("gamma in UTF-16".encode("utf-16"))
    (corpus / "bom.txt").write_bytes("delta".encode("utf-8-sig"))
    # JSON Lines as datasets' to_json() names them; a latin-1 line is replaced, not refused
    (tmp_path / "rows.json").write_bytes(json.dumps({"text": "epsilon"}).encode() + b"\n"
                                         + b'{"text": "caf\xe9"}\n')
    pq.write_table(pa.table({"text": pa.array(["zeta", "zeta", "eta"]).dictionary_encode()}),
                   tmp_path / "category.parquet")
    out = tmp_path / "out"
    result = preprocess_in_process("--input", corpus, tmp_path / "rows.json",
                                   tmp_path / "category.parquet", corpus / "own" / "a.txt",
                                   "--out", out, "--vocab-size", 300, "--val-fraction", 0)
    assert result.returncode == 0, result.stderr
    assert "left out of" in result.stdout and "1 hidden" in result.stdout \
        and "1 broken links" in result.stdout and "given twice" in result.stdout, result.stdout
    tokenizer = Tokenizer.from_file(str(out / "tokenizer.json"))
    table = pa.ipc.open_file(pa.memory_map(str(out / "train-00000.arrow"))).read_all()
    texts = [tokenizer.decode(ids) for ids in table.column("input_ids").to_pylist()]
    assert texts == ["delta", "beta behind a link", "alpha from a real folder", "gamma in UTF-16",
                     "epsilon", "caf\ufffd", "zeta", "zeta", "eta"]
    assert "invalid UTF-8 replaced by U+FFFD in 1 documents" in result.stdout
    pipe = preprocess_in_process("--input", "/dev/null", "--out", tmp_path / "other")
    assert pipe.returncode == 2 and "is not a file or a folder" in pipe.stderr


def bad_input_args(case, tmp_path):
    """Arguments for one foreseeable mistake, its files made in tmp_path."""
    good_line = json.dumps({"text": "fine"}) + "\n"
    jsonl = tmp_path / "corpus.jsonl"
    jsonl.write_text(good_line)
    if case == "missing_input":
        return ["--input", tmp_path / "nowhere"]
    if case == "directory_without_matching_files":
        (tmp_path / "d").mkdir()
        (tmp_path / "d" / "a.csv").write_text("x")
        return ["--input", tmp_path / "d"]
    if case == "jsonl_line_not_json":
        jsonl.write_text(good_line + "{not json\n")
        return ["--input", jsonl]
    if case == "jsonl_line_without_field":
        jsonl.write_text(good_line + json.dumps({"body": "x"}) + "\n")
        return ["--input", jsonl]
    # no training pass: found after shards were started
    if case == "jsonl_line_not_json_found_while_writing":
        jsonl.write_text(good_line * (preprocess.CHUNK_DOCUMENTS + 10) + "[1, 2]\n")
        Tokenizer(models.BPE()).save(str(tmp_path / "tokenizer.json"))
        return ["--input", jsonl, "--tokenizer", tmp_path / "tokenizer.json"]
    if case == "parquet_without_column":
        pq.write_table(pa.table({"body": ["x"]}), tmp_path / "t.parquet")
        return ["--input", tmp_path / "t.parquet"]
    if case == "unreadable_tokenizer":
        (tmp_path / "garbage.json").write_text("{nope")
        return ["--input", jsonl, "--tokenizer", tmp_path / "garbage.json"]
    if case == "vocab_size_too_small":
        return ["--input", jsonl, "--vocab-size", 100]
    if case == "out_below_a_file":
        (tmp_path / "a_file").write_text("")
        return ["--input", jsonl, "--out", tmp_path / "a_file" / "data"]
    if case == "only_empty_documents":
        (tmp_path / "d").mkdir()
        (tmp_path / "d" / "empty.txt").write_text("")
        return ["--input", tmp_path / "d"]
    if case == "everything_held_out":  # the train split would be empty
        return ["--input", jsonl, "--val-fraction", 1]
    if case == "option_value_not_a_number":
        return ["--input", jsonl, "--val-fraction", "two percent"]
    if case == "empty_input_value":  # an unset shell variable: not the current folder
        return ["--input", ""]
    if case == "vocab_size_too_large":  # the BPE trainer would allocate by it, and abort
        return ["--input", jsonl, "--vocab-size", 2**32]
    if case in ("parquet_damaged", "arrow_text_not_utf8"):
        if case == "parquet_damaged":
            path = tmp_path / "t.parquet"
            pq.write_table(pa.table({"text": [f"row {i} " * 20 for i in range(2000)]}), path,
                           row_group_size=500, compression="none")
            offset = pq.ParquetFile(path).metadata.row_group(2).column(0).data_page_offset
        else:
            path = tmp_path / "t.arrow"
            offsets = pa.py_buffer(np.array([0, 4, 6], dtype=np.int32).tobytes())
            column = pa.Array.from_buffers(pa.string(), 2, [None, offsets, pa.py_buffer(
                b"fine\xff\xfe")])
            with pa.ipc.new_file(path, pa.schema([("text", pa.string())])) as writer:
                writer.write_table(pa.table({"text": column}))
            offset = None
        if offset is not None:
            with open(path, "r+b") as file:
                file.seek(offset)
                file.write(b"\xff" * 16)
        return ["--input", path]
    if case in ("config_data_not_a_mapping", "config_value_a_list"):
        config = tmp_path / "config.yaml"
        config.write_text("data: [1, 2]\n" if case == "config_data_not_a_mapping"
                          else "data:\n  val_fraction: [0.1]\n")
        return ["--input", jsonl, "--config", config]
    raise ValueError(case)


@pytest.mark.parametrize("case", ["missing_input", "directory_without_matching_files",
                                  "jsonl_line_not_json", "jsonl_line_without_field",
                                  "jsonl_line_not_json_found_while_writing",
                                  "parquet_without_column", "unreadable_tokenizer",
                                  "vocab_size_too_small", "out_below_a_file",
                                  "only_empty_documents", "everything_held_out",
                                  "option_value_not_a_number", "config_data_not_a_mapping",
                                  "config_value_a_list", "empty_input_value",
                                  "vocab_size_too_large", "parquet_damaged",
                                  "arrow_text_not_utf8"])
def test_bad_input_is_one_error_line_exit_2_and_no_output(tmp_path, case):
    out = tmp_path / "out"
    # a --vocab-size or --out in the case's own arguments wins: argparse keeps the last one
    result = run_preprocess("--vocab-size", 300, "--out", out, *bad_input_args(case, tmp_path))
    assert result.returncode == 2, (result.stdout, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and " -> " in lines[0], result.stderr
    assert "Traceback" not in result.stderr + result.stdout
    assert not any(p.name.startswith("out") for p in tmp_path.iterdir())


# ---- preprocess.py: images -----------------------------------------------------------------------

IMAGE_CLASSES = ["cat", "dog"]
SUFFIX_OF_MODE = {"RGB": ".jpg", "L": ".png", "P": ".gif", "RGBA": ".png"}


def make_image_folder(root, trees=("train", "val"), per_class=(8, 3), broken=False):
    """Two classes of small images (16 to 40 px a side) in the four modes datasets hold most (RGBA
    with random alpha; JPEGs with each EXIF orientation in turn, as phones write them), plus a .txt
    and, if broken, a corrupt .jpg in the first tree; returns the good files' paths relative to
    root, sorted."""
    rng = np.random.default_rng(0)
    relpaths = []
    for tree, count in zip(trees, per_class):
        for name in IMAGE_CLASSES:
            (root / tree / name).mkdir(parents=True)
            for i in range(count):
                width, height = (int(n) for n in rng.integers(16, 41, 2))
                rgba = Image.fromarray(rng.integers(0, 256, (height, width, 4), dtype=np.uint8))
                mode = list(SUFFIX_OF_MODE)[i % 4]
                relpath = Path(tree, name, f"{i:03d}{SUFFIX_OF_MODE[mode]}").as_posix()
                if mode == "P":
                    rgba.convert("RGB").quantize(64).save(root / relpath)
                elif mode == "RGB":
                    exif = Image.Exif()
                    exif[ExifTags.Base.Orientation] = i // 4 % 8 + 1
                    rgba.convert(mode).save(root / relpath, exif=exif)
                else:
                    (rgba if mode == "RGBA" else rgba.convert(mode)).save(root / relpath)
                relpaths.append(relpath)
    if broken:
        (root / trees[0] / "cat" / "broken.jpg").write_bytes(b"\xff\xd8\xff\xe0 cut short")
    (root / trees[0] / "cat" / "notes.txt").write_text("not an image")
    return sorted(relpaths)


def pillow_reference(path, size):
    """What the trainer must get for one file, with Pillow alone: upright by its EXIF orientation,
    16- and 32-bit grey scaled from its own range to 0..255, RGB with alpha dropped (as
    transformers' load_image), the shorter side to size (bicubic), the centre size x size."""
    with Image.open(path) as image:
        upright = ImageOps.exif_transpose(image)
    if upright.mode in ("I;16", "I", "F"):
        values = np.asarray(upright, np.float64)
        levels = np.round((values - values.min()) * 255 / (values.max() - values.min()))
        upright = Image.fromarray(levels.astype(np.uint8))
    rgb = upright.convert("RGB")
    width, height = rgb.size
    new = (size, size * height // width) if width <= height else (size * width // height, size)
    resized = rgb.resize(new, Image.Resampling.BICUBIC)
    left, top = (new[0] - size) // 2, (new[1] - size) // 2  # transformers' centre crop floors
    return np.asarray(resized.crop((left, top, left + size, top + size)))


def read_images(out, split):
    """(pixels as N x S x S x 3 uint8, labels) of one split, checking the schema the trainer
    reads."""
    meta = json.loads((out / "meta.json").read_text())
    size = meta["image_size"]
    pixels, labels = [], []
    for name in meta["splits"][split]["files"]:
        table = pa.ipc.open_file(pa.memory_map(str(out / name))).read_all()
        assert table.schema == pa.schema([("pixels", pa.binary(size * size * 3)),
                                          ("label", pa.int32())])
        pixels += table.column("pixels").to_pylist()
        labels += table.column("label").to_pylist()
    assert len(labels) == meta["splits"][split]["images"]
    return np.frombuffer(b"".join(pixels), np.uint8).reshape(len(labels), size, size, 3), labels


def assert_rows_are_the_files(out, split, folder, relpaths, size):
    """The split holds exactly these files, in this order, each as Pillow resizes and crops it."""
    pixels, labels = read_images(out, split)
    assert labels == [IMAGE_CLASSES.index(Path(relpath).parent.name) for relpath in relpaths]
    for row, relpath in zip(pixels, relpaths):
        assert np.array_equal(row, pillow_reference(folder / relpath, size)), relpath


def assert_mean_std_are_the_train_pixels(out):
    meta = json.loads((out / "meta.json").read_text())
    train = read_images(out, "train")[0].reshape(-1, 3) / 255
    assert meta["mean"] == pytest.approx(train.mean(0).tolist(), rel=1e-9)
    assert meta["std"] == pytest.approx(train.std(0).tolist(), rel=1e-9)


def preprocess_in_process(*args):
    """preprocess.main() in this process, as `python preprocess.py ARGS` runs it, without the
    imports of a new interpreter. The exit code and stderr of a real process are tested by the
    subprocess tests."""
    stdout, stderr = io.StringIO(), io.StringIO()
    with monkeypatched_argv(["preprocess.py", *map(str, args)]), \
            contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        try:
            preprocess.main()
            code = 0
        except SystemExit as exit_:
            code = exit_.code
    return subprocess.CompletedProcess(args, code, stdout.getvalue(), stderr.getvalue())


def test_images_from_a_folder_with_train_and_val_trees_match_pillows_resize_and_crop_in_every_mode(
        tmp_path):
    folder, out = tmp_path / "folder", tmp_path / "out"
    # 1 of 101 does not decode
    relpaths = make_image_folder(folder, per_class=(40, 10), broken=True)
    result = run_preprocess("--images", folder, "--out", out, "--image-size", 16, "--workers", 2)
    assert result.returncode == 0, result.stderr
    notes = [line for line in result.stdout.splitlines()
             if line.startswith("note: skipped 1 of 101 files")]
    assert len(notes) == 1 and "train/cat/broken.jpg" in notes[0], result.stdout
    meta = json.loads((out / "meta.json").read_text())
    assert sorted(meta) == sorted(["format_version", "kind", "image_size", "channels", "classes",
                                   "mean", "std", "splits", "skipped", "source", "fingerprint"])
    assert (meta["format_version"], meta["kind"], meta["image_size"], meta["channels"],
            meta["classes"]) == (1, "images", 16, 3, IMAGE_CLASSES)
    assert meta["skipped"] == {"count": 1, "examples": ["train/cat/broken.jpg"]}
    for split in ("train", "val"):
        expected = [relpath for relpath in relpaths if relpath.startswith(split + "/")]
        assert len(expected) == (80 if split == "train" else 20)
        assert_rows_are_the_files(out, split, folder, expected, 16)
    assert_mean_std_are_the_train_pixels(out)
    # an RGBA file (random alpha) kept its colour values, not brightened by white under its alpha
    with Image.open(folder / "train/cat/003.png") as rgba:
        assert rgba.mode == "RGBA"
        colours = np.asarray(rgba)[..., :3]
    assert abs(read_images(out, "train")[0][3].mean() - colours.mean()) < 10


def test_images_of_16_and_32_bit_modes_are_scaled_by_their_own_range_and_a_note_says_so(tmp_path):
    """Pillow's convert("RGB") clips 16- and 32-bit grey to near white or black: preprocess.py
    scales each image from its own minimum..maximum to 0..255 and says in one note how to pass such
    images to the exported pipeline."""
    folder, out = tmp_path / "folder", tmp_path / "out"
    rng = np.random.default_rng(0)
    for name in IMAGE_CLASSES:
        (folder / name).mkdir(parents=True)
        Image.new("RGB", (20, 16), "grey").save(folder / name / "plain.jpg")
    Image.fromarray(rng.integers(0, 4096, (16, 20), np.uint16)).save(folder / "cat/scan.png")
    Image.fromarray(rng.integers(10**5, 10**6, (18, 16), np.int32)).save(folder / "dog/counts.tif")
    Image.fromarray(rng.normal(-3, 1, (16, 16)).astype(np.float32)).save(folder / "dog/field.tif")
    result = run_preprocess("--images", folder, "--out", out, "--image-size", 16,
                            "--val-fraction", 0, "--workers", 2)
    assert result.returncode == 0, result.stderr
    notes = [line for line in result.stdout.splitlines() if "scaled" in line]
    assert len(notes) == 1 and notes[0].startswith(
        "note: scaled 3 images of 16- or 32-bit modes (1 F, 1 I, 1 I;16) to 8 bits, each from its "
        "own minimum..maximum to 0..255;") and "preprocess.to_rgb(Image.open(path))" in notes[0]
    relpaths = ["cat/plain.jpg", "cat/scan.png", "dog/counts.tif", "dog/field.tif",
                "dog/plain.jpg"]
    assert_rows_are_the_files(out, "train", folder, relpaths, 16)
    pixels, _ = read_images(out, "train")
    assert all(64 < pixels[row].mean() < 192 for row in (1, 2, 3))  # neither white nor black


def test_float_images_with_nan_or_inf_pixels_are_scaled_by_their_finite_pixels_and_a_note_says_so(
        tmp_path):
    """NaN or inf in a float image (mode F, as TIFFs hold) would make its min..max scaling NaN: the
    finite pixels give the range, the others become 0, and one note counts and names the files. An
    image with no finite pixel does not decode."""
    folder, out = tmp_path / "folder", tmp_path / "out"
    for name in IMAGE_CLASSES:
        (folder / name).mkdir(parents=True)
        Image.new("RGB", (20, 16), "grey").save(folder / name / "plain.jpg")
    ramp = np.linspace(-3, 5, 16 * 18, dtype=np.float32).reshape(18, 16)
    holes, dark = ramp.copy(), ramp.copy()
    holes[2, 3], holes[7, 7], holes[9, 1] = np.nan, np.inf, -np.inf
    dark[0, 0] = np.nan  # the minimum itself
    Image.fromarray(holes).save(folder / "dog/holes.tif")
    Image.fromarray(dark).save(folder / "cat/dark.tif")
    result = run_preprocess("--images", folder, "--out", out, "--image-size", 16,
                            "--val-fraction", 0, "--workers", 1)
    assert result.returncode == 0, result.stderr
    notes = [line for line in result.stdout.splitlines() if "NaN" in line]
    assert notes == ["note: 2 images had NaN or infinite pixels (cat/dark.tif, dog/holes.tif): "
                     "each scaled by the range of its finite pixels, and those pixels set to 0"], \
        result.stdout
    pixels, _ = read_images(out, "train")  # cat/dark.tif, cat/plain.jpg, dog/holes.tif, ...
    for row, image in ((0, dark), (2, holes)):
        finite = np.isfinite(image)
        (tmp_path / "filled.tif").unlink(missing_ok=True)
        Image.fromarray(np.where(finite, image, image[finite].min())).save(tmp_path / "filled.tif")
        assert np.array_equal(pixels[row], pillow_reference(tmp_path / "filled.tif", 16)), row
    with pytest.raises(ValueError, match="every pixel is NaN or infinite"):
        preprocess.to_rgb(Image.fromarray(np.full((8, 8), np.nan, np.float32)))


def test_images_in_one_folder_are_split_by_a_hash_of_each_path_that_adding_images_does_not_change(
        tmp_path):
    folder = tmp_path / "folder"
    relpaths = make_image_folder(folder, trees=("",), per_class=(20,))
    for out, run_relpaths in (("before", relpaths), ("after", None)):
        # more images in each class: none of the first moves to the other split
        if run_relpaths is None:
            for name in IMAGE_CLASSES:
                for i in range(20, 30):
                    colour = (i * 8, 0, 255 - i * 8)
                    Image.new("RGB", (20, 24), colour).save(folder / name / f"{i:03d}.jpg")
            run_relpaths = sorted(relpaths + [f"{name}/{i:03d}.jpg" for name in IMAGE_CLASSES
                                              for i in range(20, 30)])
        result = preprocess_in_process("--images", folder, "--out", tmp_path / out,
                                       "--image-size", 16, "--val-fraction", 0.3, "--workers", 1)
        assert result.returncode == 0, result.stderr
        val = [relpath for relpath in run_relpaths if in_val(relpath, 0.3)]
        train = [relpath for relpath in run_relpaths if relpath not in val]
        assert len(val) >= 5 and len(train) >= 5
        assert_rows_are_the_files(tmp_path / out, "train", folder, train, 16)
        assert_rows_are_the_files(tmp_path / out, "val", folder, val, 16)
    assert_mean_std_are_the_train_pixels(tmp_path / "after")


@pytest.mark.parametrize("layout", ["parquet_label_names", "parquet_class_ids_named_by_hf_features",
                                    "arrow_stream_as_hf_datasets_writes"])
def test_images_from_hf_files_keep_their_pixels_labels_and_class_names(tmp_path, layout):
    """The image column as datasets' Image feature stores it ({bytes, path} structs), found by its
    type; the split from the file names; class ids named by the features in the schema's
    metadata."""
    folder = tmp_path / "folder"
    # 1 row of 101 does not decode
    relpaths = make_image_folder(folder, per_class=(40, 10), broken=True)
    (tmp_path / "hub" / "data").mkdir(parents=True)
    for split, file_split in (("train", "train"), ("val", "validation")):
        rows = [relpath for relpath in relpaths if relpath.startswith(split + "/")]
        if split == "train":
            rows.insert(0, "train/cat/broken.jpg")
        names = [Path(relpath).parent.name for relpath in rows]
        images = [{"bytes": (folder / relpath).read_bytes(), "path": Path(relpath).name}
                  for relpath in rows]
        if layout == "parquet_label_names":
            table = pa.table({"picture": images, "label": names})
        else:  # dog = 0, cat = 1: the names, not sorting, give the order
            table = pa.table({"picture": images, "label": [1 - IMAGE_CLASSES.index(name)
                                                           for name in names]})
            features = {"picture": {"_type": "Image"}, "label": {"names": ["dog", "cat"],
                                                                 "_type": "ClassLabel"}}
            table = table.replace_schema_metadata(
                {"huggingface": json.dumps({"info": {"features": features}})})
        if layout.startswith("arrow"):
            path = tmp_path / "hub" / "data" / f"{file_split}-00000-of-00001.arrow"
            with pa.ipc.new_stream(str(path), table.schema) as writer:
                writer.write_table(table, max_chunksize=5)
        else:
            pq.write_table(table,
                           tmp_path / "hub" / "data" / f"{file_split}-00000-of-00001.parquet",
                           row_group_size=5)
    out = tmp_path / "out"
    result = preprocess_in_process("--images", tmp_path / "hub", "--out", out, "--image-size", 16,
                                   "--workers", 1)
    assert result.returncode == 0, result.stderr
    meta = json.loads((out / "meta.json").read_text())
    classes = IMAGE_CLASSES if layout == "parquet_label_names" else ["dog", "cat"]
    assert meta["classes"] == classes
    suffix = ".arrow" if layout.startswith("arrow") else ".parquet"
    assert meta["skipped"] == {"count": 1, "examples": [f"data/train-00000-of-00001{suffix}:0"]}
    for split in ("train", "val"):
        expected = [relpath for relpath in relpaths if relpath.startswith(split + "/")]
        pixels, labels = read_images(out, split)
        assert [classes[label] for label in labels] == [Path(relpath).parent.name
                                                        for relpath in expected]
        for row, relpath in zip(pixels, expected):
            assert np.array_equal(row, pillow_reference(folder / relpath, 16)), relpath
    assert_mean_std_are_the_train_pixels(out)


def test_images_without_a_source_are_sklearns_digits_in_data_digits_at_32_pixels(tmp_path):
    from sklearn.datasets import load_digits
    result = run([sys.executable, REPO / "preprocess.py", "--images"], cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    out = tmp_path / "data" / "digits"
    meta = json.loads((out / "meta.json").read_text())
    assert meta["classes"] == [str(digit) for digit in range(10)] and meta["image_size"] == 32
    digits = load_digits()
    held_out = [in_val(f"digits:{index}", 0.2) for index in range(len(digits.target))]
    assert meta["splits"]["val"]["images"] == sum(held_out) and 300 < sum(held_out) < 420
    assert meta["splits"]["train"]["images"] + meta["splits"]["val"]["images"] \
        == len(digits.target) == 1797
    pixels, labels = read_images(out, "train")
    train = [index for index, out_of_train in enumerate(held_out) if not out_of_train]
    assert labels == [int(digits.target[index]) for index in train]
    for row, index in zip(pixels, train):
        grey = Image.fromarray(np.round(digits.images[index] * 255 / 16).astype(np.uint8))
        resized = grey.convert("RGB").resize((32, 32), Image.Resampling.BICUBIC)
        assert np.array_equal(row, np.asarray(resized))
    assert_mean_std_are_the_train_pixels(out)
    assert meta["skipped"] == {"count": 0, "examples": []}


def test_more_workers_than_the_open_file_limit_allows_is_one_line_that_says_so(tmp_path):
    import resource
    folder, out = tmp_path / "folder", tmp_path / "out"
    make_image_folder(folder, trees=("",), per_class=(4,))
    result = subprocess.run(
        [sys.executable, "preprocess.py", "--images", folder, "--out", out, "--image-size", "16",
         "--workers", "200"], cwd=REPO, capture_output=True, text=True, timeout=120,
        preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64)))
    assert result.returncode == 2 and result.stderr.strip().splitlines() == [
        "error: Too many open files -> pass fewer --workers, or raise the open-file limit "
        "(ulimit -n)"], result.stderr
    assert not out.exists() and not list(tmp_path.glob("out.*"))


def bad_images_args(case, tmp_path):
    """Arguments for one foreseeable mistake with --images, its files made in tmp_path."""
    folder = tmp_path / "folder"
    if case == "a_missing_folder":
        return ["--images", folder]
    if case == "an_empty_folder":
        folder.mkdir()
        return ["--images", folder]
    if case == "loose_images_without_class_folders":
        folder.mkdir()
        Image.new("RGB", (20, 20)).save(folder / "a.png")
        return ["--images", folder]
    if case == "one_class_only":
        (folder / "cat").mkdir(parents=True)
        Image.new("RGB", (20, 20)).save(folder / "cat" / "a.png")
        return ["--images", folder]
    if case == "an_empty_class_folder":
        make_image_folder(folder, trees=("",), per_class=(2,))
        (folder / "bird").mkdir()
        return ["--images", folder]
    if case == "a_val_class_that_train_lacks":
        make_image_folder(folder, per_class=(2, 1))
        (folder / "val" / "bird").mkdir()
        Image.new("RGB", (20, 20)).save(folder / "val" / "bird" / "a.png")
        return ["--images", folder]
    if case == "more_than_1_percent_do_not_decode":
        make_image_folder(folder, trees=("",), per_class=(10,), broken=True)
        return ["--images", folder, "--image-size", 16]
    if case == "images_smaller_than_the_image_size":
        for name, small in (("cat", (14, 30)), ("dog", (30, 12))):
            (folder / name).mkdir(parents=True)
            for i in range(3):
                Image.new("RGB", (20, 24)).save(folder / name / f"{i}.png")
            Image.new("RGB", small).save(folder / name / "small.png")
        return ["--images", folder, "--image-size", 16]
    if case == "no_image_decodes":
        for name in IMAGE_CLASSES:
            (folder / name).mkdir(parents=True)
            (folder / name / "a.jpg").write_bytes(b"\xff\xd8\xff\xe0 cut short")
        return ["--images", folder]
    if case == "images_smaller_than_4_pixels":
        make_image_folder(folder, trees=("",), per_class=(3,))
        Image.new("RGB", (2, 30)).save(folder / "cat" / "thin.png")
        return ["--images", folder, "--image-size", 16]
    if case == "a_class_folder_that_is_a_link_to_another":
        make_image_folder(folder, trees=("",), per_class=(2,))
        (folder / "kitty").symlink_to("cat")
        return ["--images", folder]
    if case == "split_folders_without_a_train_folder":
        make_image_folder(folder, trees=("valid", "test"), per_class=(2, 2))
        return ["--images", folder]
    if case == "folders_named_as_splits_that_hold_images":
        for name in ("Training", "Testing"):
            (folder / name).mkdir(parents=True)
            Image.new("RGB", (20, 20)).save(folder / name / "a.png")
        return ["--images", folder]
    if case == "an_out_inside_the_images":
        make_image_folder(folder, trees=("",), per_class=(2,))
        return ["--images", folder, "--out", folder / "out"]
    if case == "an_empty_images_path":  # an unset shell variable
        return ["--images", ""]
    png = io.BytesIO()
    Image.new("RGB", (20, 20)).save(png, format="PNG")
    image_rows = [{"bytes": png.getvalue(), "path": "a.png"}] * 4
    png = io.BytesIO()
    Image.new("RGB", (20, 20)).save(png, format="PNG")
    image_rows = [{"bytes": png.getvalue(), "path": "a.png"}] * 4
    if case == "parquet_without_label_column":
        pq.write_table(pa.table({"image": image_rows, "caption": ["a"] * 4}),
                       tmp_path / "t.parquet")
        return ["--images", tmp_path / "t.parquet"]
    if case == "parquet_labels_of_floats":
        pq.write_table(pa.table({"image": image_rows, "label": [0.0, 1.0] * 2}),
                       tmp_path / "t.parquet")
        return ["--images", tmp_path / "t.parquet"]
    if case == "parquet_rows_that_do_not_decode":  # 1 of 4: over 1%
        rows = image_rows[:3] + [{"bytes": b"not a png", "path": "b.png"}]
        pq.write_table(pa.table({"image": rows, "label": [0, 1] * 2}), tmp_path / "t.parquet")
        return ["--images", tmp_path / "t.parquet", "--image-size", 16]
    if case == "parquet_class_without_images":
        table = pa.table({"image": image_rows, "label": [0, 1] * 2})
        features = {"label": {"names": ["cat", "dog", "bird"], "_type": "ClassLabel"}}
        metadata = {"huggingface": json.dumps({"info": {"features": features}})}
        pq.write_table(table.replace_schema_metadata(metadata), tmp_path / "t.parquet")
        return ["--images", tmp_path / "t.parquet"]
    if case == "parquet_labels_of_minus_1":  # HF's test splits often are unlabelled
        pq.write_table(pa.table({"image": image_rows, "label": [-1] * 4}), tmp_path / "t.parquet")
        return ["--images", tmp_path / "t.parquet"]
    if case == "parquet_files_that_name_the_classes_differently":
        (tmp_path / "hub").mkdir()
        for split, names in (("train", ["cat", "dog"]), ("validation", ["dog", "cat"])):
            features = {"label": {"names": names, "_type": "ClassLabel"}}
            table = pa.table({"image": image_rows, "label": [0, 1] * 2})
            pq.write_table(table.replace_schema_metadata(
                {"huggingface": json.dumps({"info": {"features": features}})}),
                tmp_path / "hub" / f"{split}-00000-of-00001.parquet")
        return ["--images", tmp_path / "hub"]
    if case == "image_size_0":
        return ["--images", "--image-size", 0]
    if case == "image_size_3":
        return ["--images", "--image-size", 3]
    if case == "image_size_not_a_number":
        return ["--images", "--image-size", "big"]
    if case == "workers_0":
        return ["--images", "--workers", 0]
    if case == "everything_held_out":
        return ["--images", "--val-fraction", 1]
    if case == "a_text_option_with_images":
        return ["--images", "--vocab-size", 300]
    if case == "an_image_option_without_images":
        return ["--image-size", 64]
    raise ValueError(case)


@pytest.mark.parametrize("case, fragment", [
    ("a_missing_folder", "does not exist"), ("an_empty_folder", "no images"),
    ("loose_images_without_class_folders", "has no class sub-folders"),
    ("one_class_only", "one class only"), ("an_empty_class_folder", "bird holds no images"),
    ("a_val_class_that_train_lacks", "bird is no class"),
    ("more_than_1_percent_do_not_decode", ("1 of 21 files (4.76%) do not decode",
                                           "cat/broken.jpg (", "-> repair or remove them")),
    ("parquet_rows_that_do_not_decode", ("1 of 4 files (25%) do not decode", "t.parquet:3 (")),
    ("images_smaller_than_the_image_size", ("2 of 8 images are smaller than --image-size 16 on "
                                            "their shorter side",
                                            "cat/small.png (14 px), dog/small.png (12 px)",
                                            "-> pass --image-size 12, or remove them")),
    ("no_image_decodes", "no image of it decodes"),
    ("images_smaller_than_4_pixels", ("1 of 7 images are smaller than --image-size 16",
                                      "cat/thin.png (2 px) -> remove them (a ViT needs 4")),
    ("a_class_folder_that_is_a_link_to_another", "kitty is a link to a folder read already"),
    ("split_folders_without_a_train_folder", "has no train folder beside it"),
    ("folders_named_as_splits_that_hold_images", "(Testing, Training) are named as splits"),
    ("an_out_inside_the_images", "lies inside --images"),
    ("an_empty_images_path", '--images "" is an empty path'),
    ("parquet_files_that_name_the_classes_differently", "name the classes differently"),
    ("parquet_without_label_column", "has no label column"),
    ("parquet_labels_of_floats", "not integers or strings"),
    ("parquet_labels_of_minus_1", "negative label"),
    ("parquet_class_without_images", "class 'bird' has no images"),
    ("image_size_0", "--image-size 0 is not between"),
    ("image_size_3", "--image-size 3 is not between 4 and"),
    ("image_size_not_a_number", "invalid int value: 'big'"),
    ("workers_0", "--workers 0 is not positive"),
    ("everything_held_out", "--val-fraction 1.0 holds out"),
    ("a_text_option_with_images", "--vocab-size does not go with --images"),
    ("an_image_option_without_images", "--image-size does not go without --images")])
def test_bad_images_input_is_one_error_line_exit_2_and_no_output(tmp_path, monkeypatch, case,
                                                                 fragment):
    monkeypatch.chdir(tmp_path)  # where a default --out would go
    # the case's own arguments come last and win: argparse keeps the last one
    result = preprocess_in_process("--out", tmp_path / "out", "--workers", 1,
                                   *bad_images_args(case, tmp_path))
    assert result.returncode == 2, (result.stdout, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and " -> " in lines[0], result.stderr
    for part in fragment if isinstance(fragment, tuple) else (fragment,):
        assert part in lines[0], lines[0]
    assert not any(p.name.startswith(("out", "data")) for p in tmp_path.iterdir())


def test_images_that_do_not_decode_are_skipped_up_to_1_percent_and_an_error_above(tmp_path):
    folder = tmp_path / "folder"
    make_image_folder(folder, trees=("",), per_class=(50,), broken=True)
    (folder / "dog" / "000.jpg").unlink()  # 99 good files, 1 broken: 1%
    args = ["--images", folder, "--out", tmp_path / "out", "--image-size", 16, "--workers", 1]
    result = preprocess_in_process(*args)
    assert result.returncode == 0, result.stderr
    assert "note: skipped 1 of 100 files that do not decode: cat/broken.jpg (" in result.stdout
    meta = json.loads((tmp_path / "out" / "meta.json").read_text())
    assert meta["skipped"] == {"count": 1, "examples": ["cat/broken.jpg"]}
    assert meta["splits"]["train"]["images"] + meta["splits"]["val"]["images"] == 99
    (folder / "dog" / "broken.png").write_bytes(b"\x89PNG cut short")  # 2 of 101
    failed = preprocess_in_process(*args, "--out", tmp_path / "out2")
    assert failed.returncode == 2 \
        and failed.stderr.startswith("error: 2 of 101 files (1.98%) do not decode")
    assert not (tmp_path / "out2").exists()


def test_bad_images_input_in_a_real_process_is_one_line_without_a_traceback_and_no_output(tmp_path):
    """Found after the pool of decoding processes started and the temporary directory was made."""
    args = bad_images_args("no_image_decodes", tmp_path)
    result = run_preprocess(*args, "--out", tmp_path / "out", "--workers", 2)
    assert result.returncode == 2, (result.stdout, result.stderr)
    assert result.stderr.count("\n") == 1 \
        and result.stderr.startswith("error: no images for the train split")
    assert "Traceback" not in result.stdout + result.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["folder"]
    without_out = run_preprocess("--images", tmp_path / "folder")
    assert without_out.returncode == 2 and without_out.stderr.startswith("error: --images ")
    assert "needs --out" in without_out.stderr and without_out.stderr.count("\n") == 1


def test_images_rerun_is_noop_and_a_changed_image_needs_force(tmp_path):
    make_image_folder(tmp_path / "folder", trees=("",), per_class=(6,))
    out = tmp_path / "out"
    args = ["--images", tmp_path / "folder", "--out", out, "--image-size", 16, "--workers", 1]
    assert preprocess_in_process(*args).returncode == 0
    before = file_state(out)
    again = preprocess_in_process(*args[:-1], 2)  # the worker count changes nothing
    assert again.returncode == 0 and "up to date" in again.stdout and file_state(out) == before
    for changed_args in ([*args, "--image-size", 8], [*args, "--val-fraction", 0.5]):
        other = preprocess_in_process(*changed_args)
        assert other.returncode == 2 and "--force" in other.stderr and file_state(out) == before
    Image.new("RGB", (20, 20), "red").save(tmp_path / "folder" / "cat" / "000.jpg")
    changed = preprocess_in_process(*args)
    assert changed.returncode == 2 and changed.stderr.startswith("error:") \
        and "--force" in changed.stderr
    assert file_state(out) == before
    forced = preprocess_in_process(*args, "--force")
    assert forced.returncode == 0, forced.stderr
    red = np.zeros((16, 16, 3), np.uint8) + np.array([255, 0, 0], np.uint8)
    split = "val" if in_val("cat/000.jpg", 0.1) else "train"
    # JPEG's error
    assert any(np.abs(row.astype(int) - red).max() <= 2 for row in read_images(out, split)[0])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["folder", "out"]


def test_images_prepared_by_other_pixel_rules_need_force(tmp_path, monkeypatch):
    make_image_folder(tmp_path / "folder", trees=("",), per_class=(6,))
    args = ["--images", tmp_path / "folder", "--out", tmp_path / "out", "--image-size", 16,
            "--workers", 1]
    assert preprocess_in_process(*args).returncode == 0
    monkeypatch.setattr(preprocess, "PIXEL_CONVERSION", 1, raising=False)  # as older rules wrote
    again = preprocess_in_process(*args)
    assert again.returncode == 2 and "built from other inputs or options" in again.stderr


def test_killed_images_run_leaves_no_partial_output_and_the_next_run_removes_its_leftovers(
        tmp_path):
    out = tmp_path / "out"
    args = [sys.executable, "preprocess.py", "--images", "--out", out, "--image-size", "128"]
    kill_preprocess_midway(args, out, "train-00000.arrow")
    result = preprocess_in_process("--images", "--out", out, "--image-size", 8)
    assert result.returncode == 0, result.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def build_folder(folder, out, *args):
    return preprocess_in_process("--images", folder, "--out", out, "--image-size", 16,
                                 "--workers", 1, *args)


def hash_split(relpaths, val_fraction):
    """{split: relpaths} as preprocess.py splits a folder without split folders: by a hash of each
    path, but a class the hash would hold out whole trains on its first image."""
    val = [relpath for relpath in relpaths if in_val(relpath, val_fraction)]
    for name in {Path(relpath).parent for relpath in relpaths}:
        in_class = sorted(relpath for relpath in relpaths if Path(relpath).parent == name)
        if all(relpath in val for relpath in in_class):
            val.remove(in_class[0])
    return {"train": [relpath for relpath in relpaths if relpath not in val], "val": val}


def note_lines(result, start="note: skipped"):
    return [line for line in result.stdout.splitlines() if line.startswith(start)]


def test_images_behind_links_are_read_once_each_under_the_class_of_its_real_folder(tmp_path):
    """Links are followed, but neither a loop (cat/up -> .., cat/self -> .) nor a second name for a
    class (dog/more -> ../cat) or for a file (cat/alias.png -> ../dog/001.png) adds an image."""
    folder, out = tmp_path / "folder", tmp_path / "out"
    relpaths = make_image_folder(folder, trees=("",), per_class=(6,))
    (folder / "cat" / "up").symlink_to("..")
    (folder / "cat" / "self").symlink_to(".")
    (folder / "dog" / "more").symlink_to("../cat")
    (folder / "cat" / "alias.png").symlink_to("../dog/001.png")
    result = build_folder(folder, out, "--val-fraction", 0.3)
    assert result.returncode == 0, result.stderr
    for split, expected in hash_split(relpaths, 0.3).items():
        assert_rows_are_the_files(out, split, folder, expected, 16)
    notes = note_lines(result)
    assert len(notes) == 1 and "second paths (links) to what was read already: 4 (" in notes[0]


def test_images_linked_from_the_val_folder_into_train_stay_in_train_alone(tmp_path):
    folder, out = tmp_path / "folder", tmp_path / "out"
    relpaths = make_image_folder(folder, per_class=(6, 3))
    shutil.rmtree(folder / "val" / "cat")
    (folder / "val" / "cat").symlink_to("../train/cat")
    (folder / "val" / "dog" / "leak.png").symlink_to("../../train/dog/001.png")
    result = build_folder(folder, out)
    assert result.returncode == 0, result.stderr
    for split in ("train", "val"):
        expected = [relpath for relpath in relpaths if relpath.startswith(f"{split}/")
                    and not relpath.startswith("val/cat/")]
        assert_rows_are_the_files(out, split, folder, expected, 16)


@pytest.mark.parametrize("trees, val_tree, note", [
    (("train", "valid", "test"), "valid", "train/ -> train, valid/ -> val; test/ left out"),
    (("Train", "Test"), "Test", "Train/ -> train, Test/ -> val"),
    (("training_set", "validation", "extra"), "validation",
     "training_set/ -> train, validation/ -> val; extra/ left out"),
    (("train", "extra"), None,
     "train/ -> train and val (by a hash of each path); extra/ left out")])
def test_images_from_split_folders_take_a_validation_folder_before_test_and_say_which_is_which(
        tmp_path, trees, val_tree, note):
    folder, out = tmp_path / "folder", tmp_path / "out"
    relpaths = make_image_folder(folder, trees=trees, per_class=(6, 3, 2))
    result = build_folder(folder, out, "--val-fraction", 0.3)
    assert result.returncode == 0, result.stderr
    assert note_lines(result, "note: splits") == [f"note: splits from folders: {note}"]
    train = [relpath for relpath in relpaths if relpath.startswith(trees[0] + "/")]
    splits = ({"train": train, "val": [relpath for relpath in relpaths
                                       if relpath.startswith(val_tree + "/")]}
              if val_tree else hash_split(train, 0.3))
    for split, expected in splits.items():
        assert_rows_are_the_files(out, split, folder, expected, 16)


def test_images_a_class_folder_named_train_that_holds_images_is_a_class(tmp_path):
    folder, out = tmp_path / "folder", tmp_path / "out"
    make_image_folder(folder, trees=("",), per_class=(3,))
    (folder / "train").mkdir()  # CIFAR-100 has a class train
    for i in range(3):
        Image.new("RGB", (20, 20), (i * 80, 0, 0)).save(folder / "train" / f"{i}.png")
    result = build_folder(folder, out)
    assert result.returncode == 0, result.stderr
    meta = json.loads((out / "meta.json").read_text())
    assert meta["classes"] == ["cat", "dog", "train"]
    assert meta["splits"]["train"]["images"] + meta["splits"]["val"]["images"] == 9


def test_images_pillow_reads_are_kept_whatever_their_names_and_one_note_counts_the_rest(tmp_path):
    """Pillow's other names (.jfif, .ppm, .avif), none, or an unknown one are read; a file that
    is no image, hidden, or beside the class folders is left out and counted by kind in one note,
    and none counts towards the 1% of images that may fail to decode."""
    from PIL import features
    folder, out = tmp_path / "folder", tmp_path / "out"
    relpaths = make_image_folder(folder, trees=("",), per_class=(4,))  # and cat/notes.txt
    formats = {"cat/a.jfif": "JPEG", "cat/b.ppm": "PPM", "dog/c": "PNG", "dog/d.jpg_large": "JPEG",
               **({"dog/e.avif": "AVIF"} if features.check("avif") else {})}
    for index, (relpath, image_format) in enumerate(formats.items()):
        Image.new("RGB", (20, 24), (40 * index, 90, 200)).save(folder / relpath, image_format)
    (folder / "dog" / "README").write_text("not an image")  # opened, and left out
    (folder / "dog" / "labels.json").write_text("{}")
    (folder / "cat" / ".DS_Store").write_bytes(b"\0\0\0\1Bud1")
    (folder / "cat" / ".thumbs").mkdir()
    Image.new("RGB", (20, 20)).save(folder / "cat" / ".thumbs" / "000.png")
    (folder / "LICENSE.md").write_text("CC-BY")
    result = build_folder(folder, out, "--val-fraction", 0.3)
    assert result.returncode == 0, result.stderr
    for split, expected in hash_split(sorted(relpaths + list(formats)), 0.3).items():
        assert_rows_are_the_files(out, split, folder, expected, 16)
    assert note_lines(result) == [
        "note: skipped not images: 3 (1 .json, 1 .txt, 1 no extension); hidden files or folders: 2 "
        "(cat/.DS_Store, cat/.thumbs/); outside the class folders: 1 (LICENSE.md)"]


def test_images_named_in_no_utf8_are_read_and_such_a_class_is_an_error_whose_mv_works(tmp_path):
    folder, out = tmp_path / "folder", tmp_path / "out"
    make_image_folder(folder, trees=("",), per_class=(4,))
    raw = os.fsencode(folder)
    Image.new("RGB", (20, 20), "red").save(os.fsdecode(raw + b"/cat/caf\xe9.png"))
    (Path(os.fsdecode(raw + b"/r\xe9adme.md"))).write_text("as a zip made on Windows names it")
    result = run_preprocess("--images", folder, "--out", out, "--image-size", 16, "--workers", 1)
    assert result.returncode == 0 and "Traceback" not in result.stderr, result.stderr
    assert "outside the class folders: 1 (r\\xe9adme.md)" in result.stdout
    meta = json.loads((out / "meta.json").read_text())
    assert meta["splits"]["train"]["images"] + meta["splits"]["val"]["images"] == 9

    os.mkdir(raw + b"/caf\xe9")
    for i in range(2):
        Image.new("RGB", (20, 20), "blue").save(os.fsdecode(raw + b"/caf\xe9/%d.png" % i))
    failed = run_preprocess("--images", folder, "--out", tmp_path / "out2", "--workers", 1)
    assert failed.returncode == 2 and failed.stderr.count("\n") == 1, failed.stderr
    assert "Traceback" not in failed.stderr and f"{folder}/caf\\xe9 has a name that is not UTF-8" \
        in failed.stderr and not (tmp_path / "out2").exists()
    command = failed.stderr.strip().split("e.g. ")[-1]
    assert command == f"mv $'{folder}/caf\\xe9' '{folder}/café'"
    subprocess.run(["bash", "-c", command], check=True)
    again = run_preprocess("--images", folder, "--out", tmp_path / "out2", "--image-size", 16,
                           "--workers", 1)
    assert again.returncode == 0, again.stderr
    assert json.loads((tmp_path / "out2" / "meta.json").read_text())["classes"] == \
        ["café", "cat", "dog"]


def test_images_class_folders_that_differ_only_in_case_are_two_classes_and_a_note(tmp_path):
    folder, out = tmp_path / "folder", tmp_path / "out"
    make_image_folder(folder, trees=("",), per_class=(3,))
    shutil.copytree(folder / "cat", folder / "Cat")
    result = build_folder(folder, out)
    assert result.returncode == 0, result.stderr
    assert json.loads((out / "meta.json").read_text())["classes"] == ["Cat", "cat", "dog"]
    assert note_lines(result, "note: class folders") == [
        "note: class folders Cat, cat differ only in case (or in how an accent is encoded): they "
        "are distinct classes"]


def test_images_one_folder_above_the_class_folders_is_an_error_whose_images_path_works(tmp_path):
    folder, out = tmp_path / "download", tmp_path / "out"
    make_image_folder(folder / "PetImages", trees=("",), per_class=(3,))  # as Kaggle's zip holds it
    failed = build_folder(folder, out)
    assert failed.returncode == 2 and "holds one class folder, PetImages," in failed.stderr
    images = re.search(r"-> pass --images (\S+)$", failed.stderr.strip()).group(1)
    result = build_folder(images, out)
    assert result.returncode == 0, result.stderr
    assert json.loads((out / "meta.json").read_text())["classes"] == IMAGE_CLASSES


def hf_table(labels, names=None):
    png = io.BytesIO()
    Image.new("RGB", (20, 20)).save(png, format="PNG")
    table = pa.table({"image": [{"bytes": png.getvalue(), "path": "a.png"}] * len(labels),
                      "label": labels})
    if names is None:
        return table
    features = {"label": {"names": names, "_type": "ClassLabel"}}
    return table.replace_schema_metadata(
        {"huggingface": json.dumps({"info": {"features": features}})})


def test_images_from_parquet_ids_without_names_are_the_ids_that_occur(tmp_path):
    pq.write_table(hf_table([1, 2, 3, 2] * 3), tmp_path / "t.parquet")
    result = build_folder(tmp_path / "t.parquet", tmp_path / "out", "--val-fraction", 0.3)
    assert result.returncode == 0, result.stderr
    assert json.loads((tmp_path / "out" / "meta.json").read_text())["classes"] == ["1", "2", "3"]
    keys = [f"t.parquet:{row}" for row in range(12)]
    train = [label for key, label in zip(keys, [0, 1, 2, 1] * 3) if not in_val(key, 0.3)]
    assert read_images(tmp_path / "out", "train")[1] == train
    assert "the 3 that do are the classes, named by their ids" in result.stdout


def test_an_image_past_pillows_bomb_limit_says_so_and_a_large_one_decodes_without_a_warning(
        monkeypatch):
    png = io.BytesIO()
    Image.new("RGB", (100, 100)).save(png, format="PNG")  # 10,000 pixels
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 4_000)  # Pillow refuses above twice this
    assert "Pillow's limit" in preprocess.decode_image((png.getvalue(), 16))
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 6_000)  # between once and twice: a warning
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert isinstance(preprocess.decode_image((png.getvalue(), 16)), tuple)


def test_images_from_hf_files_read_a_row_that_names_its_file_instead_of_holding_its_bytes(
        tmp_path):
    """datasets writes a local image it did not embed as {"bytes": None, "path": ...}."""
    table = hf_table([0, 1] * 4)
    (tmp_path / "pictures").mkdir()
    Image.new("RGB", (20, 20), (255, 255, 255)).save(tmp_path / "pictures" / "white.png")
    images = [{"bytes": None, "path": "pictures/white.png"}] * 4 \
        + table.column("image").to_pylist()[4:]
    pq.write_table(pa.table({"image": pa.array(images, table.schema.field("image").type),
                             "label": table.column("label")}), tmp_path / "t.parquet")
    result = build_folder(tmp_path / "t.parquet", tmp_path / "out", "--val-fraction", 0)
    assert result.returncode == 0, result.stderr
    pixels, _ = read_images(tmp_path / "out", "train")
    assert len(pixels) == 8 and (pixels[:4] == 255).all() and (pixels[4:] == 0).all()


def test_images_from_hf_files_take_the_image_column_of_several_by_its_name(tmp_path):
    """A segmentation set's mask is an Image feature too, and may stand first."""
    table = hf_table([0, 1] * 4)
    png = io.BytesIO()
    Image.new("L", (20, 20), 255).save(png, format="PNG")
    masks = pa.array([{"bytes": png.getvalue(), "path": "m.png"}] * 8,
                     table.schema.field("image").type)
    pq.write_table(pa.table({"mask": masks, "image": table.column("image"),
                             "label": table.column("label")}), tmp_path / "t.parquet")
    result = build_folder(tmp_path / "t.parquet", tmp_path / "out")
    assert result.returncode == 0, result.stderr
    assert not read_images(tmp_path / "out", "train")[0].any()  # the black images, not the masks


def test_images_from_hf_files_take_the_split_from_the_file_name_and_say_where_each_went(tmp_path):
    """Named by the word nearest the file (test_run/ is no split), a file of no split trains."""
    (tmp_path / "hub" / "test_run").mkdir(parents=True)
    for name, rows in (("test_run/train", 5), ("test_run/validation", 3), ("extra", 2),
                       ("test_run/test", 4)):
        pq.write_table(hf_table([0, 1] * rows, ["cat", "dog"]),
                       tmp_path / "hub" / f"{name}-00000-of-00001.parquet")
    result = build_folder(tmp_path / "hub", tmp_path / "out")
    assert result.returncode == 0, result.stderr
    assert note_lines(result, "note: splits") == [
        "note: splits from file names: train files -> train, val files -> val, 1 with no split in "
        "the name (extra-00000-of-00001.parquet) -> train; test files left out"]
    meta = json.loads((tmp_path / "out" / "meta.json").read_text())
    assert (meta["splits"]["train"]["images"], meta["splits"]["val"]["images"]) == (14, 6)


def test_images_without_out_suggest_an_out_that_works_and_lies_outside_the_images(tmp_path):
    folder = tmp_path / "photos"
    make_image_folder(folder, trees=("",), per_class=(3,))
    for cwd, images in ((tmp_path, "photos"), (folder, ".")):
        failed = run([sys.executable, REPO / "preprocess.py", "--images", images], cwd=cwd)
        assert failed.returncode == 2 and "needs --out" in failed.stderr, failed.stderr
        suggested = re.search(r"pass e\.g\. --out (\S+)$", failed.stderr.strip()).group(1)
        result = run([sys.executable, REPO / "preprocess.py", "--images", images, "--out",
                      suggested, "--image-size", "16", "--workers", "1"], cwd=cwd)
        assert result.returncode == 0, result.stderr
        built = (cwd / suggested).resolve()
        assert (built / "meta.json").exists() and not built.is_relative_to(folder.resolve())
        shutil.rmtree(built)


def test_images_smaller_than_the_image_size_suggest_an_image_size_that_works(tmp_path):
    args = bad_images_args("images_smaller_than_the_image_size", tmp_path)
    failed = build_folder(*args[1:2], tmp_path / "out", *args[2:])
    assert failed.returncode == 2
    size = re.search(r"-> pass --image-size (\d+),", failed.stderr).group(1)
    result = build_folder(args[1], tmp_path / "out", "--image-size", size)
    assert result.returncode == 0, result.stderr


def test_images_split_by_a_hash_keep_a_training_image_in_every_class(tmp_path):
    """40 classes of 1 or 2 images: a hash of each path at --val-fraction 0.5 would hold out some
    whole; the first image of each such class trains instead."""
    folder, out = tmp_path / "folder", tmp_path / "out"
    relpaths = []
    for index in range(40):
        (folder / f"c{index:02d}").mkdir(parents=True)
        for i in range(1 + index % 2):
            relpaths.append(f"c{index:02d}/{i}.png")
            Image.new("RGB", (20, 20), (index * 6, i * 100, 0)).save(folder / relpaths[-1])
    assert sum(all(in_val(relpath, 0.5) for relpath in relpaths
                   if relpath.startswith(f"c{index:02d}/")) for index in range(40)) >= 5
    result = build_folder(folder, out, "--val-fraction", 0.5)
    assert result.returncode == 0, result.stderr
    splits = hash_split(relpaths, 0.5)
    for split in ("train", "val"):
        labels = read_images(out, split)[1]
        assert labels == [int(relpath[1:3]) for relpath in splits[split]]
    assert set(read_images(out, "train")[1]) == set(range(40)) and "warning" not in result.stderr
    # the same images as rows of one Parquet file
    pq.write_table(pa.table({"image": [{"bytes": (folder / relpath).read_bytes(), "path": relpath}
                                       for relpath in relpaths],
                             "label": [relpath[:3] for relpath in relpaths]}),
                   tmp_path / "t.parquet")
    rows = build_folder(tmp_path / "t.parquet", tmp_path / "rows", "--val-fraction", 0.5)
    assert rows.returncode == 0, rows.stderr
    assert set(read_images(tmp_path / "rows", "train")[1]) == set(range(40))


def test_images_a_class_without_training_images_is_a_warning_that_names_it(tmp_path):
    folder, out = tmp_path / "folder", tmp_path / "out"
    make_image_folder(folder, per_class=(50, 3))
    (folder / "train" / "bird").mkdir()
    (folder / "train" / "bird" / "0.jpg").write_bytes(b"\xff\xd8\xff\xe0 cut short")  # 1 of 101
    (folder / "val" / "bird").mkdir()
    Image.new("RGB", (20, 20)).save(folder / "val" / "bird" / "0.png")
    result = build_folder(folder, out)
    assert result.returncode == 0, result.stderr
    assert "warning: 1 of 3 classes have no image in the train split, so the model cannot learn " \
        "them: bird -> " in result.stderr


def test_images_with_an_empty_val_split_suggest_a_val_fraction_that_fills_it(tmp_path):
    folder = tmp_path / "folder"
    make_image_folder(folder, trees=("",), per_class=(20,))
    empty = build_folder(folder, tmp_path / "out", "--val-fraction", 0)
    assert empty.returncode == 0, empty.stderr
    fraction = re.search(r"raise --val-fraction \(now 0\.0\), e\.g\. to (\S+)$",
                         empty.stderr.strip()).group(1)
    result = build_folder(folder, tmp_path / "out2", "--val-fraction", fraction)
    assert result.returncode == 0 and read_images(tmp_path / "out2", "val")[1], result.stderr


# ---- train_ddp.py: config ------------------------------------------------------------------------

def test_config_override_is_typed_and_wins_over_the_cpu_preset():
    cfg = train_ddp.load_config(["train.max_steps=7", "optim.lr=1",
                                 "optim.eps=1e-6", "model.type=bert"], use_cuda=False)
    assert cfg.train.max_steps == 7 and train_ddp.config_dict(cfg)["train.max_steps"] == 7
    # an int where a float belongs is widened
    assert isinstance(cfg.optim.lr, float) and cfg.optim.lr == 1.0
    assert cfg.optim.eps == 1e-6  # plain PyYAML would read 1e-6 as the string '1e-6'
    assert cfg.model.type == "bert"
    assert cfg.model.n_layer == 2  # from cpu_preset: no GPU here
    cfg_gpu = train_ddp.load_config([], use_cuda=True)
    assert cfg_gpu.model.n_layer == 12  # the preset is only for machines without a GPU


def test_a_vit_on_the_digits_takes_the_gpu_preset_and_on_other_images_the_defaults():
    """With a GPU, the digits demo trains the small ViT uncompiled; a ViT on the user's own images
    keeps the defaults; on a CPU every ViT takes the CPU preset. The command line wins each time."""
    import train_fsdp
    for trainer in (train_ddp, train_fsdp):
        digits = trainer.load_config(["model.type=vit"], use_cuda=True)
        assert (digits.model.n_layer, digits.train.compile, digits.train.max_steps) == \
            (2, "false", 1000)
        assert digits.train.micro_batch_size == digits.train.global_batch_size == 32
        named = trainer.load_config(["model.type=vit", "data.dir=data/digits"], use_cuda=True)
        assert (named.model.n_layer, named.train.compile) == (2, "false")
        own = trainer.load_config(["model.type=vit", "data.dir=data/pets"], use_cuda=True)
        assert (own.model.n_layer, own.train.compile, own.train.max_steps) == (12, "auto", 300)
        cpu = trainer.load_config(["model.type=vit", "data.dir=data/pets"], use_cuda=False)
        assert (cpu.model.n_layer, cpu.train.max_steps, cpu.train.crop_padding) == (2, 1000, 0)
        text = trainer.load_config([], use_cuda=True)
        assert (text.model.n_layer, text.train.compile) == (12, "auto")
        mine = trainer.load_config(["model.type=vit", "train.max_steps=7", "model.n_layer=3"],
                                   use_cuda=True)
        assert (mine.model.n_layer, mine.train.max_steps, mine.train.eval_every) == (3, 7, 500)


@pytest.mark.parametrize("override, fragments", [
    (["train.max_step=5"], ["unknown config key 'train.max_step'",
                            "did you mean 'train.max_steps'"]),
    (["optim.lr=fast"], ["optim.lr=fast is not a float"]),
    (["train.precision=fp4"], ["train.precision=fp4 is not one of"]),
    (["max_steps"], ["is not key=value"]),
    (["train.micro_batch_size=0"], ["train.micro_batch_size=0 is out of range", "at least 1"]),
    (["optim.eps=.inf"], ["optim.eps=inf is out of range"]),  # AdamW's update would be 0
    (["optim.lr=1e999"], ["optim.lr=inf is out of range"]),  # YAML reads it as infinity
    (["checkpoint.dir="], ["checkpoint.dir has no value"]),  # not the current folder
    (["out_dir="], ["out_dir has no value", 'out_dir="out"']),
])
def test_bad_override_is_one_line_error(override, fragments):
    if override == ["train.max_step=5"]:  # one through a real process: the error line and exit code
        assert_one_line_error(run([sys.executable, "train_ddp.py", "--check", *override]),
                              *fragments)
    error, _ = train_in_process("--check", *override)
    assert error and all(fragment in error for fragment in fragments), error


@pytest.mark.parametrize("override", [
    "train.global_batch_size=0", "train.global_batch_size=-16", "train.micro_batch_size=0",
    "optim.grad_clip=-1", "optim.min_lr=-1", "optim.warmup_steps=-5", "train.mlm_probability=-1",
    "train.mlm_probability=1.5", "model.n_layer=0", "model.n_embd=-128", "model.dropout=2.0",
    "optim.beta1=1.5", "optim.lr=0", "dist.timeout_s=0", "log.prometheus_port=70000",
    "dist.bucket_mb=0", "train.pad_to_multiple=-1",
])
def test_values_of_the_right_type_but_out_of_range_are_refused(override):
    """Each of these passed the type check and then trained wrongly (NaN, flipped gradients) or
    crashed."""
    cfg = train_ddp.load_config([override], use_cuda=False)
    with pytest.raises(train_ddp.UserError,
                       match=re.escape(override.split("=")[0]) + r"=\S+ is out of range -> "):
        train_ddp.check_config(cfg, world_size=1)


def test_a_huge_whole_number_is_in_range_and_infinity_is_not():
    """Python's ints have no largest value, so the range check compares, never converts to a
    float; YAML reads .inf and 1e999 as infinite floats."""
    huge = train_ddp.load_config(["train.max_steps=" + "9" * 400], use_cuda=False)
    assert train_ddp.check_config(huge, world_size=1) == 2  # no error: the CPU preset's 32 / 16
    for value in [".inf", "-.inf", "1e999"]:
        with pytest.raises(train_ddp.UserError, match=r"optim.eps=-?inf is out of range"):
            train_ddp.check_config(train_ddp.load_config([f"optim.eps={value}"], use_cuda=False),
                                   world_size=1)


def test_config_file_mistakes_name_the_line_or_the_key(tmp_path):
    broken = tmp_path / "broken.yaml"
    broken.write_text("train:\n  max_steps: 10\n   seq_len: 64\n")
    with pytest.raises(train_ddp.UserError, match="not valid YAML at line 3, column"):
        train_ddp.load_config([str(broken)], use_cuda=False)
    wrong_type = tmp_path / "wrong_type.yaml"
    wrong_type.write_text((REPO / "config.yaml").read_text().replace("max_steps: 300",
                                                                     "max_steps: many"))
    with pytest.raises(train_ddp.UserError, match="train.max_steps=many in the config file is not "
                                                  "a number"):
        train_ddp.load_config([str(wrong_type)], use_cuda=True)
    misspelt = tmp_path / "misspelt.yaml"
    misspelt.write_text("train:\n  max_step: 10\n")
    with pytest.raises(train_ddp.UserError, match="unknown config key 'train.max_step' in the "
                                                  "config file -> did you mean 'train.max_steps'"):
        train_ddp.load_config([str(misspelt)], use_cuda=True)
    cfg = train_ddp.load_config(["optim.min_lr=1e-2", "optim.lr=1e-3"], use_cuda=False)
    with pytest.raises(train_ddp.UserError, match="optim.min_lr=0.01 is above optim.lr=0.001"):
        train_ddp.check_config(cfg, world_size=1)


def test_global_batch_that_does_not_divide_is_refused():
    error, _ = train_in_process("--check", "train.global_batch_size=30", "train.micro_batch_size=4",
                                env={"WORLD_SIZE": "2"})
    assert "train.global_batch_size=30 is not a multiple" in error \
        and "train.global_batch_size=32" in error
    # 15 sequences per rank: 3 divides them
    assert "train.micro_batch_size=3 (the same global batch)" in error


def test_the_config_file_wins_over_the_presets_which_set_only_what_it_left_at_the_defaults(
        tmp_path, monkeypatch, capsys):
    """The shipped config.yaml holds the defaults, so the CPU preset applies through it; a value the
    user changed in a config file (given first, or the one beside the trainer) stays, arguments win
    over both, and rank 0 logs what the preset set."""
    edited = (REPO / "config.yaml").read_text().replace("max_steps: 300", "max_steps: 7") \
        .replace("n_layer: 12", "n_layer: 3")
    (tmp_path / "mine.yaml").write_text(edited)
    (tmp_path / "config.yaml").write_text(edited)
    cfg = train_ddp.load_config([str(tmp_path / "mine.yaml")], use_cuda=False)
    assert (cfg.train.max_steps, cfg.model.n_layer, cfg.model.n_embd) == (7, 3, 128)
    logged = capsys.readouterr().out
    assert logged.startswith("preset cpu_preset: model.n_head=4, model.n_embd=128,") \
        and "train.max_steps" not in logged and "model.n_layer" not in logged, logged
    monkeypatch.setattr(train_ddp, "__file__", str(tmp_path / "train_ddp.py"))  # beside it
    vit = train_ddp.load_config(["model.type=vit", "train.eval_every=9"], use_cuda=False)
    assert (vit.train.max_steps, vit.model.n_layer, vit.train.eval_every,
            vit.train.crop_padding) == (7, 3, 9, 0)
    assert "preset cpu_preset + cpu_preset_images: " in capsys.readouterr().out
    monkeypatch.setenv("RANK", "1")  # load_config runs before the process group: rank 0 says it
    assert train_ddp.load_config(["train.max_steps=9"], use_cuda=False).train.max_steps == 9
    assert capsys.readouterr().out == ""


@pytest.mark.parametrize("preset, line, error", [
    ("cpu_preset", "  train.max_stepz: 9", "unknown config key 'train.max_stepz' in cpu_preset -> "
                                           "did you mean 'train.max_steps'?"),
    ("cpu_preset_images", "  model.n_layer: two",
     "model.n_layer=two in cpu_preset_images is not a number"),
    ("gpu_preset_digits", "  model.attention: fast", "model.attention=fast is not one of"),
])
def test_a_mistake_in_a_preset_that_does_not_apply_here_is_still_an_error(tmp_path, preset, line,
                                                                          error):
    """A text run on a GPU applies none of them: a typo there would wait for the first CPU run."""
    text = (REPO / "config.yaml").read_text().replace(f"\n{preset}:\n", f"\n{preset}:\n{line}\n")
    (tmp_path / "mine.yaml").write_text(text)
    with pytest.raises(train_ddp.UserError, match=re.escape(error)):
        train_ddp.load_config([str(tmp_path / "mine.yaml")], use_cuda=True)


@pytest.mark.parametrize("text, line, key", [
    ("optim:\n  warmup_steps: 5\ntrain:\n  max_steps: 9\noptim:\n  lr: 2.0e-3\n", 5, "optim"),
    ("train:\n  max_steps: 9\n  seq_len: 64\n  max_steps: 10\n", 4, "max_steps"),
    ("cpu_preset:\n  train.max_steps: 9\n  'train.max_steps': 10\n", 3, "train.max_steps"),
])
def test_a_key_given_twice_in_the_config_file_is_an_error_naming_it_and_both_lines(
        tmp_path, text, line, key):
    path = tmp_path / "twice.yaml"
    path.write_text(text)
    with pytest.raises(train_ddp.UserError, match=rf"at line {line}, column \d+ \('{key}' is given "
                                                  r"twice, first at line \d+\) -> "):
        train_ddp.load_config([str(path)], use_cuda=False)


@pytest.mark.parametrize("where, text, expected", [
    # YAML 1.1 reads these as other numbers or booleans
    ("file", "train:\n  max_steps: 010\n", "train.max_steps=010 in the config file is not a"),
    ("file", "train:\n  max_steps: 1:30\n", "train.max_steps=1:30 in the config file is not a"),
    ("file", "export: yes\n", "export=yes in the config file is not a bool"),
    ("file", "log:\n  sample_prompt: no\n", {"log.sample_prompt": "no"}),
    ("file", "train:\n  compile: false\n", {"train.compile": "false"}),
    ("file", "optim:\n  lr: 1e-3\n  eps: 1.0e-6\n", {"optim.lr": 1e-3, "optim.eps": 1e-6}),
    ("args", "train.max_steps=010", "train.max_steps=010 is not a"),
    ("args", "train.max_steps=0x10", "train.max_steps=0x10 is not a"),
    ("args", "export=off", "export=off is not a bool"),
    # nothing, null, a section as a value, an empty section
    ("file", "model:\n  pretrained:\n", "model.pretrained has no value in the config file"),
    ("args", "optim.lr=", "optim.lr has no value"),
    ("file", "optim: 3\n", "'optim' in the config file is a section, not a value"),
    ("args", "optim=3", "'optim' is a section, not a value -> give its keys, like optim.lr="),
    ("file", "optim:\n  # lr: 1.0e-3\n", {"optim.lr": 6e-4}),
    ("file", "cpu_preset: 3\n", "cpu_preset: in"),
    # ~ is the home directory in a path, as in a shell
    ("args", "checkpoint.dir=~/ckpt", {"checkpoint.dir": str(Path.home() / "ckpt")}),
    ("file", "out_dir: ~/out\n", {"out_dir": str(Path.home() / "out")}),
    # of a key given twice on the command line the last wins, as argparse does
    ("args", "train.max_steps=5 train.max_steps=50", {"train.max_steps": 50}),
])
def test_config_values_mean_what_they_say_or_are_an_error(tmp_path, where, text, expected):
    args = text.split()
    if where == "file":
        (tmp_path / "c.yaml").write_text(text)
        args = [str(tmp_path / "c.yaml")]
    if isinstance(expected, str):
        with pytest.raises(train_ddp.UserError, match=re.escape(expected)):
            train_ddp.load_config(args, use_cuda=True)
    else:
        values = train_ddp.config_dict(train_ddp.load_config(args, use_cuda=True))
        assert {key: values[key] for key in expected} == expected


# ---- train_ddp.py: distributed init --------------------------------------------------------------

def test_bf16_and_flash_attention_are_chosen_by_compute_capability(monkeypatch):
    """torch.cuda.is_bf16_supported() says True on a V100 (emulated bf16): auto must still pick fp16
    there, and must not pick FlashAttention-2, which fails on GPUs older than compute capability
    8.0."""
    gpu, cpu = torch.device("cuda", 0), torch.device("cpu")
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *args, **kwargs: True)
    monkeypatch.setattr(train_ddp, "flash_attn_available", lambda: True)
    for capability, precision, attention in [((7, 0), "fp16", "sdpa"), ((7, 5), "fp16", "sdpa"),
                                             ((8, 0), "bf16", "flash_attention_2"),
                                             ((9, 0), "bf16", "flash_attention_2")]:
        monkeypatch.setattr(torch.cuda, "get_device_capability",
                            lambda device=None, value=capability: value)
        assert train_ddp.choose_precision("auto", gpu) == precision, capability
        assert train_ddp.choose_attention("auto", gpu, "sdpa") == attention, capability
    with pytest.raises(train_ddp.UserError, match="compute capability 8.0"):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 5))
        train_ddp.choose_attention("flash_attention_2", gpu, train_ddp.ArrowTokens.sdpa)
    assert train_ddp.choose_precision("auto", cpu) == "fp32"
    assert train_ddp.choose_attention("auto", cpu, train_ddp.MaskedTokens.sdpa) == "sdpa"
    # no explicit mask under compile
    assert train_ddp.choose_attention("auto", cpu, train_ddp.ArrowTokens.sdpa) == "sdpa_causal"
    assert train_ddp.choose_attention("auto", cpu, train_ddp.ArrowImages.sdpa) == "sdpa_unmasked"
    # asked for by name: as asked
    assert train_ddp.choose_attention("sdpa", cpu, train_ddp.ArrowImages.sdpa) == "sdpa"


def test_one_rank_decides_and_a_failure_on_any_rank_stops_all(reducer_results):
    """on_rank0 hands rank 0's answer to every rank; on_all_ranks lets rank 0 report another rank's
    failure. Run on 2 ranks in the launch of the gradient reduction tests (REDUCER_SCRIPT, 5.)."""
    per_rank = reducer_results["agreed_per_rank"]
    assert per_rank[0] == per_rank[1]
    assert per_rank[0] == {
        "picked": "picked by rank 0",
        "on_rank0 failing on 0": "error: cannot read the file on rank 0",
        "on_rank0 failing on 1": "fine",  # rank 1 never runs it
        "on_all_ranks failing on 0": "error: rank 0: cannot read the file on rank 0",
        "on_all_ranks failing on 1": "error: rank 1: cannot read the file on rank 1",
    }


# ---- train_ddp.py: data, sampler, masking --------------------------------------------------------

@pytest.mark.parametrize("meta_text, fragment", [
    ("[1, 2]", "has format version None"),
    ('{"format_version": 1, "vocab_size": 400}', "lacks splits.train/val.files"),
])
def test_a_malformed_meta_json_is_a_one_line_error(meta_text, fragment, tmp_path):
    (tmp_path / "meta.json").write_text(meta_text)
    with pytest.raises(train_ddp.UserError, match=re.escape(fragment)):
        train_ddp.read_meta(tmp_path, train_ddp.ArrowTokens)


def test_a_val_split_without_samples_names_the_rebuild_that_gives_it_some(corpus_dir, tmp_path):
    data = tmp_path / "data"
    assert run_preprocess("--input", corpus_dir, "--out", data, "--val-fraction", "0").returncode \
        == 0
    args = [f"data.dir={data}", *TINY_MODEL, "train.max_steps=1", "checkpoint.every=0",
            "export=false", f"out_dir={tmp_path}/out"]
    error, printed = train_in_process(*args, "data.val_fraction=0.5")  # preprocess.py's setting
    assert "note: data.val_fraction is preprocess.py's (--val-fraction)" in printed
    assert error.startswith(f"the val split of {data} has no causal samples"), error
    command = re.search(r"-> .*: python preprocess\.py (.*)$", error)
    assert command, error
    options = {"YOUR_TEXT": str(corpus_dir), "F": "0.1"}
    assert run_preprocess(*(options.get(word, word) for word in command[1].split())).returncode \
        == 0
    error, _ = train_in_process(*args)
    assert error is None, error


def test_token_ids_beyond_the_vocabulary_are_found_when_the_data_is_opened(data_dir, tmp_path):
    copy = tmp_path / "data"
    shutil.copytree(data_dir, copy)
    meta = train_ddp.read_meta(copy, train_ddp.ArrowTokens)
    meta["vocab_size"] = 50  # the tokenizer's ids go up to ~400
    with pytest.raises(train_ddp.UserError, match="holds token id .* but the vocabulary has 50 "
                                                  "tokens"):
        train_ddp.ArrowTokens(copy, meta, "train", 64)


@pytest.mark.parametrize("world_size, micro_batch_size", [(1, 4), (2, 2), (4, 1), (2, 4)])
def test_sampler_gives_disjoint_shares_that_cover_every_epoch(world_size, micro_batch_size):
    num_samples, global_batch = 50, 8
    seen_per_epoch = {}
    for step in range(25):  # 200 samples = 4 epochs; batches straddle the epoch boundaries
        plan = train_ddp.deal(*train_ddp.global_batch(step * global_batch, global_batch,
                                                      num_samples, 3), micro_batch_size, world_size)
        assert all(sum(len(ids) for ids, _ in rank_plan) == global_batch // world_size
                   for rank_plan in plan)
        for rank_plan in plan:
            for ids, epochs in rank_plan:
                for sample_id, epoch in zip(ids.tolist(), epochs.tolist()):
                    seen_per_epoch.setdefault(epoch, []).append(sample_id)
    assert sorted(seen_per_epoch) == [0, 1, 2, 3]
    for ids in seen_per_epoch.values():
        # each sample exactly once per epoch, over all ranks
        assert sorted(ids) == list(range(num_samples))
    first_order = train_ddp.epoch_permutation(3, 0, num_samples)
    # new order each epoch
    assert not np.array_equal(first_order, train_ddp.epoch_permutation(3, 1, num_samples))


def test_sampler_depends_on_position_not_world_size():
    """A run resumed at position p on 3 ranks sees the batch a 1-rank run would see at p."""
    def flatten(plan):
        return sorted(int(i) for rank_plan in plan for ids, _ in rank_plan for i in ids)

    for position in [0, 24, 48, 1000]:
        one_rank = train_ddp.deal(*train_ddp.global_batch(position, 12, 50, 7), 2, 1)
        three_ranks = train_ddp.deal(*train_ddp.global_batch(position, 12, 50, 7), 2, 3)
        assert flatten(one_rank) == flatten(three_ranks)


def test_length_grouping_puts_similar_lengths_in_one_micro_batch():
    lengths = {i: (i * 37) % 64 + 2 for i in range(64)}

    class Documents(train_ddp.MaskedTokens):  # lengths alone, without data
        def __init__(self):
            self.num_samples = len(lengths)

        def length(self, index):
            return lengths[int(index)]

    cfg = SimpleNamespace(train=SimpleNamespace(global_batch_size=16, micro_batch_size=4))
    plan = Documents().plan(0, 5, cfg, 2)
    micro_batches = [ids for rank_plan in plan for ids, _ in rank_plan]
    spans = [max(lengths[int(i)] for i in ids) - min(lengths[int(i)] for i in ids)
             for ids in micro_batches]
    random_spans = []
    rng = np.random.default_rng(0)
    for _ in range(20):
        ids = rng.choice(64, 16, replace=False)
        random_spans += [np.ptp([lengths[int(i)] for i in ids[k:k + 4]]) for k in range(0, 16, 4)]
    assert np.mean(spans) < 0.5 * np.mean(random_spans)


def test_masking_depends_only_on_seed_epoch_and_sample():
    special = {"mask": 2, "cls": 3, "sep": 4}
    tokens = np.array([3] + list(range(10, 210)) + [4])
    # a micro-batch of two samples
    padded = np.array([[*tokens, 0, 0, 0], [*tokens[:50], 4, *[0] * 154]])

    def mask(epoch, sample_ids):
        return train_ddp.mask_tokens(padded, np.array([202, 51]), 1, np.array([epoch, epoch]),
                                     np.array(sample_ids), special, 400, 0.15)

    first, again, other_epoch, other_partner = mask(0, [42, 7]), mask(0, [42, 7]), \
        mask(1, [42, 7]), mask(0, [42, 8])
    assert all(np.array_equal(a, b) for a, b in zip(first, again))
    assert not np.array_equal(first[1][0], other_epoch[1][0])
    # a sample's masking ignores the rest of its batch
    assert np.array_equal(first[1][0], other_partner[1][0])
    assert (first[1][1, 50:] == train_ddp.IGNORE_INDEX).all()  # [SEP] and padding are never targets
    inputs, labels = first[0][0, :202], first[1][0, :202]
    masked = labels != train_ddp.IGNORE_INDEX
    assert 0.08 < masked.mean() < 0.22
    assert not masked[0] and not masked[-1]  # [CLS] and [SEP] are never targets
    assert (labels[masked] == tokens[masked]).all()
    assert (inputs[~masked] == tokens[~masked]).all()
    assert (inputs[masked] == 2).mean() > 0.6  # about 80% of targets read [MASK]


def test_the_label_count_every_rank_makes_equals_the_labels_of_all_ranks_micro_batches(data_dir):
    """The loss is divided by the global batch's label tokens, which each rank counts on the host
    from the shared plan (rank_batches); for a masked LM that count must draw exactly the positions
    micro_batch masks."""
    meta = train_ddp.read_meta(data_dir, train_ddp.MaskedTokens)
    cfg = train_ddp.load_config(["model.type=bert", "train.seq_len=64",
                                 "train.global_batch_size=12", "train.micro_batch_size=3",
                                 "train.pad_to_multiple=8"], use_cuda=False)
    data = train_ddp.MaskedTokens(data_dir, meta, "train", 64)
    for world_size in (1, 2):
        labels = 0
        for rank in range(world_size):
            batches, _, label_tokens, _ = train_ddp.rank_batches(data, 24, 5, cfg, world_size, rank,
                                                                 torch.device("cpu"))
            labels += sum(int((batch["labels"] != train_ddp.IGNORE_INDEX).sum())
                          for batch in batches)
        assert label_tokens == labels > 0


def test_masked_lm_compiles_one_graph_for_all_padded_lengths(data_dir, tmp_path, monkeypatch):
    """Dynamic padding gives micro-batches many lengths. Compiled for each length, the model would
    recompile at every new one and, past torch._dynamo.config.recompile_limit, silently run eagerly.
    Marked dynamic, a run compiles three graphs in all, whatever the lengths: the model in training,
    the loss, the model in evaluation (no_grad is another graph). The "eager" backend: Dynamo alone
    decides what is compiled when; inductor can add guards of its own (on CUDA maybe whether the
    length is a multiple of 8, which train.pad_to_multiple=8 keeps true)."""
    graphs, lengths = [], []

    def counting_backend(graph_module, example_inputs):
        graphs.append(torch.is_grad_enabled())
        return graph_module.forward

    def recording_micro_batch(*args):
        batch = real_micro_batch(*args)
        lengths.append((torch.is_grad_enabled(), batch["inputs"]["input_ids"].shape[1]))
        return batch

    real_compile, real_micro_batch = torch.compile, train_ddp.MaskedTokens.micro_batch
    monkeypatch.setattr(torch, "compile",
                        lambda target: real_compile(target, backend=counting_backend))
    monkeypatch.setattr(train_ddp.MaskedTokens, "micro_batch", recording_micro_batch)
    torch._dynamo.reset()
    try:
        error, _ = train_in_process(f"data.dir={data_dir}", "model.type=bert", *TINY_MODEL,
                                    "train.seq_len=256", "train.pad_to_multiple=8",
                                    "train.global_batch_size=16", "train.micro_batch_size=4",
                                    "train.compile=true", "train.max_steps=4", "train.eval_every=2",
                                    "train.eval_batches=1", "log.every=2", "checkpoint.every=0",
                                    "export=false", f"out_dir={tmp_path}")
    finally:
        torch._dynamo.reset()
    assert error is None, error
    train_lengths = {length for grad, length in lengths if grad}
    assert len(train_lengths) >= 3 and all(length % 8 == 0 for length in train_lengths), lengths
    assert any(not grad for grad, _ in lengths)  # evaluation ran
    assert sorted(graphs) == [False, True, True], graphs  # no_grad: the evaluation's model graph


def test_bert_as_a_causal_lm_sees_no_later_token_in_training_or_in_its_export(data_dir, tmp_path):
    """An encoder attends both ways unless its config says it is a decoder: as a causal LM it would
    learn to copy the next token, and its export would too."""
    from transformers import AutoModelForCausalLM
    seen = []
    real_step = train_ddp.train_step

    def first_logits(model, batches, *args):  # the model as the step runs it
        ids = batches[0][0]["inputs"]["input_ids"][:1, :8]
        with torch.no_grad():
            seen.append((model(input_ids=ids).logits[:, :4], model(input_ids=ids[:, :4]).logits))
        return real_step(model, batches, *args)

    with unittest.mock.patch.object(train_ddp, "train_step", first_logits):
        error, _ = train_in_process(f"data.dir={data_dir}", "model.type=bert", "model.task=causal",
                                    *TINY_MODEL, "model.dropout=0.0", "train.max_steps=2",
                                    "train.global_batch_size=4", "train.micro_batch_size=4",
                                    "checkpoint.every=0", "log.sample_tokens=4",
                                    f"out_dir={tmp_path}", f"checkpoint.dir={tmp_path}/ckpt")
    assert error is None, error
    assert seen and all(torch.allclose(longer, prefix, atol=1e-5) for longer, prefix in seen)
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "final").eval()
    ids = torch.randint(5, 400, (1, 8))
    with torch.no_grad():
        assert torch.allclose(exported(ids).logits[:, :4], exported(ids[:, :4]).logits, atol=1e-5)


def test_a_masked_lm_export_tokenizes_text_as_its_training_samples_were(data_dir, tmp_path):
    """Every sample was [CLS] document [SEP]: fill-mask must see the same framing, and no more
    positions than the model has."""
    from tokenizers import Tokenizer
    from transformers import pipeline
    error, _ = train_in_process(f"data.dir={data_dir}", "model.type=bert", *TINY_MODEL,
                                "train.max_steps=1", "train.global_batch_size=4",
                                "train.micro_batch_size=4", "checkpoint.every=0",
                                f"out_dir={tmp_path}", f"checkpoint.dir={tmp_path}/ckpt")
    assert error is None, error
    meta = json.loads((data_dir / "meta.json").read_text())
    ids, text = meta["special_tokens"], "def main(argv):\n    return 0"
    plain = Tokenizer.from_file(str(data_dir / meta["tokenizer_file"])).encode(text).ids
    fill = pipeline("fill-mask", model=str(tmp_path / "final"))
    assert fill.tokenizer(text)["input_ids"] == [ids["cls"], *plain, ids["sep"]]
    assert fill.tokenizer.model_max_length == 64
    assert len(fill(f"def main({fill.tokenizer.mask_token}):", top_k=3)) == 3


@pytest.mark.parametrize("args, message", [
    (["train.mlm_probability=0.3"], "train.mlm_probability=0.3 applies to masked LMs, and this run "
                                    "trains none -> leave it at 0.15"),
    (["model.type=bert", "model.task=causal", "train.pad_to_multiple=8"],
     "train.pad_to_multiple=8 applies to masked LMs"),
    (["model.type=bert", "train.hflip=true"], "train.hflip=True applies to image models, and this "
                                              "run trains none -> leave it at False"),
    (["train.crop_padding=2"], "train.crop_padding=2 applies to image models"),
    (["model.patch_size=4"], "model.patch_size=4 applies to image models"),
])
def test_a_setting_of_another_kind_of_model_is_refused_not_silently_unused(args, message, data_dir,
                                                                           tmp_path):
    error, _ = train_in_process(f"data.dir={data_dir}", *TINY_MODEL, *args, f"out_dir={tmp_path}",
                                f"checkpoint.dir={tmp_path}/ckpt")
    assert error and message in error, error


def test_validation_with_no_label_to_predict_says_so_instead_of_a_loss_of_zero(data_dir, tmp_path):
    """A masking probability so low that no position of the validation batches is masked."""
    error, printed = train_in_process(f"data.dir={data_dir}", "model.type=bert", *TINY_MODEL,
                                      "train.mlm_probability=1e-9", "train.max_steps=1",
                                      "train.global_batch_size=4", "train.micro_batch_size=4",
                                      "checkpoint.every=0", "export=false", f"out_dir={tmp_path}",
                                      f"checkpoint.dir={tmp_path}/ckpt")
    assert error is None, error
    assert "step 1 | val loss n/a: no label to predict in the validation batches" in printed
    assert [record["val_loss"] for record in read_metrics(tmp_path, "val")] == [None, None]


# ---- train_ddp.py: model and attention -----------------------------------------------------------

def test_log_names_the_real_model_type_of_a_pretrained_model(data_dir, tmp_path):
    from transformers import BertConfig, BertForMaskedLM
    BertForMaskedLM(BertConfig(vocab_size=448, hidden_size=32, num_hidden_layers=1,
                               num_attention_heads=2, intermediate_size=64,
                               max_position_embeddings=64)).save_pretrained(tmp_path / "bert")
    error, printed = train_in_process(f"data.dir={data_dir}", f"model.pretrained={tmp_path}/bert",
                                      "train.seq_len=64", "train.max_steps=1",
                                      "train.global_batch_size=4", "train.micro_batch_size=4",
                                      "train.eval_batches=1", f"out_dir={tmp_path}/out",
                                      f"checkpoint.dir={tmp_path}/ckpt")
    assert error is None, error
    assert "model bert (mlm)" in printed  # config.yaml still says model.type=gpt2


@pytest.mark.parametrize("override, fragment", [
    ("model.type=gpt9", "model.type=gpt9 is not a transformers model type"),
    ("model.pretrained=/nowhere/model",
     "cannot read a transformers config from model.pretrained=/nowhere/model"),
    ("model.n_head=3", "model.n_embd=32 is not divisible by model.n_head=3"),
    ("model.type=t5", "transformers has no CausalLM of type t5 -> use a model.type that has one"),
    ("model.task=mlm", "transformers has no MaskedLM of type gpt2"),
    ("model.type=llama model.n_embd=30", "model.* make no valid llama (Class validation error "
     "for validator 'validate_rope': ValueError: RoPE requires an even rotary dimension"),
    ("model.pretrained=FILE", "cannot load model.pretrained="),
    ("model.pretrained=CUT", "cannot load model.pretrained="),
])
def test_bad_model_settings_are_one_line_errors(override, fragment, data_dir, tmp_path):
    """Including a pretrained path that is a file, and one whose weights were cut short."""
    if "model.pretrained=" in override and override.endswith(("FILE", "CUT")):
        from transformers import AutoConfig, AutoModelForCausalLM
        AutoModelForCausalLM.from_config(AutoConfig.for_model(
            "gpt2", vocab_size=448, n_embd=32, n_layer=2, n_head=2, n_positions=64)
        ).save_pretrained(tmp_path / "saved")
        weights = tmp_path / "saved" / "model.safetensors"
        weights.write_bytes(weights.read_bytes()[:1000])
        where = tmp_path / "saved" / ("config.json" if override.endswith("FILE") else "")
        override = f"model.pretrained={where}"
    error, _ = train_in_process(f"data.dir={data_dir}", *TINY_MODEL, *override.split(),
                                f"out_dir={tmp_path}", f"checkpoint.dir={tmp_path}/ckpt")
    assert error and fragment in error, error


def test_a_shape_given_beside_a_pretrained_model_is_refused_where_it_differs_and_no_preset_sets_one(
        tmp_path, capsys):
    """model.pretrained keeps its own shape: another model.n_layer would go unused, and the CPU
    preset's small shape is not applied to it."""
    from transformers import AutoConfig, AutoModelForCausalLM
    AutoModelForCausalLM.from_config(AutoConfig.for_model(
        "gpt2", vocab_size=128, n_embd=32, n_layer=1, n_head=2, n_positions=64)
    ).save_pretrained(tmp_path / "gpt2")
    meta = {"vocab_size": 128, "special_tokens": dict(zip(SPECIAL_ROLES, range(5)))}
    refused = f"model.n_layer=3, but model.pretrained={tmp_path / 'gpt2'} has 1 -> leave " \
        "model.n_layer out"
    other_width = f"model.intermediate_size=64, but model.pretrained={tmp_path / 'gpt2'} has its " \
        "own -> leave model.intermediate_size out"  # GPT-2 names it n_inner
    for args, error in [(["model.n_layer=3"], refused),
                        (["model.intermediate_size=64"], other_width),
                        (["model.n_layer=1", "model.n_embd=32"], None), ([], None)]:
        cfg = train_ddp.load_config([f"model.pretrained={tmp_path / 'gpt2'}", "train.seq_len=64",
                                     *args], use_cuda=False)
        if not args:
            assert (cfg.model.n_layer, cfg.model.n_embd) == (12, 768)  # untouched by cpu_preset
            assert "model.n_layer" not in capsys.readouterr().out
        if error:
            with pytest.raises(train_ddp.UserError, match=re.escape(error)):
                train_ddp.build_model(cfg, train_ddp.ArrowTokens, meta, torch.device("cpu"))
        else:
            model, _ = train_ddp.build_model(cfg, train_ddp.ArrowTokens, meta, torch.device("cpu"))
            assert model.config.n_layer == 1


@pytest.mark.parametrize("model_type, width", [("gpt2", 48), ("llama", 48), ("gpt2", 0),
                                               ("bloom", 0), ("bloom", 48)])
def test_model_intermediate_size_shapes_the_mlp_of_every_type_that_has_one_and_else_is_refused(
        model_type, width):
    """GPT-2 calls it n_inner; BLOOM's MLP is 4 x width, with no setting: 48 would go unused."""
    cfg = train_ddp.load_config([f"model.type={model_type}", f"model.intermediate_size={width}",
                                 "model.n_embd=32", "model.n_head=2"], use_cuda=False)
    meta = {"vocab_size": 128, "special_tokens": dict(zip(SPECIAL_ROLES, range(5)))}
    if model_type == "bloom" and width:
        with pytest.raises(train_ddp.UserError, match="model.type=bloom has no intermediate_size"):
            train_ddp.text_config(cfg, meta)
        return
    model = train_ddp.AutoModelForCausalLM.from_config(train_ddp.text_config(cfg, meta))
    widths = {module.weight.shape[1] if model_type == "gpt2" else module.out_features
              for name, module in model.named_modules()
              if name.endswith(("c_fc", "up_proj", "dense_h_to_4h"))}
    assert widths == {width or 4 * 32}


def test_untying_a_pretrained_tied_model_starts_its_output_layer_as_a_copy(tmp_path):
    """A tied checkpoint holds one table; loaded untied, transformers would leave the output layer
    random."""
    from transformers import AutoConfig, AutoModelForCausalLM
    config = AutoConfig.for_model("gpt2", vocab_size=128, n_embd=32, n_layer=1, n_head=2,
                                  n_positions=64)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "tied")
    cfg = train_ddp.load_config([f"model.pretrained={tmp_path / 'tied'}",
                                 "model.tie_word_embeddings=false", "train.seq_len=64"],
                                use_cuda=False)
    meta = {"vocab_size": 128, "special_tokens": dict(zip(SPECIAL_ROLES, range(5)))}
    model, _ = train_ddp.build_model(cfg, train_ddp.ArrowTokens, meta, torch.device("cpu"))
    embedding, output = model.get_input_embeddings().weight, model.get_output_embeddings().weight
    assert output is not embedding and torch.equal(output, embedding)


def test_vit_without_a_mask_gives_the_logits_of_transformers_sdpa_compiled_or_not():
    """sdpa_unmasked passes SDPA no mask (its flash kernels refuse transformers' all-true one under
    compile): on unpadded images that is the same attention, so the same logits."""
    from transformers import AutoConfig, AutoModelForImageClassification
    config = AutoConfig.for_model("vit", hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                  intermediate_size=64, image_size=32, patch_size=8, num_labels=5)
    unmasked = train_ddp.choose_attention("auto", torch.device("cpu"), train_ddp.ArrowImages.sdpa)
    torch.manual_seed(0)
    theirs = AutoModelForImageClassification.from_config(config, attn_implementation="sdpa").eval()
    ours = AutoModelForImageClassification.from_config(config, attn_implementation=unmasked).eval()
    ours.load_state_dict(theirs.state_dict())
    masks = []
    original = torch.nn.functional.scaled_dot_product_attention
    pixels = torch.randn(4, 3, 32, 32)
    with torch.no_grad():
        expected, got = theirs(pixel_values=pixels).logits, ours(pixel_values=pixels).logits
        def spy(*args, **kwargs):  # the masks SDPA gets under compile, where transformers' sdpa
            masks.append(kwargs.get("attn_mask"))  # builds an all-true one (5.17 always)
            return original(*args, **kwargs)
        with unittest.mock.patch.object(torch.nn.functional, "scaled_dot_product_attention", spy):
            compiled = torch.compile(ours, backend="eager")(pixel_values=pixels).logits
    assert masks == [None, None]  # none in either layer
    assert (got - expected).abs().max() < 1e-5 and (compiled - expected).abs().max() < 1e-5


def test_model_flops_are_what_the_flop_counter_counts_with_causal_attention_half(data_dir):
    """torch's FlopCounterMode counts every matmul a forward + backward runs. It counts eager
    attention's full T x T scores (computed, then masked), and not SDPA's fused CPU kernel at all
    (torch 2.13), so the models here use eager attention. Our count differs from it in two stated
    ways only: 6 x matmul_params also counts biases and norm weights (FlopCounterMode counts no
    bias), and causal attention counts half the scores."""
    from torch.utils.flop_counter import FlopCounterMode
    meta = train_ddp.read_meta(data_dir, train_ddp.ArrowTokens)
    special = meta["special_tokens"]
    for model_type, reader in [("gpt2", train_ddp.ArrowTokens), ("bert", train_ddp.MaskedTokens)]:
        cfg = train_ddp.load_config([f"model.type={model_type}", *TINY_MODEL,
                                     "model.attention=eager", "train.micro_batch_size=3",
                                     "train.pad_to_multiple=16"], use_cuda=False)
        model, _ = train_ddp.build_model(cfg, reader,
                                         {"vocab_size": 448, "special_tokens": special},
                                         torch.device("cpu"))
        data = reader(data_dir, meta, "train", 64)
        ids = np.arange(40, 43)  # MLM: three documents of different lengths, padded to the longest
        lengths = [data.length(int(i)) for i in ids]
        batch = data.micro_batch(ids, np.zeros(3, int), cfg, torch.device("cpu"))
        with FlopCounterMode(display=False) as counter:
            logits = model(**batch["inputs"]).logits
            train_ddp.token_loss_sum(logits, batch["labels"]).backward()
        counted = {str(op): flops for op, flops in counter.get_flop_counts()["Global"].items()}
        positions = batch["inputs"]["input_ids"].numel()
        # MLM: rounded up to train.pad_to_multiple
        padded = -(-max(lengths) // 16) * 16 if reader.task == "mlm" else 64
        assert positions == 3 * padded, lengths
        # padding counted
        assert reader.task == "causal" or (len(set(lengths)) > 1 and padded > max(lengths))
        matmul_params = train_ddp.count_matmul_params(model)
        # biases, norm weights
        not_multiplied = sum(p.numel() for p in model.parameters() if p.dim() < 2)
        assert counted["aten.mm"] + counted["aten.addmm"] \
            == 6 * (matmul_params - not_multiplied) * positions
        full_attention = counted["aten.bmm"]
        ours = reader.flops_counter(model, "eager", cfg)([lengths])
        assert ours - 6 * matmul_params * positions \
            == full_attention / (2 if reader.task == "causal" else 1)
    # FlashAttention-2 attends within each sample only
    unpadded = reader.flops_counter(model, "flash_attention_2", cfg)([[3, 5]])
    assert unpadded - 6 * matmul_params * 2 * 16 == 12 * 2 * 32 * (3 * 3 + 5 * 5)


@pytest.mark.parametrize("model_type", ["gpt2", "llama", "bert", "vit"])
def test_a_bf16_step_casts_each_blocks_input_so_the_residual_stream_is_bf16(model_type):
    """Under bf16 autocast alone the blocks take fp32 inputs (the embedding's output); with
    residual_in_bf16 every block takes bf16 and the loss moves by rounding only. An fp16 or fp32
    step, and the model outside autocast, are left as they are."""
    cfg = train_ddp.load_config([f"model.type={model_type}", *TINY_MODEL, "model.dropout=0.0"],
                                use_cuda=False)
    reader = {"bert": train_ddp.MaskedTokens, "vit": train_ddp.ArrowImages}.get(
        model_type, train_ddp.ArrowTokens)
    meta = {"vocab_size": 448, "special_tokens": dict(zip(SPECIAL_ROLES, range(5))),
            "image_size": 32, "classes": list("abcde"), "mean": [0.5] * 3, "std": [0.25] * 3}
    torch.manual_seed(0)
    model, _ = train_ddp.build_model(cfg, reader, meta, torch.device("cpu"))
    inputs = {"pixel_values": torch.randn(2, 3, 32, 32)} if model_type == "vit" else \
        {"input_ids": torch.randint(5, 448, (2, 64))}

    def logits_and_input_dtypes(autocast=True):
        seen = set()  # what each block's forward receives, after any hook registered before
        handles = [block.register_forward_pre_hook(lambda block, args: seen.add(args[0].dtype))
                   for block in train_ddp.repeated_blocks(model)]
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            logits = model(**inputs).logits.float()
        for handle in handles:
            handle.remove()
        return logits, seen

    def loss(logits):  # a mean over every position can hide rounding: compare logits for that
        return logits.logsumexp(-1).mean().item()

    as_autocast_leaves_it, fp32_inputs = logits_and_input_dtypes()
    assert fp32_inputs == {torch.float32}
    in_fp32, _ = logits_and_input_dtypes(autocast=False)
    for other in [torch.float16, None]:
        train_ddp.residual_in_bf16(model, other)
        logits, inputs_seen = logits_and_input_dtypes()
        assert torch.equal(logits, as_autocast_leaves_it) and inputs_seen == fp32_inputs
    train_ddp.residual_in_bf16(model, torch.bfloat16)
    in_bf16, inputs_seen = logits_and_input_dtypes()
    assert inputs_seen == {torch.bfloat16}
    assert not torch.equal(in_bf16, as_autocast_leaves_it)
    assert loss(in_bf16) == pytest.approx(loss(as_autocast_leaves_it), rel=1e-2)
    assert torch.equal(logits_and_input_dtypes(autocast=False)[0], in_fp32)  # outside autocast


@pytest.mark.parametrize("trainer", TRAINERS)
def test_both_trainers_train_a_bf16_step_with_the_residual_stream_in_bf16(trainer, data_dir,
                                                                          tmp_path, monkeypatch):
    """DDP, and FSDP on one rank (trained whole), cast each block's input; the export's sample,
    generated outside autocast, still runs."""
    module, seen = importlib.import_module(trainer.removesuffix(".py")), set()
    cast = module.residual_in_bf16

    def observed(model, dtype):  # the trainer's cast, then a record of what each block receives
        cast(model, dtype)
        for block in module.repeated_blocks(model):
            block.register_forward_pre_hook(lambda block, args: seen.add(args[0].dtype))

    monkeypatch.setattr(module, "residual_in_bf16", observed)
    error, printed = train_in_process(
        f"data.dir={data_dir}", *TINY_MODEL, "train.precision=bf16", "train.max_steps=1",
        "checkpoint.every=0", "log.sample_tokens=4", f"out_dir={tmp_path}", trainer=module)
    assert error is None and "precision bf16" in printed, error
    assert "\nsample:\n" in printed  # generated after the export, in fp32: outside autocast
    assert torch.bfloat16 in seen  # training


# ---- train_ddp.py: loss normalisation ------------------------------------------------------------

def test_token_mean_gradient_is_independent_of_the_micro_batch_split_and_the_naive_mean_is_not(
        data_dir):
    """The popular recipe, loss.mean() per micro-batch divided by the accumulation steps, weights a
    token in a short micro-batch more than one in a long one. Ours divides summed losses by the
    token count of the whole batch, which equals the full-batch gradient."""
    torch.manual_seed(0)
    cfg = train_ddp.load_config(["model.type=bert", *TINY_MODEL, "model.dropout=0.0"],
                                use_cuda=False)
    meta = train_ddp.read_meta(data_dir, train_ddp.MaskedTokens)
    special = meta["special_tokens"]
    data = train_ddp.MaskedTokens(data_dir, meta, "train", 64)
    model, _ = train_ddp.build_model(cfg, train_ddp.MaskedTokens,
                                     {"vocab_size": 448, "special_tokens": special},
                                     torch.device("cpu"))
    ids = np.arange(16)
    lengths = [data.length(i) for i in ids]
    assert max(lengths) > 2 * min(lengths), "the corpus must have documents of different lengths"

    def gradient(micro_batches, normalize):
        model.zero_grad()
        for batch in micro_batches:
            logits = model(**batch["inputs"]).logits
            normalize(train_ddp.token_loss_sum(logits, batch["labels"]), batch,
                      len(micro_batches)).backward()
        return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])

    def batches(size):
        return [data.micro_batch(ids[k:k + size], np.zeros(size, int), cfg, torch.device("cpu"))
                for k in range(0, 16, size)]

    def label_tokens(batch):
        return int((batch["labels"] != train_ddp.IGNORE_INDEX).sum())

    whole = gradient(batches(16), lambda loss, b, n: loss / label_tokens(b))
    split = batches(4)
    total_tokens = sum(label_tokens(b) for b in split)
    ours = gradient(split, lambda loss, b, n: loss / total_tokens)
    naive = gradient(split, lambda loss, b, n: loss / label_tokens(b) / n)
    assert ((ours - whole).norm() / whole.norm()) < 1e-5
    assert ((naive - whole).norm() / whole.norm()) > 1e-3


def adam_first_moment(ckpt_step_dir):
    """After one AdamW step exp_avg = (1 - beta1) * gradient: the checkpoint holds the exact
    gradient."""
    state = torch.load(Path(ckpt_step_dir) / "optimizer.pt", weights_only=True)["state"]
    return torch.cat([state[key]["exp_avg"].flatten() for key in sorted(state)])


def test_gradient_is_the_same_for_any_split_into_ranks_and_micro_batches_and_either_reducer(
        data_dir, tmp_path):
    """2 ranks x 2 micro-batches run the inline reducer (small buckets: several all-reduces), 2 x 1
    DDP."""
    gradients, losses = {}, {}
    for world_size, micro_batches, reducer in [(1, 4, "torch"), (2, 2, "inline"), (2, 1, "torch")]:
        out = tmp_path / f"w{world_size}m{micro_batches}"
        args = [f"data.dir={data_dir}", "model.type=bert", *TINY_MODEL, "model.dropout=0.0",
                "train.precision=fp32", "train.global_batch_size=16",
                f"train.micro_batch_size={16 // world_size // micro_batches}", "train.max_steps=1",
                "checkpoint.every=1", "optim.grad_clip=0", "train.eval_batches=1",
                f"dist.reducer={reducer}", "dist.bucket_mb=0.05", f"out_dir={out}",
                f"checkpoint.dir={out}/ckpt"]
        if world_size == 1:  # one process needs no torchrun
            assert train_in_process(*args)[0] is None
        else:
            torchrun(world_size, "train_ddp.py", *args)
        gradients[world_size, micro_batches] = adam_first_moment(out / "ckpt" / "step_000001")
        losses[world_size, micro_batches] = read_metrics(out, "train")[0]["loss"]
    reference = gradients[1, 4]
    for split, gradient in gradients.items():
        assert ((gradient - reference).norm() / reference.norm()) < 1e-5, split
        assert losses[split] == pytest.approx(losses[1, 4], rel=1e-6)
    records = read_metrics(tmp_path / "w2m2", "train") + read_metrics(tmp_path / "w2m1", "train")
    for record in records:
        # the last bucket's all-reduce starts when backward ends: some of it is exposed, and never
        # more than the step took
        assert 0 < record["comm_exposed_ms"] < 1000 / record["steps_per_sec"], record
        assert 0 < record["allreduce_p50_ms"] <= record["allreduce_p95_ms"], record


# ---- train_ddp.py: train_step --------------------------------------------------------------------

def test_the_host_waits_for_the_gpu_once_a_step_after_queuing_its_backward_and_the_next_batches(
        data_dir, tmp_path, monkeypatch):
    """On a GPU, reading a tensor's value (.tolist(), .item()) makes the host wait for all the work
    queued before it. Inside a step the trainer reads one value, the step's verdict, and only once
    the step's backward passes and the next step's batches are queued. A CPU cannot show the GPU's
    idle time; the order of the trainer's reads (R), its training losses (L, 2 micro-batches a step)
    and its batch building (B) shows the rule."""
    events = []
    loss_sum, rank_batches = train_ddp.token_loss_sum, train_ddp.rank_batches
    monkeypatch.setattr(train_ddp, "token_loss_sum", lambda *args: (
        events.append("L") if torch.is_grad_enabled() else None, loss_sum(*args))[1])
    monkeypatch.setattr(train_ddp, "rank_batches", lambda *args: (
        events.append("B") if args[2] is not None else None, rank_batches(*args))[1])
    for name in ("tolist", "item"):
        def read(tensor, original=getattr(torch.Tensor, name)):
            if sys._getframe(1).f_code.co_filename == train_ddp.__file__:  # the trainer's reads
                events.append("R")
            return original(tensor)
        monkeypatch.setattr(torch.Tensor, name, read)
    error, _ = train_in_process(f"data.dir={data_dir}", *TINY_MODEL, "train.global_batch_size=8",
                                "train.micro_batch_size=4", "train.max_steps=4", "log.every=100",
                                "train.eval_every=100", "train.eval_batches=1",
                                "checkpoint.every=0", "export=false", f"out_dir={tmp_path}",
                                f"checkpoint.dir={tmp_path}/ckpt")
    assert error is None, error
    steps = "".join(events)
    assert steps[steps.index("B"):].startswith("B" + "LLBR" * 4), steps


@pytest.mark.parametrize("name", ["train_ddp", "train_fsdp"])
def test_batches_go_to_the_gpu_from_contiguous_pinned_memory(name, monkeypatch):
    """A causal micro-batch's inputs and labels are strided slices of one block. pin_memory() keeps
    the strides, and torch's CUDA copy of a strided source (2.11) goes through a pageable temporary:
    a copy that waits for the GPU. What on_device pins must be contiguous; the copy is faked here
    (no GPU), its source recorded."""
    pinned = []
    monkeypatch.setattr(torch.Tensor, "pin_memory",
                        lambda tensor: pinned.append(tensor.is_contiguous()) or tensor)
    monkeypatch.setattr(torch.Tensor, "to", lambda tensor, *args, **kwargs: tensor)
    blocks = torch.arange(4 * 9).reshape(4, 9)
    batch = importlib.import_module(name).on_device(
        {"input_ids": blocks[:, :-1], "labels": blocks[:, 1:], "attention_mask": None},
        torch.device("cuda"))
    assert pinned == [True, True]
    assert torch.equal(batch["labels"], blocks[:, 1:])
    assert torch.equal(batch["inputs"]["input_ids"], blocks[:, :-1])


# ---- train_ddp.py: gradient reduction ------------------------------------------------------------

# Run once on 2 gloo ranks (reducer_results): DDP and InlineReducer side by side on a tiny GPT-2,
# each rank with its own data; the folk recipe; bf16 compression; and, for the distributed init
# tests, on_rank0 and on_all_ranks. Rank 0 prints what the tests check.
REDUCER_SCRIPT = """
import contextlib, json, os, sys, time
from types import SimpleNamespace
sys.path.insert(0, REPO)
import torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
import train_ddp
dist.init_process_group("gloo")
rank, world_size = dist.get_rank(), dist.get_world_size()
cfg = train_ddp.load_config(TINY_MODEL + ["model.dropout=0.0"], use_cuda=False)
special = {"eot": 0, "pad": 1, "mask": 2, "cls": 3, "sep": 4}
generator = torch.Generator().manual_seed(100 + rank)  # each rank its own data
micro_batches = [torch.randint(5, 448, (2, 65), generator=generator) for _ in range(2)]
results = {}


def fresh_model():
    # different initial weights per rank: the reducers must broadcast rank 0's
    torch.manual_seed(rank)
    return train_ddp.build_model(cfg, train_ddp.ArrowTokens,
                                 {"vocab_size": 448, "special_tokens": special},
                                 torch.device("cpu"))[0]


# the trainer's scaling: summed loss x world size / label tokens of the global batch
def loss_of(model, ids):
    logits = model(input_ids=ids[:, :-1]).logits
    return train_ddp.token_loss_sum(logits, ids[:, 1:]) * world_size / (4 * 64 * world_size)


def train(kind, bucket_mb=0.02, accumulate=True, compression="none", steps=1, observe=None):
    raw = fresh_model()
    ddp = reducer = None
    if kind == "torch":
        ddp = DDP(raw, bucket_cap_mb=bucket_mb)
        if compression == "bf16":
            ddp.register_comm_hook(None, train_ddp.bf16_allreduce_hook)
    elif kind == "naive":
        reducer = train_ddp.NaiveReducer(raw)
    else:
        reducer = train_ddp.InlineReducer(raw, reducer_config(bucket_mb, compression))
        if observe is not None:  # gradients still to come when each bucket starts
            launch = reducer.launch
            reducer.launch = lambda index: (observe.append(sum(reducer.missing)), launch(index))
    optimizer = torch.optim.AdamW(raw.parameters(), lr=1e-2)
    batches = micro_batches if accumulate else [torch.cat(micro_batches)]
    losses = []
    for _ in range(steps):
        for index, ids in enumerate(batches):
            is_last = index == len(batches) - 1
            with ddp.no_sync() if ddp and not is_last else reducer.sync(is_last) if reducer else \
                    contextlib.nullcontext():
                loss = loss_of(ddp or raw, ids)
                loss.backward()
        if reducer:
            reducer.finish()
        losses.append(loss.item())
        gradient = torch.cat([p.grad.flatten() for p in raw.parameters()])
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    weights = torch.cat([p.detach().flatten() for p in raw.parameters()])
    return gradient, weights, losses, getattr(reducer, "buckets", None)


def relative(a, b):
    return float((a - b).norm() / b.norm())


def reducer_config(bucket_mb, compression="none"):
    return SimpleNamespace(dist=SimpleNamespace(bucket_mb=bucket_mb, grad_compression=compression))


def spread_over_ranks(tensor):  # the largest difference between this rank's tensor and any other's
    gathered = [torch.empty_like(tensor) for _ in range(world_size)]
    dist.all_gather(gathered, tensor)
    return max(float((other - tensor).abs().max()) for other in gathered)


# 1. inline against DDP: several buckets with and without accumulation, and one bucket
for name, options in [("buckets", {}), ("no_accumulation", {"accumulate": False}),
                      ("one_bucket", {"bucket_mb": 1e3})]:
    ddp_gradient, ddp_weights, _, _ = train("torch", **options)
    pending = []
    gradient, weights, _, buckets = train("inline", observe=pending, **options)
    results[name] = {"gradient": relative(gradient, ddp_gradient),
                     "weights": relative(weights, ddp_weights),
                     "rank_spread": spread_over_ranks(weights), "buckets": len(buckets),
                     "pending_at_launch": pending}
    naive_gradient, naive_weights, _, _ = train("naive", **options)
    results[name].update(naive_gradient=relative(naive_gradient, ddp_gradient),
                         naive_weights=relative(naive_weights, ddp_weights),
                         naive_rank_spread=spread_over_ranks(naive_weights))

# 2. a parameter that one rank (or no rank) does not use
class TwoBranches(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.used, self.branch = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)

    def forward(self, x, use_branch):
        return self.used(x) + (self.branch(x) if use_branch else 0)

x = torch.randn(3, 4, generator=generator)
for name, use_branch in [("unused_on_rank_1", rank == 0), ("unused_everywhere", False)]:
    torch.manual_seed(0)
    reference = DDP(TwoBranches(), find_unused_parameters=True)
    reference(x, use_branch).sum().backward()
    torch.manual_seed(0)
    model = TwoBranches()
    reducer = train_ddp.InlineReducer(model, reducer_config(1e-5))
    with reducer.sync(last=True):
        model(x, use_branch).sum().backward()
    reducer.finish()
    ddp_branch = reference.module.branch.weight.grad
    results[name] = {"used": relative(model.used.weight.grad, reference.module.used.weight.grad),
                     "branch": (None if ddp_branch is None
                                else relative(model.branch.weight.grad, ddp_branch)),
                     "branch_is_zero": bool((model.branch.weight.grad == 0).all()),
                     "ddp_branch_is_none": ddp_branch is None}

# 3. bf16 compression: DDP's hook and inline alike, close to fp32, and it trains
fp32_gradient, _, fp32_losses, _ = train("inline", steps=12)
torch_bf16_gradient, _, _, _ = train("torch", compression="bf16")
bf16_gradient, _, bf16_losses, _ = train("inline", compression="bf16", steps=12)
first_fp32_gradient, _, _, _ = train("inline")
first_bf16_gradient, _, _, _ = train("inline", compression="bf16")
results["bf16"] = {"vs_fp32": relative(first_bf16_gradient, first_fp32_gradient),
                   "inline_vs_torch": relative(first_bf16_gradient, torch_bf16_gradient),
                   "losses": bf16_losses, "fp32_losses": fp32_losses}

# 4. the folk recipe: all_reduce(async_op=True) of the first parameter's gradient, no wait(), no
#    division; then every gradient launched but not waited for, with rank 1 late; then done right
for name, everything, wait, late in [("folk_recipe", False, False, False),
                                     ("no_wait", True, False, True),
                                     ("with_wait", True, True, True)]:
    torch.manual_seed(0)
    model = train_ddp.build_model(cfg, train_ddp.ArrowTokens,
                                  {"vocab_size": 448, "special_tokens": special},
                                  torch.device("cpu"))[0]
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loss_of(model, micro_batches[0]).backward()
    if late and rank == 1:
        time.sleep(1.0)  # a rank a little behind, as any rank sometimes is
    params = list(model.parameters()) if everything else [next(model.parameters())]
    works = [dist.all_reduce(p.grad, async_op=True) for p in params]
    if wait:
        for work in works:
            work.wait()
        for p in params:
            p.grad /= world_size
    finished_before_step = all(work.is_completed() for work in works)
    optimizer.step()
    for work in works:
        work.wait()  # before the next collective: only the step above was meant to race
    flat_weights = torch.cat([p.detach().flatten() for p in model.parameters()])
    first_weights = next(model.parameters()).detach().flatten()
    results[name] = {"rank_spread": spread_over_ranks(flat_weights),
                     "first_param_spread": spread_over_ranks(first_weights),
                     "finished_before_step": finished_before_step}

# 5. on_rank0 and on_all_ranks (the distributed init tests, sharing this launch): rank 0's answer
#    on every rank, and a failure on either rank
def fails_on(bad_rank):
    if rank == bad_rank:
        train_ddp.die(f"cannot read the file on rank {rank}")
    return "fine"


agreed = {"picked": train_ddp.on_rank0(lambda: f"picked by rank {rank}")}
for name, helper in [("on_rank0", train_ddp.on_rank0), ("on_all_ranks", train_ddp.on_all_ranks)]:
    for bad_rank in (0, 1):
        try:
            agreed[f"{name} failing on {bad_rank}"] = helper(fails_on, bad_rank)
        except train_ddp.UserError as error:
            agreed[f"{name} failing on {bad_rank}"] = "error: " + str(error)
results["agreed_per_rank"] = [None] * world_size
dist.all_gather_object(results["agreed_per_rank"], agreed)

if rank == 0:
    print("RESULT " + json.dumps(results), flush=True)
dist.barrier()
dist.destroy_process_group()
# the results are out: leave at once, before a C++ thread still alive at interpreter shutdown can
# abort us
os._exit(0)
"""


@pytest.fixture(scope="module")
def reducer_results(tmp_path_factory):
    script = tmp_path_factory.mktemp("reducer") / "reducer.py"
    script.write_text(f"REPO, TINY_MODEL = {str(REPO)!r}, {TINY_MODEL!r}\n" + REDUCER_SCRIPT)
    result = torchrun(2, script)
    return json.loads(re.search(r"^RESULT (.*)$", result.stdout, re.MULTILINE).group(1))


def test_inline_and_naive_reducers_give_the_gradients_and_weights_of_ddp(reducer_results):
    """Ranks start from different weights (each seeds its own): the reducers must broadcast rank
    0's."""
    for case in ["buckets", "no_accumulation", "one_bucket"]:
        result = reducer_results[case]
        assert result["gradient"] < 1e-6 and result["weights"] < 1e-6, (case, result)
        assert result["naive_gradient"] < 1e-6 and result["naive_weights"] < 1e-6, (case, result)
        assert result["rank_spread"] == 0 and result["naive_rank_spread"] == 0, (case, result)
    assert reducer_results["buckets"]["buckets"] >= 4 \
        and reducer_results["one_bucket"]["buckets"] == 1


def test_inline_reducer_starts_all_reduces_while_backward_still_computes(reducer_results):
    """In eager mode (the tests run uncompiled): when the first bucket's all-reduce starts,
    gradients of other buckets are still to come; with one bucket, nothing is left to overlap
    with."""
    pending = reducer_results["buckets"]["pending_at_launch"]
    assert pending[0] > 0 and pending == sorted(pending, reverse=True), pending
    assert reducer_results["one_bucket"]["pending_at_launch"] == [0]


def test_inline_reducer_gives_zeros_for_a_parameter_a_rank_did_not_use(reducer_results):
    """Used on rank 0 only: the mean of rank 0's gradient and rank 1's zeros, as
    DDP(find_unused_parameters=True). Used nowhere: a zero gradient (DDP leaves None)."""
    one = reducer_results["unused_on_rank_1"]
    assert one["used"] < 1e-6 and one["branch"] < 1e-6, one
    nowhere = reducer_results["unused_everywhere"]
    assert nowhere["branch_is_zero"] and nowhere["ddp_branch_is_none"] and nowhere["used"] < 1e-6, \
        nowhere


def test_bf16_compressed_gradients_stay_within_1_percent_and_training_still_converges(
        reducer_results):
    """bf16 keeps 8 significant bits: each rounding (each rank's gradient, then the sum) is off by
    at most 2^-9 relative. DDP's hook and the inline reducer compress alike."""
    bf16 = reducer_results["bf16"]
    assert 0 < bf16["vs_fp32"] < 1e-2, bf16  # > 0: the gradients really travelled as bf16
    assert bf16["inline_vs_torch"] < 1e-6, bf16
    assert bf16["losses"][-1] < 0.7 * bf16["losses"][0], bf16
    assert bf16["losses"][-1] == pytest.approx(bf16["fp32_losses"][-1], rel=0.01), bf16


def test_async_all_reduce_without_wait_leaves_ranks_with_different_weights(reducer_results):
    """The folk recipe (one parameter, async, no wait) leaves every other parameter unsynchronised;
    launching all of them but not waiting lets a rank step on its own gradient while a slower rank
    has not yet joined. With wait() (and the division by the world size) every rank holds the same
    weights."""
    folk, no_wait, with_wait = (reducer_results[name]
                                for name in ["folk_recipe", "no_wait", "with_wait"])
    assert folk["rank_spread"] > 1e-3, folk
    assert not no_wait["finished_before_step"] and no_wait["rank_spread"] > 1e-3, no_wait
    assert with_wait["finished_before_step"] and with_wait["rank_spread"] == 0, with_wait


def test_ddp_times_its_own_all_reduces_and_the_communication_backward_did_not_hide(trained_run):
    """dist.reducer=torch, the default (trained_run's 2 ranks): a comm hook around DDP's all-reduce
    gives the p50/p95 latency and the exposed communication, as the inline reducer's own wait does;
    numbers on gloo too."""
    for record in read_metrics(trained_run[0], "train"):
        assert 0 < record["allreduce_p50_ms"] <= record["allreduce_p95_ms"], record
        # the last bucket's all-reduce ends after backward: exposed, within the step's time
        assert 0 < record["comm_exposed_ms"] < 1000 / record["steps_per_sec"], record


# ---- train_ddp.py: checkpoints and resume --------------------------------------------------------

def test_resume_on_another_world_size_continues_from_the_same_sample(trained_run, data_dir,
                                                                     tmp_path):
    out, _ = trained_run
    moved = tmp_path / "one_rank"
    error, _ = train_in_process(f"data.dir={data_dir}", *EIGHT_STEPS, "model.dropout=0.0",
                                f"checkpoint.resume={out}/ckpt/step_000004", f"out_dir={moved}",
                                f"checkpoint.dir={moved}/ckpt")
    assert error is None, error
    state = torch.load(moved / "ckpt" / "step_000008" / "train_state.pt", weights_only=True)
    assert state["step"] == 8 and state["samples_seen"] == 8 * 16 and state["world_size"] == 1
    assert [t["step"] for t in read_metrics(moved, "train")] == [5, 6, 7, 8]


def test_checkpoints_are_ordered_by_step_number_and_old_ones_go_after_the_new_one_is_synced(
        tmp_path, monkeypatch):
    """As strings, step_999900 sorts after step_1000000: pruning would delete the newest
    checkpoints."""
    ckpt_dir = tmp_path / "ckpt"
    for name in ["step_999900", "step_1000000"]:
        (ckpt_dir / name).mkdir(parents=True)
        for file_name in train_ddp.CHECKPOINT_FILES:
            (ckpt_dir / name / file_name).write_bytes(b"")
        train_ddp.write_checksums(ckpt_dir / name, ["model.pt", "optimizer.pt", "train_state.pt"])
    (ckpt_dir / "step_notanumber").mkdir()
    assert [p.name for p in train_ddp.complete_checkpoints(ckpt_dir)] == ["step_999900",
                                                                          "step_1000000"]
    # no `latest` pointer: a scan
    assert train_ddp.find_resume_checkpoint(ckpt_dir, "auto").name == "step_1000000"
    events = []
    monkeypatch.setattr(train_ddp, "fsync_dir",
                        lambda path: events.append(("fsync", Path(path).name)))
    real_rmtree = shutil.rmtree
    monkeypatch.setattr(train_ddp.shutil, "rmtree",
                        lambda path: events.append(("delete", Path(path).name))
                        or real_rmtree(path))
    model = torch.nn.Linear(2, 2)
    train_ddp.write_checkpoint(ckpt_dir, 1000001, 2, model,
                               torch.optim.SGD(model.parameters(), lr=0.1), {"config": {"a": 1}})
    assert [p.name for p in train_ddp.complete_checkpoints(ckpt_dir)] == ["step_1000000",
                                                                          "step_1000001"]
    assert (ckpt_dir / "latest").read_text() == "step_1000001"
    assert events.index(("fsync", "ckpt")) < events.index(("delete", "step_999900"))


def test_corrupt_checkpoint_is_refused_and_left_untouched(trained_run, data_dir, tmp_path):
    out, _ = trained_run
    broken = tmp_path / "ckpt" / "step_000004"
    shutil.copytree(out / "ckpt" / "step_000004", broken)
    model_file = broken / "model.pt"
    model_file.write_bytes(model_file.read_bytes()[:1000])
    before = {p.name: p.read_bytes() for p in broken.iterdir()}
    error, _ = train_in_process(f"data.dir={data_dir}", *TINY_MODEL,
                                f"checkpoint.dir={tmp_path}/ckpt", f"out_dir={tmp_path}")
    assert "every checkpoint in" in error and "is damaged" in error
    assert {p.name: p.read_bytes() for p in broken.iterdir()} == before


def damage(path):
    data = bytearray(path.read_bytes())
    # one flipped bit pattern in the middle: the file still loads as a pickle archive
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def test_a_damaged_newest_checkpoint_is_passed_over_for_the_next_intact_one(trained_run, data_dir,
                                                                            tmp_path):
    out, _ = trained_run
    shutil.copytree(out / "ckpt", tmp_path / "ckpt")
    damage(tmp_path / "ckpt" / "step_000008" / "model.pt")
    error, printed = train_in_process(f"data.dir={data_dir}", *EIGHT_STEPS, "train.max_steps=5",
                                      f"out_dir={tmp_path}", f"checkpoint.dir={tmp_path}/ckpt",
                                      "export=false")
    assert error is None, error
    assert "step_000008 is damaged (model.pt does not match its checksum)" in printed
    assert "resumed from" in printed \
        and "step_000004" in printed.split("resumed from")[1].splitlines()[0]
    error, _ = train_in_process(f"data.dir={data_dir}", *EIGHT_STEPS,
                                f"checkpoint.resume={tmp_path}/ckpt/step_000008",
                                f"out_dir={tmp_path}/b", f"checkpoint.dir={tmp_path}/b/c")
    assert "step_000008 is damaged" in error


class RunsCode:
    """A pickle that would run a shell command when loaded by a loader that trusts it."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_a_checkpoint_holding_pickled_code_is_refused_and_the_code_never_runs(trained_run, data_dir,
                                                                              tmp_path):
    out, _ = trained_run
    shutil.copytree(out / "ckpt" / "step_000004", tmp_path / "ckpt" / "step_000004")
    marker = tmp_path / "code_ran"
    state_file = tmp_path / "ckpt" / "step_000004" / "train_state.pt"
    torch.save({"step": 4, "payload": RunsCode(marker)}, state_file)
    # passes the checksum
    train_ddp.write_checksums(state_file.parent, ["model.pt", "optimizer.pt", "train_state.pt"])
    error, _ = train_in_process(f"data.dir={data_dir}", *EIGHT_STEPS, f"out_dir={tmp_path}",
                                f"checkpoint.dir={tmp_path}/ckpt")
    assert "cannot load checkpoint" in error and "loading refuses them" in error, error
    assert not marker.exists()


def test_mismatched_model_shape_is_refused_on_resume(trained_run, data_dir, tmp_path):
    out, _ = trained_run
    error, _ = train_in_process(f"data.dir={data_dir}", *TINY_MODEL, "model.n_layer=3",
                                f"checkpoint.resume={out}/ckpt/step_000004", f"out_dir={tmp_path}",
                                f"checkpoint.dir={tmp_path}/c")
    assert "model.n_layer=2" in error and "model.n_layer=3" in error


@pytest.mark.parametrize("trainer", ["train_ddp.py", "train_fsdp.py"])
def test_a_changed_seq_len_is_refused_on_resume_naming_the_key(trainer, trained_run, fsdp_run,
                                                                 data_dir, tmp_path):
    """A new model has train.seq_len positions and the data position counts samples of it: a resume
    at another length fails on the weights (for FSDP in the sharded load) or reads other data."""
    out, steps = (trained_run[0], EIGHT_STEPS) if trainer == "train_ddp.py" else \
        (fsdp_run[0], FSDP_STEPS)
    error, _ = train_in_process(f"data.dir={data_dir}", *steps, "train.seq_len=32",
                                f"checkpoint.resume={out}/ckpt/step_000004", f"out_dir={tmp_path}",
                                f"checkpoint.dir={tmp_path}/c",
                                trainer=importlib.import_module(Path(trainer).stem))
    assert error and "was trained with train.seq_len=64, this run has train.seq_len=32 -> pass " \
        "train.seq_len=64" in error, error


def test_resuming_with_data_of_another_vocabulary_says_which_vocabularies_differ(
        trained_run, data_dir, corpus_dir, tmp_path):
    other = tmp_path / "other_data"
    assert run_preprocess("--input", str(corpus_dir), "--out", str(other),
                          "--vocab-size", "300").returncode == 0
    shutil.copytree(trained_run[0] / "ckpt", tmp_path / "ckpt")
    error, _ = train_in_process(f"data.dir={other}", *EIGHT_STEPS, "train.max_steps=9",
                                f"out_dir={tmp_path}", f"checkpoint.dir={tmp_path}/ckpt")
    vocab = json.loads((data_dir / "meta.json").read_text())["vocab_size"]
    new_vocab = json.loads((other / "meta.json").read_text())["vocab_size"]
    assert error and f"of {vocab:,} tokens' vocabulary, {other} has {new_vocab:,}" in error, error
    assert "-> give the data.dir it was trained on" in error


def test_resume_never_refuses_to_overwrite_existing_checkpoints(trained_run, data_dir, tmp_path):
    out, _ = trained_run
    error, _ = train_in_process(f"data.dir={data_dir}", *TINY_MODEL, "checkpoint.resume=never",
                                f"checkpoint.dir={out}/ckpt", f"out_dir={tmp_path}")
    assert "already holds checkpoints" in error


def test_resuming_an_older_checkpoint_next_to_newer_ones_is_refused(trained_run, data_dir,
                                                                    tmp_path):
    out, _ = trained_run
    before = sorted(p.name for p in (out / "ckpt").iterdir())
    error, _ = train_in_process(f"data.dir={data_dir}", *TINY_MODEL,
                                f"checkpoint.resume={out}/ckpt/step_000004",
                                f"checkpoint.dir={out}/ckpt", f"out_dir={tmp_path}")
    assert "holds checkpoints newer than" in error and "step_000008" in error
    assert sorted(p.name for p in (out / "ckpt").iterdir()) == before


def test_resume_says_what_changed_applies_it_and_at_max_steps_validates_and_exports(
        trained_run, data_dir, tmp_path):
    """A run stopped in its last step leaves its checkpoint at max_steps: the same command then
    ends the run (validation, the export), as the stop line says; a lower max_steps is refused."""
    out, _ = trained_run
    shutil.copytree(out / "ckpt", tmp_path / "ckpt")
    error, _ = train_in_process(f"data.dir={data_dir}", *EIGHT_STEPS, "train.max_steps=6",
                                f"out_dir={tmp_path}", f"checkpoint.dir={tmp_path}/ckpt")
    assert "is at step 8, past train.max_steps=6" in error
    error, printed = train_in_process(f"data.dir={data_dir}", *EIGHT_STEPS, f"out_dir={tmp_path}",
                                      f"checkpoint.dir={tmp_path}/ckpt")
    assert error is None and "no step left, the run's end follows" in printed, error
    assert [record["step"] for record in read_metrics(tmp_path, "val")] == [8]
    assert read_metrics(tmp_path, "train") == [] and (tmp_path / "final" / "config.json").is_file()
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) \
        == sorted(p.name for p in (out / "ckpt").iterdir())  # no checkpoint written or removed
    error, printed = train_in_process(f"data.dir={data_dir}", *EIGHT_STEPS, "optim.lr=5e-3",
                                      "train.max_steps=9", f"out_dir={tmp_path}",
                                      f"checkpoint.dir={tmp_path}/ckpt", "export=false")
    assert error is None, error
    assert "optim.lr 0.01 -> 0.005" in printed and "train.max_steps 8 -> 9" in printed
    cfg = train_ddp.load_config([*EIGHT_STEPS, "optim.lr=5e-3", "train.max_steps=9"],
                                use_cuda=False)
    assert read_metrics(tmp_path, "train")[-1]["lr"] \
        == pytest.approx(5e-3 * train_ddp.lr_factor(8, cfg))


def test_the_other_trainers_checkpoints_and_a_damaged_one_are_refused_not_overwritten(
        trained_run, tmp_path):
    """Each trainer counts only its own file set as complete: it would start at step 0 and replace
    the other's step_* directories as they came."""
    import train_fsdp
    out, _ = trained_run  # train_ddp.py's
    before = sorted(p.name for p in (out / "ckpt").iterdir())
    with pytest.raises(train_fsdp.UserError, match="not a complete checkpoint of this trainer "
                                                   r"\(train_ddp.py's, or damaged\)"):
        train_fsdp.find_resume_checkpoint(out / "ckpt", "auto")
    shards = tmp_path / "ckpt" / "step_000004"  # train_fsdp.py's layout
    shards.mkdir(parents=True)
    for name in train_fsdp.CHECKPOINT_FILES:
        (shards / name).write_bytes(b"")
    with pytest.raises(train_ddp.UserError, match="train_fsdp.py's, or damaged"):
        train_ddp.find_resume_checkpoint(tmp_path / "ckpt", "auto")
    assert sorted(p.name for p in (out / "ckpt").iterdir()) == before


def test_a_latest_pointer_older_than_the_newest_checkpoint_or_not_a_name_is_passed_over(
        trained_run, tmp_path):
    out, _ = trained_run
    ckpt = tmp_path / "ckpt"
    shutil.copytree(out / "ckpt", ckpt)
    for pointer in [b"step_000004", b"\xff", b"../../etc", str(out / "ckpt" / "step_000004")]:
        (ckpt / "latest").write_bytes(pointer if isinstance(pointer, bytes) else pointer.encode())
        assert train_ddp.find_resume_checkpoint(ckpt, "auto") == ckpt / "step_000008", pointer


@pytest.mark.parametrize("content, message", [
    (b"\xff\xfe train:", "is not UTF-8 text"),
    (b"train:\n  1: 2\n", "'train.1' in the config file is not a key name"),
    (b"true: 1\n", "'True' in the config file is not a key name"),
])
def test_a_config_file_that_is_not_text_or_has_keys_that_are_not_names_is_one_line(
        tmp_path, content, message):
    config = tmp_path / "bad.yaml"
    config.write_bytes(content)
    with pytest.raises(train_ddp.UserError, match=re.escape(message)):
        train_ddp.load_config([str(config)], use_cuda=False)


def test_a_seed_numpy_and_torch_cannot_take_is_refused_before_anything_starts():
    for seed in ["-1", "99999999999999999999"]:
        cfg = train_ddp.load_config([f"train.seed={seed}"], use_cuda=False)
        with pytest.raises(train_ddp.UserError, match=f"train.seed={seed} is out of range"):
            train_ddp.check_config(cfg, 1)


def test_a_load_error_whose_first_line_ends_in_a_colon_says_the_next_line_too():
    model, other = torch.nn.Linear(4, 2), torch.nn.Linear(4, 3)
    with pytest.raises(RuntimeError) as raised:
        model.load_state_dict(other.state_dict())
    assert "size mismatch for weight" in train_ddp.first_line(raised.value)


def test_a_model_type_given_beside_a_pretrained_model_of_another_type_is_refused(trained_run,
                                                                                  data_dir,
                                                                                  tmp_path):
    out, _ = trained_run  # its export: a gpt2
    error, _ = train_in_process(f"data.dir={data_dir}", f"model.pretrained={out}/final",
                                "model.type=llama", "train.max_steps=1", f"out_dir={tmp_path}",
                                f"checkpoint.dir={tmp_path}/ckpt")
    assert f"model.type=llama, but model.pretrained={out}/final is a gpt2" in error


def test_a_new_run_in_an_old_out_dir_keeps_the_old_records_aside_and_replaces_the_export(
        data_dir, tmp_path):
    args = [f"data.dir={data_dir}", *TINY_MODEL, "train.max_steps=2", "log.every=1",
            f"out_dir={tmp_path}"]
    assert train_in_process(*args, f"checkpoint.dir={tmp_path}/first")[0] is None
    first = (tmp_path / "metrics.jsonl").read_text()
    (tmp_path / "final" / "preprocessor_config.json").write_text("{}")  # as a ViT's export holds
    error, printed = train_in_process(*args, f"checkpoint.dir={tmp_path}/second")
    assert error is None and "held records past step 0" in printed, error
    aside = list(tmp_path.glob("metrics-*.jsonl"))
    assert len(aside) == 1 and aside[0].read_text() == first
    assert [record["step"] for record in read_metrics(tmp_path, "train")] == [1, 2]
    assert not (tmp_path / "final" / "preprocessor_config.json").exists()
    assert (tmp_path / "final" / "config.json").is_file()


def test_the_end_of_a_run_cannot_fail_after_training_on_the_sample_or_the_tokenizer(
        data_dir, tmp_path):
    """Found before the first step, or said in a line: never a traceback after the compute."""
    copy = tmp_path / "data"
    shutil.copytree(data_dir, copy)
    (copy / "tokenizer.json").unlink()
    error, _ = train_in_process(f"data.dir={copy}", *TINY_MODEL, "train.max_steps=1",
                                f"out_dir={tmp_path}/a", f"checkpoint.dir={tmp_path}/a/ckpt")
    assert "lacks its tokenizer file tokenizer.json" in error
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "final").write_text("a file where the export goes")
    error, _ = train_in_process(f"data.dir={data_dir}", *TINY_MODEL, "train.max_steps=1",
                                f"out_dir={tmp_path}/b", f"checkpoint.dir={tmp_path}/b/ckpt")
    assert "final is a file, where the export goes" in error
    error, printed = train_in_process(f"data.dir={data_dir}", *TINY_MODEL, "train.max_steps=1",
                                      "log.sample_tokens=0", f"out_dir={tmp_path}/c",
                                      f"checkpoint.dir={tmp_path}/c/ckpt")
    assert error is None and "no sample: log.sample_tokens=0" in printed, error
    assert (tmp_path / "c" / "final" / "config.json").is_file()
    error, printed = train_in_process(f"data.dir={data_dir}", *TINY_MODEL, "train.max_steps=1",
                                      f"log.sample_prompt={'word ' * 100}", f"out_dir={tmp_path}/d",
                                      f"checkpoint.dir={tmp_path}/d/ckpt")
    assert error is None and re.search(r"no sample: .* and the prompt's \d+ tokens leave 0 of the "
                                       "model's positions", printed), error


def test_ranks_that_do_not_share_checkpoint_dir_are_stopped_before_training(data_dir, tmp_path):
    """Two torchrun "nodes" on this machine, each in its own working directory: a relative
    checkpoint.dir is then a different directory on each, as a node-local disk would be."""
    port = free_port()
    processes = []
    for node in (0, 1):
        (tmp_path / f"node{node}").mkdir()
        command = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2",
                   "--node-rank", str(node), "--nproc-per-node", "1", "--master-addr", "127.0.0.1",
                   "--master-port", str(port), str(REPO / "train_ddp.py"), f"data.dir={data_dir}",
                   *EIGHT_STEPS, "checkpoint.dir=ckpt", "out_dir=out"]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
        processes.append(subprocess.Popen(command, cwd=tmp_path / f"node{node}", env=env,
                                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                          text=True))
    outputs = [process.communicate(timeout=240)[0] for process in processes]
    assert all(process.returncode != 0 for process in processes)
    errors = [line for line in outputs[0].splitlines() if line.startswith("error:")]
    assert errors and "rank 1: checkpoint.dir=ckpt is not the directory rank 0 writes to" \
        in errors[0], outputs[0]
    assert not (tmp_path / "node0" / "out" / "metrics.jsonl").exists()


# ---- train_ddp.py: validation --------------------------------------------------------------------

def test_launch_trains_on_two_processes_and_the_validation_loss_falls(trained_run):
    out, result = trained_run
    assert "world size 2 (gloo, cpu)" in result.stdout
    for check in ["python and torch", "cuda", "config", "data", "checkpoint dir", "master port"]:
        assert any(line.startswith(check) and " ok" in line
                   for line in result.stdout.splitlines()), check
    val = read_metrics(out, "val")
    assert [v["step"] for v in val] == [0, 4, 8]
    assert val[-1]["val_loss"] < 0.8 * val[0]["val_loss"]
    train = read_metrics(out, "train")
    assert [t["step"] for t in train] == list(range(1, 9))
    assert all({"loss", "grad_norm", "lr", "tokens_per_sec"} <= set(t) for t in train)
    # the rate each step used: warmup_steps=2 gives steps 1 and 2 half and all of optim.lr=1e-2
    assert [t["lr"] for t in train[:2]] == pytest.approx([5e-3, 1e-2])
    assert sorted(p.name for p in (out / "ckpt").glob("step_*")) == ["step_000004", "step_000008"]
    assert (out / "ckpt" / "latest").read_text() == "step_000008"
    # the memory prediction from counts and dtypes (16 bytes per fp32 parameter) against the tensors
    # that exist
    [memory] = read_metrics(out, "memory")
    assert memory["step"] == 2 and memory["predicted_bytes"] == memory["held_bytes"] > 0
    assert memory["predicted_optimizer_bytes"] == 2 * memory["predicted_weights_bytes"]
    # every rank's stderr of the (only) attempt is kept for launch.sh's failure report
    assert len(list((out / "logs").glob("*/*/attempt_0/[01]/stderr.log"))) == 2


# ---- train_ddp.py: export ------------------------------------------------------------------------

def test_exported_model_and_tokenizer_load_with_transformers(trained_run):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    out, result = trained_run
    model = AutoModelForCausalLM.from_pretrained(out / "final")
    tokenizer = AutoTokenizer.from_pretrained(out / "final")
    ids = tokenizer("def alpha_0(x, y):", return_tensors="pt").input_ids
    assert tokenizer.decode(ids[0]) == "def alpha_0(x, y):"
    assert model(ids).logits.shape[-1] % 64 == 0
    assert "sample:" in result.stdout


def test_exported_model_trains_further_as_model_pretrained(trained_run, data_dir, tmp_path):
    out, _ = trained_run
    error, _ = train_in_process(f"data.dir={data_dir}", f"model.pretrained={out}/final",
                                *TINY_MODEL, "train.max_steps=2", "train.global_batch_size=16",
                                "train.micro_batch_size=8", f"out_dir={tmp_path}",
                                f"checkpoint.dir={tmp_path}/ckpt")
    assert error is None, error
    first_val = read_metrics(tmp_path, "val")[0]["val_loss"]
    # starts where it ended
    assert first_val == pytest.approx(read_metrics(out, "val")[-1]["val_loss"], rel=1e-4)


def test_a_pretrained_model_of_another_tokenizer_than_the_data_is_refused_and_the_fix_works(
        trained_run, corpus_dir, tmp_path):
    out, _ = trained_run
    other, same = tmp_path / "other", tmp_path / "same"
    assert run_preprocess("--input", corpus_dir, "--out", other, "--vocab-size", 300) \
        .returncode == 0
    args = [f"model.pretrained={out}/final", *TINY_MODEL, "train.max_steps=1",
            "train.global_batch_size=16", "train.micro_batch_size=8", "checkpoint.every=0",
            "export=false", f"out_dir={tmp_path}/out", f"checkpoint.dir={tmp_path}/ckpt"]
    error, _ = train_in_process(f"data.dir={other}", *args)
    assert error and f"{out}/final has another tokenizer than {other} -> prepare the data with " \
        f"it: python preprocess.py --tokenizer {out}/final/tokenizer.json --out NEW_DIR" in error
    assert run_preprocess("--input", corpus_dir, "--out", same, "--tokenizer",
                          f"{out}/final/tokenizer.json").returncode == 0
    error, _ = train_in_process(f"data.dir={same}", *args)
    assert error is None, error


# ---- train_ddp.py: stops, signals, locks ---------------------------------------------------------

def process_env(pid):
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return {}
    return dict(item.split("=", 1) for item in raw.decode(errors="replace").split("\0")
                if "=" in item)


def fork(function):
    """Start function() in a process forked from this one: a process of its own, with torch and the
    trainers imported already (a new interpreter spends seconds importing them). Returns its PID
    and a pipe of what it prints; it exits when function returns, 1 if it raised."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never back into pytest
        code = 1
        try:
            os.close(read_end)
            for fd in (1, 2):
                os.dup2(write_end, fd)
            sys.stdout = sys.stderr = open(1, "w", buffering=1, closefd=False)
            function()
            code = 0
        except BaseException:
            traceback.print_exc()
        finally:
            sys.stdout.flush()
            os._exit(code)
    os.close(write_end)
    return pid, os.fdopen(read_end)


def wait_forked(pid, output, timeout=120):
    """(exit status as subprocess gives it, what it printed) of a process started by fork()."""
    deadline = time.monotonic() + timeout
    while (status := os.waitpid(pid, os.WNOHANG))[0] == 0:
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            pytest.fail(f"timed out after {timeout} s: {output.read()[-3000:]}")
        time.sleep(0.05)
    return os.waitstatus_to_exitcode(status[1]), output.read()


# the arguments of nans_then_sigterm_run
NANS_THEN_STOP = [*EIGHT_STEPS, "train.max_steps=100000", "log.every=2", "checkpoint.every=2",
                  "checkpoint.keep=100"]


@pytest.fixture(scope="module")
def nans_then_sigterm_run(data_dir, tmp_path_factory):
    """2 ranks, a checkpoint every 2 steps: a NaN on rank 1 at step 3 and on rank 0 at step 4 (the
    faults tests read it), then SIGTERM to rank 1 alone once step 6 is logged. Returns (out_dir,
    exit code, output)."""
    out = tmp_path_factory.mktemp("nans_then_sigterm")
    ranks = Ranks(2, "train_ddp.py", f"data.dir={data_dir}", *NANS_THEN_STOP, f"out_dir={out}",
                  f"checkpoint.dir={out}/ckpt", env_extra={"FAULT": "nan:1:3,nan:0:4"})
    try:
        ranks.read_until("step 6/")
        os.kill(ranks.pids[1], signal.SIGTERM)
        result = ranks.wait(timeout=120)
    finally:
        ranks.kill()
    return out, result.returncode, result.stdout + result.stderr


def test_sigterm_to_one_rank_stops_every_rank_at_the_same_step_with_a_checkpoint(
        nans_then_sigterm_run, data_dir):
    """A preemption notice may reach one process only: rank 1 gets SIGTERM, every rank stops after
    the same step, the checkpoint of that step is written, the job exits non-zero, and a new start
    resumes from it."""
    out, returncode, text = nans_then_sigterm_run
    assert returncode != 0
    stopped = re.search(r"^stopped at step (\d+) by a stop signal", text, re.MULTILINE)
    assert stopped, text[-3000:]
    step = int(stopped.group(1))
    assert train_ddp.checksum_mismatch(out / "ckpt" / f"step_{step:06d}") is None
    args = [a for a in NANS_THEN_STOP if not a.startswith("train.max_steps")]
    error, printed = train_in_process(f"data.dir={data_dir}", *args, f"train.max_steps={step + 1}",
                                      f"out_dir={out}/resumed", f"checkpoint.dir={out}/ckpt",
                                      "export=false")
    assert error is None and f"resumed from {out}/ckpt/step_{step:06d}" in printed, \
        (error, printed)


def test_a_stopped_run_names_the_command_that_resumes_it_even_after_checkpoint_resume_never(
        data_dir, tmp_path, monkeypatch):
    args = [f"data.dir={data_dir}", *EIGHT_STEPS, "checkpoint.resume=never", f"out_dir={tmp_path}",
            f"checkpoint.dir={tmp_path}/ckpt", "export=false"]
    with monkeypatch.context() as patch:  # a SIGTERM during step 3
        patch.setattr(train_ddp, "fault_point",
                      lambda step: step == 3 and os.kill(os.getpid(), signal.SIGTERM))
        with pytest.raises(train_ddp.Stopped) as stopped:
            train_in_process(*args)
    message = str(stopped.value)
    del stopped  # its traceback holds the run's lock on checkpoint.dir
    gc.collect()
    assert f"checkpoint {tmp_path}/ckpt/step_000003 is written" in message
    # the same command would refuse the checkpoint it wrote (resume=never)
    added = re.search(r"-> run the same command with (\S+) added", message)
    assert added, message
    error, printed = train_in_process(*args, added.group(1))
    assert error is None and f"resumed from {tmp_path}/ckpt/step_000003" in printed, error


def processes_of(port):
    """The PIDs of the processes of one launch: torchrun and its workers, found by their master
    port."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and entry.name != str(os.getpid()):
            with contextlib.suppress(OSError):
                command = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
                if f"--master-port {port}" in command \
                        or process_env(entry.name).get("MASTER_PORT") == str(port):
                    found.append(int(entry.name))
    return found


def launch_training(tmp_path, *args, script="train_ddp.py", env_extra=None):
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "NPROC_PER_NODE": "2",
           "MASTER_PORT": str(port), "LOG_DIR": str(tmp_path / "logs"), **(env_extra or {})}
    command = ["bash", "launch.sh", script, *args]
    return subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True), port


def read_until(process, prefix, output, timeout=180):
    deadline = time.monotonic() + timeout
    for line in process.stdout:
        output.append(line)
        if line.startswith(prefix) or time.monotonic() > deadline:
            return
    pytest.fail("".join(output)[-3000:])


@pytest.mark.parametrize("trainer", TRAINERS)
def test_a_preemption_signalling_launch_torchrun_and_every_worker_twice_stops_after_one_checkpoint(
        trainer, data_dir, tmp_path):
    """Slurm signals every process of a job step at once, and torchrun passes its own signal on:
    every worker gets two or more. Every rank must still finish its step and write one checkpoint of
    that step; the job exits 3 (stopped) with the trainer's line, and the same arguments resume
    there. train_fsdp.py writes its checkpoints in the background here: the stop's must be published
    all the same."""
    args = [f"data.dir={data_dir}", *EIGHT_STEPS, "train.max_steps=100000", "checkpoint.every=3",
            f"out_dir={tmp_path}", f"checkpoint.dir={tmp_path}/ckpt",
            *(["checkpoint.async_save=true"] if trainer == "train_fsdp.py" else [])]
    launch, port = launch_training(tmp_path, *args, script=trainer)
    output, reader = [], None
    try:
        read_until(launch, "step 5/", output)
        everyone = [launch.pid, *processes_of(port)]
        assert len(everyone) >= 4, everyone  # launch.sh, torchrun, 2 workers
        for round_ in range(2):  # twice within a minute, as Slurm's notice and torchrun's come
            time.sleep(round_)
            for pid in everyone:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGTERM)
        # bounded: a launch.sh gone before torchrun would leave torchrun's log stream open for ever
        reader = threading.Thread(target=lambda: output.extend(launch.stdout.readlines()),
                                  daemon=True)
        reader.start()
        reader.join(timeout=150)
        launch.wait(timeout=120)
        survivors = [pid for pid in processes_of(port) if is_running(pid)]
    finally:
        for pid in processes_of(port):  # torchrun too, should launch.sh have left it running
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        kill_process_tree(launch.pid)
        if reader is not None:
            reader.join(timeout=10)
    text = "".join(output)
    assert launch.returncode == 3 and not survivors, (survivors, text[-3000:])
    stopped = re.search(r"^stopped at step (\d+) by a stop signal; checkpoint \S+ is written", text,
                        re.MULTILINE)
    assert stopped, text[-3000:]
    step = int(stopped.group(1))
    assert train_ddp.checksum_mismatch(tmp_path / "ckpt" / f"step_{step:06d}") is None
    assert not list((tmp_path / "ckpt").glob(".tmp-*")), "every checkpoint it started is published"
    assert "Traceback" not in text.split("stopped at step")[0][-2000:]
    # the same arguments resume there; in this process, on one rank: a sharded checkpoint is then
    # read whole
    error, printed = train_in_process(*[a for a in args if not a.startswith("train.max_steps")],
                                      f"train.max_steps={step + 1}", "export=false",
                                      trainer=importlib.import_module(Path(trainer).stem))
    assert error is None and f"resumed from {tmp_path}/ckpt/step_{step:06d}" in printed, \
        (error, printed[-2000:])


def test_stop_signals_within_a_minute_repeat_the_first_and_a_later_one_stops_at_once_and_says_so():
    def signalled():
        train_ddp.STOP_REPEAT_S = 1.0  # a minute in the trainer (this process's copy alone)
        requested = []
        train_ddp.catch_stop_signals(requested)
        for number in (signal.SIGTERM, signal.SIGINT, signal.SIGTERM):  # Slurm's, torchrun's, more
            os.kill(os.getpid(), number)
        print("requested", [name for name, _ in requested], flush=True)
        time.sleep(1.5)
        os.kill(os.getpid(), signal.SIGTERM)  # past the window: at once
        time.sleep(5)
        print("still running", flush=True)

    code, output = wait_forked(*fork(signalled))
    assert "requested ['SIGTERM']" in output and "still running" not in output, output
    assert code == -signal.SIGTERM, (code, output)
    assert "stopped at once by a second SIGTERM" in output and "no checkpoint" in output


CTRL_C_IN = """import ast, os, signal, sys
sys.path.insert(0, {repo!r})
import {trainer} as trainer
original = getattr(trainer, {function!r})
def interrupted(*args, **kwargs):  # Ctrl-C reaches the process as it enters this function
    os.kill(os.getpid(), signal.SIGINT)
    return original(*args, **kwargs)
setattr(trainer, {function!r}, interrupted)
source = open(trainer.__file__).read()
ending = ast.Module(body=[ast.parse(source).body[-1]], type_ignores=[])  # if __name__ == "__main__"
sys.argv[0], trainer.__name__ = "{trainer}.py", "__main__"
exec(compile(ending, trainer.__file__, "exec"), vars(trainer))
"""


@pytest.mark.parametrize("trainer", ["train_ddp", "train_fsdp"])
@pytest.mark.parametrize("function", ["build_model", "validate"])
def test_ctrl_c_in_setup_is_one_line_and_in_the_first_validation_a_stop_with_a_checkpoint(
        trainer, function, data_dir, tmp_path):
    """Before the stop handler (building the model) nothing is trained: one line, exit 130. From
    the step-0 validation on it is a stop: step 1 ends, its checkpoint is written, exit 3."""
    wrapper = tmp_path / "wrapper.py"
    wrapper.write_text(CTRL_C_IN.format(repo=str(REPO), trainer=trainer, function=function))
    result = run([sys.executable, wrapper, f"data.dir={data_dir}", *EIGHT_STEPS,
                  f"out_dir={tmp_path}/out", f"checkpoint.dir={tmp_path}/ckpt"], timeout=180)
    assert "Traceback" not in result.stderr, result.stderr
    if function == "build_model":
        assert result.returncode == 130, result.stdout + result.stderr
        assert result.stderr.strip().splitlines()[-1] == \
            "stopped by Ctrl-C before the first step: nothing was saved"
        assert not (tmp_path / "ckpt").exists() or not list((tmp_path / "ckpt").glob("step_*"))
    else:
        assert result.returncode == train_ddp.EXIT_STOPPED, result.stdout + result.stderr
        assert "stopped at step 1 by a stop signal; checkpoint" in result.stderr
        assert (tmp_path / "ckpt" / "step_000001").is_dir()


def test_a_second_run_on_a_checkpoint_dir_in_use_stops_at_once_and_the_first_run_ends_as_if_alone(
        trained_run, data_dir, tmp_path):
    """A requeued job, or a typo, starts a second run on the directory of one still running: the
    second stops before it touches anything, naming the holder; the first ends with the weights of
    the same run alone. The first run's workers are paused (SIGSTOP) while the second runs: still
    alive and holding the lock however long the second takes to start, which no fixed slowdown of
    the first could promise. The second runs in this process: rank 0 takes the lock and hands its
    error to every rank (on_rank0, tested on its own), so one rank shows what each would do."""
    first = Ranks(2, "train_ddp.py", f"data.dir={data_dir}", *EIGHT_STEPS, "model.dropout=0.1",
                  "dist.timeout_s=600", f"out_dir={tmp_path}/first",
                  f"checkpoint.dir={tmp_path}/ckpt")
    try:
        first.read_until("step 1/")  # rank 0 has held the lock since before step 0's validation
        for pid in first.pids:
            os.kill(pid, signal.SIGSTOP)
        error, _ = train_in_process(f"data.dir={data_dir}", *EIGHT_STEPS,
                                    f"out_dir={tmp_path}/second", f"checkpoint.dir={tmp_path}/ckpt")
        for pid in first.pids:
            os.kill(pid, signal.SIGCONT)
        result = first.wait(timeout=240)
    finally:
        for pid in first.pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
        first.kill()
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert error and f"{tmp_path}/ckpt is in use by another run (host {socket.gethostname()}, " \
        f"PID" in error and "-> wait for it to end" in error, error
    assert not (tmp_path / "second").exists()
    alone = final_weights(trained_run[0] / "ckpt" / "step_000008")
    together = final_weights(tmp_path / "ckpt" / "step_000008")
    assert all(torch.equal(alone[name], together[name]) for name in alone)


def test_a_holder_that_died_never_blocks_the_directory(tmp_path):
    def hold():
        lock = train_ddp.hold_directory(tmp_path, True)
        print("held" if lock else "not held", flush=True)
        time.sleep(60)

    holder, output = fork(hold)
    try:
        assert output.readline().strip() == "held"
        with pytest.raises(train_ddp.UserError, match=r"in use by another run \(host .*, PID "
                                                      rf"{holder}, since"):
            train_ddp.hold_directory(tmp_path, True)
    finally:
        os.kill(holder, signal.SIGKILL)  # as kill -9 or a crash would
        os.waitpid(holder, 0)
    assert train_ddp.hold_directory(tmp_path, True) is not None


def test_a_second_run_on_an_out_dir_in_use_stops_before_it_touches_the_metrics(tmp_path):
    """Two runs with one out_dir but their own checkpoint.dir (or none) would interleave
    metrics.jsonl and each export over the other's: the second stops. A dead holder blocks
    nothing."""
    (tmp_path / "metrics.jsonl").write_text('{"kind": "start", "step": 0}\n{"step": 5}\n')

    def hold():
        metrics = train_ddp.open_metrics(tmp_path, 5)
        print("held" if metrics else "not held", flush=True)
        time.sleep(60)

    holder, output = fork(hold)
    try:
        assert output.readline().strip() == "held"
        with pytest.raises(train_ddp.UserError, match=f"{tmp_path} is in use by another run"):
            train_ddp.open_metrics(tmp_path, 0)
        assert '{"step": 5}' in (tmp_path / "metrics.jsonl").read_text()  # not copied aside
    finally:
        os.kill(holder, signal.SIGKILL)
        os.waitpid(holder, 0)
    train_ddp.open_metrics(tmp_path, 0).close()
    assert list(tmp_path.glob("metrics-*.jsonl"))


@pytest.fixture()
def small_disk(request, tmp_path):
    """A tmpfs where one tiny model's checkpoint fits and a second beside it does not (DDP's is
    about 530 KB, FSDP's sharded one about 950 KB)."""
    mount_point = tmp_path / "disk"
    mount_point.mkdir()
    trainer = request.node.callspec.params["trainer"]
    size = {"train_ddp.py": "800k", "train_fsdp.py": "1400k"}[trainer]
    if subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs",
                       str(mount_point)]).returncode:
        pytest.skip("mounting a tmpfs needs root")
    yield mount_point
    subprocess.run(["umount", "-l", str(mount_point)])


@pytest.mark.parametrize("trainer", TRAINERS)
def test_a_full_disk_during_a_checkpoint_is_one_line_and_restarts_do_not_retry_it(
        trainer, small_disk, data_dir, tmp_path):
    """The step-2 checkpoint fits, the step-4 one does not: one line naming the directory, its free
    space and what a checkpoint needs; no temporary files left; step 2's checkpoint intact and the
    one to resume from. torchrun's restarts end at once with the same line instead of training
    again: two for train_ddp.py (the second finds what the first left), one for train_fsdp.py, whose
    restarts end in the same code before main() (ended_attempt, the same source in both
    trainers)."""
    restarts = 2 if trainer == "train_ddp.py" else 1
    result = torchrun(2, trainer, f"data.dir={data_dir}", *EIGHT_STEPS, "checkpoint.every=2",
                      "export=false", f"out_dir={tmp_path}/out",
                      f"checkpoint.dir={small_disk}/ckpt", must_pass=False, max_restarts=restarts)
    output = result.stdout + result.stderr
    errors = [line for line in output.splitlines() if line.startswith("error:")]
    assert errors and errors[0].startswith(
        f"error: cannot write checkpoint to {small_disk}/ckpt"), output[-3000:]
    assert re.search(r"MiB free there, a checkpoint needs about [\d.,]+ MiB -> free disk space",
                     errors[0]), errors[0]
    # the first attempt, then the restarts, alike
    assert errors == [errors[0]] * (1 + restarts), errors
    assert not re.search(r'File ".*(train_ddp|train_fsdp)\.py", line', output), output[-3000:]
    assert sorted(p.name for p in (small_disk / "ckpt").iterdir()
                  if p.name != ".lock") == ["latest", "step_000002"]
    assert train_ddp.checksum_mismatch(small_disk / "ckpt" / "step_000002") is None
    # no step trained again
    assert [r["step"] for r in read_metrics(tmp_path / "out", "train")][-1] == 4


# ---- train_ddp.py: metrics and logging -----------------------------------------------------------

METRIC_KEYS = ["gpu_util", "mem_alloc_gib", "mem_reserved_gib", "mem_peak_gib", "alloc_retries",
               "steps_per_sec", "tokens_per_sec", "mfu", "grad_norm", "allreduce_p50_ms",
               "allreduce_p95_ms", "comm_exposed_ms", "data_wait_frac", "step_time_skew"]


def test_a_run_whose_stdout_reader_leaves_trains_on_to_its_end(data_dir, tmp_path):
    """`... | head`: the reader of stdout leaves early; a print then raises BrokenPipeError, which
    must not end the run (nor a restart under launch.sh, which would meet the same pipe)."""
    command = [sys.executable, "train_ddp.py", f"data.dir={data_dir}", *TINY_MODEL,
               "train.global_batch_size=8", "train.micro_batch_size=4", "train.max_steps=6",
               "log.every=1", "train.eval_every=3", "checkpoint.every=0", "export=true",
               f"out_dir={tmp_path}", f"checkpoint.dir={tmp_path}/ckpt"]
    first, code, stderr = reader_leaves_after_one_line(command)
    assert first and code == 0, stderr[-3000:]
    assert "Traceback" not in stderr and "BrokenPipeError" not in stderr, stderr[-3000:]
    assert [record["step"] for record in read_metrics(tmp_path, "train")] == [1, 2, 3, 4, 5, 6]
    assert (tmp_path / "final" / "config.json").is_file()  # exported after the pipe broke


def test_every_log_line_holds_the_metrics_and_tensorboard_the_same_numbers(trained_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    out, result = trained_run
    train = read_metrics(out, "train")
    for record in train:
        assert set(METRIC_KEYS) <= set(record), set(METRIC_KEYS) - set(record)
        assert all(record[key] is None for key in ["gpu_util", "mem_alloc_gib", "alloc_retries",
                                                   "mfu"])  # CPU: no GPU figures
        # 16 sequences of 64 tokens per step, one step per log line
        assert record["tokens_per_sec"] / record["steps_per_sec"] == pytest.approx(16 * 64)
        assert 0 <= record["data_wait_frac"] < 1 and record["step_time_skew"] >= 1
        assert 0 < record["grad_norm"] < math.inf
    # the console line says what the file holds: the step's skew and the slowest rank
    last = train[-1]
    assert re.search(rf"^step 8/8 \| .* \| data \d+\.\d% \| skew {last['step_time_skew']:.2f} "
                     rf"\(rank {last['slowest_rank']}\) \| ETA", result.stdout, re.M), last
    events = EventAccumulator(str(out / "tensorboard")).Reload()
    for key in ["loss", "tokens_per_sec", "data_wait_frac", "step_time_skew"]:
        logged = [(r["step"], r[key]) for r in train]
        written = [(event.step, event.value) for event in events.Scalars(f"train/{key}")]
        # float32 there
        assert written == [(step, pytest.approx(value, rel=1e-6)) for step, value in logged], key
    assert [event.value for event in events.Scalars("val/val_loss")] == pytest.approx(
        [r["val_loss"] for r in read_metrics(out, "val")], rel=1e-6)


def scrape(port):
    """{metric name: value} of one Prometheus endpoint, or None while it does not answer."""
    import urllib.request
    try:
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    except OSError:
        return None
    return {line.split("{")[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
            if line.startswith("trainer_")}


def test_prometheus_answers_during_a_run_with_the_logged_numbers_and_a_slow_rank_shows_as_skew(
        data_dir, tmp_path):
    """Rank 1 takes 2 s more to build its batches in step 3: rank 0 waits for it at the step's sync,
    so the interval of steps 3-4 names rank 1 slowest, with a large data wait. Both ranks stop
    (hang) in step 5, so each endpoint holds step 4's numbers while the test reads them."""
    port = free_port()
    ranks = Ranks(2, "train_ddp.py", f"data.dir={data_dir}", *EIGHT_STEPS, "log.every=2",
                  "checkpoint.every=0", "train.eval_every=100", f"log.prometheus_port={port}",
                  f"out_dir={tmp_path}", f"checkpoint.dir={tmp_path}/ckpt",
                  env_extra={"FAULT": "slow:1:3,hang:0:5,hang:1:5"})
    try:
        deadline, scraped = time.monotonic() + 240, [None, None]
        while not all(s and s.get("trainer_step") == 4 for s in scraped):
            assert ranks.poll() is None and time.monotonic() < deadline, \
                ranks.output()[-3000:] + ranks.output("err")[-3000:]
            time.sleep(0.5)
            scraped = [scrape(port), scrape(port + 1)]
    finally:
        ranks.kill()
    record = {r["step"]: r for r in read_metrics(tmp_path, "train")}[4]
    numbers = {f"trainer_{key}": value for key, value in record.items()
               if isinstance(value, (int, float))}
    val = read_metrics(tmp_path, "val")[0]
    assert scraped[0].pop("trainer_val_loss") == pytest.approx(val["val_loss"], rel=1e-12)
    assert scraped[0].pop("trainer_val_accuracy") == pytest.approx(val["val_accuracy"], rel=1e-12)
    # step 2's memory accounting is a gauge of its own too
    [memory] = read_metrics(tmp_path, "memory")
    for key in [key for key in memory if key.endswith("_bytes")]:
        assert scraped[0].pop(f"trainer_{key}") == memory[key], key
    # rank 0's gauges: the logged record, number for number
    assert scraped[0] == pytest.approx(numbers, rel=1e-12)
    # null on a CPU: no gauge
    assert "trainer_mfu" not in scraped[0] and "trainer_gpu_util" not in scraped[0]
    for name in ["trainer_loss", "trainer_grad_norm", "trainer_data_wait_frac",
                 "trainer_step_time_skew"]:
        # the same on every rank
        assert scraped[1][name] == pytest.approx(numbers[name], rel=1e-12), name
    assert record["slowest_rank"] == 1
    # rank 0 waited about 2 s of an interval of 2 s + two tiny steps: its busy time is a fraction of
    # rank 1's
    assert record["step_time_skew"] > 1.5 and record["data_wait_frac"] > 0.5, record


def test_metrics_run_without_tensorboard_prometheus_client_and_pynvml(data_dir, tmp_path,
                                                                      monkeypatch):
    for name in ["tensorboard", "torch.utils.tensorboard", "prometheus_client", "pynvml"]:
        # import now raises ImportError, as if not installed
        monkeypatch.setitem(sys.modules, name, None)
    error, printed = train_in_process(f"data.dir={data_dir}", *EIGHT_STEPS, "train.max_steps=2",
                                      "checkpoint.every=0", "export=false",
                                      f"log.prometheus_port={free_port()}", f"out_dir={tmp_path}",
                                      f"checkpoint.dir={tmp_path}/ckpt")
    assert error is None, error
    assert "note: no TensorBoard logs: tensorboard is not installed" in printed
    assert "note: no Prometheus endpoint: prometheus_client is not installed" in printed
    assert [r["step"] for r in read_metrics(tmp_path, "train")] == [1, 2] \
        and not (tmp_path / "tensorboard").exists()
    # a GPU without pynvml: no utilisation, one note, no error
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda device: pytest.fail("NVML is not there"))
    with contextlib.redirect_stdout(io.StringIO()) as note:
        assert train_ddp.gpu_util_reader(torch.device("cuda", 0), enabled=True) is None
    assert "pip install nvidia-ml-py" in note.getvalue()


def test_gpu_utilisation_is_read_for_this_process_gpu_by_uuid(monkeypatch):
    """CUDA_VISIBLE_DEVICES=3,1 makes the machine's GPU 3 cuda:0; NVML knows it as index 3. The
    handle must come from the device's UUID, never from CUDA's index."""
    import types
    fake = types.ModuleType("pynvml")
    fake.NVMLError = type("NVMLError", (Exception,), {})
    utilisation = {"GPU-cccc": 97, "GPU-bbbb": 5}
    fake.nvmlInit = lambda: None
    fake.nvmlDeviceGetHandleByUUID = lambda uuid: uuid
    fake.nvmlDeviceGetHandleByIndex = lambda index: pytest.fail("looked up by index")
    fake.nvmlDeviceGetUtilizationRates = lambda handle: types.SimpleNamespace(
        gpu=utilisation[handle])
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    uuids = {0: "cccc", 1: "bbbb"}  # what CUDA reports for cuda:0 and cuda:1
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda device: types.SimpleNamespace(uuid=uuids[device.index]))
    assert train_ddp.gpu_util_reader(torch.device("cuda", 0), enabled=True)() == 97
    assert train_ddp.gpu_util_reader(torch.device("cuda", 1), enabled=True)() == 5
    # log.gpu_util=false
    assert train_ddp.gpu_util_reader(torch.device("cuda", 0), enabled=False) is None
    assert train_ddp.gpu_util_reader(torch.device("cpu"), enabled=True) is None


def test_span_timer_on_a_gpu_sums_event_pairs_and_reuses_its_events(monkeypatch):
    """The GPU path without a GPU: fake CUDA events that read a fake clock."""
    clock, created = iter([1.0, 1.5, 2.0, 2.25, 3.0, 3.125]), []

    class FakeEvent:
        def __init__(self, enable_timing):
            assert enable_timing
            created.append(self)

        def record(self):
            self.at = next(clock)

        def elapsed_time(self, end):
            return (end.at - self.at) * 1e3  # milliseconds, as CUDA's

    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    timer = train_ddp.SpanTimer(torch.device("cuda", 0))
    for _ in range(2):
        with timer:
            pass
    assert timer.total_s() == 0.75 and len(created) == 4
    with timer:
        pass
    # the second interval's span reused a pair
    assert timer.total_s() == 0.125 and len(created) == 4


def test_mfu_peak_is_looked_up_by_exact_gpu_name_only(monkeypatch):
    gpu = torch.device("cuda", 0)
    for name, expected in [("NVIDIA H200", 989e12), ("NVIDIA H100 80GB HBM3", 989e12),
                           ("NVIDIA H100 PCIe", 756e12), ("NVIDIA L40", None),
                           ("NVIDIA H100 NVL", None), ("NVIDIA RTX A1000", None)]:
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None, value=name: value)
        assert train_ddp.peak_flops_per_gpu(gpu, peak_tflops=0) == expected, name
    # log.peak_tflops names any GPU, with a datasheet's fraction (an RTX 4090: 165.2)
    assert train_ddp.peak_flops_per_gpu(gpu, peak_tflops=100) == 100e12
    peak = train_ddp.load_config(["log.peak_tflops=165.2"], use_cuda=True).log.peak_tflops
    assert train_ddp.peak_flops_per_gpu(gpu, peak) == pytest.approx(165.2e12)
    assert train_ddp.peak_flops_per_gpu(torch.device("cpu"), peak_tflops=0) is None


def test_a_taken_prometheus_port_is_a_one_line_error(data_dir, tmp_path, busy_port):
    error, _ = train_in_process(f"data.dir={data_dir}", *EIGHT_STEPS,
                                f"log.prometheus_port={busy_port}", f"out_dir={tmp_path}",
                                f"checkpoint.dir={tmp_path}/ckpt")
    assert error and f"cannot serve Prometheus metrics on port {busy_port}" in error \
        and "log.prometheus_port" in error


# ---- train_ddp.py: faults ------------------------------------------------------------------------

@pytest.mark.parametrize("fault", ["kill:1:7", "kill-in-save:0:8"])
def test_a_killed_rank_restarts_from_the_last_checkpoint_and_continues_bitwise_identically(
        fault, trained_run, data_dir, tmp_path):
    """kill: a rank dies in step 7; kill-in-save: rank 0 dies halfway through writing the step-8
    checkpoint. torchrun restarts the workers (launch.sh's MAX_RESTARTS, tested on its own, sets the
    same option), which resume from step 4 (the half-written checkpoint is never used and its
    leftovers go): steps 5..8 and the final weights match the uninterrupted run bit for bit (data
    position, dropout RNG of each rank, optimizer, schedule)."""
    out, _ = trained_run
    result = torchrun(2, "train_ddp.py", f"data.dir={data_dir}", *EIGHT_STEPS, "model.dropout=0.1",
                      f"out_dir={tmp_path}", f"checkpoint.dir={tmp_path}/ckpt",
                      env_extra={"FAULT": fault}, max_restarts=1)
    assert "resumed from" in result.stdout \
        and "step 4" in result.stdout.split("resumed from")[1].splitlines()[0]
    if fault.startswith("kill-in-save"):
        assert "removing" in result.stdout and ".tmp-step_000008" in result.stdout
    assert not list((tmp_path / "ckpt").glob(".tmp-*"))
    steps = [t["step"] for t in read_metrics(tmp_path, "train")]
    assert steps == list(range(1, 9)), steps  # replayed steps appear once, as the restart logs them
    uninterrupted, resumed = losses(out), losses(tmp_path)
    assert all(resumed[step] == uninterrupted[step] for step in range(1, 9)), (resumed,
                                                                              uninterrupted)
    reference, recovered = final_weights(out / "ckpt" / "step_000008"), \
        final_weights(tmp_path / "ckpt" / "step_000008")
    assert all(torch.equal(reference[name], recovered[name]) for name in reference)


def test_nans_on_either_rank_skip_those_steps_on_every_rank_and_leave_weights_and_adamw_untouched(
        nans_then_sigterm_run):
    """A NaN on rank 1 at step 3, on rank 0 at step 4: both steps skipped on both ranks, logged as
    steps 3 and 4. The checkpoints of steps 2 and 4 must hold the same weights and AdamW state
    (moments, step counts). (The run, nans_then_sigterm_run, is stopped later by a signal.)"""
    out, _, text = nans_then_sigterm_run
    lines = text.splitlines()
    skipped_3 = lines.index("step 3 | non-finite gradient: update skipped (1 in a row)")
    skipped_4 = lines.index("step 4 | non-finite gradient: update skipped (2 in a row)")
    assert skipped_3 < skipped_4 < next(i for i, line in enumerate(lines)
                                        if line.startswith("step 4/"))
    train = {t["step"]: t for t in read_metrics(out, "train")}
    assert {2, 4, 6} <= set(train) and [train[step]["skipped_steps"]
                                        for step in (2, 4, 6)] == [0, 2, 0]
    assert train[4]["loss"] is None and math.isfinite(train[2]["loss"]) \
        and math.isfinite(train[6]["loss"])
    ckpt = out / "ckpt"
    before, after, last = (final_weights(ckpt / f"step_{step:06d}") for step in (2, 4, 6))
    assert all(torch.equal(before[name], after[name]) for name in before)
    assert not all(torch.equal(after[name], last[name]) for name in after)  # training went on
    assert all(torch.isfinite(value).all() for value in last.values())
    state_before, state_after = (torch.load(ckpt / f"step_{step:06d}" / "optimizer.pt",
                                            weights_only=True)["state"] for step in (2, 4))
    assert sorted(state_before) == sorted(state_after)
    for index, state in state_before.items():
        assert state["step"] == 2 and all(torch.equal(value, state_after[index][key])
                                          for key, value in state.items())


def test_a_diverging_run_stops_after_max_bad_steps_and_never_saves_non_finite_weights(data_dir,
                                                                                      tmp_path):
    """optim.lr=1e6 gives NaN within a few steps: after max_bad_steps non-finite steps in a row the
    run stops with one line and exit code 2, and no checkpoint it wrote holds a non-finite
    weight."""
    result = torchrun(2, "train_ddp.py", f"data.dir={data_dir}", *TINY_MODEL,
                      "train.global_batch_size=16", "train.micro_batch_size=8",
                      "train.max_steps=40", "optim.lr=1e6", "optim.warmup_steps=0",
                      "optim.grad_clip=0", "train.max_bad_steps=3", "checkpoint.every=3",
                      "checkpoint.keep=100", "log.every=3", f"out_dir={tmp_path}",
                      f"checkpoint.dir={tmp_path}/ckpt", must_pass=False)
    assert_one_line_error(result, "3 steps in a row had a non-finite gradient", under_torchrun=True)
    assert not (tmp_path / "final").exists()
    saved = sorted((tmp_path / "ckpt").glob("step_*"))
    assert saved, result.stdout[-2000:]
    for checkpoint in saved:
        assert all(torch.isfinite(value).all() for value in final_weights(checkpoint).values()), \
            checkpoint


def test_a_hung_rank_is_named_and_the_others_stop_within_the_timeout(data_dir, tmp_path):
    """Rank 1 hangs outside any collective (FAULT=hang: a sleep); rank 0 must give up after
    dist.timeout_s, name rank 1 and exit non-zero. The two ranks are started as torchrun would start
    them, without torchrun: under torchrun the job then also waits torchrun's 30 s before it
    SIGKILLs the sleeping rank (README, "When a run breaks"), which would only make this test 30 s
    longer."""
    port = free_port()
    args = [sys.executable, str(REPO / "train_ddp.py"), f"data.dir={data_dir}", *EIGHT_STEPS,
            "dist.timeout_s=5", f"out_dir={tmp_path}", f"checkpoint.dir={tmp_path}/ckpt"]
    ranks = []
    for rank in range(2):
        env = {**os.environ, "OMP_NUM_THREADS": "1", "FAULT": "hang:1:3", "RANK": str(rank),
               "LOCAL_RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2",
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
        ranks.append(subprocess.Popen(args, cwd=REPO, env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True, start_new_session=True))
    try:
        # the harness's limit, not an assertion of speed
        output, _ = ranks[0].communicate(timeout=200)
    finally:
        for process in ranks:
            kill_process_tree(process.pid)
            process.wait()
    assert ranks[0].returncode != 0, output
    errors = [line for line in output.splitlines() if line.startswith("error:")]
    assert errors and "waited longer than dist.timeout_s" in errors[0] \
        and "stopped answering: [1]" in errors[0], output


# ---- train_ddp.py: tiered embedding --------------------------------------------------------------

# 8 GPU rows of the 384 (339 tokens padded); 2 ranks x 2 micro-batches of 4; grad_clip 1.0 clips
# these steps
TIERED = [*TINY_MODEL, "model.tie_word_embeddings=false", "model.embedding_gpu_rows=8",
          "model.dropout=0.0", "train.precision=fp32", "train.global_batch_size=16",
          "train.micro_batch_size=4", "train.max_steps=4", "checkpoint.every=2",
          "train.eval_every=4", "train.eval_batches=1", "log.every=1", "optim.lr=1e-2",
          "optim.warmup_steps=2", "log.sample_prompt="]


def merged_embedding(model_pt):
    """The input embedding a tiered checkpoint holds, its GPU and CPU rows put back in token id
    order."""
    state = torch.load(model_pt, weights_only=True)
    hot, extra = state["transformer.wte.hot_weight"], state["transformer.wte._extra_state"]
    weight = torch.empty((len(hot) + len(extra["cold_weight"]), hot.shape[1]))
    is_hot = torch.zeros(len(weight), dtype=torch.bool)
    is_hot[extra["hot_ids"]] = True
    weight[extra["hot_ids"]], weight[~is_hot] = hot, extra["cold_weight"]
    return weight


def untiered_reference(data_dir):
    """The same training written plainly: one process, the global batch as one micro-batch, an
    ordinary nn.Embedding, the other weights under torch's AdamW. The embedding is updated here by
    hand with the rules the tiered one states: AdamW on every GPU row at every step; on a CPU row
    only at the steps whose batch holds its id, with its own step count. Returns the losses and the
    final embedding."""
    cfg = train_ddp.load_config([*TIERED, "train.micro_batch_size=16"], use_cuda=False)
    optim, meta = cfg.optim, train_ddp.read_meta(data_dir, train_ddp.ArrowTokens)
    data = train_ddp.ArrowTokens(data_dir, meta, "train", cfg.train.seq_len)
    torch.manual_seed(cfg.train.seed)
    model, _ = train_ddp.build_model(cfg, train_ddp.ArrowTokens,
                                     {"vocab_size": 384, "special_tokens": meta["special_tokens"]},
                                     torch.device("cpu"))
    embedding = model.get_input_embeddings().weight
    others = [p for p in model.parameters() if p is not embedding]
    optimizer = torch.optim.AdamW([{"params": [p for p in others if p.dim() >= 2],
                                    "weight_decay": optim.weight_decay},
                                   {"params": [p for p in others if p.dim() < 2],
                                    "weight_decay": 0.0}], lr=optim.lr,
                                  betas=(optim.beta1, optim.beta2), eps=optim.eps)
    is_hot = torch.zeros(384, dtype=torch.bool)
    is_hot[train_ddp.hottest_token_ids(np.load(data_dir / "token_frequencies.npy"), 384, 8)] = True
    exp_avg, exp_avg_sq, row_steps = torch.zeros_like(embedding), torch.zeros_like(embedding), \
        torch.zeros(384)
    losses = []
    for step in range(cfg.train.max_steps):
        (batch,), _, label_tokens, _ = train_ddp.rank_batches(data, step * 16, cfg.train.seed, cfg,
                                                              1, 0, torch.device("cpu"))
        model.zero_grad()
        loss = train_ddp.token_loss_sum(model(**batch["inputs"]).logits,
                                        batch["labels"]) / label_tokens
        loss.backward()
        losses.append(loss.item())
        torch.nn.utils.clip_grad_norm_(model.parameters(), optim.grad_clip)
        lr = optim.lr * train_ddp.lr_factor(step, cfg)
        for group in optimizer.param_groups:
            group["lr"] = lr
        optimizer.step()
        rows = is_hot.clone()
        rows[batch["inputs"]["input_ids"].unique()] = True
        with torch.no_grad():
            grad, row_steps[rows] = embedding.grad[rows], row_steps[rows] + 1
            exp_avg[rows] = optim.beta1 * exp_avg[rows] + (1 - optim.beta1) * grad
            exp_avg_sq[rows] = optim.beta2 * exp_avg_sq[rows] + (1 - optim.beta2) * grad * grad
            corrected_avg = exp_avg[rows] / (1 - optim.beta1 ** row_steps[rows])[:, None]
            corrected_avg_sq = exp_avg_sq[rows] / (1 - optim.beta2 ** row_steps[rows])[:, None]
            embedding[rows] = (embedding[rows] * (1 - lr * optim.weight_decay)
                               - lr * corrected_avg / (corrected_avg_sq.sqrt() + optim.eps))
    return losses, embedding.detach()


@pytest.fixture(scope="module")
def tiered_run(data_dir, tmp_path_factory):
    """4 steps on 2 ranks with 8 of 384 embedding rows on the "GPU" (here the CPU too), checkpoints
    at 2 and 4."""
    out = tmp_path_factory.mktemp("tiered")
    result = torchrun(2, "train_ddp.py", f"data.dir={data_dir}", *TIERED, f"out_dir={out}",
                      f"checkpoint.dir={out}/ckpt")
    return out, result


def test_tiered_embedding_trains_as_the_untiered_reference_and_exports_one_table(tiered_run,
                                                                                 data_dir):
    """2 ranks x 2 micro-batches: each rank copies its own cold rows, their gradients are gathered
    from both ranks and coalesced, clipping counts them; the result is the plain computation's, to
    float rounding."""
    out, result = tiered_run
    assert "input embedding tiered: the rows of the 8 most frequent tokens" in result.stdout
    reference_losses, reference_embedding = untiered_reference(data_dir)
    tiered_losses = [t["loss"] for t in read_metrics(out, "train")]
    assert tiered_losses == pytest.approx(reference_losses, rel=1e-6)
    # clipping was on, with the CPU rows' gradient in the norm
    assert read_metrics(out, "train")[0]["grad_norm"] > 1.0
    embedding = merged_embedding(out / "ckpt" / "step_000004" / "model.pt")
    assert torch.allclose(embedding, reference_embedding, rtol=0, atol=1e-6), \
        (embedding - reference_embedding).abs().max()
    from transformers import AutoModelForCausalLM
    exported = AutoModelForCausalLM.from_pretrained(out / "final")
    assert torch.equal(exported.get_input_embeddings().weight.detach(), embedding)
    assert exported.get_output_embeddings().weight is not exported.get_input_embeddings().weight


def test_tiered_embedding_resumes_bit_for_bit(data_dir, tmp_path):
    """One process: 4 steps straight, and 2 steps + a resume for 2 more, give the same losses and
    the same checkpoint, CPU rows, their lazy AdamW moments and step counts included."""
    args = [f"data.dir={data_dir}", *TIERED, "export=false"]
    assert train_in_process(*args, f"out_dir={tmp_path}/a",
                            f"checkpoint.dir={tmp_path}/a/ckpt")[0] is None
    shutil.copytree(tmp_path / "a" / "ckpt" / "step_000002",
                    tmp_path / "b" / "ckpt" / "step_000002")
    assert train_in_process(*args, f"out_dir={tmp_path}/b",
                            f"checkpoint.dir={tmp_path}/b/ckpt")[0] is None
    straight, resumed = losses(tmp_path / "a"), losses(tmp_path / "b")
    assert sorted(resumed) == [3, 4] and all(resumed[step] == straight[step] for step in resumed)
    final_a = torch.load(tmp_path / "a" / "ckpt" / "step_000004" / "model.pt", weights_only=True)
    final_b = torch.load(tmp_path / "b" / "ckpt" / "step_000004" / "model.pt", weights_only=True)
    extra_a, extra_b = final_a.pop("transformer.wte._extra_state"), \
        final_b.pop("transformer.wte._extra_state")
    assert extra_a["cold_steps"].max() == 4 and extra_a["cold_exp_avg"].abs().sum() > 0
    assert all(torch.equal(extra_a[key], extra_b[key]) for key in extra_a)
    assert all(torch.equal(final_a[name], final_b[name]) for name in final_a)


def test_tier_map_puts_the_most_frequent_ids_on_the_gpu_with_ties_to_the_lower_id():
    # counts of ids 0..5; ids 6 and 7 pad the vocabulary (no count).
    # Ties: ids 1, 2, 4 (9) and 0, 3 (5).
    frequencies = np.array([5, 9, 9, 5, 9, 0])
    assert train_ddp.hottest_token_ids(frequencies, 8, 2).tolist() == [1, 2]
    assert train_ddp.hottest_token_ids(frequencies, 8, 4).tolist() == [1, 2, 4, 0]
    assert train_ddp.hottest_token_ids(frequencies, 8, 7).tolist() == [1, 2, 4, 0, 3, 5, 6]
    torch.manual_seed(0)
    plain = torch.nn.Embedding(8, 3, padding_idx=6)
    tiered = train_ddp.TieredEmbedding(plain, train_ddp.hottest_token_ids(frequencies, 8, 4),
                                       torch.device("cpu"))
    # the 4th hot id (0) and the first cold id (3)
    assert tiered.slot_of_id.tolist() == [3, 0, 1, 4, 2, 5, 6, 7]
    assert torch.equal(tiered.hot_weight.detach(), plain.weight.detach()[[1, 2, 4, 0]])
    assert torch.equal(tiered.cold_weight, plain.weight.detach()[[3, 5, 6, 7]])
    ids = torch.tensor([[0, 3, 4, 6, 3], [7, 1, 6, 5, 0]])
    with torch.no_grad():  # validation's path: the rows straight from the CPU tables
        assert torch.equal(tiered(ids), plain(ids))
    # training's path: the step's rows staged
    tiered.stage([{"host_input_ids": ids}], ids.flatten())
    looked_up = tiered(ids)  # its first training forward makes them the step's rows, a parameter
    # the batch's
    assert torch.equal(tiered.cold_ids[tiered.current.slots - 4], torch.tensor([3, 5, 6, 7]))
    # so the global gradient norm counts it
    assert any(p is tiered.rows for p in tiered.parameters())
    assert torch.equal(looked_up, plain(ids))
    # its hook: one micro-batch, one rank, so nothing to all-reduce
    looked_up.pow(2).sum().backward()
    plain(ids).pow(2).sum().backward()
    touched, state = tiered.rows, tiered.current
    # the padding row 6: none in both
    assert torch.allclose(touched.grad, plain.weight.grad[[3, 5, 6, 7]])
    assert torch.allclose(tiered.hot_weight.grad, plain.weight.grad[[1, 2, 4, 0]])
    assert torch.equal(tiered.merged().weight, plain.weight.detach())
    # a step whose verdict says skip leaves the rows, their moments and step counts as they were
    before = [tensor.clone() for tensor in (touched.detach(), state.exp_avg, state.exp_avg_sq,
                                            state.steps)]
    tiered.step(0.1, (0.9, 0.95), 1e-8, 0.1, skipped=True)
    assert all(torch.equal(old, new) for old, new in zip(before, (touched.detach(), state.exp_avg,
                                                                   state.exp_avg_sq, state.steps)))
    # the step ended
    assert tiered.rows is None and not any(p is touched for p in tiered.parameters())
    assert torch.equal(tiered.merged().weight, plain.weight.detach())  # the tables: unchanged too
    # a good step updates every row of the step
    tiered.step(0.1, (0.9, 0.95), 1e-8, 0.1, skipped=False)
    assert state.steps.tolist() == [1, 1, 1, 1] and not torch.equal(touched.detach(), before[0])
    assert not torch.equal(tiered.merged().weight, plain.weight.detach())  # and goes to the tables


def test_tiered_embedding_is_refused_where_it_cannot_work(data_dir, tmp_path):
    args = [f"data.dir={data_dir}", *TIERED, f"out_dir={tmp_path}",
            f"checkpoint.dir={tmp_path}/ckpt"]
    # gpt2 ties its output layer
    error, _ = train_in_process(*args, "model.tie_word_embeddings=auto")
    assert "needs an untied output layer" in error \
        and "-> set model.tie_word_embeddings=false" in error
    old_data = tmp_path / "old_data"
    shutil.copytree(data_dir, old_data)
    (old_data / "token_frequencies.npy").unlink()  # as an older preprocess.py left it
    error, _ = train_in_process(*args, f"data.dir={old_data}")
    assert "needs the token frequencies" in error \
        and f"preprocess.py --input YOUR_TEXT --out {old_data} --force" in error
    error, _ = train_in_process(*args, "model.embedding_gpu_rows=384")
    assert "is not below the embedding's 384 rows" in error
    import train_fsdp
    with pytest.raises(train_fsdp.UserError, match="FSDP shards .* fsdp.cpu_offload"):
        with monkeypatched_argv(["train_fsdp.py", "--check", "model.embedding_gpu_rows=8"]):
            train_fsdp.main()


# ---- train_ddp.py: fp8 ---------------------------------------------------------------------------

# A tiny Llama whose layers are all multiples of 16 (head size 16, MLP 64 wide); on CPU, where the
# trainers refuse fp8 (no gain), the tests lift that refusal: torch runs float8 matmuls on CPU too
FP8_MODEL = ["model.type=llama", "model.n_layer=2", "model.n_head=2", "model.n_embd=32",
             "model.intermediate_size=64", "train.seq_len=64", "train.global_batch_size=16",
             "train.micro_batch_size=4", "train.max_steps=4", "checkpoint.every=2",
             "train.eval_every=4", "train.eval_batches=1", "log.every=1", "optim.lr=1e-2",
             "optim.warmup_steps=2", "model.dropout=0.0", "log.sample_prompt="]
FP8_ON_CPU = """import sys
sys.path.insert(0, {repo!r})
import {trainer} as trainer
trainer.fp8_refusal = lambda device, use_compile: None  # a CPU has no float8 tensor cores
sys.argv[0] = "{trainer}.py"
trainer.main()
"""


def need_torchao():
    if importlib.util.find_spec("torchao") is None:
        pytest.fail("torchao is not installed -> pip install -r requirements-dev.txt",
                    pytrace=False)


def test_fp8_trains_the_blocks_linear_layers_of_sizes_in_multiples_of_16_and_nothing_else():
    """Llama: the 7 linear layers of each block; BERT and ViT: their 6, never the pooler or the
    heads; an MLP of 72 stays in bf16; GPT-2's blocks hold Conv1D layers: none."""
    from transformers import (AutoConfig, AutoModelForCausalLM, AutoModelForImageClassification,
                              AutoModelForMaskedLM)
    shape = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64)
    llama = AutoModelForCausalLM.from_config(AutoConfig.for_model("llama", vocab_size=128, **shape))
    assert train_ddp.fp8_layers(llama) == [
        f"model.layers.{i}.{name}" for i in range(2)
        for name in ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                     "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"]]
    narrow = AutoModelForCausalLM.from_config(AutoConfig.for_model(
        "llama", vocab_size=128, **{**shape, "intermediate_size": 72}))
    assert [name.rsplit(".", 1)[1] for name in train_ddp.fp8_layers(narrow)][:4] == \
        ["q_proj", "k_proj", "v_proj", "o_proj"] and len(train_ddp.fp8_layers(narrow)) == 8
    bert = AutoModelForMaskedLM.from_config(AutoConfig.for_model("bert", vocab_size=128, **shape))
    vit = AutoModelForImageClassification.from_config(AutoConfig.for_model(
        "vit", image_size=32, patch_size=8, num_labels=10, **shape))
    for model, prefix in [(bert, "bert.encoder.layer."), (vit, "vit.layers.")]:
        names = train_ddp.fp8_layers(model)
        assert len(names) == 12 and all(name.startswith(prefix) for name in names), names
    gpt2 = AutoModelForCausalLM.from_config(AutoConfig.for_model(
        "gpt2", vocab_size=128, n_embd=32, n_layer=2, n_head=2))
    assert train_ddp.fp8_layers(gpt2) == []
    cfg = SimpleNamespace(train=SimpleNamespace(precision="fp8"))
    with unittest.mock.patch.object(train_ddp, "fp8_refusal", lambda device, use_compile: None), \
            pytest.raises(train_ddp.UserError,
                          match=r"gpt2's blocks have no nn.Linear .* Conv1D.* model.type=llama"):
        train_ddp.train_in_fp8(gpt2, cfg, torch.device("cpu"), True, sharded=False)
    bf16 = SimpleNamespace(train=SimpleNamespace(precision="bf16"))
    train_ddp.train_in_fp8(llama, bf16, torch.device("cpu"), True, sharded=False)
    assert type(llama.model.layers[0].self_attn.q_proj) is torch.nn.Linear  # bf16: untouched


def test_fp8_is_refused_in_one_line_where_it_cannot_pay(monkeypatch, data_dir, tmp_path):
    """A CPU, a GPU below compute capability 8.9, eager mode, no torchao; and a precision the
    config does not know."""
    refusal, gpu = train_ddp.fp8_refusal, torch.device("cuda", 0)
    assert "needs an NVIDIA GPU with float8 tensor cores" in refusal(torch.device("cpu"), True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device: "NVIDIA A100")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device: (8, 0))
    assert "NVIDIA A100 has 8.0 -> use train.precision=bf16" in refusal(gpu, True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device: (9, 0))
    assert "needs torch.compile" in refusal(gpu, False)
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *rest: None if name == "torchao" else real_find_spec(name))
    assert refusal(gpu, True).endswith("-> pip install torchao")
    monkeypatch.undo()
    error, _ = train_in_process(f"data.dir={data_dir}", *FP8_MODEL, "train.precision=fp8",
                                f"out_dir={tmp_path}", f"checkpoint.dir={tmp_path}/c")
    assert error and error.startswith("train.precision=fp8 needs an NVIDIA GPU"), error
    assert "\n" not in error and not (tmp_path / "c").exists()
    with pytest.raises(train_ddp.UserError, match=r"precision=fp9 is not one of .*\|fp32\|fp8 "):
        train_ddp.load_config(["train.precision=fp9"], use_cuda=False)


@pytest.mark.parametrize("trainer", TRAINERS)
def test_fp8_trains_resumes_in_bf16_and_exports_a_plain_model(trainer, data_dir, tmp_path):
    """2 ranks (FSDP2: weights gathered in float8) or one process: 4 steps in fp8 with checkpoints,
    then the step-2 checkpoint resumed in bf16 gives about the same losses; the export holds fp32
    tensors under transformers' names and loads back with nn.Linear layers."""
    need_torchao()
    from safetensors.torch import load_file
    wrapper = tmp_path / f"{Path(trainer).stem}_fp8.py"
    wrapper.write_text(FP8_ON_CPU.format(repo=str(REPO), trainer=Path(trainer).stem))
    nproc = 2 if trainer == "train_fsdp.py" else 1
    result = torchrun(nproc, wrapper, f"data.dir={data_dir}", *FP8_MODEL, "train.precision=fp8",
                      f"out_dir={tmp_path}/fp8", f"checkpoint.dir={tmp_path}/fp8/c")
    assert "precision fp8" in result.stdout
    assert "fp8: 14 linear layers multiply in float8 (torchao, tensorwise)" in result.stdout
    assert "fp8: width 32; fp8 measured" in result.stdout  # narrow: told it may not pay
    shutil.copytree(tmp_path / "fp8/c/step_000002", tmp_path / "bf16/c/step_000002")
    torchrun(nproc, trainer, f"data.dir={data_dir}", *FP8_MODEL, "train.precision=bf16",
             "export=false", f"out_dir={tmp_path}/bf16", f"checkpoint.dir={tmp_path}/bf16/c")
    in_fp8, in_bf16 = losses(tmp_path / "fp8"), losses(tmp_path / "bf16")
    assert sorted(in_bf16) == [3, 4]
    assert all(in_bf16[step] == pytest.approx(in_fp8[step], rel=0.02) for step in in_bf16)
    exported = load_file(tmp_path / "fp8/final/model.safetensors")
    assert {tensor.dtype for tensor in exported.values()} == {torch.float32}
    assert "model.layers.0.self_attn.q_proj.weight" in exported
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "fp8/final")
    assert type(model.model.layers[0].mlp.up_proj) is torch.nn.Linear


# ---- train_ddp.py: images (ViT) ------------------------------------------------------------------

# 12 images per step: 2 ranks x 3, 1 rank x 6 and 3 ranks x 2 micro-batches of 2
VIT_STEPS = ["model.type=vit", "model.n_layer=2", "model.n_head=2", "model.n_embd=32",
             "train.global_batch_size=12", "train.micro_batch_size=2", "train.max_steps=6",
             "checkpoint.every=3", "train.eval_every=3", "log.every=1", "optim.lr=3e-3",
             "optim.warmup_steps=2", "model.dropout=0.0", "train.precision=fp32",
             "train.crop_padding=2", "train.hflip=true"]


@pytest.fixture(scope="module")
def vit_run(tmp_path_factory):
    """launch.sh in a copy of the scripts: model.type=vit without data.dir prepares the digits into
    data/digits, then trains 6 steps on 2 processes, checkpoints at steps 3 and 6, and exports."""
    copy = tmp_path_factory.mktemp("vit")
    for name in ["launch.sh", "train_ddp.py", "train_fsdp.py", "preprocess.py", "config.yaml"]:
        shutil.copy(REPO / name, copy / name)
    result = run(["bash", "launch.sh", "train_ddp.py", *VIT_STEPS, "out_dir=out",
                  "checkpoint.dir=out/ckpt"], cwd=copy, env_extra={"MASTER_PORT": str(free_port())})
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return copy, result


def test_vit_launch_prepares_the_digits_and_logs_images_per_second_and_accuracy(vit_run):
    copy, result = vit_run
    assert "preparing the default images data into data/digits" in result.stdout
    assert "world size 2 (gloo, cpu)" in result.stdout and "model vit (image)" in result.stdout
    assert json.loads((copy / "data/digits/meta.json").read_text())["classes"] \
        == [str(d) for d in range(10)]
    train, val = read_metrics(copy / "out", "train"), read_metrics(copy / "out", "val")
    assert [t["step"] for t in train] == list(range(1, 7)) and [v["step"] for v in val] == [0, 3, 6]
    assert all(t["images_per_sec"] > 0 and "tokens_per_sec" not in t for t in train)
    assert train[-1]["images_seen"] == 6 * 12
    assert all(0 <= v["val_accuracy"] <= 1 for v in val)
    assert re.search(r"step 6/6 \| .* \| \d+ img/s", result.stdout)
    assert re.search(r"step 6 \| val loss [\d.]+ \| accuracy [\d.]+%", result.stdout)


def test_vit_resume_continues_bitwise_identically_with_the_same_crops_and_flips(vit_run, tmp_path):
    copy, _ = vit_run
    shutil.copytree(copy / "out/ckpt/step_000003", tmp_path / "ckpt/step_000003")
    # seq_len as on a GPU, where cpu_preset's 128 does not apply: images have none
    torchrun(2, "train_ddp.py", *VIT_STEPS, f"data.dir={copy}/data/digits", f"out_dir={tmp_path}",
             f"checkpoint.dir={tmp_path}/ckpt", "train.seq_len=1024")
    uninterrupted, resumed = losses(copy / "out"), losses(tmp_path)
    assert sorted(resumed) == [4, 5, 6] and all(resumed[step] == uninterrupted[step]
                                                for step in resumed)
    final_a = torch.load(copy / "out/ckpt/step_000006/model.pt", weights_only=True)
    final_b = torch.load(tmp_path / "ckpt/step_000006/model.pt", weights_only=True)
    assert all(torch.equal(final_a[name], final_b[name]) for name in final_a)


@pytest.fixture(scope="module")
def vit_fsdp_run(vit_run, tmp_path_factory):
    """train_fsdp.py on 3 ranks, on the digits vit_run prepared: 2 micro-batches of 2 images per
    rank a step."""
    copy, _ = vit_run
    out = tmp_path_factory.mktemp("vit_fsdp")
    result = torchrun(3, "train_fsdp.py", *VIT_STEPS, f"data.dir={copy}/data/digits",
                      f"out_dir={out}", f"checkpoint.dir={out}/ckpt", "export=false")
    return out, result


def test_vit_fsdp_on_3_ranks_gives_the_losses_of_ddp_on_2_and_shards_each_vit_layer(vit_run,
                                                                                    vit_fsdp_run):
    copy, _ = vit_run
    out, result = vit_fsdp_run
    assert "sharded over 3 ranks" in result.stdout
    fsdp, ddp = losses(out), losses(copy / "out")
    assert sorted(fsdp) == sorted(ddp) == list(range(1, 7))
    assert all(fsdp[step] == pytest.approx(ddp[step], rel=1e-5) for step in ddp), (fsdp, ddp)
    import train_fsdp
    cfg = train_fsdp.load_config([*VIT_STEPS], use_cuda=False)
    meta = train_fsdp.read_meta(copy / "data/digits", train_fsdp.ArrowImages)
    model, _ = train_fsdp.build_model(cfg, train_fsdp.ArrowImages, meta, torch.device("cpu"))
    assert [type(block).__name__ for block in train_fsdp.repeated_blocks(model)] == ["ViTLayer"] * 2


def test_vit_export_classifies_image_files_in_the_transformers_pipeline_as_the_trainer_does(
        vit_run, tmp_path):
    from PIL import Image
    from transformers import AutoModelForImageClassification, pipeline
    copy, _ = vit_run
    data_dir = copy / "data/digits"
    meta = train_ddp.read_meta(data_dir, train_ddp.ArrowImages)
    val = train_ddp.ArrowImages(data_dir, meta, "val", 1)
    cfg = train_ddp.load_config(VIT_STEPS, use_cuda=False)
    ids = np.arange(4)
    batch = val.micro_batch(ids, np.zeros(4, int), cfg, torch.device("cpu"))  # val: as it is
    model = AutoModelForImageClassification.from_pretrained(copy / "out/final").eval()
    with torch.no_grad():
        expected = model(**batch["inputs"]).logits.softmax(-1)
    files = []
    # the 32-pixel images as files: the processor's resize and crop leave them as they are
    for index in ids:
        files.append(str(tmp_path / f"{index}.png"))
        Image.fromarray(val.pixels(np.array([index]))[0]).save(files[-1])
    # the first again, as a GIF whose top-left colour is its transparent one, as GIFs mark it
    rgb = val.pixels(ids[:1])[0]
    colours, index_of = np.unique(rgb.reshape(-1, 3), axis=0, return_inverse=True)
    palette = Image.frombytes("P", rgb.shape[1::-1], index_of.astype(np.uint8).tobytes())
    palette.putpalette(colours.ravel().tolist())
    files.append(str(tmp_path / "0_transparent_colour.gif"))
    palette.save(files[-1], transparency=int(index_of[0]))
    classifier = pipeline("image-classification", model=str(copy / "out/final"), device="cpu")
    for row, predictions in zip([*ids, 0], classifier(files, top_k=10)):
        scores = {p["label"]: p["score"] for p in predictions}
        assert set(scores) == set(meta["classes"])  # id2label from the class names
        assert [scores[name] for name in meta["classes"]] == pytest.approx(expected[row].tolist(),
                                                                           abs=1e-4)


def test_validation_counts_every_image_once_on_any_number_of_ranks(vit_run, vit_fsdp_run, tmp_path):
    """The digits' 353 validation images in global batches of 12: the last batch is padded past the
    end, and those samples are not counted (DistributedSampler's padding counts some images
    twice)."""
    copy, _ = vit_run
    data_dir = copy / "data/digits"
    meta = train_ddp.read_meta(data_dir, train_ddp.ArrowImages)
    val = train_ddp.ArrowImages(data_dir, meta, "val", 1)
    # the split's size is odd and no multiple of the global batch
    assert len(val) % 12 and len(val) % 2
    cfg = train_ddp.load_config(VIT_STEPS, use_cuda=False)
    counted = np.zeros(len(meta["classes"]), dtype=np.int64)
    for rank in range(3):
        for position in range(0, len(val), 12):
            for batch in train_ddp.rank_batches(val, position, None, cfg, 3, rank,
                                                torch.device("cpu"))[0]:
                labels = batch["labels"][batch["labels"] != train_ddp.IGNORE_INDEX]
                counted += np.bincount(labels.numpy(), minlength=len(counted))
    assert counted.tolist() == np.bincount(val.labels, minlength=len(counted)).tolist()
    # the same accuracy and loss from the same first weights on 1 rank, 2 (DDP) and 3 (FSDP)
    once = ["train.max_steps=1", "export=false", "checkpoint.every=0", f"data.dir={data_dir}"]
    error, _ = train_in_process(*VIT_STEPS, *once, f"out_dir={tmp_path}")
    assert error is None, error
    one, two, three = (read_metrics(out, "val")[0]
                       for out in (tmp_path, copy / "out", vit_fsdp_run[0]))
    assert one["val_accuracy"] == two["val_accuracy"] == three["val_accuracy"]
    assert two["val_loss"] == pytest.approx(one["val_loss"], rel=1e-5)
    assert three["val_loss"] == pytest.approx(one["val_loss"], rel=1e-5)


def test_vit_flop_count_is_what_flop_counter_mode_counts_for_forward_and_backward():
    from torch.utils.flop_counter import FlopCounterMode
    meta = {"image_size": 32, "classes": list("abcde"), "mean": [0.5] * 3, "std": [0.25] * 3}
    cfg = train_ddp.load_config(["model.type=vit", "model.n_layer=2", "model.n_head=2",
                                 "model.n_embd=32", "model.attention=eager", "model.patch_size=8"],
                                use_cuda=False)
    model, attention = train_ddp.build_model(cfg, train_ddp.ArrowImages, meta,
                                             torch.device("cpu"))
    flops_of = train_ddp.ArrowImages.flops_counter(model, attention, cfg)
    pixels = torch.randn(3, 3, 32, 32)
    with FlopCounterMode(display=False) as counter:
        model(pixel_values=pixels).logits.sum().backward()
    assert flops_of([[1, 1], [1]]) == counter.get_total_flops()  # 3 images in two micro-batches


def test_the_automatic_patch_is_the_largest_up_to_16_that_divides_the_images_into_4_by_4():
    cfg = train_ddp.load_config(["model.type=vit"], use_cuda=False)
    for size, patch in [(224, 16), (32, 8), (30, 6), (28, 7), (50, 10), (200, 10), (4, 1)]:
        meta = {"image_size": size, "classes": ["a", "b"]}
        assert train_ddp.vit_config(cfg, meta).patch_size == patch, size
    with pytest.raises(train_ddp.UserError, match="too few for 4 x 4 patches"):
        train_ddp.vit_config(cfg, {"image_size": 3, "classes": ["a", "b"]})


@pytest.mark.parametrize("args, message", [
    (["model.type=gpt2"], "holds images, the model reads text -> prepare text: python "),
    (["model.type=vit", "model.embedding_gpu_rows=8"],
     "model.embedding_gpu_rows=8 does not apply to images"),
    (["model.type=vit", "train.mlm_probability=0.3"],
     "train.mlm_probability=0.3 applies to masked LMs, and this run trains none"),
    (["model.type=vit", "model.patch_size=5"], "not a multiple of model.patch_size=5"),
    (["model.type=deit"], "the image path trains ViT models"),
    (["model.type=vit", "train.crop_padding=100000"],
     "train.crop_padding=100000 is more than the images' 32 pixels -> give at most 32"),
])
def test_what_does_not_apply_to_images_is_refused_with_the_reason(vit_run, args, message):
    copy, _ = vit_run
    error, _ = train_in_process(f"data.dir={copy}/data/digits", *args, "train.max_steps=1")
    assert error is not None and message in error, error


def test_a_pretrained_vit_gets_a_new_classifier_for_other_classes_and_keeps_its_encoder(tmp_path,
                                                                                        capsys):
    from transformers import AutoConfig, AutoModelForImageClassification
    config = AutoConfig.for_model("vit", hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                  intermediate_size=64, image_size=32, patch_size=8, num_labels=5)
    torch.manual_seed(0)
    AutoModelForImageClassification.from_config(config).save_pretrained(tmp_path / "vit")
    saved = AutoModelForImageClassification.from_pretrained(tmp_path / "vit").state_dict()
    meta = {"image_size": 32, "classes": [str(d) for d in range(10)], "mean": [0.5] * 3,
            "std": [0.25] * 3}
    cfg = train_ddp.load_config([f"model.pretrained={tmp_path / 'vit'}"], use_cuda=False)
    model, _ = train_ddp.build_model(cfg, train_ddp.ArrowImages, meta, torch.device("cpu"))
    assert "a new classifier for 10 classes (model.pretrained has 5)" in capsys.readouterr().out
    assert model.classifier.out_features == 10 and model.config.id2label[3] == "3"
    assert all(torch.equal(value, saved[name]) for name, value in model.state_dict().items()
               if not name.startswith("classifier"))
    meta["image_size"] = 64
    with pytest.raises(train_ddp.UserError, match="trained on 32-pixel images"):
        train_ddp.build_model(cfg, train_ddp.ArrowImages, meta, torch.device("cpu"))
    meta["image_size"] = 32
    other_patch = train_ddp.load_config([f"model.pretrained={tmp_path / 'vit'}",
                                         "model.patch_size=4"], use_cuda=False)
    with pytest.raises(train_ddp.UserError, match="model.patch_size=4, but model.pretrained=.* has "
                                                  "8 -> leave model.patch_size out"):
        train_ddp.build_model(other_patch, train_ddp.ArrowImages, meta, torch.device("cpu"))
    for classes, kept, said in [(list("vwxyz"), False, "a new classifier for 5 classes "
                                 "(model.pretrained has 5, other names): it starts from random"),
                                ([f"LABEL_{i}" for i in range(5)], True,
                                 "the classifier of model.pretrained is kept: the same 5 classes")]:
        model, _ = train_ddp.build_model(cfg, train_ddp.ArrowImages, {**meta, "classes": classes},
                                         torch.device("cpu"))
        assert said in capsys.readouterr().out
        assert torch.equal(model.classifier.weight, saved["classifier.weight"]) is kept
        assert model.config.id2label[0] == classes[0]


def test_images_too_small_for_4_by_4_patches_are_one_line_error():
    meta = {"image_size": 3, "classes": ["a", "b"], "mean": [0.5] * 3, "std": [0.25] * 3}
    cfg = train_ddp.load_config(["model.type=vit"], use_cuda=False)
    with pytest.raises(train_ddp.UserError, match="too few for 4 x 4 patches -> prepare them "
                                                  "with --image-size 4 or more"):
        train_ddp.vit_config(cfg, meta)


def write_an_image_in_every_mode(folder):
    """One file per mode datasets hold, of random pixels: RGB, RGBA and LA with fully transparent
    rows, L, palettes without transparency, with an alpha per entry and with one transparent
    colour, CMYK, 16-bit (12-bit values), 32-bit and float grey, a JPEG with an EXIF orientation;
    their sizes give crop margins of 3, 7 and 4 pixels at 16 px. Returns their paths."""
    rng = np.random.default_rng(0)
    colours = rng.integers(0, 256, (23, 20, 4), dtype=np.uint8)
    colours[::2, :, 3] = 0  # transparent rows keep their colour values in the file
    rgba = Image.fromarray(colours)
    palette = rgba.convert("RGB").quantize(64)
    grey = {"i16.png": rng.integers(0, 4096, (23, 20), np.uint16),  # as 12-bit scanners write
            "i.tif": rng.integers(-70_000, 70_000, (23, 20), np.int32),
            "f.tif": rng.normal(0.5, 2, (23, 20)).astype(np.float32)}
    exif = Image.Exif()
    exif[ExifTags.Base.Orientation] = 6  # as a phone held upright writes it
    files = [("rgb.jpg", rgba.convert("RGB"), {}), ("rgba.png", rgba, {}),
             ("la.png", rgba.convert("LA"), {}), ("l.png", rgba.convert("L"), {}),
             ("p.gif", palette, {}),
             ("p_alpha.png", palette, {"transparency": bytes(range(0, 256, 4))}),
             ("p_colour_key.gif", palette, {"transparency": int(np.asarray(palette)[0, 0])}),
             ("cmyk.jpg", rgba.convert("CMYK"), {}),
             *((name, Image.fromarray(values), {}) for name, values in grey.items()),
             ("exif.jpg", rgba.convert("RGB"), {"exif": exif})]
    folder.mkdir(parents=True)
    for index, (name, image, options) in enumerate(files):
        width, height = [(19, 16), (16, 23), (20, 16)][index % 3]
        image.crop((0, 0, width, height)).save(folder / name, **options)
    return [folder / name for name, _, _ in files]


def test_the_exported_pipeline_is_served_the_pixels_preprocess_wrote_in_every_mode_and_margin(
        tmp_path):
    """What pipeline() does to a path, load_image then the exported processor (resize the shorter
    side, centre crop, normalise), equals preprocess.py's pixels normalised, for files of every
    mode and odd crop margins; 16- and 32-bit grey as preprocess.py's note says to pass them."""
    from transformers import AutoConfig, AutoImageProcessor, AutoModelForImageClassification
    from transformers.image_utils import load_image
    meta = {"image_size": 16, "classes": ["a", "b"], "mean": [0.4, 0.5, 0.6],
            "std": [0.2, 0.25, 0.3]}
    config = AutoConfig.for_model("vit", hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                  intermediate_size=64, image_size=16, patch_size=8, num_labels=2)
    train_ddp.export_image_model(AutoModelForImageClassification.from_config(config), tmp_path,
                                 meta, tmp_path / "final", None, torch.device("cpu"))
    processor = AutoImageProcessor.from_pretrained(tmp_path / "final")
    mean, std = (np.array(meta[key])[:, None, None] for key in ("mean", "std"))
    for path in write_an_image_in_every_mode(tmp_path / "images"):
        pixels, *_ = preprocess.decode_image((str(path), 16))
        ours = np.frombuffer(pixels, np.uint8).reshape(16, 16, 3).transpose(2, 0, 1) / 255
        with Image.open(path) as image:
            wide = image.mode in ("I;16", "I", "F")
            served = load_image(preprocess.to_rgb(image) if wide else str(path))
        if wide:  # Pillow's convert() clips them: the path would be served near-white or black
            clipped = np.asarray(load_image(str(path)), float)
            assert np.abs(clipped - np.asarray(served, float)).mean() > 50, path.name
        pixel_values = processor(images=served, return_tensors="np")["pixel_values"][0]
        assert np.abs(pixel_values - (ours - mean) / std).max() < 1e-5, path.name


def test_a_vit_on_text_data_is_refused_with_the_command_that_prepares_images(data_dir):
    error, _ = train_in_process(f"data.dir={data_dir}", "model.type=vit", "train.max_steps=1")
    assert error is not None and "holds text" in error and "preprocess.py --images" in error, error


def test_a_vit_without_the_digits_names_the_command_that_prepares_them(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # data.dir at its default: data/digits, here
    args = ["model.type=vit", "train.max_steps=1", "checkpoint.every=0", "export=false"]
    error, _ = train_in_process(*args)
    command = error.split("-> run: ")[1]
    assert command.startswith("python preprocess.py --images "), error  # not text
    result = run([sys.executable, str(REPO / "preprocess.py"), *command.split()[2:]], cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    error, _ = train_in_process(*args)
    assert error is None, error


# ---- train_fsdp.py -------------------------------------------------------------------------------

# 24 sequences per step: 2 ranks x 3, 1 rank x 6 and 3 ranks x 2 micro-batches of 4 (the resume
# tests use all three)
FSDP_STEPS = [*TINY_MODEL, "train.global_batch_size=24", "train.micro_batch_size=4",
              "train.max_steps=8", "checkpoint.every=4", "train.eval_every=4", "log.every=1",
              "optim.lr=1e-2", "optim.warmup_steps=2", "model.dropout=0.0", "train.precision=fp32"]


@pytest.fixture(scope="module")
def fsdp_run(data_dir, tmp_path_factory):
    """8 steps of train_fsdp.py on 2 processes, sharded checkpoints at steps 4 and 8, written in the
    background (checkpoint.async_save): the tests that resume from them and compare the exported
    weights check that path too. Under torchrun itself: launch.sh's checks before train_fsdp.py are
    the preemption test's."""
    out = tmp_path_factory.mktemp("fsdp")
    result = torchrun(2, "train_fsdp.py", f"data.dir={data_dir}", *FSDP_STEPS,
                      "checkpoint.async_save=true", f"out_dir={out}", f"checkpoint.dir={out}/ckpt")
    return out, result


def test_fsdp_gives_the_losses_of_ddp_for_the_same_seed_and_data(fsdp_run, data_dir, tmp_path):
    """3 micro-batches per rank: accumulation without gradient sync, then one reduce-scatter."""
    out, result = fsdp_run
    assert "world size 2 (gloo, cpu)" in result.stdout and "sharded over 2 ranks" in result.stdout
    # DDP on one process, 6 micro-batches: the same global batch (the DDP tests show the split does
    # not matter)
    error, _ = train_in_process(f"data.dir={data_dir}", *FSDP_STEPS, f"out_dir={tmp_path}",
                                f"checkpoint.dir={tmp_path}/ckpt")
    assert error is None, error
    fsdp, ddp = losses(out), losses(tmp_path)
    assert sorted(fsdp) == list(range(1, 9)) and sorted(ddp) == sorted(fsdp)
    assert all(fsdp[step] == pytest.approx(ddp[step], rel=1e-5) for step in ddp), (fsdp, ddp)
    # each rank holds about half of the weights, gradients and AdamW state (dim 0 split, the last
    # shard padded)
    [fsdp_memory], [ddp_memory] = read_metrics(out, "memory"), read_metrics(tmp_path, "memory")
    assert fsdp_memory["held_bytes"] == fsdp_memory["predicted_bytes"]
    assert fsdp_memory["predicted_bytes"] == pytest.approx(ddp_memory["predicted_bytes"] / 2,
                                                           rel=0.02)
    assert read_metrics(out, "val")[-1]["val_loss"] < 0.8 * read_metrics(out, "val")[0]["val_loss"]


def test_the_blocks_fsdp_shards_are_each_models_repeated_layers_whatever_its_no_split_modules_say():
    """_no_split_modules is empty for DistilBERT, ALBERT and DeBERTa-v2: the blocks are found as the
    members of the model's outermost nn.ModuleLists instead, never one holding the input
    embedding."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForMaskedLM
    shape = dict(vocab_size=128, hidden_size=32, num_hidden_layers=3, num_attention_heads=2,
                 intermediate_size=64, max_position_embeddings=64, pad_token_id=0)
    for model_type, auto, layer in [("gpt2", AutoModelForCausalLM, "GPT2Block"),
                                    ("llama", AutoModelForCausalLM, "LlamaDecoderLayer"),
                                    ("bert", AutoModelForMaskedLM, "BertLayer"),
                                    ("distilbert", AutoModelForMaskedLM, "TransformerBlock"),
                                    ("deberta-v2", AutoModelForMaskedLM, "DebertaV2Layer"),
                                    ("albert", AutoModelForMaskedLM, "AlbertLayerGroup")]:
        model = auto.from_config(AutoConfig.for_model(model_type, **shape))
        blocks = train_ddp.repeated_blocks(model)
        assert {type(block).__name__ for block in blocks} == {layer}, model_type
        # ALBERT shares its one
        assert len(blocks) == (1 if model_type == "albert" else 3), model_type


@pytest.mark.parametrize("model_type", ["bert", "deberta-v2"])
def test_fsdp_masked_lm_with_a_tied_output_layer_gives_the_losses_of_ddp(model_type, data_dir,
                                                                         tmp_path):
    """BERT ties its output layer to the input embedding, which must stay in the root's FSDP unit,
    or the shared weight would be gathered by two units. DeBERTa-v2 lists no _no_split_modules (its
    layers are found as the members of its nn.ModuleList) and has no SDPA path (auto picks
    eager)."""
    args = [f"data.dir={data_dir}", f"model.type={model_type}", *FSDP_STEPS, "train.max_steps=3",
            "checkpoint.every=0", "export=false", "train.eval_batches=1"]
    result = torchrun(2, "train_fsdp.py", *args, f"out_dir={tmp_path}/fsdp",
                      f"checkpoint.dir={tmp_path}/fsdp/c")
    per_rank = json.loads(re.search(r"parameters per rank (\[.*\])", result.stdout).group(1))
    assert abs(per_rank[0] - per_rank[1]) <= 0.01 * per_rank[0], per_rank  # each rank holds half
    error, _ = train_in_process(*args, f"out_dir={tmp_path}/ddp",
                                f"checkpoint.dir={tmp_path}/ddp/c")  # one process
    assert error is None, error
    assert losses(tmp_path / "fsdp") == pytest.approx(losses(tmp_path / "ddp"), rel=1e-5)


# Run once on 2 gloo ranks (fsdp_shards_and_scaler): a tiny GPT-2 sharded by train_fsdp.py, trained
# two steps and exported; then a GradScaler over two fully_shard layers, with an inf in rank 1's
# shard. Each rank prints what the tests below check.
FSDP_SCRIPT = """
import json, os, sys
sys.path.insert(0, REPO)
import torch, torch.distributed as dist
from torch.distributed.fsdp import fully_shard
import train_fsdp
out = sys.argv[1]
dist.init_process_group("gloo")
rank, device = dist.get_rank(), torch.device("cpu")
cfg = train_fsdp.load_config(TINY_MODEL + ["model.dropout=0.0", "train.compile=false"],
                             use_cuda=False)
special = {"eot": 0, "pad": 1, "mask": 2, "cls": 3, "sep": 4}
meta = {"vocab_size": 448, "special_tokens": special}
torch.manual_seed(0)
model, _ = train_fsdp.shard_model(cfg, train_fsdp.ArrowTokens, meta, device, False, None)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
ids = torch.randint(5, 448, (4, 64), generator=torch.Generator().manual_seed(0))
for _ in range(2):
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    optimizer.zero_grad()
local = {"parameters": sum(p.to_local().numel() for p in model.parameters()),
         "total": sum(p.numel() for p in model.parameters()),
         "adam_state": sum(v.to_local().numel() for s in optimizer.state.values()
                           for v in s.values() if v.dim() > 0)}
with torch.no_grad():
    logits = model(input_ids=ids).logits
full_model = train_fsdp.gather_full_model(model, train_fsdp.ArrowTokens)
if rank == 0:
    full_model.save_pretrained(f"{out}/export")
    torch.save(logits, f"{out}/logits.pt")

# the plain torch.amp.GradScaler over FSDP2's sharded gradients
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))
for layer in model:
    fully_shard(layer)
fully_shard(model)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
scaler.scale(model(torch.ones(2, 8)).sum()).backward()
if rank == 1:
    next(model.parameters()).grad.to_local().view(-1)[0] = float("inf")  # in rank 1's shard only
before = next(model.parameters()).detach().full_tensor().clone()
scaler.step(optimizer)
scaler.update()
unchanged = torch.equal(before, next(model.parameters()).detach().full_tensor())
local["scaler"] = {"scale": scaler.get_scale(), "unchanged": unchanged}
# one write: ranks never interleave
os.write(1, f"RESULT {rank} {json.dumps(local)}\\n".encode())
dist.destroy_process_group()
# the results are out: leave without the interpreter's teardown of torch and transformers
os._exit(0)
"""


@pytest.fixture(scope="module")
def fsdp_shards_and_scaler(tmp_path_factory):
    """(each rank's figures, the directory of the export and the sharded model's logits)."""
    out = tmp_path_factory.mktemp("fsdp_script")
    script = out / "fsdp_script.py"
    script.write_text(f"REPO, TINY_MODEL = {str(REPO)!r}, {TINY_MODEL!r}\n" + FSDP_SCRIPT)
    result = torchrun(2, script, str(out))
    per_rank = [json.loads(line.split(" ", 2)[2]) for line in result.stdout.splitlines()
                if line.startswith("RESULT")]
    assert len(per_rank) == 2, result.stdout[-3000:]
    return per_rank, out


def test_fsdp_ranks_hold_a_shard_each_and_the_export_gives_the_trained_logits(
        fsdp_shards_and_scaler):
    """Each of 2 ranks holds half the parameters and half the AdamW state; the exported directory
    loads with AutoModelForCausalLM and computes the logits the sharded model computed."""
    shares, out = fsdp_shards_and_scaler
    total = shares[0]["total"]
    for share in shares:
        assert abs(share["parameters"] - total / 2) < 0.01 * total, shares
        # exp_avg and exp_avg_sq of its shard only
        assert share["adam_state"] == 2 * share["parameters"], shares
    from transformers import AutoModelForCausalLM
    exported = AutoModelForCausalLM.from_pretrained(out / "export")
    # still tied
    assert exported.get_output_embeddings().weight is exported.get_input_embeddings().weight
    ids = torch.randint(5, 448, (4, 64), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.allclose(exported(input_ids=ids).logits, torch.load(out / "logits.pt"),
                              atol=1e-5)


def test_fsdp_grad_scaler_sees_an_overflow_in_one_ranks_shard_on_every_rank(
        fsdp_shards_and_scaler):
    """Why train_fsdp.py can train in fp16 with the plain torch.amp.GradScaler: unscale_ on FSDP2's
    sharded (DTensor) gradients all-reduces its inf check, so an overflow in one rank's shard lowers
    the scale on every rank alike, and the ranks keep one loss scale."""
    results = [share["scaler"] for share in fsdp_shards_and_scaler[0]]
    assert [r["scale"] for r in results] == [512.0, 512.0], results  # halved on both ranks
    assert all(r["unchanged"] for r in results), results  # and the step skipped on both


def test_fsdp_resume_on_another_world_size_continues_from_the_same_sample(fsdp_run, data_dir,
                                                                          tmp_path):
    """The step-4 checkpoint of 2 ranks, resumed on 3: resharded, sums over other splits round
    differently in the last bits. (On 2 ranks the restart after a kill resumes bit for bit.)"""
    from safetensors.torch import load_file
    out, _ = fsdp_run
    uninterrupted = losses(out)
    resumed_dir = tmp_path / "resumed_on_3"
    shutil.copytree(out / "ckpt" / "step_000004", resumed_dir / "ckpt" / "step_000004")
    torchrun(3, "train_fsdp.py", f"data.dir={data_dir}", *FSDP_STEPS, f"out_dir={resumed_dir}",
             f"checkpoint.dir={resumed_dir}/ckpt")
    resumed = losses(resumed_dir)
    assert sorted(resumed) == [5, 6, 7, 8]
    state = torch.load(resumed_dir / "ckpt" / "step_000008" / "train_state.pt", weights_only=True)
    assert state["samples_seen"] == 8 * 24 and state["world_size"] == 3
    assert all(resumed[step] == pytest.approx(uninterrupted[step], rel=1e-5) for step in resumed)
    final_a, final_b = load_file(out / "final" / "model.safetensors"), \
        load_file(resumed_dir / "final" / "model.safetensors")
    assert all(torch.allclose(final_a[name], final_b[name], rtol=1e-3, atol=1e-5)
               for name in final_a)


def test_fsdp_on_one_rank_trains_the_whole_model_and_trades_checkpoints_with_two_ranks(
        fsdp_run, data_dir, tmp_path):
    """One rank shards nothing: the step-4 checkpoint of 2 ranks resumes there into the whole model,
    and the step-6 checkpoint that one rank writes resumes on 2 ranks again; both give the
    uninterrupted sharded run's losses."""
    out, _ = fsdp_run
    one, two = tmp_path / "one", tmp_path / "two"
    shutil.copytree(out / "ckpt" / "step_000004", one / "ckpt" / "step_000004")
    result = torchrun(1, "train_fsdp.py", f"data.dir={data_dir}", *FSDP_STEPS, f"out_dir={one}",
                      f"checkpoint.dir={one}/ckpt", "checkpoint.every=2", "export=false")
    assert "one rank: the model is trained whole, not sharded" in result.stdout
    assert "sharded over" not in result.stdout
    shutil.copytree(one / "ckpt" / "step_000006", two / "ckpt" / "step_000006")
    result = torchrun(2, "train_fsdp.py", f"data.dir={data_dir}", *FSDP_STEPS, f"out_dir={two}",
                      f"checkpoint.dir={two}/ckpt", "export=false")
    assert "sharded over 2 ranks" in result.stdout
    uninterrupted, on_one, on_two = losses(out), losses(one), losses(two)
    assert sorted(on_one) == [5, 6, 7, 8] and sorted(on_two) == [7, 8]
    assert all(loss == pytest.approx(uninterrupted[step], rel=1e-5)
               for resumed in (on_one, on_two) for step, loss in resumed.items())


def test_fsdp_recovers_from_a_kill_while_writing_a_sharded_checkpoint_and_resumes_bit_for_bit(
        fsdp_run, data_dir, tmp_path):
    """Rank 1 dies after writing its shards of the step-8 checkpoint, before it is published: the
    restarted job resumes from step 4 on the same 2 ranks and, with the same shards and the same
    reduction order, gives the uninterrupted run's losses and weights bit for bit."""
    from safetensors.torch import load_file
    out, _ = fsdp_run
    result = torchrun(2, "train_fsdp.py", f"data.dir={data_dir}", *FSDP_STEPS,
                      f"out_dir={tmp_path}", f"checkpoint.dir={tmp_path}/ckpt",
                      env_extra={"FAULT": "kill-in-save:1:8"}, max_restarts=1)
    assert ".tmp-step_000008" in result.stdout and "resumed from" in result.stdout \
        and "step_000004" in result.stdout.split("resumed from")[1].splitlines()[0]
    assert [t["step"] for t in read_metrics(tmp_path, "train")] == list(range(1, 9))
    uninterrupted, resumed = losses(out), losses(tmp_path)
    assert all(resumed[step] == uninterrupted[step] for step in range(1, 9)), (resumed,
                                                                              uninterrupted)
    assert train_ddp.checksum_mismatch(tmp_path / "ckpt" / "step_000008") is None
    state = torch.load(tmp_path / "ckpt" / "step_000008" / "train_state.pt", weights_only=True)
    assert state["samples_seen"] == 8 * 24 and state["world_size"] == 2
    reference, recovered = load_file(out / "final" / "model.safetensors"), \
        load_file(tmp_path / "final" / "model.safetensors")
    assert all(torch.equal(reference[name], recovered[name]) for name in reference)


@pytest.fixture(scope="module")
def fsdp_nans_run(data_dir, tmp_path_factory):
    """train_fsdp.py on 2 ranks with a NaN on rank 0 in step 1 alone, then in steps 3 to 5: the
    third in a row ends the run (train.max_bad_steps=3) while step 4's checkpoint, written in the
    background, may still be in flight. Checkpoints every 2 steps."""
    out = tmp_path_factory.mktemp("fsdp_nans")
    result = torchrun(2, "train_fsdp.py", f"data.dir={data_dir}", *FSDP_STEPS,
                      "checkpoint.async_save=true", "checkpoint.every=2", "train.max_bad_steps=3",
                      f"out_dir={out}", f"checkpoint.dir={out}/ckpt",
                      env_extra={"FAULT": "nan:0:1,nan:0:3,nan:0:4,nan:0:5"}, must_pass=False)
    return out, result


def test_fsdp_a_nan_on_one_rank_skips_that_step_on_every_rank(fsdp_nans_run):
    out, result = fsdp_nans_run
    assert "step 1 | non-finite gradient: update skipped (1 in a row)" in result.stdout
    # step 2 trained
    assert "step 3 | non-finite gradient: update skipped (1 in a row)" in result.stdout
    assert [t["skipped_steps"] for t in read_metrics(out, "train")] == [1, 0, 1, 1]


def test_fsdp_publishes_a_checkpoint_written_in_the_background_before_a_run_ends_on_an_error(
        fsdp_nans_run):
    """Steps 3 to 5 have a non-finite gradient, and the third in a row ends the run while step 4's
    checkpoint (weights as good as step 2's: skipped steps change nothing) is still being written:
    it is published."""
    out, result = fsdp_nans_run
    assert_one_line_error(result, "3 steps in a row had a non-finite gradient", under_torchrun=True)
    assert sorted(p.name for p in (out / "ckpt").iterdir() if p.name != ".lock") == [
        "latest", "step_000002", "step_000004"]
    assert train_ddp.checksum_mismatch(out / "ckpt" / "step_000004") is None


@pytest.mark.parametrize("override, reason", [
    ("dist.reducer=inline", "FSDP reduce-scatters the gradients itself"),
    ("dist.grad_compression=bf16", "FSDP reduces the gradients in fp32"),
    ("dist.bucket_mb=50", "FSDP has no buckets"), ("dist.bucket_mb=0", "FSDP has no buckets"),
    ("dist.reducer=nccl", "FSDP reduce-scatters")])
def test_fsdp_refuses_each_ddp_reducer_setting_in_one_line_with_the_reason(override, reason,
                                                                           monkeypatch):
    """Refused, not ignored, and not validated as DDP would (a bucket of 0 MiB, a reducer DDP does
    not know: DDP's settings all the same); --check (launch.sh) finds it before any work."""
    import train_fsdp
    monkeypatch.setattr(sys, "argv", ["train_fsdp.py", "--check", override])
    with pytest.raises(train_fsdp.UserError) as refused:
        train_fsdp.main()
    key = re.escape(override.split("=")[0])
    assert re.fullmatch(rf"{key}=\S+ is train_ddp\.py's \({re.escape(reason)}[^)]*\) -> use "
                        rf"train_ddp\.py, or leave {key} at \S+", str(refused.value)), refused.value


def test_fsdp_names_ddps_reducer_buckets_and_all_reduce_timing_only_to_refuse_them():
    """No reducer setting, bucket, all-reduce timer or figure that would only be null here: DDP's
    names stand in DEFAULTS (the settings of the config.yaml both trainers read) and NOT_HERE (why
    each is refused), nowhere else."""
    source, tables = (REPO / "train_fsdp.py").read_text(), top_level_sources(REPO / "train_fsdp.py")
    for table in ["DEFAULTS", "NOT_HERE"]:
        source = source.replace(tables[table], "")
    ddp_only = re.compile(r"reducer|bucket|allreduce|grad_compression|comm_|exposed|no_sync|"
                          r"span_ms|time_stamp", re.IGNORECASE)
    found = [line for line in source.splitlines() if ddp_only.search(line)]
    assert not found, found


@pytest.mark.parametrize("trainer", TRAINERS)
def test_every_setting_a_trainer_does_not_read_is_refused_there_but_preprocess_settings(trainer):
    """A value given for a setting the trainer would ignore stops it, with the reason (NOT_HERE);
    data.vocab_size and data.val_fraction are preprocess.py's: the trainer notes them as such."""
    module = importlib.import_module(trainer.removesuffix(".py"))
    source = (REPO / trainer).read_text().replace(top_level_sources(REPO / trainer)["DEFAULTS"], "")
    unread = {key for key in module.flatten(module.DEFAULTS) if f"cfg.{key}" not in source}
    assert unread == set(module.NOT_HERE) | set(module.PREPROCESS_KEYS)


@pytest.mark.parametrize("trainer", TRAINERS)
def test_the_loop_waits_for_the_gpu_only_before_a_pause(trainer, monkeypatch):
    """Interval.paused synchronizes the GPU before validation or a checkpoint, so their time leaves
    the clock, and not in other steps: a wait there would idle the GPU while the host starts the
    next step."""
    module = importlib.import_module(trainer.removesuffix(".py"))
    waits = []
    monkeypatch.setattr(module.torch.cuda, "synchronize", lambda *args: waits.append(args))
    interval = module.Interval(torch.device("cpu"))
    interval.device = SimpleNamespace(type="cuda")  # what paused() looks at
    with interval.paused(False):
        pass
    assert waits == []
    with interval.paused(True):
        time.sleep(0.01)
    assert len(waits) == 1 and interval.paused_s >= 0.01


# ---- stress_test.py ------------------------------------------------------------------------------

ROW_COLUMNS = 11  # size count type op time algbw busbw #wrong p50 p95 p99


def launch_stress_test(*options, nproc=2):
    """Run stress_test.py under torchrun; returns (exit code, stdout + stderr)."""
    done = torchrun(nproc, "stress_test.py", *options, timeout=180, must_pass=False,
                    env_extra={"CUDA_VISIBLE_DEVICES": ""})
    return done.returncode, done.stdout + done.stderr


def table_rows(output):
    """{(op, size): (#wrong, the whole line)} of the table rank 0 printed."""
    rows = {}
    for line in output.splitlines():
        fields = line.split()
        if len(fields) == ROW_COLUMNS and fields[3] in OPS and fields[0].isdigit():
            rows[(fields[3], int(fields[0]))] = (int(fields[7]), line)
    return rows


def test_stress_test_whose_stdout_reader_leaves_runs_to_its_verdict(tmp_path):
    """`torchrun ... stress_test.py | head -n 1`: rank 0's later lines meet a broken pipe."""
    command = torchrun_command(2, "stress_test.py", "--ops", "all_reduce_sum", "--sizes", "1K,4K",
                               "--iters", "5", "--warmup", "1", "--json", str(tmp_path / "f.json"))
    first, code, stderr = reader_leaves_after_one_line(command, timeout=180,
                                                       env_extra={"CUDA_VISIBLE_DEVICES": ""})
    assert first.startswith("# stress_test: 2 ranks") and code == 0, stderr[-3000:]
    assert "Traceback" not in stderr, stderr[-3000:]
    assert json.loads((tmp_path / "f.json").read_text())  # rank 0 wrote its figures at the end


@pytest.fixture(scope="module")
def default_run_with_soak(tmp_path_factory):
    """The default sweep and gradient check, then a soak of 2 s (--duration only adds the soak
    after them)."""
    figures = tmp_path_factory.mktemp("stress") / "figures.json"
    code, output = launch_stress_test("--duration", "2", "--json", str(figures))
    return code, output, figures


def test_stress_test_default_run_passes_with_a_row_for_every_op(default_run_with_soak):
    code, output, _ = default_run_with_soak
    assert code == 0, output
    assert "stress_test: PASS" in output
    rows = table_rows(output)
    assert {op for op, _ in rows} == set(OPS)
    assert all(wrong == 0 for wrong, _ in rows.values())
    assert "max |grad diff| = 0 across 2 ranks" in output and "max |param diff| = 0 " in output


@pytest.fixture(scope="module")
def corrupted_run(tmp_path_factory):
    """Rank 1 flips one element of the first row's result and changes one gradient element after
    DDP's all-reduce: each checker must find its own."""
    figures = tmp_path_factory.mktemp("stress_corrupted") / "figures.json"
    code, output = launch_stress_test("--inject-corruption", "1", "--inject-grad-corruption", "1",
                                      "--sizes", "8,1K", "--iters", "5", "--warmup", "1",
                                      "--json", str(figures))
    return code, output, figures


def test_injected_corruption_fails_with_the_wrong_count_in_its_row(corrupted_run):
    code, output, figures = corrupted_run
    assert code != 0, output
    rows = table_rows(output)
    assert rows[("all_reduce_sum", 8)][0] == 1, rows[("all_reduce_sum", 8)][1]
    assert sum(wrong for wrong, _ in rows.values()) == 1  # the first row only, found exactly once
    saved = json.loads(figures.read_text())
    assert saved["passed"] is False and [row["wrong"] for row in saved["rows"]][0] == 1
    assert saved["failures"][0] == "#wrong 1 in all_reduce_sum at 8 B"


def test_gradient_check_fails_when_one_rank_holds_a_different_gradient(corrupted_run):
    code, output, _ = corrupted_run
    assert code != 0, output
    assert "max |grad diff| = 1 across 2 ranks (1 elements differ)" in output
    assert "checksums DIFFER on every rank: FAIL" in output


def test_the_verdict_names_every_failed_check(corrupted_run):
    code, output, _ = corrupted_run
    assert "stress_test: FAIL (#wrong 1 in all_reduce_sum at 8 B; gradients or parameters differ "\
           "across ranks)" in output, output
    # and as the error line launch.sh reports
    assert "\nerror: stress_test: FAIL (#wrong 1 in all_reduce_sum" in output, output


def test_a_block_from_another_rank_is_caught_in_bfloat16_on_32_ranks():
    """Values repeat every `modulus` ranks; only the ops that add need it divided by the ranks."""
    import stress_test
    ranks, share = 32, 4
    modulus = stress_test.pattern_modulus("all_gather", "bfloat16", ranks)
    gathered = torch.cat([stress_test.pattern(rank, torch.arange(share), modulus)
                          for rank in range(ranks)]).to(torch.bfloat16)
    assert stress_test.count_wrong(gathered, "all_gather", 0, ranks, share, modulus) == 0
    gathered[:share] = stress_test.pattern(8, torch.arange(share), modulus)  # rank 8's in 0's place
    assert stress_test.count_wrong(gathered, "all_gather", 0, ranks, share, modulus) == share
    modulus = stress_test.pattern_modulus("broadcast", "bfloat16", ranks)
    from_rank_16 = stress_test.pattern(16, torch.arange(8), modulus).to(torch.bfloat16)
    assert stress_test.count_wrong(from_rank_16, "broadcast", 3, ranks, 8, modulus) == 8
    summed = stress_test.pattern_modulus("all_reduce_sum", "bfloat16", ranks)
    assert summed * ranks <= stress_test.EXACT_INTEGER_LIMIT["bfloat16"]  # sums stay exact


@pytest.mark.parametrize("options, world_size, message", [
    (["--factor", "0"], 2, "--factor 0 would not grow the sweep"),
    (["--sizes", ""], 2, '--sizes "" is an empty value'),
    (["--inject-grad-corruption", "0"], 1, "needs 2 or more ranks"),
])
def test_options_that_would_run_something_else_than_asked_are_refused(options, world_size, message,
                                                                       monkeypatch, capsys):
    import stress_test
    monkeypatch.delenv("RANK", raising=False)
    with pytest.raises(SystemExit) as exit_info:
        stress_test.load_config(options, world_size=world_size)
    assert exit_info.value.code == 2 and message in capsys.readouterr().err


def test_json_path_of_a_fifo_or_too_long_a_name_is_refused_and_the_fifo_stays(tmp_path):
    """A device or a pipe would be replaced by the file written beside it and renamed: as root,
    --json /dev/null would have replaced /dev/null."""
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    for path, message in [(fifo, "is not a regular file"),
                          (tmp_path / ("a" * 250 + ".json"), "File name too long")]:
        done = subprocess.run([sys.executable, "stress_test.py", "--json", str(path), "--sizes",
                               "8", "--ops", "broadcast", "--skip-grad-check"], cwd=REPO,
                              capture_output=True, text=True, timeout=120,
                              env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
        assert done.returncode == 2 and message in done.stderr, done.stderr
    assert fifo.is_fifo()


def test_soak_checks_every_result_and_reports_skew(default_run_with_soak):
    code, output, figures = default_run_with_soak
    assert code == 0, output
    assert "soak: " in output and ", 0 wrong; arrival skew" in output \
        and "stress_test: PASS" in output
    soak = json.loads(figures.read_text())["soak"]
    assert soak["collectives"] > 0 and soak["seconds"] >= 2 \
        and len(soak["mean_wait_us_per_rank"]) == 2


def test_a_stalled_rank_ends_the_run_with_a_timeout_error():
    code, output = launch_stress_test("--inject-stall", "1", "--timeout", "3", "--sizes", "8",
                                      "--skip-grad-check")
    assert code != 0, output
    assert "error: rank 0: no collective finished for" in output


def test_a_row_slower_than_the_timeout_but_progressing_is_no_hang():
    """The watchdog times each collective, not each row: a row of 100 all-reduces of 16 MiB takes
    longer than --timeout 1 s on a CPU, each one far less."""
    code, output = launch_stress_test("--sizes", "16M", "--ops", "all_reduce_sum", "--iters", "100",
                                      "--warmup", "0", "--timeout", "1", "--skip-grad-check")
    assert code == 0 and "stress_test: PASS" in output, output
    assert float(table_rows(output)[("all_reduce_sum", 16 * 2**20)][1].split()[4]) * 100 > 1e6


def test_parse_size_reads_bytes_and_binary_units():
    assert parse_size("8") == 8
    assert parse_size("1K") == 1024
    assert parse_size("64M") == 64 * 2**20
    assert parse_size("1G") == 2**30
    assert parse_size("1g") == 2**30
    assert parse_size("100T") == 100 * 2**40
    for bad in ["", "K", "1.5M", "-8", "0", "12Q", "1 G", "1e6", "1GB"]:
        with pytest.raises(ValueError):
            parse_size(bad)


def dist_is_initialized():
    return torch.distributed.is_available() and torch.distributed.is_initialized()


@pytest.mark.parametrize("options, message", [
    (["--ops", "all_reduce_sum,allreduce"], "unknown collective 'allreduce'"),
    (["--sizes", "8,12Q"], "'12Q' is not a size"),
    (["--sizes", "100T"], "needs"),
    (["--iterz", "5"], "did you mean --iters"),
])
def test_bad_options_end_every_rank_with_one_error_line(options, message, monkeypatch, capsys):
    """Under torchrun: a mistake found before the ranks connect (--iterz) and one found after
    (100T). The other two are found in load_config too, before any rank connects, as --iterz is:
    this process runs it."""
    if options in (["--iterz", "5"], ["--sizes", "100T"]):
        code, output = launch_stress_test(*options, "--skip-grad-check")
    else:
        import stress_test
        monkeypatch.delenv("RANK", raising=False)
        with pytest.raises(SystemExit) as exit_info:
            stress_test.load_config([*options, "--skip-grad-check"], world_size=2)
        code, output = exit_info.value.code, capsys.readouterr().err
        assert not dist_is_initialized()
    assert code != 0, output
    errors = [line for line in output.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and message in errors[0], output
    # no traceback of ours (torchrun prints its own summary)
    assert 'stress_test.py", line' not in output


def test_json_path_that_cannot_be_written_is_refused_before_any_work(tmp_path):
    code, output = launch_stress_test("--json", str(tmp_path / "missing_dir" / "figures.json"),
                                      "--sizes", "8", "--skip-grad-check")
    assert code != 0, output
    errors = [line for line in output.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "cannot write into" in errors[0] and " -> " in errors[0], output
    assert "# stress_test:" not in output and "stress_test: PASS" not in output  # nothing was run
    assert not (tmp_path / "missing_dir").exists()


@pytest.mark.parametrize("options, message", [
    (["--n-head", "0"], "--n-head 0 is not positive"),
    (["--vocab-size", "0"], "--vocab-size 0 is not positive"),
    # from_config is made to fail below
    (["--model-type", "gpt2"], "--model-type gpt2 cannot be built with"),
    # nan passed `<= 0`, then broke the backends' timeout at connect
    (["--timeout", "nan"], "both finite"),
])
def test_options_that_would_fail_late_are_checked_before_any_rank_connects(monkeypatch, capsys,
                                                                           options, message):
    import stress_test
    from transformers import AutoModelForCausalLM

    def cannot_build(config):
        raise AssertionError("Padding_idx must be within num_embeddings")
    monkeypatch.setattr(AutoModelForCausalLM, "from_config", cannot_build)
    monkeypatch.delenv("RANK", raising=False)
    with pytest.raises(SystemExit) as exit_info:
        stress_test.load_config(options, world_size=2)
    assert exit_info.value.code == 2
    assert not dist_is_initialized()
    error = capsys.readouterr().err.strip()
    assert error.startswith("error: ") and message in error and " -> " in error \
        and "\n" not in error


# ---- launch.sh -----------------------------------------------------------------------------------

def test_launch_script_is_clean_under_shellcheck():
    if shutil.which("shellcheck") is None:
        pytest.fail("shellcheck is not installed -> apt-get install shellcheck (.ci/run does it)",
                    pytrace=False)
    result = run(["shellcheck", "launch.sh"])
    assert result.returncode == 0, result.stdout


TOPOLOGY = ["NNODES", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT", "NPROC_PER_NODE", "SLURM_JOB_ID",
            "SLURM_JOB_NUM_NODES", "SLURM_NNODES", "SLURM_NODEID", "SLURM_JOB_NODELIST",
            "MAX_RESTARTS", "RDZV_ID", "LOCAL_ADDR", "LOG_DIR"]


@pytest.mark.parametrize("env, expected", [
    ({}, ["--nnodes 1 --nproc-per-node 2 --max-restarts 3 --log-dir out/logs/",
          "--tee 2 --node-rank 0 --master-addr 127.0.0.1 --master-port 29500 "]),
    ({"NNODES": "4", "NODE_RANK": "3", "MASTER_ADDR": "10.0.0.7", "MASTER_PORT": "29999",
      "NPROC_PER_NODE": "8", "MAX_RESTARTS": "0", "LOG_DIR": "/logs"},
     ["--nnodes 4 --nproc-per-node 8 --max-restarts 0 --log-dir /logs/", "-node3-",
      "--rdzv-backend c10d --rdzv-endpoint 10.0.0.7:29999 --rdzv-id none --rdzv-conf is_host=0 "]),
    ({"NNODES": "2", "NODE_RANK": "0", "MASTER_ADDR": "127.0.0.1", "RDZV_ID": "run7"},
     ["--rdzv-endpoint 127.0.0.1:29500 --rdzv-id run7 --rdzv-conf is_host=1 "
      "--local-addr 127.0.0.1 "]),
    ({"SLURM_JOB_ID": "77", "SLURM_JOB_NUM_NODES": "2", "SLURM_NODEID": "1",
      "SLURM_JOB_NODELIST": "gpu[07-08]", "LOCAL_ADDR": "10.0.0.8"},
     ["--nnodes 2 --nproc-per-node 2 --max-restarts 3",
      "--rdzv-backend c10d --rdzv-endpoint gpu07:29500 --rdzv-id 77 --rdzv-conf is_host=0 "
      "--local-addr 10.0.0.8 "]),
])
def test_launch_dry_run_prints_the_torchrun_command(env, expected, tmp_path):
    fake_bin = tmp_path / "bin"  # stands in for Slurm's scontrol, which expands the node list
    fake_bin.mkdir()
    # The pause makes the second line come after a reader that wants only the first may have gone: a
    # `scontrol | head -n 1` under `set -o pipefail` then dies of SIGPIPE (exit 141), as CI once saw
    # by chance.
    (fake_bin / "scontrol").write_text("#!/bin/sh\necho gpu07\nsleep 0.3\necho gpu08\n")
    (fake_bin / "scontrol").chmod(0o755)
    clean = {key: value for key, value in os.environ.items() if key not in TOPOLOGY}
    clean.update(env, LAUNCH_DEVICE="cpu", PATH=f"{fake_bin}:{os.environ['PATH']}")
    result = subprocess.run(["bash", "launch.sh", "--dry-run", "train.max_steps=3"], cwd=REPO,
                            env=clean, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert all(fragment in result.stdout for fragment in expected), result.stdout
    # multi-node: the c10d rendezvous replaces the static one, whose node rank and master it would
    # ignore
    nodes = int(env.get("NNODES", env.get("SLURM_JOB_NUM_NODES", 1)))
    assert ("--node-rank" in result.stdout) == (nodes == 1)
    assert result.stdout.strip().endswith("train_ddp.py train.max_steps=3")


@pytest.mark.parametrize("slurm, scontrol, message", [
    ({"SLURM_NTASKS_PER_NODE": "8", "SLURM_JOB_NODELIST": "gpu[07-08]"}, "echo gpu07",
     "srun --ntasks-per-node=1"),
    ({}, '[ -n "$3" ] && echo gpu07', "scontrol named no first node"),  # no SLURM_JOB_NODELIST
    ({"SLURM_JOB_NODELIST": "gpu[07-08]"}, "echo 'Unable to contact slurm controller' >&2; exit 1",
     "scontrol named no first node"),
])
def test_launch_under_half_set_slurm_variables_fails_in_one_line(slurm, scontrol, message,
                                                                 tmp_path):
    (tmp_path / "scontrol").write_text(f"#!/bin/sh\n{scontrol}\n")
    (tmp_path / "scontrol").chmod(0o755)
    clean = {key: value for key, value in os.environ.items() if key not in TOPOLOGY}
    env = {**clean, "SLURM_JOB_ID": "77", "SLURM_JOB_NUM_NODES": "2", "SLURM_NODEID": "0", **slurm,
           "PATH": f"{tmp_path}:{os.environ['PATH']}"}
    result = subprocess.run(["bash", "launch.sh", "--dry-run"], cwd=REPO, env=env,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and "FAIL:" in result.stdout and message in result.stdout, \
        result.stdout + result.stderr
    assert "unbound variable" not in result.stderr


def test_launch_restarts_and_checks_only_our_trainers_keeps_paths_as_given_and_has_help(tmp_path):
    """A user's own train_mine.py is launched as is, once (its --check would have run it); a
    renamed copy of ours is ours; a path names that file, not this repository's of that name."""
    shutil.copy(REPO / "train_ddp.py", tmp_path / "train_copy.py")
    (tmp_path / "train_mine.py").write_text("print('my own trainer')\n")
    clean = {key: value for key, value in os.environ.items() if key not in TOPOLOGY}

    def dry_run(*args, **env):
        result = subprocess.run(["bash", str(REPO / "launch.sh"), "--dry-run", *args], cwd=tmp_path,
                                env={**clean, "LAUNCH_DEVICE": "cpu", **env}, capture_output=True,
                                text=True, timeout=60)
        assert result.returncode == 0, result.stderr
        return result.stdout

    assert "--max-restarts 0 " in dry_run("train_mine.py")
    assert "--max-restarts 0 " in dry_run("stress_test.py")
    assert "--max-restarts 3 " in dry_run("train_copy.py")
    assert dry_run("elsewhere/train_ddp.py").strip().endswith(" elsewhere/train_ddp.py")
    # one node: its loopback, not an address a shell kept from a multi-node job
    assert "--master-addr 127.0.0.1 " in dry_run(MASTER_ADDR="no.such.host.invalid")
    usage = subprocess.run(["bash", "launch.sh", "--help"], cwd=REPO, capture_output=True,
                           text=True, timeout=60)
    assert usage.returncode == 0 and usage.stdout.startswith("launch.sh: check that this machine")
    assert "Exit codes:" in usage.stdout and "set -euo" not in usage.stdout


def write_fake_torch(directory, cuda_available, gpus=0, nccl=(2, 21, 5)):
    """A stand-in torch package for the checks that need hardware this machine lacks."""
    package = directory / "torch"
    (package / "cuda").mkdir(parents=True)
    (package / "distributed").mkdir()
    (package / "__init__.py").write_text("__version__ = 'fake'\nfrom . import cuda, distributed\n")
    (package / "cuda" / "__init__.py").write_text(
        f"from . import nccl\ndef is_available(): return {cuda_available}\n"
        f"def device_count(): return {gpus}\n")
    (package / "cuda" / "nccl.py").write_text(f"def version(): return {nccl}\n")
    (package / "distributed" / "__init__.py").write_text("def is_nccl_available(): return True\n")
    return str(directory)


@pytest.mark.parametrize("case", ["script", "torch", "cuda", "nccl", "processes", "config", "data",
                                  "checkpoint", "port", "master", "master_before_data",
                                  "port_not_a_number", "port_out_of_range", "nodes", "node_rank",
                                  "restarts", "log_dir", "not_a_rendezvous_server",
                                  "master_address", "device"])
def test_each_launch_check_fails_with_its_message(case, data_dir, tmp_path, busy_port):
    """Break one condition at a time; the launch stops at that check with a reason and a fix.
    Hardware this machine lacks (GPUs, NCCL) is played by a stand-in torch package."""
    trainer_args = [f"data.dir={data_dir}", f"checkpoint.dir={tmp_path}/ckpt",
                    f"out_dir={tmp_path}"]
    env = {"MASTER_PORT": str(free_port()), "LAUNCH_DEVICE": "auto", "NNODES": "1",
           "NODE_RANK": "0", "LOG_DIR": str(tmp_path / "logs")}
    (tmp_path / "a_file").write_text("")
    (tmp_path / "broken" / "torch").mkdir(parents=True)
    broken_init = tmp_path / "broken" / "torch" / "__init__.py"
    broken_init.write_text("raise ImportError('broken install')\n")
    worker_node = {"NNODES": "2", "NODE_RANK": "1", "MASTER_ADDR": "127.0.0.1",
                   "MASTER_WAIT_S": "1"}
    # case: (arguments of launch.sh, environment, name of the check that must fail, part of its
    # message)
    cases = {
        "script": (["train_nope.py"], {}, "script", "not found"),
        "torch": (trainer_args, {"PYTHONPATH": str(tmp_path / "broken")}, "python and torch",
                  "cannot import torch"),
        "cuda": (["stress_test.py"],
                 {"PYTHONPATH": write_fake_torch(tmp_path / "no_cuda", False),
                  "LAUNCH_DEVICE": "cuda"},
                 "cuda", "is_available() is False"),
        "nccl": (["stress_test.py"],
                 {"PYTHONPATH": write_fake_torch(tmp_path / "old_nccl", True, 2, (2, 8, 3)),
                  "LAUNCH_DEVICE": "cuda", "NPROC_PER_NODE": "2"},
                 "nccl", "NCCL 2.8.3"),
        "processes": (["stress_test.py"],
                      {"PYTHONPATH": write_fake_torch(tmp_path / "one_gpu", True, 1),
                       "LAUNCH_DEVICE": "cuda", "NPROC_PER_NODE": "4"},
                      "processes per node", "only 1 GPUs"),
        "config": ([*trainer_args, "optim.learning_rate=1e-3"], {}, "config",
                   "optim.learning_rate"),
        "data": ([f"data.dir={tmp_path}/nothing_here", *trainer_args[1:]], {}, "data",
                 "no prepared data"),
        "checkpoint": ([trainer_args[0], f"checkpoint.dir={tmp_path}/a_file/ckpt"], {},
                       "checkpoint dir", "cannot create"),
        "port": (["stress_test.py"], {"MASTER_PORT": str(busy_port)}, "master port",
                 "Address already in use"),
        "master": (["stress_test.py"], worker_node, "master", "unreachable after 1s"),
        # a worker node waits for node 0, which prepares the data, before it looks for the data
        # itself
        "master_before_data": ([f"data.dir={tmp_path}/nothing_here", *trainer_args[1:]],
                               {**worker_node, "NPROC_PER_NODE": "1"}, "master",
                               "unreachable after 1s"),
        "port_not_a_number": (["stress_test.py"], {"MASTER_PORT": "abc"}, "master port",
                              "MASTER_PORT=abc is not a port"),
        "port_out_of_range": (["stress_test.py"], {"MASTER_PORT": "70000"}, "master port",
                              "not a port number 1..65535"),
        "nodes": (["stress_test.py"], {"NNODES": "two"}, "nodes", "NNODES=two"),
        "node_rank": (["stress_test.py"], {"NNODES": "2", "NODE_RANK": "2"}, "node rank",
                      "from 0 to 1"),
        "restarts": (["stress_test.py"], {"MAX_RESTARTS": "-1"}, "restarts", "MAX_RESTARTS=-1"),
        # 127.0.0.1 would leave node 0 waiting for nodes that cannot reach it
        "master_address": (["stress_test.py"], {"NNODES": "2", "NODE_RANK": "0"},
                           "master address", "no MASTER_ADDR"),
        "device": (["stress_test.py"], {"LAUNCH_DEVICE": "gpu"}, "device", "LAUNCH_DEVICE=gpu"),
        "log_dir": (["stress_test.py"], {"LOG_DIR": str(tmp_path / "a_file" / "logs")}, "log dir",
                    "cannot create"),
        # something that accepts connections but never answers: a TCPStore client alone would wait
        # for ever
        "not_a_rendezvous_server": (["stress_test.py"],
                                    {**worker_node, "MASTER_PORT": str(busy_port)}, "master",
                                    "answers but is not a torchrun rendezvous server"),
    }
    args, case_env, expected, fragment = cases[case]
    result = run(["bash", "launch.sh", *args], env_extra={**env, **case_env}, timeout=60)
    assert result.returncode == 2  # a mistake to fix
    failures = [line for line in result.stdout.splitlines() if "FAIL:" in line]
    assert len(failures) == 1, result.stdout + result.stderr
    assert failures[0].split("FAIL:")[0].strip() == expected, failures[0]
    # every failure says what is wrong and how to fix it
    assert fragment in failures[0] and " -> " in failures[0]
    assert "launching:" not in result.stdout
    assert "Traceback" not in result.stdout + result.stderr


# Throwaway worker scripts for the tests of launch.sh's own behaviour: no torch import, so they
# start at once.
FAILS_ON_FIRST_ATTEMPT = """import os, sys
attempt, rank = os.environ["TORCHELASTIC_RESTART_COUNT"], os.environ["RANK"]
if attempt == "0" and rank == "1":
    sys.exit(1)
print(f"rank {rank} finished attempt {attempt}")
"""
RANK_1_FAILS = """import os, sys
if os.environ["RANK"] == "1":
    print("reading shard 7", file=sys.stderr)
    if sys.argv[1] == "says-why":
        print("error: shard 7 is truncated -> run preprocess.py again", file=sys.stderr)
    sys.exit(4)
"""
SLEEPS = """import os, sys, time
with open(os.path.join(sys.argv[1], f"{os.getpid()}.pid"), "w") as pid_file:
    pid_file.write(str(os.getppid()))  # torchrun's pid
time.sleep(120)
"""
# Rank 1 says it began; both ranks wait for the go-ahead (a file, or a SIGTERM), then end as told:
# a one-line error, a crash, or a stop after a checkpoint.
ENDS_AS_TOLD = """import os, signal, sys, time
go, ending = sys.argv[1:]
rank = os.environ["RANK"]
signal.signal(signal.SIGTERM, lambda *_: open(go, "a").close())
if rank == "1":
    print("reading shard 7", file=sys.stderr, flush=True)
deadline = time.monotonic() + 30
while not os.path.exists(go):
    if time.monotonic() > deadline:
        sys.exit("no go-ahead came: the line above did not reach the test at once")
    time.sleep(0.05)
if ending == "stop":
    if rank == "0":
        print("stopped at step 5 by a stop signal; checkpoint ckpt/step_000005 is written",
              file=sys.stderr)
    sys.exit(3)
if rank == "1" and ending == "error":
    print("error: shard 7 is truncated -> run preprocess.py again", file=sys.stderr)
    sys.exit(2)
if rank == "1":
    raise ValueError("a bug")
"""
# launch.sh's config check asks a trainer for these (its data and checkpoints beside it); this one
# then sleeps
FAKE_TRAINER = """import os, sys, time
if "--check" in sys.argv:
    here = os.path.dirname(os.path.abspath(__file__))
    resume = [arg for arg in sys.argv if arg.startswith("checkpoint.resume=")]
    print(f"data.dir={here}/data", f"checkpoint.dir={here}/ckpt",
          (resume or ["checkpoint.resume=auto"])[-1], "dist.timeout_s=60", "data.kind=text",
          sep="\\n")
    sys.exit()
print("training", flush=True)
time.sleep(120)
"""


def launch_script(tmp_path, source, *args, env_extra=None, popen=False, name="worker.py"):
    """launch.sh with a throwaway worker script on 2 CPU processes; its logs in tmp_path/logs."""
    script = tmp_path / name
    script.write_text(source)
    env = {"LAUNCH_DEVICE": "cpu", "NNODES": "1", "NODE_RANK": "0", "NPROC_PER_NODE": "2",
           "MASTER_PORT": str(free_port()), "LOG_DIR": str(tmp_path / "logs"), **(env_extra or {})}
    command = ["bash", "launch.sh", str(script), *map(str, args)]
    if popen:
        return subprocess.Popen(command, cwd=REPO, env={**os.environ, **env},
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    return run(command, env_extra=env, timeout=120)


def test_the_launching_line_is_a_command_to_copy_with_each_argument_quoted(tmp_path):
    """A value with a space (log.sample_prompt=def f) must read back as one argument."""
    result = launch_script(tmp_path, "import sys\nprint('argv', sys.argv[1:])\n", "a b", "it's",
                           env_extra={"NPROC_PER_NODE": "1"})
    assert result.returncode == 0, result.stdout + result.stderr
    line = next(line for line in result.stdout.splitlines() if line.startswith("launching: "))
    command = shlex.split(line.removeprefix("launching: "))
    assert command[-3:] == [str(tmp_path / "worker.py"), "a b", "it's"], line
    assert "argv ['a b', \"it's\"]" in result.stdout


def test_a_failed_worker_is_restarted_and_the_run_finishes(tmp_path):
    # a script other than a trainer is restarted only when asked: it has no checkpoint to resume
    result = launch_script(tmp_path, FAILS_ON_FIRST_ATTEMPT, env_extra={"MAX_RESTARTS": "3"})
    assert result.returncode == 0, result.stdout + result.stderr
    assert "rank 1 finished attempt 1" in result.stdout \
        and "rank 0 finished attempt 1" in result.stdout
    assert "done after 1 restart(s) of the workers (MAX_RESTARTS=3)" in result.stdout


@pytest.mark.parametrize("says_why", [True, False])
def test_a_failed_run_names_the_rank_and_its_error_line_or_its_last_stderr_lines(tmp_path,
                                                                                 says_why):
    result = launch_script(tmp_path, RANK_1_FAILS, "says-why" if says_why else "silent",
                           env_extra={"MAX_RESTARTS": "0" if says_why else "1"})
    assert result.returncode == 1  # torchrun's code for a failed worker: a restart may help
    failure = [line for line in result.stderr.splitlines() if line.startswith("FAIL:")]
    assert len(failure) == 1, result.stderr
    assert "worker.py failed" in failure[0] and str(tmp_path / "logs") in failure[0]
    if says_why:
        assert ('rank 1 exited first (exit code 4); local rank 1 wrote "error: shard 7 is '
                'truncated -> run preprocess.py again"') in failure[0]
    else:
        assert ("rank 1 (local rank 1 on this node) exited first (exit code 4) without an 'error:' "
                "line") in failure[0]
        # the last attempt: MAX_RESTARTS=1 restarted it once
        assert "attempt_1/1/stderr.log" in failure[0]
        assert result.stderr.split(failure[0])[1].splitlines()[1] == "    reading shard 7"


@pytest.mark.parametrize("ending", ["error", "stop", "crash"])
def test_a_rank_that_says_why_in_one_line_ends_without_torchruns_traceback_a_crash_keeps_it(
        tmp_path, ending):
    """torchrun ends a failure (or a stop) with its own traceback and summary of the ranks: after
    the trainer's one-line error or stop line that is noise, after a crash it is kept. Lines stream
    as they come, and the exit code is launch.sh's: 2 a mistake, 3 stopped, 1 a crash."""
    go = tmp_path / "go"
    launch = launch_script(tmp_path, ENDS_AS_TOLD, go, ending, env_extra={"MAX_RESTARTS": "0"},
                           popen=True)
    try:
        seen = []
        for line in launch.stderr:  # while the ranks wait: the line came at once
            seen.append(line)
            if "reading shard 7" in line:
                break
        if ending == "stop":
            launch.send_signal(signal.SIGTERM)
        else:
            go.touch()
        stdout, stderr = launch.communicate(timeout=60)
    finally:
        kill_process_tree(launch.pid)
    stderr = "".join(seen) + stderr
    lines = stderr.splitlines()
    assert launch.returncode == {"error": 2, "stop": 3, "crash": 1}[ending], stdout + stderr
    assert "no go-ahead came" not in stderr, stderr
    if ending == "crash":  # the worker's traceback, torchrun's summary, then launch.sh's line
        assert "[default1]:ValueError: a bug" in stderr
        summary = lines.index("Root Cause (first observed failure):")
        assert summary < [n for n, line in enumerate(lines) if line.startswith("FAIL:")][0]
        return
    assert "Traceback" not in stderr and "Root Cause" not in stderr, stderr
    ending_line = {"error": "[default1]:error: shard 7 is truncated -> run preprocess.py again",
                   "stop": "[default0]:stopped at step 5 by a stop signal"}[ending]
    assert any(line.startswith(ending_line) for line in lines), stderr
    assert lines[-1].startswith({"error": "FAIL: worker.py failed: rank 1 exited first",
                                 "stop": "stopped at step 5 by a stop signal"}[ending]), stderr


@pytest.mark.parametrize("exception", ["torch.distributed.elastic.multiprocessing.api."
                                       "SignalException: Process 9 got signal: 15",
                                       "ValueError: a bug"])
def test_torchruns_own_traceback_is_held_back_whole_even_with_a_blank_line_in_it(tmp_path,
                                                                                exception):
    """A signal that lands on a `def` line prints a blank line inside torchrun's traceback; the
    filter holds back the whole traceback all the same, and passes any other one on unchanged."""
    launch = (REPO / "launch.sh").read_text()
    function = re.search(r"^hold_back_torchruns_traceback\(\) \{\n.*?^\}\n", launch,
                         re.MULTILINE | re.DOTALL).group(0)
    traceback = ["Traceback (most recent call last):", '  File "api.py", line 91, in wait',
                 "    def num_nodes_waiting(self):", "", '  File "api.py", line 86, in handler',
                 "    raise SignalException()", exception]
    stream = "\n".join(["[default0]:stopped at step 5", *traceback, "after"]) + "\n"
    held = tmp_path / "held.log"
    script = f"{function}HELD_BACK={held}\nhold_back_torchruns_traceback"
    result = subprocess.run(["bash", "-c", script], input=stream, capture_output=True, text=True,
                            timeout=60)
    if exception.startswith("torch."):
        assert result.stdout == "[default0]:stopped at step 5\n", result.stdout
        assert held.read_text() == "\n".join([*traceback, "after"]) + "\n"
    else:
        assert result.stdout == stream and not held.exists(), result.stdout


def test_launch_prepares_the_default_data_however_the_config_names_it_and_no_other(tmp_path):
    """The digits are prepared for data.dir=data/digits as for data.dir left at its default; the
    launch then stops at the next check (a checkpoint.dir below a file), before any process."""
    (tmp_path / "a_file").write_text("")
    env = {"LAUNCH_DEVICE": "cpu", "NNODES": "1", "NODE_RANK": "0", "MASTER_PORT": str(free_port()),
           "LOG_DIR": str(tmp_path / "logs")}
    result = run(["bash", str(REPO / "launch.sh"), "model.type=vit", "data.dir=data/digits",
                  f"checkpoint.dir={tmp_path}/a_file/ckpt"], env_extra=env, cwd=tmp_path)
    assert "preparing the default images data into data/digits" in result.stdout, result.stdout
    assert (tmp_path / "data" / "digits" / "meta.json").is_file()
    assert result.returncode == 2 and re.search(r"^checkpoint dir +FAIL: cannot create",
                                                result.stdout, re.MULTILINE), result.stdout


def test_a_mistake_the_trainer_finds_after_the_launch_checks_exits_2_through_launch(tmp_path):
    """meta.json exists, so launch.sh's checks pass; the trainer refuses it after the process group
    is up. torchrun exits 1 for any failed worker; launch.sh passes the trainer's 2 on."""
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "meta.json").write_text("{}")
    result = run(["bash", "launch.sh", f"data.dir={tmp_path}/data", f"out_dir={tmp_path}",
                  f"checkpoint.dir={tmp_path}/ckpt"],
                 env_extra={"LAUNCH_DEVICE": "cpu", "NNODES": "1", "NODE_RANK": "0",
                            "NPROC_PER_NODE": "2", "MAX_RESTARTS": "0",
                            "MASTER_PORT": str(free_port()), "LOG_DIR": str(tmp_path / "logs")},
                 timeout=180)
    assert result.returncode == 2, result.stdout[-2000:] + result.stderr[-2000:]
    failure = [line for line in result.stderr.splitlines() if line.startswith("FAIL:")]
    assert len(failure) == 1 and "(exit code 2)" in failure[0] \
        and "has format version None" in failure[0], result.stderr[-2000:]


def test_sigterm_to_launch_stops_torchrun_and_every_worker_and_exits_non_zero(tmp_path):
    pid_dir = tmp_path / "pids"
    pid_dir.mkdir()
    launch = launch_script(tmp_path, SLEEPS, pid_dir, popen=True)
    run_pids = []
    try:
        deadline = time.monotonic() + 60
        while len(list(pid_dir.glob("*.pid"))) < 2:
            assert launch.poll() is None and time.monotonic() < deadline, launch.communicate()
            time.sleep(0.1)
        time.sleep(0.2)  # both pid files written in full
        workers = [int(p.stem) for p in pid_dir.glob("*.pid")]
        run_pids = [*workers, int(next(pid_dir.glob("*.pid")).read_text())]  # and torchrun's
        launch.send_signal(signal.SIGTERM)  # to launch.sh alone, as `kill PID` would
        # generous: torchrun waits up to 30 s for workers
        stdout, stderr = launch.communicate(timeout=30)
        survivors = [pid for pid in run_pids if is_running(pid)]
    finally:  # whatever happened, leave no process of this test behind
        for pid in [launch.pid, *run_pids]:
            if is_running(pid):
                os.kill(pid, signal.SIGKILL)
    assert launch.returncode == 143, stdout + stderr
    assert "FAIL: stopped by SIGTERM" in stderr
    assert not survivors


def test_a_second_stop_signal_while_launch_waits_leaves_it_watching_torchrun(tmp_path):
    """launch.sh's trap for a stop signal, as launch.sh defines it, under its set -e: a second
    signal that interrupts a `wait` must not end the script, which would leave torchrun running."""
    text = (REPO / "launch.sh").read_text()
    trap = re.search(r"^stop_torchrun\(\) \{.*?^\}\n", text, re.MULTILINE | re.DOTALL).group(0)
    script = tmp_path / "probe.sh"
    script.write_text("set -euo pipefail\nSTOPPED_BY='' STOPPED_AT_ONCE='' STARTING=1\n" + trap +
                      "trap 'stop_torchrun TERM' TERM\n"
                      # stands for torchrun; deaf to SIGTERM, so it outlives both signals
                      "( trap '' TERM; sleep 60 ) >/dev/null &\n"
                      "TORCHRUN_PID=$!\n"
                      "echo waiting\n"
                      "wait \"$TORCHRUN_PID\" || echo \"first signal: wait $?\"\n"
                      "wait \"$TORCHRUN_PID\" || echo \"second signal: wait $?\"\n"
                      "echo still watching\n")
    probe = subprocess.Popen(["bash", str(script)], stdout=subprocess.PIPE, text=True,
                             start_new_session=True)
    try:
        assert probe.stdout.readline() == "waiting\n"
        time.sleep(0.3)
        for _ in range(2):
            probe.send_signal(signal.SIGTERM)
            time.sleep(0.5)
        stdout, _ = probe.communicate(timeout=30)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(probe.pid, signal.SIGKILL)  # the sleep
    assert "second signal: wait 143" in stdout and "still watching" in stdout, \
        (probe.returncode, stdout)


@pytest.mark.parametrize("resume, command", [
    ("auto", "run the same command again"),
    ("never", "run the same command with checkpoint.resume=auto added"),
])
def test_a_launch_stopped_before_the_trainers_line_names_the_command_that_resumes(tmp_path, resume,
                                                                                   command):
    """With checkpoint.resume=never the same command would refuse the checkpoints it wrote."""
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "meta.json").write_text("{}")
    launch = launch_script(tmp_path, FAKE_TRAINER, f"checkpoint.resume={resume}", popen=True,
                           name="train_fake.py")
    try:
        seen = []
        for line in launch.stdout:
            seen.append(line)
            if line.startswith("training"):
                break
        launch.send_signal(signal.SIGTERM)
        stdout, stderr = launch.communicate(timeout=60)
    finally:
        kill_process_tree(launch.pid)
    assert launch.returncode == 143, "".join(seen) + stdout + stderr
    failure = [line for line in stderr.splitlines() if line.startswith("FAIL: stopped by SIGTERM")]
    assert len(failure) == 1 and f"-> {command} to continue" in failure[0], stderr


# Rank 0 leaves a process behind in a session of its own, as torchrun leaves the workers it was
# starting when a signal came: they outlive torchrun
LEAVES_A_PROCESS = FAKE_TRAINER.replace('print("training", flush=True)', """import subprocess
if os.environ["LOCAL_RANK"] == "0":
    left = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"],
                            start_new_session=True)
    with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "left.tmp"), "w") as file:
        file.write(str(left.pid))
    os.rename(file.name, file.name.replace(".tmp", ".pid"))
print("training", flush=True)""")


def test_a_stopped_launch_ends_the_processes_torchrun_lost(tmp_path):
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "meta.json").write_text("{}")
    launch = launch_script(tmp_path, LEAVES_A_PROCESS, popen=True, name="train_fake.py")
    left_pid = None
    try:
        deadline = time.monotonic() + 60
        while not (tmp_path / "left.pid").exists():
            assert launch.poll() is None and time.monotonic() < deadline, launch.communicate()
            time.sleep(0.1)
        left_pid = int((tmp_path / "left.pid").read_text())
        launch.send_signal(signal.SIGTERM)
        stdout, stderr = launch.communicate(timeout=60)
        still_running = is_running(left_pid)
    finally:
        kill_process_tree(launch.pid)
        if left_pid and is_running(left_pid):
            os.kill(left_pid, signal.SIGKILL)
    assert launch.returncode == 143, stdout + stderr
    assert not still_running
    assert "note: torchrun exited and left 1 of its processes running: ended them" in stderr


# ---- launch.sh: two hosts ------------------------------------------------------------------------

@pytest.fixture(scope="module")
def two_hosts():
    """Two network namespaces joined by a veth pair (bench.py's make_two_hosts): "hosts" 10.77.0.1
    and 10.77.0.2, each with its own loopback and ports, sharing this machine's files. Yields
    {address: (namespace, interface)}."""
    if shutil.which("ip") is None:
        pytest.skip("no `ip` command (iproute2) to make network namespaces: apt-get install "
                    "iproute2")
    if os.geteuid() != 0:
        pytest.skip("making network namespaces needs root")
    tag = f"{os.getpid() % 100000}"  # interface names may have at most 15 characters
    hosts = [("10.77.0.1", f"lt{tag}a", f"ltv{tag}a"), ("10.77.0.2", f"lt{tag}b", f"ltv{tag}b")]
    bench = load_bench()
    try:
        problem = bench.make_two_hosts(hosts)
        if problem:
            pytest.skip(f"cannot make two network namespaces here ({problem})")
        yield {address: (namespace, interface) for address, namespace, interface in hosts}
    finally:
        bench.remove_two_hosts(hosts)  # and anything a failed test left running in them


def launch_on_host(hosts, address, node_rank, *args, env_extra=None):
    """Start launch.sh inside the namespace of `address` as node `node_rank` of 2, master
    10.77.0.1."""
    namespace, interface = hosts[address]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "LAUNCH_DEVICE": "cpu",
           "NNODES": "2", "NODE_RANK": str(node_rank), "MASTER_ADDR": "10.77.0.1",
           "MASTER_PORT": "29500",
           # gloo would take the address of this machine's host name, which neither namespace has
           "GLOO_SOCKET_IFNAME": interface, **(env_extra or {})}
    return subprocess.Popen(["ip", "netns", "exec", namespace, "bash",
                             "launch.sh", *map(str, args)], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_two_hosts_train_together_with_one_rank_each(two_hosts, data_dir, tmp_path):
    """One process per host: every collective crosses from one namespace to the other."""
    # one directory: the two "hosts" share this machine's files
    args = [f"data.dir={data_dir}", *EIGHT_STEPS, "train.max_steps=2", f"out_dir={tmp_path}",
            f"checkpoint.dir={tmp_path}/ckpt"]
    nodes = [launch_on_host(two_hosts, address, rank, *args,
                            env_extra={"LOG_DIR": str(tmp_path / "logs"), "NPROC_PER_NODE": "1"})
             for rank, address in enumerate(two_hosts)]
    outputs = [node.communicate(timeout=240) for node in nodes]
    for node, (stdout, stderr) in zip(nodes, outputs):
        assert node.returncode == 0, stdout[-3000:] + stderr[-3000:]
    assert "world size 2 (gloo, cpu)" in outputs[0][0]
    assert ("master                     ok (10.77.0.1:29500 answers as a torchrun rendezvous "
            "server)") in outputs[1][0]
    assert read_metrics(tmp_path, "start")[0]["world_size"] == 2
    assert [t["step"] for t in read_metrics(tmp_path, "train")] == [1, 2]


# ---- bench/ --------------------------------------------------------------------------------------

def test_bench_reads_nanogpt_and_our_logs_over_the_same_window_and_writes_one_row_per_figure():
    bench = load_bench()
    # nanoGPT: iterations 0..5 are steps 1..6; skip 2 steps -> iterations 2..5, 4 x 1000 tokens
    # in 4 x 0.5 s
    nanogpt_output = "step 0: train loss 9.0, val loss 9.0\n" + "".join(
        f"iter {i}: loss 9.0{i}, time {30000.0 if i < 2 else 500.0:.2f}ms, mfu -100.00%\n"
        for i in range(6))
    theirs = bench.read_nanogpt_log(nanogpt_output, tokens_per_step=1000, skip_steps=2)
    assert theirs["tokens_per_sec"] == pytest.approx(2000.0) and theirs["window"] == "steps 3-6"
    # ours: intervals of 2 steps; skip 2 -> steps 3-4 (2000 tokens at 1000/s) and 5-6 (2000 at
    # 4000/s)
    records = [{"kind": "start", "step": 0}, {"kind": "val", "step": 0, "val_loss": 9.0}]
    for step, tokens_per_sec, data_wait in [(2, 10.0, 0.9), (4, 1000.0, 0.2), (6, 4000.0, 0.3)]:
        records.append({"kind": "train", "step": step, "tokens_seen": 1000 * step,
                        "tokens_per_sec": tokens_per_sec, "mfu": tokens_per_sec / 1e4,
                        "mem_peak_gib": step / 2, "data_wait_frac": data_wait})
    ours = bench.read_our_metrics(records, skip_steps=2)
    # the window's tokens over its time, not a mean of rates
    assert ours["tokens_per_sec"] == pytest.approx(4000 / 2.5)
    assert ours["mfu"] == pytest.approx(0.16) and ours["peak_mem_gib"] == 3.0 \
        and ours["window"] == "steps 3-6"
    # weighted by interval time
    assert ours["data_wait_fraction"] == pytest.approx((0.2 * 2 + 0.3 * 0.5) / 2.5)
    assert ours["steps_per_sec"] == pytest.approx(4 / 2.5) \
        and ours["tokens_per_sec_max_over_min"] == 4.0
    on_cpu = [{**r, "mfu": None, "mem_peak_gib": None, "data_wait_frac": None} for r in records[2:]]
    # null figures stay null, no error
    assert bench.read_our_metrics(on_cpu, skip_steps=2)["mfu"] is None
    # an interval that straddles the window's start (steps 1-2 with skip 1) is left out whole, and
    # the window says where it starts
    straddled = bench.read_our_metrics(records, skip_steps=1)
    assert straddled["tokens_per_sec"] == ours["tokens_per_sec"] \
        and straddled["window"] == "steps 3-6"
    # so every stage skips whole logged intervals: its window is the one its name says
    for name, stage in bench.STAGES.items():
        if "log_every" in stage:
            assert stage["skip_steps"] % stage["log_every"] == 0, name

    common = {"date": "2026-12-01", "machine": "2 × GPU", "nanogpt_commit": "3adf61e1",
              "tiny": False}
    stage_records = [
        {**common, "stage": "shapeA_1gpu", "side": "ours", "gpus": 1, "command": "ours1",
         "tokens_per_sec": 400.0},
        {**common, "stage": "shapeA_1gpu", "side": "nanogpt", "gpus": 1, "command": "theirs1",
         "tokens_per_sec": 500.0},
        {**common, "stage": "shapeA_2gpu", "side": "ours", "gpus": 2, "command": "ours2",
         "tokens_per_sec": 780.0},
        {**common, "stage": "shapeA_2gpu", "side": "nanogpt", "gpus": 2,
         "status": "timeout after 240s"},
        {**common, "stage": "hf_trainer", "side": "hf_trainer", "gpus": 1, "command": "hf",
         "tokens_per_sec": 200.0},
        *[{**common, "stage": "metrics_cost_shapeA_1gpu", "side": side, "gpus": 1, "command": side,
           "tokens_per_sec": tps}
          for side, tps in [("config:metrics_off#1", 400.0), ("config:metrics_on#1", 396.0),
                            ("config:metrics_off#2", 404.0), ("config:metrics_on#2", 398.0)]],
    ]
    rows = {row["metric"]: row for row in bench.figures(stage_records)}
    assert set(rows) == {"shapeA_1gpu_tokens_per_sec", "shapeA_2gpu_tokens_per_sec",
                         "shapeA_scaling_1to2", "data_wait_fraction",
                         "hf_trainer_shapeA_tokens_per_sec",
                         "metrics_on_vs_off_shapeA_1gpu_tokens_per_sec"}
    # means of 2
    assert rows["metrics_on_vs_off_shapeA_1gpu_tokens_per_sec"]["ratio"] == pytest.approx(397 / 402)
    keys = {"date", "machine", "metric", "value", "unit", "baseline", "baseline_value", "ratio",
            "command"}
    assert all(keys <= set(row) for row in rows.values())
    one_gpu = rows["shapeA_1gpu_tokens_per_sec"]
    assert (one_gpu["value"], one_gpu["baseline_value"], one_gpu["ratio"]) == (400.0, 500.0, 0.8)
    assert one_gpu["command"] == "ours1" and one_gpu["baseline_command"] == "theirs1" \
        and "3adf61e" in one_gpu["baseline"]
    # a failed baseline gives no ratio, not an error
    assert rows["shapeA_2gpu_tokens_per_sec"]["ratio"] is None
    assert rows["shapeA_scaling_1to2"]["value"] == pytest.approx(1.95)
    assert rows["hf_trainer_shapeA_tokens_per_sec"]["ratio"] == pytest.approx(0.5)
    assert rows["data_wait_fraction"]["value"] is None \
        and "not report" in rows["data_wait_fraction"]["note"]
    # the same three knobs
    assert bench.CONFIG_SIDES["metrics_off"] == [
        o.replace("true", "false").replace("{prometheus_port}", "0")
        for o in bench.CONFIG_SIDES["metrics_on"]]
    assert "| shapeA_1gpu | 1 |" in bench.summary_markdown(stage_records, list(rows.values()))
    # ours at config.yaml's micro-batch (32) against nanoGPT at 16 (the shape comparisons') and 32
    micro = [{**common, "stage": "shapeA_1gpu", "side": side, "gpus": 1, "command": side,
              "tokens_per_sec": tps}
             for side, tps in [("config:micro32", 600.0), ("nanogpt", 500.0),
                               ("nanogpt_micro32", 540.0)]]
    rows = {row["metric"]: row for row in bench.figures(micro)}
    assert set(rows) == {"shapeA_1gpu_micro32_tokens_per_sec",
                         "shapeA_1gpu_micro32_vs_nanogpt_micro32_tokens_per_sec"}
    assert rows["shapeA_1gpu_micro32_tokens_per_sec"]["ratio"] == pytest.approx(1.2)
    assert rows["shapeA_1gpu_micro32_vs_nanogpt_micro32_tokens_per_sec"]["ratio"] \
        == pytest.approx(600 / 540)
    summary = bench.summary_markdown(micro, list(rows.values()))
    assert "| shapeA_1gpu / config:micro32 | 1 |" in summary \
        and "nanogpt_micro32 |" not in summary.split("Commands")[0]


def test_bench_reads_the_trainer_against_nanogpt_at_the_same_micro_batch_from_each_pairing_stage():
    """Each stage in SAME_MICRO_STAGES that ran the trainer and nanoGPT gives the same-micro rows;
    a variant beside them does not stand in for the trainer."""
    bench = load_bench()
    for stage in bench.SAME_MICRO_STAGES:
        records = [{"date": "2026-12-01", "machine": "1 × GPU", "tiny": False, "gpus": 1,
                    "stage": f"{stage}_shapeB_1gpu", "side": side, "command": side,
                    "tokens_per_sec": tps, "mfu": mfu, "tokens_per_sec_max_over_min": 1.01}
                   for side, tps, mfu in [("ours", 106.0, 0.47), ("nanogpt", 100.0, None),
                                          ("variant:fp32_residual", 101.0, 0.44)]]
        rows = {row["metric"]: row for row in bench.figures(records)}
        same = rows["shapeB_1gpu_vs_nanogpt_same_micro_tokens_per_sec"]
        assert same["ratio"] == pytest.approx(1.06) and same["command"] == "ours", stage
        assert rows["shapeB_1gpu_mfu"]["value"] == 0.47, stage
    assert "residual" in bench.SAME_MICRO_STAGES


def test_bench_reads_shape_b_mfu_from_a_stage_that_ran_the_trainer_alone_at_micro_batches_of_32():
    """Every MFU_STAGES stage runs the trainer at micro-batches of 32 on shape B; without nanoGPT
    beside it, the MFU row stands alone (no baseline) and no same-micro ratio is made up."""
    bench = load_bench()
    for stage in bench.MFU_STAGES:
        assert bench.STAGES[f"{stage}_shapeB_1gpu"]["batch"]["micro_batch_size"] == 32, stage
        assert "ours" in bench.STAGES[f"{stage}_shapeB_1gpu"]["sides"], stage
    records = [{"date": "2026-12-01", "machine": "1 × GPU", "tiny": False, "gpus": 1,
                "stage": "optimizer_shapeB_1gpu", "side": side, "command": side,
                "tokens_per_sec": tps, "mfu": mfu}
               for side, tps, mfu in [("ours", 104.0, 0.484),
                                      ("variant:compiled_optimizer", 105.0, 0.489)]]
    rows = {row["metric"]: row for row in bench.figures(records)}
    assert "shapeB_1gpu_vs_nanogpt_same_micro_tokens_per_sec" not in rows
    mfu = rows["shapeB_1gpu_mfu"]
    assert (mfu["value"], mfu["command"], mfu["baseline"], mfu["ratio"]) == (0.484, "ours", None,
                                                                             None)
    # nanoGPT from another call, whose trainer side did not run, is no baseline for this one
    theirs = {**records[0], "stage": "residual_shapeB_1gpu", "side": "nanogpt", "command": "nano",
              "mfu_by_our_formula": 0.44}
    mfu = {row["metric"]: row for row in bench.figures([theirs, *records])}["shapeB_1gpu_mfu"]
    assert (mfu["value"], mfu["baseline"], mfu["baseline_command"]) == (0.484, None, None)


def test_bench_compares_the_inline_reducer_with_ddp_and_derives_ddps_exposed_communication():
    """DDP's own all-reduce is not timed: its exposed communication is its step time minus that of a
    run that all-reduces nothing (variant:no_comm), 65,536 tokens per step."""
    bench = load_bench()
    common = {"date": "2026-12-01", "machine": "2 × GPU", "tiny": False,
              "stage": "reducer_shapeA_2gpu"}
    stage_records = [
        {**common, "side": "ours", "command": "ddp", "tokens_per_sec": 65536 / 0.060,
         "loss_last": 4.0, "comm_exposed_ms": None},
        {**common, "side": "ours_inline", "command": "inline", "tokens_per_sec": 65536 / 0.061,
         "loss_last": 4.0, "comm_exposed_ms": 2.5, "allreduce_p50_ms": 1.0,
         "allreduce_p95_ms": 2.0},
        {**common, "side": "variant:no_comm", "command": "no_comm",
         "tokens_per_sec": 65536 / 0.058},
        {**common, "stage": "compression_shapeA_2gpu", "side": "ours_inline_bf16",
         "command": "bf16", "tokens_per_sec": 65536 / 0.0595},
    ]
    rows = {row["metric"]: row for row in bench.figures(stage_records)}
    assert rows["shapeA_2gpu_ours_inline_tokens_per_sec"]["ratio"] == pytest.approx(60 / 61)
    assert rows["shapeA_2gpu_ours_inline_bf16_tokens_per_sec"]["ratio"] == pytest.approx(61 / 59.5)
    assert rows["shapeA_2gpu_ours_comm_exposed_ms"]["value"] == pytest.approx(2.0)
    inline_exposed = rows["shapeA_2gpu_ours_inline_comm_exposed_ms"]
    assert inline_exposed["value"] == pytest.approx(3.0) \
        and "wait()): 2.5" in inline_exposed["note"]
    summary = bench.summary_markdown(stage_records, list(rows.values()))
    assert "shapeA_2gpu_ours_comm_exposed_ms: 2.0 ms per step" in summary \
        and "comm exposed 2.5 ms/step" in summary


def test_bench_compares_every_masked_lm_side_with_ours_and_scales_by_steps_per_second():
    bench = load_bench()
    common = {"date": "2026-12-01", "machine": "2 × GPU", "tiny": False}
    stage_records = [{**common, "stage": stage, "side": side, "command": side,
                      "tokens_per_sec": tps, "steps_per_sec": steps, "peak_mem_gib": mem,
                      "tokens_per_sec_max_over_min": 1.1, "mfu": 0.3}
                     for stage, side, tps, steps, mem in [
                         ("bert_1gpu", "ours", 400.0, 2.0, 40.0),
                         ("bert_1gpu", "ours_fp32", 200.0, 1.0, 60.0),
                         ("bert_padding_1gpu", "ours_dynamic", 360.0, 1.8, 44.0),
                         ("bert_2gpu", "ours", 780.0, 3.9, 30.0)]]
    rows = {row["metric"]: row for row in bench.figures(stage_records)}
    assert rows["bert_speedup_1to2"]["value"] == pytest.approx(1.95)
    assert rows["bert_fp32_vs_bf16_tokens_per_sec"]["ratio"] == 0.5
    assert rows["bert_fp32_vs_bf16_peak_mem_gib"]["ratio"] == 1.5
    assert rows["bert_dynamic_vs_padding_tokens_per_sec"]["ratio"] == 0.9
    assert rows["bert_1gpu_mfu"]["value"] == 0.3 \
        and rows["bert_steadiness_max_over_min"]["value"] == 1.1
    summary = bench.summary_markdown(stage_records, list(rows.values()))
    assert "- bert_speedup_1to2: 1.950 x" in summary and "| bert_2gpu | ours |" in summary
    assert "| bert_1gpu | 1 |" not in summary  # not in the table against nanoGPT


def test_bench_flops_per_token_counts_what_the_trainer_counts():
    """The nanoGPT MFU in the bench uses the trainer's count: same matmul parameters, causal
    attention."""
    from transformers import AutoModelForCausalLM, GPT2Config
    bench = load_bench()
    shape, batch = {"n_layer": 2, "n_head": 2, "n_embd": 32}, {"vocab_size": 128, "seq_len": 16}
    model = AutoModelForCausalLM.from_config(GPT2Config(vocab_size=128, n_positions=16, n_embd=32,
                                                        n_layer=2, n_head=2))
    cfg = SimpleNamespace(train=SimpleNamespace(seq_len=16))
    three_sequences = train_ddp.ArrowTokens.flops_counter(model, "sdpa", cfg)([[16] * 3])
    assert bench.flops_per_token(shape, batch) == three_sequences / (3 * 16)


def test_bench_two_nodes_compares_sockets_with_nvlink_and_says_what_bf16_wins_back():
    """The two-node figures from made-up records: step times (65,536 tokens per step) 60 ms over
    NVLink, 160 ms over sockets, 110 ms with bf16 gradients; the all-reduce at 4 GB/s busbw predicts
    the sockets' cost."""
    bench = load_bench()
    envs = bench.launch_envs("two_nodes:ours", {"gpus": 2, "env": {"NCCL_DEBUG": "INFO"}}, False,
                             29700)
    assert [(e["NODE_RANK"], e["CUDA_VISIBLE_DEVICES"],
             e["NPROC_PER_NODE"]) for e in envs] == [("0", "0", "1"), ("1", "1", "1")]
    assert all(e["NCCL_P2P_DISABLE"] == e["NCCL_SHM_DISABLE"] == "1" and e["NCCL_DEBUG"] == "INFO"
               for e in envs)
    assert "NNODES" not in bench.launch_envs("ours", {"gpus": 2}, False, 29700)[0]
    nccl_log = ("h:1:2 [0] NCCL INFO Channel 00/0 : 0[0] -> 1[1] [send] via NET/Socket/0\nh:1:2 "
                "[0] NCCL INFO Channel 01/0 : 0[0] -> 1[1] [send] via NET/Socket/0\nstep 1/2 | "
                "loss 9\n")
    assert bench.nccl_transports(nccl_log) == ["NET/Socket/0"] \
        and bench.nccl_transports("no nccl") is None

    common = {"date": "2026-12-01", "machine": "2 × GPU", "tiny": False,
              "stage": "two_nodes_shapeA_2gpu"}
    table = [{"size": 2**20, "time_us": 100.0, "algbw": 10.0, "busbw": 10.0, "wrong": 0}]
    stage_records = [
        {**common, "side": "stress", "command": "s1", "allreduce": [{**table[0], "busbw": 300.0}],
         "busbw_largest": 300.0, "size_largest": 2**20, "transports": ["P2P/CUMEM/read"]},
        {**common, "side": "two_nodes:stress", "command": "s2", "allreduce": table,
         "busbw_largest": 4.0, "size_largest": 2**20, "transports": ["NET/Socket/0"], "nodes": 2},
        {**common, "side": "ours", "command": "nvlink", "tokens_per_sec": 65536 / 0.060},
        {**common, "side": "two_nodes:ours", "command": "sockets", "tokens_per_sec": 65536 / 0.160,
         "parameters_millions": 100.0, "loss_last": 5.0},
        {**common, "side": "two_nodes:ours_bf16", "command": "bf16",
         "tokens_per_sec": 65536 / 0.110, "loss_last": 5.1},
    ]
    rows = {row["metric"]: row for row in bench.figures(stage_records)}
    assert set(rows) == {"two_nodes_shapeA_tokens_per_sec", "two_nodes_shapeA_bf16_tokens_per_sec",
                         "two_nodes_allreduce_busbw_gbps"}
    assert rows["two_nodes_shapeA_tokens_per_sec"]["ratio"] == pytest.approx(60 / 160)
    # 400 MB at 4 GB/s
    assert "take 100.0 ms if nothing overlaps" in rows["two_nodes_shapeA_tokens_per_sec"]["note"]
    bf16 = rows["two_nodes_shapeA_bf16_tokens_per_sec"]
    assert bf16["ratio"] == pytest.approx(160 / 110) and "wins back 50.0%" in bf16["note"]
    assert rows["two_nodes_allreduce_busbw_gbps"]["ratio"] == pytest.approx(4 / 300)
    summary = bench.summary_markdown(stage_records, list(rows.values()))
    assert "| 1,048,576 | 100.0, 300.00 | 100.0, 10.00 | 0 / 0 |" in summary \
        and "NCCL via NET/Socket/0" in summary


def test_bench_stops_the_other_nodes_when_one_fails(monkeypatch):
    """A node left running would wait for the failed one until its collective timeout."""
    bench = load_bench()
    monkeypatch.setattr(bench, "FAILED_NODE_GRACE_S", 1)
    command = ["sh", "-c", 'if [ "$NODE_RANK" = 0 ]; then exit 3; fi; echo waiting; sleep 120']
    status, outputs, _ = bench.run_processes(command, REPO,
                                             [{"NODE_RANK": "0"}, {"NODE_RANK": "1"}], 100,
                                             lambda line: None)
    # SIGTERM, not the end
    assert status == "failed (node 0: exit 3, node 1: exit -15)" and outputs[1] == "waiting\n"


def test_bench_stopped_by_sigterm_stops_the_side_it_runs(tmp_path):
    """A side runs in a process group of its own, so a SIGTERM to bench.py alone misses it."""
    pid_file, bench_file = tmp_path / "side.pid", REPO / "bench" / "bench.py"
    script = ("import importlib.util, sys\n"
              f"spec = importlib.util.spec_from_file_location('bench', {str(bench_file)!r})\n"
              "bench = importlib.util.module_from_spec(spec)\n"
              "spec.loader.exec_module(bench)\n"
              "bench.exit_on_sigterm()\n"
              f"bench.run_processes(['sh', '-c', 'echo $$ > {pid_file}; exec sleep 120'], "
              f"{str(tmp_path)!r}, [{{}}], 100, print)\n")
    caller, side = subprocess.Popen([sys.executable, "-c", script]), None
    try:
        for _ in range(300):
            if pid_file.exists() and pid_file.read_text().strip():
                break
            time.sleep(0.1)
        side = int(pid_file.read_text())
        caller.send_signal(signal.SIGTERM)
        assert caller.wait(timeout=60) == 128 + signal.SIGTERM
        with pytest.raises(ProcessLookupError):
            os.kill(side, 0)
    finally:
        caller.kill()
        if side is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(side, signal.SIGKILL)


def test_bench_times_ours_against_the_reference_commit_and_the_late_verdict_against_the_same_step():
    """Made-up tokens/s, a different one per side, so that a row built from the wrong two sides
    shows in its ratio."""
    bench = load_bench()
    commit = bench.REFERENCE_COMMIT
    common = {"date": "2026-12-01", "machine": "1 × GPU", "tiny": False}
    tokens_per_sec = {("reference_shapeA_1gpu", "variant:reference"): 500.0,
                      ("reference_shapeA_1gpu", "variant:reference_same_step"): 400.0,
                      ("reference_shapeA_1gpu", "ours"): 600.0,
                      ("reference_shapeB_1gpu", "variant:reference"): 90.0,
                      ("reference_shapeB_1gpu", "variant:reference_same_step"): 60.0,
                      ("reference_shapeB_1gpu", "ours"): 120.0,
                      ("reference_bert_1gpu", "variant:reference"): 300.0,
                      ("reference_bert_1gpu", "ours"): 330.0,
                      ("shapeA_1gpu", "ours"): 999.0}  # another stage's ours: not a side of these
    stage_records = [{**common, "stage": stage, "side": side, "command": f"{stage} {side}",
                      "tokens_per_sec": tps} for (stage, side), tps in tokens_per_sec.items()]
    rows = {row["metric"]: row for row in bench.figures(stage_records)}
    expected = {  # metric: (stage, value side, baseline side)
        f"shapeA_1gpu_vs_{commit}_tokens_per_sec": ("reference_shapeA_1gpu", "ours",
                                                    "variant:reference"),
        f"shapeB_1gpu_vs_{commit}_tokens_per_sec": ("reference_shapeB_1gpu", "ours",
                                                    "variant:reference"),
        f"bert_1gpu_vs_{commit}_tokens_per_sec": ("reference_bert_1gpu", "ours",
                                                  "variant:reference"),
        "verdict_late_vs_same_step_shapeA_1gpu_tokens_per_sec": (
            "reference_shapeA_1gpu", "variant:reference", "variant:reference_same_step"),
        "verdict_late_vs_same_step_shapeB_1gpu_tokens_per_sec": (
            "reference_shapeB_1gpu", "variant:reference", "variant:reference_same_step"),
    }
    assert "verdict_late_vs_same_step_bert_1gpu_tokens_per_sec" not in rows  # BERT has no such side
    for metric, (stage, side, baseline) in expected.items():
        row = rows[metric]
        value, baseline_value = tokens_per_sec[stage, side], tokens_per_sec[stage, baseline]
        assert (row["value"], row["baseline_value"]) == (value, baseline_value), metric
        assert row["ratio"] == pytest.approx(value / baseline_value), metric
        assert row["command"] == f"{stage} {side}"
        assert row["baseline_command"] == f"{stage} {baseline}"
    summary = bench.summary_markdown(stage_records, list(rows.values()))
    listed = summary.split(f"Against train_ddp.py of commit {commit}")[1].split("Commands")[0]
    assert all(f"- {metric}: " in listed for metric in expected)
    assert f"bert_1gpu_vs_{commit}" not in summary.split("Masked LM")[-1].split("Against")[0]
    batch = bench.stage_settings("reference_shapeA_1gpu", tiny=False)[2]
    assert batch["micro_batch_size"] == 32  # the trainer's default, not BATCH's 16


def test_bench_sets_fp8_against_bf16_of_the_same_stage_for_speed_and_loss():
    """Made-up figures, a different one per side and stage, so that a row built from the wrong
    side or stage shows in its ratio."""
    bench = load_bench()
    common = {"date": "2026-12-01", "machine": "1 × GPU", "tiny": False}
    figures = {  # (stage, side): (tokens/s, validation loss)
        ("fp8_loss_llama1p3b_1gpu", "variant:compile_blocks#fp8"): (60.0, 4.04),
        ("fp8_loss_llama1p3b_1gpu", "variant:compile_blocks"): (50.0, 4.00),
        ("fp8_loss_shapeB_1gpu", "variant:compile_blocks#fp8"): (33.0, 4.5),
        ("fp8_loss_shapeB_1gpu", "variant:compile_blocks"): (30.0, 5.0),
        ("fp8_blocks_shapeB_1gpu", "variant:compile_blocks#fp8"): (88.0, None),
        ("fp8_blocks_shapeB_1gpu", "variant:compile_blocks"): (80.0, None),
        ("fp8_micro32_shapeB_1gpu", "variant:compile_blocks#fp8"): (75.0, None),
        ("fp8_micro32_shapeB_1gpu", "variant:compile_blocks"): (100.0, None),
        ("fp8_shapeB_1gpu", "config:llama_fp8"): (96.0, None),
        ("fp8_shapeB_1gpu", "config:llama"): (80.0, None),
        ("fp8_compile_llama1p3b_1gpu", "ours#fp8"): (84.0, None),
        ("fp8_compile_llama1p3b_1gpu", "variant:compile_blocks#fp8"): (80.0, None)}
    stage_records = [{**common, "stage": stage, "side": side, "command": f"{stage} {side}",
                      "tokens_per_sec": tps, "val_loss_last": loss}
                     for (stage, side), (tps, loss) in figures.items()]
    rows = {row["metric"]: row for row in bench.figures(stage_records)}
    expected = {"fp8_vs_bf16_llama1p3b_global8_1gpu_tokens_per_sec": 1.2,
                "fp8_vs_bf16_shapeB_global8_1gpu_tokens_per_sec": 1.1,
                "fp8_vs_bf16_shapeB_blocks_1gpu_tokens_per_sec": 1.1,
                "fp8_vs_bf16_shapeB_micro32_1gpu_tokens_per_sec": 0.75,
                "fp8_vs_bf16_shapeB_1gpu_tokens_per_sec": 1.2,
                "fp8_whole_vs_blocks_llama1p3b_1gpu_tokens_per_sec": 1.05,
                "fp8_vs_bf16_llama1p3b_loss_ratio": 1.01,
                "fp8_vs_bf16_shapeB_loss_ratio": 0.9}
    assert {metric: rows[metric]["ratio"] for metric in expected} == pytest.approx(expected)
    assert rows["fp8_vs_bf16_shapeB_loss_ratio"]["baseline_command"] == \
        "fp8_loss_shapeB_1gpu variant:compile_blocks"


def test_bench_starts_ours_python_without_launch_sh_and_sets_it_against_the_trainer_under_it(
        monkeypatch):
    """ours_python: the trainer and overrides of ours, started by python3 itself with launch.sh's
    share of cores; its row divides by ours of the same stage, not by nanoGPT."""
    bench = load_bench()
    started = {}

    def run_processes(command, cwd, env_extras, timeout_s, log, prefixes=None):
        started[command[0]] = command, env_extras
        return "failed", [""], 0.0

    monkeypatch.setattr(bench, "run_processes", run_processes)
    stage, shape, batch = bench.stage_settings("launcher_shapeA_1gpu", tiny=False)
    for side in ["ours", "ours_python"]:
        record = bench.run_ours("launcher_shapeA_1gpu", stage, shape, batch, False, 29600,
                                lambda line: None, side)
    launched, bare = started["bash"], started[sys.executable]
    assert launched[0][1] == "launch.sh" and bare[0][1] == "train_ddp.py"
    assert [arg.replace("ours_python", "ours") for arg in bare[0][2:]] == launched[0][3:]
    assert bare[1][0]["OMP_NUM_THREADS"] == str(os.cpu_count()) and "NPROC_PER_NODE" in bare[1][0]
    assert record["command"].split(" train_ddp.py ")[0].endswith("python3")
    common = {"date": "2026-12-06", "machine": "1 × GPU", "tiny": False,
              "stage": "launcher_shapeA_1gpu"}
    records = [{**common, "side": side, "command": side, "tokens_per_sec": tps}
               for side, tps in [("ours", 500.0), ("nanogpt", 400.0), ("ours_python", 520.0)]]
    row = {r["metric"]: r for r in bench.figures(records)}[
        "ours_python_vs_launch_shapeA_1gpu_tokens_per_sec"]
    assert (row["ratio"], row["baseline_command"]) == (pytest.approx(1.04), "ours")


def test_bench_variant_made_from_a_kept_folder_replaces_its_text_or_says_what_no_longer_matches(
        tmp_path, monkeypatch):
    bench = load_bench()
    reference = tmp_path / "reference"
    reference.mkdir()
    old, new = bench.VARIANTS["reference_same_step"][0]
    (reference / "train_ddp.py").write_text("def main():\n    step = 0\n" + old + "    step += 1\n")
    (reference / "config.yaml").write_text("train:\n  seed: 7\n")
    monkeypatch.setitem(bench.VARIANT_FILES, "reference", reference)
    monkeypatch.setattr(bench, "WORK_DIR", tmp_path / "work")
    assert bench.variant_script("reference") == reference / "train_ddp.py"  # used where it lies
    script = bench.variant_script("reference_same_step")
    assert script.read_text() == "def main():\n    step = 0\n" + new + "    step += 1\n"
    assert new == old + "        verdicts.settle()\n"
    assert (script.parent / "config.yaml").read_text() == "train:\n  seed: 7\n"  # the base's config
    (reference / "train_ddp.py").write_text("def main():\n    pass\n")  # the line is gone
    with pytest.raises(ValueError, match=r"reference_same_step: .* no longer in .*/reference/"):
        bench.variant_script("reference_same_step")
    monkeypatch.setitem(bench.VARIANT_FILES, "reference", tmp_path / "missing")
    with pytest.raises(FileNotFoundError, match="comment above VARIANT_FILES"):
        bench.variant_script("reference_same_step")


def test_bench_stage_budget_cuts_the_later_sides_timeouts_and_skips_a_side_it_has_no_time_for(
        monkeypatch):
    """budget_s bounds a stage's sides together (a call of the GPU machine has 10 minutes)."""
    bench = load_bench()
    clock, timeouts = [1000.0], []

    def side_taking_300_s(stage_name, stage, *args):
        timeouts.append(stage["timeout_s"])
        clock[0] += 300
        return {"status": "ok"}

    monkeypatch.setattr(bench.time, "perf_counter", lambda: clock[0])
    monkeypatch.setattr(bench, "run_ours", side_taking_300_s)
    monkeypatch.setitem(bench.STAGES, "budget_check", {
        "sides": ["ours", "variant:a", "variant:b"], "shape": "A", "gpus": 1, "steps": 10,
        "skip_steps": 2, "log_every": 2, "timeout_s": 240, "budget_s": 500})
    machine = {"date": "2026-12-01", "gpus": 1, "peak_flops": None}
    records = bench.run_stage("budget_check", False, machine, 0, 29700, lambda line: None,
                              lambda record: record)
    assert timeouts == [240, 200]  # the second side gets what is left of the 500 s
    assert [r["status"] for r in records] == ["ok", "ok",
                                              "skipped: the stage's budget_s of 500 s is spent"]


# what timm's benchmark.py (aa4b585) printed for `--bench train --batch-size 16 --num-warm-iter 2
# --num-bench-iter 10 --device cpu` on a ViT of 2 layers, then the line of bench.py's TIMM_RUNNER
TIMM_SAMPLE = """Benchmarking in float32 precision. NCHW layout. torchscript disabled
Model vit_base_patch16_224 created, param count: 108106
Running train benchmark on vit_base_patch16_224 for 10 steps w/ input size (3, 32, 32) and \
batch size 16.
Train [2/10]. 75.98 samples/sec. 210.570 ms/step.
Train [4/10]. 88.55 samples/sec. 180.681 ms/step.
Train [6/10]. 103.48 samples/sec. 154.622 ms/step.
Train [8/10]. 92.93 samples/sec. 172.171 ms/step.
Train [10/10]. 95.39 samples/sec. 167.725 ms/step.
Train benchmark of vit_base_patch16_224 done. 94.26 samples/sec, 167.72 ms/sample
--result
{
    "model": "vit_base_patch16_224",
    "train_samples_per_sec": 94.26,
    "train_step_time": 167.725,
    "train_batch_size": 16,
    "train_img_size": 32,
    "param_count": 0.11
}
TIMM_PEAK_MEM_GIB 3.5
"""


def test_bench_reads_timms_samples_per_sec_from_its_result_and_says_why_there_is_none():
    bench = load_bench()
    timm = bench.read_timm_output(TIMM_SAMPLE, skip_steps=2, batch_size=16)
    assert timm["images_per_sec"] == 94.26 and timm["peak_mem_gib"] == 3.5 and timm["note"] is None
    assert timm["window"] == "steps 3-12" and timm["window_s"] == round(10 * 16 / 94.26, 2)
    assert [i["step"] for i in timm["timm_intervals"]] == [4, 6, 8, 10, 12]
    assert timm["timm_intervals"][-1] == {"step": 12, "samples_per_sec": 95.39,
                                          "ms_per_step": 167.725}
    assert timm["timm_result"]["train_batch_size"] == 16
    # cut before its JSON (killed at the timeout): the done line's figure, the same number
    cut = bench.read_timm_output(TIMM_SAMPLE.split("--result")[0], skip_steps=2, batch_size=16)
    assert cut["images_per_sec"] == 94.26 and cut["peak_mem_gib"] is None
    # its error result (--no-retry: no smaller batch), and a batch other than asked
    oom = ('"CUDA out of memory." while running benchmark.\n--result\n'
           + json.dumps({"model": "vit_base_patch16_224", "error": "CUDA out of memory."},
                        indent=4))
    failed = bench.read_timm_output(oom, skip_steps=2, batch_size=256)
    assert failed["images_per_sec"] is None and "timm: CUDA out of memory." in failed["note"]
    smaller = bench.read_timm_output(TIMM_SAMPLE, skip_steps=2, batch_size=256)
    assert "timm ran batches of 16, not 256" in smaller["note"]


def test_bench_variants_of_the_trainer_still_find_the_lines_they_replace():
    """A variant whose text no longer matches fails its side on the GPU machine, a call late."""
    bench = load_bench()
    source = (REPO / "train_ddp.py").read_text()
    for name, replacements in bench.VARIANTS.items():
        if name in bench.VARIANT_BASES:  # made from a folder outside the repository
            continue
        text = source
        for old, new in replacements:  # in order, as bench.py applies them
            assert old in text, (name, old)
            text = text.replace(old, new)


def test_step_parts_times_the_update_over_the_parameters_the_trainers_gpt2_holds():
    """bench/step_parts.py times AdamW over a list of tensors it builds itself: the same shapes,
    in the same order, as the trainer's GPT-2 (at two layers of width 64 here), every one with a
    gradient."""
    step_parts = load_bench("step_parts")
    cfg = train_ddp.load_config(["model.n_layer=2", "model.n_head=2", "model.n_embd=64",
                                 f"train.seq_len={step_parts.SEQ}"], use_cuda=False)
    meta = {"vocab_size": step_parts.VOCAB, "special_tokens": dict(zip(SPECIAL_ROLES, range(5)))}
    model, _ = train_ddp.build_model(cfg, train_ddp.ArrowTokens, meta, torch.device("cpu"))
    params = step_parts.shape_b_parameters("cpu", layers=2, width=64)
    assert [p.shape for p in params] == [p.shape for p in model.parameters()]
    assert all(p.grad is not None and p.grad.shape == p.shape for p in params)


def test_profile_steps_hooks_into_both_trainers_the_captured_variant_and_nanogpts_loop():
    """A profile whose hook no longer finds its line stops on the GPU machine, a call late."""
    profile_steps = load_bench("profile_steps")
    bench = load_bench()
    captured = (REPO / "train_ddp.py").read_text()
    for old, new in bench.VARIANTS["captured_ahead"]:
        captured = captured.replace(old, new)
    for text in [(REPO / "train_ddp.py").read_text(), (REPO / "train_fsdp.py").read_text(),
                 captured]:
        hooked = profile_steps.instrument(text, nanogpt=False)
        assert hooked.count("Window.shared.at(run.step, rank)") == 1
        assert hooked.count("label_methods(globals())") == 1
    loop = "while True:\n\n    # determine and set the learning rate for this iteration\n" \
        + profile_steps.NANOGPT_ANCHOR  # nanoGPT train.py's loop, as of 3adf61e
    assert "Window.shared.at(iter_num, 0)\n" + profile_steps.NANOGPT_ANCHOR in \
        profile_steps.instrument(loop, nanogpt=True)
    assert profile_steps.instrument("while True:\n    pass\n", nanogpt=True) is None
    # GPU idle charged to the operators that launched the kernel ending it: made-up profiler
    # events, times in us, the raw events' in ns from a trace start of 5 ns
    cpu, cuda = torch.autograd.DeviceType.CPU, torch.autograd.DeviceType.CUDA

    def raw(device_type, start, end, id=0, linked=0):
        return SimpleNamespace(device_type=lambda: device_type, correlation_id=lambda: id,
                               linked_correlation_id=lambda: linked,
                               start_ns=lambda: start * 1000 + 5, end_ns=lambda: end * 1000 + 5)

    def event(start, name, id, parent=None):
        return SimpleNamespace(name=name, id=id, cpu_parent=parent,
                               time_range=SimpleNamespace(start=start))

    step = event(0, "train_step", 1)
    adamw, forward = event(1, "AdamW.step", 2, step), event(2, "aten::mm", 3, step)
    launch = event(3, "cudaLaunchKernel", 3)  # CUPTI's id, the same number as aten::mm's
    raws = [raw(cpu, 0, 1000, id=1), raw(cpu, 1, 10, id=2), raw(cpu, 2, 10, id=3),
            raw(cpu, 3, 4, id=3, linked=2),
            raw(cuda, 0, 100, linked=3), raw(cuda, 50, 150, linked=3),  # overlapping
            raw(cuda, 160, 200, linked=2),  # 10 us after: no gap
            raw(cuda, 300, 400, linked=2), raw(cuda, 450, 500, linked=3),
            raw(cuda, 600, 700, linked=2)]
    results = SimpleNamespace(trace_start_ns=lambda: 5, events=lambda: raws)
    profile = SimpleNamespace(profiler=SimpleNamespace(kineto_results=results),
                              events=lambda: [step, adamw, forward, launch])
    kernels, operators = profile_steps.launch_links(profile)
    assert operators == {1: step, 2: adamw, 3: forward}
    assert profile_steps.idle_gaps(kernels, operators) == {"AdamW.step <- train_step": (200, 2),
                                                           "aten::mm <- train_step": (50, 1)}
    # kernel time by kind, named as cuBLAS, cuDNN and inductor name their kernels on an H100
    names = ["nvjet_tst_192x192_64x4_2x1_v_bz_coopB_TNT", "sm90_xmma_gemm_bf16bf16_bf16f32",
             "cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_7",
             "triton_per_fused_add_native_layer_norm_0", "triton_poi_fused_add_mul_pow_tanh_3",
             "triton_red_fused__log_softmax_nll_loss_forward_1", "triton_poi_fused_add_2",
             "void at::native::multi_tensor_apply_kernel<FusedAdamMathFunctor>",
             "Memcpy HtoD (Pinned -> Device)", "void at::native::vectorized_elementwise_kernel"]
    kinds = profile_steps.kernel_kinds([(0, 10 * (i + 1), name) for i, name in enumerate(names)])
    assert kinds == {"matmul (cuBLAS, CUTLASS)": (30, 2), "other (ATen)": (100, 1),
                     "copies and memsets": (90, 1), "optimizer (fused AdamW)": (80, 1),
                     "fused: other": (70, 1), "fused: loss (log_softmax, nll)": (60, 1),
                     "fused: GELU": (50, 1), "fused: layer norm": (40, 1), "attention": (30, 1)}
    assert list(kinds)[:2] == ["other (ATen)", "copies and memsets"]  # largest first
    # and each kind's largest kernels by their summed time: one kernel run twice outweighs one
    kernels = [(0, 30, names[0]), (0, 20, names[1]), (40, 60, names[1]), (0, 5, names[6])]
    assert profile_steps.largest_kernels(kernels, top=1) == {
        "matmul (cuBLAS, CUTLASS)": [(names[1], (40, 2))], "fused: other": [(names[6], (5, 1))]}
    assert profile_steps.largest_kernels(kernels)["matmul (cuBLAS, CUTLASS)"] == [
        (names[1], (40, 2)), (names[0], (30, 1))]


def test_bench_stages_name_only_variants_and_config_sides_that_exist():
    """A stage naming a variant that is gone fails that side on the GPU machine, a call late."""
    bench = load_bench()
    named = [(stage, side.split("#")[0].partition(":"))
             for stage, settings in bench.STAGES.items() for side in settings["sides"]]
    known = {"variant": {*bench.VARIANTS, *bench.VARIANT_FILES}, "config": set(bench.CONFIG_SIDES)}
    missing = [(stage, f"{kind}:{name}") for stage, (kind, _, name) in named
               if kind in known and name not in known[kind]]
    assert not missing
    assert len([1 for _, (kind, _, _) in named if kind == "variant"]) > 10  # the check saw them


def test_bench_timm_flags_ask_for_vit_b16_as_ours_runs_it_and_resize_it_for_tiny():
    bench = load_bench()
    flags = bench.timm_flags(bench.VIT_SHAPE, bench.VIT_BATCH, steps=300, skip_steps=30, tiny=False)
    assert " ".join(flags) == (
        "--bench train --model vit_base_patch16_224 --batch-size 256 --img-size 224 "
        "--num-classes 1000 --opt adamw --num-warm-iter 30 --num-bench-iter 270 --no-retry "
        "--amp --amp-dtype bfloat16 --torchcompile")
    tiny = bench.timm_flags(bench.TINY_VIT_SHAPE, bench.TINY_VIT_BATCH, steps=12, skip_steps=4,
                            tiny=True)
    kwargs = tiny[tiny.index("--model-kwargs") + 1:tiny.index("--device")]
    assert kwargs == ["depth=2", "embed_dim=64", "num_heads=4", "mlp_ratio=4.0", "patch_size=4",
                      "img_size=32"] and "--amp" not in tiny
    overrides = bench.our_overrides(bench.VIT_SHAPE, bench.VIT_BATCH, 300, 10, "out/run",
                                    tiny=False)
    assert overrides[:6] == ["model.type=vit", "model.n_layer=12", "model.n_head=12",
                             "model.n_embd=768", "model.intermediate_size=3072",
                             "model.patch_size=16"]
    assert {"train.global_batch_size=256", "train.micro_batch_size=256", "train.max_steps=300",
            "train.eval_every=300", "train.compile=true", "train.precision=bf16"} <= set(overrides)
    assert not any(o.startswith(("train.seq_len", "data.vocab_size")) for o in overrides)


def test_bench_random_image_data_is_preprocess_images_layout_in_arrow_files(tmp_path, monkeypatch):
    bench = load_bench()
    monkeypatch.setattr(bench, "WORK_DIR", tmp_path)
    shape = bench.TINY_VIT_SHAPE
    # 2 batches
    data_dir = bench.random_image_data(shape, {"train_images": 1500, "val_images": 300})
    image_bytes = 32 * 32 * 3
    schema = pa.schema([("pixels", pa.binary(image_bytes)), ("label", pa.int32())])
    tables = {}
    for split, images in [("train", 1500), ("val", 300)]:
        with pa.memory_map(str(data_dir / f"{split}-00000.arrow")) as source:
            tables[split] = pa.ipc.open_file(source).read_all()  # an IPC file, not a stream
        assert tables[split].schema == schema and tables[split].num_rows == images
        labels = tables[split].column("label").to_numpy()
        assert labels.min() >= 0 and labels.max() == shape["classes"] - 1
    meta = json.loads((data_dir / "meta.json").read_text())
    fingerprint = meta.pop("fingerprint")
    assert len(fingerprint) == 64 and meta == {
        "format_version": 1, "kind": "images", "image_size": 32, "channels": 3,
        "classes": [f"class_{i}" for i in range(10)], "mean": [0.5, 0.5, 0.5],
        "std": [0.29, 0.29, 0.29],
        "splits": {"train": {"files": ["train-00000.arrow"], "images": 1500},
                   "val": {"files": ["val-00000.arrow"], "images": 300}},
        "skipped": {"count": 0, "examples": []}, "source": "bench.py random_image_data"}
    pixels, labels = bench.read_image_split(data_dir, "train")  # what the HF Trainer's side reads
    assert pixels.shape == (1500, 32, 32, 3) and pixels.dtype == np.uint8
    for index in [0, 1100]:  # row-major height, width, channel
        row = tables["train"].column("pixels")[index].as_py()
        assert pixels[index].tobytes() == row \
            and labels[index] == tables["train"].column("label")[index].as_py()
    # image 5, row 2, column 3, green
    assert pixels[5, 2, 3, 1] == tables["train"].column("pixels")[5].as_py()[(2 * 32 + 3) * 3 + 1]
    assert abs(pixels.mean() / 255 - 0.5) < 0.01 and abs(pixels.std() / 255 - 0.29) < 0.01  # meta's


def test_bench_vit_rows_set_ours_against_timm_and_the_hf_trainer_each_from_its_own_side(
        tmp_path, monkeypatch):
    """Made-up figures, a different one per side, so that a row built from the wrong side shows."""
    bench = load_bench()
    common = {"date": "2026-12-01", "machine": "1 × GPU", "tiny": False, "stage": "vit_1gpu",
              "timm_commit": "aa4b5850c1", "timm": "1.0.31"}
    stage_records = [
        {**common, "side": "ours", "command": "ours", "images_per_sec": 3000.0, "mfu": 0.45,
         "peak_mem_gib": 40.0, "status": "ok", "window": "steps 31-300"},
        {**common, "side": "timm", "command": "timm", "images_per_sec": 2500.0,
         "peak_mem_gib": 32.0, "status": "ok"},
        {**common, "side": "hf_trainer_vit", "command": "hf", "images_per_sec": 2000.0,
         "peak_mem_gib": 50.0, "compiled": True, "status": "ok"},
        # another stage's sides of the same names must not be read
        {**common, "stage": "hf_trainer", "side": "hf_trainer", "command": "gpt2",
         "tokens_per_sec": 9.0},
    ]
    rows = {row["metric"]: row for row in bench.figures(stage_records)}
    expected = {  # metric: (value, baseline_value, baseline command)
        "vit_b16_1gpu_vs_timm_images_per_sec": (3000.0, 2500.0, "timm"),
        "vit_b16_1gpu_vs_timm_peak_mem_gib": (40.0, 32.0, "timm"),
        "vit_b16_1gpu_vs_hf_trainer_images_per_sec": (3000.0, 2000.0, "hf"),
        "vit_b16_1gpu_vs_hf_trainer_peak_mem_gib": (40.0, 50.0, "hf"),
        "vit_b16_1gpu_mfu": (0.45, None, None)}
    assert {m for m in rows if m.startswith("vit_")} == set(expected)
    for metric, (value, baseline_value, baseline_command) in expected.items():
        row = rows[metric]
        assert (row["value"], row["baseline_value"]) == (value, baseline_value), metric
        assert row["ratio"] == (pytest.approx(value / baseline_value) if baseline_value else None)
        assert (row["command"], row["baseline_command"]) == ("ours", baseline_command), metric
    assert "aa4b585" in rows["vit_b16_1gpu_vs_timm_images_per_sec"]["baseline"]
    assert "torch_compile=True" in rows["vit_b16_1gpu_vs_hf_trainer_images_per_sec"]["baseline"]
    summary = bench.summary_markdown(stage_records, list(rows.values()))
    assert "| ours | steps 31-300 | 3,000 | 1.000 | 45.0% | 40.0 | ok |" in summary
    assert "| timm | — | 2,500 | 1.200 | — | 32.0 | ok |" in summary
    assert "| vit_1gpu |" not in summary  # neither in the table against nanoGPT nor the sides table
    # timm without a peak (an older benchmark.py, or a failed run): no ratio, a note that says so
    no_peak = [r if r["side"] != "timm" else {**r, "peak_mem_gib": None} for r in stage_records]
    row = next(r for r in bench.figures(no_peak)
               if r["metric"] == "vit_b16_1gpu_vs_timm_peak_mem_gib")
    assert row["ratio"] is None and row["note"] == "timm reported no peak"


def test_bench_records_ours_as_failed_with_the_trainers_reason_when_it_refuses_a_vit(tmp_path,
                                                                                     monkeypatch):
    bench = load_bench()
    monkeypatch.setattr(bench, "WORK_DIR", tmp_path / "work")
    output = ("data                       ok (out/bench/random_images_32px_10_1024)\nconfig        "
              "             FAIL: unknown config key 'model.patch_size' -> did you mean "
              "'model.intermediate_size'?\n")
    monkeypatch.setattr(bench, "run_processes", lambda *args: ("failed (exit 1)", [output], 3.0))
    monkeypatch.setattr(bench, "REPO", tmp_path)
    stage, shape, batch = bench.stage_settings("vit_1gpu", tiny=True)
    batch.update(train_images=64, val_images=16)
    record = bench.run_ours("vit_1gpu", stage, shape, batch, True, 29700, lambda line: None)
    assert record["status"] == "failed (exit 1)" and "images_per_sec" not in record
    assert record["note"] == ("FAIL: unknown config key 'model.patch_size' -> did you mean "
                              "'model.intermediate_size'?")
    assert "data.dir=work/random_images_32px_10_64 model.type=vit" in record["command"]


def test_bench_reads_our_images_per_sec_over_the_window_like_tokens_per_sec():
    bench = load_bench()
    # steps 3-4 at 100 images/s (2 x 32 images: 0.64 s), steps 5-6 at 400 (0.16 s); 2 skipped
    records = [{"kind": "train", "step": step, "images_per_sec": rate, "mfu": rate / 1000,
                "mem_peak_gib": step / 2} for step, rate in [(2, 1.0), (4, 100.0), (6, 400.0)]]
    ours = bench.read_our_metrics(records, skip_steps=2, images_per_step=32)
    assert ours["images_per_sec"] == pytest.approx(128 / 0.8) and "tokens_per_sec" not in ours
    assert ours["mfu"] == pytest.approx((0.1 * 0.64 + 0.4 * 0.16) / 0.8) \
        and ours["peak_mem_gib"] == 3.0
    assert ours["images_per_sec_max_over_min"] == 4.0 and ours["window"] == "steps 3-6"


# ---- the scripts' form ---------------------------------------------------------------------------

# Each optional part: its tag, and the name of its block at the end of the file.
OPTIONAL = {"MLM": "MLM", "images": "images", "metrics": "metrics", "tiered": "tiered",
            "fp8": "fp8", "FAULT": "faults"}
OPTIONAL_IN = {"train_ddp.py": ["MLM", "images", "metrics", "tiered", "fp8", "FAULT"],
               "train_fsdp.py": ["MLM", "images", "metrics", "fp8", "FAULT"],
               "preprocess.py": ["images"]}
# A block that optional parts share, by name: it goes with the last of them.
SHARED = {"sample draws": ["MLM", "images"]}
# The parts whose config keys stand in their block: deleting one leaves no key unread.
KEYS_FENCED = ["MLM", "images"]
# What train_fsdp.py defines differently from train_ddp.py: FSDP's own; every other function, class
# and constant both files define must be the same source (train_ddp.py's lines tagged # tiered or
# # DDP left out).
FSDP_OWN = {"main", "train_step", "save_checkpoint", "load_weights", "weights_are_finite",
            "CHECKPOINT_FILES", "NOT_HERE", "OTHER_TRAINER"}


def tagged(line, tag):
    return re.search(rf"#\s*{tag}(:|$)", line.rstrip("\n")) is not None


def without(source, tag):
    """The source with the optional part's block and every line tagged for it deleted, and a block
    it shared with parts deleted already."""
    source = "".join(line for line in without_block(source, OPTIONAL[tag]).splitlines(keepends=True)
                     if not tagged(line, tag))
    for block, tags in SHARED.items():
        if not any(re.search(rf"^# =+ {OPTIONAL[part]}: begin", source, re.M) for part in tags):
            source = without_block(source, block)
    return source


def without_block(source, block):
    kept, inside = [], False
    for line in source.splitlines(keepends=True):
        inside = inside or re.match(rf"# =+ {block}: begin", line) is not None
        if not inside:
            kept.append(line)
        inside = inside and re.match(rf"# =+ {block}: end", line) is None
    return "".join(kept)


def unused_definitions(source):
    """The top-level functions, classes and constants nothing else in the source uses, counting
    uses by those alone as none (ruff finds unused imports and locals, not these)."""
    body = ast.parse(source).body
    defined = {getattr(target, "name", getattr(target, "id", None)): node for node in body
               for target in (node.targets if isinstance(node, ast.Assign) else [node])}
    defined.pop(None, None)
    names = {id(node): {ref.id if isinstance(ref, ast.Name) else ref.attr
                        for ref in ast.walk(node) if isinstance(ref, (ast.Name, ast.Attribute))}
             for node in body}
    unused = set()
    while True:
        live = [node for node in body if all(defined[name] is not node for name in unused)]
        newly = {name for name, node in defined.items() if name not in unused
                 and not any(name in names[id(other)] for other in live if other is not node)}
        if not newly:
            return sorted(unused)
        unused |= newly


def unread_config_keys(source, path):
    """The keys of DEFAULTS, as the source builds it, that it reads nowhere as cfg.section.key."""
    module = types.ModuleType("stripped")
    module.__file__ = str(path)
    sys.modules["stripped"] = module  # a dataclass looks its module up there
    try:
        exec(compile(source, str(path), "exec"), module.__dict__)
    finally:
        del sys.modules["stripped"]
    return {key for key in module.flatten(module.DEFAULTS)
            if not re.search(rf"cfg\.{re.escape(key)}\b", source)}


def top_level_sources(path):
    """{name: source} of a file's top-level definitions and assignments, as ast.get_source_segment
    gives them (which splits the whole file again on every call: seconds for a trainer)."""
    source = Path(path).read_text()
    lines = [line.encode() for line in source.splitlines(keepends=True)]
    names = {}
    for node in __import__("ast").parse(source).body:
        target = node.targets[0] if node.__class__.__name__ == "Assign" else node
        name = getattr(target, "name", getattr(target, "id", None))
        if name:  # the offsets count UTF-8 bytes
            segment = lines[node.lineno - 1:node.end_lineno]
            segment[-1] = segment[-1][:node.end_col_offset]
            segment[0] = segment[0][node.col_offset:]
            names[name] = b"".join(segment).decode()
    return names


def ruff(*paths, select=None):
    if importlib.util.find_spec("ruff") is None:
        pytest.fail("ruff is not installed -> pip install -r requirements-dev.txt", pytrace=False)
    return run([sys.executable, "-m", "ruff", "check", *(["--select", select] if select else []),
                *map(str, paths)])


def test_the_scripts_bench_and_these_tests_pass_the_linter_lines_of_100_characters_at_most():
    result = ruff("preprocess.py", "train_ddp.py", "train_fsdp.py", "stress_test.py", "bench",
                  "test_smoke.py")
    assert result.returncode == 0, result.stdout[-3000:]
    assert 'line-length = 100' in (REPO / "pyproject.toml").read_text()


@pytest.mark.parametrize("script", [*TRAINERS, "preprocess.py"])
def test_each_optional_part_is_one_block_with_few_call_sites_and_deleting_it_leaves_valid_code(
        script, tmp_path):
    """The promise of the docstrings: delete a part's block and its tagged lines and the rest still
    holds together (no name left undefined or unused, no empty block) and keeps nothing only the
    part used. The fenced parts reach the core through at most four tagged lines; in the trainers
    MLM and images, what they teach beside causal LMs, through at most six."""
    source = (REPO / script).read_text()
    everything_deleted, unread = source, set()
    if script in TRAINERS:
        unread = unread_config_keys(source, tmp_path / script)
    assert not unused_definitions(source)
    for tag in OPTIONAL_IN[script]:
        block = OPTIONAL[tag]
        assert len(re.findall(rf"^# =+ {block}: begin", source, re.MULTILINE)) == 1, (script, tag)
        begin, end = source.index(f"{block}: begin"), source.index(f"{block}: end")
        outside = source[:begin] + source[end:]
        call_sites = [line for line in outside.splitlines() if tagged(line, tag)]
        most = 6 if tag in ("MLM", "images") and script in TRAINERS else 4
        assert 1 <= len(call_sites) <= most, (script, tag, call_sites)
        assert source.rindex(": begin") >= begin, "the fenced blocks stand at the end of the file"
        stripped = tmp_path / f"{tag}_{script}"
        stripped.write_text(without(source, tag))
        result = ruff(stripped, select="E1,E9,F")  # syntax, indentation, undefined and unused names
        assert result.returncode == 0, (tag, result.stdout[-3000:])
        assert not unused_definitions(stripped.read_text()), tag
        if tag in KEYS_FENCED and script in TRAINERS:  # its keys went with it
            assert unread_config_keys(stripped.read_text(), stripped) <= unread, tag
        everything_deleted = without(everything_deleted, tag)
    assert not unused_definitions(everything_deleted)
    assert "tiered" not in OPTIONAL_IN[script] or "class TieredEmbedding" in source
    if script == "train_fsdp.py":  # nothing that cannot run under FSDP
        ddp_source = (REPO / "train_ddp.py").read_text()
        for name in ["TieredEmbedding", "InlineReducer", "NaiveReducer", "DistributedDataParallel",
                     "bf16_allreduce_hook", "# tiered"]:
            assert name in ddp_source, f"{name} is not in train_ddp.py: check the list"
            assert name not in source, name


def test_without_the_metrics_block_ddp_has_a_comm_hook_only_for_bf16_and_nothing_is_timed(
        tmp_path):
    """The all-reduce timing reaches the core through one tagged line: deleted with its block, DDP
    gets a comm hook only for dist.grad_compression=bf16 and no all-reduce or wait is timed."""
    stripped = tmp_path / "train_ddp.py"
    stripped.write_text(without((REPO / "train_ddp.py").read_text(), "metrics"))
    core = top_level_sources(stripped)
    assert "hook = bf16_allreduce_hook if" in core["wrap_model"] \
        and core["wrap_model"].count("register_comm_hook") == 1
    parallelism = [core[name] for name in ("wrap_model", "NaiveReducer", "InlineReducer",
                                           "bf16_allreduce_hook")]
    assert not re.search(r"time_stamp|comm_times|timed|SpanTimer", "".join(parallelism))


def test_preprocess_with_the_images_block_deleted_still_tokenizes_text(tmp_path):
    stripped = tmp_path / "preprocess.py"
    stripped.write_text(without((REPO / "preprocess.py").read_text(), "images"))
    assert "def build_images" not in stripped.read_text() and "PIL" not in stripped.read_text()
    (tmp_path / "corpus.jsonl").write_text("".join(json.dumps({"text": f"text {i} " * 20}) + "\n"
                                                   for i in range(50)))
    result = run([sys.executable, stripped, "--input", tmp_path / "corpus.jsonl",
                  "--out", tmp_path / "out", "--vocab-size", "300"], cwd=tmp_path)
    assert result.returncode == 0 and (tmp_path / "out" / "meta.json").exists(), result.stderr


@pytest.mark.parametrize("deleted", ["MLM", "images", "every optional part"])
@pytest.mark.parametrize("trainer", TRAINERS)
def test_a_trainer_with_an_optional_part_deleted_trains_a_causal_model_copied_alone(
        trainer, deleted, data_dir, tmp_path):
    """MLM, images, or every optional part (also the metrics exporters, fp8, the fault hooks and for
    train_ddp.py the tiered embedding) deleted with their tagged lines: the rest, copied alone into
    a directory with only data/ beside it, trains on 2 ranks."""
    source = (REPO / trainer).read_text()
    for tag in OPTIONAL_IN[trainer] if deleted == "every optional part" else [deleted]:
        source = without(source, tag)
    work = tmp_path / "alone"
    shutil.copytree(data_dir, work / "data" / "stdlib")
    (work / trainer).write_text(source)
    result = Ranks(2, trainer, *TINY_MODEL, "train.global_batch_size=16",
                   "train.micro_batch_size=4", "train.max_steps=6", "checkpoint.every=3",
                   "train.eval_every=3", "log.every=1", "optim.lr=1e-2", "optim.warmup_steps=2",
                   "log.sample_prompt=", cwd=work).wait()
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    val = read_metrics(work / "out", "val")
    assert val[-1]["val_loss"] < val[0]["val_loss"] \
        and (work / "out" / "checkpoints" / "step_000006").is_dir()
    assert (work / "out" / "final" / "config.json").is_file()
    # it needed nothing beside it and wrote nothing but out/
    assert sorted(p.name for p in work.iterdir()) == ["data", "out", trainer]


def test_a_copy_of_train_ddp_alone_trains_on_two_ranks_with_its_built_in_defaults(data_dir,
                                                                                  tmp_path):
    """No config.yaml beside it: the defaults built into the file (and the CPU preset) apply."""
    shutil.copytree(data_dir, tmp_path / "data" / "stdlib")
    shutil.copy(REPO / "train_ddp.py", tmp_path / "train_ddp.py")
    result = Ranks(2, "train_ddp.py", "train.max_steps=4", "train.eval_every=4", "log.every=2",
                   "train.eval_batches=1", "checkpoint.every=4", "log.sample_prompt=",
                   cwd=tmp_path).wait()
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    # CPU preset
    assert "global batch 32 samples = 2 ranks x 1 micro-batches x 16 samples" in result.stdout
    assert [r["step"] for r in read_metrics(tmp_path / "out", "train")] == [2, 4]


def test_config_yaml_holds_exactly_the_defaults_built_into_both_trainers_and_preprocess():
    """config.yaml is where users edit; the files carry the same values so a copied file runs
    alone."""
    import train_fsdp
    tree = train_ddp.read_yaml(REPO / "config.yaml")
    presets = [tree.pop(name) for name in ["cpu_preset", "cpu_preset_images", "gpu_preset_digits"]]
    for trainer in (train_ddp, train_fsdp):
        assert train_ddp.flatten(tree) == trainer.flatten(trainer.DEFAULTS)
        built_ins = [trainer.CPU_PRESET, trainer.CPU_PRESET_IMAGES, trainer.GPU_PRESET_DIGITS]
        for in_file, built_in in zip(presets, built_ins):
            assert {key: float(value) if isinstance(built_in[key], float) else value
                    for key, value in in_file.items()} == built_in
    assert preprocess.DEFAULTS == tree["data"]
    for key, value in train_ddp.flatten(train_ddp.DEFAULTS).items():  # types the config file keeps
        assert type(train_ddp.flatten(tree)[key]) is type(value), key


def test_functions_both_trainers_define_are_the_same_source_but_fsdps_own():
    """train_fsdp.py is train_ddp.py with the parallelism swapped: what both define is word for word
    the same (train_ddp.py's lines tagged # tiered or # DDP left out), except the short list of
    FSDP's own."""
    ddp, fsdp = top_level_sources(REPO / "train_ddp.py"), top_level_sources(REPO / "train_fsdp.py")
    both = set(ddp) & set(fsdp)
    assert FSDP_OWN <= both
    untiered = {name: "".join(line for line in without(text, "tiered").splitlines(keepends=True)
                              if not tagged(line, "DDP")) for name, text in ddp.items()}
    different = {name for name in both - FSDP_OWN if untiered[name] != fsdp[name]}
    assert not different, different
    assert all(untiered[name] != fsdp[name] for name in FSDP_OWN), \
        "no longer FSDP's own: drop from FSDP_OWN"
    assert {"shard_model", "gather_full_model"} <= set(fsdp) - set(ddp)
    assert {"wrap_model", "InlineReducer",
            "NaiveReducer", "TieredEmbedding"} <= set(ddp) - set(fsdp)
    # preprocess.py, which runs alone, reads config.yaml with its own copy of the trainers' loader
    loader = [re.search(r"class ConfigLoader\(yaml.SafeLoader\):.*?first_chars\)\n",
                        (REPO / name).read_text(), re.S).group(0)
              for name in ["train_ddp.py", "preprocess.py"]]
    assert loader[0] == loader[1]


# Lines per file: a budget against growth.
FILE_BUDGET = {"train_ddp.py": 2854, "train_fsdp.py": 2515}
# What each trainer defines above its marker line, in reading order, and nothing else: all a learner
# needs to understand training a causal LM with DDP (or FSDP).
LESSON = {
    "train_ddp.py": ["Run", "Setup", "main", "train_step", "step_verdict",
                     "wrap_model", "NaiveReducer", "InlineReducer", "bf16_allreduce_hook",
                     "init_distributed", "on_rank0", "on_all_ranks",
                     "_permutation_cache", "epoch_permutation", "global_batch", "deal",
                     "step_batches", "rank_batches", "on_device",
                     "save_checkpoint", "train_state", "write_checkpoint", "publish",
                     "resume", "load_train_state", "load_weights", "validate"],
    "train_fsdp.py": ["Run", "Setup", "main", "train_step", "step_verdict",
                      "shard_model", "gradient_sync", "local",
                      "init_distributed", "on_rank0", "on_all_ranks",
                      "_permutation_cache", "epoch_permutation", "global_batch", "deal",
                      "step_batches", "rank_batches", "on_device",
                      "save_checkpoint", "train_state", "IN_FLIGHT", "finish_checkpoint",
                      "wait_for_write", "write_train_state", "publish_shards", "publish",
                      "resume", "load_train_state", "load_weights", "validate"]}
LESSON_MARKER = "below this, reference machinery you may skip"
# reference machinery both trainers define below the marker
REFERENCE = ["DEFAULTS", "load_config", "check_config", "UserError", "die", "log0",
             "ArrowTokens", "build_model", "make_optimizer", "report_memory", "hold_directory",
             "find_resume_checkpoint", "file_checksum", "fsync_dir", "Interval", "log_interval",
             "log_line", "write_metrics", "export_final"]


def test_main_and_train_step_fit_their_budgets_and_the_core_comes_first():
    """main() and train_step() fit their budgets; the lesson (LESSON) stands first, in reading
    order, down to the marker line, at line 700 at most, and the reference machinery below it."""
    import ast
    for trainer in TRAINERS:
        source = (REPO / trainer).read_text()
        assert len(source.splitlines()) <= FILE_BUDGET[trainer], trainer
        body = ast.parse(source).body
        functions = {node.name: node for node in body if isinstance(node, ast.FunctionDef)}
        main, step = functions["main"], functions["train_step"]
        assert main.end_lineno - main.lineno + 1 <= 120, trainer
        assert step.end_lineno - step.lineno + 1 <= 45, trainer
        update = next(node.lineno for node in ast.walk(step) if isinstance(node, ast.Call)
                      and getattr(node.func, "attr", None) == "step"
                      and getattr(node.func.value, "id", "") == "optimizer")
        assert update - step.lineno + 1 <= 30, trainer
        markers = [number for number, line in enumerate(source.splitlines(), 1)
                   if line.startswith("# ") and LESSON_MARKER in line]
        assert len(markers) == 1 and markers[0] <= 700, (trainer, markers)
        defined = []  # (name, line) of each top-level definition and assignment to a name
        for node in body:
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
                defined.append((node.name, node.lineno))
            elif isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name):
                defined.append((node.targets[0].id, node.lineno))
        above = [name for name, line in defined if line < markers[0]]
        assert above == LESSON[trainer], trainer
        below = [name for name in REFERENCE if dict(defined).get(name, 0) < markers[0]]
        assert not below, (trainer, below)
