"""The ``weftboard`` command line.

Each package contributes its commands through a ``commands`` module with a
``register(app, bench)`` function, so this file stays a table of contents and each
package owns its own flags. A ``commands`` module imports at its top only what its flags need
(typer, the board's flag helpers), and each command imports what it runs in its body: building
this table loads no torch, numba or numpy, so ``weftboard serve`` and the board's client
commands start without them (tests/test_cli_board.py holds this).
``weftboard --version`` prints the installed distribution's
version (``importlib.metadata``) and exits before any command is resolved.

``weftboard --config FILE`` (or ``WEFTBOARD_CONFIG``) reads every command's options from a TOML
file (board/config_file.py): flags > environment variables > the file > defaults.
``--install-completion`` / ``--show-completion`` set up shell completion (typer's).
"""

from __future__ import annotations

import importlib
from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as distribution_version
from pathlib import Path

import typer

from weftboard.board.config_file import config_default_map, read_config
from weftboard.proto.errors import InvalidArgument

COMMAND_MODULES = (
    "weftboard.board.commands",       # serve, history, status, fleet, token, gc, bench board
    "weftboard.cuda.commands",        # warmup, bench codec, bench formats
    "weftboard.publisher.commands",   # bench sync
    "weftboard.subscriber.commands",  # subscribe
    "weftboard.subscriber.demo.commands",  # demo
)


def installed_version() -> str:
    try:
        return distribution_version("weftboard")
    except PackageNotFoundError:  # running from a checkout that is not installed
        return "unknown (not installed)"


def _print_version(value: bool) -> None:
    if value:
        typer.echo(f"weftboard {installed_version()}")
        raise typer.Exit()


def _global_options(
    ctx: typer.Context,
    _version: bool = typer.Option(False, "--version", callback=_print_version, is_eager=True,
                                  help="Print weftboard's version and exit."),
    config: Path | None = typer.Option(
        None, "--config", envvar="WEFTBOARD_CONFIG", dir_okay=False,
        help="TOML file of options: top-level keys for every command that has them, a table named after "
             "a command (serve, sidecar, token.create ...) for that one. Flags and environment variables win over it."),
) -> None:
    """Keep rollout islands on a trainer's latest weights with lossless patches."""
    if config is None:
        return
    try:
        ctx.default_map = config_default_map(ctx.command, read_config(config), str(config))
    except InvalidArgument as exc:
        raise typer.BadParameter(str(exc), param_hint="'--config' / WEFTBOARD_CONFIG") from None


def build_app() -> typer.Typer:
    app = typer.Typer(
        name="weftboard",
        help="Keep rollout islands on a trainer's latest weights with lossless patches.",
        no_args_is_help=True,
        add_completion=True,
    )
    bench = typer.Typer(
        help="Benchmarks; each prints ratios against a baseline measured in the same run.",
        no_args_is_help=True,
    )
    app.callback()(_global_options)
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
    build_app()(prog_name="weftboard")  # also under `python -m`: completion scripts name the command


if __name__ == "__main__":
    main()
