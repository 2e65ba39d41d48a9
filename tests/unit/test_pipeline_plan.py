"""Balanced pipeline stages: the exact split against brute force, the even split, the bubble, the
planner's split against measured stage times, `auto_split` on a TrainConfig, and the CLI."""
from __future__ import annotations

import contextlib
import dataclasses
import io
import itertools
import random
import statistics
import types

import pytest
import torch

from fullshard.core.torch_private import split_backward_problem
from fullshard.models import ARCHS
from fullshard.train import pipeline_checks, pipeline_plan as PP
from fullshard.train.config import PipelineOptions, TrainConfig
from fullshard.train.flags import flag_of
from fullshard.train.pipeline_plan_cli import PipelinePlanOptions


def _compositions(n: int, k: int):
    """Every split of n layers into k stages of at least one layer."""
    for cuts in itertools.combinations(range(1, n), k - 1):
        yield [b - a for a, b in zip((0, *cuts), (*cuts, n))]


def test_balanced_split_is_the_exact_min_max_partition():
    rng = random.Random(0)
    for _ in range(60):
        L, S = rng.randint(1, 9), rng.randint(1, 5)
        if S > L:
            with pytest.raises(PP.SplitError, match=f"{L} layers into {S} stages"):
                PP.balanced_split([1.0] * L, S)
            continue
        t = [rng.choice((0.5, 1.0, 1.0, 2.0, 3.5)) for _ in range(L)]
        first, last = rng.choice((0.0, 0.3, 4.0)), rng.choice((0.0, 2.0, 7.5))
        limit = rng.choice((None, 2, 4))  # a memory budget: at most this many layers per stage
        fits = None if limit is None else (lambda k, i, j: j - i <= limit)

        def stages(split):
            bounds = PP.stage_bounds(split)
            return [sum(t[a:b]) + (first if k == 0 else 0) + (last if k == S - 1 else 0)
                    for k, (a, b) in enumerate(bounds)]

        allowed = [c for c in _compositions(L, S) if limit is None or max(c) <= limit]
        if not allowed:
            with pytest.raises(PP.SplitError, match="fits the memory budget"):
                PP.balanced_split(t, S, first, last, fits)
            continue
        got = PP.balanced_split(t, S, first, last, fits)
        assert sum(got) == L and len(got) == S and min(got) >= 1 and got in allowed
        best = min(max(stages(c)) for c in allowed)
        assert max(stages(got)) == pytest.approx(best)
        # the tie-break: the least sum of squares among the splits with the least bottleneck
        squares = min(sum(x * x for x in stages(c)) for c in allowed if max(stages(c)) <= best + 1e-12)
        assert sum(x * x for x in stages(got)) == pytest.approx(squares)
    # the head's cost moves layers to the first stage: torchtitan's "last stage fewer layers"
    assert PP.balanced_split([1.0] * 12, 2, first_s=0.0, last_s=4.0) == [8, 4]


def test_balanced_split_minimizes_the_slowest_rank_of_a_v_placement():
    """ZBVZeroBubble / DualPipeV: rank p holds stages p and 2P-1-p, so the split minimizes the slowest
    rank's summed cost (against brute force), ties by the least slowest stage, with and without a
    memory budget (a monotone one, and one that is not: stage 1 must hold an even layer count); one
    stage per rank gives the per-stage split unchanged."""
    rng = random.Random(1)
    for trial in range(150):
        P = rng.randint(1, 3)
        S = 2 * P
        L = rng.randint(S, 9)
        t = [rng.choice((0.5, 1.0, 1.0, 2.0, 3.5)) for _ in range(L)]
        first, last = rng.choice((0.0, 0.3, 4.0)), rng.choice((0.0, 2.0, 7.5))
        fits = [None, lambda k, i, j: j - i <= 3, lambda k, i, j: k != 1 or (j - i) % 2 == 0][trial % 3]
        ranks = [PP.stage_rank(k, P, "ZBVZeroBubble") for k in range(S)]

        def slowest(split):  # (slowest rank, slowest stage)
            stages = [sum(t[a:b]) + (first if k == 0 else 0) + (last if k == S - 1 else 0)
                      for k, (a, b) in enumerate(PP.stage_bounds(split))]
            return max(sum(x for k, x in enumerate(stages) if ranks[k] == r) for r in range(P)), max(stages)

        allowed = [c for c in _compositions(L, S)
                   if fits is None or all(fits(k, a, b) for k, (a, b) in enumerate(PP.stage_bounds(c)))]
        if not allowed:
            with pytest.raises(PP.SplitError, match="fits the memory budget"):
                PP.balanced_split(t, S, first, last, fits, ranks=ranks)
            continue
        got = PP.balanced_split(t, S, first, last, fits, ranks=ranks)
        assert got in allowed
        best = min(slowest(c)[0] for c in allowed)
        assert slowest(got)[0] == pytest.approx(best)
        assert slowest(got)[1] == pytest.approx(min(slowest(c)[1] for c in allowed if slowest(c)[0] <= best + 1e-9))
    # the head's cost: rank 0 holds it and the embedding, so its stages hold fewer layers than per-stage balancing
    # gives them ([2, 2, 3, 1]: rank 0 at 2 + 1 + 4 = 7 layers' time, rank 1 at 5), and the ranks are even (6, 6)
    ranks = [0, 1, 1, 0]
    assert PP.balanced_split([1.0] * 8, 4, 0.0, 4.0) == [2, 2, 3, 1]
    assert PP.balanced_split([1.0] * 8, 4, 0.0, 4.0, ranks=ranks) == [1, 3, 3, 1]
    # one stage per rank, and the looped placement (documented: per stage), give the per-stage split
    t = [1.0, 2.0, 0.5, 3.0, 1.0, 1.0, 2.5, 0.5]
    for ranks in ([0, 1, 2, 3], [0, 1, 0, 1]):
        assert PP.balanced_split(t, 4, 0.3, 6.0, ranks=ranks) == PP.balanced_split(t, 4, 0.3, 6.0)
    with pytest.raises(ValueError, match="ranks gives 3 stages' ranks for 4 stages"):
        PP.balanced_split(t, 4, ranks=[0, 1, 0])


def test_even_split_and_bubble():
    assert PP.even_split(12, 4) == [3, 3, 3, 3]
    assert PP.even_split(10, 4) == [2, 3, 3, 2]  # the remainder to the middle stages
    assert PP.even_split(7, 2) == [4, 3] and PP.even_split(5, 5) == [1] * 5
    with pytest.raises(PP.SplitError):
        PP.even_split(3, 4)
    # Narayanan et al. 2021, §2.2: (P-1)/M of the ideal time, (P-1)/(M+P-1) of the step; / V interleaved
    assert PP.bubble_fraction("1F1B", 4, 8) == PP.bubble_fraction("GPipe", 4, 8) == pytest.approx(3 / 11)
    assert PP.bubble_fraction("Interleaved1F1B", 4, 8, 2) == pytest.approx(3 / 19)
    assert PP.bubble_fraction("1F1B", 1, 5) == 0 and PP.bubble_fraction("LoopedBFS", 2, 4, 2) is None
    assert [PP.stage_rank(k, 2) for k in range(4)] == [0, 1, 0, 1]
    assert [PP.in_flight("1F1B", r, 4, 8) for r in range(4)] == [4, 3, 2, 1]
    assert PP.in_flight("GPipe", 3, 4, 8) == 8
    # the zero-bubble schedules: no bubble figure (not modelled), the upper bound M in flight
    for schedule in ("InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV"):
        assert PP.bubble_fraction(schedule, 2, 4, 2) is None and PP.in_flight(schedule, 1, 2, 4) == 4


def test_stage_rank_places_stages_as_the_trainer_does():
    """V-shaped schedules: rank p holds stages p and 2P-1-p (the first and last on rank 0); the
    looped ones stage k on rank k mod P; the planner's rank of a stage inverts the trainer's `stage_ids`."""
    assert [PP.stage_rank(k, 3, "ZBVZeroBubble") for k in range(6)] == [0, 1, 2, 2, 1, 0]
    assert [PP.stage_rank(k, 2, "DualPipeV") for k in range(4)] == [0, 1, 1, 0]
    assert [PP.stage_rank(k, 2, "InterleavedZeroBubble") for k in range(6)] == [0, 1, 0, 1, 0, 1]
    for schedule in pipeline_checks.SCHEDULES:
        for P in (1, 2, 3, 4):
            V = 2 if schedule in pipeline_checks.LOOPED + pipeline_checks.V_SHAPED else 1
            held = [pipeline_checks.stage_ids(schedule, P, V, r) for r in range(P)]
            assert sorted(k for ks in held for k in ks) == list(range(P * V))
            assert all(PP.stage_rank(k, P, schedule) == r for r, ks in enumerate(held) for k in ks)
    # one list of names: the planner's --pipeline-schedule choices are the trainer's
    choices = [flag_of(f).choices for cls in (PipelinePlanOptions, PipelineOptions)
               for f in dataclasses.fields(cls) if f.name == "pipeline_schedule"]
    assert choices == [pipeline_checks.SCHEDULES] * 2


def test_zero_bubble_schedules_are_refused_before_torch_2_13(monkeypatch):
    """torch 2.11's stage_backward_weight gave fullshard units wrong weight gradients (gradient norm
    3.29 where one process has 2.87): the zero-bubble schedules are refused there, the others run."""
    assert split_backward_problem("2.13.0+cpu") == split_backward_problem("2.13.0a0+git1") == ""
    assert "needs torch 2.13 or newer" in split_backward_problem("2.11.0+cu130")
    monkeypatch.setattr(torch, "__version__", "2.12.0")
    for schedule in pipeline_checks.SCHEDULES:
        cfg = TrainConfig(data_dir="unused", max_positions=64, vocab_size=100, pipeline_parallel_size=2,
                          pipeline_schedule=schedule,
                          pipeline_stages_per_rank=2 if schedule in pipeline_checks.MULTI_STAGE else 1,
                          pipeline_microbatches=4, batch_size=4)
        if schedule in pipeline_checks.SPLIT_BACKWARD:
            with pytest.raises(ValueError, match=f"--pipeline-schedule {schedule}: torch 2.12.0's split backward"):
                pipeline_checks.check(cfg, 4, 8)
        else:
            pipeline_checks.check(cfg, 4, 8)


@pytest.mark.heavy
def test_planned_split_is_balanced_in_measured_stage_times():
    """The planner on a GPT whose head costs several layers (width 128, vocabulary 8192, 16 layers,
    P = 2): each stage of its split, timed whole as a pipeline runs it, is within 15% of the mean,
    and its slowest stage is faster than the even split's (whose last stage is about 1.2 x the mean).

    Robustness: timings are the least of 9 repetitions (other processes only add time), stages of
    both splits interleaved in a rotating order, one intra-op thread. On the shared 2-core machine
    (load average 4 to 10) a single attempt failed 2 of 12 times, both in the first seconds of a
    process; so a failure is measured again, up to 3 attempts in all (profile, plan and timing
    afresh): a wrong split fails every attempt, noise rarely thrice. Of 23 runs of this test (load
    average 5 to 10), 1 took a second attempt and none failed; 2-3.5 s per attempt."""
    spec = ARCHS["transformer_lm_gpt_tiny"].override(num_layers=16)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        report = []
        for _ in range(3):
            model, costs = PP.profile_for(spec, 8192, 64, 1, 64, warmup=2, reps=7, device="cpu")
            auto = PP.balanced_split([c.seconds for c in costs.layers], 2, costs.embed.seconds, costs.head.seconds)
            even = PP.even_split(16, 2)
            auto_s, even_s = PP.measure_stages(model, [auto, even], 1, 64, warmup=2, reps=9)
            report.append(f"auto {auto} {[round(x * 1e3, 1) for x in auto_s]} ms, even {even} "
                          f"{[round(x * 1e3, 1) for x in even_s]} ms")
            if max(auto_s) <= 1.15 * statistics.mean(auto_s) and max(auto_s) <= max(even_s):
                break
        else:
            pytest.fail("the planned split was unbalanced in 3 attempts: " + "; ".join(report))
    finally:
        torch.set_num_threads(threads)
    assert auto != even and auto[0] > auto[1]  # the head's stage holds fewer layers


@pytest.mark.heavy
def test_auto_split_of_a_train_config():
    cfg = TrainConfig(data_dir="unused", arch="transformer_lm_gpt_mini", decoder_layers=4, vocab_size=97,
                      max_positions=512, tokens_per_sample=16, batch_size=4, bf16=True)
    split = PP.auto_split(cfg, 3)
    assert len(split) == 3 and sum(split) == 4 and min(split) >= 1
    assert PP.auto_split(cfg, 4) == [1, 1, 1, 1]
    with pytest.raises(PP.SplitError, match="4 layers into 5 stages"):
        PP.auto_split(cfg, 5)


def _plan(*args: str):
    from fullshard.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(["plan", "--arch", "transformer_lm_gpt_mini", "--vocab-size", "97", "--tokens-per-sample",
                         "16", "--batch-size", "2", "--world-size", "2", "--decoder-layers", "4", *args])
        except SystemExit as exit_:
            code = exit_.code
    return types.SimpleNamespace(returncode=code, stdout=out.getvalue(), stderr=err.getvalue())


def test_cli_prints_both_splits_and_rejects_bad_input():
    ok = _plan("--pipeline-parallel-size", "2", "--pipeline-microbatches", "4", "--batch-size", "4",
               "--pipeline-profile-reps", "1")
    assert ok.returncode == 0, ok.stderr
    assert "P=2 ranks x V=1 = 2 stages, 1F1B,\n  M=4 micro-batches of 1 x 16" in ok.stdout and "auto [" in ok.stdout
    assert "even [2, 2]" in ok.stdout and "(P-1)/(M+P-1) = 20.0%" in ok.stdout
    looped = _plan("--pipeline-parallel-size", "2", "--pipeline-schedule", "Interleaved1F1B",
                   "--pipeline-profile-reps", "1")
    assert looped.returncode == 0 and "V=2 = 4 stages" in looped.stdout and "even [1, 1, 1, 1]" in looped.stdout
    assert "(P-1)/(V*M+P-1) = 20.0%" in looped.stdout
    for args, message in [
        (("--pipeline-parallel-size", "0"), "--pipeline-parallel-size must be >= 1, got 0"),
        (("--pipeline-parallel-size", "5"), "5 pipeline stages (--pipeline-parallel-size 5 x "
         "--pipeline-stages-per-rank 1) for 4 layers"),
        (("--pipeline-parallel-size", "2", "--pipeline-stages-per-rank", "3"), "6 pipeline stages"),
        (("--pipeline-parallel-size", "2", "--pipeline-microbatches", "1"),
         "1F1B needs at least one micro-batch per pipeline rank"),
        (("--pipeline-parallel-size", "2", "--pipeline-schedule", "1F1B", "--pipeline-stages-per-rank", "2"),
         "1F1B runs one stage per rank"),
        (("--pipeline-parallel-size", "2", "--pipeline-schedule", "GPipe", "--pipeline-stages-per-rank", "2"),
         "GPipe runs one stage per rank"),
        (("--pipeline-parallel-size", "2", "--pipeline-schedule", "LoopedBFS", "--pipeline-stages-per-rank", "1"),
         "LoopedBFS needs --pipeline-stages-per-rank >= 2"),
        (("--pipeline-parallel-size", "2", "--pipeline-microbatches", "4"), "--batch-size 2 is not divisible by"),
        (("--pipeline-parallel-size", "2", "--pipeline-schedule", "Interleaved1F1B", "--pipeline-microbatches", "3",
          "--batch-size", "3"), "Interleaved1F1B needs a multiple of --pipeline-parallel-size 2"),
        (("--pipeline-parallel-size", "2", "--pipeline-microbatches", "0"), "--pipeline-microbatches must be >= 1"),
        (("--pipeline-parallel-size", "2", "--budget-gb", "1e-9"), "no split of 4 layers into 2 stages fits"),
        # the zero-bubble schedules, with `fullshard train`'s messages
        (("--pipeline-parallel-size", "2", "--pipeline-schedule", "ZBVZeroBubble", "--pipeline-stages-per-rank", "3"),
         "--pipeline-schedule ZBVZeroBubble needs --pipeline-stages-per-rank 2 (V-shaped"),
        (("--pipeline-parallel-size", "2", "--pipeline-schedule", "DualPipeV", "--pipeline-stages-per-rank", "1"),
         "DualPipeV needs --pipeline-stages-per-rank 2"),
        (("--pipeline-parallel-size", "2", "--pipeline-schedule", "DualPipeV", "--pipeline-microbatches", "2"),
         "--pipeline-microbatches 2: DualPipeV needs at least one per stage (4)"),
        (("--pipeline-parallel-size", "2", "--pipeline-schedule", "InterleavedZeroBubble",
          "--pipeline-stages-per-rank", "1"), "InterleavedZeroBubble needs --pipeline-stages-per-rank >= 2"),
        (("--pipeline-parallel-size", "2", "--pipeline-schedule", "InterleavedZeroBubble", "--pipeline-microbatches",
          "3", "--batch-size", "3"), "InterleavedZeroBubble needs a multiple of --pipeline-parallel-size 2"),
        (("--pipeline-parallel-size", "3", "--pipeline-schedule", "ZBVZeroBubble"), "6 pipeline stages"),
    ]:
        bad = _plan(*args)
        assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and message in bad.stderr, (args, bad.stderr)


def test_cli_zero_bubble_schedules():
    """ZBVZeroBubble: V = 2 by default, rank 0 holds stages 0 and 3 (the first and the last) and its
    time and memory are theirs summed; no bubble figure; the activations' bound stated."""
    zbv = _plan("--pipeline-parallel-size", "2", "--pipeline-schedule", "ZBVZeroBubble", "--pipeline-microbatches",
                "4", "--batch-size", "4", "--pipeline-profile-reps", "1")
    assert zbv.returncode == 0, zbv.stderr
    assert "P=2 ranks x V=2 = 4 stages, ZBVZeroBubble," in zbv.stdout
    rows = zbv.stdout.splitlines()
    stage_rows = [r.split() for r in rows[rows.index(next(r for r in rows if r.startswith("auto ["))):][:4]]
    assert [int(r[-6]) for r in stage_rows] == [0, 1, 1, 0]  # stage -> rank: 0, 1, 1, 0
    per_rank = rows.index(next(r for r in rows if r.startswith("per rank")))
    rank0, rank1 = rows[per_rank + 1].split(), rows[per_rank + 2].split()
    assert rank0[:4] == ["auto", "0", "0,", "3"] and rank1[:3] == ["1", "1,", "2"]
    # the rank's memory is the sum of its stages' (GB with 3 decimals: compare within rounding)
    stage_gb = [float(r[-1]) for r in stage_rows]
    assert abs(float(rank0[-1]) - stage_gb[0] - stage_gb[3]) <= 1.5e-3
    assert "bubble: not modelled for ZBVZeroBubble (Qi et al. 2024" in zbv.stdout
    assert "activations of M micro-batches per stage: an upper bound" in zbv.stdout
    dual = _plan("--pipeline-parallel-size", "2", "--pipeline-schedule", "DualPipeV", "--pipeline-microbatches",
                 "4", "--batch-size", "4", "--pipeline-profile-reps", "1")
    assert dual.returncode == 0 and "V=2 = 4 stages, DualPipeV" in dual.stdout, dual.stderr
    izb = _plan("--pipeline-parallel-size", "2", "--pipeline-schedule", "InterleavedZeroBubble",
                "--pipeline-profile-reps", "1")
    assert izb.returncode == 0 and "not modelled for InterleavedZeroBubble" in izb.stdout, izb.stderr
    rows = izb.stdout.splitlines()
    per_rank = rows.index(next(r for r in rows if r.startswith("per rank")))
    assert rows[per_rank + 1].split()[:4] == ["auto", "0", "0,", "2"]  # looped: rank 0 holds stages 0 and 2


def test_last_stage_counts_no_adam_state_for_its_tied_copy():
    """The last stage's copy of the tied embedding has a parameter and a gradient but no Adam moments (the
    trainer's optimizer skips it): 8 bytes per element, not 16 (the plan overstated stage 1 by 8·V·C)."""
    from fullshard.train import plan as memory_plan
    from fullshard.train.pipeline_plan_cli import _stage_bytes

    tied = 97 * 64
    costs = PP.ModelCosts(PP.ItemCost("embed", 1.0, 1.0, tied + 16 * 64),
                          tuple(PP.ItemCost(f"layer {i}", 1.0, 1.0, 1000) for i in range(4)),
                          PP.ItemCost("head", 1.0, 1.0, tied + 128), tied_numel=tied)
    work = memory_plan.gpt_workload("transformer_lm_gpt_mini", 1, 16, 97)
    mem = _stage_bytes(work, costs, "1F1B", 2, 2, 1, torch.float32, False)
    assert mem(0, 0, 2, 2)[0] == 16 * (tied + 16 * 64 + 2000)
    assert mem(1, 2, 4, 2)[0] == 16 * (2000 + tied + 128) - 8 * tied
    assert mem(0, 0, 4, 1)[0] == 16 * (tied + 16 * 64 + 4000 + 128)  # one stage: the weight once, stepped
