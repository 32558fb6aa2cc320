"""Layer (a), no processes: the Lagom priority search, its H metric, and the CPU bench's fitted model.

The search runs against synthetic cost functions whose optimum is known by hand (and checked by
brute force over the grid); the exact sequence of trials is asserted.
"""

import itertools
import math

import pytest

from megatron_hexiseq.overlap.search import (
    Trial,
    h_metric,
    priority_search,
    search_steps,
    trial_from_exposed,
)
from megatron_hexiseq.testbed.overlap_bench import fit_cpu_ddp, fit_linear


def lagom_cost(y_fn, x_tables):
    """measure(levels) with Z = max(Y, X), recording the levels it was called with."""
    calls = []

    def measure(levels):
        calls.append(levels)
        y = y_fn(levels)
        x = tuple(table[lv] for table, lv in zip(x_tables, levels))
        return Trial(y_us=y, x_us=x, z_us=max(y, sum(x)))

    return measure, calls


def test_exact_trial_sequence_two_communications():
    # Hand trace in the comments; (2, 2) is the optimum of Z over the whole 4 x 3 grid.
    def y_fn(lv):
        return 50 + 5 * lv[0] + 2 * lv[1]

    x_tables = ([80, 60, 50, 55], [60, 40, 35])
    measure, calls = lagom_cost(y_fn, x_tables)
    result = priority_search((4, 3), measure)
    assert calls == [
        (0, 0),  # start, H = [0.01, 0.01]
        (1, 0),  # tie -> comm 0: x0 80 -> 60, H0 = 5/20 = 0.25
        (1, 1),  # comm 1 (0.01): x1 60 -> 40, H1 = 2/20 = 0.1
        (1, 2),  # comm 1 (0.1): x1 40 -> 35, H1 = 2/5 = 0.4
        (2, 2),  # comm 0 (0.25): x0 60 -> 50, H0 = 5/10 = 0.5
        (3, 2),
    ]  # comm 1 at its top -> done without a trial; comm 0: 50 -> 55 slower
    assert [s.decision for s in result.history] == [
        "start",
        "accept",
        "accept",
        "accept",
        "accept",
        "reject-slower",
    ]
    assert [s.communication for s in result.history] == [None, 0, 1, 1, 0, 0]
    assert result.levels == (2, 2) and result.trial.z_us == 85 and result.num_trials == 6
    grid = {lv: measure(lv).z_us for lv in itertools.product(range(4), range(3))}
    assert min(grid.values()) == 85 and min(grid, key=grid.get) == (2, 2)


def test_stops_when_computation_bound():
    measure, calls = lagom_cost(
        lambda lv: 100 + 10 * lv[0] + 5 * lv[1], ([80, 60, 50], [60, 40, 30])
    )
    result = priority_search((3, 3), measure)
    # (1,0): y 110 X 120 accepted; (1,1): y 115 X 100 < Y -> every communication done
    assert calls == [(0, 0), (1, 0), (1, 1)]
    assert result.history[-1].decision == "accept-compute-bound" and result.levels == (1, 1)


def test_already_computation_bound_at_minimal_resources():
    measure, calls = lagom_cost(lambda lv: 200.0, ([50, 10],))
    result = priority_search((2,), measure)
    assert calls == [(0,)] and result.levels == (0,)


def test_rejects_move_that_does_not_shorten_the_step():
    # x drops, but the computation slows more than the communication saves: z rises -> rejected
    def measure(levels):
        return [Trial(50, (100,), 150), Trial(90, (80,), 170)][levels[0]]

    result = priority_search((2,), measure)
    assert [s.decision for s in result.history] == [
        "start",
        "reject-no-gain",
    ] and result.levels == (0,)


def test_gallop_exact_sequence():
    x = [100, 90, 80, 70, 60, 50, 45, 47, 52, 60]
    measure, calls = lagom_cost(lambda lv: 10 + lv[0], (x,))
    result = priority_search((10,), measure, gallop=True)
    # steps 1, 2, 4 accepted; +8 clips to 9 and is slower -> step 1: 8 slower -> done at 7
    assert calls == [(0,), (1,), (3,), (7,), (9,), (8,)]
    assert result.levels == (7,)


def test_gallop_clipped_at_the_top_does_not_repeat_a_trial():
    measure, calls = lagom_cost(lambda lv: 10 + lv[0], ([100, 90, 80, 70, 75],))
    result = priority_search((5,), measure, gallop=True)
    assert calls == [(0,), (1,), (3,), (4,)] and result.levels == (3,)


def test_noise_tolerance_walks_through_a_bump_and_keeps_the_best_measured():
    measure, calls = lagom_cost(lambda lv: 10.0, ([100, 101, 80, 70, 90],))
    assert priority_search((5,), measure).levels == (0,) and calls == [
        (0,),
        (1,),
    ]  # Lagom as written
    measure, calls = lagom_cost(lambda lv: 10.0, ([100, 101, 80, 70, 90],))
    result = priority_search((5,), measure, tolerance=0.05)  # 101 is within 5% of 100: go on
    assert calls == [(0,), (1,), (2,), (3,), (4,)] and result.levels == (3,)
    assert [s.decision for s in result.history][-1] == "reject-slower"
    measure, calls = lagom_cost(lambda lv: 10.0, ([100, 80, 83, 95],))
    result = priority_search((4,), measure, tolerance=0.05)  # 83 accepted within noise, 80 kept
    assert calls == [(0,), (1,), (2,), (3,)] and result.levels == (1,) and result.trial.z_us == 80
    with pytest.raises(ValueError, match="tolerance"):
        priority_search((2,), measure, tolerance=1.5)


def test_measure_contract_is_checked():
    with pytest.raises(ValueError, match="communication times"):
        priority_search((2, 2), lambda levels: Trial(1.0, (1.0,), 1.0))
    with pytest.raises(ValueError, match="at least one level"):
        next(search_steps((2, 0)))


def test_trial_from_exposed():
    t = trial_from_exposed(100.0, [30.0, 1.0], 150.0, hidden_tol=0.02)
    assert t.x_us == (130.0, 1.0) and t.y_us == 100.0 and t.z_us == 150.0


# ----------------------------------------------------------------------------- H metric, CPU fit


def test_h_metric():
    before, after = Trial(100.0, (80.0, 5.0), 180.0), Trial(110.0, (60.0, 5.0), 170.0)
    assert h_metric(before, after, 0) == 0.5  # 10 us more computation for 20 us saved
    assert h_metric(before, after, 1) == math.inf  # x_1 did not drop
    assert h_metric(after, before, 0) == math.inf  # x_0 grew


def test_cpu_fit_recovers_known_coefficients():
    ns = [1, 2, 4, 8, 16, 32]
    y = [1000 + 7 * n for n in ns]
    e = [50 + 400 / n + 3 * n for n in ns]
    z = [a + b + 200 for a, b in zip(y, e)]
    fit = fit_cpu_ddp(ns, y, e, z)
    assert fit.compute.coef == pytest.approx((1000, 7))
    assert fit.exposed.coef == pytest.approx((50, 400, 3))
    assert fit.rest_us == pytest.approx(200) and fit.compute.r2 == pytest.approx(1.0)
    assert fit.predict_z_us(4) == pytest.approx(z[2])
    with pytest.raises(ValueError, match="at least 3"):
        fit_linear([[1, 1, 1], [1, 2, 3]], [1, 2], ("a", "b", "c"))
