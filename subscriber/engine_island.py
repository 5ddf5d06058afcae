"""Assembling an island that serves an engine: engine + adapter + subscriber + admission gate + sidecar.

``start_island`` is what ``weftboard sidecar`` and ``weftboard demo`` run (``local_follower`` is
``weftboard subscribe``'s plain follower into a local destination, without engine or sidecar). With
``engine="reference"`` and no ``engine_url`` the reference engine runs in this process
and the subscriber patches its tensors in place; otherwise the engine runs elsewhere and
the subscriber keeps a verified checkpoint directory that the adapter makes the engine
load.

Invariants:
- The sidecar's ``VersionState.held`` is only moved by the engine destination, after an
  activation succeeded; ``head`` follows what the subscriber learns from the board.
- ``stop()`` ends every task this island started and closes its servers and client.
- One ``BoardClient`` (plaintext, or TLS as ``tls`` says) carries every board call of the
  island: the subscriber's, the trajectory reporter's and the sidecar's head refresh.
- One ``IslandMetrics`` (its own registry) records the subscriber's steps, the engine's
  activations and the sidecar's requests; the sidecar serves it at ``/metrics``.
- Every ``scrub_interval_s`` (and once the first version is held) what the island serves is
  re-hashed against its record; a damaged version is quarantined and fetched again (scrub.py).
- An engine in its own process is probed every ``engine_watch_s`` (``_watch_engine``): one that
  stops answering (``ENGINE_MISSES`` probes in a row), or reports a version other than the one the
  island loaded (the reference engine's ``/health`` says, vLLM's workers when asked, SGLang's
  weight version: it restarted on its start-up weights), is withdrawn at once (503,
  ``adapter.mark_unverified``), and once it answers again the verified folder is loaded into it
  (``activate_held``). Probes overlapping an activation are not judged. A restart whose first
  ``activate_held`` fails still starts: the watch begins with the engine lost and loads it again.
- A task that ends before ``stop()`` (a fatal error) is logged at once, and ``failed()``
  returns its error, so ``weftboard sidecar`` exits instead of serving a stale version.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import structlog

from weftboard.board.client import BoardClient, TlsConfig
from weftboard.proto.errors import ApplyError, InvalidArgument, NotFound, WeftboardError
from weftboard.subscriber.admission import AdmissionGate, VersionState
from weftboard.subscriber.cancel import cancel_and_wait
from weftboard.subscriber.checkpoint_dir import CheckpointDirDestination
from weftboard.subscriber.destination import Destination
from weftboard.subscriber.engine_destination import EngineDestination
from weftboard.subscriber.engines.base import ActivationMode, EngineAdapter
from weftboard.subscriber.engines.factory import make_adapter
from weftboard.subscriber.engines.http import HttpEngineAdapter
from weftboard.subscriber.live_tensors import LiveTensorsDestination
from weftboard.subscriber.metrics import IslandMetrics
from weftboard.subscriber.reference_engine.engine import ReferenceEngine
from weftboard.subscriber.reference_engine.openai_api import serve_engine
from weftboard.subscriber.scrub import DEFAULT_SCRUB_INTERVAL_S, Scrubber
from weftboard.subscriber.sidecar import Sidecar, SidecarConfig
from weftboard.subscriber.subscriber import Subscriber
from weftboard.subscriber.trajectory_reporter import TrajectoryReporter

log = structlog.get_logger(__name__)

REFERENCE_CONFIG_LABEL = "weftboard.reference_config"


@dataclass
class RunningIsland:
    island_id: str
    url: str
    sidecar: Sidecar
    subscriber: Subscriber
    state: VersionState
    gate: AdmissionGate
    adapter: EngineAdapter
    destination: EngineDestination
    engine: ReferenceEngine | None = None  # the in-process engine, when there is one
    _closers: list[Any] = field(default_factory=list)
    _tasks: list[asyncio.Task] = field(default_factory=list)
    scrubber: Scrubber | None = None  # re-verifies what the island serves (scrub.py)

    async def failed(self) -> BaseException:
        """Waits for one of the island's tasks to end and returns why. They run until ``stop``,
        so one ends only on an error that retrying cannot cure (a token the board refuses) or a
        bug; a process serving the island should then exit rather than serve a stale version."""
        done, _ = await asyncio.wait(self._tasks, return_when=asyncio.FIRST_COMPLETED)
        task = next(iter(done))
        if task.cancelled():
            return asyncio.CancelledError(f"task {task.get_name()} was cancelled")
        return task.exception() or RuntimeError(f"task {task.get_name()} returned")

    async def stop(self) -> None:
        await cancel_and_wait(self._tasks)
        await self.sidecar.stop()
        for close in reversed(self._closers):
            try:
                await close()
            except Exception as exc:  # keep closing the rest; report what failed
                log.warning("island shutdown step failed", island=self.island_id, error=str(exc))


async def reference_config_of_run(client: Any, run: str, timeout_s: float = 60.0) -> dict[str, Any] | None:
    """The reference model config a publisher stored in the run's labels (waits for the run)."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while True:
        try:
            info = await client.get_run(run)
            raw = info.labels.get(REFERENCE_CONFIG_LABEL)
            return json.loads(raw) if raw else None
        except NotFound:
            if asyncio.get_running_loop().time() > deadline:
                raise
            await asyncio.sleep(0.2)


def _log_end(task: asyncio.Task) -> None:
    """An island's task ending on an error is logged where it happens, not first at ``stop``."""
    exc = None if task.cancelled() else task.exception()
    if exc is not None:
        log.error("island task ended; the island no longer follows its run", task=task.get_name(),
                  error=f"{type(exc).__name__}: {exc}")


async def _follow_head(subscriber: Subscriber, state: VersionState, every_s: float = 0.05) -> None:
    while True:
        if subscriber.head > state.head:
            await state.set_head(subscriber.head)
        await asyncio.sleep(every_s)


#: seconds between two probes of an engine in its own process (``_watch_engine``)
ENGINE_WATCH_S = 2.0


#: failed health checks in a row that make an engine lost (one may be a busy moment, not a loss)
ENGINE_MISSES = 2


async def _engine_trouble(adapter: HttpEngineAdapter) -> tuple[str, bool] | None:
    """(why the engine may no longer serve what the island loaded into it, whether that is certain),
    else None: it does not answer ``/health`` (maybe a busy moment), or it answers with a ``version``
    (the reference engine does) other than the served one (certain: it restarted)."""
    try:
        answer = await adapter.health_answer()
    except ApplyError as exc:
        return f"it does not answer its health check: {exc}", False
    except ValueError as exc:  # a 2xx whose JSON does not parse: it answers, without a version to read
        log.warning("the engine's health answer is not JSON", error=str(exc))
        return None
    version = answer.get("version") if isinstance(answer, dict) else None
    served = adapter.served_version()
    if isinstance(version, int) and served > 0 and version != served:
        return f"it reports version {version} where the island loaded version {served}: it restarted", True
    return None


async def _watch_engine(adapter: HttpEngineAdapter, destination: EngineDestination, gate: AdmissionGate,
                        every_s: float = ENGINE_WATCH_S, *, lost: bool = False) -> None:
    """Withdraw the island when its engine is lost (``_engine_trouble``); load the verified folder
    into it again once it answers. ``lost``: from the start (the island's first load of the held
    version failed)."""
    misses = 0
    while True:
        await asyncio.sleep(every_s)
        served = adapter.served_version()
        if gate.activating:
            continue
        trouble = await _engine_trouble(adapter)
        if gate.activating or adapter.served_version() != served:
            continue  # an activation overlapped the probe: its answer says nothing
        if trouble is not None:
            why, certain = trouble
            misses += 1
            if not lost and (certain or misses >= ENGINE_MISSES) and (served > 0 or adapter.unverified is None):
                await destination.engine_lost(why)
                lost = True
            continue
        misses = 0
        if lost:
            try:
                held = await destination.activate_held()
            except (WeftboardError, OSError) as exc:  # recorded by the activation; try again next probe
                log.warning("reloading the verified version into the engine failed", error=str(exc))
                continue
            lost = held == 0
            log.info("the engine serves the verified version again", held=held)


async def start_island(
    *,
    board: str,
    token: str | None,
    run: str,
    island_id: str,
    region: str = "local",
    engine: str = "reference",
    engine_url: str | None = None,
    reference_config: dict[str, Any] | None = None,
    token_delay_s: float = 0.0,
    checkpoint_dir: Path | str | None = None,
    cache_dir: Path | str,
    mode: ActivationMode | str = ActivationMode.DRAIN,
    host: str = "127.0.0.1",
    port: int = 0,
    blob_store: Any = None,
    heartbeat_s: float = 2.0,
    default_deadline_s: float = 30.0,
    report_trajectories: bool = True,
    tls: TlsConfig | None = None,
    engine_api_key: str | None = None,
    scrub_interval_s: float = DEFAULT_SCRUB_INTERVAL_S,
    engine_watch_s: float = ENGINE_WATCH_S,
) -> RunningIsland:
    client = BoardClient(board, token, tls=tls)  # the subscriber's, the reporter's and the sidecar's board calls
    closers: list[Any] = [client.close]
    try:
        state = VersionState()
        gate = AdmissionGate(mode)
        metrics = IslandMetrics(run)  # one registry for the island: its subscriber, engine and sidecar
        in_process = None
        engine_lost = False  # the held version did not go into the engine at start: the watch reloads it
        if engine == "reference" and not engine_url:
            config = reference_config if reference_config is not None else await reference_config_of_run(client, run)
            in_process = ReferenceEngine(config, token_delay_s=token_delay_s)
            server = await serve_engine(in_process, "127.0.0.1", 0)
            closers.append(server.stop)
            engine_url = server.url
            adapter = make_adapter("reference", engine=in_process)
            inner: Destination = LiveTensorsDestination(in_process.tensors)
            destination = EngineDestination(adapter, gate, state, inner, metrics=metrics)
        else:
            if checkpoint_dir is None:
                raise InvalidArgument(f"--engine {engine} at {engine_url} needs --dir for the checkpoint it loads")
            adapter = make_adapter(engine, engine_url, api_key=engine_api_key)
            closers.append(adapter.close)
            await adapter.warm_up()
            # its start re-hashes the checkpoint on disk (minutes for a large model): not on the loop
            on_disk = await asyncio.to_thread(CheckpointDirDestination, checkpoint_dir)
            destination = EngineDestination(adapter, gate, state, on_disk, checkpoint_dir=on_disk.current,
                                            metrics=metrics)
            if on_disk.held_version():  # a restart: serve the verified checkpoint on disk first
                try:
                    await destination.activate_held()
                except (WeftboardError, OSError) as exc:  # recorded by the activation; the engine watch retries
                    log.error("loading the verified version on disk into the engine failed; the island starts "
                              "without it", version=on_disk.held_version(), error=str(exc))
                    engine_lost = True
        subscriber = Subscriber(client, run, destination, island_id=island_id, region=region, blob_store=blob_store,
                                cache_dir=cache_dir, heartbeat_s=heartbeat_s, metrics=metrics)
        reporter = TrajectoryReporter(client) if report_trajectories else None

        async def board_head() -> int:
            return int((await client.get_head(run)).version)

        # an engine that renames its model on a load (SGLang) keeps the name it was known by
        model_name = adapter.served_model_name if isinstance(adapter, HttpEngineAdapter) else None
        sidecar = Sidecar(SidecarConfig(engine_url, run, island_id, host=host, port=port,
                                        default_deadline_s=default_deadline_s, engine_api_key=engine_api_key,
                                        served_model_name=model_name), state, gate, reporter,
                          refresh_head=board_head, metrics=metrics)
        url = await sidecar.start()
        tasks = [asyncio.create_task(subscriber.run(), name=f"subscriber-{island_id}"),
                 asyncio.create_task(_follow_head(subscriber, state), name=f"head-{island_id}")]
        scrubber = Scrubber(subscriber, interval_s=scrub_interval_s)  # 0: only when called
        if scrub_interval_s > 0:
            tasks.append(asyncio.create_task(scrubber.run(), name=f"scrub-{island_id}"))
        if isinstance(adapter, HttpEngineAdapter) and engine_watch_s > 0:  # an engine in its own process
            tasks.append(asyncio.create_task(_watch_engine(adapter, destination, gate, engine_watch_s,
                                                           lost=engine_lost),
                                             name=f"engine-watch-{island_id}"))
        for task in tasks:
            task.add_done_callback(_log_end)
        island = RunningIsland(island_id, url, sidecar, subscriber, state, gate, adapter, destination, in_process,
                               closers, tasks, scrubber=scrubber)
        log.info("island started", island=island_id, url=url, engine=engine, engine_url=engine_url,
                 mode=gate.mode.value)
        return island
    except BaseException:
        for close in reversed(closers):
            await close()
        raise
