"""Which algorithm runs an all-gather or a reduce-scatter, and which
``torch.distributed`` function runs a native one. core/collectives.py
issues the calls; this module only chooses.

[Note: collective algorithms]
On the host, gloo's reduce-scatter and all-gather are slower than an
all-to-all that moves the same bytes. At 2 ranks with one thread each
(2-core machine, torch 2.13, fp32, median of 7):

    MiB  reduce-scatter  all-to-all + sum of N blocks   all-gather  N copies + all-to-all
      1        2.0 ms              0.5 ms                  1.1 ms          0.5 ms
      7        8.7 ms              3.6 ms                  5.7 ms          4.3 ms
     28       28.3 ms             14.6 ms                 15.2 ms         19.9 ms
     64       86.9 ms             34.0 ms                 65.1 ms         45.5 ms

gloo's all-gather also allocates two output-sized temporaries per call,
which under glibc's default settings fragment the heap (see core/buffers.py
[Note: buffer reuse]); the all-to-all writes straight into our buffers. Each
variant sends (N-1)/N of the full tensor per rank, as the ring algorithms
do, so the volume is unchanged; the extra full-size buffer (received blocks,
or N copies of the shard) comes from the pool. gloo therefore uses
all-to-all for both at every size; NCCL keeps its native collectives.
``FULLSHARD_COLLECTIVES`` = ``native`` or ``all_to_all`` overrides the
choice on host tensors (tests run both).

Only when nobody watches: instrumentation expects to see our traffic as the
collectives it stands for. While a torch dispatch mode is active (torch's
``CommDebugMode`` counts each call by the c10d op it dispatches, so the
all-to-all would count as ``alltoall_base_``) or a ``torch.distributed``
function of the op was replaced (a wrapper that counts calls, checks the
reduce dtype or injects delays), gloo uses the native collective too
(``c10d._allgather_base_`` / ``_reduce_scatter_base_`` under
``CommDebugMode``). The native function is looked up on ``torch.distributed``
at every call, never bound at import, so a replacement installed later is
the one called. A profiler does not switch the algorithm (its timings are
of the traffic as it runs): it shows the all-to-all. The
world_size_invariant fold (core/invariant.py) is an all-to-all by design and
stays one.
"""
from __future__ import annotations

import os
from typing import Optional

import torch
import torch.distributed as dist

from . import torch_private

# torch's own functions behind each public name, to tell a user's replacement
# (a wrapper that counts or checks calls) from torch's; see native_fn.
_C10D = dist.distributed_c10d
_TORCH_FNS = {name: getattr(_C10D, name, None) for name in
              ("all_gather_single", "all_gather_into_tensor", "reduce_scatter_single", "reduce_scatter_tensor")}
# op -> (newer torch's name, the older name that newer torch keeps as a deprecated alias)
_NAMES = {"all_gather": ("all_gather_single", "all_gather_into_tensor"),
          "reduce_scatter": ("reduce_scatter_single", "reduce_scatter_tensor")}


def native_fn(op: str):
    """torch.distributed's function for ``op`` (``"all_gather"`` or
    ``"reduce_scatter"``), looked up now: a replacement installed under
    either of its names (``all_gather_into_tensor`` / ``all_gather_single``,
    ``reduce_scatter_tensor`` / ``reduce_scatter_single``) is the one
    called; else the newer name (the older is torch's deprecated alias)."""
    new, old = _NAMES[op]
    fn = getattr(dist, old)
    if fn is _TORCH_FNS[old] and hasattr(dist, new):
        fn = getattr(dist, new)
    return fn


def watched(op: str) -> bool:
    """Whether something watches ``op``'s calls (see [Note: collective
    algorithms]): a dispatch mode is active (``CommDebugMode`` counts the
    c10d op each call dispatches) or a ``torch.distributed`` function of
    ``op`` was replaced (a wrapper that counts, checks or delays calls)."""
    return torch_private.dispatch_mode_active() or \
        any(getattr(dist, name, None) is not _TORCH_FNS[name] for name in _NAMES[op])


def algorithm(group, device: torch.device, op: Optional[str] = None) -> str:
    """``"all_to_all"`` or ``"native"``: how ``collectives.all_gather`` and
    ``collectives.reduce_scatter`` (``op``) run on ``group`` for tensors on
    ``device``; see [Note: collective algorithms] (measured on host tensors
    only, so other devices keep the native collectives). Native also while
    ``op`` is :func:`watched`.

    Raises:
        ValueError: ``FULLSHARD_COLLECTIVES`` is set to something else.
    """
    forced = os.environ.get("FULLSHARD_COLLECTIVES", "").strip().lower()
    if forced:
        if forced not in ("native", "all_to_all"):
            raise ValueError(f"FULLSHARD_COLLECTIVES={forced!r}: use 'native' or 'all_to_all'")
        return forced
    if dist.get_backend(group) != "gloo" or device.type != "cpu":
        return "native"
    return "native" if op is not None and watched(op) else "all_to_all"
