"""What every conversion shares: its summary, and output that appears only once complete
(written under a temporary sibling name, renamed at the end, removed on failure).

Example::

    summary = atomic("/new/ckpt", lambda tmp: write_everything_into(tmp))
"""

from __future__ import annotations

import dataclasses
import enum
import uuid
from collections.abc import Callable

from etils import epath

from orbax_safetensors._src.storage import confine as _confine
from orbax_safetensors._src.storage import replace as _replace


class Direction(enum.StrEnum):
    """Which way a conversion goes (string-valued: ``ConvertSummary.direction`` and messages
    show the value)."""

    SAFETENSORS = "safetensors"  # Orbax-native (or Flax msgpack) -> safetensors
    ORBAX = "orbax"  # safetensors -> Orbax-native


TO_SAFETENSORS, TO_ORBAX = Direction.SAFETENSORS, Direction.ORBAX


@dataclasses.dataclass
class ConvertSummary:
    """What a conversion did.

    Attributes:
      direction: ``"safetensors"`` (Orbax -> safetensors) or ``"orbax"`` (the reverse).
      items: converted item directories (relative to the destination; ``""`` for an item).
      copied: items copied unchanged (e.g. Orbax JSON items of a step).
      tensors: tensors converted.
      bytes: tensor bytes converted.
    """

    direction: Direction
    items: list[str] = dataclasses.field(default_factory=list)
    copied: list[str] = dataclasses.field(default_factory=list)
    tensors: int = 0
    bytes: int = 0


def fresh_destination(dst: epath.Path) -> epath.Path:
    """The temporary sibling to write ``dst`` into (its parent is not created here:
    :func:`atomic`); ``dst`` must not exist, or be an empty directory.

    Raises:
      FileExistsError: ``dst`` exists and is not an empty directory.
    """
    if dst.exists() and (not dst.is_dir() or any(dst.iterdir())):
        raise FileExistsError(f"{dst} already exists; choose a new destination")
    return dst.parent / f".{dst.name}.converting-{uuid.uuid4().hex[:8]}"


def commit(tmp: epath.Path, dst: epath.Path) -> None:
    """Renames the complete ``tmp`` to ``dst`` (removing the empty directory ``dst`` was)."""
    if dst.exists():
        dst.rmdir()  # the empty directory checked by fresh_destination
    tmp.rename(dst)


def copy_tree(root: epath.Path, name: str, dst: epath.Path) -> None:
    """Copies the file or directory tree ``name`` of the directory ``root`` (an entry a
    conversion keeps unchanged) to ``dst``: every entry checked to lie inside ``root`` and
    every file read as every file is (``storage/confine.py``, ``confine.read_file``: a
    symbolic link out of ``root`` or a FIFO is refused)."""
    src = _confine.inside(root, name)
    if src.is_dir():
        dst.mkdir(parents=True, exist_ok=True)
        for child in src.iterdir():
            copy_tree(root, f"{name}/{child.name}", dst / child.name)
    else:
        _confine.copy_file(src, dst)


def atomic(dst: epath.PathLike, write: Callable[[epath.Path], ConvertSummary]) -> ConvertSummary:
    """Runs ``write`` into a temporary sibling of ``dst`` and renames it to ``dst`` when it
    returns; on any failure the temporary directory is removed, with the parent directories
    created for it, and ``dst`` never appears."""
    dst = epath.Path(dst)
    tmp = fresh_destination(dst)
    with _replace.made_parents(dst):  # (removed again on failure, with the temporary one)
        try:
            summary = write(tmp)
            commit(tmp, dst)
        except BaseException:
            if tmp.exists():
                tmp.rmtree()
            raise
    return summary
