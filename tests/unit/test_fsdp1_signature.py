"""FullyShardedDataParallel's constructor takes torch FSDP1's public keywords
(the installed torch's) and fullshard's own, and no private ones."""
from __future__ import annotations

import inspect

import pytest
import torch.distributed.fsdp as torch_fsdp

import fullshard

OURS = {"world_size_invariant", "shard_placement_fn"}
NOT_ACCEPTED = {"limit_all_gathers"}  # nothing to cap on this engine (docs/semantics.md)


def _params(cls) -> list[str]:
    return [n for n in inspect.signature(cls.__init__).parameters if n != "self"]


def test_constructor_has_no_private_keywords():
    assert [n for n in _params(fullshard.FullyShardedDataParallel) if n.startswith("_")] == []


def test_constructor_keywords_are_torch_fsdp1_and_ours():
    theirs = set(_params(torch_fsdp.FullyShardedDataParallel))
    assert "module" in theirs and "process_group" in theirs, "torch's FSDP1 signature changed shape"
    assert set(_params(fullshard.FullyShardedDataParallel)) == (theirs - NOT_ACCEPTED) | OURS


def test_private_keyword_is_a_type_error():
    with pytest.raises(TypeError, match="unexpected keyword argument '_unit_name'"):
        fullshard.FullyShardedDataParallel(None, _unit_name="a")
