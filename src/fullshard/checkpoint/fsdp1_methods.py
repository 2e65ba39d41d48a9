"""The state-dict methods of ``FullyShardedDataParallel`` (torch FSDP1's):
``state_dict`` / ``load_state_dict`` through ``nn.Module``'s own walk
(``module_hooks.py``), the state-dict type (``state_dict.py``) and the
optimizer state by name (``optim.py``). A mixin, so the front door stays thin.
"""
from __future__ import annotations

import contextlib

import torch
import torch.nn as nn

from ..core import collectives
from ..core.module import unit_modules
from . import module_hooks, optim as optim_state, state_dict as state_dicts


class StateDictMethods:
    """Mixin of ``FullyShardedDataParallel`` (placed before ``nn.Module`` in
    its bases: ``state_dict`` and ``load_state_dict`` call ``nn.Module``'s)."""

    def state_dict(self, *args, destination=None, prefix: str = "", keep_vars: bool = False):
        """``nn.Module.state_dict`` of the unwrapped model: full tensors under
        the original names (default), DTensor shards under
        ``FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT)``, or
        each unit's flat shard under LOCAL_STATE_DICT. Extra state, state-dict
        hooks and ``keep_vars`` behave as on the plain model. On a nested unit:
        that unit's subtree, under names relative to it. See
        ``checkpoint/module_hooks.py`` [Note: state dicts through nn.Module].

        Raises:
            RuntimeError: during forward or backward.
            NotImplementedError: SHARDED_STATE_DICT of a HYBRID_SHARD unit.
        """
        try:
            return super().state_dict(*args, destination=destination, prefix=prefix, keep_vars=keep_vars)
        finally:
            self._restore_registered()

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """``nn.Module.load_state_dict`` of the unwrapped model: a plain model's
        (full), a sharded or a local state dict, per the state-dict type.
        Each rank copies its own rows into its shards; a load that raises
        changes no shard.

        Raises:
            RuntimeError: with ``strict``, missing or unexpected keys; any
                shape mismatch (as ``nn.Module.load_state_dict`` words them,
                prefixed with the rank); during forward or backward.
            ValueError: ``assign=True``; a LOCAL_STATE_DICT of another world size.
        """
        if assign:
            raise ValueError("FullyShardedDataParallel.load_state_dict: assign=True is not supported "
                             "(values are copied into the shards); call it without assign")
        try:
            with module_hooks.deferred_row_copies(immediate=module_hooks.has_own_load_post_hooks(self)):
                return super().load_state_dict(state_dict, strict)
        except RuntimeError as e:
            if str(e).startswith("[rank"):
                raise
            raise RuntimeError(f"[rank {collectives.rank()}] {e}") from None
        finally:
            self._restore_registered()

    def _restore_registered(self) -> None:
        """Register the sharded parameters again on every unit a state-dict
        call that raised left with other values (see module_hooks' Note)."""
        for u in unit_modules(self):
            module_hooks.forget_load(u)
            u.unit.restore_all_params()

    @staticmethod
    @contextlib.contextmanager
    def state_dict_type(module: nn.Module, state_dict_type, state_dict_config=None,
                        optim_state_dict_config=None):
        """Context: every unit in ``module`` uses ``state_dict_type`` (a
        :class:`StateDictType`) and the configs, then the previous setting.

        Raises:
            RuntimeError: a config of another state-dict type (as torch FSDP1).
            ValueError: not a StateDictType; no FullyShardedDataParallel unit in ``module``.
        """
        prev = state_dicts.set_state_dict_type(module, state_dict_type, state_dict_config, optim_state_dict_config)
        try:
            yield
        finally:
            state_dicts.restore(module, prev)

    @staticmethod
    def set_state_dict_type(module: nn.Module, state_dict_type, state_dict_config=None,
                            optim_state_dict_config=None):
        """Set the state-dict type of every unit in ``module``; returns the
        previous settings. Raises as :meth:`state_dict_type`."""
        return state_dicts.set_state_dict_type(module, state_dict_type, state_dict_config, optim_state_dict_config)

    def _fqn_modifiers(self) -> dict:
        """torch.distributed.checkpoint.state_dict's hook for modules whose
        state-dict names skip a child (none: names are cleaned already); it
        refuses that API's optimizer calls (see
        ``state_dict.refuse_torch_optimizer_api``)."""
        state_dicts.refuse_torch_optimizer_api(self)
        return {}

    @staticmethod
    def optim_state_dict(model: nn.Module, optim: torch.optim.Optimizer) -> dict:
        """Optimizer state by original parameter name, full or sharded per the state-dict type."""
        return optim_state.optim_state_dict(model, optim)

    @staticmethod
    def optim_state_dict_to_load(model: nn.Module, optim: torch.optim.Optimizer, optim_state_dict: dict) -> dict:
        """A by-name optimizer state dict (any world size) as ``optim.load_state_dict`` input."""
        return optim_state.optim_state_dict_to_load(model, optim, optim_state_dict)
