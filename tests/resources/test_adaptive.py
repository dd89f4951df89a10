"""The adaptive policy on hand-made loads, the busy-fraction arithmetic, and the loop's
bookkeeping with a fake measurement (no cluster)."""

from __future__ import annotations


import pytest

from resources.adaptive import (Decision, Hysteresis, RoleAdaptive, RoleLoad, Thresholds, classify, decide,
                                loads_between)
from resources import load_resource_config
from resources.config import AdaptiveBounds


def load(role, workers, queued, busy, low=1, high=3, pool="cuda", window=10.0):
    return RoleLoad(role, workers, queued, busy, AdaptiveBounds(low, high), window=window, pool=pool)


def loads(*items):
    return {item.role: item for item in items}


def test_starved_and_idle_make_one_move_with_both_reasons():
    (decision,) = decide(loads(load("rollout", 1, 6, 0.97), load("reward", 2, 0, 0.04), load("reference", 1, 1, 0.5)))
    assert (decision.kind, decision.source_role, decision.target_role) == ("move", "reward", "rollout")
    assert decision.reason == ("rollout starved: 6 tasks queued or running on 1 worker, busy 97% over 10 s; "
                               "reward idle: busy 4% over 10 s, nothing queued, 2 workers")
    assert "move one from reward to rollout" in str(decision)


def test_classify_uses_backlog_per_worker_and_busy():
    t = Thresholds(starved_backlog=2.0, starved_busy=0.9, idle_busy=0.3)
    assert classify(load("rollout", 2, 4, 0.95), t) == "starved"
    assert classify(load("rollout", 2, 3, 0.95), t) == "ok"       # 1.5 per worker: keeping up
    assert classify(load("rollout", 2, 8, 0.85), t) == "ok"       # queued but not saturated
    assert classify(load("reward", 2, 0, 0.1), t) == "idle"
    assert classify(load("reward", 2, 1, 0.1), t) == "ok"         # something to do right now


def test_the_most_starved_role_is_served_from_the_idlest_donor():
    (decision,) = decide(loads(load("rollout", 1, 3, 0.95), load("reference", 1, 8, 0.99),
                               load("reward", 2, 0, 0.2), load("critic", 3, 0, 0.01)))
    assert (decision.source_role, decision.target_role) == ("critic", "reference")


def test_bounds_are_respected():
    # The donor is at its min and the starved role at its max: nothing moves.
    assert decide(loads(load("rollout", 1, 6, 0.97), load("reward", 1, 0, 0.0))) == []
    assert decide(loads(load("rollout", 3, 9, 0.97), load("reward", 3, 0, 0.0))) == []
    # A role at its max is not served even if another starved role is not.
    (decision,) = decide(loads(load("rollout", 3, 30, 1.0), load("reference", 1, 2, 0.95), load("reward", 2, 0, 0.0)))
    assert decision.target_role == "reference"
    # Over the max: shrink at once; under the min: take from the role most above its min.
    (over,) = decide(loads(load("rollout", 4, 0, 0.5), load("reward", 1, 0, 0.5)))
    assert (over.kind, over.source_role, over.reason) == ("shrink", "rollout", "rollout has 4 workers, "
                                                          "above its max of 3")
    (under,) = decide(loads(load("rollout", 1, 0, 0.5, low=2), load("reward", 3, 0, 0.6), load("actor", 2, 0, 0.9)))
    assert (under.kind, under.source_role, under.target_role) == ("move", "reward", "rollout")
    assert under.reason.startswith("rollout has 1 worker, below its min of 2; reward has 3 workers")


def test_moves_stay_within_a_pool_and_spares_come_first():
    cpu_reward = load("reward", 2, 0, 0.0, pool="cpu")
    assert decide(loads(load("rollout", 1, 6, 0.97), cpu_reward)) == []
    (grow,) = decide(loads(load("rollout", 1, 6, 0.97), load("reward", 2, 0, 0.0)), spare={"cuda": 1})
    assert (grow.kind, grow.target_role, grow.source_role) == ("grow", "rollout", None)


def test_hysteresis_needs_wait_count_observations():
    tracker = Hysteresis()
    starved = loads(load("rollout", 1, 6, 0.97), load("reward", 2, 0, 0.04))
    balanced = loads(load("rollout", 1, 1, 0.6), load("reward", 2, 0, 0.04))

    def observe(current):
        streaks = tracker.observe({role: classify(item) for role, item in current.items()})
        return decide(current, streaks=streaks, wait_count=3)

    assert observe(starved) == [] and observe(starved) == []
    assert observe(balanced) == []                          # the streak breaks
    assert observe(starved) == [] and observe(starved) == []
    assert [d.kind for d in observe(starved)] == ["move"]   # third in a row
    tracker.reset()
    assert observe(starved) == []


def test_nothing_to_do_when_balanced():
    assert decide(loads(load("rollout", 2, 2, 0.7), load("reward", 2, 1, 0.6), load("reference", 1, 0, 0.5))) == []
    assert decide(loads(load("rollout", 2, 0, 0.1), load("reward", 2, 0, 0.05))) == []  # all idle: no taker


def _sample(t, workers, queued=None, waiting=None):
    return {"time": t, "workers": workers, "queued": queued or {}, "waiting": waiting or {}}


def test_loads_between_integrates_busy_seconds_per_role():
    bounds = {"rollout": AdaptiveBounds(1, 2), "reward": AdaptiveBounds(1, 2)}
    before = _sample(100.0, {"a": {"name": "rollout-0", "role": "rollout", "busy": 50.0, "since": 0.0},
                             "b": {"name": "reward-0", "role": "reward", "busy": 5.0, "since": 0.0}})
    after = _sample(110.0, {"a": {"name": "rollout-0", "role": "rollout", "busy": 59.5, "since": 0.0},
                            "b": {"name": "reward-0", "role": "reward", "busy": 5.5, "since": 0.0},
                            "c": {"name": "reward-1", "role": "reward", "busy": 0.5, "since": 105.0}},
                    queued={"rollout": 3}, waiting={"reward": 2})
    result = loads_between(before, after, bounds, {"rollout": "cpu", "reward": "cpu"})
    assert result["rollout"] == RoleLoad("rollout", 1, 3, 0.95, bounds["rollout"], window=10.0, pool="cpu")
    # reward-1 joined at 105: 1 busy second over 15 worker-seconds; its waiting tasks are not backlog
    assert result["reward"].workers == 2 and result["reward"].queued == 0 and result["reward"].waiting == 2
    assert result["reward"].busy == pytest.approx(1.0 / 15.0)


def test_role_adaptive_acts_after_wait_count_and_records_the_decision():
    busy = {"t": 0.0, "rollout": 0.0, "reward": 0.0}

    def measure():  # rollout busy all the time with 4 queued, reward never busy
        busy["t"] += 1.0
        busy["rollout"] += 1.0
        return _sample(busy["t"], {"r": {"name": "rollout-0", "role": "rollout", "busy": busy["rollout"], "since": 0},
                                   "w0": {"name": "reward-0", "role": "reward", "busy": 0.0, "since": 0},
                                   "w1": {"name": "reward-1", "role": "reward", "busy": 0.0, "since": 0}},
                       queued={"rollout": 4})

    moves = []
    adaptive = RoleAdaptive(None, {"rollout": (1, 2), "reward": (1, 2)}, move=lambda *a: moves.append(a),
                            resize=lambda *a: None, interval=1.0, wait_count=2, measure=measure)
    adaptive.adapt()                           # first sample: no window yet
    adaptive.adapt()                           # starved/idle once
    assert moves == []
    adaptive.adapt()                           # twice: act
    assert [m[:2] for m in moves] == [("reward", "rollout")]
    (decision,) = adaptive.decisions
    assert decision.kind == "move" and decision.outcome.startswith("applied")
    assert "rollout starved: 4 tasks queued or running on 1 worker, busy 100%" in decision.reason
    assert adaptive.log and adaptive.log[-1][1]["status"] == "move"


def test_a_failed_action_is_recorded_and_the_loop_goes_on():
    def broken(*_):
        raise RuntimeError("no GPU left")

    adaptive = RoleAdaptive(None, {"rollout": (1, 2)}, move=broken, resize=broken, measure=lambda: None)
    adaptive.loads = loads(load("rollout", 3, 0, 0.5, high=2))
    decision = adaptive.apply(Decision("shrink", "rollout", None, "rollout has 3 workers, above its max of 2"))
    assert decision.outcome == "failed: RuntimeError('no GPU left')" and adaptive.decisions == [decision]


def test_bounds_come_from_the_resource_file():
    config = load_resource_config({"actor": {"device_type": "cpu"}, "reward": {"device_type": "cpu", "workers": 2},
                                   "rollout": {"device_type": "cpu"},
                                   "adaptive": {"rollout": {"min": 1, "max": 2}, "reward": {"min": 1, "max": 2}}})
    adaptive = RoleAdaptive(None, config.adaptive, move=print, resize=print, measure=lambda: None)
    assert adaptive.bounds == {"rollout": AdaptiveBounds(1, 2), "reward": AdaptiveBounds(1, 2)}
    with pytest.raises(ValueError, match="1 <= min <= max"):
        RoleAdaptive(None, {"rollout": (3, 2)}, move=print, resize=print)


class _FakeWorker:
    def __init__(self, name, role):
        self.name, self.resources, self.processing = name, {role: 1}, set()


class _FakeTask:
    def __init__(self, state, role):
        self.state, self.resource_restrictions = state, {role: 1}


class _FakeScheduler:
    def __init__(self):
        self.workers = {"a": _FakeWorker("rollout-0", "rollout"), "b": _FakeWorker("reward-0", "reward")}
        self.tasks = {"g1": _FakeTask("processing", "rollout"), "g2": _FakeTask("no-worker", "rollout"),
                      "s1": _FakeTask("waiting", "reward"), "s0": _FakeTask("memory", "reward")}
        self.plugins = {}

    def add_plugin(self, plugin, name):
        self.plugins[name] = plugin


def test_plugin_integrates_busy_time_between_transitions(monkeypatch):
    from resources import adaptive

    clock = [10.0]
    monkeypatch.setattr(adaptive.time, "monotonic", lambda: clock[0])
    scheduler = _FakeScheduler()
    assert adaptive._install_plugin(dask_scheduler=scheduler) and not adaptive._install_plugin(dask_scheduler=scheduler)
    plugin = scheduler.plugins[adaptive.PLUGIN_NAME]
    scheduler.workers["a"].processing.add("g1")
    plugin.transition("g1", "waiting", "processing")          # rollout busy from t=10
    clock[0] = 13.0
    scheduler.workers["b"].processing.add("s1")
    plugin.transition("s1", "waiting", "processing")          # reward busy from t=13
    clock[0] = 13.5
    scheduler.workers["b"].processing.clear()
    plugin.transition("s1", "processing", "memory")           # ... to t=13.5
    clock[0] = 14.0
    sample = adaptive.role_sample(("rollout", "reward"), dask_scheduler=scheduler)
    assert sample["workers"]["a"]["busy"] == pytest.approx(4.0)   # still running: counted up to now
    assert sample["workers"]["b"]["busy"] == pytest.approx(0.5)
    assert sample["queued"] == {"rollout": 2, "reward": 0} and sample["waiting"] == {"rollout": 0, "reward": 1}
    plugin.remove_worker(scheduler, "b")
    scheduler.workers.pop("b")
    assert set(adaptive.role_sample(("rollout",), dask_scheduler=scheduler)["workers"]) == {"a"}
