"""Reused flat buffers for the per-iteration collectives.

[Note: buffer reuse]
Every iteration each unit needs, once in forward and again in backward, an
all-gather output and an unsharded flat parameter (``N·S`` elements each),
and after its backward a reduce-scatter input (``N`` blocks). Allocating and
freeing them each time costs page faults (system CPU time) on the host, and
under glibc's default settings it also inflates the resident set: a freed
chunk raises glibc's mmap threshold to its size (up to 32 MiB on 64-bit,
``mallopt(3)``, M_MMAP_THRESHOLD), so later chunks of that size come from the
heap, whose freed memory is rarely given back. The pool below keeps freed
buffers per ``(device, nbytes)`` and hands them out again, so a stack of
equal-size units reuses a few buffers for the whole run.

A unit's unsharded flat parameter must keep one storage object for its whole
life: tensors autograd saved in forward are views of it and are read again in
backward. Its memory still comes from the pool: :func:`lend` moves a pooled
storage's memory into it (``UntypedStorage._swap_data_ptr_``, which exchanges
the two storages' data pointers and sizes) and :func:`reclaim` moves it back.
Where torch lacks that method (before 2.12) the storage is resized instead:
the memory then comes from the allocator each time (still counted in use),
and a side stream that writes it early (a one-rank unit's forward cast,
core/streams.py) waits on all the compute stream's work so far instead, as
the allocator may hand out a block that queued compute work still reads.

What the pool keeps is bounded; beyond a bound the least recently returned
buffers are freed:
* buffers in use plus cached never exceed the most ever in use at once
  (``peak_in_use_bytes``; checked where a buffer is returned and before a
  new one is allocated), so the pool adds nothing to the footprint a
  schedule that allocated and freed each buffer would have at its peak. Each
  size keeps as many buffers as were in use together, and sizes whose uses
  never overlap (a GPT's root unit, used at both ends of the step, and its
  blocks) do not each keep their own set;
* at most :data:`CACHE_FACTOR` times the largest buffer is cached;
* nothing is cached once a root unit's forward under grad has ended
  (core/state.py ``post_forward`` empties the cache): activations, and the
  loss's (``B·T·V`` logits), peak between forward and backward, while the
  pool's use is at its lowest, and buffers cached there would sit beside
  them (torch's allocator would give that memory to the activations; torch
  FSDP2 frees its all-gather outputs). Backward takes its first units'
  buffers from the allocator again; they then cycle through the pool. On
  ``fullshard bench --lora`` this was the whole step-peak difference to
  torch FSDP2 but the rounding below: the root's all-gather output and the
  last layer's two buffers, cached at the peak.

On a CUDA device with side streams (core/streams.py [Note: streams and
events]) a returned buffer carries an event recorded on the stream that
returned it (after every use of it there), and the stream that takes it next
waits on that event first; a cached buffer the pool frees makes the stream
that allocated it wait on the event, so the caching allocator cannot reuse
the block ahead of its last use. The taker is also handed that event: a
forward all-gather's side streams wait on it instead of on all the compute
stream's work so far (core/streams.py). Elsewhere no event is made.
"""
from __future__ import annotations

import collections
import threading
from typing import Optional

import torch

from . import streams, torch_private

CACHE_FACTOR = 8
"""Cap on cached bytes, as a multiple of the largest buffer handed out."""

GRANULE_BYTES = 1 << 20
"""Sizes from 1 MiB up are rounded up to a multiple of this, so buffers that
differ by a few elements (a unit's all-gather output and its reduce-scatter
input with used flags) share one free list."""


def _rounded(nbytes: int) -> int:
    if nbytes < GRANULE_BYTES:
        return nbytes
    return -(-nbytes // GRANULE_BYTES) * GRANULE_BYTES


_CAN_SWAP = torch_private.can_swap_storages()


class BufferPool:
    """Free storages keyed by ``(device, nbytes)``, most recently returned last."""

    def __init__(self) -> None:
        # (device, nbytes) -> [(storage, event of its last use or None, the stream that recorded it)]
        self._free: "collections.OrderedDict[tuple, list[tuple]]" = collections.OrderedDict()
        # data_ptr -> the stream that allocated the block (CUDA with side streams only); see _drop.
        self._home: dict = {}
        self._lock = threading.Lock()
        self.cached_bytes = 0
        self.largest_bytes = 0
        self.hits = 0
        self.misses = 0
        self.in_use_bytes = 0
        self.peak_in_use_bytes = 0

    def _take_storage(self, nbytes: int, device: torch.device,
                      oldest: bool = False) -> tuple[torch.UntypedStorage, Optional[object]]:
        """A storage of at least ``nbytes``, and the event recorded after its previous users were done (a
        cached buffer returned on a stream with side streams), after which a side stream may write it; None
        when unknown (new from the allocator: a side stream must wait on the taker's work so far).
        ``oldest``: the least recently returned cached buffer of that size (for a side stream: its last
        users are the furthest behind), not the most recent."""
        nbytes = _rounded(nbytes)
        key = (device, nbytes)
        with self._lock:
            self.largest_bytes = max(self.largest_bytes, nbytes)
            self.in_use_bytes += nbytes
            self.peak_in_use_bytes = max(self.peak_in_use_bytes, self.in_use_bytes)
            stack = self._free.get(key)
            if stack:
                self.hits += 1
                self.cached_bytes -= nbytes
                s, event, recorded_on = stack.pop(0 if oldest else -1)
                if not stack:
                    del self._free[key]
            else:
                self.misses += 1
                s = event = None
                # In use + cached stays within the peak here too (freed before the new one is allocated).
                self._trim(min(CACHE_FACTOR * self.largest_bytes, self.peak_in_use_bytes - self.in_use_bytes))
        if s is None:
            s = torch.UntypedStorage(nbytes, device=device)
            taker = streams.current(device)
            if taker is not None:
                self._home[s.data_ptr()] = taker
        elif event is not None:
            taker = streams.current(device)
            if taker != recorded_on:  # on the same stream the order is already kept
                streams.wait(event, taker)
        return s, event

    def take(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A 1-D tensor of ``numel`` elements (contents undefined) on ``device``."""
        return self.take_with_event(numel, dtype, device)[0]

    def take_with_event(self, numel: int, dtype: torch.dtype, device: torch.device,
                        oldest: bool = False) -> tuple[torch.Tensor, object]:
        """:meth:`take`, and the event after which a side stream may write the buffer (None: unknown);
        ``oldest``: the least recently returned buffer (for a side stream to write early)."""
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        s, event = self._take_storage(nbytes, torch.device(device), oldest)
        return torch.empty(0, dtype=dtype, device=device).set_(s, 0, (numel,)), event

    def give(self, t: Optional[torch.Tensor]) -> None:
        """Return ``t``'s storage for reuse. The caller must hold no other
        reference to it that is still read or written (collectives finished)."""
        if t is None:
            return
        self._give_storage(t.untyped_storage())

    def _give_storage(self, s: torch.UntypedStorage) -> None:
        nbytes = s.nbytes()
        if nbytes == 0:
            return
        key = (s.device, nbytes)
        giver = streams.current(s.device)
        entry = (s, streams.record(giver), giver)
        with self._lock:
            self.in_use_bytes -= nbytes
            self._free.setdefault(key, []).append(entry)
            self._free.move_to_end(key)
            self.cached_bytes += nbytes
            self._trim(min(CACHE_FACTOR * self.largest_bytes, self.peak_in_use_bytes - self.in_use_bytes))

    def _trim(self, limit: int) -> None:
        """Free the least recently returned cached buffers until at most ``limit`` bytes are cached (lock held)."""
        while self.cached_bytes > limit and self._free:
            old_key, stack = next(iter(self._free.items()))
            self._drop(stack.pop(0))
            self.cached_bytes -= old_key[1]
            if not stack:
                del self._free[old_key]

    def _drop(self, entry: tuple) -> None:
        """Free a cached buffer: the stream that allocated it (whose later
        allocations may reuse the block) first waits on its last use."""
        s, event, recorded_on = entry
        home = self._home.pop(s.data_ptr(), None)
        if event is not None and home is not None and home != recorded_on:
            streams.wait(event, home)

    def forget(self, nbytes: int, ptr: Optional[int] = None) -> None:
        """A buffer of ``nbytes`` (at ``ptr``, if known) handed out by
        :meth:`take` will not come back (it lives on as an ordinary tensor):
        stop counting it as in use."""
        with self._lock:
            self.in_use_bytes -= _rounded(nbytes)
            self._home.pop(ptr, None)

    def adopt(self, nbytes: int) -> None:
        """Count ``nbytes`` allocated outside the pool, which :meth:`reclaim`
        will take in, as in use (so reclaiming it does not drive the count negative)."""
        with self._lock:
            self.in_use_bytes += nbytes
            self.peak_in_use_bytes = max(self.peak_in_use_bytes, self.in_use_bytes)

    def lend(self, target: torch.UntypedStorage, nbytes: int, oldest: bool = False) -> Optional[object]:
        """Give the empty storage ``target`` at least ``nbytes`` of pooled memory; returns the event after
        which a side stream may write it, as :meth:`take_with_event` (None: unknown)."""
        if not _CAN_SWAP:  # counted in use all the same, so a buffer from take() may be reclaimed
            target.resize_(nbytes)
            self.adopt(nbytes)
            return None
        src, event = self._take_storage(nbytes, target.device, oldest)
        torch_private.swap_storages(target, src)  # src is now empty; it is dropped
        return event

    def reclaim(self, target: torch.UntypedStorage) -> None:
        """Take ``target``'s memory back into the pool, leaving it empty."""
        nbytes = target.nbytes()
        if nbytes == 0:
            return
        if not _CAN_SWAP:  # freed to the allocator: also forget a take()n block's allocating stream
            with self._lock:
                self.in_use_bytes -= nbytes
                self._home.pop(target.data_ptr(), None)
            target.resize_(0)
            return
        holder = torch.UntypedStorage(0, device=target.device)
        torch_private.swap_storages(target, holder)
        self._give_storage(holder)

    def clear(self) -> None:
        """Free every cached buffer."""
        with self._lock:
            for stack in self._free.values():
                for entry in stack:
                    self._drop(entry)
            self._free.clear()
            self.cached_bytes = 0

    def stats(self) -> dict:
        """Bytes cached and in use (now and at peak), the largest buffer, hits and misses."""
        return {"cached_bytes": self.cached_bytes, "in_use_bytes": self.in_use_bytes,
                "peak_in_use_bytes": self.peak_in_use_bytes, "largest_bytes": self.largest_bytes,
                "hits": self.hits, "misses": self.misses}


POOL = BufferPool()
"""The process's pool, shared by every unit (units of one model run in turn)."""
