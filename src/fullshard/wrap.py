"""Auto-wrap policies and manual nested wrapping.

A policy is called as ``policy(module=m, recurse=bool, nonwrapped_numel=int)``
(the signature ``torch.distributed.fsdp.wrap`` uses): with ``recurse=True`` it
answers "may units be made inside ``m``?", with ``recurse=False`` "should
``m`` itself become a unit?", given the numel of ``m``'s parameters not
already inside a nested unit.
"""
from __future__ import annotations

import contextlib
import dataclasses
import weakref
from typing import Any, Callable, Iterable, Optional

import torch.nn as nn


def always_wrap_policy(module: nn.Module, recurse: bool, nonwrapped_numel: int) -> bool:
    """Wrap every module (torch FSDP1's ``always_wrap_policy``): each
    submodule becomes a unit nested in its parent's unit, containers
    (``nn.ModuleList``, ``nn.Sequential``) and parameter-free modules
    included. Many small units mean many small collectives; this is mostly
    for tests and for models of a few large layers.

    Returns:
        Always True.
    """
    return True


def size_based_auto_wrap_policy(module: nn.Module, recurse: bool, nonwrapped_numel: int,
                                min_num_params: int = int(1e8),
                                force_leaf_modules: Optional[set] = None,
                                exclude_wrap_modules: Optional[set] = None) -> bool:
    """Wrap a module once at least ``min_num_params`` of its parameters are not
    yet in a nested unit. Use with ``functools.partial(..., min_num_params=N)``.

    ``force_leaf_modules`` classes are never recursed into (default:
    ``nn.MultiheadAttention``); ``exclude_wrap_modules`` classes are never
    wrapped (default: ``nn.ModuleList``, ``nn.ModuleDict``).
    """
    force_leaf = (nn.MultiheadAttention,) if force_leaf_modules is None else tuple(force_leaf_modules)
    exclude = (nn.ModuleList, nn.ModuleDict) if exclude_wrap_modules is None else tuple(exclude_wrap_modules)
    if recurse:
        return not isinstance(module, force_leaf)
    return nonwrapped_numel >= min_num_params and not isinstance(module, exclude)


def transformer_auto_wrap_policy(module: nn.Module, recurse: bool, nonwrapped_numel: int,
                                 transformer_layer_cls: Iterable[type]) -> bool:
    """One unit per instance of the given layer classes (e.g. a transformer block)."""
    if recurse:
        return True
    return isinstance(module, tuple(transformer_layer_cls))


def lambda_auto_wrap_policy(module: nn.Module, recurse: bool, nonwrapped_numel: int,
                            lambda_fn: Callable[[nn.Module], bool]) -> bool:
    """A unit for every module for which ``lambda_fn(module)`` is true."""
    if recurse:
        return True
    return bool(lambda_fn(module))


class ModuleWrapPolicy:
    """A unit for every instance of the given module classes.

    Args:
        module_classes: classes whose instances become units.
    Raises:
        TypeError: if an entry is not an ``nn.Module`` subclass.
    """

    def __init__(self, module_classes: Iterable[type]):
        classes = tuple(module_classes)
        for c in classes:
            if not (isinstance(c, type) and issubclass(c, nn.Module)):
                raise TypeError(f"ModuleWrapPolicy takes nn.Module subclasses, got {c!r}")
        self.module_classes = classes

    def __call__(self, module: nn.Module, recurse: bool, nonwrapped_numel: int) -> bool:
        return transformer_auto_wrap_policy(module, recurse, nonwrapped_numel, self.module_classes)

    def __repr__(self) -> str:
        return f"ModuleWrapPolicy({[c.__name__ for c in self.module_classes]})"


class CustomPolicy:
    """torch FSDP1's ``CustomPolicy``: ``lambda_fn(module)`` returns False (not a unit), True (a unit built
    with the wrapper's arguments) or a dict of constructor arguments that override the wrapper's for that
    unit, e.g. ``{"sharding_strategy": ShardingStrategy.SHARD_GRAD_OP}`` or ``{"cpu_offload": ...}``.

    Args:
        lambda_fn: ``module -> bool | dict``.
    Raises:
        TypeError: ``lambda_fn`` is not callable; at wrapping, an argument the wrapper does not take.
    """

    def __init__(self, lambda_fn: Callable[[nn.Module], Any]):
        if not callable(lambda_fn):
            raise TypeError(f"CustomPolicy takes a callable module -> bool | dict, got {lambda_fn!r}")
        self._lambda_fn = lambda_fn

    def __call__(self, module: nn.Module, recurse: bool, nonwrapped_numel: int) -> Any:
        return True if recurse else self._lambda_fn(module)


def _owners(root: nn.Module) -> dict[int, tuple[weakref.ref, set[int]]]:
    """param id -> (weak reference to the param, ids of every module holding it),
    to keep tied weights in one unit. The reference tells an original
    parameter from a shard a nested unit made later under a reused id,
    without keeping the full tensor alive."""
    owners: dict[int, tuple[weakref.ref, set[int]]] = {}
    for m in root.modules():
        for p in m._parameters.values():
            if p is not None:
                owners.setdefault(id(p), (weakref.ref(p), set()))[1].add(id(m))
    return owners


def _shared_outside(child: nn.Module, owners: dict[int, tuple[weakref.ref, set[int]]]) -> set[int]:
    """Ids of ``child``'s original parameters also held by a module outside it.

    Walks into units already nested in ``child``: a parameter they left
    unsharded (tied to a module outside them) is still an original one and
    goes to ``child``'s unit, or further out if it is shared beyond ``child``.
    Their shards are new objects (absent from ``owners``, or under a reused id
    whose weak reference no longer points at them); those units keep them.
    """
    inside = {id(s) for s in child.modules()}
    skip = set()
    for sub in child.modules():
        for p in sub._parameters.values():
            entry = None if p is None else owners.get(id(p))
            if entry is not None and entry[0]() is p and not entry[1] <= inside:
                skip.add(id(p))
    return skip


def recursive_wrap(module: nn.Module, policy: Callable, wrap_fn: Callable[..., nn.Module],
                   ignored: set[int], is_wrapped: Callable[[nn.Module], bool],
                   prefix: str = "") -> nn.Module:
    """Replace ``module``'s descendants chosen by ``policy`` with units, bottom-up.

    A policy may choose a module and some of its descendants (e.g.
    ``ModuleWrapPolicy({Block, nn.Linear})``): the descendants are wrapped
    first and their units nest inside the module's unit, as in torch FSDP1.
    ``wrap_fn(child, name=..., skip_param_ids=..., **overrides)`` builds a unit named by
    the child's path from ``module``; ``skip_param_ids`` are parameters the
    child shares with modules outside it, which stay with an enclosing unit
    so tied weights stay tied; ``overrides`` are a dict a policy returned (``CustomPolicy``), else
    none. ``module`` itself is not wrapped (its caller
    is the wrapper). Modules whose id is in ``ignored`` are not entered.
    """
    owners = _owners(module)

    def numel_of(m: nn.Module) -> int:
        seen, n = set(), 0
        for sub in _unwrapped_modules(m, is_wrapped, ignored):
            for p in sub._parameters.values():
                if p is not None and id(p) not in seen:
                    seen.add(id(p))
                    n += p.numel()
        return n

    def visit(m: nn.Module, name: str) -> None:
        for child_name, child in list(m.named_children()):
            if id(child) in ignored or is_wrapped(child):
                continue
            full = f"{name}.{child_name}" if name else child_name
            if not policy(module=child, recurse=True, nonwrapped_numel=numel_of(child)):
                continue
            visit(child, full)
            chosen = policy(module=child, recurse=False, nonwrapped_numel=numel_of(child))
            if chosen:  # a dict (CustomPolicy): this unit's own constructor arguments
                skip = _shared_outside(child, owners)
                over = chosen if isinstance(chosen, dict) else {}
                setattr(m, child_name, wrap_fn(child, name=full, skip_param_ids=skip, **over))

    visit(module, prefix)
    return module


def _unwrapped_modules(m: nn.Module, is_wrapped: Callable[[nn.Module], bool], ignored: set[int]):
    """``m`` and its descendants, not descending into units or ignored modules
    (nothing when ``m`` itself is ignored)."""
    stack = [] if id(m) in ignored else [m]
    while stack:
        cur = stack.pop()
        yield cur
        for child in cur.children():
            if not is_wrapped(child) and id(child) not in ignored:
                stack.append(child)


# ------------------------------------------------------------ manual wrapping
@dataclasses.dataclass
class _WrapContext:
    wrapper_cls: Any
    kwargs: dict


_CONTEXT: list[_WrapContext] = []


@contextlib.contextmanager
def enable_wrap(*, wrapper_cls: Any, **wrapper_kwargs: Any):
    """Within this context, :func:`wrap` turns a module into ``wrapper_cls(module, **wrapper_kwargs)``.

    Example::

        with enable_wrap(wrapper_cls=FullyShardedDataParallel, sharding_strategy=ShardingStrategy.FULL_SHARD):
            model = wrap(nn.Sequential(wrap(nn.Linear(8, 4)), wrap(nn.Linear(4, 16))))
    """
    _CONTEXT.append(_WrapContext(wrapper_cls, dict(wrapper_kwargs)))
    try:
        yield
    finally:
        _CONTEXT.pop()


def wrap(module: nn.Module, **overrides: Any) -> nn.Module:
    """Wrap ``module`` as a unit inside :func:`enable_wrap`; outside it, return
    ``module`` unchanged (so model code can call ``wrap`` unconditionally)."""
    if not _CONTEXT:
        return module
    ctx = _CONTEXT[-1]
    return ctx.wrapper_cls(module, **{**ctx.kwargs, **overrides})


__all__ = [
    "always_wrap_policy", "size_based_auto_wrap_policy", "transformer_auto_wrap_policy", "lambda_auto_wrap_policy",
    "ModuleWrapPolicy", "CustomPolicy", "enable_wrap", "wrap",
]
