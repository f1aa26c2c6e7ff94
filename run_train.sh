#!/usr/bin/env bash
# Start one island under torchrun, the way the reference platform (TorchTitan + TorchFT)
# launches one replica group:
#
#   archipelago lighthouse --min-replicas 1          # or: torchft_lighthouse --min_replicas 1 ...
#   NGPU=1 CONFIG_FILE=configs/llama3/debug.toml ./run_train.sh \
#       --fault_tolerance.enable --fault_tolerance.replica_id=0 --fault_tolerance.group_size=2
#   (and the same with --fault_tolerance.replica_id=1 for the second island)
#
# Every argument is passed on to `archipelago train`. Environment (docs/federation.md):
#   NGPU                ranks per node (default 1)
#   NNODES              nodes in this island (default 1)
#   MASTER_ADDR         host of the island's rendezvous store (default localhost; needed with NNODES > 1)
#   MASTER_PORT         port of that store; unset with NNODES=1 means `torchrun --standalone`
#                       (a free port, so several islands on one host never collide)
#   ISHOST              1 (or yes/true) on the node that hosts the rendezvous store at
#                       MASTER_ADDR:MASTER_PORT (the island's first node), 0 (no/false) on the
#                       others, as the reference platform's README writes it; unset: torchrun decides by
#                       comparing MASTER_ADDR with this host's names (always 1 with NNODES=1)
#   LOCAL_ADDR          this host's address as the other islands (and the island's other nodes)
#                       reach it, e.g. its Tailscale IP; exported for the trainer, and given to
#                       torchrun as --local-addr; with an address other than loopback the
#                       islands need ARCHIPELAGO_FEDERATION_KEY_FILE (`archipelago secret new`)
#   CONFIG_FILE         TOML run file (default configs/llama3/debug.toml)
#   TORCHFT_LIGHTHOUSE  lighthouse URL (default http://localhost:29510)
#   ARCHIPELAGO_DRY_RUN 1: check the configuration, print the torchrun command, start nothing
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
if [[ -x "$ROOT/.venv/bin/python" ]]; then PYTHON="$ROOT/.venv/bin/python"; else PYTHON=python3; fi

NGPU="${NGPU:-1}"
NNODES="${NNODES:-1}"
CONFIG_FILE="${CONFIG_FILE:-configs/llama3/debug.toml}"
# A relative CONFIG_FILE is looked up from here, then from the repository root.
if [[ ! -f "$CONFIG_FILE" && -f "$ROOT/$CONFIG_FILE" ]]; then CONFIG_FILE="$ROOT/$CONFIG_FILE"; fi
export NGPU NNODES CONFIG_FILE
export TORCHFT_LIGHTHOUSE="${TORCHFT_LIGHTHOUSE:-http://localhost:29510}"
if [[ -n "${LOCAL_ADDR:-}" ]]; then export LOCAL_ADDR; fi

fail() { echo "run_train.sh: $*" >&2; exit 2; }
[[ "$NGPU" =~ ^[1-9][0-9]*$ ]] || fail "NGPU=$NGPU: expected the number of ranks per node (1, 2, ...)"
[[ "$NNODES" =~ ^[1-9][0-9]*$ ]] || fail "NNODES=$NNODES: expected the number of nodes of this island (1, 2, ...)"
case "${ISHOST:-}" in  # the reference platform's README writes yes/no; torchrun takes 1/0
  "" | 0 | 1) ;;
  [Yy][Ee][Ss] | [Tt][Rr][Uu][Ee]) ISHOST=1 ;;
  [Nn][Oo] | [Ff][Aa][Ll][Ss][Ee]) ISHOST=0 ;;
  *) fail "ISHOST=$ISHOST: expected 1 or yes (this node hosts the rendezvous), 0 or no (it does not)" ;;
esac

# Check the configuration (and answer --help) here, in a second, instead of inside torchrun,
# which would report a configuration error as a crashed worker with exit code 1.
"$PYTHON" - --config "$CONFIG_FILE" "$@" <<'EOF'
import os, sys
try:
    from archipelago.config import ConfigError, load_config, validate_for_island
except ModuleNotFoundError as exc:
    print(f"run_train.sh: {sys.executable} cannot import {exc.name}: run `make setup` in this repository "
          "first (it creates .venv, which this script uses)", file=sys.stderr)
    sys.exit(2)
try:
    cfg = load_config(sys.argv[1:], prog="run_train.sh",
                      description="Start one island under torchrun (NGPU ranks per node, NNODES nodes); "
                                  "the options are those of `archipelago train`.")
    validate_for_island(cfg, int(os.environ["NGPU"]) * int(os.environ["NNODES"]))
except ConfigError as exc:
    print(f"error: {exc}", file=sys.stderr)
    sys.exit(2)
EOF
for arg in "$@"; do
  if [[ "$arg" == "-h" || "$arg" == "--help" ]]; then exit 0; fi  # the check above printed the help
done

launcher=(--nnodes="$NNODES" --nproc-per-node="$NGPU")
if [[ "$NNODES" == 1 && -z "${MASTER_PORT:-}" ]]; then
  launcher+=(--standalone)
else
  [[ -n "${MASTER_PORT:-}" ]] || fail "NNODES=$NNODES needs MASTER_PORT (and MASTER_ADDR): the island's rendezvous on its first node"
  if [[ "$NNODES" != 1 && -z "${MASTER_ADDR:-}" ]]; then
    fail "NNODES=$NNODES needs MASTER_ADDR: the address of the island's first node (the one with ISHOST=1)"
  fi
  if [[ "$NNODES" == 1 ]]; then ISHOST="${ISHOST:-1}"; fi
  launcher+=(--rdzv-backend=c10d --rdzv-endpoint="${MASTER_ADDR:-localhost}:$MASTER_PORT")
  if [[ -n "${ISHOST:-}" ]]; then launcher+=(--rdzv-conf="is_host=$ISHOST"); fi
fi
if [[ -n "${LOCAL_ADDR:-}" ]]; then launcher+=(--local-addr="$LOCAL_ADDR"); fi

# torchrun would set 1 thread per rank; give each rank its share of the cores instead.
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-$(( $(nproc) / NGPU > 0 ? $(nproc) / NGPU : 1 ))}"

cmd=("$PYTHON" -m torch.distributed.run "${launcher[@]}"
     -m archipelago.launch.cli train --config "$CONFIG_FILE" "$@")
echo "TORCHFT_LIGHTHOUSE=$TORCHFT_LIGHTHOUSE${LOCAL_ADDR:+ LOCAL_ADDR=$LOCAL_ADDR} OMP_NUM_THREADS=$OMP_NUM_THREADS ${cmd[*]}"
if [[ "${ARCHIPELAGO_DRY_RUN:-0}" == 1 ]]; then exit 0; fi
exec "${cmd[@]}"
