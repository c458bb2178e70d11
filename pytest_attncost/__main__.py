"""``python -m pytest_attncost``: see :mod:`pytest_attncost.cli`."""

import sys

from .cli import main
from .errors import hidden

__tracebackhide__ = hidden  # pytest shows the user's frames, not these (see errors.hidden)

sys.exit(main())
