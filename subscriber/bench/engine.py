"""``weftboard bench engine``: a real vLLM swapping versions in place against its own full reload.

On one engine (``vllm_kit``: its own virtual environment and process, a tiny Llama-style model,
bf16 AdamW-like versions), for every version: the swap in place (pause, every worker applies the
verified patch, resume) and then the engine's own reload of the same version's checkpoint from
disk (pause, ``reload_weights``, resume), each timed from the pause request to the resume
answer, while clients keep sending requests. After each, the greedy tokens and log-probs of
fixed prompts are read; the two must be equal, and the engine's live weights the version's
verified bytes (the deep digest). The patch is staged in the workers (applied, verified, the
changed elements found, CPU kernels packed) while the engine serves, before the pause:
``stage_s``. ``swap_speedup`` is the median reload time over the median in-place time;
``write_speedup`` the same for the weights' change alone (without the pause and resume).
"""

from __future__ import annotations

import asyncio
import statistics
import tempfile
import threading
import time
import urllib.error
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from weftboard.subscriber.bench import vllm_kit
from weftboard.subscriber.engines.base import ActivationMode
from weftboard.subscriber.engines.vllm import VllmAdapter

PROMPTS = ("the quick brown fox", "weights move from", "every version is")


class _Load:
    """``clients`` threads sending completions until stopped; counts answers and failures."""

    def __init__(self, server: vllm_kit.VllmServer, clients: int) -> None:
        self.server, self.stop, self.done, self.failed = server, threading.Event(), 0, 0
        self.lock = threading.Lock()
        self.threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(clients)]
        for t in self.threads:
            t.start()

    def _run(self, i: int) -> None:
        while not self.stop.is_set():
            try:
                self.server.complete(PROMPTS[i % len(PROMPTS)] + " and", max_tokens=8)
                ok = True
            except (urllib.error.URLError, OSError, KeyError, ValueError):
                ok = False
            with self.lock:
                self.done += ok
                self.failed += not ok

    def finish(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(timeout=120)


async def _timed_swap(adapter: VllmAdapter, change: Callable[[], Awaitable[Any]]) -> tuple[float, float, Any]:
    """Seconds from the pause request to the resume answer, seconds of ``change`` alone, its result."""
    t0 = time.perf_counter()
    await adapter.pause(ActivationMode.IN_PLACE)
    try:
        t1 = time.perf_counter()
        result = await change()
        write_s = time.perf_counter() - t1
    finally:
        await adapter.resume()
    return time.perf_counter() - t0, write_s, result


async def _measure(server: vllm_kit.VllmServer, versions: list[vllm_kit.Version], clients: int,
                   say: Callable[[str], None]) -> dict[str, Any]:
    adapter = VllmAdapter(server.url, timeout_s=300)
    ask = lambda: [server.complete(p) for p in PROMPTS]  # noqa: E731
    rows: list[dict[str, Any]] = []
    try:
        say(f"warm-up of the codec in the engine: {await adapter.warm_up():.1f}s")
        v0 = versions[0]
        await _timed_swap(adapter, lambda: adapter.attach(v0.folder, v0.target))
        for version in versions[1:]:
            target = version.target
            load = _Load(server, clients)
            time.sleep(0.2)
            t_stage = time.perf_counter()
            staged = await adapter.prepare_patch(version.patch, target)  # the engine serves meanwhile
            stage_s = time.perf_counter() - t_stage
            in_place_s, in_place_write_s, how = await _timed_swap(
                adapter, lambda version=version: adapter.activate_patch(version.patch, version.target, version.folder))
            load.finish()
            worker = dict(adapter.last_timings)
            digest = await adapter.engine_digest(deep=True)
            after_patch = ask()
            reload_load = _Load(server, clients)
            time.sleep(0.2)
            reload_s, reload_write_s, _ = await _timed_swap(adapter, lambda version=version: adapter.load_checkpoint(
                version.folder, version.target.version))
            reload_load.finish()
            after_reload = ask()
            await adapter.adopt(version.folder, target)  # back to patches in place (not timed)
            rows.append({
                "version": target.version, "how": how, "staged": staged, "stage_s": stage_s,
                "in_place_s": in_place_s, "reload_s": reload_s,
                "in_place_write_s": in_place_write_s, "reload_write_s": reload_write_s,
                "digest_match": digest == (target.version, target.root_digest),
                "tokens_match": [a[0] for a in after_patch] == [b[0] for b in after_reload],
                "logprobs_match": [a[1] for a in after_patch] == [b[1] for b in after_reload],
                "requests": load.done + reload_load.done, "failed": load.failed + reload_load.failed,
                "worker_stage_s": worker.get("apply_s"), "worker_write_s": worker.get("install_s"),
                "write_mode": adapter.write_mode,
            })
            say(f"version {target.version}: in place {in_place_s * 1e3:.1f} ms ({how}), reload "
                f"{reload_s * 1e3:.1f} ms, tokens equal {rows[-1]['tokens_match']}, failed {rows[-1]['failed']}")
    finally:
        await adapter.close()
    in_place_med = statistics.median(r["in_place_s"] for r in rows)
    reload_med = statistics.median(r["reload_s"] for r in rows)
    write_med = {k: statistics.median(r[k] for r in rows) for k in ("in_place_write_s", "reload_write_s")}
    return {
        "engine": "vllm",
        "in_place": all(r["how"] == "in_place" for r in rows),
        "write_mode": "/".join(sorted({r["write_mode"] for r in rows})),
        "versions": len(rows),
        "tokens_match": all(r["tokens_match"] for r in rows),
        "logprobs_match": all(r["logprobs_match"] for r in rows),
        "digest_match": all(r["digest_match"] for r in rows),
        "requests_served": sum(r["requests"] for r in rows),
        "requests_failed": sum(r["failed"] for r in rows),
        "stage_median_s": statistics.median(r["stage_s"] for r in rows),
        "in_place_median_s": in_place_med,
        "reload_median_s": reload_med,
        "swap_speedup": reload_med / in_place_med,
        # the weights' change alone (the collective_rpc inside the pause), without pause and resume
        "in_place_write_median_s": write_med["in_place_write_s"],
        "reload_write_median_s": write_med["reload_write_s"],
        "write_speedup": write_med["reload_write_s"] / write_med["in_place_write_s"],
        "rows": rows,
    }


def run(*, versions: int = 8, hidden: int = 1024, layers: int = 12, clients: int = 3,
        workdir: Path | None = None, engine_python: Path | None = None,
        say: Callable[[str], None] = print) -> dict[str, Any]:
    """Build the model and its versions, start the engine, measure; the JSON-ready result."""
    python, why = vllm_kit.engine_python(engine_python)
    if python is None:
        raise RuntimeError(why)
    with tempfile.TemporaryDirectory(prefix="weftboard-bench-engine-", dir=workdir) as tmp:
        root = Path(tmp)
        model = vllm_kit.build_tiny_model(python, root / "model", hidden=hidden, layers=layers)
        all_versions = vllm_kit.make_versions(model, root / "versions", versions)
        size = sum(f.stat().st_size for f in model.glob("*.safetensors"))
        say(f"model: hidden {hidden}, {layers} layers, {size / 1e6:.1f} MB; {versions} versions")
        server = vllm_kit.VllmServer(python, model, root / "engine.log", pythonpath=vllm_kit.weftboard_path())
        try:
            server.wait_ready()
            result = asyncio.run(_measure(server, all_versions, clients, say))
        finally:
            server.stop()
    result["model"] = {"hidden": hidden, "layers": layers, "bytes": size}
    return result

