#!/usr/bin/env bash
# The GPU benchmarks in one go, for a session lent a GPU machine (about 10 minutes on an H100;
# run `make test-gpu` first):
#   1. trainer overhead on the `small` flavor (bench/throughput.py, bf16), ratio to a minimal loop;
#      then model FLOPs utilisation of the `1B` flavor (Llama-3.2-1B's shape) on the one GPU, bf16,
#      torch.compile, 4 x 2048 tokens a step, without and with activation checkpointing
#      (docs/backends.md compares it with torchtitan's published MFU);
#   2. the quality sweep on the `small` flavor (124M parameters), 3 seeds, 200 steps per island:
#      DDP, one island alone and fp32 DiLoCo with the llama3 federation config, then int8 and
#      top-k, then streaming int8 (2 fragments) with and without the overlap, in the simulator
#      (the islands in one process on the one GPU: bench/outer_sweep.py); about 7 minutes on an
#      H200. The table of all three: bench/outer_sweep.py --summarize $OUT/sweep-small-*.jsonl
# PYTHON picks the interpreter (default .venv/bin/python), OUT_DIR where results go (runs/gpu, the
# sweep's file started afresh), DEVICE the device (cuda; cpu to try the script, slowly).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
OUT=${OUT_DIR:-runs/gpu}
DEVICE=${DEVICE:-cuda}
mkdir -p "$OUT"
rm -f "$OUT"/sweep-small-*"$DEVICE".jsonl  # outer_sweep.py appends: a second run would mix with the first
"$PY" bench/throughput.py --device "$DEVICE" --flavor small --batch-size 16 --out "$OUT/throughput-$DEVICE-small.json"
ONE_B=("$PY" bench/throughput.py --device "$DEVICE" --flavor 1B --seq-len 2048 --batch-size 4 --compile
       --steps 10 --warmup 3 --repeats 2)
"${ONE_B[@]}" --out "$OUT/throughput-$DEVICE-1B.json"
"${ONE_B[@]}" --activation-checkpointing --out "$OUT/throughput-$DEVICE-1B-ac.json"
SWEEP=("$PY" bench/outer_sweep.py --config configs/llama3/federation.toml --device "$DEVICE" --mixed-precision fp32
       --steps 200 --seeds 0 1 2)
"${SWEEP[@]}" --workers 9 --set model.flavor=small --out "$OUT/sweep-small-$DEVICE.jsonl"
"${SWEEP[@]}" --workers 6 --no-baselines --set model.flavor=small --grid fault_tolerance.codec=int8,topk \
    --out "$OUT/sweep-small-codecs-$DEVICE.jsonl"
"${SWEEP[@]}" --workers 6 --no-baselines \
    --set model.flavor=small fault_tolerance.codec=int8 fault_tolerance.num_fragments=2 \
    --grid fault_tolerance.fragment_sync_delay=1,0 --out "$OUT/sweep-small-streaming-$DEVICE.jsonl"
"$PY" bench/outer_sweep.py --summarize "$OUT"/sweep-small-*"$DEVICE".jsonl
