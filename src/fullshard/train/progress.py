"""fairseq-style training statistics and progress output (json, simple, tqdm).

The line formats copy fairseq's `fairseq/logging/progress_bar.py`:

* json   ``<time> | INFO | train_inner | {"epoch": 1, "update": 0.001, "loss": "16.408", ...}``
* simple ``<time> | INFO | train_inner | epoch 001:     25 / 123 loss=16.408, ppl=86945.6, ...``
* tqdm   a tqdm bar whose postfix holds the same stats.

End-of-epoch and validation summaries are `print`ed: json prefixes each key
with the tag (``valid_loss``), simple/tqdm join ``key value`` with `` | ``.
"""
from __future__ import annotations

import json
import logging
import math
import time
from collections import OrderedDict
from numbers import Number
from typing import Optional

import torch

LN2 = math.log(2.0)


def safe_round(number: float, ndigits: int) -> float:
    """`round` that leaves inf / nan alone."""
    if math.isfinite(number):
        return round(number, ndigits)
    return number


def perplexity(loss_base2: float) -> float:
    """2 ** loss (loss in bits), rounded to 2 decimals; inf on overflow."""
    try:
        return safe_round(2.0**loss_base2, 2)
    except OverflowError:
        return float("inf")


def format_stat(stat) -> str:
    """fairseq's `format_stat`: numbers as ``{:g}`` (6 significant digits)."""
    if isinstance(stat, Number):
        return "{:g}".format(stat)
    return str(stat)


def gb_free(device: torch.device) -> float:
    """Free memory of `device` in GiB: CUDA free memory, else MemAvailable of the host."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0] / 1024**3
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) / 1024**2
    except OSError:
        pass
    return float("nan")


class UpdateMeters:
    """Aggregates per-update statistics over an interval (train_inner) or an epoch (train).

    All counts are global (already summed over ranks).
    """

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.start = time.perf_counter()
        self.loss_sum_nats = 0.0
        self.ntokens = 0
        self.nsentences = 0
        self.updates = 0
        self.gnorm_sum = 0.0
        self.clipped = 0
        self.train_wall_seconds = 0.0

    def add(self, loss_sum_nats: float, ntokens: int, nsentences: int, gnorm: float, seconds: float,
            clipped: bool = False) -> None:
        """Record one optimizer update (``clipped``: its gradient norm exceeded --clip-norm)."""
        self.loss_sum_nats += loss_sum_nats
        self.ntokens += ntokens
        self.nsentences += nsentences
        self.updates += 1
        self.gnorm_sum += gnorm
        self.clipped += int(clipped)
        self.train_wall_seconds += seconds

    def stats(self, num_updates: int, lr: float, device: torch.device, wall_seconds: float,
              loss_scale: float = 1.0, clip_norm: float = 0.0) -> "OrderedDict[str, float]":
        """The fairseq train record, values already rounded like fairseq's meters.

        ``loss_scale`` is the current fp16 loss scale (1 without --fp16), logged
        as its latest value like fairseq's weight-0 meter. With ``clip_norm`` > 0
        ``clip`` is the percentage of updates whose gradient norm exceeded it,
        as fairseq logs it.
        """
        elapsed = max(time.perf_counter() - self.start, 1e-9)
        updates = max(self.updates, 1)
        loss = self.loss_sum_nats / max(self.ntokens, 1) / LN2
        out = OrderedDict(
            loss=safe_round(loss, 3),
            ppl=perplexity(loss),
            wps=safe_round(self.ntokens / elapsed, 1),
            ups=safe_round(self.updates / elapsed, 2),
            wpb=safe_round(self.ntokens / updates, 1),
            bsz=safe_round(self.nsentences / updates, 1),
            num_updates=num_updates,
            lr=lr,
            gnorm=safe_round(self.gnorm_sum / updates, 3),
        )
        if clip_norm > 0:
            out["clip"] = safe_round(100.0 * self.clipped / updates, 1)
        out.update(
            loss_scale=safe_round(loss_scale, 4),
            train_wall=safe_round(self.train_wall_seconds, 0),
            gb_free=safe_round(gb_free(device), 1),
            wall=safe_round(wall_seconds, 0),
        )
        return out


def valid_stats(loss_sum_nats: float, ntokens: int, nsentences: int, steps: int, seconds: float, num_updates: int):
    """The fairseq valid record (keys without the ``valid_`` prefix)."""
    loss = loss_sum_nats / max(ntokens, 1) / LN2
    steps = max(steps, 1)
    return OrderedDict(
        loss=safe_round(loss, 3),
        ppl=perplexity(loss),
        wps=safe_round(ntokens / max(seconds, 1e-9), 1),
        wpb=safe_round(ntokens / steps, 1),
        bsz=safe_round(nsentences / steps, 1),
        num_updates=num_updates,
    )


class ProgressBar:
    """Base: a prefix ``epoch 001[ | <prefix>]`` and the shared formatting."""

    def __init__(self, epoch: Optional[int], size: int, log_interval: int, prefix: Optional[str] = None):
        self.epoch = epoch
        self.size = size
        self.log_interval = log_interval
        self.i = 0
        self.prefix = "" if epoch is None else "epoch {:03d}".format(epoch)
        if prefix is not None:
            self.prefix += (" | " if self.prefix else "") + prefix

    def update(self, i: int) -> None:
        """Mark that update number `i` (0-based, within the epoch) is done."""
        self.i = i

    def close(self) -> None:
        pass

    @staticmethod
    def _str_commas(stats) -> str:
        return ", ".join(k + "=" + format_stat(v).strip() for k, v in stats.items())

    @staticmethod
    def _str_pipes(stats) -> str:
        return " | ".join(k + " " + format_stat(v).strip() for k, v in stats.items())

    def log(self, stats, tag: str) -> None:
        raise NotImplementedError

    def print(self, stats, tag: str) -> None:
        logging.getLogger(tag).info("{} | {}".format(self.prefix, self._str_pipes(stats)))


class JsonProgressBar(ProgressBar):
    """One json object per record, like fairseq's JsonProgressBar."""

    def _json(self, stats, update: Optional[float]) -> str:
        out = OrderedDict()
        if self.epoch is not None:
            out["epoch"] = self.epoch
        if update is not None:
            out["update"] = round(update, 3)
        for k, v in stats.items():
            out[k] = format_stat(v)
        return json.dumps(out)

    def log(self, stats, tag: str) -> None:
        update = None
        if self.epoch is not None:
            update = self.epoch - 1 + (self.i + 1) / float(max(self.size, 1))
        logging.getLogger(tag).info(self._json(stats, update))

    def print(self, stats, tag: str) -> None:
        stats = OrderedDict((tag + "_" + k, v) for k, v in stats.items())
        logging.getLogger(tag).info(self._json(stats, None))


class SimpleProgressBar(ProgressBar):
    """``epoch 001:     25 / 123 loss=..., ppl=...`` like fairseq's SimpleProgressBar."""

    def log(self, stats, tag: str) -> None:
        line = "{}:  {:5d} / {:d} {}".format(self.prefix, self.i + 1, self.size, self._str_commas(stats))
        logging.getLogger(tag).info(line)


class TqdmProgressBar(ProgressBar):
    """A tqdm bar on stderr whose postfix shows the latest stats."""

    def __init__(self, epoch, size, log_interval, prefix=None):
        super().__init__(epoch, size, log_interval, prefix)
        from tqdm import tqdm

        self.bar = tqdm(total=size, desc=self.prefix, leave=False, dynamic_ncols=True)

    def update(self, i: int) -> None:
        super().update(i)
        self.bar.update(1)

    def log(self, stats, tag: str) -> None:
        self.bar.set_postfix(OrderedDict((k, format_stat(v)) for k, v in stats.items()), refresh=False)

    def close(self) -> None:
        self.bar.close()


def progress_bar(log_format: str, epoch: Optional[int], size: int, log_interval: int, prefix: Optional[str] = None):
    """Build the bar for `log_format` (json, simple or tqdm)."""
    cls = {"json": JsonProgressBar, "simple": SimpleProgressBar, "tqdm": TqdmProgressBar}[log_format]
    return cls(epoch, size, log_interval, prefix)
