"""The data plane's host-side costs (CPU).

Cases (``python -m bench.dataplane CASE``):

- ``overhead``: ``MetricsClient``'s cost per put and get against a no-op inner client.
- ``integrity``: per-row wire digests of one RL batch: order-aware vs XOR fold vs crc32.
- ``histogram``: per-call cost of the accounting (``LogHistogram``, byte counts).
"""
