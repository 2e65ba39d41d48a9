"""The balanced split for the V-shaped schedules (ZBVZeroBubble, DualPipeV): pipeline rank p holds
stages p and S-1-p (S = 2P), so a rank's time per micro-batch is the sum of two stages, one from
each end of the model, and the pipeline waits for the slowest RANK, not the slowest stage.

Working from both ends at once, after ranks 0..k-1 have taken stages 0..k-1 (layers ``[0, i)``)
and S-k..S-1 (layers ``[j, L)``), what is left is the middle ``[i, j)``; rank k takes ``[i, i')``
and ``[j', j)``, and its cost is ``W(i, j) - W(i', j')`` (W: the middle's summed layer cost) plus
the embedding and the head on rank 0. So whether every rank can stay within a time T is a
reachability question over the states ``(i, j)``, level by level: ``(i', j')`` is reachable when
some reachable ``(i, j)`` with ``i < i'``, ``j > j'`` (and both stages within the memory budget)
has ``W(i, j) <= W(i', j') + T``, i.e. the least W over those predecessors decides. The least T
that reaches the end is found by bisection (to float precision); among the splits within it, a
second bisection, over the stage costs that occur, finds the least slowest stage. The states kept
at each level give the split back.
"""
from __future__ import annotations

from typing import Callable, Optional, Sequence

import numpy as np


def v_shaped_split(layer_s: Sequence[float], num_ranks: int, first_s: float, last_s: float,
                   fits: Optional[Callable[[int, int, int], bool]], error: Callable[[str], Exception]) -> list[int]:
    """The contiguous split of L layers into S = 2P stages, stage k and S-1-k on rank k, whose
    slowest rank (the sum of its two stages' costs) is the fastest possible (exact, to float
    precision); ties broken by the least slowest stage, then, stage by stage from the ends, by
    the least sum of squared stage costs (greedy: not the exact least over all tied splits).

    Args:
        layer_s: each layer's cost (seconds, >= 0), in order; L >= 2P.
        num_ranks: P >= 1.
        first_s, last_s: the costs stage 0 and stage S-1 carry besides their layers.
        fits: ``fits(stage, first_layer, end_layer)``: whether that stage fits memory (None: all do).
        error: builds the exception raised when no split fits the memory budget.
    Returns:
        The layer count of each stage, each >= 1.
    Raises:
        ``error(...)``: no split fits; ValueError: a negative layer cost.
    """
    L, P = len(layer_s), num_ranks
    S = 2 * P
    if min(layer_s) < 0:
        raise ValueError(f"layer costs must be >= 0, got {min(layer_s)}")
    prefix = np.concatenate([[0.0], np.cumsum(np.asarray(layer_s, dtype=np.float64))])
    W = prefix[None, :] - prefix[:, None]  # W[i, j]: layers i..j-1
    idx = np.arange(L + 1)
    forward = idx[:, None] < idx[None, :]  # [a, b): a < b
    # Stage costs and masks of rank k's two stages: left[k][i, i'] = stage k over [i, i'),
    # right[k][j', j] = stage S-1-k over [j', j); off the allowed pairs the cost is inf.
    left, right = [], []
    for k in range(P):
        for stage, extra, out in ((k, first_s if k == 0 else 0.0, left), (S - 1 - k, last_s if k == 0 else 0.0, right)):
            ok = forward.copy()
            if fits is not None:
                for a, b in zip(*np.nonzero(ok)):
                    ok[a, b] = fits(stage, int(a), int(b))
            out.append(np.where(ok, W + extra, np.inf))
    span = idx[None, :] - idx[:, None]  # j - i

    def reach(T: float, U: float) -> Optional[list[np.ndarray]]:
        """The reachable (i, j) of each level with every rank <= T and every stage <= U; None if the end is not."""
        R = np.zeros((L + 1, L + 1), dtype=bool)
        R[0, L] = True
        levels = [R]
        for k in range(P - 1):
            A, B = left[k] <= U, right[k] <= U
            Wm = np.where(R, W, np.inf)
            lo, hi = idx - A.sum(axis=0), idx + 1 + B.sum(axis=1)  # if A, B are windows: i in [lo, i'), j in (j', hi)
            if (A == ((idx[:, None] >= lo) & forward)).all() and (B == (forward & (idx < hi[:, None]))).all():
                G = _window_min(Wm, lo, idx)  # costs >= 0 without a memory budget: always windows, O(L^2 log L)
                H = _window_min(G.T, idx + 1, hi).T
            else:  # O(L^3)
                G = np.where(A[:, :, None], Wm[:, None, :], np.inf).min(axis=0)  # G[i', j]
                H = np.where(B[None, :, :], G[:, None, :], np.inf).min(axis=2)  # H[i', j']
            E = first_s + last_s if k == 0 else 0.0
            R = (H - W + E <= T) & (span >= S - 2 * (k + 1))
            if not R.any():
                return None
            levels.append(R)
        A, B = left[P - 1] <= U, right[P - 1] <= U
        E = first_s + last_s if P == 1 else 0.0
        done = R & (W + E <= T) & (A[:, :, None] & B[None, :, :]).any(axis=1)
        return levels + [done] if done.any() else None

    def split_of(levels: list[np.ndarray], T: float, U: float) -> list[int]:
        """Walk back from the end: at each level the predecessor with the least squared stage costs."""
        a, b = left[P - 1], right[P - 1]  # the last rank's stages [i, m) and [m, j)
        sq = np.where((a <= U)[:, :, None] & (b <= U)[None, :, :], a[:, :, None] ** 2 + b[None, :, :] ** 2, np.inf)
        best = np.where(levels[-1], sq.min(axis=1), np.inf)  # best[i, j]: over the middle cut m
        i, j = np.unravel_index(int(np.argmin(best)), best.shape)
        m = int(np.argmin(sq[i, :, j]))
        bounds = [(int(i), m), (m, int(j))]
        for k in range(P - 2, -1, -1):
            E = first_s + last_s if k == 0 else 0.0
            a, b = left[k][:, i], right[k][j, :]  # costs of [i0, i) and [j, j0) over i0, j0
            ok = levels[k] & (a[:, None] <= U) & (b[None, :] <= U) & (W - W[i, j] + E <= T)
            score = np.where(ok, a[:, None] ** 2 + b[None, :] ** 2, np.inf)
            i, j = np.unravel_index(int(np.argmin(score)), score.shape)
            bounds = [(int(i), bounds[0][0]), *bounds, (bounds[-1][1], int(j))]
        return [e - s for s, e in bounds]

    total = prefix[-1] + first_s + last_s
    every = np.finfo(np.float64).max  # a stage cap that keeps every allowed stage (inf marks the others)
    if reach(total, every) is None:
        raise error(f"no split of {L} layers into {S} stages fits the memory budget")
    lo, hi = total / P * (1 - 1e-12) - 1e-300, total  # no rank can be under the mean
    while hi - lo > 1e-12 * hi + 1e-15:
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if reach(mid, every) is not None else (mid, hi)
    T = hi * (1 + 1e-9) + 1e-15
    costs = np.unique(np.concatenate([c[np.isfinite(c)] for c in left + right]))
    a, b = 0, len(costs) - 1  # the least stage cap U among the costs that occur: costs[b] works
    while a < b:
        c = (a + b) // 2
        a, b = (a, c) if reach(T, costs[c] * (1 + 1e-12)) is not None else (c + 1, b)
    U = costs[b] * (1 + 1e-12)
    return split_of(reach(T, U), T, U)


def _window_min(X: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """``out[q] = X[lo[q]:hi[q]].min(axis=0)`` for every q (inf where empty), by a sparse table:
    ``table[p][r]`` is the least of rows r..r+2^p-1, and a window is two overlapping such blocks."""
    tables, w = [X], 1
    while 2 * w <= X.shape[0]:
        tables.append(np.minimum(tables[-1][:-w], tables[-1][w:]))
        w *= 2
    out = np.full((len(lo), X.shape[1]), np.inf)
    length = hi - lo
    p = np.where(length > 0, np.floor(np.log2(np.maximum(length, 1))).astype(int), -1)
    for level in np.unique(p[p >= 0]):
        q = np.nonzero(p == level)[0]
        out[q] = np.minimum(tables[level][lo[q]], tables[level][hi[q] - (1 << level)])
    return out

