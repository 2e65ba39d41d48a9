"""A small Llama-style decoder in torchtitan's shape, for FSDP2 (``fully_shard``) tests and examples.

Token embedding → ``n_layers`` :class:`TransformerBlock` (RMSNorm → causal self-attention with
rotary position embeddings → residual; RMSNorm → SwiGLU feed-forward → residual) → final RMSNorm →
output ``Linear``. Parameter names follow torchtitan's Llama 3 (``layers.0.attention.wq.weight``),
blocks live in an ``nn.ModuleDict`` keyed ``"0"``, ``"1"``, ... so ``fully_shard`` can be applied per
block. Construction does not initialize: build under ``torch.device("meta")``, shard, ``to_empty``,
then call :meth:`Llama.init_weights` (deterministic given torch's global RNG), as torchtitan does.
The rotary table is a non-persistent buffer: it is not in ``state_dict()`` and ``init_weights``
recomputes it, so a model materialized with ``to_empty`` gets correct values.

Plain ``nn.Module``s only (``models/`` never imports the engine).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass(frozen=True)
class LlamaArgs:
    """Model shape; the defaults are a tiny test model (30,880 parameters)."""

    dim: int = 32
    """Model (residual stream) width."""
    n_layers: int = 2
    """Number of transformer blocks."""
    n_heads: int = 4
    """Attention heads; ``dim`` must be a multiple of it (head_dim = dim // n_heads, even)."""
    vocab_size: int = 64
    """Tokens ids are in ``[0, vocab_size)``."""
    max_seq_len: int = 16
    """Longest input sequence (length of the rotary table)."""
    multiple_of: int = 16
    """The SwiGLU hidden width is rounded up to a multiple of this."""
    norm_eps: float = 1e-5
    """RMSNorm epsilon."""
    rope_theta: float = 10000.0
    """Rotary base frequency."""

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def ffn_hidden_dim(self) -> int:
        """torchtitan's rule: 2/3 of 4·dim, rounded up to ``multiple_of``."""
        hidden = int(2 * (4 * self.dim) / 3)
        return self.multiple_of * ((hidden + self.multiple_of - 1) // self.multiple_of)


def rope_table(head_dim: int, seq_len: int, theta: float, device=None) -> torch.Tensor:
    """Rotary angles' cosines and sines.

    Returns:
        float32 tensor of shape ``(seq_len, head_dim // 2, 2)``: ``[..., 0]`` cosines, ``[..., 1]`` sines
        of ``position · theta^(-2i / head_dim)`` (Su et al. 2021, RoFormer, §3.4.2).
    """
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim))
    angles = torch.outer(torch.arange(seq_len, device=device, dtype=torch.float32), inv_freq)
    return torch.stack((angles.cos(), angles.sin()), dim=-1)


def apply_rope(x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """Rotate consecutive pairs ``(x[2i], x[2i+1])`` of ``x`` (B, T, H, D) by the angles of ``table``
    (at least T rows); the same pairing as torchtitan's complex-number form. Returns x's dtype."""
    seq_len = x.shape[1]
    pairs = x.float().unflatten(-1, (-1, 2))  # (B, T, H, D/2, 2)
    cos = table[:seq_len, None, :, 0]  # (T, 1, D/2)
    sin = table[:seq_len, None, :, 1]
    real, imag = pairs[..., 0], pairs[..., 1]
    rotated = torch.stack((real * cos - imag * sin, real * sin + imag * cos), dim=-1)
    return rotated.flatten(-2).type_as(x)


class Attention(nn.Module):
    """Causal multi-head self-attention with rotary embeddings, no biases."""

    def __init__(self, args: LlamaArgs):
        super().__init__()
        self.n_heads = args.n_heads
        self.head_dim = args.head_dim
        self.wq = nn.Linear(args.dim, args.n_heads * args.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, args.n_heads * args.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, args.n_heads * args.head_dim, bias=False)
        self.wo = nn.Linear(args.n_heads * args.head_dim, args.dim, bias=False)

    def init_weights(self, init_std: float) -> None:
        for linear in (self.wq, self.wk, self.wv):
            nn.init.trunc_normal_(linear.weight, mean=0.0, std=0.02)
        nn.init.trunc_normal_(self.wo.weight, mean=0.0, std=init_std)

    def forward(self, x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
        """x: (B, T, dim) → (B, T, dim)."""
        batch, seq_len, _ = x.shape
        q = apply_rope(self.wq(x).view(batch, seq_len, -1, self.head_dim), rope)
        k = apply_rope(self.wk(x).view(batch, seq_len, -1, self.head_dim), rope)
        v = self.wv(x).view(batch, seq_len, -1, self.head_dim)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                             is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(batch, seq_len, -1))


class FeedForward(nn.Module):
    """SwiGLU: ``w2(silu(w1 x) · w3 x)`` (Shazeer 2020, GLU Variants Improve Transformer, §2)."""

    def __init__(self, args: LlamaArgs):
        super().__init__()
        self.w1 = nn.Linear(args.dim, args.ffn_hidden_dim, bias=False)
        self.w2 = nn.Linear(args.ffn_hidden_dim, args.dim, bias=False)
        self.w3 = nn.Linear(args.dim, args.ffn_hidden_dim, bias=False)

    def init_weights(self, init_std: float) -> None:
        nn.init.trunc_normal_(self.w1.weight, mean=0.0, std=0.02)
        for linear in (self.w2, self.w3):
            nn.init.trunc_normal_(linear.weight, mean=0.0, std=init_std)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    """Pre-norm block: ``h = x + attention(norm(x)); out = h + feed_forward(norm(h))``."""

    def __init__(self, layer_id: int, args: LlamaArgs):
        super().__init__()
        self.attention_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.attention = Attention(args)
        self.ffn_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.feed_forward = FeedForward(args)
        # torchtitan's depth-scaled init of the output projections.
        self.weight_init_std = 0.02 / (2 * (layer_id + 1)) ** 0.5

    def init_weights(self) -> None:
        for norm in (self.attention_norm, self.ffn_norm):
            norm.reset_parameters()
        self.attention.init_weights(self.weight_init_std)
        self.feed_forward.init_weights(self.weight_init_std)

    def forward(self, x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), rope)
        return h + self.feed_forward(self.ffn_norm(h))


class Llama(nn.Module):
    """The decoder; ``forward(tokens (B, T) int64) → logits (B, T, vocab_size)`` in the parameters' dtype.

    Raises:
        ValueError: at construction if ``dim`` is not a multiple of ``n_heads`` or head_dim is odd.
    """

    def __init__(self, args: LlamaArgs = LlamaArgs()):
        super().__init__()
        if args.dim % args.n_heads or args.head_dim % 2:
            raise ValueError(f"LlamaArgs: dim {args.dim} must be n_heads {args.n_heads} × an even head_dim")
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.register_buffer("rope", rope_table(args.head_dim, args.max_seq_len, args.rope_theta),
                             persistent=False)
        self.layers = nn.ModuleDict({str(i): TransformerBlock(i, args) for i in range(args.n_layers)})
        self.norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)

    def init_buffers(self, device: torch.device | str | None = None) -> None:
        """Compute the rotary table (a non-persistent buffer: no state dict restores it) on ``device``
        (default: where it is now; after ``to_empty`` its values are garbage until this runs)."""
        self.rope = rope_table(self.args.head_dim, self.args.max_seq_len, self.args.rope_theta,
                               device=device or self.rope.device)

    @torch.no_grad()
    def init_weights(self, buffer_device: torch.device | str | None = None) -> None:
        """Initialize the buffers and every parameter from torch's global RNG (torchtitan's scheme:
        N(0, 1) embedding, truncated normals for projections, ones for norms). Works on plain and on
        sharded (DTensor) parameters; the draw order is fixed, so a plain model built after
        ``torch.manual_seed(s)`` always gets the same values."""
        self.init_buffers(buffer_device)
        nn.init.normal_(self.tok_embeddings.weight)
        for block in self.layers.values():
            block.init_weights()
        self.norm.reset_parameters()
        std = self.args.dim ** -0.5
        nn.init.trunc_normal_(self.output.weight, mean=0.0, std=std, a=-3 * std, b=3 * std)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        for block in self.layers.values():
            h = block(h, self.rope)
        return self.output(self.norm(h))


def build_plain(args: LlamaArgs = LlamaArgs(), seed: int = 0) -> Llama:
    """A fully initialized single-device model: ``torch.manual_seed(seed)`` then ``init_weights()``."""
    model = Llama(args)
    torch.manual_seed(seed)
    model.init_weights()
    return model


def token_batch(step: int, rank: int = 0, world_size: int = 1, global_batch_size: int = 8,
                args: LlamaArgs = LlamaArgs()) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's rows of step ``step``'s global batch, independent of the world size.

    The global batch holds ``global_batch_size`` learnable sequences of ``max_seq_len + 1`` token ids:
    ``(start + i · stride) mod vocab_size`` with a random start and stride (1, 2 or 3) per sequence, drawn from a
    generator seeded with ``step`` (the loss falls as the model learns to read the stride from the two
    previous tokens). Rank ``r`` of ``world_size`` takes rows
    ``[r·b, (r+1)·b)`` with ``b = global_batch_size // world_size``, so the ranks together see exactly the
    single-process batch.

    Returns:
        ``(inputs, labels)``, both int64 of shape ``(b, max_seq_len)``; labels are inputs shifted by one.

    Raises:
        ValueError: if ``world_size`` does not divide ``global_batch_size``.
    """
    if global_batch_size % world_size:
        raise ValueError(f"token_batch: world size {world_size} does not divide global batch {global_batch_size}")
    rows = global_batch_size // world_size
    generator = torch.Generator().manual_seed(10_000 + step)
    start = torch.randint(0, args.vocab_size, (global_batch_size, 1), generator=generator)
    stride = torch.randint(1, 4, (global_batch_size, 1), generator=generator)
    tokens = (start + stride * torch.arange(args.max_seq_len + 1)) % args.vocab_size
    mine = tokens[rank * rows:(rank + 1) * rows]
    return mine[:, :-1], mine[:, 1:]
