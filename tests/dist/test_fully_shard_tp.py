"""``fully_shard`` over tensor-parallel parameters: ``parallelize_module`` on ``mesh["tp"]``, then
``fully_shard(block, mesh=mesh["dp"])`` per block and on the root, on a (dp=2, tp=2) mesh of 4 gloo ranks,
against one process training tests/dist/llama.py's Llama on the same global batches.

Two TP plans: ``blocks`` (the brief's: ColwiseParallel on q/k/v and w1/w3, RowwiseParallel on wo and w2;
embedding, norms and output stay plain, so the model mixes 1-D (dp) and 2-D (dp, tp) parameters) and ``full``
(torchtitan's: every parameter a TP DTensor, norms under SequenceParallel, so all parameters are 2-D).
Each rank of a dp group reads its dp rank's rows of the global batch (the tp ranks of a group read the same
rows). Checked per plan: the 2-D placements, the full view forward reads (a DTensor on the TP mesh with the TP
placements), gradients and per-step (loss, global gradient norm) against one process, the weights after
training, ``get_state_dict`` full and sharded, and a DCP save/load that resumes bit for bit.
"""
from __future__ import annotations

import pytest
import torch

from tests.dist.harness import run_ranks
from tests.dist.llama import build_plain, token_batch

# Not in the fast tier (make test-fast): several spawned groups; make test runs it.

LR, STEPS, SPLIT, MAX_NORM = 1e-2, 5, 3, 0.5
"""Learning rate; steps per run; step of the checkpoint; clipping threshold (below every step's norm)."""
RTOL, ATOL = 1e-5, 4e-6
"""fp32 tolerance of sharded vs single-process figures (reduction orders differ; DTensor's differ between
torch releases: on torch 2.11 one weight element of 1,024 ended 1.7e-6 from one process's after 3 AdamW steps)."""
PLANS = ("blocks", "full")
COLWISE = ("attention.wq", "attention.wk", "attention.wv", "feed_forward.w1", "feed_forward.w3")
ROWWISE = ("attention.wo", "feed_forward.w2")
TP_NAMES = tuple(f"layers.{i}.{m}.weight" for i in range(2) for m in COLWISE + ROWWISE)
"""The parameters both plans make TP DTensors (the ``blocks`` plan's 2-D parameters)."""


def _optimizer(params):
    # eps=1e-6 as in test_llama_reference.py: keeps Adam's normalization of near-zero gradients from
    # amplifying rounding differences beyond fp32 tolerance.
    return torch.optim.AdamW(params, lr=LR, weight_decay=0.1, eps=1e-6)


def _reference():
    """One process: per step (loss, global grad norm, norm of the TP_NAMES gradients), the step-0
    gradients, and the weights after SPLIT and STEPS steps."""
    model = build_plain()
    opt = _optimizer(model.parameters())
    history, snapshots, grads0 = [], {}, None
    for step in range(STEPS):
        inputs, labels = token_batch(step)
        loss = torch.nn.functional.cross_entropy(model(inputs).flatten(0, 1), labels.flatten())
        loss.backward()
        named = dict(model.named_parameters())
        sub = torch.nn.utils.get_total_norm([named[n].grad for n in TP_NAMES])
        if step == 0:
            grads0 = {n: p.grad.clone() for n, p in named.items()}
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        opt.step()
        opt.zero_grad()
        history.append((loss.item(), norm.item(), sub.item()))
        if step + 1 in (SPLIT, STEPS):
            snapshots[step + 1] = {n: p.detach().clone() for n, p in model.named_parameters()}
    return history, grads0, snapshots


# ------------------------------------------------------------------ ranks
def _parallelize(model, tp_mesh, plan: str) -> None:
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    if plan == "full":
        parallelize_module(model, tp_mesh, {
            "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
            "norm": SequenceParallel(),
            "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
        })
    for block in model.layers.values():
        layer_plan = {name: ColwiseParallel() for name in COLWISE}
        if plan == "full":
            layer_plan.update({
                "attention_norm": SequenceParallel(), "ffn_norm": SequenceParallel(),
                "attention": PrepareModuleInput(input_layouts=(Shard(1), None),
                                                desired_input_layouts=(Replicate(), None)),
                "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
                **{name: RowwiseParallel(output_layouts=Shard(1)) for name in ROWWISE}})
        else:
            layer_plan.update({name: RowwiseParallel() for name in ROWWISE})
        parallelize_module(block, tp_mesh, layer_plan)


def _build(mesh, plan: str, seed: int = 0):
    from fullshard import fully_shard

    model = build_plain(seed=seed)
    _parallelize(model, mesh["tp"], plan)
    for block in model.layers.values():
        fully_shard(block, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    return model


def _full(model) -> dict:
    """Every parameter as a full numpy array (a collective)."""
    return {n: p.detach().full_tensor().numpy() for n, p in model.named_parameters()}


def _clip(model, plan: str):
    """Clip by the global norm; returns (global norm, norm of the TP_NAMES gradients) as floats. The
    ``blocks`` model mixes parameters on mesh["dp"] and on the (dp, tp) mesh, which one
    ``clip_grad_norm_`` call cannot stack (torch raises): there the norm is taken per mesh, combined,
    and applied with ``clip_grads_with_norm_`` (what docs should recommend for mixed meshes)."""
    import fullshard

    params = dict(model.named_parameters())
    sub = torch.nn.utils.get_total_norm([params[n].grad for n in TP_NAMES]).full_tensor().item()
    # fullshard's clip_grad_norm_, both forms, by an infinite max_norm (no clipping): the same global norm on
    # every rank (ColwiseParallel's _StridedShard dp dimension and the TP dimensions summed too).
    ours = [fullshard.clip_grad_norm_(model.parameters(), float("inf")).item(),
            fullshard.clip_grad_norm_(model, float("inf")).item()]
    if plan == "full":
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM).full_tensor().item()
        assert all(abs(o - norm) <= 1e-6 * norm for o in ours), (plan, ours, norm)
        return norm, sub
    by_mesh: dict = {}
    for p in params.values():
        by_mesh.setdefault(p.device_mesh, []).append(p)
    assert len(by_mesh) == 2, list(by_mesh)
    norms = [torch.nn.utils.get_total_norm([p.grad for p in group]).full_tensor() for group in by_mesh.values()]
    total = torch.linalg.vector_norm(torch.stack(norms))
    for group in by_mesh.values():
        torch.nn.utils.clip_grads_with_norm_(group, MAX_NORM, total)
    assert all(abs(o - total.item()) <= 1e-6 * total.item() for o in ours), (plan, ours, total.item())
    return total.item(), sub


def _train(model, opt, mesh, plan: str, first: int, steps: int, grads=None):
    """``steps`` steps from ``first``; returns [(global loss, global norm, TP-parameter norm)]."""
    import torch.distributed as dist

    dp = mesh["dp"]
    history = []
    for step in range(first, first + steps):
        inputs, labels = token_batch(step, dp.get_local_rank(), dp.size())
        loss = torch.nn.functional.cross_entropy(model(inputs).flatten(0, 1), labels.flatten())
        loss.backward()
        if grads is not None and step == first:
            grads.update({n: p.grad.full_tensor().numpy() for n, p in model.named_parameters()})
        norm, sub = _clip(model, plan)
        opt.step()
        opt.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean, group=dp.get_group())
        history.append((mean.item() / dp.size(), norm, sub))
    return history


def _check_layout(model, mesh, plan: str) -> list:
    """Placements of the sharded parameters and of the full view a TP module reads in forward."""
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    strided = (_StridedShard(0, split_factor=2), Shard(0))
    for name, p in model.named_parameters():
        if name in TP_NAMES or plan == "full":
            assert p.device_mesh == mesh, (name, p.device_mesh)
            colwise = any(f".{m}." in name for m in COLWISE) or name in ("tok_embeddings.weight", "output.weight")
            want = strided if colwise else (Shard(0), Shard(1)) if name in TP_NAMES else (Shard(0), Replicate())
        else:
            assert p.device_mesh == mesh["dp"], (name, p.device_mesh)
            want = (Shard(0),)
        assert tuple(p.placements) == want, (name, p.placements, want)
    seen = []
    wq, wo = model.layers["0"].attention.wq, model.layers["0"].attention.wo
    hooks = [m.register_forward_pre_hook(lambda m, args: seen.append(
        (type(m.weight), m.weight.device_mesh, tuple(m.weight.placements), tuple(m.weight.to_local().shape))))
        for m in (wq, wo)]
    with torch.no_grad():
        model(token_batch(0, 0, 2)[0])
    for h in hooks:
        h.remove()
    assert seen == [(DTensor, mesh["tp"], (Shard(0),), (16, 32)), (DTensor, mesh["tp"], (Shard(1),), (32, 16))], seen
    return seen


def _run_plan(mesh, plan: str, ckpt: str) -> dict:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
    from torch.distributed.tensor import DTensor

    model = _build(mesh, plan)
    _check_layout(model, mesh, plan)
    initial = _full(model)
    opt = _optimizer(model.parameters())
    grads0: dict = {}
    history = _train(model, opt, mesh, plan, 0, SPLIT, grads0)
    # Sharded: DTensors as registered (2-D placements, this rank's shard); full: plain full tensors.
    model_sd, optim_sd = get_state_dict(model, opt)
    for name, p in model.named_parameters():
        value = model_sd[name]
        assert (value.device_mesh, value.placements) == (p.device_mesh, p.placements), name
        assert torch.equal(value.to_local(), p.to_local()), name
    assert all(isinstance(v, DTensor) for s in optim_sd["state"].values() for v in s.values() if v.ndim)
    full_sd, full_optim = get_state_dict(model, opt, options=StateDictOptions(full_state_dict=True))
    at_split = _full(model)
    assert set(full_sd) == set(at_split)
    for name, value in full_sd.items():
        assert not isinstance(value, DTensor) and torch.equal(value, torch.as_tensor(at_split[name])), name
    assert all(not isinstance(v, DTensor) for s in full_optim["state"].values() for v in s.values())
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=ckpt)
    history += _train(model, opt, mesh, plan, SPLIT, STEPS - SPLIT)
    # Resume: other initial weights (seed 1) and a fresh optimizer take the checkpoint.
    resumed = _build(mesh, plan, seed=1)
    resumed_opt = _optimizer(resumed.parameters())
    model_sd, optim_sd = get_state_dict(resumed, resumed_opt)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=ckpt)
    set_state_dict(resumed, resumed_opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    loaded = _full(resumed)
    resumed_history = _train(resumed, resumed_opt, mesh, plan, SPLIT, STEPS - SPLIT)
    return dict(initial=initial, grads0=grads0, history=history, at_split=at_split, final=_full(model),
                loaded=loaded, resumed_history=resumed_history, resumed_final=_full(resumed))


def _edge_cases(mesh) -> dict:
    """Uneven TP and dp chunks (rows 9 and 3 over tp=2, dp=2: TP parts of 5/4 and 2/1 rows, an empty dp
    shard), the torchtitan meta-device flow (full state dict broadcast from rank 0), HSDP + TP on a
    (replicate=2, shard=1, tp=2) mesh, and the errors for DTensors fully_shard cannot take."""
    import torch.nn as nn
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    from fullshard import fully_shard
    from tests.dist.llama import Llama

    out = {}
    dp = mesh["dp"]
    for rows in (9, 3):
        torch.manual_seed(0)
        ref = nn.Linear(4, rows)
        model = nn.Linear(4, rows)
        model.load_state_dict(ref.state_dict())
        parallelize_module(model, mesh["tp"], ColwiseParallel())
        fully_shard(model, mesh=dp)
        x = torch.randn(4, 4, generator=torch.Generator().manual_seed(1))
        model(x[2 * dp.get_local_rank():][:2]).square().sum().backward()  # local rows: separable
        (ref(x).square().sum() / 2).backward()
        out[f"uneven {rows}"] = [(torch.equal(p.full_tensor(), r), (p.grad.full_tensor() - r.grad).abs().max().item())
                                 for p, r in zip(model.parameters(), ref.parameters())]
    with torch.device("meta"):
        meta = Llama()
    _parallelize(meta, mesh["tp"], "blocks")
    for block in meta.layers.values():
        fully_shard(block, mesh=dp)
    fully_shard(meta, mesh=dp)
    meta.to_empty(device="cpu")
    meta.init_buffers()
    full = build_plain().state_dict() if torch.distributed.get_rank() == 0 else {}
    set_model_state_dict(meta, full, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    out["meta"] = _full(meta)
    hsdp = init_device_mesh("cpu", (2, 1, 2), mesh_dim_names=("replicate", "shard", "tp"))
    model = build_plain()
    _parallelize(model, hsdp["tp"], "blocks")
    for block in model.layers.values():
        fully_shard(block, mesh=hsdp["replicate", "shard"])
    fully_shard(model, mesh=hsdp["replicate", "shard"])
    inputs, labels = token_batch(0, hsdp["replicate"].get_local_rank(), 2)
    torch.nn.functional.cross_entropy(model(inputs).flatten(0, 1), labels.flatten()).backward()
    out["hsdp placements"] = {n: tuple(p.placements) for n, p in model.named_parameters()}
    out["hsdp grads"] = {n: p.grad.full_tensor().numpy() for n, p in model.named_parameters()}
    errors = []
    for what in ("partial", "world mesh", "invariant"):
        layer = parallelize_module(nn.Linear(4, 4), mesh["tp"], ColwiseParallel())
        if what == "partial":
            layer.weight = nn.Parameter(DTensor.from_local(torch.zeros(4, 4), mesh["tp"], (Partial(),)))
        try:
            fully_shard(layer, mesh=init_device_mesh("cpu", (4,)) if what == "world mesh" else dp,
                        world_size_invariant=what == "invariant")
        except ValueError as e:
            errors.append(str(e))
    out["errors"] = errors
    return out


def _tp_ranks(rank, world, ckpt_dir):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    out = {plan: _run_plan(mesh, plan, f"{ckpt_dir}/{plan}") for plan in PLANS}
    out["edge"] = _edge_cases(mesh)
    return out


def _close(got, want, what):
    torch.testing.assert_close(torch.as_tensor(got), torch.as_tensor(want), rtol=RTOL, atol=ATOL,
                               msg=lambda m: f"{what}: {m}")


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    """What the 4 ranks report (one spawned group for both tests)."""
    return run_ranks(_tp_ranks, 4, str(tmp_path_factory.mktemp("tp")), timeout_s=300)


def test_fully_shard_tp_matches_single_process(ranks):
    ref_history, ref_grads, ref_weights = _reference()
    assert min(norm for _, norm, _ in ref_history) > MAX_NORM, "clipping must act for the test to cover it"
    plain = {n: p.detach() for n, p in build_plain().named_parameters()}
    for plan in PLANS:
        out = ranks[0][plan]
        for other in ranks[1:]:  # every rank reports the same global figures
            assert other[plan]["history"] == out["history"], plan
        for name in plain:
            assert torch.equal(torch.as_tensor(out["initial"][name]), plain[name]), f"{plan}: initial {name}"
            _close(out["grads0"][name], ref_grads[name], f"{plan}: step-0 gradient of {name}")
            _close(out["at_split"][name], ref_weights[SPLIT][name], f"{plan}: {name} after {SPLIT} steps")
            _close(out["final"][name], ref_weights[STEPS][name], f"{plan}: {name} after {STEPS} steps")
        _close(torch.tensor(out["history"], dtype=torch.float64), torch.tensor(ref_history, dtype=torch.float64),
               f"{plan}: (loss, global grad norm, TP-parameter grad norm) per step vs 1 process")
        # DCP resumes bit for bit.
        for name in plain:
            assert torch.equal(torch.as_tensor(out["loaded"][name]), torch.as_tensor(out["at_split"][name])), name
            assert torch.equal(torch.as_tensor(out["resumed_final"][name]), torch.as_tensor(out["final"][name])), name
        assert out["resumed_history"] == out["history"][SPLIT:], f"{plan}: resumed run differs"



def test_fully_shard_tp_edge_cases(ranks):
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    edge = ranks[0]["edge"]
    for rows in (9, 3):  # weight and bias: full values exact, gradients as one process
        for exact, grad_diff in edge[f"uneven {rows}"]:
            assert exact and grad_diff < 1e-6, (rows, edge[f"uneven {rows}"])
    plain = {n: p.detach() for n, p in build_plain().named_parameters()}
    for name, value in plain.items():
        assert torch.equal(torch.as_tensor(edge["meta"][name]), value), f"meta init + full state dict: {name}"
    assert edge["hsdp placements"]["layers.0.attention.wq.weight"] == (Replicate(), _StridedShard(0, split_factor=2),
                                                                        Shard(0))
    assert edge["hsdp placements"]["layers.0.attention.wo.weight"] == (Replicate(), Shard(0), Shard(1))
    assert edge["hsdp placements"]["norm.weight"] == (Replicate(), Shard(0))
    model = build_plain()
    inputs, labels = token_batch(0)
    torch.nn.functional.cross_entropy(model(inputs).flatten(0, 1), labels.flatten()).backward()
    for name, p in model.named_parameters():
        _close(edge["hsdp grads"][name], p.grad, f"HSDP + TP gradient of {name}")
    partial, overlap, invariant = edge["errors"]
    assert "world_size_invariant=True with tensor-parallel parameters ('weight')" in invariant, invariant
    assert partial.startswith("[rank 0] fully_shard(Linear): parameter 'weight' is a DTensor with placements "
                              "(Partial(sum),)"), partial
    assert overlap.startswith("[rank 0] fully_shard(Linear): parameter 'weight' is a DTensor on mesh") and \
        "does not combine with the data-parallel mesh" in overlap, overlap
