"""Cases that run inside the ranks of tests/dist/test_fully_shard_checkpoint.py on a ``fully_shard`` Llama
trained SPLIT steps: torch.distributed.checkpoint.state_dict's API (against the plain model and torch FSDP2),
``nn.Module.state_dict`` / ``load_state_dict`` (also while units are gathered), and the FSDP1 helpers.

Every function asserts on its own rank; a failure is re-raised by the harness with the rank.
"""
from __future__ import annotations

import re

import pytest
import torch
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
    set_state_dict,
)
from torch.distributed.tensor import DTensor, Shard

from fullshard import FullyShardedDataParallel as FSDP, StateDictType
from tests.dist.llama import build_plain, token_batch

SPLIT = 3
"""Optimizer steps taken before these cases (the ``step`` the optimizer state must hold)."""
RTOL, ATOL = 1e-5, 1e-6
OPTIONS = [(full, cpu) for full in (True, False) for cpu in (True, False)]
FULL = StateDictOptions(full_state_dict=True)
MISSING = "layers.1.feed_forward.w2.weight"
"""The key left out by the strict cases."""


def _same(a, b, what: str) -> None:
    """Bitwise equality of two state dicts (DTensors: placements and local shards)."""
    if isinstance(a, dict):
        assert list(a) == list(b), f"{what}: keys differ"
        for k in a:
            _same(a[k], b[k], f"{what}/{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), what
        for i, (x, y) in enumerate(zip(a, b)):
            _same(x, y, f"{what}[{i}]")
    elif isinstance(a, DTensor):
        assert isinstance(b, DTensor) and a.placements == b.placements and a.shape == b.shape, what
        assert torch.equal(a.to_local(), b.to_local()), what
    elif torch.is_tensor(a):
        assert type(a) is type(b) and torch.equal(a, b), what
    else:
        assert a == b, what


def _copy(state):
    """A state dict with every tensor cloned, as a checkpoint file gives it: get_* values alias the live
    model and optimizer (``step`` tensors and sharded optimizer state too), and ``Optimizer.load_state_dict``
    keeps tensors it need not convert, so an in-process round trip would share them between two optimizers."""
    if isinstance(state, dict):
        return {k: _copy(v) for k, v in state.items()}
    if isinstance(state, (list, tuple)):
        return type(state)(_copy(v) for v in state)
    return state.clone() if torch.is_tensor(state) else state


def _check_value(value, ref: torch.Tensor, full: bool, cpu: bool, rank: int, world: int, what: str) -> None:
    """A full plain tensor close to the plain model's, or a Shard(0) DTensor holding this rank's chunk of it."""
    assert value.shape == ref.shape, what
    if full:
        assert type(value) is torch.Tensor, f"{what}: {type(value).__name__}, not a plain tensor"
        torch.testing.assert_close(value, ref, rtol=RTOL, atol=ATOL, msg=lambda m: f"{what}: {m}")
    else:
        assert isinstance(value, DTensor) and value.placements == (Shard(0),), what
        assert value.device_mesh.size() == world, what
        rows = torch.chunk(ref, world)[rank]
        torch.testing.assert_close(value.to_local(), rows, rtol=RTOL, atol=ATOL, msg=lambda m: f"{what}: {m}")
    if cpu:
        assert value.device.type == "cpu", what


def dsd_cases(rank, world, model, opt, torch_model, torch_opt, plain, plain_opt, build, optimizer) -> dict:
    """get_* with every option against the plain model (names, values) and torch FSDP2 (bits); set_* into
    fresh models; strict errors. Returns {case: (model, optimizer)} loaded at SPLIT, for the caller to train
    on and compare with the uninterrupted run."""
    plain_sd = plain.state_dict()
    params = [name for name, _ in plain.named_parameters()]
    plain_optim = {name: plain_opt.state[p] for name, p in plain.named_parameters()}
    for full, cpu in OPTIONS:
        where = f"full_state_dict={full} cpu_offload={cpu}"
        options = StateDictOptions(full_state_dict=full, cpu_offload=cpu)
        model_sd = get_model_state_dict(model, options=options)
        optim_sd = get_optimizer_state_dict(model, opt, options=options)
        both = get_state_dict(model, opt, options=options)
        theirs = get_state_dict(torch_model, torch_opt, options=options)
        _same(both, (model_sd, optim_sd), f"{where}: get_state_dict vs get_model/optimizer_state_dict")
        _same(both, theirs, f"{where}: fully_shard vs torch FSDP2")
        if full and cpu and rank != 0:  # torch's contract: rank 0 alone holds a full cpu_offload state dict
            assert model_sd == {} and optim_sd == {}, where
            continue
        assert list(model_sd) == list(plain_sd), where
        assert list(optim_sd["state"]) == params and optim_sd["param_groups"][0]["params"] == params, where
        for name, ref in plain_sd.items():
            _check_value(model_sd[name], ref, full, cpu, rank, world, f"{where} {name}")
        for name in params:
            state = optim_sd["state"][name]
            assert set(state) == {"step", "exp_avg", "exp_avg_sq"}, (where, name)
            assert type(state["step"]) is torch.Tensor and state["step"].item() == SPLIT, (where, name)
            for key in ("exp_avg", "exp_avg_sq"):
                _check_value(state[key], plain_optim[name][key], full, cpu, rank, world, f"{where} {name}/{key}")
    _strict_cases(model, opt, build, optimizer)
    return _round_trips(model, opt, build, optimizer)


def _round_trips(model, opt, build, optimizer) -> dict:
    """set_* of each form into a model with other weights and a fresh optimizer: the same state, bitwise."""
    want = get_state_dict(model, opt, options=FULL)
    loaded = {}
    for full, cpu in OPTIONS:
        where = f"set_* of full_state_dict={full} cpu_offload={cpu}"
        model_sd, optim_sd = _copy(get_state_dict(model, opt, options=StateDictOptions(full_state_dict=full,
                                                                                       cpu_offload=cpu)))
        target = build("fully_shard", seed=1)
        target_opt = optimizer(target)
        if full and cpu:  # torch's contract: rank 0's dicts, broadcast; set_state_dict would skip the
            options = StateDictOptions(full_state_dict=True, cpu_offload=True, broadcast_from_rank0=True)
            result = set_model_state_dict(target, model_sd, options=options)  # model where its dict is empty
            set_optimizer_state_dict(target, target_opt, optim_sd, options=options)
        elif cpu:
            options = StateDictOptions(full_state_dict=full, cpu_offload=cpu)
            result = set_model_state_dict(target, model_sd, options=options)
            set_optimizer_state_dict(target, target_opt, optim_sd, options=options)
        else:
            options = StateDictOptions(full_state_dict=full, strict=not full)
            result = set_state_dict(target, target_opt, model_state_dict=model_sd, optim_state_dict=optim_sd,
                                    options=options)
        assert not result.missing_keys and not result.unexpected_keys, (where, result)
        _same(get_state_dict(target, target_opt, options=FULL), want, where)
        loaded[where] = (target, target_opt)
    return loaded


def _strict_cases(model, opt, build, optimizer) -> None:
    """Missing and unexpected keys: errors that name them (strict), reported keys otherwise."""
    sd = model.state_dict()
    partial = {k: v for k, v in sd.items() if k != MISSING}
    target = build("fully_shard", seed=1)
    target_opt = optimizer(target)
    named = rf"Missing key\(s\) in state_dict: \"{re.escape(MISSING)}\""
    with pytest.raises(RuntimeError, match=named):
        target.load_state_dict(partial)
    with pytest.raises(RuntimeError, match=named):
        set_model_state_dict(target, partial)
    result = set_model_state_dict(target, partial, options=StateDictOptions(strict=False))
    assert result.missing_keys == [MISSING] and result.unexpected_keys == [], result
    got, want = get_model_state_dict(target, options=FULL), get_model_state_dict(model, options=FULL)
    for name in want:
        ref = build_plain(seed=1).state_dict()[name] if name == MISSING else want[name]
        assert torch.equal(got[name], ref), f"strict=False load: {name}"
    optim_sd = get_optimizer_state_dict(model, opt)
    optim_sd = {"state": {k: v for k, v in optim_sd["state"].items() if k != MISSING},
                "param_groups": optim_sd["param_groups"]}
    with pytest.raises(RuntimeError, match=f"Missing optimizer state for parameter '{re.escape(MISSING)}'"):
        set_optimizer_state_dict(target, target_opt, optim_sd)
    with pytest.raises(RuntimeError, match=r"Unexpected key\(s\) in state_dict: \"bogus\""):
        target.load_state_dict({**sd, "bogus": torch.zeros(1)})


def load_cases(rank, world, model, build) -> None:
    """model.state_dict() is Shard(0) DTensors under the plain names; load_state_dict (and set_model_state_dict)
    of it works on a fresh model, and also on one whose units are gathered at the time (torch FSDP2 reshards
    first), after which a forward reads the loaded weights."""
    sd = model.state_dict()
    assert list(sd) == list(build_plain().state_dict())
    full = get_model_state_dict(model, options=FULL)
    for name, value in sd.items():
        assert isinstance(value, DTensor) and value.placements == (Shard(0),), name
        assert torch.equal(value.to_local(), torch.chunk(full[name], world)[rank]), name
    inputs, labels = token_batch(0, rank, world)
    reference = build("fully_shard", seed=1)
    result = reference.load_state_dict(sd)
    assert not result.missing_keys and not result.unexpected_keys, result
    _same(get_model_state_dict(reference, options=FULL), full, "load_state_dict(model.state_dict())")
    with torch.no_grad():
        want = reference(inputs)
    for setup in ("unshard()", "reshard_after_backward=False", "forward without backward"):
        for how in ("load_state_dict", "set_model_state_dict sharded", "set_model_state_dict full"):
            target = build("fully_shard", seed=1)
            if setup == "unshard()":
                target.unshard()
            elif setup == "reshard_after_backward=False":
                target.set_reshard_after_backward(False)
                torch.nn.functional.cross_entropy(target(inputs).flatten(0, 1), labels.flatten()).backward()
                target.zero_grad()
            else:
                with torch.no_grad():
                    target(inputs)
            if how == "load_state_dict":
                target.load_state_dict(sd)
            elif how == "set_model_state_dict sharded":
                set_model_state_dict(target, sd)
            else:
                set_model_state_dict(target, full, options=FULL)
            with torch.no_grad():
                got = target(inputs)
            assert torch.equal(got, want), f"{how} after {setup}: the forward read other weights"


def _raises(call, pattern: str, what: str) -> None:
    try:
        call()
    except ValueError as e:
        assert re.search(pattern, str(e)), f"{what}: {e}"
        return
    raise AssertionError(f"{what} did not raise")


def fsdp1_helper_cases(model, opt, wrapper, wrapper_opt) -> None:
    """FSDP1's helpers on a fully_shard model, and torch's state-dict API with an optimizer on the FSDP1
    wrapper, raise one error naming the API to use; the wrapper's model-only calls give its full weights."""
    to_dsd = r"fully_shard.*torch\.distributed\.checkpoint\.state_dict"
    calls = {
        "FSDP.optim_state_dict": lambda: FSDP.optim_state_dict(model, opt),
        "FSDP.optim_state_dict_to_load": lambda: FSDP.optim_state_dict_to_load(
            model, opt, get_optimizer_state_dict(model, opt)),
        "FSDP.set_state_dict_type": lambda: FSDP.set_state_dict_type(model, StateDictType.SHARDED_STATE_DICT),
        "FSDP.state_dict_type": lambda: FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT).__enter__(),
    }
    for what, call in calls.items():
        _raises(call, to_dsd, what)
    assert all(isinstance(v, DTensor) for v in model.state_dict().values()), "a refused call changed the type"
    to_ours = r"FullyShardedDataParallel.*fullshard\.checkpoint\.save"
    calls = {
        "get_state_dict": lambda: get_state_dict(wrapper, wrapper_opt),
        "get_optimizer_state_dict": lambda: get_optimizer_state_dict(wrapper, wrapper_opt, options=FULL),
        "set_optimizer_state_dict": lambda: set_optimizer_state_dict(wrapper, wrapper_opt, {}),
        "set_state_dict": lambda: set_state_dict(wrapper, wrapper_opt, model_state_dict={}, optim_state_dict={}),
    }
    for what, call in calls.items():
        _raises(call, to_ours, what)
    full = get_model_state_dict(model, options=FULL)
    for options in (StateDictOptions(), FULL):
        _same(get_model_state_dict(wrapper, options=options), full, f"get_model_state_dict(wrapper, {options})")
