"""The per-rank entry point: set up the rank, run epochs, validate, log like fairseq, save.

`train_main(cfg)` is what the launcher runs in every rank. Only rank 0 logs.
"""
from __future__ import annotations

import gc
import logging
import os
import random
import sys
import time
from typing import List, Optional, Tuple

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

from fullshard import memory_stats
from fullshard.core import collectives
from fullshard.data import GlobalBatchSampler, ShardedBatchSampler, TokenBlockDataset
from fullshard.train import checkpoint_utils, hf_export, invariance, optimizers, pipeline
from fullshard.train.config import GlobalBatchError, TrainConfig
from fullshard.train.launcher import threads_per_rank
from fullshard.train.pipeline_checks import microbatches
from fullshard.train.progress import UpdateMeters, progress_bar, valid_stats
from fullshard.train.sigterm import PeerSigterm, SigtermWatch, StoppedBySigterm
from fullshard.train.trainer import Trainer

LOG_FORMAT = "%(asctime)s | %(levelname)s | %(name)s | %(message)s"
LOG_DATEFMT = "%Y-%m-%d %H:%M:%S"
logger = logging.getLogger("fullshard.train")


def setup_logging(rank: int, log_file) -> None:
    """Rank 0: INFO to stdout (and --log-file). Other ranks: warnings only."""
    root = logging.getLogger()
    for handler in list(root.handlers):
        root.removeHandler(handler)
    if rank != 0:
        root.setLevel(logging.WARNING)
        return
    formatter = logging.Formatter(LOG_FORMAT, datefmt=LOG_DATEFMT)
    handlers = [logging.StreamHandler(sys.stdout)]
    if log_file:
        # Arguments were validated before launch, so creating the folder now
        # cannot leave anything behind for a rejected command.
        os.makedirs(os.path.dirname(os.path.abspath(log_file)), exist_ok=True)
        handlers.append(logging.FileHandler(log_file))
    for handler in handlers:
        handler.setFormatter(formatter)
        root.addHandler(handler)
    root.setLevel(logging.INFO)


def intra_op_threads(cfg: TrainConfig, device: torch.device, local_world_size: int) -> int:
    """--threads-per-rank, else 1 under --world-size-invariant on a CPU (sums depend on the thread
    count), else the machine's cores divided among its ranks."""
    if cfg.threads_per_rank is not None:
        return cfg.threads_per_rank
    if cfg.world_size_invariant and device.type == "cpu":
        return 1
    return threads_per_rank(local_world_size)


def setup_rank(cfg: TrainConfig) -> torch.device:
    """Init the process group (env://), pick the device, threads and seeds."""
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank)
        if cfg.world_size_invariant:
            invariance.make_deterministic(device)  # before any CUDA work
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        device = torch.device("cpu")
        backend = "gloo"
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1")))
    torch.set_num_threads(intra_op_threads(cfg, device, local_world))
    if not dist.is_initialized():
        collectives.init_process_group(backend, timeout_s=cfg.collective_timeout_s)
    else:
        collectives.set_timeout(cfg.collective_timeout_s)
    if cfg.debug_collectives:
        collectives.set_debug(True)
    random.seed(cfg.seed)
    torch.manual_seed(cfg.seed)
    try:
        import numpy as np

        np.random.seed(cfg.seed)
    except ImportError:  # pragma: no cover
        pass
    return device


def collate(dataset, indices) -> tuple:
    """Stack dataset items (input (T,), target (T,)) into (B, T) LongTensors."""
    items = [dataset[i] for i in indices]
    return torch.stack([x for x, _ in items]), torch.stack([y for _, y in items])


MicroBatch = Tuple[Optional[invariance.MicroBatchId], list]
"""(its (epoch, global index) under --world-size-invariant, else None; its dataset indices).
Under --pipeline-parallel-size with --world-size-invariant the first is the list of its M pipeline
micro-batches' ids (see [Note: world-size-invariant pipelining] in ``pipeline.py``)."""


def epoch_updates(cfg: TrainConfig, dataset, epoch: int) -> List[List[MicroBatch]]:
    """This rank's micro-batches of `epoch`, grouped `update_freq` per update.

    A final short group (fewer than K micro-batches) is still one update, as in
    fairseq's GroupedIterator. Under --world-size-invariant the micro-batches come
    from `GlobalBatchSampler` with their global indices, and an incomplete last
    update is dropped instead (every update has --global-batch-size sequences).
    Under --pipeline-parallel-size the data-parallel rank and size take the world's place (every
    rank of one pipeline feeds the same batches).
    """
    rank, world = pipeline.data_parallel(cfg)
    if cfg.world_size_invariant:
        # Pipelined: a global micro-batch is one pipeline micro-batch; M consecutive ones of this
        # rank make one --batch-size micro-batch.
        m = microbatches(cfg) if cfg.pipeline_parallel_size > 1 else 1
        sampler = GlobalBatchSampler(len(dataset), cfg.batch_size // m, cfg.global_batch_size, rank, world,
                                     seed=cfg.seed, epoch=epoch)
        if m == 1:
            return [[((epoch, i), list(idx)) for i, idx in update] for update in sampler]
        return [[([(epoch, i) for i, _ in update[s:s + m]], [x for _, idx in update[s:s + m] for x in idx])
                 for s in range(0, len(update), m)] for update in sampler]
    sampler = ShardedBatchSampler(len(dataset), cfg.batch_size, rank, world,
                                  seed=cfg.seed, epoch=epoch, shuffle=True, drop_last=True)
    batches = [(None, list(b)) for b in sampler]
    k = cfg.update_freq
    return [batches[i:i + k] for i in range(0, len(batches), k)]


def update_ids(group: List[MicroBatch]) -> list:
    """--world-size-invariant: the ids `Trainer.train_step` takes for one update's micro-batches
    (under pipelining every pipeline micro-batch's, in order)."""
    return [one for ids, _ in group for one in (ids if isinstance(ids, list) else [ids])]


def valid_batches(cfg: TrainConfig, dataset) -> List[tuple]:
    """This rank's share of the whole valid split as (input, target, counted) batches.

    The sampler (no shuffle, drop_last=False) gives every rank the same number
    of batches by wrapping around to the start; `counted` (B,) bool marks the
    sequences at global positions < len(dataset), so each block counts once.
    """
    rank, world = pipeline.data_parallel(cfg)
    sampler = ShardedBatchSampler(len(dataset), cfg.batch_size, rank, world,
                                  seed=cfg.seed, epoch=0, shuffle=False, drop_last=False)
    out = []
    for b, indices in enumerate(sampler):
        first = b * cfg.batch_size * world + rank * cfg.batch_size
        counted = torch.tensor([first + j < len(dataset) for j in range(len(indices))])
        out.append(collate(dataset, list(indices)) + (counted,))
    return out


class Run:
    """State of one training run on one rank (epochs, meters, stop conditions)."""

    def __init__(self, cfg: TrainConfig, device: torch.device, sigterm: Optional[SigtermWatch] = None):
        self.cfg = cfg
        self.device = device
        self.sigterm = sigterm  # --save-on-sigterm
        self.stopped_by_sigterm = False
        self.rank = dist.get_rank()
        self.trainer = Trainer(cfg, device)
        self.train_data = TokenBlockDataset(cfg.data_dir, "train", cfg.tokens_per_sample)
        self.valid_data = TokenBlockDataset(cfg.data_dir, "valid", cfg.tokens_per_sample)
        self.valid_set = valid_batches(cfg, self.valid_data)
        self.start = time.perf_counter()
        self.inner = UpdateMeters()  # train_inner: reset after each log, not per epoch (as fairseq)
        self.epoch_meters = UpdateMeters()  # the epoch's train line; saved, so a mid-epoch resume continues it

    def log_header(self) -> None:
        n = self.trainer.num_params
        kind = "GPUs" if self.device.type == "cuda" else "CPUs"
        cfg = self.cfg
        if cfg.hf_model:
            described = f"Hugging Face {cfg.hf_model}" + (f" + LoRA rank {cfg.lora_rank} (base {cfg.base_dtype}, "
                                                          "adapters fp32)" if cfg.lora_rank else "")
        else:
            described = f"{cfg.arch} ({cfg.arch_spec().describe()})"
        logger.info(f"model {described}, "
                    f"ddp-backend {self.cfg.ddp_backend}"
                    + ("" if self.cfg.ddp_backend == "c10d" else f" ({self._strategy()})"))
        logger.info(f"num. model params: {n:,} (num. trained: {self.trainer.num_trained:,})")
        if cfg.hf_model:  # the base's bytes as stored (--base-dtype), from fullshard.memory_stats
            shards = sum(u["sharded_bytes"] for k, u in memory_stats(self.trainer.model).items() if k != "pool")
            logger.info(f"parameter shards on rank 0: {shards:,} bytes ({shards / 2**20:,.1f} MiB)")
        logger.info(optimizers.describe(self.cfg, self.trainer.optimizer))
        cfg, parts = self.cfg, []
        if cfg.fp16:
            parts.append(f"fp16 (loss scale {cfg.fp16_init_scale:g}, scale window {cfg.fp16_scale_window}, "
                         f"min loss scale {cfg.min_loss_scale:g})")
        if cfg.bf16:
            parts.append("bf16")
        parts += [flag for flag, on in (("cpu-offload", cfg.cpu_offload),
                                        ("checkpoint-activations", cfg.checkpoint_activations),
                                        ("offload-activations", cfg.offload_activations)) if on]
        if cfg.update_freq > 1:  # under pipelining, --pipeline-grad-accumulation decides (the pipeline line)
            how = "the pipeline" if cfg.pipeline_parallel_size > 1 else cfg.accumulate_mode
            parts.append(f"update-freq {cfg.update_freq} accumulated by {how}")
        if parts:
            logger.info("precision and memory: " + ", ".join(parts))
        if cfg.log_memory and cfg.ddp_backend == "c10d":
            logger.info("--log-memory: ddp-backend c10d has no fullshard units; no mem_* fields are logged")
        logger.info(f"loaded {len(self.train_data):,} blocks from {self.cfg.data_dir} train, "
                    f"{len(self.valid_data):,} from valid")
        logger.info(f"training on {dist.get_world_size()} devices ({kind})")
        if self.trainer.pipeline is not None:
            pipe = self.trainer.pipeline
            logger.info(f"pipeline: {cfg.pipeline_parallel_size} ranks x {pipeline.data_parallel(cfg)[1]} "
                        f"data-parallel, {cfg.pipeline_schedule}, {pipe.microbatches} micro-batches, layers per "
                        f"stage {pipe.split}, gradients accumulated by {cfg.pipeline_grad_accumulation}")
        logger.info(f"max tokens per device = None and batch size per device = {self.cfg.batch_size}")
        if self.device.type == "cpu":
            logger.info(f"intra-op threads per rank: {torch.get_num_threads()}"
                        + (" (--threads-per-rank)" if cfg.threads_per_rank is not None else ""))
        if cfg.world_size_invariant:
            logger.info(f"world-size invariant: global batch {cfg.global_batch_size} = {cfg.batch_size} sequences x "
                        f"{cfg.update_freq} micro-batches x {pipeline.data_parallel(cfg)[1]} ranks"
                        + (" of each pipeline stage" if cfg.pipeline_parallel_size > 1 else "")
                        + "; an incomplete last update of an epoch is dropped")
        elif cfg.global_batch_size is not None:
            logger.info(f"global batch {cfg.global_batch_size} = {cfg.batch_size} sequences x {cfg.update_freq} "
                        f"micro-batches x {pipeline.data_parallel(cfg)[1]} ranks"
                        + (" of each pipeline stage" if cfg.pipeline_parallel_size > 1 else ""))

    def _strategy(self) -> str:
        version = f"; fsdp-version {self.cfg.fsdp_version}"
        if self.cfg.hybrid_shard:
            return (f"HYBRID_SHARD: shard within {os.environ.get('LOCAL_WORLD_SIZE', '?')} ranks, replicate across "
                    f"nodes{version}")
        return ("FULL_SHARD" if self.cfg.reshard_after_forward else "SHARD_GRAD_OP") + version

    def wall(self) -> float:
        return time.perf_counter() - self.start

    def should_stop(self) -> bool:
        return self.cfg.max_update > 0 and self.trainer.num_updates >= self.cfg.max_update

    def validate(self, epoch: int) -> None:
        logger.info('begin validation on "valid" subset')
        start = time.perf_counter()
        out = self.trainer.valid_step(self.valid_set)
        stats = valid_stats(out["loss_sum"], out["ntokens"], out["nsentences"], out["steps"],
                            time.perf_counter() - start, self.trainer.num_updates)
        progress_bar(self.cfg.log_format, epoch, 1, 1, prefix="valid on 'valid' subset").print(stats, tag="valid")

    def train_epoch(self, epoch: int, offset: int = 0) -> bool:
        """Train one epoch from its ``offset``-th update; returns True when --max-update was reached."""
        cfg = self.cfg
        groups = epoch_updates(cfg, self.train_data, epoch)
        logger.info(f"begin training epoch {epoch}" + (f" at update {offset} of it" if offset else ""))
        bar = progress_bar(cfg.log_format, epoch, len(groups), cfg.log_interval)
        if not offset:  # else resumed mid-epoch: the meters restored from the checkpoint go on
            self.epoch_meters = UpdateMeters()
        inner, whole = self.inner, self.epoch_meters
        stop = False
        for i, group in enumerate(groups):
            if i < offset:
                continue
            ids = update_ids(group) if cfg.world_size_invariant else None
            out = self.trainer.train_step([collate(self.train_data, idx) for _, idx in group], ids)
            bar.update(i)
            n = self.trainer.num_updates
            # An fp16 overflow skipped the update (fairseq: no stats, no update counted).
            updated = not out["overflow"]
            if updated:
                for meters in (inner, whole):
                    meters.add(out["loss_sum"], out["ntokens"], out["nsentences"], out["gnorm"], out["seconds"],
                               clipped=0 < cfg.clip_norm < out["gnorm"])
                if n % cfg.log_interval == 0:
                    stats = inner.stats(n, self.trainer.get_lr(), self.device, self.wall(), out["loss_scale"],
                                        cfg.clip_norm)
                    stats.update(self.trainer.memory_record())  # --log-memory (all ranks: one all-reduce)
                    bar.log(stats, tag="train_inner")
                    inner.reset()
            if self.sigterm is not None and self.sigterm.any_rank(self.device):
                self.stopped_by_sigterm = True  # `run` saves; no validation (the agent kills in 30 s)
                self.position = (epoch, i + 1, i == len(groups) - 1)
                break
            stop = self.should_stop()
            end_of_epoch = i == len(groups) - 1
            if stop:
                logger.info(f"Stopping training due to num_updates: {n} >= max_update: {cfg.max_update}")
            periodic = updated and cfg.validate_interval_updates > 0 and n % cfg.validate_interval_updates == 0
            if stop or end_of_epoch or periodic:
                self.validate(epoch)
            interval = cfg.save_interval_updates
            last = stop or (end_of_epoch and 0 < cfg.max_epoch <= epoch)  # the run's final save follows
            if updated and not cfg.no_save and interval > 0 and n % interval == 0 and not last:
                checkpoint_utils.save(self, epoch, i + 1, end_of_epoch)
            if stop:
                self.position = (epoch, i + 1, end_of_epoch)
                break
            self.position = (epoch, i + 1, end_of_epoch)
        bar.close()
        logger.info(f"end of epoch {epoch} (average epoch stats below)")
        stats = whole.stats(self.trainer.num_updates, self.trainer.get_lr(), self.device, self.wall(),
                            self.trainer.scaler.get_scale(), cfg.clip_norm)
        progress_bar(cfg.log_format, epoch, len(groups), cfg.log_interval).print(stats, tag="train")
        return stop or self.stopped_by_sigterm

    def run(self) -> None:
        self.log_header()
        epoch, offset = checkpoint_utils.load(self)
        self.position = (epoch, offset, False)
        while (self.cfg.max_epoch == 0 or epoch <= self.cfg.max_epoch) and not self.should_stop():
            if self.train_epoch(epoch, offset):
                break
            epoch, offset = epoch + 1, 0
        if not self.cfg.no_save:
            checkpoint_utils.save(self, *self.position)
        if self.cfg.hf_model and not self.stopped_by_sigterm and (self.cfg.save_hf or not self.cfg.no_save):
            out = hf_export.export(self.cfg, self.trainer.model, self.trainer.peft_model)
            what = "merged model" if self.cfg.merge_lora else "LoRA adapter" if self.cfg.lora_rank else "model"
            logger.info(f"wrote the Hugging Face {what} to {out}")
        n = self.trainer.num_updates
        if not self.stopped_by_sigterm:
            logger.info("done training in {:.1f} seconds".format(self.wall()))
        else:  # --save-on-sigterm excludes --no-save
            logger.info(f"SIGTERM: saved checkpoint at update {n}")


def _known_errors() -> tuple:
    """Errors whose message is already one line naming the rank and what to do."""
    # Lazy for start-up speed: CheckpointError lives in save_load (torch.distributed.checkpoint,
    # about 0.7 s of every `fullshard` command).
    from fullshard.checkpoint import CheckpointError

    return (collectives.CollectiveError, CheckpointError, FloatingPointError, GlobalBatchError, PeerSigterm)


@record
def train_main(cfg: TrainConfig) -> Optional[StoppedBySigterm]:
    """Entry point of one rank (run by the elastic launcher or directly under torchrun).

    A known failure (collective timeout or lost peer, failed save, NaN loss)
    prints one line on stderr and exits 1 (the launcher then stops the other
    ranks); ``--debug`` raises it with its traceback instead.

    Returns:
        None after training to the end; with --save-on-sigterm, `StoppedBySigterm` when this rank
        got SIGTERM and training stopped early (see `fullshard.train.sigterm`).
    """
    # First: from here on a SIGTERM waits for the end of an update instead of killing the rank.
    sigterm = SigtermWatch() if cfg.save_on_sigterm else None
    setup_logging(int(os.environ.get("RANK", "0")), cfg.log_file)
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if restart:
        # Under torchrun its --max-restarts counts (torch elastic passes it on), not ours.
        most = os.environ.get("TORCHELASTIC_MAX_RESTARTS", cfg.max_restarts)
        logger.info(f"restart {restart} of at most {most}: every rank restarted, resuming "
                    "from the last checkpoint")
    stopped = None
    try:
        device = setup_rank(cfg)
        # The world size is known only now (an elastic restart may have changed it).
        cfg = _at_world_size(cfg, pipeline.data_parallel(cfg)[1])
        stopped_at = _run(cfg, device, sigterm)
        if stopped_at is not None:
            stopped = sigterm.finish(stopped_at)
    except _known_errors() as e:
        if cfg.debug:
            raise
        _exit_one_line(e)
    finally:
        if dist.is_initialized():
            # The model (a DDP Reducer holds the process group) must go while the group is
            # alive: a gloo group destroyed by the Reducer's dealloc joins its worker thread
            # while holding the GIL that thread needs (a hang at exit).
            gc.collect()
            dist.destroy_process_group()
    if stopped is not None:
        sigterm.leave_soon()
    return stopped


def _run(cfg: TrainConfig, device: torch.device, sigterm: Optional[SigtermWatch]) -> Optional[int]:
    """Train; returns the update a SIGTERM stopped training at, else None. The Run (model,
    optimizer) is freed on return, before the process group is destroyed."""
    run = Run(cfg, device, sigterm)
    run.run()
    return run.trainer.num_updates if run.stopped_by_sigterm else None


def _at_world_size(cfg: TrainConfig, world_size: int) -> TrainConfig:
    """``cfg.at_world_size(world_size)``; its error names this rank.

    Raises:
        GlobalBatchError: ``world_size`` does not divide --global-batch-size / --batch-size.
    """
    try:
        return cfg.at_world_size(world_size)
    except GlobalBatchError as e:
        raise GlobalBatchError(f"[rank {dist.get_rank()}] cannot start at world size {world_size}: {e}") from None


def _exit_one_line(e: BaseException) -> None:
    """Record ``e`` for the elastic agent's report, print it as one line, exit 1 (no traceback)."""
    from torch.distributed.elastic.multiprocessing.errors import ErrorHandler

    if os.environ.get("TORCHELASTIC_ERROR_FILE"):
        ErrorHandler().record_exception(e)
    for handler in logging.getLogger().handlers:
        handler.flush()
    sys.stdout.flush()
    sys.stderr.write(f"{e}\n")
    sys.stderr.flush()
    os._exit(1)  # skip teardown that could wait on peers that are gone
