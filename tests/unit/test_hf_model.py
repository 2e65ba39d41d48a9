"""The pieces of the sharded Hugging Face load (fullshard/train/hf_model.py) in one process: row reads
equal the stored tensor's rows in every stored dtype, a model with no decoder-layer list is refused in
one line, and a checkpoint whose tensors do not match its config (or that holds more) is refused naming the
tensor."""
from __future__ import annotations

import json
import types

import pytest
import torch
import torch.nn as nn

pytest.importorskip("transformers")
pytest.importorskip("peft")

from safetensors.torch import save_file  # noqa: E402

from fullshard.train import hf_model  # noqa: E402


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_read_rows_equal_the_stored_rows(tmp_path, dtype):
    tensors = {"a": torch.randn(7, 5).to(dtype), "b": torch.randn(9).to(dtype), "c": torch.randn(3, 2, 4).to(dtype)}
    file = str(tmp_path / "model.safetensors")
    save_file(tensors, file)
    header, start = hf_model.read_header(file)
    for name, full in tensors.items():
        for lo, hi in ((0, full.shape[0]), (1, 3), (2, 2), (full.shape[0] - 1, full.shape[0])):
            rows = hf_model.read_rows(file, header[name], start, lo, hi)
            assert rows.dtype == dtype and torch.equal(rows, full[lo:hi]), (name, lo, hi)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_read_rows_into_fills_the_given_shard(tmp_path, dtype, monkeypatch):
    """``read_rows_into`` reads a rank's rows into its shard: the stored dtype straight into its bytes,
    another dtype converted a few rows at a time (``CHUNK_BYTES`` made small here)."""
    monkeypatch.setattr(hf_model, "CHUNK_BYTES", 40)
    tensors = {"a": torch.randn(7, 5).to(dtype), "b": torch.randn(9).to(dtype)}
    file = str(tmp_path / "model.safetensors")
    save_file(tensors, file)
    header, start = hf_model.read_header(file)
    for name, full in tensors.items():
        for out_dtype in (dtype, torch.float64):
            for lo, hi in ((0, full.shape[0]), (1, 6), (3, 3)):
                out = torch.full((hi - lo, *full.shape[1:]), float("nan"), dtype=out_dtype)
                assert hf_model.read_rows_into(out, file, header[name], start, lo) is out
                assert torch.equal(out, full[lo:hi].to(out_dtype)), (name, out_dtype, lo, hi)


def test_no_decoder_layer_list_is_refused():
    model = nn.Sequential(nn.Linear(2, 2))
    with pytest.raises(hf_model.HFModelError, match="found no list of decoder layers"):
        hf_model.layer_list(model, "somewhere")


def test_tensor_of_another_shape_is_refused(tmp_path):
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2, bos_token_id=0, eos_token_id=1)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["intermediate_size"] = 48  # the MLP weights in the file are 32 wide
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(hf_model.HFModelError, match="mlp.*has shape|mlp.*is F32"):
        hf_model.load_meta(types.SimpleNamespace(lora_rank=0), str(tmp_path))


def test_tensors_the_config_has_no_place_for_are_refused(tmp_path):
    """A config.json of fewer layers than the files (transformers only warns, and training would drop the
    layer silently) is refused naming the tensors; GPT-2's file, with its layers' persistent attention
    buffers, loads."""
    from transformers import AutoModelForCausalLM, GPT2Config, LlamaConfig

    config = LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=2, bos_token_id=0, eos_token_id=1)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "llama")
    cfg = json.loads((tmp_path / "llama" / "config.json").read_text())
    cfg["num_hidden_layers"] = 1
    (tmp_path / "llama" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(hf_model.HFModelError, match=r"hold 9 tensors .* no place for \('model\.layers\.1\."):
        hf_model.load_meta(types.SimpleNamespace(lora_rank=0), str(tmp_path / "llama"))
    AutoModelForCausalLM.from_config(GPT2Config(vocab_size=32, n_embd=16, n_layer=1, n_head=2, n_positions=8)) \
        .save_pretrained(tmp_path / "gpt2")
    hf_model.load_meta(types.SimpleNamespace(lora_rank=0), str(tmp_path / "gpt2"))


def test_lora_all_linear_adapts_every_decoder_linear(tmp_path):
    """--lora-target-modules all-linear is PEFT's shorthand (every Linear but the output layer), not a
    module name (it was refused as "matches no module")."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2, bos_token_id=0, eos_token_id=1)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    cfg = types.SimpleNamespace(lora_rank=2, lora_alpha=4, lora_dropout=0.0, lora_target_modules="all-linear",
                                base_dtype="fp32", seed=0)
    model, _, _ = hf_model.load_meta(cfg, str(tmp_path))
    adapted = {n.split(".")[-4] for n, _ in model.named_parameters() if "lora_A" in n}
    assert adapted == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}, adapted
