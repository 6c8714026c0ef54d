"""Event files damaged as a killed run or a bad disk leaves them: read as TensorBoard's loader reads them up
to the damage, past it where the TFRecord framing allows, and every cut named with its step, byte offset and
cause; ``spectral-monitor report`` says so, and its user's mistakes are one-paragraph errors.

Each damaged file is checked against TensorBoard's own loader (``LegacyEventFileLoader``, what its
``EventAccumulator`` reads with): it reads the same events up to the cut, and stops there, where ours goes on.
"""

from __future__ import annotations

import errno
import os
import struct
import tracemalloc
from pathlib import Path

import pytest
from tensorboard.backend.event_processing.event_file_loader import LegacyEventFileLoader
from tensorboard.compat.proto.event_pb2 import Event
from tensorboard.compat.proto.summary_pb2 import Summary

from spectral_monitor.checksum import masked_crc32c
from spectral_monitor.cli import main
from spectral_monitor.eventfiles import read_event_file
from spectral_monitor.report import RunScalars
from spectral_monitor.sinks.tfrecord import tfrecord

STEPS = 10
TAG = "attention/entropy/blocks.0"


def scalar_event(step: int, tag: str = TAG) -> Event:
    return Event(step=step, wall_time=1.0, summary=Summary(value=[Summary.Value(tag=tag, simple_value=0.5)]))


def write_events(path: Path, events: list[Event]) -> list[int]:
    """Writes ``events`` as TFRecords after a file-version header; returns each event's record offset."""
    records = [tfrecord(Event(wall_time=1.0, file_version="brain.Event:2").SerializeToString())]
    records += [tfrecord(event.SerializeToString()) for event in events]
    offsets = [sum(len(record) for record in records[: index + 1]) for index in range(len(events))]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"".join(records))
    return offsets


def run_file(folder: Path) -> tuple[Path, list[int]]:
    path = folder / "events.out.tfevents.1.host.1.1.spectral_monitor"
    return path, write_events(path, [scalar_event(step) for step in range(STEPS)])


def steps_read(path: Path) -> list[int]:
    return [event.step for event in read_event_file(path).events if event.HasField("summary")]


def tensorboard_steps(path: Path) -> list[int]:
    return [event.step for event in LegacyEventFileLoader(str(path)).Load() if event.HasField("summary")]


def damage(path: Path, offset: int, data: bytes) -> None:
    content = bytearray(path.read_bytes())
    content[offset : offset + len(data)] = data
    path.write_bytes(bytes(content))


def test_an_intact_file_reads_as_tensorboard_reads_it(tmp_path: Path) -> None:
    path, _ = run_file(tmp_path)
    read = read_event_file(path)
    assert read.cuts == []
    assert [event.SerializeToString() for event in read.events] == [
        event.SerializeToString() for event in LegacyEventFileLoader(str(path)).Load()
    ]


def test_a_file_cut_inside_a_record_keeps_every_whole_record_and_says_where(tmp_path: Path) -> None:
    path, offsets = run_file(tmp_path)
    path.write_bytes(path.read_bytes()[: offsets[7] + 20])  # a run killed while writing step 7
    assert steps_read(path) == tensorboard_steps(path) == list(range(7))
    (cut,) = read_event_file(path).cuts
    assert (cut.offset, cut.after_step, cut.resumed_at) == (offsets[7], 6, None)
    assert cut.why.startswith("truncated")
    assert cut.describe().startswith(f"cut at byte {offsets[7]} (after step 6): truncated")


def test_a_bad_data_crc_in_the_middle_loses_that_record_only(tmp_path: Path) -> None:
    path, offsets = run_file(tmp_path)
    damage(path, offsets[4] + 14, b"\xff")  # a byte of step 4's event
    assert tensorboard_steps(path) == [0, 1, 2, 3]  # TensorBoard stops there
    assert steps_read(path) == [0, 1, 2, 3, 5, 6, 7, 8, 9]
    (cut,) = read_event_file(path).cuts
    assert (cut.offset, cut.after_step, cut.why, cut.resumed_at) == (
        offsets[4],
        3,
        "bad data CRC",
        offsets[5],
    )


def test_a_bad_length_crc_resynchronises_on_the_next_whole_record(tmp_path: Path) -> None:
    path, offsets = run_file(tmp_path)
    damage(path, offsets[4], b"\x07")  # step 4's length: its CRC no longer matches
    assert tensorboard_steps(path) == [0, 1, 2, 3]
    assert steps_read(path) == [0, 1, 2, 3, 5, 6, 7, 8, 9]
    (cut,) = read_event_file(path).cuts
    assert (cut.offset, cut.why, cut.resumed_at) == (offsets[4], "bad length CRC", offsets[5])


@pytest.mark.parametrize("where", ["middle", "end"])
def test_a_length_of_2_to_the_62_costs_no_memory_and_hides_nothing_after_it(
    tmp_path: Path, where: str
) -> None:
    path, offsets = run_file(tmp_path)
    index = 4 if where == "middle" else STEPS - 1
    header = struct.pack("<Q", 2**62)
    damage(path, offsets[index], header + struct.pack("<I", masked_crc32c(header)))  # a CRC that checks
    tracemalloc.start()
    read = read_event_file(path)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < 2**20
    (cut,) = read.cuts
    expected = [step for step in range(STEPS) if step != index]
    assert [event.step for event in read.events if event.HasField("summary")] == expected
    if where == "middle":
        assert cut.why.startswith("oversized length") and cut.resumed_at == offsets[5]
    else:
        assert cut.why.startswith("truncated") and cut.resumed_at is None


def report_run(folder: Path, tags: tuple[str, ...] = (TAG,)) -> None:
    for tag in tags:
        name = f"events.out.tfevents.1.host.1.{tags.index(tag)}.spectral_monitor"
        write_events(folder / name, [scalar_event(step, tag) for step in range(STEPS)])


def test_report_reads_past_a_bad_record_and_names_the_cut(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path, offsets = run_file(tmp_path / "run")
    damage(path, offsets[4] + 14, b"\xff")
    assert main(["report", str(tmp_path), "--out", str(tmp_path / "out")]) == 0
    printed = capsys.readouterr().out
    assert (
        f"damaged event file, {path.name}: cut at byte {offsets[4]} (after step 3): bad data CRC; skipped "
        f"{offsets[5] - offsets[4]} bytes, read on from byte {offsets[5]}"
    ) in printed
    steps, _ = RunScalars.load(path.parent).series["attention/entropy"]["blocks.0"]
    assert steps.tolist() == [0, 1, 2, 3, 5, 6, 7, 8, 9]  # the latest step is the run's own, not the cut's


def test_report_follows_a_symlinked_run_directory(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    report_run(tmp_path / "elsewhere" / "run")
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "linked").symlink_to(tmp_path / "elsewhere" / "run", target_is_directory=True)
    (tmp_path / "logs" / "loop").symlink_to(tmp_path / "logs", target_is_directory=True)  # read once
    assert main(["report", str(tmp_path / "logs"), "--out", str(tmp_path / "out")]) == 0
    assert [path.parent.name for path in (tmp_path / "out").rglob("report.md")] == ["linked"]


def test_report_names_of_300_characters_and_a_nul_make_plots_with_file_names_a_disk_takes(
    tmp_path: Path,
) -> None:
    long_tag, nul_tag = f"attention/{'x' * 300}/blocks.0", "attention/en\x00tropy/blocks.0"
    report_run(tmp_path / "run", (TAG, long_tag, nul_tag))
    assert main(["report", str(tmp_path / "run"), "--out", str(tmp_path / "out")]) == 0
    names = [path.name for path in (tmp_path / "out" / "plots").iterdir()]
    assert len(names) == 3 and all(len(name.encode()) <= 255 and "\x00" not in name for name in names)


def test_report_into_a_file_or_a_read_only_folder_is_one_paragraph_and_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    report_run(tmp_path / "run")
    (tmp_path / "a_file").write_text("")
    assert main(["report", str(tmp_path / "run"), "--out", str(tmp_path / "a_file")]) == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and "Traceback" not in error
    assert error.startswith("spectral-monitor report: error: could not write the report (--out ")
    assert "--out names the folder the report goes into, not a file" in error

    def read_only(self: Path, *args: object, **kwargs: object) -> None:
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(self))

    monkeypatch.setattr(Path, "mkdir", read_only)
    assert main(["report", str(tmp_path / "run")]) == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1
    assert "could not write the report (LOGDIR/report)" in error
    assert "Read-only file system; pass --out a folder you can write to." in error
