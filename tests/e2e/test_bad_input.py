"""Bad input, tried: each malformed `fullshard train` command line gives one line on stderr, exit
code 2 and writes nothing. In-process (validation runs before any rank starts), so the table is
fast; the seeds' fairseq-train commands (with a CPU-sized --arch) are accepted."""
from __future__ import annotations

import json
import os
import shutil

import pytest

ARCH = "transformer_lm_gpt_mini"


@pytest.fixture(scope="module")
def paths(corpus_dir, tmp_path_factory):
    """Data directories broken in different ways, plus a checkpoint of another model."""
    import torch.nn as nn

    from fullshard import checkpoint

    root = tmp_path_factory.mktemp("bad")
    out = {"data": str(corpus_dir), "missing": str(root / "nope"), "file": str(root / "a_file")}
    (root / "a_file").write_text("x")
    (root / "nometa").mkdir()
    out["nometa"] = str(root / "nometa")
    meta = json.loads((corpus_dir / "meta.json").read_text())

    def variant(name, edit_meta=None, edit_dir=None):
        d = root / name
        shutil.copytree(corpus_dir, d)
        if edit_meta:
            m = json.loads(json.dumps(meta))
            edit_meta(m)
            (d / "meta.json").write_text(json.dumps(m))
        if edit_dir:
            edit_dir(d)
        out[name] = str(d)

    variant("badjson", edit_dir=lambda d: (d / "meta.json").write_text("{not json"))
    variant("novalid", edit_meta=lambda m: m["splits"].pop("valid"))
    variant("empty", edit_meta=lambda m: m["splits"]["train"].update(num_tokens=0))
    variant("tiny", edit_meta=lambda m: m["splits"]["train"].update(num_tokens=100))
    variant("tinyvalid", edit_meta=lambda m: m["splits"]["valid"].update(num_tokens=10))
    variant("truncated", edit_dir=lambda d: (d / "train.bin").write_bytes((d / "train.bin").read_bytes()[:1000]))
    variant("baddtype", edit_meta=lambda m: m.update(dtype="int8"))
    variant("oddsize", edit_dir=lambda d: (d / "train.bin").write_bytes((d / "train.bin").read_bytes()[:1001]))
    other = root / "other" / "checkpoint_last"
    checkpoint.save(str(other), nn.Linear(4, 3))
    out["other"] = str(other)
    out["save_other"] = str(root / "other")
    # A checkpoint of ARCH as an older run records it (the arch only): 2 layers, width 64, 2 heads.
    from fullshard.models import build_model

    mini = build_model(ARCH, vocab_size=int(meta["vocab_size"]), max_positions=512, device="cpu")
    checkpoint.save(str(root / "mini" / "checkpoint_last"), mini, extra={"args": {"arch": ARCH}})
    out["save_mini"] = str(root / "mini")
    # The same, trained on data of another tokenizer (checkpoints record the data's).
    checkpoint.save(str(root / "gpt2" / "checkpoint_last"), mini,
                    extra={"args": {"arch": ARCH}, "tokenizer": "gpt2-bpe"})
    out["save_gpt2"], out["gpt2_ckpt"] = str(root / "gpt2"), str(root / "gpt2" / "checkpoint_last")
    return out


CASES = [  # (argv after DATA or with {placeholders}, expected text in the one line)
    (["{data}", "--arch", "transformer_lm_gpt_huge"], "unknown --arch"),
    (["{data}", "--tokens-per-sample", "0"], "--tokens-per-sample must be >= 1"),
    (["{data}", "--tokens-per-sample", "abc"], "invalid int value: 'abc'"),
    (["{data}", "--tokens-per-sample", "4096"], "exceeds the 512 positions"),
    (["{data}", "--batch-size", "0"], "--batch-size must be >= 1"),
    (["{data}", "--batch-size", "-3"], "--batch-size must be >= 1"),
    (["{data}", "--update-freq", "0"], "--update-freq must be >= 1"),
    (["{data}", "--lr", "0"], "--lr must be > 0"),
    (["{data}", "--lr=-1e-3"], "--lr must be > 0"),
    (["{data}", "--seed=-1"], "--seed must be in [0, 2**32)"),
    (["{data}", "--keep-interval-updates=-5"], "--keep-interval-updates must be >= -1"),
    (["{data}", "--save-interval", "1"], "unrecognized arguments: --save-interval 1"),  # not --save-interval-updates
    (["{data}", "--dropout", "1.5"], "--dropout must be in [0, 1)"),
    (["{data}", "--adam-betas", "(0.9)"], "expected a pair"),
    (["{data}", "--adam-betas", "fast"], "expected a pair"),
    (["{data}", "--lr-scheduler", "triangular"], "invalid choice: 'triangular'"),
    (["{data}", "--lr-scheduler", "polynomial_decay"], "needs --total-num-update or --max-update"),
    (["{data}", "--lr-scheduler", "cosine", "--warmup-updates", "10", "--total-num-update", "5"], "must exceed"),
    (["{data}", "--fp16", "--bf16"], "mutually exclusive"),
    (["{data}", "--cpu-offload", "--ddp-backend", "c10d"], "--cpu-offload needs --ddp-backend fully_sharded"),
    (["{data}", "--ddp-backend", "horovod"], "invalid choice: 'horovod'"),
    (["{data}", "--fp16-init-scale", "0"], "--fp16-init-scale must be > 0"),
    (["{data}", "--fp16-scale-window", "0"], "--fp16-scale-window must be >= 1"),
    (["{data}", "--max-update", "-1"], "--max-update must be >= 0"),
    (["{data}", "--save-interval-updates", "-1"], "--save-interval-updates must be >= 0"),
    (["{data}", "--collective-timeout", "0"], "--collective-timeout must be > 0"),
    (["{data}", "--max-restarts", "-1"], "--max-restarts must be >= 0"),
    (["{data}", "--task", "translation"], "invalid choice: 'translation'"),
    (["{data}", "--optimizer", "sgd"], "invalid choice: 'sgd'"),
    # --optimizer muon | adafactor | lamb: torch's ranges, and no flag of another optimizer
    (["{data}", "--muon-momentum", "0.9"],
     "--muon-momentum is a flag of --optimizer muon, this run has --optimizer adam"),
    (["{data}", "--optimizer", "adafactor", "--adam-betas", "(0.9,0.98)"],
     "--adam-betas is a flag of --optimizer adam and muon, this run has --optimizer adafactor"),
    (["{data}", "--optimizer", "muon", "--lamb-eps", "1e-6"], "--lamb-eps is a flag of --optimizer lamb"),
    (["{data}", "--optimizer", "lamb", "--no-muon-nesterov"], "--muon-nesterov is a flag of --optimizer muon"),
    (["{data}", "--optimizer", "lamb", "--lamb-betas", "(0.9,1.5)"], "--lamb-betas must be two numbers in [0, 1)"),
    (["{data}", "--optimizer", "muon", "--muon-ns-steps", "0"], "--muon-ns-steps must be in [1, 100), got 0"),
    (["{data}", "--optimizer", "muon", "--muon-momentum=-0.1"], "--muon-momentum must be >= 0"),
    (["{data}", "--optimizer", "muon", "--muon-adjust-lr-fn", "sqrt"], "invalid choice: 'sqrt'"),
    (["{data}", "--optimizer", "muon", "--muon-ns-coefficients", "(1,2)"], "expected three numbers"),
    (["{data}", "--optimizer", "adafactor", "--adafactor-eps", "(1e-3)"], "expected a pair like '(None,1e-3)'"),
    (["{data}", "--optimizer", "adafactor", "--adafactor-eps", "(None,-1)"], "--adafactor-eps must be"),
    (["{data}", "--optimizer", "adafactor", "--adafactor-d", "0.5"], "--adafactor-d must be >= 1"),
    (["{data}", "--optimizer", "adafactor", "--adafactor-beta2-decay", "0.8"], "--adafactor-beta2-decay must be <= 0"),
    (["{data}", "--optimizer", "lamb", "--world-size-invariant"], "--world-size-invariant with --optimizer lamb"),
    (["{data}", "--save-dir", "{save_mini}", "--optimizer", "muon"],
     "it was trained with --optimizer adam, this run has --optimizer muon; add --reset-optimizer"),
    (["{data}", "--no-such-flag"], "unrecognized arguments: --no-such-flag"),
    (["{data}", "--nnodes", "2"], "needs --rdzv-endpoint HOST:PORT"),
    (["{data}", "--nnodes", "2", "--node-rank", "2", "--rdzv-endpoint", "h:1"], "--node-rank must be in"),
    (["{data}", "--rdzv-endpoint", "no-port"], "is not HOST:PORT"),
    (["{data}", "--nnodes", "1:2"], "--nnodes 1:2 needs --rdzv-endpoint HOST:PORT"),
    (["{data}", "--nnodes", "2:1", "--rdzv-endpoint", "h:1"], "--nnodes 2:1: MIN must not exceed MAX"),
    (["{data}", "--nnodes", "0:2", "--rdzv-endpoint", "h:1"], "--nnodes must be >= 1, got 0:2"),
    (["{data}", "--nnodes", "1:2:3"], "argument --nnodes: expected N or MIN:MAX (e.g. 2 or 1:4), got '1:2:3'"),
    (["{data}", "--nnodes", "1:2", "--node-rank", "2", "--rdzv-endpoint", "h:1"], "--node-rank must be in [0, 2)"),
    (["{data}", "--nnodes", "1:2", "--rdzv-endpoint", "h:1"], "--nnodes 1:2 needs --global-batch-size"),
    (["{data}", "--rdzv-last-call", "0"], "--rdzv-last-call must be >= 1 second, got 0"),
    (["{data}", "--save-on-sigterm", "--no-save"], "--save-on-sigterm and --no-save are exclusive"),
    (["{data}", "--hybrid-shard", "--ddp-backend", "c10d"], "--hybrid-shard needs --ddp-backend fully_sharded"),
    (["{data}", "--fsdp-version", "3"], "argument --fsdp-version: invalid choice: 3 (choose from 1, 2)"),
    (["{data}", "--fsdp-version", "two"], "argument --fsdp-version: invalid int value: 'two'"),
    (["{data}", "--fsdp-version", "2", "--ddp-backend", "c10d"], "--fsdp-version 2 needs --ddp-backend fully_sharded"),
    (["{missing}"], "does not exist"),
    (["{file}"], "does not exist"),
    (["{nometa}"], "no meta.json"),
    (["{badjson}"], "meta.json is not valid JSON"),
    (["{novalid}"], "no 'valid' split"),
    (["{empty}"], "fewer than one batch"),
    (["{tiny}"], "fewer than one batch"),
    (["{tinyvalid}"], "fewer than one sample"),
    (["{truncated}"], "train"),
    (["{baddtype}"], "records token dtype 'int8', not one of uint16, uint32; rerun `fullshard preprocess`"),
    (["{oddsize}"], "train.bin holds 1,001 bytes, not a whole number of uint16 token ids"),
    (["{data}", "--nproc-per-node", "64", "--batch-size", "64"], "x 64 ranks"),
    (["{data}", "--save-dir", "{file}"], "exists and is not a directory"),
    (["{data}", "--log-file", "{nometa}"], "is a directory"),
    (["{data}", "--log-file", "{file}/train.log"], "is a file"),
    (["{data}", "--finetune-from-model", "{missing}"], "does not exist"),
    (["{data}", "--restore-file", "{missing}"], "does not exist"),
    (["{data}", "--restore-file", "{file}"], "is not a checkpoint directory"),
    (["{data}", "--save-dir", "{save_other}"], "is of another model"),
    (["{data}", "--decoder-layers", "0"], "--decoder-layers must be >= 1, got 0"),
    (["{data}", "--decoder-embed-dim", "-64"], "--decoder-embed-dim must be >= 1, got -64"),
    (["{data}", "--decoder-attention-heads", "0"], "--decoder-attention-heads must be >= 1, got 0"),
    (["{data}", "--decoder-ffn-embed-dim", "0"], "--decoder-ffn-embed-dim must be >= 1, got 0"),
    (["{data}", "--decoder-layers", "two"], "invalid int value: 'two'"),
    (["{data}", "--decoder-embed-dim", "96", "--decoder-attention-heads", "5"],
     "--decoder-attention-heads 5 must divide --decoder-embed-dim 96"),
    (["{data}", "--decoder-attention-heads", "3"],
     f"--decoder-attention-heads 3 must divide the width 64 of --arch {ARCH}"),
    (["{data}", "--decoder-embed-dim", "99"],
     f"the 2 attention heads of --arch {ARCH} must divide --decoder-embed-dim 99"),
    # --global-batch-size (--batch-size 4 by default here) and --world-size-invariant
    (["{data}", "--global-batch-size", "6"], "--global-batch-size 6 is not divisible by --batch-size 4 x 1 ranks = 4"),
    (["{data}", "--global-batch-size", "8", "--nproc-per-node", "3"], "--batch-size 4 x 3 ranks = 12"),
    (["{data}", "--global-batch-size", "0"], "--global-batch-size must be >= 1, got 0"),
    (["{data}", "--global-batch-size", "-8"], "--global-batch-size must be >= 1, got -8"),
    (["{data}", "--global-batch-size", "8", "--update-freq", "1"],
     "--update-freq 1 conflicts with --global-batch-size 8"),
    (["{data}", "--global-batch-size", "eight"], "argument --global-batch-size: invalid int value: 'eight'"),
    (["{data}", "--world-size-invariant", "--ddp-backend", "c10d"],
     "--world-size-invariant needs --ddp-backend fully_sharded"),
    (["{data}", "--world-size-invariant", "--global-batch-size", "400000"], "fewer than one global batch of 400000"),
    (["{data}", "--threads-per-rank", "0"], "--threads-per-rank must be >= 1, got 0"),
    # resuming needs the shape the checkpoint was trained with: tensors, and heads (which no tensor shows)
    (["{data}", "--save-dir", "{save_mini}", "--decoder-layers", "3"], "is of another model"),
    (["{data}", "--save-dir", "{save_mini}", "--decoder-attention-heads", "4"],
     "it was trained with 2 layers, width 64, 2 heads, ffn 256, this run has 2 layers, width 64, 4 heads, ffn 256"),
    (["{data}", "--save-dir", "{save_gpt2}"], "it was trained on data preprocessed with the tokenizer gpt2-bpe, "),
    (["{data}", "--finetune-from-model", "{gpt2_ckpt}"],
     "was trained on data preprocessed with the tokenizer gpt2-bpe,"),
    # --pipeline-parallel-size (--arch gpt_mini: 2 layers)
    (["{data}", "--nproc-per-node", "3", "--pipeline-parallel-size", "2"],
     "--pipeline-parallel-size 2 does not divide the world size 3"),
    (["{data}", "--nproc-per-node", "4", "--pipeline-parallel-size", "4"],
     "4 pipeline stages (--pipeline-parallel-size 4 x --pipeline-stages-per-rank 1) for 2 layers"),
    (["{data}", "--nproc-per-node", "4", "--pipeline-parallel-size", "4", "--decoder-layers", "4",
      "--pipeline-microbatches", "2"], "--pipeline-microbatches 2 is smaller than --pipeline-parallel-size 4"),
    (["{data}", "--nproc-per-node", "2", "--pipeline-parallel-size", "2", "--pipeline-schedule", "ZBVZeroBubble"],
     "--pipeline-schedule ZBVZeroBubble needs --pipeline-stages-per-rank 2 (V-shaped"),
    (["{data}", "--nproc-per-node", "2", "--pipeline-parallel-size", "2", "--pipeline-schedule", "ZBVZeroBubble",
      "--pipeline-stages-per-rank", "2", "--world-size-invariant"],
     "--pipeline-schedule ZBVZeroBubble with --world-size-invariant: the invariant fold counts one"),
    (["{data}", "--nproc-per-node", "2", "--pipeline-parallel-size", "2", "--pipeline-schedule", "LoopedBFS",
      "--pipeline-stages-per-rank", "2", "--decoder-layers", "4", "--world-size-invariant"],
     "--pipeline-schedule LoopedBFS with --world-size-invariant: it runs a stage's backwards in descending"),
    (["{data}", "--pipeline-schedule", "GPipe", "--pipeline-split", "auto"],
     "--pipeline-schedule, --pipeline-split: apply only under pipelining; set --pipeline-parallel-size > 1"),
    (["{data}", "--nproc-per-node", "2", "--pipeline-parallel-size", "2", "--pipeline-schedule", "DualPipeV",
      "--pipeline-stages-per-rank", "2", "--decoder-layers", "4", "--pipeline-microbatches", "2"],
     "--pipeline-microbatches 2: DualPipeV needs at least one per stage (4)"),
    (["{data}", "--nproc-per-node", "2", "--pipeline-parallel-size", "2", "--pipeline-split", "2,1"],
     "--pipeline-split 2,1 must give every stage at least one layer and add up to the model's 2 layers"),
    (["{data}", "--nproc-per-node", "2", "--pipeline-parallel-size", "2", "--pipeline-split", "1,1,1"],
     "--pipeline-split 1,1,1 has 3 stages, the run has 2"),
    (["{data}", "--nproc-per-node", "2", "--pipeline-parallel-size", "2", "--pipeline-schedule", "Interleaved1F1B"],
     "--pipeline-schedule Interleaved1F1B needs --pipeline-stages-per-rank >= 2"),
    (["{data}", "--nproc-per-node", "2", "--pipeline-parallel-size", "2", "--fsdp-version", "1",
      "--pipeline-schedule", "Interleaved1F1B", "--pipeline-stages-per-rank", "2", "--decoder-layers", "4"],
     "--pipeline-schedule Interleaved1F1B with --fsdp-version 1: a rank's several stage wrappers"),
    (["{data}", "--nproc-per-node", "2", "--pipeline-parallel-size", "2", "--fsdp-version", "1", "--hybrid-shard"],
     "--pipeline-parallel-size 2 does not support --hybrid-shard with --fsdp-version 1"),
    (["{data}", "--nproc-per-node", "2", "--pipeline-parallel-size", "2", "--hybrid-shard", "--world-size-invariant"],
     "--pipeline-parallel-size 2 does not support --hybrid-shard with --world-size-invariant"),
    (["{data}", "--nproc-per-node", "2", "--pipeline-parallel-size", "2", "--pipeline-microbatches", "3"],
     "--batch-size 4 is not divisible by --pipeline-microbatches 3"),
    (["{data}", "--nproc-per-node", "2", "--pipeline-parallel-size", "2", "--hf-model", "{missing}"],
     "--pipeline-parallel-size 2 does not support --hf-model: stages are cut from fullshard's GPT"),
    (["{data}", "--start-method", "thread"], "argument --start-method: invalid choice: 'thread'"),
]


def test_bad_inputs_one_line_exit_2_nothing_written(paths, tmp_path, capsys):
    from fullshard.cli import main

    assert len(CASES) >= 30
    failures = []
    for argv, expected in CASES:
        work = tmp_path / "work"
        work.mkdir()
        argv = [a.format(**paths) for a in argv]
        defaults = [("--arch", ARCH), ("--tokens-per-sample", "64"), ("--batch-size", "4"),
                    ("--save-dir", str(work / "ck")), ("--log-file", str(work / "train.log"))]
        argv += [x for flag, value in defaults if flag not in argv for x in (flag, value)]
        cwd = os.getcwd()
        os.chdir(work)
        try:
            with pytest.raises(SystemExit) as info:
                main(["train", *argv])
        finally:
            os.chdir(cwd)
        err = capsys.readouterr().err
        lines = err.strip().splitlines()
        ok = info.value.code == 2 and len(lines) == 1 and lines[0].startswith("fullshard train: error: ") \
            and expected in lines[0] and "Traceback" not in err and list(work.iterdir()) == []
        if not ok:
            failures.append((argv[:3], expected, info.value.code, err))
        shutil.rmtree(work)
    assert not failures, "\n".join(map(str, failures))
    # torchrun's variable for the default --start-method is checked like a flag
    os.environ["PET_START_METHOD"] = "thread"
    try:
        with pytest.raises(SystemExit) as info:
            main(["train", paths["data"], "--arch", ARCH, "--save-dir", str(tmp_path / "ck")])
    finally:
        del os.environ["PET_START_METHOD"]
    err = capsys.readouterr().err
    assert info.value.code == 2 and err == ("fullshard train: error: PET_START_METHOD='thread' is not a start "
                                            "method (spawn, fork, forkserver); fix or unset it, or give "
                                            "--start-method\n"), err
    assert not (tmp_path / "ck").exists()
    # RANK and WORLD_SIZE without LOCAL_RANK: each process launched its own one-rank job
    os.environ.update(RANK="0", WORLD_SIZE="2")
    try:
        with pytest.raises(SystemExit) as info:
            main(["train", paths["data"], "--arch", ARCH, "--save-dir", str(tmp_path / "ck")])
    finally:
        del os.environ["RANK"], os.environ["WORLD_SIZE"]
    err = capsys.readouterr().err
    assert info.value.code == 2 and err.startswith("fullshard train: error: RANK, WORLD_SIZE set but not "
                                                   "LOCAL_RANK: set all three as torchrun does"), err
    assert not (tmp_path / "ck").exists()


def test_a_train_split_of_exactly_one_batch_is_accepted(corpus_dir, tmp_path):
    """B samples of T tokens need B * T + 1 tokens (they overlap by one); B * (T + 1) was asked, refusing
    splits that hold a whole batch."""
    from fullshard.train.options import OneLineArgumentParser, add_train_args, validate

    tokens = json.loads((corpus_dir / "meta.json").read_text())["splits"]["train"]["num_tokens"]
    batch = (tokens - 1) // 64
    assert batch * 65 > tokens  # the old count refused it
    p = OneLineArgumentParser(prog="fullshard train")
    add_train_args(p)
    argv = [str(corpus_dir), "--arch", ARCH, "--tokens-per-sample", "64", "--save-dir", str(tmp_path / "ck")]
    assert validate(p, p.parse_args([*argv, "--batch-size", str(batch)])).batch_size == batch
    with pytest.raises(SystemExit):
        validate(p, p.parse_args([*argv, "--batch-size", str(batch + 1)]))


def test_ctrl_c_under_save_on_sigterm_claims_no_save(monkeypatch, capsys):
    """Ranks save on SIGTERM only: a SIGINT stop does not say they saved (it did, and no save was made)."""
    import signal
    import types

    from fullshard import cli
    from fullshard.train.launcher import Interrupted

    job = types.SimpleNamespace(save_on_sigterm=True)
    for sig, says in ((signal.SIGINT, False), (signal.SIGTERM, True)):
        monkeypatch.setattr(cli, "launch", lambda job, entry, sig=sig: (_ for _ in ()).throw(Interrupted(sig)))
        assert cli._launch("train", job, None) == 128 + sig
        err = capsys.readouterr().err
        assert ("after the ranks saved checkpoint_last" in err) == says, err


SEED_COMMAND = """fullshard train data-bin/wikitext-103-roberta-bpe-bin \\
    --ddp-backend fully_sharded --fp16 --fp16-init-scale 4 \\
    --cpu-offload --checkpoint-activations \\
    --task language_modeling --tokens-per-sample 2048 --batch-size 8 \\
    --arch transformer_lm_gpt3_tiny \\
    --optimizer cpu_adam --adam-betas "(0.9,0.98)" \\
    --lr 0.0001 --lr-scheduler polynomial_decay --warmup-updates 5 --total-num-update 10 \\
    --max-update 10 --no-save --log-format json --log-interval 1"""


def test_seed_commands_are_accepted_and_fp16_warns_once(tmp_path, capsys, monkeypatch):
    """The seeds' two fairseq-train commands (identical once the GPU environment variables are
    dropped) with a CPU-sized --arch: --task language_modeling and --optimizer cpu_adam accepted,
    one warning that --bf16 is faster on a CPU."""
    import shlex

    from fullshard.train import options

    data = tmp_path / "data-bin" / "wikitext-103-roberta-bpe-bin"
    data.mkdir(parents=True)
    meta = {"format_version": 1, "tokenizer": "gpt2-bpe", "vocab_size": 50257, "eos_id": 50256,
            "dtype": "uint16", "splits": {s: {"file": f"{s}.bin", "num_tokens": n, "num_documents": 1}
                                          for s, n in (("train", 40000), ("valid", 4000))}}
    (data / "meta.json").write_text(json.dumps(meta))
    for s, n in (("train", 40000), ("valid", 4000)):
        (data / f"{s}.bin").write_bytes(b"\0\0" * n)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(options, "_FP16_WARNED", [])
    argv = shlex.split(SEED_COMMAND.replace("\\\n", " "))[2:]
    cfg = options.parse_train_args(argv)
    assert cfg.optimizer == "cpu_adam" and cfg.fp16 and cfg.cpu_offload and cfg.tokens_per_sample == 2048
    options.parse_train_args(argv)
    err = capsys.readouterr().err
    assert err.count("--bf16 is much faster here") == 1 and len(err.splitlines()) == 1, err


def test_global_batch_size_derives_update_freq(corpus_dir, tmp_path, monkeypatch):
    """--global-batch-size with an --update-freq that agrees is accepted; the config records both."""
    from fullshard.train import options

    monkeypatch.chdir(tmp_path)
    base = [str(corpus_dir), "--arch", ARCH, "--tokens-per-sample", "64", "--batch-size", "2", "--nproc-per-node", "2"]
    for extra, invariant in (([], False), (["--update-freq", "3"], False), (["--world-size-invariant"], True)):
        cfg = options.parse_train_args(base + ["--global-batch-size", "12"] + extra)
        assert (cfg.global_batch_size, cfg.update_freq, cfg.world_size_invariant) == (12, 3, invariant)
    cfg = options.parse_train_args(base + ["--update-freq", "2", "--world-size-invariant"])
    assert (cfg.global_batch_size, cfg.update_freq) == (8, 2)  # recorded: restarts keep the global batch
    cfg = options.parse_train_args(base)
    assert (cfg.global_batch_size, cfg.update_freq) == (None, 1)


def test_valid_split_smaller_than_one_batch_is_evaluated(cli, corpus_dir, tmp_path):
    """Fewer than 8 valid samples of 512 tokens for 2 ranks x 4: validated on those (fairseq does), not rejected."""
    from fullshard.data import TokenBlockDataset
    from tests.e2e.common import json_records

    samples = len(TokenBlockDataset(corpus_dir, "valid", 512))
    assert 0 < samples < 8

    proc = cli("train", str(corpus_dir), "--arch", ARCH, "--tokens-per-sample", "512", "--batch-size", "4",
               "--nproc-per-node", "2", "--max-update", "1", "--no-save", "--log-format", "json", timeout=240)
    assert proc.returncode == 0, proc.stderr[-2000:]
    valid = json_records(proc.stdout)["valid"][-1]
    assert valid["valid_wpb"] == str(samples * 512) and float(valid["valid_loss"]) > 0, valid
