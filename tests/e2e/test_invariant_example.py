"""examples/invariant.py (the documented recipe) prints the same losses, gradient norms and
parameter digest under torchrun at 1 and 3 ranks; and `python -m fullshard.bench.reductions`
times the three reductions it compares."""
from __future__ import annotations

import os
import subprocess
import sys

from fullshard.bench import reductions
from tests.dist import harness
from tests.e2e.common import cli_env, run_all

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _run_example(nproc: int) -> list:
    env = cli_env()  # (torchrun starts a script's ranks as new interpreters whatever the start method)
    env["PYTHONPATH"] = os.path.join(ROOT, "src")
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
                           "--standalone", os.path.join(ROOT, "examples", "invariant.py")],
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout.splitlines()


def test_example_gives_the_same_bits_at_one_and_three_ranks():
    runs = run_all({n: lambda n=n: _run_example(n) for n in (1, 3)})
    one, three = runs[1], runs[3]
    assert len(one) == 5 and one[-1].startswith("1 ranks: parameters sha256 ")
    assert one[:4] == three[:4]
    assert one[-1].split()[-1] == three[-1].split()[-1]


def test_reduction_costs_table():
    table = reductions.run(2, [2**18], 1, context=harness.context())  # ranks forked, as tests/dist's
    rows = [line.split("|") for line in table.splitlines() if line.startswith("| 1 MiB fp32")]
    assert [row[2].strip() for row in rows] == ["reduce-scatter", "ordered fold", "fixed point"]
    # Bytes one rank sends: half the gradient, and three int64 limbs per fp32 element for fixed point.
    assert [row[5].strip() for row in rows] == ["0.5 MiB", "0.5 MiB", "3.0 MiB"]
