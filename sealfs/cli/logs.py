"""Logging set-up for the CLI and the daemon: one line per event, never secrets."""

from __future__ import annotations

import logging
import sys

from sealfs.cli.stdio import one_line


class OneLineFormatter(logging.Formatter):
    """Each event on one line, whatever its message holds: a store path or an error
    text from the service with a newline in it split an entry in two, and what
    followed the newline read as an entry of its own. A traceback (of a bug) keeps
    its lines."""

    def formatMessage(self, record: logging.LogRecord) -> str:
        return one_line(super().formatMessage(record))


def setup_logging(*, verbose: bool) -> None:
    """Log to stderr (the daemon's stderr is its log file)."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(
        OneLineFormatter("%(asctime)s %(levelname)s %(name)s[%(process)d]: %(message)s")
    )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(logging.DEBUG if verbose else logging.INFO)
    for noisy in ("botocore", "boto3", "urllib3", "s3transfer"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
