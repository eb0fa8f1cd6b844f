"""Command-line flags from the config dataclasses, and back.

One flag per field (``micro_batch_size`` -> ``--micro-batch-size``): its type from the annotation,
its help from the comment after the field in the class body. ``fastpar train`` has one for every
:class:`~fastpar.train.config.TrainConfig` field; ``fastpar plan`` the
:class:`~fastpar.models.parallel_config.ParallelConfig` fields it can pin, and it prints the
``fastpar train`` line of a layout with :func:`flags_of`, so the two commands cannot drift apart.
"""
from __future__ import annotations

import argparse
import dataclasses
import inspect
import re
import typing


def field_help(cls) -> dict[str, str]:
    """Each dataclass field's trailing comment in its class body, with the comment-only lines
    that continue it, for the classes ``cls`` is built from."""
    names, out = {f.name for f in dataclasses.fields(cls)}, {}
    for klass in reversed([k for k in cls.__mro__ if dataclasses.is_dataclass(k)]):
        last = None
        for line in inspect.getsource(klass).splitlines():
            field_line = re.match(r"\s+(\w+): [^#]*?(?:#\s*(.*))?$", line)
            more = re.match(r"\s+#\s*(.*)$", line)
            if field_line and field_line.group(1) in names:
                last = field_line.group(1)
                out[last] = field_line.group(2) or ""
            elif more and last:
                out[last] += " " + more.group(1)
            else:
                last = None
    return out


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def add_flags(parser, cls, names=None, unset: bool = False, skip=()) -> None:
    """A flag for each field of ``cls`` (those in ``names``, default all, less ``skip``), with
    the class's defaults, or with ``unset`` None (the field is then not given)."""
    hints, helps = typing.get_type_hints(cls), field_help(cls)
    defaults = {f.name: f.default for f in dataclasses.fields(cls)}
    for name in names or defaults:
        if name in skip:
            continue
        kind = [t for t in typing.get_args(hints[name]) if t is not type(None)] or [hints[name]]
        value = None if unset and kind != [bool] else defaults[name]
        text = helps.get(name, "").replace("%", "%%")
        if kind == [bool]:      # on by default: --name / --no-name
            parser.add_argument(flag(name), default=value, help=text,
                                action=argparse.BooleanOptionalAction if defaults[name] is True
                                else "store_true")
        else:
            parser.add_argument(flag(name), type=kind[0], default=value, help=text)


def flags_of(cfg, names, defaults, always=()) -> list[str]:
    """The flags that give ``cfg``'s ``names`` to a command whose defaults are ``defaults``
    (a config instance): the fields that differ from them, and ``always``."""
    out = []
    for name in names:
        value = getattr(cfg, name)
        if name not in always and value == getattr(defaults, name):
            continue
        if value is False and getattr(defaults, name) is True:
            out.append(flag("no_" + name))
            continue
        out += [flag(name)] if value is True else [] if value is False else \
            [flag(name), str(value)]
    return out


def resume_arg(value: str):
    """``--resume`` takes no value, or ``auto``."""
    if value != "auto":
        raise argparse.ArgumentTypeError(f"--resume takes no value or 'auto', not {value!r}")
    return value
