"""``weftboard --config FILE`` (and ``WEFTBOARD_CONFIG``): every command's options from TOML, with
flags > environment variables > the file > defaults; unknown keys are errors naming them; and
shell completion.

The precedence is read off what a command really did: a client command names the board it could
not reach, ``serve`` the ``--listen`` it refused. The file's values against a real board run in a
``weftboard`` process of its own.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path

import pytest
import typer
from boardkit import make_run, publish
from typer.testing import CliRunner

from weftboard.board.cli import build_app
from weftboard.board.client import BoardClient
from weftboard.board.config_file import config_default_map, read_config
from weftboard.board.embedded import free_port
from weftboard.proto.errors import InvalidArgument


def _env(**extra: str) -> dict[str, str | None]:
    """CliRunner's environment: every WEFTBOARD_* variable of this process unset, then ``extra``."""
    cleared: dict[str, str | None] = {k: None for k in os.environ if k.startswith("WEFTBOARD_")}
    return {**cleared, "COLUMNS": "400", "NO_COLOR": "1", **extra}


def _write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def _invoke(*args: str, **env: str):
    return CliRunner().invoke(build_app(), list(args), env=_env(**env), prog_name="weftboard")


def _unreachable() -> str:
    return f"127.0.0.1:{free_port()}"


def test_keys_map_to_options_by_name_or_flag_with_dashes_or_underscores() -> None:
    root = typer.main.get_command(build_app())
    config = {"board": "b:1", "history": {"from": 3, "json": True}, "gc": {"keep-anchors": 2, "dry_run": True},
              "token": {"create": {"role": "island"}}}
    default_map = config_default_map(root, config, "f.toml")
    assert default_map["history"] == {"board": "b:1", "from_version": 3, "as_json": True}
    assert default_map["gc"] == {"board": "b:1", "keep_anchors": 2, "dry_run": True}
    assert default_map["token"]["create"] == {"board": "b:1", "role": "island"}
    assert default_map["subscribe"]["board"] == "b:1" and "serve" not in default_map  # serve has no --board
    # a top-level string named like the `token` group is the --token option of every command
    assert config_default_map(root, {"token": "secret"}, "f.toml")["status"] == {"token": "secret"}


def test_flags_beat_environment_beat_file_beat_defaults(tmp_path: Path) -> None:
    from_file, from_env, from_flag = _unreachable(), _unreachable(), _unreachable()
    config = _write(tmp_path / "weftboard.toml", f'board = "{from_file}"\ntoken = "{"t" * 24}"\n')

    def board_dialled(*args: str, **env: str) -> str:
        result = _invoke("--config", str(config), "status", *args, **env)
        assert result.exit_code == 1 and "UNAVAILABLE" in result.output, result.output
        return next(a for a in (from_file, from_env, from_flag) if f"from board {a}" in result.output)

    assert board_dialled() == from_file
    assert board_dialled(WEFTBOARD_BOARD=from_env) == from_env
    assert board_dialled("--board", from_flag, WEFTBOARD_BOARD=from_env) == from_flag
    # WEFTBOARD_CONFIG names the file as --config does
    result = _invoke("status", WEFTBOARD_CONFIG=str(config))
    assert result.exit_code == 1 and f"from board {from_file}" in result.output, result.output


def test_serve_settings_rank_environment_above_the_file(tmp_path: Path) -> None:
    """``serve`` builds ``BoardSettings`` itself: a file value yields to its WEFTBOARD_* variable."""
    config = _write(tmp_path / "serve.toml", '[serve]\nlisten = "from-file"\n')

    def refused_listen(*args: str, **env: str) -> str:
        result = _invoke("--config", str(config), "serve", *args, WEFTBOARD_DATA_DIR=str(tmp_path / "data"), **env)
        assert result.exit_code == 2 and "must be host:port" in result.output, result.output
        return result.output.split("listen '", 1)[1].split("'", 1)[0]

    assert refused_listen() == "from-file"
    assert refused_listen(WEFTBOARD_LISTEN="from-env") == "from-env"
    assert refused_listen("--listen", "from-flag", WEFTBOARD_LISTEN="from-env") == "from-flag"


@pytest.mark.parametrize(("text", "expected"), [
    ('bogus = 1\n', "unknown key 'bogus' at the top of the config file"),
    ('[serve]\nboard = "x:1"\n', "unknown key 'board' in [serve]"),
    ('[history]\nno-such-option = 1\n', "'weftboard history' has no option --no-such-option"),
    ('[nope]\nx = 1\n', "there is no command 'weftboard nope'"),
    ('[token]\nrole = "admin"\n', "'weftboard token' is a group; its options go in [token.COMMAND]"),
    ('[history\n', "is not valid TOML"),
])
def test_an_unknown_key_is_a_clear_error(tmp_path: Path, text: str, expected: str) -> None:
    config = _write(tmp_path / "bad.toml", text)
    result = _invoke("--config", str(config), "status", "--board", _unreachable())
    assert result.exit_code == 2, result.output
    message = " ".join(result.output.replace("│", " ").split())
    assert expected in message and str(config) in message and "--config" in message, message


def test_a_missing_file_is_an_error_naming_it(tmp_path: Path) -> None:
    missing = tmp_path / "missing.toml"
    with pytest.raises(InvalidArgument, match="cannot read the config file"):
        read_config(missing)
    result = _invoke("status", WEFTBOARD_CONFIG=str(missing))
    assert result.exit_code == 2 and "missing.toml" in result.output, result.output


async def test_a_command_takes_board_token_run_and_flags_from_the_file(board, local_store, tmp_path: Path) -> None:
    """``history`` against a real board, in its own process, with nothing on its command line
    but ``--config``: the board, the admin token, the run (an argument), ``--last`` and ``--json``."""
    async with BoardClient(board.address, board.admin_token) as client:
        await client.create_run(make_run("cfg"))
        await publish(client, local_store, "cfg", [1, 2, 3, 4])
    config = _write(tmp_path / "weftboard.toml", (
        f'board = "{board.address}"\ntoken = "{board.admin_token}"\n\n'
        '[history]\nrun = "cfg"\nlast = 2\njson = true\n'))
    env = {k: v for k, v in os.environ.items() if not k.startswith("WEFTBOARD_")}
    proc = await asyncio.create_subprocess_exec(sys.executable, "-m", "weftboard.board.cli", "--config", str(config),
                                                "history", env=env, stdout=asyncio.subprocess.PIPE,
                                                stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(proc.communicate(), 120)
    assert proc.returncode == 0, err.decode()
    history = json.loads(out)
    assert history["run"] == "cfg" and [v["version"] for v in history["versions"]] == [3, 4]


def test_shell_completion(monkeypatch: pytest.MonkeyPatch) -> None:
    """Completions come from the command tree; ``--show-completion`` prints the script to source."""
    result = _invoke(**{"_WEFTBOARD_COMPLETE": "complete_bash", "COMP_WORDS": "weftboard se", "COMP_CWORD": "1"})
    assert result.exit_code == 0 and result.output.split() == ["serve"]
    result = _invoke(**{"_WEFTBOARD_COMPLETE": "complete_bash", "COMP_WORDS": "weftboard history --la",
                        "COMP_CWORD": "2"})
    assert result.output.split() == ["--last"]
    monkeypatch.setenv("_TYPER_COMPLETE_TEST_DISABLE_SHELL_DETECTION", "1")  # typer's hook: name the shell
    for shell, marker in (("bash", "complete -o default -F _weftboard_completion weftboard"),
                          ("zsh", "compdef _weftboard_completion weftboard")):
        result = _invoke("--show-completion", shell)
        assert result.exit_code == 0 and marker in result.output and f"complete_{shell}" in result.output, result.output
