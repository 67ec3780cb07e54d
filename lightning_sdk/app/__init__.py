"""The application layer: the jobs behind ``lightning-sdk train`` and ``lightning-sdk daemon``, and the training loop.

- ``job.py``: ``open_job`` sets up and tears down everything a job runs on (run dir, socket, tasks, policy, store,
  engine, learner, proxy, view), once for both jobs, handing each part its own section of the config;
  ``parts.py`` builds the engine and learner of their sections; ``server.py`` serves the proxy; ``warmup.py``
  runs the warm start.
- ``loop.py``: the training loop in one file (take groups, records, ``learner.step``, checkpoint, publish, the
  held-out checks) and the evaluations.
- ``train.py``: ``run_training``, the main job top to bottom (warm start, evaluations, RL, summary).
- ``daemon.py``: ``run_daemon``, the trainer for external workers.

The components it composes live in their folders (``trainer/`` keeps the learner, losses, checkpoints, the config
and the verl backend).
"""

from lightning_sdk.app.daemon import run_daemon
from lightning_sdk.app.job import Job, open_job
from lightning_sdk.app.loop import RunStopped, StepReport, TrainingLoop
from lightning_sdk.app.train import run_training

__all__ = [
    "Job",
    "RunStopped",
    "StepReport",
    "TrainingLoop",
    "open_job",
    "run_daemon",
    "run_training",
]
