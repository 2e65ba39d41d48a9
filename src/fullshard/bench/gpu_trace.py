"""What ``python -m fullshard.bench.gpu`` measures of one step besides time and memory: host syncs
(``torch.cuda.set_sync_debug_mode("warn")``'s warnings, counted, each with the Python frames that
made it) and the fraction of all-gather and reduce-scatter kernel time hidden behind compute kernels on
other streams (from a torch.profiler chrome trace of the step, which is saved); also that fraction for
the other kernels of the side streams (``side_copy``: the copy-in's casts, which at world size 1, with
no collective kernel at all, are what overlap can hide).

The overlap analysis is a pure function over kernel intervals (:func:`hidden_time`), so it is tested on
synthetic events without a GPU; the CUDA-only parts (:func:`host_sync_sites`, :func:`profile_step`) are
called only with a GPU.
"""
from __future__ import annotations

import json
import os
import traceback
import warnings
from typing import Callable, Iterable, NamedTuple

import torch

COMM_KINDS = ("all_gather", "reduce_scatter", "all_reduce")
"""Kinds of communication kernels; every other kernel is ``compute`` (or ``side_copy``)."""
SIDE_COPY = "side_copy"
"""A non-communication kernel off the compute stream (the stream with the most compute kernel time)."""


class Kernel(NamedTuple):
    """One kernel's interval on the GPU."""

    start: float
    """Start, in microseconds."""
    end: float
    """End, in microseconds (>= start)."""
    stream: int
    kind: str
    """One of :data:`COMM_KINDS`, or ``compute``."""


def kind_of(name: str) -> str:
    """The kind of a kernel from its name (NCCL's ``ncclDevKernel_AllGather_RING_LL`` -> ``all_gather``)."""
    low = name.lower().replace("_", "")
    if "nccl" not in low:
        return "compute"
    for kind in COMM_KINDS:
        if kind.replace("_", "") in low:
            return kind
    return "compute"  # another NCCL kernel (send/recv, broadcast): not one this bench reports


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[list[float]] = []
    for s, e in sorted(intervals):
        if merged and s <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], e)
        else:
            merged.append([s, e])
    return [(s, e) for s, e in merged]


def hidden_time(kernels: Iterable[Kernel]) -> dict[str, dict[str, float]]:
    """Per communication kind, its kernels' total time and the part of it during which a compute kernel
    ran on another stream.

    Args:
        kernels: the step's kernels, any order.
    Returns:
        ``{kind: {"total_us", "hidden_us", "hidden_fraction"}}`` for each kind in :data:`COMM_KINDS`
        and :data:`SIDE_COPY` that has kernels (``hidden_fraction`` in [0, 1]; 0 when the total is 0).
    """
    kernels = list(kernels)
    out: dict[str, dict[str, float]] = {}
    for k in kernels:
        if k.kind not in COMM_KINDS + (SIDE_COPY,):
            continue
        # Compute on other streams only: a kernel on its own stream cannot run beside it.
        busy = _union([(c.start, c.end) for c in kernels if c.kind == "compute" and c.stream != k.stream])
        hidden = sum(max(0.0, min(e, k.end) - max(s, k.start)) for s, e in busy)
        row = out.setdefault(k.kind, {"total_us": 0.0, "hidden_us": 0.0})
        row["total_us"] += k.end - k.start
        row["hidden_us"] += hidden
    for row in out.values():
        row["hidden_fraction"] = row["hidden_us"] / row["total_us"] if row["total_us"] else 0.0
    return out


def side_copies(kernels: Iterable[Kernel]) -> list[Kernel]:
    """``kernels`` with each ``compute`` kernel off the compute stream (the stream with the most
    ``compute`` kernel time) marked :data:`SIDE_COPY`."""
    kernels = list(kernels)
    per_stream: dict[int, float] = {}
    for k in kernels:
        if k.kind == "compute":
            per_stream[k.stream] = per_stream.get(k.stream, 0.0) + k.end - k.start
    main = max(per_stream, key=per_stream.get) if per_stream else None
    return [k._replace(kind=SIDE_COPY) if k.kind == "compute" and k.stream != main else k for k in kernels]


def kernels_of_trace(path: str) -> list[Kernel]:
    """The GPU kernels of a torch.profiler chrome trace (events of category ``kernel``), side-stream
    copies marked (:func:`side_copies`)."""
    with open(path) as f:
        events = json.load(f).get("traceEvents", [])
    return side_copies(Kernel(float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0.0)),
                              int(e.get("args", {}).get("stream", -1)), kind_of(e.get("name", "")))
                       for e in events if e.get("cat") == "kernel" and "ts" in e)


SYNC_WARNING = "called a synchronizing CUDA operation"  # c10/cuda/CUDAFunctions.cpp, warn_or_error_on_sync


def host_sync_sites(step: Callable[[], None], frames: int = 6) -> list[str]:
    """Run ``step`` under ``torch.cuda.set_sync_debug_mode("warn")``; one entry per synchronizing CUDA
    call it warned about (CUDA only): ``"file:line < caller:line < ...: message"``, the innermost
    ``frames`` Python frames first, so a bench row's host syncs can be located from its JSON."""
    sites = []

    def record(message, category, filename, lineno, file=None, line=None):
        # torch's warning for each synchronizing call; not the one-time "Synchronization debug mode is a
        # prototype feature" warning that enabling the mode itself emits (it was counted as 1 sync per step).
        if SYNC_WARNING in str(message):
            stack = [f for f in traceback.extract_stack()[:-1] if not f.filename.endswith("warnings.py")]
            where = " < ".join(f"{os.path.basename(f.filename)}:{f.lineno}" for f in reversed(stack[-frames:]))
            sites.append(f"{where}: {str(message).splitlines()[0][:160]}")

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sites


def count_syncs(sites: list[str]) -> int:
    """How many of :func:`host_sync_sites`' entries are synchronizing calls (entries that runs before the
    message check recorded for the mode's own prototype warning are not)."""
    return sum(SYNC_WARNING in site for site in sites)


def profile_step(step: Callable[[], None], path: str) -> dict[str, dict[str, float]]:
    """Run ``step`` under torch.profiler (CPU and CUDA activity), save its chrome trace at ``path`` and
    return :func:`hidden_time` of its kernels (CUDA only)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    prof.export_chrome_trace(path)
    return hidden_time(kernels_of_trace(path))
