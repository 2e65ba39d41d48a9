"""fullshard.checkpoint.save / load: resharding across world sizes, DDP and
plain-model interop, atomicity under SIGKILL, damaged files, wrong model."""
from __future__ import annotations

import io
import os
import subprocess
import sys

import pytest
import torch

from tests.dist.harness import run_ranks
from tests.dist.models import batch, loss_fn, make_model, param_groups, unit_policy

KIND = "gpt"


def _fsdp():
    from fullshard import FSDP

    model = FSDP(make_model(KIND, seed=3), auto_wrap_policy=unit_policy(KIND))
    return model, torch.optim.AdamW(param_groups(model.named_parameters()), lr=1e-2)


def _step(model, opt, rank, step):
    x, y = batch(KIND, rank, step)
    loss = loss_fn(KIND, model, x, y)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.item()


def _full(model, opt):
    from fullshard import FSDP

    return model.state_dict(), FSDP.optim_state_dict(model, opt)


def _same(a, b, where):
    sd_a, osd_a = a
    sd_b, osd_b = b
    assert list(sd_a) == list(sd_b), where
    for k in sd_a:
        assert torch.equal(sd_a[k], sd_b[k]), f"{where}: {k}"
    assert osd_a["param_groups"] == osd_b["param_groups"], where
    for name, st in osd_a["state"].items():
        for k, v in st.items():
            assert torch.equal(v, osd_b["state"][name][k]), f"{where}: {name}/{k}"


def _save_at(rank, world, path):
    from fullshard import checkpoint

    model, opt = _fsdp()
    for step in range(2):
        _step(model, opt, rank, step)
    checkpoint.save(path, model, opt, extra={"rank": rank, "rng": torch.get_rng_state()})
    from fullshard import FSDP, FullStateDictConfig, StateDictType

    full = _full(model, opt)
    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, FullStateDictConfig(rank0_only=True)):
        r0 = model.state_dict()
    if rank == 0:
        full = (r0, full[1])  # the consolidated file is compared with the rank0-only state dict
    else:
        assert r0 == {}
    return _pack(full)


def _pack(obj) -> bytes:
    """Tensors cross the result queue as bytes (shared-memory handles die with the rank)."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _unpack(data: bytes):
    return torch.load(io.BytesIO(data), weights_only=False)


def _load_at(rank, world, path, ref, save_to):
    from fullshard import checkpoint

    ref = _unpack(ref)
    model, opt = _fsdp()
    extra = checkpoint.load(path, model, opt)
    assert extra["rank"] == (rank if rank < 2 else 0)
    _same(_full(model, opt), ref, f"loaded at world {world}")
    if save_to:  # the loaded state, saved again at this world size
        checkpoint.save(save_to, model, opt)
    _step(model, opt, rank, 5)  # training continues
    if world == 1:  # the same checkpoint into a plain model and optimizer
        plain = make_model(KIND, seed=8)
        popt = torch.optim.AdamW(param_groups(plain.named_parameters()), lr=1e-2)
        checkpoint.load(path, plain, popt)
        for k, v in ref[0].items():
            assert torch.equal(plain.state_dict()[k], v), k
    return True


def _ddp_roundtrip(rank, world, path, ref):
    """DDP loads an FSDP checkpoint, saves its own; FSDP loads that one."""
    from fullshard import checkpoint

    ref = _unpack(ref)
    ddp = torch.nn.parallel.DistributedDataParallel(make_model(KIND, seed=4))
    opt = torch.optim.AdamW(param_groups(ddp.module.named_parameters()), lr=1e-2)
    checkpoint.load(path, ddp, opt)
    for k, v in ref[0].items():
        assert torch.equal(ddp.module.state_dict()[k], v), k
    checkpoint.save(path + "-ddp", ddp, opt)
    model, fopt = _fsdp()
    checkpoint.load(path + "-ddp", model, fopt)
    _same(_full(model, fopt), ref, "FSDP from a DDP checkpoint")
    return True


def _check_consolidated(path, full_sd, tmp_path):
    """Offline consolidation (.safetensors streamed, .pt) equals the gathered full state dict."""
    from safetensors.torch import load_file

    from fullshard.checkpoint.consolidate import consolidate

    for out in (str(tmp_path / "m.safetensors"), str(tmp_path / "m.pt")):
        stats = consolidate(path, out)
        got = load_file(out) if out.endswith(".safetensors") else torch.load(out, weights_only=True)
        assert list(got) == list(full_sd) and stats["tensors"] == len(full_sd)
        for k, v in full_sd.items():
            assert torch.equal(got[k], v), k
        plain = make_model(KIND, seed=11)
        plain.load_state_dict(got)
    with pytest.raises(ValueError, match=r"\.safetensors or \.pt"):
        consolidate(path, str(tmp_path / "m.bin"))


def test_reshard_2_to_1_3_4_and_4_to_2(tmp_path):
    """Saved at 2 loads at 1, 3, 4 (and into DDP / a plain model); saved at 4 loads at 2; the
    consolidated file equals the full state dict."""
    a, b = str(tmp_path / "w2"), str(tmp_path / "w4")
    ref = run_ranks(_save_at, 2, a)[0]
    _check_consolidated(a, _unpack(ref)[0], tmp_path)
    assert sorted(os.listdir(a)) == [".metadata", "__0_0.distcp", "__1_0.distcp", "extra-rank0.pt",
                                     "extra-rank1.pt", "fullshard.json"]
    run_ranks(_load_at, 1, a, ref, None)
    run_ranks(_load_at, 3, a, ref, None)
    run_ranks(_load_at, 4, a, ref, b)
    run_ranks(_ddp_roundtrip, 2, b, ref)


_KILLED_SAVERS = r"""
import os, signal, sys, time
import torch
from fullshard import checkpoint

path = sys.argv[1]


def saver(ready):  # a forked process saving new versions until it is killed
    model = torch.nn.Linear(2048, 2048 * 2)
    for version in range(1000):
        with torch.no_grad():
            model.weight.fill_(version)
            model.bias.fill_(version)
        checkpoint.save(path, model)
        if version == 0:
            os.write(ready, b"0")  # one complete checkpoint exists
    os._exit(0)


# This process only imports torch (no op has started its thread pool), so forking it is safe;
# one import serves every kill.
for delay in map(float, sys.argv[2:]):
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        saver(w)
    os.close(w)
    assert os.read(r, 1) == b"0"
    while not os.path.isdir(path + ".tmp"):
        time.sleep(0.001)
    time.sleep(delay)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    os.close(r)
    print(delay, flush=True)
    sys.stdin.readline()  # the test has checked the checkpoint
"""


def test_sigkill_during_save_leaves_previous_checkpoint(tmp_path):
    """A real SIGKILL of a saving process at several points of a save: the directory always loads
    completely."""
    from fullshard import checkpoint

    path = str(tmp_path / "ckpt")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    delays = ("0.0", "0.05", "0.15", "0.3")
    proc = subprocess.Popen([sys.executable, "-c", _KILLED_SAVERS, path, *delays], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env)
    try:
        for delay in delays:
            assert proc.stdout.readline().strip() == delay.encode()  # the saver was killed
            model = torch.nn.Linear(2048, 2048 * 2)
            checkpoint.load(path, model)
            v = model.bias[0].item()
            assert torch.all(model.weight == v) and torch.all(model.bias == v) and v >= 0
            proc.stdin.write(b"next\n")
            proc.stdin.flush()
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()


def test_damaged_files_and_wrong_model_are_refused(tmp_path):
    """Truncated / corrupted / missing files are named; another model's names and shapes are listed."""
    from fullshard import checkpoint

    path = str(tmp_path / "ckpt")
    model = make_model("mlp")
    checkpoint.save(path, model)
    shard = os.path.join(path, "__0_0.distcp")
    good = open(shard, "rb").read()
    with open(shard, "wb") as f:
        f.write(good[:-10])
    with pytest.raises(checkpoint.CheckpointError, match=r"__0_0.distcp \(truncated"):
        checkpoint.load(path, make_model("mlp"))
    with open(shard, "wb") as f:
        f.write(good[:100] + bytes([good[100] ^ 1]) + good[101:])
    with pytest.raises(checkpoint.CheckpointError, match=r"__0_0.distcp \(corrupted"):
        checkpoint.load(path, make_model("mlp"))
    with open(shard, "wb") as f:
        f.write(good)
    checkpoint.load(path, make_model("mlp", seed=1))

    class Other(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inp = torch.nn.Linear(7, 16)
            self.extra = torch.nn.Linear(2, 2)

    other = Other()
    optimizer = torch.optim.AdamW(other.parameters())
    with pytest.raises(checkpoint.CheckpointError, match=r"missing from checkpoint: \['extra.weight', "
                       r"'extra.bias'\].*not in model: \[.*'scale'.*\].*'inp.weight': checkpoint \(15, 7\) vs "
                       r"model \(16, 7\)"):
        checkpoint.load(path, other, optimizer)
    assert not any(optimizer.state.values())  # refused before anything was loaded: no state (it had step 1)
    model = make_model("mlp")
    optimizer = torch.optim.AdamW(model.parameters())  # the checkpoint has no optimizer state
    with pytest.raises(checkpoint.CheckpointError, match=r"holds no optimizer state of this optimizer's form "
                       r"\(AdamW; Missing key in checkpoint state_dict: optim\..*load it without the optimizer"):
        checkpoint.load(path, model, optimizer)
    assert not any(optimizer.state.values())

    # extra-rank0.pt: read_extra checks it against the manifest; a checkpoint that lost its manifest is refused
    checkpoint.save(path, model, extra={"step": 7})
    extra = os.path.join(path, "extra-rank0.pt")
    blob = open(extra, "rb").read()
    with open(extra, "wb") as f:
        f.write(blob[:-30] + bytes([blob[-30] ^ 1]) + blob[-29:])
    with pytest.raises(checkpoint.CheckpointError, match=r"extra-rank0.pt \(corrupted: sha256 differs\)"):
        checkpoint.read_extra(path)
    with open(extra, "wb") as f:
        f.write(blob)
    assert checkpoint.read_extra(path) == {"step": 7}
    with open(os.path.join(path, "fullshard.json"), "r+") as f:
        f.truncate(20)
    with pytest.raises(checkpoint.CheckpointError, match=r"its fullshard.json is damaged"):
        checkpoint.verify(path)
    os.remove(os.path.join(path, "fullshard.json"))
    for call in (checkpoint.verify, checkpoint.read_extra, lambda p: checkpoint.load(p, make_model("mlp"))):
        with pytest.raises(checkpoint.CheckpointError, match=r"has lost its fullshard.json"):
            call(path)
    with pytest.raises(checkpoint.CheckpointError, match=r"no checkpoint at"):
        checkpoint.verify(str(tmp_path / "nothing"))
    checkpoint.save(path, model)
    os.remove(os.path.join(path, ".metadata"))
    with pytest.raises(checkpoint.CheckpointError, match=r"\.metadata \(missing\)"):
        checkpoint.load(path, make_model("mlp"))
