"""Unit tests for fullshard.models: shapes, parameter counts, tying, deterministic init."""

import ast
import pathlib
import random
import time

import pytest
import torch

from fullshard.models import ARCHS, GPT, GPTConfig, TransformerBlock, build_model, make_param_init_fn, num_params

V, P = 50257, 2048


def psi(layers, width, vocab=V, positions=P):
    """Ψ = V·C + P·C + L·(12C² + 13C) + 2C (tied output projection counted once)."""
    return vocab * width + positions * width + layers * (12 * width**2 + 13 * width) + 2 * width


def small_config(**kw):
    base = dict(num_layers=2, embed_dim=32, num_heads=4, ffn_embed_dim=128,
                vocab_size=97, max_positions=16)
    return GPTConfig(**{**base, **kw})


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_arch_param_count_matches_formula(arch):
    model = build_model(arch, V, P, device="meta")
    spec = ARCHS[arch]
    assert num_params(model) == psi(spec.num_layers, spec.embed_dim)
    assert model.config.ffn_embed_dim == 4 * model.config.embed_dim


def test_gpt3_archs_are_fairseqs():
    expected = {"small": (12, 768, 12), "medium": (24, 1024, 16), "large": (24, 1536, 16),
                "xl": (24, 2048, 32), "2_7": (32, 2560, 32), "6_7": (32, 4096, 32),
                "13": (40, 5120, 40), "175": (96, 12288, 96)}
    for name, (layers, width, heads) in expected.items():
        spec = ARCHS[f"transformer_lm_gpt3_{name}"]
        assert (spec.num_layers, spec.embed_dim, spec.num_heads) == (layers, width, heads)


def test_known_psi_values():
    assert num_params(build_model("transformer_lm_gpt3_small", V, P, device="meta")) == 125_226_240
    assert num_params(build_model("transformer_lm_gpt3_13", V, P, device="meta")) == 12_853_386_240
    # fairseq's logged 13,110,865,920 (examples/fully_sharded_data_parallel) is
    # this architecture with V=50272, an untied output projection and P+2 position rows.
    C, L = 5120, 40
    assert 2 * 50272 * C + (P + 2) * C + L * (12 * C * C + 13 * C) + 2 * C == 13_110_865_920


@pytest.mark.parametrize("arch", ["transformer_lm_gpt3_13", "transformer_lm_gpt3_175"])
def test_meta_build_is_instant_and_allocates_nothing(arch):
    # Torch's first nn.Embedding lazily imports torch._dynamo (~1.5 s once per
    # process); that is not build time, so warm up before timing.
    build_model("transformer_lm_gpt_mini", 97, 16, device="meta")
    start = time.perf_counter()
    model = build_model(arch, V, P, device="meta")
    assert time.perf_counter() - start < 1.0
    assert all(p.is_meta for p in model.parameters())
    assert model.output_projection.weight is model.embed_tokens.weight


def psi_ffn(layers, width, ffn, vocab=V, positions=P):
    """Ψ with any FFN width F: per block 4C² + 2CF + 9C + F (qkv, out, fc1, fc2 with biases, two LayerNorms)."""
    return vocab * width + positions * width + layers * (4 * width**2 + 2 * width * ffn + 9 * width + ffn) + 2 * width


def test_overrides_reshape_the_named_arch():
    """fairseq's --decoder-* semantics: given sizes replace the arch's; FFN = 4 x the new width unless given."""
    from fullshard.models import make_config

    medium = ARCHS["transformer_lm_gpt3_medium"]
    deeper = medium.override(num_layers=30)
    assert (deeper.num_layers, deeper.embed_dim, deeper.num_heads, deeper.ffn_embed_dim) == (30, 1024, 16, 4096)
    assert num_params(build_model(deeper, V, P, device="meta")) == psi(30, 1024) == psi_ffn(30, 1024, 4096)
    assert num_params(build_model(deeper, V, P, device="meta")) > num_params(
        build_model("transformer_lm_gpt3_medium", V, P, device="meta"))
    wide = ARCHS["transformer_lm_gpt_mini"].override(num_layers=3, embed_dim=96, num_heads=4)
    cfg = make_config(wide, 97, 16)
    assert (cfg.num_layers, cfg.embed_dim, cfg.num_heads, cfg.ffn_embed_dim) == (3, 96, 4, 384)
    model = build_model(wide, 97, 16, device="meta")
    assert num_params(model) == psi_ffn(3, 96, 384, vocab=97, positions=16) == 346_560
    assert len(model.layers) == 3 and all(block.attn.num_heads == 4 for block in model.layers)
    ffn = wide.override(ffn_embed_dim=200)  # an explicit FFN width is kept, width unchanged
    assert make_config(ffn, 97, 16).ffn_embed_dim == 200
    assert num_params(build_model(ffn, 97, 16, device="meta")) == psi_ffn(3, 96, 200, vocab=97, positions=16)
    assert ffn.override(num_heads=8).ffn_embed_dim == 200 and ffn.override(embed_dim=64).ffn_embed_dim == 256
    assert medium.override() == medium and "30 layers, width 1024, 16 heads, ffn 4096" == deeper.describe()


@pytest.mark.parametrize("sizes, message", [
    (dict(num_layers=0), "num_layers must be positive"),
    (dict(embed_dim=-8), "embed_dim must be positive"),
    (dict(ffn_embed_dim=0), "ffn_embed_dim must be positive"),
    (dict(num_heads=5), "num_heads=5 must divide embed_dim=64"),
])
def test_bad_overrides_raise(sizes, message):
    with pytest.raises(ValueError, match=message):
        ARCHS["transformer_lm_gpt_mini"].override(**sizes)


def test_unknown_arch_lists_known_names():
    with pytest.raises(ValueError, match="transformer_lm_gpt3_small.*transformer_lm_gpt_mini"):
        build_model("transformer_lm_gpt4", V, P)


def test_tied_weight_is_one_parameter_and_counted_once():
    model = GPT(small_config())
    assert model.output_projection.weight is model.embed_tokens.weight
    names = [n for n, _ in model.named_parameters()]
    assert "embed_tokens.weight" in names and "output_projection.weight" not in names
    assert num_params(model) == psi(2, 32, vocab=97, positions=16)


def test_forward_shapes_and_dtype():
    model = GPT(small_config())
    logits = model(torch.randint(0, 97, (3, 16)))
    assert logits.shape == (3, 16, 97) and logits.dtype == torch.float32
    block = TransformerBlock(small_config())
    assert block(torch.randn(2, 5, 32)).shape == (2, 5, 32)


def test_too_long_sequence_raises_with_both_numbers():
    model = GPT(small_config())
    with pytest.raises(ValueError, match="17.*16"):
        model(torch.zeros(1, 17, dtype=torch.long))


def test_attention_is_causal():
    torch.manual_seed(0)
    model = GPT(small_config()).eval()
    tokens = torch.randint(0, 97, (1, 10))
    changed = tokens.clone()
    changed[0, 6:] = (changed[0, 6:] + 1) % 97
    assert torch.equal(model(tokens)[0, :6], model(changed)[0, :6])


def test_no_dropout_modules_when_dropout_is_zero():
    assert not any(isinstance(m, torch.nn.Dropout) for m in GPT(small_config()).modules())
    model = GPT(small_config(dropout=0.1)).eval()
    tokens = torch.randint(0, 97, (2, 8))
    assert any(isinstance(m, torch.nn.Dropout) for m in model.modules())
    assert torch.equal(model(tokens), model(tokens))


def test_backward_reaches_tied_weight():
    model = build_model("transformer_lm_gpt_mini", 97, 16, seed=0)
    logits = model(torch.randint(0, 97, (2, 16)))
    logits.sum().backward()
    assert model.embed_tokens.weight.grad is not None


def test_init_scheme():
    model = build_model("transformer_lm_gpt_mini", 500, 16, seed=3)
    sd = model.state_dict()
    assert torch.all(sd["layers.0.ln_1.weight"] == 1) and torch.all(sd["layers.0.ln_1.bias"] == 0)
    assert torch.all(sd["layers.1.attn.qkv_proj.bias"] == 0)
    std = sd["embed_tokens.weight"].std().item()
    assert abs(std - 0.02) < 0.001
    residual_std = sd["layers.0.mlp.fc2.weight"].std().item()
    assert abs(residual_std - 0.02 / 2.0) < 0.001  # 1/sqrt(2 * 2 layers)
    other = build_model("transformer_lm_gpt_mini", 500, 16, seed=4)
    assert not torch.equal(other.embed_tokens.weight, model.embed_tokens.weight)


def test_build_with_seed_equals_init_weights_on_default_init():
    a = build_model("transformer_lm_gpt_mini", 97, 16, seed=7)
    b = build_model("transformer_lm_gpt_mini", 97, 16)
    b.init_weights(7)
    for (na, pa), (nb, pb) in zip(a.state_dict().items(), b.state_dict().items()):
        assert na == nb and torch.equal(pa, pb), na


@pytest.mark.parametrize("order", ["forward", "reversed", "shuffled"])
def test_deferred_meta_init_is_bit_exact(order):
    full = build_model("transformer_lm_gpt_mini", 97, 16, seed=11)
    meta = build_model("transformer_lm_gpt_mini", 97, 16, device="meta")
    init_fn = make_param_init_fn(meta, seed=11, device="cpu")
    modules = list(meta.modules())
    if order == "reversed":  # output_projection (tied slot) before embed_tokens
        modules.reverse()
    elif order == "shuffled":
        random.Random(0).shuffle(modules)
    for module in modules:
        init_fn(module)
    for module in modules:  # idempotent: a second pass changes nothing
        init_fn(module)
    assert not any(p.is_meta for p in meta.parameters())
    assert meta.output_projection.weight is meta.embed_tokens.weight
    full_sd, meta_sd = full.state_dict(), meta.state_dict()
    assert full_sd.keys() == meta_sd.keys()
    for name in full_sd:
        assert torch.equal(full_sd[name], meta_sd[name]), name
    tokens = torch.randint(0, 97, (2, 16))
    assert torch.equal(full(tokens), meta(tokens))


def test_init_fn_rejects_modules_of_another_model():
    meta = build_model("transformer_lm_gpt_mini", 97, 16, device="meta")
    init_fn = make_param_init_fn(meta, seed=0, device="cpu")
    stranger = build_model("transformer_lm_gpt_mini", 97, 16, device="meta")
    with pytest.raises(ValueError, match="not part of the model"):
        init_fn(stranger.layer_norm)


def test_init_weights_rejects_meta():
    with pytest.raises(ValueError, match="meta"):
        build_model("transformer_lm_gpt_mini", 97, 16, device="meta").init_weights(0)


def test_models_never_import_the_rest_of_fullshard():
    root = pathlib.Path(__import__("fullshard.models").models.__file__).parent
    for path in root.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                assert node.level <= 1, f"{path.name} imports outside models/"
                assert not (node.module or "").startswith("fullshard"), path.name
            elif isinstance(node, ast.Import):
                assert not any(a.name.startswith("fullshard") for a in node.names), path.name


def test_init_rows_equal_the_same_rows_of_a_full_init():
    from fullshard.models import GPT, make_config

    cfg = make_config("transformer_lm_gpt_mini", vocab_size=97, max_positions=16)
    full = GPT(cfg)
    full.init_weights(3)
    with torch.device("meta"):
        meta = GPT(cfg)
    fn = make_param_init_fn(meta, 3, "cpu")
    full_params = dict(full.named_parameters())
    for name, p in meta.named_parameters():
        rows = p.shape[0] if p.dim() else 1
        for lo, hi in ((0, rows), (rows // 3, rows - 1), (rows - 1, rows), (rows, rows)):
            got = fn.init_rows(p, lo, hi, "cpu")
            assert torch.equal(got, full_params[name][lo:hi]), (name, lo, hi)
    # The tied weight resolves through either owner to its canonical rows.
    assert torch.equal(fn.init_rows(meta.output_projection.weight, 5, 9, "cpu"), full.embed_tokens.weight[5:9])
    with pytest.raises(ValueError, match="not part of the model"):
        fn.init_rows(torch.nn.Parameter(torch.empty(2, 2, device="meta")), 0, 1, "cpu")
