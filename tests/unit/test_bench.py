"""Fast single-process checks of the benchmarks' measurements, tables and files (no ranks launched)."""
import argparse
import dataclasses
import json
import mmap

import pytest
import torch

from fullshard.bench import measure, report as RP, suite
from fullshard.bench.modes import MODES, ModelSpec, analytic_label, analytic_volume_bytes


def test_storage_bytes_counts_shared_storage_once():
    flat = torch.zeros(10)
    a, b = flat[:4], flat[4:]
    other = torch.zeros(3, dtype=torch.float64)
    assert measure.storage_bytes([a, b, None, other, torch.empty(0)]) == 10 * 4 + 3 * 8


def test_model_state_bytes_of_adamw():
    model = torch.nn.Linear(3, 2)  # 8 parameters
    opt = torch.optim.AdamW(model.parameters())
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    assert measure.param_bytes(model) == 8 * 4
    assert measure.grad_bytes(model) == 8 * 4
    assert measure.optim_state_bytes(opt) == 2 * 8 * 4 + 2 * 4  # m, v + one fp32 step per tensor


def test_zero_formula():
    assert measure.zero_model_state_bytes(1000, 4, sharded=True) == 4000
    assert measure.zero_model_state_bytes(1000, 4, sharded=False) == 16000


def test_peak_rss_sees_an_allocation():
    rss = measure.PeakRSS()
    rss.start()
    # A fresh anonymous mapping, touched page by page: new resident memory
    # for sure (a tensor could reuse heap that earlier tests freed).
    size = 32 * 2 ** 20
    buf = mmap.mmap(-1, size)
    for off in range(0, size, 4096):
        buf[off] = 1
    if rss.method == "VmHWM":
        assert rss.growth_bytes() >= 16 * 2 ** 20
    buf.close()


# ---------------------------------------------------------------- fullshard bench
PSI = 1000
MODEL = ModelSpec(num_layers=1, embed_dim=4, num_heads=1, vocab_size=10, max_positions=3)  # Ψ_root = 40 + 12 + 8


def test_model_spec_psi_matches_the_built_model():
    from fullshard.models import GPT, num_params

    spec = ModelSpec(num_layers=3, embed_dim=16, num_heads=2, vocab_size=37, max_positions=9)
    with torch.device("meta"):
        assert spec.psi() == num_params(GPT(spec.gpt_config()))


def _vol(all_gather=0, reduce_scatter=0, all_reduce=0, all_to_all=0):
    return dict(all_gather=all_gather, reduce_scatter=reduce_scatter, all_reduce=all_reduce, all_to_all=all_to_all)


def test_analytic_volume_follows_zero_section_7():
    # ZeRO §7: DDP all-reduce 2Ψ, ZeRO-3 3Ψ (2Ψ all-gather + Ψ reduce-scatter); fp32 = 4 bytes.
    vol = lambda key, k=1: analytic_volume_bytes(MODES[key], PSI, k)  # noqa: E731
    assert vol("ddp") == _vol(all_reduce=8000)
    assert vol("no_shard") == vol("ddp")
    assert vol("grad_op") == _vol(all_gather=4000, reduce_scatter=4000)
    assert vol("full") == _vol(all_gather=8000, reduce_scatter=4000)
    assert vol("fsdp2") == vol("fsdp1") == vol("deepspeed") == vol("full")
    # bf16 all-gathers move 2 bytes per element, the fp32 reduce-scatter 4.
    assert vol("full_bf16") == vol("fsdp2_bf16") == _vol(all_gather=4000, reduce_scatter=4000)
    # world_size_invariant: one all-to-all of the reduce-scatter's input per backward instead.
    assert vol("full_invariant") == vol("fully_shard_invariant") == _vol(all_gather=8000, all_to_all=4000)
    assert vol("full_bf16_invariant") == _vol(all_gather=4000, all_to_all=4000)
    # K micro-batches per step: K x the all-gathers; the default reduces once, the invariant path K times.
    assert vol("full", 3) == _vol(all_gather=24000, reduce_scatter=4000)
    assert vol("grad_op", 3) == _vol(all_gather=12000, reduce_scatter=4000)
    assert vol("ddp", 3) == vol("ddp")
    assert vol("full_invariant", 3) == _vol(all_gather=24000, all_to_all=12000)
    labels = [analytic_label(MODES[k]) for k in ("full", "grad_op", "full_bf16", "full_invariant")]
    assert labels == ["3Ψ·4 B", "2Ψ·4 B", "2Ψ·2 B + Ψ·4 B", "3Ψ·4 B"]
    assert analytic_label(MODES["full_invariant"], 3) == "6Ψ·4 B + 3Ψ·4 B"
    assert analytic_label(MODES["full_bf16"], 2) == "4Ψ·2 B + Ψ·4 B"


def test_expected_volume_gathers_the_root_once_and_deepspeed_the_tied_weight_per_use():
    psi, root, tied = MODEL.psi(), 10 * 4 + 3 * 4 + 2 * 4, 10 * 4
    assert RP.expected_volume_bytes(MODES["full"], MODEL)["all_gather"] == (2 * psi - root) * 4
    assert RP.expected_volume_bytes(MODES["fsdp2_bf16"], MODEL)["all_gather"] == (2 * psi - root) * 2
    assert RP.expected_volume_bytes(MODES["deepspeed"], MODEL)["all_gather"] == 2 * (psi + tied) * 4
    for key in ("grad_op", "no_shard", "ddp"):
        assert RP.expected_volume_bytes(MODES[key], MODEL) == analytic_volume_bytes(MODES[key], psi)
    invariant = RP.expected_volume_bytes(MODES["full_invariant"], MODEL, update_freq=2)
    assert invariant == _vol(all_gather=2 * (2 * psi - root) * 4, all_to_all=2 * psi * 4)


def _rank(rank, step_s, losses, rss=100, ag=0, rs=0, ar=0, a2a=0, state=(10, 10, 20)):
    return dict(rank=rank, threads=1, psi=PSI, step_s=step_s, losses=losses, user_s=1.0, sys_s=0.5,
                rss_base_bytes=1000, rss_peak_bytes=1000 + rss, rss_method="VmHWM", notes=[],
                param_bytes=state[0], grad_bytes=state[1], optim_bytes=state[2],
                volume_bytes=_vol(ag, rs, ar, a2a), calls=_vol(2, 2, 0, 0), volume_source="counters")


def _rows():
    two = lambda **kw: [_rank(0, **kw), _rank(1, **kw)]  # noqa: E731
    losses = [[3.0, 2.0], [3.0, 2.5]]
    ddp = two(step_s=[0.1, 0.2, 0.3], losses=[3.0, 2.0], rss=200, ar=2 * 8000)
    ddp[1]["losses"] = losses[1]
    full = [_rank(0, step_s=[0.1, 0.1, 0.1], losses=[3.0, 2.0], rss=100, ag=2 * 8000, rs=2 * 4000),
            _rank(1, step_s=[0.3, 0.1, 0.4], losses=[3.0, 2.5], rss=150, ag=2 * 8000, rs=2 * 4000)]
    bf16 = two(step_s=[0.1] * 3, losses=[3.0, 2.01], rss=50)  # 0.5% off: inside the bf16 tolerance
    bf16[1]["losses"] = [3.0, 2.5]
    fsdp2 = two(step_s=[0.4] * 3, losses=[3.0, 2.0001], rss=300)  # 5e-5 off at step 2: fp32 mismatch
    fsdp2[1]["losses"] = [3.0, 2.5]
    fsdp2_bf16 = two(step_s=[0.2] * 3, losses=[3.0, 2.0], rss=100)
    fsdp2_bf16[1]["losses"] = [3.0, 2.5]
    rows = [RP.merge_ranks(MODES[k], res, MODEL, 2, 256) for k, res in
            (("full", full), ("full_bf16", bf16), ("ddp", ddp), ("fsdp2", fsdp2), ("fsdp2_bf16", fsdp2_bf16))]
    rows.append(RP.error_row(MODES["fsdp1"], "rank 1 failed: RuntimeError: boom"))
    return rows


def _config(**extra):
    cfg = dict(preset="quick", modes=[], world_size=2, threads=1, cpu_cores=2, batch_size=1, seq_len=128,
               warmup_steps=1, timed_steps=2, model=vars(MODEL), psi=PSI, torch_version="x",
               load_average_before=[1.0, 1.0, 1.0], load_average_after=[2.0, 1.0, 1.0], deepspeed_available=False)
    cfg.update(extra)
    return cfg


def test_merge_takes_max_of_rank_medians_and_peaks_and_per_step_volume():
    full = _rows()[0]
    assert full["step_ms"] == pytest.approx(300.0)  # rank 1's median of 0.3, 0.1, 0.4
    assert full["step_ms_per_rank"] == pytest.approx([100.0, 300.0])
    assert full["tokens_per_s"] == pytest.approx(256 / 0.3)
    assert full["rss_peak_growth_bytes"] == 150
    assert full["volume_bytes_per_step"] == _vol(all_gather=8000, reduce_scatter=4000)
    assert full["volume_ratio_analytic"] == pytest.approx(1.0)
    assert full["user_s_per_step"] == pytest.approx(0.5) and full["sys_s_per_step"] == pytest.approx(0.25)
    assert full["state_bytes"] == 40 and full["zero_state_bytes"] == 16 * PSI // 2


def test_ratios_and_loss_checks():
    report = RP.build_report(_config(), _rows())
    rows = {r["mode"]: r for r in report["modes"]}
    assert rows["ddp"]["step_ratio_ddp"] == 1.0
    assert rows["full"]["step_ratio_ddp"] == pytest.approx(300 / 200)
    assert rows["full"]["rss_ratio_ddp"] == pytest.approx(150 / 200)
    assert rows["full"]["loss_match"] and rows["full"]["loss_max_rel_diff"] == 0.0
    assert rows["full_bf16"]["loss_match"] and rows["full_bf16"]["loss_rtol"] == RP.BF16_LOSS_RTOL
    assert not rows["fsdp2"]["loss_match"] and rows["fsdp2"]["loss_first_bad_step"] == 2
    assert rows["fsdp2"]["loss_max_rel_diff"] == pytest.approx(5e-5)
    pairs = {p["mode"]: p for p in report["vs_fsdp2"]}
    assert pairs["fullshard FULL_SHARD"]["step_ratio"] == pytest.approx(300 / 400)
    assert pairs["fullshard FULL_SHARD bf16"]["rss_ratio"] == pytest.approx(50 / 100)


def test_fully_shard_rows_get_ratios_to_the_wrapper_and_to_torch_fsdp2():
    """fullshard's fully_shard modes: a table of ratios to the same configuration through the
    FullyShardedDataParallel wrapper, and rows in the torch FSDP2 table."""
    rows = _rows()
    fs = [_rank(0, step_s=[0.15] * 3, losses=[3.0, 2.0], rss=120), _rank(1, step_s=[0.15] * 3, losses=[3.0, 2.5])]
    rows.insert(2, RP.merge_ranks(MODES["fully_shard"], fs, MODEL, 2, 256))
    report = RP.build_report(_config(), rows)
    assert [(p["mode"], p["vs"]) for p in report["vs_wrapper"]] == [("fullshard fully_shard", "fullshard FULL_SHARD")]
    assert report["vs_wrapper"][0]["step_ratio"] == pytest.approx(150 / 300)
    assert report["vs_wrapper"][0]["rss_ratio"] == pytest.approx(120 / 150)
    fsdp2 = {p["mode"]: p for p in report["vs_fsdp2"]}
    assert fsdp2["fullshard fully_shard"]["step_ratio"] == pytest.approx(150 / 400)
    assert {r["mode"]: r for r in report["modes"]}["fully_shard"]["loss_match"]
    text = RP.markdown(report)
    assert "| ratio to the FullyShardedDataParallel wrapper | step time | RSS peak | params+grads+optim |" in text
    assert "| fullshard fully_shard / fullshard FULL_SHARD | 0.50 | 0.80 | 1.000 |" in text
    assert "| fullshard fully_shard / torch FSDP2 | 0.38 |" in text
    assert "ratio to the FullyShardedDataParallel wrapper" not in RP.markdown(RP.build_report(_config(), _rows()))


def test_invariant_rows_get_ratios_to_the_default_path():
    """world_size_invariant modes: a table of step time, RSS, state and bytes-moved ratios to the
    same mode without it, in the report and the JSON."""
    rows = _rows()
    inv = [_rank(r, step_s=[0.36] * 3, losses=[3.0, [2.0, 2.5][r]], rss=180, ag=2 * 8000, a2a=2 * 6000)
           for r in range(2)]
    rows.insert(1, RP.merge_ranks(MODES["full_invariant"], inv, MODEL, 2, 256, update_freq=1))
    report = RP.build_report(_config(update_freq=1), rows)
    (pair,) = report["vs_default"]
    assert (pair["mode"], pair["vs"]) == ("fullshard FULL_SHARD invariant", "fullshard FULL_SHARD")
    assert pair["step_ratio"] == pytest.approx(360 / 300) and pair["rss_ratio"] == pytest.approx(180 / 150)
    assert pair["volume_ratio"] == pytest.approx((8000 + 6000) / (8000 + 4000)) and pair["state_ratio"] == 1.0
    row = {r["mode"]: r for r in report["modes"]}["full_invariant"]
    assert row["volume_bytes_per_step"]["all_to_all"] == 6000 and row["loss_match"]
    text = RP.markdown(report)
    assert ("| world_size_invariant=True / default | step time | RSS peak | params+grads+optim | bytes moved |"
            in text)
    assert "| fullshard FULL_SHARD invariant / fullshard FULL_SHARD | 1.20 | 1.20 | 1.000 | 1.167 |" in text
    assert "| A2A MiB/step |" in text and "all-to-alls each micro-batch" not in text
    accumulated = RP.markdown(RP.build_report(_config(update_freq=4), rows))
    assert "tokens per rank, 4 micro-batches per step (gradients accumulated under no_sync); AdamW" in accumulated
    assert "all-to-alls each micro-batch" in accumulated
    assert "world_size_invariant=True / default" not in RP.markdown(RP.build_report(_config(), _rows()))
    assert json.loads(json.dumps(report))["vs_default"][0]["volume_ratio"] == pytest.approx(14 / 12)


def test_markdown_table_errors_and_notes():
    text = RP.markdown(RP.build_report(_config(), _rows()))
    lines = text.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("| mode |"))
    widths = {line.count(" | ") for line in lines[header:header + 8]}
    assert len(widths) == 1  # every row has as many cells as the header, the error row too
    assert "| torch FSDP1 FULL_SHARD | ERROR: rank 1 failed: RuntimeError: boom |" in text
    assert "| fullshard FULL_SHARD | 300.0 | 1.50 |" in text
    assert "MISMATCH (5.0e-05 > 1e-05 from step 2)" in text
    assert "bf16 match" in text and "| reference |" in text
    assert "| fullshard FULL_SHARD / torch FSDP2 | 0.75 |" in text
    assert RP.DEEPSPEED_MISSING in text
    assert RP.DEEPSPEED_MISSING not in RP.markdown(RP.build_report(_config(deepspeed_available=True), _rows()))
    assert text.startswith("`fullshard bench` — preset `quick`: GPT")
    overridden = RP.markdown(RP.build_report(_config(overrides=["--arch", "--vocab-size"]), _rows()))
    assert overridden.startswith("`fullshard bench` — preset `quick with --arch, --vocab-size`: GPT")


def test_files_are_written_atomically(tmp_path):
    report = RP.build_report(_config(), _rows())
    paths = RP.write_files(report, str(tmp_path / "out"))
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["bench.json", "bench.md", "bench.png"]
    data = json.loads(open(paths["json"]).read())
    assert data["config"]["psi"] == PSI and len(data["modes"]) == 6
    assert data["modes"][0]["ranks"][1]["step_s"] == [0.3, 0.1, 0.4]
    assert open(paths["png"], "rb").read(8) == b"\x89PNG\r\n\x1a\n"
    assert open(paths["md"]).read() == RP.markdown(report)


def _bench_args(*argv):
    p = argparse.ArgumentParser()
    suite.add_args(p)
    return p.parse_args(list(argv))


class _Fail(Exception):
    pass


def _fail(msg):
    raise _Fail(msg)


@pytest.mark.parametrize("argv, message", [
    (["--modes", "full,nope"], "unknown mode nope"),
    (["--modes", "full,full"], "more than once"),
    (["--world-size", "0"], "--world-size must be >= 1"),
    (["--timed-steps", "0"], "--timed-steps must be >= 1"),
    (["--warmup-steps", "-1"], "--warmup-steps must be >= 0"),
    (["--width", "30", "--heads", "4"], "must divide"),
    (["--arch", "gpt5"], "unknown --arch"),
    (["--update-freq", "0"], "--update-freq must be >= 1"),
    (["--optimizer", "muon", "--modes", "full,fsdp2,fsdp1"],
     r"--optimizer muon runs on the fullshard modes and ddp only .* drop fsdp2,fsdp1 from --modes"),
])
def test_bad_input_fails(argv, message):
    with pytest.raises(_Fail, match=message):
        suite.validate(_bench_args(*argv), _fail)


def test_presets_and_overrides(monkeypatch):
    monkeypatch.setattr(suite, "deepspeed_available", lambda: False)
    plan = suite.validate(_bench_args(), _fail)
    assert "deepspeed" not in plan.modes and plan.modes[0] == "full" and len(plan.modes) == len(MODES) - 3
    assert not {"pp2", "pp2_unsharded"} & set(plan.modes)  # only when named
    assert (plan.job.model.num_layers, plan.job.model.embed_dim, plan.job.world_size) == (4, 128, 2)
    with pytest.raises(_Fail, match="not installed"):
        suite.validate(_bench_args("--modes", "deepspeed"), _fail)
    monkeypatch.setattr(suite, "deepspeed_available", lambda: True)
    assert suite.validate(_bench_args(), _fail).modes[-1] == "deepspeed"
    with pytest.raises(_Fail, match="--update-freq > 1 is not supported with the deepspeed mode"):
        suite.validate(_bench_args("--update-freq", "2"), _fail)  # the default list has it
    small = suite.validate(_bench_args("--preset", "gpt2-small", "--layers", "2", "--seq-len", "64"), _fail)
    assert (small.job.model.num_layers, small.job.model.embed_dim, small.job.model.max_positions) == (2, 768, 1024)
    assert small.job.model.vocab_size == 50257 and small.job.seq_len == 64
    # the report's header names the flags that changed the preset
    assert suite.validate(_bench_args(), _fail).overrides == () and small.overrides == ("--seq-len", "--layers")
    assert RP.preset_label("gpt2-small", small.overrides) == "gpt2-small with --seq-len, --layers"
    monkeypatch.setattr(suite, "deepspeed_available", lambda: False)
    acc = suite.validate(_bench_args("--modes", "full,full_invariant", "--update-freq", "3"), _fail)
    assert acc.job.update_freq == 3 and acc.overrides == ("--update-freq",)
    assert plan.job.update_freq == 1 and {"full_invariant", "full_bf16_invariant"} <= set(plan.modes)


def test_optimizer_choice_keeps_the_modes_it_can_run_on(monkeypatch):
    """--optimizer muon/adafactor/lamb: the default modes are fullshard's and ddp (fullshard.optim cannot
    see torch FSDP's or DeepSpeed's shards); the job and the report's header carry the optimizer."""
    monkeypatch.setattr(suite, "deepspeed_available", lambda: True)
    for name, label in (("muon", "Muon + AdamW"), ("adafactor", "Adafactor"), ("lamb", "LAMB")):
        plan = suite.validate(_bench_args("--optimizer", name), _fail)
        assert plan.job.optimizer == name and plan.overrides == ("--optimizer",)
        assert "ddp" in plan.modes and "full" in plan.modes
        assert {MODES[m].family for m in plan.modes} == {"fullshard", "ddp"}
        assert suite._config(plan, (0, 0, 0), (0, 0, 0), {})["optimizer"] == label
    assert suite.validate(_bench_args(), _fail).job.optimizer == "adam"


def test_batches_are_grouped_into_micro_batches_per_step():
    from fullshard.bench.rank import make_batches

    job = suite.validate(_bench_args("--modes", "full", "--warmup-steps", "1", "--timed-steps", "2",
                                     "--batch-size", "1", "--seq-len", "4", "--vocab-size", "50"), _fail).job
    one = make_batches(job, 0)
    three = make_batches(dataclasses.replace(job, update_freq=3), 0)
    assert [len(step) for step in one] == [1] * 3 and [len(step) for step in three] == [3] * 3
    x, y = three[2][1]
    assert x.shape == y.shape == (1, 4) and torch.equal(x[:, 1:], y[:, :-1])  # targets = inputs shifted by one
    assert torch.equal(one[0][0][0], three[0][0][0])  # the same seed draws the first micro-batch alike
    assert not torch.equal(three[0][0][0], three[0][1][0])


def test_a_failed_fullshard_mode_is_an_error_row_and_exit_1(monkeypatch, tmp_path):
    from fullshard.train.launcher import RankFailed

    def fake_launch(job):
        if job.mode == "full":
            raise RankFailed("rank 0 failed: RuntimeError: injected")
        return [_rank(r, step_s=[0.1], losses=[3.0], ar=16000) for r in range(job.world_size)]

    monkeypatch.setattr(suite, "launch_mode", fake_launch)
    plan = suite.validate(_bench_args("--modes", "full,ddp", "--out-dir", str(tmp_path / "o")), _fail)
    assert suite.run(plan) == 1
    data = json.loads((tmp_path / "o" / "bench.json").read_text())
    assert data["modes"][0]["error"] == "rank 0 failed: RuntimeError: injected"
    assert "ERROR: rank 0 failed" in (tmp_path / "o" / "bench.md").read_text()
    monkeypatch.setattr(suite, "launch_mode", lambda job: [_rank(0, step_s=[0.1], losses=[3.0])])
    assert suite.run(suite.validate(_bench_args("--modes", "ddp", "--out-dir", str(tmp_path / "o")), _fail)) == 0


def test_patched_collectives_count_volume_once_per_outer_call():
    from fullshard.bench.rank import PatchedCollectives

    pc = PatchedCollectives()

    def reduce_scatter_single(output, input, op=None, group=None, async_op=False):
        return None

    def reduce_scatter_tensor(output, input, op=None, group=None, async_op=False):
        return inner(output, input)  # forwards, as torch's deprecated alias does

    inner = pc._wrap("reduce_scatter_single", reduce_scatter_single)
    outer = pc._wrap("reduce_scatter_tensor", reduce_scatter_tensor)
    outer(torch.empty(2), torch.empty(4))
    gather = pc._wrap("all_gather_single", lambda output_tensor, input_tensor, group=None, async_op=False: None)
    gather(output_tensor=torch.empty(6, dtype=torch.bfloat16), input_tensor=torch.empty(3, dtype=torch.bfloat16))
    reduce = pc._wrap("all_reduce", lambda tensor, op=None, group=None, async_op=False: None)
    reduce(torch.empty(5))
    assert pc.bytes == _vol(all_gather=12, reduce_scatter=16, all_reduce=40)
    assert pc.calls == _vol(all_gather=1, reduce_scatter=1, all_reduce=1)

def test_memory_report_ratios_errors_and_footnote():
    from fullshard.bench import memory

    args = memory.parse_args(["--configs", "fp32,bf16,cpu_offload", "--seq-len", "8", "--vocab-size", "10"])
    cfg = memory.run_config(args)

    def row(name, peak, loss=2.0):
        return dict(config=name, psi=100, peak_bytes=peak, warm_loss=3.0, loss=loss, step_s=0.1, param_bytes=200,
                    grad_bytes=200, optim_bytes=408, where="params cpu float32; grads cpu float32; optim cpu float32")

    results = [{"rank": 0, "rows": [row("fp32", 1000), row("bf16", 500), {"config": "cpu_offload", "error": "boom"}]},
               {"rank": 1, "rows": [row("fp32", 800, 4.0), row("bf16", 600, 4.0),
                                    {"config": "cpu_offload", "error": "another rank failed"}]}]
    text = "\n".join(memory.format_report(results, cfg))
    assert "0.600" in text  # bf16 max peak 600 / fp32 max peak 1000
    assert "ERROR rank 0: boom" in text
    assert "3.000000" in text  # loss averaged over ranks
    assert "host memory IS device memory" in text


def test_memory_rejects_odd_batch_for_micro_batches():
    import pytest

    from fullshard.bench import memory

    with pytest.raises(SystemExit):
        memory.parse_args(["--batch-size", "3"])


# ---------------------------------------------------------------- pipeline modes (pp2, pp2_unsharded)
def test_pipeline_modes_run_only_when_named_on_an_even_world_with_adamw():
    plan = suite.validate(_bench_args("--world-size", "4", "--modes", "ddp,fully_shard,pp2,pp2_unsharded"), _fail)
    assert plan.modes == ("ddp", "fully_shard", "pp2", "pp2_unsharded") and plan.job.world_size == 4
    for argv, message in ((("--world-size", "3", "--modes", "pp2"), "needs a --world-size divisible by 2"),
                          (("--world-size", "4", "--layers", "1", "--modes", "fully_shard,pp2_unsharded"),
                           "at least 2 layers, got --world-size 4 and 1 layers"),
                          (("--optimizer", "lamb", "--modes", "full,pp2"), "drop pp2 from --modes")):
        with pytest.raises(_Fail, match=message):
            suite.validate(_bench_args(*argv), _fail)
    assert not {"pp2", "pp2_unsharded"} & set(suite.validate(_bench_args("--optimizer", "lamb"), _fail).modes)


def test_pipeline_batches_are_the_columns_data_parallel_ranks_sequences():
    """Pipeline column c (ranks c and c + N/2) trains on data-parallel ranks 2c and 2c + 1's sequences:
    every step's global batch is the data-parallel modes'."""
    from fullshard.bench import pipeline
    from fullshard.bench.rank import make_batches

    job = dataclasses.replace(suite.validate(_bench_args(
        "--world-size", "4", "--modes", "pp2", "--warmup-steps", "1", "--timed-steps", "1", "--batch-size", "2",
        "--seq-len", "4", "--vocab-size", "50", "--update-freq", "2"), _fail).job, mode="pp2")
    assert pipeline.data_parallel_size(job, MODES["pp2"]) == 2 and pipeline.data_parallel_size(job, MODES["full"]) == 4
    cfg = pipeline.config(job, MODES["pp2_unsharded"])
    assert (cfg.batch_size, cfg.pipeline_microbatches, cfg.pipeline_parallel_size) == (4, 4, 2)
    assert cfg.pipeline_grad_accumulation == "unsharded" and cfg.arch_spec().num_layers == job.model.num_layers
    plain = [make_batches(job, r) for r in range(4)]
    for rank in range(4):
        column = rank % 2
        piped = pipeline.make_batches(job, rank, make_batches)
        assert [len(step) for step in piped] == [2, 2]
        for s, step in enumerate(piped):
            for j, (x, y) in enumerate(step):
                assert x.shape == (4, 4)
                assert torch.equal(x, torch.cat([plain[2 * column][s][j][0], plain[2 * column + 1][s][j][0]]))
                assert torch.equal(y, torch.cat([plain[2 * column][s][j][1], plain[2 * column + 1][s][j][1]]))


def test_pipeline_rows_compare_the_global_loss_and_get_a_per_rank_table():
    """A pipeline row: its (global) loss against the mean over ranks of DDP's, no ZeRO volume, a
    ratio row to fully_shard over every rank, and each rank's time, RSS peak and model state."""
    rows = _rows()  # ddp's losses per rank: [3.0, 2.0] and [3.0, 2.5]: means 3.0, 2.25
    fs = [_rank(r, step_s=[0.2] * 3, losses=[3.0, [2.0, 2.5][r]], rss=100) for r in range(2)]
    pp = [_rank(0, step_s=[0.1] * 3, losses=[3.0, 2.25], rss=50, state=(30, 30, 60)),
          _rank(1, step_s=[0.3] * 3, losses=[3.0, 2.25], rss=300)]
    bad = [dict(r, losses=[3.0, 2.0]) for r in pp]  # rank 0's loss, not the global mean
    rows += [RP.merge_ranks(MODES["fully_shard"], fs, MODEL, 2, 256), RP.merge_ranks(MODES["pp2"], pp, MODEL, 2, 256),
             RP.merge_ranks(MODES["pp2_unsharded"], bad, MODEL, 2, 256)]
    report = RP.build_report(_config(), rows)
    by = {r["mode"]: r for r in report["modes"]}
    assert by["pp2"]["loss_match"] and by["pp2"]["loss_max_rel_diff"] == 0.0
    assert not by["pp2_unsharded"]["loss_match"] and by["pp2_unsharded"]["loss_first_bad_step"] == 2
    assert "analytic_volume_bytes" not in by["pp2"] and by["pp2"]["pipeline"] == "reduce_scatter"
    pair = report["vs_data_parallel"][0]
    assert (pair["mode"], pair["vs"]) == ("fullshard fully_shard pp=2 1F1B", "fullshard fully_shard")
    assert pair["step_ratio"] == pytest.approx(300 / 200) and pair["rss_ratio"] == pytest.approx(300 / 100)
    text = RP.markdown(report)
    assert "| pp=2 x dp=1 / dp=2 | step time | RSS peak | params+grads+optim | bytes moved |" in text
    assert "| per rank: step ms / RSS peak MiB / params+grads+optim MiB | rank 0 | rank 1 |" in text
    assert "| fullshard fully_shard pp=2 1F1B | 100.0 / 0.0 / 0.0 | 300.0 / 0.0 / 0.0 |" in text
    per_rank = text.split("| per rank:")[1].split("\n\n")[0]
    assert "| torch DDP | 200.0 / 0.0 / 0.0 |" in per_rank and "| fullshard FULL_SHARD |" not in per_rank
    assert "pp=2 rows: pp=2 x dp=1" in text
    assert "| per rank:" not in RP.markdown(RP.build_report(_config(), _rows()))
