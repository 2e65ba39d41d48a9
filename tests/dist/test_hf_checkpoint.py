"""A Hugging Face GPT-2 trained under FSDP (unit per ``GPT2Block``, 2 gloo
ranks) leaves through both doors: ``fullshard.checkpoint.save`` +
``fullshard consolidate`` to ``model.safetensors``, and ``save_pretrained``
called on rank 0 inside ``summon_full_params``. ``from_pretrained`` loads
either with no missing keys and the trained model's logits."""
from __future__ import annotations

import io
import os

import pytest
import torch

pytest.importorskip("transformers")

from tests.dist.common import gpt2_block_policy, tiny_gpt2  # noqa: E402
from tests.dist.harness import run_ranks  # noqa: E402

PROMPT = torch.tensor([[5, 7, 11, 13, 17, 19, 23, 29]])


def _train_and_save(rank, world, root):
    from fullshard import FSDP, checkpoint

    model = FSDP(tiny_gpt2(), auto_wrap_policy=gpt2_block_policy())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(2):
        ids = torch.randint(0, 61, (2, 12), generator=torch.Generator().manual_seed(10 * rank + step))
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
    with torch.no_grad():
        logits = model(input_ids=PROMPT).logits
    checkpoint.save(os.path.join(root, "ckpt"), model, opt)
    # The pattern of the issue: HF's own save, on rank 0 only, inside summon_full_params.
    with FSDP.summon_full_params(model, writeback=False):
        if rank == 0:
            model.save_pretrained(os.path.join(root, "hf_root"))
            model.module.save_pretrained(os.path.join(root, "hf_inner"))
    with FSDP.summon_full_params(model, writeback=False, rank0_only=True):
        if rank == 1:  # no full parameters here: a clear error, not a hang
            with pytest.raises(RuntimeError, match="holds no full parameters on this rank; call it on rank 0"):
                model.state_dict()
        else:
            assert list(model.state_dict()) == list(tiny_gpt2().state_dict())
    buf = io.BytesIO()
    torch.save(logits, buf)
    return buf.getvalue()


def _from_pretrained(path):
    from transformers import GPT2LMHeadModel

    model, info = GPT2LMHeadModel.from_pretrained(path, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    assert model.lm_head.weight.data_ptr() == model.transformer.wte.weight.data_ptr()  # still tied
    return model.eval()


def test_consolidated_and_save_pretrained_load_in_hugging_face(tmp_path):
    from fullshard.checkpoint.consolidate import consolidate

    root = str(tmp_path)
    want = torch.load(io.BytesIO(run_ranks(_train_and_save, 2, root)[0]))
    consolidated = tmp_path / "consolidated"
    consolidate(os.path.join(root, "ckpt"), str(consolidated / "model.safetensors"))
    tiny_gpt2().config.save_pretrained(str(consolidated))
    untrained = tiny_gpt2()(input_ids=PROMPT).logits
    for path in (consolidated, tmp_path / "hf_root", tmp_path / "hf_inner"):
        with torch.no_grad():
            got = _from_pretrained(str(path))(input_ids=PROMPT).logits
        torch.testing.assert_close(got, want, msg=lambda m: f"{path.name}: {m}")
    assert not torch.allclose(untrained, want)  # training changed the model, so the check has teeth
