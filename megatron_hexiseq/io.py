"""Small file helpers: atomic writes and YAML/JSON reads that raise HexiSeqError."""
from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

from megatron_hexiseq.errors import HexiSeqError


def write_text_atomic(path: str | os.PathLike, text: str) -> None:
    """Write ``text`` to ``path`` via a temporary file in the same folder and ``os.replace``.

    A crash or error half-way leaves the old file (or no file) in place, never a partial one.
    """
    path = Path(path)
    folder = path.parent if str(path.parent) else Path(".")
    if not folder.is_dir():
        raise HexiSeqError(f"cannot write {path}: folder {folder} does not exist; create it first")
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=folder)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def write_json_atomic(path: str | os.PathLike, obj: Any) -> None:
    """Serialise ``obj`` (indent 2, trailing newline) and write it atomically."""
    write_text_atomic(path, json.dumps(obj, indent=2) + "\n")


def read_json(path: str | os.PathLike, what: str = "JSON file") -> Any:
    """Read JSON, turning missing files and syntax errors into one-line HexiSeqErrors."""
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except FileNotFoundError:
        raise HexiSeqError(f"{what} {path} does not exist") from None
    except json.JSONDecodeError as e:
        raise HexiSeqError(f"{what} {path} is not valid JSON: {e.msg} at line {e.lineno} column {e.colno}") from None
    except OSError as e:
        raise HexiSeqError(f"cannot read {what} {path}: {e.strerror}") from None


def read_yaml(path: str | os.PathLike, what: str = "YAML file") -> Any:
    """Read YAML, turning missing files and syntax errors into one-line HexiSeqErrors."""
    import yaml

    try:
        with open(path, encoding="utf-8") as f:
            return yaml.safe_load(f)
    except FileNotFoundError:
        raise HexiSeqError(f"{what} {path} does not exist") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1} column {mark.column + 1}" if mark else ""
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise HexiSeqError(f"{what} {path} is not valid YAML{where}: {problem}") from None
    except OSError as e:
        raise HexiSeqError(f"cannot read {what} {path}: {e.strerror}") from None
