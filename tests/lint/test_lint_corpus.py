"""The labelled corpus: every `# expect: CODE` line is flagged, nothing else is.

Each file in cases/ labels the lines that must be flagged with a trailing
``# expect: SL001`` (several codes comma-separated). The linter's (line, code) set
must equal the labelled set exactly: full recall on the positives, no finding
anywhere else. An optional first-line ``# case-config: hot-path-patterns = a, b``
sets configured patterns for that file.
"""

from __future__ import annotations

import io
import re
import tokenize
from pathlib import Path

import pytest

from syncless.lint import RULES, LintConfig, lint_source

CASES = Path(__file__).parent / "cases"
_EXPECT = re.compile(r"#\s*expect:\s*(?P<codes>SL\d{3}(?:\s*,\s*SL\d{3})*)")
_CONFIG = re.compile(r"#\s*case-config:\s*hot-path-patterns\s*=\s*(?P<patterns>.+)")


def _labels(source: str) -> set[tuple[int, str]]:
    expected = set()
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            match = _EXPECT.search(token.string)
            if match:
                for code in match.group("codes").split(","):
                    expected.add((token.start[0], code.strip()))
    return expected


def _config(source: str) -> LintConfig:
    match = _CONFIG.match(source.splitlines()[0]) if source else None
    if match is None:
        return LintConfig()
    patterns = tuple(p.strip() for p in match.group("patterns").split(","))
    return LintConfig(hot_path_patterns=patterns)


CASE_FILES = sorted(CASES.glob("*.py"))


@pytest.mark.parametrize("case", CASE_FILES, ids=[p.stem for p in CASE_FILES])
def test_case_file(case: Path) -> None:
    source = case.read_text(encoding="utf-8")
    expected = _labels(source)
    found = {(f.line, f.rule) for f in lint_source(source, str(case), _config(source))}
    missing = sorted(expected - found)
    unexpected = sorted(found - expected)
    lines = source.splitlines()
    report = [f"missed   {line}: {code}  | {lines[line - 1].strip()}" for line, code in missing]
    report += [f"spurious {line}: {code}  | {lines[line - 1].strip()}" for line, code in unexpected]
    assert not report, f"{case.name}:\n" + "\n".join(report)


def test_corpus_covers_every_rule() -> None:
    labelled = set()
    for case in CASE_FILES:
        labelled |= {code for _, code in _labels(case.read_text(encoding="utf-8"))}
    assert labelled == set(RULES)


def test_labels_are_on_code_lines() -> None:
    # A label on a line that holds only a comment could never match: catch typos.
    for case in CASE_FILES:
        source = case.read_text(encoding="utf-8")
        lines = source.splitlines()
        for line, code in _labels(source):
            assert lines[line - 1].split("#")[0].strip(), f"{case.name}:{line}: {code}"
