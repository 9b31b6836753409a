"""Reading a pipeline file's text: YAML with limits on its shape, environment
interpolation, and validation errors named by their path in the file."""

from __future__ import annotations

import fnmatch
import re
import types
import typing
from collections.abc import Mapping
from typing import Any, Union

import yaml
from pydantic import BaseModel, ValidationError

from wormhole.core.errors import ConfigError

# ---------------------------------------------------------------- interpolation
_VAR = re.compile(r"\$(\$|\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\})")


def interpolate(
    value: Any,
    env: Mapping[str, str],
    path: str,
    problems: list[str],
    unused: tuple[str, ...] = (),
) -> Any:
    """Replace ``${VAR}`` / ``${VAR:-default}`` in every string; ``$$`` is a literal ``$``.

    Under a key matching one of the ``unused`` patterns (``fnmatch``, e.g. ``source.*``: a
    part the command does not use), an unset variable stays as written instead of being an
    error: ``wormhole status`` needs no database password."""
    if isinstance(value, str):
        if "$" not in value:
            return value

        def sub(m: re.Match[str]) -> str:
            if m.group(1) == "$":
                return "$"
            name, default = m.group(2), m.group(3)
            if name in env and (env[name] != "" or default is None):
                return env[name]
            if default is not None:
                return default
            if any(fnmatch.fnmatchcase(path, pattern) for pattern in unused):
                return m.group(0)
            problems.append(
                f"{path or '<root>'}: environment variable {name} is not set "
                f"(set it, or write ${{{name}:-default}})"
            )
            return ""

        return _VAR.sub(sub, value)
    if isinstance(value, dict):
        return {
            k: interpolate(v, env, f"{path}.{k}" if path else str(k), problems, unused)
            for k, v in value.items()
        }
    if isinstance(value, list):
        return [interpolate(v, env, f"{path}[{i}]", problems, unused) for i, v in enumerate(value)]
    return value


# ------------------------------------------------------------- error formatting
def _path(loc: tuple[Any, ...]) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += f".{part}" if out else str(part)
    return out or "<root>"


def _unwrap(annotation: Any) -> Any:
    origin = typing.get_origin(annotation)
    if origin in (Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        return _unwrap(args[0]) if len(args) == 1 else annotation
    return annotation


def _known_keys(model: type[BaseModel], loc: tuple[Any, ...]) -> list[str] | None:
    current: Any = model
    i = 0
    while i < len(loc):
        if not (isinstance(current, type) and issubclass(current, BaseModel)):
            return None
        info = current.model_fields.get(str(loc[i]))
        if info is None:
            return None
        annotation = _unwrap(info.annotation)
        i += 1
        while typing.get_origin(annotation) in (dict, list):
            args = typing.get_args(annotation)
            annotation = _unwrap(args[-1])
            i += 1
        current = annotation
    if isinstance(current, type) and issubclass(current, BaseModel):
        return [
            field.alias or name  # as the file spells it (`copy`, not the field `copy_`)
            for name, field in current.model_fields.items()
            if not (
                isinstance(field.json_schema_extra, dict)
                and field.json_schema_extra.get("internal")
            )
        ]
    return None


def format_validation_error(
    exc: ValidationError, model: type[BaseModel], prefix: tuple[Any, ...] = ()
) -> list[str]:
    problems = []
    for error in exc.errors():
        loc = tuple(error["loc"])
        kind = error["type"]
        if kind == "missing":
            message = "field required"
        elif kind == "extra_forbidden":
            known = _known_keys(model, loc[:-1])
            message = "unknown option" + (f" (known: {', '.join(known)})" if known else "")
        else:
            message = str(error["msg"])
            message = message.removeprefix("Value error, ")
            message = message[:1].lower() + message[1:]
        problems.append(f"{_path(prefix + loc)}: {message}")
    return problems


# ------------------------------------------------------------------- loading
MAX_NESTING = 64
"""Mappings and lists nest at most this deep in a pipeline file."""
MAX_VALUES = 100_000
"""Values in a pipeline file, counting each use of a YAML alias again."""


def load_yaml(text: str, source: str) -> Any:
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
        problem = getattr(exc, "problem", None) or str(exc)
        raise ConfigError(f"malformed YAML: {where}{problem}", source) from exc
    except RecursionError:
        # The YAML parser recurses once per level of nesting.
        raise ConfigError(
            f"malformed YAML: nested too deeply (at most {MAX_NESTING} levels)", source
        ) from None
    _check_shape(data, "", [], [MAX_VALUES], source)
    return data


def _check_shape(
    value: Any, path: str, ancestors: list[int], budget: list[int], source: str
) -> None:
    """Refuse what YAML anchors and aliases can build before anything walks it: a mapping or
    list inside itself, nesting deeper than MAX_NESTING, or aliases of aliases that expand
    to more than MAX_VALUES values."""
    if not isinstance(value, dict | list):
        return
    if id(value) in ancestors:
        raise ConfigError(
            f"{path or '<root>'}: contains itself (a YAML alias inside its own anchor); "
            f"write the value out",
            source,
        )
    if len(ancestors) >= MAX_NESTING:
        raise ConfigError(f"{path}: nested more than {MAX_NESTING} levels deep", source)
    ancestors.append(id(value))
    items = value.items() if isinstance(value, dict) else enumerate(value)
    for key, item in items:
        budget[0] -= 1
        if budget[0] < 0:
            raise ConfigError(
                f"more than {MAX_VALUES:,} values once YAML aliases are expanded (aliases "
                f"inside aliases?); a pipeline file needs far fewer",
                source,
            )
        child = (
            f"{path}[{key}]" if isinstance(value, list) else f"{path}.{key}" if path else str(key)
        )
        _check_shape(item, child, ancestors, budget, source)
    ancestors.pop()
