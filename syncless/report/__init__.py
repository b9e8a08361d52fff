"""Views of a run directory: the HTML report, the terminal summary, the Perfetto trace.

Each reads the run through ``syncless.run.RunStore`` (the read-only query sandbox), so a
killed run (fewer shards) or one with an unreadable shard still reports.
"""
