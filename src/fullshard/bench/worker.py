"""One rank of :mod:`fullshard.bench.compare`: train the same GPT with each
backend in turn and return what was measured.

Runs under torch's elastic launcher (``RANK``/``WORLD_SIZE``/``MASTER_ADDR``
set in the environment). ``torch.distributed.fsdp`` is imported here only, as
the comparison baseline; the product never uses it.
"""
from __future__ import annotations

import dataclasses
import gc
import time
import warnings

import torch
import torch.distributed as dist
import torch.nn.functional as F

from fullshard.bench import measure as M

FULL_SHARD = "fullshard FULL_SHARD"
SHARD_GRAD_OP = "fullshard SHARD_GRAD_OP"
DDP = "torch DDP"
TORCH_FSDP = "torch FSDP1 FULL_SHARD"
BACKENDS = {"full": FULL_SHARD, "grad_op": SHARD_GRAD_OP, "ddp": DDP, "torch_fsdp": TORCH_FSDP}
"""``--backends`` keys -> row names, in the order they run."""
OURS = (FULL_SHARD, SHARD_GRAD_OP)
_NOTES: dict[str, list[str]] = {}
"""Warnings a backend emitted while wrapping, reported under the table."""


@dataclasses.dataclass(frozen=True)
class BenchConfig:
    """One launch of the comparison (every rank gets the same copy)."""

    arch: str
    vocab_size: int
    seq_len_tokens: int
    """T: tokens per sample; also the model's ``max_positions``."""
    batch_size_per_rank: int
    warmup_steps: int
    timed_steps: int
    lr: float
    weight_decay: float
    seed: int
    backends: tuple[str, ...]
    """Row names from :data:`BACKENDS`."""
    timeout_s: float


class _DDPCommCounter:
    """State of :func:`_counting_allreduce_hook`: all-reduce input bytes."""

    def __init__(self) -> None:
        self.bytes = 0


def _counting_allreduce_hook(state: _DDPCommCounter, bucket):
    """DDP communication hook: the stock all-reduce hook, counting bucket bytes."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    buf = bucket.buffer()
    state.bytes += buf.numel() * buf.element_size()
    return default_hooks.allreduce_hook(None, bucket)


def _wrap(name: str, model: torch.nn.Module):
    """The wrapped model and, for DDP, its byte counter."""
    from fullshard.models import TransformerBlock

    if name in OURS:
        from fullshard import FullyShardedDataParallel, ShardingStrategy
        from fullshard.wrap import ModuleWrapPolicy

        strategy = ShardingStrategy.FULL_SHARD if name == FULL_SHARD else ShardingStrategy.SHARD_GRAD_OP
        return FullyShardedDataParallel(model, sharding_strategy=strategy,
                                        auto_wrap_policy=ModuleWrapPolicy({TransformerBlock})), None
    if name == DDP:
        # Gradients as views of the buckets: the grad column then holds the
        # buckets, which a default DDP would keep *in addition* to .grad.
        ddp = torch.nn.parallel.DistributedDataParallel(model, gradient_as_bucket_view=True)
        counter = _DDPCommCounter()
        ddp.register_comm_hook(counter, _counting_allreduce_hook)
        return ddp, counter
    if name == TORCH_FSDP:
        from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP
        from torch.distributed.fsdp import ShardingStrategy as TorchStrategy
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy as TorchPolicy

        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            # device_id=cpu: without it FSDP1 looks for an accelerator and refuses.
            wrapped = TorchFSDP(model, sharding_strategy=TorchStrategy.FULL_SHARD,
                                auto_wrap_policy=TorchPolicy({TransformerBlock}),
                                use_orig_params=True, device_id=torch.device("cpu"))
        # Surface what torch changed (e.g. NO_SHARD at N=1), not its deprecation notice.
        _NOTES[name] = sorted({str(w.message).splitlines()[0] for w in caught
                               if not issubclass(w.category, FutureWarning)})
        return wrapped, None
    raise ValueError(f"unknown backend {name!r}")


def _batches(cfg: BenchConfig, rank: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Random token batches, different per rank, identical for every backend."""
    g = torch.Generator().manual_seed(cfg.seed * 100_003 + rank)
    n = cfg.warmup_steps + cfg.timed_steps
    tok = torch.randint(0, cfg.vocab_size, (n, cfg.batch_size_per_rank, cfg.seq_len_tokens + 1), generator=g)
    return [(t[:, :-1].contiguous(), t[:, 1:].contiguous()) for t in tok]


def _train(name: str, cfg: BenchConfig, batches) -> dict:
    from fullshard.core import collectives as C
    from fullshard.models import build_model, num_params

    model = build_model(cfg.arch, cfg.vocab_size, cfg.seq_len_tokens, seed=cfg.seed)
    psi = num_params(model)
    wrapped, ddp_counter = _wrap(name, model)
    del model
    opt = torch.optim.AdamW(wrapped.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    gc.collect()
    rss = M.PeakRSS()
    dist.barrier()
    rss.start()
    times, losses = [], []
    for i, (x, y) in enumerate(batches):
        if i == cfg.warmup_steps:
            C.reset_counts()
            if ddp_counter is not None:
                ddp_counter.bytes = 0
        dist.barrier()  # every step starts together: times are not skew
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        logits = wrapped(x)
        loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1))
        loss.backward()
        opt.step()
        dt = time.perf_counter() - t0
        losses.append(loss.item())
        if i >= cfg.warmup_steps:
            times.append(dt)
    steps = cfg.timed_steps
    out = dict(psi=psi, step_ms=M.median(times) * 1e3, first_loss=losses[0], last_loss=losses[-1],
               param_bytes=M.param_bytes(wrapped), grad_bytes=M.grad_bytes(wrapped),
               optim_bytes=M.optim_state_bytes(opt), rss_growth_bytes=rss.growth_bytes(),
               rss_method=rss.method)
    if name in OURS:
        out["ag_bytes_per_step"] = C.BYTES["all_gather"] / steps
        out["rs_bytes_per_step"] = C.BYTES["reduce_scatter"] / steps
        out["ag_calls_per_step"] = C.COUNTS["all_gather"] / steps
        out["rs_calls_per_step"] = C.COUNTS["reduce_scatter"] / steps
    if ddp_counter is not None:
        out["ar_bytes_per_step"] = ddp_counter.bytes / steps
    if _NOTES.get(name):
        out["notes"] = _NOTES[name]
    return out


def _run_backend(name: str, cfg: BenchConfig, batches) -> dict:
    row: dict = {"backend": name}
    M.run_guarded(row, lambda: _train(name, cfg, batches))
    gc.collect()
    return row


def rank_main(cfg: BenchConfig) -> dict:
    """Entry of one rank: returns ``{"rank", "threads", "rows": [...]}``."""
    def rows(rank: int) -> list[dict]:
        batches = _batches(cfg, rank)
        return [_run_backend(name, cfg, batches) for name in cfg.backends]

    return M.run_rank(cfg.timeout_s, rows)
