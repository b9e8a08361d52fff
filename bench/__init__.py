"""syncless's benchmarks: seven suites, one entry point each.

From the repository root, ``python -m bench.<suite> CASE [ARGS...]`` runs a case and
``python -m bench.<suite>`` lists the suite's cases: ``monitors``, ``capture``,
``profile``, ``dataplane``, ``demo``, ``store``, ``stacks``. bench/README.md says what
each measures and how long it takes; bench/harness.py is what they share (the entry
point, interleaved rounds, RESULTS.md lines); bench/RESULTS.md is the record.
"""
