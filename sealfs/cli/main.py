"""`sealfs`: the command-line entry point, and the boundary where errors become exit codes."""

from __future__ import annotations

import argparse
import errno
import importlib
import os
import re
import select
import sys
import traceback
from typing import Any, NoReturn, TextIO

from sealfs import __version__
from sealfs.cli.commands import COMMANDS
from sealfs.cli.coredumps import forbid_core_dumps
from sealfs.cli.exitcodes import BUG, FAILURE, INTERRUPTED, USAGE, exit_code
from sealfs.cli.logs import DEBUG_ENV, WITHHELD, setup_logging
from sealfs.cli.oserrors import describe_os_error
from sealfs.cli.stdio import discard_stdout, error_line, standard_streams, stdout_writable
from sealfs.errors import SealfsError, first_leaf


class OneLineParser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line, as every sealfs error is.

    argparse prints the whole usage block (a dozen lines for mount) above the
    message; the line names the command and where its usage is instead.
    add_subparsers makes the command parsers of the parser's own class, so
    they (and key's actions) inherit this.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        # An option is its whole name: with argparse's abbreviations, --passphrase SECRET
        # was --passphrase-file SECRET, whose error then quoted the secret, and a typo or
        # a guessed name could land on any option it began.
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        self.exit(USAGE, f"{self.prog}: {message} (see '{self.prog} --help')\n")


# Options a user may try to give a secret with: sealfs takes none on the command line.
_SECRET_OPTION = re.compile(r"--?(new-)?(pass|pin|secret|recovery-key|pkcs11-pin)", re.IGNORECASE)


def unrecognized(extra: list[str]) -> str:
    """The usage error for words no option or argument took, quoting no secret.

    The word after an unknown option is left out, as is what follows an option's "=":
    it is the option's value, and `--passphrase SECRET` is how a user who has not read
    the README would try to give one.
    """
    shown: list[str] = []
    secret = value_next = False
    for word in extra:
        if word.startswith("-"):
            name, has_value, _ = word.partition("=")
            shown.append(name)
            secret = secret or bool(_SECRET_OPTION.match(name))
            value_next = not has_value
        elif value_next:
            value_next = False
        else:
            shown.append(word)
    message = f"unrecognized arguments: {' '.join(shown)}"
    if "-v" in shown or "--verbose" in shown:
        message += "; --verbose (-v) goes before the command: 'sealfs -v COMMAND ...'"
    if secret:
        message += (
            "; secrets are never taken from the command line: put it in a file only you"
            " can read and give --passphrase-file FILE (--recovery-key-file,"
            " --pkcs11-pin-file, --new-passphrase-file likewise)"
        )
    return message


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The parser: complete for command (for every command if None), the others only listed.

    Imports only the module that defines command (see sealfs.cli.commands).
    """
    parser = OneLineParser(
        prog="sealfs", description="An encrypted filesystem whose store sees only sealed objects."
    )
    parser.add_argument("--version", action="version", version=f"sealfs {__version__}")
    parser.add_argument(
        "--verbose", "-v", action="store_true", help="log what the command does, with debug detail"
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    wanted = COMMANDS[command].module if command in COMMANDS else None
    for name, (module, help_text) in COMMANDS.items():
        if name in sub.choices:
            continue  # added with an earlier command of its module
        if command is None or module == wanted:
            importlib.import_module(module).add_parsers(sub)
        else:
            sub.add_parser(name, help=help_text)  # for --help; never parses: not the one run
    return parser


def command_in(argv: list[str]) -> str:
    """The command argv names: its first word that is not an option ("" if none).

    sealfs's own options (--verbose, --version, --help) take no value, so no
    option's value can come before the command.
    """
    return next((arg for arg in argv if not arg.startswith("-")), "")


def command_parser(
    parser: argparse.ArgumentParser, args: argparse.Namespace
) -> argparse.ArgumentParser:
    """The parser of the (sub)command args chose, e.g. that of `key remove`."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            chosen = action.choices.get(getattr(args, action.dest, None) or "")
            if chosen is not None:
                return command_parser(chosen, args)
    return parser


def parse(argv: list[str]) -> argparse.Namespace:
    """The parsed arguments; exits 2 with one line on a usage error.

    Unknown options are reported by the command's own parser (parse_args would
    blame the top one, "sealfs: unrecognized arguments"), so the line points
    at the right --help.
    """
    parser = build_parser(command_in(argv))
    try:
        args, extra = parser.parse_known_args(argv)
    except SystemExit:
        # --help and --version print, then exit: their output fails here, where main
        # reports it (a closed stdout), not in the flush at exit ("Exception ignored").
        sys.stdout.flush()
        raise
    if extra:
        command_parser(parser, args).error(unrecognized(extra))
    return args


def run(argv: list[str]) -> int:
    """Parse argv and run its command (errors are main's to report)."""
    args = parse(argv)
    # A mount sets its own (a log) once it serves.
    setup_logging(verbose=args.verbose, terminal=sys.stderr.isatty(), command=True)
    forbid_core_dumps()  # before any command reads a secret
    code: int = args.run(args)
    # Here, not at exit: with stdout a pipe (buffered, unless PYTHONUNBUFFERED is set)
    # the output is written only now, and a reader gone by then failed the flush at
    # exit, which printed "Exception ignored ... BrokenPipeError" and exited 120.
    sys.stdout.flush()
    return code


def report_bug(exc: BaseException) -> int:
    """One line for an exception no code path expected, instead of a traceback.

    Every error sealfs means to raise is a SealfsError (or an OSError) with its
    own message and code; anything else is a bug, and the line says so. Its
    message is shown on a terminal only: stderr elsewhere is a log (a systemd
    unit's journal, a file), and the message may quote a name (README, threat model).
    """
    if not (_on_terminal(sys.stderr) or os.environ.get(DEBUG_ENV) == "1"):
        message = WITHHELD
    else:
        try:
            message = str(exc)
        except Exception:  # a bug in the bug: the line and the code still say what it is
            message = "(its message cannot be shown)"
    text = " ".join(message.split()) or "(no message)"  # one line, even if the message is not
    error_line(
        f"unexpected {type(exc).__name__}: {text}; this is a bug in sealfs;"
        f" please report it (run with {DEBUG_ENV}=1 for the traceback)"
    )
    return BUG


def _on_terminal(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (OSError, ValueError):  # closed
        return False


def _stdout_reader_gone() -> bool:
    """Whether stdout is a pipe whose reading end was closed (a broken pipe elsewhere,
    a socket say, is an error to report)."""
    try:
        poller = select.poll()
        poller.register(sys.stdout.fileno(), select.POLLOUT)
        return any(events & select.POLLERR for _, events in poller.poll(0))
    except (OSError, ValueError):
        return False


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    standard_streams()
    try:
        return run(argv)
    except KeyboardInterrupt:
        error_line("interrupted")
        return INTERRUPTED
    except Exception as exc:
        return report_error(exc)
    except BaseExceptionGroup as group:
        # Ctrl-C met inside trio beside another task's error (a group of errors alone
        # is an Exception): it escaped main, and Python printed both, messages and all.
        _, rest = group.split(KeyboardInterrupt)
        if rest is None:
            error_line("interrupted")
            return INTERRUPTED
        leaf = first_leaf(rest)
        if isinstance(leaf, SystemExit):
            # The exit it asks for: the group raised again ended in Python's traceback of
            # every member, a bug's message included, and exit code 1.
            raise leaf from None
        return report_error(leaf)


def report_error(exc: BaseException) -> int:
    """One line for exc on stderr; its exit code."""
    if isinstance(exc, SealfsError):
        error_line(str(exc))
        return exit_code(exc)
    if isinstance(exc, OSError):
        if isinstance(exc, BrokenPipeError) and _stdout_reader_gone():
            # `sealfs status --json | head -1`: nothing to say, and the flush at exit
            # must not fail on the closed pipe again.
            discard_stdout()
            return FAILURE
        if exc.errno == errno.EBADF and not stdout_writable():
            # `sealfs status >&-`: said only "Bad file descriptor", then Python's flush at
            # exit failed on the same output again ("Exception ignored ...", exit 120).
            discard_stdout()
            error_line("cannot write the output: stdout is closed")
            return FAILURE
        error_line(describe_os_error(exc))
        return FAILURE
    if os.environ.get(DEBUG_ENV) == "1":
        # The traceback, then the same line and code: a script or a unit that
        # tells bugs from failures by the exit code must not see 1 instead.
        traceback.print_exception(exc)
    return report_bug(exc)


if __name__ == "__main__":
    sys.exit(main())
