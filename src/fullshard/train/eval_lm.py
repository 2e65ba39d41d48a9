"""``fullshard eval-lm DATA_DIR --path CHECKPOINT`` (fairseq-eval-lm): loss
(base 2) and perplexity of one split under a trained model, on any number of
ranks.

The computation is the trainer's validation, unchanged: the model is built
and wrapped by :class:`~fullshard.train.trainer.Trainer` from the run's saved
arguments (same ``--ddp-backend``, precision and units), the split is cut
into ``--tokens-per-sample`` blocks and shared over the ranks by
:func:`~fullshard.train.loop.valid_batches`, and
:meth:`~fullshard.train.trainer.Trainer.valid_step` sums the token losses.
So on the valid split with the run's block size, the loss equals the
trainer's last logged valid loss. A checkpoint directory loads resharded to
the launched world size; a consolidated file loads as a full state dict.
"""
from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import time
from dataclasses import dataclass

import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

from fullshard.train.config import TrainConfig
from fullshard.train.options import (OneLineArgumentParser, add_arch_override_args, add_train_args, arch_fields,
                                     config_from_args, launched_world_size, _check_data)
from fullshard.train.trained_model import ModelSpecError, read_spec

logger = logging.getLogger("fullshard.eval_lm")
_DEFAULT_TOKENS_PER_SAMPLE = 1024  # fairseq-eval-lm's default


@dataclass(frozen=True)
class EvalJob:
    """What every rank of ``eval-lm`` needs (picklable for the launcher)."""

    cfg: TrainConfig
    """The model's training configuration with the evaluation's data directory,
    ``tokens_per_sample``, ``batch_size`` and world size."""
    path: str
    """The checkpoint directory or consolidated file."""
    subset: str
    """The split to evaluate (``valid``, ``test``, ``train``)."""
    num_updates: int
    """Updates the checkpoint was trained for (0 when unknown: a consolidated file)."""

    def __getattr__(self, name: str):
        # The launcher reads the launch fields (nproc_per_node, max_restarts,
        # nnodes, node_rank, rdzv_endpoint, rdzv_timeout_s) off its argument.
        if name == "cfg" or name.startswith("__"):
            raise AttributeError(name)
        return getattr(self.cfg, name)


def add_args(p: argparse.ArgumentParser) -> None:
    """Register the eval-lm flags (fairseq-eval-lm names) on ``p``."""
    p.add_argument("data", metavar="DATA_DIR", help="directory written by `fullshard preprocess`")
    p.add_argument("--path", required=True, metavar="CHECKPOINT",
                   help="checkpoint directory (e.g. checkpoints/checkpoint_last) or consolidated .safetensors/.pt")
    p.add_argument("--gen-subset", default="valid", help="split to evaluate (default: %(default)s)")
    p.add_argument("--arch", default=None, help="architecture (default: the one the checkpoint records)")
    add_arch_override_args(p)  # default: the shape the checkpoint records
    p.add_argument("--nproc-per-node", type=int, default=1, help="ranks to launch on this machine (default: 1)")
    p.add_argument("--batch-size", type=int, default=None,
                   help="sequences per rank per forward (default: the training run's, else 8)")
    p.add_argument("--tokens-per-sample", type=int, default=None,
                   help=f"block length in tokens (default: the training run's, else {_DEFAULT_TOKENS_PER_SAMPLE} "
                        "capped at the model's positions)")
    p.add_argument("--log-format", choices=("json", "simple"), default="simple")


def _train_defaults(data: str) -> argparse.Namespace:
    """`fullshard train DATA` defaults, the base of a config when the checkpoint records no arguments."""
    p = OneLineArgumentParser(prog="fullshard train")
    add_train_args(p)
    return p.parse_args([data])


def prepare(p: OneLineArgumentParser, args) -> EvalJob:
    """Check every input on the launching process; on a problem print one line and exit 2."""
    for flag in ("nproc_per_node", "batch_size", "tokens_per_sample"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            p.fail(f"--{flag.replace('_', '-')} must be >= 1, got {value}")
    try:
        spec = read_spec(args.path, args.arch, vars(args))
    except ModelSpecError as e:
        p.fail(str(e))
    meta = _check_data(p, args)
    if int(meta["vocab_size"]) > spec.vocab_size:
        p.fail(f"{args.data!r} has {int(meta['vocab_size']):,} token ids but the model only "
               f"{spec.vocab_size:,}; evaluate on data preprocessed with the model's tokenizer")
    saved = spec.args or {}
    tps = args.tokens_per_sample or saved.get("tokens_per_sample") or min(_DEFAULT_TOKENS_PER_SAMPLE,
                                                                          spec.max_positions)
    if tps > spec.max_positions:
        p.fail(f"--tokens-per-sample {tps} exceeds the {spec.max_positions} positions of the model; "
               f"use --tokens-per-sample <= {spec.max_positions}")
    from fullshard.data import DataError, TokenBlockDataset

    try:
        TokenBlockDataset(args.data, args.gen_subset, tps)
    except (DataError, ValueError) as e:
        p.fail(str(e))
    world = launched_world_size(args.nproc_per_node)
    base = config_from_args(_train_defaults(args.data), max_positions=spec.max_positions,
                            vocab_size=spec.vocab_size, world_size=world, scale_window=1)
    known = {f.name for f in dataclasses.fields(TrainConfig)}
    kept = {k: (tuple(v) if k == "adam_betas" else v) for k, v in saved.items() if k in known}
    cfg = dataclasses.replace(base, **kept)
    cfg = dataclasses.replace(
        cfg, data_dir=args.data, arch=spec.arch, **arch_fields(spec.shape), vocab_size=spec.vocab_size,
        max_positions=spec.max_positions,
        tokens_per_sample=tps, batch_size=args.batch_size or saved.get("batch_size") or 8,
        nproc_per_node=world, log_format=args.log_format, log_file=None, no_save=True,
        finetune_from_model=None, checkpoint_activations=False, offload_activations=False,
        # launched here, on this machine, whatever the training run used
        max_restarts=0, nnodes=1, node_rank=0, rdzv_endpoint="localhost:0", hybrid_shard=False)
    return EvalJob(cfg, args.path, args.gen_subset, spec.num_updates or 0)


@record
def eval_main(job: EvalJob) -> dict:
    """Entry point of one rank: load the checkpoint, evaluate the split, log on rank 0.

    Returns:
        ``{"loss_sum", "ntokens", "nsentences", "steps"}`` summed over ranks
        (loss in nats).
    """
    from fullshard.data import TokenBlockDataset
    from fullshard.train.checkpoint_utils import load_weights
    from fullshard.train.loop import setup_logging, setup_rank, valid_batches
    from fullshard.train.progress import LN2, perplexity, progress_bar, valid_stats
    from fullshard.train.trainer import Trainer

    cfg = job.cfg
    setup_logging(int(os.environ.get("RANK", "0")), None)
    device = setup_rank(cfg)
    try:
        trainer = Trainer(cfg, device)
        start = time.perf_counter()
        load_weights(job.path, trainer.model)
        world = dist.get_world_size()
        trained = f", {job.num_updates} updates" if job.num_updates else ""
        logger.info(f"loaded {job.path} ({cfg.arch}, {trainer.num_params:,} parameters{trained}) on {world} "
                    f"rank{'s' if world > 1 else ''} ({time.perf_counter() - start:.2f} seconds)")
        dataset = TokenBlockDataset(cfg.data_dir, job.subset, cfg.tokens_per_sample)
        start = time.perf_counter()
        out = trainer.valid_step(valid_batches(cfg, dataset))
        seconds = time.perf_counter() - start
        stats = valid_stats(out["loss_sum"], out["ntokens"], out["nsentences"], out["steps"], seconds,
                            job.num_updates)
        progress_bar(cfg.log_format, None, 1, 1, prefix=f"valid on '{job.subset}' subset").print(stats, tag="valid")
        loss = out["loss_sum"] / max(out["ntokens"], 1) / LN2
        logger.info(f"Evaluated {out['ntokens']:,} tokens in {seconds:.1f}s "
                    f"({out['ntokens'] / max(seconds, 1e-9):,.2f} tokens/s)")
        logger.info(f"Loss (base 2): {loss:.4f}, Perplexity: {perplexity(loss):.2f}")
        return out
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
