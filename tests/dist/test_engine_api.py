"""Containers, full-precision norms, methods other than forward, tensors kept
on modules, conversions after wrapping, memory that must be freed,
summon_full_params with torch's arguments, and torch FSDP1's constructor
arguments and helpers."""
from __future__ import annotations

import collections
import functools
import gc
import time
import weakref

import pytest
import torch
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

from fullshard import (
    FullyShardedDataParallel as FSDP,
    MixedPrecision,
    MixedPrecisionPolicy,
    ShardingStrategy,
    fully_shard,
    memory_stats,
)
from fullshard.core import registry
from fullshard.core.module import unit_modules
from fullshard.fsdp import register_fsdp_forward_method
from fullshard.memory import memory_totals
from fullshard.wrap import ModuleWrapPolicy, size_based_auto_wrap_policy
from tests.dist import patterns as P
from tests.dist.common import FULLY_SHARD, BNBlock, BNNet, label, no_sync, shard, unwrap
from tests.dist.harness import run_ranks


# ------------------------------------------------------- 7. containers
class DCInner(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(7, 5)
        self.b = nn.Linear(7, 5)
        self.seen_dtypes: list = []

    def forward(self, inp: P.Pair):
        self.seen_dtypes = [inp.main.dtype, inp.side.dtype]
        return P.Out(logits=self.a(inp.main), aux={"side": self.b(inp.side)})


class DCNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.pre = nn.Linear(7, 7)
        self.inner = DCInner()

    def forward(self, x):
        h = self.pre(x)
        o = self.inner(P.Pair(main=h, side=h * 2))
        return o.logits + o.aux["side"]


def _plain_step(model, opt, rank, s):
    x, y = P.batch(rank, s)
    loss = P.mse(model(x), y)
    loss.backward()
    return loss.detach()


class KeepsLoss(P.Net):
    """Stores its loss on itself instead of returning it."""

    def forward(self, x, y, return_loss: bool = False):
        out = super().forward(x)
        self.loss = P.mse(out, y)
        return self.loss if return_loss else out.detach()


def _containers_norms_methods(rank, world):
    out = {}
    torch.manual_seed(0)
    out["dataclass_namedtuple_io"] = P.compare(rank, _plain_step, make_fn=DCNet,
                                               policy_fn=lambda: ModuleWrapPolicy({DCInner}))
    bf16 = MixedPrecision(param_dtype=torch.bfloat16)
    bf16_policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    for how, kwargs in ((ShardingStrategy.FULL_SHARD, dict(mixed_precision=bf16)),
                        (FULLY_SHARD, dict(mp_policy=bf16_policy))):
        torch.manual_seed(0)
        m = shard(DCNet(), how, ModuleWrapPolicy({DCInner}), **kwargs)
        m(torch.randn(2, 7)).sum().backward()
        assert unwrap(m.inner).seen_dtypes == [torch.bfloat16, torch.bfloat16], how

    # 8. BatchNorm under bf16 with no extra arguments: full-precision units.
    # fully_shard, as torch FSDP2, casts what it is told to: each norm is its own
    # unit with an fp32 policy whose output goes back to bf16 (without it, torch's
    # batch_norm raises "expected scalar type BFloat16 but found Float", as under torch FSDP2).
    torch.manual_seed(0)
    base = BNNet()
    ref = DDP(P._clone(base), broadcast_buffers=False)  # per-rank statistics, as ours
    ref_losses, _, ref_params = P.run(ref, _plain_step, rank, 3)
    for how in P.WRAPPINGS:
        if how == FULLY_SHARD:
            model = P._clone(base)
            for norm in (model.bn, model.block.bn):
                fully_shard(norm, mp_policy=MixedPrecisionPolicy(param_dtype=torch.float32,
                                                                 output_dtype=torch.bfloat16))
            model = shard(model, how, ModuleWrapPolicy({BNBlock}), mp_policy=bf16_policy)
        else:
            model = shard(P._clone(base), how, ModuleWrapPolicy({BNBlock}), mixed_precision=bf16)
        bn_units = [u for u in unit_modules(model) if isinstance(unwrap(u), nn.BatchNorm1d)]
        assert len(bn_units) == 2 and all(u.unit.compute_dtype == torch.float32 for u in bn_units), how
        losses, _, params = P.run(model, _plain_step, rank, 3)
        for name, buf in model.named_buffers():
            if "running" in name:
                assert buf.dtype == torch.float32, name
                torch.testing.assert_close(buf, dict(ref.module.named_buffers())[name], rtol=0.05, atol=0.02)
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=0.05, atol=0.02)
        out[f"batchnorm_bf16_loss_diff[{label(how)}]"] = max(abs(a - b) for a, b in zip(losses, ref_losses))

    # 9. A method other than forward that uses the parameters.
    torch.manual_seed(0)
    plain = P.Net()
    P.Net.score = lambda self, h: h @ self.pre.weight.t()
    P.Net.broken = lambda self, h: self.pre(h[:, :6])  # wrong width: raises after the all-gather
    h = torch.randn(3, 7)
    for how in (ShardingStrategy.FULL_SHARD, FULLY_SHARD):
        model = shard(P._clone(plain), how, P.policy())
        register_fsdp_forward_method(model, "score")
        for grad in (True, False, False):  # repeated, without backward; no_grad as generate() runs
            with torch.set_grad_enabled(grad):
                torch.testing.assert_close(model.score(h), plain.score(h))
                # Calling the wrapped module directly (what generate() does) gathers too.
                torch.testing.assert_close(unwrap(model)(h), plain(h))
        assert memory_totals(memory_stats(model))["unsharded_bytes"] == 0, how  # nothing left gathered
        with pytest.raises(ValueError, match="no method 'nope'"):
            register_fsdp_forward_method(model, "nope")
        # A registered method that raises leaves the model idle: no_sync() and training go on.
        register_fsdp_forward_method(model, "broken")
        with pytest.raises(RuntimeError):
            model.broken(h)
        with no_sync(model):
            pass
        x, y = P.batch(rank, 0)
        P.mse(model(x), y).backward()
        # A direct call that raises, then an optimizer step: the next direct call gathers the new values.
        with pytest.raises(RuntimeError):
            unwrap(model)(h[:, :6])
        torch.optim.SGD(model.parameters(), lr=0.5).step()
        with torch.no_grad():
            torch.testing.assert_close(unwrap(model)(h), model(h), rtol=0, atol=0)

    # 10. A loss the root stored on itself, with and without nested units.
    def keeps_loss(model, opt, rank, s):
        x, y = P.batch(rank, s)
        model(x, y)
        inner = model.module if isinstance(model, DDP) else model
        inner.loss.backward()
        return inner.loss.detach()
    # DDP itself fails this pattern (its unused-parameter search starts from
    # the detached output; with static_graph=True its gradients go wrong
    # from the third step), so the reference DDP returns the loss instead.
    def returns_loss(model, opt, rank, s):
        x, y = P.batch(rank, s)
        loss = model(x, y, return_loss=True)
        loss.backward()
        return loss.detach()
    out["loss_stored_on_root"] = P.compare(rank, keeps_loss, make_fn=KeepsLoss, ref_step_fn=returns_loss)
    out["loss_stored_on_root_no_units"] = P.compare(rank, keeps_loss, make_fn=KeepsLoss, ref_step_fn=returns_loss,
                                                    policy_fn=lambda: None)

    # 10. Conversions after wrapping: a no-op is fine, a device move is
    # refused (dtype conversions: tests/dist/test_dtype.py).
    model = FSDP(P.make(), auto_wrap_policy=P.policy())
    model.to(torch.float32)
    model.float()
    with pytest.raises(RuntimeError, match="after wrapping is not supported") as info:
        model.to("meta")
    assert "\n" not in str(info.value) and "device_id" in str(info.value)
    assert all(p.dtype == torch.float32 and p.device.type == "cpu" for p in model.parameters())
    return out


def test_containers_norms_methods_stored_tensors():
    print(run_ranks(_containers_norms_methods, 2)[0])


# ------------------------------------------------------------------ memory
def _live_tensors() -> collections.Counter:
    """Live tensors by (shape, dtype, requires_grad, is a view), after a full collection."""
    gc.collect()
    return collections.Counter((tuple(o.shape), o.dtype, o.requires_grad, o._base is not None)
                               for o in gc.get_objects() if torch.is_tensor(o))


def _memory(rank, world):
    out = {}
    for how in (ShardingStrategy.FULL_SHARD, FULLY_SHARD):
        out[label(how)] = _memory_of(rank, how)
    return out


def _memory_of(rank, how):
    # A deleted model is freed (no cycle through hooks keeps the shards), and so
    # are its entries in the sharded-parameter registry (core/registry.py).
    gc.collect()
    entries = registry.size()
    model = shard(P.make(), how, P.policy())
    assert registry.size() == entries + len(list(model.parameters()))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x, y = P.batch(rank, 0)
    P.mse(model(x), y).backward()
    opt.step()
    refs = [weakref.ref(model), weakref.ref(model.enc.unit.flat_shard), weakref.ref(model.unit.flat_full)]
    del model, opt
    gc.collect()
    assert all(r() is None for r in refs), [r() is None for r in refs]
    assert registry.size() == entries

    # Frozen-only units are resharded right after their own backward.
    for keep in (False, True):
        base = P.make()
        base.enc.requires_grad_(False)
        if how == FULLY_SHARD:
            model = shard(base, how, P.policy(), reshard_after_forward=not keep)
        else:
            model = shard(base, ShardingStrategy.SHARD_GRAD_OP if keep else how, P.policy())
        seen = []
        # prepend: the input as the caller passed it, before fully_shard's pre-forward hook wraps it
        model.enc.register_forward_pre_hook(
            lambda m, a: a[0].register_hook(lambda g: seen.append(memory_stats(model)["enc"]["unsharded_bytes"]))
            and None, prepend=True)
        P.mse(model(x), y).backward()
        assert seen == [0], (how, keep, seen)

    # Live tensors and gathered bytes stay flat over iterations of every pattern.
    model = shard(P.make(), how, P.policy())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)

    def iteration(i):
        x, y = P.batch(rank, i)
        if i % 5 == 2:  # a forward that raises inside the nested unit, after its all-gather
            h = model.enc.b.register_forward_pre_hook(lambda m, a: _boom(None))
            with pytest.raises(ValueError, match="boom"):
                model(x)
            h.remove()
        with no_sync(model):
            P.mse(model(x, use_spare=True), y).backward()
        if i % 3 == 0:
            opt.zero_grad()  # discards the stash
        out, aux = model(x, branch="no_grad" if i % 2 else "reentrant")
        loss = P.mse(out, y) + aux
        if i % 4 == 1:
            h = model.enc.register_forward_pre_hook(lambda m, a: a[0].register_hook(_boom) and None)
            loss = P.mse(model(x), y)
            h.remove()
            with pytest.raises(ValueError, match="boom"):
                loss.backward()
        else:
            loss.backward()
            opt.step()
        opt.zero_grad()

    for i in range(3):
        iteration(i)
    before = _live_tensors()
    for i in range(3, 11):
        iteration(i)
        totals = memory_totals(memory_stats(model))
        if i % 4 != 1:  # after a backward that raised, the next forward reshards
            assert totals["unsharded_bytes"] == 0
        assert totals["stashed_grad_bytes"] == 0
    # gloo's worker threads may still hold a finished collective's tensors (their
    # Python objects are then kept alive) for a moment; a real leak never settles.
    deadline = time.monotonic() + 5.0
    while (after := _live_tensors()) != before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert after == before, f"live tensors grew: {dict(after - before)} shrank: {dict(before - after)}"
    return {"live_tensors": after.total()}


def _boom(grad):
    raise ValueError("boom")


def test_memory_freed():
    print(run_ranks(_memory, 2)[0])


# ------------------------------------------------------ summon_full_params
def _summon(rank, world):
    # Root holding no parameter of its own (all in nested units).
    torch.manual_seed(0)
    seq = nn.Sequential(nn.Linear(7, 15), nn.ReLU(), nn.Linear(15, 5))
    ref = P._clone(seq)
    model = FSDP(seq, auto_wrap_policy=functools.partial(size_based_auto_wrap_policy, min_num_params=1))
    assert len(model.units()) == 3 and not model.unit.slots
    with model.summon_full_params():
        for (n, p), (rn, rp) in zip(model.named_parameters(), ref.named_parameters()):
            assert n == rn and torch.equal(p, rp), n

    model = FSDP(P.make(), auto_wrap_policy=P.policy())
    full = P.make()
    rows = (15 + world - 1) // world
    with model.summon_full_params(recurse=False):
        assert model.pre.weight.shape == (7, 7)
        assert model.enc.a.weight.shape[0] == min(rows, 15 - rank * rows)  # still a shard
    with model.summon_full_params(writeback=False, rank0_only=True, offload_to_cpu=True):
        shape = model.enc.a.weight.shape
        assert shape == ((15, 7) if rank == 0 else (min(rows, 15 - rank * rows), 7)), shape
    with pytest.raises(ValueError, match="rank0_only"):
        with model.summon_full_params(rank0_only=True):
            pass
    # Nested calls compose: the inner sees the outer's edit, both edits persist.
    with model.summon_full_params(), torch.no_grad():
        model.enc.a.weight.add_(1.0)
        with FSDP.summon_full_params(model.enc):
            assert torch.equal(model.enc.a.weight, full.enc.a.weight + 1.0)
            model.enc.a.weight.mul_(2.0)
        assert torch.equal(model.enc.a.weight, (full.enc.a.weight + 1.0) * 2.0)
        with pytest.raises(RuntimeError, match="forward inside summon_full_params"):
            model(torch.randn(2, 7))
    with model.summon_full_params():
        torch.testing.assert_close(model.enc.a.weight, (full.enc.a.weight + 1.0) * 2.0)
    # The model still trains after all of the above.
    x, y = P.batch(rank, 0)
    P.mse(model(x), y).backward()

    # apply() runs fn on full parameters and writes them back (torch FSDP1's apply).
    seen = {}

    def fill(m):
        if isinstance(m, nn.Linear):
            seen[id(m)] = tuple(m.weight.shape)
            with torch.no_grad():
                m.weight.copy_(torch.arange(m.weight.numel(), dtype=torch.float32).view_as(m.weight))

    model = FSDP(P.make(), auto_wrap_policy=P.policy())
    assert model.apply(fill) is model
    plain = P.make()
    assert sorted(seen.values()) == sorted(tuple(m.weight.shape) for m in plain.modules()
                                           if isinstance(m, nn.Linear)), seen
    with model.summon_full_params():
        for n, m in model.named_modules():
            if isinstance(m, nn.Linear):
                assert torch.equal(m.weight, torch.arange(m.weight.numel(), dtype=torch.float32).view_as(m.weight)), n
    return True


def test_summon_full_params():
    run_ranks(_summon, 2)


# ------------------------------------------- torch FSDP1 arguments, helpers
def _ctor(rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    out = {}
    for flag in (True, False):
        assert FSDP(P.make(), use_orig_params=flag).use_orig_params is flag
    base = P.make()
    m = FSDP(P._clone(base), auto_wrap_policy={P.Enc})
    assert len(m.units()) == 2 and len(FSDP.fsdp_modules(m)) == 2
    assert FSDP.fsdp_modules(m, root_only=True) == [m]
    assert m.check_is_root() and not m.enc.check_is_root()
    for states in (lambda b: [b.extra], lambda b: [b.extra.weight, b.extra.bias]):
        b = P._clone(base)
        m = FSDP(b, auto_wrap_policy=P.policy(), ignored_states=states(b))
        assert m.extra.weight.shape == (5, 7)
        assert all("extra" not in s.fqn for u in m.units() for s in u.unit.slots)
    with pytest.raises(ValueError, match="only nn.Parameter or only nn.Module"):
        FSDP(P._clone(base), ignored_states=[base.extra, base.pre.weight])
    mesh = init_device_mesh("cpu", (world,))
    out["device_mesh_1d"] = P.compare(rank, _plain_step, strategies=(ShardingStrategy.FULL_SHARD,),
                                      fsdp_kwargs=dict(device_mesh=mesh))
    mesh2 = init_device_mesh("cpu", (1, world), mesh_dim_names=("replicate", "shard"))
    out["device_mesh_2d_hybrid"] = P.compare(rank, _plain_step, strategies=(ShardingStrategy.HYBRID_SHARD,),
                                             fsdp_kwargs=dict(device_mesh=mesh2))
    with pytest.raises(ValueError, match="2-D device_mesh"):
        FSDP(P.make(), sharding_strategy=ShardingStrategy.HYBRID_SHARD, device_mesh=mesh)
    with pytest.raises(ValueError, match="not both"):
        FSDP(P.make(), device_mesh=mesh, process_group=mesh.get_group(0))
    return out


def test_constructor_arguments():
    print(run_ranks(_ctor, 2)[0])
