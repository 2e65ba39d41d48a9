"""LoRA benchmark: full fine-tuning against LoRA (fp32 base, bf16 base) and QLoRA (NF4 base) on a small
Hugging Face Llama, under fullshard's ``fully_shard`` and torch FSDP2 + PEFT.

Run::

    fullshard bench --lora                       # 2 ranks, every row (about 2 minutes on 2 CPU cores)
    fullshard bench --lora --modes lora_bf16,fsdp2_lora_bf16 --timed-steps 10

torch's elastic launcher starts N gloo ranks on the CPU (one launch; the rows run one after another
in the same processes). Every row builds the same ``transformers`` ``LlamaForCausalLM`` from a
config (random weights from ``--seed``, nothing downloaded) and, for a LoRA row, casts the base to
the row's dtype and applies PEFT (``LoraConfig(r, alpha = 2r, target_modules)``; PEFT keeps the
adapters fp32); a QLoRA row then makes each decoder layer's frozen Linear weight a torchao ``NF4Tensor``
of its whole bf16 value (``to_nf4``, block 64, scaler block 256, as train/qlora.py), so every rank
holds the same NF4 base and both libraries shard it with the tensor-subclass all-gather extension
(``fsdp_pre_all_gather`` / ``fsdp_post_all_gather``; ours: core/packed.py). Then each row shards each
decoder layer and the root (``fully_shard`` per layer, then the model) and steps AdamW over
``model.parameters()`` (frozen ones get no state). The batches of random tokens are the same for every row.

Measured over the timed steps (after ``--warmup-steps``), per rank:

* step time (median; each step after a barrier, ``zero_grad`` to the end of ``optimizer.step``);
* bytes all-gathered and reduce-scattered per step: the volume of [Note: communication volume] in
  :mod:`fullshard.bench.modes` (an all-gather's output, a reduce-scatter's input), from
  ``fullshard.core.collectives``' counters for fullshard, from wrapped ``torch.distributed``
  functions for torch FSDP2 (:class:`fullshard.bench.rank.PatchedCollectives`, installed before
  torch FSDP is imported);
* peak memory of a step, max over ranks: what is live when it starts (parameter shards and optimizer
  state; gradients set to None) plus the peak the torch profiler's CPU allocator events show during
  one more step (:func:`fullshard.bench.measure.peak_allocated_bytes`; fullshard's buffer pool is
  emptied first, so its buffers count). Allocator-independent, unlike RSS, which glibc's reuse of
  freed memory makes depend on the rows run before in the same process;
* model state after that step: parameter shards (an NF4 shard: its packed codes, scales and
  factors), gradients and optimizer state;
* the loss of each step: a fullshard row's must equal its torch row's (same model, same batches)
  within :data:`LOSS_TOL`, else the run fails.

Before the rows, each library in the rows trains a one-layer model of the same kind for one step
(one-time imports and set-up stay out of the first row).
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import gc
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

from fullshard import fully_shard as ours_fully_shard
from fullshard.bench import measure
from fullshard.bench.rank import PatchedCollectives
from fullshard.core import collectives
from fullshard.train import qlora
from fullshard.train.launcher import launch_local

MiB = float(2 ** 20)
LOSS_TOL = 1e-4
"""Largest |loss difference| allowed between a fullshard row and its torch row at any step (the table's
last printed digit; both dequantize and compute identically, so they differ by summation order only)."""


@dataclasses.dataclass(frozen=True)
class LoraMode:
    """One row: ``family`` ``fullshard`` or ``fsdp2`` (torch); ``lora`` off for a full fine-tune;
    ``base`` the frozen base's dtype under LoRA; ``nf4``: its decoder-layer Linear weights NF4 (QLoRA)."""

    key: str
    label: str
    family: str
    lora: bool
    base: torch.dtype = torch.float32
    nf4: bool = False


LORA_MODES = {m.key: m for m in (
    LoraMode("full_ft", "fullshard full fine-tune", "fullshard", False),
    LoraMode("lora_fp32", "fullshard LoRA, fp32 base", "fullshard", True),
    LoraMode("lora_bf16", "fullshard LoRA, bf16 base", "fullshard", True, torch.bfloat16),
    LoraMode("qlora", "fullshard QLoRA, NF4 base", "fullshard", True, torch.bfloat16, nf4=True),
    LoraMode("fsdp2_full_ft", "torch FSDP2 full fine-tune", "fsdp2", False),
    LoraMode("fsdp2_lora_fp32", "torch FSDP2 + PEFT, fp32 base", "fsdp2", True),
    LoraMode("fsdp2_lora_bf16", "torch FSDP2 + PEFT, bf16 base", "fsdp2", True, torch.bfloat16),
    LoraMode("fsdp2_qlora", "torch FSDP2 + PEFT, NF4 base", "fsdp2", True, torch.bfloat16, nf4=True),
)}
"""Every row, in the order they run."""


@dataclasses.dataclass(frozen=True)
class LoraJob:
    """The model, the batch and the rows of one launch."""

    modes: tuple = tuple(LORA_MODES)
    world_size: int = 2
    hidden_size: int = 256
    intermediate_size: int = 768  # Llama's 8h/3 rounded up to 256: whole NF4 scaler blocks per rank at N = 1, 2
    num_layers: int = 4
    num_heads: int = 8
    num_kv_heads: int = 4
    vocab_size: int = 4096
    batch_size: int = 4
    seq_len: int = 128
    lora_rank: int = 8
    target_modules: tuple = ("q_proj", "v_proj")
    warmup_steps: int = 2
    timed_steps: int = 5
    lr: float = 1e-4
    seed: int = 1
    timeout_s: float = 300.0
    note: str = ""  # printed before the table (QLoRA rows left out of the default rows)


def build(job: LoraJob, mode: LoraMode) -> torch.nn.Module:
    """The job's Llama from ``job.seed`` (the same weights in every row), LoRA-wrapped for a LoRA row."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=job.vocab_size, hidden_size=job.hidden_size,
                      intermediate_size=job.intermediate_size, num_hidden_layers=job.num_layers,
                      num_attention_heads=job.num_heads, num_key_value_heads=job.num_kv_heads,
                      max_position_embeddings=job.seq_len, bos_token_id=0, eos_token_id=1, use_cache=False)
    torch.manual_seed(job.seed)
    model = LlamaForCausalLM(cfg)
    if not mode.lora:
        return model
    from peft import LoraConfig, get_peft_model

    model.to(mode.base)
    model = get_peft_model(model, LoraConfig(r=job.lora_rank, lora_alpha=2 * job.lora_rank, lora_dropout=0.0,
                                             target_modules=list(job.target_modules), task_type="CAUSAL_LM"))
    if mode.nf4:
        from torchao.quantization import to_nf4

        for layer in model.get_base_model().model.layers:
            qlora.check_world(layer, dist.get_world_size() if dist.is_initialized() else 1)
            for _, linear in qlora.base_linears(layer):
                linear.weight = torch.nn.Parameter(to_nf4(linear.weight.detach(), qlora.BLOCK, qlora.SCALER_BLOCK),
                                                   requires_grad=False)
    return model


def nf4_shapes(job: LoraJob) -> list[tuple[int, int]]:
    """The shapes of a decoder layer's Linear weights (q, k and v, o, gate and up, down)."""
    h, kv = job.hidden_size, job.hidden_size // job.num_heads * job.num_kv_heads
    return [(h, h), (kv, h), (job.intermediate_size, h), (h, job.intermediate_size)]


def shard(mode: LoraMode, model: torch.nn.Module) -> torch.nn.Module:
    """Each decoder layer, then the root: fullshard's or torch's ``fully_shard`` (defaults: FULL_SHARD)."""
    if mode.family == "fsdp2":
        from torch.distributed.fsdp import fully_shard  # the baseline only (lazy, as in bench/rank.py)
    else:
        fully_shard = ours_fully_shard
    inner = model.get_base_model() if mode.lora else model
    for layer in inner.model.layers:
        fully_shard(layer)
    return fully_shard(model)


def _batches(job: LoraJob, rank: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(job.seed * 100_003 + rank)
    return [torch.randint(0, job.vocab_size, (job.batch_size, job.seq_len + 1), generator=g)
            for _ in range(job.warmup_steps + job.timed_steps)]


def _step(model, opt, tokens: torch.Tensor) -> float:
    opt.zero_grad(set_to_none=True)
    logits = model(input_ids=tokens[:, :-1]).logits
    loss = F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), tokens[:, 1:].reshape(-1))
    loss.backward()
    opt.step()
    return loss.item()


def _volume(mode: LoraMode, patched: PatchedCollectives, world: int) -> dict:
    if mode.family == "fsdp2":
        return {k: patched.bytes[k] for k in ("all_gather", "reduce_scatter")}
    return {"all_gather": collectives.BYTES["all_gather"] * world,  # counted as the shard sent
            "reduce_scatter": collectives.BYTES["reduce_scatter"]}


def _measure(job: LoraJob, mode: LoraMode, batches, patched: PatchedCollectives) -> dict:
    gc.collect()
    model = shard(mode, build(job, mode))
    params = list(model.parameters())
    trainable = sum(measure.local_tensor(p).numel() for p in params if p.requires_grad)
    opt = torch.optim.AdamW(params, lr=job.lr)
    step_s, losses = [], []
    for i, tokens in enumerate(batches):
        if i == job.warmup_steps:
            collectives.reset_counts()
            patched.reset()
        dist.barrier()
        t0 = time.perf_counter()
        losses.append(_step(model, opt, tokens))
        if i >= job.warmup_steps:
            step_s.append(time.perf_counter() - t0)
    vol = _volume(mode, patched, dist.get_world_size())
    opt.zero_grad(set_to_none=True)
    live = measure.param_bytes(model) + measure.optim_state_bytes(opt)
    _, peak = measure.peak_allocated_bytes(functools.partial(_step, model, opt, batches[-1]))
    out = dict(step_s=statistics.median(step_s), losses=losses, peak_bytes=live + peak, trainable_numel=trainable,
               param_bytes=measure.param_bytes(model), grad_bytes=measure.grad_bytes(model),
               optim_bytes=measure.optim_state_bytes(opt),
               **{f"{k}_bytes_per_step": v // job.timed_steps for k, v in vol.items()})
    del model, opt, params
    gc.collect()
    return out


def _warm_up(job: LoraJob, patched: PatchedCollectives) -> None:
    """One step of a one-layer LoRA Llama (bf16 base) under each library of ``job``'s rows."""
    tiny = dataclasses.replace(job, hidden_size=32, intermediate_size=64, num_layers=1, num_heads=4,
                               num_kv_heads=2, vocab_size=64, batch_size=1, seq_len=8, warmup_steps=0,
                               timed_steps=1)
    for family in dict.fromkeys(LORA_MODES[k].family for k in job.modes):
        mode = next(m for m in LORA_MODES.values() if m.family == family and m.lora and m.base != torch.float32
                    and not m.nf4)
        _measure(tiny, mode, _batches(tiny, dist.get_rank()), patched)
    if any(LORA_MODES[k].nf4 for k in job.modes):
        import torchao.quantization  # noqa: F401  (its import, seconds, stays out of the first QLoRA row)


def rank_main(job: LoraJob) -> dict:
    """Entry of one rank: ``{"rank", "threads", "rows": [one dict per mode]}``."""
    patched = PatchedCollectives()
    patched.install()  # before torch FSDP is imported: the names it binds are the counting ones

    def rows(rank: int) -> list[dict]:
        _warm_up(job, patched)
        batches = _batches(job, rank)
        return [measure.run_guarded({"mode": key}, lambda key=key: _measure(job, LORA_MODES[key], batches, patched))
                for key in job.modes]

    return measure.run_rank(job.timeout_s, rows)


def format_report(results: list[dict], job: LoraJob) -> list[str]:
    """The table: per row the max over ranks of step time, bytes all-gathered and reduce-scattered per
    step, peak memory of a step and model state after it; trainable parameters (all ranks' shards) and
    the first rank's last loss."""
    head = (f"{'row':<32}{'trainable':>11}{'step s':>8}{'all-gather MiB':>16}{'reduce-scatter MiB':>20}"
            f"{'peak MiB':>10}{'state MiB':>11}{'last loss':>11}")
    lines = [head, "-" * len(head)]
    for i, key in enumerate(job.modes):
        rows = [res["rows"][i] for res in results]
        errs = [(res["rank"], r["error"]) for res, r in zip(results, rows) if "error" in r]
        own = [e for e in errs if e[1] != "another rank failed"] or errs
        label = LORA_MODES[key].label
        if own:
            lines.append(f"{label:<32}  ERROR rank {own[0][0]}: {own[0][1]}")
            continue
        mx = lambda k, rows=rows: max(r[k] for r in rows)  # noqa: E731
        state = max(r["param_bytes"] + r["grad_bytes"] + r["optim_bytes"] for r in rows)
        lines.append(f"{label:<32}{sum(r['trainable_numel'] for r in rows):>11,}{mx('step_s'):>8.3f}"
                     f"{mx('all_gather_bytes_per_step') / MiB:>16.3f}{mx('reduce_scatter_bytes_per_step') / MiB:>20.3f}"
                     f"{mx('peak_bytes') / MiB:>10.2f}{state / MiB:>11.2f}{rows[0]['losses'][-1]:>11.4f}")
    diffs = loss_diffs(results, job)
    if diffs:
        lines.append(f"loss vs torch, max |diff| over steps and ranks (tolerance {LOSS_TOL:g}): "
                     + ", ".join(f"{k} {d:.2g}" + (" MISMATCH" if d > LOSS_TOL else "") for k, d in diffs.items()))
    tb = next((r["traceback"] for res in results for r in res["rows"] if "traceback" in r), None)
    if tb:
        lines += ["", "first traceback:", tb]
    return lines


def loss_diffs(results: list[dict], job: LoraJob) -> dict[str, float]:
    """``{fullshard row key: max |loss - torch row's loss| over every step and rank}`` for each fullshard row
    whose torch row (``fsdp2_`` + key) also ran in ``job`` on every rank."""
    out = {}
    for key in job.modes:
        other = f"fsdp2_{key}"
        if LORA_MODES[key].family != "fullshard" or other not in job.modes:
            continue
        i, j = job.modes.index(key), job.modes.index(other)
        pairs = [(res["rows"][i], res["rows"][j]) for res in results]
        if all("losses" in a and "losses" in b for a, b in pairs):
            out[key] = max(abs(x - y) for a, b in pairs for x, y in zip(a["losses"], b["losses"]))
    return out


def job_from_args(args: argparse.Namespace, fail) -> LoraJob:
    """The :class:`LoraJob` of `fullshard bench --lora` (``--modes`` names rows of :data:`LORA_MODES`;
    ``--world-size``, ``--warmup-steps``, ``--timed-steps``, ``--batch-size``, ``--seq-len``, ``--seed``,
    ``--timeout-s`` apply).

    Args:
        fail: called with a one-line message on bad input (must not return).
    """
    d = LoraJob()
    for flag, given in (("--preset", args.preset != "quick"), ("--update-freq", args.update_freq != 1),
                        ("--optimizer", args.optimizer != "adam"), ("--arch", args.arch), ("--layers", args.layers),
                        ("--width", args.width), ("--heads", args.heads), ("--vocab-size", args.vocab_size),
                        ("--threads", args.threads)):
        if given:
            fail(f"{flag} is for the GPT bench, not --lora (a fixed small Llama, AdamW); drop it")
    modes = [m for m in (args.modes or ",".join(LORA_MODES)).split(",") if m]
    unknown = [m for m in modes if m not in LORA_MODES]
    if unknown or not modes:
        fail(f"--lora: unknown --modes {','.join(unknown) or '(none)'}; choose from {','.join(LORA_MODES)}")
    pick = lambda name: d.__dict__[name] if getattr(args, name) is None else getattr(args, name)  # noqa: E731
    job = dataclasses.replace(d, modes=tuple(modes), world_size=pick("world_size"), batch_size=pick("batch_size"),
                              seq_len=pick("seq_len"), warmup_steps=pick("warmup_steps"),
                              timed_steps=pick("timed_steps"), seed=args.seed, timeout_s=args.timeout_s)
    for name in ("world_size", "batch_size", "seq_len", "timed_steps"):
        if getattr(job, name) < 1:
            fail(f"--{name.replace('_', '-')} must be >= 1, got {getattr(job, name)}")
    if job.warmup_steps < 0:
        fail(f"--warmup-steps must be >= 0, got {job.warmup_steps}")
    bad = [s for s in nf4_shapes(job) if not qlora.fits(s, job.world_size)]
    nf4 = [m for m in job.modes if LORA_MODES[m].nf4]
    if bad and nf4:
        why = (f"a {bad[0][0]} x {bad[0][1]} weight does not split into whole NF4 scaler blocks "
               f"({qlora.BLOCK} x {qlora.SCALER_BLOCK} elements) on each of {job.world_size} ranks")
        if args.modes:
            fail(f"--lora: --modes {','.join(nf4)}: {why}; use --world-size 1 or 2, or drop them")
        job = dataclasses.replace(job, modes=tuple(m for m in job.modes if m not in nf4),
                                  note=f"QLoRA rows left out: {why} (they run at --world-size 1 or 2)")
    return job


def run(job: LoraJob) -> int:
    """Launch, print the table; 0 when every fullshard row ran and its losses equal its torch row's within
    :data:`LOSS_TOL` (a torch row may fail: its row says why)."""
    print(f"fullshard bench --lora: torch {torch.__version__}, N={job.world_size} gloo ranks; Llama "
          f"h={job.hidden_size}, F={job.intermediate_size}, L={job.num_layers}, heads {job.num_heads}/"
          f"{job.num_kv_heads} kv, V={job.vocab_size}; batch {job.batch_size} x {job.seq_len} tokens per rank; "
          f"LoRA r={job.lora_rank} on {','.join(job.target_modules)}"
          + ("; QLoRA: decoder-layer Linear weights NF4 (block 64, scaler block 256)"
             if any(LORA_MODES[k].nf4 for k in job.modes) else "")
          + f"; AdamW; {job.warmup_steps} warm-up + {job.timed_steps} timed steps", flush=True)
    t0 = time.perf_counter()
    try:
        results = launch_local(rank_main, job, job.world_size)
    except Exception as e:
        print(f"LAUNCH FAILED: {e}", flush=True)
        return 1
    print(f"threads per rank: {results[0]['threads']}")
    if job.note:
        print(job.note)
    print("\n".join(format_report(results, job)))
    failed = [k for i, k in enumerate(job.modes) if LORA_MODES[k].family == "fullshard"
              and any("error" in res["rows"][i] for res in results)]
    failed += [f"{k} loss" for k, d in loss_diffs(results, job).items() if d > LOSS_TOL]
    print(f"total wall time: {time.perf_counter() - t0:.1f} s" + (f"; FAILED: {failed}" if failed else ""),
          flush=True)
    return 1 if failed else 0
