"""What the linter knows about torch names: which calls return tensors, which sync.

Plain data, kept apart from the logic that uses it so that it can be reviewed (and
extended) against the torch documentation in one place.
"""

from __future__ import annotations

# Attributes of a tensor that are host-side metadata, never tensors.
NON_TENSOR_ATTRS = frozenset(
    {
        "shape", "ndim", "dtype", "device", "is_cuda", "is_cpu", "is_mps", "is_xpu",
        "is_meta", "is_sparse", "is_quantized", "is_nested", "is_leaf", "requires_grad",
        "layout", "names", "itemsize", "nbytes", "grad_fn", "output_nr", "_version",
    }
)  # fmt: skip

# Attributes of a tensor that are tensors again.
TENSOR_ATTRS = frozenset({"T", "mT", "H", "mH", "grad", "data", "real", "imag"})

# Tensor methods whose result is host metadata or a Python value, never a tensor.
NON_TENSOR_METHODS = frozenset(
    {
        "numel", "size", "dim", "ndimension", "nelement", "element_size", "stride",
        "storage_offset", "data_ptr", "get_device", "is_contiguous", "is_pinned",
        "is_floating_point", "is_complex", "is_signed", "is_shared", "is_set_to",
        "is_nonzero", "item", "tolist", "numpy", "untyped_storage", "storage",
        "register_hook", "register_post_accumulate_grad_hook", "backward", "dim_order",
        "equal", "allclose", "type", "__len__",
    }
)  # fmt: skip

# Methods (and torch functions) returning a boolean tensor.
BOOL_METHODS = frozenset(
    {
        "eq", "ne", "gt", "lt", "ge", "le", "greater", "less", "greater_equal",
        "less_equal", "not_equal", "isnan", "isinf", "isfinite", "isposinf", "isneginf",
        "isreal", "isclose", "isin", "signbit", "logical_and", "logical_or", "logical_not",
        "logical_xor", "bool", "any", "all",
    }
)  # fmt: skip

# Methods (and torch functions) returning a tuple of tensors.
SEQ_METHODS = frozenset(
    {
        "split", "chunk", "unbind", "tensor_split", "hsplit", "vsplit", "dsplit", "sort",
        "topk", "kthvalue", "aminmax", "std_mean", "var_mean", "frexp", "meshgrid",
        "broadcast_tensors", "slogdet", "histogram", "svd", "qr", "eigh", "eig", "lu",
        "cummax", "cummin", "split_with_sizes",
    }
)  # fmt: skip

# Reductions returning (values, indices) when given a dimension, a tensor otherwise.
DIM_SEQ_METHODS = frozenset({"max", "min", "median", "nanmedian", "mode"})

# Methods that, even on a receiver of unknown type, are taken to return a tensor:
# reductions and elementwise math that str/list/dict/set/loggers do not have (so not
# `add`, `log`, `where`, `update`...).
GENERIC_TENSOR_METHODS = frozenset(
    {
        "abs", "max", "min", "sum", "mean", "std", "var", "norm", "amax", "amin", "argmax",
        "argmin", "prod", "exp", "log2", "log10", "log1p", "expm1", "sqrt", "rsqrt", "pow",
        "square", "sigmoid", "tanh", "relu", "softmax", "log_softmax", "logsumexp", "isnan",
        "isinf", "isfinite", "any", "all", "eq", "ne", "gt", "lt", "ge", "le", "clamp",
        "clamp_min", "clamp_max", "clip", "detach", "float", "half", "bfloat16", "double",
        "long", "int", "bool", "count_nonzero", "cumsum", "cumprod", "flatten", "view",
        "view_as", "reshape", "contiguous", "squeeze", "unsqueeze", "transpose", "permute",
        "matmul", "mm", "bmm", "neg", "reciprocal", "sign", "nansum", "nanmean",
        "logical_not", "logical_and", "logical_or", "maximum", "minimum", "masked_fill",
        "expand_as", "index_select", "argsort", "float_power", "abs_", "add_", "mul_",
        "zero_", "fill_", "copy_", "clamp_",
    }
)  # fmt: skip

# torch.* callables that return something other than a tensor.
NON_TENSOR_TORCH = frozenset(
    {
        "is_tensor", "is_storage", "is_floating_point", "is_complex", "is_nonzero",
        "numel", "equal", "allclose", "is_grad_enabled", "is_inference_mode_enabled",
        "get_default_dtype", "get_default_device", "device", "dtype", "Size", "finfo",
        "iinfo", "no_grad", "enable_grad", "inference_mode", "set_grad_enabled",
        "autocast", "manual_seed", "seed", "compile", "typename", "set_printoptions",
        "use_deterministic_algorithms", "are_deterministic_algorithms_enabled",
        "get_num_threads", "set_num_threads", "is_autocast_enabled", "Generator",
        "Stream", "Event", "cond",
    }
)  # fmt: skip

# Namespaces whose public functions return tensors (``torch.stack``,
# ``torch.nn.functional.softmax``); anything else under torch (``torch.cuda``,
# ``torch.distributed``, ``torch._C``...) is typed UNKNOWN.
TENSOR_TORCH_NAMESPACES = frozenset(
    {
        "torch", "torch.linalg", "torch.fft", "torch.special", "torch.nn.functional",
        "torch.nn.init", "torch.Tensor", "torch.sparse", "torch.masked",
    }
)  # fmt: skip
TENSOR_TORCH_CONSTRUCTORS = frozenset(
    {"torch.nn.Parameter", "torch.nn.parameter.Parameter", "torch.nn.Buffer", "torch.Tensor"}
)

# Methods copying to the host (rule SL002); `.to()` is handled separately.
HOST_COPY_METHODS = frozenset({"cpu", "tolist", "numpy"})

# Data-dependent shapes or Python results, flagged whatever the receiver (rule SL006).
DATA_DEPENDENT = frozenset(
    {
        "nonzero", "argwhere", "unique", "unique_consecutive", "masked_select",
        "bincount", "histc", "equal", "allclose",
    }
)  # fmt: skip

# Collectives, flagged whatever the receiver (rule SL007).
COLLECTIVES = frozenset(
    {
        "all_reduce", "all_reduce_coalesced", "allreduce", "allreduce_coalesced",
        "all_gather", "all_gather_into_tensor", "all_gather_object", "all_gather_coalesced",
        "all_gather_single", "all_gather_tensor", "allgather", "allgather_coalesced",
        "allgather_into_tensor_coalesced", "_all_gather_base", "reduce_scatter",
        "reduce_scatter_tensor", "reduce_scatter_tensor_coalesced", "_reduce_scatter_base",
        "reducescatter", "broadcast_object_list", "barrier", "monitored_barrier",
        "all_to_all", "all_to_all_single", "alltoall", "alltoall_base", "isend", "irecv",
        "batch_isend_irecv", "send_object_list", "recv_object_list", "gather_object",
        "scatter_object_list", "wait_tensor",
    }
)  # fmt: skip

# Collective names that are also ordinary tensor or Python operations (`x.gather`,
# `functools.reduce`, `socket.send`): flagged only on torch.distributed or a receiver
# named like a process group.
AMBIGUOUS_COLLECTIVES = frozenset({"broadcast", "send", "recv", "gather", "scatter", "reduce"})
DIST_RECEIVERS = frozenset(
    {"dist", "distributed", "c10d", "pg", "process_group", "group", "funcol"}
)

# Methods of loggers (rule SL005 applies to their arguments).
LOG_METHODS = frozenset(
    {"debug", "info", "warning", "warn", "error", "exception", "critical", "log"}
)

# Calls that store a function for later instead of running it: a function passed to
# them from hot code does not become hot (`pending.append(partial(self._finish, t))`).
DEFERRING_CALLS = frozenset(
    {
        "append", "appendleft", "extend", "insert", "add", "put", "put_nowait", "register",
        "submit", "Thread", "Timer", "Process", "add_done_callback", "then", "call_soon",
        "call_later", "call_soon_threadsafe", "partial", "partialmethod", "setdefault",
        "finalize", "setattr", "__setitem__", "update", "ref", "WeakMethod",
    }
)  # fmt: skip
