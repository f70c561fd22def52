"""`sealfs`: the command-line entry point, and the boundary where errors become exit codes."""

from __future__ import annotations

import argparse
import sys

from sealfs import __version__
from sealfs.cli import init_cmd, key_cmd, mount_cmd, rekey_cmd, status_cmd
from sealfs.cli.exitcodes import FAILURE, USAGE, exit_code
from sealfs.cli.logs import setup_logging
from sealfs.errors import SealfsError


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="sealfs", description="An encrypted filesystem whose store sees only sealed objects."
    )
    parser.add_argument("--version", action="version", version=f"sealfs {__version__}")
    parser.add_argument("--verbose", "-v", action="store_true", help="log debug detail")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    init_cmd.add_parser(sub)
    mount_cmd.add_parsers(sub)
    status_cmd.add_parser(sub)
    key_cmd.add_parsers(sub)
    rekey_cmd.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
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
