"""fullshard.optim on one device: Muon and Adafactor bitwise equal to torch's,
the Muon/AdamW recipe, LAMB against a transcription of You et al. 2020 Alg. 2,
and the opt-out API of the loud error (its multi-rank cases are in
tests/dist/test_optim.py)."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

from fullshard import optim
from fullshard.core import optim_guard, optim_hooks
from fullshard.models import GPT, GPTConfig
from fullshard.models.llama import Llama, LlamaArgs


def _grads(params, step):
    gen = torch.Generator().manual_seed(100 + step)
    return [torch.randn(p.shape, generator=gen) for p in params]


def _run(make_opt, params, steps=4):
    """Step ``make_opt(params)`` on fixed pseudo-random gradients; returns the parameters."""
    params = [nn.Parameter(p.detach().clone()) for p in params]
    opt = make_opt(params)
    for step in range(steps):
        for p, g in zip(params, _grads(params, step)):
            p.grad = g
        opt.step()
    return [p.detach() for p in params], opt


def _tensors(*shapes):
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(s, generator=gen) for s in shapes]


@pytest.mark.parametrize("kw", [{}, {"nesterov": False, "adjust_lr_fn": "match_rms_adamw", "weight_decay": 0.0},
                                {"lr": torch.tensor([0.02]), "adjust_lr_fn": "original", "ns_steps": 3}])
def test_muon_bitwise_torch(kw):
    params = _tensors((8, 5), (5, 8), (6, 6))
    ours, _ = _run(lambda ps: optim.Muon(ps, **kw), params)
    ref, _ = _run(lambda ps: torch.optim.Muon(ps, **kw), params)
    for a, b in zip(ours, ref):
        assert torch.equal(a, b)


def test_muon_rejects_non_2d_like_torch():
    with pytest.raises(ValueError, match="Muon only supports 2D parameters.*use_muon=False"):
        optim.Muon([nn.Parameter(torch.zeros(3))])
    opt = optim.Muon([nn.Parameter(torch.zeros(2, 2))])
    with pytest.raises(ValueError, match="2D"):
        opt.add_param_group({"params": [nn.Parameter(torch.zeros(2, 2, 2))]})
    optim.Muon([{"params": [nn.Parameter(torch.zeros(3))], "use_muon": False}])  # AdamW group: fine


def test_muon_adamw_groups_bitwise_torch():
    """use_muon=False groups are torch.optim.AdamW with adamw_betas/eps/lr/weight_decay; Muon groups torch's Muon."""
    params = _tensors((6, 4), (4,), (3, 4, 2), (7, 3))

    def ours(ps):
        return optim.Muon([{"params": [ps[0], ps[3]]}, {"params": [ps[1], ps[2]], "use_muon": False}], lr=0.02,
                          adamw_lr=3e-3, adamw_weight_decay=0.01, adamw_betas=(0.8, 0.9), adamw_eps=1e-6)

    got, opt = _run(ours, params)
    ref, _ = _run(_Pair, params)
    for a, b in zip(got, ref):
        assert torch.equal(a, b)
    assert set(opt.state[opt.param_groups[1]["params"][0]]) == {"step", "exp_avg", "exp_avg_sq"}
    assert set(opt.state[opt.param_groups[0]["params"][0]]) == {"momentum_buffer"}


class _Pair(torch.optim.Optimizer):
    """torch.optim.Muon on params 0 and 3, torch.optim.AdamW on 1 and 2, stepped together."""

    def __init__(self, ps):
        super().__init__(ps, {})
        self.muon = torch.optim.Muon([ps[0], ps[3]], lr=0.02)
        self.adamw = torch.optim.AdamW([ps[1], ps[2]], lr=3e-3, weight_decay=0.01, betas=(0.8, 0.9), eps=1e-6)

    def step(self, closure=None):
        self.muon.step()
        self.adamw.step()


def test_muon_param_groups_recipe():
    gpt = GPT(GPTConfig(num_layers=2, embed_dim=16, num_heads=2, ffn_embed_dim=32, vocab_size=50, max_positions=8))
    groups = optim.muon_param_groups(gpt, muon={"lr": 0.02}, adamw={"lr": 3e-4})
    names = {id(p): n for n, p in gpt.named_parameters()}
    muon = sorted(names[id(p)] for p in groups[0]["params"])
    assert groups[0]["use_muon"] and groups[0]["lr"] == 0.02 and not groups[1]["use_muon"]
    assert muon == sorted(n for n, p in gpt.named_parameters() if p.ndim == 2 and "embed" not in n)
    assert "embed_tokens.weight" in {names[id(p)] for p in groups[1]["params"]}  # tied output head: AdamW
    assert sum(len(g["params"]) for g in groups) == len(list(gpt.parameters()))
    llama = Llama(LlamaArgs())
    groups = optim.muon_param_groups(llama, exclude=["layers.0.*"])
    names = {id(p): n for n, p in llama.named_parameters()}
    muon = {names[id(p)] for p in groups[0]["params"]}
    assert "output.weight" not in muon and "tok_embeddings.weight" not in muon
    assert "layers.1.attention.wq.weight" in muon and not any(n.startswith("layers.0.") for n in muon)
    with_head = {names[id(p)] for p in optim.muon_param_groups(llama, head_adamw=False)[0]["params"]}
    assert "output.weight" in with_head
    optim.Muon(optim.muon_param_groups(llama))  # every Muon parameter is 2-D
    place = optim.muon_placement_fn(llama)
    owned = {n for n, p in llama.named_parameters() if place(p) is not None}
    assert owned == {names[id(p)] for p in optim.muon_param_groups(llama)[0]["params"]}
    assert place(torch.zeros(3)) is None


@pytest.mark.parametrize("kw", [{}, {"weight_decay": 0.1, "maximize": True, "eps": (1e-30, 1e-3), "d": 1.5},
                                {"lr": 0.5, "beta2_decay": -0.5}])
def test_adafactor_bitwise_torch(kw):
    params = _tensors((8, 5), (5,), (3, 4, 6), (), (1, 7))
    ours, opt = _run(lambda ps: optim.Adafactor(ps, **kw), params)
    ref, ref_opt = _run(lambda ps: torch.optim.Adafactor(ps, **kw), params)
    for a, b in zip(ours, ref):
        assert torch.equal(a, b)
    for p, q in zip(opt.param_groups[0]["params"], ref_opt.param_groups[0]["params"]):
        assert opt.state[p].keys() == ref_opt.state[q].keys()
        for k in opt.state[p]:
            assert torch.equal(opt.state[p][k], ref_opt.state[q][k]), k


def _lamb_reference(params, grads_per_step, lr, betas, eps, wd):
    """You et al. 2020, Algorithm 2 written out in float64 (phi the identity)."""
    xs = [p.double().clone() for p in params]
    ms = [torch.zeros_like(x) for x in xs]
    vs = [torch.zeros_like(x) for x in xs]
    for t, grads in enumerate(grads_per_step, start=1):
        for x, m, v, g in zip(xs, ms, vs, grads):
            g = g.double()
            m.copy_(betas[0] * m + (1 - betas[0]) * g)
            v.copy_(betas[1] * v + (1 - betas[1]) * g * g)
            r = (m / (1 - betas[0] ** t)) / ((v / (1 - betas[1] ** t)).sqrt() + eps)
            u = r + wd * x
            xn, un = x.norm().item(), u.norm().item()
            x.sub_(lr * (xn / un if xn > 0 and un > 0 else 1.0) * u)
    return xs


@pytest.mark.parametrize("wd", [0.0, 0.01])
def test_lamb_matches_algorithm_2(wd):
    params = _tensors((8, 5), (5,), (3, 4, 6))
    params.append(torch.zeros(4))  # ||x|| = 0: trust ratio 1
    ours, opt = _run(lambda ps: optim.Lamb(ps, lr=0.01, weight_decay=wd), params, steps=5)
    ref = _lamb_reference(params, [_grads(params, s) for s in range(5)], 0.01, (0.9, 0.999), 1e-6, wd)
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a.double(), b, rtol=1e-5, atol=1e-6)
    assert set(opt.state[opt.param_groups[0]["params"][0]]) == {"step", "exp_avg", "exp_avg_sq"}


def test_lamb_trust_ratio_matters():
    """A guard against a reference that agrees by accident: Adam's step differs."""
    params = _tensors((8, 5))
    ours, _ = _run(lambda ps: optim.Lamb(ps, lr=0.01), params)
    adam, _ = _run(lambda ps: torch.optim.Adam(ps, lr=0.01, eps=1e-6), params)
    assert not torch.allclose(ours[0], adam[0])


def test_allow_elementwise_api():
    class Mine(torch.optim.SGD):
        pass

    assert Mine not in optim.ELEMENTWISE and torch.optim.AdamW in optim.ELEMENTWISE
    assert optim.allow_elementwise(Mine) is Mine
    assert Mine in optim_guard._ALLOWED
    optim.disallow(Mine)
    assert Mine not in optim_guard._ALLOWED
    with pytest.raises(TypeError, match="Optimizer subclass"):
        optim.allow_elementwise(nn.Linear)
    for cls in (optim.Muon, optim.Adafactor, optim.Lamb):
        assert cls in optim_guard._ALLOWED


def test_plain_model_untouched_by_guard():
    """No unit, no shard_info: every optimizer (LBFGS with its closure too) runs as without fullshard."""
    optim_guard.install()
    model = nn.Linear(3, 2)
    ref = copy.deepcopy(model)
    x = torch.randn(5, 3)
    for m in (model, ref):
        opt = torch.optim.LBFGS(m.parameters(), max_iter=3)

        def closure(m=m, opt=opt):
            opt.zero_grad()
            loss = m(x).square().mean()
            loss.backward()
            return loss

        opt.step(closure)
    assert torch.equal(model.weight, ref.weight)


def test_optimizer_step_hooks_run_in_their_fixed_order():
    """core/optim_hooks.py: one torch pre-hook and one post-hook, each registered once; callbacks run in the
    order PRE_STEP / POST_STEP fix, whatever order they were added in; unknown names are refused."""
    calls = []
    saved = dict(optim_hooks._PRE), dict(optim_hooks._POST)
    try:
        optim_hooks.add_pre_step("converted state dtype", lambda opt, a, k: calls.append("dtype"))
        optim_hooks.add_step_hooks("step count", lambda opt, a, k: calls.append("count"))
        optim_hooks.add_pre_step("sharded optimizer", lambda opt, a, k: calls.append("guard"))
        handles = dict(optim_hooks._HANDLES)
        optim_hooks.add_pre_step("sharded optimizer", lambda opt, a, k: calls.append("guard"))
        assert optim_hooks._HANDLES == handles and None not in handles.values()
        p = nn.Parameter(torch.ones(2))
        p.grad = torch.ones(2)
        torch.optim.SGD([p], lr=0.1).step()
        assert calls == ["count", "guard", "dtype", "count"]  # a step is counted before it writes, and after
        with pytest.raises(ValueError, match="not one of"):
            optim_hooks.add_pre_step("mine", lambda opt, a, k: None)
    finally:
        for table, old in zip((optim_hooks._PRE, optim_hooks._POST), saved):
            table.clear()
            table.update(old)


def test_init_optim_state_keeps_parameters():
    """fullshard.checkpoint.init_optim_state (and torch's DCP _init_optim_state) step at lr 0 with zero
    gradients to create state templates: no parameter may move, also in Muon's AdamW groups given adamw_lr."""
    from fullshard.checkpoint import init_optim_state

    params = [nn.Parameter(t) for t in _tensors((6, 4), (4,), (3, 4, 2))]
    for opt in (optim.Muon([{"params": [params[0]]}, {"params": params[1:], "use_muon": False}], adamw_lr=0.1,
                           adamw_weight_decay=0.5),
                optim.Adafactor(params, weight_decay=0.1), optim.Lamb(params, weight_decay=0.1)):
        before = [p.detach().clone() for p in params]
        init_optim_state(opt)
        assert opt.state and all(torch.equal(a, b) for a, b in zip(before, params)), type(opt).__name__
    groups = optim.Muon([{"params": params[1:], "use_muon": False}], adamw_lr=0.1).param_groups
    assert groups[0]["lr"] == 0.1 and groups[0]["weight_decay"] == 0.1  # adamw_lr: the group's own lr
