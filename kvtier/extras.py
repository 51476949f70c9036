"""Optional dependencies (pip extras): a missing one is a one-line error that names the extra to install."""

from __future__ import annotations

import importlib
import importlib.util
from types import ModuleType

from kvtier.errors import KVTierError

#: module → (pip extra that installs it, what needs it)
EXTRAS = {
    "redis": ("redis", "a redis tier"),
    "matplotlib": ("plot", "a plot"),
}


class MissingExtra(KVTierError, ImportError):
    """An optional dependency is not installed; the message says which ``pip install`` brings it."""


def _message(module: str) -> str:
    extra, needed_by = EXTRAS[module]
    return f"{needed_by} needs the {module} package, which is not installed: pip install 'kvtier[{extra}]'"


def missing(module: str) -> str | None:
    """The error message if ``module`` (a key of :data:`EXTRAS`) is not installed, else None; imports
    nothing."""
    try:
        found = importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        found = False
    return None if found else _message(module)


def require(module: str) -> ModuleType:
    """Import ``module`` (a key of :data:`EXTRAS`), or raise :class:`MissingExtra` naming its extra."""
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as exc:
        if exc.name is None or exc.name.split(".")[0] != module:
            raise  # the package is there but broken: its own error says more
        raise MissingExtra(_message(module)) from None
