"""core/algorithms.py: the native collective is looked up on
``torch.distributed`` at each call, so a replacement under either of its
names is the one called and marks the op as watched, as does an active
dispatch mode (``CommDebugMode``)."""
from __future__ import annotations

import pytest
import torch.distributed as dist
from torch.distributed.tensor.debug import CommDebugMode

from fullshard.core import algorithms


@pytest.mark.parametrize("op,new,old", [("all_gather", "all_gather_single", "all_gather_into_tensor"),
                                        ("reduce_scatter", "reduce_scatter_single", "reduce_scatter_tensor")])
def test_native_function_is_looked_up_at_each_call(monkeypatch, op, new, old):
    names = (new, old) if hasattr(dist, new) else (old,)  # older torch (2.11) has only the older name
    assert algorithms.native_fn(op) is getattr(dist, names[0])  # not torch's deprecated alias
    assert not algorithms.watched(op)
    for name in names:
        with monkeypatch.context() as m:
            def wrapper(*args, **kwargs):
                return None
            m.setattr(dist, name, wrapper)
            assert algorithms.native_fn(op) is wrapper, name
            assert algorithms.watched(op), name
    assert not algorithms.watched(op)
    with CommDebugMode():
        assert algorithms.watched(op)
