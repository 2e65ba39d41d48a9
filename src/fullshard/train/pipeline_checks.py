"""Checks and parsing of the `fullshard train --pipeline-*` flags (no torch.distributed import, so the
CLI validates them before any rank starts); the pipeline itself is ``pipeline.py``."""
from __future__ import annotations

from fullshard.models.stages import check_split

LOOPED = ("Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble")
"""Schedules with several stages per pipeline rank (``--pipeline-stages-per-rank`` >= 2), placed in a loop:
pipeline rank ``p`` holds stages ``p, p + P, ...``."""
V_SHAPED = ("ZBVZeroBubble", "DualPipeV")
"""Schedules with exactly 2 stages per pipeline rank, placed in a V: pipeline rank ``p`` holds stages ``p``
and ``2P - 1 - p`` (so the first rank holds the first and the last stage)."""
SPLIT_BACKWARD = ("InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV")
"""The zero-bubble schedules: backward split into an input and a weight pass (fullshard.pipelining's
[Note: split backward of fullshard units])."""
HF_MODEL_REASON = (
    "stages are cut from fullshard's GPT (models/stages.py: embeddings, blocks, final norm, tied head), and a "
    "Hugging Face model has no such cut (its embed_tokens, decoder layers, norm and lm_head live in the HF "
    "classes' own forward); train it without --pipeline-parallel-size")
"""Why --hf-model cannot be pipelined: `fullshard.models.stages.cut_gpt` only cuts fullshard's GPT."""


def microbatches(cfg) -> int:
    """``--pipeline-microbatches``, P when not given."""
    return cfg.pipeline_microbatches or cfg.pipeline_parallel_size


def check(cfg, world_size: int, num_layers: int) -> None:
    """Refuse a pipeline configuration that cannot run, with one line saying what to change.

    ``cfg`` is anything with the TrainConfig field names (a TrainConfig or parsed arguments).

    Raises:
        ValueError: P not dividing the world size, a stage count the schedule cannot use or the
            model cannot fill, too few micro-batches for the schedule, a batch the micro-batches do
            not divide, a split that does not add up, or a flag pipelining does not support.
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
    if schedule in V_SHAPED and v != 2:
        raise ValueError(f"--pipeline-schedule {schedule} needs --pipeline-stages-per-rank 2 (V-shaped: rank p holds "
                         f"stages p and 2P-1-p), not {v}")
    looped = schedule in LOOPED or schedule in V_SHAPED
    if looped and cfg.fsdp_version == 1:
        raise ValueError(f"--pipeline-schedule {cfg.pipeline_schedule} with --fsdp-version 1: a rank's several "
                         "stage wrappers have no one module under the plain names for checkpoints; use "
                         "--fsdp-version 2, or GPipe / 1F1B")
    if looped and v < 2:
        raise ValueError(f"--pipeline-schedule {cfg.pipeline_schedule} needs --pipeline-stages-per-rank >= 2")
    if not looped and v != 1:
        raise ValueError(f"--pipeline-schedule {cfg.pipeline_schedule} runs one stage per rank; drop "
                         f"--pipeline-stages-per-rank {v} or use Interleaved1F1B / LoopedBFS / ZBVZeroBubble")
    stages = p * v
    if stages > num_layers:
        raise ValueError(f"{stages} pipeline stages (--pipeline-parallel-size {p} x --pipeline-stages-per-rank "
                         f"{v}) for {num_layers} layers: every stage needs a layer; use fewer stages")
    m = microbatches(cfg)
    if m < 1:
        raise ValueError(f"--pipeline-microbatches {m} must be >= 1")
    if cfg.pipeline_schedule != "GPipe" and m < p:
        raise ValueError(f"--pipeline-microbatches {m} is smaller than --pipeline-parallel-size {p}: "
                         f"{cfg.pipeline_schedule} needs at least one micro-batch per pipeline rank")
    if schedule == "DualPipeV" and m < stages:
        raise ValueError(f"--pipeline-microbatches {m}: DualPipeV needs at least one per stage ({stages})")
    if cfg.pipeline_schedule in LOOPED and m % p:
        raise ValueError(f"--pipeline-microbatches {m}: {cfg.pipeline_schedule} needs a multiple of "
                         f"--pipeline-parallel-size {p}")
    if cfg.batch_size % m:
        raise ValueError(f"--batch-size {cfg.batch_size} is not divisible by --pipeline-microbatches {m}; each "
                         "micro-batch is split into that many pipeline micro-batches")
    if cfg.pipeline_split not in ("even", "auto"):
        check_split(parse_split(cfg.pipeline_split), num_layers, stages)


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
