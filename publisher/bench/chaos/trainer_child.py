"""The chaos bench's trainer: a process that publishes versions of a tiny model as fast as allowed.

``python -m weftboard.publisher.bench.chaos.trainer_child --board A,B --run R ...``. Each step
moves a random ~1% of every tensor's elements (seeded by the step, so a restarted trainer
continues the same walk), publishes the weights, and keeps its fp32 master weights in
``--state-dir`` (written aside and renamed: a kill leaves the old or the new file, never half of
one), as a trainer keeps its checkpoint. Killed at any moment, it is started again: it loads
the last master weights it wrote and the ``Publisher`` resumes from the run's head, either by
following its own run (``--resume run``) or from those weights (``--resume state``: kept only
if they are the head's exact view, else the next version is an anchor).

stdout: one JSON line per event: ``started`` (with the head it resumed from), ``publish``
(version, step), ``committed`` (version, root digest, whether it carries an anchor, the moment
the commit was acknowledged). SIGTERM stops it after the versions in flight are committed.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from weftboard.board.blobs import S3BlobStore
from weftboard.board.logs import configure
from weftboard.proto.v1 import board_pb2 as pb
from weftboard.publisher.job import PublishHandle
from weftboard.publisher.publisher import Publisher
from weftboard.subscriber.engine_island import REFERENCE_CONFIG_LABEL
from weftboard.subscriber.reference_engine.model import (
    init_parameters,
    model_config,
    parameter_shapes,
)

_print_lock = threading.Lock()


def emit(event: str, **fields: object) -> None:
    with _print_lock:
        sys.stdout.write(json.dumps({"event": event, "t": time.time(), **fields}) + "\n")
        sys.stdout.flush()


def step_weights(master: dict[str, torch.Tensor], step: int, seed: int, fraction: float, lr: float) -> None:
    """Move a random ``fraction`` of each tensor's elements by ``lr`` * N(0, 1), seeded by the step."""
    gen = torch.Generator().manual_seed(seed * 1_000_003 + step)
    for tensor in master.values():
        flat = tensor.view(-1)
        count = max(1, int(flat.numel() * fraction))
        index = torch.randint(0, flat.numel(), (count,), generator=gen)
        flat.index_add_(0, index, torch.randn(count, generator=gen) * lr)


def load_state(state_dir: Path, config: dict) -> tuple[dict[str, torch.Tensor], int]:
    """The last master weights written and their step, or the model's initial weights."""
    path = state_dir / "master.safetensors"
    if path.exists():
        tensors = load_file(path)
        step = int(tensors.pop("__step__").item())
        return {name: tensors[name] for name in parameter_shapes(config)}, step  # the run's layout order
    return init_parameters(config), 0


def save_state(state_dir: Path, master: dict[str, torch.Tensor], step: int) -> None:
    tmp = state_dir / "master.safetensors.tmp"
    save_file({**master, "__step__": torch.tensor([step], dtype=torch.int64)}, str(tmp))
    os.replace(tmp, state_dir / "master.safetensors")


def report_commits(handles: list[PublishHandle], lock: threading.Condition, stop: threading.Event) -> None:
    """Print each version's commit as it is acknowledged, in order."""
    while True:
        with lock:
            while not handles and not stop.is_set():
                lock.wait(0.5)
            if not handles:
                return
            handle = handles.pop(0)
        try:
            record = handle.result()
        except Exception as exc:  # noqa: BLE001 - the publisher is poisoned; main() sees it too
            emit("failed", version=handle.version, error=f"{type(exc).__name__}: {exc}")
            return
        emit("committed", version=record.version, root=record.root_digest,
             anchor=any(a.kind == pb.ARTIFACT_KIND_ANCHOR for a in record.artifacts), step=handle.step)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--board", required=True)
    parser.add_argument("--run", required=True)
    parser.add_argument("--token", required=True)
    parser.add_argument("--s3-endpoint", required=True)
    parser.add_argument("--s3-access-key", required=True)
    parser.add_argument("--s3-secret-key", required=True)
    parser.add_argument("--s3-bucket", required=True)
    parser.add_argument("--state-dir", type=Path, required=True)
    parser.add_argument("--model", required=True, help="the reference model's config, JSON")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--anchor-every", type=int, default=8)
    parser.add_argument("--interval-s", type=float, default=0.0, help="least time between two publishes")
    parser.add_argument("--fraction", type=float, default=0.01)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--resume", choices=("run", "state"), default="run")
    args = parser.parse_args(argv)
    configure(json=True, level="WARNING")

    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    config = model_config(json.loads(args.model))
    args.state_dir.mkdir(parents=True, exist_ok=True)
    master, step = load_state(args.state_dir, config)
    store = S3BlobStore(args.s3_endpoint, args.s3_access_key, args.s3_secret_key, args.s3_bucket,
                        region="us-east-1")
    publisher = Publisher(args.board, args.run, token=args.token, blob_store=store, anchor_every=args.anchor_every,
                          work_dir=args.state_dir / "publisher", timeout_s=10.0,
                          resume_state=master if args.resume == "state" else None,
                          run_labels={REFERENCE_CONFIG_LABEL: json.dumps(config)})
    handles: list[PublishHandle] = []
    lock = threading.Condition()
    reporter = threading.Thread(target=report_commits, args=(handles, lock, stop), daemon=True)
    try:
        publisher.connect(master)
        emit("started", head=publisher.head, step=step, resume=args.resume, pid=os.getpid())
        reporter.start()
        while not stop.is_set():
            begun = time.monotonic()
            step += 1
            step_weights(master, step, args.seed, args.fraction, args.lr)
            handle = publisher.publish(master, step=step)  # returns once the weights are read
            emit("publish", version=handle.version, step=step)
            save_state(args.state_dir, master, step)
            with lock:
                handles.append(handle)
                lock.notify_all()
            stop.wait(max(0.0, args.interval_s - (time.monotonic() - begun)))
        publisher.flush(60)
    finally:
        stop.set()
        with lock:
            lock.notify_all()
        if reporter.is_alive():
            reporter.join(30)
        publisher.close(flush=False)
    emit("stopped", head=publisher.head)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
