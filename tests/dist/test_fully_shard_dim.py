"""``fully_shard(..., shard_placement_fn=...)`` returning ``Shard(d)`` with d != 0 (core/flat.py [Note: flat
layouts], ``DimShard``), against torch FSDP2 with the same function and against DDP.

Each weight is sharded on its largest dim (ties: the last), the expert tensor ``(3, D, K)`` on ``Shard(-1)`` and
``mix`` ``(D, K)`` on ``Shard(1)``. The uneven model (D=7, H=9, K=2: at 3 ranks ``mix`` and the experts leave rank 2
an empty chunk) is compared with DDP; torch FSDP2 refuses uneven chunks of a dim other than 0, so the comparisons
with it use the even model (D=6, H=12, K=6). One spawned group per world size runs every case: AdamW training with
``torch.nn.utils.clip_grad_norm_`` (fp32; bf16 params with fp32 reduction; fp32 params with bf16 reduction),
torch FSDP2's local tensors and placements (bitwise equal), contiguous local params and grads,
``fullshard.clip_grad_norm_``, ``shard_info``, full state dicts, DCP checkpoints written by one FSDP2 and read by the
other (bitwise), ``fullshard.optim`` (Lamb trains like DDP; Muon and Adafactor refuse), HSDP placements, and the
wrapper's refusal. At 2 ranks fullshard and torch FSDP2 agree bit for bit; at 3 within fp32 tolerance.
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from tests.dist.harness import run_ranks

RTOL, ATOL = 1e-5, 1e-6
BF16_RTOL = 1.6e-2
STEPS = 3


class Block(nn.Module):
    def __init__(self, d=7, h=9):
        super().__init__()
        self.lin1 = nn.Linear(d, h)
        self.lin2 = nn.Linear(h, d)

    def forward(self, h):
        return h + self.lin2(torch.tanh(self.lin1(h)))


class DimNet(nn.Module):
    """Embedding (11, D), two blocks (D -> H -> D), experts (3, D, K), mix (D, K), head (11, D + 3K)."""

    def __init__(self, d, h, k):
        super().__init__()
        self.emb = nn.Embedding(11, d)
        self.layers = nn.ModuleList(Block(d, h) for _ in range(2))
        self.experts = nn.Parameter(torch.randn(3, d, k) * 0.3)
        self.mix = nn.Parameter(torch.randn(d, k) * 0.3)
        self.head = nn.Linear(d + 3 * k, 11)

    def forward(self, x):
        h = self.emb(x)
        for layer in self.layers:
            h = layer(h)
        e = torch.einsum("btd,edk->btek", h, self.experts).flatten(2)
        m = h @ self.mix
        return self.head(torch.cat([h, e * m.sum(-1, keepdim=True)], dim=-1))


def placement_fn(param):
    from torch.distributed.tensor import Shard

    if param.ndim == 3:  # experts
        return Shard(-1)
    if param.shape in ((7, 2), (6, 6)):  # mix
        return Shard(1)
    return Shard(max(range(param.ndim), key=lambda d: (param.shape[d], d)))


DIMS = {"uneven": (7, 9, 2), "even": (6, 12, 6)}


def _build(lib, seed=0, shape="uneven", **options):
    torch.manual_seed(seed)
    model = DimNet(*DIMS[shape])
    if lib is None:
        return model
    for block in model.layers:
        lib.fully_shard(block, shard_placement_fn=placement_fn, **options)
    return lib.fully_shard(model, shard_placement_fn=placement_fn, **options)


def _loss(model, rank, step):
    g = torch.Generator().manual_seed(100 * step + rank)
    x, y = torch.randint(0, 11, (3, 5), generator=g), torch.randint(0, 11, (3, 5), generator=g)
    return F.cross_entropy(model(x).flatten(0, 1), y.flatten())


def _full(t):
    return t.full_tensor().detach() if hasattr(t, "full_tensor") else t.detach().clone()


def _train(model, rank, check=None, optim=None):
    opt = optim(model.parameters()) if optim else torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-6)
    losses, norms = [], []
    for step in range(STEPS):
        loss = _loss(model, rank, step)
        loss.backward()
        if check is not None:
            check(model)
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)))
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return dict(losses=losses, norms=norms,
                params={n.removeprefix("module."): _full(p) for n, p in model.named_parameters()})


def _compare(got, want, where, exact, rtol=RTOL, atol=ATOL, params=True):
    if exact:
        assert got["losses"] == want["losses"], f"{where}: losses {got['losses']} vs {want['losses']}"
        assert got["norms"] == want["norms"], f"{where}: norms {got['norms']} vs {want['norms']}"
    else:
        torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(want["losses"]), rtol=rtol, atol=atol,
                                   msg=lambda m: f"{where} losses: {m}")
        torch.testing.assert_close(torch.tensor(got["norms"]), torch.tensor(want["norms"]), rtol=rtol, atol=atol,
                                   msg=lambda m: f"{where} norms: {m}")
    for n, p in want["params"].items() if params else ():
        if exact:
            assert torch.equal(got["params"][n], p), f"{where}: {n} differs by {(got['params'][n] - p).abs().max()}"
        else:
            torch.testing.assert_close(got["params"][n], p, rtol=rtol, atol=atol, msg=lambda m: f"{where} {n}: {m}")


def _diff(got, want):
    return max(float((got["params"][n] - p).abs().max()) for n, p in want["params"].items())


def _check_layout(ours, theirs, rank, world):
    """Placements, local tensors (equal to torch.chunk's and torch FSDP2's, if given), contiguity, shard_info."""
    from torch.distributed.tensor import Shard

    import fullshard

    dims = set()
    plain = _build(None)
    for (n, p), q in zip(ours.named_parameters(), plain.parameters()):
        d = placement_fn(p).dim % p.ndim
        dims.add(d)
        assert tuple(p.placements) == (Shard(d),), (n, p.placements)
        local = p.to_local()
        assert local.is_contiguous(), n
        chunks = torch.chunk(q.detach(), world, dim=d)
        want = chunks[rank] if rank < len(chunks) else q.detach().narrow(d, 0, 0)
        assert local.shape == want.shape and torch.equal(local, want), n
        info = fullshard.shard_info(p)
        assert info.dim == d and info.rows == p.shape[d] and info.row_range[1] - info.row_range[0] == local.shape[d]
    assert dims == {0, 1, 2}, dims
    for (n, p), (n2, q) in zip(theirs[0].named_parameters(), theirs[1].named_parameters()):
        assert n == n2 and tuple(p.placements) == tuple(q.placements), (n, p.placements, q.placements)
        assert torch.equal(p.to_local(), q.to_local()) and p.to_local().shape == q.to_local().shape, n


def _check_grads(model):
    for n, p in model.named_parameters():
        assert p.grad is not None and tuple(p.grad.placements) == tuple(p.placements), n
        assert p.grad.to_local().is_contiguous() and p.grad.to_local().shape == p.to_local().shape, n


def _case_training(rank, world, figures):
    import torch.distributed.fsdp as torch_fsdp
    from torch.nn.parallel import DistributedDataParallel as DDP

    import fullshard

    exact = world == 2
    even = (_build(fullshard, shape="even"), _build(torch_fsdp, shape="even"))
    _check_layout(_build(fullshard), even, rank, world)
    got, ref = _train(_build(fullshard), rank, check=_check_grads), _train(DDP(_build(None)), rank)
    _compare(got, ref, f"fp32 uneven world={world}: fullshard vs DDP", False)
    figures[f"fp32 uneven world={world}"] = {"vs_ddp": _diff(got, ref)}
    ref = _train(DDP(_build(None, shape="even")), rank)
    got, want = _train(even[0], rank, check=_check_grads), _train(even[1], rank)
    _compare(got, want, f"fp32 world={world}: fullshard vs torch FSDP2", exact)
    _compare(got, ref, f"fp32 world={world}: fullshard vs DDP", False)
    _compare(want, ref, f"fp32 world={world}: torch FSDP2 vs DDP", False)
    figures[f"fp32 even world={world}"] = {"vs_torch": _diff(got, want), "vs_ddp": _diff(got, ref)}
    # fullshard.clip_grad_norm_ over the Shard(d) grads: the global norm (chunks are disjoint).
    model = _build(fullshard)
    _loss(model, rank, 0).backward()
    plain = _build(None)
    _loss(plain, 0, 0).backward()
    for r in range(1, world):
        _loss(plain, r, 0).backward()
    want_norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.grad / world)
                                                      for p in plain.parameters()]))
    norm = fullshard.clip_grad_norm_(model.parameters(), 1e9)
    torch.testing.assert_close(norm, want_norm, rtol=RTOL, atol=ATOL)
    for mp in (dict(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
               dict(param_dtype=torch.float32, reduce_dtype=torch.bfloat16)):
        where = f"{mp} world={world}"
        got = _train(_build(fullshard, shape="even", mp_policy=fullshard.MixedPrecisionPolicy(**mp)), rank,
                     check=_check_grads)
        want = _train(_build(torch_fsdp, shape="even", mp_policy=torch_fsdp.MixedPrecisionPolicy(**mp)), rank)
        _compare(got, want, f"{where}: fullshard vs torch FSDP2", exact, BF16_RTOL, 1e-3, params=exact)
        _compare(got, ref, f"{where}: fullshard vs DDP", False, BF16_RTOL, 1e-2, params=False)
        figures[where] = {"vs_torch": _diff(got, want)}


def _case_checkpoint(rank, world, tmp):
    """DCP both ways between the FSDP2s (bitwise, model and AdamW state); full state dicts round-trip."""
    import torch.distributed.checkpoint as dcp
    import torch.distributed.fsdp as torch_fsdp
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_state_dict,
        set_model_state_dict,
        set_state_dict,
    )

    import fullshard

    def trained(lib, seed):
        model = _build(lib, seed, "even")
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        _loss(model, rank, 0).backward()
        opt.step()
        opt.zero_grad()
        return model, opt

    def full_state(model, opt):
        msd, osd = get_state_dict(model, opt, options=StateDictOptions(full_state_dict=True))
        return msd, {k: v for k, v in osd["state"].items()}

    for src, dst in ((fullshard, torch_fsdp), (torch_fsdp, fullshard)):
        model, opt = trained(src, 0)
        msd, osd = get_state_dict(model, opt)
        path = f"{tmp}/{src.__name__}-{world}"
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)
        target, topt = trained(dst, 1)
        tmsd, tosd = get_state_dict(target, topt)
        state = {"model": tmsd, "optim": tosd}
        dcp.load(state, checkpoint_id=path)
        set_state_dict(target, topt, model_state_dict=state["model"], optim_state_dict=state["optim"])
        (wm, wo), (gm, go) = full_state(model, opt), full_state(target, topt)
        for k, v in wm.items():
            assert torch.equal(gm[k], v), f"{src.__name__} -> {dst.__name__}: {k}"
        for k, s in wo.items():
            for key, v in s.items():
                assert torch.equal(go[k][key], v), f"{src.__name__} -> {dst.__name__}: optim {k}/{key}"
        for (n, p), (_, q) in zip(model.named_parameters(), target.named_parameters()):
            assert torch.equal(p.to_local(), q.to_local()) and q.to_local().is_contiguous(), n
        # Both go on training alike.
        for m, o in ((model, opt), (target, topt)):
            _loss(m, rank, 1).backward()
            o.step()
        for (n, p), (_, q) in zip(model.named_parameters(), target.named_parameters()):
            torch.testing.assert_close(q.full_tensor(), p.full_tensor(), rtol=RTOL, atol=ATOL, msg=n)
    # A full state dict: what the plain model holds, and loaded back into a fresh model.
    model = _build(fullshard, 3)
    full_sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    plain = _build(None, 3).state_dict()
    assert full_sd.keys() == plain.keys() and all(torch.equal(full_sd[k], plain[k]) for k in plain)
    fresh = _build(fullshard, 4)
    set_model_state_dict(fresh, full_sd, options=StateDictOptions(full_state_dict=True))
    for (n, p), (_, q) in zip(model.named_parameters(), fresh.named_parameters()):
        assert torch.equal(p.to_local(), q.to_local()) and q.to_local().is_contiguous(), n
    # fullshard.checkpoint save/load of a fully_shard model with Shard(d) parameters.
    from fullshard import checkpoint as fcp

    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _loss(model, rank, 0).backward()
    opt.step()
    fcp.save(f"{tmp}/fcp-{world}", model, opt)
    other = _build(fullshard, 5)
    oopt = torch.optim.AdamW(other.parameters(), lr=1e-2)
    fcp.load(f"{tmp}/fcp-{world}", other, oopt)
    for (n, p), (_, q) in zip(model.named_parameters(), other.named_parameters()):
        assert torch.equal(p.to_local(), q.to_local()), n


def _case_optimizers(rank, world, figures):
    from torch.nn.parallel import DistributedDataParallel as DDP

    import fullshard
    from fullshard.optim import Adafactor, Lamb, Muon

    lamb = lambda params: Lamb(params, lr=1e-2)  # noqa: E731
    got, ref = _train(_build(fullshard), rank, optim=lamb), _train(DDP(_build(None)), rank, optim=lamb)
    _compare(got, ref, f"Lamb world={world}: fullshard vs DDP", False)
    figures[f"Lamb world={world}"] = {"vs_ddp": _diff(got, ref)}
    for cls in (Muon, Adafactor):
        model = _build(fullshard)
        _loss(model, rank, 0).backward()
        with pytest.raises(ValueError, match=r"is sharded on dim 1 \(Shard\(1\)\), but fullshard.optim"):
            cls([p for p in model.parameters() if p.ndim == 2], lr=1e-2).step()


def _case_hsdp_and_wrapper(rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard

    import fullshard

    mesh = init_device_mesh("cpu", (1, world))
    model = _build(fullshard, mesh=mesh)
    for n, p in model.named_parameters():
        assert tuple(p.placements) == (Replicate(), Shard(placement_fn(p).dim % p.ndim)), n
    plain = _build(None)
    _loss(model, rank, 0).backward()
    _loss(plain, rank, 0).backward()
    for (n, p), (_, q) in zip(model.named_parameters(), plain.named_parameters()):
        g = q.grad.clone()
        dist.all_reduce(g)
        torch.testing.assert_close(p.grad.full_tensor(), g / world, rtol=RTOL, atol=ATOL, msg=n)
    with pytest.raises(ValueError, match=r"returned Shard\(1\) for 'lin1.weight'.*FullyShardedDataParallel shards "
                                         r"dim 0 only"):
        fullshard.FullyShardedDataParallel(Block(), shard_placement_fn=lambda p: Shard(1) if p.ndim > 1 else None)


def _all(rank, world, tmp):
    figures = {}
    _case_training(rank, world, figures)
    _case_checkpoint(rank, world, tmp)
    _case_optimizers(rank, world, figures)
    _case_hsdp_and_wrapper(rank, world)
    return figures


@pytest.mark.parametrize("world", [2, 3])
def test_shard_dim(world, tmp_path):
    figures = run_ranks(_all, world, str(tmp_path), timeout_s=300)[0]
    for where, value in figures.items():
        print(f"{where}: {value}")
