"""``fullshard generate --path CHECKPOINT --prompt TEXT``: sample a
continuation from a trained GPT, in one process with no process group.

The checkpoint is read offline (a checkpoint directory through
``torch.distributed.checkpoint``'s reader, which assembles every rank's
shards, or a consolidated file) into the plain model; text goes through the
project's GPT-2 tokenizer. The checkpoint of a ``fullshard train --hf-model DIR``
run loads into the run's ``transformers`` / PEFT model, and text goes through
DIR's ``tokenizer.json`` (``hf_trained.py``). A GPT trained on data preprocessed with
``fullshard preprocess --tokenizer DIR`` needs ``--tokenizer DIR``: the checkpoint records its
data's tokenizer, and text through any other tokenizer is refused (one line, exit 2).
Sampling is ancestral, one token at a time, over the logits of the last
position divided by ``--temperature`` and restricted to the ``--top-k`` most
likely tokens and then to the smallest set whose probability reaches
``--top-p`` (nucleus sampling, Holtzman et al. 2020, "The Curious Case of
Neural Text Degeneration", §3.1). ``--temperature 0`` (or ``--greedy``) takes
the argmax. Generation stops after ``--max-tokens`` new tokens or at
``<|endoftext|>``; a seeded ``torch.Generator`` makes the text a function of
``--seed``.
"""
from __future__ import annotations

import argparse
from typing import List, Optional, Sequence

import torch

from fullshard.data import DataError, load_gpt2_tokenizer
from fullshard.data.tokenizer import TOKENIZER_NAME, HFTokenizer, different_tokenizers
from fullshard.train import hf_model, hf_trained
from fullshard.train.options import OneLineArgumentParser
from fullshard.train.trained_model import ModelSpec, ModelSpecError, add_model_args, load_plain_model, read_spec


def add_args(p: argparse.ArgumentParser) -> None:
    """Register the generate flags on ``p``."""
    p.add_argument("--path", required=True, metavar="CHECKPOINT",
                   help="checkpoint directory (e.g. checkpoints/checkpoint_last) or consolidated .safetensors/.pt")
    p.add_argument("--prompt", required=True, help="text to continue")
    p.add_argument("--max-tokens", type=int, default=50, help="new tokens at most (default: %(default)s)")
    p.add_argument("--temperature", type=float, default=1.0, help="softmax temperature; 0 = greedy (default: 1.0)")
    p.add_argument("--greedy", action="store_true", help="take the most likely token (same as --temperature 0)")
    p.add_argument("--top-k", type=int, default=0, help="sample among the k most likely tokens (0 = all)")
    p.add_argument("--top-p", type=float, default=1.0,
                   help="sample among the most likely tokens whose probability reaches p, in (0, 1] (default: 1)")
    p.add_argument("--seed", type=int, default=1, help="sampling seed (default: %(default)s)")
    p.add_argument("--tokenizer", metavar="DIR", default=None,
                   help="the Hugging Face tokenizer directory the training data was preprocessed with "
                        "(`fullshard preprocess --tokenizer DIR`); default: a --hf-model run's own, else GPT-2 BPE")
    add_model_args(p, group=False)


def filter_logits(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Keep the ``top_k`` largest logits, then the nucleus of mass ``top_p``; the rest become -inf.

    Args:
        logits: (V,) float logits, already divided by the temperature.
        top_k: tokens kept by rank (0 = all).
        top_p: probability mass kept, in (0, 1]; the most likely token is always kept.
    Returns:
        (V,) a filtered copy.
    """
    logits = logits.clone()
    if 0 < top_k < logits.numel():
        kth = torch.topk(logits, top_k).values[-1]
        logits[logits < kth] = float("-inf")
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        drop = probs.cumsum(dim=-1) - probs >= top_p  # the more likely tokens already hold mass p
        logits[order[drop]] = float("-inf")
    return logits


@torch.no_grad()
def sample(model: torch.nn.Module, prompt: Sequence[int], max_tokens: int, temperature: float = 1.0,
           top_k: int = 0, top_p: float = 1.0, generator: Optional[torch.Generator] = None,
           eos_id: Optional[int] = None, vocab_limit: Optional[int] = None,
           positions: Optional[int] = None) -> List[int]:
    """New token ids continuing ``prompt`` (without the prompt).

    Args:
        model: a GPT mapping (1, T) int64 tokens to (1, T, V) logits, or a
            ``transformers`` causal LM (its output's ``.logits``); the context is
            cut to its last ``positions`` tokens.
        prompt: at least one token id.
        max_tokens: new tokens at most.
        temperature: > 0 samples from softmax(logits / temperature); 0 is greedy.
        top_k, top_p: see :func:`filter_logits`.
        generator: the sampling RNG (a fixed seed gives the same ids).
        eos_id: stop after emitting this id (it is included).
        vocab_limit: only ids below it are emitted (a tokenizer smaller than V).
        positions: the longest context, tokens (default: ``model.config.max_positions``).
    Returns:
        The generated ids, at most ``max_tokens``.
    """
    positions = positions or model.config.max_positions
    ids = torch.tensor([list(prompt)], dtype=torch.long)
    out: List[int] = []
    for _ in range(max_tokens):
        output = model(ids[:, -positions:])
        logits = getattr(output, "logits", output)[0, -1].float()  # --hf-model: a transformers ModelOutput
        if vocab_limit is not None:
            logits = logits[:vocab_limit]
        if temperature == 0:
            nxt = int(torch.argmax(logits))
        else:
            probs = torch.softmax(filter_logits(logits / temperature, top_k, top_p), dim=-1)
            nxt = int(torch.multinomial(probs, 1, generator=generator))
        out.append(nxt)
        if nxt == eos_id:
            break
        ids = torch.cat([ids, torch.tensor([[nxt]])], dim=1)
    return out


def load_tokenizer(spec: ModelSpec, directory: Optional[str] = None):
    """The tokenizer of the checkpoint's training data: ``directory``'s ``tokenizer.json`` when given,
    else GPT-2 BPE when the checkpoint records it, else a --hf-model run's own, else GPT-2 BPE.

    Args:
        spec: the checkpoint's model (``spec.tokenizer``: the record of its training data's tokenizer,
            None for a checkpoint written before the record).
        directory: a Hugging Face tokenizer directory, or None.

    Raises:
        DataError: ``directory`` has no usable tokenizer, or the chosen tokenizer is not the one the
            checkpoint records (text through another tokenizer's ids would be silently wrong).
        HFModelError: the --hf-model directory has no usable tokenizer.
    """
    recorded = spec.tokenizer
    if directory is not None:
        tok = HFTokenizer(directory)
    elif spec.hf_model and recorded != TOKENIZER_NAME:  # a --hf-model run on GPT-2 BPE data saw GPT-2 BPE ids
        tok = hf_trained.load_tokenizer(spec.hf_model)
    else:
        tok = load_gpt2_tokenizer()
    if different_tokenizers(recorded, tok.name):
        if directory is None and recorded.startswith("hf:") and not spec.hf_model:
            raise DataError(f"the model was trained on data preprocessed with the tokenizer {recorded}; pass its "
                            "directory (the one given to `fullshard preprocess --tokenizer`) as --tokenizer DIR")
        raise DataError(f"the tokenizer {tok.name} is not the one the model's training data was preprocessed with "
                        f"({recorded})" + ("; drop --tokenizer" if recorded == TOKENIZER_NAME
                                           else "; pass that one as --tokenizer DIR"))
    return tok


def _check(p: OneLineArgumentParser, args) -> None:
    if not args.prompt.strip():
        p.fail("--prompt is empty; give the text to continue")
    if args.max_tokens < 1:
        p.fail(f"--max-tokens must be >= 1, got {args.max_tokens}")
    if args.temperature < 0:
        p.fail(f"--temperature must be >= 0 (0 = greedy), got {args.temperature}")
    if args.top_k < 0:
        p.fail(f"--top-k must be >= 0 (0 = off), got {args.top_k}")
    if not 0.0 < args.top_p <= 1.0:
        p.fail(f"--top-p must be in (0, 1], got {args.top_p}")


def run(p: OneLineArgumentParser, args) -> int:
    """Check the flags, load the model, print prompt + continuation; exit 2 (one line) on bad input."""
    _check(p, args)
    try:
        spec = read_spec(args.path, args.arch, vars(args))
        tokenizer = load_tokenizer(spec, args.tokenizer)
        model = load_plain_model(spec)
    except (ModelSpecError, DataError, hf_model.HFModelError) as e:
        p.fail(str(e))
    prompt = tokenizer.encode(args.prompt)
    if max(prompt, default=0) >= spec.vocab_size:  # a checkpoint without the record, through another tokenizer
        p.fail(f"the prompt has token id {max(prompt)}, beyond the model's {spec.vocab_size:,} ids: the model was "
               "trained with another tokenizer; pass the one its data was preprocessed with as --tokenizer DIR")
    temperature = 0.0 if args.greedy else args.temperature
    generator = torch.Generator().manual_seed(args.seed)
    new = sample(model, prompt, args.max_tokens, temperature, args.top_k, args.top_p, generator,
                 eos_id=tokenizer.eos_id, vocab_limit=min(tokenizer.vocab_size, spec.vocab_size),
                 positions=spec.max_positions)
    print(tokenizer.decode(prompt + new))
    return 0
