"""Model FLOPs utilisation (MFU) of the demo: FLOPs per token from the config, and the
peak of the GPU it runs on.

torchtitan's convention (``get_moe_model_nparams_and_flops``), so the numbers read like
its: 6 FLOPs per active matmul parameter per token (forward 2, backward 4), plus the
attention scores and their weighted sum, 12 x layers x heads x head_dim x seq_len,
the causal mask not discounted. docs/demo.md, "MFU", writes the formula out.
"""

from __future__ import annotations

from dataclasses import dataclass

from syncless.demo.config import DemoConfig
from syncless.demo.data import VOCAB_SIZE

# Dense bf16 tensor-core peak per GPU, FLOP/s, from the vendors' datasheets (the values
# torchtitan's get_peak_flops uses). Matched as substrings of the device name, first
# match wins: the more specific names come first ("H200" before "H20", "GB200" before
# "B200", the H100 variants before the SXM default).
PEAK_BF16_FLOPS: tuple[tuple[str, float], ...] = (
    ("GB300", 2.5e15),
    ("GB200", 2.5e15),
    ("B300", 2.25e15),
    ("B200", 2.25e15),
    ("H200", 989e12),
    ("H100 NVL", 835e12),
    ("H100 PCIe", 756e12),
    ("H100", 989e12),  # SXM
    ("H800", 989e12),
    ("H20", 148e12),
    ("A100", 312e12),
    ("A800", 312e12),
    ("L40S", 362e12),
    ("A6000", 154.85e12),
    ("MI355X", 2500e12),
    ("MI325X", 1300e12),
    ("MI300X", 1300e12),
)


def active_matmul_params(cfg: DemoConfig) -> int:
    """Weights one token multiplies through: per layer the attention projections, the
    router, its top_k experts and the shared expert, plus the tied LM head once.

    Norm weights and the embedding lookup are not matmuls and do not count; the tied
    head is the embedding's matrix and counts once (torchtitan with weight tying).
    """
    d, h = cfg.d_model, cfg.expert_hidden
    attention = 4 * d * d
    router = d * cfg.n_experts
    experts = cfg.top_k * 3 * d * h
    shared = 3 * d * h if cfg.shared_expert else 0
    return cfg.n_layers * (attention + router + experts + shared) + VOCAB_SIZE * d


def attention_flops_per_token(cfg: DemoConfig) -> int:
    """QK^T and the weighted sum of V, forward and backward: 12 x layers x d_model x
    seq_len (heads x head_dim = d_model), the causal mask not discounted."""
    return 12 * cfg.n_layers * cfg.d_model * cfg.seq_len


def flops_per_token(cfg: DemoConfig) -> int:
    """Training FLOPs per token: 6 x active matmul parameters + the attention term."""
    return 6 * active_matmul_params(cfg) + attention_flops_per_token(cfg)


@dataclass(frozen=True)
class Peak:
    """The peak an MFU is taken against, or why there is none."""

    flops: float | None  # FLOP/s per device; None: no MFU
    about: str  # "NVIDIA H200, bf16 dense", or the reason there is none

    def describe(self) -> str:
        if self.flops is None:
            return f"no MFU ({self.about})"
        return f"{self.flops / 1e12:,.0f} TFLOP/s ({self.about})"


def peak_for(device_type: str, device_name: str, bf16: bool) -> Peak:
    """The dense bf16 peak of the device the demo trains on.

    No MFU on a CPU, for an fp32 run (its peak is not the bf16 one), or on a GPU the
    table does not know: add it to ``PEAK_BF16_FLOPS``.
    """
    if device_type != "cuda":
        return Peak(None, "a CPU has no tensor-core peak to compare with")
    if not bf16:
        return Peak(None, "fp32 training: MFU is taken against the bf16 peak")
    for pattern, flops in PEAK_BF16_FLOPS:
        if pattern in device_name:
            return Peak(flops, f"{device_name}, bf16 dense")
    return Peak(None, f"unknown GPU {device_name!r}: add its bf16 peak to syncless.demo.flops")
