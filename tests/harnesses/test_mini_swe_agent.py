"""mini-swe-agent (``DefaultAgent`` + ``LitellmModel`` + ``LocalEnvironment``, its default config, the ``bash`` tool):
only the model's ``api_base`` and ``api_key`` point at the proxy; commands really run in a temporary directory."""

from __future__ import annotations

from pathlib import Path

import minisweagent
import pytest
import yaml
from minisweagent.agents.default import DefaultAgent
from minisweagent.environments.local import LocalEnvironment
from minisweagent.models.litellm_model import LitellmModel

from tests.harnesses.rig import SECRET, TASK, Rig

pytestmark = pytest.mark.harness


def test_default_agent(rig: Rig, tmp_path: Path) -> None:
    s = rig.session()
    config = yaml.safe_load((Path(minisweagent.__file__).parent / "config" / "default.yaml").read_text())
    model = LitellmModel(
        model_name="openai/policy",
        model_kwargs={"api_base": s.base_url, "api_key": s.token, "num_retries": 0},
        cost_tracking="ignore_errors",  # the policy has no price
        **{k: v for k, v in config["model"].items() if k not in ("model_name", "model_kwargs")},
    )
    env = LocalEnvironment(cwd=str(tmp_path), **{k: v for k, v in config["environment"].items() if k == "env"})
    agent_cfg = dict(config["agent"], step_limit=4, cost_limit=0, output_path=None)
    agent = DefaultAgent(model, env, **agent_cfg)
    result = agent.run(TASK)
    if rig.scripted:
        assert result["exit_status"] == "Submitted" and result["submission"].strip() == SECRET, result
    else:
        assert result["exit_status"] in ("LimitsExceeded", "RepeatedFormatError", "Submitted"), result
    calls = rig.verify(s)
    assert calls[0]["request"]["tools"][0]["function"]["name"] == "bash"
