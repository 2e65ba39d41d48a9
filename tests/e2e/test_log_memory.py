"""`fullshard train --log-memory`: mem_* fields on train_inner lines (2 gloo ranks, gpt_mini),
checked against sizes computed from the model's parameter shapes.

* ``sgo``  SHARD_GRAD_OP, --update-freq 2 by no_sync, json: every unit stays gathered after
           forward, and the first micro-batch leaves a stash of every unit's full gradient.
* ``full`` FULL_SHARD, simple format: only the root stays gathered; no stash.
* ``c10d`` no units: no mem_* field, one header line saying so.
"""
from __future__ import annotations

import json
import math

import pytest

from tests.e2e.common import ARCH, TRAIN_INNER_KEYS, json_records, run_all

MEM_KEYS = ["mem_sharded_mb", "mem_unsharded_mb", "mem_full_grad_mb", "mem_stashed_grad_mb", "mem_pending_rs",
            "mem_pool_in_use_mb", "mem_pool_cached_mb"]
MIB = 2**20
UPDATES = 3
BASE = ["--nproc-per-node", "2", "--arch", ARCH, "--tokens-per-sample", "64", "--max-update", str(UPDATES),
        "--log-interval", "1", "--no-save", "--log-memory"]
RUNS = {
    "sgo": ["--no-reshard-after-forward", "--batch-size", "2", "--update-freq", "2", "--log-format", "json"],
    "full": ["--batch-size", "4", "--log-format", "simple"],
    "c10d": ["--ddp-backend", "c10d", "--batch-size", "4", "--log-format", "simple"],
}


@pytest.fixture(scope="module")
def runs(cli, corpus_dir):
    procs = run_all({name: lambda flags=flags: cli("train", str(corpus_dir), *BASE, *flags)
                     for name, flags in RUNS.items()})
    for name, proc in procs.items():
        assert proc.returncode == 0, name + "\n" + proc.stdout[-3000:] + proc.stderr[-3000:]
    return {name: proc.stdout for name, proc in procs.items()}


def _simple_records(text: str) -> list:
    """train_inner fields of a simple-format log, as ordered (key, value) lists."""
    out = []
    for line in text.splitlines():
        if "| train_inner | epoch" in line:
            out.append([kv.split("=", 1) for kv in line.split(" / ", 1)[1].split(" ", 1)[1].split(", ")])
    return out


def _unit_bytes(corpus_dir) -> dict:
    """Per unit of the trainer's model ("" root, one per TransformerBlock): fp32 bytes of this
    rank's flat shard at 2 ranks (each parameter's chunk of ceil(rows / 2) rows)."""
    from fullshard.models import TransformerBlock, arch_spec, build_model

    vocab = int(json.loads((corpus_dir / "meta.json").read_text())["vocab_size"])
    model = build_model(arch_spec(ARCH), device="meta", vocab_size=vocab, max_positions=arch_spec(ARCH).max_positions)
    units = [""] + [n for n, m in model.named_modules() if isinstance(m, TransformerBlock)]
    out = dict.fromkeys(units, 0)
    for name, p in model.named_parameters():
        owner = max((u for u in units if u == "" or name.startswith(u + ".")), key=len)
        rows = p.shape[0] if p.dim() else 1
        out[owner] += 4 * math.ceil(rows / 2) * (p.numel() // rows)
    return out


def _gathered_mib(shard_bytes: list) -> tuple:
    """Bounds (MiB, as logged with one decimal) on the storages of these units gathered at 2 ranks:
    2 x the shard each, which the buffer pool may round up by less than 1 MiB."""
    low = sum(2 * b for b in shard_bytes) / MIB
    return low - 0.05, low + len(shard_bytes) + 0.05


def _check_fields(mem: dict, units: dict, gathered: list, stashed: bool, where: str) -> None:
    assert mem["mem_sharded_mb"] == round(sum(units.values()) / MIB, 1), (where, mem)
    low, high = _gathered_mib(gathered)
    assert low <= mem["mem_unsharded_mb"] <= high, (where, mem, low, high)
    if stashed:  # fp32: the stash is N·S elements of every unit, the size gathered parameters take
        low, high = _gathered_mib(list(units.values()))
        assert low <= mem["mem_stashed_grad_mb"] <= high, (where, mem, low, high)
    else:
        assert mem["mem_stashed_grad_mb"] == 0, (where, mem)
    # At the sample points no gradient is waiting for its reduce-scatter.
    assert mem["mem_full_grad_mb"] == 0 and mem["mem_pending_rs"] == 0, (where, mem)
    # Gathered parameters are lent by the pool.
    assert mem["mem_pool_in_use_mb"] >= mem["mem_unsharded_mb"] and mem["mem_pool_cached_mb"] >= 0, (where, mem)


def test_log_memory_fields(runs, corpus_dir):
    units = _unit_bytes(corpus_dir)
    assert len(units) == 3, units  # the root and 2 blocks

    records = json_records(runs["sgo"])["train_inner"]
    assert len(records) == UPDATES
    for rec in records:
        assert list(rec) == TRAIN_INNER_KEYS + MEM_KEYS, list(rec)
        mem = {k: float(rec[k]) for k in MEM_KEYS}
        _check_fields(mem, units, list(units.values()), stashed=True, where=f"sgo {rec['num_updates']}")

    records = _simple_records(runs["full"])
    assert len(records) == UPDATES
    for rec in records:
        assert [k for k, _ in rec] == TRAIN_INNER_KEYS[2:] + MEM_KEYS, rec
        mem = {k: float(v) for k, v in rec if k in MEM_KEYS}
        _check_fields(mem, units, [units[""]], stashed=False, where="full")

    records = _simple_records(runs["c10d"])
    assert len(records) == UPDATES and all([k for k, _ in rec] == TRAIN_INNER_KEYS[2:] for rec in records)
    assert "--log-memory: ddp-backend c10d has no fullshard units; no mem_* fields are logged" in runs["c10d"]
