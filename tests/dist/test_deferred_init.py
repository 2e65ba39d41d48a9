"""Deferred initialization: a GPT built on the meta device is materialized
one unit at a time inside the wrapper, each rank keeps only its shards, and
the result equals a full initialization with the same seed."""
from __future__ import annotations

import torch

from fullshard import FullyShardedDataParallel as FSDP
from fullshard.models import GPT, GPTConfig, TransformerBlock, make_param_init_fn
from fullshard.wrap import ModuleWrapPolicy
from tests.dist.harness import run_ranks

# Ψ ≈ 25.7M (≈103 MB fp32): 8 blocks of 3.15M parameters, small embeddings,
# so one unit is half of a rank's share at N = 4.
CONFIG = GPTConfig(num_layers=8, embed_dim=512, num_heads=8, ffn_embed_dim=2048, vocab_size=1024,
                   max_positions=64)
SEED = 7


def _status_kb(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    raise KeyError(key)


def _reset_peak_rss() -> bool:
    """Reset VmHWM to the current RSS (Linux ``clear_refs`` 5)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _deferred(rank, world):
    with torch.device("meta"):
        meta_model = GPT(CONFIG)
    assert all(p.is_meta for p in meta_model.parameters())
    psi = sum(p.numel() for p in meta_model.parameters())
    share_bytes = psi * 4 / world
    unit_bytes = sum(p.numel() for p in meta_model.layers[0].parameters()) * 4
    init_fn = make_param_init_fn(meta_model, SEED, torch.device("cpu"))
    can_measure = _reset_peak_rss()
    rss0 = _status_kb("VmRSS")
    model = FSDP(meta_model, auto_wrap_policy=ModuleWrapPolicy({TransformerBlock}),
                 param_init_fn=init_fn, device_id=torch.device("cpu"))
    peak_growth = (_status_kb("VmHWM") - rss0) * 1024
    held = sum(p.numel() * p.element_size() for p in model.parameters())
    assert not any(p.is_meta for p in model.parameters())
    assert held <= share_bytes + 4 * 4096, (held, share_bytes)
    if can_measure:
        # Peak while wrapping: this rank's shards plus one unit's full
        # parameters (and the init's fp32 draw of it), never the whole model.
        assert peak_growth < share_bytes + 3 * unit_bytes, (peak_growth, share_bytes, unit_bytes)
        assert peak_growth < 0.6 * psi * 4, (peak_growth, psi)
    assert model.output_projection.weight is model.embed_tokens.weight
    reference = GPT(CONFIG)
    reference.init_weights(SEED)
    with model.summon_full_params():
        got = dict(model.named_parameters())
        for n, p in reference.named_parameters():
            assert torch.equal(got[n], p), n
    return {"psi": psi, "share_bytes": share_bytes, "unit_bytes": unit_bytes, "held_bytes": held,
            "peak_rss_growth_bytes": peak_growth if can_measure else None}


def test_deferred_init_matches_full_init_and_stays_near_the_share(monkeypatch):
    # A fixed mmap threshold makes glibc return every freed tensor to the OS
    # at once, so the RSS high-water mark measures live tensors, not malloc's
    # retained heap.
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "65536")
    out = run_ranks(_deferred, 4)
    for rank, o in enumerate(out):
        print(rank, o)
