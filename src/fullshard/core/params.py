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

[Note: full-parameter views shadow sharded parameters]
The sharded ``nn.Parameter`` of each original parameter stays registered in
its owning modules' ``_parameters`` for the unit's whole life, so
``named_parameters()``, ``parameters()`` and every optimizer only ever see
shards. To compute with full parameters, :meth:`Unit.use_full_params` writes
each full-parameter view into ``module.__dict__[attr]``
(:meth:`ParamSlot.show_full`). Python's attribute lookup finds an
instance-``__dict__`` entry before it calls ``nn.Module.__getattr__``, the
method that reads ``_parameters`` and is consulted only when normal lookup
fails; so ``self.weight`` inside ``forward`` is the full view while the
registered parameter is unchanged. :meth:`Unit.hide_full_params` pops the
entries (at reshard; :meth:`ParamSlot.hide_full`), after which the attribute
resolves to the shard again. Nothing but attribute reads sees the views:
``state_dict``, ``named_parameters`` and ``_apply`` read ``_parameters``.
Where a full tensor must be *registered* (the state-dict hooks,
``summon_full_params``, load targets), :meth:`Unit.install_params` swaps the
``_parameters`` entries instead (:meth:`ParamSlot.install`) and
:meth:`Unit.restore_params` puts the shards back. ``state_dict`` and
``load_state_dict`` read ``_parameters`` directly; ``summon_full_params``,
whose users read attributes, hides any views first, which would otherwise
shadow what it installs.
"""
from __future__ import annotations

import dataclasses
import functools
import weakref
from typing import Callable, Optional

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from . import extensions, torch_private
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
        spec = self._torch_specs.get(local.dtype)
        if spec is None:  # one per dtype: every backward wraps each gradient shard
            spec = self._torch_specs[local.dtype] = torch_private.dtensor_spec(
                self.mesh, self.placements, self.shape, self.stride, local.dtype)
        return torch_private.dtensor_of(local, spec)

    @functools.cached_property
    def _torch_specs(self) -> dict:
        return {}

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
    init_rows: Optional[Callable[[int, int, Optional[torch.Tensor]], torch.Tensor]] = None
    """For a meta ``param``: ``fn(row_start, row_end, out)`` returning those rows
    initialized (written into ``out`` where it can: core/deferred_init.py
    ``rows_fn``), so the unit materializes only this rank's chunk."""
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

    def take_shard(self, view: torch.Tensor, world: int, rank: int) -> None:
        """Register this rank's shard in place of ``param``, which is dropped
        (the full tensor is no longer ours to keep): ``view`` (of the flat
        shard), or a tensor subclass's own local shard, which cannot view the
        flat one (all-gather extensions; ``own_local``)."""
        self.own_local = extensions.defines(type(self.param))
        if self.own_local:
            view = extensions.local_shard(self.param, world, rank)
        self.make_sharded(view, self.param.requires_grad)
        torch_private.carry_gradient_hooks(self.sharded, self.param)  # registered before sharding
        self.param = None

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

    def show_full(self, full: torch.Tensor) -> None:
        """Point every owning module attribute at ``full`` (a full-parameter
        view, in the form modules read) until :meth:`hide_full` (see
        [Note: full-parameter views shadow sharded parameters])."""
        view = self.full_view(full)
        for module, attr in self.owners:
            module.__dict__[attr] = view

    def hide_full(self) -> None:
        """Make owning modules resolve the attribute to the registered parameter again."""
        for module, attr in self.owners:
            module.__dict__.pop(attr, None)

    def install(self, value: Optional[torch.Tensor]) -> list[tuple[nn.Module, str, object]]:
        """Register ``value`` on every owning module; returns what each
        ``(module, attr)`` held before, for the unit to put back."""
        prev = []
        for module, attr in self.owners:
            prev.append((module, attr, module._parameters[attr]))
            module._parameters[attr] = value
        return prev

    def follow_shard(self, view: torch.Tensor) -> None:
        """The unit's flat shard was replaced: the registered parameter (the
        same object) views ``view`` of the new one; a subclass shard kept
        apart (``own_local``; ``_apply`` may have replaced it) is re-read."""
        if self.own_local:
            self.local = self.registered_local()
        else:
            self.rebind(view)

    def record_view_ptr(self) -> None:
        """Where the registered parameter's memory must stay (see :meth:`view_problem`)."""
        meta = self.own_local or self.local.is_meta or not self.local.numel()
        self.view_ptr = None if meta else self.local.data_ptr()

    def view_problem(self, flat_dtype: torch.dtype, registered: bool = True) -> Optional[str]:
        """Why the registered parameter can no longer be the unit's (None when
        it still is): a module's registered parameter is another object
        (checked with ``registered``; replaced after sharding), or its memory
        is no longer its view of the ``flat_dtype`` flat shard (``.half()`` /
        ``.to()`` on a module inside the unit, or ``p.data = ...``). Either
        way the all-gather would read values the optimizer no longer updates."""
        if registered and any(m._parameters.get(a) is not self.sharded for m, a in self.owners):
            return (f"parameter '{self.fqn}' was replaced (module.<name> = ...) after sharding; the unit computes "
                    "from its own shard and would ignore it. Replace parameters before wrapping (fully_shard: "
                    "before the first forward), or write values in place with p.copy_() under torch.no_grad()")
        sp = self.registered_local()
        if self.view_ptr is not None and (sp.data_ptr() != self.view_ptr or sp.dtype != flat_dtype):
            return (f"parameter '{self.fqn}' ({sp.dtype}) no longer views the unit's {flat_dtype} flat shard "
                    "(.half()/.to() on a module inside the wrapper, or p.data = ...); convert the "
                    "FullyShardedDataParallel model itself (model.half()) and write values with p.copy_() under "
                    "torch.no_grad()")
        return None

    def versions(self) -> tuple[int, int]:
        """Version counters of the registered parameter and of its local tensor."""
        return torch_private.version_counter(self.sharded), torch_private.version_counter(self.registered_local())

    def take_back(self) -> Optional[str]:
        """Register the registered parameter on every owner again after
        ``nn.Module._apply`` or ``load_state_dict(assign=True)`` put another
        object there; that object gives it its value and dtype
        (``torch.utils.swap_tensors``), so an optimizer holding the parameter
        keeps training the model. Returns why the assigned value cannot be
        this rank's shard (nothing is changed then), or None."""
        new = next((v for v in (m._parameters.get(a) for m, a in self.owners)
                    if v is not None and v is not self.sharded), None)
        if new is not None:
            wrong = self.assigned_mismatch(new)
            if wrong:
                return wrong
            torch.utils.swap_tensors(self.sharded, new)
        for module, attr in self.owners:
            module._parameters[attr] = self.sharded
        return None

    def drop_sentinel(self, ref: Optional[weakref.ref]) -> None:
        """Reset ``.grad`` to None when it is the zero gradient ``ref`` points
        at (a ``no_sync`` sentinel, never a gradient; core/stash.py). A dead
        ``ref`` is ruled out before ``.grad`` is read: called from a
        sentinel's finalizer while ``zero_grad`` frees that very gradient,
        reading ``.grad`` first would touch a tensor being deallocated."""
        if ref is not None and ref() is not None and self.sharded.grad is ref():
            self.sharded.grad = None


def local_of(t: torch.Tensor) -> torch.Tensor:
    """The plain tensor behind ``t``: its local tensor for a DTensor, else ``t``."""
    return torch_private.local_tensor(t) if isinstance(t, DTensor) else t
