"""``backend: verl`` — verl's FSDP workers on Ray train on our records (see docs/scale-out.md).

Importing this package does not import verl or Ray; they load when a backend starts.
"""

from lightning_sdk.trainer.verl.adapter import VerlLearner
from lightning_sdk.trainer.verl.backend import LocalRanks, RayRanks, VerlBackend
from lightning_sdk.trainer.verl.batch import TrainRow, dataproto_to_rows, records_to_dataproto, rows_from_records
from lightning_sdk.trainer.verl.config import VerlConfig, to_verl_config
from lightning_sdk.trainer.verl.step import run_step

__all__ = [
    "LocalRanks",
    "RayRanks",
    "TrainRow",
    "VerlBackend",
    "VerlConfig",
    "VerlLearner",
    "dataproto_to_rows",
    "records_to_dataproto",
    "rows_from_records",
    "run_step",
    "to_verl_config",
]
