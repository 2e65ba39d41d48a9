"""fullshard.optim's state in checkpoints (checkpoint/optim.py [Note: declared
state layouts]): the full optimizer state dict of a sharded run equals the
single-device optimizer's state (Adafactor's (R, 1) row and (1, C) column
statistics included), and fullshard.checkpoint.save / load round-trips it
across world sizes and placements, through both front doors."""
from __future__ import annotations

import numpy as np
import torch
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)

from fullshard import (
    BlockShard,
    FullOptimStateDictConfig,
    FullStateDictConfig,
    FullyShardedDataParallel as FSDP,
    StateDictType,
    checkpoint,
    optim,
)
from tests.dist import optim_cases as O
from tests.dist.common import FULLY_SHARD
from tests.dist.harness import run_ranks

PLACE = {None: None, "owned": optim.muon_placement_fn, "block2": lambda base: (lambda p: BlockShard(2))}
OPTS = {
    "adafactor": (lambda g: optim.Adafactor(g, weight_decay=0.01),
                  lambda g: torch.optim.Adafactor(g, weight_decay=0.01), None),
    "lamb": (lambda g: optim.Lamb(g, lr=0.01), lambda g: optim.Lamb(g, lr=0.01), None),
    "muon": (lambda g: optim.Muon(g, lr=0.02), O.RefMuon, lambda m: optim.muon_param_groups(m, adamw={"lr": 3e-3})),
}


def full_optim_state(model, opt) -> dict:
    """``{"<param>.<key>": numpy}`` of the full optimizer state, on every rank (collective)."""
    if isinstance(model, FSDP):
        with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, FullStateDictConfig(rank0_only=False),
                                  FullOptimStateDictConfig(rank0_only=False)):
            state = FSDP.optim_state_dict(model, opt)["state"]
    else:
        state = get_optimizer_state_dict(model, opt, options=StateDictOptions(full_state_dict=True))["state"]
    return {f"{n}.{k}": v.detach().cpu().numpy().copy() for n, s in state.items() for k, v in s.items()
            if torch.is_tensor(v)}


def _reference_state(ref, ref_opt) -> dict:
    opts = ref_opt.opts if isinstance(ref_opt, O.RefMuon) else [ref_opt]
    names = {id(p): n for n, p in ref.named_parameters()}
    return {f"{names[id(p)]}.{k}": v.detach().numpy().copy() for o in opts for p, s in o.state.items()
            for k, v in s.items()}


def _full_matches_one_device(rank, world, cases):
    out = {}
    for how, opt_name, place in cases:
        make, ref_make, groups = OPTS[opt_name]
        model, opt, ref, ref_opt, _ = O.run_pair(rank, world, how, make, ref_make, PLACE[place], steps=2,
                                                 groups=groups)
        got, want = full_optim_state(model, opt), _reference_state(ref, ref_opt)
        where = f"{opt_name} {how} {place}"
        assert got.keys() == want.keys(), (where, sorted(got.keys() ^ want.keys()))
        worst = 0.0
        for k in want:
            assert got[k].shape == want[k].shape, (where, k, got[k].shape, want[k].shape)
            worst = max(worst, float(np.abs(got[k].astype(np.float64) - want[k]).max(initial=0.0)))
        assert worst == 0.0 if opt_name == "muon" else worst < 1e-6, (where, worst)
        out[where] = worst
        if how == "FULL_SHARD" and place is None:  # rank0_only: the other ranks pass {} to the load, as in torch
            configs = (StateDictType.FULL_STATE_DICT, FullStateDictConfig(rank0_only=True),
                       FullOptimStateDictConfig(rank0_only=True))
            with FSDP.state_dict_type(model, *configs):
                osd = FSDP.optim_state_dict(model, opt)
            assert bool(osd) == (rank == 0), where
            fresh, fresh_opt = _trained(rank, world, how, opt_name, place, 0)
            with FSDP.state_dict_type(fresh, *configs):
                fresh_opt.load_state_dict(FSDP.optim_state_dict_to_load(fresh, fresh_opt, osd))
            again = full_optim_state(fresh, fresh_opt)
            assert again.keys() == got.keys() and all(np.array_equal(again[k], got[k]) for k in got), where
        if how == FULLY_SHARD:  # torch's full-state load scatters it into a fresh optimizer's DTensors
            fresh, fresh_opt = _trained(rank, world, how, opt_name, place, 0)
            set_optimizer_state_dict(fresh, fresh_opt, get_optimizer_state_dict(
                model, opt, options=StateDictOptions(full_state_dict=True)),
                options=StateDictOptions(full_state_dict=True))
            again = full_optim_state(fresh, fresh_opt)
            assert again.keys() == got.keys() and all(np.array_equal(again[k], got[k]) for k in got), where
    return out


def test_full_optim_state_matches_one_device():
    cases = [("FULL_SHARD", "adafactor", None), ("FULL_SHARD", "adafactor", "owned"),
             ("SHARD_GRAD_OP", "adafactor", "block2"), (FULLY_SHARD, "adafactor", None),
             ("FULL_SHARD", "lamb", "block2"), (FULLY_SHARD, "lamb", None), ("FULL_SHARD", "muon", "owned")]
    for where, worst in sorted(run_ranks(_full_matches_one_device, 3, cases)[0].items()):
        print(f"{where}: max |full optimizer state - one device| = {worst:.3e}")


def _trained(rank, world, how, opt_name, place, steps):
    make, _, groups = OPTS[opt_name]
    base = O.make_net()
    model = O.wrap(base, how, world, PLACE[place](base) if PLACE[place] else None)
    opt = make(groups(model) if groups else model.parameters())
    for step in range(steps):
        O.loss(model, rank, step).backward()
        opt.step()
        opt.zero_grad()
    return model, opt


ROUND_TRIPS = [("FULL_SHARD", "adafactor", None, "block2"), ("FULL_SHARD", "muon", "owned", "owned"),
               ("FULL_SHARD", "lamb", "owned", None), (FULLY_SHARD, "adafactor", None, None)]
"""(front door, optimizer, placement saved at 2 ranks, placement loaded at 3 ranks)."""


def _numpy_params(model) -> dict:
    return {k: v.numpy() for k, v in O.full_state(model)[0].items()}


def _save(rank, world, root):
    out = []
    for i, (how, opt_name, place, _) in enumerate(ROUND_TRIPS):
        model, opt = _trained(rank, world, how, opt_name, place, 2)
        checkpoint.save(f"{root}/{i}", model, opt)
        out.append((full_optim_state(model, opt), _numpy_params(model)))
    return out


def _load(rank, world, root):
    out = []
    for i, (how, opt_name, _, place) in enumerate(ROUND_TRIPS):
        model, opt = _trained(rank, world, how, opt_name, place, 0)
        checkpoint.load(f"{root}/{i}", model, opt)
        out.append((full_optim_state(model, opt), _numpy_params(model)))
    return out


def test_checkpoint_round_trip_across_world_sizes(tmp_path):
    saved = run_ranks(_save, 2, str(tmp_path))[0]
    loaded = run_ranks(_load, 3, str(tmp_path))[0]
    for case, (saved_state, saved_params), (loaded_state, loaded_params) in zip(ROUND_TRIPS, saved, loaded):
        assert loaded_state.keys() == saved_state.keys(), case
        for k in saved_state:
            assert np.array_equal(loaded_state[k], saved_state[k]), (case, k)
        for k in saved_params:
            assert np.array_equal(loaded_params[k], saved_params[k]), (case, k)


def _freezing_run(rank, world, how, root, resume: bool, warm: bool = False):
    """AdamW for 4 steps: parameter A trains at step 0 and is frozen at step 1 (it has state), B is frozen
    at steps 0-1 (no state yet); both train at steps 2-3. ``resume``: saved after step 1 and loaded into a
    fresh model whose B already trains (its state is not in the checkpoint) and whose A is frozen (its
    state is). ``warm``: the fresh optimizer took a step with A frozen before the load, so it holds state
    for every parameter but A."""
    def fresh():
        model = O.wrap(O.make_net(), how, world)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    model, opt = fresh()
    a, b = list(model.parameters())[:2]
    for step in range(4):
        a.requires_grad_(step != 1)
        b.requires_grad_(step >= 2)
        if resume and step == 2:
            checkpoint.save(root, model, opt)
            model, opt = fresh()
            a, b = list(model.parameters())[:2]
            a.requires_grad_(False)  # frozen when loaded; its saved state must stay for later
            if warm:
                O.loss(model, rank, 9).backward()
                opt.step()
                opt.zero_grad()
            checkpoint.load(root, model, opt)
            a.requires_grad_(True)
        O.loss(model, rank, step).backward()
        opt.step()
        opt.zero_grad()
    return _numpy_params(model)


def _freezing(rank, world, root):
    out = {}
    for how in ("FULL_SHARD", FULLY_SHARD):
        want = _freezing_run(rank, world, how, f"{root}/{how}", resume=False)
        for warm in (False, True):
            got = _freezing_run(rank, world, how, f"{root}/{how}", resume=True, warm=warm)
            out[how, warm] = max(float(np.abs(got[k] - want[k]).max()) for k in want)
    return out


def test_frozen_and_stateless_parameters_resume_as_uninterrupted(tmp_path):
    """checkpoint.load keeps the saved optimizer state of a parameter frozen when loaded (dropped before:
    0.017 off after unfreezing) and gives none to one the checkpoint has none for (refused before, "Missing
    key in checkpoint"), as optimizer.load_state_dict does, also when the optimizer holds state for the
    other parameters (A's saved state was dropped then: 2.5e-2 off); the run then equals the uninterrupted
    one."""
    worst = run_ranks(_freezing, 2, str(tmp_path))[0]
    assert all(v == 0.0 for v in worst.values()), worst
