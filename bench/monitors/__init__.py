"""The built-in monitors: their step-time overhead, kernels, host time and flush.

Cases (``python -m bench.monitors CASE``):

- ``overhead``: step-time overhead of each monitor, the default stack and the naive
  implementation on the demo's train step (GPU).
- ``kernels``: GPU launches each monitor adds per hooked module (target <= 3; GPU).
- ``ops``: kernel-launching aten ops each monitor adds per layer (deterministic, CPU).
- ``host_cost``: host microseconds per hook call and per flush (GPU; CPU torch rows).
- ``flush``: the flush's host time on the training thread, as shipped and as the
  per-key loop it replaced.
- ``attention_kernel``: the attention statistics kernel against its floor per model
  shape, and its tile sweep (GPU).
- ``attention_insitu``: the attention monitor's kernels inside a real training step
  against the same launches alone (GPU).
- ``spike_rules``: how far ordinary CPU runs' loss and gradient norm stray, against the
  spike rule (the defaults of ``SpikeRule`` come from it).

Not a case: ``naive`` (the same statistics the obvious way, one ``.item()`` each: the
comparison of ``overhead`` and of bench/stacks/real_models.py).
"""
