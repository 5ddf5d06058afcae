"""The structure DESIGN.md describes holds in the code.

- the import-linter contracts in pyproject.toml (layers, product apart from benches, demo
  and commands, no import loops) pass;
- no module is over 600 lines (generated stubs excepted);
- fewer than 30 imports inside functions, each with a comment that says why (an optional
  dependency, ...);
- vulture finds no dead code in the product at 80% confidence;
- every file DESIGN.md names exists, and every subpackage is in the wheel's package list.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import tomllib

REPO = Path(__file__).resolve().parents[1]
PACKAGE_DIRS = {"proto": "weftboard.proto", "board": "weftboard.board", "publisher": "weftboard.publisher",
                "subscriber": "weftboard.subscriber", "cuda": "weftboard.cuda"}
GENERATED = REPO / "proto" / "v1"
MAX_MODULE_LINES = 600
# optional dependencies, plus one in each command's body that needs torch (the command line
# registers every command without it: ``board/cli.py``)
MAX_LOCAL_IMPORTS = 35


def _sources() -> list[Path]:
    files = []
    for folder in PACKAGE_DIRS:
        for path in sorted((REPO / folder).rglob("*.py")):
            if GENERATED not in path.parents:
                files.append(path)
    return files


def _local_imports(path: Path) -> list[tuple[int, str]]:
    """(line, source line) of every import statement inside a function body."""
    text = path.read_text()
    lines = text.splitlines()
    found = []

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            inside = in_function or isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef)
            if in_function and isinstance(child, ast.Import | ast.ImportFrom):
                found.append((child.lineno, lines[child.lineno - 1]))
            visit(child, inside)

    visit(ast.parse(text), False)
    return found


def test_import_contracts_hold() -> None:
    lint = Path(sys.executable).with_name("lint-imports")
    command = [str(lint)] if lint.exists() else ["lint-imports"]
    result = subprocess.run([*command, "--no-cache"], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, f"lint-imports found broken contracts:\n{result.stdout}{result.stderr}"
    assert "0 broken" in result.stdout, result.stdout


def test_no_module_over_600_lines() -> None:
    long = {str(p.relative_to(REPO)): n for p in _sources() if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES}
    assert not long, f"modules over {MAX_MODULE_LINES} lines: {long}"


def test_function_local_imports_are_few_and_explained() -> None:
    local = [(p, line, src) for p in _sources() for line, src in _local_imports(p)]
    unexplained = []
    for path, line, src in local:
        previous = path.read_text().splitlines()[line - 2].strip() if line > 1 else ""
        if "#" not in src and not previous.startswith("#"):
            unexplained.append(f"{path.relative_to(REPO)}:{line}: {src.strip()}")
    assert len(local) < MAX_LOCAL_IMPORTS, (
        f"{len(local)} imports inside functions (fewer than {MAX_LOCAL_IMPORTS} wanted):\n"
        + "\n".join(f"{p.relative_to(REPO)}:{n}: {s.strip()}" for p, n, s in local))
    assert not unexplained, "imports inside functions without a comment saying why:\n" + "\n".join(unexplained)


def test_no_dead_code_in_the_product() -> None:
    folders = list(PACKAGE_DIRS)
    result = subprocess.run([sys.executable, "-m", "vulture", "--min-confidence", "80", *folders,
                             "--exclude", "proto/v1"], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0 and not result.stdout.strip(), f"vulture found dead code:\n{result.stdout}{result.stderr}"


def test_design_names_files_that_exist() -> None:
    design = (REPO / "DESIGN.md").read_text()
    named = set(re.findall(r"`((?:proto|board|publisher|subscriber|cuda|tests|deploy)/[\w/.-]+\.(?:py|md|proto|sh|yml|yaml|json))`",
                           design))
    assert len(named) >= 20, f"DESIGN.md names only {len(named)} files; its paths should point at the code"
    missing = sorted(p for p in named if not (REPO / p).exists())
    assert not missing, f"DESIGN.md names files that do not exist: {missing}"
    assert (REPO / "LICENSE").read_text().startswith("Apache License"), "LICENSE does not match pyproject's Apache-2.0"


def test_every_subpackage_is_packaged() -> None:
    config = tomllib.loads((REPO / "pyproject.toml").read_text())
    listed = set(config["tool"]["setuptools"]["packages"])
    found = set()
    for folder, name in PACKAGE_DIRS.items():
        for init in (REPO / folder).rglob("__init__.py"):
            rel = init.parent.relative_to(REPO / folder)
            found.add(".".join([name, *rel.parts]))
    assert found == listed, f"missing from pyproject: {sorted(found - listed)}; listed but absent: {sorted(listed - found)}"
