"""Placements on the flat shard (core/placement.py [Note: placements]):
RowShard, BlockShard and Owned give DDP's result under every sharding
strategy, at 2, 3 and 4 ranks, through the usage patterns the wrapper
supports; and the layout, state dicts and checkpoints follow them."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from fullshard import BlockShard, FullyShardedDataParallel as FSDP, Owned, RowShard, ShardingStrategy, shard_info
from tests.dist import models as M
from tests.dist.common import ATOL, RTOL, train
from tests.dist.harness import run_ranks

PLACEMENTS = {
    "owned": lambda p: Owned() if p.dim() == 2 else None,
    "owned0": lambda p: Owned(rank=0),
    "block3": lambda p: BlockShard(3),
    "mixed": lambda p: Owned() if p.dim() == 2 and p.shape[0] % 2 else (BlockShard(2) if p.dim() == 1 else RowShard()),
}


def _strategies(world):
    out = [(ShardingStrategy.FULL_SHARD, None), (ShardingStrategy.SHARD_GRAD_OP, None)]
    if world == 4:
        rank = dist.get_rank()
        shard_groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
        rep_groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
        out.append((ShardingStrategy.HYBRID_SHARD, (shard_groups[rank // 2], rep_groups[rank % 2])))
    return out


def _check_rows(model, name):
    """The placement reached the layout: each parameter's local rows are the ones its bounds name."""
    for n, p in model.named_parameters():
        info = shard_info(p)
        assert info is not None, n
        lo, hi = info.row_range
        rows = info.shape[0] if info.shape else 1
        assert (p.shape[0] if p.dim() else p.numel()) == hi - lo, (n, p.shape, info)
        if name == "owned0":
            assert info.owner == 0 and (hi - lo == rows) == (info.rank == 0), (n, info)
        if name == "block3" and info.world > 1:
            assert all(b % 3 == 0 or b == rows for b in (lo, hi)), (n, info)


def _parity(rank, world, kinds, names):
    worst = 0.0
    for kind in kinds:
        base = M.make_model(kind)
        ref = DDP(M.clone(base))
        ref_losses, ref_norms = train(ref, kind, rank)
        ref_params = {n.removeprefix("module."): p.detach() for n, p in ref.named_parameters()}
        for strategy, pg in _strategies(world):
            for name in names:
                model = FSDP(M.clone(base), process_group=pg, sharding_strategy=strategy,
                             auto_wrap_policy=M.unit_policy(kind), shard_placement_fn=PLACEMENTS[name])
                _check_rows(model, name)
                losses, norms = train(model, kind, rank)
                where = f"{kind} {strategy.value} {name} world={world}"
                torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses),
                                           rtol=RTOL, atol=ATOL, msg=lambda m: f"{where} losses: {m}")
                torch.testing.assert_close(torch.tensor(norms), torch.tensor(ref_norms),
                                           rtol=1e-5, atol=ATOL, msg=lambda m: f"{where} grad norms: {m}")
                worst = max(worst, max(abs(a - b) for a, b in zip(losses, ref_losses)))
                with model.summon_full_params():
                    full = dict(model.named_parameters())
                    for n, p in full.items():
                        torch.testing.assert_close(p, ref_params[n], rtol=RTOL, atol=ATOL,
                                                   msg=lambda m: f"{where} param {n}: {m}")
    return worst


@pytest.mark.parametrize("world", [pytest.param(2, marks=pytest.mark.fast), 3, 4])
def test_placements_match_ddp(world):
    worst = run_ranks(_parity, world, ["mlp", "frozen", "gpt"], list(PLACEMENTS))
    print(f"world={world}: largest per-step loss difference to DDP = {max(worst):.3e}")


def _trained(rank, kind, name, steps=3):
    """A wrapped model under placement ``name`` after ``steps`` AdamW steps, and its optimizer."""
    model = FSDP(M.make_model(kind), auto_wrap_policy=M.unit_policy(kind),
                 shard_placement_fn=PLACEMENTS[name] if name else None)
    named = [(n, p) for n, p in model.named_parameters()]
    opt = torch.optim.AdamW(M.param_groups(named), lr=1e-2, eps=1e-6)
    for step in range(steps):
        x, y = M.batch(kind, rank, step)
        M.loss_fn(kind, model, x, y).backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def _full_state(model, opt):
    """Full parameters and full optimizer state as numpy, by name (collective)."""
    from fullshard import FullOptimStateDictConfig, FullStateDictConfig, StateDictType
    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, FullStateDictConfig(rank0_only=False),
                              FullOptimStateDictConfig(rank0_only=False)):
        sd = {k: v.detach().clone().numpy() for k, v in model.state_dict().items()}
        osd = FSDP.optim_state_dict(model, opt)
    state = {f"{n}.{k}": v.detach().clone().numpy() for n, s in osd["state"].items()
             for k, v in s.items() if torch.is_tensor(v)}
    return sd, state


def _save(rank, world, kind, name, path):
    from fullshard import checkpoint
    model, opt = _trained(rank, kind, name)
    checkpoint.save(path, model, opt)
    return _full_state(model, opt)


def _load(rank, world, kind, name, path):
    from fullshard import checkpoint
    model, opt = _trained(rank, kind, name, steps=0)
    checkpoint.init_optim_state(opt)
    checkpoint.load(path, model, opt)
    sharded = _sharded_round_trip(model, name)
    return _full_state(model, opt), sharded


def _sharded_round_trip(model, name):
    """SHARDED_STATE_DICT of a block/owned model holds torch.chunk rows, and loads back bit for bit."""
    from torch.distributed.tensor import DTensor, Shard

    from fullshard import StateDictType
    with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
        sd = {k: v.detach().clone() for k, v in model.state_dict().items()}  # RowShard values view the shards
        for k, v in sd.items():
            if isinstance(v, DTensor):
                assert v.placements == (Shard(0),), (k, v.placements)
                assert torch.equal(v.full_tensor(), v.full_tensor()), k
        before = {k: p.detach().clone() for k, p in model.named_parameters()}
        with torch.no_grad():
            for p in model.parameters():
                p.zero_()
        model.load_state_dict(sd)
    return all(torch.equal(p, before[k]) for k, p in model.named_parameters())


@pytest.mark.parametrize("kind", ["gpt"])
def test_checkpoints_reshard_across_placements_and_world_sizes(kind, tmp_path):
    path = str(tmp_path / "ck")
    saved = run_ranks(_save, 2, kind, "owned", path)[0]
    for world, name in ((2, None), (3, "block3"), (2, "mixed"), (3, "owned")):
        loaded, sharded_ok = zip(*run_ranks(_load, world, kind, name, path))
        assert all(sharded_ok), (world, name)
        sd, state = loaded[0]
        assert sd.keys() == saved[0].keys() and state.keys() == saved[1].keys(), (world, name)
        for k in sd:
            assert (sd[k] == saved[0][k]).all(), (world, name, k)
        for k in state:
            assert (state[k] == saved[1][k]).all(), (world, name, k)


def _fully_shard_refuses(rank, world):
    from fullshard import fully_shard
    out = []
    for fn in (lambda p: Owned(), lambda p: BlockShard(2)):
        try:
            fully_shard(M.vector_scale(M.make_model("mlp")), shard_placement_fn=fn)
        except ValueError as e:
            out.append(str(e))
    model = fully_shard(M.vector_scale(M.make_model("mlp")), shard_placement_fn=lambda p: RowShard())
    out.append(all(shard_info(p).placement == RowShard() for p in model.parameters()))
    return out


@pytest.mark.fast
def test_fully_shard_takes_row_placements_and_refuses_ragged_ones():
    msgs = run_ranks(_fully_shard_refuses, 2)[0]
    assert len(msgs) == 3 and msgs[2] is True, msgs
    for m in msgs[:2]:
        assert "fully_shard presents parameters as DTensor(Shard(0))" in m and "FullyShardedDataParallel" in m, m


@pytest.mark.parametrize("name", ["owned", "block"])
def test_usage_patterns_under_placements(name, monkeypatch):
    """Every usage pattern of tests/dist/test_patterns.py (no_sync, frozen and
    unused parameters, exceptions, stored outputs, ...) under the placement:
    its ranks read FULLSHARD_TEST_PLACEMENT (tests/dist/common.shard)."""
    from tests.dist import test_patterns

    monkeypatch.setenv("FULLSHARD_TEST_PLACEMENT", name)
    cases = [fn for key, fn in vars(test_patterns).items() if key.startswith("test_") and callable(fn)]
    assert len(cases) >= 4, cases
    for case in cases:
        case()


def _free_clip(rank, world):
    """fullshard.clip_grad_norm_ on the wrapper's plain shards (row and owned) is DDP's norm."""
    import fullshard
    kind = "gpt"
    base = M.make_model(kind)
    ref = DDP(M.clone(base))
    out = []
    x, y = M.batch(kind, rank, 0)
    M.loss_fn(kind, ref, x, y).backward()
    want = [float(torch.nn.utils.clip_grad_norm_(ref.parameters(), 1e9, p)) for p in (1.0, 2.0, float("inf"))]
    for name in (None, "owned", "mixed"):
        model = FSDP(M.clone(base), auto_wrap_policy=M.unit_policy(kind),
                     shard_placement_fn=PLACEMENTS[name] if name else None)
        M.loss_fn(kind, model, x, y).backward()
        got = [float(fullshard.clip_grad_norm_(model.parameters(), 1e9, p)) for p in (1.0, 2.0, float("inf"))]
        out.append((name, got, want))
    return out


@pytest.mark.fast
def test_free_clip_grad_norm_sums_the_wrappers_shards():
    for name, got, want in run_ranks(_free_clip, 2)[0]:
        for g, w in zip(got, want):
            assert abs(g - w) <= 1e-5 * w, (name, got, want)
