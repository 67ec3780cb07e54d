"""LangChain / LangGraph: a ``ChatOpenAI`` pointed at the attempt, and callbacks that tag sub-agent calls.

``chat_model(llm)`` builds a ``ChatOpenAI`` on ``llm`` whose HTTP clients tag requests (``tagging``) and whose
``LightningCallbackHandler`` sets the tag for each model call from its LangChain run metadata:

* ``lightning_agent`` — the sub-agent: an explicit ``metadata={"lightning_agent": ...}`` in the run config or the
  handler's fixed ``agent``, else the LangGraph path of the graph nodes above the calling node (from
  ``langgraph_checkpoint_ns``: a supervisor graph whose node ``researcher`` runs a ReAct sub-graph tags that
  sub-graph's calls ``researcher``), else ``main``;
* ``lightning_node`` — the LangGraph node that called the model (``langgraph_node``), when there is one.

The proxy records them in the call's ``request["metadata"]``, so the calls of each sub-agent can be told apart
(and trained or filtered separately). The handler runs inline (``run_inline = True``): LangChain calls it in the
same context as the model request, which is what lets a ``ContextVar`` carry the tag to the HTTP layer.
"""

from __future__ import annotations

from typing import Any
from uuid import UUID

from langchain_core.callbacks import BaseCallbackHandler
from langchain_openai import ChatOpenAI

from lightning_sdk.agent import LLM
from lightning_sdk_integrations.tagging import (
    async_tagging_http_client,
    current_tags,
    set_tags,
    tagging_http_client,
)

__all__ = ["LightningCallbackHandler", "chat_model", "tags_from_metadata"]


def tags_from_metadata(metadata: dict[str, Any] | None, default_agent: str | None = None) -> dict[str, str]:
    """The tags of one model call, from LangChain run metadata (see the module docstring)."""
    md = metadata or {}
    agent = md.get("lightning_agent") or default_agent
    if not agent:
        ns = str(md.get("langgraph_checkpoint_ns") or "")
        path = [part.split(":", 1)[0] for part in ns.split("|") if part]
        agent = "/".join(path[:-1]) or "main"
    tags = {"lightning_agent": str(agent)}
    if md.get("langgraph_node"):
        tags["lightning_node"] = str(md["langgraph_node"])
    return tags


class LightningCallbackHandler(BaseCallbackHandler):
    """Tags each chat-model call with its sub-agent and node (``agent`` fixes the sub-agent name)."""

    run_inline = True

    def __init__(self, agent: str | None = None) -> None:
        self.agent = agent
        self._previous: dict[UUID, dict[str, str] | None] = {}

    def on_chat_model_start(
        self,
        serialized: dict[str, Any],
        messages: list[list[Any]],
        *,
        run_id: UUID,
        metadata: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        self._previous[run_id] = current_tags()
        set_tags(tags_from_metadata(metadata, self.agent))

    def _restore(self, run_id: UUID) -> None:
        if run_id in self._previous:
            set_tags(self._previous.pop(run_id))

    def on_llm_end(self, response: Any, *, run_id: UUID, **kwargs: Any) -> None:
        self._restore(run_id)

    def on_llm_error(self, error: BaseException, *, run_id: UUID, **kwargs: Any) -> None:
        self._restore(run_id)


def chat_model(llm: LLM, *, agent: str | None = None, **kwargs: Any) -> ChatOpenAI:
    """A ``ChatOpenAI`` for ``llm`` that tags its calls (``agent`` fixes the sub-agent name; other keyword arguments
    go to ``ChatOpenAI``, e.g. ``temperature``)."""
    callbacks = list(kwargs.pop("callbacks", None) or [])
    callbacks.append(LightningCallbackHandler(agent))
    return ChatOpenAI(
        base_url=llm.base_url,
        api_key=llm.api_key,
        model=llm.model,
        http_client=tagging_http_client(),
        http_async_client=async_tagging_http_client(),
        callbacks=callbacks,
        **kwargs,
    )
