"""Selecting tensors by dotted name: ``include`` / ``exclude`` glob patterns.

A pattern is a case-sensitive ``fnmatch`` glob over dotted names (``*`` crosses dots) that also
selects everything beneath a name it matches: ``params`` selects ``params.layers.0.b``,
``layers.1`` selects ``layers.1.w`` but not ``layers.10.w``. A name is selected when it (or a
dotted prefix) matches an ``include`` pattern (no ``include``: every name) and none matches an
``exclude`` pattern. A pattern that matches no name is an error: a typo never selects nothing
in silence.
"""

from __future__ import annotations

import difflib
import fnmatch
import re
from collections.abc import Iterable, Sequence

from orbax_safetensors._src.core.errors import TargetMismatchError

Patterns = str | Sequence[str] | None


def _patterns(value: Patterns, what: str) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, str):
        value = (value,)
    elif not isinstance(value, Sequence):
        raise TypeError(
            f"{what} must be a glob string or a sequence of them, not {type(value).__name__}"
        )
    out = []
    for p in value:
        if not isinstance(p, str) or not p:
            raise TypeError(f"{what} patterns must be non-empty strings, got {p!r}")
        out.append(p)
    return tuple(out)


def _compile(patterns: tuple[str, ...]) -> re.Pattern[str] | None:
    # One regex for all patterns: each matches a name, or a dotted prefix of it (``p.*``).
    if not patterns:
        return None
    parts = [fnmatch.translate(p) for p in patterns]
    parts += [fnmatch.translate(p + ".*") for p in patterns]
    return re.compile("|".join(f"(?:{p})" for p in parts))


class Selection:
    """Which dotted names a restore reads (see the module docstring); ``include`` and
    ``exclude`` hold the patterns."""

    __slots__ = ("_exclude", "_include", "exclude", "include")

    def __init__(self, include: tuple[str, ...], exclude: tuple[str, ...]) -> None:
        self.include, self.exclude = include, exclude
        self._include, self._exclude = _compile(include), _compile(exclude)

    @classmethod
    def of(cls, include: Patterns = None, exclude: Patterns = None) -> Selection | None:
        """The selection of ``include`` and ``exclude`` (a glob or a sequence of globs), or
        None when both are None (everything).

        Raises:
          TypeError: a pattern that is not a non-empty string.
        """
        inc, exc = _patterns(include, "include"), _patterns(exclude, "exclude")
        if include is not None and not inc:
            raise TypeError("include=[] selects nothing; pass None to select everything")
        return cls(inc, exc) if inc or exc else None

    def selects(self, name: str) -> bool:
        """Whether ``name`` is selected."""
        if self._include is not None and self._include.match(name) is None:
            return False
        return self._exclude is None or self._exclude.match(name) is None

    def check(self, names: Iterable[str], where: str = "the checkpoint") -> None:
        """Raises unless every pattern matches one of ``names`` and something is selected.

        Raises:
          TargetMismatchError: naming the patterns that match nothing and a few names of
            ``where`` (the closest ones first).
        """
        names = list(names)
        dead = []
        for kind, patterns in (("include", self.include), ("exclude", self.exclude)):
            for p in patterns:
                one = _compile((p,))
                assert one is not None
                if not any(one.match(n) for n in names):
                    dead.append((kind, p))
        if dead:
            lines = [f"{kind} pattern {p!r} matches no name in {where}" for kind, p in dead]
            raise TargetMismatchError("; ".join(lines) + _names_hint(names, dead[0][1]))
        if not any(self.selects(n) for n in names):
            raise TargetMismatchError(
                f"include={list(self.include)!r} with exclude={list(self.exclude)!r} selects "
                f"nothing in {where}" + _names_hint(names, self.include[0] if self.include else "")
            )

    def __repr__(self) -> str:
        return f"Selection(include={list(self.include)!r}, exclude={list(self.exclude)!r})"


def _names_hint(names: Sequence[str], pattern: str) -> str:
    if not names:
        return "; it holds no names at all"
    close = difflib.get_close_matches(pattern.replace("*", ""), names, n=5, cutoff=0.3)
    shown = list(dict.fromkeys([*close, *names[:5]]))[:8]
    more = f", ... ({len(names)} names)" if len(names) > len(shown) else ""
    return (
        f"; names there look like: {', '.join(shown)}{more} (patterns are fnmatch globs over "
        "dotted names; '*' crosses dots; a pattern also selects everything beneath a name)"
    )
