"""The capsule file: what a capsule needs to outlive the process, checked field by field on read.

Layout (little endian):
    magic    8 bytes   b"FRTCAPS\\x00"
    version  u32       2 (version 1, without `pinned`, is still read, as unpinned)
    hlen     u32       length of the header, 2 .. 1 MiB
    header   hlen      UTF-8 JSON object: fingerprint, layout, nbytes, checksum, id, name,
                       session, parent_id, step, stamp, pinned
    payload  nbytes    the arena bytes
    digest   32 bytes  SHA-256 over everything before it

The reader never trusts the folder: it opens without following symlinks and without blocking,
takes regular files only, reads the fixed head and the header first, and reads the payload only
when the file's size is exactly what the header says (and the caller's check accepted the
header), so a FIFO, a link to /dev/zero or a sparse giant file costs nothing. Every problem is a
CorruptCapsule naming the file.

Writes are atomic: an exclusive temp file in the target folder (`.<name>.<random>.tmp`, made by
mkstemp, never following a planted link), fsync, then a link (no overwrite) or a rename onto the
target, fsync of the folder.
"""

from __future__ import annotations

import errno
import hashlib
import json
import math
import os
import re
import stat
import struct
import tempfile
from collections.abc import Callable
from pathlib import Path

import numpy as np

from flashrt_ros.capsules.names import CAPSULE_NAME, SESSION_NAME
from flashrt_ros.errors import CorruptCapsule

MAGIC = b"FRTCAPS\x00"
VERSION = 2
READS = (1, 2)  # versions this build reads
MAX_HEADER = 1 << 20
SUFFIX = ".fcap"
HEAD = 16  # magic + version + hlen
DIGEST = 32
# temp files of a write: ".<target>.<random>.tmp" (mkstemp) and, from older builds,
# ".<target>.tmp<pid>"; both are ours to remove when a killed write left them behind
TEMP = re.compile(r"\..+\.fcap\.(?:tmp[0-9]*|[A-Za-z0-9_]+\.tmp)")
_FIELDS = {
    "fingerprint": str,
    "layout": list,
    "nbytes": int,
    "checksum": str,
    "id": str,
    "name": str,
    "session": str,
    "parent_id": str,
    "step": int,
    "stamp": float,
}
_ROW = {"name": str, "dtype": str, "shape": list, "role": str, "offset": int, "nbytes": int}
_CHUNK = 1 << 24


class _NonFinite:
    """Stands for a NaN/Infinity token of the header JSON, which no field accepts."""


def write_capsule_file(
    path: str | Path, header: dict, payload: bytes, *, overwrite: bool = True
) -> Path:
    """Write atomically; a crash leaves either the old file or the new one, never a torn one.
    With overwrite=False an existing target (a link included) raises FileExistsError."""
    path = Path(path)
    if len(payload) != header["nbytes"]:
        raise ValueError("payload size does not match header nbytes")
    header = {"pinned": False, **header}
    hjson = json.dumps(header, sort_keys=True).encode()
    head = MAGIC + struct.pack("<II", VERSION, len(hjson)) + hjson
    digest = hashlib.sha256(head)
    digest.update(payload)
    fd, name = tempfile.mkstemp(dir=path.parent, prefix=_temp_prefix(path.name), suffix=".tmp")
    tmp = Path(name)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(head)
            fh.write(payload)
            fh.write(digest.digest())
            fh.flush()
            os.fsync(fh.fileno())
        if overwrite:
            os.replace(tmp, path)
        else:
            _link_new(tmp, path)
    finally:
        if os.path.lexists(tmp):
            tmp.unlink()
    dfd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)
    return path


NAME_MAX = 255  # bytes of one file name on Linux file systems


def _temp_prefix(name: str) -> str:
    """`.<name>.`, or for a name near NAME_MAX (mkstemp adds 8 characters and ".tmp") a shorter
    one that keeps its ending (`.fcap.`: the start's cleanup still knows it) and a hash of it."""
    prefix = f".{name}."
    if len(prefix.encode()) + 12 <= NAME_MAX:
        return prefix
    tail = ".fcap." if name.endswith(".fcap") else "."
    tag = hashlib.sha256(name.encode()).hexdigest()[:12]
    return f".{name.encode()[:160].decode(errors='ignore')}~{tag}{tail}"


def _link_new(tmp: Path, path: Path) -> None:
    """Give `tmp` the name `path` only if nothing has that name (FileExistsError otherwise)."""
    try:
        os.link(tmp, path)
    except FileExistsError:
        raise
    except OSError as e:
        if e.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.ENOSYS):
            raise
        # no hard links here: claim the name exclusively, then rename over our own placeholder
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644))
        os.replace(tmp, path)


def read_capsule_header(path: str | Path) -> dict:
    """The checked header of a capsule file, without reading its payload."""
    path = Path(path)
    fd = _open(path)
    try:
        return _read_head(fd, path)[0]
    finally:
        os.close(fd)


def read_capsule_file(
    path: str | Path, check: Callable[[dict], None] | None = None
) -> tuple[dict, bytearray]:
    """Read and check structure, sizes, the file digest and that float state is finite;
    `check(header)` runs before the payload is read (a caller refuses foreign layouts there).
    CorruptCapsule says what is wrong."""
    path = Path(path)
    fd = _open(path)
    try:
        header, head = _read_head(fd, path)
        if check is not None:
            check(header)
        nbytes = header["nbytes"]
        digest = hashlib.sha256(head)
        payload = bytearray(nbytes)
        view = memoryview(payload)
        got = 0
        while got < nbytes:
            n = os.readv(fd, [view[got : got + _CHUNK]])
            if n == 0:
                raise CorruptCapsule(f"{path}: truncated while reading the payload")
            got += n
        digest.update(payload)
        tail = _read_exact(fd, DIGEST + 1, path)
    finally:
        os.close(fd)
    if len(tail) != DIGEST:
        raise CorruptCapsule(f"{path}: file size changed while reading")
    if digest.digest() != tail:
        raise CorruptCapsule(f"{path}: corrupted: file digest does not match its contents")
    check_finite(header, payload, path)
    return header, payload


def check_finite(header: dict, payload: bytes | bytearray, path: str | Path) -> None:
    """CorruptCapsule when a floating-point region of the layout holds NaN or Inf: a capsule
    with a non-finite state must never reach a session."""
    for row in header["layout"]:
        kind = row["dtype"]
        raw = np.frombuffer(payload, dtype=np.uint8, count=row["nbytes"], offset=row["offset"])
        if kind in ("float16", "float32", "float64", "complex64", "complex128"):
            bad = ~np.isfinite(raw.view(np.dtype(kind)))
        elif kind == "bfloat16":  # exponent all ones is Inf or NaN
            bad = (raw.view(np.uint16) & 0x7F80) == 0x7F80
        elif kind == "float8_e5m2":
            bad = (raw & 0x7C) == 0x7C
        elif kind == "float8_e4m3fn":  # no Inf; NaN is S.1111.111
            bad = (raw & 0x7F) == 0x7F
        else:
            continue
        if bad.any():
            raise CorruptCapsule(
                f"{path}: state {row['name']!r} holds NaN or Inf (first at element "
                f"{int(np.argmax(bad))}); a non-finite state is never loaded"
            )


# -- reading -------------------------------------------------------------------------------------
def _open(path: Path) -> int:
    """A descriptor of a regular file; never follows a final symlink, never blocks on a FIFO."""
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(path, flags)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise CorruptCapsule(f"{path}: is a symlink; capsule files are never followed") from e
        raise CorruptCapsule(f"{path}: cannot read capsule file ({e.strerror})") from None
    except (TypeError, ValueError) as e:
        raise CorruptCapsule(f"{path!r}: not a file path ({e})") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise CorruptCapsule(f"{path}: not a regular file (FIFO, device or folder)")
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _read_exact(fd: int, n: int, path: Path) -> bytes:
    """Up to n bytes (fewer only at the end of the file)."""
    parts, left = [], n
    while left:
        try:
            b = os.read(fd, min(left, _CHUNK))
        except OSError as e:
            raise CorruptCapsule(f"{path}: cannot read capsule file ({e.strerror})") from None
        if not b:
            break
        parts.append(b)
        left -= len(b)
    return b"".join(parts)


def _read_head(fd: int, path: Path) -> tuple[dict, bytes]:
    """The checked header, and the bytes it came from (the digest covers them)."""
    size = os.fstat(fd).st_size
    fixed = _read_exact(fd, HEAD, path)
    if len(fixed) < HEAD or fixed[:8] != MAGIC:
        raise CorruptCapsule(f"{path}: not a flashrt capsule file (bad magic)")
    version, hlen = struct.unpack("<II", fixed[8:16])
    if version not in READS:
        raise CorruptCapsule(
            f"{path}: capsule file version {version}, this build reads {', '.join(map(str, READS))}"
        )
    if not 2 <= hlen <= MAX_HEADER or HEAD + hlen > size:
        raise CorruptCapsule(f"{path}: header length {hlen} out of bounds (truncated file?)")
    raw = _read_exact(fd, hlen, path)
    if len(raw) != hlen:
        raise CorruptCapsule(f"{path}: truncated header")
    header = _parse(raw, path)
    _check_fields(header, version, path)
    expected = HEAD + hlen + header["nbytes"] + DIGEST
    if size != expected:
        what = "truncated" if size < expected else f"{size - expected} trailing bytes"
        raise CorruptCapsule(f"{path}: file size {size}, header says {expected} ({what})")
    return header, fixed + raw


def _parse(raw: bytes, path: Path) -> dict:
    try:
        header = json.loads(raw.decode("utf-8"), parse_constant=lambda _: _NonFinite())
    except UnicodeDecodeError as e:
        raise CorruptCapsule(f"{path}: corrupted header (not UTF-8: {e.reason})") from None
    except RecursionError:
        raise CorruptCapsule(f"{path}: corrupted header (nested too deep)") from None
    except ValueError as e:  # JSONDecodeError, and integers too long to parse
        raise CorruptCapsule(f"{path}: corrupted header ({e})") from None
    if not isinstance(header, dict):
        raise CorruptCapsule(f"{path}: header is not an object")
    return header


def _typed(val: object, typ: type) -> bool:
    if typ is float:
        return isinstance(val, int | float) and not isinstance(val, bool)
    return isinstance(val, typ) and not (typ is int and isinstance(val, bool))


def _check_fields(header: dict, version: int, path: Path) -> None:
    for key, typ in _FIELDS.items():
        if not _typed(header.get(key), typ):
            raise CorruptCapsule(f"{path}: header field {key!r} missing or not {typ.__name__}")
    if version == 1:
        header.setdefault("pinned", False)  # version 1 had no pins: read as unpinned
    if not isinstance(header.get("pinned"), bool):
        raise CorruptCapsule(f"{path}: header field 'pinned' missing or not bool")
    nbytes = header["nbytes"]
    if not 0 < nbytes < 2**63 or not 0 <= header["step"] < 2**63:
        raise CorruptCapsule(f"{path}: header sizes out of bounds")
    try:
        stamp = float(header["stamp"])
    except OverflowError:
        stamp = math.inf
    if not math.isfinite(stamp) or stamp < 0:
        raise CorruptCapsule(f"{path}: header stamp is not a time")
    header["stamp"] = stamp
    # ids and names become file names and lookup keys: the same rules as live ones
    for key, rule, empty_ok in (
        ("id", CAPSULE_NAME, False),
        ("name", CAPSULE_NAME, True),
        ("parent_id", CAPSULE_NAME, True),
        ("session", SESSION_NAME, False),
    ):
        if not (header[key] == "" and empty_ok) and not rule.fullmatch(header[key]):
            raise CorruptCapsule(f"{path}: header field {key!r} = {header[key]!r} is not allowed")
    for i, row in enumerate(header["layout"]):
        ok = isinstance(row, dict) and all(_typed(row.get(k), t) for k, t in _ROW.items())
        if ok:
            size = _itemsize(row["dtype"])
            off, n = row["offset"], row["nbytes"]
            ok = 0 <= off and 0 <= n and off + n <= nbytes
            ok = ok and (size is None or row["nbytes"] % size == 0)
        if not ok:
            raise CorruptCapsule(f"{path}: header layout row {i} is malformed or out of bounds")


def _itemsize(kind: str) -> int | None:
    """Bytes per element of the float dtypes check_finite reads (None: not checked)."""
    return {
        "float16": 2,
        "bfloat16": 2,
        "float32": 4,
        "float64": 8,
        "complex64": 8,
        "complex128": 16,
        "float8_e5m2": 1,
        "float8_e4m3fn": 1,
    }.get(kind)
