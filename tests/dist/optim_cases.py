"""Cases of tests/dist/test_optim.py: a small model with uneven shapes, both
front doors under every strategy, and steps of a sharded optimizer against
a single-device reference fed the same (gathered) gradients."""
from __future__ import annotations

import copy

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from fullshard import FullyShardedDataParallel as FSDP, ShardingStrategy, fully_shard
from fullshard.wrap import ModuleWrapPolicy
from tests.dist.common import FULLY_SHARD

VOCAB = 11


class Block(nn.Module):
    """Linear(6, 9) -> GELU -> Linear(9, 6), a (4, 3, 2) tensor mixing, and a (1, 6) gate."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(6, 9)
        self.fc2 = nn.Linear(9, 6)
        self.mix = nn.Parameter(torch.randn(4, 3, 2) * 0.3)
        self.gate = nn.Linear(6, 1, bias=False)

    def forward(self, x):
        mixed = torch.einsum("btij,kij->btk", x.unflatten(-1, (3, 2)), self.mix)
        return x + self.fc2(F.gelu(self.fc1(x))) * torch.sigmoid(self.gate(x)) + F.pad(mixed, (0, 2))


class Net(nn.Module):
    """Embedding(11, 6), two blocks, LayerNorm, an untied (11, 6) head: rows no world size divides."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 6)
        self.blocks = nn.ModuleList([Block(), Block()])
        self.norm = nn.LayerNorm(6)
        self.head = nn.Linear(6, VOCAB, bias=False)

    def forward(self, tokens):
        x = self.embed(tokens)
        for b in self.blocks:
            x = b(x)
        return self.head(self.norm(x))


def make_net() -> Net:
    torch.manual_seed(0)
    return Net()


def loss(model, rank: int, step: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1000 * rank + step)
    tokens = torch.randint(0, VOCAB, (2, 9), generator=gen)
    out = model(tokens[:, :-1])
    return F.cross_entropy(out.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))


def hybrid_groups():
    """(shard group, replicate group) of this rank for 4 ranks as 2 x 2 (every rank creates all groups)."""
    rank = dist.get_rank()
    shard = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    rep = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    return shard[rank // 2], rep[rank % 2]


def wrap(base: nn.Module, how, world: int, placement=None) -> nn.Module:
    """``base`` sharded one unit per Block plus the root, by ``how``: a ShardingStrategy value
    (FullyShardedDataParallel) or FULLY_SHARD (2-D mesh under HYBRID at 4 ranks when ``how`` is
    ``("fully_shard", "hybrid")``)."""
    kw = {} if placement is None else {"shard_placement_fn": placement}
    if isinstance(how, tuple):  # fully_shard on a (replicate, shard) mesh
        from torch.distributed.device_mesh import init_device_mesh
        kw["mesh"] = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
        how = FULLY_SHARD
    if how == FULLY_SHARD:
        for b in base.blocks:
            fully_shard(b, **kw)
        return fully_shard(base, **kw)
    if how == "HYBRID_SHARD":
        kw["process_group"] = hybrid_groups()
    return FSDP(base, sharding_strategy=ShardingStrategy[how], auto_wrap_policy=ModuleWrapPolicy({Block}), **kw)


def full_state(model) -> tuple[dict, dict]:
    """Full parameters and gradients by name (collective on every rank)."""
    if isinstance(model, FSDP):
        with model.summon_full_params(with_grads=True):
            return ({n: p.detach().clone() for n, p in model.named_parameters()},
                    {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    params, grads = {}, {}
    for n, p in model.named_parameters():
        params[n] = (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
        if p.grad is not None:
            grads[n] = (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).clone()
    return params, grads


def compare(rank: int, world: int, how, make_opt, make_ref, placement=None, steps: int = 3,
            groups=None) -> float:
    """Steps of ``make_opt(groups(model))`` on the sharded model and of
    ``make_ref(groups(reference))`` on a plain copy fed the same full
    gradients; returns the largest |difference| of the parameters over the
    steps (checked after every step)."""
    return run_pair(rank, world, how, make_opt, make_ref, placement, steps, groups)[-1]


def run_pair(rank: int, world: int, how, make_opt, make_ref, placement=None, steps: int = 3, groups=None):
    """:func:`compare`'s run: (model, optimizer, reference, reference optimizer, largest difference)."""
    groups = groups or (lambda m: m.parameters())
    base = make_net()
    ref = copy.deepcopy(base)
    model = wrap(base, how, world, placement(base) if placement is not None else None)
    opt = make_opt(groups(model))
    ref_opt = make_ref(groups(ref))
    named_ref = dict(ref.named_parameters())
    worst = 0.0
    for step in range(steps):
        loss(model, rank, step).backward()
        _, grads = full_state(model)
        for n, p in named_ref.items():
            p.grad = grads[n].clone() if n in grads else None
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        params, _ = full_state(model)
        for n, p in named_ref.items():
            worst = max(worst, (params[n] - p.detach()).abs().max().item())
    return model, opt, ref, ref_opt, worst


class RefMuon:
    """torch.optim.Muon on the ``use_muon`` groups and torch.optim.AdamW (betas (0.9, 0.95), eps 1e-8,
    fullshard.optim.Muon's recipe defaults) on the others: the single-device reference."""

    def __init__(self, groups, lr=0.02, weight_decay=0.1):
        groups = list(groups)
        muon = [g["params"] for g in groups if g.get("use_muon", True)]
        adamw = [g for g in groups if not g.get("use_muon", True)]
        self.opts = [torch.optim.Muon([p for ps in muon for p in ps], lr=lr, weight_decay=weight_decay)]
        if adamw:
            self.opts.append(torch.optim.AdamW([{"params": g["params"], "lr": g.get("lr", lr)} for g in adamw],
                                               betas=(0.9, 0.95), eps=1e-8, weight_decay=weight_decay))

    def step(self):
        for o in self.opts:
            o.step()
