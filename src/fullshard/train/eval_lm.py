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
the launched world size; a consolidated file loads as a full state dict. The
checkpoint of a ``fullshard train --hf-model DIR`` run rebuilds the same way:
the recorded flags name DIR and the LoRA settings, and the trainer builds that
model (DIR must still be there, see ``hf_trained.py``).
"""
from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import time
from dataclasses import dataclass
from typing import ClassVar

import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

from fullshard.data import DataError, TokenBlockDataset
from fullshard.data.tokenizer import different_tokenizers
from fullshard.train import checkpoint_record
from fullshard.train.checkpoint_utils import load_weights
from fullshard.train.config import DatasetOptions, DistributedOptions, LoggingCheckpointOptions, TrainConfig
from fullshard.train.flags import add_options, flag
from fullshard.train.loop import setup_logging, setup_rank, valid_batches
from fullshard.train.options import OneLineArgumentParser, arch_fields, check_data, launched_world_size
from fullshard.train.progress import LN2, perplexity, progress_bar, valid_stats
from fullshard.train.trained_model import ModelSpecError, add_model_args, read_spec
from fullshard.train.trainer import Trainer

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


@dataclass(frozen=True, kw_only=True)
class EvalOptions:
    """eval-lm's own flags (fairseq-eval-lm names); the others are `fullshard train`'s."""

    TITLE: ClassVar[str] = "eval-lm"
    path: str = flag(help="checkpoint directory (e.g. checkpoints/checkpoint_last) or consolidated "
                     ".safetensors/.pt", metavar="CHECKPOINT")
    gen_subset: str = flag("valid", "split to evaluate (default: %(default)s)")


def add_args(p: argparse.ArgumentParser) -> None:
    """Register the eval-lm flags on ``p``: the data, the checkpoint and its model (default: the
    recorded one), ranks, block and batch sizes (default: the training run's), the log format."""
    add_options(p, DatasetOptions, ("data_dir",))
    add_options(p, EvalOptions)
    add_model_args(p)
    add_options(p, DistributedOptions, ("nproc_per_node",))
    add_options(p, DatasetOptions, ("tokens_per_sample", "batch_size"), overrides={
        "batch_size": dict(default=None, help="sequences per rank per forward (default: the training run's, "
                                              "else 8)"),
        "tokens_per_sample": dict(default=None, help="block length in tokens (default: the training run's, else "
                                                     f"{_DEFAULT_TOKENS_PER_SAMPLE} capped at the model's positions)")})
    add_options(p, LoggingCheckpointOptions, ("log_format",), overrides={
        "log_format": dict(default="simple", choices=("json", "simple"),
                           help="json or simple log lines (default: %(default)s)")})


def prepare(p: OneLineArgumentParser, args) -> EvalJob:
    """Check every input on the launching process; on a problem print one line and exit 2."""
    for name in ("nproc_per_node", "batch_size", "tokens_per_sample"):
        value = getattr(args, name)
        if value is not None and value < 1:
            p.fail(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    try:
        spec = read_spec(args.path, args.arch, vars(args))
    except ModelSpecError as e:
        p.fail(str(e))
    meta = check_data(p, args.data_dir)
    if different_tokenizers(spec.tokenizer, meta.get("tokenizer")):
        p.fail(f"{args.data_dir!r} was preprocessed with the tokenizer {meta.get('tokenizer')}, the model was "
               f"trained on data of {spec.tokenizer}; evaluate on data preprocessed with the model's tokenizer")
    if int(meta["vocab_size"]) > spec.vocab_size:
        p.fail(f"{args.data_dir!r} has {int(meta['vocab_size']):,} token ids but the model only "
               f"{spec.vocab_size:,}; evaluate on data preprocessed with the model's tokenizer")
    saved = spec.args or {}
    tps = args.tokens_per_sample or saved.get("tokens_per_sample") or min(_DEFAULT_TOKENS_PER_SAMPLE,
                                                                          spec.max_positions)
    if tps > spec.max_positions:
        p.fail(f"--tokens-per-sample {tps} exceeds the {spec.max_positions} positions of the model; "
               f"use --tokens-per-sample <= {spec.max_positions}")
    try:
        TokenBlockDataset(args.data_dir, args.gen_subset, tps)
    except (DataError, ValueError) as e:
        p.fail(str(e))
    world = launched_world_size(args.nproc_per_node)
    if os.path.isdir(args.path):
        problem = checkpoint_record.nf4_problem(args.path, [world])
        if problem is not None:
            p.fail(problem)
    # The run's recorded flags (none for a .pt file: `fullshard train`'s defaults); the loss-scale
    # window only matters to training.
    cfg = TrainConfig.from_saved(saved, data_dir=args.data_dir, max_positions=spec.max_positions,
                                 vocab_size=spec.vocab_size, fp16_scale_window=1)
    # A --hf-model run's model is DIR's with the recorded flags; a GPT's the checkpoint's shape.
    model = {} if spec.hf_model else dict(arch=spec.arch, **arch_fields(spec.shape), vocab_size=spec.vocab_size,
                                          max_positions=spec.max_positions)
    cfg = dataclasses.replace(
        cfg, data_dir=args.data_dir, **model, tokens_per_sample=tps,
        batch_size=args.batch_size or saved.get("batch_size") or 8,
        nproc_per_node=world, log_format=args.log_format, log_file=None, no_save=True,
        finetune_from_model=None, checkpoint_activations=False, offload_activations=False,
        # launched here, on this machine, whatever the training run used
        max_restarts=0, start_method=None, nnodes="1", node_rank=0, rdzv_endpoint="localhost:0", hybrid_shard=False,
        # and evaluated as one model, as `generate` does: a pipelined run's checkpoint holds every layer
        **{f.name: f.default for f in dataclasses.fields(TrainConfig) if f.name.startswith("pipeline_")})
    return EvalJob(cfg, args.path, args.gen_subset, spec.num_updates or 0)


@record
def eval_main(job: EvalJob) -> dict:
    """Entry point of one rank: load the checkpoint, evaluate the split, log on rank 0.

    Returns:
        ``{"loss_sum", "ntokens", "nsentences", "steps"}`` summed over ranks
        (loss in nats).
    """
    cfg = job.cfg
    setup_logging(int(os.environ.get("RANK", "0")), None)
    device = setup_rank(cfg)
    try:
        trainer = Trainer(cfg, device)
        start = time.perf_counter()
        load_weights(job.path, trainer.model)
        world = dist.get_world_size()
        trained = f", {job.num_updates} updates" if job.num_updates else ""
        model = f"Hugging Face {cfg.hf_model}" + (f" + LoRA rank {cfg.lora_rank}" if cfg.lora_rank else "") \
            if cfg.hf_model else cfg.arch
        logger.info(f"loaded {job.path} ({model}, {trainer.num_params:,} parameters{trained}) on {world} "
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
