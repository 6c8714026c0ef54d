"""The monitor's own TensorBoard event file: TFRecord framing checksummed by a vectorised CRC-32C.

Without TensorFlow, TensorBoard's writer frames each event as a TFRecord whose masked CRC-32C it computes a
byte at a time in pure Python (``tensorboard.compat.tensorflow_stub.pywrap_tensorflow.crc32c``): ≈ 0.3 µs a
byte, 17–22 ms for the ≈ 70 KB a logging step of the demo writes, holding the GIL against the training
thread. Here the same checksum is computed over many lanes of the record at once with numpy (CRC is linear
over GF(2), so lane checksums combine exactly), bit for bit what TensorBoard computes. It frames the
monitor's own records only: the training framework's event file is left to its own writer.
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

import numpy as np
from tensorboard.compat.proto.event_pb2 import Event
from tensorboard.compat.proto.summary_pb2 import Summary

CASTAGNOLI_POLYNOMIAL = 0x82F63B78  # CRC-32C, bit-reflected
_MASK_DELTA = 0xA282EAD8  # TFRecord's checksum mask
# Measured on the 2-core development VM: 32-byte lanes were fastest or within 15% from 4 KB to 1 MB; the
# lanes' fixed ≈ 0.3 ms pays from ≈ 2 KB (an event's header, 8 bytes, takes the byte loop).
LANE_BYTES = 32
VECTORISED_FROM_BYTES = 2048


def _byte_table() -> np.ndarray:
    """The register after one byte: ``table[(crc ^ byte) & 0xFF] ^ (crc >> 8)``."""
    table = np.arange(256, dtype=np.uint32)
    for _ in range(8):
        table = np.where(table & 1, (table >> 1) ^ CASTAGNOLI_POLYNOMIAL, table >> 1).astype(np.uint32)
    return table


_TABLE = _byte_table()
_TABLE_INTS = _TABLE.tolist()


def _byte_tables_of(images_of_bits: np.ndarray) -> np.ndarray:
    """(4, 256) tables applying the GF(2)-linear map with ``images_of_bits[i] = F(1 << i)`` bytewise."""
    tables = np.zeros((4, 256), dtype=np.uint32)
    for byte in range(4):
        for bit in range(8):
            span = 1 << bit
            tables[byte, span : 2 * span] = tables[byte, :span] ^ images_of_bits[8 * byte + bit]
    return tables


def _apply(tables: np.ndarray, registers: np.ndarray) -> np.ndarray:
    return (
        tables[0, registers & 0xFF]
        ^ tables[1, (registers >> 8) & 0xFF]
        ^ tables[2, (registers >> 16) & 0xFF]
        ^ tables[3, registers >> 24]
    )


def _zero_bytes_tables() -> list[np.ndarray]:
    """Entry t advances a register over 2**t zero bytes, up to protobuf's 2 GiB limit on a message.

    Built once, at import: the writer's thread and the training thread may both checksum.
    """
    bits = np.uint32(1) << np.arange(32, dtype=np.uint32)
    tables = [_byte_tables_of(_TABLE[bits & 0xFF] ^ (bits >> 8))]
    for _ in range(31):
        tables.append(_byte_tables_of(_apply(tables[-1], _apply(tables[-1], bits))))
    return tables


_ZERO_BYTES_TABLES = _zero_bytes_tables()


def _register_after_bytes(register: int, data: bytes) -> int:
    for byte in data:
        register = _TABLE_INTS[(register ^ byte) & 0xFF] ^ (register >> 8)
    return register


def _register_after_bytes_from_ones(data: bytes) -> int:
    """The register after ``data`` (at least 4 bytes) from 0xFFFFFFFF, by lanes of ``LANE_BYTES`` run side by
    side, then merged in pairs.

    Starting from 0xFFFFFFFF is starting from 0 with the first four bytes complemented, and zero bytes leave
    a zero register unchanged, so the data is padded in front to whole lanes. With R(a) the register after
    bytes ``a`` from 0, R(a + b) = Z^len(b) R(a) ^ R(b), where Z^m advances a register over m zero bytes.
    """
    lanes = -(-len(data) // LANE_BYTES)
    padded = np.zeros(lanes * LANE_BYTES, dtype=np.uint8)
    start = padded.size - len(data)
    padded[start:] = np.frombuffer(data, dtype=np.uint8)
    padded[start : start + 4] ^= 0xFF
    registers = np.zeros(lanes, dtype=np.uint32)
    for column in padded.reshape(lanes, LANE_BYTES).T.copy():
        registers = np.take(_TABLE, registers.astype(np.uint8) ^ column) ^ (registers >> 8)
    power = LANE_BYTES.bit_length() - 1
    while registers.size > 1:
        if registers.size % 2:  # a zero lane in front: more leading zeros
            registers = np.concatenate((np.zeros(1, dtype=np.uint32), registers))
        registers = _apply(_ZERO_BYTES_TABLES[power], registers[0::2]) ^ registers[1::2]
        power += 1
    return int(registers[0])


def crc32c(data: bytes) -> int:
    """CRC-32C (Castagnoli) of ``data``, as iSCSI, ext4 and TFRecord define it."""
    if len(data) < VECTORISED_FROM_BYTES:
        return _register_after_bytes(0xFFFFFFFF, data) ^ 0xFFFFFFFF
    return _register_after_bytes_from_ones(data) ^ 0xFFFFFFFF


def masked_crc32c(data: bytes) -> int:
    """TFRecord's masked checksum: the CRC rotated right by 15 bits, plus a constant."""
    crc = crc32c(data)
    return (((crc >> 15) | (crc << 17)) + _MASK_DELTA) & 0xFFFFFFFF


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
