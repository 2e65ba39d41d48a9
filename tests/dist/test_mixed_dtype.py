"""Units that mix dtypes (issue 29): PEFT LoRA (r=4 on q_proj/v_proj) on a tiny transformers Llama whose
base is bf16 and whose adapters PEFT keeps in fp32, one unit per decoder layer, 2 ranks, 3 AdamW steps, on
both doors (fully_shard; the wrapper under FULL_SHARD and SHARD_GRAD_OP), against single-process PEFT on the
same global batch: adapter weights, the bf16 base bit for bit, frozen parameters without gradient or optimizer
state, the gathered lora_A weight fp32 inside forward, memory_stats counting every dtype, and state dicts
(full; sharded for the wrapper) that keep each parameter's dtype through a round trip."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("peft")

from tests.dist.harness import run_ranks  # noqa: E402

BF16 = torch.bfloat16
VOCAB, T, B, STEPS, LR, SEED = 96, 8, 2, 3, 1e-2, 5
DOORS = ("fully_shard", "full_shard", "shard_grad_op")


def _peft_llama():
    """The tiny Llama in bf16 with PEFT adapters (fp32: PEFT's default beside a bf16 base)."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(SEED)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      tie_word_embeddings=True, bos_token_id=0, eos_token_id=1, use_cache=False)
    model = LlamaForCausalLM(cfg).to(BF16)
    torch.manual_seed(SEED + 1)  # lora_B starts at zero: a random one makes the forward test the adapter
    model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                             lora_dropout=0.0, task_type="CAUSAL_LM"))
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.1)
    return model


def _batch(rank: int, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randint(0, VOCAB, (B, T + 1), generator=g)


def _loss(model, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(input_ids=tokens[:, :-1]).logits
    return torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB).float(), tokens[:, 1:].reshape(-1))


def _train(model, batches) -> tuple[torch.optim.Optimizer, dict]:
    """AdamW steps; returns the optimizer and which parameters had a gradient at the last step."""
    opt = torch.optim.AdamW(model.parameters(), lr=LR)  # frozen parameters included: they must get no state
    for tokens in batches:
        _loss(model, tokens).backward()
        has_grad = {n: p.grad is not None for n, p in model.named_parameters()}
        opt.step()
        opt.zero_grad(set_to_none=True)
    return opt, has_grad


def _shard(model, door: str):
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    from fullshard import FullyShardedDataParallel as FSDP, ShardingStrategy, fully_shard
    from fullshard.wrap import ModuleWrapPolicy

    if door == "fully_shard":
        for layer in model.base_model.model.model.layers:
            fully_shard(layer)
        return fully_shard(model)
    strategy = ShardingStrategy.FULL_SHARD if door == "full_shard" else ShardingStrategy.SHARD_GRAD_OP
    return FSDP(model, auto_wrap_policy=ModuleWrapPolicy({LlamaDecoderLayer}), sharding_strategy=strategy)


def _full_state(model, door: str) -> dict:
    sd = model.state_dict()
    if door == "fully_shard":
        return {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in sd.items()}
    return sd


def _check_plan(model, opt, rank: int, door: str) -> None:
    """`fullshard plan --hf-model`'s per-rank model state equals memory_stats on the wrapped model (see
    :func:`check_plan_equals_memory_stats`). Every dimension of the tiny Llama is even, so both ranks hold
    the same and padding is nil."""
    check_plan_equals_memory_stats(model, opt, _peft_llama(), lambda: _loss(model, _batch(rank, 0)).backward(), door)


def check_plan_equals_memory_stats(model, opt, plain, backward, what: str, nf4: bool = False) -> dict:
    """`fullshard plan --hf-model`'s per-rank model state (train/plan_hf.py), planned on ``plain`` (the
    same PEFT model unwrapped; ``nf4``: as `--quantize-base nf4` stores it), equals what memory_stats
    counts on the wrapped ``model`` (2 ranks, FULL_SHARD): frozen and trainable shard bytes by dtype
    (an NF4 base under ``"NF4Tensor"``), gradient shards after ``backward()``, AdamW state (plus its
    0-dim fp32 step per trained parameter). Returns the plan."""
    from fullshard import ShardingStrategy, memory_stats
    from fullshard.train import plan_hf

    est = plan_hf.plan_hf(plan_hf.hf_units(plain, plain.base_model.model.model.layers, nf4),
                          ShardingStrategy.FULL_SHARD, 2, "adam")
    backward()
    units = [e for k, e in memory_stats(model, opt).items() if k != "pool"]
    opt.zero_grad(set_to_none=True)
    for kind in ("frozen", "trainable"):
        got = {}
        for e in units:
            for dtype, d in e["by_dtype"].items():
                got[dtype] = got.get(dtype, 0) + d[f"{kind}_bytes"]
        assert {k: v for k, v in got.items() if v} == {k: v for k, v in est[kind].items() if v}, (what, kind, got)
    assert est["frozen"]["bfloat16"] > 0 and est["trainable"]["float32"] > 0, est
    assert ("NF4Tensor" in est["frozen"]) == nf4, est
    assert sum(e["grad_bytes"] for e in units) == est["grads"] == est["trainable"]["float32"], (what, est)
    trained = sum(p.requires_grad for p in plain.parameters())
    assert sum(e["optim_state_bytes"] for e in units) == est["optimizer"] + 4 * trained, (what, est)
    return est


def _group(rank: int, world: int) -> dict:
    from fullshard import FullyShardedDataParallel as FSDP, StateDictType, memory_stats

    init = {k: v.clone() for k, v in _peft_llama().state_dict().items()}
    ref = _peft_llama()
    _train(ref, [torch.cat([_batch(r, s) for r in range(world)]) for s in range(STEPS)])
    want = ref.state_dict()
    out = {}
    for door in DOORS:
        model = _peft_llama()
        seen = []
        lora_a = model.base_model.model.model.layers[0].self_attn.q_proj.lora_A["default"]
        base = model.base_model.model.model.layers[0].self_attn.q_proj.base_layer
        lora_a.register_forward_hook(lambda m, i, o: seen.append(("lora_A", m.weight.dtype)))
        base.register_forward_hook(lambda m, i, o: seen.append(("base", m.weight.dtype)))
        model = _shard(model, door)
        opt, has_grad = _train(model, [_batch(rank, s) for s in range(STEPS)])
        assert set(seen) == {("lora_A", torch.float32), ("base", BF16)}, (door, set(seen))
        for n, p in model.named_parameters():
            assert p.dtype == (torch.float32 if "lora_" in n else BF16), (door, n, p.dtype)
            assert has_grad[n] == p.requires_grad, (door, n)
            assert (p in opt.state) == p.requires_grad, (door, n)
        local = sum(p.to_local().nbytes if door == "fully_shard" else p.nbytes for p in model.parameters())
        held = sum(e["sharded_bytes"] for k, e in memory_stats(model).items() if k != "pool")
        assert local <= held <= 2 * local, (door, local, held)  # every dtype's shard counted, padding aside
        _check_plan(model, opt, rank, door)
        got = _full_state(model, door)
        assert got.keys() == want.keys(), door
        lora = max((got[k].float() - want[k].float()).abs().max().item() for k in got if "lora_" in k)
        for k, v in got.items():
            assert v.dtype == want[k].dtype, (door, k, v.dtype)
            if "lora_" not in k:
                assert torch.equal(v, init[k]), (door, k)  # the frozen bf16 base, bit for bit
        # Round trips keep each parameter's dtype and value: full (both doors), sharded (the wrapper).
        fresh = _shard(_peft_llama(), door)
        fresh.load_state_dict(model.state_dict())
        back = _full_state(fresh, door)
        assert all(back[k].dtype == v.dtype and torch.equal(back[k], v) for k, v in got.items()), door
        if door != "fully_shard":
            with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
                sharded = model.state_dict()
            fresh = _shard(_peft_llama(), door)
            with FSDP.state_dict_type(fresh, StateDictType.SHARDED_STATE_DICT):
                fresh.load_state_dict(sharded)
            back = _full_state(fresh, door)
            assert all(back[k].dtype == v.dtype and torch.equal(back[k], v) for k, v in got.items()), door
            with FSDP.summon_full_params(model):
                assert {p.dtype for n, p in model.named_parameters() if "lora_" not in n} == {BF16}, door
        out[door] = lora
    return out


def test_lora_on_bf16_base_matches_single_process_peft():
    got = run_ranks(_group, 2)
    for rank, diffs in enumerate(got):
        for door, diff in diffs.items():
            assert diff <= 1e-6, f"rank {rank} {door}: adapters max |diff| {diff:.3g} vs single-process PEFT"
    print({door: f"{d:.3g}" for door, d in got[0].items()})
