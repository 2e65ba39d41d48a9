"""Optimizers that need whole tensors, on a plain model or on fullshard's shards.

``Muon`` (with AdamW for the rest), ``Adafactor`` and ``Lamb`` give a single
device's step on parameters sharded by ``FullyShardedDataParallel`` or
``fully_shard``: per-tensor statistics are summed over the shard group, and
Muon's matrices are each held whole by one rank::

    import fullshard
    from fullshard import optim

    place = optim.muon_placement_fn(model)          # on the unwrapped model
    model = fullshard.FullyShardedDataParallel(model, shard_placement_fn=place, ...)
    opt = optim.Muon(optim.muon_param_groups(model), lr=0.02, adamw_lr=3e-4)

torch's optimizers that are not element-wise (``torch.optim.Muon``,
``Adafactor``, ``LBFGS``, ...) raise :class:`ShardedOptimizerError` at their
first step on such parameters; :func:`allow_elementwise` opts a class out.

``OffloadAdamW(model, ...)``: AdamW over a CPU-offloaded model whose host step
of each unit starts as soon as the unit's gradient is on the host, during
backward (bit for bit ``torch.optim.AdamW(fused=True)`` after backward).
"""
from ..core.optim_guard import shard_aware
from .adafactor import Adafactor
from .guard import ELEMENTWISE, ShardedOptimizerError, allow_elementwise, disallow
from .lamb import Lamb
from .muon import Muon, muon_param_groups, muon_placement_fn
from .offload import OffloadAdamW

for _cls in (Muon, Adafactor, Lamb):
    shard_aware(_cls)
del _cls

__all__ = ["Muon", "Adafactor", "Lamb", "OffloadAdamW", "muon_param_groups", "muon_placement_fn",
           "allow_elementwise", "disallow", "ELEMENTWISE", "ShardedOptimizerError"]
