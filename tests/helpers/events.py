"""Event files read back with TensorBoard's own reader, as the tests check what a run wrote."""

from __future__ import annotations

from pathlib import Path

from tensorboard.backend.event_processing import event_accumulator


def read_back(logdir: str | Path, purge_orphaned_data: bool = False) -> event_accumulator.EventAccumulator:
    """Every event of ``logdir``, nothing sampled away.

    By default an event whose step goes back is kept, so a duplicate step shows; ``purge_orphaned_data=True``
    reads as TensorBoard's viewer does, dropping events a restarted writer wrote over.
    """
    everything = {kind: 0 for kind in event_accumulator.DEFAULT_SIZE_GUIDANCE}
    accumulator = event_accumulator.EventAccumulator(
        str(logdir), size_guidance=everything, purge_orphaned_data=purge_orphaned_data
    )
    accumulator.Reload()
    return accumulator


def scalar_series(events: event_accumulator.EventAccumulator, prefix: str = "") -> dict[str, list]:
    """``tag -> [(step, value), ...]`` of every scalar whose tag starts with ``prefix``."""
    return {
        tag: [(event.step, event.value) for event in events.Scalars(tag)]
        for tag in events.Tags()["scalars"]
        if tag.startswith(prefix)
    }


def scalar_steps(events: event_accumulator.EventAccumulator, tag: str) -> list[int]:
    return [event.step for event in events.Scalars(tag)]


def scalar_at(events: event_accumulator.EventAccumulator, tag: str, step: int) -> float:
    (value,) = [event.value for event in events.Scalars(tag) if event.step == step]
    return value
