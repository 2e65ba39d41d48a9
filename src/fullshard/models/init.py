"""Deterministic, order-independent parameter initialization.

[Note: per-parameter generators]
Every parameter draws from its own ``torch.Generator`` seeded from
``(seed, qualified name in the unwrapped model)``. The value of a parameter
therefore depends on nothing but the seed and its name: initializing the
whole model at once (:meth:`GPT.init_weights`) and initializing it module by
module from the meta device in any order (:func:`make_param_init_fn`, which a
sharding wrapper calls while it builds units) give bit-identical tensors. A
tied parameter is initialized once, under its canonical name, which is the
first name ``model.named_parameters()`` gives it (``embed_tokens.weight``).

The scheme is GPT-2's (Radford et al. 2019, §2.3; ``model.py`` of
openai/gpt-2): Linear and Embedding weights ~ N(0, 0.02), the projections that
write into the residual stream scaled by 1/sqrt(2 * num_layers), biases 0,
LayerNorm weight 1 and bias 0. Values are drawn in float32 on the CPU and then
copied, so they do not depend on the target device or dtype.
"""

from __future__ import annotations

import hashlib
import math
from typing import Callable

import torch
from torch import nn

INIT_STD = 0.02
# Qualified-name suffixes of the projections that write into the residual
# stream (attention output, second MLP layer): GPT-2 scales their init.
RESIDUAL_PROJECTION_SUFFIXES = ("attn.out_proj.weight", "mlp.fc2.weight")


def param_seed(seed: int, qualname: str) -> int:
    """Returns the generator seed of one parameter.

    A stable hash (BLAKE2b, not Python's salted ``hash``) of ``seed`` and the
    parameter's qualified name, so it is the same in every process and run.

    Args:
        seed: The model's init seed.
        qualname: Qualified parameter name in the unwrapped model.

    Returns:
        A non-negative 63-bit integer for ``torch.Generator.manual_seed``.
    """
    digest = hashlib.blake2b(f"{seed}:{qualname}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def init_param_(param: torch.Tensor, module: nn.Module, local_name: str,
                qualname: str, seed: int, num_layers: int) -> None:
    """Initializes one parameter in place according to the GPT-2 scheme.

    Args:
        param: The tensor to fill (any device and floating dtype, not meta).
        module: The module that owns ``param`` under its canonical name.
        local_name: The attribute name of ``param`` on ``module``.
        qualname: Canonical qualified name in the unwrapped model.
        seed: The model's init seed.
        num_layers: Number of transformer blocks (for the residual scaling).

    Raises:
        ValueError: The parameter belongs to a module type with no rule.
    """
    with torch.no_grad():
        if isinstance(module, nn.LayerNorm):
            param.fill_(1.0 if local_name == "weight" else 0.0)
        elif local_name == "bias":
            param.zero_()
        elif isinstance(module, (nn.Linear, nn.Embedding)) and local_name == "weight":
            std = INIT_STD
            if qualname.endswith(RESIDUAL_PROJECTION_SUFFIXES):
                std /= math.sqrt(2 * num_layers)
            gen = torch.Generator(device="cpu").manual_seed(param_seed(seed, qualname))
            value = torch.empty(param.shape, dtype=torch.float32).normal_(0.0, std, generator=gen)
            param.copy_(value)
        else:
            raise ValueError(
                f"no init rule for parameter {qualname!r} of {type(module).__name__}")


def _num_layers(model: nn.Module) -> int:
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "num_layers"):
        raise TypeError(
            f"make_param_init_fn needs a model with a .config.num_layers (a GPT), "
            f"got {type(model).__name__}")
    return config.num_layers


class _ParamInitFn:
    """The callable :func:`make_param_init_fn` returns (see there)."""

    def __init__(self, model: nn.Module, seed: int, device: torch.device | str) -> None:
        self._seed = seed
        self._device = torch.device(device)
        self._num_layers = _num_layers(model)
        # Keep the modules alive so the id() keys below stay valid.
        self._modules = list(model.modules())
        # id(original param) -> (canonical qualname, owner module, local name)
        self._canonical: dict[int, tuple[str, nn.Module, str]] = {}
        # id(original param) -> every (module, local name) slot holding it
        self._slots: dict[int, list[tuple[nn.Module, str]]] = {}
        # (id(module), local name) -> id(original param)
        self._slot_param: dict[tuple[int, str], int] = {}
        # named_modules() walks in the order named_parameters() does, so the
        # first slot seen is the canonical one (embed_tokens.weight).
        for prefix, module in model.named_modules():
            for local, param in module._parameters.items():
                if param is None:
                    continue
                qualname = f"{prefix}.{local}" if prefix else local
                self._canonical.setdefault(id(param), (qualname, module, local))
                self._slots.setdefault(id(param), []).append((module, local))
                self._slot_param[(id(module), local)] = id(param)

    def __call__(self, module: nn.Module) -> None:
        for local, param in list(module._parameters.items()):
            if param is None or not param.is_meta:
                continue  # already materialized, e.g. through a tied slot
            key = self._slot_param.get((id(module), local))
            if key is None:
                raise ValueError(
                    f"{type(module).__name__}.{local} was not part of the model given to "
                    f"make_param_init_fn; build the init fn before wrapping")
            qualname, owner, owner_local = self._canonical[key]
            new = nn.Parameter(torch.empty(param.shape, dtype=param.dtype, device=self._device),
                               requires_grad=param.requires_grad)
            init_param_(new, owner, owner_local, qualname, self._seed, self._num_layers)
            # Re-tie: to_empty() would give each slot its own Parameter.
            for slot_module, slot_local in self._slots[key]:
                if slot_module._parameters.get(slot_local) is param:
                    setattr(slot_module, slot_local, new)
        for local, buf in module._buffers.items():
            if buf is not None and buf.is_meta:
                raise ValueError(
                    f"meta buffer {type(module).__name__}.{local} has no init rule")


def make_param_init_fn(model: nn.Module, seed: int,
                       device: torch.device | str) -> Callable[[nn.Module], None]:
    """Builds a per-module initializer for deferred (meta-device) init.

    Call it on the unwrapped model (built on the meta device), before any
    wrapping: it records which module holds which parameter under which
    qualified name. The returned function materializes one module's direct
    parameters (``recurse=False``) on ``device`` and initializes them exactly
    as :meth:`GPT.init_weights` does (see [Note: per-parameter generators]).
    Parameters that are no longer on meta are left untouched, so calling it
    twice, or on both owners of a tied weight, is harmless. A tied weight is
    materialized once and set on every module that shares it, so it stays one
    ``nn.Parameter`` (``Module.to_empty`` would untie it).

    Args:
        model: The unwrapped GPT whose modules will be passed to the function.
        seed: Init seed; the same seed as ``init_weights`` gives the same values.
        device: Where to materialize parameters.

    Returns:
        ``fn(module) -> None``, mutating ``module`` in place.

    Raises:
        TypeError: ``model`` has no ``config.num_layers``.
        ValueError: (from ``fn``) the module was not part of ``model``, or it
            holds a meta buffer.
    """
    return _ParamInitFn(model, seed, device)
