"""Elastic `fullshard train`: ``--nnodes MIN:MAX`` on torch elastic's c10d rendezvous (two launchers
of 2 ranks on 127.0.0.1) shrinks when a launcher is SIGKILLed and grows when one joins, each time
resuming from checkpoint_last at the new world size, and ends with the parameters of an
uninterrupted run bit for bit (under --world-size-invariant); a launcher preempted by SIGTERM
under --save-on-sigterm loses no work; --save-on-sigterm saves at an update boundary and a single
launcher's run resumes exactly; an elastic range is checked up front (one line, exit 2)."""
from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest
import torch

from tests.e2e.common import ARCH, checkpoint_params, cli_env, json_records, run_all, run_cli

SMALL = ["--arch", ARCH, "--tokens-per-sample", "16", "--batch-size", "2", "--log-interval", "1",
         "--log-format", "json", "--seed", "3", "--lr", "0.001", "--save-interval-updates", "2"]
# Updates of the elastic runs: a membership change must land well before the end. An update of these
# runs takes about 0.15 s here; a join took effect about 6 updates after it was made.
UPDATES = 24
INVARIANT = [*SMALL, "--max-update", str(UPDATES), "--global-batch-size", "8", "--world-size-invariant",
             "--dropout", "0.1", "--clip-norm", "0.5"]
# Fast rendezvous for one machine: a dead launcher is dropped after 3 x 1 s without a heartbeat,
# a round starts 3 s after its first node is in.
ELASTIC = ["--nproc-per-node", "2", "--nnodes", "1:2", "--max-restarts", "2", "--rdzv-keep-alive", "1",
           "--rdzv-last-call", "3", "--rdzv-timeout", "120", "--collective-timeout", "60"]
_CHANGED = re.compile(r"world size changed from (\d+) to (\d+): resuming at update (\d+) \(epoch 1, update (\d+) "
                      r"of it\) from (\S+); update-freq (\d+) -> (\d+)")
# Runs `fullshard ARGV` once the file argv[1] exists: the test starts it early (imports done) and
# lets it join at the moment it chooses.
_ON_GO = ("import os, sys, time\nimport torch.distributed.launcher.api\nfrom fullshard import cli\n"
          "while not os.path.exists(sys.argv[1]):\n    time.sleep(0.02)\nsys.exit(cli.main(sys.argv[2:]))\n")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env() -> dict:
    return cli_env()  # ranks forked from the launcher (see tests/e2e/common.run_cli)


class Launcher:
    """One `fullshard train` launcher in its own process group; its output is read as it comes."""

    def __init__(self, *argv: str, go: str = None):
        cmd = [sys.executable, "-c", _ON_GO, go] if go else [sys.executable, "-m", "fullshard.cli"]
        self.proc = subprocess.Popen([*cmd, "train", *argv], env=_env(), stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True, start_new_session=True)
        self.out, self.err = [], []
        self._readers = [threading.Thread(target=self._drain, args=(pipe, lines), daemon=True)
                         for pipe, lines in ((self.proc.stdout, self.out), (self.proc.stderr, self.err))]
        for reader in self._readers:
            reader.start()

    @staticmethod
    def _drain(pipe, lines) -> None:
        for line in pipe:
            lines.append(line)

    def stdout(self) -> str:
        return "".join(self.out)

    def finish(self, timeout: float) -> int:
        try:
            code = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.signal_group(signal.SIGKILL)
            raise
        for reader in self._readers:
            reader.join(timeout=10)
        return code

    def signal_group(self, sig: int) -> None:
        """``sig`` to the launcher and its ranks (its process group)."""
        try:
            os.killpg(self.proc.pid, sig)
        except ProcessLookupError:
            pass

    def ranks(self) -> list:
        """Pids of the ranks this launcher started (torch elastic's multiprocessing children)."""
        found = []
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                with open(f"/proc/{pid}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
                with open(f"/proc/{pid}/cmdline") as f:
                    cmdline = f.read()
            except (OSError, IndexError, ValueError):
                continue
            if ppid == self.proc.pid and "resource_tracker" not in cmdline:  # spawned or forked
                found.append(int(pid))
        return found


def _records(*texts: str) -> dict:
    """num_updates -> (loss, gnorm) of every train_inner line in ``texts``."""
    return {int(r["num_updates"]): (r["loss"], r["gnorm"]) for text in texts
            for r in json_records(text)["train_inner"]}


def _wait_for(launchers, condition, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition("".join(launcher.stdout() for launcher in launchers)):
        if time.monotonic() > deadline or all(x.proc.poll() is not None for x in launchers):
            for launcher in launchers:
                launcher.signal_group(signal.SIGKILL)
            tails = [(launcher.stdout()[-3000:], "".join(launcher.err)[-3000:]) for launcher in launchers]
            pytest.fail(f"did not see {what} within {timeout} s: {tails}")
        time.sleep(0.05)


def _updated_at(world: int, update: int):
    """A condition: a train_inner line of update >= ``update`` after 'training on <world> devices'."""
    def condition(text: str) -> bool:
        marker = f"training on {world} devices"
        return marker in text and any(n >= update for n in _records(text.rsplit(marker, 1)[1]))
    return condition


def _print_key_lines(*texts: str) -> None:
    """The lines that tell an elastic run's story (shown with pytest -s)."""
    keys = ("training on", "restart ", "loaded checkpoint", "world size changed", "SIGTERM:", "done training")
    for text in texts:
        for line in text.splitlines():
            if any(key in line for key in keys):
                print(line)


def _assert_same_params(got: dict, want: dict, what: str) -> None:
    assert got.keys() == want.keys()
    differing = [k for k in want if not torch.equal(got[k], want[k])]
    assert not differing, f"{what}: {len(differing)} tensors differ, e.g. {differing[:3]}"


@pytest.fixture(scope="module")
def straight(corpus_dir, tmp_path_factory):
    """Uninterrupted --world-size-invariant runs at 4 and 2 ranks: {world: (params, records)}."""
    root = tmp_path_factory.mktemp("straight")
    out = {}
    procs = run_all({world: lambda world=world: run_cli("train", str(corpus_dir), *INVARIANT, "--nproc-per-node",
                                                        str(world), "--save-dir", str(root / str(world)), timeout=300)
                     for world in (4, 2)})
    for world, proc in procs.items():
        assert proc.returncode == 0, proc.stderr[-3000:]
        out[world] = (checkpoint_params(corpus_dir, root / str(world) / "checkpoint_last")[0], _records(proc.stdout))
    assert out[4][1] == out[2][1] and len(out[4][1]) == UPDATES  # the trainer's invariance, which this file relies on
    return out


def test_shrink_when_a_launcher_dies(corpus_dir, tmp_path, straight):
    """Two launchers of 2 ranks at --nnodes 1:2; node 1 and its ranks SIGKILLed after update 3
    at world size 4: node 0's ranks fail, restart (1 of 2) without it at world size 2 from the last
    checkpoint, log the change, and finish with the parameters of the straight 4- and 2-rank runs."""
    endpoint, save = f"127.0.0.1:{_free_port()}", tmp_path / "ck"
    start = time.monotonic()
    nodes = [Launcher(str(corpus_dir), *INVARIANT, *ELASTIC, "--node-rank", str(n), "--rdzv-endpoint", endpoint,
                      "--save-dir", str(save)) for n in (0, 1)]
    _wait_for(nodes, _updated_at(4, 3), 120, "update 3 at world size 4")
    nodes[1].signal_group(signal.SIGKILL)
    killed = time.monotonic()
    assert nodes[0].finish(timeout=180) == 0, (nodes[0].stdout()[-3000:], "".join(nodes[0].err)[-3000:])
    assert nodes[1].finish(timeout=30) == -signal.SIGKILL
    log = nodes[0].stdout()
    _print_key_lines(nodes[1].stdout(), log)
    changed = _CHANGED.findall(log)
    assert len(changed) == 1, log[-4000:]
    old, new, update, offset, path, freq_old, freq_new = changed[0]
    assert (old, new, path, freq_old, freq_new) == ("4", "2", str(save / "checkpoint_last"), "1", "2"), changed
    # the interval checkpoint before the kill (--save-interval-updates 2)
    assert update == offset and int(update) % 2 == 0 and 2 <= int(update) < UPDATES, changed
    assert "restart 1 of at most 2" in log and "training on 2 devices" in log
    records = _records(log, nodes[1].stdout())
    assert {n: records[n] for n in records if n > int(update)} == \
        {n: straight[2][1][n] for n in straight[2][1] if n > int(update)}
    params, extra = checkpoint_params(corpus_dir, save / "checkpoint_last")
    assert extra["world_size"] == 2 and extra["train_state"]["num_updates"] == UPDATES
    _assert_same_params(params, straight[4][0], "shrunk run vs straight 4-rank run")
    _assert_same_params(params, straight[2][0], "shrunk run vs straight 2-rank run")
    print(f"shrink: {killed - start:.1f} s to the kill, {time.monotonic() - killed:.1f} s from the kill to the end")


def test_preempted_launcher_saves_and_the_others_go_on(corpus_dir, tmp_path, straight):
    """As the shrink, with --save-on-sigterm and SIGTERM (a preemption notice) to node 1's process
    group: all 4 ranks stop after the same update and save; node 1 exits 143; node 0's ranks, which
    got no SIGTERM, exit 1 naming it, restart at world size 2 from that very update (no work lost)
    and finish with the straight runs' parameters."""
    endpoint, save = f"127.0.0.1:{_free_port()}", tmp_path / "ck"
    nodes = [Launcher(str(corpus_dir), *INVARIANT, *ELASTIC, "--node-rank", str(n), "--rdzv-endpoint", endpoint,
                      "--save-dir", str(save), "--save-on-sigterm") for n in (0, 1)]
    _wait_for(nodes, _updated_at(4, 3), 120, "update 3 at world size 4")
    nodes[1].signal_group(signal.SIGTERM)
    sent = time.monotonic()
    assert nodes[0].finish(timeout=180) == 0, (nodes[0].stdout()[-3000:], "".join(nodes[0].err)[-3000:])
    assert nodes[1].finish(timeout=30) == 128 + signal.SIGTERM
    assert "".join(nodes[1].err).strip().splitlines()[-1] == (
        "fullshard train: stopped by SIGTERM after the ranks saved checkpoint_last; the same command resumes from "
        "the last checkpoint")
    log = nodes[0].stdout() + nodes[1].stdout()
    _print_key_lines(log)
    saved = re.findall(r"SIGTERM: saved checkpoint at update (\d+)", log)
    assert len(saved) == 1 and 3 <= int(saved[0]) < UPDATES, log[-4000:]
    assert re.search(rf"\[rank \d\] stopped after update {saved[0]} because another rank got SIGTERM",
                     "".join(nodes[0].err)), "".join(nodes[0].err)[-3000:]
    assert _CHANGED.findall(log) == [("4", "2", saved[0], saved[0], str(save / "checkpoint_last"), "1", "2")]
    assert "restart 1 of at most 2" in log
    assert _records(log) == straight[2][1]
    params, extra = checkpoint_params(corpus_dir, save / "checkpoint_last")
    assert extra["world_size"] == 2 and extra["train_state"]["num_updates"] == UPDATES
    _assert_same_params(params, straight[4][0], "preempted run vs straight 4-rank run")
    _assert_same_params(params, straight[2][0], "preempted run vs straight 2-rank run")
    print(f"preempt: {time.monotonic() - sent:.1f} s from the SIGTERM to the end")


def test_grow_when_a_launcher_joins(corpus_dir, tmp_path, straight):
    """Node 0 alone at --nnodes 1:2 (world size 2) with --save-on-sigterm; node 1 joins after
    update 1: torch elastic SIGTERMs node 0's ranks (no restart counted), they save at an update
    boundary, and all 4 ranks resume from that checkpoint, ending with the straight runs' parameters."""
    endpoint, save, go = f"127.0.0.1:{_free_port()}", tmp_path / "ck", tmp_path / "go"
    argv = [str(corpus_dir), *INVARIANT, *ELASTIC, "--rdzv-endpoint", endpoint, "--save-dir", str(save),
            "--save-on-sigterm"]
    start = time.monotonic()
    node0 = Launcher(*argv, "--node-rank", "0")
    node1 = Launcher(*argv, "--node-rank", "1", go=str(go))  # imports now, joins on `go`
    _wait_for([node0], _updated_at(2, 1), 120, "update 1 at world size 2")
    go.write_text("")
    joined = time.monotonic()
    codes = [node.finish(timeout=180) for node in (node0, node1)]
    assert codes == [0, 0], [(node.stdout()[-3000:], "".join(node.err)[-3000:]) for node in (node0, node1)]
    log = node0.stdout() + node1.stdout()
    _print_key_lines(log)
    saved = re.findall(r"SIGTERM: saved checkpoint at update (\d+)", log)
    assert len(saved) == 1 and 1 <= int(saved[0]) < UPDATES, log[-4000:]
    changed = _CHANGED.findall(log)
    assert changed == [("2", "4", saved[0], saved[0], str(save / "checkpoint_last"), "2", "1")], changed
    assert "restart 1 of" not in log  # a membership change is no restart
    assert _records(log) == straight[4][1]
    params, extra = checkpoint_params(corpus_dir, save / "checkpoint_last")
    assert extra["world_size"] == 4 and extra["train_state"]["num_updates"] == UPDATES
    _assert_same_params(params, straight[4][0], "grown run vs straight 4-rank run")
    _assert_same_params(params, straight[2][0], "grown run vs straight 2-rank run")
    print(f"grow: {joined - start:.1f} s to the join, {time.monotonic() - joined:.1f} s from the join to the end")


def test_save_on_sigterm_stops_saves_and_resumes_exactly(corpus_dir, tmp_path):
    """2 ranks, --save-on-sigterm: SIGTERM to the launcher's process group after update 2 ->
    checkpoint_last at an update boundary, exit 143 within seconds (not torch's 30 s SIGKILL);
    resumed, SIGTERM to the ranks alone -> the same; resumed to the end -> the parameters and
    losses of an uninterrupted run, bit for bit."""
    from fullshard import checkpoint

    args = [str(corpus_dir), *SMALL, "--max-update", "16", "--nproc-per-node", "2"]
    plain = run_cli("train", *args, "--save-dir", str(tmp_path / "plain"), timeout=300)
    assert plain.returncode == 0, plain.stderr[-3000:]
    want = _records(plain.stdout)
    run = [*args, "--save-dir", str(tmp_path / "ck"), "--save-on-sigterm"]
    stops = []
    for target, after in (("group", 2), ("ranks", 0)):
        launcher = Launcher(*run)
        _wait_for([launcher], lambda text: any(n > after for n in _records(text)) and
                  (not stops or any(n > stops[-1] for n in _records(text))), 120, "an update")
        sent = time.monotonic()
        if target == "group":
            launcher.signal_group(signal.SIGTERM)
        else:
            ranks = launcher.ranks()
            assert len(ranks) == 2, ranks
            for pid in ranks:
                os.kill(pid, signal.SIGTERM)
        assert launcher.finish(timeout=120) == 128 + signal.SIGTERM, "".join(launcher.err)[-3000:]
        took = time.monotonic() - sent
        saved = re.findall(r"SIGTERM: saved checkpoint at update (\d+)", launcher.stdout())
        assert len(saved) == 1 and int(saved[0]) < 16, launcher.stdout()[-3000:]
        stops.append(int(saved[0]))
        last = "".join(launcher.err).strip().splitlines()[-1]
        assert last == ("fullshard train: stopped by SIGTERM after the ranks saved checkpoint_last; the same "
                        "command resumes from the last checkpoint" if target == "group" else
                        f"fullshard train: stopped by SIGTERM after saving checkpoint_last at update {stops[-1]}; "
                        "the same command resumes from it"), last
        assert took < 20, took  # the ranks leave by themselves, long before torch's 30 s SIGKILL
        checkpoint.verify(str(tmp_path / "ck" / "checkpoint_last"))
        got = _records(launcher.stdout())
        assert got == {n: want[n] for n in got}
    assert stops[0] < stops[1], stops
    rest = run_cli("train", *run, timeout=300)
    assert rest.returncode == 0, rest.stderr[-3000:]
    assert f"@ {stops[1]} updates, saved by 2 ranks" in rest.stdout and "world size changed" not in rest.stdout
    assert _records(rest.stdout) == {n: want[n] for n in want if n > stops[1]}
    params, extra = checkpoint_params(corpus_dir, tmp_path / "ck" / "checkpoint_last")
    assert extra["train_state"]["num_updates"] == 16
    _assert_same_params(params, checkpoint_params(corpus_dir, tmp_path / "plain" / "checkpoint_last")[0],
                        "resumed twice after SIGTERM vs uninterrupted")


def test_elastic_range_needs_a_global_batch_every_world_size_divides(corpus_dir, tmp_path, capsys):
    """--nnodes MIN:MAX: without --global-batch-size, or with one that a world size of the range
    does not divide, one line and exit 2; a valid range gives a config."""
    from fullshard.cli import main
    from fullshard.train.options import parse_train_args

    base = [str(corpus_dir), *SMALL, "--nproc-per-node", "2", "--rdzv-endpoint", "127.0.0.1:29400",
            "--save-dir", str(tmp_path / "ck")]
    cases = [(["--nnodes", "1:2"], ["--nnodes 1:2 needs --global-batch-size: an elastic job restarts at another "
                                    "world size"]),
             (["--nnodes", "1:3", "--global-batch-size", "8"],
              ["--global-batch-size 8 is not", "--batch-size 2 x 6 ranks", "can run at 2, 4, 6 ranks"]),
             (["--nnodes", "2:3", "--global-batch-size", "12"],
              ["--global-batch-size 12 is not", "--batch-size 2 x 4 ranks", "can run at 4, 6 ranks"])]
    for extra, expected in cases:
        with pytest.raises(SystemExit) as info:
            main(["train", *base, *extra])
        err = capsys.readouterr().err
        assert info.value.code == 2 and err.count("\n") == 1 and all(x in err for x in expected), (extra, err)
    assert not (tmp_path / "ck").exists()
    cfg = parse_train_args([*base, "--nnodes", "1:2", "--global-batch-size", "8"])
    assert (cfg.nnodes, cfg.global_batch_size) == ("1:2", 8)
    assert json.loads(json.dumps(cfg.to_dict()))["nnodes"] == "1:2"
