"""The committed gRPC stubs match proto/weftboard/v1/*.proto (regenerate with python -m
weftboard.proto.generate), whatever grpcio-tools release renders them, and the runtime floors
they check at import are what pyproject.toml asks for."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import tomllib

from weftboard.proto import generate

PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"


def test_stubs_are_not_stale():
    result = subprocess.run(
        [sys.executable, "-m", "weftboard.proto.generate", "--check"], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr + result.stdout
    assert "up to date" in result.stdout


def test_the_check_ignores_version_stamps_but_not_code():
    rendered = generate.render()
    grpc_stub = rendered["board_pb2_grpc.py"]
    restamped = re.sub(r"GRPC_GENERATED_VERSION = '[^']*'", "GRPC_GENERATED_VERSION = '9.99.9'", grpc_stub)
    assert restamped != grpc_stub
    assert generate.unstamped(restamped) == generate.unstamped(grpc_stub)
    pb2 = rendered["board_pb2.py"]
    restamped = re.sub(r"(Domain\.PUBLIC,\s*)\d+,", r"\g<1>99,", re.sub(r"Version: \S+", "Version: 99.0.0", pb2))
    assert restamped != pb2
    assert generate.unstamped(restamped) == generate.unstamped(pb2)
    edited = grpc_stub.replace("def ", "def renamed_", 1)
    assert generate.unstamped(edited) != generate.unstamped(grpc_stub)


def _floor(requirements: list[str], package: str) -> tuple[int, ...]:
    (spec,) = [r for r in requirements if re.fullmatch(rf"{re.escape(package)}\s*>=.*", r)]
    return tuple(int(p) for p in re.search(r">=\s*([\d.]+)", spec).group(1).split("."))


def test_declared_floors_cover_what_the_stubs_require():
    """An install the stubs would refuse at import (grpcio or protobuf older than the stubs'
    stamps) must not satisfy pyproject.toml."""
    project = tomllib.loads(PYPROJECT.read_text())["project"]
    stamps = {k: tuple(int(p) for p in v.split(".")) for k, v in generate.committed_stamps().items()}
    deps = project["dependencies"]
    for package in ("grpcio", "grpcio-health-checking", "grpcio-reflection"):
        assert _floor(deps, package) >= stamps["grpcio"], package
    assert _floor(deps, "protobuf") >= stamps["protobuf"]
    assert _floor(project["optional-dependencies"]["test"], "grpcio-tools") >= stamps["grpcio"]
