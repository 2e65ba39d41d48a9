"""`fullshard bench --lora` (fullshard/bench/lora.py) without launching: its flags become a LoraJob or one
error line (the GPT bench's flags refused), and the report's table takes the max over ranks, sums the
ranks' trainable shards, and shows a failed row's own error."""
from __future__ import annotations

import argparse

import pytest

from fullshard.bench import lora, suite


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
