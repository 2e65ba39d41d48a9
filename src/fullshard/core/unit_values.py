"""The value-replacing half of :class:`fullshard.core.unit.Unit`: a dtype
conversion of the master shard after wrapping (``model.double()``), and
taking back values that ``nn.Module._apply`` (``to_empty``, ``.to()``) or
``load_state_dict(assign=True)`` registered in place of the shards
(``fully_shard``).

A mixin, like :class:`fullshard.core.unit_grads.UnitGrads`; it uses the
unit's ``slots``, ``layout``, ``flat_shard``, ``_new_shard``,
``_set_shard`` and ``_check_sharded``.
"""
from __future__ import annotations

from typing import Callable

import torch

from . import collectives, flat


class UnitValues:
    """Value replacement of a unit (see the module docstring)."""

    def convert(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> bool:
        """Apply an ``nn.Module._apply`` function (``.double()``, ``.half()``,
        ``.to(dtype)``) to the master shard: ``flat_shard`` becomes
        ``fn(flat_shard)``, each sharded parameter (the same ``nn.Parameter``
        object, so an optimizer holding it keeps working) a view of it, and
        gradients, the compute, reduce and gradient dtypes that default to the
        master dtype, and ``flat_full`` follow. The caller checks the unit is
        idle, resharded and holds no ``no_sync`` stash.

        Returns:
            True when ``flat_full`` was replaced (hooks on it must be re-armed).
        Raises:
            RuntimeError: ``fn`` moves the shard to another device, changes
                its shape, or makes it a non-floating-point dtype.
        """
        self._check_sharded("convert its parameters")
        old = self.flat_shard
        new = fn(old)
        if new is old:  # nothing to convert; share_memory_() may have moved the storage
            self._record_view_ptrs()
            return False
        if new.device != old.device or new.shape != old.shape or not new.is_floating_point():
            raise RuntimeError(
                f"[rank {collectives.rank()}] unit '{self.name}': converting the parameters to "
                f"{new.dtype}/{new.device} (shape {tuple(new.shape)}) after wrapping is not supported; only a "
                "floating-point dtype change on the same device is (convert the model before "
                "FullyShardedDataParallel instead)")
        if old.is_pinned() and not new.is_pinned():
            new = new.pin_memory()
        self._set_shard(new)
        for sp in self.sharded_params:
            if sp.grad is not None and sp.grad.dtype != self.grad_dtype:
                sp.grad.data = sp.grad.to(self.grad_dtype)
        return True

    def adopt(self) -> bool:
        """Take back what ``nn.Module._apply`` (``to_empty``, ``.to(dtype)``)
        or ``load_state_dict(assign=True)`` registered in place of the
        sharded parameters (``fully_shard``, which lets both run on the
        model as torch FSDP2 does): each registered value is copied into the
        flat shard and the registered parameter made a view of it again. A
        meta shard (``fully_shard`` of a meta module) is allocated on the
        device the values now live on, in their dtype.

        The registered parameter objects stay: an object assigned in place of
        one gives it its value and dtype (``torch.utils.swap_tensors``), so
        an optimizer made before ``load_state_dict(assign=True)`` still holds
        the parameters the model trains.

        Returns:
            True when ``flat_full`` was replaced (hooks on it must be re-armed).
        Raises:
            ValueError: the new values of one unit differ in dtype or device;
                an assigned value is not this rank's shard.
        """
        self._check_sharded("adopt new parameter values")
        for slot in self.slots:
            new = next((v for v in (m._parameters.get(a) for m, a in slot.owners)
                        if v is not None and v is not slot.sharded), None)
            if new is not None:  # load_state_dict(assign=True) registered another object
                wrong = slot.assigned_mismatch(new)
                if wrong:
                    raise ValueError(f"[rank {collectives.rank()}] unit '{self.name}': {wrong}")
                # The registered object, which optimizers hold, takes the new value.
                torch.utils.swap_tensors(slot.sharded, new)
            for module, attr in slot.owners:
                module._parameters[attr] = slot.sharded
        values = [slot.registered_local() for slot in self.slots]
        if all(v is s.local for v, s in zip(values, self.slots)):
            return False
        kinds = {(v.dtype, v.device) for v in values}
        if len(kinds) > 1:
            raise ValueError(f"[rank {collectives.rank()}] unit '{self.name}': its parameters now have different "
                             f"dtypes or devices {sorted(map(str, kinds))}; one unit needs one of each")
        dtype, device = kinds.pop() if kinds else (self.flat_shard.dtype, self.flat_shard.device)
        replace = self.flat_shard.is_meta or dtype != self.flat_shard.dtype or (
            device != self.flat_shard.device and not self.cfg.offload_params)
        if device.type != "meta" and not self.cfg.offload_params and device != self.cfg.compute_device:
            raise ValueError(f"[rank {collectives.rank()}] unit '{self.name}': parameters moved to {device}, but the "
                             f"unit computes on {self.cfg.compute_device}; keep them on the mesh's device")
        target = self._new_shard(dtype, torch.device("meta") if device.type == "meta" else None) \
            if replace else self.flat_shard
        if target.device.type != "meta":
            with torch.no_grad():
                for view, value in zip(flat.shard_views(target, self.layout, self.rank), values):
                    if not value.is_meta and value is not view:
                        view.copy_(value)
        self._set_shard(target)
        return True
