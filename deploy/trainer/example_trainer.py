"""An example trainer for deploy/docker-compose.yml: it stands in for your training job.

It loads the base model's safetensors (the folder the engine starts from, so the tensor names and
shapes are the ones vLLM loads), keeps fp32 master weights, and at every step nudges a sixteenth
of the tensors by a small random amount (a stand-in for an optimizer step) and publishes the
result as the run's next version, served as bf16. Replace it with your trainer; what carries
over is the ``Publisher`` call with a PUBLISHER-role token.

Environment: ``WEFTBOARD_BOARD`` (host:port), ``WEFTBOARD_RUN``, ``TOKEN_FILE`` (the token),
``MODEL_DIR`` (a Hugging Face folder with ``*.safetensors``), ``WORK_DIR`` (the publisher's
scratch space), ``STEPS`` (0: until stopped) and ``STEP_SECONDS``.
"""

from __future__ import annotations

import os
import signal
import threading
from pathlib import Path

import torch
from safetensors.torch import load_file

from weftboard.cuda.formats import ServedFormatSpec
from weftboard.publisher import Publisher


def load_master(folder: Path) -> dict[str, torch.Tensor]:
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise SystemExit(f"no *.safetensors in {folder}: set MODEL_DIR to a Hugging Face model folder")
    state: dict[str, torch.Tensor] = {}
    for path in files:
        state.update(load_file(str(path)))
    return {name: tensor.float() for name, tensor in state.items()}


def main() -> None:
    board = os.environ["WEFTBOARD_BOARD"]
    run = os.environ.get("WEFTBOARD_RUN", "demo")
    token = Path(os.environ["TOKEN_FILE"]).read_text().strip()
    steps = int(os.environ.get("STEPS", "0"))
    step_s = float(os.environ.get("STEP_SECONDS", "30"))
    master = load_master(Path(os.environ.get("MODEL_DIR", "/models/base")))
    names = sorted(master)
    noise = torch.Generator().manual_seed(0)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())

    with Publisher(board, run, token=token, served_format=ServedFormatSpec("bf16"), anchor_every=50,
                   work_dir=os.environ.get("WORK_DIR")) as publisher:
        step = 0
        while not stop.is_set() and (steps == 0 or step < steps):
            for name in names[step % 16::16]:
                tensor = master[name]
                tensor.add_(torch.randn(tensor.shape, generator=noise), alpha=1e-4)
            handle = publisher.publish(master, step=step, labels={"trainer": "example"})
            print(f"step {step}: publishing version {handle.version}", flush=True)
            step += 1
            stop.wait(step_s)
    print(f"published {step} steps; the newest committed version is {publisher.head}", flush=True)


if __name__ == "__main__":
    main()
