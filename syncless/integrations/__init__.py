"""Thin adapters to training frameworks: optional extras that call the public API only.

``syncless.integrations.transformers.SynclessCallback``: the monitors in a Hugging Face
``Trainer`` (``pip install "syncless[transformers]"``);
``syncless.integrations.lightning.SynclessCallback``: the same for a Lightning
``Trainer`` (``pip install "syncless[lightning]"``);
``syncless.integrations.megatron.SynclessMegatron``: monitors, profiler sections and
capture windows in a Megatron-core training loop (``syncless[megatron]``);
``syncless.integrations.torchtitan.syncless_metrics``: torchtitan's ``Trainer``, from
the job config or one line (``syncless[torchtitan]``).
"""
