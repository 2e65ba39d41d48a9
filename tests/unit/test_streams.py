"""core/streams.py on the CPU: no side streams, every helper a no-op, the
switch read from ``FULLSHARD_STREAMS``, and the buffer pool and the
side-stream collectives keep today's single-stream behaviour (no events)."""
import contextlib

import pytest
import torch

from fullshard.core import buffers as B, overlap, streams

CPU = torch.device("cpu")


@pytest.fixture(autouse=True)
def _unforced():
    streams.set_enabled(None)
    yield
    streams.set_enabled(None)


def test_helpers_are_no_ops_without_side_streams():
    streams.set_enabled(True)  # on, yet the CPU has no streams
    assert streams.side(CPU) is None and streams.current(CPU) is None
    assert isinstance(streams.on(None), contextlib.nullcontext)
    with streams.on(None):
        pass
    assert streams.record(None) is None
    assert streams.wait(None) is None and streams.wait(None, None) is None
    work = overlap.SideWork(None, CPU, (torch.ones(2),))
    assert work.wait() and work.is_completed()


def test_switch_reads_the_environment_unless_forced(monkeypatch):
    monkeypatch.delenv(streams.ENV, raising=False)
    assert streams.enabled()  # on by default (the CUDA tests passed on a GPU)
    for off in ("0", "off", "false", "OFF"):
        monkeypatch.setenv(streams.ENV, off)
        assert not streams.enabled()
        # Disabled: no CUDA call is made, so this holds on a machine without a GPU too.
        assert streams.side(torch.device("cuda", 0)) is None
    monkeypatch.setenv(streams.ENV, "1")
    assert streams.enabled()
    streams.set_enabled(False)
    assert not streams.enabled()
    streams.set_enabled(None)
    assert streams.enabled()  # FULLSHARD_STREAMS=1 still set


def test_pool_makes_no_events_on_the_cpu():
    pool = B.BufferPool()
    a = pool.take(1 << 18, torch.float32, CPU)
    pool.give(a)
    (entry,) = [e for stack in pool._free.values() for e in stack]
    assert entry[1] is None and entry[2] is None and not pool._home
    b = pool.take(1 << 18, torch.float32, CPU)
    assert b.untyped_storage().data_ptr() == a.untyped_storage().data_ptr()
    pool.give(b)
    pool.clear()
    assert pool.cached_bytes == 0 and not pool._free


def test_collectives_without_side_streams_are_todays(monkeypatch):
    """No side streams: the work handle of the one asynchronous collective, issued as before; a cast shard
    is written into this rank's block of the output and gathered in place."""
    calls = []

    def fake(name):
        def run(out, inp, group, async_op, tag):
            offset = inp.data_ptr() - out.data_ptr() if name == "all_gather" else None  # bytes into out
            calls.append((name, async_op, tag, inp.dtype, offset))
            if name == "reduce_scatter":
                out.copy_(inp)
            return "handle"
        return run
    monkeypatch.setattr(overlap.collectives, "group_rank", lambda group: 1)  # block 1 of 2
    monkeypatch.setattr(overlap.collectives, "all_gather", fake("all_gather"))
    monkeypatch.setattr(overlap.collectives, "reduce_scatter", fake("reduce_scatter"))
    out = torch.zeros(8, dtype=torch.bfloat16)
    assert overlap.all_gather(out, torch.arange(4.0), None, "t", (CPU, torch.bfloat16)) == "handle"
    assert torch.equal(out[4:], torch.arange(4.0).bfloat16()) and not out[:4].any()
    assert overlap.reduce_scatter(torch.empty(4), torch.ones(4), None, "t", replicas="rep") == ("handle", False)
    assert calls == [("all_gather", True, "t", torch.bfloat16, 4 * 2),
                     ("reduce_scatter", True, "t", torch.float32, None)]
