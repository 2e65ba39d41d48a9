"""Usage patterns off the happy path: each gives DDP's result (losses,
gradients or None, final parameters) under FULL_SHARD, SHARD_GRAD_OP and
NO_SHARD and through ``fully_shard`` at 2 ranks, or raises one clear error."""
from __future__ import annotations

import pytest
import torch

from fullshard import memory_stats
from fullshard.core import collectives as C
from fullshard.core.module import unit_modules
from fullshard.core.state import TrainingState
from fullshard.core.unit import ShardedState
from tests.dist import patterns as P
from tests.dist.common import FULLY_SHARD, is_sharded, no_sync, shard
from tests.dist.harness import run_ranks

pytestmark = pytest.mark.fast  # every pattern is in `make test-fast`


class _Boom(RuntimeError):
    pass


def _raise(grad):
    raise _Boom("injected failure in backward")


def _fail_below(module):
    """Make backward raise once the gradient reaches ``module``'s input."""
    def pre(mod, args):
        args[0].register_hook(_raise)
    return module.register_forward_pre_hook(pre)


# ----------------------------------------------- 1. a backward that raises
def _skip_on_raise(model, opt, rank, step):
    x, y = P.batch(rank, step)
    if step == 1:
        # Fail after the nested unit's backward (its reduce-scatter is in
        # flight) and before the root's: the loop catches it and skips the batch.
        handle = _fail_below(P.inner(model))
        try:
            P.mse(model(x), y).backward()
            raise AssertionError("backward did not raise")
        except _Boom:
            pass
        finally:
            handle.remove()
        opt.zero_grad()
        return None
    loss = P.mse(model(x), y)
    loss.backward()
    return loss.detach()


def _skip_ref(model, opt, rank, step):
    if step == 1:
        return None  # DDP's result for a skipped batch: as if it never ran
    x, y = P.batch(rank, step)
    loss = P.mse(model(x), y)
    loss.backward()
    return loss.detach()


def _window_backward_raises(model, opt, rank, step):
    """In step 1, the second micro-batch of a no_sync window raises in backward after the nested unit's
    backward: the next forward raises once (the window was discarded, as zero_grad() would); the step then
    takes its synchronizing micro-batch alone."""
    if step == 1:
        for micro in (0, 1):
            handle = _fail_below(P.inner(model)) if micro == 1 else None
            x, y = P.batch(rank, step, micro)
            try:
                with no_sync(model):
                    P.mse(model(x), y).backward()
            except _Boom:
                assert micro == 1
            finally:
                if handle is not None:
                    handle.remove()
        with pytest.raises(RuntimeError, match="micro-batches were discarded"):
            model(x)
    return _window_ref(model, opt, rank, step)


def _window_ref(model, opt, rank, step):
    x, y = P.batch(rank, step, 2 if step == 1 else 0)
    loss = P.mse(model(x), y)
    loss.backward()
    return loss.detach()


def _interrupted(rank, world):
    out = {}
    out["backward_raises"] = P.compare(rank, _skip_on_raise, steps=5, ref_step_fn=_skip_ref)
    out["backward_raises_in_no_sync_window"] = P.compare(rank, _window_backward_raises, steps=3,
                                                         ref_step_fn=_window_ref)
    # A forward that raises, then normal training.
    def forward_raises(model, opt, rank, step):
        x, y = P.batch(rank, step)
        if step == 1:
            with pytest.raises(RuntimeError):
                model(torch.randn(4, 6))  # wrong width: raises inside the unit
            with no_sync(model):  # the model is idle again, as DDP's
                pass
            return None
        loss = P.mse(model(x), y)
        loss.backward()
        return loss.detach()
    out["forward_raises"] = P.compare(rank, forward_raises, steps=4, ref_step_fn=_skip_ref)

    def interrupt(m, a):
        raise KeyboardInterrupt  # not an Exception: torch runs no always_call forward hook for it

    def nested_forward_raises(model, opt, rank, step, hook=lambda m, a: _raise(None), error=_Boom):
        if step == 1:  # inside the nested unit, after its all-gather
            handle = P.inner(model).b.register_forward_pre_hook(hook)
            with pytest.raises(error):
                model(P.batch(rank, step)[0])
            handle.remove()
            with no_sync(model):  # idle again (the wrapper stayed busy after a KeyboardInterrupt)
                pass
            return None
        return _skip_ref(model, opt, rank, step)
    out["nested_forward_raises"] = P.compare(rank, nested_forward_raises, steps=4, ref_step_fn=_skip_ref)
    # A KeyboardInterrupt there left fully_shard's units counted as in forward: the next two iterations failed.
    out["nested_forward_interrupted"] = P.compare(
        rank, lambda *a: nested_forward_raises(*a, hook=interrupt, error=KeyboardInterrupt), steps=3,
        ref_step_fn=_skip_ref)
    # A graph kept with retain_graph=True across its optimizer step, or a load_state_dict between a forward and
    # its backward: one process and DDP refuse the backward (autograd's in-place check), so does fullshard
    # (core/stale_graph.py); training then goes on as DDP's.
    kept = {}

    def graph_kept_across_step(model, opt, rank, step):
        sharded = not isinstance(model, torch.nn.parallel.DistributedDataParallel)
        if id(model) in kept and sharded:
            with pytest.raises(RuntimeError, match="graph whose forward ran before the unit.s parameters were updated"):
                kept.pop(id(model)).backward()
        x, y = P.batch(rank, step)
        if step == 2 and sharded:  # a load_state_dict between a forward and its backward: the same
            loss = P.mse(model(x), y)
            model.load_state_dict(model.state_dict())
            with pytest.raises(RuntimeError, match="graph whose forward ran before the unit.s parameters were updated"):
                loss.backward()
        loss = P.mse(model(x), y)
        loss.backward(retain_graph=step == 0)
        if step == 0:
            kept[id(model)] = loss
        return loss.detach()
    out["graph_kept_across_step"] = P.compare(rank, graph_kept_across_step, steps=3)
    out["gan_steps_between_forward_and_backward"] = _gan(rank)

    # A gradient penalty (WGAN-GP, R1): a backward with create_graph=True to the input, then a backward through
    # the graph it built, which saved the full parameters (units stay gathered until then).
    def gradient_penalty(model, opt, rank, step):
        x, y = P.batch(rank, step)
        x.requires_grad_()
        out = model(x)
        g, = torch.autograd.grad(out.sum(), x, create_graph=True)
        loss = P.mse(out, y) + g.pow(2).sum()
        loss.backward()
        return loss.detach()
    out["gradient_penalty"] = P.compare(rank, gradient_penalty, steps=3)

    # Gradient hooks on parameters (param.register_hook), registered before wrapping (enc.a.weight) and
    # after (head.weight, on the parameter the model holds then): DDP runs them on each rank's local
    # gradient before averaging; fullshard on the unit's full gradient before the reduce-scatter.
    def hooked():
        model = P.make()
        model.enc.a.weight.register_hook(lambda g: g * 3.0)
        return model

    def hook_after_wrapping(model, opt, rank, step):
        if step == 0:
            for name, p in model.named_parameters():
                if name.endswith("head.weight"):
                    p.register_hook(lambda g: -g)
        x, y = P.batch(rank, step)
        loss = P.mse(model(x), y)
        loss.backward()
        return loss.detach()
    out["gradient_hooks"] = P.compare(rank, hook_after_wrapping, steps=2, make_fn=hooked)
    # After the interrupted iteration, the next forward starts clean.
    for how in (P.STRATEGIES[0], FULLY_SHARD):
        model = shard(P.make(), how, P.policy())
        x, y = P.batch(rank, 0)
        handle = _fail_below(P.inner(model))
        with pytest.raises(_Boom):
            P.mse(model(x), y).backward()
        handle.remove()
        units = unit_modules(model)
        assert any(u._runtime.state is not TrainingState.IDLE for u in units)
        model.zero_grad()
        P.mse(model(x), y).backward()
        for u in units:
            assert u._runtime.state is TrainingState.IDLE and u.unit.state is ShardedState.SHARDED, u.unit.name
        for n, p in model.named_parameters():
            if p.numel():  # a gradient exactly where the parameter was used
                assert (p.grad is None) == ("spare" in n or "extra" in n), (how, n)
    return out


def _gan(rank):
    """GAN training: the discriminator steps between the generator's forward and the generator loss's
    backward through it, which leaves the generator's graph valid (its parameters did not change): the same
    losses and parameters as DDP, no stale-graph error. Returns the largest difference to DDP."""
    def train(g, d):
        g_opt, d_opt = (torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (g, d))
        losses = []
        for step in range(3):
            x, real = P.batch(rank, step)
            fake = g(x)
            d_loss = d(torch.cat([fake.detach(), x[:, :2]], 1)).mean() - d(torch.cat([real, x[:, :2]], 1)).mean()
            d_loss.backward()
            d_opt.step()
            d_opt.zero_grad()
            g_loss = -d(torch.cat([fake, x[:, :2]], 1)).mean()
            g_loss.backward()
            g_opt.step()
            g_opt.zero_grad()
            d_opt.zero_grad()
            losses += [float(d_loss), float(g_loss)]
        return losses, [P.full_state(m)[0] for m in (g, d)]
    from torch.nn.parallel import DistributedDataParallel as DDP
    want = train(*(DDP(P.make(seed), find_unused_parameters=True) for seed in (0, 1)))
    worst = 0.0
    for how in P.WRAPPINGS:
        got = train(*(shard(P.make(seed), how, P.policy()) for seed in (0, 1)))
        torch.testing.assert_close(got, want, rtol=P.RTOL, atol=P.ATOL, msg=lambda m: f"{P.label(how)}: {m}")
        worst = max([worst] + [abs(a - b) for a, b in zip(got[0], want[0])])
    return worst


# ------------------------------------------- 2. no_grad / inference / checkpoint
def _branch(mode):
    def step(model, opt, rank, s):
        x, y = P.batch(rank, s)
        out, aux = model(x, branch=mode)
        loss = P.mse(out, y) + aux
        loss.backward()
        return loss.detach()
    return step


def _grad_modes(rank, world):
    out = {}
    for mode in ("no_grad", "inference_mode", "reentrant", "non_reentrant"):
        # DDP's reducer rejects reentrant checkpointing of a module with
        # unused parameters; recomputation does not change the result, so
        # DDP runs the non-reentrant form as the reference.
        ref = _branch("non_reentrant" if mode == "reentrant" else mode)
        out[mode] = P.compare(rank, _branch(mode), steps=3, ref_step_fn=ref)
    out["apply_activation_checkpointing_after_wrap"] = _checkpoint_after_wrap(rank)
    out["writes_to_gathered_parameters"] = _gathered_writes(rank)
    return out


def _gathered_writes(rank):
    """nn.Embedding(max_norm=...) renormalizes rows of its weight in forward; under no_grad the renorm of
    the gathered full weight was silently dropped at reshard (row norm 7.2 kept where the plain model has
    1.0). It raises now, where a shard group of one rank keeps the write (NO_SHARD: the full parameters are
    the shard); the unit then runs on."""
    import torch.nn as nn

    from fullshard.wrap import ModuleWrapPolicy

    torch.manual_seed(0)
    plain = nn.Sequential(nn.Embedding(10, 4, max_norm=1.0), nn.Linear(4, 2))
    with torch.no_grad():
        plain[0].weight.mul_(3)
    idx = torch.tensor([[1, 2, 3]])
    worst = 0.0
    for how in P.WRAPPINGS:
        model = shard(P._clone(plain), how, ModuleWrapPolicy({nn.Embedding}))
        with torch.no_grad():
            if how == P.STRATEGIES[2]:
                model(idx)
            else:
                with pytest.raises(RuntimeError, match="unit '.*': a full parameter was written in place while"):
                    model(idx)
            model[0].max_norm = None  # no more writes (on a wrapper, set through the unit): evaluation runs on
            out = model(idx)
        ref = P._clone(plain)
        with torch.no_grad():
            if how == P.STRATEGIES[2]:
                ref(idx)  # the renorm, kept as by the plain model
            ref[0].max_norm = None
            worst = max(worst, (out - ref(idx)).abs().max().item())
    assert worst == 0.0, worst
    return worst


def _checkpoint_after_wrap(rank):
    from torch.nn.parallel import DistributedDataParallel as DDP

    from fullshard import apply_activation_checkpointing
    from fullshard.models import TransformerBlock
    from tests.dist import models as M
    from tests.dist.common import train

    base = M.make_model("gpt")
    ref_losses, _ = train(DDP(M.clone(base)), "gpt", rank)
    worst = 0.0
    for how in (P.STRATEGIES[0], FULLY_SHARD):
        model = shard(M.clone(base), how, M.unit_policy("gpt"))
        apply_activation_checkpointing(model, check_fn=lambda m: isinstance(m, TransformerBlock))
        assert sum(type(m).__name__ == "CheckpointWrapper" for m in model.modules()) == 2
        C.reset_counts()
        losses, _ = train(model, "gpt", rank)
        # Recomputation reuses the backward gather: 2 per block + 1 root per step.
        assert C.COUNTS["all_gather"] == 5 * len(losses), (how, dict(C.COUNTS))
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=P.RTOL, atol=P.ATOL)
        worst = max([worst] + [abs(a - b) for a, b in zip(losses, ref_losses)])
    return worst


# ------------------------------------------------ 3-5. no_sync, unused parameters
def _accumulate(zero_after_first: str = "", skip_enc_last: bool = False, spare_on: tuple = (0,),
                extra_steps: tuple = (), reference: bool = False):
    """Two micro-batches per step, the first inside no_sync. With
    ``zero_after_first`` the gradients are zeroed after it on odd steps; the
    ``reference`` form (for DDP, whose reducer fails on zero_grad after
    no_sync with unused parameters) runs that micro-batch without backward,
    which is what discarding its gradient means."""
    def step(model, opt, rank, s):
        total = 0.0
        for micro in range(2):
            x, y = P.batch(rank, s, micro)
            discard = micro == 0 and zero_after_first and s % 2 == 1
            ctx = no_sync(model) if micro == 0 else _null()
            with ctx, torch.set_grad_enabled(not (discard and reference)):
                use_enc = not (skip_enc_last and micro == 1)
                out = model(x, use_enc=use_enc, use_spare=micro in spare_on, use_extra=s in extra_steps)
                loss = P.mse(out, y) / 2
                if loss.requires_grad:
                    loss.backward()
            total += float(loss)
            if discard and not reference:
                if zero_after_first == "optimizer_none":
                    opt.zero_grad(set_to_none=True)
                elif zero_after_first == "optimizer_zero":
                    opt.zero_grad(set_to_none=False)
                else:
                    model.zero_grad()
                if is_sharded(model):
                    _assert_stash_freed(model, zero_after_first)
        return torch.tensor(total)
    return step


def _assert_stash_freed(model, how):
    if how == "optimizer_zero":
        return  # in-place zeroing is seen at the next forward
    for name, entry in memory_stats(model).items():
        assert name == "pool" or entry["stashed_grad_bytes"] == 0, (how, name)


class _null:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def _no_sync(rank, world):
    out = {}
    ddp = dict(find_unused_parameters=True)
    for how in ("optimizer_none", "optimizer_zero", "model"):
        out[f"zero_grad_after_no_sync[{how}]"] = P.compare(
            rank, _accumulate(zero_after_first=how), ddp_kwargs=ddp,
            ref_step_fn=_accumulate(zero_after_first=how, reference=True))
    out["unit_only_in_no_sync_microbatch"] = P.compare(rank, _accumulate(skip_enc_last=True), ddp_kwargs=ddp)
    out["unused_params_grad_none"] = P.compare(rank, _accumulate(spare_on=(), extra_steps=(1,)), ddp_kwargs=ddp)
    out["param_used_in_some_microbatches"] = P.compare(rank, _accumulate(spare_on=(1,)), ddp_kwargs=ddp)

    def rank_dependent(model, opt, rank, s):  # used on rank 0 only: averaged with rank 1's zero
        x, y = P.batch(rank, s)
        loss = P.mse(model(x, use_spare=rank == 0, use_extra=rank == 1), y)
        loss.backward()
        return loss.detach()
    out["param_used_on_one_rank"] = P.compare(rank, rank_dependent, ddp_kwargs=ddp)
    return out


# ------------------------------------------------ 6. requires_grad after wrapping
def _requires_grad(rank, world):
    def step(model, opt, rank, s):
        if s == 1:
            P.inner(model).requires_grad_(False)
        if s == 3:
            P.inner(model).requires_grad_(True)
        x, y = P.batch(rank, s)
        C.reset_counts()
        loss = P.mse(model(x), y)
        loss.backward()
        # FULL_SHARD, and fully_shard (no sharding_strategy): the frozen unit leaves the reduce-scatter
        if is_sharded(model) and getattr(model, "sharding_strategy", P.STRATEGIES[0]) is P.STRATEGIES[0]:
            enc_numel = sum(p.numel() for p in P.Enc().parameters())
            rs_numel = C.BYTES["reduce_scatter"] // 4
            assert (rs_numel < enc_numel) == (s in (1, 2)), (s, rs_numel, enc_numel)
        return loss.detach()
    return {"requires_grad_changed": P.compare(rank, step, steps=5, ddp_kwargs=dict(find_unused_parameters=True))}


def test_interrupted_iterations():
    print(run_ranks(_interrupted, 2)[0])


def test_grad_modes_and_checkpointing():
    print(run_ranks(_grad_modes, 2)[0])


def test_no_sync_and_unused_parameters():
    print(run_ranks(_no_sync, 2)[0])


def test_requires_grad_after_wrapping():
    print(run_ranks(_requires_grad, 2)[0])
