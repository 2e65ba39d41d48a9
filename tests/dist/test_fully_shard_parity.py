"""``fullshard.fully_shard`` against torch's own FSDP2 (``torch.distributed.fsdp.fully_shard``) and DDP.

The same model, initial weights and per-rank batches go through both ``fully_shard``s (each block, then the
root) and through DDP: ``common.STEPS`` AdamW steps with ``torch.nn.utils.clip_grad_norm_`` at 0.5 on the
DTensor parameters. At 2 ranks the two FSDP2s agree bit for bit (per-step losses, gradient norms, final
parameters: a 2-term sum has one rounding in any order); at 3 ranks the reduction order may differ, so they
agree within fp32 tolerance, as both do with DDP. Cases: the GPT mini (tied embedding), default,
``reshard_after_forward=False``, ``CPUOffloadPolicy(pin_memory=False)``, bf16 compute with fp32 reduction; the
nested MLP and its frozen variant (uneven shapes; their 0-dim ``scale`` as a 1-element 1-D parameter, since
both FSDP2s refuse 0-dim ones); the torchtitan-shaped Llama (tests/dist/llama.py). An ignored 0-dim parameter
is not managed by either FSDP2: its gradient stays this rank's own, not DDP's mean (recorded here).
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.distributed.fsdp as torch_fsdp
import torch.nn.functional as F
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel as DDP

import fullshard
from fullshard.core import flat as fsflat
from tests.dist import models as M
from tests.dist.common import ATOL, BF16_RTOL, RTOL, ddp_bf16_losses, full, train
from tests.dist.harness import run_ranks
from tests.dist.llama import build_plain, token_batch

LIBS = {"fullshard": fullshard, "torch": torch_fsdp}
"""Implementation name -> the module holding its ``fully_shard`` and policies."""
NORM_RTOL = 1e-5
"""Relative tolerance of gradient norms (a sum of squares over every element), as tests/dist/test_parity.py."""
LLAMA_STEPS, MAX_NORM = 6, 0.5


def _options(lib, case: str) -> dict:
    """``fully_shard`` keyword arguments of ``case`` in ``lib``'s own policy classes."""
    if case == "reshard_after_forward=False":
        return dict(reshard_after_forward=False)
    if case == "cpu_offload":
        return dict(offload_policy=lib.CPUOffloadPolicy(pin_memory=False))
    if case == "bf16":
        return dict(mp_policy=lib.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32))
    return {}


def _sharded(lib, model, blocks, **options):
    for block in blocks:
        lib.fully_shard(block, **options)
    return lib.fully_shard(model, **options)


def _blocks(kind: str, model) -> list:
    return list(model.layers) if kind == "gpt" else [model.inner]


def _model(kind: str):
    base = M.make_model(kind)
    return base if kind == "gpt" else M.vector_scale(base)


def _run(kind: str, case: str, rank: int, lib) -> dict:
    base = _model(kind)
    model = _sharded(lib, base, _blocks(kind, base), **_options(lib, case))
    losses, norms = train(model, kind, rank, clip=case != "bf16")  # bf16: as the unclipped DDP reference
    return dict(losses=losses, norms=norms, params={n: full(p) for n, p in model.named_parameters()})


def _max_diff(got: dict, want: dict) -> dict:
    return {"loss": max(abs(a - b) for a, b in zip(got["losses"], want["losses"])),
            "norm": max([abs(a - b) for a, b in zip(got["norms"], want["norms"])], default=0.0),
            "param": max(float((got["params"][n] - want["params"][n]).abs().max()) for n in want["params"])}


def _assert_equal(got: dict, want: dict, where: str) -> None:
    assert got["losses"] == want["losses"], f"{where}: losses {got['losses']} vs {want['losses']}"
    assert got["norms"] == want["norms"], f"{where}: gradient norms {got['norms']} vs {want['norms']}"
    assert list(got["params"]) == list(want["params"]), where
    for n, p in want["params"].items():
        assert torch.equal(got["params"][n], p), f"{where}: {n} differs by {(got['params'][n] - p).abs().max()}"


def _assert_close(got: dict, want: dict, where: str, rtol=RTOL, atol=ATOL, norm_rtol=NORM_RTOL,
                  params=True) -> None:
    torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(want["losses"]), rtol=rtol, atol=atol,
                               msg=lambda m: f"{where} losses: {m}")
    torch.testing.assert_close(torch.tensor(got["norms"]), torch.tensor(want["norms"]), rtol=norm_rtol, atol=atol,
                               msg=lambda m: f"{where} gradient norms: {m}")
    for n, p in want["params"].items() if params else ():
        torch.testing.assert_close(got["params"][n], p, rtol=rtol, atol=atol, msg=lambda m: f"{where} {n}: {m}")


def _ddp(kind: str, rank: int) -> dict:
    model = DDP(_model(kind))
    losses, norms = train(model, kind, rank)
    return dict(losses=losses, norms=norms,
                params={n.removeprefix("module."): p.detach().clone() for n, p in model.named_parameters()})


def _parity(rank, world):
    """Every case under both FSDP2s and DDP; returns the largest differences per case."""
    figures = {}
    cases = [("gpt", c) for c in ("default", "reshard_after_forward=False", "cpu_offload", "bf16")]
    cases += [("mlp", "default"), ("frozen", "default")]
    refs = {kind: _ddp(kind, rank) for kind in ("gpt", "mlp", "frozen")}
    for kind, case in cases:
        where = f"{kind} {case} world={world}"
        ours, theirs = (_run(kind, case, rank, LIBS[name]) for name in ("fullshard", "torch"))
        if world == 2:
            _assert_equal(ours, theirs, f"{where}: fullshard vs torch FSDP2")
        elif case == "bf16":  # bf16 sums in another order differ by bf16 roundings, which Adam amplifies
            _assert_close(ours, theirs, f"{where}: fullshard vs torch FSDP2", BF16_RTOL, 1e-3, BF16_RTOL, False)
        else:
            _assert_close(ours, theirs, f"{where}: fullshard vs torch FSDP2")
        if case == "bf16":
            ref = dict(losses=ddp_bf16_losses(M.make_model("gpt"), rank), norms=[], params={})
            _assert_close(ours, ref, f"{where}: fullshard vs DDP (bf16 casts)", BF16_RTOL, 1e-3, params=False)
            figures[where] = {"vs_torch": _max_diff(ours, theirs),
                              "vs_ddp_loss": max(abs(a - b) for a, b in zip(ours["losses"], ref["losses"]))}
        else:
            _assert_close(ours, refs[kind], f"{where}: fullshard vs DDP")
            _assert_close(theirs, refs[kind], f"{where}: torch FSDP2 vs DDP")  # the reference itself agrees
            figures[where] = {"vs_torch": _max_diff(ours, theirs), "vs_ddp": _max_diff(ours, refs[kind])}
    figures.update(_llama(rank, world))
    if world == 2:
        figures.update(_ignored_scalar(rank, world))
    return figures


def _llama(rank, world) -> dict:
    """The Llama of tests/dist/llama.py (RMSNorm, rotary buffer, ModuleDict blocks, untied output):
    LLAMA_STEPS steps on rank-disjoint rows of one global batch, both FSDP2s vs one process."""
    batch_size = 4 * world

    def run(lib):
        model = build_plain()
        if lib is not None:
            _sharded(lib, model, list(model.layers.values()))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, eps=1e-6)
        losses, norms = [], []
        for step in range(LLAMA_STEPS):
            rows = (rank, world) if lib is not None else (0, 1)
            x, y = token_batch(step, *rows, global_batch_size=batch_size)
            loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
            loss.backward()
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)))
            opt.step()
            opt.zero_grad()
            if lib is not None:  # the global batch's loss: the mean of equal-sized rows' means
                loss = loss.detach().clone()
                dist.all_reduce(loss)
                loss /= world
            losses.append(loss.item())
        return dict(losses=losses, norms=norms, params={n: full(p) for n, p in model.named_parameters()})

    ours, theirs, one = run(fullshard), run(torch_fsdp), run(None)
    where = f"llama world={world}"
    if world == 2:
        _assert_equal(ours, theirs, f"{where}: fullshard vs torch FSDP2")
    else:
        _assert_close(ours, theirs, f"{where}: fullshard vs torch FSDP2")
    _assert_close(ours, one, f"{where}: fullshard vs one process")
    return {where: {"vs_torch": _max_diff(ours, theirs), "vs_one_process": _max_diff(ours, one)}}


def _ignored_scalar(rank, world) -> dict:
    """``ignored_params={scale}`` (the MLP's 0-dim parameter): the rest is sharded and averaged as DDP does;
    ``scale`` is left to the user, so its gradient is this rank's own, under both FSDP2s (DDP averages it)."""
    x, y = M.batch("mlp", rank, 0)
    local = M.make_model("mlp")
    M.loss_fn("mlp", local, x, y).backward()
    ddp = DDP(M.make_model("mlp"))
    M.loss_fn("mlp", ddp, x, y).backward()
    want = {n.removeprefix("module."): p.grad for n, p in ddp.named_parameters()}
    grads = {}
    for name, lib in LIBS.items():
        model = M.make_model("mlp")
        _sharded(lib, model, [model.inner], ignored_params={model.scale})
        assert not isinstance(model.scale, DTensor), name
        M.loss_fn("mlp", model, x, y).backward()
        grads[name] = {n: full(p.grad) for n, p in model.named_parameters()}
        for n, g in grads[name].items():
            if n != "scale":
                torch.testing.assert_close(g, want[n], rtol=RTOL, atol=ATOL, msg=lambda m: f"{name} {n}: {m}")
        assert torch.equal(grads[name]["scale"], local.scale.grad), (name, grads[name]["scale"], local.scale.grad)
        assert not torch.equal(grads[name]["scale"], want["scale"]), "the ranks' batches must differ for this check"
    for n, g in grads["fullshard"].items():
        assert torch.equal(g, grads["torch"][n]), n
    return {"ignored 0-dim scale: |local grad - DDP mean|": float((local.scale.grad - want["scale"]).abs())}


def _one_rank_bf16(rank, world):
    """One rank, bf16 compute with fp32 reduction: the cast shard is the unsharded flat (core/unit.py), so
    no copy-out runs (nor in summon_full_params); both doors give torch FSDP2's results bit for bit, and DDP's
    within bf16 roundings."""
    copies = []
    real = fsflat.copy_out
    fsflat.copy_out = lambda *a: copies.append(1) or real(*a)
    try:
        ours = _run("gpt", "bf16", rank, fullshard)
        wrapper = fullshard.FullyShardedDataParallel(
            M.make_model("gpt"), auto_wrap_policy=M.unit_policy("gpt"),
            mixed_precision=fullshard.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32))
        wrapper_losses = train(wrapper, "gpt", rank, clip=False)[0]
        with wrapper.summon_full_params():  # gathered without a copy-out too (core/gather.py)
            summoned = {n: p.detach().clone() for n, p in wrapper.named_parameters()}
    finally:
        fsflat.copy_out = real
    theirs = _run("gpt", "bf16", rank, torch_fsdp)
    _assert_equal(ours, theirs, "one rank bf16: fullshard vs torch FSDP2")
    assert ours["losses"] == wrapper_losses, (ours["losses"], wrapper_losses)
    _assert_equal(dict(ours, losses=wrapper_losses, params=summoned), ours, "one rank bf16: the wrapper")
    ref = dict(losses=ddp_bf16_losses(M.make_model("gpt"), rank), norms=[], params={})
    _assert_close(ours, ref, "one rank bf16: fullshard vs DDP (bf16 casts)", BF16_RTOL, 1e-3, params=False)
    assert not copies, f"{len(copies)} copy-outs at one rank"
    return ours["losses"][-1]


def test_one_rank_bf16_casts_into_the_unsharded_flat():
    print(run_ranks(_one_rank_bf16, 1)[0])


@pytest.mark.parametrize("world", [pytest.param(2, marks=pytest.mark.fast), 3])
def test_fully_shard_matches_torch_fsdp2_and_ddp(world):
    figures = run_ranks(_parity, world)[0]
    for where, value in figures.items():
        print(f"{where}: {value}")
