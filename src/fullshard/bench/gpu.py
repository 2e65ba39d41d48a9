"""`python -m fullshard.bench.gpu`: fullshard's ``fully_shard`` against torch FSDP2 and DDP on one CUDA GPU.

    python -m fullshard.bench.gpu --out-dir docs/benchmarks/gpu             # the default GPT, every mode
    python -m fullshard.bench.gpu --out-dir /tmp/g --layers 2 --width 256 --seq-len 128 --batch-size 2

One NCCL rank (world size 1) per mode, each mode in a fresh process (so that one mode's cached CUDA
memory, compiled kernels and pinned host pages do not reach the next), the same GPT (built on the GPU
from ``--seed``), the same token batches and AdamW. Modes (:data:`MODES`):

- ``fully_shard``: fullshard's ``fully_shard`` on each block, then the root, with
  ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``;
- ``fsdp2``: torch FSDP2's ``fully_shard`` likewise (the baseline; imported in its own process only);
- ``ddp``: torch DDP over the fp32 model under ``torch.autocast(bf16)`` (DDP's usual mixed precision:
  fp32 parameters, gradients and all-reduce, bf16 matrix products);
- ``wrapper``: fullshard's ``FullyShardedDataParallel`` (FULL_SHARD, a unit per block by auto-wrap) with
  ``MixedPrecision(param_dtype=bf16, reduce_dtype=fp32)``: the same engine behind the FSDP1-style door;
- ``fully_shard_offload``, ``fsdp2_offload``: ``fully_shard`` and torch FSDP2 with
  ``CPUOffloadPolicy(pin_memory=True)`` (shards, gradients and the AdamW step in pinned host memory), and
  ``wrapper_offload``: the wrapper with ``CPUOffload(offload_params=True)`` (pinned likewise). The fullshard
  offload rows step with :class:`fullshard.optim.OffloadAdamW` (each unit's CPU step overlapping the rest of
  backward, torch's fused CPU AdamW kernel); ``fsdp2_offload`` with ``torch.optim.AdamW``'s default (what
  torch FSDP2's users get), and ``fsdp2_offload_fused`` with ``torch.optim.AdamW(fused=True)``, the same CPU
  kernel as ours without the overlap.

A step is ``zero_grad``, forward, backward and ``optimizer.step``, timed between
``torch.cuda.synchronize()`` calls; the table gives the median of ``--timed-steps`` steps after
``--warmup-steps``, and ``torch.cuda.max_memory_allocated`` over all steps (peak statistics reset once the
model is wrapped). Ratios divide a row by torch FSDP2's (offload rows: by ``fsdp2_offload``) and by DDP's.
After the timed steps, one more step runs under ``torch.cuda.set_sync_debug_mode("warn")`` (host syncs
per step: the synchronizing CUDA calls it warns about; ``gpu.json``'s ``host_sync_sites`` gives each one's
innermost Python frames) and one under torch.profiler, whose chrome trace is
saved as ``OUT_DIR/trace_<mode>.json``; the table gives the fraction of all-gather and reduce-scatter
kernel time during which compute kernels ran on other streams (bench/gpu_trace.py).
The table goes to ``OUT_DIR/gpu.md`` (raw numbers: ``gpu.json``) and to stdout.

``--device cpu`` runs the same modes over gloo on the CPU (no memory figures; for developing this
module). Exit status 0 when the fullshard modes ran (a baseline may fail: its row says why), else 1.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh

from fullshard import (
    CPUOffload,
    CPUOffloadPolicy,
    FullyShardedDataParallel,
    MixedPrecision,
    MixedPrecisionPolicy,
    fully_shard,
)
from fullshard.bench import gpu_trace
from fullshard.core.params import local_of
from fullshard.models import GPT, GPTConfig, TransformerBlock
from fullshard.optim import OffloadAdamW
from fullshard.wrap import ModuleWrapPolicy

GIB = 1024 ** 3


@dataclasses.dataclass(frozen=True)
class Mode:
    """One row of the table."""

    label: str
    family: str
    """``fully_shard``, ``wrapper`` (fullshard's ``FullyShardedDataParallel``), ``fsdp2`` or ``ddp``."""
    offload: bool
    baseline: str
    """The mode this row's "x torch FSDP2" ratio divides by."""


MODES = {
    "fully_shard": Mode("fullshard fully_shard", "fully_shard", False, "fsdp2"),
    "fsdp2": Mode("torch FSDP2", "fsdp2", False, "fsdp2"),
    "ddp": Mode("torch DDP (autocast bf16)", "ddp", False, "fsdp2"),
    "wrapper": Mode("fullshard FullyShardedDataParallel", "wrapper", False, "fsdp2"),
    "fully_shard_offload": Mode("fullshard fully_shard, CPU offload", "fully_shard", True, "fsdp2_offload"),
    "wrapper_offload": Mode("fullshard FullyShardedDataParallel, CPU offload", "wrapper", True, "fsdp2_offload"),
    "fsdp2_offload": Mode("torch FSDP2, CPU offload", "fsdp2", True, "fsdp2_offload"),
    "fsdp2_offload_fused": Mode("torch FSDP2, CPU offload, fused AdamW", "fsdp2", True, "fsdp2_offload"),
}


@dataclasses.dataclass(frozen=True)
class GpuJob:
    """What every mode trains."""

    num_layers: int = 24
    embed_dim: int = 2048
    num_heads: int = 16
    vocab_size: int = 50304
    seq_len: int = 1024
    batch_size: int = 8
    """Sequences per step (one micro-batch)."""
    warmup_steps: int = 3
    timed_steps: int = 10
    seed: int = 0
    device: str = "cuda"
    trace_dir: str = ""
    """Where each mode's profiler trace goes (CUDA; empty: no syncs count, no trace)."""

    def config(self) -> GPTConfig:
        return GPTConfig(num_layers=self.num_layers, embed_dim=self.embed_dim, num_heads=self.num_heads,
                         ffn_embed_dim=4 * self.embed_dim, vocab_size=self.vocab_size, max_positions=self.seq_len)


# ---------------------------------------------------------------- one mode, in its own process
def _device(job: GpuJob) -> torch.device:
    return torch.device("cuda", 0) if job.device == "cuda" else torch.device("cpu")


def build_gpt(job: GpuJob, device: torch.device) -> GPT:
    """The job's GPT on ``device``: weights ~ N(0, 0.02) drawn there from ``job.seed``, biases 0, norms 1
    (GPT-2's scheme without its per-row generators, which would take seconds per mode on the host)."""
    with torch.device("meta"):
        model = GPT(job.config())
    model.to_empty(device=device)
    model.tie_weights()
    gen = torch.Generator(device).manual_seed(job.seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.ndim > 1:
                param.normal_(0.0, 0.02, generator=gen)
            else:
                param.fill_(1.0 if name.endswith("weight") else 0.0)  # 1-D weights are LayerNorm gains
    return model


def wrap(name: str, model: GPT, device: torch.device) -> torch.nn.Module:
    """``model`` prepared as mode ``name`` (a unit per block plus the root for the sharded modes)."""
    mode = MODES[name]
    if mode.family == "ddp":
        return torch.nn.parallel.DistributedDataParallel(
            model, device_ids=[device.index] if device.type == "cuda" else None, gradient_as_bucket_view=True)
    if mode.family == "wrapper":
        return FullyShardedDataParallel(model, auto_wrap_policy=ModuleWrapPolicy({TransformerBlock}), device_id=device,
                                        mixed_precision=MixedPrecision(param_dtype=torch.bfloat16,
                                                                       reduce_dtype=torch.float32),
                                        cpu_offload=CPUOffload(offload_params=mode.offload))
    mesh = init_device_mesh(device.type, (1,))
    if mode.family == "fsdp2":
        from torch.distributed.fsdp import (
            CPUOffloadPolicy as TorchOffload,
            MixedPrecisionPolicy as TorchPolicy,
            OffloadPolicy as TorchNoOffload,
            fully_shard as shard,
        )

        policy = TorchPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        offload = TorchOffload(pin_memory=True) if mode.offload else TorchNoOffload()
    else:
        shard, policy = fully_shard, MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        offload = CPUOffloadPolicy(pin_memory=True) if mode.offload else None
    kwargs = dict(mesh=mesh, mp_policy=policy, **({"offload_policy": offload} if offload is not None else {}))
    for block in model.layers:
        shard(block, **kwargs)
    shard(model, **kwargs)
    return model


def _where(model: torch.nn.Module) -> str:
    """The devices the parameters (their local shards) live on, e.g. ``"cuda"`` or ``"cpu (pinned)"``."""
    locals_ = [local_of(p) for p in model.parameters()]
    types = sorted({t.device.type for t in locals_})
    pinned = all(t.is_pinned() for t in locals_) if types == ["cpu"] and torch.cuda.is_available() else False
    return "+".join(types) + (" (pinned)" if pinned else "")


def run_mode(name: str, job: GpuJob, init_file: str) -> dict:
    """Train ``job`` as mode ``name`` on one rank; the measurements (see the module docstring)."""
    device = _device(job)
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"file://{init_file}", rank=0, world_size=1)
    try:
        model = wrap(name, build_gpt(job, device), device)
        if MODES[name].offload and MODES[name].family != "fsdp2":
            opt = OffloadAdamW(model, lr=1e-4, weight_decay=0.1)
        else:
            opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1,
                                    fused=True if name == "fsdp2_offload_fused" else None)
        gen = torch.Generator(device).manual_seed(job.seed + 1)
        steps = job.warmup_steps + job.timed_steps
        tokens = torch.randint(0, job.vocab_size, (steps, job.batch_size, job.seq_len + 1), generator=gen,
                               device=device)
        autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=MODES[name].family == "ddp")
        sync = torch.cuda.synchronize if cuda else (lambda: None)
        sync()
        after_wrap = torch.cuda.memory_allocated() if cuda else 0
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        times, losses = [], []

        def one_step(step: int) -> torch.Tensor:
            opt.zero_grad(set_to_none=True)
            x, y = tokens[step % steps, :, :-1], tokens[step % steps, :, 1:]
            with autocast:
                logits = model(x)
            loss = F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), y.reshape(-1))
            loss.backward()
            opt.step()
            return loss.detach()
        for step in range(steps):
            sync()
            start = time.perf_counter()
            loss = one_step(step)
            sync()
            times.append(time.perf_counter() - start)
            losses.append(loss.item())
        timed = times[job.warmup_steps:]
        syncs = hidden = sites = None
        if cuda and job.trace_dir:
            sites = gpu_trace.host_sync_sites(lambda: one_step(steps))
            syncs = gpu_trace.count_syncs(sites)
            hidden = gpu_trace.profile_step(lambda: one_step(steps + 1),
                                            os.path.join(job.trace_dir, f"trace_{name}.json"))
        return dict(mode=name, step_ms=1e3 * statistics.median(timed), step_ms_all=[1e3 * t for t in timed],
                    host_syncs=syncs, host_sync_sites=sites, comm_hidden=hidden,
                    max_allocated=torch.cuda.max_memory_allocated() if cuda else None,
                    max_reserved=torch.cuda.max_memory_reserved() if cuda else None,
                    after_wrap=after_wrap if cuda else None, losses=losses, params_on=_where(model))
    finally:
        dist.destroy_process_group()


# ---------------------------------------------------------------- the report
def _ratio(a, b) -> str:
    return f"{a / b:.2f}" if a is not None and b else "—"


def _gib(n) -> str:
    return f"{n / GIB:.2f}" if n is not None else "—"


def _hidden(res: dict, kind: str) -> str:
    row = (res.get("comm_hidden") or {}).get(kind)
    return f"{100 * row['hidden_fraction']:.0f}%" if row else "—"


def format_table(results: dict[str, dict], job: GpuJob, env: dict) -> str:
    """Markdown: a header naming the setup and one row per mode in ``results``.

    Args:
        results: mode name -> :func:`run_mode`'s dict, or ``{"error": "..."}``. A name ``LABEL/mode`` (rows
            of another run, see ``--from-json``) is labelled so and divided by that run's baselines, or
            by the first other run's when it has none.
        job: what was trained.
        env: ``torch``, ``cuda``, ``gpu`` and ``command`` strings.
    """
    tokens = job.batch_size * job.seq_len
    params = 12 * job.num_layers * job.embed_dim ** 2 + (job.vocab_size + job.seq_len) * job.embed_dim
    lines = [
        f"GPT {job.num_layers} layers, width {job.embed_dim}, {job.num_heads} heads, vocabulary {job.vocab_size} "
        f"(about {params / 1e9:.2f} B parameters), batch {job.batch_size} x {job.seq_len} tokens, AdamW; "
        f"median of {job.timed_steps} steps after {job.warmup_steps}. World size 1 ({env.get('backend', 'nccl')}); "
        f"torch {env['torch']}, CUDA {env['cuda']}, {env['gpu']}.",
        "",
        f"Command: `{env['command']}`",
        "",
        *([f"Rows from: {'; '.join(env['runs'])}.", ""] if env.get("runs") else []),
        "| mode | params on | step ms (median) | tokens/s | max allocated GiB | after wrap GiB "
        "| step x torch FSDP2 | step x DDP | memory x torch FSDP2 | memory x DDP | host syncs / step "
        "| all-gather hidden | reduce-scatter hidden | side-stream copies hidden | loss first → last |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for name, res in results.items():
        prefix, _, plain = name.rpartition("/")
        mode = MODES[plain]
        label = f"{prefix}: {mode.label}" if prefix else mode.label
        if "error" in res:
            lines.append(f"| {label} | ERROR: {res['error']} |" + " |" * 13)
            continue
        base = _row(results, prefix, mode.baseline)
        vs_ddp = _row(results, prefix, "ddp") if not mode.offload else {}
        lines.append(
            f"| {label} | {res['params_on']} | {res['step_ms']:.1f} | {tokens / res['step_ms'] * 1e3:,.0f} "
            f"| {_gib(res['max_allocated'])} | {_gib(res['after_wrap'])} "
            f"| {_ratio(res['step_ms'], base.get('step_ms'))} | {_ratio(res['step_ms'], vs_ddp.get('step_ms'))} "
            f"| {_ratio(res['max_allocated'], base.get('max_allocated'))} "
            f"| {_ratio(res['max_allocated'], vs_ddp.get('max_allocated'))} "
            f"| {'—' if res.get('host_syncs') is None else res['host_syncs']} "
            f"| {_hidden(res, 'all_gather')} | {_hidden(res, 'reduce_scatter')} | {_hidden(res, 'side_copy')} "
            f"| {res['losses'][0]:.4f} → {res['losses'][-1]:.4f} |")
    return "\n".join(lines) + "\n"


def _row(results: dict, prefix: str, mode: str) -> dict:
    """Mode ``mode``'s row of the run named ``prefix``, else of the first run that has one ({} if none)."""
    own = results.get(f"{prefix}/{mode}" if prefix else mode)
    if own is not None:
        return own
    return next((res for name, res in results.items() if name.rpartition("/")[2] == mode), {})


def _env(job: GpuJob, argv: list[str]) -> dict:
    cuda = job.device == "cuda" and torch.cuda.is_available()
    return dict(torch=torch.__version__, cuda=torch.version.cuda or "none",
                gpu=torch.cuda.get_device_name(0) if cuda else "CPU", backend="nccl" if cuda else "gloo",
                command="python -m fullshard.bench.gpu " + " ".join(argv))


def _launch(name: str, job: GpuJob, tmp: str, timeout_s: float) -> dict:
    """Run one mode in a fresh interpreter; its result, or ``{"error": ...}`` with the last line it printed."""
    out = os.path.join(tmp, f"{name}.json")
    cmd = [sys.executable, "-m", "fullshard.bench.gpu", "--worker", name, "--job", json.dumps(dataclasses.asdict(job)),
           "--result", out, "--init-file", os.path.join(tmp, f"{name}.init")]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout_s:.0f} s"}
    if proc.returncode != 0 or not os.path.exists(out):
        tail = [line for line in (proc.stderr or proc.stdout).strip().splitlines() if line.strip()]
        sys.stderr.write(f"[{name}] exited with {proc.returncode}:\n" + "\n".join(tail[-30:]) + "\n")
        return {"error": (tail[-1] if tail else f"exit status {proc.returncode}")[:200].replace("|", "/")}
    with open(out) as f:
        return json.load(f)


def _write(out_dir: str, results: dict, job: GpuJob, env: dict) -> str:
    table = format_table(results, job, env)
    with open(os.path.join(out_dir, "gpu.md"), "w") as f:
        f.write(table)
    with open(os.path.join(out_dir, "gpu.json"), "w") as f:
        json.dump(dict(job=dataclasses.asdict(job), env=env, results=results), f, indent=1)
    return table


def _render(sources: list[str], out_dir: str, argv: list[str]) -> int:
    """``--from-json``: one table from earlier runs' raw results (each run's own command is named).

    Raises:
        ValueError: a file that cannot be read, or runs of different jobs (sizes or step counts).
    """
    results, runs, job, env = {}, [], None, None
    for source in sources:
        label, _, path = source.rpartition("=")
        try:
            with open(path) as f:
                run = json.load(f)
            this = GpuJob(**run["job"])
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ValueError(f"--from-json: cannot read {path} as a gpu.json ({e})") from None
        if job is not None and dataclasses.replace(this, trace_dir="") != dataclasses.replace(job, trace_dir=""):
            raise ValueError(f"--from-json: {path} ran another job than {sources[0]}; one table holds one job")
        job, env = job or this, env or dict(run["env"])
        runs.append(f"{label + ': ' if label else ''}`{run['env']['command']}` ({run['env']['gpu']})")
        for name, res in run["results"].items():
            if res.get("host_sync_sites") is not None:  # recounted: runs before the fix counted a non-sync warning
                res["host_syncs"] = gpu_trace.count_syncs(res["host_sync_sites"])
            results[f"{label}/{name}" if label else name] = res
    env.update(command="python -m fullshard.bench.gpu " + " ".join(argv), runs=runs)
    os.makedirs(out_dir, exist_ok=True)
    print(_write(out_dir, results, job, env))
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(prog="python -m fullshard.bench.gpu", description=__doc__.split("\n")[0])
    p.add_argument("--out-dir", help="where gpu.md and gpu.json go")
    p.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, from {', '.join(MODES)}")
    defaults = GpuJob()
    for flag, field in (("--layers", "num_layers"), ("--width", "embed_dim"), ("--heads", "num_heads"),
                        ("--vocab-size", "vocab_size"), ("--seq-len", "seq_len"), ("--batch-size", "batch_size"),
                        ("--warmup-steps", "warmup_steps"), ("--timed-steps", "timed_steps"), ("--seed", "seed")):
        p.add_argument(flag, dest=field, type=int, default=getattr(defaults, field))
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--timeout-s", type=float, default=300.0, help="per mode")
    p.add_argument("--from-json", nargs="+", metavar="[LABEL=]FILE",
                   help="run nothing: write one table from the gpu.json files of earlier runs of the same job "
                        "(rows of a LABEL= file are named LABEL/mode)")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--job", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    p.add_argument("--init-file", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        res = run_mode(args.worker, GpuJob(**json.loads(args.job)), args.init_file)
        with open(args.result, "w") as f:
            json.dump(res, f)
        return 0
    if args.from_json:
        if not args.out_dir:
            p.error("--out-dir is required")
        try:
            return _render(args.from_json, args.out_dir, argv)
        except ValueError as e:
            p.error(str(e))
    names = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = [m for m in names if m not in MODES]
    if unknown or not args.out_dir:
        p.error(f"unknown modes {unknown}" if unknown else "--out-dir is required")
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA GPU here (use --device cpu to try the modes on the CPU)")
    job = GpuJob(**{f.name: getattr(args, f.name) for f in dataclasses.fields(GpuJob) if f.name != "trace_dir"},
                 trace_dir=os.path.abspath(args.out_dir))
    results, env = {}, _env(job, argv)
    os.makedirs(args.out_dir, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        for name in names:
            results[name] = res = _launch(name, job, tmp, args.timeout_s)
            print(f"{name}: " + (f"ERROR {res['error']}" if "error" in res else
                                 f"{res['step_ms']:.1f} ms/step, max allocated {_gib(res['max_allocated'])} GiB"),
                  flush=True)
            # Written after every mode, so the modes done so far survive a run cut short.
            table = _write(args.out_dir, results, job, env)
    print(table)
    return 1 if any("error" in r for n, r in results.items() if MODES[n].family == "fully_shard") else 0


if __name__ == "__main__":
    sys.exit(main())
