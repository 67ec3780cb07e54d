"""Templates checked, not assumed: what a policy's chat template really renders, and the built-in override.

``probe_capabilities`` renders a few probe conversations with the template and records what shows up in the text:
tool definitions (rendered with and without a probe tool, compared), assistant tool calls, tool results,
reasoning and a system prompt. Each capability is ``True`` (rendered), ``False`` (rendered without error, and the
probe's marker is missing: the template drops it) or ``None`` (the probe itself failed: unknown, nothing is refused
on it). The record lives on the ``ChatRenderer`` (``renderer.capabilities``), which refuses a request that uses a
feature the template drops (``TemplateFeatureError``) instead of rendering a prompt without it.

A template that cannot render tools gets a tool format from us: ``policy.chat_template`` names a file or a
built-in (``BUILTIN_TEMPLATES``), or the family's default applies (ChatML: ``hermes``, the layout Qwen2.5 uses).
``builtin_template`` makes the built-in's text for one model: the model's own default system prompt is carried over
so a conversation without tools renders exactly as the model's template renders it.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from lightning_sdk.errors import TokenizationError

__all__ = ["BUILTIN_TEMPLATES", "TemplateCapabilities", "builtin_template", "probe_capabilities", "read_template"]

Message = dict[str, Any]
RenderFn = Callable[[Sequence[Mapping[str, Any]], Sequence[Mapping[str, Any]] | None, bool], str]

BUILTIN_TEMPLATES: dict[str, str] = {
    "hermes": "templates/hermes.jinja",
}
"""Built-in template names (``policy.chat_template = "hermes"``) -> their file under ``lightning_sdk/assets``."""

_MARK = "lsdkprobe"
_PROBE_TOOL: Message = {
    "type": "function",
    "function": {
        "name": f"{_MARK}_fn",
        "description": f"{_MARK} description",
        "parameters": {"type": "object", "properties": {f"{_MARK}_arg": {"type": "integer"}}},
    },
}


@dataclass(frozen=True)
class TemplateCapabilities:
    """What a chat template renders (``True``), drops (``False``) or could not be probed for (``None``).

    ``tools``: tool definitions (the rendering with a probe tool differs from the one without and names it);
    ``tool_calls``: an assistant message's tool calls; ``tool_results``: ``tool`` messages; ``reasoning``: an
    assistant message's reasoning (``False`` when the family has no reasoning field); ``system``: a system prompt.
    """

    tools: bool | None
    tool_calls: bool | None
    tool_results: bool | None
    reasoning: bool | None
    system: bool | None

    def as_dict(self) -> dict[str, bool | None]:
        return asdict(self)

    def missing(self) -> list[str]:
        """The features the template drops (probed ``False``)."""
        return [name for name, value in asdict(self).items() if value is False]


def _probe(render: RenderFn, messages: list[Message], tools: list[Message] | None, marker: str) -> bool | None:
    try:
        return marker in render(messages, tools, False)
    except Exception:  # a template that refuses the probe's shape: unknown, never refused on
        return None


def probe_capabilities(render: RenderFn, reasoning_key: str | None) -> TemplateCapabilities:
    """Probe a template through ``render(messages, tools, add_generation_prompt) -> text`` (messages already in
    the OpenAI shape; ``render`` shapes them for the family and must not check capabilities itself)."""
    user: Message = {"role": "user", "content": "hello"}
    try:
        without = render([user], None, True)
        with_tool = render([user], [_PROBE_TOOL], True)
        tools: bool | None = with_tool != without and f"{_MARK}_fn" in with_tool
    except Exception:
        tools = None
    call: Message = {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {
                "id": "call_lsdkprobe1",
                "type": "function",
                "function": {"name": f"{_MARK}_call", "arguments": json.dumps({f"{_MARK}_arg": 1})},
            }
        ],
    }
    result: Message = {"role": "tool", "tool_call_id": "call_lsdkprobe1", "content": f"{_MARK}_result"}
    probe_tools = [_PROBE_TOOL] if tools else None
    tool_calls = _probe(render, [user, call], probe_tools, f"{_MARK}_call")
    tool_results = _probe(render, [user, call, result], probe_tools, f"{_MARK}_result")
    reasoning: bool | None = False
    if reasoning_key is not None:
        thought: Message = {"role": "assistant", "content": "done", "reasoning_content": f"{_MARK}_thought"}
        reasoning = _probe(render, [user, thought], None, f"{_MARK}_thought")
    system = _probe(render, [{"role": "system", "content": f"{_MARK}_system"}, user], None, f"{_MARK}_system")
    return TemplateCapabilities(tools, tool_calls, tool_results, reasoning, system)


def read_template(value: str, base: Path | None = None) -> tuple[str, str]:
    """``policy.chat_template``'s value -> (template text or the built-in's name, source label).

    A built-in name gives ``("builtin", name)`` (its text depends on the model: ``builtin_template``); anything
    else is a file path (relative to ``base``): ``(text, "file:PATH")``. A missing file is a ``TokenizationError``
    naming the built-ins."""
    if value in BUILTIN_TEMPLATES:
        return "builtin", value
    path = Path(value).expanduser()
    if base is not None and not path.is_absolute():
        path = base / path
    if not path.is_file():
        known = ", ".join(sorted(BUILTIN_TEMPLATES))
        raise TokenizationError(f"chat_template {value!r}: not a built-in template ({known}) and no such file ({path})")
    return path.read_text(encoding="utf-8"), f"file:{path}"


def _default_system(render_model: Callable[[list[Message]], str]) -> str | None:
    """The system prompt the model's ChatML template writes when the conversation has none (SmolLM2's "You are a
    helpful AI assistant named SmolLM..."), or None when it writes none."""
    text = render_model([{"role": "user", "content": f"{_MARK}_user"}])
    head = text[: text.find(f"<|im_start|>user\n{_MARK}_user")]
    if not head:
        return None
    match = re.fullmatch(r"<\|im_start\|>system\n(.*)<\|im_end\|>\n", head, flags=re.DOTALL)
    if match is None:
        raise TokenizationError(
            f"the model's template writes {head[:80]!r} before the first user turn: the built-in hermes template "
            "cannot reproduce it; set policy.chat_template to a template file"
        )
    return match.group(1)


def builtin_template(name: str, render_model: Callable[[list[Message]], str]) -> str:
    """The text of built-in template ``name`` for one model; ``render_model(messages) -> text`` renders with the
    model's own template (no generation prompt), to carry its default system prompt over."""
    if name not in BUILTIN_TEMPLATES:
        raise TokenizationError(f"no built-in chat template {name!r}; known: {', '.join(sorted(BUILTIN_TEMPLATES))}")
    text = resources.files("lightning_sdk.assets").joinpath(BUILTIN_TEMPLATES[name]).read_text(encoding="utf-8")
    default = _default_system(render_model)
    if default is None:
        return text
    # a Jinja string literal: JSON's escapes (\n, \", \\, \uXXXX) are Jinja's too
    return "{%- set default_system = " + json.dumps(default) + " %}\n" + text
