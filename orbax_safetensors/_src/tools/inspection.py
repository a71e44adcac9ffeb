"""``orbax-safetensors inspect``: what a path holds (files, items, steps of a root), as a
JSON-able report and as text; and the words of every tool's output (counts, sizes, progress
bars, shown on a terminal only).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from etils import epath

from orbax_safetensors._src.catalog import flax_msgpack as _flax_msgpack
from orbax_safetensors._src.catalog import listing as _listing
from orbax_safetensors._src.core import select as _select
from orbax_safetensors._src.core import sniff as _sniff
from orbax_safetensors._src.core.errors import SafetensorsCheckpointError
from orbax_safetensors._src.orbax import completeness as _completeness
from orbax_safetensors._src.orbax import steps as _steps
from orbax_safetensors._src.orbax.steps import PathKind

if TYPE_CHECKING:
    from orbax_safetensors._src.catalog.sources import TensorSource

# What a damaged or half-deleted checkpoint may raise while being read (Orbax's readers raise
# ValueError subclasses too).
_UNREADABLE = (ValueError, OSError, EOFError)


def _disk_bytes(path: epath.Path) -> int:
    if path.is_dir():
        return sum(_disk_bytes(p) for p in path.iterdir())
    st = path.stat()
    return int(getattr(st, "st_size", getattr(st, "length", 0)))


def _open(path: epath.Path, kind: PathKind | None = None) -> TensorSource | _listing.FileTable:
    """The table of what ``path`` (of ``kind``, a directory when None) holds: a safetensors
    file from its header alone, so that ``inspect FILE`` imports no JAX and no Orbax; anything
    else through ``catalog.sources``, imported when first needed."""
    if kind is PathKind.FILE and not _flax_msgpack.is_flax_msgpack(path):
        return _listing.list_file(path)
    from orbax_safetensors._src.catalog import sources

    return sources.open_source(path)


class _Inspection:
    """The reports of one :func:`inspect_path`: the tensors they list (those ``select``
    selects), and every name seen, to check the patterns against once the report is built."""

    def __init__(self, select: _select.Selection | None = None) -> None:
        self.select = select
        self.seen: list[str] = []

    def source(self, source: TensorSource | _listing.FileTable) -> dict[str, Any]:
        tensors = list(source.tensors.values())
        if self.select is not None:
            self.seen += source.tensors
            tensors = [t for n, t in source.tensors.items() if self.select.selects(n)]
        return {
            "path": str(source.path),
            "kind": source.kind,
            "num_tensors": len(tensors),
            "total_bytes": sum(t.nbytes for t in tensors),
            "metadata": source.metadata,
            "tensors": [t.to_json() for t in tensors],
        }

    def step(self, path: epath.Path) -> dict[str, Any]:
        items: dict[str, Any] = {}
        other: list[str] = []
        for name, kind in _steps.list_items(path).items():
            if kind in _steps.TENSOR_KINDS:
                items[name] = self.source(_open(path / name))
            else:
                other.append(name)
        return {
            "path": str(path),
            "kind": "step",
            "items": items,
            "other_items": other,
            "num_tensors": sum(i["num_tensors"] for i in items.values()),
            "total_bytes": sum(i["total_bytes"] for i in items.values()),
        }

    def root_step(self, step: _steps.StepDir) -> dict[str, Any]:
        """One committed step of a root report; an incomplete or unreadable step says so."""
        entry: dict[str, Any] = {
            "step": step.step,
            "name": step.path.name,
            "path": str(step.path),
            "items": list(_steps.list_items(step.path)),
            "num_tensors": None,
            "tensor_bytes": None,
            "disk_bytes": _disk_bytes(step.path),
            "status": "ok",
            "problem": None,
            "missing": [],
        }
        missing = _completeness.missing_entries(step)
        if missing:
            entry["status"] = "incomplete"
            entry["problem"] = f"missing {', '.join(missing)}"
            entry["missing"] = missing
            return entry
        try:
            if _steps.item_kind(step.path) in _steps.TENSOR_KINDS:  # a step that is an item
                rep = self.source(_open(step.path))
                entry["items"] = [""]
            else:
                rep = self.step(step.path)
                entry["items"] = [*rep["items"], *rep["other_items"]]
        except _UNREADABLE as e:
            entry["status"] = "unreadable"
            entry["problem"] = str(e)
            return entry
        entry["num_tensors"] = rep["num_tensors"]
        entry["tensor_bytes"] = rep["total_bytes"]
        return entry

    def root(self, path: epath.Path) -> dict[str, Any]:
        scanned = _steps.scan_steps(path)
        steps = [self.root_step(s) for s in scanned if s.committed]
        latest = steps[-1]["step"] if steps else None
        warnings = []
        for s in steps:
            if s["status"] == "incomplete":
                warnings.append(
                    _completeness.incomplete_warning(s["step"], s["path"], s["missing"], latest)
                )
            elif s["status"] == "unreadable":
                warnings.append(f"step {s['step']} cannot be read: {s['problem']}")
        return {
            "path": str(path),
            "kind": "root",
            "steps": steps,  # the steps mngr.all_steps() lists
            "latest_step": latest,
            "uncommitted": [
                {"step": s.step, "name": s.path.name, "path": str(s.path), "reason": s.reason}
                for s in scanned
                if not s.committed
            ],
            "warnings": warnings,
        }

    def report(self, path: epath.Path) -> dict[str, Any]:
        entry = _steps.step_entry(path)
        if entry is not None and entry.committed:
            missing = _completeness.missing_entries(entry)
            if missing:  # a step Orbax lists whose files are partly gone: say so, read nothing
                return _incomplete_step_report(path, missing)
        kind = _steps.classify(path)
        if kind is PathKind.ROOT:
            return self.root(path)
        if kind is PathKind.STEP:
            reason = entry.reason if entry is not None and not entry.committed else None
            try:
                report = self.step(path)
            except _UNREADABLE as e:
                if reason is None:
                    raise
                raise SafetensorsCheckpointError(f"{path}: uncommitted step ({reason}): {e}") from e
            if reason is not None:
                report["uncommitted"] = reason
            return report
        if kind is PathKind.OTHER:
            raise _steps.not_a_checkpoint(path)
        return self.source(_open(path, kind))


def _incomplete_step_report(path: epath.Path, missing: list[str]) -> dict[str, Any]:
    """A step named directly that Orbax lists with parts missing: its items, no tensors."""
    return {
        "path": str(path),
        "kind": "step",
        "status": "incomplete",
        "missing": missing,
        "problem": f"missing {', '.join(missing)}",
        "items": {},
        "other_items": list(_steps.list_items(path)),
        "num_tensors": None,
        "total_bytes": None,
    }


def inspect_path(
    path: epath.PathLike,
    *,
    include: _select.Patterns = None,
    exclude: _select.Patterns = None,
) -> dict[str, Any]:
    """A JSON-able description of a file, item, step or root (its steps ``mngr.all_steps()``
    lists, each with a ``status``: ``ok``, ``incomplete`` or ``unreadable``; its uncommitted
    ones). ``include`` / ``exclude`` as in ``osf.load_file`` (TargetMismatchError if one
    matches nothing)."""
    inspection = _Inspection(_select.Selection.of(include, exclude))
    report = inspection.report(epath.Path(path))
    if inspection.select is not None:
        inspection.select.check(inspection.seen, str(path))
    return report


def counted(n: int, noun: str, plural: str | None = None) -> str:
    """``n`` and ``noun`` in agreement: ``'1 file'``, ``'2 files'`` (``plural`` where adding an
    s is wrong)."""
    return f"{n} {noun if n == 1 else plural or noun + 's'}"


def stderr_is_terminal() -> bool:
    """Whether ``sys.stderr`` is a terminal (False when it is missing or closed)."""
    try:
        return sys.stderr is not None and sys.stderr.isatty()
    except (AttributeError, ValueError, OSError):  # no isatty, or a closed stream
        return False


def progress_bar(total: int, desc: str, progress: bool | None) -> Any:
    """A tqdm bar of bytes on stderr, shown only when stderr is a terminal (never mixed into
    piped or redirected output) and ``progress`` is not False."""
    from tqdm import tqdm

    return tqdm(
        total=total,
        desc=desc,
        unit="B",
        unit_scale=True,
        unit_divisor=1024,
        file=sys.stderr,
        disable=progress is False or not stderr_is_terminal(),
        mininterval=0.5,
        leave=False,
    )


def human_bytes(n: float) -> str:
    """``1536`` -> ``'1.5 KiB'``."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def _table(headers: Sequence[str], rows: Sequence[Sequence[str]], right: set[int]) -> list[str]:
    widths = [len(h) for h in headers]
    for row in rows:
        widths = [max(w, len(c)) for w, c in zip(widths, row)]

    def fmt(row: Sequence[str]) -> str:
        cells = [
            c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths))
        ]
        return "  ".join(cells).rstrip()

    return [fmt(headers), "  ".join("-" * w for w in widths), *(fmt(r) for r in rows)]


def _tensor_lines(report: Mapping[str, Any], prefix: str = "") -> list[str]:
    rows = [
        [
            t["name"],
            t["dtype"] + (f" (from {t['cast_from']})" if t.get("cast_from") else ""),
            "("
            + ", ".join(str(d) for d in t["shape"])
            + ("," if len(t["shape"]) == 1 else "")
            + ")",
            str(t["bytes"]),
            prefix + t["file"],
        ]
        for t in report["tensors"]
    ]
    return _table(["name", "dtype", "shape", "bytes", "file"], rows, right={3})


def format_report(report: Mapping[str, Any]) -> str:
    """The human-readable table for a report from :func:`inspect_path`."""
    lines: list[str] = []
    kind = report["kind"]
    if kind == "root":
        lines.append(
            f"{report['path']}: CheckpointManager root, {counted(len(report['steps']), 'step')}"
        )
        headers = ["step", "items", "tensors", "tensor bytes", "on disk"]
        flagged = any(s["status"] != "ok" for s in report["steps"])
        rows = []
        for s in report["steps"]:
            row = [
                str(s["step"]),
                ",".join(s["items"]) or "-",
                "-" if s["num_tensors"] is None else str(s["num_tensors"]),
                "-" if s["tensor_bytes"] is None else str(s["tensor_bytes"]),
                human_bytes(s["disk_bytes"]),
            ]
            rows.append([*row, s["status"].upper()] if flagged else row)
        lines += _table([*headers, "status"] if flagged else headers, rows, {0, 2, 3, 4})
        if report["steps"]:
            lines.append(f"latest step: {report['latest_step']}")
        for u in report["uncommitted"]:
            lines.append(f"uncommitted (not listed by Orbax): {u['name']}: {u['reason']}")
        lines += [f"warning: {w}" for w in report["warnings"]]
        return "\n".join(lines)
    if kind == "step" and report.get("status") == "incomplete":
        return "\n".join(
            [
                f"{report['path']}: step; items: {', '.join(report['other_items']) or '-'}; "
                "status: INCOMPLETE",
                f"warning: incomplete step ({report['problem']}): Orbax lists it but restoring "
                "it fails; most likely the process was killed while Orbax's cleanup "
                "(max_to_keep) was deleting it",
            ]
        )
    if kind == "step":
        if report.get("uncommitted"):
            lines.append(
                f"warning: uncommitted step, Orbax does not list it: {report['uncommitted']}"
            )
        items, other = list(report["items"]), report["other_items"]
        lines.append(
            f"{report['path']}: step; items: {', '.join(items) or '-'}"
            + (f"; other items: {', '.join(other)}" if other else "")
        )
        for name, item in report["items"].items():
            lines.append("")
            lines.append(f"[{name}] {item['kind']}")
            lines += _tensor_lines(item, prefix=f"{name}/")
        lines.append("")
        lines.append(_total_line(report))
        return "\n".join(lines)
    if kind == "flax-msgpack":  # read here, but not safetensors: say what to run
        path = str(report["path"])
        lines.append(
            f"{path}: a Flax msgpack checkpoint, not safetensors (decoded whole to list it); "
            f"convert it: {_sniff.convert_command(path)}"
        )
    else:
        lines.append(f"{report['path']}: {kind}")
    meta = report.get("metadata") or {}
    if meta:
        lines.append("metadata: " + json.dumps(meta, sort_keys=True)[:400])
    lines += _tensor_lines(report)
    lines.append(_total_line(report))
    return "\n".join(lines)


def _total_line(report: Mapping[str, Any]) -> str:
    return (
        f"total: {counted(report['num_tensors'], 'tensor')}, "
        f"{counted(report['total_bytes'], 'byte')} "
        f"({human_bytes(report['total_bytes'])})"
    )
