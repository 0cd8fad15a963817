"""Control policies on synthetic profiles and acceptance streams: no engine, answers known by hand."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import pytest

from tide.config import CollectConfig, RollbackConfig, SpeculationConfig
from tide.control import (
    CollectAction,
    CollectionGate,
    CollectState,
    Decision,
    LatencyProfile,
    RollbackAction,
    RollbackGate,
    SpecAction,
    SpeculationGate,
    SpeculationObservation,
)
from tide.draft.acceptance import AcceptanceHistogram

GAMMA = 3


def hist(al: float, steps: int, gamma: int = GAMMA) -> AcceptanceHistogram:
    """`steps` drafting steps whose mean acceptance length is `al` (to 1/steps)."""
    accepted = round((al - 1) * steps)
    lo, n_hi = divmod(accepted, steps)
    h = AcceptanceHistogram(gamma)
    h.add(lo, steps - n_hi)
    if n_hi:
        h.add(lo + 1, n_hi)
    return h


def flat(t: float = 0.030, d0: float = 0.0025) -> LatencyProfile:
    return LatencyProfile(((1, t), (64, t)), draft_step_s=d0, gamma=GAMMA)


def linear(a: float = 0.020, c: float = 0.001, d0: float = 0.002) -> LatencyProfile:
    """T(n) = a + c n, given as points at 1, 8, 64 (extrapolated above 64)."""
    return LatencyProfile(tuple((n, a + c * n) for n in (64, 1, 8)), draft_step_s=d0, gamma=GAMMA)


# ---------------------------------------------------------------- profile and Eq. 5

def test_hist_helper_hits_the_requested_al() -> None:
    assert hist(1.25, 256).acceptance_length == 1.25 and hist(2.5, 10).acceptance_length == 2.5


def test_flat_latency_breaks_even_at_one_plus_gamma_d0_over_t() -> None:
    p = flat()
    for b in (1, 3.5, 8, 200):
        assert p.min_acceptance(b) == pytest.approx(1 + 3 * 0.0025 / 0.030)  # 1.25
        assert p.predicted_speedup(p.min_acceptance(b), b) == pytest.approx(1.0)
    assert p.predicted_speedup(1.8, 1) == pytest.approx(1.8 / 1.25)


def test_linear_latency_raises_the_bar_with_batch() -> None:
    p = linear()
    # b 4: T(4) = 24 ms, verify 16 tokens T(16) = 36 ms: (3 * 2 + 36) / 24 = 1.75
    assert p.min_acceptance(4) == pytest.approx(1.75)
    # b 32: T(32) = 52 ms, T(128) = 148 ms (extrapolated): (6 + 148) / 52
    assert p.min_acceptance(32) == pytest.approx(154 / 52)
    # larger than a flat profile at the same T(b): verification is no longer free
    assert p.min_acceptance(4) > 1 + 3 * 0.002 / 0.024
    bars = [p.min_acceptance(b) for b in (1, 2, 4, 8, 16, 32)]
    assert bars == sorted(bars)


def test_target_latency_interpolates_and_extends() -> None:
    p = LatencyProfile(((16, 0.036), (1, 0.030)), draft_step_s=0.0, gamma=GAMMA)
    assert p.points == ((1, 0.030), (16, 0.036))  # sorted
    assert p.target_latency(8.5) == pytest.approx(0.033)
    assert p.target_latency(31) == pytest.approx(0.042)  # last segment extended
    assert p.target_latency(0.5) == 0.030  # flat below the first point
    dip = LatencyProfile(((1, 0.030), (8, 0.029)), draft_step_s=0.0, gamma=GAMMA)
    assert dip.target_latency(100) == 0.029  # a measured dip never extrapolates downwards
    assert LatencyProfile.from_json(p.to_json()) == p


@pytest.mark.parametrize("kwargs, field_name", [
    (dict(points=()), "points"),
    (dict(points=((1, 0.03), (1, 0.04))), "points"),
    (dict(points=((1, 0.0),)), "points"),
    (dict(draft_step_s=-1.0), "draft_step_s"),
    (dict(gamma=0), "gamma"),
])
def test_bad_profile_names_the_field(kwargs: dict, field_name: str) -> None:
    args = dict(points=((1, 0.03),), draft_step_s=0.002, gamma=3) | kwargs
    with pytest.raises(ValueError, match=f"LatencyProfile.{field_name}"):
        LatencyProfile(**args)


def test_bad_configs_name_the_field() -> None:
    with pytest.raises(ValueError, match="SpeculationConfig.margin_off = 1.5: must be in"):
        SpeculationConfig(margin_off=1.5)
    with pytest.raises(ValueError, match="CollectConfig.lambda_short/lambda_long"):
        CollectConfig(lambda_short=0.01, lambda_long=0.05)
    with pytest.raises(ValueError, match="RollbackConfig.fraction"):
        RollbackConfig(fraction=0.0)


# ---------------------------------------------------------------- speculation gate

NO_DWELL = SpeculationConfig(min_steps=100, min_dwell_steps=0, min_dwell_s=0.0)


def obs(step: int, live: float | None = None, est: float | None = None, b: float = 4, n: int = 256,
        t: float | None = None) -> SpeculationObservation:
    return SpeculationObservation(step, step * 0.05 if t is None else t, b,
                                  live=None if live is None else hist(live, n),
                                  estimate=None if est is None else hist(est, n))


def test_gate_turns_off_below_break_even_with_the_numbers_in_the_reason() -> None:
    gate = SpeculationGate(NO_DWELL, flat())  # break-even 1.25; off below 1.1875
    d = gate.decide(obs(1, live=1.30))
    assert d.action is SpecAction.STAY and gate.enabled
    d = gate.decide(obs(2, live=1.15))
    assert d.action is SpecAction.DISABLE and not gate.enabled
    assert "live AL 1.15 < 1.19" in d.reason and "break-even 1.25 at batch 4.0" in d.reason
    assert str(d).startswith("disable: live AL 1.15")


def test_gate_waits_for_enough_steps() -> None:
    gate = SpeculationGate(NO_DWELL, flat())
    d = gate.decide(obs(1, live=1.15, n=99))  # 0.04 under the bar: not clear after 99 steps
    assert d.action is SpecAction.STAY and "99 < 100 steps" in d.reason and gate.enabled


def test_gate_decides_a_clear_case_early() -> None:
    slow = LatencyProfile(((1, 0.030), (4, 0.045)), 0.010, 3)  # break-even at batch 1: (.03 + .045) / .03 = 2.5
    gate = SpeculationGate(SpeculationConfig(min_steps=256, early_steps=32, min_dwell_steps=0, min_dwell_s=0), slow)
    assert gate.decide(obs(1, live=1.0, b=1, n=31)).action is SpecAction.STAY  # below early_steps
    d = gate.decide(obs(2, live=1.0, b=1, n=32))  # AL 1.0 vs bar 2.375: 1.4 AL away, se 0.09
    assert d.action is SpecAction.DISABLE and "over 32 steps" in d.reason


def test_gate_turns_off_a_useless_cheap_draft_inside_the_band() -> None:
    """A draft that accepts nothing and costs 3% (break-even 1.03, inside the 5% band) is a sure
    loss once the evidence is tight; a draft near break-even with the usual spread is not."""
    cheap = LatencyProfile(((1, 0.068), (8, 0.068)), draft_step_s=0.002, gamma=1)  # break-even 1.03
    gate = SpeculationGate(SpeculationConfig(min_dwell_steps=0, min_dwell_s=0), cheap)
    useless = lambda n: SpeculationObservation(n, 10.0, 1, live=hist(1.0, n, gamma=1))  # noqa: E731
    assert gate.decide(useless(64)).action is SpecAction.STAY  # 4/64 wide: could still be 1.03
    d = gate.decide(useless(256))
    assert d.action is SpecAction.DISABLE and "standard errors" in d.reason
    near = SpeculationGate(SpeculationConfig(min_dwell_steps=0, min_dwell_s=0), cheap)
    assert near.decide(SpeculationObservation(256, 10.0, 1, live=hist(1.01, 256, gamma=1))).action is SpecAction.STAY


def test_gate_comes_back_on_from_a_held_out_estimate() -> None:
    off_at_start = SpeculationConfig(min_steps=100, min_dwell_steps=0, min_dwell_s=0, start_enabled=False)
    gate = SpeculationGate(off_at_start, flat())
    o = lambda al: SpeculationObservation(1, 1.0, 4, estimate_al=al)  # noqa: E731
    assert gate.decide(o(1.30)).action is SpecAction.STAY  # on bar 1.375
    d = gate.decide(o(1.60))
    assert d.action is SpecAction.ENABLE and "held-out AL 1.60 > 1.38" in d.reason


def test_gate_comes_back_on_from_an_estimate() -> None:
    gate = SpeculationGate(NO_DWELL, flat())
    assert gate.decide(obs(1, live=1.05)).action is SpecAction.DISABLE
    d = gate.decide(obs(2))  # off: no live AL and no estimate yet
    assert d.action is SpecAction.STAY and "not enough evidence" in d.reason
    assert gate.decide(obs(3, est=1.35)).action is SpecAction.STAY  # above break-even, not above 1.375
    d = gate.decide(obs(4, est=1.60))
    assert d.action is SpecAction.ENABLE and gate.enabled and "estimated AL 1.60 > 1.38" in d.reason


def test_break_even_depends_on_batch() -> None:
    """Linear T: AL 1.9 pays at batch 4 (bar 1.75) but not at batch 32 (bar 2.96)."""
    gate = SpeculationGate(NO_DWELL, linear())
    assert gate.decide(obs(1, live=1.9, b=4)).action is SpecAction.STAY
    assert gate.decide(obs(2, live=1.9, b=32)).action is SpecAction.DISABLE


def test_gate_never_enables_when_even_perfect_drafts_cannot_pay() -> None:
    p = flat(t=0.010, d0=0.010)  # break-even 1 + 3 = 4.0 = gamma + 1
    gate = SpeculationGate(NO_DWELL, p)
    assert gate.decide(obs(1, live=4.0)).action is SpecAction.STAY  # not below 0.95 x 4
    gate = SpeculationGate(SpeculationConfig(min_steps=100, min_dwell_steps=0, min_dwell_s=0, start_enabled=False), p)
    assert all(gate.decide(obs(i, est=4.0)).action is SpecAction.STAY for i in range(100))


def test_hysteresis_does_not_flap_on_al_oscillating_around_break_even() -> None:
    """AL alternates 1.22 / 1.28 around break-even 1.25: both sit inside [1.19, 1.375]."""
    stream = [1.25 + (0.03 if i % 2 else -0.03) for i in range(2000)]
    on = SpeculationGate(NO_DWELL, flat())
    off = SpeculationGate(SpeculationConfig(min_steps=100, min_dwell_steps=0, min_dwell_s=0, start_enabled=False),
                          flat())
    for i, al in enumerate(stream):
        assert on.decide(obs(i, live=al)).action is SpecAction.STAY
        assert off.decide(obs(i, est=al)).action is SpecAction.STAY
    # without the band the same stream flips at nearly every observation
    bare = SpeculationGate(SpeculationConfig(margin_off=0, margin_on=0, min_steps=100, min_dwell_steps=0,
                                      min_dwell_s=0), flat())
    flips = sum(bare.decide(obs(i, live=al, est=al)).action is not SpecAction.STAY for i, al in enumerate(stream))
    assert flips > 1000


def test_dwell_holds_a_switch_for_steps_and_seconds() -> None:
    """A noisy AL that crosses both bars: switches at most once per dwell (64 steps and 2 s)."""
    gate = SpeculationGate(SpeculationConfig(min_steps=100), flat(), step=0, time_s=0.0)
    assert gate.decide(obs(10, live=1.0, t=5.0)).action is SpecAction.STAY  # 5 s but only 10 steps
    gate = SpeculationGate(SpeculationConfig(min_steps=100), flat(), step=0, time_s=0.0)
    assert gate.decide(obs(64, live=1.0, t=1.0)).action is SpecAction.STAY  # 64 steps but only 1 s
    assert gate.decide(obs(65, live=1.0, t=2.0)).action is SpecAction.DISABLE
    d = gate.decide(obs(100, est=2.0, t=10.0))
    assert d.action is SpecAction.STAY and "only 35 steps / 8.0 s since the last switch" in d.reason
    assert gate.decide(obs(129, est=2.0, t=10.0)).action is SpecAction.ENABLE
    rng, switches = random.Random(0), []
    for i in range(130, 5000):
        al = rng.choice([1.0, 2.0])
        d = gate.decide(obs(i, live=al, est=al, t=i * 0.05))
        if d.action is not SpecAction.STAY:
            switches.append(i)
    assert switches and min(b - a for a, b in zip(switches, switches[1:])) >= 64


# ---------------------------------------------------------------- collection gate

SMALL = CollectConfig(n_threshold=4096)  # 16 requests of 256 stored tokens


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
            deployed += d.action is CollectAction.DEPLOY
    return trace


def noisy(level, sigma: float, seed: int = 0):
    rng = random.Random(seed)
    return lambda i, deployed: level(i, deployed) + rng.gauss(0, sigma)


def test_warm_up_sets_both_emas_to_the_mean_then_updates_them() -> None:
    gate = CollectionGate(CollectConfig(n_init=4))
    for al in (1.0, 2.0, 3.0):
        assert "warming up" in gate.on_request(al).reason and gate.warming_up
    assert "baseline AL 2.50" in gate.on_request(4.0).reason
    assert gate.short == gate.long == gate.baseline == 2.5
    gate.on_request(1.5)
    assert gate.short == pytest.approx(2.5 - 0.05) and gate.long == pytest.approx(2.5 - 0.01)


def test_worked_example_collects_on_the_sixth_request_after_a_drop() -> None:
    gate = CollectionGate(CollectConfig(n_init=1))
    gate.on_request(2.0)
    actions = [gate.on_request(1.0).action for _ in range(6)]
    assert actions == [CollectAction.WAIT] * 5 + [CollectAction.COLLECT]
    assert gate.short == pytest.approx(1 + 0.95**6) and gate.long == pytest.approx(1 + 0.99**6)


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("sigma", [0.1, 0.3])
def test_stable_stream_never_collects(seed: int, sigma: float) -> None:
    trace = drive(CollectionGate(CollectConfig()), noisy(lambda i, d: 1.8, sigma, seed), 10_000)
    assert trace.events == []


def test_abrupt_shift_collects_trains_deploys_then_settles() -> None:
    # AL 1.8 until request 200, then 1.2 until a new draft is deployed, then 1.75
    level = lambda i, deployed: 1.75 if deployed else (1.8 if i < 200 else 1.2)
    trace = drive(CollectionGate(SMALL), noisy(level, 0.1), 1000, result=lambda i: (7, 1.70, 1.20))
    (c,) = trace.at(CollectAction.COLLECT)
    assert 200 < c <= 200 + 15  # ~12 requests for a 0.6 drop
    (t,) = trace.at(CollectAction.TRAIN)
    assert t == c + 15  # 16 requests x 256 tokens = 4096 = n_threshold (the COLLECT request stores too)
    (d,) = trace.at(CollectAction.DEPLOY)
    assert d == t + 5
    deploy = next(x for x in trace.decisions if x.action is CollectAction.DEPLOY)
    assert deploy.version == 7 and "eval AL 1.70 > live draft 1.20" in deploy.reason
    assert len(trace.events) == 3  # the new level (1.75) becomes the baseline: nothing after


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
    ema_only = drive(CollectionGate(CollectConfig(n_threshold=4096, drift_epsilon=0)), noisy(level, 0.1), 4000)
    assert ema_only.events == []


def test_recurring_domains_collect_at_each_shift() -> None:
    """Domains A, B, A (300 requests each). A draft is good (1.8) on the domain of the last deployed
    training run and poor (1.2) elsewhere; it starts trained on A and each deploy flips it."""
    def level(i: int, deployed: int) -> float:
        domain = "ABA"[min(i // 300, 2)]
        draft = "AB"[deployed % 2]
        return 1.8 if domain == draft else 1.2
    trace = drive(CollectionGate(SMALL), noisy(level, 0.1), 900, result=lambda i: (i, 1.75, 1.2))
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
    assert trained(SMALL, 1.5, 1.5) is CollectAction.REJECT
    assert trained(SMALL, 1.51, 1.5) is CollectAction.DEPLOY
    assert trained(CollectConfig(min_gain=0.05), 1.51, 1.5) is CollectAction.REJECT


def test_training_failure_retries_and_stale_results_are_ignored() -> None:
    gate = CollectionGate(CollectConfig(n_init=1, n_threshold=100))
    assert gate.on_trained(1, 3.0, 1.0).action is CollectAction.WAIT  # nobody asked
    assert gate.on_stored(500).action is CollectAction.WAIT and gate.stored_tokens == 0  # idle: not counted
    gate.on_request(2.0)
    while gate.on_request(1.0).action is not CollectAction.COLLECT:
        pass
    assert gate.on_stored(60).action is CollectAction.WAIT
    assert gate.on_stored(60).action is CollectAction.TRAIN and gate.state is CollectState.TRAINING
    assert gate.on_stored(60).action is CollectAction.WAIT  # TRAIN is emitted once
    assert "will retry" in gate.on_training_failed("trainer rank died").reason and gate.collecting
    assert gate.on_stored(10).action is CollectAction.TRAIN
    assert gate.on_trained(4, 1.9, 1.2).action is CollectAction.DEPLOY
    assert not gate.collecting and gate.warming_up


def test_untrained_draft_collects_on_request_and_nan_is_ignored() -> None:
    gate = CollectionGate(CollectConfig(n_init=2, n_threshold=100))
    assert gate.on_request(float("nan")).reason == "request AL nan ignored" and gate._first == []
    d = gate.collect_now("untrained draft v0")
    assert (d.action, d.reason) == (CollectAction.COLLECT, "untrained draft v0") and gate.collecting
    assert gate.collect_now("again").action is CollectAction.WAIT
    assert gate.on_stored(100).action is CollectAction.TRAIN


# ---------------------------------------------------------------- rollback

def watched(eval_al: float = 2.10, previous: int | None = 2) -> RollbackGate:
    gate = RollbackGate(RollbackConfig(), GAMMA)
    gate.watch(3, eval_al, previous)
    return gate


def test_good_draft_is_confirmed() -> None:
    gate = watched()
    d = gate.decide(hist(1.90, 256))
    assert (d.action, d.version) == (RollbackAction.CONFIRM, 3) and not gate.watching
    assert gate.decide(hist(1.0, 256)).action is RollbackAction.WAIT  # judged: no longer watching


def test_corrupted_draft_rolls_back_with_the_numbers() -> None:
    gate = watched()
    d = gate.decide(hist(1.02, 256))
    assert (d.action, d.version) == (RollbackAction.ROLLBACK, 2)
    assert d.reason == "live AL 1.02 < 1.66 = 1 + 0.60 x (eval 2.10 - 1) over 256 steps: v3 back to v2"


def test_not_enough_evidence_waits_then_judges_the_whole_window() -> None:
    gate = watched()
    assert gate.decide(hist(1.0, 100)).action is RollbackAction.WAIT
    d = gate.decide(hist(1.0, 100))
    assert d.action is RollbackAction.WAIT and "200/256 steps" in d.reason
    assert gate.decide(hist(1.0, 56)).action is RollbackAction.ROLLBACK


def test_collapse_is_caught_for_a_small_target_draft() -> None:
    """Eval 1.45 (SmolLM2 code): 0.6 x 1.45 = 0.87 could never catch AL 1.0; the gain bar 1.27 does."""
    assert watched(eval_al=1.45).decide(hist(1.0, 256)).action is RollbackAction.ROLLBACK
    assert watched(eval_al=1.45).decide(hist(1.35, 256)).action is RollbackAction.CONFIRM


def test_rollback_without_an_earlier_draft_turns_speculation_off() -> None:
    d = watched(previous=None).decide(hist(1.0, 256))
    assert (d.action, d.version) == (RollbackAction.ROLLBACK, None) and "speculation off" in d.reason
