"""CPU offload: host gradient buffers reused across steps (core/offload.py
[Note: offloaded gradient buffers]) and the overlapped AdamW step
(``fullshard.optim.OffloadAdamW``, [Note: overlapped offload step]), both
front doors, 2 gloo ranks, one spawned group.

Five iterations: plain; the root's ``norm`` skipped by every rank (its
parameters keep ``grad None``); two micro-batches, the first under
``no_sync`` / ``set_requires_gradient_sync(False)``; plain, then
``zero_grad(set_to_none=False)``; plain (added into the zeroed gradients).
``OffloadAdamW`` (without ``max_norm``, with one every step's norm exceeds, so
every speculative step is redone, and with one no norm reaches) must give,
bit for bit, the parameters and AdamW state of ``backward()``,
``fullshard.clip_grad_norm_`` and ``torch.optim.AdamW(fused=True).step()``, and
the same norms; each gradient must live in the same host storage at every
step. Then, with ``max_norm``: an iteration dropped by ``zero_grad()`` before
``step()``, two synchronizing backwards for one step, and lr / weight decay set
after backward, equal the reference; what cannot be done is refused.
"""
from __future__ import annotations

import weakref

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

import fullshard
from fullshard import FullyShardedDataParallel as FSDP
from fullshard.optim import OffloadAdamW
from fullshard.wrap import ModuleWrapPolicy
from tests.dist import fsdp2_parity as P
from tests.dist.harness import run_ranks

LR = 1e-2
CLIP = 0.05  # below every step's global norm here, so each step is clipped
HIGH = 1e6  # above every step's global norm: the speculative steps stand


Net = P.SkipNormNet


def _make(door: str, **options):
    torch.manual_seed(0)
    model = Net(layers=2)
    if door == "fully_shard":
        for layer in model.layers:
            fullshard.fully_shard(layer, offload_policy=fullshard.CPUOffloadPolicy(), **options)
        return fullshard.fully_shard(model, offload_policy=fullshard.CPUOffloadPolicy(), **options)
    return FSDP(model, auto_wrap_policy=ModuleWrapPolicy({P.Block}),
                cpu_offload=fullshard.CPUOffload(offload_params=True), **options)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _backward(model, rank: int, step: int, micro: int, sync: bool, scale: float = 1.0) -> None:
    x, y = P.tokens(10 * rank + micro, step)
    loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten()) * scale
    if sync:
        loss.backward()
    elif isinstance(model, FSDP):
        with model.no_sync():
            loss.backward()
    else:
        model.set_requires_gradient_sync(False)
        loss.backward()
        model.set_requires_gradient_sync(True)


def _train(model, rank: int, overlap: bool, max_norm):
    """The five iterations; returns (full parameters and this rank's AdamW state, whether the parameters
    had changed after the first backward before step(), the global norms,
    per parameter name whether its gradient kept one storage at every step,
    OffloadAdamW's (unit_steps_in_backward, redone_steps) or None)."""
    if overlap:
        opt = OffloadAdamW(model, lr=LR, max_norm=max_norm)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=LR, fused=True)
    base = model.module if isinstance(model, FSDP) else model
    named = list(model.named_parameters())
    storages, norms, moved = {n: [] for n, _ in named}, [], None
    for step in range(5):
        base.skip_norm = step == 1
        before = [_local(p).clone() for _, p in named]
        if step == 2:
            _backward(model, rank, step, 0, sync=False)
        _backward(model, rank, step, 1, sync=True)
        for n, p in named:
            if p.grad is not None:
                storages[n].append(weakref.ref(_local(p.grad).untyped_storage()))
        if step == 0 and overlap:
            opt.state_dict()  # waits for the unit steps taken during backward
            moved = any(not torch.equal(b, _local(p)) for b, (_, p) in zip(before, named))
        if max_norm is not None:
            if overlap:
                opt.step()
                norms.append(float(opt.grad_norm))
            else:
                norms.append(float(fullshard.clip_grad_norm_(model, max_norm)))
                opt.step()
        else:
            opt.step()
        opt.zero_grad(set_to_none=step != 3)
    full = _state(model, opt)
    # While the model lives: each parameter's gradient had one storage at every step.
    alive = {n: [r() for r in refs] for n, refs in storages.items()}
    reused = {n: len(a) >= 4 and a[0] is not None and all(s is a[0] for s in a) for n, a in alive.items()}
    counts = (opt.unit_steps_in_backward, opt.redone_steps) if overlap else None
    return full, moved, norms, reused, counts


def _state(model, opt) -> dict:
    """Full parameters and this rank's AdamW state (the step counts included)."""
    full = {n: P.full(p) for n, p in model.named_parameters()}
    for i, st in opt.state_dict()["state"].items():
        full.update({f"state {i} {k}": _local(v).clone() for k, v in st.items()})
    return full


def _dropped_and_accumulated(door: str, rank: int, overlap: bool, max_norm: float) -> dict:
    """An iteration dropped by zero_grad() before step(); two synchronizing backwards for one step
    (the second forward puts the speculative steps back); a plain one; one whose finite gradients
    (x 1e22) have an inf norm (every gradient clipped to 0, as clip_grad_norm_ does)."""
    model = _make(door)
    if overlap:
        opt = OffloadAdamW(model, lr=LR, max_norm=max_norm)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=LR, fused=True)
    _backward(model, rank, 0, 0, sync=True)
    opt.zero_grad()
    dropped = {f"dropped {k}": v for k, v in _state(model, opt).items()}  # before any other forward
    norms = []
    for step, micros, scale in ((1, 2, 1.0), (2, 1, 1.0), (3, 1, 1e22)):
        for micro in range(micros):
            _backward(model, rank, step, micro, sync=True, scale=scale)
        if not overlap:
            norms.append(fullshard.clip_grad_norm_(model, max_norm))
        opt.step()
        if overlap:
            norms.append(opt.grad_norm)
        opt.zero_grad()
    assert norms[-1].isinf() and all(n.isfinite() for n in norms[:-1]), norms
    return _state(model, opt) | dropped | {"norms": torch.stack(norms)}


def _lr_after_backward(door: str, rank: int, overlap: bool) -> dict:
    """lr and weight decay set after each backward, before step() (a warmup written that way): OffloadAdamW
    with max_norm redoes the steps taken during backward with the new settings."""
    model = _make(door)
    opt = OffloadAdamW(model, lr=LR, max_norm=HIGH) if overlap else \
        torch.optim.AdamW(model.parameters(), lr=LR, fused=True)
    for step in range(3):
        _backward(model, rank, step, 0, sync=True)
        for group in opt.param_groups:
            group["lr"], group["weight_decay"] = LR * (step + 2), 0.01 * step
        if not overlap:
            fullshard.clip_grad_norm_(model, HIGH)
        opt.step()
        opt.zero_grad()
    return _state(model, opt)


def _twice_reentrant():
    """A unit called in two reentrant-checkpointed segments: each recomputation reduces its gradient."""
    from torch.utils.checkpoint import checkpoint

    class Twice(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.block, self.head = torch.nn.Linear(8, 8), torch.nn.Linear(8, 1)

        def forward(self, x):
            h = checkpoint(self.block, x, use_reentrant=True)
            return self.head(checkpoint(self.block, torch.tanh(h), use_reentrant=True))
    torch.manual_seed(0)
    model = Twice()
    fullshard.fully_shard(model.block, offload_policy=fullshard.CPUOffloadPolicy())
    return fullshard.fully_shard(model, offload_policy=fullshard.CPUOffloadPolicy())


def _refusals(rank: int) -> None:
    model = _make("fully_shard")
    _backward(model, rank, 0, 0, sync=True)  # the root is known after the first forward
    model.zero_grad()
    with pytest.raises(ValueError, match="root module"):
        OffloadAdamW(model.layers[0])
    with pytest.raises(TypeError, match="root fully_shard"):
        OffloadAdamW(torch.nn.Linear(2, 2))
    half = _make("fully_shard", mp_policy=fullshard.MixedPrecisionPolicy(param_dtype=torch.float16))
    with pytest.raises(ValueError, match="float16"):
        OffloadAdamW(half)
    opt = OffloadAdamW(model, lr=LR)
    _backward(model, rank, 0, 0, sync=True)
    with pytest.raises(RuntimeError, match="got a gradient again before opt.step"):
        _backward(model, rank, 1, 0, sync=True)  # two synchronizing backwards for one step
    with pytest.raises(ValueError, match="no closure"):
        opt.step(lambda: None)
    # zero_grad() before step() (a step pre-hook that raised, say) cannot put back the steps taken during
    # backward without max_norm: said once, and the next iteration trains as usual.
    model = _make("fully_shard")
    opt = OffloadAdamW(model, lr=LR)
    _backward(model, rank, 0, 0, sync=True)
    with pytest.raises(RuntimeError, match="were already stepped during backward"):
        opt.zero_grad()
    _backward(model, rank, 1, 0, sync=True)
    opt.step()
    opt.zero_grad()
    # A clip after backward comes too late for the steps taken during it: loud, never ignored.
    for door in ("fully_shard", "wrapper"):
        model = _make(door)
        opt = OffloadAdamW(model, lr=LR)
        _backward(model, rank, 0, 0, sync=True)
        if door == "fully_shard":
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3)  # torch's clip on the DTensor gradients
        else:
            model.clip_grad_norm_(1e-3)
        with pytest.raises(RuntimeError, match="changed after it was stepped during backward"):
            opt.step()
    # A gradient scaler: its inf check would come after the units' steps.
    model = _make("fully_shard")
    opt = OffloadAdamW(model, lr=LR)
    _backward(model, rank, 0, 0, sync=True)
    with pytest.raises(RuntimeError, match="ShardedGradScaler cannot drive OffloadAdamW"):
        fullshard.ShardedGradScaler().step(opt)
    opt.step()
    # Settings changed after backward, without max_norm: the steps taken during backward are final.
    model = _make("fully_shard")
    opt = OffloadAdamW(model, lr=LR)
    _backward(model, rank, 0, 0, sync=True)
    opt.param_groups[0]["lr"] = 2 * LR
    with pytest.raises(RuntimeError, match="changed after units were stepped with the old one"):
        opt.step()
    # A unit reduced twice in one backward after its speculative step (its second recomputation may have
    # gathered the stepped shards): refused; speculate=False steps it once at step().
    for speculate in (True, False):
        model = _twice_reentrant()
        opt = OffloadAdamW(model, lr=LR, max_norm=HIGH, speculate=speculate)
        loss = model(torch.randn(4, 8, requires_grad=True)).sum()
        if speculate:
            with pytest.raises(RuntimeError, match="got a gradient again in the backward that stepped it"):
                loss.backward()
        else:
            loss.backward()
            opt.step()


def _ranks(rank: int, world: int):
    report = {}
    for door in ("fully_shard", "FullyShardedDataParallel"):
        for max_norm in (None, CLIP, HIGH):
            want, _, want_norms, storages, _ = _train(_make(door), rank, False, max_norm)
            got, moved, got_norms, got_storages, (in_backward, redone) = _train(_make(door), rank, True, max_norm)
            what = f"{door} max_norm={max_norm}"
            assert got.keys() == want.keys(), (what, sorted(got.keys() ^ want.keys()))
            for name in want:
                assert torch.equal(got[name], want[name]), (what, name, (got[name] - want[name]).abs().max())
            assert got_norms == want_norms, (what, got_norms, want_norms)
            if max_norm is not None:  # clipping really happened (CLIP), or never (HIGH)
                assert all((n > max_norm) is (max_norm == CLIP) for n in want_norms), (what, want_norms)
            # Every unit of every iteration stepped during backward (3 units x 5), with clipping too;
            # the clipped iterations redid their steps at step().
            assert moved and in_backward == 15, (what, moved, in_backward)
            assert redone == (5 if max_norm == CLIP else 0), (what, redone)
            for run, reused in (("AdamW", storages), ("OffloadAdamW", got_storages)):
                assert all(reused.values()), (what, run, "gradient storage not reused across steps", reused)
            report[what] = f"bitwise equal, {in_backward} unit steps in backward, {redone} redone"
        for max_norm in (CLIP, HIGH):
            want = _dropped_and_accumulated(door, rank, False, max_norm)
            got = _dropped_and_accumulated(door, rank, True, max_norm)
            for name in want:
                assert torch.equal(got[name], want[name]), (door, max_norm, name)
            report[f"{door} max_norm={max_norm} dropped + accumulated"] = "bitwise equal"
        want, got = _lr_after_backward(door, rank, False), _lr_after_backward(door, rank, True)
        for name in want:
            assert torch.equal(got[name], want[name]), (door, "lr after backward", name)
        report[f"{door} lr changed after backward"] = "bitwise equal"
    _refusals(rank)
    dist.barrier()
    return report


def test_offload_adamw_bitwise_and_reused_grad_buffers():
    """OffloadAdamW (steps during backward; with max_norm speculatively,
    redone at step() when the norm clips) equals backward + clip_grad_norm_
    + fused AdamW bit for bit under both
    front doors with CPU offload, an unused parameter, no_sync accumulation
    and zero_grad(set_to_none=False); gradient shards stay in one host
    buffer per unit across steps; what it cannot do is refused."""
    print(run_ranks(_ranks, 2)[0])


# ------------------------------------------------------------------------------------------------ CUDA
def _cuda_one_rank(rank, world, device_type="cuda"):
    """One NCCL rank on the GPU, pinned offload, both doors, with side streams on and off:
    OffloadAdamW equals fused AdamW bit for bit (non-blocking copies waited on before the host step),
    and the host gradient buffers are pinned. ``device_type="cpu"`` (gloo) runs the same checks here."""
    from fullshard.core import offload, streams
    from fullshard.core.module import unit_modules
    from tests.dist import models as M
    from tests.dist.test_cuda import _shard
    device = torch.device(device_type, 0) if device_type == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    base = M.make_model("gpt")

    def run(door, overlap, max_norm):
        model = _shard(door, base, device, offload=True)
        opt = OffloadAdamW(model, lr=LR, max_norm=max_norm) if overlap else \
            torch.optim.AdamW(model.parameters(), lr=LR, fused=True)
        for step in range(3):
            x, y = (t.to(device) for t in M.batch("gpt", rank, step))
            M.loss_fn("gpt", model, x, y).backward()
            if max_norm is not None and not overlap:
                fullshard.clip_grad_norm_(model, max_norm)
            opt.step()
            opt.zero_grad()
        pinned = all(b.is_pinned() == (device.type == "cuda") for m in unit_modules(model)
                     for b in offload.buffers(m.unit))
        return {n: _local(p).detach().cpu() for n, p in model.named_parameters()}, pinned

    out = {}
    for on in (False, True):
        streams.set_enabled(on)
        for door in ("wrapper", "fully_shard"):
            for max_norm in (None, 1e-3):
                want, _ = run(door, False, max_norm)
                got, pinned = run(door, True, max_norm)
                assert pinned, f"{door}: host gradient buffers not pinned"
                for n in want:
                    assert torch.equal(got[n], want[n]), (door, on, max_norm, n)
                out[f"{door} streams={on} max_norm={max_norm}"] = "bitwise equal"
    streams.set_enabled(None)
    return out


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_offload_adamw_on_cuda():
    print(run_ranks(_cuda_one_rank, 1, backend="nccl", timeout_s=300))
