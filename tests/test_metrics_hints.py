"""tiering.metrics: the retention hints' families (`tiering.hint_metrics`), per engine and
tier, from the CPU tier's `HintStatistics`; no sample before the first hint."""

from __future__ import annotations

import anyio
import pytest

from tiering.hint_metrics import HINT_FAMILIES
from tiering.hints import Hint
from tiering.metrics import FAMILIES, render_metrics

from .test_metrics import families_of, keys, make_engine, parse, spec, value

CPU = {"engine": "hinted", "tier": "cpu"}


def hint_samples(text: bytes) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    series, _ = parse(text)
    return {key: v for key, v in series.items() if key[0].startswith("tiering_hint")}


def test_the_hint_families_are_exported_with_their_types() -> None:
    assert set(HINT_FAMILIES) <= set(FAMILIES)
    _, types = parse(render_metrics(make_engine(10, backend="mock")))
    assert {name: types[name.removesuffix("_total")] for name in HINT_FAMILIES} == {
        "tiering_hint_chunks": "gauge",
        "tiering_hint_retained_chunks_limit": "gauge",
        "tiering_hint_followed": "gauge",
        "tiering_hinted_chunks_total": "counter",
        "tiering_hint_released_evictions_total": "counter",
        "tiering_hint_retentions_dropped_total": "counter",
        "tiering_hint_retentions_overridden_total": "counter",
        "tiering_hint_reuse_ratio": "gauge",
    }


@pytest.mark.anyio
async def test_an_engine_given_hints_shows_what_they_hold_and_did(anyio_backend: str) -> None:
    engine = make_engine(10, backend="mock", engine_id="hinted")
    async with engine:
        with anyio.fail_after(10):
            for first in (1, 4, 7):
                stored = await engine.submit_store(keys(first, first + 1, first + 2), spec(0, 1, 2))
                assert (await stored).success
        manager = engine.manager
        manager.touch(keys(1, 2, 3))  # a use without a hint: the book stays out of it

        before = render_metrics(engine)
        assert families_of(before) == set(FAMILIES)  # named, with no sample
        assert hint_samples(before) == {}

        manager.touch(keys(1, 2, 3), Hint(retain_s=600, priority=1))  # 3 retained of 2 kept
        manager.touch(keys(4, 5), Hint(release=True))
        manager.touch(keys(1, 2, 3))  # the retained request used again, without a hint
        with anyio.fail_after(10):
            stored = await engine.submit_store(keys(10, 11), spec(0, 1))  # evicts 4 for 11
            assert (await stored).success
        text = render_metrics(engine)
        stats = manager.hints.statistics()

    series = hint_samples(text)
    assert all(("engine", "hinted") in labels and ("tier", "cpu") in labels for _, labels in series)
    assert value(series, "tiering_hint_chunks", state="retained", **CPU) == 2
    assert value(series, "tiering_hint_chunks", state="released", **CPU) == 1  # 5 is left
    assert value(series, "tiering_hint_retained_chunks_limit", **CPU) == 2  # 0.2 of 10
    assert value(series, "tiering_hint_followed", kind="release", **CPU) == 1
    assert value(series, "tiering_hint_followed", kind="retain", **CPU) == 1
    assert value(series, "tiering_hinted_chunks_total", kind="retain", **CPU) == 3
    assert value(series, "tiering_hinted_chunks_total", kind="release", **CPU) == 2
    assert value(series, "tiering_hint_released_evictions_total", **CPU) == 1
    assert value(series, "tiering_hint_retentions_dropped_total", **CPU) == 1
    assert value(series, "tiering_hint_retentions_overridden_total", **CPU) == 0
    # The retained request's keys were used again (each request weighs once), the
    # released one's and the plain ones' not yet.
    assert value(series, "tiering_hint_reuse_ratio", kind="retain", **CPU) == 1.0
    assert value(series, "tiering_hint_reuse_ratio", kind="release", **CPU) == 0.0
    assert value(series, "tiering_hint_reuse_ratio", kind="none", **CPU) == 0.0
    # Two states, two kinds followed and hinted, three reuse kinds, four more.
    assert len(series) == 13
    assert (stats.retained, stats.released, stats.released_evicted_total) == (2, 1, 1)
    assert stats.released_keys_total + stats.retained_keys_total == stats.hinted_keys_total


@pytest.mark.anyio
async def test_the_kinds_are_told_apart_when_one_is_ignored(anyio_backend: str) -> None:
    """Released requests whose keys come back at once, plain ones that never do: the tier
    stops following releases and still follows retentions (none seen to judge them)."""
    engine = make_engine(10, backend="mock", engine_id="hinted")
    manager = engine.manager
    for i in range(100):
        manager.touch(keys(1000 + i), Hint(release=True))
        manager.touch(keys(1000 + i))  # the released conversation goes on
        manager.touch(keys(5000 + i))  # a plain one that never comes back
    series = hint_samples(render_metrics(engine))
    assert value(series, "tiering_hint_followed", kind="release", **CPU) == 0
    assert value(series, "tiering_hint_followed", kind="retain", **CPU) == 1
    assert value(series, "tiering_hint_reuse_ratio", kind="release", **CPU) == 1.0
    assert value(series, "tiering_hint_reuse_ratio", kind="none", **CPU) == 0.0
    assert value(series, "tiering_hint_reuse_ratio", kind="retain", **CPU) == 0.0
    # Hints of keys the tier does not hold apply to nothing.
    assert value(series, "tiering_hinted_chunks_total", kind="release", **CPU) == 0
    assert value(series, "tiering_hinted_chunks_total", kind="retain", **CPU) == 0
    assert value(series, "tiering_hint_chunks", state="released", **CPU) == 0


@pytest.mark.anyio
async def test_a_reset_hides_the_hint_series_and_their_counters_never_go_back(
    anyio_backend: str,
) -> None:
    """A reset of the tier forgets its hints (no sample until the next one, as before the
    first); the counters keep their totals through it, as the tier's other counters do,
    so a rate over the reset is never a counter reset."""
    engine = make_engine(10, backend="mock", engine_id="hinted")
    async with engine:
        with anyio.fail_after(10):
            stored = await engine.submit_store(keys(1, 2, 3), spec(0, 1, 2))
            assert (await stored).success
        manager = engine.manager
        manager.touch(keys(1, 2, 3), Hint(release=True))
        before = hint_samples(render_metrics(engine))
        assert value(before, "tiering_hinted_chunks_total", kind="release", **CPU) == 3
        assert value(before, "tiering_hinted_chunks_total", kind="retain", **CPU) == 0

        manager.reset()
        assert hint_samples(render_metrics(engine)) == {}

        with anyio.fail_after(10):
            stored = await engine.submit_store(keys(4, 5), spec(0, 1))
            assert (await stored).success
        manager.touch(keys(4, 5), Hint(retain_s=600))
        after = hint_samples(render_metrics(engine))
    assert value(after, "tiering_hinted_chunks_total", kind="release", **CPU) == 3
    assert value(after, "tiering_hinted_chunks_total", kind="retain", **CPU) == 2
    assert value(after, "tiering_hint_chunks", state="released", **CPU) == 0
    assert value(after, "tiering_hint_chunks", state="retained", **CPU) == 2
    for name in HINT_FAMILIES:
        if name.endswith("_total"):
            assert all(v <= after[key] for key, v in before.items() if key[0] == name), name
