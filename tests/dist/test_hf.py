"""A Hugging Face GPT-2 (tiny config, built locally, no download) wrapped
unit per block (or ``fully_shard`` per block, then the root): ``ModelOutput``
losses train like DDP, and ``generate()`` on the sharded model equals the
plain model's."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from tests.dist import patterns as P  # noqa: E402
from tests.dist.common import gpt2_block_policy, shard, tiny_gpt2  # noqa: E402
from tests.dist.harness import run_ranks  # noqa: E402


def _lm_step(model, opt, rank, s):
    ids = torch.randint(0, 61, (2, 12), generator=torch.Generator().manual_seed(100 * rank + s))
    out = model(input_ids=ids, labels=ids)  # a CausalLMOutputWithCrossAttentions
    out.loss.backward()
    return out.loss.detach()


def _hf(rank, world):
    from fullshard import memory_stats
    from fullshard.memory import memory_totals
    out = {"model_output_loss": P.compare(rank, _lm_step, steps=3, make_fn=tiny_gpt2, policy_fn=gpt2_block_policy)}
    plain = tiny_gpt2()
    prompt = torch.tensor([[5, 7, 11, 13]])
    kwargs = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
    want = plain.generate(prompt, **kwargs)
    for how in P.WRAPPINGS:
        model = shard(P._clone(plain), how, gpt2_block_policy())
        for _ in range(2):  # repeated forwards without backward, twice
            got = model.generate(prompt, **kwargs)
            assert torch.equal(got, want), (how, got, want)
            assert memory_totals(memory_stats(model))["unsharded_bytes"] == 0, how
    out["generated"] = got.tolist()
    return out


def test_hugging_face_gpt2():
    print(run_ranks(_hf, 2)[0])
