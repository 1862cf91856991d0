"""`python -m jobs.cli`: the same as the `freight` command."""

import sys

from jobs.cli.main import main

sys.exit(main())
