"""The distribution installs everything under the one ``weftboard`` namespace.

Bare top-level ``board``/``cuda`` packages would shadow Adafruit's ``board`` and NVIDIA's
``cuda`` namespace on real GPU hosts (DESIGN.md), so we build the wheel from a copy of the
source tree, install it into a fresh virtual environment and look at what landed.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SOURCE_ITEMS = ["pyproject.toml", "README.md", "LICENSE", "proto", "board", "publisher", "subscriber", "cuda"]
FORBIDDEN_TOP_LEVEL = {"board", "publisher", "subscriber", "cuda", "proto"}
PACKAGE_DIRS = {"proto": "weftboard.proto", "board": "weftboard.board", "publisher": "weftboard.publisher",
                "subscriber": "weftboard.subscriber", "cuda": "weftboard.cuda"}
# Every folder with an __init__.py under the fixed top-level folders is a subpackage the wheel must carry.
SUBPACKAGES = sorted(
    ".".join([name, *init.parent.relative_to(REPO / folder).parts])
    for folder, name in PACKAGE_DIRS.items()
    for init in (REPO / folder).rglob("__init__.py")
)


def _run(argv: list[str], cwd: Path, timeout: float = 120, env: dict[str, str] | None = None) -> str:
    result = subprocess.run(argv, cwd=cwd, capture_output=True, text=True, timeout=timeout, env=env)
    assert result.returncode == 0, f"{argv} failed ({result.returncode}):\n{result.stdout}\n{result.stderr}"
    return result.stdout


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Build the wheel from a copy of the tree (keeps build/ and egg-info out of the repo)."""
    src = tmp_path_factory.mktemp("src")
    for item in SOURCE_ITEMS:
        path = REPO / item
        if path.is_dir():
            shutil.copytree(path, src / item, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        elif path.exists():
            shutil.copy2(path, src / item)
    out = tmp_path_factory.mktemp("dist")
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", ".", "-w", str(out)],
         cwd=src, timeout=180)
    wheels = list(out.glob("weftboard-*.whl"))
    assert len(wheels) == 1, wheels
    return wheels[0]


def test_wheel_contents_live_under_the_namespace(wheel: Path) -> None:
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
        record = next(n for n in names if n.endswith(".dist-info/RECORD"))
        recorded = [line.split(",", 1)[0] for line in zf.read(record).decode().splitlines() if line]
    top_levels = {n.split("/", 1)[0] for n in recorded}
    assert top_levels - {"weftboard"} == {record.split("/", 1)[0]}, top_levels
    for package in SUBPACKAGES:
        assert f"{package.replace('.', '/')}/__init__.py" in names, package
    assert "weftboard/proto/weftboard/v1/board.proto" in names
    # `weftboard` itself is a namespace: no __init__.py that another distribution could clash on
    assert "weftboard/__init__.py" not in names


def _site_packages(python: Path | str, cwd: Path) -> Path:
    return Path(_run([str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"], cwd=cwd).strip())


def test_wheel_installs_into_a_fresh_venv(wheel: Path, tmp_path: Path) -> None:
    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", str(venv)], cwd=tmp_path)
    python = venv / "bin" / "python"
    # Reuse torch & co. from the environment running the tests instead of downloading them
    # again: a .pth line puts its site-packages after the new venv's own. (--system-site-packages
    # would show the base interpreter's packages, not those of a virtual environment the tests
    # run in.) The editable install's finder of this checkout is left out, so `weftboard`
    # can only come from the wheel.
    outer = _site_packages(sys.executable, tmp_path)
    site = _site_packages(python, tmp_path)
    (site / "outer-environment.pth").write_text(f"{outer}\n")
    _run([str(python), "-m", "pip", "install", "--no-deps", "--no-index", "-q", str(wheel)], cwd=tmp_path, timeout=180)

    installed = {p.name for p in site.iterdir()}
    assert "weftboard" in installed
    assert not (FORBIDDEN_TOP_LEVEL & installed), FORBIDDEN_TOP_LEVEL & installed

    probe = (
        "import importlib, importlib.util, json\n"
        f"mods = {SUBPACKAGES!r}\n"
        "files = {m: importlib.import_module(m).__file__ for m in mods}\n"
        f"bare = {{m: importlib.util.find_spec(m) is not None for m in {sorted(FORBIDDEN_TOP_LEVEL - {'cuda', 'board'})!r}}}\n"
        "print(json.dumps({'files': files, 'bare': bare}))\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    import json

    report = json.loads(_run([str(python), "-c", probe], cwd=tmp_path, env=env))
    for module, file in report["files"].items():
        assert file.startswith(str(site)), f"{module} imported from {file}, not from the wheel in {site}"
    assert not any(report["bare"].values()), report["bare"]

    # The console script is installed and runs.
    help_text = _run([str(venv / "bin" / "weftboard"), "--help"], cwd=tmp_path, env=env)
    assert "serve" in help_text


def test_editable_install_maps_the_source_folders(tmp_path: Path) -> None:
    """The development environment (pip install -e .) imports straight from the folders."""
    probe = (
        "import importlib, importlib.util, json\n"
        "print(json.dumps({'board': importlib.import_module('weftboard.board').__file__,"
        " 'cuda': importlib.import_module('weftboard.cuda').__file__,"
        " 'blobs': importlib.import_module('weftboard.board.blobs').__file__,"
        " 'bare_board': importlib.util.find_spec('board') is not None and"
        " str(importlib.util.find_spec('board').origin).startswith(" + repr(str(REPO)) + ")}))\n"
    )
    import json

    report = json.loads(_run([sys.executable, "-c", probe], cwd=tmp_path))
    assert report["board"] == str(REPO / "board" / "__init__.py")
    assert report["cuda"] == str(REPO / "cuda" / "__init__.py")
    assert report["blobs"] == str(REPO / "board" / "blobs" / "__init__.py")
    assert report["bare_board"] is False, "the repo's board/ folder is importable as a top-level module"
