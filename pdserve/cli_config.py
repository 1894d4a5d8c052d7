"""Command lines generated from config dataclasses: one flag per field, so a field added to a config is a flag of
every service that holds it, with the same name and meaning everywhere.

- A field ``foo_bar`` is ``--foo-bar``; a nested dataclass field (``PrefillConfig.engine``) is flattened, its fields
  are flags of their own (``--block-size``, not ``--engine-block-size``) and its default instance gives the defaults.
- The type comes from the annotation (``int``, ``float``, ``str``, ``bool``, ``X | None``). Booleans take
  ``--x`` / ``--no-x``; an optional value also takes ``none``.
- ``field(metadata=...)`` keys: ``help``, ``choices``, ``metavar``, ``flag`` (name without ``--``), ``aliases``
  (``("-tp",)``), ``env`` (default read from that environment variable), ``secret`` (never shown in --help nor put on a
  command line by ``to_argv``), ``cli`` (False: not a flag), ``parse`` (a function from the flag's text to the value,
  for a field of more than one type such as ``int | str`` "a count or auto"; its ValueError is the flag's error).

``add_arguments`` / ``from_args`` go from a class to argparse and back; ``flags_of`` says which flags a class
takes; ``argv_for`` / ``to_argv`` build the command line of values (a supervisor starting services).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import types
import typing
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence, TypeVar

T = TypeVar("T")

_SCALARS: tuple[type, ...] = (bool, int, float, str)


@dataclass(frozen=True)
class Flag:
    """One command-line flag of a config field."""

    name: str  # the field's name, also the argparse dest (unique across nested configs)
    path: tuple[str, ...]  # attribute path from the top config, e.g. ("engine", "block_size")
    flag: str  # "--block-size"
    aliases: tuple[str, ...]
    type: type
    optional: bool  # the annotation admits None
    default: Any
    help: str
    choices: tuple[Any, ...] | None
    metavar: str | None
    env: str | None
    secret: bool
    parse: Callable[[str], Any] | None = None  # the field's own parser (metadata "parse")

    def env_default(self, environ: Mapping[str, str]) -> Any:
        raw = environ.get(self.env, "") if self.env else ""
        if not raw:
            return self.default
        if self.type is bool:
            return raw.strip().lower() in ("1", "true", "yes", "on")
        return _parser_of(self)(raw)


def _scalar(annotation: Any) -> tuple[Any, bool]:
    """(base type, optional) of an annotation such as ``int``, ``int | None``, ``Optional[str]``."""
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        if len(args) == 1:
            return args[0], True
    return annotation, False


def _default_of(f: dataclasses.Field[Any]) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return dataclasses.MISSING


def _walk(cls: type, defaults: Any, path: tuple[str, ...]) -> list[Flag]:
    out: list[Flag] = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        meta = f.metadata
        if not f.init or meta.get("cli", True) is False:
            continue
        typ, optional = _scalar(hints[f.name])
        default = getattr(defaults, f.name) if defaults is not None else _default_of(f)
        if isinstance(typ, type) and dataclasses.is_dataclass(typ):
            out += _walk(typ, default if default is not dataclasses.MISSING else None, (*path, f.name))
            continue
        if "parse" in meta:  # the command-line form is text the field's parser reads
            typ = str
        if typ not in _SCALARS:
            raise TypeError(f"{cls.__name__}.{f.name}: no command-line form for {hints[f.name]!r}")
        if default is dataclasses.MISSING:
            raise TypeError(f"{cls.__name__}.{f.name}: a flag needs a default")
        choices = meta.get("choices")
        out.append(
            Flag(
                name=f.name,
                path=(*path, f.name),
                flag="--" + meta.get("flag", f.name.replace("_", "-")),
                aliases=tuple(meta.get("aliases", ())),
                type=typ,
                optional=optional,
                default=default,
                help=meta.get("help", ""),
                choices=tuple(choices) if choices is not None else None,
                metavar=meta.get("metavar"),
                env=meta.get("env"),
                secret=bool(meta.get("secret")),
                parse=meta.get("parse"),
            )
        )
    return out


def flags(cls: type) -> list[Flag]:
    """Every flag of config class ``cls`` (nested configs flattened), in field order."""
    out = _walk(cls, None, ())
    seen: dict[str, Flag] = {}
    for fl in out:
        for key in (fl.name, fl.flag, *fl.aliases):
            if key in seen:
                raise TypeError(f"{cls.__name__}: {key!r} is both {'.'.join(seen[key].path)} and {'.'.join(fl.path)}")
            seen[key] = fl
    return out


def flags_of(cls: type) -> set[str]:
    """The flag strings ``cls`` accepts (``--no-x`` forms and aliases included)."""
    out: set[str] = set()
    for fl in flags(cls):
        out |= {fl.flag, *fl.aliases}
        if fl.type is bool:
            out |= {"--no-" + f[2:] for f in (fl.flag, *fl.aliases) if f.startswith("--")}
    return out


def argparse_type(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    """``parse`` as an argparse ``type=``: its ValueError's text becomes the flag's error (argparse would print only
    "invalid value"; the parser's text says what to pass)."""

    def typed(raw: str) -> Any:
        try:
            return parse(raw)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    return typed


def _parser_of(fl: Flag) -> Callable[[str], Any]:
    base: Callable[[str], Any] = fl.type if fl.parse is None else argparse_type(fl.parse)

    def parse(raw: str) -> Any:
        if fl.optional and raw.strip().lower() == "none":
            return None
        v = base(raw)
        # checked here rather than by argparse's choices=, which would refuse an optional field's None
        if fl.choices is not None and v not in fl.choices:
            raise argparse.ArgumentTypeError(
                f"invalid choice: {raw!r} (choose from {', '.join(map(repr, fl.choices))})"
            )
        return v

    parse.__name__ = fl.type.__name__  # argparse names it in "invalid int value: 'x'"
    return parse


def _help(fl: Flag) -> str:
    parts = [fl.help] if fl.help else []
    if fl.env:
        parts.append(f"env {fl.env}")
    if not fl.secret and fl.type is not bool:
        if fl.default not in (None, ""):
            parts.append("default: %(default)s")
    return "; ".join(parts)


def add_arguments(p: argparse.ArgumentParser, cls: type, environ: Mapping[str, str] | None = None) -> None:
    """Add one argument per field of ``cls`` (nested configs in a group each) to ``p``."""
    env = os.environ if environ is None else environ
    groups: dict[tuple[str, ...], Any] = {(): p}
    for fl in flags(cls):
        where = fl.path[:-1]
        if where not in groups:
            groups[where] = p.add_argument_group(".".join(where))
        g = groups[where]
        default = fl.env_default(env)
        if fl.type is bool:
            g.add_argument(
                fl.flag,
                *fl.aliases,
                dest=fl.name,
                action=argparse.BooleanOptionalAction,
                default=default,
                help=_help(fl),
            )
        else:
            shown = "{" + ",".join(map(str, fl.choices)) + "}" if fl.choices else fl.type.__name__.upper()
            g.add_argument(
                fl.flag,
                *fl.aliases,
                dest=fl.name,
                type=_parser_of(fl),
                default=default,
                metavar=fl.metavar or shown,
                help=_help(fl),
            )


def build_parser(
    cls: type, prog: str, description: str | None = None, environ: Mapping[str, str] | None = None
) -> argparse.ArgumentParser:
    # exact flags only: a prefix of a renamed flag must not quietly mean another one
    p = argparse.ArgumentParser(prog=prog, description=description, allow_abbrev=False)
    add_arguments(p, cls, environ)
    return p


def _build(cls: type[T], values: Mapping[str, Any], defaults: Any = None) -> T:
    hints = typing.get_type_hints(cls)
    kw: dict[str, Any] = {}
    for f in dataclasses.fields(typing.cast(Any, cls)):
        if not f.init:
            continue
        typ, _ = _scalar(hints[f.name])
        default = getattr(defaults, f.name) if defaults is not None else _default_of(f)
        if isinstance(typ, type) and dataclasses.is_dataclass(typ) and f.metadata.get("cli", True) is not False:
            # the holder's default instance (DecodeConfig's engine) supplies what ``values`` leaves out
            kw[f.name] = _build(typ, values, default if default is not dataclasses.MISSING else None)
        elif f.name in values:
            kw[f.name] = values[f.name]
        elif defaults is not None:
            kw[f.name] = default
    return cls(**kw)


def build(cls: type[T], /, **values: Any) -> T:
    """``cls`` with the named fields set, nested ones by their flattened names: ``build(DecodeConfig, model=p,
    tensor_parallel_size=2)`` is DecodeConfig(engine=<its default engine, with model and TP set>)."""
    known = {fl.name for fl in flags(cls)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise TypeError(f"{cls.__name__} has no field {', '.join(map(repr, unknown))}")
    return _build(cls, values)


def from_args(cls: type[T], args: argparse.Namespace | Mapping[str, Any]) -> T:
    """The ``cls`` of parsed arguments (fields without a flag keep their defaults). Validation errors are the
    config's own (``ValueError`` subclasses)."""
    values = vars(args) if isinstance(args, argparse.Namespace) else args
    return _build(cls, {fl.name: values[fl.name] for fl in flags(cls) if fl.name in values})


def _arg(fl: Flag, value: Any) -> list[str]:
    if fl.type is bool:
        return [fl.flag if value else "--no-" + fl.flag[2:]]
    if value is None:
        if not fl.optional:
            raise ValueError(f"{fl.flag} cannot be None")
        return [fl.flag, "none"]
    if fl.type is float:
        return [fl.flag, f"{value:g}" if float(value) == float(f"{value:g}") else repr(float(value))]
    return [fl.flag, str(value)]


def argv_for(cls: type, values: Mapping[str, Any] | None = None, /, **kw: Any) -> list[str]:
    """The command-line arguments that set the named fields of ``cls`` (flattened names: ``block_size``, not
    ``engine.block_size``). An unknown name raises KeyError, so a caller cannot drift from the config's flags."""
    byname = {fl.name: fl for fl in flags(cls)}
    out: list[str] = []
    for name, value in {**(values or {}), **kw}.items():
        if name not in byname:
            raise KeyError(f"{cls.__name__} has no flag for {name!r}")
        out += _arg(byname[name], value)
    return out


def to_argv(cfg: Any, *, all_fields: bool = False, secrets: bool = False) -> list[str]:
    """The command line that rebuilds ``cfg`` (fields at their class default are left out unless ``all_fields``;
    secrets only with ``secrets=True``: command lines are visible to every user of the host)."""
    out: list[str] = []
    for fl in flags(type(cfg)):
        if fl.secret and not secrets:
            continue
        value: Any = cfg
        for part in fl.path:
            value = getattr(value, part)
        if all_fields or value != fl.default:
            out += _arg(fl, value)
    return out


def field_names(cls: type) -> Sequence[str]:
    return [fl.name for fl in flags(cls)]


LOG_LEVEL_ENV = "PDSERVE_LOG_LEVEL"


def add_log_level(p: argparse.ArgumentParser, environ: Mapping[str, str] | None = None) -> None:
    """--log-level, the same on every service (not a config field: it is set before the config is built)."""
    env = os.environ if environ is None else environ
    p.add_argument(
        "--log-level",
        default=env.get(LOG_LEVEL_ENV) or "INFO",
        type=str.upper,
        choices=("DEBUG", "INFO", "WARNING", "ERROR"),
        help=f"env {LOG_LEVEL_ENV}; default: %(default)s",
    )
