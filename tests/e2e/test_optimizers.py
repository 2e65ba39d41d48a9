"""`fullshard train --optimizer muon | adafactor | lamb` (fullshard.optim): a few updates under
fully_sharded give c10d's run (torch DDP: whole parameters, the single-device step) on 2 ranks, the
run header names the optimizer and its groups, and checkpoints resume bit for bit: adafactor's (row
factors per rank, column factors replicated) and muon's (its matrices Owned by one rank each under the
wrapper), also under the other --fsdp-version and on another number of ranks. Bad flags:
test_bad_input.py."""
from __future__ import annotations

import torch

from tests.e2e.common import checkpoint_params, json_records, run_all

ARCH = "transformer_lm_gpt_mini"
# No --clip-norm: DDP's norm and the sharded one differ in the last bit, and Muon's Newton-Schulz
# iteration in bf16 turns such a difference into about 2e-4 in its update (measured); without it the
# 2-rank gradient averages are bitwise equal and so is Muon's step.
COMMON = ["--arch", ARCH, "--tokens-per-sample", "64", "--batch-size", "4", "--weight-decay", "0.01", "--seed", "3",
          "--lr-scheduler", "polynomial_decay", "--warmup-updates", "1", "--total-num-update", "4",
          "--log-interval", "1", "--log-format", "json"]
TOLERANCE = {"muon": 0.0, "adafactor": 1e-5, "lamb": 1e-5}
"""Largest |parameter difference| from c10d after 3 updates: Muon's owner steps the whole matrix as one
device does; Adafactor's and LAMB's per-tensor sums add the ranks' partial sums (fp32 reduction order)."""
FLAGS = {"muon": ["--optimizer", "muon", "--lr", "0.01", "--muon-adjust-lr-fn", "match_rms_adamw"],
         "adafactor": ["--optimizer", "adafactor", "--lr", "0.01"],
         "lamb": ["--optimizer", "lamb", "--lr", "0.01"]}
HEADERS = {"muon": "optimizer muon: Muon (momentum 0.95, nesterov True, ns_steps 5",
           "adafactor": "optimizer adafactor: Adafactor (lr = max relative step, beta2_decay -0.8",
           "lamb": "optimizer lamb: LAMB (betas (0.9, 0.999), eps 1e-08"}


def _train(cli, corpus_dir, save_dir, optimizer, *extra, nproc=2, updates=3):
    proc = cli("train", str(corpus_dir), *COMMON, *FLAGS[optimizer], "--nproc-per-node", str(nproc),
               "--max-update", str(updates), "--save-dir", str(save_dir), *extra)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout, [(r["num_updates"], float(r["loss"])) for r in json_records(proc.stdout)["train_inner"]]


def test_fully_sharded_gives_c10d_run_for_each_optimizer(cli, corpus_dir, tmp_path):
    """3 updates of each optimizer under fully_sharded (muon: its matrices Owned) against c10d: the same
    logged losses, and parameters bitwise equal for Muon, within fp32 reduction order for Adafactor and
    LAMB; both headers name the optimizer. An Adafactor run resumed after 2 updates ends bit for bit as
    the straight one (its row factors, column factors and step come back)."""
    half = tmp_path / "adafactor" / "half"

    def half_then_resume():  # 2 updates, save, resume, 1 == 3 straight (row and column factors)
        _train(cli, corpus_dir, half, "adafactor", updates=2)
        return _train(cli, corpus_dir, half, "adafactor")

    calls = {"half": half_then_resume}  # first: the longest chain
    for optimizer in FLAGS:
        calls[optimizer, "fs"] = lambda o=optimizer: _train(cli, corpus_dir, tmp_path / o / "fs", o)
        calls[optimizer, "ddp"] = lambda o=optimizer: _train(cli, corpus_dir, tmp_path / o / "ddp", o,
                                                             "--ddp-backend", "c10d")
    done = run_all(calls)
    for optimizer in FLAGS:
        (out, sharded), (out_ddp, ddp) = done[optimizer, "fs"], done[optimizer, "ddp"]
        assert HEADERS[optimizer] in out and HEADERS[optimizer] in out_ddp, out[:3000]
        assert [n for n, _ in sharded] == [n for n, _ in ddp] == ["1", "2", "3"]
        for (_, a), (_, b) in zip(sharded, ddp):
            assert abs(a - b) <= 2e-3, (optimizer, sharded, ddp)  # logged with 3 decimals
        a, extra = checkpoint_params(corpus_dir, tmp_path / optimizer / "fs" / "checkpoint_last")
        b, _ = checkpoint_params(corpus_dir, tmp_path / optimizer / "ddp" / "checkpoint_last")
        assert extra["args"]["optimizer"] == optimizer
        diff = max((a[k] - b[k]).abs().max().item() for k in a)
        assert diff <= TOLERANCE[optimizer], (optimizer, diff)
        if optimizer == "adafactor":
            _, resumed = done["half"]
            assert resumed == sharded[2:]
            c, _ = checkpoint_params(corpus_dir, half / "checkpoint_last")
            assert all(torch.equal(a[k], c[k]) for k in a)


def test_muon_resumes_exactly_and_on_another_world_size(cli, corpus_dir, tmp_path):
    """4 muon updates straight == 2, save, new processes, load under --fsdp-version 2, 2 (bit-identical
    parameters and the same logged losses: the owners' momentum and the AdamW moments come back, and
    fully_shard's row-split matrices, each orthogonalized whole on every rank, step as their owner did);
    the 2-rank checkpoint resumes on 1 rank, where every matrix is whole on the only rank."""
    half = tmp_path / "b"
    first = run_all({"straight": lambda: _train(cli, corpus_dir, tmp_path / "a", "muon", updates=4),
                     "half": lambda: _train(cli, corpus_dir, half, "muon", "--save-interval-updates", "2",
                                            updates=2)})
    _, straight = first["straight"]
    # Both start from checkpoint_1_2, which the resumed run (no interval saves) leaves alone.
    second = run_all({"resumed": lambda: _train(cli, corpus_dir, half, "muon", "--fsdp-version", "2", updates=4),
                      "one": lambda: _train(cli, corpus_dir, tmp_path / "c", "muon", "--restore-file",
                                            str(half / "checkpoint_1_2"), nproc=1, updates=4)})
    out, resumed = second["resumed"]
    assert "epoch 1 offset 2 @ 2 updates" in out and "fsdp-version 2" in out
    assert resumed == straight[2:]
    a, _ = checkpoint_params(corpus_dir, tmp_path / "a" / "checkpoint_last")
    b, _ = checkpoint_params(corpus_dir, half / "checkpoint_last")
    for k in a:
        assert torch.equal(a[k], b[k]), k
    out, one = second["one"]
    assert "saved by 2 ranks" in out and [n for n, _ in one] == ["3", "4"]
    # It starts from the saved weights, not from a fresh model (whose loss is the first update's).
    assert one[0][1] < straight[0][1] - 0.1, (one, straight)
