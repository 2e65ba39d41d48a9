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


def _with_fault(spec: str, tmpdir=None):
    """Set the fault hook for the CLI subprocess (spawned ranks inherit it), and TMPDIR when given."""
    env = {"FULLSHARD_TEST_FAULT": spec, **({"TMPDIR": str(tmpdir)} if tmpdir is not None else {})}

    class _Env:
        def __enter__(self):
            os.environ.update(env)

        def __exit__(self, *exc):
            for key in env:
                os.environ.pop(key, None)
    return _Env()


def _assert_no_launcher_dirs(tmpdir) -> None:
    """torch elastic's per-launch log directories (each rank's error file) are gone after the job."""
    left = [p.name for p in tmpdir.iterdir() if "elastic" in p.name]
    assert left == [], left


def _stderr_lines(proc) -> list:
    return [line for line in proc.stderr.splitlines() if line.strip() and "Warning" not in line
            and not line.startswith("  ")]


def _two_ranks_with_fault(cli, corpus_dir, spec: str, timeout_s: int, tmpdir):
    """4 updates on 2 ranks with fault ``spec`` (TMPDIR = ``tmpdir``); returns (process, seconds);
    asserts it exited 1 and left no launcher directory."""
    start = time.monotonic()
    with _with_fault(spec, tmpdir):
        proc = cli("train", str(corpus_dir), *FAST, "--nproc-per-node", "2", "--max-update", "4",
                   "--collective-timeout", str(timeout_s), "--no-save", timeout=240)
    assert proc.returncode == 1, proc.stderr
    _assert_no_launcher_dirs(tmpdir)
    return proc, time.monotonic() - start


def test_stuck_rank_times_out_with_one_line(cli, corpus_dir, tmp_path):
    """Rank 1 stops issuing collectives mid-update 2; rank 0 exits after --collective-timeout
    naming the collective, its unit and rank 1; the launcher stops rank 1; nothing hangs."""
    proc, took = _two_ranks_with_fault(cli, corpus_dir, "hang:1:2", timeout_s=4, tmpdir=tmp_path)
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("fullshard train: error: rank 0 failed: [rank 0] "), proc.stderr
    assert "of unit 'layers." in last and "timed out after 4 s" in last and "rank 1 did not arrive" in last, last
    assert "Traceback" not in proc.stderr, proc.stderr
    assert took < 120, took


def test_killed_rank_is_named_and_others_exit(cli, corpus_dir, tmp_path):
    """SIGKILL of rank 1 mid-update 2: the job exits 1 at once (well within the timeout) with one
    line saying rank 1 was lost."""
    proc, took = _two_ranks_with_fault(cli, corpus_dir, "kill:1:2", timeout_s=60, tmpdir=tmp_path)
    assert _stderr_lines(proc)[-1].startswith("fullshard train: error: rank 1 was lost: killed by SIGKILL"), \
        proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    assert took < 60, took  # far below the 60 s collective timeout


def test_nan_loss_stops_naming_update_and_last_finite_loss(cli, corpus_dir, tmp_path):
    with _with_fault("nan:0:3"):
        proc = cli("train", str(corpus_dir), *FAST, "--nproc-per-node", "1", "--max-update", "5",
                   "--save-dir", str(tmp_path / "ck"), "--save-interval-updates", "2", timeout=240)
    assert proc.returncode == 1, proc.stderr
    from tests.e2e.common import json_records

    second = json_records(proc.stdout)["train_inner"][1]
    assert second["num_updates"] == "2"
    last = proc.stderr.strip().splitlines()[-1]
    assert f"loss is nan at update 3 (last finite loss {float(second['loss']):.3f} at update 2)" in last, last
    assert "Traceback" not in proc.stderr
    # the checkpoint of update 2 is what a resume starts from
    assert (tmp_path / "ck" / "checkpoint_last").is_dir()


def test_disk_full_during_save_keeps_previous_checkpoint(cli, corpus_dir, tmp_path):
    """ENOSPC on rank 1's second save (the final one): with --on-save-error continue the job ends
    0 with the update-1 checkpoint intact and no half-written directory; with stop (default) the
    failed save ends the job with one line."""
    from fullshard import checkpoint

    ck = tmp_path / "ck"
    with _with_fault("enospc:1:2"):
        proc = cli("train", str(corpus_dir), *FAST, "--nproc-per-node", "2", "--max-update", "2",
                   "--save-dir", str(ck), "--save-interval-updates", "1", "--on-save-error", "continue",
                   timeout=240)
    assert proc.returncode == 0, proc.stderr
    assert "failed on rank 1 while writing files: OSError: [Errno 28] No space left on device" in proc.stdout
    assert "the previous checkpoint" in proc.stdout and "continuing without this checkpoint" in proc.stdout
    assert sorted(p.name for p in ck.iterdir()) == ["checkpoint_1_1", "checkpoint_last"]
    manifest = checkpoint.verify(str(ck / "checkpoint_last"))
    assert manifest["world_size"] == 2
    import torch

    assert torch.load(ck / "checkpoint_last" / "extra-rank0.pt", weights_only=False)["train_state"]["num_updates"] == 1

    with _with_fault("enospc:0:1"):
        proc = cli("train", str(corpus_dir), *FAST, "--nproc-per-node", "1", "--max-update", "1",
                   "--save-dir", str(tmp_path / "stop"), timeout=240)
    assert proc.returncode == 1, proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert "No space left on device" in last and "no checkpoint was written" in last, last
    assert "stopped at update 1 (--on-save-error stop)" in last and "Traceback" not in proc.stderr
    assert list((tmp_path / "stop").iterdir()) == []


def test_max_restarts_resumes_after_sigkill_bit_identical(cli, corpus_dir, tmp_path):
    """A run that resumes an earlier one with --reset-lr-scheduler; rank 1 SIGKILLed mid-update 5 with
    --max-restarts 1: every rank restarts, resumes from its own update-4 checkpoint without resetting the
    schedule again (it restarted the warmup at update 4: other losses) and ends with the same logged losses
    and bit-identical parameters as an uninterrupted run."""
    import shutil

    import torch

    from tests.e2e.common import checkpoint_params, json_records

    args = [*FAST, "--nproc-per-node", "2", "--save-interval-updates", "2",
            "--lr-scheduler", "polynomial_decay", "--warmup-updates", "1", "--clip-norm", "1.0"]
    first = cli("train", str(corpus_dir), *args, "--max-update", "2", "--save-dir", str(tmp_path / "a"), timeout=300)
    assert first.returncode == 0, first.stderr
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    args += ["--max-update", "6", "--reset-lr-scheduler"]
    straight = cli("train", str(corpus_dir), *args, "--save-dir", str(tmp_path / "a"), timeout=300)
    assert straight.returncode == 0, straight.stderr
    start = time.monotonic()
    (tmp_path / "tmp").mkdir()
    with _with_fault("kill:1:5", tmp_path / "tmp"):
        proc = cli("train", str(corpus_dir), *args, "--save-dir", str(tmp_path / "b"), "--max-restarts", "1",
                   timeout=300)
    assert proc.returncode == 0, proc.stderr
    _assert_no_launcher_dirs(tmp_path / "tmp")  # two attempts, one log directory, removed
    assert "restart 1 of at most 1" in proc.stdout and "which an earlier start of this run wrote" in proc.stdout
    assert "@ 4 updates" in proc.stdout, proc.stdout

    def losses(p):
        return [(r["num_updates"], r["loss"], r["gnorm"], r["lr"]) for r in json_records(p.stdout)["train_inner"]]

    resumed = losses(proc)
    assert resumed[-2:] == losses(straight)[-2:], (resumed, losses(straight))
    a, _ = checkpoint_params(corpus_dir, tmp_path / "a" / "checkpoint_last")
    b, extra = checkpoint_params(corpus_dir, tmp_path / "b" / "checkpoint_last")
    assert extra["train_state"]["num_updates"] == 6
    for k in a:
        assert torch.equal(a[k], b[k]), k
    print(f"kill + restart + resume + 2 updates: {time.monotonic() - start:.1f} s")


def test_max_epoch_end_is_saved_once(cli, corpus_dir, tmp_path):
    """The last update of the last --max-epoch epoch, a multiple of --save-interval-updates, was saved twice
    (the interval save, then the run's final save of the same state)."""
    import json

    tokens = json.loads((corpus_dir / "meta.json").read_text())["splits"]["train"]["num_tokens"]
    per_epoch = (tokens - 1) // 64 // 4  # samples of 64 tokens, 4 per update (a partial last one is dropped)
    proc = cli("train", str(corpus_dir), *FAST, "--nproc-per-node", "1", "--max-epoch", "1", "--log-format",
               "simple", "--save-interval-updates", str(per_epoch), "--save-dir", str(tmp_path / "s"), timeout=300)
    assert proc.returncode == 0, proc.stderr
    saves = [line for line in proc.stdout.splitlines() if "saved checkpoint" in line]
    assert len(saves) == 1 and f"@ {per_epoch} updates" in saves[0], saves


def test_first_start_flags_apply_again_to_a_changed_command(cli, corpus_dir, tmp_path):
    """--restore-file and --reset-* act again when the command changed: another --optimizer with
    --reset-optimizer (it was taken for a restart and refused the saved optimizer state), and a rewind to an
    interval checkpoint of the save dir asked for a second time (it was ignored)."""
    save = ["--nproc-per-node", "1", "--log-format", "simple", "--save-dir", str(tmp_path / "s")]
    args = [a for a in FAST if a not in ("--log-format", "json")]

    def train(*extra):
        proc = cli("train", str(corpus_dir), *args, *save, *extra, timeout=300)
        assert proc.returncode == 0, proc.stderr
        return proc.stdout
    train("--max-update", "4", "--save-interval-updates", "2")
    train("--max-update", "5", "--reset-optimizer", "--optimizer", "adafactor")
    out = train("--max-update", "3", "--reset-optimizer", "--optimizer", "adam")
    assert "@ 0 updates" in out and "earlier start of this run" not in out, out
    for _ in range(2):  # a rewind, twice
        out = train("--max-update", "6", "--restore-file", "checkpoint_1_2")
        assert "checkpoint_1_2 (epoch 1 offset 2 @ 2 updates" in out, out
