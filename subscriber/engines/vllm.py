"""vLLM adapter: patches applied in place inside the engine, a full reload as the fallback.

The engine runs with the weftboard worker extension and vLLM's development endpoints::

    VLLM_SERVER_DEV_MODE=1 python -m vllm.entrypoints.openai.api_server --model DIR \\
        --worker-extension-cls weftboard.subscriber.engines.vllm_worker.WeftboardWorkerExtension

Endpoints used (``vllm/entrypoints/rl/online/api_router.py`` and ``serve/dev``):
- ``POST /pause?mode=wait|keep&clear_cache=true``: ``wait`` lets in-flight requests finish
  first (our ``drain``); ``keep`` freezes them between two steps (our ``in_place``); the KV and
  prefix caches computed on the old weights are dropped (frozen requests recompute theirs).
- ``POST /collective_rpc`` ``{"method": ..., "kwargs": {...}}`` runs a ``vllm_worker`` method
  in every worker: ``weftboard_stage_patch`` (while the engine serves: apply and verify the
  patch file, on this host, on the worker's copy and find what differs) and
  ``weftboard_commit`` (paused: write it into the live parameters); ``weftboard_apply_patch``
  (both at once); ``weftboard_attach`` (a verified checkpoint folder whole, through vLLM's
  loader); ``weftboard_detach``/``weftboard_adopt`` around the engine's own ``reload_weights``
  from disk (``load_checkpoint``), which is always followed by ``weftboard_retie`` (vLLM's reload
  loads nothing into a tied output head: its packed CPU copy would stay on the old version);
  ``weftboard_digest``.
- ``POST /reset_prefix_cache`` after a change; ``POST /resume``; ``GET /health``, and while the
  workers hold the served version bound, ``weftboard_digest`` in the same probe (``health_answer``:
  a restarted engine's workers hold none).
The requests of ``pause``, ``resume`` and ``load_checkpoint`` are pinned by tests/contracts/vllm.json.
An engine started without the extension cannot retie: until a ``warm_up`` confirmed the extension,
a retie answered "no such method" is logged once and the reload stands (a tied head served stale on
CPU); once confirmed, a failed retie vouches for no version.

Security: ``VLLM_SERVER_DEV_MODE`` exposes unauthenticated endpoints that change weights and
run worker methods (``/collective_rpc``, ``/pause``, ``/update_weights``...); vLLM's
``--api-key`` guards only ``/v1``-style paths, not these. The engine's port must be reachable only by the island (bind it to 127.0.0.1 or a private network); clients
reach the engine through the island's sidecar.

Invariants: ``served_version()`` moves only after every worker answered ``ok`` with the
record's root digest; any other answer raises ``ApplyError`` saying what the engine serves
now. Workers that did not all put the old bytes back (``restored``), a weight change the engine
never answered or answered with an HTTP error (a worker raised part-way: vLLM's
``reload_weights`` is not transactional), a patch that left the workers apart and whose whole
load failed, or new weights whose old prefix cache was not dropped leave no version vouched
for: ``served_version()`` is 0 (``mark_unverified``) until a verified load succeeds. A staged
patch is committed only for the version it was staged for. Patches in place need the island and
the engine on one host (the worker reads the file).
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import structlog

from weftboard.proto.errors import ApplyError
from weftboard.subscriber.destination import VersionTarget
from weftboard.subscriber.engines.base import ActivationMode, require_mode
from weftboard.subscriber.engines.http import EngineErrorAnswer, HttpEngineAdapter
from weftboard.subscriber.engines.vllm_worker import target_to_json

log = structlog.get_logger(__name__)

#: the flag value a user adds to vLLM's server command
WORKER_EXTENSION = "weftboard.subscriber.engines.vllm_worker.WeftboardWorkerExtension"
_PAUSE_MODE = {ActivationMode.DRAIN: "wait", ActivationMode.IN_PLACE: "keep"}
#: worker answers after which the engine may take the version whole from a verified folder
_NEEDS_FULL_LOAD = ("needs_attach", "install_failed")
#: how often the island asks whether the workers finished staging (each ask is a step boundary)
_STAGE_POLL_S = 0.02


class _NoExtension(ApplyError):
    """The engine answered a worker method in a way only an engine without the extension does."""


class VllmAdapter(HttpEngineAdapter):
    kind = "vllm"
    #: a worker that raised in a weight change leaves the others (and its own layers) anywhere
    error_answer_keeps_weights = False
    #: False once ``warm_up`` found no worker extension in the engine
    in_place = True
    #: True while the last ``warm_up`` got no clear answer (engine unreachable, timed out, an
    #: error that says nothing of the extension): every version is then the engine's own reload,
    #: and the next ``prepare_patch`` asks again
    _extension_unknown = False
    #: the slowest worker's seconds of the last patch in place: ``apply_s`` (patch and verify),
    #: ``install_s`` (the model's loader); empty after anything else
    last_timings: dict[str, float] = {}  # replaced, never mutated
    #: how the workers write a patch: ``direct`` (into the live parameters) or ``loader``
    write_mode: str = "unknown"
    #: the record of the patch the workers staged (``prepare_patch``, as sent), else None
    _staged: str | None = None
    #: True once a ``warm_up`` answered: the workers have the extension, so a failed retie is an error
    _extension_confirmed = False
    #: whether the warning that an engine without the extension serves a stale tied head was logged
    _warned_stale_head = False
    #: the version the workers hold bound (``attach``, ``adopt``, a patch in place); 0 from the
    #: engine's own reload until ``adopt``. The health probe asks them only while it is the served one.
    _bound = 0
    #: True while ``prepare_patch`` stages: a digest would wait inside the engine for the staging
    _staging = False

    async def health_answer(self) -> Any:
        """``/health``, and while the workers hold the served version bound, the version they hold
        (``{"version": v}``, as the reference engine answers): an engine restarted between two
        probes answers its health check on its start-up weights with no version (0), so the island
        sees the restart (``engine_island._engine_trouble``) instead of labelling those weights
        with the version it had loaded. Each ask within ``probe_timeout_s``, as the health check."""
        answer = await super().health_answer()
        served = self.served_version()
        if not served or self._bound != served or self._staging:
            return answer
        version, _ = await self.engine_digest(timeout_s=self.probe_timeout_s)
        return {"version": version}

    async def pause(self, mode: ActivationMode) -> None:
        await self.call("POST", "/pause", params={"mode": _PAUSE_MODE[require_mode(mode)], "clear_cache": "true"},
                        timeout_s=self.load_timeout_s)

    async def resume(self) -> None:
        await self.call("POST", "/resume")

    async def load_checkpoint(self, directory: Path, version: int) -> None:
        """The engine's own reload of a whole checkpoint folder from disk (the workers first give
        vLLM its layers back: what they vouched for is gone until ``adopt`` or ``attach``), then
        the tied output head prepared again (``_retie``) before the version counts as served."""
        self._staged = None
        self._bound = 0
        if self.in_place:
            try:
                await self._rpc("weftboard_detach", {})
            except ApplyError as exc:  # an engine without the extension has nothing bound
                log.warning("vllm workers did not detach before the reload", engine=self.engine_url, error=str(exc))
        await self.change_weights("POST", "/collective_rpc", what="collective_rpc reload_weights",
                                  json={"method": "reload_weights", "kwargs": {"weights_path": str(directory)}})
        await self._retie(version)
        await self._changed_to(version)

    async def _retie(self, version: int) -> None:
        """After vLLM's ``reload_weights`` of ``version``: the workers tie the output head to the
        embedding again and redo its kernel preparation (``weftboard_retie``). vLLM's reload loads
        nothing into a tied head, so on CPU its packed copy stays on the old weights.

        A failure leaves the new weights behind the old head: no version is vouched for. Except
        where no ``warm_up`` confirmed the extension and the answer says it is missing: such an
        engine cannot retie, so a warning (once) and the reload stands."""
        what = f"the weights of version {version} are in but the tied output head was not prepared again"
        try:
            answers = await self._rpc("weftboard_retie", {})
            bad = [a for a in answers if a.get("status") != "ok"]
            if bad:
                raise ApplyError(f"vllm engine at {self.engine_url}: weftboard_retie failed: {_errors(bad)}")
        except ApplyError as exc:
            if not self._extension_confirmed and _extension_missing(exc, "weftboard_retie"):
                if not self._warned_stale_head:
                    self._warned_stale_head = True
                    log.warning("vllm engine without the weftboard worker extension cannot retie a tied output "
                                "head after a reload: on CPU it serves the old head; start it with "
                                "--worker-extension-cls " + WORKER_EXTENSION, engine=self.engine_url, error=str(exc))
                return
            self.mark_unverified(f"{what} (collective_rpc weftboard_retie): {exc}")
            raise
        except asyncio.CancelledError:
            self.mark_unverified(f"{what}: collective_rpc weftboard_retie was cancelled")
            raise

    async def _changed_to(self, version: int) -> None:
        """After the weights took ``version``: drop the prefix cache computed on the old ones, then
        serve it. A failure leaves new weights behind a stale cache: no version is vouched for."""
        try:
            answer = await self.call("POST", "/reset_prefix_cache")
            if isinstance(answer, dict) and answer.get("success") is False:  # vLLM's answer when it could not
                raise ApplyError(f"vllm engine at {self.engine_url} did not reset its prefix cache: {str(answer)[:300]}")
        except ApplyError as exc:
            self.mark_unverified(f"the weights of version {version} are in but the old prefix cache stayed: {exc}")
            raise
        self.mark_served(version)

    async def warm_up(self) -> float:
        """Compile the codec's kernels in every worker while the engine serves; the seconds it took.

        Only an answer that says the extension is missing (``_extension_missing``: the route or
        the method does not exist, or results no extension gives) turns patches in place off for
        good: every version is then the engine's own reload, and the log says how to fix that.
        Any other failure (engine unreachable or still loading, timed out, an HTTP error saying
        nothing of the extension) leaves ``in_place`` on but the extension unknown: until a later
        ``warm_up`` succeeds (``prepare_patch`` calls it again, while the engine serves) every
        version is the engine's own reload, which works with or without the extension."""
        try:
            answers = await self._rpc("weftboard_warm_up", {})
        except ApplyError as exc:
            if not _extension_missing(exc, "weftboard_warm_up"):
                self._extension_unknown = True
                log.warning("vllm worker warm-up failed; versions are full reloads until the next patch asks "
                            "again", engine=self.engine_url, error=str(exc))
                return 0.0
            self._extension_unknown = False
            self.in_place = False
            log.warning("vllm engine without the weftboard worker extension: every version is a full reload; "
                        "start it with --worker-extension-cls " + WORKER_EXTENSION, engine=self.engine_url,
                        error=str(exc))
            return 0.0
        self._extension_unknown = False
        self._extension_confirmed = True
        return max(float(a.get("seconds", 0.0)) for a in answers)

    def _patches_in_place(self) -> bool:
        """Whether versions may go through the worker extension (present, or not known missing)."""
        return self.in_place and not self._extension_unknown

    async def attach(self, directory: Path, target: VersionTarget) -> None:
        """Between pause and resume: every worker loads the verified folder of ``target`` whole."""
        await self._attach(directory, target, intact=True)

    async def _attach(self, directory: Path, target: VersionTarget, *, intact: bool) -> None:
        """``attach``; ``intact``: whether the workers held the served version before it (False:
        a refusal cannot leave that version served, whatever the answers say of ``restored``)."""
        self._staged = None
        answers = await self._rpc("weftboard_attach", {"checkpoint_dir": str(directory), "target": target_to_json(target)},
                                  changes_weights=True)
        self._require_ok(answers, target, what=f"loading {directory}", intact=intact)
        self.write_mode = _write_mode(answers)
        self._bound = target.version
        await self._changed_to(target.version)

    async def adopt(self, directory: Path, target: VersionTarget) -> None:
        """After the engine's own reload of ``directory`` (``load_checkpoint``): the workers keep its
        verified bytes and bind their live parameters again, so the next patch goes in place."""
        answers = await self._rpc("weftboard_adopt", {"checkpoint_dir": str(directory), "target": target_to_json(target)},
                                  changes_weights=True)
        self._require_ok(answers, target, what=f"adopting {directory}")
        self.write_mode = _write_mode(answers)
        self._bound = target.version

    async def load_version(self, directory: Path, target: VersionTarget) -> None:
        """``attach`` where the extension is there (asked again first when unknown), else, or
        when ``attach`` answers that it is missing (an engine restarted without it), the
        engine's own reload (``load_checkpoint``)."""
        if self.in_place and self._extension_unknown:
            await self.warm_up()  # the warm-up got no clear answer: ask again before choosing
        if self._patches_in_place():
            try:
                await self.attach(directory, target)
                return
            except ApplyError as exc:
                if not _extension_missing(exc, "weftboard_attach"):
                    raise
                log.warning("vllm engine answered that the weftboard worker extension is missing; loading the "
                            "version with its own reload", engine=self.engine_url, error=str(exc))
                # not the engine whose extension a warm-up confirmed: ask again at the next version
                self._extension_confirmed, self._extension_unknown = False, True
        await self.load_checkpoint(directory, target.version)

    async def prepare_patch(self, patch: Path, target: VersionTarget) -> bool:
        """While the engine serves: every worker applies and verifies ``patch`` on its copy of the
        weights and finds the elements to write, in the background; ``activate_patch`` commits."""
        self._staged = None
        if self.in_place and self._extension_unknown:
            await self.warm_up()  # the warm-up got no clear answer: ask again while the engine serves
        if not self._patches_in_place():
            return False
        record = target_to_json(target)
        self._staging = True
        try:
            answers = await self._rpc("weftboard_stage_patch", {"patch_path": str(patch), "target": record})
            deadline = time.monotonic() + self.load_timeout_s
            # workers finish apart (tensor parallel): wait while any is still at it
            while any(a.get("status") == "staging" for a in answers) and time.monotonic() < deadline:
                await asyncio.sleep(_STAGE_POLL_S)
                answers = await self._rpc("weftboard_stage_status", {})
        finally:
            self._staging = False
        if {a.get("status") for a in answers} != {"staged"}:
            log.info("the patch was not staged; it will be applied whole while paused", version=target.version,
                     answers=_errors(answers))
            return False
        self._staged = record
        return True

    async def activate_patch(self, patch: Path, target: VersionTarget, checkpoint_dir: Path | None = None) -> str:
        """Between pause and resume: apply ``patch`` in place; answers ``"in_place"`` or ``"full_load"``.

        A worker that does not hold the patch's base (the engine restarted, or reloaded an
        anchor from disk) or whose hand-over failed takes the version whole from
        ``checkpoint_dir`` (the island's verified folder, already at ``target.version``). If the
        patch left the workers apart and that whole load fails too, no version is vouched for."""
        if not self._patches_in_place():
            if checkpoint_dir is None:
                raise ApplyError(f"vllm engine at {self.engine_url} has no weftboard worker extension and no "
                                 f"verified folder was given to load version {target.version} whole")
            await self.load_checkpoint(checkpoint_dir, target.version)
            return "full_load"
        if self._staged == target_to_json(target):
            answers = await self._rpc("weftboard_commit", {"target": self._staged}, changes_weights=True)
        else:
            answers = await self._rpc("weftboard_apply_patch", {"patch_path": str(patch), "target": target_to_json(target)},
                                      changes_weights=True)
        self._staged = None
        statuses = {a.get("status") for a in answers}
        self.last_timings = {k: max(float(a.get(k, 0.0)) for a in answers) for k in ("apply_s", "install_s")}
        if statuses == {"ok"}:
            self._require_ok(answers, target, what=f"applying {patch.name}")
            self._bound = target.version
            await self._changed_to(target.version)
            return "in_place"
        torn = "ok" in statuses or any(a.get("restored") is False for a in answers)  # workers on different bytes
        if torn and (checkpoint_dir is None or "layout" in statuses):  # and no whole load below puts that right
            self.mark_unverified(f"the patch to version {target.version} left the workers apart: {_errors(answers)}")
        if "layout" in statuses:
            raise ApplyError(f"vllm engine at {self.engine_url}: version {target.version} has a layout the engine "
                             f"does not hold ({_errors(answers)}); restart the engine from that version's folder")
        if "rejected" in statuses and not statuses & set(_NEEDS_FULL_LOAD) and "ok" not in statuses:
            raise ApplyError(f"vllm engine at {self.engine_url} refused the patch to version {target.version} and "
                             f"still serves version {self.served_version()}: {_errors(answers)}")
        if checkpoint_dir is None:
            raise ApplyError(f"vllm engine at {self.engine_url} cannot apply version {target.version} in place "
                             f"({_errors(answers)}) and no verified folder was given to load it whole")
        try:  # some workers moved, others not, or none holds the base
            await self._attach(checkpoint_dir, target, intact=not torn)
        except (ApplyError, asyncio.CancelledError) as exc:
            if torn:
                self.mark_unverified(f"the patch to version {target.version} left the workers apart "
                                     f"({_errors(answers)}) and loading {checkpoint_dir} whole failed: {exc!r}")
            raise
        return "full_load"

    async def engine_digest(self, *, deep: bool = False, timeout_s: float | None = None) -> tuple[int, str | None]:
        """The version and root digest every worker holds (they must agree); ``deep`` first
        compares every live parameter with the verified bytes, bit for bit. ``timeout_s``: the
        answer's limit (default: the load timeout)."""
        answers = await self._rpc("weftboard_digest", {"deep": deep}, timeout_s=timeout_s)
        bad = [a for a in answers if a.get("status") != "ok"]
        if bad:
            raise ApplyError(f"vllm engine at {self.engine_url}: {_errors(bad)}")
        held = {(a.get("version"), a.get("root")) for a in answers}
        if len(held) != 1:
            raise ApplyError(f"vllm engine at {self.engine_url}: workers hold different versions {sorted(map(str, held))}")
        version, root = held.pop()
        return int(version or 0), root

    async def _rpc(self, method: str, kwargs: dict[str, Any], *, changes_weights: bool = False,
                   timeout_s: float | None = None) -> list[dict[str, Any]]:
        """``method`` in every worker, answered within ``timeout_s`` (default: the load timeout);
        ``changes_weights``: one without an answer, or answered with an HTTP error, leaves no
        version vouched for (``change_weights``)."""
        body = {"method": method, "kwargs": kwargs}
        if changes_weights:
            answer = await self.change_weights("POST", "/collective_rpc", json=body, what=f"collective_rpc {method}")
        else:
            answer = await self.call("POST", "/collective_rpc", json=body,
                                     timeout_s=self.load_timeout_s if timeout_s is None else timeout_s)
        results = answer.get("results") if isinstance(answer, dict) else None
        if not results or not all(isinstance(r, dict) for r in results):
            raise _NoExtension(f"vllm engine at {self.engine_url} answered {method} with {str(answer)[:300]}: is it "
                             f"started with --worker-extension-cls {_EXTENSION}?")
        return results

    def _require_ok(self, answers: list[dict[str, Any]], target: VersionTarget, *, what: str,
                    intact: bool = True) -> None:
        """Every worker answered ``ok`` with ``target``'s root, else ``ApplyError``. The served
        version stands only if ``intact`` (it was whole before) and every worker refused and
        none said it did not restore; otherwise ``mark_unverified``."""
        bad = [a for a in answers if a.get("status") != "ok" or a.get("root") != target.root_digest]
        if not bad:
            return
        restored = intact and all(a.get("restored", True) for a in bad) and len(bad) == len(answers)
        if restored:
            now = f"it still serves version {self.served_version()}"
        else:
            now = ("its weights are no longer a verified version: load a verified folder (load_checkpoint) or "
                   "restart the engine before it serves again")
        message = (f"vllm engine at {self.engine_url}: {what} for version {target.version} failed on "
                   f"{len(bad)} of {len(answers)} workers ({_errors(bad)}); {now}")
        if not restored:
            self.mark_unverified(message)
        raise ApplyError(message)


_EXTENSION = "weftboard.subscriber.engines.vllm_worker.WeftboardWorkerExtension"


def _errors(answers: list[dict[str, Any]]) -> str:
    return "; ".join(f"worker {a.get('rank')}: {a.get('status')}: {a.get('error')}" for a in answers
                     if a.get("status") != "ok") or "no error"


def _extension_missing(exc: ApplyError, method: str) -> bool:
    """Whether ``exc`` from calling worker ``method`` says the engine has no worker extension: results
    no extension gives, no ``/collective_rpc`` route (404: not in dev mode), or an error answer
    naming ``method`` as missing (vLLM: "Method 'x' is not implemented", "has no attribute 'x'")."""
    if isinstance(exc, _NoExtension):
        return True
    if not isinstance(exc, EngineErrorAnswer):
        return False  # unreachable, timed out: says nothing of the extension
    if exc.status == 404:
        return True
    body = exc.body.lower()
    return method in body and any(m in body for m in ("not implemented", "no attribute", "not found"))


def _write_mode(answers: list[dict[str, Any]]) -> str:
    modes = {str(a.get("write_mode", "unknown")) for a in answers}
    return modes.pop() if len(modes) == 1 else "mixed"
