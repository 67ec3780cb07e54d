"""The agent side: how users bring their agents, and the workers that run them.

* ``rollout`` — decorate ``(task, llm) -> reward | None`` (sync or async); ``LLM`` is where it sends its calls;
  ``emit_reward`` reports rewards from anywhere inside it (threads: ``Thread`` / ``ContextExecutor``).
* ``CommandAgent`` — any program as an agent, with the attempt's endpoint in its environment.
* ``WorkerPool`` / ``run_tasks`` — claim attempts and run them (``lightning-sdk run`` and, in process, ``train``).
"""

from lightning_sdk.agent._base import Agent, AttemptOutcome
from lightning_sdk.agent._command import CommandAgent
from lightning_sdk.agent._context import AttemptContext, ContextExecutor, Thread, current_attempt, emit_reward
from lightning_sdk.agent._llm import LLM
from lightning_sdk.agent._rollout import RolloutAgent, rollout
from lightning_sdk.agent.loader import agent_from_config, import_path, load_agent
from lightning_sdk.agent.tasks import RunSummary, run_tasks
from lightning_sdk.agent.worker import AttemptResult, WorkerPool, policy_model_name

__all__ = [
    "LLM",
    "Agent",
    "AttemptContext",
    "AttemptOutcome",
    "AttemptResult",
    "CommandAgent",
    "ContextExecutor",
    "RolloutAgent",
    "RunSummary",
    "Thread",
    "WorkerPool",
    "agent_from_config",
    "current_attempt",
    "emit_reward",
    "import_path",
    "load_agent",
    "policy_model_name",
    "rollout",
    "run_tasks",
]
