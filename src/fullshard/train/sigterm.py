"""``--save-on-sigterm``: stop at an update boundary on SIGTERM, save, exit.

SIGTERM is a preemption notice from a scheduler, and also what torch elastic's
agent sends the ranks when a node joins an elastic job (it SIGKILLs them 30 s
later: ``LocalElasticAgent._stop_workers`` -> ``_shutdown(timeout=30)``; the
launcher's own SIGTERM gives them ``TORCH_ELASTIC_SHUTDOWN_TIMEOUT``, 30 s by
default). The handler only sets a flag. After each update every rank
all-reduces its flag (one int, max), so all ranks stop after the same update
even when the signal reaches them at different times; then checkpoint_last is
saved (atomically, as every save) and the ranks leave.

Exit status: a rank that got SIGTERM itself returns `StoppedBySigterm`; the
launcher reports the stop with exit code 143. Under torch elastic's launcher a
rank that returns waits in torch's ``_wrap`` (multiprocessing/api.py,
``queue_finished_reading_event.wait()``) until its agent has collected the
value, which an agent that is stopping the ranks never does: the rank would be
SIGKILLed 30 s later, delaying the restart by as much. So the rank exits 0 a
second after returning (`SigtermWatch.leave_soon`): its value is in the agent's
pipe by then (written before that wait), and exiting 0 without one would leave
a monitoring agent waiting forever (torch.multiprocessing's ``join`` counts
exit 0 as success, and the agent waits for every rank's value).

A rank that stopped only because another rank got SIGTERM (another node was
preempted) waits `PEER_GRACE_S` for its own (its agent may be restarting for a
membership change too) and otherwise raises `PeerSigterm` (exit 1), so its
agent restarts it from the checkpoint just saved (--max-restarts) instead of
reporting a finished job.
"""
from __future__ import annotations

import logging
import multiprocessing
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass

import torch

from fullshard.core import collectives

PEER_GRACE_S = 5.0
"""How long a rank stopped by another rank's SIGTERM waits for its own before exiting 1."""
LEAVE_AFTER_S = 1.0
"""How long after returning `StoppedBySigterm` a rank spawned by torch elastic exits by itself."""


@dataclass(frozen=True)
class StoppedBySigterm:
    """What a rank returns after a SIGTERM stop: the update checkpoint_last holds."""

    update: int


class PeerSigterm(RuntimeError):
    """This rank stopped and saved because another rank got SIGTERM; it got none itself."""


class SigtermWatch:
    """Installs the SIGTERM handler (in the constructor: call it first thing in a rank) and
    answers, once per update and on every rank, whether any rank got SIGTERM."""

    def __init__(self) -> None:
        self.received = False
        signal.signal(signal.SIGTERM, self._on_sigterm)

    def _on_sigterm(self, signum, frame) -> None:
        self.received = True

    def any_rank(self, device: torch.device) -> bool:
        """True on every rank when any rank has got SIGTERM; a collective: every rank calls it
        after the same update."""
        flag = torch.tensor([int(self.received)], dtype=torch.int32, device=device)
        collectives.all_reduce(flag, collectives.world_group(), "max", tag="--save-on-sigterm check")
        return bool(flag.item())

    def finish(self, update: int) -> StoppedBySigterm:
        """After the save: `StoppedBySigterm` when this rank got SIGTERM (waiting up to
        `PEER_GRACE_S` for it).

        Raises:
            PeerSigterm: it never came (one line naming the rank and the update saved).
        """
        deadline = time.monotonic() + PEER_GRACE_S
        while not self.received and time.monotonic() < deadline:
            time.sleep(0.05)
        if self.received:
            return StoppedBySigterm(update)
        raise PeerSigterm(f"[rank {collectives.rank()}] stopped after update {update} because another rank got "
                          f"SIGTERM (--save-on-sigterm); checkpoint_last holds update {update}, and a restart "
                          "(--max-restarts, or the same command) resumes from it")

    @staticmethod
    def leave_soon() -> None:
        """Under torch elastic's function launcher, exit 0 `LEAVE_AFTER_S` from now: call it last
        before returning `StoppedBySigterm` (see the module docstring)."""
        if multiprocessing.parent_process() is not None:  # a spawned rank (torchrun starts processes)
            threading.Thread(target=_leave, daemon=True, name="fullshard-sigterm-exit").start()


def _leave() -> None:
    time.sleep(LEAVE_AFTER_S)
    for handler in logging.getLogger().handlers:
        handler.flush()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
