"""Public torch APIs that replaced private ones (core/torch_private.py) keep
doing what fullshard relies on; a torch upgrade that changes them fails here."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from fullshard import MixedPrecision


def _subclasses(cls: type) -> set[type]:
    out = set()
    for sub in cls.__subclasses__():
        out |= {sub} | _subclasses(sub)
    return out


def test_default_full_precision_classes_cover_torch_norms():
    """The public classes listed as the default cover every torch.nn subclass of
    the private ``_NormBase`` (the default before), quantized ones aside."""
    default = MixedPrecision().full_precision_module_classes
    norms = [c for c in _subclasses(nn.modules.batchnorm._NormBase)
             if c.__module__.startswith("torch.nn.") and not c.__name__.startswith("_")]
    assert norms, "torch.nn has no _NormBase subclasses any more"
    missing = [c.__name__ for c in norms if not issubclass(c, default)]
    assert not missing, f"not in the default full_precision_module_classes: {missing}"
    assert all(not c.__name__.startswith("_") for c in default)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_clip_grads_with_norm_rounds_once(dtype):
    """``torch.nn.utils.clip_grads_with_norm_`` (used by clip_grad_norm_)
    multiplies a low-precision gradient by the fp32 coefficient in fp32 and
    rounds once, also for a gradient whose dtype differs from its parameter's
    (keep_low_precision_grads)."""
    torch.manual_seed(0)
    params = [nn.Parameter(torch.randn(300, 7)) for _ in range(3)]
    grads = [torch.randn(300, 7).to(dtype) for _ in params]
    for p, g in zip(params, grads):
        holder = torch.empty((), dtype=p.dtype).expand(p.shape)  # as core/grads.set_grad installs it
        p.grad = holder
        holder.data = g.clone()
    total = torch.tensor(3.3333333)
    coef = torch.clamp(torch.tensor(0.7) / (total + 1e-6), max=1.0)
    torch.nn.utils.clip_grads_with_norm_(params, 0.7, total)
    for p, g in zip(params, grads):
        assert p.grad.dtype == dtype
        assert torch.equal(p.grad, (g.float() * coef).to(dtype))
