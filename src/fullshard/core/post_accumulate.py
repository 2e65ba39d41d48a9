"""Post-accumulate-grad hooks of sharded parameters.

[Note: post-accumulate-grad hooks]
A sharded parameter (a DTensor under ``fully_shard``, a view of the flat
shard under ``FullyShardedDataParallel``) never gets its gradient from
autograd's ``AccumulateGrad``: the unit's reduce-scatter writes it. So the
hooks ``param.register_post_accumulate_grad_hook(fn)`` registered are run
here, as torch FSDP2 runs them: ``fn(param)`` once per parameter per
synchronizing backward, under ``no_grad``, after the reduce (and, with
replicas, the all-reduce) left the gradient shard in ``param.grad``; by
unit in the order their reduces finish (the backward's order), within a
unit in parameter order. No hook runs for

* a parameter no rank gave a gradient in this backward (``grad`` untouched),
  nor for a frozen one;
* a backward inside ``no_sync`` / ``set_requires_gradient_sync(False)``: the
  gradient is stashed, not reduced; the synchronizing backward runs each
  hook once, for every parameter any micro-batch reached (under
  world_size_invariant after the last stashed micro-batch is folded);
* HSDP under ``set_requires_all_reduce(False)``, until the all-reduce runs.

Optimizer in backward (a per-parameter optimizer stepped from the hook):
the step writes the flat shard in place while other units are still in
backward. Each unit's reduce finishes after its own backward, and its shard
is read again only by its next all-gather; should one be in flight (a unit
used again later in the same backward), it is finished before the hooks
run, so no all-gather reads a half-written shard. A unit kept gathered
after backward (``set_reshard_after_backward(False)``) is gathered again by
the next forward, as after any step (``Unit.keep_unsharded``). The
optimizer guard (core/optim_guard.py) checks these steps like any other.
"""
from __future__ import annotations

import torch

from . import offload, torch_private


def mark(unit, index: int) -> None:
    """Layout parameter ``index`` of ``unit`` got a reduced gradient: its
    hooks run at the next :func:`run` of the unit."""
    unit.hooks_due.add(index)


def forget(unit) -> None:
    """Drop pending hook runs (a reduce that was abandoned)."""
    unit.hooks_due.clear()


def run(unit) -> None:
    """Run the post-accumulate-grad hooks of ``unit``'s parameters whose
    gradient shard was written since the last call (see the module note).
    A hook's exception propagates (out of ``backward()``), as under autograd."""
    due, unit.hooks_due = sorted(unit.hooks_due), set()
    todo = [(p, hooks) for p in (unit.slots[i].sharded for i in due)
            for hooks in [torch_private.post_accumulate_grad_hooks(p)] if hooks]
    if todo:
        if unit.state.name == "UNSHARDING":  # its all-gather may still read the shard a hook is about to step
            unit.wait_unshard()
        offload.wait(unit)  # an offloaded gradient may still be on its way to the host
        with torch.no_grad():
            for param, hooks in todo:
                for hook in hooks:
                    hook(param)
    if due:
        offload.run_ready(unit)
