"""Trainer checkpoints: exact resume (bit-identical parameters), interval
saves with --keep-interval-updates, resume at another --nproc-per-node,
c10d <-> fully_sharded, --finetune-from-model, --reset-* flags, a resume with another lr schedule
and update size; 8 short CLI runs, two at a
time where one doesn't need another's checkpoint (each run costs mostly process start-up)."""
from __future__ import annotations

import torch

from tests.e2e.common import checkpoint_params, json_records, pool

ARCH = "transformer_lm_gpt_mini"
COMMON = ["--arch", ARCH, "--tokens-per-sample", "64", "--lr", "0.001", "--lr-scheduler", "polynomial_decay",
          "--warmup-updates", "1", "--total-num-update", "4", "--clip-norm", "1.0", "--weight-decay", "0.01",
          "--seed", "3", "--log-interval", "1", "--batch-size", "4", "--log-format", "json"]


def _train(cli, corpus_dir, save_dir, *extra, nproc=2, updates=8):
    proc = cli("train", str(corpus_dir), *COMMON, "--nproc-per-node", str(nproc), "--max-update", str(updates),
               "--save-dir", str(save_dir), *extra)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout, json_records(proc.stdout)


def _epoch_line(records):
    return [(r["train_loss"], r["train_gnorm"], r["train_num_updates"]) for r in records["train"]]


def _losses(records):
    return [(r["num_updates"], r["loss"], r["ppl"], r["lr"]) for r in records["train_inner"]]


def test_exact_resume_interval_keep_reshard_c10d_and_resets(cli, corpus_dir, tmp_path):
    """4 updates straight == 2, save, new processes, load, 2 (bit-identical fp32 parameters and the
    same logged losses); interval checkpoints pruned to the last one; resuming at 1 rank continues at
    the same sample position; a fully_sharded checkpoint fine-tunes a c10d run, whose checkpoint
    resumes under fully_sharded (same names, both directions); --reset-* restart the counter."""
    half, ddp = tmp_path / "b", tmp_path / "ddp"

    def ddp_chain():
        # fully_sharded -> c10d (weights only), then c10d -> fully_sharded (full resume), then --reset-*.
        return [_train(cli, corpus_dir, ddp, "--ddp-backend", "c10d", "--finetune-from-model",
                       str(half / "checkpoint_1_2"), updates=2),
                _train(cli, corpus_dir, ddp, updates=4),
                _train(cli, corpus_dir, ddp, "--reset-optimizer", "--reset-lr-scheduler", "--reset-dataloader",
                       updates=1)]

    with pool() as runs:
        straight = runs.submit(_train, cli, corpus_dir, tmp_path / "a", updates=4)
        runs.submit(_train, cli, corpus_dir, half, "--save-interval-updates", "1", "--keep-interval-updates", "1",
                    updates=2).result()
        assert sorted(p.name for p in half.iterdir()) == ["checkpoint_1_2", "checkpoint_last"]
        # The runs below read checkpoint_1_2, which the resumed run (no interval saves) leaves alone.
        chain = runs.submit(ddp_chain)  # first: the longest
        resume = runs.submit(_train, cli, corpus_dir, half, updates=4)
        # Resume the 2-update checkpoint on 1 rank (resharded), same data position (16 samples = 4 updates of 4).
        one = runs.submit(_train, cli, corpus_dir, tmp_path / "c", "--restore-file", str(half / "checkpoint_1_2"),
                          nproc=1, updates=4)
        # Resumed with other flags: its own lr schedule (a new --lr and --total-num-update, as when a run is
        # extended) at the saved update count, and the saved sample position in updates of its new size.
        changed = runs.submit(_train, cli, corpus_dir, tmp_path / "e", "--restore-file", str(half / "checkpoint_1_2"),
                              "--lr", "0.002", "--total-num-update", "6", "--update-freq", "2", updates=4)
    _, straight = straight.result()
    out, resumed = resume.result()
    assert "loaded checkpoint" in out and "epoch 1 offset 2 @ 2 updates" in out
    assert _losses(resumed) == _losses(straight)[2:]
    # The epoch's train line (printed at the stop) covers the whole epoch, the updates before the resume too.
    assert _epoch_line(resumed) == _epoch_line(straight) and _epoch_line(straight), _epoch_line(resumed)
    a, extra = checkpoint_params(corpus_dir, tmp_path / "a" / "checkpoint_last")
    b, _ = checkpoint_params(corpus_dir, half / "checkpoint_last")
    assert extra["train_state"]["num_updates"] == 4 and extra["world_size"] == 2
    for k in a:
        assert torch.equal(a[k], b[k]), k
    out, one = one.result()
    assert "saved by 2 ranks" in out and "offset 4 @ 2 updates" in out
    assert [r["num_updates"] for r in one["train_inner"]] == ["3", "4"]
    out, rec = changed.result()
    assert "epoch 1 offset 1 @ 2 updates" in out, out[-2000:]  # 16 sequences = 1 update of 2 x 4 x 2
    # polynomial decay from 0.002 over 6 updates, warmup 1: the lr logged after update n is 0.002 * (1 - (n-1)/5)
    assert [(r["num_updates"], round(float(r["lr"]), 8)) for r in rec["train_inner"]] == [("3", 0.0012), ("4", 0.0008)]
    (out, rec), (out2, rec2), (_, rec3) = chain.result()
    assert "for fine-tuning" in out and [r["num_updates"] for r in rec["train_inner"]] == ["1", "2"]
    assert "@ 2 updates" in out2 and [r["num_updates"] for r in rec2["train_inner"]] == ["3", "4"]
    assert [r["num_updates"] for r in rec3["train_inner"]] == ["1"]


def test_invariant_resume_keeps_the_global_batch(cli, corpus_dir, tmp_path):
    """A --world-size-invariant run without --global-batch-size records the update size it derived at
    launch (2 ranks x 4 = 8 sequences); resumed at 1 rank it would take 4 per update, no longer the same
    run: refused on every rank, naming the flag to pass."""
    _train(cli, corpus_dir, tmp_path, "--world-size-invariant", updates=1)
    proc = cli("train", str(corpus_dir), *COMMON, "--nproc-per-node", "1", "--max-update", "2", "--save-dir",
               str(tmp_path), "--world-size-invariant")
    assert proc.returncode != 0 and "pass --global-batch-size 8 to continue it" in proc.stderr, proc.stderr[-2000:]
