"""Engine behaviour beyond parity: collective choreography, memory, tied and
frozen parameters, wrap policies, summon/no_sync/ignored modules, and every
construction error path."""
from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel as DDP

from fullshard import FullyShardedDataParallel as FSDP, ShardingStrategy, memory_stats
from fullshard.core import collectives as C
from fullshard.core.module import unit_modules
from fullshard.core.state import TrainingState, TrainingStateError
from fullshard.wrap import ModuleWrapPolicy, enable_wrap, lambda_auto_wrap_policy, size_based_auto_wrap_policy, wrap
from tests.dist import models as M, patterns as P
from tests.dist.common import ATOL, FULLY_SHARD, RTOL, label, no_sync, shard, train
from tests.dist.harness import run_ranks


def _step(model, kind, rank, step=0):
    x, y = M.batch(kind, rank, step)
    loss = M.loss_fn(kind, model, x, y)
    loss.backward()
    return loss


def _state_bytes(model, opt):
    """(parameter, gradient, optimizer-state, parameter-storage) bytes held by this rank."""
    local = lambda t: t.to_local() if isinstance(t, DTensor) else t  # noqa: E731  fully_shard: this rank's rows
    params = [local(p) for p in model.parameters()]
    storages = {p.untyped_storage().data_ptr(): p.untyped_storage().nbytes() for p in params}
    p_bytes = sum(p.numel() * p.element_size() for p in params)
    grads = [local(p.grad) for p in model.parameters() if p.grad is not None]
    g_bytes = sum(g.numel() * g.element_size() for g in grads)
    states = [local(t) for st in opt.state.values() for t in st.values() if torch.is_tensor(t) and t.dim() > 0]
    o_bytes = sum(t.numel() * t.element_size() for t in states)
    return p_bytes, g_bytes, o_bytes, sum(storages.values())


# ------------------------------------------------------------- choreography
def _counts_and_memory(rank, world):
    out = {}
    base = M.make_model("gpt")
    # FULL_SHARD: 2 all-gathers per non-root unit (forward, backward), 1 for
    # the root (never freed between its forward and backward), 1 reduce-scatter each.
    # fully_shard: the same with reshard_after_forward True, as SHARD_GRAD_OP with False.
    for how, gathers_per_unit, kwargs in (
            (ShardingStrategy.FULL_SHARD, 2, {}), (ShardingStrategy.SHARD_GRAD_OP, 1, {}),
            (FULLY_SHARD, 2, {}), (FULLY_SHARD, 1, dict(reshard_after_forward=False))):
        where = (label(how), kwargs)
        model = shard(M.clone(base), how, M.unit_policy("gpt"), **kwargs)
        units = unit_modules(model)
        assert len(units) == 3, [u.unit.name for u in units]  # root + 2 blocks
        _step(model, "gpt", rank)  # first step records the order; count the second
        for p in model.parameters():
            p.grad = None
        C.reset_counts()
        x, y = M.batch("gpt", rank, 1)
        loss = M.loss_fn("gpt", model, x, y)
        if gathers_per_unit == 2:
            # After forward no full parameters remain except the root's.
            stats = memory_stats(model)
            assert stats[""]["unsharded_bytes"] > 0
            nested = [name for name in stats if name not in ("", "pool")]
            assert len(nested) == 2, list(stats)
            for name in nested:
                assert stats[name]["unsharded_bytes"] == 0, name
        loss.backward()
        non_root = len(units) - 1
        expected_gathers = gathers_per_unit * non_root + 1
        assert C.COUNTS["all_gather"] == expected_gathers, (where, dict(C.COUNTS))
        assert C.COUNTS["reduce_scatter"] == len(units), (where, dict(C.COUNTS))
        for name, entry in memory_stats(model).items():  # after backward every unit is resharded
            assert name == "pool" or entry["unsharded_bytes"] == 0, name
        out[f"{label(how)} {kwargs}"] = dict(C.COUNTS)
        # Evaluation without grad keeps nothing gathered, root included.
        with torch.no_grad():
            model(x)
        for name, entry in memory_stats(model).items():
            assert name == "pool" or entry["unsharded_bytes"] == 0, (where, name)
    # Model-state bytes per rank after a step: ≈ 1/N of DDP's (plus padding).
    ddp = DDP(M.clone(base))
    fsdp = FSDP(M.clone(base), auto_wrap_policy=M.unit_policy("gpt"))
    fully = shard(M.clone(base), FULLY_SHARD, M.unit_policy("gpt"))
    sizes = {}
    for name, model in (("ddp", ddp), ("fsdp", fsdp), (FULLY_SHARD, fully)):
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        _step(model, "gpt", rank)
        opt.step()
        sizes[name] = _state_bytes(model, opt)
    psi = sum(p.numel() for p in base.parameters())
    assert sizes[FULLY_SHARD] == sizes["fsdp"], sizes
    for i, what in enumerate(("params", "grads", "optimizer state")):
        ratio = sizes["fsdp"][i] / sizes["ddp"][i]
        assert ratio <= 1 / world + 0.02, (what, ratio, sizes)
    # Every rank's shards together hold exactly Ψ real elements.
    local = torch.tensor([sum(p.numel() for p in fsdp.parameters())])
    dist.all_reduce(local)
    assert int(local) == psi
    # The storage behind the shards is the padded flat shard: at most one
    # extra row per parameter and rank.
    assert sizes["fsdp"][3] <= (psi / world + 2000) * 4
    out["bytes"] = {"ddp": sizes["ddp"][:3], "fsdp": sizes["fsdp"][:3], "psi": psi}
    return out


@pytest.mark.parametrize("world", [2, 4])
def test_collective_counts_and_memory(world):
    outs = run_ranks(_counts_and_memory, world)
    print(world, outs[0])


# ---------------------------------------------------------------- features
class TiedTwice(nn.Module):
    """The same Linear weight used by two sibling modules."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(6, 6)
        self.b = nn.Linear(6, 6)
        self.b.weight = self.a.weight

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


def _local(tensor):
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _features(rank, world):
    base = M.make_model("gpt")
    for how in (ShardingStrategy.FULL_SHARD, FULLY_SHARD):
        # Original names, no wrapper prefixes; tied embedding stays one parameter.
        model = shard(M.clone(base), how, M.unit_policy("gpt"))
        assert [n for n, _ in model.named_parameters()] == [n for n, _ in base.named_parameters()]
        assert model.output_projection.weight is model.embed_tokens.weight
        train(model, "gpt", rank, clip=True)
        assert model.output_projection.weight is model.embed_tokens.weight
        if how != FULLY_SHARD:
            with model.summon_full_params():
                assert model.output_projection.weight is model.embed_tokens.weight
                assert model.embed_tokens.weight.shape == base.embed_tokens.weight.shape

        # Frozen parameters (also mixed inside one unit): no gradient, no change,
        # and not part of the reduce-scatter.
        frozen = shard(M.vector_scale(M.make_model("frozen")), how, M.unit_policy("frozen"))
        before = {n: _local(p).detach().clone() for n, p in frozen.named_parameters()}
        C.reset_counts()
        _step(frozen, "frozen", rank)
        # Each rank's block: the trainable shard plus one used flag per parameter.
        trainable_numel = sum((u.unit.layout.grad_shard_numel + len(u.unit.layout.params)) * world
                              for u in unit_modules(frozen))
        assert C.BYTES["reduce_scatter"] == trainable_numel * 4, how
        for n, p in frozen.named_parameters():
            assert (p.grad is None) == (not p.requires_grad), (how, n)
        train(frozen, "frozen", rank)
        for n, p in frozen.named_parameters():
            if not p.requires_grad:
                assert torch.equal(_local(p), before[n]), (how, n)

    # Wrap policies and manual wrapping all train like DDP.
    mlp = M.make_model("mlp")
    ref_losses, _ = train(DDP(M.clone(mlp)), "mlp", rank)
    variants = {
        "size": dict(auto_wrap_policy=functools.partial(size_based_auto_wrap_policy, min_num_params=100)),
        "lambda": dict(auto_wrap_policy=functools.partial(lambda_auto_wrap_policy,
                                                          lambda_fn=lambda m: isinstance(m, nn.Linear))),
        "forward_prefetch": dict(auto_wrap_policy=M.unit_policy("mlp"), forward_prefetch=True),
    }
    unit_counts = {}
    for name, kwargs in variants.items():
        m = FSDP(M.clone(mlp), **kwargs)
        unit_counts[name] = len(m.units())
        losses, _ = train(m, "mlp", rank)
        torch.testing.assert_close(losses, ref_losses, rtol=RTOL, atol=ATOL, msg=name)
    # size: inp (120 params) and inner.a (240) reach 100; the rest stays in the root.
    assert unit_counts == {"size": 3, "lambda": 5, "forward_prefetch": 2}, unit_counts
    manual_model = M.clone(mlp)
    with enable_wrap(wrapper_cls=FSDP, sharding_strategy=ShardingStrategy.FULL_SHARD):
        manual_model.inner.a = wrap(manual_model.inner.a)
        manual_model.inner = wrap(manual_model.inner)
        manual = wrap(manual_model)
    assert len(manual.units()) == 3
    losses, _ = train(manual, "mlp", rank)
    torch.testing.assert_close(losses, ref_losses, rtol=RTOL, atol=ATOL)
    assert wrap(nn.Linear(2, 2)).__class__ is nn.Linear  # outside enable_wrap: unchanged

    # Tied weights across sibling modules: auto-wrap keeps them in one unit.
    tied = FSDP(TiedTwice(), auto_wrap_policy=ModuleWrapPolicy({nn.Linear}))
    assert tied.b.weight is tied.a.weight
    tied(torch.randn(3, 6)).sum().backward()

    # summon_full_params: writeback=True keeps edits, writeback=False drops them.
    m = FSDP(M.clone(mlp), auto_wrap_policy=M.unit_policy("mlp"))
    shard_before = m.inner.a.weight.detach().clone()
    with m.summon_full_params(writeback=False), torch.no_grad():
        m.inner.a.weight.add_(1.0)
    assert torch.equal(m.inner.a.weight, shard_before)
    with m.summon_full_params(), torch.no_grad():
        assert m.inner.a.weight.shape == (15, 15)
        m.inner.a.weight.add_(1.0)
    torch.testing.assert_close(m.inner.a.weight, shard_before + 1.0)
    # A tensor assigned through .data is written back too (it was dropped: 7.33 off one process in an
    # audit); one of another shape raises and writes nothing back.
    with m.summon_full_params():
        m.inner.a.weight.data = torch.full((15, 15), 7.0)
    assert torch.equal(m.inner.a.weight, torch.full_like(shard_before, 7.0))
    b_before = m.inner.b.weight.detach().clone()
    with pytest.raises(ValueError, match="'a.weight' of unit .* was given shape \\(3, 3\\).*nothing was written"):
        with m.summon_full_params():
            m.inner.a.weight.data = torch.zeros(3, 3)
            m.inner.b.weight.add_(1.0)
    assert torch.equal(m.inner.a.weight, torch.full_like(shard_before, 7.0)) and torch.equal(m.inner.b.weight, b_before)

    # ignored_modules: kept whole, never sharded.
    ign_model = M.clone(mlp)
    ign = FSDP(ign_model, ignored_modules=[ign_model.out])
    assert ign.out.weight.shape == (5, 3)
    assert all("out." not in s.fqn for u in ign.units() for s in u.unit.slots)

    # no_sync: K micro-batches with local accumulation == reduce-scatter every
    # micro-batch == DDP with its own no_sync, through either front door.
    results = []
    vector_mlp = M.vector_scale(M.clone(mlp))
    for mode in ("ddp", "no_sync", "reduce_scatter", "fully_shard no_sync", "fully_shard reduce_scatter"):
        how = FULLY_SHARD if mode.startswith(FULLY_SHARD) else ShardingStrategy.FULL_SHARD
        model = DDP(M.clone(vector_mlp)) if mode == "ddp" else shard(M.clone(vector_mlp), how, M.unit_policy("mlp"))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        for step in range(3):
            for micro in range(2):
                ctx = no_sync(model) if micro == 0 and not mode.endswith("reduce_scatter") else _null()
                with ctx:
                    (_step_loss(model, rank, 10 * step + micro) / 2).backward()
            opt.step()
            opt.zero_grad()
        results.append(list(P.full_state(model)[0].values()))
    for other in results[1:]:
        for a, b in zip(results[0], other):
            torch.testing.assert_close(b, a, rtol=RTOL, atol=ATOL)
    return True


def _step_loss(model, rank, step):
    x, y = M.batch("mlp", rank, step)
    return M.loss_fn("mlp", model, x, y)


class _null:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def test_features():
    run_ranks(_features, 2)


# ------------------------------------------------------------------ errors
def _errors(rank, world):
    msgs = {}

    def expect(exc, fn, *needles):
        with pytest.raises(exc) as info:
            fn()
        text = str(info.value)
        assert "\n" not in text.strip(), text
        for needle in needles:
            assert needle in text, (needle, text)
        return text

    m = FSDP(M.make_model("mlp"))
    msgs["twice_instance"] = expect(ValueError, lambda: FSDP(m), "already", "wrap each module once")
    msgs["twice_module"] = expect(ValueError, lambda: FSDP(m.module), "already wrapped", "wrap each module once")

    # Parameters that differ across ranks: named, with the remedy.
    torch.manual_seed(rank)
    msgs["differ"] = expect(ValueError, lambda: FSDP(M.NestedMLP()), "inp.weight", "differs across ranks",
                            f"rank {rank}", "sync_module_states=True")
    torch.manual_seed(rank)
    synced = FSDP(M.NestedMLP(), sync_module_states=True)
    with synced.summon_full_params():
        w = synced.inp.weight.detach().clone()
    lo, hi = w.clone(), w.clone()
    dist.all_reduce(lo, op=dist.ReduceOp.MIN)
    dist.all_reduce(hi, op=dist.ReduceOp.MAX)
    assert torch.equal(lo, hi)

    # Strategies that do not fit the process group.
    g = dist.new_group([0, 1])
    msgs["hybrid_single"] = expect(ValueError, lambda: FSDP(M.make_model("mlp"), process_group=g,
                                   sharding_strategy=ShardingStrategy.HYBRID_SHARD), "HYBRID_SHARD", "pair")
    msgs["pair_full"] = expect(ValueError, lambda: FSDP(M.make_model("mlp"), process_group=(g, g),
                               sharding_strategy=ShardingStrategy.FULL_SHARD), "FULL_SHARD", "single process group")
    msgs["hybrid_sizes"] = expect(ValueError, lambda: FSDP(M.make_model("mlp"), process_group=(g, g),
                                  sharding_strategy=ShardingStrategy.HYBRID_SHARD), "world size")
    msgs["bad_strategy"] = expect(ValueError, lambda: FSDP(M.make_model("mlp"), sharding_strategy="FULL"),
                                  "ShardingStrategy")

    # A tied weight split between units by manual wrapping.
    tied = TiedTwice()
    tied.a = FSDP(tied.a)  # a manually wrapped unit is named by its module's class
    msgs["tied_split"] = expect(ValueError, lambda: FSDP(tied), "b.weight", "already sharded by unit 'Linear'")

    # Illegal training-state transitions name the unit, the rank and both states.
    rt = FSDP(M.make_model("mlp"))._runtime
    rt.transition(TrainingState.FORWARD)
    msgs["transition"] = expect(TrainingStateError, lambda: rt.transition(TrainingState.POST_BACKWARD),
                                "FORWARD -> POST_BACKWARD", "NestedMLP", f"rank {rank}")
    return msgs


def test_error_paths():
    msgs = run_ranks(_errors, 2)[0]
    for k, v in msgs.items():
        print(f"{k}: {v}")


def test_no_process_group_error():
    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match="torchrun --nproc-per-node") as info:
        FSDP(nn.Linear(2, 2))
    assert "init_process_group" in str(info.value)
