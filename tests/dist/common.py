"""Helpers shared by several multi-process test modules (test modules import
from here, never from each other): DDP-parity tolerances and training loop,
both front doors behind one call (:func:`shard`, :func:`no_sync`), a
BatchNorm model, and a tiny Hugging Face GPT-2."""
from __future__ import annotations

import os

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel as DDP

from fullshard import BlockShard, FSDPModule, FullyShardedDataParallel as FSDP, Owned, ShardingStrategy, fully_shard
from fullshard.core.module import UnitModule
from fullshard.train.sharding import no_sync  # noqa: F401 (either API's no_sync, for the suites)
from fullshard.wrap import recursive_wrap
from tests.dist import models as M


class Tokens:
    """A fixed synthetic token dataset: item i is (input (T,), target (T,)) int64 ids below ``vocab``, as
    TokenBlockDataset's."""

    def __init__(self, n: int, seed: int, vocab: int, T: int):
        self.data = torch.randint(0, vocab, (n, T + 1), generator=torch.Generator().manual_seed(seed))

    def __len__(self) -> int:
        return self.data.size(0)

    def __getitem__(self, i: int):
        return self.data[i, :-1], self.data[i, 1:]

RTOL, ATOL = 1.3e-6, 1e-5
"""Tolerances of fp32 parity with DDP (losses, parameters)."""
BF16_RTOL = 1.6e-2
"""Relative tolerance of bf16 (param dtype) losses against :func:`ddp_bf16_losses` (absolute: 1e-3)."""
STEPS = 10
"""Optimizer steps of :func:`train`."""
FULLY_SHARD = "fully_shard"
"""Where a test takes a ``ShardingStrategy`` for the wrapper: ``fullshard.fully_shard`` (torch FSDP2's API)."""


# FULLSHARD_TEST_PLACEMENT=<name> runs every wrapper test of :func:`shard`
# under that placement (tests/dist/test_placements.py runs the usage patterns so).
PLACEMENT_FNS = {
    "owned": lambda p: Owned(),
    "block": lambda p: BlockShard(2),
}


def shard(base: nn.Module, how, policy=None, **kwargs) -> nn.Module:
    """``base`` sharded by either front door.

    Args:
        base: the plain model (changed in place by ``fully_shard``).
        how: a ``ShardingStrategy`` for ``FullyShardedDataParallel``, or
            :data:`FULLY_SHARD`: ``fully_shard`` on every module the auto-wrap
            ``policy`` picks (children before parents, as users apply it
            per block), then on ``base``.
        policy: an auto-wrap policy (``fullshard.wrap``) or None (one unit).
        kwargs: the wrapper's or ``fully_shard``'s keyword arguments.
    Returns:
        The wrapper, or ``base`` itself (now an ``FSDPModule``).
    """
    if how != FULLY_SHARD:
        placed = PLACEMENT_FNS.get(os.environ.get("FULLSHARD_TEST_PLACEMENT", ""))
        if placed is not None:
            kwargs = {"shard_placement_fn": placed, **kwargs}
        return FSDP(base, sharding_strategy=ShardingStrategy(how), auto_wrap_policy=policy, **kwargs)

    def shard_child(child, name, skip_param_ids):
        if isinstance(child, (nn.ModuleList, nn.ModuleDict)):
            return child  # no forward to hook: fully_shard refuses it, as torch's does; the parent's unit takes it
        # A weight tied to a module outside ``child`` goes to an enclosing unit, as under auto-wrap.
        skip = {p for p in child.parameters() if id(p) in skip_param_ids}
        return fully_shard(child, ignored_params=skip or None, **kwargs)
    if policy is not None:
        recursive_wrap(base, policy, shard_child, set(), lambda m: isinstance(m, FSDPModule))
    return fully_shard(base, **kwargs)


def label(how) -> str:
    """A readable name of a :func:`shard` ``how``."""
    return how if how == FULLY_SHARD else ShardingStrategy(how).value


def unwrap(model: nn.Module) -> nn.Module:
    """The user's module: DDP's and the wrapper's ``.module``, a ``fully_shard`` model itself."""
    return model if isinstance(model, FSDPModule) or not hasattr(model, "module") else model.module


def is_sharded(model: nn.Module) -> bool:
    """Whether ``model`` fronts a fullshard unit (either front door)."""
    return isinstance(model, UnitModule)




def full(tensor: torch.Tensor) -> torch.Tensor:
    """A detached copy of ``tensor``, all-gathered if it is a DTensor (a collective then)."""
    return (tensor.full_tensor() if isinstance(tensor, DTensor) else tensor).detach().clone()


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


def ddp_bf16_losses(base: nn.Module, rank: int, steps: int = STEPS) -> list[float]:
    """Per-step losses of DDP under the casting of a bf16 param dtype with fp32
    reduction, on ``base`` (a ``models.make_model("gpt")``) and rank ``rank``'s
    batches: a bf16 model copy computes forward/backward, gradients are
    averaged in fp32 and AdamW steps fp32 master weights that are cast back to
    bf16 after each step. No clipping. (DDP's own ``mixed_precision`` needs
    CUDA events, so it is spelled out.)"""
    low = M.clone(base).to(torch.bfloat16)
    ddp = DDP(low)
    names = [n for n, _ in low.named_parameters()]
    master = [p.detach().float().clone().requires_grad_(True) for p in low.parameters()]
    opt = torch.optim.AdamW(M.param_groups(list(zip(names, master))), lr=1e-2, eps=1e-6)
    # fp32 gradient reduction: DDP's comm hook averages an fp32 copy of each bucket.
    ddp.register_comm_hook(None, _fp32_allreduce_hook)
    losses = []
    for step in range(steps):
        x, y = M.batch("gpt", rank, step)
        loss = M.loss_fn("gpt", ddp, x, y)
        loss.backward()
        with torch.no_grad():
            for m, p in zip(master, low.parameters()):
                m.grad = p.grad.float()
                p.grad = None
            opt.step()
            opt.zero_grad()
            for m, p in zip(master, low.parameters()):
                p.copy_(m)
        losses.append(loss.item())
    return losses


def _fp32_allreduce_hook(state, bucket):
    buf = bucket.buffer()
    full = buf.float().div_(dist.get_world_size())
    fut = dist.all_reduce(full, async_op=True).get_future()
    return fut.then(lambda f: f.value()[0].to(buf.dtype))


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
