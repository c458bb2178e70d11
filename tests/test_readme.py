"""Every Python block of the README runs: test files pass under pytest, the others execute.

A block that is a test file (it defines ``test_*`` functions or uses the marker) is written to a
pytester project and must pass; any other block is executed in a fresh namespace. Blocks must be
self-contained: what a reader copies has to work as it stands.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parent.parent / "README.md"
_FENCE = re.compile(r"^```python\n(.*?)^```\s*$", re.DOTALL | re.MULTILINE)


def python_blocks(text: str) -> list[tuple[int, str]]:
    """(line number of the opening fence, code) of every ```python block."""
    return [(text.count("\n", 0, match.start()) + 1, match.group(1)) for match in _FENCE.finditer(text)]


def is_test_file(code: str) -> bool:
    return "def test_" in code or "@pytest.mark.attncost" in code


BLOCKS = python_blocks(README.read_text(encoding="utf-8"))
TEST_FILES = [pytest.param(code, id=f"README.md:{line}") for line, code in BLOCKS if is_test_file(code)]
SNIPPETS = [pytest.param(line, code, id=f"README.md:{line}") for line, code in BLOCKS if not is_test_file(code)]


def test_the_readme_has_both_kinds_of_block() -> None:
    # a fence written differently (```py, ```Python) would silently drop its block from the checks below
    assert not re.search(r"^```(py|Python|python3)\s*$", README.read_text(encoding="utf-8"), re.MULTILINE)
    assert len(TEST_FILES) >= 3 and len(SNIPPETS) >= 2


@pytest.mark.parametrize("code", TEST_FILES)
def test_readme_test_file_passes(code: str, pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_readme_block=code)
    result = pytester.runpytest("-p", "no:randomly", "-p", "no:cacheprovider")
    outcomes = result.parseoutcomes()
    assert result.ret == 0, result.stdout.str()
    assert outcomes.get("passed", 0) >= 1 and not outcomes.get("failed") and not outcomes.get("skipped")


@pytest.mark.parametrize(("line", "code"), SNIPPETS)
def test_readme_snippet_runs(line: int, code: str) -> None:
    namespace: dict[str, object] = {"__name__": f"readme_block_{line}"}
    exec(compile(code, f"{README}:{line}", "exec"), namespace)  # noqa: S102 - our own README


def test_every_fixture_option_and_ini_key_is_in_the_readme(pytestconfig: pytest.Config) -> None:
    # a name the plugin's messages may send a user to (attncost_n, --attncost-lock-timeout) must be findable
    from pytest_attncost import plugin

    text = README.read_text(encoding="utf-8")
    fixtures = [name for name in plugin.__all__ if name.startswith("attncost")]
    parser = pytestconfig._parser  # noqa: SLF001 - pytest keeps its registered options here only
    options = [name for group in parser._groups for option in group.options  # noqa: SLF001
               for name in option.names() if name.startswith("--attncost")]
    keys = [name for name in parser._inidict if name.startswith("attncost")]  # noqa: SLF001
    assert fixtures and options and keys
    assert [name for name in [*fixtures, *options, *keys] if f"`{name}" not in text] == []
