#!/usr/bin/env bash
# Everything we measure on the GPU machine, in one run: preprocessing throughput, training on
# 1 and on 2 GPUs with the default GPU config, the collective stress test. Logs and a summary
# table go to $OUT (default bench/out).   Usage: bash bench/gpu_bench.sh [key=value ...]
# (overrides go to both training runs, e.g. train.max_steps=50 for a quick check).
set -uo pipefail  # no -e: one failed stage must not hide the figures of the others
cd "$(dirname "$0")/.." || exit 1
OUT=${OUT:-bench/out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1

{
  date -u +"%Y-%m-%d %H:%M UTC"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  nvidia-smi topo -m 2>/dev/null | head -n 4
  python3 -c "import torch, transformers, tokenizers
print('torch', torch.__version__, 'cuda', torch.version.cuda, 'nccl', torch.cuda.nccl.version(),
      'transformers', transformers.__version__, 'tokenizers', tokenizers.__version__)"
  echo "cores: $(nproc)"
} 2>&1 | tee "$OUT/env.txt"

# 1. preprocessing: the default corpus end to end, then the tokenize stage against a per-document
# loop
timeout 120 python3 preprocess.py --force 2>&1 | tee "$OUT/preprocess.log"
timeout 90 python3 bench/bench_preprocess.py --rounds 2 2>&1 | tee "$OUT/bench_preprocess.log"

# 2. training with the default GPU config on 1, then 2 GPUs
GPUS=$(nvidia-smi -L | grep -c '^GPU')
for n in 1 2; do
  [ "$n" -le "$GPUS" ] || continue
  rm -rf "out/bench_gpu$n"
  CUDA_VISIBLE_DEVICES=$(seq -s, 0 $((n - 1))) NPROC_PER_NODE=$n MASTER_PORT=$((29500 + n)) \
    timeout 240 bash launch.sh train_ddp.py out_dir="out/bench_gpu$n" \
    checkpoint.dir="out/bench_gpu$n/ckpt" "$@" 2>&1 |
    tee "$OUT/train_gpu$n.log"
  # keep some figure: eager mode
  if ! grep -q '"kind": "train"' "out/bench_gpu$n/metrics.jsonl" 2>/dev/null; then
    echo "run on $n GPUs failed; again with train.compile=false" | tee -a "$OUT/train_gpu$n.log"
    rm -rf "out/bench_gpu$n"
    CUDA_VISIBLE_DEVICES=$(seq -s, 0 $((n - 1))) NPROC_PER_NODE=$n MASTER_PORT=$((29510 + n)) \
      timeout 180 bash launch.sh train_ddp.py out_dir="out/bench_gpu$n" \
      checkpoint.dir="out/bench_gpu$n/ckpt" train.compile=false "$@" 2>&1 |
      tee -a "$OUT/train_gpu$n.log"
  fi
  cp "out/bench_gpu$n/metrics.jsonl" "$OUT/metrics_gpu$n.jsonl"
done

# 3. collectives on every GPU
timeout 120 bash launch.sh stress_test.py --json "$OUT/stress.json" 2>&1 | tee "$OUT/stress.log"

python3 - "$OUT" <<'PY' | tee "$OUT/summary.md"
import json, sys, pathlib
out = pathlib.Path(sys.argv[1])
print("| GPUs | steps | tokens/s (mean of steps > 20) | MFU | peak mem GiB "
      "| val loss start -> end |")
print("|---|---|---|---|---|---|")
for n in (1, 2):
    path = out / f"metrics_gpu{n}.jsonl"
    if not path.exists():
        continue
    lines = [json.loads(l) for l in path.read_text().splitlines()]
    train = [l for l in lines if l["kind"] == "train"]
    val = [l for l in lines if l["kind"] == "val"]
    if not train:
        continue
    steady = [l for l in train if l["step"] > 20] or train
    tps = sum(l["tokens_per_sec"] for l in steady) / len(steady)
    mfu = sum(l.get("mfu") or 0 for l in steady) / len(steady)  # null where the trainer has no MFU
    peak = max(l.get("mem_peak_gib") or 0 for l in train)
    print(f"| {n} | {train[-1]['step']} | {tps:,.0f} | {100 * mfu:.1f}% | {peak:.1f} | "
          f"{val[0]['val_loss']:.3f} -> {val[-1]['val_loss']:.3f} |")
PY
