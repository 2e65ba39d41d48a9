"""Frozen all-gather-extension parameters gathered in their own format only
(a QLoRA base: torchao ``NF4Tensor`` weights travel as packed bytes).

[Note: packed parts]
A frozen parameter whose class defines ``fsdp_pre_all_gather`` /
``fsdp_post_all_gather`` (core/extensions.py [Note: all-gather extensions])
has no place in a flat shard: its values are the subclass's inner tensors
(NF4: 4-bit codes packed two per byte, int8 block scales, per-scaler-block
factors), which a plain buffer cannot hold without dequantizing them, and a
dequantized copy would cost more memory than the base it replaces. Such
parameters form a :class:`PackedPart` of their unit, one more frozen part
next to the dtype parts of core/mixed.py, moving with the main unit as they
do. The part's shard is each parameter's own ``torch.chunk`` rows of the
subclass (``extensions.local_shard``); its flat shard is a meta tensor (the
layout still gives every parameter its shape and placement, no memory), and
its unshard issues only the extension all-gathers, so what travels is the
inner tensors' bytes (NF4: about 0.28 of bf16's). Modules read the
post-hook's tensor (an ``NF4Tensor`` of the full shape, whose ``F.linear``
dequantizes inside torchao's own autograd function).

The part never has a gradient; a trainable extension parameter stays in the
main unit's flat shard (its plain values must be reduce-scattered there).
What reads a flat shard's values (``summon_full_params``, full state dicts,
dtype conversion) refuses a packed part with one line; sharded state dicts
present its local subclass shards as ``DTensor(Shard(0))``.
"""
from __future__ import annotations

from typing import Iterator, Optional

import torch

from . import collectives, extensions
from .params import ParamSlot
from .unit import ShardedState, Unit


def is_packed(slot: ParamSlot) -> bool:
    """Whether ``slot``'s parameter goes to a packed part: frozen, of a
    tensor subclass that defines an all-gather extension."""
    return extensions.defines(type(slot.param)) and not slot.param.requires_grad


class PackedPart(Unit):
    """A unit part of frozen all-gather-extension parameters (see [Note:
    packed parts]); :class:`Unit`'s API, its gathers the extensions' only."""

    packed = True

    def _shard(self) -> None:
        """Take each parameter's own subclass rows; the flat shard is meta (no memory)."""
        dtype = self.slots[0].param.dtype if self.slots else torch.float32
        self.flat_shard = self.new_shard(dtype, torch.device("meta"))
        for slot in self.slots:
            slot.take_shard(None, self.world, self.rank)
        self._make_full()

    def _make_full(self) -> None:
        cfg = self.cfg
        self.compute_dtype = cfg.param_dtype or self.flat_shard.dtype
        self.reduce_dtype = self.grad_dtype = self.compute_dtype
        for slot in self.slots:
            slot.record_view_ptr()
        self.aliased = False
        self.flat_full = torch.empty(0, dtype=self.compute_dtype, device=cfg.compute_device)

    def shard_bytes(self) -> int:
        """Bytes of this rank's shards: every inner tensor of each subclass local shard."""
        return sum(_inner_bytes(slot.registered_local()) for slot in self.slots)

    def unsharded_bytes(self) -> int:
        """Bytes of the extension all-gather outputs and post-hook tensors held now."""
        return sum(storage.nbytes() for state in self.ext.values() for storage, _ in state.storages)

    def check_views(self) -> None:
        """Refuse a parameter replaced after sharding (the flat shard is meta by design)."""
        for slot in self.slots:
            problem = slot.view_problem(self.flat_shard.dtype, registered=not self._installed)
            if problem:
                raise RuntimeError(f"[rank {collectives.rank()}] unit '{self.name}': {problem}")
            if not extensions.defines(slot.registered_local()):
                raise RuntimeError(
                    f"[rank {collectives.rank()}] unit '{self.name}': parameter '{slot.fqn}' was sharded as a "
                    f"frozen {type(slot.param).__name__ if slot.param is not None else 'extension'} tensor and "
                    "now holds a plain tensor (p.data = ... or .to(dtype)); set it before sharding")

    def unshard(self, after=None) -> None:
        """Issue the extension all-gathers only (no flat one). SHARDED → UNSHARDING."""
        self._check((ShardedState.SHARDED,), "unshard")
        self.state = ShardedState.UNSHARDING
        extensions.start(self)

    def use_full_params(self, grad: Optional[bool] = None) -> None:
        """Point every owning module attribute at the post-hook's tensor."""
        self._check((ShardedState.UNSHARDED,), "expose full parameters")
        for i, slot in enumerate(self.slots):
            slot.show_full(self.ext[i].full)

    def reshard_partial(self) -> None:
        """``reshard_after_forward=k`` keeps nothing of a packed part: it reshards fully."""
        if self.state is not ShardedState.SHARDED:
            self.reshard()

    def adopt(self) -> None:
        """After ``nn.Module._apply``: keep this rank's subclass shards. A
        result of the same class, shape, dtype and device (``to_empty`` or
        ``.to()`` on the device the part computes on) is dropped, as the
        parameters were never on the meta device; anything else is refused.

        Raises:
            ValueError: a parameter converted to another class, dtype, shape or device.
        """
        self.check_sharded("adopt new parameter values")
        for slot in self.slots:
            wrong = slot.take_back()
            new, kept = slot.registered_local(), slot.local
            if wrong is None and new is not kept and (type(new), new.shape, new.dtype, new.device) != \
                    (type(kept), kept.shape, kept.dtype, kept.device):
                wrong = f"parameter '{slot.fqn}' became {type(new).__name__} {new.dtype} on {new.device}"
            if wrong:
                self.refuse(f"module._apply() / load_state_dict(assign=True) ({wrong})")
            slot.rebind(kept)

    def refuse(self, what: str) -> None:
        """Raise: ``what`` needs plain values this part does not hold.

        Raises:
            ValueError: naming the unit, its first parameter and what to do.
        """
        name = self.slots[0].fqn if self.slots else "?"
        raise ValueError(
            f"[rank {collectives.rank()}] unit '{self.name}': {what} needs plain values of the frozen all-gather "
            f"extension parameter '{name}' (a tensor subclass kept in its own packed format); use a sharded "
            "state dict (StateDictType.SHARDED_STATE_DICT / get_model_state_dict with full_state_dict=False), "
            "or dequantize the parameter before sharding")


def inner_tensors(t: torch.Tensor) -> Iterator[torch.Tensor]:
    """The plain tensors inside a traceable subclass (``__tensor_flatten__``, recursively); a plain
    tensor itself."""
    if type(t) is torch.Tensor or not hasattr(t, "__tensor_flatten__"):
        yield t
        return
    names, _ = t.__tensor_flatten__()
    for n in names:
        yield from inner_tensors(getattr(t, n))


def _inner_bytes(t: torch.Tensor) -> int:
    """Bytes of the plain tensors inside a traceable subclass (its own for a plain tensor)."""
    return sum(x.numel() * x.element_size() for x in inner_tensors(t))
