"""syncless on real model shapes and inside the users' own stacks (GPU-bound steps).

Cases (``python -m bench.stacks CASE``):

- ``real_models``: the monitor stack's, each monitor's and the profiler's step-time
  overhead on Hugging Face models built from their configs: the evidence for every
  overhead claim.
- ``stack_models``: the same inside Megatron-core and torchtitan models.
- ``compiled_models``: torch.compile's speed-up with and without the stack.
- ``cuda_graphs``: what CUDA graphs buy, and the stack and the alarm inside graphs
  (``cuda_graphs_device.sh`` runs it with the CUDA tests in one device call).
- ``stack_profile``: the stack's device time per kernel, on and off.
- ``megatron_check``: the attention kernel and the norms against Megatron-core's own
  tensors and optimizer (checks, no timing).

Not cases: ``hf_models`` and ``titan_models`` (the models), ``segments`` (interleaved
segments of training steps), ``dynamo_counts`` (compiles and graph breaks).
"""
