"""fullshard's process-wide optimizer step hooks: one
``register_optimizer_step_pre_hook`` and one
``register_optimizer_step_post_hook`` registered with torch (each once, on
first use), which run the engine's callbacks in a fixed order.

[Note: optimizer step hooks]
Every ``optimizer.step()`` of every torch optimizer in the process runs,
before the step and in this order:

1. ``step count`` (core/unit.py): counts steps, so a unit kept gathered
   knows its shards may have changed (``Unit.kept_fresh``); added when a
   unit first records its shard versions. Counted before the step too: a
   step that raises, or whose own post-step hook raises (torch runs those
   before the global ones), runs no global post-step hook, yet may have
   written the shards.
2. ``replaced parameters`` (core/optim_guard.py): an optimizer holding
   original parameters that sharding replaced (made before wrapping) raises;
   added when the first unit is built.
3. ``sharded optimizer`` (core/optim_guard.py): a non-element-wise
   optimizer stepping on parameters spread over ranks raises; added with 2.
4. ``torch grad scaler`` (core/optim_guard.py): ``torch.amp.GradScaler``
   stepping over the wrapper's plain gradient shards raises; added with 2.
5. ``converted state dtype`` (core/convert.py): optimizer state made before
   a dtype conversion after wrapping raises; added at the first conversion.
6. ``unit steps`` (core/stale_graph.py): counts the step for each unit whose
   parameters it names, so a backward through a graph older than the step
   raises; added at the first forward.

and after the step:

1. ``step count`` again.

A callback's place in its list is fixed here, not by when it was added;
one that is not added yet is skipped. A pre-step callback that raises stops
the step (and the callbacks after it).
"""
from __future__ import annotations

import weakref
from typing import Any, Callable

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

StepHook = Callable[[torch.optim.Optimizer, tuple, dict], None]

PRE_STEP = ("step count", "replaced parameters", "sharded optimizer", "torch grad scaler", "converted state dtype",
            "unit steps")
"""The pre-step callbacks' names, in the order they run."""
POST_STEP = ("step count",)
"""The post-step callbacks' names, in the order they run."""

_PRE: dict[str, StepHook] = {}
_POST: dict[str, StepHook] = {}
_HANDLES: dict[str, Any] = {"pre": None, "post": None}


def add_pre_step(name: str, fn: StepHook) -> None:
    """Run ``fn(optimizer, args, kwargs)`` before every optimizer step, at
    ``name``'s place in :data:`PRE_STEP` (idempotent).

    Raises:
        ValueError: ``name`` is not in :data:`PRE_STEP`.
    """
    _add(_PRE, PRE_STEP, name, fn)
    if _HANDLES["pre"] is None:
        _HANDLES["pre"] = register_optimizer_step_pre_hook(_run_pre)


def add_post_step(name: str, fn: StepHook) -> None:
    """Run ``fn(optimizer, args, kwargs)`` after every optimizer step, at
    ``name``'s place in :data:`POST_STEP` (idempotent).

    Raises:
        ValueError: ``name`` is not in :data:`POST_STEP`.
    """
    _add(_POST, POST_STEP, name, fn)
    if _HANDLES["post"] is None:
        _HANDLES["post"] = register_optimizer_step_post_hook(_run_post)


def add_step_hooks(name: str, fn: StepHook) -> None:
    """:func:`add_pre_step` and :func:`add_post_step` of the same callback."""
    add_pre_step(name, fn)
    add_post_step(name, fn)


def per_optimizer(cache: "weakref.WeakKeyDictionary", optimizer: torch.optim.Optimizer,
                  compute: Callable[[torch.optim.Optimizer], Any]) -> Any:
    """``compute(optimizer)``, kept in ``cache`` (a ``WeakKeyDictionary`` of
    the caller's) until the optimizer's parameter groups change: what a
    callback learns from the parameters once, not at every step."""
    key = tuple((id(g["params"]), len(g["params"])) for g in optimizer.param_groups)
    seen = cache.get(optimizer)
    if seen is None or seen[0] != key:
        seen = (key, compute(optimizer))
        cache[optimizer] = seen
    return seen[1]


def _add(table: dict[str, StepHook], order: tuple[str, ...], name: str, fn: StepHook) -> None:
    if name not in order:
        raise ValueError(f"optimizer step hook {name!r}: not one of {order} (core/optim_hooks.py fixes the order)")
    table[name] = fn


def _run_pre(optimizer: torch.optim.Optimizer, args, kwargs) -> None:
    for name in PRE_STEP:
        fn = _PRE.get(name)
        if fn is not None:
            fn(optimizer, args, kwargs)
    return None


def _run_post(optimizer: torch.optim.Optimizer, args, kwargs) -> None:
    for name in POST_STEP:
        fn = _POST.get(name)
        if fn is not None:
            fn(optimizer, args, kwargs)
