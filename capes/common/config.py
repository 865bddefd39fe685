"""Typed configuration: TOML tables -> nested dataclasses, validated on load.

Every component's settings are a dataclass. ``build(cls, table)`` turns a TOML table
into an instance, checking types and rejecting unknown keys; each dataclass may add a
``validate()`` method that raises ``ValueError`` for values out of range. Every problem
becomes one ``ConfigError`` that names the file, the dotted key and what is wrong.

``--set dotted.key=value`` overrides are parsed as TOML values (falling back to a bare
string) and merged into the raw table before it is built, so they get the same checks.

A ``[vars]`` table names values said once and used in many places: every ``{name}`` in
a string of the file becomes ``vars.name`` (``/sys/block/{device}/queue/read_ahead_kb``
with ``vars.device = "sda"``), after the overrides, so ``--set vars.device=nvme0n1``
retargets the whole file. Placeholders that are not in ``[vars]`` (``{node}``) are
left for their component.

Every number is checked for sanity before any ``validate()`` sees it: a float must be
finite (NaN never; ±inf only where the field says ``metadata={"allow_inf": True}``), an
integer must fit in 64 bits (TOML's range), and a string may not hold a NUL character.
"""
from __future__ import annotations

import dataclasses
import math
import os
import re
import stat
import tomllib
import types
import typing
from pathlib import Path
from typing import Any, Iterable, TypeVar

T = TypeVar("T")

INT_LIMIT = 1 << 63          # TOML integers are 64-bit; Python's tomllib does not check
ALLOW_INF = "allow_inf"      # dataclass field metadata: this float may be ±inf


class ConfigError(ValueError):
    """A configuration value is missing, unknown, of the wrong type or out of range."""

    def __init__(self, source: str, key: str, problem: str):
        self.source, self.key, self.problem = source, key, problem
        where = f"{source}: {key}" if key else source
        super().__init__(f"{where}: {problem}")


def parse_override(text: str) -> tuple[list[str], Any]:
    """Parse ``a.b.c=value``; the value is read as TOML (``3``, ``0.1``, ``true``,
    ``[1, 2]``, ``"x"``) and, failing that, kept as a bare string."""
    if "=" not in text:
        raise ConfigError("--set", text, "expected dotted.key=value")
    key, raw = text.split("=", 1)
    key = key.strip()
    if not key or any(not part for part in key.split(".")):
        raise ConfigError("--set", key, "empty key")
    if key.count(".") >= MAX_DEPTH:
        raise ConfigError("--set", key[:60] + "...", f"nested more than {MAX_DEPTH} levels deep")
    try:
        value = parse_toml(f"v = {raw}", f"--set {key}")["v"]
    except ConfigError as exc:
        if "nested" in exc.problem:
            raise ConfigError(f"--set {key}", "", exc.problem) from None
        value = raw
    return key.split("."), value


def apply_overrides(table: dict, overrides: Iterable[str]) -> dict:
    """Return a copy of ``table`` with every ``--set`` override merged in."""
    merged = _deepcopy(table)
    for text in overrides:
        path, value = parse_override(text)
        node = merged
        for part in path[:-1]:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ConfigError("--set", ".".join(path), f"{part!r} is not a table")
            node = child
        node[path[-1]] = value
    check_depth(merged, "--set")
    return merged


def copy_tree(value: Any) -> Any:
    """A copy of a TOML value's tables and lists (their leaves are immutable)."""
    if isinstance(value, dict):
        return {k: copy_tree(v) for k, v in value.items()}
    if isinstance(value, list):
        return [copy_tree(v) for v in value]
    return value


def _deepcopy(table: dict) -> dict:
    return {k: _deepcopy(v) if isinstance(v, dict) else v for k, v in table.items()}


MAX_CONFIG_BYTES = 4 << 20   # a deployment file is kilobytes; /dev/zero is not a config
MAX_DEPTH = 32               # tables and lists inside each other; ours nest 5 deep
MAX_EXPANDED_BYTES = 16 << 20   # text the [vars] may put into a config, in all


def read_toml(path: str | Path) -> dict:
    """The TOML table of ``path``: a regular file (a FIFO, a device, /dev/zero are refused
    at once, never read or waited on) of at most ``MAX_CONFIG_BYTES``, nested at most
    ``MAX_DEPTH`` deep; every problem is one ``ConfigError``."""
    path = Path(path)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise ConfigError(str(path), "", "file not found") from None
    except PermissionError:
        raise ConfigError(str(path), "", "permission denied") from None
    except OSError as exc:
        raise ConfigError(str(path), "", f"cannot read: {exc.strerror or exc}") from None
    try:
        mode = os.fstat(fd).st_mode
        if stat.S_ISDIR(mode):
            raise ConfigError(str(path), "", "is a directory, not a TOML file")
        if not stat.S_ISREG(mode):
            raise ConfigError(str(path), "", f"not a regular file (a {_file_kind(mode)}); "
                                             f"give a TOML file")
        with os.fdopen(fd, "rb", closefd=False) as fh:
            raw = fh.read(MAX_CONFIG_BYTES + 1)
    except OSError as exc:
        raise ConfigError(str(path), "", f"cannot read: {exc.strerror or exc}") from None
    finally:
        os.close(fd)
    if len(raw) > MAX_CONFIG_BYTES:
        raise ConfigError(str(path), "", f"larger than {MAX_CONFIG_BYTES >> 20} MiB: not a "
                                         f"config file")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(str(path), "", f"not valid TOML: not UTF-8 text (byte "
                                         f"{exc.object[exc.start]:#04x} at offset "
                                         f"{exc.start})") from None
    return parse_toml(text, str(path))


def parse_toml(text: str, source: str, key: str = "") -> dict:
    """``tomllib.loads`` with the nesting bounded: tables or lists deeper than
    ``MAX_DEPTH`` are a ``ConfigError`` (tomllib itself recurses once per level)."""
    if _bracket_depth(text) > 4 * MAX_DEPTH:          # refuse before tomllib recurses
        raise ConfigError(source, key, f"nested more than {MAX_DEPTH} levels deep")
    try:
        table = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(source, key, f"not valid TOML: {exc}") from None
    except RecursionError:
        raise ConfigError(source, key, f"nested more than {MAX_DEPTH} levels deep") from None
    check_depth(table, source, key)
    return table


def _bracket_depth(text: str) -> int:
    """The deepest run of opening brackets and braces, ignoring what closes them: a cheap
    upper bound that cannot be fooled into recursion (strings are counted too)."""
    depth = best = 0
    for match in _BRACKETS.finditer(text):          # the brackets only, not every char
        if match.group() in "[{":
            depth += 1
            best = max(best, depth)
        else:
            depth = max(0, depth - 1)
    return best


_BRACKETS = re.compile(r"[\[\]{}]")


def check_depth(value: Any, source: str, key: str = "") -> None:
    """A ``ConfigError`` when ``value`` nests tables/lists more than ``MAX_DEPTH`` deep
    (iterative: a hostile value cannot overflow the stack here)."""
    stack = [(value, 0)]
    while stack:
        v, depth = stack.pop()
        if depth > MAX_DEPTH:
            raise ConfigError(source, key, f"nested more than {MAX_DEPTH} levels deep")
        if isinstance(v, dict):
            stack.extend((x, depth + 1) for x in v.values())
        elif isinstance(v, list):
            stack.extend((x, depth + 1) for x in v)


def _file_kind(mode: int) -> str:
    return ("FIFO" if stat.S_ISFIFO(mode) else "character device" if stat.S_ISCHR(mode)
            else "block device" if stat.S_ISBLK(mode) else "socket" if stat.S_ISSOCK(mode)
            else "special file")


def build(cls: type[T], table: dict, source: str = "<config>", prefix: str = "") -> T:
    """Build dataclass ``cls`` from ``table``; missing keys take the field defaults."""
    if not isinstance(table, dict):
        raise ConfigError(source, prefix, f"expected a table, got {_typename(table)}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(set(table) - set(fields))
    if unknown:
        key = _join(prefix, unknown[0])
        raise ConfigError(source, key, f"unknown key ({_suggest(unknown[0], fields)})")
    kwargs = {}
    for name, value in table.items():
        f = fields[name]
        if isinstance(value, dict) and f.default_factory is not dataclasses.MISSING:
            default = f.default_factory()
            if dataclasses.is_dataclass(default):   # a partial table keeps the other defaults
                value = {**to_table(default), **value}
        kwargs[name] = _coerce(hints[name], value, source, _join(prefix, name),
                               allow_inf=bool(f.metadata.get(ALLOW_INF)))
    missing = [n for n, f in fields.items() if n not in kwargs
               and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    if missing:
        raise ConfigError(source, _join(prefix, missing[0]), "required key is missing")
    obj = cls(**kwargs)
    check(obj, source, prefix)
    return obj


def _suggest(name: str, known) -> str:
    """What to say of an unknown key: the close known ones (a typo), or every known key
    where the table is small; never a wall of ~70 names."""
    import difflib
    close = difflib.get_close_matches(name, sorted(known), n=3, cutoff=0.8)
    if close:
        return f"did you mean {' or '.join(close)}?"
    if len(known) <= 15:
        return f"known: {', '.join(sorted(known))}"
    return f"none of this table's {len(known)} keys is close to it"


def check(obj: Any, source: str = "<config>", prefix: str = "") -> None:
    """Run ``validate()`` on ``obj`` and on every nested dataclass, naming the key."""
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value):
            check(value, source, _join(prefix, f.name))
        elif isinstance(value, dict):
            for k, v in value.items():
                if dataclasses.is_dataclass(v):
                    check(v, source, _join(prefix, f"{f.name}.{k}"))
    validate = getattr(obj, "validate", None)
    if validate is not None:
        try:
            validate()
        except ConfigError:
            raise
        except ValueError as exc:
            key, _, problem = str(exc).partition(": ")
            if not problem:
                key, problem = "", key
            raise ConfigError(source, _join(prefix, key) if key else prefix, problem) from None


def to_table(obj: Any) -> Any:
    """Dataclass -> plain TOML-ready dict (the inverse of ``build``)."""
    if dataclasses.is_dataclass(obj):
        return {f.name: to_table(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, dict):
        return {k: to_table(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [to_table(v) for v in obj]
    return obj


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _typename(value: Any) -> str:
    return {dict: "a table", list: "a list", str: "a string", bool: "a boolean",
            int: "an integer", float: "a number"}.get(type(value), type(value).__name__)


def _coerce(hint: Any, value: Any, source: str, key: str, allow_inf: bool = False) -> Any:
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(arg, value, source, key, allow_inf)
            except ConfigError as exc:
                errors.append(exc.problem)
        choices = _choices(args)
        if choices:                    # e.g. bool | Literal["auto"]: name the values
            raise ConfigError(source, key, f"must be {choices} (got {value!r})")
        raise ConfigError(source, key, " or ".join(errors))
    if origin is typing.Literal:
        if value not in args:
            raise ConfigError(source, key, f"must be one of {', '.join(map(repr, args))} "
                                           f"(got {value!r})")
        return value
    if dataclasses.is_dataclass(hint):
        return build(hint, value, source, key)
    if origin in (list, tuple):
        if not isinstance(value, list):
            raise ConfigError(source, key, f"expected a list, got {_typename(value)}")
        item = args[0] if args else Any
        items = [_coerce(item, v, source, f"{key}[{i}]", allow_inf)
                 for i, v in enumerate(value)]
        return tuple(items) if origin is tuple else items
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(source, key, f"expected a table, got {_typename(value)}")
        vt = args[1] if len(args) == 2 else Any
        return {k: _coerce(vt, v, source, _join(key, k), allow_inf) for k, v in value.items()}
    if hint is Any:             # a plug-in's raw option table: checked again when built
        _check_raw(value, source, key)
        return value
    if hint is bool:
        if not isinstance(value, bool):
            raise ConfigError(source, key, f"expected true or false, got {_typename(value)}")
        return value
    if hint is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(source, key, f"expected a number, got {_typename(value)}")
        if isinstance(value, int) and abs(value) >= INT_LIMIT:
            raise ConfigError(source, key, f"number out of range (got {value})")
        value = float(value)
        if math.isnan(value) or (math.isinf(value) and not allow_inf):
            raise ConfigError(source, key, f"expected a finite number, got {value}")
        return value
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(source, key, f"expected an integer, got {_typename(value)}")
        if abs(value) >= INT_LIMIT:
            raise ConfigError(source, key, f"integer out of range (got {value})")
        return value
    if hint is str:
        if not isinstance(value, str):
            raise ConfigError(source, key, f"expected a string, got {_typename(value)}")
        if "\0" in value:
            raise ConfigError(source, key, "must not contain a NUL character")
        return value
    raise ConfigError(source, key, f"unsupported type {hint!r}")


def _choices(args) -> str | None:
    """The values a union of booleans and literals allows, in words (None for other
    unions): ``bool | Literal["auto"]`` -> "true, false or 'auto'"."""
    values = []
    for arg in args:
        if arg is bool:
            values += ["true", "false"]
        elif typing.get_origin(arg) is typing.Literal:
            values += [repr(v) for v in typing.get_args(arg)]
        elif arg is not type(None):
            return None
    return ", ".join(values[:-1]) + " or " + values[-1] if len(values) > 1 else None


def _check_raw(value: Any, source: str, key: str) -> None:
    """The number rules for an untyped value (and everything inside it)."""
    if isinstance(value, bool):
        return
    if isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(source, key, f"expected a finite number, got {value}")
    if isinstance(value, int) and abs(value) >= INT_LIMIT:
        raise ConfigError(source, key, f"integer out of range (got {value})")
    if isinstance(value, str) and "\0" in value:
        raise ConfigError(source, key, "must not contain a NUL character")
    if isinstance(value, list):
        for i, v in enumerate(value):
            _check_raw(v, source, f"{key}[{i}]")
    elif isinstance(value, dict):
        for k, v in value.items():
            _check_raw(v, source, _join(key, k))


def drop_key(table: dict, key: str) -> bool:
    """Take the dotted ``key`` (``a.b``, ``a[0].b``) out of ``table``; False when it is
    not there or names a list item (removing one would renumber the others)."""
    parts = [p for p in key.replace("[", ".[").split(".") if p]
    node: Any = table
    for part in parts[:-1]:
        if part.startswith("[") and part.endswith("]") and part[1:-1].isdigit():
            i = int(part[1:-1])
            if not isinstance(node, list) or i >= len(node):
                return False
            node = node[i]
        elif isinstance(node, dict) and part in node:
            node = node[part]
        else:
            return False
    last = parts[-1] if parts else ""
    if not isinstance(node, dict) or last not in node:
        return False
    del node[last]
    return True


VARS = "vars"


def expand_vars(table: dict, source: str = "<config>") -> dict:
    """A copy of ``table`` without its ``[vars]`` table, each ``{name}`` of a var in its
    strings (values and table keys) replaced by the var's value."""
    if VARS not in table:
        return table
    names = table[VARS]
    if not isinstance(names, dict):
        raise ConfigError(source, VARS, f"expected a table, got {_typename(names)}")
    for name, value in names.items():
        if not isinstance(value, (str, int, float)) or isinstance(value, bool):
            raise ConfigError(source, _join(VARS, name),
                              f"expected a string or a number, got {_typename(value)}")
    subs = {"{" + k + "}": str(v) for k, v in names.items()}
    if not subs:
        return {k: v for k, v in table.items() if k != VARS}
    # one pass: a var's value is put in as it is, never expanded again, so that vars
    # naming each other cannot grow a string exponentially ({a} -> 12 x {b} -> ...)
    pattern = re.compile("|".join(re.escape(p) for p in sorted(subs, key=len, reverse=True)))
    budget = [MAX_EXPANDED_BYTES]

    def put(match: re.Match) -> str:
        text = subs[match.group(0)]
        budget[0] -= len(text)
        if budget[0] < 0:
            raise ConfigError(source, VARS, f"expanding the vars makes the config larger "
                                            f"than {MAX_EXPANDED_BYTES >> 20} MiB")
        return text

    def expand(value: Any) -> Any:
        if isinstance(value, str):
            return pattern.sub(put, value)
        if isinstance(value, dict):
            return {expand(k): expand(v) for k, v in value.items()}
        if isinstance(value, list):
            return [expand(v) for v in value]
        return value

    return {k: expand(v) for k, v in table.items() if k != VARS}


def load_table(path: str | Path | None, overrides: Iterable[str] = ()) -> tuple[dict, str]:
    """The raw table of ``path`` (empty when None) with overrides merged and ``[vars]``
    expanded, and its source name for error messages."""
    table = read_toml(path) if path else {}
    source = str(path) if path else "<defaults>"
    overrides = list(overrides)
    if overrides:
        table = apply_overrides(table, overrides)
        source = f"{source} (with --set)"
    return expand_vars(table, source), source


def load(cls: type[T], path: str | Path | None, overrides: Iterable[str] = ()) -> T:
    """Load ``cls`` from ``path`` (or pure defaults when None) plus ``--set`` overrides."""
    table, source = load_table(path, overrides)
    return build(cls, table, source)


# --------------------------------------------------------------------- a TOML writer
def toml_value(v: Any) -> str:
    """One value as TOML (tables inline), so that ``tomllib.loads`` gives it back."""
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        if math.isnan(v):
            return "nan"
        if math.isinf(v):
            return "inf" if v > 0 else "-inf"
        return repr(v)
    if isinstance(v, str):
        return '"' + "".join(f"\\u{ord(c):04x}" if c in '"\\' or ord(c) < 0x20 or ord(c) == 0x7F
                             else c for c in v) + '"'
    if isinstance(v, list):
        return "[" + ", ".join(toml_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{toml_value(str(k))} = {toml_value(x)}"
                               for k, x in v.items()) + "}"
    raise TypeError(f"no TOML form for {type(v).__name__}")


def as_overrides(table: str, values: dict) -> list[str]:
    """The ``--set`` texts that put ``values`` under ``table`` (``parse_override``'s
    inverse): a dict of settings as an experiment arm's overrides."""
    return [f"{table}.{k}={toml_value(v)}" for k, v in values.items()]


def dump_toml(table: dict) -> str:
    """A whole document, one top-level key a line (what a generated config needs: the
    demo's per-node deployment, the tests' fuzzed files)."""
    return "".join(f"{toml_value(str(k))} = {toml_value(v)}\n" for k, v in table.items())
