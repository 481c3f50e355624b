"""The gossip timeline on the simulated clock: per edge, no global barrier, by hand."""

import pytest

from fededge.algorithms.gossip import GossipError, GossipTimeline, GossipWork
from fededge.netem.clock import ClientLink, SimClock
from fededge.netem.profiles import Direction, LinkProfile

# 1 MB/s up with 100 ms, 2 MB/s down with 50 ms; node 2 sits on an ideal link.
LINK = LinkProfile(name="t", up=Direction(rate_bps=8e6, delay_s=0.1),
                   down=Direction(rate_bps=16e6, delay_s=0.05), source="test")
PATH = [(0, 1), (1, 0), (1, 2), (2, 1)]  # 0 - 1 - 2, each edge both ways


def _timeline() -> GossipTimeline:
    return GossipTimeline(SimClock([ClientLink(LINK), ClientLink(LINK), ClientLink(None)]))


def test_a_path_of_three_by_hand():
    tl = _timeline()
    # Round 1: the 1 MB initial model comes down first; node 2 computes 3 s, the others 1 s.
    end1 = tl.run_round(1, [GossipWork(0, 1.0, 500_000, 1_000_000), GossipWork(1, 1.0, 500_000, 1_000_000),
                            GossipWork(2, 3.0, 500_000, 1_000_000)], PATH)
    # Nodes 0 and 1: down 0.5 s + 0.05, compute to 1.55, up 0.5 s + 0.1 -> at the relay 2.15.
    assert tl.at_relay[(1, 0)] == pytest.approx(2.15) and tl.at_relay[(1, 1)] == pytest.approx(2.15)
    assert tl.at_relay[(1, 2)] == pytest.approx(3.0)
    # Node 0 hears node 1: 0.25 s down + 0.05 -> 2.45. Node 1 hears 0 (2.45) then 2, which
    # reaches the relay at 3.0 and its downlink at 3.25 + 0.05 = 3.3. Node 2 hears 1 at 2.15
    # (ideal link) but computes until 3.0.
    assert tl.ready == pytest.approx({0: 2.45, 1: 3.3, 2: 3.0})
    assert end1 == pytest.approx(3.3)

    end2 = tl.run_round(2, [GossipWork(c, s, 500_000) for c, s in ((0, 1.0), (1, 1.0), (2, 3.0))], PATH)
    # Node 0 starts at 2.45, not at the slow node's 3.3: no global barrier.
    assert tl.started[(2, 0)] == pytest.approx(2.45) and tl.waited[(2, 0)] == pytest.approx(0.9)
    assert tl.started[(2, 1)] == pytest.approx(3.3) and tl.started[(2, 2)] == pytest.approx(3.0)
    # 0 at relay 3.45 + 0.6 = 4.05; 1 at 4.3 + 0.6 = 4.9; 2 at 6.0.
    # Node 0 hears 1 at 4.9 + 0.3 = 5.2; node 1 hears 0 at 4.35 and 2 at 6.3; node 2 is busy to 6.0.
    assert tl.ready == pytest.approx({0: 5.2, 1: 6.3, 2: 6.0})
    assert end2 == pytest.approx(6.3)


def test_a_slow_node_delays_only_its_neighbours():
    ring4 = [(a, b) for a in range(4) for b in ((a + 1) % 4, (a - 1) % 4)]
    tl = GossipTimeline(SimClock([ClientLink(None)] * 4))
    for t in (1, 2, 3):
        tl.run_round(t, [GossipWork(c, 5.0 if c == 0 else 1.0, 10) for c in range(4)], ring4)
    # Ideal links: node 2 (opposite the slow node 0) is held back only through 1 and 3,
    # one hop per round; the slow node's neighbours wait for it from round 2 on.
    assert tl.started[(2, 2)] == pytest.approx(1.0)
    assert tl.started[(2, 1)] == pytest.approx(5.0) and tl.started[(2, 3)] == pytest.approx(5.0)
    assert tl.started[(3, 2)] == pytest.approx(6.0)
    assert tl.end[3] == pytest.approx(15.0)


def test_an_edge_from_a_node_that_sent_nothing_is_refused():
    with pytest.raises(GossipError, match="an edge from node 1, which sent no message"):
        _timeline().run_round(1, [GossipWork(0, 1.0, 10)], [(1, 0)])
