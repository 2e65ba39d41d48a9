"""Command-line flags of `fullshard train` (fairseq-train names) and their validation.

The flags are declared once, as the fields of the option groups in `config.py`;
`add_train_args` registers them. Validation runs on the launching process
before any rank starts. Each bad input is reported as ONE line
``fullshard train: error: <what> ... <what to do>`` on stderr with exit code 2
(argparse's `error()` convention), and nothing is written: no save directory,
no log file.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from typing import NoReturn, Optional, Sequence

import torch

from fullshard.data import DataError, TokenBlockDataset, read_meta
from fullshard.data.tokenizer import different_tokenizers
from fullshard.models import ARCHS, ArchSpec, build_model
from fullshard.train import checkpoint_record, hf_options, pipeline_checks
from fullshard.train.config import (
    START_METHODS,
    TRAIN_GROUPS,
    GlobalBatchError,
    ModelOptions,
    OptimizationOptions,
    TrainConfig,
    derive_update_freq,
    node_range,
)
from fullshard.train.flags import add_options, option_string, values_of
from fullshard.train.invariance import resolve_batch  # noqa: F401 (also imported from here)
from fullshard.train.optimizers import check_flags as check_optimizer_flags


class OneLineArgumentParser(argparse.ArgumentParser):
    """One ``prog: error: msg`` line per error; no abbreviated flags (``--save-interval`` was read as
    ``--save-interval-updates``)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **{"allow_abbrev": False, **kwargs})

    def fail(self, message: str) -> NoReturn:
        sys.stderr.write(f"{self.prog}: error: {message}\n")
        sys.exit(2)

    def error(self, message: str) -> NoReturn:
        """argparse's own errors (unknown flag, bad value): one line too, no usage block."""
        self.fail(f"{message}; see `{self.prog} --help`")


# fairseq's model-override flags (argparse dest, also the TrainConfig field) -> the ArchSpec field each sets.
ARCH_OVERRIDES = {"decoder_layers": "num_layers", "decoder_embed_dim": "embed_dim",
                  "decoder_attention_heads": "num_heads", "decoder_ffn_embed_dim": "ffn_embed_dim"}


def add_model_args(p: argparse.ArgumentParser, arch: dict, group: bool = True) -> None:
    """Register --arch (with ``arch``: its overridden default, help, required, choices) and the
    --decoder-* overrides on ``p``, for a command that is not `fullshard train`."""
    add_options(p, ModelOptions, ("arch", *ARCH_OVERRIDES), group=group, overrides={"arch": arch})


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
    """Register the fairseq-train style flags on `p`: every field of `config.TRAIN_GROUPS`."""
    for group in TRAIN_GROUPS:
        add_options(p, group)


def option(name: str) -> str:
    """The option a TrainConfig field is given with (``collective_timeout_s`` -> ``--collective-timeout``)."""
    return option_string(TrainConfig, name)


def launched_world_size(nproc_per_node: int, nnodes: int = 1) -> int:
    """World size: WORLD_SIZE under an existing torchrun, else --nproc-per-node x --nnodes."""
    if under_torchrun():
        return int(os.environ["WORLD_SIZE"])
    return nproc_per_node * nnodes


def under_torchrun() -> bool:
    """True when this process is already a rank started by torchrun / elastic."""
    return all(os.environ.get(k) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))


def _resolve_log_format(fmt: Optional[str]) -> str:
    tty = sys.stdout.isatty() and sys.stderr.isatty()
    if fmt is None:
        return "tqdm" if tty else "simple"
    if fmt == "tqdm" and not tty:
        return "simple"
    return fmt


def _check_positive(p: OneLineArgumentParser, args) -> None:
    for name in ("tokens_per_sample", "batch_size", "update_freq", "nproc_per_node", "log_interval",
                 "threads_per_rank"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            p.fail(f"{option(name)} must be >= 1, got {getattr(args, name)}")
    for name in ("warmup_updates", "total_num_update", "max_update", "max_epoch", "max_restarts",
                 "validate_interval_updates", "save_interval_updates", "weight_decay", "clip_norm",
                 "end_learning_rate"):
        if getattr(args, name) < 0:
            p.fail(f"{option(name)} must be >= 0, got {getattr(args, name)}")
    if args.lr <= 0:
        p.fail(f"--lr must be > 0, got {args.lr}")
    if not 0 <= args.seed < 2**32:  # torch.manual_seed's range; a rank would fail after the launch
        p.fail(f"--seed must be in [0, 2**32), got {args.seed}")
    if args.keep_interval_updates < -1:
        p.fail(f"--keep-interval-updates must be >= -1 (0 or -1 keep all), got {args.keep_interval_updates}")
    for name in ("collective_timeout_s", "rdzv_timeout_s"):
        if not getattr(args, name) > 0:
            p.fail(f"{option(name)} must be > 0 seconds, got {getattr(args, name)}")
    if not 0.0 <= args.dropout < 1.0:
        p.fail(f"--dropout must be in [0, 1), got {args.dropout}")
    problem = check_optimizer_flags(args, {f.name: f.default for f in dataclasses.fields(OptimizationOptions)})
    if problem:
        p.fail(problem)


def _check_schedule(p: OneLineArgumentParser, args) -> None:
    if args.lr_scheduler in ("polynomial_decay", "cosine"):
        total = args.total_num_update or args.max_update
        if total <= 0:
            p.fail(f"--lr-scheduler {args.lr_scheduler} needs --total-num-update or --max-update")
        if total <= args.warmup_updates:
            p.fail(f"--total-num-update ({total}) must exceed --warmup-updates ({args.warmup_updates})")


def _check_invariance(p: OneLineArgumentParser, args, world_size: int) -> int:
    """Check --global-batch-size / --update-freq / --world-size-invariant; returns the update freq."""
    if args.world_size_invariant and args.ddp_backend != "fully_sharded":
        p.fail("--world-size-invariant needs --ddp-backend fully_sharded (torch DDP's all-reduce order depends "
               "on the world size); use --ddp-backend fully_sharded or drop --world-size-invariant")
    try:
        return resolve_batch(args, world_size)[0]
    except GlobalBatchError as e:
        p.fail(str(e))


def _check_memory_flags(p: OneLineArgumentParser, args, world_size: int, update_freq: int) -> int:
    """Check the mixed-precision / offload / checkpointing flags; returns the loss-scale window."""
    if args.fp16 and args.bf16:
        p.fail("--fp16 and --bf16 are mutually exclusive; pick one")
    if args.cpu_offload and args.ddp_backend != "fully_sharded":
        p.fail("--cpu-offload needs --ddp-backend fully_sharded (c10d keeps whole parameters on the device)")
    if args.fsdp_version is not None and args.ddp_backend != "fully_sharded":
        p.fail(f"--fsdp-version {args.fsdp_version} needs --ddp-backend fully_sharded (c10d is torch DDP, which "
               "shards nothing); drop --fsdp-version or use --ddp-backend fully_sharded")
    if args.fp16_init_scale <= 0:
        p.fail(f"--fp16-init-scale must be > 0, got {args.fp16_init_scale}")
    if args.min_loss_scale < 0:
        p.fail(f"--min-loss-scale must be >= 0, got {args.min_loss_scale}")
    if args.fp16_scale_window is None:
        # fairseq's rule (trainer.py): the window shrinks as more gradients are summed per update.
        return max(1, int(2**14 / world_size / update_freq))
    if args.fp16_scale_window < 1:
        p.fail(f"--fp16-scale-window must be >= 1, got {args.fp16_scale_window}")
    return args.fp16_scale_window


def check_data(p: OneLineArgumentParser, data_dir: str) -> dict:
    """The meta.json of a preprocessed data directory; fails (one line, exit 2) on anything else."""
    if not os.path.isdir(data_dir):
        p.fail(f"data directory {data_dir!r} does not exist; create it with `fullshard preprocess --destdir "
               f"{data_dir} ...`")
    if not os.path.isfile(os.path.join(data_dir, "meta.json")):
        p.fail(f"no meta.json in {data_dir!r}; it is not a preprocessed data directory, run `fullshard preprocess "
               f"--destdir {data_dir} ...` first")
    try:
        meta = read_meta(data_dir)
    except DataError as e:  # its message says what to do
        p.fail(str(e))
    except (OSError, ValueError) as e:
        p.fail(f"cannot read {os.path.join(data_dir, 'meta.json')}: {e}; re-run `fullshard preprocess`")
    return meta


def _check_split_sizes(p: OneLineArgumentParser, args, meta: dict, world_size: int,
                       global_batch: Optional[int]) -> None:
    for split in ("train", "valid"):
        have = _split_tokens(meta, split)
        if have is None:
            p.fail(f"no {split!r} split in {args.data_dir!r}; re-run `fullshard preprocess` to write train and "
                   "valid splits")
        # Training needs one full global batch; validation runs on what the split has (one sample or more).
        # Samples of T tokens overlap by one (the last target of one is the first input of the next).
        need = (args.batch_size * world_size if split == "train" else 1) * args.tokens_per_sample + 1
        if split == "valid" and have < need:
            p.fail(f"the 'valid' split of {args.data_dir!r} has {have:,} tokens, fewer than one sample of "
                   f"--tokens-per-sample {args.tokens_per_sample} + 1; lower --tokens-per-sample or preprocess "
                   "more text")
        if have < need:
            p.fail(f"the {split!r} split of {args.data_dir!r} has {have:,} tokens, fewer than one batch "
                   f"(--batch-size {args.batch_size} x {world_size} ranks x --tokens-per-sample "
                   f"{args.tokens_per_sample} + 1 = {need:,}); lower --batch-size, --tokens-per-sample or "
                   f"--nproc-per-node, or preprocess more text")
        try:  # checks the split file against meta.json
            blocks = len(TokenBlockDataset(args.data_dir, split, args.tokens_per_sample))
        except (DataError, ValueError) as e:
            p.fail(str(e))
        if split == "train" and global_batch is not None and args.world_size_invariant and blocks < global_batch:
            p.fail(f"the 'train' split of {args.data_dir!r} has {blocks:,} samples of --tokens-per-sample "
                   f"{args.tokens_per_sample}, fewer than one global batch of {global_batch} (--world-size-invariant "
                   "takes whole global batches only); lower --global-batch-size or preprocess more text")


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


def _check_restore(p: OneLineArgumentParser, args, shape: ArchSpec, vocab_size: int,
                   tokenizer: Optional[str]) -> None:
    """A checkpoint that would be resumed must be readable and of this model: tensor names and shapes,
    the recorded shape (`shape`), which also holds what no tensor shows (the heads), and the data's
    tokenizer (same-sized vocabularies of two tokenizers would otherwise resume silently)."""
    # Lazy for start-up speed: save_load imports torch.distributed.checkpoint (about 0.7 s of every
    # `fullshard` command); only a run with a checkpoint to resume needs it.
    from fullshard.checkpoint import CheckpointError, verify
    from fullshard.checkpoint.save_load import check_model_keys, resolve

    path = args.restore_file
    if not os.path.isabs(path) and not os.path.exists(path):
        path = os.path.join(args.save_dir, path)
    if os.path.exists(path) and not os.path.isdir(path):
        p.fail(f"--restore-file {path!r} is not a checkpoint directory")
    path = checkpoint_record.resume_path(args.save_dir, args.restore_file, vars(args))[0]  # what the run loads
    if path is None:
        if args.restore_file != "checkpoint_last":
            p.fail(f"--restore-file {args.restore_file!r} does not exist; give a checkpoint directory")
        return
    try:
        resolved = resolve(path)
        verify(resolved)
        model = build_model(shape, device="meta", vocab_size=vocab_size, max_positions=shape.max_positions)
        check_model_keys(resolved, model.state_dict())
        saved, _, recorded = checkpoint_record.read(resolved)
        saved = saved or {}
    except (CheckpointError, OSError, ValueError) as e:
        p.fail(f"cannot resume from {path!r}: {str(e).split('] ', 1)[-1]}; use another --save-dir, or "
               "--restore-file / --finetune-from-model with a checkpoint of this --arch and --decoder-* shape")
    try:
        trained = resolve_arch(saved["arch"], saved) if "arch" in saved else shape
    except ValueError:  # an arch this version does not know: the tensor check above stands
        trained = shape
    if different_tokenizers(recorded, tokenizer):
        p.fail(f"cannot resume from {path!r}: it was trained on data preprocessed with the tokenizer "
               f"{recorded}, {args.data_dir!r} with {tokenizer}; use another --save-dir, or data of that one")
    if trained != shape:
        p.fail(f"cannot resume from {path!r}: it was trained with {trained.describe()}, this run has "
               f"{shape.describe()}; use another --save-dir, or the --arch / --decoder-* flags it was trained with")
    # adam and cpu_adam keep the same AdamW state; another optimizer's state would not load.
    kind = {"cpu_adam": "adam"}
    before = saved.get("optimizer", "adam")
    if not args.reset_optimizer and kind.get(before, before) != kind.get(args.optimizer, args.optimizer):
        p.fail(f"cannot resume from {path!r}: it was trained with --optimizer {before}, this run has --optimizer "
               f"{args.optimizer}; add --reset-optimizer to start a fresh {args.optimizer} from its weights, or "
               f"resume with --optimizer {before}")


_FP16_WARNED = []


def _warn_fp16_on_cpu(args) -> None:
    """--fp16 without a GPU: warn once that bf16 is much faster on a CPU."""
    if args.fp16 and not torch.cuda.is_available() and not _FP16_WARNED:
        _FP16_WARNED.append(True)
        sys.stderr.write("fullshard train: warning: --fp16 on a CPU is slow (no fast fp16 kernels; measured about "
                         "100 tokens/s against 1,800 at fp32); --bf16 is much faster here\n")


def _check_nodes(p: OneLineArgumentParser, args) -> str:
    """Check --nnodes / --node-rank / --rdzv-* / --hybrid-shard; returns the endpoint."""
    min_nodes, max_nodes = node_range(args.nnodes)
    if min_nodes < 1:
        p.fail(f"--nnodes must be >= 1, got {args.nnodes}")
    if min_nodes > max_nodes:
        p.fail(f"--nnodes {args.nnodes}: MIN must not exceed MAX; give MIN:MAX, e.g. {max_nodes}:{min_nodes}")
    if not 0 <= args.node_rank < max_nodes:
        p.fail(f"--node-rank must be in [0, {max_nodes}) for --nnodes {args.nnodes}, got {args.node_rank}")
    endpoint = args.rdzv_endpoint or "localhost:0"
    host, _, port = endpoint.rpartition(":")
    if not host or not port.isdigit() or not 0 <= int(port) < 65536:
        p.fail(f"--rdzv-endpoint {endpoint!r} is not HOST:PORT (e.g. 10.0.0.1:29400)")
    if max_nodes > 1 and int(port) == 0:
        p.fail(f"--nnodes {args.nnodes} needs --rdzv-endpoint HOST:PORT, the same on every node "
               "(HOST: node 0's address, PORT: a free port there; node 0 hosts the rendezvous and must stay up)")
    for name in ("rdzv_last_call_s", "rdzv_keep_alive_s"):
        if getattr(args, name) < 1:
            p.fail(f"{option(name)} must be >= 1 second, got {getattr(args, name)}")
    if args.hybrid_shard and args.ddp_backend != "fully_sharded":
        p.fail("--hybrid-shard needs --ddp-backend fully_sharded")
    if args.hybrid_shard and not args.reshard_after_forward:
        p.fail("--hybrid-shard and --no-reshard-after-forward are exclusive; pick one sharding strategy")
    return endpoint


def elastic_world_sizes(nproc_per_node: int, nnodes) -> list:
    """The world sizes an ``--nnodes`` range can run at: ``nproc_per_node * n`` for each node count ``n``
    in it (one entry for a plain N; under torchrun, its WORLD_SIZE)."""
    if under_torchrun():
        return [int(os.environ["WORLD_SIZE"])]
    min_nodes, max_nodes = node_range(nnodes)
    return [nproc_per_node * n for n in range(min_nodes, max_nodes + 1)]


def _check_elastic_batch(p: OneLineArgumentParser, args) -> None:
    """An elastic range keeps the update the same at every world size only through --global-batch-size,
    which each of its world sizes must divide (in micro-batches of --batch-size)."""
    min_nodes, max_nodes = node_range(args.nnodes)
    if min_nodes == max_nodes:
        return
    if args.global_batch_size is None:
        p.fail(f"--nnodes {args.nnodes} needs --global-batch-size: an elastic job restarts at another world "
               "size, and with a fixed --update-freq its update would change size with it")
    sizes = elastic_world_sizes(args.nproc_per_node, args.nnodes)
    for world in sizes:
        try:
            derive_update_freq(args.global_batch_size, args.batch_size, world)
        except GlobalBatchError as e:
            p.fail(f"{e} (--nnodes {args.nnodes} x --nproc-per-node {args.nproc_per_node} can run at "
                   f"{', '.join(map(str, sizes))} ranks)")


def check_tokens_per_sample(p: OneLineArgumentParser, args, shape: ArchSpec) -> int:
    """The position-table size of ``shape`` (``args.arch``'s); fails (one line, exit 2) when
    ``args.tokens_per_sample`` exceeds it."""
    max_positions = shape.max_positions
    if args.tokens_per_sample > max_positions:
        p.fail(f"--tokens-per-sample {args.tokens_per_sample} exceeds the {max_positions} positions of "
               f"--arch {args.arch}; use --tokens-per-sample <= {max_positions}")
    return max_positions


def _check_pipeline(p: OneLineArgumentParser, args, world_size: int) -> int:
    """The --pipeline-* flags (`pipeline_checks.check`); returns the data-parallel size, world / P."""
    if args.pipeline_parallel_size == 1:
        ignored = [f"--{f.name.replace('_', '-')}" for f in dataclasses.fields(TrainConfig)
                   if f.name.startswith("pipeline_") and f.name != "pipeline_parallel_size"
                   and getattr(args, f.name) != f.default]
        if ignored:
            p.fail(f"{', '.join(ignored)}: {'apply' if len(ignored) > 1 else 'applies'} only under pipelining; "
                   f"set --pipeline-parallel-size > 1 or drop {'them' if len(ignored) > 1 else 'it'}")
    else:
        try:
            shape = resolve_arch(args.arch, vars(args))
            pipeline_checks.check(args, world_size, shape.num_layers)
        except ValueError as e:
            p.fail(str(e))
    return world_size // args.pipeline_parallel_size


def validate(p: OneLineArgumentParser, args) -> TrainConfig:
    """Check every input; on the first problem print one line and exit 2. Else a TrainConfig."""
    _check_positive(p, args)
    _check_schedule(p, args)
    rdzv_endpoint = _check_nodes(p, args)
    pet = os.environ.get("PET_START_METHOD")
    if args.start_method is None and pet and pet not in START_METHODS:
        p.fail(f"PET_START_METHOD={pet!r} is not a start method ({', '.join(START_METHODS)}); fix or unset it, "
               "or give --start-method")
    _check_elastic_batch(p, args)
    # An elastic range is checked at its largest world size (the most data per update).
    world_size = max(elastic_world_sizes(args.nproc_per_node, args.nnodes))
    world_size = _check_pipeline(p, args, world_size)  # the data-parallel size from here on
    update_freq = _check_invariance(p, args, world_size)
    scale_window = _check_memory_flags(p, args, world_size, update_freq)
    meta = check_data(p, args.data_dir)
    try:
        shape = resolve_arch(args.arch, vars(args))
    except ValueError as e:
        p.fail(str(e))
    hf_positions = hf_options.check(p, args, meta)  # --hf-model: the model's positions
    if hf_positions is None:
        check_tokens_per_sample(p, args, shape)
    _check_split_sizes(p, args, meta, world_size, resolve_batch(args, world_size)[1])
    if args.log_file and os.path.isdir(args.log_file):
        p.fail(f"--log-file {args.log_file!r} is a directory; give a file path")
    log_dir = os.path.dirname(os.path.abspath(args.log_file)) if args.log_file else None
    if log_dir and os.path.exists(log_dir) and not os.path.isdir(log_dir):
        p.fail(f"the directory of --log-file {args.log_file!r} is a file; give a path in a directory")
    if args.save_on_sigterm and args.no_save:
        p.fail("--save-on-sigterm and --no-save are exclusive: drop --no-save to save on SIGTERM")
    if not args.no_save and os.path.exists(args.save_dir) and not os.path.isdir(args.save_dir):
        p.fail(f"--save-dir {args.save_dir!r} exists and is not a directory")
    if args.finetune_from_model and not os.path.exists(args.finetune_from_model):
        p.fail(f"--finetune-from-model {args.finetune_from_model!r} does not exist; give a consolidated "
               "file or a checkpoint directory")
    if args.finetune_from_model:
        try:
            source = checkpoint_record.read(args.finetune_from_model)[2]
        except (OSError, ValueError, RuntimeError):  # unreadable: loading it names the problem
            source = None
        if different_tokenizers(source, meta.get("tokenizer")):
            p.fail(f"--finetune-from-model {args.finetune_from_model!r} was trained on data preprocessed with the "
                   f"tokenizer {source}, {args.data_dir!r} with {meta['tokenizer']}; fine-tune on data of that one")
    if hf_positions is None:  # --hf-model: the checkpoint's keys are checked when it loads
        _check_restore(p, args, shape, int(meta["vocab_size"]), meta.get("tokenizer"))
    elif args.quantize_base != "none":
        hf_options.check_nf4_restore(p, args, elastic_world_sizes(args.nproc_per_node, args.nnodes))
    _warn_fp16_on_cpu(args)
    cfg = config_from_args(args, shape=shape, vocab_size=int(meta["vocab_size"]), world_size=world_size,
                           scale_window=scale_window, rdzv_endpoint=rdzv_endpoint)
    return cfg if hf_positions is None else dataclasses.replace(cfg, max_positions=hf_positions)


def config_from_args(args, *, shape: ArchSpec, vocab_size: int, world_size: int, scale_window: int,
                     rdzv_endpoint: str = "localhost:0") -> TrainConfig:
    """The TrainConfig of parsed `fullshard train` arguments (no checks; see `validate`): every
    flag's value, with the values resolved from others in place of the given ones.

    Args:
        args: the train parser's Namespace.
        shape: the model's shape (``args.arch`` with the --decoder-* overrides); the config records
            its effective sizes and position-table size, so checkpoints record the shape trained.
        vocab_size: token ids of the model.
        world_size: ranks of the run.
        scale_window: resolved fp16 loss-scale window, updates.
        rdzv_endpoint: resolved rendezvous ``host:port`` (multi-node runs).

    Raises:
        GlobalBatchError: see `resolve_batch` (`validate` reports it first).
    """
    update_freq, global_batch_size = resolve_batch(args, world_size)
    return TrainConfig(**{
        **values_of(TrainConfig, args), **arch_fields(shape), "max_positions": shape.max_positions,
        "vocab_size": vocab_size, "update_freq": update_freq, "global_batch_size": global_batch_size,
        "adam_betas": tuple(args.adam_betas), "log_format": _resolve_log_format(args.log_format),
        "nproc_per_node": world_size if under_torchrun() else args.nproc_per_node,
        "fp16_scale_window": scale_window, "rdzv_endpoint": rdzv_endpoint,
        "checkpoint_activations": args.checkpoint_activations or args.offload_activations})


def parse_train_args(argv: Optional[Sequence[str]] = None, prog: str = "fullshard train") -> TrainConfig:
    """Parse and validate `fullshard train` arguments (exits 2 on bad input)."""
    p = OneLineArgumentParser(prog=prog, description="Train a GPT language model (fairseq-train flags).")
    add_train_args(p)
    return validate(p, p.parse_args(argv))
