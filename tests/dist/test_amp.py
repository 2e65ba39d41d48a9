"""ShardedGradScaler on FSDP FULL_SHARD gloo ranks.

An inf (or NaN) put into ONE rank's gradient shard must make every rank skip
that step and back off together; skipping is exact (fp32 parameters equal a
run that never saw the bad batch, since scaling by powers of two is exact);
the scale grows after ``growth_interval`` clean steps; backing off to
``min_loss_scale`` raises fairseq's FloatingPointError. torch's own
``GradScaler`` over the wrapper's gradient shards is refused.
"""
from __future__ import annotations

import pytest
import torch

from fullshard import FullyShardedDataParallel as FSDP
from fullshard.amp import ShardedGradScaler
from fullshard.core import collectives as C
from tests.dist import models as M
from tests.dist.harness import run_ranks

STEPS = 8
BAD = {2: (1, float("inf")), 3: (0, float("nan"))}  # step -> (rank whose shard is poisoned, value)


def _poison(model, value):
    """Write ``value`` into the first non-empty gradient shard of this rank."""
    for p in model.parameters():
        if p.grad is not None and p.grad.numel():
            p.grad.view(-1)[0] = value
            return
    raise AssertionError("no gradient shard on this rank")


def _train(rank, steps, bad, scaler_kwargs):
    model = FSDP(M.clone(M.make_model("gpt")), auto_wrap_policy=M.unit_policy("gpt"))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-6)
    scaler = ShardedGradScaler(**scaler_kwargs)
    scales, skipped, reduces = [], [], []
    for step in steps:
        x, y = M.batch("gpt", rank, step)
        scaler.scale(M.loss_fn("gpt", model, x, y)).backward()
        if step in bad and bad[step][0] == rank:
            _poison(model, bad[step][1])
        C.reset_counts()
        scaler.unscale_(opt)
        reduces.append(C.COUNTS["all_reduce"])
        model.clip_grad_norm_(1.0)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        scales.append(scaler.get_scale())
        skipped.append(scaler.last_step_skipped)
    with model.summon_full_params():
        params = {n: p.detach().clone() for n, p in model.named_parameters()}
    return scales, skipped, reduces, params


def _skip_and_growth(rank, world):
    kwargs = dict(init_scale=2.0**10, growth_interval=3)
    scales, skipped, reduces, params = _train(rank, range(STEPS), BAD, kwargs)
    # The found-inf decision is one all-reduce per unscale_ (the clip norm's is counted apart).
    assert reduces == [1] * STEPS, reduces
    assert skipped == [False, False, True, True, False, False, False, False], skipped
    # 2 clean steps (no growth), 2 back-offs, then growth after 3 clean steps.
    assert scales == [1024, 1024, 512, 256, 256, 256, 512, 512], scales
    # A run that never saw steps 2 and 3 ends with bit-identical fp32 parameters.
    _, ref_skipped, _, ref_params = _train(rank, [s for s in range(STEPS) if s not in BAD], {}, kwargs)
    assert not any(ref_skipped)
    assert list(params) == list(ref_params)
    for n, p in params.items():
        assert torch.equal(p, ref_params[n]), n

    # Minimum loss scale: 1 -> 0.5 -> (0.25 <= min) raises on every rank; scale kept.
    scaler = ShardedGradScaler(init_scale=1.0, min_loss_scale=0.25)
    model = FSDP(M.clone(M.make_model("gpt")), auto_wrap_policy=M.unit_policy("gpt"))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(2):
        x, y = M.batch("gpt", rank, step)
        scaler.scale(M.loss_fn("gpt", model, x, y)).backward()
        if rank == 0:
            _poison(model, float("inf"))
        scaler.step(opt)
        if step == 0:
            scaler.update()
            assert scaler.get_scale() == 0.5
        else:
            with pytest.raises(FloatingPointError) as err:
                scaler.update()
            assert str(err.value) == (
                "Minimum loss scale reached (0.25). Your loss is probably exploding. Try lowering the "
                "learning rate, using gradient clipping or increasing the batch size.")
            assert scaler.get_scale() == 0.5
        opt.zero_grad()

    # torch.amp.GradScaler checks only this rank's gradient shard: refused at the wrapper's first step
    # (core/optim_guard.py [Note: torch's GradScaler over plain shards]); under fully_shard (DTensor
    # gradients) torch reduces the check itself and it steps.
    import fullshard

    for door in ("wrapper", "fully_shard"):
        model = M.clone(M.make_model("gpt"))
        if door == "wrapper":
            model = FSDP(model, auto_wrap_policy=M.unit_policy("gpt"))
        else:
            fullshard.fully_shard(model)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        scaler = torch.amp.GradScaler("cpu", init_scale=1.0)
        x, y = M.batch("gpt", rank, 0)
        scaler.scale(M.loss_fn("gpt", model, x, y)).backward()
        if door == "wrapper":
            with pytest.raises(RuntimeError, match="use fullshard.ShardedGradScaler"):
                scaler.step(opt)
        else:
            scaler.step(opt)
    return scales


def test_overflow_on_one_rank_skips_everywhere_and_growth():
    per_rank = run_ranks(_skip_and_growth, 2)
    assert per_rank[0] == per_rank[1]


def test_scaler_single_process_api():
    """No process group: unscale_ on CPU fp32 grads, state_dict round trip, disabled pass-through."""
    p = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.SGD([p], lr=1.0)
    scaler = ShardedGradScaler(init_scale=4.0, growth_interval=1)
    scaler.scale((p * 2).sum()).backward()
    assert torch.equal(p.grad, torch.full((3,), 8.0))
    scaler.unscale_(opt)
    assert torch.equal(p.grad, torch.full((3,), 2.0))
    with pytest.raises(RuntimeError, match="already been called"):
        scaler.unscale_(opt)
    scaler.step(opt)
    scaler.update()
    assert torch.equal(p.detach(), torch.full((3,), -1.0)) and scaler.get_scale() == 8.0
    other = ShardedGradScaler()
    other.load_state_dict(scaler.state_dict())
    assert other.state_dict() == scaler.state_dict()
    off = ShardedGradScaler(enabled=False)
    loss = p.sum()
    assert off.scale(loss) is loss and off.get_scale() == 1.0 and off.state_dict() == {}
