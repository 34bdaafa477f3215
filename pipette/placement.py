"""Rank placement: which device runs which rank (``placement[rank] = device``).

Three steps, each cheaper than the next is useful:

1. ``default_placement``, per device on the measured matrix: keep the best-connected
   ``world`` devices, cut them into tensor-parallel cliques of the fastest links (greedy),
   gather those into data-parallel sets (greedy again, so DP rings stay in a node where they
   fit), then chain the sets into pipeline stages, which therefore cross nodes. This is
   Megatron-LM's rule "tensor parallel within a server, pipeline across servers"
   (Narayanan et al. 2021, SC'21, section 3.3, takeaway #1), read off the matrix instead of
   the node list.
2. On a *two-level* cluster (identical devices, one intra-node and one inter-node link
   figure, equal nodes) a placement's cost only depends on which groups stay inside a
   node, so a handful of whole-node tilings are evaluated and nothing else can gain.
3. Otherwise simulated annealing (Kirkpatrick, Gelatt and Vecchi 1983, Metropolis rule:
   accept a worse state with probability ``exp(-dC / T)``) over structured moves that keep
   the rank layout meaningful: swap two devices, two TP groups, two stages, two DP replicas
   (whole pipelines), reverse a segment of a DP ring or of the pipeline, or trade a used
   device for an idle one, restarting from the best after a long plateau. It starts from
   the better of the default and the rank order (both evaluated) and returns the best
   placement seen, so the answer is never worse than either.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from pipette.cluster import ClusterProfile
from pipette.config import ParallelConfig
from pipette.errors import SpecError
from pipette.memory_cp import fold_config

IntArray = npt.NDArray[np.int64]
FloatArray = npt.NDArray[np.float64]
#: ``cost(placement)`` is the predicted step time (s) of the candidate under ``placement``.
PlacementCost = Callable[[IntArray], float]

# Two link figures closer than this (relative) are the same figure: the matrices go through
# unit conversions and sums, so exact float equality would miss equal links.
_SAME_RTOL = 1e-9
# Annealing temperature, relative to the start's cost: a move 1 % worse is first accepted
# with probability 1/e, at the end almost never. Picked (with the restart share below) on ten
# slow-link clusters x degrees, against 0.05 and 0.002, by the gap to 30000-evaluation runs.
_T_START = 0.01
_T_END = 1e-4
# Stop after this share of the budget without a new best (the tail of a cold anneal).
_STALL_SHARE = 0.35
# Go back to the best placement after this share of ``stall`` proposals without a gain.
_RESTART_SHARE = 0.25
# Relative weights of the structured moves (see ``_propose``).
_MOVE_WEIGHTS = {
    "device": 4.0, "idle": 2.0, "tp_group": 2.0, "stage": 1.0, "replica": 1.0,
    "reverse_dp": 1.0, "reverse_pp": 1.0,
}


@dataclass(frozen=True)
class PlacementResult:
    placement: tuple[int, ...]
    cost: float  # cost of ``placement``
    default_cost: float  # cost of ``default_placement``
    evaluations: int  # calls of ``cost``
    method: str  # "default" (nothing to gain), "layout" (a whole-node tiling) or "annealing"


def naive_placement(config: ParallelConfig) -> tuple[int, ...]:
    """Rank ``i`` on device ``i``."""
    return tuple(range(config.world))


def default_placement(config: ParallelConfig, cluster: ClusterProfile) -> tuple[int, ...]:
    """The topology-aware start: TP cliques, DP sets, then stages (module docstring)."""
    config = fold_config(config)  # cp ranks as data-parallel ones: the same rank order (pipette.memory_cp)
    _check_fits(config, cluster)
    levels = _two_level(cluster)
    if levels is not None and (config.world <= levels.node_size or config.world % levels.node_size == 0):
        # On a two-level cluster the greedy below returns whole nodes in rank order (a unit
        # test checks it); skipping it keeps 1024-device plans fast.
        return tuple(int(d) for d in levels.order[: config.world])
    return _greedy_placement(config, cluster)


def _greedy_placement(config: ParallelConfig, cluster: ClusterProfile) -> tuple[int, ...]:
    used = _best_connected(cluster, config.world)
    bw, lat = _symmetric_links(cluster)
    if len(used) < cluster.world:
        bw, lat = bw[np.ix_(used, used)], lat[np.ix_(used, used)]
    tp_sets = _greedy_cliques(bw, lat, config.tp)
    # A DP ring or pipeline hop between two TP groups pairs rank t with rank t: its speed
    # is the slowest of those tp links.
    g_bw = bw[tp_sets[:, None, :], tp_sets[None, :, :]].min(axis=2)
    g_lat = lat[tp_sets[:, None, :], tp_sets[None, :, :]].max(axis=2)
    dp_sets = _greedy_cliques(g_bw, g_lat, config.dp)
    stages = _chain_stages(dp_sets, g_bw, g_lat)
    grid = tp_sets[stages]  # (pp, dp, tp) indices into ``used``
    return tuple(int(d) for d in used[grid.reshape(-1)])


def optimize_placement(
    config: ParallelConfig,
    cluster: ClusterProfile,
    cost: PlacementCost,
    *,
    seed: int = 0,
    max_evaluations: int = 2000,
) -> PlacementResult:
    """The placement with the lowest ``cost`` found; never worse than the default.

    ``cost`` gets a read-only ``(world,)`` array of device indices (e.g.
    ``PerfModel.step_time``) and is called at most ``max_evaluations`` times, once per
    distinct placement. Deterministic for a given ``seed``.
    """
    if isinstance(max_evaluations, bool) or not isinstance(max_evaluations, int) or max_evaluations < 1:
        raise SpecError(
            f"is {max_evaluations!r}", field="max_evaluations", fix="give a positive whole number"
        )
    config = fold_config(config)
    start = np.array(default_placement(config, cluster), dtype=np.int64)
    evaluator = _Evaluator(cost)
    default_cost = evaluator(start)
    levels = _two_level(cluster)
    if levels is not None:
        found = _on_two_levels(config, levels, start, default_cost, evaluator, max_evaluations)
        if found is not None:
            return found
    # The rank order is what a user gets without Pipette: never answer worse than it either.
    naive = np.arange(config.world, dtype=np.int64)
    naive_cost = evaluator(naive) if max_evaluations > 1 else math.inf
    if naive_cost < default_cost:
        start, start_cost = naive, naive_cost
    else:
        start_cost = default_cost
    rng = np.random.default_rng(seed)
    idle = np.setdiff1d(np.arange(cluster.world, dtype=np.int64), start)
    best, best_cost = _anneal(config, start, idle, start_cost, evaluator, rng, max_evaluations)
    return PlacementResult(_tuple(best), best_cost, default_cost, evaluator.calls, "annealing")


def _on_two_levels(
    config: ParallelConfig, levels: _Levels, start: IntArray, start_cost: float,
    evaluate: _Evaluator, budget: int,
) -> PlacementResult | None:
    """The answer without search on a two-level cluster, or None when there is none."""
    if config.world <= levels.node_size or levels.flat:
        # All links used are the fastest there are, or every placement costs the same.
        return PlacementResult(_tuple(start), start_cost, start_cost, evaluate.calls, "default")
    if config.world % levels.node_size:
        return None
    tilings = _node_tilings(config, levels)
    if not tilings:
        return None
    best, best_cost = start, start_cost
    for p in tilings:
        if evaluate.calls >= budget:
            break
        c = evaluate(p)
        if c < best_cost:
            best, best_cost = p, c
    method = "default" if best is start else "layout"
    return PlacementResult(_tuple(best), best_cost, start_cost, evaluate.calls, method)


# ---- the default ------------------------------------------------------------------


def _check_fits(config: ParallelConfig, cluster: ClusterProfile) -> None:
    if config.world > cluster.world:
        raise SpecError(
            f"tp x pp x dp = {config.world} ranks, but the cluster has {cluster.world} devices",
            field="config", fix=f"choose degrees whose product is at most {cluster.world}",
        )


def _best_connected(cluster: ClusterProfile, world: int) -> IntArray:
    """``world`` devices, dropping one at a time the one whose links cost the most.

    A device's score is the sum over the devices kept of ``1/B`` (seconds per byte), so one
    slow link weighs more than many fast ones; latency breaks ties. Ties drop the highest
    index, which keeps whole low-numbered nodes.
    """
    n = cluster.world
    if world == n:
        return np.arange(n, dtype=np.int64)
    bw, lat = _symmetric_links(cluster)
    inv = 1.0 / bw  # the diagonal is inf, so a device costs nothing to itself
    score, lat_score = inv.sum(axis=1), lat.sum(axis=1)
    kept = np.ones(n, dtype=bool)
    for _ in range(n - world):
        worst = _best_index(score, -lat_score, kept, largest=True, last=True)
        kept[worst] = False
        score -= inv[:, worst]
        lat_score -= lat[:, worst]
    return np.flatnonzero(kept).astype(np.int64)


_SYMMETRIC: weakref.WeakKeyDictionary[ClusterProfile, tuple[FloatArray, FloatArray]] = (
    weakref.WeakKeyDictionary()
)


def _symmetric_links(cluster: ClusterProfile) -> tuple[FloatArray, FloatArray]:
    """Bandwidth and latency of the slower direction of each pair: a group's collective
    waits for it. Cached, since the planner places many candidates on one cluster."""
    if cluster not in _SYMMETRIC:
        bw, lat = cluster.bandwidth, cluster.latency
        _SYMMETRIC[cluster] = (np.minimum(bw, bw.T), np.maximum(lat, lat.T))
    return _SYMMETRIC[cluster]


def _best_index(primary: FloatArray, secondary: FloatArray, allowed: npt.NDArray[np.bool_],
                *, largest: bool, last: bool = False) -> int:
    """Index with the best ``primary`` (then best ``secondary``) among ``allowed``.

    ``largest`` picks the maximum of ``primary`` and the minimum of ``secondary`` (for
    bandwidth, latency); remaining ties go to the lowest index, or the highest with ``last``.
    """
    sign = 1.0 if largest else -1.0
    p = np.where(allowed, sign * primary, -np.inf)
    top = p.max()
    ok = allowed & (p >= top - abs(top) * _SAME_RTOL)
    s = np.where(ok, sign * secondary, -np.inf)
    top2 = s.max()
    ok &= s >= top2 - abs(top2) * _SAME_RTOL
    hits = np.flatnonzero(ok)
    return int(hits[-1] if last else hits[0])


def _greedy_cliques(bw: FloatArray, lat: FloatArray, size: int) -> IntArray:
    """Cut ``range(n)`` into cliques of ``size``, each grown by the member whose slowest
    link to the clique is fastest. ``bw`` and ``lat`` are symmetric; rows in clique order.

    Each clique is seeded with the worst-connected free member (largest sum of ``1/B``
    to the free ones), so a device with slow links picks its best partners before they
    are gone instead of being left over with whoever remains.
    """
    n = bw.shape[0]
    free = np.ones(n, dtype=bool)
    inv = 1.0 / bw
    score = inv.sum(axis=1)
    groups = np.empty((n // size, size), dtype=np.int64)
    for g in range(n // size):
        seed = _best_index(score, score, free, largest=True)
        min_bw, max_lat = bw[seed].copy(), lat[seed].copy()
        for k in range(size):
            j = seed if k == 0 else _best_index(min_bw, max_lat, free, largest=True)
            free[j] = False
            score -= inv[:, j]
            groups[g, k] = j
            np.minimum(min_bw, bw[j], out=min_bw)
            np.maximum(max_lat, lat[j], out=max_lat)
    return groups


def _chain_stages(sets: IntArray, g_bw: FloatArray, g_lat: FloatArray) -> IntArray:
    """Order the DP sets into stages, each next stage the best-linked remaining set, and
    match each stage's replicas to the previous stage's (rank ``d`` talks to rank ``d``)."""
    pp, dp = sets.shape
    s_bw = g_bw[sets[:, None, :, None], sets[None, :, None, :]].min(axis=(2, 3))
    s_lat = g_lat[sets[:, None, :, None], sets[None, :, None, :]].max(axis=(2, 3))
    left = np.ones(pp, dtype=bool)
    left[0] = False
    out = np.empty_like(sets)
    out[0] = sets[0]
    prev = 0
    for s in range(1, pp):
        nxt = _best_index(s_bw[prev], s_lat[prev], left, largest=True)
        left[nxt] = False
        free = np.ones(dp, dtype=bool)
        for d in range(dp):
            k = _best_index(g_bw[out[s - 1, d], sets[nxt]], g_lat[out[s - 1, d], sets[nxt]], free, largest=True)
            free[k] = False
            out[s, d] = sets[nxt, k]
        prev = nxt
    return out


# ---- two-level clusters -----------------------------------------------------------


@dataclass(frozen=True)
class _Levels:
    node_size: int
    order: IntArray  # devices sorted by node, then index
    flat: bool  # one link figure everywhere: every placement costs the same


_LEVELS: weakref.WeakKeyDictionary[ClusterProfile, _Levels | None] = weakref.WeakKeyDictionary()


def _two_level(cluster: ClusterProfile) -> _Levels | None:
    """``_Levels`` when the devices are interchangeable up to their node, else None.

    That is: identical specs, equal node sizes, one (bandwidth, latency) inside every node
    and one, no better, between nodes. The planner asks once per candidate, so it is cached.
    """
    if cluster in _LEVELS:
        return _LEVELS[cluster]
    result = _find_levels(cluster)
    _LEVELS[cluster] = result
    return result


def _find_levels(cluster: ClusterProfile) -> _Levels | None:
    spec = cluster.devices[0].spec
    if any(d.spec != spec for d in cluster.devices):
        return None
    node = cluster.node_of
    counts = np.bincount(node)
    counts = counts[counts > 0]
    if np.any(counts != counts[0]):
        return None
    n = cluster.world
    order = np.lexsort((np.arange(n), node)).astype(np.int64)
    if n == 1:
        return _Levels(1, order, True)
    same = node[:, None] == node[None, :]
    off = ~np.eye(n, dtype=bool)
    figures: list[tuple[float, float] | None] = []
    for mask in (same & off, ~same):
        if not mask.any():
            figures.append(None)
            continue
        b, lt = cluster.bandwidth[mask], cluster.latency[mask]
        if not (np.allclose(b, b[0], rtol=_SAME_RTOL, atol=0) and np.allclose(lt, lt[0], rtol=_SAME_RTOL, atol=0)):
            return None
        figures.append((float(b[0]), float(lt[0])))
    intra, inter = figures
    if intra is None or inter is None:
        return _Levels(int(counts[0]), order, True)
    if inter[0] > intra[0] or inter[1] < intra[1]:
        return None  # a faster network than the node's own links: nothing is obvious
    flat = math.isclose(intra[0], inter[0], rel_tol=_SAME_RTOL) and math.isclose(
        intra[1], inter[1], rel_tol=_SAME_RTOL
    )
    return _Levels(int(counts[0]), order, flat)


def _node_tilings(config: ParallelConfig, levels: _Levels) -> list[IntArray]:
    """Placements that keep every TP group in a node and tile each node with an ``a x b``
    block of TP groups (``a`` stages by ``b`` replicas). On a two-level cluster only which
    groups stay in a node matters, and inside one kind of group the slowest sets the pace,
    so these blocks are the shapes worth comparing. Empty when TP cannot stay in a node."""
    c, tp, pp, dp = levels.node_size, config.tp, config.pp, config.dp
    if c % tp:
        return []
    k = c // tp
    out = []
    for a in range(1, k + 1):
        b = k // a
        if a * b != k or pp % a or dp % b:
            continue
        s, d, t = np.meshgrid(np.arange(pp), np.arange(dp), np.arange(tp), indexing="ij")
        block = (s // a) * (dp // b) + d // b
        slot = ((s % a) * b + d % b) * tp + t
        out.append(levels.order[(block * c + slot).reshape(-1)])
    return out


# ---- annealing --------------------------------------------------------------------


class _Evaluator:
    """Calls ``cost`` once per distinct placement; NaN counts as infinitely slow."""

    def __init__(self, cost: PlacementCost) -> None:
        self.cost = cost
        self.seen: dict[bytes, float] = {}
        self.calls = 0

    def __call__(self, placement: IntArray) -> float:
        key = placement.tobytes()
        if key not in self.seen:
            arg = placement.copy()
            arg.setflags(write=False)
            value = float(self.cost(arg))
            self.seen[key] = math.inf if math.isnan(value) else value
            self.calls += 1
        return self.seen[key]


def _anneal(
    config: ParallelConfig, start: IntArray, idle: IntArray, start_cost: float,
    evaluate: _Evaluator, rng: np.random.Generator, budget: int,
) -> tuple[IntArray, float]:
    state = np.concatenate([start, idle])  # first ``world`` entries are the placement
    world = config.world
    moves = _moves(config, len(idle))
    if not moves:
        return start, start_cost
    names = list(moves)
    weights = np.array([moves[m] for m in names])
    weights /= weights.sum()
    scale = start_cost if math.isfinite(start_cost) and start_cost > 0 else 1.0
    cur_cost = best_cost = start_cost
    best = start
    # Counted in proposals, not evaluations: on a small cluster most proposals are
    # placements already seen, which cost nothing but find nothing either.
    stall = max(50, int(_STALL_SHARE * budget))
    last_gain = last_restart = 0
    best_state = state
    for step in range(20 * budget):
        if evaluate.calls >= budget or step - last_gain > stall:
            break
        if step - max(last_gain, last_restart) > _RESTART_SHARE * stall:
            # Lost on a plateau of the max-type cost: go back to the best and walk again.
            state, cur_cost, last_restart = best_state, best_cost, step
        frac = evaluate.calls / budget
        temp = scale * _T_START * (_T_END / _T_START) ** frac
        cand = _propose(names[rng.choice(len(names), p=weights)], state, config, rng)
        c = evaluate(cand[:world])
        delta = c - cur_cost
        if delta <= 0 or (math.isfinite(c) and rng.random() < math.exp(-delta / temp)):
            state, cur_cost = cand, c
            if c < best_cost:
                best, best_cost, best_state, last_gain = cand[:world].copy(), c, cand, step
    return best, best_cost


def _moves(config: ParallelConfig, n_idle: int) -> dict[str, float]:
    tp, pp, dp, world = config.tp, config.pp, config.dp, config.world
    ok = {
        "device": world > 1, "idle": n_idle > 0, "tp_group": tp > 1 and pp * dp > 1,
        "stage": pp > 1, "replica": dp > 1 and pp > 1, "reverse_dp": dp > 2, "reverse_pp": pp > 2,
    }
    return {m: w for m, w in _MOVE_WEIGHTS.items() if ok[m]}


def _propose(move: str, state: IntArray, config: ParallelConfig, rng: np.random.Generator) -> IntArray:
    tp, pp, dp, world = config.tp, config.pp, config.dp, config.world
    cand = state.copy()
    grid = cand[:world].reshape(pp, dp, tp)  # a view: writing it writes ``cand``
    if move == "device":
        i, j = rng.choice(world, 2, replace=False)
        cand[[i, j]] = cand[[j, i]]
    elif move == "idle":
        i, j = int(rng.integers(world)), int(rng.integers(world, len(state)))
        cand[[i, j]] = cand[[j, i]]
    elif move == "tp_group":
        groups = grid.reshape(pp * dp, tp)
        i, j = rng.choice(pp * dp, 2, replace=False)
        groups[[i, j]] = groups[[j, i]]
    elif move == "stage":
        i, j = rng.choice(pp, 2, replace=False)
        grid[[i, j]] = grid[[j, i]]
    elif move == "replica":
        i, j = rng.choice(dp, 2, replace=False)
        grid[:, [i, j]] = grid[:, [j, i]]
    elif move == "reverse_dp":
        s = int(rng.integers(pp))
        i, j = sorted(int(x) for x in rng.choice(dp, 2, replace=False))
        grid[s, i : j + 1] = grid[s, i : j + 1][::-1].copy()
    else:  # reverse_pp
        i, j = sorted(int(x) for x in rng.choice(pp, 2, replace=False))
        grid[i : j + 1] = grid[i : j + 1][::-1].copy()
    return cand


def _tuple(placement: IntArray) -> tuple[int, ...]:
    return tuple(int(d) for d in placement)
