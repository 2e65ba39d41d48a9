"""What one ``fully_shard`` call leaves on its modules, and the parts of
torch FSDP2's module contract that are not methods: ``fully_shard.state``,
the containers it refuses, the original class a container's slice gets,
``copy.deepcopy``'s refusal, and parameters replaced between ``fully_shard``
and the first forward (adopted at lazy init, as torch FSDP2's
``reset_sharded_param`` does for DTensors).
"""
from __future__ import annotations

from typing import NoReturn, Optional

import torch.nn as nn
from torch.distributed.tensor import DTensor

from .api import MixedPrecisionPolicy
from .core import collectives, registry, state, stored
from .core.names import clean_name
from .core.unit import ShardedState, Unit


class FSDPState:
    """The state one ``fully_shard`` call shares between its modules, as
    ``fully_shard.state(module)`` returns it (torch FSDP2's ``FSDPState``,
    whose fields are private; these are fullshard's public ones).

    The properties are read-only views of the unit; change settings with
    the :class:`~fullshard.FSDPModule` methods (``set_reshard_after_forward``
    ...). ``runtime``, ``own``, ``output_dtype`` and ``before`` are the
    forward hooks' working fields (fsdp2.py), not part of the contract.
    """

    def __init__(self, runtime: state.UnitRuntime, modules: list[nn.Module], own: list[nn.Module],
                 mp_policy: MixedPrecisionPolicy, mesh):
        self.runtime = runtime
        self.own = own  # modules whose stored tensors count as outputs
        self.output_dtype = mp_policy.output_dtype
        self.before: Optional[stored.Snapshot] = None  # ``own``'s attributes before this forward
        self._modules = tuple(modules)
        self._mp_policy = mp_policy
        self._mesh = mesh

    @property
    def modules(self) -> tuple[nn.Module, ...]:
        """The module(s) passed to the ``fully_shard`` call (one unit)."""
        return self._modules

    @property
    def unit(self) -> Unit:
        """The engine's unit: its flat shard, layout and parameter records."""
        return self.runtime.unit

    @property
    def mesh(self):
        """The ``DeviceMesh`` the unit is sharded over."""
        return self._mesh

    @property
    def mp_policy(self) -> MixedPrecisionPolicy:
        return self._mp_policy

    @property
    def param_names(self) -> tuple[str, ...]:
        """Names of the unit's parameters, relative to the first module of the call."""
        return tuple(s.fqn for part in (self.runtime.unit, *self.runtime.unit.side) for s in part.slots)

    @property
    def is_root(self) -> Optional[bool]:
        """Whether this unit is the root (runs forward first); None before
        the first forward (lazy init), as torch's ``_is_root``."""
        return None if self.runtime.root is None else self.runtime.is_root

    @property
    def training_state(self) -> state.TrainingState:
        """IDLE, FORWARD, PRE_BACKWARD or POST_BACKWARD."""
        return self.runtime.state

    @property
    def sharded_state(self) -> ShardedState:
        """SHARDED, UNSHARDING (all-gather in flight) or UNSHARDED."""
        return self.runtime.unit.state

    @property
    def reshard_after_forward(self) -> bool:
        return self.runtime.settings.reshard_after_forward

    @property
    def reshard_after_backward(self) -> bool:
        return self.runtime.settings.reshard_after_backward

    @property
    def requires_gradient_sync(self) -> bool:
        return self.runtime.settings.requires_gradient_sync

    def __repr__(self) -> str:
        return (f"FSDPState(unit={self.runtime.unit.name!r}, is_root={self.is_root}, "
                f"training_state={self.training_state.value}, sharded_state={self.sharded_state.value})")


def state_of(module: nn.Module) -> Optional[FSDPState]:
    """``fully_shard.state(module)``: the :class:`FSDPState` of the call
    ``module`` was passed to, or None (a module below it, or never passed)."""
    found = module.__dict__.get("_fsdp_state")
    return found if isinstance(found, FSDPState) else None


def check_module(module: nn.Module, where: str) -> None:
    """Refuse a container that has no forward, as torch FSDP2 does: its
    hooks would never run (``fully_shard(model.layers)`` instead of each layer).

    Raises:
        ValueError: an ``nn.ModuleList`` / ``nn.ModuleDict`` without its own ``forward``.
    """
    if isinstance(module, (nn.ModuleList, nn.ModuleDict)) and type(module).forward is nn.Module.forward:
        raise ValueError(f"{where}: fully_shard does not support containers that do not implement forward "
                         f"({type(module).__name__}); apply it to each module inside, or pass them as a list "
                         "to shard them as one unit")


def new_original(cls: type, args: tuple, kwargs: dict) -> nn.Module:
    """A new instance of the class ``cls`` (an ``FSDP<Original>`` class) was
    made from: containers build ``type(self)(...)`` for a slice
    (``nn.Sequential``'s ``model[1:]``), which is not sharded, so it gets the
    original class, as under torch FSDP2."""
    original = cls.__dict__["_fsdp_original"]
    obj = original.__new__(original, *args, **kwargs)
    obj.__init__(*args, **kwargs)
    return obj


def refuse_deepcopy(self, memo=None) -> NoReturn:
    """``copy.deepcopy`` of a ``fully_shard`` module (torch FSDP2 raises too).

    Raises:
        AssertionError: always (torch FSDP2's type).
    """
    raise AssertionError(f"[rank {collectives.rank()}] copy.deepcopy of a fully_shard module "
                         f"({type(self).__name__}) is not supported, as in torch FSDP2: deep-copy the model before "
                         "fully_shard, or build another and load model.state_dict() into it")


# ------------------------------------------------- replaced before lazy init
def adopt_replaced(rt: state.UnitRuntime) -> bool:
    """Before the unit first runs: take into its flat shard any parameter the
    user replaced after ``fully_shard`` with ``module.weight =
    nn.Parameter(t)``, ``t`` this rank's shard as a DTensor (what
    ``model.state_dict()`` holds, e.g. ``distribute_tensor(full,
    p.device_mesh, p.placements)``), as torch FSDP2's lazy init does. The new
    object becomes the registered parameter, so an optimizer made after the
    replacement trains the model, as under DDP. A plain tensor cannot be
    adopted: the registered parameter must be a DTensor, and the user's
    object (which an optimizer may hold) would be left out of training.
    Replacing after the first forward is refused then (``Unit.check_views``).

    Returns:
        Whether anything was replaced.
    Raises:
        ValueError: a plain tensor, or a DTensor of another shape,
            placement, dtype or device; one of tied parameters replaced
            alone; another sharded parameter (a tie made after sharding).
    """
    unit = rt.unit
    todo = []
    for slot in unit.slots:
        got = [m._parameters.get(a) for m, a in slot.owners]
        new = got[0]
        if all(v is slot.sharded for v in got):
            continue
        where = f"[rank {collectives.rank()}] unit '{unit.name}': parameter '{slot.fqn}'"
        if any(v is not new for v in got) or new is None:
            raise ValueError(f"{where} was replaced (or deleted) on some of the modules that share it "
                             f"({[a for _, a in slot.owners]}); replace it on all of them with one tensor")
        if registry.find(new) is not None:  # another sharded parameter: a tie made after sharding
            raise ValueError(f"{where} was replaced by another sharded parameter (weights tied after "
                             "fully_shard); tie them before fully_shard, or shard the modules that share "
                             "them as one unit (fully_shard([a, b]))")
        if not isinstance(new, DTensor):
            raise ValueError(f"{where} was replaced by a plain tensor after fully_shard; assign this rank's "
                             "shard, nn.Parameter(distribute_tensor(full, p.device_mesh, p.placements)), or write "
                             "values in place with p.copy_(...) under torch.no_grad()")
        if tuple(new.shape) != tuple(slot.sharded.shape):
            raise ValueError(f"{where} was replaced by a tensor of shape {tuple(new.shape)} after fully_shard; "
                             f"it must keep the shape {tuple(slot.sharded.shape)} the unit was built with "
                             "(or be replaced before fully_shard)")
        if new.dtype != slot.sharded.dtype or new.device != slot.sharded.device:
            raise ValueError(f"{where} was replaced by a {new.dtype} tensor on {new.device}; the unit holds "
                             f"{slot.sharded.dtype} on {slot.sharded.device} (convert the whole model with "
                             "model.to(...) instead)")
        wrong = slot.assigned_mismatch(new)
        if wrong:
            raise ValueError(f"[rank {collectives.rank()}] unit '{unit.name}': {wrong}")
        todo.append((slot, new))
    if not todo:
        return False
    if unit.state is not ShardedState.SHARDED:
        unit.reshard()
    for slot, new in todo:
        slot.take_over(new)
    registry.register(unit)  # the registry follows the adopted objects
    return True


def name_units(root: nn.Module, runtimes: list) -> None:
    """Name each unit below ``root`` by its module path in ``root`` (``layers.1``; a unit of several modules
    joins their paths with ``+``), as the wrapper names its auto-wrapped units. ``fully_shard`` starts from the
    class names, which are ambiguous in messages and in the collectives' tags that debug mode compares across
    ranks: two blocks of one class and shape would pass for each other. The root keeps its class name."""
    paths: dict[int, list[str]] = {}
    ids = {id(rt) for rt in runtimes}
    for path, m in root.named_modules():
        # vars(): a wrapper forwarding attribute reads (checkpoint_wrapper) is not a module of the unit
        if path and m is not root and id(vars(m).get("_runtime")) in ids:
            paths.setdefault(id(m._runtime), []).append(clean_name(path))
    for rt in runtimes:
        if rt is not getattr(root, "_runtime", None) and id(rt) in paths:
            rt.unit.name = "+".join(paths[id(rt)])
            for part in rt.unit.side:  # frozen parts of other dtypes (core/mixed.py)
                part.name = rt.unit.name
