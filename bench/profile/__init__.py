"""The section profiler and straggler detection: overhead, skew split, scoring.

Cases (``python -m bench.profile CASE``):

- ``overhead``: each profiler mode's step-time overhead on the demo's train step, with
  a Megatron-style synchronize-per-span timer beside it (GPU).
- ``pool``: pools the per-period estimates of several ``overhead --dump`` runs.
- ``skew``: how much of an injected rank delay lands in the rendezvous row (2 ranks).
- ``stragglers``: straggler scoring at 1,024 ranks x 50 sections, and ``syncless
  stragglers`` reading such a run back (CPU).
"""
