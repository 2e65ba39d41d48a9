"""fullshard on a CUDA GPU (skipped without one): both front doors put the model on the GPU and train it as a
single device does.

NCCL at world size 1 (one spawned rank): ``FullyShardedDataParallel`` (``device_id``) and ``fully_shard`` (the
default mesh) take a model built on the CPU, hold every shard on the GPU, and train ``STEPS`` AdamW steps to a
plain GPU model's losses and weights; bf16 ``param_dtype`` with fp32 reduction trains to a hand-written bf16
compute / fp32 master reference; CPU offload (pinned host shards) trains to the non-offloaded result; the state
dict loads into a plain model and into a fresh sharded one. gloo with 2 ranks on the same GPU (CUDA tensors):
both front doors match DDP (``fully_shard``: each rank's local rows, since ``DTensor.full_tensor()`` over gloo
segfaults on CUDA tensors in torch 2.11). Each case prints its largest difference (0 means bit for bit).
Runs in about a minute on an H100; skipped at collection without a GPU.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from fullshard import (
    CPUOffload,
    CPUOffloadPolicy,
    FullyShardedDataParallel as FSDP,
    MixedPrecision,
    MixedPrecisionPolicy,
    fully_shard,
)
from fullshard.core.params import local_of
from tests.dist import models as M
from tests.dist.common import ATOL, RTOL, full
from tests.dist.harness import run_ranks

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

STEPS = 3
"""AdamW steps per run."""
DOORS = ("wrapper", "fully_shard")
"""``FullyShardedDataParallel`` (a unit per block, auto-wrapped) and ``fully_shard`` (each block, then the root)."""
BF16 = torch.bfloat16


def _shard(door: str, base, device, precision: bool = False, offload: bool = False):
    """A CPU copy of ``base`` sharded by ``door`` onto ``device`` (the front door moves it)."""
    model = M.clone(base)
    if door == "wrapper":
        return FSDP(model, auto_wrap_policy=M.unit_policy("gpt"), device_id=device,
                    mixed_precision=MixedPrecision(param_dtype=BF16, reduce_dtype=torch.float32) if precision else None,
                    cpu_offload=CPUOffload(offload_params=offload))
    kwargs = dict(offload_policy=CPUOffloadPolicy(pin_memory=True)) if offload else {}
    if precision:
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=BF16, reduce_dtype=torch.float32)
    for block in model.layers:
        fully_shard(block, **kwargs)
    return fully_shard(model, **kwargs)


def _train(model, params, rank: int, device) -> list[torch.Tensor]:
    """``STEPS`` AdamW steps on rank ``rank``'s batches; returns the detached losses."""
    opt = torch.optim.AdamW(params, lr=1e-2, eps=1e-6, weight_decay=0.1)
    losses = []
    for step in range(STEPS):
        x, y = (t.to(device) for t in M.batch("gpt", rank, step))
        loss = M.loss_fn("gpt", model, x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach().float().cpu())
    return losses


def _full_params(model) -> dict[str, torch.Tensor]:
    """Full fp32 copies of the parameters, by original name (on the model's compute device)."""
    if isinstance(model, FSDP):
        with model.summon_full_params():
            return {n: p.detach().clone() for n, p in model.named_parameters()}
    return {n: full(p) for n, p in model.named_parameters()}


def _diff(losses, params, ref_losses, ref_params, where: str, rtol: float = RTOL, atol: float = ATOL) -> float:
    """Assert closeness to the reference; the largest absolute difference."""
    torch.testing.assert_close(torch.stack(losses), torch.stack(ref_losses), rtol=rtol, atol=atol,
                               msg=lambda m: f"{where} losses: {m}")
    assert params.keys() == ref_params.keys(), (where, sorted(params), sorted(ref_params))
    worst = max(float((a - b).abs().max()) for a, b in zip(losses, ref_losses))
    for n, p in params.items():
        want = ref_params[n].to(p.device)
        torch.testing.assert_close(p, want, rtol=rtol, atol=atol, msg=lambda m: f"{where} param {n}: {m}")
        worst = max(worst, float((p - want).abs().max()))
    return worst


def _rows(full_param: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """Rank ``rank``'s dim-0 shard of ``full_param`` (``torch.chunk``; empty past the last chunk)."""
    chunks = torch.chunk(full_param, world)
    return chunks[rank] if rank < len(chunks) else full_param[:0]


def _check_placement(model, door: str, device, offload: bool) -> None:
    for n, p in model.named_parameters():
        local = local_of(p)
        want = "cpu" if offload else device.type
        assert local.device.type == want, f"{door}: shard of {n} on {local.device}, expected {want}"
        if offload and device.type == "cuda":
            assert local.is_pinned(), f"{door}: offloaded shard of {n} is not in pinned memory"


def _bf16_reference(base, rank: int, device) -> tuple[list[torch.Tensor], dict]:
    """bf16 compute, fp32 gradients (cast, as an fp32 reduction of one rank gives), fp32 AdamW master weights."""
    master = {n: p.detach().to(device).clone().requires_grad_(True) for n, p in base.named_parameters()}
    low = M.clone(base).to(device, BF16)
    opt = torch.optim.AdamW(master.values(), lr=1e-2, eps=1e-6, weight_decay=0.1)
    losses = []
    for step in range(STEPS):
        x, y = (t.to(device) for t in M.batch("gpt", rank, step))
        loss = M.loss_fn("gpt", low, x, y)
        loss.backward()
        with torch.no_grad():
            for n, p in low.named_parameters():
                master[n].grad, p.grad = p.grad.float(), None
            opt.step()
            opt.zero_grad()
            for n, p in low.named_parameters():
                p.copy_(master[n])
        losses.append(loss.detach().float().cpu())
    return losses, {n: m.detach() for n, m in master.items()}


def _round_trip(model, door: str, base, device) -> float:
    """The state dict into a plain GPU model (same logits) and into a fresh sharded model (same weights)."""
    sd = model.state_dict()
    plain = M.clone(base).to(device)
    plain.load_state_dict({k: full(v) for k, v in sd.items()})
    x, _ = (t.to(device) for t in M.batch("gpt", 0, 99))
    with torch.no_grad():
        got, want = model(x), plain(x)
    torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL, msg=lambda m: f"{door} state dict -> plain: {m}")
    fresh = _shard(door, M.make_model("gpt", seed=1), device)
    fresh.load_state_dict(sd)
    params, loaded = _full_params(fresh), _full_params(model)
    for n, p in params.items():
        assert torch.equal(p, loaded[n]), f"{door}: {n} differs after load_state_dict into a fresh model"
    return float((got - want).abs().max())


def _note(out: dict, key: str, value: float) -> None:
    """Record one case's largest difference, and print it at once (a later case may fail)."""
    out[key] = value
    print(f"[{key}] max |diff| = {value:.3e}", flush=True)


def _nccl_one_rank(rank, world, device_type="cuda"):
    # device_type "cpu" (under gloo) runs the same checks without a GPU, for developing them.
    device = torch.device(device_type, 0) if device_type == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    base = M.make_model("gpt")
    ref = M.clone(base).to(device)
    ref_losses = _train(ref, ref.parameters(), rank, device)
    ref_params = {n: p.detach() for n, p in ref.named_parameters()}
    bf16_losses, bf16_params = _bf16_reference(base, rank, device)
    out = {}
    for door in DOORS:
        model = _shard(door, base, device)
        _check_placement(model, door, device, offload=False)
        losses = _train(model, model.parameters(), rank, device)
        fp32 = _full_params(model)
        # One rank: no reduction, the same kernels on the same values, so bit for bit (seen on an H100).
        _note(out, f"{door} fp32 vs plain GPU", _diff(losses, fp32, ref_losses, ref_params, f"{door} fp32", 0, 0))
        _note(out, f"{door} state dict round trip (logits)", _round_trip(model, door, base, device))

        model = _shard(door, base, device, precision=True)
        _check_placement(model, door, device, offload=False)
        seen = []
        linear = next(m for m in model.modules() if isinstance(m, torch.nn.Linear))
        hook = linear.register_forward_pre_hook(lambda mod, args: seen.append(mod.weight.dtype))
        losses = _train(model, model.parameters(), rank, device)
        hook.remove()
        assert seen and all(d == BF16 for d in seen), f"{door}: forward saw weights of dtypes {set(seen)}"
        assert all(local_of(p).dtype == torch.float32 for p in model.parameters()), f"{door}: master not fp32"
        _note(out, f"{door} bf16 vs bf16 reference",
              _diff(losses, _full_params(model), bf16_losses, bf16_params, f"{door} bf16", 0, 0))

        model = _shard(door, base, device, offload=True)
        _check_placement(model, door, device, offload=True)
        losses = _train(model, model.parameters(), rank, device)
        _note(out, f"{door} CPU offload vs not",
              _diff(losses, _full_params(model), ref_losses, fp32, f"{door} offload"))
    return out


def _gloo_two_ranks(rank, world, device_type="cuda"):
    # Both ranks share the one GPU; gloo moves CUDA tensors through the host.
    device = torch.device(device_type, 0) if device_type == "cuda" else torch.device("cpu")
    base = M.make_model("gpt")
    ddp = DDP(M.clone(base).to(device))
    ref_losses = _train(ddp, ddp.parameters(), rank, device)
    ref_params = {n.removeprefix("module."): p.detach() for n, p in ddp.named_parameters()}
    out = {}
    for door in DOORS:
        model = _shard(door, base, device)
        _check_placement(model, door, device, offload=False)
        losses = _train(model, model.parameters(), rank, device)
        if door == "wrapper":
            params, want = _full_params(model), ref_params
        else:  # this rank's rows (torch.chunk): DTensor.full_tensor() over gloo segfaults on CUDA in torch 2.11
            params = {n: local_of(p).detach() for n, p in model.named_parameters()}
            want = {n: _rows(p, rank, world) for n, p in ref_params.items()}
        _note(out, f"{door} vs DDP (gloo, 2 ranks, rank {rank})",
              _diff(losses, params, ref_losses, want, f"{door} gloo"))
    return out


def _report(results: list[dict]) -> None:
    for out in results:
        for key, value in out.items():
            print(f"{key}: max |diff| = {value:.3e}")


def test_nccl_single_rank_matches_plain_gpu():
    _report(run_ranks(_nccl_one_rank, 1, backend="nccl", timeout_s=300))


@pytest.mark.parametrize("algorithm", ["default", "all_to_all"])
def test_gloo_cuda_tensors_match_ddp(algorithm, monkeypatch):
    if algorithm != "default":  # gloo's native reduce-scatter and all-gather on CUDA tensors, and the all-to-all form
        monkeypatch.setenv("FULLSHARD_COLLECTIVES", algorithm)
    _report(run_ranks(_gloo_two_ranks, 2, timeout_s=300))


# ------------------------------------------------------------------------------------------------ side streams
SLEEP_CYCLES = 1_000_000
"""GPU cycles (about half a millisecond) each side stream sleeps after each wait, before its work: a consumer
that does not wait for the side stream then reads unfinished results, and the run differs from the
single-stream one."""


def _slow_side_streams(device):
    """Make every side stream of ``device`` sleep after each of its waits (see :data:`SLEEP_CYCLES`); returns
    the undo."""
    from fullshard.core import streams

    sides = streams.side(device)
    mine = [getattr(sides, f.name) for f in dataclasses.fields(sides)]
    original = streams.wait

    def slow(event, stream=None):
        original(event, stream)
        if stream is not None and any(stream == s for s in mine):
            with torch.cuda.stream(stream):
                torch.cuda._sleep(SLEEP_CYCLES)
    streams.wait = slow
    return lambda: setattr(streams, "wait", original)


def _slow_compute(device):
    """Make the compute stream sleep (:data:`SLEEP_CYCLES`) before every copy-out of an all-gather and before
    every ``nn.Linear`` forward: a side stream that writes a recycled buffer without waiting for the compute
    stream's last read of it (core/streams.py: a forward all-gather waits only on the buffer's return event)
    then overwrites values still to be read; returns the undo."""
    from fullshard.core import flat

    original = flat.copy_out

    def copy_out(*args, **kwargs):
        torch.cuda._sleep(SLEEP_CYCLES)
        return original(*args, **kwargs)

    def sleep(module, args):
        if isinstance(module, torch.nn.Linear):
            torch.cuda._sleep(SLEEP_CYCLES)
    flat.copy_out = copy_out
    handle = torch.nn.modules.module.register_module_forward_pre_hook(sleep)

    def undo():
        flat.copy_out = original
        handle.remove()
    return undo


def _hybrid(door: str, base, device, world: int):
    """``base`` under HYBRID_SHARD with one-rank shard groups and every rank a replica (the replicas'
    all-reduce carries the whole gradient)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from fullshard import ShardingStrategy

    model = M.clone(base)
    if door == "wrapper":
        shards = [dist.new_group([r]) for r in range(world)]
        rep = dist.new_group(list(range(world)))
        return FSDP(model, auto_wrap_policy=M.unit_policy("gpt"), device_id=device,
                    sharding_strategy=ShardingStrategy.HYBRID_SHARD, process_group=(shards[dist.get_rank()], rep))
    mesh = init_device_mesh(device.type, (world, 1), mesh_dim_names=("replicate", "shard"))
    for block in model.layers:
        fully_shard(block, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def _streams_on_off(rank, world, device_type="cuda"):
    """Each door and variant trained with side streams (the side streams slowed; then the compute stream
    slowed) and without: the same bits. Offload only at world size 1 (NCCL). ``device_type`` "cpu" (under
    gloo) runs the same code without streams, for developing."""
    from fullshard.core import streams

    device = torch.device(device_type, 0) if device_type == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    base = M.make_model("gpt")
    variants = {"fp32": dict(), "bf16": dict(precision=True), "offload": dict(offload=True), "hybrid": None}
    if world > 1:
        del variants["offload"]
    out = {}
    for door in DOORS:
        for name, kw in variants.items():
            runs = []
            for on, slow in ((True, _slow_side_streams), (True, _slow_compute), (False, None)):
                streams.set_enabled(on)
                undo = slow(device) if slow is not None and device.type == "cuda" else (lambda: None)
                try:
                    model = _hybrid(door, base, device, world) if kw is None else _shard(door, base, device, **kw)
                    losses = _train(model, model.parameters(), rank, device)
                finally:
                    undo()
                    streams.set_enabled(None)
                runs.append((torch.stack(losses), [local_of(p).detach().cpu() for p in model.parameters()]))
            off_losses, off_params = runs[-1]
            for how, (on_losses, on_params) in zip(("side streams slowed", "compute slowed"), runs):
                assert torch.equal(on_losses, off_losses), f"{door} {name} {how}: losses {on_losses} vs {off_losses}"
                for i, (a, b) in enumerate(zip(on_params, off_params)):
                    assert torch.equal(a, b), f"{door} {name} {how}: parameter {i} differs, max {(a - b).abs().max()}"
            _note(out, f"{door} {name} streams on (side, then compute slowed) vs off (rank {rank})", 0.0)
    return out


def test_streams_on_equal_streams_off():
    """Side streams (core/streams.py [Note: streams and events]) give the single-stream path's bits: NCCL at
    world size 1, and gloo with 2 ranks on the one GPU (real collectives, HYBRID's all-reduce over 2 ranks)."""
    _report(run_ranks(_streams_on_off, 1, backend="nccl", timeout_s=300))
    _report(run_ranks(_streams_on_off, 2, timeout_s=300))


def _sync_free_step(rank, world):
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    base = M.make_model("gpt")
    batches = [tuple(t.to(device) for t in M.batch("gpt", rank, step)) for step in range(2)]
    out = {}
    for door in DOORS:
        for precision in (False, True):
            model = _shard(door, base, device, precision=precision)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
            for step, (x, y) in enumerate(batches):  # the first step builds what is built once
                torch.cuda.synchronize()
                if step:
                    torch.cuda.set_sync_debug_mode("error")
                try:
                    M.loss_fn("gpt", model, x, y).backward()
                finally:
                    torch.cuda.set_sync_debug_mode(0)
                opt.step()
                opt.zero_grad()
            _note(out, f"{door} {'bf16' if precision else 'fp32'}: forward + backward without a host sync", 0.0)
    return out


def test_no_host_sync_in_forward_backward():
    """Issue 27 item 1 on the GPU: a steady-state forward + backward of both doors (NCCL, world size 1) makes
    no call that synchronizes the host with the GPU (``torch.cuda.set_sync_debug_mode("error")`` raises)."""
    _report(run_ranks(_sync_free_step, 1, backend="nccl", timeout_s=300))
