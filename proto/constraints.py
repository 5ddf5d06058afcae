"""Version constraints on requests (exact, minimum, staleness bound) and the lag of a version.

Invariants: an empty constraint accepts any committed version but never "no version" (0);
every field that is set must hold.
"""

from __future__ import annotations

from dataclasses import dataclass

from weftboard.proto.errors import InvalidArgument


@dataclass(frozen=True)
class VersionConstraint:
    """Which versions a request accepts: an exact version, a minimum, or a staleness bound.

    Fields may be combined; all that are set must hold. An empty constraint accepts any
    version (but never "no version at all").
    """

    exact: int | None = None
    minimum: int | None = None
    max_staleness: int | None = None

    def __post_init__(self) -> None:
        for field, value in (("exact", self.exact), ("minimum", self.minimum), ("max_staleness", self.max_staleness)):
            if value is not None and value < 0:
                raise InvalidArgument(f"version constraint {field} must be >= 0, got {value}")
        if self.exact is not None and self.exact == 0:
            raise InvalidArgument("version constraint exact must be >= 1")

    def accepts(self, version: int, head: int) -> bool:
        if version <= 0:
            return False
        if self.exact is not None and version != self.exact:
            return False
        if self.minimum is not None and version < self.minimum:
            return False
        return not (self.max_staleness is not None and head - version > self.max_staleness)

    @classmethod
    def parse(cls, text: str) -> VersionConstraint:
        """Parse the header form: ``exact=7``, ``min=5``, ``max_staleness=2``, comma separated."""
        values: dict[str, int] = {}
        aliases = {"exact": "exact", "min": "minimum", "minimum": "minimum", "max_staleness": "max_staleness"}
        for part in filter(None, (p.strip() for p in text.split(","))):
            key, sep, raw = part.partition("=")
            field = aliases.get(key.strip())
            if not sep or field is None:
                raise InvalidArgument(
                    f"bad version constraint {part!r}: use exact=N, min=N or max_staleness=N, comma separated"
                )
            try:
                values[field] = int(raw.strip())
            except ValueError:
                raise InvalidArgument(f"bad version constraint {part!r}: {raw.strip()!r} is not an integer") from None
        return cls(**values)


def lag(head: int, version: int) -> int:
    return max(head - version, 0)
