"""The `fullshard` console script: ``preprocess``, ``train``, ``eval-lm``, ``generate``,
``consolidate``, ``plan``, ``bench`` and ``plot`` subcommands.

    fullshard preprocess --builtin-corpus --destdir data-bin/wiki
    fullshard train data-bin/wiki --nproc-per-node 2 --arch transformer_lm_gpt_tiny ...
    fullshard eval-lm data-bin/wiki --path checkpoints/tiny/checkpoint_last --nproc-per-node 2
    fullshard generate --path checkpoints/tiny/checkpoint_last --prompt "The city" --top-p 0.9
    fullshard consolidate checkpoints/tiny/checkpoint_last model.safetensors
    fullshard plan --arch transformer_lm_gpt3_xl --world-size 8 --bf16 --budget-gb 16
    fullshard plan --arch transformer_lm_gpt3_medium --decoder-layers 30 --world-size 8 --bf16
    fullshard plan --arch transformer_lm_gpt3_small --world-size 1 --pipeline-parallel-size 2
    fullshard bench --preset quick --out-dir bench-results
    fullshard plot run_a.log run_b.log -o curve.png

Exit codes: 0 success, 1 a rank failed while training or evaluating (bench: a
fullshard mode failed), 2 bad input, 128 + N stopped by signal N (143: SIGTERM,
after saving checkpoint_last with ``train --save-on-sigterm``).

The top floor: it imports ``train/`` and ``bench/`` (which never import each
other's commands back: ``train/`` never imports ``bench/``); nothing imports it.
"""
from __future__ import annotations

# Imports: the project's own modules at the top of the file; a lazy import only for an optional
# dependency or for start-up speed (here: consolidate's torch.distributed.checkpoint, about 0.7 s).
import argparse
import os
import signal
import sys
from typing import Optional, Sequence

import torch

from fullshard.bench import lora, suite
from fullshard.data import preprocess_cli
from fullshard.train import eval_lm, generate, pipeline_plan_cli, plan
from fullshard.train.launcher import Interrupted, LaunchError, RankFailed, launch
from fullshard.train.loop import train_main
from fullshard.train.options import OneLineArgumentParser, add_train_args, under_torchrun, validate
from fullshard.train.plot import LogError, plot
from fullshard.train.sigterm import StoppedBySigterm


def _build_parser() -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    """The ``fullshard`` parser and its subcommands' parsers by name."""
    parser = OneLineArgumentParser(prog="fullshard", description="Fully Sharded Data Parallel GPT training.")
    sub = parser.add_subparsers(dest="command",
                                metavar="{preprocess,train,eval-lm,generate,consolidate,plan,bench,plot}",
                                parser_class=OneLineArgumentParser)
    sub.required = True
    preprocess_cli.add_args(sub.add_parser("preprocess", help="tokenize text into a data directory"))
    add_train_args(sub.add_parser("train", help="train a GPT language model"))
    eval_lm.add_args(sub.add_parser("eval-lm", help="loss and perplexity of a split under a checkpoint"))
    generate.add_args(sub.add_parser("generate", help="sample text from a checkpoint"))
    cons = sub.add_parser("consolidate", help="write a checkpoint's model as one .safetensors / .pt file")
    cons.add_argument("checkpoint", metavar="CHECKPOINT_DIR",
                      help="a directory written by fullshard.checkpoint.save, or by torch.distributed.checkpoint.save "
                           "of {'model': model_state_dict, ...}")
    cons.add_argument("out", metavar="OUT", help="output file ending in .safetensors (streamed) or .pt")
    plan_parser = sub.add_parser("plan", help="per-rank memory of a training configuration; what fits a budget; "
                                              "balanced pipeline stages")
    plan.add_args(plan_parser)
    pipeline_plan_cli.add_args(plan_parser)
    suite.add_args(sub.add_parser("bench", help="fullshard vs torch DDP / FSDP (and DeepSpeed): speed, memory, "
                                                "communication"))
    plot_parser = sub.add_parser("plot", help="plot loss curves from training logs")
    plot_parser.add_argument("logs", nargs="+", metavar="LOG", help="json or simple logs of `fullshard train`")
    plot_parser.add_argument("-o", "--output", default="curve.png", help="image file to write (default: %(default)s)")
    plot_parser.add_argument("--title", default="", help="chart title")
    return parser, sub.choices


def _launch(command: str, job, entry) -> int:
    """Run ``entry(job)`` on every rank; a failed rank or launch is one stderr line and exit code 1;
    a stop by a signal (the launcher's, or the ranks' SIGTERM under --save-on-sigterm) one line and
    128 + the signal's number."""
    try:
        results = launch(job, entry)
    except (RankFailed, LaunchError) as e:
        sys.stderr.write(f"fullshard {command}: error: {e}\n")
        return 1
    except Interrupted as e:
        # Ranks save only on SIGTERM (train/sigterm.py); a Ctrl-C stops them without a save.
        saved = " after the ranks saved checkpoint_last" if command == "train" and job.save_on_sigterm and \
            e.signal == signal.SIGTERM else ""
        sys.stderr.write(f"fullshard {command}: {e}{saved}; the same command resumes from the last checkpoint\n")
        return 128 + e.signal
    stops = [r for r in results if isinstance(r, StoppedBySigterm)]
    if stops:
        sys.stderr.write(f"fullshard {command}: stopped by SIGTERM after saving checkpoint_last at update "
                         f"{stops[0].update}; the same command resumes from it\n")
        return 128 + signal.SIGTERM
    return 0


def _consolidate(p: OneLineArgumentParser, args) -> int:
    from fullshard.checkpoint import CheckpointError  # lazy: start-up speed (see the top)
    from fullshard.checkpoint.consolidate import consolidate
    from fullshard.train import checkpoint_record

    try:
        problem = checkpoint_record.nf4_problem(args.checkpoint, None) if os.path.isdir(args.checkpoint) else None
        if problem is not None:
            raise ValueError(problem)
        r = consolidate(args.checkpoint, args.out)
    except (CheckpointError, OSError, ValueError) as e:
        p.fail(str(e))
    print(f"wrote {args.out}: {r['tensors']} tensors, {r['bytes'] / 2**20:.1f} MiB in {r['seconds']:.2f} s; "
          f"largest tensor {r['largest_tensor_bytes'] / 2**20:.1f} MiB, peak memory "
          f"+{r['peak_rss_bytes'] / 2**20:.1f} MiB")
    return 0


def _plot(p: OneLineArgumentParser, args) -> int:
    try:
        out = plot(args.logs, args.output, args.title)
    except LogError as e:
        p.fail(str(e))
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
    parser, subcommands = _build_parser()
    args, extra = parser.parse_known_args(argv)
    sub = subcommands[args.command]
    if extra:
        sub.error(f"unrecognized arguments: {' '.join(extra)}")
    if args.command == "preprocess":
        return int(preprocess_cli.run(args) or 0)
    rank_env = ("RANK", "WORLD_SIZE", "LOCAL_RANK")
    missing = [k for k in rank_env if not os.environ.get(k)]  # an empty value is not set either
    if args.command in ("train", "eval-lm", "bench") and 0 < len(missing) < 3:
        # Without all three this process would launch its own ranks: an independent job per process.
        sub.error(f"{', '.join(k for k in rank_env if k not in missing)} set but not {', '.join(missing)}: set "
                  "all three as torchrun does (with MASTER_ADDR and MASTER_PORT), or none to let fullshard "
                  "launch the ranks")
    if args.command in ("train", "eval-lm", "bench") and not under_torchrun():
        # This process only launches the ranks. With one intra-op thread it never starts OpenMP's
        # thread pool, which does not survive a fork: a rank forked from it (--start-method fork)
        # would hang in its first parallel region.
        torch.set_num_threads(1)
    if args.command == "train":
        return _launch("train", validate(sub, args), train_main)
    if args.command == "eval-lm":
        return _launch("eval-lm", eval_lm.prepare(sub, args), eval_lm.eval_main)
    if args.command == "generate":
        return generate.run(sub, args)
    if args.command == "consolidate":
        return _consolidate(sub, args)
    if args.command == "plan":
        pipelined = args.pipeline_parallel_size is not None and not args.hf_model  # plan_hf refuses it
        return (pipeline_plan_cli.run if pipelined else plan.run)(sub, args)
    if args.command == "bench":
        if args.lora:
            return lora.run(lora.job_from_args(args, sub.fail))
        return suite.run(suite.validate(args, sub.fail))
    return _plot(sub, args)


if __name__ == "__main__":
    sys.exit(main())
