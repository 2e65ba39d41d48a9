"""Small models and helpers shared by the multi-process tests."""
from __future__ import annotations

import copy

import torch
import torch.nn as nn
import torch.nn.functional as F


class Inner(nn.Module):
    """A nested unit with uneven shapes: (15, 15) and (3, 15) weights."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(15, 15)
        self.b = nn.Linear(15, 3)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


class NestedMLP(nn.Module):
    """Linear(7, 15) → Inner → Linear(3, 5): shapes that no world size divides."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(7, 15)
        self.inner = Inner()
        self.out = nn.Linear(3, 5)
        self.scale = nn.Parameter(torch.ones(()))

    def forward(self, x):
        return self.out(self.inner(torch.tanh(self.inp(x)))) * self.scale


class FrozenMLP(NestedMLP):
    """NestedMLP with a frozen subset: all of ``inp`` and, inside the nested
    unit, ``inner.a.bias`` only (frozen and trained parameters in one unit)."""

    def __init__(self):
        super().__init__()
        self.inp.requires_grad_(False)
        self.inner.a.bias.requires_grad_(False)


def make_model(kind: str, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    if kind == "mlp":
        return NestedMLP()
    if kind == "frozen":
        return FrozenMLP()
    if kind == "gpt":
        from fullshard.models import build_model
        return build_model("transformer_lm_gpt_mini", vocab_size=97, max_positions=16, seed=seed)
    raise ValueError(kind)


def vector_scale(model: nn.Module) -> nn.Module:
    """``model`` with its 0-dim ``scale`` replaced by a 1-element 1-D parameter of the same value and
    ``requires_grad`` (``fully_shard`` refuses 0-dim parameters, as torch FSDP2 does; the results are the same)."""
    model.scale = nn.Parameter(model.scale.detach().reshape(1).clone(), requires_grad=model.scale.requires_grad)
    return model


def batch(kind: str, rank: int, step: int):
    g = torch.Generator().manual_seed(1000 * rank + step)
    if kind == "gpt":
        tokens = torch.randint(0, 97, (2, 17), generator=g)
        return tokens[:, :-1], tokens[:, 1:]
    return torch.randn(4, 7, generator=g), torch.randn(4, 5, generator=g)


def loss_fn(kind: str, model, x, y):
    out = model(x)
    if kind == "gpt":
        return F.cross_entropy(out.reshape(-1, out.size(-1)), y.reshape(-1))
    return F.mse_loss(out, y)


def param_groups(named):
    """AdamW groups selected by original names: no decay for biases, norms, scalars."""
    decay, no_decay = [], []
    for n, p in named:
        if not p.requires_grad:
            continue
        (no_decay if n.endswith("bias") or "norm" in n or "ln" in n or n == "scale" else decay).append(p)
    return [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]


def unit_policy(kind: str):
    from fullshard.wrap import ModuleWrapPolicy
    if kind == "gpt":
        from fullshard.models import TransformerBlock
        return ModuleWrapPolicy({TransformerBlock})
    return ModuleWrapPolicy({Inner})


def clone(m):
    return copy.deepcopy(m)
