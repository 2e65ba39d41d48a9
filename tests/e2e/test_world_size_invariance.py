"""`fullshard train --global-batch-size 8 --world-size-invariant` as a user runs it, with dropout and
clipping: 1, 2 and 4 ranks log the same train_inner losses and gradient norms and save the same
parameter bytes, and a run saved at 2 ranks and resumed at 4 ends where a straight run ends."""
from __future__ import annotations

from tests.e2e.common import ARCH, checkpoint_params, json_records, run_all

UPDATES = 4
COMMON = ["--arch", ARCH, "--tokens-per-sample", "32", "--batch-size", "2", "--global-batch-size", "8",
          "--world-size-invariant", "--dropout", "0.1", "--clip-norm", "0.5", "--lr", "0.003", "--seed", "5",
          "--log-interval", "1", "--log-format", "json"]


def _train(cli, corpus_dir, save_dir, nproc: int, max_update: int):
    proc = cli("train", str(corpus_dir), *COMMON, "--nproc-per-node", str(nproc), "--max-update", str(max_update),
               "--save-dir", str(save_dir), timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def _lines(proc) -> list:
    return [(r["num_updates"], r["loss"], r["ppl"], r["gnorm"], r["wpb"], r["bsz"])
            for r in json_records(proc.stdout)["train_inner"]]


def test_world_size_invariant_cli_runs_are_bitwise_the_same(cli, corpus_dir, tmp_path):
    resumed = tmp_path / "resumed"

    def saved_at_2_resumed_at_4():
        return _train(cli, corpus_dir, resumed, 2, 2), _train(cli, corpus_dir, resumed, 4, UPDATES)

    calls = {"resumed": saved_at_2_resumed_at_4}  # first: the longest chain
    calls.update({n: lambda n=n: _train(cli, corpus_dir, tmp_path / f"w{n}", n, UPDATES) for n in (4, 2, 1)})
    done = run_all(calls)
    straight = {n: done[n] for n in (1, 2, 4)}
    for n, proc in straight.items():
        header = f"world-size invariant: global batch 8 = 2 sequences x {8 // (2 * n)} micro-batches x {n} ranks"
        assert header in proc.stdout, proc.stdout
        assert "intra-op threads per rank: 1" in proc.stdout
    lines = {n: _lines(proc) for n, proc in straight.items()}
    assert len(lines[1]) == UPDATES and all(line[4:] == ("256", "8") for line in lines[1])
    assert float(lines[1][0][3]) > 0.5  # clipping acts
    assert lines[2] == lines[1] and lines[4] == lines[1], lines
    valid = {n: json_records(proc.stdout)["valid"][-1]["valid_loss"] for n, proc in straight.items()}
    assert valid[2] == valid[1] and valid[4] == valid[1], valid

    # Saved at 2 ranks after 2 updates, resumed at 4 ranks: the same 4 updates.
    first, second = done["resumed"]
    assert _lines(first) + _lines(second) == lines[1]

    params = {n: checkpoint_params(corpus_dir, tmp_path / f"w{n}" / "checkpoint_last")[0] for n in (1, 2, 4)}
    params["resumed"] = checkpoint_params(corpus_dir, resumed / "checkpoint_last")[0]
    for name, state in params.items():
        assert state.keys() == params[1].keys()
        for key, value in state.items():
            want = params[1][key]
            assert value.dtype == want.dtype and value.numpy().tobytes() == want.numpy().tobytes(), \
                f"{name}: {key} differs from the 1-rank run"
