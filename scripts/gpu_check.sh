#!/usr/bin/env bash
# The checks a session with a CUDA GPU runs (a few minutes on one H100):
#   1. tests/dist/test_cuda.py: both front doors on the GPU, side streams on == off bit for bit
#      (core/streams.py [Note: streams and events]), no host sync in forward + backward;
#      tests/dist/test_offload_optim.py::test_offload_adamw_on_cuda: OffloadAdamW == fused AdamW bit for bit
#      with pinned, non-blocking gradient copies (core/offload.py), side streams on and off;
#   2. the GPU bench on a small GPT, side streams on (FULLSHARD_STREAMS=1) and off, tables under OUT_DIR.
# Usage: scripts/gpu_check.sh [OUT_DIR]   (default /tmp/fullshard_gpu_check)
set -euo pipefail
cd "$(dirname "$0")/.."
OUT_DIR="${1:-/tmp/fullshard_gpu_check}"
PY="${PYTHON:-python}"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
"$PY" -m pytest -q -rs tests/dist/test_cuda.py tests/dist/test_offload_optim.py::test_offload_adamw_on_cuda
SMALL=(--layers 4 --width 1024 --heads 16 --seq-len 512 --batch-size 4 --warmup-steps 3 --timed-steps 5
       --timeout-s 120)
FULLSHARD_STREAMS=1 "$PY" -m fullshard.bench.gpu --out-dir "$OUT_DIR/streams_on" --modes fully_shard,wrapper,fsdp2 \
    "${SMALL[@]}"
FULLSHARD_STREAMS=0 "$PY" -m fullshard.bench.gpu --out-dir "$OUT_DIR/streams_off" --modes fully_shard,wrapper \
    "${SMALL[@]}"
