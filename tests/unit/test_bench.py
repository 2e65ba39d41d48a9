"""Fast single-process checks of the benchmark's measurements and table (no ranks launched)."""
import mmap

import torch

from fullshard.bench import compare, measure


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


def _row(backend, total_scale, loss, **extra):
    return dict(backend=backend, psi=1000, step_ms=10.0, first_loss=loss, last_loss=loss, param_bytes=4000 // total_scale,
                grad_bytes=4000 // total_scale, optim_bytes=8000 // total_scale, rss_growth_bytes=2 ** 20,
                rss_method="VmHWM", **extra)


def test_merge_and_table_report_errors_and_ratios():
    args = compare.parse_args(["--world-sizes", "1,2", "--backends", "full,ddp,torch_fsdp"])
    assert args.world_sizes == [1, 2]
    cfg = compare.bench_config(args)
    ours = _row("fullshard FULL_SHARD", 2, 10.0, ag_bytes_per_step=1.0, rs_bytes_per_step=2.0,
                ag_calls_per_step=1, rs_calls_per_step=1)
    results = [
        {"rank": 0, "rows": [ours, _row("torch DDP", 1, 10.0), {"backend": "torch FSDP1 FULL_SHARD", "error": "boom"}]},
        {"rank": 1, "rows": [dict(ours, last_loss=12.0), _row("torch DDP", 1, 12.0),
                             {"backend": "torch FSDP1 FULL_SHARD", "error": "another rank failed"}]},
    ]
    rows = compare.merge_rows(results)
    assert rows[0]["last_loss"] == 11.0
    assert rows[2]["error"] == "rank 0: boom"
    text = "\n".join(compare.format_table(rows, 2, cfg) + compare.format_details(rows, 2))
    assert "0.500" in text and "ERROR rank 0: boom" in text
    assert "measured/ZeRO = 1.0000" in text


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
