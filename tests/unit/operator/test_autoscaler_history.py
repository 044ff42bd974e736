"""The predictive term's memory: the fleet's demand per 5-minute slot over earlier periods,
its forecast for the time ahead, and the ConfigMap form it survives a restart in."""

from __future__ import annotations

import math

import pytest

from brook_operator.autoscaler.history import (
    DATA_KEY,
    SLOT_SECONDS,
    DemandHistory,
    HistoryError,
)

DAY = 86_400.0
NINE = 9 * 3600.0


def _days(history: DemandHistory, days: int, surge: float, at: float = NINE) -> None:
    """``days`` days of 100 tok/s with ``surge`` tok/s for 20 minutes from ``at``."""
    for d in range(days):
        for minute in range(24 * 60):
            t = d * DAY + minute * 60.0
            in_surge = at <= t - d * DAY < at + 1200
            history.record(t, surge if in_surge else 100.0)


def test_a_recurring_surge_is_forecast_a_lead_ahead() -> None:
    history = DemandHistory()
    _days(history, 3, 400.0)
    today = 3 * DAY
    assert history.forecast(today + NINE - 600, lead_seconds=600) == pytest.approx(400.0)
    assert history.forecast(today + NINE - 1200, lead_seconds=600) == pytest.approx(100.0)
    assert history.forecast(today + NINE + 300, lead_seconds=600) == pytest.approx(400.0)
    assert history.forecast(today + NINE + 1500, lead_seconds=600) == pytest.approx(100.0)


def test_one_odd_day_does_not_move_the_forecast() -> None:
    history = DemandHistory()
    _days(history, 2, 400.0)
    for minute in range(24 * 60):  # the third day, an outage: nothing arrived
        history.record(2 * DAY + minute * 60.0, 0.0)
    assert history.forecast(3 * DAY + NINE, lead_seconds=600) == pytest.approx(400.0)
    quiet = DemandHistory()
    _days(quiet, 2, 100.0)  # no surge on two days of three
    for minute in range(20):
        quiet.record(2 * DAY + NINE + minute * 60.0, 400.0)  # a one-off surge on day 3
    assert quiet.forecast(3 * DAY + NINE, lead_seconds=600) == pytest.approx(100.0)


def test_no_history_no_forecast_and_old_slots_go() -> None:
    history = DemandHistory(periods=2)
    assert history.forecast(NINE, 600) is None
    _days(history, 4, 400.0)
    assert min(history.slots) * SLOT_SECONDS >= 4 * DAY - 2 * DAY - 2 * SLOT_SECONDS
    # Readings that are not a demand are ignored, not averaged in.
    before = dict(history.slots)
    for bad in (math.nan, math.inf, -5.0):
        history.record(4 * DAY, bad)
    assert history.slots == before


def test_the_configmap_form_round_trips_and_refuses_what_it_cannot_read() -> None:
    history = DemandHistory()
    _days(history, 1, 400.0)
    back = DemandHistory.from_data(history.to_data(), DAY, 7)
    assert back.forecast(DAY + NINE, 600) == pytest.approx(400.0)
    assert back.slots.keys() == history.slots.keys()
    assert DemandHistory.from_data(None, DAY, 7).slots == {}
    assert DemandHistory.from_data({"other": "x"}, DAY, 7).slots == {}
    with pytest.raises(HistoryError, match=r"period of 86400\.0 s, not"):
        DemandHistory.from_data(history.to_data(), 3600.0, 7)
    with pytest.raises(HistoryError, match="unreadable"):
        DemandHistory.from_data({DATA_KEY: "{not json"}, DAY, 7)
    bad = '{"slotSeconds":300,"periodSeconds":86400.0,"slots":{"3":[NaN,1]}}'
    with pytest.raises(HistoryError, match="slot 3"):
        DemandHistory.from_data({DATA_KEY: bad}, DAY, 7)
    for shape in ('{"slotSeconds":300,"periodSeconds":86400.0,"slots":[]}', "[]", '"x"'):
        with pytest.raises(HistoryError, match="not a mapping"):
            DemandHistory.from_data({DATA_KEY: shape}, DAY, 7)
    odd = '{"slotSeconds":300,"periodSeconds":86400.0,"slots":{"3":"ab"}}'
    with pytest.raises(HistoryError, match="unreadable"):
        DemandHistory.from_data({DATA_KEY: odd}, DAY, 7)
