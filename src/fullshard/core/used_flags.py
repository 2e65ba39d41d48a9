"""The used flags of a unit's reduce, read on the host at most once per
backward.

[Note: used flags on the host]
Each rank's reduce block carries one flag per parameter, 1 where its
backward gave the parameter a gradient (core/reduce.py); after the sum a
flag of 0 means no rank used the parameter, which then keeps ``grad None``
(DDP with ``find_unused_parameters=True``), and a positive one that some
rank did, so the gradient is written (zeros from the ranks that did not).
Reading the flags is a device-to-host copy, a synchronization on a GPU, so
it is paid the way DDP pays for its used map, at most:

* a rank that used every parameter of the unit knows on the host, from
  autograd, that every summed flag is positive: nothing to read, the
  gradient is written at once (the steady state of most models);
* otherwise the unit's reduced block waits in the root's
  :class:`UsedFlags` until the end of backward, where the flags of every
  waiting unit are read in one batched ``tolist`` and the units are written
  in the order their reduces finished. Once a unit waits, every later unit
  of the backward waits behind it, so each ``.grad`` is written in today's
  order (a unit reduced twice in one backward adds in the same order).

A unit whose parameters have post-accumulate-grad hooks is never held back
(the hooks run when its reduce finishes, as torch FSDP2 runs them; an
optimizer step in them may issue collectives): the waiting units before it
are written first, with one read, and its own flags are read at once when
it needs them. Everything collective (the replicas' all-reduce, the
all-reduce hook, the world_size_invariant all-gather) runs before a unit
waits, so the ranks' collectives stay in the same order whatever each rank
used.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch

from . import torch_private

Write = Callable[[Optional[list[bool]]], None]
"""Writes a unit's reduced gradient given the summed flags as booleans (None: all positive)."""


def fill(flags: torch.Tensor, used: list[bool]) -> None:
    """Set ``flags`` (``(world, n_params)``, a view into the reduce input) to
    1 where ``used`` and 0 elsewhere, without a host-to-device copy of a
    Python list: one fill, and one zero per run of unused parameters."""
    flags.fill_(1)
    start = None
    for i, u in enumerate(used + [True]):
        if not u and start is None:
            start = i
        elif u and start is not None:
            flags[:, start:i].zero_()
            start = None


def read(flags: torch.Tensor) -> list[bool]:
    """The summed ``flags`` (1-D) as booleans: one host read."""
    return (flags > 0).tolist()


def _has_hooks(unit) -> bool:
    return any(torch_private.post_accumulate_grad_hooks(slot.sharded) for slot in unit.slots)


class UsedFlags:
    """One root's units waiting for their flags (see [Note: used flags on
    the host]), and which units' gradients were reduced in this backward."""

    def __init__(self):
        # (unit, flags > 0 as a device bool tensor or None when known all positive, write)
        self.waiting: list[tuple] = []
        self.synced: set[int] = set()  # id() of units reduced in this backward

    def holds(self, unit) -> bool:
        """Whether a reduce of ``unit`` waits (its ``.grad`` is not written yet)."""
        return any(u is unit for u, _, _ in self.waiting)

    def settle(self, unit, flags: torch.Tensor, all_used: bool, write: Write) -> None:
        """Write ``unit``'s reduced gradient with ``write`` now, or queue it.

        Args:
            unit: the unit whose reduce finished.
            flags: its summed used flags, 1-D, one per layout parameter.
            all_used: every flag is known positive (this rank used every
                parameter, or unused ones are reduced anyway).
            write: called with the flags as booleans (None: all positive).
        """
        if _has_hooks(unit):
            self.flush()
            write(None if all_used else read(flags))
        elif not self.waiting and all_used:
            write(None)
        else:
            self.waiting.append((unit, None if all_used else flags > 0, write))

    def flush(self) -> None:
        """Write every waiting unit, in order, after one read of all their flags."""
        waiting, self.waiting = self.waiting, []
        unknown = [f for _, f, _ in waiting if f is not None]
        values = torch.cat(unknown).tolist() if unknown else []
        pos = 0
        for _, f, write in waiting:
            if f is None:
                write(None)
            else:
                write(values[pos:pos + f.numel()])
                pos += f.numel()

    def reset(self) -> None:
        """Start a backward: drop waiting units (a backward that raised) and the reduced set."""
        self.waiting = []
        self.synced = set()

    def all_synced(self, runtimes) -> bool:
        """Whether this backward reduced every unit that reduces at all
        (trainable, ``requires_gradient_sync``). True on one rank means true
        on all: a unit reduced on some ranks only would already have
        mismatched their collectives."""
        return all(id(rt.unit) in self.synced for rt in runtimes
                   if rt.unit.needs_grad and rt.settings.requires_gradient_sync)


def settle(later: Optional[UsedFlags], unit, flags: torch.Tensor, all_used: bool, write: Write) -> None:
    """:meth:`UsedFlags.settle`, or with ``later`` None write at once (one read unless ``all_used``)."""
    if later is None:
        write(None if all_used else read(flags))
    else:
        later.settle(unit, flags, all_used, write)
