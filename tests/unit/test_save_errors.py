"""A write error during checkpoint.save (a full disk) fails with one clear line and leaves the
previous checkpoint loadable and no half-written directory (single process, no process group)."""
from __future__ import annotations

import errno
import os

import pytest
import torch
import torch.nn as nn


def test_enospc_in_writer_keeps_previous_checkpoint(tmp_path, monkeypatch):
    from fullshard import checkpoint
    from fullshard.checkpoint import save_load

    model = nn.Linear(4, 3)
    path = tmp_path / "checkpoint_last"
    checkpoint.save(str(path), model, extra={"n": 1})
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        model.weight.add_(1.0)

    def full_disk(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(save_load.torch, "save", full_disk)
    with pytest.raises(checkpoint.CheckpointError) as info:
        checkpoint.save(str(path), model, extra={"n": 2})
    monkeypatch.undo()
    msg = str(info.value)
    assert "\n" not in msg and msg.startswith("[rank 0] saving ")
    assert "failed on rank 0 while writing files: OSError: [Errno 28] No space left on device" in msg
    assert "the previous checkpoint" in msg and "is intact; free disk space and save again" in msg
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint_last"]
    fresh = nn.Linear(4, 3)
    assert checkpoint.load(str(path), fresh) == {"n": 1}
    for k, v in fresh.state_dict().items():
        assert torch.equal(v, before[k]), k


def test_after_write_hook_runs_before_publish_and_its_error_fails_the_save(tmp_path):
    """``after_write`` (the trainer's fault injection) sees the written temporary
    directory; an error it raises fails the save and publishes nothing."""
    from fullshard import checkpoint

    model = nn.Linear(4, 3)
    seen = []
    checkpoint.save(str(tmp_path / "ok"), model, after_write=lambda tmp: seen.append(sorted(os.listdir(tmp))))
    assert seen and any(name.endswith(".distcp") for name in seen[0])

    def fail(tmp):
        raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(checkpoint.CheckpointError, match="No space left on device"):
        checkpoint.save(str(tmp_path / "bad"), model, after_write=fail)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ok"]


def test_qlora_checkpoint_is_refused_at_another_world_size_and_by_consolidate(tmp_path, capsys):
    """A checkpoint whose recorded arguments say --quantize-base nf4 holds each rank's rows of a frozen NF4
    base, which torch.distributed.checkpoint cannot cut at other rows: resuming it at another world size,
    eval-lm at another and consolidate crashed in DCP / torch.load; they are refused in one line."""
    from fullshard import checkpoint
    from fullshard.cli import main
    from fullshard.train.checkpoint_record import nf4_problem

    path, plain = str(tmp_path / "q"), str(tmp_path / "plain")
    checkpoint.save(path, nn.Linear(2, 2), extra={"args": {"quantize_base": "nf4"}, "world_size": 2})
    checkpoint.save(plain, nn.Linear(2, 2), extra={"args": {"quantize_base": "none"}, "world_size": 2})
    assert nf4_problem(path, [2]) is None and nf4_problem(plain, [3]) is None
    assert nf4_problem(path, [3]).endswith("its quantized base loads at that world size only, not at 3 "
                                                 "ranks: use --nproc-per-node 2")
    # fullshard train's check of the checkpoint it would resume (here --restore-file q in the save dir)
    import types

    from fullshard.train.hf_options import check_nf4_restore
    from fullshard.train.options import OneLineArgumentParser

    args = types.SimpleNamespace(save_dir=str(tmp_path), restore_file="q")
    check_nf4_restore(OneLineArgumentParser(prog="fullshard train"), args, [2])
    with pytest.raises(SystemExit) as info:
        check_nf4_restore(OneLineArgumentParser(prog="fullshard train"), args, [3])
    err = capsys.readouterr().err
    assert info.value.code == 2 and "cannot resume from" in err and "use --nproc-per-node 2" in err, err
    with pytest.raises(SystemExit) as info:
        main(["consolidate", path, str(tmp_path / "q.safetensors")])
    err = capsys.readouterr().err
    assert info.value.code == 2 and "its quantized base cannot be written into one file" in err, err
    assert not (tmp_path / "q.safetensors").exists()


def test_interval_copy_that_fills_the_disk_leaves_no_tmp_and_says_so(tmp_path, monkeypatch):
    """The interval checkpoint is a copy of checkpoint_last made by rank 0 alone; a disk that filled during it
    raised out of the save on rank 0 only (rank 1 then failed in the barrier with a C++ trace) and left the
    half-written ``.tmp``. Now the copy returns what failed (every rank then acts on it alike)."""
    import shutil

    from fullshard.train.checkpoint_utils import _copy_interval

    last = tmp_path / "checkpoint_last"
    last.mkdir()
    (last / "a.distcp").write_bytes(b"x" * 10)
    (tmp_path / "checkpoint_1_2").mkdir()  # an older copy of the same name stays until one replaces it
    real = shutil.copytree

    def full_disk(src, dst, **kw):
        real(src, dst, **kw)  # written in part
        raise shutil.Error([(os.path.join(src, "a.distcp"), dst, "[Errno 28] No space left on device")])
    monkeypatch.setattr(shutil, "copytree", full_disk)
    failed = _copy_interval(str(last), str(tmp_path / "checkpoint_1_4"), keep=-1)
    assert failed == (f"copying {last} to {tmp_path / 'checkpoint_1_4'} failed: [Errno 28] No space left on "
                      "device; free disk space"), failed
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint_1_2", "checkpoint_last"]
    monkeypatch.setattr(shutil, "copytree", real)
    # An older copy that cannot be removed (a busy NFS file) costs disk only: not a failed save on rank 0 alone.
    rmtree = shutil.rmtree

    def busy(path, *a, **kw):
        if str(path).endswith("checkpoint_1_2"):
            raise OSError(16, "Device or resource busy")
        return rmtree(path, *a, **kw)
    monkeypatch.setattr(shutil, "rmtree", busy)
    assert _copy_interval(str(last), str(tmp_path / "checkpoint_1_4"), keep=1) is None
    monkeypatch.setattr(shutil, "rmtree", rmtree)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint_1_2", "checkpoint_1_4", "checkpoint_last"]
    assert _copy_interval(str(last), str(tmp_path / "checkpoint_1_4"), keep=1) is None
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint_1_4", "checkpoint_last"]
