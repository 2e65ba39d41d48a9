"""The side streams' schedule (core/streams.py [Note: streams and events]) checked on the CPU, where stand-in
streams and events replace CUDA's:

* a race detector: each stream keeps what it knows to be finished on the others (a vector clock: an event
  carries its stream's knowledge, a wait merges it), and a dispatch mode logs each op's bytes with the stream
  it was issued on, per memory block followed while it is alive (it moves with a storage swap and ends when
  its storage dies or is resized, so the CPU allocator's reuse of an address is a new block, as CUDA's
  per-stream pools make it). An op that touches bytes another stream's op touched (one of them writing) that
  its stream does not know to be finished is a race, whichever the two streams; so is freeing a block before
  the stream that allocated it knows of every other stream's use (on CUDA it may reuse the block at once). An
  allocation counts as a write by its stream, a collective's outputs as written, an op on DTensors
  (``fully_shard``'s optimizer step) as touching their local tensors. Dropping any of the engine's waits
  makes the detector report races (checked below, so the check is live);
* the overlap: inside a root's forward, unit k's all-gather (its copy-in and all-gather streams) waits only on
  compute events recorded before unit k-1 began computing, so on a GPU it runs while unit k-1 computes, as
  torch FSDP2's forward all-gathers do;
* the bits: the runs with stand-in streams train to the runs without;
* a root pre-forward that raised leaves no event for later all-gathers: a block called on its own after an
  optimizer step waits on that step's writes; shards written after the root's event (a forward pre-hook of
  the root) get no early wait.

Both doors, bf16 compute with fp32 reduction, on two ranks: a real all-gather into a pooled buffer, and
HYBRID_SHARD with one-rank shard groups (the cast written straight into the unit's full parameters). The CUDA
test (tests/dist/test_cuda.py) runs the real streams with each side slowed in turn."""
from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import itertools
import threading
import weakref

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree
from torch.distributed.device_mesh import init_device_mesh
from torch.utils._python_dispatch import TorchDispatchMode

from fullshard import (
    FullyShardedDataParallel as FSDP,
    MixedPrecision,
    MixedPrecisionPolicy,
    ShardingStrategy,
    fully_shard,
)
from fullshard.core import buffers, streams, torch_private, unit as unit_module
from fullshard.core.buffers import POOL
from fullshard.core.params import local_of
from fullshard.models import TransformerBlock
from tests.dist import models as M
from tests.dist.harness import run_ranks

STEPS = 3
"""AdamW steps; the last one's forward is checked (the pool holds what the previous backward returned)."""


class _Stream:
    def __init__(self, name: str):
        self.name, self.known = name, {}  # stream name -> clock up to which its work is known finished


class _Event:
    def __init__(self, stream: _Stream, clock: int):
        self.stream, self.clock, self.known = stream, clock, dict(stream.known)

    def query(self) -> bool:
        return True


@contextlib.contextmanager
def _stand_in_streams(log: list, drop=None):
    """Side streams on the CPU: ``streams``' helpers replaced by stand-ins. Every wait is logged as
    ("wait", stream name, the event's clock, the name of the stream it was recorded on); every event and
    every op gets the next value of the clock; yields (clock, the stack of current streams). ``drop``:
    (event's stream name, waiting stream name) pairs whose waits are skipped (the detector's live checks)."""
    clock, compute = itertools.count(1), _Stream("compute")
    sides = streams.StreamSet(*(_Stream(f.name) for f in dataclasses.fields(streams.StreamSet)))
    current = [compute]

    @contextlib.contextmanager
    def on(stream):
        current.append(stream or current[-1])
        try:
            yield
        finally:
            current.pop()

    def wait(event, stream=None):
        stream = stream or compute
        if event is None or event.stream is stream or (event.stream.name, stream.name) in (drop or ()):
            return
        log.append(("wait", stream.name, event.clock, event.stream.name))
        for name, c in itertools.chain(event.known.items(), [(event.stream.name, event.clock)]):
            if name != stream.name:
                stream.known[name] = max(stream.known.get(name, 0), c)

    saved = {k: getattr(streams, k) for k in ("side", "current", "on", "record", "wait")}
    POOL.clear()  # buffers cached by runs without streams carry no event
    streams.side = lambda device: sides
    streams.current = lambda device: current[-1]  # as on CUDA: the innermost stream context
    streams.on = on
    streams.record = lambda stream: None if stream is None else _Event(stream, next(clock))
    streams.wait = wait
    try:
        yield clock, current
    finally:
        POOL.clear()  # its buffers carry stand-in events
        for k, v in saved.items():
            setattr(streams, k, v)


class _Block:
    """A memory block, followed while it is alive (it moves with ``swap_storages``): the stream that
    allocated it (None: unknown, e.g. made before the run) and each stream's ops on it."""

    __slots__ = ("alloc", "span", "ops", "freed")

    def __init__(self, alloc, span):
        self.alloc, self.span, self.freed = alloc, span, False
        self.ops = collections.defaultdict(list)  # stream name -> [(clock, lo, hi, wrote, op)]


class _Races(TorchDispatchMode):
    """The race detector of the module docstring: every op's bytes, per live memory block and stream."""

    SKIP = {torch.ops.aten.detach.default, torch.ops.aten.set_.source_Storage_storage_offset,
            torch.ops.aten.set_.source_Storage, torch.ops.aten.set_.source_Tensor}
    ALLOC = {torch.ops.aten.empty.memory_format, torch.ops.aten.empty_strided.default}
    # Ops that read only their arguments' metadata.
    META = {getattr(torch.ops.aten, n).default for n in ("empty_like", "zeros_like", "ones_like", "full_like",
                                                          "new_empty", "new_empty_strided", "new_zeros")}
    C10D_OUT = ("output", "output_tensor", "output_tensors", "tensors", "tensor")  # no alias annotations

    def __init__(self, clock, current):
        super().__init__()
        self.clock, self.current = clock, current
        self.blocks: dict = {}  # id(storage object) -> _Block
        self.races: list[tuple] = []
        self.checked = 0
        self.lock = threading.RLock()  # storages may die on gloo's threads

    def _new(self, s, span, alloc):
        block = self.blocks[id(s)] = _Block(alloc, span)
        if alloc is not None:  # on CUDA the allocator may hand out a block its stream used before: a write
            block.ops[alloc].append((next(self.clock), *span, True, "alloc"))
        weakref.finalize(s, self._died, id(s), block)
        return block

    def _died(self, key, block):
        with self.lock:
            if self.blocks.get(key) is block:
                del self.blocks[key]
            self._free(block)

    def _free(self, block):
        """On CUDA the allocating stream may reuse the block at once: it must know every other stream's use."""
        if block.freed or block.alloc is None:
            return
        block.freed = True
        home = self.streams[block.alloc]
        for name, ops in block.ops.items():
            if name != block.alloc and ops and ops[-1][0] > home.known.get(name, 0):
                self.races.append(("free", block.alloc, name, ops[-1][4]))

    def _block_of(self, t, new_on):
        """(block, lo, hi) of ``t``'s bytes (a DTensor's local tensor's), or None (meta, empty, no storage)."""
        t = getattr(t, "_local_tensor", t)
        try:
            if t.device.type != "cpu" or t.is_meta or not t.untyped_storage().nbytes():
                return None
            s = t.untyped_storage()
        except RuntimeError:
            return None
        span = (s.data_ptr(), s.data_ptr() + s.nbytes())
        lo = t.data_ptr()
        hi = lo + (1 + sum((n - 1) * st for n, st in zip(t.shape, t.stride()) if n > 1)) * t.element_size() \
            if t.numel() else lo
        block = self.blocks.get(id(s))
        if block is None or block.span != span:
            if block is not None:  # its memory changed under us: the old block is gone
                self._free(block)
            block = self._new(s, span, new_on)
        return block, lo, hi

    def _swap(self, a, b):
        with self.lock:
            blocks = self.blocks.pop(id(a), None), self.blocks.pop(id(b), None)
            self._orig["swap"](a, b)
            for s, block in zip((b, a), blocks):
                if block is not None:
                    self.blocks[id(s)] = block
                    weakref.finalize(s, self._died, id(s), block)

    def _resize(self, s, nbytes):
        with self.lock:
            block = self.blocks.get(id(s))
            if block is not None and nbytes != s.nbytes():
                del self.blocks[id(s)]
                self._free(block)
        return self._orig["resize"](s, nbytes)

    def _take(self, nbytes, device, oldest=False):
        s, event = self._orig["take"](nbytes, device, oldest)
        with self.lock:
            if id(s) not in self.blocks and s.nbytes():  # new from the allocator, on the current stream
                self._new(s, (s.data_ptr(), s.data_ptr() + s.nbytes()), self.current[-1].name)
        return s, event

    def __enter__(self):
        sides = streams.side(None)
        self.streams = {x.name: x for x in (self.current[0], sides.copy_in, sides.all_gather,
                                            sides.reduce_scatter, sides.all_reduce)}
        self._orig = {"swap": torch_private.swap_storages, "resize": torch.UntypedStorage.resize_,
                      "take": POOL._take_storage, "own_take": POOL.__dict__.get("_take_storage")}
        torch_private.swap_storages = self._swap
        torch.UntypedStorage.resize_ = lambda s, nbytes: self._resize(s, nbytes)
        POOL._take_storage = self._take
        return super().__enter__()

    def __exit__(self, *exc):
        torch_private.swap_storages = self._orig["swap"]
        torch.UntypedStorage.resize_ = self._orig["resize"]
        POOL.__dict__.pop("_take_storage", None)
        if self._orig["own_take"] is not None:
            POOL._take_storage = self._orig["own_take"]
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func.is_view or func in self.SKIP:
            return out
        stream = self.current[-1]
        with self.lock:
            if func in self.ALLOC:
                for t in pytree.tree_leaves(out):
                    if isinstance(t, torch.Tensor):
                        self._block_of(t, stream.name)
                return out
            now, c10d, touched = next(self.clock), func.namespace == "c10d", []
            named = {a.name: a for a in func._schema.arguments}
            pairs = [] if func in self.META else [*zip(func._schema.arguments, args),
                                                  *((named.get(k), v) for k, v in kwargs.items())]
            for a, value in pairs:
                wrote = a is not None and (bool(a.alias_info and a.alias_info.is_write) or a.name == "out"
                                           or (c10d and a.name in self.C10D_OUT))
                touched += [(t, wrote, None) for t in pytree.tree_leaves(value) if isinstance(t, torch.Tensor)]
            # A new output is this stream's allocation.
            touched += [(t, True, stream.name) for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
            for t, wrote, new_on in touched:
                found = self._block_of(t, new_on)
                if found is None:
                    continue
                block, lo, hi = found
                self.checked += 1
                for name, ops in block.ops.items():
                    known = stream.known.get(name, 0)
                    for c, olo, ohi, w, op in reversed(ops) if name != stream.name else ():
                        if c <= known:
                            break
                        if olo < hi and lo < ohi and (w or wrote):
                            self.races.append((stream.name, str(func), name, op))
                            break
                block.ops[stream.name].append((now, lo, hi, wrote, str(func)))
        return out


def _build(door: str, layout: str, world: int):
    model = M.make_model("gpt")
    bf16 = torch.bfloat16
    if door == "wrapper":
        kw = dict(mixed_precision=MixedPrecision(param_dtype=bf16, reduce_dtype=torch.float32))
        if layout == "hybrid":
            shards = [dist.new_group([r]) for r in range(world)]
            kw.update(sharding_strategy=ShardingStrategy.HYBRID_SHARD,
                      process_group=(shards[dist.get_rank()], dist.new_group(list(range(world)))))
        return FSDP(model, auto_wrap_policy=M.unit_policy("gpt"), **kw)
    kw = dict(mp_policy=MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=torch.float32))
    if layout == "hybrid":
        kw["mesh"] = init_device_mesh("cpu", (world, 1), mesh_dim_names=("replicate", "shard"))
    for block in model.layers:
        fully_shard(block, **kw)
    return fully_shard(model, **kw)


def _train(model, rank: int, log: list, clock=None):
    """``STEPS`` steps; with a ``clock``, logs ("pre", k, time) before block k's unshard and ("compute", k,
    time) as its computation begins, in the last step's forward."""
    blocks = [m for m in model.modules() if isinstance(m, TransformerBlock)]
    units = [m for m in model.modules() if isinstance(m, FSDP) and isinstance(m.module, TransformerBlock)] or blocks
    step_box = [0]

    def marker(kind, k):
        def hook(module, args):
            if step_box[0] == STEPS - 1 and clock is not None:
                log.append((kind, k, next(clock)))
        return hook
    for k, (unit, block) in enumerate(zip(units, blocks)):
        unit.register_forward_pre_hook(marker("pre", k), prepend=True)
        next(block.children()).register_forward_pre_hook(marker("compute", k))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for step in range(STEPS):
        step_box[0] = step
        x, y = M.batch("gpt", rank, step)
        loss = M.loss_fn("gpt", model, x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    return torch.stack(losses), [local_of(p).detach().clone() for p in model.parameters()]


def _watched(door: str, layout: str, rank: int, world: int, drop=None):
    """Train under stand-in streams and the race detector: (losses, parameters, log, races, checked)."""
    log: list = []
    with _stand_in_streams(log, drop) as (clock, current):
        model = _build(door, layout, world)
        races = _Races(clock, current)
        with races:
            losses, params = _train(model, rank, log, clock)
    return losses, params, log, races.races, races.checked


def _forward_waits_are_early(door: str, layout: str, log: list) -> int:
    marks = {(e[0], e[1]): i for i, e in enumerate(log) if e[0] in ("pre", "compute")}
    blocks = sorted(k for kind, k in marks if kind == "pre")
    assert len(blocks) >= 2, (door, layout, blocks)
    for k in blocks[1:]:
        waits = [e for e in log[marks[("pre", k)]:marks[("compute", k)]] if e[0] == "wait"
                 and e[1] in ("copy_in", "all_gather")]
        assert {e[1] for e in waits} == {"copy_in", "all_gather"}, (door, layout, k, waits)
        started = log[marks[("compute", k - 1)]][2]  # the clock as block k-1 began computing
        late = [e for e in waits if e[3] == "compute" and e[2] > started]
        assert not late, f"{door} {layout}: block {k}'s all-gather waits on {late}, after block {k - 1} began"
    return len(blocks)


def _check(rank, world):
    torch.manual_seed(0)
    out = {}
    for door, layout in itertools.product(("wrapper", "fully_shard"), ("sharded", "hybrid")):
        losses, params, log, races, checked = _watched(door, layout, rank, world)
        assert checked > 50 and not races, f"{door} {layout}: {len(races)} races, first {races[:3]}"
        ref_losses, ref_params = _train(_build(door, layout, world), rank, [])
        assert torch.equal(losses, ref_losses), (door, layout, losses, ref_losses)
        assert all(torch.equal(a, b) for a, b in zip(params, ref_params)), (door, layout)
        if layout == "hybrid" and not buffers._CAN_SWAP:
            # torch before 2.12 has no UntypedStorage._swap_data_ptr_: the one-rank cast's target comes from
            # the allocator, whose earlier users are unknown, so it waits on all the compute so far.
            out[f"{door} {layout}"] = 0
            continue
        out[f"{door} {layout}"] = _forward_waits_are_early(door, layout, log)
    # The detector is live. Without the wait on the buffer's last use (and with the pool's most recently
    # returned buffer, whose last users are unit k-1's unfinished ops) the forward copy-ins race with that
    # unit's compute; without the root's event they race with the optimizer step's writes to the shards.
    original, take = unit_module.issue_all_gather, POOL._take_storage
    for door, keep in (("wrapper", slice(0, 1)), ("fully_shard", slice(1, 2))):
        unit_module.issue_all_gather = functools.partial(_dropping, original, keep)
        if door == "wrapper":
            POOL._take_storage = lambda nbytes, device, oldest=False: take(nbytes, device, False)
        try:
            races = _watched(door, "sharded", rank, world)[3]
        finally:
            unit_module.issue_all_gather = original
            POOL.__dict__.pop("_take_storage", None)
        assert len(races) >= 2, f"{door}: the race detector missed a dropped wait ({races})"
    # Each stream's side of the schedule is checked too: the compute stream reading a collective's output,
    # a side stream the copy-in's or the reduce-scatter's, with the wait dropped.
    for door, layout, drop in (("wrapper", "sharded", {("all_gather", "compute")}),
                               ("fully_shard", "sharded", {("reduce_scatter", "compute")}),
                               ("fully_shard", "hybrid", {("all_reduce", "compute")}),
                               ("fully_shard", "sharded", {("copy_in", "all_gather")}),
                               ("wrapper", "hybrid", {("reduce_scatter", "all_reduce")})):
        races = _watched(door, layout, rank, world, drop)[3]
        assert races, f"{door} {layout}: the race detector missed the dropped waits {drop}"
    races, checked = _block_after_failed_root_forward(rank, world)
    assert checked and not races, f"a block called after a failed root forward and a step races: {races[:3]}"
    for door in ("wrapper", "fully_shard"):
        races, checked = _root_pre_hook_writes(door, rank, world)
        assert checked and not races, f"{door}: a root pre-hook's write to the shards races: {races[:3]}"
    return out


def _root_pre_hook_writes(door: str, rank: int, world: int) -> tuple:
    """A forward pre-hook registered on the root module after wrapping (so it runs after the root's
    pre-forward recorded its event) clamps every parameter in place: the shards it wrote get no early
    event. (races, checked) of two training steps."""
    with _stand_in_streams([]) as (clock, current):
        model = _build(door, "sharded", world)
        inner = model.module if door == "wrapper" else model

        def clamp(module, args):
            with torch.no_grad():
                for p in model.parameters():
                    p.clamp_(-0.05, 0.05)
        inner.register_forward_pre_hook(clamp)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        races = _Races(clock, current)
        with races:
            for step in range(2):
                x, y = M.batch("gpt", rank, step)
                M.loss_fn("gpt", model, x, y).backward()
                opt.step()
                opt.zero_grad()
    return races.races, races.checked


def _block_after_failed_root_forward(rank: int, world: int) -> tuple:
    """The root's pre-forward raises after recording its event; an optimizer step then writes the shards, and
    a block is called on its own (not through the root): its all-gather must not wait on that older event
    alone. (races, checked) of the block's call."""
    log: list = []
    with _stand_in_streams(log) as (clock, current):
        model = _build("fully_shard", "sharded", world)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        x, y = M.batch("gpt", rank, 0)
        M.loss_fn("gpt", model, x, y).backward()
        root_unit = model._fsdp_state.runtime.unit

        def fail(*args, **kwargs):
            raise RuntimeError("injected")
        root_unit.ensure_unsharded = fail
        try:
            model(x)
        except RuntimeError:
            pass
        del root_unit.ensure_unsharded
        races = _Races(clock, current)
        with races:
            opt.step()
            model.layers[0](torch.randn(2, 16, 64))
    return races.races, races.checked


def _dropping(original, keep: slice, out, send, group, tag, cast=None, after=None):
    """``issue_all_gather`` waiting on ``after[keep]`` only (the root's event, or the buffer's)."""
    return original(out, send, group, tag, cast, after[keep] if after is not None else None)


def test_side_streams_race_free_and_forward_all_gathers_overlap():
    """See the module docstring: no races, each forward all-gather's early waits, the same bits as without
    streams, and a dropped wait caught."""
    for rank_out in run_ranks(_check, 2, timeout_s=300):
        assert len(rank_out) == 4, rank_out
