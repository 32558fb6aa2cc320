"""JSON Schema checks of the user's specs (cluster, model), with one-line messages that carry the
numbers.

The schemas (``schema/cluster.schema.json``, ``schema/model.schema.json``) say what each field
is; ``jsonschema`` walks them. Each field's schema carries ``x-expected`` ("a positive number"),
the words of the message ``{where} must be {expected}, got {value}``; ``required`` and
``additionalProperties`` give ``is missing`` / ``unknown key(s)`` lines. Two choices differ from
stock Draft 2020-12: ``integer`` is a Python ``int`` (not ``2.0``, never a ``bool``) and
``number`` is finite (NaN and inf from a YAML file are refused). The keyword checks below never
form the ``repr`` of a value (a YAML alias bomb or a 500-digit integer stays a short message;
:func:`errors.short` writes the value).

``jsonschema`` is imported on first use: it costs about 0.1 s CPU, as much as all of
``megatron-hexiseq --help`` (~0.1 s CPU).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterator, Sequence
from functools import cache
from importlib import resources
from typing import Any

from megatron_hexiseq.errors import HexiSeqError, short

Where = Callable[[Sequence[Any], Any], str]  # (path, whole document) -> "node 'a': count"


def _finite_number(checker: Any, x: Any) -> bool:
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        return False
    return isinstance(x, int) or math.isfinite(x)


def _int(checker: Any, x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _keyword(
    name: str, failed: Callable[[Any, Any, Any, Any], bool]
) -> Callable[..., Iterator[Any]]:
    """A keyword check whose error carries no message: the message is written by :func:`check`."""
    from jsonschema.exceptions import ValidationError

    def validate(validator: Any, value: Any, instance: Any, schema: Any) -> Iterator[Any]:
        if failed(validator, value, instance, schema):
            yield ValidationError(name)

    return validate


def _additional(validator: Any, value: Any, instance: Any, schema: Any) -> Iterator[Any]:
    """``additionalProperties``: ``false`` refuses keys outside ``properties`` (one error for all of
    them); a schema checks each of those values."""
    from jsonschema.exceptions import ValidationError

    if not validator.is_type(instance, "object"):
        return
    extra = [k for k in instance if k not in schema.get("properties", {})]
    if value is False and extra:
        yield ValidationError("additionalProperties")
    elif isinstance(value, dict):
        for k in extra:
            yield from validator.descend(instance[k], value, path=k)


@cache
def _validator(name: str) -> Any:
    import jsonschema

    base = jsonschema.Draft202012Validator
    checker = base.TYPE_CHECKER.redefine_many({"integer": _int, "number": _finite_number})
    number = lambda v, x: v.is_type(x, "number")  # noqa: E731
    keywords = {
        "type": _keyword(
            "type",
            lambda v, t, x, s: not any(v.is_type(x, k) for k in ([t] if isinstance(t, str) else t)),
        ),
        "minimum": _keyword("minimum", lambda v, m, x, s: number(v, x) and x < m),
        "maximum": _keyword("maximum", lambda v, m, x, s: number(v, x) and x > m),
        "minLength": _keyword(
            "minLength", lambda v, m, x, s: v.is_type(x, "string") and len(x) < m
        ),
        "minItems": _keyword("minItems", lambda v, m, x, s: v.is_type(x, "array") and len(x) < m),
        "enum": _keyword(
            "enum", lambda v, e, x, s: not any(type(x) is type(y) and x == y for y in e)
        ),
        "required": _keyword(
            "required", lambda v, r, x, s: v.is_type(x, "object") and any(k not in x for k in r)
        ),
        "additionalProperties": _additional,
    }
    cls = jsonschema.validators.extend(base, validators=keywords, type_checker=checker)
    schema = json.loads(
        resources.files("megatron_hexiseq").joinpath(f"schema/{name}.schema.json").read_text()
    )
    return cls(schema)


def check(data: Any, name: str, where: Where) -> None:
    """Raise a one-line HexiSeqError for the most relevant (shallowest) problem of ``data`` against
    schema ``name``; ``where(path, data)`` names the place ("nodes[0]", "node 'a': count")."""
    from jsonschema.exceptions import best_match

    err = best_match(_validator(name).iter_errors(data))
    if err is None:
        return
    path, schema, x = list(err.absolute_path), err.schema, err.instance
    here = where(path, data)
    if err.validator == "required":
        missing = [k for k in err.validator_value if k not in x]
        raise HexiSeqError(f"{here} is missing {', '.join(repr(k) for k in missing)}")
    if err.validator == "additionalProperties":
        allowed = sorted(schema.get("properties", {}))
        unknown = sorted(short(k) for k in x if k not in allowed)
        shown = ", ".join(unknown[:5]) + (
            f" and {len(unknown) - 5} more" if len(unknown) > 5 else ""
        )
        raise HexiSeqError(
            f"{here}: unknown {schema.get('x-keys', 'key(s)')} {shown}; allowed: {', '.join(allowed)}"
        )
    raise HexiSeqError(
        f"{here} must be {schema.get('x-expected', 'valid')}, got {short(x)}{_range_note(schema, x)}"
    )


def _range_note(schema: Any, x: Any) -> str:
    """Why a value that looks valid is refused: outside the range the cost model can compute with."""
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        return ""
    low, high = schema.get("minimum"), schema.get("maximum")
    if schema.get("type") == "integer":
        return f" (at most {high})" if isinstance(x, int) and high is not None and x > high else ""
    if high is not None and low is not None and (x > high or 0 < x < low):
        return f" (allowed: {low:g} to {high:g})"
    return ""
