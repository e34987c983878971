"""The common case of a call's argument check, at C speed (``call_checks.c``)."""

from collections.abc import Hashable

def block_mapping(blocks: object, num_blocks: int, unique: bool, /) -> dict[Hashable, int] | None: ...
