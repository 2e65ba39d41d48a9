"""Activation checkpointing (recompute in backward) and activation offloading.

    from fullshard.activation_checkpointing import apply_activation_checkpointing
    apply_activation_checkpointing(model, check_fn=lambda m: isinstance(m, TransformerBlock))
    model = FullyShardedDataParallel(model, auto_wrap_policy=ModuleWrapPolicy({TransformerBlock}))

Each chosen submodule is replaced by a :class:`CheckpointWrapper` that runs it
under non-reentrant ``torch.utils.checkpoint.checkpoint``: forward keeps only
the wrapper's inputs; backward re-runs the forward to rebuild what it needs
(Chen et al., "Training Deep Nets with Sublinear Memory Cost", 2016, §3).

[Note: checkpointing composes with FSDP units]
Checkpointing may be applied before wrapping or after. Before, with
``ModuleWrapPolicy({TransformerBlock})`` the result is
``CheckpointWrapper(FSDP(TransformerBlock))``; with a policy on
``CheckpointWrapper`` it is ``FSDP(CheckpointWrapper(TransformerBlock))``,
which is also what applying it after wrapping gives (the unit's wrapped
module is replaced; the unit's shards and names do not change).
Either way the unit's pre-backward hook has already gathered its full
parameters, and exposed its grad-mode views, when backward reaches the
recomputation, and the engine's pre_forward (``rt.in_backward`` branch in
``core/state.py``) reuses that gather, so recomputation adds no all-gather:
FULL_SHARD keeps 2 per unit per step
(tests/dist/test_activation_checkpointing.py checks this).

Parameter names: the wrapper holds the module as ``_checkpoint_wrapped_module``
but that segment never shows: ``named_modules()`` yields the wrapped module
under the wrapper's own name (so ``named_parameters()`` / ``named_buffers()``
of any ancestor, FSDP units included, give the unwrapped model's names), and
state-dict hooks strip it from ``state_dict()`` keys and add it back on load.
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

_PREFIX = "_checkpoint_wrapped_module."


def offload_activations():
    """Context manager: tensors saved for backward inside it are kept in host
    memory and copied back for backward (``torch.autograd.graph.save_on_cpu``).

    Pinned host memory is used only when CUDA is available; on a CPU-only
    machine the saved tensors are already on the host and nothing is copied.
    """
    return torch.autograd.graph.save_on_cpu(pin_memory=torch.cuda.is_available())


class CheckpointWrapper(nn.Module):
    """Runs ``module`` under non-reentrant activation checkpointing.

    Args:
        module: the module whose intermediate activations are recomputed in
            backward instead of being kept from forward.
        offload_to_cpu: also keep the checkpointed inputs in host memory
            (see :func:`offload_activations`).

    Notes:
        Random ops (dropout) replay the forward's RNG state in recomputation
        (``preserve_rng_state=True``), so results equal the unwrapped module's.
    """

    def __init__(self, module: nn.Module, offload_to_cpu: bool = False):
        super().__init__()
        self._checkpoint_wrapped_module = module
        self.offload_to_cpu = offload_to_cpu
        # State-dict keys without our prefix, and loading accepts them back.
        self._register_state_dict_hook(_strip_prefix_hook)
        self._register_load_state_dict_pre_hook(_add_prefix_hook)

    @property
    def module(self) -> nn.Module:
        """The wrapped module."""
        return self._checkpoint_wrapped_module

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self._modules["_checkpoint_wrapped_module"], name)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        ctx = offload_activations() if self.offload_to_cpu else contextlib.nullcontext()
        with ctx:
            return checkpoint(self._checkpoint_wrapped_module, *args, use_reentrant=False,
                              preserve_rng_state=True, **kwargs)

    def named_modules(self, memo=None, prefix: str = "", remove_duplicate: bool = True):
        """This wrapper, then the wrapped module and its descendants under the
        SAME prefix (no ``_checkpoint_wrapped_module`` segment).

        ``nn.Module.named_parameters`` / ``named_buffers`` of any ancestor
        recurse through ``named_modules``, so this keeps every parameter's
        name equal to the unwrapped model's (for the plain model and inside
        FSDP units alike).
        """
        if memo is None:
            memo = set()
        if self in memo:
            return
        if remove_duplicate:
            memo.add(self)
        yield prefix, self
        yield from self._checkpoint_wrapped_module.named_modules(memo, prefix, remove_duplicate)


def _strip_prefix_hook(module: nn.Module, state_dict: dict, prefix: str, *args: Any) -> dict:
    for key in list(state_dict):
        if key.startswith(prefix + _PREFIX):
            state_dict[prefix + key[len(prefix + _PREFIX):]] = state_dict.pop(key)
    return state_dict


def _add_prefix_hook(state_dict: dict, prefix: str, *args: Any) -> None:
    for key in list(state_dict):
        if key.startswith(prefix) and not key.startswith(prefix + _PREFIX):
            state_dict[prefix + _PREFIX + key[len(prefix):]] = state_dict.pop(key)


def apply_activation_checkpointing(model: nn.Module, check_fn: Callable[[nn.Module], bool],
                                   offload_to_cpu: bool = False) -> nn.Module:
    """Replace, in place, every submodule of ``model`` for which ``check_fn`` is
    true with ``CheckpointWrapper(submodule)``.

    A chosen module's own descendants are not visited (no nested checkpoints).
    ``model`` itself is never replaced. It may be applied before wrapping with
    FSDP or after (torch's documented order): after wrapping, a chosen module
    inside a unit becomes the unit's ``CheckpointWrapper``-wrapped module (see
    [Note: checkpointing composes with FSDP units]).

    Args:
        model: the module to modify.
        check_fn: ``fn(module) -> bool``, e.g. ``lambda m: isinstance(m, TransformerBlock)``.
        offload_to_cpu: passed to each :class:`CheckpointWrapper`.
    Returns:
        ``model`` (modified in place).
    """

    def visit(parent: nn.Module) -> None:
        for name, child in list(parent.named_children()):
            if isinstance(child, CheckpointWrapper):
                continue
            if check_fn(child):
                setattr(parent, name, CheckpointWrapper(child, offload_to_cpu=offload_to_cpu))
            else:
                visit(child)

    visit(model)
    return model


__all__ = ["CheckpointWrapper", "apply_activation_checkpointing", "offload_activations"]
