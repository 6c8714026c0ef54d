"""The monitor's own TensorBoard event file: TFRecord framing checksummed by a vectorised CRC-32C.

Without TensorFlow, TensorBoard's writer frames each event as a TFRecord whose masked CRC-32C it computes a
byte at a time in pure Python (``tensorboard.compat.tensorflow_stub.pywrap_tensorflow.crc32c``),
holding the GIL against the training thread for every byte a logging step writes (benchmarks/README.md).
Here the same checksum is computed over many lanes of the record at once with numpy
(:mod:`spectral_monitor.checksum`), bit for bit what TensorBoard computes. It frames the monitor's own
records only: the training framework's event file is left to its own writer.
"""

from __future__ import annotations

import contextlib
import errno
import itertools
import os
import socket
import struct
import time
from typing import BinaryIO

from tensorboard.compat.proto.event_pb2 import Event
from tensorboard.compat.proto.summary_pb2 import Summary

from spectral_monitor.checksum import LANE_BYTES, VECTORISED_FROM_BYTES, crc32c, masked_crc32c

__all__ = [
    "LANE_BYTES",
    "VECTORISED_FROM_BYTES",
    "EventFile",
    "crc32c",
    "masked_crc32c",
    "open_for_appending",
    "tfrecord",
]


def tfrecord(data: bytes) -> bytes:
    """``data`` framed as one TFRecord: length, its masked CRC, the data, its masked CRC (little-endian)."""
    header = struct.pack("<Q", len(data))
    return header + struct.pack("<I", masked_crc32c(header)) + data + struct.pack("<I", masked_crc32c(data))


def open_for_appending(path: str) -> BinaryIO:
    """The binary file the monitor's event records are appended to (unbuffered: a record that fails to go
    out fails at once, not at some later flush)."""
    return open(path, "ab", buffering=0)  # noqa: SIM115 - EventFile closes it


_FILE_NUMBERS = itertools.count(1)
"""Numbers the event files this process opens, so two opened within one second get distinct names."""


class EventFile:
    """The monitor's own TensorBoard event file in a run directory, written synchronously.

    TensorBoard shows every event file of a directory as one run, so the monitor's records sit beside those
    of the training framework's logger without sharing its writer: a failure here (no space, I/O error,
    permission) raises ``OSError`` to the caller and touches nothing else. After a failure the file is
    closed; the next write starts a new file (the failed one may end in a partial record, which TensorBoard's
    readers stop at), so what was written before stays readable.

    Records are framed by :func:`tfrecord` with the vectorised checksum, and each event goes out with one
    ``write``.
    """

    def __init__(self, log_dir: str | os.PathLike[str]) -> None:
        self.log_dir = os.fspath(log_dir)
        self._file: BinaryIO | None = None

    def add_summary(self, summary: Summary, step: int, walltime: float | None = None) -> None:
        """``summary`` as one event at ``step``."""
        event = Event(summary=summary, step=step, wall_time=time.time() if walltime is None else walltime)
        self._write(event)

    def close(self) -> None:
        file, self._file = self._file, None
        if file is not None:
            file.close()

    def _write(self, event: Event) -> None:
        try:
            if self._file is None:
                self._open()
            self._write_all(tfrecord(event.SerializeToString()))
        except BaseException:
            self._close_after_failure()
            raise

    def _open(self) -> None:
        os.makedirs(self.log_dir, exist_ok=True)
        name = (
            f"events.out.tfevents.{time.time():.0f}.{socket.gethostname()}.{os.getpid()}."
            f"{next(_FILE_NUMBERS)}.spectral_monitor"
        )
        self._file = open_for_appending(os.path.join(self.log_dir, name))
        header = Event(wall_time=time.time(), file_version="brain.Event:2")
        self._write_all(tfrecord(header.SerializeToString()))

    def _write_all(self, data: bytes) -> None:
        view = memoryview(data)
        while view:
            written = self._file.write(view)
            if not written:
                raise OSError(errno.EIO, f"wrote nothing of an event record to {self.log_dir}")
            view = view[written:]

    def _close_after_failure(self) -> None:
        file, self._file = self._file, None
        if file is not None:
            with contextlib.suppress(OSError):  # the write that failed is the failure reported
                file.close()
