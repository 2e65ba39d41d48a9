"""A small token model and a DDP-parity driver for ``fully_shard``'s methods
and construction paths (tests/dist/test_fully_shard_api.py,
tests/dist/test_fully_shard_construct.py).

:func:`parity` runs one training loop twice from the same weights: on torch
DDP and on a ``fully_shard`` model, each rank on its own batches, and compares
every snapshot the loop took (losses, full gradients or None, full weights).
Shapes are uneven on purpose: at 2 ranks the 7- and 11-row parameters split
4/3 and 6/5, at 3 ranks ``gate`` (2 rows) leaves rank 2 an empty shard.
"""
from __future__ import annotations

import copy
from typing import Callable, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel as DDP

from fullshard import fully_shard
from tests.dist.common import ATOL, RTOL

VOCAB, DIM, HIDDEN, SEQ = 11, 7, 9, 5


class Block(nn.Module):
    """Residual MLP with a 2-element gate (fewer rows than 3 ranks)."""

    def __init__(self):
        super().__init__()
        self.lin1 = nn.Linear(DIM, HIDDEN)
        self.lin2 = nn.Linear(HIDDEN, DIM)
        self.gate = nn.Parameter(torch.tensor([1.0, 0.1]))

    def forward(self, x):
        return x + self.lin2(torch.tanh(self.lin1(x))) * self.gate[0] + self.gate[1]

    def mix(self, x):
        """Uses the parameters without calling forward (register_fsdp_forward_method)."""
        return F.linear(x, self.lin2.weight @ self.lin1.weight) * self.gate[0]


class Net(nn.Module):
    """Embedding, ``layers`` blocks, norm, output head (optionally tied to the embedding)."""

    def __init__(self, tied: bool = False, layers: int = 3):
        super().__init__()
        self.tok_embeddings = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(Block() for _ in range(layers))
        self.norm = nn.LayerNorm(DIM)
        self.output = nn.Linear(DIM, VOCAB, bias=False)
        if tied:
            self.output.weight = self.tok_embeddings.weight

    def forward(self, tokens):
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h)
        return self.output(self.norm(h))

    def logits_direct(self, tokens):
        """Embedding straight into the head, reading the root's parameters without calling forward."""
        return F.linear(F.embedding(tokens, self.tok_embeddings.weight), self.output.weight)


class SkipNormNet(Net):
    """``Net`` whose forward skips ``norm`` while ``skip_norm`` is set (an unused parameter)."""

    skip_norm = False

    def forward(self, tokens):
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h)
        return self.output(h if self.skip_norm else self.norm(h))


def make(seed: int = 0, **kwargs) -> Net:
    torch.manual_seed(seed)
    return Net(**kwargs)


def shard(model: Net, **kwargs) -> Net:
    """``fully_shard`` on every block, then on the root (torchtitan's order)."""
    for layer in model.layers:
        fully_shard(layer, **kwargs)
    fully_shard(model, **kwargs)
    return model


def tokens(rank: int, step: int, batch: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, targets), each (batch, SEQ) int64, fixed by (rank, step)."""
    gen = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randint(0, VOCAB, (batch, SEQ), generator=gen), torch.randint(0, VOCAB, (batch, SEQ), generator=gen)


def loss_of(model, rank: int, step: int, method: Optional[str] = None) -> torch.Tensor:
    x, y = tokens(rank, step)
    logits = getattr(model, method)(x) if method else model(x)
    return F.cross_entropy(logits.flatten(0, 1), y.flatten())


def full(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """A detached full copy (gathers a DTensor: every rank must call it)."""
    if t is None:
        return None
    if isinstance(t, DTensor):
        t = t.full_tensor()
    return t.detach().clone()


def _named(model):
    return [(n.removeprefix("module."), p) for n, p in model.named_parameters()]


def grads(model) -> dict:
    """Full gradient (or None) per parameter name."""
    return {f"grad:{n}": full(p.grad) for n, p in _named(model)}


def params(model) -> dict:
    return {f"param:{n}": full(p) for n, p in _named(model)}


def snap(model, loss: Optional[torch.Tensor] = None) -> dict:
    out = {**grads(model), **params(model)}
    if loss is not None:
        out["loss"] = loss.detach().clone()
    return out


def train(model, opt, rank: int, steps: int = 3) -> list[dict]:
    """``steps`` plain steps (loss of batch ``step``, backward, snapshot, optimizer step, zero_grad)."""
    out = []
    for step in range(steps):
        loss = loss_of(model, rank, step)
        loss.backward()
        out.append(snap(model, loss))
        opt.step()
        opt.zero_grad()
    return out


def sgd(model) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)


def assert_same(got: list[dict], want: list[dict], rtol: float = RTOL, atol: float = ATOL) -> None:
    """Snapshots agree: same keys, None where the other is None, values within fp32 tolerance."""
    assert len(got) == len(want), (len(got), len(want))
    for i, (g, w) in enumerate(zip(got, want)):
        assert g.keys() == w.keys(), (i, sorted(g.keys() ^ w.keys()))
        for key in w:
            if w[key] is None or g[key] is None:
                assert g[key] is None and w[key] is None, f"snapshot {i} {key}: {g[key]} vs {w[key]}"
                continue
            torch.testing.assert_close(g[key], w[key], rtol=rtol, atol=atol, msg=lambda m: f"snapshot {i} {key}: {m}")


def max_diff(got: list[dict], want: list[dict]) -> float:
    """Largest |difference| over every value of the snapshots (None counts as 0)."""
    worst = 0.0
    for g, w in zip(got, want):
        for key in w:
            if g.get(key) is not None and w[key] is not None:
                worst = max(worst, (g[key].double() - w[key].double()).abs().max().item())
    return worst


def parity(rank: int, loop: Callable, *, build: Callable = make, shard_fn: Callable = shard,
           optimizer: Callable = sgd, ref_loop: Optional[Callable] = None) -> float:
    """Run ``loop(model, opt, rank, sharded)`` (returns a list of snapshots)
    on DDP and on ``shard_fn(model)`` from the same weights; assert the
    snapshots agree (``ref_loop`` replaces ``loop`` for DDP where they differ).

    Returns:
        The largest absolute difference seen (for the report).
    """
    plain = build()
    ref = DDP(copy.deepcopy(plain))
    want = (ref_loop or loop)(ref, optimizer(ref), rank, False)
    model = shard_fn(copy.deepcopy(plain))
    got = loop(model, optimizer(model), rank, True)
    assert_same(got, want)
    return max_diff(got, want)
