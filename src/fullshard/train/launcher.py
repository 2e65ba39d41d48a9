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

import logging
import os
import shutil
import socket
import tempfile
import time
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
    picklable object with the launch fields of a TrainConfig (``nproc_per_node``,
    ``max_restarts``, ``nnodes``, ``node_rank``, ``rdzv_endpoint``,
    ``rdzv_timeout_s``): a TrainConfig, or eval-lm's EvalJob.

    Raises:
        RankFailed: a rank raised or died.
        LaunchError: the rendezvous could not be reached or hosted.
    """
    if under_torchrun():
        entry(cfg)
        return
    launch_local(entry, cfg, cfg.nproc_per_node, max_restarts=cfg.max_restarts, nnodes=cfg.nnodes,
                 node_rank=cfg.node_rank, rdzv_endpoint=cfg.rdzv_endpoint, rdzv_timeout_s=cfg.rdzv_timeout_s)


def launch_local(entry: Callable[[object], object], arg: object, nproc: int, max_restarts: int = 0,
                 nnodes: int = 1, node_rank: int = 0, rdzv_endpoint: str = "localhost:0",
                 rdzv_timeout_s: float = 900.0) -> list:
    """Run `entry(arg)` on `nproc` ranks of this machine with torch's elastic
    launcher (a c10d rendezvous: standalone on a free port for one node, at
    ``rdzv_endpoint`` hosted by node 0 for several); their return values by
    local rank (empty on nodes other than 0's ranks' results).

    Args:
        max_restarts: restarts of every local rank after one fails (torch elastic's).
        nnodes, node_rank: launchers taking part and this one's number (0 hosts the store).
        rdzv_endpoint: ``host:port`` of the rendezvous, the same on every node.
        rdzv_timeout_s: how long to wait for all nodes (and the store's connection).
    Raises:
        RankFailed: a rank raised or died ("rank R was lost: ..." / "rank R failed: <its error>").
        LaunchError: the rendezvous could not be hosted or reached (names host:port).
    """
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    os.environ.setdefault("OMP_NUM_THREADS", str(threads_per_rank(nproc)))
    rdzv_configs = {}
    if nnodes > 1:
        timeout = max(1, int(rdzv_timeout_s))
        rdzv_configs = {"is_host": node_rank == 0, "join_timeout": timeout,
                        "read_timeout": min(timeout, 60)}
    run_id = os.environ.get("FULLSHARD_RUN_ID", "fullshard") if nnodes > 1 else str(uuid.uuid4())
    log_dir = tempfile.mkdtemp(prefix="fullshard_elastic_")  # see logs_specs below
    config = LaunchConfig(
        min_nodes=nnodes, max_nodes=nnodes, nproc_per_node=nproc, run_id=run_id,
        rdzv_backend="c10d", rdzv_endpoint=rdzv_endpoint, rdzv_configs=rdzv_configs,
        max_restarts=max_restarts, monitor_interval=0.1, start_method="spawn",
        local_addr=rdzv_endpoint.rpartition(":")[0] if nnodes > 1 else None,
        # torch's agent writes each rank's error file under a log directory; left to itself it
        # makes a new torchelastic_* directory in the temp dir per launch and never removes it.
        logs_specs=DefaultLogsSpecs(log_dir=log_dir),
    )
    _quiet_elastic_logs()
    try:
        if nnodes > 1 and node_rank != 0:
            _wait_reachable(rdzv_endpoint, node_rank, rdzv_timeout_s)
        try:
            out = elastic_launch(config, entry)(arg)
        except ChildFailedError as e:
            raise RankFailed(_describe_failure(e)) from None  # reads the error files: before the rmtree
        except Exception as e:  # rendezvous / store errors: one line naming the address
            if _is_network_error(e):
                raise LaunchError(_describe_network_error(e, rdzv_endpoint, node_rank)) from None
            raise
    finally:
        shutil.rmtree(log_dir, ignore_errors=True)
    return [out[r] for r in sorted(out)]


class LaunchError(RuntimeError):
    """The ranks could not be started: the rendezvous could not be hosted or reached."""


def _wait_reachable(endpoint: str, node_rank: int, timeout_s: float) -> None:
    """Before joining, wait until node 0's rendezvous port accepts connections (node 0 may start
    later); a plain TCP connect, so an unreachable address is one line, not the store's C++ retries.

    Raises:
        LaunchError: nothing accepted connections at ``endpoint`` within ``timeout_s``.
    """
    host, _, port = endpoint.rpartition(":")
    deadline = time.monotonic() + timeout_s
    last = None
    while time.monotonic() < deadline:
        try:
            with socket.create_connection((host, int(port)), timeout=min(5.0, timeout_s)):
                return
        except OSError as e:
            last = e
            time.sleep(0.5)
    raise LaunchError(f"could not reach the rendezvous at {endpoint} from node {node_rank} within {timeout_s:g} s "
                      f"({last.strerror if getattr(last, 'strerror', None) else last}): check that node 0 is "
                      "started with the same --rdzv-endpoint, that the host is reachable and the port open "
                      "(firewall), and that --nnodes matches on every node")


def _quiet_elastic_logs() -> None:
    """torch elastic's agent logs every worker it stops; our one-line report replaces that
    (FULLSHARD_DEBUG=1 keeps its logs)."""
    if os.environ.get("FULLSHARD_DEBUG", "0") in ("", "0"):
        for name in ("torch.distributed.elastic", "torch.multiprocessing"):
            logging.getLogger(name).setLevel(logging.CRITICAL)


def _is_network_error(e: BaseException) -> bool:
    from torch.distributed.elastic.rendezvous.api import RendezvousError

    return isinstance(e, (RendezvousError, ConnectionError, TimeoutError)) or \
        type(e).__name__ in ("DistNetworkError", "DistStoreError")


def _describe_network_error(e: BaseException, endpoint: str, node_rank: int) -> str:
    """One line naming ``endpoint`` and what to check."""
    text = " ".join(str(x) for x in (e, e.__cause__, e.__context__) if x is not None).lower()
    if "address already in use" in text or "errno 98" in text:
        return (f"cannot host the rendezvous at {endpoint}: the port is in use; pick a free port for "
                "--rdzv-endpoint (the same on every node) or stop the process listening there")
    if node_rank == 0 and ("cannot assign" in text or "errno 99" in text):
        return (f"cannot host the rendezvous at {endpoint}: this machine does not have that address; "
                "give node 0's own address in --rdzv-endpoint")
    if "timeout" in text or "timed out" in text or "connection" in text or "refused" in text:
        return (f"could not reach the rendezvous at {endpoint} (node {node_rank}): check that node 0 is "
                "started with the same --rdzv-endpoint, that the host is reachable and the port open "
                "(firewall), and --nnodes matches on every node")
    return f"rendezvous at {endpoint} failed: {str(e).splitlines()[0] if str(e) else type(e).__name__}"


def _last_line(failure) -> str:
    message = failure.message
    if isinstance(message, dict):
        message = message.get("message", message)
        if isinstance(message, dict):
            message = message.get("message", str(message))
    text = str(message).strip()
    last = text.splitlines()[-1].strip() if text else ""
    if last in ("", "<N/A>", "<NONE>"):
        return f"exit code {failure.exitcode}"
    # "CollectiveError: [rank 0] ..." -> "[rank 0] ..." (the message names itself)
    head, _, rest = last.partition(": ")
    return rest if rest.startswith("[rank ") and head.isidentifier() else last


def _describe_failure(e) -> str:
    """One line: ranks killed by a signal first ("rank R was lost: killed by SIGKILL"), then the
    first rank that raised ("rank R failed: <last line of its error>")."""
    failures = getattr(e, "failures", {}) or {}
    if not failures:
        return str(e)
    lost = [f"rank {r} was lost: killed by {f.signal_name()}" for r, f in sorted(failures.items())
            if f.exitcode is not None and f.exitcode < 0]
    raised = sorted(((f.timestamp, r, f) for r, f in failures.items() if f.exitcode is None or f.exitcode >= 0),
                    key=lambda x: (x[0], x[1]))
    parts = lost + [f"rank {r} failed: {_last_line(f)}" for _, r, f in raised[:1]]
    return "; ".join(parts)
