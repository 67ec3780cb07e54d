"""What a training job is built from (``Parts``: serving engine, learner, weight publishing) and what the training
loop asks of a learner (``LearnerLike``). ``app/parts.py`` makes them from the ``[engine]`` and learner sections;
the backends that build their own (``[verl]``: ``trainer/verl/adapter.py``; several policies: ``app/policies.py``;
the learner as a Ray actor: ``lightning_sdk/cluster``) return one too.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from transformers import PreTrainedModel

from lightning_sdk.engines.serving import ServingEngine
from lightning_sdk.records.record import Record

if TYPE_CHECKING:
    from lightning_sdk.tokens import ChatRenderer

__all__ = ["LearnerLike", "Parts", "learner_elsewhere_parts"]


class LearnerLike(Protocol):
    """What the training loop asks of a learner (``Learner`` and ``VerlLearner`` both are one)."""

    steps: int

    def step(self, records: Sequence[Record]) -> dict[str, float]: ...

    def weights(self) -> dict[str, Any]:  # a state dict (several policies: each policy's adapter state)
        ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...

    # -- optional: defaults for a learner in this process (the Ray learner actor overrides them) --------------------
    #: what happened to the learner's process (a restart and the step run again); none for one in this process
    events: Sequence[dict[str, Any]] = ()

    def where(self) -> dict[str, Any] | None:
        """Where the learner runs (node, process), for ``cluster.json``; None for one in this process."""
        return None

    def reset_optimizer(self) -> None:
        """Forget the optimizer's moments (after a warm start moved the weights); nothing to forget by default."""
        return None


@dataclass
class Parts:
    """What ``build_parts`` made. ``weights()`` is what ``engine.update_weights`` gets after a step (run it off the
    event loop: it may write a checkpoint); ``model`` is the torch model a warm start trains (None: the backend
    keeps its weights elsewhere, so no warm start)."""

    engine: ServingEngine
    learner: LearnerLike
    weights: Callable[[], Any]
    save_model: Callable[[Path], None]
    model: PreTrainedModel | None = None
    closers: list[Callable[[], None]] = field(default_factory=list)
    renderer: ChatRenderer | None = None  # the policy's template, probed (``ChatRenderer.for_policy``)
    #: what the warm start's evaluations publish (None: ``weights``): the weights of ``model``, where the learner keeps
    #: its own copy elsewhere (a learner process gets the warm-started weights only at the end, ``reset_optimizer``)
    warm_start_weights: Callable[[], Any] | None = None
    policies: tuple[str, ...] = ()  # several policies in one run (``[policies]``: app/policies.py); empty: one

    async def close(self) -> None:
        """Close the engine (and the servers it launched), then shut the backend down."""
        await self.engine.close()
        for close in self.closers:
            close()


def learner_elsewhere_parts(learner: Any, engine: ServingEngine, model: PreTrainedModel, tokenizer: Any) -> Parts:
    """The parts of a run whose learner keeps its weights outside this process (a child process: ``[learner]
    process``; a Ray actor: ``[cluster] learner``). ``learner`` offers ``weights()``, ``save(out, tokenizer)`` and
    ``close()``; ``model`` is this process's copy of the policy: the warm start trains it, and its evaluations serve
    its weights (the learner gets them at the warm start's end, ``reset_optimizer``)."""
    return Parts(
        engine=engine,
        learner=learner,
        weights=learner.weights,
        save_model=lambda out: learner.save(out, tokenizer),
        model=model,
        closers=[learner.close],
        warm_start_weights=lambda: {k: v.detach().clone() for k, v in model.state_dict().items()},
    )
