"""``torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm, norm_type)`` on ``fully_shard``'s DTensor
gradients against DDP, for norm types 1, 2 and inf: FSDP on a 1-D mesh of 2 and 3 ranks (uneven shards) and
HSDP on a (2, 2) mesh. Two steps of AdamW with clipping per norm type: the returned norm (``full_tensor()``:
for inf torch returns a ``Partial(max)`` DTensor) equals DDP's, and so do the clipped gradients and the
weights. Also: a model mixing an ignored (plain) parameter with DTensor ones, where torch's clip_grad_norm_
raises on every rank and the per-kind recipe gives DDP's result; and ``FullyShardedDataParallel.clip_grad_norm_``
with the inf norm on a rank whose shard is empty (it raised there, leaving the other ranks in the all-reduce).
"""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from tests.dist.harness import run_ranks

# Not in the fast tier (make test-fast): several spawned groups; make test runs it.

NORM_TYPES = (1.0, 2.0, float("inf"))
STEPS = 2
RTOL, ATOL = 1e-5, 1e-6


class Net(nn.Module):
    """Rows 7, 10, 5: uneven chunks at 3 ranks, none empty (see test_wrapper_inf_norm_empty_shard)."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(5, 7)
        self.b = nn.Linear(7, 10)
        self.c = nn.Linear(10, 5)

    def forward(self, x):
        return self.c(torch.tanh(self.b(torch.tanh(self.a(x)))))


def _net(seed: int = 0) -> Net:
    torch.manual_seed(seed)
    return Net()


def _batch(step: int, rank: int) -> torch.Tensor:
    return torch.randn(6, 5, generator=torch.Generator().manual_seed(100 * step + rank)) * 3


def _loss(model, step: int, rank: int) -> torch.Tensor:
    return model(_batch(step, rank)).square().mean()


def _global(t):
    """A tensor (or DTensor) as a plain full tensor."""
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def _ddp_run(norm_type: float, max_norms: list) -> list:
    """DDP: per step (norm, clipped grads, weights after the step); ``max_norms`` filled on the way
    (half of each step's norm, so clipping always scales)."""
    from torch.nn.parallel import DistributedDataParallel

    rank = torch.distributed.get_rank()
    ddp = DistributedDataParallel(_net())
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-2)
    out = []
    for step in range(STEPS):
        _loss(ddp, step, rank).backward()
        norm = torch.nn.utils.get_total_norm([p.grad for p in ddp.parameters()], norm_type)
        max_norms.append(norm.item() / 2)
        clipped = torch.nn.utils.clip_grad_norm_(ddp.parameters(), max_norms[-1], norm_type)
        grads = [p.grad.clone() for p in ddp.module.parameters()]
        opt.step()
        opt.zero_grad()
        out.append((clipped.item(), grads, [p.detach().clone() for p in ddp.module.parameters()]))
    return out


def _fully_shard_run(mesh, norm_type: float, max_norms: list, clip=None) -> list:
    """``clip``: the clipping function (torch's by default; ``fullshard.clip_grad_norm_``)."""
    from fullshard import fully_shard

    clip = clip or torch.nn.utils.clip_grad_norm_

    rank = torch.distributed.get_rank()
    model = _net()
    fully_shard(model.a, mesh=mesh)
    fully_shard(model.b, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    out = []
    for step in range(STEPS):
        _loss(model, step, rank).backward()
        norm = clip(model.parameters(), max_norms[step], norm_type)
        grads = [_global(p.grad) for p in model.parameters()]
        opt.step()
        opt.zero_grad()
        out.append((_global(norm).item(), grads, [_global(p.detach()) for p in model.parameters()]))
    return out


def _fullshard_clip(params, max_norm, norm_type):
    from fullshard import clip_grad_norm_

    norm = clip_grad_norm_(params, max_norm, norm_type)
    assert type(norm) is torch.Tensor and norm.dim() == 0, type(norm)
    return norm


def _compare(got: list, want: list, what: str) -> None:
    for step, ((norm, grads, weights), (ref_norm, ref_grads, ref_weights)) in enumerate(zip(got, want)):
        torch.testing.assert_close(norm, ref_norm, rtol=RTOL, atol=0, msg=lambda m: f"{what} step {step} norm: {m}")
        for i, (g, r) in enumerate(zip(grads, ref_grads)):
            torch.testing.assert_close(g, r, rtol=RTOL, atol=ATOL, msg=lambda m: f"{what} step {step} grad {i}: {m}")
        for i, (w, r) in enumerate(zip(weights, ref_weights)):
            torch.testing.assert_close(w, r, rtol=RTOL, atol=ATOL, msg=lambda m: f"{what} step {step} weight {i}: {m}")


def _clip_vs_ddp(rank, world, hsdp):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, world // 2) if hsdp else (world,))
    for norm_type in NORM_TYPES:
        max_norms: list = []
        want = _ddp_run(norm_type, max_norms)
        got = _fully_shard_run(mesh, norm_type, max_norms)
        _compare(got, want, f"[rank {rank}] {'HSDP' if hsdp else 'FSDP'} {world} ranks, norm {norm_type}")
        # fullshard.clip_grad_norm_ returns a plain tensor: its .item() is the global norm on every
        # rank, also for inf (torch's returns a Partial(max) DTensor there).
        got = _fully_shard_run(mesh, norm_type, max_norms, clip=_fullshard_clip)
        assert all(isinstance(norm, float) for norm, _, _ in got)
        _compare(got, want, f"[rank {rank}] fullshard.clip_grad_norm_, {world} ranks, norm {norm_type}")
    out = {"clip": True}
    if world == 2:
        out["mixed"] = _mixed(rank, world)
    if world == 3:
        out["wrapper"] = _wrapper_empty_shard(rank)
    return out


GROUPS = {"fsdp2": (2, False), "fsdp3": (3, False), "hsdp2x2": (4, True)}
_RESULTS: dict = {}


def _group(name: str) -> list:
    """Each spawned group runs once for all tests of this file."""
    if name not in _RESULTS:
        world, hsdp = GROUPS[name]
        _RESULTS[name] = run_ranks(_clip_vs_ddp, world, hsdp, timeout_s=180)
    return _RESULTS[name]


@pytest.mark.parametrize("name", sorted(GROUPS))
def test_clip_grad_norm_matches_ddp(name):
    assert all(out["clip"] for out in _group(name))  # the comparisons ran (and passed) on every rank


# ---------------------------------------------------------- ignored params
def _mixed(rank, world):
    """An ignored (plain) parameter among DTensor ones: torch's clip_grad_norm_ refuses the mix on every
    rank; the per-kind recipe (DTensor norm, plain norm, their norm; clip each kind) equals DDP once the
    user has averaged the ignored gradient as DDP would (fully_shard leaves it alone)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.nn.parallel import DistributedDataParallel

    from fullshard import fully_shard

    mesh = init_device_mesh("cpu", (world,))
    ddp = DistributedDataParallel(_net())
    model = _net()
    fully_shard(model, mesh=mesh, ignored_params={model.c.weight})
    for m in (ddp, model):
        _loss(m, 0, rank).backward()
    torch.distributed.all_reduce(model.c.weight.grad)
    model.c.weight.grad /= world
    try:
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        refused = None
    except RuntimeError as e:
        refused = str(e)
    out = {"refused": refused}
    sharded = [p for p in model.parameters() if p is not model.c.weight]
    saved = [p.grad.detach().clone() for p in model.parameters()]
    ddp_saved = [p.grad.detach().clone() for p in ddp.parameters()]
    for norm_type in NORM_TYPES:
        max_norm = torch.nn.utils.get_total_norm([p.grad for p in ddp.parameters()], norm_type).item() / 2
        want = torch.nn.utils.clip_grad_norm_(ddp.parameters(), max_norm, norm_type).item()
        total = torch.nn.utils.get_total_norm([
            _global(torch.nn.utils.get_total_norm([p.grad for p in sharded], norm_type)),
            torch.nn.utils.get_total_norm([model.c.weight.grad], norm_type)], norm_type)
        for group in (sharded, [model.c.weight]):
            torch.nn.utils.clip_grads_with_norm_(group, max_norm, total)
        grad_diff = max((_global(p.grad) - q.grad).abs().max().item()
                        for p, q in zip(model.parameters(), ddp.module.parameters()))
        out[norm_type] = (total.item(), want, grad_diff)
        # fullshard.clip_grad_norm_ takes the mix in one call (plain gradients count once).
        for p, g in zip(model.parameters(), saved):
            p.grad.copy_(g)
        from fullshard import clip_grad_norm_
        ours = clip_grad_norm_(model.parameters(), max_norm, norm_type).item()
        ours_diff = max((_global(p.grad) - q.grad).abs().max().item()
                        for p, q in zip(model.parameters(), ddp.module.parameters()))
        out[("fullshard", norm_type)] = (ours, want, ours_diff)
        for params, grads in ((model.parameters(), saved), (ddp.parameters(), ddp_saved)):
            for p, g in zip(params, grads):
                p.grad.copy_(g)
    return out


def test_ignored_param_with_dtensors():
    for rank_out in (out["mixed"] for out in _group("fsdp2")):
        assert rank_out["refused"] is not None and "mixed torch.Tensor and DTensor" in rank_out["refused"], rank_out
        for norm_type in NORM_TYPES:
            for key in (norm_type, ("fullshard", norm_type)):
                total, want, grad_diff = rank_out[key]
                assert total == pytest.approx(want, rel=RTOL), (key, total, want)
                assert grad_diff < ATOL, (key, grad_diff)


# ------------------------------------------------- the wrapper's own method
class Small(nn.Module):
    """Rows 4 and 2: at 3 ranks, rank 2's shards of every parameter are empty."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(5, 4)
        self.b = nn.Linear(4, 2)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)))


def _wrapper_empty_shard(rank) -> dict:
    """``FullyShardedDataParallel.clip_grad_norm_`` vs DDP's for each norm type, on a rank with empty shards."""
    from torch.nn.parallel import DistributedDataParallel

    from fullshard import FullyShardedDataParallel

    torch.manual_seed(0)
    ddp = DistributedDataParallel(Small())
    torch.manual_seed(0)
    model = FullyShardedDataParallel(Small())
    out = {"empty here": any(p.numel() == 0 for p in model.parameters())}
    for m in (ddp, model):
        m(_batch(0, rank)).square().mean().backward()
    for norm_type in NORM_TYPES:
        want = torch.nn.utils.get_total_norm([p.grad for p in ddp.parameters()], norm_type).item()
        out[norm_type] = (model.clip_grad_norm_(1e9, norm_type).item(), want)
    return out


def test_wrapper_inf_norm_empty_shard():
    results = _group("fsdp3")
    assert results[2]["wrapper"]["empty here"], "rank 2 must hold empty shards for the test to cover them"
    for out in results:
        for norm_type in NORM_TYPES:
            got, want = out["wrapper"][norm_type]
            assert got == pytest.approx(want, rel=RTOL), (norm_type, got, want)
