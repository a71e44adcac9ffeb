"""A Hugging Face export written to ``s3://`` or ``gs://`` by every process of a
multi-process JAX job (``sharded_export.write_processes`` hands it this process's pieces).

Object storage has no rename, so the export goes straight into its directory:

1. the primary deletes the old export's model files and index (``storage/replace.
   remove_owned``: the index first); a barrier;
2. the files are uploaded a group at a time (consecutive files of at most ``batch_bytes`` x N
   bytes; a larger file alone), each group as one spread save of a multi-process checkpoint
   (``storage/router.prepare_directory`` / ``finish_files``, ``storage/objstore/spread``):
   each process uploads its own bytes, the part building is shared by the processes, and
   each file appears whole once its upload is completed or its top level composed. A file's
   parts are planned from every process's byte ranges of it, so each process holds its share
   of one group in host memory (about ``batch_bytes``), not of the model. A barrier, and the
   primary commits the group (``finalize_files``);
3. once every file is complete, the primary writes the index and the small files
   (``config.json``, ``generation_config.json``, the tokenizer's): a reader
   never follows them to a missing, old or partial file. A last barrier.

Example::

    # every process, with ``items`` from sharded_export (pieces, and each link once done)
    stats = write_objects("gs://b/hf", plan, links, tied, items, {"config.json": text},
                          batch_bytes=256 << 20)
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import jax
from etils import epath

from orbax_safetensors._src.compat import multihost as _multihost
from orbax_safetensors._src.core import plan as _plan
from orbax_safetensors._src.integrations import links as _links
from orbax_safetensors._src.pipeline import checkpoint_save as _checkpoint_save
from orbax_safetensors._src.pipeline import pieces as _pieces
from orbax_safetensors._src.storage import interface as _interface
from orbax_safetensors._src.storage import replace as _replace
from orbax_safetensors._src.storage import router as _router

Pieces = tuple[int, list[_interface.Piece]]


def _barrier(name: str) -> None:
    _multihost.barrier(f"orbax_safetensors.export_objects.{name}")


def write_objects(
    directory: epath.Path,
    plan: _plan.CheckpointPlan,
    links: Sequence[_links.Link],
    tied: Mapping[str, str],
    items: Iterator[Any],
    extra_files: Mapping[str, str | bytes],
    *,
    batch_bytes: int,
) -> _pieces.WriteStats:
    """Writes ``plan``'s files into the object-storage ``directory`` from every process (see
    the module docstring): ``items`` yields this process's pieces ``(file index, pieces)``
    link by link, in the order of ``links`` on every process, and each link (a
    ``links.Link``) once its pieces are out; ``tied`` keys are not written. ``extra_files``
    (``{name: text or bytes}``) are written by the primary, last. Returns what this process
    wrote.
    """
    primary = jax.process_index() == 0
    if primary:
        _replace.remove_owned(directory)
    _barrier("cleared")
    # The links each file's tensors come from: a file is complete once they all are.
    waiting: list[set[int]] = [set() for _ in plan.files]
    for k, link in enumerate(links):
        for key in link.torch:
            if key not in tied:
                waiting[plan.file_of[key]].add(k)
    number = {id(link): k for k, link in enumerate(links)}
    ahead: dict[int, list[Pieces]] = {}  # (a link's pieces in a later file than the one written)

    def file_pieces(i: int) -> Iterator[Pieces]:
        yield from ((0, p) for _, p in ahead.pop(i, []))
        while waiting[i]:
            item = next(items)
            if isinstance(item, _links.Link):  # all of this link's pieces are out
                for w in waiting:
                    w.discard(number[id(item)])
            elif item[0] == i:
                yield 0, item[1]
            else:
                ahead.setdefault(item[0], []).append(item)

    stats = _pieces.WriteStats()
    try:
        for g, group in enumerate(file_groups(plan, batch_bytes * jax.process_count())):
            files = [plan.files[i] for i in group]
            # every process, in the same order (a spread save); the primary commits it
            sizes = [(f.filename, f.size) for f in files]
            _router.prepare_directory(directory, sizes, is_primary=primary)
            part = _plan.CheckpointPlan(
                files, {n: j for j, f in enumerate(files) for n in f.entries}
            )
            pieces = (
                (j, p) for j, i in enumerate(group) for _, p in file_pieces(i)
            )  # (in file order: a file's pieces are out once its links are)
            # (no index: the primary writes the export's own once every file is complete)
            _checkpoint_save.write_unchecksummed(
                part,
                pieces,
                directory,
                jax.process_index(),
                primary=primary,
                index=False,
                stats=stats,
            )
            _barrier(f"group.{g}")  # (without JAX's key-value store, nothing else waits)
            if primary:
                _router.finalize_files(directory)  # (the commit record of its uploads deleted)
        for item in items:  # (nothing but the last marks: the reading thread ends)
            if not isinstance(item, _links.Link):
                raise RuntimeError(f"internal: pieces of file {item[0]} after its upload")
    except BaseException as error:
        # The others stop waiting for this process; the primary removes what this group's
        # save uploaded (the files before it are complete; no index names them).
        _router.abandon_files(directory, error)
        raise
    _barrier("written")
    if primary:
        _checkpoint_save.write_small_files(directory, extra_files)
    _barrier("done")
    return stats


def file_groups(plan: _plan.CheckpointPlan, max_bytes: int) -> list[list[int]]:
    """``plan``'s file indices in groups of consecutive files of at most ``max_bytes`` bytes
    (a larger file alone).

    Example::

        file_groups(plan, 2 * (256 << 20))   # [[0, 1], [2], ...]
    """
    groups: list[list[int]] = []
    size = 0
    for i, f in enumerate(plan.files):
        if not groups or size + f.size > max_bytes:
            groups.append([])
            size = 0
        groups[-1].append(i)
        size += f.size
    return groups
