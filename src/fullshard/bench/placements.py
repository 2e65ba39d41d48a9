"""``python -m fullshard.bench.placements``: what a placement costs in
padding and balance for a named GPT, at shard-group sizes N = 2..8.

One unit per transformer block (``--blocks-per-unit k``: k consecutive
blocks) plus the root (embeddings, final norm), as the trainer wraps. For each N it builds the units' flat layouts
(core/flat.py) with no process group and prints, per placement:

* ``max/mean``: the largest rank's real elements over the mean (1.000 is
  perfect balance; each unit's flat shard is padded to its largest rank);
* ``padding``: padding elements summed over ranks and units, as a share of Ψ;
* ``NS max/mean``: (owned placement) the largest rank's Newton–Schulz cost,
  Σ m·n·min(m, n) over the matrices it owns, over the mean — Muon's step
  time is set by the busiest owner.

Placements: ``row`` (every parameter ``RowShard``), ``block128``
(``BlockShard(128)``), ``owned`` (the blocks' 2-D ``nn.Linear`` weights
``Owned(rank=None)``, the rest ``RowShard``: the Muon recipe).
"""
from __future__ import annotations

import argparse
import sys

import torch
import torch.nn as nn

from ..core import flat, placement
from ..models import ARCHS, build_model
from ..models.gpt import TransformerBlock


def _units(model: nn.Module, blocks_per_unit: int = 1) -> list[list[tuple[str, nn.Parameter, bool]]]:
    """Parameters per unit (fqn, param, is a block Linear weight): ``blocks_per_unit``
    consecutive blocks per unit, then the root."""
    units, taken = [], set()
    for name, mod in model.named_modules():
        if isinstance(mod, TransformerBlock):
            linear = {id(m.weight) for m in mod.modules() if isinstance(m, nn.Linear)}
            params = [(f"{name}.{n}", p, id(p) in linear and p.dim() == 2) for n, p in mod.named_parameters()]
            taken.update(id(p) for _, p, _ in params)
            if units and len(units[-1]) < blocks_per_unit * len(params):
                units[-1] += params
            else:
                units.append(params)
    units.append([(n, p, False) for n, p in model.named_parameters() if id(p) not in taken])
    return units


def _choose(kind: str, is_matrix: bool) -> placement.Placement:
    if kind == "block128":
        return placement.BlockShard(128)
    if kind == "owned" and is_matrix:
        return placement.Owned()
    return placement.RowShard()


def measure(model: nn.Module, kind: str, world: int, blocks_per_unit: int = 1) -> dict:
    """Balance and padding of ``model``'s units under placement ``kind`` at N = ``world``."""
    per_rank, padding, ns, numel, tally = [0] * world, 0, [0] * world, 0, [0] * world
    for i, params in enumerate(_units(model, blocks_per_unit)):
        requested = [_choose(kind, m) for _, _, m in params]
        placed = placement.assign_owners(f"unit{i}", requested, [p.numel() for _, p, _ in params], world, tally)
        lay = flat.make_layout([(n, p.shape, True) for n, p, _ in params], world, placed)
        for r in range(world):
            per_rank[r] += lay.rank_numel(r)
        padding += lay.unsharded_numel - lay.numel
        numel += lay.numel
        for p in lay.params:
            if p.owned and len(p.shape) == 2:
                m, n = p.shape
                ns[p.placement.rank] += m * n * min(m, n)
    mean = sum(per_rank) / world
    out = {"max_over_mean": max(per_rank) / mean, "padding_numel": padding, "padding_share": padding / numel,
           "numel": numel}
    if any(ns):
        out["ns_max_over_mean"] = max(ns) / (sum(ns) / world)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m fullshard.bench.placements", description=__doc__.split("\n\n")[0])
    p.add_argument("--arch", default="transformer_lm_gpt3_small", choices=sorted(ARCHS))
    p.add_argument("--vocab-size", type=int, default=50257)
    p.add_argument("--max-positions", type=int, default=1024)
    p.add_argument("--min-world", type=int, default=2)
    p.add_argument("--max-world", type=int, default=8)
    p.add_argument("--blocks-per-unit", type=int, default=1,
                   help="consecutive transformer blocks per unit (more matrices to balance owners over)")
    args = p.parse_args(argv)
    if not 1 <= args.min_world <= args.max_world:
        p.error(f"need 1 <= --min-world <= --max-world, got {args.min_world} and {args.max_world}")
    if args.blocks_per_unit < 1:
        p.error(f"--blocks-per-unit must be >= 1, got {args.blocks_per_unit}")
    with torch.device("meta"):
        model = build_model(args.arch, vocab_size=args.vocab_size, max_positions=args.max_positions)
    psi = sum(t.numel() for t in model.parameters())
    print(f"{args.arch}: Ψ = {psi:,} parameters, {len(_units(model, args.blocks_per_unit))} units "
          f"({args.blocks_per_unit} block(s) per unit + root)")
    print(f"{'N':>3} {'placement':>9} {'max/mean':>9} {'padding':>12} {'pad/Ψ':>8} {'NS max/mean':>12}")
    for world in range(args.min_world, args.max_world + 1):
        for kind in ("row", "block128", "owned"):
            m = measure(model, kind, world, args.blocks_per_unit)
            ns = f"{m['ns_max_over_mean']:.3f}" if "ns_max_over_mean" in m else "-"
            print(f"{world:>3} {kind:>9} {m['max_over_mean']:>9.3f} {m['padding_numel']:>12,} "
                  f"{100 * m['padding_share']:>7.3f}% {ns:>12}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
