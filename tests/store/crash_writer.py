"""Child process of test_crash_safety: writes to a SQLiteStore in a loop and reports each committed write.

Usage: python crash_writer.py DB_PATH. Prints ``CALL <call_id>`` after record_calls returns and
``FINISH <attempt_id>`` after finish_attempt returns (flushed), until killed.
"""

from __future__ import annotations

import asyncio
import sys

from lightning_sdk.store import SQLiteStore
from lightning_sdk.types import AttemptStatus, Call, Reward


def ids_for(call_id: str) -> tuple[list[int], list[int], list[float]]:
    """Deterministic token ids/logprobs of a call, so the parent can check them exactly."""
    h = sum(map(ord, call_id))
    return [h + i for i in range(50)], [h * 7 + i for i in range(20)], [-(h + i) / 997.0 for i in range(20)]


async def main(path: str) -> None:
    store = SQLiteStore(path)
    await store.enqueue([{"i": i} for i in range(2_000)], n=2, max_attempts=3)
    print("READY", flush=True)
    k = 0
    while True:
        claim = await store.claim("crash-writer", lease_s=0.5)
        assert claim is not None
        aid, rid = claim.attempt.attempt_id, claim.rollout.rollout_id
        calls = []
        for j in range(3):
            cid = f"call-{k}-{j}"
            p, c, lp = ids_for(cid)
            calls.append(Call(call_id=cid, attempt_id=aid, rollout_id=rid, seq=j, model="policy", prompt_ids=p,
                              completion_ids=c, logprobs=lp))  # fmt: skip
        await store.record_calls(calls)
        print("CALL", " ".join(c.call_id for c in calls), flush=True)
        await store.record_rewards([Reward(rollout_id=rid, attempt_id=aid, value=k / 10)])
        await store.finish_attempt(aid, AttemptStatus.SUCCEEDED)
        print("FINISH", aid, flush=True)
        k += 1


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1]))
