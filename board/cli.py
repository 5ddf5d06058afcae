"""The ``weftboard`` command line.

Each package contributes its commands through a ``commands`` module with a
``register(app, bench)`` function, so this file stays a table of contents and each
package owns its own flags. Command bodies import their heavy dependencies (torch,
grpc) lazily, so ``weftboard --help`` stays fast.
"""

from __future__ import annotations

import importlib

import typer

COMMAND_MODULES = (
    "weftboard.board.commands",       # serve, history, status, token, gc, bench board
    "weftboard.cuda.commands",        # warmup, bench codec, bench formats
    "weftboard.publisher.commands",   # bench sync
    "weftboard.subscriber.commands",  # subscribe
    "weftboard.subscriber.demo.commands",  # demo
)


def build_app() -> typer.Typer:
    app = typer.Typer(
        name="weftboard",
        help="Keep rollout islands on a trainer's latest weights with lossless patches.",
        no_args_is_help=True,
        add_completion=False,
    )
    bench = typer.Typer(
        help="Benchmarks; each prints ratios against a baseline measured in the same run.",
        no_args_is_help=True,
    )
    app.add_typer(bench, name="bench")
    for name in COMMAND_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name != name:  # a real missing dependency, not an absent commands module
                raise
            continue
        module.register(app, bench)
    return app


def main() -> None:
    build_app()()


if __name__ == "__main__":
    main()
