"""fully_shard's FSDPModule offers every public method of the installed torch's FSDPModule."""
from __future__ import annotations

import torch.distributed.fsdp as torch_fsdp

import fullshard


def _public(cls) -> set[str]:
    return {n for n in dir(cls) if not n.startswith("_") and callable(getattr(cls, n))}


def test_fsdp_module_has_every_torch_method():
    ours, theirs = _public(fullshard.FSDPModule), _public(torch_fsdp.FSDPModule)
    assert theirs, "torch's FSDPModule lists no public methods"
    assert sorted(theirs - ours) == []
