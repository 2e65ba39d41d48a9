"""Side-by-side benchmark: fullshard vs. torch DDP vs. torch FSDP1, on CPU/gloo.

Run::

    python -m fullshard.bench.compare                       # N=2, gpt_tiny, all backends
    python -m fullshard.bench.compare --world-sizes 1,2,4   # one launch and one table per N
    python -m fullshard.bench.compare --backends full,ddp --timed-steps 5 --batch-size 2

For each N, torch's elastic launcher (as ``fullshard.train.launcher``) starts N
gloo ranks on CPU. Each rank builds the same GPT (same seed), and trains it
with each backend in turn, in the same processes: ``--warmup-steps`` AdamW
steps, then ``--timed-steps`` timed ones, on random tokens that differ per
rank and are identical across backends. Backends (``--backends``):

* ``full`` / ``grad_op``: fullshard FULL_SHARD / SHARD_GRAD_OP, one unit per
  ``TransformerBlock`` (``ModuleWrapPolicy``) plus the root unit.
* ``ddp``: ``torch.nn.parallel.DistributedDataParallel``
  (``gradient_as_bucket_view=True``; the stock all-reduce comm hook, wrapped
  to count bytes).
* ``torch_fsdp``: ``torch.distributed.fsdp.FullyShardedDataParallel`` (FSDP1),
  FULL_SHARD, the same wrap policy, ``use_orig_params=True``,
  ``device_id=cpu`` (without it FSDP1 refuses to run on a CPU-only host).
  Used only here, as a baseline. Warnings it raises while wrapping (e.g. its
  switch to NO_SHARD at N=1) are printed under the table.

A backend that raises prints ``ERROR rank R: <reason>`` in its row; the command
exits 0 iff every fullshard row ran at every N.

Columns (bytes are per rank, the max over ranks; MiB = 2^20 bytes):

* ``step ms``: median wall time of one timed step (zero_grad, forward,
  backward, optimizer step), max over ranks of each rank's median; every step
  starts after a barrier, so it excludes rank skew.
* ``tok/s``: ``N * batch * T / step``, global tokens per second.
* ``params``: distinct storages of ``model.parameters()`` on the rank after
  training (fullshard: the units' padded flat shards).
* ``grads``: distinct storages of the parameters' ``.grad`` after the last
  step (fullshard: gradient shards; DDP: its buckets).
* ``optim``: sum of ``numel * element_size`` over ``optimizer.state`` tensors
  (AdamW ``exp_avg``, ``exp_avg_sq``, one 4-byte ``step`` per parameter).
* ``total``: params + grads + optim. ``/DDP``: total over DDP's total.
* ``ZeRO``: per-rank model state from the ZeRO formula for fp32 AdamW
  (4 + 4 + 8 bytes per parameter: 16Ψ/N sharded, 16Ψ replicated;
  Rajbhandari et al., "ZeRO", SC 2020, §5), see ``measure.zero_model_state_bytes``.
* ``AG/step``, ``RS/step``: fullshard ``collectives.BYTES`` per timed step,
  i.e. the *input* bytes of this rank's all-gather calls (its shards) and
  reduce-scatter calls (full padded gradients). ``AR/step``: DDP all-reduce
  bucket bytes per step. ``-`` = not measured.
* ``RSS peak+``: peak resident-set growth of the rank's process during the
  training loop: ``VmHWM`` (high-water mark, reset via
  ``/proc/self/clear_refs`` before the loop) minus ``VmRSS`` before the loop,
  so it includes optimizer state, gradients, activations and gathered full
  parameters. Falls back to ``getrusage`` ``ru_maxrss`` (never reset) when
  ``/proc`` is unavailable; the method is printed. ``MALLOC_MMAP_THRESHOLD_``
  is pinned so freed tensors go back to the OS between backends.
* Above the table: intra-op threads per rank (cores // N, at least 1, as
  the trainer) and the 1-minute load average before/after the launch; times
  on a shared or oversubscribed machine (N > cores) are only indicative,
  the byte columns are exact.
* ``last loss``: mean over ranks of the last step's cross entropy (nats);
  backends must agree (printed: each one's difference to DDP, and the
  first step's loss to show training moved).
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Optional

from fullshard.bench import measure as M
from fullshard.bench.worker import BACKENDS, DDP, OURS, BenchConfig, rank_main

MiB = float(2 ** 20)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m fullshard.bench.compare", description=__doc__.split("\n")[0])
    p.add_argument("--world-sizes", default="2", help="comma-separated N to launch in turn (default: 2)")
    p.add_argument("--arch", default="transformer_lm_gpt_tiny")
    p.add_argument("--vocab-size", type=int, default=50257)
    p.add_argument("--seq-len", type=int, default=128, help="T, tokens per sample (= max_positions)")
    p.add_argument("--batch-size", type=int, default=4, help="samples per rank per step")
    p.add_argument("--warmup-steps", type=int, default=3)
    p.add_argument("--timed-steps", type=int, default=10)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--weight-decay", type=float, default=0.01)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--backends", default=",".join(BACKENDS),
                   help=f"comma-separated, run in this order; from {list(BACKENDS)}")
    p.add_argument("--timeout-s", type=float, default=300.0, help="gloo collective timeout")
    args = p.parse_args(argv)
    try:
        args.world_sizes = [int(n) for n in args.world_sizes.split(",") if n.strip()]
    except ValueError:
        p.error(f"--world-sizes takes integers like 1,2,4, got {args.world_sizes!r}")
    unknown = [b for b in args.backends.split(",") if b not in BACKENDS]
    if unknown or args.timed_steps < 1 or not args.world_sizes or min(args.world_sizes) < 1:
        p.error(f"bad --backends {unknown} (choose from {list(BACKENDS)}), --timed-steps or --world-sizes")
    return args


def bench_config(args: argparse.Namespace) -> BenchConfig:
    return BenchConfig(arch=args.arch, vocab_size=args.vocab_size, seq_len_tokens=args.seq_len,
                       batch_size_per_rank=args.batch_size, warmup_steps=args.warmup_steps,
                       timed_steps=args.timed_steps, lr=args.lr, weight_decay=args.weight_decay,
                       seed=args.seed, backends=tuple(BACKENDS[b] for b in args.backends.split(",")),
                       timeout_s=args.timeout_s)


def launch(cfg: BenchConfig, nproc: int) -> list[dict]:
    """Run :func:`rank_main` on ``nproc`` ranks; returns their results by rank.

    Raises:
        RuntimeError: a rank died or raised outside a backend ("rank R failed: ...").
    """
    from fullshard.train.launcher import launch_local

    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "65536")
    return launch_local(rank_main, cfg, nproc)


def merge_rows(results: list[dict]) -> list[dict]:
    """One row per backend: max over ranks of times and bytes, mean of losses."""
    merged = []
    for i, first in enumerate(results[0]["rows"]):
        per_rank = [res["rows"][i] for res in results]
        row = {"backend": first["backend"]}
        errs = [(res["rank"], r["error"]) for res, r in zip(results, per_rank) if "error" in r]
        own = [e for e in errs if e[1] != "another rank failed"] or errs
        if own:
            row["error"] = f"rank {own[0][0]}: {own[0][1]}"
        else:
            for k, v in first.items():
                if isinstance(v, (int, float)) and not k.endswith("_loss"):
                    row[k] = max(r[k] for r in per_rank)
            for k in ("first_loss", "last_loss"):
                row[k] = sum(r[k] for r in per_rank) / len(per_rank)
            row["rss_method"] = first["rss_method"]
            row["notes"] = first.get("notes", [])
        merged.append(row)
    return merged


def _mib(x: Optional[float]) -> str:
    return "-" if x is None else f"{x / MiB:.2f}"


HEADER = (f"{'backend':<24}{'step ms':>9}{'tok/s':>9}{'params':>9}{'grads':>9}{'optim':>9}"
          f"{'total':>9}{'/DDP':>7}{'ZeRO':>9}{'AG/step':>9}{'RS/step':>9}{'AR/step':>9}"
          f"{'RSS peak+':>10}{'last loss':>11}")


def format_table(rows: list[dict], n: int, cfg: BenchConfig) -> list[str]:
    tokens = n * cfg.batch_size_per_rank * cfg.seq_len_tokens
    ddp = next((r for r in rows if r["backend"] == DDP and "error" not in r), None)
    ddp_total = ddp and ddp["param_bytes"] + ddp["grad_bytes"] + ddp["optim_bytes"]
    lines = [HEADER + "   (bytes columns in MiB)", "-" * len(HEADER)]
    for r in rows:
        if "error" in r:
            lines.append(f"{r['backend']:<24}  ERROR {r['error']}")
            continue
        total = r["param_bytes"] + r["grad_bytes"] + r["optim_bytes"]
        ratio = f"{total / ddp_total:.3f}" if ddp_total else "-"
        zero = M.zero_model_state_bytes(r["psi"], n, sharded=r["backend"] != DDP)
        lines.append(
            f"{r['backend']:<24}{r['step_ms']:>9.1f}{tokens / (r['step_ms'] / 1e3):>9.0f}"
            f"{_mib(r['param_bytes']):>9}{_mib(r['grad_bytes']):>9}{_mib(r['optim_bytes']):>9}"
            f"{_mib(total):>9}{ratio:>7}{_mib(zero):>9}{_mib(r.get('ag_bytes_per_step')):>9}"
            f"{_mib(r.get('rs_bytes_per_step')):>9}{_mib(r.get('ar_bytes_per_step')):>9}"
            f"{_mib(r['rss_growth_bytes']):>10}{r['last_loss']:>11.6f}")
    return lines


def format_details(rows: list[dict], n: int) -> list[str]:
    """Exact bytes, collective counts and loss agreement under the table."""
    ok = [r for r in rows if "error" not in r]
    if not ok:
        return []
    psi = ok[0]["psi"]
    lines = [f"Psi = {psi} parameters (tied embedding counted once); ZeRO fp32 AdamW per rank: "
             f"16*Psi/N = {M.zero_model_state_bytes(psi, n, True)} B sharded, "
             f"16*Psi = {M.zero_model_state_bytes(psi, n, False)} B replicated"]
    for r in ok:
        total = r["param_bytes"] + r["grad_bytes"] + r["optim_bytes"]
        zero = M.zero_model_state_bytes(psi, n, sharded=r["backend"] != DDP)
        extra = ""
        if "ag_calls_per_step" in r:
            extra = (f"; all_gather {r['ag_calls_per_step']:g} calls {r['ag_bytes_per_step']:.0f} B/step, "
                     f"reduce_scatter {r['rs_calls_per_step']:g} calls {r['rs_bytes_per_step']:.0f} B/step")
        lines.append(f"  {r['backend']:<24} model state {total} B = params {r['param_bytes']} + grads "
                     f"{r['grad_bytes']} + optim {r['optim_bytes']}; measured/ZeRO = {total / zero:.4f}{extra}")
        lines += [f"  {r['backend']:<24} note from torch: {note}" for note in r.get("notes", [])]
    ddp = next((r for r in ok if r["backend"] == DDP), None)
    if ddp is not None:
        diffs = ", ".join(f"{r['backend']} {abs(r['last_loss'] - ddp['last_loss']):.2e}"
                          for r in ok if r is not ddp)
        lines.append(f"  |last loss - DDP last loss|: {diffs or '-'}")
    lines.append("  loss first -> last step: " + ", ".join(
        f"{r['backend']} {r['first_loss']:.6f} -> {r['last_loss']:.6f}" for r in ok))
    lines.append(f"  RSS method: {ok[0]['rss_method']}")
    return lines


def run(args: argparse.Namespace) -> int:
    import torch

    cfg = bench_config(args)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    print(f"fullshard.bench.compare: torch {torch.__version__}, {cores} CPU cores, gloo; arch {cfg.arch}, "
          f"V={cfg.vocab_size}, T={cfg.seq_len_tokens}, batch {cfg.batch_size_per_rank}/rank, AdamW "
          f"lr={cfg.lr} wd={cfg.weight_decay}, {cfg.warmup_steps} warm-up + {cfg.timed_steps} timed steps, "
          f"seed {cfg.seed}", flush=True)
    ours_ok, summary, t_all = True, [], time.perf_counter()
    for n in args.world_sizes:
        t0 = time.perf_counter()
        print(f"\n=== N = {n} ranks ===", flush=True)
        load0 = os.getloadavg()[0]
        try:
            results = launch(cfg, n)
        except Exception as e:
            print(f"LAUNCH FAILED: {e}", flush=True)
            ours_ok = False
            continue
        rows = merge_rows(results)
        print(f"threads per rank: {results[0]['threads']}; load average (1 min) before/after: "
              f"{load0:.2f}/{os.getloadavg()[0]:.2f}")
        print("\n".join(format_table(rows, n, cfg) + format_details(rows, n)))
        print(f"N = {n} took {time.perf_counter() - t0:.1f} s", flush=True)
        ours_ok &= all("error" not in r for r in rows if r["backend"] in OURS)
        summary += [(n, r) for r in rows if "error" not in r]
    print("\n=== per-rank model state (params + grads + optimizer state), bytes ===")
    for n, r in summary:
        total = r["param_bytes"] + r["grad_bytes"] + r["optim_bytes"]
        zero = M.zero_model_state_bytes(r["psi"], n, sharded=r["backend"] != DDP)
        print(f"N={n} {r['backend']:<24} measured {total:>11}  ZeRO {zero:>11}")
    print(f"total wall time: {time.perf_counter() - t_all:.1f} s; fullshard "
          f"{'ran' if ours_ok else 'FAILED'}", flush=True)
    return 0 if ours_ok else 1


def main(argv=None) -> None:
    sys.exit(run(parse_args(argv)))


if __name__ == "__main__":
    main()
