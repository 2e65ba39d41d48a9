"""Start the training ranks: torch's elastic launcher in-process, or join an existing torchrun.

* Not under torchrun: `elastic_launch` with a standalone c10d rendezvous on
  ``localhost:0`` (a free port) spawns ``nproc_per_node`` ranks, each running
  `entry(cfg)`. A rank's exception makes `launch` raise `RankFailed` with the
  rank and the child's error message.
* Under torchrun (``RANK``/``WORLD_SIZE``/``LOCAL_RANK`` set): this process is
  one rank; `entry(cfg)` runs here directly and initializes the process group
  from the environment.
"""
from __future__ import annotations

import os
import uuid
from typing import Callable

from fullshard.train.config import TrainConfig
from fullshard.train.options import under_torchrun


class RankFailed(RuntimeError):
    """A launched rank raised or died; the message names the rank and holds its error."""


def cpu_cores() -> int:
    """Cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - non-Linux
        return os.cpu_count() or 1


def threads_per_rank(local_world_size: int) -> int:
    """Intra-op threads per rank so the ranks together use the machine's cores once."""
    return max(1, cpu_cores() // max(local_world_size, 1))


def launch(cfg: TrainConfig, entry: Callable[[TrainConfig], object]) -> None:
    """Run `entry(cfg)` on every rank (see module docstring); ``cfg`` is any
    picklable object with ``nproc_per_node`` (a TrainConfig, eval-lm's EvalJob).

    Raises:
        RankFailed: a rank raised or died.
    """
    if under_torchrun():
        entry(cfg)
        return
    launch_local(entry, cfg, cfg.nproc_per_node)


def launch_local(entry: Callable[[object], object], arg: object, nproc: int) -> list:
    """Run `entry(arg)` on `nproc` ranks of this machine with torch's elastic
    launcher (standalone c10d rendezvous on a free port); their return values
    by rank.

    Raises:
        RankFailed: a rank raised or died ("rank R failed: <its error>").
    """
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    os.environ.setdefault("OMP_NUM_THREADS", str(threads_per_rank(nproc)))
    config = LaunchConfig(
        min_nodes=1, max_nodes=1, nproc_per_node=nproc, run_id=str(uuid.uuid4()),
        rdzv_backend="c10d", rdzv_endpoint="localhost:0", max_restarts=0, monitor_interval=0.1,
        start_method="spawn",
    )
    try:
        out = elastic_launch(config, entry)(arg)
    except ChildFailedError as e:
        raise RankFailed(_describe_failure(e)) from None
    return [out[r] for r in sorted(out)]


def _describe_failure(e) -> str:
    """'rank R failed: <last line of the child's traceback>' from a ChildFailedError."""
    try:
        rank, failure = e.get_first_failure()
    except Exception:  # pragma: no cover - defensive
        return str(e)
    message = failure.message
    if isinstance(message, dict):
        message = message.get("message", message)
        if isinstance(message, dict):
            message = message.get("message", str(message))
    text = str(message).strip()
    last = text.splitlines()[-1].strip() if text else f"exit code {failure.exitcode}"
    if last in ("", "<N/A>", "<NONE>"):
        last = f"exit code {failure.exitcode}"
    return f"rank {rank} failed: {last}"
