"""The trainer's checkpoints (fairseq's ``checkpoint_utils``): save every
``--save-interval-updates`` and at the end, keep the last N, resume from
``save_dir/checkpoint_last`` or ``--restore-file``, ``--reset-*`` and
``--finetune-from-model``.

One checkpoint is one :mod:`fullshard.checkpoint` directory (sharded model and
optimizer through torch.distributed.checkpoint) whose per-rank ``extra`` holds
the rest of the training state::

    {"train_state": {"epoch", "offset", "num_updates", "samples"},   # data position, updates
     "lr_scheduler", "loss_scaler", "rng": {torch, python, numpy, cuda},
     "meters": {...}, "args": {...}, "world_size": N,
     "tokenizer": "gpt2-bpe" | "hf:<name>:<digest>"}   # the training data's (meta.json)

``offset`` counts the updates already taken in ``epoch``; ``samples`` the
sequences taken in it over all ranks, which gives the position at another
world size (``samples // (batch_size * update_freq * world)``).
"""
from __future__ import annotations

import dataclasses
import logging
import os
import random
import re
import shutil
import time
from typing import Optional

import torch
from safetensors.torch import load_file
from torch.distributed.tensor import DTensor, distribute_tensor

from fullshard import checkpoint, faults
from fullshard.core import collectives
from fullshard.train import checkpoint_record, pipeline

logger = logging.getLogger("fullshard.train")
_INTERVAL = re.compile(r"^checkpoint_(\d+)_(\d+)$")


def rng_state() -> dict:
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    try:
        import numpy as np

        state["numpy"] = np.random.get_state()
    except ImportError:  # pragma: no cover
        pass
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "numpy" in state:
        import numpy as np

        np.random.set_state(state["numpy"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def _meters_state(meters) -> dict:
    # Seconds elapsed, not the start time: a resumed run's wps/ups divide the restored counts by the time they
    # took plus the time since the load (as fairseq's TimeMeter state does), not by this process's age.
    state = {k: v for k, v in vars(meters).items() if k != "start"}
    state["elapsed"] = time.perf_counter() - meters.start
    return state


def _restore_meters(meters, state: dict) -> None:
    state = dict(state)
    elapsed = state.pop("elapsed", 0.0)
    vars(meters).update(state)
    meters.start = time.perf_counter() - elapsed


def save(run, epoch: int, offset: int, end_of_epoch: bool) -> str:
    """Save ``checkpoint_last`` (and ``checkpoint_<epoch>_<updates>`` on an
    interval), prune old interval checkpoints; every rank calls it.

    Args:
        run: the loop's Run (trainer, cfg, meters).
        epoch, offset: data position after the last update (updates taken in ``epoch``).
        end_of_epoch: the epoch's last update was taken (resume starts the next epoch).
    Returns:
        The checkpoint_last path, or None when the save failed under ``--on-save-error continue``.
    Raises:
        CheckpointError: the save failed (previous checkpoint intact) under ``--on-save-error stop``.
    """
    cfg, trainer = run.cfg, run.trainer
    if end_of_epoch:
        epoch, offset = epoch + 1, 0
    dp = pipeline.data_parallel(cfg)[1]
    samples = offset * cfg.batch_size * cfg.update_freq * dp
    extra = dict(train_state=dict(epoch=epoch, offset=offset, samples=samples, num_updates=trainer.num_updates),
                 lr_scheduler=trainer.lr_scheduler.state_dict(), loss_scaler=trainer.scaler.state_dict(),
                 rng=rng_state(), meters=_meters_state(run.inner), epoch_meters=_meters_state(run.epoch_meters),
                 args=cfg.to_dict(),
                 world_size=collectives.world_size(), data_parallel_size=dp, tokenizer=run.train_data.tokenizer)
    last = os.path.join(cfg.save_dir, "checkpoint_last")
    n = trainer.num_updates
    try:
        seconds = checkpoint.save(last, trainer.model, trainer.optimizer, extra=extra, after_write=faults.on_save,
                                  process_group=trainer.checkpoint_group)
    except checkpoint.CheckpointError as e:
        if cfg.on_save_error == "stop":
            raise checkpoint.CheckpointError(f"{e}; stopped at update {n} (--on-save-error stop)") from None
        logger.error(f"{e}; continuing without this checkpoint (--on-save-error continue)")
        return None
    saved = [last]
    if cfg.save_interval_updates > 0 and n % cfg.save_interval_updates == 0:
        interval = os.path.join(cfg.save_dir, f"checkpoint_{epoch if not end_of_epoch else epoch - 1}_{n}")
        failed = _copy_interval(last, interval, cfg.keep_interval_updates) if collectives.rank() == 0 else None
        # Every rank acts on the copy's outcome alike (a disk that filled during it: one line, --on-save-error).
        failed = collectives.broadcast_object(failed, tag="interval checkpoint copy")
        if failed is None:
            saved.append(interval)
        elif cfg.on_save_error == "stop":
            raise checkpoint.CheckpointError(f"[rank {collectives.rank()}] {failed}; checkpoint_last was saved; "
                                             f"stopped at update {n} (--on-save-error stop)")
        else:
            logger.error(f"{failed}; checkpoint_last was saved; continuing (--on-save-error continue)")
    collectives.barrier()
    logger.info(f"saved checkpoint {', '.join(saved)} (epoch {epoch} @ {n} updates) "
                f"(writing took {seconds:.2f} seconds)")
    return last


def _copy_interval(last: str, interval: str, keep: int) -> Optional[str]:
    """Copy ``last`` to ``interval`` through ``<interval>.tmp`` (published by a rename), then keep the last
    ``keep`` interval checkpoints; None, or what failed (the ``.tmp`` removed, an older ``interval`` kept)."""
    try:
        shutil.rmtree(interval + ".tmp", ignore_errors=True)
        shutil.copytree(last, interval + ".tmp")
        shutil.rmtree(interval, ignore_errors=True)
        os.rename(interval + ".tmp", interval)
    except OSError as e:
        shutil.rmtree(interval + ".tmp", ignore_errors=True)
        # copytree collects each file's error as (source, destination, why) in a shutil.Error
        why = str(e.args[0][0][2]) if isinstance(e, shutil.Error) and e.args and e.args[0] else e.strerror or str(e)
        hint = "; free disk space" if "No space left" in why else ""
        return f"copying {last} to {interval} failed: {why}{hint}"
    try:
        _prune(os.path.dirname(interval), keep)
    except OSError as e:  # an older copy that cannot be removed (a busy NFS file) costs disk only
        logger.warning(f"could not remove an older interval checkpoint of {os.path.dirname(interval)}: {e}")
    return None


def _prune(save_dir: str, keep: int) -> None:
    if keep <= 0:  # fairseq's: -1 (and 0) keeps every interval checkpoint
        return
    found = sorted((int(m.group(2)), name) for name in os.listdir(save_dir)
                   if (m := _INTERVAL.match(name)) and os.path.isdir(os.path.join(save_dir, name)))
    for _, name in found[:max(0, len(found) - keep)]:
        shutil.rmtree(os.path.join(save_dir, name))


def load(run) -> tuple[int, int]:
    """Resume if a checkpoint exists (else fine-tune from --finetune-from-model);
    returns the data position ``(epoch, offset)`` to start from."""
    cfg, trainer = run.cfg, run.trainer
    path, own = checkpoint_record.resume_path(cfg.save_dir, cfg.restore_file, cfg.to_dict())
    if own:
        logger.info(f"resuming {path}, which an earlier start of this run wrote: --restore-file and --reset-* "
                    "took effect at that start (to start over from them, use another --save-dir)")
        cfg = dataclasses.replace(cfg, **{k: False for k in checkpoint_record.FIRST_START[1:]})
    if path is None:
        if cfg.finetune_from_model:
            start = time.perf_counter()
            load_weights(cfg.finetune_from_model, trainer.model, trainer.checkpoint_group)
            trainer.after_load()
            logger.info(f"loaded weights from {cfg.finetune_from_model} for fine-tuning "
                        f"({time.perf_counter() - start:.2f} seconds)")
        return 1, 0
    start = time.perf_counter()
    extra = checkpoint.load(path, trainer.model, None if cfg.reset_optimizer else trainer.optimizer,
                            process_group=trainer.checkpoint_group)
    saved_global = (extra.get("args") or {}).get("global_batch_size")
    if cfg.world_size_invariant and saved_global and saved_global != cfg.global_batch_size:
        raise ValueError(f"[rank {collectives.rank()}] --world-size-invariant: {path} was trained with "
                         f"{saved_global} sequences per update, this run takes {cfg.global_batch_size}; pass "
                         f"--global-batch-size {saved_global} to continue it")
    trainer.after_load()
    ts = extra["train_state"]
    if not cfg.reset_optimizer:
        trainer.num_updates = ts["num_updates"]
        trainer.scaler.load_state_dict(extra["loss_scaler"])
    # The schedule's own step count: the updates since it last started again (--reset-lr-scheduler at an
    # earlier start), which --reset-optimizer restarts with the update counter.
    steps = (extra.get("lr_scheduler") or {}).get("last_epoch", trainer.num_updates)
    _schedule_at(trainer, 0 if cfg.reset_lr_scheduler or cfg.reset_optimizer else steps)
    if not cfg.reset_meters:
        _restore_meters(run.inner, extra["meters"])
        _restore_meters(run.epoch_meters, extra.get("epoch_meters", {}))
    set_rng_state(extra["rng"])
    epoch, offset = 1, 0
    world = collectives.world_size()
    dp = pipeline.data_parallel(cfg)[1]
    if not cfg.reset_dataloader:
        # The position in sequences, in updates of this run's size (--batch-size, --update-freq,
        # --global-batch-size and the data-parallel size may all have changed since the save).
        epoch, per_update = ts["epoch"], cfg.batch_size * cfg.update_freq * dp
        offset, repeated = divmod(ts.get("samples", ts["offset"] * per_update), per_update)
        if repeated:
            logger.warning(f"the checkpoint is {repeated} sequences into an update of {per_update} sequences of "
                           f"this run: those sequences of epoch {epoch} are trained again")
    logger.info(f"loaded checkpoint {path} (epoch {epoch} offset {offset} @ {trainer.num_updates} updates, "
                f"saved by {extra['world_size']} ranks) ({time.perf_counter() - start:.2f} seconds)")
    if extra["world_size"] != world:  # e.g. an elastic job (--nnodes MIN:MAX) lost or gained a node
        saved_freq = (extra.get("args") or {}).get("update_freq", "?")
        logger.info(f"world size changed from {extra['world_size']} to {world}: resuming at update "
                    f"{trainer.num_updates} (epoch {epoch}, update {offset} of it) from {path}; "
                    f"update-freq {saved_freq} -> {cfg.update_freq}")
    return epoch, offset


def _schedule_at(trainer, steps: int) -> None:
    """Put the lr schedule of this run's flags at ``steps`` updates: a resumed run follows its own
    ``--lr``, ``--lr-scheduler``, ``--warmup-updates``, ``--max-update`` / ``--total-num-update`` (extending
    a finished run), not the saved run's, as fairseq does; only the update count comes from the
    checkpoint (the optimizer's saved ``lr`` is replaced)."""
    sched = trainer.lr_scheduler
    sched.last_epoch = steps
    for group, base, f in zip(sched.optimizer.param_groups, sched.base_lrs, sched.lr_lambdas):
        group["initial_lr"], group["lr"] = base, base * f(steps)


def load_weights(path: str, model, parts_group=None) -> Optional[dict]:
    """Full weights into ``model``: a consolidated ``.safetensors`` / ``.pt``
    file (plain state dict) or a fullshard checkpoint directory (model only).

    Args:
        parts_group: the group over which ``model`` is spread in parts (pipeline stages; the
            trainer's ``checkpoint_group``), or None: each rank loads its part's names, and the
            names of all parts together must be the file's / checkpoint's.
    Returns:
        The checkpoint directory's ``extra`` (None for a file).
    Raises:
        CheckpointError: a damaged checkpoint directory or one of another model.
        RuntimeError: a file whose names or shapes do not fit ``model``.
    """
    if os.path.isdir(path):
        return checkpoint.load(path, model, process_group=parts_group)
    if path.endswith(".safetensors"):
        sd = load_file(path)
    else:
        sd = torch.load(path, map_location="cpu", weights_only=True)
    target = model.module if isinstance(model, torch.nn.parallel.DistributedDataParallel) else model
    sd = _as_dtensors(sd, target)
    if parts_group is None:
        target.load_state_dict(sd)
        return None
    _load_part(path, target, sd, parts_group)
    return None


def _as_dtensors(sd: dict, model: torch.nn.Module) -> dict:
    """``sd`` with each full tensor that ``model`` holds as a DTensor (``fully_shard``: its state dict
    is DTensor shards, which a plain tensor cannot be copied into) replaced by this rank's rows of it,
    as a DTensor of the model's placements. No communication: every rank read the same file. A
    tensor of another shape is left as is, for ``load_state_dict`` to name the mismatch."""
    if not any(isinstance(p, DTensor) for p in model.parameters()):
        return sd  # no state_dict() call: FullyShardedDataParallel's FULL one would gather
    out = dict(sd)
    for key, held in model.state_dict().items():
        value = out.get(key)
        if isinstance(held, DTensor) and torch.is_tensor(value) and not isinstance(value, DTensor) \
                and value.shape == held.shape:
            out[key] = distribute_tensor(value.to(held.dtype), held.device_mesh, held.placements, src_data_rank=None)
    return out


def _load_part(path: str, part: torch.nn.Module, sd: dict, parts_group) -> None:
    """A whole model's state dict ``sd`` into this rank's ``part``: every part's names must be in
    it, and each of its names must belong to some rank's part (one all-gather, so every rank of the
    group raises together)."""
    result = part.load_state_dict(sd, strict=False)
    everyone = collectives.all_gather_object((sorted(result.missing_keys), sorted(result.unexpected_keys)),
                                             parts_group, tag="fine-tuning names")
    missing = sorted({k for keys, _ in everyone for k in keys})
    unknown = sorted(set.intersection(*(set(keys) for _, keys in everyone)))
    if missing or unknown:
        raise RuntimeError(f"[rank {collectives.rank()}] {path} is of another model: "
                           + "; ".join(([f"missing from it: {missing}"] if missing else [])
                                       + ([f"not in the model: {unknown}"] if unknown else [])))
