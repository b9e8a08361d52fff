"""Rendering a lint result: text lines, JSON, and the one-line summary."""

from __future__ import annotations

import json

from syncless.lint.findings import Finding, LintResult


def format_text(findings: list[Finding]) -> str:
    """``path:line:col: CODE message (hint)``, one finding per line."""
    return "".join(
        f"{f.path}:{f.line}:{f.col}: {f.rule} {f.message} ({f.hint})\n" for f in findings
    )


def format_json(findings: list[Finding]) -> str:
    """A JSON list of objects with keys ``path line col rule message function hint``."""
    return json.dumps([f.to_dict() for f in findings], indent=2) + "\n"


def summary(result: LintResult) -> str:
    """One line for stderr: counts of findings, files and errors."""
    files = result.files_checked
    checked = f"{files} file{'s' if files != 1 else ''} checked"
    if result.findings:
        count = len(result.findings)
        with_findings = len({f.path for f in result.findings})
        text = (
            f"{count} finding{'s' if count != 1 else ''} in {with_findings} "
            f"file{'s' if with_findings != 1 else ''} ({checked})"
        )
    else:
        text = f"no findings ({checked})"
    if result.errors:
        errors = len(result.errors)
        text += f", {errors} error{'s' if errors != 1 else ''}"
    return f"syncless lint: {text}"
