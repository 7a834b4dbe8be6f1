"""``python -m llamapool``: the same as the ``llamapool`` command."""

import sys

from llamapool.cli import main

sys.exit(main())
