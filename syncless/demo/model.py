"""A small decoder-only MoE transformer, written to be read.

Byte-level tokens -> embedding -> N x [RMSNorm -> causal attention -> RMSNorm -> MoE]
-> RMSNorm -> tied LM head. The MoE layer routes each token to its top-k experts
(SwiGLU MLPs) plus an optional shared expert. Experts are dispatched by a
``Dispatcher`` (see dispatch.py): all experts local, or sharded over ranks; how they
run (grouped GEMMs, a padded batched matmul, a loop) is experts.py's.

Under autocast the residual stream stays fp32 and each norm's output is cast to the
compute dtype once, so the projections that read it share one cast.

Initialisation draws every parameter (and every expert slice) from its own generator
seeded by (seed, parameter name, expert index), so a model sharded across ranks
starts from exactly the weights of the unsharded one.
"""

from __future__ import annotations

import math
import zlib

import torch
import torch.nn.functional as F
from torch import nn

from syncless.demo.config import DemoConfig
from syncless.demo.data import VOCAB_SIZE
from syncless.demo.dispatch import Dispatcher, LocalDispatcher
from syncless.demo.experts import Experts, compute_dtype


class Rotary(nn.Module):
    """Rotary position embedding for queries and keys of shape [B, H, L, Dh].

    Channels (2i, 2i+1) are a pair rotated by angle_i: (x1 cos - x2 sin, x2 cos + x1 sin).
    Written as ``x * cos + swap(x) * sin`` with the sign folded into the table: a flip,
    a multiply and an addcmul, three passes over x instead of seven.
    """

    def __init__(self, head_dim: int, max_len: int, base: float = 10_000.0) -> None:
        super().__init__()
        inv_freq = 1.0 / base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
        angles = torch.outer(torch.arange(max_len, dtype=torch.float32), inv_freq)
        cos, sin = angles.cos().repeat_interleave(2, -1), angles.sin().repeat_interleave(2, -1)
        sin[:, 0::2] *= -1  # the first of each pair takes -x2 sin
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        seq = x.shape[-2]
        cos, sin = self.cos[:seq].to(x.dtype), self.sin[:seq].to(x.dtype)
        swapped = x.unflatten(-1, (-1, 2)).flip(-1).flatten(-2)  # (x2, x1) per pair
        return torch.addcmul(x * cos, swapped, sin)


class Attention(nn.Module):
    """Causal multi-head self-attention with separate q, k, v projections."""

    def __init__(self, d_model: int, n_heads: int, max_len: int) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.head_dim = d_model // n_heads
        self.q_proj = nn.Linear(d_model, d_model, bias=False)
        self.k_proj = nn.Linear(d_model, d_model, bias=False)
        self.v_proj = nn.Linear(d_model, d_model, bias=False)
        self.o_proj = nn.Linear(d_model, d_model, bias=False)
        self.rotary = Rotary(self.head_dim, max_len)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, seq, d = x.shape

        def heads(t: torch.Tensor) -> torch.Tensor:
            return t.view(b, seq, self.n_heads, self.head_dim).transpose(1, 2)

        q = self.rotary(heads(self.q_proj(x)))
        k = self.rotary(heads(self.k_proj(x)))
        v = heads(self.v_proj(x))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(out.transpose(1, 2).reshape(b, seq, d))


class Router(nn.Module):
    """Softmax router: top-k experts per token and their renormalised weights.

    ``bias=True`` (``--balance bias``, DeepSeek-V3's auxiliary-loss-free balancing):
    the buffer ``expert_bias`` is added to the probabilities for the top-k choice only.
    The weights are the unbiased probabilities of the chosen experts, so the bias takes
    no gradient and the gate's gradient is that of the same choice without it. Each
    forward adds its picks per expert to ``expert_load`` on the device;
    :class:`ExpertBalancer` moves the bias from them after each optimizer step.

    ``fixed=True`` (``--fix-router``, for benchmarks) ignores the scores: token t goes
    to experts ``(t*k + j) mod E`` for j < k with weight 1/k, the same plan in every
    layer and step and balanced whenever E divides T*k. The gate still runs, so the
    compute, the monitors' view of the router and the balance loss stay defined (with
    perfectly balanced counts the loss is 1 and has no gradient). A fixed router has
    no bias.
    """

    def __init__(
        self, d_model: int, n_experts: int, top_k: int, fixed: bool = False, bias: bool = False
    ) -> None:
        super().__init__()
        self.top_k = top_k
        self.fixed = fixed
        self.gate = nn.Linear(d_model, n_experts, bias=False)
        balanced = bias and not fixed
        # The bias is training state (saved with the model); the load is the picks
        # since the last update, summed over the ranks before it is used.
        self.register_buffer("expert_bias", torch.zeros(n_experts) if balanced else None)
        self.register_buffer(
            "expert_load", torch.zeros(n_experts) if balanced else None, persistent=False
        )

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [T, d] -> (weights [T, k], experts [T, k] int64, probs [T, E] fp32)."""
        probs = self.gate(x).float().softmax(dim=-1)
        if self.fixed:
            experts = fixed_routing(x.shape[0], self.top_k, probs.shape[-1], x.device)
            return probs.new_full(experts.shape, 1.0 / self.top_k), experts, probs
        if self.expert_bias is None:
            weights, experts = probs.topk(self.top_k, dim=-1)
        else:
            experts = (probs.detach() + self.expert_bias).topk(self.top_k, dim=-1).indices
            weights = probs.gather(-1, experts)
            # index_add_, not bincount: bincount reads its maximum back on CUDA. Under
            # activation checkpointing the recomputed forward adds its picks again:
            # every load doubles, and the update reads only their signs against the mean.
            flat = experts.reshape(-1)
            self.expert_load.index_add_(0, flat, torch.ones_like(flat, dtype=torch.float32))
        weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights, experts, probs


def fixed_routing(tokens: int, top_k: int, n_experts: int, device: torch.device) -> torch.Tensor:
    """[tokens, top_k] expert ids: token t -> (t*k + j) mod E (distinct while k <= E)."""
    t = torch.arange(tokens, device=device).unsqueeze(1)
    return (t * top_k + torch.arange(top_k, device=device)) % n_experts


class ExpertBalancer:
    """DeepSeek-V3's auxiliary-loss-free load balancing over a model's biased routers.

    After each optimizer step, in every layer, ``bias_i += speed * sign(mean load -
    load_i)``: an expert that took more than its share of the picks since the last
    update becomes less likely to be chosen, one that took less more likely. Then the
    loads restart. All on the device: nothing is read back.

    The loads must be global before the update. The trainer passes :attr:`loads` to
    the step's gradient all_reduce (``parallel.sync_gradients(..., also=)``): no
    collective of their own, and every rank moves its bias the same way.

    Example::

        balancer = ExpertBalancer(model, speed=1e-3)
        loss.backward()
        sync_gradients(model, expert_parallel, also=balancer.loads)
        optimizer.step()
        balancer.step()
    """

    def __init__(self, model: nn.Module, speed: float) -> None:
        self.speed = speed
        self.routers = [m for m in model.modules() if getattr(m, "expert_bias", None) is not None]

    @property
    def loads(self) -> list[torch.Tensor]:
        """Each biased router's picks per expert since the last update (device)."""
        return [r.expert_load for r in self.routers]

    @torch.no_grad()
    def step(self) -> None:
        if not self.routers:
            return
        loads = torch.stack(self.loads)  # [layers, experts]
        moves = (loads.mean(dim=-1, keepdim=True) - loads).sign_().mul_(self.speed)
        torch._foreach_add_([r.expert_bias for r in self.routers], list(moves.unbind(0)))
        torch._foreach_zero_(self.loads)


class SwiGLU(nn.Module):
    def __init__(self, d_model: int, hidden: int) -> None:
        super().__init__()
        self.w_gate = nn.Linear(d_model, hidden, bias=False)
        self.w_up = nn.Linear(d_model, hidden, bias=False)
        self.w_down = nn.Linear(hidden, d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w_down(F.silu(self.w_gate(x)) * self.w_up(x))


class MoE(nn.Module):
    """Top-k routed experts plus an optional shared expert.

    Returns the output and a sequence-wise load-balancing loss (DeepSeek-V3 style:
    sum_i f_i * P_i per sequence, averaged over sequences). Being a mean over
    sequences, it is the same whether a batch is split across data-parallel ranks or
    not, which keeps a sharded run numerically equal to a single-process one.
    """

    def __init__(self, cfg: DemoConfig, dispatcher: Dispatcher) -> None:
        super().__init__()
        self.n_experts = cfg.n_experts
        self.top_k = cfg.top_k
        self.router = Router(
            cfg.d_model,
            cfg.n_experts,
            cfg.top_k,
            fixed=cfg.fix_router,
            bias=cfg.balance == "bias",
        )
        self.dispatcher = dispatcher
        self.experts = Experts(
            dispatcher.local_experts(cfg.n_experts),
            cfg.d_model,
            cfg.expert_hidden,
            first_expert=dispatcher.first_local_expert(cfg.n_experts),
            impl=cfg.expert_impl,
            capacity_factor=cfg.capacity_factor,
        )
        self.shared_expert = SwiGLU(cfg.d_model, cfg.expert_hidden) if cfg.shared_expert else None

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        b, seq, d = x.shape
        flat = x.reshape(b * seq, d)
        weights, experts, probs = self.router(flat)
        out = self.dispatcher(flat, experts, weights, self.experts)
        if self.shared_expert is not None:
            out = out + self.shared_expert(flat)
        return out.view(b, seq, d), self._balance_loss(experts, probs, b, seq)

    def _balance_loss(
        self, experts: torch.Tensor, probs: torch.Tensor, b: int, seq: int
    ) -> torch.Tensor:
        # scatter_add instead of one_hot/bincount: both of those read the max index back
        # to the host on CUDA.
        counts = torch.zeros(b * seq, self.n_experts, device=probs.device)
        counts.scatter_add_(1, experts, torch.ones_like(experts, dtype=counts.dtype))
        frac = counts.view(b, seq, -1).sum(1) * (self.n_experts / (self.top_k * seq))
        mean_prob = probs.view(b, seq, -1).mean(1)
        return (frac * mean_prob).sum(-1).mean()


class Block(nn.Module):
    def __init__(self, cfg: DemoConfig, dispatcher: Dispatcher) -> None:
        super().__init__()
        self.attn_norm = nn.RMSNorm(cfg.d_model)
        self.attn = Attention(cfg.d_model, cfg.n_heads, cfg.seq_len)
        self.moe_norm = nn.RMSNorm(cfg.d_model)
        self.moe = MoE(cfg, dispatcher)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = x + self.attn(_cast(self.attn_norm(x)))
        y, balance = self.moe(_cast(self.moe_norm(x)))
        return x + y, balance


def _cast(x: torch.Tensor) -> torch.Tensor:
    """A norm's output in the compute dtype, once for every matmul that reads it
    (autocast would cast it again for each)."""
    return x.to(compute_dtype(x))


class MoETransformer(nn.Module):
    def __init__(self, cfg: DemoConfig, dispatcher: Dispatcher | None = None) -> None:
        super().__init__()
        dispatcher = dispatcher or LocalDispatcher()
        self.embed = nn.Embedding(VOCAB_SIZE, cfg.d_model)
        self.layers = nn.ModuleList(Block(cfg, dispatcher) for _ in range(cfg.n_layers))
        self.norm = nn.RMSNorm(cfg.d_model)

    def forward(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """tokens [B, L] -> (logits [B, L, 256], mean balance loss over layers)."""
        x = self.embed(tokens)
        balance = x.new_zeros((), dtype=torch.float32)
        for layer in self.layers:
            x, layer_balance = layer(x)
            balance = balance + layer_balance
        logits = self.norm(x) @ self.embed.weight.t().to(x.dtype)  # tied LM head
        return logits, balance / len(self.layers)


def _seed_for(seed: int, name: str, index: int = 0) -> int:
    # crc32, not hash(): Python's string hash is salted per process.
    return (seed * 1_000_003 + zlib.crc32(f"{name}#{index}".encode())) % (2**63)


@torch.no_grad()
def init_weights(model: MoETransformer, seed: int) -> None:
    """Deterministic init, independent of construction order and expert sharding.

    Normal(0, 0.02) for weights, with residual output projections scaled by
    1/sqrt(2 * n_layers) (GPT-2); norms start at one.
    """
    n_layers = len(model.layers)
    for name, p in model.named_parameters():
        std = 0.02
        if name.endswith(("o_proj.weight", "w_down.weight", "experts.w_down")):
            std /= math.sqrt(2 * n_layers)
        if "norm" in name:
            p.fill_(1.0)
        elif name.endswith(("experts.w_gate", "experts.w_up", "experts.w_down")):
            first = model.get_submodule(name.rsplit(".", 1)[0]).first_expert
            for local, slice_ in enumerate(p):
                g = torch.Generator(p.device).manual_seed(_seed_for(seed, name, first + local))
                slice_.normal_(0.0, std, generator=g)
        else:
            p.normal_(
                0.0, std, generator=torch.Generator(p.device).manual_seed(_seed_for(seed, name))
            )
