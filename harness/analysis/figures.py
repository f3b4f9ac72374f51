"""Saving a matplotlib figure the one way every report figure is saved (report, roofline, crossover, scaling)."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def save(fig: Any, path: str | Path, dpi: int | None = None) -> Path:
    """Lay out, write (creating the folder) and close `fig`; returns the path written."""
    import matplotlib.pyplot as plt  # heavy: only when a figure is drawn

    path = Path(path)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, **({"dpi": dpi} if dpi else {}))
    plt.close(fig)
    return path
