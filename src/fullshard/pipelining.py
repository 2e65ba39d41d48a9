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
scaling and the optimizer see whole gradients. The zero-bubble schedules split
backward into an input pass and a weight pass that take gradients with
``torch.autograd.grad`` on ``submodule.parameters()``: a unit's sharded
parameters are not in the autograd graph (its unsharded flat parameter is),
so no weight gradient would reach the unit and its reduce-scatter would never
run; they are refused (`fullshard.train.pipeline_checks.ZERO_BUBBLE_REASON`).
"""
from __future__ import annotations

import contextlib
from typing import Iterator

import torch.nn as nn
from torch.distributed.pipelining import PipelineStage as _TorchPipelineStage

from fullshard.core import collectives
from fullshard.core.module import UnitModule
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
        """One micro-batch's backward with gradient sync as ``grad_accumulation`` says.

        Raises:
            RuntimeError: a split (input / weight) backward of a zero-bubble schedule on a stage
                holding fullshard units.
        """
        if not isinstance(self.submod, UnitModule):
            return super().backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward)
        if backward_type != "full":
            raise RuntimeError(f"[rank {collectives.rank()}] pipeline stage {self.stage_index}: a schedule "
                               f"that splits backward ({backward_type!r} pass) cannot drive fullshard units: "
                               "torch takes its weight gradients with torch.autograd.grad on the stage's "
                               "parameters, which are not in the autograd graph (a unit's unsharded flat parameter "
                               "is), so no gradient would be reduce-scattered; use GPipe, 1F1B, Interleaved1F1B "
                               "or LoopedBFS")
        sync = self.grad_accumulation == "reduce_scatter" or last_backward
        with self._gradient_sync(sync):
            return super().backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward)

    def _post_metadata_inference_cleanup(self) -> None:
        # Dynamic metadata inference ran a real forward and backward: drop what it left in our
        # units too (torch cleans only its own FSDP modules).
        super()._post_metadata_inference_cleanup()
        for module in self.submod.modules():
            if isinstance(module, FSDPModule):
                module.reshard()
        for param in self.submod.parameters():
            param.grad = None
