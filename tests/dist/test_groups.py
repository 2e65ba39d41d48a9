"""Units on process groups other than the world (issue 15 item 3): two
different models on disjoint groups of a 4-rank world, per-rank experts on
singleton groups inside a world-sharded model, HYBRID_SHARD groups that do
not start at rank 0. Construction, training, clipping, state dicts and
optimizer state dicts must use each unit's own groups."""
from __future__ import annotations

import os

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from tests.dist.harness import run_ranks
from tests.dist.models import batch, clone, loss_fn, make_model, param_groups, unit_policy

STEPS = 3
MAX_NORM = 0.5
# (sharding strategy value, sync_module_states) of the two-model case.
TWO_MODEL_CONFIGS = [("FULL_SHARD", True), ("FULL_SHARD", False), ("SHARD_GRAD_OP", True),
                     ("NO_SHARD", True), ("NO_SHARD", False)]
# (root unit's sharding strategy value, sync_module_states) of the expert case.
EXPERT_CONFIGS = [("FULL_SHARD", False), ("FULL_SHARD", True), ("NO_SHARD", False)]


def _groups():
    """Every group the cases use, created in the same order on every rank."""
    import torch.distributed as dist

    return {
        "pairs": [dist.new_group([0, 1]), dist.new_group([2, 3])],
        "singles": [dist.new_group([r]) for r in range(4)],
        # HYBRID (shard, replicate) groups whose shard-rank-0 ranks {0, 1} are
        # not the lowest of every replicate group ({2, 3} starts at shard rank 1).
        "shard": [dist.new_group([0, 3]), dist.new_group([1, 2])],
        "rep": [dist.new_group([2, 3])],  # {0, 1} is pairs[0]
        # Replicas that hold different shard indices (rank 0 is shard rank 0,
        # its replica rank 3 shard rank 1): not a hybrid layout.
        "latin_shard": [dist.new_group([0, 2]), dist.new_group([1, 3])],
        "latin_rep": [dist.new_group([1, 2])],  # {0, 3} is shard[0]
    }


def _train(model, opt, kind, rank, steps, clip):
    norms = []
    for step in range(steps):
        x, y = batch(kind, rank, step)
        loss_fn(kind, model, x, y).backward()
        norms.append(float(clip(model)))
        opt.step()
        opt.zero_grad(set_to_none=True)
    return norms


def _fsdp_clip(model):
    return model.clip_grad_norm_(MAX_NORM)


def _ddp_clip(model):
    return torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)


def _optim_by_name(plain_model, opt):
    names = {}
    for n, p in plain_model.named_parameters():
        names.setdefault(id(p), n)
    return {names[id(p)]: opt.state[p] for g in opt.param_groups for p in g["params"] if p in opt.state}


def _adamw(named):
    return torch.optim.AdamW(param_groups(named), lr=1e-2, eps=1e-6)


def _assert_same_sd(got, want, where, rtol=1e-5, atol=1e-6):
    assert list(got) == list(want), (where, list(got), list(want))
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=rtol, atol=atol, msg=f"{where} {k}")


def _round_trip(model, opt, make_fresh, kind, rank, where):
    """Full and sharded model + optimizer state dicts load into a fresh model,
    which then continues exactly like the original."""
    from fullshard import FSDP, StateDictType

    for sd_type in (StateDictType.FULL_STATE_DICT, StateDictType.SHARDED_STATE_DICT):
        with FSDP.state_dict_type(model, sd_type):
            msd, mosd = model.state_dict(), FSDP.optim_state_dict(model, opt)
        fresh = make_fresh()
        fresh_opt = _adamw(fresh.named_parameters())
        with FSDP.state_dict_type(fresh, sd_type):
            fresh.load_state_dict(msd)
            fresh_opt.load_state_dict(FSDP.optim_state_dict_to_load(fresh, fresh_opt, mosd))
        for m, o in ((fresh, fresh_opt), (model, opt)):
            _train(m, o, kind, rank, 1, _fsdp_clip)
        _assert_same_sd(fresh.state_dict(), model.state_dict(), f"{where} {sd_type.value}", rtol=0, atol=0)


def _save_load(model, opt, fresh, kind, rank, path, where):
    """fullshard.checkpoint save and load over the model's own ranks."""
    from fullshard import FSDP, checkpoint

    checkpoint.save(path, model, opt, extra={"rank": rank})
    fresh_opt = _adamw(fresh.named_parameters())
    assert checkpoint.load(path, fresh, fresh_opt) == {"rank": rank}, where
    _assert_same_sd(fresh.state_dict(), model.state_dict(), f"{where} checkpoint", rtol=0, atol=0)
    got, want = FSDP.optim_state_dict(fresh, fresh_opt), FSDP.optim_state_dict(model, opt)
    assert got["param_groups"] == want["param_groups"], where
    for name, st in want["state"].items():
        for k, v in st.items():
            torch.testing.assert_close(got["state"][name][k], v, rtol=0, atol=0, msg=f"{where} {name}/{k}")


# --------------------------------------------------- (a) two models, two groups
def _two_models(rank, groups, tmp):
    from torch.distributed.tensor import DTensor
    from torch.nn.parallel import DistributedDataParallel as DDP

    from fullshard import FSDP, FullOptimStateDictConfig, FullStateDictConfig, ShardingStrategy, StateDictType

    gi = rank // 2
    pair = groups["pairs"][gi]
    kind = ("mlp", "gpt")[gi]  # two different models side by side
    for strategy, sync in [(ShardingStrategy(s), sync) for s, sync in TWO_MODEL_CONFIGS]:
        where = f"two models: {kind} on ranks {[2 * gi, 2 * gi + 1]}, {strategy.value}, sync={sync}"
        # sync: every rank initializes differently, the group's first rank wins
        # (as under DDP). No sync: a seed per group, so the two groups differ
        # and only a world-wide check would complain.
        base = make_model(kind, seed=rank if sync else 10 + gi)
        ddp = DDP(clone(base), process_group=pair)
        ddp_opt = _adamw(ddp.module.named_parameters())
        model = FSDP(clone(base), process_group=pair, sharding_strategy=strategy,
                     auto_wrap_policy=unit_policy(kind), sync_module_states=sync)
        opt = _adamw(model.named_parameters())
        ref_norms = _train(ddp, ddp_opt, kind, rank, STEPS, _ddp_clip)
        norms = _train(model, opt, kind, rank, STEPS, _fsdp_clip)
        torch.testing.assert_close(torch.tensor(norms), torch.tensor(ref_norms), rtol=1e-5, atol=1e-6,
                                   msg=lambda m: f"{where} grad norms: {m}")
        ref = ddp.module.state_dict()
        _assert_same_sd(model.state_dict(), ref, where)
        osd = FSDP.optim_state_dict(model, opt)
        ref_state = _optim_by_name(ddp.module, ddp_opt)
        assert set(osd["state"]) == set(ref_state), where
        for name, st in ref_state.items():
            for k, v in st.items():
                torch.testing.assert_close(osd["state"][name][k], v, rtol=1e-4, atol=1e-6, msg=f"{where} {name}/{k}")
        # rank0_only keeps the state on the group's first rank (ranks 0 and 2).
        with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, FullStateDictConfig(rank0_only=True),
                                  FullOptimStateDictConfig(rank0_only=True)):
            r0, osd0 = model.state_dict(), FSDP.optim_state_dict(model, opt)
        if rank % 2 == 0:
            assert list(r0) == list(ref) and set(osd0["state"]) == set(ref_state), where
        else:
            assert r0 == {} and osd0 == {}, where
        # Sharded: DTensors on a mesh over the unit's own group.
        with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
            ssd = model.state_dict()
        for k, v in ssd.items():
            if isinstance(v, DTensor):
                assert v.device_mesh.mesh.flatten().tolist() == [2 * gi, 2 * gi + 1], (where, k)
                torch.testing.assert_close(v.full_tensor(), ref[k], rtol=1e-5, atol=1e-6, msg=f"{where} {k}")
            else:
                assert strategy is ShardingStrategy.NO_SHARD or v.dim() == 0 or k not in dict(
                    ddp.module.named_parameters()), (where, k)
        with model.summon_full_params(writeback=False, rank0_only=True):
            full = {n: p.shape for n, p in model.named_parameters()}
        want = {n: p.shape for n, p in ddp.module.named_parameters()}
        if rank % 2 == 0:
            assert full == want, where
        elif strategy is not ShardingStrategy.NO_SHARD:  # NO_SHARD shards are whole
            assert full != want, where

        def fresh():
            return FSDP(make_model(kind, seed=20 + gi), process_group=pair, sharding_strategy=strategy,
                        auto_wrap_policy=unit_policy(kind))

        _round_trip(model, opt, fresh, kind, rank, where)
        if sync:  # each group saves to its own directory at the same time
            _save_load(model, opt, fresh(), kind, rank, os.path.join(tmp, f"{kind}-{strategy.value}"), where)
    # Not in lockstep: only the first group takes state dicts and steps again;
    # nothing may wait for the other group's ranks.
    if gi == 0:
        for sd_type in (StateDictType.FULL_STATE_DICT, StateDictType.SHARDED_STATE_DICT):
            with FSDP.state_dict_type(model, sd_type):
                model.state_dict()
                FSDP.optim_state_dict(model, opt)
        with model.summon_full_params():
            pass
        _train(model, opt, kind, rank, 1, _fsdp_clip)


# ------------------------------------------------------ (b) per-rank experts
class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(16, 16)

    def forward(self, x):
        return torch.relu(self.lin(x))


class Expert(nn.Module):
    """Per-rank values: parameters and a buffer."""

    def __init__(self, seed: int):
        super().__init__()
        torch.manual_seed(seed)
        self.up = nn.Linear(16, 24)
        self.down = nn.Linear(24, 16)
        self.register_buffer("gain", torch.full((16,), 1.0 + seed / 1000))

    def forward(self, x):
        return self.down(torch.tanh(self.up(x))) * self.gain


class MoE(nn.Module):
    """Shared layers (one model over the world) around one expert per rank."""

    def __init__(self, shared_seed: int, expert_seed: int):
        super().__init__()
        torch.manual_seed(shared_seed)
        self.inp = nn.Linear(7, 16)
        self.block = Block()
        self.out = nn.Linear(16, 5)
        self.expert = Expert(expert_seed)

    def forward(self, x):
        h = self.block(self.inp(x))
        return self.out(h + self.expert(h))


def _wrap_moe(moe, single, sync, strategy):
    from fullshard import FSDP

    # Nested by hand: auto_wrap_policy refuses a model that already holds a unit (as torch FSDP1 does).
    moe.expert = FSDP(moe.expert, process_group=single, sync_module_states=sync)
    moe.block = FSDP(moe.block, sync_module_states=sync, sharding_strategy=strategy)
    return FSDP(moe, sync_module_states=sync, sharding_strategy=strategy)


def _reference_moe(rank, world):
    """DDP semantics by hand: shared gradients averaged over ranks, each
    expert's gradient its own; the clip norm is the norm of every parameter
    of the distributed model (shared once, every rank's expert once)."""
    import torch.distributed as dist

    ref = MoE(0, 100 + rank)
    opt = _adamw(ref.named_parameters())
    norms = []
    for step in range(STEPS):
        x, y = batch("mlp", rank, step)
        F.mse_loss(ref(x), y).backward()
        shared = [p for n, p in ref.named_parameters() if not n.startswith("expert.")]
        expert = [p for n, p in ref.named_parameters() if n.startswith("expert.")]
        for p in shared:
            dist.all_reduce(p.grad)
            p.grad.div_(world)
        expert_sq = torch.stack([p.grad.pow(2).sum() for p in expert]).sum().reshape(1)
        dist.all_reduce(expert_sq)
        total = (torch.stack([p.grad.pow(2).sum() for p in shared]).sum() + expert_sq[0]).sqrt()
        coef = torch.clamp(MAX_NORM / (total + 1e-6), max=1.0)
        for p in shared + expert:
            p.grad.mul_(coef)
        norms.append(float(total))
        opt.step()
        opt.zero_grad(set_to_none=True)
    return ref, opt, norms


def _experts(rank, groups, tmp):
    import torch.distributed as dist

    from fullshard import FSDP, ShardingStrategy

    world = dist.get_world_size()
    single = groups["singles"][rank]
    ref, ref_opt, ref_norms = _reference_moe(rank, world)
    for strategy, sync in [(ShardingStrategy(s), sync) for s, sync in EXPERT_CONFIGS]:
        where = f"experts in a {strategy.value} model, sync={sync}"
        # sync: the shared layers differ per rank and take rank 0's values; an
        # expert keeps its own (its group is this rank alone).
        model = _wrap_moe(MoE(rank if sync else 0, 100 + rank), single, sync, strategy)
        expert_unit = model.expert
        assert expert_unit.unit.cfg.dp_world_size == 1, where
        opt = _adamw(model.named_parameters())
        norms = _train(model, opt, "mlp", rank, STEPS, _fsdp_clip)
        torch.testing.assert_close(torch.tensor(norms), torch.tensor(ref_norms), rtol=1e-5, atol=1e-6,
                                   msg=lambda m: f"{where} grad norms: {m}")
        _assert_same_sd(model.state_dict(), ref.state_dict(), where)
        osd = FSDP.optim_state_dict(model, opt)
        ref_state = _optim_by_name(ref, ref_opt)
        assert set(osd["state"]) == set(ref_state), where
        for name, st in ref_state.items():
            for k, v in st.items():
                torch.testing.assert_close(osd["state"][name][k], v, rtol=1e-4, atol=1e-6, msg=f"{where} {name}/{k}")
        _round_trip(model, opt, lambda: _wrap_moe(MoE(5, 200 + rank), single, False, strategy), "mlp", rank,
                    where)
    # A checkpoint keys by name: the experts (one name, four values) would collapse to one.
    from fullshard import checkpoint
    with pytest.raises(checkpoint.CheckpointError, match=r"unit 'Expert' is held by ranks \[\d\], the model by "
                                                         r"ranks \[0, 1, 2, 3\]"):
        checkpoint.save(os.path.join(tmp, "experts"), model, opt)


# ------------------------------------------------------------- HYBRID groups
def _hybrid(rank, groups, tmp):
    from torch.nn.parallel import DistributedDataParallel as DDP

    from fullshard import FSDP, ShardingStrategy

    shard = groups["shard"][0 if rank in (0, 3) else 1]
    rep = groups["pairs"][0] if rank in (0, 1) else groups["rep"][0]
    base = make_model("mlp", seed=rank)  # every rank differs: rank 0's values must win everywhere
    ddp = DDP(clone(base))
    ddp_opt = _adamw(ddp.module.named_parameters())
    model = FSDP(clone(base), process_group=(shard, rep), sharding_strategy=ShardingStrategy.HYBRID_SHARD,
                 auto_wrap_policy=unit_policy("mlp"), sync_module_states=True)
    opt = _adamw(model.named_parameters())
    _assert_same_sd(model.state_dict(), ddp.module.state_dict(), "hybrid after sync", rtol=0, atol=0)
    ref_norms = _train(ddp, ddp_opt, "mlp", rank, STEPS, _ddp_clip)
    norms = _train(model, opt, "mlp", rank, STEPS, _fsdp_clip)
    torch.testing.assert_close(torch.tensor(norms), torch.tensor(ref_norms), rtol=1e-5, atol=1e-6)
    _assert_same_sd(model.state_dict(), ddp.module.state_dict(), "hybrid trained")
    # Replicas that hold different shards: one clear error, not mixed shards.
    latin_shard = groups["latin_shard"][rank % 2]
    latin_rep = groups["shard"][0] if rank in (0, 3) else groups["latin_rep"][0]
    with pytest.raises(ValueError, match=r"\[rank \d\] unit 'NestedMLP': HYBRID_SHARD replicate group"):
        FSDP(make_model("mlp"), process_group=(latin_shard, latin_rep),
             sharding_strategy=ShardingStrategy.HYBRID_SHARD)


def _all_cases(rank, world, tmp):
    groups = _groups()
    _two_models(rank, groups, tmp)
    _experts(rank, groups, tmp)
    _hybrid(rank, groups, tmp)
    return True


def test_units_use_their_own_groups(tmp_path):
    """(a) two models on ranks {0,1} and {2,3} match DDP on their group, and
    save / load their state dicts and checkpoints independently; (b) per-rank
    experts on singleton groups inside a world-sharded model match the
    hand-computed reference; HYBRID groups sync from rank 0 and a layout
    whose replicas hold different shards is refused."""
    run_ranks(_all_cases, 4, str(tmp_path), timeout_s=300)
