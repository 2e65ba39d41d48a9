"""ShardedGradScaler in one process (no process group): sparse gradients."""
from __future__ import annotations

import torch
import torch.nn as nn

from fullshard.amp import ShardedGradScaler


def test_unscale_sparse_uncoalesced_grad():
    """An embedding with sparse=True gets an uncoalesced gradient when an index
    repeats; unscale_ must divide the gradient itself, not a coalesced copy
    (which left it scaled by S)."""
    torch.manual_seed(0)
    ref, emb = nn.Embedding(10, 3, sparse=True), nn.Embedding(10, 3, sparse=True)
    emb.load_state_dict(ref.state_dict())
    ids = torch.tensor([1, 4, 1, 7, 4])
    ref(ids).pow(2).sum().backward()
    scaler = ShardedGradScaler(init_scale=1024.0)
    scaler.scale(emb(ids).pow(2).sum()).backward()
    assert emb.weight.grad.is_sparse and not emb.weight.grad.is_coalesced()
    opt = torch.optim.SGD(emb.parameters(), lr=0.1)
    scaler.unscale_(opt)
    torch.testing.assert_close(emb.weight.grad.to_dense(), ref.weight.grad.to_dense())
    scaler.step(opt)
    scaler.update()
    assert not scaler.last_step_skipped
    torch.testing.assert_close(emb.weight.detach(), ref.weight.detach() - 0.1 * ref.weight.grad.to_dense())


def test_unscale_sparse_inf_found():
    """A non-finite value in a sparse gradient is found (the step is skipped)."""
    emb = nn.Embedding(4, 2, sparse=True)
    scaler = ShardedGradScaler(init_scale=2.0)
    scaler.scale(emb(torch.tensor([0, 0, 2])).sum() * float("inf")).backward()
    opt = torch.optim.SGD(emb.parameters(), lr=0.1)
    before = emb.weight.detach().clone()
    scaler.step(opt)
    scaler.update()
    assert scaler.last_step_skipped
    torch.testing.assert_close(emb.weight.detach(), before)
