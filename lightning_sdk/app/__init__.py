"""The application layer: the jobs behind ``lightning-sdk train`` and ``lightning-sdk daemon``.

- ``job.py``: ``open_job`` sets up and tears down everything a job runs on (run dir, socket, policy, store, proxy,
  engine, learner, view), once for both jobs.
- ``train.py``: ``run_training``, the main job top to bottom (warm start, evaluations, RL, summary).
- ``daemon.py``: ``run_daemon``, the trainer for external workers.

The components it composes live in their folders (``trainer/`` keeps the learner, losses, checkpoints, the training
loop ``TrainerDaemon`` and the verl backend).
"""

from lightning_sdk.app.daemon import run_daemon
from lightning_sdk.app.job import Job, open_job, validation_tasks
from lightning_sdk.app.train import run_training
from lightning_sdk.trainer.phases import RunStopped

__all__ = ["Job", "RunStopped", "open_job", "run_daemon", "run_training", "validation_tasks"]
