"""Token fidelity: render chat messages to the policy's token ids, bridge follow-up calls, parse replies.

- ``ChatRenderer``: the policy's tokenizer + chat template (``render(messages, tools) -> ids``), its template
  probed at load (``capabilities``; ``ChatRenderer.for_policy`` picks the template a policy is served with).
- ``render_prompt``: a call's prompt ids, reusing an earlier call's prompt + sampled ids verbatim (history policies
  ``exact`` and ``template``), with the reason when the call starts a new segment.
- ``get_parser`` / ``OutputParser`` / ``StreamingParser``: completion ids -> OpenAI assistant message or deltas.
- ``retokenize_reply`` / ``retokenize_text``: the never-silent fallback for engines that return text only.

See docs/tokens.md.
"""

from lightning_sdk.tokens._bridge import HistoryPolicy, PriorCall, RenderedPrompt, SplitReason, render_prompt
from lightning_sdk.tokens._families import FAMILIES, Family, detect_family, get_family, register_family
from lightning_sdk.tokens._messages import message_key, message_text, short_tool_call_id, to_template_messages
from lightning_sdk.tokens._parsers import (
    PARSERS,
    OutputParser,
    ParsedReply,
    StreamingParser,
    ToolCall,
    get_parser,
    new_tool_call_id,
    register_parser,
    trailing_partial,
)
from lightning_sdk.tokens._render import ChatRenderer
from lightning_sdk.tokens._retokenize import Retokenized, render_reply_text, retokenize_reply, retokenize_text
from lightning_sdk.tokens._templates import (
    BUILTIN_TEMPLATES,
    TemplateCapabilities,
    builtin_template,
    probe_capabilities,
)

__all__ = [
    "BUILTIN_TEMPLATES",
    "FAMILIES",
    "PARSERS",
    "ChatRenderer",
    "Family",
    "HistoryPolicy",
    "OutputParser",
    "ParsedReply",
    "PriorCall",
    "RenderedPrompt",
    "Retokenized",
    "SplitReason",
    "StreamingParser",
    "TemplateCapabilities",
    "ToolCall",
    "builtin_template",
    "detect_family",
    "get_family",
    "get_parser",
    "message_key",
    "message_text",
    "new_tool_call_id",
    "probe_capabilities",
    "register_family",
    "register_parser",
    "render_prompt",
    "render_reply_text",
    "retokenize_reply",
    "retokenize_text",
    "short_tool_call_id",
    "to_template_messages",
    "trailing_partial",
]
