"""Per-rank bytes of the parameter shards and of the optimizer state, parameter by parameter, as
`fullshard train` shards a GPT (one unit per ``TransformerBlock``, the root unit for the rest) and
as each ``--optimizer`` keeps its state: what ``fullshard plan`` reports.

[Note: optimizer state per rank]
Rank r of N keeps rows ``[lo_r, hi_r)`` of a parameter of shape ``(R, *rest)`` (``c`` elements per
row); ``n_r = hi_r - lo_r``. RowShard gives every rank a slot of ``ceil(R / N)`` rows (trailing
ranks hold fewer real rows); Owned puts all R rows on one rank, chosen per unit by
``core.placement.assign_owners`` (largest first, to the least-loaded rank; ties to the rank owning
least in earlier units). State elements of
rank r, fp32 like the master parameters:

* adam, cpu_adam, lamb: two moments, ``2·n_r·c``;
* muon: the Muon matrices (2-D block weights, ``Owned`` under fully_sharded): one momentum buffer
  ``R·c`` on the owner only; the AdamW parameters ``2·n_r·c``;
* adafactor: a matrix ``(R, C)`` keeps a row factor for its rows and a column factor for all its
  columns, ``n_r + C`` on every rank of the group, also one holding no rows (factored second
  moment, Shazeer & Stern 2018, §3); a vector keeps its full variance, ``n_r``.

Scalars (``step``) are not counted. Under NO_SHARD (N = 1) every rank holds everything. Muon is
counted as the wrapper places it (``--fsdp-version 1``); under ``fully_shard`` its momentum is
row-sharded like Adam's moments (``n_r·c``, one moment).
"""
from __future__ import annotations

import dataclasses
import math
from typing import Sequence

import torch

from fullshard import optim as fullshard_optim
from fullshard.core.flat import make_layout
from fullshard.core.placement import Owned, RowShard, assign_owners, normalize
from fullshard.models import TransformerBlock

OPTIMIZER_STATE = {
    "adam": "Adam moments (fp32)", "cpu_adam": "Adam moments (fp32)",
    "muon": "Muon momentum + AdamW moments (fp32)", "adafactor": "Adafactor factors (fp32)",
    "lamb": "LAMB moments (fp32)",
}
"""``--optimizer`` -> what its state is called in the plan."""


@dataclasses.dataclass(frozen=True)
class ParamRecord:
    """One parameter as sharded: full shape, and whether it is a Muon matrix (Owned under muon)."""

    shape: tuple
    muon: bool = False

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclasses.dataclass(frozen=True)
class UnitRecord:
    """One unit: its name (the owner assignment's tie-break) and its parameters in order."""

    name: str
    params: tuple


def gpt_units(model: torch.nn.Module) -> tuple:
    """The units `fullshard train` makes of an unwrapped GPT (meta is fine) with the wrapper
    (``--fsdp-version 1``): each ``TransformerBlock`` named by its module path, then the root
    (named by its class, as ``FullyShardedDataParallel`` names it) with the parameters left, a tied
    parameter once, where it is first met. Muon matrices are those ``muon_placement_fn`` places
    ``Owned``."""
    placement_of = fullshard_optim.muon_placement_fn(model)
    seen, units = set(), []
    blocks = [(name, m) for name, m in model.named_modules() if isinstance(m, TransformerBlock)]
    for name, module in blocks + [(type(model).__name__, model)]:
        records = []
        for fqn, p in module.named_parameters():
            if id(p) in seen:
                continue
            seen.add(id(p))
            owned = isinstance(normalize(placement_of(p), fqn), Owned)
            records.append(ParamRecord(tuple(p.shape), owned))
        units.append(UnitRecord(name, tuple(records)))
    return tuple(units)


def _layouts(units: Sequence[UnitRecord], world: int, owned: bool) -> list:
    """The engine's layout of each unit at ``world`` ranks (Muon matrices Owned when ``owned``), built
    in construction order: owners balance within a unit, ties go to the rank owning least so far."""
    tally = [0] * world
    out = []
    for unit in units:
        places = [Owned() if owned and p.muon else RowShard() for p in unit.params]
        places = assign_owners(unit.name, places, [p.numel for p in unit.params], world, tally)
        out.append(make_layout([(str(i), torch.Size(p.shape), True) for i, p in enumerate(unit.params)], world,
                               places))
    return out


def shard_elements(units: Sequence[UnitRecord], world: int, owned: bool) -> int:
    """Elements of one rank's flat shards over all units (padding included: each row-sharded
    parameter's slot of ``ceil(R / N)`` rows, then the largest rank's owned parameters)."""
    return sum(layout.shard_numel for layout in _layouts(units, world, owned))


def _adafactor_elements(local: torch.Size) -> int:
    """``fullshard.optim.Adafactor``'s state of a tensor with these local rows (torch's shapes on
    them): ``row_var`` (the last dim reduced) and ``col_var`` (dim -2 reduced) for >= 2-D, which a
    rank holding no rows of a matrix keeps too (the column sums are the whole group's);
    ``variance`` for the rest."""
    if len(local) < 2:
        return local.numel()
    return math.prod(local[:-1]) + math.prod(local[:-2]) * local[-1]


def state_elements(units: Sequence[UnitRecord], optimizer: str, world: int) -> list:
    """Optimizer-state elements of each rank of ``world`` (see [Note: optimizer state per rank]).

    Raises:
        ValueError: an unknown ``optimizer``.
    """
    if optimizer not in OPTIMIZER_STATE:
        raise ValueError(f"unknown optimizer {optimizer!r}; one of {', '.join(OPTIMIZER_STATE)}")
    out = [0] * world
    for unit, layout in zip(units, _layouts(units, world, optimizer == "muon")):
        for p, lay in zip(unit.params, layout.params):
            for r in range(world):
                n = lay.local_rows(r)
                if optimizer == "muon" and p.muon:
                    out[r] += n * lay.row_numel  # all R rows on the owner, none elsewhere
                elif optimizer == "adafactor":
                    out[r] += _adafactor_elements(lay.local_shape(r))
                else:
                    out[r] += 2 * n * lay.row_numel
    return out
