"""Muon (with the AdamW recipe built in) on a plain model or on fullshard's shards.

Muon (Jordan et al. 2024, "Muon: An optimizer for hidden layers in neural
networks", https://kellerjordan.github.io/posts/muon/; ``torch.optim.Muon``)
replaces each 2-D weight's momentum update by its Newton–Schulz
orthogonalization, which needs the whole matrix. A Muon parameter held
whole by one rank (``Owned``; see :func:`muon_placement_fn`) is stepped by
its owner, which runs exactly ``torch.optim.Muon``'s single-tensor
operations on the same matrix, so its result is bitwise the same as on one
device; the next all-gather brings it to the other ranks. A matrix whose
rows are spread over ranks (``RowShard``, the only placement ``fully_shard``
takes) costs one extra all-gather of its momentum update per step, and
every rank of the shard group orthogonalizes the whole matrix: the same
bits again, at N times the Newton–Schulz work.
"""
from __future__ import annotations

import fnmatch
import math
from typing import Callable, Iterable, Optional

import torch
import torch.nn as nn
from torch.optim.adamw import adamw

from ..core.names import clean_name
from ..core.params import local_of
from ..core.placement import Owned, shard_info
from . import shards
from .shards import ROWS, like_param

# Torch's constants (torch/optim/_muon.py), from Keller Jordan's Muon post.
EPS = 1e-7
DEFAULT_A = 3.4445
DEFAULT_B = -4.7750
DEFAULT_C = 2.0315
DEFAULT_NS_STEPS = 5


def zeropower_via_newtonschulz(grad: torch.Tensor, ns_coefficients: tuple, ns_steps: int,
                               eps: float) -> torch.Tensor:
    """Quintic Newton–Schulz orthogonalization of a 2-D ``grad`` in bfloat16,
    ``torch.optim.Muon``'s operations in its order (torch 2.13).

    Returns:
        bfloat16 tensor of ``grad``'s shape, roughly ``U S' V^T`` with
        ``S'_ii`` in about (0.5, 1.5) for ``grad = U S V^T``.
    Raises:
        ValueError: ``ns_steps >= 100``, ``grad`` not 2-D, or not 3 coefficients.
    """
    if ns_steps >= 100:
        raise ValueError("Number of steps must be less than 100 for computational efficiency")
    if len(grad.shape) != 2:
        raise ValueError("Input tensor gradient must be a 2D matrix")
    if len(ns_coefficients) != 3:
        raise ValueError("Coefficients must be a tuple of exactly 3 values")
    a, b, c = ns_coefficients
    ortho = grad.bfloat16()
    if grad.size(0) > grad.size(1):
        ortho = ortho.T
    ortho.div_(ortho.norm().clamp(min=eps))  # spectral norm at most 1
    for _ in range(ns_steps):
        gram = ortho @ ortho.T
        gram_update = torch.addmm(gram, gram, gram, beta=b, alpha=c)
        ortho = torch.addmm(ortho, gram_update, ortho, beta=a)
    if grad.size(0) > grad.size(1):
        ortho = ortho.T
    return ortho


def adjust_lr(lr, adjust_lr_fn: Optional[str], shape: torch.Size):
    """``torch.optim.Muon``'s learning-rate scale for a ``(A, B)`` matrix:
    ``sqrt(max(1, A/B))`` ("original", None) or ``0.2 sqrt(max(A, B))``
    ("match_rms_adamw", Liu et al. 2025, "Muon is Scalable for LLM Training")."""
    rows, cols = shape[:2]
    if adjust_lr_fn is None or adjust_lr_fn == "original":
        ratio = math.sqrt(max(1, rows / cols))
    elif adjust_lr_fn == "match_rms_adamw":
        ratio = 0.2 * math.sqrt(max(rows, cols))
    else:
        ratio = 1.0
    return lr * ratio


def _to_scalar(x):
    """A 1-element tensor hyper-parameter as a 0-dim tensor (torch's ``_to_scalar``)."""
    return x.squeeze() if isinstance(x, torch.Tensor) and x.dim() != 0 else x


def _scalar_dtype() -> torch.dtype:
    return torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32


class Muon(torch.optim.Optimizer):
    """``torch.optim.Muon`` for 2-D weights, AdamW for the rest, on a plain
    model or on parameters sharded by fullshard (either front door).

    Groups with ``use_muon`` True (the default, so ``Muon(model.parameters())``
    behaves like ``torch.optim.Muon``) run Muon: per parameter, ``B <- mu B + g``
    (as ``lerp``), ``U = g + mu B`` (nesterov) or ``B``, ``O = NS(U)``,
    ``x <- x (1 - lr wd) - adjust_lr(lr) O`` (torch's single-tensor code,
    bitwise). Groups with ``use_muon`` False run ``torch.optim.adamw.adamw``
    (bitwise ``torch.optim.AdamW`` on the same tensors) with the group's
    ``lr``, ``weight_decay``, ``adamw_betas`` and ``adamw_eps``; such a group
    given without ``lr`` (``weight_decay``) takes ``adamw_lr``
    (``adamw_weight_decay``) when set, so learning-rate schedulers and
    ``lr = 0`` act on both kinds of group alike. See
    :func:`muon_param_groups` for the usual split.

    On shards, every Muon parameter must be whole on one rank: build the model
    with ``shard_placement_fn=fullshard.optim.muon_placement_fn(model)``. The
    owner steps it; ranks holding zero rows skip it and keep an empty
    ``momentum_buffer`` (their rows of the state). AdamW groups step on any
    placement (element-wise).

    Args:
        params: parameters or groups (dicts; ``use_muon`` per group).
        lr, weight_decay, momentum, nesterov, ns_coefficients, eps, ns_steps,
            adjust_lr_fn: as ``torch.optim.Muon`` (same defaults: 1e-3, 0.1,
            0.95, True, (3.4445, -4.7750, 2.0315), 1e-7, 5, None).
        adamw_betas: AdamW's betas in ``use_muon=False`` groups (default (0.9, 0.95)).
        adamw_eps: AdamW's eps (default 1e-8).
        adamw_lr: ``lr`` of ``use_muon=False`` groups that name none
            (default None: ``lr``).
        adamw_weight_decay: ``weight_decay`` of ``use_muon=False`` groups that
            name none (default None: ``weight_decay``).

    State (per parameter, shaped like its local rows, dtype of its grad):
        Muon: ``momentum_buffer``. AdamW: ``step`` (0-dim fp32 CPU tensor),
        ``exp_avg``, ``exp_avg_sq``. DTensors like the parameter under
        ``fully_shard``.

    Raises:
        ValueError: invalid hyper-parameters; a parameter of a ``use_muon``
            group that is not 2-D (construction, like torch); at the first
            step, Muon parameters split over ranks (one error naming them and
            the fix), or a tensor-parallel parameter.
        RuntimeError: complex parameters or sparse gradients.
    """

    def __init__(self, params, lr: float = 1e-3, weight_decay: float = 0.1, momentum: float = 0.95,
                 nesterov: bool = True, ns_coefficients: tuple = (DEFAULT_A, DEFAULT_B, DEFAULT_C),
                 eps: float = EPS, ns_steps: int = DEFAULT_NS_STEPS, adjust_lr_fn: Optional[str] = None, *,
                 adamw_betas: tuple = (0.9, 0.95), adamw_eps: float = 1e-8, adamw_lr: Optional[float] = None,
                 adamw_weight_decay: Optional[float] = None):
        if isinstance(lr, torch.Tensor) and lr.numel() != 1:
            raise ValueError("Tensor lr must be 1-element")
        if not 0.0 <= lr:
            raise ValueError(f"Learning rate should be >= 0 but is: {lr}")
        if not 0.0 <= momentum:
            raise ValueError(f"momentum should be >= 0 but is: {momentum}")
        if not 0.0 <= weight_decay:
            raise ValueError(f"weight decay should be >= 0 but is: {weight_decay}")
        if adjust_lr_fn is not None and adjust_lr_fn not in ("original", "match_rms_adamw"):
            raise ValueError(f"Adjust learning rate function {adjust_lr_fn} is not supported")
        if not all(0.0 <= b < 1.0 for b in adamw_betas) or len(adamw_betas) != 2:
            raise ValueError(f"adamw_betas should be two values in [0, 1) but are: {adamw_betas}")
        if not 0.0 <= adamw_eps:
            raise ValueError(f"adamw_eps should be >= 0 but is: {adamw_eps}")
        defaults = {"lr": lr, "weight_decay": weight_decay, "momentum": momentum, "nesterov": nesterov,
                    "ns_coefficients": ns_coefficients, "eps": eps, "ns_steps": ns_steps,
                    "adjust_lr_fn": adjust_lr_fn, "use_muon": True, "adamw_betas": tuple(adamw_betas),
                    "adamw_eps": adamw_eps}
        self._adamw_defaults = {k: v for k, v in (("lr", adamw_lr), ("weight_decay", adamw_weight_decay))
                                if v is not None}
        self._where = shards.WhereCache()
        super().__init__(params, defaults)

    def add_param_group(self, param_group: dict) -> None:
        """torch's (an AdamW group without ``lr`` / ``weight_decay`` takes
        ``adamw_lr`` / ``adamw_weight_decay`` when set), then the 2-D check
        of ``torch.optim.Muon`` for ``use_muon`` groups.

        Raises:
            ValueError: a parameter of a ``use_muon`` group is not 2-D.
        """
        if not param_group.get("use_muon", True):
            param_group = {**self._adamw_defaults, **param_group}
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        if group["use_muon"]:
            for p in group["params"]:
                if p.ndim != 2:
                    raise ValueError(f"Muon only supports 2D parameters whereas we found a parameter with size: "
                                     f"{p.size()}; put it in a group with use_muon=False (AdamW), e.g. with "
                                     "fullshard.optim.muon_param_groups(model)")

    def state_kind(self, param: torch.Tensor, key: str) -> Optional[str]:
        """How state ``key`` of ``param`` is laid out over its shard group (for
        fullshard's checkpoints): every tensor but ``step`` is the parameter's rows."""
        return None if key == "step" else ROWS

    @torch.no_grad()
    def step(self, closure=None):
        """One optimization step (see the class docstring).

        Args:
            closure: re-evaluates the model and returns the loss (optional).
        Returns:
            The closure's loss, or None.
        """
        loss = shards.run_closure(closure)
        wheres = self._where.get(self)
        for group in self.param_groups:
            if group["use_muon"]:
                self._muon(group, wheres)
            else:
                self._adamw(group, wheres)
        return loss

    def _muon(self, group: dict, wheres: dict) -> None:
        lr = _to_scalar(group["lr"])
        weight_decay, momentum = group["weight_decay"], group["momentum"]
        for p in group["params"]:
            if p.grad is None:
                continue
            w = wheres[id(p)]
            shards.check_grad(p, w.name, "Muon")
            state = self.state[p]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = like_param(
                    p, torch.zeros_like(local_of(p.grad), memory_format=torch.preserve_format), w.shape)
            if not w.holds_all and not w.split:
                continue  # zero rows of a parameter another rank owns
            grad, buf, param = local_of(p.grad), local_of(state["momentum_buffer"]), local_of(p)
            if len(w.shape) != 2:
                raise ValueError("Param gradient must be a 2D matrix")
            # The momentum and Nesterov steps are element-wise: this rank's rows of them are the
            # single-device rows, bit for bit.
            buf.lerp_(grad, 1 - momentum)
            update = grad.lerp(buf, momentum) if group["nesterov"] else buf
            if w.split:
                # Rows spread over ranks (fully_shard, RowShard): gather the whole update, and every
                # rank of the shard group runs the same Newton-Schulz on it and keeps its rows.
                update = shards.gather_rows(update, w.info, "fullshard.optim.Muon")
            update = zeropower_via_newtonschulz(update, group["ns_coefficients"], group["ns_steps"], group["eps"])
            if w.split:
                lo, hi = w.info.row_range
                update = update[lo:hi]
            adjusted_lr = adjust_lr(lr, group["adjust_lr_fn"], w.shape)
            param.mul_(1 - lr * weight_decay)
            param.add_(update, alpha=-adjusted_lr)

    def _adamw(self, group: dict, wheres: dict) -> None:
        params, grads, exp_avgs, exp_avg_sqs, steps = [], [], [], [], []
        for p in group["params"]:
            if p.grad is None:
                continue
            w = wheres[id(p)]
            shards.check_grad(p, w.name, "AdamW")
            state = self.state[p]
            if not state:
                state["step"] = torch.tensor(0.0, dtype=_scalar_dtype())
                for key in ("exp_avg", "exp_avg_sq"):
                    state[key] = like_param(p, torch.zeros_like(local_of(p), memory_format=torch.preserve_format),
                                            w.shape)
            params.append(local_of(p))
            grads.append(local_of(p.grad))
            exp_avgs.append(local_of(state["exp_avg"]))
            exp_avg_sqs.append(local_of(state["exp_avg_sq"]))
            steps.append(state["step"])
        if not params:
            return
        beta1, beta2 = group["adamw_betas"]
        adamw(params, grads, exp_avgs, exp_avg_sqs, [], steps, foreach=None, capturable=False, differentiable=False,
              fused=None, grad_scale=None, found_inf=None, has_complex=False, amsgrad=False, beta1=beta1,
              beta2=beta2, lr=group["lr"], weight_decay=group["weight_decay"], eps=group["adamw_eps"],
              maximize=False)


# ------------------------------------------------------------------ the recipe
def _muon_names(model: nn.Module, exclude: Iterable[str], head_adamw: bool) -> dict[int, str]:
    """id(parameter) -> name of the parameters :func:`muon_param_groups` gives Muon."""
    linears = [(name, m) for name, m in model.named_modules() if isinstance(m, nn.Linear)]
    embedded = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    head = id(linears[-1][1].weight) if linears and head_adamw else None
    patterns = list(exclude)
    out = {}
    for name, m in linears:
        w = m._parameters.get("weight")
        full = clean_name(f"{name}.weight" if name else "weight")
        if w is None or w.ndim != 2 or id(w) in embedded or id(w) == head:
            continue
        if any(fnmatch.fnmatchcase(full, pat) for pat in patterns):
            continue
        out.setdefault(id(w), full)
    return out


def muon_param_groups(model: nn.Module, *, exclude: Iterable[str] = (), head_adamw: bool = True,
                      muon: Optional[dict] = None, adamw: Optional[dict] = None) -> list[dict]:
    """Muon's usual split of a model's parameters into two groups for :class:`Muon`.

    Muon gets the ``weight`` of every ``nn.Linear`` (2-D) except: one tied to
    an ``nn.Embedding``'s weight (GPT's output projection), the output head
    (the last ``nn.Linear`` in registration order, Llama's ``output``, when
    ``head_adamw``), and names matching an ``exclude`` pattern. AdamW gets
    everything else: embeddings, norms, biases, the head (Jordan et al. 2024).

    Call it on the model the optimizer steps (wrapped, after sharding); names
    are the unwrapped model's. On a part of a model (a pipeline stage) whose
    last ``nn.Linear`` is not the whole model's head, pass ``head_adamw=False``
    (and ``exclude`` the head where the part holds it), or a block matrix goes
    to AdamW.

    Args:
        model: the model (plain, FullyShardedDataParallel or fully_shard).
        exclude: ``fnmatch`` patterns of parameter names kept out of Muon
            (e.g. ``["layers.0.*"]``).
        head_adamw: give the last ``nn.Linear`` to AdamW.
        muon: extra options for the Muon group (e.g. ``{"lr": 0.02}``).
        adamw: extra options for the AdamW group (e.g. ``{"lr": 3e-4}``).
    Returns:
        ``[{"params": [...], "use_muon": True, **muon}, {"params": [...],
        "use_muon": False, **adamw}]``, empty groups left out; each parameter
        once, in ``model.parameters()`` order.
    """
    chosen = _muon_names(model, exclude, head_adamw)
    muon_params, adamw_params = [], []
    for p in model.parameters():
        (muon_params if id(p) in chosen else adamw_params).append(p)
    groups = []
    if muon_params:
        groups.append({"params": muon_params, **(muon or {}), "use_muon": True})
    if adamw_params:
        groups.append({"params": adamw_params, **(adamw or {}), "use_muon": False})
    return groups


def muon_placement_fn(model: nn.Module, *, exclude: Iterable[str] = (),
                      head_adamw: bool = True) -> Callable[[torch.Tensor], Optional[Owned]]:
    """A ``shard_placement_fn`` giving each Muon parameter (as chosen by
    :func:`muon_param_groups` with the same arguments) to one rank:
    ``Owned()`` (fullshard balances owners), None (row sharding) otherwise.

    Pass it to ``FullyShardedDataParallel(..., shard_placement_fn=...)`` or
    ``fully_shard(..., shard_placement_fn=...)``; build it on the unwrapped
    model, before any wrapping (parameters are recognized by identity).

    Raises:
        ValueError: ``model`` already holds parameters sharded by fullshard.
    """
    for name, p in model.named_parameters():
        if shard_info(p) is not None:
            raise ValueError(f"muon_placement_fn: parameter '{clean_name(name)}' is already sharded by fullshard; "
                             "build the placement function on the unwrapped model, before wrapping it")
    shapes = {id(p): p.shape for p in model.parameters()}
    chosen = {i: shapes[i] for i in _muon_names(model, exclude, head_adamw)}

    def placement(param: torch.Tensor) -> Optional[Owned]:
        # The shape guards against an id reused by a tensor made after this call.
        return Owned() if chosen.get(id(param)) == param.shape else None

    return placement
