"""examples/train_llama.py (torchtitan-style FSDP2 training of tests/dist/llama.py) against one process.

The script's own functions run on gloo ranks with the ``fully_shard`` named by ``IMPLS`` swapped in for the
script's one import line, and are compared with a plain single-process model trained on the same global
batches: the initial weights bit for bit, per-step losses and gradient norms and the final weights within fp32
tolerance. Its DCP checkpoint must resume bit for bit at the same world size and load at another one.
Under HSDP (a 2-D mesh) clip_grad_norm_ must see the global gradient norm (pytorch/pytorch#170862 reported
partial norms).
"""
from __future__ import annotations

import importlib
import importlib.util
import os

import pytest
import torch

from tests.dist.harness import run_ranks
from tests.dist.llama import build_plain, token_batch

# Not in the fast tier (make test-fast): several spawned groups; make test runs it.

SCRIPT = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                      "examples", "train_llama.py")
IMPLS = {"torch": "torch.distributed.fsdp", "fullshard": "fullshard"}
"""Implementation name → module whose ``fully_shard`` replaces the script's (add ``"fullshard": "fullshard"``)."""
LR, STEPS, SPLIT, MAX_NORM = 1e-2, 6, 3, 0.5
"""The script's default learning rate; steps per run; the step at which the checkpoint is saved; the clipping
threshold (below the gradient norms of these steps, so clipping scales every step)."""
RTOL, ATOL = 1e-5, 1e-6
"""fp32 tolerance of sharded vs single-process figures (reduction order differs)."""


def _script(impl: str):
    """examples/train_llama.py as a module, its ``fully_shard`` replaced by ``impl``'s (the one swap point)."""
    spec = importlib.util.spec_from_file_location("train_llama", SCRIPT)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    script.fully_shard = importlib.import_module(IMPLS[impl]).fully_shard
    return script


def _full(model) -> dict:
    """Every parameter as a full numpy array (a collective: all ranks call it). numpy, not tensors: a
    tensor crosses the harness's queue as a shared-memory handle that dies with the rank."""
    return {name: param.detach().full_tensor().numpy() for name, param in model.named_parameters()}


def _optimizer(model):
    # eps=1e-6 (the script's AdamW has the default 1e-8): with 1e-8, Adam's normalization turns the
    # rounding noise of near-zero gradients into 1e-5 weight differences within 6 steps, for any two
    # correct reduction orders; 1e-6 keeps them at ~5e-7, so RTOL/ATOL stay fp32-tight.
    return torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1, eps=1e-6)


def _reference():
    """Single process: per-step (loss, grad norm) of STEPS steps, and the weights after SPLIT and STEPS."""
    model = build_plain()
    opt = _optimizer(model)
    history, snapshots = [], {}
    for step in range(STEPS):
        inputs, labels = token_batch(step)
        loss = torch.nn.functional.cross_entropy(model(inputs).flatten(0, 1), labels.flatten())
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=MAX_NORM)
        opt.step()
        opt.zero_grad()
        history.append((loss.item(), norm.item()))
        if step + 1 in (SPLIT, STEPS):
            snapshots[step + 1] = {name: p.detach().clone() for name, p in model.named_parameters()}
    return history, snapshots


def _train_and_checkpoint(rank, world, impl, ckpt):
    """Init, STEPS steps with a save at SPLIT, and a resume into a differently initialized model."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    script = _script(impl)
    mesh = init_device_mesh("cpu", (world,))
    model = script.build_model(mesh)
    initial = _full(model)
    placements = {name: p.placements for name, p in model.named_parameters() if isinstance(p, DTensor)}
    assert set(placements) == set(initial) and set(placements.values()) == {(Shard(0),)}, placements
    opt = _optimizer(model)
    history = script.train(model, opt, 0, SPLIT, MAX_NORM, log=None)
    script.save_checkpoint(ckpt, model, opt, SPLIT)
    at_split = _full(model)
    history += script.train(model, opt, SPLIT, STEPS - SPLIT, MAX_NORM, log=None)
    # Resume: a model with other weights (seed 1) and a fresh optimizer take the checkpoint's state.
    resumed = script.build_model(mesh, seed=1)
    resumed_opt = _optimizer(resumed)
    step = script.load_checkpoint(ckpt, resumed, resumed_opt)
    loaded = _full(resumed)
    resumed_history = script.train(resumed, resumed_opt, step, STEPS - SPLIT, MAX_NORM, log=None)
    return dict(initial=initial, history=history, at_split=at_split, final=_full(model), step=step,
                loaded=loaded, resumed_history=resumed_history, resumed_final=_full(resumed))


def _load_elsewhere(rank, world, impl, ckpt):
    """Load a checkpoint saved at another world size and train the remaining steps."""
    from torch.distributed.device_mesh import init_device_mesh

    script = _script(impl)
    model = script.build_model(init_device_mesh("cpu", (world,)), seed=1)
    opt = _optimizer(model)
    step = script.load_checkpoint(ckpt, model, opt)
    loaded = _full(model)
    history = script.train(model, opt, step, STEPS - SPLIT, MAX_NORM, log=None)
    return dict(step=step, loaded=loaded, history=history, final=_full(model))


def _hsdp(rank, world, impl):
    """SPLIT steps on a (2, 2) mesh: parameters (Replicate, Shard(0)), clipping on the global norm."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard

    script = _script(impl)
    model = script.build_model(init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard")))
    assert {p.placements for p in model.parameters()} == {(Replicate(), Shard(0))}
    history = script.train(model, _optimizer(model), 0, SPLIT, MAX_NORM, log=None)
    return dict(history=history, weights=_full(model))


def _assert_weights(got, want, what, exact=False):
    assert list(got) == list(want), what
    got, want = ({name: torch.as_tensor(value) for name, value in weights.items()} for weights in (got, want))
    for name in want:
        if exact:
            assert torch.equal(got[name], want[name]), f"{what}: {name} differs"
        else:
            torch.testing.assert_close(got[name], want[name], rtol=RTOL, atol=ATOL, msg=lambda m: f"{what}: {name} {m}")


def _assert_history(got, want, what):
    torch.testing.assert_close(torch.tensor(got, dtype=torch.float64), torch.tensor(want, dtype=torch.float64),
                               rtol=RTOL, atol=ATOL, msg=lambda m: f"{what} (loss, grad norm) per step: {m}")


@pytest.mark.parametrize("impl", sorted(IMPLS))
def test_llama_script_matches_single_process(impl, tmp_path):
    ref_history, ref_weights = _reference()
    assert min(norm for _, norm in ref_history) > MAX_NORM, "clipping must act for the test to cover it"
    ckpt = str(tmp_path / "step-3")
    ranks = run_ranks(_train_and_checkpoint, 2, impl, ckpt, timeout_s=120)
    out = ranks[0]
    for other in ranks[1:]:  # every rank reports the same global figures
        assert other["history"] == out["history"] and other["resumed_history"] == out["resumed_history"]
    _assert_weights(out["initial"], {k: v.detach() for k, v in build_plain().named_parameters()},
                    "initial weights (full init scattered into shards)", exact=True)
    _assert_history(out["history"], ref_history, "2 ranks vs 1 process")
    _assert_weights(out["at_split"], ref_weights[SPLIT], f"weights after {SPLIT} steps, 2 ranks vs 1 process")
    _assert_weights(out["final"], ref_weights[STEPS], f"weights after {STEPS} steps, 2 ranks vs 1 process")
    # The same world size resumes bit for bit.
    assert out["step"] == SPLIT
    _assert_weights(out["loaded"], out["at_split"], "weights loaded from the checkpoint", exact=True)
    assert out["resumed_history"] == out["history"][SPLIT:], "resumed run's (loss, grad norm) differ"
    _assert_weights(out["resumed_final"], out["final"], "final weights of the resumed run", exact=True)
    # Saved at 2 ranks, loaded at 4: the same weights, and training goes on as the single process does.
    four = run_ranks(_load_elsewhere, 4, impl, ckpt, timeout_s=120)[0]
    assert four["step"] == SPLIT
    _assert_weights(four["loaded"], out["at_split"], "weights saved at 2 ranks, loaded at 4", exact=True)
    _assert_history(four["history"], ref_history[SPLIT:], "4 ranks after loading vs 1 process")
    _assert_weights(four["final"], ref_weights[STEPS], "weights after loading at 4 and training, vs 1 process")


@pytest.mark.parametrize("impl", sorted(IMPLS))
def test_llama_script_hsdp_matches_single_process(impl):
    ref_history, ref_weights = _reference()
    assert min(norm for _, norm in ref_history[:SPLIT]) > MAX_NORM, "clipping must act for the test to cover it"
    out = run_ranks(_hsdp, 4, impl, timeout_s=120)[0]
    _assert_history(out["history"], ref_history[:SPLIT], "HSDP (2, 2) vs 1 process")
    _assert_weights(out["weights"], ref_weights[SPLIT], f"weights after {SPLIT} steps, HSDP (2, 2) vs 1 process")


def _plain_run(rank, world, impl):
    from torch.distributed.device_mesh import init_device_mesh

    script = _script(impl)
    model = script.build_model(init_device_mesh("cpu", (world,)))
    history = script.train(model, _optimizer(model), 0, STEPS, MAX_NORM, log=None)
    return dict(history=history, weights=_full(model))


def test_llama_script_fullshard_equals_torch_fsdp2():
    """The Done-when of the FSDP2 API: the script, unchanged but for its import, gives torch FSDP2's losses,
    gradient norms and weights bit for bit at 2 ranks (both shard on dim 0; a + b is commutative) and
    within fp32 tolerance at 4 (reduction orders may differ)."""
    for world, exact in ((2, True), (4, False)):
        ours, theirs = (run_ranks(_plain_run, world, impl, timeout_s=120)[0] for impl in ("fullshard", "torch"))
        if exact:
            assert ours["history"] == theirs["history"], (ours["history"], theirs["history"])
        else:
            _assert_history(ours["history"], theirs["history"], f"{world} ranks: fullshard vs torch FSDP2")
        _assert_weights(ours["weights"], theirs["weights"], f"{world} ranks: fullshard vs torch FSDP2", exact=exact)
