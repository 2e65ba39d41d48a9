"""``fullshard plan --pipeline-parallel-size P``: the balanced split of a GPT into pipeline stages,
beside the even split, with each stage's layers, predicted and measured time, parameters and
memory per rank, and the schedule's bubble (the measuring and the choice: `pipeline_plan.py`).

    fullshard plan --arch transformer_lm_gpt3_small --world-size 1 --pipeline-parallel-size 2
"""
from __future__ import annotations

import argparse
import dataclasses
import statistics
from typing import Callable, ClassVar, Optional

import torch

from fullshard.train import plan as memory_plan
from fullshard.train.flags import add_options, flag
from fullshard.train.launcher import threads_per_rank
from fullshard.train.options import OneLineArgumentParser
from fullshard.train.pipeline_checks import MULTI_STAGE, SCHEDULES, SPLIT_BACKWARD, check_schedule
from fullshard.train.pipeline_plan import (
    ModelCosts,
    SplitError,
    balanced_split,
    bubble_fraction,
    even_split,
    in_flight,
    intra_op_threads,
    measure_stages,
    profile_for,
    stage_bounds,
    stage_rank,
)


# ---------------------------------------------------------------- the `fullshard plan --pipeline-*` flags
@dataclasses.dataclass(frozen=True, kw_only=True)
class PipelinePlanOptions:
    """Flags of `fullshard plan --pipeline-parallel-size` (with it, the plan is the stage split)."""

    TITLE: ClassVar[str] = "pipeline"
    pipeline_parallel_size: Optional[int] = flag(
        None, "P pipeline ranks: time every layer's forward and backward on this machine and print the split "
        "that minimizes the slowest stage (ZBVZeroBubble, DualPipeV: the slowest rank's two stages) beside the "
        "even split (--batch-size is split into the M micro-batches, as "
        "`fullshard train` does; --world-size: the data-parallel ranks per stage; --budget-gb a per-rank limit "
        "the split must fit)", type=int, metavar="P")
    pipeline_microbatches: Optional[int] = flag(None, "M micro-batches per step (default: P)", type=int,
                                                metavar="M")
    pipeline_stages_per_rank: Optional[int] = flag(None, "V stages per rank of the looped and V-shaped schedules "
                                                   "(default: 2 for Interleaved1F1B, LoopedBFS, "
                                                   "InterleavedZeroBubble, ZBVZeroBubble and DualPipeV, else 1)",
                                                   type=int, metavar="V")
    pipeline_schedule: Optional[str] = flag(None, "torch.distributed.pipelining schedule (default: 1F1B, or "
                                            "Interleaved1F1B with V > 1)", choices=SCHEDULES)
    pipeline_profile_reps: int = flag(5, "timed repetitions per layer and per stage after one warm-up; the "
                                      "least time counts (default: %(default)s)")


def add_args(p: argparse.ArgumentParser) -> None:
    """Register the pipeline flags on `fullshard plan`'s parser (after :func:`plan.add_args`)."""
    add_options(p, PipelinePlanOptions)


def _check(p: OneLineArgumentParser, args, num_layers: int) -> tuple[str, int, int]:
    """The schedule, M and V of the flags; one line and exit 2 on what torch's schedules refuse."""
    P = args.pipeline_parallel_size
    if P < 1:
        p.fail(f"--pipeline-parallel-size must be >= 1, got {P}")
    V = args.pipeline_stages_per_rank
    schedule = args.pipeline_schedule or ("Interleaved1F1B" if V is not None and V > 1 else "1F1B")
    V = V if V is not None else (2 if schedule in MULTI_STAGE else 1)
    M = args.pipeline_microbatches if args.pipeline_microbatches is not None else P
    for name, value in (("microbatches", M), ("stages_per_rank", V), ("profile_reps", args.pipeline_profile_reps)):
        if value < 1:
            p.fail(f"--pipeline-{name.replace('_', '-')} must be >= 1, got {value}")
    try:
        check_schedule(schedule, P, V, M, num_layers)  # `fullshard train`'s rules and messages
    except ValueError as e:
        p.fail(str(e))
    if args.batch_size % M:
        p.fail(f"--batch-size {args.batch_size} is not divisible by --pipeline-microbatches {M}: each batch is split "
               "into that many pipeline micro-batches")
    if args.budget_gb is not None and args.optimizer != "adam":
        p.fail("--budget-gb with --pipeline-parallel-size counts Adam's model state; drop --optimizer or --budget-gb")
    return schedule, M, V


def _stage_bytes(work, costs: ModelCosts, schedule: str, P: int, M: int, dp: int, dtype: torch.dtype,
                 checkpoint: bool) -> Callable[[int, int, int, int], tuple[float, float]]:
    """``f(stage, first_layer, end_layer, num_stages) -> (model-state bytes, activation bytes)`` of a
    stage on one rank: Adam's fp32 state of its parameters (16 bytes each: shard, gradient, two
    moments; 8 for the last stage's copy of the tied embedding, which the optimizer does not step)
    sharded over ``dp`` ranks, and the activations (`plan.py`'s Korthikanti et al. counts) of the
    micro-batches it holds in flight."""
    p = torch.finfo(dtype).bits // 8
    full = memory_plan.layer_activation_bytes(work, p)
    layer_act = memory_plan.checkpointed_layer_bytes(work, p) if checkpoint else full
    recompute = full if checkpoint else 0.0  # one layer rebuilt at a time

    def f(k: int, i: int, j: int, S: int) -> tuple[float, float]:
        numel = sum(it.param_numel for it in costs.layers[i:j])
        numel += (costs.embed.param_numel if k == 0 else 0) + (costs.head.param_numel if k == S - 1 else 0)
        numel -= costs.tied_numel if S == 1 else 0
        per_mb = (j - i) * layer_act + (memory_plan.logits_bytes(work, p) if k == S - 1 else 0)
        flight = in_flight(schedule, stage_rank(k, P, schedule), P, M)
        copy = costs.tied_numel if k == S - 1 and S > 1 else 0  # trainer.py: join_stages(with_tied_copy=False)
        return (16 * numel - 8 * copy) / dp, per_mb * flight + recompute
    return f


def run(p: OneLineArgumentParser, args: argparse.Namespace) -> int:
    """`fullshard plan --pipeline-parallel-size P`: profile, choose the split, print it beside the even one."""
    shape, positions, dtype = memory_plan.check_args(p, args)
    schedule, M, V = _check(p, args, shape.num_layers)
    micro = args.batch_size // M
    P, S, L = args.pipeline_parallel_size, args.pipeline_parallel_size * V, shape.num_layers
    device = "cuda" if torch.cuda.is_available() else "cpu"
    # On a CPU, the threads each rank of a P x N job on this machine would get (`fullshard train`'s default).
    threads = threads_per_rank(P * args.world_size) if device == "cpu" else None
    with intra_op_threads(threads):
        model, costs = profile_for(shape, args.vocab_size, positions, micro, args.tokens_per_sample,
                                   dtype=dtype, checkpoint=args.checkpoint_activations,
                                   reps=args.pipeline_profile_reps, device=device)
    work = memory_plan.gpt_workload(shape, micro, args.tokens_per_sample, args.vocab_size,
                                    max_positions=positions)
    mem = _stage_bytes(work, costs, schedule, P, M, args.world_size, dtype, args.checkpoint_activations)
    budget = None if args.budget_gb is None else args.budget_gb * 1e9
    fits = None if budget is None else (lambda k, i, j: sum(mem(k, i, j, S)) <= budget)
    try:
        auto = balanced_split([it.seconds for it in costs.layers], S, costs.embed.seconds, costs.head.seconds, fits,
                              ranks=[stage_rank(k, P, schedule) for k in range(S)])
    except SplitError as e:
        p.fail(f"{e} of {args.budget_gb:g} GB per rank")
    splits = {"auto": auto, "even": even_split(L, S)}
    with intra_op_threads(threads):
        measured = measure_stages(model, list(splits.values()), micro, args.tokens_per_sample,
                                  checkpoint=args.checkpoint_activations, reps=args.pipeline_profile_reps)
    print(format_pipeline(args, costs, splits, dict(zip(splits, measured)), mem, schedule=schedule, P=P, M=M,
                          V=V, dtype=dtype, device=device, threads=threads))
    per_rank = [0.0] * P
    for k, (a, b) in enumerate(stage_bounds(auto)):
        per_rank[stage_rank(k, P, schedule)] += sum(mem(k, a, b, S))
    if budget is not None and max(per_rank) > budget:
        p.fail(f"the balanced split needs {max(per_rank) / 1e9:.3f} GB on rank {per_rank.index(max(per_rank))}, "
               f"over --budget-gb {args.budget_gb:g}; add ranks or checkpoint activations")
    return 0


def format_pipeline(args, costs: ModelCosts, splits: dict, measured: dict, mem, *, schedule: str, P: int, M: int,
                    V: int, dtype: torch.dtype, device: str, threads: Optional[int]) -> str:
    """The plan's report: the profile, each split's stages (layers, predicted and measured time,
    parameters, memory), the slowest stages compared and the bubble."""
    ms = lambda s: f"{s * 1e3:.2f}"  # noqa: E731
    S = P * V
    name = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}[dtype]
    layer_s = [it.seconds for it in costs.layers]
    where = f"{device}, {threads} intra-op thread(s), as each of {P} x {args.world_size} ranks here" if threads \
        else device
    lines = [f"pipeline: {args.arch}, {len(layer_s)} layers, P={P} ranks x V={V} = {S} stages, {schedule},",
             f"  M={M} micro-batches of {args.batch_size // M} x {args.tokens_per_sample} tokens, {name}, "
             f"{where}",
             f"profile per micro-batch, forward + backward (least of {args.pipeline_profile_reps} after 1 warm-up): "
             f"embed {ms(costs.embed.seconds)} ms,",
             f"  layers {ms(statistics.median(layer_s))} ms (min {ms(min(layer_s))}, max {ms(max(layer_s))}), "
             f"head {ms(costs.head.seconds)} ms = {costs.head.seconds / statistics.median(layer_s):.1f} layers",
             f"{'split':<20}{'stage':>5}{'rank':>5}{'layers':>8}{'predicted ms':>14}{'measured ms':>13}"
             f"{'params':>13}{'GB/rank':>9}"]
    for label, split in splits.items():
        predicted = costs.stage_seconds(split)
        params = costs.stage_params(split)
        for k, (a, b) in enumerate(stage_bounds(split)):
            head = f"{label} {list(split)}" if k == 0 else ""
            lines.append(f"{head:<20}{k:>5}{stage_rank(k, P, schedule):>5}{f'{a}-{b - 1}':>8}"
                         f"{ms(predicted[k]):>14}{ms(measured[label][k]):>13}{params[k]:>13,}"
                         f"{sum(mem(k, a, b, S)) / 1e9:>9.3f}")
    worst = {label: max(t) for label, t in measured.items()}
    for label, w in worst.items():
        lines.append(f"slowest {label} stage, measured: {ms(w)} ms = {w / statistics.mean(measured[label]):.2f} x "
                     "the mean of its stages")
    if V > 1:
        lines += _per_rank(splits, costs, measured, mem, schedule, P)
    if splits["auto"] == splits["even"]:
        lines.append("auto: the even split is the balanced one")
    elif V > 1:  # a rank runs its stages one after another: the slowest rank bounds the step
        rank_s = {label: max(sum(t[k] for k in range(S) if stage_rank(k, P, schedule) == r) for r in range(P))
                  for label, t in measured.items()}
        lines.append(f"auto: {rank_s['even'] / rank_s['auto']:.2f} x the even split's throughput (slowest rank, "
                     "measured)")
    else:
        lines.append(f"auto: {worst['even'] / worst['auto']:.2f} x the even split's throughput (slowest stage, "
                     "measured)")
    bubble = bubble_fraction(schedule, P, M, V)
    formula = "(P-1)/(V*M+P-1)" if schedule == "Interleaved1F1B" else "(P-1)/(M+P-1)"
    if bubble is not None:
        lines.append(f"bubble: {formula} = {bubble:.1%} of a step idle (Narayanan et al. 2021, §2.2)")
    elif schedule in SPLIT_BACKWARD:
        lines += [f"bubble: not modelled for {schedule} (Qi et al. 2024, \"Zero Bubble Pipeline Parallelism\", "
                  "§2-3,", "  derive it from the forward's, input backward's and weight backward's own "
                  "times; the profile does not split them)"]
    else:
        lines.append(f"bubble: not modelled for {schedule}")
    lines.append(f"GB/rank: Adam's fp32 model state (16 bytes per parameter; 8 for the last stage's copy of the "
                 f"tied embedding) / {args.world_size} data-parallel rank(s)")
    if schedule in SPLIT_BACKWARD:
        lines.append(f"  + activations of M micro-batches per stage: an upper bound ({schedule}'s in-flight count is "
                     "not modelled)")
    else:
        lines.append("  + activations of the micro-batches in flight (1F1B: min(M, P - rank); else M)")
    return "\n".join(lines)


def _per_rank(splits: dict, costs: ModelCosts, measured: dict, mem, schedule: str, P: int) -> list[str]:
    """Each split's ranks (V > 1): the stages a rank holds as `fullshard train` places them (the
    V-shaped schedules: p and 2P-1-p), and the sums of their time and memory."""
    ms = lambda s: f"{s * 1e3:.2f}"  # noqa: E731
    lines = [f"{'per rank':<20}{'rank':>5}{'stages':>8}{'predicted ms':>14}{'measured ms':>13}{'GB/rank':>9}"]
    for label, split in splits.items():
        S, predicted, bounds = len(split), costs.stage_seconds(split), stage_bounds(split)
        slowest = 0.0
        for r in range(P):
            ks = [k for k in range(S) if stage_rank(k, P, schedule) == r]
            took = sum(measured[label][k] for k in ks)
            slowest = max(slowest, took)
            lines.append(f"{label if r == 0 else '':<20}{r:>5}{', '.join(map(str, ks)):>8}"
                         f"{ms(sum(predicted[k] for k in ks)):>14}{ms(took):>13}"
                         f"{sum(sum(mem(k, *bounds[k], S)) for k in ks) / 1e9:>9.3f}")
        lines.append(f"slowest {label} rank, measured: {ms(slowest)} ms (the sum of its stages)")
    return lines
