"""Balanced pipeline stages: the split behind ``fullshard train --pipeline-split auto``
(:func:`auto_split`) and ``fullshard plan --pipeline-parallel-size P`` (`pipeline_plan_cli.py`).

A split is a list of per-stage layer counts ``[n_0, ..., n_{S-1}]`` (S stages in order, each
n_i >= 1, summing to the model's layer count); the token and position embeddings run in stage 0,
the final LayerNorm, the output projection and the loss in stage S-1. A GPT's blocks cost the
same, but its vocabulary head does not: at a small width the head (a C x V matmul and the
softmax over V) costs several blocks, so an even split leaves the last stage the slowest and
the first/last stages should hold fewer layers (torchtitan's advice). This module measures the
costs and chooses the split:

1. :func:`profile_model` times, on this machine, every layer's forward and backward (and the
   embedding's and the head's as their own items) on one micro-batch, in place inside whole
   forward and backward passes of the model: one warm-up pass, then the least time of each item
   over a few passes. The least, not the mean or the median: other processes only ever add
   time, so the minimum is the estimate of what the code costs that load disturbs least (the
   reasoning of Python's ``timeit`` documentation). On the shared 2-core test machine, for the
   16-layer model of ``tests/unit/test_pipeline_plan.py``, medians put the head at 4.5 to 8.7
   layers from one run to the next and chose splits from [6, 10] to [11, 5]; minima chose
   [10, 6] in 10 of 12 runs.
2. :func:`balanced_split` chooses the contiguous partition that minimizes the slowest stage
   (the linear-partition problem, Skiena, "The Algorithm Design Manual", 2nd ed., §8.5, in its
   min-max form, also called chains-on-chains partitioning, Pınar and Aykanat 2004): an exact
   dynamic program over (stage, last layer), O(S·L²), optionally refusing stages over a memory
   budget; among the splits with the least bottleneck it takes the one with the least sum of
   squared stage times (a second exact pass), so the stages that are not the slowest are even.
   For the V-shaped schedules it minimizes the slowest rank's two stages instead (`pipeline_vsplit.py`).
3. :func:`bubble_fraction` is the share of a step the schedule leaves idle.

Timings differ between calls: call :func:`auto_split` once (e.g. in the launching process) and
hand the same split to every rank.
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
import time
from typing import Callable, Optional, Sequence

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint as checkpoint_fn

from fullshard.models import GPT, build_model
from fullshard.train import pipeline_checks
from fullshard.train.launcher import threads_per_rank
from fullshard.train.pipeline_checks import SPLIT_BACKWARD
from fullshard.train.pipeline_vsplit import v_shaped_split


class SplitError(ValueError):
    """No split satisfies the request (too many stages, or none fits the memory budget)."""


@dataclasses.dataclass(frozen=True)
class ItemCost:
    """One cost item of a micro-batch: the embedding, one transformer layer or the head.

    Attributes:
        name: ``"embed"``, ``"layer <i>"`` or ``"head"``.
        forward_s, backward_s: least seconds of its forward, and of its backward (parameter and
            input gradients, the recomputation under activation checkpointing included).
        param_numel: elements of its parameters (the head counts the tied embedding weight: the
            last stage of a pipeline holds its own copy).
    """

    name: str
    forward_s: float
    backward_s: float
    param_numel: int

    @property
    def seconds(self) -> float:
        return self.forward_s + self.backward_s


@dataclasses.dataclass(frozen=True)
class ModelCosts:
    """The measured items of one micro-batch, in model order."""

    embed: ItemCost
    layers: tuple
    head: ItemCost
    tied_numel: int = 0
    """Elements shared by ``embed`` and ``head`` (the tied token embedding); counted once in one stage."""

    def stage_seconds(self, split: Sequence[int]) -> list[float]:
        """Predicted forward + backward seconds of each stage of ``split`` (sums of its items)."""
        return [sum(it.seconds for it in items) for items in self.stage_items(split)]

    def stage_items(self, split: Sequence[int]) -> list[list[ItemCost]]:
        """The items of each stage: the embedding first, the head last."""
        bounds = stage_bounds(split)
        out = [list(self.layers[a:b]) for a, b in bounds]
        out[0].insert(0, self.embed)
        out[-1].append(self.head)
        return out

    def stage_params(self, split: Sequence[int]) -> list[int]:
        """Parameter elements of each stage (the tied weight once if one stage holds both ends)."""
        out = [sum(it.param_numel for it in items) for items in self.stage_items(split)]
        if len(split) == 1:
            out[0] -= self.tied_numel
        return out


def stage_bounds(split: Sequence[int]) -> list[tuple[int, int]]:
    """``[(first layer, end layer)]`` of each stage."""
    ends = [sum(split[:k + 1]) for k in range(len(split))]
    return [(end - n, end) for n, end in zip(split, ends)]


# ---------------------------------------------------------------- measuring
def _embed(model: GPT, tokens: torch.Tensor) -> torch.Tensor:
    positions = torch.arange(tokens.shape[1], device=tokens.device)
    return model.dropout(model.embed_tokens(tokens) + model.embed_positions(positions))


def _layer(layer: torch.nn.Module, x: torch.Tensor, checkpoint: bool) -> torch.Tensor:
    return checkpoint_fn(layer, x, use_reentrant=False) if checkpoint else layer(x)


def _loss(model: GPT, x: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The head as the trainer runs it: final norm, logits, fp32 cross-entropy (a scalar)."""
    logits = model.output_projection(model.layer_norm(x))
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


def _stage_fn(model: GPT, start: int, stop: int, first: bool, last: bool, inputs: dict, checkpoint: bool):
    """Forward of one stage on the prepared inputs: (tokens ->) layers[start:stop] (-> loss)."""
    def run() -> torch.Tensor:
        x = _embed(model, inputs["tokens"]) if first else inputs["hidden"]
        for layer in model.layers[start:stop]:
            x = _layer(layer, x, checkpoint)
        return _loss(model, x, inputs["tokens"]) if last else x
    return run


def _inputs(model: GPT, micro_batch: int, seq_len: int) -> dict:
    """A micro-batch: token ids (B, T), a hidden state (B, T, C) that requires grad, an output grad."""
    p = next(model.parameters())
    gen = torch.Generator().manual_seed(0)
    shape = (micro_batch, seq_len, model.config.embed_dim)
    return {"tokens": torch.randint(model.config.vocab_size, (micro_batch, seq_len), generator=gen).to(p.device),
            "hidden": torch.randn(shape, generator=gen).to(p.device, p.dtype).requires_grad_(),
            "grad": torch.randn(shape, generator=gen).to(p.device, p.dtype)}


def _time_rotating(model: GPT, fns: Sequence[Callable[[], torch.Tensor]], inputs: dict,
                   warmup: int, reps: int) -> list[float]:
    """Least forward + backward seconds of each of ``fns`` over ``reps`` repetitions; within a
    repetition each runs once, in an order rotated by one at every repetition (so no function
    always runs right after the same one, e.g. on the memory it just freed)."""
    sync = torch.cuda.synchronize if next(model.parameters()).is_cuda else (lambda: None)
    samples = [[] for _ in fns]
    for rep in range(warmup + reps):
        for i in [(rep + j) % len(fns) for j in range(len(fns))]:
            model.zero_grad(set_to_none=True)  # every repetition allocates its gradients, as the first micro-batch
            inputs["hidden"].grad = None
            sync()
            start = time.perf_counter()
            out = fns[i]()
            out.backward(None if out.dim() == 0 else inputs["grad"])
            sync()
            if rep >= warmup:
                samples[i].append(time.perf_counter() - start)
    return [min(t) for t in samples]


def _chain_once(model: GPT, inputs: dict, checkpoint: bool, sync: Callable[[], None]) -> tuple[list, list]:
    """One forward and backward of the whole model, timed item by item: forward between the items'
    outputs, backward between the gradients reaching each item's input (tensor hooks).

    Returns:
        ``(forward_s, backward_s)``, each ``[embed, layer 0, ..., layer L-1, head]``.
    """
    model.zero_grad(set_to_none=True)  # every repetition allocates its gradients, as the first micro-batch
    stamps, grad_stamps = [time.perf_counter()], []

    def stamp(grad: torch.Tensor) -> None:
        sync()
        grad_stamps.append(time.perf_counter())

    x = _embed(model, inputs["tokens"])
    for layer in [*model.layers, None]:
        sync()
        stamps.append(time.perf_counter())
        x.register_hook(stamp)  # fires once the gradient of this item's input is complete
        x = _loss(model, x, inputs["tokens"]) if layer is None else _layer(layer, x, checkpoint)
    sync()
    stamps.append(time.perf_counter())
    x.backward()
    sync()
    grad_stamps.append(time.perf_counter())
    forward = [b - a for a, b in zip(stamps, stamps[1:])]
    ends = [stamps[-1], *grad_stamps]  # head, layer L-1, ..., layer 0, then the embedding
    backward = [b - a for a, b in zip(ends, ends[1:])][::-1]
    return forward, backward


def profile_model(model: GPT, micro_batch: int, seq_len: int, *, checkpoint: bool = False,
                  warmup: int = 1, reps: int = 5) -> ModelCosts:
    """Time the embedding, every layer and the head of ``model`` on one micro-batch, in place in
    whole forward and backward passes of the model (so each layer runs on the memory and caches a
    stage sees); each item's forward and backward time is the least over ``reps`` passes.

    Args:
        model: a GPT on the device and in the compute dtype of training, in training mode.
        micro_batch: sequences per micro-batch (B); seq_len: tokens per sequence (T).
        checkpoint: run each layer under activation checkpointing (backward recomputes it).
        warmup, reps: untimed and timed passes.
    Raises:
        ValueError: ``reps`` < 1, or ``seq_len`` over the model's positions.
    """
    if reps < 1 or warmup < 0:
        raise ValueError(f"profile needs reps >= 1 and warmup >= 0, got reps={reps}, warmup={warmup}")
    if seq_len > model.config.max_positions:
        raise ValueError(f"seq_len {seq_len} exceeds the model's {model.config.max_positions} positions")
    inputs = _inputs(model, micro_batch, seq_len)
    sync = torch.cuda.synchronize if next(model.parameters()).is_cuda else (lambda: None)
    runs = [_chain_once(model, inputs, checkpoint, sync) for _ in range(warmup + reps)][warmup:]
    times = [(min(r[0][i] for r in runs), min(r[1][i] for r in runs))
             for i in range(len(model.layers) + 2)]
    layers = list(model.layers)
    numel = lambda *mods: sum(p.numel() for m in mods for p in m.parameters())  # noqa: E731
    vocab_numel = model.embed_tokens.weight.numel()  # a GPT ties it to the output projection's weight
    head_numel = numel(model.layer_norm) + vocab_numel
    return ModelCosts(
        ItemCost("embed", *times[0], numel(model.embed_tokens, model.embed_positions)),
        tuple(ItemCost(f"layer {i}", *t, numel(layer)) for i, (t, layer) in enumerate(zip(times[1:-1], layers))),
        ItemCost("head", *times[-1], head_numel), tied_numel=vocab_numel)


def measure_stages(model: GPT, splits: Sequence[Sequence[int]], micro_batch: int, seq_len: int, *,
                   checkpoint: bool = False, warmup: int = 1, reps: int = 5) -> list[list[float]]:
    """Measured forward + backward seconds of each stage of each split (whole stages, as a pipeline
    runs them: a stage after the first also computes its input's gradient), the stages of every
    split interleaved within a repetition (so a burst of load slows them alike); the least of ``reps``."""
    inputs = _inputs(model, micro_batch, seq_len)
    fns = [_stage_fn(model, a, b, k == 0, k == len(split) - 1, inputs, checkpoint)
           for split in splits for k, (a, b) in enumerate(stage_bounds(split))]
    times = _time_rotating(model, fns, inputs, warmup, reps)
    out, i = [], 0
    for split in splits:
        out.append(times[i:i + len(split)])
        i += len(split)
    return out


# ---------------------------------------------------------------- choosing the split
def balanced_split(layer_s: Sequence[float], num_stages: int, first_s: float = 0.0, last_s: float = 0.0,
                   fits: Optional[Callable[[int, int, int], bool]] = None,
                   ranks: Optional[Sequence[int]] = None) -> list[int]:
    """The contiguous split of the layers into ``num_stages`` stages whose slowest stage is the
    fastest possible (exact; see the module docstring), ties broken by the least sum of squared
    stage times. With ``ranks`` in the V placement (stages k and S-1-k on one rank: ZBVZeroBubble,
    DualPipeV), the objective is the slowest RANK, the sum of its two stages
    (`pipeline_vsplit.py`, exact; ties by the least slowest stage). Other placements with several
    stages per rank (the looped schedules, stage k on rank k mod P) keep the per-stage objective:
    their ranks' sums are not minimized exactly (no exact method fast enough was found), though
    even stages make even sums.

    Args:
        layer_s: each layer's cost (seconds), in order.
        num_stages: S, 1 <= S <= len(layer_s).
        first_s, last_s: costs the first and the last stage carry besides their layers (the
            embedding, the head).
        fits: ``fits(stage, first_layer, end_layer)``: whether that stage fits memory (None: all do).
        ranks: ``ranks[k]``: the pipeline rank of stage k (:func:`stage_rank`); None: one stage per rank.
    Returns:
        The layer count of each stage, each >= 1.
    Raises:
        SplitError: S outside 1..L, or no split fits.
        ValueError: ``ranks`` not of length S.
    """
    L, S = len(layer_s), num_stages
    if not 1 <= S <= L:
        raise SplitError(f"cannot split {L} layers into {S} stages of at least one layer each")
    if ranks is not None and len(ranks) != S:
        raise ValueError(f"ranks gives {len(ranks)} stages' ranks for {S} stages")
    if ranks is not None and S % 2 == 0 and len(set(ranks)) == S // 2 and \
            all(ranks[k] == ranks[S - 1 - k] for k in range(S // 2)):
        return v_shaped_split(layer_s, S // 2, first_s, last_s, fits, SplitError)
    prefix = [0.0]
    for t in layer_s:
        prefix.append(prefix[-1] + t)

    def cost(k: int, i: int, j: int) -> float:
        return prefix[j] - prefix[i] + (first_s if k == 0 else 0.0) + (last_s if k == S - 1 else 0.0)

    def solve(step):  # table[k][j]: the best of stages 0..k-1 ending at layer j, and where stage k-1 starts
        table = [[math.inf] * (L + 1) for _ in range(S + 1)]
        start = [[0] * (L + 1) for _ in range(S + 1)]
        table[0][0] = 0.0
        for k in range(1, S + 1):
            for j in range(k, L - (S - k) + 1):
                for i in range(k - 1, j):
                    if table[k - 1][i] == math.inf or (fits is not None and not fits(k - 1, i, j)):
                        continue
                    value = step(table[k - 1][i], cost(k - 1, i, j))
                    if value < table[k][j]:
                        table[k][j], start[k][j] = value, i
        return table, start

    bottleneck = solve(max)[0][S][L]
    if bottleneck == math.inf:
        raise SplitError(f"no split of {L} layers into {S} stages fits the memory budget")
    limit = bottleneck * (1 + 1e-9) + 1e-15
    table, start = solve(lambda acc, c: acc + c * c if c <= limit else math.inf)
    split, j = [], L
    for k in range(S, 0, -1):
        i = start[k][j]
        split.append(j - i)
        j = i
    return split[::-1]


def even_split(num_layers: int, num_stages: int) -> list[int]:
    """``num_layers // num_stages`` layers per stage, the remainder one each to the stages nearest
    the middle (the ends carry the embedding and the head).

    Raises:
        SplitError: ``num_stages`` outside 1..num_layers.
    """
    if not 1 <= num_stages <= num_layers:
        raise SplitError(f"cannot split {num_layers} layers into {num_stages} stages of at least one layer each")
    split = [num_layers // num_stages] * num_stages
    middle = sorted(range(num_stages), key=lambda k: (abs(k - (num_stages - 1) / 2), k))
    for k in middle[:num_layers % num_stages]:
        split[k] += 1
    return split


def bubble_fraction(schedule: str, num_ranks: int, microbatches: int, stages_per_rank: int = 1) -> Optional[float]:
    """Share of a step's time the pipeline is idle, for equal stages; None where not modelled.

    GPipe (Huang et al. 2019, §2.2) and 1F1B: (P-1)/(M+P-1); interleaved 1F1B with V stages per
    rank: (P-1)/(V·M+P-1). These are Narayanan et al. 2021, "Efficient Large-Scale Language Model
    Training on GPU Clusters Using Megatron-LM", §2.2.1-2.2.2, whose bubble-to-ideal ratios
    (P-1)/M and (P-1)/(V·M) are written as shares of the whole step. None for LoopedBFS and the
    zero-bubble schedules (InterleavedZeroBubble, ZBVZeroBubble, DualPipeV): Qi et al. 2024, "Zero
    Bubble Pipeline Parallelism" (ICLR 2024; §2 under equal times, §3 in general; arXiv 2401.10241
    also gives ZB-V), derive their bubbles from the separate times of the forward, the input
    backward and the weight backward, which the profile does not split.
    """
    if schedule == "LoopedBFS" or schedule in SPLIT_BACKWARD:
        return None
    v = stages_per_rank if schedule == "Interleaved1F1B" else 1
    return (num_ranks - 1) / (v * microbatches + num_ranks - 1)


def stage_rank(stage: int, num_ranks: int, schedule: str = "1F1B") -> int:
    """The pipeline rank that runs ``stage``, as `fullshard train` places it: stage mod P (one stage
    per rank, or the looped schedules); 2P-1-stage for the second stage of a V-shaped schedule."""
    return pipeline_checks.stage_rank(schedule, num_ranks, stage)


def in_flight(schedule: str, rank: int, num_ranks: int, microbatches: int) -> int:
    """Micro-batches whose activations a stage holds at most: GPipe all M; 1F1B min(M, P - rank)
    (Narayanan et al. 2021, §2.2.1); the looped and the zero-bubble schedules at most M per stage
    (an upper bound: no stage holds more micro-batches than the step has)."""
    return min(microbatches, num_ranks - rank) if schedule == "1F1B" else microbatches


@contextlib.contextmanager
def intra_op_threads(threads: Optional[int]):
    """Run the block with ``torch.set_num_threads(threads)`` (None: as is), then restore the count."""
    before = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def profile_for(shape, vocab_size: int, max_positions: int, micro_batch: int, seq_len: int, *,
                dtype: torch.dtype = torch.float32, dropout: float = 0.0, checkpoint: bool = False,
                warmup: int = 1, reps: int = 5, device=None) -> tuple[GPT, ModelCosts]:
    """Build the GPT of ``shape`` (an arch name or :class:`fullshard.models.ArchSpec`) in ``dtype`` on
    ``device`` (default: CUDA when available, else CPU) and profile it; returns the model too.

    The output projection gets its own copy of the tied embedding weight, as the last stage of a
    pipeline holds one: otherwise the sum of the two ends' V x C gradients would be timed at the
    end of the backward, as the embedding's.
    """
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    model = build_model(shape, vocab_size, max_positions, device=device, seed=0, dropout=dropout).to(dtype)
    model.output_projection.weight = torch.nn.Parameter(model.embed_tokens.weight.detach().clone())
    return model, profile_model(model, micro_batch, seq_len, checkpoint=checkpoint, warmup=warmup, reps=reps)


def auto_split(cfg, num_stages: int) -> list[int]:
    """The balanced split of ``fullshard train --pipeline-split auto``: profile the model of ``cfg``
    on one pipeline micro-batch (``--batch-size`` / ``--pipeline-microbatches`` sequences, M = P when
    not given, as `fullshard train` splits it) of ``cfg.tokens_per_sample`` tokens in its compute dtype
    (``--bf16``/``--fp16``), with ``--checkpoint-activations`` and ``--dropout`` as configured (on a
    CPU with the intra-op threads a rank gets: ``--threads-per-rank``, or the cores divided among
    ``--nproc-per-node`` ranks), then :func:`balanced_split`. Timings differ between calls: call it
    once and give every rank the result. The stages go to ranks as ``--pipeline-schedule`` places
    them: for ZBVZeroBubble and DualPipeV the split minimizes the slowest rank's two stages.

    Args:
        cfg: a :class:`fullshard.train.config.TrainConfig`.
        num_stages: S = pipeline ranks x stages per rank.
    Returns:
        ``[n_0, ..., n_{S-1}]``, each >= 1, summing to the model's layer count.
    Raises:
        SplitError: S outside 1..the layer count.
    """
    shape = cfg.arch_spec()
    even_split(shape.num_layers, num_stages)  # the range check, before profiling
    dtype = torch.bfloat16 if cfg.bf16 else torch.float16 if cfg.fp16 else torch.float32
    cpu = not torch.cuda.is_available()
    threads = (cfg.threads_per_rank or threads_per_rank(cfg.nproc_per_node)) if cpu else None
    m = getattr(cfg, "pipeline_microbatches", None) or getattr(cfg, "pipeline_parallel_size", 1)
    micro_batch = max(1, cfg.batch_size // m)
    with intra_op_threads(threads):
        _, costs = profile_for(shape, cfg.vocab_size, cfg.max_positions, micro_batch, cfg.tokens_per_sample,
                               dtype=dtype, dropout=cfg.dropout, checkpoint=cfg.checkpoint_activations)
    P = getattr(cfg, "pipeline_parallel_size", 1) or 1
    schedule = getattr(cfg, "pipeline_schedule", "1F1B")
    ranks = [stage_rank(k, P, schedule) for k in range(num_stages)] if num_stages % P == 0 else None
    return balanced_split([it.seconds for it in costs.layers], num_stages, costs.embed.seconds, costs.head.seconds,
                          ranks=ranks)
