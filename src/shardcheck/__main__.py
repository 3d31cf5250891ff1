"""``python -m shardcheck``: the same command line as the ``shardcheck`` script."""

import sys

from shardcheck.cli import main

sys.exit(main())
