"""Cost of the gradient reductions world-size invariance could use, on this machine.

``python -m fullshard.bench.reductions [--ranks 2] [--numel 1048576 8388608] [--out FILE]``
times, per backward of one unit with a ``numel``-element fp32 gradient:

* ``reduce-scatter``: the default path (core/collectives.py: all-to-all, then
  a sum of the N received blocks);
* ``ordered fold``: world_size_invariant's path (core/invariant.py: the same
  all-to-all, then N ordered adds onto the gradient shard);
* ``fixed point``: the order-independent alternative (Demmel & Nguyen 2015):
  a global maximum (one all-reduce), each element cut into
  ``invariant.LIMBS`` int64 limbs, the limbs all-to-all'd and summed as
  integers, then turned back into fp32.

Each is the median of ``--repeat`` runs after one warm-up, on ``--ranks``
gloo ranks of this machine with one thread each; the bytes column is what
one rank sends. Prints a Markdown table (and writes it to ``--out``).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from fullshard.core import collectives, invariant


def _reduce_scatter(full: torch.Tensor, world: int) -> torch.Tensor:
    out = torch.empty(full.numel() // world)
    collectives.reduce_scatter(out, full, collectives.world_group(), async_op=False)
    return out


def _ordered_fold(full: torch.Tensor, world: int) -> torch.Tensor:
    recv = torch.empty_like(full)
    collectives.all_to_all(recv, full, collectives.world_group(), async_op=False)
    acc = torch.zeros(full.numel() // world)
    for piece in recv.view(world, -1):
        acc.add_(piece)
    return acc


def _fixed_point(full: torch.Tensor, world: int) -> torch.Tensor:
    peak = full.abs().max().reshape(1)
    collectives.all_reduce(peak, collectives.world_group(), "max")
    # Headroom for the sum of `world` values: one bit per doubling.
    exponent = int(torch.frexp(peak).exponent) + max(1, (world - 1).bit_length())
    rest = torch.ldexp(full.double(), torch.tensor(-exponent, dtype=torch.float64))
    limbs = torch.empty(invariant.LIMBS, full.numel(), dtype=torch.int64)
    for k in range(invariant.LIMBS):
        rest = rest * float(2 ** invariant.LIMB_BITS)
        digit = torch.floor(rest)
        rest = rest - digit
        limbs[k] = digit.to(torch.int64)
    send = limbs.view(invariant.LIMBS, world, -1).transpose(0, 1).contiguous().view(-1)
    recv = torch.empty_like(send)
    collectives.all_to_all(recv, send, collectives.world_group(), async_op=False)
    summed = recv.view(world, invariant.LIMBS, -1).sum(dim=0)  # integer adds: exact in any order
    value = torch.zeros(summed.size(1), dtype=torch.float64)
    for k in range(invariant.LIMBS):  # most significant first; rounded to fp32 once at the end
        value += torch.ldexp(summed[k].double(), torch.tensor(
            float(exponent - (k + 1) * invariant.LIMB_BITS), dtype=torch.float64))
    return value.float()


PATHS = {"reduce-scatter": (_reduce_scatter, 1), "ordered fold": (_ordered_fold, 1),
         "fixed point": (_fixed_point, 2 * invariant.LIMBS)}
"""name -> (function, bytes sent relative to the fp32 gradient)."""


def _rank(rank: int, world: int, init_file: str, numels: list, repeat: int, queue) -> None:
    torch.set_num_threads(1)
    os.environ.setdefault("FULLSHARD_COLLECTIVES", "all_to_all")
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    rows = []
    for numel in numels:
        full = torch.randn(numel, generator=torch.Generator().manual_seed(rank))
        for name, (fn, scale) in PATHS.items():
            times = []
            for i in range(repeat + 1):
                dist.barrier()
                start = time.perf_counter()
                fn(full, world)
                if i:
                    times.append(time.perf_counter() - start)
            rows.append((numel, name, statistics.median(times), numel * 4 * scale * (world - 1) // world))
    dist.destroy_process_group()
    if rank == 0:
        queue.put(rows)


def run(world: int, numels: list, repeat: int, context=None) -> str:
    """Time the paths on ``world`` local ranks; returns the Markdown table. ``context``: the
    multiprocessing context the ranks start from (default: spawn)."""
    ctx = context or mp.get_context("spawn")
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "init")
        procs = [ctx.Process(target=_rank, args=(r, world, init_file, numels, repeat, queue)) for r in range(world)]
        for p in procs:
            p.start()
        rows = queue.get(timeout=600)
        for p in procs:
            p.join()
    lines = [f"{world} gloo ranks, 1 thread each, torch {torch.__version__}, median of {repeat}",
             "", "| gradient | path | time per backward | x reduce-scatter | bytes sent per rank |",
             "|---|---|---|---|---|"]
    base = {numel: t for numel, name, t, _ in rows if name == "reduce-scatter"}
    for numel, name, seconds, nbytes in rows:
        lines.append(f"| {numel * 4 / 2**20:.0f} MiB fp32 | {name} | {seconds * 1e3:.1f} ms | "
                     f"{seconds / base[numel]:.2f} | {nbytes / 2**20:.1f} MiB |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fullshard.bench.reductions", description=__doc__.split("\n")[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--numel", type=int, nargs="+", default=[2**18, 2**21])
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--out", default=None, help="also write the table here")
    args = parser.parse_args(argv)
    if args.ranks < 2 or any(n % args.ranks for n in args.numel) or args.repeat < 1:
        parser.error("--ranks must be >= 2, every --numel a multiple of it, --repeat >= 1")
    table = run(args.ranks, args.numel, args.repeat)
    sys.stdout.write(table)
    if args.out:
        tmp = args.out + ".tmp"
        with open(tmp, "w") as f:
            f.write(table)
        os.replace(tmp, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
