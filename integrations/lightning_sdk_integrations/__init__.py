"""Adapters for agent frameworks that need more than a base URL to be traced and trained by lightning_sdk.

Most harnesses need nothing: point them at ``llm.base_url`` with ``llm.api_key`` (or run them as a
``CommandAgent``, which sets ``OPENAI_BASE_URL`` and friends). The modules here cover the rest, each importing its
framework only when used (install the ``integrations`` extra, or just the framework you use):

* ``tagging`` — label calls with the sub-agent that made them (recorded by the proxy in the call's request
  ``metadata``), for any httpx-based client;
* ``langchain`` — ``chat_model(llm)`` (a ``ChatOpenAI`` wired for tagging) and ``LightningCallbackHandler``, which
  tags every call with its LangGraph sub-agent and node;
* ``litellm`` — ``completion(llm, ...)`` / ``acompletion`` and ``completion_kwargs(llm)`` for ``litellm.completion``;
* ``openai_agents`` — ``model_provider(llm)`` and ``run_config(llm)`` for the OpenAI Agents SDK.
"""

__all__: list[str] = []  # the modules are imported one by one (each pulls in its framework)
