"""``fully_shard``'s construction paths against DDP on the same weights and
batches: what the model looks like afterwards, a list of modules with tied
weights as one unit, deferred (meta) init, dtype conversion and
``load_state_dict(assign=True)`` after sharding, an optimizer made between
forward and backward; and the construction errors."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor, Shard, distribute_tensor
from torch.nn.parallel import DistributedDataParallel as DDP

import fullshard
from fullshard import fully_shard
from fullshard.core import registry
from tests.dist import fsdp2_parity as FP
from tests.dist.harness import run_ranks

# Not in the fast tier (make test-fast): several spawned groups; make test runs it.


def _train(model, opt, rank, sharded, steps=3):
    out = []
    for step in range(steps):
        loss = FP.loss_of(model, rank, step)
        loss.backward()
        out.append(FP.snap(model, loss))
        opt.step()
        opt.zero_grad()
    return out


def _parity_on(rank, model, opt=None, loop=_train, dtype=None, **tol) -> float:
    """``loop`` on ``model`` (already sharded) and on DDP over a plain model
    holding its full weights now; the snapshots must agree."""
    plain = FP.make()
    if dtype is not None:
        plain.to(dtype)
    with torch.no_grad():
        for p, q in zip(model.parameters(), plain.parameters()):
            q.copy_(FP.full(p))
    ref = DDP(plain)
    want = loop(ref, FP.sgd(ref), rank, False)
    got = loop(model, opt or FP.sgd(model), rank, True)
    FP.assert_same(got, want, **tol)
    return FP.max_diff(got, want)


# ------------------------------------------------------------------ identity
def _identity_case(rank, world):
    plain = FP.make()
    model = FP.shard(FP.make())
    assert isinstance(model, fullshard.FSDPModule) and isinstance(model, FP.Net)
    assert type(model).__name__ == "FSDPNet" and type(model.layers[0]).__name__ == "FSDPBlock"
    assert not isinstance(model.norm, fullshard.FSDPModule)
    assert [n for n, _ in model.named_modules()] == [n for n, _ in plain.named_modules()]
    assert [n for n, _ in model.named_parameters()] == [n for n, _ in plain.named_parameters()]
    sd = model.state_dict()
    assert list(sd) == list(plain.state_dict())
    for name, value in sd.items():
        full = plain.state_dict()[name]
        assert isinstance(value, DTensor) and value.placements == (Shard(0),), name
        assert value.shape == full.shape, name
        rows = -(-full.shape[0] // world)  # torch.chunk
        assert value.to_local().shape[0] == max(0, min(full.shape[0] - rank * rows, rows)), name
        torch.testing.assert_close(value.full_tensor(), full, rtol=0, atol=0)
    return {}


# ---------------------------------------------------- list unit, tied weights
def _tied_case(rank, world):
    def shard_fn(model):
        for layer in model.layers:
            fully_shard(layer)
        pair = [model.tok_embeddings, model.output]
        assert fully_shard(pair) is pair
        fully_shard(model)
        assert model.output.weight is model.tok_embeddings.weight
        assert model.output.unit is model.tok_embeddings.unit
        return model
    build = lambda: FP.make(tied=True)  # noqa: E731
    return {"tied_list_unit": FP.parity(rank, _train, build=build, shard_fn=shard_fn)}


# ---------------------------------------------------------------- deferred init
def _meta_model():
    with torch.device("meta"):
        model = FP.Net()
    return FP.shard(model)


def _deferred_case(rank, world):
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    res = {}
    # Forward before to_empty: one clear error.
    model = _meta_model()
    with pytest.raises(RuntimeError, match=r"\[rank \d\] unit '.*': .*meta device.*to_empty"):
        FP.loss_of(model, rank, 0)
    # The user's init on the sharded parameters, under a seed.
    model = _meta_model()
    model.to_empty(device="cpu")
    assert all(isinstance(p, DTensor) and not p.is_meta for p in model.parameters())
    torch.manual_seed(7)
    with torch.no_grad():
        for m in model.modules():
            if hasattr(m, "reset_parameters"):
                m.reset_parameters()
        for layer in model.layers:
            gate = layer.gate
            gate.copy_(distribute_tensor(torch.tensor([1.0, 0.1]), gate.device_mesh, gate.placements))
    res["reset_parameters"] = _parity_on(rank, model)
    # A full state dict (rank 0's) scattered into the shards.
    model = _meta_model()
    model.to_empty(device="cpu")
    full = FP.make(seed=5).state_dict() if rank == 0 else {}
    set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    loaded = FP.params(model)
    for name, value in FP.make(seed=5).named_parameters():
        torch.testing.assert_close(loaded[f"param:{name}"], value, rtol=0, atol=0)
    res["set_model_state_dict"] = _parity_on(rank, model)
    return res


# ------------------------------------------------------ conversions and loads
def _convert_case(rank, world):
    res = {}
    model = FP.shard(FP.make())
    opt = FP.sgd(model)  # made before: holds the same parameter objects after the conversion
    ids = [id(p) for p in model.parameters()]
    model.to(torch.float64)
    assert [id(p) for p in model.parameters()] == ids
    assert all(isinstance(p, DTensor) and p.dtype == torch.float64 for p in model.parameters())
    res["float64"] = _parity_on(rank, model, opt, dtype=torch.float64)

    model = FP.shard(FP.make())
    model.bfloat16()
    want = FP.make().bfloat16()
    for p, q in zip(model.parameters(), want.parameters()):
        assert p.dtype == torch.bfloat16
        torch.testing.assert_close(FP.full(p), q.detach(), rtol=0, atol=0)
    # bf16 sums depend on the order of the reduction: bf16 tolerance
    one = lambda *a: _train(*a, steps=1)  # noqa: E731
    res["bfloat16"] = _parity_on(rank, model, loop=one, dtype=torch.bfloat16, rtol=2e-2, atol=2e-2)

    # load_state_dict(assign=True) of another sharded model's state dict:
    # the optimizer made before keeps training the model.
    model = FP.shard(FP.make())
    opt = FP.sgd(model)
    ids = [id(p) for p in model.parameters()]
    other = FP.shard(FP.make(seed=1))
    model.load_state_dict(other.state_dict(), assign=True)
    assert [id(p) for p in model.parameters()] == ids
    for p, q in zip(model.parameters(), FP.make(seed=1).parameters()):
        torch.testing.assert_close(FP.full(p), q.detach(), rtol=0, atol=0)
    res["assign"] = _parity_on(rank, model, opt)
    # Full tensors cannot be assigned to sharded parameters: one clear error.
    model = FP.shard(FP.make())
    with pytest.raises(ValueError, match=r"\[rank \d\] unit '.*': parameter '.*' was assigned a plain tensor"):
        model.load_state_dict(FP.make(seed=1).state_dict(), assign=True)
    return res


# ------------------------------------------- optimizer between forward and backward
def _late_optimizer(model, opt, rank, sharded):
    out, opt = [], None
    for step in range(3):
        loss = FP.loss_of(model, rank, step)
        if opt is None:
            # torch FSDP2 hands such an optimizer the unsharded parameters
            # its root registers during forward; ours always sees the shards.
            opt = FP.sgd(model)
            if sharded:
                assert all(isinstance(p, DTensor) for g in opt.param_groups for p in g["params"])
        loss.backward()
        out.append(FP.snap(model, loss))
        opt.step()
        opt.zero_grad()
    return out


def _late_optimizer_case(rank, world):
    return {"late_optimizer": FP.parity(rank, _late_optimizer, optimizer=lambda m: None)}


# -------------------------------------------------------------- construction errors
def _raises(match, fn):
    with pytest.raises(ValueError, match=match):
        fn()


def _errors_case(rank, world):
    from torch.distributed.device_mesh import init_device_mesh

    where = r"\[rank \d\]"
    model = FP.make()
    fully_shard(model.layers[0])
    _raises(f"{where} fully_shard.*already sharded", lambda: fully_shard(model.layers[0]))
    _raises(f"{where} fully_shard.*already sharded", lambda: fully_shard([model.layers[1], model.layers[0]]))
    # Root first, then a child: its parameters are the root's shards already.
    model = FP.make()
    fully_shard(model)
    _raises(f"{where} parameter 'gate' of unit 'Block' is already a sharded parameter of unit 'Net'",
            lambda: fully_shard(model.layers[0]))
    # Inside an FSDP1 wrapper, and the wrapper itself.
    model = FP.make()
    wrapper = fullshard.FullyShardedDataParallel(model)
    _raises(f"{where} parameter 'gate' of unit 'Block' is already a sharded parameter of unit 'Net'",
            lambda: fully_shard(model.layers[0]))
    _raises(f"{where} fully_shard.*already sharded", lambda: fully_shard(wrapper))
    _raises(f"reshard_after_forward=3 must divide the shard group size {world}",
            lambda: fully_shard(FP.make(), reshard_after_forward=3))
    _raises("reshard_after_forward must be None, a bool or an int, got 'yes'",
            lambda: fully_shard(FP.make(), reshard_after_forward="yes"))
    mesh3 = init_device_mesh("cpu", (1, 1, world))
    _raises("mesh must be 1-D .* or 2-D .*got 3-D", lambda: fully_shard(FP.make(), mesh=mesh3))
    _raises("mp_policy must be a fullshard.MixedPrecisionPolicy, got MixedPrecision",
            lambda: fully_shard(FP.make(), mp_policy=fullshard.MixedPrecision()))
    _raises("offload_policy must be", lambda: fully_shard(FP.make(), offload_policy=fullshard.CPUOffload()))
    scalar = FP.make()
    scalar.temperature = nn.Parameter(torch.tensor(1.0))
    _raises(f"{where} fully_shard.*'temperature' is 0-dimensional", lambda: fully_shard(scalar))
    # Sparse gradients (failed in backward with "copy_() between dense and sparse Tensors"); a frozen table
    # makes none and shards.
    sparse = "parameter 'weight' of unit 'EmbeddingBag': EmbeddingBag\\(sparse=True\\) makes sparse gradients"
    _raises(f"{where} {sparse}", lambda: fully_shard(nn.EmbeddingBag(8, 4, sparse=True)))
    _raises(f"{where} {sparse}", lambda: fullshard.FullyShardedDataParallel(nn.EmbeddingBag(8, 4, sparse=True)))
    fully_shard(nn.Embedding(8, 4, sparse=True).requires_grad_(False))
    # A trainable parameter added to a unit's module after sharding (each rank trained its own copy: 1.1e-2
    # apart in an audit, torch FSDP2 the same) is refused at the next forward; frozen ones and modules without
    # parameters are fine.
    for door in (FP.shard, fullshard.FullyShardedDataParallel):
        model = door(FP.make())
        block = (model.layers if door is FP.shard else model.module.layers)[0]
        block.spare = nn.Identity()
        block.frozen = nn.Parameter(torch.ones(3), requires_grad=False)
        FP.loss_of(model, rank, 0).backward()
        block.extra = nn.Parameter(torch.ones(3))
        with pytest.raises(RuntimeError, match=rf"{where} unit '.*': parameter 'extra' of its .* was added after "
                                               "sharding"):
            FP.loss_of(model, rank, 1)
    # An optimizer made before sharding holds the replaced parameters: its step left the model untrained
    # (4.2e-2 off one process in an audit, no error); refused at its first step, both doors.
    for door in (FP.shard, fullshard.FullyShardedDataParallel):
        base = FP.make()
        early = torch.optim.AdamW(base.parameters(), lr=0.1)
        model = door(base)
        FP.loss_of(model, rank, 0).backward()
        with pytest.raises(RuntimeError, match=rf"{where} AdamW holds parameter '.*' of unit '.*' and \d+ more as it "
                                               "was before sharding.*create the optimizer after"):
            early.step()
    # After all these refusals, sharding and training still match DDP.
    return {"after_errors": FP.parity(rank, _train)}


def _per_rank_values_case(rank, world):
    """Different weights on different ranks: torch FSDP2 would shard each
    rank's own values (a model no rank holds); DDP broadcasts rank 0's.
    fully_shard refuses at the first forward, naming what works for its
    users; torch's remedy (rank 0's full state dict broadcast after
    fully_shard) then trains as DDP from rank 0's weights."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    model = FP.shard(FP.make(seed=rank))
    remedies = r"same seed.*set_model_state_dict\(.*broadcast_from_rank0=True"
    for _ in range(2):  # refused again until something writes the parameters
        _raises(rf"\[rank \d\] unit '.*': parameter '.*' differed across ranks \[0, 1\].*{remedies}",
                lambda: FP.loss_of(model, rank, 0))
    _raises("differs across ranks.*sync_module_states=True",  # the wrapper's own remedy
            lambda: fullshard.FullyShardedDataParallel(FP.make(seed=rank)))

    def load_from_rank0(plain):  # plain: rank 0's weights, built on every rank for the DDP reference
        model = FP.shard(FP.make(seed=rank))
        options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
        set_model_state_dict(model, plain.state_dict() if rank == 0 else {}, options=options)
        return model

    return {"broadcast_from_rank0_vs_ddp": FP.parity(rank, _train, shard_fn=load_from_rank0)}


# ------------------------------------------- parameters replaced before the first forward
def _new_values(seed=3):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(FP.HIDDEN, FP.DIM, generator=gen), torch.randn(FP.VOCAB, FP.DIM, generator=gen)


def _shard_of(value, like):
    """``value`` (full) as this rank's shard of a parameter placed like ``like``."""
    return distribute_tensor(value, like.device_mesh, like.placements)


def _replace(model, sharded: bool) -> None:
    """Two trained parameters and a frozen one, replaced (as shards under fully_shard)."""
    w1, w2 = _new_values()
    gate = torch.tensor([0.5, 0.2])
    news = [(model.layers[1].lin1, "weight", w1, True), (model.output, "weight", w2, True),
            (model.layers[2], "gate", gate, False)]
    for mod, attr, value, trained in news:
        value = _shard_of(value, getattr(mod, attr)) if sharded else value
        setattr(mod, attr, nn.Parameter(value, requires_grad=trained))


def _replaced_case(rank, world):
    """Parameters replaced between fully_shard and the first forward are
    adopted (torch FSDP2's lazy init); the optimizer made after trains them, as DDP's."""
    res = {}
    plain = FP.make()
    _replace(plain, False)
    ref = DDP(plain)
    want = _train(ref, FP.sgd(ref), rank, False)
    model = FP.shard(FP.make())
    old = model.layers[1].lin1.weight
    _replace(model, True)
    new = model.layers[1].lin1.weight
    got = _train(model, FP.sgd(model), rank, True)
    assert model.layers[1].lin1.weight is new and not model.layers[2].gate.requires_grad
    # The sharded-parameter registry follows the adopted object (core/registry.py).
    assert fullshard.shard_info(new).fqn == "lin1.weight" and fullshard.shard_info(old) is None
    assert registry.holder(new) == registry.holder(model.layers[1].lin2.weight) is not None
    assert registry.holder(old) is None
    FP.assert_same(got, want)
    res["replaced_before_forward"] = FP.max_diff(got, want)
    # to_empty, then every parameter replaced (an init that assigns).
    model = _meta_model()
    model.to_empty(device="cpu")
    for (_, value), (mod, attr) in zip(FP.make(seed=5).named_parameters(), _owners(model)):
        setattr(mod, attr, nn.Parameter(_shard_of(value.detach(), getattr(mod, attr))))
    opt = FP.sgd(model)
    FP.loss_of(model, rank, 0)  # lazy init adopts
    for name, value in FP.make(seed=5).named_parameters():
        torch.testing.assert_close(FP.full(dict(model.named_parameters())[name]), value.detach(), rtol=0, atol=0)
    res["to_empty_replaced"] = _parity_on(rank, model, opt)
    # One clear error each: a plain tensor (torch: AttributeError), another
    # shape (torch: ignored), weights tied after sharding, a replacement
    # after the first forward (torch: ignored).
    where = r"\[rank \d\] unit 'Block': parameter 'lin1.weight'"
    bad = {"plain tensor": lambda lin: nn.Parameter(_new_values()[0]),
           r"tensor of shape \(10, 7\).*must keep the shape \(9, 7\)":
               lambda lin: nn.Parameter(_shard_of(torch.zeros(FP.HIDDEN + 1, FP.DIM), lin.weight)),
           "another sharded parameter": lambda lin: model.layers[1].lin1.weight}
    for what, value in bad.items():
        model = FP.shard(FP.make())
        model.layers[0].lin1.weight = value(model.layers[0].lin1)
        _raises(f"{where} was replaced by a {what}" if "shape" in what else f"{where} was replaced by (a )?{what}",
                lambda: FP.loss_of(model, rank, 0))
    model = FP.shard(FP.make())
    FP.loss_of(model, rank, 0).backward()
    model.layers[0].lin1.weight = nn.Parameter(_shard_of(_new_values()[0], model.layers[0].lin1.weight))
    where = r"\[rank \d\] unit 'layers\.0': parameter 'lin1.weight'"  # units are named by path once the root ran
    with pytest.raises(RuntimeError, match=f"{where} was replaced .* after sharding"):
        FP.loss_of(model, rank, 1)
    return res


def _owners(model):
    """(module, attribute) of each parameter, in named_parameters() order."""
    return [(model.get_submodule(n.rpartition(".")[0]), n.rpartition(".")[2]) for n, _ in model.named_parameters()]


# ------------------------------------------------ torch FSDP2's module contract
def _contract_case(rank, world):
    import copy

    model = FP.shard(FP.make())
    st = fully_shard.state(model.layers[0])
    assert fully_shard.state(model.layers[0].lin1) is None and fully_shard.state(nn.Linear(2, 2)) is None
    assert st.modules == (model.layers[0],)
    assert sorted(st.param_names) == sorted(n for n, _ in FP.Block().named_parameters())
    assert st.is_root is None and fully_shard.state(model).is_root is None  # before lazy init
    FP.loss_of(model, rank, 0).backward()
    assert st.is_root is False and fully_shard.state(model).is_root is True
    assert st.training_state.value == "IDLE" and st.sharded_state.value == "SHARDED" and st.reshard_after_forward
    model.layers[0].set_reshard_after_forward(False)
    assert not st.reshard_after_forward and st.mesh.size() == world and st.unit is model.layers[0].unit
    other = FP.make()
    fully_shard([other.tok_embeddings, other.output])
    assert fully_shard.state(other.tok_embeddings) is fully_shard.state(other.output)
    # Containers without a forward: torch FSDP2's ValueError.
    for container in (nn.ModuleList([nn.Linear(2, 2)]), nn.ModuleDict({"a": nn.Linear(2, 2)})):
        _raises("does not support containers that do not implement forward", lambda: fully_shard(container))
    # deepcopy: torch FSDP2's AssertionError (it crashed in copy_ on an invalid storage).
    for target in (model, model.layers[0]):
        with pytest.raises(AssertionError, match="deepcopy of a fully_shard module .* not supported"):
            copy.deepcopy(target)
    # A slice of a sharded nn.Sequential is a plain Sequential (torch's);
    # called on sharded children alone it computes as the plain model does.
    torch.manual_seed(0)
    seq = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3), nn.Linear(3, 2))
    ref = copy.deepcopy(seq)
    for i in (0, 2):
        fully_shard(seq[i])
    fully_shard(seq)
    part = seq[0:3]
    assert type(part) is nn.Sequential and not isinstance(part, fullshard.FSDPModule)
    assert isinstance(part[0], fullshard.FSDPModule) and type(seq[1:]) is nn.Sequential
    x = torch.randn(5, 4, generator=torch.Generator().manual_seed(rank))
    seq(x).sum().backward()
    out = part(x)
    out.sum().backward()
    want = ref[0:3](x)
    want.sum().backward()
    torch.testing.assert_close(out, want)
    seq(x).sum().backward()  # the whole model runs on
    return {}


def _group_two(rank, world):
    out = {}
    for case in (_identity_case, _tied_case, _deferred_case, _convert_case, _late_optimizer_case, _errors_case,
                 _per_rank_values_case, _replaced_case, _contract_case):
        out.update(case(rank, world))
    return out


def _group_three(rank, world):
    out = {}
    for case in (_identity_case, _tied_case, _deferred_case):
        out.update(case(rank, world))
    return out


def test_construction_two_ranks():
    print(run_ranks(_group_two, 2)[0])


def test_construction_three_ranks():
    """Uneven shards and an empty one (``gate`` on rank 2)."""
    print(run_ranks(_group_three, 3)[0])
