"""Fault injection for the reliability tests: a test hook, not a user feature.

Set ``FULLSHARD_TEST_FAULT`` to ``KIND:RANK:AT`` (several separated by ``,``)
before starting `fullshard train`; the spawned ranks inherit it:

=========  =====================================================================
KIND       what happens on global rank RANK (``*`` = every rank)
=========  =====================================================================
kill       SIGKILL itself in the middle of update AT (after its first forward)
hang       sleep forever in the middle of update AT (a rank stuck outside collectives)
nan        the loss of update AT becomes NaN
enospc     the AT-th checkpoint save of this process raises ``OSError(ENOSPC)``
           after the shard files are written (a disk that fills during a save)
=========  =====================================================================

A fault fires only in the first attempt of a job (``TORCHELASTIC_RESTART_COUNT``
unset or 0), so a job restarted by ``--max-restarts`` runs clean. Without the
variable every hook is a dictionary lookup and nothing else.
"""
from __future__ import annotations

import errno
import os
import signal
import time
from typing import Optional

ENV = "FULLSHARD_TEST_FAULT"
_SAVES = [0]


def _active(kind: str, at: int) -> bool:
    spec = os.environ.get(ENV)
    if not spec or os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
        return False
    rank = os.environ.get("RANK", "0")
    for entry in spec.split(","):
        k, r, a = (entry.strip().split(":") + ["", ""])[:3]
        if k == kind and r in ("*", rank) and a.isdigit() and int(a) == at:
            return True
    return False


def in_update(update: int) -> None:
    """Mid-update hook (after the first micro-batch's forward): kill or hang here."""
    if _active("kill", update):
        os.kill(os.getpid(), signal.SIGKILL)
    if _active("hang", update):
        while True:
            time.sleep(60)


def poison_loss(loss, update: int):
    """The loss, or NaN where a ``nan`` fault targets this update."""
    return loss * float("nan") if _active("nan", update) else loss


def on_save(path: Optional[str] = None) -> None:
    """Called by checkpoint saving after this rank's files are written."""
    _SAVES[0] += 1
    if _active("enospc", _SAVES[0]):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)
