"""The errors a user of the API sees: one type, whose message names the problem and the fix.

:class:`ProfileError` is raised by ``profile()``, ``sweep()``, ``decode_sweep()`` and ``measure()``
for bad arguments and for models that cannot be counted; :class:`CountError` is the subclass
raised where a counter failed, :class:`TimingError` where a timed run could not be made. The
model's name is put in front of the message in one place (:func:`named`), by the pipeline.
"""

from __future__ import annotations

__all__ = ["CountError", "ProfileError", "TimingError", "named"]


class ProfileError(ValueError):
    """Something that cannot be counted, or bad arguments; the message names the fix."""


class CountError(ProfileError):
    """A counter could not count the model; the message carries the counter's reason and the fix."""


class TimingError(ProfileError):
    """``measure()`` could not time the model; the message names the fix."""


def named(name: str, exc: ProfileError) -> ProfileError:
    """*exc* with the model's name in front of its message (once), as the same type."""
    message = str(exc)
    if message.startswith(f"{name}: ") or message.startswith(f"{name} "):
        return exc
    renamed = type(exc)(f"{name}: {message}")
    renamed.__cause__ = exc.__cause__
    return renamed
