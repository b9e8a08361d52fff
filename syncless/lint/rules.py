"""The rule catalogue: one stable code per rule, with a summary and a fix hint."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Rule:
    """A lint rule: ``code`` never changes meaning once released."""

    code: str
    name: str
    summary: str
    hint: str


_RULES = (
    Rule(
        "SL001",
        "item",
        "`.item()` copies a tensor value to the host and waits for the device",
        "keep the value a tensor on the device; read it back in the batched copy at flush",
    ),
    Rule(
        "SL002",
        "host-copy",
        "`.cpu()`, `.tolist()`, `.numpy()` or `.to('cpu')` copies a tensor to the host",
        "keep the tensor on the device; copy to the host once per flush, non-blocking "
        "into pinned memory",
    ),
    Rule(
        "SL003",
        "python-scalar",
        "`int()`/`float()`/`bool()`/`math.*`/`range()` of a tensor converts it on the host",
        "keep it a tensor (`t.float()`, `t.to(torch.int64)`, `torch.sqrt`), or convert at flush",
    ),
    Rule(
        "SL004",
        "tensor-branch",
        "a branch on a tensor value (`if`, `while`, ternary, `assert`, `and`/`or`/`not`, "
        "builtin `max`/`min`/`any`/`all`/`sorted`) reads it on the host",
        "compute both outcomes on the device (`torch.where`, `masked_fill`, `clamp`, "
        "`torch.maximum`), or check at flush",
    ),
    Rule(
        "SL005",
        "tensor-format",
        "`print`, f-string, `format`, `%`, `str()`/`repr()` or a logging call formats a "
        "tensor's values on the host",
        "record the tensor into a metric and format it at flush",
    ),
    Rule(
        "SL006",
        "data-dependent",
        "data-dependent shape or Python result (`nonzero`, `unique`, boolean-mask "
        "indexing, `masked_select`, `repeat_interleave(tensor)`, one-argument "
        "`torch.where`, `equal`, `allclose`, `bincount`, `histc`) needs the data on the host",
        "use a fixed-shape form: `torch.where(mask, x, 0)`, `masked_fill`, `nonzero_static`, "
        "`repeat_interleave(..., output_size=n)`, or a reduction kept on the device",
    ),
    Rule(
        "SL007",
        "collective",
        "a collective on the hot path makes every rank wait for the slowest one",
        "aggregate once per flush in the packed collectives; if correctness needs it here, "
        "add `# syncless: collective-ok <reason>`",
    ),
    Rule(
        "SL008",
        "declare-in-hook",
        "a `declare*` call on the hot path changes the metric schema after registration",
        "declare every key at registration, before `allocate()` locks the schema",
    ),
    Rule(
        "SL009",
        "swallowed-exception",
        "an `except` without `raise` (or `contextlib.suppress`) hides a failure on the hot path",
        "let the exception propagate; a silent fallback hides bugs and often takes a host path",
    ),
    Rule(
        "SL010",
        "synchronize",
        "`synchronize()` blocks the host until the device has caught up",
        "remove it; time with CUDA events and read them at flush",
    ),
    Rule(
        "SL100",
        "suppression-without-reason",
        "a `# syncless: ok` or `# syncless: collective-ok` comment without a reason "
        "suppresses nothing",
        "write the reason after the directive: `# syncless: ok <why this is safe>`",
    ),
    Rule(
        "SL101",
        "unknown-directive",
        "a `# syncless:` comment with a directive the linter does not know",
        "use `# syncless: ok <reason>` or `# syncless: collective-ok <reason>`",
    ),
)

RULES: dict[str, Rule] = {rule.code: rule for rule in _RULES}
"""Every rule by code, in code order."""
