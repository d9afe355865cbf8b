#!/bin/bash
# A multi-node trainer, rehearsed on this machine: 2 iterations of the embedded default whose two
# Train Worker ranks are launched by torchrun as two "nodes" of one rank each on localhost (a 2-D
# HSDP mesh: 2 nodes × 1 GPU), with the coordinator and its local agents (README "Multi-node
# training"). The commands are those of a real cluster; only the addresses are localhost:
#
#   spotlight keys init KEYS; spotlight keys add KEYS trainer NAME        # once, on the coordinator
#   spotlight up --external-trainers --reserved 0.0.0.0:7400 --keys KEYS …   # trainer port 7401
#   torchrun --nnodes 2 --nproc-per-node 1 --node-rank N --master-addr HEAD --master-port 29500 \
#       -m spotlight.workers.train.launch --coordinator HEAD:7401 --keys KEYS  # on node N = 0, 1
#
#   examples/deploy/two-node-trainer-local.sh [WORK_DIR]      (default: a new temporary directory)
# Exits 0 when the run finished both iterations and every process exited cleanly.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
source "$ROOT/scripts/_venv.sh"
WORK="${1:-$(mktemp -d -t spotlight-two-node-XXXX)}"
mkdir -p "$WORK"
KEYS="$WORK/keys"
RUN_DIR="$WORK/run"
echo "two-node trainer rehearsal in $WORK (logs: $WORK/*.log, $RUN_DIR/logs/)"

# the coordinator's keys, and the trainer key every rank presents (copied to each node in real life)
spotlight keys init "$KEYS" >/dev/null
spotlight keys add "$KEYS" trainer two-node >/dev/null

read -r PORT TRAINER_PORT MASTER_PORT < <(python - <<'PY'
import socket
socks = [socket.socket() for _ in range(3)]
for s in socks:
    s.bind(("127.0.0.1", 0))
print(*(s.getsockname()[1] for s in socks))
PY
)

pids=()
cleanup() {
  for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done
}
trap cleanup EXIT

spotlight up --local --agents 1 --config "$ROOT/examples/deploy/two-node-trainer.toml" --run-dir "$RUN_DIR" \
  --reserved "127.0.0.1:$PORT" --external-trainers --trainer-port "$TRAINER_PORT" --keys "$KEYS" \
  --timeout-s "${TIMEOUT_S:-900}" > "$WORK/up.log" 2>&1 &
up=$!
pids+=("$up")

# node 0 and node 1: torchrun's static rendezvous on node 0 (MASTER_ADDR), one rank per node
for NODE in 0 1; do
  torchrun --nnodes 2 --nproc-per-node 1 --node-rank "$NODE" --master-addr 127.0.0.1 --master-port "$MASTER_PORT" \
    -m spotlight.workers.train.launch --coordinator "127.0.0.1:$TRAINER_PORT" --keys "$KEYS" \
    > "$WORK/trainer-node$NODE.log" 2>&1 &
  pids+=("$!")
done

rc=0
wait "$up" || rc=$?
for pid in "${pids[@]:1}"; do
  wait "$pid" || rc=$((rc ? rc : $?))
done
trap - EXIT
cat "$WORK/up.log"
if [ "$rc" -ne 0 ]; then
  echo "two-node trainer rehearsal FAILED (exit $rc); trainer logs:" >&2
  tail -n 20 "$WORK"/trainer-node*.log >&2
  exit "$rc"
fi
echo "two-node trainer rehearsal ok: $RUN_DIR/metrics.jsonl"
