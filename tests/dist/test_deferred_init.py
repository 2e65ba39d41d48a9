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


def _wrap_deferred(init_fn_of):
    """Wrap a meta-built GPT; returns (model, Ψ, peak RSS growth in bytes or None)."""
    with torch.device("meta"):
        meta_model = GPT(CONFIG)
    assert all(p.is_meta for p in meta_model.parameters())
    psi = sum(p.numel() for p in meta_model.parameters())
    init_fn = init_fn_of(make_param_init_fn(meta_model, SEED, torch.device("cpu")))
    can_measure = _reset_peak_rss()
    rss0 = _status_kb("VmRSS")
    model = FSDP(meta_model, auto_wrap_policy=ModuleWrapPolicy({TransformerBlock}),
                 param_init_fn=init_fn, device_id=torch.device("cpu"))
    peak_growth = (_status_kb("VmHWM") - rss0) * 1024 if can_measure else None
    return model, psi, peak_growth


def _deferred(rank, world):
    reference = GPT(CONFIG)
    reference.init_weights(SEED)
    unit_bytes = sum(p.numel() for p in reference.layers[0].parameters()) * 4
    out = {}
    # "rows": the init fn's init_rows gives each rank only its own rows of
    # each parameter. "modules": a plain fn(module) materializes one module
    # at a time, so a rank holds at most one unit's full parameters.
    for path, init_fn_of, bound_units in (("rows", lambda fn: fn, 0.5),
                                          ("modules", lambda fn: (lambda m: fn(m)), 3)):
        model, psi, peak = _wrap_deferred(init_fn_of)
        share_bytes = psi * 4 / world
        held = sum(p.numel() * p.element_size() for p in model.parameters())
        assert not any(p.is_meta for p in model.parameters())
        assert held <= share_bytes + 4 * 4096, (path, held, share_bytes)
        if peak is not None:
            assert peak < share_bytes + bound_units * unit_bytes, (path, peak, share_bytes, unit_bytes)
            assert peak < 0.6 * psi * 4, (path, peak, psi)
        assert model.output_projection.weight is model.embed_tokens.weight
        with model.summon_full_params():
            got = dict(model.named_parameters())
            for n, p in reference.named_parameters():
                assert torch.equal(got[n], p), (path, n)
        out[path] = {"psi": psi, "share_bytes": share_bytes, "unit_bytes": unit_bytes, "held_bytes": held,
                     "peak_rss_growth_bytes": peak}
        del model
    return out


def test_deferred_init_matches_full_init_and_stays_near_the_share(monkeypatch):
    # A fixed mmap threshold makes glibc return every freed tensor to the OS
    # at once, so the RSS high-water mark measures live tensors, not malloc's
    # retained heap.
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "65536")
    out = run_ranks(_deferred, 4)
    for rank, o in enumerate(out):
        print(rank, o)
