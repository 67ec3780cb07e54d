"""Take docs/img/telemetry-phoenix.png: a real proxy session's spans in Arize Phoenix's trace UI (local, from PyPI).

    python -m venv /tmp/phx && /tmp/phx/bin/pip install arize-phoenix     # Phoenix in its own venv
    PHOENIX_BIN=/tmp/phx/bin/phoenix python scripts/phoenix_screenshot.py

Starts ``phoenix serve`` (OTLP/HTTP on its UI port, 6006), runs the real proxy in front of the loopback mock engine
with the ``SpanObserver`` exporting to it, makes a two-call session with a reward and a finish, then opens Phoenix
in Debian's chromium (playwright) and saves the screenshot of the trace.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import openai

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from lightning_sdk.telemetry import Telemetry, TelemetryConfig  # noqa: E402
from lightning_sdk.telemetry.observer import SpanObserver  # noqa: E402
from tests.support.mock_openai import MockOpenAI  # noqa: E402
from tests.support.proxy import run_proxy  # noqa: E402
from tests.support.servers import run_server  # noqa: E402

PORT = 6006


def main() -> None:
    work = Path(tempfile.mkdtemp(prefix="phoenix-"))
    env = {**os.environ, "PHOENIX_WORKING_DIR": str(work), "PHOENIX_PORT": str(PORT)}
    log = open(work / "log", "wb")  # noqa: SIM115 (the server writes to it for its whole life; closed below)
    phoenix = subprocess.Popen(
        [os.environ.get("PHOENIX_BIN", "phoenix"), "serve"], env=env, stdout=log, stderr=subprocess.STDOUT
    )
    try:
        deadline = time.monotonic() + 180
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{PORT}/healthz", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline or phoenix.poll() is not None:
                raise SystemExit(f"phoenix did not start: {(work / 'log').read_text()[-2000:]}")
            time.sleep(0.5)
        tel = Telemetry(TelemetryConfig(otlp=f"http://127.0.0.1:{PORT}", protocol="http/protobuf",
                                        service_name="calc-agent"))  # fmt: skip
        with (
            run_server(MockOpenAI().app) as upstream,
            run_proxy(upstream.url + "/v1", store_path=work / "s.db", observers=[SpanObserver(tel)]) as px,
        ):
            s = px.session({"question": "What is 2 + 2?"})
            client = openai.OpenAI(base_url=px.url + "/v1", api_key=s["token"], max_retries=0)
            msgs: list[dict[str, str]] = [{"role": "user", "content": "What is 2 + 2?"}]
            first = client.chat.completions.create(model="policy", messages=msgs, max_tokens=8)  # type: ignore[arg-type]
            msgs += [{"role": "assistant", "content": str(first.choices[0].message.content)},
                     {"role": "user", "content": "and 3 + 3?"}]  # fmt: skip
            client.chat.completions.create(model="policy", messages=msgs, max_tokens=8)  # type: ignore[arg-type]
            px.reward(s["token"], 1.0)
            px.finish(s["token"])
        assert tel.flush()
        tel.shutdown()
        from playwright.sync_api import sync_playwright

        with sync_playwright() as pw:
            ctx = pw.chromium.launch_persistent_context(
                str(work / "profile"), executable_path="/usr/bin/chromium", viewport={"width": 1400, "height": 800},
                args=["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                      "--disable-background-networking", "--disable-component-update", "--disable-sync"],
            )  # fmt: skip
            page = ctx.new_page()
            page.set_default_timeout(60_000)
            page.goto(f"http://127.0.0.1:{PORT}/")
            page.get_by_text("default").first.click()
            page.get_by_text("rl.attempt").first.click()
            page.wait_for_timeout(1500)  # the trace's tree animates open: a bound for the picture, not a test
            out = ROOT / "docs" / "img" / "telemetry-phoenix.png"
            page.screenshot(path=str(out))
            ctx.close()
        print(f"wrote {out}")
    finally:
        phoenix.terminate()
        phoenix.wait(30)
        log.close()


if __name__ == "__main__":
    main()
