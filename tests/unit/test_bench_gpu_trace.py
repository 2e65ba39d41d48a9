"""The GPU bench's overlap analysis (fullshard.bench.gpu_trace) on synthetic kernel intervals, and its
trace reader, without a GPU."""
import json

import pytest
import torch

from fullshard.bench import gpu_trace
from fullshard.bench.gpu_trace import Kernel


def test_hidden_time_counts_compute_on_other_streams_only_once():
    kernels = [
        Kernel(0, 10, 7, "all_gather"),
        Kernel(2, 6, 0, "compute"),
        Kernel(4, 8, 0, "compute"),        # overlaps the previous compute: [2, 8] counted once
        Kernel(0, 10, 7, "compute"),       # on the all-gather's own stream: hides nothing
        Kernel(20, 30, 9, "reduce_scatter"),
        Kernel(25, 40, 0, "compute"),      # covers its last half
        Kernel(50, 54, 9, "reduce_scatter"),  # nothing beside it
    ]
    got = gpu_trace.hidden_time(kernels)
    assert got["all_gather"] == {"total_us": 10.0, "hidden_us": 6.0, "hidden_fraction": 0.6}
    assert got["reduce_scatter"] == {"total_us": 14.0, "hidden_us": 5.0, "hidden_fraction": pytest.approx(5 / 14)}
    assert "all_reduce" not in got
    assert gpu_trace.hidden_time([Kernel(0, 0, 1, "all_gather")])["all_gather"]["hidden_fraction"] == 0.0


def test_kernel_names_and_trace_events(tmp_path):
    assert gpu_trace.kind_of("ncclDevKernel_AllGather_RING_LL") == "all_gather"
    assert gpu_trace.kind_of("ncclKernel_ReduceScatter_RING_LL_Sum_float") == "reduce_scatter"
    assert gpu_trace.kind_of("ncclDevKernel_AllReduce_Sum_f32_RING_LL") == "all_reduce"
    assert gpu_trace.kind_of("ampere_bf16_s16816gemm_bf16_128x128") == "compute"
    assert gpu_trace.kind_of("ncclDevKernel_SendRecv") == "compute"
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"traceEvents": [
        {"cat": "kernel", "name": "ncclDevKernel_AllGather_RING_LL", "ts": 100, "dur": 50, "args": {"stream": 21}},
        {"cat": "kernel", "name": "gemm", "ts": 120, "dur": 100, "args": {"stream": 7}},
        {"cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 500},
    ]}))
    kernels = gpu_trace.kernels_of_trace(str(path))
    assert kernels == [Kernel(100.0, 150.0, 21, "all_gather"), Kernel(120.0, 220.0, 7, "compute")]
    assert gpu_trace.hidden_time(kernels)["all_gather"]["hidden_fraction"] == pytest.approx(0.6)


def test_side_stream_copies_are_told_from_compute_by_stream():
    """A non-NCCL kernel off the stream with the most compute time is a side-stream copy, and its hidden
    part is the time a compute kernel ran beside it (what overlap hides at world size 1)."""
    kernels = gpu_trace.side_copies([
        Kernel(0, 10, 7, "compute"), Kernel(10, 30, 7, "compute"),
        Kernel(5, 15, 14, "compute"),      # the copy-in stream's cast, beside compute throughout
        Kernel(40, 44, 14, "compute"),     # alone
        Kernel(0, 8, 21, "all_gather"),
    ])
    assert [k.kind for k in kernels] == ["compute", "compute", "side_copy", "side_copy", "all_gather"]
    got = gpu_trace.hidden_time(kernels)
    assert got["side_copy"] == {"total_us": 14.0, "hidden_us": 10.0, "hidden_fraction": pytest.approx(10 / 14)}
    assert got["all_gather"]["hidden_us"] == 8.0  # the side-stream copy is not compute
    assert gpu_trace.side_copies([]) == []


@pytest.mark.skipif(not torch.cuda.is_available(), reason="counts CUDA host syncs")
def test_host_sync_count_sees_an_item():
    x = torch.ones(4, device="cuda")
    assert len(gpu_trace.host_sync_sites(lambda: x.sum().item())) >= 1
    assert len(gpu_trace.host_sync_sites(lambda: x.add_(1))) == 0

    def reads():
        return x.sum().item()
    sites = gpu_trace.host_sync_sites(reads)
    assert sites and sites[0].startswith("test_bench_gpu_trace.py:"), sites  # the innermost frame: reads()


def test_host_sync_sites_name_the_frames_of_each_warned_sync(monkeypatch):
    """The recording itself, on any machine: a warning of the sync-debug kind (emitted here by hand,
    as torch emits one for each synchronizing CUDA call) is kept with its innermost Python frames;
    other warnings are not counted."""
    import warnings

    modes = []
    monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", modes.append)

    def sync_here():
        warnings.warn("called a synchronizing CUDA operation", stacklevel=1)
        warnings.warn("something else", stacklevel=1)
        # what enabling the mode emits once (torch 2.11): not a sync, and counted as one per step before
        warnings.warn("Synchronization debug mode is a prototype feature and does not yet detect all "
                      "synchronizing operations", stacklevel=1)

    sites = gpu_trace.host_sync_sites(sync_here, frames=2)
    assert modes == ["warn", "default"] and len(sites) == 1, (modes, sites)
    line = sync_here.__code__.co_firstlineno + 1
    assert sites[0].startswith(f"test_bench_gpu_trace.py:{line} < gpu_trace.py:"), sites
    assert sites[0].endswith(": called a synchronizing CUDA operation"), sites
