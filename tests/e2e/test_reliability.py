"""Reliability of `fullshard train` with real processes: a stuck rank and a SIGKILLed rank
end the job within the collective timeout with one line naming the lost rank; NaN losses,
failed saves and restarts. Faults come from the FULLSHARD_TEST_FAULT test hook
(``fullshard/faults.py``)."""
from __future__ import annotations

import os
import time

ARCH = "transformer_lm_gpt_mini"
FAST = ["--arch", ARCH, "--tokens-per-sample", "64", "--batch-size", "4", "--log-interval", "1",
        "--log-format", "json", "--seed", "3", "--lr", "0.001"]


def _with_fault(spec: str):
    """Set the fault hook for the CLI subprocess (spawned ranks inherit it)."""
    class _Env:
        def __enter__(self):
            os.environ["FULLSHARD_TEST_FAULT"] = spec

        def __exit__(self, *exc):
            os.environ.pop("FULLSHARD_TEST_FAULT", None)
    return _Env()


def _stderr_lines(proc) -> list:
    return [line for line in proc.stderr.splitlines() if line.strip() and "Warning" not in line
            and not line.startswith("  ")]


def test_stuck_rank_times_out_with_one_line(cli, corpus_dir, tmp_path):
    """Rank 1 stops issuing collectives mid-update 2; rank 0 exits after --collective-timeout
    naming the collective, its unit and rank 1; the launcher stops rank 1; nothing hangs."""
    start = time.monotonic()
    with _with_fault("hang:1:2"):
        proc = cli("train", str(corpus_dir), *FAST, "--nproc-per-node", "2", "--max-update", "4",
                   "--collective-timeout", "4", "--no-save", timeout=240)
    took = time.monotonic() - start
    assert proc.returncode == 1, proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("fullshard train: error: rank 0 failed: [rank 0] "), proc.stderr
    assert "of unit 'layers." in last and "timed out after 4 s" in last and "rank 1 did not arrive" in last, last
    assert "Traceback" not in proc.stderr, proc.stderr
    assert took < 120, took


def test_killed_rank_is_named_and_others_exit(cli, corpus_dir):
    """SIGKILL of rank 1 mid-update 2: the job exits 1 at once (well within the timeout) with one
    line saying rank 1 was lost."""
    start = time.monotonic()
    with _with_fault("kill:1:2"):
        proc = cli("train", str(corpus_dir), *FAST, "--nproc-per-node", "2", "--max-update", "4",
                   "--collective-timeout", "60", "--no-save", timeout=240)
    took = time.monotonic() - start
    assert proc.returncode == 1, proc.stderr
    assert _stderr_lines(proc)[-1].startswith("fullshard train: error: rank 1 was lost: killed by SIGKILL"), \
        proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    assert took < 60, took  # far below the 60 s collective timeout
