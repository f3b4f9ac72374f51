"""The one exception type a user should ever see from quantbench.

Every check that can fail on bad input raises :class:`QuantbenchError` with a single line that names
the field (or the missing piece) and says what to do. ``run.py`` prints that line and exits 2, so a
typo costs a second, not a model load.
"""

from __future__ import annotations


class QuantbenchError(Exception):
    """A user-facing error: one line, names the problem and the fix."""


class Unsupported(QuantbenchError):
    """This run cannot run on this machine (e.g. it needs CUDA): not a bug, not bad input.

    A sweep records such a cell as SKIPPED with this one-line reason and goes on; the sweep still
    succeeds. Raise it from preflight checks only (before anything loads).
    """


class ConfigError(QuantbenchError):
    """One or more configuration problems, all reported at once (one per line)."""

    def __init__(self, problems: list[str]):
        self.problems = list(problems)
        super().__init__("; ".join(self.problems) if len(self.problems) == 1 else
                         f"{len(self.problems)} config problems: " + "; ".join(self.problems))


def one_of(field: str, value: object, allowed: list[str] | tuple[str, ...]) -> str | None:
    """Return an error line if ``value`` is not in ``allowed``, else None."""
    if value in allowed:
        return None
    return f"{field}={value!r} is not allowed; choose one of: {', '.join(map(str, allowed))}"


def require(problems: list[str], ok: bool, message: str) -> None:
    """Append ``message`` to ``problems`` when ``ok`` is false (collect-all validation)."""
    if not ok:
        problems.append(message)


def raise_if(problems: list[str]) -> None:
    if problems:
        raise ConfigError(problems)
