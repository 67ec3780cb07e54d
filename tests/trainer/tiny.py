"""A small real policy for tests: the project's own tokenizer builder and chat template, a Qwen3 of ~50k parameters.

Built from the calc example's demonstrations, like the default policy, only smaller so tests stay fast.
"""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path
from types import ModuleType

from lightning_sdk.policy.model import TinyPolicyConfig, build_policy
from lightning_sdk.policy.tokenizer import build_tokenizer
from tests.support.scripts import load_script

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "calc_agent"


@lru_cache(maxsize=1)
def calc_tasks() -> ModuleType:
    """The example's ``tasks`` module (imported by path, as the trainer does)."""
    return load_script(EXAMPLE / "tasks.py", "calc_tasks_for_tests", register=True)


def corpus(n: int = 300) -> list[str]:
    tasks = calc_tasks()
    bootstrap = build_tokenizer(["x"], vocab_size=300)
    demos = [tasks.demonstration(t) for t in tasks.make_tasks(n, "train", seed=3)]
    return [str(bootstrap.apply_chat_template(d["messages"], tools=d["tools"], tokenize=False)) for d in demos]


def build_small_policy(out: Path, *, hidden: int = 32, layers: int = 2, seed: int = 0) -> Path:
    config = TinyPolicyConfig(
        vocab_size=400, hidden_size=hidden, num_layers=layers, num_heads=2, intermediate_size=64, seed=seed
    )
    return build_policy(out, corpus(), config)


#: ``python -c CLI ARGS...`` runs ``lightning-sdk ARGS...`` with the trainer commands registered.
CLI = (
    "import sys; from lightning_sdk.cli._app import app; "
    "import lightning_sdk.cli.train_cmd, lightning_sdk.cli.daemon_cmd; sys.exit(app())"
)


def write_config(path: Path, model: str, **sections: dict[str, object]) -> Path:
    """A training config for the calc example with ``model`` as the policy and ``sections`` as overrides."""
    lines = [
        f'agent = "{EXAMPLE / "agent.py"}:agent"',
        "threads = 1",
        "[data]",
        f'train = "{EXAMPLE / "tasks.py"}:train_tasks"',
        f'heldout = "{EXAMPLE / "tasks.py"}:heldout_tasks"',
        f'demonstrations = "{EXAMPLE / "tasks.py"}:demonstrations"',
        f'validation = "{EXAMPLE / "tasks.py"}:validation_tasks"',
        "[policy]",
        f'model = "{model}"',
    ]
    for name, values in sections.items():
        lines.append(f"[{name}]")
        lines += [f"{k} = {json.dumps(v)}" for k, v in values.items()]
    path.write_text("\n".join(lines) + "\n")
    return path
