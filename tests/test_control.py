"""Control policies on synthetic latencies and acceptance streams: no engine, answers known by hand."""

from __future__ import annotations

import functools
import random
from dataclasses import dataclass, field

import pytest

from tide.config import CollectConfig, RollbackConfig, SpeculationConfig
from tide.control import (
    CollectAction,
    CollectionGate,
    CollectState,
    Decision,
    LatencyModel,
    RollbackAction,
    RollbackGate,
    SpecAction,
    SpeculationGate,
    SpeculationObservation,
)
from tide.draft.acceptance import AcceptanceHistogram, PositionRates, RecentRates
from tide.serve.engine import step_costs

GAMMA = 3


def rates(*r: float, steps: int = 256) -> PositionRates:
    """`steps` drafting steps of length len(r) whose conditional position rates are r (to 1/steps)."""
    out, alive = PositionRates(len(r)), steps
    for j, x in enumerate(r):
        out.tried[j] = alive
        alive = round(alive * x)
        out.accepted[j] = alive
    return out


def flat(t: float = 0.030, d0: float = 0.0025, gamma: int = GAMMA) -> LatencyModel:
    return LatencyModel.flat(((1, t), (64, t)), d0, gamma)


def linear(a: float = 0.020, c: float = 0.001, d0: float = 0.002) -> LatencyModel:
    """T(n) = a + c n, given as points at 1, 8, 64 (extrapolated above 64)."""
    return LatencyModel.flat(tuple((n, a + c * n) for n in (64, 1, 8)), d0, GAMMA)


# ---------------------------------------------------------------- acceptance by position

def test_position_rates_count_what_each_step_tried() -> None:
    r = PositionRates(3)
    for k, a in ((1, 1), (3, 0), (3, 3)):
        r.add(k, a)
    assert (r.tried, r.accepted, r.steps) == ([3, 1, 1], [2, 1, 1], 3)
    assert r.rates() == pytest.approx([2 / 3, 1.0, 1.0])
    assert r.expected_length(1) == pytest.approx(1 + 2 / 3) and r.expected_length(3) == pytest.approx(1 + 3 * 2 / 3)


def test_rates_of_a_fixed_length_walk_and_of_untried_positions() -> None:
    h = AcceptanceHistogram(3, [2, 1, 0, 1])  # 4 steps of 3 drafts, accepted 0, 0, 1, 3
    r = PositionRates.from_histogram(h)
    assert r.tried == [4, 2, 1] and r.accepted == [2, 1, 1]
    assert r.expected_length(3) == pytest.approx(h.acceptance_length)  # the walk's own mean
    only_first = PositionRates(3, [100, 0, 0], [40, 0, 0])
    assert only_first.rates() == [0.4, 0.4, 0.4]  # an untried position takes the rate before it
    assert only_first.rates(-4)[0] < 0.4 < only_first.rates(+4)[0]


def test_recent_rates_keep_whole_windows_covering_the_steps_asked_for() -> None:
    """The gate's live evidence: windows of 80 drafting steps, 256 kept -> the newest 4 windows (the
    oldest of them is dropped only once the other three alone hold 256)."""
    live = RecentRates(1, keep_steps=256)
    for i in range(10):
        live.add(PositionRates(1, [80], [10 * i]))
    assert len(live.windows) == 4 and live.steps == 320
    assert live.merged().rates() == [pytest.approx((60 + 70 + 80 + 90) / 320)]
    live.add(PositionRates(1, [300], [0]))  # one window that alone holds enough
    assert len(live.windows) == 1
    live.clear()
    assert live.steps == 0 and live.merged().rates() == [1.0]


# ---------------------------------------------------------------- latency model and Eq. 5

def test_flat_latency_breaks_even_at_one_plus_k_d0_over_t() -> None:
    m = flat()
    for b in (1, 3.5, 8):
        for k in (1, 2, 3):
            assert m.break_even(b, k) == pytest.approx(1 + k * 0.0025 / 0.030)
            assert m.speedup(b, k, m.break_even(b, k)) == pytest.approx(1.0)
    assert m.speedup(1, 3, 1.8) == pytest.approx(1.8 / 1.25)


def test_linear_latency_raises_the_bar_with_batch() -> None:
    m = linear()
    # b 4: T(4) = 24 ms, verify 16 tokens T(16) = 36 ms: (3 * 2 + 36) / 24 = 1.75
    assert m.break_even(4, 3) == pytest.approx(1.75)
    # b 32: T(32) = 52 ms, T(128) = 148 ms (extrapolated): (6 + 148) / 52
    assert m.break_even(32, 3) == pytest.approx(154 / 52)
    bars = [m.break_even(b, 3) for b in (1, 2, 4, 8, 16, 32)]
    assert bars == sorted(bars)


def test_latencies_interpolate_extend_and_learn() -> None:
    m = LatencyModel({(1, 16): 0.036, (1, 1): 0.030}, {(1, 1): 0.002, (4, 1): 0.005, (1, 2): 0.0035}, gamma=3)
    assert m.target_latency(1, 8.5) == pytest.approx(0.033)
    assert m.target_latency(1, 31) == pytest.approx(0.042)  # last segment extended
    assert m.target_latency(1, 0.5) == 0.030  # flat below the first point
    assert m.target_latency(4) == pytest.approx(0.0312)  # above the measured batches: batch 1's cost of 4 tokens
    assert m.draft_latency(2.5, 1) == pytest.approx(0.0035)  # between the measured batches
    assert m.draft_latency(1, 2) == 0.0035 and m.draft_latency(1, 3) == pytest.approx(0.0035 * 3 / 2)
    assert m.draft_latency(4, 0) == 0.0 and m.step_cost(1, 0) == 0.030
    dip = LatencyModel({(1, 1): 0.030, (1, 4): 0.026, (1, 8): 0.029}, {}, 1)
    assert dip.target_latency(1, 4) == 0.026  # a measured dip is kept: some shapes do cost less on a CPU
    assert dip.target_latency(1, 100) == pytest.approx(0.029 + 0.003 / 4 * 92)  # the last segment, rising


def test_a_verify_step_is_priced_by_its_own_shape_not_by_its_token_count() -> None:
    """On a CPU a batch-4 decode (4 tokens) can cost less than a batch-1 decode while a batch-1 verify
    of 3 drafts (also 4 tokens) costs more: each shape keeps its own figure, and batches between the
    measured ones interpolate at the same tokens per sequence."""
    m = LatencyModel({(1, 1): 0.070, (1, 4): 0.080, (4, 4): 0.053, (4, 16): 0.090}, {(1, 1): 0.005}, gamma=3)
    assert m.break_even(1, 3) == pytest.approx((0.080 + 0.015) / 0.070)  # a useless draft at k 3: 0.74x, off
    assert m.target_latency(4) == 0.053
    assert m.target_latency(2) == pytest.approx(0.070 + (0.053 - 0.070) / 3)
    assert m.target_latency(2, 8) == pytest.approx(0.080 + (0.090 - 0.080) / 3)  # 4 tokens per sequence
    by_tokens = LatencyModel.flat(((1, 0.070), (4, 0.053), (16, 0.090)), 0.005, 3)  # the old table
    assert by_tokens.break_even(1, 3) < 1.0 < m.break_even(1, 3)


def test_a_profiled_verify_step_costs_at_least_a_plain_step_until_serving_measures_it() -> None:
    m = LatencyModel.profiled({"1,1": 0.056, "1,3": 0.047, "1,4": 0.060, "2,2": 0.062, "2,4": 0.050}, {}, 3)
    assert m.target == {(1, 1): 0.056, (1, 3): 0.056, (1, 4): 0.060, (2, 2): 0.062, (2, 4): 0.062}
    m.observe_target(1, 3, 0.050, steps=64)
    assert m.target_latency(1, 3) < m.target_latency(1, 1)  # measured: a dip is kept


def test_serving_calibrates_each_entry_then_refits_the_machine_speed() -> None:
    """An entry's first serving steps are its own figure (the profile was a weak prior); later, a trainer
    starting on the same cores slows plain steps (all the gate sees while speculation is off): every
    entry slows with them, so the cost of drafting relative to a plain step stays what it was."""
    m = LatencyModel({(4, 4): 0.010, (4, 8): 0.012}, {(4, 1): 0.002}, gamma=1)
    near = functools.partial(pytest.approx, rel=1e-3)
    m.observe_target(4, 8, 0.015, steps=16)  # verify steps cost more than profiled: half way, the profile is 16
    assert m.target_latency(4, 8) == pytest.approx(0.0135, rel=0.02) and m.scale == pytest.approx(1.0, abs=0.02)
    m.observe_target(4, 4, 0.010, steps=64)  # plain steps as profiled: both entries calibrated
    m.observe_target(4, 8, 0.015, steps=48)  # calibrated: the mean of the profile (16 steps) and 64 served
    ratio = (16 * 0.012 + 64 * 0.015) / 80 / 0.010
    assert m.target_latency(4, 8) / m.target_latency(4) == pytest.approx(ratio, rel=0.01)
    bar = m.break_even(4, 1)
    m.observe_target(4, 4, 0.020, steps=2000)  # the machine now runs at half the speed
    assert m.target_latency(4) == near(0.020) and m.target_latency(4, 8) == pytest.approx(0.020 * ratio, rel=0.01)
    assert m.break_even(4, 1) == pytest.approx(bar, rel=0.01)
    assert LatencyModel.from_json(m.to_json()) == m


def test_an_entry_first_seen_while_serving_starts_from_its_neighbours() -> None:
    """A batch the profile never ran (3 of a closed loop of 4) is priced from batches 2 and 4 and
    calibrates from there: one slow first step does not set its cost."""
    m = LatencyModel({(2, 2): 0.060, (4, 4): 0.090}, {(4, 1): 0.004}, gamma=1)
    m.observe_target(3, 3, 0.239)
    assert m.target[(3, 3)] == pytest.approx((16 * 0.075 + 0.239) / 17, rel=0.01)
    m.observe_target(3, 3, 0.080, steps=63)  # calibrated: the reading counts as 16 steps, the served 64
    assert m.target[(3, 3)] * m.scale == pytest.approx((16 * 0.075 + 0.239 + 63 * 0.080) / 80, rel=0.03)
    m.observe_draft(2, 1, 0.009)  # below the measured batches: batch 4's
    assert m.draft[(2, 1)] == pytest.approx((16 * 0.004 + 0.009 / m.scale) / 17, rel=0.01)
    fresh = LatencyModel({(1, 1): 0.05}, {}, gamma=1)
    fresh.observe_draft(1, 1, 0.003)
    assert fresh.draft_latency(1, 1) == pytest.approx(0.003)  # nothing to read: taken as it is


def test_a_windows_step_costs_refit_decode_and_verify_steps_and_leave_prefills_out() -> None:
    m = LatencyModel({(4, 4): 0.010, (4, 8): 0.012}, {}, gamma=1)
    m.observe_costs({"target": {"4,4": [2000, 40.0], "4,512": [3, 3.0]}, "draft": {"4,1": [10, 0.05]}},
                    most_tokens=8)
    # a window calibrating an entry is one moment of the machine: all its steps go into the running mean
    assert m.target_latency(4) == pytest.approx((16 * 0.010 + 2000 * 0.020) / 2016) and (4, 512) not in m.target
    assert m.draft_latency(4, 1) == pytest.approx(0.005)
    # the drafter's pass in a step with a prompt (over the prompt too) is no draft step's cost
    worker = [[520, 4, 1, 0.300, 0.020], [8, 4, 1, 0.015, 0.004]]  # n, b, k, target s, draft s
    assert step_costs(worker, [0.330, 0.020], most_tokens=8) == {
        "target": {"4,520": [1, pytest.approx(0.310)], "4,8": [1, pytest.approx(0.016)]}, "draft": {"4,1": [1, 0.004]}}


def test_the_machines_speed_moves_before_new_entries_calibrate_whatever_their_order() -> None:
    """A window in which the machine runs 20% slower serves calibrated plain steps and the first
    verify steps: the verify entry calibrates at the window's speed, so drafting costs what it did
    relative to a plain step, whichever entry the window lists first."""
    def model() -> LatencyModel:
        m = LatencyModel({(1, 1): 0.050, (1, 2): 0.055}, {(1, 1): 0.003}, gamma=1)
        m.observe_target(1, 1, 0.050, steps=64)  # calibrated, as profiled
        return m

    window = {"1,2": [500, 500 * 0.066], "1,1": [500, 500 * 0.060]}
    for order in (window, dict(reversed(window.items()))):
        m = model()
        m.observe_costs({"target": order}, most_tokens=4)
        assert m.scale == pytest.approx(1.2, rel=0.01)
        assert m.target_latency(1, 2) / m.target_latency(1) == pytest.approx(1.1, rel=0.01)


@pytest.mark.parametrize("kwargs, field_name", [
    (dict(target={}), "target"),
    (dict(target={(1, 1): 0.0}), "target"),
    (dict(target={(2, 1): 0.03}), "target"),
    (dict(draft={(1, 4): 0.001}), "draft"),
    (dict(gamma=0), "gamma"),
])
def test_bad_latency_model_names_the_field(kwargs: dict, field_name: str) -> None:
    args = dict(target={(1, 1): 0.03}, draft={(1, 1): 0.002}, gamma=3) | kwargs
    with pytest.raises(ValueError, match=f"LatencyModel.{field_name}"):
        LatencyModel(**args)


def test_bad_configs_name_the_field() -> None:
    with pytest.raises(ValueError, match="SpeculationConfig.margin_off = 1.5: must be in"):
        SpeculationConfig(margin_off=1.5)
    with pytest.raises(ValueError, match="CollectConfig.lambda_short/lambda_long"):
        CollectConfig(lambda_short=0.01, lambda_long=0.05)
    with pytest.raises(ValueError, match="RollbackConfig.fraction"):
        RollbackConfig(fraction=0.0)


# ---------------------------------------------------------------- speculation gate

NO_DWELL = SpeculationConfig(min_steps=100, min_dwell_steps=0, min_dwell_s=0.0)
OFF_AT_START = SpeculationConfig(min_steps=100, min_dwell_steps=0, min_dwell_s=0, start_enabled=False)


def obs(step: int, live: PositionRates | None = None, est: PositionRates | None = None, b: float = 1,
        t: float | None = None) -> SpeculationObservation:
    return SpeculationObservation(step, step * 0.05 if t is None else t, b, live=live, estimate=est)


def test_gate_turns_off_below_break_even_with_the_numbers_in_the_reason() -> None:
    gate = SpeculationGate(NO_DWELL, flat(gamma=1), max_batch=1)  # k 1 breaks even at 1.083
    d = gate.decide(obs(1, live=rates(0.10)))  # 1.10 / 1.083 = 1.015
    assert d.action is SpecAction.STAY and gate.enabled
    d = gate.decide(obs(2, live=rates(0.02)))  # 0.94
    assert d.action is SpecAction.DISABLE and not gate.enabled and gate.lengths == [0, 0]
    assert "live rates [0.02] over 256 steps, batch 1.0: predicted k0 1.00x, k1 0.94x" in d.reason
    assert d.reason.endswith("draft length by batch 1:0") and str(d).startswith("disable: live rates")


def test_gate_picks_the_draft_length_that_pays_most() -> None:
    """T 30 ms, a draft pass 2.5 ms, K 3 (the worked example of `decide`)."""
    gate = SpeculationGate(NO_DWELL, flat(), max_batch=1)
    assert gate.lengths == [0, 3]
    d = gate.decide(obs(1, live=rates(0.6, 0.5, 0.4)))  # k2 1.63x, k3 1.62x: down to the shorter, no margin
    assert d.action is SpecAction.RESIZE and gate.lengths == [0, 2]
    up = SpeculationGate(NO_DWELL, flat(), max_batch=1, lengths=[0, 1])
    assert up.decide(obs(1, live=rates(0.6, 0.5, 0.4))).action is SpecAction.RESIZE  # k1 1.48x: up for > 3%
    assert up.lengths == [0, 2]
    near_up = SpeculationGate(NO_DWELL, flat(), max_batch=1, lengths=[0, 1])
    assert near_up.decide(obs(1, live=rates(0.4, 0.27, 0.1))).action is SpecAction.STAY  # k2 alike: no move up
    d = gate.decide(obs(2, live=rates(0.5, 0.1, 0.1)))  # k1 1.38x, k2 1.33x, k3 1.24x
    assert d.action is SpecAction.RESIZE and gate.lengths == [0, 1] and "k1 1.38x" in d.reason
    assert gate.decide(obs(3, live=rates(0.9, 0.9, 0.9))).action is SpecAction.RESIZE and gate.lengths == [0, 3]
    assert gate.decide(obs(4, live=rates(0.02, 0.0, 0.0))).action is SpecAction.DISABLE
    near = SpeculationGate(NO_DWELL, flat(), max_batch=1)
    d = near.decide(obs(1, live=rates(0.4, 0.27, 0.1)))  # k1 1.29x, k2 1.29x, k3 1.21x
    assert d.action is SpecAction.RESIZE and near.lengths == [0, 1]  # the shorter of two that pay alike


def test_gate_waits_for_enough_steps() -> None:
    gate = SpeculationGate(NO_DWELL, flat(gamma=1), max_batch=1)
    d = gate.decide(obs(1, live=rates(0.02, steps=31)))  # a loss, but 31 steps are not even early_steps
    assert d.action is SpecAction.STAY and "31 < 100 steps" in d.reason and gate.enabled


def test_gate_decides_a_clear_case_early() -> None:
    slow = LatencyModel({(1, 1): 0.030, (1, 2): 0.045}, {(1, 1): 0.030}, 1)  # k 1 breaks even at (45 + 30) / 30 = 2.5
    gate = SpeculationGate(SpeculationConfig(min_steps=256, early_steps=32, min_dwell_steps=0, min_dwell_s=0),
                           slow, max_batch=1)
    assert gate.decide(obs(1, live=rates(0.0, steps=31))).action is SpecAction.STAY  # below early_steps
    d = gate.decide(obs(2, live=rates(0.0, steps=32)))
    assert d.action is SpecAction.DISABLE and "over 32 steps" in d.reason


def test_gate_turns_off_a_useless_cheap_draft_inside_the_band() -> None:
    """A draft that accepts nothing and costs 3% (break-even 1.03, inside the 5% band) is a sure
    loss once the evidence is tight; a draft near break-even with the usual spread is not."""
    cheap = flat(t=0.068, d0=0.002, gamma=1)
    gate = SpeculationGate(SpeculationConfig(min_dwell_steps=0, min_dwell_s=0), cheap, max_batch=1)
    assert gate.decide(obs(1, live=rates(0.0, steps=64))).action is SpecAction.STAY  # could still be 1.03
    assert gate.decide(obs(2, live=rates(0.0, steps=256))).action is SpecAction.DISABLE
    near = SpeculationGate(SpeculationConfig(min_dwell_steps=0, min_dwell_s=0), cheap, max_batch=1)
    assert near.decide(obs(1, live=rates(0.01, steps=256))).action is SpecAction.STAY


def test_gate_comes_back_on_from_a_held_out_walk() -> None:
    gate = SpeculationGate(OFF_AT_START, flat(gamma=1), max_batch=1)
    assert gate.decide(obs(1)).action is SpecAction.STAY  # nothing to go on
    assert gate.decide(obs(2, est=rates(0.15))).action is SpecAction.STAY  # 1.06x: not above 1.10
    d = gate.decide(obs(3, est=rates(0.25)))
    assert d.action is SpecAction.ENABLE and gate.lengths == [0, 1] and "held-out rates [0.25]" in d.reason


def test_probes_come_rarer_while_the_lengths_stand_and_often_again_after_a_change() -> None:
    gate = SpeculationGate(SpeculationConfig(probe_every=32, probe_max=256, min_dwell_steps=0, min_dwell_s=0),
                           flat(), max_batch=1)
    assert [gate.probe_gap(s) for s in (0, 63, 64, 127, 128, 255, 256, 10_000)] == [32, 32, 64, 64, 128, 128,
                                                                                   256, 256]
    assert gate.decide(obs(5000, live=rates(0.5, 0.1, 0.1))).action is SpecAction.RESIZE  # to k1
    assert gate.probe_gap(5000) == 32 and gate.probe_gap(5064) == 64
    two = SpeculationGate(SpeculationConfig(probe_every=32, probe_max=256, min_dwell_steps=0, min_dwell_s=0),
                          flat(), max_batch=2)
    assert two.decide(obs(5000, b=2, live=rates(0.5, 0.1, 0.1))).action is SpecAction.RESIZE
    assert two.probe_gap(5000) == 32  # the served batch size's length changed
    two.lengths[1] = 3  # another batch size's length moves (as a refit moves those not served)
    two.decide(obs(6000, b=2, live=rates(0.5, 0.1, 0.1)))
    assert two.lengths == [0, 1, 1] and two.probe_gap(6000) == 256
    assert SpeculationGate(SpeculationConfig(probe_every=0), flat(), max_batch=1).probe_gap(10_000) == 0
    with pytest.raises(ValueError, match="probe_max"):
        SpeculationConfig(probe_every=64, probe_max=32)


def test_draft_lengths_depend_on_batch() -> None:
    """Linear T: rates of 0.5 pay at batch 1-4 but not at 32, where verifying costs too much."""
    gate = SpeculationGate(NO_DWELL, linear(), max_batch=32)
    d = gate.decide(obs(1, live=rates(0.5, 0.5, 0.5), b=4))
    assert d.action is SpecAction.RESIZE and gate.length(1) > 0 and gate.length(4) > 0 and gate.length(32) == 0
    assert gate.decide(obs(2, live=rates(0.5, 0.5, 0.5), b=32)).action is SpecAction.STAY  # already 0 there


def test_gate_never_enables_when_even_perfect_drafts_cannot_pay() -> None:
    m = flat(t=0.010, d0=0.010)  # drafting k costs 1 + k: a perfect draft emits 1 + k
    gate = SpeculationGate(OFF_AT_START, m, max_batch=1)
    assert all(gate.decide(obs(i, est=rates(1.0, 1.0, 1.0))).action is SpecAction.STAY for i in range(100))


def test_hysteresis_does_not_flap_on_rates_oscillating_around_break_even() -> None:
    """K 1, break-even 1.083: rates alternate 0.06 / 0.11 (0.98x / 1.02x), inside [0.95, 1.10]."""
    stream = [0.083 + (0.025 if i % 2 else -0.025) for i in range(2000)]
    on = SpeculationGate(NO_DWELL, flat(gamma=1), max_batch=1)
    off = SpeculationGate(OFF_AT_START, flat(gamma=1), max_batch=1)
    for i, a in enumerate(stream):
        assert on.decide(obs(i, live=rates(a))).action is SpecAction.STAY
        assert off.decide(obs(i, est=rates(a))).action is SpecAction.STAY
    bare = SpeculationGate(SpeculationConfig(margin_off=0, margin_on=0, min_steps=100, min_dwell_steps=0,
                                             min_dwell_s=0), flat(gamma=1), max_batch=1)
    flips = sum(bare.decide(obs(i, live=rates(a), est=rates(a))).action is not SpecAction.STAY
                for i, a in enumerate(stream))
    assert flips > 1000  # without the band the same stream flips at nearly every window


def test_dwell_holds_a_change_for_steps_and_seconds() -> None:
    """Rates that cross both bars: the lengths change at most once per dwell (64 steps and 2 s)."""
    cfg = SpeculationConfig(min_steps=100)
    gate = SpeculationGate(cfg, flat(gamma=1), max_batch=1)
    assert gate.decide(obs(10, live=rates(0.0), t=5.0)).action is SpecAction.STAY  # 5 s but only 10 steps
    gate = SpeculationGate(cfg, flat(gamma=1), max_batch=1)
    assert gate.decide(obs(64, live=rates(0.0), t=1.0)).action is SpecAction.STAY  # 64 steps but only 1 s
    assert gate.decide(obs(65, live=rates(0.0), t=2.0)).action is SpecAction.DISABLE
    d = gate.decide(obs(100, est=rates(0.8), t=10.0))
    assert d.action is SpecAction.STAY and "only 35 steps / 8.0 s since the last change" in d.reason
    assert gate.decide(obs(129, est=rates(0.8), t=10.0)).action is SpecAction.ENABLE
    rng, changes = random.Random(0), []
    for i in range(130, 5000):
        a = rates(rng.choice([0.0, 0.8]))
        if gate.decide(obs(i, live=a, est=a, t=i * 0.05)).action is not SpecAction.STAY:
            changes.append(i)
    assert changes and min(b - a for a, b in zip(changes, changes[1:])) >= 64


# ---------------------------------------------------------------- collection gate

# The logic tests below use epsilons twice the defaults on streams twice as wide (levels ~1.8 with
# sigma 0.1-0.3, the scale of a mean acceptance length); the defaults' own claim has a test of its own.
WIDE = dict(epsilon=0.2, drift_epsilon=0.25)
SMALL = CollectConfig(n_threshold=4096, **WIDE)  # 16 requests of 256 stored tokens


@dataclass
class Trace:
    """What a gate did on a stream: request index of every non-WAIT action."""

    events: list[tuple[int, CollectAction]] = field(default_factory=list)
    decisions: list[Decision] = field(default_factory=list)

    def at(self, action: CollectAction) -> list[int]:
        return [i for i, a in self.events if a is action]


def drive(gate: CollectionGate, al_of, n: int, tokens: int = 256, train_delay: int = 5,
          result=lambda i: (1, 9.0, 1.0)) -> Trace:
    """Feed n requests; al_of(i, deployed) gives request i's AL given the number of deploys so far.
    While collecting each request stores `tokens`; a TRAIN is answered `train_delay` requests later
    with result(i) = (version, new_al, live_al)."""
    trace, due, deployed = Trace(), None, 0
    for i in range(n):
        ds = [gate.on_request(al_of(i, deployed))]
        if gate.collecting:
            ds.append(gate.on_stored(tokens))
        if due == i:
            ds.append(gate.on_trained(*result(i)))
            due = None
        for d in ds:
            trace.decisions.append(d)
            if d.action is not CollectAction.WAIT:
                trace.events.append((i, d.action))
            if d.action is CollectAction.TRAIN:
                due = i + train_delay
            if d.action is CollectAction.DEPLOY:  # as the coordinator does: the regime trains on
                deployed += 1
                ds.append(gate.next_cycle())
    return trace


def noisy(level, sigma: float, seed: int = 0):
    rng = random.Random(seed)
    return lambda i, deployed: level(i, deployed) + rng.gauss(0, sigma)


def test_warm_up_sets_both_emas_to_the_mean_then_updates_them() -> None:
    gate = CollectionGate(CollectConfig(n_init=4))
    for al in (1.0, 2.0, 3.0):
        assert "warming up" in gate.on_request(al).reason and gate.warming_up
    assert "baseline 2.50" in gate.on_request(4.0).reason
    assert gate.short == gate.long == gate.baseline == 2.5
    gate.on_request(1.5)
    assert gate.short == pytest.approx(2.5 - 0.05) and gate.long == pytest.approx(2.5 - 0.01)


def test_worked_example_collects_on_the_sixth_request_after_a_drop() -> None:
    gate = CollectionGate(CollectConfig(n_init=1, **WIDE))
    gate.on_request(2.0)
    decisions = [gate.on_request(1.0) for _ in range(6)]
    assert [d.action for d in decisions] == [CollectAction.WAIT] * 5 + [CollectAction.COLLECT]
    assert f"short EMA {1 + 0.95**6:.2f} < long {1 + 0.99**6:.2f}" in decisions[-1].reason
    assert gate.warming_up  # the new level is learnt from the next n_init requests


def test_speculation_turned_off_far_below_the_long_ema_is_a_shift() -> None:
    """With speculation off no request moves the EMAs: the live steps that turned it off are the
    evidence. Off near the long EMA is a draft that stopped paying, not a new workload."""
    gate = CollectionGate(CollectConfig(n_init=1, epsilon=0.1))
    assert "no baseline yet" in gate.on_speculation_off(0.04).reason
    gate.on_request(0.27)
    assert gate.on_speculation_off(0.22).action is CollectAction.WAIT and not gate.warming_up
    d = gate.on_speculation_off(0.04)
    assert d.action is CollectAction.COLLECT and "0.04 < long EMA 0.27 - 0.1" in d.reason and gate.warming_up
    gate.on_request(0.27)
    gate.on_stored(gate.cfg.n_threshold)  # TRAIN: a shift now waits for the cycle's answer
    assert gate.on_speculation_off(0.04).action is CollectAction.WAIT and gate.shifted
    assert gate.on_trained(2, 1.3, 1.35).action is CollectAction.COLLECT  # the new regime starts at the answer


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("sigma", [0.1, 0.3])
def test_stable_stream_never_collects(seed: int, sigma: float) -> None:
    trace = drive(CollectionGate(CollectConfig(**WIDE)), noisy(lambda i, d: 1.8, sigma, seed), 10_000)
    assert trace.events == []


@pytest.mark.parametrize("seed", range(3))
def test_the_defaults_hold_a_stable_acceptance_and_catch_a_halving(seed: int) -> None:
    """First-draft acceptance 0.6 with sigma 0.15 a request: no false shift in 10,000 requests; a
    drop to 0.3 is caught within ~15 (CollectConfig's reasoning)."""
    trace = drive(CollectionGate(CollectConfig()), noisy(lambda i, d: 0.6, 0.15, seed), 10_000)
    assert trace.events == []
    trace = drive(CollectionGate(CollectConfig()), noisy(lambda i, d: 0.6 if i < 200 else 0.3, 0.15, seed), 300)
    (c, *_) = trace.at(CollectAction.COLLECT)
    assert 200 < c <= 220


def test_abrupt_shift_collects_trains_on_while_cycles_gain_then_settles() -> None:
    """AL 1.8 until request 200, then 1.2 until a new draft is deployed, then 1.75. Cycles gain
    0.5, then 0.1, then nothing: two deploys, then a plateau ends the regime."""
    level = lambda i, deployed: 1.75 if deployed else (1.8 if i < 200 else 1.2)
    gains = iter([(7, 1.70, 1.20), (8, 1.80, 1.70), (9, 1.80, 1.80)])
    trace = drive(CollectionGate(SMALL), noisy(level, 0.1), 1000, result=lambda i: next(gains))
    (c,) = trace.at(CollectAction.COLLECT)
    assert 200 < c <= 200 + 15  # ~12 requests for a 0.6 drop
    t1, t2, t3 = trace.at(CollectAction.TRAIN)
    assert t1 == c + 15  # 16 requests x 256 tokens = 4096 = n_threshold (the COLLECT request stores too)
    d1, d2 = trace.at(CollectAction.DEPLOY)
    assert (d1, t2, d2, t3) == (t1 + 5, t1 + 5, t2 + 5, t2 + 5)  # each deploy trains on at once
    (r,) = trace.at(CollectAction.REJECT)
    assert r == t3 + 5
    deploy = next(x for x in trace.decisions if x.action is CollectAction.DEPLOY)
    assert deploy.version == 7 and "eval AL 1.70 > live draft 1.20 + 0.02" in deploy.reason
    assert "a plateau" in next(x.reason for x in trace.decisions if x.action is CollectAction.REJECT)
    assert len(trace.events) == 7  # the new level (1.75) becomes the baseline: nothing after


def test_gradual_drift_eventually_collects() -> None:
    level = lambda i, d: 1.8 - 0.6 * min(max(i - 200, 0) / 150, 1.0)  # 0.004 AL/request from 200 to 350
    trace = drive(CollectionGate(SMALL), noisy(level, 0.1), 1000, result=lambda i: (1, 1.0, 1.2))
    (c, *_) = trace.at(CollectAction.COLLECT)
    assert 200 < c < 350  # while the drift is still going on; the EMA gap tends to 80 x 0.004 = 0.32
    assert "workload shifted" in next(x.reason for x in trace.decisions if x.action is CollectAction.COLLECT)


def test_slow_drift_is_caught_by_the_baseline_and_only_by_it() -> None:
    level = lambda i, d: 1.8 - 0.5 * min(i / 3000, 1.0)  # 0.00017 AL/request: the EMA gap stays ~0.013
    trace = drive(CollectionGate(SMALL), noisy(level, 0.1), 4000, result=lambda i: (1, 1.0, 1.2))
    (c, *_) = trace.at(CollectAction.COLLECT)
    assert "slow drift" in next(x.reason for x in trace.decisions if x.action is CollectAction.COLLECT)
    assert c > 1500  # 0.25 below the baseline (+ the long EMA's lag of ~100 requests)
    ema_only = drive(CollectionGate(CollectConfig(n_threshold=4096, epsilon=0.2, drift_epsilon=0)),
                     noisy(level, 0.1), 4000)
    assert ema_only.events == []


def test_recurring_domains_collect_at_each_shift() -> None:
    """Domains A, B, A (300 requests each). A draft is good (1.8) on the domain of the last deployed
    training run and poor (1.2) elsewhere; it starts trained on A and each deploy flips it."""
    def level(i: int, deployed: int) -> float:
        domain = "ABA"[min(i // 300, 2)]
        draft = "AB"[deployed % 2]
        return 1.8 if domain == draft else 1.2
    cycles = iter(range(10_000))  # a regime's first cycle gains, its second does not: one deploy a regime
    trace = drive(CollectionGate(SMALL), noisy(level, 0.1), 900,
                  result=lambda i: (i, 1.75, 1.2 if next(cycles) % 2 == 0 else 1.75))
    collects, deploys = trace.at(CollectAction.COLLECT), trace.at(CollectAction.DEPLOY)
    assert len(collects) == 2 and len(deploys) == 2
    assert 300 < collects[0] <= 315 and 600 < collects[1] <= 615
    assert all(c < d < c + 30 for c, d in zip(collects, deploys))


def test_rejected_draft_stops_collection_until_the_next_shift() -> None:
    # 1.8 -> 1.2 at 200 -> 0.8 at 700; every new draft is no better than the live one: rejected
    level = lambda i, d: 1.8 if i < 200 else (1.2 if i < 700 else 0.8)
    trace = drive(CollectionGate(SMALL), noisy(level, 0.1), 1000, result=lambda i: (3, 1.15, 1.20))
    collects, rejects = trace.at(CollectAction.COLLECT), trace.at(CollectAction.REJECT)
    assert trace.at(CollectAction.DEPLOY) == [] and len(collects) == len(rejects) == 2
    assert 200 < collects[0] < rejects[0] < 250  # collected, trained, rejected
    assert 700 < collects[1] <= 730  # nothing in between: idle at 1.2 until the next shift (0.4 AL)


def test_equal_eval_is_rejected_and_min_gain_raises_the_bar() -> None:
    def trained(cfg: CollectConfig, new: float, live: float) -> CollectAction:
        gate = CollectionGate(cfg)
        gate.state = CollectState.TRAINING
        return gate.on_trained(2, new, live).action
    assert trained(CollectConfig(min_gain=0), 1.5, 1.5) is CollectAction.REJECT
    assert trained(CollectConfig(min_gain=0), 1.51, 1.5) is CollectAction.DEPLOY
    assert trained(CollectConfig(), 1.51, 1.5) is CollectAction.CHAIN  # min_gain 0.02: not deployed, still rising
    assert trained(CollectConfig(), 1.503, 1.5) is CollectAction.REJECT  # min_rise 0.005: not even that
    assert trained(CollectConfig(), 1.53, 1.5) is CollectAction.DEPLOY


def test_a_chain_trains_on_from_each_draft_that_still_rises_until_one_beats_the_live_draft() -> None:
    """The docstring's example: a cycle that rises over its own start by min_rise but not over the
    live draft by min_gain chains (the next cycle at once, from it, no miss counted); the rises add
    up to a deploy; a cycle that rises over neither is the plateau."""
    gate = CollectionGate(CollectConfig(n_init=1, n_threshold=100))
    gate.collect_now("start")
    assert gate.on_stored(100).action is CollectAction.TRAIN
    chain = gate.on_trained(1, 1.41, 1.40)
    assert chain.action is CollectAction.CHAIN and chain.version == 1 and "train on from v1" in chain.reason
    assert gate.next_cycle().action is CollectAction.TRAIN  # at once: no new rows needed
    assert gate.on_trained(2, 1.418, 1.40, base_al=1.41).action is CollectAction.CHAIN and gate.misses == 0
    assert gate.next_cycle().action is CollectAction.TRAIN
    assert gate.on_trained(3, 1.43, 1.40, base_al=1.418).action is CollectAction.DEPLOY
    assert gate.next_cycle().action is CollectAction.TRAIN
    assert gate.on_trained(4, 1.43, 1.43).action is CollectAction.REJECT and not gate.collecting


def test_training_failure_retries_with_backoff_and_stale_results_are_ignored() -> None:
    gate = CollectionGate(CollectConfig(n_init=1, n_threshold=100))
    assert gate.on_trained(1, 3.0, 1.0).action is CollectAction.WAIT  # nobody asked
    assert gate.on_stored(500).action is CollectAction.WAIT and gate.stored_tokens == 0  # idle: not counted
    gate.on_request(2.0)
    while gate.on_request(1.0).action is not CollectAction.COLLECT:
        pass
    assert gate.on_stored(60).action is CollectAction.WAIT
    assert gate.on_stored(60).action is CollectAction.TRAIN and gate.state is CollectState.TRAINING
    assert gate.on_stored(60).action is CollectAction.WAIT  # TRAIN is emitted once
    assert "will retry after 100 more rows" in gate.on_training_failed("trainer rank died").reason and gate.collecting
    assert gate.on_stored(99).action is CollectAction.WAIT  # 180 + 99 < 180 + 100
    assert gate.on_stored(1).action is CollectAction.TRAIN
    for backoff in (200, 400, 800, 1600, 1600):  # doubling, at most MAX_BACKOFF x n_threshold
        assert f"after {backoff} more rows" in gate.on_training_failed("CUDA OOM").reason
        assert gate.on_stored(backoff - 1).action is CollectAction.WAIT
        assert gate.on_stored(1).action is CollectAction.TRAIN
    assert gate.on_trained(4, 1.9, 1.2).action is CollectAction.DEPLOY and gate.failures == 0
    assert gate.collecting and gate.next_cycle().action is CollectAction.TRAIN  # the regime trains on
    assert gate.on_trained(5, 1.9, 1.9).action is CollectAction.REJECT  # a plateau ends it
    assert not gate.collecting and gate.warming_up and gate.next_cycle().action is CollectAction.WAIT


def test_patience_holds_the_live_draft_and_trains_again_on_new_rows() -> None:
    """patience 2: a cycle without min_gain keeps the live draft and the regime, which trains again as
    soon as rows the cycle did not see are stored; a miss counts only n_threshold rows after the last
    counted one, so the regime ends after two counted misses in a row, not after two cycles."""
    gate = CollectionGate(CollectConfig(n_init=1, n_threshold=100, patience=2))
    assert gate.collect_now("start").action is CollectAction.COLLECT
    assert gate.on_stored(100).action is CollectAction.TRAIN
    hold = gate.on_trained(1, 1.402, 1.40)  # under min_gain over the live draft and min_rise over its start
    assert hold.action is CollectAction.HOLD and "1 of 2 in a row" in hold.reason and gate.collecting
    assert gate.on_stored(0).action is CollectAction.WAIT  # no row it has not seen
    assert gate.on_stored(1).action is CollectAction.TRAIN  # one is enough: the trainer does not wait
    hold = gate.on_trained(2, 1.40, 1.40)  # 1 row beyond the counted miss: not a second one
    assert hold.action is CollectAction.HOLD and "1 of 2" in hold.reason and "after 99 more rows" in hold.reason
    assert gate.on_stored(50).action is CollectAction.TRAIN
    assert gate.on_trained(3, 1.50, 1.40).action is CollectAction.DEPLOY and gate.misses == 0
    assert gate.next_cycle().action is CollectAction.TRAIN  # on 151 rows
    assert gate.on_trained(4, 1.50, 1.50).action is CollectAction.HOLD
    assert gate.on_stored(60).action is CollectAction.TRAIN  # 211 rows: 60 beyond the counted miss
    assert gate.on_trained(5, 1.49, 1.50).action is CollectAction.HOLD
    assert gate.on_stored(40).action is CollectAction.TRAIN  # 251: 100 beyond it
    assert gate.on_trained(6, 1.49, 1.50).action is CollectAction.REJECT and not gate.collecting


def test_rows_stored_while_a_cycle_trains_start_the_next_at_once_after_a_hold() -> None:
    gate = CollectionGate(CollectConfig(n_init=1, n_threshold=100, patience=3))
    gate.collect_now("start")
    assert gate.on_stored(100).action is CollectAction.TRAIN
    assert gate.on_stored(30).action is CollectAction.WAIT  # stored while the cycle trains
    assert gate.on_trained(1, 1.40, 1.40).action is CollectAction.HOLD
    assert gate.on_stored(0).action is CollectAction.TRAIN  # what the coordinator asks after a HOLD


def test_a_shift_during_a_regime_starts_a_new_one() -> None:
    """Continuous learning from the start keeps a regime open; a shift must still start a new one
    (its cycles then learn the new workload only): at once while collecting, and after the answer
    of the cycle in flight while training."""
    def shifted(gate: CollectionGate, level: float) -> Decision[CollectAction]:
        for _ in range(200):
            d = gate.on_request(level)
            if d.action is not CollectAction.WAIT or "workload shifted" in d.reason:
                return d
        raise AssertionError("no shift seen")

    gate = CollectionGate(CollectConfig(n_init=4, n_threshold=100, epsilon=0.2))
    assert gate.collect_now("start").action is CollectAction.COLLECT
    for _ in range(4):
        gate.on_request(1.8)
    gate.on_stored(60)
    d = shifted(gate, 1.0)  # collecting: a new regime at once, its rows counted from zero
    assert d.action is CollectAction.COLLECT and "workload shifted" in d.reason and gate.stored_tokens == 0
    for _ in range(4):
        gate.on_request(1.0)
    assert gate.on_stored(100).action is CollectAction.TRAIN
    d = shifted(gate, 0.4)  # training: wait for the cycle in flight
    assert d.action is CollectAction.WAIT and "while a cycle trains" in d.reason
    d = gate.on_trained(5, 1.2, 1.0)  # it learnt the old workload: deployed, then a new regime
    assert d.action is CollectAction.DEPLOY
    assert gate.next_cycle().action is CollectAction.COLLECT and gate.stored_tokens == 0
    assert gate.on_stored(100).action is CollectAction.TRAIN
    for _ in range(4):
        gate.on_request(0.4)
    shifted(gate, 0.0)
    d = gate.on_trained(6, 0.4, 0.4)  # no gain: the live draft stays and the new regime starts
    assert d.action is CollectAction.COLLECT and "during the cycle" in d.reason
    assert gate.state is CollectState.COLLECTING


def test_untrained_draft_collects_on_request_and_nan_is_ignored() -> None:
    gate = CollectionGate(CollectConfig(n_init=2, n_threshold=100))
    assert gate.on_request(float("nan")).reason == "request acceptance nan ignored" and gate._first == []
    d = gate.collect_now("untrained draft v0")
    assert (d.action, d.reason) == (CollectAction.COLLECT, "untrained draft v0") and gate.collecting
    assert gate.collect_now("again").action is CollectAction.WAIT
    assert gate.on_stored(100).action is CollectAction.TRAIN


# ---------------------------------------------------------------- rollback

def watched(held_out: float = 0.55, previous: int | None = 2) -> RollbackGate:
    gate = RollbackGate(RollbackConfig(), GAMMA)
    gate.watch(3, held_out, previous)
    return gate


def test_good_draft_is_confirmed() -> None:
    gate = watched()
    d = gate.decide(rates(0.45, 0.4, 0.3))
    assert (d.action, d.version) == (RollbackAction.CONFIRM, 3) and not gate.watching
    assert gate.decide(rates(0.0, 0.0, 0.0)).action is RollbackAction.WAIT  # judged: no longer watching


def test_corrupted_draft_rolls_back_with_the_numbers() -> None:
    gate = watched()
    d = gate.decide(rates(0.02, 0.0, 0.0))
    assert (d.action, d.version) == (RollbackAction.ROLLBACK, 2)
    assert d.reason == ("live first-draft acceptance 0.02 < 0.33 = 0.60 x held-out 0.55 over 256 steps: "
                        "v3 back to v2")


def test_not_enough_evidence_waits_then_judges_the_whole_window() -> None:
    gate = watched()
    assert gate.decide(rates(0.0, 0.0, 0.0, steps=100)).action is RollbackAction.WAIT
    d = gate.decide(rates(0.0, 0.0, 0.0, steps=100))
    assert d.action is RollbackAction.WAIT and "200/256 steps" in d.reason
    assert gate.decide(rates(0.0, 0.0, 0.0, steps=56)).action is RollbackAction.ROLLBACK


def test_the_bar_does_not_move_with_the_draft_length() -> None:
    """The same draft drafting 1 or 3 tokens a step has the same first-draft acceptance."""
    assert watched().decide(PositionRates(3, [256, 0, 0], [115, 0, 0])).action is RollbackAction.CONFIRM  # k 1
    assert watched().decide(rates(0.45, 0.2, 0.1)).action is RollbackAction.CONFIRM  # k 3


def test_a_draft_that_wins_offline_but_loses_live_to_the_one_it_replaced_goes_back() -> None:
    """The bar is also the replaced draft's live first-draft acceptance on the same traffic, less
    previous_margin (0.1): 0.45 live before the swap -> 0.35, above 0.6 x 0.55 = 0.33."""
    gate = RollbackGate(RollbackConfig(), GAMMA)
    gate.watch(3, 0.55, 2, previous_live=0.45)
    d = gate.decide(rates(0.34, 0.3, 0.2))
    assert (d.action, d.version) == (RollbackAction.ROLLBACK, 2)
    assert d.reason == "live first-draft acceptance 0.34 < 0.35 = v2's live 0.45 - 0.1 over 256 steps: v3 back to v2"
    gate.watch(3, 0.55, 2, previous_live=0.45)
    assert gate.decide(rates(0.36, 0.3, 0.2)).action is RollbackAction.CONFIRM
    gate.watch(3, 0.55, 2, previous_live=0.30)  # a weak predecessor does not lower the held-out bar
    assert gate.decide(rates(0.32, 0.3, 0.2)).action is RollbackAction.ROLLBACK


def test_rollback_without_an_earlier_draft_turns_speculation_off() -> None:
    gate = watched(previous=None)
    d = gate.decide(rates(0.0, 0.0, 0.0))
    assert d.action is RollbackAction.ROLLBACK and d.version is None and "speculation off" in d.reason
