"""The validated training configuration handed to every rank.

`TrainConfig` is built once, on the launching process, from the parsed and
checked command line (see `options.py`); it is a frozen, picklable dataclass so
the elastic launcher can hand it to spawned ranks unchanged.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional, Tuple


@dataclass(frozen=True)
class TrainConfig:
    """Everything one rank needs to train. Field names follow fairseq-train flags."""

    data_dir: str
    """Directory written by `fullshard preprocess` (holds meta.json and the splits)."""
    arch: str
    """Model architecture name, a key of `fullshard.models.ARCHS`."""
    max_positions: int
    """Positions the architecture supports (size of its positional table), tokens."""
    vocab_size: int
    """Vocabulary size read from the data directory's meta.json."""
    ddp_backend: str
    """'fully_sharded' (fullshard FSDP) or 'c10d' (torch DistributedDataParallel)."""
    reshard_after_forward: bool
    """FULL_SHARD when True, SHARD_GRAD_OP when False (--no-reshard-after-forward)."""
    tokens_per_sample: int
    """Sequence length T of one sample, tokens."""
    batch_size: int
    """Sequences per rank per micro-batch."""
    update_freq: int
    """Micro-batches accumulated per optimizer update (gradient accumulation)."""
    dropout: float
    """Dropout probability inside the model."""
    adam_betas: Tuple[float, float]
    """AdamW (beta1, beta2)."""
    adam_eps: float
    """AdamW epsilon."""
    weight_decay: float
    """Decoupled weight decay, applied to >=2-D weights only."""
    lr: float
    """Peak learning rate."""
    lr_scheduler: str
    """One of polynomial_decay, inverse_sqrt, cosine, fixed."""
    warmup_updates: int
    """Linear warmup length, updates."""
    total_num_update: int
    """Updates over which polynomial_decay / cosine anneal (0 = use max_update)."""
    end_learning_rate: float
    """Final learning rate of polynomial_decay / cosine."""
    power: float
    """Exponent of polynomial_decay."""
    max_update: int
    """Stop after this many updates (0 = no limit)."""
    max_epoch: int
    """Stop after this many epochs (0 = no limit)."""
    clip_norm: float
    """Clip the global gradient L2 norm to this value (0 = off; gnorm still computed)."""
    seed: int
    """Seed for model initialization, data order and dropout."""
    log_format: str
    """Resolved log format: json, simple or tqdm."""
    log_interval: int
    """Log a train_inner record every this many updates."""
    log_file: Optional[str]
    """Also write the log lines to this file (rank 0), or None."""
    log_memory: bool
    """Add mem_* fields (`fullshard.memory_stats` totals, MiB, max over ranks of the largest value
    sampled after each micro-batch's forward and backward) to train_inner lines; fully_sharded only."""
    validate_interval_updates: int
    """Validate every this many updates (0 = only at end of epoch / training)."""
    save_dir: str
    """Directory for checkpoint_last/ and checkpoint_<epoch>_<updates>/ (fullshard.checkpoint layout)."""
    no_save: bool
    """Write no checkpoint when True."""
    nproc_per_node: int
    """Ranks to launch on this machine."""
    decoder_layers: Optional[int] = None
    """Transformer blocks L, overriding the arch's (--decoder-layers); None = the arch's. `validate`
    stores the effective value, so checkpoints record the shape they were trained with."""
    decoder_embed_dim: Optional[int] = None
    """Model width C, overriding the arch's (--decoder-embed-dim); None = the arch's."""
    decoder_attention_heads: Optional[int] = None
    """Attention heads, dividing the width (--decoder-attention-heads); None = the arch's."""
    decoder_ffn_embed_dim: Optional[int] = None
    """MLP hidden width (--decoder-ffn-embed-dim); None = 4 x the effective width."""
    fp16: bool = False
    """Compute in float16 with dynamic loss scaling (fully_sharded: MixedPrecision(fp16, fp32 reduce,
    fp16 buffers); c10d: torch.autocast). Master parameters and optimizer state stay fp32."""
    bf16: bool = False
    """Compute in bfloat16 (fully_sharded: MixedPrecision(bf16, fp32 reduce, bf16 buffers); c10d:
    torch.autocast). No loss scaling: bf16 has fp32's exponent range."""
    fp16_init_scale: float = 128.0
    """Initial loss scale with fp16 (fairseq --fp16-init-scale)."""
    fp16_scale_window: int = 2**14
    """Clean updates before the loss scale doubles (fairseq --fp16-scale-window; resolved from
    fairseq's 2**14 / world size / update_freq rule when not given)."""
    min_loss_scale: float = 1e-4
    """Backing the loss scale off to this or below stops training with FloatingPointError."""
    cpu_offload: bool = False
    """fully_sharded only: keep parameter and gradient shards and the optimizer step on the host
    (CPUOffload(offload_params=True))."""
    checkpoint_activations: bool = False
    """Recompute each transformer block's activations in backward instead of storing them."""
    offload_activations: bool = False
    """Also keep the checkpointed block inputs in host memory (implies checkpoint_activations)."""
    accumulate_mode: str = "no_sync"
    """How --update-freq accumulates: 'no_sync' (micro-batches keep unsharded gradients locally;
    one reduce-scatter per update; Psi more gradient elements per rank) or 'reduce_scatter'
    (every micro-batch reduce-scatters into the gradient shards; K times the communication)."""

    save_interval_updates: int = 0
    """Also save checkpoint_<epoch>_<updates> every this many updates (0 = only at the end)."""
    keep_interval_updates: int = -1
    """Keep only the newest this many interval checkpoints (-1 = keep all)."""
    restore_file: str = "checkpoint_last"
    """Checkpoint directory to resume from: a path, or a name inside save_dir; used when it exists."""
    reset_optimizer: bool = False
    """Resume the model only: fresh optimizer state, update counter 0."""
    reset_dataloader: bool = False
    """Resume at epoch 1, first batch, instead of the saved data position."""
    reset_lr_scheduler: bool = False
    """Keep the fresh lr scheduler instead of the saved one."""
    reset_meters: bool = False
    """Start the train meters from zero instead of the saved ones."""
    finetune_from_model: Optional[str] = None
    """Initial weights (consolidated .pt/.safetensors file, or a checkpoint directory) when there is
    nothing to resume in save_dir."""

    collective_timeout_s: float = 300.0
    """Deadline of every collective, seconds: a rank waiting longer exits naming the collective,
    its unit and the ranks that did not arrive (--collective-timeout)."""
    debug_collectives: bool = False
    """Before each collective, check that every rank issues the same one (--debug-collectives)."""
    debug: bool = False
    """Print tracebacks instead of one-line errors (--debug)."""
    on_save_error: str = "stop"
    """After a failed checkpoint save: 'stop' training (exit 1) or 'continue' without that checkpoint."""
    max_restarts: int = 0
    """Restarts of all ranks the launcher makes after a rank fails; each resumes from checkpoint_last."""
    nnodes: int = 1
    """Nodes (launchers) taking part; >1 joins --rdzv-endpoint's c10d rendezvous."""
    node_rank: int = 0
    """This launcher's node number (0 hosts the rendezvous store)."""
    rdzv_endpoint: str = "localhost:0"
    """host:port of the c10d rendezvous (port 0: a free port, single node only)."""
    rdzv_timeout_s: float = 900.0
    """Seconds to wait for all nodes to join the rendezvous."""
    optimizer: str = "adam"
    """'adam' (AdamW) or 'cpu_adam' (AdamW stepping on host shards with torch's fused CPU kernel)."""
    hybrid_shard: bool = False
    """HYBRID_SHARD: shard within a node, replicate across nodes."""

    def arch_spec(self):
        """The model's shape, a `fullshard.models.ArchSpec`: ``arch`` with the decoder_* overrides.

        Raises:
            ValueError: unknown ``arch`` or an invalid shape (`validate` reports these first).
        """
        from fullshard.models import arch_spec

        return arch_spec(self.arch).override(self.decoder_layers, self.decoder_embed_dim,
                                             self.decoder_attention_heads, self.decoder_ffn_embed_dim)

    def to_dict(self) -> dict:
        """Plain-Python copy (for checkpoints)."""
        return dataclasses.asdict(self)
