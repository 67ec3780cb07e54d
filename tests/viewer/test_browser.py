"""The run viewer in a real browser: Debian's chromium driven by Playwright, on the run directory of a real
``lightning-sdk train`` of the calc example (tiny policy, a few RL steps) made by the test.

What is shown is checked against the store read independently: ``lightning-sdk records`` exports the same store
(the real CLI), and the rollouts' rewards, trained-token counts, split reasons and per-token log-probs on the page
must equal the exported rows. Screenshots go to ``.ci/reports/`` (or ``$LIGHTNING_SDK_CI_REPORTS``). Marker
``browser`` (its .ci/run stage installs chromium with apt and playwright with pip).
"""

from __future__ import annotations

import json
import os
import re
import sqlite3
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.support.waiting import until
from tests.trainer.tiny import CLI, ROOT, build_small_policy, write_config

pytestmark = pytest.mark.browser

CHROMIUM = os.environ.get("LIGHTNING_SDK_CHROMIUM", "/usr/bin/chromium")
REPORTS = Path(os.environ.get("LIGHTNING_SDK_CI_REPORTS", ROOT / ".ci" / "reports"))
ENV = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{ROOT / 'integrations'}", "LIGHTNING_SDK_LOG_LEVEL": "WARNING"}
VIEW = "import sys; from lightning_sdk.cli import _register, app; _register(); sys.exit(app())"


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real training run: warm start, held-out evaluation before and after, 3 RL steps."""
    tmp = tmp_path_factory.mktemp("browser")
    policy = build_small_policy(tmp / "policy", hidden=32, layers=2)
    config = write_config(
        tmp / "train.toml",
        str(policy),
        warm_start={"enabled": True, "max_steps": 2, "eval_every": 2, "eval_below_loss": 100.0,
                    "target_success": 1.0, "batch_size": 8, "validation_tasks": 8},
        rl={"steps": 3, "tasks_per_step": 4, "samples_per_task": 2, "workers": 8, "max_tokens": 24},
        eval={"n": 4, "max_tokens": 24, "workers": 4},
    )  # fmt: skip
    out = tmp / "run"
    proc = subprocess.Popen(
        [sys.executable, "-c", CLI, "train", str(config), "--output", str(out), "--view", "--view-port", "0"],
        cwd=str(ROOT), env={**ENV, "COLUMNS": "200"}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
    )  # fmt: skip
    assert proc.stdout is not None
    first = ""
    for _ in range(50):  # --view: the viewer's URL is printed before the set-up starts
        line = proc.stdout.readline().decode()
        first += line
        match = re.match(r"run viewer: (http://127\.0\.0\.1:\d+/)", line)
        if match or not line:
            break
    assert match, first

    # served during the run: answers 503 until the run has its store, then the run's overview
    def answers() -> bool:
        try:
            return httpx.get(match.group(1) + "api/overview", timeout=30).status_code == 200
        except httpx.TimeoutException:
            return False

    until(answers, timeout=120, what="the viewer")
    assert httpx.get(match.group(1) + "api/overview").json()["run_dir"] == str(out)
    rest, _ = proc.communicate(timeout=240)
    assert proc.returncode == 0, first + rest.decode()[-3000:]
    return out


@pytest.fixture(scope="module")
def exported(run_dir: Path) -> dict[str, list[dict[str, object]]]:
    """The store's records as ``lightning-sdk records`` exports them, by rollout id."""
    out = run_dir.parent / "records.jsonl"
    proc = subprocess.run(
        [sys.executable, "-c", VIEW, "records", "--store", str(run_dir / "store.db"), "--out", str(out), "--quiet"],
        cwd=str(ROOT), env=ENV, capture_output=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr.decode()[-2000:]
    rows: dict[str, list[dict[str, object]]] = {}
    for line in out.read_text().splitlines():
        row = json.loads(line)
        rows.setdefault(str(row["rollout_id"]), []).append(row)
    return rows


@pytest.fixture(scope="module")
def viewer(run_dir: Path) -> Iterator[str]:
    """``lightning-sdk view RUN_DIR --port 0`` (the real command); yields its URL."""
    proc = subprocess.Popen(
        [sys.executable, "-c", VIEW, "view", str(run_dir), "--port", "0"],
        cwd=str(ROOT), env={**ENV, "COLUMNS": "400"}, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL,
    )  # fmt: skip
    assert proc.stderr is not None
    line = proc.stderr.readline().decode()  # printed once the socket is bound
    match = re.search(r"(http://127\.0\.0\.1:\d+/)", line)
    assert match, line
    yield match.group(1)
    proc.terminate()
    proc.wait(timeout=20)


@pytest.fixture(scope="module")
def page(tmp_path_factory: pytest.TempPathFactory) -> Iterator[object]:
    from playwright.sync_api import sync_playwright

    profile = tmp_path_factory.mktemp("chromium-profile")
    with sync_playwright() as pw:
        context = pw.chromium.launch_persistent_context(
            str(profile),  # a fresh user-data-dir
            executable_path=CHROMIUM,
            args=["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync"],
            viewport={"width": 1280, "height": 900},
        )  # fmt: skip
        page = context.pages[0] if context.pages else context.new_page()
        page.set_default_timeout(90_000)  # a loaded 2-core CI machine: a bound, not a wait
        yield page
        context.close()


def _store_rewards(run_dir: Path) -> dict[str, float]:
    """Each rollout's reward (the sum of its succeeded attempt's rewards), read from the SQLite file directly."""
    with sqlite3.connect(run_dir / "store.db") as conn:
        rows = conn.execute(
            "SELECT w.rollout_id, SUM(w.value) FROM rewards w JOIN attempts a ON a.attempt_id = w.attempt_id "
            "WHERE a.status = 'succeeded' GROUP BY w.rollout_id"
        ).fetchall()
    return {str(r): float(v) for r, v in rows}


def test_the_viewer_shows_what_the_store_holds(
    run_dir: Path, exported: dict[str, list[dict[str, object]]], viewer: str, page: object
) -> None:
    from playwright.sync_api import Page, expect

    expect.set_options(timeout=90_000)

    assert isinstance(page, Page)
    REPORTS.mkdir(parents=True, exist_ok=True)
    summary = json.loads((run_dir / "summary.json").read_text())

    # the overview: held-out success and one row per step of metrics.jsonl, the reward curve drawn
    page.goto(viewer)
    expect(page.locator("#eval-before")).to_have_text(f"{summary['eval_before']['success_rate']:.3f}")
    expect(page.locator("#eval-after")).to_have_text(f"{summary['eval_after']['success_rate']:.3f}")
    steps = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    expect(page.locator("#steps tbody tr")).to_have_count(len(steps))
    assert page.locator("#reward-chart circle").count() == 2 * len(steps)  # reward and success per step
    page.screenshot(path=str(REPORTS / "viewer-overview.png"), full_page=True)

    # the rollouts table of the train split: every train rollout of the store, with its reward and trained tokens
    page.click("text=rollouts")
    page.fill("input[name=split]", "train")
    page.click("button[type=submit]")
    with sqlite3.connect(run_dir / "store.db") as conn:
        n_train = conn.execute("SELECT COUNT(*) FROM rollouts WHERE split = 'train'").fetchone()[0]
    expect(page.locator("#rollouts tbody tr")).to_have_count(n_train)
    rewards = _store_rewards(run_dir)
    trained_rollouts = 0
    for tr in page.locator("#rollouts tbody tr").all():
        rid = tr.get_attribute("data-rollout")
        assert rid is not None
        rows = exported.get(rid, [])
        assert int(tr.locator("td.trained").inner_text()) == sum(sum(r["loss_mask"]) for r in rows)  # type: ignore[arg-type, misc]
        if rid in rewards:
            assert float(tr.locator("td.reward").inner_text()) == pytest.approx(rewards[rid], abs=5e-4)
        trained_rollouts += bool(rows)
    assert trained_rollouts > 0

    # click into a trained rollout: its reward, trained tokens (highlighted spans), split reasons and log-probs
    rid = next(r.get_attribute("data-rollout") for r in page.locator("#rollouts tbody tr").all()
               if exported.get(str(r.get_attribute("data-rollout"))))  # fmt: skip
    assert rid is not None
    page.click(f"tr[data-rollout='{rid}'] a.rollout-link")
    expect(page.locator("h1")).to_contain_text(rid)
    rows = sorted(exported[rid], key=lambda r: int(r["segment"]))  # type: ignore[call-overload]
    assert float(page.locator("#reward").inner_text()) == pytest.approx(float(rows[0]["reward"]), abs=5e-6)  # type: ignore[arg-type]
    trained = sum(sum(r["loss_mask"]) for r in rows)  # type: ignore[arg-type, misc]
    expect(page.locator("#tokens-trained")).to_have_text(str(trained))
    expect(page.locator(".tok.m1")).to_have_count(trained)
    expect(page.locator("section.record")).to_have_count(len(rows))
    for sec, row in zip(page.locator("section.record").all(), rows, strict=True):
        reason = sec.locator(".split-reason")
        if row["split_reason"] is None:
            assert reason.count() == 0
        else:
            assert reason.inner_text() == row["split_reason"]
    # the conversation: the agent's first user message is shown as the store recorded it
    with sqlite3.connect(run_dir / "store.db") as conn:
        body = conn.execute(
            "SELECT c.body FROM calls c JOIN attempts a ON a.attempt_id = c.attempt_id "
            "WHERE c.rollout_id = ? AND a.status = 'succeeded' ORDER BY c.seq LIMIT 1",
            (rid,),
        ).fetchone()[0]
    first_user = next(m["content"] for m in json.loads(body)["request"]["messages"] if m["role"] == "user")
    expect(page.locator(".msg.user pre").first).to_have_text(first_user)

    # hover the first trained token: the tooltip shows the exported log-prob of that position
    mask, logprobs = rows[0]["loss_mask"], rows[0]["logprobs"]
    assert isinstance(mask, list) and isinstance(logprobs, list)
    pos = mask.index(1)
    tok = page.locator("section.record").first.locator(".tok").nth(pos)
    tok.hover()
    expect(page.locator("#tip")).to_be_visible()
    expect(page.locator("#tip")).to_contain_text(f"logprob {logprobs[pos]:.4f}")
    expect(page.locator("#tip")).to_contain_text("trained")
    page.screenshot(path=str(REPORTS / "viewer-rollout.png"), full_page=False)

    # the fidelity report: the trained tokens of the whole store equal the export's
    page.click("text=fidelity report")
    total = sum(sum(r["loss_mask"]) for rs in exported.values() for r in rs)  # type: ignore[arg-type, misc]
    expect(page.locator("#f-tokens-trained")).to_have_text(str(total))
    page.screenshot(path=str(REPORTS / "viewer-fidelity.png"), full_page=True)
