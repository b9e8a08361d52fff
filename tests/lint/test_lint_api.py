"""The Python API, and the project's own promises: it lints clean, docs cover every rule."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

import syncless
from syncless.lint import RULES, Finding, LintConfig, lint_paths, lint_source

ROOT = Path(__file__).resolve().parents[2]


def lint(code: str, **config: tuple[str, ...]) -> list[Finding]:
    return lint_source(textwrap.dedent(code), "m.py", LintConfig(**config))


def test_finding_fields() -> None:
    [finding] = lint(
        """\
        class Mon:
            def attach(self, model):
                model.register_forward_hook(self._make(3))

            def _make(self, i):
                def inner(module, inputs, output):
                    return output.abs().max().item()
                return inner
        """
    )
    assert finding.path == "m.py"
    assert (finding.line, finding.col, finding.rule) == (7, 39, "SL001")
    assert finding.function == "Mon._make.<locals>.inner"
    assert "forward hook `Mon._make.<locals>.inner`" in finding.message
    assert finding.hint == RULES["SL001"].hint
    assert set(finding.to_dict()) == {"path", "line", "col", "rule", "message", "function", "hint"}


def test_syntax_error_raises() -> None:
    with pytest.raises(SyntaxError):
        lint_source("def f(:\n")


def test_no_hot_path_no_findings() -> None:
    assert lint("x = __import__('torch').ones(1).item()\n") == []


def test_transitive_message_names_the_caller() -> None:
    [finding] = lint(
        """\
        def helper(t):
            return t.cpu()

        def grad_hook(grad):
            return helper(grad)
        """
    )
    assert finding.function == "helper"
    assert "called from `grad_hook`" in finding.message


def test_ignore_codes() -> None:
    code = "def grad_hook(g):\n    print(g.item())  # syncless: ok\n"
    assert {f.rule for f in lint(code)} == {"SL001", "SL100"}
    assert {f.rule for f in lint(code, ignore=("SL1",))} == {"SL001"}


def test_lint_paths_collects_errors(tmp_path: Path) -> None:
    (tmp_path / "a.py").write_text("def grad_hook(g):\n    return g.item()\n")
    (tmp_path / "b.py").write_text("def f(:\n")
    result = lint_paths([tmp_path, tmp_path / "missing"])
    assert [f.rule for f in result.findings] == ["SL001"]
    assert sorted(Path(e.path).name for e in result.errors) == ["b.py", "missing"]
    assert result.files_checked == 1
    assert result.exit_code == 2


def test_deep_nesting_is_an_error_not_a_crash(tmp_path: Path) -> None:
    body = " + ".join(["g"] * 5000)
    (tmp_path / "deep.py").write_text(f"def grad_hook(g):\n    return {body}\n")
    result = lint_paths([tmp_path])
    assert result.exit_code in (0, 2)  # parsed and clean, or reported: never a traceback


def test_syncless_package_lints_clean() -> None:
    # ARCHITECTURE.md: `syncless lint` runs on syncless/ in CI.
    result = lint_paths([Path(syncless.__file__).parent])
    assert result.errors == []
    assert result.findings == [], "\n".join(
        f"{f.path}:{f.line}: {f.rule} {f.message}" for f in result.findings
    )


def test_docs_list_every_rule_and_hint() -> None:
    docs = (ROOT / "docs" / "lint.md").read_text(encoding="utf-8")
    for code, rule in RULES.items():
        assert f"| {code} |" in docs, code
        assert rule.hint in docs, code


def test_pre_commit_hook_entry() -> None:
    text = (ROOT / ".pre-commit-hooks.yaml").read_text(encoding="utf-8")
    assert "- id: syncless-lint" in text
    assert "entry: syncless lint" in text
    assert "language: python" in text
    assert "types: [python]" in text


def test_directive_outside_functions() -> None:
    [finding] = lint("x = 1  # syncless: ok\n")
    assert (finding.rule, finding.function, finding.col) == ("SL100", "<module>", 8)
