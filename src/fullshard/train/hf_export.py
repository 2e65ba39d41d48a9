"""Writing a trained ``--hf-model`` back in Hugging Face formats (``--save-hf DIR``, at the end of training).

Every rank takes part: the sharded state dict (``DTensor`` values under both front doors) is gathered
one tensor at a time and kept only on rank 0, which writes

- without LoRA: the full model, ``save_pretrained`` format (``config.json`` + ``model.safetensors``),
  which ``AutoModelForCausalLM.from_pretrained(DIR)`` loads;
- with ``--lora-rank``: the PEFT adapter (``adapter_config.json`` + ``adapter_model.safetensors``),
  which ``PeftModel.from_pretrained(base, DIR)`` loads over the ``--hf-model`` base;
- with ``--merge-lora``: the base with the adapters merged in by PEFT (``merge_and_unload``), as the
  full model.

Under ``--quantize-base nf4`` (train/qlora.py) the adapter export gathers no base weight: the adapter
is for the base as training saw it, the ``--base-dtype`` checkpoint with each decoder-layer frozen
Linear weight replaced by ``to_nf4`` of it. ``--merge-lora`` gathers each NF4 weight as NF4 and
dequantizes it (torchao's dequantization, the forward's) to ``--base-dtype``, in which the merged
model is written.

The tokenizer and generation files of ``--hf-model`` are copied along, so DIR is a complete checkpoint.
Rank 0 holds the full model while it writes (the gather's cost; no other rank does). It writes into a
hidden sibling directory and moves the files into DIR only once all are written, so a failure leaves
no half-written DIR.
"""
from __future__ import annotations

import copy
import os
import shutil

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from fullshard.adapters import sharded_state_dict, write_dir
from fullshard.core import collectives
from fullshard.train import hf_model, qlora

# Files of a checkpoint directory that are neither weights nor the model config: copied along.
_SKIP = (".safetensors", ".bin", ".pt", hf_model.INDEX, hf_model.CONFIG, "adapter_config.json")


def gather_state_dict(model: nn.Module, nf4: bool = True) -> dict[str, torch.Tensor]:
    """The full state dict of a sharded model on rank 0 (CPU tensors, the unwrapped model's names);
    an empty dict on the other ranks. Every rank must call it (one all-gather per sharded tensor).

    Args:
        model: the sharded model (FullyShardedDataParallel root or ``fully_shard`` model).
        nf4: a torchao ``NF4Tensor`` weight (``--quantize-base nf4``) is gathered as NF4 and kept
            dequantized to its original dtype (:func:`qlora.dequantize`); False leaves it out.
    """
    state = sharded_state_dict(model)
    out, rank0 = {}, collectives.rank() == 0
    for name, value in state.items():
        packed = qlora.is_nf4(value.to_local() if isinstance(value, DTensor) else value)
        if packed and not nf4:
            continue
        full = value.full_tensor() if isinstance(value, DTensor) else value  # NF4: its packed bytes travel
        if packed:  # on every rank: NF4's gathered bytes are waited for only when read, and a rank that
            full = qlora.dequantize(full)  # never read them could exit before its part was sent
        if rank0:
            out[name] = full.to("cpu") if packed else full.detach().to("cpu", copy=True)
    return out


def _plain_names(state: dict) -> dict:
    """Base-model tensors of a PEFT model's state dict under the plain transformers names."""
    prefix = "base_model.model."
    out = {}
    for name, value in state.items():
        if "lora_" in name or not name.startswith(prefix):
            continue
        out[name[len(prefix):].replace(".base_layer.", ".")] = value
    return out


def _plain_model(config, state: dict) -> nn.Module:
    """A CPU transformers model of ``config`` holding ``state`` (assigned, no copy; ties re-made)."""
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    model.tie_weights()
    left = [n for n, p in model.named_parameters() if p.is_meta]
    if left or unexpected:
        raise RuntimeError(f"[rank 0] Hugging Face export: tensors missing {left[:5]} or unexpected "
                           f"{unexpected[:5]}; report this with the checkpoint")
    return model


def _untie_merged_weights(plain) -> None:
    """Before ``merge_and_unload``: PEFT merges each LoRA delta into its base weight in place, so with
    tied input and output embeddings (``tie_word_embeddings``) an adapter on either would change the
    other too, and the merged model would no longer compute what was trained. Then the output
    embedding gets a copy of its own and the exported config says the weights are untied."""
    model = plain.get_base_model()
    inp, out = model.get_input_embeddings(), model.get_output_embeddings()
    if inp is None or out is None:
        return
    inp, out = getattr(inp, "base_layer", inp), getattr(out, "base_layer", out)
    targeted = any(hasattr(m, "base_layer") and m.base_layer in (inp, out) for m in model.modules())
    if targeted and out.weight is inp.weight:
        out.weight = nn.Parameter(inp.weight.detach().clone(), requires_grad=False)
        model.config.tie_word_embeddings = False


def _copy_side_files(src: str, dst: str) -> None:
    for name in os.listdir(src):
        path = os.path.join(src, name)
        if os.path.isfile(path) and not name.endswith(_SKIP) and not name.startswith("adapter_"):
            shutil.copy2(path, os.path.join(dst, name))


def export(cfg, model: nn.Module, peft_model=None, out_dir: str | None = None) -> str:
    """Write the trained model as the module docstring says; every rank calls it.

    Args:
        cfg: the run's TrainConfig (``hf_model``, ``lora_rank``, ``merge_lora``, ``save_hf``, ``save_dir``).
        model: the sharded model (FullyShardedDataParallel root or ``fully_shard`` model).
        peft_model: with --lora-rank, the ``peft.PeftModel`` that was sharded (its LoRA config).
        out_dir: where to write (default: ``cfg.save_hf`` or ``<save_dir>/hf``).
    Returns:
        The directory written.
    """
    out_dir = out_dir or cfg.save_hf or os.path.join(cfg.save_dir, "hf")
    # The adapter alone needs no NF4 base weight (nor their dequantized copies on rank 0).
    state = gather_state_dict(model, nf4=peft_model is None or bool(cfg.merge_lora))
    if collectives.rank() == 0:
        write_dir(out_dir, lambda tmp: _write(cfg, state, peft_model, tmp))
    collectives.barrier()
    return out_dir


def _write(cfg, state: dict, peft_model, out_dir: str) -> None:
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(cfg.hf_model)
    if peft_model is None:
        _plain_model(config, state).save_pretrained(out_dir)
    else:
        from peft import get_peft_model, get_peft_model_state_dict, set_peft_model_state_dict

        lora = copy.deepcopy(peft_model.peft_config["default"])
        # PEFT finds the adapters' keys by walking the model's modules: a plain PeftModel of the same
        # structure (FullyShardedDataParallel renames the trained one's modules).
        base = _plain_model(config, _plain_names(state)) if cfg.merge_lora else hf_model.build_meta(config)
        with torch.random.fork_rng(devices=[]):  # the adapters' fresh init is replaced below
            plain = get_peft_model(base, copy.deepcopy(lora))
        adapter = get_peft_model_state_dict(plain, state_dict=state)
        if not adapter:
            raise RuntimeError("[rank 0] Hugging Face export: no adapter tensors in the gathered state dict; "
                               "report this")
        if cfg.merge_lora:
            result = set_peft_model_state_dict(plain, adapter)
            if result.unexpected_keys:
                raise RuntimeError(f"[rank 0] --merge-lora: adapter tensors {result.unexpected_keys[:5]} did not "
                                   "load; report this")
            _untie_merged_weights(plain)
            plain.merge_and_unload().save_pretrained(out_dir)
        else:
            from safetensors.torch import save_file

            lora.base_model_name_or_path = os.path.abspath(cfg.hf_model)
            save_file({k: v.contiguous() for k, v in adapter.items()},
                      os.path.join(out_dir, "adapter_model.safetensors"), metadata={"format": "pt"})
            lora.save_pretrained(out_dir)
    _copy_side_files(cfg.hf_model, out_dir)
