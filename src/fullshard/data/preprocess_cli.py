"""The ``fullshard preprocess`` subcommand: argument parsing and exit codes.

The console script (``fullshard.cli``) adds these arguments to its
``preprocess`` subparser and calls :func:`run`.
"""

from __future__ import annotations

import argparse
import sys

from .binarize import preprocess
from .errors import DataError


def add_args(parser: argparse.ArgumentParser) -> None:
    """Adds the preprocess flags (fairseq-preprocess names) to ``parser``."""
    parser.add_argument("--trainpref", metavar="PATH",
                        help="training text: a UTF-8 file or a directory of *.txt files; "
                             "documents are blank-line-separated blocks")
    parser.add_argument("--validpref", metavar="PATH",
                        help="validation text (default: hold out --valid-fraction of train)")
    parser.add_argument("--testpref", metavar="PATH", help="test text")
    parser.add_argument("--destdir", metavar="DIR", required=True,
                        help="output directory for {split}.bin and meta.json")
    parser.add_argument("--builtin-corpus", action="store_true",
                        help="train on the built-in corpus: 10,033 English Wikipedia article "
                             "summaries (CC BY-SA 4.0)")
    parser.add_argument("--valid-fraction", type=float, default=0.01, metavar="F",
                        help="fraction of training documents held out as valid when no "
                             "--validpref is given (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=1,
                        help="seed of the train/valid document split (default: %(default)s)")
    parser.add_argument("--tokenizer", metavar="DIR",
                        help="tokenize with this Hugging Face checkpoint's tokenizer.json (the model "
                             "`fullshard train --hf-model DIR` fine-tunes) instead of GPT-2 BPE")
    parser.add_argument("--workers", type=int, default=1,
                        help="1: sequential encoding; >1: parallel batch encoding "
                             "(default: %(default)s)")


def run(args: argparse.Namespace) -> int:
    """Runs preprocessing from parsed arguments.

    Args:
        args: Namespace from a parser given :func:`add_args`.

    Returns:
        0 on success, 2 on a :class:`DataError` (message on stderr).
    """
    try:
        result = preprocess(args.destdir, trainpref=args.trainpref, validpref=args.validpref,
                            testpref=args.testpref, builtin=args.builtin_corpus,
                            valid_fraction=args.valid_fraction, seed=args.seed,
                            workers=args.workers, tokenizer=args.tokenizer)
    except DataError as e:
        print(f"fullshard preprocess: error: {e}", file=sys.stderr)
        return 2
    meta = result.meta
    if result.cached:
        print(f"{args.destdir} already holds these inputs binarized "
              f"(meta.json fingerprint matches); skipping")
    for split, info in meta["splits"].items():
        print(f"{split}: {info['num_documents']:,} documents, {info['num_tokens']:,} tokens "
              f"-> {args.destdir}/{info['file']}")
    return 0
