"""Frozen dataclasses as command-line flags and as config mappings.

Each field is one flag named after it (`--max-num-seqs` for max_num_seqs) whose type,
default, choices and help come from the field: its annotation (`int | None` parses as int,
a `Literal` gives the choices), its default, and its metadata ("help", "choices", and
"group": the help section the flag is listed under). A field whose type is itself a
dataclass contributes its fields as flags of their own (flat: `--max-num-seqs`, not
`--engine.max-num-seqs`), so the flag names form one flat namespace.

The same fields read a mapping of flag names to values (a Ray Serve config's `args`) field by
field: `config_values` converts each value as the flag's parser would and refuses an unknown
name or a value of the wrong type with an error that names it.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import typing
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

# A bool flag's value in a config may also be one of these words: `serve run app:builder
# enforce_eager=true` passes every value as a string.
_BOOL_WORDS = {"true": True, "false": False}

T = TypeVar("T", bound="DataclassInstance")


@dataclass(frozen=True)
class Flag:
    """One field as a flag: its `name` (the field's, and the parsed namespace's attribute),
    the type its value parses as (`kind`: bool, int, float or str), its `choices` (None:
    any), and the field itself (default and metadata)."""

    name: str
    kind: type
    choices: tuple[Any, ...] | None
    field: dataclasses.Field
    multiple: bool = False  # a tuple[kind, ...] field: the flag takes one value or more


def _init_fields(cls: type) -> Iterator[tuple[dataclasses.Field, Any]]:
    """Each field of dataclass `cls` that `__init__` takes, with its resolved annotation."""
    hints = typing.get_type_hints(cls)
    return ((field, hints[field.name]) for field in dataclasses.fields(cls) if field.init)


def _walk(
    cls: type, defaults: Any = None, section: str | None = None
) -> Iterator[tuple[Flag, Any, str | None]]:
    """Each flag of dataclass `cls` in field order, those of nested dataclass fields in
    their place, with its default (the field's value in `defaults`, an instance of `cls`,
    else the field's default; MISSING: none) and the help section it is listed under (the
    "group" of its field, else that of the nearest enclosing dataclass field that has one,
    else `section`)."""
    for field, hint in _init_fields(cls):
        default = getattr(defaults, field.name) if defaults is not None else _default(field)
        group = field.metadata.get("group", section)
        if dataclasses.is_dataclass(hint):
            nested = None if default is dataclasses.MISSING else default
            yield from _walk(typing.cast(type, hint), nested, group)
            continue
        kind, choices, multiple = _parsed_type(hint)
        if "choices" in field.metadata:
            choices = tuple(field.metadata["choices"])
        yield Flag(field.name, kind, choices, field, multiple), default, group


def flags(cls: type) -> dict[str, Flag]:
    """Every flag of dataclass `cls` by name, in field order, those of nested dataclass
    fields in their place."""
    return {flag.name: flag for flag, _, _ in _walk(cls)}


def _default(field: dataclasses.Field) -> Any:
    """The field's default (made by its factory if it has one), or MISSING."""
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return field.default


def _parsed_type(hint: Any) -> tuple[type, tuple[Any, ...] | None, bool]:
    """The parsed type of an annotation, its Literal choices, and whether it is
    `tuple[X, ...]` (a flag of one value or more): `int | None` -> (int, None, False),
    `Literal["a", "b"]` -> (str, ("a", "b"), False), `tuple[str, ...]` -> (str, None, True)."""
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if typing.get_origin(hint) is typing.Literal:
        return type(args[0]), tuple(args), False
    if typing.get_origin(hint) is tuple:
        return *_parsed_type(args[0])[:2], True
    if len(args) == 1:  # Optional[X]
        return _parsed_type(args[0])
    return hint, None, False


def add_flags(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup,
    cls: type,
    defaults: Any = None,
) -> None:
    """Adds one flag per field of `cls` to `parser`, each defaulting to the field's value in
    `defaults` (an instance of `cls`), or without one to the field's default (a field
    without a default is then a required flag). A field with metadata "group" (a nested
    dataclass field included) is listed under that help section, made on first use. A bool
    that is off by default is `--name`; one on (or decided later) by default also has
    `--no-name`."""
    sections: dict[str, argparse._ArgumentGroup] = {}
    for flag, default, title in _walk(cls, defaults):
        if title is not None and title not in sections:
            sections[title] = parser.add_argument_group(title)
        _add_flag(parser if title is None else sections[title], flag, default)


def _add_flag(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup, flag: Flag, default: Any
) -> None:
    option = "--" + flag.name.replace("_", "-")
    options: dict[str, Any] = {"help": flag.field.metadata.get("help")}
    if flag.choices is not None:
        options["choices"] = list(flag.choices)
    if flag.multiple:
        parser.add_argument(option, type=flag.kind, nargs="+", default=default, **options)
    elif flag.kind is bool:
        action = argparse.BooleanOptionalAction if default is not False else "store_true"
        parser.add_argument(option, action=action, default=default, **options)
    elif default is dataclasses.MISSING:
        parser.add_argument(option, type=flag.kind, required=True, **options)
    else:
        parser.add_argument(option, type=flag.kind, default=default, **options)


def from_flags(cls: type[T], values: Mapping[str, Any]) -> T:
    """An instance of `cls` from flag values by name (a parsed namespace's `vars`, or
    `config_values`): a field missing from `values` keeps its default, a nested dataclass
    field is its default with the values given for its own fields replaced (names that are
    no flag of `cls` are ignored). The dataclasses' own checks run (ValueError)."""
    kwargs: dict[str, Any] = {}
    for field, hint in _init_fields(cls):
        if dataclasses.is_dataclass(hint):
            nested = typing.cast(type, hint)
            own = {name: values[name] for name in flags(nested) if name in values}
            default = _default(field)
            if default is not dataclasses.MISSING:
                kwargs[field.name] = dataclasses.replace(default, **own)
            elif own:
                kwargs[field.name] = nested(**own)
        elif field.name in values:
            value = values[field.name]
            kwargs[field.name] = tuple(value) if isinstance(value, list) else value
    return cls(**kwargs)


def config_values(cls: type, config: Mapping[str, Any], source: str) -> dict[str, Any]:
    """The flag values of a config mapping, by field name: keys are flag names with
    underscores or dashes, values what the flag's argument would be (a bool for a bool
    flag; a number, or a string the flag's type parses); null keeps the default. An unknown
    key, a value of the wrong type or outside the choices is a ValueError naming the key
    and `source` (what the mapping is, for the message)."""
    known = flags(cls)
    values: dict[str, Any] = {}
    for key, value in config.items():
        name = str(key).replace("-", "_")
        if name not in known:
            raise ValueError(
                f"{source}: unknown option {key!r} (each key is an `octavo serve` flag, "
                "see `octavo serve --help`)"
            )
        if value is None:
            continue
        flag = known[name]
        if flag.multiple:  # a list, or one value
            items = value if isinstance(value, list) else [value]
            values[name] = tuple(_config_value(flag, key, item, source) for item in items)
        else:
            values[name] = _config_value(flag, key, value, source)
    return values


def _config_value(flag: Flag, key: Any, value: Any, source: str) -> Any:
    """`value` as `flag`'s type, or a ValueError naming `key`. A string converts as the
    flag's argument would; a bool fits only a bool flag, and a float no int flag."""
    converted: Any = None
    if isinstance(value, str) and flag.kind is bool:
        converted = _BOOL_WORDS.get(value.strip().lower())
    elif isinstance(value, str):
        with contextlib.suppress(ValueError):
            converted = flag.kind(value)
    elif isinstance(value, bool):
        converted = value if flag.kind is bool else None
    elif isinstance(value, (int, float)) and flag.kind is not bool:
        fits = isinstance(value, int) or flag.kind is not int
        converted = flag.kind(value) if fits else None
    if converted is None:
        raise ValueError(f"{source}: {key!r} must be {flag.kind.__name__}, got {value!r}")
    if flag.choices is not None and converted not in flag.choices:
        raise ValueError(f"{source}: {key!r} must be one of {list(flag.choices)}, got {value!r}")
    return converted
