"""Every Python block of the README and of the docs site runs: test files pass under pytest, the others
execute; the site builds in strict mode.

A block that is a test file (it defines ``test_*`` functions or uses the marker) is written to a
pytester project and must pass; any other block is executed in a fresh namespace. Blocks must be
self-contained: what a reader copies has to work as it stands.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]
_FENCE = re.compile(r"^```python\n(.*?)^```\s*$", re.DOTALL | re.MULTILINE)


def python_blocks(text: str) -> list[tuple[int, str]]:
    """(line number of the opening fence, code) of every ```python block."""
    return [(text.count("\n", 0, match.start()) + 1, match.group(1)) for match in _FENCE.finditer(text)]


def is_test_file(code: str) -> bool:
    return "def test_" in code or "@pytest.mark.attncost" in code


BLOCKS = [(page.relative_to(ROOT).as_posix(), line, code) for page in PAGES
          for line, code in python_blocks(page.read_text(encoding="utf-8"))]
TEST_FILES = [pytest.param(code, id=f"{page}:{line}") for page, line, code in BLOCKS if is_test_file(code)]
SNIPPETS = [pytest.param(line, code, id=f"{page}:{line}") for page, line, code in BLOCKS if not is_test_file(code)]


def test_the_pages_have_both_kinds_of_block() -> None:
    # a fence written differently (```py, ```Python) would silently drop its block from the checks below
    for page in PAGES:
        assert not re.search(r"^```(py|Python|python3)\s*$", page.read_text(encoding="utf-8"), re.MULTILINE), page
    assert len(PAGES) > 10 and len(TEST_FILES) >= 3 and len(SNIPPETS) >= 2


def test_the_readme_opens_with_the_two_commands_and_links_to_pages_that_exist() -> None:
    text = README.read_text(encoding="utf-8")
    fences = re.findall(r"^```(\w*)\n(.*?)^```", text, re.DOTALL | re.MULTILINE)
    assert [lang for lang, _ in fences[:2]] == ["bash", "bash"]
    assert fences[0][1].rstrip().endswith("pytest examples --attncost-report")
    assert fences[1][1].rstrip().endswith("pytest tests -n 2")
    links = re.findall(r"\]\((docs/[^)#]+)", text)
    assert links and [link for link in links if not (ROOT / link).is_file()] == []
    assert "mkdocs build" in text  # the site's one command


def _extras(names: list[str], table: dict[str, list[str]]) -> list[str]:
    """The requirements extras *names* pull in, the package's own extras (``pytest-attncost[zoo]``) expanded."""
    found = []
    for name in names:
        for requirement in table[name]:
            inner = re.fullmatch(r"pytest-attncost\[([\w,-]+)\]", requirement)
            found += _extras(inner.group(1).split(","), table) if inner else [requirement]
    return found


def test_the_first_command_installs_what_the_examples_import_and_not_the_zoo_or_docs() -> None:
    import tomllib

    first = re.search(r"^```bash\n(.*?)^```", README.read_text(encoding="utf-8"), re.DOTALL | re.MULTILINE)
    assert first is not None
    extras = re.findall(r"pip install -e '\.\[([\w,-]+)\]'", first.group(1))
    assert len(extras) == 1
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    table = project["optional-dependencies"]
    installed = _extras(extras[0].split(","), table)
    heavy = _extras(["zoo", "docs"], table)
    assert installed and not set(installed) & set(heavy), installed
    names = {re.split(r"[\[<>=!~ ]", r)[0].lower() for r in [*installed, *project["dependencies"]]}
    local = {path.stem for path in (ROOT / "examples").glob("*.py")}
    imported = {match.split(".")[0] for path in (ROOT / "examples").glob("*.py")
                for match in re.findall(r"^(?:from|import) ([\w.]+)", path.read_text(encoding="utf-8"), re.MULTILINE)}
    missing = imported - local - set(sys.stdlib_module_names) - {"pytest_attncost", "__future__"} - names
    assert missing == set(), f"examples/ imports {missing}, which the first command does not install"


def test_the_examples_that_time_forwards_or_profile_hundreds_of_steps_are_marked_slow() -> None:
    # the first command's few seconds hold while its examples count on the meta device: a timed real forward
    # (measure()) or a loop of profiles belongs to the full run, behind @pytest.mark.slow
    unmarked = []
    for path in sorted((ROOT / "examples").glob("test_*.py")):
        for block in re.split(r"\n\n+(?=@|def )", path.read_text(encoding="utf-8")):
            heavy = ".measure(" in block or re.search(r"profile\(.*for \w+ in range\(", block)
            if heavy and block.startswith(("@", "def test_")) and "@pytest.mark.slow" not in block:
                unmarked.append(f"{path.name}: {block.splitlines()[0]}")
    assert unmarked == []


#: Fences of what a reader copies (program output, ```console and bare fences, is shown as the program prints it).
_CODE_FENCE = re.compile(r"^```(python|bash|sh|yaml|toml|ini)\n(.*?)^```", re.DOTALL | re.MULTILINE)
THEME_WIDTH = 88  # the columns the docs theme shows without a scroll bar


def test_the_code_blocks_fit_the_theme_and_long_pages_have_headings() -> None:
    too_wide, headless = [], []
    for page in PAGES:
        text = page.read_text(encoding="utf-8")
        for number, match in enumerate(_CODE_FENCE.finditer(text)):
            if page == README and number < 2:
                continue  # the two commands a fresh clone pastes, each on one line
            first = text.count("\n", 0, match.start()) + 2
            too_wide += [f"{page.name}:{first + i}: {len(line)} columns"
                         for i, line in enumerate(match.group(2).splitlines()) if len(line) > THEME_WIDTH]
        if text.count("\n") > 40 and not re.search(r"^## ", text, re.MULTILINE):
            headless.append(page.name)  # its table of contents would be empty
    assert too_wide == [] and headless == []


def test_split_page_draws_the_split() -> None:
    text = (ROOT / "docs" / "split.md").read_text(encoding="utf-8")
    drawing = text[text.index("## The data flow, drawn"):text.index("## The rule")]
    assert all(word in drawing for word in ("Q = x·Wq", "K = x·Wk", "V = x·Wv", "S = Q·Kᵀ", "A = S·V", "O = A·Wo",
                                            "FFN", "attention_proj", "attention_core", "ffn", "other"))


def test_the_docs_site_builds_in_strict_mode(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-q", "-d", str(tmp_path / "site")],
                          cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert done.returncode == 0, done.stderr
    reference = (tmp_path / "site" / "reference" / "index.html").read_text(encoding="utf-8")
    assert reference.count("Count one forward") >= 1
    text = re.sub(r"\s+", " ", re.sub(r"<[^>]+>", " ", reference))
    # the docstrings' Sphinx roles render as code (docs/griffe_roles.py), never raw
    assert re.findall(r":(?:class|func|meth|attr|mod|data|exc):", text) == []
    # Returns sections are "Type | Description", the type from the annotation, never a word of the sentence
    assert "Returns: Type Description Profile The count" in text and "Returns: Name Type" not in text


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
    exec(compile(code, f"page:{line}", "exec"), namespace)  # noqa: S102 - our own pages


def test_every_fixture_option_and_ini_key_is_in_the_docs(pytestconfig: pytest.Config) -> None:
    # a name the plugin's messages may send a user to (attncost_n, --attncost-lock-timeout) must be findable
    from pytest_attncost import plugin

    text = "".join(page.read_text(encoding="utf-8") for page in PAGES)
    fixtures = [name for name in plugin.__all__ if name.startswith("attncost")]
    parser = pytestconfig._parser  # noqa: SLF001 - pytest keeps its registered options here only
    options = [name for group in parser._groups for option in group.options  # noqa: SLF001
               for name in option.names() if name.startswith("--attncost")]
    keys = [name for name in parser._inidict if name.startswith("attncost")]  # noqa: SLF001
    assert fixtures and options and keys
    assert [name for name in [*fixtures, *options, *keys] if f"`{name}" not in text] == []
