"""`fullshard bench --lora` (fullshard/bench/lora.py) without launching: its flags become a LoraJob or one
error line (the GPT bench's flags refused; QLoRA rows at a world size whose NF4 scaler blocks do not
split), and the report's table takes the max over ranks, sums the ranks' trainable shards, shows a failed
row's own error and each fullshard row's loss difference to its torch row; an NF4 weight's bytes are
its inner tensors'."""
from __future__ import annotations

import argparse

import pytest
import torch

from fullshard.bench import lora, measure, suite


class _Fail(Exception):
    pass


def _job(*argv):
    p = argparse.ArgumentParser()
    suite.add_args(p)
    args = p.parse_args(["--lora", *argv])

    def fail(msg):
        raise _Fail(msg)

    return lora.job_from_args(args, fail)


def test_flags_make_the_job_or_one_error():
    job = _job()
    assert job.modes == tuple(lora.LORA_MODES) and job.world_size == 2 and job.timed_steps == lora.LoraJob().timed_steps
    job = _job("--modes", "lora_bf16,fsdp2_lora_bf16", "--timed-steps", "3", "--world-size", "4", "--seq-len", "32")
    assert job.modes == ("lora_bf16", "fsdp2_lora_bf16")
    assert (job.timed_steps, job.world_size, job.seq_len) == (3, 4, 32)
    for argv, msg in ((("--modes", "full,lora_bf16"), "unknown --modes full"),
                      (("--arch", "transformer_lm_gpt_tiny"), "--arch is for the GPT bench"),
                      (("--optimizer", "muon"), "--optimizer is for the GPT bench"),
                      (("--timed-steps", "0"), "--timed-steps must be >= 1")):
        with pytest.raises(_Fail, match=msg):
            _job(*argv)


def _row(step_s, ag, rs, peak, trainable, loss=8.0):
    return dict(step_s=step_s, losses=[9.0, loss], peak_bytes=peak, trainable_numel=trainable, param_bytes=2 ** 20,
                grad_bytes=2 ** 19, optim_bytes=2 ** 20, all_gather_bytes_per_step=ag,
                reduce_scatter_bytes_per_step=rs)


def test_report_takes_max_over_ranks_and_shows_errors():
    job = lora.LoraJob(modes=("lora_bf16", "fsdp2_lora_bf16"))
    mib = 2 ** 20
    results = [{"rank": 0, "rows": [_row(0.5, 15 * mib, mib // 10, 60 * mib, 14000, 8.25),
                                    {"mode": "fsdp2_lora_bf16", "error": "another rank failed"}]},
               {"rank": 1, "rows": [_row(0.7, 15 * mib, mib // 5, 70 * mib, 14672),
                                    {"mode": "fsdp2_lora_bf16", "error": "ValueError: refused"}]}]
    lines = lora.format_report(results, job)
    assert lines[0].split()[:2] == ["row", "trainable"]
    ours = next(ln for ln in lines if ln.startswith("fullshard LoRA, bf16 base"))
    assert ours.split()[-7:] == ["28,672", "0.700", "15.000", "0.200", "70.00", "2.50", "8.2500"], ours
    torch_row = next(ln for ln in lines if ln.startswith("torch FSDP2 + PEFT, bf16 base"))
    assert "ERROR rank 1: ValueError: refused" in torch_row


def test_qlora_rows_only_where_nf4_blocks_split():
    assert {"qlora", "fsdp2_qlora"} <= set(_job().modes) and not _job().note
    job = _job("--world-size", "4")  # k_proj 128 x 256: 8,192 elements per rank, half a scaler block
    assert "qlora" not in job.modes and "fsdp2_qlora" not in job.modes and "lora_bf16" in job.modes
    assert "QLoRA rows left out" in job.note and "128 x 256" in job.note, job.note
    with pytest.raises(_Fail, match="--modes qlora: a 128 x 256 weight does not split into whole NF4 scaler blocks"):
        _job("--modes", "qlora,lora_bf16", "--world-size", "4")


def test_report_compares_each_fullshard_row_loss_with_torch():
    job = lora.LoraJob(modes=("qlora", "lora_bf16", "fsdp2_qlora", "fsdp2_lora_bf16"))
    mib = 2 ** 20
    row = lambda loss: _row(0.5, mib, mib, mib, 100, loss)  # noqa: E731
    results = [{"rank": r, "rows": [row(8.0), row(8.0), row(8.0 + 5e-5 * r), row(8.001)]} for r in range(2)]
    assert lora.loss_diffs(results, job) == pytest.approx({"qlora": 5e-5, "lora_bf16": 1e-3})
    last = next(ln for ln in lora.format_report(results, job) if ln.startswith("loss vs torch"))
    assert "qlora 5e-05," in last and "lora_bf16 0.001 MISMATCH" in last, last
    results[1]["rows"][2] = {"mode": "fsdp2_qlora", "error": "ValueError: refused"}
    assert set(lora.loss_diffs(results, job)) == {"lora_bf16"}  # a failed torch row is not compared


def test_nf4_parameter_bytes_are_its_inner_tensors():
    to_nf4 = pytest.importorskip("torchao.quantization").to_nf4
    lin = torch.nn.Linear(256, 256, bias=False).to(torch.bfloat16)
    lin.weight = torch.nn.Parameter(to_nf4(lin.weight.detach(), 64, 256), requires_grad=False)
    # codes 4 bits, an int8 scale per 64, a bf16 factor per 64 x 256, the bf16 scaler mean and 16-entry table
    assert measure.param_bytes(lin) == 256 * 256 // 2 + 256 * 256 // 64 + 4 * 2 + 2 + 16 * 2
