"""`fullshard train` / `fullshard plot` as a user runs them: 2 gloo ranks on CPU, tiny GPT."""
from __future__ import annotations

import ast
import json
import math
import subprocess
import sys
import textwrap

import pytest
import torch

from tests.dist import harness
from tests.e2e.common import ARCH, TRAIN_INNER_KEYS, cli_env, json_records, run_all, run_cli_checked

UPDATES = 20
COMMON = ["--nproc-per-node", "2", "--arch", ARCH, "--tokens-per-sample", "64", "--lr", "0.001",
          "--lr-scheduler", "polynomial_decay", "--warmup-updates", "5", "--max-update", str(UPDATES),
          "--clip-norm", "1.0", "--weight-decay", "0.01", "--adam-betas", "(0.9,0.98)", "--seed", "3",
          "--log-interval", "1"]
VALID_KEYS = ["epoch", "valid_loss", "valid_ppl", "valid_wps", "valid_wpb", "valid_bsz", "valid_num_updates"]
# With --clip-norm, fairseq's clip (percent of updates clipped) follows gnorm.
CLIPPED_INNER_KEYS = TRAIN_INNER_KEYS[:TRAIN_INNER_KEYS.index("gnorm") + 1] + ["clip"] + \
    TRAIN_INNER_KEYS[TRAIN_INNER_KEYS.index("gnorm") + 1:]
TRAIN_KEYS = ["epoch"] + ["train_" + k for k in CLIPPED_INNER_KEYS[2:]]


def simple_losses(text: str) -> list:
    """train_inner losses of a simple-format log, in order."""
    losses = []
    for line in text.splitlines():
        if "| train_inner | epoch" in line:
            fields = dict(kv.split("=", 1) for kv in line.split(" / ", 1)[1].split(" ", 1)[1].split(", "))
            losses.append(float(fields["loss"]))
    return losses


def _vocab(runs) -> int:
    meta = json.loads((runs["corpus"] / "meta.json").read_text())
    return int(meta["vocab_size"])


@pytest.fixture(scope="module")
def runs(cli, corpus_dir, tmp_path_factory):
    """The same 20-update run on fully_sharded and on c10d (json logs, checkpoints), and
    ``update_freq``: fully_sharded at --batch-size 2 --update-freq 2 (simple log, --no-save)."""
    out = {"corpus": corpus_dir}
    roots = {name: tmp_path_factory.mktemp(name) for name in ("fully_sharded", "c10d", "update_freq")}
    calls = {backend: lambda backend=backend: cli(
        "train", str(corpus_dir), *COMMON, "--ddp-backend", backend, "--batch-size", "4", "--log-format", "json",
        "--log-file", str(roots[backend] / "train.log"), "--save-dir", str(roots[backend] / "ckpt"))
        for backend in ("fully_sharded", "c10d")}
    calls["update_freq"] = lambda: cli("train", str(corpus_dir), *COMMON, "--ddp-backend", "fully_sharded",
                                       "--batch-size", "2", "--update-freq", "2", "--log-format", "simple",
                                       "--no-save", "--save-dir", str(roots["update_freq"] / "ckpt"))
    for name, proc in run_all(calls).items():
        assert proc.returncode == 0, name + "\n" + proc.stdout[-3000:] + proc.stderr[-3000:]
        out[name] = dict(proc=proc, root=roots[name],
                         records=json_records(proc.stdout) if name != "update_freq" else None)
    return out


@pytest.mark.parametrize("backend", ["fully_sharded", "c10d"])
def test_log_records_have_every_field(runs, backend):
    run = runs[backend]
    stdout, records = run["proc"].stdout, run["records"]
    assert "num. model params: " in stdout and "(num. trained: " in stdout
    assert "training on 2 devices (CPUs)" in stdout
    assert "max tokens per device = None and batch size per device = 4" in stdout
    assert f"Stopping training due to num_updates: {UPDATES} >= max_update: {UPDATES}" in stdout
    assert "done training in " in stdout
    assert len(records["train_inner"]) == UPDATES
    for rec in records["train_inner"]:
        assert list(rec) == CLIPPED_INNER_KEYS
        assert all(isinstance(rec[k], str) for k in CLIPPED_INNER_KEYS[2:])
        assert float(rec["clip"]) == (100.0 if float(rec["gnorm"]) > 1.0 else 0.0), rec  # --clip-norm 1.0
        assert float(rec["ppl"]) == pytest.approx(2 ** float(rec["loss"]), rel=1e-2)
        assert rec["wpb"] == str(4 * 2 * 64) and rec["bsz"] == "8" and rec["loss_scale"] == "1"
    assert [int(r["num_updates"]) for r in records["train_inner"]] == list(range(1, UPDATES + 1))
    assert [r["lr"] for r in records["train_inner"][:5]] == ["0.0002", "0.0004", "0.0006", "0.0008", "0.001"]
    assert records["train_inner"][-1]["lr"] == "0"
    assert len(records["valid"]) == 1 and list(records["valid"][0]) == VALID_KEYS
    assert records["valid"][0]["valid_num_updates"] == str(UPDATES)
    assert len(records["train"]) == 1 and list(records["train"][0]) == TRAIN_KEYS
    clipped = sum(float(r["clip"]) for r in records["train_inner"]) / UPDATES
    assert float(records["train"][0]["train_clip"]) == pytest.approx(clipped, abs=0.06)
    # --log-file holds the same lines as stdout (rank 0 only: no duplicates).
    logged = (run["root"] / "train.log").read_text().splitlines()
    assert logged == [line for line in stdout.splitlines() if " | INFO | " in line]


@pytest.mark.parametrize("backend", ["fully_sharded", "c10d"])
def test_loss_falls(runs, backend):
    losses = [float(r["loss"]) for r in runs[backend]["records"]["train_inner"]]
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 0.3, losses
    valid = float(runs[backend]["records"]["valid"][0]["valid_loss"])
    assert valid < losses[0]


def test_fully_sharded_matches_c10d(runs):
    """Same seed and data: the same per-update losses, grad norms and final parameters."""
    fsdp, ddp = (runs[b]["records"]["train_inner"] for b in ("fully_sharded", "c10d"))
    for a, b in zip(fsdp, ddp):
        # The log keeps 3 decimals, so allow one unit in the last logged place.
        assert math.isclose(float(a["loss"]), float(b["loss"]), rel_tol=1e-5, abs_tol=1.01e-3), (a, b)
        assert math.isclose(float(a["gnorm"]), float(b["gnorm"]), rel_tol=1e-5, abs_tol=1.01e-3), (a, b)
    from fullshard import checkpoint
    from fullshard.models import ARCHS, build_model

    models = {}
    for backend in ("fully_sharded", "c10d"):
        models[backend] = build_model(ARCH, vocab_size=_vocab(runs),
                                       max_positions=ARCHS[ARCH].max_positions)
        extra = checkpoint.load(str(runs[backend]["root"] / "ckpt" / "checkpoint_last"), models[backend])
        assert extra["world_size"] == 2 and extra["train_state"]["num_updates"] == UPDATES
    full = models["c10d"].state_dict()
    for name, value in models["fully_sharded"].state_dict().items():
        torch.testing.assert_close(value, full[name], rtol=1e-4, atol=1e-4, msg=name)
    leftovers = [p.name for b in ("fully_sharded", "c10d") for p in (runs[b]["root"] / "ckpt").iterdir()
                 if ".tmp" in p.name or ".old" in p.name]
    assert leftovers == []


def test_update_freq_equals_larger_batch(runs):
    """--batch-size 2 --update-freq 2 takes the same 8 sequences per update as --batch-size 4."""
    save_dir, proc = runs["update_freq"]["root"] / "ckpt", runs["update_freq"]["proc"]
    blocks = int(proc.stdout.split("| loaded ")[1].split(" blocks")[0].replace(",", ""))
    assert f"epoch 001:      1 / {-(-blocks // 8)} loss=" in proc.stdout  # 8 sequences per update
    assert "wpb=512, bsz=8" in proc.stdout
    losses = simple_losses(proc.stdout)
    reference = [float(r["loss"]) for r in runs["c10d"]["records"]["train_inner"]]
    assert len(losses) == UPDATES
    for a, b in zip(losses, reference):
        assert math.isclose(a, b, rel_tol=1e-5, abs_tol=1.01e-3), (losses, reference)
    assert not save_dir.exists()


BAD_INPUTS = {
    "missing data dir": (["{missing}"], "does not exist"),
    "no meta.json": (["{empty}"], "fullshard preprocess"),
    "unknown arch": (["{data}", "--arch", "transformer_lm_gpt_huge"], "transformer_lm_gpt3_small"),
    "tokens beyond positions": (["{data}", "--tokens-per-sample", "513"], "512"),
    "split smaller than a batch": (["{data}", "--batch-size", "500"], "fewer than one batch"),
}


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_input_is_one_line_exit_2_nothing_written(capsys, corpus_dir, tmp_path, case):
    """Checked before any rank starts: the first case through the command (its exit code), the others
    in this process."""
    argv, expected = BAD_INPUTS[case]
    (tmp_path / "empty").mkdir()
    paths = dict(missing=str(tmp_path / "nope"), empty=str(tmp_path / "empty"), data=str(corpus_dir))
    argv = [a.format(**paths) for a in argv]
    if "--arch" not in argv:
        argv += ["--arch", ARCH]
    for flag, value in (("--batch-size", "4"), ("--tokens-per-sample", "64")):
        if flag not in argv:
            argv += [flag, value]
    save_dir, log_file = tmp_path / "ckpt", tmp_path / "train.log"
    argv = ["train", *argv, "--nproc-per-node", "2", "--save-dir", str(save_dir), "--log-file", str(log_file)]
    code, out, err = run_cli_checked(capsys, argv, case == next(iter(BAD_INPUTS)))
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("fullshard train: error: ") and expected in lines[0], lines[0]
    assert not save_dir.exists() and not log_file.exists()
    assert out == ""


def test_rank_failure_surfaces_error(corpus_dir):
    """A rank that raises makes launch() raise RankFailed naming the rank and the error."""
    code = textwrap.dedent(f"""
        import dataclasses
        from fullshard.train.launcher import RankFailed, launch
        from fullshard.train.loop import train_main
        from fullshard.train.options import parse_train_args
        cfg = parse_train_args([{str(corpus_dir)!r}, "--arch", {ARCH!r}, "--tokens-per-sample", "64",
                                "--batch-size", "4", "--nproc-per-node", "2", "--no-save"])
        try:
            launch(dataclasses.replace(cfg, arch="broken_arch"), train_main)
        except RankFailed as e:
            print("RANKFAILED", e)
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert "RANKFAILED rank " in proc.stdout, proc.stdout + proc.stderr[-3000:]
    assert "unknown arch 'broken_arch'" in proc.stdout


def _rank_store(_) -> tuple:
    import os

    return os.environ["TORCHELASTIC_USE_AGENT_STORE"], os.environ["MASTER_PORT"]


def _launch_forked(argv) -> int:
    from fullshard.train.launcher import launch_local

    print("STORES", launch_local(_rank_store, None, int(argv[0]), start_method="fork"))
    return 0


def test_forked_ranks_meet_at_their_own_store():
    """Under --start-method fork the ranks' process group does not use the store that a thread of the
    launcher serves while the next rank is forked: a rank forked while a thread of the launcher held
    glibc's resolver lock deadlocked at its first lookup (launcher.py [Note: fork and the store])."""
    proc = harness.run_main(_launch_forked, ["3"], cli_env(), 120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    stores = ast.literal_eval(proc.stdout.split("STORES ", 1)[1])
    assert [use for use, _ in stores] == ["False"] * 3 and len({port for _, port in stores}) == 1, stores


def test_plot_two_logs(cli, runs, tmp_path):
    logs = []
    for backend in ("fully_sharded", "c10d"):
        path = tmp_path / f"{backend}.log"
        path.write_text(runs[backend]["proc"].stdout)
        logs.append(str(path))
    out = tmp_path / "curve.png"
    proc = cli("plot", *logs, "-o", str(out))
    assert proc.returncode == 0, proc.stderr
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_rejects_log_without_records(cli, tmp_path):
    empty = tmp_path / "empty.log"
    empty.write_text("nothing to see\n")
    proc = cli("plot", str(empty), "-o", str(tmp_path / "x.png"))
    assert proc.returncode == 2
    assert "fullshard plot: error: no train_inner or valid records" in proc.stderr
    assert not (tmp_path / "x.png").exists()
