"""The `fullshard` console script: ``preprocess``, ``train``, ``eval-lm``, ``generate``,
``consolidate`` and ``plot`` subcommands.

    fullshard preprocess --builtin-corpus --destdir data-bin/wiki
    fullshard train data-bin/wiki --nproc-per-node 2 --arch transformer_lm_gpt_tiny ...
    fullshard eval-lm data-bin/wiki --path checkpoints/tiny/checkpoint_last --nproc-per-node 2
    fullshard generate --path checkpoints/tiny/checkpoint_last --prompt "The city" --top-p 0.9
    fullshard consolidate checkpoints/tiny/checkpoint_last model.safetensors
    fullshard plot run_a.log run_b.log -o curve.png

Exit codes: 0 success, 1 a rank failed while training or evaluating, 2 bad input.
"""
from __future__ import annotations

import argparse
import sys
from typing import Optional, Sequence

from fullshard.train.options import OneLineArgumentParser, add_train_args, validate


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fullshard", description="Fully Sharded Data Parallel GPT training.")
    sub = parser.add_subparsers(dest="command", metavar="{preprocess,train,eval-lm,generate,consolidate,plot}",
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
    plot = sub.add_parser("plot", help="plot loss curves from training logs")
    plot.add_argument("logs", nargs="+", metavar="LOG", help="json or simple logs of `fullshard train`")
    plot.add_argument("-o", "--output", default="curve.png", help="image file to write (default: %(default)s)")
    plot.add_argument("--title", default="", help="chart title")
    return parser


def _parsers(parser: argparse.ArgumentParser) -> dict:
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return action.choices


def _launch(command: str, job, entry) -> int:
    """Run ``entry(job)`` on every rank; a failed rank is one stderr line and exit code 1."""
    from fullshard.train.launcher import RankFailed, launch

    try:
        launch(job, entry)
    except RankFailed as e:
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
    """Console-script entry point; returns the process exit code."""
    parser = _build_parser()
    args = parser.parse_args(argv)
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
    return _plot(parser, args)


if __name__ == "__main__":
    sys.exit(main())
