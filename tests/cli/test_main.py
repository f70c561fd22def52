"""The entry point: every command is listed, and starting one imports only its own module."""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest

from sealfs.cli.commands import COMMANDS
from sealfs.cli.main import build_parser, command_in
from tests.mounts import sealfs


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    (action,) = (a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


def test_help_lists_every_command_with_its_help() -> None:
    result = sealfs("--help", check=True)
    for name, command in COMMANDS.items():
        assert f"{name}  " in result.stdout
        assert command.help in result.stdout


@pytest.mark.parametrize("name", list(COMMANDS))
def test_each_command_is_defined_by_the_module_the_table_names(name: str) -> None:
    parsers = _subparsers(build_parser(name))
    assert list(parsers) == list(COMMANDS)  # all listed, in the table's order
    # The complete parser, as when every module is loaded (not a placeholder):
    assert parsers[name].format_help() == _subparsers(build_parser())[name].format_help()


def test_command_is_the_first_word_that_is_not_an_option() -> None:
    assert command_in(["-v", "mount", "s", "m", "--passphrase-file", "f"]) == "mount"
    assert command_in(["--help"]) == ""
    assert command_in([]) == ""


def test_mount_imports_no_other_command_and_not_rich() -> None:
    # Mount time regression: main imported every command module, and status's rich
    # alone was a fifth of the start-up of every mount.
    probe = (
        "import sys; from sealfs.cli.main import build_parser;"
        " build_parser('mount').parse_args(['mount', 'store', 'mnt']);"
        " print(' '.join(sorted(sys.modules)))"
    )
    modules = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True, timeout=60
    ).stdout.split()
    assert "sealfs.cli.mount_cmd" in modules
    unwanted = {"sealfs.cli.init_cmd", "sealfs.cli.key_cmd", "sealfs.cli.status_cmd", "rich"}
    assert unwanted & set(modules) == set()
