"""Legacy Flax msgpack (``flax.serialization.to_bytes``, ``flax.training.checkpoints``) ->
safetensors: the file is decoded whole (see ``catalog/flax_msgpack.py``, which executes
nothing), then written as one ``.safetensors`` file or as a step of a new CheckpointManager
root.

Example::

    flax_msgpack_to_safetensors("ckpts/checkpoint_3", "st_ckpts")   # st_ckpts/3/default
"""

from __future__ import annotations

import uuid
from typing import Any

from etils import epath

from orbax_safetensors._src.catalog import flax_msgpack as _flax_msgpack
from orbax_safetensors._src.core import casting as _casting
from orbax_safetensors._src.core import plan as _plan
from orbax_safetensors._src.core import select as _select
from orbax_safetensors._src.core.errors import SafetensorsCheckpointError
from orbax_safetensors._src.orbax import steps as _steps
from orbax_safetensors._src.orbax import v0 as _v0
from orbax_safetensors._src.pipeline import standalone as _standalone
from orbax_safetensors._src.storage import replace as _replace
from orbax_safetensors._src.tools import convert_output as _output
from orbax_safetensors._src.tools import terminal as _terminal


def flax_msgpack_to_safetensors(
    src: epath.PathLike,
    dst: epath.PathLike,
    *,
    step: int | None = None,
    max_file_size: int | None = _plan.DEFAULT_MAX_FILE_SIZE,
    progress: bool | None = None,
    select: _select.Selection | None = None,
    dtype: _casting.Policy | None = None,
) -> _output.ConvertSummary:
    """Converts a legacy Flax msgpack file into a ``.safetensors`` file or a new
    CheckpointManager root holding one step.

    The file is decoded whole (host memory: about twice its size) before anything is
    written; a truncated or forged file raises and writes nothing. Tensors get the dotted
    names ``flax.traverse_util.flatten_dict(state_dict, sep=".")`` gives; Python scalars and
    strings are kept in the tree schema, so ``load_file``/``SafetensorsRestore`` without a
    target give the state dict back.

    Args:
      src: a ``flax.serialization.to_bytes`` or ``flax.training.checkpoints`` file.
      dst: a path ending in ``.safetensors`` (one file), or a directory to create as a
        CheckpointManager root (the step under ``<dst>/<step>/default``).
      step: the step for a directory ``dst`` (default: from ``checkpoint_<step>``).
      max_file_size: split a directory's files at this size.
      progress: False: no progress bar; True or None: a bar on stderr when it is a terminal.
      select: convert only the leaves it selects (``convert(include=..., exclude=...)``).
      dtype: a parsed save-time dtype policy (``convert(dtype=...)``).

    Example::

        flax_msgpack_to_safetensors("ckpts/checkpoint_3", "st_ckpts")   # st_ckpts/3/default
        flax_msgpack_to_safetensors("flax_model.msgpack", "model.safetensors")
    """
    src, dst = epath.Path(src), epath.Path(dst)
    as_file = dst.suffix == ".safetensors"
    step = step if step is not None else _flax_msgpack.step_of(src)
    if not as_file and step is None:
        raise SafetensorsCheckpointError(
            f"{src}: no step in its name (checkpoint_<step>); pass --step (step=) or a "
            "destination ending in .safetensors"
        )
    if dst.exists() and (as_file or any(dst.iterdir())):
        raise FileExistsError(f"{dst} already exists; choose a new destination")
    source = _flax_msgpack.MsgpackSource(src)  # decoded (and checked) before anything is written
    tree, tensors = source.tree, source.tensors
    if select is not None:
        select.check(_flax_msgpack.flatten(tree), str(src))
        tree = _flax_msgpack.select(tree, select.selects)
        tensors = {n: t for n, t in tensors.items() if select.selects(n)}
    size = sum(t.nbytes for t in tensors.values())
    summary = _output.ConvertSummary(
        _output.TO_SAFETENSORS, [], [], len(tensors), size
    )  # a file: no items
    with _terminal.progress_bar(size, f"convert {src.name}", progress) as bar:
        if as_file:
            tmp = dst.parent / f".{dst.name}.converting-{uuid.uuid4().hex[:8]}"
            with _replace.made_parents(dst):
                try:
                    _standalone.save_file(
                        tree, tmp, {"converted_from": "flax-msgpack"}, dtype=dtype
                    )
                    tmp.rename(dst)
                finally:
                    if tmp.exists():
                        tmp.unlink()
        elif step is not None:  # (a directory without a step was refused above)
            summary.items = [f"{step}/default"]

            def write_root(tmp: epath.Path) -> _output.ConvertSummary:
                _save_step(tree, tmp, step, max_file_size, dtype)
                return summary

            _output.atomic(dst, write_root)
        bar.update(size)
    return summary


def _save_step(
    tree: Any,
    root: epath.Path,
    step: int,
    max_file_size: int | None,
    dtype: _casting.Policy | None = None,
) -> None:
    """Saves ``tree`` as step ``step`` of a new CheckpointManager root, through Orbax."""
    import orbax.checkpoint as ocp

    options = ocp.CheckpointManagerOptions(enable_async_checkpointing=False)
    handler = _v0.SafetensorsCheckpointHandler(max_file_size=max_file_size)
    with ocp.CheckpointManager(
        _steps.absolute(root), item_handlers=handler, options=options
    ) as mngr:
        mngr.save(step, args=_v0.SafetensorsSave(tree, dtype=dtype))
        mngr.wait_until_finished()
