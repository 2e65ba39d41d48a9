"""Hugging Face causal language models in `fullshard train` (``--hf-model DIR``), with LoRA (``--lora-rank``).

[Note: sharded Hugging Face load]
No rank holds the full model. The model is built from ``DIR/config.json`` with its parameters on the
meta device (``accelerate.init_empty_weights(include_buffers=False)``: buffers such as the rotary
``inv_freq``, which checkpoints do not store, are computed for real; they are small), its tied
weights tied (``tie_weights``). Its decoder layers (the classes of ``_no_split_modules``) become
units, and each unit materializes only this rank's dim-0 rows of each parameter through the
engine's row initializer (the ``init_rows`` protocol of ``param_init_fn``, docs/design.md), which
reads their bytes alone from the safetensors file with one positioned read (`read_rows`; safetensors'
own ``get_slice(name)[lo:hi]`` materializes the whole tensor first). Values are cast to the
parameter's dtype (fp32: the dtype the run trains in is its precision flags', as for the GPT;
``--bf16`` is ``MixedPrecision`` over fp32 shards).

LoRA goes through PEFT (``peft.get_peft_model`` with a ``LoraConfig``) before sharding, so the units
hold the adapters next to the frozen base they adapt. The adapters must start where single-process
PEFT's do for the same seed: PEFT draws them on the CPU from the global generator, once per target
module in module order, and moves them to the base layer's device, which is meta here. So PEFT runs
twice: on a CPU skeleton of the meta model whose parameters are one-element tensors expanded to
their shapes (no memory), after ``torch.manual_seed(seed)`` as a single-process script does, which
gives the adapters' values; and on the meta model, which gives the structure that is sharded. The
row initializer serves adapter rows from the skeleton's values and base rows from the files.

By default every parameter, frozen base and adapters alike, is fp32. ``--base-dtype bf16`` (or fp16,
with ``--lora-rank``) stores the frozen base in that dtype and keeps the adapters fp32, as
single-process ``from_pretrained(dtype=torch.bfloat16)`` + ``get_peft_model`` does: the meta model's
parameters take the base dtype before PEFT runs, so PEFT rounds the adapters' initial values through
it and casts them back to fp32 (its ``autocast_adapter_dtype``) exactly as in a single process; each
rank casts its base rows as it reads them. Units then mix a bf16 base with fp32 adapters
(core/mixed.py: each part gathers in its own dtype). Buffers stay fp32.
"""
from __future__ import annotations

import copy
import glob
import json
import math
import os
from typing import Optional

import torch
import torch.nn as nn

CONFIG = "config.json"
INDEX = "model.safetensors.index.json"


class HFModelError(ValueError):
    """A ``--hf-model`` / ``--lora-*`` input that cannot be used; the message is one line."""


def safetensors_files(path: str) -> list[str]:
    """The ``*.safetensors`` weight files of a checkpoint directory (sorted; the index names the
    shards of a sharded one)."""
    index = os.path.join(path, INDEX)
    if os.path.isfile(index):
        with open(index) as f:
            return sorted({os.path.join(path, v) for v in json.load(f)["weight_map"].values()})
    return sorted(f for f in glob.glob(os.path.join(path, "*.safetensors"))
                  if not os.path.basename(f).startswith("adapter_"))


def read_config(path: str):
    """The ``transformers`` config of a causal-LM checkpoint directory ``path``.

    Raises:
        HFModelError: transformers or peft not installed; not a directory, no ``config.json`` or no
            ``*.safetensors`` in it, a ``model_type`` transformers does not know, or one with no causal-LM class.
    """
    try:
        import peft  # noqa: F401  (--lora-rank; checked here so a missing one fails before any rank starts)
        from transformers import AutoConfig
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING
    except ImportError as e:
        raise HFModelError(f"--hf-model needs transformers and peft ({e}); pip install 'fullshard[hf]'") from None
    if not os.path.isdir(path):
        raise HFModelError(f"--hf-model {path!r} is not a directory; give a local Hugging Face checkpoint "
                           "directory (config.json and *.safetensors, as save_pretrained writes)")
    if not os.path.isfile(os.path.join(path, CONFIG)):
        raise HFModelError(f"--hf-model {path!r} has no config.json; it is not a Hugging Face checkpoint "
                           "(save one with model.save_pretrained(DIR))")
    if not safetensors_files(path):
        raise HFModelError(f"--hf-model {path!r} has no *.safetensors weights (only safetensors are read; "
                           "re-save with model.save_pretrained(DIR, safe_serialization=True))")
    try:
        config = AutoConfig.from_pretrained(path)
    except (ValueError, KeyError, OSError) as e:
        raise HFModelError(f"--hf-model {path!r}: transformers cannot read its config.json "
                           f"({str(e).splitlines()[0][:200]}); use a checkpoint of an architecture your "
                           "transformers version knows") from None
    if type(config) not in MODEL_FOR_CAUSAL_LM_MAPPING:
        raise HFModelError(f"--hf-model {path!r}: model_type {config.model_type!r} has no causal language "
                           "model class in transformers; use a decoder-only LM checkpoint (Llama, Qwen2, GPT-2, ...)")
    return config


def max_positions(config) -> Optional[int]:
    """The longest sequence the model's position table / rotary scaling is made for, or None."""
    for name in ("max_position_embeddings", "n_positions", "n_ctx"):
        value = getattr(config, name, None)
        if isinstance(value, int):
            return value
    return None


def build_meta(config) -> nn.Module:
    """The causal LM of ``config`` in fp32 with meta parameters, real buffers, tied weights tied,
    and no KV cache in forward (``use_cache=False``)."""
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    config = copy.deepcopy(config)
    config.use_cache = False
    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.tie_weights()
    return model


def layer_list(model: nn.Module, path: str = "") -> nn.ModuleList:
    """The ``nn.ModuleList`` of the model's decoder layers: the list whose items are of a class in
    ``_no_split_modules`` (``model.model.layers`` for Llama and Qwen2, ``transformer.h`` for GPT-2).

    Raises:
        HFModelError: no such list (``path`` names the checkpoint in the message).
    """
    classes = set(getattr(model, "_no_split_modules", None) or ())
    for module in model.modules():
        if isinstance(module, nn.ModuleList) and len(module) and \
                all(type(m).__name__ in classes for m in module):
            return module
    raise HFModelError(f"--hf-model {path!r}: found no list of decoder layers in {type(model).__name__} "
                       f"(no nn.ModuleList of its _no_split_modules {sorted(classes)}); this architecture cannot "
                       "be sharded one unit per layer yet")


def _skeleton(model: nn.Module) -> nn.Module:
    """A CPU copy of a meta model whose parameters are one element expanded to their shapes (no
    memory); ties kept. PEFT builds real adapters next to it."""
    skeleton = copy.deepcopy(model)
    fakes: dict[int, nn.Parameter] = {}
    for module in skeleton.modules():
        for name, p in module._parameters.items():
            if p is not None:
                if id(p) not in fakes:
                    fakes[id(p)] = nn.Parameter(torch.zeros((), dtype=p.dtype).expand(p.shape),
                                                requires_grad=p.requires_grad)
                module._parameters[name] = fakes[id(p)]
    return skeleton


def lora_config(cfg):
    """The ``peft.LoraConfig`` of the --lora-* flags (target modules None: PEFT's default for the
    architecture)."""
    from peft import LoraConfig

    targets = [t.strip() for t in cfg.lora_target_modules.split(",") if t.strip()] \
        if cfg.lora_target_modules else None
    if targets == ["all-linear"]:  # PEFT's shorthand (every Linear but the output layer): a string, not a name
        targets = "all-linear"
    return LoraConfig(r=cfg.lora_rank, lora_alpha=cfg.lora_alpha, lora_dropout=cfg.lora_dropout,
                      target_modules=targets, task_type="CAUSAL_LM")


def apply_lora(model: nn.Module, cfg, path: str = "") -> tuple[nn.Module, dict[str, torch.Tensor]]:
    """``peft.get_peft_model(model, lora_config(cfg))`` on the meta ``model``, and the adapters'
    initial values by name, drawn as single-process PEFT draws them after ``torch.manual_seed(cfg.seed)``
    (see [Note: sharded Hugging Face load]). The global generator is left as it was.

    Raises:
        HFModelError: --lora-target-modules naming no module of the model.
    """
    from peft import get_peft_model

    config = lora_config(cfg)
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(cfg.seed)
            values = {n: p.detach().clone() for n, p in
                      get_peft_model(_skeleton(model), copy.deepcopy(config)).named_parameters() if p.requires_grad}
        peft_model = get_peft_model(model, config)
    except ValueError as e:
        raise HFModelError(f"--lora-target-modules {cfg.lora_target_modules!r}: PEFT cannot adapt it in "
                           f"{type(model).__name__} of {path!r} ({str(e).splitlines()[0][:160]}); name Linear "
                           "layers it has, e.g. q_proj,v_proj (Llama, Qwen2) or c_attn (GPT-2), or all-linear") \
            from None
    return peft_model, values


class RowReader:
    """The ``param_init_fn`` of a Hugging Face model built on meta: ``init_rows(param, lo, hi, device)``
    reads rows ``[lo, hi)`` of a base parameter from the checkpoint's safetensors files, or takes them
    from the adapters' initial values (see [Note: sharded Hugging Face load]).

    Args:
        model: the meta model (PEFT-wrapped or not), before any sharding.
        path: the checkpoint directory.
        base_names: ``{id(parameter): [its names in the plain transformers model]}`` (every tied name).
        adapters: ``{name in model: initial value}`` of parameters that are not in the files.
        expected: whether a file tensor that is no parameter's has a place in the model anyway (a
            persistent buffer, a name transformers ignores on load); None: every one has.
    Raises:
        HFModelError: a parameter the files lack or hold in another shape or dtype, or a file tensor
            the model has no place for (a config.json of fewer layers than the files, say).
    """

    def __init__(self, model: nn.Module, path: str, base_names: dict[int, list[str]],
                 adapters: dict[str, torch.Tensor], expected=None):
        self._where: dict[str, tuple[str, dict, int]] = {}  # tensor name -> (file, header entry, data start)
        for file in safetensors_files(path):
            header, start = read_header(file)
            for key, entry in header.items():
                if key != "__metadata__":
                    self._where[key] = (file, entry, start)
        self._params = list(model.parameters())  # keeps the ids below valid
        self._source: dict[int, object] = {}
        for name, p in model.named_parameters(remove_duplicate=False):
            if name in adapters:
                self._source[id(p)] = adapters[name]
            elif id(p) not in self._source:
                names = base_names.get(id(p), [])
                found = [n for n in names if n in self._where]
                if not found:
                    raise HFModelError(f"--hf-model {path!r}: its safetensors files hold no tensor "
                                       f"{' or '.join(map(repr, names)) or repr(name)}; the checkpoint does not "
                                       f"match its config.json ({type(model).__name__})")
                self._source[id(p)] = found[0]
                entry = self._where[found[0]][1]
                if tuple(entry["shape"]) != tuple(p.shape) or entry["dtype"] not in _DTYPES:
                    raise HFModelError(f"--hf-model {path!r}: tensor {found[0]!r} is {entry['dtype']} "
                                       f"{list(entry['shape'])}, its config.json gives {list(p.shape)} (floating "
                                       "dtypes: F32, F16, BF16, F64); the checkpoint does not match it")
        named = {n for names in base_names.values() for n in names}
        extra = sorted(k for k in self._where if k not in named and expected is not None and not expected(k))
        if extra:  # transformers only warns; training would silently drop them
            raise HFModelError(f"--hf-model {path!r}: its safetensors files hold {len(extra)} tensors the model of "
                               f"its config.json has no place for ({', '.join(map(repr, extra[:3]))}"
                               f"{', ...' if len(extra) > 3 else ''}); the checkpoint does not match its config.json")

    def __call__(self, module: nn.Module) -> None:
        raise RuntimeError("the Hugging Face loader initializes rows only (init_rows); report this")

    def init_rows(self, param: nn.Parameter, row_start: int, row_end: int,
                  device: torch.device | str, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Rows ``[row_start, row_end)`` of ``param``: shape ``(row_end - row_start, *param.shape[1:])``,
        ``param.dtype``, on ``device``; written into ``out`` when given (a rank's shard: the file's
        bytes are read straight into it, or converted a few MiB at a time, so no transient copy of
        the rows is made).

        Raises:
            ValueError: ``param`` is not a parameter of the model this reader was made for.
        """
        source = self._source.get(id(param))
        if source is None:
            raise ValueError("init_rows: the parameter is not one of the Hugging Face model's")
        if isinstance(source, torch.Tensor):
            rows = source[row_start:row_end]
            return rows.to(device=device, dtype=param.dtype, copy=True) if out is None else out.copy_(rows)
        if out is None:
            return read_rows(*self._where[source], row_start, row_end).to(device=device, dtype=param.dtype)
        return read_rows_into(out, *self._where[source], row_start)


_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "F64": torch.float64}


def read_header(file: str) -> tuple[dict, int]:
    """The JSON header of a safetensors file (``{name: {"dtype", "shape", "data_offsets"}}``) and the
    byte offset where its data starts (the format: an 8-byte little-endian header length, the header,
    the data)."""
    with open(file, "rb") as f:
        size = int.from_bytes(f.read(8), "little")
        return json.loads(f.read(size)), 8 + size


def read_rows(file: str, entry: dict, start: int, row_start: int, row_end: int) -> torch.Tensor:
    """Rows ``[row_start, row_end)`` of one tensor of a safetensors file, read with one positioned read
    of their bytes alone. (``safe_open(...).get_slice(name)[lo:hi]`` materializes the whole tensor in
    safetensors 0.8: every rank would then hold each full parameter for a moment.)

    Returns:
        A new tensor ``(row_end - row_start, *shape[1:])`` of the stored dtype.
    """
    out = torch.empty((row_end - row_start, *entry["shape"][1:]), dtype=_DTYPES[entry["dtype"]])
    return _read_bytes_into(out, file, entry, start, row_start)


def _read_bytes_into(out: torch.Tensor, file: str, entry: dict, start: int, row_start: int) -> torch.Tensor:
    """The file's bytes of rows ``row_start, ...`` into ``out`` (a contiguous CPU tensor of the stored
    dtype, as many rows as it has), with one positioned read. Returns ``out``."""
    if out.numel():
        row_bytes = math.prod(entry["shape"][1:]) * _DTYPES[entry["dtype"]].itemsize
        with open(file, "rb") as f:
            f.seek(start + entry["data_offsets"][0] + row_start * row_bytes)
            f.readinto(memoryview(out.view(torch.uint8).numpy()).cast("B"))
    return out


CHUNK_BYTES = 8 << 20
"""Bytes converted at a time when the file's dtype is not the shard's (`read_rows_into`)."""


def read_rows_into(out: torch.Tensor, file: str, entry: dict, start: int, row_start: int) -> torch.Tensor:
    """Read rows ``[row_start, row_start + len(out))`` of one tensor of a safetensors file into ``out``
    (a contiguous CPU tensor of the rows' shape): straight into its memory when it has the stored
    dtype, else through a buffer of at most `CHUNK_BYTES`, converted by ``copy_``. Another ``out``
    (a device tensor) gets the rows read whole and copied. Returns ``out``."""
    rows = out.shape[0] if out.dim() else 1
    stored = _DTYPES[entry["dtype"]]
    if not out.numel():
        return out
    if out.device.type != "cpu" or not out.is_contiguous():
        return out.copy_(read_rows(file, entry, start, row_start, row_start + rows).view(out.shape))
    if out.dtype == stored:
        return _read_bytes_into(out, file, entry, start, row_start)
    flat = out.view(rows, -1)
    step = max(1, CHUNK_BYTES // (flat.shape[1] * stored.itemsize))
    for lo in range(0, rows, step):
        hi = min(rows, lo + step)
        flat[lo:hi].copy_(read_rows(file, entry, start, row_start + lo, row_start + hi).view(hi - lo, -1))
    return out


def base_names(model: nn.Module) -> dict[int, list[str]]:
    """``{id(parameter): every name it has in the plain model}`` (tied ones: each name), plus the
    name without the model's ``base_model_prefix`` (older GPT-2 files)."""
    out: dict[int, list[str]] = {}
    prefix = getattr(model, "base_model_prefix", "") + "."
    for name, p in model.named_parameters(remove_duplicate=False):
        out.setdefault(id(p), []).append(name)
    for names in out.values():
        names += [n[len(prefix):] for n in list(names) if n.startswith(prefix)]
    return out


def load_meta(cfg, path: Optional[str] = None):
    """The model of ``--hf-model`` (LoRA-wrapped with --lora-rank), still on meta, its decoder-layer
    list, and its row reader (see [Note: sharded Hugging Face load]).

    Returns:
        ``(model, layers, reader)``: ``model`` a ``transformers`` causal LM or a ``peft.PeftModel``;
        ``layers`` the ``nn.ModuleList`` whose items become units.
    Raises:
        HFModelError: see `read_config`, `layer_list`, `apply_lora`, `RowReader`.
    """
    path = path or cfg.hf_model
    model = build_meta(read_config(path))
    layers = layer_list(model, path)
    base = BASE_DTYPES[getattr(cfg, "base_dtype", "fp32")]
    if base != torch.float32:
        if not cfg.lora_rank:
            raise HFModelError(f"--base-dtype {cfg.base_dtype} needs --lora-rank R (> 0): only a frozen base is "
                               "stored in it; a full fine-tune trains fp32 master weights (--bf16 computes in bf16)")
        for p in model.parameters():  # meta: no memory; ties kept (same parameter objects)
            p.data = p.data.to(base)
    names = base_names(model)
    expected = _expected_extra(model)
    adapters: dict[str, torch.Tensor] = {}
    if cfg.lora_rank:
        model, adapters = apply_lora(model, cfg, path)
        wrong = [n for n, p in model.named_parameters() if p.requires_grad and p.dtype != torch.float32]
        if wrong:  # PEFT upcasts its adapters (autocast_adapter_dtype); a trainable base copy would not be
            raise HFModelError(f"--base-dtype {cfg.base_dtype}: trainable parameters {wrong[:3]} are not fp32; "
                               "train adapters only (--lora-target-modules) or use --base-dtype fp32")
    return model, layers, RowReader(model, path, names, adapters, expected)


def _expected_extra(model: nn.Module):
    """Whether a checkpoint tensor that is none of ``model``'s parameters belongs in its files anyway: a
    persistent buffer of the plain model, or a name its class tells ``from_pretrained`` to ignore
    (``_keys_to_ignore_on_load_unexpected``: GPT-2's old attention masks; old checkpoints' rotary
    ``inv_freq`` and ``position_ids`` buffers, which transformers also skips)."""
    import re

    buffers = {n for n, _ in model.named_buffers()}
    patterns = set(getattr(model, "_keys_to_ignore_on_load_unexpected", None) or ()) | \
        {r"rotary_emb\.inv_freq", r"(^|\.)position_ids$"}
    ignored = re.compile("|".join(f"({p})" for p in patterns))
    return lambda key: key in buffers or ignored.search(key) is not None


BASE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def buffers_of(model: nn.Module) -> list[tuple[nn.Module, str, torch.Tensor]]:
    """Every (module, buffer name, value) of ``model`` (the values a ``to_empty`` would lose)."""
    return [(m, n, b) for m in model.modules() for n, b in m._buffers.items() if b is not None]


@torch.no_grad()
def restore_buffers(saved: list[tuple[nn.Module, str, torch.Tensor]]) -> None:
    """Put back the values of `buffers_of` into the current buffers (same device and dtype)."""
    for module, name, value in saved:
        current = module._buffers.get(name)
        if current is not None:
            current.copy_(value.to(current.dtype))
