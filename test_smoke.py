"""The tests: CPU only, gloo, tiny models, real torchrun processes where the behaviour is distributed.

    python -m pytest -q test_smoke.py
"""

import json
import os
import random
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

REPO = Path(__file__).resolve().parent
sys.path.insert(0, str(REPO))
import train_ddp  # noqa: E402

TINY_MODEL = ["model.n_layer=2", "model.n_head=2", "model.n_embd=32", "train.seq_len=64"]


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(command, env_extra=None, timeout=300, cwd=REPO):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **(env_extra or {})}
    return subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def torchrun(nproc, script, *args, timeout=300):
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
               "--master-addr", "127.0.0.1", "--master-port", str(free_port()), str(REPO / script), *args]
    result = run(command, timeout=timeout)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result


def assert_one_line_error(result, *fragments):
    """Bad input: non-zero exit, a clear `error:` line, and no traceback."""
    assert result.returncode != 0
    output = result.stdout + result.stderr
    assert "Traceback" not in output, output
    error_lines = [line for line in output.splitlines() if line.startswith("error:")]
    assert error_lines, output
    for fragment in fragments:
        assert fragment in error_lines[0], error_lines[0]


def read_metrics(out_dir, kind):
    lines = [json.loads(line) for line in (Path(out_dir) / "metrics.jsonl").read_text().splitlines()]
    return [line for line in lines if line["kind"] == kind]


# ----------------------------------------------------------------------------- a tiny corpus

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
            lines.append(f"def {name}_{function_index}(x, y):\n    return x * {function_index} + y - {doc_index % 7}\n")
        (directory / f"doc_{doc_index:03d}.txt").write_text("\n".join(lines))
    return directory


@pytest.fixture(scope="session")
def data_dir(corpus_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("data") / "tiny"
    result = run([sys.executable, "preprocess.py", "--input", str(corpus_dir), "--out", str(out),
                  "--vocab-size", "400", "--val-fraction", "0.1"])
    assert result.returncode == 0, result.stderr
    return out


# ----------------------------------------------------------------------------- config

def test_config_override_is_typed_and_wins_over_the_cpu_preset():
    cfg, flat = train_ddp.load_config(["train.max_steps=7", "optim.lr=1", "optim.eps=1e-6", "model.type=bert"],
                                      use_cuda=False)
    assert cfg.train.max_steps == 7 and flat["train.max_steps"] == 7
    assert isinstance(cfg.optim.lr, float) and cfg.optim.lr == 1.0  # an int where a float belongs is widened
    assert cfg.optim.eps == 1e-6  # plain PyYAML would read 1e-6 as the string '1e-6' 
    assert cfg.model.type == "bert"
    assert cfg.model.n_layer == 2  # from cpu_preset: no GPU here
    cfg_gpu, _ = train_ddp.load_config([], use_cuda=True)
    assert cfg_gpu.model.n_layer == 12  # the preset is only for machines without a GPU


@pytest.mark.parametrize("override, fragments", [
    (["train.max_step=5"], ["unknown config key 'train.max_step'", "did you mean 'train.max_steps'"]),
    (["optim.lr=fast"], ["optim.lr=fast is not a float"]),
    (["train.precision=fp8"], ["train.precision=fp8 is not one of"]),
    (["max_steps"], ["is not key=value"]),
])
def test_bad_override_is_one_line_error(override, fragments):
    assert_one_line_error(run([sys.executable, "train_ddp.py", "--check", *override]), *fragments)


def test_global_batch_that_does_not_divide_is_refused():
    result = run([sys.executable, "train_ddp.py", "--check", "train.global_batch_size=30", "train.micro_batch_size=4"],
                 env_extra={"WORLD_SIZE": "2"})
    assert_one_line_error(result, "train.global_batch_size=30 is not a multiple", "train.global_batch_size=32")


# ----------------------------------------------------------------------------- sampler and masking

@pytest.mark.parametrize("world_size, micro_batch_size", [(1, 4), (2, 2), (4, 1), (2, 4)])
def test_sampler_gives_disjoint_shares_that_cover_every_epoch(world_size, micro_batch_size):
    num_samples, global_batch = 50, 8
    seen_per_epoch = {}
    for step in range(25):  # 200 samples = 4 epochs; batches straddle the epoch boundaries
        plan = train_ddp.global_batch_plan(step * global_batch, global_batch, num_samples, 3, micro_batch_size, world_size)
        assert all(sum(len(ids) for ids, _ in rank_plan) == global_batch // world_size for rank_plan in plan)
        for rank_plan in plan:
            for ids, epochs in rank_plan:
                for sample_id, epoch in zip(ids.tolist(), epochs.tolist()):
                    seen_per_epoch.setdefault(epoch, []).append(sample_id)
    assert sorted(seen_per_epoch) == [0, 1, 2, 3]
    for ids in seen_per_epoch.values():
        assert sorted(ids) == list(range(num_samples))  # each sample exactly once per epoch, over all ranks
    first_order = train_ddp.epoch_permutation(3, 0, num_samples)
    assert not np.array_equal(first_order, train_ddp.epoch_permutation(3, 1, num_samples))  # new order each epoch


def test_sampler_depends_on_position_not_world_size():
    """A run resumed at position p on 3 ranks sees the batch a 1-rank run would see at p."""
    for position in [0, 24, 48, 1000]:
        one_rank = train_ddp.global_batch_plan(position, 12, 50, 7, 2, 1)
        three_ranks = train_ddp.global_batch_plan(position, 12, 50, 7, 2, 3)
        flatten = lambda plan: sorted(int(i) for rank_plan in plan for ids, _ in rank_plan for i in ids)
        assert flatten(one_rank) == flatten(three_ranks)


def test_length_grouping_puts_similar_lengths_in_one_micro_batch():
    lengths = {i: (i * 37) % 64 + 2 for i in range(64)}
    plan = train_ddp.global_batch_plan(0, 16, 64, 5, 4, 2, length_of=lambda i: lengths[int(i)])
    micro_batches = [ids for rank_plan in plan for ids, _ in rank_plan]
    spans = [max(lengths[int(i)] for i in ids) - min(lengths[int(i)] for i in ids) for ids in micro_batches]
    random_spans = []
    rng = np.random.default_rng(0)
    for _ in range(20):
        ids = rng.choice(64, 16, replace=False)
        random_spans += [np.ptp([lengths[int(i)] for i in ids[k:k + 4]]) for k in range(0, 16, 4)]
    assert np.mean(spans) < 0.5 * np.mean(random_spans)


def test_masking_depends_only_on_seed_epoch_and_sample():
    special = {"mask": 2, "cls": 3, "sep": 4}
    tokens = np.array([3] + list(range(10, 210)) + [4])
    first = train_ddp.mask_tokens(tokens, 1, 0, 42, special, 400, 0.15)
    again = train_ddp.mask_tokens(tokens, 1, 0, 42, special, 400, 0.15)
    other_epoch = train_ddp.mask_tokens(tokens, 1, 1, 42, special, 400, 0.15)
    assert all(np.array_equal(a, b) for a, b in zip(first, again))
    assert not np.array_equal(first[1], other_epoch[1])
    inputs, labels = first
    masked = labels != train_ddp.IGNORE_INDEX
    assert 0.08 < masked.mean() < 0.22
    assert not masked[0] and not masked[-1]  # [CLS] and [SEP] are never targets
    assert (labels[masked] == tokens[masked]).all()
    assert (inputs[~masked] == tokens[~masked]).all()
    assert (inputs[masked] == 2).mean() > 0.6  # about 80% of targets read [MASK]


# ----------------------------------------------------------------------------- loss normalization

def test_token_mean_gradient_is_independent_of_the_micro_batch_split_and_the_naive_mean_is_not(data_dir):
    """The popular recipe, loss.mean() per micro-batch divided by the accumulation steps, weights a
    token in a short micro-batch more than one in a long one. Ours divides summed losses by the
    token count of the whole batch, which equals the full-batch gradient."""
    torch.manual_seed(0)
    cfg, _ = train_ddp.load_config(["model.type=bert", *TINY_MODEL, "model.dropout=0.0"], use_cuda=False)
    meta = train_ddp.read_meta(data_dir)
    special = meta["special_tokens"]
    data = train_ddp.ArrowTokens(data_dir, meta, "train", "mlm", 64, special)
    model, _ = train_ddp.build_model(cfg, "mlm", 448, special, use_cuda=False)
    ids = np.arange(16)
    lengths = [data.length(i) for i in ids]
    assert max(lengths) > 2 * min(lengths), "the corpus must have documents of different lengths"

    def gradient(micro_batches, normalize):
        model.zero_grad()
        for batch in micro_batches:
            logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
            normalize(train_ddp.token_loss_sum(logits, batch["labels"]), batch, len(micro_batches)).backward()
        return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])

    def batches(size):
        return [train_ddp.make_micro_batch(data, ids[k:k + size], np.zeros(size, int), cfg, special, "cpu")
                for k in range(0, 16, size)]

    whole = gradient(batches(16), lambda loss, b, n: loss / b["label_tokens"])
    split = batches(4)
    total_tokens = sum(b["label_tokens"] for b in split)
    ours = gradient(split, lambda loss, b, n: loss / total_tokens)
    naive = gradient(split, lambda loss, b, n: loss / b["label_tokens"] / n)
    assert ((ours - whole).norm() / whole.norm()) < 1e-5
    assert ((naive - whole).norm() / whole.norm()) > 1e-3


def adam_first_moment(ckpt_step_dir):
    """After one AdamW step exp_avg = (1 - beta1) * gradient: the checkpoint holds the exact gradient."""
    state = torch.load(Path(ckpt_step_dir) / "optimizer.pt", weights_only=True)["state"]
    return torch.cat([state[key]["exp_avg"].flatten() for key in sorted(state)])


def test_gradient_is_the_same_for_any_split_into_ranks_and_micro_batches(data_dir, tmp_path):
    gradients, losses = {}, {}
    for world_size, micro_batches in [(1, 4), (2, 2), (2, 1)]:
        out = tmp_path / f"w{world_size}m{micro_batches}"
        torchrun(world_size, "train_ddp.py", f"data.dir={data_dir}", "model.type=bert", *TINY_MODEL,
                 "model.dropout=0.0", "train.precision=fp32", "train.global_batch_size=16",
                 f"train.micro_batch_size={16 // world_size // micro_batches}", "train.max_steps=1",
                 "checkpoint.every=1", "optim.grad_clip=0", "train.eval_batches=1", f"out_dir={out}",
                 f"checkpoint.dir={out}/ckpt")
        gradients[world_size, micro_batches] = adam_first_moment(out / "ckpt" / "step_000001")
        losses[world_size, micro_batches] = read_metrics(out, "train")[0]["loss"]
    reference = gradients[1, 4]
    for split, gradient in gradients.items():
        assert ((gradient - reference).norm() / reference.norm()) < 1e-5, split
        assert losses[split] == pytest.approx(losses[1, 4], rel=1e-6)


# ----------------------------------------------------------------------------- training, checkpoints, resume

@pytest.fixture(scope="module")
def trained_run(data_dir, tmp_path_factory):
    """8 steps on 2 processes through launch.sh, checkpoints at steps 4 and 8."""
    out = tmp_path_factory.mktemp("run")
    result = run(["bash", "launch.sh", f"data.dir={data_dir}", *TINY_MODEL, "train.global_batch_size=16",
                  "train.micro_batch_size=4", "train.max_steps=8", "checkpoint.every=4", "train.eval_every=4",
                  "log.every=1", "optim.lr=1e-2", "optim.warmup_steps=2", "model.dropout=0.1", f"out_dir={out}",
                  f"checkpoint.dir={out}/ckpt"], env_extra={"MASTER_PORT": str(free_port())})
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return out, result


def test_launch_trains_on_two_processes_and_the_validation_loss_falls(trained_run):
    out, result = trained_run
    assert "world size 2 (gloo, cpu)" in result.stdout
    for check in ["python and torch", "cuda", "config", "data", "checkpoint dir", "master port"]:
        assert any(line.startswith(check) and " ok" in line for line in result.stdout.splitlines()), check
    val = read_metrics(out, "val")
    assert [v["step"] for v in val] == [0, 4, 8]
    assert val[-1]["val_loss"] < 0.8 * val[0]["val_loss"]
    train = read_metrics(out, "train")
    assert [t["step"] for t in train] == list(range(1, 9))
    assert all({"loss", "grad_norm", "lr", "tokens_per_sec"} <= set(t) for t in train)
    assert sorted(p.name for p in (out / "ckpt").glob("step_*")) == ["step_000004", "step_000008"]
    assert (out / "ckpt" / "latest").read_text() == "step_000008"


def test_resume_continues_bitwise_identically(trained_run, data_dir, tmp_path):
    """Crash after the step-4 checkpoint, resume: steps 5..8 and the final weights match the
    uninterrupted run bit for bit (data position, dropout RNG of each rank, optimizer, schedule)."""
    out, _ = trained_run
    crashed = tmp_path / "crashed"
    shutil.copytree(out / "ckpt" / "step_000004", crashed / "ckpt" / "step_000004")
    torchrun(2, "train_ddp.py", f"data.dir={data_dir}", *TINY_MODEL, "train.global_batch_size=16",
             "train.micro_batch_size=4", "train.max_steps=8", "checkpoint.every=4", "train.eval_every=4",
             "log.every=1", "optim.lr=1e-2", "optim.warmup_steps=2", "model.dropout=0.1", f"out_dir={crashed}",
             f"checkpoint.dir={crashed}/ckpt")
    uninterrupted = {t["step"]: t["loss"] for t in read_metrics(out, "train")}
    resumed = {t["step"]: t["loss"] for t in read_metrics(crashed, "train")}
    assert sorted(resumed) == [5, 6, 7, 8]
    assert all(resumed[step] == uninterrupted[step] for step in resumed)
    final_a = torch.load(out / "ckpt" / "step_000008" / "model.pt", weights_only=True)
    final_b = torch.load(crashed / "ckpt" / "step_000008" / "model.pt", weights_only=True)
    assert all(torch.equal(final_a[name], final_b[name]) for name in final_a)


def test_resume_on_another_world_size_continues_from_the_same_sample(trained_run, data_dir, tmp_path):
    out, _ = trained_run
    moved = tmp_path / "one_rank"
    torchrun(1, "train_ddp.py", f"data.dir={data_dir}", *TINY_MODEL, "train.global_batch_size=16",
             "train.micro_batch_size=4", "train.max_steps=8", "checkpoint.every=4", "train.eval_every=4",
             "log.every=1", "optim.lr=1e-2", "optim.warmup_steps=2", "model.dropout=0.0",
             f"checkpoint.resume={out}/ckpt/step_000004", f"out_dir={moved}", f"checkpoint.dir={moved}/ckpt")
    state = torch.load(moved / "ckpt" / "step_000008" / "train_state.pt", weights_only=True)
    assert state["step"] == 8 and state["samples_seen"] == 8 * 16 and state["world_size"] == 1
    assert [t["step"] for t in read_metrics(moved, "train")] == [5, 6, 7, 8]


def test_exported_model_and_tokenizer_load_with_transformers(trained_run):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    out, result = trained_run
    model = AutoModelForCausalLM.from_pretrained(out / "final")
    tokenizer = AutoTokenizer.from_pretrained(out / "final")
    ids = tokenizer("def alpha_0(x, y):", return_tensors="pt").input_ids
    assert tokenizer.decode(ids[0]) == "def alpha_0(x, y):"
    assert model(ids).logits.shape[-1] % 64 == 0
    assert "sample:" in result.stdout


def test_corrupt_checkpoint_is_refused_and_left_untouched(trained_run, data_dir, tmp_path):
    out, _ = trained_run
    broken = tmp_path / "ckpt" / "step_000004"
    shutil.copytree(out / "ckpt" / "step_000004", broken)
    model_file = broken / "model.pt"
    model_file.write_bytes(model_file.read_bytes()[:1000])
    before = {p.name: p.read_bytes() for p in broken.iterdir()}
    result = run([sys.executable, "train_ddp.py", f"data.dir={data_dir}", *TINY_MODEL,
                  f"checkpoint.dir={tmp_path}/ckpt", f"out_dir={tmp_path}"])
    assert_one_line_error(result, "cannot load checkpoint")
    assert {p.name: p.read_bytes() for p in broken.iterdir()} == before


def test_mismatched_model_shape_is_refused_on_resume(trained_run, data_dir, tmp_path):
    out, _ = trained_run
    result = run([sys.executable, "train_ddp.py", f"data.dir={data_dir}", *TINY_MODEL, "model.n_layer=3",
                  f"checkpoint.resume={out}/ckpt/step_000004", f"out_dir={tmp_path}", f"checkpoint.dir={tmp_path}/c"])
    assert_one_line_error(result, "model.n_layer=2", "model.n_layer=3")


def test_resume_never_refuses_to_overwrite_existing_checkpoints(trained_run, data_dir, tmp_path):
    out, _ = trained_run
    result = run([sys.executable, "train_ddp.py", f"data.dir={data_dir}", *TINY_MODEL, "checkpoint.resume=never",
                  f"checkpoint.dir={out}/ckpt", f"out_dir={tmp_path}"])
    assert_one_line_error(result, "already holds checkpoints")


# ----------------------------------------------------------------------------- launch.sh

def test_launch_script_is_clean_under_shellcheck():
    if shutil.which("shellcheck") is None:
        pytest.fail("shellcheck is not installed (apt-get install shellcheck; .ci/run does it)")
    result = run(["shellcheck", "launch.sh"])
    assert result.returncode == 0, result.stdout


TOPOLOGY = ["NNODES", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT", "NPROC_PER_NODE", "SLURM_JOB_ID",
            "SLURM_JOB_NUM_NODES", "SLURM_NNODES", "SLURM_NODEID", "SLURM_JOB_NODELIST"]


@pytest.mark.parametrize("env, expected", [
    ({}, "--nnodes 1 --nproc-per-node 2 --node-rank 0 --master-addr 127.0.0.1 --master-port 29500"),
    ({"NNODES": "4", "NODE_RANK": "3", "MASTER_ADDR": "10.0.0.7", "MASTER_PORT": "29999", "NPROC_PER_NODE": "8"},
     "--nnodes 4 --nproc-per-node 8 --node-rank 3 --master-addr 10.0.0.7 --master-port 29999"),
    ({"SLURM_JOB_ID": "77", "SLURM_JOB_NUM_NODES": "2", "SLURM_NODEID": "1", "SLURM_JOB_NODELIST": "gpu[07-08]"},
     "--nnodes 2 --nproc-per-node 2 --node-rank 1 --master-addr gpu07 --master-port 29500"),
])
def test_launch_dry_run_prints_the_torchrun_command(env, expected, tmp_path):
    fake_bin = tmp_path / "bin"  # stands in for Slurm's scontrol, which expands the node list
    fake_bin.mkdir()
    (fake_bin / "scontrol").write_text("#!/bin/sh\necho gpu07\necho gpu08\n")
    (fake_bin / "scontrol").chmod(0o755)
    clean = {key: value for key, value in os.environ.items() if key not in TOPOLOGY}
    clean.update(env, LAUNCH_DEVICE="cpu", PATH=f"{fake_bin}:{os.environ['PATH']}")
    result = subprocess.run(["bash", "launch.sh", "--dry-run", "train.max_steps=3"], cwd=REPO, env=clean,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert expected in result.stdout
    assert result.stdout.strip().endswith("train_ddp.py train.max_steps=3")


def write_fake_torch(directory, cuda_available, gpus=0, nccl=(2, 21, 5)):
    """A stand-in torch package for the checks that need hardware this machine lacks."""
    package = directory / "torch"
    (package / "cuda").mkdir(parents=True)
    (package / "distributed").mkdir()
    (package / "__init__.py").write_text("__version__ = 'fake'\nfrom . import cuda, distributed\n")
    (package / "cuda" / "__init__.py").write_text(
        f"from . import nccl\ndef is_available(): return {cuda_available}\ndef device_count(): return {gpus}\n")
    (package / "cuda" / "nccl.py").write_text(f"def version(): return {nccl}\n")
    (package / "distributed" / "__init__.py").write_text("def is_nccl_available(): return True\n")
    return str(directory)


@pytest.fixture()
def busy_port():
    with socket.socket() as listener:
        listener.bind(("", 0))
        listener.listen()
        yield listener.getsockname()[1]


@pytest.mark.parametrize("case", ["script", "torch", "cuda", "nccl", "processes", "config", "data", "checkpoint",
                                  "port", "master"])
def test_each_launch_check_fails_with_its_message(case, data_dir, tmp_path, busy_port):
    """Break one condition at a time; the launch stops at that check with a reason and a fix.
    Hardware this machine lacks (GPUs, NCCL) is played by a stand-in torch package."""
    trainer_args = [f"data.dir={data_dir}", f"checkpoint.dir={tmp_path}/ckpt", f"out_dir={tmp_path}"]
    env = {"MASTER_PORT": str(free_port()), "LAUNCH_DEVICE": "auto", "NNODES": "1", "NODE_RANK": "0"}
    (tmp_path / "a_file").write_text("")
    (tmp_path / "broken" / "torch").mkdir(parents=True)
    (tmp_path / "broken" / "torch" / "__init__.py").write_text("raise ImportError('broken install')\n")
    cases = {  # case: (arguments of launch.sh, environment, name of the check that must fail)
        "script": (["train_nope.py"], {}, "script"),
        "torch": (trainer_args, {"PYTHONPATH": str(tmp_path / "broken")}, "python and torch"),
        "cuda": (["stress_test.py"], {"PYTHONPATH": write_fake_torch(tmp_path / "no_cuda", False), "LAUNCH_DEVICE": "cuda"},
                 "cuda"),
        "nccl": (["stress_test.py"], {"PYTHONPATH": write_fake_torch(tmp_path / "old_nccl", True, 2, (2, 8, 3)),
                                      "LAUNCH_DEVICE": "cuda", "NPROC_PER_NODE": "2"}, "nccl"),
        "processes": (["stress_test.py"], {"PYTHONPATH": write_fake_torch(tmp_path / "one_gpu", True, 1), "LAUNCH_DEVICE": "cuda",
                                           "NPROC_PER_NODE": "4"}, "processes per node"),
        "config": ([*trainer_args, "optim.learning_rate=1e-3"], {}, "config"),
        "data": ([f"data.dir={tmp_path}/nothing_here", *trainer_args[1:]], {}, "data"),
        "checkpoint": ([trainer_args[0], f"checkpoint.dir={tmp_path}/a_file/ckpt"], {}, "checkpoint dir"),
        "port": (["stress_test.py"], {"MASTER_PORT": str(busy_port)}, "master port"),
        "master": (["stress_test.py"], {"NNODES": "2", "NODE_RANK": "1", "MASTER_WAIT_S": "1"}, "master"),
    }
    args, case_env, expected = cases[case]
    result = run(["bash", "launch.sh", *args], env_extra={**env, **case_env})
    assert result.returncode != 0
    failures = [line for line in result.stdout.splitlines() if "FAIL:" in line]
    assert len(failures) == 1, result.stdout + result.stderr
    assert failures[0].split("FAIL:")[0].strip() == expected, failures[0]
    assert " -> " in failures[0]  # every failure says how to fix it
    assert "launching:" not in result.stdout
    assert "Traceback" not in result.stdout + result.stderr
