"""RunClock: one run's links, where a node sits on them, and what its work costs."""

import json

import pytest

from fededge.netem.profiles import ProfileError
from fededge.netem.runclock import RunClock


def test_a_reported_partition_wins_else_the_node_ids_order_places_a_node():
    rc = RunClock()
    assert rc.place(77, None) is None  # nothing known: not on the clock
    rc.know_nodes([900, 12, 450])
    assert [rc.place(n, None) for n in (12, 450, 900)] == [0, 1, 2]
    assert rc.place(900, 5) == 5 and rc.place(3, None) is None
    assert rc.num_clients(None) == 3 and rc.num_clients(10) == 10


@pytest.mark.parametrize("reported, steps, measured, step_s, fixed, want", [
    (1.25, 4, 9.0, 0.0, None, 1.25),  # reported compute-s
    (1.25, 4, 9.0, 0.5, None, 2.0),  # sim-step-s per reported step replaces it
    (None, None, 9.0, 0.5, None, 9.0),  # no steps: sim-step-s cannot apply; measured
    (None, None, 9.0, 0.0, 0.75, 0.75),  # the fixed compute_s beats the measurement
    (None, None, None, 0.0, None, 0.0),  # nothing at all
])
def test_compute_rule(reported, steps, measured, step_s, fixed, want):
    rc = RunClock(sim_step_s=step_s, compute_s=fixed)
    assert rc.compute_s(reported, steps, measured) == want


def test_built_once_for_the_first_size_asked_and_recorded(tmp_path):
    rc = RunClock(netem="wifi:0.5,3g:0.5", compute_speed="lognormal:0.5", seed=4, run_dir=tmp_path)
    clock = rc.build(6)
    assert rc.build(100) is clock and len(clock.clients) == 6
    rec = json.loads((tmp_path / "netem.json").read_text())
    assert [c["profile"] for c in rec["clients"]] == [c.profile.name for c in clock.clients]
    assert {c["profile"] for c in rec["clients"]} == {"wifi", "3g"}
    # The same settings and seed give the same links.
    again = RunClock(netem="wifi:0.5,3g:0.5", compute_speed="lognormal:0.5", seed=4).build(6)
    assert [(c.profile.name, c.speed) for c in again.clients] == [(c.profile.name, c.speed) for c in clock.clients]


def test_bad_settings_are_refused_when_made_or_checked():
    with pytest.raises(ProfileError, match="must be 'profile:fraction'"):
        RunClock(netem="wifi:x")
    with pytest.raises(ValueError, match="sim_step_s"):
        RunClock(sim_step_s=float("inf"))
    with pytest.raises(ProfileError):
        RunClock(netem="no-such-profile").check(3)


def test_every_devices_message_overhead_is_charged_unscaled():
    clock = RunClock(compute_speed="2.0", message_overhead_s=0.25).build(2)
    assert clock.compute(1, 1.0, at=3.0) == 3.0 + 0.25 + 0.5
    with pytest.raises(ValueError, match="message_overhead_s"):
        RunClock(message_overhead_s=-1.0)
