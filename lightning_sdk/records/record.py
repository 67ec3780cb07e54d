"""Typed training data: a ``Segment`` (merged calls of one attempt) and a ``Record`` (a segment with its advantage).

Both hold numpy arrays of equal length and check it on construction, raising ``RecordError`` (never ``assert``):
``input_ids`` (int32), ``loss_mask`` (int8, 1 where the model sampled the token and it is trained) and ``logprobs``
(float64, the engine's log-probabilities, 0.0 wherever the mask is 0). ``visualize`` prints a record so a person
can see exactly which tokens are trained.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import numpy.typing as npt

from lightning_sdk.errors import RecordError
from lightning_sdk.types import SPLIT_REASONS, SplitReason

__all__ = [
    "SPLIT_REASONS",
    "CallSpan",
    "Record",
    "Segment",
    "SplitReason",
    "visualize",
]

IntArray = npt.NDArray[np.int32]
MaskArray = npt.NDArray[np.int8]
FloatArray = npt.NDArray[np.float64]


@dataclass(frozen=True, slots=True)
class CallSpan:
    """Where one call's sampled completion sits in a segment: ``input_ids[start:end]`` (end exclusive)."""

    call_id: str
    seq: int
    start: int
    end: int
    policy_version: int | None


def _check_lengths(kind: str, input_ids: IntArray, loss_mask: MaskArray, logprobs: FloatArray) -> None:
    n = input_ids.shape[0]
    if input_ids.ndim != 1 or loss_mask.ndim != 1 or logprobs.ndim != 1:
        raise RecordError(f"{kind}: input_ids, loss_mask and logprobs must be 1-D arrays")
    if loss_mask.shape[0] != n or logprobs.shape[0] != n:
        raise RecordError(
            f"{kind}: lengths differ: input_ids={n}, loss_mask={loss_mask.shape[0]}, logprobs={logprobs.shape[0]}"
        )


@dataclass(frozen=True, slots=True)
class Segment:
    """A run of calls of one attempt merged into one token sequence (prompt + masked completions).

    ``spans`` lists the completions trained in this segment (mask 1), in position order. ``split_reason`` is None
    for the attempt's first segment. ``truncated`` is True when the sequence was cut to a maximum length (the
    completions past the cut are lost, and say so).
    """

    attempt_id: str
    rollout_id: str
    index: int
    input_ids: IntArray
    loss_mask: MaskArray
    logprobs: FloatArray
    spans: tuple[CallSpan, ...] = ()
    split_reason: SplitReason | None = None  # why this segment does not continue the one before it
    truncated: bool = False

    def __post_init__(self) -> None:
        _check_lengths(
            f"segment {self.index} of attempt {self.attempt_id}", self.input_ids, self.loss_mask, self.logprobs
        )
        if self.split_reason is not None and self.split_reason not in SPLIT_REASONS:
            raise RecordError(f"unknown split reason {self.split_reason!r}; valid: {', '.join(SPLIT_REASONS)}")
        n = self.input_ids.shape[0]
        for s in self.spans:
            if not 0 <= s.start < s.end <= n:
                raise RecordError(f"span of call {s.call_id} [{s.start}, {s.end}) is outside the segment (len {n})")

    def __len__(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def n_trained(self) -> int:
        """Tokens with mask 1."""
        return int(np.count_nonzero(self.loss_mask))

    @property
    def policy_versions(self) -> list[int]:
        """The sorted distinct policy versions that sampled this segment's trained tokens."""
        return sorted({s.policy_version for s in self.spans if s.policy_version is not None})


@dataclass(frozen=True, slots=True)
class Record:
    """One training row: a segment, its attempt's reward, a per-token advantage and the row's weight.

    ``advantages`` has the segment's length (0.0 where the mask is 0). ``weight`` is this row's share of its
    rollout's trained tokens: the rows of one rollout sum to 1, so a rollout split into several segments does not
    weigh more than one that was not (see ``docs/records.md``).
    """

    segment: Segment
    group_id: str
    reward: float
    advantages: FloatArray
    weight: float = 1.0
    policy: str | None = None  # several policies in one run: the policy whose calls made it (trains its adapter)

    def __post_init__(self) -> None:
        if self.advantages.ndim != 1 or self.advantages.shape[0] != len(self.segment):
            raise RecordError(
                f"record of attempt {self.segment.attempt_id} segment {self.segment.index}: advantages has "
                f"length {self.advantages.shape[0]}, input_ids {len(self.segment)}"
            )

    # Shortcuts to the segment, so trainers and exporters read one object.
    @property
    def rollout_id(self) -> str:
        return self.segment.rollout_id

    @property
    def attempt_id(self) -> str:
        return self.segment.attempt_id

    @property
    def input_ids(self) -> IntArray:
        return self.segment.input_ids

    @property
    def loss_mask(self) -> MaskArray:
        return self.segment.loss_mask

    @property
    def logprobs(self) -> FloatArray:
        return self.segment.logprobs

    def __len__(self) -> int:
        return len(self.segment)

    def scalar_advantage(self) -> float | list[float]:
        """The advantage as the export writes it: one float when every trained token shares it, else a list."""
        trained = self.advantages[self.segment.loss_mask.astype(bool)]
        if trained.size == 0:
            return 0.0
        first = float(trained[0])
        if bool(np.all(trained == trained[0])):
            return first
        return [float(x) for x in self.advantages]


class _Decoder(Protocol):
    def decode(self, ids: Sequence[int], /) -> str: ...


def visualize(record: Record | Segment, tokenizer: _Decoder | None = None, *, max_tokens: int | None = None) -> str:
    """A printable view of a record: trained tokens (mask 1) inside ``[...]``, context tokens plain.

    With a tokenizer the runs are decoded to text; without, ids are shown. Each run of trained tokens is one
    bracket, so ``[Hello world]`` means those tokens are trained and everything outside is context. The returned
    string is markup-free plain text (safe to print with rich using ``markup=False``).
    """
    seg = record.segment if isinstance(record, Record) else record
    ids = seg.input_ids if max_tokens is None else seg.input_ids[:max_tokens]
    mask = seg.loss_mask[: ids.shape[0]]
    if ids.shape[0] == 0:
        return "(empty)"
    change = np.flatnonzero(np.diff(mask.astype(np.int8))) + 1
    bounds = [0, *change.tolist(), int(ids.shape[0])]
    parts: list[str] = []
    for a, b in itertools.pairwise(bounds):
        chunk = ids[a:b].tolist()
        text = tokenizer.decode(chunk) if tokenizer is not None else " ".join(str(t) for t in chunk)
        parts.append(f"[{text}]" if mask[a] else text)
    sep = "" if tokenizer is not None else " "
    head = (
        f"segment {seg.index} of {seg.attempt_id} ({len(seg)} tokens, {seg.n_trained} trained"
        f"{', split: ' + seg.split_reason if seg.split_reason else ''}{', truncated' if seg.truncated else ''})"
    )
    tail = "" if max_tokens is None or max_tokens >= len(seg) else f" ... (+{len(seg) - max_tokens} tokens)"
    return head + "\n" + sep.join(parts) + tail
