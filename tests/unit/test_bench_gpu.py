"""The GPU benchmark's table and command line (fullshard.bench.gpu), without a GPU or ranks."""
import dataclasses
import json

import pytest
import torch

from fullshard.bench import gpu

ENV = dict(torch="2.x", cuda="13.0", gpu="H100", command="python -m fullshard.bench.gpu --out-dir d")


def _res(step_ms, max_gib, where="cuda"):
    return dict(step_ms=step_ms, max_allocated=max_gib * gpu.GIB, after_wrap=1.0 * gpu.GIB,
                losses=[11.0, 10.5], params_on=where)


def _row(table: str, label: str) -> list[str]:
    line = next(line for line in table.splitlines() if line.startswith(f"| {label} |"))
    return [cell.strip() for cell in line.strip("|").split("|")]


def test_table_ratios_divide_by_the_matching_baseline():
    results = {"fully_shard": _res(110.0, 30.0), "fsdp2": _res(100.0, 40.0), "ddp": _res(88.0, 60.0),
               "fully_shard_offload": _res(900.0, 6.0, "cpu (pinned)"), "fsdp2_offload": _res(1200.0, 8.0)}
    job = gpu.GpuJob(batch_size=4, seq_len=1000)
    table = gpu.format_table(results, job, ENV)
    ours = _row(table, "fullshard fully_shard")
    assert ours[2:] == ["110.0", "36,364", "30.00", "1.00", "1.10", "1.25", "0.75", "0.50", "—", "—", "—", "—",
                        "11.0000 → 10.5000"]
    measured = dict(_res(110.0, 30.0), host_syncs=0, comm_hidden={
        "all_gather": {"total_us": 10.0, "hidden_us": 8.0, "hidden_fraction": 0.8},
        "reduce_scatter": {"total_us": 4.0, "hidden_us": 1.0, "hidden_fraction": 0.25},
        "side_copy": {"total_us": 2.0, "hidden_us": 1.8, "hidden_fraction": 0.9}})
    row = _row(gpu.format_table({"fully_shard": measured}, job, ENV), "fullshard fully_shard")
    assert row[10:14] == ["0", "80%", "25%", "90%"]
    offload = _row(table, "fullshard fully_shard, CPU offload")
    # Offloaded rows divide by torch FSDP2's offloaded row, and have no DDP ratio.
    assert offload[1] == "cpu (pinned)"
    assert offload[6:10] == ["0.75", "—", "0.75", "—"]
    assert "torch 2.x, CUDA 13.0, H100" in table and "`python -m fullshard.bench.gpu --out-dir d`" in table


def test_table_shows_a_failed_mode_and_leaves_its_ratios_out():
    results = {"fully_shard": _res(110.0, 30.0), "fsdp2": {"error": "CUDA out of memory"}}
    table = gpu.format_table(results, gpu.GpuJob(), ENV)
    assert _row(table, "torch FSDP2")[1] == "ERROR: CUDA out of memory"
    assert _row(table, "fullshard fully_shard")[6:10] == ["—", "—", "—", "—"]


def test_command_line_refuses_unknown_modes_and_a_missing_gpu(capsys):
    with pytest.raises(SystemExit) as e:
        gpu.main(["--out-dir", "d", "--modes", "fully_shard,zero3", "--device", "cpu"])
    assert e.value.code == 2 and "unknown modes ['zero3']" in capsys.readouterr().err
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit) as e:
            gpu.main(["--out-dir", "d"])
        assert e.value.code == 2 and "no CUDA GPU here" in capsys.readouterr().err


def test_build_gpt_is_deterministic_and_gpt2_scaled():
    job = gpu.GpuJob(num_layers=1, embed_dim=32, num_heads=2, vocab_size=50, seq_len=8, device="cpu")
    a, b = (gpu.build_gpt(job, torch.device("cpu")) for _ in range(2))
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(p, q), name
    assert a.output_projection.weight is a.embed_tokens.weight
    assert 0.015 < float(a.layers[0].mlp.fc1.weight.detach().std()) < 0.025
    assert torch.equal(a.layer_norm.weight, torch.ones(32)) and torch.equal(a.layer_norm.bias, torch.zeros(32))


def test_from_json_renders_labelled_runs_against_their_own_baselines(tmp_path, capsys):
    job = gpu.GpuJob(batch_size=4, seq_len=1000)

    def dump(name, results, run_job=job):
        path = tmp_path / name
        path.write_text(json.dumps(dict(job=dataclasses.asdict(run_job), env=ENV, results=results)))
        return str(path)
    # Sites as a run recorded them; the count is taken again from them (runs before the message check
    # counted the one-time "prototype" warning of enabling the sync debug mode as a sync).
    prototype = "gpu_trace.py:124: Synchronization debug mode is a prototype feature and does not yet detect all"
    sync = "gpu.py:9: called a synchronizing CUDA operation"
    now = dump("now.json", {"fully_shard": dict(_res(110.0, 30.0), host_syncs=1, host_sync_sites=[prototype]),
                            "fsdp2": dict(_res(100.0, 40.0), host_syncs=2, host_sync_sites=[prototype, sync])})
    old = dump("old.json", {"fully_shard": _res(150.0, 40.0)})
    other = dump("other.json", {"fully_shard": _res(90.0, 30.0), "fsdp2": _res(60.0, 40.0)})
    out = tmp_path / "out"
    assert gpu.main(["--out-dir", str(out), "--from-json", now, f"before={old}", f"elsewhere={other}"]) == 0
    table = (out / "gpu.md").read_text()
    assert _row(table, "fullshard fully_shard")[6] == "1.10"
    assert _row(table, "fullshard fully_shard")[10] == "0" and _row(table, "torch FSDP2")[10] == "1"
    assert _row(table, "before: fullshard fully_shard")[6] == "1.50"  # no torch row of its own: the first run's
    assert _row(table, "elsewhere: fullshard fully_shard")[6] == "1.50"  # its own torch row (60 ms)
    assert "Rows from: `python -m fullshard.bench.gpu --out-dir d` (H100); before: `" in table
    assert json.loads((out / "gpu.json").read_text())["results"]["before/fully_shard"]["step_ms"] == 150.0
    longer = dump("longer.json", {"fully_shard": _res(1.0, 1.0)}, dataclasses.replace(job, timed_steps=3))
    for bad, says in ((longer, "ran another job"), (str(tmp_path / "missing.json"), "cannot read")):
        with pytest.raises(SystemExit) as e:
            gpu.main(["--out-dir", str(out), "--from-json", now, bad])
        assert e.value.code == 2 and says in capsys.readouterr().err
