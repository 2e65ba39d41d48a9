"""One record per original parameter of a unit, and the DTensor form its
shard and full views take under ``fully_shard``.

[Note: parameter records]
A unit keeps one :class:`ParamSlot` per original parameter: its name, every
``(module, attribute)`` that holds it (tied weights), its entry in the
flat layout, the registered sharded parameter, the plain view
of the flat shard that parameter's values live in, whether the current
backward used it, and how it is presented. The engine computes on plain
tensors only (``local``, the flat buffers); a :class:`DTensorSpec` on the
slot says how the registered parameter, its gradient and the full view a
module reads are wrapped as ``torch.distributed.tensor.DTensor``
(``fully_shard``). Without one (``FullyShardedDataParallel``) the registered
parameter is an ``nn.Parameter`` over the view itself. Either way the
registered parameter's memory *is* the view: an optimizer step writes the
flat shard directly, and the next all-gather reads it (no copy-in).
``core/registry.py`` finds the slot of a registered parameter
([Note: sharded-parameter registry]).
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Optional

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from . import torch_private
from .flat import ParamLayout
from .placement import Placement, RowShard


@dataclasses.dataclass(frozen=True)
class DTensorSpec:
    """How a plain tensor of a unit is presented as a DTensor.

    Attributes:
        mesh: the ``DeviceMesh`` of the sharded parameter (1-D shard mesh;
            2-D ``(replicate, shard)`` under HSDP; the parent of the data-
            parallel and tensor-parallel meshes under TP).
        placements: the sharded parameter's placements (``Shard(0)``,
            ``(Replicate(), Shard(0))``, or the data-parallel placement
            followed by the tensor-parallel ones).
        shape: global shape of the parameter.
        stride: global (contiguous) stride.
        full_mesh: mesh of the full view a module reads (tensor parallel:
            the TP mesh); None when modules read plain tensors.
        full_placements: placements of that full view.
    """

    mesh: object
    placements: tuple
    shape: torch.Size
    stride: tuple
    full_mesh: object = None
    full_placements: tuple = ()

    def wrap(self, local: torch.Tensor) -> DTensor:
        """``local`` (this rank's shard) as the parameter's DTensor; no copy."""
        return torch_private.dtensor_of(local, self.mesh, self.placements, self.shape, self.stride)

    def wrap_full(self, full: torch.Tensor) -> torch.Tensor:
        """A full view (this rank's tensor-parallel part of the parameter) as
        modules must read it: a DTensor on the TP mesh, or ``full`` itself."""
        if self.full_mesh is None:
            return full
        return DTensor.from_local(full, self.full_mesh, self.full_placements, run_check=False,
                                  shape=self.shape, stride=self.stride)


@dataclasses.dataclass(eq=False)
class ParamSlot:
    """One original parameter of a unit (see [Note: parameter records]).

    ``param`` is the original parameter until the unit takes its shard (then
    None, so the full tensor can be freed); ``sharded`` the registered
    parameter from then on, whose values are ``local``, a view of the flat
    shard with shape ``(local_rows, *shape[1:])``.
    """

    fqn: str
    param: Optional[torch.Tensor]
    owners: list[tuple[nn.Module, str]]
    init_rows: Optional[Callable[[int, int], torch.Tensor]] = None
    """For a meta ``param``: ``fn(row_start, row_end)`` returning those rows
    initialized, so the unit materializes only this rank's chunk."""
    spec: Optional[DTensorSpec] = None
    sharded: Optional[nn.Parameter] = None
    local: Optional[torch.Tensor] = None
    used: bool = False
    view_ptr: Optional[int] = None
    placement: Placement = RowShard()
    """Requested placement (``shard_placement_fn``); the unit resolves owners."""
    own_local: bool = False
    """``local`` is a tensor subclass kept apart from the flat shard (an
    all-gather extension; core/extensions.py [Note: all-gather extensions])."""
    layout: Optional[ParamLayout] = None
    """This parameter's entry in its unit's layout (``unit.layout.params``,
    set with it); what ``shard_info`` presents."""

    def make_sharded(self, view: torch.Tensor, requires_grad: bool) -> None:
        """Register ``view`` (a view of the flat shard) as this parameter on
        every owner: an ``nn.Parameter`` over it, a DTensor one with a spec."""
        self.local = view
        value = view if self.spec is None else self.spec.wrap(view)
        self.sharded = nn.Parameter(value, requires_grad=requires_grad)
        for module, attr in self.owners:
            module._parameters[attr] = self.sharded

    def rebind(self, view: torch.Tensor) -> None:
        """Make the registered parameter (the same object, so optimizers that
        hold it keep working) hold ``view``'s memory instead."""
        self.local = view
        if self.spec is None:
            self.sharded.data = view
        else:
            torch_private.set_local_tensor(self.sharded, view)

    def take_over(self, new: nn.Parameter) -> None:
        """Register ``new`` (a parameter in the registered one's form: same
        type, placements, local shape, dtype and device) in place of
        ``sharded``: its values go into ``local`` and it views them. The old
        object keeps a copy of its values, so whoever still holds it (an
        optimizer made before) no longer writes the flat shard, as a
        parameter replaced under DDP is disconnected from the model."""
        old = self.sharded
        with torch.no_grad():
            if not self.local.is_meta:
                self.local.copy_(local_of(new))
                kept = self.local.clone()
                if self.spec is None:
                    old.data = kept
                else:
                    torch_private.set_local_tensor(old, kept)
        self.sharded = new
        self.rebind(self.local)
        for module, attr in self.owners:
            module._parameters[attr] = new

    def assigned_mismatch(self, value: torch.Tensor) -> Optional[str]:
        """Why ``value`` (assigned in place of the registered parameter,
        ``load_state_dict(assign=True)``) cannot be this rank's shard, or None."""
        want = tuple(self.local.shape)
        got = tuple(local_of(value).shape)
        placements = getattr(value, "placements", None)
        expected = None if self.spec is None else tuple(self.spec.placements)
        if got == want and (placements is None if expected is None else tuple(placements) == expected):
            return None
        form = "a plain tensor" if placements is None else f"a DTensor with placements {tuple(placements)}"
        return (f"parameter '{self.fqn}' was assigned {form} of local shape {got}, not this rank's shard "
                f"({'a DTensor with placements ' + str(expected) + ' and ' if expected else ''}local shape {want}, "
                "as model.state_dict() holds it); load full tensors with torch.distributed.checkpoint.state_dict."
                "set_model_state_dict(model, sd, options=StateDictOptions(full_state_dict=True))")

    def registered_local(self) -> torch.Tensor:
        """The plain tensor behind the registered parameter now (which may no
        longer be ``local`` after ``p.data = ...`` or ``module.to()``)."""
        return local_of(self.sharded)

    def grad(self) -> Optional[torch.Tensor]:
        """This rank's part of the registered parameter's ``.grad`` (plain)."""
        g = self.sharded.grad
        return None if g is None else local_of(g)

    def grad_like(self, local: torch.Tensor) -> torch.Tensor:
        """``local`` (a gradient shard) in the form ``.grad`` takes."""
        return local if self.spec is None else self.spec.wrap(local)

    def full_view(self, full: torch.Tensor) -> torch.Tensor:
        """A full-parameter view in the form owning modules read."""
        return full if self.spec is None else self.spec.wrap_full(full)


def local_of(t: torch.Tensor) -> torch.Tensor:
    """The plain tensor behind ``t``: its local tensor for a DTensor, else ``t``."""
    return torch_private.local_tensor(t) if isinstance(t, DTensor) else t
