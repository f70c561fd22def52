"""`sealfs`: the command-line entry point, and the boundary where errors become exit codes."""

from __future__ import annotations

import argparse
import importlib
import sys

from sealfs import __version__
from sealfs.cli.commands import COMMANDS
from sealfs.cli.exitcodes import FAILURE, USAGE, exit_code
from sealfs.cli.logs import setup_logging
from sealfs.errors import SealfsError


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The parser: complete for command (for every command if None), the others only listed.

    Imports only the module that defines command (see sealfs.cli.commands).
    """
    parser = argparse.ArgumentParser(
        prog="sealfs", description="An encrypted filesystem whose store sees only sealed objects."
    )
    parser.add_argument("--version", action="version", version=f"sealfs {__version__}")
    parser.add_argument("--verbose", "-v", action="store_true", help="log debug detail")
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


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser(command_in(argv)).parse_args(argv)
    setup_logging(log_path=None, verbose=args.verbose)
    try:
        code: int = args.run(args)
    except SealfsError as exc:
        print(f"sealfs: {exc}", file=sys.stderr)
        return exit_code(exc)
    except KeyboardInterrupt:
        print("sealfs: interrupted", file=sys.stderr)
        return USAGE
    except OSError as exc:
        print(f"sealfs: {exc.strerror or exc}: {exc.filename or ''}".rstrip(": "), file=sys.stderr)
        return FAILURE
    return code


if __name__ == "__main__":
    sys.exit(main())
