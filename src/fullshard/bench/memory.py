"""Memory benchmark: peak bytes of one training step under each memory feature of fullshard.

Run::

    python -m fullshard.bench.memory                          # N=2, gpt_mini, T=1024, batch 2/rank
    python -m fullshard.bench.memory --configs fp32,ckpt --seq-len 512

torch's elastic launcher (as `fullshard bench`, :mod:`fullshard.bench.suite`) starts N gloo
ranks on CPU. Every rank builds the same GPT (same seed) once per config,
wraps it with fullshard FULL_SHARD and ``ModuleWrapPolicy({TransformerBlock})``
(plus the root unit) and runs two full training steps (zero_grad, forward,
cross entropy, backward, AdamW step) on the same two batches of random tokens
(different per rank, identical for every config):

* step 1 is a warm-up (lazy init, AdamW state created);
* step 2 is measured: its peak allocated bytes, from the torch profiler's CPU
  allocator events (running sum of +alloc/-free, see
  :func:`fullshard.bench.measure.peak_allocated_bytes`), i.e. bytes above
  what was live when the step began (parameter shards, optimizer state,
  the batch). Gradients are set to None before it, so they are in the peak.

After step 2 the model state is read: bytes of the parameter shards, their
gradients and the AdamW state, with the device and dtype of each.

Configs (``--configs``, run in this order):

* ``fp32``: the baseline, no mixed precision.
* ``bf16``: ``MixedPrecision(param_dtype=bf16, reduce_dtype=fp32, buffer_dtype=bf16)``.
* ``ckpt``: ``apply_activation_checkpointing`` on each ``TransformerBlock`` before wrapping.
* ``ckpt_offload``: ``ckpt`` with the step run inside ``offload_activations()``.
* ``cpu_offload``: ``CPUOffload(offload_params=True)``.
* ``accum_no_sync``: two micro-batches of half the batch (``--update-freq 2``),
  the first under ``model.no_sync()`` (unsharded gradients kept locally).
* ``accum_rs``: the same two micro-batches, each backward reduce-scattering.
* ``bf16_ckpt``: ``bf16`` and ``ckpt`` together.

The loss printed is the measured step's (for micro-batches: the sum of the
halves, each divided by 2, = the mean over the batch), averaged over ranks;
all configs train the same model on the same data, so they agree (bf16 to
its precision).
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import os
import sys
import time

import torch
import torch.nn.functional as F

from fullshard import (
    CPUOffload,
    FullyShardedDataParallel,
    MixedPrecision,
    ShardingStrategy,
    apply_activation_checkpointing,
    offload_activations,
)
from fullshard.bench import measure
from fullshard.models import TransformerBlock, build_model, num_params
from fullshard.train.launcher import launch_local
from fullshard.wrap import ModuleWrapPolicy

MiB = float(2 ** 20)


@dataclasses.dataclass(frozen=True)
class MemConfig:
    """One memory configuration of fullshard FULL_SHARD."""

    name: str
    bf16: bool = False
    """MixedPrecision(param_dtype=bf16, reduce_dtype=fp32, buffer_dtype=bf16)."""
    checkpoint: bool = False
    """Activation checkpointing on each TransformerBlock."""
    offload_activations: bool = False
    """Run forward+backward inside ``offload_activations()``."""
    cpu_offload: bool = False
    """CPUOffload(offload_params=True)."""
    micro_batches: int = 1
    """Split each batch into this many equal micro-batches (gradient accumulation)."""
    no_sync: bool = False
    """With micro-batches: all but the last backward under ``model.no_sync()``."""


CONFIGS = {c.name: c for c in (
    MemConfig("fp32"),
    MemConfig("bf16", bf16=True),
    MemConfig("ckpt", checkpoint=True),
    MemConfig("ckpt_offload", checkpoint=True, offload_activations=True),
    MemConfig("cpu_offload", cpu_offload=True),
    MemConfig("accum_no_sync", micro_batches=2, no_sync=True),
    MemConfig("accum_rs", micro_batches=2),
    MemConfig("bf16_ckpt", bf16=True, checkpoint=True),
)}
"""``--configs`` keys; ``fp32`` is the baseline of the ratio column."""


@dataclasses.dataclass(frozen=True)
class RunConfig:
    """One launch (every rank gets the same copy)."""

    arch: str
    vocab_size: int
    seq_len_tokens: int
    """T: tokens per sample; also the model's ``max_positions``."""
    batch_size_per_rank: int
    lr: float
    seed: int
    configs: tuple[MemConfig, ...]
    timeout_s: float


# ---------------------------------------------------------------- one rank
def _batches(cfg: RunConfig, rank: int):
    g = torch.Generator().manual_seed(cfg.seed * 100_003 + rank)
    tok = torch.randint(0, cfg.vocab_size, (2, cfg.batch_size_per_rank, cfg.seq_len_tokens + 1), generator=g)
    return [(t[:, :-1].contiguous(), t[:, 1:].contiguous()) for t in tok]


def _build(cfg: RunConfig, mc: MemConfig):
    model = build_model(cfg.arch, cfg.vocab_size, cfg.seq_len_tokens, seed=cfg.seed)
    psi = num_params(model)
    if mc.checkpoint:
        apply_activation_checkpointing(model, check_fn=lambda m: isinstance(m, TransformerBlock))
    mp = (MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, buffer_dtype=torch.bfloat16)
          if mc.bf16 else None)
    wrapped = FullyShardedDataParallel(model, sharding_strategy=ShardingStrategy.FULL_SHARD,
                                       auto_wrap_policy=ModuleWrapPolicy({TransformerBlock}),
                                       mixed_precision=mp, cpu_offload=CPUOffload(offload_params=mc.cpu_offload))
    return wrapped, psi


def _step(model, opt, mc: MemConfig, x, y) -> float:
    """One optimizer step (zero_grad, forward, loss, backward per micro-batch, AdamW); returns the loss."""
    opt.zero_grad(set_to_none=True)
    total = 0.0
    micro = list(zip(x.chunk(mc.micro_batches), y.chunk(mc.micro_batches)))
    for i, (xm, ym) in enumerate(micro):
        last = i == len(micro) - 1
        sync = model.no_sync() if mc.no_sync and not last else contextlib.nullcontext()
        act = offload_activations() if mc.offload_activations else contextlib.nullcontext()
        with sync, act:
            out = model(xm)
            loss = F.cross_entropy(out.float().reshape(-1, out.size(-1)), ym.reshape(-1)) / len(micro)
            loss.backward()
        total += loss.item()
    opt.step()
    return total


def _where(tensors) -> str:
    kinds = sorted({f"{t.device.type} {str(t.dtype).replace('torch.', '')}" for t in tensors})
    return "/".join(kinds) or "-"


def _measure(cfg: RunConfig, mc: MemConfig, batches) -> dict:
    torch.manual_seed(cfg.seed)
    model, psi = _build(cfg, mc)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
    warm_loss = _step(model, opt, mc, *batches[0])
    opt.zero_grad(set_to_none=True)
    gc.collect()
    t0 = time.perf_counter()
    loss, peak = measure.peak_allocated_bytes(lambda: _step(model, opt, mc, *batches[1]))
    step_s = time.perf_counter() - t0
    params = list(model.parameters())
    grads = [p.grad for p in params if p.grad is not None]
    opt_t = [v for s in opt.state.values() for v in s.values() if torch.is_tensor(v)]
    out = dict(psi=psi, peak_bytes=peak, warm_loss=warm_loss, loss=loss, step_s=step_s,
               param_bytes=measure.param_bytes(model), grad_bytes=measure.grad_bytes(model),
               optim_bytes=measure.optim_state_bytes(opt),
               where=f"params {_where(params)}; grads {_where(grads)}; optim {_where(opt_t)}")
    del model, opt
    gc.collect()
    return out


def _run_config(cfg: RunConfig, mc: MemConfig, batches) -> dict:
    return measure.run_guarded({"config": mc.name}, lambda: _measure(cfg, mc, batches))


def rank_main(cfg: RunConfig) -> dict:
    """Entry of one rank: ``{"rank", "threads", "rows": [...]}``."""
    def rows(rank: int) -> list[dict]:
        batches = _batches(cfg, rank)
        return [_run_config(cfg, mc, batches) for mc in cfg.configs]

    return measure.run_rank(cfg.timeout_s, rows)


# ---------------------------------------------------------------- launcher
def launch(cfg: RunConfig, nproc: int) -> list[dict]:
    """Run :func:`rank_main` on ``nproc`` ranks; their results by rank.

    Raises:
        RuntimeError: a rank died or raised outside a config ("rank R failed: ...").
    """
    return launch_local(rank_main, cfg, nproc)


# ---------------------------------------------------------------- report
def _label(mc: MemConfig) -> str:
    return {"fp32": "1 fp32 baseline", "bf16": "2 bf16", "ckpt": "3 act. ckpt",
            "ckpt_offload": "4 ckpt + act. offload", "cpu_offload": "5 CPUOffload(params)",
            "accum_no_sync": "6a 2 micro, no_sync", "accum_rs": "6b 2 micro, RS each",
            "bf16_ckpt": "7 bf16 + ckpt"}.get(mc.name, mc.name)


def format_report(results: list[dict], cfg: RunConfig) -> list[str]:
    """The table (peak = max over ranks) and the per-rank exact numbers below it."""
    n = len(results)
    labels = {mc.name: _label(mc) for mc in cfg.configs}
    base = [res["rows"][i] for res in results for i, mc in enumerate(cfg.configs)
            if mc.name == "fp32" and "error" not in res["rows"][i]]
    base_peak = max(r["peak_bytes"] for r in base) if len(base) == n else None
    head = (f"{'config':<24}{'peak MiB':>10}{'peak bytes':>12}{'/fp32':>7}{'state MiB':>11}"
            f"{'state bytes':>13}{'loss':>11}  where (params; grads; optim)")
    lines = [head, "-" * (len(head) + 40)]
    for i, mc in enumerate(cfg.configs):
        rows = [res["rows"][i] for res in results]
        errs = [(res["rank"], r["error"]) for res, r in zip(results, rows) if "error" in r]
        own = [e for e in errs if e[1] != "another rank failed"] or errs
        if own:
            lines.append(f"{labels[mc.name]:<24}  ERROR rank {own[0][0]}: {own[0][1]}")
            continue
        peak = max(r["peak_bytes"] for r in rows)
        state = max(r["param_bytes"] + r["grad_bytes"] + r["optim_bytes"] for r in rows)
        loss = sum(r["loss"] for r in rows) / n
        ratio = f"{peak / base_peak:.3f}" if base_peak else "-"
        lines.append(f"{labels[mc.name]:<24}{peak / MiB:>10.2f}{peak:>12}{ratio:>7}{state / MiB:>11.2f}"
                     f"{state:>13}{loss:>11.6f}  {rows[0]['where']}")
    lines += ["", "per rank (exact bytes; peak = above the bytes live when the measured step began):"]
    for i, mc in enumerate(cfg.configs):
        for res in results:
            r = res["rows"][i]
            if "error" in r:
                lines.append(f"  {labels[mc.name]:<24} rank {res['rank']}: ERROR {r['error']}")
                continue
            lines.append(f"  {labels[mc.name]:<24} rank {res['rank']}: peak {r['peak_bytes']} B; state "
                         f"{r['param_bytes'] + r['grad_bytes'] + r['optim_bytes']} B = params "
                         f"{r['param_bytes']} + grads {r['grad_bytes']} + optim {r['optim_bytes']}; loss "
                         f"warm-up {r['warm_loss']:.6f} -> measured {r['loss']:.6f}; step {r['step_s']:.2f} s")
    tb = next((r["traceback"] for res in results for r in res["rows"] if "traceback" in r), None)
    if tb:
        lines += ["", "first traceback:", tb]
    ok = next((r for r in results[0]["rows"] if "error" not in r), None)
    if ok is not None:
        psi = ok["psi"]
        lines += ["", f"Psi = {psi} parameters (tied embedding once); ZeRO fp32 AdamW model state per rank "
                      f"16*Psi/N = {16 * psi // n} B"]
    lines += [
        "",
        "Notes:",
        "* peak = max over the measured step (forward, loss, backward, AdamW step) of the running sum of the",
        "  torch profiler's CPU allocator events (+alloc, -free); it excludes what was live when the step began",
        "  (parameter shards, AdamW state, the batch). Gradients are set to None first, so they are in it.",
        "* state = params + grads + AdamW state after the step (distinct storages; AdamW m, v and a 4-byte step",
        "  per parameter). Master shards, gradient shards and optimizer state stay fp32 under bf16.",
        "* On a CPU-only machine host memory IS device memory: CPUOffload(offload_params=True) and",
        "  offload_activations() have nowhere else to move tensors to, so they move nothing (shards are already",
        "  host tensors; save_on_cpu keeps CPU tensors as they are). Their rows are shown, not hidden: they run",
        "  the same allocations as the row they modify (5 vs 1, 4 vs 3), so their peak equals it by construction,",
        "  up to the timing of asynchronous gloo collectives (whether one unit's gathered parameters or",
        "  reduce-scatter buffer is still alive at the peak), which can move any peak by one unit's full flat",
        "  size between runs and ranks. On a GPU they would lower device memory at the cost of host memory.",
    ]
    logits = cfg.batch_size_per_rank * cfg.seq_len_tokens * cfg.vocab_size * 4
    if base_peak:
        lines.append(f"* one (B, T, V) fp32 logits tensor is {logits} B = {logits / MiB:.2f} MiB; the fp32 peak is "
                     f"{base_peak / logits:.2f}x that. What the logits and the loss need is not inside the "
                     f"checkpointed blocks, so checkpointing cannot shrink it"
                     + (" (try a smaller --vocab-size)." if base_peak < 8 * logits else "."))
    return lines


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m fullshard.bench.memory", description=__doc__.split("\n")[0])
    p.add_argument("--nproc", type=int, default=2, help="N, gloo ranks (default: 2)")
    p.add_argument("--arch", default="transformer_lm_gpt_mini")
    p.add_argument("--vocab-size", type=int, default=50257)
    p.add_argument("--seq-len", type=int, default=1024, help="T, tokens per sample (= max_positions)")
    p.add_argument("--batch-size", type=int, default=2, help="samples per rank per step")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--configs", default=",".join(CONFIGS), help=f"comma-separated, from {list(CONFIGS)}")
    p.add_argument("--timeout-s", type=float, default=300.0, help="gloo collective timeout")
    args = p.parse_args(argv)
    names = [c for c in args.configs.split(",") if c]
    unknown = [c for c in names if c not in CONFIGS]
    if unknown or not names or args.nproc < 1:
        p.error(f"bad --configs {unknown} (choose from {list(CONFIGS)}) or --nproc")
    if args.batch_size % 2 and any(CONFIGS[c].micro_batches == 2 for c in names):
        p.error("the micro-batch configs split the batch in two: --batch-size must be even")
    args.config_names = names
    return args


def run_config(args: argparse.Namespace) -> RunConfig:
    return RunConfig(arch=args.arch, vocab_size=args.vocab_size, seq_len_tokens=args.seq_len,
                     batch_size_per_rank=args.batch_size, lr=args.lr, seed=args.seed,
                     configs=tuple(CONFIGS[c] for c in args.config_names), timeout_s=args.timeout_s)


def run(args: argparse.Namespace) -> int:
    cfg = run_config(args)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    print(f"fullshard.bench.memory: torch {torch.__version__}, {cores} CPU cores, N={args.nproc} gloo ranks; "
          f"{cfg.arch}, V={cfg.vocab_size}, T={cfg.seq_len_tokens}, batch {cfg.batch_size_per_rank}/rank, "
          f"FULL_SHARD + ModuleWrapPolicy({{TransformerBlock}}), AdamW lr={cfg.lr}, seed {cfg.seed}; "
          f"1 warm-up + 1 measured step per config", flush=True)
    t0 = time.perf_counter()
    try:
        results = launch(cfg, args.nproc)
    except Exception as e:
        print(f"LAUNCH FAILED: {e}", flush=True)
        return 1
    print(f"threads per rank: {results[0]['threads']}")
    print("\n".join(format_report(results, cfg)))
    ok = all("error" not in r for res in results for r in res["rows"])
    print(f"total wall time: {time.perf_counter() - t0:.1f} s; {'all configs ran' if ok else 'SOME CONFIGS FAILED'}",
          flush=True)
    return 0 if ok else 1


def main(argv=None) -> None:
    sys.exit(run(parse_args(argv)))


if __name__ == "__main__":
    main()
