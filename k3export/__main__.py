"""`python -m k3export ...`: the same as the `k3export` command."""

import sys

from k3export.cli import main

sys.exit(main())
