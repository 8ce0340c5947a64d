#!/usr/bin/env bash
# launch.sh: check that this machine, the network and the data are ready, then start a script
# under torchrun. Each check prints "ok" or "FAIL: reason -> fix"; a failed check stops the launch.
#
#   bash launch.sh                                  # train_ddp.py: a process per GPU, or 2 on CPU
#   bash launch.sh train_ddp.py train.max_steps=100 # any config.yaml key as key=value
#   bash launch.sh stress_test.py --sizes 1M,64M    # options go to the script unchanged
#   bash launch.sh --dry-run                        # print the torchrun command and exit
#   NNODES=2 NODE_RANK=0 MASTER_ADDR=node0 bash launch.sh   # on every node, NODE_RANK 0, 1, ...
#   srun --ntasks-per-node=1 bash launch.sh         # nodes, rank and master from SLURM_* variables
#
# Environment: NNODES (1), NODE_RANK (0), MASTER_ADDR (node 0's address, needed with NNODES > 1;
# one node uses 127.0.0.1), MASTER_PORT (29500), NPROC_PER_NODE (visible GPUs, or 2 without GPUs),
# PYTHON (python3), LAUNCH_DEVICE (auto|cuda|cpu), MASTER_WAIT_S (how long a worker node waits for
# the master, 120), MIN_FREE_GB (checkpoint disk, 2), MAX_RESTARTS (how often torchrun restarts the
# workers after one of them failed: 3 for a trainer, which then resumes from its newest checkpoint;
# 0 for other scripts), LOG_DIR (out/logs: every rank's stderr of each
# attempt goes to LOG_DIR/<date>-node<NODE_RANK>-<pid>/; a node whose workers were restarted only
# because another node's failed rewrites its attempt_0), and with NNODES > 1: RDZV_ID (the job's
# id, the same on every node: SLURM_JOB_ID under Slurm, else "none"), LOCAL_ADDR (this node's
# address as the others reach it; default: the address this node reaches the master from). With
# NNODES > 1 torchrun numbers the nodes by LOCAL_ADDR, not by NODE_RANK: rank 0, which logs and
# saves, runs on the node whose address sorts first.
#
# Stopping: SIGTERM or SIGINT to this script is passed to torchrun as one SIGTERM; torchrun sends
# SIGTERM to every worker and SIGKILLs those still running 30 s later (torch 2.13 reads
# TORCH_ELASTIC_SHUTDOWN_TIMEOUT instead; older versions may not). The trainer then finishes its
# step, writes a checkpoint and exits 3, and so does this script, with the trainer's line. torchrun
# does not restart workers after a signal it got; workers that got one alone end every restart at
# once. torchrun can get signals of its own too (Slurm signals every process; Ctrl-C reaches it once
# its workers run). A second one during its shutdown sends every worker SIGTERM again and waits 30 s
# anew; a third ends the shutdown: no more waiting, no SIGKILL, the workers finish alone, and
# torchrun never exits (Python waits at exit for its log threads, which nothing stops now), so this
# script ends it once its workers are gone. A second Ctrl-C at a terminal makes this script kill
# torchrun and its workers at once, without a checkpoint.
# Exit codes: 0 done; 1 a rank failed or was lost (a restart may help); 2 a mistake to fix (a check
# failed, or the first rank to fail exited 2); 3 stopped (a checkpoint written: the last line says
# how to go on).
# (Not SIGINT when this script starts with SIGINT ignored, as background jobs of another script do:
# bash cannot trap a signal ignored on entry. SIGTERM works there too.)
# Slurm: `#SBATCH --signal=TERM@120` asks Slurm to send SIGTERM to the job's steps (this script,
# torchrun and the workers) about 120 s before the time limit (see sbatch(1)). A trainer that
# checkpoints on SIGTERM needs that lead to cover one checkpoint, and gets at most the 30 s above
# before torchrun's SIGKILL.
set -euo pipefail

HERE=$(cd "$(dirname "$(readlink -f "${BASH_SOURCE[0]}")")" && pwd)
PYTHON=${PYTHON:-python3}

# ---------------------------------------------------------------- arguments
SCRIPT=train_ddp.py
DRY_RUN=0
ARGS=()
for arg in "$@"; do
  case "$arg" in
    --dry-run) DRY_RUN=1 ;;
    -h | --help) sed -n '2,/^set -euo/{/^#/s/^# \{0,1\}//p}' "$HERE/launch.sh"; exit 0 ;;
    *.py)
      if [ ${#ARGS[@]} -eq 0 ] && [ "$SCRIPT" = train_ddp.py ]; then
        SCRIPT=$arg
      else
        ARGS+=("$arg")
      fi ;;
    *) ARGS+=("$arg") ;;
  esac
done
# a bare name is this repository's script when there is none of that name here
case "$SCRIPT" in */*) ;; *) [ -f "$SCRIPT" ] || SCRIPT=$HERE/$SCRIPT ;; esac
# a trainer of ours (a renamed copy too) gets the config, data and checkpoint checks and restarts;
# any other script is launched as is, once
IS_TRAINER=0
if grep -qsF '"--check" in sys.argv' "$SCRIPT"; then IS_TRAINER=1; fi

report() { printf '%-26s %s\n' "$1" "$2"; }
fail() {  # fail CHECK "reason -> fix": a mistake to fix
  report "$1" "FAIL: $2"
  exit 2
}
# Digits without a leading zero: bash arithmetic reads "08" as a broken octal number and stops
# the script.
is_count() { [[ "$1" =~ ^(0|[1-9][0-9]{0,8})$ ]]; }

# ------------------------------------------------------------ topology: single node, env, or Slurm
if [ -n "${SLURM_JOB_ID:-}" ] && [ -z "${NNODES:-}" ]; then
  NNODES=${SLURM_JOB_NUM_NODES:-${SLURM_NNODES:-1}}
  NODE_RANK=${SLURM_NODEID:-0}
  [ "${SLURM_NTASKS_PER_NODE:-1}" = 1 ] || fail "slurm" "SLURM_NTASKS_PER_NODE=$SLURM_NTASKS_PER_NODE: each task would start a torchrun of its own -> srun --ntasks-per-node=1 bash launch.sh"
  if [ -z "${MASTER_ADDR:-}" ]; then
    command -v scontrol >/dev/null || fail "slurm" "scontrol not found to read the first node of \$SLURM_JOB_NODELIST -> set MASTER_ADDR"
    # `sed -n 1p` reads to the end; `head -n 1` would leave early, and under pipefail the SIGPIPE
    # this gives scontrol (exit 141) would end this script without a word.
    MASTER_ADDR=$(scontrol show hostnames "${SLURM_JOB_NODELIST:-}" 2>/dev/null | sed -n 1p) || true
    [ -n "$MASTER_ADDR" ] || fail "slurm" "scontrol named no first node of SLURM_JOB_NODELIST='${SLURM_JOB_NODELIST:-}' -> run inside the job's allocation, or set MASTER_ADDR"
  fi
fi
NNODES=${NNODES:-1}
NODE_RANK=${NODE_RANK:-0}
GIVEN_MASTER_ADDR=${MASTER_ADDR:-}
# one node: its own loopback, whatever MASTER_ADDR a shell kept from another job
if [ "$NNODES" = 1 ]; then MASTER_ADDR=127.0.0.1; fi
MASTER_ADDR=${MASTER_ADDR:-127.0.0.1}
MASTER_PORT=${MASTER_PORT:-29500}
LAUNCH_DEVICE=${LAUNCH_DEVICE:-auto}
MAX_RESTARTS=${MAX_RESTARTS:-$((IS_TRAINER ? 3 : 0))}  # a restart resumes a trainer's checkpoint
RDZV_ID=${RDZV_ID:-${SLURM_JOB_ID:-none}}
LOG_DIR=${LOG_DIR:-out/logs}

check_node_count() {
  { is_count "$NNODES" && [ "$NNODES" -ge 1 ]; } ||
    fail "nodes" "NNODES=$NNODES is not a number of nodes -> set NNODES=1 or more, the same on every node"
}

check_node_rank() {
  is_count "$NODE_RANK" || fail "node rank" "NODE_RANK=$NODE_RANK is not a number -> set NODE_RANK=0 on the master node, 1..$((NNODES - 1)) on the others"
  [ "$NODE_RANK" -lt "$NNODES" ] ||
    fail "node rank" "NODE_RANK=$NODE_RANK but NNODES=$NNODES -> node ranks go from 0 to $((NNODES - 1)), one per node"
}

check_port_number() {
  { is_count "$MASTER_PORT" && [ "$MASTER_PORT" -ge 1 ] && [ "$MASTER_PORT" -le 65535 ]; } ||
    fail "master port" "MASTER_PORT=$MASTER_PORT is not a port number 1..65535 -> set MASTER_PORT=29500 (the same on every node)"
}

check_restarts() {
  is_count "$MAX_RESTARTS" || fail "restarts" "MAX_RESTARTS=$MAX_RESTARTS is not a number -> set MAX_RESTARTS=0 (never restart) or more"
}

check_master_address() {
  [ "$NNODES" = 1 ] || [ -n "$GIVEN_MASTER_ADDR" ] ||
    fail "master address" "NNODES=$NNODES but no MASTER_ADDR: the other nodes cannot reach 127.0.0.1 -> set MASTER_ADDR to node 0's address, the same on every node"
}

check_device() {
  case "$LAUNCH_DEVICE" in auto | cuda | cpu) ;; *)
    fail "device" "LAUNCH_DEVICE=$LAUNCH_DEVICE is not auto, cuda or cpu -> set one of them" ;;
  esac
}

check_node_count
check_node_rank
check_port_number
check_restarts
check_master_address
check_device

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
  # two gloo processes: the distributed code paths run on a laptop too
  NPROC_PER_NODE=${NPROC_PER_NODE:-2}
fi
is_count "$NPROC_PER_NODE" || fail "processes per node" "NPROC_PER_NODE=$NPROC_PER_NODE is not a number -> set NPROC_PER_NODE=1 or more"
WORLD_SIZE=$((NNODES * NPROC_PER_NODE))

# Each process gets its share of the cores for its OpenMP pool: torchrun alone would give every
# process one thread when it starts several, leaving the other cores of a CPU run idle.
CORES=$(nproc 2>/dev/null || echo 2)
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$((
  NPROC_PER_NODE > 0 && CORES / NPROC_PER_NODE > 0 ? CORES / NPROC_PER_NODE : 1 ))}
if [ "$LAUNCH_DEVICE" = cpu ]; then export CUDA_VISIBLE_DEVICES=""; fi

# the source address of this node's route to the master; empty if there is none
address_towards_master() {
  "$PYTHON" - "$MASTER_ADDR" "$MASTER_PORT" <<'EOF' 2>/dev/null || true
import socket, sys
family, kind, _, _, address = socket.getaddrinfo(sys.argv[1], int(sys.argv[2]),
                                                 type=socket.SOCK_DGRAM)[0]
with socket.socket(family, kind) as probe:
    probe.connect(address)  # UDP: connect() only picks the route, it sends nothing
    print(probe.getsockname()[0])
EOF
}

# --tee 2: every rank's stderr goes to LOG_DIR (for the failure report below) and still to the
# console, prefixed [default<local rank>]:; stdout, where rank 0 logs, reaches the console as is.
RUN_LOG_DIR=$LOG_DIR/$(date +%Y%m%d-%H%M%S)-node$NODE_RANK-$$
TORCHRUN=("$PYTHON" -m torch.distributed.run --nnodes "$NNODES" --nproc-per-node "$NPROC_PER_NODE"
  --max-restarts "$MAX_RESTARTS" --log-dir "$RUN_LOG_DIR" --tee 2)
if [ "$NNODES" -gt 1 ]; then
  # c10d, not the static rendezvous: after a worker fails, torchrun on every node restarts its
  # workers together.
  # Node 0 hosts the rendezvous store on MASTER_PORT, said explicitly (is_host): torchrun's guess
  # compares MASTER_ADDR with this host's names and addresses and misses secondary interfaces.
  # The nodes are ranked by LOCAL_ADDR as text and the first one's becomes the workers' MASTER_ADDR;
  # without it torchrun takes socket.getfqdn(), which the other nodes may not reach ("localhost").
  LOCAL_ADDR=${LOCAL_ADDR:-$(address_towards_master)}
  TORCHRUN+=(--rdzv-backend c10d --rdzv-endpoint "$MASTER_ADDR:$MASTER_PORT" --rdzv-id "$RDZV_ID"
    --rdzv-conf "is_host=$(( NODE_RANK == 0 ))" ${LOCAL_ADDR:+--local-addr "$LOCAL_ADDR"})
else
  TORCHRUN+=(--node-rank "$NODE_RANK" --master-addr "$MASTER_ADDR" --master-port "$MASTER_PORT")
fi
TORCHRUN+=("$SCRIPT" "${ARGS[@]}")

if [ "$DRY_RUN" = 1 ]; then
  echo "OMP_NUM_THREADS=$OMP_NUM_THREADS ${TORCHRUN[*]}"
  exit 0
fi

# ---------------------------------------------------------------- checks
check_script() {
  [ -f "$SCRIPT" ] || fail "script" "$SCRIPT not found -> name an existing script: train_ddp.py, train_fsdp.py or stress_test.py"
  report "script" "ok ($(basename "$SCRIPT"))"
}

probe_python() {  # one interpreter start for the next three checks: importing torch takes seconds
  PROBE=$("$PYTHON" - "$IS_TRAINER" 2>/dev/null <<'PY'
import importlib.util, sys
import torch
import torch.distributed as dist
print(f"torch {torch.__version__}, Python {sys.version.split()[0]}")
needed = ["transformers", "tokenizers", "pyarrow", "yaml", "numpy"] if sys.argv[1] == "1" else []
print(" ".join(m for m in needed if importlib.util.find_spec(m) is None) or "-")
gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
print(gpus)
print(".".join(map(str, torch.cuda.nccl.version())) if gpus and dist.is_nccl_available()
      else "0.0.0")
PY
  ) || PROBE=""
}

check_python() {
  local version missing
  version=$(sed -n 1p <<<"$PROBE")
  [ -n "$version" ] ||
    fail "python and torch" "'$PYTHON' cannot import torch -> pip install -r $HERE/requirements.txt, or set PYTHON=/path/to/python"
  missing=$(sed -n 2p <<<"$PROBE")
  [ "$missing" = - ] || fail "python and torch" "'$PYTHON' cannot import $missing -> pip install -r $HERE/requirements.txt"
  report "python and torch" "ok ($version)"
}

check_cuda() {
  if [ "$EXPECT_GPUS" = 0 ]; then report "cuda" "ok (no GPU: CPU with gloo)"; return; fi
  local torch_gpus
  torch_gpus=$(sed -n 3p <<<"$PROBE")
  [ "${torch_gpus:-0}" -gt 0 ] ||
    fail "cuda" "GPUs are expected but torch.cuda.is_available() is False -> install a CUDA build of torch, check CUDA_VISIBLE_DEVICES, or LAUNCH_DEVICE=cpu"
  TORCH_GPUS=$torch_gpus
  report "cuda" "ok ($torch_gpus GPUs visible to torch)"
}

check_nccl() {
  if [ "$EXPECT_GPUS" = 0 ]; then report "nccl" "ok (not used: gloo)"; return; fi
  local version major minor
  version=$(sed -n 4p <<<"$PROBE")
  IFS=. read -r major minor _ <<<"${version:-0.0.0}"
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
  report "processes per node" "ok ($NPROC_PER_NODE per node x $NNODES nodes = $WORLD_SIZE; this is node $NODE_RANK)"
}

check_config() {  # the trainer validates its own config (types, unknown keys, batch divisibility)
  local output
  output=$(WORLD_SIZE=$WORLD_SIZE "$PYTHON" "$SCRIPT" --check "${ARGS[@]}" 2>&1) ||
    fail "config" "$(grep -m1 '^error:' <<<"$output" | sed 's/^error: //' || echo "$output" | tail -n 1)"
  DATA_DIR=$(sed -n 's/^data\.dir=//p' <<<"$output")
  DATA_KIND=$(sed -n 's/^data\.kind=//p' <<<"$output")
  CKPT_DIR=$(sed -n 's/^checkpoint\.dir=//p' <<<"$output")
  CKPT_RESUME=$(sed -n 's/^checkpoint\.resume=//p' <<<"$output")
  TIMEOUT_S=$(sed -n 's/^dist\.timeout_s=//p' <<<"$output")
  report "config" "ok (collective timeout ${TIMEOUT_S}s from dist.timeout_s)"
}

check_data() {
  [ -f "$DATA_DIR/meta.json" ] && { report "data" "ok ($DATA_DIR)"; return; }
  local source="--input YOUR_TEXT" kind=() default=data/stdlib
  if [ "${DATA_KIND:-text}" = images ]; then
    source="--images YOUR_IMAGE_FOLDER" kind=(--images) default=data/digits
  fi
  # the default data only: a data.dir of the user's would get the default corpus or the digits
  [ "$DATA_DIR" = "$default" ] ||
    fail "data" "no prepared data in $DATA_DIR -> run: $PYTHON $HERE/preprocess.py $source --out $DATA_DIR"
  report "data" "preparing the default ${DATA_KIND:-text} data into $DATA_DIR (once)"
  "$PYTHON" "$HERE/preprocess.py" "${kind[@]}" --out "$DATA_DIR" ||
    fail "data" "preprocess.py failed (its error is above) -> fix it, or prepare data yourself and pass data.dir="
  report "data" "ok ($DATA_DIR)"
}

check_checkpoint_dir() {
  if ! { mkdir -p "$CKPT_DIR" && touch "$CKPT_DIR/.write-test" &&
         rm -f "$CKPT_DIR/.write-test"; } 2>/dev/null; then
    fail "checkpoint dir" "cannot create or write $CKPT_DIR -> set checkpoint.dir= to a writable directory"
  fi
  local free_gb
  is_count "${MIN_FREE_GB:-2}" || fail "checkpoint dir" "MIN_FREE_GB=$MIN_FREE_GB is not a number -> set MIN_FREE_GB=2"
  free_gb=$(df -Pk "$CKPT_DIR" | awk 'NR == 2 { printf "%d", $4 / 1048576 }')
  [ "$free_gb" -ge "${MIN_FREE_GB:-2}" ] ||
    fail "checkpoint dir" "only ${free_gb} GB free in $CKPT_DIR (MIN_FREE_GB=${MIN_FREE_GB:-2}) -> free space or set checkpoint.dir="
  report "checkpoint dir" "ok ($CKPT_DIR, ${free_gb} GB free)"
}

check_master_port_free() {
  local problem
  problem=$("$PYTHON" - "$MASTER_PORT" <<'EOF' 2>&1
import socket, sys
with socket.socket() as s:
    # as torchrun's store does: TIME_WAIT is no conflict
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        s.bind(("", int(sys.argv[1])))
    except OSError as error:
        sys.exit(error.strerror)
EOF
  ) || fail "master port" "cannot listen on port $MASTER_PORT on this node ($problem) -> set MASTER_PORT to a free port (the same on every node)"
  report "master port" "ok ($MASTER_PORT free)"
}

# Wait for node 0 (it may start later), then ask for a TCPStore: on any other service torchrun's
# client would retry for its whole timeout (60 s c10d, 900 s static rendezvous), or hang if silent.
# Exit 1: nothing answered in time; exit 3: something answered, but not a store.
check_master_reachable() {
  local wait_s=${MASTER_WAIT_S:-120} status=0
  is_count "$wait_s" || fail "master" "MASTER_WAIT_S=$wait_s is not a number of seconds -> set MASTER_WAIT_S=120"
  "$PYTHON" - "$MASTER_ADDR" "$MASTER_PORT" "$wait_s" <<'EOF' >/dev/null 2>&1 || status=$?
import socket, sys, threading, time
from datetime import timedelta
host, port, deadline = sys.argv[1], int(sys.argv[2]), time.monotonic() + float(sys.argv[3])
while True:
    try:
        socket.create_connection((host, port), timeout=5).close()
        break
    except OSError:
        if time.monotonic() > deadline:
            sys.exit(1)
        time.sleep(1)
import torch.distributed as dist
answered = []
# wait_for_workers=False, like the missing world_size, keeps this probe out of the count of joined
# workers that a master store can wait for; a client never waits for the others itself
def ask_store():
    dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=5), wait_for_workers=False)
    answered.append(True)
# A thread with a deadline: a TCPStore client waits without a time limit for the answer to its
# first message, so a server that accepts and stays silent would hang it.
asking = threading.Thread(target=ask_store, daemon=True)
asking.start()
asking.join(5)
sys.exit(0 if answered else 3)
EOF
  case "$status" in
    0) report "master" "ok ($MASTER_ADDR:$MASTER_PORT answers as a torchrun rendezvous server)" ;;
    3) fail "master" "$MASTER_ADDR:$MASTER_PORT answers but is not a torchrun rendezvous server -> check MASTER_ADDR/MASTER_PORT: another service uses that port, or node 0 runs something else there" ;;
    *) fail "master" "$MASTER_ADDR:$MASTER_PORT unreachable after ${wait_s}s -> start node 0 first, check MASTER_ADDR/MASTER_PORT and the firewall" ;;
  esac
}

check_log_dir() {
  { mkdir -p "$RUN_LOG_DIR" && : >"$RUN_LOG_DIR/torchrun.log"; } 2>/dev/null ||
    fail "log dir" "cannot create or write $RUN_LOG_DIR -> set LOG_DIR to a writable directory"
  report "log dir" "ok ($RUN_LOG_DIR)"
}

# set before the checks: a stop while the default data is prepared ends with its line
STOPPED_BY="" STOPPED_AT_ONCE="" TORCHRUN_PID="" STARTING=""
# shellcheck disable=SC2317  # called by the traps below, which shellcheck 0.9 does not follow
stop_torchrun() {  # trap for SIGTERM and SIGINT, set before torchrun starts
  if [ -z "$TORCHRUN_PID" ] && [ -z "$STARTING" ]; then
    echo "stopped by SIG$1 before torchrun started: nothing was launched" >&2
    [ "$1" = INT ] && exit 130
    exit 143
  fi
  if [ -n "$STOPPED_BY" ]; then  # a second Ctrl-C at a terminal: at once, without a checkpoint
    if [ "$1" = INT ] && [ -t 0 ] && [ -n "$TORCHRUN_PID" ]; then
      STOPPED_AT_ONCE=1
      pkill -KILL -P "$TORCHRUN_PID" 2>/dev/null || true
      kill -KILL "$TORCHRUN_PID" 2>/dev/null || true
    fi
    # 0: a bare return in a trap gives the interrupted command's status (a wait's 143), and set -e
    # would then end this script, leaving torchrun running
    return 0
  fi
  # Once: torchrun may get signals of its own too, and a third would break its shutdown (see the top).
  # SIGTERM also for SIGINT: torchrun, a background job, ignores SIGINT until its workers start.
  STOPPED_BY=$1
  if [ -n "$TORCHRUN_PID" ]; then kill -TERM "$TORCHRUN_PID" 2>/dev/null || true; fi
}
trap 'stop_torchrun TERM' TERM
trap 'stop_torchrun INT' INT

check_script
probe_python
check_python
check_cuda
check_nccl
check_processes
if [ "$IS_TRAINER" = 1 ]; then check_config; fi
# A worker node waits for the master before it looks at the data: node 0 prepares the default corpus
# before it opens the rendezvous, so on a shared filesystem no two nodes build it at once.
if [ "$NODE_RANK" != 0 ]; then check_master_reachable; fi
if [ "$IS_TRAINER" = 1 ]; then
  check_data
  check_checkpoint_dir
fi
if [ "$NODE_RANK" = 0 ]; then check_master_port_free; fi
check_log_dir

# ---------------------------------------------------------------- launch, watch, report
# torchrun's traceback and summary of the ranks at its end: shown below if no rank's line said why
HELD_BACK=$RUN_LOG_DIR/torchrun-traceback.log
# Lines pass on as they come; a traceback of torchrun's own (a worker's line starts [default<N>]:)
# waits for its exception: ChildFailedError or SignalException go, with what follows, to HELD_BACK.
hold_back_torchruns_traceback() {
  local line held=()
  while IFS= read -r line || [ -n "$line" ]; do
    if [ ${#held[@]} -eq 0 ] && [ "$line" != "Traceback (most recent call last):" ]; then
      printf '%s\n' "$line"
      continue
    fi
    held+=("$line")
    case "$line" in
      "Traceback (most recent call last):" | " "* | "") ;;  # a signal's frame may print a blank line
      *.ChildFailedError:* | *.SignalException:*)
        { printf '%s\n' "${held[@]}"; cat; } >"$HELD_BACK"
        return ;;
      *) printf '%s\n' "${held[@]}"; held=() ;;
    esac
  done
  if [ ${#held[@]} -gt 0 ]; then printf '%s\n' "${held[@]}"; fi
}
show_held_back() { if [ -f "$HELD_BACK" ]; then cat "$HELD_BACK" >&2; fi; }

# torchrun's own messages go to a file and, through tail (GNU: --pid) and the filter above, to
# stderr: its summary of a failure names the rank that failed first, which the report below needs.
printf "launching:"; printf " %q" "${TORCHRUN[@]}"; echo  # quoted: a line to copy and run
STARTING=1  # a signal from here on is passed on once torchrun's PID is known
# LAUNCH_RUN marks torchrun and its workers, not this script: lost_workers finds them by it
LAUNCH_RUN=$RUN_LOG_DIR "${TORCHRUN[@]}" 2>>"$RUN_LOG_DIR/torchrun.log" &
TORCHRUN_PID=$!
if [ -n "$STOPPED_BY" ]; then kill -TERM "$TORCHRUN_PID" 2>/dev/null || true; fi
# deaf to SIGTERM, which Slurm sends to every process: the stream lasts until torchrun has exited
( trap '' TERM
  tail -n +1 -s 0.2 -f --pid="$TORCHRUN_PID" "$RUN_LOG_DIR/torchrun.log" |
    hold_back_torchruns_traceback >&2 ) &
TAIL_PID=$!
live_children() {  # whether a process has a child that has not ended (a zombie has)
  local child
  for child in $(pgrep -P "$1" 2>/dev/null); do
    [ "$(sed 's/.*) //' "/proc/$child/stat" 2>/dev/null | cut -d' ' -f1)" = Z ] || return 0
  done
  return 1
}

status=0
wait "$TORCHRUN_PID" || status=$?
# A trapped signal ends `wait` early: watch torchrun until it exits. One still running 10 s after
# its last worker ended is stuck (a third signal: see the top) and is ended.
idle=0
while kill -0 "$TORCHRUN_PID" 2>/dev/null; do
  if live_children "$TORCHRUN_PID"; then idle=0; else idle=$((idle + 1)); fi
  if [ "$idle" -ge 20 ]; then kill -KILL "$TORCHRUN_PID" 2>/dev/null || true; fi
  sleep 0.5
done
status=0
wait "$TORCHRUN_PID" || status=$?
wait "$TAIL_PID" || true

# A signal while torchrun starts its workers ends torchrun before it knows them: they run on, each
# in a session of its own. Whatever still carries this run's mark is ended: SIGTERM, SIGKILL at 30 s.
lost_workers() {
  grep -lsxzF "LAUNCH_RUN=$RUN_LOG_DIR" /proc/[0-9]*/environ | cut -d/ -f3 || true
}
end_lost_workers() {
  local lost count waited=0
  mapfile -t lost < <(lost_workers)
  count=${#lost[@]}
  [ "$count" -gt 0 ] || return 0
  kill -TERM "${lost[@]}" 2>/dev/null || true
  while [ -n "$(lost_workers)" ] && [ "$waited" -lt 60 ]; do sleep 0.5; waited=$((waited + 1)); done
  mapfile -t lost < <(lost_workers)
  if [ ${#lost[@]} -gt 0 ]; then kill -KILL "${lost[@]}" 2>/dev/null || true; fi
  echo "note: torchrun exited and left $count of its processes running: ended them" >&2
}
end_lost_workers

last_attempt_dir() {  # LOG_DIR/<date>-node<rank>-<pid>/<rendezvous id>_<random>/attempt_<restarts>
  local run_dir attempt=0
  run_dir=$(find "$RUN_LOG_DIR" -mindepth 1 -maxdepth 1 -type d -print -quit)
  [ -n "$run_dir" ] || return 0
  while [ -d "$run_dir/attempt_$((attempt + 1))" ]; do attempt=$((attempt + 1)); done
  echo "$run_dir/attempt_$attempt"
}

# what failed, from torchrun's summary ("Root Cause") and the ranks' stderr files
report_failure() {
  local attempt_dir rank local_rank exit_code stderr_file file error_line=""
  attempt_dir=$(last_attempt_dir)
  read -r rank local_rank < <(sed -n \
    '/Root Cause/,$ s/^ *rank *: \([0-9]*\) (local_rank: \([0-9]*\)).*/\1 \2/p' \
    "$RUN_LOG_DIR/torchrun.log" | sed -n 1p) || true
  exit_code=$(sed -n '/Root Cause/,$ s/^ *exitcode *: \([^ ]*\).*/\1/p' \
    "$RUN_LOG_DIR/torchrun.log" | sed -n 1p)
  FIRST_EXIT_CODE=$exit_code
  if [ -z "${local_rank:-}" ] || [ -z "$attempt_dir" ]; then
    show_held_back
    echo "FAIL: torchrun exited with status $status before any worker failed -> its messages above say why (also in $RUN_LOG_DIR/torchrun.log)" >&2
    return
  fi
  stderr_file=$attempt_dir/$local_rank/stderr.log
  # the rank that failed first may have said why; if not, maybe another one did (the trainer's
  # errors come from rank 0)
  for file in "$stderr_file" "$attempt_dir"/*/stderr.log; do
    error_line=$(grep -m1 '^error:' "$file" 2>/dev/null || true)
    [ -n "$error_line" ] && break
  done
  # after a crash (a traceback in a rank's stderr) torchrun's summary stays, whatever else was said
  if [ -z "$error_line" ] ||
     grep -qs '^Traceback (most recent call last):' "$attempt_dir"/*/stderr.log; then
    show_held_back
  fi
  if [ -n "$error_line" ]; then
    echo "FAIL: $(basename "$SCRIPT") failed: rank $rank exited first (exit code $exit_code); local rank $(basename "$(dirname "$file")") wrote \"$error_line\" (logs: $RUN_LOG_DIR)" >&2
  else
    echo "FAIL: $(basename "$SCRIPT") failed: rank $rank (local rank $local_rank on this node) exited first (exit code $exit_code) without an 'error:' line; the last lines of its stderr ($stderr_file):" >&2
    tail -n 15 "$stderr_file" | sed 's/^/    /' >&2
  fi
}

restarts=$(basename "$(last_attempt_dir)" | sed -n 's/^attempt_//p')
# with checkpoint.resume=never or a step_* directory the same command would refuse the
# checkpoints this run wrote
GO_ON="run the same command again"
if [ -n "${CKPT_RESUME:-}" ] && [ "$CKPT_RESUME" != auto ]; then
  GO_ON="run the same command with checkpoint.resume=auto added"
fi
# the trainer's line when it stopped after a checkpoint, from any rank of any attempt
stop_line=$(grep -rh '^stopped at step' "$RUN_LOG_DIR" 2>/dev/null | sed -n 1p || true)
if [ -n "$STOPPED_AT_ONCE" ]; then
  show_held_back
  echo "stopped at once by a second Ctrl-C: torchrun and its workers were killed, without a checkpoint of this step -> $GO_ON to resume from the newest checkpoint (logs: $RUN_LOG_DIR)" >&2
  exit 130
fi
if [ -n "$stop_line" ]; then
  echo "$stop_line (logs: $RUN_LOG_DIR)" >&2
  exit 3
fi
if [ -n "$STOPPED_BY" ]; then
  show_held_back
  echo "FAIL: stopped by SIG$STOPPED_BY, passed on to torchrun and the workers, which have exited (logs: $RUN_LOG_DIR) -> $GO_ON to continue: the trainer resumes from its newest checkpoint" >&2
  [ "$STOPPED_BY" = INT ] && exit 130
  exit 143
fi
if [ "$status" != 0 ]; then
  report_failure
  # torchrun exits 1 whatever its workers' codes: a worker's 2, a mistake to fix, is passed on
  if [ "${FIRST_EXIT_CODE:-}" = 2 ]; then exit 2; fi
elif [ "${restarts:-0}" -gt 0 ]; then
  echo "done after $restarts restart(s) of the workers (MAX_RESTARTS=$MAX_RESTARTS); logs of every attempt: $RUN_LOG_DIR"
fi
exit "$status"
