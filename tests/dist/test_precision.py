"""Mixed precision, CPU offload of shards, and gradient accumulation
(``--update-freq``) in every combination."""
from __future__ import annotations

import itertools

import torch

from fullshard import CPUOffload, FullyShardedDataParallel as FSDP, MixedPrecision, ShardingStrategy
from fullshard.core import collectives as C
from tests.dist import models as M
from tests.dist.common import BF16_RTOL, ddp_bf16_losses, train
from tests.dist.harness import run_ranks

BF16 = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, buffer_dtype=torch.bfloat16)


def _full(model):
    with model.summon_full_params():
        return {n: p.detach().clone() for n, p in model.named_parameters()}


def _bf16_and_offload(rank, world):
    base = M.make_model("gpt")
    out = {}
    ref_losses = ddp_bf16_losses(base, rank)
    ours = FSDP(M.clone(base), auto_wrap_policy=M.unit_policy("gpt"), mixed_precision=BF16)
    losses, _ = train(ours, "gpt", rank, clip=False)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=BF16_RTOL, atol=1e-3)
    out["bf16_max_loss_diff"] = max(abs(a - b) for a, b in zip(losses, ref_losses))
    # NO_SHARD (one-rank shard groups: the cast goes straight into the full parameters, core/unit.py)
    # gives FULL_SHARD's bits (a sum of two terms has one rounding in any order).
    replicated = FSDP(M.clone(base), auto_wrap_policy=M.unit_policy("gpt"), mixed_precision=BF16,
                      sharding_strategy=ShardingStrategy.NO_SHARD)
    assert train(replicated, "gpt", rank, clip=False)[0] == losses
    # Sharded masters stay fp32; the gradient shards are fp32.
    assert all(p.dtype == torch.float32 and p.grad.dtype == torch.float32 for p in ours.parameters())
    # All-gather bytes per step: bf16 moves half of fp32.
    gathered = {}
    for name, mp in (("fp32", None), ("bf16", BF16)):
        model = FSDP(M.clone(base), auto_wrap_policy=M.unit_policy("gpt"), mixed_precision=mp)
        x, y = M.batch("gpt", rank, 0)
        C.reset_counts()
        M.loss_fn("gpt", model, x, y).backward()
        gathered[name] = C.BYTES["all_gather"]
        if mp is not None:
            assert all(p.grad.dtype == torch.float32 for p in model.parameters())
    assert gathered["bf16"] * 2 == gathered["fp32"], gathered
    out["all_gather_bytes"] = gathered

    # CPU offload: same results as without, bit for bit, with shards,
    # gradient shards and optimizer state in host memory.
    plain = FSDP(M.clone(base), auto_wrap_policy=M.unit_policy("gpt"))
    off = FSDP(M.clone(base), auto_wrap_policy=M.unit_policy("gpt"), cpu_offload=CPUOffload(offload_params=True))
    plain_losses, plain_norms = train(plain, "gpt", rank)
    off_losses, off_norms = train(off, "gpt", rank)
    assert plain_losses == off_losses and plain_norms == off_norms
    for (n, a), b in zip(_full(plain).items(), _full(off).values()):
        assert torch.equal(a, b), n
    for u in off.units():
        assert u.unit.flat_shard.device.type == "cpu"
    opt = torch.optim.AdamW(off.parameters(), lr=1e-3, foreach=True)
    x, y = M.batch("gpt", rank, 0)
    M.loss_fn("gpt", off, x, y).backward()
    opt.step()
    for p in off.parameters():
        assert p.device.type == "cpu" and p.grad.device.type == "cpu"
        assert all(t.device.type == "cpu" for t in opt.state[p].values())
    return out


def test_bf16_parity_and_cpu_offload():
    out = run_ranks(_bf16_and_offload, 2)[0]
    print(out)


def _accumulate(model, rank, steps, micro_batches, mode):
    """Train with ``micro_batches`` per update; returns (the first update's
    gradient shards, the full parameters after ``steps`` updates)."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-6)
    first_grads = None
    for step in range(steps):
        x, y = M.batch("gpt", rank, step)  # (2, 16): split into micro-batches
        xs, ys = x.chunk(micro_batches), y.chunk(micro_batches)
        for i, (xm, ym) in enumerate(zip(xs, ys)):
            local = mode == "no_sync" and i < micro_batches - 1
            with (model.no_sync() if local else torch.enable_grad()):
                (M.loss_fn("gpt", model, xm, ym) / micro_batches).backward()
        if first_grads is None:
            first_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        opt.step()
        opt.zero_grad()
    return first_grads, _full(model)


def _accumulation(rank, world):
    base = M.make_model("gpt")
    worst = {}
    for mp, offload in itertools.product((None, BF16), (False, True)):
        kwargs = dict(auto_wrap_policy=M.unit_policy("gpt"), mixed_precision=mp,
                      cpu_offload=CPUOffload(offload_params=offload))
        ref_grads, ref = _accumulate(FSDP(M.clone(base), **kwargs), rank, 3, 1, "one_batch")
        for mode in ("no_sync", "reduce_scatter"):
            grads, got = _accumulate(FSDP(M.clone(base), **kwargs), rank, 3, 2, mode)
            key = f"{'bf16' if mp else 'fp32'} offload={offload} {mode}"
            if mp is None:  # fp32: gradients and trained parameters match one 2x batch
                for n in ref:
                    torch.testing.assert_close(got[n], ref[n], rtol=1.3e-6, atol=1e-5,
                                               msg=lambda m: f"{key} {n}: {m}")
                    torch.testing.assert_close(grads[n], ref_grads[n], rtol=1.3e-6, atol=1e-6,
                                               msg=lambda m: f"{key} grad {n}: {m}")
            else:
                # bf16: each micro-batch's gradient is rounded to bf16 on its
                # own, so the sum differs from one batch's by bf16 rounding;
                # compared on gradients, since Adam turns rounding noise on
                # near-zero gradients into lr-sized steps.
                for n in ref_grads:
                    scale = float(ref_grads[n].abs().max())
                    torch.testing.assert_close(grads[n], ref_grads[n], rtol=BF16_RTOL,
                                               atol=BF16_RTOL * scale, msg=lambda m: f"{key} grad {n}: {m}")
            worst[key] = max(float((grads[n] - ref_grads[n]).abs().max()) for n in ref_grads)
    return worst


def test_update_freq_equals_larger_batch_in_every_combination():
    worst = run_ranks(_accumulation, 2)[0]
    for k, v in worst.items():
        print(f"{k}: max |grad diff| vs one 2x batch = {v:.3e}")
