"""The run store and the commands that read it: scale, start-up, report, sinks (CPU).

Cases (``python -m bench.store CASE``):

- ``scale``: shard writes, queries, compaction, summary and report at 64 to 1,024 ranks.
- ``report_scale``: ``syncless report`` on 1,000,000 steps of 64 ranks (<= 5 s, 10 MB).
- ``cli_startup``: the commands that should answer at once, against bare baselines.
- ``summary_speed``: ``syncless summary`` on a 100k-record run (< 1 s).
- ``sink_cost``: writer-thread time of the TensorBoard and wandb sinks per step.
"""
