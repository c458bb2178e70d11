"""``python -m pytest_attncost``: see :mod:`pytest_attncost.cli`."""

import sys

from .cli import main
from .errors import hidden as __tracebackhide__  # noqa: F401  pytest reads it (errors.hidden)

sys.exit(main())
