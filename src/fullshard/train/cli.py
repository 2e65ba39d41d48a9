"""The `fullshard` console script: ``preprocess``, ``train``, ``eval-lm``, ``generate``,
``consolidate``, ``plan``, ``bench`` and ``plot`` subcommands.

    fullshard preprocess --builtin-corpus --destdir data-bin/wiki
    fullshard train data-bin/wiki --nproc-per-node 2 --arch transformer_lm_gpt_tiny ...
    fullshard eval-lm data-bin/wiki --path checkpoints/tiny/checkpoint_last --nproc-per-node 2
    fullshard generate --path checkpoints/tiny/checkpoint_last --prompt "The city" --top-p 0.9
    fullshard consolidate checkpoints/tiny/checkpoint_last model.safetensors
    fullshard plan --arch transformer_lm_gpt3_xl --world-size 8 --bf16 --budget-gb 16
    fullshard plan --arch transformer_lm_gpt3_medium --decoder-layers 30 --world-size 8 --bf16
    fullshard bench --preset quick --out-dir bench-results
    fullshard plot run_a.log run_b.log -o curve.png

Exit codes: 0 success, 1 a rank failed while training or evaluating (bench: a
fullshard mode failed), 2 bad input.
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import Optional, Sequence

from fullshard.train.options import (OneLineArgumentParser, add_arch_override_args, add_train_args,
                                     check_tokens_per_sample, resolve_arch, validate)


def _build_parser() -> argparse.ArgumentParser:
    parser = OneLineArgumentParser(prog="fullshard", description="Fully Sharded Data Parallel GPT training.")
    sub = parser.add_subparsers(dest="command",
                                metavar="{preprocess,train,eval-lm,generate,consolidate,plan,bench,plot}",
                                parser_class=OneLineArgumentParser)
    sub.required = True
    from fullshard.data import preprocess_cli

    pre = sub.add_parser("preprocess", help="tokenize text into a data directory")
    preprocess_cli.add_args(pre)
    train = sub.add_parser("train", help="train a GPT language model")
    add_train_args(train)
    from fullshard.train import eval_lm, generate

    eval_lm.add_args(sub.add_parser("eval-lm", help="loss and perplexity of a split under a checkpoint"))
    generate.add_args(sub.add_parser("generate", help="sample text from a checkpoint"))
    cons = sub.add_parser("consolidate", help="write a checkpoint's model as one .safetensors / .pt file")
    cons.add_argument("checkpoint", metavar="CHECKPOINT_DIR", help="a directory written by fullshard.checkpoint.save")
    cons.add_argument("out", metavar="OUT", help="output file ending in .safetensors (streamed) or .pt")
    plan = sub.add_parser("plan", help="per-rank memory of a training configuration; what fits a budget")
    _add_plan_args(plan)
    from fullshard.bench import suite

    suite.add_args(sub.add_parser("bench", help="fullshard vs torch DDP / FSDP (and DeepSpeed): speed, memory, "
                                                "communication"))
    plot = sub.add_parser("plot", help="plot loss curves from training logs")
    plot.add_argument("logs", nargs="+", metavar="LOG", help="json or simple logs of `fullshard train`")
    plot.add_argument("-o", "--output", default="curve.png", help="image file to write (default: %(default)s)")
    plot.add_argument("--title", default="", help="chart title")
    return parser


def _add_plan_args(p: argparse.ArgumentParser) -> None:
    from fullshard.models.config import ARCHS

    p.add_argument("--arch", required=True, choices=sorted(ARCHS), metavar="ARCH",
                   help="a named GPT (see `fullshard train --help`)")
    add_arch_override_args(p)
    p.add_argument("--world-size", type=int, required=True, help="N, data-parallel ranks")
    p.add_argument("--sharding-strategy", default="FULL_SHARD",
                   choices=["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"])
    p.add_argument("--bf16", action="store_true", help="bf16 compute, fp32 master shards")
    p.add_argument("--fp16", action="store_true", help="fp16 compute, fp32 master shards")
    p.add_argument("--cpu-offload", action="store_true")
    p.add_argument("--checkpoint-activations", action="store_true")
    p.add_argument("--batch-size", type=int, default=8, help="sequences per rank")
    p.add_argument("--tokens-per-sample", type=int, default=1024)
    p.add_argument("--vocab-size", type=int, default=50257)
    p.add_argument("--budget-gb", type=float, help="list every configuration fitting this many GB per rank")


def _plan(parser: argparse.ArgumentParser, args) -> int:
    import torch

    from fullshard.api import ShardingStrategy
    from fullshard.bench import plan as PL

    sub = _parsers(parser)["plan"]
    for name in ("world_size", "batch_size", "tokens_per_sample", "vocab_size"):
        if getattr(args, name) < 1:
            sub.fail(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.bf16 and args.fp16:
        sub.fail("--bf16 and --fp16 are exclusive; pick one")
    if args.budget_gb is not None and args.budget_gb <= 0:
        sub.fail(f"--budget-gb must be > 0, got {args.budget_gb}")
    try:
        shape = resolve_arch(args.arch, vars(args))
    except ValueError as e:
        sub.fail(str(e))
    positions = check_tokens_per_sample(sub, args)  # the position table `fullshard train` builds
    work = PL.gpt_workload(shape, args.batch_size, args.tokens_per_sample, args.vocab_size, max_positions=positions)
    dtype = torch.bfloat16 if args.bf16 else torch.float16 if args.fp16 else torch.float32
    cfg = PL.Config(ShardingStrategy[args.sharding_strategy], args.world_size, dtype, args.cpu_offload,
                    args.checkpoint_activations)
    print(PL.format_plan(work, cfg, PL.plan(work, cfg)))
    if args.budget_gb is not None:
        fits = PL.fitting(work, args.world_size, args.budget_gb * 1e9)
        print(f"configurations fitting {args.budget_gb:g} GB per rank, expected fastest first:"
              + ("" if fits else " none"))
        for c, est in fits:
            print(f"  {est['device_total'] / 1e9:8.3f} GB  {c.label()}")
    return 0


def _bench(parser: argparse.ArgumentParser, args) -> int:
    from fullshard.bench import suite

    return suite.run(suite.validate(args, _parsers(parser)["bench"].fail))


def _parsers(parser: argparse.ArgumentParser) -> dict:
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return action.choices


def _launch(command: str, job, entry) -> int:
    """Run ``entry(job)`` on every rank; a failed rank or launch is one stderr line and exit code 1."""
    from fullshard.train.launcher import LaunchError, RankFailed, launch

    try:
        launch(job, entry)
    except (RankFailed, LaunchError) as e:
        sys.stderr.write(f"fullshard {command}: error: {e}\n")
        return 1
    return 0


def _train(parser: argparse.ArgumentParser, args) -> int:
    from fullshard.train.loop import train_main

    return _launch("train", validate(_parsers(parser)["train"], args), train_main)


def _eval_lm(parser: argparse.ArgumentParser, args) -> int:
    from fullshard.train.eval_lm import eval_main, prepare

    return _launch("eval-lm", prepare(_parsers(parser)["eval-lm"], args), eval_main)


def _consolidate(parser: argparse.ArgumentParser, args) -> int:
    from fullshard.checkpoint import CheckpointError
    from fullshard.checkpoint.consolidate import consolidate

    try:
        r = consolidate(args.checkpoint, args.out)
    except (CheckpointError, ValueError) as e:
        _parsers(parser)["consolidate"].fail(str(e))
    print(f"wrote {args.out}: {r['tensors']} tensors, {r['bytes'] / 2**20:.1f} MiB in {r['seconds']:.2f} s; "
          f"largest tensor {r['largest_tensor_bytes'] / 2**20:.1f} MiB, peak memory +{r['peak_rss_bytes'] / 2**20:.1f} MiB")
    return 0


def _plot(parser: argparse.ArgumentParser, args) -> int:
    from fullshard.train.plot import LogError, plot

    try:
        out = plot(args.logs, args.output, args.title)
    except LogError as e:
        _parsers(parser)["plot"].fail(str(e))
    print(f"wrote {out}")
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Console-script entry point; returns the process exit code.

    A reader that closes stdout early (``fullshard plan ... | head``) ends the
    command quietly with exit code 1, as Python's documentation advises
    (library/signal, "Note on SIGPIPE"), instead of a BrokenPipeError traceback.
    """
    try:
        code = _main(argv)
        sys.stdout.flush()  # inside the try: a closed pipe fails here, not at interpreter exit
        return code
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # the exit-time flush must not fail again
        return 1


def _main(argv: Optional[Sequence[str]]) -> int:
    parser = _build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:
        _parsers(parser)[args.command].error(f"unrecognized arguments: {' '.join(extra)}")
    if args.command == "preprocess":
        from fullshard.data import preprocess_cli

        return int(preprocess_cli.run(args) or 0)
    if args.command == "train":
        return _train(parser, args)
    if args.command == "eval-lm":
        return _eval_lm(parser, args)
    if args.command == "generate":
        from fullshard.train import generate

        return generate.run(_parsers(parser)["generate"], args)
    if args.command == "consolidate":
        return _consolidate(parser, args)
    if args.command == "plan":
        return _plan(parser, args)
    if args.command == "bench":
        return _bench(parser, args)
    return _plot(parser, args)


if __name__ == "__main__":
    sys.exit(main())
