"""QLoRA in `fullshard train` (``--hf-model DIR --lora-rank R --quantize-base nf4``): the frozen base's
decoder-layer Linear weights stored 4-bit as torchao ``NF4Tensor`` (block size 64, scaler block 256:
``to_nf4``'s defaults), sharded and all-gathered as packed bytes (core/packed.py [Note: packed parts]).

Each such weight is quantized from the whole tensor, as a single process does, so every rank's shard
is that rank's dim-0 rows of the same NF4 tensor (one per-tensor scaler mean; quantizing each rank's
rows alone would give each rank its own, and the gathered tensor would dequantize other ranks' rows
with the wrong one). Each rank reads one full weight at a time from the safetensors files (its
``--base-dtype``), just before its decoder layer is sharded, which keeps its own rows; embeddings,
norms and the output layer stay in ``--base-dtype``, the adapters fp32. torchao's ``F.linear`` on an
``NF4Tensor`` dequantizes it to the input's dtype inside its own autograd function (PEFT's LoRA layer
calls its base ``nn.Linear``, whose weight it is).

Export (train/hf_export.py): the adapter is saved alone (no base weight gathered); ``--merge-lora``
gathers each NF4 weight as NF4 and dequantizes it with torchao (:func:`dequantize`, the forward's own
dequantization) before PEFT merges the adapters in.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import math
import sys

import torch
import torch.nn as nn

BLOCK, SCALER_BLOCK = 64, 256  # torchao to_nf4's defaults (QLoRA's)
CHOICES = ("none", "nf4")


_LIBC = ctypes.CDLL(ctypes.util.find_library("c") or None)


def trim_heap() -> None:
    """Return freed heap pages to the OS (glibc's ``malloc_trim(0)``; nothing elsewhere).

    Quantizing one weight after another frees temporaries whose pages glibc keeps (its mmap
    threshold rises after the first large free, so later ones come from the heap). Those pages,
    not the NF4 shards, set a rank's load peak: 220 / 267 MiB per rank on the 109.5M Llama at 2
    ranks without the trim, 120 / 118 MiB with it (another run: 127 / 146; examples/hf_load_rss.py
    --quantize-base nf4).
    """
    trim = getattr(_LIBC, "malloc_trim", None)
    if trim is not None:
        trim(0)


class QuantizeError(ValueError):
    """A base that cannot be quantized as asked; the message is one line."""


def nf4_available() -> bool:
    """Whether torchao's NF4 can be imported."""
    try:
        from torchao.quantization import to_nf4  # noqa: F401
    except ImportError:
        return False
    return True


def is_nf4(t) -> bool:
    """Whether ``t`` is a torchao ``NF4Tensor`` (never imports torchao: none exists before it is imported)."""
    if "torchao" not in sys.modules:
        return False
    from torchao.quantization import NF4Tensor

    return isinstance(t, NF4Tensor)


def dequantize(weight) -> torch.Tensor:
    """A plain tensor of an ``NF4Tensor``'s values in its original dtype (``--base-dtype``): torchao's
    dequantization, the one its ``F.linear`` runs on every forward (``weight.to(input.dtype)``).

    Args:
        weight: a full ``NF4Tensor`` ``(out_features, in_features)``.
    Returns:
        A new ``(out_features, in_features)`` tensor of ``weight.dtype``.
    """
    return weight.to(weight.dtype)


def base_linears(block: nn.Module) -> list[tuple[str, nn.Linear]]:
    """The frozen ``nn.Linear`` modules of a decoder layer (PEFT's ``base_layer`` included, adapters not)."""
    return [(n, m) for n, m in block.named_modules() if type(m) is nn.Linear and not m.weight.requires_grad]


class Quantizer:
    """``prepare(block)`` for `sharding.shard_model`: each frozen Linear weight of ``block`` becomes a
    frozen ``NF4Tensor`` parameter built from its whole value read by ``reader``.

    Args:
        reader: the model's ``hf_model.RowReader`` (made before any parameter was replaced).
        world: ranks a weight is sharded over (its rows must split into whole scaler blocks).
    """

    def __init__(self, reader, world: int):
        self.reader, self.world = reader, world

    def __call__(self, block: nn.Module) -> None:
        from torchao.quantization import to_nf4

        check_world(block, self.world)
        for _, linear in base_linears(block):
            value = self.reader.init_rows(linear.weight, 0, linear.weight.shape[0], "cpu")
            linear.weight = nn.Parameter(to_nf4(value, BLOCK, SCALER_BLOCK), requires_grad=False)
            del value
            trim_heap()


def fits(shape: tuple, world: int) -> bool:
    """Whether a 2-D weight of ``shape`` splits into ``world`` dim-0 shards of whole NF4 scaler blocks."""
    rows, numel = shape[0], math.prod(shape)
    return rows % world == 0 and (numel // world) % (BLOCK * SCALER_BLOCK) == 0


def nf4_bytes(shape: tuple, world: int, elem_size: int) -> tuple[int, int]:
    """Bytes of one rank's shard of a weight of ``shape`` stored NF4, and of its all-gather's outputs.

    torchao's ``NF4Tensor`` of E elements holds 4-bit codes (uint8, E/2), one int8 scale per block
    (E/64), one factor per scaler block (E/16384, ``elem_size`` bytes: the source weight's dtype), and
    two tensors every shard keeps whole: the scaler mean (one element) and the 16-entry code table.
    Its all-gather extension gathers the first three only. ``fits(shape, world)`` must hold.

    Returns:
        ``(shard, gathered)``: what ``memory_stats`` counts for this rank's shard (``by_dtype``
        ``"NF4Tensor"``), and the ``world`` ranks' gathered codes, scales and factors.
    """
    e = math.prod(shape) // world
    gathered = e // 2 + e // BLOCK + e // (BLOCK * SCALER_BLOCK) * elem_size
    return gathered + (1 + 16) * elem_size, world * gathered


def check_world(block: nn.Module, world: int) -> None:
    """Raise :class:`QuantizeError` when a frozen Linear of ``block`` cannot be sharded as NF4 at ``world`` ranks."""
    for name, linear in base_linears(block):
        if not fits(tuple(linear.weight.shape), world):
            raise QuantizeError(
                f"--quantize-base nf4: weight '{name}' {tuple(linear.weight.shape)} does not split into whole NF4 "
                f"scaler blocks ({BLOCK} x {SCALER_BLOCK} elements) on each of {world} ranks; use fewer ranks or "
                "--quantize-base none")

