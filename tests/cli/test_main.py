"""The entry point: every command is listed, and starting one imports only its own module."""

from __future__ import annotations

import argparse
import io
import subprocess
import sys
from collections.abc import Callable

import pytest

from sealfs.cli import main as main_module
from sealfs.cli.commands import COMMANDS
from sealfs.cli.exitcodes import BUG, BUSY, DAMAGED, FAILURE, INTERRUPTED, USAGE, WRONG_KEY
from sealfs.cli.main import DEBUG_ENV, build_parser, command_in, main, parse
from sealfs.errors import ConfigError, WrongKeyError
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


def test_python_dash_m_sealfs_is_the_sealfs_command() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "sealfs", "status", "/nonexistent/sealfs-store"],
        capture_output=True,
        check=False,
        text=True,
        timeout=60,
    )
    assert done.returncode == USAGE, done.stderr
    assert done.stderr.startswith("sealfs: "), done.stderr


@pytest.mark.parametrize(
    ("args", "command", "words"),
    [
        (["mount", "s", "m", "--commit-interval", "abc"], "mount", "invalid float value: 'abc'"),
        (["mount", "s"], "mount", "required: mountpoint"),
        (["key", "remove", "s", "x"], "key remove", "invalid int value: 'x'"),
        (["key", "list", "s", "--bogus"], "key list", "unrecognized arguments: --bogus"),
        # Regression: the line did not say where the option goes (README: sealfs -v COMMAND).
        (["mount", "s", "m", "-v"], "mount", "-v; --verbose (-v) goes before the command"),
        (["key"], "key", "required: ACTION"),
        ([], "", "required: COMMAND"),
    ],
)
def test_usage_error_is_one_line_naming_the_command(
    args: list[str], command: str, words: str
) -> None:
    """Regression: argparse printed the whole usage block (a dozen lines) above the error."""
    result = sealfs(*args)
    assert result.returncode == USAGE, result
    err = result.stderr.strip()
    assert "\n" not in err, err
    prog = f"sealfs {command}".strip()
    assert err.startswith(f"{prog}: ") and err.endswith(f"(see '{prog} --help')"), err
    assert words in err, err


@pytest.mark.parametrize(
    "args",
    [
        ["status", "store", "--passphrase", "hunter2 horse"],
        ["mount", "store", "mnt", "--passphrase=hunter2 horse"],
        ["init", "store", "--pass", "hunter2 horse"],
        ["key", "add", "store", "pkcs11", "--pin", "hunter2 horse"],
    ],
)
def test_a_secret_on_the_command_line_is_refused_and_never_echoed(args: list[str]) -> None:
    """Regression: argparse took --passphrase (or --pass) for --passphrase-file, its
    abbreviation, and the error quoted the passphrase on stderr, a log or a terminal's
    scrollback: "cannot read passphrase file hunter2 horse"."""
    result = sealfs(*args)
    assert result.returncode == USAGE, result
    err = result.stderr.strip()
    assert "\n" not in err and "hunter2" not in err, err
    assert "never taken from the command line" in err and "--passphrase-file FILE" in err, err


def test_an_abbreviated_option_is_not_taken_for_another() -> None:
    """An option is its whole name: argparse took --read for --read-only, and any prefix
    of an option for it, so a typo or a guessed name could land on a real option."""
    result = sealfs("mount", "store", "mnt", "--read")
    assert result.returncode == USAGE, result
    assert "unrecognized arguments: --read " in result.stderr, result.stderr


def _raise(exc: BaseException) -> Callable[..., None]:
    def raiser(*args: object, **kwargs: object) -> None:
        raise exc

    return raiser


class _Terminal(io.StringIO):
    """stderr as a terminal: where a bug's message may be shown."""

    def isatty(self) -> bool:
        return True


def test_unexpected_exception_is_one_line_and_its_own_code(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Regression: an exception no code path expected ended in a traceback."""
    monkeypatch.delenv(DEBUG_ENV, raising=False)
    monkeypatch.setattr(sys, "stderr", terminal := _Terminal())
    monkeypatch.setattr(main_module, "setup_logging", _raise(RuntimeError("boom\nsecond line")))
    assert main(["status", "store"]) == BUG
    err = terminal.getvalue().strip()
    assert "\n" not in err and "Traceback" not in err, err
    assert err.startswith("sealfs: unexpected RuntimeError: boom second line;"), err
    assert "this is a bug in sealfs; please report it" in err
    assert BUG not in (0, FAILURE, USAGE, WRONG_KEY, DAMAGED, BUSY)


def test_a_bug_s_message_is_withheld_from_a_stderr_that_is_no_terminal(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Regression: a bug's message went wherever stderr went, a systemd unit's journal
    for `sealfs mount --foreground`, and a bug in loading a volume may quote one of its
    file names. Off a terminal the line names the bug's type and how to see the rest."""
    monkeypatch.delenv(DEBUG_ENV, raising=False)
    monkeypatch.setattr(main_module, "setup_logging", _raise(KeyError("secret-plan.txt")))
    assert main(["status", "store"]) == BUG
    err = capsys.readouterr().err
    assert "secret-plan" not in err, err
    assert err.startswith("sealfs: unexpected KeyError: (message withheld"), err
    assert f"run with {DEBUG_ENV}=1" in err


class _Unprintable(Exception):
    def __str__(self) -> str:
        raise ValueError("no text")


@pytest.mark.parametrize("debug", ["0", "1"])
def test_a_bug_whose_message_fails_is_still_a_bug(
    monkeypatch: pytest.MonkeyPatch, debug: str
) -> None:
    """Regression: an exception whose str() raised escaped main from the report itself,
    a traceback and exit code 1 (a failure) instead of a bug's line and code."""
    monkeypatch.setenv(DEBUG_ENV, debug)
    monkeypatch.setattr(sys, "stderr", terminal := _Terminal())
    monkeypatch.setattr(main_module, "setup_logging", _raise(_Unprintable()))
    assert main(["status", "store"]) == BUG
    last = terminal.getvalue().rstrip().splitlines()[-1]
    assert last.startswith("sealfs: unexpected _Unprintable: (its message cannot be shown);")


def test_debug_variable_shows_the_traceback_and_keeps_the_code(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Regression: with the traceback came exit code 1, a failure, instead of a bug's."""
    monkeypatch.setenv(DEBUG_ENV, "1")
    monkeypatch.setattr(main_module, "setup_logging", _raise(RuntimeError("boom")))
    assert main(["status", "store"]) == BUG
    err = capsys.readouterr().err
    assert err.startswith("Traceback (most recent call last):"), err
    assert "RuntimeError: boom" in err
    assert err.rstrip().splitlines()[-1].startswith("sealfs: unexpected RuntimeError: boom;")


def test_ctrl_c_beside_a_bug_in_trio_reports_the_bug_on_one_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Regression: Ctrl-C met inside trio while another task raised made a group of
    both, which no clause of main caught: Python printed both tracebacks, the bug's
    message included, and exited 1."""
    monkeypatch.delenv(DEBUG_ENV, raising=False)
    group = BaseExceptionGroup("nursery", [KeyboardInterrupt(), KeyError("secret-plan.txt")])
    monkeypatch.setattr(main_module, "setup_logging", _raise(group))
    assert main(["status", "store"]) == BUG
    err = capsys.readouterr().err
    assert err.startswith("sealfs: unexpected KeyError: (message withheld"), err
    assert "\n" not in err.strip() and "secret-plan" not in err, err


def test_an_exit_inside_trio_beside_a_bug_ends_with_its_code(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Regression: a group of SystemExit and a bug was raised again as a group, which
    is no SystemExit: Python printed every member's traceback, the bug's message
    included, and exited 1 instead of the code the exit asked for."""
    monkeypatch.delenv(DEBUG_ENV, raising=False)
    group = BaseExceptionGroup("nursery", [SystemExit(3), KeyError("secret-plan.txt")])
    monkeypatch.setattr(main_module, "setup_logging", _raise(group))
    with pytest.raises(SystemExit) as exited:
        main(["status", "store"])
    assert exited.value.code == 3
    assert "secret-plan" not in capsys.readouterr().err


def test_ctrl_c_inside_trio_alone_is_an_interruption(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    group = BaseExceptionGroup("nursery", [KeyboardInterrupt(), KeyboardInterrupt()])
    monkeypatch.setattr(main_module, "setup_logging", _raise(group))
    assert main(["status", "store"]) == INTERRUPTED
    assert capsys.readouterr().err == "sealfs: interrupted\n"


@pytest.mark.parametrize(
    ("exc", "code"),
    [
        (ConfigError("bad option"), USAGE),
        (WrongKeyError("no"), WRONG_KEY),
        (KeyboardInterrupt(), INTERRUPTED),
    ],
)
def test_expected_errors_keep_their_codes(
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    exc: BaseException,
    code: int,
) -> None:
    """SealfsError and KeyboardInterrupt keep their codes, and are not called bugs."""
    monkeypatch.delenv(DEBUG_ENV, raising=False)
    monkeypatch.setattr(main_module, "setup_logging", _raise(exc))
    assert main(["status", "store"]) == code
    assert "bug" not in capsys.readouterr().err


def test_a_broken_pipe_that_is_not_stdout_is_reported(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Only a closed stdout ends quietly: a broken pipe elsewhere is an error to show."""
    monkeypatch.setattr(main_module, "setup_logging", _raise(BrokenPipeError(32, "Broken pipe")))
    assert main(["status", "store"]) == FAILURE
    assert capsys.readouterr().err.strip() == "sealfs: Broken pipe"


def _option_help(parser: argparse.ArgumentParser, option: str) -> str | None:
    for action in parser._actions:
        if option in action.option_strings:
            return action.help
    return None


def _all_parsers(
    parser: argparse.ArgumentParser, prog: str = "sealfs"
) -> list[tuple[str, argparse.ArgumentParser]]:
    found = [(prog, parser)]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                found += _all_parsers(sub, f"{prog} {name}")
    return found


def test_every_passphrase_file_option_names_the_other_sources() -> None:
    """Regression: `sealfs init --help` said only "read the passphrase from this file",
    though init, like every command, also reads SEALFS_PASSPHRASE_FILE and the
    sealfs-passphrase credential, and a user reading it took the prompt for the only
    other way."""
    helps = {
        prog: text
        for prog, parser in _all_parsers(build_parser())
        if (text := _option_help(parser, "--passphrase-file")) is not None
    }
    assert "sealfs init" in helps and "sealfs mount" in helps
    for prog, text in helps.items():
        assert "SEALFS_PASSPHRASE_FILE" in text, (prog, text)
        # Regression: only init's named the credential, which a unit's mount reads.
        assert "sealfs-passphrase systemd credential" in text, (prog, text)


def test_every_option_value_is_named_by_what_it_is() -> None:
    """Regression: --help showed argparse's names, "--passphrase-file PASSPHRASE_FILE",
    "--log-file LOG_FILE", "umount --timeout TIMEOUT", beside "--pkcs11-pin-file FILE",
    "--store-timeout SECONDS", and did not say in what unit a cache size is given."""
    for prog, parser in _all_parsers(build_parser()):
        for action in parser._actions:
            if action.option_strings and action.nargs != 0:
                assert action.metavar is not None, (prog, action.option_strings)


def test_the_default_paths_in_mount_help_are_those_the_readme_gives() -> None:
    """The log under $XDG_STATE_HOME if set; the cache named by URL and endpoint."""
    (mount,) = (parser for prog, parser in _all_parsers(build_parser()) if prog == "sealfs mount")
    assert "$XDG_STATE_HOME/sealfs/sealfs.log" in (_option_help(mount, "--log-file") or "")
    cache_help = _option_help(mount, "--cache-dir") or ""
    assert "$XDG_CACHE_HOME" in cache_help and "endpoint" in cache_help, cache_help


def test_store_timeout_help_speaks_of_the_command_it_is_on() -> None:
    """`sealfs init --help` (and status, key, rekey) said that "a mount's fsync then fails
    with EIO, and commits resume", which is true of a mount only: a command gives up."""
    helps = {}
    for prog, parser in _all_parsers(build_parser()):
        for action in parser._actions:
            if "--store-timeout" in action.option_strings:  # as --help prints it
                helps[prog] = parser._get_formatter()._expand_help(action)
    assert {"sealfs init", "sealfs status", "sealfs rekey", "sealfs key add"} <= set(helps)
    for prog, text in helps.items():
        if prog == "sealfs mount":
            assert "default 300" in text and "fsync" in text, text
        else:
            assert "default 30)" in text and "fsync" not in text, (prog, text)


def test_every_path_option_expands_a_leading_tilde(monkeypatch: pytest.MonkeyPatch) -> None:
    """Regression: the shell expands neither --cache-dir=~/cache nor a systemd unit's ~,
    and sealfs took such paths as they were: a directory named ~ was made in the working
    directory for the cache or the log, and a key file there was reported missing
    under a name that looked right. The store's path was already expanded."""
    monkeypatch.setenv("HOME", "/home/agent")
    seen = []
    for prog, parser in _all_parsers(build_parser()):
        for action in parser._actions:
            if not action.option_strings or not action.dest.endswith(("_file", "_dir", "_module")):
                continue
            seen.append(action.option_strings[0])
            convert = action.type  # what argparse applies to the option's value
            assert callable(convert), (prog, action.dest)
            assert convert("~/x") == "/home/agent/x", (prog, action.dest)
            assert convert("a/~/x") == "a/~/x", (prog, action.dest)
    expected = {"--passphrase-file", "--recovery-key-file", "--cache-dir", "--log-file"}
    assert expected | {"--new-recovery-key-file", "--pkcs11-pin-file"} <= set(seen), seen


def test_every_mountpoint_argument_expands_a_leading_tilde(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Regression: the store's path expanded a leading ~ and, since, every path option
    did, but not the mountpoint: in a systemd unit (which expands no ~) `sealfs mount
    ~/store ~/mnt` opened $HOME/store and mounted it on /~/mnt, and `sealfs status
    '~/mnt'` took a live mount for a store."""
    monkeypatch.setenv("HOME", "/home/agent")
    for argv in (
        ["mount", "~/store", "~/mnt"],
        ["sync", "~/mnt"],
        ["umount", "~/mnt"],
        ["status", "~/mnt"],
    ):
        args = parse(argv)
        where = args.target if argv[0] == "status" else args.mountpoint
        assert where == "/home/agent/mnt", (argv, where)
