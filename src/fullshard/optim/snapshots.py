"""Host copies of parameter shards and their optimizer state, taken before a
speculative step so that the step can be undone exactly (``OffloadAdamW``
with ``max_norm``, [Note: overlapped offload step] in optim/offload.py).

One buffer per (parameter, state key), allocated at the first save and reused
by every later one: the steady state allocates nothing. For AdamW that is the
shard, ``exp_avg`` and ``exp_avg_sq`` (plus ``max_exp_avg_sq`` with amsgrad)
and the 0-dim ``step``: three times the shards' bytes for fp32 shards.
"""
from __future__ import annotations

import torch

from ..core.params import local_of

_FRESH = object()  # the parameter had no optimizer state: undoing drops what the step created


class Snapshots:
    """Saved shards and optimizer state of some parameters (between a
    :meth:`save` and a :meth:`restore` / :meth:`forget`)."""

    def __init__(self):
        self._buffers: dict[int, dict[str, torch.Tensor]] = {}  # id(param) -> key -> host buffer (kept)
        self._saved: dict[int, tuple[torch.Tensor, object]] = {}  # id(param) -> (param, state keys or _FRESH)

    def save(self, state: dict, params: list[torch.Tensor]) -> None:
        """Copy each of ``params`` (its local shard) and ``state[param]``'s
        tensors into this object's buffers; ``state``: the optimizer's."""
        for p in params:
            st = state.get(p) or {}
            tensors = {"param": p, **{k: v for k, v in st.items() if torch.is_tensor(v)}}
            bufs = self._buffers.setdefault(id(p), {})
            for key, t in tensors.items():
                local = local_of(t).detach()
                buf = bufs.get(key)
                if buf is None or buf.shape != local.shape or buf.dtype != local.dtype:
                    buf = bufs[key] = torch.empty(local.shape, dtype=local.dtype, device="cpu")
                buf.copy_(local)
            others = {k: v for k, v in st.items() if not torch.is_tensor(v)}
            self._saved[id(p)] = (p, (list(tensors), others) if st else _FRESH)

    @torch.no_grad()
    def restore(self, state: dict) -> None:
        """Put every saved parameter and its state back as saved (a parameter
        that had no state gets none), then forget them."""
        for pid, (p, saved) in self._saved.items():
            bufs = self._buffers[pid]
            local_of(p).copy_(bufs["param"])
            if saved is _FRESH:
                state.pop(p, None)
                continue
            keys, others = saved
            st = state[p]
            for key in keys[1:]:
                local_of(st[key]).copy_(bufs[key])
            st.update(others)
        self._saved = {}

    def forget(self) -> None:
        """Keep the steps taken: drop what was saved (the buffers stay for the next save)."""
        self._saved = {}

    def nbytes(self) -> int:
        """Bytes of host memory the buffers hold."""
        return sum(b.numel() * b.element_size() for bufs in self._buffers.values() for b in bufs.values())
