"""The capture engine: drain rate, host cost, cost under load, disk, long runs.

Cases (``python -m bench.capture CASE``):

- ``drain``: unconstrained drain rate against the pinned D2H bandwidth (target >= 90%
  on an H200), and one small ``capture()``'s host time.
- ``host``: where ``capture()``'s host time goes (threads, deferred, copy skipped).
- ``load``: every layer's hidden state, every step, of a GPU-bound model: the disk, the
  engine into it, and step overhead in interleaved segments.
- ``soak``: minutes of steady capture into the safetensors sink once the page cache is
  full (issue 23's "for hours").
- ``gaps``: where ``load``'s step cost lands on the GPU (kernel time or idle gaps).
- ``gil``: how long the engine's threads keep the training thread from the GIL.
- ``gc_counts``: garbage collections per generation while one engine captures.
- ``windows``: recurring capture windows against ordinary batching on the
  expert-parallel demo (2 ranks).
- ``before_after``: ``drain``, ``host`` and ``load`` on two source trees, interleaved.

Not cases: ``disk`` (the disk under the sink's folder and the engine into it: the first
stages of ``load``, and the rate ``soak`` offers against) and ``gc_clock`` (counts
collections per mode, for ``load`` and ``gc_counts``).
"""
