"""The flags of `fullshard train`, grouped, and the validated training configuration.

Each group is a frozen options dataclass whose fields are the flags of one
``--help`` section (fairseq-train's names); a field's help text is its
documentation (see `flags.py`). `TrainConfig` is all the groups together plus
the sizes read from the architecture and the data; it is built once, on the
launching process, from the parsed and checked command line (`options.py`),
and is picklable so the elastic launcher can hand it to spawned ranks
unchanged. `fullshard plan`, `eval-lm` and `generate` register the fields of
these groups they need. A new flag is one field here and, when it needs one,
one check in `options.validate`.
"""
from __future__ import annotations

import argparse
import ast
import dataclasses
from dataclasses import dataclass
from typing import ClassVar, Mapping, Optional, Tuple

from fullshard.models import ARCHS, ArchSpec, arch_spec
from fullshard.train.flags import flag
from fullshard.train.lr_scheduler import SCHEDULERS
from fullshard.train.pipeline_checks import SCHEDULES


def node_range(nnodes) -> Tuple[int, int]:
    """``--nnodes`` as ``(min_nodes, max_nodes)``: ``"2"`` (or 2, as older checkpoints record it)
    -> ``(2, 2)``, ``"1:4"`` -> ``(1, 4)``; no range check (`options.validate` does it).

    Raises:
        ValueError: not ``N`` or ``MIN:MAX`` of integers.
    """
    if isinstance(nnodes, int):
        return nnodes, nnodes
    parts = str(nnodes).split(":")
    try:
        low, high = (int(parts[0]), int(parts[-1])) if len(parts) <= 2 else (None, None)
    except ValueError:
        low = None
    if low is None:
        raise ValueError(f"expected N or MIN:MAX (e.g. 2 or 1:4), got {nnodes!r}")
    return low, high


def parse_nnodes(text: str) -> str:
    """``--nnodes`` text in its canonical form: ``"2"`` and ``"2:2"`` -> ``"2"``, ``"1:4"`` -> ``"1:4"``.

    Raises:
        argparse.ArgumentTypeError: not ``N`` or ``MIN:MAX`` of integers (argparse prints one line).
    """
    try:
        low, high = node_range(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return str(low) if low == high else f"{low}:{high}"


def parse_betas(text: str) -> Tuple[float, float]:
    """``--adam-betas '(0.9,0.98)'`` -> ``(0.9, 0.98)``.

    Raises:
        argparse.ArgumentTypeError: not a pair of numbers (argparse prints it as one line).
    """
    try:
        value = ast.literal_eval(text)
        betas = tuple(float(b) for b in value)
    except (ValueError, SyntaxError, TypeError):
        raise argparse.ArgumentTypeError(f"expected a pair like '(0.9,0.98)', got {text!r}") from None
    if len(betas) != 2:
        raise argparse.ArgumentTypeError(f"expected two betas like '(0.9,0.98)', got {text!r}")
    return betas


def parse_adafactor_eps(text: str) -> Tuple[Optional[float], float]:
    """``--adafactor-eps '(None,1e-3)'`` -> ``(None, 0.001)``: torch.optim.Adafactor's ``eps``
    (epsilon1 of the second-moment denominator, None = the dtype's eps; epsilon2 of the step scale).

    Raises:
        argparse.ArgumentTypeError: not a pair whose first item is None or a number and second a number.
    """
    try:
        first, second = ast.literal_eval(text)
        pair = (None if first is None else float(first), float(second))
    except (ValueError, SyntaxError, TypeError):
        raise argparse.ArgumentTypeError(f"expected a pair like '(None,1e-3)', got {text!r}") from None
    return pair


def parse_ns_coefficients(text: str) -> Tuple[float, float, float]:
    """``--muon-ns-coefficients '(3.4445,-4.775,2.0315)'`` -> the three floats (a, b, c) of Muon's
    quintic Newton-Schulz iteration.

    Raises:
        argparse.ArgumentTypeError: not three numbers.
    """
    try:
        value = tuple(float(c) for c in ast.literal_eval(text))
    except (ValueError, SyntaxError, TypeError):
        value = ()
    if len(value) != 3:
        raise argparse.ArgumentTypeError(f"expected three numbers like '(3.4445,-4.775,2.0315)', got {text!r}")
    return value


OPTIMIZERS = ("adam", "cpu_adam", "muon", "adafactor", "lamb")
"""``--optimizer`` choices; see ``train/optimizers.py``."""

DEFAULT_FSDP_VERSION = 1
"""``--fsdp-version`` when not given: the FullyShardedDataParallel wrapper. On the 2-core CPU
machine's quick bench (6 alternating runs, 2026-11-24) fully_shard took 1.02x the wrapper's median
step time in fp32 and 1.08x in bf16 (CPU seconds per step 1.04x, 1.03x): AdamW's per-parameter
ops on DTensor parameters cost about 8 ms more per step; forward and backward cost the same."""


class GlobalBatchError(ValueError):
    """A global batch that the micro-batch size and world size cannot make; the message is one line."""


def derive_update_freq(global_batch_size: int, batch_size: int, world_size: int) -> int:
    """Micro-batches per rank per update, ``global_batch_size / (batch_size * world_size)``.

    Args:
        global_batch_size: sequences per update over all ranks (``--global-batch-size``).
        batch_size: sequences per rank per micro-batch (``--batch-size``).
        world_size: ranks.

    Raises:
        GlobalBatchError: a size < 1, or ``batch_size * world_size`` not dividing
            ``global_batch_size``; one line saying what to change.
    """
    if global_batch_size < 1:
        raise GlobalBatchError(f"--global-batch-size must be >= 1, got {global_batch_size}")
    if batch_size < 1 or world_size < 1:
        raise GlobalBatchError(f"--batch-size and the world size must be >= 1, got {batch_size} and {world_size}")
    per_step = batch_size * world_size
    if global_batch_size % per_step:
        raise GlobalBatchError(
            f"--global-batch-size {global_batch_size} is not divisible by --batch-size {batch_size} x {world_size} "
            f"ranks = {per_step}; use a multiple of {per_step}, or a --batch-size and number of ranks whose "
            f"product divides {global_batch_size}")
    return global_batch_size // per_step


@dataclass(frozen=True, kw_only=True)
class ModelOptions:
    """The GPT: a named architecture, fairseq's ``--decoder-*`` overrides of its shape, dropout."""

    TITLE: ClassVar[str] = "model"
    arch: str = flag("transformer_lm_gpt_tiny", f"model architecture, one of {', '.join(ARCHS)} "
                     "(default: %(default)s)", aliases=("-a",), metavar="ARCH")
    # The decoder_* fields: None = the arch's. `options.validate` stores the effective
    # values, so checkpoints record the shape they were trained with.
    decoder_layers: Optional[int] = flag(None, "transformer blocks, overriding the --arch's (default: the --arch's)",
                                         type=int, metavar="L")
    decoder_embed_dim: Optional[int] = flag(None, "model width, overriding the --arch's (default: the --arch's)",
                                            type=int, metavar="C")
    decoder_attention_heads: Optional[int] = flag(None, "attention heads, dividing the width (default: the "
                                                  "--arch's)", type=int, metavar="H")
    decoder_ffn_embed_dim: Optional[int] = flag(None, "MLP hidden width (default: 4 x the width, as fairseq's "
                                                "base_gpt3_architecture)", type=int, metavar="F")
    dropout: float = flag(0.0, "dropout probability (default: %(default)s)")


START_METHODS = ("spawn", "fork", "forkserver")
"""How torch elastic may start the ranks (torchrun's ``--start-method`` choices)."""


@dataclass(frozen=True, kw_only=True)
class DistributedOptions:
    """Data parallelism: backend and sharding, memory features, and the launch of the ranks."""

    TITLE: ClassVar[str] = "distributed"
    ddp_backend: str = flag("fully_sharded", "fully_sharded = fullshard FSDP; c10d = torch DistributedDataParallel "
                            "baseline", choices=("fully_sharded", "c10d"))
    # FULL_SHARD when True, SHARD_GRAD_OP when False.
    reshard_after_forward: bool = flag(True, "keep full params between forward and backward (SHARD_GRAD_OP, "
                                       "ZeRO-2-like)", option="--no-reshard-after-forward")
    # Under torchrun `validate` stores the ranks torchrun started.
    nproc_per_node: int = flag(1, "ranks to launch on this machine (default: 1)")
    # CPUOffload(offload_params=True).
    cpu_offload: bool = flag(False, "fully_sharded: keep parameter/gradient shards and the optimizer step on the CPU")
    # no_sync: Psi more gradient elements per rank; reduce_scatter: K times the communication.
    accumulate_mode: str = flag(
        "no_sync", "with --update-freq > 1: no_sync accumulates unsharded gradients locally and reduce-scatters "
        "once per update (faster, more memory); reduce_scatter reduce-scatters every micro-batch into the "
        "gradient shards (less memory). c10d: whether DDP all-reduces every micro-batch (default: %(default)s)",
        choices=("no_sync", "reduce_scatter"))
    hybrid_shard: bool = flag(False, "fully_sharded: HYBRID_SHARD, shard within a node and replicate across nodes")
    # [Note: world-size-invariant training] in trainer.py. Off by default until its cost is measured.
    world_size_invariant: bool = flag(
        False, "fully_sharded: bitwise the same losses, gradient norms and parameters at every world size "
        "(for a fixed --global-batch-size, --batch-size and --threads-per-rank): each micro-batch has a global "
        "index that fixes its data and dropout, gradients and logged sums are added in that order",
        negatable=True)
    # None: cores / ranks on this machine; under --world-size-invariant on a CPU, 1.
    threads_per_rank: Optional[int] = flag(
        None, "intra-op CPU threads of each rank (default: the cores divided among this machine's ranks; "
        "1 under --world-size-invariant on a CPU, where sums depend on the thread count)", type=int, metavar="N")
    # Hugging Face Accelerate's flag name. None: DEFAULT_FSDP_VERSION (TrainConfig stores the
    # resolved version). Both versions give the same losses and checkpoints (train/sharding.py).
    fsdp_version: Optional[int] = flag(
        None, "fully_sharded: 1 = the FullyShardedDataParallel wrapper, one unit per transformer block by "
        "auto-wrap; 2 = fullshard.fully_shard on each transformer block, then the root (DTensor parameters). "
        "Same engine, losses and checkpoint format; a run saved with one resumes with the other "
        f"(default: {DEFAULT_FSDP_VERSION}; --optimizer muon: 1 keeps each matrix on one rank, 2 orthogonalizes "
        "every matrix on every rank)", type=int, choices=(1, 2))
    collective_timeout_s: float = flag(300.0, "a rank waiting longer in one collective exits naming it, its unit "
                                       "and the ranks that did not arrive (default: %(default)s)",
                                       option="--collective-timeout", metavar="SECONDS")
    debug_collectives: bool = flag(False, "before each collective check that every rank issues the same one "
                                   "(also FULLSHARD_DEBUG=1)")
    # None: PET_START_METHOD (torchrun's variable for its --start-method), else spawn; `launch` resolves it.
    start_method: Optional[str] = flag(
        None, "how the launched ranks start (torchrun's --start-method): spawn, a fresh interpreter per rank; "
        "fork, a copy of the launcher, which starts a rank in well under a second instead of re-importing "
        "torch (the launcher must not have initialized CUDA); forkserver (default: $PET_START_METHOD, else "
        "spawn)", choices=START_METHODS)
    max_restarts: int = flag(0, "after a rank dies, restart all ranks up to this many times; each resumes from "
                             "checkpoint_last (default: 0)")
    # `validate` stores "N" or "MIN:MAX" with MIN < MAX; `node_range` reads it (also an older int).
    nnodes: str = flag("1", "launchers (nodes) taking part: N, or MIN:MAX (torchrun's syntax) for an elastic job "
                       "that runs on any number of nodes in the range: when a node dies the others restart "
                       "(--max-restarts) without it, when one joins all restart with it, each time resuming "
                       "from checkpoint_last (needs --global-batch-size; node 0 hosts the rendezvous and must "
                       "stay up) (default: 1)", type=parse_nnodes, metavar="N|MIN:MAX")
    node_rank: int = flag(0, "this node's number; node 0 hosts the rendezvous")
    # `validate` stores the resolved address: "localhost:0" (a free port) on one node.
    rdzv_endpoint: Optional[str] = flag(None, "c10d rendezvous address, the same on every node (needed with "
                                        "--nnodes > 1 or MIN:MAX)", metavar="HOST:PORT")
    rdzv_timeout_s: float = flag(900.0, "wait this long for every node to join (default: %(default)s)",
                                 option="--rdzv-timeout", metavar="SECONDS")
    # torch's c10d rendezvous settings last_call_timeout and keep_alive_interval (whole seconds).
    rdzv_last_call_s: int = flag(30, "--nnodes MIN:MAX: once MIN nodes are in a rendezvous, wait this long for "
                                 "more before starting (default: %(default)s)", option="--rdzv-last-call",
                                 metavar="SECONDS")
    rdzv_keep_alive_s: int = flag(5, "several nodes: each launcher's heartbeat interval; a launcher silent for 3 "
                                  "intervals counts as dead and an elastic job goes on without it "
                                  "(default: %(default)s)", option="--rdzv-keep-alive", metavar="SECONDS")
    # `validate` sets it with offload_activations too.
    checkpoint_activations: bool = flag(False, "recompute each transformer block's activations in backward")
    offload_activations: bool = flag(False, "keep checkpointed activations in host memory (implies "
                                     "--checkpoint-activations)")


PIPELINE_SCHEDULES = SCHEDULES  # torch.distributed.pipelining's synchronous schedules (zero-bubble included)


@dataclass(frozen=True, kw_only=True)
class PipelineOptions:
    """Pipeline parallelism over a (pp, dp) mesh: the GPT cut into stages, torch's schedules (docs/pipeline.md)."""

    TITLE: ClassVar[str] = "pipeline"
    pipeline_parallel_size: int = flag(1, "pipeline ranks P: the world is a (P, world / P) mesh of pipeline x "
                                       "data-parallel ranks (default: %(default)s, no pipelining)")
    pipeline_schedule: str = flag("1F1B", "torch.distributed.pipelining schedule; the zero-bubble ones split "
                                  "backward (docs/pipeline.md) (default: %(default)s)", choices=PIPELINE_SCHEDULES)
    # None: P (one micro-batch in flight per pipeline rank).
    pipeline_microbatches: Optional[int] = flag(
        None, "pipeline micro-batches each --batch-size batch is split into (default: P)", type=int, metavar="M")
    pipeline_stages_per_rank: int = flag(1, "stages per pipeline rank V (Interleaved1F1B, LoopedBFS, "
                                         "InterleavedZeroBubble need V >= 2; ZBVZeroBubble, DualPipeV V = 2) "
                                         "(default: %(default)s)")
    pipeline_split: str = flag("even", "layers per stage: even (the remainder to the middle stages), auto (the "
                               "planner's balanced split) or N,N,... (P x V counts adding up to the layers)")
    pipeline_grad_accumulation: str = flag(
        "reduce_scatter", "over the pipeline micro-batches: reduce_scatter each into the gradient shards (least "
        "memory) or keep unsharded gradients and reduce once per update (least communication) "
        "(default: %(default)s)", choices=("reduce_scatter", "unsharded"))


@dataclass(frozen=True, kw_only=True)
class PrecisionOptions:
    """Mixed precision. fully_sharded: MixedPrecision(low, fp32 reduce, low buffers); c10d: torch.autocast.
    Master parameters and optimizer state stay fp32."""

    TITLE: ClassVar[str] = "mixed precision"
    fp16: bool = flag(False, "float16 compute with dynamic loss scaling")
    bf16: bool = flag(False, "bfloat16 compute (no loss scaling)")
    fp16_init_scale: float = flag(128.0, "initial loss scale (default: 128)")
    # `validate` stores the resolved window.
    fp16_scale_window: Optional[int] = flag(None, "updates without overflow before the loss scale doubles "
                                            "(default: 2**14 / world size / update freq, as fairseq)", type=int)
    # Backing the scale off to this or below stops training with FloatingPointError.
    min_loss_scale: float = flag(1e-4, "stop training when the loss scale falls to this (default: %(default)s)")


@dataclass(frozen=True, kw_only=True)
class DatasetOptions:
    """The preprocessed data and how it is cut into batches."""

    TITLE: ClassVar[str] = "dataset"
    data_dir: str = flag(help="directory written by `fullshard preprocess`", positional=True, metavar="DATA_DIR")
    tokens_per_sample: int = flag(1024, "tokens per sample (default: %(default)s)")
    batch_size: int = flag(8, "sequences per rank per micro-batch (default: %(default)s)")
    # None when not given (so a conflict with --global-batch-size can be told): `validate` stores
    # 1, or the value derived from global_batch_size (each rank derives it again at its world size).
    update_freq: Optional[int] = flag(None, "micro-batches accumulated per update (default: 1, or "
                                      "--global-batch-size / (--batch-size x ranks))", type=int)
    # Megatron's and torchtitan's name; update_freq = global_batch_size / (batch_size * world size).
    global_batch_size: Optional[int] = flag(
        None, "sequences per update over all ranks; --update-freq is derived from it at the world size the "
        "ranks start with, which must divide it (default: --batch-size x --update-freq x ranks)", type=int,
        metavar="G")


@dataclass(frozen=True, kw_only=True)
class OptimizationOptions:
    """The optimizer and its hyper-parameters, the learning-rate schedule, stopping and clipping, the seed."""

    TITLE: ClassVar[str] = "optimization"
    task: str = flag("language_modeling", "the only task: GPT language modeling", choices=("language_modeling",))
    # train/optimizers.py builds them: torch.optim.AdamW, or fullshard.optim's Muon, Adafactor, Lamb.
    optimizer: str = flag("adam", "adam: AdamW with decoupled weight decay; cpu_adam: the same, stepping on host "
                          "shards with torch's fused CPU AdamW kernel; muon: Muon (torch.optim.Muon's update) on "
                          "the 2-D weights of the transformer blocks, AdamW (--adam-betas, --adam-eps) on "
                          "embeddings, norms and biases; adafactor: torch.optim.Adafactor's update; lamb: LAMB "
                          "(You et al. 2020, Algorithm 2). The structured ones match one device under "
                          "fully_sharded (fullshard.optim) (default: %(default)s)", choices=OPTIMIZERS)
    adam_betas: Tuple[float, float] = flag((0.9, 0.999), "AdamW betas, e.g. '(0.9,0.98)' (also muon's AdamW "
                                           "half)", type=parse_betas)
    adam_eps: float = flag(1e-8, "AdamW epsilon (also muon's AdamW half) (default: %(default)s)")
    weight_decay: float = flag(0.0, "decoupled weight decay (lr x wd), applied to >=2-D weights only "
                               "(every optimizer)", aliases=("--wd",))
    # torch.optim.Muon's arguments; None (torch's default) is "original".
    muon_momentum: float = flag(0.95, "muon: momentum of the 2-D weights (default: %(default)s)")
    muon_nesterov: bool = flag(True, "muon: Nesterov momentum (default: on)", negatable=True)
    muon_ns_coefficients: Tuple[float, float, float] = flag(
        (3.4445, -4.775, 2.0315), "muon: (a,b,c) of the quintic Newton-Schulz iteration (default: torch's, "
        "'(3.4445,-4.775,2.0315)')", type=parse_ns_coefficients, metavar="'(A,B,C)'")
    muon_eps: float = flag(1e-7, "muon: floor of the norm the update is divided by (default: %(default)s)")
    muon_ns_steps: int = flag(5, "muon: Newton-Schulz iterations, 1 to 99 (default: %(default)s)")
    muon_adjust_lr_fn: str = flag(
        "original", "muon: lr scale of an m x n matrix: original = sqrt(max(1, m/n)) (Keller Jordan); "
        "match_rms_adamw = 0.2 sqrt(max(m, n)) (Moonshot), so --lr and --weight-decay tuned for AdamW carry "
        "over (default: %(default)s)", choices=("original", "match_rms_adamw"))
    # torch.optim.Adafactor's arguments (its lr is the cap of the relative step size, 1e-2 in the paper).
    adafactor_beta2_decay: float = flag(-0.8, "adafactor: exponent of the second-moment decay 1 - t^c, <= 0 "
                                        "(default: %(default)s)")
    adafactor_eps: Tuple[Optional[float], float] = flag(
        (None, 1e-3), "adafactor: (eps1, eps2): eps1 guards the second-moment denominator (None: the dtype's "
        "eps), eps2 is the smallest parameter RMS the step scales with (default: '(None,1e-3)')",
        type=parse_adafactor_eps, metavar="'(EPS1,EPS2)'")
    adafactor_d: float = flag(1.0, "adafactor: clipping threshold of the update RMS (default: %(default)s)")
    # fairseq's --optimizer lamb flags.
    lamb_betas: Tuple[float, float] = flag((0.9, 0.999), "lamb: betas, e.g. '(0.9,0.999)'", type=parse_betas)
    lamb_eps: float = flag(1e-8, "lamb: epsilon (default: %(default)s)")
    lr: float = flag(5e-4, "peak learning rate (adafactor: the cap of its relative step size, torch's default "
                     "1e-2) (default: %(default)s)")
    lr_scheduler: str = flag("fixed", "learning-rate schedule (default: %(default)s)", choices=SCHEDULERS)
    warmup_updates: int = flag(0, "updates of linear learning-rate warmup (default: %(default)s)")
    total_num_update: int = flag(0, "updates over which polynomial_decay/cosine anneal (default: --max-update)")
    end_learning_rate: float = flag(0.0, "final learning rate of polynomial_decay/cosine (default: %(default)s)")
    power: float = flag(1.0, "exponent of polynomial_decay (default: %(default)s)")
    max_update: int = flag(0, "stop after N updates (0 = no limit)")
    max_epoch: int = flag(0, "stop after N epochs (0 = no limit)")
    # The global gradient L2 norm; gnorm is logged either way.
    clip_norm: float = flag(0.0, "clip gradient norm (0 = off)")
    seed: int = flag(1, "seed of model initialization, data order and dropout (default: %(default)s)")


@dataclass(frozen=True, kw_only=True)
class LoggingCheckpointOptions:
    """Log lines, validation, checkpoints (fullshard.checkpoint directories), resuming, errors."""

    TITLE: ClassVar[str] = "logging and checkpoints"
    # `validate` stores the resolved format: json, simple or tqdm.
    log_format: Optional[str] = flag(None, "default: tqdm on a terminal, else simple",
                                     choices=("json", "simple", "tqdm"))
    log_interval: int = flag(100, "log a train_inner line every N updates (default: %(default)s)")
    log_file: Optional[str] = flag(None, "also write the log to this file")
    # fully_sharded only: max over ranks of the largest value sampled after each micro-batch's
    # forward and backward.
    log_memory: bool = flag(False, "log FSDP memory on train_inner lines: fullshard.memory_stats totals (mem_*_mb, "
                            "MiB), the most seen after any forward or backward since the last line, on any rank "
                            "(c10d: none)")
    validate_interval_updates: int = flag(0, "validate every N updates (0 = end of epoch/training only)")
    save_dir: str = flag("checkpoints", "directory of checkpoint_last and checkpoint_<epoch>_<updates> "
                         "(default: %(default)s)")
    no_save: bool = flag(False, "write no checkpoint")
    save_interval_updates: int = flag(0, "also save checkpoint_<epoch>_<updates> every N updates (0 = only at "
                                      "the end)")
    keep_interval_updates: int = flag(-1, "keep only the last N interval checkpoints (0 or -1 = all)")
    restore_file: str = flag("checkpoint_last", "checkpoint to resume from: a path, or a name in --save-dir "
                             "(default: %(default)s; resumed automatically when it exists)")
    reset_optimizer: bool = flag(False, "resume the model only: fresh optimizer state and update counter")
    reset_dataloader: bool = flag(False, "resume at epoch 1, first batch")
    reset_lr_scheduler: bool = flag(False, "start the lr schedule again from its step 0 (warmup, then decay over "
                                    "--total-num-update) while the update count goes on")
    reset_meters: bool = flag(False, "do not restore the train meters")
    # The agent of torch elastic SIGTERMs the ranks at a membership change too, and SIGKILLs them
    # 30 s later; the save must end before that (a cut-off save leaves the previous checkpoint).
    save_on_sigterm: bool = flag(False, "on SIGTERM (a preemption notice; torch elastic's restart when a node "
                                 "joins) every rank finishes its update, checkpoint_last is saved and training "
                                 "stops (exit code 143)")
    on_save_error: str = flag("stop", "after a failed checkpoint save (e.g. disk full): stop, or continue training "
                              "(the previous checkpoint stays) (default: %(default)s)", choices=("stop", "continue"))
    debug: bool = flag(False, "print tracebacks instead of one-line errors")
    finetune_from_model: Optional[str] = flag(None, "start from these weights (a consolidated .pt/.safetensors or "
                                              "a checkpoint directory) when --save-dir has no checkpoint_last")


# --- Hugging Face fine-tuning (train/hf_model.py, train/hf_export.py; checks: train/hf_options.py) ---
@dataclass(frozen=True, kw_only=True)
class FinetuneOptions:
    """Fine-tuning a local Hugging Face checkpoint, fully or with LoRA adapters (PEFT)."""

    TITLE: ClassVar[str] = "Hugging Face fine-tuning"
    # None: the GPT of --arch. Its vocabulary must hold the data's (`fullshard preprocess --tokenizer DIR`).
    hf_model: Optional[str] = flag(None, "train this local transformers checkpoint (config.json + *.safetensors) "
                                   "instead of --arch: one unit per decoder layer, each rank reading only its rows",
                                   metavar="DIR")
    # None: <--save-dir>/hf (nothing with --no-save).
    save_hf: Optional[str] = flag(None, "--hf-model: at the end write the trained model here in save_pretrained "
                                  "format (with --lora-rank: the PEFT adapter, or the merged model with --merge-lora) "
                                  "(default: <--save-dir>/hf)", metavar="DIR")
    # 0: full fine-tuning. Else peft.LoraConfig(r, lora_alpha, lora_dropout, target_modules).
    lora_rank: int = flag(0, "--hf-model: train LoRA adapters of this rank on a frozen base (0 = full fine-tuning)")
    lora_alpha: float = flag(8.0, "LoRA scaling numerator: the update is (alpha / rank) B A (default: %(default)s)")
    lora_dropout: float = flag(0.0, "dropout on the LoRA branch's input (default: %(default)s)")
    # None: PEFT's default targets for the architecture.
    lora_target_modules: Optional[str] = flag(None, "comma-separated module names to adapt, e.g. q_proj,v_proj "
                                              "(default: PEFT's for the architecture)", metavar="NAMES")
    merge_lora: bool = flag(False, "--lora-rank: export the base with the adapters merged in, not the adapter")
    # fp32: one dtype for the whole model. bf16/fp16: the frozen base stored so, adapters fp32 (PEFT's default).
    base_dtype: str = flag("fp32", "--lora-rank: dtype the frozen base is stored and trained in; the adapters "
                           "stay fp32 (default: %(default)s)", choices=("fp32", "bf16", "fp16"))
    # none: as --base-dtype. nf4: decoder layers' frozen Linear weights as torchao NF4 (train/qlora.py).
    quantize_base: str = flag("none", "--lora-rank: store the decoder layers' frozen Linear weights 4-bit (QLoRA: "
                              "torchao NF4, gathered as packed bytes) (default: %(default)s)", choices=("none", "nf4"))


TRAIN_GROUPS = (ModelOptions, DistributedOptions, PipelineOptions, PrecisionOptions, DatasetOptions,
                OptimizationOptions, LoggingCheckpointOptions, FinetuneOptions)
"""The option groups of `fullshard train`, in ``--help`` order."""


@dataclass(frozen=True, kw_only=True)
class TrainConfig(ModelOptions, DistributedOptions, PipelineOptions, PrecisionOptions, DatasetOptions,
                  OptimizationOptions, LoggingCheckpointOptions, FinetuneOptions):
    """Everything one rank needs to train: every group's fields (resolved by `options.validate`)
    and the sizes below. Field names follow fairseq-train flags."""

    max_positions: int
    """Positions of the architecture (size of its positional table), tokens."""
    vocab_size: int
    """Vocabulary size read from the data directory's meta.json."""

    def __post_init__(self) -> None:
        if self.fsdp_version is None:  # not given, or a checkpoint's args from before the flag
            # Pipelining shards its stages with fully_shard by default (train/pipeline.py).
            object.__setattr__(self, "fsdp_version", 2 if self.pipeline_parallel_size > 1 else DEFAULT_FSDP_VERSION)
        if self.update_freq is None and self.global_batch_size is None:
            object.__setattr__(self, "update_freq", 1)

    def at_world_size(self, world_size: int) -> "TrainConfig":
        """This config for ranks that started at ``world_size``: with ``global_batch_size``, its
        ``update_freq`` derived again (the launcher's world size may differ from the one the ranks
        rendezvoused at, e.g. after an elastic restart); else itself.

        Raises:
            GlobalBatchError: ``world_size`` does not divide the global batch (one line).
        """
        if self.global_batch_size is None:
            return self
        k = derive_update_freq(self.global_batch_size, self.batch_size, world_size)
        return self if k == self.update_freq else dataclasses.replace(self, update_freq=k)

    def arch_spec(self) -> ArchSpec:
        """The model's shape: ``arch`` with the decoder_* overrides.

        Raises:
            ValueError: unknown ``arch`` or an invalid shape (`validate` reports these first).
        """
        return arch_spec(self.arch).override(self.decoder_layers, self.decoder_embed_dim,
                                             self.decoder_attention_heads, self.decoder_ffn_embed_dim)

    def to_dict(self) -> dict:
        """Plain-Python copy, flat ``{field: value}`` (checkpoints record it as their ``args``)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_saved(cls, saved: Mapping, **defaults) -> "TrainConfig":
        """The config a checkpoint's recorded ``args`` describe.

        Args:
            saved: ``to_dict()`` of this or an older version (the same flat field names; older
                versions lack later fields), possibly through JSON (lists for tuples).
            defaults: values for the fields ``saved`` lacks (``data_dir``, ``max_positions`` and
                ``vocab_size`` at least, when it may lack them); the rest take the field defaults.

        Names this version does not know are dropped.

        Raises:
            TypeError: a required field is neither in ``saved`` nor in ``defaults``.
        """
        known = {f.name for f in dataclasses.fields(cls)}
        tuples = {f.name for f in dataclasses.fields(cls) if isinstance(f.default, tuple)}  # JSON gives lists
        kept = {k: (tuple(v) if k in tuples and v is not None else v) for k, v in saved.items() if k in known}
        return cls(**{**defaults, **kept})
