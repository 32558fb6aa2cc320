"""File helpers: safe readers (YAML/JSON -> HexiSeqError) and atomic writers, and the output checks
every command runs before its long work.

Writers: a temporary file in the target's folder, then ``os.replace``: a crash or error half-way
leaves the old file (or none), never a partial one. The file gets the user's umask (``0o666 &
~umask``, not ``mkstemp``'s 0600). :func:`check_outputs` refuses, up front: an output that is an
input (or another output), a symbolic link (written through, it would replace another file), an
existing non-regular file (``/dev/full``, a directory), a missing or unwritable folder.

Readers: missing files, non-UTF-8 bytes, syntax errors, duplicate YAML keys, nesting too deep and
files over ``MAX_INPUT_BYTES`` are one-line HexiSeqErrors naming the file.

The project's JSON files (layouts, job files): :func:`plain` turns their records into JSON trees,
:func:`schema_error` checks one against its packaged schema, :func:`check_finite` refuses NaN and
infinity (JSON reads ``NaN``) in the records a file keeps.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import stat
import tempfile
from collections.abc import Collection, Iterable, Iterator, Mapping
from importlib import resources
from pathlib import Path
from typing import Any

from megatron_hexiseq.errors import HexiSeqError, short, short_text

MAX_INPUT_BYTES = 256 << 20  # a 100,000-GPU layout is ~30 MB
# YAML inputs are specs (a 16,384-node cluster is ~1.8 MB); PyYAML reads ~0.1 MB/s on a busy core,
# so a larger file would be minutes of parsing before the size checks could refuse it
MAX_YAML_BYTES = 4 << 20


def _shown(path: str | os.PathLike, limit: int = 120) -> str:
    """A path as a message shows it: ``errors.short_text`` (control characters escaped, the middle
    of a long one cut)."""
    return short_text(str(path), limit)


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def write_bytes_atomic(path: str | os.PathLike, data: bytes) -> None:
    """Write ``data`` to ``path`` via a temporary file in the same folder and ``os.replace``."""
    with atomic_path(path) as tmp, open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[str]:
    """``with atomic_path("out.png") as tmp: savefig(tmp)``: for writers that want a file name
    (matplotlib picks the format from the suffix). ``tmp`` is in the same folder with the same
    suffix; it replaces ``path`` (user's umask) only if the block succeeds."""
    path = Path(path)
    folder = _existing_folder(path, str(path))
    if path.is_symlink():
        raise HexiSeqError(
            f"cannot write {_shown(path)}: it is a symbolic link; give the real path or remove "
            "the link"
        )
    try:
        fd, tmp = tempfile.mkstemp(
            prefix=f".{path.stem[:64]}.", suffix=path.suffix[:16], dir=folder
        )
    except OSError as e:
        raise HexiSeqError(
            f"cannot write {_shown(path)}: {e.strerror} (folder {_shown(folder)})"
        ) from None
    try:
        os.fchmod(fd, 0o666 & ~_umask())
        os.close(fd)
        yield tmp
        os.replace(tmp, path)
    except OSError as e:
        _unlink(tmp)
        raise HexiSeqError(f"cannot write {_shown(path)}: {e.strerror}") from None
    except BaseException:
        _unlink(tmp)
        raise


def check_plot_path(flag: str, path: str | os.PathLike | None) -> None:
    """A figure path whose suffix matplotlib can write (checked before the work that makes it)."""
    if path is None:
        return
    from matplotlib.backend_bases import FigureCanvasBase

    kinds = FigureCanvasBase.get_supported_filetypes()
    suffix = Path(path).suffix.lower().lstrip(".")
    if suffix not in kinds:
        raise HexiSeqError(
            f"{flag} {_shown(path)}: cannot write a figure as "
            f"{'.' + _shown(suffix, 20) if suffix else 'a file without a suffix'};"
            f" use one of {', '.join('.' + k for k in sorted(kinds))}"
        )


def write_text_atomic(path: str | os.PathLike, text: str) -> None:
    """Write ``text`` (UTF-8) to ``path`` atomically."""
    write_bytes_atomic(path, text.encode("utf-8"))


def write_json_atomic(path: str | os.PathLike, obj: Any) -> None:
    """Serialise ``obj`` (indent 2, trailing newline) and write it atomically."""
    write_text_atomic(path, json.dumps(obj, indent=2) + "\n")


def check_outputs(
    outputs: Iterable[tuple[str, str | os.PathLike | None]],
    inputs: Iterable[str | os.PathLike | None] = (),
    *,
    figures: Iterable[str] = (),
) -> None:
    """Before any long work: every ``(flag, path)`` in ``outputs`` (None = not requested) can be
    written atomically and clobbers no input and no other output; the paths of the flags named in
    ``figures`` are also figure formats matplotlib writes (:func:`check_plot_path`)."""
    outputs = list(outputs)
    for flag, raw in outputs:
        if flag in figures:
            check_plot_path(flag, raw)
    ins = [Path(p) for p in inputs if p]
    seen: list[tuple[str, Path]] = []
    for flag, raw in outputs:
        if raw is None:
            continue
        if str(raw) == "":
            raise HexiSeqError(f"{flag} is empty; give a file name")
        if str(raw).endswith(("/", os.sep)):  # Path("dir/") is "dir": it would write a file there
            raise HexiSeqError(f"{flag} {_shown(raw)} names a folder; give a file name to write")
        path = Path(raw)
        _check_name_length(flag, path)
        try:
            st = path.lstat()
        except FileNotFoundError:
            st = None
        except OSError as e:
            raise HexiSeqError(f"cannot write {flag} {_shown(path)}: {e.strerror}") from None
        if st is not None and stat.S_ISLNK(st.st_mode):
            raise HexiSeqError(
                f"{flag} {_shown(path)} is a symbolic link; writing through it would replace "
                "another file: "
                "give the real path or remove the link"
            )
        if st is not None and not stat.S_ISREG(st.st_mode):
            kind = "a directory" if stat.S_ISDIR(st.st_mode) else "not a regular file"
            raise HexiSeqError(f"{flag} {_shown(path)} is {kind}; give a file name to write")
        for other in ins:
            if _same(path, other):
                raise HexiSeqError(
                    f"{flag} {_shown(path)} is also an input ({_shown(other)}); writing it would "
                    "destroy the input: "
                    "give another output path"
                )
        for oflag, other in seen:
            if _same(path, other):
                raise HexiSeqError(
                    f"{flag} and {oflag} are the same file {_shown(path)}; give two different paths"
                )
        seen.append((flag, path))
        folder = _existing_folder(path, f"{flag} {_shown(path)}")
        try:  # the only test that holds for root, read-only mounts and ACLs alike: create a file there
            fd, probe = tempfile.mkstemp(prefix=".hexiseq-", suffix=".probe", dir=folder)
        except OSError as e:
            raise HexiSeqError(
                f"cannot write {flag} {_shown(path)}: {e.strerror} (folder {_shown(folder)})"
            ) from None
        os.close(fd)
        _unlink(probe)


def _check_name_length(flag: str, path: Path) -> None:
    """A file name the folder's file system can hold (ENAMETOOLONG would come after the work)."""
    name = len(os.fsencode(path.name))
    try:
        limit = os.pathconf(path.parent if str(path.parent) else ".", "PC_NAME_MAX")
    except (OSError, ValueError):
        limit = 255
    whole = len(os.fsencode(str(path)))
    if name > limit or whole > 4095:
        what, most = ("file name", limit) if name > limit else ("path", 4095)
        raise HexiSeqError(
            f"{flag} {_shown(path)}: the {what} is {name if name > limit else whole} bytes, more "
            f"than the {most} the file system allows; give a shorter name"
        )


def _existing_folder(path: Path, what: str) -> Path:
    """The folder ``path`` would be written in; a one-line error when it does not exist."""
    folder = path.parent if str(path.parent) else Path(".")
    if not folder.is_dir():
        raise HexiSeqError(
            f"cannot write {what}: folder {_shown(folder)} does not exist; create it first"
        )
    return folder


def _same(a: Path, b: Path) -> bool:
    try:
        if a.exists() and b.exists():
            return os.path.samefile(a, b)
    except OSError:
        pass
    return os.path.realpath(a) == os.path.realpath(b)


def _read_text(path: str | os.PathLike, what: str, limit: int | None = None) -> str:
    limit = MAX_INPUT_BYTES if limit is None else limit
    what = f"{what} {_shown(path)}"
    try:
        size = os.stat(path).st_size
        if size > limit:
            raise HexiSeqError(
                f"{what} is {size / 2**20:.1f} MiB, more than the {limit >> 20} MiB "
                "it may be; is it the right file?"
            )
        with open(path, "rb") as f:
            data = f.read(limit + 1)
    except FileNotFoundError:
        raise HexiSeqError(f"{what} does not exist") from None
    except IsADirectoryError:
        raise HexiSeqError(f"{what} is a directory, not a file") from None
    except OSError as e:
        raise HexiSeqError(f"cannot read {what}: {e.strerror}") from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise HexiSeqError(
            f"{what} is not UTF-8 text (byte 0x{data[e.start]:02x} at offset {e.start}); "
            "save it as UTF-8"
        ) from None


class _DuplicateKey(Exception):
    pass


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """JSON objects with each key once (``json`` would keep the last of two silently)."""
    out = dict(pairs)
    if len(out) != len(pairs):
        seen: set[str] = set()
        for k, _ in pairs:
            if k in seen:
                raise _DuplicateKey(k)
            seen.add(k)
    return out


def read_json(path: str | os.PathLike, what: str = "JSON file") -> Any:
    """Read JSON, turning every problem with the file into a one-line HexiSeqError."""
    text = _read_text(path, what)
    try:
        return json.loads(text, object_pairs_hook=_unique_keys)
    except _DuplicateKey as e:
        raise HexiSeqError(
            f"{what} {_shown(path)}: key {short(e.args[0])} appears twice in one object; keep one"
        ) from None
    except json.JSONDecodeError as e:
        raise HexiSeqError(
            f"{what} {_shown(path)} is not valid JSON: {e.msg} at line {e.lineno} column {e.colno}"
        ) from None
    except RecursionError:
        raise HexiSeqError(f"{what} {_shown(path)} is nested too deeply to be a {what}") from None
    except ValueError as e:  # e.g. an integer of more than 4300 digits
        raise HexiSeqError(f"{what} {_shown(path)} is not valid JSON: {short(str(e))}") from None


def _yaml_loader():
    import yaml

    class UniqueKeyLoader(yaml.SafeLoader):
        """SafeLoader that rejects a key given twice in one mapping (YAML would keep the last)."""

        def construct_mapping(self, node, deep=False):  # type: ignore[override]
            seen: dict[Any, Any] = {}
            for key_node, _ in node.value:
                key = self.construct_object(key_node, deep=deep)
                try:
                    if key in seen:
                        raise yaml.constructor.ConstructorError(
                            None,
                            None,
                            f"key {short(key)} appears twice in one mapping (line "
                            f"{seen[key].start_mark.line + 1} and line {key_node.start_mark.line + 1})",
                            key_node.start_mark,
                        )
                    seen[key] = key_node
                except TypeError:  # unhashable: the base class reports it
                    break
            return super().construct_mapping(node, deep=deep)

    return UniqueKeyLoader


def read_yaml(path: str | os.PathLike, what: str = "YAML file") -> Any:
    """Read YAML (safe, duplicate keys refused), turning every problem into a one-line HexiSeqError."""
    import yaml

    text = _read_text(path, what, MAX_YAML_BYTES)
    try:
        return yaml.load(text, Loader=_yaml_loader())  # noqa: S506 (a SafeLoader subclass)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1} column {mark.column + 1}" if mark else ""
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise HexiSeqError(f"{what} {_shown(path)} is not valid YAML{where}: {problem}") from None
    except RecursionError:
        raise HexiSeqError(f"{what} {_shown(path)} is nested too deeply to be a {what}") from None
    except ValueError as e:  # e.g. an integer of more than 4300 digits
        raise HexiSeqError(f"{what} {_shown(path)} is not valid YAML: {short(str(e))}") from None


def plain(x: Any) -> Any:
    """Mapping/tuple trees to plain dict/list for JSON."""
    if isinstance(x, Mapping):
        return {str(k): plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [plain(v) for v in x]
    return x


def schema_error(data: Any, schema: str) -> Any | None:
    """The best-matching error of ``data`` against the packaged JSON Schema ``schema`` (a file
    under ``megatron_hexiseq/schema/``), or None."""
    import jsonschema

    spec = json.loads(resources.files("megatron_hexiseq").joinpath(f"schema/{schema}").read_text())
    return jsonschema.exceptions.best_match(jsonschema.Draft202012Validator(spec).iter_errors(data))


def check_finite(
    data: Mapping[str, Any],
    source: str,
    keys: Iterable[str],
    what: str,
    skip: Collection[str] = (),
) -> None:
    """One line naming the first NaN or infinity under ``data[key]`` for each of ``keys``
    ("``{source}: {where} is nan; numbers in {what} must be finite``"); mappings' ``skip`` keys are
    not entered (checked elsewhere)."""

    def walk(x: Any, where: str) -> None:
        if isinstance(x, float) and not math.isfinite(x):
            raise HexiSeqError(f"{source}: {where} is {x}; numbers in {what} must be finite")
        if isinstance(x, Mapping):
            for k, v in x.items():
                if k not in skip:
                    walk(v, f"{where}.{k}")
        elif isinstance(x, list):
            for i, v in enumerate(x):
                walk(v, f"{where}[{i}]")

    for key in keys:
        walk(data.get(key), key)
