"""deploy/ stays consistent with the real CLI, settings and metrics.

Every ``WEFTBOARD_*`` variable a deploy file sets must be one the code reads; every flag it
passes must exist; the README's settings table must list exactly ``BoardSettings``; and
every metric the Grafana dashboard queries must be exported by a running board.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import urllib.request
from pathlib import Path

import pytest
import typer
import yaml
from boardkit import make_run, publish

from weftboard.board.cli import build_app
from weftboard.board.client import BoardClient
from weftboard.board.config import BoardSettings
from weftboard.proto.v1 import board_pb2 as pb

DEPLOY = Path(__file__).resolve().parents[1] / "deploy"
TEXT_FILES = [p for p in DEPLOY.rglob("*") if p.is_file()]


def _cli():
    """The click-level command tree typer builds (typer ships its own click core)."""
    return typer.main.get_command(build_app())


def _commands(group, prefix: str = "") -> dict:
    out: dict = {}
    for name, command in group.commands.items():
        full = f"{prefix}{name}"
        out[full] = command
        if getattr(command, "commands", None):
            out.update(_commands(command, full + " "))
    return out


def _known_env_vars() -> set[str]:
    names = {f"WEFTBOARD_{field.upper()}" for field in BoardSettings.model_fields}
    for command in _commands(_cli()).values():
        for param in command.params:
            envvar = getattr(param, "envvar", None)
            if isinstance(envvar, str):
                names.add(envvar)
            elif envvar:
                names.update(envvar)
    return names


def test_deploy_files_parse() -> None:
    yaml_files = [p for p in TEXT_FILES if p.suffix in (".yml", ".yaml")]
    assert len(yaml_files) >= 8
    for path in yaml_files:
        docs = list(yaml.safe_load_all(path.read_text()))
        assert docs and all(d is not None for d in docs), path
    compose = yaml.safe_load((DEPLOY / "docker-compose.yml").read_text())
    assert {"redis", "minio", "board", "island"} <= set(compose["services"])
    dashboard = json.loads((DEPLOY / "grafana" / "weftboard-board.json").read_text())
    assert dashboard["panels"] and all(p["targets"] for p in dashboard["panels"])


def test_every_weftboard_variable_is_read_by_the_code() -> None:
    known = _known_env_vars()
    used: dict[str, set[str]] = {}
    for path in TEXT_FILES:
        for name in re.findall(r"\bWEFTBOARD_[A-Z0-9_]+\b", path.read_text()):
            used.setdefault(name, set()).add(path.name)
    unknown = {name: files for name, files in used.items() if name not in known}
    assert not unknown, f"deploy files set variables no command reads: {unknown}"
    assert "WEFTBOARD_REDIS_URL" in used and "WEFTBOARD_ADMIN_TOKEN" in used


def test_every_flag_in_deploy_files_exists() -> None:
    commands = _commands(_cli())
    flags = {name: {opt for p in cmd.params for opt in (*p.opts, *p.secondary_opts)} for name, cmd in commands.items()}
    invocations: list[tuple[str, list[str]]] = []
    for path in TEXT_FILES:
        text = path.read_text()
        for match in re.finditer(r"weftboard ((?:token )?[a-z]+)\b([^|&\n]*)", text):
            invocations.append((match.group(1), re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", match.group(2))))
    compose = yaml.safe_load((DEPLOY / "docker-compose.yml").read_text())
    board_cmd = compose["services"]["board"]["command"]
    invocations.append((board_cmd[0], [a for a in board_cmd[1:] if a.startswith("--")]))
    for doc in yaml.safe_load_all((DEPLOY / "k8s" / "board.yaml").read_text()):
        if doc["kind"] == "Deployment":
            args = doc["spec"]["template"]["spec"]["containers"][0]["args"]
            invocations.append((args[0], [a for a in args[1:] if a.startswith("--")]))
    checked = 0
    for command, opts in invocations:
        if command not in commands:
            continue  # prose such as "weftboard board" in comments
        for opt in opts:
            assert opt in flags[command], f"'weftboard {command} {opt}' in deploy/ is not a real flag"
            checked += 1
    assert checked >= 5
    assert any(cmd == "serve" for cmd, _ in invocations) and any(cmd == "subscribe" for cmd, _ in invocations)


def test_readme_settings_table_matches_board_settings() -> None:
    readme = (DEPLOY / "README.md").read_text()
    section = readme.split("## Board settings", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| `(WEFTBOARD_[A-Z0-9_]+)` \| ([^|]*)\|", section, flags=re.M)
    listed = {name for name, _ in rows}
    expected = {f"WEFTBOARD_{field.upper()}" for field in BoardSettings.model_fields}
    assert listed == expected, f"missing {expected - listed}, extra {listed - expected}"
    serve_flags = {opt for p in _commands(_cli())["serve"].params for opt in (*p.opts, *p.secondary_opts)}
    for name, flag_cell in rows:
        for flag in re.findall(r"--[a-z0-9-]+", flag_cell):
            assert flag in serve_flags, f"README lists {flag} for {name}, but serve has no such flag"


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl is not installed")
def test_kustomization_builds() -> None:
    result = subprocess.run(["kubectl", "kustomize", str(DEPLOY / "k8s")], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    kinds = re.findall(r"^kind: (\w+)", result.stdout, flags=re.M)
    assert {"Deployment", "Service", "ConfigMap", "Secret", "StatefulSet"} <= set(kinds)


async def test_dashboard_metrics_are_exported_by_a_board(board_factory, local_store) -> None:
    board = await board_factory(blobs=local_store, metrics_port=0)
    async with BoardClient(board.address, board.admin_token) as client:
        await client.create_run(make_run("dash"))
        await publish(client, local_store, "dash", [1, 2])
        await client.heartbeat(pb.IslandStatus(island_id="i1", run="dash", version=2, state=pb.ISLAND_STATE_READY), lease_s=30)
        await client.list_islands("dash")
        await client.report_trajectories([pb.TrajectoryRecord(run="dash", island_id="i1", version=2, request_id="r")])
        stream = client.watch("dash").__aiter__()
        await stream.__anext__()
        port = board.handle.metrics_port
        exposition = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
        await stream.aclose()
    exported = set(re.findall(r"^(weftboard_[a-z_]+)", exposition, flags=re.M))
    dashboard = (DEPLOY / "grafana" / "weftboard-board.json").read_text()
    queried = set(re.findall(r"\b(weftboard_[a-z_]+)", dashboard)) - {"weftboard_board"}
    assert queried, "the dashboard queries no weftboard metric"
    missing = queried - exported
    assert not missing, f"dashboard queries metrics the board does not export: {missing}"
    readme_metrics = set(re.findall(r"^\| `(weftboard_[a-z_]+)`", (DEPLOY / "README.md").read_text(), flags=re.M))
    assert readme_metrics, "deploy/README.md lists no metrics"
    families = {re.sub(r"_(bucket|sum|count|created)$", "", m) for m in exported}
    assert readme_metrics <= families | exported, readme_metrics - families - exported


def test_every_island_keeps_its_compiled_kernels_on_persistent_storage() -> None:
    """An island compiles the codec's kernels on first use: each deployment points
    NUMBA_CACHE_DIR into the island's own persistent, writable path, so a restart loads them
    (and a sandboxed or read-only install has somewhere to write them at all)."""
    k8s = next(d for d in yaml.safe_load_all((DEPLOY / "k8s" / "island.yaml").read_text()) if d["kind"] == "StatefulSet")
    (container,) = k8s["spec"]["template"]["spec"]["containers"]
    env = {e["name"]: e.get("value") for e in container["env"]}
    mounts = [m["mountPath"] for m in container["volumeMounts"]]
    assert any(env["NUMBA_CACHE_DIR"].startswith(m + "/") for m in mounts), (env["NUMBA_CACHE_DIR"], mounts)

    island = yaml.safe_load((DEPLOY / "docker-compose.yml").read_text())["services"]["island"]
    volumes = [v.split(":")[1] for v in island["volumes"] if not v.endswith(":ro")]
    assert any(island["environment"]["NUMBA_CACHE_DIR"].startswith(v + "/") for v in volumes)

    unit = (DEPLOY / "systemd" / "weftboard-island@.service").read_text()
    (cache,) = re.findall(r"^Environment=NUMBA_CACHE_DIR=(\S+)$", unit, re.M)
    (writable,) = re.findall(r"^ReadWritePaths=(\S+)$", unit, re.M)
    assert cache.startswith(writable + "/")
