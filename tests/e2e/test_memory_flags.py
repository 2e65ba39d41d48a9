"""`fullshard train` memory and precision flags end to end: 2 gloo ranks, gpt_mini, 6 updates.

Six runs (cases combined per run to keep this file near two minutes on 2 cores):

* ``ref``  fully_sharded, batch 4, fp32, --cpu-offload
* ``ns``   batch 2 x --update-freq 2, --accumulate-mode no_sync, --offload-activations
* ``rs``   batch 2 x --update-freq 2, --accumulate-mode reduce_scatter, --checkpoint-activations
* ``fp16`` --fp16 with a loss scale so large that the first updates overflow, --cpu-offload,
           --checkpoint-activations (32-token samples, as c10d_fp16)
* ``bf16`` --bf16, --update-freq 2, reduce_scatter
* ``c10d_fp16`` --ddp-backend c10d --fp16 (autocast + the same scaler), --checkpoint-activations

ref, ns and rs see the same 8 sequences per update in fp32, so their per-update
losses agree to the logged precision.
"""
from __future__ import annotations

import json
import math

import pytest

from tests.e2e.common import ARCH, json_records, run_all, run_cli_checked

UPDATES = 6
BASE = ["--nproc-per-node", "2", "--arch", ARCH, "--tokens-per-sample", "64", "--lr", "0.001",
        "--lr-scheduler", "polynomial_decay", "--warmup-updates", "2", "--max-update", str(UPDATES),
        "--clip-norm", "1.0", "--weight-decay", "0.01", "--adam-betas", "(0.9,0.98)", "--seed", "3",
        "--log-interval", "1", "--log-format", "json", "--no-save"]
RUNS = {
    "ref": ["--batch-size", "4", "--cpu-offload"],
    "ns": ["--batch-size", "2", "--update-freq", "2", "--accumulate-mode", "no_sync", "--offload-activations"],
    "rs": ["--batch-size", "2", "--update-freq", "2", "--accumulate-mode", "reduce_scatter",
           "--checkpoint-activations"],
    # fp16 matmuls are emulated on this CPU (about 6x fp32's time): the fp16 runs use shorter samples.
    "fp16": ["--batch-size", "4", "--tokens-per-sample", "32", "--fp16", "--fp16-init-scale", str(2**20),
             "--cpu-offload", "--checkpoint-activations"],
    "bf16": ["--batch-size", "2", "--update-freq", "2", "--accumulate-mode", "reduce_scatter", "--bf16"],
    "c10d_fp16": ["--ddp-backend", "c10d", "--batch-size", "4", "--tokens-per-sample", "32", "--fp16",
                  "--fp16-init-scale", str(2**20), "--checkpoint-activations"],
}
OVERFLOW = "NOTE: gradient overflow detected, ignoring gradient, setting loss scale to: "


@pytest.fixture(scope="module")
def runs(cli, corpus_dir):
    procs = run_all({name: lambda flags=flags: cli("train", str(corpus_dir), *BASE, *flags)
                     for name, flags in RUNS.items()})
    out = {}
    for name, proc in procs.items():
        assert proc.returncode == 0, name + "\n" + proc.stdout[-3000:] + proc.stderr[-3000:]
        out[name] = dict(stdout=proc.stdout, records=json_records(proc.stdout))
    return out


def _losses(run):
    return [float(r["loss"]) for r in run["records"]["train_inner"]]


def test_every_run_trains(runs):
    for name, run in runs.items():
        inner = run["records"]["train_inner"]
        assert [int(r["num_updates"]) for r in inner] == list(range(1, UPDATES + 1)), name
        assert all(math.isfinite(x) for x in _losses(run)), name
        assert len(run["records"]["valid"]) == 1 and math.isfinite(float(run["records"]["valid"][0]["valid_loss"]))
        if "fp16" not in name:
            assert all(r["loss_scale"] == "1" for r in inner), name
            assert OVERFLOW not in run["stdout"], name
    assert "precision and memory: cpu-offload" in runs["ref"]["stdout"]
    assert "checkpoint-activations, offload-activations, update-freq 2 accumulated by no_sync" in runs["ns"]["stdout"]


def test_accumulate_modes_equal_one_larger_batch(runs):
    ref, ns, rs = (_losses(runs[k]) for k in ("ref", "ns", "rs"))
    for a, b, c in zip(ref, ns, rs):
        # The log keeps 3 decimals: allow one unit in the last logged place.
        assert math.isclose(a, b, abs_tol=1.01e-3) and math.isclose(a, c, abs_tol=1.01e-3), (ref, ns, rs)
    assert math.isclose(float(runs["ns"]["records"]["train"][0]["train_gnorm"]),
                        float(runs["rs"]["records"]["train"][0]["train_gnorm"]), abs_tol=1.01e-3)


@pytest.mark.parametrize("name", ["fp16", "c10d_fp16"])
def test_fp16_overflow_backs_off_and_logs_like_fairseq(runs, name):
    """Scale 2**20 overflows the fp16 gradients: fairseq's NOTE line per skipped
    step, halving the scale each time; skipped steps don't count as updates;
    each train_inner record's loss_scale is the scale in use."""
    scale, notes, updates = 2.0**20, 0, []
    for line in runs[name]["stdout"].splitlines():
        if OVERFLOW in line:
            new = float(line.split(OVERFLOW)[1])
            assert new == scale / 2, line
            scale, notes = new, notes + 1
        elif " | train_inner | " in line:
            record = json.loads(line.split(" | ", 3)[3])
            assert float(record["loss_scale"]) == scale, (line, scale)
            updates.append(int(record["num_updates"]))
    assert notes >= 1 and updates == list(range(1, UPDATES + 1)), (notes, updates)
    # Same init and data order as the fp32 reference, but overflowed batches were
    # consumed without an update: the curve is similar, not equal.
    assert abs(_losses(runs[name])[0] - _losses(runs["ref"])[0]) < 0.1


def test_bf16_close_to_fp32(runs):
    for a, b in zip(_losses(runs["bf16"]), _losses(runs["ref"])):
        assert abs(a - b) < 0.1, (_losses(runs["bf16"]), _losses(runs["ref"]))


@pytest.mark.parametrize("argv, expected, subprocess", [
    (["--ddp-backend", "c10d", "--cpu-offload"], "--cpu-offload needs --ddp-backend fully_sharded", True),
    (["--fp16", "--bf16"], "--fp16 and --bf16 are mutually exclusive", False),
    (["--fp16", "--fp16-scale-window", "0"], "--fp16-scale-window must be >= 1", False),
])
def test_bad_memory_flags_exit_2(capsys, corpus_dir, tmp_path, argv, expected, subprocess):
    """Checked before any rank starts: the first case through the command (its exit code), the others
    in this process."""
    argv = ["train", str(corpus_dir), "--arch", ARCH, "--tokens-per-sample", "64", "--batch-size", "4",
            "--nproc-per-node", "2", "--save-dir", str(tmp_path / "ckpt"), *argv]
    code, out, err = run_cli_checked(capsys, argv, subprocess)
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("fullshard train: error: ") and expected in lines[0], lines
    assert out == "" and not (tmp_path / "ckpt").exists()
