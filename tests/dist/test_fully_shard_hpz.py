"""``fully_shard(reshard_after_forward=k)``: after forward each rank keeps 1/k
of a unit's full parameters and backward all-gathers within k consecutive
ranks (hpZ). Training must be bitwise equal to ``True`` and ``False`` (the
same values reach the same arithmetic), the memory held between forward and
backward must be the k-group's share, and a k that does not divide the shard
group must be refused."""
from __future__ import annotations

import pytest
import torch

from tests.dist import models as M
from tests.dist.harness import run_ranks

# Not in the fast tier (make test-fast): several spawned groups; make test runs it.


def _train(rank, setting):
    import fullshard
    from fullshard.core.module import unit_modules

    model = M.make_model("gpt")
    for block in model.layers:
        fullshard.fully_shard(block, reshard_after_forward=setting)
    fullshard.fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-6)
    losses, held = [], []
    for step in range(3):
        x, y = M.batch("gpt", rank, step)
        loss = M.loss_fn("gpt", model, x, y)
        held.append([u.unit.unsharded_bytes() for u in unit_modules(model)])
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    params = {n: p.detach().full_tensor().numpy() for n, p in model.named_parameters()}
    return losses, held, params


def _body(rank, world):
    import fullshard

    out = {s: _train(rank, s) for s in (True, 2, False)}
    model = M.make_model("gpt")
    with pytest.raises(ValueError, match="must divide the shard group size 4"):
        fullshard.fully_shard(model.layers[0], reshard_after_forward=3)
    return out


def test_reshard_to_a_smaller_group_after_forward_is_bitwise_equal():
    out = run_ranks(_body, 4)[0]
    full, hpz, kept = out[True], out[2], out[False]
    assert full[0] == hpz[0] == kept[0]
    for name, value in full[2].items():
        assert (value == hpz[2][name]).all() and (value == kept[2][name]).all(), name
    # Between forward and backward a nested unit holds nothing (True), half
    # of its full parameters (k=2 of 4 ranks), or all of them (False).
    root_held = full[1][0][0]
    for step in range(3):
        for i in range(1, len(full[1][step])):
            assert full[1][step][i] == 0
            assert hpz[1][step][i] * 2 == kept[1][step][i] > 0
        assert hpz[1][step][0] == kept[1][step][0] == root_held
