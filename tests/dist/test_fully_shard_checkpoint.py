"""``fully_shard`` with ``torch.distributed.checkpoint``: the state-dict API, one checkpoint format across
torch FSDP2, ``fullshard.fully_shard`` and ``FullyShardedDataParallel``, ``fullshard consolidate``, and the
FSDP1 helpers on a ``fully_shard`` model.

The model is tests/dist/llama.py's Llama (blocks sharded, then the root), trained with AdamW on
world-size-independent batches. At 2 ranks the three systems train bit for bit alike (asserted), so every
checkpoint written by one of them at step SPLIT, read by any reader, must give the writer's state bit for bit
and then train on to the uninterrupted run's weights bit for bit; at 4 ranks (DCP reshards; other
reduction order) the state is still exact and the final weights agree within fp32 tolerance.
"""
from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from tests.dist.harness import run_ranks

# Not in the fast tier (make test-fast): several spawned groups; make test runs it.

LR, EPS, STEPS, SPLIT = 1e-2, 1e-6, 6, 3
"""AdamW learning rate and eps (1e-6: see test_llama_reference), steps per run, the step saved at."""
RTOL, ATOL = 1e-5, 1e-6
"""fp32 tolerance: another world size sums gradients in another order; plain vs sharded likewise."""
WRITERS = ("torch", "fully_shard", "wrapper", "fully_shard+fullshard.checkpoint")
"""torch FSDP2 and fully_shard: dcp.save of get_state_dict's dicts (examples/train_llama.py);
FullyShardedDataParallel: fullshard.checkpoint.save (what the trainer does); fully_shard through it too."""
READERS = ("torch", "fully_shard", "fully_shard+fullshard.checkpoint", "wrapper", "wrapper+dcp")
"""The first three mirror the writers; "wrapper" is fullshard.checkpoint.load, "wrapper+dcp" torch FSDP1's
documented flow (SHARDED_STATE_DICT + FSDP.optim_state_dict + dcp.load)."""
ALL_PAIRS = [(writer, reader) for writer in WRITERS for reader in READERS]
"""Read at 2 ranks, where the saving run was."""
RESHARDED_PAIRS = sorted({(writer, "fully_shard") for writer in WRITERS} | {("fully_shard", r) for r in READERS})
"""Read at 4 ranks: every checkpoint into fully_shard, and fully_shard's into every reader."""
UNEVEN_PAIRS = [("torch", "fully_shard"), ("fully_shard", "torch"), ("wrapper", "fully_shard"),
                ("fully_shard", "wrapper")]
"""Read at 3 ranks (uneven shards): fully_shard against each other system, both ways."""


# --------------------------------------------------------------------------------- building and training
def _build(system: str, seed: int = 0):
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    from fullshard import FullyShardedDataParallel, fully_shard
    from fullshard.wrap import ModuleWrapPolicy
    from tests.dist.llama import TransformerBlock, build_plain

    model = build_plain(seed=seed)
    if system == "wrapper":
        return FullyShardedDataParallel(model, auto_wrap_policy=ModuleWrapPolicy({TransformerBlock}))
    shard = torch_fully_shard if system == "torch" else fully_shard
    for block in model.layers.values():
        shard(block)
    shard(model)
    return model


def _optimizer(model):
    return torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1, eps=EPS)


def _train(model, opt, rank, world, first, steps):
    from tests.dist.llama import token_batch

    for step in range(first, first + steps):
        inputs, labels = token_batch(step, rank, world)
        torch.nn.functional.cross_entropy(model(inputs).flatten(0, 1), labels.flatten()).backward()
        opt.step()
        opt.zero_grad()


def _numpy(state: dict) -> dict:
    """Copies (get_state_dict's ``step`` values are the optimizer's live tensors, even when full)."""
    return {k: _numpy(v) if isinstance(v, dict) else v.detach().cpu().numpy().copy() for k, v in state.items()}


def _full_state(system: str, model, opt) -> tuple[dict, dict]:
    """(model, optimizer state by name) as full numpy arrays, every rank (collective)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    from fullshard import FullyShardedDataParallel

    if system.startswith("wrapper"):
        return _numpy(model.state_dict()), _numpy(FullyShardedDataParallel.optim_state_dict(model, opt)["state"])
    model_sd, optim_sd = get_state_dict(model, opt, options=StateDictOptions(full_state_dict=True))
    return _numpy(model_sd), _numpy(optim_sd["state"])


def _weights(system: str, model) -> dict:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    if system.startswith("wrapper"):
        return _numpy(model.state_dict())
    return _numpy(get_model_state_dict(model, options=StateDictOptions(full_state_dict=True)))


def _save(writer: str, path: str, model, opt) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from fullshard import checkpoint

    if writer in ("wrapper", "fully_shard+fullshard.checkpoint"):
        checkpoint.save(path, model, opt)
        return
    model_sd, optim_sd = get_state_dict(model, opt)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)


def _load(reader: str, path: str):
    """A model of ``reader``'s system with other weights (seed 1) and a fresh optimizer, loaded from ``path``."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    from fullshard import FullyShardedDataParallel as FSDP, StateDictType, checkpoint

    model = _build(reader.split("+")[0], seed=1)
    opt = _optimizer(model)
    if reader in ("torch", "fully_shard"):
        model_sd, optim_sd = get_state_dict(model, opt)
        dcp.load({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
        set_state_dict(model, opt, model_state_dict=model_sd, optim_state_dict=optim_sd)
    elif reader == "wrapper+dcp":
        checkpoint.init_optim_state(opt)
        with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
            state = {"model": model.state_dict(), "optim": FSDP.optim_state_dict(model, opt)}
            dcp.load(state, checkpoint_id=path)
            model.load_state_dict(state["model"])
            opt.load_state_dict(FSDP.optim_state_dict_to_load(model, opt, state["optim"]))
    else:
        checkpoint.load(path, model, opt)
    return model, opt


def _plain_at_split():
    """One process, the same global batches: the reference of names and (within tolerance) values."""
    from tests.dist.llama import build_plain

    plain = build_plain()
    opt = _optimizer(plain)
    _train(plain, opt, 0, 1, 0, SPLIT)
    return plain, opt


# ------------------------------------------------------------------------------ the groups of ranks
def _at_two(rank, world, tmp):
    """Every system trains STEPS steps and writes its checkpoints at SPLIT; the state-dict API cases run on
    the fully_shard model at SPLIT; every reader loads every checkpoint and trains on."""
    from tests.dist.fully_shard_cases import dsd_cases, fsdp1_helper_cases, load_cases

    models, saved, final = {}, {}, {}
    for system in ("torch", "fully_shard", "wrapper"):
        model = _build(system)
        opt = _optimizer(model)
        _train(model, opt, rank, world, 0, SPLIT)
        saved[system] = _full_state(system, model, opt)
        for writer in WRITERS:
            if writer.split("+")[0] == system:
                _save(writer, os.path.join(tmp, writer), model, opt)
        models[system] = (model, opt)
    for writer in WRITERS:
        saved.setdefault(writer, saved[writer.split("+")[0]])
    _model_only(tmp, models["fully_shard"][0], saved)
    plain, plain_opt = _plain_at_split()
    fs_model, fs_opt = models["fully_shard"]
    continued = dsd_cases(rank, world, fs_model, fs_opt, *models["torch"], plain, plain_opt, _build, _optimizer)
    load_cases(rank, world, fs_model, _build)
    fsdp1_helper_cases(fs_model, fs_opt, *models["wrapper"])
    for system, (model, opt) in models.items():
        _train(model, opt, rank, world, SPLIT, STEPS - SPLIT)
        final[system] = _weights(system, model)
    for what, (model, opt) in continued.items():
        _train(model, opt, rank, world, SPLIT, STEPS - SPLIT)
        _assert_equal(_weights("fully_shard", model), final["fully_shard"], f"{what}, then {STEPS - SPLIT} steps")
    return dict(saved=saved, final=final, loads=_read(rank, world, tmp, ALL_PAIRS, True))


def _model_only(tmp, fs_model, saved) -> None:
    """fullshard.checkpoint.save / load without an optimizer: fully_shard's into the wrapper and back."""
    from fullshard import checkpoint

    path = os.path.join(tmp, "fully_shard-model-only")
    checkpoint.save(path, fs_model)
    wrapper = _build("wrapper", seed=1)
    checkpoint.load(path, wrapper)
    _assert_equal(_weights("wrapper", wrapper), saved["fully_shard"][0], "fully_shard's model-only, into wrapper")
    target = _build("fully_shard", seed=1)
    checkpoint.load(os.path.join(tmp, "wrapper"), target)
    _assert_equal(_weights("fully_shard", target), saved["wrapper"][0], "wrapper's, model only into fully_shard")


def _read(rank, world, tmp, pairs, train):
    """{(writer, reader): (state after loading, weights after training on or None)} at this world size."""
    out = {}
    for writer, reader in pairs:
        model, opt = _load(reader, os.path.join(tmp, writer))
        state = _full_state(reader, model, opt)
        if train:
            _train(model, opt, rank, world, SPLIT, STEPS - SPLIT)
        out[(writer, reader)] = (state, _weights(reader, model) if train else None)
    return out


# ---------------------------------------------------------------------------------------- comparisons
def _assert_equal(got, want, what):
    assert list(got) == list(want), f"{what}: names {list(got)} != {list(want)}"
    for name in want:
        if isinstance(want[name], dict):
            _assert_equal(got[name], want[name], f"{what}: {name}")
        else:
            assert np.array_equal(got[name], want[name]), \
                f"{what}: {name} differs by {np.abs(got[name] - want[name]).max()}"


def _max_diff(got, want) -> float:
    return max(float(np.abs(got[k] - want[k]).max()) for k in want)


@pytest.fixture(scope="module")
def two(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("ckpt"))
    return tmp, run_ranks(_at_two, 2, tmp, timeout_s=300)[0]


def test_systems_train_alike_at_two_ranks(two):
    """The precondition of the bitwise comparisons below: torch FSDP2, fully_shard and the wrapper give the
    same bits at 2 ranks (same reduce-scatter of the same per-rank gradients)."""
    _, out = two
    for system in ("fully_shard", "wrapper"):
        _assert_equal(out["saved"][system][0], out["saved"]["torch"][0], f"{system} vs torch after {SPLIT} steps")
        _assert_equal(out["saved"][system][1], out["saved"]["torch"][1], f"{system} vs torch optimizer state")
        _assert_equal(out["final"][system], out["final"]["torch"], f"{system} vs torch after {STEPS} steps")


def test_one_format(two):
    """Every writer puts the same keys, global shapes and dtypes in the DCP metadata."""
    import torch.distributed.checkpoint as dcp

    tmp, _ = two
    layouts = {}
    for writer in WRITERS:
        md = dcp.FileSystemReader(os.path.join(tmp, writer)).read_metadata().state_dict_metadata
        layouts[writer] = {k: (type(v).__name__, tuple(getattr(v, "size", ())),
                               getattr(getattr(v, "properties", None), "dtype", None)) for k, v in md.items()}
    assert any(k.startswith("optim.state.") and k.endswith(".exp_avg_sq") for k in layouts["torch"])
    for writer in WRITERS[1:]:
        assert layouts[writer] == layouts["torch"], writer


def test_every_reader_takes_every_checkpoint_at_two_ranks(two):
    _, out = two
    assert list(out["loads"]) == ALL_PAIRS
    for (writer, reader), (state, final) in out["loads"].items():
        what = f"{writer} checkpoint read by {reader} at 2 ranks"
        _assert_equal(state[0], out["saved"][writer][0], f"{what}: weights")
        _assert_equal(state[1], out["saved"][writer][1], f"{what}: optimizer state")
        _assert_equal(final, out["final"][reader.split("+")[0]], f"{what}: weights after training on")


def test_every_reader_takes_every_checkpoint_at_four_ranks(two):
    tmp, out = two
    loads = run_ranks(_read, 4, tmp, RESHARDED_PAIRS, True, timeout_s=300)[0]
    assert list(loads) == RESHARDED_PAIRS
    for (writer, reader), (state, final) in loads.items():
        what = f"{writer} checkpoint (2 ranks) read by {reader} at 4 ranks"
        _assert_equal(state[0], out["saved"][writer][0], f"{what}: weights")
        _assert_equal(state[1], out["saved"][writer][1], f"{what}: optimizer state")
        want = out["final"][reader.split("+")[0]]
        for name in want:
            np.testing.assert_allclose(final[name], want[name], rtol=RTOL, atol=ATOL,
                                       err_msg=f"{what}: {name} after training on")
        print(f"{what}: max |final - uninterrupted 2-rank final| = {_max_diff(final, want):.3g}")


def test_uneven_shards_at_three_ranks(two):
    """32 rows over 3 ranks: chunks of 11, 11 and 10 rows."""
    tmp, out = two
    loads = run_ranks(_read, 3, tmp, UNEVEN_PAIRS, False, timeout_s=300)[0]
    assert list(loads) == UNEVEN_PAIRS
    for (writer, reader), (state, _) in loads.items():
        what = f"{writer} checkpoint (2 ranks) read by {reader} at 3 ranks"
        _assert_equal(state[0], out["saved"][writer][0], f"{what}: weights")
        _assert_equal(state[1], out["saved"][writer][1], f"{what}: optimizer state")


def test_plain_model_reads_every_checkpoint(two):
    """fullshard.checkpoint.load into the unwrapped model in one process (no process group)."""
    from fullshard import checkpoint
    from tests.dist.llama import build_plain

    tmp, out = two
    for writer in WRITERS:
        model = build_plain(seed=1)
        opt = _optimizer(model)
        checkpoint.load(os.path.join(tmp, writer), model, opt)
        optim_state = {name: opt.state[p] for name, p in model.named_parameters()}
        _assert_equal(_numpy(model.state_dict()), out["saved"][writer][0], f"{writer} checkpoint, plain model")
        _assert_equal(_numpy(optim_state), out["saved"][writer][1], f"{writer} checkpoint, plain optimizer")


def test_consolidate_every_checkpoint(two, tmp_path):
    from safetensors.torch import load_file

    from fullshard.checkpoint.consolidate import consolidate

    tmp, out = two
    for writer in WRITERS:
        want = out["saved"][writer][0]
        for ext in ("safetensors", "pt"):
            dest = str(tmp_path / f"{writer}.{ext}")
            consolidate(os.path.join(tmp, writer), dest)
            got = load_file(dest) if ext == "safetensors" else torch.load(dest, weights_only=True)
            _assert_equal(_numpy(got), want, f"consolidated {writer} checkpoint ({ext})")


def test_consolidate_cli(two, tmp_path):
    from safetensors.torch import load_file

    from tests.e2e.common import run_cli

    tmp, out = two
    dest = tmp_path / "model.safetensors"
    proc = run_cli("consolidate", os.path.join(tmp, "torch"), str(dest))
    assert proc.returncode == 0, proc.stderr
    assert "wrote" in proc.stdout and not proc.stderr.strip(), (proc.stdout, proc.stderr)
    _assert_equal(_numpy(load_file(str(dest))), out["saved"]["torch"][0], "fullshard consolidate of torch's")


def test_consolidate_refuses_a_checkpoint_without_model_keys(tmp_path):
    """A DCP checkpoint of a bare state dict (no ``model.`` keys) has nothing to consolidate: an error, not an
    empty file."""
    import torch.distributed.checkpoint as dcp

    from fullshard.checkpoint import CheckpointError
    from fullshard.checkpoint.consolidate import consolidate
    from tests.dist.llama import build_plain

    path = str(tmp_path / "bare")
    dcp.save(build_plain().state_dict(), checkpoint_id=path, no_dist=True)
    with pytest.raises(CheckpointError, match=r"no model tensors.*'tok_embeddings'"):
        consolidate(path, str(tmp_path / "out.safetensors"))
    assert not os.path.exists(tmp_path / "out.safetensors")
