"""The errors a user of the API sees: one type, whose message names the problem and the fix.

Its subclasses, the model's name, and the package's frames hidden: docs/architecture.md, "Errors".
"""

from __future__ import annotations

import linecache
import os
import sysconfig
import traceback
from typing import Any

__all__ = ["CheckFailed", "CountError", "ProfileError", "TimingError", "hidden", "hint", "named", "site"]

_PACKAGE = os.path.dirname(os.path.abspath(__file__)) + os.sep


def hidden(excinfo: Any) -> bool:
    """pytest's ``__tracebackhide__`` for the package's frames: hidden when *excinfo* is one of the package's
    own errors (a message for the user) or was raised outside the package (the user's model, torch);
    shown when the package's own code failed (a bug to report, traceback and all)."""
    if excinfo is None:
        return True
    value = excinfo.value
    if any(cls.__module__ == "_pytest.outcomes" for cls in type(value).__mro__):
        return False  # pytest.fail(..., pytrace=False) from the plugin: pytest prints the message alone
    if type(value).__module__.startswith(__package__ or "pytest_attncost"):
        return True
    tb = value.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    return tb is None or not os.path.abspath(tb.tb_frame.f_code.co_filename).startswith(_PACKAGE)


__tracebackhide__ = hidden


class ProfileError(ValueError):
    """Something that cannot be counted, or bad arguments; the message names the fix."""


class CheckFailed(AssertionError):
    """A check the user called failed (``Profile.check_formula``): an assertion of theirs, so pytest locates it
    at their line, the package's frames hidden (see :func:`hidden`)."""


class CountError(ProfileError):
    """A counter could not count the model; the message carries the counter's reason and the fix."""


class TimingError(ProfileError):
    """``measure()`` could not time the model; the message names the fix."""


def named(name: str, exc: ProfileError) -> ProfileError:
    """*exc* with the model's name in front of its message (once), as the same type."""
    if (message := str(exc)).startswith((f"{name}: ", f"{name} ")):
        return exc
    renamed = type(exc)(f"{name}: {message}")
    renamed.__cause__ = exc.__cause__
    return renamed


#: Code that is not the model's: the counters, the plugin, pytest and the standard library.
_NOT_THE_MODEL = tuple(f"{os.sep}{name}{os.sep}"
                       for name in ("torch", "fvcore", "pytest_attncost", "_pytest", "pluggy"))
_STDLIB = sysconfig.get_paths()["stdlib"]

#: What a failure's message says when the forward read a tensor's values, which meta and fake tensors lack.
VALUE_READS = ("Cannot copy out of meta tensor", "on meta tensors", "DataDependentOutput", "data-dependent",
               "_local_scalar_dense", "cannot be converted to Python")

#: A failure's cause, told by its message, and the fix for it (the first that matches).
_CAUSES = (
    (("unsupported scalarType", "autocast"),
     "the model enters torch.autocast (or asks for its dtype) with device_type taken from a tensor, which is "
     "'meta' while counting and unknown to autocast: take the device type from the config or guard it with "
     "`if x.device.type != 'meta'`, or pass the model built on the CPU (not a factory)"),
    (VALUE_READS,
     "forward() reads tensor values (.item(), bool(tensor), .tolist(), printing, .cpu() or numpy), which a "
     "counted forward does not have: read them from the config or the inputs' shapes, or pass the model built "
     "on the CPU (not a factory) so that the torch backend runs it on real tensors at small n"),
    (("nonzero", "DynamicOutputShape"),
     "forward() picks rows by their values (nonzero, where or a boolean mask: mixture-of-experts routing as "
     "transformers 4 writes it), which a counted forward does not have: pass the model built on the CPU (not a "
     "factory) so that the torch backend runs it on real tensors at small n; transformers 5 runs most families' "
     "experts as matrix products the meta device counts (DBRX still routes its by value)"),
    (("same device", "found at least two devices", "meta and cpu", "cpu and meta"),
     "forward() mixes the model's tensors with a tensor it holds outside its parameters and buffers (a plain "
     "attribute, or a closure over a real tensor), which does not move with the model: register it with "
     "self.register_buffer(...)"),
    (("Boolean value of Tensor", "symbolic", "guard"),
     "forward() branches in Python on tensor values: branch on shapes or on the config instead"),
)
_DEFAULT_HINT = "make forward() traceable (no Python control flow on tensor values), or pass inputs= that it accepts"


def site(exc: BaseException, model: Any) -> str:
    """Where in *model* the failure *exc* happened: the innermost module on the stack (its dotted name and
    class) and the model's own source line, as ``in blocks.0.attn (Attention) at file.py:12 (`code`)``;
    empty when the traceback holds neither."""
    names = {id(module): name for name, module in model.named_modules()} if hasattr(model, "named_modules") else {}
    module = line = ""
    for frame, number in traceback.walk_tb(exc.__traceback__):
        owner = frame.f_locals.get("self")
        if owner is not None and id(owner) in names:
            module = f" in {names[id(owner)] or 'the model'} ({type(owner).__name__})"
        file = frame.f_code.co_filename
        if not (file.startswith("<") or file.startswith(_STDLIB) and "site-packages" not in file
                or any(part in file for part in _NOT_THE_MODEL)):
            line = f" at {file}:{number} (`{linecache.getline(file, number).strip()}`)"
    return module + line


def hint(reason: str) -> str:
    """The fix for a counter's failure, by its cause as the message tells it."""
    return next((fix for needles, fix in _CAUSES if any(needle in reason for needle in needles)), _DEFAULT_HINT)
