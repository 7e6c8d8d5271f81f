"""``python -m loadtests ...``: see :mod:`loadtests.cli`."""

import sys

from loadtests.cli import main

sys.exit(main())
