"""Thin adapters to training frameworks: optional extras that call the public API only.

``syncless.integrations.transformers.SynclessCallback``: the monitors in a Hugging Face
``Trainer`` (``pip install "syncless[transformers]"``).
"""
