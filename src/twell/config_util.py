"""Config sections (plain mappings from YAML or JSON) into dataclasses, checked key by key.

Low-level (standard library only), so that every layer that reads a config section (data, model, train)
can use it without importing another's.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping


def _coerce(value: Any, type_str: str, where: str) -> Any:
    """Check one config value against its annotation; numbers written as strings ("2e-5": YAML 1.1 reads
    exponent notation without a dot as text) become numbers."""
    if value is None:
        if "None" in type_str:
            return None
        raise ValueError(f"{where} must not be null (expected {type_str})")
    base = [t.strip() for t in type_str.split("|") if t.strip() != "None"]
    named = "str" in base and isinstance(value, str)  # a union with str ("bool | str"): a name such as "auto"
    if "bool" in base:
        if isinstance(value, bool):
            return value
        if named:
            return value
        raise ValueError(f"{where} must be true or false, got {value!r}")
    if "int" in base and "float" not in base:
        if isinstance(value, bool):
            raise ValueError(f"{where} must be an integer, got {value!r}")
        if isinstance(value, float) and value.is_integer():
            return int(value)
        if isinstance(value, str):
            try:
                f = float(value)
            except ValueError:
                raise ValueError(f"{where} must be an integer, got {value!r}") from None
            if f.is_integer():
                return int(f)
        if isinstance(value, int):
            return value
        raise ValueError(f"{where} must be an integer, got {value!r}")
    if "float" in base:
        if isinstance(value, bool):
            raise ValueError(f"{where} must be a number, got {value!r}")
        if isinstance(value, (int, float)):
            return float(value)
        try:
            return float(value)
        except (TypeError, ValueError):
            if named:
                return value
            raise ValueError(f"{where} must be a number, got {value!r}") from None
    if "str" in base:
        if isinstance(value, str):
            return value
        raise ValueError(f"{where} must be a string, got {value!r}")
    return value


def dataclass_from_dict(cls, d: Mapping[str, Any] | None, where: str):
    """``cls(**d)`` with unknown keys and mistyped values rejected by name (``where.key``)."""
    if d is None:
        d = {}
    if not isinstance(d, Mapping):
        raise ValueError(f"{where} must be a mapping, got {type(d).__name__}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(d) - set(fields))
    if unknown:
        raise ValueError(f"unknown key(s) {unknown} in {where}; expected some of {sorted(fields)}")
    kwargs = {k: _coerce(v, str(fields[k].type), f"{where}.{k}") for k, v in d.items()}
    return cls(**kwargs)
