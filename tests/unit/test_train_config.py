"""`fullshard train`'s flags declared once: the option groups build the parsers of train, plan and
eval-lm and TrainConfig; a command line gives the config it gave before; checkpoints' recorded
arguments of today's format still load; an architecture's positions come from its ArchSpec."""
from __future__ import annotations

import dataclasses
import json

import pytest

from fullshard.models import ARCHS, ArchSpec
from fullshard.train.config import DEFAULT_FSDP_VERSION, TRAIN_GROUPS, TrainConfig, node_range
from fullshard.train.flags import flag_fields, option_string
from fullshard.train.options import (
    OneLineArgumentParser,
    _resolve_log_format,
    add_train_args,
    config_from_args,
    resolve_arch,
)

# TrainConfig.to_dict() as checkpoints record it before the flags were grouped (captured from that
# code for `fullshard train data-bin/wiki --arch transformer_lm_gpt_mini --fp16 --lr 0.001
# --adam-betas '(0.9,0.98)' --decoder-layers 3` at 2 ranks, with the effective shape and json logs).
SAVED_BEFORE = {
    'data_dir': 'data-bin/wiki', 'arch': 'transformer_lm_gpt_mini', 'max_positions': 512, 'vocab_size': 50257,
    'ddp_backend': 'fully_sharded', 'reshard_after_forward': True, 'tokens_per_sample': 1024, 'batch_size': 8,
    'update_freq': 1, 'dropout': 0.0, 'adam_betas': (0.9, 0.98), 'adam_eps': 1e-08, 'weight_decay': 0.0,
    'lr': 0.001, 'lr_scheduler': 'fixed', 'warmup_updates': 0, 'total_num_update': 0, 'end_learning_rate': 0.0,
    'power': 1.0, 'max_update': 0, 'max_epoch': 0, 'clip_norm': 0.0, 'seed': 1, 'log_format': 'json',
    'log_interval': 100, 'log_file': None, 'log_memory': False, 'validate_interval_updates': 0,
    'save_dir': 'checkpoints', 'no_save': False, 'nproc_per_node': 1, 'decoder_layers': 3, 'decoder_embed_dim': 64,
    'decoder_attention_heads': 2, 'decoder_ffn_embed_dim': 256, 'fp16': True, 'bf16': False,
    'fp16_init_scale': 128.0, 'fp16_scale_window': 8192, 'min_loss_scale': 0.0001, 'cpu_offload': False,
    'checkpoint_activations': False, 'offload_activations': False, 'accumulate_mode': 'no_sync',
    'save_interval_updates': 0, 'keep_interval_updates': -1, 'restore_file': 'checkpoint_last',
    'reset_optimizer': False, 'reset_dataloader': False, 'reset_lr_scheduler': False, 'reset_meters': False,
    'finetune_from_model': None, 'collective_timeout_s': 300.0, 'debug_collectives': False, 'debug': False,
    'on_save_error': 'stop', 'start_method': None, 'max_restarts': 0, 'nnodes': 1, 'node_rank': 0,
    'rdzv_endpoint': 'localhost:0',
    'rdzv_timeout_s': 900.0, 'optimizer': 'adam', 'hybrid_shard': False}
# Fields added since, at their defaults (a run without them behaves as before).
NEW_FIELDS = {"global_batch_size": None, "world_size_invariant": False, "threads_per_rank": None,
              # --optimizer muon | adafactor | lamb (issue 19): torch's defaults, fairseq's for lamb
              "muon_momentum": 0.95, "muon_nesterov": True, "muon_ns_coefficients": (3.4445, -4.775, 2.0315),
              "muon_eps": 1e-7, "muon_ns_steps": 5, "muon_adjust_lr_fn": "original", "adafactor_beta2_decay": -0.8,
              "adafactor_eps": (None, 1e-3), "adafactor_d": 1.0, "lamb_betas": (0.9, 0.999), "lamb_eps": 1e-8,
              # --pipeline-* (issue 28): no pipelining
              "pipeline_parallel_size": 1, "pipeline_schedule": "1F1B", "pipeline_microbatches": None,
              "pipeline_stages_per_rank": 1, "pipeline_split": "even", "pipeline_grad_accumulation": "reduce_scatter",
              # --hf-model, LoRA (issue 29)
              "hf_model": None, "save_hf": None, "lora_rank": 0, "lora_alpha": 8.0, "lora_dropout": 0.0,
              "lora_target_modules": None, "merge_lora": False, "base_dtype": "fp32", "quantize_base": "none"}
ELASTIC_DEFAULTS = {"rdzv_last_call_s": 30, "rdzv_keep_alive_s": 5, "save_on_sigterm": False}
"""Flags added after SAVED_BEFORE was captured, at their defaults (--nnodes became text then)."""
ARGV = ["data-bin/wiki", "--arch", "transformer_lm_gpt_mini", "--fp16", "--lr", "0.001", "--adam-betas", "(0.9,0.98)",
        "--decoder-layers", "3", "--log-format", "json"]


def _train_parser() -> OneLineArgumentParser:
    p = OneLineArgumentParser(prog="fullshard train")
    add_train_args(p)
    return p


def _config(argv, **kw) -> TrainConfig:
    args = _train_parser().parse_args(argv)
    values = dict(shape=resolve_arch(args.arch, vars(args)), vocab_size=50257, world_size=2, scale_window=8192)
    return config_from_args(args, **{**values, **kw})


def test_the_train_parser_is_the_config_fields():
    """Every flag of `fullshard train` is one TrainConfig field (its dest), in one --help group per
    option group; the only other fields are the sizes read from the arch and the data."""
    p = _train_parser()
    dests = [a.dest for a in p._actions if a.dest != "help"]
    flags = [f.name for f in flag_fields(TrainConfig)]
    assert sorted(dests) == sorted(flags) and len(dests) == len(set(dests))
    assert {f.name for f in dataclasses.fields(TrainConfig)} - set(flags) == {"max_positions", "vocab_size"}
    titles = [g.title for g in p._action_groups][2:]  # after "positional arguments" and "options"
    assert titles == [g.TITLE for g in TRAIN_GROUPS] == ["model", "distributed", "pipeline", "mixed precision",
                                                         "dataset", "optimization", "logging and checkpoints",
                                                         "Hugging Face fine-tuning"]
    for f in flag_fields(TrainConfig):
        assert f.metadata["fullshard.flag"].help, f"{f.name} has no help text"
    assert option_string(TrainConfig, "collective_timeout_s") == "--collective-timeout"
    assert option_string(TrainConfig, "reshard_after_forward") == "--no-reshard-after-forward"


def test_every_flag_value_reaches_the_config():
    """A value given for each flag arrives in TrainConfig under its field (no hand copy to forget
    one), except the values `validate` resolves from others."""
    argv, want = ["DATA"], {"data_dir": "DATA"}
    for f in flag_fields(TrainConfig):
        spec = f.metadata["fullshard.flag"]
        option = option_string(TrainConfig, f.name)
        if spec.positional or f.name in ("decoder_layers", "decoder_embed_dim", "decoder_attention_heads",
                                         "decoder_ffn_embed_dim", "arch"):
            continue  # the shape: tested below
        if isinstance(f.default, bool):
            argv.append(option.replace("--", "--no-", 1) if spec.negatable and f.default else option)
            want[f.name] = not f.default
        elif spec.choices:
            argv += [option, str(spec.choices[-1])]
            want[f.name] = spec.choices[-1]
        elif f.name in ("adam_betas", "lamb_betas"):
            argv += [option, "(0.5,0.75)"]
            want[f.name] = (0.5, 0.75)
        elif f.name == "adafactor_eps":
            argv += [option, "(None,0.5)"]
            want[f.name] = (None, 0.5)
        elif f.name == "muon_ns_coefficients":
            argv += [option, "(1,-2,3.5)"]
            want[f.name] = (1.0, -2.0, 3.5)
        elif f.name == "global_batch_size":  # 7 x 7 x 2 ranks: agrees with --update-freq 7 --batch-size 7
            argv += [option, "98"]
            want[f.name] = 98
        elif f.name == "nnodes":
            argv += [option, "2:7"]
            want[f.name] = "2:7"
        elif spec.type is int or isinstance(f.default, int):
            argv += [option, "7"]
            want[f.name] = 7
        elif spec.type is float or isinstance(f.default, float):
            argv += [option, "0.25"]
            want[f.name] = 0.25
        else:
            argv += [option, f"text_{f.name}"]
            want[f.name] = f"text_{f.name}"
    cfg = _config(argv, scale_window=11, rdzv_endpoint="h:1")
    resolved = {"fp16_scale_window": 11, "rdzv_endpoint": "h:1", "checkpoint_activations": True,
                "log_format": _resolve_log_format("tqdm")}  # tqdm needs a terminal
    want.update(resolved)
    got = {k: getattr(cfg, k) for k in want}
    assert got == want
    assert (cfg.max_positions, cfg.vocab_size) == (ARCHS["transformer_lm_gpt_tiny"].max_positions, 50257)


def test_a_command_line_gives_the_config_it_gave_before():
    """The same argv gives the same recorded arguments as before the groups (plus --task and the
    resolved --fsdp-version)."""
    assert _config(ARGV).to_dict() == {**SAVED_BEFORE, "task": "language_modeling",
                                       "fsdp_version": DEFAULT_FSDP_VERSION, **NEW_FIELDS, **ELASTIC_DEFAULTS,
                                       "nnodes": "1"}


def test_recorded_arguments_of_todays_format_still_load():
    """`from_saved` reads a checkpoint's args of today's format, also through JSON (the header of a
    consolidated .safetensors) and from an older run that lacks later fields."""
    for saved in (SAVED_BEFORE, json.loads(json.dumps(SAVED_BEFORE))):
        cfg = TrainConfig.from_saved(saved)  # from before --fsdp-version: the default version
        assert cfg.to_dict() == {**SAVED_BEFORE, "task": "language_modeling", "fsdp_version": DEFAULT_FSDP_VERSION,
                                 **NEW_FIELDS, **ELASTIC_DEFAULTS}
        assert node_range(cfg.nnodes) == (1, 1)  # recorded as an int before MIN:MAX
        assert cfg.arch_spec() == ARCHS["transformer_lm_gpt_mini"].override(num_layers=3)
    older = {k: v for k, v in SAVED_BEFORE.items() if k not in ("hybrid_shard", "optimizer", "rdzv_endpoint")}
    cfg = TrainConfig.from_saved({**older, "a_field_of_the_future": 1}, rdzv_endpoint="localhost:0")
    assert (cfg.hybrid_shard, cfg.optimizer, cfg.rdzv_endpoint, cfg.lr) == (False, "adam", "localhost:0", 0.001)
    cfg = TrainConfig.from_saved({}, data_dir="d", max_positions=16, vocab_size=97, fp16_scale_window=1)
    assert (cfg.arch, cfg.batch_size, cfg.fp16_scale_window) == ("transformer_lm_gpt_tiny", 8, 1)
    with pytest.raises(TypeError):
        TrainConfig.from_saved({"arch": "transformer_lm_gpt_mini"})  # no data_dir, sizes


def test_optimizer_flags_round_trip_through_a_checkpoints_json():
    """The tuple-valued optimizer flags come back as tuples from JSON (lists there), None kept."""
    cfg = _config(ARGV + ["--optimizer", "adafactor", "--adafactor-eps", "(None,0.01)", "--lamb-betas", "(0.8,0.9)",
                          "--muon-ns-coefficients", "(3,-4,2)"])
    again = TrainConfig.from_saved(json.loads(json.dumps(cfg.to_dict())))
    assert again == cfg and again.adafactor_eps == (None, 0.01) and again.muon_ns_coefficients == (3.0, -4.0, 2.0)


def test_max_positions_is_the_archs():
    """Positions live on ArchSpec: the named archs' tables, kept by the --decoder-* overrides, and
    honoured for an arch that declares its own (before, every arch not in a hard-coded list got 2048)."""
    assert ARCHS["transformer_lm_gpt_tiny"].max_positions == 1024
    assert ARCHS["transformer_lm_gpt_mini"].max_positions == 512
    assert {ARCHS[a].max_positions for a in ARCHS if a.startswith("transformer_lm_gpt3")} == {2048}
    assert ARCHS["transformer_lm_gpt_mini"].override(num_layers=3, embed_dim=96, num_heads=4).max_positions == 512
    assert resolve_arch("transformer_lm_gpt_mini", {"decoder_layers": 3}).max_positions == 512
    with pytest.raises(ValueError, match="max_positions must be positive"):
        ArchSpec(2, 64, 2, max_positions=0)


def test_plan_sizes_an_archs_own_position_table(monkeypatch, capsys):
    from fullshard import cli

    monkeypatch.setitem(ARCHS, "test_short", ArchSpec(2, 64, 2, max_positions=128))
    with pytest.raises(SystemExit) as info:
        cli.main(["plan", "--arch", "test_short", "--world-size", "2", "--tokens-per-sample", "256"])
    err = capsys.readouterr().err
    assert info.value.code == 2 and err.count("\n") == 1
    assert "--tokens-per-sample 256 exceeds the 128 positions of --arch test_short" in err
    assert cli.main(["plan", "--arch", "test_short", "--world-size", "2", "--tokens-per-sample", "64",
                     "--vocab-size", "100"]) == 0
    c = 64  # Ψ = V·C + P·C + L·(12C² + 13C) + 2C with the arch's P = 128 positions
    assert f"Ψ={100 * c + 128 * c + 2 * (12 * c * c + 13 * c) + 2 * c:,}" in capsys.readouterr().out


def test_keep_interval_updates_zero_keeps_every_interval_checkpoint(tmp_path):
    """--keep-interval-updates: N > 0 keeps the last N interval checkpoints; 0 and -1 keep all (fairseq's
    meaning; 0 deleted the checkpoints the log had just announced as saved)."""
    from fullshard.train.checkpoint_utils import _prune

    for name in ("checkpoint_1_2", "checkpoint_1_4", "checkpoint_last"):
        (tmp_path / name).mkdir()
    for keep in (-1, 0):
        _prune(str(tmp_path), keep)
        assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint_1_2", "checkpoint_1_4", "checkpoint_last"]
    _prune(str(tmp_path), 1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint_1_4", "checkpoint_last"]


def test_resumed_meters_divide_by_the_time_their_counts_took():
    """A resumed run's first wps/ups: the restored interval's tokens over the seconds they took plus the time
    since the load (fairseq's TimeMeter), not over the age of the new process (which includes the model build)."""
    import time

    import torch

    from fullshard.train.checkpoint_utils import _meters_state, _restore_meters
    from fullshard.train.progress import UpdateMeters

    saved = UpdateMeters()
    saved.start = time.perf_counter() - 10.0  # 10 s of training before the save
    saved.add(3.0, 1000, 8, 1.0, 10.0)
    state = _meters_state(saved)
    resumed = UpdateMeters()
    resumed.start = time.perf_counter() - 100.0  # the new process is 100 s old at the load
    _restore_meters(resumed, state)
    wps = resumed.stats(1, 1e-3, torch.device("cpu"), 0.0)["wps"]
    assert 90 < wps <= 100, wps  # 1000 tokens / ~10 s; the old code gave 1000 / ~100 s
