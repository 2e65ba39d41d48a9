"""Sampling filters, the sampling loop and the tokenizer choice of `fullshard generate` (no checkpoint
needed)."""
from __future__ import annotations

import math
import shutil

import pytest
import torch

from fullshard.data import DataError
from fullshard.data.tokenizer import HFTokenizer
from fullshard.models import build_model
from fullshard.train.generate import filter_logits, load_tokenizer, sample
from fullshard.train.trained_model import ModelSpec
from tests.wide_tokenizer import save_wide_tokenizer


def test_filter_logits_top_k_and_nucleus():
    logits = torch.log(torch.tensor([0.5, 0.2, 0.15, 0.1, 0.05]))
    assert torch.isinf(filter_logits(logits, 2, 1.0)).tolist() == [False, False, True, True, True]
    # nucleus 0.6: 0.5 alone is < 0.6, so the second token is kept too; 0.7 reaches it.
    assert torch.isinf(filter_logits(logits, 0, 0.6)).tolist() == [False, False, True, True, True]
    assert torch.isinf(filter_logits(logits, 0, 0.7)).tolist() == [False, False, True, True, True]
    assert torch.isinf(filter_logits(logits, 0, 0.71)).tolist() == [False, False, False, True, True]
    assert torch.isinf(filter_logits(logits, 0, 0.1)).tolist() == [False, True, True, True, True]
    assert torch.equal(filter_logits(logits, 0, 1.0), logits)
    assert not math.isinf(filter_logits(logits, 1, 0.01)[0])


def test_sample_greedy_seeded_and_eos():
    model = build_model("transformer_lm_gpt_mini", vocab_size=40, max_positions=8, seed=1).eval()
    greedy = sample(model, [1, 2, 3], 12, temperature=0)  # longer than max_positions: the context slides
    with torch.no_grad():
        ids = [1, 2, 3]
        for _ in range(12):
            ids.append(int(model(torch.tensor([ids[-8:]]))[0, -1].argmax()))
    assert greedy == ids[3:]
    a = sample(model, [1], 10, generator=torch.Generator().manual_seed(0), top_k=5)
    assert a == sample(model, [1], 10, generator=torch.Generator().manual_seed(0), top_k=5)
    assert sample(model, [1, 2, 3], 10, eos_id=greedy[0], temperature=0, vocab_limit=40) == greedy[:1]
    assert all(t < 7 for t in sample(model, [1], 20, vocab_limit=7, generator=torch.Generator().manual_seed(1)))


def test_tokenizer_is_the_training_datas(tmp_path):
    """The checkpoint's record of its data's tokenizer decides, --hf-model runs included; a copy of the
    tokenizer elsewhere is accepted; any other tokenizer, or none where one is needed, is refused."""
    wide = save_wide_tokenizer(tmp_path / "wide")
    copy = shutil.copytree(wide, tmp_path / "copy")
    other = save_wide_tokenizer(tmp_path / "other")
    (other / "tokenizer.json").write_text((other / "tokenizer.json").read_text().replace("w9", "v9"))
    name = HFTokenizer(wide).name

    def spec(tokenizer, hf_model=None):
        return ModelSpec("ckpt", "transformer_lm_gpt_mini", 70_000, 64, None, None, hf_model=hf_model,
                         tokenizer=tokenizer)

    assert load_tokenizer(spec(None)).name == "gpt2-bpe"  # a checkpoint from before the record
    assert load_tokenizer(spec("gpt2-bpe", hf_model=str(wide))).name == "gpt2-bpe"  # the data's, not the model's
    assert load_tokenizer(spec(name, hf_model=str(copy))).name == HFTokenizer(copy).name
    assert load_tokenizer(spec(name), str(copy)).name == HFTokenizer(copy).name
    with pytest.raises(DataError, match=f"tokenizer {name}; pass its directory .* as --tokenizer DIR"):
        load_tokenizer(spec(name))
    with pytest.raises(DataError, match=r"the tokenizer hf:other:\w+ is not the one .*; pass that one as --tokenizer"):
        load_tokenizer(spec(name, hf_model=str(other)))
    with pytest.raises(DataError, match=r"\(gpt2-bpe\); drop --tokenizer"):
        load_tokenizer(spec("gpt2-bpe"), str(wide))
