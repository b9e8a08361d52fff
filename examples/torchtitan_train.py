"""syncless in torchtitan's trainer (0.3), two ways; this file is a ``--module`` config
registry for the second.

1. From the job config, no code: torchtitan's override mechanism swaps the trainer's
   ``metrics`` component for ``SynclessMetricsProcessor`` (settings as JSON)::

       torchrun --nproc-per-node 8 -m torchtitan.train \\
           --module llama3 --config llama3_debugmodel \\
           --override.imports \\
           'syncless.integrations.torchtitan.syncless_metrics={"monitors": "all"}'

2. One line in a config function (below)::

       PYTHONPATH=examples torchrun --nproc-per-node 8 -m torchtitan.train \\
           --module torchtitan_train --config llama3_debugmodel_syncless

Either way the monitors attach after AC, compile and FSDP, flush once per optimizer
step and write to ``runs/<time>-torchtitan`` (``syncless report`` reads it). They work
with torchtitan's CUDA graphs (its default): step 2 captures their hooks, and device
gates set between replays carry their cadences.
"""

from __future__ import annotations

from torchtitan.models.llama3.config_registry import llama3_debugmodel
from torchtitan.trainer import Trainer

from syncless.integrations.torchtitan import syncless_metrics


def llama3_debugmodel_syncless() -> Trainer.Config:
    """torchtitan's Llama 3 debug model with every syncless monitor."""
    config = llama3_debugmodel()
    config.metrics = syncless_metrics(config.metrics, monitors="all")  # the one line
    return config
