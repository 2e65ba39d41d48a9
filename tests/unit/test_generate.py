"""Sampling filters and the sampling loop of `fullshard generate` (no checkpoint needed)."""
from __future__ import annotations

import math

import torch

from fullshard.models import build_model
from fullshard.train.generate import filter_logits, sample


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
