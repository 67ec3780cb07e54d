"""No test sleeps to wait for a state: every ``sleep(`` under ``tests/`` is listed here with its reason, so a new one
fails this test until it is turned into a wait on an observable state (``tests/support/waiting.py``: ``until``,
``until_async``; a store's ``ManualClock``; an ``asyncio.Event``) or listed with a reason a reviewer can judge.

Two kinds: ``FAKE`` are the deliberate delays of fake servers and stand-in agents or processes (a slow upstream, a
token pace, an agent that hangs until it is killed or released): they are what the test is about, not a wait of the
test. ``KEPT`` are the other sleeps, at most ``MAX_KEPT``. ``docs/development.md`` shows this list (checked below).
The count is of the text ``sleep(`` in every file, as ``grep -rn "sleep(" tests`` counts it (strings of scripts that
run in subprocesses included)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent
DOC = ROOT / "docs" / "development.md"
FAKE, KEPT = "fake", "kept"
MAX_KEPT = 20


@dataclass(frozen=True)
class Sleep:
    path: str  # relative to the repository root
    count: int
    kind: str
    reason: str


ALLOWED = [
    # -- kept: not a wait for a state ----------------------------------------------------------------------------
    Sleep("tests/support/waiting.py", 2, KEPT, "the poll interval of `until` / `until_async` (the one poll)"),
    Sleep("tests/sandbox/test_local.py", 2, KEPT, "a create / a close cancelled at chosen moments (0-50 ms in)"),
    Sleep("tests/proxy/test_routes.py", 1, KEPT, "an idle keep-alive connection must outlast the 0.5 s read timeout"),
    Sleep("tests/proxy/test_barrier.py", 2, KEPT, "a first call and its finish sent a random 0-2 ms apart (the race)"),
    Sleep("tests/proxy/test_split_sampling.py", 1, KEPT, "`sleep(0)`: a yield, so two attempts' calls interleave"),
    Sleep(
        "tests/engines/test_vllm_real.py",
        1,
        KEPT,
        "real vLLM: a weight swap a quarter into the same call's measured duration (asserted still running)",
    ),
    Sleep(
        "tests/engines/test_vllm_lora.py",
        1,
        KEPT,
        "real vLLM: an adapter load a quarter into the same call's measured duration (asserted still running)",
    ),
    # -- fake: deliberate delays of fakes and stand-ins -----------------------------------------------------------
    Sleep("tests/support/mock_openai.py", 2, FAKE, "the mock upstream's reply delay and its chunk pace"),
    Sleep("tests/surfaces/upstream.py", 2, FAKE, "the scripted upstream's reply delay; a yield between stream chunks"),
    Sleep("tests/engines/test_vllm.py", 2, FAKE, "fake vLLM: token pace; `pause?mode=wait` lets running calls end"),
    Sleep("tests/engines/test_sglang.py", 1, FAKE, "fake SGLang: token pace"),
    Sleep("tests/test_http1.py", 1, FAKE, "the raw HTTP server's reply delay"),
    Sleep("tests/agent/test_transport.py", 1, FAKE, "the test server's slow route"),
    Sleep("tests/proxy/test_routes.py", 1, FAKE, "an upstream that sends its body 0.5 s after its headers"),
    Sleep("tests/agent/test_rollout.py", 2, FAKE, "agents that outlast their timeout (sync and async)"),
    Sleep("tests/agent/test_command.py", 2, FAKE, "a command agent and its grandchild that hang until killed"),
    Sleep("tests/agent/test_worker.py", 1, FAKE, "a command agent that hangs until its attempt is released"),
    Sleep("tests/agent/test_run_cli.py", 2, FAKE, "agents held until the test opens a gate file / past the grace"),
    Sleep("tests/agent/test_context.py", 1, FAKE, "an agent's child task that yields before it reports"),
    Sleep("tests/sandbox/test_local.py", 1, FAKE, "a sandbox owner process that hangs until SIGKILLed"),
    Sleep("tests/examples/test_hostile_agent.py", 1, FAKE, "a sandbox owner process that hangs until SIGKILLed"),
]


def count_sleeps(root: Path = TESTS, base: Path = ROOT) -> dict[str, int]:
    """``sleep(`` occurrences per file under ``root`` (paths relative to ``base``, the repository root)."""
    found: dict[str, int] = {}
    for path in sorted(root.rglob("*")):
        if not path.is_file() or "__pycache__" in path.parts or path.suffix in (".pyc", ".db"):
            continue
        if path == Path(__file__).resolve():  # this file names the text it counts
            continue
        try:
            n = path.read_text(errors="replace").count("sleep(")
        except OSError:
            continue
        if n:
            found[path.relative_to(base).as_posix()] = n
    return found


def allowed_per_file() -> dict[str, int]:
    per_file: dict[str, int] = {}
    for entry in ALLOWED:
        per_file[entry.path] = per_file.get(entry.path, 0) + entry.count
    return per_file


def unlisted(found: dict[str, int]) -> list[str]:
    """What differs from the list: a file with more sleeps than listed (a new one) or fewer (a stale entry)."""
    allowed = allowed_per_file()
    problems = []
    for path in sorted(set(found) | set(allowed)):
        have, listed = found.get(path, 0), allowed.get(path, 0)
        if have > listed:
            problems.append(f"{path}: {have} sleep( calls, {listed} listed: wait on a state instead, or list it")
        elif have < listed:
            problems.append(f"{path}: {have} sleep( calls, {listed} listed: remove the stale entry")
    return problems


def doc_table() -> str:
    """The table ``docs/development.md`` shows (the same list, kept sleeps first)."""
    lines = ["| file | sleeps | kind | why |", "|---|---|---|---|"]
    lines += [f"| `{e.path}` | {e.count} | {e.kind} | {e.reason} |" for e in ALLOWED]
    kept = sum(e.count for e in ALLOWED if e.kind == KEPT)
    fake = sum(e.count for e in ALLOWED if e.kind == FAKE)
    lines.append(f"\n{kept} kept, {fake} in fakes and stand-ins ({kept + fake} in all).")
    return "\n".join(lines)


def test_every_sleep_in_the_tests_is_listed_with_its_reason() -> None:
    assert unlisted(count_sleeps()) == []


def test_few_sleeps_are_kept_outside_fakes() -> None:
    assert sum(e.count for e in ALLOWED if e.kind == KEPT) <= MAX_KEPT
    assert all(e.kind in (FAKE, KEPT) and e.reason and e.count > 0 for e in ALLOWED)


def test_a_new_sleep_is_caught(tmp_path: Path) -> None:
    """The check itself: a file the list does not know, or one more sleep in a listed file, is reported."""
    found = count_sleeps()
    assert unlisted({**found, "tests/new_test.py": 1}) == [
        "tests/new_test.py: 1 sleep( calls, 0 listed: wait on a state instead, or list it"
    ]
    one_more = {**found, "tests/proxy/test_barrier.py": found.get("tests/proxy/test_barrier.py", 0) + 1}
    assert len(unlisted(one_more)) == 1
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "t.py").write_text("import time\ntime.sleep(1)\nawait asyncio.sleep(0.1)\n")
    (tmp_path / "quiet.py").write_text("until(lambda: done)\n")
    assert count_sleeps(tmp_path, base=tmp_path) == {"sub/t.py": 2}


def test_the_development_guide_shows_the_list() -> None:
    assert doc_table() in DOC.read_text(), "docs/development.md: paste doc_table() (python tests/test_no_sleeps.py)"


if __name__ == "__main__":
    print(doc_table())
