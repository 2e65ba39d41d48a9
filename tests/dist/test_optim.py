"""fullshard.optim on shards (src/fullshard/optim/shards.py [Note: optimizers
on shards]): Muon, Adafactor and Lamb under FULL_SHARD, SHARD_GRAD_OP and
HYBRID_SHARD, through both front doors and several placements, against the
single-device optimizer fed the same gradients (Muon bitwise; the others'
largest difference printed); and the loud error for torch's optimizers that
are not element-wise (core/optim_guard.py)."""
from __future__ import annotations

import pytest
import torch

from fullshard import BlockShard, optim
from tests.dist import optim_cases as O
from tests.dist.common import FULLY_SHARD
from tests.dist.harness import run_ranks

TOL = 1e-5
"""Largest |parameter difference| allowed for Adafactor and Lamb (fp32 sums in another order)."""


def _muon_groups(m):
    return optim.muon_param_groups(m, adamw={"lr": 3e-3})


def _gate_groups(m):
    """Muon for the (1, 6) gates only (whole on one rank under torch.chunk rows), AdamW for the rest."""
    gates = [p for n, p in m.named_parameters() if n.endswith("gate.weight")]
    rest = [p for n, p in m.named_parameters() if not n.endswith("gate.weight")]
    return [{"params": gates}, {"params": rest, "use_muon": False, "lr": 3e-3}]


def _cases(how):
    """name -> (optimizer, reference, placement factory, groups, bitwise)."""
    wrapper = not (how == FULLY_SHARD or isinstance(how, tuple))
    muon = lambda g: optim.Muon(g, lr=0.02)  # noqa: E731
    ada = lambda g: optim.Adafactor(g, weight_decay=0.01)  # noqa: E731
    ada_ref = lambda g: torch.optim.Adafactor(g, weight_decay=0.01)  # noqa: E731
    lamb = lambda g: optim.Lamb(g, lr=0.01, weight_decay=0.01)  # noqa: E731
    owned = optim.muon_placement_fn
    out = {"muon gates": (muon, O.RefMuon, None, _gate_groups, True),
           "muon rows": (muon, O.RefMuon, None, _muon_groups, True),
           "adafactor": (ada, ada_ref, None, None, False),
           "lamb": (lamb, lamb, None, None, False)}
    if wrapper:
        out.update({"muon owned": (muon, O.RefMuon, owned, _muon_groups, True),
                    "adafactor owned": (ada, ada_ref, owned, None, False),
                    "adafactor block2": (ada, ada_ref, lambda b: (lambda p: BlockShard(2)), None, False),
                    "lamb owned": (lamb, lamb, owned, None, False)})
    return out


def _parity(rank, world, hows):
    out = {}
    for how in hows:
        for name, (make, ref, place, groups, bitwise) in _cases(how).items():
            worst = O.compare(rank, world, how, make, ref, place, groups=groups)
            where = f"{name} {how if isinstance(how, str) else 'fully_shard hybrid'} world={world}"
            assert worst == 0.0 if bitwise else worst < TOL, f"{where}: max |diff| {worst:.3e}"
            out[where] = worst
    return out


def _report(results):
    for where, worst in sorted(results[0].items()):
        print(f"{where}: max |param diff| vs one device = {worst:.3e}")


@pytest.mark.fast
def test_optimizers_match_one_device_2_ranks():
    _report(run_ranks(_parity, 2, ["FULL_SHARD", "SHARD_GRAD_OP", FULLY_SHARD]))


def test_optimizers_match_one_device_3_ranks():
    _report(run_ranks(_parity, 3, ["FULL_SHARD", "SHARD_GRAD_OP", FULLY_SHARD]))


def test_optimizers_match_one_device_hybrid_4_ranks():
    _report(run_ranks(_parity, 4, ["HYBRID_SHARD", (FULLY_SHARD, "hybrid")]))


class _Logged(torch.optim.AdamW):
    """A subclass of an element-wise optimizer: not on the exact-class list."""


def _step(model, opt, rank, step=0):
    O.loss(model, rank, step).backward()
    opt.step()
    opt.zero_grad()


def _raises(fn, exc=Exception):
    try:
        fn()
    except exc as e:
        return str(e)
    raise AssertionError("did not raise")


def _guard(rank, world):
    from fullshard.core import collectives
    out = {}
    # torch's optimizers that need whole tensors: one clear error at the first step, nothing changed.
    for how in ("FULL_SHARD", FULLY_SHARD):
        model = O.wrap(O.make_net(), how, world)
        before = [p.detach().clone() for p in model.parameters()]
        two_d = [p for p in model.parameters() if p.ndim == 2]
        out[f"muon {how}"] = _raises(lambda: _step(model, torch.optim.Muon(two_d), rank), optim.ShardedOptimizerError)
        out[f"adafactor {how}"] = _raises(lambda: _step(model, torch.optim.Adafactor(model.parameters()), rank),
                                          optim.ShardedOptimizerError)
        calls = []

        def closure():
            calls.append(1)
            return O.loss(model, rank, 0)
        out[f"lbfgs {how}"] = _raises(lambda: torch.optim.LBFGS(model.parameters()).step(closure),
                                      optim.ShardedOptimizerError)
        assert not calls, "the closure ran before the error"
        assert all(torch.equal(a, b) for a, b in zip(before, model.parameters())), how
        # Element-wise optimizers (foreach and fused variants too) run untouched.
        for opt in (torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                    torch.optim.AdamW(model.parameters(), foreach=True),
                    torch.optim.Adam(model.parameters(), fused=True),
                    torch.optim.Adagrad(model.parameters()), torch.optim.RMSprop(model.parameters())):
            _step(model, opt, rank)
        # A subclass is checked; allow_elementwise opts it out; the verdict follows the groups.
        logged = _Logged([torch.nn.Parameter(torch.zeros(3))])
        logged.step()
        logged.add_param_group({"params": list(model.parameters())})
        out[f"subclass {how}"] = _raises(lambda: _step(model, logged, rank), optim.ShardedOptimizerError)
        optim.allow_elementwise(_Logged)
        _step(model, logged, rank)
        optim.disallow(_Logged)
    # What the guard prevents: torch's Muon and Adafactor on row shards are not one device's step.
    try:
        optim.allow_elementwise(torch.optim.Muon)
        optim.allow_elementwise(torch.optim.Adafactor)
        two_d = lambda m: [p for p in m.parameters() if p.ndim == 2]  # noqa: E731
        muon = lambda g: torch.optim.Muon(g, lr=0.02)  # noqa: E731
        out["muon wrong by"] = O.compare(rank, world, "FULL_SHARD", muon, muon, groups=two_d)
        # (torch's Adafactor divides by zero on a rank holding no rows of the (1, 6) gates.)
        no_gates = lambda m: [p for n, p in m.named_parameters() if "gate" not in n]  # noqa: E731
        out["adafactor wrong by"] = O.compare(rank, world, "FULL_SHARD", torch.optim.Adafactor,
                                              torch.optim.Adafactor, groups=no_gates)
    finally:
        optim.disallow(torch.optim.Muon)
        optim.disallow(torch.optim.Adafactor)
    # State sharded like the parameters: Muon's momentum only on owners (empty elsewhere), Adafactor's
    # row statistics per row and column statistics the same on every rank.
    base = O.make_net()
    model = O.wrap(base, "FULL_SHARD", world, optim.muon_placement_fn(base))
    muon = optim.Muon(optim.muon_param_groups(model))
    ada = optim.Adafactor([p for g in optim.muon_param_groups(model) if not g["use_muon"] for p in g["params"]])
    _step(model, muon, rank)
    for p in muon.param_groups[0]["params"]:
        assert muon.state[p]["momentum_buffer"].shape == p.shape, (p.shape, muon.state[p]["momentum_buffer"].shape)
    out["empty momentum"] = sum(p.shape[0] == 0 for p in muon.param_groups[0]["params"])
    O.loss(model, rank, 1).backward()
    ada.step()
    cols = {}
    for p in ada.param_groups[0]["params"]:
        s = ada.state[p]
        if p.ndim >= 2:
            assert s["row_var"].shape[0] == p.shape[0], (p.shape, s["row_var"].shape)
        if p.ndim == 2:
            cols[shard_name(p)] = s["col_var"].tolist()
    out["cols"] = collectives.all_gather_object(cols)
    return out


def shard_name(p):
    from fullshard import shard_info
    return shard_info(p).fqn


@pytest.mark.fast
def test_torch_optimizers_that_need_whole_tensors_raise():
    out = run_ranks(_guard, 2)
    for key in ("muon", "lbfgs", "subclass"):
        print(out[0][f"{key} FULL_SHARD"])
    for rank, res in enumerate(out):
        for how in ("FULL_SHARD", FULLY_SHARD):
            for key, fix in (("muon", "use fullshard.optim.Muon"), ("adafactor", "use fullshard.optim.Adafactor"),
                             ("lbfgs", "use an element-wise optimizer"), ("subclass", "allow_elementwise")):
                msg = res[f"{key} {how}"]
                assert msg.startswith(f"[rank {rank}] ") and "not element-wise" in msg and fix in msg, msg
                assert "\n" not in msg
        print(f"rank {rank}: torch.optim.Muon off by {res['muon wrong by']:.3e}, torch.optim.Adafactor off by "
              f"{res['adafactor wrong by']:.3e} on row shards (with the opt-out)")
        assert res["muon wrong by"] > 1e-2 and res["adafactor wrong by"] > 1e-4, res
    assert sum(r["empty momentum"] for r in out) > 0  # some rank holds zero rows of an owned matrix
    cols = out[0]["cols"]
    assert cols[0].keys() == cols[1].keys() and cols[0]
    for name in cols[0]:
        assert cols[0][name] == cols[1][name], name
