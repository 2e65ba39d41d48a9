"""`fullshard plot`: training / validation loss curves of one or more runs from their logs.

Reads the json and the simple log formats of `fullshard train` (stdout captures
or --log-file files): ``train_inner`` loss and ``valid`` loss against
num_updates. Every run gets one colour: a solid line for train, dots joined by
a dashed line for valid; the label is the file's stem.
"""
from __future__ import annotations

import json
import os
import re
from typing import Dict, List, Tuple

Curve = List[Tuple[int, float]]

_JSON = re.compile(r"\| (train_inner|valid) \| (\{.*\})\s*$")
_SIMPLE_INNER = re.compile(r"\| train_inner \| epoch \d+:\s+\d+ / \d+ (.*)$")
_SIMPLE_VALID = re.compile(r"\| valid \| epoch \d+ \| valid on '[^']*' subset \| (.*)$")


class LogError(ValueError):
    """A log file could not be read or holds no train_inner / valid record."""


def _simple_pairs(text: str, sep: str, kv: str) -> Dict[str, str]:
    out = {}
    for part in text.split(sep):
        if kv in part:
            key, value = part.strip().split(kv, 1)
            out[key.strip()] = value.strip()
    return out


def parse_log(path: str) -> Dict[str, Curve]:
    """{'train': [(num_updates, loss)], 'valid': [(num_updates, valid_loss)]} from one log.

    Raises:
        LogError: the file is missing or has no train_inner / valid records.
    """
    curves: Dict[str, Curve] = {"train": [], "valid": []}
    try:
        with open(path, errors="replace") as f:
            lines = f.readlines()
    except OSError as e:
        raise LogError(f"cannot read log {path!r}: {e.strerror}") from None
    for line in lines:
        m = _JSON.search(line)
        if m:
            rec = json.loads(m.group(2))
            if m.group(1) == "train_inner" and "loss" in rec:
                curves["train"].append((int(float(rec["num_updates"])), float(rec["loss"])))
            elif m.group(1) == "valid" and "valid_loss" in rec:
                curves["valid"].append((int(float(rec["valid_num_updates"])), float(rec["valid_loss"])))
            continue
        m = _SIMPLE_INNER.search(line)
        if m:
            rec = _simple_pairs(m.group(1), ",", "=")
            curves["train"].append((int(float(rec["num_updates"])), float(rec["loss"])))
            continue
        m = _SIMPLE_VALID.search(line)
        if m:
            rec = _simple_pairs(m.group(1), "|", " ")
            curves["valid"].append((int(float(rec["num_updates"])), float(rec["loss"])))
    if not curves["train"] and not curves["valid"]:
        raise LogError(f"no train_inner or valid records in {path!r}; give a log written by "
                       f"`fullshard train --log-format json` or `--log-format simple`")
    return curves


def plot(logs: List[str], output: str, title: str = "") -> str:
    """Draw every log's curves on one chart and save it to `output` (PNG by extension)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [(os.path.splitext(os.path.basename(p))[0], parse_log(p)) for p in logs]
    fig, ax = plt.subplots(figsize=(8, 5), dpi=100)
    for i, (label, curves) in enumerate(runs):
        color = f"C{i % 10}"
        if curves["train"]:
            x, y = zip(*curves["train"])
            ax.plot(x, y, color=color, label=f"{label} train")
        if curves["valid"]:
            x, y = zip(*curves["valid"])
            ax.plot(x, y, color=color, linestyle="--", marker="o", label=f"{label} valid")
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("updates")
    ax.set_ylabel("loss (base 2)")
    ax.set_title(title or "fullshard training loss")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(output)
    plt.close(fig)
    return output
