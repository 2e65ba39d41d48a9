"""write_dir (fullshard/adapters.py; the CLI's exports and save_adapter) writes an export beside its
directory and moves it in only when complete, so a failure leaves the directory as it was and no partial
sibling behind, and an earlier export's files the new one does not write go; merging an adapter on tied
embeddings unties them first, so the merged model computes what was trained."""
from __future__ import annotations

import os

import pytest
import torch

from fullshard.adapters import write_dir


def _files(path) -> dict:
    return {name: open(os.path.join(path, name)).read() for name in sorted(os.listdir(path))}


def _writer(fail: bool):
    def write(tmp: str) -> None:
        with open(os.path.join(tmp, "model.safetensors"), "w") as f:
            f.write("new")
        if fail:  # as a save_pretrained or PEFT merge raising after the first file
            raise RuntimeError("merge failed")
        with open(os.path.join(tmp, "config.json"), "w") as f:
            f.write("{}")
    return write


def test_write_dir_complete_or_untouched(tmp_path):
    out = tmp_path / "hf"
    with pytest.raises(RuntimeError, match="merge failed"):
        write_dir(str(out), _writer(fail=True))
    assert os.listdir(tmp_path) == []  # neither DIR nor its partial sibling

    write_dir(str(out), _writer(fail=False))
    assert _files(out) == {"config.json": "{}", "model.safetensors": "new"}
    assert os.listdir(tmp_path) == ["hf"]

    # An existing DIR (a resumed run's earlier export, the user's own files): a failure keeps it as it was,
    # a success replaces the files it writes and keeps the others.
    (out / "model.safetensors").write_text("old")
    (out / "notes.txt").write_text("mine")
    with pytest.raises(RuntimeError, match="merge failed"):
        write_dir(str(out), _writer(fail=True))
    assert _files(out) == {"config.json": "{}", "model.safetensors": "old", "notes.txt": "mine"}
    write_dir(str(out), _writer(fail=False))
    assert _files(out) == {"config.json": "{}", "model.safetensors": "new", "notes.txt": "mine"}
    assert os.listdir(tmp_path) == ["hf"]
    # An earlier export's files that this one does not write (an adapter beside the model written now, the
    # shards and index of a sharded export) would load with it: they go; the user's files stay.
    for name in ("adapter_config.json", "adapter_model.safetensors", "model-00001-of-00002.safetensors",
                 "model.safetensors.index.json"):
        (out / name).write_text("stale")
    write_dir(str(out), _writer(fail=False))
    assert _files(out) == {"config.json": "{}", "model.safetensors": "new", "notes.txt": "mine"}


@pytest.mark.parametrize("target", ["lm_head", "embed_tokens"])
def test_merging_an_adapter_on_tied_embeddings_unties_them(tmp_path, target):
    """PEFT merges a LoRA delta into its base weight in place: on one of two tied embeddings it changed
    the other too (logits 0.46 off the trained model's in the audit). The merged model, saved and loaded,
    gives the adapter model's logits."""
    pytest.importorskip("peft")
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, LlamaConfig

    from fullshard.train.hf_export import _untie_merged_weights

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2, tie_word_embeddings=True)
    model = get_peft_model(AutoModelForCausalLM.from_config(config),
                           LoraConfig(r=2, target_modules=["q_proj", target], init_lora_weights=False))
    x = torch.tensor([[3, 7, 11, 30]])
    with torch.no_grad():
        want = model(x).logits
        _untie_merged_weights(model)
        model.merge_and_unload().save_pretrained(tmp_path)
        got = AutoModelForCausalLM.from_pretrained(tmp_path)(x).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
