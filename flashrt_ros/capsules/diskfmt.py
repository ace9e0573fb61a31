"""The capsule file: what a capsule needs to outlive the process, checked field by field on read.

Layout (little endian):
    magic    8 bytes   b"FRTCAPS\\x00"
    version  u32       1
    hlen     u32       length of the header, 2 .. 1 MiB
    header   hlen      UTF-8 JSON object: fingerprint, layout, nbytes, checksum, id, name,
                       session, parent_id, step, stamp
    payload  nbytes    the arena bytes
    digest   32 bytes  SHA-256 over everything before it

Writes are atomic: temp file in the same folder, fsync, rename, fsync of the folder.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import struct
from pathlib import Path

from flashrt_ros.capsules.names import CAPSULE_NAME, SESSION_NAME

MAGIC = b"FRTCAPS\x00"
VERSION = 1
MAX_HEADER = 1 << 20
SUFFIX = ".fcap"
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


def write_capsule_file(path: str | Path, header: dict, payload: bytes) -> Path:
    """Write atomically; a crash leaves either the old file or the new one, never a torn one."""
    path = Path(path)
    if len(payload) != header["nbytes"]:
        raise ValueError("payload size does not match header nbytes")
    hjson = json.dumps(header, sort_keys=True).encode()
    head = MAGIC + struct.pack("<II", VERSION, len(hjson)) + hjson
    digest = hashlib.sha256(head)
    digest.update(payload)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        with open(tmp, "wb") as fh:
            fh.write(head)
            fh.write(payload)
            fh.write(digest.digest())
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
    dfd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)
    return path


def read_capsule_file(path: str | Path) -> tuple[dict, bytes]:
    """Read and check structure, sizes and the file digest; ValueError says what is wrong."""
    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as e:
        raise ValueError(f"{path}: cannot read capsule file ({e.strerror})") from None
    if len(data) < 16 or data[:8] != MAGIC:
        raise ValueError(f"{path}: not a flashrt capsule file (bad magic)")
    version, hlen = struct.unpack("<II", data[8:16])
    if version != VERSION:
        raise ValueError(f"{path}: capsule file version {version}, this build reads {VERSION}")
    if not 2 <= hlen <= MAX_HEADER or 16 + hlen > len(data):
        raise ValueError(f"{path}: header length {hlen} out of bounds (truncated file?)")
    try:
        header = json.loads(data[16 : 16 + hlen].decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: corrupted header ({e})") from None
    if not isinstance(header, dict):
        raise ValueError(f"{path}: header is not an object")
    for key, typ in _FIELDS.items():
        val = header.get(key)
        ok = isinstance(val, typ) and not (typ is int and isinstance(val, bool))
        if typ is float:
            ok = isinstance(val, (int, float)) and not isinstance(val, bool)
        if not ok:
            raise ValueError(f"{path}: header field {key!r} missing or not {typ.__name__}")
    nbytes = header["nbytes"]
    if nbytes <= 0 or not 0 <= header["step"] < 2**63:
        raise ValueError(f"{path}: header sizes out of bounds")
    if not math.isfinite(header["stamp"]) or header["stamp"] < 0:
        raise ValueError(f"{path}: header stamp is not a time")
    # ids and names become file names and lookup keys: the same rules as live ones
    for key, rule, empty_ok in (
        ("id", CAPSULE_NAME, False),
        ("name", CAPSULE_NAME, True),
        ("parent_id", CAPSULE_NAME, True),
        ("session", SESSION_NAME, False),
    ):
        if not (header[key] == "" and empty_ok) and not rule.fullmatch(header[key]):
            raise ValueError(f"{path}: header field {key!r} = {header[key]!r} is not allowed")
    expected = 16 + hlen + nbytes + 32
    if len(data) < expected:
        raise ValueError(f"{path}: truncated: {len(data)} bytes, expected {expected}")
    if len(data) > expected:
        raise ValueError(f"{path}: {len(data) - expected} trailing bytes after the capsule")
    body_end = 16 + hlen + nbytes
    if hashlib.sha256(data[:body_end]).digest() != data[body_end:]:
        raise ValueError(f"{path}: corrupted: file digest does not match its contents")
    return header, data[16 + hlen : body_end]
