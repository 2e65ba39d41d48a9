"""The trainer's AdamW groups (weight decay for >=2-D weights only) map wrapped parameter names to
the model's with the one name-cleaning rule: a user's submodule called ``module`` keeps its name
under FullyShardedDataParallel and DistributedDataParallel (only DDP's own first ``module.``
segment is dropped)."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from fullshard.train.optimizers import original_name, param_groups


class Inner(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(8))  # 1-D: no weight decay


class UserModel(nn.Module):
    """A 2-D ``weight`` at the root and a 1-D ``module.weight``: stripping every ``module``
    segment turns the second name into the first."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(8, 8))  # 2-D: decayed
        self.module = Inner()
        self.proj = nn.Linear(8, 8)

    def forward(self, x):
        return self.proj(x @ self.weight * self.module.weight)


SHAPES = {"weight": torch.Size([8, 8]), "module.weight": torch.Size([8]), "proj.weight": torch.Size([8, 8]),
          "proj.bias": torch.Size([8])}
DECAYED = {"weight", "proj.weight"}


def test_original_name_keeps_a_user_module_named_module():
    assert original_name("_fsdp_wrapped_module.module._fsdp_wrapped_module.weight", SHAPES) == "module.weight"
    assert original_name("_fsdp_wrapped_module.weight", SHAPES) == "weight"
    assert original_name("_fsdp_wrapped_module.module._checkpoint_wrapped_module.weight", SHAPES) == "module.weight"
    assert original_name("module.weight", SHAPES, ddp=True) == "weight"
    assert original_name("module.module.weight", SHAPES, ddp=True) == "module.weight"
    with pytest.raises(KeyError, match="matches no parameter"):
        original_name("weight", SHAPES, ddp=True)  # DDP's names always start with its `module.`
    with pytest.raises(KeyError, match="matches no parameter"):
        original_name("_fsdp_wrapped_module.other.weight", SHAPES)


def _groups(rank, world):
    """(wrapped names, wrapped names of the decayed group, the groups' weight decays) per wrapper."""
    from fullshard import FullyShardedDataParallel
    from fullshard.wrap import ModuleWrapPolicy

    out = {}
    for kind in ("fsdp", "ddp"):
        torch.manual_seed(0)  # the same model on every rank
        model = UserModel()
        assert {n: p.shape for n, p in model.named_parameters()} == SHAPES
        if kind == "fsdp":  # Inner is a unit of its own, inside the root unit
            wrapped = FullyShardedDataParallel(model, auto_wrap_policy=ModuleWrapPolicy({Inner}))
        else:
            wrapped = nn.parallel.DistributedDataParallel(model)
        name_of = {id(p): n for n, p in wrapped.named_parameters()}
        groups = param_groups(wrapped, SHAPES, 0.1)
        out[kind] = (sorted(name_of.values()), sorted(name_of[id(p)] for p in groups[0]["params"]),
                     [g["weight_decay"] for g in groups])
    return out


def test_decay_groups_of_a_user_model_with_a_submodule_named_module():
    from tests.dist.harness import run_ranks

    for out in run_ranks(_groups, 2):
        names, decayed, decays = out["fsdp"]
        assert names == ["module.weight", "proj.bias", "proj.weight", "weight"]  # the wrapper keeps the names
        assert decayed == ["proj.weight", "weight"]
        assert decays == [0.1, 0.0]
        names, decayed, _ = out["ddp"]
        assert names == ["module.module.weight", "module.proj.bias", "module.proj.weight", "module.weight"]
        assert decayed == ["module.proj.weight", "module.weight"]
