r"""Advantage estimators: pure functions registered by name, all with one typed signature.

Every estimator maps an ``AdvantageInput`` — ``scores`` (n,), ``group_index`` (n,) and ``token_counts`` (n,), one
entry per *item* (an attempt for outcome rewards, or a call for per-turn credit) — and an ``AdvantageConfig`` to the
advantages (n,). Items of one group (the rollouts of one task) share a baseline. The estimators follow verl's
``core_algos`` (and are tested equal to it on the same tensors):

- ``grpo``: :math:`A_i = (r_i - \mu_g) / (\sigma_g + \epsilon)` with the unbiased group std, or
  :math:`r_i - \mu_g` when ``norm_by_std`` is off (GRPO, Shao et al. 2024, arXiv:2402.03300);
- ``dr_grpo``: :math:`A_i = r_i - \mu_g` always (Dr. GRPO, Liu et al. 2025, arXiv:2503.20783);
- ``rloo``: :math:`A_i = \frac{n}{n-1}(r_i - \mu_g)`, i.e. the reward minus the mean of the others
  (Ahmadian et al. 2024, arXiv:2402.14740);
- ``reinforce_plus_plus_baseline``: :math:`r_i - \mu_g`, then whitened over every trained token of the batch
  (each item weighted by its token count) (REINFORCE++, Hu 2025, arXiv:2501.03262).

A group of one has baseline 0 (and std 1), as in verl. ``reference_advantages`` is a plain-loop version of every
estimator, kept beside the vectorised ones and tested equal to them.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import numpy as np
import numpy.typing as npt

from lightning_sdk.errors import ConfigError, RecordError

__all__ = [
    "AdvantageConfig",
    "AdvantageInput",
    "Estimator",
    "compute_advantages",
    "discounted_returns",
    "estimator_names",
    "get_estimator",
    "is_batch_wide",
    "reference_advantages",
    "register_estimator",
    "zero_variance_groups",
]

F64 = npt.NDArray[np.float64]
I64 = npt.NDArray[np.int64]


@dataclass(frozen=True, slots=True)
class AdvantageConfig:
    """Flat advantage settings.

    ``estimator``: a registered name (``estimator_names()``). ``norm_by_std``: divide by the group std (``grpo``).
    ``epsilon``: added to the std. ``gamma``: discount over calls for per-turn credit. ``per_turn``: None = on for
    groups whose agent emitted per-call rewards. ``failed_fill``: reward given to failed or timed-out attempts so
    they are trained (None, the default: they are not trained). ``drop_zero_variance``: leave out groups whose
    scores are all equal (they are always counted). ``train_single_groups``: false leaves out groups with one
    trained rollout (a hand-opened session, or a group whose other attempts failed): with no other rollout to
    compare against, most estimators hand it its raw reward as advantage; train them only when the estimator is
    meant for that (they are always counted). ``turn_baseline`` (per-turn credit only): ``"group"`` compares each
    call's return with every call of its group; ``"turn"`` with the calls at the same turn of the group's other
    rollouts (first calls with first calls, second with second): with per-call rewards the returns of a rollout's
    first and last calls differ by construction, and one baseline over both pushes every first call up and every
    last call down; a turn only one rollout of the group reached has no baseline and gets advantage 0. The names are
    ``[rl]``'s, so the trainer hands that section's values over as they are.
    """

    estimator: str = "grpo"
    norm_by_std: bool = True
    epsilon: float = 1e-6
    gamma: float = 1.0
    per_turn: bool | None = None
    failed_fill: float | None = None
    drop_zero_variance: bool = False
    train_single_groups: bool = True
    turn_baseline: Literal["group", "turn"] = "group"

    def __post_init__(self) -> None:
        if self.turn_baseline not in ("group", "turn"):
            raise ConfigError(f"turn_baseline must be 'group' or 'turn', got {self.turn_baseline!r}")


@dataclass(frozen=True, slots=True)
class AdvantageInput:
    """One entry per item. ``group_index`` may be any integers; items with the same value share a baseline."""

    scores: F64
    group_index: I64
    token_counts: I64

    def __post_init__(self) -> None:
        n = self.scores.shape[0]
        if self.group_index.shape != (n,) or self.token_counts.shape != (n,) or self.scores.ndim != 1:
            raise RecordError(
                f"advantage input lengths differ: scores={self.scores.shape}, group_index={self.group_index.shape}, "
                f"token_counts={self.token_counts.shape}"
            )

    @classmethod
    def of(cls, scores: object, group_index: object, token_counts: object | None = None) -> AdvantageInput:
        """Build from lists or arrays (token counts default to 1 per item)."""
        s = np.asarray(scores, dtype=np.float64)
        g = np.asarray(group_index, dtype=np.int64)
        c = np.ones_like(g) if token_counts is None else np.asarray(token_counts, dtype=np.int64)
        return cls(s, g, c)


Estimator = Callable[[AdvantageInput, AdvantageConfig], F64]
"""The one signature of every estimator: (items, config) -> advantages (n,)."""

_ESTIMATORS: dict[str, Estimator] = {}
_BATCH_WIDE: set[str] = set()


def register_estimator(name: str, *, batch_wide: bool = False) -> Callable[[Estimator], Estimator]:
    """Decorator: register ``fn`` under ``name`` (a name may be registered once). ``batch_wide``: the advantage of
    an item depends on items of other groups (a whitening over the batch), not only on its own group's."""

    def deco(fn: Estimator) -> Estimator:
        if name in _ESTIMATORS and _ESTIMATORS[name] is not fn:
            raise ConfigError(f"advantage estimator {name!r} is already registered")
        _ESTIMATORS[name] = fn
        if batch_wide:
            _BATCH_WIDE.add(name)
        return fn

    return deco


def is_batch_wide(name: str) -> bool:
    """Whether estimator ``name`` looks beyond each group (so a batch cannot be split between groups unchanged)."""
    get_estimator(name)
    return name in _BATCH_WIDE


def estimator_names() -> list[str]:
    return sorted(_ESTIMATORS)


def get_estimator(name: str) -> Estimator:
    """The estimator registered as ``name``; ``ConfigError`` listing the valid names otherwise."""
    try:
        return _ESTIMATORS[name]
    except KeyError:
        raise ConfigError(f"unknown advantage estimator {name!r}; valid: {', '.join(estimator_names())}") from None


def compute_advantages(items: AdvantageInput, config: AdvantageConfig) -> F64:
    """Advantages (n,) of ``items`` by ``config.estimator``."""
    if items.scores.shape[0] == 0:
        return np.zeros(0, dtype=np.float64)
    return get_estimator(config.estimator)(items, config)


# ---- group statistics (vectorised with bincount) --------------------------------------------------------------


def _group_stats(items: AdvantageInput) -> tuple[I64, F64, F64, I64]:
    """Per item: dense group id; per group: mean (0 for groups of one), unbiased std (1 for groups of one), size."""
    _, g = np.unique(items.group_index, return_inverse=True)
    g = g.astype(np.int64)
    size = np.bincount(g).astype(np.int64)
    total = np.bincount(g, weights=items.scores)
    mean = np.where(size > 1, total / np.maximum(size, 1), 0.0)
    sq = np.bincount(g, weights=(items.scores - mean[g]) ** 2, minlength=size.shape[0])
    std = np.where(size > 1, np.sqrt(sq / np.maximum(size - 1, 1)), 1.0)
    return g, mean, std, size


def zero_variance_groups(items: AdvantageInput) -> npt.NDArray[np.bool_]:
    """Per item: True when its group has more than one item and all their scores are equal (no learning signal)."""
    if items.scores.shape[0] == 0:
        return np.zeros(0, dtype=bool)
    _, g = np.unique(items.group_index, return_inverse=True)
    size = np.bincount(g)
    lo = np.full(size.shape[0], np.inf)
    hi = np.full(size.shape[0], -np.inf)
    np.minimum.at(lo, g, items.scores)
    np.maximum.at(hi, g, items.scores)
    flat = (size > 1) & (lo == hi)
    return np.asarray(flat[g], dtype=bool)


@register_estimator("grpo")
def grpo(items: AdvantageInput, config: AdvantageConfig) -> F64:
    """(r - group mean) / (group std + eps); without the division when ``config.norm_by_std`` is False."""
    g, mean, std, _ = _group_stats(items)
    centred = items.scores - mean[g]
    return centred / (std[g] + config.epsilon) if config.norm_by_std else centred


@register_estimator("dr_grpo")
def dr_grpo(items: AdvantageInput, config: AdvantageConfig) -> F64:
    """r - group mean (Dr. GRPO removes the std normalisation; pair it with a token-sum loss)."""
    g, mean, _, _ = _group_stats(items)
    return items.scores - mean[g]


@register_estimator("rloo")
def rloo(items: AdvantageInput, config: AdvantageConfig) -> F64:
    """n/(n-1) (r - group mean) = r - mean of the other items; r itself in a group of one."""
    g, mean, _, size = _group_stats(items)
    n = size[g].astype(np.float64)
    scale = np.where(n > 1, n / np.maximum(n - 1, 1), 1.0)
    return np.asarray(scale * (items.scores - mean[g]), dtype=np.float64)


@register_estimator("reinforce_plus_plus_baseline", batch_wide=True)
def reinforce_plus_plus_baseline(items: AdvantageInput, config: AdvantageConfig) -> F64:
    """r - group mean, whitened over the batch's trained tokens (items weighted by token count)."""
    g, mean, _, _ = _group_stats(items)
    centred = items.scores - mean[g]
    w = items.token_counts.astype(np.float64)
    total = float(w.sum())
    if total <= 1.0:  # too few tokens to estimate a variance: leave the centred scores as they are
        return centred
    mu = float((w * centred).sum()) / (total + 1e-8)
    var = float((w * (centred - mu) ** 2).sum()) / (total + 1e-8) * total / (total - 1.0)
    return np.asarray((centred - mu) / np.sqrt(var + 1e-8), dtype=np.float64)


# ---- loop references (tested equal to the vectorised estimators) ----------------------------------------------


def reference_advantages(items: AdvantageInput, config: AdvantageConfig) -> F64:
    """The estimators written as plain loops over items, for tests. Same results as ``compute_advantages``."""
    name = get_estimator(config.estimator).__name__
    scores = [float(x) for x in items.scores]
    groups: dict[int, list[int]] = defaultdict(list)
    for i, gid in enumerate(items.group_index.tolist()):
        groups[gid].append(i)
    out = [0.0] * len(scores)
    for members in groups.values():
        vals = [scores[i] for i in members]
        n = len(vals)
        mean = sum(vals) / n if n > 1 else 0.0
        std = (sum((v - mean) ** 2 for v in vals) / (n - 1)) ** 0.5 if n > 1 else 1.0
        for i in members:
            if name == "grpo":
                out[i] = (scores[i] - mean) / (std + config.epsilon) if config.norm_by_std else scores[i] - mean
            elif name == "rloo":
                out[i] = (scores[i] - mean) * n / (n - 1) if n > 1 else scores[i]
            else:  # dr_grpo, reinforce_plus_plus_baseline (whitened below)
                out[i] = scores[i] - mean
    if name == "reinforce_plus_plus_baseline":
        counts = [int(c) for c in items.token_counts]
        total = sum(counts)
        if total > 1:
            mu = sum(c * a for c, a in zip(counts, out, strict=True)) / (total + 1e-8)
            var = sum(c * (a - mu) ** 2 for c, a in zip(counts, out, strict=True)) / (total + 1e-8)
            var *= total / (total - 1)
            out = [(a - mu) / (var + 1e-8) ** 0.5 for a in out]
    return np.asarray(out, dtype=np.float64)


def discounted_returns(rewards: F64, gamma: float) -> F64:
    """Per-turn credit: ``G_k = r_k + gamma * G_{k+1}`` over an attempt's calls in order (shape (n_calls,))."""
    out = np.zeros(rewards.shape[0], dtype=np.float64)
    running = 0.0
    for k in range(rewards.shape[0] - 1, -1, -1):  # one step per call, not per token
        running = float(rewards[k]) + gamma * running
        out[k] = running
    return out
