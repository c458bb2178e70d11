"""A griffe extension for the API reference: the docstrings' Sphinx roles rendered as code.

The package's docstrings use Sphinx roles (``:class:`~pytest_attncost.result.Profile```), which read
well in ``help()`` and editors; mkdocstrings would print them raw. Here each becomes inline code, the
last component for a ``~`` reference (``Profile``), the whole target otherwise.
"""

from __future__ import annotations

import re
from typing import Any

import griffe

ROLE = re.compile(r":(?:py:)?(?:class|func|meth|attr|mod|data|exc|obj|const):`(~?)([^`]+)`")


def plain(text: str) -> str:
    """*text* with every Sphinx role replaced by inline code."""
    return ROLE.sub(lambda m: f"`{m.group(2).rpartition('.')[2] if m.group(1) else m.group(2)}`", text)


class SphinxRoles(griffe.Extension):
    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = plain(obj.docstring.value)
