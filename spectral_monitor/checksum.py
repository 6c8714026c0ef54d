"""CRC-32C (Castagnoli) and TFRecord's masked checksum, computed over many lanes of the data at once.

TensorBoard's own checksum without TensorFlow
(``tensorboard.compat.tensorflow_stub.pywrap_tensorflow.crc32c``) takes a byte at a time in pure Python. Here
CRC's linearity over GF(2) lets numpy run lanes of the data side by side and combine them exactly, bit for bit
what TensorBoard computes. Used to write the monitor's event records (:mod:`spectral_monitor.sinks.tfrecord`)
and to read event files back (:mod:`spectral_monitor.eventfiles`); nothing here imports torch.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import numpy as np

__all__ = [
    "BATCH_BYTES",
    "LANE_BYTES",
    "VECTORISED_FROM_BYTES",
    "crc32c",
    "crc32c_of_each",
    "masked_crc32c",
    "masked_crc32c_of_each",
]

CASTAGNOLI_POLYNOMIAL = 0x82F63B78  # CRC-32C, bit-reflected
_MASK_DELTA = 0xA282EAD8  # TFRecord's checksum mask
# The lane width and the length from which lanes pay for their fixed cost are measured choices
# (benchmarks/README.md); shorter records, such as an event's 8-byte header, take the byte loop.
LANE_BYTES = 32
VECTORISED_FROM_BYTES = 2048
BATCH_BYTES = 32 << 20
"""The most padded record data checksummed in one batch of :func:`crc32c_of_each`: the batch holds it twice
(the records in rows, then in lane columns) and its lanes' registers, an eighth as much."""


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


def _registers_after_bytes_from_ones(records: Sequence[bytes | memoryview]) -> list[int]:
    """The register after each record (at least 4 bytes each) from 0xFFFFFFFF, by lanes of ``LANE_BYTES``
    run side by side, then merged in pairs: the records of one batch together, each padded in front to the
    batch's longest.

    Starting from 0xFFFFFFFF is starting from 0 with the first four bytes complemented, and zero bytes leave
    a zero register unchanged, so a record is padded in front to whole lanes. With R(a) the register after
    bytes ``a`` from 0, R(a + b) = Z^len(b) R(a) ^ R(b), where Z^m advances a register over m zero bytes.
    """
    lanes = -(-max(len(record) for record in records) // LANE_BYTES)
    padded = np.zeros((len(records), lanes * LANE_BYTES), dtype=np.uint8)
    for row, record in zip(padded, records, strict=True):
        start = row.size - len(record)
        row[start:] = np.frombuffer(record, dtype=np.uint8)
        row[start : start + 4] ^= 0xFF
    registers = np.zeros((len(records), lanes), dtype=np.uint32)
    for column in np.moveaxis(padded.reshape(len(records), lanes, LANE_BYTES), 2, 0).copy():
        registers = np.take(_TABLE, registers.astype(np.uint8) ^ column) ^ (registers >> 8)
    power = LANE_BYTES.bit_length() - 1
    while registers.shape[1] > 1:
        if registers.shape[1] % 2:  # a zero lane in front: more leading zeros
            registers = np.concatenate((np.zeros((len(records), 1), dtype=np.uint32), registers), axis=1)
        registers = _apply(_ZERO_BYTES_TABLES[power], registers[:, 0::2]) ^ registers[:, 1::2]
        power += 1
    return registers[:, 0].tolist()


def _batches_of_similar_length(records: Sequence[bytes | memoryview]) -> Iterator[list[int]]:
    """Indices of the records at least ``VECTORISED_FROM_BYTES`` long, in batches of lengths within a factor
    of two of each other (front padding to the batch's longest costs at most as much again) and at most
    ``BATCH_BYTES`` of padded data each."""
    by_octave: dict[int, list[int]] = {}
    for index, record in enumerate(records):
        if len(record) >= VECTORISED_FROM_BYTES:
            by_octave.setdefault(len(record).bit_length(), []).append(index)
    for octave, indices in by_octave.items():
        per_batch = max(1, BATCH_BYTES >> octave)
        for start in range(0, len(indices), per_batch):
            yield indices[start : start + per_batch]


def crc32c(data: bytes) -> int:
    """CRC-32C (Castagnoli), as iSCSI, ext4 and TFRecord define it.

    Args:
        data: The bytes to checksum.

    Returns:
        The checksum, an unsigned 32-bit integer.

    Examples:
        The standard check value, and a long input (checksummed by lanes) against TensorBoard's byte loop:

        >>> hex(crc32c(b"123456789"))
        '0xe3069283'
        >>> from tensorboard.compat.tensorflow_stub import pywrap_tensorflow
        >>> crc32c(bytes(range(256)) * 16) == pywrap_tensorflow.crc32c(bytes(range(256)) * 16)
        True
    """
    return crc32c_of_each([data])[0]


def crc32c_of_each(records: Sequence[bytes | memoryview]) -> list[int]:
    """:func:`crc32c` of each record: those of similar length checksummed together, by lanes across all of
    them, which a file's many records of a few kilobytes need (one at a time, each pays numpy's fixed costs
    per lane column).

    Args:
        records: The byte strings to checksum.

    Returns:
        Each record's checksum, in order.

    Examples:
        >>> records = [b"123456789", bytes(range(256)) * 16, bytes(range(255)) * 9]
        >>> crc32c_of_each(records) == [crc32c(record) for record in records]
        True
    """
    checksums = [0] * len(records)
    for index, record in enumerate(records):
        if len(record) < VECTORISED_FROM_BYTES:
            checksums[index] = _register_after_bytes(0xFFFFFFFF, record) ^ 0xFFFFFFFF
    for batch in _batches_of_similar_length(records):
        registers = _registers_after_bytes_from_ones([records[index] for index in batch])
        for index, register in zip(batch, registers, strict=True):
            checksums[index] = register ^ 0xFFFFFFFF
    return checksums


def masked_crc32c(data: bytes) -> int:
    """TFRecord's masked checksum: the CRC rotated right by 15 bits, plus a constant.

    Args:
        data: The bytes to checksum.

    Returns:
        The masked checksum, an unsigned 32-bit integer.

    Examples:
        >>> hex(masked_crc32c(b"123456789"))
        '0xc78ab0e5'
    """
    return masked_crc32c_of_each([data])[0]


def masked_crc32c_of_each(records: Sequence[bytes | memoryview]) -> list[int]:
    """:func:`masked_crc32c` of each record, computed as :func:`crc32c_of_each` does.

    Args:
        records: The byte strings to checksum.

    Returns:
        Each record's masked checksum, in order.

    Examples:
        >>> [hex(checksum) for checksum in masked_crc32c_of_each([b"123456789", b""])]
        ['0xc78ab0e5', '0xa282ead8']
    """
    return [(((crc >> 15) | (crc << 17)) + _MASK_DELTA) & 0xFFFFFFFF for crc in crc32c_of_each(records)]
