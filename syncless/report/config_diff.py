"""What differs between runs' ``run.json``: config fields, world size, versions.

``syncless compare`` prints it and the overlay report shows it: in an ablation, these
few keys are the experiment. Config keys are flattened (``opt.lr``); versions and the
host come from ``env`` as ``env.<key>``. ``env.argv`` and ``env.platform`` are left
out: the argv names the run directory, so it always differs.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any, NamedTuple

from syncless.run.runset import RunEntry, flatten

__all__ = ["ConfigDiff", "Difference", "diff_configs"]

ENV_KEYS = ("python", "torch", "syncless", "cuda", "gpu", "host", "git_commit")


class Difference(NamedTuple):
    """One key whose value is not the same in every run: its values, run by run
    (``None`` where a run lacks the key)."""

    key: str
    values: list[Any]


class ConfigDiff(NamedTuple):
    """The keys that differ, in the first run's order, and how many are the same."""

    differences: list[Difference]
    same: int


def diff_configs(runs: Sequence[RunEntry]) -> ConfigDiff:
    """Compare the runs' config, world size and versions."""
    settings = [_settings(r.info) for r in runs]
    keys = list(dict.fromkeys(k for s in settings for k in s))
    differences, same = [], 0
    for key in keys:
        values = [s.get(key) for s in settings]
        if all(_same(values[0], v) for v in values[1:]):
            same += 1
        else:
            differences.append(Difference(key, values))
    return ConfigDiff(differences, same)


def _settings(info: dict[str, Any]) -> dict[str, Any]:
    out = {"world_size": info.get("world_size")}
    out.update(flatten(info.get("config") or {}))
    env = info.get("env") or {}
    out.update({f"env.{k}": env[k] for k in ENV_KEYS if k in env})
    return out


def _same(a: Any, b: Any) -> bool:
    numbers = (int, float)
    if isinstance(a, numbers) and isinstance(b, numbers) and not isinstance(a, bool):
        return not isinstance(b, bool) and a == b  # 1 and 1.0 are one setting
    # JSON-equal: a list and a tuple are one setting too.
    return json.dumps(a, sort_keys=True, default=str) == json.dumps(b, sort_keys=True, default=str)
