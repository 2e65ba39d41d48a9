"""One rank's model, optimizer and steps: build + wrap, train_step, valid_step.
Sharding (``--fsdp-version``): see ``sharding.py``. Checkpoints: see ``checkpoint_utils.py``.

Loss convention: each rank's loss is its own mean token cross entropy (nats),
so the data-parallel gradient average done by FSDP / DDP gives the mean over
all ranks' tokens (every rank sees the same number of tokens). With
``update_freq`` K each micro-batch's mean is divided by K, which makes the
accumulated gradient equal to that of one K-times larger batch. For logging,
[loss_sum, ntokens, nsentences] are summed over micro-batches and ranks.

Under ``--world-size-invariant`` each micro-batch's loss is divided by the update's global token
count instead, the engine sums gradients over ranks, and the logged sums are added in global
micro-batch order: see [Note: world-size-invariant training] in ``invariance.py``.
"""
from __future__ import annotations

import contextlib
import logging
import math
import time
from collections import OrderedDict
from typing import List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

from fullshard import faults
from fullshard.activation_checkpointing import apply_activation_checkpointing
from fullshard.amp import ShardedGradScaler
from fullshard.core import collectives
from fullshard.memory import TOTAL_FIELDS, memory_stats, memory_totals
from fullshard.models import TransformerBlock, build_model, make_param_init_fn, num_params
from fullshard.optim import OffloadAdamW
from fullshard.train import hf_model, invariance, optimizers, pipeline, qlora, sharding
from fullshard.train.config import TrainConfig
from fullshard.train.lr_scheduler import build_lr_scheduler
from fullshard.train.progress import safe_round

logger = logging.getLogger("fullshard.train")

Batch = Tuple[torch.Tensor, torch.Tensor]


class Trainer:
    """Holds the wrapped model, the optimizer (``--optimizer``, see ``optimizers.py``) and the lr
    scheduler of one rank."""

    def __init__(self, cfg: TrainConfig, device: torch.device):
        self.cfg = cfg
        self.device = device
        self.rank = collectives.rank()
        self.world_size = collectives.world_size()
        # --pipeline-parallel-size > 1: this rank's stages (train/pipeline.py); self.model is then
        # the module holding them under the plain model's names.
        self.pipeline: Optional[pipeline.Pipeline] = None
        self.peft_model = None  # --lora-rank: the PeftModel inside self.model (adapter export)
        self.model, shapes, self.num_params = self._build_hf_model() if cfg.hf_model else self._build_model()
        if not cfg.hf_model:
            self.num_trained = self.num_params  # every GPT parameter trains
        stepped = self.pipeline.optim_model if self.pipeline is not None else self.model
        self.optimizer = optimizers.build(cfg, stepped, shapes, self._host_shards())
        self.lr_scheduler = build_lr_scheduler(self.optimizer, cfg)
        self.num_updates = 0
        self.last_finite = None  # (update, loss in base 2) of the last update with a finite loss
        self.scaler = ShardedGradScaler(init_scale=cfg.fp16_init_scale, growth_interval=cfg.fp16_scale_window,
                                        min_loss_scale=cfg.min_loss_scale, enabled=cfg.fp16)
        if self.pipeline is not None:
            self.pipeline.scaler = self.scaler
        # c10d computes in low precision through autocast; fully_sharded through MixedPrecision.
        self.autocast_dtype = (torch.float16 if cfg.fp16 else torch.bfloat16 if cfg.bf16 else None) \
            if cfg.ddp_backend == "c10d" else None
        # --log-memory: largest memory_stats totals sampled since the last log line
        # (c10d has no units: nothing is sampled or logged).
        self.memory_peaks = {} if cfg.log_memory and cfg.ddp_backend == "fully_sharded" else None

    # ------------------------------------------------------------------ build
    def _build_model(self):
        """Build the GPT (same seed on every rank) and wrap it per --ddp-backend."""
        cfg = self.cfg
        shape = cfg.arch_spec()  # --arch with the --decoder-* overrides
        kwargs = dict(vocab_size=cfg.vocab_size, max_positions=cfg.max_positions, dropout=cfg.dropout)
        if cfg.pipeline_parallel_size > 1:
            self.pipeline = pipeline.Pipeline(cfg, self.device)
            whole = build_model(shape, device="meta", **kwargs)
            return self.pipeline.model, {n: p.shape for n, p in whole.named_parameters()}, num_params(whole)
        if cfg.ddp_backend == "c10d":
            if cfg.world_size_invariant:
                raise ValueError(f"[rank {self.rank}] --world-size-invariant needs --ddp-backend fully_sharded")
            model = build_model(shape, device=self.device, seed=cfg.seed, **kwargs)
            shapes = {n: p.shape for n, p in model.named_parameters()}
            self._checkpoint_blocks(model)
            ids = [self.device.index] if self.device.type == "cuda" else None
            return DistributedDataParallel(model, device_ids=ids), shapes, num_params(model)

        # Deferred init: build on meta; each unit is materialized and
        # initialized by rows, so no rank holds the full model.
        model = build_model(shape, device="meta", **kwargs)
        init_fn = make_param_init_fn(model, cfg.seed, self.device)
        shapes = {n: p.shape for n, p in model.named_parameters()}
        total = num_params(model)
        # Checkpoint first, then shard: the unit's gather for backward is reused by the
        # recomputation (fullshard/activation_checkpointing.py).
        self._checkpoint_blocks(model)
        return sharding.shard_model(model, cfg, self.device, init_fn), shapes, total

    def _build_hf_model(self):
        """--hf-model: the Hugging Face model (LoRA-wrapped with --lora-rank) built on meta, each rank
        reading its rows from the checkpoint (see [Note: sharded Hugging Face load] in hf_model.py)."""
        cfg = self.cfg
        if cfg.ddp_backend != "fully_sharded":
            raise ValueError(f"[rank {self.rank}] --hf-model needs --ddp-backend fully_sharded")
        model, layers, reader = hf_model.load_meta(cfg)
        self.peft_model = model if cfg.lora_rank else None
        shapes = {n: p.shape for n, p in model.named_parameters()}
        total = sum(p.numel() for p in model.parameters())
        self.num_trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
        if cfg.checkpoint_activations:
            classes = tuple({type(b) for b in layers})
            apply_activation_checkpointing(model, check_fn=lambda m: isinstance(m, classes),
                                           offload_to_cpu=cfg.offload_activations)
        buffers = hf_model.buffers_of(model)  # fully_shard's to_empty loses their values
        quantize = None
        if getattr(cfg, "quantize_base", "none") == "nf4":  # QLoRA: train/qlora.py
            quantize = qlora.Quantizer(reader, self.world_size)
        wrapped = sharding.shard_model(model, cfg, self.device, reader, blocks=list(layers), prepare=quantize)
        hf_model.restore_buffers(buffers)
        return wrapped, shapes, total

    def _host_shards(self) -> bool:
        """The optimizer's shards live in host memory (CPU device or --cpu-offload)."""
        return self.device.type == "cpu" or self.cfg.cpu_offload

    def _checkpoint_blocks(self, model) -> None:
        """--checkpoint-activations / --offload-activations: wrap every TransformerBlock."""
        if not self.cfg.checkpoint_activations:
            return
        apply_activation_checkpointing(model, check_fn=lambda m: isinstance(m, TransformerBlock),
                                       offload_to_cpu=self.cfg.offload_activations)

    # ------------------------------------------------------------------ steps
    def _logits(self, inputs: torch.Tensor) -> torch.Tensor:
        """Model forward (B, T) -> (B, T, V); under autocast for c10d --fp16/--bf16."""
        if self.autocast_dtype is None:
            out = self.model(inputs)
        else:
            with torch.autocast(device_type=self.device.type, dtype=self.autocast_dtype):
                out = self.model(inputs)
        return getattr(out, "logits", out)  # --hf-model: a transformers ModelOutput

    def _loss(self, batch: Batch) -> Tuple[torch.Tensor, int]:
        """Summed token cross entropy (nats) of one micro-batch and its target-token count."""
        inputs, targets = (t.to(self.device, non_blocking=True) for t in batch)
        logits = self._logits(inputs)
        loss_sum = F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), targets.reshape(-1), reduction="sum")
        return loss_sum, targets.numel()

    @property
    def checkpoint_group(self):
        """The ranks a checkpoint spans when the model is in parts (pipeline stages: the world), else
        None (the model's own group)."""
        return self.pipeline.group if self.pipeline is not None else None

    def after_load(self) -> None:
        """After loading a checkpoint: the last stage's copy of the tied weight from the first's."""
        if self.pipeline is not None:
            self.pipeline.sync_tied_weight()

    def _clip(self) -> float:
        """Clip to --clip-norm (inf when 0, i.e. only measure); returns the pre-clip global norm."""
        max_norm = self.cfg.clip_norm if self.cfg.clip_norm > 0 else float("inf")
        if self.pipeline is not None:
            return self.pipeline.clip(max_norm)
        if self.cfg.ddp_backend == "c10d":
            norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm)
        else:
            norm = sharding.clip_grad_norm_(self.model, max_norm)
        return float(norm)

    def train_step(self, micro_batches: Sequence[Batch],
                   micro_batch_ids: Optional[Sequence[invariance.MicroBatchId]] = None) -> dict:
        """One optimizer update over K micro-batches; returns global stats of the update.

        Args:
            micro_batches: this rank's K (input (B, T), target (B, T)) int64 micro-batches.
            micro_batch_ids: --world-size-invariant only (ignored otherwise): each micro-batch's
                (epoch, global micro-batch index), as `fullshard.data.GlobalBatchSampler` yields
                them; K must be ``cfg.update_freq``. Under --pipeline-parallel-size, K x M ids: each
                pipeline micro-batch's, M per micro-batch (see [Note: world-size-invariant
                pipelining] in ``pipeline.py``).

        With --fp16 the loss is multiplied by the loss scale before backward and
        the gradient shards divided by it before clipping. When any rank finds
        inf/NaN the update is skipped on every rank, as fairseq does: no
        optimizer or lr-scheduler step, ``num_updates`` unchanged, the returned
        ``overflow`` is True and the scale is backed off.

        Raises:
            FloatingPointError: the loss scale fell to --min-loss-scale, or (fp32 / bf16)
                the loss is NaN or inf: names the update and the last finite loss.
            ValueError: --world-size-invariant with ``micro_batch_ids`` missing or not this
                rank's schedule (`invariance.check_schedule`).
        """
        start = time.perf_counter()
        self.model.train()
        k = len(micro_batches)
        invariant = self.cfg.world_size_invariant
        if invariant:
            per_update, m = self._check_ids(micro_batch_ids, k)
        local, rows = torch.zeros(3, dtype=torch.float64), []
        for j, batch in enumerate(micro_batches):
            if self.pipeline is not None:  # the M pipeline micro-batches of this one, through the schedule
                if j == 0:
                    faults.in_update(self.num_updates + 1)
                if invariant:
                    rows += self.pipeline.train_micro_batch(*batch, k, micro_batch_ids[j * m:(j + 1) * m])
                else:
                    local += torch.tensor(self.pipeline.train_micro_batch(*batch, k), dtype=torch.float64)
                continue
            # no_sync: keep unsharded gradients until the last micro-batch;
            # reduce_scatter: every backward reduce-scatters into the gradient shards.
            local_accumulate = j < k - 1 and self.cfg.accumulate_mode == "no_sync"
            with sharding.no_sync(self.model) if local_accumulate else contextlib.nullcontext():
                if invariant:
                    invariance.seed_micro_batch(self.cfg.seed, micro_batch_ids[j])
                loss_sum, ntokens = self._loss(batch)
                self._sample_memory()  # gathered units (SHARD_GRAD_OP, the root)
                if j == 0:
                    faults.in_update(self.num_updates + 1)
                loss_sum = faults.poison_loss(loss_sum, self.num_updates + 1)
                # Invariant: the global token count, the same division at every world size.
                share = loss_sum / (ntokens * per_update) if invariant else loss_sum / (ntokens * k)
                self.scaler.scale(share).backward()
                self._sample_memory()  # no_sync stashes; anything a backward left behind
            row = [loss_sum.item(), ntokens, batch[0].size(0)]
            if invariant:
                rows.append(row)
            else:
                local += torch.tensor(row, dtype=torch.float64)
        if invariant and self.pipeline is not None:
            loss_sum, ntokens, nsentences = self.pipeline.ordered_sums(torch.tensor(rows, dtype=torch.float64))
        elif invariant:
            gathered = invariance.gather_rows(torch.tensor(rows, dtype=torch.float64), self.device)
            loss_sum, ntokens, nsentences = invariance.sum_interleaved(gathered)
        else:
            total = local.to(self.device)
            collectives.all_reduce(total, collectives.world_group(), "sum", tag="training loss")
            loss_sum, ntokens, nsentences = total.tolist()
        self._check_finite(loss_sum / max(ntokens, 1) / math.log(2))
        if self.pipeline is not None:
            self.pipeline.tie_gradients()
        self.scaler.unscale_(self.optimizer)
        # OffloadAdamW (--cpu-offload --optimizer cpu_adam) clips inside its step, by the same norm.
        overlapped = isinstance(self.optimizer, OffloadAdamW)
        gnorm = None if overlapped else self._clip()
        self.scaler.step(self.optimizer)
        if overlapped:
            gnorm = float(self.optimizer.grad_norm)
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        if self.pipeline is not None:
            self.pipeline.sync_tied_weight()
            self.model.zero_grad(set_to_none=True)  # the tied copy's gradient too
        overflow = self.scaler.last_step_skipped
        if overflow:
            logger.info(f"NOTE: gradient overflow detected, ignoring gradient, setting loss scale to: "
                        f"{self.scaler.get_scale()}")
        else:
            self.lr_scheduler.step()
            self.num_updates += 1
            self.last_finite = (self.num_updates, loss_sum / max(ntokens, 1) / math.log(2))
        return dict(loss_sum=loss_sum, ntokens=int(ntokens), nsentences=int(nsentences), gnorm=gnorm,
                    seconds=time.perf_counter() - start, overflow=overflow, loss_scale=self.scaler.get_scale())

    def _check_ids(self, ids, k: int) -> Tuple[int, int]:
        """--world-size-invariant: check ``ids`` against this rank's schedule; returns (global
        micro-batches per update, ids per micro-batch: M under pipelining, else 1).

        Raises:
            ValueError: ids missing, not this rank's schedule, or not ``m`` per micro-batch.
        """
        if self.pipeline is not None:  # data-parallel rank and size; a global micro-batch per pipeline one
            (rank, world), m = pipeline.data_parallel(self.cfg), self.pipeline.microbatches
        else:
            rank, world, m = self.rank, self.world_size, 1
        per_update = self.cfg.update_freq * world * m
        invariance.check_schedule(ids or [], rank, world, per_update)
        if k * m != len(ids):
            raise ValueError(f"[rank {self.rank}] --world-size-invariant: {k} micro-batches for {len(ids)} "
                             f"micro-batch ids; pass {m} id(s) per micro-batch")
        return per_update, m

    def _check_finite(self, loss: float) -> None:
        """fp32 / bf16: stop on a NaN or inf loss (fp16: the loss scaler skips such updates)."""
        if self.cfg.fp16 or math.isfinite(loss):
            return
        update = self.num_updates + 1
        last = (f"last finite loss {self.last_finite[1]:.3f} at update {self.last_finite[0]}"
                if self.last_finite else "no finite loss yet in this run")
        raise FloatingPointError(
            f"[rank {self.rank}] loss is {loss} at update {update} ({last}); the model was not updated: "
            "lower --lr, set --clip-norm, or try --fp16 (its loss scaler skips such updates), then resume "
            "from the last checkpoint")

    @torch.no_grad()
    def valid_step(self, batches: List[tuple]) -> dict:
        """Summed loss over this rank's (input, target, counted) valid batches, then over ranks.

        Every rank runs the same number of forwards (FSDP's all-gathers need all
        ranks); sequences with counted=False (wrap-around padding) add nothing.
        --world-size-invariant: the per-sequence sums are gathered and added in global sequence
        order, which takes batch b of rank r as global batch b * world + r (`loop.valid_batches`).
        """
        self.model.eval()
        local, rows = torch.zeros(3, dtype=torch.float64), []
        for inputs, targets, counted in batches:
            if self.pipeline is not None and self.cfg.world_size_invariant:
                rows.append(self.pipeline.valid_batch(inputs, targets, counted))
                continue
            if self.pipeline is not None:
                local += torch.tensor(self.pipeline.valid_batch(inputs, targets, counted), dtype=torch.float64)
                continue
            logits = self._logits(inputs.to(self.device))
            per_token = F.cross_entropy(logits.transpose(1, 2).float(), targets.to(self.device), reduction="none")
            per_seq = per_token.sum(dim=1).cpu().double()
            mask = counted.double()
            if self.cfg.world_size_invariant:
                rows.append(torch.stack([per_seq * mask, mask * targets.size(1), mask], dim=1))
            else:
                local += torch.stack([(per_seq * mask).sum(), mask.sum() * targets.size(1), mask.sum()])
        if self.cfg.world_size_invariant and batches:
            block = batches[0][0].size(0)
            if self.pipeline is not None:
                loss_sum, ntokens, nsentences = self.pipeline.ordered_sums(torch.cat(rows), block)
            else:
                gathered = invariance.gather_rows(torch.cat(rows), self.device)
                loss_sum, ntokens, nsentences = invariance.sum_interleaved(gathered, block=block)
            return dict(loss_sum=loss_sum, ntokens=int(ntokens), nsentences=int(nsentences), steps=len(batches))
        total = local.to(self.device)
        collectives.all_reduce(total, collectives.world_group(), "sum", tag="validation loss")
        loss_sum, ntokens, nsentences = total.tolist()
        return dict(loss_sum=loss_sum, ntokens=int(ntokens), nsentences=int(nsentences), steps=len(batches))

    def _sample_memory(self) -> None:
        if self.memory_peaks is not None:
            for key, value in memory_totals(memory_stats(self.model)).items():
                self.memory_peaks[key] = max(self.memory_peaks.get(key, 0), value)

    def memory_record(self) -> "OrderedDict[str, float]":
        """--log-memory fields of a train_inner line: each `fullshard.memory.memory_totals` field, the
        largest value sampled after a micro-batch's forward or backward since the last call, max over
        ranks (one all-reduce), in MiB with one decimal (``mem_<field>_mb``; ``mem_pending_rs``: a
        count). Every rank must call it; empty (no collective) without --log-memory or under c10d."""
        if self.memory_peaks is None:
            return OrderedDict()
        peaks = torch.tensor([self.memory_peaks.get(key, 0) for key in TOTAL_FIELDS], dtype=torch.int64,
                             device=self.device)
        collectives.all_reduce(peaks, collectives.world_group(), "max", tag="--log-memory statistics")
        self.memory_peaks = {}
        out = OrderedDict()
        for key, value in zip(TOTAL_FIELDS, peaks.tolist()):
            if key.endswith("_bytes"):
                out[f"mem_{key[:-len('_bytes')]}_mb"] = safe_round(value / 2**20, 1)
            else:  # pending_reduce_scatters
                out["mem_pending_rs"] = value
        return out

    def get_lr(self) -> float:
        return self.optimizer.param_groups[0]["lr"]
