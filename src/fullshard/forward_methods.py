"""Methods of a wrapped module that run like ``forward``: registered ones
(:func:`register_fsdp_forward_method`) and calls of the wrapped module that
bypass its unit's ``forward`` (Hugging Face ``generate()`` calling ``self``).
"""
from __future__ import annotations

import functools
import weakref

import torch.nn as nn

from .core import state
from .core.module import UnitModule


def register_fsdp_forward_method(module: nn.Module, method_name: str) -> None:
    """Make ``module.method_name(...)`` run like ``forward``: the unit's full
    parameters are gathered for the call and freed after it.

    Methods that call the wrapped module (Hugging Face ``generate()`` calls
    ``self(...)``) need no registration: a call of the wrapped module that
    does not come through the unit's ``forward`` is handled like one. This is
    for methods that use the parameters without calling the module.

    Raises:
        ValueError: ``module`` is not a unit, or has no such method.
    """
    if not isinstance(module, UnitModule):
        raise ValueError(f"register_fsdp_forward_method: {type(module).__name__} is not a "
                         "FullyShardedDataParallel unit or fully_shard module")
    # The wrapper's method lives on the wrapped module; fully_shard's on the module itself.
    target = module._modules.get("_fsdp_wrapped_module", module)
    inner = getattr(target, method_name, None)
    if not callable(inner):
        raise ValueError(f"register_fsdp_forward_method: {type(target).__name__} has "
                         f"no method {method_name!r}")
    unit_ref = weakref.ref(module)

    @functools.wraps(inner)
    def run(*args, **kwargs):
        unit = unit_ref()
        return unit._run_as_forward(inner, args, kwargs)

    object.__setattr__(module, method_name, run)


def _hook_direct_calls(unit: UnitModule, module: nn.Module) -> None:
    """Treat a call of the wrapped module that bypasses the unit's forward
    (``generate()`` calling ``self(...)``) like a call of the unit. The
    post-forward runs even when the call raised (``always_call``), as the
    unit's own forward does: a failed call must not leave the unit in
    FORWARD, where the next call would be taken for a nested one and run on
    parameters gathered before an optimizer step."""
    ref = weakref.ref(unit)
    began: list = []  # one entry per call of the wrapped module in progress: whether it ran the pre-forward

    def pre(mod, args, kwargs):
        u = ref()
        # Not a call made by the unit's own forward, nor one nested in a direct call that began the forward.
        mine = u is not None and not u._runtime.settings.forward_depth and not any(began)
        began.append(False)
        if not mine:
            return None
        u._lazy_init()
        out = state.pre_forward(u._runtime, args, kwargs)
        began[-1] = True
        return out

    def post(mod, args, kwargs, output):
        u = ref()
        if not began.pop() or u is None:
            return None
        return state.post_forward(u._runtime, output)

    module.register_forward_pre_hook(pre, with_kwargs=True)
    module.register_forward_hook(post, with_kwargs=True, always_call=True)
