"""Several policies in one run: each a LoRA adapter over one frozen base model, chosen by the request's ``model``.

    [policies.planner] lora = {...}  ─▶ a ``Learner`` training its own adapter (over a copy of the base whose
    [policies.coder]   lora = {...}     frozen weights it shares)              ─┐
    one ``EmbeddedEngine`` over the base ─▶ an ``AdapterEngine`` per policy ◀──┘ its adapter, unmerged, per version

A rollout may call any of them (``model="planner"``, ``model="coder"``); the proxy routes each call to its policy
(``proxy/router.py``) and records it under that name with that policy's version. The records of each policy are built
from its own calls (``RecordsConfig.policies``: advantages per policy from the same rollout reward) and train only its
own adapter (``PolicyLearners.step``). Every step publishes every policy's adapter as the run's new version (one
version counter: staleness is measured as in a one-policy run; a policy without records in a step keeps its weights
under the new number).
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from lightning_sdk.engines.base import Engine, Generation, Sampling
from lightning_sdk.engines.embedded import AdapterEngine, EmbeddedEngine
from lightning_sdk.errors import EngineError
from lightning_sdk.records.record import Record
from lightning_sdk.trainer.config import PolicySettings
from lightning_sdk.trainer.learner import Learner, LearnerConfig, lora_config
from lightning_sdk.trainer.parts import LearnerLike, Parts

if TYPE_CHECKING:
    from lightning_sdk.tokens import ChatRenderer

__all__ = ["PolicyEngines", "PolicyLearners", "PolicySettings", "build_policies", "policy_parts", "save_policies"]


class PolicyLearners(LearnerLike):
    """One LoRA ``Learner`` per policy behind the loop's one learner (``LearnerLike``): ``step`` trains each policy on
    its own records only; ``weights`` is every policy's adapter state (``Learner.adapter_weights``)."""

    def __init__(self, learners: Mapping[str, Learner]) -> None:
        self.learners = dict(learners)
        self.steps = 0

    def step(self, records: Sequence[Record]) -> dict[str, float]:
        """Each policy's update on the records whose ``policy`` is its name; metrics as ``NAME/key``, and the
        loop's ``loss`` / ``tokens`` summed over the policies that trained."""
        out: dict[str, float] = {}
        unknown = {r.policy for r in records} - set(self.learners)
        if unknown:
            raise EngineError(f"records of unknown policies {sorted(map(str, unknown))}")
        for name, learner in self.learners.items():
            mine = [r for r in records if r.policy == name]
            if not mine:
                continue
            metrics = learner.step(mine)
            out.update({f"{name}/{k}": v for k, v in metrics.items()})
            out[f"{name}/records"] = float(len(mine))
            out["loss"] = out.get("loss", 0.0) + metrics["loss"]
            out["tokens"] = out.get("tokens", 0.0) + metrics["tokens"]
        self.steps += 1
        return out

    def weights(self) -> dict[str, dict[str, torch.Tensor]]:
        return {name: learner.adapter_weights() for name, learner in self.learners.items()}

    def state_dict(self) -> dict[str, Any]:
        states = {name: learner.state_dict() for name, learner in self.learners.items()}
        return {"policies": states, "steps": self.steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for name, learner in self.learners.items():
            learner.load_state_dict(state["policies"][name])
        self.steps = int(state["steps"])


class PolicyEngines(Engine):
    """The loop's one engine (``ServingEngine``) over the policies' ``AdapterEngine`` s: ``update_weights`` loads
    each policy's adapter state as ``version``; generation goes through a policy (``policies[name]``), never here."""

    def __init__(self, base: EmbeddedEngine, policies: Mapping[str, AdapterEngine]) -> None:
        self.base = base
        self.policies = dict(policies)
        self.stats: dict[str, Any] = base.stats  # the shared engine's counters (the same dict)

    @property
    def policy_version(self) -> int:
        return min(e.policy_version for e in self.policies.values())

    @property
    def tokenizer(self) -> PreTrainedTokenizerBase:
        return self.base.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.base.max_model_len

    async def generate(self, input_ids: list[int], sampling: Sampling, *, session_id: str | None = None) -> Generation:
        raise EngineError(f"a multi-policy engine generates through a policy: one of {sorted(self.policies)}")

    def stream(self, input_ids: list[int], sampling: Sampling, *, session_id: str | None = None) -> Any:
        raise EngineError(f"a multi-policy engine generates through a policy: one of {sorted(self.policies)}")

    async def update_weights(self, source: Any, version: int) -> None:
        if not isinstance(source, Mapping) or set(source) != set(self.policies):
            raise EngineError(f"multi-policy weights must map every policy ({sorted(self.policies)}) to its adapter")
        for name, engine in self.policies.items():
            await engine.update_weights(source[name], version)

    async def close(self) -> None:
        await self.base.close()


def policy_parts(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    renderer: ChatRenderer,
    policies: Mapping[str, PolicySettings],
    learner: LearnerConfig,
    *,
    max_batch_size: int = 64,
    threads: int | None = None,
) -> Parts:
    """The parts of a multi-policy run (``build_parts`` with ``[policies]``): ``build_policies``' engine and learners,
    every policy's adapter published after each step, and the model directory of ``save_policies``."""
    engines, learners = build_policies(
        model, tokenizer, policies, learner, max_batch_size=max_batch_size, threads=threads
    )
    return Parts(
        engine=engines,
        learner=learners,
        weights=learners.weights,
        save_model=functools.partial(save_policies, learners, model, tokenizer),
        model=None,  # no warm start: it would train the shared base
        renderer=renderer,
        policies=tuple(policies),
    )


def build_policies(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    policies: Mapping[str, PolicySettings],
    learner: LearnerConfig,
    *,
    max_batch_size: int = 64,
    threads: int | None = None,
) -> tuple[PolicyEngines, PolicyLearners]:
    """The engine (one base, an adapter per policy) and the learners (one per policy, each over a copy of ``model``
    that shares its frozen weights: the base is in memory twice, the engine's and the learners', not once per
    policy) of a multi-policy run."""
    if learner.lora is not None:
        raise EngineError("learner.lora with [policies]: each policy sets its own lora ([policies.NAME] lora)")
    pad = tokenizer.pad_token_id
    learners: dict[str, Learner] = {}
    for name, settings in policies.items():
        own = _sharing_copy(model)
        learners[name] = Learner(own, learner.model_copy(update={"lora": settings.lora}), pad_id=int(pad or 0))
    engine = EmbeddedEngine(copy.deepcopy(model), tokenizer, max_batch_size=max_batch_size, threads=threads)
    adapters = {name: engine.add_adapter(name, lora_config(s.lora)) for name, s in policies.items()}
    return PolicyEngines(engine, adapters), PolicyLearners(learners)


def save_policies(
    learners: PolicyLearners, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, out: Path
) -> None:
    """The run's model directory: the base model and tokenizer, and each policy's adapter in PEFT's format under
    ``adapters/NAME`` (``PeftModel.from_pretrained(base, out / "adapters" / NAME)`` loads it)."""
    model.save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))
    for name, learner in learners.learners.items():
        learner.model.save_pretrained(str(out / "adapters" / name))


def _sharing_copy(model: PreTrainedModel) -> PreTrainedModel:
    """A copy of ``model`` whose parameters share ``model``'s storage (LoRA freezes them: no policy writes them)."""
    own = copy.deepcopy(model)
    source = dict(model.named_parameters())
    for name, param in own.named_parameters():
        param.data = source[name].data
    return own
