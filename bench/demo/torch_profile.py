"""Where the demo step's time goes, by torch.profiler (a diagnostic, not a benchmark).

python -m bench.demo torch_profile --preset large --steps 8 --profile-steps 3
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from syncless.demo.config import preset
from syncless.demo.train import run_demo


class ProfileTool:
    """Profiles steps [first, first + n) of the demo."""

    name = "profile"

    def __init__(self, first: int, n: int) -> None:
        self.first, self.last = first, first + n - 1
        activities = [ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(ProfilerActivity.CUDA)
        self.prof = profile(activities=activities)

    def attach(self, ctx) -> None:
        pass

    def step_begin(self, step: int) -> None:
        if step == self.first:
            self.prof.__enter__()

    def step_end(self, step: int) -> None:
        if step == self.last:
            self.prof.__exit__(None, None, None)

    def close(self) -> None:
        pass


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--profile-steps", type=int, default=3)
    parser.add_argument("--rows", type=int, default=25)
    args = parser.parse_args(argv)
    tool = ProfileTool(first=args.steps - args.profile_steps, n=args.profile_steps)
    with tempfile.TemporaryDirectory() as tmp:
        cfg = preset(args.preset, steps=args.steps, log_every=1)
        run_demo(cfg, run_dir=Path(tmp) / "run", quiet=True, tools=[tool])
    key = "self_cuda_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
    print(
        tool.prof.key_averages().table(sort_by=key, row_limit=args.rows, max_name_column_width=60)
    )
