"""The seeds' two `fairseq-train` commands (13B GPT-3 on 1 and on 8 GPUs; the same command line once
the GPU environment variables are dropped) run as `fullshard train` with only ``--arch`` changed to
the CPU-sized ``transformer_lm_gpt3_tiny`` (2048 positions, like fairseq's GPT-3 family).

The fast test checks that the verbatim command (``--tokens-per-sample 2048``) passes validation; the
training test runs the verbatim argument list with a few flags appended (argparse: the later
occurrence wins) so that it takes seconds instead of the full command's hour of fp16 on a CPU.
"""
from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from tests.e2e.common import cli_env

ARCH = "transformer_lm_gpt3_tiny"
DATA = "data-bin/wikitext-103-roberta-bpe-bin"

# Copied from the seeds (fairseq-train -> fullshard train, GPU env vars dropped, CPU-sized --arch).
SEED_COMMAND = """fullshard train data-bin/wikitext-103-roberta-bpe-bin \\
    --ddp-backend fully_sharded --fp16 --fp16-init-scale 4 \\
    --cpu-offload --checkpoint-activations \\
    --task language_modeling --tokens-per-sample 2048 --batch-size 8 \\
    --arch transformer_lm_gpt3_tiny \\
    --optimizer cpu_adam --adam-betas "(0.9,0.98)" \\
    --lr 0.0001 --lr-scheduler polynomial_decay --warmup-updates 5 --total-num-update 10 \\
    --max-update 10 --no-save --log-format json --log-interval 1"""

# Appended to the verbatim argv by the training test: one short update instead of ten of 8 x 2048.
FAST_OVERRIDES = ["--max-update", "1", "--total-num-update", "1", "--warmup-updates", "0",
                  "--tokens-per-sample", "256", "--batch-size", "2"]

FAIRSEQ_INNER_FIELDS = ("epoch", "update", "loss", "ppl", "wps", "ups", "wpb", "bsz", "num_updates", "lr",
                        "gnorm", "loss_scale", "train_wall", "gb_free", "wall")


def seed_argv() -> list:
    """The seed command's arguments after `fullshard train`."""
    argv = shlex.split(SEED_COMMAND.replace("\\\n", " "))
    assert argv[:2] == ["fullshard", "train"]
    return argv[2:]


def _link_data(data_dir: Path, root: Path) -> None:
    """root/data-bin/wikitext-103-roberta-bpe-bin -> a preprocessed data directory."""
    (root / "data-bin").mkdir()
    os.symlink(data_dir, root / DATA)


def _fullshard(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    """`fullshard ARGS` run in `cwd`, outside any torchrun environment, importing this checkout."""
    import fullshard

    env = cli_env()
    env["PYTHONPATH"] = str(Path(fullshard.__file__).resolve().parents[1])
    return subprocess.run([sys.executable, "-m", "fullshard.cli", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def builtin_data(tmp_path_factory) -> Path:
    """The data directory a user makes for the seed command (README):
    `fullshard preprocess --builtin-corpus --destdir data-bin/wikitext-103-roberta-bpe-bin`."""
    root = tmp_path_factory.mktemp("seeds")
    proc = _fullshard("preprocess", "--builtin-corpus", "--destdir", DATA, cwd=root)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return root / DATA


def test_gpt3_tiny_has_the_gpt3_familys_2048_positions():
    """The arch exists, keeps gpt_tiny's shape and has 2048 positions; gpt_tiny/gpt_mini are unchanged."""
    import dataclasses

    from fullshard.models import ARCHS

    assert ARCH in ARCHS and dataclasses.replace(ARCHS[ARCH], max_positions=1024) == ARCHS["transformer_lm_gpt_tiny"]
    assert ARCHS[ARCH].max_positions == 2048
    assert ARCHS["transformer_lm_gpt_tiny"].max_positions == 1024
    assert ARCHS["transformer_lm_gpt_mini"].max_positions == 512


def test_verbatim_seed_command_passes_validation(builtin_data, tmp_path, monkeypatch, capsys):
    """The exact seed command (--tokens-per-sample 2048, 8 sequences) validates against the built-in
    corpus, with 1 and 2 ranks, although its valid split is smaller than one batch; the fast
    overrides appended after it win (argparse keeps the last value)."""
    from fullshard.data import read_meta
    from fullshard.train import options

    valid_tokens = read_meta(str(builtin_data))["splits"]["valid"]["num_tokens"]
    assert 2049 <= valid_tokens < 8 * 2049  # evaluated on what it has, not rejected
    _link_data(builtin_data, tmp_path)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(options, "_FP16_WARNED", [])
    cfg = options.parse_train_args(seed_argv())
    assert (cfg.arch, cfg.max_positions, cfg.tokens_per_sample, cfg.batch_size) == (ARCH, 2048, 2048, 8)
    assert cfg.optimizer == "cpu_adam" and cfg.fp16 and cfg.fp16_init_scale == 4 and cfg.cpu_offload
    assert cfg.checkpoint_activations and cfg.adam_betas == (0.9, 0.98) and cfg.no_save
    assert (cfg.lr_scheduler, cfg.warmup_updates, cfg.total_num_update, cfg.max_update) == \
        ("polynomial_decay", 5, 10, 10)
    assert (cfg.log_format, cfg.log_interval, cfg.nproc_per_node) == ("json", 1, 1)
    two = options.parse_train_args(seed_argv() + ["--nproc-per-node", "2"])
    assert two.nproc_per_node == 2 and two.tokens_per_sample == 2048
    fast = options.parse_train_args(seed_argv() + FAST_OVERRIDES)
    assert (fast.max_update, fast.total_num_update, fast.warmup_updates, fast.tokens_per_sample,
            fast.batch_size) == (1, 1, 0, 256, 2)
    err = capsys.readouterr().err
    assert err.count("--bf16 is much faster here") == 1 and len(err.splitlines()) == 1, err
    assert list(tmp_path.iterdir()) == [tmp_path / "data-bin"]  # validation wrote nothing


def test_seed_command_trains(corpus_dir, tmp_path):
    """The seed's argv plus FAST_OVERRIDES trains one fp16 update with cpu-offload, activation
    checkpointing and cpu_adam: exit 0, one fp16 warning, fairseq's json log fields, a validation
    record, and no checkpoint (--no-save)."""
    import math

    from fullshard.models import ARCHS, build_model, num_params

    _link_data(corpus_dir, tmp_path)  # 150 documents: a valid split of a few batches keeps this fast
    proc = _fullshard("train", *seed_argv(), *FAST_OVERRIDES, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stderr.count("--fp16 on a CPU is slow") == 1, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    records = {"train_inner": [], "valid": [], "train": []}
    for line in proc.stdout.splitlines():
        parts = line.split(" | ", 3)
        if len(parts) == 4 and parts[2] in records:
            records[parts[2]].append(json.loads(parts[3]))
    assert len(records["train_inner"]) == 1, proc.stdout
    inner = records["train_inner"][0]
    assert set(FAIRSEQ_INNER_FIELDS) <= set(inner), inner
    assert inner["num_updates"] == "1" and inner["wpb"] == str(2 * 256) and inner["bsz"] == "2", inner
    assert inner["loss_scale"] == "4", inner
    # base 2, as fairseq: an untrained model is near log2(V) bits per token
    vocab = int(json.loads((corpus_dir / "meta.json").read_text())["vocab_size"])
    assert abs(float(inner["loss"]) - math.log2(vocab)) < 1.5 and float(inner["wps"]) > 0, inner
    params = num_params(build_model(ARCH, vocab, ARCHS[ARCH].max_positions, device="meta"))
    assert f"model {ARCH}" in proc.stdout and f"num. model params: {params:,}" in proc.stdout
    valid = records["valid"][-1]
    assert float(valid["valid_loss"]) > 0 and valid["valid_num_updates"] == "1", valid
    assert records["train"] and records["train"][-1]["train_num_updates"] == "1"
    assert not (tmp_path / "checkpoints").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data-bin"]
