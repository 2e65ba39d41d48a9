"""Helpers shared by several end-to-end test modules (test modules import
from here, never from each other): running the CLI, reading its json logs,
loading a checkpoint's parameters."""
from __future__ import annotations

import concurrent.futures
import json
import os
import subprocess
import sys

from fullshard import checkpoint, cli as fullshard_cli
from fullshard.models import ARCHS, build_model
from tests.dist import harness

ARCH = "transformer_lm_gpt_mini"
"""The architecture most end-to-end runs train (2 layers, width 64, 2 heads)."""
TRAIN_INNER_KEYS = ["epoch", "update", "loss", "ppl", "wps", "ups", "wpb", "bsz", "num_updates", "lr",
                    "gnorm", "loss_scale", "train_wall", "gb_free", "wall"]
"""Keys of a ``train_inner`` json log record, in order."""
WORKERS = int(os.environ.get("FULLSHARD_E2E_WORKERS", "2"))
"""CLI runs at a time where a test has independent ones (env FULLSHARD_E2E_WORKERS, default 2): a run
spends much of its time starting and stopping processes (imports, rendezvous, exit), which leaves a core
idle; results don't depend on timing."""


SMALL_VOCAB = 2048
"""Ids of ``save_small_tokenizer``'s tokenizer."""


def corpus_documents() -> list:
    """The end-to-end corpus: the first 150 documents of the built-in corpus, stripped."""
    from fullshard.data import builtin_corpus_documents

    return [d.strip() for d in builtin_corpus_documents()[:150]]


def save_small_tokenizer(path):
    """Trains a byte-level BPE of :data:`SMALL_VOCAB` ids (``<|endoftext|>`` the end of sequence, id 0)
    on :func:`corpus_documents` with Hugging Face ``tokenizers`` and saves ``tokenizer.json`` and
    ``tokenizer_config.json`` into ``path``; returns ``path``. The GPT's output layer is then 25x smaller
    than with GPT-2 BPE's 50,257 ids, where the end-to-end runs spent most of each step."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(corpus_documents(), trainers.BpeTrainer(
        vocab_size=SMALL_VOCAB, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    path.mkdir(parents=True, exist_ok=True)
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))
    return path


def pool(workers: int = WORKERS) -> concurrent.futures.ThreadPoolExecutor:
    """A thread pool that runs CLI calls (subprocesses) ``workers`` at a time."""
    return concurrent.futures.ThreadPoolExecutor(max_workers=workers)


def run_all(calls: dict, workers: int = WORKERS) -> dict:
    """{name: fn()} for the thunks of ``calls``, ``workers`` at a time."""
    with pool(workers) as p:
        futures = {name: p.submit(fn) for name, fn in calls.items()}
    return {name: f.result() for name, f in futures.items()}


def cli_env(start_method: str = "fork") -> dict:
    """This process's environment outside any torchrun job, with ``PET_START_METHOD`` (the
    launcher's default ``--start-method``) set to ``start_method``."""
    env = dict(os.environ)
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    env["PET_START_METHOD"] = start_method
    return env


def run_cli(*args: str, timeout: float = 300, fresh: bool = False) -> subprocess.CompletedProcess:
    """`fullshard ARGS` in a process of its own, outside any torchrun environment, its ranks started
    with ``--start-method fork``; never raises on exit code.

    By default the process is forked from the test forkserver (tests/dist/harness.py), which has
    imported torch and fullshard, so neither it nor its forked ranks import them again (~13 s of CPU
    per 2-rank run on this machine). ``fresh``: `python -m fullshard.cli` in a new interpreter
    whose ranks are spawned, as a user runs the command."""
    if fresh:
        return subprocess.run([sys.executable, "-m", "fullshard.cli", *args], env=cli_env("spawn"),
                              capture_output=True, text=True, timeout=timeout)
    return harness.run_main(fullshard_cli.main, list(args), cli_env(), timeout, ["fullshard", *args])


def main_in_process(capsys, *argv):
    """`fullshard ARGV` in this process: (exit code, stdout, stderr)."""
    try:
        code = fullshard_cli.main(list(argv))
    except SystemExit as e:
        code = e.code
    out = capsys.readouterr()
    return code, out.out, out.err


def run_cli_checked(capsys, argv, through_command: bool, timeout: float = 300) -> tuple:
    """(exit code, stdout, stderr) of `fullshard ARGV`: through the command in a subprocess (its real
    exit code), or in this process for a check made before any rank starts."""
    if through_command:
        proc = run_cli(*argv, timeout=timeout)
        return proc.returncode, proc.stdout, proc.stderr
    return main_in_process(capsys, *argv)


def json_records(text: str) -> dict:
    """{'train_inner': [...], 'valid': [...], 'train': [...]} from a json-format log."""
    out = {"train_inner": [], "valid": [], "train": []}
    for line in text.splitlines():
        parts = line.split(" | ", 3)
        if len(parts) == 4 and parts[2] in out:
            out[parts[2]].append(json.loads(parts[3]))
    return out


def checkpoint_params(corpus_dir, path, arch: str = ARCH):
    """(state dict of an ``arch`` model loaded from checkpoint ``path``, the checkpoint's extra state)."""
    vocab = int(json.loads((corpus_dir / "meta.json").read_text())["vocab_size"])
    model = build_model(arch, vocab_size=vocab, max_positions=ARCHS[arch].max_positions)
    extra = checkpoint.load(str(path), model)
    return model.state_dict(), extra
