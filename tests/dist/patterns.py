"""Models and a DDP-parity driver for the usage patterns off the happy path
(tests/dist/test_patterns.py): every pattern is run on torch DDP and on
fullshard under FULL_SHARD, SHARD_GRAD_OP and NO_SHARD and through
``fully_shard`` with the same seeds and per-rank data, and losses,
gradients-or-None and final parameters are compared."""
from __future__ import annotations

import dataclasses
from typing import Callable, NamedTuple

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.checkpoint import checkpoint

from fullshard import FSDPModule, ShardingStrategy
from fullshard.wrap import ModuleWrapPolicy
from tests.dist.common import ATOL, FULLY_SHARD, RTOL, full, label, shard

STRATEGIES = (ShardingStrategy.FULL_SHARD, ShardingStrategy.SHARD_GRAD_OP, ShardingStrategy.NO_SHARD)
WRAPPINGS = STRATEGIES + (FULLY_SHARD,)
"""What :func:`compare` runs by default: the wrapper under each strategy, then ``fully_shard``."""


class Enc(nn.Module):
    """The nested unit: (15, 7) and (3, 15) weights, plus a spare layer that
    some patterns leave unused."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(7, 15)
        self.b = nn.Linear(15, 3)
        self.spare = nn.Linear(3, 3)

    def forward(self, x, use_spare: bool = False):
        h = self.b(torch.tanh(self.a(x)))
        return self.spare(h) if use_spare else h


class Net(nn.Module):
    """Root parameters (pre, head, extra) around the nested unit ``enc``."""

    def __init__(self):
        super().__init__()
        self.pre = nn.Linear(7, 7)
        self.enc = Enc()
        self.head = nn.Linear(3, 5)
        self.extra = nn.Linear(7, 5)  # unused unless asked

    def forward(self, x, use_enc: bool = True, use_spare: bool = False, use_extra: bool = False,
                branch: str = ""):
        h = torch.relu(self.pre(x))
        if branch:
            return self._branch(h, branch)
        out = self.head(self.enc(h, use_spare)) if use_enc else self.head(h[:, :3])
        if use_extra:
            out = out + self.extra(h)
        return out

    def _branch(self, h, mode: str):
        """A target branch of ``enc`` without grad, then an online branch with
        grad, in one iteration (SimSiam/BYOL-style; checkpointing's first pass)."""
        if mode == "inference_mode":
            with torch.inference_mode():
                target = self.enc(h)
            target = target.clone()
        else:
            with torch.no_grad():
                target = self.enc(h)
        if mode == "reentrant":
            online = checkpoint(self.enc, h, use_reentrant=True)
        elif mode == "non_reentrant":
            online = checkpoint(self.enc, h, use_reentrant=False)
        else:
            online = self.enc(h)
        return self.head(online), (online * target).mean()


@dataclasses.dataclass
class Out:
    logits: torch.Tensor
    aux: dict


class Pair(NamedTuple):
    main: torch.Tensor
    side: torch.Tensor


def make(seed: int = 0) -> Net:
    torch.manual_seed(seed)
    return Net()


def batch(rank: int, step: int, micro: int = 0):
    g = torch.Generator().manual_seed(10_000 * rank + 100 * step + micro)
    return torch.randn(4, 7, generator=g), torch.randn(4, 5, generator=g)


def policy():
    return ModuleWrapPolicy({Enc})


def inner(model):
    """The Enc module, whatever wraps it."""
    m = model.module if isinstance(model, DDP) else model
    return m.enc


def full_state(model) -> tuple[dict, dict]:
    """(full parameters, full gradients or None) by original name."""
    if isinstance(model, DDP):
        named = {n.removeprefix("module."): p for n, p in model.named_parameters()}
        return ({n: p.detach().clone() for n, p in named.items()},
                {n: None if p.grad is None else p.grad.clone() for n, p in named.items()})
    if isinstance(model, FSDPModule):
        named = dict(model.named_parameters())
        nones = [p.grad is None for p in named.values()]
        every = [None] * dist.get_world_size()
        dist.all_gather_object(every, nones)  # a gradient None on one rank only would hang full_tensor()
        assert all(e == nones for e in every), f"gradient None differs across ranks: {every}"
        return ({n: full(p) for n, p in named.items()},
                {n: None if p.grad is None else full(p.grad) for n, p in named.items()})
    with model.summon_full_params(writeback=False, with_grads=True):
        named = dict(model.named_parameters())
        return ({n: p.detach().clone() for n, p in named.items()},
                {n: None if p.grad is None else p.grad.clone() for n, p in named.items()})


def run(model, step_fn: Callable, rank: int, steps: int, opt_fn=None):
    """Train ``steps`` steps with ``step_fn(model, opt, rank, step) -> loss or
    None`` (None: the step was skipped). Returns losses, per-step gradients
    (full, None kept) and the final full parameters."""
    params = list(model.parameters())
    opt = opt_fn(params) if opt_fn else torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)
    losses, grads = [], []
    for step in range(steps):
        loss = step_fn(model, opt, rank, step)
        if loss is None:
            continue
        losses.append(float(loss))
        grads.append(full_state(model)[1])
        opt.step()
        opt.zero_grad()
    return losses, grads, full_state(model)[0]


def compare(rank: int, step_fn: Callable, steps: int = 4, strategies=WRAPPINGS, make_fn=make,
            ddp_kwargs=None, fsdp_kwargs=None, ref_step_fn=None, opt_fn=None, policy_fn=None) -> float:
    """Run ``step_fn`` on DDP (``ref_step_fn`` if given) and on fullshard under
    each of ``strategies`` (a ``ShardingStrategy``: the wrapper, with
    ``fsdp_kwargs``; ``FULLY_SHARD``: ``fully_shard`` on the units of the
    policy, then the root, with defaults); assert equal losses, equal
    gradients (None where DDP has None) and equal final parameters. Returns
    the largest absolute difference to DDP over losses, gradients and final
    parameters."""
    if fsdp_kwargs and FULLY_SHARD in strategies:
        raise ValueError("fsdp_kwargs are the wrapper's arguments: pass strategies=STRATEGIES with them")
    base = make_fn()
    ref = DDP(_clone(base), **(ddp_kwargs or {"find_unused_parameters": True}))
    ref_losses, ref_grads, ref_params = run(ref, ref_step_fn or step_fn, rank, steps, opt_fn)
    worst = 0.0
    for strategy in strategies:
        model = shard(_clone(base), strategy, (policy_fn or policy)(), **(fsdp_kwargs or {}))
        losses, grads, params = run(model, step_fn, rank, steps, opt_fn)
        where = label(strategy)
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=RTOL, atol=ATOL,
                                   msg=lambda m: f"{where} losses: {m}")
        for step, (g, rg) in enumerate(zip(grads, ref_grads)):
            assert g.keys() == rg.keys(), (where, sorted(g), sorted(rg))
            for n in rg:
                assert (g[n] is None) == (rg[n] is None), f"{where} step {step} {n}: grad {g[n]} vs DDP {rg[n]}"
                if rg[n] is not None:
                    torch.testing.assert_close(g[n], rg[n], rtol=1e-5, atol=ATOL,
                                               msg=lambda m: f"{where} step {step} grad {n}: {m}")
        for n in ref_params:
            torch.testing.assert_close(params[n], ref_params[n], rtol=RTOL, atol=ATOL,
                                       msg=lambda m: f"{where} param {n}: {m}")
        worst = max([worst] + [abs(a - b) for a, b in zip(losses, ref_losses)]
                    + [float((g[n] - rg[n]).abs().max()) for g, rg in zip(grads, ref_grads)
                       for n in rg if rg[n] is not None and rg[n].numel()]
                    + [float((params[n] - ref_params[n]).abs().max()) for n in ref_params if params[n].numel()])
    return worst


def _clone(m):
    import copy
    return copy.deepcopy(m)


def mse(out, y):
    # In the promoted dtype: torch 2.11's mse_loss backward refuses mixed dtypes (a bf16 output, fp32 target).
    dtype = torch.promote_types(out.dtype, y.dtype)
    return F.mse_loss(out.to(dtype), y.to(dtype))
