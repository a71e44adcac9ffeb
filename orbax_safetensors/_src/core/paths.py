"""Names read from a checkpoint, as paths: the rule that keeps each inside the directory that
holds it, as far as the name alone tells, and the one wording of its error. Pure: what the
filesystem adds (symbolic links) is ``storage/confine.py``'s.

A name is a relative path below its directory: not empty, no NUL, no URL (``scheme://``), not
absolute (a path joined to an absolute one is that one), no ``..`` part.

Example::

    escape_problem("params.w")        # None
    escape_problem("/etc/passwd")     # 'an absolute path'
    raise escape_error("ckpt/_METADATA", "/etc/passwd", "ckpt", "an absolute path")
"""

from __future__ import annotations

from orbax_safetensors._src.core.errors import UnsafePathError


def escape_problem(name: object) -> str | None:
    """What makes ``name`` no relative path below a directory (``"an absolute path"``...),
    or None when it is one."""
    if not isinstance(name, str) or not name:
        return "not a file name"
    if "\0" in name:
        return "a NUL character"
    if "://" in name:
        return "a URL"
    if name.startswith(("/", "\\")):
        return "an absolute path"
    if ".." in name.replace("\\", "/").split("/"):
        return "a '..' part"
    return None


def escape_error(where: object, name: object, root: object, detail: str = "") -> UnsafePathError:
    """The one error for a name read from ``where`` (the file that holds it) that leads
    outside ``root`` (the directory that holds it); ``detail`` says how.

    Example::

        escape_error("ckpt/_METADATA", "/etc/passwd", "ckpt", "an absolute path")
        # ckpt/_METADATA: names '/etc/passwd', which leads outside ckpt (an absolute path);
        # a name read from a checkpoint must stay inside the directory that holds it (...)
    """
    return UnsafePathError(
        f"{where}: names {name!r}, which leads outside {root}"
        + (f" ({detail})" if detail else "")
        + "; a name read from a checkpoint must stay inside the directory that holds it (no "
        "absolute path, '..', URL or symbolic link out of it)"
    )
