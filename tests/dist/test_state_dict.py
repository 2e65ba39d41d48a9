"""State dicts of wrapped models against the plain model and DDP: full and
sharded model state dicts, optimizer state by name, error paths."""
from __future__ import annotations

import pytest
import torch

from tests.dist.harness import run_ranks
from tests.dist.models import batch, clone, loss_fn, make_model, param_groups, unit_policy


def _train(model, opt, kind, rank, steps):
    for step in range(steps):
        x, y = batch(kind, rank, step)
        loss_fn(kind, model, x, y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)


def _wrap(kind, strategy, seed=0):
    from fullshard import FSDP

    return FSDP(make_model(kind, seed), sharding_strategy=strategy, auto_wrap_policy=unit_policy(kind))


def _optim_by_name(plain_model, opt):
    """A plain optimizer's state keyed by parameter names (first name of tied ones)."""
    names = {}
    for n, p in plain_model.named_parameters():
        names.setdefault(id(p), n)
    return {names[id(p)]: opt.state[p] for g in opt.param_groups for p in g["params"] if p in opt.state}


def _full_and_sharded(rank, world):
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor, Shard

    from fullshard import FSDP, FullOptimStateDictConfig, FullStateDictConfig, ShardingStrategy, StateDictType

    for kind in ("mlp", "gpt"):
        for strategy in (ShardingStrategy.FULL_SHARD, ShardingStrategy.SHARD_GRAD_OP, ShardingStrategy.NO_SHARD):
            where = f"{kind} {strategy.value}"
            plain = make_model(kind)
            ddp = torch.nn.parallel.DistributedDataParallel(clone(plain))
            ddp_opt = torch.optim.AdamW(param_groups(ddp.module.named_parameters()), lr=1e-2)
            model = _wrap(kind, strategy)
            opt = torch.optim.AdamW(param_groups(model.named_parameters()), lr=1e-2)
            _train(ddp, ddp_opt, kind, rank, 2)
            _train(model, opt, kind, rank, 2)
            ref = ddp.module.state_dict()
            # Default: full tensors under the plain names, in the plain order.
            sd = model.state_dict()
            assert list(sd) == list(ref), where
            for k in ref:
                torch.testing.assert_close(sd[k], ref[k], rtol=1e-5, atol=1e-6, msg=f"{where} {k}")
            # rank0_only: other ranks get nothing; offload_to_cpu copies.
            with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT,
                                      FullStateDictConfig(offload_to_cpu=True, rank0_only=True),
                                      FullOptimStateDictConfig(rank0_only=True)):
                r0 = model.state_dict()
                osd0 = FSDP.optim_state_dict(model, opt)
            assert (list(r0) == list(ref)) if rank == 0 else (r0 == {} and osd0 == {}), where
            # Optimizer state by original name, full.
            osd = FSDP.optim_state_dict(model, opt)
            ref_state = _optim_by_name(ddp.module, ddp_opt)
            assert set(osd["state"]) == set(ref_state), where
            for name, st in ref_state.items():
                for k, v in st.items():
                    torch.testing.assert_close(osd["state"][name][k], v, rtol=1e-4, atol=1e-6,
                                               msg=f"{where} {name}/{k}")
            assert osd["param_groups"][0]["params"][0] in ref, where
            # Sharded: DTensor(Shard(0)) whose local tensor IS the shard (no copy).
            with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
                ssd = model.state_dict()
                FSDP.optim_state_dict(model, opt)  # must not raise (values: not checked here)
            local = dict(model.named_parameters())
            for k, v in ssd.items():
                if isinstance(v, DTensor):
                    assert strategy is not ShardingStrategy.NO_SHARD
                    assert v.placements == (Shard(0),) and v.shape == ref[k].shape, (where, k)
                    if k in local:
                        assert v.to_local().data_ptr() == local[k].data_ptr() or local[k].numel() == 0
                    torch.testing.assert_close(v.full_tensor(), sd[k], rtol=0, atol=0)
                else:
                    torch.testing.assert_close(v, sd[k], rtol=0, atol=0)
            # Full and sharded state dicts load into a fresh model and optimizer,
            # which then continue exactly like the original.
            for sd_type in (StateDictType.FULL_STATE_DICT, StateDictType.SHARDED_STATE_DICT):
                with FSDP.state_dict_type(model, sd_type):
                    msd, mosd = model.state_dict(), FSDP.optim_state_dict(model, opt)
                fresh = _wrap(kind, strategy, seed=5)
                fresh_opt = torch.optim.AdamW(param_groups(fresh.named_parameters()), lr=1e-2)
                with FSDP.state_dict_type(fresh, sd_type):
                    fresh.load_state_dict(msd)
                    fresh_opt.load_state_dict(FSDP.optim_state_dict_to_load(fresh, fresh_opt, mosd))
                for m, o in ((fresh, fresh_opt), (model, opt)):
                    _train(m, o, kind, rank, 1)
                got, want = fresh.state_dict(), model.state_dict()
                for k in want:
                    torch.testing.assert_close(got[k], want[k], rtol=0, atol=0, msg=f"{where} {sd_type} {k}")
            # A plain model's state dict loads; and the plain model loads ours.
            other = make_model(kind, seed=7)
            model.load_state_dict(other.state_dict())
            back = make_model(kind, seed=9)
            back.load_state_dict(model.state_dict())
            for k, v in other.state_dict().items():
                torch.testing.assert_close(back.state_dict()[k], v, rtol=0, atol=0)
            dist.barrier()
    return True


@pytest.mark.fast
def test_full_and_sharded_state_dicts_match_ddp():
    """Default/full/sharded model and optimizer state dicts vs DDP; round trips; rank0_only."""
    run_ranks(_full_and_sharded, 2)


def _errors(rank, world):
    from fullshard import FSDP, ShardingStrategy, StateDictType

    model = _wrap("mlp", ShardingStrategy.FULL_SHARD)
    sd = make_model("mlp").state_dict()
    bad = dict(sd)
    bad.pop("inp.weight")
    bad["extra.weight"] = torch.zeros(1)
    before = model.state_dict()
    with pytest.raises(RuntimeError, match=r"(?s)\[rank \d\] Error\(s\) in loading state_dict.*Missing key\(s\) "
                                           r"in state_dict: \"inp.weight\".*Unexpected key\(s\) in state_dict: "
                                           r"\"extra.weight\""):
        model.load_state_dict(bad)
    for k, v in model.state_dict().items():  # a load that raised changed no shard
        torch.testing.assert_close(v, before[k], rtol=0, atol=0)
    keys = model.load_state_dict(bad, strict=False)
    assert keys.missing_keys == ["inp.weight"] and keys.unexpected_keys == ["extra.weight"]
    wrong = dict(sd, **{"out.weight": torch.zeros(5, 4)})
    with pytest.raises(RuntimeError, match=r"size mismatch for out.weight: copying a param with shape "
                                           r"torch.Size\(\[5, 4\]\) from checkpoint, the shape in current model is "
                                           r"torch.Size\(\[5, 3\]\)"):
        model.load_state_dict(wrong)
    with pytest.raises(ValueError, match="StateDictType"):
        FSDP.set_state_dict_type(model, "sharded")
    hybrid = FSDP(make_model("mlp"), sharding_strategy=ShardingStrategy.HYBRID_SHARD)
    with FSDP.state_dict_type(hybrid, StateDictType.SHARDED_STATE_DICT):
        with pytest.raises(NotImplementedError, match="HYBRID_SHARD"):
            hybrid.state_dict()
    # A nested unit gives its own subtree under names relative to it.
    inner = [u for u in model.units() if u is not model][0]
    assert list(inner.state_dict()) == list(make_model("mlp").inner.state_dict())
    return True


def test_state_dict_errors():
    """Strict errors list names; shape mismatch named; HYBRID sharded refused; nested units."""
    run_ranks(_errors, 2)
