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
    """Frame bytes as one TFRecord.

    Args:
        data: The record's payload (a serialised event).

    Returns:
        The length, its masked CRC, the data and its masked CRC, integers little-endian.

    Examples:
        >>> record = tfrecord(b"abc")
        >>> len(record), record[12:15]
        (19, b'abc')
    """
    header = struct.pack("<Q", len(data))
    return header + struct.pack("<I", masked_crc32c(header)) + data + struct.pack("<I", masked_crc32c(data))


def open_for_appending(path: str) -> BinaryIO:
    """Open the binary file the monitor's event records are appended to.

    Unbuffered: a record that fails to go out fails at once, not at some later flush.

    Args:
        path: The file, created if missing.

    Returns:
        The open file; the caller closes it.

    Examples:
        >>> import os, tempfile
        >>> with tempfile.TemporaryDirectory() as folder:
        ...     with open_for_appending(os.path.join(folder, "events")) as file:
        ...         file.write(tfrecord(b"abc"))
        19
    """
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

    Args:
        log_dir: The run directory; made when the first event is written.

    Attributes:
        log_dir: The run directory, as a string.

    Examples:
        >>> import os, tempfile
        >>> from tensorboard.compat.proto.summary_pb2 import Summary
        >>> entropy = Summary(value=[Summary.Value(tag="attention/entropy/a", simple_value=0.5)])
        >>> with tempfile.TemporaryDirectory() as run:
        ...     events = EventFile(run)
        ...     events.add_summary(entropy, step=3)
        ...     events.close()
        ...     [name.endswith(".spectral_monitor") for name in os.listdir(run)]
        [True]
    """

    def __init__(self, log_dir: str | os.PathLike[str]) -> None:
        self.log_dir = os.fspath(log_dir)
        self._file: BinaryIO | None = None

    def add_summary(self, summary: Summary, step: int, walltime: float | None = None) -> None:
        """Write a summary as one event, opening the file first where none is open.

        Args:
            summary: The summary.
            step: The training step.
            walltime: The event's time in seconds since the epoch; now by default.

        Raises:
            OSError: The write failed; the file is closed, and the next write starts a new one.
        """
        event = Event(summary=summary, step=step, wall_time=time.time() if walltime is None else walltime)
        self._write(event)

    def close(self) -> None:
        """Close the file; a later write opens a new one."""
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
        # TensorBoard reads a run's files in name order and drops the steps a later-read file goes back over:
        # the zero-padded number keeps a file reopened in the same second after its predecessors (unpadded,
        # file 10 sorts before file 9).
        name = (
            f"events.out.tfevents.{time.time():.0f}.{socket.gethostname()}.{os.getpid()}."
            f"{next(_FILE_NUMBERS):09d}.spectral_monitor"
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
