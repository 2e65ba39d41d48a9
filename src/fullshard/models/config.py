"""GPT configuration and the named architectures.

The GPT-3 family reproduces fairseq's ``transformer_lm_gpt3_*`` architectures
(``fairseq/models/transformer_lm.py``: ``base_gpt3_architecture`` and the
``transformer_lm_gpt3_{small,medium,large,xl,2_7,6_7,13,175}`` registrations),
which in turn follow Brown et al. 2020, "Language Models are Few-Shot
Learners", Table 2.1: learned positions, GELU, FFN = 4 x width, tied
input/output embeddings, no dropout.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class GPTConfig:
    """Shape of a decoder-only transformer language model.

    Attributes:
        num_layers: Number of transformer blocks (fairseq ``decoder_layers``).
        embed_dim: Model width C (fairseq ``decoder_embed_dim``).
        num_heads: Attention heads; must divide ``embed_dim``.
        ffn_embed_dim: Hidden width of the MLP, 4 * ``embed_dim`` for every
            named architecture (fairseq ``decoder_ffn_embed_dim``).
        vocab_size: Number of token ids V (50257 for the GPT-2 BPE).
        max_positions: Longest sequence, in tokens, the learned position
            table covers (fairseq ``max_target_positions``).
        dropout: Dropout probability for embeddings, attention weights and
            residual branches; 0.0 (the GPT-3 default) disables every dropout.

    Raises:
        ValueError: On a non-positive size, ``num_heads`` not dividing
            ``embed_dim``, or ``dropout`` outside [0, 1).
    """

    num_layers: int
    embed_dim: int
    num_heads: int
    ffn_embed_dim: int
    vocab_size: int
    max_positions: int
    dropout: float = 0.0

    def __post_init__(self) -> None:
        for name in ("num_layers", "embed_dim", "num_heads", "ffn_embed_dim",
                     "vocab_size", "max_positions"):
            if getattr(self, name) <= 0:
                raise ValueError(f"GPTConfig.{name} must be positive, got {getattr(self, name)}")
        if self.embed_dim % self.num_heads != 0:
            raise ValueError(
                f"GPTConfig.num_heads={self.num_heads} must divide embed_dim={self.embed_dim}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"GPTConfig.dropout must be in [0, 1), got {self.dropout}")

    @property
    def head_dim(self) -> int:
        """Width of one attention head, ``embed_dim // num_heads``."""
        return self.embed_dim // self.num_heads


@dataclass(frozen=True)
class ArchSpec:
    """A named architecture without the data-dependent sizes (vocab, positions).

    Attributes:
        num_layers: Number of transformer blocks.
        embed_dim: Model width C.
        num_heads: Attention heads.
    """

    num_layers: int
    embed_dim: int
    num_heads: int

    @property
    def ffn_embed_dim(self) -> int:
        """MLP hidden width: 4 x width, as fairseq's ``base_gpt3_architecture``."""
        return 4 * self.embed_dim


ARCHS: dict[str, ArchSpec] = {
    # fairseq transformer_lm_gpt3_* (comments: fairseq's nominal sizes).
    "transformer_lm_gpt3_small": ArchSpec(12, 768, 12),      # 125M
    "transformer_lm_gpt3_medium": ArchSpec(24, 1024, 16),    # 350M
    "transformer_lm_gpt3_large": ArchSpec(24, 1536, 16),     # 760M
    "transformer_lm_gpt3_xl": ArchSpec(24, 2048, 32),        # 1.3B
    "transformer_lm_gpt3_2_7": ArchSpec(32, 2560, 32),       # 2.7B
    "transformer_lm_gpt3_6_7": ArchSpec(32, 4096, 32),       # 6.7B
    "transformer_lm_gpt3_13": ArchSpec(40, 5120, 40),        # 13B
    "transformer_lm_gpt3_175": ArchSpec(96, 12288, 96),      # 175B
    # CPU-sized; with the 50257 vocab most parameters are the embedding.
    "transformer_lm_gpt_tiny": ArchSpec(4, 128, 4),
    "transformer_lm_gpt_mini": ArchSpec(2, 64, 2),
    # CPU-sized member of the GPT-3 family: gpt_tiny's shape with the family's 2048
    # positions, so fairseq's GPT-3 commands (--tokens-per-sample 2048) run on a CPU.
    "transformer_lm_gpt3_tiny": ArchSpec(4, 128, 4),
}


def make_config(arch: str, vocab_size: int, max_positions: int,
                dropout: float = 0.0) -> GPTConfig:
    """Builds the :class:`GPTConfig` of a named architecture.

    Args:
        arch: A key of :data:`ARCHS`.
        vocab_size: Number of token ids V.
        max_positions: Longest sequence in tokens.
        dropout: Dropout probability (0.0 disables dropout).

    Returns:
        The frozen config.

    Raises:
        ValueError: ``arch`` is unknown (the message lists the known names),
            or a size is invalid.
    """
    spec = ARCHS.get(arch)
    if spec is None:
        raise ValueError(f"unknown arch {arch!r}; known archs: {', '.join(ARCHS)}")
    return GPTConfig(num_layers=spec.num_layers, embed_dim=spec.embed_dim,
                     num_heads=spec.num_heads, ffn_embed_dim=spec.ffn_embed_dim,
                     vocab_size=vocab_size, max_positions=max_positions, dropout=dropout)
