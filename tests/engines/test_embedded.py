"""The embedded engine with a real (small, randomly initialised) Qwen3 and the project's real tokenizer."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from lightning_sdk.engines.base import Engine, Sampling
from lightning_sdk.engines.embedded import EmbeddedEngine
from lightning_sdk.errors import EngineError
from lightning_sdk.policy.model import load_policy
from tests.support.waiting import until_async
from tests.trainer.tiny import build_small_policy


@pytest.fixture(scope="module")
def policy_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_small_policy(tmp_path_factory.mktemp("policy") / "tiny")


@pytest.fixture
async def engine(policy_dir: Path):  # type: ignore[no-untyped-def]
    eng = EmbeddedEngine.from_pretrained(policy_dir, max_batch_size=64)
    yield eng
    await eng.close()


def _prompt(engine: EmbeddedEngine, question: str) -> list[int]:
    out = engine.tokenizer.apply_chat_template(
        [{"role": "user", "content": question}], add_generation_prompt=True, tokenize=True, return_dict=False
    )
    return [int(i) for i in out]


def _reference_logprobs(
    model: torch.nn.Module, prompt: list[int], completion: list[int], temperature: float
) -> list[float]:
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float()
    if temperature > 0:
        logits = logits / temperature
    logp = torch.log_softmax(logits, -1)
    return [float(logp[i, t]) for i, t in enumerate(completion)]


async def test_implements_engine_protocol(engine: EmbeddedEngine) -> None:
    assert isinstance(engine, Engine)
    assert engine.policy_version == 0


async def test_logprobs_equal_a_separate_forward_pass(engine: EmbeddedEngine, policy_dir: Path) -> None:
    """Batched, left-padded, KV-cached sampling records the log-probs a plain forward pass gives."""
    model, _ = load_policy(policy_dir)
    prompts = [_prompt(engine, q) for q in ("What is 1 plus 2?", "Add 34 and 5.", "Multiply 7 by 8, please now.")]
    for temperature in (1.0, 0.7, 0.0):
        sampling = Sampling(max_tokens=12, temperature=temperature, seed=3)
        gens = await asyncio.gather(*(engine.generate(p, sampling) for p in prompts))
        for prompt, gen in zip(prompts, gens, strict=True):
            assert len(gen.completion_ids) == len(gen.logprobs) > 0
            ref = _reference_logprobs(model, prompt, gen.completion_ids, temperature)
            assert gen.logprobs == pytest.approx(ref, abs=2e-4)


async def test_long_completions_past_the_caches_room_keep_their_logprobs(
    engine: EmbeddedEngine, policy_dir: Path
) -> None:
    """Rows that decode past the running cache's room (``_RoomLayer.ROOM`` tokens: the buffers grow) and rows that
    join a running batch (``_room_cache`` stacks the parts) still record a plain forward pass's log-probs."""
    from lightning_sdk.engines.embedded import _RoomLayer

    model, _ = load_policy(policy_dir)
    long = Sampling(max_tokens=3 * _RoomLayer.ROOM, temperature=1.0, seed=5)
    steps = engine.stats["steps"]
    first = asyncio.ensure_future(engine.generate(_prompt(engine, "What is 12 plus 30?"), long))
    # the next ones join the running batch: once it has decoded a few tokens
    await until_async(lambda: engine.stats["steps"] >= steps + 3, what="the first row decoding")
    later = [_prompt(engine, q) for q in ("Add 3 and 4.", "What is the product of 6 and 7 and then some more?")]
    gens = await asyncio.gather(first, *(engine.generate(p, long) for p in later))
    assert max(len(g.completion_ids) for g in gens) > 2 * _RoomLayer.ROOM  # past the first room and a growth
    for prompt, gen in zip([_prompt(engine, "What is 12 plus 30?"), *later], gens, strict=True):
        ref = _reference_logprobs(model, prompt, gen.completion_ids, 1.0)
        assert gen.logprobs == pytest.approx(ref, abs=2e-4)


def test_room_cache_stacks_left_padded_parts_and_grows_in_place() -> None:
    from lightning_sdk.engines.embedded import _room_cache, _RoomLayer

    g = torch.Generator().manual_seed(0)
    a = [(torch.randn(2, 3, 5, 4, generator=g), torch.randn(2, 3, 5, 4, generator=g)) for _ in range(2)]
    b = [(torch.randn(1, 3, 7, 4, generator=g), torch.randn(1, 3, 7, 4, generator=g)) for _ in range(2)]
    cache = _room_cache(a, b)
    for layer, (ka, va), (kb, vb) in zip(cache.layers, a, b, strict=True):
        assert isinstance(layer, _RoomLayer)
        assert layer.keys.shape == (3, 3, 7, 4)
        assert torch.equal(layer.keys[:2, :, :2], torch.zeros(2, 3, 2, 4))  # left padding is zeros, not garbage
        assert torch.equal(layer.keys[:2, :, 2:], ka) and torch.equal(layer.values[:2, :, 2:], va)
        assert torch.equal(layer.keys[2:], kb) and torch.equal(layer.values[2:], vb)
    layer = cache.layers[0]
    expected_k, expected_v = layer.keys.clone(), layer.values.clone()
    buffers = set()
    for _ in range(3 * _RoomLayer.ROOM):  # decode steps: one token each
        k, v = torch.randn(3, 3, 1, 4, generator=g), torch.randn(3, 3, 1, 4, generator=g)
        got_k, got_v = cache.update(k, v, 0)
        expected_k, expected_v = torch.cat([expected_k, k], dim=2), torch.cat([expected_v, v], dim=2)
        assert torch.equal(got_k, expected_k) and torch.equal(got_v, expected_v)
        buffers.add(layer.keys.untyped_storage().data_ptr())
    assert cache.get_seq_length(0) == 7 + 3 * _RoomLayer.ROOM
    assert len(buffers) <= 3  # grown a few times, not copied every step
    layer.batch_select_indices(torch.tensor([0, 2]))  # transformers' own edit: the next token still lands after it
    k, v = torch.randn(2, 3, 1, 4, generator=g), torch.randn(2, 3, 1, 4, generator=g)
    got_k, _ = layer.update(k, v)
    assert torch.equal(got_k, torch.cat([expected_k[[0, 2]], k], dim=2))


def test_room_cache_gathers_picked_rows_into_place() -> None:
    """``rows`` picks a part's rows (compaction keeps the live rows of a cache view, twins take one prefill row
    each): the buffer holds exactly what indexing first and stacking after would, left padding zeros."""
    from lightning_sdk.engines.embedded import _room_cache

    g = torch.Generator().manual_seed(1)
    a = [(torch.randn(4, 3, 9, 4, generator=g), torch.randn(4, 3, 9, 4, generator=g)) for _ in range(2)]
    view = [(k[:, :, 3:], v[:, :, 3:]) for k, v in a]  # the columns still used: a view, as _Batch._take gives
    b = [(torch.randn(2, 3, 4, 4, generator=g), torch.randn(2, 3, 4, 4, generator=g)) for _ in range(2)]
    keep, twins = torch.tensor([3, 0]), torch.tensor([1, 1, 0])
    cache = _room_cache(view, b, width=6, rows=[keep, twins])
    for layer, (ka, va), (kb, vb) in zip(cache.layers, view, b, strict=True):
        assert layer.keys.shape == (5, 3, 6, 4)
        assert torch.equal(layer.keys[:2], ka[keep]) and torch.equal(layer.values[:2], va[keep])
        assert torch.equal(layer.keys[2:, :, :2], torch.zeros(3, 3, 2, 4))
        assert torch.equal(layer.keys[2:, :, 2:], kb[twins]) and torch.equal(layer.values[2:, :, 2:], vb[twins])


async def test_concurrent_requests_share_batches(engine: EmbeddedEngine) -> None:
    prompt = _prompt(engine, "What is 3 times 4?")
    sampling = Sampling(max_tokens=8, temperature=1.0)
    before = dict(engine.stats)
    gens = await asyncio.gather(*(engine.generate(prompt, sampling.model_copy(update={"seed": i})) for i in range(24)))
    assert len(gens) == 24
    assert engine.stats["requests"] - before["requests"] == 24
    assert engine.stats["batches"] - before["batches"] < 24  # requests joined batches
    assert engine.stats["max_batch"] > 1
    # the worker thread's own CPU while busy: counted, and never more than its busy wall time
    assert 0.0 < engine.stats["cpu_s"] - before["cpu_s"] <= engine.stats["busy_s"] - before["busy_s"] + 1e-3


async def test_seed_makes_sampling_deterministic(engine: EmbeddedEngine) -> None:
    prompt = _prompt(engine, "Subtract 3 from 9.")
    a = await engine.generate(prompt, Sampling(max_tokens=10, seed=11))
    b, c = await asyncio.gather(
        engine.generate(prompt, Sampling(max_tokens=10, seed=11)),
        engine.generate(_prompt(engine, "Add 1 and 1."), Sampling(max_tokens=10, seed=11)),
    )
    assert a.completion_ids == b.completion_ids
    assert a.logprobs == pytest.approx(b.logprobs, abs=1e-5)
    assert c.completion_ids != a.completion_ids or c.logprobs != a.logprobs


async def test_stops_on_max_tokens_eos_stop_ids_and_strings(engine: EmbeddedEngine) -> None:
    prompt = _prompt(engine, "What is 5 plus 5?")
    gen = await engine.generate(prompt, Sampling(max_tokens=4, temperature=1.0, seed=0))
    assert gen.finish_reason == "length" and len(gen.completion_ids) == 4

    # Greedy is deterministic: stop on whatever token greedy decoding emits third.
    greedy = await engine.generate(prompt, Sampling(max_tokens=6, temperature=0.0))
    third = greedy.completion_ids[2]
    cut = await engine.generate(prompt, Sampling(max_tokens=6, temperature=0.0, stop_token_ids=[third]))
    assert cut.finish_reason == "stop"
    assert cut.completion_ids == greedy.completion_ids[: greedy.completion_ids.index(third) + 1]

    text = engine.tokenizer.decode(greedy.completion_ids[:3])
    stopped = await engine.generate(prompt, Sampling(max_tokens=6, temperature=0.0, stop=[text[-1]]))
    assert stopped.finish_reason == "stop"
    assert text[-1] in engine.tokenizer.decode(stopped.completion_ids)

    # Force EOS by making it the only likely token.
    eos = engine.tokenizer.eos_token_id
    model = engine._model
    with torch.no_grad():
        bias = torch.full((model.config.vocab_size,), -30.0)
        bias[eos] = 30.0
        hook = model.lm_head.register_forward_hook(lambda m, i, o: o + bias)
    try:
        gen = await engine.generate(prompt, Sampling(max_tokens=6, temperature=1.0, seed=1))
    finally:
        hook.remove()
    assert gen.completion_ids == [eos] and gen.finish_reason == "stop"


async def test_stream_delivers_the_same_tokens(engine: EmbeddedEngine) -> None:
    prompt = _prompt(engine, "Add 8 and 9.")
    sampling = Sampling(max_tokens=7, seed=5)
    whole = await engine.generate(prompt, sampling)
    ids: list[int] = []
    reasons = []
    async for delta in engine.stream(prompt, sampling):
        ids += delta.ids
        reasons.append(delta.finish_reason)
    assert ids == whole.completion_ids
    assert reasons[-1] == whole.finish_reason and all(r is None for r in reasons[:-1])


async def test_weight_swap_bumps_version_and_changes_outputs(engine: EmbeddedEngine) -> None:
    prompt = _prompt(engine, "What is 2 times 2?")
    sampling = Sampling(max_tokens=5, temperature=0.0)
    before = await engine.generate(prompt, sampling)
    assert before.policy_version == 0
    state = {k: v.clone() for k, v in engine._model.state_dict().items()}
    new = {k: (v + 0.5 * torch.randn_like(v) if v.dtype.is_floating_point else v) for k, v in state.items()}
    await engine.update_weights(new, 7)
    after = await engine.generate(prompt, sampling)
    assert engine.policy_version == 7 and after.policy_version == 7
    assert after.logprobs != before.logprobs
    await engine.update_weights(state, 8)
    again = await engine.generate(prompt, sampling)
    assert again.completion_ids == before.completion_ids and again.policy_version == 8


@pytest.mark.parametrize("temperature", [0.0, 1.0])
async def test_weights_that_answer_nan_fail_the_call_and_the_engine_recovers(
    engine: EmbeddedEngine, temperature: float
) -> None:
    """Published weights with a NaN (a diverged update) make the model's logits NaN: the call fails with the
    engine's error, greedy or sampled, instead of returning tokens drawn from nothing; good weights serve again."""
    prompt = _prompt(engine, "What is 3 plus 4?")
    sampling = Sampling(max_tokens=5, temperature=temperature, seed=1)
    state = {k: v.clone() for k, v in engine._model.state_dict().items()}
    broken = dict(state)
    name = next(k for k in state if k.endswith("norm.weight"))
    broken[name] = torch.full_like(state[name], float("nan"))
    await engine.update_weights(broken, 1)
    with pytest.raises(EngineError, match="logits are not finite"):
        await engine.generate(prompt, sampling)
    await engine.update_weights(state, 2)
    again = await engine.generate(prompt, sampling)
    assert again.policy_version == 2 and len(again.completion_ids) >= 1
    assert all(lp == lp and lp <= 0.0 for lp in again.logprobs)  # finite log-probs (NaN != NaN)


async def test_in_flight_batch_finishes_on_old_weights(engine: EmbeddedEngine) -> None:
    """A weight swap waits for the running batch: that batch records the old version, the next the new one."""
    prompt = _prompt(engine, "Add 2 and 2.")
    long = asyncio.create_task(engine.generate(prompt, Sampling(max_tokens=40, temperature=1.0, seed=2)))
    tokens = engine.stats["tokens"]
    await until_async(lambda: engine.stats["tokens"] != tokens, every=0.0005, what="the first token")
    in_flight = not long.done()
    state = {k: v.clone() for k, v in engine._model.state_dict().items()}
    await engine.update_weights(state, 3)
    first = await long
    assert in_flight
    second = await engine.generate(prompt, Sampling(max_tokens=3, seed=2))
    assert first.policy_version == 0
    assert second.policy_version == 3


async def test_closed_engine_refuses(policy_dir: Path) -> None:
    eng = EmbeddedEngine.from_pretrained(policy_dir)
    await eng.close()
    with pytest.raises(EngineError):
        await eng.generate([1, 2, 3], Sampling(max_tokens=2))


async def test_prefix_cache_gives_the_logprobs_of_a_cold_prefill(engine: EmbeddedEngine, policy_dir: Path) -> None:
    """A call whose prompt extends the previous prompt + completion (the next turn of an episode) and a group's
    equal first prompts reuse cached KV, and record the log-probs of a cold prefill (a plain forward pass and an
    engine with the cache off) within float tolerance."""
    model, _ = load_policy(policy_dir)
    cold = EmbeddedEngine.from_pretrained(policy_dir, prefix_cache=False)
    try:
        first = _prompt(engine, "What is 6 times 7?")
        tool = [int(i) for i in engine.tokenizer.encode("<|im_start|>tool\n42<|im_end|>\n<|im_start|>assistant\n")]
        sampling = Sampling(max_tokens=10, temperature=1.0, seed=4)
        turn1 = await engine.generate(first, sampling)
        sibling = await engine.generate(first, sampling.model_copy(update={"seed": 5}))  # same first prompt
        reused_before = engine.stats["reused_tokens"]
        second = first + turn1.completion_ids + tool
        turn2 = await engine.generate(second, sampling)
        reused = engine.stats["reused_tokens"] - reused_before
        assert reused == len(first) + len(turn1.completion_ids) - 1  # all but the last sampled token's KV
        assert engine.prefix_cache is not None and engine.prefix_cache.hits >= 2
        for prompt, gen in ((first, sibling), (second, turn2)):
            assert gen.logprobs == pytest.approx(_reference_logprobs(model, prompt, gen.completion_ids, 1.0), abs=2e-4)
        again = await cold.generate(second, sampling)
        assert cold.stats["reused_tokens"] == 0
        assert again.completion_ids == turn2.completion_ids
        assert again.logprobs == pytest.approx(turn2.logprobs, abs=2e-4)
    finally:
        await cold.close()


async def test_a_finished_rows_cached_kv_is_one_copy_for_all_layers(engine: EmbeddedEngine, policy_dir: Path) -> None:
    """The prefix cache's entry for a finished row (prompt + completion but its last token) holds the keys/values a
    plain forward pass computes, and all layers' keys are views of one copy (as are the values): two operations a
    row, not one per layer's keys and one per layer's values."""
    model, _ = load_policy(policy_dir)
    prompt = _prompt(engine, "What is 6 times 7?")
    gen = await engine.generate(prompt, Sampling(max_tokens=6, temperature=1.0, seed=9))
    ids = prompt + gen.completion_ids[:-1]
    assert engine.prefix_cache is not None
    n, kv = engine.prefix_cache.peek(ids)
    assert n == len(ids) and kv is not None and len(kv) == model.config.num_hidden_layers
    assert len({k.untyped_storage().data_ptr() for k, _ in kv}) == 1
    assert len({v.untyped_storage().data_ptr() for _, v in kv}) == 1
    with torch.no_grad():
        ref = model(input_ids=torch.tensor([ids]), use_cache=True).past_key_values
    for (k, v), layer in zip(kv, ref.layers, strict=True):
        assert torch.allclose(k, layer.keys[0], atol=1e-5) and torch.allclose(v, layer.values[0], atol=1e-5)


async def test_the_prefix_cache_size_comes_from_the_engine_config(policy_dir: Path) -> None:
    """``[engine] prefix_cache_tokens``: the embedded engine's cache holds at most that many tokens (0: no cache)."""
    from lightning_sdk.engines.serving import EngineConfig, open_engine

    model, tokenizer = load_policy(policy_dir)
    small = open_engine(EngineConfig(prefix_cache_tokens=40), model, tokenizer, policy_dir)
    off = open_engine(EngineConfig(prefix_cache_tokens=0), model, tokenizer, policy_dir)
    try:
        assert isinstance(small, EmbeddedEngine) and isinstance(off, EmbeddedEngine)
        assert small.prefix_cache is not None and small.prefix_cache.max_tokens == 40
        assert off.prefix_cache is None
        for q in ("What is 1 plus 2?", "Add 34 and 5.", "Multiply 7 by 8, please now."):
            await small.generate(_prompt(small, q), Sampling(max_tokens=8, temperature=0.0))
        assert 0 < small.prefix_cache.tokens <= 40
    finally:
        await small.close()
        await off.close()


async def test_weight_swap_empties_the_prefix_cache(engine: EmbeddedEngine) -> None:
    """KV computed by old weights is never reused after a swap: the next turn prefills in full, on the new weights."""
    first = _prompt(engine, "Add 12 and 30.")
    sampling = Sampling(max_tokens=6, temperature=0.0)
    turn1 = await engine.generate(first, sampling)
    assert engine.prefix_cache is not None and len(engine.prefix_cache) > 0
    state = {k: v.clone() for k, v in engine._model.state_dict().items()}
    new = {k: (v + 0.5 * torch.randn_like(v) if v.dtype.is_floating_point else v) for k, v in state.items()}
    await engine.update_weights(new, 1)
    assert len(engine.prefix_cache) == 0
    reused = engine.stats["reused_tokens"]
    second = first + turn1.completion_ids + [int(i) for i in engine.tokenizer.encode("<|im_start|>user\nok")]
    turn2 = await engine.generate(second, sampling)
    assert engine.stats["reused_tokens"] == reused and turn2.policy_version == 1
    ref = _reference_logprobs(engine._model, second, turn2.completion_ids, 0.0)
    assert turn2.logprobs == pytest.approx(ref, abs=2e-4)


async def test_a_request_joins_the_running_batch(engine: EmbeddedEngine) -> None:
    """Continuous batching: a short request sent while a long one decodes starts at once and finishes first."""
    prompt = _prompt(engine, "What is 9 minus 4?")
    long = asyncio.create_task(engine.generate(prompt, Sampling(max_tokens=60, temperature=1.0, seed=1)))
    tokens = engine.stats["tokens"]
    await until_async(lambda: engine.stats["tokens"] >= tokens + 2, every=0.0005, what="two tokens")
    short = await engine.generate(_prompt(engine, "Add 1 and 2."), Sampling(max_tokens=2, temperature=1.0, seed=1))
    assert len(short.completion_ids) <= 2
    done_long = long.done()
    gen = await long
    assert not done_long or gen.finish_reason == "stop"
    assert engine.stats["max_batch"] >= 2


async def test_rows_with_and_without_cached_prefixes_share_a_prefill(engine: EmbeddedEngine, policy_dir: Path) -> None:
    """One prefill of a cold prompt, a group sibling and a next turn (different cached lengths, left-padded into one
    batch) records, for each, the log-probs of a plain forward pass."""
    model, _ = load_policy(policy_dir)
    first = _prompt(engine, "Multiply 13 by 3.")
    turn1 = await engine.generate(first, Sampling(max_tokens=8, temperature=1.0, seed=2))
    tool = [int(i) for i in engine.tokenizer.encode("<|im_start|>tool\n39<|im_end|>\n<|im_start|>assistant\n")]
    prompts = [first + turn1.completion_ids + tool, first, _prompt(engine, "What is 81 minus 17? Quickly.")]
    reused = engine.stats["reused_tokens"]
    sampling = Sampling(max_tokens=8, temperature=0.8, seed=6)
    gens = await asyncio.gather(*(engine.generate(p, sampling) for p in prompts))
    assert engine.stats["reused_tokens"] > reused
    for prompt, gen in zip(prompts, gens, strict=True):
        ref = _reference_logprobs(model, prompt, gen.completion_ids, 0.8)
        assert gen.logprobs == pytest.approx(ref, abs=2e-4)


async def test_rows_that_stop_early_leave_the_others_exact(engine: EmbeddedEngine, policy_dir: Path) -> None:
    """Rows stopping one by one stay in the batch masked until it is compacted; the rows still running record the
    log-probs of a plain forward pass all along."""
    model, _ = load_policy(policy_dir)
    questions = [f"What is {a} plus {a + 3}?" for a in range(8)]
    prompts = [_prompt(engine, q) for q in questions]
    gens = await asyncio.gather(
        *(engine.generate(p, Sampling(max_tokens=3 + 2 * i, temperature=1.0, seed=i)) for i, p in enumerate(prompts))
    )
    assert engine.stats["max_batch"] == 8
    for prompt, gen in zip(prompts, gens, strict=True):
        ref = _reference_logprobs(model, prompt, gen.completion_ids, 1.0)
        assert gen.logprobs == pytest.approx(ref, abs=2e-4)


async def test_the_engine_thread_uses_its_own_thread_count(policy_dir: Path) -> None:
    """torch keeps intra-op threads per thread: the engine's thread takes ``threads`` and the caller's stays."""
    model, tokenizer = load_policy(policy_dir)
    before = torch.get_num_threads()
    engine = EmbeddedEngine(model, tokenizer, max_batch_size=4, threads=1)
    try:
        gen = await engine.generate(_prompt(engine, "2+2"), Sampling(max_tokens=4, temperature=0.0))
        assert len(gen.completion_ids) >= 1
        assert engine.stats["threads"] == 1
        assert torch.get_num_threads() == before
    finally:
        await engine.close()


async def test_set_threads_changes_the_engine_threads_from_its_next_pass(policy_dir: Path) -> None:
    """``set_threads`` (what the learner/engine balance calls during RL) takes effect in the engine's own thread at
    its next forward pass; the caller's thread keeps its count; a count below 1 is refused."""
    model, tokenizer = load_policy(policy_dir)
    before = torch.get_num_threads()
    engine = EmbeddedEngine(model, tokenizer, max_batch_size=4, threads=2)
    try:
        await engine.generate(_prompt(engine, "2+2"), Sampling(max_tokens=2, temperature=0.0))
        assert engine.stats["threads"] == 2
        engine.set_threads(1)
        assert engine.threads == 1
        await engine.generate(_prompt(engine, "3+3"), Sampling(max_tokens=2, temperature=0.0))
        assert engine.stats["threads"] == 1
        assert torch.get_num_threads() == before
        with pytest.raises(EngineError, match="engine threads must be >= 1"):
            engine.set_threads(0)
        assert engine.threads == 1
    finally:
        await engine.close()


def test_prefix_cache_stores_a_sequence_once_and_serves_its_chunk_prefixes() -> None:
    """One entry per sequence, its prefixes at multiples of the chunk indexed to it: a prompt that shares the first
    40 tokens of a cached 100-token sequence gets a view of its first 32 (the last whole chunk), and evicting the
    entry forgets those prefixes too."""
    from lightning_sdk.engines.embedded import PrefixCache

    cache = PrefixCache(max_tokens=150, chunk=16)
    seq = list(range(1000, 1100))
    kv = [(torch.arange(2 * 100 * 3.0).reshape(2, 100, 3), -torch.arange(2 * 100 * 3.0).reshape(2, 100, 3))]
    cache.put(seq, kv)
    assert len(cache) == 1 and cache.tokens == 100
    n, got = cache.lookup([*seq[:40], 7, 8, 9])
    assert n == 32 and got is not None
    assert torch.equal(got[0][0], kv[0][0][:, :32]) and torch.equal(got[0][1], kv[0][1][:, :32])
    assert cache.lookup([*seq, 5])[0] == 100  # the whole sequence
    assert cache.lookup([*seq[:15], 5])[0] == 0  # shorter than a chunk: not indexed
    assert cache.lookup(seq[:40], "adapter-a")[0] == 0  # another namespace's KV is never served
    assert cache.hits == 2 and cache.misses == 2
    other = list(range(2000, 2080))
    cache.put(other, [(torch.zeros(2, 80, 3), torch.zeros(2, 80, 3))])  # 180 tokens > 150: the oldest goes
    assert len(cache) == 1 and cache.tokens == 80
    assert cache.lookup(seq[:40])[0] == 0 and cache.lookup(other[:33])[0] == 32


async def test_rows_admitted_together_prefill_their_shared_head_once(policy_dir: Path) -> None:
    """Four prompts that share a 200-token head and arrive at once (a group's rollouts, a CLI's instructions): the
    head is prefilled once for all of them, and every row records the log-probs of a plain forward pass."""
    model, _ = load_policy(policy_dir)
    engine = EmbeddedEngine.from_pretrained(policy_dir, max_batch_size=64)
    try:
        head = [int(i) for i in engine.tokenizer.encode("You are a careful agent. " * 40)][:200]
        assert len(head) == 200
        prompts = [head + _prompt(engine, q) for q in ("Add 1 and 2.", "Add 3 and 4.", "Add 5 and 6.", "Add 7 and 8.")]
        sampling = Sampling(max_tokens=6, temperature=1.0, seed=9)
        gens = await asyncio.gather(*(engine.generate(p, sampling) for p in prompts))
        assert engine.stats["shared_head_tokens"] >= 192  # the head's whole chunks, once
        assert engine.stats["batches"] == 1
        assert engine.stats["reused_tokens"] >= 4 * 192
        for prompt, gen in zip(prompts, gens, strict=True):
            assert gen.logprobs == pytest.approx(_reference_logprobs(model, prompt, gen.completion_ids, 1.0), abs=2e-4)
    finally:
        await engine.close()


async def test_identical_prompts_admitted_together_run_once_and_sample_apart(policy_dir: Path) -> None:
    """A group's eight rollouts send the same first prompt at once, beside another task's two: the prefill runs
    each distinct prompt once (``twin_tokens`` counts the rest), every row still samples on its own seed (the twins'
    completions differ) and records the log-probs of a plain forward pass, and a twin's cache is its own (a twin
    that stops early leaves the others exact)."""
    model, _ = load_policy(policy_dir)
    engine = EmbeddedEngine.from_pretrained(policy_dir, max_batch_size=64, prefix_cache=False)
    try:
        group, other = _prompt(engine, "What is 12 times 7?"), _prompt(engine, "Subtract 9 from 40.")
        prompts = [group] * 8 + [other] * 2
        samplings = [Sampling(max_tokens=4 + i, temperature=1.0, seed=i) for i in range(len(prompts))]
        gens = await asyncio.gather(*(engine.generate(p, s) for p, s in zip(prompts, samplings, strict=True)))
        assert engine.stats["batches"] == 1 and engine.stats["max_batch"] == 10
        assert engine.stats["twin_tokens"] == 7 * len(group) + len(other)
        assert len({tuple(g.completion_ids) for g in gens[:8]}) > 1
        for prompt, gen in zip(prompts, gens, strict=True):
            assert gen.logprobs == pytest.approx(_reference_logprobs(model, prompt, gen.completion_ids, 1.0), abs=2e-4)
    finally:
        await engine.close()


async def test_bf16_engine_samples_within_bf16_rounding_of_fp32(policy_dir: Path) -> None:
    """``precision="bf16"`` autocasts the forward passes: greedy answers' log-probs within bf16 rounding of a plain
    fp32 forward pass, not equal to it; an unknown precision is refused."""
    model, _ = load_policy(policy_dir)
    with pytest.raises(EngineError, match="precision"):
        EmbeddedEngine(model, load_policy(policy_dir)[1], precision="fp16")
    engine = EmbeddedEngine.from_pretrained(policy_dir, precision="bf16")
    try:
        prompt = _prompt(engine, "What is 6 times 7?")
        gen = await engine.generate(prompt, Sampling(max_tokens=8, temperature=1.0, seed=1))
        ref = _reference_logprobs(model, prompt, gen.completion_ids, 1.0)
        diff = max(abs(a - b) for a, b in zip(gen.logprobs, ref, strict=True))
        assert 0 < diff < 0.1
    finally:
        await engine.close()


async def test_grouped_query_attention_keeps_its_groups_and_its_logprobs(policy_dir: Path) -> None:
    """A grouped-query model (4 query heads over 2 key/value heads, as SmolLM2's 9 over 3) is served with SDPA's
    ``enable_gqa`` instead of keys/values repeated per query head: rows of different lengths decode together and each
    records the log-probs of a plain forward pass of the model as transformers builds it."""
    from transformers import LlamaConfig, LlamaForCausalLM

    _, tokenizer = load_policy(policy_dir)
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    reference = LlamaForCausalLM(config).eval()
    served = LlamaForCausalLM(LlamaConfig.from_dict(config.to_dict())).eval()  # its own config: the engine sets it
    served.load_state_dict(reference.state_dict())
    engine = EmbeddedEngine(served, tokenizer)
    try:
        assert served.config._attn_implementation == "lightning_sdk_sdpa_gqa"
        assert reference.config._attn_implementation == "sdpa"
        prompts = [_prompt(engine, q) for q in ("Add 1 and 2.", "What is 34 plus 5, please, and why?")]
        sampling = Sampling(max_tokens=8, temperature=1.0, seed=2, stop_token_ids=[])
        gens = await asyncio.gather(*(engine.generate(p, sampling) for p in prompts))
        for prompt, gen in zip(prompts, gens, strict=True):
            assert len(gen.completion_ids) == 8
            ref = _reference_logprobs(reference, prompt, gen.completion_ids, 1.0)
            assert gen.logprobs == pytest.approx(ref, abs=2e-4)
    finally:
        await engine.close()


def test_rows_draw_from_their_own_distributions_together() -> None:
    """The batch's sampled rows draw at once, by inversion of each row's cumulative distribution: each row's tokens
    follow its own temperature and top-p (frequencies within 5 standard errors over 4,000 rows each), a token of zero
    mass or cut by top-p is never drawn, a greedy row takes the argmax, and every log-prob is the chosen token's
    under the row's temperature (before top-p), as the learner computes it."""
    import random

    from lightning_sdk.engines.embedded import _sample_rows

    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, float("-inf")])
    kinds = [
        Sampling(temperature=1.0),
        Sampling(temperature=0.6),
        Sampling(temperature=1.0, top_p=0.7),
        Sampling(temperature=0.0),
    ]
    n = 4000
    samplings = [kind for kind in kinds for _ in range(n)]
    rngs = [random.Random(i) for i in range(len(samplings))]
    tokens, logprobs = _sample_rows(logits.expand(len(samplings), -1).clone(), samplings, rngs)
    for k, kind in enumerate(kinds):
        got = torch.bincount(torch.tensor(tokens[k * n : (k + 1) * n]), minlength=len(logits)).double() / n
        temperature = kind.temperature if kind.temperature > 0 else 1.0
        logp = torch.log_softmax(logits / temperature, -1)
        p = logp.exp().double()
        if kind.temperature == 0.0:
            expected = torch.zeros_like(p)
            expected[0] = 1.0
        elif kind.top_p < 1.0:  # 0.61 + 0.22 passes 0.7 at the second token: the first two, renormalised
            assert float(p[0]) < 0.7 < float(p[0] + p[1])
            expected = torch.zeros_like(p)
            expected[:2] = p[:2] / p[:2].sum()
        else:
            expected = p
        assert got[expected == 0].sum() == 0  # never a token of zero mass or cut by top-p
        se = (expected * (1 - expected) / n).sqrt()
        assert torch.all((got - expected).abs() <= 5 * se + 1e-12), (kind, got, expected)
        for t, lp in zip(tokens[k * n : (k + 1) * n], logprobs[k * n : (k + 1) * n], strict=True):
            assert lp == pytest.approx(float(logp[t]), abs=1e-6)
    # the same generators give the same tokens whatever the batch around them
    alone, _ = _sample_rows(logits.expand(3, -1).clone(), samplings[:3], [random.Random(i) for i in range(3)])
    assert alone == tokens[:3]


def test_non_finite_logits_are_an_error_not_a_token() -> None:
    """A model that answers NaN or infinite logits (broken weights) fails the rows' generation loudly: no token is
    drawn from a distribution that is not one, greedy or sampled (the engine's loop turns it into an EngineError
    for every request of the batch)."""
    import random

    from lightning_sdk.engines.embedded import _sample_rows

    for bad in (float("nan"), float("inf")):
        for temperature in (0.0, 0.6):
            logits = torch.zeros(3, 8)
            logits[1, 2] = bad
            with pytest.raises(FloatingPointError, match="not finite in 1 of 3 rows"):
                _sample_rows(logits, [Sampling(temperature=temperature)] * 3, [random.Random(i) for i in range(3)])
