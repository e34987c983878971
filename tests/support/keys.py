"""Keys of the callers' own types."""

from __future__ import annotations


class Named:
    """A key with ``__hash__`` and ``__eq__`` of its own: equal to its name and to any ``Named`` of that name."""

    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name

    def __hash__(self) -> int:
        return hash(self.name)

    def __eq__(self, other: object) -> bool:
        return other == self.name if isinstance(other, str) else isinstance(other, Named) and other.name == self.name

    def __repr__(self) -> str:
        return f"Named({self.name!r})"
