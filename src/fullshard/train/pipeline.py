"""`fullshard train --pipeline-parallel-size P`: the GPT cut into stages on a (pp, dp) mesh, driven
by torch.distributed.pipelining's schedules (docs/pipeline.md).

Rank ``r`` is pipeline rank ``r // D`` and data-parallel rank ``r % D`` (D = world / P): ranks of
one data-parallel group are consecutive, and each pipeline group (one per data-parallel rank) feeds
the same batches through its stages. A pipeline rank holds stages ``p, p + P, ..., p + (V-1) P``
(torch's loop placement; the V-shaped ZBVZeroBubble / DualPipeV: ``p`` and ``2P - 1 - p``, so
the first pipeline rank holds the first and last stages and sums the tied weight's copies locally),
each cut by `fullshard.models.stages.cut_gpt` and sharded with
``fully_shard`` (one unit per block, then the stage; --fsdp-version 1: a FullyShardedDataParallel
wrapper auto-wrapping the blocks, one stage per rank) over the data-parallel group (--hybrid-shard:
a 2-D (replicate, shard) sub-mesh, `pipeline_mesh`), in a `fullshard.pipelining.PipelineStage` with
the chosen gradient accumulation.

The tied embedding crosses stages (see [Note: pipeline stages]): after backward the first and last
stages' gradient shards are summed (both ranks of the pair get the sum), the optimizer steps the
first stage's ``embed_tokens.weight`` only, and the last stage's copy ``output_projection.weight``
is then overwritten with it, which equals the tied model's update. The gradient norm counts that
copy zero times, everything else once (one all-reduce over the world).

Loss convention as the trainer's: each pipeline micro-batch adds its summed token cross entropy
divided by the rank's micro-batch token count times --update-freq, so the M pipeline micro-batches
of a micro-batch add up to its mean.

[Note: world-size-invariant pipelining]
Under --world-size-invariant the global micro-batch (see [Note: world-size-invariant training]) is
one pipeline micro-batch of B / M sequences, so the fold order is fixed by the data whatever D is.
The loop samples global micro-batches of B / M sequences and gives each --batch-size micro-batch
M consecutive ones of its data-parallel rank ``r``: global indices ``u*N + k*D + r`` for
k = j*M .. j*M + M - 1 (N per update). The schedule splits the micro-batch back into those M, so
every stage's unit folds (over its data-parallel group, `fullshard.core.invariant.fold_group`)
the gradients of global micro-batches in ascending order in either gradient accumulation mode.
Each pipeline micro-batch's loss is divided by the update's global token count; before a stage's
forward of a pipeline micro-batch the generator is seeded from (seed, epoch, index, stage); the
logged sums are the last stage's per-pipeline-micro-batch (validation: per-sequence) rows added in
global order; the gradient norm is summed exactly over the world. The tied weight's two gradient
shards are summed by a two-rank all-reduce (a + b = b + a, bitwise).
"""
from __future__ import annotations

import contextlib
import math
import os
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.pipelining import schedules

from fullshard.activation_checkpointing import apply_activation_checkpointing
from fullshard.core import collectives, norms, torch_private
from fullshard.models import TransformerBlock, build_model, make_param_init_fn
from fullshard.models.stages import check_split, cut_gpt, even_split, join_stages
from fullshard.pipelining import PipelineStage
from fullshard.train import invariance, pipeline_plan, sharding
from fullshard.train.pipeline_checks import MULTI_STAGE, V_SHAPED, check, microbatches, parse_split, stage_ids


def data_parallel(cfg) -> tuple[int, int]:
    """(this rank's data-parallel rank, the data-parallel size): ``(rank % D, D)`` with
    D = world / --pipeline-parallel-size (the world itself without pipelining)."""
    d = collectives.world_size() // max(cfg.pipeline_parallel_size, 1)
    return collectives.rank() % d, d


def split_of(cfg, num_layers: int) -> list[int]:
    """Layers per stage (all P x V stages, in order) that ``--pipeline-split`` asks for."""
    stages = cfg.pipeline_parallel_size * cfg.pipeline_stages_per_rank
    if cfg.pipeline_split == "even":
        return even_split(num_layers, stages)
    if cfg.pipeline_split == "auto":
        # Profiled on rank 0 only and handed to every rank: timings differ between processes, and
        # ranks that chose different splits would build stages that do not fit together.
        split = pipeline_plan.auto_split(cfg, stages) if collectives.rank() == 0 else None
        return check_split(collectives.all_gather_object(split, tag="pipeline split")[0], num_layers, stages)
    return check_split(parse_split(cfg.pipeline_split), num_layers, stages)


def pipeline_mesh(cfg, device_type: str, p: int, d: int):
    """(the world's mesh, a stage's data-parallel mesh). ``(pp, dp)`` = (P, D), stages sharded over
    ``dp``; --hybrid-shard: ``(pp, replicate, shard)`` = (P, D / S, S) with shard groups of
    S = gcd(D, LOCAL_WORLD_SIZE) consecutive ranks (within a node when a node's ranks are
    consecutive) replicated over the rest of the data-parallel group, stages on the 2-D
    ``(replicate, shard)`` sub-mesh. Rank ``r`` is data-parallel rank ``r % D`` either way."""
    if not cfg.hybrid_shard:
        mesh = init_device_mesh(device_type, (p, d), mesh_dim_names=("pp", "dp"))
        return mesh, mesh["dp"]
    shard = math.gcd(d, int(os.environ.get("LOCAL_WORLD_SIZE", d)))
    mesh = init_device_mesh(device_type, (p, d // shard, shard), mesh_dim_names=("pp", "replicate", "shard"))
    return mesh, mesh["replicate", "shard"]


class Pipeline:
    """This rank's pipeline stages, their schedule and the tied weight's bookkeeping.

    Attributes:
        model: the module whose ``named_parameters()`` are the plain model's names of every
            parameter this rank holds (its stage, or a join of its stages): the optimizer's and the
            checkpoint's model.
        group: the world (the ranks a checkpoint spans).
        is_last: this rank holds the last stage (it computes the loss).
    """

    def __init__(self, cfg, device: torch.device):
        self.cfg, self.device = cfg, device
        self.scaler = None  # the trainer's ShardedGradScaler, set once it exists
        world = collectives.world_size()
        check(cfg, world, cfg.arch_spec().num_layers)
        p, v = cfg.pipeline_parallel_size, cfg.pipeline_stages_per_rank
        d = world // p
        self.mesh, self.dp_mesh = pipeline_mesh(cfg, device.type, p, d)
        self.pp_rank, self.dp_size = self.mesh.get_local_rank("pp"), d
        # --hybrid-shard: replicas hold the same shards; only replica 0 counts them in the norm.
        self.counts_norm = not cfg.hybrid_shard or self.mesh.get_local_rank("replicate") == 0
        num_stages = p * v
        self.stage_ids = stage_ids(cfg.pipeline_schedule, p, v, self.pp_rank)
        shape = cfg.arch_spec()
        kwargs = dict(vocab_size=cfg.vocab_size, max_positions=cfg.max_positions, dropout=cfg.dropout)
        split = split_of(cfg, shape.num_layers)
        self.split = split
        self.modules, stages = [], []
        m = self.microbatches = microbatches(cfg)
        for s in self.stage_ids:
            whole = build_model(shape, device="meta", **kwargs)  # one per stage: see cut_gpt
            init_fn = make_param_init_fn(whole, cfg.seed, device)
            stage = cut_gpt(whole, split, s)
            self._checkpoint_blocks(stage)
            stage = sharding.shard_stage(stage, cfg, device, init_fn, self.dp_mesh)
            self.modules.append(stage)
            inputs, outputs = self._metadata(s, num_stages, cfg.batch_size // m, whole.config)
            stages.append(_Stage(stage, s, num_stages, device, input_args=inputs, output_args=outputs,
                                 group=self.mesh.get_group("pp"), grad_accumulation=cfg.pipeline_grad_accumulation,
                                 before_forward=self._seed_chunk if cfg.world_size_invariant else None))
        self.model = join_stages(self.modules)
        self.optim_model = join_stages(self.modules, with_tied_copy=False)
        self.is_first, self.is_last = 0 in self.stage_ids, num_stages - 1 in self.stage_ids
        cls = schedules.get_schedule_class(cfg.pipeline_schedule)
        self.schedule = cls(stages if cfg.pipeline_schedule in MULTI_STAGE else stages[0], m, loss_fn=self._loss_fn,
                            scale_grads=False)
        self.group = collectives.world_group()
        self._tie_group = self._make_tie_group(p, d)
        self._denominator, self._sums, self._seq_sums = 1.0, [], []
        self._ids: Optional[list] = None  # --world-size-invariant: this micro-batch's pipeline micro-batch ids

    # ------------------------------------------------------------------ build
    def _checkpoint_blocks(self, stage: nn.Module) -> None:
        if self.cfg.checkpoint_activations:
            apply_activation_checkpointing(stage, check_fn=lambda mod: isinstance(mod, TransformerBlock),
                                           offload_to_cpu=self.cfg.offload_activations)

    def _metadata(self, s: int, num_stages: int, mb: int, config) -> tuple[torch.Tensor, torch.Tensor]:
        """Static input / output examples of stage ``s`` (torch's stage then runs no inference pass):
        token ids (mb, T) int64 into the first stage, hidden states (mb, T, C) between stages and
        logits (mb, T, V) out of the last, in the compute dtype."""
        t, dtype = self.cfg.tokens_per_sample, sharding.low_precision(self.cfg) or torch.float32
        hidden = torch.zeros(mb, t, config.embed_dim, dtype=dtype, device=self.device, requires_grad=True)
        inputs = torch.zeros(mb, t, dtype=torch.long, device=self.device) if s == 0 else hidden
        outputs = (torch.zeros(mb, t, config.vocab_size, dtype=dtype, device=self.device, requires_grad=True)
                   if s == num_stages - 1 else hidden)
        return inputs, outputs

    def _make_tie_group(self, p: int, d: int):
        """The group of the first and last pipeline ranks of this rank's data-parallel column (every
        rank creates every pair, in the same order); None on the ranks in between, and for the
        V-shaped schedules (the first pipeline rank holds both stages: no pair)."""
        mine = None
        if self.cfg.pipeline_schedule in V_SHAPED:
            return None
        for col in range(d):
            pair = [col, (p - 1) * d + col]
            group = collectives.new_group(pair)
            if collectives.rank() in pair:
                mine = group
        return mine

    # ------------------------------------------------------------------ steps
    def _loss_fn(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Last stage: summed token cross entropy of one pipeline micro-batch (targets -100 count
        nothing), recorded for logging; training returns it over the denominator, loss-scaled."""
        flat = logits.reshape(-1, logits.size(-1)).float()
        if not torch.is_grad_enabled():
            per_seq = F.cross_entropy(flat, targets.reshape(-1), reduction="none").view(targets.shape).sum(dim=1)
            self._seq_sums.append(per_seq)  # --world-size-invariant validation: added in global order
            self._sums.append(per_seq.sum())
            return self._sums[-1]
        ce = F.cross_entropy(flat, targets.reshape(-1), reduction="sum")
        self._sums.append(ce.detach())
        return self.scaler.scale(ce / self._denominator)

    def train_micro_batch(self, inputs: torch.Tensor, targets: torch.Tensor, k: int,
                          ids: Optional[list] = None) -> list:
        """Forward and backward of one (B, T) micro-batch through the pipeline (all M pipeline
        micro-batches); gradients accumulate. Returns this rank's [loss sum (nats), tokens,
        sequences] to add over the world: the last stage's, zeros elsewhere.

        --world-size-invariant (see [Note: world-size-invariant pipelining]): ``ids`` are the M
        pipeline micro-batches' (epoch, global index); the loss is divided by the update's global
        token count (``k`` x D micro-batches), and the return is M such rows, one per pipeline
        micro-batch, for `ordered_sums`.
        """
        invariant = self.cfg.world_size_invariant
        dp = self.dp_size if invariant else 1
        self._denominator, self._sums, self._ids = float(targets.numel() * k * dp), [], ids
        for module in self.modules:
            module.train()
        self._run(self.schedule.step, inputs, targets)
        self._ids = None
        return self._chunk_rows(targets) if invariant else self._row(targets)

    def _seed_chunk(self, stage: int, chunk: int) -> None:
        """Before stage ``stage``'s forward of pipeline micro-batch ``chunk`` (training): seed the
        generator from its global id, so its dropout masks do not depend on D."""
        if self._ids is not None:
            invariance.seed_micro_batch(self.cfg.seed, self._ids[chunk], stage)

    def _chunk_rows(self, targets: torch.Tensor) -> list:
        """[loss sum, tokens, sequences] of each pipeline micro-batch (the last stage's, zeros
        elsewhere); the schedules run the last stage's forwards in micro-batch order."""
        if not self.is_last:
            return [[0.0, 0, 0]] * self.microbatches
        rows = []
        for ce, chunk in zip(self._sums, targets.tensor_split(self.microbatches)):
            counted = chunk != -100
            rows.append([float(ce), int(counted.sum()), int(counted.any(dim=1).sum())])
        return rows

    def ordered_sums(self, rows: torch.Tensor, block: int = 1) -> list:
        """--world-size-invariant: every rank's (K, F) float64 ``rows`` gathered, the last pipeline
        rank's D data-parallel ranks' added in global order (`invariance.sum_interleaved`; the
        other ranks' rows are zeros). Every rank calls it; returns F floats, the same on all."""
        gathered = invariance.gather_rows(rows, self.device)
        return invariance.sum_interleaved(gathered[-self.dp_size:], block)

    def _run(self, fn, inputs, targets) -> None:
        args = (inputs.to(self.device),) if self.is_first else ()
        kwargs = dict(target=targets.to(self.device), losses=[]) if self.is_last else {}
        fn(*args, **kwargs)

    def _row(self, targets: torch.Tensor) -> list:
        if not self.is_last:
            return [0.0, 0, 0]
        counted = (targets != -100)
        return [float(torch.stack(self._sums).sum()), int(counted.sum()),
                int(counted.any(dim=1).sum())]

    @torch.no_grad()
    def valid_batch(self, inputs: torch.Tensor, targets: torch.Tensor, counted: torch.Tensor):
        """Summed loss of one valid batch's counted sequences (the last stage's, zeros elsewhere):
        [loss sum, tokens, sequences]; under --world-size-invariant (B, 3) float64 rows, one per
        sequence (zeros where not counted), for `ordered_sums`."""
        for module in self.modules:
            module.eval()
        masked = targets.masked_fill(~counted.bool()[:, None], -100)
        self._sums, self._seq_sums = [], []
        with torch_private.forward_actions_only(self.schedule) if self.cfg.pipeline_schedule in V_SHAPED else \
                contextlib.nullcontext():
            self._run(self.schedule.eval, inputs, masked)
        if not self.cfg.world_size_invariant:
            return self._row(masked)
        mask = counted.double()
        if not self.is_last:
            return torch.zeros(len(mask), 3, dtype=torch.float64)
        per_seq = torch.cat(self._seq_sums).cpu().double()
        return torch.stack([per_seq * mask, mask * targets.size(1), mask], dim=1)

    def tie_gradients(self) -> None:
        """Sum the tied weight's two gradient shards (first stage's ``embed_tokens``, last stage's
        ``output_projection``) on both ranks of the pair; a no-op on the ranks in between."""
        if self.is_first and self.is_last:  # V-shaped: both copies here, sharded alike (a + b = b + a)
            first = self._tied_grad(self.model.embed_tokens.weight)
            last = self._tied_grad(self.model.output_projection.weight)
            first.add_(last)
            last.copy_(first)
            return
        grad = self._tied_grad(self._tied_param())
        if grad is not None:
            collectives.all_reduce(grad, self._tie_group, "sum", tag="tied embedding gradient")

    def _tied_param(self) -> Optional[nn.Parameter]:
        if self.is_first:
            return self.model.embed_tokens.weight
        if self.is_last:
            return self.model.output_projection.weight
        return None

    @staticmethod
    def _tied_grad(param: Optional[nn.Parameter]) -> Optional[torch.Tensor]:
        if param is None:
            return None
        if param.grad is None:  # every stage's backward reaches its weights; be safe anyway
            param.grad = torch.zeros_like(param)
        return _local(param.grad)

    @torch.no_grad()
    def sync_tied_weight(self) -> None:
        """Copy the first stage's ``embed_tokens.weight`` shard over the last stage's copy (after an
        optimizer step or a load)."""
        if self.is_first and self.is_last:  # V-shaped: both copies on this rank
            _local(self.model.output_projection.weight).copy_(_local(self.model.embed_tokens.weight))
            return
        param = self._tied_param()
        if param is not None:  # group rank 0 holds the first stage
            collectives.broadcast(_local(param), 0, self._tie_group, tag="tied embedding weight")

    def clip(self, max_norm: float) -> float:
        """Clip every stage's gradients by one global L2 norm (each element of the plain model once:
        the last stage's tied copy not counted); returns the pre-clip norm, the same on every rank."""
        copy = self.model.output_projection.weight if self.is_last else None
        grads = [_local(p.grad) for p in self.model.parameters() if p.grad is not None]
        counted = [_local(p.grad) for p in self.model.parameters()
                   if p.grad is not None and p is not copy and self.counts_norm]
        if self.cfg.world_size_invariant:  # summed exactly: shard boundaries move with D
            norm = norms.reduced_norm([((self.group,), counted)], 2.0, exact=True)
            return self._scale(grads, norm, max_norm)
        total = torch.zeros((), dtype=torch.float64)
        for g in counted:
            total += g.detach().double().pow(2).sum().cpu()
        collectives.all_reduce(total, self.group, "sum", tag="pipeline gradient norm")
        return self._scale(grads, total.sqrt().float(), max_norm)

    @staticmethod
    def _scale(grads: list, norm: torch.Tensor, max_norm: float) -> float:
        coef = torch.clamp(float(max_norm) / (norm + 1e-6), max=1.0)
        for g in grads:
            g.mul_(coef.to(g.device))
        return float(norm)


class _Stage(PipelineStage):
    """fullshard's stage with a hook before each forward chunk (``before_forward(stage index,
    chunk id)``: --world-size-invariant seeds the generator there)."""

    def __init__(self, *args, before_forward=None, **kwargs):
        super().__init__(*args, **kwargs)
        self.before_forward = before_forward

    def forward_one_chunk(self, fwd_chunk_id: int, *args, **kwargs):
        if self.before_forward is not None:
            self.before_forward(self.stage_index, fwd_chunk_id)
        return super().forward_one_chunk(fwd_chunk_id, *args, **kwargs)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t

