"""Lagom's priority search over communication resources (arXiv 2602.20656).

Pure logic, separate from measurement. The search sees N communications, communication j with
``num_levels[j]`` resource levels (level 0 = least resources taken from the overlapped
computation), and a measurement ``Trial(y_us, x_us, z_us)`` per tried level vector:

* ``y_us``: computation time of the step, slowed by whatever the overlapped communication takes;
* ``x_us[j]``: time of communication j (Lagom's ``x_j(s_j)``); ``X = sum(x_us)``;
* ``z_us``: the step time (Lagom's ``Z = max(Y, X)`` where the model holds).

Rules (Lagom's, with the two deviations marked *):

1. Start every communication at level 0; measure; every priority ``H_j = 0.01``.
2. Pick the unfinished communication with the smallest ``H_j`` (ties: lowest index) and try it
   one level up (*with ``gallop=True`` the step doubles after each accepted move and falls back to
   one level after a rejection, so long ladders cost O(log L) trials instead of O(L)).
3. Reject the move and finish j when more resources make the communication slower
   (``x_j' >= x_j``) or (*) when the step time does not improve (``z' >= z``: measured guard
   against moves the cost model would accept but the hardware does not reward).
4. Otherwise accept it, with ``H_j = (Y' - Y) / (x_j - x_j')``: computation added per unit of
   communication saved.
5. When ``X' < Y'`` the step is computation-bound: more resources for any communication can only
   slow computation, so every communication is finished.

(*) ``tolerance`` > 0 (for measured trials): rules 3 only fire when x_j or z got worse by at least
that fraction; moves within the noise are accepted and the result is the best-measured accepted
configuration (see ``search_steps``).

Every call of ``measure`` is one trial; ``SearchResult.history`` records them in order.
``distributed_priority_search`` runs the same logic on rank ``src`` of an explicit process group
and broadcasts every decision, so all ranks try the same configurations in the same order.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass
from typing import TypeVar

import torch
import torch.distributed as dist

Levels = tuple[int, ...]

_T = TypeVar("_T")

#: Lagom's initial priority of every communication.
INITIAL_H = 0.01


@dataclass(frozen=True)
class Trial:
    """One measurement: computation ``y_us``, per-communication ``x_us``, step ``z_us``."""

    y_us: float
    x_us: tuple[float, ...]
    z_us: float

    @property
    def X_us(self) -> float:
        return float(sum(self.x_us))


@dataclass(frozen=True)
class Step:
    """One trial of the search: the levels tried, what was measured and what was decided.

    ``decision``: ``start`` (level 0 of everything), ``accept``, ``accept-compute-bound`` (accepted
    and X < Y, search ends), ``reject-slower`` (x_j did not drop), ``reject-no-gain`` (z did not
    drop). ``communication`` is the index moved (None for the start).
    """

    levels: Levels
    trial: Trial
    communication: int | None
    decision: str


@dataclass(frozen=True)
class SearchResult:
    levels: Levels
    trial: Trial
    history: tuple[Step, ...]

    @property
    def num_trials(self) -> int:
        return len(self.history)


def h_metric(before: Trial, after: Trial, j: int) -> float:
    """Lagom's priority of communication j after a move: H_j = (Y' - Y) / (x_j - x_j'), the
    computation added per unit of communication saved; inf when x_j did not drop."""
    saved_us = before.x_us[j] - after.x_us[j]
    return (after.y_us - before.y_us) / saved_us if saved_us > 0 else math.inf


def search_steps(
    num_levels: Sequence[int], *, gallop: bool = False, tolerance: float = 0.0
) -> Generator[Levels, Trial, SearchResult]:
    """The search as a coroutine: yields level vectors to try, receives their ``Trial``.

    Drive it with ``send``; its return value (``StopIteration.value``) is the ``SearchResult``.
    Used both offline (``priority_search``) and online (one trial per few training iterations).

    ``tolerance`` (measurement noise, relative): a move is rejected only when x_j or z got worse
    by at least that much; a move within the noise is accepted (the search walks through
    plateaus and noise) with H_j = inf when x_j did not drop, and the result is the accepted
    configuration with the smallest z (ties: the earlier one, i.e. fewer resources). With 0 (the
    default) this is exactly the rule list in the module docstring.
    """
    n = len(num_levels)
    if n == 0 or any(k < 1 for k in num_levels):
        raise ValueError(f"every communication needs at least one level, got {list(num_levels)}")
    if not 0.0 <= tolerance < 1.0:
        raise ValueError(f"tolerance must be in [0, 1), got {tolerance}")
    levels: Levels = (0,) * n
    current = yield levels
    _check(current, n)
    history = [Step(levels, current, None, "start")]
    best = (levels, current)
    h = [INITIAL_H] * n
    step = [1] * n
    done = [False] * n
    if current.X_us < current.y_us:
        done = [True] * n  # already computation-bound at minimal resources
    while not all(done):
        j = min((c for c in range(n) if not done[c]), key=lambda c: (h[c], c))
        top = num_levels[j] - 1
        if levels[j] >= top:
            done[j] = True
            continue
        candidate = levels[:j] + (min(levels[j] + step[j], top),) + levels[j + 1 :]
        trial = yield candidate
        _check(trial, n)
        slower = trial.x_us[j] >= current.x_us[j] * (1.0 + tolerance)
        if slower or trial.z_us >= current.z_us * (1.0 + tolerance):
            history.append(
                Step(candidate, trial, j, "reject-slower" if slower else "reject-no-gain")
            )
            if candidate[j] - levels[j] > 1:
                step[j] = 1  # overshot while galloping: retry one level up from the accepted level
            else:
                done[j] = True
            continue
        h[j] = h_metric(current, trial, j)
        levels, current = candidate, trial
        if trial.z_us < best[1].z_us:
            best = (levels, trial)
        if gallop:
            step[j] *= 2
        if trial.X_us < trial.y_us:
            history.append(Step(candidate, trial, j, "accept-compute-bound"))
            break
        history.append(Step(candidate, trial, j, "accept"))
    return SearchResult(levels=best[0], trial=best[1], history=tuple(history))


def priority_search(
    num_levels: Sequence[int],
    measure: Callable[[Levels], Trial],
    *,
    gallop: bool = False,
    tolerance: float = 0.0,
) -> SearchResult:
    """Run the search to the end in this process, calling ``measure(levels)`` once per trial."""
    gen = search_steps(num_levels, gallop=gallop, tolerance=tolerance)
    levels = next(gen)
    while True:
        try:
            levels = gen.send(measure(levels))
        except StopIteration as stop:
            return stop.value


def trial_from_exposed(
    y_us: float, exposed_us: Sequence[float], z_us: float, *, hidden_tol: float = 0.02
) -> Trial:
    """A ``Trial`` from what a runtime can observe: computation, exposed wait per communication, step.

    Only the exposed part of an overlapped communication is visible (gloo, or a timer around the
    wait). By Z = max(Y, X) per window: while communication j is exposed the window is
    communication-bound and ``x_j = y + exposed_j``; once it hides (``exposed_j <= hidden_tol * z``)
    ``x_j = exposed_j`` (< y). With ``y_us = 0`` (nothing but the step time observable) pass
    ``exposed_us = [z_us] * n``: every ``x_j = z`` and the search hill-climbs on the step time.
    """
    x = tuple(e if e <= hidden_tol * z_us else y_us + e for e in exposed_us)
    return Trial(y_us=y_us, x_us=x, z_us=z_us)


def _check(trial: Trial, n: int) -> None:
    if not isinstance(trial, Trial) or len(trial.x_us) != n:
        raise ValueError(f"measure must return a Trial with {n} communication times, got {trial!r}")


def collective_device(group: dist.ProcessGroup) -> torch.device:
    """Where a tensor for a collective on ``group`` must live: the current CUDA device on an NCCL
    group (ProcessGroupNCCL has no CPU backend: "No backend type associated with device type cpu"),
    the CPU otherwise (gloo, or a default group initialised with both, ``cpu:gloo,cuda:nccl``)."""
    if str(dist.get_backend(group)) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def max_over_ranks(values: Sequence[float], group: dist.ProcessGroup) -> tuple[float, ...]:
    """Each value maximised over the group's ranks (float64; the same result on every rank)."""
    t = torch.tensor(list(values), dtype=torch.float64, device=collective_device(group))
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return tuple(t.tolist())


def max_trial_over_ranks(trial: Trial, group: dist.ProcessGroup) -> Trial:
    """Every time maximised over the group's ranks: a synchronous step is as slow as its slowest rank."""
    values = max_over_ranks([trial.y_us, trial.z_us, *trial.x_us], group)
    return Trial(y_us=values[0], x_us=tuple(values[2:]), z_us=values[1])


def broadcast_from(obj: _T, src_global: int, group: dist.ProcessGroup) -> _T:
    """``obj`` of global rank ``src_global`` on every rank of ``group`` (pickled; small objects only).

    Every rank passes a value of the same declared type (the source's is the one kept)."""
    box = [obj]
    dist.broadcast_object_list(box, src=src_global, group=group)
    return box[0]


def distributed_priority_search(
    num_levels: Sequence[int],
    measure: Callable[[Levels], Trial],
    *,
    group: dist.ProcessGroup,
    src: int = 0,
    gallop: bool = False,
    tolerance: float = 0.0,
) -> SearchResult:
    """The search with every rank of ``group`` agreeing on every trial.

    Each trial: rank ``src`` (a rank of ``group``) broadcasts the levels to try, every rank calls
    ``measure`` (they run the training iterations together), the trials are maximised over the
    group, and only rank ``src`` advances the search. The final result is broadcast too, so every
    rank returns the same ``SearchResult``. All ranks must call this collectively.
    """
    src_global = dist.get_global_rank(group, src)
    leader = dist.get_rank(group) == src
    gen = search_steps(num_levels, gallop=gallop, tolerance=tolerance) if leader else None
    levels: Levels | None = next(gen) if gen is not None else None
    result: SearchResult | None = None
    while True:
        levels = broadcast_from(levels, src_global, group)
        if levels is None:
            break
        trial = max_trial_over_ranks(measure(levels), group)
        if gen is not None:
            try:
                levels = gen.send(trial)
            except StopIteration as stop:
                result, levels = stop.value, None
    result = broadcast_from(result, src_global, group)
    if result is None:  # the leader only stops broadcasting levels once its search returned
        raise RuntimeError("distributed_priority_search: the source rank ended without a result")
    return result
