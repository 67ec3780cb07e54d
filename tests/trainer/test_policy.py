"""The default policy: tokenizer, chat template with tools, model directory, and the warm start's loss mask."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from lightning_sdk.policy.model import load_policy
from lightning_sdk.policy.warm_start import WarmStartConfig, render_demonstration, warm_start
from lightning_sdk.tokens import ChatRenderer, get_parser
from tests.trainer.tiny import build_small_policy, calc_tasks


@pytest.fixture(scope="module")
def policy_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_small_policy(tmp_path_factory.mktemp("policy") / "tiny")


def test_is_a_normal_hf_directory(policy_dir: Path) -> None:
    tok = AutoTokenizer.from_pretrained(str(policy_dir))
    model = AutoModelForCausalLM.from_pretrained(str(policy_dir))
    assert model.config.model_type == "qwen3"
    assert model.config.vocab_size == len(tok) <= 400
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>"
    assert tok.chat_template and "<tool_call>" in tok.chat_template
    config = json.loads((policy_dir / "tokenizer_config.json").read_text())
    assert config["tokenizer_class"] == "TokenizersBackend"  # AutoTokenizer honours the saved tokenizer.json


def test_digits_are_single_tokens_and_text_round_trips(policy_dir: Path) -> None:
    tok = AutoTokenizer.from_pretrained(str(policy_dir))
    ids = tok.encode("12345 + 678 = ünïcödé", add_special_tokens=False)
    pieces = [tok.decode([i]) for i in ids]
    assert pieces[:5] == ["1", "2", "3", "4", "5"]
    assert tok.decode(ids) == "12345 + 678 = ünïcödé"  # byte-level: nothing is unknown


def test_episodes_are_short(policy_dir: Path) -> None:
    tok = AutoTokenizer.from_pretrained(str(policy_dir))
    tasks = calc_tasks()
    demo = tasks.demonstration(tasks.make_tasks(1, "train", seed=9)[0])
    ids, mask = render_demonstration(tok, demo["messages"], demo["tools"])
    assert len(ids) < 200  # 400 entries here (480 by default: ~90); a character vocabulary needs ~900
    assert 8 < sum(mask) < 40


def test_mask_covers_exactly_the_assistant_turns(policy_dir: Path) -> None:
    tok = AutoTokenizer.from_pretrained(str(policy_dir))
    tasks = calc_tasks()
    task = tasks.make_tasks(1, "train", seed=4)[0]
    demo = tasks.demonstration(task)
    ids, mask = render_demonstration(tok, demo["messages"], demo["tools"])
    trained = [i for i, m in zip(ids, mask, strict=True) if m]
    text = tok.decode(trained, skip_special_tokens=False)
    expected_call = json.dumps({"name": "calculator", "arguments": {"expression": task["expression"]}})
    assert text == f"<tool_call>{expected_call}</tool_call><|im_end|>{task['answer']}<|im_end|>"


def test_template_and_hermes_parser_agree(policy_dir: Path) -> None:
    """What the template renders for an assistant tool call, the proxy's parser reads back as the same call."""
    tok = AutoTokenizer.from_pretrained(str(policy_dir))
    renderer = ChatRenderer(tok)
    parser = get_parser(renderer)
    tasks = calc_tasks()
    demo = tasks.demonstration(tasks.make_tasks(1, "train", seed=6)[0])
    user = demo["messages"][:1]
    prompt = renderer.render(user, demo["tools"], add_generation_prompt=True)
    full = renderer.render(demo["messages"][:2], demo["tools"], add_generation_prompt=False)
    assert full[: len(prompt)] == prompt
    completion = full[len(prompt) :]
    completion = completion[: completion.index(tok.eos_token_id) + 1]
    reply = parser.parse(completion)
    assert len(reply.tool_calls) == 1
    call = reply.tool_calls[0]
    assert call.name == "calculator"
    assert json.loads(call.arguments) == json.loads(demo["messages"][1]["tool_calls"][0]["function"]["arguments"])


def test_warm_start_stops_on_measured_success(policy_dir: Path) -> None:
    model, tok = load_policy(policy_dir)
    tasks = calc_tasks()
    demos = [tasks.demonstration(t) for t in tasks.make_tasks(64, "train", seed=3)]
    calls: list[int] = []

    def evaluate(m: torch.nn.Module) -> float:
        calls.append(1)
        return 0.5 if len(calls) >= 2 else 0.0

    cfg = WarmStartConfig(lr=3e-3, batch_size=8, max_steps=50, eval_every=2, eval_below_loss=None, target_success=0.4)
    result = warm_start(model, tok, demos, evaluate, cfg)
    assert result.steps == 4 and result.success == 0.5
    assert result.history == [(2, 0.0), (4, 0.5)]
