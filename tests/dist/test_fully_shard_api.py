"""FSDPModule's methods (``fully_shard``) against DDP on the same batches:
unshard/reshard, gradient sync and all-reduce skipping, resharding settings,
explicit prefetch, the gradient divide factor, unshard_in_backward,
is_last_backward and register_fsdp_forward_method. Each case gives DDP's
losses, gradients (or None) and weights, or one clear error."""
from __future__ import annotations

import functools

import pytest
import torch
import torch.nn as nn

import fullshard
from fullshard.core.unit import ShardedState
from tests.dist import fsdp2_parity as FP
from tests.dist.harness import run_ranks


def _units(model):
    return [*model.layers, model]


def _foreach_sgd(model):
    """SGD as GPUs run it by default: foreach ops, which bump no DTensor's version counter."""
    return torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9, foreach=True)


# ------------------------------------------------------- unshard / reshard
def _unshard_loop(model, opt, rank, sharded):
    out = []
    for step in range(4):
        if sharded and step == 0:
            assert model.layers[1].unshard() is None  # synchronous
            assert model.layers[1].unit.state is ShardedState.UNSHARDED
        if sharded and step == 1:
            handles = [m.unshard(async_op=True) for m in (model.layers[0], model)]
            for h in handles:
                h.wait()
            assert model.layers[0].unit.state is ShardedState.UNSHARDED
        if sharded and step == 2:
            model.layers[2].unshard()
            model.layers[2].reshard()
            assert model.layers[2].unit.state is ShardedState.SHARDED
        loss = FP.loss_of(model, rank, step)
        loss.backward()
        out.append(FP.snap(model, loss))
        if sharded and step == 1:
            # Gathered now, then the step changes every shard: the next
            # forward must gather again instead of reusing stale weights.
            model.layers[1].unshard()
            model.unshard(async_op=True)  # never waited on by the user
        opt.step()
        opt.zero_grad()
    return out


def _unshard_during_forward(rank):
    model = FP.shard(FP.make())
    hook = model.layers[1].lin1.register_forward_pre_hook(lambda m, a: model.layers[0].unshard())
    with pytest.raises(RuntimeError, match="unshard.*during forward or backward"):
        FP.loss_of(model, rank, 0)
    hook.remove()
    FP.loss_of(model, rank, 0).backward()  # the next iteration starts clean
    # The wrapper's summon_full_params on fully_shard modules: one clear error, not an AttributeError.
    with pytest.raises(TypeError, match="summon_full_params: .* is a fully_shard module"):
        with fullshard.FullyShardedDataParallel.summon_full_params(model):
            pass


def _unshard_case(rank, world):
    out = {"unshard": FP.parity(rank, _unshard_loop)}
    # foreach steps on DTensors bump no version counter: the step itself must count
    out["unshard_foreach"] = FP.parity(rank, _unshard_loop, optimizer=_foreach_sgd)
    _unshard_during_forward(rank)
    return out


# ------------------------------------------- set_requires_gradient_sync
def _no_sync_loop(model, opt, rank, sharded, *, micro=3, zero_at=None, set_to_none=True,
                  knob="set_requires_gradient_sync"):
    """Two optimizer steps of ``micro`` micro-batches, all but the last without
    gradient sync (DDP: ``no_sync()``; ``knob``: the fullshard setting turned
    off for them); ``zero_at``: zero_grad after that micro-batch, inside the
    accumulation window (``set_to_none``: True, False, or None for True in the
    first step and False in the second)."""
    out = []
    for step in range(2):
        for i in range(micro):
            sync = i == micro - 1
            if sharded:
                getattr(model, knob)(sync)
            loss = FP.loss_of(model, rank, step * micro + i)
            if sharded or sync:
                loss.backward()
            else:
                with model.no_sync():
                    loss.backward()
            if i == zero_at:
                opt.zero_grad(set_to_none=step == 0 if set_to_none is None else set_to_none)
        out.append(FP.snap(model, loss))
        opt.step()
        opt.zero_grad(set_to_none=step == 0)
    return out


def _window_backward_raises_loop(model, opt, rank, sharded, knob="set_requires_gradient_sync", late=False):
    """The second micro-batch of the first window raises in backward after the last block's backward ran (a
    hook on the first block's output): the next forward raises once, naming the discarded window, and the
    window runs again. DDP zeroes and runs it again. ``late``: the window's synchronizing backward raises
    instead, after every unit's backward ran (a term of the loss made before the forward, so autograd runs
    its node last): the reduces that took the window's sums never wrote ``.grad``."""
    out, fail = [], [False]

    def boom(grad):
        if fail[0]:
            raise RuntimeError("injected backward failure")

    def arm(module, args, output):
        output.register_hook(boom)
    if not late:
        (model.module if not sharded else model).layers[0].register_forward_hook(arm)
    # The first window up to the micro-batch that fails, then both windows whole.
    first = ((0, 0), (0, 1)) if not late else ((0, 0), (0, 1), (0, 2))
    for k, (step, i) in enumerate(first + ((0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (1, 2))):
        sync = i == 2
        if sharded:
            getattr(model, knob)(sync)
        fail[0] = k == len(first) - 1
        if fail[0] and not sharded:  # DDP: the same failure, then zero_grad
            opt.zero_grad()
            continue
        if late:
            extra = torch.zeros((), requires_grad=True) * 1.0  # made before the forward: its node runs last
            extra.register_hook(boom)
        loss = FP.loss_of(model, rank, step * 3 + i) + (extra if late else 0.0)
        try:
            if sharded or sync:
                loss.backward()
            else:
                with model.no_sync():
                    loss.backward()
        except RuntimeError as e:
            assert "injected" in str(e), e
            try:
                FP.loss_of(model, rank, 99)
                raise AssertionError("the forward after a failed backward in the window did not raise")
            except RuntimeError as e:
                assert "micro-batches were discarded" in str(e) and "\n" not in str(e), e
            continue
        if sync:
            out.append(FP.snap(model, loss))
            opt.step()
            opt.zero_grad()
    return out


def _nested_only_loop(model, opt, rank, sharded):
    """layers[1] alone accumulates without sync (recurse=False); DDP syncs
    every micro-batch, which gives the same sums."""
    out = []
    for step in range(2):
        for i in range(3):
            if sharded:
                model.layers[1].set_requires_gradient_sync(i == 2, recurse=False)
            loss = FP.loss_of(model, rank, step * 3 + i)
            loss.backward()
            if i == 0:  # the other units reduced this micro-batch already
                out.append({k: v for k, v in FP.grads(model).items() if not k.startswith("grad:layers.1.")})
        out.append(FP.snap(model, loss))
        opt.step()
        opt.zero_grad()
    return out


def _grad_sync_case(rank, world):
    return {
        "no_sync": FP.parity(rank, _no_sync_loop),
        "zero_grad_none": FP.parity(rank, lambda *a: _no_sync_loop(*a, zero_at=0, set_to_none=True)),
        "zero_grad_zeros": FP.parity(rank, lambda *a: _no_sync_loop(*a, zero_at=0, set_to_none=False)),
        "nested_only": FP.parity(rank, _nested_only_loop),
        "window_backward_raises": FP.parity(rank, _window_backward_raises_loop),
        "window_sync_backward_raises": FP.parity(rank, lambda *a: _window_backward_raises_loop(*a, late=True)),
    }


# ----------------------------------------------- set_requires_all_reduce
def _hsdp_loop(model, opt, rank, sharded):
    out = []
    for step in range(2):
        for i in range(3):
            if sharded:
                model.set_requires_all_reduce(i == 2)
            loss = FP.loss_of(model, rank, step * 3 + i)
            loss.backward()
            if sharded and i < 2 and step == 0:
                # The partial sums wait for the all-reduce; .grad is written then (until then zero
                # sentinels that let zero_grad reach the sums: core/stash.py).
                assert all(p.grad is not None and not p.grad.to_local().any() for p in model.parameters())
        out.append(FP.snap(model, loss))
        opt.step()
        opt.zero_grad()
    return out


def _hsdp_case(rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard

    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))

    def shard_fn(model):
        FP.shard(model, mesh=mesh)
        assert {p.placements for p in model.parameters()} == {(Replicate(), Shard(0))}
        return model
    out = {"all_reduce": FP.parity(rank, _hsdp_loop, shard_fn=shard_fn)}
    # zero_grad inside the window discards the replica sums held back, as DDP discards param.grad
    # (set_to_none=True in the first step, False in the second; torch FSDP2 keeps them).
    out["all_reduce_zero_grad"] = FP.parity(
        rank, lambda *a: _no_sync_loop(*a, zero_at=0, set_to_none=None, knob="set_requires_all_reduce"),
        shard_fn=shard_fn)
    # A backward raising inside the window drops the replica sums held back (said once; DDP zeroes).
    out["all_reduce_window_backward_raises"] = FP.parity(
        rank, lambda *a: _window_backward_raises_loop(*a, knob="set_requires_all_reduce"), shard_fn=shard_fn)
    out["all_reduce_window_sync_backward_raises"] = FP.parity(
        rank, lambda *a: _window_backward_raises_loop(*a, knob="set_requires_all_reduce", late=True),
        shard_fn=shard_fn)
    # The divide factor spans both dimensions: the sum over all 4 ranks / f.
    factors = {"0": 1.0, "root": 3.0}
    loop = _divide_loop(factors)
    out["hsdp_divide"] = FP.parity(rank, loop, shard_fn=shard_fn, ref_loop=lambda *a: _scaled(loop(*a), world, factors))
    return out


# --------------------------------------- reshard after forward / backward
def _foreach_sgd_post_hook_fails(model):
    """:func:`_foreach_sgd` whose own post-step hook raises every other step, after the step wrote the shards:
    torch then runs no global post-step hook."""
    opt, calls = _foreach_sgd(model), [0]

    def post(optimizer, args, kwargs):
        calls[0] += 1
        if calls[0] % 2:
            raise RuntimeError("post-step hook failed")
    opt.register_step_post_hook(post)
    return opt


def _reshard_loop(model, opt, rank, sharded, *, after_forward=True, after_backward=True, step_between=False,
                  direct=False, metric=False):
    """``direct``: every second backward is of a block called on its own, not through the root, on the same
    input on every rank (so DDP's unreduced gradient is the average); a block kept gathered across the step
    before must gather the stepped shards (it reused the old full weights). ``metric``: a forward without
    backward after each backward (with ``after_forward=False`` it leaves the blocks gathered: the same)."""
    out = []
    if sharded:
        model.set_reshard_after_forward(after_forward)
        model.set_reshard_after_backward(after_backward)
    for step in range(3):
        for i in range(2):
            if direct and i:
                x = torch.randn(2, 4, FP.DIM, generator=torch.Generator().manual_seed(step))
                loss = getattr(model, "module", model).layers[1](x).pow(2).mean()
            else:
                loss = FP.loss_of(model, rank, 2 * step + i)
            if sharded and not after_forward:
                assert model.layers[0].unit.state is ShardedState.UNSHARDED  # kept for backward
            loss.backward()
            if sharded and not after_backward:
                assert all(m.unit.state is ShardedState.UNSHARDED for m in _units(model))
            out.append(FP.snap(model, loss))
            if metric:  # DDP's reference runs it past DDP (its reducer refuses a forward without backward)
                FP.loss_of(model if sharded else model.module, rank, 99)
            if step_between:
                try:
                    opt.step()  # the kept full weights are stale now
                except RuntimeError as e:  # the step's own post-hook (the step itself went through)
                    assert "post-step hook failed" in str(e), e
                opt.zero_grad()
        if not step_between:
            opt.step()
            opt.zero_grad()
    return out


def _reshard_case(rank, world):
    return {
        "after_forward_false": FP.parity(rank, lambda *a: _reshard_loop(*a, after_forward=False)),
        "after_backward_false": FP.parity(rank, lambda *a: _reshard_loop(*a, after_backward=False)),
        "after_backward_false_step": FP.parity(
            rank, lambda *a: _reshard_loop(*a, after_backward=False, step_between=True)),
        "both_false_step": FP.parity(
            rank, lambda *a: _reshard_loop(*a, after_forward=False, after_backward=False, step_between=True)),
        "after_backward_false_step_direct": FP.parity(
            rank, lambda *a: _reshard_loop(*a, after_backward=False, step_between=True, direct=True)),
        "after_forward_false_metric_step_direct": FP.parity(
            rank, lambda *a: _reshard_loop(*a, after_forward=False, step_between=True, direct=True, metric=True)),
        "after_backward_false_step_foreach": FP.parity(
            rank, lambda *a: _reshard_loop(*a, after_backward=False, step_between=True),
            optimizer=_foreach_sgd),
        "after_backward_false_step_foreach_post_hook_fails": FP.parity(
            rank, lambda *a: _reshard_loop(*a, after_backward=False, step_between=True),
            optimizer=_foreach_sgd_post_hook_fails),
    }


# ------------------------------------- what is registered while gathered
def _registered_case(rank, world):
    """Pinned difference from torch FSDP2 (docs/migration.md): while a unit
    is gathered (after a forward that keeps it, after unshard()), torch
    registers full nn.Parameters; fullshard keeps the DTensor shards
    registered and modules read full plain tensors by attribute."""
    from torch.distributed.tensor import DTensor

    model = FP.shard(FP.make(), reshard_after_forward=False)
    lin1 = model.layers[0].lin1
    shards = dict(model.named_parameters())
    shard = shards["layers.0.lin1.weight"]

    def gathered(grad_fn: bool):
        w = lin1.weight
        assert type(w) is torch.Tensor and w.shape == (FP.HIDDEN, FP.DIM) and (w.grad_fn is not None) == grad_fn
        assert all(v is shards[k] for k, v in model.named_parameters()) and lin1._parameters["weight"] is shard
        assert isinstance(shard, DTensor) and shard.to_local().shape[0] < FP.HIDDEN

    loss = FP.loss_of(model, rank, 0)
    gathered(grad_fn=True)  # the view autograd differentiates through
    loss.backward()
    assert lin1.weight is shard
    model.layers[0].unshard()
    gathered(grad_fn=False)
    model.layers[0].reshard()
    assert lin1.weight is shard
    return {}


# ------------------------------------------------------------ prefetching
def _prefetch_loop(model, opt, rank, sharded):
    seen = []
    if sharded:
        layers = model.layers
        model.set_modules_to_forward_prefetch([layers[0]])
        for i, layer in enumerate(layers):
            layer.set_modules_to_forward_prefetch(list(layers[i + 1:i + 2]))
            layer.set_modules_to_backward_prefetch(list(layers[i - 1:i]) if i else [])
        # When layers[1] starts computing, layers[2] is already being gathered.
        layers[1].lin1.register_forward_pre_hook(lambda m, a: seen.append(layers[2].unit.state))
        with pytest.raises(ValueError, match="not a fully_shard module"):
            layers[0].set_modules_to_forward_prefetch([nn.Linear(2, 2)])
        with pytest.raises(ValueError, match="not a fully_shard module"):
            layers[0].set_modules_to_backward_prefetch([layers[1].lin1])
    out = FP.train(model, opt, rank)
    if sharded:
        assert seen and all(s is not ShardedState.SHARDED for s in seen), seen
    return out


def _prefetch_case(rank, world):
    return {"prefetch": FP.parity(rank, _prefetch_loop)}


# ------------------------------------------------- gradient divide factor
def _divide_loop(factors):
    def loop(model, opt, rank, sharded):
        if sharded:
            for name, f in factors.items():
                (model if name == "root" else model.layers[int(name)]).set_gradient_divide_factor(f)
        loss = FP.loss_of(model, rank, 0)
        loss.backward()
        return [FP.grads(model)]
    return loop


def _scaled(snapshots, world, factors):
    """DDP's gradients × world / factor per unit (torch FSDP2: the sum over ranks divided by the factor)."""
    out = {}
    for key, g in snapshots[0].items():
        name = key.removeprefix("grad:")
        unit = name.split(".")[1] if name.startswith("layers.") else "root"
        f = factors.get(unit)
        out[key] = g if f is None or g is None else g * world / f
    return [out]


def _torch_fsdp2_grads(rank, factors):
    """torch FSDP2's gradients with the same factors. Gloo has no PREMUL_SUM,
    so its reduce-scatter sums and divides after (force_sum_reduction_for_comms):
    the same quotient."""
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    model = FP.make()
    for layer in model.layers:
        torch_fully_shard(layer)
    torch_fully_shard(model)
    for name, f in factors.items():
        unit = model if name == "root" else model.layers[int(name)]
        unit.set_gradient_divide_factor(f)
        unit.set_force_sum_reduction_for_comms(True)
    FP.loss_of(model, rank, 0).backward()
    return [FP.grads(model)]


def _divide_case(rank, world):
    res = {}
    for factors in ({"root": 1.0, "0": 1.0, "1": 1.0, "2": 1.0}, {"1": 3.0}, {"root": 0.5}):
        loop = _divide_loop(factors)
        ref_loop = lambda *a, loop=loop, factors=factors: _scaled(loop(*a), world, factors)  # noqa: E731
        res[str(factors)] = FP.parity(rank, loop, ref_loop=ref_loop)
        mine = _divide_loop(factors)(FP.shard(FP.make()), None, rank, True)
        FP.assert_same(mine, _torch_fsdp2_grads(rank, factors))
    model = FP.shard(FP.make())
    for bad in (0, -1.0):
        with pytest.raises(ValueError, match="factor must be > 0"):
            model.set_gradient_divide_factor(bad)
    return res


# ------------------------------------------------------- unshard in backward
def _count_unshards(unit):
    calls = []
    original = unit.unshard

    def counting(*args):
        calls.append(1)
        original(*args)
    unit.unshard = counting
    return calls


def _embedding_unit(model):
    fullshard.fully_shard(model.tok_embeddings)
    return FP.shard(model)


def _unshard_in_backward_case(rank, world):
    counts = {}

    def loop(model, opt, rank, sharded):
        if sharded:
            model.tok_embeddings.set_unshard_in_backward(False)
            counts["calls"] = _count_unshards(model.tok_embeddings.unit)
        return FP.train(model, opt, rank)
    res = {"embedding": FP.parity(rank, loop, shard_fn=_embedding_unit)}
    assert len(counts["calls"]) == 3, counts  # one all-gather per forward, none in backward
    # A unit whose backward reads its weights (lin1, lin2, gate): one clear
    # error (it was a segfault: autograd read the freed storage), then the
    # model trains on as DDP does.
    def fails_once(model, opt, rank, sharded):
        if sharded:
            model.layers[1].set_unshard_in_backward(False)
            with pytest.raises(RuntimeError, match=r"\[rank \d\] unit 'layers\.\d'.*set_unshard_in_backward\(True\)"):
                FP.loss_of(model, rank, 0).backward()
            opt.zero_grad()
            model.layers[1].set_unshard_in_backward(True)
        loss = FP.loss_of(model, rank, 1)
        loss.backward()
        return [FP.snap(model, loss)]
    res["error_then_train"] = FP.parity(rank, fails_once)
    return res


# -------------------------------------------------------- is_last_backward
def _last_backward_loop(model, opt, rank, sharded):
    out = []
    for step in range(3):
        micro = 3 if step < 2 else 1
        for i in range(micro):
            last = i == micro - 1 and step != 1
            if sharded:
                model.set_is_last_backward(last)
            loss = FP.loss_of(model, rank, 3 * step + i)
            loss.backward()
        # step 1's last backward runs under set_is_last_backward(False).
        opt.step()
        out.append(FP.params(model))
        opt.zero_grad()
    if sharded:
        model.set_is_last_backward(True)
        with pytest.raises(RuntimeError, match="root"):
            model.layers[0].set_is_last_backward(False)
    return out


def _zeroed_while_deferred(model, opt, rank, sharded, *, set_to_none=True):
    """A backward whose reduce-scatters are still in flight, then zero_grad
    (a skipped micro-batch): DDP's reduced gradients are gone, ours too."""
    out = []
    for step in range(2):
        if sharded:
            model.set_is_last_backward(False)
        FP.loss_of(model, rank, 2 * step).backward()
        opt.zero_grad(set_to_none=set_to_none)
        if sharded:
            model.set_is_last_backward(True)
        loss = FP.loss_of(model, rank, 2 * step + 1)
        loss.backward()
        out.append(FP.snap(model, loss))
        opt.step()
    return out


def _last_backward_case(rank, world):
    out = {"is_last_backward": FP.parity(rank, _last_backward_loop),
           "zero_grad_while_deferred": FP.parity(rank, _zeroed_while_deferred),
           "zero_grad_in_place_while_deferred": FP.parity(
               rank, functools.partial(_zeroed_while_deferred, set_to_none=False)),
           "clip_while_deferred": FP.parity(rank, _clipped_while_not_last)}
    return out


def _clipped_while_not_last(model, opt, rank, sharded):
    """A gradient read after a backward under set_is_last_backward(False)
    (clipping) sees the whole sum: every backward finishes its reduce."""
    out = []
    for step in range(2):
        if sharded:
            model.set_is_last_backward(False)
        loss = FP.loss_of(model, rank, step)
        loss.backward()
        norm = fullshard.clip_grad_norm_(model.parameters(), 0.1) if sharded else \
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1)
        out.append({**FP.snap(model, loss), "norm": torch.tensor(norm.item())})
        opt.step()
        opt.zero_grad()
    return out


# ------------------------------------------------ register_fsdp_forward_method
def _forward_method_case(rank, world):
    """Methods that read parameters without calling forward, against one
    process on the global batch."""
    plain = FP.make()
    model = FP.shard(FP.make())
    fullshard.register_fsdp_forward_method(model, "logits_direct")
    for layer in model.layers:
        fullshard.register_fsdp_forward_method(layer, "mix")
    with pytest.raises(ValueError, match="no method"):
        fullshard.register_fsdp_forward_method(model, "missing")
    with pytest.raises(ValueError, match="not a"):
        fullshard.register_fsdp_forward_method(nn.Linear(2, 2), "forward")

    def loss(m, r):
        x, y = FP.tokens(r, 0)
        h = torch.randn(3, FP.DIM, generator=torch.Generator().manual_seed(r))
        return torch.nn.functional.cross_entropy(m.logits_direct(x).flatten(0, 1), y.flatten()) + \
            m.layers[0].mix(h).square().mean()
    mine = loss(model, rank)
    mine.backward()
    got = FP.grads(model)
    for r in range(world):
        (loss(plain, r) / world).backward()
    want = {f"grad:{n}": None if p.grad is None else p.grad.clone() for n, p in plain.named_parameters()}
    FP.assert_same([got], [want])
    return {"forward_method": FP.max_diff([got], [want])}


# ------------------------------------------------------------------ tests
def _group_two(rank, world):
    out = {}
    for case in (_unshard_case, _grad_sync_case, _reshard_case, _prefetch_case, _divide_case,
                 _unshard_in_backward_case, _last_backward_case, _forward_method_case, _registered_case):
        out.update(case(rank, world))
    return out


@pytest.mark.fast
def test_methods_two_ranks():
    diffs = run_ranks(_group_two, 2)[0]
    print(diffs)


def _group_three(rank, world):
    out = {}
    for case in (_unshard_case, _reshard_case, _divide_case):
        out.update(case(rank, world))
    return out


def test_methods_three_ranks():
    """Uneven shards, one empty (``gate``: 2 rows on 3 ranks)."""
    run_ranks(_group_three, 3)


def test_requires_all_reduce_hsdp():
    run_ranks(_hsdp_case, 4)
