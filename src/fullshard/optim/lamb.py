"""LAMB on a plain model or on fullshard's shards.

You et al. 2020, "Large Batch Optimization for Deep Learning: Training BERT
in 76 minutes" (ICLR), Algorithm 2: Adam's moments with bias correction, the
update ``r + wd x``, scaled per tensor by the trust ratio ``||x|| / ||r + wd
x||`` (``phi`` the identity; ratio 1 when either norm is 0). Both norms are
whole-tensor norms: on a split parameter (see ``shards.py`` [Note:
optimizers on shards]) the squared partial norms are summed over the shard
group, all parameters of a step in one all-reduce per group.
"""
from __future__ import annotations

import math
from typing import Optional

import torch

from ..core.params import local_of
from . import shards
from .shards import ROWS, GroupSums, like_param


class Lamb(torch.optim.Optimizer):
    """LAMB (You et al. 2020, Algorithm 2) with decoupled weight decay.

    Per parameter ``x`` with gradient ``g``: ``t += 1``, ``m <- b1 m + (1 -
    b1) g``, ``v <- b2 v + (1 - b2) g^2``, ``r = (m / (1 - b1^t)) / (sqrt(v /
    (1 - b2^t)) + eps)``, ``u = r + weight_decay x``, ``x <- x - lr
    (||x|| / ||u||) u`` (norms over the whole tensor; ratio 1 when either is
    0). The defaults are NVIDIA apex's ``FusedLAMB`` (which fairseq's
    ``--optimizer lamb`` wraps) with its trust ratio on every tensor
    (``use_nvlamb``) and no global gradient clipping; fairseq's flags are
    ``--lamb-betas`` (0.9, 0.999), ``--lamb-eps`` (default 1e-8, not
    apex's 1e-6) and ``--weight-decay`` (0.0).

    Args:
        params: parameters or groups.
        lr: learning rate (default 1e-3).
        betas: ``(b1, b2)`` of the moments (default (0.9, 0.999)).
        eps: added to ``sqrt(v_hat)`` (default 1e-6).
        weight_decay: ``wd`` of the update ``r + wd x`` (default 0.0).

    State (per parameter; this rank's rows, the parameter's dtype):
        ``step`` (0-dim fp32 CPU tensor), ``exp_avg``, ``exp_avg_sq``
        (DTensors like the parameter under ``fully_shard``).

    Raises:
        ValueError: invalid hyper-parameters; a tensor-parallel parameter (first step).
        RuntimeError: complex parameters or sparse gradients.
    """

    def __init__(self, params, lr: float = 1e-3, betas: tuple = (0.9, 0.999), eps: float = 1e-6,
                 weight_decay: float = 0.0):
        if not 0.0 <= float(lr):
            raise ValueError(f"Learning rate should be >= 0 but is: {lr}")
        if len(betas) != 2 or not all(0.0 <= b < 1.0 for b in betas):
            raise ValueError(f"betas should be two values in [0, 1) but are: {betas}")
        if not 0.0 <= eps:
            raise ValueError(f"eps should be >= 0 but is: {eps}")
        if not 0.0 <= weight_decay:
            raise ValueError(f"weight_decay should be >= 0 but is: {weight_decay}")
        self._where = shards.WhereCache(any_dim=True)  # norms only: any sharded dim will do
        super().__init__(params, {"lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": weight_decay})

    def state_kind(self, param: torch.Tensor, key: str) -> Optional[str]:
        """How state ``key`` of ``param`` is laid out over its shard group (for
        fullshard's checkpoints): every tensor but ``step`` is the parameter's rows."""
        return None if key == "step" else ROWS

    @torch.no_grad()
    def step(self, closure=None):
        """One optimization step (see the class docstring); one all-reduce per
        shard group when some parameter is split over ranks.

        Args:
            closure: re-evaluates the model and returns the loss (optional).
        Returns:
            The closure's loss, or None.
        """
        loss = shards.run_closure(closure)
        wheres = self._where.get(self)
        sums = GroupSums("fullshard.optim.Lamb norms")
        pending = []
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            lr = float(group["lr"])
            for p in group["params"]:
                if p.grad is None:
                    continue
                w = wheres[id(p)]
                shards.check_grad(p, w.name, "Lamb")
                state = self.state[p]
                if not state:
                    state["step"] = torch.tensor(0.0, dtype=torch.float32)
                    for key in ("exp_avg", "exp_avg_sq"):
                        state[key] = like_param(p, torch.zeros_like(local_of(p), memory_format=torch.preserve_format),
                                                w.shape)
                param, grad = local_of(p), local_of(p.grad)
                exp_avg, exp_avg_sq = local_of(state["exp_avg"]), local_of(state["exp_avg_sq"])
                state["step"] += 1
                t = state["step"].item()
                exp_avg.mul_(beta1).add_(grad, alpha=1 - beta1)
                exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
                update = (exp_avg / (1 - beta1 ** t)).div_((exp_avg_sq / (1 - beta2 ** t)).sqrt_().add_(group["eps"]))
                if group["weight_decay"] != 0:
                    update.add_(param, alpha=group["weight_decay"])
                if w.split:
                    pending.append((param, update, lr, sums.add(w.group, torch.cat([shards.sq_norm(param),
                                                                                    shards.sq_norm(update)]))))
                elif w.holds_all:
                    _apply(param, update, lr, torch.linalg.vector_norm(param).item(),
                           torch.linalg.vector_norm(update).item())
        sums.reduce()
        for param, update, lr, ticket in pending:
            sq = sums.get(ticket).tolist()
            _apply(param, update, lr, math.sqrt(sq[0]), math.sqrt(sq[1]))
        return loss


def _apply(param: torch.Tensor, update: torch.Tensor, lr: float, param_norm: float, update_norm: float) -> None:
    """``x <- x - lr * trust * u`` with ``trust = ||x|| / ||u||`` (1 when either is 0)."""
    trust = param_norm / update_norm if param_norm > 0 and update_norm > 0 else 1.0
    param.add_(update, alpha=-lr * trust)
