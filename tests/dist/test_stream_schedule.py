"""What the side streams wait on (core/streams.py [Note: streams and events]), checked on the CPU with stand-in
streams and events that log every wait: inside a root's forward, unit k's all-gather (its copy-in and
all-gather streams) waits only on events recorded before unit k-1 began computing (the root's pre-forward
event, after the optimizer step, and the event of the buffer's last use), so on a GPU it runs while unit k-1
computes, as torch FSDP2's forward all-gathers do. Both doors, bf16 compute with fp32 reduction, on two ranks
(a real all-gather into a pooled buffer) and under HYBRID_SHARD with one-rank shard groups (the cast written
straight into the unit's full parameters). The runs with stand-in streams give the bits of the runs without.
The CUDA test (tests/dist/test_cuda.py) checks that these waits suffice, with the compute stream slowed."""
from __future__ import annotations

import contextlib
import itertools

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from fullshard import (
    FullyShardedDataParallel as FSDP,
    MixedPrecision,
    MixedPrecisionPolicy,
    ShardingStrategy,
    fully_shard,
)
from fullshard.core import streams
from fullshard.core.buffers import POOL
from fullshard.core.params import local_of
from fullshard.models import TransformerBlock
from tests.dist import models as M
from tests.dist.harness import run_ranks

STEPS = 3
"""AdamW steps; the last one's forward is checked (the pool holds what the previous backward returned)."""


class _Stream:
    def __init__(self, name: str):
        self.name = name


class _Event:
    def __init__(self, stream: _Stream, clock: int):
        self.stream, self.clock = stream, clock

    def query(self) -> bool:
        return True


@contextlib.contextmanager
def _stand_in_streams(log: list):
    """Side streams on the CPU: ``streams``' helpers replaced by stand-ins; every wait is logged as
    ("wait", stream name, the event's clock, the name of the stream it was recorded on), every event gets
    the next value of the clock this yields."""
    clock, compute = itertools.count(), _Stream("compute")
    sides = streams.StreamSet(*(_Stream(n) for n in ("copy_in", "all_gather", "reduce_scatter", "all_reduce")))
    saved = {k: getattr(streams, k) for k in ("side", "current", "on", "record", "wait")}
    streams.side = lambda device: sides
    streams.current = lambda device: compute
    streams.on = lambda stream: contextlib.nullcontext()
    streams.record = lambda stream: None if stream is None else _Event(stream, next(clock))
    streams.wait = lambda event, stream=None: event is None or log.append(
        ("wait", (stream or compute).name, event.clock, event.stream.name))
    try:
        yield clock
    finally:
        POOL.clear()  # its buffers carry stand-in events
        for k, v in saved.items():
            setattr(streams, k, v)


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


def _check(rank, world):
    torch.manual_seed(0)
    out = {}
    for door, layout in itertools.product(("wrapper", "fully_shard"), ("sharded", "hybrid")):
        log: list = []
        with _stand_in_streams(log) as clock:
            losses, params = _train(_build(door, layout, world), rank, log, clock)
        ref_losses, ref_params = _train(_build(door, layout, world), rank, [])
        assert torch.equal(losses, ref_losses), (door, layout, losses, ref_losses)
        assert all(torch.equal(a, b) for a, b in zip(params, ref_params)), (door, layout)
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
        out[f"{door} {layout}"] = len(blocks)
    return out


def test_forward_all_gathers_wait_only_on_earlier_work():
    """See the module docstring: the waits of each forward all-gather, and the same bits as without streams."""
    for rank_out in run_ranks(_check, 2, timeout_s=300):
        assert len(rank_out) == 4, rank_out
