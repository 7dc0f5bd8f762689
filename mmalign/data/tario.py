"""A small tar reader that knows where every sample starts.

Exact resume needs to re-open a shard at the sample where reading stopped and to
re-read single buffered samples, so each sample carries the byte offset of its first
header.  Python's ``tarfile`` hides those positions in streaming mode; this reader
parses the 512-byte ustar headers itself (plus GNU long names and pax ``path``
records, which Python's and webdataset's writers emit for long names).

A sample is the run of consecutive regular members that share a key: the member
path up to the first dot of its basename, as WebDataset defines it.

Reads are bounded: a member larger than ``max_member`` bytes is never read (it is
skipped by seeking, which a ``.tar.gz`` does by decompressing in small blocks) and
is reported in ``RawSample.oversized``; long-name and pax headers are capped at
``MAX_NAME_HEADER`` bytes.
"""

from __future__ import annotations

import gzip
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import BinaryIO, Protocol

from mmalign.data.remote import RemoteFile, RemoteOptions, is_gzip_name, kind_of, local_path

BLOCK = 512
MAX_NAME_HEADER = 1 << 20  # a GNU long name or pax record set larger than this is corrupt


class ShardFile(Protocol):
    """What the readers ask of a shard: a local file, a gunzipped stream, a RemoteFile."""

    def read(self, n: int = -1, /) -> bytes: ...

    def seek(self, offset: int, whence: int = 0, /) -> int: ...

    def tell(self) -> int: ...


class Oversized:
    """Stands for the data of a member that was not read because of its size."""

    def __init__(self, size: int):
        self.size = size


class TruncatedTar(Exception):
    """The archive ended inside a header or a member (a partial copy or download).

    ``name`` is the member whose data was cut, when its header was still whole;
    ``at_boundary``: the archive ended between two members (the members before it are whole).
    """

    def __init__(self, message: str, name: str | None = None, at_boundary: bool = False):
        super().__init__(message)
        self.name, self.at_boundary = name, at_boundary


class CorruptTar(Exception):
    """A header failed its checksum: the bytes are not a tar from here on."""


@dataclass
class RawSample:
    key: str  # member path up to the first dot of the basename
    offset: int  # byte offset of the sample's first header
    end: int  # byte offset just past the sample's last member
    index: int  # position of the sample in its shard (0-based)
    members: dict[str, bytes] = field(default_factory=dict)  # extension (lower case) -> bytes
    oversized: dict[str, int] = field(default_factory=dict)  # extension -> size of a member too large to read
    unsafe: bool = False  # its name would extract outside the folder (unsafe_name): members left unread


def _octal(field_bytes: bytes) -> int:
    if field_bytes and field_bytes[0] & 0x80:  # GNU base-256 for sizes >= 8 GiB
        value = int.from_bytes(field_bytes[1:], "big")
        return value
    text = field_bytes.rstrip(b"\0 ").strip()
    try:
        return int(text, 8) if text else 0
    except ValueError:
        raise CorruptTar(f"header field {bytes(field_bytes)!r} is not an octal number") from None


def _checksum_ok(header: bytes) -> bool:
    stored = _octal(header[148:156])
    unsigned = sum(header[:148]) + 8 * 32 + sum(header[156:])
    return stored == unsigned


def _pax_path(data: bytes) -> str | None:
    """The ``path`` record of a pax extended header (``"%d path=%s\\n"`` records)."""
    pos = 0
    while pos < len(data):
        space = data.find(b" ", pos)
        if space < 0:
            break
        try:
            length = int(data[pos:space])
        except ValueError:
            raise CorruptTar("malformed pax header") from None
        if length <= 0:
            raise CorruptTar("malformed pax header")
        record = data[space + 1 : pos + length - 1]
        pos += length
        if record.startswith(b"path="):
            return record[5:].decode("utf-8", "surrogateescape")
    return None


OpenShard = BinaryIO | gzip.GzipFile | RemoteFile  # what open_shard returns (each a ShardFile)


class _GzipShard(gzip.GzipFile):
    """A gzip stream over a remote shard file, closing that file with itself."""

    needs_end_marker = True  # a remote stream's end is checked (see iter_members)

    def __init__(self, raw: RemoteFile):
        super().__init__(fileobj=raw, mode="rb")
        self._raw = raw

    def close(self) -> None:
        try:
            super().close()
        finally:
            self._raw.close()


def open_shard(path: str, remote: RemoteOptions | None = None) -> OpenShard:
    """A shard spec -> a readable, seekable file.

    Local: plain ``.tar`` (seekable, cheap) or ``.tar.gz``/``.tgz`` (seekable, slow).
    ``http(s)://`` and fsspec URLs: a :class:`~mmalign.data.remote.RemoteFile` (``remote`` says
    how it retries), gunzipped by the same names.  ``pipe:CMD``: the command's output, gunzipped
    when it starts with gzip's magic (the command may well decompress itself).
    """
    kind = kind_of(path)
    if kind == "local":
        path = local_path(path)
        if path.endswith((".gz", ".tgz")):
            return gzip.open(path, "rb")
        return open(path, "rb")
    raw = RemoteFile(path, remote)
    if kind != "pipe":
        return _GzipShard(raw) if is_gzip_name(path) else raw
    try:  # a pipe is read from its start anyway: sniffing costs nothing
        magic = raw.read(2)
        raw.seek(0)  # served from the remote file's window
    except BaseException:
        raw.close()
        raise
    return _GzipShard(raw) if magic == b"\x1f\x8b" else raw


def iter_members(
    f: ShardFile, offset: int = 0, *, want=None, max_member: int | None = None
) -> Iterator[tuple[int, int, str, bytes | Oversized | None]]:
    """Yield ``(header_offset, next_offset, name, data)`` for regular members from ``offset``.

    ``want(name) -> bool`` decides whether a member's data is read (True) or skipped
    by seeking (data is then None).  A wanted member of more than ``max_member``
    bytes is skipped too, its data an :class:`Oversized`.  Raises TruncatedTar / CorruptTar.
    """
    f.seek(offset)
    pos = offset
    long_name: str | None = None
    start: int | None = None  # first header of a member that spans extra headers
    while True:
        header = f.read(BLOCK)
        if len(header) == 0:
            if getattr(
                f, "needs_end_marker", False
            ):  # a remote body cut at a header boundary: no silent loss
                raise TruncatedTar(
                    f"archive ends at byte {pos} without its end-of-archive blocks "
                    "(the remote stream was cut short)",
                    at_boundary=True,
                )
            return  # a local file without the end-of-archive blocks: lenient, like tarfile
        if len(header) < BLOCK:
            raise TruncatedTar(f"archive ends inside a header at byte {pos}")
        if header == b"\0" * BLOCK:
            return  # end-of-archive marker
        if not _checksum_ok(header):
            raise CorruptTar(f"bad header checksum at byte {pos}")
        if start is None:
            start = pos
        size = _octal(header[124:136])
        kind = header[156:157]
        padded = (size + BLOCK - 1) // BLOCK * BLOCK
        data_pos = pos + BLOCK
        pos = data_pos + padded
        if kind in (b"L", b"x"):  # the next member's real name
            if size > MAX_NAME_HEADER:
                raise CorruptTar(f"a {size}-byte name header at byte {data_pos - BLOCK}")
            payload = f.read(padded)
            if len(payload) < size:
                raise TruncatedTar(f"archive ends inside a long-name header at byte {data_pos}")
            payload = payload[:size]
            long_name = (
                payload.rstrip(b"\0").decode("utf-8", "surrogateescape")
                if kind == b"L"
                else _pax_path(payload)
            )
            continue
        if kind not in (b"0", b"\0", b"7"):  # directories, links, global pax headers, ...
            f.seek(pos)
            long_name, start = None, None
            continue
        name = long_name
        if name is None:
            name = header[:100].rstrip(b"\0").decode("utf-8", "surrogateescape")
            prefix = header[345:500].rstrip(b"\0")
            if header[257:262] == b"ustar" and prefix:
                name = prefix.decode("utf-8", "surrogateescape") + "/" + name
        long_name = None
        member_start, start = start, None
        data: bytes | Oversized | None
        if (want is None or want(name)) and max_member is not None and size > max_member:
            f.seek(pos)
            data = Oversized(size)
        elif want is None or want(name):
            data = f.read(size)
            if len(data) < size:
                raise TruncatedTar(f"archive ends inside member {name!r}", name=name)
            f.seek(pos)
        else:
            f.seek(pos)
            data = None
        yield member_start, pos, name, data


def unsafe_name(name: str) -> bool:
    """A member name that extracting would write outside the target folder: absolute, or with a
    ``..`` part (``../x.jpg``, ``/x.jpg``, ``a/../../x.jpg``; ``\\`` counts as a separator too,
    as it does where the output may be extracted). Such a sample is refused, never copied."""
    return name.startswith(("/", "\\")) or ".." in re.split(r"[/\\]", name)


def split_name(name: str) -> tuple[str, str] | None:
    """``dir/KEY.a.b`` -> (``dir/KEY``, ``a.b``); names without a dot are no sample part."""
    slash = name.rfind("/")
    base = name[slash + 1 :]
    dot = base.find(".")
    if dot <= 0:
        return None
    return name[: slash + 1 + dot].removeprefix("./"), base[dot + 1 :].lower()


def iter_samples(
    f: ShardFile, offset: int = 0, index: int = 0, *, keep=None, max_member: int | None = None
) -> Iterator[RawSample]:
    """Group members into samples, starting at the sample whose first header is at ``offset``.

    ``keep(index) -> bool`` lets a reader skip whole samples without reading their
    bytes (sample-granular splitting); skipped samples are yielded with empty members.
    A truncated tail raises TruncatedTar after the complete samples before it.
    Members over ``max_member`` bytes are left unread and listed in ``oversized``; a sample
    whose name is unsafe (:func:`unsafe_name`) is yielded unread with ``unsafe`` set, for the
    reader to count as a skip.
    """
    current: RawSample | None = None
    reading = True

    def want(name: str) -> bool:
        parts = split_name(name)
        if parts is None or unsafe_name(parts[0]):
            return False
        if current is not None and parts[0] == current.key:
            return reading and not current.unsafe
        upcoming = index + 1 if current is not None else index
        return keep is None or keep(upcoming)

    members = iter_members(f, offset, want=want, max_member=max_member)
    while True:
        try:
            start, end, name, data = next(members)
        except StopIteration:
            break
        except TruncatedTar as e:
            # Cut inside the first member of the next sample: the current one is whole.
            cut = split_name(e.name) if e.name else None
            if current is not None and (e.at_boundary or (cut is not None and cut[0] != current.key)):
                yield current
            raise
        parts = split_name(name)
        if parts is None:
            continue
        key, ext = parts
        if current is None or current.key != key:
            if current is not None:
                yield current
                index += 1
            current = RawSample(key=key, offset=start, end=end, index=index, unsafe=unsafe_name(key))
            reading = (keep is None or keep(index)) and not current.unsafe
        current.end = end
        if reading and isinstance(data, Oversized):
            current.oversized[ext] = data.size
        elif reading and isinstance(data, bytes):  # read (not skipped: None)
            current.members[ext] = data
    if current is not None:
        yield current


def read_sample_at(f: ShardFile, offset: int, index: int, max_member: int | None = None) -> RawSample | None:
    """The one sample whose first header is at ``offset`` (re-reading a buffered sample)."""
    for sample in iter_samples(f, offset, index, max_member=max_member):
        return sample
    return None


def read_samples_at(
    f: ShardFile, refs: list[tuple[int, int]], max_member: int | None = None
) -> Iterator[RawSample]:
    """The samples at ``refs`` ((offset, index) pairs of one shard), in offset order, in one forward pass.

    Re-filling a shuffle buffer on resume: the shard is opened and read once, the samples
    between the wanted ones are skipped without reading their data.  A wanted sample not
    found at its offset (the shard changed since the checkpoint) raises CorruptTar.
    """
    if not refs:
        return
    wanted = {index: offset for offset, index in refs}
    need = set(wanted)
    offset, index = min(refs)
    for sample in iter_samples(f, offset, index, keep=need.__contains__, max_member=max_member):
        if sample.index not in need:
            continue
        if sample.offset != wanted[sample.index]:
            raise CorruptTar(
                f"sample {sample.index} starts at byte {sample.offset}, not {wanted[sample.index]}: "
                "the shard changed since the checkpoint"
            )
        need.discard(sample.index)
        yield sample
        if not need:
            return
    if need:
        raise CorruptTar(
            f"{len(need)} sample(s) from index {min(need)} are missing: the shard changed since "
            "the checkpoint"
        )
