"""The only module that calls ``torch.distributed`` operations.

Every function takes an explicit process group, checks sizes in Python before
calling into the backend (so a mismatch reads clearly instead of a C++
``Check failed``), and returns the work handle (or ``None`` when the group has
one rank and nothing needs to travel). Backend quirks live here only (the
choice of algorithm per backend: core/algorithms.py).

``COUNTS`` counts issued collectives by name; tests use it to assert the
per-step choreography (e.g. two all-gathers and one reduce-scatter per unit
under FULL_SHARD).

[Note: no hangs]
Every collective takes a ``tag`` (what it is for, e.g. ``"unit 'layers.0'"``)
and runs under a deadline: the process group's timeout (``init_process_group(
timeout=...)``, which gloo applies to every operation) and the same deadline
on waits of async work handles (:func:`set_timeout`). A collective that times
out or loses a peer raises :class:`CollectiveError` with one line naming this
rank, the op, the tag and the ranks that did not arrive: on failure each rank
posts what it was waiting in to the process group's store and reads the
others' posts for a few seconds (a rank that posts nothing died or is busy
outside collectives). With ``FULLSHARD_DEBUG=1`` (or :func:`set_debug`) every
collective is preceded by a small all-gather of its fingerprint (op, tag,
numel, dtype) and fails at once with a per-rank diff when ranks disagree.
The messages are made in core/postmortem.py; the collectives stay here.

[Note: collectives at exit]
A gloo group runs each collective on a worker thread, which drops its
reference to the finished work just after the waiting thread resumes. When
the work's tensors were Python temporaries already gone on the Python side
(torch's own DTensor ``full_tensor`` passes such), that drop takes the GIL.
A group outlives ``destroy_process_group`` while anything holds it (units
do; so do DTensor's device meshes and torch's sharding caches), so if the
script ends right after its last collective the worker can ask for the GIL
once the interpreter is finalizing; CPython then ends the thread inside a
``noexcept`` destructor and the process aborts ("terminate called without
an active exception") after a run that succeeded: 2 runs in 10 of
examples/invariant.py at 3 ranks here, and 8 in 20 of a torch-only script
that keeps a reference to its group.
:func:`let_workers_finish`, an ``atexit`` hook (``atexit`` runs before
finalization), hands the GIL over for :data:`EXIT_GRACE_S` seconds so such a
worker finishes first: 0 failures in 40 runs of the example with it.

How :func:`all_gather` and :func:`reduce_scatter` run on each backend is
chosen in core/algorithms.py ([Note: collective algorithms]).
"""
from __future__ import annotations

import atexit
import collections
import datetime
import os
import time
import weakref
from typing import Optional

import torch
import torch.distributed as dist

from . import postmortem
from .algorithms import algorithm, native_fn
from .buffers import POOL

COUNTS: collections.Counter = collections.Counter()
"""Collectives issued per op name since :func:`reset_counts` (one-rank groups, where
nothing travels, are not counted)."""
BYTES: collections.Counter = collections.Counter()
"""Bytes this rank put on the wire per op name (input bytes of each call)."""

class _SelfGroup:
    """A group of just this rank: nothing travels (NO_SHARD's shard group)."""

    def __repr__(self) -> str:
        return "SELF_GROUP"


SELF_GROUP = _SelfGroup()


class CollectiveError(RuntimeError):
    """A collective timed out, lost a peer, or ranks issued different collectives (one-line message)."""


_TIMEOUT_S: Optional[float] = None
_DEBUG: Optional[bool] = None
# Collectives issued per group (debug fingerprints and failure messages number
# them): keyed by the group object, weakly, so a destroyed group's count goes
# with it and a new group never inherits a count through a reused id().
_SEQ: "weakref.WeakKeyDictionary[object, int]" = weakref.WeakKeyDictionary()
_SEQ_WORLD = [0]  # group=None (the default group)


def init_process_group(backend: str, timeout_s: Optional[float] = None, **kwargs) -> None:
    """``dist.init_process_group`` with every collective bounded by ``timeout_s`` seconds.

    Args:
        backend: "gloo" or "nccl".
        timeout_s: deadline of each collective and of waits on its work handle
            (None: torch's default).
        kwargs: passed on (``init_method``, ``rank``, ``world_size``, ...).
    """
    if timeout_s is not None:
        kwargs["timeout"] = datetime.timedelta(seconds=timeout_s)
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    if attempt is not None and not {"init_method", "store"} & set(kwargs):
        # Under torch elastic every restart reuses the agent's store: keys of the previous
        # attempt (peers' old gloo addresses) must not be read, so each attempt gets a prefix.
        store, rank, world = next(dist.rendezvous("env://", **({"timeout": kwargs["timeout"]}
                                                                if "timeout" in kwargs else {})))
        kwargs.update(store=dist.PrefixStore(f"fullshard/attempt{attempt}/", store), rank=rank, world_size=world)
    dist.init_process_group(backend, **kwargs)
    set_timeout(timeout_s)


def set_timeout(seconds: Optional[float]) -> None:
    """Deadline applied to waits on async work handles (the group's own timeout covers the ops)."""
    global _TIMEOUT_S
    _TIMEOUT_S = seconds


def set_debug(on: Optional[bool]) -> None:
    """Check before every collective that all ranks issue the same one (None: read FULLSHARD_DEBUG)."""
    global _DEBUG
    _DEBUG = on


def debug_enabled() -> bool:
    return _DEBUG if _DEBUG is not None else os.environ.get("FULLSHARD_DEBUG", "0") not in ("", "0")


def _group_ranks(group) -> list[int]:
    return dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)


def _failure(exc: BaseException, op: str, tag: str, group, seq: int, t: Optional[torch.Tensor]) -> CollectiveError:
    """One-line CollectiveError for a collective that raised ``exc`` (see [Note: no hangs])."""
    desc = postmortem.describe(op, tag, t)
    return CollectiveError(postmortem.failure_message(exc, desc, seq, dist.get_rank(), _group_ranks(group),
                                                      _TIMEOUT_S))


class Work:
    """An async work handle whose ``wait()`` has the collective deadline and one-line errors."""

    def __init__(self, handle, op: str, tag: str, group, seq: int, t: torch.Tensor):
        self.handle, self.op, self.tag, self.group, self.seq, self.t = handle, op, tag, group, seq, t

    def wait(self) -> bool:
        """Block until done. Raises CollectiveError on timeout or a lost peer."""
        try:
            if _TIMEOUT_S is not None:
                return self.handle.wait(timeout=datetime.timedelta(seconds=_TIMEOUT_S))
            return self.handle.wait()
        except RuntimeError as e:
            raise _failure(e, self.op, self.tag, self.group, self.seq, self.t) from None

    def is_completed(self) -> bool:
        return self.handle.is_completed()


class _ThenWork(Work):
    """Work whose first ``wait()`` also runs ``then()`` (finishing an all-to-all variant)."""

    def __init__(self, work: Work, then):
        self.__dict__.update(work.__dict__)
        self.then = then

    def wait(self) -> bool:
        if self.then is not None:
            super().wait()
            then, self.then = self.then, None
            then()
        return True

    def is_completed(self) -> bool:
        return self.then is None or self.handle.is_completed()


def _finish(work, async_op: bool, then):
    if async_op:
        return _ThenWork(work, then)
    then()
    return None


def _sum_blocks(recv: torch.Tensor, output: torch.Tensor) -> None:
    torch.sum(recv.view(-1, output.numel()), dim=0, out=output)
    POOL.give(recv)


def _check_same(op: str, tag: str, t: Optional[torch.Tensor], group, seq: int) -> None:
    """Debug mode: all-gather this collective's fingerprint and raise on any difference."""
    mine = postmortem.fingerprint(postmortem.describe(op, tag, t))
    ranks = _group_ranks(group)
    every = torch.zeros(len(ranks) * mine.numel(), dtype=torch.uint8)
    try:
        native_fn("all_gather")(every, mine, group=group)
    except RuntimeError as e:
        raise _failure(e, "debug fingerprint check before " + op, tag, group, seq, None) from None
    problem = postmortem.fingerprint_mismatch(every, ranks, dist.get_rank(), seq)
    if problem is not None:
        raise CollectiveError(problem)


def _run(op: str, tag: str, group, t: Optional[torch.Tensor], async_op: bool, fn):
    """Issue ``fn()`` as collective ``op``: debug check first, errors made one line, handle wrapped."""
    if group is None:
        _SEQ_WORLD[0] += 1
        seq = _SEQ_WORLD[0]
    else:
        seq = _SEQ[group] = _SEQ.get(group, 0) + 1
    if debug_enabled():
        _check_same(op, tag, t, group, seq)
    try:
        handle = fn()
    except RuntimeError as e:
        raise _failure(e, op, tag, group, seq, t) from None
    if async_op and handle is not None:
        return Work(handle, op, tag, group, seq, t)
    return handle


EXIT_GRACE_S = 0.05
"""Seconds the interpreter's exit hands the GIL to other threads ([Note: collectives at exit])."""


@atexit.register
def let_workers_finish() -> None:
    """Release the GIL for :data:`EXIT_GRACE_S` seconds at interpreter exit
    when this process issued a collective on the default group or on a
    group still alive ([Note: collectives at exit]); ``atexit`` runs this
    before finalization."""
    if _SEQ_WORLD[0] or len(_SEQ):
        time.sleep(EXIT_GRACE_S)


def world_group():
    return dist.group.WORLD


def reset_counts() -> None:
    COUNTS.clear()
    BYTES.clear()


def group_size(group) -> int:
    return 1 if group is SELF_GROUP else dist.get_world_size(group)


def group_rank(group) -> int:
    return 0 if group is SELF_GROUP else dist.get_rank(group)


def group_ranks(group) -> list[int]:
    """Global ranks of ``group`` in group-rank order (``[this rank]`` for
    :data:`SELF_GROUP`, every rank for None)."""
    return [rank()] if group is SELF_GROUP else _group_ranks(group)


def is_first_rank(shard_group, replicate_group) -> bool:
    """Whether this rank is the first of the ranks holding a unit sharded over
    ``shard_group`` and replicated over ``replicate_group`` (None: no
    replicas): group rank 0 in both. Global rank 0 for the world; rank 2 for
    a unit on ranks {2, 3}; one rank per HYBRID_SHARD layout."""
    return group_rank(shard_group) == 0 and (replicate_group is None or group_rank(replicate_group) == 0)


def holding_group(shard_group, replicate_group):
    """The group of every rank that holds a unit sharded over ``shard_group``
    and replicated over ``replicate_group``: the shard group (no replicas),
    the replicate group (NO_SHARD: shards of one rank), else the world
    (HYBRID_SHARD's pair tiles it; checked at construction)."""
    if replicate_group is None:
        return shard_group
    if shard_group is SELF_GROUP:
        return replicate_group
    return world_group()


def multi_rank_groups(shard_group, replicate_group) -> list:
    """A unit's groups that span more than one rank, replicate group first
    (the order cross-rank checks, broadcasts and norms reduce in)."""
    return [g for g in (replicate_group, shard_group) if g is not None and group_size(g) > 1]


def _count(name: str, t: torch.Tensor) -> None:
    COUNTS[name] += 1
    BYTES[name] += t.numel() * t.element_size()


def _check_blocks(op: str, what: str, full: torch.Tensor, block: torch.Tensor, group) -> int:
    """Check ``full`` holds group-size blocks of ``block``'s numel and dtype; returns the group size."""
    n = group_size(group)
    if full.numel() != n * block.numel() or full.dtype != block.dtype:
        raise ValueError(f"{op}: {what} has {full.numel()} {full.dtype} elements, expected "
                         f"{n} x {block.numel()} {block.dtype}")
    return n


def all_gather(output: torch.Tensor, shard: torch.Tensor, group, async_op: bool = True, tag: str = ""):
    """All-gather equal-size 1-D shards into ``output`` (rank-major).

    Args:
        output: 1-D tensor of ``group_size * shard.numel()`` elements.
        shard: 1-D tensor, this rank's shard; same dtype and device as output.
        tag: what the collective is for, named in errors (e.g. ``"unit 'layers.0'"``).
    Returns:
        The work handle, or None for a one-rank group (copied locally).
    Raises:
        ValueError: on a size or dtype mismatch.
        CollectiveError: timed out, lost a peer, or (debug mode) ranks disagree.
    """
    n = _check_blocks("all_gather", "output", output, shard, group)
    if n == 1:
        if shard.data_ptr() != output.data_ptr():  # in place (core/overlap.py): already there
            output.copy_(shard)
        return None
    _count("all_gather", shard)
    if algorithm(group, output.device, "all_gather") == "native":
        return _run("all_gather", tag, group, shard, async_op,
                    lambda: native_fn("all_gather")(output, shard, group=group, async_op=async_op))
    send = POOL.take(output.numel(), output.dtype, output.device)
    send.view(n, -1).copy_(shard.reshape(1, -1).expand(n, -1))  # block r goes to rank r
    work = _run("all_gather", tag, group, shard, async_op,
                lambda: dist.all_to_all_single(output, send, group=group, async_op=async_op))
    return _finish(work, async_op, lambda: POOL.give(send))


def all_gather_rows(local: torch.Tensor, bounds: tuple, group, tag: str = "") -> torch.Tensor:
    """The whole tensor whose rows ``[bounds[r], bounds[r + 1])`` rank r of
    ``group`` holds (this rank: ``local``), by one all-gather of the rows
    padded to the largest rank's count; every rank of the group calls it.
    A CPU ``local`` travels through the current CUDA device under NCCL.

    Returns:
        A new tensor of ``bounds[-1]`` rows, ``local``'s trailing shape,
        dtype and device.
    """
    sizes = [hi - lo for lo, hi in zip(bounds, bounds[1:])]
    most, tail = max(sizes), tuple(local.shape[1:])
    device = local.device
    if device.type == "cpu" and backend(group) == "nccl":  # offloaded values
        device = torch.device("cuda", torch.cuda.current_device())
    send = torch.zeros((most, *tail), dtype=local.dtype, device=device)
    send[:local.shape[0]].copy_(local)
    out = torch.empty((len(sizes) * most, *tail), dtype=local.dtype, device=device)
    all_gather(out.view(-1), send.view(-1), group, async_op=False, tag=tag)
    return torch.cat([out[r * most:r * most + n] for r, n in enumerate(sizes)]).to(local.device)


def reduce_scatter(output: torch.Tensor, full: torch.Tensor, group, async_op: bool = True, tag: str = ""):
    """Sum ``full`` (rank-major, ``group_size`` equal blocks) over the group and
    leave block ``rank`` in ``output``.

    Callers pre-divide ``full`` for averaging: gloo has no ``PREMUL_SUM`` and
    pre-division is what DDP does, which keeps results bit-close to it.

    Raises:
        ValueError: on a size or dtype mismatch.
        CollectiveError: timed out, lost a peer, or (debug mode) ranks disagree.
    """
    n = _check_blocks("reduce_scatter", "input", full, output, group)
    if n == 1:
        output.copy_(full)
        return None
    _count("reduce_scatter", full)
    if algorithm(group, full.device, "reduce_scatter") == "native":
        return _run("reduce_scatter", tag, group, full, async_op,
                    lambda: native_fn("reduce_scatter")(output, full, op=dist.ReduceOp.SUM, group=group,
                                                        async_op=async_op))
    recv = POOL.take(full.numel(), full.dtype, full.device)
    work = _run("reduce_scatter", tag, group, full, async_op,
                lambda: dist.all_to_all_single(recv, full, group=group, async_op=async_op))
    return _finish(work, async_op, lambda: _sum_blocks(recv, output))


def all_to_all(output: torch.Tensor, send: torch.Tensor, group, async_op: bool = True, tag: str = ""):
    """Send block ``r`` of ``send`` (``group_size`` equal 1-D blocks) to group
    rank ``r``; block ``r`` of ``output`` is what rank ``r`` sent here.

    Raises:
        ValueError: on a size or dtype mismatch.
        CollectiveError: timed out, lost a peer, or (debug mode) ranks disagree.
    """
    if output.numel() != send.numel() or output.dtype != send.dtype or output.numel() % group_size(group):
        raise ValueError(f"all_to_all: output has {output.numel()} {output.dtype} elements and send "
                         f"{send.numel()} {send.dtype}; both need the same dtype and group-size equal blocks")
    if group_size(group) == 1:
        output.copy_(send)
        return None
    _count("all_to_all", send)
    return _run("all_to_all", tag, group, send, async_op,
                lambda: dist.all_to_all_single(output, send, group=group, async_op=async_op))


def all_reduce(tensor: torch.Tensor, group, op: str = "sum", async_op: bool = False, tag: str = ""):
    """In-place all-reduce with ``op`` in {"sum", "max", "min"}; ``tag`` as in :func:`all_gather`."""
    ops = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}
    if op not in ops:
        raise ValueError(f"all_reduce: unknown op {op!r}; use one of {sorted(ops)}")
    if group_size(group) == 1:
        return None
    _count("all_reduce", tensor)
    return _run(f"all_reduce({op})", tag, group, tensor, async_op,
                lambda: dist.all_reduce(tensor, op=ops[op], group=group, async_op=async_op))


def broadcast(tensor: torch.Tensor, src_group_rank: int, group, async_op: bool = False, tag: str = ""):
    """In-place broadcast from the rank with group rank ``src_group_rank``."""
    if group_size(group) == 1:
        return None
    _count("broadcast", tensor)
    src = dist.get_global_rank(group, src_group_rank) if group is not None else src_group_rank
    return _run("broadcast", tag, group, tensor, async_op,
                lambda: dist.broadcast(tensor, src=src, group=group, async_op=async_op))


def barrier(group=None, tag: str = "") -> None:
    """Block until every rank of ``group`` (None = the world) gets here."""
    if group_size(group) > 1:
        _run("barrier", tag, group, None, False, lambda: dist.barrier(group=group))


def new_group(ranks: list[int], timeout_s: Optional[float] = None, local: bool = False):
    """Create a process group over ``ranks``; every rank must call it in the same order.

    Args:
        timeout_s: deadline of each collective on the group (None: the default group's).
        local: only the members of ``ranks`` call it (``use_local_synchronization``).
    """
    kw = {"use_local_synchronization": True} if local else {}
    if timeout_s is None:
        return dist.new_group(ranks=ranks, **kw)
    return dist.new_group(ranks=ranks, timeout=datetime.timedelta(seconds=timeout_s), **kw)


def pg_of(group):
    """The ``ProcessGroup`` object of ``group`` (None: the world)."""
    return group if group is not None else dist.group.WORLD


def call_custom(op: str, tag: str, group, t: torch.Tensor, fn) -> None:
    """Run a user's collective ``fn(process_group, ReduceOp.SUM)`` (see
    core/comm.py [Note: custom collectives]) as ``op``: counted, under the
    debug check and one-line errors; a work handle it returns is waited on."""
    _count(op, t)
    handle = _run(op, tag, group, t, False, lambda: fn(pg_of(group), dist.ReduceOp.SUM))
    if handle is not None:
        Work(handle, op, tag, group, 0, t).wait()


def is_initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def world_size() -> int:
    return dist.get_world_size()


def rank() -> int:
    return dist.get_rank() if is_initialized() else 0


def backend(group=None) -> str:
    return dist.get_backend(group)


def all_gather_object(obj, group=None, tag: str = "") -> list:
    """Every rank's picklable ``obj``, by group rank (``[obj]`` for a one-rank group)."""
    n = group_size(group)
    if n == 1:
        return [obj]
    out = [None] * n
    COUNTS["all_gather_object"] += 1
    _run("all_gather_object", tag, group, None, False, lambda: dist.all_gather_object(out, obj, group=group))
    return out


def broadcast_object(obj, group=None, tag: str = ""):
    """The picklable ``obj`` of ``group``'s first rank, on every rank of it (``obj`` for a one-rank group)."""
    if group_size(group) == 1:
        return obj
    box = [obj]
    COUNTS["broadcast_object"] += 1
    _run("broadcast_object", tag, group, None, False,
         lambda: dist.broadcast_object_list(box, src=group_ranks(group)[0], group=group))
    return box[0]


def device_mesh(group, device_type: str):
    """A 1-D ``DeviceMesh`` over ``group`` (None = the world) for DTensor values.

    Raises:
        ValueError: for :data:`SELF_GROUP`, which has no process group to span.
    """
    from torch.distributed.device_mesh import DeviceMesh

    if group is SELF_GROUP:
        raise ValueError("device_mesh: SELF_GROUP (NO_SHARD's shard group) spans no process group")
    return DeviceMesh.from_group(group if group is not None else dist.group.WORLD, device_type)
