"""Start the training ranks: torch's elastic launcher in-process, or join an existing torchrun.

* Not under torchrun: `elastic_launch` with a c10d rendezvous spawns
  ``nproc_per_node`` ranks, each running `entry(cfg)`: standalone on
  ``localhost:0`` (a free port) for one node, at ``--rdzv-endpoint`` (hosted by
  node 0) for several. A rank's exception makes `launch` raise `RankFailed` with
  the rank and the child's error message.
* Under torchrun (``RANK``/``WORLD_SIZE``/``LOCAL_RANK`` set): this process is
  one rank; `entry(cfg)` runs here directly and initializes the process group
  from the environment.

[Note: elastic jobs]
``--nnodes MIN:MAX`` passes the range to torch elastic
(torch/distributed/elastic/agent/server/api.py, ``SimpleElasticAgent._invoke_run``):

* A node dies: its peers' collectives fail at once (gloo sees the connections
  close) or after --collective-timeout, the ranks exit 1 with one line, and each
  surviving agent restarts its ranks while --max-restarts allows (this counts as
  a restart). The restart is a new rendezvous round; the dead launcher is
  dropped from it once its heartbeat is 3 x --rdzv-keep-alive old
  (dynamic_rendezvous.py ``_sanitize``), then the round completes
  --rdzv-last-call seconds after MIN nodes are in (at once with MAX).
* A node joins: it waits in the rendezvous's wait list; every running agent
  polls ``num_nodes_waiting()`` each monitor interval (0.1 s here) and restarts
  its ranks (no restart counted): SIGTERM, then SIGKILL 30 s later
  (``LocalElasticAgent._stop_workers`` -> ``_shutdown`` with its default
  timeout), and a new round with the newcomer. With --save-on-sigterm the ranks
  save checkpoint_last in those 30 s (`fullshard.train.sigterm`).

Each start resumes from checkpoint_last at the new world size. Node 0 hosts the
rendezvous store: the job ends when node 0 does.

An elastic range sets ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``. With the store
shared (torch 2.13's default) a node cannot join a running job: the running
rank-0 agent keeps its first round's bootstrap info
(``DynamicRendezvousHandler.next_rendezvous``: it builds ``RendezvousStoreInfo``
only when it has none or newly became rank 0), so it never writes MASTER_ADDR /
MASTER_PORT under the new round's store prefix; the newcomer blocks in
``RendezvousStoreInfo.build``'s ``store.get("MASTER_ADDR")`` and the rank-0 agent
in ``_assign_worker_ranks``'s ``multi_get`` of the newcomer's role info, both
until the store's read timeout (60 s), and the job fails. Opted out, rank 0
writes them every round and the ranks' process group gets a fresh store on a
free port each round, so ranks restarted by a membership change (which keeps
TORCHELASTIC_RESTART_COUNT) cannot read the previous round's keys either.

[Note: fork and the store]
``--start-method fork`` sets it too. A shared store is served by a thread of
this process while the ranks connect, and c10d formats socket addresses with
``getnameinfo`` (a reverse lookup, which holds glibc's resolver lock). A rank
forked while a thread here held the lock inherits the lock held and deadlocks
at its own first lookup (its store connection): seen as one rank stuck in
``__resolv_context_get`` and its peers waiting for it in gloo's rendezvous;
three loops of 4-rank launches here hung within 4, 26 and 34 launches, and
240 launches after the change none did. Unshared, the ranks meet at rank 0's
store, and no thread of this process serves them while it forks.
"""
from __future__ import annotations

import functools
import logging
import os
import shutil
import signal
import socket
import tempfile
import time
import uuid
from dataclasses import dataclass
from typing import Callable, Optional, Tuple

from fullshard.train.config import START_METHODS, TrainConfig, node_range
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


def launch(cfg: TrainConfig, entry: Callable[[TrainConfig], object]) -> list:
    """Run `entry(cfg)` on every rank (see module docstring); ``cfg`` is any
    picklable object with the launch fields of a TrainConfig (``nproc_per_node``,
    ``max_restarts``, ``nnodes``, ``node_rank``, ``rdzv_*``): a TrainConfig, or
    eval-lm's EvalJob. Returns what `entry` returned on this node's ranks (by
    local rank; under torchrun, this rank's alone).

    Raises:
        RankFailed: a rank raised or died.
        LaunchError: the rendezvous could not be reached or hosted.
        Interrupted: this process got SIGTERM, SIGINT or SIGHUP (the ranks were stopped).
    """
    if under_torchrun():
        return [entry(cfg)]
    rdzv = Rendezvous(cfg.rdzv_endpoint, cfg.node_rank, cfg.rdzv_timeout_s, cfg.rdzv_last_call_s,
                      cfg.rdzv_keep_alive_s)
    return launch_local(entry, cfg, cfg.nproc_per_node, max_restarts=cfg.max_restarts, nnodes=node_range(cfg.nnodes),
                        rdzv=rdzv, start_method=getattr(cfg, "start_method", None))


def start_method_of(chosen: Optional[str]) -> str:
    """The start method to launch with: ``chosen``, else ``$PET_START_METHOD`` (the variable torchrun
    reads for its ``--start-method``), else ``"spawn"``.

    ``fork`` needs a launcher that never ran an intra-op parallel region: OpenMP's thread pool
    does not survive a fork, and a forked rank entering one would hang (`fullshard train`,
    ``eval-lm`` and ``bench`` keep their launcher at one thread).

    Raises:
        LaunchError: the method is none of :data:`START_METHODS`, or is ``fork`` after this process
            initialized CUDA (a forked rank could not use the GPU).
    """
    method = chosen or os.environ.get("PET_START_METHOD") or "spawn"
    if method not in START_METHODS:
        raise LaunchError(f"start method {method!r} (from PET_START_METHOD) is not one of "
                          f"{', '.join(START_METHODS)}; fix or unset PET_START_METHOD")
    if method == "fork":
        import torch

        if torch.cuda.is_initialized():
            raise LaunchError("--start-method fork: this process has initialized CUDA, which forked ranks "
                              "cannot use; use --start-method spawn")
    return method


@dataclass(frozen=True)
class Rendezvous:
    """Where and how the launchers of a multi-node job meet (torch elastic's c10d rendezvous).

    The timings are torch's c10d rendezvous settings: ``last_call_s`` its ``last_call_timeout`` (torch's
    default 30 s), ``keep_alive_s`` its ``keep_alive_interval`` (default 5 s; a launcher whose heartbeat
    is missing for ``keep_alive_max_attempt`` = 3 intervals is dropped from the next round),
    ``timeout_s`` its ``join_timeout``.
    """

    endpoint: str = "localhost:0"
    """``host:port``, the same on every node; node 0 hosts the store there."""
    node_rank: int = 0
    timeout_s: float = 900.0
    """How long to wait for all nodes (and the store's connection)."""
    last_call_s: int = 30
    """Once MIN nodes of an elastic range are in, how long to wait for more before starting."""
    keep_alive_s: int = 5
    """Heartbeat interval of each launcher."""

    def configs(self, max_nodes: int) -> dict:
        """torch's ``rdzv_configs`` (empty on one node: a standalone store, torch's defaults)."""
        if max_nodes == 1:
            return {}
        timeout = max(1, int(self.timeout_s))
        return {"is_host": self.node_rank == 0, "join_timeout": timeout, "read_timeout": min(timeout, 60),
                "last_call_timeout": self.last_call_s, "keep_alive_interval": self.keep_alive_s}


def launch_local(entry: Callable[[object], object], arg: object, nproc: int, max_restarts: int = 0,
                 nnodes: Tuple[int, int] = (1, 1), rdzv: Optional[Rendezvous] = None,
                 start_method: Optional[str] = None) -> list:
    """Run `entry(arg)` on `nproc` ranks of this machine with torch's elastic
    launcher (a c10d rendezvous: standalone on a free port for one node, at
    ``rdzv.endpoint`` hosted by node 0 for several); their return values by
    local rank (empty on nodes other than 0's ranks' results).

    Args:
        max_restarts: restarts of every local rank after one fails (torch elastic's). A node
            joining an elastic job restarts the ranks too but counts as no restart.
        nnodes: ``(min, max)`` launchers taking part; min < max is an elastic job (torch elastic
            restarts the ranks at each membership change; ``entry`` resumes from its checkpoint).
        rdzv: where and how the launchers meet (default: one node, a free local port).
        start_method: how torch elastic starts each rank (:data:`START_METHODS`; None:
            :func:`start_method_of`'s default): ``spawn`` re-imports everything in a fresh
            interpreter; ``fork`` copies this process, whose imports the rank then shares.
    Raises:
        RankFailed: a rank raised or died ("rank R was lost: ..." / "rank R failed: <its error>").
        LaunchError: the rendezvous could not be hosted or reached (names host:port), or the
            start method is unusable (:func:`start_method_of`).
        Interrupted: this process got a termination signal; the ranks got it too (torch's agent
            passes it on and SIGKILLs them after its shutdown timeout, 30 s by default).
    """
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    rdzv = rdzv or Rendezvous()
    start_method = start_method_of(start_method)
    min_nodes, max_nodes = nnodes
    os.environ.setdefault("OMP_NUM_THREADS", str(threads_per_rank(nproc)))
    if min_nodes < max_nodes or start_method == "fork":
        # [Note: elastic jobs] a fresh store for the ranks at every round, not the rank-0 agent's:
        # with it shared (torch's default), a node joining a running job hangs until the store's
        # read timeout (see the module docstring), and ranks restarted by a membership change
        # (same TORCHELASTIC_RESTART_COUNT) would read the previous round's keys. Forked ranks
        # must not connect to a store this process serves: [Note: fork and the store].
        os.environ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    run_id = os.environ.get("FULLSHARD_RUN_ID", "fullshard") if max_nodes > 1 else str(uuid.uuid4())
    log_dir = tempfile.mkdtemp(prefix="fullshard_elastic_")  # see logs_specs below
    config = LaunchConfig(
        min_nodes=min_nodes, max_nodes=max_nodes, nproc_per_node=nproc, run_id=run_id,
        rdzv_backend="c10d", rdzv_endpoint=rdzv.endpoint, rdzv_configs=rdzv.configs(max_nodes),
        max_restarts=max_restarts, monitor_interval=0.1, start_method=start_method,
        local_addr=rdzv.endpoint.rpartition(":")[0] if max_nodes > 1 else None,
        # torch's agent writes each rank's error file under a log directory; left to itself it
        # makes a new torchelastic_* directory in the temp dir per launch and never removes it.
        logs_specs=DefaultLogsSpecs(log_dir=log_dir),
    )
    _quiet_elastic_logs()
    try:
        if max_nodes > 1 and rdzv.node_rank != 0:
            _wait_reachable(rdzv.endpoint, rdzv.node_rank, rdzv.timeout_s)
        try:
            out = elastic_launch(config, entry if start_method != "fork" else _forked(entry))(arg)
        except ChildFailedError as e:
            raise RankFailed(_describe_failure(e)) from None  # reads the error files: before the rmtree
        except SignalException as e:
            raise Interrupted(e.sigval) from None
        except Exception as e:  # rendezvous / store errors: one line naming the address
            if _is_network_error(e):
                raise LaunchError(_describe_network_error(e, rdzv.endpoint, rdzv.node_rank)) from None
            raise
    finally:
        shutil.rmtree(log_dir, ignore_errors=True)
    return [out[r] for r in sorted(out)]


def _forked(entry: Callable[[object], object]) -> Callable[[object], object]:
    """``entry`` for a forked rank (fork pickles nothing, so a closure will do): first the signal
    handlers a spawned rank starts with, not the ones torch's agent installed in the launcher (they
    would raise its ``SignalException`` in the rank)."""
    @functools.wraps(entry)
    def rank_main(arg: object) -> object:
        for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT):
            signal.signal(sig, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        return entry(arg)
    return rank_main


class Interrupted(RuntimeError):
    """The launcher got a termination signal (``signal``); torch's agent passed it on to the ranks."""

    def __init__(self, sig: signal.Signals):
        super().__init__(f"stopped by {sig.name}")
        self.signal = sig


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
        prefixes = ("torch.distributed.elastic", "torch.multiprocessing")
        # torch's get_logger sets each module's logger's own level (LOGLEVEL or WARNING), so the
        # parents' level alone would not hide e.g. "Received 15 death signal, shutting down workers".
        names = [name for name in logging.root.manager.loggerDict if name.startswith(prefixes)]
        for name in {*prefixes, *names}:
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
