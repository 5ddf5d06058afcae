"""``WeftboardCallback``: a ``transformers.TrainerCallback`` that publishes the weights of a
Hugging Face ``Trainer`` (or a TRL trainer such as ``GRPOTrainer``) to a weftboard run.

When training begins the callback creates or opens the run, with the model's config (naming
its architecture and the served dtype) and the trainer's tokenizer or processor as the run's
model files, so every island's folder is a complete model folder. It publishes after every
``every_n_steps``-th optimizer step and after the last one, puts the version into the logs
(``weftboard/version``), and at train end publishes the final weights if their step was not
published yet, waits for the last commit and closes the publisher.

Invariants:
- Versions follow the steps in order, each published with ``step=state.global_step``; a
  publish returns once the weights are read, the commits run in the background.
- One process publishes (the main one) unless the job is sharded (torch.distributed with more
  than one rank, or DTensor parameters as FSDP2 makes them): then every rank runs a
  ``ShardedPublisher`` and calls it at the same steps; rank 0 creates the run and commits.
- A tensor under two names (tied weights) is published once, under its first name, as
  ``save_pretrained`` saves it.
- What is published is the served model (``model_state.py``): unwrapped from ``torch.compile``
  and DDP; a PEFT model's merged weights, config and class are its base model's (the training
  model is never modified); what cannot be merged exactly is refused, never published wrong.
- A publisher this callback opened is closed at train end, or (without waiting) when
  ``on_train_begin`` fails after opening it; one left by a ``train()`` that raised is closed by
  the next ``on_train_begin``, ``close()``, or the publisher's own finalizer.
- This module imports transformers (an optional dependency); ``weftboard.publisher`` imports
  it only when ``WeftboardCallback`` is asked for.
"""

from __future__ import annotations

import copy
import inspect
from typing import Any

import structlog
import torch
import torch.distributed as dist
from torch.distributed.fsdp import FullyShardedDataParallel
from torch.distributed.tensor import DTensor
from transformers import TrainerCallback

from weftboard.cuda.formats import ServedFormatSpec
from weftboard.proto.domain import check_name
from weftboard.proto.errors import InvalidArgument
from weftboard.proto.v1 import board_pb2 as pb
from weftboard.publisher.job import PublishHandle
from weftboard.publisher.model_state import module_state, served_module
from weftboard.publisher.publisher import Publisher
from weftboard.publisher.sharded import ShardedPublisher

__all__ = ["VERSION_LOG_KEY", "WeftboardCallback", "publishable_state", "trainer_model_files"]

log = structlog.get_logger("weftboard.publisher")

#: The key of the published version in the trainer's logs and ``state.log_history``.
VERSION_LOG_KEY = "weftboard/version"
_SERVED_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def _options(cls: type) -> set[str]:
    """The keyword options of a publisher class, besides those the callback sets itself."""
    return set(inspect.signature(cls.__init__).parameters) - {"self", "board", "run", "token", "served_format",
                                                             "model_files"}


def _own_class(model: torch.nn.Module) -> type:
    """The model's class, not one torch.distributed made for it (FSDP2's ``fully_shard`` subclasses it)."""
    return next((c for c in type(model).__mro__ if not c.__module__.startswith("torch.")), type(model))


def _is_sharded(model: torch.nn.Module) -> bool:
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return True
    return any(isinstance(p, DTensor) for p in model.parameters())


def _check_readable(model: torch.nn.Module) -> None:
    """Refuse the parallel wrappings whose parameters are not the model's weights."""
    if any(hasattr(p, "ds_id") for p in model.parameters()):
        raise InvalidArgument("WeftboardCallback cannot read DeepSpeed ZeRO-partitioned parameters; train with "
                              "FSDP2 (fsdp_version: 2), whose DTensor shards every rank publishes")
    if any(isinstance(m, FullyShardedDataParallel) for m in model.modules()):
        raise InvalidArgument("WeftboardCallback does not read FSDP1's flat parameters; train with FSDP2 "
                              "(fsdp_version: 2), whose DTensor shards every rank publishes")


def publishable_state(model: torch.nn.Module) -> dict[str, Any]:
    """The model's served weights (``model_state.module_state``): unwrapped from ``torch.compile``
    and DDP, a PEFT model's adapters merged under the base model's names, each tensor once (tied
    weights keep their first name)."""
    return module_state(model)


def trainer_model_files(model: torch.nn.Module, processing_class: Any, served_format: ServedFormatSpec) -> list[Any]:
    """The run's model files from a trainer: the model's config (its architecture named, the
    dtype of the served weights), its generation config and the tokenizer or processor.

    For an fp8 or 4-bit served format the config names bfloat16 and no quantization config:
    pass ``model_files=`` with the config your engine expects. A wrapped or PEFT model's files
    are its served module's (``model_state.served_module``: the base model's config and class)."""
    model = served_module(model)
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "save_pretrained"):
        raise InvalidArgument(f"WeftboardCallback: the {type(model).__name__} has no Hugging Face config to "
                              "give the islands; pass model_files= (a folder or files), or () for none")
    config = copy.deepcopy(config)
    if not getattr(config, "architectures", None):
        config.architectures = [_own_class(model).__name__]  # as save_pretrained names it
    dtype = _SERVED_DTYPES.get(served_format.kind, torch.bfloat16)
    if served_format.kind == "raw":
        dtype = getattr(model, "dtype", None) or next(model.parameters()).dtype
    if isinstance(getattr(type(config), "torch_dtype", None), property):
        config.dtype = dtype  # transformers 5 (torch_dtype is a deprecated alias)
    else:
        config.torch_dtype = dtype
    files: list[Any] = [config]
    if getattr(model, "generation_config", None) is not None:
        files.append(model.generation_config)
    if processing_class is not None and hasattr(processing_class, "save_pretrained"):
        files.append(processing_class)
    return files


class WeftboardCallback(TrainerCallback):
    """Publishes the trainer's weights to run ``run`` on the board at ``board`` (host:port).

    ``every_n_steps``: publish after every that many optimizer steps (and after the last);
    ``publish_initial``: also publish the weights training starts from (version of step
    ``state.global_step``, so islands serve the starting policy from the first rollout on);
    ``model_files``: what ``Publisher`` takes, instead of the model's config and the trainer's
    tokenizer (``()`` for none); other keyword options go to ``Publisher`` (or, sharded, to
    ``ShardedPublisher``): ``blob_store``, ``anchor_every``, ``max_pending``, ``tls_ca``, ...

    ``versions`` maps each published step to its version; ``last_record`` is the committed
    record of the last version, once training ended.
    """

    def __init__(self, board: str, run: str, *, token: str | None = None, every_n_steps: int = 1,
                 publish_initial: bool = True, served_format: ServedFormatSpec | None = None,
                 model_files: Any = None, **publisher_options: Any) -> None:
        if not isinstance(board, str) or not board.strip():
            raise InvalidArgument(f"WeftboardCallback needs the board's address (host:port), not {board!r}")
        if isinstance(every_n_steps, bool) or not isinstance(every_n_steps, int) or every_n_steps < 1:
            raise InvalidArgument(f"every_n_steps must be an integer >= 1, not {every_n_steps!r}")
        self.run = check_name("run", run)
        unknown = set(publisher_options) - _options(Publisher) - _options(ShardedPublisher)
        if unknown:
            raise InvalidArgument(f"WeftboardCallback: unknown publisher options {sorted(unknown)}")
        self.spec = served_format if served_format is not None else ServedFormatSpec("bf16")
        if not isinstance(self.spec, ServedFormatSpec):
            raise InvalidArgument(f"served_format must be a ServedFormatSpec, not {type(self.spec).__name__}")
        self.board, self.token = board, token
        self.every_n_steps = every_n_steps
        self.publish_initial = publish_initial
        self.model_files = model_files
        self.options = publisher_options
        self.publisher: Publisher | ShardedPublisher | None = None
        self.versions: dict[int, int] = {}
        self.last_record: pb.VersionRecord | None = None
        self._last: tuple[int, PublishHandle] | None = None  # the newest (step, handle)

    # -- the trainer's events ----------------------------------------------------------------

    def on_train_begin(self, args: Any, state: Any, control: Any, model: torch.nn.Module | None = None,
                       processing_class: Any = None, **kwargs: Any) -> None:
        if model is None:
            raise InvalidArgument("WeftboardCallback got no model from the trainer")
        self.close()  # a publisher left by an earlier train() that did not end
        _check_readable(model)
        sharded = _is_sharded(model)
        if not sharded and not state.is_world_process_zero:
            return  # one process publishes
        tokenizer = processing_class if processing_class is not None else kwargs.get("tokenizer")  # transformers < 4.46
        files = self.model_files if self.model_files is not None else trainer_model_files(model, tokenizer, self.spec)
        if sharded:
            refused = set(self.options) - _options(ShardedPublisher)
            if refused:
                raise InvalidArgument(f"WeftboardCallback: ShardedPublisher (a sharded job) takes no {sorted(refused)}")
            self.publisher = ShardedPublisher(self.board, self.run, token=self.token, served_format=self.spec,
                                              model_files=files, **self.options)
        else:
            refused = set(self.options) - _options(Publisher)
            if refused:
                raise InvalidArgument(f"WeftboardCallback: Publisher takes no {sorted(refused)}")
            self.publisher = Publisher(self.board, self.run, token=self.token, served_format=self.spec,
                                       model_files=files, **self.options)
        self._last = None
        self.last_record = None
        try:
            weights = publishable_state(model)
            self.publisher.connect(weights)  # creates or opens the run (rank 0 of a sharded job)
            if self.publish_initial:
                self._publish(weights, state.global_step)
        except BaseException:
            self.close()  # the trainer calls no on_train_end when on_train_begin raises
            raise
        log.info("publishing the trainer's weights", run=self.run, sharded=sharded, every_n_steps=self.every_n_steps)

    def on_step_end(self, args: Any, state: Any, control: Any, model: torch.nn.Module | None = None,
                    **kwargs: Any) -> None:
        step = state.global_step
        if self.publisher is not None and (step % self.every_n_steps == 0 or step >= state.max_steps):
            self._publish(publishable_state(model), step)

    def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, Any] | None = None,
               **kwargs: Any) -> None:
        if self._last is None:
            return
        version = self._last[1].version
        if logs is not None:
            logs[VERSION_LOG_KEY] = version  # for the callbacks after this one
        if state.log_history and state.log_history[-1].get("step") == state.global_step:
            state.log_history[-1][VERSION_LOG_KEY] = version  # the trainer appended these logs just before

    def on_train_end(self, args: Any, state: Any, control: Any, model: torch.nn.Module | None = None,
                     **kwargs: Any) -> None:
        publisher = self.publisher
        if publisher is None:
            return
        try:
            if self._last is None or self._last[0] != state.global_step:
                version = self._publish(publishable_state(model), state.global_step)
                state.log_history.append({VERSION_LOG_KEY: version, "step": state.global_step})
            assert self._last is not None
            self.last_record = self._last[1].result()  # commits are in order: every version is in
        except BaseException:
            self.close()
            raise
        self.publisher = None
        publisher.close()

    # -- the rest ----------------------------------------------------------------------------

    def close(self) -> None:
        """Close the publisher without waiting for pending versions (after a failed training)."""
        publisher, self.publisher = self.publisher, None
        if publisher is not None:
            publisher.close(flush=False)

    def _publish(self, weights: dict[str, Any], step: int) -> int:
        assert self.publisher is not None
        handle = self.publisher.publish(weights, step=step)
        self._last = (step, handle)
        self.versions[step] = handle.version
        return handle.version
