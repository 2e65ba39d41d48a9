"""The pipeline schedules' names and stage placement, and the checks and parsing of the `fullshard train
--pipeline-*` flags (the CLI validates them before any rank starts); the one
source of both for the trainer (``pipeline.py``, ``config.py``) and the planner (``pipeline_plan*.py``)."""
from __future__ import annotations

from fullshard.core.torch_private import split_backward_problem
from fullshard.models.stages import check_split

SCHEDULES = ("GPipe", "1F1B", "Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV")
"""``--pipeline-schedule`` choices: torch.distributed.pipelining's synchronous ``Schedule<name>``."""
LOOPED = ("Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble")
"""Schedules with several stages per pipeline rank (``--pipeline-stages-per-rank`` >= 2), placed in a loop:
pipeline rank ``p`` holds stages ``p, p + P, ...``."""
V_SHAPED = ("ZBVZeroBubble", "DualPipeV")
"""Schedules with exactly 2 stages per pipeline rank, placed in a V: pipeline rank ``p`` holds stages ``p``
and ``2P - 1 - p`` (so the first rank holds the first and the last stage)."""
MULTI_STAGE = LOOPED + V_SHAPED
"""Schedules that take a list of stages (several per pipeline rank)."""
SPLIT_BACKWARD = ("InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV")
"""The zero-bubble schedules: backward split into an input and a weight pass (fullshard.pipelining's
[Note: split backward of fullshard units])."""
HF_MODEL_REASON = (
    "stages are cut from fullshard's GPT (models/stages.py: embeddings, blocks, final norm, tied head), and a "
    "Hugging Face model has no such cut (its embed_tokens, decoder layers, norm and lm_head live in the HF "
    "classes' own forward); train it without --pipeline-parallel-size")
"""Why --hf-model cannot be pipelined: `fullshard.models.stages.cut_gpt` only cuts fullshard's GPT."""


def stage_ids(schedule: str, p: int, v: int, pp_rank: int) -> list[int]:
    """The stages pipeline rank ``pp_rank`` of ``p`` holds: ``pp_rank, pp_rank + p, ...`` (``v`` of them, torch's
    loop placement), or ``pp_rank, 2p - 1 - pp_rank`` for the V-shaped schedules (ZBVZeroBubble, DualPipeV)."""
    if schedule in V_SHAPED:
        return [pp_rank, 2 * p - 1 - pp_rank]
    return [pp_rank + p * i for i in range(v)]


def stage_rank(schedule: str, p: int, stage: int) -> int:
    """The pipeline rank of ``p`` that holds ``stage`` (the inverse of :func:`stage_ids`)."""
    if schedule in V_SHAPED and stage >= p:
        return 2 * p - 1 - stage
    return stage % p


def microbatches(cfg) -> int:
    """``--pipeline-microbatches``, P when not given."""
    return cfg.pipeline_microbatches or cfg.pipeline_parallel_size


def check(cfg, world_size: int, num_layers: int) -> None:
    """Refuse a pipeline configuration that cannot run, with one line saying what to change.

    ``cfg`` is anything with the TrainConfig field names (a TrainConfig or parsed arguments).

    Raises:
        ValueError: P not dividing the world size, a stage count the schedule cannot use or the
            model cannot fill, too few micro-batches for the schedule, a batch the micro-batches do
            not divide, a split that does not add up, a flag pipelining does not support, or a
            zero-bubble schedule on torch before 2.13 (``core.torch_private.split_backward_problem``).
    """
    p, v = cfg.pipeline_parallel_size, cfg.pipeline_stages_per_rank
    if p < 1 or v < 1:
        raise ValueError(f"--pipeline-parallel-size {p} and --pipeline-stages-per-rank {v} must be >= 1")
    if p == 1:
        return
    if world_size % p:
        raise ValueError(f"--pipeline-parallel-size {p} does not divide the world size {world_size}; launch a "
                         f"multiple of {p} ranks")
    unsupported = [(cfg.ddp_backend != "fully_sharded",
                    "--ddp-backend c10d (each stage is sharded with fullshard units; use --ddp-backend fully_sharded)"),
                   (cfg.hybrid_shard and cfg.fsdp_version == 1,
                    "--hybrid-shard with --fsdp-version 1 (the wrapper's HYBRID_SHARD groups tile the world; use "
                    "--fsdp-version 2)"),
                   (cfg.hybrid_shard and cfg.world_size_invariant,
                    "--hybrid-shard with --world-size-invariant (the replicas' fold runs over the world; drop one)"),
                   (bool(cfg.hf_model), f"--hf-model: {HF_MODEL_REASON}")]
    for bad, what in unsupported:
        if bad:
            raise ValueError(f"--pipeline-parallel-size {p} does not support {what}")
    schedule = cfg.pipeline_schedule
    if schedule in SPLIT_BACKWARD and cfg.world_size_invariant:
        raise ValueError(f"--pipeline-schedule {schedule} with --world-size-invariant: the invariant fold counts one "
                         "micro-batch per backward and a split backward runs two; use GPipe, 1F1B or Interleaved1F1B")
    if schedule == "LoopedBFS" and cfg.world_size_invariant:
        raise ValueError("--pipeline-schedule LoopedBFS with --world-size-invariant: it runs a stage's backwards in "
                         "descending micro-batch order and the invariant fold needs them ascending; use GPipe, 1F1B "
                         "or Interleaved1F1B")
    m = microbatches(cfg)
    check_schedule(schedule, p, v, m, num_layers, fsdp_version=cfg.fsdp_version)
    if cfg.batch_size % m:
        raise ValueError(f"--batch-size {cfg.batch_size} is not divisible by --pipeline-microbatches {m}; each "
                         "micro-batch is split into that many pipeline micro-batches")
    if cfg.pipeline_split not in ("even", "auto"):
        check_split(parse_split(cfg.pipeline_split), num_layers, p * v)
    if schedule in SPLIT_BACKWARD:  # last: a flag the user can fix is named first
        problem = split_backward_problem()
        if problem:
            raise ValueError(f"--pipeline-schedule {schedule}: {problem}")


def check_schedule(schedule: str, p: int, v: int, m: int, num_layers: int, *, fsdp_version: int = 2) -> None:
    """The rules of ``schedule`` on ``p`` pipeline ranks x ``v`` stages per rank, ``m`` micro-batches and a model
    of ``num_layers`` layers (`fullshard train`'s and `fullshard plan`'s, one message each).

    Raises:
        ValueError: V not 2 for a V-shaped schedule, under 2 for a looped one or over 1 for the others, more
            stages than layers, M under 1, under P (but GPipe) or, for DualPipeV, under the stages, M not a multiple
            of P for a looped schedule, or a looped / V-shaped schedule with --fsdp-version 1.
    """
    if schedule in V_SHAPED and v != 2:
        raise ValueError(f"--pipeline-schedule {schedule} needs --pipeline-stages-per-rank 2 (V-shaped: rank p holds "
                         f"stages p and 2P-1-p), not {v}")
    looped = schedule in MULTI_STAGE
    if looped and fsdp_version == 1:
        raise ValueError(f"--pipeline-schedule {schedule} with --fsdp-version 1: a rank's several "
                         "stage wrappers have no one module under the plain names for checkpoints; use "
                         "--fsdp-version 2, or GPipe / 1F1B")
    if looped and v < 2:
        raise ValueError(f"--pipeline-schedule {schedule} needs --pipeline-stages-per-rank >= 2")
    if not looped and v != 1:
        raise ValueError(f"--pipeline-schedule {schedule} runs one stage per rank; drop "
                         f"--pipeline-stages-per-rank {v} or use Interleaved1F1B / LoopedBFS / ZBVZeroBubble")
    stages = p * v
    if stages > num_layers:
        raise ValueError(f"{stages} pipeline stages (--pipeline-parallel-size {p} x --pipeline-stages-per-rank "
                         f"{v}) for {num_layers} layers: every stage needs a layer; use fewer stages")
    if m < 1:
        raise ValueError(f"--pipeline-microbatches {m} must be >= 1")
    if schedule != "GPipe" and m < p:
        raise ValueError(f"--pipeline-microbatches {m} is smaller than --pipeline-parallel-size {p}: "
                         f"{schedule} needs at least one micro-batch per pipeline rank")
    if schedule == "DualPipeV" and m < stages:
        raise ValueError(f"--pipeline-microbatches {m}: DualPipeV needs at least one per stage ({stages})")
    if schedule in LOOPED and m % p:
        raise ValueError(f"--pipeline-microbatches {m}: {schedule} needs a multiple of "
                         f"--pipeline-parallel-size {p}")


def parse_split(text: str) -> list[int]:
    """``N,N,...`` as a list of ints.

    Raises:
        ValueError: not comma-separated integers.
    """
    try:
        return [int(part) for part in text.split(",")]
    except ValueError:
        raise ValueError(f"--pipeline-split {text!r}: give even, auto or comma-separated layer counts like 2,2") \
            from None
