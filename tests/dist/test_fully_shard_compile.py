"""``torch.compile`` with ``fullshard.fully_shard`` in the two orders used in practice, on 2 gloo ranks.

(a) torchtitan's: each block compiled in place (``block.compile()``), then ``fully_shard(block)``, then
``fully_shard(model)``; (b) sharded, then compiled: ``fully_shard`` per block and at the root, then
``model.compile()``. Each step trains (forward, backward, SGD with momentum) and then evaluates under ``no_grad``.

What must hold:
- The compiled runs give the eager run's per-step losses and final parameters: bit for bit under
  ``aot_eager`` (the same aten kernels run); under ``inductor`` (its own fused kernels, so reductions
  associate differently) bit for bit equal to torch FSDP2 compiled the same way, and within fp32 tolerance
  of eager.
- Nothing compiles after the first step: ``error_on_recompile`` is on from the second step, and dynamo's
  frame and graph counts stay where the first step left them. The full-parameter views the engine writes
  into ``module.__dict__`` are new tensor objects every iteration (checked here, so this is not vacuous):
  dynamo guards them by metadata (dtype, shape, stride, requires_grad), not by identity.
- The compiled graph runs in every step (block 0's output comes from aot_autograd's node), so bitwise
  equality under ``aot_eager`` is not eager code compared with itself.

The FSDP hooks stay outside the graphs (``torch.compiler.disable``): graphs break at unit boundaries.
"""
from __future__ import annotations

import pytest
import torch

from tests.dist.harness import run_ranks
from tests.dist.models import batch, loss_fn, make_model

STEPS = 3
RTOL, ATOL = 1e-5, 1e-6
"""fp32 tolerance of inductor vs eager: its fused kernels reassociate reductions (SGD, which passes gradient
rounding through unamplified; Adam's normalization would magnify it on near-zero gradients)."""


def _build(impl: str, order: str, backend: str, seen: dict):
    """GPT mini sharded per block and at the root; compiled in ``order`` ("a", "b" or "eager"). Each
    forward of block 0 appends to ``seen``: the full view its ``ln_1.weight`` reads and what made its output."""
    if impl == "torch":
        from torch.distributed.fsdp import fully_shard
    else:
        from fullshard import fully_shard
    model = make_model("gpt")
    for block in model.layers:
        if order == "a":
            block.compile(backend=backend)
        fully_shard(block)
    fully_shard(model)
    if order == "b":
        model.compile(backend=backend)

    # Registered after fully_shard's hooks, so they run after them; kept out of the graphs.
    @torch.compiler.disable
    def record_view(module, args):
        seen["views"].append(module.ln_1.__dict__.get("weight"))

    @torch.compiler.disable
    def record_output(module, args, output):
        seen["made_by"].append(type(output.grad_fn).__name__)

    model.layers[0].register_forward_pre_hook(record_view)
    model.layers[0].register_forward_hook(record_output)
    return model


def _counts() -> tuple[int, int]:
    from torch._dynamo.utils import counters
    return counters["frames"]["total"], counters["stats"]["unique_graphs"]


def _train(rank: int, impl: str, order: str, backend: str) -> dict:
    """STEPS steps (train, then a no_grad eval) from a fresh dynamo cache; this rank's figures."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    seen: dict = {"views": [], "made_by": []}
    model = _build(impl, order, backend, seen)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    losses, evals, counts = [], [], []
    try:
        for step in range(STEPS):
            torch._dynamo.config.error_on_recompile = step > 0
            x, y = batch("gpt", rank, step)
            loss = loss_fn("gpt", model, x, y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            with torch.no_grad():
                evals.append(loss_fn("gpt", model, x, y).item())
            losses.append(loss.item())
            counts.append(_counts())
    finally:
        torch._dynamo.config.error_on_recompile = False
    model.reshard()  # torch FSDP2 registers plain full tensors while its root is gathered
    train_views = seen["views"][::2]  # each step: the training forward, then the eval forward
    return {
        "losses": losses, "evals": evals, "counts": counts,
        # aot_autograd's node on the outputs of a compiled graph: the graph ran, not a fallback to eager
        "compiled_steps": seen["made_by"][::2].count("CompiledFunctionBackward"),
        "params": {n: p.detach().to_local().clone() for n, p in model.named_parameters()},
        "fresh_views": len({id(v) for v in train_views}) == STEPS and all(
            torch.is_tensor(v) and not isinstance(v, torch.nn.Parameter) for v in train_views),
    }


def _max_diff(got: dict, want: dict) -> float:
    return max((g - want[n]).abs().max().item() for n, g in got.items())


def _summary(run: dict, ref: dict) -> dict:
    """Plain figures (tensors do not cross the harness's queue)."""
    return {"losses": run["losses"], "evals": run["evals"], "counts": run["counts"],
            "compiled_steps": run["compiled_steps"],
            "fresh_views": run["fresh_views"], "params_equal": all(
                torch.equal(p, ref["params"][n]) for n, p in run["params"].items()),
            "params_close": all(torch.allclose(p, ref["params"][n], rtol=RTOL, atol=ATOL)
                                for n, p in run["params"].items()),
            "max_param_diff": _max_diff(run["params"], ref["params"])}


def _aot_eager_cases(rank, world):
    eager = _train(rank, "fullshard", "eager", "")
    out = {"eager": _summary(eager, eager)}
    for order in ("a", "b"):
        out[order] = _summary(_train(rank, "fullshard", order, "aot_eager"), eager)
    return out


def _inductor_cases(rank, world):
    eager = _train(rank, "fullshard", "eager", "")
    torch_ref = _train(rank, "torch", "a", "inductor")
    out = {"eager": _summary(eager, eager), "torch": _summary(torch_ref, eager)}
    for order in ("a", "b"):
        run = _train(rank, "fullshard", order, "inductor")
        out[order] = _summary(run, eager)
        out[order]["vs_torch"] = _summary(run, torch_ref)
    return out


def _assert_compiled_once(got: dict, what: str) -> None:
    first = got["counts"][0]
    assert first[1] > 0, f"{what}: nothing was compiled"
    assert got["compiled_steps"] == STEPS, f"{what}: block 0 ran compiled in {got['compiled_steps']}/{STEPS} steps"
    assert all(c == first for c in got["counts"]), \
        f"{what}: (frames, graphs) compiled per step {got['counts']}; nothing may compile after the first step"
    assert got["fresh_views"], f"{what}: the full-parameter views were not new tensors each iteration"


def test_compile_aot_eager_matches_eager_bitwise_without_recompiles():
    results = run_ranks(_aot_eager_cases, 2)
    for rank, out in enumerate(results):
        assert out["eager"]["fresh_views"] and out["eager"]["compiled_steps"] == 0
        for order in ("a", "b"):
            got, what = out[order], f"rank {rank}, order ({order}), aot_eager"
            _assert_compiled_once(got, what)
            assert got["losses"] == out["eager"]["losses"], f"{what}: {got['losses']} != eager {out['eager']['losses']}"
            assert got["evals"] == out["eager"]["evals"], f"{what}: eval losses differ from eager"
            assert got["params_equal"], f"{what}: final parameters differ from eager by {got['max_param_diff']:.3g}"


@pytest.mark.slow
def test_compile_inductor_matches_torch_fsdp2_and_eager_without_recompiles():
    results = run_ranks(_inductor_cases, 2)
    for rank, out in enumerate(results):
        eager = out["eager"]
        for order in ("a", "b"):
            got, what = out[order], f"rank {rank}, order ({order}), inductor"
            _assert_compiled_once(got, what)
            assert got["vs_torch"]["params_equal"] and got["losses"] == out["torch"]["losses"], \
                f"{what}: differs from torch FSDP2 compiled alike by {got['vs_torch']['max_param_diff']:.3g}"
            torch.testing.assert_close(got["losses"], eager["losses"], rtol=RTOL, atol=ATOL, msg=what)
            torch.testing.assert_close(got["evals"], eager["evals"], rtol=RTOL, atol=ATOL, msg=what)
            assert got["params_close"], f"{what}: parameters {got['max_param_diff']:.3g} from eager"
