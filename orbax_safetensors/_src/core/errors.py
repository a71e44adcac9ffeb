"""The library's exceptions: one hierarchy under :class:`SafetensorsCheckpointError`, every
class a ``ValueError`` (:class:`MetadataError` also a ``TypeError``, ``osf.ObjectStoreError``
also an ``OSError``). Messages name the offending key, file, shape and dtype, and say what was
expected.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Iterable
from typing import Any


class SafetensorsCheckpointError(ValueError):
    """Base class of every error raised by orbax_safetensors about data or files.

    Example::

        try:
            tree = osf.load_file(path)
        except osf.SafetensorsCheckpointError as e:
            print(e)  # names the file, key and numbers involved, and what was expected
    """


class HeaderError(SafetensorsCheckpointError):
    """A ``.safetensors`` file's header is malformed, inconsistent or hostile.

    Example: ``osf.read_header(path)`` of a truncated file raises it, naming the file."""


class NotSafetensorsError(HeaderError):
    """The path is not a safetensors file but something recognisable (a Flax msgpack
    checkpoint, a pickle, a zip, an Orbax directory...); the message says what and what to
    run instead.

    Example::

        try:
            osf.read_header("flax_model.msgpack")
        except osf.NotSafetensorsError as e:
            e.found.kind, e.found.suggestion   # 'flax-msgpack', 'Convert it: ...'
    """

    def __init__(self, message: str, found: Any = None) -> None:
        super().__init__(message)
        self.found = found


class SchemaError(SafetensorsCheckpointError):
    """The JSON tree schema stored with a checkpoint is malformed or inconsistent.

    Example: ``osf.load_file(path)`` of a file whose schema names an unknown kind raises it."""


class UnsafePathError(SafetensorsCheckpointError):
    """A path refused before anything is read from it: a name read from a checkpoint that
    leads outside the directory holding it (absolute, ``..``, a URL, a symbolic link out of
    it), or a file that is not a regular file (a FIFO, device, socket or directory).

    Example: an index naming ``../other.safetensors`` raises it before anything is read."""


class UnsupportedLeafError(SafetensorsCheckpointError):
    """A pytree leaf (or its dtype) cannot be stored; nothing was written.

    Example: ``osf.save_file({"f": print}, path)`` raises it, naming the leaf ``f``."""


class DeletedArrayError(UnsupportedLeafError):
    """A ``jax.Array`` leaf has been deleted (donated); nothing was written.

    Example: saving ``state`` after ``jax.jit(step, donate_argnums=0)(state)`` raises it."""


class MetadataError(SafetensorsCheckpointError, TypeError):
    """User metadata of a checkpoint directory is not JSON-serialisable.

    Example: ``SafetensorsSave(state, metadata={"when": datetime.now()})`` raises it."""


class MismatchKind(enum.Enum):
    """What kind of disagreement a :class:`Mismatch` records."""

    MISSING = "missing"  # the target has the key, the checkpoint does not
    UNEXPECTED = "unexpected"  # the checkpoint has the key, the target does not
    STRUCTURE = "structure"  # a leaf or empty node in one, a subtree in the other
    SHAPE = "shape"  # the stored shape is not the target's
    KIND = "kind"  # the target asks for something the stored value cannot give
    SHARDING = "sharding"  # the saved sharding cannot be rebuilt and the target gives none


@dataclasses.dataclass(frozen=True)
class Mismatch:
    """One disagreement between a restore target and a checkpoint, at one dotted key.

    Attributes:
      key: the dotted name.
      kind: what disagrees.
      detail: a sentence saying what (without the key, without advice).
      saved, wanted: what the checkpoint holds and what the target asks (a shape, a
        structure's description), where that applies.
      resizable: a shape mismatch that padding or truncating would resolve.
    """

    key: str
    kind: MismatchKind
    detail: str = ""
    saved: Any = None
    wanted: Any = None
    resizable: bool = False


class TargetMismatchError(SafetensorsCheckpointError):
    """The restore target disagrees with the checkpoint (keys, shapes, dtypes); the message
    lists every disagreement at once, and ``mismatches`` each as a :class:`Mismatch` (empty for
    errors about no one key, such as an include pattern that matches nothing).

    Example::

        try:
            osf.load_file("model.safetensors", target)
        except osf.TargetMismatchError as e:
            missing = [m.key for m in e.mismatches if m.kind.value == "missing"]
    """

    def __init__(self, message: str, mismatches: Iterable[Mismatch] = ()) -> None:
        super().__init__(message)
        self.mismatches: tuple[Mismatch, ...] = tuple(mismatches)


class IntegrityError(SafetensorsCheckpointError):
    """Stored bytes do not match their recorded checksum.

    Example: ``osf.load_file(path)`` of a file with a flipped bit raises it, naming the tensor."""


class ConfigError(SafetensorsCheckpointError):
    """A model config's value that shapes a tensor (``vocab_size``, heads, ``head_dim``...) is
    impossible: not a positive whole number, or not dividing what it must divide.

    Example: a preset reading a ``config.json`` whose ``num_attention_heads`` is 0 raises it."""
