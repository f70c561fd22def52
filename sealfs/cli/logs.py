"""Logging set-up for the CLI and the daemon: one line per event, never secrets."""

from __future__ import annotations

import logging
import sys


def setup_logging(*, log_path: str | None, verbose: bool) -> None:
    handler: logging.Handler = (
        logging.FileHandler(log_path) if log_path else logging.StreamHandler(sys.stderr)
    )
    handler.setFormatter(
        logging.Formatter("%(asctime)s %(levelname)s %(name)s[%(process)d]: %(message)s")
    )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(logging.DEBUG if verbose else logging.INFO)
    for noisy in ("botocore", "boto3", "urllib3", "s3transfer"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
