"""Exit codes and the one error type of the gate."""

from __future__ import annotations

from harness.errors import QuantbenchError

PASS, REGRESSION, ERROR = 0, 1, 2


class GateError(QuantbenchError):
    """The comparison cannot be made (exit code 2)."""
