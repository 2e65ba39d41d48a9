"""What went wrong in a collective, in one line: the post-mortem half of
core/collectives.py [Note: no hangs].

After a collective timed out or lost a peer, each rank posts what it was
waiting in to the default process group's store and reads the others' posts
for :data:`REPORT_WAIT_S` seconds: a rank that posts nothing died or is busy
outside collectives ("did not arrive"), a rank that posts something else is
waiting in another collective. In debug mode every collective is preceded by
an all-gather of a fixed-size fingerprint (op, tag, numel, dtype) of what each
rank is about to issue; :func:`fingerprint_mismatch` turns a disagreement into
a per-rank diff.

This module issues no collective: core/collectives.py runs the fingerprint
all-gather and raises ``CollectiveError`` with the messages made here; only
the store is used directly.
"""
from __future__ import annotations

import os
import re
import time
from typing import Optional

import torch

from . import torch_private

REPORT_WAIT_S = 3.0
"""Seconds a failed rank waits for the other ranks' posts."""
FINGERPRINT_BYTES = 240
"""Bytes of a debug fingerprint (longer descriptions are cut)."""


def describe(op: str, tag: str, t: Optional[torch.Tensor]) -> str:
    """``"all_gather of unit 'layers.0' (1024 x float32)"``: what a collective is, for messages."""
    what = f"{op} of {tag}" if tag else op
    return what if t is None else f"{what} ({t.numel()} x {str(t.dtype).replace('torch.', '')})"


def _post_and_collect(me: int, desc: str, ranks: list[int]) -> dict:
    """Post ``desc`` to the store; return {rank: its post or None} after waiting a few seconds."""
    prefix = f"fullshard/stuck/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/"
    try:
        store = torch_private.default_store()
        store.set(prefix + str(me), desc)
    except Exception:  # the store itself is gone: nothing more to learn
        return {r: None for r in ranks if r != me}
    posts: dict = {}
    deadline = time.monotonic() + REPORT_WAIT_S
    while True:
        for r in ranks:
            if r != me and r not in posts:
                try:
                    if store.check([prefix + str(r)]):
                        posts[r] = store.get(prefix + str(r)).decode()
                except Exception:
                    return {r: posts.get(r) for r in ranks if r != me}
        if len(posts) == len(ranks) - 1 or time.monotonic() > deadline:
            return {r: posts.get(r) for r in ranks if r != me}
        time.sleep(0.1)


def failure_message(exc: BaseException, desc: str, seq: int, me: int, ranks: list[int],
                    timeout_s: Optional[float]) -> str:
    """One line for collective number ``seq`` (``desc``, see :func:`describe`)
    on global ``ranks`` that raised ``exc`` on rank ``me``: this rank, the
    op, the tag, whether it timed out (after how long: gloo's message, else
    ``timeout_s``), which ranks did not arrive or wait elsewhere, and what to
    do. Waits up to :data:`REPORT_WAIT_S` seconds for the other ranks' posts.
    """
    text = str(exc)
    posts = _post_and_collect(me, f"{desc} (#{seq})", ranks)
    absent = [r for r, p in posts.items() if p is None]
    elsewhere = [f"rank {r} is waiting in {p}" for r, p in posts.items() if p is not None and p != f"{desc} (#{seq})"]
    who = []
    if absent:
        who.append(f"rank{'s' if len(absent) > 1 else ''} {', '.join(map(str, absent))} did not arrive "
                   f"(no answer within {REPORT_WAIT_S:g} s: died, or busy outside collectives)")
    who += elsewhere
    found = re.search(r"waiting (\d+)ms", text)
    if "timed out" in text.lower():
        limit = float(found.group(1)) / 1000 if found else timeout_s
        what = f"timed out after {limit:g} s" if limit else "timed out"
        advice = ("check those ranks' logs; raise --collective-timeout (timeout= for library users) "
                  "if a step legitimately takes longer")
    else:
        first = text.strip().splitlines()[0] if text.strip() else type(exc).__name__
        first = re.sub(r"^\[[^]]*\] ?", "", first)  # gloo's source-location prefix
        what = f"failed: {first[:160]}"
        advice = "a peer process was probably lost; check its log"
    return (f"[rank {me}] {desc}, collective #{seq} on ranks {ranks}, {what}; "
            + ("; ".join(who) + "; " if who else "") + advice)


def fingerprint(desc: str) -> torch.Tensor:
    """``desc`` as :data:`FINGERPRINT_BYTES` uint8 (UTF-8, cut, zero-padded): what every rank all-gathers."""
    raw = desc.encode()[:FINGERPRINT_BYTES]
    out = torch.zeros(FINGERPRINT_BYTES, dtype=torch.uint8)
    out[:len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    return out


def fingerprint_mismatch(every: torch.Tensor, ranks: list[int], me: int, seq: int) -> Optional[str]:
    """None when the all-gathered fingerprints ``every`` (``len(ranks)`` rows
    of :func:`fingerprint`, group-rank order) agree, else the one-line error
    with each rank's collective."""
    seen = [bytes(row.tolist()).rstrip(b"\0").decode(errors="replace") for row in every.view(len(ranks), -1)]
    if len(set(seen)) == 1:
        return None
    diff = " | ".join(f"rank {r}: {d}" for r, d in zip(ranks, seen))
    return (f"[rank {me}] ranks issue different collectives (#{seq} on ranks {ranks}): {diff}; a unit or "
            "collective runs on some ranks only (rank-dependent control flow in forward?): make every rank "
            "run the same units in the same order")
