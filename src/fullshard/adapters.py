"""Saving a PEFT adapter trained under either front door, and :func:`write_dir`, the all-or-nothing
write of a Hugging Face export directory (used by ``fullshard train --save-hf`` too).

[Note: PEFT adapters of sharded models]
``PeftModel.save_pretrained`` picks the adapter's entries of ``state_dict()`` by the names of the modules
that hold them (``named_modules()``). Inside ``FullyShardedDataParallel`` each nested unit puts
``_fsdp_wrapped_module.`` into those names while the state dict keeps the model's own names (torch's
wrapper does the same), so nothing matches and it writes an adapter file with no tensors, with no error;
under ``fully_shard`` the state dict holds this rank's ``DTensor`` shards. :func:`save_adapter` asks PEFT's
own ``get_peft_model_state_dict`` for the entries, over a view of the model whose module names drop the
wrapper's segments, then gathers only those tensors (one all-gather each; no base weight is gathered) and
writes PEFT's two files from the first rank.
"""
from __future__ import annotations

import copy
import os
import shutil
from typing import Iterator

import torch.nn as nn
from torch.distributed.tensor import DTensor

from .api import StateDictType
from .core import collectives
from .core.names import clean_name
from .fsdp import FullyShardedDataParallel
from .fsdp2 import FSDPModule


class _ModelNames:
    """``peft_model`` as PEFT walks it, with the model's own module names: every attribute is the model's,
    ``named_modules()`` skips the wrapper's units and drops their ``_fsdp_wrapped_module.`` segments."""

    def __init__(self, peft_model: nn.Module):
        self._model = peft_model

    def __getattr__(self, name: str):
        return getattr(self._model, name)

    def named_modules(self, *args, **kwargs) -> Iterator[tuple[str, nn.Module]]:
        for name, module in self._model.named_modules(*args, **kwargs):
            if not isinstance(module, FullyShardedDataParallel):
                yield clean_name(name), module


def sharded_state_dict(model: nn.Module) -> dict:
    """The state dict of a sharded model (wrapper root or ``fully_shard`` model) as ``DTensor`` shards under
    the plain model's names: no gather."""
    if isinstance(model, FullyShardedDataParallel):
        with FullyShardedDataParallel.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
            return model.state_dict()
    return model.state_dict()  # fully_shard: DTensor shards already


def save_adapter(model: nn.Module, out_dir: str, adapter_name: str = "default") -> None:
    """Write adapter ``adapter_name`` of a sharded ``peft.PeftModel`` as ``PeftModel.save_pretrained`` does:
    ``adapter_config.json`` and ``adapter_model.safetensors`` in ``out_dir``, which
    ``PeftModel.from_pretrained(base, out_dir)`` loads (see [Note: PEFT adapters of sharded models]).

    Every rank calls it, outside forward and backward; the first rank of the model's groups (global rank 0
    for a model on every rank) writes, through :func:`write_dir` (a failure leaves ``out_dir`` as it was; an
    earlier export's weights there are removed). Only the adapter's tensors are gathered, each to its full
    shape, in its own dtype.

    Args:
        model: a ``FullyShardedDataParallel`` root wrapping a ``peft.PeftModel``, or a ``PeftModel`` sharded
            with ``fully_shard``.
        out_dir: the directory to write (created if missing).
        adapter_name: which adapter (PEFT's name; ``"default"`` unless named).
    Raises:
        TypeError: ``model`` is not such a model.
        ValueError: ``adapter_name`` is not one of its adapters.
    """
    from peft import PeftModel, get_peft_model_state_dict
    from safetensors.torch import save_file

    peft_model = model.module if isinstance(model, FullyShardedDataParallel) else model
    if not isinstance(peft_model, PeftModel) or not isinstance(model, (FullyShardedDataParallel, FSDPModule)):
        raise TypeError(f"[rank {collectives.rank()}] save_adapter takes a FullyShardedDataParallel root wrapping "
                        "a peft.PeftModel, or a PeftModel sharded with fully_shard; got "
                        f"{type(model).__name__} of {type(peft_model).__name__}")
    if adapter_name not in peft_model.peft_config:
        raise ValueError(f"[rank {collectives.rank()}] save_adapter: no adapter {adapter_name!r}; the model has "
                         f"{sorted(peft_model.peft_config)}")
    sharded = sharded_state_dict(model)
    chosen = get_peft_model_state_dict(_ModelNames(peft_model), state_dict=sharded, adapter_name=adapter_name)
    cfg = model.unit.cfg
    first = collectives.is_first_rank(cfg.shard_group, cfg.replicate_group)
    tensors = {}
    for key, value in chosen.items():  # the same keys in the same order on every rank
        full = value.full_tensor() if isinstance(value, DTensor) else value
        if first:
            tensors[key] = full.detach().to("cpu", copy=True).contiguous()
    if first:
        config = copy.deepcopy(peft_model.peft_config[adapter_name])
        config.inference_mode = True  # as PeftModel.save_pretrained writes it
        write_dir(out_dir, lambda tmp: (save_file(tensors, os.path.join(tmp, "adapter_model.safetensors"),
                                               metadata={"format": "pt"}), config.save_pretrained(tmp)))
    collectives.barrier(collectives.holding_group(cfg.shard_group, cfg.replicate_group), tag="save_adapter")


def _is_export_file(name: str) -> bool:
    """A file of a Hugging Face model or PEFT adapter export: weights (one file or shards), their index,
    the model or adapter config."""
    weights = name.startswith(("model", "pytorch_model", "adapter_model")) and name.endswith((".safetensors", ".bin"))
    return weights or name.endswith(".index.json") or name in ("config.json", "adapter_config.json")


def write_dir(out_dir: str, write) -> None:
    """Run ``write(tmp)`` on a new hidden sibling directory of ``out_dir``, then move its files into
    ``out_dir`` (made if missing). Files of an earlier export there that this one did not write (an
    adapter beside a merged model, weight shards of another count) are removed, since
    ``from_pretrained`` would load them with the new ones; other files are kept. If ``write`` raises, the
    sibling is removed and ``out_dir`` is untouched."""
    out_dir = os.path.abspath(out_dir)
    parent, base = os.path.split(out_dir)
    tmp = os.path.join(parent, f".{base}.partial-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)  # a leftover of a killed export by a process of the same id
    os.makedirs(tmp)
    try:
        write(tmp)
        if not os.path.exists(out_dir):
            os.rename(tmp, out_dir)
            return
        written = set(os.listdir(tmp))
        for name in written:  # same file system: each a rename
            os.replace(os.path.join(tmp, name), os.path.join(out_dir, name))
        for name in os.listdir(out_dir):
            if name not in written and _is_export_file(name) and os.path.isfile(os.path.join(out_dir, name)):
                os.remove(os.path.join(out_dir, name))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
