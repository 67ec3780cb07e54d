"""Per-split sampling: the proxy's request policy for the calls of an attempt, chosen by its rollout's split.

The trainer samples training rollouts at ``[rl] temperature`` and evaluates at ``[eval]`` settings (greedy by
default) on the same engine, sometimes at the same time (a held-out check while train attempts are still released,
the warm start's evaluations). So the settings belong to the request, not to the engine: the proxy is given one
``SplitSampling`` when it is built, and token mode applies the rule of each call's split to that call's ``Sampling``
before the engine sees it (the embedded engine, vLLM and SGLang alike)::

    SplitSampling({"train": {"temperature": 1.0, "max_tokens": 256}, "eval-*": {"temperature": 0.0}})

Rules are ``fnmatch`` patterns over split names, tried in order (the first match wins); a split no rule matches is
sampled as its request asks. A rule's values replace the request's, except ``max_tokens``, which caps it
(``Sampling.overridden``).
"""

from __future__ import annotations

import fnmatch
from collections.abc import Mapping
from typing import Any

from lightning_sdk.engines.base import Sampling
from lightning_sdk.errors import ConfigError

__all__ = ["SplitSampling"]


class SplitSampling:
    """Ordered ``pattern -> sampling override`` rules (see the module docstring)."""

    def __init__(self, rules: Mapping[str, Mapping[str, Any]]) -> None:
        valid = set(Sampling.model_fields)
        for pattern, override in rules.items():
            unknown = sorted(set(override) - valid)
            if unknown:
                raise ConfigError(
                    f"sampling rule {pattern!r}: unknown field(s) {', '.join(unknown)} "
                    f"(valid: {', '.join(sorted(valid))})"
                )
        self.rules: tuple[tuple[str, dict[str, Any]], ...] = tuple((p, dict(o)) for p, o in rules.items())
        self._by_split: dict[str, dict[str, Any] | None] = {}

    def override_for(self, split: str | None) -> dict[str, Any] | None:
        """The override of ``split``'s first matching rule (None: no rule matches, or the split is unknown)."""
        if split is None:
            return None
        try:
            return self._by_split[split]
        except KeyError:
            found = next((o for p, o in self.rules if fnmatch.fnmatchcase(split, p)), None)
            if len(self._by_split) < 4096:  # split names are few (train, eval-*, warmup-*): cache them
                self._by_split[split] = found
            return found

    def apply(self, sampling: Sampling, split: str | None) -> Sampling:
        """``sampling`` with ``split``'s rule applied."""
        return sampling.overridden(self.override_for(split))

    def as_dict(self) -> dict[str, dict[str, Any]]:
        """The rules as written (for ``summary.json``)."""
        return {p: dict(o) for p, o in self.rules}

    def __repr__(self) -> str:
        return f"SplitSampling({self.as_dict()!r})"
