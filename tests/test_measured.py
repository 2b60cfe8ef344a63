"""Measurements at the door: timed once per machine and cached, shared by ranks, kept where a caller gave them."""

from __future__ import annotations

import types

import pytest

from hf_speedup import measured
from hf_speedup.config import SpeedupConfig
from hf_speedup.hardware import Capabilities
from hf_speedup.measured import Measurement, cached
from hf_speedup.model_info import ModelInfo


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv(measured.CACHE_ENV, str(tmp_path))
    monkeypatch.setenv(measured.MEASURE_ENV, "1")
    return tmp_path


def test_a_measurement_is_timed_once_per_key_and_read_back_after(cache_dir):
    calls = []

    def timing(v):
        def run():
            calls.append(v)
            return Measurement(v, "a ratio", "this machine")
        return run

    first = cached("ratio", {"shape": [4, 8]}, timing(2.0))
    again = cached("ratio", {"shape": [4, 8]}, timing(9.0))
    other = cached("ratio", {"shape": [4, 16]}, timing(3.0))
    assert (first.value, first.cached) == (2.0, False)
    assert (again.value, again.cached) == (2.0, True) and "(cached)" in again.text()
    assert other.value == 3.0 and calls == [2.0, 3.0]
    assert (cache_dir / "measured.json").exists()


def test_a_corrupt_cache_is_measured_again(cache_dir):
    (cache_dir / "measured.json").write_text("{not json")
    assert cached("ratio", {}, lambda: Measurement(1.5, "x")).value == 1.5


def _features_with(monkeypatch, hook):
    import hf_speedup.plan as plan_module

    fake = types.SimpleNamespace(NAME="fake", measure=hook)
    monkeypatch.setattr(plan_module, "FEATURES", (*plan_module.FEATURES, fake))
    return plan_module


def test_the_door_adds_what_features_measure_and_keeps_what_the_caller_gave(cache_dir, monkeypatch):
    seen = []

    def hook(config, caps, model):
        seen.append(model.architecture)
        return {"fake.ratio": Measurement(2.5, "fake"), "fake.given": Measurement(0.0, "timed")}

    plan_module = _features_with(monkeypatch, hook)
    caps = Capabilities(measured={"fake.given": Measurement(7.0, "the caller's")})
    out = plan_module.measure(SpeedupConfig(), caps, ModelInfo(architecture="Tiny"))
    assert out.measured["fake.ratio"].value == 2.5 and out.measured["fake.given"].value == 7.0
    assert seen == ["Tiny"] and caps.measured == {"fake.given": Measurement(7.0, "the caller's")}  # caps frozen
    assert plan_module.measure(SpeedupConfig(), caps, None) is caps  # no model: nothing to measure at


def test_measuring_off_leaves_the_capabilities_as_probed(cache_dir, monkeypatch):
    plan_module = _features_with(monkeypatch, lambda *a: pytest.fail("measured although HF_SPEEDUP_MEASURE=0"))
    monkeypatch.setenv(measured.MEASURE_ENV, "0")
    caps = Capabilities()
    assert plan_module.measure(SpeedupConfig(), caps, ModelInfo()) is caps
