"""``python -m syncless.capture.simulate TRACE.json``.

The command line is :func:`syncless.capture.simulate.replay.main`.
"""

from __future__ import annotations

from syncless.capture.simulate.replay import main

raise SystemExit(main())
