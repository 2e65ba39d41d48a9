"""Helpers shared by several multi-process test modules (test modules import
from here, never from each other): DDP-parity tolerances and training loop,
a BatchNorm model, and a tiny Hugging Face GPT-2."""
from __future__ import annotations

import torch
import torch.nn as nn

from fullshard import FullyShardedDataParallel as FSDP
from tests.dist import models as M

RTOL, ATOL = 1.3e-6, 1e-5
"""Tolerances of fp32 parity with DDP (losses, parameters)."""
STEPS = 10
"""Optimizer steps of :func:`train`."""


def train(model, kind, rank, clip=True):
    """``STEPS`` AdamW steps of ``model`` (DDP or FSDP over a ``models.make_model(kind)``)
    on rank ``rank``'s batches, clipping at 0.5 when ``clip``.

    Returns:
        (per-step losses, per-step gradient norms before clipping; empty without ``clip``).
    """
    named = [(n.removeprefix("module."), p) for n, p in model.named_parameters()]
    # eps=1e-6: the attention key bias has an exactly-zero true gradient, so
    # its gradient is rounding noise (~1e-12) that Adam's normalization would
    # blow up to lr-sized steps with the default eps, for DDP and FSDP alike.
    opt = torch.optim.AdamW(M.param_groups(named), lr=1e-2, eps=1e-6)
    losses, norms = [], []
    for step in range(STEPS):
        x, y = M.batch(kind, rank, step)
        loss = M.loss_fn(kind, model, x, y)
        loss.backward()
        if clip:
            if isinstance(model, FSDP):
                norm = model.clip_grad_norm_(0.5)
            else:
                norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
            norms.append(float(norm))
        opt.step()
        opt.zero_grad(set_to_none=step % 2 == 0)
        losses.append(loss.item())
    return losses, norms


class BNBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(16, 16)
        self.bn = nn.BatchNorm1d(16)

    def forward(self, x):
        return torch.relu(self.bn(self.lin(x)))


class BNNet(nn.Module):
    """BatchNorm at the root and inside a :class:`BNBlock` (full-precision norm units)."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(7, 16)
        self.bn = nn.BatchNorm1d(16)
        self.block = BNBlock()
        self.out = nn.Linear(16, 5)

    def forward(self, x):
        return self.out(self.block(torch.relu(self.bn(self.inp(x)))))


def tiny_gpt2():
    """A 2-layer Hugging Face GPT-2 (vocabulary 61, no dropout, eval mode), built
    locally from a config. Needs ``transformers`` (callers importorskip it)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=61, n_positions=32, n_embd=16, n_layer=2, n_head=2,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return GPT2LMHeadModel(cfg).eval()  # eval: no dropout in either model


def gpt2_block_policy():
    """A unit per ``GPT2Block``."""
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block

    from fullshard.wrap import ModuleWrapPolicy

    return ModuleWrapPolicy({GPT2Block})
