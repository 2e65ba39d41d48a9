"""The memory planner: the ZeRO paper's Figure 1, fullshard's own accounting
against bytes measured on a wrapped model, budgets, and the CLI."""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from fullshard.api import ShardingStrategy
from fullshard.train import plan as PL


def test_reproduces_zero_figure_1():
    # Rajbhandari et al. 2020, Figure 1: Ψ = 7.5B, N = 64, K = 12.
    got = [round(PL.zero_model_state_bytes(7.5e9, 64, stage) / 1e9, 1) for stage in range(4)]
    assert got == [120.0, 31.4, 16.6, 1.9]
    with pytest.raises(ValueError, match="stage"):
        PL.zero_model_state_bytes(1, 1, 4)


def test_unit_counts_and_strategies():
    work = PL.gpt_workload("transformer_lm_gpt3_small", batch_size=1, tokens_per_sample=1024)
    h = 768  # 12 blocks of 12h² + 13h, tied 50257 x h embedding, 1024 x h positions, final norm
    assert work.psi == 12 * (12 * h * h + 13 * h) + 50257 * h + 1024 * h + 2 * h == 124_439_808
    assert work.largest_unit_numel == work.root_unit_numel  # the embedding outweighs a block
    full = PL.plan(work, PL.Config(ShardingStrategy.FULL_SHARD, 8))
    grad_op = PL.plan(work, PL.Config(ShardingStrategy.SHARD_GRAD_OP, 8))
    ddp_like = PL.plan(work, PL.Config(ShardingStrategy.NO_SHARD, 8))
    # Each parameter's slot is ceil(R / 8) rows: a little padding above 16Ψ/N, none at one rank.
    assert 16 * work.psi // 8 <= full["params"] + full["grads"] + full["optimizer"] <= 1.001 * 16 * work.psi / 8
    assert ddp_like["params"] + ddp_like["grads"] + ddp_like["optimizer"] == 16 * work.psi
    assert full["device_total"] < grad_op["device_total"] < ddp_like["device_total"]
    ckpt = PL.plan(work, PL.Config(ShardingStrategy.FULL_SHARD, 8, checkpoint_activations=True))
    assert ckpt["activations"] < full["activations"]
    off = PL.plan(work, PL.Config(ShardingStrategy.FULL_SHARD, 8, cpu_offload=True))
    assert off["host_offloaded"] == full["params"] + full["grads"] + full["optimizer"]
    assert off["device_total"] == full["device_total"] - off["host_offloaded"]


def test_budget_lists_only_fitting_configs_in_speed_order():
    work = PL.gpt_workload("transformer_lm_gpt3_small", batch_size=2, tokens_per_sample=512)
    budget = 3e9
    fits = PL.fitting(work, 4, budget)
    assert fits and all(est["device_total"] <= budget for _, est in fits)
    keys = [PL._speed_rank(c) for c, _ in fits]
    assert keys == sorted(keys)
    every = PL.fitting(work, 4, 1e15)
    assert len(every) == 3 * 2 * 2 * 2 and len(fits) < len(every)


def _tracked_bytes(rank, world):
    import fullshard
    from fullshard import FullyShardedDataParallel as FSDP
    from fullshard.models import TransformerBlock, build_model
    from fullshard.wrap import ModuleWrapPolicy

    model = FSDP(build_model("transformer_lm_gpt_mini", vocab_size=997, max_positions=32, seed=0),
                 auto_wrap_policy=ModuleWrapPolicy({TransformerBlock}))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    peak = [0]  # full parameters held at once: sampled in each block's forward and backward (at its Linears)

    def sample(*_):
        stats = fullshard.memory_stats(model)
        peak[0] = max(peak[0], sum(v["unsharded_bytes"] for k, v in stats.items() if k != "pool"))

    for block in model.modules():
        if isinstance(block, TransformerBlock):
            for linear in (m for m in block.modules() if isinstance(m, torch.nn.Linear)):
                linear.register_forward_hook(lambda m, a, out: sample() or out.register_hook(sample) and None)
    tokens = torch.randint(0, 997, (2, 17))
    out = model(tokens[:, :-1])
    torch.nn.functional.cross_entropy(out.reshape(-1, 997), tokens[:, 1:].reshape(-1)).backward()
    opt.step()
    params = list(model.parameters())
    nbytes = lambda ts: sum(t.numel() * t.element_size() for t in ts)  # noqa: E731
    return {"params": nbytes(params), "grads": nbytes(p.grad for p in params if p.grad is not None),
            "optimizer": nbytes(t for st in opt.state.values() for t in st.values()
                                if torch.is_tensor(t) and t.dim() > 0), "full_params": peak[0]}


@pytest.mark.heavy
def test_matches_measured_model_state_within_10_percent():
    from tests.dist.harness import run_ranks

    measured = run_ranks(_tracked_bytes, 2)[0]
    est = PL.plan(PL.gpt_workload("transformer_lm_gpt_mini", 2, 32, vocab_size=997),
                  PL.Config(ShardingStrategy.FULL_SHARD, 2))
    for key, value in measured.items():
        assert abs(est[key] - value) <= 0.1 * value, (key, est[key], value)


def _plan_cli(*args):
    """`fullshard plan ARGS` through the console entry point, in this process (a subprocess per call
    costs seconds of imports; the closed-pipe test below keeps a real process)."""
    import contextlib
    import io
    import types

    from fullshard.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(["plan", *args])
        except SystemExit as exit_:  # argparse's error(): exit 2
            code = exit_.code
    return types.SimpleNamespace(returncode=code, stdout=out.getvalue(), stderr=err.getvalue())


def test_cli_prints_plan_and_rejects_bad_input():
    run = _plan_cli
    ok = run("--arch", "transformer_lm_gpt3_small", "--world-size", "4", "--bf16", "--budget-gb", "6")
    assert ok.returncode == 0, ok.stderr
    assert "per-rank device total" in ok.stdout and "stage 3:" in ok.stdout
    assert "expected fastest first" in ok.stdout
    bad = run("--arch", "transformer_lm_gpt3_small", "--world-size", "0")
    assert bad.returncode == 2 and bad.stderr.strip().count("\n") == 0 and "--world-size" in bad.stderr


def test_cli_sizes_decoder_overrides():
    """`plan --decoder-layers 30` sizes the deeper model: Ψ of 30 blocks of gpt3_medium, more than its 24."""
    import re

    from fullshard.models import ARCHS, build_model, num_params

    run = lambda *a: _plan_cli("--arch", "transformer_lm_gpt3_medium", "--world-size", "8", *a)  # noqa: E731
    psi = lambda proc: int(re.search(r"Ψ=([\d,]+)", proc.stdout).group(1).replace(",", ""))  # noqa: E731
    base, deeper = run(), run("--decoder-layers", "30")
    assert base.returncode == 0 and deeper.returncode == 0, base.stderr + deeper.stderr
    # the position table `fullshard train` builds: the arch's 2048 positions, not --tokens-per-sample
    want = num_params(build_model(ARCHS["transformer_lm_gpt3_medium"].override(num_layers=30), 50257, 2048,
                                  device="meta"))
    assert psi(deeper) == want > psi(base)
    assert psi(run("--decoder-layers", "30", "--tokens-per-sample", "128")) == want
    long = run("--tokens-per-sample", "4096")
    assert long.returncode == 2 and "--tokens-per-sample 4096 exceeds the 2048 positions" in long.stderr
    bad = run("--decoder-attention-heads", "7")
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1, bad.stderr
    assert "--decoder-attention-heads 7 must divide the width 1024 of --arch transformer_lm_gpt3_medium" in bad.stderr


def test_ffn_width_enters_activations():
    """A wider FFN adds 4·s·b·ΔF·p/2 activation bytes per layer (Korthikanti eq. (1), MLP term)."""
    from fullshard.models import ARCHS

    spec = ARCHS["transformer_lm_gpt_mini"]
    base = PL.gpt_workload("transformer_lm_gpt_mini", 2, 32, vocab_size=97)
    wide = PL.gpt_workload(spec.override(ffn_embed_dim=4 * spec.embed_dim + 10), 2, 32, vocab_size=97)
    assert wide.ffn_embed_dim == 4 * spec.embed_dim + 10 and base.ffn_embed_dim == 4 * spec.embed_dim
    got = PL.activation_bytes(wide, 2, False) - PL.activation_bytes(base, 2, False)
    assert got == spec.num_layers * 4 * 32 * 2 * 10


@pytest.mark.heavy
def test_a_reader_closing_stdout_early_is_not_a_traceback():
    """`fullshard plan ... | head`: the closed pipe ends the command quietly (exit 1, nothing on stderr)."""
    proc = subprocess.Popen([sys.executable, "-m", "fullshard.cli", "plan", "--arch", "transformer_lm_gpt3_small",
                             "--world-size", "8", "--budget-gb", "100"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    proc.stdout.close()  # the reader is gone before anything is written
    err = proc.stderr.read()
    assert proc.wait(timeout=120) == 1 and err == "", err


def _state_by_rank(rank, world):
    """Per optimizer: (parameter-shard elements, optimizer-state elements) of this rank after one step of
    the mini GPT wrapped as `fullshard train` wraps it (muon: its matrices Owned)."""
    from fullshard import FullyShardedDataParallel as FSDP, optim
    from fullshard.models import TransformerBlock, build_model
    from fullshard.wrap import ModuleWrapPolicy

    out = {}
    for name in ("adam", "muon", "adafactor", "lamb"):
        model = build_model("transformer_lm_gpt_mini", vocab_size=997, max_positions=32, seed=0)
        place = {"shard_placement_fn": optim.muon_placement_fn(model)} if name == "muon" else {}
        model = FSDP(model, auto_wrap_policy=ModuleWrapPolicy({TransformerBlock}), **place)
        opt = {"adam": lambda: torch.optim.AdamW(model.parameters()),
               "muon": lambda: optim.Muon(optim.muon_param_groups(model)),
               "adafactor": lambda: optim.Adafactor(model.parameters()),
               "lamb": lambda: optim.Lamb(model.parameters())}[name]()
        tokens = torch.randint(0, 997, (2, 17), generator=torch.Generator().manual_seed(rank))
        logits = model(tokens[:, :-1])
        torch.nn.functional.cross_entropy(logits.reshape(-1, 997), tokens[:, 1:].reshape(-1)).backward()
        opt.step()
        shard = sum(u._runtime.unit.flat_shard.numel() for u in model.units())
        state = sum(t.numel() for st in opt.state.values() for t in st.values() if torch.is_tensor(t) and t.dim() > 0)
        out[name] = (shard, state)
    return out


def test_optimizer_state_per_rank_is_counted_exactly():
    """`plan --optimizer` counts each rank's optimizer state and parameter shard exactly as the engine and
    fullshard.optim hold them at 2 ranks: muon's momentum on the matrices' owners only, AdamW's moments for
    the rest; Adafactor's row and column factors; Adam's and LAMB's two moments."""
    from fullshard.models import build_model
    from fullshard.train.optim_state import gpt_units, shard_elements, state_elements
    from tests.dist.harness import run_ranks

    measured = run_ranks(_state_by_rank, 2)
    units = gpt_units(build_model("transformer_lm_gpt_mini", vocab_size=997, max_positions=32, device="meta"))
    for name in ("adam", "muon", "adafactor", "lamb"):
        want = state_elements(units, name, 2)
        assert [m[name][1] for m in measured] == want, (name, measured, want)
        assert {m[name][0] for m in measured} == {shard_elements(units, 2, owned=name == "muon")}, name
    adam, muon = state_elements(units, "adam", 2), state_elements(units, "muon", 2)
    assert muon[0] != muon[1] and sum(muon) < sum(adam)  # one momentum per matrix, on its owner


def test_cli_plans_hf_lora_frozen_and_trainable_apart(tmp_path):
    """`plan --hf-model DIR --lora-rank R`: the frozen base, the adapters, their gradients and optimizer
    state on lines of their own; a bf16 base halves the frozen shards only. (That these equal the engine's
    bytes is tests/dist/test_mixed_dtype.py's check against memory_stats.)"""
    pytest.importorskip("peft")
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, bos_token_id=0, eos_token_id=1)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    base = ("--hf-model", str(tmp_path), "--world-size", "2")

    def lines(*args):
        r = _plan_cli(*base, *args)
        assert r.returncode == 0, r.stderr
        return {ln[:46].strip(): int(ln.split()[-2].replace(",", "")) for ln in r.stdout.splitlines()[2:]}

    full, fp32, bf16 = lines(), lines("--lora-rank", "4"), lines("--lora-rank", "4", "--base-dtype", "bf16")
    assert "frozen parameter shards (float32)" not in full
    assert fp32["frozen parameter shards (float32)"] == 2 * bf16["frozen parameter shards (bfloat16)"] > 0
    assert fp32["frozen parameter shards (float32)"] + fp32["trainable parameter shards (float32)"] > \
        full["trainable parameter shards (float32)"]  # the adapters are added to the base
    for key in ("trainable parameter shards (float32)", "gradient shards (trainable only)",
                "Adam moments (fp32), trainable only"):
        assert fp32[key] == bf16[key] and fp32[key] * 10 < full[key], key
    for args, msg in ((("--base-dtype", "bf16"), "--base-dtype bf16 needs --lora-rank"),
                      (("--arch", "transformer_lm_gpt_tiny"), "exclusive"), (("--budget-gb", "2"), "--budget-gb")):
        bad = _plan_cli(*base, *args)
        assert bad.returncode == 2 and bad.stderr.strip().count("\n") == 0 and msg in bad.stderr, bad.stderr
    bad = _plan_cli("--world-size", "2")
    assert bad.returncode == 2 and "--arch NAME" in bad.stderr
    for args, msg in ((("--lora-rank", "4", "--quantize-base", "nf4"), "does not split into whole NF4 scaler blocks"),
                      (("--quantize-base", "nf4"), "--quantize-base nf4 needs --lora-rank")):
        bad = _plan_cli(*base, *args)
        assert bad.returncode == 2 and bad.stderr.strip().count("\n") == 0 and msg in bad.stderr, bad.stderr
    bad = _plan_cli("--arch", "transformer_lm_gpt_tiny", "--world-size", "2", "--quantize-base", "nf4")
    assert bad.returncode == 2 and "--quantize-base needs --hf-model" in bad.stderr, bad.stderr


def test_cli_plans_hf_qlora_nf4_shards_as_torchao_holds_them(tmp_path):
    """`plan --hf-model DIR --lora-rank R --quantize-base nf4`: the decoder layers' Linear weights are
    planned as each rank's chunk of torchao's NF4Tensor (every inner tensor, as memory_stats counts it;
    tests/dist/test_qlora.py checks the plan against memory_stats on the wrapped model); the rest of the
    bf16 base, the adapters, their gradients and optimizer state are those of the bf16 LoRA plan."""
    pytest.importorskip("peft")
    pytest.importorskip("torchao")
    transformers = pytest.importorskip("transformers")
    from torchao.quantization import to_nf4

    from fullshard.train import qlora

    # hidden 256: every Linear weight is whole NF4 scaler blocks on each of 2 ranks.
    config = transformers.LlamaConfig(vocab_size=96, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, bos_token_id=0, eos_token_id=1)
    model = transformers.AutoModelForCausalLM.from_config(config).to(torch.bfloat16)
    model.save_pretrained(tmp_path)
    base = ("--hf-model", str(tmp_path), "--world-size", "2", "--lora-rank", "4", "--base-dtype", "bf16")

    def lines(*args):
        r = _plan_cli(*base, *args)
        assert r.returncode == 0, r.stderr
        return {ln[:46].strip(): int(ln.split()[-2].replace(",", "")) for ln in r.stdout.splitlines()[2:]}

    bf16, nf4 = lines(), lines("--quantize-base", "nf4")
    linears = [m.weight.detach() for layer in model.model.layers for m in layer.modules()
               if type(m) is torch.nn.Linear]
    assert len(linears) == 2 * 7

    def inner_bytes(t):
        names, _ = t.__tensor_flatten__()
        return sum(getattr(t, n).numel() * getattr(t, n).element_size() for n in names)

    want = sum(inner_bytes(torch.chunk(to_nf4(w, qlora.BLOCK, qlora.SCALER_BLOCK), 2)[0]) for w in linears)
    assert nf4["frozen parameter shards (NF4Tensor)"] == want
    linear_bf16 = sum(w.numel() for w in linears) // 2 * 2
    assert nf4["frozen parameter shards (bfloat16)"] == bf16["frozen parameter shards (bfloat16)"] - linear_bf16
    assert want < 0.3 * linear_bf16  # 4-bit codes plus scales
    for key in ("trainable parameter shards (float32)", "gradient shards (trainable only)",
                "Adam moments (fp32), trainable only", "largest unit's full gradient + reduce input"):
        assert nf4[key] == bf16[key], key
    assert nf4["full parameters in flight"] < bf16["full parameters in flight"]
