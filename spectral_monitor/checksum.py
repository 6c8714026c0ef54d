"""CRC-32C (Castagnoli) and TFRecord's masked checksum, computed over many lanes of the data at once.

TensorBoard's own checksum without TensorFlow
(``tensorboard.compat.tensorflow_stub.pywrap_tensorflow.crc32c``) takes a byte at a time in pure Python. Here
CRC's linearity over GF(2) lets numpy run lanes of the data side by side and combine them exactly, bit for bit
what TensorBoard computes. Used to write the monitor's event records (:mod:`spectral_monitor.sinks.tfrecord`)
and to read event files back (:mod:`spectral_monitor.eventfiles`); nothing here imports torch.
"""

from __future__ import annotations

import numpy as np

__all__ = ["LANE_BYTES", "VECTORISED_FROM_BYTES", "crc32c", "masked_crc32c"]

CASTAGNOLI_POLYNOMIAL = 0x82F63B78  # CRC-32C, bit-reflected
_MASK_DELTA = 0xA282EAD8  # TFRecord's checksum mask
# The lane width and the length from which lanes pay for their fixed cost are measured choices
# (benchmarks/README.md); shorter records, such as an event's 8-byte header, take the byte loop.
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
    if len(data) < VECTORISED_FROM_BYTES:
        return _register_after_bytes(0xFFFFFFFF, data) ^ 0xFFFFFFFF
    return _register_after_bytes_from_ones(data) ^ 0xFFFFFFFF


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
    crc = crc32c(data)
    return (((crc >> 15) | (crc << 17)) + _MASK_DELTA) & 0xFFFFFFFF
