"""Forged and damaged checkpoints, generated in code (no binary blobs in the repository).

Every case starts from a valid file or directory written by the library and damages it by
hand: raw bytes, the JSON header, the stored schema or the directory's metadata file. Each case
says which error it must raise and a regex its message must match.

Kinds:
  ``"header"``: the safetensors header is hostile; ``read_header``, ``load_file`` and
    ``verify`` all fail.
  ``"schema"``: a valid safetensors file whose orbax-safetensors metadata (tree schema,
    checksums) is forged; ``read_header`` succeeds, ``load_file`` and ``verify`` fail.
  ``"dir"``: a checkpoint directory whose ``orbax_safetensors.json`` (or one of its files) is
    forged; ``restore_directory`` and ``verify`` fail.

Example::

    for case in all_cases():
        path = case.build(tmp_path / case.name)
        with pytest.raises(case.error, match=case.match):
            osf.load_file(path)
"""

from . import layout
from .bases import (
    CRC_KEY,
    MAX_HEADER,
    META_FILE,
    SCHEMA_KEY,
    Case,
    base_dir,
    base_file_bytes,
    base_tree,
    join,
    split,
)
from .dir_cases import dir_cases
from .header_cases import header_cases
from .schema_cases import schema_cases

__all__ = [
    "CRC_KEY",
    "MAX_HEADER",
    "META_FILE",
    "SCHEMA_KEY",
    "Case",
    "all_cases",
    "base_dir",
    "base_file_bytes",
    "base_tree",
    "dir_cases",
    "header_cases",
    "join",
    "schema_cases",
    "split",
]


def all_cases() -> list[Case]:
    """Every case of every kind."""
    return header_cases() + schema_cases() + dir_cases() + layout.cases()
