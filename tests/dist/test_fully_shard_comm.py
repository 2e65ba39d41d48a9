"""FSDPModule's communication methods (fsdp2_comm.py) against torch FSDP2
(``torch.distributed.fsdp.fully_shard``, the baseline) or DDP: custom
all-gather / reduce-scatter objects really carry the traffic, the
all-reduce hook sees what torch's sees, force_sum moves the division,
unused parameters, in-flight reduce-scatter buffers, a separate
reduce-scatter group, reset_iter_state, the post-optimizer event and the
memory strategies' behaviour on gloo."""
from __future__ import annotations

import math
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import fullshard
from fullshard.core import collectives, state as core_state
from tests.dist import fsdp2_parity as FP
from tests.dist.harness import run_ranks


class QuantRS:
    """A custom reduce-scatter: rounds its input to bf16 precision ("compressed"
    traffic), records each call, and reduces with torch.distributed underneath."""

    def __init__(self, log):
        self.log = log

    def allocate(self, size, *, dtype, device):
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        self.log.append(("rs", input_tensor.numel(), output_tensor.numel()))
        input_tensor.copy_(input_tensor.to(torch.bfloat16).float())
        return dist.reduce_scatter_tensor(output_tensor, input_tensor, op=op, group=group, async_op=async_op)


class RecordAG:
    def __init__(self, log):
        self.log = log

    def allocate(self, size, *, dtype, device):
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, async_op=False):
        self.log.append(("ag", input_tensor.numel(), output_tensor.numel()))
        return dist.all_gather_into_tensor(output_tensor, input_tensor, group=group, async_op=async_op)


class StridedAG(RecordAG):
    """Allocates a strided (every other element) all-gather output."""

    def allocate(self, size, *, dtype, device):
        return torch.empty(2 * math.prod(size), dtype=dtype, device=device)[::2]


def _custom_run(rank, shard_fn):
    """Two steps of FP.Net with custom collectives and an all-reduce hook on
    every unit (force_sum on the root): the calls, the hook inputs, snapshots."""
    model = shard_fn(FP.make())
    log, hooked = [], {}
    for i, m in enumerate([*model.layers, model]):
        m.set_custom_all_gather(RecordAG(log))
        m.set_custom_reduce_scatter(QuantRS(log))
        m.set_all_reduce_hook(lambda t, i=i: hooked.setdefault(i, []).append(t.detach().clone()))
    model.set_force_sum_reduction_for_comms(True)
    opt = FP.sgd(model)
    snaps = FP.train(model, opt, rank, steps=2)
    return sorted(log), hooked, snaps


def _torch_shard(model):
    from torch.distributed.fsdp import fully_shard

    for layer in model.layers:
        fully_shard(layer)
    fully_shard(model)
    return model


def _custom_case(rank, world):
    collectives.reset_counts()
    ours = _custom_run(rank, FP.shard)
    native = collectives.COUNTS["all_gather"] + collectives.COUNTS["reduce_scatter"]
    custom = collectives.COUNTS["all_gather(custom)"], collectives.COUNTS["reduce_scatter(custom)"]
    theirs = _custom_run(rank, _torch_shard)
    assert native == 0, collectives.COUNTS  # every all-gather and reduce-scatter went through the objects
    assert ours[0] == theirs[0], (ours[0], theirs[0])  # same calls with the same sizes
    assert custom == (sum(1 for e in ours[0] if e[0] == "ag"), sum(1 for e in ours[0] if e[0] == "rs"))
    assert ours[1].keys() == theirs[1].keys() == set(range(4))
    worst = 0.0
    for i in ours[1]:
        assert len(ours[1][i]) == len(theirs[1][i]) == 2
        for a, b in zip(ours[1][i], theirs[1][i]):
            # Root: the undivided sum (force_sum); blocks: the mean. The same padded
            # shards, in each library's parameter order (Block's own `gate` comes first in ours).
            a, b = a.sort().values, b.sort().values
            torch.testing.assert_close(a, b)
            worst = max(worst, (a - b).abs().max().item())
    FP.assert_same(ours[2], theirs[2])
    model = FP.shard(FP.make())  # a buffer the collective would not write densely is refused, in one line
    model.layers[0].set_custom_all_gather(StridedAG([]))
    try:
        FP.train(model, FP.sgd(model), rank, steps=1)
        raise AssertionError("a strided all-gather output was accepted")
    except ValueError as e:
        assert "allocate() for the all-gather output returned" in str(e) and "strides (2,)" in str(e), e
    return {"custom_hook_vs_torch": worst, "custom_vs_torch": FP.max_diff(ours[2], theirs[2]),
            "calls": len(ours[0])}


# ------------------------------------------------- unused parameters
class TwoHeads(nn.Module):
    def __init__(self):
        super().__init__()
        self.used = nn.Linear(4, 3)
        self.unused = nn.Linear(4, 3)

    def forward(self, x):
        return self.used(x)


def _unused_grads(rank, shard, flag):
    torch.manual_seed(0)
    model = TwoHeads()
    shard(model)
    model.set_reduce_scatter_unused_params(flag)
    model(torch.randn(2, 4) + rank).sum().backward()
    return {n: FP.full(p.grad) for n, p in model.named_parameters()}


def _unused_case(rank, world):
    from torch.distributed.fsdp import FSDPModule, fully_shard as torch_fully_shard

    for flag in (False, True):
        ours = _unused_grads(rank, fullshard.fully_shard, flag)
        assert flag or ours["unused.weight"] is None
        if flag:
            assert not ours["unused.weight"].any()
        if not hasattr(FSDPModule, "set_reduce_scatter_unused_params"):  # torch 2.11 lacks the method
            continue
        theirs = _unused_grads(rank, torch_fully_shard, flag)
        for n in theirs:
            if theirs[n] is None:
                assert ours[n] is None, (flag, n)
            else:
                torch.testing.assert_close(ours[n], theirs[n])
        assert (ours["unused.weight"] is None) is (not flag)
    return {}


# ----------------------------- in-flight buffers, separate reduce-scatter group
def _buffers_case(rank, world):
    seen = []
    original = core_state.PostBackwardHook.__call__

    def spy(self, flat_full):
        original(self, flat_full)
        rt = self.rt_ref()
        seen.append(len(rt.root.pending))

    def shard(model):
        model = FP.shard(model)
        model.set_reduce_scatter_max_input_buffers(1)
        model.set_separate_reduce_scatter_group()
        return model

    core_state.PostBackwardHook.__call__ = spy
    try:
        diff = FP.parity(rank, lambda m, o, r, s: FP.train(m, o, r), shard_fn=shard)
    finally:
        core_state.PostBackwardHook.__call__ = original
    assert seen and max(seen) == 1, seen
    model = FP.shard(FP.make())
    model.set_separate_reduce_scatter_group()
    units = [m._runtime.unit for m in (*model.layers, model)]
    groups = {id(u.settings.reduce_scatter_group) for u in units}
    assert len(groups) == 1 and units[0].settings.reduce_scatter_group is not units[0].cfg.shard_group
    assert collectives.group_ranks(units[0].settings.reduce_scatter_group) == collectives.group_ranks(
        units[0].cfg.shard_group)
    model.set_separate_reduce_scatter_group(False)
    assert all(u.settings.reduce_scatter_group is None for u in units)
    with pytest.raises(TypeError, match="must be an int"):
        model.set_reduce_scatter_max_input_buffers(True)
    with pytest.raises(ValueError, match="positive"):
        model.set_reduce_scatter_max_input_buffers(0)
    return {"max_buffers_1_separate_group_vs_ddp": diff}


# ------------------------------------------------------ reset_iter_state
class Boom(RuntimeError):
    pass


def _reset_loop(model, opt, rank, sharded):
    """Step 1's forward raises (fullshard) inside a no_sync window; the root
    resets and the window's micro-batch is lost, as torch documents (DDP:
    zero_grad instead)."""
    out = []
    for step in range(3):
        if step == 1:
            if sharded:
                model.set_requires_gradient_sync(False)
                FP.loss_of(model, rank, 5).backward()  # stashed, then discarded by the reset
                model.set_requires_gradient_sync(True)
                fire = {"on": True}

                def boom(mod, args):
                    if fire.pop("on", False):
                        raise Boom("injected")

                h = model.layers[1].register_forward_pre_hook(boom)
                with pytest.raises(Boom):
                    FP.loss_of(model, rank, 6)
                h.remove()
                with pytest.raises(RuntimeError, match="root module"):
                    model.layers[0].reset_iter_state()
                model.reset_iter_state()
            else:
                opt.zero_grad()
        loss = FP.loss_of(model, rank, step)
        loss.backward()
        out.append(FP.snap(model, loss))
        opt.step()
        opt.zero_grad()
    return out


# --------------------------------------------------- post-optimizer event
class FakeEvent:
    def __init__(self):
        self.waits = 0

    def wait(self, stream=None):
        self.waits += 1


def _event_case(rank, world):
    model = FP.shard(FP.make())
    with pytest.raises(TypeError, match="torch.Event"):
        model.set_post_optim_event(object())
    event = FakeEvent()
    model.set_post_optim_event(event)
    with pytest.raises(RuntimeError, match="root module"):
        model.layers[0].set_post_optim_event(FakeEvent())
    FP.loss_of(model, rank, 0).backward()
    FP.loss_of(model, rank, 1).backward()
    assert event.waits == 1  # waited before the next forward's all-gathers, then dropped
    model.set_post_optim_event(torch.Event())  # an unrecorded CPU event: its wait returns at once
    FP.loss_of(model, rank, 2).backward()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.layers[0].set_reduce_scatter_divide_factor(3.0)
    assert any(issubclass(w.category, DeprecationWarning) for w in caught)
    assert model.layers[0]._runtime.settings.grad_divide_factor == 3.0
    return {}


# ------------------------------------------------- memory strategies (gloo)
def _memory_case(rank, world):
    model = FP.shard(FP.make())
    with pytest.raises(ValueError, match="NCCL process group"):
        model.set_symm_mem_for_comm()
    with pytest.raises(ValueError, match="only backend='NCCL'"):
        model.set_symm_mem_for_comm("NVSHMEM")

    def shard(m):
        m = FP.shard(m)
        for u in (*m.layers, m):
            u.set_allocate_memory_from_process_group_for_comm(True)
            assert u._runtime.settings.allocator.pooled  # gloo has no allocator: the pool serves
        return m

    diff = FP.parity(rank, lambda m, o, r, s: FP.train(m, o, r), shard_fn=shard)
    model.set_custom_reduce_scatter(QuantRS([]))
    with pytest.raises(ValueError, match="custom all-gather or reduce-scatter"):
        model.set_allocate_memory_from_process_group_for_comm(True)
    with pytest.raises(TypeError, match="protocol"):
        model.set_custom_all_gather(lambda *a: None)
    return {"pg_alloc_gloo_vs_ddp": diff}


def _group(rank, world):
    out = {"reset_iter_state_vs_ddp": FP.parity(rank, _reset_loop)}
    for case in (_custom_case, _unused_case, _buffers_case, _event_case, _memory_case):
        out.update(case(rank, world))
    return out


@pytest.mark.fast
def test_comm_methods_two_ranks():
    print(run_ranks(_group, 2)[0])
