"""`fullshard train --hf-model` through the trainer API at 2 ranks against single-process transformers / PEFT
training of the same checkpoint on the same global batches: full fine-tuning (Llama with tied embeddings,
Qwen2, GPT-2; FullyShardedDataParallel and fully_shard) and LoRA (FULL_SHARD wrapper, SHARD_GRAD_OP
wrapper, fully_shard): losses, trained weights, a frozen base unchanged bit for bit with no gradient and
no optimizer state, and the Hugging Face exports (full model, PEFT adapter, merged model) giving the
trained sharded model's logits. Tiny random-weight models are made and saved by the tests (no network)."""
from __future__ import annotations

import os

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("peft")

from tests.dist.harness import run_ranks  # noqa: E402

VOCAB, T, B, UPDATES, LR, WD, SEED = 96, 8, 2, 3, 1e-2, 0.01, 5
PROMPT = [[3, 17, 5, 41, 8, 2, 60, 9]]
LORA = dict(lora_rank=4, lora_alpha=8.0, lora_target_modules="q_proj,v_proj")


def _config(kind: str):
    from transformers import GPT2Config, LlamaConfig, Qwen2Config

    common = dict(vocab_size=VOCAB, bos_token_id=0, eos_token_id=1)
    if kind == "llama":  # tied input and output embeddings
        return LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=True, **common)
    if kind == "qwen2":
        return Qwen2Config(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False, **common)
    return GPT2Config(n_embd=32, n_layer=2, n_head=4, n_positions=64, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                      **common)  # no dropout: the reference draws other masks


def _save(kind: str, path: str) -> str:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(11)
    # Qwen2 in several files with an index, as large checkpoints are
    AutoModelForCausalLM.from_config(_config(kind)).save_pretrained(
        path, **({"max_shard_size": "40KB"} if kind == "qwen2" else {}))
    return path


def _batch(rank: int, update: int) -> tuple[torch.Tensor, torch.Tensor]:
    tok = torch.randint(0, VOCAB, (B, T + 1), generator=torch.Generator().manual_seed(100 * update + rank))
    return tok[:, :-1].contiguous(), tok[:, 1:].contiguous()


def _cfg(path: str, **over):
    from fullshard.train.config import TrainConfig

    base = dict(data_dir="unused", max_positions=64, vocab_size=VOCAB, tokens_per_sample=T, batch_size=B, lr=LR,
                weight_decay=WD, seed=SEED, hf_model=path, fp16_scale_window=4)
    return TrainConfig(**{**base, **over})


def _np(tensors: dict) -> dict:
    # numpy, not tensors: tensors would travel back as file descriptors of exited ranks
    return {k: v.detach().float().numpy().copy() for k, v in tensors.items()}


def _train(cfg, rank: int):
    from fullshard.train.trainer import Trainer

    trainer = Trainer(cfg, torch.device("cpu"))
    losses = [trainer.train_step([_batch(rank, u)])["loss_sum"] / (B * T * 2) for u in range(UPDATES)]
    with torch.no_grad():
        logits = trainer.model(torch.tensor(PROMPT)).logits
    return trainer, losses, logits


def _full_group(rank: int, world: int, dirs: dict) -> dict:
    from fullshard.train.hf_export import export, gather_state_dict

    out = {}
    for name, kind, version, over in (("llama_v1", "llama", 1, {}), ("llama_v2", "llama", 2, {}),
                                      ("qwen2_v2", "qwen2", 2, {}), ("gpt2_v1", "gpt2", 1, {}),
                                      ("llama_v2_checkpointed", "llama", 2, dict(checkpoint_activations=True)),
                                      ("llama_v1_bf16", "llama", 1, dict(bf16=True)),
                                      ("llama_v2_bf16", "llama", 2, dict(bf16=True))):
        cfg = _cfg(dirs[kind], fsdp_version=version, **over)
        trainer, losses, logits = _train(cfg, rank)
        state = gather_state_dict(trainer.model)
        saved = export(cfg, trainer.model, None, os.path.join(dirs["out"], name)) if name == "llama_v2" else None
        out[name] = dict(losses=losses, state=_np(state), logits=_np({"x": logits})["x"], saved=saved)
    return out


def _check_frozen(trainer, path: str, base: torch.dtype = torch.float32) -> None:
    """Base shards bit for bit the file's rows, no gradient; optimizer state only for adapters."""
    from safetensors import safe_open

    from fullshard.construct import clean_name

    with safe_open(os.path.join(path, "model.safetensors"), framework="pt") as f:
        file = {k: f.get_tensor(k) for k in f.keys()}
    trainable = 0
    for name, p in trainer.model.named_parameters():
        local = p.to_local() if hasattr(p, "to_local") else p
        if p.requires_grad:
            trainable += 1
            assert "lora_" in name and p.dtype == torch.float32, name
            continue
        assert p.grad is None, name
        assert p not in trainer.optimizer.state, name
        plain = clean_name(name).replace("base_model.model.", "").replace(".base_layer.", ".")
        full = file[plain if plain in file else "model.embed_tokens.weight"].to(base)  # cast as from_pretrained
        rows = full.chunk(2)[torch.distributed.get_rank()] if full.dim() else full
        assert local.dtype == base and torch.equal(local.detach()[:rows.shape[0]], rows), name
    assert trainable and len(trainer.optimizer.state) == trainable


def _lora_group(rank: int, world: int, dirs: dict) -> dict:
    from fullshard.train.hf_export import export, gather_state_dict

    out = {}
    for name, over in (("full_shard_v1", dict(fsdp_version=1)),
                       ("shard_grad_op_v1", dict(fsdp_version=1, reshard_after_forward=False)),
                       ("fully_shard_v2", dict(fsdp_version=2)),
                       # --base-dtype bf16: a bf16 frozen base beside fp32 adapters (units mixing dtypes)
                       ("full_shard_v1_bf16_base", dict(fsdp_version=1, base_dtype="bf16")),
                       ("fully_shard_v2_bf16_base", dict(fsdp_version=2, base_dtype="bf16")),
                       ("fully_shard_v2_bf16_base_bf16", dict(fsdp_version=2, base_dtype="bf16", bf16=True))):
        cfg = _cfg(dirs["llama"], **LORA, **over)
        trainer, losses, logits = _train(cfg, rank)
        _check_frozen(trainer, dirs["llama"], torch.bfloat16 if "bf16_base" in name else torch.float32)
        adapters = {k: v for k, v in gather_state_dict(trainer.model).items() if "lora_" in k}
        saved = {}
        if name in ("full_shard_v1", "fully_shard_v2", "full_shard_v1_bf16_base", "fully_shard_v2_bf16_base"):
            merge = name.startswith("full_shard_v1")
            cfg = _cfg(dirs["llama"], **LORA, **over, merge_lora=merge)
            saved = export(cfg, trainer.model, trainer.peft_model, os.path.join(dirs["out"], name))
        if name in ("full_shard_v1", "fully_shard_v2"):  # the library's save, both doors
            from fullshard.adapters import save_adapter

            save_adapter(trainer.model, os.path.join(dirs["out"], name + "_library"))
        out[name] = dict(losses=losses, state=_np(adapters), logits=_np({"x": logits})["x"], saved=saved)
    return out


def _reference(path: str, lora: bool, dtype: torch.dtype = torch.float32):
    """Single-process transformers (PEFT with ``lora``) AdamW training with DDP's gradient (each rank's
    batch's mean-loss gradient, averaged; one pass over the concatenated batches sums in another order,
    which a bf16 base's roundings can amplify), the checkpoint loaded in ``dtype`` (PEFT keeps the
    adapters fp32)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    model.config.use_cache = False
    if lora:
        torch.manual_seed(SEED)
        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                                 task_type="CAUSAL_LM"))
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW([{"params": [p for p in params if p.dim() >= 2], "weight_decay": WD},
                             {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}], lr=LR)
    losses = []
    for u in range(UPDATES):
        total = 0.0
        for rank in range(2):
            inputs, targets = _batch(rank, u)
            logits = model(inputs).logits
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB).float(), targets.reshape(-1))
            (loss / 2).backward()
            total += loss.item() / 2
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(total)
    with torch.no_grad():
        logits = model(torch.tensor(PROMPT)).logits
    return model, losses, logits


def _close(got, want, what, tol=2e-5):
    got, want = np.asarray(got), np.asarray(want)
    diff = float(np.abs(got - want).max())
    assert diff <= tol, f"{what}: max |diff| {diff:.3g} > {tol}"
    return diff


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    out = {kind: _save(kind, str(root / kind)) for kind in ("llama", "qwen2", "gpt2")}
    out["out"] = str(root / "out")
    return out


def test_full_finetune_matches_single_process(dirs):
    from transformers import AutoModelForCausalLM

    assert len([f for f in os.listdir(dirs["qwen2"]) if f.endswith(".safetensors")]) > 1

    got = run_ranks(_full_group, 2, dirs)[0]
    refs = {kind: _reference(dirs[kind], lora=False) for kind in ("llama", "qwen2", "gpt2")}
    # --bf16 (MixedPrecision over fp32 shards, buffers kept fp32): both front doors alike, bit for bit
    bf16 = [got.pop(f"llama_v{v}_bf16")["losses"] for v in (1, 2)]
    assert bf16[0] == bf16[1], bf16
    _close(bf16[0], refs["llama"][1], "bf16 losses vs fp32", tol=3e-2)
    diffs = {}
    for name, result in got.items():
        ref, losses, logits = refs[name.split("_")[0]]
        want = {n: p.detach().numpy() for n, p in ref.state_dict().items()}
        assert want.keys() <= result["state"].keys(), (name, sorted(want.keys() - result["state"].keys()))
        # Parameters after 3 AdamW steps: Adam's division by sqrt(v) magnifies rounding of tiny gradients.
        diffs[name] = (_close(result["losses"], losses, f"{name} losses", tol=1e-5),
                       max(_close(result["state"][n], want[n], f"{name} {n}", tol=1e-4) for n in want))
        _close(result["logits"], logits.numpy(), f"{name} logits")
        if result["saved"]:  # the exported directory loads with transformers and gives the sharded logits
            loaded = AutoModelForCausalLM.from_pretrained(result["saved"])
            with torch.no_grad():
                _close(loaded(torch.tensor(PROMPT)).logits.numpy(), result["logits"], f"{name} export logits")
    print("max |diff| (losses, parameters) vs single-process transformers:", diffs)


def test_lora_matches_single_process_peft(dirs):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    got = run_ranks(_lora_group, 2, dirs)[0]
    # --bf16 over a bf16 base: every parameter computes in bf16 (adapters' master fp32): near the bf16 base run
    mixed = got.pop("fully_shard_v2_bf16_base_bf16")
    assert all(v.dtype == np.float32 for v in mixed["state"].values())
    _close(mixed["losses"], got["fully_shard_v2_bf16_base"]["losses"], "--bf16 over a bf16 base, losses", tol=3e-2)
    refs = {dtype: _reference(dirs["llama"], lora=True, dtype=dtype) for dtype in (torch.float32, torch.bfloat16)}
    diffs = {}
    for name, result in got.items():
        ref, losses, logits = refs[torch.bfloat16 if "bf16_base" in name else torch.float32]
        want = {n: p.detach().numpy() for n, p in ref.named_parameters() if p.requires_grad}
        assert sorted(result["state"]) == sorted(want), name
        diffs[name] = (_close(result["losses"], losses, f"{name} losses", tol=1e-5),
                       max(_close(result["state"][n], want[n], f"{name} {n}", tol=1e-4) for n in want))
        _close(result["logits"], logits.float().numpy(), f"{name} logits")
    with torch.no_grad():
        adapter = got["fully_shard_v2"]["saved"]
        assert {"adapter_config.json", "adapter_model.safetensors"} <= set(os.listdir(adapter))
        peft_model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(dirs["llama"]), adapter)
        _close(peft_model(torch.tensor(PROMPT)).logits.numpy(), got["fully_shard_v2"]["logits"], "adapter logits")
        # fullshard.adapters.save_adapter (PeftModel.save_pretrained inside the wrapper wrote no tensors): the
        # same adapter from either door, giving the sharded model's logits over the base
        for name in ("full_shard_v1", "fully_shard_v2"):
            library = os.path.join(dirs["out"], name + "_library")
            peft_model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(dirs["llama"]), library)
            _close(peft_model(torch.tensor(PROMPT)).logits.numpy(), got[name]["logits"], f"{name} library adapter")
        merged = AutoModelForCausalLM.from_pretrained(got["full_shard_v1"]["saved"])
        assert not any("lora" in n for n, _ in merged.named_parameters())
        _close(merged(torch.tensor(PROMPT)).logits.numpy(), got["full_shard_v1"]["logits"], "merged logits")
        # bf16 base: the adapter (fp32) over the base loaded in bf16 gives the sharded logits; the merged
        # model is stored bf16 (PEFT merges into the bf16 weights: its rounding is the only difference)
        adapter = got["fully_shard_v2_bf16_base"]["saved"]
        base = AutoModelForCausalLM.from_pretrained(dirs["llama"], dtype=torch.bfloat16)
        peft_model = PeftModel.from_pretrained(base, adapter)
        assert {p.dtype for n, p in peft_model.named_parameters() if "lora_" in n} == {torch.float32}
        _close(peft_model(torch.tensor(PROMPT)).logits.float().numpy(), got["fully_shard_v2_bf16_base"]["logits"],
               "bf16 base: adapter logits")
        merged = AutoModelForCausalLM.from_pretrained(got["full_shard_v1_bf16_base"]["saved"], dtype="auto")
        assert {p.dtype for p in merged.parameters()} == {torch.bfloat16}
        _close(merged(torch.tensor(PROMPT)).logits.float().numpy(), got["full_shard_v1_bf16_base"]["logits"],
               "bf16 base: merged logits", tol=5e-2)
    print("max |diff| (losses, adapters) vs single-process PEFT:", diffs)
