"""Command-line flags declared once, as fields of frozen options dataclasses.

A flag is a dataclass field made by :func:`flag`: the field's name is the
argparse ``dest`` and the config attribute, its default is the flag's default,
and its help text is both the field's documentation and its ``--help`` line.
:func:`add_options` registers the flags of one options class on a parser as an
argument group titled by the class's ``TITLE``; a command that means something
else by a flag (``eval-lm``'s ``--batch-size`` defaults to the training run's)
overrides only its default, help, ``required`` or choices there.

    @dataclasses.dataclass(frozen=True, kw_only=True)
    class DatasetOptions:
        TITLE: ClassVar[str] = "dataset"
        batch_size: int = flag(8, "sequences per rank per micro-batch (default: %(default)s)")

    add_options(parser, DatasetOptions)                  # --batch-size BATCH_SIZE
"""
from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional, Sequence

_KEY = "fullshard.flag"
_OVERRIDABLE = frozenset({"default", "help", "required", "choices"})


@dataclass(frozen=True)
class Flag:
    """How one field appears on the command line (kept in the field's metadata)."""

    help: Optional[str]
    """The ``--help`` text (argparse ``%(default)s`` is expanded); the field's documentation."""
    option: Optional[str] = None
    """The option string, e.g. ``--no-reshard-after-forward``; None: ``--`` + the field name with dashes."""
    aliases: tuple = ()
    """More option strings, e.g. ``("-a",)`` or ``("--wd",)``."""
    type: Optional[Callable[[str], Any]] = None
    """Converts the text; None: the default's type (int, float) or the text itself."""
    choices: Optional[Sequence] = None
    metavar: Optional[str] = None
    positional: bool = False
    """A positional argument (its metavar names it), registered on the parser, not in the group."""
    negatable: bool = False
    """A bool given as ``--name`` / ``--no-name`` (argparse's ``BooleanOptionalAction``)."""


def flag(default: Any = dataclasses.MISSING, help: Optional[str] = None, *, option: Optional[str] = None,
         aliases: Sequence[str] = (), type: Optional[Callable[[str], Any]] = None,
         choices: Optional[Sequence] = None, metavar: Optional[str] = None, positional: bool = False,
         negatable: bool = False):
    """A dataclass field that is also a command-line flag (see the module docstring).

    A bool field is a switch: ``store_true`` with default False; with default True the
    ``option`` must name the switch that turns it off (``store_false``, e.g.
    ``--no-reshard-after-forward``); with ``negatable`` both ``--name`` and ``--no-name`` exist
    (``BooleanOptionalAction``), whatever the default. A field without a default is a required
    argument.

    Raises:
        ValueError: a bool defaulting to True without an ``option`` or ``negatable`` (nothing could
            turn it off), or ``negatable`` on a field that is no bool.
    """
    if default is True and option is None and not negatable:
        raise ValueError("a bool flag defaulting to True needs the option that turns it off")
    if negatable and not isinstance(default, bool):
        raise ValueError("only a bool flag can be negatable")
    spec = Flag(help, option, tuple(aliases), type, tuple(choices) if choices is not None else None, metavar,
                positional, negatable)
    return dataclasses.field(default=default, metadata={_KEY: spec})


def flag_of(field: dataclasses.Field) -> Optional[Flag]:
    """The field's :class:`Flag`, or None for a field that is no flag."""
    return field.metadata.get(_KEY)


def option_string(cls, name: str) -> str:
    """The option a field of ``cls`` is given with, e.g. ``collective_timeout_s`` -> ``--collective-timeout``.

    Raises:
        KeyError: ``name`` is no flag field of ``cls``.
    """
    for f in dataclasses.fields(cls):
        if f.name == name and flag_of(f) is not None:
            spec = flag_of(f)
            return spec.metavar if spec.positional else spec.option or "--" + name.replace("_", "-")
    raise KeyError(f"{cls.__name__} has no flag {name!r}")


def flag_fields(cls) -> list:
    """The fields of ``cls`` that are flags, in declaration order."""
    return [f for f in dataclasses.fields(cls) if flag_of(f) is not None]


def add_options(parser: argparse.ArgumentParser, cls, names: Optional[Sequence[str]] = None, *,
                group: bool = True, overrides: Optional[Mapping[str, Mapping[str, Any]]] = None):
    """Register the flags of the options class ``cls`` on ``parser``.

    Args:
        parser: the (sub)command's parser.
        cls: an options dataclass whose flag fields were made by :func:`flag`; its ``TITLE`` names
            the argument group.
        names: the fields to register (default: all), in ``cls``'s order.
        group: put them in an argument group titled ``cls.TITLE`` (False: the parser's own options).
        overrides: ``{field: {"default" | "help" | "required" | "choices": value}}`` for a command
            whose meaning of a flag differs (e.g. a default read from a checkpoint).

    Returns:
        The argument group (``parser`` when ``group`` is False or only positionals were chosen).

    Raises:
        KeyError: a name in ``names`` or ``overrides`` is no flag of ``cls``.
        TypeError: an override of anything but default, help, required or choices.
    """
    fields = {f.name: f for f in flag_fields(cls)}
    overrides = dict(overrides or {})
    for name in list(names or ()) + list(overrides):
        if name not in fields:
            raise KeyError(f"{cls.__name__} has no flag {name!r}")
    chosen = [f for name, f in fields.items() if names is None or name in names]
    target = parser
    if group and any(not flag_of(f).positional for f in chosen):
        target = parser.add_argument_group(cls.TITLE)
    for field in chosen:
        extra = overrides.get(field.name, {})
        if set(extra) - _OVERRIDABLE:
            raise TypeError(f"cannot override {sorted(set(extra) - _OVERRIDABLE)} of --{field.name}")
        _add(parser if flag_of(field).positional else target, field, extra)
    return target


def _add(target, field: dataclasses.Field, extra: Mapping[str, Any]) -> None:
    spec = flag_of(field)
    default = extra.get("default", field.default)
    kwargs = {"help": extra.get("help", spec.help)}
    if spec.positional:
        target.add_argument(field.name, metavar=spec.metavar, **kwargs)
        return
    if spec.negatable:
        kwargs.update(action=argparse.BooleanOptionalAction, default=default)
    elif isinstance(field.default, bool):
        kwargs["action"] = "store_false" if field.default else "store_true"
    else:
        kind = spec.type or (type(field.default) if isinstance(field.default, (int, float)) else None)
        kwargs.update(default=default, type=kind, choices=extra.get("choices", spec.choices), metavar=spec.metavar)
        if field.default is dataclasses.MISSING or extra.get("required"):
            kwargs.update(required=True, default=None)
    strings = [spec.option or "--" + field.name.replace("_", "-"), *spec.aliases]
    target.add_argument(*strings, dest=field.name, **{k: v for k, v in kwargs.items() if v is not None})


def values_of(cls, namespace: argparse.Namespace) -> dict:
    """``{field: value}`` of the flags of ``cls`` found in a parsed ``namespace``."""
    return {f.name: getattr(namespace, f.name) for f in flag_fields(cls) if hasattr(namespace, f.name)}
