"""Thin adapters to training frameworks: optional extras that call the public API only.

``syncless.integrations.transformers.SynclessCallback``: the monitors in a Hugging Face
``Trainer`` (``pip install "syncless[transformers]"``);
``syncless.integrations.lightning.SynclessCallback``: the same for a Lightning
``Trainer`` (``pip install "syncless[lightning]"``).
"""
