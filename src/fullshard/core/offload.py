"""Host gradient buffers of CPU-offloaded units, and the callbacks that run
once a unit's gradient shards are on the host.

[Note: offloaded gradient buffers]
A unit with ``offload_params`` keeps its gradient shards in host memory.
Its reduced block is copied into a host buffer the unit keeps (pinned when
``pin_memory`` and the compute device is CUDA), allocated once and reused
by every backward, and the sharded parameters' ``.grad`` are views of it.
A buffer is written only when nothing else holds its memory
(:func:`~fullshard.core.torch_private.storage_users` is 1: every ``.grad``
view was dropped by ``zero_grad()``, and nobody kept one); otherwise
(gradients accumulated over backwards, ``zero_grad(set_to_none=False)``, a
``.grad`` kept by the user) the other of the unit's two buffers is used, and
only when both are held is a new one allocated. So the steady state of any
loop allocates no host memory for gradients, and a kept gradient is never
overwritten.

On CUDA, when no ``.grad`` is added to (every written parameter had
``grad None``), the copy into a pinned buffer is non-blocking, and an event
recorded after it is what the host waits on before it reads the values.
With side streams (core/streams.py) the copy runs on the device-to-host
stream, after an event the compute stream records once the reduced block is
final, so the next units' backward does not queue behind it (torch FSDP2
copies on its reduce-scatter stream); the device block it reads is kept
alive until the copy's event has completed (checked without blocking at
each later copy, or waited on), never given back to the allocator while the
copy may still read it. Without side streams the copy is on the compute
stream, ordered after the reduce. The host waits on the event in the parameters'
post-accumulate-grad hooks (core/post_accumulate.py), the grads-ready
callbacks below (the overlapped optimizer, ``fullshard.optim.OffloadAdamW``)
and, for every unit, the end of backward (so ``.grad`` is final when
``backward()`` returns, whatever reads it next). Adding into an existing
``.grad`` needs the values on the host at once: that copy is blocking, as
torch FSDP2's. On the CPU every copy is synchronous and no event exists.
"""
from __future__ import annotations

import weakref
from typing import Callable, Optional

import torch

from . import streams, torch_private

_KEEP = 2  # buffers per unit: one held by .grad, one to receive the next reduce


class _HostGrads:
    """One unit's host gradient buffers and the event of the last copy into one."""

    def __init__(self):
        self.buffers: list[torch.Tensor] = []
        self.event = None  # torch.cuda.Event of a pending non-blocking copy, or None
        self.source: Optional[torch.Tensor] = None  # the device block a side-stream copy reads, until it is done


# States whose side-stream copy may still read their source: the sources are dropped (given back to the
# caching allocator) only once the copy's event has completed. Touched on the thread that runs backward.
_IN_FLIGHT: list[_HostGrads] = []


_STATE: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # unit -> _HostGrads
_READY: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # unit -> {key: callback}


def _state(unit) -> _HostGrads:
    found = _STATE.get(unit)
    if found is None:
        found = _STATE[unit] = _HostGrads()
    return found


def buffers(unit) -> list[torch.Tensor]:
    """The host gradient buffers ``unit`` keeps (at most two), oldest first."""
    found = _STATE.get(unit)
    return list(found.buffers) if found is not None else []


def to_host(unit, reduced: torch.Tensor, dtype: torch.dtype, blocking: bool) -> torch.Tensor:
    """``reduced`` (1-D, this rank's reduced gradient shard, on the compute
    device) copied as ``dtype`` into a host buffer of ``unit`` that nothing
    else holds (see [Note: offloaded gradient buffers]); the same bits as
    ``reduced.to("cpu", dtype)``.

    Args:
        unit: an offloaded unit.
        reduced: the reduced gradient shard, ``layout.grad_shard_numel`` elements.
        dtype: the gradient dtype.
        blocking: the caller reads the values at once (a non-blocking copy
            needs a CUDA source and a pinned buffer; the host then waits on
            :func:`wait` before reading).

    Returns:
        The host buffer (1-D, ``reduced.numel()`` elements, ``dtype``).
    """
    buf = _free(unit, reduced.numel(), dtype)
    st = _state(unit)
    async_copy = not blocking and reduced.device.type == "cuda" and buf.is_pinned()
    sides = streams.side(reduced.device) if async_copy else None
    if sides is None:
        buf.copy_(reduced, non_blocking=async_copy)
        st.event = streams.host_copy_event(reduced.device) if async_copy else None
        return buf
    _release_copied()
    if reduced.dtype != dtype:  # cast on the compute stream, where the engine allocates (core/streams.py)
        reduced = reduced.to(dtype)
    streams.wait(streams.record(streams.current(reduced.device)), sides.to_host)  # the block is final
    with streams.on(sides.to_host):
        buf.copy_(reduced, non_blocking=True)
        st.event = streams.record(sides.to_host)
    st.source = reduced  # its memory must not be reused before the copy has read it
    if st not in _IN_FLIGHT:
        _IN_FLIGHT.append(st)
    return buf


def _release_copied() -> None:
    """Drop the sources of side-stream copies that have completed (waited on, or ``event.query()``,
    which does not block the host)."""
    for st in list(_IN_FLIGHT):
        if st.source is None or st.event is None or st.event.query():
            st.source = None
            _IN_FLIGHT.remove(st)


def zeros(unit, numel: int, dtype: torch.dtype) -> torch.Tensor:
    """A zeroed host buffer of ``unit`` that nothing else holds (1-D,
    ``numel`` elements, ``dtype``): the sentinel gradients of a ``no_sync``
    window (core/stash.py), which the synchronizing reduce then adds into."""
    return _free(unit, numel, dtype).zero_()


def _free(unit, numel: int, dtype: torch.dtype) -> torch.Tensor:
    """One of ``unit``'s buffers that nothing else holds, else a new one (the oldest is forgotten)."""
    st = _state(unit)
    wait(unit)  # a copy still landing in one of them must not land after what the caller writes
    buf = next((b for b in st.buffers if b.dtype == dtype and b.numel() == numel
                and torch_private.storage_users(b) == 1), None)
    if buf is None:
        device = unit.cfg.compute_device
        pin = unit.cfg.pin_memory and device.type == "cuda"
        buf = torch.empty(numel, dtype=dtype, device="cpu", pin_memory=pin)
        st.buffers = (st.buffers + [buf])[-_KEEP:]
    return buf


def wait(unit) -> None:
    """Block the host until ``unit``'s last copy to a host buffer has landed
    (nothing to wait for on the CPU, or after a blocking copy). Safe from
    any thread, any number of times."""
    found = _STATE.get(unit)
    event = None if found is None else found.event
    if event is not None:
        event.synchronize()
        if found.event is event:  # the copy has read its source (dropped from _IN_FLIGHT at the next sweep)
            found.source = None


def wait_all(units) -> None:
    """:func:`wait` for each of ``units`` (the end of backward)."""
    for unit in units:
        wait(unit)
    _release_copied()


def on_grads_ready(unit, key: object, fn: Optional[Callable]) -> None:
    """Call ``fn(unit)`` each time ``unit``'s reduced gradient has been
    written into its sharded parameters' ``.grad`` (after their
    post-accumulate-grad hooks; core/post_accumulate.py), under ``key``
    (an object held weakly is fine; a second call with the same key
    replaces, ``fn=None`` removes). The gradient may still be in flight to
    the host: call :func:`wait` before reading it."""
    table = _READY.get(unit)
    if table is None:
        table = _READY[unit] = {}
    if fn is None:
        table.pop(key, None)
    else:
        table[key] = fn


def run_ready(unit) -> None:
    """Run ``unit``'s grads-ready callbacks (see :func:`on_grads_ready`), in registration order."""
    table = _READY.get(unit)
    for fn in list(table.values()) if table else ():
        fn(unit)
