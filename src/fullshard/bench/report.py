"""The report of `fullshard bench`: one row per mode from its ranks' results,
ratios, the Markdown table, the JSON document and the PNG chart.

No ``torch`` here: everything works on the plain dicts the ranks return
(see :func:`fullshard.bench.rank.rank_main`), so it is tested in one process.

Units: bytes (MiB = 2^20 bytes in the table), milliseconds per step, CPU
seconds per step, tokens per second. Every ratio is "this mode / reference",
so below 1 is faster or smaller.
"""
from __future__ import annotations

import json
import os
import statistics
import tempfile
from typing import Optional

from fullshard.bench.measure import zero_model_state_bytes
from fullshard.bench.modes import (
    COLLECTIVES,
    REFERENCE,
    VS_DATA_PARALLEL,
    VS_DEFAULT,
    VS_FSDP2,
    VS_WRAPPER,
    Mode,
    ModelSpec,
    analytic_label,
    analytic_volume_bytes,
)

MiB = float(2 ** 20)
FP32_LOSS_RTOL = 1e-5
"""fp32 modes must match DDP's per-step losses to this relative difference."""
BF16_LOSS_RTOL = 1e-2
"""bf16 modes (bf16 compute, fp32 reduce) are compared with this looser tolerance."""
DEEPSPEED_MISSING = "DeepSpeed not installed: pip install deepspeed to add ZeRO-3"


def expected_volume_bytes(mode: Mode, model: ModelSpec, update_freq: int = 1) -> dict[str, int]:
    """:func:`~fullshard.bench.modes.analytic_volume_bytes` counted unit by
    unit as each library gathers, for the GPT ``model``.

    * fullshard FULL_SHARD, torch FSDP1 and FSDP2 keep the root unit
      (embeddings, final norm, tied output projection: Ψ_root = V·C + P·C + 2·C
      elements) gathered from forward into backward, so they all-gather
      (2Ψ - Ψ_root) elements per step.
    * DeepSpeed ZeRO-3 gathers per module and releases after each use, so the
      tied embedding (V·C elements, used by the token embedding and by the
      output projection) is gathered twice in forward and twice in backward:
      2(Ψ + V·C) elements.
    * With ``update_freq`` K micro-batches per step the all-gathers happen
      K times (see [Note: communication volume] in :mod:`fullshard.bench.modes`).

    Padding rows and the per-parameter "used" flags appended to fullshard's
    reduce-scatter input are not in it (they are what remains of measured /
    expected).
    """
    psi = model.psi()
    out = analytic_volume_bytes(mode, psi, update_freq)
    gather_b = 2 if mode.bf16 else 4
    if mode.strategy == "FULL_SHARD" or mode.family in ("fsdp1", "fsdp2"):
        root = model.vocab_size * model.embed_dim + model.max_positions * model.embed_dim + 2 * model.embed_dim
        out["all_gather"] = update_freq * (2 * psi - root) * gather_b
    elif mode.family == "deepspeed":
        out["all_gather"] = update_freq * 2 * (psi + model.vocab_size * model.embed_dim) * gather_b
    return out


def merge_ranks(mode: Mode, results: list[dict], model: ModelSpec, timed_steps: int,
                tokens_per_step: int, update_freq: int = 1) -> dict:
    """One row from the ranks' results of one launch.

    Args:
        mode: the launched mode.
        results: :func:`~fullshard.bench.rank.rank_main`'s dict of every rank, by rank.
        model: the trained GPT (for the expected volume).
        timed_steps: steps the volume and CPU time were summed over.
        tokens_per_step: global tokens per step (N·B·T·K).
        update_freq: K, micro-batches per step (for the expected volume).
    Returns:
        The row: ``step_ms`` (max over ranks of each rank's median),
        ``tokens_per_s``, ``rss_peak_growth_bytes`` (max over ranks of
        ``VmHWM - VmRSS`` at the baseline), model-state bytes (max over ranks;
        ``zero_state_bytes``: the ZeRO formula's 16Ψ/N or 16Ψ beside them),
        ``volume_bytes_per_step`` by collective (max over ranks),
        ``analytic_volume_bytes`` / ``expected_volume_bytes`` and their
        ratios, ``user_s_per_step`` / ``sys_s_per_step`` (mean over ranks),
        ``losses`` (per rank, per step) and ``ranks`` (the raw results).
    """
    per_rank_ms = [statistics.median(r["step_s"]) * 1e3 for r in results]
    step_ms = max(per_rank_ms)
    psi = results[0]["psi"]
    row = dict(mode=mode.key, label=mode.label, family=mode.family, ours=mode.ours, bf16=mode.bf16, psi=psi,
               step_ms=step_ms, step_ms_per_rank=per_rank_ms, tokens_per_s=tokens_per_step / (step_ms / 1e3),
               rss_peak_growth_bytes=max(r["rss_peak_bytes"] - r["rss_base_bytes"] for r in results),
               rss_method=results[0]["rss_method"],
               user_s_per_step=statistics.mean(r["user_s"] for r in results) / timed_steps,
               sys_s_per_step=statistics.mean(r["sys_s"] for r in results) / timed_steps,
               losses=[r["losses"] for r in results], notes=sorted({n for r in results for n in r.get("notes", [])}),
               volume_source=results[0].get("volume_source"), ranks=results)
    for k in ("param_bytes", "grad_bytes", "optim_bytes"):
        row[k] = max(r[k] for r in results)
    row["state_bytes"] = row["param_bytes"] + row["grad_bytes"] + row["optim_bytes"]
    sharded = mode.family != "ddp" and mode.strategy != "NO_SHARD"
    row["zero_state_bytes"] = zero_model_state_bytes(psi, len(results), sharded)
    if results[0].get("volume_bytes") is not None:
        vol = {k: max(r["volume_bytes"][k] for r in results) / timed_steps for k in COLLECTIVES}
        row["volume_bytes_per_step"] = vol
        row["calls_per_step"] = {k: max(r["calls"][k] for r in results) / timed_steps for k in COLLECTIVES}
    if mode.pipeline:  # ZeRO's counts are of one data-parallel model, not of stages
        row["pipeline"] = mode.pipeline
        return row
    row["analytic_volume_bytes"] = analytic_volume_bytes(mode, psi, update_freq)
    row["analytic_formula"] = analytic_label(mode, update_freq)
    row["expected_volume_bytes"] = expected_volume_bytes(mode, model, update_freq)
    if "volume_bytes_per_step" in row:
        total = sum(row["volume_bytes_per_step"].values())
        row["volume_ratio_analytic"] = total / sum(row["analytic_volume_bytes"].values())
        row["volume_ratio_expected"] = total / sum(row["expected_volume_bytes"].values())
    return row


def error_row(mode: Mode, reason: str) -> dict:
    """The row of a mode whose launch failed."""
    return dict(mode=mode.key, label=mode.label, family=mode.family, ours=mode.ours, bf16=mode.bf16,
                error=reason)


def _rel_diffs(a: list[list[float]], b: list[list[float]]) -> Optional[list[float]]:
    """Per step, the max over ranks of ``|a - b| / |b|``; None when the shapes differ."""
    if len(a) != len(b) or any(len(x) != len(y) for x, y in zip(a, b)):
        return None
    return [max(abs(x[i] - y[i]) / max(abs(y[i]), 1e-12) for x, y in zip(a, b)) for i in range(len(a[0]))]


def add_comparisons(rows: list[dict]) -> None:
    """Add ratios to DDP (``step_ratio_ddp``, ``rss_ratio_ddp``) and the loss
    check (``loss_max_rel_diff``, ``loss_rtol``, ``loss_match``, and
    ``loss_first_bad_step``, 1-based, when it fails) to every row that ran;
    needs the DDP row (otherwise they stay absent)."""
    ref = next((r for r in rows if r["mode"] == REFERENCE and "error" not in r), None)
    for r in rows:
        if "error" in r or ref is None:
            continue
        r["step_ratio_ddp"] = r["step_ms"] / ref["step_ms"]
        r["rss_ratio_ddp"] = (r["rss_peak_growth_bytes"] / ref["rss_peak_growth_bytes"]
                              if ref["rss_peak_growth_bytes"] else None)
        if r is ref:
            continue
        r["loss_rtol"] = BF16_LOSS_RTOL if r["bf16"] else FP32_LOSS_RTOL
        if r.get("pipeline"):  # every rank has the global batch's loss: against DDP's mean over ranks
            steps = list(zip(*ref["losses"]))
            diffs = _rel_diffs(r["losses"][:1], [[sum(s) / len(s) for s in steps]])
        else:
            diffs = _rel_diffs(r["losses"], ref["losses"])
        r["loss_max_rel_diff"] = None if diffs is None else max(diffs, default=0.0)
        r["loss_match"] = diffs is not None and r["loss_max_rel_diff"] <= r["loss_rtol"]
        if diffs is not None and not r["loss_match"]:
            r["loss_first_bad_step"] = next(i + 1 for i, d in enumerate(diffs) if d > r["loss_rtol"])


def fsdp2_ratios(rows: list[dict]) -> list[dict]:
    """:func:`pair_ratios` of the :data:`VS_FSDP2` pairs: fullshard modes to torch FSDP2."""
    return pair_ratios(rows, VS_FSDP2)


def pair_ratios(rows: list[dict], pairs) -> list[dict]:
    """For each ``(mode, reference mode)`` key pair of ``pairs`` that both ran:
    step-time, RSS, model-state and communication-volume ratios of the mode to
    the reference (``mode``, ``vs``, ``step_ratio``, ``rss_ratio``,
    ``state_ratio``, ``volume_ratio``: total bytes per step, None when either
    was not measured; labels for the names)."""
    ok = {r["mode"]: r for r in rows if "error" not in r}
    out = []
    for ours, theirs in pairs:
        if ours in ok and theirs in ok:
            a, b = ok[ours], ok[theirs]
            out.append(dict(mode=a["label"], vs=b["label"], step_ratio=a["step_ms"] / b["step_ms"],
                            rss_ratio=(a["rss_peak_growth_bytes"] / b["rss_peak_growth_bytes"]
                                       if b["rss_peak_growth_bytes"] else None),
                            state_ratio=a["state_bytes"] / b["state_bytes"], volume_ratio=_volume_ratio(a, b)))
    return out


def _volume_ratio(a: dict, b: dict) -> Optional[float]:
    va, vb = a.get("volume_bytes_per_step"), b.get("volume_bytes_per_step")
    if not va or not vb or not sum(vb.values()):
        return None
    return sum(va.values()) / sum(vb.values())


# ---------------------------------------------------------------- Markdown
COLUMNS = ("mode", "step ms", "×DDP", "tok/s", "RSS peak MiB", "×DDP", "params MiB", "grads MiB", "optim MiB",
           "AG MiB/step", "RS MiB/step", "AR MiB/step", "A2A MiB/step", "vol/ZeRO", "vol/expected", "user s/step",
           "sys s/step", "losses vs DDP")


def _f(x: Optional[float], fmt: str) -> str:
    return "-" if x is None else format(x, fmt)


def _loss_cell(r: dict) -> str:
    if r["mode"] == REFERENCE:
        return "reference"
    if "loss_match" not in r:
        return "-"
    d = r["loss_max_rel_diff"]
    verdict = "match" if r["loss_match"] else "MISMATCH"
    prefix = "bf16 " if r["bf16"] else ""
    if r["loss_match"]:
        return f"{prefix}{verdict} ({_f(d, '.1e')} ≤ {r['loss_rtol']:.0e})"
    if d is None:
        return f"{prefix}{verdict} (different number of ranks or steps)"
    return f"{prefix}{verdict} ({d:.1e} > {r['loss_rtol']:.0e} from step {r['loss_first_bad_step']})"


def table_row(r: dict) -> list[str]:
    """The cells of one row (an error row: the label, then ``ERROR: reason``)."""
    if "error" in r:
        return [r["label"], f"ERROR: {r['error']}"] + [""] * (len(COLUMNS) - 2)
    vol = r.get("volume_bytes_per_step")
    mib = lambda x: _f(None if x is None else x / MiB, ".2f")  # noqa: E731
    return [r["label"], f"{r['step_ms']:.1f}", _f(r.get("step_ratio_ddp"), ".2f"), f"{r['tokens_per_s']:.0f}",
            mib(r["rss_peak_growth_bytes"]), _f(r.get("rss_ratio_ddp"), ".2f"), mib(r["param_bytes"]),
            mib(r["grad_bytes"]), mib(r["optim_bytes"])] + \
        [mib(vol[k]) if vol else "-" for k in COLLECTIVES] + \
        [_f(r.get("volume_ratio_analytic"), ".3f"), _f(r.get("volume_ratio_expected"), ".3f"),
         f"{r['user_s_per_step']:.3f}", f"{r['sys_s_per_step']:.3f}", _loss_cell(r)]


def _md(cells: list[str]) -> str:
    return "| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |"


def preset_label(preset: str, overrides=()) -> str:
    """``quick``, or ``quick with --arch, --seq-len`` when flags overrode the preset."""
    return f"{preset} with {', '.join(overrides)}" if overrides else preset


def markdown(report: dict) -> str:
    """The whole report as Markdown: a header line, the table, the FSDP2 ratios and notes."""
    cfg, rows = report["config"], report["modes"]
    m = cfg["model"]
    preset = preset_label(cfg["preset"], cfg.get("overrides", ()))
    lines = [
        f"`fullshard bench` — preset `{preset}`: GPT {m['num_layers']} layers × width {m['embed_dim']}, "
        f"{m['num_heads']} heads, V={m['vocab_size']}, P={m['max_positions']} (Ψ = {cfg['psi']:,}); "
        f"{cfg['world_size']} gloo ranks × {cfg['threads']} threads on {cfg['cpu_cores']} cores; batch "
        f"{cfg['batch_size']} × {cfg['seq_len']} tokens per rank{_accumulation(cfg)}; {cfg.get('optimizer', 'AdamW')}; "
        f"{cfg['warmup_steps']} warm-up + "
        f"{cfg['timed_steps']} timed steps; torch {cfg['torch_version']}; load average (1 min) "
        f"{cfg['load_average_before'][0]:.2f} before, {cfg['load_average_after'][0]:.2f} after.",
        "",
        _md(list(COLUMNS)),
        _md(["---"] + ["---:"] * (len(COLUMNS) - 2) + ["---"]),
    ]
    lines += [_md(table_row(r)) for r in rows]
    lines += per_rank_table(report)
    for key, title in (("vs_data_parallel", f"pp=2 x dp={cfg['world_size'] // 2} / dp={cfg['world_size']}"),
                       ("vs_default", "world_size_invariant=True / default"),
                       ("vs_wrapper", "ratio to the FullyShardedDataParallel wrapper"),
                       ("vs_fsdp2", "ratio to torch FSDP2")):
        pairs = report.get(key) or []
        if pairs:
            lines += ["", _md([title, "step time", "RSS peak", "params+grads+optim", "bytes moved"]),
                      _md(["---", "---:", "---:", "---:", "---:"])]
            lines += [_md([f"{p['mode']} / {p['vs']}", f"{p['step_ratio']:.2f}", _f(p["rss_ratio"], ".2f"),
                           f"{p['state_ratio']:.3f}", _f(p.get("volume_ratio"), ".3f")]) for p in pairs]
    lines += [""] + [f"{n}" for n in report.get("notes", [])]
    return "\n".join(lines) + "\n"


def per_rank_table(report: dict) -> list[str]:
    """When a pipeline mode ran: the Markdown lines of each rank's step time (median), RSS peak and
    model state for the pipeline modes and their data-parallel references (``VS_DATA_PARALLEL``,
    DDP); no lines otherwise."""
    rows = [r for r in report["modes"] if "error" not in r]
    if not any(r.get("pipeline") for r in rows):
        return []
    shown = {m for pair in VS_DATA_PARALLEL for m in pair} | {REFERENCE}
    world = report["config"]["world_size"]
    head = ["per rank: step ms / RSS peak MiB / params+grads+optim MiB"] + [f"rank {i}" for i in range(world)]
    lines = ["", _md(head), _md(["---"] + ["---:"] * world)]
    for r in rows:
        if r["mode"] in shown:
            cells = [f"{ms:.1f} / {(x['rss_peak_bytes'] - x['rss_base_bytes']) / MiB:.1f} / "
                     f"{(x['param_bytes'] + x['grad_bytes'] + x['optim_bytes']) / MiB:.1f}"
                     for ms, x in zip(r["step_ms_per_rank"], r["ranks"])]
            lines.append(_md([r["label"]] + cells))
    return lines


def _accumulation(cfg: dict) -> str:
    k = cfg.get("update_freq", 1)
    return f", {k} micro-batches per step (gradients accumulated under no_sync)" if k > 1 else ""


def notes(report: dict) -> list[str]:
    """The lines under the table: definitions, then what this run needs said."""
    cfg, rows = report["config"], report["modes"]
    out = [
        "- step ms: median of the timed steps (zero_grad, forward, loss, backward, optimizer step; a barrier "
        "before each), max over ranks; ×DDP = ratio to torch DDP (ratios are the result, absolute times depend "
        "on the machine). tok/s = ranks × batch × tokens / step.",
        "- RSS peak: per rank, VmHWM (reset before the model is built) minus VmRSS just before the model is "
        "built, max over ranks: model build, wrapping, optimizer state, activations, gathered parameters. "
        "Each mode runs in fresh processes with glibc malloc's default settings.",
        "- params/grads/optim: distinct storages this rank holds after the last step (local shards of "
        "DTensors; DeepSpeed: its partitions and fp32 master partitions, its flat gradient partition buffer), "
        "max over ranks.",
        "- AG/RS/AR/A2A: all-gather / reduce-scatter / all-reduce / all-to-all volume per rank per step: "
        "all-gather output bytes, reduce-scatter and all-to-all input bytes, 2 × all-reduce bytes "
        "(world_size_invariant=True exchanges each backward's gradient by one all-to-all of the "
        "reduce-scatter's size and folds it in rank order: A2A replaces RS). vol/ZeRO = total over the ZeRO paper's "
        "volume (Rajbhandari et al. 2020, §7: DDP, NO_SHARD and SHARD_GRAD_OP 2Ψ, FULL_SHARD 3Ψ elements; "
        "bf16 all-gathers 2 bytes, reductions fp32). vol/expected = total over the same count with the root "
        "unit (embeddings, final norm) all-gathered once per step, as fullshard, FSDP1 and FSDP2 do "
        "(they keep it gathered from forward into backward); the rest is padding and fullshard's "
        "per-parameter used flags.",
        "- user/sys s/step: getrusage(RUSAGE_SELF) CPU seconds over the timed steps / steps, mean over ranks "
        "(all threads of the rank: intra-op, gloo, autograd).",
        f"- losses vs DDP: max over ranks and steps of |loss - DDP loss| / DDP loss; fp32 modes must be within "
        f"{FP32_LOSS_RTOL:.0e}, bf16 modes within {BF16_LOSS_RTOL:.0e}.",
    ]
    psi = cfg["psi"]
    out.insert(4, f"- Ψ = {psi:,} parameters (the tied embedding once); ZeRO volume per step: 2Ψ·4 B = "
                  f"{8 * psi / MiB:.2f} MiB (DDP, NO_SHARD, SHARD_GRAD_OP), 3Ψ·4 B = {12 * psi / MiB:.2f} MiB "
                  f"(FULL_SHARD). DeepSpeed's expected volume counts the tied embedding gathered once per use "
                  f"(token embedding and output projection), in forward and in backward.")
    if any(r.get("pipeline") for r in rows):
        n = cfg["world_size"]
        out.append(f"- pp=2 rows: pp=2 x dp={n // 2}, fully_shard stages under torch's 1F1B schedule (fullshard "
                   "train's pipeline), on the global batch of the other modes in pipeline micro-batches of one "
                   "sequence; unsharded = gradients accumulated unsharded over the micro-batches, reduce-scattered "
                   "once. Their losses vs DDP: the global batch's mean loss against the mean over ranks of DDP's. "
                   "AG/RS/AR count fullshard's collectives (AR: the tied embedding's gradient), not the stages' "
                   "activation sends; ZeRO's volume is of one data-parallel model, so vol/ZeRO is not given.")
    if report.get("vs_default"):
        k = cfg.get("update_freq", 1)
        out.append("- world_size_invariant=True / default: the same mode with gradients summed over ranks in "
                   "global micro-batch order (its bench loss is divided by N, the same gradient scale); "
                   "bytes moved = total volume per step."
                   + (f" With {k} micro-batches per step the default reduces once per step, the invariant "
                      f"path all-to-alls each micro-batch and keeps each no_sync micro-batch's full gradient "
                      f"apart until then." if k > 1 else ""))
    by_source: dict[str, list[str]] = {}
    for r in rows:
        if "error" not in r and r.get("volume_source"):
            by_source.setdefault(r["volume_source"], []).append(r["label"])
    if by_source:
        out.append("- volume measured by " + "; ".join(f"{src} ({', '.join(labels)})"
                                                      for src, labels in by_source.items()) + ".")
    for r in rows:
        out += [f"- {r['label']}: note from the library: {n}" for n in r.get("notes", [])]
    if cfg.get("malloc_env"):
        out.append(f"- MALLOC_* set in the environment (not defaults): {cfg['malloc_env']}")
    if cfg["world_size"] * cfg["threads"] > cfg["cpu_cores"]:
        out.append(f"- oversubscribed: {cfg['world_size']} ranks × {cfg['threads']} threads on "
                   f"{cfg['cpu_cores']} cores; times are indicative only.")
    if not cfg.get("deepspeed_available"):
        out.append(f"- {DEEPSPEED_MISSING}")
    return out


# ---------------------------------------------------------------- files
def build_report(config: dict, rows: list[dict]) -> dict:
    """The JSON document: ``config``, ``modes`` (rows with comparisons), ``vs_data_parallel``
    (pipeline modes to ``fully_shard`` over every rank), ``vs_default``
    (world_size_invariant modes to the same mode without it), ``vs_wrapper`` (fully_shard modes
    to the wrapper's), ``vs_fsdp2``, ``notes``."""
    add_comparisons(rows)
    report = {"config": config, "modes": rows, "vs_data_parallel": pair_ratios(rows, VS_DATA_PARALLEL),
              "vs_default": pair_ratios(rows, VS_DEFAULT),
              "vs_wrapper": pair_ratios(rows, VS_WRAPPER),
              "vs_fsdp2": fsdp2_ratios(rows)}
    report["notes"] = notes(report)
    return report


def write_atomic(path: str, data: bytes) -> None:
    """Write ``data`` to ``path`` through a temporary file in the same directory and a rename."""
    d = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(dir=d, prefix="." + os.path.basename(path) + ".", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp makes 0600; a plain file's mode instead
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def chart_png(report: dict) -> bytes:
    """A PNG (matplotlib, Agg): per mode, bars of step time and peak RSS as ratios
    to DDP (absolute ms and MiB when DDP did not run); failed modes left out."""
    import io

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in report["modes"] if "error" not in r]
    have_ref = all("step_ratio_ddp" in r for r in rows) and rows
    fig, axes = plt.subplots(1, 2, figsize=(12, 0.45 * max(len(rows), 2) + 1.6))
    labels = [r["label"] for r in rows]
    if have_ref:
        series = [("step time / DDP", [r["step_ratio_ddp"] for r in rows]),
                  ("peak RSS growth / DDP", [r["rss_ratio_ddp"] or 0.0 for r in rows])]
    else:
        series = [("step time (ms)", [r["step_ms"] for r in rows]),
                  ("peak RSS growth (MiB)", [r["rss_peak_growth_bytes"] / MiB for r in rows])]
    for ax, (title, values) in zip(axes, series):
        colors = ["tab:blue" if r["ours"] else "tab:gray" for r in rows]
        ax.barh(range(len(rows)), values, color=colors)
        ax.set_yticks(range(len(rows)), labels)
        ax.invert_yaxis()
        ax.set_title(title)
        if have_ref:
            ax.axvline(1.0, color="black", linewidth=0.8)
        for i, v in enumerate(values):
            ax.text(v, i, f" {v:.2f}", va="center", fontsize=8)
    cfg = report["config"]
    preset = preset_label(cfg["preset"], cfg.get("overrides", ()))
    fig.suptitle(f"fullshard bench, preset {preset}: Ψ = {cfg['psi']:,}, N = {cfg['world_size']} "
                 f"(blue: fullshard)", fontsize=10)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100)
    plt.close(fig)
    return buf.getvalue()


def write_files(report: dict, out_dir: str) -> dict[str, str]:
    """Write ``bench.md``, ``bench.json`` and ``bench.png`` into ``out_dir`` (created), each atomically.

    Returns:
        ``{"md", "json", "png"}`` -> path.
    """
    os.makedirs(out_dir, exist_ok=True)
    paths = {k: os.path.join(out_dir, f"bench.{k}") for k in ("md", "json", "png")}
    write_atomic(paths["md"], markdown(report).encode())
    write_atomic(paths["json"], (json.dumps(report, indent=1, sort_keys=False) + "\n").encode())
    write_atomic(paths["png"], chart_png(report))
    return paths
