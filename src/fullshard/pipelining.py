"""fullshard units inside ``torch.distributed.pipelining`` stages.

[Note: pipeline gradient accumulation]
A pipeline schedule runs one stage's backward once per micro-batch and then
steps the optimizer once. torch's ``PipelineStage`` recognizes torch's own
FSDP modules (``isinstance(submod, torch.distributed.fsdp.FSDPModule)``) and
keeps their gradients unsharded until the last micro-batch; it does not know
fullshard's units, so with torch's stage every micro-batch's backward
reduce-scatters (correct, a choice the user never made). This subclass makes
the choice explicit for a stage whose module is a fullshard unit (a
``fully_shard`` module or a ``FullyShardedDataParallel`` wrapper):

``grad_accumulation="reduce_scatter"``
    every micro-batch's backward reduce-scatters its gradient into the
    sharded gradient, which accumulates (least memory: no unsharded gradient
    outlives its unit's backward; M reduce-scatters per unit and update).
``grad_accumulation="unsharded"``
    the micro-batches before the last run with gradient sync off
    (``set_requires_gradient_sync(False)`` and ``set_reshard_after_backward(False)``
    as torch does for its FSDP, or the wrapper's ``no_sync()``): each unit sums
    its unsharded gradient locally, and the last micro-batch's backward
    reduce-scatters the sum once (least communication: one reduce-scatter per
    unit and update; an unsharded fp32 gradient per unit held across the
    micro-batches). The last backward is the schedule's ``last_backward``.

Both give the gradient of the whole batch (no weight staleness: synchronous
schedules step once after every micro-batch's backward). Every backward
finishes its reduce-scatters before it returns, so the schedule's gradient
scaling and the optimizer see whole gradients.

[Note: split backward of fullshard units]
The zero-bubble schedules (ZBVZeroBubble, InterleavedZeroBubble, DualPipeV)
split a micro-batch's backward into an input pass (the stage inputs'
gradients, sent upstream at once) and a weight pass run later; torch takes
both with ``torch.autograd.grad`` (``stage_backward_input`` /
``stage_backward_weight``) on the weights it is given. A unit's registered
parameters are not in the autograd graph: the leaf every use of them
differentiates through is the unit's unsharded flat parameter
(``unit.flat_full``, through ``grads.UnflattenFull``), whose
post-accumulate-grad hook drives the unit's reduce-scatter. So this stage
hands torch those leaves (and any parameter no unit holds) as the weights:

input pass
    runs with every unit kept gathered (``reshard_after_backward`` off for
    the pass): the weight pass's saved tensors are views of the unsharded
    flat parameters. ``torch.autograd.grad`` runs no ``AccumulateGrad``,
    so no unit reduces here.
weight pass
    regathers any unit a forward in between resharded (a
    ``reshard_after_forward`` unit), lets ``stage_backward_weight`` write
    each leaf's ``.grad``, and then feeds those gradients through the
    leaves' ``AccumulateGrad`` in one ``torch.autograd.backward``: the
    unit's post-accumulate-grad hook and end-of-backward callback run as in
    a full backward (reduce-scatter, or the unsharded sum under
    ``grad_accumulation="unsharded"`` until the ``last_backward`` weight
    pass). Units stay gathered while another micro-batch's weight pass is
    still due.

The first stage's input pass does nothing and its weight pass is a full
backward (torch's choice when the stage inputs need no gradient).
World-size-invariant units (``world_size_invariant``) count one micro-batch
per backward and are refused here, as is torch before 2.13, whose
``stage_backward_weight`` gave the units wrong weight gradients
(``core.torch_private.split_backward_problem``).
"""
from __future__ import annotations

import contextlib
from typing import Iterator

import torch
import torch.nn as nn
from torch.distributed.pipelining import PipelineStage as _TorchPipelineStage

from fullshard.core import collectives, registry
from fullshard.core.module import UnitModule, unit_modules
from fullshard.core.torch_private import split_backward_problem, stage_backward_input, stage_backward_weight
from fullshard.fsdp import FullyShardedDataParallel
from fullshard.fsdp2 import FSDPModule

GRAD_ACCUMULATION = ("reduce_scatter", "unsharded")
"""The ``grad_accumulation`` modes (see [Note: pipeline gradient accumulation])."""


class PipelineStage(_TorchPipelineStage):
    """torch's ``PipelineStage`` for a stage module that is a fullshard unit, so torch's schedules
    drive it with the gradient accumulation chosen (see [Note: pipeline gradient accumulation]).

    Args:
        submodule: the stage module: a root ``fully_shard`` module (its blocks sharded first) or a
            ``FullyShardedDataParallel`` wrapper, on this stage's data-parallel group; or a module
            holding no unit at all (then this is torch's stage).
        stage_index, num_stages, device: as torch's ``PipelineStage``.
        *args, **kwargs: the rest of torch's ``PipelineStage`` arguments (``input_args``,
            ``output_args``, ``group``, ...). Give ``input_args`` / ``output_args`` (static
            metadata): dynamic inference runs a real forward and backward, after which this
            stage drops the gradients it left.
        grad_accumulation: ``"reduce_scatter"`` or ``"unsharded"``.
    Raises:
        ValueError: an unknown ``grad_accumulation``, or a module that holds units without being
            one itself (wrap the stage module itself).
    """

    def __init__(self, submodule: nn.Module, stage_index: int, num_stages: int, device, *args,
                 grad_accumulation: str = "reduce_scatter", **kwargs):
        if grad_accumulation not in GRAD_ACCUMULATION:
            raise ValueError(f"[rank {collectives.rank()}] grad_accumulation={grad_accumulation!r}: use one of "
                             f"{GRAD_ACCUMULATION}")
        if not isinstance(submodule, UnitModule) and any(isinstance(m, UnitModule) for m in submodule.modules()):
            raise ValueError(f"[rank {collectives.rank()}] pipeline stage {stage_index}: the stage module holds "
                             "fullshard units but is not one; apply fully_shard (or FullyShardedDataParallel) to "
                             "the stage module itself, after its blocks")
        super().__init__(submodule, stage_index, num_stages, device, *args, **kwargs)
        self.grad_accumulation = grad_accumulation
        self._weight_passes_due = 0  # input passes whose weight pass has not run yet

    @contextlib.contextmanager
    def _gradient_sync(self, sync: bool) -> Iterator[None]:
        """Gradient sync on (reduce-scatter in this backward) or off (accumulate unsharded)."""
        module = self.submod
        if isinstance(module, FSDPModule):
            module.set_requires_gradient_sync(sync)
            # Keep the gathered parameters between micro-batches while accumulating, as torch
            # does for its FSDP; the last backward reshards them.
            module.set_reshard_after_backward(sync)
            yield
        elif isinstance(module, FullyShardedDataParallel) and not sync:
            with module.no_sync():
                yield
        else:
            yield

    def backward_maybe_with_nosync(self, backward_type, bwd_kwargs: dict, last_backward: bool = False):
        """One micro-batch's backward (``"full"``, or a zero-bubble schedule's ``"input"`` /
        ``"weight"`` pass: see [Note: split backward of fullshard units]) with gradient sync as
        ``grad_accumulation`` says.

        Returns:
            torch's ``(input gradients, param_groups)``.
        Raises:
            RuntimeError: a split backward on world-size-invariant units or on torch before 2.13
                (``core.torch_private.split_backward_problem``), or an unknown
                ``backward_type``.
        """
        if not isinstance(self.submod, UnitModule):
            return super().backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward)
        sync = self.grad_accumulation == "reduce_scatter" or last_backward
        if backward_type == "full":
            with self._gradient_sync(sync):
                return super().backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward)
        if backward_type not in ("input", "weight"):
            raise RuntimeError(f"[rank {collectives.rank()}] pipeline stage {self.stage_index}: unknown backward "
                               f"type {backward_type!r}")
        problem = split_backward_problem()
        if problem:
            raise RuntimeError(f"[rank {collectives.rank()}] pipeline stage {self.stage_index}: {problem}")
        runtimes = [m._runtime for m in unit_modules(self.submod)]
        if any(rt.unit.cfg.invariant_layout is not None for rt in runtimes):
            raise RuntimeError(f"[rank {collectives.rank()}] pipeline stage {self.stage_index}: a schedule that "
                               "splits backward cannot drive world_size_invariant units (their fold counts one "
                               "micro-batch per backward); use GPipe, 1F1B, Interleaved1F1B or LoopedBFS")
        leaves = self._graph_leaves(runtimes)
        if backward_type == "input":
            # Never the last pass: no gradient reaches a unit, and none must reduce a stash.
            with self._gradient_sync(self.grad_accumulation == "reduce_scatter"), _kept_gathered(runtimes, True):
                out = stage_backward_input(bwd_kwargs["stage_output"], bwd_kwargs["output_grads"],
                                           bwd_kwargs["input_values"], iter(leaves))
            self._weight_passes_due += 1
            return out
        self._weight_passes_due -= 1
        for rt in runtimes:  # a forward in between may have resharded it (reshard_after_forward)
            if rt.unit.needs_grad:
                rt.unit.ensure_unsharded()
        keep = self._weight_passes_due > 0
        # Sync off while torch takes the weight gradients: its autograd.grad may end in our
        # end-of-backward callback (a unit output's hook fired), which must not reduce a stash yet.
        with self._gradient_sync(False), _kept_gathered(runtimes, True):
            grads = stage_backward_weight(iter(leaves), bwd_kwargs["param_groups"])
        with self._gradient_sync(sync), _kept_gathered(runtimes, keep):
            _accumulate([rt.unit.flat_full for rt in runtimes if rt.unit.needs_grad])
        return grads, None

    def _graph_leaves(self, runtimes: list) -> list[torch.Tensor]:
        """The leaves the stage's forward differentiates through: each trainable unit's unsharded
        flat parameter, and every trainable parameter no unit holds."""
        leaves = [rt.unit.flat_full for rt in runtimes if rt.unit.needs_grad]
        return leaves + [p for p in self.submod.parameters() if p.requires_grad and registry.find(p) is None]

    def _post_metadata_inference_cleanup(self) -> None:
        # Dynamic metadata inference ran a real forward and backward: drop what it left in our
        # units too (torch cleans only its own FSDP modules).
        super()._post_metadata_inference_cleanup()
        for module in self.submod.modules():
            if isinstance(module, FSDPModule):
                module.reshard()
        for param in self.submod.parameters():
            param.grad = None


@contextlib.contextmanager
def _kept_gathered(runtimes: list, keep: bool) -> Iterator[None]:
    """With ``keep``, no unit reshards at the end of the backwards inside (their settings restored after)."""
    saved = [rt.settings.reshard_after_backward for rt in runtimes]
    if keep:
        for rt in runtimes:
            rt.settings.reshard_after_backward = False
    try:
        yield
    finally:
        for rt, value in zip(runtimes, saved):
            rt.settings.reshard_after_backward = value


def _accumulate(flats: list[torch.Tensor]) -> None:
    """Feed the gradients ``stage_backward_weight`` wrote into ``.grad`` of units' flat parameters
    through their ``AccumulateGrad``, so each unit's post-accumulate-grad hook and end-of-backward
    callback run as in a full backward (see [Note: split backward of fullshard units])."""
    roots = [f for f in flats if f.grad is not None]
    grads = [f.grad for f in roots]
    for f in roots:
        f.grad = None
    if roots:
        torch.autograd.backward(roots, grads)
