"""Two launchers on 127.0.0.1 acting as two nodes of 2 ranks (torch elastic's c10d rendezvous),
HYBRID_SHARD: the same losses as one launcher's 4-rank FULL_SHARD run; rendezvous network
errors are one line naming address:port."""
from __future__ import annotations

import socket
import subprocess
import sys
import time

from tests.e2e.common import cli_env, json_records, pool, run_cli

ARGS = ["--arch", "transformer_lm_gpt_mini", "--tokens-per-sample", "64", "--batch-size", "2",
        "--log-interval", "1", "--log-format", "json", "--seed", "3", "--lr", "0.001", "--max-update", "3",
        "--no-save"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _losses(stdout: str) -> list:
    return [(r["num_updates"], r["loss"]) for r in json_records(stdout)["train_inner"]]


def test_two_nodes_hybrid_shard_match_single_node_full_shard(corpus_dir):
    endpoint = f"127.0.0.1:{_free_port()}"
    env = cli_env()
    background = pool(1)  # the single-node run, meanwhile
    single = background.submit(run_cli, "train", str(corpus_dir), *ARGS, "--nproc-per-node", "4", timeout=300)
    background.shutdown(wait=False)
    nodes = [subprocess.Popen([sys.executable, "-m", "fullshard.cli", "train", str(corpus_dir), *ARGS,
                               "--nproc-per-node", "2", "--nnodes", "2", "--node-rank", str(n),
                               "--rdzv-endpoint", endpoint, "--rdzv-timeout", "120", "--hybrid-shard"],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for n in (0, 1)]
    outs = [p.communicate(timeout=300) for p in nodes]
    for p, (_, err) in zip(nodes, outs):
        assert p.returncode == 0, err[-3000:]
    assert "training on 4 devices (CPUs)" in outs[0][0]
    assert "HYBRID_SHARD: shard within 2 ranks, replicate across nodes" in outs[0][0]
    single = single.result()
    assert single.returncode == 0, single.stderr[-3000:]
    assert _losses(outs[0][0]) == _losses(single.stdout) and len(_losses(single.stdout)) == 3


def test_rendezvous_port_in_use_and_unreachable_host_are_one_line(corpus_dir):
    base = ["train", str(corpus_dir), *ARGS, "--nnodes", "2", "--rdzv-timeout", "3"]
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        endpoint = f"127.0.0.1:{busy.getsockname()[1]}"
        proc = run_cli(*base, "--node-rank", "0", "--rdzv-endpoint", endpoint, timeout=120)
    assert proc.returncode == 1
    assert proc.stderr == (f"fullshard train: error: cannot host the rendezvous at {endpoint}: the port is in "
                           "use; pick a free port for --rdzv-endpoint (the same on every node) or stop the "
                           "process listening there\n")
    endpoint = f"127.0.0.1:{_free_port()}"
    start = time.monotonic()
    proc = run_cli(*base, "--node-rank", "1", "--rdzv-endpoint", endpoint, timeout=120)
    assert proc.returncode == 1 and len(proc.stderr.splitlines()) == 1, proc.stderr
    assert proc.stderr.startswith(f"fullshard train: error: could not reach the rendezvous at {endpoint} "
                                  "from node 1 within 3 s (Connection refused): check that node 0"), proc.stderr
    assert time.monotonic() - start < 60
