"""Command-line flags of `fullshard train` (fairseq-train names) and their validation.

Validation runs on the launching process before any rank starts. Each bad input
is reported as ONE line ``fullshard train: error: <what> ... <what to do>`` on
stderr with exit code 2 (argparse's `error()` convention), and nothing is
written: no save directory, no log file.
"""
from __future__ import annotations

import argparse
import ast
import dataclasses
import os
import sys
from typing import NoReturn, Optional, Sequence

from fullshard.train.config import TrainConfig
from fullshard.train.lr_scheduler import SCHEDULERS

# Fallback when an ArchSpec carries no `max_positions` of its own: fairseq's
# GPT-3 family uses 2048 positions (the CPU-sized transformer_lm_gpt3_tiny too);
# the CPU-sized gpt_tiny/gpt_mini fewer.
_GPT3_MAX_POSITIONS = 2048
_FALLBACK_MAX_POSITIONS = {"transformer_lm_gpt_tiny": 1024, "transformer_lm_gpt_mini": 512,
                           "transformer_lm_gpt3_tiny": _GPT3_MAX_POSITIONS}


class OneLineArgumentParser(argparse.ArgumentParser):
    """ArgumentParser whose `fail()` prints exactly one ``prog: error: msg`` line."""

    def fail(self, message: str) -> NoReturn:
        sys.stderr.write(f"{self.prog}: error: {message}\n")
        sys.exit(2)

    def error(self, message: str) -> NoReturn:
        """argparse's own errors (unknown flag, bad value): one line too, no usage block."""
        self.fail(f"{message}; see `{self.prog} --help`")


def _betas(text: str):
    try:
        value = ast.literal_eval(text)
        betas = tuple(float(b) for b in value)
    except (ValueError, SyntaxError, TypeError):
        raise argparse.ArgumentTypeError(f"expected a pair like '(0.9,0.98)', got {text!r}")
    if len(betas) != 2:
        raise argparse.ArgumentTypeError(f"expected two betas like '(0.9,0.98)', got {text!r}")
    return betas


# fairseq's model-override flags (argparse dest, also the TrainConfig field) -> the ArchSpec field each sets.
ARCH_OVERRIDES = {"decoder_layers": "num_layers", "decoder_embed_dim": "embed_dim",
                  "decoder_attention_heads": "num_heads", "decoder_ffn_embed_dim": "ffn_embed_dim"}


def add_arch_override_args(p) -> None:
    """Register --decoder-layers / -embed-dim / -attention-heads / -ffn-embed-dim on `p` (a parser or group)."""
    p.add_argument("--decoder-layers", type=int, default=None, metavar="L",
                   help="transformer blocks, overriding the --arch's (default: the --arch's)")
    p.add_argument("--decoder-embed-dim", type=int, default=None, metavar="C",
                   help="model width, overriding the --arch's (default: the --arch's)")
    p.add_argument("--decoder-attention-heads", type=int, default=None, metavar="H",
                   help="attention heads, dividing the width (default: the --arch's)")
    p.add_argument("--decoder-ffn-embed-dim", type=int, default=None, metavar="F",
                   help="MLP hidden width (default: 4 x the width, as fairseq's base_gpt3_architecture)")


def resolve_arch(arch: str, overrides, base=None, base_name: Optional[str] = None):
    """The shape of `arch` with fairseq's --decoder-* overrides applied.

    Args:
        arch: a key of `fullshard.models.ARCHS`.
        overrides: a mapping (e.g. ``vars(args)`` or a checkpoint's saved arguments) whose
            `ARCH_OVERRIDES` keys hold an int or None (= the base's value); other keys are ignored.
        base: the `fullshard.models.ArchSpec` overridden (default: ``ARCHS[arch]``).
        base_name: what errors call the base (default: ``--arch <arch>``).

    Returns:
        The `fullshard.models.ArchSpec`; its FFN width is 4 x the width when --decoder-embed-dim
        changes it and --decoder-ffn-embed-dim is not given, else the base's.

    Raises:
        ValueError: one line naming the flag: unknown arch, a value < 1, or heads not dividing the width.
    """
    from fullshard.models import ARCHS

    if arch not in ARCHS:
        raise ValueError(f"unknown --arch {arch!r}; known archs: {', '.join(ARCHS)}")
    given = {dest: overrides.get(dest) for dest in ARCH_OVERRIDES if overrides.get(dest) is not None}
    for dest, value in given.items():
        if value < 1:
            raise ValueError(f"--{dest.replace('_', '-')} must be >= 1, got {value}")
    base, base_name = base or ARCHS[arch], base_name or f"--arch {arch}"
    heads, width = given.get("decoder_attention_heads", base.num_heads), given.get("decoder_embed_dim", base.embed_dim)
    if width % heads:
        h = (f"--decoder-attention-heads {heads}" if "decoder_attention_heads" in given
             else f"the {heads} attention heads of {base_name}")
        w = f"--decoder-embed-dim {width}" if "decoder_embed_dim" in given else f"the width {width} of {base_name}"
        raise ValueError(f"{h} must divide {w}; pick --decoder-attention-heads dividing the width")
    return base.override(**{ARCH_OVERRIDES[dest]: value for dest, value in given.items()})


def arch_fields(shape) -> dict:
    """TrainConfig's decoder_* fields (effective values) of a `fullshard.models.ArchSpec`."""
    return {dest: getattr(shape, field) for dest, field in ARCH_OVERRIDES.items()}


def add_train_args(p: argparse.ArgumentParser) -> None:
    """Register the fairseq-train style flags on `p`."""
    p.add_argument("data", metavar="DATA_DIR", help="directory written by `fullshard preprocess`")
    g = p.add_argument_group("model")
    from fullshard.models.config import ARCHS

    g.add_argument("--arch", "-a", default="transformer_lm_gpt_tiny", metavar="ARCH",
                   help=f"model architecture, one of {', '.join(ARCHS)} (default: %(default)s)")
    add_arch_override_args(g)
    g.add_argument("--dropout", type=float, default=0.0, help="dropout probability (default: %(default)s)")
    g = p.add_argument_group("distributed")
    g.add_argument("--ddp-backend", choices=("fully_sharded", "c10d"), default="fully_sharded",
                   help="fully_sharded = fullshard FSDP; c10d = torch DistributedDataParallel baseline")
    g.add_argument("--no-reshard-after-forward", action="store_true",
                   help="keep full params between forward and backward (SHARD_GRAD_OP, ZeRO-2-like)")
    g.add_argument("--nproc-per-node", type=int, default=1, help="ranks to launch on this machine (default: 1)")
    g.add_argument("--cpu-offload", action="store_true",
                   help="fully_sharded: keep parameter/gradient shards and the optimizer step on the CPU")
    g.add_argument("--accumulate-mode", choices=("no_sync", "reduce_scatter"), default="no_sync",
                   help="with --update-freq > 1: no_sync accumulates unsharded gradients locally and "
                        "reduce-scatters once per update (faster, more memory); reduce_scatter "
                        "reduce-scatters every micro-batch into the gradient shards (less memory). "
                        "c10d: whether DDP all-reduces every micro-batch (default: %(default)s)")
    g.add_argument("--hybrid-shard", action="store_true",
                   help="fully_sharded: HYBRID_SHARD, shard within a node and replicate across nodes")
    g.add_argument("--collective-timeout", type=float, default=300.0, metavar="SECONDS",
                   help="a rank waiting longer in one collective exits naming it, its unit and the ranks "
                        "that did not arrive (default: %(default)s)")
    g.add_argument("--debug-collectives", action="store_true",
                   help="before each collective check that every rank issues the same one (also FULLSHARD_DEBUG=1)")
    g.add_argument("--max-restarts", type=int, default=0,
                   help="after a rank dies, restart all ranks up to this many times; each resumes from "
                        "checkpoint_last (default: 0)")
    g.add_argument("--nnodes", type=int, default=1, help="launchers (nodes) taking part (default: 1)")
    g.add_argument("--node-rank", type=int, default=0, help="this node's number; node 0 hosts the rendezvous")
    g.add_argument("--rdzv-endpoint", default=None, metavar="HOST:PORT",
                   help="c10d rendezvous address, the same on every node (needed with --nnodes > 1)")
    g.add_argument("--rdzv-timeout", type=float, default=900.0, metavar="SECONDS",
                   help="wait this long for every node to join (default: %(default)s)")
    g.add_argument("--checkpoint-activations", action="store_true",
                   help="recompute each transformer block's activations in backward")
    g.add_argument("--offload-activations", action="store_true",
                   help="keep checkpointed activations in host memory (implies --checkpoint-activations)")
    g = p.add_argument_group("mixed precision")
    g.add_argument("--fp16", action="store_true", help="float16 compute with dynamic loss scaling")
    g.add_argument("--bf16", action="store_true", help="bfloat16 compute (no loss scaling)")
    g.add_argument("--fp16-init-scale", type=float, default=128.0, help="initial loss scale (default: 128)")
    g.add_argument("--fp16-scale-window", type=int, default=None,
                   help="updates without overflow before the loss scale doubles "
                        "(default: 2**14 / world size / update freq, as fairseq)")
    g.add_argument("--min-loss-scale", type=float, default=1e-4,
                   help="stop training when the loss scale falls to this (default: %(default)s)")
    g = p.add_argument_group("dataset")
    g.add_argument("--tokens-per-sample", type=int, default=1024, help="tokens per sample (default: %(default)s)")
    g.add_argument("--batch-size", type=int, default=8, help="sequences per rank per micro-batch (default: %(default)s)")
    g.add_argument("--update-freq", type=int, default=1, help="micro-batches accumulated per update (default: 1)")
    g = p.add_argument_group("optimization")
    g.add_argument("--task", choices=("language_modeling",), default="language_modeling",
                   help="the only task: GPT language modeling")
    g.add_argument("--optimizer", choices=("adam", "cpu_adam"), default="adam",
                   help="AdamW with decoupled weight decay; cpu_adam: the same, stepping on host shards with "
                        "torch's fused CPU AdamW kernel")
    g.add_argument("--adam-betas", type=_betas, default=(0.9, 0.999), help="betas, e.g. '(0.9,0.98)'")
    g.add_argument("--adam-eps", type=float, default=1e-8)
    g.add_argument("--weight-decay", "--wd", type=float, default=0.0, help="applied to >=2-D weights only")
    g.add_argument("--lr", type=float, default=5e-4, help="peak learning rate (default: %(default)s)")
    g.add_argument("--lr-scheduler", choices=SCHEDULERS, default="fixed")
    g.add_argument("--warmup-updates", type=int, default=0)
    g.add_argument("--total-num-update", type=int, default=0,
                   help="updates over which polynomial_decay/cosine anneal (default: --max-update)")
    g.add_argument("--end-learning-rate", type=float, default=0.0)
    g.add_argument("--power", type=float, default=1.0)
    g.add_argument("--max-update", type=int, default=0, help="stop after N updates (0 = no limit)")
    g.add_argument("--max-epoch", type=int, default=0, help="stop after N epochs (0 = no limit)")
    g.add_argument("--clip-norm", type=float, default=0.0, help="clip gradient norm (0 = off)")
    g.add_argument("--seed", type=int, default=1)
    g = p.add_argument_group("logging and checkpoints")
    g.add_argument("--log-format", choices=("json", "simple", "tqdm"), default=None,
                   help="default: tqdm on a terminal, else simple")
    g.add_argument("--log-interval", type=int, default=100)
    g.add_argument("--log-file", default=None, help="also write the log to this file")
    g.add_argument("--log-memory", action="store_true",
                   help="log FSDP memory on train_inner lines: fullshard.memory_stats totals (mem_*_mb, MiB), "
                        "the most seen after any forward or backward since the last line, on any rank (c10d: none)")
    g.add_argument("--validate-interval-updates", type=int, default=0,
                   help="validate every N updates (0 = end of epoch/training only)")
    g.add_argument("--save-dir", default="checkpoints")
    g.add_argument("--no-save", action="store_true", help="write no checkpoint")
    g.add_argument("--save-interval-updates", type=int, default=0,
                   help="also save checkpoint_<epoch>_<updates> every N updates (0 = only at the end)")
    g.add_argument("--keep-interval-updates", type=int, default=-1,
                   help="keep only the last N interval checkpoints (-1 = all)")
    g.add_argument("--restore-file", default="checkpoint_last",
                   help="checkpoint to resume from: a path, or a name in --save-dir (default: %(default)s; "
                        "resumed automatically when it exists)")
    g.add_argument("--reset-optimizer", action="store_true",
                   help="resume the model only: fresh optimizer state and update counter")
    g.add_argument("--reset-dataloader", action="store_true", help="resume at epoch 1, first batch")
    g.add_argument("--reset-lr-scheduler", action="store_true", help="do not restore the lr scheduler")
    g.add_argument("--reset-meters", action="store_true", help="do not restore the train meters")
    g.add_argument("--on-save-error", choices=("stop", "continue"), default="stop",
                   help="after a failed checkpoint save (e.g. disk full): stop, or continue training "
                        "(the previous checkpoint stays) (default: %(default)s)")
    g.add_argument("--debug", action="store_true", help="print tracebacks instead of one-line errors")
    g.add_argument("--finetune-from-model", default=None,
                   help="start from these weights (a consolidated .pt/.safetensors or a checkpoint directory) "
                        "when --save-dir has no checkpoint_last")


def arch_max_positions(arch: str) -> int:
    """Positions supported by `arch` (the models package's, else the documented defaults)."""
    from fullshard.models import ARCHS

    spec = ARCHS[arch]
    value = getattr(spec, "max_positions", None)
    if value:
        return int(value)
    if arch in _FALLBACK_MAX_POSITIONS:
        return _FALLBACK_MAX_POSITIONS[arch]
    return _GPT3_MAX_POSITIONS


def launched_world_size(nproc_per_node: int, nnodes: int = 1) -> int:
    """World size: WORLD_SIZE under an existing torchrun, else --nproc-per-node x --nnodes."""
    if under_torchrun():
        return int(os.environ["WORLD_SIZE"])
    return nproc_per_node * nnodes


def under_torchrun() -> bool:
    """True when this process is already a rank started by torchrun / elastic."""
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))


def _resolve_log_format(fmt: Optional[str]) -> str:
    tty = sys.stdout.isatty() and sys.stderr.isatty()
    if fmt is None:
        return "tqdm" if tty else "simple"
    if fmt == "tqdm" and not tty:
        return "simple"
    return fmt


def _check_positive(p: OneLineArgumentParser, args) -> None:
    for flag in ("tokens_per_sample", "batch_size", "update_freq", "nproc_per_node", "log_interval"):
        if getattr(args, flag) < 1:
            p.fail(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    for flag in ("warmup_updates", "total_num_update", "max_update", "max_epoch", "max_restarts",
                 "validate_interval_updates", "save_interval_updates", "weight_decay", "clip_norm",
                 "end_learning_rate"):
        if getattr(args, flag) < 0:
            p.fail(f"--{flag.replace('_', '-')} must be >= 0, got {getattr(args, flag)}")
    if args.lr <= 0:
        p.fail(f"--lr must be > 0, got {args.lr}")
    for flag in ("collective_timeout", "rdzv_timeout"):
        if not getattr(args, flag) > 0:
            p.fail(f"--{flag.replace('_', '-')} must be > 0 seconds, got {getattr(args, flag)}")
    if not 0.0 <= args.dropout < 1.0:
        p.fail(f"--dropout must be in [0, 1), got {args.dropout}")


def _check_schedule(p: OneLineArgumentParser, args) -> None:
    if args.lr_scheduler in ("polynomial_decay", "cosine"):
        total = args.total_num_update or args.max_update
        if total <= 0:
            p.fail(f"--lr-scheduler {args.lr_scheduler} needs --total-num-update or --max-update")
        if total <= args.warmup_updates:
            p.fail(f"--total-num-update ({total}) must exceed --warmup-updates ({args.warmup_updates})")


def _check_memory_flags(p: OneLineArgumentParser, args, world_size: int) -> int:
    """Check the mixed-precision / offload / checkpointing flags; returns the loss-scale window."""
    if args.fp16 and args.bf16:
        p.fail("--fp16 and --bf16 are mutually exclusive; pick one")
    if args.cpu_offload and args.ddp_backend != "fully_sharded":
        p.fail("--cpu-offload needs --ddp-backend fully_sharded (c10d keeps whole parameters on the device)")
    if args.fp16_init_scale <= 0:
        p.fail(f"--fp16-init-scale must be > 0, got {args.fp16_init_scale}")
    if args.min_loss_scale < 0:
        p.fail(f"--min-loss-scale must be >= 0, got {args.min_loss_scale}")
    if args.fp16_scale_window is None:
        # fairseq's rule (trainer.py): the window shrinks as more gradients are summed per update.
        return max(1, int(2**14 / world_size / args.update_freq))
    if args.fp16_scale_window < 1:
        p.fail(f"--fp16-scale-window must be >= 1, got {args.fp16_scale_window}")
    return args.fp16_scale_window


def _check_data(p: OneLineArgumentParser, args) -> dict:
    from fullshard.data import DataError, read_meta

    if not os.path.isdir(args.data):
        p.fail(f"data directory {args.data!r} does not exist; create it with `fullshard preprocess --destdir {args.data} ...`")
    if not os.path.isfile(os.path.join(args.data, "meta.json")):
        p.fail(f"no meta.json in {args.data!r}; it is not a preprocessed data directory, run `fullshard preprocess --destdir {args.data} ...` first")
    try:
        meta = read_meta(args.data)
    except (DataError, OSError, ValueError) as e:
        p.fail(f"cannot read {os.path.join(args.data, 'meta.json')}: {e}; re-run `fullshard preprocess`")
    return meta


def _check_split_sizes(p: OneLineArgumentParser, args, meta: dict, world_size: int) -> None:
    from fullshard.data import DataError, TokenBlockDataset

    for split in ("train", "valid"):
        have = _split_tokens(meta, split)
        if have is None:
            p.fail(f"no {split!r} split in {args.data!r}; re-run `fullshard preprocess` to write train and valid splits")
        # Training needs one full global batch; validation runs on what the split has (one sample or more).
        need = (args.batch_size * world_size if split == "train" else 1) * (args.tokens_per_sample + 1)
        if split == "valid" and have < need:
            p.fail(f"the 'valid' split of {args.data!r} has {have:,} tokens, fewer than one sample of "
                   f"--tokens-per-sample {args.tokens_per_sample} + 1; lower --tokens-per-sample or preprocess "
                   "more text")
        if have < need:
            p.fail(f"the {split!r} split of {args.data!r} has {have:,} tokens, fewer than one batch "
                   f"(--batch-size {args.batch_size} x {world_size} ranks x (--tokens-per-sample "
                   f"{args.tokens_per_sample} + 1) = {need:,}); lower --batch-size, --tokens-per-sample or "
                   f"--nproc-per-node, or preprocess more text")
        try:  # checks the split file against meta.json
            TokenBlockDataset(args.data, split, args.tokens_per_sample)
        except (DataError, ValueError) as e:
            p.fail(str(e))


def _split_tokens(meta: dict, split: str) -> Optional[int]:
    """Token count of `split` from meta.json (``splits.<s>.num_tokens`` or ``<s>.num_tokens``)."""
    for holder in (meta.get("splits", {}), meta):
        entry = holder.get(split) if isinstance(holder, dict) else None
        if isinstance(entry, dict) and "num_tokens" in entry:
            return int(entry["num_tokens"])
    num_tokens = meta.get("num_tokens")
    if isinstance(num_tokens, dict) and split in num_tokens:
        return int(num_tokens[split])
    return None


def _check_restore(p: OneLineArgumentParser, args, shape, max_positions: int, vocab_size: int) -> None:
    """A checkpoint that would be resumed must be readable and of this model: tensor names and shapes,
    and the recorded shape (`shape`, an ArchSpec), which also holds what no tensor shows (the heads)."""
    from fullshard.checkpoint import CheckpointError, read_extra, verify
    from fullshard.checkpoint.save_load import _check_model_keys, _resolve
    from fullshard.models import build_model

    path = args.restore_file
    if not os.path.isabs(path) and not os.path.exists(path):
        path = os.path.join(args.save_dir, path)
    if not os.path.exists(path):
        if args.restore_file != "checkpoint_last":
            p.fail(f"--restore-file {args.restore_file!r} does not exist; give a checkpoint directory")
        return
    if not os.path.isdir(path):
        p.fail(f"--restore-file {path!r} is not a checkpoint directory")
    try:
        resolved = _resolve(path)
        verify(resolved)
        model = build_model(shape, device="meta", vocab_size=vocab_size, max_positions=max_positions)
        _check_model_keys(resolved, model.state_dict())
        saved = (read_extra(resolved) or {}).get("args") or {}
    except (CheckpointError, OSError, ValueError) as e:
        p.fail(f"cannot resume from {path!r}: {str(e).split('] ', 1)[-1]}; use another --save-dir, or "
               "--restore-file / --finetune-from-model with a checkpoint of this --arch and --decoder-* shape")
    try:
        trained = resolve_arch(saved["arch"], saved) if "arch" in saved else shape
    except ValueError:  # an arch this version does not know: the tensor check above stands
        trained = shape
    if trained != shape:
        p.fail(f"cannot resume from {path!r}: it was trained with {trained.describe()}, this run has "
               f"{shape.describe()}; use another --save-dir, or the --arch / --decoder-* flags it was trained with")


_FP16_WARNED = []


def _warn_fp16_on_cpu(args) -> None:
    """--fp16 without a GPU: warn once that bf16 is much faster on a CPU."""
    import torch

    if args.fp16 and not torch.cuda.is_available() and not _FP16_WARNED:
        _FP16_WARNED.append(True)
        sys.stderr.write("fullshard train: warning: --fp16 on a CPU is slow (no fast fp16 kernels; measured about "
                         "100 tokens/s against 1,800 at fp32); --bf16 is much faster here\n")


def _check_nodes(p: OneLineArgumentParser, args) -> str:
    """Check --nnodes / --node-rank / --rdzv-endpoint / --hybrid-shard; returns the endpoint."""
    if args.nnodes < 1:
        p.fail(f"--nnodes must be >= 1, got {args.nnodes}")
    if not 0 <= args.node_rank < args.nnodes:
        p.fail(f"--node-rank must be in [0, --nnodes {args.nnodes}), got {args.node_rank}")
    endpoint = args.rdzv_endpoint or "localhost:0"
    host, _, port = endpoint.rpartition(":")
    if not host or not port.isdigit() or not 0 <= int(port) < 65536:
        p.fail(f"--rdzv-endpoint {endpoint!r} is not HOST:PORT (e.g. 10.0.0.1:29400)")
    if args.nnodes > 1 and int(port) == 0:
        p.fail(f"--nnodes {args.nnodes} needs --rdzv-endpoint HOST:PORT, the same on every node "
               "(HOST: node 0's address, PORT: a free port there)")
    if args.hybrid_shard and args.ddp_backend != "fully_sharded":
        p.fail("--hybrid-shard needs --ddp-backend fully_sharded")
    if args.hybrid_shard and args.no_reshard_after_forward:
        p.fail("--hybrid-shard and --no-reshard-after-forward are exclusive; pick one sharding strategy")
    return endpoint


def check_tokens_per_sample(p: OneLineArgumentParser, args) -> int:
    """The position-table size of ``args.arch``; fails (one line, exit 2) when
    ``args.tokens_per_sample`` exceeds it."""
    max_positions = arch_max_positions(args.arch)
    if args.tokens_per_sample > max_positions:
        p.fail(f"--tokens-per-sample {args.tokens_per_sample} exceeds the {max_positions} positions of "
               f"--arch {args.arch}; use --tokens-per-sample <= {max_positions}")
    return max_positions


def validate(p: OneLineArgumentParser, args) -> TrainConfig:
    """Check every input; on the first problem print one line and exit 2. Else a TrainConfig."""
    _check_positive(p, args)
    _check_schedule(p, args)
    rdzv_endpoint = _check_nodes(p, args)
    world_size = launched_world_size(args.nproc_per_node, args.nnodes)
    scale_window = _check_memory_flags(p, args, world_size)
    meta = _check_data(p, args)
    try:
        shape = resolve_arch(args.arch, vars(args))
    except ValueError as e:
        p.fail(str(e))
    max_positions = check_tokens_per_sample(p, args)
    _check_split_sizes(p, args, meta, world_size)
    if args.log_file and os.path.isdir(args.log_file):
        p.fail(f"--log-file {args.log_file!r} is a directory; give a file path")
    log_dir = os.path.dirname(os.path.abspath(args.log_file)) if args.log_file else None
    if log_dir and os.path.exists(log_dir) and not os.path.isdir(log_dir):
        p.fail(f"the directory of --log-file {args.log_file!r} is a file; give a path in a directory")
    if not args.no_save and os.path.exists(args.save_dir) and not os.path.isdir(args.save_dir):
        p.fail(f"--save-dir {args.save_dir!r} exists and is not a directory")
    if args.finetune_from_model and not os.path.exists(args.finetune_from_model):
        p.fail(f"--finetune-from-model {args.finetune_from_model!r} does not exist; give a consolidated "
               "file or a checkpoint directory")
    _check_restore(p, args, shape, max_positions, int(meta["vocab_size"]))
    _warn_fp16_on_cpu(args)
    cfg = config_from_args(args, max_positions=max_positions, vocab_size=int(meta["vocab_size"]),
                           world_size=world_size, scale_window=scale_window, rdzv_endpoint=rdzv_endpoint)
    return dataclasses.replace(cfg, **arch_fields(shape))  # checkpoints record the effective shape


def config_from_args(args, *, max_positions: int, vocab_size: int, world_size: int,
                     scale_window: int, rdzv_endpoint: str = "localhost:0") -> TrainConfig:
    """The TrainConfig of parsed `fullshard train` arguments (no checks; see `validate`).

    Args:
        args: the train parser's Namespace.
        max_positions: positions of ``args.arch``, tokens.
        vocab_size: token ids of the model.
        world_size: ranks of the run.
        scale_window: resolved fp16 loss-scale window, updates.
        rdzv_endpoint: resolved rendezvous ``host:port`` (multi-node runs).
    """
    return TrainConfig(
        data_dir=args.data, arch=args.arch, max_positions=max_positions, vocab_size=vocab_size,
        ddp_backend=args.ddp_backend, reshard_after_forward=not args.no_reshard_after_forward,
        tokens_per_sample=args.tokens_per_sample, batch_size=args.batch_size, update_freq=args.update_freq,
        dropout=args.dropout, adam_betas=tuple(args.adam_betas), adam_eps=args.adam_eps,
        weight_decay=args.weight_decay, lr=args.lr, lr_scheduler=args.lr_scheduler,
        warmup_updates=args.warmup_updates, total_num_update=args.total_num_update,
        end_learning_rate=args.end_learning_rate, power=args.power, max_update=args.max_update,
        max_epoch=args.max_epoch, clip_norm=args.clip_norm, seed=args.seed,
        log_format=_resolve_log_format(args.log_format), log_interval=args.log_interval,
        log_file=args.log_file, log_memory=args.log_memory, validate_interval_updates=args.validate_interval_updates,
        save_dir=args.save_dir, no_save=args.no_save,
        nproc_per_node=world_size if under_torchrun() else args.nproc_per_node,
        fp16=args.fp16, bf16=args.bf16, fp16_init_scale=args.fp16_init_scale, fp16_scale_window=scale_window,
        min_loss_scale=args.min_loss_scale, cpu_offload=args.cpu_offload,
        checkpoint_activations=args.checkpoint_activations or args.offload_activations,
        offload_activations=args.offload_activations, accumulate_mode=args.accumulate_mode,
        save_interval_updates=args.save_interval_updates, keep_interval_updates=args.keep_interval_updates,
        restore_file=args.restore_file, reset_optimizer=args.reset_optimizer,
        reset_dataloader=args.reset_dataloader, reset_lr_scheduler=args.reset_lr_scheduler,
        reset_meters=args.reset_meters, finetune_from_model=args.finetune_from_model,
        collective_timeout_s=args.collective_timeout, debug_collectives=args.debug_collectives,
        debug=args.debug, on_save_error=args.on_save_error, max_restarts=args.max_restarts,
        nnodes=args.nnodes, node_rank=args.node_rank, rdzv_endpoint=rdzv_endpoint,
        rdzv_timeout_s=args.rdzv_timeout, hybrid_shard=args.hybrid_shard, optimizer=args.optimizer,
        **{dest: getattr(args, dest) for dest in ARCH_OVERRIDES},
    )


def parse_train_args(argv: Optional[Sequence[str]] = None, prog: str = "fullshard train") -> TrainConfig:
    """Parse and validate `fullshard train` arguments (exits 2 on bad input)."""
    p = OneLineArgumentParser(prog=prog, description="Train a GPT language model (fairseq-train flags).")
    add_train_args(p)
    return validate(p, p.parse_args(argv))
