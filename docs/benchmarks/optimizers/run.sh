#!/usr/bin/env bash
# Writes docs/benchmarks/optimizers/results.txt: `make train`'s run (transformer_lm_gpt_tiny, 300
# updates on 2 ranks, the built-in corpus) with --optimizer adam (as `make train`), muon and adafactor
# (at torch's default lr and at a larger one): validation perplexity at updates 100, 200, 300 and wall
# time of each; then the optimizer state per rank that `fullshard bench` measures (quick preset,
# fullshard FULL_SHARD and torch DDP) and that `fullshard plan` predicts. The train logs (<run>.log)
# and bench reports (bench-<optimizer>/) stay beside it.
# Run from the repository root after `make setup` and
# `.venv/bin/fullshard preprocess --builtin-corpus --destdir data-bin/wiki`.
# PYTHON (default .venv/bin/python), DATA (default data-bin/wiki) and RUNS (default
# "adam muon adafactor adafactor-lr0.05"; also lamb) override; each command runs under `timeout`
# (TIMEOUT_S, default 1800).
set -euo pipefail
PYTHON=${PYTHON:-.venv/bin/python}
DATA=${DATA:-data-bin/wiki}
RUNS=${RUNS:-adam muon adafactor adafactor-lr0.05}
TIMEOUT_S=${TIMEOUT_S:-1800}
DIR=docs/benchmarks/optimizers
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
# `make train`'s command, less its optimizer flags (below, per optimizer).
COMMON=(--nproc-per-node 2 --arch transformer_lm_gpt_tiny --ddp-backend fully_sharded
        --tokens-per-sample 128 --batch-size 8 --weight-decay 0.01 --lr-scheduler polynomial_decay
        --warmup-updates 30 --total-num-update 300 --max-update 300 --clip-norm 1.0
        --log-format simple --log-interval 25 --validate-interval-updates 100 --seed 1)
# adam: `make train`. muon: its lr and weight decay, which torch.optim.Muon's match_rms_adamw scaling
# is for (0.2·sqrt(max(m, n)) matches AdamW's update RMS), the same betas for the AdamW group.
# adafactor: torch.optim.Adafactor's default lr 1e-2, the paper's cap on the relative step size
# rho_t = min(lr, 1/sqrt(t)) (the same schedule scaling it); a step moves each element by about
# rho_t·max(1e-3, RMS(tensor)), 2e-4 on this GPT's 0.02-RMS weights at 1e-2, a fifth of AdamW's 1e-3.
# adafactor-lr0.05 raises the cap so that step matches AdamW's (1/sqrt(t) caps it below t = 400).
declare -A FLAGS=(
    [adam]="--optimizer adam --adam-betas (0.9,0.98) --lr 0.001"
    [muon]="--optimizer muon --muon-adjust-lr-fn match_rms_adamw --adam-betas (0.9,0.98) --lr 0.001"
    [adafactor]="--optimizer adafactor --lr 0.01"
    [adafactor-lr0.05]="--optimizer adafactor --lr 0.05"
    [lamb]="--optimizer lamb --lamb-betas (0.9,0.98) --lr 0.001"
)
# TABLE_ONLY=1: rebuild results.txt from the logs and bench files already here.
for run in $([ -n "${TABLE_ONLY:-}" ] || echo "$RUNS"); do
    read -r -a extra <<< "${FLAGS[$run]}"
    opt=${run%%-*}
    before=$(cut -d' ' -f1 /proc/loadavg)
    timeout "$TIMEOUT_S" "$PYTHON" -m fullshard.cli train "$DATA" "${COMMON[@]}" "${extra[@]}" \
        --save-dir "$WORK/$run" > "$WORK/$run.log" 2>&1
    { echo "# 1-minute load average before and after: $before $(cut -d' ' -f1 /proc/loadavg)"
      echo "# flags after the common ones: ${FLAGS[$run]}"
      sed -E 's#'"$WORK"'#SAVE#g' "$WORK/$run.log"; } > "$DIR/$run.log"
    if [ ! -d "$WORK/bench-$opt" ]; then  # once per optimizer
        timeout "$TIMEOUT_S" "$PYTHON" -m fullshard.cli bench --optimizer "$opt" --modes full,ddp \
            --out-dir "$WORK/bench-$opt" > /dev/null
        mkdir -p "$DIR/bench-$opt"
        cp "$WORK/bench-$opt/bench.md" "$WORK/bench-$opt/bench.json" "$DIR/bench-$opt/"
    fi
done
"$PYTHON" - "$DIR" "$RUNS" "${COMMON[*]}" > "$DIR/results.txt" <<'EOF'
import json, os, re, sys

from fullshard.models import ArchSpec
from fullshard.train import plan as PL

here, runs, common = sys.argv[1], sys.argv[2].split(), sys.argv[3]
lines, rows = [], []
for run in runs:
    log = open(os.path.join(here, f"{run}.log")).read()
    opt = run.split("-")[0]
    flags = re.search(r"# flags after the common ones: (.*)", log).group(1)
    lines.append(f"  {run}: {flags}\n      {re.search(r'optimizer ' + opt + r': (.*)', log).group(1)}")
    version = re.search(r"fsdp-version (\d)", log).group(1)
    ppl = {int(n): p for p, n in re.findall(r"valid on 'valid' subset \| loss [\d.]+ \| ppl ([\d.]+) .*num_updates (\d+)",
                                            log)}
    wall = float(re.search(r"done training in ([\d.]+) seconds", log).group(1))
    load = re.search(r"before and after: (\S+) (\S+)", log).groups()
    bench = json.load(open(os.path.join(here, f"bench-{opt}", "bench.json")))
    by_mode = {r["mode"]: r for r in bench["modes"]}
    model = bench["config"]["model"]
    work = PL.gpt_workload(ArchSpec(model["num_layers"], model["embed_dim"], model["num_heads"]),
                           bench["config"]["batch_size"], bench["config"]["seq_len"], model["vocab_size"],
                           max_positions=model["max_positions"])
    planned = PL.plan(work, PL.Config(PL.ShardingStrategy.FULL_SHARD, 2, optimizer=opt))["optimizer"] / 2**20
    rows.append((run, version, [ppl.get(n, "-") for n in (100, 200, 300)], wall, load,
                 by_mode["full"]["optim_bytes"] / 2**20, by_mode["ddp"]["optim_bytes"] / 2**20, planned,
                 by_mode["full"]["loss_match"]))
print("fullshard train DATA " + common + " --save-dir SAVE, then per run:")
print("\n".join(lines))
print()
print(f"{'run':<17} {'fsdp':>4} {'ppl@100':>8} {'ppl@200':>8} {'ppl@300':>8} {'wall s':>7} {'load 1m':>11}   "
      f"{'optimizer state MiB/rank: FULL_SHARD':>36} {'DDP':>6} {'plan':>6} {'losses=DDP':>10}")
for run, version, ppl, wall, load, full, ddp, planned, match in rows:
    print(f"{run:<17} {version:>4} {ppl[0]:>8} {ppl[1]:>8} {ppl[2]:>8} {wall:>7.1f} {load[0]:>5}-{load[1]:<5}   "
          f"{full:>36.2f} {ddp:>6.2f} {planned:>6.2f} {str(match):>10}")
print()
print("fsdp: the --fsdp-version the run used. ppl: validation perplexity (base 2) after that many updates;\n"
      "wall s: `done training in`; load 1m: the machine's 1-minute load average before and after the run\n"
      "(2 cores, shared with other work). Optimizer state MiB/rank: optimizer state tensors on the rank holding\n"
      "the most, measured by `fullshard bench --optimizer <optimizer> --modes full,ddp` (quick preset: this\n"
      "GPT with 128 positions, batch 2 x 128, 2 + 5 steps); plan: `fullshard plan --optimizer <optimizer>`'s\n"
      "count for that GPT (fullshard.train.plan.plan); losses=DDP: the bench's per-step losses of FULL_SHARD\n"
      "equal torch DDP's within 1e-5.")
EOF
cat "$DIR/results.txt"
