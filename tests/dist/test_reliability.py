"""No hangs, library side: a collective past its group's timeout and ranks that issue
different collectives (debug mode) fail fast with one line naming the rank, the unit and
the other ranks. Real gloo processes."""
from __future__ import annotations

import time

import torch
import torch.nn as nn

from tests.dist.harness import run_ranks


class TwoBlocks(nn.Module):
    """Two same-shape blocks; ``skip_rank`` runs only the second (rank-dependent control flow)."""

    def __init__(self, skip_rank: int):
        super().__init__()
        self.b1, self.b2, self.skip_rank = nn.Linear(8, 8), nn.Linear(8, 8), skip_rank

    def forward(self, x):
        import torch.distributed as dist

        if dist.get_rank() != self.skip_rank:
            x = self.b1(x)
        return self.b2(x)


def _wrap(skip_rank: int, group, door: str = "wrapper"):
    from fullshard import FullyShardedDataParallel as FSDP, fully_shard

    torch.manual_seed(0)
    model = TwoBlocks(skip_rank)
    if door == "wrapper":
        return FSDP(model, process_group=group, auto_wrap_policy={nn.Linear})
    fully_shard(model.b1)
    fully_shard(model.b2)
    return fully_shard(model)


def _debug_mismatch(rank, world):
    from fullshard.core import collectives as C

    out = {}
    for door in ("wrapper", "fully_shard"):
        model = _wrap(skip_rank=1, group=None, door=door)
        C.set_debug(True)
        start = time.monotonic()
        try:
            model(torch.ones(2, 8)).sum().backward()
            out[door] = "no error", 0.0
        except C.CollectiveError as e:
            out[door] = str(e), time.monotonic() - start
        finally:
            C.set_debug(None)
    # Names by path with wrapper segments dropped: a checkpoint_wrapper put around a sharded block forwards
    # attribute reads to it and was counted as a second module of the unit ('b2+b2._checkpoint_wrapped_module').
    from fullshard.activation_checkpointing import CheckpointWrapper

    model = _wrap(skip_rank=-1, group=None, door="fully_shard")
    model.b2 = CheckpointWrapper(model.b2)
    model(torch.ones(2, 8))
    out["names"] = sorted(m._runtime.unit.name for m in (model.b1, model.b2._checkpoint_wrapped_module))
    return out


def test_debug_mode_reports_rank_dependent_unit_with_per_rank_diff():
    """Same shapes, so without the check the all-gathers would pair up silently (b1's shards
    with b2's); with it both ranks fail at once and show what each was about to issue. Under
    fully_shard too, whose units are named by their path at the root's first forward (named by
    class, both were 'Linear', and the check passed them: outputs 0.25 and 0.40 off)."""
    for rank, found in enumerate(run_ranks(_debug_mismatch, 2, timeout_s=300)):
        assert found.pop("names") == ["b1", "b2"], found
        for door, (msg, seconds) in found.items():
            assert msg.startswith(f"[rank {rank}] ranks issue different collectives"), (door, msg)
            assert "rank 0: all_gather of unit 'b1' (36 x float32)" in msg, (door, msg)
            assert "rank 1: all_gather of unit 'b2' (36 x float32)" in msg, (door, msg)
            assert "\n" not in msg and seconds < 10, (door, msg, seconds)


def _stuck_peer(rank, world):
    from fullshard.core import collectives as C

    group = C.new_group([0, 1], timeout_s=2.0)
    model = _wrap(skip_rank=-1, group=group)
    if rank == 1:
        time.sleep(7)  # stuck outside collectives (a slow data loader, a deadlock, ...)
        return "slept", 0.0
    start = time.monotonic()
    try:
        model(torch.ones(2, 8)).sum().backward()
    except C.CollectiveError as e:
        return str(e), time.monotonic() - start
    return "no error", 0.0


def test_collective_timeout_names_rank_op_unit_and_missing_rank():
    msg, seconds = run_ranks(_stuck_peer, 2, timeout_s=300)[0]
    assert msg.startswith("[rank 0] all_gather of unit 'b1' (36 x float32)"), msg
    assert "timed out after 2 s" in msg and "rank 1 did not arrive" in msg, msg
    assert "\n" not in msg
    # 2 s deadline + up to 3 s for the other ranks' reports (+ slack for a loaded machine)
    assert 2.0 <= seconds < 9.0, seconds
