"""``python -m pytest_attncost``: see :mod:`pytest_attncost.cli`."""

import sys

from .cli import main

sys.exit(main())
