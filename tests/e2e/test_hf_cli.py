"""`fullshard preprocess --tokenizer DIR` and `fullshard train --hf-model DIR` as a user runs them: a tiny
Llama with its own tokenizer (trained here on the corpus, no network) fine-tuned with LoRA at 2 ranks, its
adapter written for PEFT; `eval-lm` and `generate` on such runs' checkpoints (LoRA and full fine-tuning);
and the bad inputs of the Hugging Face flags, each one line and exit 2."""
from __future__ import annotations

import json
import re
import shutil

import pytest

pytest.importorskip("transformers")
pytest.importorskip("peft")

from tests.e2e.common import main_in_process  # noqa: E402

T = 16
PROMPT = "The river"


def _valid(out: str) -> tuple[str, str]:
    """(loss, ppl) of the last `valid on 'valid' subset` line of a --log-format simple log."""
    line = [x for x in out.splitlines() if "valid on 'valid' subset" in x][-1]
    return re.search(r"\| loss ([\d.]+) \| ppl ([\d.]+)", line).groups()


def _transformers_greedy(model, tokenizer_dir, n: int) -> str:
    """PROMPT and transformers' own greedy continuation of it (``generate``, KV cache on), decoded."""
    import torch
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    ids = tok.encode(PROMPT, add_special_tokens=False).ids
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False)
    return tok.decode(out[0].tolist(), skip_special_tokens=False)


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory, corpus_dir):
    """A tiny random Llama saved with a 300-id byte-level BPE tokenizer trained on the corpus text."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import AutoModelForCausalLM, LlamaConfig

    path = tmp_path_factory.mktemp("llama")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    text = (corpus_dir.parent / "corpus.txt").read_text().split("\n\n")
    tok.train_from_iterator(text, trainers.BpeTrainer(vocab_size=300, special_tokens=["<s>", "</s>"],
                                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>", "bos_token": "<s>"}))
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=tok.get_vocab_size(), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         tie_word_embeddings=True, bos_token_id=0, eos_token_id=1)
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def llama_data(tmp_path_factory, cli, corpus_dir, llama_dir):
    """The corpus preprocessed with the Llama's tokenizer."""
    data = tmp_path_factory.mktemp("llama_data") / "data"
    proc = cli("preprocess", "--trainpref", str(corpus_dir.parent / "corpus.txt"), "--destdir", str(data),
               "--valid-fraction", "0.1", "--tokenizer", str(llama_dir))
    assert proc.returncode == 0, proc.stderr
    return data


def test_preprocess_with_model_tokenizer_then_lora_finetune(capsys, cli, llama_data, llama_dir, tmp_path):
    import torch
    from peft import PeftModel
    from safetensors.torch import load_file
    from torch.distributed.checkpoint import FileSystemReader
    from transformers import AutoModelForCausalLM

    from fullshard.train.trained_model import load_plain_model, read_spec

    data = llama_data
    meta = json.loads((data / "meta.json").read_text())
    assert meta["vocab_size"] == 300 and meta["eos_id"] == 1 and meta["tokenizer"].startswith("hf:"), meta
    save = tmp_path / "ckpt"

    def train(updates: int, save=save):
        # the frozen base stored in bf16, the adapters fp32
        proc = cli("train", str(data), "--hf-model", str(llama_dir), "--lora-rank", "4", "--lora-target-modules",
                   "q_proj,v_proj", "--base-dtype", "bf16", "--nproc-per-node", "2", "--fsdp-version", "2",
                   "--tokens-per-sample", str(T), "--batch-size", "2", "--max-update", str(updates), "--lr", "1e-2",
                   "--log-format", "simple", "--save-dir", str(save))
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        return proc.stdout

    out = train(2)
    # q_proj: A 4x32 + B 32x4, v_proj: A 4x32 + B 16x4 (2 key-value heads of 8), in 2 layers
    assert "+ LoRA rank 4 (base bf16, adapters fp32)" in out and "num. trained: 896)" in out, out[-3000:]
    # rank 0's shards: half of the 28,192 base parameters in bf16 (2 bytes) + half of the 896 adapter ones in
    # fp32 (4 bytes), plus padding; an fp32 base would take 56,384 + 1,792
    shards = int(re.search(r"parameter shards on rank 0: ([\d,]+) bytes", out).group(1).replace(",", ""))
    assert 28_192 + 1_792 <= shards < 28_192 + 1_792 + 512, out[-3000:]
    assert (save / "checkpoint_last").is_dir()
    dtypes = {k: v.properties.dtype for k, v in FileSystemReader(str(save / "checkpoint_last")).read_metadata()
              .state_dict_metadata.items() if k.startswith("model.") and hasattr(v, "properties")}
    assert {d for k, d in dtypes.items() if "lora_" in k} == {torch.float32}, dtypes
    assert {d for k, d in dtypes.items() if "lora_" not in k} == {torch.bfloat16}, dtypes
    out = train(3)  # resumes the adapters and their optimizer state from checkpoint_last
    assert "@ 2 updates" in out and "num_updates 3" in out, out[-3000:]
    # eval-lm rebuilds the LoRA model (bf16 base) from the recorded flags: the trainer's last valid loss
    proc = cli("eval-lm", str(data), "--path", str(save / "checkpoint_last"), "--nproc-per-node", "2")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert _valid(proc.stdout) == _valid(out), (_valid(proc.stdout), _valid(out))
    adapter = save / "hf"
    assert {"adapter_config.json", "adapter_model.safetensors", "tokenizer.json"} <= {p.name for p in adapter.iterdir()}
    train(3, tmp_path / "straight")  # the same 3 updates without a resume: the same adapter bit for bit
    assert load_file(adapter / "adapter_model.safetensors").keys() and all(
        torch.equal(v, load_file(tmp_path / "straight" / "hf" / "adapter_model.safetensors")[k])
        for k, v in load_file(adapter / "adapter_model.safetensors").items())
    base = AutoModelForCausalLM.from_pretrained(llama_dir, dtype=torch.bfloat16)
    with torch.no_grad():
        ids = torch.tensor([[5, 9, 33, 120]])
        before = base(ids).logits
        after = PeftModel.from_pretrained(base, str(adapter))(ids).logits
    assert (after - before).abs().max() > 1e-4  # the trained adapter changes the model
    # generate's model: the trained one (this tiny model's greedy text repeats the last token before and
    # after 3 updates, so its logits are compared), and the same greedy text as transformers' generate
    # over PEFT's model of the exported adapter
    with torch.no_grad():
        got = load_plain_model(read_spec(str(save / "checkpoint_last")))(ids).logits
    assert (got - after).abs().max() <= 1e-6, (got - after).abs().max()
    capsys.readouterr()  # transformers' loading bars above
    code, text, err = main_in_process(capsys, "generate", "--path", str(save / "checkpoint_last"), "--prompt", PROMPT,
                                      "--max-tokens", "6", "--greedy")
    want = _transformers_greedy(PeftModel.from_pretrained(base, str(adapter)), llama_dir, 6)
    assert (code, text, err) == (0, want + "\n", ""), (code, text, err[-2000:], want)


def test_eval_generate_full_finetune(capsys, cli, llama_data, llama_dir, tmp_path):
    """A full fine-tune (FSDP1 wrapper, 2 ranks): eval-lm at 1 rank (the checkpoint resharded) gives the
    trainer's last valid loss; generate's greedy text is transformers' own on the exported model and not the
    untrained model's; with --arch, without DIR's tokenizer.json, with another model in DIR or without DIR:
    one line, exit 2."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    base = tmp_path / "base"  # a copy: the test takes it away afterwards
    shutil.copytree(llama_dir, base)
    save = tmp_path / "run"
    proc = cli("train", str(llama_data), "--hf-model", str(base), "--nproc-per-node", "2", "--fsdp-version", "1",
               "--tokens-per-sample", str(T), "--batch-size", "2", "--max-update", "3", "--lr", "1e-2",
               "--log-format", "simple", "--save-dir", str(save))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    ckpt = str(save / "checkpoint_last")
    evaluated = cli("eval-lm", str(llama_data), "--path", ckpt, "--nproc-per-node", "1")
    assert evaluated.returncode == 0, evaluated.stdout[-3000:] + evaluated.stderr[-3000:]
    assert _valid(evaluated.stdout) == _valid(proc.stdout), (_valid(evaluated.stdout), _valid(proc.stdout))
    assert "Hugging Face" in evaluated.stdout and "on 1 rank" in evaluated.stdout

    code, text, err = main_in_process(capsys, "generate", "--path", ckpt, "--prompt", PROMPT, "--max-tokens", "6",
                                      "--greedy")
    want = _transformers_greedy(AutoModelForCausalLM.from_pretrained(save / "hf"), base, 6)
    untrained = _transformers_greedy(AutoModelForCausalLM.from_pretrained(base), base, 6)
    assert (code, text, err) == (0, want + "\n", ""), (code, text, err[-2000:], want)
    assert want != untrained, want

    capsys.readouterr()  # transformers' loading bars above

    def fails(*argv) -> str:
        code, out, err = main_in_process(capsys, *argv)
        assert code == 2 and out == "" and len(err.strip().splitlines()) == 1, (argv, code, err)
        return err

    assert "--arch does not apply" in fails("eval-lm", str(llama_data), "--path", ckpt, "--arch",
                                            "transformer_lm_gpt_mini")
    (base / "tokenizer.json").unlink()
    assert "has no tokenizer.json" in fails("generate", "--path", ckpt, "--prompt", PROMPT)
    other = AutoModelForCausalLM.from_config(LlamaConfig(vocab_size=300, hidden_size=16, intermediate_size=32,
                                                         num_hidden_layers=2, num_attention_heads=2,
                                                         max_position_embeddings=64, tie_word_embeddings=True))
    other.save_pretrained(base)  # DIR now holds another model
    capsys.readouterr()
    assert "does not fit the model" in fails("eval-lm", str(llama_data), "--path", ckpt)
    base.rename(tmp_path / "moved")
    for argv in (("eval-lm", str(llama_data), "--path", ckpt), ("generate", "--path", ckpt, "--prompt", PROMPT)):
        assert f"is a fine-tune of the Hugging Face model {str(base)!r}, which is not a directory" in fails(*argv)


def test_tokenizer_of_more_than_65536_ids_trains(cli, tmp_path):
    """A Qwen2 with its own 70,000-id tokenizer: preprocess writes uint32 ids and `fullshard train --hf-model`
    at 2 ranks logs, at update 1 (the 4 train blocks make one global batch), single-process transformers'
    loss on those blocks; ids above 65,535 truncated to uint16 would give another loss."""
    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    from tests.e2e.common import json_records
    from tests.wide_tokenizer import WIDE_VOCAB, save_wide_tokenizer, word

    model_dir = tmp_path / "qwen2"
    torch.manual_seed(0)
    # hidden 8: the 70,000-row embedding and output stay small; a wide init makes the loss depend on the targets
    config = Qwen2Config(vocab_size=WIDE_VOCAB, hidden_size=8, intermediate_size=16, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
                         tie_word_embeddings=False, initializer_range=0.5, bos_token_id=1, eos_token_id=1)
    AutoModelForCausalLM.from_config(config).save_pretrained(model_dir)
    save_wide_tokenizer(model_dir)
    rng = np.random.default_rng(0)
    (tmp_path / "train.txt").write_text(" ".join(word(i) for i in rng.integers(62_000, WIDE_VOCAB, 4 * T + 4)))
    (tmp_path / "valid.txt").write_text(" ".join(word(i) for i in rng.integers(2, WIDE_VOCAB, 2 * T)))
    data = tmp_path / "data"
    proc = cli("preprocess", "--trainpref", str(tmp_path / "train.txt"), "--validpref", str(tmp_path / "valid.txt"),
               "--destdir", str(data), "--tokenizer", str(model_dir))
    assert proc.returncode == 0, proc.stderr
    assert json.loads((data / "meta.json").read_text())["dtype"] == "uint32"
    stream = torch.from_numpy(np.fromfile(data / "train.bin", dtype=np.uint32).astype(np.int64))
    # 4 blocks of T + 1 tokens at stride T (the launcher asks for 4 x (T + 1) tokens: one document and its eos)
    assert stream.numel() == 4 * T + 5 and int(stream.max()) > 65_535

    proc = cli("train", str(data), "--hf-model", str(model_dir), "--nproc-per-node", "2", "--fsdp-version", "2",
               "--tokens-per-sample", str(T), "--batch-size", "2", "--max-update", "2", "--lr", "1e-3",
               "--log-format", "json", "--log-interval", "1", "--no-save")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    logs = json_records(proc.stdout)
    losses = [float(r["loss"]) for r in logs["train_inner"]]
    assert len(losses) == 2 and all(np.isfinite(losses)) and np.isfinite(float(logs["valid"][-1]["valid_loss"]))

    model = AutoModelForCausalLM.from_pretrained(model_dir)
    blocks = stream[:4 * T + 1].unfold(0, T + 1, T)  # (4, T + 1) at stride T

    def bits(tokens):
        with torch.no_grad():
            logits = model(tokens[:, :-1]).logits
        return torch.nn.functional.cross_entropy(logits.reshape(-1, WIDE_VOCAB), tokens[:, 1:].reshape(-1)).item() \
            / np.log(2)

    want, truncated = bits(blocks), bits(blocks % 2**16)
    assert abs(want - truncated) > 0.05, (want, truncated)
    assert abs(losses[0] - want) <= 1.5e-3, (losses, want)  # the log rounds to 3 decimals
    print(f"loss (bits) at updates 1, 2: {losses}; single-process transformers {want:.4f}, "
          f"ids truncated to uint16 {truncated:.4f}; train.bin {(data / 'train.bin').stat().st_size} bytes")


def _bad_dirs(tmp_path, llama_dir, gpt2: bool) -> dict:
    empty = tmp_path / "empty"
    empty.mkdir()
    unknown = tmp_path / "unknown"
    unknown.mkdir()
    (unknown / "config.json").write_text(json.dumps({"model_type": "no_such_model"}))
    (unknown / "model.safetensors").write_bytes(b"")
    if not gpt2:
        return {"empty": empty, "unknown": unknown}
    # A tiny GPT-2 (its decoder layers' weights are transformers' Conv1D, not nn.Linear) with the Llama's tokenizer.
    import shutil

    from transformers import AutoModelForCausalLM, GPT2Config

    gpt2 = tmp_path / "gpt2"
    AutoModelForCausalLM.from_config(GPT2Config(vocab_size=300, n_embd=16, n_layer=1, n_head=2, n_positions=64)) \
        .save_pretrained(gpt2)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(llama_dir / name, gpt2 / name)
    return {"empty": empty, "unknown": unknown, "gpt2": gpt2}


@pytest.mark.parametrize("case, extra, expected", [
    ("missing", [], "is not a directory"),
    ("empty", [], "has no config.json"),
    ("unknown", [], "transformers cannot read its config.json"),
    ("llama", ["--lora-rank", "4", "--lora-target-modules", "nope_proj"],
     "--lora-target-modules 'nope_proj': PEFT cannot adapt it"),
    ("llama", ["--merge-lora"], "--merge-lora needs --lora-rank"),
    ("llama", ["--base-dtype", "bf16"], "--base-dtype bf16 needs --lora-rank"),
    ("llama", ["--lora-rank", "4", "--base-dtype", "fp16", "--bf16"], "--base-dtype fp16 with --bf16 would cast"),
    ("llama", ["--quantize-base", "nf4"], "--quantize-base nf4 needs --lora-rank"),
    ("llama", ["--lora-rank", "4", "--quantize-base", "nf4", "--fsdp-version", "1"],
     "--quantize-base nf4 needs --fsdp-version 2"),
    ("gpt2", ["--lora-rank", "4", "--quantize-base", "nf4", "--fsdp-version", "2"],
     "--quantize-base nf4: the decoder layers of"),
    ("llama", ["--tokens-per-sample", "65"], "exceeds the 64 positions"),
    ("llama", ["--save-hf", "{file}"], "is a file; the export is a directory"),
    ("vocab", [], "preprocess with the model's tokenizer"),
    (None, ["--lora-rank", "4"], "--lora-rank needs --hf-model"),
])
def test_bad_input_one_line_exit_2(capsys, corpus_dir, llama_data, llama_dir, tmp_path, case, extra, expected):
    if case == "gpt2":
        pytest.importorskip("torchao")  # without it, the flag is refused earlier, for that
    dirs = {**_bad_dirs(tmp_path, llama_dir, gpt2=case == "gpt2"), "missing": tmp_path / "nowhere",
            "llama": llama_dir, "vocab": llama_dir}
    capsys.readouterr()  # save_pretrained's progress lines
    (tmp_path / "a_file").write_text("")
    extra = [str(tmp_path / "a_file") if x == "{file}" else x for x in extra]
    # GPT-2 BPE data has 50,257 ids, more than the Llama's 300
    data = corpus_dir if case in (None, "vocab") else llama_data
    argv = ["train", str(data), "--tokens-per-sample", str(T), "--batch-size", "2", "--no-save",
            *(["--hf-model", str(dirs[case])] if case else []), *extra]
    code, _, err = main_in_process(capsys, *argv)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1, err
    assert lines[0].startswith("fullshard train: error: ") and expected in lines[0], lines[0]
