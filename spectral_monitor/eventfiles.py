"""TensorBoard event files read as TensorBoard's loader reads them, and past the damage a killed run or a bad
disk leaves, saying where each file was cut and why.

An event file is a sequence of TFRecords: an 8-byte little-endian length, the masked CRC-32C of those 8
bytes, the serialised ``Event``, and the masked CRC-32C of the event. TensorBoard's loader stops at the first
record it cannot read, silently: every later step of that file is lost, and the last step before the damage
looks like the run's latest. Here each damage is a :class:`Cut`, and reading goes on where the framing
allows:

- a record whose event fails its CRC (or does not parse) while its length passed its own CRC: the length is
  trusted, that one record is skipped and reading goes on after it;
- a length that fails its CRC, or points past the end of the file while more records could follow: the
  length cannot be trusted, so reading resynchronises at the next offset where a whole record checks (a
  length whose CRC matches, and an event of that length whose CRC matches too: two 32-bit checks, so a false
  match is about one in 2⁶⁴ offsets), and says how many bytes it skipped;
- a file that ends inside a record (a run killed while writing): nothing follows, reading stops there.

Memory is bounded whatever a length field says: the file is read through ``mmap``, a record is sliced out
only once its end is known to lie inside the file, and at most ``BATCH_BYTES`` of records wait for their
checksums at once. Nothing here imports torch.
"""

from __future__ import annotations

import mmap
import os
import struct
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from google.protobuf.message import DecodeError
from tensorboard.compat.proto.event_pb2 import Event

from spectral_monitor.checksum import BATCH_BYTES, masked_crc32c, masked_crc32c_of_each

__all__ = ["Cut", "EventFile", "read_event_file"]

_HEADER = 12  # length (8 bytes) and its masked CRC (4)
_FOOTER = 4  # the event's masked CRC
_LENGTH = struct.Struct("<Q")
_CRC = struct.Struct("<I")


@dataclass(frozen=True)
class Cut:
    """Where a file was damaged.

    Attributes:
        offset: The byte the damage starts at.
        after_step: The step of the last event read before it; None when none was.
        why: ``"truncated"``, ``"bad length CRC"``, ``"bad data CRC"``, ``"oversized length"`` or
            ``"unparseable event"``, with details.
        resumed_at: The byte reading resumed at; None: it could not.

    Examples:
        >>> Cut(100, 4, "bad data CRC", 140).describe()
        'cut at byte 100 (after step 4): bad data CRC; skipped 40 bytes, read on from byte 140'
    """

    offset: int
    after_step: int | None
    why: str
    resumed_at: int | None

    def describe(self) -> str:
        """The cut in one line.

        Returns:
            Where, why, and what was lost.
        """
        after = "before any step" if self.after_step is None else f"after step {self.after_step}"
        if self.resumed_at is None:
            lost = "nothing after it could be read"
        else:
            lost = f"skipped {self.resumed_at - self.offset} bytes, read on from byte {self.resumed_at}"
        return f"cut at byte {self.offset} ({after}): {self.why}; {lost}"


@dataclass
class EventFile:
    """The events of one file, in file order, and the cuts found in it.

    Attributes:
        path: The file.
        events: The events read, in file order (the first is the file's version header).
        cuts: Each damage found, in file order.

    Examples:
        >>> import os, tempfile
        >>> from tensorboard.compat.proto.summary_pb2 import Summary
        >>> from spectral_monitor.sinks.tfrecord import EventFile as EventWriter
        >>> with tempfile.TemporaryDirectory() as run:
        ...     writer = EventWriter(run)
        ...     for step in range(3):
        ...         writer.add_summary(Summary(value=[Summary.Value(tag="a", simple_value=step)]), step=step)
        ...     writer.close()
        ...     path = os.path.join(run, os.listdir(run)[0])
        ...     os.truncate(path, os.path.getsize(path) - 5)  # a run killed while writing step 2
        ...     read = read_event_file(path)
        >>> [event.step for event in read.events], [cut.why.split(":")[0] for cut in read.cuts]
        ([0, 0, 1], ['truncated'])
    """

    path: Path
    events: list[Event] = field(default_factory=list)
    cuts: list[Cut] = field(default_factory=list)


def read_event_file(path: str | os.PathLike[str]) -> EventFile:
    """Read an event file past its damage.

    Args:
        path: The event file.

    Returns:
        Every event that can be read, and a :class:`Cut` for each damage.

    Raises:
        OSError: if the file cannot be opened or read.

    Examples:
        >>> import os, tempfile
        >>> from tensorboard.compat.proto.summary_pb2 import Summary
        >>> from spectral_monitor.sinks.tfrecord import EventFile as EventWriter
        >>> with tempfile.TemporaryDirectory() as run:
        ...     writer = EventWriter(run)
        ...     for step in range(3):
        ...         writer.add_summary(Summary(value=[Summary.Value(tag="a", simple_value=step)]), step=step)
        ...     writer.close()
        ...     path = os.path.join(run, os.listdir(run)[0])
        ...     os.truncate(path, os.path.getsize(path) - 5)  # a run killed while writing step 2
        ...     read = read_event_file(path)
        >>> read.cuts[0].describe()  # doctest: +ELLIPSIS
        'cut at byte 116 (after step 1): truncated: a record of 23 bytes runs past the end ...'
    """
    result = EventFile(Path(path))
    with open(path, "rb") as file:
        size = os.fstat(file.fileno()).st_size
        if size == 0:
            return result
        with mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as data:
            for event, cut in _records(data, size):
                if cut is not None:
                    last = result.events[-1].step if result.events else None
                    result.cuts.append(Cut(cut[0], last, cut[1], cut[2]))
                if event is not None:
                    result.events.append(event)
    return result


def _records(data: mmap.mmap, size: int) -> Iterator[tuple[Event | None, tuple[int, str, int | None] | None]]:
    """(event, None) for each readable record; (None, (offset, why, resumed at)) for each damage.

    Where a record ends is read from its framing alone, so the walk over the framing goes ahead and the
    events' checksums are computed a batch of records at a time (:func:`_checked`)."""
    framed: list[tuple[int, int]] = []  # (offset, end) of records walked over, not yet checked
    framed_bytes = 0
    offset = 0
    while offset < size:
        if size - offset < _HEADER + _FOOTER:
            yield from _checked(data, framed)
            yield None, (offset, f"truncated: {size - offset} bytes, less than a record's framing", None)
            return
        header = data[offset : offset + 8]
        (length,) = _LENGTH.unpack(header)
        end = offset + _HEADER + length + _FOOTER
        if not _header_checks(data, offset):
            why = "bad length CRC"
        elif end > size:
            why = f"a record of {length} bytes runs past the end of the file"
        else:
            # The length passed its CRC: trusted, so an event that fails its own loses only its record.
            framed.append((offset, end))
            framed_bytes += length
            if framed_bytes >= BATCH_BYTES:
                yield from _checked(data, framed)
                framed, framed_bytes = [], 0
            offset = end
            continue
        yield from _checked(data, framed)
        framed, framed_bytes = [], 0
        resumed = _resynchronised(data, size, offset + 1)
        if resumed is None and why.startswith("a record"):
            why = f"truncated: {why}"
        elif resumed is not None and why.startswith("a record"):
            why = f"oversized length: {why}, yet a whole record follows"
        yield None, (offset, why, resumed)
        if resumed is None:
            return
        offset = resumed
    yield from _checked(data, framed)


def _checked(
    data: mmap.mmap, framed: list[tuple[int, int]]
) -> Iterator[tuple[Event | None, tuple[int, str, int | None] | None]]:
    """The records framed at (offset, end), in order, as :func:`_records` yields them: each event whose
    masked CRC checks and that parses, else a cut of that record alone."""
    payloads = [data[offset + _HEADER : end - _FOOTER] for offset, end in framed]
    for (offset, end), payload, checksum in zip(
        framed, payloads, masked_crc32c_of_each(payloads), strict=True
    ):
        if checksum != _CRC.unpack(data[end - _FOOTER : end])[0]:
            yield None, (offset, "bad data CRC", end)
            continue
        event = Event()
        try:
            event.ParseFromString(payload)
        except DecodeError:
            yield None, (offset, "unparseable event", end)
        else:
            yield event, None


def _header_checks(data: mmap.mmap, offset: int) -> bool:
    """Whether the length at ``offset`` matches its masked CRC."""
    return masked_crc32c(data[offset : offset + 8]) == _CRC.unpack(data[offset + 8 : offset + _HEADER])[0]


def _resynchronised(data: mmap.mmap, size: int, start: int) -> int | None:
    """The first offset from ``start`` where a whole record checks (a length inside the file, its CRC, then
    the event's CRC); None if there is none before the end."""
    for offset in range(start, size - _HEADER - _FOOTER + 1):
        (length,) = _LENGTH.unpack(data[offset : offset + 8])
        end = offset + _HEADER + length + _FOOTER
        if end > size or not _header_checks(data, offset):
            continue
        if masked_crc32c(data[offset + _HEADER : end - _FOOTER]) == _CRC.unpack(data[end - _FOOTER : end])[0]:
            return offset
    return None
