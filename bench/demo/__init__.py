"""The demo workload itself: throughput, MFU, MoE balance, expert-parallel pacing.

Cases (``python -m bench.demo CASE``):

- ``baseline``: the demo's median step and tokens/s with no syncless tool on.
- ``mfu``: tokens/s, MFU and step-time CV before and after a change, and the
  ``--impls``, ``--sweep`` and ``--ranks`` comparisons (GPU; ``--smoke`` on a CPU).
- ``balance``: how balanced the MoE trains under each ``--balance`` mode (CPU).
- ``pacing_ep``: the expert-parallel dispatch's split-list modes, interleaved (2 ranks).
- ``torch_profile``: where the demo step's time goes, by torch.profiler (a diagnostic).

Not a case: ``train_step`` (the demo's step in a tight loop, the workload of
bench/monitors/overhead.py, bench/profile/overhead.py and bench/capture/windows.py).
"""
