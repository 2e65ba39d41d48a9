"""AdamW whose CPU step of each offloaded unit overlaps the rest of backward.

[Note: overlapped offload step]
With CPU offload each unit's gradient shards reach the host one unit at a
time during backward (core/offload.py [Note: offloaded gradient buffers]).
:class:`OffloadAdamW` registers a grads-ready callback on every unit: when
a unit's reduced gradient is in ``.grad``, a worker thread waits for its
copy to land and steps that unit's parameters with torch's AdamW kernel
(``fused=True``: one multi-threaded pass over the shards), while backward
goes on with the next units. ``opt.step()`` after ``backward()`` waits for
those steps and steps whatever backward did not (parameters outside every
unit, a unit with gradients left from an earlier backward it did not
reach). Each element's update depends only on that element's gradient and
state, so stepping unit by unit gives the bits one ``AdamW.step()`` after
backward gives.

With ``max_norm`` the global gradient norm is needed before the steps.
Each unit is still stepped during backward, speculatively: first its
shards and AdamW state are copied to host buffers (optim/snapshots.py:
allocated once and reused, 3x the shards' bytes for fp32 AdamW, 4x with
amsgrad), and the norm of each of its gradient shards is taken as
``clip_grad_norm_`` takes it (core/norms.py :func:`grad_norm`). ``opt.step()``
then only adds those norms in ``clip_grad_norm_``'s order and all-reduces
the scalar, so the norm has the same bits. If torch's coefficient
``min(1, max_norm / (norm + 1e-6))`` is exactly 1 (the norm is at most
``max_norm``, less 1e-6), the gradients clip to themselves and the steps
taken stand. Otherwise (clipped, or a nan / inf norm) every unit is put
back from its copy, the gradients are scaled as ``clip_grad_norm_`` scales
them, and every unit is stepped again: the bits of the non-overlapped step,
paid for with one more pass over the state. It pays when most steps are not
clipped; ``speculate=False`` waits for ``opt.step()`` instead (no copies).
A forward, or ``zero_grad()``, before ``opt.step()`` puts the speculative
steps back first (the forward reads the parameters before the update; a
zeroed iteration takes no step), and those units step at ``opt.step()``.

Gradient accumulation: micro-batches under ``no_sync()`` /
``set_requires_gradient_sync(False)`` reduce nothing, so only the
synchronizing backward steps. A unit whose gradient arrives a second time
before ``opt.step()`` (two synchronizing backwards per step, or a unit
reduced twice in one backward) raises without ``max_norm`` (its step has
already been taken); with it, the speculative steps are put back and those
units step at ``opt.step()``.
The next forward of the model waits for the steps in flight (a forward
pre-hook), as do ``zero_grad``, ``state_dict`` and ``load_state_dict``.
"""
from __future__ import annotations

import concurrent.futures
import weakref
from typing import Optional

import torch
import torch.nn as nn
from torch.optim.adam import adam

from ..core import collectives, norms, offload, optim_guard, state
from ..core.module import UnitModule, unit_modules
from .snapshots import Snapshots


def _root(model: nn.Module, what: str, init: bool = True):
    """The root runtime of ``model``, a root ``fully_shard`` / ``FullyShardedDataParallel``
    module. ``init=False`` (construction): before the first forward, when no
    root is known yet, only the type is checked (initializing here would
    make a nested unit a root); :meth:`OffloadAdamW.step` checks again."""
    if not isinstance(model, UnitModule):
        raise TypeError(f"{what} takes the root fully_shard / FullyShardedDataParallel module, got "
                        f"{type(model).__name__}")
    rt = model._runtime
    if not init and rt.root is None:
        return rt
    model._lazy_init()
    if not rt.is_root:
        raise ValueError(f"[rank {collectives.rank()}] {what}: pass the root module (the outermost fully_shard / "
                         "FullyShardedDataParallel one), not a nested unit")
    return rt


class OffloadAdamW(torch.optim.AdamW):
    """``torch.optim.AdamW`` over a CPU-offloaded model, each unit stepped on
    the host as soon as its gradient shards arrive during backward (see
    [Note: overlapped offload step]). Use it as an optimizer::

        opt = fullshard.optim.OffloadAdamW(model, lr=3e-4, max_norm=1.0)
        for batch in data:
            model(batch).sum().backward()   # units step as their gradients land
            opt.step()                      # waits for them (clips, then steps, with max_norm)
            opt.zero_grad()

    The parameters after ``opt.step()`` are bit for bit those of
    ``backward()``, then ``fullshard.clip_grad_norm_(model, max_norm,
    norm_type)`` when ``max_norm`` is set, then
    ``torch.optim.AdamW(params, fused=fused, ...).step()``; its
    ``state_dict()`` is that optimizer's.

    Args:
        model: the root module; every unit must keep its shards on the host
            (``CPUOffloadPolicy()`` / ``CPUOffload(offload_params=True)``),
            unless the model computes on the CPU.
        lr: as ``torch.optim.AdamW``'s ``lr``.
        betas: as ``torch.optim.AdamW``'s ``betas``.
        eps: as ``torch.optim.AdamW``'s ``eps``.
        weight_decay: as ``torch.optim.AdamW``'s ``weight_decay``.
        amsgrad: as ``torch.optim.AdamW``'s ``amsgrad``.
        maximize: as ``torch.optim.AdamW``'s ``maximize``.
        max_norm: clip the global gradient norm to it before stepping
            (``float("inf")``: only measure it); None: no clipping.
        norm_type: p of the clipping norm.
        fused: ``torch.optim.AdamW``'s ``fused`` (True: one fused kernel
            per dtype; False: its ``foreach`` path).
        params: parameters or parameter groups (dicts, as torch optimizers
            take them) of ``model``; None: ``model.parameters()``.
        speculate: with ``max_norm``, step each unit during backward and
            redo the steps when the norm clips (False: wait for ``opt.step()``).

    Attributes:
        grad_norm: with ``max_norm``, the last step's norm before clipping
            (0-dim fp32, what ``clip_grad_norm_`` returns).
        unit_steps_in_backward: units stepped during a backward (a count).
        redone_steps: ``opt.step()`` calls that put speculative steps back and redid them.
    Raises:
        TypeError: ``model`` is not a ``fully_shard`` / wrapper module.
        ValueError: a nested unit; a unit that keeps its shards on an
            accelerator; fp16 parameters or gradients (a gradient scaler's
            inf check must precede the step).
    """

    steps_in_backward = True
    """Units step during backward: no gradient scaler can drive it (``ShardedGradScaler`` refuses it)."""

    def __init__(self, model: nn.Module, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 1e-2, amsgrad: bool = False, *, maximize: bool = False,
                 max_norm: Optional[float] = None, norm_type: float = 2.0, fused: bool = True,
                 params=None, speculate: bool = True):
        _root(model, "OffloadAdamW", init=False)
        units = [m.unit for m in unit_modules(model)]
        for unit in units:
            if not unit.cfg.offload_params and unit.cfg.compute_device.type != "cpu":
                raise ValueError(f"OffloadAdamW: unit '{unit.name}' keeps its shards on {unit.cfg.compute_device}; "
                                 "wrap with CPUOffloadPolicy() / CPUOffload(offload_params=True), or use "
                                 "torch.optim.AdamW")
            if torch.float16 in (unit.compute_dtype, unit.reduce_dtype, unit.grad_dtype):
                raise ValueError(f"OffloadAdamW: unit '{unit.name}' computes or reduces in float16, which needs a "
                                 "gradient scaler whose inf check must come before any step; use bfloat16, or "
                                 "torch.optim.AdamW with the scaler")
        super().__init__(model.parameters() if params is None else params, lr=lr, betas=betas, eps=eps,
                         weight_decay=weight_decay, amsgrad=amsgrad, maximize=maximize, fused=fused or None,
                         foreach=None if fused else True)
        self.max_norm, self.norm_type = max_norm, float(norm_type)
        self.grad_norm: Optional[torch.Tensor] = None
        self.unit_steps_in_backward = self.redone_steps = 0
        self._speculate = max_norm is None or speculate
        self._model = weakref.ref(model)
        self._pool: Optional[concurrent.futures.ThreadPoolExecutor] = None
        self._jobs: list[concurrent.futures.Future] = []
        self._stepped: dict[int, str] = {}  # id(unit) -> name: units whose gradient arrived since step()
        self._deferred: set[int] = set()  # id(unit): speculative steps put back; they step at step()
        self._done: dict[int, torch.Tensor] = {}  # id -> parameter stepped since the last step()
        # id(parameter) -> (parameter, fingerprint of its .grad when stepped during backward): a gradient
        # changed afterwards (a clip, a scaler's unscale_) came too late for that step.
        self._versions: dict[int, tuple] = {}
        self._known: dict[int, tuple] = {}  # id(gradient shard) -> (it, its norm): norms.reduced_norm's known
        self._saved = Snapshots()  # what the speculative steps (max_norm) overwrote
        self._hyper: Optional[list[dict]] = None  # the group settings this iteration's unit steps used
        me = weakref.ref(self)

        def ready(unit, me=me):
            opt = me()
            if opt is not None:
                opt._unit_ready(unit)
        for unit in units:
            offload.on_grads_ready(unit, me, ready)
        self._handle = model.register_forward_pre_hook(lambda *_: me() and me()._before_forward(), prepend=True)

    # ------------------------------------------------------------ backward
    def _unit_ready(self, unit) -> None:
        """A unit's gradient is in ``.grad`` (possibly still landing): step it now (speculatively with
        max_norm), or at step()."""
        if id(unit) in self._stepped and self.max_norm is None:
            raise RuntimeError(
                f"[rank {collectives.rank()}] OffloadAdamW: unit '{unit.name}' got a gradient again before "
                "opt.step(); it steps each unit in the backward that reduces the unit's gradient, so call "
                "opt.step() after every synchronizing backward and accumulate micro-batches under no_sync() "
                "(set_requires_gradient_sync(False))")
        if id(unit) in self._stepped and id(unit) not in self._deferred and \
                any(id(s.sharded) in self._done for s in unit.slots):
            # Reduced twice in one backward (reentrant checkpointing recomputing it in two segments): the
            # second recomputation may have gathered the shards this speculative step had changed.
            self._undo(defer=False)
            raise RuntimeError(
                f"[rank {collectives.rank()}] OffloadAdamW: unit '{unit.name}' got a gradient again in the "
                "backward that stepped it speculatively, so a recomputation in between may have run on the "
                "stepped parameters; pass speculate=False (units then step at opt.step()), or checkpoint "
                "non-reentrantly")
        if id(unit) in self._stepped and id(unit) not in self._deferred:
            self._undo()  # its gradient grows after its speculative step: put every such step back
        self._stepped[id(unit)] = unit.name
        if not self._speculate or id(unit) in self._deferred:
            return
        if unit.state.name == "UNSHARDING":  # an all-gather in flight still reads the shard
            unit.wait_unshard()
        params = [s.sharded for s in unit.slots if s.sharded.grad is not None]
        self._done.update((id(p), p) for p in params)
        if self._hyper is None:  # read here, on the caller's thread: step() checks nothing changed since
            self._hyper = _hyperparameters(self.param_groups)
        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="fullshard-offload-adamw")
        self._jobs.append(self._pool.submit(self._step_unit, unit, params, self._hyper))

    def _step_unit(self, unit, params: list[torch.Tensor], hyper: list[dict]) -> None:
        offload.wait(unit)  # its gradient copy has landed on the host
        self._versions.update((id(p), (p, _fingerprint(p))) for p in params)
        if self.max_norm is not None:
            self._saved.save(self.state, params)
            self._known.update((id(g), (g, norms.grad_norm(g, self.norm_type))) for g in norms.counted_grads(unit))
        self._update(params, hyper)
        self.unit_steps_in_backward += 1

    def _drain(self) -> None:
        """Wait for the unit steps in flight; re-raise the first failure."""
        jobs, self._jobs = self._jobs, []
        errors = [e for e in (job.exception() for job in jobs) if e is not None]
        if errors:
            raise errors[0]

    def _undo(self, defer: bool = True) -> None:
        """Put the speculative steps taken since step() back; ``defer``: their units step at step()
        (else the iteration is over: nothing of it is kept)."""
        self._drain()
        self._saved.restore(self.state)
        self._deferred = set(self._stepped) | self._deferred if defer else set()
        self._done, self._versions, self._known, self._hyper = {}, {}, {}, None
        if not defer:
            self._stepped = {}

    def _forget_iteration(self) -> None:
        """Forget which units this iteration stepped (after step(), or an iteration dropped by zero_grad())."""
        self._stepped, self._done, self._versions, self._known, self._deferred = {}, {}, {}, {}, set()
        self._hyper = None

    def _before_forward(self) -> None:
        self._drain()
        if self._done and self.max_norm is not None:
            self._undo()  # the forward reads the parameters before this update

    @torch.no_grad()
    def _update(self, params: list[torch.Tensor], hyper: Optional[list[dict]] = None) -> None:
        """``AdamW.step()`` restricted to ``params`` (each group's settings, or ``hyper``'s copy of them;
        the same kernel and arguments)."""
        ids = {id(p) for p in params}
        for i, group in enumerate(self.param_groups):
            if hyper is not None:
                group = dict(hyper[i], params=group["params"])
            mine = dict(group, params=[p for p in group["params"] if id(p) in ids])
            if not mine["params"]:
                continue
            p_, g_, m_, v_, vmax_, steps = [], [], [], [], [], []
            has_complex = self._init_group(mine, p_, g_, m_, v_, vmax_, steps)
            beta1, beta2 = group["betas"]
            adam(p_, g_, m_, v_, vmax_, steps, amsgrad=group["amsgrad"], has_complex=has_complex, beta1=beta1,
                 beta2=beta2, lr=group["lr"], weight_decay=group["weight_decay"], eps=group["eps"],
                 maximize=group["maximize"], foreach=group["foreach"], capturable=group["capturable"],
                 differentiable=group["differentiable"], fused=group["fused"],
                 decoupled_weight_decay=group["decoupled_weight_decay"])

    # ------------------------------------------------------------ public
    @torch.no_grad()
    def step(self, closure=None):
        """Finish this iteration's step: wait for the units stepped during
        backward; with ``max_norm``, all-reduce the norm and, when it clips,
        put those steps back, clip and step every unit again; then step
        every parameter with a gradient that was not stepped yet.

        Raises:
            ValueError: a closure (backward has already run).
            RuntimeError: the model is in forward or backward; a gradient
                scaler drives the step (fp16 is refused); a gradient changed
                after its unit was stepped; a unit step failed.
        """
        if closure is not None:
            raise ValueError("OffloadAdamW.step() takes no closure: the steps follow the backward you ran")
        if getattr(self, "grad_scale", None) is not None or getattr(self, "found_inf", None) is not None:
            raise RuntimeError("OffloadAdamW cannot be stepped through a gradient scaler: its units step before "
                               "the scaler's inf check; train in bfloat16 or float32 without one")
        model, done, versions, known, hyper = self._model(), self._done, self._versions, self._known, self._hyper
        try:
            self._drain()
        finally:
            self._forget_iteration()
        if done and not _same_hyperparameters(hyper, self.param_groups):
            if self.max_norm is None:  # the steps taken during backward are final
                raise RuntimeError(
                    f"[rank {collectives.rank()}] OffloadAdamW: lr, weight_decay or another setting of a parameter "
                    "group changed after units were stepped with the old one during backward; change settings "
                    "before the forward (after step()), or pass max_norm=... so such steps are redone")
            self._saved.restore(self.state)  # put the steps back; every unit steps below with the new settings
            self.redone_steps += 1
            done = {}
        changed = next((p for p, v in versions.values() if not _same(_fingerprint(p), v)), None)
        if changed is not None:
            self._saved.restore(self.state)  # with max_norm: no step of this iteration stays
            raise RuntimeError(
                f"[rank {collectives.rank()}] OffloadAdamW: a gradient changed after it was stepped during backward "
                f"(shape {tuple(changed.shape)}; a clip_grad_norm_, a scaler's unscale_ or zero_grad before step()), "
                "so that step did not see the change; pass max_norm=... to OffloadAdamW to clip, and change "
                "gradients only with a torch.optim.AdamW")
        if model is not None:
            rt = _root(model, "OffloadAdamW.step()")
            state.require_idle(rt.root, "OffloadAdamW.step()")
            if self.max_norm is not None:
                params = list(model.parameters())
                self.grad_norm = norms.root_norm(rt, params, self.norm_type, known)
                coef = norms.clip_coef(self.grad_norm, self.max_norm)
                if not bool(coef == 1.0):  # clipped, or a nan / inf norm: redo every step with clipped gradients
                    if done:
                        self._saved.restore(self.state)
                        self.redone_steps += 1
                    done = {}
                    norms.scale_grads_(params, coef)
        self._saved.forget()
        self._update([p for g in self.param_groups for p in g["params"] if p.grad is not None and id(p) not in done])
        return None

    def zero_grad(self, set_to_none: bool = True) -> None:
        """``AdamW.zero_grad``; gradients dropped before :meth:`step` drop the iteration's step: with
        ``max_norm`` the units stepped during backward are put back.

        Raises:
            RuntimeError: without ``max_norm``, units were stepped during backward and :meth:`step` did not
                run (their steps are final: the iteration stays partly applied). Raised once: the next
                iteration starts afresh.
        """
        self._drain()
        final = sorted(self._stepped.values()) if self._done and self.max_norm is None else []
        if self._done and self.max_norm is not None:
            self._undo(defer=False)  # gradients dropped before step(): this iteration takes no step
        self._forget_iteration()
        super().zero_grad(set_to_none)
        if final:
            raise RuntimeError(
                f"[rank {collectives.rank()}] OffloadAdamW: zero_grad() before step() completed, but units {final} "
                "were already stepped during backward, and without max_norm those steps are final: this "
                "iteration is partly applied; call step() after every synchronizing backward (with max_norm "
                "set, steps taken during backward are put back when the iteration is dropped)")

    def state_dict(self):
        self._drain()
        return super().state_dict()

    def load_state_dict(self, state_dict) -> None:
        self._drain()
        super().load_state_dict(state_dict)


def _hyperparameters(groups: list[dict]) -> list[dict]:
    """A copy of each parameter group's settings (tensors cloned), without its parameters."""
    return [{k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in g.items() if k != "params"}
            for g in groups]


def _same_hyperparameters(seen: Optional[list[dict]], groups: list[dict]) -> bool:
    now = _hyperparameters(groups)
    if seen is None:
        return True
    if len(seen) != len(now) or any(a.keys() != b.keys() for a, b in zip(seen, now)):
        return False
    return all(_equal(a[k], b[k]) for a, b in zip(seen, now) for k in a)


def _equal(x, y) -> bool:
    if isinstance(x, torch.Tensor) or isinstance(y, torch.Tensor):  # a tensor lr (capturable)
        return isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor) and torch.equal(x, y)
    return x == y


_STRIDE = 61  # every 61st element: about 2% of a pass over the gradient


def _fingerprint(p: torch.Tensor) -> Optional[tuple]:
    """``p.grad``'s in-place version counter and a strided sample of its (local) values; None
    without a gradient. The sample catches writes the counter misses (in-place foreach ops on
    DTensor gradients leave both counters alone): a clip scales every element, so it changes
    the sample unless every sampled element is 0, when the step is unchanged anyway."""
    g = p.grad
    if g is None:
        return None
    local = getattr(g, "_local_tensor", g)
    return g._version, local._version, local.detach().reshape(-1)[::_STRIDE].clone()


def _same(a: Optional[tuple], b: Optional[tuple]) -> bool:
    if a is None or b is None:
        return a is b
    return a[:2] == b[:2] and torch.equal(a[2], b[2])


optim_guard.shard_aware(OffloadAdamW)  # element-wise: stepping rows gives the whole tensor's update
