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
from typing import Optional


@dataclass(frozen=True)
class GPTConfig:
    """Shape of a decoder-only transformer language model.

    Attributes:
        num_layers: Number of transformer blocks (fairseq ``decoder_layers``).
        embed_dim: Model width C (fairseq ``decoder_embed_dim``).
        num_heads: Attention heads; must divide ``embed_dim``.
        ffn_embed_dim: Hidden width of the MLP, 4 * ``embed_dim`` for every
            named architecture unless overridden (fairseq ``decoder_ffn_embed_dim``).
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


GPT3_MAX_POSITIONS = 2048
"""Positions of fairseq's GPT-3 family (``max_target_positions`` of ``base_gpt3_architecture``)."""


@dataclass(frozen=True)
class ArchSpec:
    """A named model's shape and position table, without the data-dependent vocabulary.

    The values of :data:`ARCHS`, or one of them with fairseq's override flags
    applied (:meth:`override`).

    Attributes:
        num_layers: Number of transformer blocks L.
        embed_dim: Model width C.
        num_heads: Attention heads; must divide ``embed_dim``.
        ffn_embed_dim: MLP hidden width F; ``None`` (the default) becomes
            4 x ``embed_dim`` at construction, as fairseq's
            ``base_gpt3_architecture``.
        max_positions: Longest sequence, in tokens, the architecture's learned
            position table covers (fairseq ``max_target_positions``; 2048 for
            the GPT-3 family). ``fullshard train`` builds the table this size.

    Raises:
        ValueError: On a non-positive size or ``num_heads`` not dividing
            ``embed_dim``.
    """

    num_layers: int
    embed_dim: int
    num_heads: int
    ffn_embed_dim: Optional[int] = None
    max_positions: int = GPT3_MAX_POSITIONS

    def __post_init__(self) -> None:
        if self.ffn_embed_dim is None:
            object.__setattr__(self, "ffn_embed_dim", 4 * self.embed_dim)
        for name in ("num_layers", "embed_dim", "num_heads", "ffn_embed_dim", "max_positions"):
            if getattr(self, name) <= 0:
                raise ValueError(f"ArchSpec.{name} must be positive, got {getattr(self, name)}")
        if self.embed_dim % self.num_heads != 0:
            raise ValueError(f"ArchSpec.num_heads={self.num_heads} must divide embed_dim={self.embed_dim}")

    def override(self, num_layers: Optional[int] = None, embed_dim: Optional[int] = None,
                 num_heads: Optional[int] = None, ffn_embed_dim: Optional[int] = None) -> "ArchSpec":
        """This shape with some sizes replaced (fairseq's ``--decoder-*`` flags).

        ``None`` keeps this shape's value. The FFN width, unless given, is
        4 x the new width when ``embed_dim`` changes (fairseq's
        ``base_gpt3_architecture`` computes it after the overrides), else kept.
        ``max_positions`` is always kept (no fairseq flag overrides it).

        Raises:
            ValueError: The resulting shape is invalid (see the class).
        """
        width = self.embed_dim if embed_dim is None else embed_dim
        if ffn_embed_dim is None:
            ffn_embed_dim = self.ffn_embed_dim if width == self.embed_dim else 4 * width
        return ArchSpec(self.num_layers if num_layers is None else num_layers, width,
                        self.num_heads if num_heads is None else num_heads, ffn_embed_dim, self.max_positions)

    def describe(self) -> str:
        """The shape in words, e.g. ``24 layers, width 1024, 16 heads, ffn 4096``."""
        return (f"{self.num_layers} layers, width {self.embed_dim}, {self.num_heads} heads, "
                f"ffn {self.ffn_embed_dim}")


ARCHS: dict[str, ArchSpec] = {
    # fairseq transformer_lm_gpt3_*, 2048 positions each (comments: fairseq's nominal sizes).
    "transformer_lm_gpt3_small": ArchSpec(12, 768, 12),      # 125M
    "transformer_lm_gpt3_medium": ArchSpec(24, 1024, 16),    # 350M
    "transformer_lm_gpt3_large": ArchSpec(24, 1536, 16),     # 760M
    "transformer_lm_gpt3_xl": ArchSpec(24, 2048, 32),        # 1.3B
    "transformer_lm_gpt3_2_7": ArchSpec(32, 2560, 32),       # 2.7B
    "transformer_lm_gpt3_6_7": ArchSpec(32, 4096, 32),       # 6.7B
    "transformer_lm_gpt3_13": ArchSpec(40, 5120, 40),        # 13B
    "transformer_lm_gpt3_175": ArchSpec(96, 12288, 96),      # 175B
    # CPU-sized, with shorter position tables; with the 50257 vocab most parameters are the embedding.
    "transformer_lm_gpt_tiny": ArchSpec(4, 128, 4, max_positions=1024),
    "transformer_lm_gpt_mini": ArchSpec(2, 64, 2, max_positions=512),
    # CPU-sized member of the GPT-3 family: gpt_tiny's shape with the family's 2048
    # positions, so fairseq's GPT-3 commands (--tokens-per-sample 2048) run on a CPU.
    "transformer_lm_gpt3_tiny": ArchSpec(4, 128, 4, max_positions=GPT3_MAX_POSITIONS),
}


def arch_spec(arch: str | ArchSpec) -> ArchSpec:
    """The shape of ``arch``: ``ARCHS[arch]`` for a name, ``arch`` itself for an :class:`ArchSpec`.

    Raises:
        ValueError: ``arch`` is an unknown name (the message lists the known names).
    """
    if isinstance(arch, ArchSpec):
        return arch
    spec = ARCHS.get(arch)
    if spec is None:
        raise ValueError(f"unknown arch {arch!r}; known archs: {', '.join(ARCHS)}")
    return spec


def make_config(arch: str | ArchSpec, vocab_size: int, max_positions: int,
                dropout: float = 0.0) -> GPTConfig:
    """Builds the :class:`GPTConfig` of a named architecture or of a shape.

    Args:
        arch: A key of :data:`ARCHS`, or an :class:`ArchSpec` (e.g.
            ``ARCHS[name].override(num_layers=30)``).
        vocab_size: Number of token ids V.
        max_positions: Longest sequence in tokens.
        dropout: Dropout probability (0.0 disables dropout).

    Returns:
        The frozen config.

    Raises:
        ValueError: ``arch`` is unknown (the message lists the known names),
            or a size is invalid.
    """
    spec = arch_spec(arch)
    return GPTConfig(num_layers=spec.num_layers, embed_dim=spec.embed_dim,
                     num_heads=spec.num_heads, ffn_embed_dim=spec.ffn_embed_dim,
                     vocab_size=vocab_size, max_positions=max_positions, dropout=dropout)
