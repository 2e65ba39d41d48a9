"""A plain decoder-only GPT: pre-LayerNorm blocks, learned positions, tied embeddings.

Architecture as fairseq's ``transformer_lm_gpt3_*`` (see :mod:`.config`) with
pre-LayerNorm blocks and a final LayerNorm (GPT-2, Radford et al. 2019, §2.3).
This module never imports the sharding engine: parallelism is applied from
outside, so a GPT stays an ordinary ``nn.Module``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .config import ArchSpec, GPTConfig, make_config
from .init import init_param_


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention with a fused QKV projection.

    Args:
        config: Model shape; uses ``embed_dim``, ``num_heads``, ``dropout``.
    """

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        self.dropout_p = config.dropout
        self.qkv_proj = nn.Linear(config.embed_dim, 3 * config.embed_dim)
        self.out_proj = nn.Linear(config.embed_dim, config.embed_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Attends each position to itself and earlier positions.

        Args:
            x: Float tensor (B, T, C).

        Returns:
            Float tensor (B, T, C).
        """
        B, T, C = x.shape
        q, k, v = self.qkv_proj(x).split(C, dim=-1)
        # (B, T, C) -> (B, H, T, C/H)
        q, k, v = (t.view(B, T, self.num_heads, C // self.num_heads).transpose(1, 2)
                   for t in (q, k, v))
        dropout_p = self.dropout_p if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True)
        return self.out_proj(y.transpose(1, 2).reshape(B, T, C))


class FeedForward(nn.Module):
    """Position-wise MLP: Linear(C, F) -> GELU -> Linear(F, C).

    Args:
        config: Model shape; uses ``embed_dim`` and ``ffn_embed_dim``.
    """

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.fc1 = nn.Linear(config.embed_dim, config.ffn_embed_dim)
        self.fc2 = nn.Linear(config.ffn_embed_dim, config.embed_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Maps (B, T, C) floats to (B, T, C) floats."""
        return self.fc2(F.gelu(self.fc1(x)))


def _dropout(p: float) -> nn.Module:
    # Identity when off, so a dropout-free model has no Dropout modules at all.
    return nn.Dropout(p) if p > 0 else nn.Identity()


class TransformerBlock(nn.Module):
    """Pre-LayerNorm decoder block.

    ``x = x + attn(ln_1(x)); x = x + mlp(ln_2(x))`` (GPT-2, Radford et al.
    2019, §2.3), with dropout on both residual branches when
    ``config.dropout > 0``.

    Args:
        config: Model shape.
    """

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.embed_dim)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.embed_dim)
        self.mlp = FeedForward(config)
        self.dropout = _dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Maps (B, T, C) floats to (B, T, C) floats."""
        x = x + self.dropout(self.attn(self.ln_1(x)))
        return x + self.dropout(self.mlp(self.ln_2(x)))


class GPT(nn.Module):
    """Decoder-only transformer language model.

    Parameter count Ψ = V·C + P·C + L·(12·C² + 13·C) + 2·C for vocabulary V,
    positions P, width C, layers L (the tied output projection counted once).

    Attributes:
        config: The model shape.
        embed_tokens: Token embedding, weight (V, C).
        embed_positions: Learned position embedding, weight (P, C).
        layers: ``L`` :class:`TransformerBlock` modules.
        layer_norm: Final LayerNorm.
        output_projection: Linear C -> V without bias; its weight is the same
            ``nn.Parameter`` as ``embed_tokens.weight`` (tied).

    Args:
        config: The model shape.
    """

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.embed_dim)
        self.embed_positions = nn.Embedding(config.max_positions, config.embed_dim)
        self.dropout = _dropout(config.dropout)
        self.layers = nn.ModuleList(TransformerBlock(config) for _ in range(config.num_layers))
        self.layer_norm = nn.LayerNorm(config.embed_dim)
        self.output_projection = nn.Linear(config.embed_dim, config.vocab_size, bias=False)
        self.tie_weights()

    def tie_weights(self) -> None:
        """Makes ``output_projection.weight`` the same Parameter as ``embed_tokens.weight``."""
        self.output_projection.weight = self.embed_tokens.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Computes next-token logits.

        Args:
            tokens: Integer token ids (B, T), int64 (or int32).

        Returns:
            Logits (B, T, V) in the parameters' dtype.

        Raises:
            ValueError: ``tokens`` is not 2-D, or T > ``config.max_positions``.
        """
        if tokens.dim() != 2:
            raise ValueError(f"GPT expects tokens of shape (B, T), got {tuple(tokens.shape)}")
        T = tokens.shape[1]
        if T > self.config.max_positions:
            raise ValueError(
                f"sequence length {T} exceeds max_positions {self.config.max_positions}")
        positions = torch.arange(T, device=tokens.device)
        x = self.dropout(self.embed_tokens(tokens) + self.embed_positions(positions))
        for layer in self.layers:
            x = layer(x)
        return self.output_projection(self.layer_norm(x))

    def init_weights(self, seed: int) -> None:
        """Initializes every parameter in place, deterministically from ``seed``.

        See [Note: per-row generators] in :mod:`.init`: each parameter's
        values depend only on ``seed`` and its qualified name, so this equals a
        deferred per-module init with :func:`make_param_init_fn`. The tied
        weight is initialized once, as ``embed_tokens.weight``.

        Args:
            seed: Init seed.

        Raises:
            ValueError: Parameters are still on the meta device.
        """
        # named_parameters() yields a tied Parameter once, under its first name.
        for qualname, param in self.named_parameters():
            if param.is_meta:
                raise ValueError(
                    f"{qualname} is on the meta device; materialize it first "
                    f"(make_param_init_fn, or build_model(device=...))")
            module_name, _, local = qualname.rpartition(".")
            init_param_(param, self.get_submodule(module_name), local, qualname,
                        seed, self.config.num_layers)


def num_params(model: nn.Module) -> int:
    """Counts parameters, each shared (tied) Parameter once.

    Works on meta-device models (no memory needed).

    Args:
        model: Any module.

    Returns:
        Ψ, the number of scalar parameters.
    """
    return sum(p.numel() for p in model.parameters())


def build_model(arch: str | ArchSpec, vocab_size: int, max_positions: int,
                device: torch.device | str | None = None, seed: int | None = None,
                dropout: float = 0.0) -> GPT:
    """Builds a GPT of a named architecture or of a shape.

    With ``device="meta"`` no storage is allocated, so even
    ``transformer_lm_gpt3_175`` builds instantly (for Ψ or deferred init).
    With a seed and a real device, the model is built on meta, materialized
    on ``device`` and initialized with :meth:`GPT.init_weights`, so PyTorch's
    default init never runs. Without a seed it gets PyTorch's default init.

    Args:
        arch: A key of :data:`ARCHS`, or an :class:`ArchSpec` (a named
            shape with overrides, ``ARCHS[name].override(num_layers=30)``).
        vocab_size: Number of token ids V.
        max_positions: Longest sequence in tokens.
        device: Where to build; ``None`` means the current default (CPU).
        seed: Init seed; ignored on the meta device.
        dropout: Dropout probability (0.0 disables dropout).

    Returns:
        The model, in training mode.

    Raises:
        ValueError: Unknown ``arch`` (the message lists known names) or an
            invalid size.
    """
    config = make_config(arch, vocab_size, max_positions, dropout)
    device = torch.device(device) if device is not None else torch.get_default_device()
    if device.type == "meta" or seed is None:
        with device:
            return GPT(config)
    with torch.device("meta"):
        model = GPT(config)
    model.to_empty(device=device)
    model.tie_weights()  # to_empty gives each slot its own Parameter
    model.init_weights(seed)
    return model
