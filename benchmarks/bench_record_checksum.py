"""Benchmark: the event records' masked CRC-32C, ``spectral_monitor.sinks.tfrecord`` against TensorBoard's.

TensorBoard without TensorFlow checksums each record a byte at a time in pure Python; the sink's writer
uses the vectorised one instead. Sizes: an event header (8 bytes), a small event, a demo logging step's
scalars and histograms (≈ 70 KB) and a large PNG. Both functions run on the same random bytes in one
process, alternating, and must agree.

    python benchmarks/bench_record_checksum.py --repeats 5
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
from _common import describe_machine, markdown_table
from tensorboard.compat.tensorflow_stub.pywrap_tensorflow import masked_crc32c as tensorboard_masked_crc32c

from spectral_monitor.sinks.tfrecord import masked_crc32c

SIZES = (8, 1024, 4096, 70_000, 1_000_000)


def seconds(checksum, data: bytes) -> tuple[float, int]:
    start = time.perf_counter()
    value = checksum(data)
    return time.perf_counter() - start, value


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    rows = []
    for size in SIZES:
        data = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8).tobytes()
        ours, theirs = [], []
        for _ in range(args.repeats):
            elapsed, mine = seconds(masked_crc32c, data)
            ours.append(elapsed)
            elapsed, reference = seconds(tensorboard_masked_crc32c, data)
            theirs.append(elapsed)
            if mine != reference:
                raise SystemExit(f"checksums differ at {size} bytes: {mine:#x} != {reference:#x}")
        mine_ms, theirs_ms = 1000 * statistics.median(ours), 1000 * statistics.median(theirs)
        rows.append([f"{size:,}", f"{theirs_ms:.3f}", f"{mine_ms:.3f}", f"{theirs_ms / mine_ms:.1f}×"])
    print(describe_machine())
    print(f"\nmedian of {args.repeats} alternating calls each, same bytes, checksums equal\n")
    print(markdown_table(["bytes", "TensorBoard (ms)", "spectral-monitor (ms)", "speed-up"], rows))


if __name__ == "__main__":
    main()
