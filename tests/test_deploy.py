"""deploy/ stays consistent with the real CLI, settings and metrics, and would pass a review.

Every ``WEFTBOARD_*`` variable a deploy file sets must be one the code reads; every flag it
passes must exist; the README's settings table must list exactly ``BoardSettings``; and
every metric a Grafana dashboard queries must be one the code exports (the board's by a running
board; the islands' and publishers' by their metric definitions). Beyond that:
- Kubernetes: every container has readiness and liveness probes, CPU/memory requests and a
  memory limit, and a restricted security context (non-root, read-only root with writable
  mounts where it writes, no privilege escalation, no capabilities, RuntimeDefault seccomp);
  the island pod runs the vLLM engine beside the sidecar, its probes hit endpoints the
  sidecar and the engine really serve, and no Service exposes the engine's port.
- Compose: a trainer and an engine beside board, Redis, MinIO and the island; healthchecks
  and ``depends_on`` conditions; MinIO's S3 port published; volumes owned by the image's user.
- Grafana: per-run gauges combined across board replicas (and islands) with ``max``, counters
  with ``sum(rate(...))``; every dashboard is provisioned in compose, and Prometheus scrapes the
  island's sidecar where it listens.
- systemd: units that ``systemd-analyze verify`` accepts, hardened, restarting on failure but
  not on the exit codes of a refused token or a usage error (checked against the commands).
"""

from __future__ import annotations

import asyncio
import configparser
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import typer
import yaml
from boardkit import make_run, publish
from pubsubkit import run_cli

from weftboard.board.cli import build_app
from weftboard.board.client import BoardClient
from weftboard.board.config import BoardSettings
from weftboard.proto.v1 import board_pb2 as pb

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
TEXT_FILES = [p for p in DEPLOY.rglob("*") if p.is_file()]
DASHBOARDS = sorted((DEPLOY / "grafana").glob("*.json"))


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
    for path in DASHBOARDS:
        dashboard = json.loads(path.read_text())
        assert dashboard["panels"] and all(p["targets"] for p in dashboard["panels"]), path.name


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
    sidecars = [_command_text(compose["services"]["island"]), _island_pod()[1]["args"][0]]
    invocations += [("sidecar", [a for a in _sidecar_argv(text) if a.startswith("--")]) for text in sidecars]
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
    assert {"Deployment", "Service", "ConfigMap", "Secret", "StatefulSet", "NetworkPolicy",
            "PodDisruptionBudget", "Namespace"} <= set(kinds)
    assert "image: vllm/vllm-openai:" in result.stdout and "image: weftboard:" in result.stdout


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
    # the board's rows against what a running board exported; every row against the definitions,
    # and every island and publisher metric has its row
    board_rows = {m for m in readme_metrics if not m.startswith(("weftboard_island_", "weftboard_publisher_"))}
    assert board_rows <= families | exported, board_rows - families - exported
    defined = _families(_metric_kinds())
    assert readme_metrics <= defined, readme_metrics - defined
    others = {m for m in defined if m.startswith(("weftboard_island_", "weftboard_publisher_"))}
    assert others <= readme_metrics, f"deploy/README.md leaves out {others - readme_metrics}"


# ---------------------------------------------------------------------------
# The image and its user
# ---------------------------------------------------------------------------


def _image_user() -> tuple[int, int]:
    """The uid and gid the Dockerfile runs as, checked against the user it creates."""
    text = (DEPLOY / "Dockerfile").read_text()
    (user,) = re.findall(r"^USER (\d+):(\d+)\s*$", text, flags=re.M)
    uid, gid = int(user[0]), int(user[1])
    assert re.search(rf"groupadd [^\n]*--gid {gid}\b", text), "the Dockerfile's group has another gid than USER"
    assert re.search(rf"useradd [^\n]*--uid {uid}\b[^\n]*", text), "the Dockerfile's user has another uid than USER"
    assert uid >= 1000 and gid >= 1000, "the image must run as an unprivileged user"
    return uid, gid


def test_dockerfile_copies_every_package_and_runs_as_its_own_user() -> None:
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    text = (DEPLOY / "Dockerfile").read_text()
    _image_user()
    copied = set(re.findall(r"^COPY (\S+) \1\s*$", text, flags=re.M))
    package_dirs = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"].values())
    assert package_dirs <= copied, f"the image leaves out {package_dirs - copied}"
    ignore = (DEPLOY / "Dockerfile.dockerignore").read_text()
    assert all(f"!{d}" in ignore.split() for d in package_dirs), "Dockerfile.dockerignore leaves out a package"


# ---------------------------------------------------------------------------
# Kubernetes
# ---------------------------------------------------------------------------

K8S = DEPLOY / "k8s"
WRITABLE_ENV = ("NUMBA_CACHE_DIR", "WEFTBOARD_DIR", "HOME", "XDG_CACHE_HOME", "HF_HOME", "VLLM_CACHE_ROOT",
                "TRITON_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR")


def _k8s_docs() -> list[dict]:
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    files = sorted(p.name for p in K8S.glob("*.yaml") if p.name != "kustomization.yaml")
    assert sorted(kustomization["resources"]) == files, "every manifest is in the kustomization, and only those"
    return [d for name in files for d in yaml.safe_load_all((K8S / name).read_text())]


def _workloads() -> list[dict]:
    return [d for d in _k8s_docs() if d["kind"] in ("Deployment", "StatefulSet", "DaemonSet", "Job")]


def _all_containers(pod: dict) -> list[dict]:
    return [*pod.get("initContainers", []), *pod["containers"]]


def _island_pod() -> tuple[dict, dict, dict]:
    """The island StatefulSet's pod spec, its sidecar container and its engine container."""
    (sts,) = [d for d in yaml.safe_load_all((K8S / "island.yaml").read_text()) if d["kind"] == "StatefulSet"]
    pod = sts["spec"]["template"]["spec"]
    (engine,) = [c for c in pod["containers"] if "vllm.entrypoints.openai.api_server" in c.get("command", [])]
    (sidecar,) = [c for c in pod["containers"] if "weftboard sidecar" in " ".join(c.get("args", []))]
    return pod, sidecar, engine


def _flag(args: list[str], name: str) -> str:
    return args[args.index(name) + 1]


def _sidecar_argv(script: str) -> list[str]:
    (line,) = [ln for ln in script.splitlines() if re.search(r"\bweftboard sidecar\b", ln)]
    argv = shlex.split(line.split("weftboard sidecar", 1)[1])
    assert all(not a.startswith("$") for a in argv), argv
    return argv


def test_every_kubernetes_container_has_probes_resources_and_a_restricted_security_context() -> None:
    uid, gid = _image_user()
    namespace = next(d for d in _k8s_docs() if d["kind"] == "Namespace")
    assert namespace["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "restricted"
    workloads = _workloads()
    assert {w["metadata"]["name"] for w in workloads} >= {"weftboard-board", "weftboard-island", "weftboard-redis"}
    checked = 0
    for workload in workloads:
        name = workload["metadata"]["name"]
        pod = workload["spec"]["template"]["spec"]
        pod_sc = pod.get("securityContext", {})
        assert pod.get("automountServiceAccountToken") is False, f"{name}: mounts a service account token"
        assert pod_sc.get("seccompProfile", {}).get("type") == "RuntimeDefault", name
        volumes = {v["name"]: v for v in pod.get("volumes", [])}
        volumes.update({t["metadata"]["name"]: {"pvc": True} for t in workload["spec"].get("volumeClaimTemplates", [])})
        if any(c["image"] == "weftboard" for c in pod["containers"]):
            assert (pod_sc.get("runAsUser"), pod_sc.get("runAsGroup"), pod_sc.get("fsGroup")) == (uid, gid, gid), (
                f"{name}: runs as another user than the image's {uid}:{gid}")
        for c in _all_containers(pod):
            where = f"{name}/{c['name']}"
            sc = c.get("securityContext", {})
            assert sc.get("runAsNonRoot", pod_sc.get("runAsNonRoot")) is True, where
            assert sc.get("allowPrivilegeEscalation") is False, where
            assert sc.get("readOnlyRootFilesystem") is True, where
            assert sc.get("capabilities", {}).get("drop") == ["ALL"] and not sc["capabilities"].get("add"), where
            assert sc.get("seccompProfile", pod_sc.get("seccompProfile", {})).get("type") == "RuntimeDefault", where
            assert not sc.get("privileged"), where
            for probe in ("readinessProbe", "livenessProbe"):
                assert probe in c, f"{where} has no {probe}"
            resources = c.get("resources", {})
            assert {"cpu", "memory"} <= set(resources.get("requests", {})), f"{where}: no cpu/memory requests"
            assert "memory" in resources.get("limits", {}), f"{where}: no memory limit"
            # A read-only root: every place the container is told to write is a writable mount.
            mounts = {m["mountPath"]: m for m in c.get("volumeMounts", [])}
            for mount in mounts.values():
                assert mount["name"] in volumes, f"{where}: mounts an undeclared volume {mount['name']}"
            env = {e["name"]: e.get("value") for e in c.get("env", [])}
            for var in WRITABLE_ENV:
                if env.get(var):
                    assert any(env[var] == p or env[var].startswith(p.rstrip("/") + "/")
                               for p, m in mounts.items() if not m.get("readOnly")), (
                        f"{where}: {var}={env[var]} is not on a writable mount (the root file system is read-only)")
            if c["image"] == "weftboard":
                assert "/tmp" in mounts and not mounts["/tmp"].get("readOnly"), f"{where}: no writable /tmp"
            checked += 1
    assert checked >= 4


def test_island_pod_runs_the_engine_beside_the_sidecar_and_the_service_exposes_only_the_sidecar() -> None:
    pod, sidecar, engine = _island_pod()
    assert len(pod["containers"]) == 2
    engine_port = int(_flag(engine["args"], "--port"))
    assert _flag(engine["args"], "--host") == "127.0.0.1", "the engine's admin endpoints must stay inside the pod"
    assert not engine.get("ports"), "the engine declares a container port"
    env = {e["name"]: e.get("value") for e in engine["env"]}
    assert env["VLLM_SERVER_DEV_MODE"] == "1", "the vLLM adapter needs /pause, /resume and /collective_rpc"
    assert "nvidia.com/gpu" in engine["resources"]["limits"]

    argv = _sidecar_argv(sidecar["args"][0])
    assert _flag(argv, "--engine") == "vllm"
    assert _flag(argv, "--engine-url") == f"http://127.0.0.1:{engine_port}"
    listen_port = int(_flag(argv, "--listen").rpartition(":")[2])
    sidecar_ports = {p["name"]: p["containerPort"] for p in sidecar["ports"]}
    assert listen_port in sidecar_ports.values()

    # The engine reads the checkpoints the sidecar writes, read-only, at the same path (the
    # sidecar names the folder to reload by its own path).
    sidecar_env = {e["name"]: e.get("value") for e in sidecar["env"]}
    island_dir = sidecar_env["WEFTBOARD_DIR"]
    (island_mount,) = [m for m in sidecar["volumeMounts"] if m["mountPath"] == island_dir]
    (engine_view,) = [m for m in engine["volumeMounts"] if m["name"] == island_mount["name"]]
    assert engine_view["mountPath"] == island_dir and engine_view["readOnly"] is True
    assert not island_mount.get("readOnly")
    assert sidecar_env["NUMBA_CACHE_DIR"].startswith(island_dir + "/")

    services = [d for d in yaml.safe_load_all((K8S / "island.yaml").read_text()) if d["kind"] == "Service"]
    (sts,) = [d for d in yaml.safe_load_all((K8S / "island.yaml").read_text()) if d["kind"] == "StatefulSet"]
    pod_labels = sts["spec"]["template"]["metadata"]["labels"]
    assert sts["spec"]["serviceName"] in {s["metadata"]["name"] for s in services}
    assert len(services) >= 1
    for service in services:
        assert service["spec"]["selector"].items() <= pod_labels.items()
        for port in service["spec"]["ports"]:
            target = port.get("targetPort", port["port"])
            resolved = sidecar_ports.get(target, target)
            assert engine_port not in (port["port"], resolved), f"Service {service['metadata']['name']} exposes the engine"
            assert resolved == listen_port, f"Service {service['metadata']['name']} targets {target}, not the sidecar"


async def test_island_probes_use_endpoints_the_sidecar_and_the_engine_really_serve() -> None:
    """The sidecar's probes name routes ``Sidecar.app`` serves, and they mean what the probes
    need: liveness 200 on a fresh island, readiness 503 until it serves a version, then 200.
    The engine's probe asks vLLM for the path the vLLM adapter checks its health on."""
    from weftboard.subscriber.admission import AdmissionGate, VersionState
    from weftboard.subscriber.engines.factory import make_adapter
    from weftboard.subscriber.sidecar import Sidecar, SidecarConfig

    pod, sidecar_c, engine = _island_pod()
    listen_port = int(_flag(_sidecar_argv(sidecar_c["args"][0]), "--listen").rpartition(":")[2])
    ports = {p["name"]: p["containerPort"] for p in sidecar_c["ports"]}
    paths = {}
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        get = sidecar_c[probe]["httpGet"]
        assert ports.get(get["port"], get["port"]) == listen_port, probe
        paths[probe] = get["path"]

    state = VersionState()
    sidecar = Sidecar(SidecarConfig("http://127.0.0.1:9", "r", "island"), state, AdmissionGate())
    base = await sidecar.start()
    try:
        def status(path: str) -> int:
            try:
                with urllib.request.urlopen(base + path, timeout=5) as response:
                    return response.status
            except urllib.error.HTTPError as exc:
                return exc.code

        assert await asyncio.to_thread(status, paths["livenessProbe"]) == 200
        assert await asyncio.to_thread(status, paths["startupProbe"]) == 200
        assert await asyncio.to_thread(status, paths["readinessProbe"]) == 503  # holds no version yet
        await state.set_held(1)
        assert await asyncio.to_thread(status, paths["readinessProbe"]) == 200
        await state.set_error("activation failed")
        assert await asyncio.to_thread(status, paths["readinessProbe"]) == 503
        assert await asyncio.to_thread(status, paths["livenessProbe"]) == 200  # in error, but alive
        assert await asyncio.to_thread(status, "/no/such/path") == 404
    finally:
        await sidecar.stop()

    asked: list[tuple[str, str]] = []
    adapter = make_adapter("vllm", "http://127.0.0.1:9")

    async def call(method: str, path: str, **_: object) -> dict:
        asked.append((method, path))
        return {}

    adapter.call = call  # type: ignore[method-assign]
    assert await adapter.health()
    await adapter.close()
    ((method, health_path),) = asked
    assert method == "GET"
    engine_port = int(_flag(engine["args"], "--port"))
    url = f"http://127.0.0.1:{engine_port}{health_path}"
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        command = " ".join(engine[probe]["exec"]["command"])
        assert f"'{url}'" in command, (probe, command)
    assert url in sidecar_c["args"][0], "the sidecar's start does not wait for the engine's health"


def test_board_and_redis_probe_what_they_should() -> None:
    docs = _k8s_docs()
    (board,) = [d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] == "weftboard-board"]
    (c,) = board["spec"]["template"]["spec"]["containers"]
    config = next(d for d in docs if d["kind"] == "ConfigMap")
    grpc_port = int(config["data"]["WEFTBOARD_LISTEN"].rpartition(":")[2])
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert c["readinessProbe"]["grpc"]["port"] == grpc_port and c["startupProbe"]["grpc"]["port"] == grpc_port
    # gRPC health follows Redis: liveness on it would restart every board during a Redis outage.
    assert "grpc" not in c["livenessProbe"]
    assert ports.get(c["livenessProbe"]["tcpSocket"]["port"], c["livenessProbe"]["tcpSocket"]["port"]) == grpc_port
    assert any(d["kind"] == "PodDisruptionBudget" for d in docs) and board["spec"]["replicas"] >= 2
    # Every Service targets a port some selected container declares.
    pods = [(w["spec"]["template"]["metadata"]["labels"], w["spec"]["template"]["spec"]) for w in _workloads()]
    for service in (d for d in docs if d["kind"] == "Service"):
        selected = [spec for labels, spec in pods if service["spec"]["selector"].items() <= labels.items()]
        assert selected, f"Service {service['metadata']['name']} selects no pod"
        declared = {p.get("name"): p["containerPort"] for spec in selected for c in spec["containers"]
                    for p in c.get("ports", [])}
        for port in service["spec"]["ports"]:
            target = port.get("targetPort", port["port"])
            assert target in declared or target in declared.values(), (service["metadata"]["name"], target)
    redis_policy = [d for d in docs if d["kind"] == "NetworkPolicy" and "redis" in d["metadata"]["name"]]
    assert redis_policy, "the password-less Redis is open to every pod"


# ---------------------------------------------------------------------------
# Docker Compose
# ---------------------------------------------------------------------------

ONE_SHOT = {"volume-init", "tokens", "trainer"}  # batch jobs: their exit status is their health
_VOLUME = re.compile(r"^(\$\{[^}]*\}|[^:]+):([^:]+)(?::(ro|rw))?$")


def _compose() -> dict:
    return yaml.safe_load((DEPLOY / "docker-compose.yml").read_text())


def _mounts(service: dict) -> list[tuple[str, str, bool]]:
    """(source, target, read_only) of a service's short-syntax volumes."""
    out = []
    for entry in service.get("volumes", []):
        match = _VOLUME.match(entry)
        assert match, entry
        out.append((match.group(1), match.group(2), match.group(3) == "ro"))
    return out


def _command_text(service: dict) -> str:
    command = service.get("command", [])
    return command if isinstance(command, str) else " ".join(command)


def test_compose_runs_the_whole_loop_with_healthchecks_and_ordered_starts() -> None:
    compose = _compose()
    services = compose["services"]
    assert {"redis", "minio", "board", "tokens", "trainer", "engine", "island", "volume-init"} <= set(services)
    for name, service in services.items():
        if name not in ONE_SHOT:
            test = service.get("healthcheck", {}).get("test")
            assert test and test[0] in ("CMD", "CMD-SHELL"), f"{name} has no healthcheck"
        depends = service.get("depends_on", {})
        assert isinstance(depends, dict), f"{name}: depends_on without conditions"
        for dep, cond in depends.items():
            want = "service_completed_successfully" if dep in ONE_SHOT else "service_healthy"
            assert cond == {"condition": want}, f"{name} waits for {dep} with {cond}, not {want}"
    assert services["trainer"]["restart"] == "no"
    # MinIO's S3 API is published (presigned URLs used from this host), on BIND_ADDR.
    published = {p.rsplit(":", 2)[-1]: p for p in services["minio"]["ports"]}
    assert "9000" in published and published["9000"].rsplit(":", 2)[1] == "9000"
    # A refused token exits 1 and Docker cannot leave out an exit code: bounded retries.
    assert re.fullmatch(r"on-failure:\d+", services["island"]["restart"])
    for name, service in services.items():
        for port in service.get("ports", []):
            assert port.startswith("${BIND_ADDR:-127.0.0.1}:"), f"{name} publishes {port} on every interface"


def test_compose_volumes_belong_to_the_image_user() -> None:
    uid, gid = _image_user()
    compose = _compose()
    services = compose["services"]
    named = set(compose["volumes"])
    init = services["volume-init"]
    assert init["user"] == "0:0" and init["cap_drop"] == ["ALL"] and set(init["cap_add"]) <= {"CHOWN", "FOWNER", "DAC_OVERRIDE"}
    script = _command_text(init)
    chowned = {source for source, target, _ in _mounts(init) if target in re.findall(rf"chown -R {uid}:{gid} ([^&]+)", script)[0].split()}
    assert chowned, script
    ours = 0
    for name, service in services.items():
        for source, _target, _ro in _mounts(service):
            if not source.startswith((".", "/", "$")):
                assert source in named, f"{name} mounts undeclared volume {source}"
        if name == "volume-init" or service.get("image") not in ("weftboard:dev", services["engine"]["image"]):
            continue
        ours += 1
        assert service["user"] == f"{uid}:{gid}", f"{name} does not run as the image's user {uid}:{gid}"
        assert service["security_opt"] == ["no-new-privileges:true"] and service["cap_drop"] == ["ALL"], name
        assert service.get("read_only") is True and any(t.startswith("/tmp:") for t in service["tmpfs"]), name
        writable = {source for source, _t, ro in _mounts(service) if source in named and not ro}
        assert writable <= chowned, f"{name} writes volumes the init step does not own to {uid}: {writable - chowned}"
        if writable:
            assert service["depends_on"]["volume-init"] == {"condition": "service_completed_successfully"}, name
    assert ours >= 5


def test_compose_engine_is_reachable_only_by_the_island() -> None:
    compose = _compose()
    services = compose["services"]
    engine, island = services["engine"], services["island"]
    assert "vllm.entrypoints.openai.api_server" in " ".join(engine["entrypoint"])
    assert engine["environment"]["VLLM_SERVER_DEV_MODE"] == "1"
    assert not engine.get("ports"), "the engine's admin endpoints are published"
    assert engine["networks"] == ["engine"] and compose["networks"]["engine"]["internal"] is True
    assert "engine" in island["networks"]
    others = [n for n, s in services.items() if n not in ("engine", "island") and "engine" in s.get("networks", [])]
    assert not others, f"{others} can reach the engine"
    argv = shlex.split(_command_text(island).split("weftboard sidecar", 1)[1])
    assert _flag(argv, "--engine-url") == f"http://engine:{_flag(engine['command'], '--port')}"
    island_dir = island["environment"]["WEFTBOARD_DIR"]
    assert (("island-data", island_dir, True) in _mounts(engine)) and (("island-data", island_dir, False) in _mounts(island))
    assert "/health/ready" in " ".join(island["healthcheck"]["test"]) and "/health" in " ".join(engine["healthcheck"]["test"])
    listen_port = _flag(argv, "--listen").rpartition(":")[2]
    assert f":{listen_port}/health/ready" in " ".join(island["healthcheck"]["test"])
    assert any(p.endswith(f":{listen_port}:{listen_port}") for p in island["ports"])


def test_every_island_keeps_its_compiled_kernels_on_persistent_storage() -> None:
    """An island compiles the codec's kernels on first use: each deployment points
    NUMBA_CACHE_DIR into the island's own persistent, writable path, so a restart loads them
    (and a sandboxed or read-only install has somewhere to write them at all)."""
    pod, sidecar, _engine = _island_pod()
    env = {e["name"]: e.get("value") for e in sidecar["env"]}
    claims = {t["metadata"]["name"] for t in yaml.safe_load_all((K8S / "island.yaml").read_text())
              if t["kind"] == "StatefulSet" for t in t["spec"]["volumeClaimTemplates"]}
    persistent = [m["mountPath"] for m in sidecar["volumeMounts"] if m["name"] in claims and not m.get("readOnly")]
    assert any(env["NUMBA_CACHE_DIR"].startswith(m + "/") for m in persistent), (env["NUMBA_CACHE_DIR"], persistent)

    compose = _compose()
    for name in ("island", "trainer"):
        service = compose["services"][name]
        volumes = [t for s, t, ro in _mounts(service) if s in compose["volumes"] and not ro]
        assert any(service["environment"]["NUMBA_CACHE_DIR"].startswith(v + "/") for v in volumes), name

    for unit in ("weftboard-island@.service", "weftboard-sidecar@.service"):
        text = (DEPLOY / "systemd" / unit).read_text()
        (cache,) = re.findall(r"^Environment=NUMBA_CACHE_DIR=(\S+)$", text, re.M)
        (writable,) = re.findall(r"^ReadWritePaths=(\S+)$", text, re.M)
        assert cache.startswith(writable + "/"), unit


@pytest.mark.slow
@pytest.mark.timeout(600)
async def test_the_example_trainer_publishes_to_a_board(board_factory, s3_store, warm_kernels, tmp_path) -> None:
    """deploy/trainer/example_trainer.py, as the compose trainer runs it (its own process, a
    PUBLISHER token from a file, blobs through the board's presigned URLs), commits its steps."""
    import torch
    from safetensors.torch import save_file

    board = await board_factory(blobs=s3_store)
    async with BoardClient(board.address, board.admin_token) as admin:
        token = (await admin.create_token("trainer", pb.ROLE_PUBLISHER)).token
    model = tmp_path / "model"
    model.mkdir()
    save_file({"model.embed_tokens.weight": torch.randn(64, 32).to(torch.bfloat16),
               "model.norm.weight": torch.ones(32, dtype=torch.bfloat16)}, str(model / "model.safetensors"))
    (tmp_path / "token").write_text(token + "\n")
    env = {**os.environ, "WEFTBOARD_BOARD": board.address, "WEFTBOARD_RUN": "compose-demo",
           "TOKEN_FILE": str(tmp_path / "token"), "MODEL_DIR": str(model), "WORK_DIR": str(tmp_path / "work"),
           "STEPS": "2", "STEP_SECONDS": "0"}
    proc = await asyncio.create_subprocess_exec(sys.executable, str(DEPLOY / "trainer" / "example_trainer.py"), env=env,
                                                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
    out, _ = await asyncio.wait_for(proc.communicate(), 300)
    assert proc.returncode == 0, out.decode()[-3000:]
    async with BoardClient(board.address, board.admin_token) as admin:
        assert (await admin.get_head("compose-demo")).version == 2, out.decode()[-3000:]


# ---------------------------------------------------------------------------
# Grafana: right with several board replicas
# ---------------------------------------------------------------------------


def _metric_kinds() -> dict[str, tuple[str, tuple[str, ...]]]:
    """Exported series name -> (kind, labels), from the metric definitions of the board, the
    island (sidecar and follower) and the publisher."""
    from prometheus_client.metrics import MetricWrapperBase

    from weftboard.board.metrics import BoardMetrics
    from weftboard.publisher.metrics import PublisherMetrics
    from weftboard.subscriber.metrics import IslandMetrics

    kinds: dict[str, tuple[str, tuple[str, ...]]] = {}
    metrics = [*vars(BoardMetrics()).values(), *vars(IslandMetrics("r")).values(), *vars(PublisherMetrics("r")).values()]
    for metric in metrics:
        if not isinstance(metric, MetricWrapperBase):
            continue
        name, kind, labels = metric._name, metric._type, tuple(metric._labelnames)
        if kind == "counter":
            kinds[name + "_total"] = ("counter", labels)
        elif kind == "histogram":
            kinds[name + "_bucket"] = ("bucket", labels)
            kinds[name + "_sum"] = kinds[name + "_count"] = ("counter", labels)
        else:
            kinds[name] = (kind, labels)
    return kinds


def _families(kinds: dict[str, tuple[str, tuple[str, ...]]]) -> set[str]:
    """The names a metrics table lists: counters as ``_total`` series, histograms by family."""
    histograms = {name.removesuffix("_bucket") for name, (kind, _) in kinds.items() if kind == "bucket"}
    series_of_histograms = {h + suffix for h in histograms for suffix in ("_bucket", "_sum", "_count")}
    return histograms | (set(kinds) - series_of_histograms)


def _enclosing(expr: str, pos: int) -> list[tuple[str, set[str]]]:
    """The calls and aggregations around ``expr[pos]``, innermost first: (name, by-labels)."""
    chain: list[tuple[str, set[str]]] = []
    depth = 0
    for i in range(pos - 1, -1, -1):
        if expr[i] == ")":
            depth += 1
        elif expr[i] == "(":
            if depth:
                depth -= 1
                continue
            head = expr[:i].rstrip()
            grouped = re.search(r"(\w+)\s+(?:by|without)\s*\(([^)]*)\)$", head)
            if grouped:
                chain.append((grouped.group(1), {x.strip() for x in grouped.group(2).split(",") if x.strip()}))
            else:
                word = re.search(r"(\w*)$", head)
                chain.append((word.group(1) if word else "", set()))
    return chain


def _aggregation_problems(expr: str, kinds: dict[str, tuple[str, tuple[str, ...]]]) -> list[str]:
    """What in ``expr`` would be wrong with several board replicas (or is wrong for a counter)."""
    problems = []
    for match in re.finditer(r"\b(weftboard_[a-z_]+)\b", expr):
        name = match.group(1)
        if name not in kinds:
            problems.append(f"{name} is not a series a board exports")
            continue
        kind, labels = kinds[name]
        chain = _enclosing(expr, match.start())
        ops = [op for op, _ in chain]
        ranged = re.match(r"(\{[^}]*\})?\[[^\]]+\]", expr[match.end():])
        if kind in ("counter", "bucket"):
            if ops[:2] != ["rate", "sum"] or not ranged:
                problems.append(f"{name} is a counter: sum(rate({name}[...])), not {ops}")
            elif kind == "bucket" and ("le" not in chain[1][1] or ops[2:3] != ["histogram_quantile"]):
                problems.append(f"{name}: histogram_quantile(q, sum by (..., le) (rate(...)))")
        elif "run" in labels:  # one run's shared state, reported by every replica
            if not chain or chain[0][0] != "max" or "run" not in chain[0][1]:
                problems.append(f"{name} is a per-run gauge every replica reports: max by (run, ...), not {chain[:1]}")
        elif not chain or chain[0][0] != "sum":  # each replica's own count
            problems.append(f"{name} counts per replica: sum across them, not {chain[:1]}")
    return problems


def test_dashboard_panels_stay_right_with_several_board_replicas() -> None:
    kinds = _metric_kinds()
    # The check itself tells right from wrong.
    assert _aggregation_problems('sum by (run) (weftboard_head{run=~"$run"})', kinds)
    assert _aggregation_problems("sum(weftboard_islands)", kinds)
    assert _aggregation_problems("max(weftboard_head)", kinds)
    assert _aggregation_problems("sum(weftboard_commits_total)", kinds)
    assert _aggregation_problems("sum(increase(weftboard_commits_total[5m]))", kinds)
    assert _aggregation_problems("max(weftboard_watch_streams)", kinds)
    assert _aggregation_problems("histogram_quantile(0.9, sum by (method) (rate(weftboard_rpc_latency_seconds_bucket[5m])))", kinds)
    assert not _aggregation_problems("sum(max by (run, state) (weftboard_islands))", kinds)

    assert _aggregation_problems("sum by (run) (weftboard_island_version)", kinds)  # islands: max, as replicas
    assert not _aggregation_problems("sum(max by (run, instance) (weftboard_island_ready))", kinds)
    for path in DASHBOARDS:
        dashboard = json.loads(path.read_text())
        gauges = counters = 0
        for panel in dashboard["panels"]:
            for target in panel["targets"]:
                expr = target["expr"]
                problems = _aggregation_problems(expr, kinds)
                assert not problems, f"{path.name}, panel {panel['title']!r}: {problems}"
                for name in re.findall(r"\b(weftboard_[a-z_]+)\b", expr):
                    gauges += kinds[name][0] == "gauge" and "run" in kinds[name][1]
                    counters += kinds[name][0] == "counter"
        assert gauges >= 2 and counters >= 5, path.name


def test_every_metric_a_dashboard_queries_is_exported_and_every_dashboard_is_provisioned() -> None:
    """Each ``weftboard_*`` name in a panel's query or a template variable's is a series that
    BoardMetrics, IslandMetrics or PublisherMetrics defines; compose's Grafana mounts every
    dashboard, and its Prometheus scrapes the island's sidecar on the port it listens on."""
    kinds = _metric_kinds()
    for path in DASHBOARDS:
        dashboard = json.loads(path.read_text())
        queries = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
        queries += [v["query"] for v in dashboard["templating"]["list"] if v["type"] == "query"]
        queried = {name for q in queries for name in re.findall(r"\b(weftboard_\w+)", q)}
        assert queried, f"{path.name} queries no weftboard metric"
        assert queried <= set(kinds), f"{path.name} queries series no metrics class exports: {queried - set(kinds)}"
    compose = _compose()
    mounted = {Path(source).name for source, _target, _ro in _mounts(compose["services"]["grafana"])}
    assert {p.name for p in DASHBOARDS} <= mounted, "compose's Grafana leaves out a dashboard"
    targets = {t for job in yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())["scrape_configs"]
               for config in job["static_configs"] for t in config["targets"]}
    listen = _flag(shlex.split(_command_text(compose["services"]["island"]).split("weftboard sidecar", 1)[1]), "--listen")
    assert f"island:{listen.rpartition(':')[2]}" in targets, targets


# ---------------------------------------------------------------------------
# systemd
# ---------------------------------------------------------------------------

SYSTEMD = DEPLOY / "systemd"
ISLAND_UNITS = ("weftboard-island@.service", "weftboard-sidecar@.service")


def _unit(name: str) -> configparser.ConfigParser:
    parser = configparser.ConfigParser(strict=False, interpolation=None, delimiters=("=",))
    parser.optionxform = str  # type: ignore[assignment,method-assign]
    parser.read_string((SYSTEMD / name).read_text())
    return parser


def test_systemd_units_restart_on_failure_but_not_on_a_refused_token_and_are_hardened() -> None:
    units = sorted(p.name for p in SYSTEMD.glob("*.service"))
    assert set(ISLAND_UNITS) | {"weftboard-board.service"} <= set(units)
    for name in units:
        unit = _unit(name)
        service = unit["Service"]
        assert {"Unit", "Service", "Install"} <= set(unit.sections()), name
        assert service.get("User") or service.get("DynamicUser") == "yes", name
        for key, value in {"NoNewPrivileges": "true", "ProtectSystem": "strict", "PrivateTmp": "true",
                           "ProtectHome": "true", "Restart": "on-failure"}.items():
            assert service.get(key) == value, f"{name}: {key}={service.get(key)}, want {value}"
        assert "MemoryDenyWriteExecute" not in service, f"{name}: the JIT-compiled kernels need W+X pages"
        assert service.get("CapabilityBoundingSet") == "", name
        state = "/var/lib/" + service["StateDirectory"]
        assert service["ReadWritePaths"].split() == [state], f"{name}: writable paths beyond its state directory"
        prevent = set(service.get("RestartPreventExitStatus", "").split())
        if name in ISLAND_UNITS:
            assert {"1", "2"} <= prevent, f"{name} keeps restarting on a refused token"
        else:  # the board: exit 1 is Redis or S3 not answering yet, which a restart cures
            assert prevent == {"2"}, name
    for name in ISLAND_UNITS:
        assert re.search(r"^ExecStart=\S+/weftboard (subscribe|sidecar)\b", (SYSTEMD / name).read_text(), re.M), name


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze is not installed")
def test_systemd_units_verify(tmp_path: Path) -> None:
    """``systemd-analyze verify`` finds no unknown key or unparsable value (it only warns about
    those, so any line it prints about a unit fails the test)."""
    weftboard = shutil.which("weftboard") or str(Path(sys.executable).with_name("weftboard"))
    paths = []
    for unit in SYSTEMD.glob("*.service"):
        target = tmp_path / unit.name.replace("@.", "@test.")
        target.write_text(unit.read_text().replace("/opt/weftboard/bin/weftboard", weftboard))
        paths.append(str(target))
    result = subprocess.run(["systemd-analyze", "verify", *paths], capture_output=True, text=True, timeout=120)
    about_ours = [line for line in (result.stdout + result.stderr).splitlines()
                  if str(tmp_path) in line or "weftboard" in line]
    assert result.returncode == 0 and not about_ours, result.stdout + result.stderr


async def test_the_exit_codes_the_island_units_stop_on_are_the_ones_the_commands_use(board, tmp_path) -> None:
    """A refused token makes `subscribe` and `sidecar` exit with a status the units do not restart
    on, and so does a usage error; what the units do restart on (any other failure) is what
    the island does not handle itself."""
    prevented = {name: {int(c) for c in _unit(name)["Service"]["RestartPreventExitStatus"].split()}
                 for name in ISLAND_UNITS}
    results = await asyncio.gather(
        run_cli("subscribe", "--board", board.address, "--run", "r", "--dir", str(tmp_path / "s"),
                "--token", "not-a-token", "--no-progress"),
        run_cli("sidecar", "--board", board.address, "--run", "r", "--dir", str(tmp_path / "c"),
                "--token", "not-a-token", "--listen", "127.0.0.1:0"),
        run_cli("subscribe", "--run", "r"),
    )
    (sub_code, sub_err), (side_code, side_err), (usage_code, _) = results
    assert sub_code != 0 and sub_code in prevented["weftboard-island@.service"], (sub_code, sub_err[-1500:])
    assert "Unauthenticated" in sub_err and "Traceback" not in sub_err
    assert side_code != 0 and side_code in prevented["weftboard-sidecar@.service"], (side_code, side_err[-1500:])
    assert "Unauthenticated" in side_err and "Traceback" not in side_err
    assert all(usage_code in codes for codes in prevented.values()) and usage_code != 0
