"""What a lint run produces: findings, per-path errors, and the overall result."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass(frozen=True, order=True)
class Finding:
    """One rule violation. ``line`` and ``col`` are 1-based.

    ``function`` is the qualified name of the hot-path function the code is in
    (``<module>`` for findings about comments outside any function).
    """

    path: str
    line: int
    col: int
    rule: str
    message: str
    function: str
    hint: str

    def to_dict(self) -> dict[str, object]:
        """The JSON form: keys ``path line col rule message function hint``."""
        return asdict(self)


@dataclass(frozen=True)
class LintError:
    """A path that could not be linted (missing, unreadable, or not valid Python)."""

    path: str
    message: str


@dataclass
class LintResult:
    """Findings and errors of one run over some paths."""

    findings: list[Finding] = field(default_factory=list)
    errors: list[LintError] = field(default_factory=list)
    files_checked: int = 0

    @property
    def exit_code(self) -> int:
        """2 when a path could not be linted, else 1 when there are findings, else 0."""
        if self.errors:
            return 2
        return 1 if self.findings else 0
