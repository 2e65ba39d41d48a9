"""``fullshard.memory_stats``: per-unit bytes of shards, gathered parameters,
unsharded gradients, ``no_sync`` stashes and reduce-scatters in flight, and
the buffer pool, checked against sizes computed from the plain model's
parameter shapes (dim-0 chunks of ``ceil(rows / N)`` rows)."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

import fullshard
from fullshard import (
    FullyShardedDataParallel as FSDP,
    MixedPrecision,
    MixedPrecisionPolicy,
    ShardingStrategy,
    memory_stats,
)
from fullshard.activation_checkpointing import apply_activation_checkpointing
from fullshard.models import TransformerBlock
from tests.dist import models as M, patterns as P
from tests.dist.common import FULLY_SHARD, no_sync, shard, unwrap
from tests.dist.harness import run_ranks

UNIT_KEYS = ["sharded_bytes", "unsharded_bytes", "full_grad_bytes", "stashed_grad_bytes",
             "pending_reduce_scatters"]
PARAM_KEYS = ["trainable_bytes", "frozen_bytes", "grad_bytes"]


def _unit_numels(plain: nn.Module, unit_paths: list[str], world: int) -> dict[str, tuple[int, int]]:
    """(flat-shard numel, trainable unsharded numel) per unit path of ``plain``
    (the root "" owns every parameter no listed path below it owns)."""
    out = {path: [0, 0] for path in unit_paths}
    for name, p in plain.named_parameters():
        owner = max((u for u in unit_paths if u == "" or name.startswith(u + ".")), key=len)
        rows = p.shape[0] if p.dim() else 1
        chunk = math.ceil(rows / world) * (p.numel() // max(rows, 1))
        out[owner][0] += chunk
        out[owner][1] += world * chunk if p.requires_grad else 0
    return {k: tuple(v) for k, v in out.items()}


def _block_paths(plain: nn.Module) -> list[str]:
    return [n for n, m in plain.named_modules() if isinstance(m, TransformerBlock)]


def _check_shape(stats: dict, names: list[str]) -> None:
    assert list(stats) == names + ["pool"], list(stats)
    for name in names:
        assert list(stats[name]) == UNIT_KEYS + PARAM_KEYS + ["by_dtype"], stats[name]
        assert all(type(v) is int for k, v in stats[name].items() if k != "by_dtype"), stats[name]
        entry = stats[name]
        assert entry["trainable_bytes"] + entry["frozen_bytes"] == entry["sharded_bytes"], entry
    assert list(stats["pool"]) == ["in_use_bytes", "cached_bytes"], stats["pool"]
    assert all(type(v) is int and v >= 0 for v in stats["pool"].values()), stats["pool"]


def _all_zero(stats: dict, *fields: str) -> bool:
    return all(entry[f] == 0 for name, entry in stats.items() if name != "pool" for f in fields)


def _gpt_cases(rank, world):
    plain = M.make_model("gpt")
    blocks = _block_paths(plain)
    names = [""] + blocks
    numels = _unit_numels(plain, names, world)
    x, y = M.batch("gpt", rank, 0)
    # (front door, bf16, activation checkpointing, full parameters kept after forward)
    for how, mp, ckpt, keep in ((ShardingStrategy.SHARD_GRAD_OP, False, False, True),
                                (ShardingStrategy.SHARD_GRAD_OP, True, True, True),
                                (ShardingStrategy.FULL_SHARD, False, True, False),
                                (FULLY_SHARD, False, False, False), (FULLY_SHARD, True, True, True)):
        where = (how, mp, ckpt)
        base = M.clone(plain)
        if ckpt:  # CheckpointWrapper(FSDP(block)): the name drops both wrapper segments
            apply_activation_checkpointing(base, check_fn=lambda m: isinstance(m, TransformerBlock))
        if how == FULLY_SHARD:
            policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if mp else None
            kwargs = dict(reshard_after_forward=not keep, mp_policy=policy or MixedPrecisionPolicy())
        else:
            policy = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if mp else None
            kwargs = dict(mixed_precision=policy)
        model = shard(base, how, M.unit_policy("gpt"), **kwargs)
        compute = 2 if mp else 4
        stats = memory_stats(model)
        _check_shape(stats, names)
        for n in names:
            assert stats[n]["sharded_bytes"] == 4 * numels[n][0], (where, n)
        assert _all_zero(stats, *UNIT_KEYS[1:]), (where, stats)

        # Forward without backward: SHARD_GRAD_OP keeps every unit gathered,
        # FULL_SHARD only the root; in the compute dtype.
        loss = M.loss_fn("gpt", model, x, y)
        stats = memory_stats(model)
        for n in names:
            kept = n == "" or keep
            assert stats[n]["unsharded_bytes"] == (compute * world * numels[n][0] if kept else 0), (where, n)
        assert stats["pool"]["in_use_bytes"] >= sum(stats[n]["unsharded_bytes"] for n in names), where
        # Activations peak now: the pool caches nothing beside them (core/buffers.py [Note: buffer reuse]).
        assert stats["pool"]["cached_bytes"] == 0, (where, stats["pool"])
        assert _all_zero(stats, "full_grad_bytes", "stashed_grad_bytes", "pending_reduce_scatters"), where

        # In backward, once the first block's input gradient exists: the last
        # block's reduce-scatter is in flight, the root's not yet issued.
        seen = []
        handle = unwrap(model).layers[0].register_forward_pre_hook(
            lambda m, a: a[0].register_hook(lambda g: seen.append(memory_stats(model))) and None)
        loss.backward()
        assert seen == [], "the hook was registered after the forward"
        loss = M.loss_fn("gpt", model, x, y)
        loss.backward()
        handle.remove()
        assert len(seen) == 1, where
        assert seen[0][blocks[-1]]["pending_reduce_scatters"] == 1, (where, seen[0])
        assert seen[0][""]["pending_reduce_scatters"] == 0, (where, seen[0])
        assert sum(e["pending_reduce_scatters"] for n, e in seen[0].items() if n != "pool") <= 2, where
        stats = memory_stats(model)
        assert _all_zero(stats, *UNIT_KEYS[1:]), (where, stats)
        assert stats["pool"]["in_use_bytes"] == 0, (where, stats["pool"])

        # no_sync: each unit stashes N·S elements in the reduce dtype (fp32).
        with no_sync(model):
            M.loss_fn("gpt", model, x, y).backward()
        stats = memory_stats(model)
        for n in names:
            assert stats[n]["stashed_grad_bytes"] == 4 * numels[n][1], (where, n, stats[n])
        assert _all_zero(stats, "unsharded_bytes", "full_grad_bytes", "pending_reduce_scatters"), where
        M.loss_fn("gpt", model, x, y).backward()  # the synchronizing backward reduces the stash
        stats = memory_stats(model)
        assert _all_zero(stats, *UNIT_KEYS[1:]), (where, stats)
        with torch.no_grad():  # no backward follows: the buffers stay cached for the next forward
            M.loss_fn("gpt", model, x, y)
        assert memory_stats(model)["pool"]["cached_bytes"] > 0, where
        # A nested unit reports under the same names, relative to itself.
        assert list(memory_stats(unwrap(model).layers[1])) == ["", "pool"], where
        if not ckpt:
            _check_leftover_gradient(model, blocks[-1], 4 * numels[blocks[-1]][1], x, y)
    return "ok"


def _check_leftover_gradient(model, name, nbytes, x, y):
    """A backward that raises after the last block took its full gradient
    leaves that gradient behind until the next forward clears it."""
    last = unwrap(model).layers[1]

    def fail(*args, **kwargs):
        raise RuntimeError("injected reduce failure")

    last.unit.reduce_grads = fail  # setup only: the failure happens on every rank
    with pytest.raises(RuntimeError, match="injected reduce failure"):
        M.loss_fn("gpt", model, x, y).backward()
    del last.unit.reduce_grads
    stats = memory_stats(model)
    assert stats[name]["full_grad_bytes"] == nbytes, stats[name]
    assert sum(e["full_grad_bytes"] for e in stats.values() if "full_grad_bytes" in e) == nbytes, stats
    with torch.no_grad():
        model(x)
    assert _all_zero(memory_stats(model), *UNIT_KEYS[1:])


class _TwoUnits(nn.Module):
    """A plain root holding two units (each becomes its own root) and a plain layer."""

    def __init__(self, strategy):
        super().__init__()
        torch.manual_seed(0)
        self.first = FSDP(P.Enc(), sharding_strategy=strategy)
        self.mid = nn.Linear(3, 7)
        self.second = FSDP(P.Enc(), sharding_strategy=strategy)

    def forward(self, x):
        return self.second(self.mid(self.first(x)))


def _plain_root_cases(rank, world):
    enc_numels = _unit_numels(P.Enc(), [""], world)[""]
    x = torch.randn(4, 7, generator=torch.Generator().manual_seed(rank))
    model = _TwoUnits(ShardingStrategy.SHARD_GRAD_OP)
    stats = memory_stats(model)
    _check_shape(stats, ["first", "second"])
    assert stats["first"]["sharded_bytes"] == 4 * enc_numels[0]
    out = model(x)
    stats = memory_stats(model)
    assert [stats[n]["unsharded_bytes"] for n in ("first", "second")] == [4 * world * enc_numels[0]] * 2, stats
    with model.first.no_sync(), model.second.no_sync():
        out.sum().backward()
    stats = memory_stats(model)
    assert [stats[n]["stashed_grad_bytes"] for n in ("first", "second")] == [4 * enc_numels[1]] * 2, stats
    assert _all_zero(stats, "unsharded_bytes", "full_grad_bytes", "pending_reduce_scatters"), stats
    model(x).sum().backward()
    assert _all_zero(memory_stats(model), *UNIT_KEYS[1:])

    # NO_SHARD without a cast computes on the shard itself: nothing extra is gathered.
    model = FSDP(P.make(), sharding_strategy=ShardingStrategy.NO_SHARD, auto_wrap_policy=P.policy())
    whole = _unit_numels(P.make(), ["", "enc"], 1)
    loss = P.mse(model(x), torch.zeros(4, 5))
    stats = memory_stats(model)
    _check_shape(stats, ["", "enc"])
    assert [stats[n]["sharded_bytes"] for n in ("", "enc")] == [4 * whole[""][0], 4 * whole["enc"][0]], stats
    assert _all_zero(stats, "unsharded_bytes"), stats
    loss.backward()

    # No units (torch DDP): only the pool.
    assert list(memory_stats(DDP(nn.Linear(3, 3)))) == ["pool"]

    # A unit at module path "pool" would hide the pool's entry.
    holder = nn.Module()
    holder.pool = FSDP(nn.Linear(3, 3))
    with pytest.raises(ValueError, match="unit at module path 'pool'"):
        memory_stats(holder)
    assert list(memory_stats(holder.pool)) == ["", "pool"]
    return "ok"


class _LoraLinear(nn.Module):
    """A frozen bf16 ``base`` Linear plus fp32 LoRA factors ``lora_A`` (r, in), ``lora_B`` (out, r)."""

    def __init__(self, fan_in, fan_out, r):
        super().__init__()
        self.base = nn.Linear(fan_in, fan_out).to(torch.bfloat16).requires_grad_(False)
        self.lora_A = nn.Parameter(torch.randn(r, fan_in))
        self.lora_B = nn.Parameter(torch.randn(fan_out, r))

    def forward(self, x):
        return self.base(x.to(torch.bfloat16)).float() + x @ self.lora_A.t() @ self.lora_B.t()


class _Lora(nn.Module):
    """Two LoRA layers (units mixing a bf16 frozen base with fp32 adapters) and a root unit whose
    fp32 parameters are frozen (``proj``) and trainable (``head``)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.proj = nn.Linear(8, 8).requires_grad_(False)
        self.layers = nn.ModuleList([_LoraLinear(8, 5, 2), _LoraLinear(5, 8, 3)])
        self.head = nn.Linear(8, 3)

    def forward(self, x):
        return self.head(self.layers[1](self.layers[0](self.proj(x))))


def _local_numel(shape, rank, world) -> int:
    """Real elements of ``rank``'s ``torch.chunk`` rows of a parameter of ``shape``."""
    chunk = math.ceil(shape[0] / world)
    return max(0, min(chunk, shape[0] - rank * chunk)) * math.prod(shape[1:])


def _lora_cases(rank, world):
    """Trainable / frozen / by-dtype shard bytes, gradient and AdamW state bytes of a LoRA-like model,
    exact, on both doors."""
    from fullshard.wrap import ModuleWrapPolicy

    assert world == 2
    names = ["", "layers.0", "layers.1"]
    # Per rank at N=2 (ceil(R/2) rows each): layers.0: base.weight (5, 8) 3·8 + base.bias 3 bf16 = 54 B
    # frozen, lora_A (2, 8) 1·8 + lora_B (5, 2) 3·2 fp32 = 56 B trainable; layers.1: base (8, 5) 4·5 + 4
    # bf16 = 48 B, lora_A (3, 5) 2·5 + lora_B (8, 3) 4·3 fp32 = 88 B; root: proj (8, 8) 4·8 + 4 fp32 =
    # 144 B frozen, head (3, 8) 2·8 + 2 fp32 = 72 B trainable.
    want = {"": {"float32": {"trainable_bytes": 72, "frozen_bytes": 144}},
            "layers.0": {"float32": {"trainable_bytes": 56, "frozen_bytes": 0},
                         "bfloat16": {"trainable_bytes": 0, "frozen_bytes": 54}},
            "layers.1": {"float32": {"trainable_bytes": 88, "frozen_bytes": 0},
                         "bfloat16": {"trainable_bytes": 0, "frozen_bytes": 48}}}
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(rank))
    for door in ("wrapper", FULLY_SHARD):
        plain = _Lora()
        trained = {n: [p.shape for m, p in plain.named_parameters() if m.startswith(n + ".") and p.requires_grad]
                   for n in ("layers.0", "layers.1")}
        trained[""] = [plain.head.weight.shape, plain.head.bias.shape]
        if door == FULLY_SHARD:
            for layer in plain.layers:
                fullshard.fully_shard(layer)
            model = fullshard.fully_shard(plain)
        else:
            model = FSDP(plain, auto_wrap_policy=ModuleWrapPolicy({_LoraLinear}))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)  # frozen parameters included: they get no state
        stats = memory_stats(model)
        _check_shape(stats, names)
        for n in names:
            assert stats[n]["by_dtype"] == want[n], (door, n, stats[n])
            total = {k: sum(d[k] for d in want[n].values()) for k in ("trainable_bytes", "frozen_bytes")}
            assert {k: stats[n][k] for k in total} == total, (door, n, stats[n])
            assert stats[n]["grad_bytes"] == 0, (door, n)
        model(x).sum().backward()
        opt.step()
        stats = memory_stats(model, opt)
        for n in names:
            grads = 4 * sum(_local_numel(s, rank, world) for s in trained[n])
            assert stats[n]["grad_bytes"] == grads, (door, n, stats[n], grads)
            # AdamW: exp_avg and exp_avg_sq like the gradient shard, and a 0-dim fp32 step per parameter
            assert stats[n]["optim_state_bytes"] == 2 * grads + 4 * len(trained[n]), (door, n, stats[n])
            assert stats[n]["by_dtype"] == want[n], (door, n)
        opt.zero_grad(set_to_none=True)
        assert all(e["grad_bytes"] == 0 for k, e in memory_stats(model).items() if k != "pool"), door
    # One unit of both layers (fully_shard([a, b])): one entry named by both paths (it was listed under each
    # path, so memory_totals counted its shard twice).
    plain = _Lora()
    fullshard.fully_shard([plain.layers[0], plain.layers[1]])
    stats = memory_stats(fullshard.fully_shard(plain))
    assert sorted(stats) == ["", "layers.0+layers.1", "pool"], sorted(stats)
    assert stats["layers.0+layers.1"]["by_dtype"] == {"float32": {"trainable_bytes": 56 + 88, "frozen_bytes": 0},
                                                      "bfloat16": {"trainable_bytes": 0, "frozen_bytes": 54 + 48}}
    return "ok"


def _cases(rank, world):
    return _gpt_cases(rank, world), _plain_root_cases(rank, world), _lora_cases(rank, world)


def test_memory_stats():
    assert "memory_stats" in fullshard.__all__
    assert run_ranks(_cases, 2) == [("ok", "ok", "ok")] * 2
