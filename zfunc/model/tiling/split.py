"""How k tiles cut a size: ``_sizes`` (differing by at most one, the larger first) and ``_check_tiles``."""
from __future__ import annotations

from typing import Any


def _sizes(n: int, tiles: int) -> list[int]:
    """``tensor_split`` sizes: k tiles differing by at most one element, the larger first."""
    return [n // tiles + (i < n % tiles) for i in range(tiles)]


def _check_tiles(tiles: Any, size: int, what: str) -> None:
    if isinstance(tiles, bool) or not isinstance(tiles, int) or tiles < 1:
        raise ValueError(f"tiles: expected an int >= 1, got {tiles!r}")
    if tiles > size:
        raise ValueError(f"tiles: {tiles} tiles but {what} has only {size}; use at most {size}")
