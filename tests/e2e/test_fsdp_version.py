"""`fullshard train --fsdp-version 1|2` as a user runs it (2 gloo ranks, fp32): the same per-update
log records (losses and gradient norms, bit for bit) and the same checkpoints, and a checkpoint
written under one version resumes under the other exactly where it left off. Four short CLI runs,
two at a time (each costs mostly process start-up)."""
from __future__ import annotations

import torch

from tests.e2e.common import ARCH, checkpoint_params, json_records, run_all

UPDATES = 4
# --update-freq 2: the first micro-batch of each update accumulates without communication
# (no_sync / set_requires_gradient_sync(False)); --clip-norm 0.1 clips every update.
COMMON = ["--nproc-per-node", "2", "--arch", ARCH, "--tokens-per-sample", "64", "--batch-size", "2",
          "--update-freq", "2", "--lr", "0.001", "--lr-scheduler", "polynomial_decay", "--warmup-updates", "1",
          "--total-num-update", str(UPDATES), "--clip-norm", "0.1", "--weight-decay", "0.01", "--seed", "3",
          "--log-interval", "1", "--log-format", "json", "--max-update", str(UPDATES)]
# Fields of a train_inner record that measure time or memory, not training.
TIMING = {"wps", "ups", "train_wall", "gb_free", "wall"}


def _train(cli, corpus_dir, save_dir, version, *extra):
    proc = cli("train", str(corpus_dir), *COMMON, "--fsdp-version", str(version), "--save-dir", str(save_dir),
               *extra)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout, json_records(proc.stdout)["train_inner"]


def _training_fields(records):
    return [{k: v for k, v in r.items() if k not in TIMING} for r in records]


def _assert_same_params(corpus_dir, a, b):
    pa, _ = checkpoint_params(corpus_dir, a)
    pb, _ = checkpoint_params(corpus_dir, b)
    assert pa.keys() == pb.keys()
    for k in pa:
        assert torch.equal(pa[k], pb[k]), k


def test_versions_give_the_same_run_and_resume_each_others_checkpoints(cli, corpus_dir, tmp_path):
    runs = {}
    straight = run_all({version: lambda v=version: _train(cli, corpus_dir, tmp_path / f"v{v}", v,
                                                          "--save-interval-updates", "2") for version in (1, 2)})
    for version in (1, 2):
        out, records = straight[version]
        assert f"; fsdp-version {version})" in out
        assert [r["num_updates"] for r in records] == [str(u) for u in range(1, UPDATES + 1)]
        runs[version] = records
    assert _training_fields(runs[2]) == _training_fields(runs[1])  # loss, ppl, gnorm, lr ... as logged
    assert all(float(r["gnorm"]) > 0.1 for r in runs[1])  # clipping acted at every update
    _assert_same_params(corpus_dir, tmp_path / "v1" / "checkpoint_last", tmp_path / "v2" / "checkpoint_last")
    # Resume the 2-update checkpoint of one version under the other: the remaining updates and the
    # final parameters (and optimizer state, through them) equal the straight run's, bit for bit.
    pairs = ((1, 2), (2, 1))
    done = run_all({(saved, resumed): lambda s=saved, r=resumed: _train(
        cli, corpus_dir, tmp_path / f"v{s}_to_v{r}", r, "--restore-file", str(tmp_path / f"v{s}" / "checkpoint_1_2"))
        for saved, resumed in pairs})
    for saved, resumed in pairs:
        save_dir = tmp_path / f"v{saved}_to_v{resumed}"
        out, records = done[saved, resumed]
        assert "epoch 1 offset 2 @ 2 updates" in out
        assert _training_fields(records) == _training_fields(runs[1])[2:]
        _assert_same_params(corpus_dir, save_dir / "checkpoint_last", tmp_path / "v1" / "checkpoint_last")
