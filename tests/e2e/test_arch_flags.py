"""fairseq's --decoder-* overrides end to end: `fullshard train` builds, logs and records the
overridden shape; `eval-lm` and `generate` rebuild it from the checkpoint without the flags; resuming
needs the same shape."""
from __future__ import annotations

import json

import pytest

from tests.e2e.common import json_records, main_in_process

ARCH = "transformer_lm_gpt_mini"  # 2 layers, width 64, 2 heads
SHAPE = ["--decoder-layers", "3", "--decoder-embed-dim", "96", "--decoder-attention-heads", "4"]
TRAIN = ["--arch", ARCH, "--tokens-per-sample", "64", "--batch-size", "4", "--seed", "3", "--log-format", "json",
         "--log-interval", "1"]


@pytest.fixture(scope="module")
def trained(cli, corpus_dir, tmp_path_factory):
    """(save dir, train stdout) of 1 update with SHAPE."""
    save = tmp_path_factory.mktemp("arch") / "ckpt"
    proc = cli("train", str(corpus_dir), *TRAIN, *SHAPE, "--max-update", "1", "--save-dir", str(save))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return save, proc.stdout


def test_train_logs_and_records_the_overridden_shape(corpus_dir, trained):
    from fullshard.checkpoint import read_extra
    from fullshard.models import ARCHS, build_model, num_params

    save, stdout = trained
    vocab = int(json.loads((corpus_dir / "meta.json").read_text())["vocab_size"])
    n = num_params(build_model(ARCHS[ARCH].override(3, 96, 4), vocab, 512, device="meta"))
    # Ψ = V·C + P·C + L·(12C² + 13C) + 2C with FFN = 4C = 384
    assert n == vocab * 96 + 512 * 96 + 3 * (12 * 96**2 + 13 * 96) + 2 * 96
    assert f"model {ARCH} (3 layers, width 96, 4 heads, ffn 384), ddp-backend fully_sharded (" in stdout
    assert f"num. model params: {n:,} (num. trained: {n:,})" in stdout
    args = read_extra(str(save / "checkpoint_last"))["args"]
    assert {k: args[k] for k in ("arch", "decoder_layers", "decoder_embed_dim", "decoder_attention_heads",
                                 "decoder_ffn_embed_dim")} == dict(
        arch=ARCH, decoder_layers=3, decoder_embed_dim=96, decoder_attention_heads=4, decoder_ffn_embed_dim=384)


def test_eval_lm_and_generate_load_it_without_the_flags(cli, capsys, corpus_dir, small_tokenizer, trained, tmp_path):
    """eval-lm reproduces the trainer's valid loss; generate runs on the directory and a .safetensors
    (both record the shape); a .pt records nothing, so it needs --arch and the flags."""
    from fullshard.checkpoint.consolidate import consolidate

    save, stdout = trained
    ckpt = save / "checkpoint_last"
    proc = cli("eval-lm", str(corpus_dir), "--path", str(ckpt), "--log-format", "json")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    got, want = json_records(proc.stdout)["valid"][-1], json_records(stdout)["valid"][-1]
    assert (got["valid_loss"], got["valid_ppl"]) == (want["valid_loss"], want["valid_ppl"])
    consolidate(str(ckpt), str(tmp_path / "model.safetensors"))
    consolidate(str(ckpt), str(tmp_path / "model.pt"))
    texts = set()
    sources = ((ckpt, []), (tmp_path / "model.safetensors", []), (tmp_path / "model.pt", ["--arch", ARCH, *SHAPE]))
    for path, flags in sources:
        code, out, err = main_in_process(capsys, "generate", "--path", str(path), "--prompt", "The city",
                                         "--max-tokens", "6", "--greedy", "--tokenizer", str(small_tokenizer), *flags)
        assert code == 0 and out.startswith("The city"), (path, err)
        texts.add(out)
    assert len(texts) == 1
    code, out, err = main_in_process(capsys, "generate", "--path", str(tmp_path / "model.pt"), "--prompt", "x",
                                     "--arch", ARCH)
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert f"is not a {ARCH} model (2 layers, width 64, 2 heads, ffn 256;" in err
    code, out, err = main_in_process(capsys, "eval-lm", str(corpus_dir), "--path", str(ckpt),
                                     "--decoder-attention-heads", "5")
    assert code == 2 and "--decoder-attention-heads 5 must divide the width 96" in err


def test_resume_needs_the_same_shape(cli, capsys, corpus_dir, trained):
    """Without the flags the tensors differ; with other heads only the recorded shape does; with the
    same flags training resumes."""
    save, _ = trained
    common = ["train", str(corpus_dir), *TRAIN, "--save-dir", str(save)]
    code, _, err = main_in_process(capsys, *common)
    assert code == 2 and "cannot resume from" in err and "is of another model" in err, err
    code, _, err = main_in_process(capsys, *common, *SHAPE[:4], "--decoder-attention-heads", "2")
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert ("it was trained with 3 layers, width 96, 4 heads, ffn 384, this run has 3 layers, width 96, 2 heads, "
            "ffn 384") in err
    proc = cli(*common, *SHAPE, "--max-update", "2")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert [r["num_updates"] for r in json_records(proc.stdout)["train_inner"]] == ["2"]
