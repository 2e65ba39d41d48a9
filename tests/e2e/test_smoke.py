"""The fast tier's end-to-end case (`make test-fast`): preprocess a small text, train on 2 ranks
with `--ddp-backend fully_sharded`, and read the checkpoint back, as a user runs the commands.
The rest of tests/e2e covers each command in depth."""
from __future__ import annotations

import pytest
import torch

from tests.e2e.common import ARCH, checkpoint_params, json_records, main_in_process, run_all, run_cli


@pytest.mark.fast
def test_preprocess_train_and_load_the_checkpoint(tmp_path, capsys):
    from fullshard.data import builtin_corpus_documents

    text = tmp_path / "corpus.txt"
    text.write_text("\n\n".join(d.strip() for d in builtin_corpus_documents()[:40]) + "\n")
    data = tmp_path / "data"
    code, _, err = main_in_process(capsys, "preprocess", "--trainpref", str(text), "--destdir", str(data),
                                   "--valid-fraction", "0.1")
    assert code == 0, err
    def train(save_dir, fresh):
        return lambda: run_cli("train", str(data), "--nproc-per-node", "2", "--arch", ARCH, "--ddp-backend",
                               "fully_sharded", "--tokens-per-sample", "32", "--batch-size", "4", "--lr", "0.003",
                               "--max-update", "6", "--seed", "1", "--log-format", "json", "--log-interval", "1",
                               "--save-dir", str(tmp_path / save_dir), fresh=fresh)
    # As a user runs it (a new interpreter, spawned ranks), and as the other e2e tests run the
    # command (forked from the test forkserver, forked ranks): the same losses.
    runs = run_all({"fresh": train("ckpt", True), "forked": train("forked", False)})
    for proc in runs.values():
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    records = json_records(runs["fresh"].stdout)
    losses = [float(r["loss"]) for r in records["train_inner"]]
    assert len(losses) == 6 and losses[-1] < losses[0], losses
    assert records["valid"], "no validation line"
    assert [r["loss"] for r in json_records(runs["forked"].stdout)["train_inner"]] == \
        [r["loss"] for r in records["train_inner"]]
    params, extra = checkpoint_params(data, tmp_path / "ckpt" / "checkpoint_last")
    assert all(torch.isfinite(v).all() for v in params.values())
    assert extra["train_state"]["num_updates"] == 6
