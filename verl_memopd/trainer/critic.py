"""The critic worker: verl's critic ``TrainingWorker`` on the ``memopd_value_model`` engine (packed layout)."""

from __future__ import annotations

import dataclasses

from verl.workers.config import TrainingWorkerConfig
from verl.workers.engine_workers import TrainingWorker


class MemopdCriticWorker(TrainingWorker):
    """verl's critic ``TrainingWorker`` on the ``memopd_value_model`` engine (``verl_memopd.trainer.engine``).

    verl 0.9.1 hard-codes ``model_type="value_model"`` for the critic in the trainer's setup;
    the trainer maps Role.Critic to this class instead.
    """

    def __init__(self, config: TrainingWorkerConfig):
        super().__init__(dataclasses.replace(config, model_type="memopd_value_model"))
