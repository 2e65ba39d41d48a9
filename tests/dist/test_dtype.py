"""Gradients kept in low precision (``MixedPrecision.keep_low_precision_grads``)
and dtype conversions after wrapping (``model.double()``, ``.half()``,
``.to(torch.bfloat16)``), on 2 gloo ranks."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

from fullshard import CPUOffload, FullyShardedDataParallel as FSDP, MixedPrecision, ShardingStrategy
from fullshard.amp import ShardedGradScaler
from tests.dist import patterns as P
from tests.dist.harness import run_ranks

BF16 = torch.bfloat16
LOW_TOL = dict(rtol=1.6e-2, atol=1e-2)  # bf16/fp16 training vs DDP in the same dtype
FP64_TOL = dict(rtol=1e-12, atol=1e-14)


def _grads(model) -> dict:
    return {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()}


def _backward(model, rank, step, dtype=torch.float32, micro=0, scale=1.0):
    x, y = P.batch(rank, step, micro)
    loss = P.mse(model(x.to(dtype)), y.to(dtype))
    (loss * scale).backward()
    return loss.detach()


def _check_rounded(low: dict, ref: dict, where: str, exact: bool = True) -> float:
    """``low`` gradients are bf16 and equal ``ref`` (master-dtype) rounded to
    bf16 (or within bf16 rounding when not ``exact``); None where ref is None.
    Returns the largest |low - ref|."""
    worst = 0.0
    for n, r in ref.items():
        g = low[n]
        assert (g is None) == (r is None), f"{where} {n}: {g} vs {r}"
        if r is None:
            continue
        assert g.dtype == BF16 and r.dtype == torch.float32, (where, n, g.dtype, r.dtype)
        if exact:
            assert torch.equal(g, r.to(BF16)), f"{where} {n}: not the reference rounded to bf16"
        else:
            torch.testing.assert_close(g.float(), r, rtol=2**-7, atol=2**-7 * float(r.abs().max()),
                                       msg=lambda m: f"{where} {n}: {m}")
        if r.numel():
            worst = max(worst, float((g.float() - r).abs().max()))
    return worst


# ------------------------------------------------ keep_low_precision_grads
def _keep_low(rank, world):
    out = {}
    base = P.make()

    def pair(strategy, reduce_dtype, offload=False):
        kw = dict(auto_wrap_policy=P.policy(), sharding_strategy=strategy,
                  cpu_offload=CPUOffload(offload_params=offload))
        mp = dict(param_dtype=BF16, reduce_dtype=reduce_dtype)
        return (FSDP(P._clone(base), mixed_precision=MixedPrecision(**mp), **kw),
                FSDP(P._clone(base), mixed_precision=MixedPrecision(**mp, keep_low_precision_grads=True), **kw))

    # Two backwards without zero_grad, every strategy, bf16 and fp32 reduce,
    # with and without CPU offload: the masters stay fp32, the gradients are
    # bf16 and equal the default path's fp32 gradients rounded to bf16. With a
    # bf16 reduce that holds exactly even after accumulating (each reduced
    # value is a bf16, the fp32 sum is rounded once); with an fp32 reduce the
    # first backward's rounding stays in the sum (within bf16 rounding).
    cases = [(s, rd, False) for s in P.STRATEGIES for rd in (None, torch.float32)]
    cases.append((ShardingStrategy.FULL_SHARD, None, True))
    for strategy, rd, offload in cases:
        ref, low = pair(strategy, rd, offload)
        where = f"{strategy.value} reduce={rd} offload={offload}"
        for step in range(2):
            for m in (ref, low):
                _backward(m, rank, step)
            assert all(p.dtype == torch.float32 for p in low.parameters())
            exact = rd is None or step == 0
            out[f"{where} backward {step}"] = _check_rounded(_grads(low), _grads(ref), where, exact)
        assert all(p.grad is None or p.grad.device == p.device for p in low.parameters())

    # Training runs: SGD steps on the fp32 master with the bf16 gradient
    # (computed in fp32); Adam-family optimizers refuse a gradient whose dtype
    # differs from the parameter's (documented in MixedPrecision).
    ref, low = pair(ShardingStrategy.FULL_SHARD, None)
    opt = torch.optim.SGD(low.parameters(), lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    losses = []
    for step in range(3):
        before = {n: p.detach().clone() for n, p in low.named_parameters()}
        losses.append((float(_backward(low, rank, step)), float(_backward(ref, rank, step))))
        grads = _grads(low)
        opt.step()
        ref_opt.step()
        if step == 0:  # no momentum yet: p -= lr * g, in fp32
            for n, p in low.named_parameters():
                if grads[n] is not None:
                    torch.testing.assert_close(p.detach(), before[n] - 0.1 * grads[n].float(), rtol=1.3e-6,
                                               atol=1e-7)
        opt.zero_grad()
        ref_opt.zero_grad()
    assert all(p.dtype == torch.float32 for p in low.parameters())
    torch.testing.assert_close(torch.tensor(losses)[:, 0], torch.tensor(losses)[:, 1], **LOW_TOL)
    out["sgd_loss_diff_vs_fp32_grads"] = max(abs(a - b) for a, b in losses)
    _backward(low, rank, 0)
    with pytest.raises(RuntimeError):
        torch.optim.AdamW(low.parameters(), lr=1e-2).step()
    low.zero_grad()

    # no_sync: the stash is reduced once; zeroed gradients inside the window
    # (set_to_none True/False) drop their part, as under fp32 gradients.
    for zero in (None, True, False):
        ref, low = pair(ShardingStrategy.FULL_SHARD, None)
        for m in (ref, low):
            with m.no_sync():
                _backward(m, rank, 0, micro=0)
            if zero is not None:
                m.zero_grad(set_to_none=zero)
                assert not any(u.unit.stash.active for u in m.units()), ("stash kept after zero_grad", zero)
            _backward(m, rank, 0, micro=1)
        _check_rounded(_grads(low), _grads(ref), f"no_sync zero={zero}")

    # clip_grad_norm_: the norm of the bf16 gradients (computed in fp32); the
    # gradients stay bf16 and are scaled in fp32, rounded once.
    ref, low = pair(ShardingStrategy.FULL_SHARD, None)
    for m in (ref, low):
        _backward(m, rank, 0)
    before = _grads(low)
    total, fp32_total = low.clip_grad_norm_(0.05), ref.clip_grad_norm_(0.05)  # ref: bf16-valued fp32 grads
    assert total.dtype == BF16 and total == fp32_total.to(BF16)  # returned in the grads' dtype, as torch FSDP1
    coef = torch.clamp(torch.tensor(0.05) / (fp32_total + 1e-6), max=1.0)  # clipping used the fp32 norm
    for n, p in low.named_parameters():
        if p.grad is not None:
            assert p.grad.dtype == BF16
            assert torch.equal(p.grad, (before[n].float() * coef).to(BF16)), n
    assert abs(float(low.clip_grad_norm_(1e9)) - 0.05) < 0.05 * 2**-7

    # ShardedGradScaler: unscaled bf16 gradients equal the unscaled run's
    # (scaling by a power of two is exact); an inf on one rank skips the step
    # everywhere.
    _, plain = pair(ShardingStrategy.FULL_SHARD, None)
    _, scaled = pair(ShardingStrategy.FULL_SHARD, None)
    scaler = ShardedGradScaler(init_scale=2.0**10)
    opt = torch.optim.SGD(scaled.parameters(), lr=0.1)
    _backward(plain, rank, 0)
    _backward(scaled, rank, 0, scale=scaler.get_scale())
    scaler.unscale_(opt)
    for (n, g), r in zip(_grads(scaled).items(), _grads(plain).values()):
        assert (g is None) == (r is None) and (g is None or (g.dtype == BF16 and torch.equal(g, r))), n
    scaler.step(opt)
    scaler.update()
    opt.zero_grad()
    _backward(scaled, rank, 1, scale=scaler.get_scale())
    if rank == 1:
        next(p for p in scaled.parameters() if p.grad is not None and p.grad.numel()).grad.view(-1)[0] = float("inf")
    params = [p.detach().clone() for p in scaled.parameters()]
    scaler.step(opt)
    scaler.update()
    assert scaler.last_step_skipped and all(torch.equal(a, p) for a, p in zip(params, scaled.parameters()))
    return out


def test_keep_low_precision_grads():
    out = run_ranks(_keep_low, 2)[0]
    for k, v in out.items():
        print(f"{k}: max |bf16 grad - fp32 grad| = {v:.3e}")


# --------------------------------------------------- conversion after wrapping
def _train(model, opt, rank, dtype, steps=3):
    losses, grads = [], []
    for step in range(steps):
        losses.append(float(_backward(model, rank, step, dtype)))
        grads.append(P.full_state(model)[1])
        opt.step()
        opt.zero_grad()
    return losses, grads, P.full_state(model)[0]


def _diff(got, ref, tol, where) -> float:
    """Assert equal training within ``tol``; returns the largest difference."""
    (losses, grads, params), (r_losses, r_grads, r_params) = got, ref
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(r_losses), **tol)
    worst = max(abs(a - b) for a, b in zip(losses, r_losses))
    for g, rg in zip(grads + [params], r_grads + [r_params]):
        for n, r in rg.items():
            assert (g[n] is None) == (r is None), (where, n)
            if r is not None:
                assert g[n].dtype == r.dtype, (where, n, g[n].dtype, r.dtype)
                torch.testing.assert_close(g[n], r, **tol, msg=lambda m: f"{where} {n}: {m}")
                worst = max(worst, float((g[n] - r).abs().max()) if r.numel() else 0.0)
    return worst


def _bn_net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(7, 8), nn.BatchNorm1d(8), nn.Linear(8, 5))


def _conversion(rank, world):
    out = {}
    base = P.make()
    sgd = lambda params: torch.optim.SGD(params, lr=0.1)  # noqa: E731
    adamw = lambda params: torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)  # noqa: E731

    # Each conversion vs DDP on the plain model converted the same way; the
    # optimizer is created BEFORE the conversion and keeps working (the
    # Parameter objects are kept).
    cases = [(torch.float64, s, False, adamw, FP64_TOL) for s in P.STRATEGIES]
    cases += [(torch.float64, ShardingStrategy.FULL_SHARD, True, adamw, FP64_TOL),
              (torch.float16, ShardingStrategy.FULL_SHARD, False, sgd, LOW_TOL),
              (BF16, ShardingStrategy.FULL_SHARD, False, sgd, LOW_TOL),
              (BF16, ShardingStrategy.NO_SHARD, False, sgd, LOW_TOL)]
    convert = {torch.float64: lambda m: m.double(), torch.float16: lambda m: m.half(),
               BF16: lambda m: m.to(BF16)}
    for dtype, strategy, offload, opt_fn, tol in cases:
        where = f"{dtype} {strategy.value} offload={offload}"
        ref_model = DDP(P._clone(base).to(dtype), find_unused_parameters=True)
        ref = _train(ref_model, opt_fn(ref_model.parameters()), rank, dtype)
        model = FSDP(P._clone(base), auto_wrap_policy=P.policy(), sharding_strategy=strategy,
                     cpu_offload=CPUOffload(offload_params=offload))
        params = list(model.parameters())
        opt = opt_fn(params)
        assert convert[dtype](model) is model
        assert all(a is b and a.dtype == dtype for a, b in zip(model.parameters(), params))
        for u in model.units():
            unit = u.unit
            assert unit.flat_shard.dtype == unit.compute_dtype == unit.reduce_dtype == dtype, where
        got = _train(model, opt, rank, dtype)
        out[where] = _diff(got, ref, tol, where)
        # The same as wrapping the converted model, bit for bit.
        pre = FSDP(P._clone(base).to(dtype), auto_wrap_policy=P.policy(), sharding_strategy=strategy,
                   cpu_offload=CPUOffload(offload_params=offload))
        _diff(_train(pre, opt_fn(pre.parameters()), rank, dtype), got, dict(rtol=0, atol=0), where + " pre")

    # Gradients present at conversion are converted with the parameters.
    model = FSDP(P._clone(base), auto_wrap_policy=P.policy())
    _backward(model, rank, 0)
    before = {n: (p.detach().clone(), None if p.grad is None else p.grad.clone()) for n, p in model.named_parameters()}
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model.double()
    for n, p in model.named_parameters():
        value, grad = before[n]
        assert torch.equal(p.detach(), value.double()), n
        assert (p.grad is None) == (grad is None) and (grad is None or torch.equal(p.grad, grad.double())), n
    opt.step()
    for n, p in model.named_parameters():
        value, grad = before[n]
        if grad is not None:
            torch.testing.assert_close(p.detach(), value.double() - 0.1 * grad.double(), **FP64_TOL)

    # MixedPrecision: explicit dtypes stay, the master follows; the same as
    # wrapping the converted model, bit for bit. Explicit buffer_dtype stays;
    # buffers without one follow. Full-precision (BatchNorm) units follow.
    for mp in (MixedPrecision(param_dtype=BF16), MixedPrecision(param_dtype=BF16, reduce_dtype=torch.float32),
               MixedPrecision(param_dtype=BF16, keep_low_precision_grads=True)):
        runs = []
        for pre in (False, True):
            plain = P._clone(base)
            plain.register_buffer("scale", torch.ones(3))
            model = FSDP(plain.double() if pre else plain, auto_wrap_policy=P.policy(), mixed_precision=mp)
            if not pre:
                model.double()
            for u in model.units():
                assert u.unit.flat_shard.dtype == torch.float64 and u.unit.compute_dtype == BF16
                assert u.unit.reduce_dtype == (mp.reduce_dtype or BF16)
            assert model.scale.dtype == torch.float64
            runs.append(_train(model, torch.optim.SGD(model.parameters(), lr=0.1), rank, torch.float64))
            if mp.keep_low_precision_grads:
                _backward(model, rank, 5)
                assert all(p.grad is None or (p.dtype == torch.float64 and p.grad.dtype == BF16)
                           for p in model.parameters())
        _diff(runs[0], runs[1], dict(rtol=0, atol=0), f"{mp}")
    plain = P._clone(base)
    plain.register_buffer("scale", torch.ones(3))
    model = FSDP(plain, mixed_precision=MixedPrecision(param_dtype=BF16, buffer_dtype=BF16))
    model.half()
    assert model.unit.flat_shard.dtype == torch.float16 and model.unit.compute_dtype == BF16
    assert model.scale.dtype == BF16
    model.double()
    assert model.scale.dtype == BF16
    _backward(model, rank, 0, torch.float64)
    runs = []
    for pre in (False, True):
        model = FSDP(_bn_net().double() if pre else _bn_net(), mixed_precision=MixedPrecision(param_dtype=BF16))
        if not pre:
            model.double()
        x, y = P.batch(rank, 0)
        P.mse(model(x.double()), y.double()).backward()
        assert all(p.dtype == p.grad.dtype == torch.float64 for p in model.parameters())
        runs.append(_grads(model))
    assert all(torch.equal(a, b) for a, b in zip(runs[0].values(), runs[1].values()))

    # No-ops, and under torch's swap-tensors flag the Parameter objects stay too.
    model = FSDP(P._clone(base), auto_wrap_policy=P.policy())
    params = list(model.parameters())
    flats = [u.unit.flat_shard for u in model.units()]
    model.to("cpu").float().to(torch.float32)
    assert all(u.unit.flat_shard is f for u, f in zip(model.units(), flats))
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        model.double()
    finally:
        torch.__future__.set_swap_module_params_on_conversion(False)
    assert all(a is b and a.dtype == torch.float64 for a, b in zip(model.parameters(), params))
    model.float()
    _backward(model, rank, 0)

    # Refusals, one line each; nothing is converted.
    def refused(fn, match):
        with pytest.raises(RuntimeError, match=match) as info:
            fn()
        assert "\n" not in str(info.value) and f"[rank {rank}]" in str(info.value)
        return str(info.value)

    model = FSDP(P._clone(base), auto_wrap_policy=P.policy())
    out["device_move"] = refused(lambda: model.to("meta"), "from cpu to meta after wrapping is not supported")
    seen = []

    def convert_in_hook(*_):
        try:
            model.double()
        except RuntimeError as e:
            seen.append(str(e))
    handle = model.enc.module.a.register_forward_pre_hook(convert_in_hook)
    x, y = P.batch(rank, 0)
    out_t = model(x)
    handle.remove()
    out_t.register_hook(convert_in_hook)
    P.mse(out_t, y).backward()
    assert len(seen) == 2 and all("during forward or backward" in s for s in seen), seen
    out_t = model(x)
    refused(lambda: model.double(), "between a forward and its backward")
    P.mse(out_t, y).backward()
    with model.summon_full_params():
        refused(lambda: model.half(), "inside summon_full_params")
    with model.no_sync():
        _backward(model, rank, 1)
    refused(lambda: model.double(), "no_sync")
    assert all(p.dtype == torch.float32 for p in model.parameters())
    model.zero_grad()
    model.double()  # fine once the stash is gone
    assert all(p.dtype == torch.float64 for p in model.parameters())

    # A conversion of a module inside the wrapper (not of the wrapper) is
    # caught at the next forward instead of training stale values.
    model = FSDP(P._clone(base), auto_wrap_policy=P.policy())
    model.module.pre.double()
    out["inner_conversion"] = refused(lambda: model(x.double()), "no longer views the unit's")

    # An optimizer whose state was made before the conversion is refused at
    # its next step (torch's own error would be an opaque dtype mismatch).
    model = FSDP(P._clone(base), auto_wrap_policy=P.policy())
    opt = adamw(model.parameters())
    _backward(model, rank, 0)
    opt.step()
    opt.zero_grad()
    model.double()
    _backward(model, rank, 1, dtype=torch.float64)
    out["stale_optimizer_state"] = refused(opt.step, "create the optimizer after converting the model")
    return out


def test_conversion_after_wrapping():
    out = run_ranks(_conversion, 2)[0]
    for k, v in out.items():
        print(f"{k}: {v if isinstance(v, str) else f'max |diff| vs DDP = {v:.3e}'}")


class _Adapted(nn.Module):
    """A LoRA-like layer: a bf16 base weight beside fp32 adapter matrices; the base trains unless frozen."""

    def __init__(self, frozen_base: bool):
        super().__init__()
        self.base = nn.Linear(8, 8, bias=False).to(BF16).requires_grad_(not frozen_base)
        self.lora_a = nn.Linear(8, 2, bias=False)
        self.lora_b = nn.Linear(2, 8, bias=False)

    def forward(self, x):
        return self.base(x.to(self.base.weight.dtype)).float() + self.lora_b(self.lora_a(x))


def _mixed_dtypes(rank, world):
    """Both doors refuse a unit whose trainable parameters differ in dtype (one reduce-scatter
    dtype per unit; torch FSDP2 refuses too) and take nothing; a frozen bf16 base beside fp32
    adapters shards (core/mixed.py), and making that base trainable afterwards is refused."""
    from fullshard import fully_shard

    out = {}
    for door in ("fully_shard", "wrapper"):
        model = _Adapted(frozen_base=False)
        before = {n: (p, p.dtype) for n, p in model.named_parameters()}
        try:
            fully_shard(model) if door == "fully_shard" else FSDP(model)
        except ValueError as e:
            out[door] = str(e)
        assert {n: (p, p.dtype) for n, p in model.named_parameters()} == before
        # Nothing was taken: the module shards once its trainable dtypes agree.
        model.float()
        model = fully_shard(model) if door == "fully_shard" else FSDP(model)
        model(torch.ones(2, 8)).sum().backward()
        model = _Adapted(frozen_base=True)
        model = fully_shard(model) if door == "fully_shard" else FSDP(model)
        model(torch.ones(2, 8)).sum().backward()
        next(p for n, p in model.named_parameters() if "base" in n).requires_grad_(True)
        try:
            model(torch.ones(2, 8))
        except RuntimeError as e:
            out[door + " unfrozen"] = str(e)
    return out


@pytest.mark.fast
def test_units_refuse_trainable_parameters_of_different_dtypes():
    out = run_ranks(_mixed_dtypes, 1)[0]
    for door in ("fully_shard", "wrapper"):
        assert door in out, f"{door} sharded trainable bf16 and fp32 parameters into one unit without an error"
        assert "trainable parameters 'base.weight' (torch.bfloat16) and 'lora_a.weight' (torch.float32) differ" \
            in out[door], out[door]
        assert door + " unfrozen" in out, f"{door}: a frozen bf16 part made trainable ran without an error"
        assert "'base.weight' (torch.bfloat16) was made trainable after sharding" in out[door + " unfrozen"]
        assert "\n" not in out[door] + out[door + " unfrozen"]
