"""What the comparison measures on one rank: bytes of model state, peak RSS,
and the ZeRO formula it is checked against. No ``torch.distributed`` here.
"""
from __future__ import annotations

import datetime
import os
import re
import resource
import statistics
import traceback
from typing import Iterable, Optional

import torch
import torch.distributed as dist
import torch.nn as nn

from fullshard.core import packed, torch_private
from fullshard.core.buffers import POOL
from fullshard.train.launcher import threads_per_rank

_STATUS = "/proc/self/status"
_CLEAR_REFS = "/proc/self/clear_refs"


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``t``: the local shard of a ``DTensor`` (torch FSDP2's
    parameters, gradients and optimizer state), else ``t`` itself."""
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t


def storage_bytes(tensors: Iterable[Optional[torch.Tensor]]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (None and empty storages skipped).

    Views of one flat buffer (a unit's shard, a DDP bucket) are counted once,
    with the whole storage, padding included. A ``DTensor`` counts its local shard;
    a traceable tensor subclass (torchao's ``NF4Tensor``) the storages of its inner tensors.
    """
    seen: dict[int, int] = {}
    for t in _plain(tensors):
        st = t.untyped_storage()
        if st.nbytes() == 0:
            continue
        seen[st.data_ptr()] = max(seen.get(st.data_ptr(), 0), st.nbytes())
    return sum(seen.values())


def _plain(tensors: Iterable[Optional[torch.Tensor]]):
    """The plain tensors holding ``tensors``' memory: DTensors' local shards, subclasses' inner tensors."""
    for t in tensors:
        if t is None:
            continue
        yield from packed.inner_tensors(local_tensor(t))


def param_bytes(model: nn.Module) -> int:
    """Bytes of the storages of ``model.parameters()`` on this rank (shards when sharded)."""
    return storage_bytes(model.parameters())


def grad_bytes(model: nn.Module) -> int:
    """Bytes of the storages of the parameters' ``.grad`` on this rank."""
    return storage_bytes(p.grad for p in model.parameters())


def optim_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Sum of ``numel * element_size`` over every tensor in ``optimizer.state``
    (AdamW: ``exp_avg``, ``exp_avg_sq`` and the 0-dim fp32 ``step`` per parameter;
    a ``DTensor`` counts its local shard)."""
    return sum(local_tensor(v).numel() * v.element_size() for s in optimizer.state.values()
               for v in s.values() if torch.is_tensor(v))


def zero_model_state_bytes(psi: int, world_size: int, sharded: bool) -> int:
    """Per-rank model-state bytes of fp32 AdamW training, ZeRO formula.

    fp32 parameters (4 B) + fp32 gradients (4 B) + Adam ``m`` and ``v`` (8 B)
    = 16 B per parameter. Sharded over N ranks (ZeRO stage 3 / FULL_SHARD,
    Rajbhandari et al., "ZeRO", SC 2020, §5): 16Ψ/N. Replicated (DDP): 16Ψ.
    SHARD_GRAD_OP at rest (after the optimizer step) holds the same shards as
    FULL_SHARD, so it is also 16Ψ/N; its full parameters live only between a
    unit's forward and its backward.
    """
    return 16 * psi // world_size if sharded else 16 * psi


def median(xs: list[float]) -> float:
    return statistics.median(xs)


def _status_kib(key: str) -> Optional[int]:
    try:
        with open(_STATUS) as f:
            m = re.search(rf"^{key}:\s+(\d+) kB", f.read(), re.M)
    except OSError:
        return None
    return int(m.group(1)) if m else None


class PeakRSS:
    """Peak resident-set growth of this process over a window.

    Preferred method ``VmHWM``: :meth:`start` reads ``VmRSS`` and resets the
    kernel's high-water mark (``echo 5 > /proc/self/clear_refs``, Linux ≥ 4.0);
    :meth:`growth_bytes` is ``VmHWM - VmRSS(start)``. So each backend run in
    the same process gets its own peak. Fallback ``ru_maxrss`` (when
    ``/proc`` cannot be reset): ``getrusage`` max RSS, which never resets, so
    the growth of a later backend only shows above an earlier one's peak.
    """

    def __init__(self) -> None:
        self.method = "VmHWM"
        self._start_kib = 0

    @property
    def start_bytes(self) -> int:
        """The resident set at :meth:`start` (``VmRSS``; ``ru_maxrss`` in the fallback)."""
        return self._start_kib * 1024

    def peak_bytes(self) -> int:
        """The resident set's high-water mark since :meth:`start` (``VmHWM``;
        in the fallback ``ru_maxrss``, which is never reset)."""
        if self.method == "VmHWM":
            return (_status_kib("VmHWM") or 0) * 1024
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024

    def start(self) -> None:
        rss = _status_kib("VmRSS")
        try:
            with open(_CLEAR_REFS, "w") as f:
                f.write("5")
        except OSError:
            rss = None
        if rss is None:
            self.method = "ru_maxrss"
            rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
        self._start_kib = rss

    def growth_bytes(self) -> int:
        """``peak_bytes() - start_bytes``, at least 0."""
        return max(0, self.peak_bytes() - self.start_bytes)


def peak_allocated_bytes(fn) -> tuple[object, int]:
    """Run ``fn()`` and return ``(its result, peak bytes torch allocated on the CPU during it)``.

    The peak is above what was allocated when ``fn`` started: the torch
    profiler's allocator events (``profile_memory=True``; each allocation
    +bytes, each free -bytes, storage ``resize_`` included) replayed in time
    order, and the running sum's maximum. Tensors already live at
    the start (parameter shards, optimizer state) are not in it. The buffer
    pool (core/buffers.py) is emptied first, so the unit buffers ``fn`` uses
    are allocated, and counted, during it; the pool keeps them afterwards, so
    they count until the end, as they do in the process's memory.
    """
    from torch.profiler import ProfilerActivity, profile

    POOL.clear()

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        out = fn()
    live = peak = 0
    for _, nbytes in sorted(torch_private.profiler_allocations(prof)):
        live += nbytes
        peak = max(peak, live)
    return out, peak


def run_guarded(row: dict, fn) -> dict:
    """Fill ``row`` with ``fn()``'s dict; an exception becomes a one-line
    ``row["error"]`` (plus ``row["traceback"]``), never hidden. Then one MAX
    all-reduce of a failure flag tells every rank whether any rank failed, so
    ranks leave a failed configuration in step.
    """
    try:
        row.update(fn())
    except Exception as e:  # reported in the row
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        row["error"] = f"{type(e).__name__}: {first}"[:200]
        row["traceback"] = traceback.format_exc()
    flag = torch.tensor([0.0 if "error" not in row else 1.0])
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    if flag.item() and "error" not in row:
        row["error"] = "another rank failed"
    return row


def run_rank(timeout_s: float, rows_of_rank) -> dict:
    """Body of one benchmark rank: set intra-op threads (cores // local ranks),
    join the gloo group, and return ``{"rank", "threads", "rows": rows_of_rank(rank)}``."""
    torch.set_num_threads(threads_per_rank(int(os.environ.get("LOCAL_WORLD_SIZE", "1"))))
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=timeout_s))
    try:
        rank = dist.get_rank()
        return {"rank": rank, "threads": torch.get_num_threads(), "rows": rows_of_rank(rank)}
    finally:
        dist.destroy_process_group()
