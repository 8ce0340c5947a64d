#!/usr/bin/env bash
# launch.sh: check that this machine, the network and the data are ready, then start a script
# under torchrun. Each check prints "ok" or "FAIL: reason -> fix"; a failed check stops the launch.
#
#   bash launch.sh                                  # train_ddp.py, one process per GPU (2 processes on a CPU-only machine)
#   bash launch.sh train_ddp.py train.max_steps=100 # any config.yaml key as key=value
#   bash launch.sh stress_test.py --sizes 1M,64M    # options go to the script unchanged
#   bash launch.sh --dry-run                        # print the torchrun command and exit
#   NNODES=2 NODE_RANK=0 MASTER_ADDR=node0 bash launch.sh   # on every node, NODE_RANK 0, 1, ...
#   srun --ntasks-per-node=1 bash launch.sh         # Slurm: nodes, rank and master come from SLURM_* variables
#
# Environment: NNODES (1), NODE_RANK (0), MASTER_ADDR (127.0.0.1), MASTER_PORT (29500),
# NPROC_PER_NODE (visible GPUs, or 2 without GPUs), PYTHON (python3), LAUNCH_DEVICE (auto|cuda|cpu),
# MASTER_WAIT_S (how long a worker node waits for the master, 120), MIN_FREE_GB (checkpoint disk, 2).
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
PYTHON=${PYTHON:-python3}

# ---------------------------------------------------------------- arguments
SCRIPT=train_ddp.py
DRY_RUN=0
ARGS=()
for arg in "$@"; do
  case "$arg" in
    --dry-run) DRY_RUN=1 ;;
    *.py) if [ ${#ARGS[@]} -eq 0 ] && [ "$SCRIPT" = train_ddp.py ]; then SCRIPT=$arg; else ARGS+=("$arg"); fi ;;
    *) ARGS+=("$arg") ;;
  esac
done
[ -f "$SCRIPT" ] || SCRIPT=$HERE/$(basename "$SCRIPT")
IS_TRAINER=1
case "$(basename "$SCRIPT")" in stress_test.py) IS_TRAINER=0 ;; esac

report() { printf '%-26s %s\n' "$1" "$2"; }
fail() {  # fail CHECK "reason -> fix"
  report "$1" "FAIL: $2"
  exit 1
}

# ---------------------------------------------------------------- topology: single node, env, or Slurm
if [ -n "${SLURM_JOB_ID:-}" ] && [ -z "${NNODES:-}" ]; then
  NNODES=${SLURM_JOB_NUM_NODES:-${SLURM_NNODES:-1}}
  NODE_RANK=${SLURM_NODEID:-0}
  if [ -z "${MASTER_ADDR:-}" ]; then
    command -v scontrol >/dev/null || fail "slurm" "scontrol not found to read the first node of \$SLURM_JOB_NODELIST -> set MASTER_ADDR"
    MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
  fi
fi
NNODES=${NNODES:-1}
NODE_RANK=${NODE_RANK:-0}
MASTER_ADDR=${MASTER_ADDR:-127.0.0.1}
MASTER_PORT=${MASTER_PORT:-29500}
LAUNCH_DEVICE=${LAUNCH_DEVICE:-auto}

gpus_seen_by_driver() {
  if [ "$LAUNCH_DEVICE" = cpu ] || ! command -v nvidia-smi >/dev/null; then echo 0; return; fi
  local count
  count=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
  if [ -n "${CUDA_VISIBLE_DEVICES+set}" ]; then  # torchrun's workers see only these
    local visible
    visible=$(tr ',' '\n' <<<"$CUDA_VISIBLE_DEVICES" | grep -c . || true)
    [ "$visible" -lt "$count" ] && count=$visible
  fi
  echo "$count"
}
DRIVER_GPUS=$(gpus_seen_by_driver)
EXPECT_GPUS=0
if [ "$LAUNCH_DEVICE" = cuda ] || [ "$DRIVER_GPUS" -gt 0 ]; then EXPECT_GPUS=1; fi
if [ "$EXPECT_GPUS" = 1 ]; then
  NPROC_PER_NODE=${NPROC_PER_NODE:-$DRIVER_GPUS}
else
  NPROC_PER_NODE=${NPROC_PER_NODE:-2}  # two gloo processes: the distributed code paths run on a laptop too
fi
[[ "$NPROC_PER_NODE" =~ ^[0-9]+$ ]] || fail "processes per node" "NPROC_PER_NODE=$NPROC_PER_NODE is not a number -> set NPROC_PER_NODE=1 or more"
WORLD_SIZE=$((NNODES * NPROC_PER_NODE))

# One OpenMP thread pool per process, sharing the cores: without this each of N processes starts
# one thread per core and they fight over the machine.
CORES=$(nproc 2>/dev/null || echo 2)
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$(( NPROC_PER_NODE > 0 && CORES / NPROC_PER_NODE > 0 ? CORES / NPROC_PER_NODE : 1 ))}
# A failed NCCL collective tears the process down, so torchrun sees it, instead of hanging the job.
export TORCH_NCCL_ASYNC_ERROR_HANDLING=${TORCH_NCCL_ASYNC_ERROR_HANDLING:-1}
if [ "$LAUNCH_DEVICE" = cpu ]; then export CUDA_VISIBLE_DEVICES=""; fi

TORCHRUN=("$PYTHON" -m torch.distributed.run --nnodes "$NNODES" --nproc-per-node "$NPROC_PER_NODE"
  --node-rank "$NODE_RANK" --master-addr "$MASTER_ADDR" --master-port "$MASTER_PORT" "$SCRIPT" "${ARGS[@]}")

if [ "$DRY_RUN" = 1 ]; then
  echo "OMP_NUM_THREADS=$OMP_NUM_THREADS TORCH_NCCL_ASYNC_ERROR_HANDLING=$TORCH_NCCL_ASYNC_ERROR_HANDLING ${TORCHRUN[*]}"
  exit 0
fi

# ---------------------------------------------------------------- checks
check_script() {
  [ -f "$SCRIPT" ] || fail "script" "$SCRIPT not found -> name an existing script: train_ddp.py or stress_test.py"
  report "script" "ok ($(basename "$SCRIPT"))"
}

check_python() {
  local version missing
  version=$("$PYTHON" -c "import torch, sys; print(f'torch {torch.__version__}, Python {sys.version.split()[0]}')" 2>/dev/null) ||
    fail "python and torch" "'$PYTHON' cannot import torch -> pip install -r $HERE/requirements.txt, or set PYTHON=/path/to/python"
  if [ "$IS_TRAINER" = 1 ]; then
    missing=$("$PYTHON" -c "import importlib.util as u
print(' '.join(m for m in ['transformers', 'tokenizers', 'pyarrow', 'yaml', 'numpy'] if u.find_spec(m) is None))")
    [ -z "$missing" ] || fail "python and torch" "'$PYTHON' cannot import $missing -> pip install -r $HERE/requirements.txt"
  fi
  report "python and torch" "ok ($version)"
}

check_cuda() {
  if [ "$EXPECT_GPUS" = 0 ]; then report "cuda" "ok (no GPU: CPU with gloo)"; return; fi
  local torch_gpus
  torch_gpus=$("$PYTHON" -c "import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)" 2>/dev/null || echo 0)
  [ "$torch_gpus" -gt 0 ] ||
    fail "cuda" "GPUs are expected but torch.cuda.is_available() is False -> install a CUDA build of torch, check CUDA_VISIBLE_DEVICES, or LAUNCH_DEVICE=cpu"
  TORCH_GPUS=$torch_gpus
  report "cuda" "ok ($torch_gpus GPUs visible to torch)"
}

check_nccl() {
  if [ "$EXPECT_GPUS" = 0 ]; then report "nccl" "ok (not used: gloo)"; return; fi
  local version
  version=$("$PYTHON" -c "
import torch, torch.distributed as dist
v = torch.cuda.nccl.version() if dist.is_nccl_available() else (0, 0, 0)
print('.'.join(map(str, v)))" 2>/dev/null || echo 0.0.0)
  local major minor
  IFS=. read -r major minor _ <<<"$version"
  if [ "$major" -lt 2 ] || { [ "$major" = 2 ] && [ "$minor" -lt 10 ]; }; then
    fail "nccl" "NCCL $version found, 2.10 or newer needed -> install a torch build with a recent NCCL"
  fi
  report "nccl" "ok (NCCL $version)"
}

check_processes() {
  [ "$NPROC_PER_NODE" -ge 1 ] || fail "processes per node" "NPROC_PER_NODE=$NPROC_PER_NODE -> set NPROC_PER_NODE=1 or more"
  if [ "$EXPECT_GPUS" = 1 ] && [ "$NPROC_PER_NODE" -gt "${TORCH_GPUS:-0}" ]; then
    fail "processes per node" "NPROC_PER_NODE=$NPROC_PER_NODE but only ${TORCH_GPUS:-0} GPUs are visible -> set NPROC_PER_NODE=${TORCH_GPUS:-0} or fewer"
  fi
  report "processes per node" "ok ($NPROC_PER_NODE per node x $NNODES nodes = $WORLD_SIZE)"
}

check_config() {  # the trainer validates its own config (types, unknown keys, batch divisibility)
  local output
  output=$(WORLD_SIZE=$WORLD_SIZE "$PYTHON" "$SCRIPT" --check "${ARGS[@]}" 2>&1) ||
    fail "config" "$(grep -m1 '^error:' <<<"$output" | sed 's/^error: //' || echo "$output" | tail -n 1)"
  DATA_DIR=$(sed -n 's/^data\.dir=//p' <<<"$output")
  CKPT_DIR=$(sed -n 's/^checkpoint\.dir=//p' <<<"$output")
  TIMEOUT_S=$(sed -n 's/^dist\.timeout_s=//p' <<<"$output")
  report "config" "ok (collective timeout ${TIMEOUT_S}s from dist.timeout_s)"
}

check_data() {
  [ -f "$DATA_DIR/meta.json" ] && { report "data" "ok ($DATA_DIR)"; return; }
  local override
  for override in "${ARGS[@]}"; do
    case "$override" in data.dir=*|*.yaml|*.yml)
      fail "data" "no prepared data in $DATA_DIR -> run: $PYTHON $HERE/preprocess.py --input YOUR_TEXT --out $DATA_DIR" ;;
    esac
  done
  report "data" "preparing the default corpus into $DATA_DIR (once)"
  "$PYTHON" "$HERE/preprocess.py" --out "$DATA_DIR" ||
    fail "data" "preprocess.py failed (its error is above) -> fix it, or prepare data yourself and pass data.dir="
  report "data" "ok ($DATA_DIR)"
}

check_checkpoint_dir() {
  if ! { mkdir -p "$CKPT_DIR" && touch "$CKPT_DIR/.write-test" && rm -f "$CKPT_DIR/.write-test"; } 2>/dev/null; then
    fail "checkpoint dir" "cannot create or write $CKPT_DIR -> set checkpoint.dir= to a writable directory"
  fi
  local free_gb
  free_gb=$(df -Pk "$CKPT_DIR" | awk 'NR == 2 { printf "%d", $4 / 1048576 }')
  [ "$free_gb" -ge "${MIN_FREE_GB:-2}" ] ||
    fail "checkpoint dir" "only ${free_gb} GB free in $CKPT_DIR (MIN_FREE_GB=${MIN_FREE_GB:-2}) -> free space or set checkpoint.dir="
  report "checkpoint dir" "ok ($CKPT_DIR, ${free_gb} GB free)"
}

check_master() {
  if [ "$NODE_RANK" = 0 ]; then
    "$PYTHON" - "$MASTER_PORT" <<'EOF' 2>/dev/null ||
import socket, sys
with socket.socket() as s:
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as torchrun's store does: TIME_WAIT is no conflict
    s.bind(("", int(sys.argv[1])))
EOF
      fail "master port" "port $MASTER_PORT is in use on this node -> set MASTER_PORT to a free port (same on every node)"
    report "master port" "ok ($MASTER_PORT free)"
  else  # worker nodes may start before the master: wait for it, but not forever
    "$PYTHON" - "$MASTER_ADDR" "$MASTER_PORT" "${MASTER_WAIT_S:-120}" <<'EOF' 2>/dev/null ||
import socket, sys, time
host, port, deadline = sys.argv[1], int(sys.argv[2]), time.time() + float(sys.argv[3])
while True:
    try:
        socket.create_connection((host, port), timeout=5).close()
        break
    except OSError:
        if time.time() > deadline:
            sys.exit(1)
        time.sleep(1)
EOF
      fail "master" "$MASTER_ADDR:$MASTER_PORT unreachable after ${MASTER_WAIT_S:-120}s -> start node 0 first, check MASTER_ADDR/MASTER_PORT and the firewall"
    report "master" "ok ($MASTER_ADDR:$MASTER_PORT reachable)"
  fi
}

check_script
check_python
check_cuda
check_nccl
check_processes
if [ "$IS_TRAINER" = 1 ]; then
  check_config
  check_data
  check_checkpoint_dir
fi
check_master

echo "launching: ${TORCHRUN[*]}"
status=0
"${TORCHRUN[@]}" || status=$?
if [ "$status" != 0 ]; then
  echo "FAIL: $(basename "$SCRIPT") exited with status $status (the first 'error:' line above says why)" >&2
fi
exit "$status"
