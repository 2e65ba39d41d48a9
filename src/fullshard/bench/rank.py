"""One rank of one `fullshard bench` launch: build the GPT, wrap it as the
job's mode, train, and return what was measured.

Runs under torch's elastic launcher (``RANK``/``WORLD_SIZE``/``MASTER_ADDR``
set). The baselines (``torch.distributed.fsdp``, ``deepspeed``) are imported
here only, inside their own mode's processes; the library never uses them.

Order of a rank, so that the memory and time windows hold only training:

1. set intra-op threads; for a baseline, wrap ``torch.distributed``'s
   collectives with byte counters (before the baseline is imported, so that
   names it binds at import are the counting ones); join the gloo group;
   import the mode's library; make the batches;
   build and step a throwaway one-layer GPT in plain torch
   (:func:`warm_up_torch`: one-time lazy imports and set-up, the same for
   every mode);
2. baseline RSS: ``VmRSS`` now, and the kernel's high-water mark reset
   (:class:`fullshard.bench.measure.PeakRSS`);
3. build the model (same seed in every mode), wrap it, make the optimizer (``--optimizer``);
4. ``warmup_steps`` steps, then ``timed_steps`` steps, each after a barrier,
   each timed from ``zero_grad`` to the end of ``optimizer.step`` (a step is
   ``update_freq`` forward/backward passes, all but the last under ``no_sync``);
   ``getrusage`` and the collective counters cover the timed steps only;
5. read ``VmHWM`` and the model state (params, grads, optimizer state).
"""
from __future__ import annotations

import contextlib
import gc
import inspect
import os
import resource
import threading
import time
import warnings

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh

from fullshard import FullyShardedDataParallel, MixedPrecision, MixedPrecisionPolicy, ShardingStrategy, fully_shard
from fullshard.bench import measure, optimizers, pipeline
from fullshard.bench.modes import COLLECTIVES, MODES, Job, Mode
from fullshard.core import collectives
from fullshard.models import GPT, GPTConfig, TransformerBlock
from fullshard.train.sharding import no_sync as fullshard_no_sync
from fullshard.wrap import ModuleWrapPolicy


# ---------------------------------------------------------------- counting torch.distributed
class PatchedCollectives:
    """Counts the volume of ``torch.distributed`` collectives a baseline issues.

    Replaces the module-level functions of ``torch.distributed`` (and of
    ``distributed_c10d``) with wrappers that add each call's volume, as in
    [Note: communication volume] of :mod:`fullshard.bench.modes`, to
    :attr:`bytes` (keys ``all_gather``, ``reduce_scatter``, ``all_reduce``)
    and count calls in :attr:`calls`. A call made inside another counted call
    (e.g. ``all_gather_into_tensor`` forwarding to ``all_gather_single``) is
    counted once. Used in the baselines' own processes only.
    """

    # name -> (type, how its volume is read)
    _SPECS = {
        "all_gather_single": ("all_gather", "output_tensor"),
        "all_gather_into_tensor": ("all_gather", "output_tensor"),
        "_all_gather_base": ("all_gather", "output_tensor"),
        "all_gather": ("all_gather", "tensor_list"),
        "reduce_scatter_single": ("reduce_scatter", "input"),
        "reduce_scatter_tensor": ("reduce_scatter", "input"),
        "_reduce_scatter_base": ("reduce_scatter", "input"),
        "reduce_scatter": ("reduce_scatter", "input_list"),
        "all_reduce": ("all_reduce", "tensor"),
    }

    def __init__(self) -> None:
        self.bytes = dict.fromkeys(COLLECTIVES, 0)
        self.calls = dict.fromkeys(COLLECTIVES, 0)
        self._depth = threading.local()
        self._originals: dict = {}

    def reset(self) -> None:
        for k in COLLECTIVES:
            self.bytes[k] = self.calls[k] = 0

    @staticmethod
    def _nbytes(x) -> int:
        if isinstance(x, (list, tuple)):
            return sum(t.numel() * t.element_size() for t in x)
        return x.numel() * x.element_size()

    def _wrap(self, name: str, fn):
        kind, arg = self._SPECS[name]
        sig = inspect.signature(fn)

        def counted(*args, **kwargs):
            depth = getattr(self._depth, "n", 0)
            if depth == 0:
                nbytes = self._nbytes(sig.bind(*args, **kwargs).arguments[arg])
                self.bytes[kind] += 2 * nbytes if kind == "all_reduce" else nbytes
                self.calls[kind] += 1
            self._depth.n = depth + 1
            try:
                return fn(*args, **kwargs)
            finally:
                self._depth.n = depth

        counted.__wrapped__ = fn
        return counted

    def install(self) -> None:
        from torch.distributed import distributed_c10d as c10d

        for name in self._SPECS:
            fn = getattr(c10d, name, None)
            if fn is None:
                continue
            self._originals[name] = fn
            wrapped = self._wrap(name, fn)
            for module in (dist, c10d):
                if getattr(module, name, None) is fn:
                    setattr(module, name, wrapped)


# ---------------------------------------------------------------- model and batches
def build_gpt(job: Job) -> torch.nn.Module:
    """The job's GPT on the CPU, initialized from ``job.seed`` (identical in every mode)."""
    with torch.device("meta"):
        model = GPT(job.model.gpt_config())
    model.to_empty(device="cpu")
    model.tie_weights()
    model.init_weights(job.seed)
    return model


def warm_up_torch() -> None:
    """Build, run and step a throwaway one-layer GPT in plain torch (no wrapper).

    The first model built on the meta device imports hundreds of modules
    (sympy, mpmath, ...; about 70 MiB of RSS), the first backward starts
    autograd's machinery and the first bf16 kernels page in their code (about
    10 MiB). That is one-time process set-up, the same for every mode, so it
    happens before the memory baseline, not inside it.
    """
    with torch.device("meta"):
        model = GPT(GPTConfig(num_layers=1, embed_dim=8, num_heads=1, ffn_embed_dim=32, vocab_size=16,
                              max_positions=4))
    model.to_empty(device="cpu")
    model.tie_weights()
    model.init_weights(0)
    opt = torch.optim.AdamW(model.parameters())
    tokens = torch.zeros(1, 4, dtype=torch.long)
    _loss(model(tokens), tokens).backward()
    opt.step()
    model.to(torch.bfloat16)  # the bf16 kernels' first use, too
    _loss(model(tokens), tokens).backward()
    del model, opt


def make_batches(job: Job, rank: int) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    """Per step, ``job.update_freq`` random (input, target) token micro-batches (B, T) int64,
    different per rank, identical in every mode."""
    g = torch.Generator().manual_seed(job.seed * 100_003 + rank)
    n, k = job.warmup_steps + job.timed_steps, job.update_freq
    tok = torch.randint(0, job.model.vocab_size, (n * k, job.batch_size, job.seq_len + 1), generator=g)
    micro = [(t[:, :-1].contiguous(), t[:, 1:].contiguous()) for t in tok]
    return [micro[i * k:(i + 1) * k] for i in range(n)]


def _loss(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), y.reshape(-1))


# ---------------------------------------------------------------- the modes
class _Trainer:
    """A wrapped model and its optimizer: ``step(micro_batches) -> mean loss`` and the state-byte readers.

    Args:
        no_sync: a context manager factory under which a backward accumulates
            gradients without communication (every micro-batch but the last).
        loss_scale: what each micro-batch's loss is multiplied by before backward
            (1/K for K micro-batches, and 1/N more under ``world_size_invariant``).
    """

    def __init__(self, model, optimizer, no_sync=contextlib.nullcontext, loss_scale: float = 1.0) -> None:
        self.model, self.optimizer = model, optimizer
        self.no_sync, self.loss_scale = no_sync, loss_scale
        self.notes: list[str] = []

    def step(self, micro_batches: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
        self.optimizer.zero_grad(set_to_none=True)
        losses = []
        for i, (x, y) in enumerate(micro_batches):
            with self.no_sync() if i < len(micro_batches) - 1 else contextlib.nullcontext():
                loss = _loss(self.model(x), y)
                (loss if self.loss_scale == 1.0 else loss * self.loss_scale).backward()
            losses.append(loss.item())
        self.optimizer.step()
        return sum(losses) / len(losses)

    def state_bytes(self) -> dict[str, int]:
        return dict(param_bytes=measure.param_bytes(self.model), grad_bytes=measure.grad_bytes(self.model),
                    optim_bytes=measure.optim_state_bytes(self.optimizer))


class _DeepSpeedTrainer(_Trainer):
    """DeepSpeed's engine runs backward and the step; its ZeRO-3 state lives in its own buffers."""

    def step(self, micro_batches: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
        (x, y), = micro_batches  # --update-freq 1 only (suite.validate)
        loss = _loss(self.model(x), y)
        self.model.backward(loss)
        self.model.step()
        return loss.item()

    def state_bytes(self) -> dict[str, int]:
        """params: the ZeRO-3 partitions of the module's parameters (``ds_tensor``,
        views of DeepSpeed's flat groups) and its fp32 master partitions (the same
        storage when the model is fp32 on the host, then counted once); grads: the
        flat buffer of gradient partitions; optim: the inner AdamW's state."""
        zero = self.model.optimizer
        params = [getattr(p, "ds_tensor", p) for p in self.model.module.parameters()]
        params += list(getattr(zero, "fp16_partitioned_groups_flat", []))
        params += list(getattr(zero, "fp32_partitioned_groups_flat", []))
        grads = [getattr(zero, "grad_partitions_flat_buffer", None)]
        return dict(param_bytes=measure.storage_bytes(params), grad_bytes=measure.storage_bytes(grads),
                    optim_bytes=measure.optim_state_bytes(zero.optimizer))


def _import_mode(mode: Mode) -> None:
    """Import the mode's library before the memory baseline (imports are not training memory)."""
    if mode.family in ("fsdp1", "fsdp2"):
        import torch.distributed.fsdp  # noqa: F401
    elif mode.family == "deepspeed":
        import deepspeed

        # Joins the existing gloo group; on the CPU accelerator this also loads
        # DeepSpeed's shared-memory comm extension (process set-up, not training).
        deepspeed.init_distributed(dist_backend="gloo")


def wrap(mode: Mode, model: torch.nn.Module, job: Job):
    """``(trainer, ddp_counter)``: the model wrapped as ``mode``, with ``job.optimizer``
    (:mod:`fullshard.bench.optimizers`; AdamW by default).

    Every sharded mode puts one unit around each ``TransformerBlock`` plus the
    root unit (embeddings, final norm, tied output projection). With
    ``job.update_freq`` K > 1 each micro-batch's loss is scaled by 1/K so that
    every mode accumulates the same mean gradient.

    Raises:
        ValueError: unknown mode family.
    """
    scale = 1.0 / job.update_freq
    if mode.invariant:
        # world_size_invariant sums the ranks' gradients instead of averaging
        # them; dividing the loss by N keeps every mode's gradient scale (and
        # so its AdamW trajectory and losses) the same. A timing choice only:
        # a training loop divides by the global token count instead.
        scale /= job.world_size
    if mode.family == "fullshard" and mode.fully_shard:
        mesh = init_device_mesh("cpu", (job.world_size,))
        policy = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if mode.bf16
                  else MixedPrecisionPolicy())
        for block in model.layers:
            fully_shard(block, mesh=mesh, mp_policy=policy, world_size_invariant=mode.invariant)
        fully_shard(model, mesh=mesh, mp_policy=policy, world_size_invariant=mode.invariant)
        return _Trainer(model, optimizers.build(job, model), lambda: fullshard_no_sync(model), scale), None
    if mode.family == "fullshard":
        mp = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if mode.bf16 else None
        wrapped = FullyShardedDataParallel(model, sharding_strategy=ShardingStrategy[mode.strategy],
                                           auto_wrap_policy=ModuleWrapPolicy({TransformerBlock}),
                                           mixed_precision=mp, world_size_invariant=mode.invariant,
                                           **optimizers.placement_kwargs(job, model))
        return _Trainer(wrapped, optimizers.build(job, wrapped), wrapped.no_sync, scale), None
    if mode.family == "ddp":
        # Gradients as views of DDP's buckets, so they are not held twice.
        ddp = torch.nn.parallel.DistributedDataParallel(model, gradient_as_bucket_view=True)
        counter = _DDPCommCounter()
        ddp.register_comm_hook(counter, _counting_allreduce_hook)
        return _Trainer(ddp, optimizers.build(job, ddp), ddp.no_sync, scale), counter
    if mode.family == "fsdp2":
        from torch.distributed.fsdp import MixedPrecisionPolicy as TorchPolicy, fully_shard as torch_fully_shard

        mesh = init_device_mesh("cpu", (job.world_size,))
        mp = (TorchPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if mode.bf16
              else TorchPolicy())
        for block in model.modules():
            if isinstance(block, TransformerBlock):
                torch_fully_shard(block, mesh=mesh, mp_policy=mp)
        torch_fully_shard(model, mesh=mesh, mp_policy=mp)
        return _Trainer(model, optimizers.build(job, model), lambda: _fsdp2_no_sync(model), scale), None
    if mode.family == "fsdp1":
        from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP, ShardingStrategy as TorchStrategy
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy as TorchPolicy

        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            # device_id=cpu: without it FSDP1 looks for an accelerator and refuses.
            wrapped = TorchFSDP(model, sharding_strategy=TorchStrategy.FULL_SHARD,
                                auto_wrap_policy=TorchPolicy({TransformerBlock}), use_orig_params=True,
                                device_id=torch.device("cpu"))
        trainer = _Trainer(wrapped, optimizers.build(job, wrapped), wrapped.no_sync, scale)
        trainer.notes = sorted({str(w.message).splitlines()[0] for w in caught
                                if not issubclass(w.category, FutureWarning)})
        return trainer, None
    if mode.family == "deepspeed":
        import deepspeed

        config = {
            "train_micro_batch_size_per_gpu": job.batch_size,
            "gradient_accumulation_steps": 1,
            "zero_optimization": {
                "stage": 3,
                # Partition every parameter (the default keeps those under 1e5
                # elements whole on every rank), as the other sharded modes do.
                "stage3_param_persistence_threshold": 0,
                # No prefetch: with a bucket (default 5e7 elements) larger than
                # the blocks, DeepSpeed's prefetcher sees each block's reuse in
                # backward and keeps it gathered from forward to backward, which
                # is not ZeRO-3's memory behaviour (measured: 1Ψ all-gathered
                # per step instead of 2Ψ). So it also gets no overlap here.
                "stage3_prefetch_bucket_size": 0,
                # Release a module's parameters right after it ran.
                "stage3_max_reuse_distance": 0,
                "overlap_comm": False,
            },
            "zero_allow_untested_optimizer": True,  # torch AdamW, the same optimizer as every mode
            "steps_per_print": 2 ** 31 - 1,
            "wall_clock_breakdown": False,
        }
        engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizers.build(job, model),
                                               config=config)
        return _DeepSpeedTrainer(engine, engine.optimizer), None
    raise ValueError(f"unknown mode family {mode.family!r}")


@contextlib.contextmanager
def _fsdp2_no_sync(model):
    """torch FSDP2's accumulation without reduction (``set_requires_gradient_sync``)."""
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)


class _DDPCommCounter:
    """State of :func:`_counting_allreduce_hook`: all-reduce volume in bytes (2 x bucket bytes)."""

    def __init__(self) -> None:
        self.bytes = 0
        self.calls = 0


def _counting_allreduce_hook(state: _DDPCommCounter, bucket):
    """DDP communication hook: the stock all-reduce hook, counting each bucket."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    buf = bucket.buffer()
    state.bytes += 2 * buf.numel() * buf.element_size()
    state.calls += 1
    return default_hooks.allreduce_hook(None, bucket)


def _fullshard_volume(world: int) -> tuple[dict, dict]:
    """Volume and calls from ``fullshard.core.collectives`` counters.

    ``BYTES`` holds input bytes: a shard for all-gather (x group size = the
    output), the full tensor for reduce-scatter and all-to-all (world_size_invariant's
    gradient exchange), the tensor for all-reduce (x 2). FULL_SHARD and SHARD_GRAD_OP
    gather over the world group (``world``: its size; a pipeline mode's units gather over
    the data-parallel group, N / 2); NO_SHARD's shard group is this rank alone (nothing
    counted) and it all-reduces.
    """
    vol = {"all_gather": collectives.BYTES["all_gather"] * world, "reduce_scatter": collectives.BYTES["reduce_scatter"],
           "all_reduce": 2 * collectives.BYTES["all_reduce"], "all_to_all": collectives.BYTES["all_to_all"]}
    return vol, {k: collectives.COUNTS[k] for k in COLLECTIVES}


# ---------------------------------------------------------------- one rank
def _rusage() -> tuple[float, float]:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime, r.ru_stime


def rank_main(job: Job) -> dict:
    """Entry of one rank: train ``job`` and return this rank's measurements.

    Returns:
        A dict: ``rank``, ``threads``, ``psi``, ``step_s`` (each timed step,
        seconds), ``losses`` (every step's cross entropy on this rank, nats,
        the mean over its micro-batches),
        ``user_s``/``sys_s`` (CPU seconds over the timed steps),
        ``rss_base_bytes``, ``rss_peak_bytes``, ``rss_method``,
        ``param_bytes``/``grad_bytes``/``optim_bytes``, ``volume_bytes`` and
        ``calls`` by collective type summed over the timed steps (collectives
        of one-rank groups move nothing and are not counted),
        ``volume_source``, ``notes``.
    Raises:
        Whatever the mode raises; the launcher reports it as that mode's error.
    """
    import datetime

    mode = MODES[job.mode]
    torch.set_num_threads(job.threads)
    patched = None
    if mode.baseline:
        patched = PatchedCollectives()
        patched.install()
    if mode.family == "deepspeed":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        # DeepSpeed calls torch's older collective names; torch warns on each call.
        warnings.filterwarnings("ignore", message=r".*is deprecated\. Please use .torch\.distributed\.",
                                category=FutureWarning)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=job.timeout_s))
    try:
        rank = dist.get_rank()
        _import_mode(mode)
        warm_up_torch()
        batches = pipeline.make_batches(job, rank, make_batches) if mode.pipeline else make_batches(job, rank)
        gc.collect()
        rss = measure.PeakRSS()
        rss.start()
        if mode.pipeline:  # the stages are built on meta: no rank holds the whole model
            trainer, ddp_counter, psi = pipeline.PipelineTrainer(job, mode, optimizers.build), None, job.model.psi()
        else:
            model = build_gpt(job)
            psi = sum(p.numel() for p in model.parameters())
            with _quiet(mode):
                trainer, ddp_counter = wrap(mode, model, job)
            del model
        step_s, losses = [], []
        for i, micro_batches in enumerate(batches):
            if i == job.warmup_steps:
                collectives.reset_counts()
                if patched is not None:
                    patched.reset()
                if ddp_counter is not None:
                    ddp_counter.bytes = ddp_counter.calls = 0
                u0, s0 = _rusage()
            dist.barrier()  # every step starts together: a step's time is not rank skew
            t0 = time.perf_counter()
            losses.append(trainer.step(micro_batches))
            if i >= job.warmup_steps:
                step_s.append(time.perf_counter() - t0)
        u1, s1 = _rusage()
        out = dict(rank=rank, threads=torch.get_num_threads(), psi=psi, step_s=step_s, losses=losses,
                   user_s=u1 - u0, sys_s=s1 - s0, rss_base_bytes=rss.start_bytes,
                   rss_peak_bytes=rss.peak_bytes(), rss_method=rss.method, notes=trainer.notes,
                   **trainer.state_bytes())
        if mode.family == "fullshard":
            out["volume_bytes"], out["calls"] = _fullshard_volume(pipeline.data_parallel_size(job, mode))
            out["volume_source"] = "fullshard.core.collectives counters"
            if mode.pipeline:  # summed over the world after the counters are read
                out["losses"] = trainer.global_losses()
        elif ddp_counter is not None:
            out["volume_bytes"] = dict(dict.fromkeys(COLLECTIVES, 0), all_reduce=ddp_counter.bytes)
            out["calls"] = dict(dict.fromkeys(COLLECTIVES, 0), all_reduce=ddp_counter.calls)
            out["volume_source"] = "DDP comm hook"
        else:
            out["volume_bytes"], out["calls"] = dict(patched.bytes), dict(patched.calls)
            out["volume_source"] = "torch.distributed functions wrapped in the bench process"
        dist.barrier()
        return out
    finally:
        dist.destroy_process_group()


@contextlib.contextmanager
def _quiet(mode: Mode):
    """DeepSpeed logs its configuration at INFO while initializing; keep the console to the report."""
    if mode.family != "deepspeed":
        yield
        return
    import logging

    from deepspeed.utils import logger

    level = logger.level
    logger.setLevel(logging.WARNING)
    try:
        yield
    finally:
        logger.setLevel(level)
