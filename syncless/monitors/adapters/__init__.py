"""Model adapters: find each layer's attention, router and MLP, and hook them sync-free.

``find_layers(model)`` returns a :class:`ModelMap`: per layer a :class:`LayerSite`
with an :class:`AttentionSite` (``attach_qk``: post-RoPE q and k as they enter the
softmax), a :class:`RouterSite` for MoE layers (``attach_logits``) and the block itself
(``attach_output``, ``parameters``). Built-in adapters, tried in this order: the
syncless demo model, torchtitan's decoders, Megatron-core GPTModel (and its
virtual-pipeline chunks), Hugging Face Llama/Mistral/Qwen2/Mixtral/Qwen2-MoE style models,
``torch.nn.MultiheadAttention``. Add your own with :func:`register_adapter`; see
docs/adapters.md.
"""

from syncless.monitors.adapters.demo import DemoAdapter, DemoAttentionSite
from syncless.monitors.adapters.hf import HFAdapter, HFAttentionSite
from syncless.monitors.adapters.megatron import (
    MegatronAdapter,
    MegatronAttentionSite,
    MegatronRouterSite,
)
from syncless.monitors.adapters.mha import MHAAttentionSite, MultiheadAttentionAdapter
from syncless.monitors.adapters.registry import (
    Adapter,
    find_layers,
    register_adapter,
    registered_adapters,
)
from syncless.monitors.adapters.sites import (
    AttentionSite,
    LayerSite,
    ModelMap,
    QKCallback,
    Rotary,
    RotaryQKCallback,
    RouterSite,
    RoutingCallback,
    TensorCallback,
)
from syncless.monitors.adapters.torchtitan import (
    TorchtitanAdapter,
    TorchtitanAttentionSite,
    TorchtitanRouterSite,
)

# Built-ins, most specific first: the demo's blocks would not match the HF layout and
# vice versa, and MultiheadAttention (any model containing one) is the catch-all.
for _adapter in (
    DemoAdapter(),
    TorchtitanAdapter(),
    MegatronAdapter(),
    HFAdapter(),
    MultiheadAttentionAdapter(),
):
    register_adapter(_adapter, first=False)
del _adapter

__all__ = [
    "Adapter",
    "AttentionSite",
    "DemoAdapter",
    "DemoAttentionSite",
    "HFAdapter",
    "HFAttentionSite",
    "LayerSite",
    "MHAAttentionSite",
    "MegatronAdapter",
    "MegatronAttentionSite",
    "MegatronRouterSite",
    "ModelMap",
    "MultiheadAttentionAdapter",
    "QKCallback",
    "Rotary",
    "RotaryQKCallback",
    "RouterSite",
    "RoutingCallback",
    "TensorCallback",
    "TorchtitanAdapter",
    "TorchtitanAttentionSite",
    "TorchtitanRouterSite",
    "find_layers",
    "register_adapter",
    "registered_adapters",
]
