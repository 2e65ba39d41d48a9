"""Checks of the Hugging Face fine-tuning flags of `fullshard train` (`config.FinetuneOptions`), run by
`options.validate` on the launching process: each bad input is one line and exit 2, before any rank
starts."""
from __future__ import annotations

import os
from typing import Optional

from fullshard.train import checkpoint_record, hf_model, qlora
from fullshard.train.config import DEFAULT_FSDP_VERSION


def check(p, args, meta: dict) -> Optional[int]:
    """Check --hf-model and the --lora-* / --save-hf / --merge-lora flags against each other and the data.

    Args:
        p: the `options.OneLineArgumentParser` (its ``fail`` prints one line and exits 2).
        args: the parsed train arguments.
        meta: the data directory's meta.json.
    Returns:
        The model's position-table size (tokens) with --hf-model, else None.
    """
    if not args.hf_model:
        for name, given in (("--lora-rank", args.lora_rank), ("--save-hf", args.save_hf),
                            ("--merge-lora", args.merge_lora), ("--lora-target-modules", args.lora_target_modules),
                            ("--base-dtype", args.base_dtype != "fp32"),
                            ("--quantize-base", args.quantize_base != "none")):
            if given:
                p.fail(f"{name} needs --hf-model DIR (LoRA and Hugging Face export are for Hugging Face checkpoints)")
        return None
    if args.ddp_backend != "fully_sharded":
        p.fail("--hf-model needs --ddp-backend fully_sharded")
    if args.save_hf and os.path.exists(args.save_hf) and not os.path.isdir(args.save_hf):
        p.fail(f"--save-hf {args.save_hf!r} is a file; the export is a directory: give a directory's path")
    if args.lora_rank < 0:
        p.fail(f"--lora-rank must be >= 0 (0 = full fine-tuning), got {args.lora_rank}")
    if not 0.0 <= args.lora_dropout < 1.0:
        p.fail(f"--lora-dropout must be in [0, 1), got {args.lora_dropout}")
    if not args.lora_rank:
        for name, given in (("--merge-lora", args.merge_lora), ("--lora-target-modules", args.lora_target_modules)):
            if given:
                p.fail(f"{name} needs --lora-rank R (> 0)")
    if args.base_dtype != "fp32":
        if not args.lora_rank:
            p.fail(f"--base-dtype {args.base_dtype} needs --lora-rank R (> 0): it stores the frozen base in "
                   f"{args.base_dtype}; a full fine-tune trains every parameter in fp32 master weights (add --bf16 to "
                   "compute in bf16)")
        other = "fp16" if args.fp16 else "bf16" if args.bf16 else None
        if other and other != args.base_dtype:
            p.fail(f"--base-dtype {args.base_dtype} with --{other} would cast the base to {other} in every "
                   f"forward; use --base-dtype {other}, or drop --{other}")
    if args.quantize_base != "none":
        _check_quantize(p, args)
    if args.optimizer == "muon":
        p.fail("--hf-model with --optimizer muon is not supported yet; use adam, cpu_adam, adafactor or lamb")
    try:
        config = hf_model.read_config(args.hf_model)
        # The structure on meta (no weights read): decoder layers found, LoRA targets matched, files complete.
        _, layers, _ = hf_model.load_meta(args, args.hf_model)
    except hf_model.HFModelError as e:
        p.fail(str(e))
    if args.quantize_base != "none" and not any(qlora.base_linears(layer) for layer in layers):
        kinds = sorted({type(m).__name__ for layer in layers for m in layer.modules()
                        if getattr(m, "weight", None) is not None and not m.weight.requires_grad
                        and m.weight.dim() == 2})
        p.fail(f"--quantize-base {args.quantize_base}: the decoder layers of {args.hf_model!r} hold no frozen "
               f"torch.nn.Linear to quantize (their frozen weights are in {', '.join(kinds) or 'no module'}); "
               "drop --quantize-base")
    data_vocab, vocab = int(meta["vocab_size"]), int(config.vocab_size)
    if data_vocab > vocab:
        p.fail(f"the data in {args.data_dir!r} has {data_vocab:,} token ids ({meta.get('tokenizer')}), the model in "
               f"{args.hf_model!r} embeds {vocab:,}; preprocess with the model's tokenizer: `fullshard preprocess "
               f"--tokenizer {args.hf_model} ...`")
    positions = hf_model.max_positions(config) or args.tokens_per_sample
    if args.tokens_per_sample > positions:
        p.fail(f"--tokens-per-sample {args.tokens_per_sample} exceeds the {positions} positions of the model in "
               f"{args.hf_model!r}; use --tokens-per-sample <= {positions}")
    return positions


def _check_quantize(p, args) -> None:
    """--quantize-base nf4 (QLoRA, train/qlora.py): adapters on a frozen base, on fully_shard, with torchao."""
    if not args.lora_rank:
        p.fail(f"--quantize-base {args.quantize_base} needs --lora-rank R (> 0): only a frozen base is quantized "
               "(QLoRA); drop --quantize-base for a full fine-tune")
    if (args.fsdp_version or DEFAULT_FSDP_VERSION) != 2:
        p.fail(f"--quantize-base {args.quantize_base} needs --fsdp-version 2 (fully_shard gathers NF4 weights as "
               "packed bytes; the FSDP1 wrapper's flat parameters cannot hold them)")
    if not qlora.nf4_available():
        p.fail(f"--quantize-base {args.quantize_base} needs torchao (pip install torchao==0.18.0)")


def check_nf4_restore(p, args, worlds: list) -> None:
    """A QLoRA checkpoint this run would resume (``checkpoint_record.resume_path``) loads at the world size it
    was saved at only (``checkpoint_record.nf4_problem``); ``worlds``: this run's."""
    from fullshard.checkpoint import CheckpointError  # lazy: start-up speed (see options._check_restore)

    path = checkpoint_record.resume_path(args.save_dir, args.restore_file, vars(args))[0]
    if path is None:
        return
    try:
        problem = checkpoint_record.nf4_problem(path, worlds)
    except (CheckpointError, OSError, ValueError):
        return  # unreadable: loading it names the problem
    if problem is not None:
        p.fail(f"cannot resume from {path!r}: {problem}")
