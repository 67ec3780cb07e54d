"""The fixture's real tokenizers load offline, carry TOKENIZERS.md's check ids, and their families are detected."""

from __future__ import annotations

import pytest

from lightning_sdk.errors import TokenizationError
from lightning_sdk.tokens import ChatRenderer, detect_family, get_family
from tests.support.tokenizers import load_tokenizer, tokenizer_dir
from tests.tokens.conversations import FAMILY_NAMES, renderer_for

CHECK_IDS = {
    "qwen3": {"<|im_start|>": 151644, "<think>": 151667},
    "qwen2.5": {"<|im_start|>": 151644, "<tool_call>": 151657},
    "llama3.1": {"<|begin_of_text|>": 128000, "<|eot_id|>": 128009},
    "llama3.2": {"<|begin_of_text|>": 128000, "<|eot_id|>": 128009},
    "gpt-oss": {"<|start|>": 200006, "<|return|>": 200002, "<|call|>": 200012},
    "mistral-nemo": {"[INST]": 3, "[TOOL_CALLS]": 9},
    "deepseek-v3": {"<think>": 128798, "</think>": 128799},
}
DETECTED = {
    "qwen3": "qwen3",
    "qwen2.5": "qwen2.5",
    "llama3.1": "llama3",
    "llama3.2": "llama3",
    "gpt-oss": "gpt-oss",
    "mistral-nemo": "mistral",
    "deepseek-v3": "deepseek-v3",
}


@pytest.mark.parametrize("name", FAMILY_NAMES)
def test_fixture_directory_loads_with_autotokenizer(name: str) -> None:
    assert (tokenizer_dir(name) / "tokenizer.json").exists()
    tok = load_tokenizer(name)  # AutoTokenizer.from_pretrained(tokenizer_dir(name)), cached per session
    assert {t: tok.convert_tokens_to_ids(t) for t in CHECK_IDS[name]} == CHECK_IDS[name]
    assert tok.chat_template


@pytest.mark.parametrize("name", FAMILY_NAMES)
def test_family_detected_from_template(name: str) -> None:
    renderer = renderer_for(name)
    assert renderer.family.name == DETECTED[name]
    assert detect_family(renderer.chat_template) is get_family(DETECTED[name])


def test_qwen25_think_is_plain_text_and_gpt_oss_matches_tiktoken() -> None:
    qwen25 = renderer_for("qwen2.5")
    assert len(qwen25.encode("<think>")) > 1  # Qwen2.5 has no <think> token
    import tiktoken.load

    from tests.support.tokenizers import _o200k_file

    ranks = tiktoken.load.load_tiktoken_bpe(str(_o200k_file()))
    enc = tiktoken.Encoding("o200k_base", pat_str=_O200K_PATTERN, mergeable_ranks=ranks, special_tokens={})
    text = "Grüße, world! 12345 tokens\n\n\tdef f(x): return x**2  # ünïcödé 你好"
    assert renderer_for("gpt-oss").encode(text) == enc.encode(text)


_O200K_PATTERN = "|".join(
    [
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""\p{N}{1,3}""",
        r""" ?[^\s\p{L}\p{N}]+[\r\n/]*""",
        r"""\s*[\r\n]+""",
        r"""\s+(?!\S)""",
        r"""\s+""",
    ]
)


def test_stop_ids_are_the_turn_ends() -> None:
    qwen = renderer_for("qwen3")
    assert qwen.stop_token_ids == {qwen.token_id("<|im_end|>"), qwen.token_id("<|im_start|>")}  # a new turn ends it
    oss = renderer_for("gpt-oss")
    assert oss.stop_token_ids == {200002, 200012}  # <|return|>, <|call|>; <|end|> only closes a message
    llama = renderer_for("llama3.1")
    assert {128009, 128008} <= llama.stop_token_ids  # <|eot_id|>, <|eom_id|>


def test_unknown_family_and_template_errors_are_tokenization_errors() -> None:
    with pytest.raises(TokenizationError, match="unknown chat-template family"):
        get_family("nope")
    with pytest.raises(TokenizationError, match="cannot tell"):
        detect_family("{{ messages }}")
    mistral = renderer_for("mistral-nemo")
    with pytest.raises(TokenizationError, match="alternate"):
        mistral.render([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])
    tok = load_without_template()
    with pytest.raises(TokenizationError, match="no chat template"):
        ChatRenderer(tok)


def load_without_template() -> object:
    class NoTemplate:
        chat_template = None

    return NoTemplate()
