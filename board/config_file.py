"""The ``weftboard`` config file: command options from a TOML file (``--config FILE`` or
``WEFTBOARD_CONFIG``).

Top-level keys apply to every command that has that option; a table named after a command
(``[serve]``, ``[sidecar]``, ``[token.create]``, ``[bench.board]``) to that command only, over
the top-level keys. A server's own settings (``TABLE_ONLY``: ``serve``'s ``listen``, ``tls-cert``,
``tls-key`` and ``tls-client-ca``, the sidecar's ``listen``) come only from its table: at the top
level ``tls-cert``/``tls-key`` are the client commands' certificate for mutual TLS, which must
never become the board's server certificate, and ``listen`` (the board's gRPC address or the
sidecar's HTTP one) is refused as ambiguous. A key is an option's name, with dashes or
underscores (``s3-endpoint``, ``s3_endpoint``) or as its flag spells it (``from`` for
``history --from``, ``json``).

Invariants:
- Precedence: flags > environment variables > the config file > defaults. The file's values
  become click's ``default_map``, which click ranks below the command line and an option's
  ``envvar``; ``serve``, whose settings read the environment themselves (``BoardSettings``),
  drops a value from the file when its ``WEFTBOARD_*`` variable is set (``environment_wins``).
- A top-level value never sets an option that ``TABLE_ONLY`` names for that command; a top-level
  key that only such options would take is an ``InvalidArgument`` saying which table it goes in.
- A key that names no option of its command (at the top level: of any command), a table that
  names no command, and a file that is not TOML are ``InvalidArgument`` errors naming the key,
  the command and the file; nothing of such a file is used.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from weftboard.proto.errors import InvalidArgument

# Commands and contexts are typer's click objects, duck-typed: typer 0.29+ ships its own copy of
# click, older releases use the click package, and the classes of the two are unrelated.
Command = Any
Context = Any

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: the same parser, as the tomli package (a dependency there)
    import tomli as tomllib  # type: ignore[no-redef]

__all__ = ["TABLE_ONLY", "config_default_map", "environment_wins", "read_config"]

# Options (by parameter name) a command takes only from its own table, never from the top level:
# a server's own address and certificates, whose top-level keys mean something else elsewhere.
TABLE_ONLY: dict[tuple[str, ...], frozenset[str]] = {
    ("serve",): frozenset({"listen", "tls_cert", "tls_key", "tls_client_ca"}),
    ("sidecar",): frozenset({"listen"}),
}


def read_config(path: Path) -> dict[str, Any]:
    """The TOML document at ``path``."""
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except OSError as exc:
        raise InvalidArgument(f"cannot read the config file {path}: {exc.strerror or exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise InvalidArgument(f"the config file {path} is not valid TOML: {exc}") from None


def _key(name: str) -> str:
    return name.replace("-", "_")


def _option_keys(command: Command) -> dict[str, str]:
    """Keys a config file may use for ``command``'s parameters -> the parameter's name."""
    keys: dict[str, str] = {}
    for param in command.params:
        if not param.expose_value or param.name is None:
            continue
        keys[_key(param.name)] = param.name
        for opt in param.opts:  # not secondary ones: ``no-progress = true`` would read as progress
            if opt.startswith("--"):
                keys.setdefault(_key(opt[2:]), param.name)
    return keys


def _is_group(command: Command) -> bool:
    return isinstance(getattr(command, "commands", None), Mapping)


def _commands(group: Command, prefix: tuple[str, ...] = ()) -> dict[tuple[str, ...], Command]:
    """Every command under ``group`` (not the groups themselves), by its path of names."""
    out: dict[tuple[str, ...], Command] = {}
    for name, command in group.commands.items():
        if _is_group(command):
            out.update(_commands(command, (*prefix, name)))
        else:
            out[(*prefix, name)] = command
    return out


def _section(config: Mapping[str, Any], path: tuple[str, ...]) -> Mapping[str, Any]:
    """The table of the command at ``path`` (empty when the file has none). A top-level scalar
    named like a group (``token = "..."``) is an option of every command, not a table."""
    table: Any = config
    for name in path:
        table = table.get(name, {})
        if not isinstance(table, Mapping):
            return {}
    return table


def _check_tables(group: Command, table: Mapping[str, Any], path: tuple[str, ...], source: str) -> None:
    """Every table names a command (or a group, whose tables name its commands)."""
    for name, value in table.items():
        if not isinstance(value, Mapping):
            if path:  # top-level scalars are options of every command; under a group there are none
                raise InvalidArgument(f"key {name!r} in [{'.'.join(path)}] of the config file {source}: "
                                      f"'weftboard {' '.join(path)}' is a group; its options go in [{'.'.join(path)}.COMMAND]")
            continue
        command = group.commands.get(name)
        if command is None:
            where = " ".join((*path, name))
            known = ", ".join(sorted(group.commands))
            raise InvalidArgument(f"table [{'.'.join((*path, name))}] in the config file {source}: there is no "
                                  f"command 'weftboard {where}' (commands here: {known})")
        if _is_group(command):
            _check_tables(command, value, (*path, name), source)


def config_default_map(root: Command, config: Mapping[str, Any], source: str) -> dict[str, Any]:
    """click's ``default_map`` for ``root`` (the ``weftboard`` group) from a parsed config file."""
    _check_tables(root, config, (), source)
    common = {key: value for key, value in config.items() if not isinstance(value, Mapping)}
    used: set[str] = set()
    held_back: dict[str, list[tuple[str, ...]]] = {}  # top-level keys TABLE_ONLY kept from commands
    default_map: dict[str, Any] = {}
    for path, command in _commands(root).items():
        keys = _option_keys(command)
        values: dict[str, Any] = {}
        table_only = TABLE_ONLY.get(path, frozenset())
        for key, value in common.items():
            if _key(key) in keys:
                if keys[_key(key)] in table_only:
                    held_back.setdefault(key, []).append(path)
                    continue
                values[keys[_key(key)]] = value
                used.add(key)
        for key, value in _section(config, path).items():
            if _key(key) not in keys:
                raise InvalidArgument(f"unknown key {key!r} in [{'.'.join(path)}] of the config file {source}: "
                                      f"'weftboard {' '.join(path)}' has no option --{key.replace('_', '-')}")
            values[keys[_key(key)]] = value
        if values:
            node = default_map
            for name in path[:-1]:
                node = node.setdefault(name, {})
            node[path[-1]] = values
    unused = sorted(set(common) - used)
    for key in unused:
        if key in held_back:
            tables = " or ".join(f"[{'.'.join(path)}]" for path in held_back[key])
            raise InvalidArgument(f"key {key!r} at the top of the config file {source}: a server's own setting is "
                                  f"read only from its command's table; put it in {tables}")
    if unused:
        raise InvalidArgument(f"unknown key {unused[0]!r} at the top of the config file {source}: no weftboard "
                              f"command has an option --{unused[0].replace('_', '-')}")
    return default_map


def environment_wins(ctx: Context, values: dict[str, Any], prefix: str = "WEFTBOARD_") -> dict[str, Any]:
    """``values`` (``ctx``'s command's parameters by name) less those the config file gave while
    the environment sets ``<prefix><NAME>``: for a command whose settings read the environment
    themselves, so that the environment still ranks above the file."""
    environment = {name.upper() for name in os.environ}

    def from_file(name: str) -> bool:
        source = ctx.get_parameter_source(name)
        return source is not None and source.name == "DEFAULT_MAP"

    return {name: value for name, value in values.items()
            if not (from_file(name) and f"{prefix}{name.upper()}" in environment)}
