"""The vectorised CRC-32C and TFRecord framing against TensorBoard's own, and the writer that uses them."""

from __future__ import annotations

import errno
import io
import itertools
import struct
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from tensorboard.backend.event_processing import event_accumulator
from tensorboard.compat.proto.event_pb2 import Event
from tensorboard.compat.proto.summary_pb2 import Summary
from tensorboard.compat.tensorflow_stub.pywrap_tensorflow import masked_crc32c as tensorboard_masked_crc32c
from tensorboard.summary.writer.record_writer import RecordWriter
from torch.utils.tensorboard import SummaryWriter

import spectral_monitor.sinks.tfrecord as tfrecord_module
from spectral_monitor.records import Measurement
from spectral_monitor.sinks import TensorBoardSink
from spectral_monitor.sinks.tfrecord import (
    LANE_BYTES,
    VECTORISED_FROM_BYTES,
    EventFile,
    crc32c,
    masked_crc32c,
    tfrecord,
)


def test_crc32c_gives_the_standard_check_value() -> None:
    # RFC 3720 (iSCSI), B.4, and every CRC catalogue: CRC-32C of the ASCII digits 1-9.
    assert crc32c(b"123456789") == 0xE3069283
    assert crc32c(bytes(32)) == 0x8A9136AA  # RFC 3720, B.4: 32 bytes of zeros
    assert crc32c(b"\xff" * 32) == 0x62A8AB43  # and of ones


LENGTHS = sorted(
    {0, 1, 3, 4, 5, LANE_BYTES - 1, LANE_BYTES, LANE_BYTES + 1}
    | {VECTORISED_FROM_BYTES + d for d in (-1, 0, 1, LANE_BYTES, 3 * LANE_BYTES + 5)}
    | {70_001, 262_144}
)


@pytest.mark.parametrize("length", LENGTHS)
def test_masked_checksum_is_tensorboards_for_every_length_around_the_lanes(length: int) -> None:
    data = np.random.default_rng(length).integers(0, 256, length, dtype=np.uint8).tobytes()
    assert masked_crc32c(data) == tensorboard_masked_crc32c(data)


def test_leading_and_trailing_zeros_change_the_checksum() -> None:
    # The lanes pad with zeros in front; a CRC from all ones must still see real zeros at either end.
    data = np.random.default_rng(0).integers(0, 256, 3 * VECTORISED_FROM_BYTES, dtype=np.uint8).tobytes()
    for variant in (b"\x00" + data, data + b"\x00", b"\x00" * LANE_BYTES + data):
        assert masked_crc32c(variant) == tensorboard_masked_crc32c(variant) != masked_crc32c(data)


def test_framing_is_byte_for_byte_tensorboards_record_writer() -> None:
    payloads = [b"", b"x", bytes(range(256)) * 40]
    ours, theirs = io.BytesIO(), io.BytesIO()
    reference = RecordWriter(theirs)
    for payload in payloads:
        ours.write(tfrecord(payload))
        reference.write(payload)
    assert ours.getvalue() == theirs.getvalue()


def records_in(event_file: Path) -> list[bytes]:
    """Each record's data, after checking both of its checksums with TensorBoard's own function."""
    raw, records, offset = event_file.read_bytes(), [], 0
    while offset < len(raw):
        header = raw[offset : offset + 8]
        (length,) = struct.unpack("<Q", header)
        (header_crc,) = struct.unpack("<I", raw[offset + 8 : offset + 12])
        data = raw[offset + 12 : offset + 12 + length]
        (data_crc,) = struct.unpack("<I", raw[offset + 12 + length : offset + 16 + length])
        assert header_crc == tensorboard_masked_crc32c(header)
        assert data_crc == tensorboard_masked_crc32c(data)
        records.append(data)
        offset += 16 + length
    return records


def test_the_sinks_own_event_file_is_checksummed_as_tensorboard_checks_and_leaves_the_writer_alone(
    tmp_path: Path,
) -> None:
    writer = SummaryWriter(log_dir=str(tmp_path))
    writer.add_scalar("framework/loss", 1.0, 7)
    record_writer = writer._get_file_writer().event_writer._async_writer._writer
    sink = TensorBoardSink(tmp_path)
    # Enough scalars for one event to take the lanes (the demo writes ≈ 70 KB a logging step).
    records = [Measurement(7, "attention", "entropy", f"layers.{i}", i / 1000) for i in range(400)]
    sink.write_measurements(records)
    sink.write_text("alerts", "a text entry", 7)
    sink.close()
    writer.close()

    assert "write" not in vars(record_writer)  # the framework's writer is not touched
    (own_file,) = tmp_path.glob("events.out.tfevents.*.spectral_monitor")
    sizes = [len(data) for data in records_in(own_file)]
    assert max(sizes) >= VECTORISED_FROM_BYTES
    assert len(sizes) == 3  # the file version, the scalars' event, the text's
    (framework_file,) = set(tmp_path.glob("events.out.tfevents.*")) - {own_file}
    assert len(records_in(framework_file)) == 2  # its file version and its scalar, nothing of the sink's


def test_an_event_file_that_failed_starts_a_new_file_and_keeps_what_was_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    events = EventFile(tmp_path)
    scalar = Summary(value=[Summary.Value(tag="a/b", simple_value=1.0)])
    events.add_summary(scalar, 0)

    def refused(path: str) -> Any:
        raise OSError(errno.ENOSPC, "No space left on device", path)

    with monkeypatch.context() as patch:
        patch.setattr(tfrecord_module, "open_for_appending", refused)
        events._file.write = lambda data: (_ for _ in ()).throw(OSError(errno.ENOSPC, "full"))
        with pytest.raises(OSError, match="full"):
            events.add_summary(scalar, 1)
        with pytest.raises(OSError, match="No space"):
            events.add_summary(scalar, 2)  # the failed file was closed: a new one is opened
    events.add_summary(scalar, 3)
    events.close()
    files = sorted(tmp_path.glob("events.out.tfevents.*"))
    assert len(files) == 2
    steps = [Event.FromString(data).step for file in files for data in records_in(file)[1:]]
    assert sorted(steps) == [0, 3]


def test_files_reopened_in_the_same_second_sort_in_the_order_they_were_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(tfrecord_module, "_FILE_NUMBERS", itertools.count(8))  # 8, 9, 10, 11: a digit more
    monkeypatch.setattr(tfrecord_module.time, "time", lambda: 1_700_000_000.0)
    events = EventFile(tmp_path)
    for step in range(4):
        events.add_summary(Summary(value=[Summary.Value(tag="a/b", simple_value=float(step))]), step)
        events.close()  # as after a failed write: the next one opens a new file
    files = sorted(tmp_path.glob("events.out.tfevents.*"))
    assert [Event.FromString(records_in(file)[1]).step for file in files] == [0, 1, 2, 3]
    viewer = event_accumulator.EventAccumulator(str(tmp_path), purge_orphaned_data=True)
    viewer.Reload()
    assert [event.step for event in viewer.Scalars("a/b")] == [0, 1, 2, 3]
