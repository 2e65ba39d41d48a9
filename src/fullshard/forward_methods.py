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
    (``generate()`` calling ``self(...)``) like a call of the unit."""
    ref = weakref.ref(unit)

    def pre(mod, args, kwargs):
        u = ref()
        if u is None or u._runtime.settings.forward_depth:  # called by the unit's own forward
            return None
        u._lazy_init()
        if u._runtime.state is state.TrainingState.FORWARD:  # a nested call of the same module
            return None
        return state.pre_forward(u._runtime, args, kwargs)

    def post(mod, args, kwargs, output):
        u = ref()
        if u is None or u._runtime.settings.forward_depth or u._runtime.state is not state.TrainingState.FORWARD:
            return None
        return state.post_forward(u._runtime, output)

    module.register_forward_pre_hook(pre, with_kwargs=True)
    module.register_forward_hook(post, with_kwargs=True)
