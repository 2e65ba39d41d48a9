"""Activation checkpointing composed with FSDP units on gloo ranks.

* parity: checkpointed blocks (both nestings: CheckpointWrapper(FSDP(block))
  and FSDP(CheckpointWrapper(block))) give the same losses, parameter names
  and parameters as no checkpointing, with dropout on (RNG replayed);
* communication: recomputation in backward issues no extra all-gather (FULL_SHARD:
  2 per block unit + 1 for the root, per step) and no extra reduce-scatter;
* memory: at a long sequence the peak bytes torch allocates on the CPU during
  forward+backward fall (torch profiler memory timeline, see ``_peak_bytes``).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from fullshard import FullyShardedDataParallel as FSDP, MixedPrecision, ShardingStrategy
from fullshard.activation_checkpointing import CheckpointWrapper, apply_activation_checkpointing
from fullshard.bench.measure import peak_allocated_bytes
from fullshard.core import collectives as C
from fullshard.models import GPT, GPTConfig, TransformerBlock, build_model
from fullshard.wrap import ModuleWrapPolicy
from tests.dist import models as M
from tests.dist.harness import run_ranks

RTOL, ATOL = 1.3e-6, 1e-5
STEPS = 4
LAYERS = 2  # transformer_lm_gpt_mini


def _build(nesting: str, strategy, mp=None):
    model = build_model("transformer_lm_gpt_mini", vocab_size=97, max_positions=16, seed=0, dropout=0.1)
    policy = ModuleWrapPolicy({TransformerBlock})
    if nesting != "none":
        apply_activation_checkpointing(model, check_fn=lambda m: isinstance(m, TransformerBlock))
        if nesting == "outer":
            policy = ModuleWrapPolicy({CheckpointWrapper})
    return FSDP(model, sharding_strategy=strategy, auto_wrap_policy=policy, mixed_precision=mp)


def _train(model, rank):
    torch.manual_seed(100 + rank)  # dropout masks differ per rank, equal per variant
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-6)
    losses, counts = [], []
    for step in range(STEPS):
        x, y = M.batch("gpt", rank, step)
        C.reset_counts()
        out = model(x)
        loss = F.cross_entropy(out.float().reshape(-1, out.size(-1)), y.reshape(-1))
        loss.backward()
        counts.append((C.COUNTS["all_gather"], C.COUNTS["reduce_scatter"]))
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    with model.summon_full_params():
        params = {n: p.detach().clone() for n, p in model.named_parameters()}
    return losses, counts, params


def _parity(rank, world):
    bf16 = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, buffer_dtype=torch.bfloat16)
    for strategy, mp in ((ShardingStrategy.FULL_SHARD, None), (ShardingStrategy.SHARD_GRAD_OP, None),
                         (ShardingStrategy.FULL_SHARD, bf16)):
        ref_losses, ref_counts, ref_params = _train(_build("none", strategy, mp), rank)
        per_step_gathers = 2 * LAYERS + 1 if strategy is ShardingStrategy.FULL_SHARD else LAYERS + 1
        assert all(c == (per_step_gathers, LAYERS + 1) for c in ref_counts), ref_counts
        for nesting in ("inner", "outer"):
            where = f"{strategy.value} mp={mp is not None} nesting={nesting}"
            losses, counts, params = _train(_build(nesting, strategy, mp), rank)
            assert counts == ref_counts, (where, counts, ref_counts)
            torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=RTOL, atol=ATOL,
                                       msg=lambda m: f"{where} losses: {m}")
            assert list(params) == list(ref_params), (where, list(params), list(ref_params))
            for n, p in params.items():
                torch.testing.assert_close(p, ref_params[n], rtol=RTOL, atol=ATOL,
                                           msg=lambda m: f"{where} param {n}: {m}")
    return True


def test_checkpointing_parity_and_collective_counts():
    run_ranks(_parity, 2)


def _peak_bytes(model, x, y) -> int:
    """Peak bytes allocated by torch on the CPU during one forward+backward,
    above what was allocated when it started.

    Measured with the torch profiler's allocator events (``profile_memory``):
    every allocation (+bytes) and free (-bytes) the CPU allocator reports
    during the step, replayed in time order; the answer is the running sum's
    maximum. It covers all categories (activations, temporaries, gradients,
    FSDP's gathered parameters); only activations differ between the runs.
    (``export_memory_timeline`` gives the same numbers on a plain model but
    its data-flow analysis rejects FSDP's storage resizing.)
    """
    def step():
        out = model(x)
        F.cross_entropy(out.reshape(-1, out.size(-1)), y.reshape(-1)).backward()

    return peak_allocated_bytes(step)[1]


def _memory(rank, world):
    cfg = GPTConfig(num_layers=4, embed_dim=64, num_heads=2, ffn_embed_dim=256, vocab_size=97,
                    max_positions=512)
    g = torch.Generator().manual_seed(rank)
    tokens = torch.randint(0, 97, (4, 513), generator=g)
    x, y = tokens[:, :-1], tokens[:, 1:]
    peaks = {}
    for ckpt in (False, True):
        model = GPT(cfg)
        model.init_weights(0)
        if ckpt:
            apply_activation_checkpointing(model, check_fn=lambda m: isinstance(m, TransformerBlock))
        model = FSDP(model, auto_wrap_policy=ModuleWrapPolicy({TransformerBlock}))
        model(x).sum().backward()  # warm-up: lazy init, first-iteration buffers
        peaks[ckpt] = _peak_bytes(model, x, y)
    return peaks


def test_checkpointing_lowers_peak_memory():
    """4 blocks, width 64, (B, T) = (4, 512) per rank, FULL_SHARD on 2 ranks."""
    for rank, peaks in enumerate(run_ranks(_memory, 2)):
        print(f"rank {rank}: peak bytes during fwd+bwd without checkpointing {peaks[False]:,}, "
              f"with {peaks[True]:,} ({peaks[True] / peaks[False]:.2f}x)")
        # One block's activations are ~16 (B, T, C) fp32 tensors; checkpointing keeps
        # one per block and recomputes one block at a time, so well under half.
        assert peaks[True] < 0.5 * peaks[False], peaks


class _CastBlock(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x):
        return torch.relu(self.lin(x))


class _Fp32Handoff(torch.nn.Module):
    """Hands an fp32 activation to a checkpointed unit (e.g. an fp32 positional term)."""

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(8, 8)
        self.b = _CastBlock()

    def forward(self, x):
        return self.b(self.a(x).float())


def _recompute_casts_inputs(rank, world):
    torch.manual_seed(0)
    model = _Fp32Handoff()
    apply_activation_checkpointing(model, check_fn=lambda m: isinstance(m, _CastBlock))
    model = FSDP(model, auto_wrap_policy=ModuleWrapPolicy({_CastBlock}),
                 mixed_precision=MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32))
    model(torch.randn(4, 8)).float().sum().backward()
    return True



def test_recomputation_casts_inputs_like_forward():
    run_ranks(_recompute_casts_inputs, 1)
