"""`fullshard train --pipeline-parallel-size`: the pipelined trainer equals the same training without
pipelining (no weight staleness).

- pp=2 x dp=2, for GPipe, 1F1B, Interleaved1F1B (2 stages per rank) and the split-backward
  ZBVZeroBubble (V-shaped: the first rank holds the first and last stages) and InterleavedZeroBubble,
  in both gradient accumulation modes, and DualPipeV, equals one process training the plain tied GPT
  on the same global batch (per-update losses, gradient norms, every parameter, the validation loss);
- fullshard.pipelining.PipelineStage under torch's split-backward schedules (ZBVZeroBubble,
  DualPipeV; fully_shard and the FSDP1 wrapper, both modes): every unit's sharded gradient equals
  plain autograd's on the whole batch, none zero, reduce-scattered once per micro-batch or once;
- pp=2 x dp=1 equals dp=2 without pipelining;
- a checkpoint saved at pp=2 x dp=2 resumes at pp=1 x dp=4 (no pipelining) and at pp=2 x dp=1 (the
  2-rank group loads what the 4-rank group saved) and gives the uninterrupted run's parameters;
- --hybrid-shard: pp=2 x replicate 2 x shard 1 equals one process (the norm counts replicas once);
- --world-size-invariant: pp=2 x dp=2 and pp=2 x dp=1 give bitwise the same losses, gradient norms,
  validation loss and parameters (dropout, --update-freq > 1, both accumulation modes);
- the trainer's other flags at pp=2 x dp=2 equal the same flags without pipelining: --bf16, --fp16 (an
  overflow on one rank of the first stage skips the update on every stage), --checkpoint-activations
  and --cpu-offload (FLAG_CASES); --optimizer muon (each stage's block matrices, per stage over its
  data-parallel group) follows dp=4's muon;
- --finetune-from-model (a checkpoint directory, a consolidated file) at pp=2 x dp=2 trains as at dp=4.
"""
from __future__ import annotations

import functools
import hashlib
import os
import tempfile

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from fullshard.construct import clean_name
from fullshard.core.torch_private import split_backward_problem
from fullshard.models import ARCHS
from fullshard.train.config import TrainConfig
from fullshard.train.pipeline_checks import SPLIT_BACKWARD
from tests.dist.common import ATOL, BF16_RTOL, RTOL, Tokens as SyntheticTokens  # as DDP parity (fp32, bf16)
from tests.dist.harness import run_ranks

ARCH = "transformer_lm_gpt_mini"
VOCAB, T, LAYERS = 97, 8, 4
GLOBAL = 8  # sequences per update over all data-parallel ranks
UPDATES = 3
# ZBVZeroBubble, InterleavedZeroBubble: split backward (fullshard.pipelining [Note: split backward of fullshard units]).
SPLIT_OK = not split_backward_problem()
"""Whether this torch splits the backward of fullshard units right (2.13 and newer; refused before)."""
SCHEDULES = tuple(s for s in (("GPipe", 1), ("1F1B", 1), ("Interleaved1F1B", 2), ("ZBVZeroBubble", 2),
                              ("InterleavedZeroBubble", 2)) if SPLIT_OK or s[0] not in SPLIT_BACKWARD)
MODES = ("reduce_scatter", "unsharded")
HYBRID_CASES = (("1F1B", "reduce_scatter"), ("GPipe", "unsharded"))
FSDP1_CASES = (("1F1B", 1, "unsharded"), ("GPipe", 1, "reduce_scatter"))  # --fsdp-version 1


def _cfg(dp: int, **over) -> TrainConfig:
    base = dict(data_dir="unused", arch=ARCH, decoder_layers=LAYERS, max_positions=ARCHS[ARCH].max_positions,
                vocab_size=VOCAB, tokens_per_sample=T, batch_size=GLOBAL // dp, lr=3e-3, weight_decay=0.01,
                clip_norm=0.05, seed=3, fsdp_version=2, fp16_scale_window=4)
    return TrainConfig(**{**base, **over})


def _global_batch(update: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + update)
    return torch.randint(0, VOCAB, (GLOBAL, T + 1), generator=g)


def _rank_batch(update: int, dp_rank: int, dp: int) -> list:
    rows = _global_batch(update).chunk(dp)[dp_rank]
    return [(rows[:, :-1].contiguous(), rows[:, 1:].contiguous())]


def _full_params(model) -> dict:
    """Every parameter this rank's part holds, whole (an all-gather over its data-parallel group)."""
    from fullshard import FullyShardedDataParallel

    if any(isinstance(m, FullyShardedDataParallel) for m in model.modules()):  # --fsdp-version 1
        with FullyShardedDataParallel.summon_full_params(model, writeback=False):
            return {clean_name(n): p.detach().numpy().copy() for n, p in model.named_parameters()}
    out = {}
    for name, p in model.named_parameters():
        full = p.full_tensor() if hasattr(p, "full_tensor") else p
        out[clean_name(name)] = full.detach().numpy().copy()
    return out


def _train(cfg, rank, world, updates, start=0, trainer=None):
    from fullshard.core import collectives
    from fullshard.train.trainer import Trainer

    trainer = trainer or Trainer(cfg, torch.device("cpu"))
    dp = world // cfg.pipeline_parallel_size
    history = []
    for update in range(start, start + updates):
        collectives.reset_counts()
        out = trainer.train_step(_rank_batch(update, rank % dp, dp))
        history.append((out["loss_sum"] / out["ntokens"], out["gnorm"]))
    trainer.reduce_scatters = collectives.COUNTS["reduce_scatter"]  # in the last update
    return trainer, history


def _valid_loss(trainer, rank, world) -> float:
    """The trained model's mean token loss on a batch of its own (update UPDATES's), through valid_step."""
    dp = world // trainer.cfg.pipeline_parallel_size
    x, y = _rank_batch(UPDATES, rank % dp, dp)[0]
    out = trainer.valid_step([(x, y, torch.ones(len(x), dtype=torch.bool))])
    return out["loss_sum"] / out["ntokens"]


def _reference(updates: int) -> dict:
    """One process, the plain tied GPT, the whole global batch, AdamW and clipping as the trainer's."""
    from fullshard.models import build_model

    cfg = _cfg(1)
    model = build_model(cfg.arch_spec(), vocab_size=VOCAB, max_positions=cfg.max_positions, seed=cfg.seed)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                             {"params": rest, "weight_decay": 0.0}], lr=cfg.lr)
    history = []
    for update in range(updates):
        tok = _global_batch(update)
        logits = model(tok[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, VOCAB), tok[:, 1:].reshape(-1))
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.clip_norm)
        opt.step()
        opt.zero_grad()
        history.append((loss.item(), norm.item()))
    params = {n: p.detach().numpy().copy() for n, p in model.state_dict().items()}
    with torch.no_grad():
        tok = _global_batch(updates)
        valid = F.cross_entropy(model(tok[:, :-1]).reshape(-1, VOCAB), tok[:, 1:].reshape(-1)).item()
    return dict(history=history, params=params, valid=valid)


# --world-size-invariant: 8 sequences per update in pipeline micro-batches of one sequence
# (--batch-size 2, M = 2): 4 micro-batches per rank at dp=1, 2 at dp=2.
INVARIANT_CASES = {"1F1B reduce_scatter": dict(pipeline_schedule="1F1B"),
                   "Interleaved1F1B unsharded, activation checkpointing": dict(
                       pipeline_schedule="Interleaved1F1B", pipeline_stages_per_rank=2,
                       pipeline_grad_accumulation="unsharded", checkpoint_activations=True)}
INVARIANT_ITEMS = 3 * GLOBAL + 3  # 3 updates; the incomplete 4th is dropped


def _Tokens(n: int, seed: int):
    return SyntheticTokens(n, seed, VOCAB, T)


def _invariant_runs(dp: int) -> dict:
    """Each INVARIANT_CASES run through the loop's sampler at pp=2 x dp: per-update (loss, norm,
    tokens) reprs, the validation sum, and a digest of this rank's full parameters."""
    from fullshard.train.loop import collate, epoch_updates, update_ids, valid_batches
    from fullshard.train.trainer import Trainer

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # kernels' sums depend on the thread count: fixed at every dp
    out = {}
    try:
        for name, over in INVARIANT_CASES.items():
            cfg = _cfg(dp, batch_size=2, global_batch_size=GLOBAL, world_size_invariant=True, dropout=0.1,
                       pipeline_parallel_size=2, pipeline_microbatches=2, **over).at_world_size(dp)
            train, valid = _Tokens(INVARIANT_ITEMS, seed=11), _Tokens(7, seed=12)
            trainer = Trainer(cfg, torch.device("cpu"))
            history = []
            for group in epoch_updates(cfg, train, epoch=1):
                step = trainer.train_step([collate(train, idx) for _, idx in group], update_ids(group))
                history.append((repr(step["loss_sum"]), repr(step["gnorm"]), step["ntokens"]))
            val = trainer.valid_step(valid_batches(cfg, valid))
            digest = hashlib.sha256()
            for name_, value in sorted(_full_params(trainer.model).items()):
                digest.update(name_.encode() + value.tobytes())
            out[name] = dict(history=history, valid=(repr(val["loss_sum"]), val["ntokens"]),
                             params=digest.hexdigest())
    finally:
        torch.set_num_threads(threads)
    return out


# The trainer's other flags at pp=2 x dp=2: name -> (pipeline flags, the flags of the same run at
# pp=1 x dp=4; None: one process in fp32 is the reference). --fp16 starts at a scale that does not
# overflow; the test makes rank 0's gradient shard inf in update 2 (POISONED).
_PIPE = dict(pipeline_parallel_size=2, pipeline_microbatches=2)
FLAG_CASES = {
    "bf16 Interleaved1F1B reduce_scatter": (dict(bf16=True, pipeline_schedule="Interleaved1F1B",
                                                 pipeline_stages_per_rank=2, **_PIPE), dict(bf16=True)),
    "fp16 1F1B unsharded": (dict(fp16=True, pipeline_schedule="1F1B", pipeline_grad_accumulation="unsharded",
                                 **_PIPE), dict(fp16=True)),
    "fp16 --fsdp-version 1 GPipe reduce_scatter": (dict(fp16=True, fsdp_version=1, pipeline_schedule="GPipe", **_PIPE),
                                                   dict(fp16=True, fsdp_version=1)),
    "checkpoint_activations Interleaved1F1B unsharded": (dict(
        checkpoint_activations=True, pipeline_schedule="Interleaved1F1B", pipeline_stages_per_rank=2,
        pipeline_grad_accumulation="unsharded", **_PIPE), None),
    # Checkpointed blocks under a split backward (an input and a weight pass over one graph).
    "checkpoint_activations ZBVZeroBubble reduce_scatter": (dict(
        checkpoint_activations=True, pipeline_schedule="ZBVZeroBubble", pipeline_stages_per_rank=2, **_PIPE), None),
    "cpu_offload GPipe unsharded": (dict(cpu_offload=True, pipeline_schedule="GPipe",
                                         pipeline_grad_accumulation="unsharded", **_PIPE), None),
    "--fsdp-version 1 cpu_offload checkpoint_activations 1F1B": (dict(
        fsdp_version=1, cpu_offload=True, checkpoint_activations=True, pipeline_schedule="1F1B", **_PIPE), None),
    # Muon orthogonalizes each block matrix whole: per stage, over the stage's data-parallel group.
    "muon Interleaved1F1B unsharded": (dict(optimizer="muon", pipeline_schedule="Interleaved1F1B",
                                            pipeline_stages_per_rank=2, pipeline_grad_accumulation="unsharded",
                                            **_PIPE), dict(optimizer="muon")),
    "muon --fsdp-version 1 GPipe reduce_scatter": (dict(optimizer="muon", fsdp_version=1, pipeline_schedule="GPipe",
                                                        **_PIPE), dict(optimizer="muon", fsdp_version=1)),
}
if not SPLIT_OK:
    FLAG_CASES = {k: v for k, v in FLAG_CASES.items() if v[0]["pipeline_schedule"] not in SPLIT_BACKWARD}
FP16_INIT_SCALE = 2.0 ** 14
FP16_RTOL = 1e-3  # fp16 rounding (unit roundoff 4.9e-4) differs with the batch split
POISONED = 2  # the update whose gradient rank 0 makes inf under --fp16
MUON_TOL = 1e-3  # Newton-Schulz runs in bfloat16 (torch.optim.Muon's): one rounding flip moves an update


def _poison_rank0(trainer, rank: int) -> None:
    """Under --fp16, make one element of rank 0's first non-empty local gradient shard inf just before
    the scaler's check in the POISONED-th update: only rank 0 (first stage) sees it."""
    calls, unscale_ = [0], trainer.scaler.unscale_

    def poisoned(optimizer):
        calls[0] += 1
        if rank == 0 and calls[0] == POISONED:
            grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
            local = next(g for g in (g.to_local() if hasattr(g, "to_local") else g for g in grads) if g.numel())
            local.view(-1)[0] = float("inf")
        return unscale_(optimizer)

    trainer.scaler.unscale_ = poisoned


def _optimizer_groups(trainer) -> dict:
    """{plain parameter name: how this rank's optimizer steps it} ("muon", or AdamW and its weight decay)."""
    stepped = trainer.pipeline.optim_model if trainer.pipeline is not None else trainer.model
    names = {id(p): clean_name(n) for n, p in stepped.named_parameters()}
    return {names[id(p)]: "muon" if g.get("use_muon") else f"adamw {g['weight_decay']}"
            for g in trainer.optimizer.param_groups for p in g["params"]}


def _flag_runs(rank, world) -> dict:
    """FLAG_CASES: each pipelined run and its reference without pipelining (when not one process):
    per-update (loss, norm), overflow flags, the final loss scale and update count, the parameters."""
    from fullshard.train.trainer import Trainer

    def run(cfg):
        trainer = Trainer(cfg, torch.device("cpu"))
        if cfg.fp16:
            _poison_rank0(trainer, rank)
        _, history = _train(cfg, rank, world, UPDATES, trainer=trainer)
        return dict(history=history, overflow=[h[1] == float("inf") for h in history],
                    params=_full_params(trainer.model), scale=trainer.scaler.get_scale(), updates=trainer.num_updates,
                    groups=_optimizer_groups(trainer))

    out = {}
    for name, (piped, plain) in FLAG_CASES.items():
        out[name] = dict(pp=run(_cfg(2, fp16_init_scale=FP16_INIT_SCALE, **piped)),
                         plain=None if plain is None else run(_cfg(4, fp16_init_scale=FP16_INIT_SCALE, **plain)))
    return out


def _pipelined_cases(rank, world, tmp):
    """pp=2 x dp=2: every schedule and mode; then the resume at pp=1 x dp=4; the invariant runs; the
    trainer's other flags."""
    out = {"invariant": _invariant_runs(2), "flags": _flag_runs(rank, world)}
    for schedule, v in SCHEDULES:
        for mode in MODES:
            cfg = _cfg(2, pipeline_parallel_size=2, pipeline_schedule=schedule, pipeline_stages_per_rank=v,
                       pipeline_microbatches=2, pipeline_grad_accumulation=mode)
            trainer, history = _train(cfg, rank, world, UPDATES)
            out[(schedule, mode)] = dict(history=history, params=_full_params(trainer.model),
                                         reduce_scatters=trainer.reduce_scatters,
                                         valid=_valid_loss(trainer, rank, world))
    if SPLIT_OK:  # DualPipeV needs a micro-batch per stage (M = 4 of one sequence).
        cfg = _cfg(2, pipeline_parallel_size=2, pipeline_schedule="DualPipeV", pipeline_stages_per_rank=2,
                   pipeline_microbatches=4, pipeline_grad_accumulation="unsharded")
        trainer, history = _train(cfg, rank, world, UPDATES)
        out["DualPipeV"] = dict(history=history, params=_full_params(trainer.model),
                                valid=_valid_loss(trainer, rank, world))
    out["split_backward"] = _split_backward_cases()
    out["reference"] = _reference(UPDATES) if rank == 0 else None
    for schedule, v, mode in FSDP1_CASES:
        cfg = _cfg(2, pipeline_parallel_size=2, pipeline_schedule=schedule, pipeline_stages_per_rank=v,
                   pipeline_microbatches=2, pipeline_grad_accumulation=mode, fsdp_version=1)
        trainer, history = _train(cfg, rank, world, UPDATES)
        out[("fsdp1", schedule, mode)] = dict(history=history, params=_full_params(trainer.model))
    # --hybrid-shard: shard groups of gcd(D, LOCAL_WORLD_SIZE) = 1 rank, 2 replicas.
    os.environ["LOCAL_WORLD_SIZE"] = "1"
    try:
        for schedule, mode in HYBRID_CASES:
            cfg = _cfg(2, pipeline_parallel_size=2, pipeline_schedule=schedule, pipeline_microbatches=2,
                       pipeline_grad_accumulation=mode, hybrid_shard=True)
            trainer, history = _train(cfg, rank, world, UPDATES)
            out[("hybrid", schedule, mode)] = dict(history=history, params=_full_params(trainer.model))
    finally:
        os.environ["LOCAL_WORLD_SIZE"] = str(world)
    # Resume: 2 updates at pp=2 x dp=2, save, then the third at pp=1 x dp=4.
    from fullshard import checkpoint
    from fullshard.train.trainer import Trainer

    cfg = _cfg(2, pipeline_parallel_size=2, pipeline_schedule="1F1B", pipeline_microbatches=2)
    trainer, first = _train(cfg, rank, world, UPDATES - 1)
    path = os.path.join(tmp, "ckpt")
    checkpoint.save(path, trainer.model, trainer.optimizer, process_group=trainer.checkpoint_group)
    plain = Trainer(_cfg(4), torch.device("cpu"))
    checkpoint.load(path, plain.model, plain.optimizer)
    plain.num_updates = UPDATES - 1
    _, last = _train(_cfg(4), rank, world, 1, start=UPDATES - 1, trainer=plain)
    out["resumed"] = dict(history=first + last, params=_full_params(plain.model))
    # --fsdp-version 1 stages save the same checkpoint: resumed at pp=2 x dp=2 under fully_shard.
    cfg1 = _cfg(2, pipeline_parallel_size=2, pipeline_schedule="1F1B", pipeline_microbatches=2, fsdp_version=1)
    trainer, first = _train(cfg1, rank, world, UPDATES - 1)
    path = os.path.join(tmp, "ckpt_fsdp1")
    checkpoint.save(path, trainer.model, trainer.optimizer, process_group=trainer.checkpoint_group)
    again = Trainer(cfg, torch.device("cpu"))
    checkpoint.load(path, again.model, again.optimizer, process_group=again.checkpoint_group)
    again.after_load()
    again.num_updates = UPDATES - 1
    _, last = _train(cfg, rank, world, 1, start=UPDATES - 1, trainer=again)
    out["resumed_fsdp1"] = dict(history=first + last, params=_full_params(again.model))
    out["finetune"] = _finetune_runs(rank, world, tmp, os.path.join(tmp, "ckpt"))
    return out


# --finetune-from-model under pipelining: (source, pipeline flags); each fine-tunes one update and
# is compared with the same source fine-tuned at pp=1 x dp=4.
FINETUNE_CASES = {"checkpoint directory, 1F1B": ("dir", dict(pipeline_schedule="1F1B", **_PIPE)),
                  "consolidated file, --fsdp-version 1 GPipe": ("file", dict(pipeline_schedule="GPipe", fsdp_version=1,
                                                                                 **_PIPE))}


def _finetune_runs(rank, world, tmp, saved) -> dict:
    """Each FINETUNE_CASES source loaded through the trainer's --finetune-from-model path at pp=2 x
    dp=2 and at pp=1 x dp=4, then one update: per-update (loss, norm) and the parameters. The file is
    a plain GPT's state dict (another seed than the runs', both names of the tied weight)."""
    from types import SimpleNamespace

    from fullshard.models import build_model
    from fullshard.train import checkpoint_utils
    from fullshard.train.trainer import Trainer

    plain_cfg = _cfg(1)
    file = os.path.join(tmp, f"finetune_{rank}.pt")  # one per rank: no rank waits for another's write
    torch.save(build_model(plain_cfg.arch_spec(), vocab_size=VOCAB, max_positions=plain_cfg.max_positions,
                           seed=5).state_dict(), file)
    out = {}
    for name, (source, over) in FINETUNE_CASES.items():
        src = saved if source == "dir" else file
        common = dict(finetune_from_model=src, save_dir=os.path.join(tmp, "finetune_nothing_to_resume"))
        for label, cfg in (("pp", _cfg(2, **over, **common)), ("plain", _cfg(4, **common))):
            trainer = Trainer(cfg, torch.device("cpu"))
            assert checkpoint_utils.load(SimpleNamespace(cfg=cfg, trainer=trainer)) == (1, 0)
            _, history = _train(cfg, rank, world, 1, trainer=trainer)
            out[(name, label)] = dict(history=history, params=_full_params(trainer.model))
    return out


def _merge(per_rank: list, key) -> dict:
    merged = {}
    for out in per_rank:
        merged.update(out[key]["params"])
    return merged


def _assert_close(got_history, got_params, want, where, rtol=RTOL, atol=ATOL):
    want_params = dict(want["params"])  # named_parameters() of a tied model: the tie under its first name
    want_params.setdefault("output_projection.weight", want_params["embed_tokens.weight"])
    got_params = dict(got_params)
    got_params.setdefault("output_projection.weight", got_params["embed_tokens.weight"])
    np.testing.assert_allclose(np.array(got_history), np.array(want["history"]), rtol=rtol, atol=atol,
                               err_msg=f"{where}: losses / gradient norms")
    assert sorted(got_params) == sorted(want_params), where
    for name, value in want_params.items():
        np.testing.assert_allclose(got_params[name], value, rtol=rtol, atol=atol, err_msg=f"{where}: {name}")


@functools.lru_cache(maxsize=None)
def _checkpoints() -> tempfile.TemporaryDirectory:
    """The session's checkpoint directory: the 4-rank group saves there, the 2-rank group loads."""
    return tempfile.TemporaryDirectory()


@functools.lru_cache(maxsize=None)
def _spawned(world: int) -> list:
    """Each spawned group's results, once per session (the tests below share them). The 2-rank
    group resumes the 4-rank group's pp=2 x dp=2 checkpoint, so that group runs first."""
    tmp = _checkpoints().name
    if world == 2:
        _spawned(4)
        return run_ranks(_pp2_dp1_cases, 2, os.path.join(tmp, "ckpt"))
    return run_ranks(_pipelined_cases, 4, tmp)


def test_pp2_dp2_equals_one_process_and_resumes_without_pipelining():
    per_rank = _spawned(4)
    want = per_rank[0]["reference"]
    for schedule, _ in SCHEDULES:
        for mode in MODES:
            key = (schedule, mode)
            _assert_close(per_rank[0][key]["history"], _merge(per_rank, key), want, f"pp=2 x dp=2 {schedule} {mode}")
            # validation (a forward-only run of the schedule; V-shaped ones: core.torch_private)
            for out in per_rank:
                np.testing.assert_allclose(out[key]["valid"], want["valid"], rtol=RTOL, atol=ATOL, err_msg=str(key))
        # reduce_scatter: each unit reduce-scatters once per pipeline micro-batch (2); unsharded: once.
        for out in per_rank:
            every = out[(schedule, "reduce_scatter")]["reduce_scatters"]
            once = out[(schedule, "unsharded")]["reduce_scatters"]
            assert once > 0 and every == 2 * once, (schedule, every, once)
    _assert_close(per_rank[0]["resumed"]["history"], per_rank[0]["resumed"]["params"], want,
                  "saved at pp=2 x dp=2, resumed at pp=1 x dp=4")
    _assert_close(per_rank[0]["resumed_fsdp1"]["history"], _merge(per_rank, "resumed_fsdp1"), want,
                  "saved at pp=2 x dp=2 --fsdp-version 1, resumed at pp=2 x dp=2 --fsdp-version 2")
    if SPLIT_OK:
        _assert_close(per_rank[0]["DualPipeV"]["history"], _merge(per_rank, "DualPipeV"), want,
                      "pp=2 x dp=2 DualPipeV unsharded")
        for out in per_rank:
            np.testing.assert_allclose(out["DualPipeV"]["valid"], want["valid"], rtol=RTOL, atol=ATOL)
    for schedule, _, mode in FSDP1_CASES:
        key = ("fsdp1", schedule, mode)
        _assert_close(per_rank[0][key]["history"], _merge(per_rank, key), want,
                      f"pp=2 x dp=2 --fsdp-version 1 {schedule} {mode}")
    for schedule, mode in HYBRID_CASES:
        key = ("hybrid", schedule, mode)
        _assert_close(per_rank[0][key]["history"], _merge(per_rank, key), want,
                      f"pp=2 x replicate 2 x shard 1 (--hybrid-shard) {schedule} {mode}")


# fullshard.pipelining.PipelineStage driven by torch's split-backward schedules directly:
# (schedule, grad_accumulation, FSDP1 wrapper instead of fully_shard).
SPLIT_CASES = (("ZBVZeroBubble", "reduce_scatter", False), ("ZBVZeroBubble", "unsharded", False),
               ("ZBVZeroBubble", "unsharded", True), ("DualPipeV", "reduce_scatter", True)) if SPLIT_OK else ()
SPLIT_WIDTH, SPLIT_STAGES, SPLIT_MICROBATCHES = 8, 4, 4


def _split_block() -> torch.nn.Module:
    nn = torch.nn
    return nn.Sequential(nn.Linear(SPLIT_WIDTH, SPLIT_WIDTH), nn.LayerNorm(SPLIT_WIDTH), nn.Tanh())


def _split_backward_cases() -> dict:
    """pp=2 x dp=2, 4 stages of Linear-LayerNorm-Tanh placed in a V (rank p: stages p, 3 - p), each
    sharded over its data-parallel group (fully_shard: the Linear a unit, then the stage; or one
    FullyShardedDataParallel wrapper), one schedule step of 4 micro-batches on this data-parallel
    rank's half of 16 rows (summed squared error). Returns, per SPLIT_CASES entry, the largest
    |gradient x 2 - plain autograd's gradient of the whole batch| (reduce-scatter averages over 2
    ranks), the smallest per-parameter gradient sum of |.|, and the step's reduce-scatters."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.pipelining import schedules

    from fullshard import FullyShardedDataParallel, fully_shard
    from fullshard.core import collectives
    from fullshard.pipelining import PipelineStage

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    pp, dp = mesh.get_local_rank("pp"), mesh.get_local_rank("dp")
    g = torch.Generator().manual_seed(5)
    x, y = torch.randn(16, SPLIT_WIDTH, generator=g), torch.randn(16, SPLIT_WIDTH, generator=g)
    torch.manual_seed(0)
    reference = torch.nn.Sequential(*[_split_block() for _ in range(SPLIT_STAGES)])
    ((reference(x) - y) ** 2).sum().backward()
    out = {}
    for schedule, mode, fsdp1 in SPLIT_CASES:
        ids, stages, modules = [pp, SPLIT_STAGES - 1 - pp], [], []
        for s in ids:
            module = _split_block()
            module.load_state_dict(reference[s].state_dict())
            if fsdp1:
                module = FullyShardedDataParallel(module, process_group=mesh.get_group("dp"))
            else:
                fully_shard(module[0], mesh=mesh["dp"])
                fully_shard(module, mesh=mesh["dp"])
            example = torch.zeros(16 // 2 // SPLIT_MICROBATCHES, SPLIT_WIDTH, requires_grad=True)
            stages.append(PipelineStage(module, s, SPLIT_STAGES, torch.device("cpu"), input_args=example,
                                        output_args=example, group=mesh.get_group("pp"), grad_accumulation=mode))
            modules.append((s, module))
        step = schedules.get_schedule_class(schedule)(stages, SPLIT_MICROBATCHES, scale_grads=False,
                                                       loss_fn=lambda out_, target: ((out_ - target) ** 2).sum())
        collectives.reset_counts()
        step.step(*((x.chunk(2)[dp],) if 0 in ids else ()),
                  **(dict(target=y.chunk(2)[dp], losses=[]) if SPLIT_STAGES - 1 in ids else {}))
        worst, least = 0.0, float("inf")
        for s, module in modules:
            if fsdp1:
                with FullyShardedDataParallel.summon_full_params(module, with_grads=True):
                    grads = {clean_name(n): p.grad.clone() for n, p in module.named_parameters()}
            else:
                grads = {n: p.grad.full_tensor() for n, p in module.named_parameters()}
            for name, p in reference[s].named_parameters():
                worst = max(worst, float((grads[name] * 2 - p.grad).abs().max()))
                least = min(least, float(grads[name].abs().sum()))
        out[(schedule, mode, fsdp1)] = dict(worst=worst, least=least,
                                            reduce_scatters=collectives.COUNTS["reduce_scatter"])
    return out


def test_split_backward_schedules_reduce_every_units_weight_gradients():
    """torch's zero-bubble schedules take weight gradients with torch.autograd.grad on the leaves
    the stage hands them; fullshard hands each unit's unsharded flat parameter and routes the
    gradient through its post-accumulate-grad hook: every unit's gradient equals plain autograd's,
    none is left zero, and each unit reduce-scatters once per micro-batch (reduce_scatter) or once
    per step (unsharded). Before, the split passes were refused."""
    if not SPLIT_OK:
        pytest.skip(split_backward_problem())
    per_rank = _spawned(4)
    for schedule, mode, fsdp1 in SPLIT_CASES:
        # Units per rank: fully_shard 2 per stage (the Linear, the stage), the wrapper 1; 2 stages.
        units = 2 if fsdp1 else 4
        for rank, out in enumerate(per_rank):
            got = out["split_backward"][(schedule, mode, fsdp1)]
            where = f"{schedule} {mode} {'FSDP1' if fsdp1 else 'fully_shard'} rank {rank}"
            assert got["worst"] <= 1e-5, (where, got)
            assert got["least"] > 0, (where, got)
            want = units * (SPLIT_MICROBATCHES if mode == "reduce_scatter" else 1)
            assert got["reduce_scatters"] == want, (where, got["reduce_scatters"], want)


def test_precision_checkpointing_and_offload_under_pipelining_equal_the_run_without_it():
    per_rank = _spawned(4)
    for name, (piped, plain) in FLAG_CASES.items():
        runs = [out["flags"][name] for out in per_rank]
        got = runs[0]["pp"]
        if plain is None:  # fp32: one process on the same global batch
            _assert_close(got["history"], _merge([{name: r["pp"]} for r in runs], name), per_rank[0]["reference"],
                          f"pp=2 x dp=2 {name}")
            continue
        want = runs[0]["plain"]
        if piped.get("optimizer") == "muon":
            # Each stage steps its parameters as the whole model's optimizer does (Muon on every block
            # matrix, AdamW on the rest), and the run follows dp=4's within Newton-Schulz's bfloat16
            # rounding (the fp32 gradients differ in summation order; measured 1.7e-4 at most).
            kinds = {}
            for run in runs:
                kinds.update(run["pp"]["groups"])
            assert kinds == want["groups"], (name, kinds, want["groups"])
            _assert_close(got["history"], _merge([{name: r["pp"]} for r in runs], name), want,
                          f"pp=2 x dp=2 {name} vs dp=4", rtol=MUON_TOL, atol=MUON_TOL)
            continue
        if piped.get("bf16"):  # bf16 rounding differs with the batch split: losses and norms only
            np.testing.assert_allclose(np.array(got["history"]), np.array(want["history"]), rtol=BF16_RTOL, atol=1e-3,
                                       err_msg=f"pp=2 x dp=2 {name} vs dp=4: losses / gradient norms")
            continue
        # fp16: every rank of both runs skipped the poisoned update (one decision over all stages),
        # halved the scale once, and trained the same; without the world's decision the stages that
        # did not see the inf would have stepped.
        for r, run in enumerate(runs):
            for label in ("pp", "plain"):
                skipped = [u + 1 for u, o in enumerate(run[label]["overflow"]) if o]
                assert skipped == [POISONED], f"{name} {label} rank {r}: skipped updates {skipped}"
                assert run[label]["updates"] == UPDATES - 1 and run[label]["scale"] == FP16_INIT_SCALE / 2, \
                    (name, label, r, run[label]["updates"], run[label]["scale"])
        _assert_close(got["history"], _merge([{name: r["pp"]} for r in runs], name), want,
                      f"pp=2 x dp=2 {name} vs dp=4", rtol=FP16_RTOL, atol=FP16_RTOL)


def test_finetune_from_model_under_pipelining_equals_the_run_without_it():
    """--finetune-from-model at pp=2 x dp=2 (each stage loads its own layers from a checkpoint
    directory or a consolidated file) trains as at pp=1 x dp=4 from the same weights."""
    per_rank = _spawned(4)
    for name in FINETUNE_CASES:
        want = per_rank[0]["finetune"][(name, "plain")]
        got = _merge([{name: out["finetune"][(name, "pp")]} for out in per_rank], name)
        _assert_close(per_rank[0]["finetune"][(name, "pp")]["history"], got, want,
                      f"--finetune-from-model {name}: pp=2 x dp=2 vs dp=4")


def _pp2_dp1_cases(rank, world, saved):
    """pp=2 x dp=1: every schedule and mode against dp=2; the invariant runs; the third update
    resumed at pp=2 x dp=1 from ``saved``, the 4-rank group's checkpoint after 2 updates at pp=2 x dp=2."""
    from fullshard import checkpoint
    from fullshard.train.trainer import Trainer

    plain, dp_history = _train(_cfg(2), rank, world, UPDATES)
    out = {"dp2": dict(history=dp_history, params=_full_params(plain.model)), "invariant": _invariant_runs(1)}
    for schedule, v in SCHEDULES:
        for mode in MODES:
            cfg = _cfg(1, pipeline_parallel_size=2, pipeline_schedule=schedule, pipeline_stages_per_rank=v,
                       pipeline_microbatches=2, pipeline_grad_accumulation=mode)
            trainer, history = _train(cfg, rank, world, UPDATES)
            out[(schedule, mode)] = dict(history=history, params=_full_params(trainer.model))
    cfg = _cfg(1, pipeline_parallel_size=2, pipeline_schedule="1F1B", pipeline_microbatches=2)
    resumed = Trainer(cfg, torch.device("cpu"))
    checkpoint.load(saved, resumed.model, resumed.optimizer, process_group=resumed.checkpoint_group)
    resumed.after_load()
    resumed.num_updates = UPDATES - 1
    _, last = _train(cfg, rank, world, 1, start=UPDATES - 1, trainer=resumed)
    out["resumed"] = dict(history=last, params=_full_params(resumed.model))
    return out


def test_pp2_dp1_equals_dp2_without_pipelining_and_resumes_a_pp2_dp2_checkpoint():
    per_rank = _spawned(2)
    want = per_rank[0]["dp2"]
    for schedule, _ in SCHEDULES:
        for mode in MODES:
            key = (schedule, mode)
            _assert_close(per_rank[0][key]["history"], _merge(per_rank, key), want, f"pp=2 x dp=1 {schedule} {mode}")
    # The 4-rank group's first 2 updates at pp=2 x dp=2 (saved), then the third here at pp=2 x dp=1.
    saved = _spawned(4)[0]["resumed"]["history"][:UPDATES - 1]
    _assert_close(saved + per_rank[0]["resumed"]["history"], _merge(per_rank, "resumed"),
                  _spawned(4)[0]["reference"], "saved at pp=2 x dp=2, resumed at pp=2 x dp=1")


def test_world_size_invariant_pipeline_is_bitwise_the_same_at_dp_1_and_2():
    """pp=2: dp=1 (2 ranks) and dp=2 (4 ranks) give the same bits; pipeline rank p is world rank p at
    dp=1 and ranks 2p, 2p + 1 at dp=2."""
    one, two = _spawned(2), _spawned(4)
    for name in INVARIANT_CASES:
        for p in range(2):
            want = one[p]["invariant"][name]
            assert len(want["history"]) == 3 and want["history"][0][2] == GLOBAL * T, (name, want)
            for r in (2 * p, 2 * p + 1):
                assert two[r]["invariant"][name] == want, f"{name}: pipeline rank {p}, dp=2 rank {r} != dp=1"
