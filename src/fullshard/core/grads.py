"""Gradient bookkeeping of a unit beyond the reduce itself: the full
gradient autograd writes into a pooled buffer (recording which parameters
were used in a backward), and installing or adding a gradient shard as a
sharded parameter's ``.grad``. The ``no_sync`` stash is core/stash.py.
"""
from __future__ import annotations

from typing import Optional

import torch

from . import flat, torch_private
from .buffers import POOL


class UnflattenFull(torch.autograd.Function):
    """Full-parameter views of a unit's unsharded flat parameter whose
    backward writes the unit's full gradient into a pooled buffer.

    [Note: pooled full gradient]
    ``split_with_sizes`` views would do, but their backward concatenates the
    parameters' gradients into a fresh ``N·S``-element tensor every backward
    (``SplitWithSizesBackward``): on the host that is one unit-sized malloc
    and free per unit per iteration, the allocations that keep glibc's heap
    large (see core/buffers.py [Note: buffer reuse]). Here the backward copies
    each gradient into a buffer from the pool (zeros where a parameter got no
    gradient, and in the padding) and returns it; ``AccumulateGrad`` adopts
    it as ``flat_full.grad`` without a copy when the unit has no gradient yet,
    and the unit hands it back after the reduce-scatter's input is written
    (:meth:`PooledGrad.release`). All views still meet in this one node, so
    the post-accumulate-grad hook runs once per backward, as before. The node
    also records which parameters received a gradient (``Unit.mark_used``).

    Inputs: ``flat_full`` (1-D, param-major, ``N·S`` elements), a weak
    reference to the unit, the layout. Outputs: one view per layout
    parameter, in its full shape.
    """

    @staticmethod
    def forward(ctx, flat_full, unit_ref, layout):
        ctx.unit_ref, ctx.layout = unit_ref, layout
        ctx.set_materialize_grads(False)
        return tuple(flat.unsharded_views(flat_full, layout))

    @staticmethod
    def backward(ctx, *grads):
        layout, unit = ctx.layout, ctx.unit_ref()
        like = next((g for g in grads if g is not None), None)
        if like is None:
            return None, None, None
        if unit is None:  # the model is gone; any correct gradient will do
            out = torch.zeros(layout.unsharded_numel, dtype=like.dtype, device=like.device)
        else:
            grads = _run_gradient_hooks(unit, grads)
            out = unit.pooled_grad.take(unit.layout.unsharded_numel, like.dtype, like.device)
        with torch.no_grad():  # the reduce path is not differentiable either
            zero, dst, src = [], [], []
            end = max((p.full_offset + p.full_span for p in layout.params), default=0)
            if end < out.numel():  # past the owned parameters (flat.py [Note: flat layouts])
                zero.append(out[end:])
            for i, (p, g) in enumerate(zip(layout.params, grads)):
                seg = out[p.full_offset:p.full_offset + p.full_span]
                if g is None:
                    zero.append(seg)
                else:
                    if unit is not None:
                        unit.mark_used(i)
                    dst.append(seg[:p.numel].view(p.shape))
                    src.append(g)
                    if p.full_span > p.numel:
                        zero.append(seg[p.numel:])
            if dst:
                torch_private.foreach_copy_(dst, src)
            if zero:
                torch_private.foreach_zero_(zero)
        return out, None, None


def _run_gradient_hooks(unit, grads: tuple) -> tuple:
    """Run the hooks a user registered on a sharded parameter (``param.register_hook``) on its full
    gradient of this backward, as autograd runs them on a leaf's gradient before accumulating it, and as
    DDP runs them before averaging: each hook gets this rank's unsharded gradient (a plain tensor of the
    parameter's full shape) and may return a replacement."""
    out = None
    for i, (slot, g) in enumerate(zip(unit.slots, grads)):
        hooks = torch_private.gradient_hooks(slot.sharded) if g is not None else ()
        for hook in hooks:
            new = hook(g)
            if new is not None:
                g = new
        if hooks:
            out = out or list(grads)
            out[i] = g
    return grads if out is None else tuple(out)


class PooledGrad:
    """The pooled buffer a unit handed to autograd for its full gradient
    (see [Note: pooled full gradient]) until the unit settles it."""

    def __init__(self):
        # (data_ptr, nbytes) of the buffer handed out and not yet settled.
        self.held: Optional[tuple[int, int]] = None

    def take(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A pooled ``numel``-element (``N·S``) buffer for this backward's full gradient."""
        self.release(None)  # an earlier one autograd did not adopt
        buf = POOL.take(numel, dtype, device)
        self.held = (buf.data_ptr(), buf.untyped_storage().nbytes())
        return buf

    def release(self, grad: Optional[torch.Tensor], keep: bool = False) -> None:
        """Settle the pooled full gradient once ``grad`` (from
        ``Unit.take_full_grad``, or None) is no longer needed. When ``grad``
        is the pooled buffer it goes back to the pool, or with ``keep`` (a
        ``no_sync`` stash holds it) it leaves the pool's accounting and is
        freed like any tensor; when autograd copied or summed instead of
        adopting the buffer, the buffer is already gone and only the
        accounting is settled."""
        if self.held is None:
            return
        ptr, nbytes = self.held
        self.held = None
        if grad is not None and grad.data_ptr() == ptr and grad.untyped_storage().nbytes() == nbytes:
            if not keep:
                POOL.give(grad)
                return
        POOL.forget(nbytes, ptr)

    def nbytes(self) -> int:
        """Bytes of the buffer handed out and not yet settled (0 if none)."""
        return self.held[1] if self.held else 0


def set_grad(slot, grad: torch.Tensor) -> torch.Tensor:
    """Install ``grad`` (plain, this rank's shard) as the registered
    parameter's ``.grad`` of ``slot`` (a :class:`~fullshard.core.params.ParamSlot`;
    wrapped as a DTensor like the parameter under ``fully_shard``), also when
    its dtype differs from the parameter's
    (``MixedPrecision.keep_low_precision_grads``: fp32 master, bf16
    gradient). Autograd refuses such an assignment, so a placeholder of the
    parameter's dtype and shape (one element, expanded) is installed and its
    ``.data`` swapped for ``grad``, as torch FSDP1 does.

    Returns:
        The tensor now at ``.grad`` (the placeholder when the dtypes differ;
        it shares ``grad``'s memory).
    """
    param = slot.sharded
    if grad.dtype == param.dtype:
        param.grad = slot.grad_like(grad)
        return param.grad
    holder = torch.empty((), dtype=param.dtype, device=param.device).expand(param.shape)
    param.grad = holder
    holder.data = grad
    return holder


def add_to_grad(slot, grad: torch.Tensor, dtype: torch.dtype) -> None:
    """``.grad += grad`` for ``slot``'s registered parameter, with the result
    in ``dtype``. ``grad`` (plain) is in the accumulation dtype (the master
    dtype), so a low-precision ``.grad`` is summed in it and rounded once; an
    existing ``.grad`` keeps its identity when it already has ``dtype``."""
    cur = slot.grad()
    if cur is None:
        set_grad(slot, grad.to(dtype))
    elif cur.dtype == dtype:
        cur.add_(grad)  # computed in the wider dtype, rounded once on store
    else:
        slot.sharded.grad.data = grad.add(cur).to(dtype)
