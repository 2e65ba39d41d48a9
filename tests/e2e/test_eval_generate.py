"""`fullshard eval-lm` and `fullshard generate` on the checkpoint of a short `fullshard train` run (on data
preprocessed with a small Hugging Face tokenizer, which the checkpoint records)."""
from __future__ import annotations

import json

import pytest
import torch

from tests.e2e.common import json_records, main_in_process, run_all

ARCH = "transformer_lm_gpt_mini"
TRAIN = ["--arch", ARCH, "--tokens-per-sample", "64", "--batch-size", "4", "--lr", "0.003", "--seed", "3",
         "--log-interval", "1", "--log-format", "json", "--nproc-per-node", "2", "--max-update", "4"]


@pytest.fixture(scope="module")
def trained(cli, corpus_dir, tmp_path_factory):
    """(checkpoint_last, the trainer's last valid record, a consolidated .safetensors, a .pt) of 4 updates
    on 2 ranks."""
    from fullshard.checkpoint.consolidate import consolidate

    root = tmp_path_factory.mktemp("eval")
    proc = cli("train", str(corpus_dir), *TRAIN, "--save-dir", str(root / "ckpt"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    ckpt = root / "ckpt" / "checkpoint_last"
    consolidate(str(ckpt), str(root / "st" / "model.safetensors"))
    consolidate(str(ckpt), str(root / "model.pt"))
    return ckpt, json_records(proc.stdout)["valid"][-1], root / "st" / "model.safetensors", root / "model.pt"


def test_eval_lm_equals_trainer_valid_loss(cli, corpus_dir, trained):
    """The checkpoint directory at world size 2 and the consolidated file at world size 1 give the
    trainer's last logged valid loss and perplexity (same blocks and batching)."""
    ckpt, valid, st, _ = trained
    cases = ((ckpt, "2"), (st, "1"))
    procs = run_all({path: lambda path=path, nproc=nproc: cli("eval-lm", str(corpus_dir), "--path", str(path),
                                                               "--nproc-per-node", nproc, "--log-format", "json")
                     for path, nproc in cases})
    for path, _ in cases:
        proc = procs[path]
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        got = json_records(proc.stdout)["valid"][-1]
        assert (got["valid_loss"], got["valid_ppl"]) == (valid["valid_loss"], valid["valid_ppl"]), (path, got, valid)
        line = next(x for x in proc.stdout.splitlines() if "Loss (base 2):" in x)
        loss4 = float(line.split("Loss (base 2): ")[1].split(",")[0])
        assert abs(loss4 - float(valid["valid_loss"])) <= 5e-4 + 1e-9, line
    assert got["valid_num_updates"] == "0" and valid["valid_num_updates"] == "4"  # a file records no updates


def test_eval_lm_reads_a_pipelined_checkpoint(cli, corpus_dir, tmp_path):
    """A --pipeline-parallel-size 2 run's checkpoint (its stages' parts in one directory) evaluates as one
    model at world size 1, to the pipelined trainer's last logged valid loss (the same sums in another
    order: within the log's rounding)."""
    train = [*TRAIN[:-1], "2", "--pipeline-parallel-size", "2", "--save-dir", str(tmp_path)]
    proc = cli("train", str(corpus_dir), *train)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    valid = json_records(proc.stdout)["valid"][-1]
    proc = cli("eval-lm", str(corpus_dir), "--path", str(tmp_path / "checkpoint_last"), "--nproc-per-node", "1",
               "--log-format", "json")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    got = json_records(proc.stdout)["valid"][-1]
    assert abs(float(got["valid_loss"]) - float(valid["valid_loss"])) <= 1e-3, (got, valid)


def test_eval_lm_bad_input(capsys, corpus_dir, trained, tmp_path):
    """Missing checkpoint or data, a .pt without --arch, a wrong --arch, too long blocks, data of another
    tokenizer: one line, exit 2."""
    import shutil

    ckpt, _, st, pt = trained
    gpt2 = tmp_path / "gpt2"
    shutil.copytree(corpus_dir, gpt2)  # the same token files, recorded as GPT-2 BPE's
    meta = json.loads((gpt2 / "meta.json").read_text())
    (gpt2 / "meta.json").write_text(json.dumps({**meta, "tokenizer": "gpt2-bpe"}))
    for path in (ckpt, st):
        code, _, err = main_in_process(capsys, "eval-lm", str(gpt2), "--path", str(path))
        assert code == 2 and f"was preprocessed with the tokenizer gpt2-bpe, the model was trained on data of " \
            f"{meta['tokenizer']}" in err and len(err.strip().splitlines()) == 1, err
    cases = [
        (["--path", str(tmp_path / "nope")], "does not exist"),
        (["--path", str(pt)], "does not record its architecture; pass --arch"),
        (["--path", str(pt), "--arch", "transformer_lm_gpt_tiny"], "is not a transformer_lm_gpt_tiny model"),
        (["--path", str(ckpt), "--tokens-per-sample", "4096"], "exceeds the 512 positions"),
        (["--path", str(ckpt), "--gen-subset", "test"], "has no split 'test'"),
    ]
    for flags, message in cases:
        code, _, err = main_in_process(capsys, "eval-lm", str(corpus_dir), *flags)
        assert code == 2 and message in err and len(err.strip().splitlines()) == 1, (flags, err)
    code, _, err = main_in_process(capsys, "eval-lm", str(tmp_path / "nodata"), "--path", str(ckpt))
    assert code == 2 and "does not exist" in err and len(err.strip().splitlines()) == 1, err


def _greedy_by_hand(ckpt, corpus_dir, tokenizer, prompt: str, n: int) -> str:
    """argmax loop over the plain model, the checkpoint loaded with fullshard.checkpoint.load."""
    from fullshard import checkpoint
    from fullshard.data.tokenizer import HFTokenizer
    from fullshard.models import ARCHS, build_model

    vocab = int(json.loads((corpus_dir / "meta.json").read_text())["vocab_size"])
    model = build_model(ARCH, vocab_size=vocab, max_positions=ARCHS[ARCH].max_positions)
    checkpoint.load(str(ckpt), model)
    model.eval()
    tok = HFTokenizer(tokenizer)
    ids = tok.encode(prompt)
    with torch.no_grad():
        for _ in range(n):
            nxt = int(model(torch.tensor([ids]))[0, -1, :tok.vocab_size].argmax())
            ids.append(nxt)
            if nxt == tok.eos_id:
                break
    return tok.decode(ids)


def test_generate_greedy_seed_and_errors(cli, capsys, corpus_dir, small_tokenizer, trained, tmp_path):
    """Greedy text equals a manual argmax loop (directory and consolidated file alike) through the data's
    tokenizer; a seed reproduces the sampled text and another seed changes it; bad input is one line, exit
    2, another tokenizer than the data's (or none) included."""
    from fullshard.data import load_gpt2_tokenizer
    from tests.wide_tokenizer import save_wide_tokenizer

    ckpt, _, st, pt = trained
    recorded = json.loads((corpus_dir / "meta.json").read_text())["tokenizer"]
    prompt = "The river flows"
    tok = ["--tokenizer", str(small_tokenizer)]
    want = _greedy_by_hand(ckpt, corpus_dir, small_tokenizer, prompt, 8)
    proc = cli("generate", "--path", str(ckpt), "--prompt", prompt, "--max-tokens", "8", "--greedy", *tok)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout == want + "\n" and proc.stderr == ""
    assert main_in_process(capsys, "generate", "--path", str(st), "--prompt", prompt, "--max-tokens", "8",
                 "--temperature", "0", *tok)[:2] == (0, want + "\n")
    sampled = {}
    for seed in ("5", "5", "6"):
        code, out, _ = main_in_process(capsys, "generate", "--path", str(st), "--prompt", prompt, "--max-tokens", "12",
                             "--top-k", "100", "--top-p", "0.95", "--temperature", "1.2", "--seed", seed, *tok)
        assert code == 0 and out.startswith(prompt)
        sampled.setdefault(seed, set()).add(out)
    assert len(sampled["5"]) == 1 and sampled["5"] != sampled["6"]
    wide = save_wide_tokenizer(tmp_path / "wide")
    cases = [
        # the checkpoint directory and the consolidated file record the data's tokenizer
        (["--path", str(ckpt), "--prompt", prompt], f"the model was trained on data preprocessed with the tokenizer "
         f"{recorded}; "),
        (["--path", str(st), "--prompt", prompt], "pass its directory (the one given to `fullshard preprocess "
         "--tokenizer`) as --tokenizer DIR"),
        (["--path", str(ckpt), "--prompt", prompt, "--tokenizer", str(wide)], "the tokenizer hf:wide:"),
        (["--path", str(ckpt), "--prompt", prompt, "--tokenizer", str(tmp_path)], "has no tokenizer.json"),
        # a .pt records nothing: GPT-2 BPE's ids beyond the model's are caught
        (["--path", str(pt), "--arch", ARCH, "--prompt", prompt], f"the prompt has token id "
         f"{max(load_gpt2_tokenizer().encode(prompt))}, beyond the model's 2,048 ids"),
        (["--path", str(tmp_path / "nope"), "--prompt", "x"], "does not exist"),
        (["--path", str(ckpt), "--prompt", ""], "--prompt is empty"),
        (["--path", str(ckpt), "--prompt", "x", "--top-p", "0"], "--top-p must be in (0, 1]"),
        (["--path", str(ckpt), "--prompt", "x", "--top-p", "1.5"], "--top-p must be in (0, 1]"),
        (["--path", str(ckpt), "--prompt", "x", "--temperature", "-1"], "--temperature must be >= 0"),
    ]
    for flags, message in cases:
        code, out, err = main_in_process(capsys, "generate", *flags)
        assert code == 2 and out == "" and message in err and len(err.strip().splitlines()) == 1, (flags, err)
