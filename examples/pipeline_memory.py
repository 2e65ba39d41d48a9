"""Measure the two pipeline gradient-accumulation modes (docs/pipeline.md): per rank, the bytes
fullshard's collectives put on the wire in one update and the peak of the bytes its units hold
(``fullshard.memory_stats``: shards, gathered parameters, unsharded and stashed gradients, the
buffer pool in use), sampled after every pipeline micro-batch's backward; and the process's peak
resident memory. pp=2 x dp=2 on 4 gloo CPU ranks, 1F1B, the trainer's own pipeline.

    PYTHONPATH=src .venv/bin/python examples/pipeline_memory.py [--microbatches 4] [--width 256]
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import resource
import tempfile

import torch
import torch.distributed as dist


def _rank(rank, world, init, mode, args, results):
    from fullshard.core import collectives
    from fullshard.memory import memory_stats, memory_totals
    from fullshard.models import ARCHS
    from fullshard.train.config import TrainConfig
    from fullshard.train.trainer import Trainer

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    arch = "transformer_lm_gpt_mini"
    cfg = TrainConfig(data_dir="unused", arch=arch, decoder_layers=4, decoder_embed_dim=args.width,
                      max_positions=ARCHS[arch].max_positions, vocab_size=512, tokens_per_sample=args.tokens,
                      batch_size=args.batch_size, lr=1e-3, seed=1, fp16_scale_window=4, pipeline_parallel_size=2,
                      pipeline_schedule="1F1B", pipeline_microbatches=args.microbatches,
                      pipeline_grad_accumulation=mode)
    trainer = Trainer(cfg, torch.device("cpu"))
    peak = {"bytes": 0}
    keys = ("sharded_bytes", "unsharded_bytes", "full_grad_bytes", "stashed_grad_bytes", "pool_in_use_bytes")
    for stage in trainer.pipeline.schedule._stages if hasattr(trainer.pipeline.schedule, "_stages") \
            else [trainer.pipeline.schedule._stage]:
        backward = stage.backward_maybe_with_nosync

        def sampled(*a, _backward=backward, **kw):
            out = _backward(*a, **kw)
            totals = memory_totals(memory_stats(trainer.model))
            peak["bytes"] = max(peak["bytes"], sum(totals[k] for k in keys))
            return out
        stage.backward_maybe_with_nosync = sampled
    g = torch.Generator().manual_seed(rank % 2)

    def batch():
        tok = torch.randint(0, 512, (args.batch_size, args.tokens + 1), generator=g)
        return [(tok[:, :-1].contiguous(), tok[:, 1:].contiguous())]

    trainer.train_step(batch())  # warm-up: buffers, optimizer state
    collectives.reset_counts()
    peak["bytes"] = 0
    trainer.train_step(batch())
    wire = dict(collectives.BYTES)
    counts = dict(collectives.COUNTS)
    rss_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    results.put((rank, wire, counts, peak["bytes"], rss_kib))
    dist.destroy_process_group()


def measure(mode: str, args) -> list:
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        procs = [ctx.Process(target=_rank, args=(r, 4, os.path.join(tmp, "init"), mode, args, results))
                 for r in range(4)]
        for p in procs:
            p.start()
        out = sorted(results.get(timeout=600) for _ in procs)
        for p in procs:
            p.join()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=8)
    args = parser.parse_args()
    print(f"GPT mini, 4 layers, width {args.width}, vocab 512, T={args.tokens}; pp=2 x dp=2, 1F1B, "
          f"{args.microbatches} pipeline micro-batches of {args.batch_size // args.microbatches} sequences")
    print("| mode | rank | reduce-scatters | reduce-scatter MiB | all-gather MiB | all-reduce MiB | "
          "peak unit memory MiB | peak RSS MiB |")
    print("|---|---|---|---|---|---|---|---|")
    for mode in ("reduce_scatter", "unsharded"):
        for rank, wire, counts, peak, rss in measure(mode, args):
            mib = {k: v / 2**20 for k, v in wire.items()}
            print(f"| {mode} | {rank} | {counts.get('reduce_scatter', 0)} | {mib.get('reduce_scatter', 0):.2f} | "
                  f"{mib.get('all_gather', 0):.2f} | {mib.get('all_reduce', 0):.2f} | {peak / 2**20:.2f} | "
                  f"{rss / 1024:.0f} |")


if __name__ == "__main__":
    main()
