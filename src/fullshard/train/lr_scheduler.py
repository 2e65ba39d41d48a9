"""Learning-rate schedules with fairseq semantics, as `LambdaLR` multipliers.

Each schedule is a small picklable callable `f(num_updates) -> multiplier` of
the peak `--lr`. `LambdaLR` evaluates `f(0)` at construction (the lr of the
first update) and `f(n)` after the n-th `scheduler.step()`; the trainer steps
the scheduler once per update, so the logged `lr` after update n is the lr the
(n+1)-th update will use, exactly like fairseq's `lr_step_update`.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

SCHEDULERS = ("polynomial_decay", "inverse_sqrt", "cosine", "fixed")


@dataclass(frozen=True)
class PolynomialDecay:
    """fairseq `polynomial_decay`: linear warmup to lr, then (lr-end)*(1-p)^power + end."""

    lr: float
    warmup_updates: int
    total_num_update: int
    end_learning_rate: float
    power: float

    def __call__(self, num_updates: int) -> float:
        if self.warmup_updates > 0 and num_updates <= self.warmup_updates:
            return max(num_updates, 1) / self.warmup_updates
        if num_updates >= self.total_num_update:
            return self.end_learning_rate / self.lr
        span = self.total_num_update - self.warmup_updates
        remaining = 1.0 - (num_updates - self.warmup_updates) / span
        lr = (self.lr - self.end_learning_rate) * remaining**self.power + self.end_learning_rate
        return lr / self.lr


@dataclass(frozen=True)
class InverseSqrt:
    """fairseq `inverse_sqrt`: warmup from 0 to lr, then lr * sqrt(warmup / n).

    With no warmup the decay is lr / sqrt(max(n, 1)).
    """

    warmup_updates: int

    def __call__(self, num_updates: int) -> float:
        if num_updates < self.warmup_updates:
            return num_updates / self.warmup_updates
        return math.sqrt(max(self.warmup_updates, 1)) / math.sqrt(max(num_updates, 1))


@dataclass(frozen=True)
class Cosine:
    """Linear warmup, then half a cosine from lr down to end_learning_rate.

    (Loshchilov & Hutter 2017, SGDR, eq. 5 with a single period and no restart.)
    """

    lr: float
    warmup_updates: int
    total_num_update: int
    end_learning_rate: float

    def __call__(self, num_updates: int) -> float:
        if self.warmup_updates > 0 and num_updates < self.warmup_updates:
            return num_updates / self.warmup_updates
        span = max(self.total_num_update - self.warmup_updates, 1)
        progress = min((num_updates - self.warmup_updates) / span, 1.0)
        end = self.end_learning_rate
        lr = end + 0.5 * (self.lr - end) * (1.0 + math.cos(math.pi * progress))
        return lr / self.lr


@dataclass(frozen=True)
class Fixed:
    """fairseq `fixed`: constant lr, with warmup factor (n+1)/warmup during warmup."""

    warmup_updates: int

    def __call__(self, num_updates: int) -> float:
        if self.warmup_updates > 0 and num_updates < self.warmup_updates:
            return (num_updates + 1) / self.warmup_updates
        return 1.0


def build_schedule(cfg) -> object:
    """Return the multiplier callable for `cfg.lr_scheduler` (a TrainConfig)."""
    total = cfg.total_num_update or cfg.max_update
    if cfg.lr_scheduler == "polynomial_decay":
        return PolynomialDecay(cfg.lr, cfg.warmup_updates, total, cfg.end_learning_rate, cfg.power)
    if cfg.lr_scheduler == "inverse_sqrt":
        return InverseSqrt(cfg.warmup_updates)
    if cfg.lr_scheduler == "cosine":
        return Cosine(cfg.lr, cfg.warmup_updates, total, cfg.end_learning_rate)
    if cfg.lr_scheduler == "fixed":
        return Fixed(cfg.warmup_updates)
    raise ValueError(f"unknown lr scheduler {cfg.lr_scheduler!r}; known: {', '.join(SCHEDULERS)}")


def build_lr_scheduler(optimizer: torch.optim.Optimizer, cfg) -> torch.optim.lr_scheduler.LambdaLR:
    """A LambdaLR over `optimizer` following `cfg.lr_scheduler`."""
    return torch.optim.lr_scheduler.LambdaLR(optimizer, build_schedule(cfg))
