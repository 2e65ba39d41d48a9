"""Losses computed from tensors a forward stored on a module instead of
returning them (auxiliary heads, multi-task models), from a nested unit's
output, from the root's, from both, under every strategy, through
``fully_shard``, and with ``no_sync``, against one process that computes the same global batch.

The reference is a single process, not DDP: DDP with
``find_unused_parameters=True`` searches for used parameters from the
forward's return value, so when the loss comes from a stored intermediate
it waits for gradients of parameters the loss never reached, never
all-reduces, leaves each rank its local gradient and raises at the next
forward (``test_ddp_is_no_reference_here`` records this)."""
from __future__ import annotations

import contextlib
import copy

import torch
import torch.nn as nn

from tests.dist.harness import run_ranks

STEPS = 3


class Block(nn.Module):
    def __init__(self, store: bool = False):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.store = store

    def forward(self, x):
        y = torch.tanh(self.lin(x))
        if self.store:
            self.kept = y * 2  # stored inside the nested unit
        return y


class Aux(nn.Module):
    """inp: Linear(6, 8); blocks: 2 × Block, one unit each; out: Linear(8, 3)."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(6, 8)
        self.blocks = nn.ModuleList([Block(store=True), Block()])
        self.out = nn.Linear(8, 3)

    def forward(self, x):
        h = self.blocks[0](self.inp(x))
        self.aux = h  # a nested unit's output, kept on the root
        self.root_aux = self.inp.weight.sum() * h.mean()  # computed by the root itself
        return self.out(self.blocks[1](h))


LOSSES = {
    "nested unit's output on the root": lambda m, out: m.aux.pow(2).mean(),
    "nested output and returned output": lambda m, out: m.aux.pow(2).mean() + out.pow(2).mean(),
    "root's own stored tensor": lambda m, out: m.root_aux,
    "root's and nested unit's": lambda m, out: m.root_aux + m.aux.pow(2).mean(),
    "stored inside the nested unit": lambda m, out: m.blocks[0].kept.pow(2).mean(),
    "inside the nested unit and returned": lambda m, out: m.blocks[0].kept.pow(2).mean() + out.sum(),
}


def _data(rank: int, step: int, micro: int) -> torch.Tensor:
    return torch.randn(4, 6, generator=torch.Generator().manual_seed(1000 * rank + 10 * step + micro))


def _reference(base: nn.Module, loss_fn, world: int, micro: int) -> list[dict]:
    """Per-step gradients of one process over the global batch (DDP's mean over ranks)."""
    model = copy.deepcopy(base)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    grads = []
    for step in range(STEPS):
        for rank in range(world):
            for k in range(micro):
                (loss_fn(model, model(_data(rank, step, k))) / world).backward()
        grads.append({n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()})
        opt.step()
        opt.zero_grad()
    return grads


def _stored_outputs(rank, world):
    from fullshard.wrap import ModuleWrapPolicy
    from tests.dist import patterns as P
    from tests.dist.common import label, no_sync, shard, unwrap

    worst = {}
    for lname, loss_fn in LOSSES.items():
        torch.manual_seed(0)
        base = Aux()
        for micro in (1, 2):
            ref = _reference(base, loss_fn, world, micro)
            for how in P.WRAPPINGS:
                where = f"{lname}, {label(how)}, {micro} micro-batch(es)"
                model = shard(copy.deepcopy(base), how, ModuleWrapPolicy({Block}))
                opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
                for step in range(STEPS):
                    for k in range(micro):
                        sync = contextlib.nullcontext() if k == micro - 1 else no_sync(model)
                        with sync:
                            loss_fn(unwrap(model), model(_data(rank, step, k))).backward()
                    for n, grad in P.full_state(model)[1].items():
                        want = ref[step][n]
                        assert (grad is None) == (want is None), f"{where} step {step} {n}: grad None?"
                        if want is not None:
                            torch.testing.assert_close(grad, want, rtol=1e-5, atol=1e-6,
                                                       msg=lambda m: f"{where} step {step} {n}: {m}")
                            worst[where] = max(worst.get(where, 0.0), float((grad - want).abs().max()))
                    opt.step()
                    opt.zero_grad()
    return worst


def test_losses_from_stored_outputs_match_one_process():
    """Every stored-output loss, FULL_SHARD / SHARD_GRAD_OP / NO_SHARD and
    fully_shard, with and without no_sync: gradients equal one process's over
    the global batch."""
    worst = run_ranks(_stored_outputs, 2)[0]
    assert max(worst.values()) < 1e-6, worst


def _ddp(rank, world):
    import pytest
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    base = Aux()
    loss_fn = LOSSES["nested unit's output on the root"]
    local = copy.deepcopy(base)
    loss_fn(local, local(_data(rank, 0, 0))).backward()
    ddp = DDP(copy.deepcopy(base), find_unused_parameters=True)
    loss_fn(ddp.module, ddp(_data(rank, 0, 0))).backward()
    for n, p in local.named_parameters():
        got = ddp.module.get_parameter(n).grad
        assert (got is None) == (p.grad is None), n
        if got is not None:
            assert torch.equal(got, p.grad), f"{n}: DDP reduced after all"
    with pytest.raises(RuntimeError, match="finished reduction in the prior iteration"):
        ddp(_data(rank, 1, 0))
    return True


def test_ddp_is_no_reference_here():
    """DDP leaves the unreduced local gradient for this pattern and fails on
    the next forward: why the test above compares with one process."""
    run_ranks(_ddp, 2)
