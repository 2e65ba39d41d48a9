"""Instrumentation sees fullshard's all-gathers and reduce-scatters
(core/algorithms.py [Note: collective algorithms]): a wrapper installed on
``torch.distributed.all_gather_into_tensor`` / ``reduce_scatter_tensor``
after import is called for every one, and sees the reduce dtype;
``CommDebugMode`` counts them as ``_allgather_base_`` /
``_reduce_scatter_base_``; with nobody watching, gloo keeps its all-to-all.
2 gloo ranks, a ``fully_shard`` model of 2 units (one block, the root):
forward gathers both, backward gathers the block again (the root stays
gathered) and reduces both, so 3 all-gathers and 2 reduce-scatters."""
from __future__ import annotations

import collections
import functools
import os

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor.debug import CommDebugMode

import fullshard
from tests.dist import fsdp2_parity as P
from tests.dist.harness import run_ranks

c10d = torch.ops.c10d
GATHERS, REDUCES = 3, 2


def _model(**options):
    model = P.make(layers=1)
    fullshard.fully_shard(model.layers[0], **options)
    return fullshard.fully_shard(model, **options)


def _step(model, rank):
    P.loss_of(model, rank, 0).backward()


def _wrap(name, calls, check=None):
    """Replace ``torch.distributed.<name>`` with a wrapper that counts (and checks) calls; returns the original."""
    original = getattr(dist, name)

    @functools.wraps(original)
    def wrapper(*args, **kwargs):
        calls[name] += 1
        if check is not None:
            check(*args, **kwargs)
        return original(*args, **kwargs)
    setattr(dist, name, wrapper)
    return original


def _watchers(rank, world):
    os.environ.pop("FULLSHARD_COLLECTIVES", None)
    model = _model()
    # Nobody watching: gloo's all-to-all variants carry all 5.
    calls = collections.Counter()
    originals = {name: _wrap(name, calls) for name in ("all_to_all_single",)}
    _step(model, rank)
    dist.all_to_all_single = originals["all_to_all_single"]
    assert calls == {"all_to_all_single": GATHERS + REDUCES}, calls

    # A counting wrapper on each public name installed after import sees every call.
    calls = collections.Counter()
    originals = {name: _wrap(name, calls) for name in ("all_gather_into_tensor", "reduce_scatter_tensor",
                                                        "all_to_all_single")}
    try:
        _step(model, rank)
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)
    assert calls == {"all_gather_into_tensor": GATHERS, "reduce_scatter_tensor": REDUCES}, calls

    # The reduce-scatter input has the policy's reduce dtype (bf16 gradients summed in fp32).
    dtypes = collections.Counter()
    bf16 = _model(mp_policy=fullshard.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32))
    calls = collections.Counter()
    # Older torch (2.11 among them) has only the older name.
    name = "reduce_scatter_single" if hasattr(dist, "reduce_scatter_single") else "reduce_scatter_tensor"
    original = _wrap(name, calls, lambda output, input, *a, **k: dtypes.update([input.dtype]))
    try:
        _step(bf16, rank)
    finally:
        setattr(dist, name, original)
    assert dtypes == {torch.float32: REDUCES}, dtypes

    # CommDebugMode counts them as the collectives they stand for.
    with CommDebugMode() as comm:
        _step(model, rank)
    counts = comm.get_comm_counts()
    assert counts[c10d._allgather_base_] == GATHERS and counts[c10d._reduce_scatter_base_] == REDUCES, counts
    assert counts[c10d.alltoall_base_] == 0, counts
    return True


@pytest.mark.fast
def test_wrappers_and_comm_debug_mode_see_collectives():
    assert all(run_ranks(_watchers, 2))
