"""core/collectives.py [Note: collectives at exit]: an ``atexit`` hook hands
the GIL over (sleeps) at exit after a collective, and only then. A gloo worker
that asks for the GIL during finalization aborts the process; the hook's
effect on that race is what tests/e2e/test_invariant_example.py's 3-rank
torchrun run exercises."""
from __future__ import annotations

import weakref

from fullshard.core import collectives


def test_exit_hook_sleeps_only_after_a_collective(monkeypatch):
    slept = []
    monkeypatch.setattr(collectives.time, "sleep", slept.append)
    monkeypatch.setattr(collectives, "_SEQ", weakref.WeakKeyDictionary())
    monkeypatch.setattr(collectives, "_SEQ_WORLD", [0])
    collectives.let_workers_finish()
    assert slept == []  # no collective issued: exit is not slowed
    collectives._SEQ_WORLD[0] += 1  # as after a collective on the default group
    collectives.let_workers_finish()
    assert slept == [collectives.EXIT_GRACE_S]
