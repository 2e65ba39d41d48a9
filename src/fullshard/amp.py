"""Dynamic loss scaling for gradients that are shards (fp16 training).

:class:`ShardedGradScaler` is used like ``torch.amp.GradScaler``::

    scaler = ShardedGradScaler(init_scale=128.0)
    scaler.scale(loss).backward()
    scaler.unscale_(optimizer)          # optional: before clipping
    model.clip_grad_norm_(1.0)
    scaler.step(optimizer)              # skipped when any rank saw inf/NaN
    scaler.update()

[Note: one decision for all ranks]
Under FSDP each rank holds different gradient shards, so an overflow may be
visible on one rank only. Each rank checks its own shards (and any replicated,
unsharded gradients), then ONE all-reduce (MAX) of a 1-element found-inf flag
over the process group makes every rank skip the same step and back off the
scale together; otherwise ranks' parameters would silently diverge.

Loss-scale schedule: Micikevicius et al., "Mixed Precision Training", ICLR
2018, §3.2 (dynamic scaling), with fairseq's ``DynamicLossScaler`` knobs
(``--fp16-init-scale``, ``--fp16-scale-window``, ``--min-loss-scale``).
"""
from __future__ import annotations

from collections import defaultdict
from typing import Any, Optional

import torch

from .core import collectives, torch_private
from .core.params import local_of

_MIN_SCALE_MESSAGE = (
    "Minimum loss scale reached ({}). Your loss is probably exploding. Try lowering the learning rate, "
    "using gradient clipping or increasing the batch size.")


def all_reduce_found_inf(flag: torch.Tensor, group) -> torch.Tensor:
    """Make ``flag`` the maximum over ``group`` (in place): 1.0 if any rank found inf/NaN.

    Args:
        flag: 1-element fp32 tensor, 0.0 or 1.0.
        group: process group (None = the whole world).
    Returns:
        ``flag``, now identical on every rank of the group.
    """
    if collectives.is_initialized():
        group = collectives.world_group() if group is None else group
        collectives.all_reduce(flag, group, "max", tag="loss scaler inf check")
    return flag


def _unscale_and_check(grads: list[torch.Tensor], inv_scale: float) -> torch.Tensor:
    """Multiply ``grads`` by ``inv_scale`` in place; return a (1,) fp32 CPU flag,
    1.0 if any element is inf or NaN (checked before unscaling, like torch's).
    A sparse gradient must be coalesced (its ``values()`` is then a view)."""
    found = torch.zeros(1, dtype=torch.float32)
    by_key: dict[tuple, list[torch.Tensor]] = defaultdict(list)
    for g in grads:
        if g.is_sparse:
            g = g.values()
        by_key[(g.device, g.dtype)].append(g)
    for (device, _), group in by_key.items():
        dev_found = torch.zeros(1, dtype=torch.float32, device=device)
        inv = torch.full((1,), inv_scale, dtype=torch.float32, device=device)
        try:
            torch_private.unscale_and_check_(group, dev_found, inv)
        except (RuntimeError, NotImplementedError):
            # Fallback for a backend/dtype without the fused kernel.
            finite = torch.stack([torch.isfinite(g).all() for g in group]).all()
            dev_found.fill_(0.0 if bool(finite) else 1.0)
            torch_private.foreach_mul_(group, inv_scale)
        found = torch.maximum(found, dev_found.cpu())
    return found


class ShardedGradScaler:
    """Dynamic loss scaler whose overflow check spans all ranks of a process group.

    Args:
        init_scale: initial loss scale S (fairseq ``--fp16-init-scale``, default 128
            there; ``2**16`` in torch).
        growth_factor: multiply S by this after ``growth_interval`` clean steps.
        backoff_factor: multiply S by this after a step with inf/NaN gradients.
        growth_interval: consecutive clean steps before growing (fairseq
            ``--fp16-scale-window``).
        min_loss_scale: backing off to S <= this raises ``FloatingPointError``
            (fairseq ``--min-loss-scale``); 0 disables the check.
        process_group: group over which the found-inf flag is reduced (None =
            the world). Must contain every rank that holds a shard; for a
            model wrapped on a process group pass that group, or the scaler
            couples it to whatever the other ranks run (another model's
            overflow would skip this model's step).
        enabled: False makes every method a pass-through (``scale`` returns the
            loss, ``step`` steps, ``get_scale`` is 1.0) so callers need no branches.

    Raises:
        ValueError: non-positive ``init_scale``, ``growth_factor`` <= 1,
            ``backoff_factor`` outside (0, 1) or ``growth_interval`` < 1.
    """

    def __init__(self, init_scale: float = 2.0**16, growth_factor: float = 2.0, backoff_factor: float = 0.5,
                 growth_interval: int = 2000, min_loss_scale: float = 1e-4, process_group=None,
                 enabled: bool = True):
        if init_scale <= 0:
            raise ValueError(f"ShardedGradScaler: init_scale must be > 0, got {init_scale}")
        if growth_factor <= 1.0:
            raise ValueError(f"ShardedGradScaler: growth_factor must be > 1, got {growth_factor}")
        if not 0.0 < backoff_factor < 1.0:
            raise ValueError(f"ShardedGradScaler: backoff_factor must be in (0, 1), got {backoff_factor}")
        if growth_interval < 1:
            raise ValueError(f"ShardedGradScaler: growth_interval must be >= 1, got {growth_interval}")
        self._scale = float(init_scale)
        self._growth_factor = float(growth_factor)
        self._backoff_factor = float(backoff_factor)
        self._growth_interval = int(growth_interval)
        self._min_loss_scale = float(min_loss_scale)
        self._growth_tracker = 0
        self._group = process_group
        self._enabled = enabled
        # id(optimizer) -> {"unscaled": bool, "found_inf": bool} for the current step.
        self._per_optimizer: dict[int, dict[str, bool]] = {}
        self._last_step_skipped = False

    # ---------------------------------------------------------------- scaling
    def is_enabled(self) -> bool:
        return self._enabled

    def scale(self, outputs: Any) -> Any:
        """Multiply a loss (tensor, or nested list/tuple of tensors) by S.

        Returns:
            The scaled tensors; the product is in the outputs' own dtype.
        """
        if not self._enabled:
            return outputs
        if torch.is_tensor(outputs):
            return outputs * torch.tensor(self._scale, dtype=torch.float32, device=outputs.device)
        if isinstance(outputs, (list, tuple)):
            return type(outputs)(self.scale(o) for o in outputs)
        raise TypeError(f"ShardedGradScaler.scale takes tensors or lists/tuples of them, got {type(outputs)}")

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Divide ``optimizer``'s gradients by S in place and decide, over all
        ranks, whether any is inf/NaN (one all-reduce of a 1-element flag).

        Raises:
            RuntimeError: called twice for one optimizer before ``update()``; ``optimizer`` is an
                ``OffloadAdamW`` (its units step during backward, before any inf check).
        """
        if not self._enabled:
            return
        if getattr(optimizer, "steps_in_backward", False):  # OffloadAdamW (amp imports only core)
            raise RuntimeError("ShardedGradScaler cannot drive OffloadAdamW: its units step during backward, before "
                               "the scaler's inf check; train in bfloat16 or float32 without a scaler")
        state = self._per_optimizer.setdefault(id(optimizer), {"unscaled": False, "found_inf": False})
        if state["unscaled"]:
            raise RuntimeError("unscale_() has already been called on this optimizer since the last update().")
        grads = []
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p.grad is not None and p.grad.is_sparse and not p.grad.is_coalesced():
                    # Unscaling a coalesced copy would leave p.grad scaled by S.
                    p.grad = p.grad.coalesce()
                if p.grad is not None:
                    # A DTensor gradient (fully_shard): its local shard, which the kernel
                    # unscales in place; the flag below then spans the ranks.
                    grads.append(local_of(p.grad))
        flag = _unscale_and_check(grads, 1.0 / self._scale)
        all_reduce_found_inf(flag, self._group)
        state["unscaled"] = True
        state["found_inf"] = bool(flag.item())

    def step(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Optional[Any]:
        """Unscale (if not done yet) and call ``optimizer.step()`` unless any
        rank found inf/NaN; returns the step's result, or None when skipped."""
        if not self._enabled:
            return optimizer.step(*args, **kwargs)
        state = self._per_optimizer.get(id(optimizer))
        if state is None or not state["unscaled"]:
            self.unscale_(optimizer)
            state = self._per_optimizer[id(optimizer)]
        if state["found_inf"]:
            return None
        return optimizer.step(*args, **kwargs)

    def update(self, new_scale: Optional[float] = None) -> None:
        """Adjust S for the next step: back off after an overflow, grow after
        ``growth_interval`` clean steps (or set ``new_scale``).

        Raises:
            FloatingPointError: backing off would take S to ``min_loss_scale``
                or below (S is left unchanged), with fairseq's message.
        """
        if not self._enabled:
            return
        found_inf = any(s["found_inf"] for s in self._per_optimizer.values())
        self._per_optimizer.clear()
        self._last_step_skipped = found_inf
        if new_scale is not None:
            self._scale = float(new_scale)
            self._growth_tracker = 0
            return
        if found_inf:
            backed_off = self._scale * self._backoff_factor
            if backed_off <= self._min_loss_scale:
                raise FloatingPointError(_MIN_SCALE_MESSAGE.format(self._min_loss_scale))
            self._scale = backed_off
            self._growth_tracker = 0
            return
        self._growth_tracker += 1
        if self._growth_tracker == self._growth_interval:
            self._scale *= self._growth_factor
            self._growth_tracker = 0

    # ----------------------------------------------------------------- queries
    def get_scale(self) -> float:
        """The current loss scale S (1.0 when disabled)."""
        return self._scale if self._enabled else 1.0

    @property
    def last_step_skipped(self) -> bool:
        """True when the step before the last ``update()`` found inf/NaN on
        some rank and was skipped (identical on every rank)."""
        return self._last_step_skipped

    def get_growth_factor(self) -> float:
        return self._growth_factor

    def get_backoff_factor(self) -> float:
        return self._backoff_factor

    def get_growth_interval(self) -> int:
        return self._growth_interval

    # ------------------------------------------------------------ state dicts
    def state_dict(self) -> dict:
        """Scale and schedule (torch ``GradScaler`` keys plus ``min_loss_scale``);
        empty when disabled, as torch's."""
        if not self._enabled:
            return {}
        return {"scale": self._scale, "growth_factor": self._growth_factor,
                "backoff_factor": self._backoff_factor, "growth_interval": self._growth_interval,
                "_growth_tracker": self._growth_tracker, "min_loss_scale": self._min_loss_scale}

    def load_state_dict(self, state_dict: dict) -> None:
        """Restore from :meth:`state_dict` (or a torch ``GradScaler`` state dict).

        Raises:
            RuntimeError: the state dict is empty (saved from a disabled scaler).
        """
        if not self._enabled:
            return
        if not state_dict:
            raise RuntimeError("The source state dict is empty, possibly because it was saved "
                               "from a disabled instance of ShardedGradScaler.")
        self._scale = float(state_dict["scale"])
        self._growth_factor = float(state_dict["growth_factor"])
        self._backoff_factor = float(state_dict["backoff_factor"])
        self._growth_interval = int(state_dict["growth_interval"])
        self._growth_tracker = int(state_dict["_growth_tracker"])
        self._min_loss_scale = float(state_dict.get("min_loss_scale", self._min_loss_scale))
