"""`fullshard bench`'s pipeline modes (``pp2``, ``pp2_unsharded``): the job's GPT in
pp = 2 x dp = N / 2 (torch's 1F1B schedule over ``fully_shard`` stages), trained by
`fullshard train --pipeline-parallel-size 2`'s pipeline (:class:`fullshard.train.pipeline.Pipeline`),
on the same global batch as the data-parallel modes, so its row reads against ``fully_shard``
(dp = N) and DDP.

Rank ``r`` is pipeline rank ``r // D`` and data-parallel rank ``c = r % D`` (D = N / 2). The
pipeline of column ``c`` trains on the sequences the data-parallel modes give ranks ``2c`` and
``2c + 1`` (2B per micro-batch, split into 2B pipeline micro-batches of one sequence), so every
step's global batch is theirs. Its loss is the last stage's: every rank reports the step's global
mean (summed over the world once, after the timed steps), which the report compares with the
mean over ranks of DDP's losses. The tied embedding crosses the stages as in training (its two
gradient shards summed by an all-reduce, the last stage's copy overwritten after the step). The
optimizer is the bench's AdamW on every parameter of the rank's stage (the tied copy excluded).
"""
from __future__ import annotations

import torch

from fullshard import ShardedGradScaler
from fullshard.bench import measure
from fullshard.bench.modes import Job, Mode
from fullshard.core import collectives
from fullshard.train.config import TrainConfig
from fullshard.train.pipeline import Pipeline

PIPELINE_SIZE = 2
"""P of the pipeline modes."""
SCHEDULE = "1F1B"


def data_parallel_size(job: Job, mode: Mode) -> int:
    """Ranks a unit shards over: N / P in a pipeline mode, N otherwise."""
    return job.world_size // PIPELINE_SIZE if mode.pipeline else job.world_size


def config(job: Job, mode: Mode) -> TrainConfig:
    """The `fullshard train` configuration of ``mode``'s pipeline: the job's GPT (4C MLP, no
    dropout), ``P x B`` sequences per micro-batch in ``P x B`` pipeline micro-batches."""
    m = job.model
    per_pipeline = PIPELINE_SIZE * job.batch_size
    return TrainConfig(data_dir="unused", arch="transformer_lm_gpt_tiny", decoder_layers=m.num_layers,
                       decoder_embed_dim=m.embed_dim, decoder_attention_heads=m.num_heads,
                       decoder_ffn_embed_dim=4 * m.embed_dim, vocab_size=m.vocab_size, max_positions=m.max_positions,
                       tokens_per_sample=job.seq_len, batch_size=per_pipeline, seed=job.seed, fsdp_version=2,
                       threads_per_rank=job.threads, pipeline_parallel_size=PIPELINE_SIZE, pipeline_schedule=SCHEDULE,
                       pipeline_microbatches=per_pipeline, pipeline_grad_accumulation=mode.pipeline)


def make_batches(job: Job, rank: int, batches_of) -> list:
    """Per step, ``job.update_freq`` (input, target) micro-batches (P x B, T) int64: the
    sequences ``batches_of(job, r)`` gives the data-parallel ranks ``r`` of this rank's column."""
    column = rank % (job.world_size // PIPELINE_SIZE)
    parts = [batches_of(job, column * PIPELINE_SIZE + i) for i in range(PIPELINE_SIZE)]
    return [[tuple(torch.cat([p[s][j][t] for p in parts]) for t in range(2)) for j in range(job.update_freq)]
            for s in range(len(parts[0]))]


class PipelineTrainer:
    """The pipeline and its optimizer, as ``fullshard.bench.rank``'s trainers: ``step``,
    ``state_bytes``, ``notes``; ``global_losses`` after the timed steps."""

    def __init__(self, job: Job, mode: Mode, build_optimizer) -> None:
        self.pipeline = Pipeline(config(job, mode), torch.device("cpu"))
        self.pipeline.scaler = ShardedGradScaler(enabled=False)  # fp32: the loss as it is
        self.model = self.pipeline.model
        self.optimizer = build_optimizer(job, self.pipeline.optim_model)
        self.notes: list[str] = []
        self._rows: list[torch.Tensor] = []

    def step(self, micro_batches: list) -> float:
        """One optimizer step over the micro-batches; returns this rank's mean token loss (the
        last stage's; 0.0 on the others)."""
        self.optimizer.zero_grad(set_to_none=True)
        self.model.zero_grad(set_to_none=True)  # the tied copy's gradient too
        row = torch.zeros(2, dtype=torch.float64)
        for x, y in micro_batches:
            loss_sum, ntokens, _ = self.pipeline.train_micro_batch(x, y, len(micro_batches))
            row += torch.tensor([loss_sum, ntokens], dtype=torch.float64)
        self.pipeline.tie_gradients()
        self.optimizer.step()
        self.pipeline.sync_tied_weight()
        self._rows.append(row)
        return float(row[0] / row[1]) if row[1] else 0.0

    def global_losses(self) -> list[float]:
        """Every step's mean token loss over the global batch (one all-reduce over the world; call
        after the collective counters are read)."""
        rows = torch.stack(self._rows)
        collectives.all_reduce(rows, collectives.world_group(), "sum", tag="bench pipeline losses")
        return (rows[:, 0] / rows[:, 1]).tolist()

    def state_bytes(self) -> dict[str, int]:
        return dict(param_bytes=measure.param_bytes(self.model), grad_bytes=measure.grad_bytes(self.model),
                    optim_bytes=measure.optim_state_bytes(self.optimizer))
