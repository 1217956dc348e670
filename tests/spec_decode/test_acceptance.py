"""The per-request acceptance switch: exact window sums, the moment a request is switched off, forgetting."""
from __future__ import annotations

import pytest

from pagedserve.config import SpeculativeConfig
from pagedserve.spec_decode.acceptance import AcceptanceTracker


def test_a_full_window_below_the_rate_switches_the_request_off():
    t = AcceptanceTracker(min_rate=0.25, window=8)
    t.record("a", 3, 0)
    t.record("a", 3, 1)
    assert "a" not in t.disabled                      # 6 drafted: the window is not full yet
    t.record("a", 0, 0)                               # a step without drafts changes nothing
    assert t.rate("a") == pytest.approx(1 / 6)
    t.record("a", 3, 1)                               # 9 drafted, 2 accepted: 0.222 < 0.25
    assert t.disabled == {"a"} and t.rate("a") is None
    t.record("a", 3, 3)                               # nothing more is counted once off
    assert t.disabled == {"a"}


def test_the_window_slides_over_the_latest_draft_tokens():
    t = AcceptanceTracker(min_rate=0.5, window=6)
    t.record("b", 3, 3)
    t.record("b", 3, 0)                               # 6 drafted, 3 accepted: 0.5, kept
    assert "b" not in t.disabled
    t.record("b", 3, 2)                               # the first step leaves: (3, 0) + (3, 2) = 2/6
    assert t.disabled == {"b"}
    u = AcceptanceTracker(min_rate=0.5, window=6)
    for accepted in (0, 3, 3, 0, 3):                  # never below 0.5 once the window is full
        u.record("c", 3, accepted)
        assert "c" not in u.disabled
    assert u.rate("c") == pytest.approx(0.5)


def test_requests_are_independent_and_forgotten():
    t = AcceptanceTracker(min_rate=0.5, window=4)
    t.record("x", 4, 0)
    t.record("y", 4, 4)
    assert t.disabled == {"x"} and t.rate("y") == 1.0
    t.forget("x")
    t.forget("y")
    assert not t.disabled and t.rate("y") is None and not t._steps and not t._sums


def test_config():
    assert AcceptanceTracker.from_config(SpeculativeConfig()) is None
    t = AcceptanceTracker.from_config(SpeculativeConfig.parse('{"disable_by_acceptance_rate": 0.2}'))
    assert (t.min_rate, t.window) == (0.2, 32)
    for bad in ({"disable_by_acceptance_rate": 0}, {"disable_by_acceptance_rate": 1.5},
                {"disable_by_acceptance_rate": "0.2"}, {"acceptance_window": 0}, {"acceptance_window": 2.0}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            SpeculativeConfig.parse(bad)
