"""The default policy: tokenizer, chat template with tools, model directory, and the warm start's loss mask."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from lightning_sdk.errors import TokenizationError
from lightning_sdk.policy.model import load_policy
from lightning_sdk.policy.warm_start import (
    ThreadChoice,
    WarmStartConfig,
    render_demonstration,
    render_demonstration_rows,
    warm_start,
)
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


def test_a_turn_merged_with_the_template_newline_is_trained_from_its_first_token(policy_dir: Path) -> None:
    """The BPE merges ``"\\n"`` + ``"<"`` into one token, so the full render's ids do not start with the generation
    prompt's: the turn must still be trained on the tokens the policy samples after that prompt, first one included
    (the old mask started at len(prompt) in the merged render and silently skipped it)."""
    tok = AutoTokenizer.from_pretrained(str(policy_dir))
    merged = [t for t in tok.get_vocab() if t.startswith("Ċ<")]
    assert merged, "the tiny tokenizer is expected to merge a newline with '<'"
    messages = [
        {"role": "user", "content": "what is 2 + 2?"},
        {"role": "assistant", "content": "<b>4</b>"},
        {"role": "user", "content": "and 3 + 3?"},
        {"role": "assistant", "content": "<b>6</b>"},
    ]
    prompt = tok.apply_chat_template(messages[:1], add_generation_prompt=True, tokenize=True, return_dict=False)
    whole = tok.apply_chat_template(messages[:2], tokenize=True, return_dict=False)
    assert whole[: len(prompt)] != prompt  # the merge this test is about
    rows = render_demonstration_rows(tok, messages)
    trained = [
        tok.decode([i for i, m in zip(ids, mask, strict=True) if m], skip_special_tokens=False) for ids, mask in rows
    ]
    assert "".join(trained) == "<b>4</b><|im_end|><b>6</b><|im_end|>"
    first_ids, first_mask = rows[0]
    assert first_ids[: len(prompt)] == prompt and first_mask[len(prompt)] == 1
    for ids, mask in rows:  # each row is a generation prompt followed by sampled tokens only
        start = mask.index(1)
        assert tok.decode(ids[:start]).endswith("<|im_start|>assistant\n")
    assert len(rows) == 2  # the second turn's prompt holds the first turn as the template renders it (merged)
    with pytest.raises(TokenizationError, match="2 rows"):
        render_demonstration(tok, messages)


def test_demonstration_rows_match_the_single_row_when_nothing_merges(policy_dir: Path) -> None:
    tok = AutoTokenizer.from_pretrained(str(policy_dir))
    tasks = calc_tasks()
    demo = tasks.demonstration(tasks.make_tasks(1, "train", seed=4)[0])
    rows = render_demonstration_rows(tok, demo["messages"], demo["tools"])
    assert len(rows) == 1
    assert rows[0] == render_demonstration(tok, demo["messages"], demo["tools"])
    full = tok.apply_chat_template(demo["messages"], tools=demo["tools"], tokenize=True, return_dict=False)
    ids, _ = rows[0]
    assert full[: len(ids)] == ids  # the whole conversation up to the last EOS


def test_thread_choice_measures_each_count_and_keeps_the_faster() -> None:
    """Every ``every`` steps one step runs on each count (never the first step); the lower time per token wins,
    by at least the margin (15%) against the current count."""
    choice = ThreadChoice(None, every=5, most=2)
    assert choice.candidates == [1, 2] and choice.threads_for(0) == 2  # the first step: allocations, not measured
    assert [choice.threads_for(s) for s in range(1, 12)] == [1, 2, 2, 2, 2, 1, 2, 2, 2, 2, 1]
    choice.observe(0, 2, 100.0, 1000)  # not a measuring step: ignored
    choice.observe(1, 1, 1.0, 1000)
    assert choice.chosen == 2 and choice.history == []  # one count measured: nothing chosen yet
    choice.observe(2, 2, 3.0, 1000)  # two threads 3x slower per token (a busy machine)
    assert choice.chosen == 1 and choice.history == [(3, 1)]
    assert [choice.threads_for(s) for s in (3, 4, 5)] == [1, 1, 1]
    choice.observe(6, 1, 2.0, 2000)  # 1 ms per token
    choice.observe(7, 2, 0.5, 1000)  # 0.5 ms per token: the machine went quiet
    assert choice.chosen == 2 and choice.history == [(3, 1), (8, 2)]
    choice.observe(11, 1, 1.0, 1000)
    choice.observe(12, 2, 0.6, 1000)  # still two: the history records only moves
    assert choice.history == [(3, 1), (8, 2)]
    choice.observe(16, 1, 0.9, 1000)  # one thread 10% faster: within the margin, two threads stay
    choice.observe(17, 2, 1.0, 1000)
    assert choice.chosen == 2 and choice.history == [(3, 1), (8, 2)]
    choice.observe(21, 1, 0.8, 1000)  # 20% faster: one thread takes over
    choice.observe(22, 2, 1.0, 1000)
    assert choice.chosen == 1 and choice.history == [(3, 1), (8, 2), (23, 1)]
    fixed = ThreadChoice(1, every=5, most=2)
    assert fixed.candidates == [1] and {fixed.threads_for(s) for s in range(12)} == {1}


def test_warm_start_runs_on_the_chosen_threads_and_puts_the_count_back(policy_dir: Path) -> None:
    """A fixed count is used for every step (read from inside the model's forward), the calling thread's count
    is restored afterwards; unset, the steps measure both counts and the result says what was chosen."""
    model, tok = load_policy(policy_dir)
    tasks = calc_tasks()
    demos = [tasks.demonstration(t) for t in tasks.make_tasks(16, "train", seed=3)]
    seen: list[int] = []
    hook = model.register_forward_pre_hook(lambda _m, _a: seen.append(torch.get_num_threads()))
    outer = torch.get_num_threads()
    torch.set_num_threads(2)  # two candidates (1 and 2) whatever this machine's default
    before = torch.get_num_threads()
    try:
        cfg = WarmStartConfig(batch_size=4, max_steps=3, eval_every=100, threads=1)
        assert warm_start(model, tok, demos, lambda _m: 0.0, cfg).threads == []
        assert seen == [1, 1, 1] and torch.get_num_threads() == before
        seen.clear()
        auto = WarmStartConfig(batch_size=4, max_steps=7, eval_every=100, retune_every=3)
        result = warm_start(model, tok, demos, lambda _m: 0.0, auto)
        after = torch.get_num_threads()
    finally:
        hook.remove()
        torch.set_num_threads(outer)
    assert len(seen) == 7 and seen[1] == 1 and seen[2] == 2 and seen[4] == 1 and seen[5] == 2  # the measuring steps
    assert result.threads and result.threads[0][0] == 3 and result.threads[0][1] in (1, 2)
    assert after == before
