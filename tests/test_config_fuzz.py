"""Property: whatever TOML value lands on whatever key of the deployment config, loading
it gives one clean ``ConfigError`` (file, key, problem) or a valid ``Settings`` whose
numbers are all finite (issue 12). Never another exception, never NaN or inf accepted.

Key paths come from walking the ``Settings`` dataclasses, so a new field is fuzzed the
day it is added. The values: integers (huge ones too), floats (NaN, ±inf, -0.0,
subnormals, 1e308), strings (empty, non-ASCII, control characters), booleans, lists and
nested tables; plus unknown keys anywhere, random ``--set`` text and random bytes as
the file."""
from __future__ import annotations

import dataclasses
import math
import tomllib
import typing
from pathlib import Path

from hypothesis import HealthCheck, example, given, settings, strategies as st

from capes.common import config as cfgmod
from capes.common.config import ConfigError, dump_toml as toml_document, toml_value
from capes.settings import Settings, load_settings

BASE_FILE = Path(__file__).resolve().parent.parent / "configs" / "simulator.toml"
BASE = tomllib.loads(BASE_FILE.read_text())
FUZZ = settings(max_examples=250, deadline=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture,
                                       HealthCheck.too_slow])


# --------------------------------------------------------------------- key paths
def key_paths(cls, prefix: tuple = (), depth: int = 0) -> list[tuple]:
    """Every settable key under dataclass ``cls``: a path of table keys. A dict of
    dataclasses (``parameters``, ``control.appliers``) is entered under an existing and
    a new name; a list of dataclasses (``game.phases``) is a leaf (its value a list)."""
    out = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        path, hint = prefix + (f.name,), hints[f.name]
        out.append(path)
        if depth > 4:
            continue
        origin, args = typing.get_origin(hint), typing.get_args(hint)
        if dataclasses.is_dataclass(hint):
            out += key_paths(hint, path, depth + 1)
        elif origin is dict and len(args) == 2 and dataclasses.is_dataclass(args[1]):
            for name in ("window", "fresh_name"):
                out.append(path + (name,))
                out += key_paths(args[1], path + (name,), depth + 1)
    return out


PATHS = key_paths(Settings)


def test_the_walk_reaches_every_section():
    dotted = {".".join(p) for p in PATHS}
    for key in ("tick_seconds", "daemon.commit_every_s", "daemon.forbidden",
                "control.restore_after_s", "parameters.window.step", "engine.gamma",
                "reward.options", "game.window.max", "game.phases", "monitor.collectors",
                "control.appliers.window.options", "keys.dir"):
        assert key in dotted, key
    assert len(PATHS) > 100


# --------------------------------------------------------------------- values
floats = st.one_of(
    st.sampled_from([math.nan, math.inf, -math.inf, -0.0, 0.0, 5e-324, 1e308, -1e308,
                     1e-300, 1e-17, 1e-9, 0.5, 0.999999999, 1.0, 2.0, 1e9, 1e16]),
    st.floats(allow_nan=True, allow_infinity=True))
ints = st.one_of(
    st.sampled_from([0, 1, -1, 2, 10, 2**31, 2**53 + 1, 2**63 - 1, -2**63, 2**63, 10**30,
                     -10**30]),
    st.integers())
strings = st.one_of(
    st.sampled_from(["", " ", "window", "throughput", "diff", "diff_avg", "diff_ewma",
                     "throughput_fairness", "file", "simulator", "default", "paper", "huber",
                     "\x00", "é", "日本", "/", "/tmp", "..", "nan", "inf", "1e400",
                     "tcp://127.0.0.1:0", "x" * 300]),
    st.text(max_size=20))
scalars = st.one_of(floats, ints, strings, st.booleans())
keys = st.one_of(st.sampled_from(["window", "rate_limit", "min", "max", "step", "default",
                                  "name", "options", "at_tick", "noise", "weight", "alpha",
                                  "path", "dir", ""]),
                 st.text(min_size=0, max_size=8))
values = st.recursive(
    scalars,
    lambda inner: st.one_of(st.lists(inner, max_size=4),
                            st.dictionaries(keys, inner, max_size=4)),
    max_leaves=8)


def put(table: dict, path: tuple, value) -> dict:
    """A copy of ``table`` with ``value`` at ``path`` (tables created as needed; a
    non-table in the way is replaced by one)."""
    table = cfgmod._deepcopy(table)
    node = table
    for part in path[:-1]:
        child = node.get(part)
        if not isinstance(child, dict):
            child = node[part] = {}
        node = child
    node[path[-1]] = value
    return table


# --------------------------------------------------------------------- the property
def check_settings(obj, path: str = "", allow_inf: bool = False) -> None:
    """Every number in a loaded ``Settings`` is finite (inf only where a field allows
    it) and every integer fits in 64 bits."""
    if dataclasses.is_dataclass(obj):
        for f in dataclasses.fields(obj):
            check_settings(getattr(obj, f.name), f"{path}.{f.name}",
                           bool(f.metadata.get("allow_inf")))
    elif isinstance(obj, dict):
        for k, v in obj.items():
            check_settings(v, f"{path}.{k}", allow_inf)
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            check_settings(v, f"{path}[{i}]", allow_inf)
    elif isinstance(obj, bool):
        pass
    elif isinstance(obj, float):
        assert not math.isnan(obj), f"{path} is NaN"
        assert allow_inf or math.isfinite(obj), f"{path} is {obj}"
    elif isinstance(obj, int):
        assert -2**63 <= obj < 2**63, f"{path} = {obj} does not fit in 64 bits"


def load_or_refuse(path: Path, overrides=()) -> Settings | None:
    try:
        s = load_settings(path, overrides)
    except ConfigError as exc:
        msg = str(exc)
        assert msg and "\n" not in exc.problem.strip(), msg       # one line
        assert exc.source, msg
        return None
    assert isinstance(s, Settings)
    check_settings(s)
    return s


def test_the_base_config_is_valid(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text(toml_document(BASE))
    assert tomllib.loads(path.read_text()) == BASE          # the writer round-trips
    assert load_or_refuse(path) is not None


@FUZZ
@given(changes=st.lists(st.tuples(st.sampled_from(PATHS), values), min_size=1, max_size=3))
def test_random_values_at_every_key_give_a_clean_error_or_a_valid_config(tmp_path, changes):
    table = BASE
    for path, value in changes:
        table = put(table, path, value)
    f = tmp_path / "fuzz.toml"
    f.write_text(toml_document(table), encoding="utf-8")
    load_or_refuse(f)


def plugin_tables():
    """``[reward]`` tables naming a registered objective and reward type, with option
    tables made of those plug-ins' own option names (random values)."""
    from drl_engine.rewards import OBJECTIVES, REWARD_TYPES

    def options_of(registry, name):
        opts = getattr(registry.get_plugin(name), "Options", None)
        names = [f.name for f in dataclasses.fields(opts)] if opts else []
        return st.dictionaries(st.sampled_from(names) if names else keys,
                               st.one_of(floats, ints, values), max_size=2)

    def table(obj, typ):
        return st.fixed_dictionaries({
            "objective": st.just(obj), "type": st.just(typ),
            "objective_options": options_of(OBJECTIVES, obj),
            "options": options_of(REWARD_TYPES, typ)})
    return st.tuples(st.sampled_from(OBJECTIVES.names()),
                     st.sampled_from(REWARD_TYPES.names())).flatmap(lambda t: table(*t))


@FUZZ
@given(reward=plugin_tables())
@example(reward={"objective": "throughput", "type": "diff_ewma", "objective_options": {},
                 "options": {"weight": 1e-17}})          # 1 − w == 1: lookback ÷ 0
@example(reward={"objective": "throughput", "type": "diff_avg", "objective_options": {},
                 "options": {"window": 2**62}})
def test_random_plugin_options_give_a_clean_error_or_a_valid_config(tmp_path, reward):
    f = tmp_path / "fuzz.toml"
    f.write_text(toml_document({**BASE, "reward": {**BASE["reward"], **reward}}),
                 encoding="utf-8")
    load_or_refuse(f)


@FUZZ
@given(where=st.sampled_from([()] + [p for p in PATHS]), name=keys, value=values)
def test_unknown_keys_anywhere_are_refused_or_harmless(tmp_path, where, name, value):
    table = put(BASE, where + (name,), value) if where else {**BASE, name: value}
    f = tmp_path / "fuzz.toml"
    f.write_text(toml_document(table), encoding="utf-8")
    load_or_refuse(f)


@settings(max_examples=150, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(key=st.one_of(st.sampled_from([".".join(p) for p in PATHS]), st.text(max_size=12)),
       raw=st.one_of(values.map(toml_value), st.text(max_size=20)))
def test_random_set_overrides_give_a_clean_error_or_a_valid_config(tmp_path, key, raw):
    f = tmp_path / "base.toml"
    if not f.exists():
        f.write_text(BASE_FILE.read_text())
    load_or_refuse(f, [f"{key}={raw}"])


@settings(max_examples=100, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.one_of(st.binary(max_size=64),
                      st.binary(max_size=16).map(lambda b: b"tick_seconds = 1\n# " + b)))
def test_random_bytes_as_the_file_give_a_clean_error_or_a_valid_config(tmp_path, data):
    f = tmp_path / "bytes.toml"
    f.write_bytes(data)
    load_or_refuse(f)
