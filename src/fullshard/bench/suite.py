"""`fullshard bench`: the same GPT, data and seed trained under every mode,
one launch (fresh processes) per mode, and one report.

    fullshard bench                                  # --preset quick, all modes, 2 ranks
    fullshard bench --preset gpt2-small --modes full,ddp,fsdp2
    fullshard bench --modes full,ddp --timed-steps 10 --out-dir /tmp/b
    fullshard bench --modes full,full_invariant --update-freq 4   # cost of world-size invariance
    fullshard bench --optimizer muon --modes full,ddp             # fullshard.optim.Muon's state per rank
    fullshard bench --world-size 4 --modes ddp,fully_shard,pp2,pp2_unsharded   # pp=2 x dp=2 against dp=4

Modes (``--modes``, run in this order; see :data:`fullshard.bench.modes.MODES`):
``full``, ``grad_op``, ``no_shard``, ``full_bf16`` (fullshard FULL_SHARD,
SHARD_GRAD_OP, NO_SHARD, FULL_SHARD with ``MixedPrecision(param_dtype=bf16,
reduce_dtype=fp32)``), ``fully_shard``, ``fully_shard_bf16`` (fullshard's
``fully_shard`` on each block and the root, FULL_SHARD, fp32 and
``MixedPrecisionPolicy(bf16, fp32)``; their ratios to the wrapper's ``full`` /
``full_bf16`` rows get a table of their own), ``full_invariant``,
``full_bf16_invariant``, ``fully_shard_invariant`` (``full``, ``full_bf16``
and ``fully_shard`` with ``world_size_invariant=True``; their ratios to those
modes get a table of their own), ``ddp`` (torch DDP), ``fsdp2``, ``fsdp2_bf16`` (torch
``fully_shard`` on each block and the root, ``MixedPrecisionPolicy(bf16,
fp32)``), ``fsdp1`` (torch FSDP1 FULL_SHARD) and ``deepspeed`` (DeepSpeed
ZeRO-3 on its CPU accelerator over gloo; in the default list only when
``deepspeed`` is installed, which the project does not require), and, only when named,
``pp2`` and ``pp2_unsharded`` (pp=2 x dp=N/2: ``fully_shard`` stages under torch's 1F1B schedule, as
`fullshard train --pipeline-parallel-size 2` runs them, accumulating gradients over the pipeline
micro-batches reduce-scattered or unsharded; :mod:`fullshard.bench.pipeline`; their ratios to
``fully_shard`` over all N ranks and every rank's time and memory get tables of their own).

``--optimizer`` picks what every mode steps with (default AdamW; ``muon``, ``adafactor`` and
``lamb`` are ``fullshard.optim``'s, on the fullshard modes and ``ddp`` only: see
:mod:`fullshard.bench.optimizers`); the ``optim MiB`` column is then that optimizer's state.

``--update-freq K`` makes each step K forward/backward passes of ``--batch-size``
sequences, the first K - 1 under ``no_sync`` (each library's own: ``no_sync()``
or ``set_requires_gradient_sync(False)``), as ``fullshard train`` accumulates.

Each mode is a separate launch of ``--world-size`` gloo ranks by torch's
elastic launcher (:func:`fullshard.train.launcher.launch_local`), so each
process's peak RSS is that mode's alone; glibc malloc runs with its defaults
(nothing here sets ``MALLOC_*``). What a rank does and measures:
:mod:`fullshard.bench.rank`; the table, JSON and chart:
:mod:`fullshard.bench.report`.

Exit status: 0 when every fullshard mode ran (a baseline may fail: its row
says ``ERROR: reason``), 1 when a fullshard mode failed or the report could
not be written, 2 on bad input (one ``fullshard bench: error: ...`` line,
nothing run or written).
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import os
import platform
import sys
import time
from typing import Optional

import torch

from fullshard.bench import report as RP
from fullshard.bench.modes import MODES, Job, ModelSpec
from fullshard.bench.optimizers import LABELS, OPTIMIZERS, runs_on
from fullshard.bench.pipeline import PIPELINE_SIZE
from fullshard.bench.rank import rank_main
from fullshard.models import ARCHS
from fullshard.train.launcher import LaunchError, RankFailed, cpu_cores, launch_local, threads_per_rank

DEFAULT_OUT_DIR = "bench-results"


@dataclasses.dataclass(frozen=True)
class Preset:
    """Defaults of a named benchmark size; every field has a flag that overrides it.

    Attributes:
        arch: a key of :data:`fullshard.models.ARCHS` (layers, width, heads).
        max_positions: the position table's size (None = the sequence length).
    """

    arch: str
    vocab_size: int
    seq_len: int
    batch_size: int
    warmup_steps: int
    timed_steps: int
    world_size: int = 2
    max_positions: Optional[int] = None


PRESETS = {
    # The CPU-sized GPT of `make train` (4 layers, width 128; with the GPT-2
    # vocabulary most of its 7.2M parameters are the tied embedding): every
    # mode in under 3 minutes at 2 ranks on 2 cores.
    "quick": Preset("transformer_lm_gpt_tiny", 50257, 128, 2, 2, 5),
    # GPT-2 small's shape (12 layers, width 768, 12 heads, 1024 positions,
    # V = 50257: Ψ = 124.4M); batch 1 × 128 tokens per rank keeps DDP's
    # 16Ψ bytes of model state plus activations far below 24 GiB per rank.
    "gpt2-small": Preset("transformer_lm_gpt3_small", 50257, 128, 1, 1, 5, max_positions=1024),
}


def deepspeed_available() -> bool:
    """Whether ``deepspeed`` can be found (not imported: that takes seconds)."""
    return importlib.util.find_spec("deepspeed") is not None


def add_args(p: argparse.ArgumentParser) -> None:
    """Register ``fullshard bench``'s flags on ``p``."""
    p.add_argument("--preset", default="quick", choices=sorted(PRESETS),
                   help="model and run size (default: %(default)s); the flags below override it")
    p.add_argument("--modes", help=f"comma-separated, from {','.join(MODES)} (default: all but pp2 and "
                                   "pp2_unsharded; deepspeed only when installed)")
    p.add_argument("--world-size", type=int, help="N, gloo ranks per launch (preset: 2)")
    p.add_argument("--warmup-steps", type=int, help="untimed steps first")
    p.add_argument("--timed-steps", type=int, help="timed steps (the median is reported; use at least 5)")
    p.add_argument("--batch-size", type=int, help="sequences per rank per step")
    p.add_argument("--seq-len", type=int, help="tokens per sequence")
    p.add_argument("--update-freq", type=int, default=1,
                   help="micro-batches per step, gradients accumulated under no_sync over all but the last "
                        "(default: %(default)s; not with deepspeed)")
    p.add_argument("--optimizer", default="adam", choices=OPTIMIZERS,
                   help="what every mode steps with: adam (torch AdamW), or fullshard.optim's muon, adafactor, "
                        "lamb (fullshard modes and ddp only) (default: %(default)s)")
    p.add_argument("--arch", help="a named GPT for layers, width and heads (see `fullshard train --help`)")
    p.add_argument("--layers", type=int, help="transformer blocks (overrides --arch)")
    p.add_argument("--width", type=int, help="model width C (overrides --arch)")
    p.add_argument("--heads", type=int, help="attention heads; must divide the width (overrides --arch)")
    p.add_argument("--vocab-size", type=int, help="vocabulary size V (preset: 50257)")
    p.add_argument("--threads", type=int, help="intra-op threads per rank (default: cores // world size, "
                                               "at least 1)")
    p.add_argument("--seed", type=int, default=1, help="model init and data seed (default: %(default)s)")
    p.add_argument("--timeout-s", type=float, default=300.0, help="deadline of each gloo collective, seconds")
    p.add_argument("--lora", action="store_true",
                   help="the LoRA rows instead (fullshard.bench.lora): full fine-tune, LoRA on an fp32 and a bf16 "
                        "base, fullshard and torch FSDP2 + PEFT, on a small Hugging Face Llama; printed, not saved")
    p.add_argument("--out-dir", default=DEFAULT_OUT_DIR,
                   help="where bench.md, bench.json and bench.png go (default: %(default)s)")


@dataclasses.dataclass(frozen=True)
class Plan:
    """A validated invocation: the modes to launch and the job template."""

    preset: str
    modes: tuple[str, ...]
    job: Job
    out_dir: str
    deepspeed_available: bool
    overrides: tuple[str, ...] = ()
    """The preset-overriding flags given (e.g. ``("--arch", "--seq-len")``), for the report's header."""


def validate(args: argparse.Namespace, fail) -> Plan:
    """Resolve the preset and the overrides into a :class:`Plan`.

    Args:
        fail: called with a one-line message on bad input (must not return;
            ``OneLineArgumentParser.fail`` prints ``fullshard bench: error: ...``
            and exits 2).
    """
    preset = PRESETS[args.preset]
    has_ds = deepspeed_available()
    if args.modes is None:
        modes = [k for k in MODES if (k != "deepspeed" or has_ds) and runs_on(args.optimizer, k)
                 and not MODES[k].pipeline]
    else:
        modes = [m.strip() for m in args.modes.split(",") if m.strip()]
        unknown = [m for m in modes if m not in MODES]
        if unknown or not modes:
            fail(f"unknown mode{'s' if len(unknown) > 1 else ''} {','.join(unknown) or repr(args.modes)} in "
                 f"--modes; choose from {','.join(MODES)}")
        twice = sorted({m for m in modes if modes.count(m) > 1})
        if twice:
            fail(f"--modes names {','.join(twice)} more than once")
        if "deepspeed" in modes and not has_ds:
            fail("--modes deepspeed: DeepSpeed is not installed (pip install deepspeed)")
        foreign = [m for m in modes if not runs_on(args.optimizer, m)]
        if foreign:
            fail(f"--optimizer {args.optimizer} runs on the fullshard modes and ddp only (fullshard.optim cannot "
                 f"see the shards of {','.join(foreign)}; the pipeline modes step AdamW, as `fullshard train` "
                 f"does); drop {','.join(foreign)} from --modes")
    pick = lambda name, default: default if getattr(args, name) is None else getattr(args, name)  # noqa: E731
    arch = pick("arch", preset.arch)
    if arch not in ARCHS:
        fail(f"unknown --arch {arch!r}; choose from {', '.join(ARCHS)}")
    spec = ARCHS[arch]
    world = pick("world_size", preset.world_size)
    values = dict(world_size=world, warmup_steps=pick("warmup_steps", preset.warmup_steps),
                  timed_steps=pick("timed_steps", preset.timed_steps), batch_size=pick("batch_size", preset.batch_size),
                  seq_len=pick("seq_len", preset.seq_len), layers=pick("layers", spec.num_layers),
                  width=pick("width", spec.embed_dim), heads=pick("heads", spec.num_heads),
                  vocab_size=pick("vocab_size", preset.vocab_size),
                  threads=pick("threads", threads_per_rank(world if world >= 1 else 1)))
    for name, v in values.items():
        least = 0 if name == "warmup_steps" else 1
        if v < least:
            fail(f"--{name.replace('_', '-')} must be >= {least}, got {v}")
    piped = [m for m in modes if MODES[m].pipeline]
    if piped and (world % PIPELINE_SIZE or values["layers"] < PIPELINE_SIZE):
        fail(f"--modes {','.join(piped)}: a pp={PIPELINE_SIZE} pipeline needs a --world-size divisible by "
             f"{PIPELINE_SIZE} and at least {PIPELINE_SIZE} layers, got --world-size {world} and {values['layers']} "
             "layers")
    if values["width"] % values["heads"]:
        fail(f"--heads {values['heads']} must divide the width {values['width']}")
    if args.update_freq < 1:
        fail(f"--update-freq must be >= 1, got {args.update_freq}")
    if args.update_freq > 1 and "deepspeed" in modes:
        fail("--update-freq > 1 is not supported with the deepspeed mode (its engine accumulates by its own "
             "configuration); name the other modes in --modes")
    if args.timeout_s <= 0:
        fail(f"--timeout-s must be > 0, got {args.timeout_s:g}")
    if os.path.exists(args.out_dir) and not os.path.isdir(args.out_dir):
        fail(f"--out-dir {args.out_dir!r} exists and is not a directory")
    existing = os.path.abspath(args.out_dir)
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.access(existing, os.W_OK | os.X_OK):
        fail(f"--out-dir {args.out_dir!r}: {existing} is not writable")
    model = ModelSpec(num_layers=values["layers"], embed_dim=values["width"], num_heads=values["heads"],
                      vocab_size=values["vocab_size"], max_positions=max(preset.max_positions or 0, values["seq_len"]))
    job = Job(mode=modes[0], model=model, world_size=world, batch_size=values["batch_size"],
              seq_len=values["seq_len"], warmup_steps=values["warmup_steps"], timed_steps=values["timed_steps"],
              threads=values["threads"], seed=args.seed, timeout_s=args.timeout_s, update_freq=args.update_freq,
              optimizer=args.optimizer)
    given = tuple(f"--{name.replace('_', '-')}" for name in ("arch", *values) if getattr(args, name) is not None)
    given += ("--update-freq",) if args.update_freq != 1 else ()
    given += ("--optimizer",) if args.optimizer != "adam" else ()
    return Plan(args.preset, tuple(modes), job, args.out_dir, has_ds, given)


def launch_mode(job: Job) -> list[dict]:
    """Run :func:`fullshard.bench.rank.rank_main` on ``job.world_size`` fresh ranks; their results by rank.

    Raises:
        RankFailed: a rank raised or died ("rank R failed: ...").
        LaunchError: the rendezvous could not be hosted.
    """
    return launch_local(rank_main, job, job.world_size)


def _config(plan: Plan, load_before, load_after, per_mode_load: dict) -> dict:
    job = plan.job
    cfg = dict(preset=plan.preset, overrides=list(plan.overrides), modes=list(plan.modes), world_size=job.world_size,
               threads=job.threads,
               cpu_cores=cpu_cores(), batch_size=job.batch_size, seq_len=job.seq_len,
               warmup_steps=job.warmup_steps, timed_steps=job.timed_steps, lr=job.lr,
               weight_decay=job.weight_decay, seed=job.seed, optimizer=LABELS[job.optimizer],
               model=dataclasses.asdict(job.model),
               psi=job.model.psi(), update_freq=job.update_freq,
               tokens_per_step=job.world_size * job.batch_size * job.seq_len * job.update_freq,
               torch_version=torch.__version__, python_version=platform.python_version(),
               platform=platform.platform(), backend="gloo",
               load_average_before=list(load_before), load_average_after=list(load_after),
               load_average_per_mode=per_mode_load, deepspeed_available=plan.deepspeed_available,
               malloc_env={k: v for k, v in os.environ.items() if k.startswith("MALLOC_")},
               argv=sys.argv[1:])
    if plan.deepspeed_available and "deepspeed" in plan.modes:
        try:
            from importlib.metadata import version

            cfg["deepspeed_version"] = version("deepspeed")
        except Exception:  # metadata missing: the row still says what ran
            pass
    return cfg


def run(plan: Plan) -> int:
    """Launch every mode in turn, print and write the report; the exit status (see module docstring)."""
    job0 = plan.job
    # The ranks set their own intra-op threads; OpenMP's pool follows suit
    # (the launched processes inherit the variable; restored afterwards).
    old_omp = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = str(job0.threads)
    try:
        return _run(plan)
    finally:
        if old_omp is None:
            os.environ.pop("OMP_NUM_THREADS", None)
        else:
            os.environ["OMP_NUM_THREADS"] = old_omp


def _run(plan: Plan) -> int:
    job0 = plan.job
    m = job0.model
    print(f"fullshard bench: preset {RP.preset_label(plan.preset, plan.overrides)}, {len(plan.modes)} modes "
          f"({','.join(plan.modes)}), "
          f"N={job0.world_size} x {job0.threads} threads, GPT L={m.num_layers} C={m.embed_dim} V={m.vocab_size} "
          f"(Ψ={m.psi():,}), batch {job0.batch_size}x{job0.seq_len}"
          + (f" x {job0.update_freq} micro-batches" if job0.update_freq > 1 else "")
          + f", {job0.warmup_steps}+{job0.timed_steps} steps, {LABELS[job0.optimizer]}", flush=True)
    load_before = os.getloadavg()
    rows, per_mode_load, t_all = [], {}, time.perf_counter()
    tokens = job0.world_size * job0.batch_size * job0.seq_len * job0.update_freq
    for i, key in enumerate(plan.modes, 1):
        mode = MODES[key]
        job = dataclasses.replace(job0, mode=key)
        t0, load0 = time.perf_counter(), os.getloadavg()[0]
        try:
            results = launch_mode(job)
            row = RP.merge_ranks(mode, results, job.model, job.timed_steps, tokens, job.update_freq)
            what = f"step {row['step_ms']:.1f} ms, RSS peak +{row['rss_peak_growth_bytes'] / RP.MiB:.1f} MiB"
        except (RankFailed, LaunchError) as e:
            row = RP.error_row(mode, str(e))
            what = f"ERROR: {e}"
        per_mode_load[key] = [load0, os.getloadavg()[0]]
        row["wall_s"] = time.perf_counter() - t0
        rows.append(row)
        print(f"[{i}/{len(plan.modes)}] {mode.label}: {what} ({row['wall_s']:.1f} s)", flush=True)
    report = RP.build_report(_config(plan, load_before, os.getloadavg(), per_mode_load), rows)
    report["config"]["wall_s"] = time.perf_counter() - t_all
    print()
    print(RP.markdown(report), end="")
    try:
        paths = RP.write_files(report, plan.out_dir)
    except OSError as e:  # the table above is all there is
        sys.stderr.write(f"fullshard bench: error: cannot write the report to {plan.out_dir}: {e}\n")
        return 1
    failed = [r["label"] for r in rows if r["ours"] and "error" in r]
    print(f"wrote {paths['md']}, {paths['json']}, {paths['png']} ({report['config']['wall_s']:.0f} s)"
          + (f"; FAILED: {', '.join(failed)}" if failed else ""), flush=True)
    return 1 if failed else 0
