"""Step time and peak memory per rank of pp=2 x dp=2 against dp=4 (docs/pipeline.md): the same GPT,
initialization, global batch and AdamW, trained by `fullshard train`'s Trainer on 4 gloo CPU ranks,
each configuration in 4 fresh processes (so a rank's peak is that configuration's alone):

- dp=4, ``fully_shard`` (--fsdp-version 2, one unit per block and the root), B sequences per rank;
- dp=4, torch DDP (--ddp-backend c10d), B sequences per rank;
- pp=2 x dp=2, 1F1B, 2B sequences per pipeline in M pipeline micro-batches, ``fully_shard`` stages,
  in each gradient accumulation mode (``reduce_scatter``, ``unsharded``).

Measured as `fullshard bench` measures (fullshard.bench.measure): a barrier before each step, step
time the median of the timed steps after the warm-up ones (max over ranks in the ratios), peak
memory the rank's resident high-water mark (VmHWM, reset just before the Trainer is built) minus its
resident set then (after a throwaway model's step: imports and torch's one-time set-up are not
counted); model state is the rank's parameter, gradient and optimizer-state storages after the last
step (the trainer has freed the gradients by then). The load average before and after is printed:
the ranks share the machine's cores, so read the ratios of a quiet run. Every configuration trains
on the same global batches, so their per-step losses (summed over the world) must agree; the largest
difference to dp=4 fully_shard's is printed.

    PYTHONPATH=src python examples/pipeline_bench.py [--microbatches 4] [--timed-steps 5]
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import tempfile
import time

import torch
import torch.distributed as dist

WORLD = 4
CONFIGS = (("dp=4 fully_shard", {}),
           ("dp=4 torch DDP", dict(ddp_backend="c10d")),
           ("pp=2 x dp=2 reduce_scatter", dict(pipeline_parallel_size=2, pipeline_grad_accumulation="reduce_scatter")),
           ("pp=2 x dp=2 unsharded", dict(pipeline_parallel_size=2, pipeline_grad_accumulation="unsharded")))


def _global_batch(step: int, args) -> torch.Tensor:
    """The step's (4B, T + 1) int64 token rows, the same in every configuration."""
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randint(0, args.vocab_size, (WORLD * args.batch_size, args.tokens + 1), generator=g)


def _rank(rank, init, over, args, results):
    try:
        _train(rank, init, over, args, results)
    except BaseException as e:  # the parent stops the other ranks (blocked in a collective)
        results.put((rank, None, f"rank {rank}: {type(e).__name__}: {e}"))
        raise


def _train(rank, init, over, args, results):
    from fullshard.bench import measure
    from fullshard.bench.rank import warm_up_torch
    from fullshard.models import ARCHS
    from fullshard.train.config import TrainConfig
    from fullshard.train.trainer import Trainer

    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=WORLD)
    p = over.get("pipeline_parallel_size", 1)
    dp = WORLD // p
    pipe = dict(pipeline_schedule="1F1B", pipeline_microbatches=args.microbatches) if p > 1 else {}
    cfg = TrainConfig(data_dir="unused", arch=args.arch, max_positions=max(ARCHS[args.arch].max_positions, args.tokens),
                      vocab_size=args.vocab_size, tokens_per_sample=args.tokens,
                      batch_size=WORLD * args.batch_size // dp, lr=1e-3, seed=1, fsdp_version=2,
                      fp16_scale_window=4, threads_per_rank=args.threads, **pipe, **over)
    warm_up_torch()  # one-time imports and set-up, before the memory baseline (as `fullshard bench`)
    rss = measure.PeakRSS()
    rss.start()
    trainer = Trainer(cfg, torch.device("cpu"))
    times, losses = [], []
    for step in range(args.warmup_steps + args.timed_steps):
        rows = _global_batch(step, args).chunk(dp)[rank % dp]  # a pipeline's ranks read the same rows
        dist.barrier()
        t0 = time.perf_counter()
        out = trainer.train_step([(rows[:, :-1].contiguous(), rows[:, 1:].contiguous())])
        if step >= args.warmup_steps:
            times.append(time.perf_counter() - t0)
        losses.append(out["loss_sum"] / out["ntokens"])
    model = trainer.model
    state = measure.param_bytes(model) + measure.grad_bytes(model) + measure.optim_state_bytes(trainer.optimizer)
    results.put((rank, statistics.median(times), rss.growth_bytes(), state, losses))
    dist.barrier()
    dist.destroy_process_group()


def measure_config(over: dict, args) -> list:
    """[(rank, median step s, RSS peak growth bytes, model state bytes, losses)] by rank."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        procs = [ctx.Process(target=_rank, args=(r, os.path.join(tmp, "init"), over, args, results))
                 for r in range(WORLD)]
        for proc in procs:
            proc.start()
        out = []
        try:
            for _ in procs:
                out.append(results.get(timeout=1800))
                if out[-1][1] is None:
                    raise SystemExit(f"pipeline_bench: {over or 'dp=4'} failed: {out[-1][2]}")
        finally:
            for proc in procs:
                if out and out[-1][1] is None:
                    proc.terminate()
                proc.join()
    return sorted(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", default="transformer_lm_gpt_tiny")
    parser.add_argument("--vocab-size", type=int, default=50257)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=2, help="sequences per rank at dp=4 (global: 4x)")
    parser.add_argument("--microbatches", type=int, default=4, help="pipeline micro-batches at pp=2")
    parser.add_argument("--warmup-steps", type=int, default=2)
    parser.add_argument("--timed-steps", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads per rank")
    args = parser.parse_args()
    print(f"{args.arch}, V={args.vocab_size}, T={args.tokens}, global batch {WORLD * args.batch_size} sequences; "
          f"4 gloo ranks x {args.threads} thread(s); pp=2: 1F1B, {args.microbatches} pipeline micro-batches; "
          f"{args.warmup_steps} warm-up + {args.timed_steps} timed steps")
    load = os.getloadavg()
    runs = {name: measure_config(over, args) for name, over in CONFIGS}
    print(f"load average (1, 5, 15 min) before: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}; after: "
          + " ".join(f"{x:.2f}" for x in os.getloadavg()))
    base = runs[CONFIGS[0][0]]
    base_ms = max(r[1] for r in base) * 1e3
    base_rss = max(r[2] for r in base) / 2**20
    print("| configuration | step ms (median, max over ranks) | vs dp=4 fully_shard | RSS peak MiB per rank "
          "(rank 0, 1, 2, 3) | max RSS peak vs dp=4 fully_shard | model state MiB per rank | max loss diff |")
    print("|---|---|---|---|---|---|---|")
    for name, ranks in runs.items():
        ms, rss = max(r[1] for r in ranks) * 1e3, [r[2] / 2**20 for r in ranks]
        diff = max(abs(a - b) for r, b0 in zip(ranks, base) for a, b in zip(r[4], b0[4]))
        print(f"| {name} | {ms:.0f} | {ms / base_ms:.2f} | {', '.join(f'{x:.0f}' for x in rss)} | "
              f"{max(rss) / base_rss:.2f} | {', '.join(f'{r[3] / 2**20:.1f}' for r in ranks)} | {diff:.1e} |")


if __name__ == "__main__":
    main()
