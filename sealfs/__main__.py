"""`python -m sealfs` is the `sealfs` command, for a venv whose bin/ is not on PATH."""

import sys

from sealfs.cli.main import main

sys.exit(main())
