"""The ``orbax-safetensors`` command line.

Example::

    orbax-safetensors inspect /ckpt                 # the steps of a CheckpointManager root
    orbax-safetensors inspect /ckpt/100/state --json
    orbax-safetensors verify /ckpt                  # exit status 1 on any damage
    orbax-safetensors convert /orbax/100 /st/100    # Orbax-native step -> safetensors (or back)
    orbax-safetensors diff /st/100/state /st/200/state
    orbax-safetensors export /ckpt /hf --mapping llama --hf-config config.json --item state
    orbax-safetensors import /hf /ckpt --mapping maxtext-llama3  # MaxText: /ckpt/0/items
    orbax-safetensors demo /tmp/demo
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import sys
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

EXIT_OK = 0
EXIT_DIFFERENT = 1  # diff: the checkpoints differ; verify: damage found
EXIT_ERROR = 2  # bad usage, unreadable input, any failure (one `error:` line)
EXIT_INTERRUPTED = 130  # Ctrl-C


def _demo(args: argparse.Namespace) -> int:
    """Trains a small NNX model on synthetic data, checkpoints it asynchronously through
    Orbax's CheckpointManager as safetensors, simulates a crash and resumes."""
    from orbax_safetensors._src.tools import demo  # imported only when used

    return demo.main(args.dir, steps=args.steps)


def _show(args: argparse.Namespace, doc: Any, as_text: Callable[[], str]) -> None:
    """Prints a verb's report: ``doc`` as JSON with ``--json``, else ``as_text()``."""
    print(json.dumps(doc, indent=1, default=str) if args.json else as_text())


def _inspect_cmd(args: argparse.Namespace) -> int:
    """Prints a table of tensors (name, dtype, shape, bytes, file) with totals. PATH may be
    a .safetensors file, a checkpoint item directory, a plain safetensors directory (Hugging
    Face style), an Orbax-native item, a step directory (every item) or a CheckpointManager
    root (then the steps Orbax lists and their sizes, flagging incomplete steps, and the
    uncommitted ones)."""
    from orbax_safetensors._src.tools import inspection as _inspection

    report = _inspection.inspect_path(args.path, include=args.include, exclude=args.exclude)
    _show(args, report, lambda: _inspection.format_report(report))
    return EXIT_OK


def _verify_cmd(args: argparse.Namespace) -> int:
    """Checks the headers, metadata and CRC32C checksums of a .safetensors file, a
    checkpoint item, a step or a CheckpointManager root (the steps Orbax lists: uncommitted
    steps are skipped, a step with missing parts is reported as incomplete). Prints every
    problem found and exits with status 1 when there is any damage or missing part, 0 when
    all is well; status 2 (one error line) when PATH is no checkpoint of this library (an
    empty or other directory, another handler's Orbax item, an Orbax-native checkpoint, a
    file whose header cannot be read)."""
    import dataclasses

    from orbax_safetensors._src.tools.verify import verify  # imported only when used

    report = verify(args.path)
    doc = {"path": args.path, **dataclasses.asdict(report)}
    _show(args, doc, lambda: report.format(args.path))
    return EXIT_OK if report.ok else EXIT_DIFFERENT


def _keywords(args: argparse.Namespace, names: Sequence[str]) -> dict[str, Any]:
    """The options ``names`` as the keyword arguments of the function a subcommand calls."""
    return {name: getattr(args, name) for name in names}


_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?b?)\s*$", re.IGNORECASE)


def parse_size(text: str) -> int:
    """``"5GB"`` -> 5e9, ``"512MiB"`` -> 512 * 2**20, ``"1000"`` -> 1000."""
    m = _SIZE.match(text)
    if not m:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 2GB, 512MiB, 1000000)")
    number, unit, binary = m.groups()
    base = 1024 if binary.lower().startswith("i") else 1000
    power = " kmgt".index(unit.lower() or " ")
    return int(float(number) * base**power)


def dtype_policy(values: Sequence[str] | None) -> Any:
    """The dtype policy of ``--dtype`` values: one ``DTYPE`` (every floating-point tensor), or
    ``PATTERN=DTYPE`` entries, first match wins (``keep`` keeps a dtype); ValueError naming a
    value that is neither (``["*norm*=keep", "*=bfloat16"]``: ``{'*norm*': None, '*':
    'bfloat16'}``)."""
    from orbax_safetensors._src.core import casting as _casting

    if not values:
        return None
    if len(values) == 1 and "=" not in values[0]:
        return _casting.parse_policy(values[0])
    mapping: dict[str, str | None] = {}
    for value in values:
        pattern, sep, dtype = value.rpartition("=")
        if not sep or not pattern:
            raise ValueError(
                f"--dtype {value!r}: give one DTYPE, or PATTERN=DTYPE entries (e.g. "
                "'*.kernel=bfloat16', '*=keep')"
            )
        mapping[pattern] = None if dtype.lower() in ("keep", "none") else dtype
    return _casting.parse_policy(mapping)


def _convert_cmd(args: argparse.Namespace) -> int:
    """Converts an Orbax-native item, step or CheckpointManager root
    (StandardSave/PyTreeSave, OCDBT or not) into safetensors checkpoints with the same
    dotted names and values, streaming a batch of tensors at a time; or a safetensors item,
    file, step or root into Orbax-native (StandardSave) checkpoints; or a legacy Flax
    msgpack file (flax.serialization.to_bytes, flax.training.checkpoints' checkpoint_<step>)
    into a .safetensors file or a CheckpointManager root holding that step (decoded whole:
    host memory about twice the file). Other items of a step (e.g. JSON) are copied. DST
    must not exist (or be empty); it appears only once complete."""
    from orbax_safetensors._src.tools import convert as _convert
    from orbax_safetensors._src.tools import inspection as _inspection

    try:
        policy = dtype_policy(args.dtype)
    except ValueError as e:
        _error_line("orbax-safetensors convert", e)
        return EXIT_ERROR
    passed = ("to", "unwrap_values", "wrap_values", "step", "max_file_size", "include", "exclude")
    summary = _convert.convert(
        args.src,
        args.dst,
        batch_bytes=args.batch_size,
        progress=not args.quiet,
        dtype=policy,
        **_keywords(args, passed),
    )
    target = (
        "safetensors" if summary.direction is _convert.Direction.SAFETENSORS else "Orbax-native"
    )
    items = ", ".join(i or "(item)" for i in summary.items) or "-"
    print(
        f"converted {_inspection.counted(summary.tensors, 'tensor')} "
        f"({_inspection.human_bytes(summary.bytes)}) to "
        f"{target} in {args.dst}; items: {items}"
        + (f"; copied unchanged: {', '.join(summary.copied)}" if summary.copied else "")
    )
    return EXIT_OK


def _export_cmd(args: argparse.Namespace) -> int:
    """Writes the tensors of SRC (a .safetensors file, a checkpoint item, an Orbax-native
    item, a step or a CheckpointManager root: its latest committed step) as a Hugging Face
    model directory OUT: model.safetensors (or shards plus model.safetensors.index.json),
    header format 'pt', and config.json from --hf-config (a directory: its
    generation_config.json and tokenizer files too), renamed and transformed by the key
    mapping, a batch of tensors at a time. Earlier model*.safetensors files in OUT are
    replaced, other files kept."""
    from etils import epath

    from orbax_safetensors._src.integrations import export as _export
    from orbax_safetensors._src.tools import inspection as _inspection
    from orbax_safetensors._src.tools import mapping_flags as _mapping_flags

    try:
        policy = dtype_policy(args.dtype)
        config = _mapping_flags.read_hf_config(args.hf_config)
        mapping = _mapping_flags.resolve_mapping(args.mapping, config, args.lora_scale)
    except ValueError as e:
        _error_line("orbax-safetensors export", e)
        return EXIT_ERROR
    report = _export.export_pytorch(
        args.src,
        args.out,
        mapping,
        hf_config=args.hf_config,  # (a directory: its generation config and tokenizer too)
        dtype=policy,
        batch_bytes=args.batch_size,
        **_keywords(args, ("max_file_size", "step", "item")),
    )
    files = sorted(p for p in epath.Path(args.out).iterdir() if p.is_file())
    size = sum(p.stat().length for p in files if p.suffix == ".safetensors")
    print(
        f"exported {_inspection.counted(len(report.moved), 'tensor')} "
        f"({_inspection.human_bytes(size)}) to {args.out}: " + ", ".join(p.name for p in files)
    )
    return EXIT_OK


def _import_cmd(args: argparse.Namespace) -> int:
    """Writes the Hugging Face model directory HFDIR (its config.json and safetensors files) as
    step --step of the Orbax checkpoint CKPTDIR, the train state MaxText's to_maxtext saves
    ({"step", "params", "opt_state": {}} in the item "items", OCDBT and zarr3,
    custom_metadata {"scan_layers": ...}): MaxText reads it with
    load_parameters_path=CKPTDIR/<step>/items. Tensors are read a batch at a time onto the
    devices, split over all of them, transformed there, and saved by Orbax. With
    --distributed, run it on every host of the job: each process reads and writes only its
    share. CKPTDIR/<step> must not exist."""
    from orbax_safetensors._src.integrations import hf_import as _hf_import
    from orbax_safetensors._src.tools import inspection as _inspection
    from orbax_safetensors._src.tools import mapping_flags as _mapping_flags

    try:
        policy = dtype_policy(args.dtype)
        named = (
            args.mapping
            if ":" not in args.mapping
            else _mapping_flags.resolve_mapping(args.mapping)
        )
        mapping, scan_layers = _hf_import.resolve(
            named, args.hfdir, args.scan_layers, args.vocab_size
        )
    except ValueError as e:
        _error_line("orbax-safetensors import", e)
        return EXIT_ERROR
    if args.distributed:
        import jax

        if not jax.distributed.is_initialized():
            jax.distributed.initialize()  # (the cluster's: Cloud TPU, GKE, SLURM, Open MPI)
    step = 0 if args.step is None else args.step
    report = _hf_import.import_pytorch(
        args.hfdir,
        args.ckptdir,
        mapping,
        step=step,
        dtype=policy,
        scan_layers=scan_layers,
        batch_bytes=args.batch_size,
    )
    items = f"{str(args.ckptdir).rstrip('/')}/{step}/items"
    print(
        f"imported {len(report.moved)} tensors to {items} (this process read "
        f"{_inspection.human_bytes(report.bytes_read)}); MaxText: load_parameters_path={items}"
    )
    return EXIT_OK


def _diff_cmd(args: argparse.Namespace) -> int:
    """Lists tensors missing on either side, differing in shape or dtype, or differing in
    value (with the max abs difference). A and B may be files, items, Orbax-native items or
    steps. Values compare bitwise unless --atol/--rtol is given. Exit status 0 when
    identical, 1 when different."""
    from orbax_safetensors._src.tools import diff as _diff

    report = _diff.diff_paths(
        args.a, args.b, **_keywords(args, ("atol", "rtol", "include", "exclude"))
    )
    _show(args, report.to_json(), report.format)
    return EXIT_OK if report.identical else EXIT_DIFFERENT


_TRISTATE = {"action": argparse.BooleanOptionalAction, "default": None}  # --x, --no-x or neither
# Every option of the verbs, by name: its flags and settings (help apart).
_OPTIONS: dict[str, tuple[tuple[str, ...], dict[str, Any]]] = {
    "json": (("--json",), {"action": "store_true"}),
    "include": (("--include",), {"action": "append", "metavar": "GLOB"}),
    "exclude": (("--exclude",), {"action": "append", "metavar": "GLOB"}),
    "to": (("--to",), {"choices": ("safetensors", "orbax"), "default": None}),
    "unwrap_values": (("--unwrap-values",), _TRISTATE),
    "wrap_values": (("--wrap-values",), _TRISTATE),
    "mapping": (("--mapping",), {"required": True, "metavar": "NAME | module:attr"}),
    "hf_config": (("--hf-config",), {"metavar": "FILE"}),
    "step": (("--step",), {"type": int, "default": None}),
    "item": (("--item",), {"default": None}),
    "max_file_size": (("--max-file-size",), {"type": parse_size, "default": "5GB"}),
    "batch_size": (("--batch-size",), {"type": parse_size, "default": "256MiB"}),
    "dtype": (("--dtype",), {"action": "append", "metavar": "DTYPE | PATTERN=DTYPE"}),
    "quiet": (("-q", "--quiet"), {"action": "store_true"}),
    "atol": (("--atol",), {"type": float, "default": None}),
    "rtol": (("--rtol",), {"type": float, "default": None}),
    "dir": (("dir",), {"nargs": "?", "default": None}),
    "steps": (("--steps",), {"type": int, "default": 300}),
    "lora_scale": (("--lora-scale",), {"type": float, "default": None, "metavar": "X"}),
    "scan_layers": (("--scan-layers",), _TRISTATE),
    "vocab_size": (("--vocab-size",), {"type": int, "default": None, "metavar": "N"}),
    "distributed": (("--distributed",), {"action": "store_true"}),
}
_HELP = {  # the help of an option that means the same in every verb (a verb gives the others')
    "path": "file, item, step or root directory",
    "json": "print machine-readable JSON",
    "max_file_size": "split the output into files of at most this size (default 5GB)",
    "batch_size": "tensor bytes held in memory at once (default 256MiB)",
    "dtype": "stored dtype: one DTYPE (e.g. bfloat16) for every floating-point tensor, or "
    "PATTERN=DTYPE entries over dotted names, repeated, first match wins ('*norm*=keep' keeps a "
    "dtype)",
}


def _selection(verb: str) -> dict[str, str]:
    """The helps of ``--include`` and ``--exclude`` for ``verb``."""
    rule = (
        "GLOB is an fnmatch pattern over dotted names ('*' crosses dots); it also selects "
        "everything beneath a name it matches (params selects params.w)"
    )
    return {
        "include": f"{verb} only the tensors it selects (repeatable); {rule}",
        "exclude": f"do not {verb} the tensors it selects (repeatable)",
    }


def _verb(
    sub: Any, name: str, func: Callable[[argparse.Namespace], int], summary: str, **helps: Any
) -> None:
    """The verb ``name``, described by ``func``'s docstring, with the arguments named, in
    order, each with its help (None: ``_HELP``'s): an option of ``_OPTIONS``, else a
    positional argument of that name."""
    parser = sub.add_parser(name, help=summary, description=func.__doc__)
    parser.set_defaults(func=func, command_parser=parser)
    for dest, text in helps.items():
        flags, settings = _OPTIONS.get(dest, ((dest,), {}))
        parser.add_argument(*flags, **settings, help=text or _HELP[dest])


def build_parser() -> argparse.ArgumentParser:
    """The argument parser with every subcommand."""
    parser = _Parser(
        prog="orbax-safetensors",
        description="Inspect, verify and convert safetensors checkpoints of JAX pytrees.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    _verb(
        sub,
        "inspect",
        _inspect_cmd,
        "list the tensors (or steps) of a checkpoint",
        path=None,
        json=None,
        **_selection("list"),
    )
    _verb(
        sub,
        "verify",
        _verify_cmd,
        "check headers and checksums; exit status 1 on damage",
        path=None,
        json=None,
    )
    _verb(
        sub,
        "convert",
        _convert_cmd,
        "convert Orbax-native checkpoints to safetensors, or back",
        src="item, step or root to convert",
        dst="where to write the converted checkpoint",
        to="direction (default: from what SRC holds)",
        unwrap_values="to safetensors: collapse the {'value': x} dicts of Orbax's nnx.Variable "
        "form so names match nnx.state(model) here (layers.0.kernel rather than "
        "layers.0.kernel.value). Default: when SRC stores an nnx.State (every leaf so "
        "wrapped) or is a copy this command wrote (its Variables recorded), so a round trip "
        "is the identity; --unwrap-values: every such dict; --no-unwrap-values: none",
        wrap_values="to Orbax: wrap leaves in {'value': x} dicts, as Orbax stores nnx.Variable, "
        "so StandardCheckpointer().restore(path, abstract nnx.State) works. Default: the "
        "leaves saved as nnx.Variable; --wrap-values: every leaf; --no-wrap-values: none",
        step="Flax msgpack source: the step of the CheckpointManager root written to DST "
        "(default: from the checkpoint_<step> file name)",
        max_file_size=None,
        batch_size=None,
        dtype=f"{_HELP['dtype']}; to safetensors only, cast a batch at a time, the metadata recording "
        "each tensor's original dtype",
        quiet="no progress bar",
        **_selection("convert"),
    )
    _verb(
        sub,
        "export",
        _export_cmd,
        "write a checkpoint as a Hugging Face model directory",
        src="file, item, step or root to export",
        out="the Hugging Face model directory to write",
        mapping="a preset (llama, mistral, qwen2, qwen3, phi3, gemma3, mixtral, qwen2-moe, "
        "qwen3-moe, gpt2: NNX ports named as Hugging Face names its modules; tunix-llama3, "
        "tunix-qwen2, tunix-qwen3, tunix-gemma, tunix-gemma3, tunix-gemma4: Tunix's models; "
        "maxtext-*: MaxText's train states) or module:attr naming an osf.KeyMapping (or a "
        "function returning one)",
        hf_config="the model's config.json, or its directory (config.json, "
        "generation_config.json and tokenizer files written to OUT)",
        dtype=None,
        step="with a root: the step (default: the latest)",
        item="with a step of several items: the item to export",
        max_file_size=None,
        batch_size=None,
        lora_scale="the scale of the LoRA adapters merged into their kernels: alpha / rank "
        "for qwix's (Tunix's LoRA; needed there), default 1.0 for flax's nnx.LoRA",
    )

    _verb(
        sub,
        "import",
        _import_cmd,
        "write a Hugging Face model directory as a MaxText checkpoint",
        hfdir="the Hugging Face model directory (config.json, *.safetensors)",
        ckptdir="the Orbax checkpoint directory (its step --step is written)",
        mapping="a MaxText preset (maxtext-llama3, maxtext-mistral, maxtext-mixtral, "
        "maxtext-qwen3, maxtext-qwen3-moe, maxtext-qwen2, maxtext-gemma2, maxtext-gemma3, "
        "maxtext-deepseek3), built from HFDIR's config.json, or module:attr naming an "
        "osf.KeyMapping (or a function returning one)",
        step="the step written (default 0)",
        scan_layers="MaxText's scan_layers: the layers stacked (default, as MaxText) or one "
        "subtree each (--no-scan-layers); recorded in the checkpoint, which MaxText checks",
        vocab_size="the MaxText model's vocabulary when padded past the config's (e.g. 256128 "
        "for Gemma 2): the embedding gets zero rows",
        dtype=f"{_HELP['dtype']} (float32: MaxText's weight_dtype); cast after the preset's transforms "
        "(default: as HFDIR stores them)",
        batch_size="tensor bytes read at a time, and Orbax's copies to the host at a time "
        "(default 256MiB)",
        distributed="join the job's other processes first (jax.distributed.initialize(), "
        "which finds Cloud TPU, GKE, SLURM and Open MPI jobs; elsewhere set "
        "JAX_COORDINATOR_ADDRESS): run the command on every host",
    )

    _verb(
        sub,
        "diff",
        _diff_cmd,
        "compare the tensors of two checkpoints",
        a="first checkpoint",
        b="second checkpoint",
        atol="compare values with a tolerance: floats within ATOL + RTOL * |b| count as equal "
        "(any NaN equal to any NaN), integers within ATOL (exactly). Default: no tolerance, "
        "every tensor compared bitwise (-0.0 differs from 0.0)",
        rtol="relative tolerance for floating-point tensors (see --atol; not applied to integers)",
        json=None,
        **_selection("compare"),
    )
    _verb(
        sub,
        "demo",
        _demo,
        "train a small NNX model, checkpoint it, crash, resume",
        dir="checkpoint directory (default: a new temp dir)",
        steps="training steps (default 300)",
    )
    return parser


_LISTED = 10  # entries of a list shown in an error line; the rest are counted


def one_line(message: object) -> str:
    """A multi-line error message as one line: each list (indented lines under the line that
    introduces it) joined with commas (semicolons when its entries hold commas or colons), at
    most ``_LISTED`` entries shown, lists of several headings separated by semicolons."""
    pieces: list[str] = []
    entries: list[str] = []

    def close_list() -> bool:
        if not entries:
            return False
        sep = "; " if any(", " in e or ": " in e for e in entries) else ", "
        shown = entries[:_LISTED]
        if len(entries) > len(shown):
            shown.append(f"and {len(entries) - len(shown)} more")
        pieces.append(sep.join(shown))
        entries.clear()
        return True

    for raw in str(message).splitlines():
        line = raw.strip()
        if not line:
            continue
        if raw[0].isspace() and pieces:  # an entry of the list the line above introduces
            entries.append(line)
            continue
        if close_list():
            pieces[-1] += ";"
        pieces.append(line)
    close_list()
    return " ".join(pieces)


def _error_line(where: str, message: object) -> None:
    text = one_line(message)
    try:
        print(f"{where}: error: {text}", file=sys.stderr)
        sys.stderr.flush()
    except (OSError, ValueError):  # stderr closed too: the exit status is all there is
        pass


class _Parser(argparse.ArgumentParser):
    """``argparse`` with usage errors as one ``error:`` line (exit status 2), no usage dump."""

    def error(self, message: str) -> NoReturn:
        _error_line(self.prog, f"{message} (see {self.prog} --help)")
        raise SystemExit(EXIT_ERROR)


def _quiet_stdout() -> None:
    """Points stdout at /dev/null once its reader went away (``| head``), so the interpreter's
    final flush prints no BrokenPipeError."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError, AttributeError):
        pass


_QUIET_HOOKS: list[Any] = []  # the hook installed by _quiet_closed_loop_callbacks


def _quiet_closed_loop_callbacks() -> None:
    """Installs (once) an unraisable-exception hook that drops tensorstore's calls back into
    the event loop Orbax closed after a failed read (``RuntimeError('Event loop is closed')``),
    which Python would print as a traceback after the command's ``error:`` line."""
    previous = sys.unraisablehook
    if previous in _QUIET_HOOKS:
        return

    def hook(unraisable: Any) -> None:
        error = unraisable.exc_value
        if not (isinstance(error, RuntimeError) and str(error) == "Event loop is closed"):
            previous(unraisable)

    _QUIET_HOOKS.append(hook)
    sys.unraisablehook = hook


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the command line; returns the exit status.

    Every failure is one ``orbax-safetensors COMMAND: error: ...`` line on stderr and exit
    status 2, never a traceback; Orbax's log messages are silenced while it runs. A closed
    output pipe (``... | head``) ends the command quietly with status 2; Ctrl-C prints
    ``error: interrupted``, status 130.

    Example::

        main(["verify", "/ckpt"])   # 0 (OK), 1 (damage found) or 2 (error)
    """
    args, unknown = build_parser().parse_known_args(argv)
    if unknown:  # reported by the subcommand's parser, so the line names the subcommand
        args.command_parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    # Orbax logs through absl (e.g. a WARNING before it fails on a damaged item); the command
    # reports problems itself, in one line each.
    # Orbax's tensorstore reads may also leave an asyncio task whose failure the event loop
    # logs when the task is collected ("Task exception was never retrieved"), while the
    # command reports that failure itself.
    absl_logger, asyncio_logger = logging.getLogger("absl"), logging.getLogger("asyncio")
    level, asyncio_level = absl_logger.level, asyncio_logger.level
    absl_logger.setLevel(logging.CRITICAL)
    asyncio_logger.setLevel(logging.CRITICAL)
    _quiet_closed_loop_callbacks()
    try:
        status = int(args.func(args))
        sys.stdout.flush()
        return status
    except BrokenPipeError:
        _quiet_stdout()
        return EXIT_ERROR
    except KeyboardInterrupt:
        _error_line(f"orbax-safetensors {args.command}", "interrupted")
        return EXIT_INTERRUPTED
    except Exception as e:  # every failure is one line, never a traceback
        _error_line(f"orbax-safetensors {args.command}", _describe(e))
        return EXIT_ERROR
    finally:
        absl_logger.setLevel(level)
        asyncio_logger.setLevel(asyncio_level)


def _describe(error: Exception) -> str:
    """The message of ``error``, naming its type when it is neither this library's nor the
    OS's (likely a bug to report)."""
    from orbax_safetensors._src.core.errors import SafetensorsCheckpointError

    if isinstance(error, OSError) and error.filename is not None and error.strerror:
        # The operating system's error on a path, worded as the library words its own:
        # "PATH: no such file or directory", not "[Errno 2] No such file or directory: 'PATH'".
        return f"{error.filename}: {error.strerror[:1].lower()}{error.strerror[1:]}"
    if isinstance(error, (SafetensorsCheckpointError, OSError)):
        return str(error) or type(error).__name__
    return f"{type(error).__name__}: {error}"


if __name__ == "__main__":
    sys.exit(main())
