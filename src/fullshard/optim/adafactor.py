"""Adafactor (``torch.optim.Adafactor``'s algorithm) on a plain model or on
fullshard's shards.

Adafactor (Shazeer & Stern 2018, "Adafactor: Adaptive Learning Rates with
Sublinear Memory Cost", §3 factored second moments, §4 update clipping, §5
relative step size with parameter scale; torch's variant of eps1 and lr)
keeps, for a matrix, a row mean and a column mean of the squared gradient.
On dim-0 shards (see ``shards.py`` [Note: optimizers on shards]):

* row statistics (``row_var``) are local: each rank keeps its rows';
* the column means (``col_var``) and the mean of ``row_var`` sum over all
  rows: partial sums are added over the shard group;
* the parameter's RMS (relative step size) and the update's RMS (clipping,
  §4) are whole-tensor norms: squared partial norms are added likewise.

All of a step's sums go in two all-reduces per shard group (statistics,
then update norms); none when every parameter is whole on one rank of a
one-rank group. A parameter held whole by one rank of a larger group (``Owned``)
is computed by its holder with torch's operations (bitwise); only its column
sums travel (zeros from the others), so ``col_var`` is the same on every rank.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Optional

import torch

from ..core.params import local_of
from . import shards
from .shards import REPLICATED, ROWS, GroupSums, like_param


def _to_scalar(x):
    return x.squeeze() if isinstance(x, torch.Tensor) and x.dim() != 0 else x


def _scalar_dtype() -> torch.dtype:
    return torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32


@dataclasses.dataclass(eq=False)
class _Pending:
    """A parameter whose step waits for group sums."""

    where: shards.Where
    param: torch.Tensor  # local rows
    grad: torch.Tensor
    state: dict
    group: dict
    eps1: float
    one_minus_beta2: float
    rho: float
    norm_ticket: Optional[tuple] = None
    col_ticket: Optional[tuple] = None
    row_ticket: Optional[tuple] = None
    update_ticket: Optional[tuple] = None
    alpha: float = 0.0
    update: Optional[torch.Tensor] = None


class Adafactor(torch.optim.Optimizer):
    """``torch.optim.Adafactor`` on a plain model or on parameters sharded by
    fullshard (either front door, any placement).

    Per parameter with gradient ``G`` (Shazeer & Stern 2018, Alg. 4 and 5 as
    torch writes them): ``t += 1``, ``beta2_t = 1 - t^beta2_decay``,
    ``rho_t = min(lr, 1/sqrt(t))``, ``alpha = max(eps2, RMS(x)) rho_t``,
    ``x <- x (1 - lr wd)``; for ``G`` of 2 or more dims ``R <- lerp(R,
    mean_-1(G^2))``, ``C <- lerp(C, mean_-2(G^2))``, ``V = R C /
    max(mean_-2(R), eps1)``; else ``V <- lerp(V, G^2)``; ``U = G /
    max(sqrt(V), eps1)``, ``x <- x - alpha U / max(1, RMS(U)/d)``. RMS and the
    means over dim 0 of a split parameter sum over its shard group.

    Args:
        params: parameters or groups.
        lr: maximum relative step size and weight-decay scale (default 1e-2).
        beta2_decay: decay rate exponent, <= 0 (default -0.8).
        eps: ``(eps1, eps2)``; eps1 None means the parameter dtype's machine
            epsilon (default (None, 1e-3)).
        d: update clipping threshold, >= 1 (default 1.0).
        weight_decay: decoupled weight decay (default 0.0).
        foreach: accepted for torch's signature; the single-tensor path always runs.
        maximize: maximize the objective (default False).

    State (per parameter; on this rank's rows, dtype of the gradient):
        ``step`` (0-dim fp32 CPU tensor); for ``n``-row local shards of 2-D
        ``(R, C)`` parameters ``row_var (n, 1)`` and ``col_var (1, C)`` (the
        same on every rank of the shard group); for ``(n, *A, B, C)``
        ``row_var (n, *A, B, 1)`` and ``col_var (n, *A, 1, C)``; for 0/1-D
        ``variance`` of the parameter's local shape. DTensors under
        ``fully_shard`` (``col_var`` of a matrix replicated).

    Raises:
        ValueError: invalid hyper-parameters; a tensor-parallel parameter (first step).
        RuntimeError: complex parameters or sparse gradients.
    """

    def __init__(self, params, lr: float = 1e-2, beta2_decay: float = -0.8, eps: tuple = (None, 1e-3),
                 d: float = 1.0, weight_decay: float = 0.0, *, foreach: Optional[bool] = None,
                 maximize: bool = False):
        if isinstance(lr, torch.Tensor) and lr.numel() != 1:
            raise ValueError("Tensor lr must be 1-element")
        if not 0.0 <= lr:
            raise ValueError(f"Learning rate should be >= 0 but is: {lr}")
        if not 0.0 >= beta2_decay:
            raise ValueError(f"beta2_decay should be <= 0 but is: {beta2_decay}")
        if eps[0] is not None and not 0.0 <= eps[0]:
            raise ValueError(f"epsilon1 should be >= 0 but is: {eps[0]}")
        if not 0.0 <= eps[1]:
            raise ValueError(f"epsilon2 should be >= 0 but is: {eps[1]}")
        if not 1.0 <= d:
            raise ValueError(f"Clipping threshold d should be >= 1 but is: {d}")
        if not 0.0 <= weight_decay:
            raise ValueError(f"weight_decay should be >= 0 but is: {weight_decay}")
        defaults = {"lr": lr, "beta2_decay": beta2_decay, "eps": eps, "d": d, "weight_decay": weight_decay,
                    "foreach": foreach, "maximize": maximize}
        self._where = shards.WhereCache()
        super().__init__(params, defaults)

    def state_kind(self, param: torch.Tensor, key: str) -> Optional[str]:
        """How state ``key`` of ``param`` is laid out over its shard group (for
        fullshard's checkpoints): ``col_var`` of a matrix is replicated, the
        other tensors but ``step`` are the parameter's rows."""
        if key == "step":
            return None
        return REPLICATED if key == "col_var" and param.ndim == 2 else ROWS

    def _init_state(self, p: torch.Tensor, w: shards.Where) -> dict:
        state = self.state[p]
        if len(state) == 0:
            state["step"] = torch.tensor(0.0, dtype=_scalar_dtype())
            grad = local_of(p.grad)
            if grad.dim() > 1:
                state["row_var"] = like_param(p, grad.new_zeros(grad.shape[:-1] + (1,)), w.shape[:-1] + (1,))
                col = grad.new_zeros(grad.shape[:-2] + (1, grad.shape[-1]))
                full = w.shape[:-2] + (1, w.shape[-1])
                state["col_var"] = like_param(p, col, full, replicated=grad.dim() == 2)
            else:
                state["variance"] = like_param(p, torch.zeros_like(grad, memory_format=torch.preserve_format),
                                               w.shape)
        return state

    @torch.no_grad()
    def step(self, closure=None):
        """One optimization step (see the class docstring); two all-reduces per
        shard group when some parameter needs group sums.

        Args:
            closure: re-evaluates the model and returns the loss (optional).
        Returns:
            The closure's loss, or None.
        """
        loss = shards.run_closure(closure)
        wheres = self._where.get(self)
        stats = GroupSums("fullshard.optim.Adafactor statistics")
        pending = []
        for group in self.param_groups:
            eps1 = group["eps"][0]
            for p in group["params"]:
                if p.grad is None:
                    continue
                w = wheres[id(p)]
                shards.check_grad(p, w.name, "Adafactor")
                state = self._init_state(p, w)
                if eps1 is None:  # as torch: the first parameter's dtype sets it for the group
                    eps1 = torch.finfo(p.dtype).eps
                rec = self._begin(p, w, state, group, eps1, stats)
                if rec is not None:
                    pending.append(rec)
        stats.reduce()
        norms = GroupSums("fullshard.optim.Adafactor update norms")
        for rec in pending:
            self._middle(rec, stats, norms)
        norms.reduce()
        for rec in pending:
            self._finish(rec, norms)
        return loss

    def _begin(self, p, w, state, group, eps1, stats: GroupSums) -> Optional[_Pending]:
        """Step ``p`` whole (torch's operations) when nothing needs group sums;
        else the local part, queueing its sums."""
        grad = local_of(p.grad)
        grad = -grad if group["maximize"] else grad
        param = local_of(p)
        lr = _to_scalar(group["lr"])
        step_t = state["step"]
        step_t += 1
        step_float = step_t.item()
        one_minus_beta2 = step_float ** group["beta2_decay"]
        rho = min(lr, 1 / (step_float ** 0.5))
        if w.group is None:
            self._whole(param, grad, state, group, eps1, one_minus_beta2, rho)
            return None
        rec = _Pending(w, param, grad, state, group, eps1, one_minus_beta2, rho)
        if w.split:
            rec.norm_ticket = stats.add(w.group, shards.sq_norm(param))
        if grad.dim() > 1:
            row_mean = torch.norm(grad, dim=-1, keepdim=True).square_().div_(grad.size(-1))
            local_of(state["row_var"]).lerp_(row_mean, one_minus_beta2)
            if grad.dim() == 2:  # the column statistics span all rows: summed over the group
                rec.col_ticket = stats.add(w.group, torch.norm(grad, dim=-2, keepdim=True).square_())
                if w.split:
                    rec.row_ticket = stats.add(w.group, local_of(state["row_var"]).sum(dim=-2, keepdim=True))
        return rec

    def _whole(self, param, grad, state, group, eps1, one_minus_beta2, rho) -> None:
        """torch's single-tensor Adafactor step on a parameter this rank holds whole (torch 2.13)."""
        lr, weight_decay = _to_scalar(group["lr"]), group["weight_decay"]
        alpha = max(group["eps"][1], param.norm(2).item() / (param.numel() ** 0.5)) * rho
        if weight_decay != 0:
            param.mul_(1 - lr * weight_decay)
        if grad.dim() > 1:
            row_var, col_var = local_of(state["row_var"]), local_of(state["col_var"])
            row_mean = torch.norm(grad, dim=-1, keepdim=True).square_().div_(grad.size(-1))
            row_var.lerp_(row_mean, one_minus_beta2)
            col_mean = torch.norm(grad, dim=-2, keepdim=True).square_().div_(grad.size(-2))
            col_var.lerp_(col_mean, one_minus_beta2)
            var_estimate = row_var @ col_var
            var_estimate.div_(row_var.mean(dim=-2, keepdim=True).clamp_(min=eps1))
        else:
            variance = local_of(state["variance"])
            variance.lerp_(grad * grad, one_minus_beta2)
            var_estimate = variance.clone()
        update = var_estimate.clamp_(min=eps1 * eps1).rsqrt_()
        update.mul_(grad)
        denom = max(1.0, update.norm(2).item() / ((update.numel() ** 0.5) * group["d"]))
        param.add_(update, alpha=-alpha / denom)

    def _middle(self, rec: _Pending, stats: GroupSums, norms: GroupSums) -> None:
        """With the statistics summed: decay, the update, and its norm (queued when split)."""
        w, param, grad, state, group = rec.where, rec.param, rec.grad, rec.state, rec.group
        holder = w.holds_all
        if w.split:
            rec.alpha = max(group["eps"][1], math.sqrt(stats.get(rec.norm_ticket).item()) / (w.numel ** 0.5)) * rec.rho
        elif holder:
            rec.alpha = max(group["eps"][1], param.norm(2).item() / (param.numel() ** 0.5)) * rec.rho
        lr, weight_decay = _to_scalar(group["lr"]), group["weight_decay"]
        if weight_decay != 0:
            param.mul_(1 - lr * weight_decay)
        if grad.dim() > 1:
            row_var, col_var = local_of(state["row_var"]), local_of(state["col_var"])
            if grad.dim() == 2:
                col_mean = stats.get(rec.col_ticket).to(grad.dtype).div_(w.shape[-2])
            else:
                col_mean = torch.norm(grad, dim=-2, keepdim=True).square_().div_(grad.size(-2))
            col_var.lerp_(col_mean, rec.one_minus_beta2)
            if not w.split and not holder:
                return  # zero rows: only the replicated column statistics to keep
            var_estimate = row_var @ col_var
            if rec.row_ticket is not None:
                row_mean = stats.get(rec.row_ticket).to(row_var.dtype).div_(w.shape[-2])
            else:
                row_mean = row_var.mean(dim=-2, keepdim=True)
            var_estimate.div_(row_mean.clamp_(min=rec.eps1))
        else:
            variance = local_of(state["variance"])
            variance.lerp_(grad * grad, rec.one_minus_beta2)
            var_estimate = variance.clone()
        if not w.split and not holder:
            return
        update = var_estimate.clamp_(min=rec.eps1 * rec.eps1).rsqrt_()
        update.mul_(grad)
        rec.update = update
        if w.split:
            rec.update_ticket = norms.add(w.group, shards.sq_norm(update))

    def _finish(self, rec: _Pending, norms: GroupSums) -> None:
        if rec.update is None:
            return
        if rec.update_ticket is not None:
            norm = math.sqrt(norms.get(rec.update_ticket).item())
        else:
            norm = rec.update.norm(2).item()
        denom = max(1.0, norm / ((rec.where.numel ** 0.5) * rec.group["d"]))
        rec.param.add_(rec.update, alpha=-rec.alpha / denom)
        rec.update = None
