"""argparse flags generated from pydantic settings models, so that each flag is declared once, as a field: its name,
type, choices, help and metavar come from the field, its default stays in the model, and the parsed flags are built
back into the (nested) settings with one-line errors that name the flag."""

from __future__ import annotations

import argparse
import types
import typing
from typing import Any, Iterable, Literal, Union

import pydantic
from pydantic import BaseModel
from pydantic.fields import FieldInfo


class FlagError(ValueError):
    """A flag value the settings refuse; the message is one line naming the flag and what it needs."""


def add_flags(parser: argparse.ArgumentParser, model: type[BaseModel], exclude: Iterable[str] = ()) -> None:
    """Adds one flag per field of `model` to `parser`; a field that is itself a model becomes an argument group,
    titled by the field's name, of its own fields' flags. `exclude` names fields to leave out by dotted path
    (`network.client_mode`); they keep their model default.

    A flag is `--` + the field name with dashes, or `json_schema_extra={"flag": ...}`; `metavar` comes from the
    same place. bool fields are switches: one defaulting to True needs a flag spelled `no-...` that turns it off.
    Raises TypeError for an annotation this function cannot turn into a flag (a programming error).
    """
    _add_flags(parser, parser, model, (), frozenset(exclude))


def settings_from_args(model: type[BaseModel], args: argparse.Namespace) -> Any:
    """Builds `model` from flags that `add_flags(..., model)` added; flags not given leave the model's defaults.

    Raises FlagError with one line, `bad flag --NAME: what the value must be`, when the model refuses a value.
    """
    given = vars(args)
    try:
        return model.model_validate(_values(model, given, ()))
    except pydantic.ValidationError as e:
        err = e.errors()[0]
        msg = err["msg"].removeprefix("Value error, ")
        flag = _flag_at(model, tuple(str(part) for part in err["loc"]))
        raise FlagError(f"bad flag {flag}: {msg}" if flag else f"bad flags: {msg}") from None


def _add_flags(parser: argparse.ArgumentParser, container: Any, model: type[BaseModel], path: tuple[str, ...],
               exclude: frozenset[str]) -> None:
    for name, field in model.model_fields.items():
        dotted = ".".join(path + (name,))
        if dotted in exclude:
            continue
        group = _group_model(field)
        if group is not None:
            _add_flags(parser, parser.add_argument_group(name), group, path + (name,), exclude)
            continue
        if not field.description:
            raise TypeError(f"{model.__name__}.{name} needs a description: it is the help of its flag")
        kwargs: dict[str, Any] = dict(dest=dotted, default=argparse.SUPPRESS, help=field.description.replace("%", "%%"),
                                      **_kind(model, name, field))
        if field.is_required():
            kwargs["required"] = True
        container.add_argument(_flag(name, field), **kwargs)


def _kind(model: type[BaseModel], name: str, field: FieldInfo) -> dict[str, Any]:
    """argparse's action/type/nargs/choices/metavar for one field."""
    annotation = _unwrap_optional(field.annotation)
    metavar = {"metavar": _extra(field)["metavar"]} if "metavar" in _extra(field) else {}
    origin, type_args = typing.get_origin(annotation), typing.get_args(annotation)
    if annotation is bool:
        if field.default is None:  # three ways: --x, --no-x, or neither (the field's own default decides)
            return dict(action=argparse.BooleanOptionalAction)
        if field.default is True:  # a switch that turns something off must say so in its name
            if not _flag(name, field).startswith("--no-"):
                raise TypeError(f"{model.__name__}.{name} defaults to True: its flag must be spelled --no-...")
            return dict(action="store_false")
        return dict(action="store_true")
    if origin is Literal:
        return dict(choices=type_args)
    if origin is tuple and len(type_args) == 2 and type_args[1] is Ellipsis and type_args[0] in (str, int, float):
        return dict(nargs="+", type=type_args[0], **metavar)
    if annotation in (str, int, float):
        return dict(type=annotation, **metavar)
    raise TypeError(f"{model.__name__}.{name}: no flag for annotation {annotation!r}")


def _values(model: type[BaseModel], given: dict[str, Any], path: tuple[str, ...]) -> dict[str, Any]:
    """The nested mapping of given flag values, keyed by field name, for model_validate."""
    values: dict[str, Any] = {}
    for name, field in model.model_fields.items():
        dotted = ".".join(path + (name,))
        group = _group_model(field)
        if group is not None:
            values[name] = _values(group, given, path + (name,))
        elif dotted in given:
            values[name] = given[dotted]
    return values


def _flag_at(model: type[BaseModel], loc: tuple[str, ...]) -> str:
    """The flag of the field at a validation error's location, or '' for an error of a whole model."""
    for name in loc:
        field = model.model_fields.get(name)
        if field is None:
            return ""
        group = _group_model(field)
        if group is None:
            return _flag(name, field)
        model = group
    return ""


def _group_model(field: FieldInfo) -> type[BaseModel] | None:
    """The settings model a field nests (its flags form a group), or None for a field that is one flag."""
    annotation = _unwrap_optional(field.annotation)
    return annotation if isinstance(annotation, type) and issubclass(annotation, BaseModel) else None


def _flag(name: str, field: FieldInfo) -> str:
    return "--" + _extra(field).get("flag", name.replace("_", "-"))


def _extra(field: FieldInfo) -> dict[str, Any]:
    return field.json_schema_extra if isinstance(field.json_schema_extra, dict) else {}


def _unwrap_optional(annotation: Any) -> Any:
    """X for Optional[X] / X | None; anything else unchanged."""
    if typing.get_origin(annotation) in (Union, types.UnionType):
        rest = [arg for arg in typing.get_args(annotation) if arg is not type(None)]
        if len(rest) == 1:
            return rest[0]
    return annotation
