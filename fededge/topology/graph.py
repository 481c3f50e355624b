"""Communication graphs for gossip: the built-in families, custom graphs, and their checks.

Every function here returns an **adjacency matrix**: an ``(n, n)`` numpy bool array,
``A[i, j]`` True when node ``i`` hears node ``j``. For the undirected graphs (all but the
per-round graphs of the one-peer exponential graph) ``A`` is symmetric. The diagonal is
False: self-weights are set by the mixing rule (:mod:`fededge.topology.mixing`), not by
the graph. ``A[i, j]`` has the orientation of a mixing matrix's ``W[i, j]`` (the weight
node ``i`` gives to ``j``'s model), so a directed round graph and its weights read alike.

Nodes are ``0 .. n-1``. :func:`check_adjacency` is the one gate a graph passes before a
mixing matrix is built from it: square, 0/1 entries, no self-loops, symmetric, every node
with a neighbour, connected. It raises :class:`TopologyError` naming the problem and
what to change.

Pure numpy (networkx only if you pass a networkx graph, imported then): no Flower.

Examples
--------
>>> from fededge.topology.graph import ring, degrees
>>> degrees(ring(5)).tolist()
[2, 2, 2, 2, 2]
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np

__all__ = [
    "TopologyError",
    "check_adjacency",
    "check_directed",
    "complete",
    "degrees",
    "edges",
    "erdos_renyi",
    "exponential",
    "exponential_distances",
    "from_edges",
    "from_networkx",
    "hypercube",
    "is_connected",
    "k_regular",
    "one_peer_exponential",
    "read_edge_list",
    "ring",
    "star",
    "torus",
    "torus_shape",
]


class TopologyError(ValueError):
    """A graph or mixing matrix cannot be used for gossip.

    Raised for a disconnected graph, a node with no neighbours, a negative or non-0/1
    entry, an asymmetric matrix where a symmetric one is needed, a node count the family
    cannot form (a hypercube of 33 nodes), a malformed edge-list file, or an unknown
    topology name. The message names the problem and what to change.
    """


# ------------------------------------------------------------------ checks and queries
def _need_n(n: Any, *, family: str, minimum: int = 2) -> int:
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)):
        raise TopologyError(f"{family}: n must be an integer number of nodes, got {n!r}")
    if n < minimum:
        raise TopologyError(f"{family}: n must be >= {minimum} nodes, got {n}; a gossip node needs "
                            f"someone to talk to")
    return int(n)


def _reachable(adj: np.ndarray, start: int = 0) -> np.ndarray:
    """Nodes reachable from ``start`` following ``adj[i, j]`` from j to i (breadth first)."""
    seen = np.zeros(adj.shape[0], dtype=bool)
    seen[start] = True
    frontier = seen.copy()
    while frontier.any():
        nxt = adj[:, frontier].any(axis=1) & ~seen
        seen |= nxt
        frontier = nxt
    return seen


def is_connected(adj: np.ndarray) -> bool:
    """Whether every node reaches every other (strongly connected, for a directed graph)."""
    adj = np.asarray(adj, dtype=bool)
    return bool(_reachable(adj).all() and _reachable(adj.T).all())


def degrees(adj: np.ndarray) -> np.ndarray:
    """Each node's number of neighbours (in-neighbours for a directed graph), int64."""
    return np.asarray(adj, dtype=bool).sum(axis=1).astype(np.int64)


def edges(adj: np.ndarray) -> list[tuple[int, int]]:
    """The undirected edges ``(u, v)`` with ``u < v``, in row order."""
    u, v = np.nonzero(np.triu(np.asarray(adj, dtype=bool), k=1))
    return list(zip(u.tolist(), v.tolist()))


def square_nonnegative(a: np.ndarray, what: str, fix: str) -> None:
    """Raise :class:`TopologyError` unless ``a`` is a square, numeric, finite matrix with
    no negative entry; ``fix`` ends the negative-entry message."""
    if a.ndim != 2 or a.shape[0] != a.shape[1]:
        raise TopologyError(f"{what} must be a square (n, n) matrix, got shape {a.shape}")
    if a.shape[0] < 1:
        raise TopologyError(f"{what} has no nodes (shape {a.shape}); give it n >= 2 nodes")
    if a.dtype != bool and not np.issubdtype(a.dtype, np.number):
        raise TopologyError(f"{what} must be numeric or bool, got dtype {a.dtype}")
    if not np.all(np.isfinite(a)):
        i, j = np.argwhere(~np.isfinite(a))[0]
        raise TopologyError(f"{what} has a non-finite entry {a[i, j]} at ({i}, {j})")
    if np.any(a < 0):
        i, j = np.argwhere(a < 0)[0]
        raise TopologyError(f"{what} has a negative weight {a[i, j]:.3g} at ({i}, {j}); {fix}")


def _as_01(adj: Any, what: str) -> np.ndarray:
    a = np.asarray(adj)
    square_nonnegative(a, what, "entries are 1 (an edge) or 0 (none), and the mixing rule sets the weights")
    if a.dtype == bool:
        return a.copy()
    bad = (a != 0) & (a != 1)
    if np.any(bad):
        i, j = np.argwhere(bad)[0]
        raise TopologyError(f"{what} has entry {a[i, j]} at ({i}, {j}); entries are 1 (an edge) or 0 "
                            f"(none). The mixing rule sets the weights; to use weights of your own, "
                            f"check them with fededge.topology.mixing.check_mixing")
    return a != 0


def _check_no_self_loops(a: np.ndarray, what: str) -> None:
    loops = np.flatnonzero(np.diag(a))
    if loops.size:
        raise TopologyError(f"{what} has a self-loop at node {loops[0]} (diagonal entry set); set "
                            f"the diagonal to 0: the mixing rule sets each node's own weight")


def check_adjacency(adj: Any, *, what: str = "adjacency matrix") -> np.ndarray:
    """Validate an undirected graph; return it as a fresh ``(n, n)`` bool array.

    Raises
    ------
    TopologyError
        Not square; an entry other than 0/1 (a negative weight included); a self-loop;
        asymmetric; fewer than 2 nodes; a node with no neighbours; disconnected.
    """
    a = _as_01(adj, what)
    n = a.shape[0]
    if n < 2:
        raise TopologyError(f"{what} has {n} node(s); gossip needs n >= 2")
    _check_no_self_loops(a, what)
    if not np.array_equal(a, a.T):
        i, j = np.argwhere(a != a.T)[0]
        raise TopologyError(
            f"{what} is not symmetric: ({i}, {j}) is {int(a[i, j])} but ({j}, {i}) is {int(a[j, i])}. "
            f"Symmetrise it (np.maximum(A, A.T)) for doubly stochastic mixing, or use push-sum "
            f"weights (fededge.topology.mixing.push_sum_weights) for a directed graph")
    _check_neighbours_and_connected(a, what)
    return a


def check_directed(adj: Any, *, what: str = "directed adjacency matrix",
                   connected: bool = True) -> np.ndarray:
    """Validate a directed graph (``A[i, j]``: i hears j); return it as a bool array.

    As :func:`check_adjacency` without the symmetry: every node hears someone and is
    heard by someone, and, with ``connected``, the graph is strongly connected (every
    node's model reaches every other). One round of a time-varying graph need not be
    connected (``connected=False``); its union over a period must be.
    """
    a = _as_01(adj, what)
    if a.shape[0] < 2:
        raise TopologyError(f"{what} has {a.shape[0]} node(s); gossip needs n >= 2")
    _check_no_self_loops(a, what)
    deaf = np.flatnonzero(~a.any(axis=1))
    if deaf.size:
        raise TopologyError(f"node {deaf[0]} of the {what} hears no one (empty row); give it an "
                            f"in-neighbour")
    mute = np.flatnonzero(~a.any(axis=0))
    if mute.size:
        raise TopologyError(f"node {mute[0]} of the {what} is heard by no one (empty column); give "
                            f"it an out-neighbour")
    if connected and not is_connected(a):
        unreached = np.flatnonzero(~_reachable(a))
        # Node 0 may reach everyone while some node does not reach node 0: name those.
        where = (f"node 0's model never reaches node(s) {unreached[:10].tolist()}" if unreached.size else
                 f"node(s) {np.flatnonzero(~_reachable(a.T))[:10].tolist()} never reach node 0")
        raise TopologyError(f"the {what} is not strongly connected: {where}; add edges so that every node "
                            f"reaches every other")
    return a


def _check_neighbours_and_connected(a: np.ndarray, what: str) -> None:
    lonely = np.flatnonzero(~a.any(axis=1))
    if lonely.size:
        raise TopologyError(f"node {lonely[0]} of the {what} has no neighbours; connect it to at "
                            f"least one node (or leave it out and renumber the nodes)")
    reach = _reachable(a)
    if not reach.all():
        cut = np.flatnonzero(~reach)
        raise TopologyError(
            f"the {what} is disconnected: node(s) {cut[:10].tolist()}"
            f"{' ...' if cut.size > 10 else ''} cannot be reached from node 0, so the nodes never "
            f"reach consensus. Add edges between the components")


# ------------------------------------------------------------------ deterministic families
def _circulant(n: int, offsets: Iterable[int]) -> np.ndarray:
    """Symmetric graph joining i and (i +- d) mod n for each offset d."""
    a = np.zeros((n, n), dtype=bool)
    idx = np.arange(n)
    for d in offsets:
        a[idx, (idx + d) % n] = True
        a[(idx + d) % n, idx] = True
    np.fill_diagonal(a, False)
    return a


def ring(n: int) -> np.ndarray:
    """Ring (cycle): node i hears i-1 and i+1 (mod n). n = 2 is a single edge.

    Spectral gap shrinks as 1/n^2: cheap (2 peers) but slow to mix at large n.
    """
    return _circulant(_need_n(n, family="ring"), [1])


def torus_shape(n: int, rows: int | None = None, cols: int | None = None) -> tuple[int, int]:
    """The ``(rows, cols)`` of a 2-D torus of n nodes: as given, or near-square.

    Without ``rows`` or ``cols``, rows is the largest divisor of n with 2 <= rows <=
    sqrt(n). With one of them, the other is n divided by it. Both sides must be >= 2.
    """
    n = _need_n(n, family="torus")
    if rows is None and cols is None:
        rows = max((r for r in range(2, math.isqrt(n) + 1) if n % r == 0), default=0)
        if not rows:
            raise TopologyError(f"torus: n={n} cannot form a 2-D torus, which needs rows x cols = n "
                                f"with both >= 2; use such an n (4, 6, 8, 9, ...) or topology 'ring'")

    def whole(side: Any) -> bool:
        return isinstance(side, (int, np.integer)) and not isinstance(side, bool) and side >= 2

    if rows is None and whole(cols) and n % cols == 0:
        rows = n // cols
    if cols is None and whole(rows) and n % rows == 0:
        cols = n // rows
    if not (whole(rows) and whole(cols) and rows * cols == n):
        raise TopologyError(f"torus: rows={rows!r} x cols={cols!r} must be integers >= 2 with "
                            f"rows * cols = n = {n}; change rows/cols or n")
    return int(rows), int(cols)


def torus(n: int, *, rows: int | None = None, cols: int | None = None) -> np.ndarray:
    """2-D torus (wrap-around grid) of ``rows x cols = n`` nodes, each hearing its 4 grid
    neighbours. Node ``r * cols + c`` sits at row r, column c.

    Parameters
    ----------
    n : int
        Nodes; must factor as rows x cols with both >= 2 (a prime n raises).
    rows, cols : int, optional
        The shape; by default the most square factorisation (16 -> 4 x 4, 8 -> 2 x 4).
        A side of 2 joins its two rows once, not twice, so degrees are 3 there.
    """
    rows, cols = torus_shape(n, rows, cols)
    a = np.zeros((n, n), dtype=bool)
    r, c = np.divmod(np.arange(n), cols)
    for dr, dc in ((1, 0), (-1, 0), (0, 1), (0, -1)):
        a[np.arange(n), ((r + dr) % rows) * cols + (c + dc) % cols] = True
    np.fill_diagonal(a, False)
    return a


def complete(n: int) -> np.ndarray:
    """Complete graph: everyone hears everyone. With uniform weights one step is the exact
    average (FedAvg's), at n - 1 messages per node."""
    n = _need_n(n, family="complete")
    return ~np.eye(n, dtype=bool)


def star(n: int) -> np.ndarray:
    """Star: node 0 is the hub, every other node hears only the hub (a parameter server
    without the averaging). The hub carries n - 1 links."""
    n = _need_n(n, family="star")
    a = np.zeros((n, n), dtype=bool)
    a[0, 1:] = a[1:, 0] = True
    return a


def hypercube(n: int) -> np.ndarray:
    """Hypercube of dimension log2(n): i hears every j differing from i in one bit.

    Raises :class:`TopologyError` unless n is a power of two (>= 2).
    """
    n = _need_n(n, family="hypercube")
    if n & (n - 1):
        lo = 1 << (n.bit_length() - 1)
        raise TopologyError(f"hypercube: n={n} is not a power of two; use n={lo} or n={2 * lo}, or "
                            f"topology 'exponential' (which takes any n)")
    idx = np.arange(n)
    a = np.zeros((n, n), dtype=bool)
    for b in range(n.bit_length() - 1):
        a[idx, idx ^ (1 << b)] = True
    return a


def exponential_distances(n: int) -> list[int]:
    """The exponential graph's hop distances: 1, 2, 4, ... below n (ceil(log2 n) of them)."""
    n = _need_n(n, family="exponential")
    return [1 << k for k in range((n - 1).bit_length())]


def exponential(n: int) -> np.ndarray:
    """Exponential graph, symmetrised: i hears (i +- 2^k) mod n for every 2^k < n.

    In SGP (Assran et al., 2019, "Stochastic Gradient Push") the graph is directed: i sends
    to i + 2^k only, and push-sum corrects for the lack of symmetry. fededge symmetrises
    it (i also hears i + 2^k) so that Metropolis-Hastings gives a symmetric doubly
    stochastic W and plain D-PSGD / CHOCO apply. Degrees are up to 2 ceil(log2 n) (for n a
    power of two, 2 log2 n - 1: distance n/2 is its own mirror); the gap stays large as
    n grows (Ying et al., 2021).
    """
    return _circulant(_need_n(n, family="exponential"), exponential_distances(n))


def one_peer_exponential(n: int, t: int) -> np.ndarray:
    """Round ``t``'s directed graph of the one-peer exponential graph.

    With ``tau = ceil(log2 n)`` distances, in round t node i sends to its one peer
    ``(i + 2^(t mod tau)) mod n``; so node i hears only ``(i - 2^(t mod tau)) mod n``.
    The graph is **directed** (each node has exactly one in- and one out-neighbour),
    except when the distance is n/2, where the two coincide. Over tau consecutive rounds
    the union is the exponential graph. With weights 1/2-1/2
    (:func:`fededge.topology.mixing.one_peer_exponential_mixing`) tau rounds give the
    exact average when n is a power of two (Ying et al., 2021, "Exponential Graph is
    Provably Efficient for Decentralized Deep Training"; Assran et al., 2019).
    """
    dist = exponential_distances(n)
    if isinstance(t, bool) or not isinstance(t, (int, np.integer)) or t < 0:
        raise TopologyError(f"one-peer-exponential: the round t must be an integer >= 0, got {t!r}")
    d = dist[int(t) % len(dist)]
    idx = np.arange(n)
    a = np.zeros((n, n), dtype=bool)
    a[idx, (idx - d) % n] = True
    return a


# ------------------------------------------------------------------ random families
def _rng(seed: Any) -> np.random.Generator:
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)):
        raise TopologyError(f"seed must be an integer, got {seed!r}")
    return np.random.default_rng(int(seed))


def erdos_renyi(n: int, *, p: float | None = None, seed: int = 0, max_tries: int = 100) -> np.ndarray:
    """Erdős–Rényi G(n, p), seeded, redrawn until connected.

    Parameters
    ----------
    n : int
        Nodes.
    p : float, optional
        Probability of each edge, in (0, 1]. Default ``min(1, 2 ln(n) / n)``: twice the
        connectivity threshold ln(n)/n, so few redraws are needed. Raise it for more
        edges (larger spectral gap, more bytes per round).
    seed : int
        Seed of the local numpy Generator: the same seed gives the same graph.
    max_tries : int
        Draws before giving up with :class:`TopologyError` (naming p and n).
    """
    n = _need_n(n, family="erdos-renyi")
    if p is None:
        p = min(1.0, 2 * math.log(n) / n)
    if not isinstance(p, (int, float, np.floating)) or not 0 < p <= 1:
        raise TopologyError(f"erdos-renyi: p must be in (0, 1], got {p!r}")
    if max_tries < 1:
        raise TopologyError(f"erdos-renyi: max_tries must be >= 1, got {max_tries}")
    rng = _rng(seed)
    for _ in range(max_tries):
        upper = np.triu(rng.random((n, n)) < p, k=1)
        a = upper | upper.T
        if a.any(axis=1).all() and is_connected(a):
            return a
    raise TopologyError(
        f"erdos-renyi: no connected graph in {max_tries} draws with p={p} and n={n}; raise p "
        f"above the connectivity threshold ln(n)/n = {math.log(n) / n:.3g} (e.g. p="
        f"{min(1.0, 2 * math.log(n) / n):.3g}) or raise max_tries")


def k_regular(n: int, *, k: int = 4, seed: int = 0, max_tries: int = 100) -> np.ndarray:
    """Random connected k-regular graph, seeded.

    Starts from the circulant k-regular graph (i joined to i +- 1..k/2, and to i + n/2 when
    k is odd) and applies 10 |E| random degree-preserving double-edge swaps (a-b, c-d ->
    a-d, c-b, skipping swaps that would make a self-loop or a repeated edge: the Markov
    chain of Milo et al., 2003). Redrawn until connected.

    Parameters
    ----------
    k : int
        Degree, 1 <= k < n with n * k even. k = 1 is a perfect matching, connected only
        for n = 2. Default 4.
    seed, max_tries : as :func:`erdos_renyi`.
    """
    n = _need_n(n, family="k-regular")
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or not 1 <= k < n:
        raise TopologyError(f"k-regular: need 1 <= k < n, got k={k!r} with n={n}; lower k or add nodes")
    if (n * k) % 2:
        raise TopologyError(f"k-regular: n * k must be even (each edge has two ends), got n={n}, "
                            f"k={k}; change k or n by one")
    if k == 1 and n > 2:
        raise TopologyError(f"k-regular: k=1 is a perfect matching, disconnected for n={n} > 2; "
                            f"use k >= 2")
    base = _circulant(n, range(1, k // 2 + 1))
    if k % 2:
        idx = np.arange(n)
        base[idx, (idx + n // 2) % n] = True
    rng = _rng(seed)
    e = edges(base)
    present = set(e)
    for _ in range(max_tries):
        for _ in range(10 * len(e)):
            x, y = rng.integers(len(e), size=2)
            (a, b), (c, d) = e[x], e[y]
            if rng.random() < 0.5:
                c, d = d, c
            new1, new2 = (min(a, d), max(a, d)), (min(c, b), max(c, b))
            if len({a, b, c, d}) < 4 or new1 in present or new2 in present:
                continue
            present -= {e[x], e[y]}
            present |= {new1, new2}
            e[x], e[y] = new1, new2
        adj = from_edges(e, n, check=False)
        if is_connected(adj):
            return adj
    raise TopologyError(f"k-regular: no connected graph in {max_tries} draws with k={k} and n={n}; "
                        f"raise k or max_tries")


# ------------------------------------------------------------------ custom graphs
def from_edges(edge_list: Iterable[tuple[int, int]], n: int, *, check: bool = True) -> np.ndarray:
    """Undirected adjacency of n nodes from ``(u, v)`` pairs (either order; repeats are
    the same edge). Checked with :func:`check_adjacency` unless ``check=False``."""
    n = _need_n(n, family="edge list")
    a = np.zeros((n, n), dtype=bool)
    for u, v in edge_list:
        for node in (u, v):
            # (a float indexes nothing; True would index a whole row)
            if isinstance(node, bool) or not isinstance(node, (int, np.integer)):
                raise TopologyError(f"edge ({u!r}, {v!r}) names node {node!r}, not an integer; number "
                                    f"the nodes 0..n-1")
            if not 0 <= node < n:
                raise TopologyError(f"edge ({u}, {v}) names node {node}, outside 0..{n - 1}; number "
                                    f"the nodes 0..n-1 or raise n")
        if u == v:
            raise TopologyError(f"edge ({u}, {v}) is a self-loop; remove it: the mixing rule sets "
                                f"each node's own weight")
        a[u, v] = a[v, u] = True
    return check_adjacency(a, what="edge list") if check else a


def read_edge_list(path: str | Path, n: int) -> np.ndarray:
    """Adjacency from a text file of ``u v`` lines (0-based node numbers).

    ``#`` starts a comment (whole line or the line's end); blank lines are skipped. An
    edge may be listed once or in both directions. Every node 0..n-1 must have an edge.

    Raises
    ------
    TopologyError
        An unreadable file, a line that is not two integers (with its line number), a
        node outside 0..n-1, a self-loop, or a graph :func:`check_adjacency` refuses.
    """
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as e:
        raise TopologyError(f"cannot read the edge-list file {str(path)!r}: {e.strerror or e}; "
                            f"give an existing file of 'u v' lines") from e
    pairs = []
    for lineno, line in enumerate(text.splitlines(), 1):
        fields = line.split("#", 1)[0].split()
        if not fields:
            continue
        try:
            u, v = (int(f) for f in fields)
        except ValueError:
            raise TopologyError(f"{path}:{lineno}: expected 'u v' (two integers), got {line.strip()!r}") from None
        pairs.append((u, v))
    try:
        return check_adjacency(from_edges(pairs, n, check=False), what=f"edge list {path.name}")
    except TopologyError as e:
        raise TopologyError(f"{path}: {e}") from None


def from_networkx(graph: Any) -> np.ndarray:
    """Adjacency of an undirected networkx graph.

    Node k is the k-th of ``graph.nodes``, except that nodes labelled exactly 0..n-1
    keep their labels. Edge weights are not used (the mixing rule sets them). networkx is
    imported only here; without it this raises ImportError saying how to install it.
    """
    try:
        import networkx as nx
    except ImportError as e:
        raise ImportError("reading a networkx graph needs networkx: pip install networkx") from e
    if not isinstance(graph, nx.Graph):
        raise TopologyError(f"expected a networkx graph, got {type(graph).__name__}")
    if graph.is_directed():
        raise TopologyError("the networkx graph is directed; pass graph.to_undirected() for "
                            "doubly stochastic mixing, or build push-sum weights from its adjacency")
    nodes = list(graph.nodes)
    if set(nodes) == set(range(len(nodes))):
        nodes = list(range(len(nodes)))
    a = nx.to_numpy_array(graph, nodelist=nodes, weight=None, dtype=float)
    loops = [u for u, v in nx.selfloop_edges(graph)]
    if loops:
        raise TopologyError(f"the networkx graph has a self-loop at node {loops[0]!r}; remove it "
                            f"(graph.remove_edges_from(nx.selfloop_edges(graph))): the mixing rule "
                            f"sets each node's own weight")
    return check_adjacency(a != 0, what="networkx graph")
