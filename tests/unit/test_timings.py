"""Stage timings: each mark ends a stage begun at the previous one."""

from __future__ import annotations

from forkd.runtime import timings as timings_module
from forkd.runtime.timings import Timings


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class Recorder:
    def __init__(self) -> None:
        self.samples: list[tuple[tuple[str, ...], float]] = []

    def labels(self, *values: str) -> "Recorder._Bound":
        return Recorder._Bound(self, values)

    class _Bound:
        def __init__(self, owner: "Recorder", values: tuple[str, ...]) -> None:
            self.owner, self.values = owner, values

        def observe(self, amount: float) -> None:
            self.owner.samples.append((self.values, amount))


def test_stages_totals_and_observation(monkeypatch) -> None:
    clock = FakeClock()
    monkeypatch.setattr(timings_module.time, "monotonic", clock)
    t = Timings()
    for stage, at in (("stop", 100.010), ("disk_switched", 100.012), ("cont", 100.050), ("published", 101.0)):
        clock.now = at
        t.mark(stage)
    stages = t.stages()
    assert list(stages) == ["stop", "disk_switched", "cont", "published"]
    assert round(stages["cont"], 6) == 0.038 and round(t.total, 6) == 1.0
    assert round(t.between("disk_switched", "cont"), 6) == 0.040
    assert t.as_ms() == {"stop": 10.0, "disk_switched": 2.0, "cont": 38.0, "published": 950.0, "total": 1000.0}
    recorder = Recorder()
    t.observe(recorder, "diff")
    assert [(labels, round(s, 6)) for labels, s in recorder.samples] == [
        (("diff", "stop"), 0.01), (("diff", "disk_switched"), 0.002), (("diff", "cont"), 0.038),
        (("diff", "published"), 0.95)]


def test_a_stage_marked_twice_adds_up_and_empty_is_zero(monkeypatch) -> None:
    clock = FakeClock()
    monkeypatch.setattr(timings_module.time, "monotonic", clock)
    t = Timings()
    assert t.total == 0 and t.as_ms() == {"total": 0.0}
    for stage, at in (("copy", 101.0), ("wait", 102.0), ("copy", 104.0)):
        clock.now = at
        t.mark(stage)
    assert t.stages() == {"copy": 3.0, "wait": 1.0}
