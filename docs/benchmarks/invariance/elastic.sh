#!/usr/bin/env bash
# Writes docs/benchmarks/invariance/elastic.txt: an elastic job (two launchers of 2 ranks on
# 127.0.0.1, --nnodes 1:2) loses node 1 (SIGKILL of its launcher and ranks) after update 3 and
# finishes on 2 ranks; its final parameters are compared with straight 4-rank and 2-rank runs.
# Run from the repository root after `make setup` and
# `.venv/bin/fullshard preprocess --builtin-corpus --destdir data-bin/wiki`.
set -euo pipefail
OUT=docs/benchmarks/invariance/elastic.txt
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
PORT=$(.venv/bin/python -c "import socket; s=socket.socket(); s.bind(('127.0.0.1',0)); print(s.getsockname()[1])")
ARGS=(data-bin/wiki --arch transformer_lm_gpt_mini --tokens-per-sample 64 --batch-size 2 --lr 0.001 --seed 3
      --global-batch-size 8 --world-size-invariant --dropout 0.1 --clip-norm 0.5 --max-update 10
      --save-interval-updates 2 --log-format simple --log-interval 1)
ELASTIC=(--nproc-per-node 2 --nnodes 1:2 --max-restarts 2 --rdzv-endpoint "127.0.0.1:$PORT"
         --rdzv-keep-alive 1 --rdzv-last-call 3 --collective-timeout 60)
for node in 0 1; do
    setsid .venv/bin/fullshard train "${ARGS[@]}" "${ELASTIC[@]}" --node-rank $node --save-dir "$WORK/elastic" \
        > "$WORK/node$node.log" 2>&1 &
    echo $! > "$WORK/node$node.pid"
done
until grep -qs "num_updates=3," "$WORK/node0.log"; do sleep 0.2; done
kill -KILL -- -"$(cat "$WORK/node1.pid")"
wait "$(cat "$WORK/node0.pid")"
for n in 4 2; do
    .venv/bin/fullshard train "${ARGS[@]}" --nproc-per-node $n --save-dir "$WORK/straight$n" > "$WORK/straight$n.log" 2>&1
done
{
    echo "\$ fullshard train ... --nnodes 1:2 --node-rank 0   # node 1: the same with --node-rank 1, SIGKILLed after update 3"
    grep -E "training on|train_inner|restart|world size changed|loaded checkpoint|did not arrive|done training" \
        "$WORK/node0.log" | sed -E 's/^[0-9-]+ //; s#'"$WORK"'#SAVE#g; s/ \| INFO \| / | /' | cut -c1-220
    echo
    echo "final parameters (sha256 of the checkpoint's state dict):"
    .venv/bin/python - "$WORK" <<'EOF'
import hashlib, pathlib, sys
from tests.e2e.common import checkpoint_params
work = pathlib.Path(sys.argv[1])
for run in ("elastic", "straight4", "straight2"):
    state, _ = checkpoint_params(pathlib.Path("data-bin/wiki"), work / run / "checkpoint_last")
    digest = hashlib.sha256(b"".join(state[k].numpy().tobytes() for k in sorted(state))).hexdigest()[:16]
    print(f"  {run:10s} {digest}")
EOF
} > "$OUT"
cat "$OUT"
