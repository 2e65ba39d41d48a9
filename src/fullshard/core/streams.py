"""CUDA streams and events of the engine: one set of side streams per
device, and helpers that are no-ops where there are none (the CPU, or
CUDA with ``FULLSHARD_STREAMS=0``), so the same engine code runs on both.

On by default on CUDA. A missing wait between streams would be a silent
wrong result, so tests/dist/test_cuda.py (``test_streams_on_equal_streams_off``:
side streams slowed after each wait, NCCL at world size 1 and gloo with 2
ranks on one GPU; ``test_no_host_sync_in_forward_backward``) checks it;
``scripts/gpu_check.sh`` runs them. They passed on an NVIDIA H200 with
torch 2.11.0+cu130. ``FULLSHARD_STREAMS=0`` gives the single-stream path.

[Note: streams and events]

The stream that runs forward and backward (the *compute* stream) is
whatever stream is current when the engine runs; it is never stored. Per
compute device there are five side streams: torch FSDP2's four, copy-in,
all-gather, reduce-scatter and all-reduce (HYBRID_SHARD's replicas), and a
device-to-host stream for offloaded gradients. What waits on what:

* unshard: the compute stream records an event *after* the all-gather
  output buffer is taken (the shard's values are final: optimizer step,
  copy-in of a new value, the previous users of the buffer). The copy-in
  stream waits on it and casts / copies the shard to the compute dtype and
  device (only when they differ), into this rank's own block of the output
  (gathered in place); the all-gather stream waits on both, issues
  the all-gather and waits for it *inside* the stream (so NCCL's internal
  stream, or gloo's copies of CUDA tensors, are ordered before the
  all-gather stream's next work), then records the gather event. Before the
  copy-out into the unit's full parameters, the compute stream waits on the
  gather event; only then are the send and gather buffers released. A
  one-rank shard group casts into the full parameters themselves (their
  memory taken before the first event), with no gather buffer or copy-out.
* forward all-gathers: inside a root's forward the side streams wait
  instead on two earlier events: the one the root's pre-forward recorded
  (after the optimizer step, a load and ``set_post_optim_event``'s event:
  every write to the shards; kept only once that pre-forward succeeded, and
  until the root's post-forward; a unit written in place after it, as by a
  forward pre-hook of the root, is told apart by its version counters:
  ``overlap.ShardsReady``) and the one recorded when the buffer went back
  to the pool (after its last use; the pool hands out its least recently
  returned buffer here, whose users are the furthest behind). So unit k's
  all-gather runs while unit k-1 computes, as torch FSDP2's do. Where
  either is unknown the event above is used: a buffer new from the
  allocator, a unit with all-gather extensions (their pre-hook writes the
  shard), a kept partial shard, a memory strategy's buffers, every
  unshard outside a root's forward (backward's prefetch is issued early
  enough anyway), and a one-rank unit's cast on torch before 2.12 (its
  full parameters' memory then comes from the allocator: core/buffers.py
  [Note: buffer reuse]). tests/dist/test_stream_schedule.py checks the whole
  schedule on the CPU (stand-in streams with vector clocks and a race
  detector over every op's memory) and that forward all-gathers wait only on
  earlier work; the CUDA test runs with the compute stream slowed too.
* reduce: the full gradient is copied into the reduce-scatter input on the
  compute stream (so autograd's gradient may be freed at once, as torch
  FSDP2 does); the reduce-scatter stream waits on the compute stream's event
  recorded after that copy, runs the reduce-scatter (waited inside the
  stream) and records its event. With replicas and nothing held back
  (``set_requires_all_reduce(False)``), the all-reduce stream waits on that
  event, all-reduces and records its own. The compute stream waits on the
  last event before anything reads the reduced block (the all-reduce hook,
  the division, the accumulation into ``.grad``, the used flags) and before
  the reduce-scatter input goes back to the pool.
* offloaded gradients: the device-to-host stream waits on a compute event
  recorded once the reduced block is final (after the division and the
  all-reduce hook), copies it into the unit's pinned host buffer and records
  the event the host waits on before reading ``.grad``; the block stays
  referenced until that event has completed (core/offload.py [Note:
  offloaded gradient buffers]). Torch FSDP2 copies on its reduce-scatter
  stream; a stream of its own keeps the copy from delaying the next
  reduce-scatter.
* buffers: every allocation the engine makes is on the compute stream, and
  a side stream touches a buffer only after waiting on a compute event
  recorded after the buffer was taken, so the caching allocator's
  per-stream reuse never hands a block to work that could overtake its last
  use. The pool (core/buffers.py) also records, when a buffer is returned,
  an event on the returning stream, and the stream that takes the buffer
  next waits on it; a buffer it frees first makes the stream that allocated
  it wait on that event.

Events, never ``Tensor.record_stream``: the allocator's record_stream delays
reuse until an unknown later time and hides what waits on what.
Collectives are issued and waited inside their side stream (torch FSDP2's
design): ``work.wait()`` there makes the side stream, not the compute
stream, wait for NCCL, and the compute stream waits only on our events. With
gloo on CUDA tensors the wait also blocks the host (gloo's CUDA support
completes on the host); the result is the same.
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
from typing import Optional

import torch

ENV = "FULLSHARD_STREAMS"
"""Unset or ``1``: side streams on CUDA (the default); ``0`` (or ``off``, ``false``): the single-stream path."""

_FORCED: Optional[bool] = None
_SETS: dict = {}  # torch.device (with index) -> StreamSet


def set_enabled(on: Optional[bool]) -> None:
    """Use side streams on CUDA (True), never (False), or as ``FULLSHARD_STREAMS`` says (None; default on)."""
    global _FORCED
    _FORCED = on


def enabled() -> bool:
    """Whether side streams are used on CUDA devices (see :func:`set_enabled`)."""
    if _FORCED is not None:
        return _FORCED
    return os.environ.get(ENV, "1").strip().lower() not in ("0", "false", "off")


@dataclasses.dataclass(frozen=True)
class StreamSet:
    """The side streams of one CUDA device (see [Note: streams and events])."""

    copy_in: "torch.cuda.Stream"
    all_gather: "torch.cuda.Stream"
    reduce_scatter: "torch.cuda.Stream"
    all_reduce: "torch.cuda.Stream"
    to_host: "torch.cuda.Stream"  # offloaded units' reduced gradients to pinned host memory (core/offload.py)


def side(device: torch.device) -> Optional[StreamSet]:
    """The side streams of ``device``, made on first use; None on a non-CUDA
    device or with streams disabled (every helper below is then a no-op)."""
    device = torch.device(device)
    if device.type != "cuda" or not enabled():
        return None
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    found = _SETS.get(device)
    if found is None:
        # High priority, as torch FSDP2's: communication is on the critical path of the compute it feeds.
        found = StreamSet(*(torch.cuda.Stream(device=device, priority=-1) for _ in dataclasses.fields(StreamSet)))
        _SETS[device] = found
    return found


def current(device: torch.device) -> Optional["torch.cuda.Stream"]:
    """The compute stream of ``device`` (the current one) when it has side streams, else None."""
    if side(device) is None:
        return None
    device = torch.device(device)
    return torch.cuda.current_stream(device if device.index is not None else None)


def on(stream: Optional["torch.cuda.Stream"]):
    """A context making ``stream`` current; does nothing for None."""
    return contextlib.nullcontext() if stream is None else torch.cuda.stream(stream)


def record(stream: Optional["torch.cuda.Stream"]) -> Optional["torch.cuda.Event"]:
    """An event recorded now on ``stream`` (None for None)."""
    return None if stream is None else stream.record_event()


def wait(event: Optional["torch.cuda.Event"], stream: Optional["torch.cuda.Stream"] = None) -> None:
    """Make ``stream`` (None: the current stream) wait on ``event``; does nothing for a None event."""
    if event is None:
        return
    if stream is None:
        event.wait()  # the current stream of the event's device
    else:
        stream.wait_event(event)


def host_copy_event(device: torch.device) -> Optional["torch.cuda.Event"]:
    """An event recorded now on ``device``'s current stream, with or without
    side streams, for the host to wait on (``event.synchronize()``) before it
    reads what a non-blocking copy to pinned host memory issued there
    wrote; None on a non-CUDA device (the copy was synchronous)."""
    device = torch.device(device)
    if device.type != "cuda":
        return None
    return torch.cuda.current_stream(device if device.index is not None else None).record_event()
