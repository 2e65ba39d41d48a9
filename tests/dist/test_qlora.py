"""QLoRA on ``fully_shard`` (core/packed.py [Note: packed parts]): a tiny Llama whose decoder layers'
Linear weights are torchao ``NF4Tensor`` (frozen, built from the full bf16 weight with ``to_nf4``),
PEFT LoRA adapters (fp32) on q_proj/v_proj, one unit per decoder layer, 2 ranks, 3 AdamW steps.
Checked against single-process data-parallel training of the same NF4 model (each rank's batch's
gradient, averaged): losses
and adapters; the NF4 shards are each rank's bytes of the full NF4 tensor, unchanged by training;
the decoder layers' all-gathers carry packed bytes (<= 0.3x those of the same model with its base in
bf16, measured in the same group by counting every all-gather's output bytes); `fullshard plan --hf-model
--quantize-base nf4`'s model state equals memory_stats on the wrapped NF4 model."""
from __future__ import annotations

import os

import pytest
import torch
import torch.nn as nn

pytest.importorskip("torchao", reason="QLoRA needs torchao (pip install 'fullshard[dev]')")
pytest.importorskip("transformers")
pytest.importorskip("peft")

from tests.dist.harness import run_ranks  # noqa: E402

VOCAB, T, B, STEPS, LR = 64, 8, 2, 3, 1e-2


def _llama() -> nn.Module:
    """The plain bf16 Llama."""
    from transformers import LlamaConfig, LlamaForCausalLM

    # hidden 256: every Linear weight is whole NF4 scaler blocks (64 x 256 elements) on each of 2 ranks.
    config = LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=4, vocab_size=VOCAB, max_position_embeddings=32, use_cache=False,
                         tie_word_embeddings=False)
    torch.manual_seed(0)
    return LlamaForCausalLM(config).to(torch.bfloat16)


def _model(nf4: bool) -> nn.Module:
    """The PEFT model: bf16 base (decoder Linear weights NF4 with ``nf4``), fp32 adapters."""
    from peft import LoraConfig, get_peft_model
    from torchao.quantization import to_nf4

    model = get_peft_model(_llama(), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                                task_type="CAUSAL_LM"))
    if nf4:
        for module in model.base_model.model.model.layers.modules():
            if type(module) is nn.Linear and not module.weight.requires_grad:
                module.weight = nn.Parameter(to_nf4(module.weight.detach()), requires_grad=False)
    return model


def _batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    tok = torch.randint(0, VOCAB, (B, T + 1), generator=torch.Generator().manual_seed(10 * step + rank))
    return tok[:, :-1], tok[:, 1:]


def _loss(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(model(inputs).logits.float().reshape(-1, VOCAB), targets.reshape(-1))


def _train(model: nn.Module, batches, world: int = 1) -> tuple[list[float], torch.optim.Optimizer]:
    """AdamW steps, each on ``world`` micro-batches whose mean-loss gradients are averaged (DDP's
    gradient; one pass over the concatenated batch sums in another order, and a flipped bf16 rounding
    can grow through Adam's sign into 1e-2); returns each step's mean loss, and the optimizer."""
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR)
    losses = []
    for step in range(len(batches) // world):
        total = 0.0
        for inputs, targets in batches[step * world:(step + 1) * world]:
            loss = _loss(model, inputs, targets)
            (loss / world).backward()
            total += loss.item() / world
        opt.step()
        opt.zero_grad()
        losses.append(total)
    return losses, opt


def _local(p: torch.Tensor) -> torch.Tensor:
    return p.to_local() if hasattr(p, "to_local") else p


def _sharded(rank: int, world: int, nf4: bool) -> dict:
    import fullshard
    from fullshard.core import collectives

    model = _model(nf4)
    for layer in model.base_model.model.model.layers:
        fullshard.fully_shard(layer)
    fullshard.fully_shard(model)
    sent = {"layers": 0}
    plain = collectives.all_gather

    def counting(out, shard, group, async_op=True, tag=""):
        if ".layers." in tag:  # the decoder layers' units, named by path (not the root's embeddings, norm, lm_head)
            sent["layers"] += out.numel() * out.element_size()
        return plain(out, shard, group, async_op=async_op, tag=tag)

    collectives.all_gather = counting
    try:
        losses, opt = _train(model, [_batch(rank, s) for s in range(STEPS)])
    finally:
        collectives.all_gather = plain
    if nf4:  # `fullshard plan` of the same model (PEFT over the bf16 base, NF4 as --quantize-base nf4 stores it)
        from tests.dist.test_mixed_dtype import check_plan_equals_memory_stats

        check_plan_equals_memory_stats(model, opt, _model(False), lambda: _loss(model, *_batch(rank, 0)).backward(),
                                       "qlora", nf4=True)
    stats = fullshard.memory_stats(model)
    out = {"losses": losses, "layer_bytes_per_step": sent["layers"] // STEPS,
           "sharded_bytes": sum(v["sharded_bytes"] for k, v in stats.items() if "layers." in k),
           "adapters": {n: _local(p).detach().numpy().copy() for n, p in model.named_parameters() if "lora_" in n}}
    if nf4:  # the frozen base: this rank's dim-0 part of each full NF4 tensor's packed bytes, unchanged
        base = _base(_model(True))
        out["nf4_equal"] = {n: all(torch.equal(getattr(_local(p), a), torch.chunk(full, world)[rank])
                                   for a, full in base[n].items())
                            for n, p in model.named_parameters() if n in base}
    return out


def _base(model: nn.Module) -> dict:
    """``{name: {inner tensor name: full tensor}}`` of the model's NF4 weights."""
    return {n: {a: getattr(p, a) for a in ("quantized_data", "quantized_scalers", "quantization_factor")}
            for n, p in model.named_parameters() if type(p).__name__ == "NF4Tensor"}


def _group(rank: int, world: int) -> dict:
    return {"nf4": _sharded(rank, world, True), "bf16": _sharded(rank, world, False)}


def test_qlora_matches_single_process_and_gathers_packed_bytes():
    got = run_ranks(_group, 2)
    ref = _model(True)
    base = _base(ref)
    assert len(base) == 2 * 7  # q, k, v, o, gate, up, down per layer
    want, _ = _train(ref, [_batch(rank, s) for s in range(STEPS) for rank in range(2)], world=2)
    adapters = {n: p.detach() for n, p in ref.named_parameters() if "lora_" in n}
    # Each rank's loss is its half-batch mean; their mean is the global batch's.
    losses = torch.tensor([res["nf4"]["losses"] for res in got]).mean(0)
    print(f"losses {losses.tolist()} vs single process {want}")
    torch.testing.assert_close(losses, torch.tensor(want), rtol=1e-5, atol=1e-5)
    for rank, res in enumerate(got):
        q = res["nf4"]
        assert q["adapters"].keys() == adapters.keys()
        worst = 0.0
        for n, value in q["adapters"].items():
            rows = torch.chunk(adapters[n], 2)[rank]
            worst = max(worst, (torch.from_numpy(value) - rows).abs().max().item())
        print(f"rank {rank}: adapters max |diff| vs single process {worst:.3g}")
        assert worst <= 1e-6, worst
        assert q["nf4_equal"].keys() == base.keys() and all(q["nf4_equal"].values()), q["nf4_equal"]
        ratio = q["layer_bytes_per_step"] / res["bf16"]["layer_bytes_per_step"]
        shard_ratio = q["sharded_bytes"] / res["bf16"]["sharded_bytes"]
        print(f"rank {rank}: decoder-layer all-gather bytes per step NF4 {q['layer_bytes_per_step']:,} vs bf16 base "
              f"{res['bf16']['layer_bytes_per_step']:,} ({ratio:.3f}x); layer shard bytes {shard_ratio:.3f}x")
        assert 0.2 < ratio <= 0.3, ratio
        assert shard_ratio <= 0.3, shard_ratio


# ---------------------------------------------------------------- the trainer: --quantize-base nf4
SEED, WD = 5, 0.01
PROMPT = [[3, 17, 5, 41, 8, 2, 60, 9]]


def _trainer_group(rank: int, world: int, path: str) -> dict:
    import dataclasses

    from fullshard.train.config import TrainConfig
    from fullshard.train.hf_export import export
    from fullshard.train.trainer import Trainer

    cfg = TrainConfig(data_dir="unused", max_positions=32, vocab_size=VOCAB, tokens_per_sample=T, batch_size=B, lr=LR,
                      weight_decay=WD, seed=SEED, hf_model=path, fsdp_version=2, lora_rank=4, lora_alpha=8.0,
                      lora_target_modules="q_proj,v_proj", base_dtype="bf16", quantize_base="nf4",
                      fp16_scale_window=4)
    # The FSDP1 wrapper (TrainConfig's default fsdp_version) cannot hold NF4 weights: refused (it trained the
    # base unquantized, silently: the plain bf16 losses)
    try:
        Trainer(dataclasses.replace(cfg, fsdp_version=1), torch.device("cpu"))
        raise AssertionError("quantize_base='nf4' with fsdp_version=1 was accepted")
    except ValueError as e:
        assert "quantize_base='nf4' needs fsdp_version=2" in str(e), e
    trainer = Trainer(cfg, torch.device("cpu"))
    losses = [trainer.train_step([_batch(rank, s)])["loss_sum"] / (B * T * 2) for s in range(STEPS)]
    kinds = {type(_local(p)).__name__ for p in trainer.model.parameters() if not p.requires_grad}
    adapters = {n.replace("_checkpoint_wrapped_module.", ""): _local(p).detach().numpy().copy()
                for n, p in trainer.model.named_parameters() if "lora_" in n}
    with torch.no_grad():
        logits = trainer.model(torch.tensor(PROMPT)).logits.float().numpy().copy()
    # Both exports of the one trained model: the PEFT adapter, and the merged model (--merge-lora).
    saved = {"adapter": export(cfg, trainer.model, trainer.peft_model, f"{path}/out/adapter"),
             "merged": export(dataclasses.replace(cfg, merge_lora=True), trainer.model, trainer.peft_model,
                              f"{path}/out/merged")}
    return {"losses": losses, "kinds": kinds, "adapters": adapters, "logits": logits, "saved": saved}


def _nf4_base(model: nn.Module) -> nn.Module:
    """``model`` with its decoder layers' base Linear weights replaced by ``to_nf4`` of them, in place
    (PEFT's adapters are Linear too, frozen once loaded for inference: kept)."""
    from torchao.quantization import to_nf4

    for name, module in model.get_decoder().layers.named_modules():
        if type(module) is nn.Linear and "lora_" not in name:
            module.weight = nn.Parameter(to_nf4(module.weight.detach()), requires_grad=False)
    return model


def test_trainer_quantize_base_nf4_matches_single_process_data_parallel_qlora_and_exports(tmp_path):
    from peft import LoraConfig, PeftModel, get_peft_model
    from transformers import AutoModelForCausalLM

    _llama().save_pretrained(tmp_path)  # bf16 random weights
    got = run_ranks(_trainer_group, 2, str(tmp_path))
    # Single-process QLoRA: from_pretrained in bf16, PEFT seeded as the trainer, the same NF4 base,
    # and DDP's gradient: each rank's half-batch mean loss, the two gradients averaged. (The gradient
    # of the concatenated batch in one pass sums in another order: its last-bit differences flip a
    # bf16 rounding of an activation at step 2, and Adam's first lora_A update, ~0.74 * lr * sign(g),
    # turns the flipped sign of a tiny gradient into 1.5e-2; the trainer at 1 rank equals that loop.)
    model = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16)
    model.config.use_cache = False
    torch.manual_seed(SEED)
    model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                             task_type="CAUSAL_LM"))
    _nf4_base(model)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW([{"params": [p for p in params if p.dim() >= 2], "weight_decay": WD},
                             {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}], lr=LR)
    want = []
    for s in range(STEPS):
        halves = []
        for rank in range(2):
            inputs, targets = _batch(rank, s)
            loss = nn.functional.cross_entropy(model(inputs).logits.float().reshape(-1, VOCAB), targets.reshape(-1))
            (loss / 2).backward()
            halves.append(loss.item())
        opt.step()
        opt.zero_grad()
        want.append(sum(halves) / 2)
    adapters = {n: p.detach() for n, p in model.named_parameters() if "lora_" in n}
    print(f"trainer losses {got[0]['losses']} vs single process {want}")
    for rank, res in enumerate(got):
        assert res["kinds"] >= {"NF4Tensor"}, res["kinds"]
        torch.testing.assert_close(torch.tensor(res["losses"]), torch.tensor(want), rtol=1e-5, atol=1e-5)
        assert res["adapters"].keys() == adapters.keys(), sorted(res["adapters"].keys() ^ adapters.keys())
        worst = max((torch.from_numpy(v) - torch.chunk(adapters[n], 2)[rank]).abs().max().item()
                    for n, v in res["adapters"].items())
        print(f"rank {rank}: adapters max |diff| vs single process {worst:.3g}")
        assert worst <= 1e-6, worst
    # The adapter over the base as training saw it (the checkpoint in bf16, decoder Linear weights to_nf4
    # of them, single process): the sharded model's logits. The merged model (bf16, each NF4 weight
    # dequantized by torchao, the adapters merged in by PEFT) loads with transformers alone: the same
    # logits but for the bf16 rounding of each merged weight (W + B A alpha / r), as for a bf16 base.
    sharded, saved = got[0]["logits"], got[0]["saved"]
    assert sorted(os.listdir(tmp_path / "out")) == ["adapter", "merged"]  # no partial directory left
    prompt = torch.tensor(PROMPT)
    with torch.no_grad():
        base = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16)
        peft = _nf4_base(PeftModel.from_pretrained(base, saved["adapter"]))
        assert {"adapter_config.json", "adapter_model.safetensors"} <= set(os.listdir(saved["adapter"]))
        adapter_diff = (peft(prompt).logits.float() - torch.from_numpy(sharded)).abs().max().item()
        merged = AutoModelForCausalLM.from_pretrained(saved["merged"], dtype="auto")
        assert {p.dtype for p in merged.parameters()} == {torch.bfloat16}
        assert not any("lora" in n for n, _ in merged.named_parameters())
        merged_diff = (merged(prompt).logits.float() - torch.from_numpy(sharded)).abs().max().item()
        # What the tolerances tell apart: the adapter over the bf16 base, not quantized.
        plain = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16),
                                          saved["adapter"])
        unquantized = (plain(prompt).logits.float() - torch.from_numpy(sharded)).abs().max().item()
    print(f"exports: adapter over the NF4 base, logits max |diff| {adapter_diff:.3g}; merged bf16 model "
          f"{merged_diff:.3g}; the adapter over the unquantized base {unquantized:.3g} (logits' max |value| "
          f"{abs(sharded).max():.3g})")
    assert adapter_diff <= 1e-5, adapter_diff
    assert merged_diff <= 3e-2 < unquantized, (merged_diff, unquantized)
