#!/usr/bin/env bash
# The checks a session with a CUDA GPU runs (about 4 minutes on one H200, the machine's start not counted):
#   1. tests/dist/test_cuda.py: both front doors on the GPU, side streams on == off bit for bit
#      (core/streams.py [Note: streams and events]), no host sync in forward + backward;
#      tests/dist/test_offload_optim.py::test_offload_adamw_on_cuda: OffloadAdamW == fused AdamW bit for bit
#      with pinned, non-blocking gradient copies (core/offload.py), side streams on and off;
#   2. the GPU bench on the default 1.31 B GPT: every mode without offload (side streams on, the default),
#      the two fullshard modes with FULLSHARD_STREAMS=0, and the offload modes (fewer steps: a step takes
#      seconds). Each writes OUT_DIR/<part>/gpu.md and gpu.json, and a profiler trace per mode.
# 3. one table of the runs without offload, rendered from their raw results (OUT_DIR/combined/gpu.md; the
#    offload table is OUT_DIR/offload/gpu.md), ready for docs/benchmarks/gpu/ (docs/benchmarks.md).
# Usage: scripts/gpu_check.sh [OUT_DIR]   (default /tmp/fullshard_gpu_check)
set -euo pipefail
cd "$(dirname "$0")/.."
OUT_DIR="${1:-/tmp/fullshard_gpu_check}"
PY="${PYTHON:-python}"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
# A failing CUDA test does not stop the bench (device time is scarce); the script exits with the tests' status.
TESTS_RC=0
"$PY" -m pytest -q -rs -p no:cacheprovider tests/dist/test_cuda.py tests/dist/test_offload_optim.py::test_offload_adamw_on_cuda \
    || TESTS_RC=$?
BIG=(--batch-size 12 --warmup-steps 2 --timed-steps 5 --timeout-s 100)
OFF=(--batch-size 12 --warmup-steps 1 --timed-steps 3 --timeout-s 120)
"$PY" -m fullshard.bench.gpu --out-dir "$OUT_DIR/streams_on" --modes fully_shard,wrapper,fsdp2,ddp "${BIG[@]}"
FULLSHARD_STREAMS=0 "$PY" -m fullshard.bench.gpu --out-dir "$OUT_DIR/streams_off" --modes fully_shard,wrapper "${BIG[@]}"
"$PY" -m fullshard.bench.gpu --out-dir "$OUT_DIR/offload" \
    --modes fully_shard_offload,wrapper_offload,fsdp2_offload,fsdp2_offload_fused "${OFF[@]}"
"$PY" -m fullshard.bench.gpu --out-dir "$OUT_DIR/combined" \
    --from-json "$OUT_DIR/streams_on/gpu.json" "FULLSHARD_STREAMS=0=$OUT_DIR/streams_off/gpu.json"
if [ "$TESTS_RC" -ne 0 ]; then echo "gpu_check: the CUDA tests failed (pytest exit $TESTS_RC); the bench ran anyway" >&2; fi
exit "$TESTS_RC"
