"""What `fullshard bench` runs: the modes, the model and job it trains, and the
analytic communication volume each mode is checked against.

Pure Python (no ``torch.distributed``), shared by the launcher, the ranks and
the report.

[Note: communication volume]
"Volume" is the unsharded logical size a collective moves, in bytes per rank
per step, the accounting of Rajbhandari et al., "ZeRO: Memory Optimizations
Toward Training Trillion Parameter Models", SC 2020, §7 (Communication
Analysis of ZeRO-DP):

* all-gather: the bytes of its output (the full tensor);
* reduce-scatter: the bytes of its input (the full tensor);
* all-reduce: 2 x the tensor's bytes (a reduce-scatter phase then an
  all-gather phase, as a ring all-reduce does).

With Ψ parameters the analytic volume of one training step is then

* DDP and fullshard NO_SHARD: one all-reduce of the gradients, 2Ψ elements
  (ZeRO §7.1);
* SHARD_GRAD_OP: all-gather the parameters once for forward and backward
  (Ψ) and reduce-scatter the gradients (Ψ): 2Ψ (ZeRO-2's P_os+g, §7.2.1);
* FULL_SHARD (ZeRO-3, P_os+g+p): all-gather for forward (Ψ), again for
  backward (Ψ), reduce-scatter (Ψ): 3Ψ, 1.5x DDP (§7.2.2);

each element counted with its dtype's bytes: under bf16 mixed precision the
all-gathers move bf16 (2 B) and the reduce-scatter fp32 (4 B). fullshard,
torch FSDP1 and torch FSDP2 do not reshard the root unit after forward (its
parameters are used first in backward), so they all-gather the root once and
measure below 3Ψ; :func:`fullshard.bench.report.expected_volume_bytes` counts
that.

Under ``world_size_invariant=True`` (core/invariant.py [Note: world-size
invariance]) each backward sends its unsharded gradient, unreduced, with one
all-to-all of the reduce-scatter's input (Ψ fp32 elements; the volume of an
all-to-all is its input bytes, like a reduce-scatter's) and the receiver folds
the pieces in rank order: the ``all_to_all`` column replaces the
``reduce_scatter`` one, same bytes. (Clipping's exact norm adds two tiny
all-reduces per group, 2 float64 + 3 int64; the bench does not clip.)

With ``K`` micro-batches per step (``--update-freq K``, the first ``K - 1``
under ``no_sync``) every micro-batch all-gathers again (FULL_SHARD and
SHARD_GRAD_OP reshard after each backward, torch FSDP1/FSDP2 FULL_SHARD
too): K times the all-gather volume. The default path reduces once per step
(reduce-scatter Ψ, DDP and NO_SHARD all-reduce 2Ψ), the invariant path
all-to-alls every micro-batch (KΨ): its stash keeps each micro-batch apart,
because the fold order interleaves the ranks' micro-batches. Both add a few
bytes of all-reduce per step that agree on the stashes (not in the formula).
"""
from __future__ import annotations

import dataclasses
from typing import Optional

from fullshard.models import GPTConfig

COLLECTIVES = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all")
"""Collective types reported, in column order."""


@dataclasses.dataclass(frozen=True)
class Mode:
    """One row of the benchmark.

    Attributes:
        key: the ``--modes`` name.
        label: the row name.
        family: ``fullshard``, ``ddp``, ``fsdp2``, ``fsdp1`` or ``deepspeed``.
        strategy: fullshard's ``ShardingStrategy`` name (fullshard modes only).
        bf16: ``param_dtype=bfloat16, reduce_dtype=float32`` mixed precision.
        fully_shard: a fullshard mode through ``fullshard.fully_shard`` (each block, then the root;
            DTensor parameters) instead of the ``FullyShardedDataParallel`` wrapper.
        invariant: ``world_size_invariant=True`` (gradients summed over ranks in global
            micro-batch order by an all-to-all and ordered adds; core/invariant.py).
        pipeline: a pp=2 x dp=N/2 pipeline (``fully_shard`` stages, :mod:`fullshard.bench.pipeline`)
            with this gradient accumulation (``reduce_scatter`` or ``unsharded``); None: data-parallel.
    """

    key: str
    label: str
    family: str
    strategy: Optional[str] = None
    bf16: bool = False
    fully_shard: bool = False
    invariant: bool = False
    pipeline: Optional[str] = None

    @property
    def ours(self) -> bool:
        """A fullshard mode: its failure makes the command fail."""
        return self.family == "fullshard"

    @property
    def baseline(self) -> bool:
        """A mode that runs another library (torch FSDP, DeepSpeed): imported inside the bench only."""
        return self.family in ("fsdp1", "fsdp2", "deepspeed")


MODES: dict[str, Mode] = {m.key: m for m in (
    Mode("full", "fullshard FULL_SHARD", "fullshard", "FULL_SHARD"),
    Mode("grad_op", "fullshard SHARD_GRAD_OP", "fullshard", "SHARD_GRAD_OP"),
    Mode("no_shard", "fullshard NO_SHARD", "fullshard", "NO_SHARD"),
    Mode("full_bf16", "fullshard FULL_SHARD bf16", "fullshard", "FULL_SHARD", bf16=True),
    Mode("fully_shard", "fullshard fully_shard", "fullshard", "FULL_SHARD", fully_shard=True),
    Mode("fully_shard_bf16", "fullshard fully_shard bf16", "fullshard", "FULL_SHARD", bf16=True, fully_shard=True),
    Mode("full_invariant", "fullshard FULL_SHARD invariant", "fullshard", "FULL_SHARD", invariant=True),
    Mode("full_bf16_invariant", "fullshard FULL_SHARD bf16 invariant", "fullshard", "FULL_SHARD", bf16=True,
         invariant=True),
    Mode("fully_shard_invariant", "fullshard fully_shard invariant", "fullshard", "FULL_SHARD", fully_shard=True,
         invariant=True),
    Mode("pp2", "fullshard fully_shard pp=2 1F1B", "fullshard", "FULL_SHARD", fully_shard=True,
         pipeline="reduce_scatter"),
    Mode("pp2_unsharded", "fullshard fully_shard pp=2 1F1B unsharded", "fullshard", "FULL_SHARD", fully_shard=True,
         pipeline="unsharded"),
    Mode("ddp", "torch DDP", "ddp"),
    Mode("fsdp2", "torch FSDP2", "fsdp2"),
    Mode("fsdp2_bf16", "torch FSDP2 bf16", "fsdp2", bf16=True),
    Mode("fsdp1", "torch FSDP1 FULL_SHARD", "fsdp1"),
    Mode("deepspeed", "DeepSpeed ZeRO-3", "deepspeed"),
)}
"""Every mode, in the order they run (the pipeline modes only when named in ``--modes``)."""

REFERENCE = "ddp"
"""Ratios of step time and peak RSS are to this mode."""
VS_FSDP2 = (("full", "fsdp2"), ("full_bf16", "fsdp2_bf16"), ("fully_shard", "fsdp2"),
            ("fully_shard_bf16", "fsdp2_bf16"))
"""(fullshard mode, torch FSDP2 mode) pairs whose ratios get their own rows."""
VS_WRAPPER = (("fully_shard", "full"), ("fully_shard_bf16", "full_bf16"))
"""(fullshard ``fully_shard`` mode, the same configuration through the FullyShardedDataParallel
wrapper) pairs whose ratios get their own rows: the two front doors over one engine."""
VS_DEFAULT = (("full_invariant", "full"), ("full_bf16_invariant", "full_bf16"),
              ("fully_shard_invariant", "fully_shard"))
"""(``world_size_invariant=True`` mode, the same configuration without it) pairs whose ratios
get their own rows: the cost of world-size invariance."""
VS_DATA_PARALLEL = (("pp2", "fully_shard"), ("pp2_unsharded", "fully_shard"))
"""(pipeline mode, ``fully_shard`` over all N ranks) pairs whose ratios get their own rows, and
whose ranks get a per-rank table: pp=2 x dp=N/2 against dp=N."""


def analytic_volume_bytes(mode: Mode, psi: int, update_freq: int = 1) -> dict[str, int]:
    """Bytes per rank per step each collective type should move, by ZeRO §7.

    See [Note: communication volume] (volume = unsharded logical size).

    Args:
        mode: the mode (FSDP1/FSDP2/DeepSpeed are ZeRO-3 and count as FULL_SHARD).
        psi: Ψ, the number of parameters (a tied weight once).
        update_freq: K, micro-batches per step (all-gathers, and the invariant
            all-to-all, once per micro-batch; the default reduction once per step).
    Returns:
        ``{"all_gather", "reduce_scatter", "all_reduce", "all_to_all"}`` -> bytes (int).
    """
    gather_b = 2 if mode.bf16 else 4  # full parameters in param_dtype
    reduce_b = 4  # reduce_dtype fp32 in every mode
    out = dict.fromkeys(COLLECTIVES, 0)
    if mode.family == "ddp" or mode.strategy == "NO_SHARD":
        out["all_reduce"] = 2 * psi * reduce_b
    elif mode.strategy == "SHARD_GRAD_OP":
        out["all_gather"] = update_freq * psi * gather_b
        out["reduce_scatter"] = psi * reduce_b
    else:  # FULL_SHARD and the ZeRO-3 baselines
        out["all_gather"] = update_freq * 2 * psi * gather_b
        out["reduce_scatter"] = psi * reduce_b
    if mode.invariant:  # one all-to-all of the reduce-scatter's input per backward instead
        out["all_to_all"] = update_freq * out.pop("reduce_scatter")
        out["reduce_scatter"] = 0
    return out


def analytic_label(mode: Mode, update_freq: int = 1) -> str:
    """The formula of :func:`analytic_volume_bytes` as text, e.g. ``3Ψ·4 B`` or ``2Ψ·2 B + Ψ·4 B``
    (``4Ψ·4 B + 2Ψ·4 B`` for FULL_SHARD invariant with 2 micro-batches)."""
    k = update_freq
    times = lambda n: "Ψ" if n == 1 else f"{n}Ψ"  # noqa: E731
    if mode.family == "ddp" or mode.strategy == "NO_SHARD":
        return "2Ψ·4 B"
    gathers = k if mode.strategy == "SHARD_GRAD_OP" else 2 * k
    reduces = k if mode.invariant else 1
    if not mode.bf16 and gathers == 2 and reduces == 1:
        return "3Ψ·4 B"
    if not mode.bf16 and gathers == 1 and reduces == 1:
        return "2Ψ·4 B"
    return f"{times(gathers)}·{2 if mode.bf16 else 4} B + {times(reduces)}·4 B"


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """The GPT every mode trains (:class:`fullshard.models.GPTConfig` without dropout)."""

    num_layers: int
    embed_dim: int
    num_heads: int
    vocab_size: int
    max_positions: int

    def gpt_config(self) -> GPTConfig:
        return GPTConfig(num_layers=self.num_layers, embed_dim=self.embed_dim, num_heads=self.num_heads,
                         ffn_embed_dim=4 * self.embed_dim, vocab_size=self.vocab_size,
                         max_positions=self.max_positions)

    def psi(self) -> int:
        """Ψ = V·C + P·C + L·(12·C² + 13·C) + 2·C (the tied output projection once)."""
        c = self.embed_dim
        return self.vocab_size * c + self.max_positions * c + self.num_layers * (12 * c * c + 13 * c) + 2 * c


@dataclasses.dataclass(frozen=True)
class Job:
    """One launch: one mode on ``world_size`` ranks (every rank gets the same copy).

    Attributes:
        mode: a key of :data:`MODES`.
        batch_size: sequences per rank per step (B).
        seq_len: tokens per sequence (T), at most ``model.max_positions``.
        warmup_steps, timed_steps: AdamW steps before timing, and timed.
        update_freq: micro-batches of ``batch_size`` sequences per step, gradients
            accumulated over the first ``update_freq - 1`` under ``no_sync``.
        threads: intra-op threads per rank (``torch.set_num_threads``).
        timeout_s: deadline of every gloo collective.
        optimizer: ``adam``, ``muon``, ``adafactor`` or ``lamb`` (:mod:`fullshard.bench.optimizers`).
    """

    mode: str
    model: ModelSpec
    world_size: int
    batch_size: int
    seq_len: int
    warmup_steps: int
    timed_steps: int
    threads: int
    lr: float = 1e-3
    weight_decay: float = 0.01
    seed: int = 1
    timeout_s: float = 300.0
    update_freq: int = 1
    optimizer: str = "adam"
