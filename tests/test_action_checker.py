"""The action checker and the action plane: nothing out of range or forbidden leaves
the daemon; absolute values reach exactly the agents a parameter targets, until acked."""
from __future__ import annotations

import math

import pytest

from capes.common.params import ParameterSpec
from capes.common.protocol import Ack, Action, decode, encode
from interface_daemon.action_checker import ActionChecker
from interface_daemon.action_plane import ActionPlane
from interface_daemon.counters import Counters


def specs():
    return [ParameterSpec(min=10, max=200, step=10, default=50, nodes=["n1"], name="rate"),
            ParameterSpec(min=1, max=100, step=1, default=10, forbidden=[13], name="window")]


CURRENT = {"rate": 50.0, "window": 10.0}


@pytest.fixture
def checker():
    return ActionChecker(specs(), {"window": [66]})


def test_values_in_range_pass(checker):
    v = checker.check(1, {"window": 11}, CURRENT)
    assert v.ok and v.values == {"rate": 50.0, "window": 11.0}


@pytest.mark.parametrize("values,key", [
    ({"window": 0}, "range"), ({"window": 100.5}, "range"), ({"rate": 210}, "range"),
    ({"window": 13}, "forbidden"),          # from [parameters.window]
    ({"window": 66}, "forbidden"),          # from [daemon.forbidden]
    ({"window": math.nan}, "not_finite"), ({"window": math.inf}, "not_finite"),
    ({"stripe": 4}, "unknown"),
])
def test_bad_values_refuse_the_whole_action(checker, values, key):
    v = checker.check(1, {"rate": 60, **values}, CURRENT)
    assert not v.ok and v.key == key and v.reason
    assert v.values == CURRENT                  # nothing changes


@pytest.mark.parametrize("action", [-1, 33, 99, True, 1.0])
def test_action_index_must_exist(checker, action):
    # 2 parameters, moves of up to MAX_STEPS = 8 steps: actions 0..32 exist
    assert checker.check(action, {}, CURRENT).key == "action"


def test_a_multi_step_action_must_move_by_its_steps(checker):
    # action 5 = rate +2 steps, 8 = window −2 steps (capes.common.actions)
    step = lambda a, values, now=CURRENT: checker.check_step(  # noqa: E731
        a, checker.check(a, values, now), now)
    assert step(5, {"rate": 70}).values == {"rate": 70.0, "window": 10.0}
    assert step(5, {"rate": 60}).key == "step"            # one step, labelled two
    assert step(1, {"rate": 70}).key == "step"            # two steps, labelled one
    assert step(8, {"window": 8}).ok
    # each of the steps goes over forbidden values: 11 → 12 → (13 forbidden) 14
    assert step(7, {"window": 14}, {"rate": 50.0, "window": 11.0}).ok
    assert step(7, {"window": 13}, {"rate": 50.0, "window": 11.0}).key == "forbidden"


def test_forbidden_for_unknown_parameter_is_a_config_error():
    with pytest.raises(ValueError, match="stripe"):
        ActionChecker(specs(), {"stripe": [1]})


class Wire:
    def __init__(self):
        self.sent: list[tuple[bytes, Action]] = []
        self.up = True

    def __call__(self, identity: bytes, payload: bytes) -> bool:
        if self.up:
            self.sent.append((identity, decode(payload)))
        return self.up


@pytest.fixture
def plane():
    wire = Wire()
    counters = Counters()
    p = ActionPlane(specs(), ActionChecker(specs()), counters, wire, ack_timeout_s=1.0)
    p.handle(encode(Ack("n1", 0, {"rate": 50.0, "window": 10.0})), b"id1", now=0.0)
    p.handle(encode(Ack("n2", 0, {"window": 12.0})), b"id2", now=0.0)
    return p, wire, counters


def test_actions_go_to_the_nodes_a_parameter_targets(plane):
    p, wire, _ = plane
    verdict, seq, sent = p.submit(5, 3, {"rate": 60}, tuning=True)
    assert verdict.ok and sent == 1
    (ident, action), = wire.sent
    assert ident == b"id1" and action.seq == seq and action.tick == 5
    assert action.values == {"rate": 60.0, "window": p.current["window"]}
    wire.sent.clear()
    verdict, seq2, sent = p.submit(6, 1, {"window": 20}, tuning=True)
    assert sent == 2 and seq2 > seq
    assert {i: a.values for i, a in wire.sent} == {
        b"id1": {"rate": 60.0, "window": 20.0}, b"id2": {"window": 20.0}}


def test_refused_and_tuning_off_actions_send_nothing(plane):
    p, wire, counters = plane
    before = dict(p.current)
    assert not p.submit(1, 1, {"window": 13}, tuning=True)[0].ok
    assert not p.submit(2, 1, {"window": 500}, tuning=True)[0].ok
    assert not p.submit(3, 1, {"window": 20}, tuning=False)[0].ok
    assert wire.sent == [] and p.current == before
    assert counters.actions["refused_forbidden"] == 1 and counters.actions["refused_range"] == 1
    assert counters.actions["tuning_off"] == 1


def test_unacked_actions_are_resent_until_acked(plane):
    p, wire, counters = plane
    _, seq, _ = p.submit(1, 1, {"window": 20}, tuning=True)
    wire.sent.clear()
    assert p.resend_due(now=time_after(p, 0.5)) == 0
    p.handle(encode(Ack("n1", seq, {"rate": 50.0, "window": 20.0})), b"id1")
    assert p.resend_due(now=time_after(p, 1.5)) == 1          # n2 has not acked
    (ident, action), = wire.sent
    assert ident == b"id2" and action.seq == seq and action.values == {"window": 20.0}
    p.handle(encode(Ack("n2", seq, {"window": 20.0})), b"id2")
    assert p.resend_due(now=time_after(p, 5.0)) == 0
    assert counters.actions["acked"] == 2 and counters.actions["resent"] == 1


def test_a_reconnecting_agent_gets_the_current_values(plane):
    p, wire, _ = plane
    _, seq, _ = p.submit(1, 1, {"window": 20}, tuning=True)
    p.handle(encode(Ack("n2", seq, {"window": 20.0})), b"id2")
    wire.sent.clear()
    # the agent restarted, restored its default and said hello on a new connection
    p.handle(encode(Ack("n2", 0, {"window": 10.0})), b"id2-new")
    (ident, action), = wire.sent
    assert ident == b"id2-new" and action.values == {"window": 20.0} and action.seq > seq


def test_hello_values_are_adopted_until_the_engine_decides(plane):
    p, _, _ = plane
    assert p.current["window"] == 12.0                        # n2's hello came last
    p.handle(encode(Ack("n3", 0, {"window": 13.0})), b"id3")   # forbidden: ignored
    assert p.current["window"] == 12.0


def test_a_node_name_is_pinned_to_its_key():
    wire = Wire()
    p = ActionPlane(specs(), ActionChecker(specs()), Counters(), wire)
    assert p.handle(encode(Ack("n1", 0, {})), b"a", key="ctl") is None
    assert p.handle(encode(Ack("n1", 0, {})), b"b", key="intruder") == "auth"
    assert p.peers["n1"].identity == b"a"


def test_hostile_control_messages_are_dropped():
    p = ActionPlane(specs(), ActionChecker(specs()), Counters(), Wire())
    assert p.handle(b"\x01\x03garbage", b"x") == "decompress"
    assert p.handle(encode(Action(1, 1, {"window": 5.0})), b"x") == "type"
    assert p.peers == {}


def time_after(p: ActionPlane, seconds: float) -> float:
    return max(peer.sent_at for peer in p.peers.values()) + seconds


def test_per_node_rows_move_one_knob_each_by_at_most_max_steps():
    """Per-node knobs (<node>/<knob>, action ROWS): every node may move one of its own
    knobs at once; two knobs of one node, a jump, or a global parameter are refused."""
    from capes.common import actions
    specs = [ParameterSpec(min=1, max=100, step=1, default=10, name=f"{n}/{k}")
             for n in ("n1", "n2") for k in ("window", "rate")]
    checker = ActionChecker(specs)
    now = {s.name: 10.0 for s in specs}

    def verdict(**moves):
        values = {**now, **{k.replace("__", "/"): v for k, v in moves.items()}}
        return checker.check_step(actions.ROWS, checker.check(actions.ROWS, values, now), now)

    ok = verdict(n1__window=12.0, n2__rate=9.0)
    assert ok.ok and ok.values["n1/window"] == 12.0 and ok.values["n2/rate"] == 9.0
    assert verdict(n1__window=11.0, n1__rate=11.0).key == "step"       # two in one row
    assert verdict(n2__window=10.0 + actions.MAX_STEPS + 1).key == "step"   # a jump
    glob = ActionChecker([ParameterSpec(min=1, max=100, step=1, default=10, name="w")])
    v = glob.check_step(actions.ROWS, glob.check(actions.ROWS, {"w": 11.0}, {"w": 10.0}),
                        {"w": 10.0})
    assert v.key == "step" and "per-node" in v.reason
