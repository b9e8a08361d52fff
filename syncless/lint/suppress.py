"""``# syncless:`` comments: suppressions and collective permissions.

``# syncless: ok <reason>`` suppresses the findings of the statement it is on (any
line of it; for a compound statement, of its header). ``# syncless: collective-ok
<reason>`` allows a collective on its statement, or on the statement starting on the
next line. The reason is the text after the directive, up to a following ``#`` (so
another comment may follow); without a reason the directive suppresses nothing and
is reported itself (SL100). Which lines a finding covers is decided by the checker.
"""

from __future__ import annotations

import io
import re
import tokenize
from dataclasses import dataclass

OK = "ok"
COLLECTIVE_OK = "collective-ok"
KNOWN = (OK, COLLECTIVE_OK)
_DIRECTIVE = re.compile(r"#\s*syncless:\s*(?P<name>[A-Za-z][\w-]*)?(?P<rest>[^#]*)")


@dataclass(frozen=True)
class Directive:
    """One ``# syncless: <name> <reason>`` comment; ``col`` is 1-based."""

    line: int
    col: int
    name: str
    reason: str


def scan_directives(source: str) -> list[Directive]:
    """Every ``# syncless:`` directive in the comments of ``source``."""
    found = []
    try:
        tokens = list(tokenize.generate_tokens(io.StringIO(source).readline))
    except (tokenize.TokenError, SyntaxError):
        return found
    for token in tokens:
        if token.type != tokenize.COMMENT:
            continue
        match = _DIRECTIVE.search(token.string)
        if match is None:
            continue
        col = token.start[1] + match.start() + 1
        name = match.group("name") or ""
        found.append(Directive(token.start[0], col, name, match.group("rest").strip()))
    return found


class Suppressions:
    """Which lines carry a valid (reasoned) ``ok`` or ``collective-ok`` directive."""

    def __init__(self, directives: list[Directive]) -> None:
        self._ok = {d.line for d in directives if d.name == OK and d.reason}
        self._collective = {d.line for d in directives if d.name == COLLECTIVE_OK and d.reason}

    def allows(self, rule: str, lines: tuple[int, ...], line_above: int | None = None) -> bool:
        """Whether a finding spanning ``lines`` is suppressed.

        ``line_above`` is also searched for ``collective-ok`` (collectives only).
        """
        if any(line in self._ok for line in lines):
            return True
        if rule != "SL007":
            return False
        candidates = (*lines, line_above) if line_above is not None else lines
        return any(line in self._collective for line in candidates)
