"""The run viewer: ``lightning-sdk view RUN_DIR`` (and the daemon's ``/lightning/v1/ui``), read-only.

``RunData`` reads a run directory and its store a bounded page at a time (``viewer/data.py``);
``create_viewer_app`` serves it as server-rendered pages with one small script, and the same data as JSON
(``viewer/app.py``; templates and static files ship in the package: no Node build). See docs/viewer.md.
"""

from lightning_sdk.viewer.app import create_viewer_app, svg_curves
from lightning_sdk.viewer.data import GROUPS_PER_READ, RolloutFilter, RunData, conversation, open_run

__all__ = ["GROUPS_PER_READ", "RolloutFilter", "RunData", "conversation", "create_viewer_app", "open_run", "svg_curves"]
