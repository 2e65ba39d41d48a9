"""A unit's all-gather and reduce-scatter (and HYBRID_SHARD's all-reduce)
issued on the side streams of its compute device, so they overlap the
compute stream's work (core/streams.py [Note: streams and events] says what
waits on what). Without side streams (the CPU; CUDA with ``FULLSHARD_STREAMS=0``)
each function issues exactly today's asynchronous collective on the
current stream and returns its work handle.

Every function returns something with ``wait()``: called on the compute
stream before the collective's output is read, it makes that stream wait
for the collective (a CUDA event) or, without side streams, waits on the
work handle as before.
"""
from __future__ import annotations

from typing import Optional

import torch

from . import collectives, streams


class ShardsReady:
    """A root's forward event (core/state.py ``pre_forward``), recorded after every write to the shards
    before the forward (the optimizer step, a load), with each unit's ``Unit.shard_versions`` (the version
    counters a kept unit is checked by) at that moment. A unit written in place since (by a forward pre-hook
    of the root registered after wrapping, or during the forward) gets no early event: its all-gather then
    waits on all the compute so far. A write through ``.data`` bumps no counter, so it is not seen (as
    autograd's checks do not see it)."""

    def __init__(self, event, parts: list):
        self.event = event
        self._seen = {id(p): (p, p.flat_shard, p.shard_versions()) for p in parts}

    @classmethod
    def record(cls, device: torch.device, runtimes: list) -> Optional["ShardsReady"]:
        """Record on ``device``'s compute stream; None without side streams."""
        event = streams.record(streams.current(device))
        return None if event is None else cls(event, [p for rt in runtimes for p in (rt.unit, *rt.unit.side)])

    def event_for(self, part, send: torch.Tensor):
        """The early event for the all-gather of ``part``'s ``send``, or None (not its flat shard as seen
        here, or written since)."""
        seen = self._seen.get(id(part))
        fresh = seen is not None and seen[0] is part and seen[1] is send is part.flat_shard
        return self.event if fresh and seen[2] == part.shard_versions() else None


class SideWork:
    """A collective issued on a side stream: ``event`` marks its end there.
    The tensors in ``keep`` (read or written by the side stream) stay alive
    until the compute stream waits on it, so the caching allocator cannot
    reuse their memory ahead of the side stream."""

    def __init__(self, event, device: torch.device, keep: tuple = ()):
        self.event, self.device, self.keep = event, device, keep

    def wait(self) -> bool:
        """Make the current (compute) stream wait for the collective; no host sync."""
        if self.event is not None:
            streams.wait(self.event, streams.current(self.device))
            self.event, self.keep = None, ()
        return True

    def is_completed(self) -> bool:
        return self.event is None or self.event.query()


def all_gather(out: torch.Tensor, send: torch.Tensor, group, tag: str,
               cast: Optional[tuple[torch.device, torch.dtype]] = None, after: Optional[tuple] = None):
    """All-gather ``send`` (1-D, this rank's shard) into ``out`` (1-D,
    ``group_size × send.numel()`` elements, on the compute device),
    asynchronously. ``cast``: (device, dtype) to copy ``send`` to first
    (mixed precision, an offloaded shard); on side streams the copy runs on
    the copy-in stream. The copy is written into this rank's own block of
    ``out`` and gathered in place (as torch FSDP2 does): no separate send
    buffer, and NCCL (or the one-rank copy) has no local block to move.
    ``after``: CUDA events that together mark ``send``'s writers and ``out``'s
    earlier users done; the side streams wait on them instead of on all the
    compute stream's work so far (None), so the all-gather may overlap that
    work (core/streams.py [Note: streams and events]).

    Returns:
        A handle whose ``wait()`` precedes any read of ``out``, or None
        (one-rank group without side streams: copied already).
    """
    sides = streams.side(out.device)
    if cast is not None:
        own = out.narrow(0, collectives.group_rank(group) * send.numel(), send.numel())
    if sides is None:
        if cast is not None:
            send = own.copy_(send, non_blocking=True)
        return collectives.all_gather(out, send, group, async_op=True, tag=tag)
    # Without ``after``: after the buffers were taken, so their earlier users and the shard's writers are done.
    ready = after or (streams.record(streams.current(out.device)),)
    copied = None
    if cast is not None:
        with streams.on(sides.copy_in):
            for event in ready:
                streams.wait(event, sides.copy_in)
            send = own.copy_(send, non_blocking=True)
            copied = streams.record(sides.copy_in)
    with streams.on(sides.all_gather):
        for event in ready:
            streams.wait(event, sides.all_gather)
        streams.wait(copied, sides.all_gather)
        _issue_and_wait(collectives.all_gather(out, send, group, async_op=True, tag=tag))
        done = streams.record(sides.all_gather)
    return SideWork(done, out.device, (send, out))


def reduce_scatter(out: torch.Tensor, full: torch.Tensor, group, tag: str, replicas=None):
    """Reduce-scatter ``full`` (rank-major blocks, written on the compute
    stream) into ``out``, asynchronously; with ``replicas`` (a group, side
    streams only) then all-reduce ``out`` over it.

    Returns:
        (handle whose ``wait()`` precedes any read of ``out`` and any reuse
        of ``full``, or None; whether ``out`` was all-reduced over ``replicas``).
    """
    sides = streams.side(out.device)
    if sides is None:
        return collectives.reduce_scatter(out, full, group, async_op=True, tag=tag), False
    ready = streams.record(streams.current(out.device))
    with streams.on(sides.reduce_scatter):
        streams.wait(ready, sides.reduce_scatter)
        _issue_and_wait(collectives.reduce_scatter(out, full, group, async_op=True, tag=tag))
        done = streams.record(sides.reduce_scatter)
    if replicas is not None:
        with streams.on(sides.all_reduce):
            streams.wait(done, sides.all_reduce)
            collectives.all_reduce(out, replicas, "sum", tag=tag + " replicas")
            done = streams.record(sides.all_reduce)
    return SideWork(done, out.device, (full, out)), replicas is not None


def _issue_and_wait(work) -> None:
    """Wait for ``work`` inside the current side stream: NCCL makes that
    stream (not the compute stream) wait; gloo completes on the host."""
    if work is not None:
        work.wait()
