"""Read and write rosbag2 bags (sqlite3 and MCAP storage) with ``rosbags``; no rclpy.

Bags are rosbag2 directories as ``ros2 bag record`` writes them (``metadata.yaml`` plus one or more
``.db3`` / ``.mcap`` files); a bare ``.db3`` or ``.mcap`` file is read too. Messages are
(de)serialized with the rosbags typestore of ROS 2 Kilted (``TYPESTORE_NAME``).

Times: every timestamp here is the bag's receive time (``log_time``) in integer nanoseconds. For
JointState the header stamp is kept as ``InputEvent.header_ns``; ``write_inputs`` writes
``header_ns`` (or the receive time when it is 0) into the header.

Images: with ``camera_prefix`` (e.g. ``"/camera"``), ``read_inputs`` also returns the
sensor_msgs/Image messages of ``<camera_prefix>/<name>/image_raw`` as ``kind="image"`` events
(``camera`` = name, ``image`` = an ``ImageFrame`` holding the raw bytes, no pixel conversion), and
``write_inputs`` writes such events to those topics. They are held in memory whole: a bag of long
high-resolution runs needs as much memory as its images.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import sqlite3
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from rosbags.rosbag2 import Reader, StoragePlugin, Writer, WriterError
from rosbags.typesys import Stores, get_typestore

__all__ = [
    "InputEvent",
    "ImageFrame",
    "IMAGE",
    "STORAGES",
    "JOINT_STATE",
    "FLOAT64_MULTI_ARRAY",
    "JOINT_TRAJECTORY",
    "typestore",
    "detect_storage",
    "list_topics",
    "read_inputs",
    "write_inputs",
    "read_commands",
    "write_commands",
    "write_recording",
]

STORAGES = ("sqlite3", "mcap")
JOINT_STATE = "sensor_msgs/msg/JointState"
FLOAT64_MULTI_ARRAY = "std_msgs/msg/Float64MultiArray"
JOINT_TRAJECTORY = "trajectory_msgs/msg/JointTrajectory"
IMAGE = "sensor_msgs/msg/Image"

TYPESTORE_NAME = "ROS2_KILTED" if hasattr(Stores, "ROS2_KILTED") else "ROS2_JAZZY"
_TYPESTORE = None

_SQLITE_MAGIC = b"SQLite format 3\x00"
_MCAP_MAGIC = b"\x89MCAP0\r\n"
_EMPTY = np.zeros(0, dtype=np.float64)


def typestore():
    """The shared rosbags typestore (ROS 2 Kilted, or Jazzy on an older rosbags)."""
    global _TYPESTORE
    if _TYPESTORE is None:
        _TYPESTORE = get_typestore(getattr(Stores, TYPESTORE_NAME))
    return _TYPESTORE


@dataclass(eq=False)
class ImageFrame:
    """The fields of a sensor_msgs/Image that a camera observation uses; ``data`` is the raw
    uint8 bytes (rows of ``step`` bytes), as the message carries them."""

    height: int
    width: int
    encoding: str
    step: int
    data: np.ndarray
    is_bigendian: int = 0
    header_ns: int = 0

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, ImageFrame):
            return NotImplemented
        return (
            self.height,
            self.width,
            self.encoding,
            self.step,
            self.is_bigendian,
            self.header_ns,
        ) == (
            other.height,
            other.width,
            other.encoding,
            other.step,
            other.is_bigendian,
            other.header_ns,
        ) and np.array_equal(self.data, other.data)


@dataclass(eq=False)
class InputEvent:
    """One input message of a bag: a JointState (``kind="joint_states"``), a goal (``"goal"``)
    or a camera image (``"image"``).

    ``stamp_ns`` is the bag receive time. joint_states fill ``names``, ``position``,
    ``velocity``, ``effort`` (and ``header_ns``); goals fill ``data``; images ``camera`` and
    ``image``. Unused arrays are empty float64 arrays.
    """

    kind: str
    stamp_ns: int
    names: list[str] = field(default_factory=list)
    position: np.ndarray = field(default_factory=lambda: _EMPTY.copy())
    velocity: np.ndarray = field(default_factory=lambda: _EMPTY.copy())
    effort: np.ndarray = field(default_factory=lambda: _EMPTY.copy())
    data: np.ndarray = field(default_factory=lambda: _EMPTY.copy())
    header_ns: int = 0
    camera: str = ""
    image: ImageFrame | None = None

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, InputEvent):
            return NotImplemented
        return (
            self.kind == other.kind
            and self.camera == other.camera
            and self.image == other.image
            and self.stamp_ns == other.stamp_ns
            and list(self.names) == list(other.names)
            and self.header_ns == other.header_ns
            and all(
                np.array_equal(np.asarray(a, np.float64), np.asarray(b, np.float64), equal_nan=True)
                for a, b in (
                    (self.position, other.position),
                    (self.velocity, other.velocity),
                    (self.effort, other.effort),
                    (self.data, other.data),
                )
            )
        )


# ---------------------------------------------------------------------------------------------
# storage detection and opening


def detect_storage(path: str | Path) -> str:
    """Storage of a rosbag2 bag: ``"sqlite3"`` or ``"mcap"``; ValueError if missing or not a bag."""
    p = Path(path)
    if not p.exists():
        raise ValueError(f"{p}: no such bag (path does not exist)")
    if p.is_dir():
        meta = p / "metadata.yaml"
        if not meta.is_file():
            raise ValueError(f"{p}: not a rosbag2 bag (directory without metadata.yaml)")
        try:
            from ruamel.yaml import YAML

            info = YAML(typ="safe").load(meta.read_text())["rosbag2_bagfile_information"]
            storage = info["storage_identifier"]
        except Exception as exc:  # noqa: BLE001 - any parse problem means "not a bag"
            why = " ".join(str(exc).split())  # a YAML error spans lines: one line here
            raise ValueError(f"{p}: not a rosbag2 bag (unreadable metadata.yaml: {why})") from None
        if storage not in STORAGES:
            raise ValueError(
                f"{p}: unsupported rosbag2 storage {storage!r} (expected one of {STORAGES})"
            )
        return str(storage)
    try:
        with p.open("rb") as f:
            head = f.read(16)
    except OSError as exc:
        raise ValueError(f"{p}: cannot read: {exc}") from None
    if head.startswith(_SQLITE_MAGIC) and p.suffix == ".db3":
        return "sqlite3"
    if head.startswith(_MCAP_MAGIC) and p.suffix == ".mcap":
        return "mcap"
    raise ValueError(
        f"{p}: not a rosbag2 bag "
        "(expected a bag directory with metadata.yaml, or a .db3 / .mcap file)"
    )


def _open(path: str | Path) -> Reader:
    detect_storage(path)
    try:
        reader = Reader(Path(path))
        reader.open()
    except Exception as exc:  # noqa: BLE001 - a damaged index can raise anything (see _messages)
        raise ValueError(f"{path}: cannot open bag ({type(exc).__name__}: {exc})") from None
    return reader


def _norm(topic: str) -> str:
    return "/" + topic.strip("/")


def _connections(reader: Reader, topic: str, msgtype: str, path) -> list:
    conns = [c for c in reader.connections if _norm(c.topic) == _norm(topic)]
    bad = sorted({c.msgtype for c in conns if c.msgtype != msgtype})
    if bad:
        raise ValueError(f"{path}: topic {topic!r} has type {', '.join(bad)}, expected {msgtype}")
    return conns


def _topics_text(reader: Reader) -> str:
    topics = sorted({f"{c.topic} [{c.msgtype}]" for c in reader.connections})
    return ", ".join(topics) if topics else "(none)"


def list_topics(path: str | Path) -> dict[str, str]:
    """Topic name -> message type of a bag."""
    reader = _open(path)
    try:
        return {c.topic: c.msgtype for c in reader.connections}
    finally:
        reader.close()


def _messages(reader: Reader, conns: list, path) -> Iterable[tuple]:
    """The bag's messages; a damaged chunk or page (rosbags raises struct.error, OverflowError,
    sqlite's CorruptError... from deep inside) is a ValueError naming the file, as any bad
    input is."""
    try:
        yield from reader.messages(connections=conns)
    except Exception as exc:  # noqa: BLE001 - whatever a damaged file makes the reader raise
        raise ValueError(f"{path}: cannot read messages ({type(exc).__name__}: {exc})") from None


def _deserialize(raw, msgtype: str, path, stamp: int):
    try:
        return typestore().deserialize_cdr(raw, msgtype)
    except Exception as exc:  # noqa: BLE001 - corrupted payloads surface as ValueError
        raise ValueError(f"{path}: cannot deserialize {msgtype} at {stamp} ns: {exc}") from None


def _stamp_ns(t) -> int:
    return int(t.sec) * 1_000_000_000 + int(t.nanosec)


# ---------------------------------------------------------------------------------------------
# inputs (joint_states + goal)


def _camera_conns(reader: Reader, prefix: str, path) -> dict[str, tuple[str, list]]:
    pat = re.compile(re.escape(_norm(prefix).rstrip("/")) + r"/([A-Za-z][A-Za-z0-9_]*)/image_raw")
    out: dict[str, tuple[str, list]] = {}
    for c in reader.connections:
        m = pat.fullmatch(_norm(c.topic))
        if m is None:
            continue
        if c.msgtype != IMAGE:
            raise ValueError(f"{path}: topic {c.topic!r} has type {c.msgtype}, expected {IMAGE}")
        out.setdefault(m.group(1), (_norm(c.topic), []))[1].append(c)
    return dict(sorted(out.items()))


def read_inputs(
    path: str | Path,
    joint_states_topic: str = "/joint_states",
    goal_topic: str = "/goal",
    camera_prefix: str | None = None,
) -> list[InputEvent]:
    """JointState and goal (Float64MultiArray) messages, by receive time (ties in bag order);
    with ``camera_prefix`` the images of ``<camera_prefix>/<name>/image_raw`` too.

    Topics match with or without the leading slash. ValueError when the joint_states topic is
    missing (the message lists the bag's topics) or has another type. The goal topic is optional.
    """
    reader = _open(path)
    try:
        js = _connections(reader, joint_states_topic, JOINT_STATE, path)
        if not js:
            raise ValueError(
                f"{path}: no {joint_states_topic!r} topic ({JOINT_STATE}); "
                f"the bag has: {_topics_text(reader)}"
            )
        goal = _connections(reader, goal_topic, FLOAT64_MULTI_ARRAY, path)
        js_ids = {c.id for c in js}
        cams = _camera_conns(reader, camera_prefix, path) if camera_prefix is not None else {}
        cam_of = {c.id: name for name, (_, conns) in cams.items() for c in conns}
        img_conns = [c for _, conns in cams.values() for c in conns]
        events: list[InputEvent] = []
        for conn, stamp, raw in _messages(reader, js + goal + img_conns, path):
            if conn.id in cam_of:
                m = _deserialize(raw, IMAGE, path, stamp)
                frame = ImageFrame(
                    height=int(m.height),
                    width=int(m.width),
                    encoding=str(m.encoding),
                    step=int(m.step),
                    data=np.asarray(m.data, dtype=np.uint8),
                    is_bigendian=int(m.is_bigendian),
                    header_ns=_stamp_ns(m.header.stamp),
                )
                events.append(
                    InputEvent(
                        kind="image", stamp_ns=int(stamp), camera=cam_of[conn.id], image=frame
                    )
                )
            elif conn.id in js_ids:
                m = _deserialize(raw, JOINT_STATE, path, stamp)
                events.append(
                    InputEvent(
                        kind="joint_states",
                        stamp_ns=int(stamp),
                        names=[str(n) for n in m.name],
                        position=np.array(m.position, dtype=np.float64),
                        velocity=np.array(m.velocity, dtype=np.float64),
                        effort=np.array(m.effort, dtype=np.float64),
                        header_ns=_stamp_ns(m.header.stamp),
                    )
                )
            else:
                m = _deserialize(raw, FLOAT64_MULTI_ARRAY, path, stamp)
                events.append(
                    InputEvent(
                        kind="goal", stamp_ns=int(stamp), data=np.array(m.data, dtype=np.float64)
                    )
                )
    finally:
        reader.close()
    # rosbags yields each storage file in time order with ties in write order (sqlite: the
    # timestamp index, i.e. rowid; MCAP: file offset); a stable sort merges split bags.
    events.sort(key=lambda e: e.stamp_ns)
    return events


def _writer(path: str | Path, storage: str) -> Writer:
    p = Path(path)
    if storage not in STORAGES:
        raise ValueError(f"unknown storage {storage!r}; expected one of {STORAGES}")
    if p.exists() or p.is_symlink():
        raise ValueError(f"{p} exists already; not overwriting")
    plugin = StoragePlugin.SQLITE3 if storage == "sqlite3" else StoragePlugin.MCAP
    return Writer(p, version=Writer.VERSION_LATEST, storage_plugin=plugin)


def _check_stamp(stamp) -> int:
    if isinstance(stamp, (bool, np.bool_)) or not isinstance(stamp, (int, np.integer)):
        raise ValueError(f"timestamps must be integer nanoseconds, got {stamp!r}")
    s = int(stamp)
    if not 0 <= s < 2**63:
        raise ValueError(f"timestamp out of range: {s}")
    return s


def _write(path: str | Path, storage: str, fill) -> None:
    """Open a new bag, let ``fill(writer)`` write it; remove the partial bag on any error (the
    path did not exist before: _writer refuses one that does, so what is there now is ours, a
    failure inside open() included). A full disk is a ValueError saying so, sqlite3's too."""
    writer = _writer(path, storage)
    try:
        writer.open()
        fill(writer)
        writer.close()
    except BaseException as exc:
        with contextlib.suppress(Exception):
            writer.close()
        if os.path.lexists(path):
            shutil.rmtree(path, ignore_errors=True)
        if isinstance(exc, WriterError | OSError | sqlite3.Error):
            raise ValueError(f"{path}: cannot write bag: {exc}") from None
        raise


def _float_array(x, what: str) -> np.ndarray:
    a = np.array(x, dtype=np.float64).reshape(-1) if np.ndim(x) <= 1 else None
    if a is None:
        raise ValueError(f"{what} must be 1-D, got shape {np.shape(x)}")
    return a


def _joint_state_msg(e: InputEvent):
    ts = typestore()
    T = ts.types
    hns = e.header_ns or e.stamp_ns
    header = T["std_msgs/msg/Header"](
        stamp=T["builtin_interfaces/msg/Time"](
            sec=hns // 1_000_000_000, nanosec=hns % 1_000_000_000
        ),
        frame_id="",
    )
    return T[JOINT_STATE](
        header=header,
        name=[str(n) for n in e.names],
        position=_float_array(e.position, "position"),
        velocity=_float_array(e.velocity, "velocity"),
        effort=_float_array(e.effort, "effort"),
    )


def _image_msg(e: InputEvent):
    T = typestore().types
    f = e.image
    if f is None or not e.camera:
        raise ValueError("an image event needs a camera name and an ImageFrame")
    hns = f.header_ns or e.stamp_ns
    header = T["std_msgs/msg/Header"](
        stamp=T["builtin_interfaces/msg/Time"](
            sec=hns // 1_000_000_000, nanosec=hns % 1_000_000_000
        ),
        frame_id=f"{e.camera}_camera",
    )
    return T[IMAGE](
        header=header,
        height=int(f.height),
        width=int(f.width),
        encoding=str(f.encoding),
        is_bigendian=int(f.is_bigendian),
        step=int(f.step),
        data=np.ascontiguousarray(f.data, dtype=np.uint8).reshape(-1),
    )


def _float64_multi_array_msg(data):
    T = typestore().types
    layout = T["std_msgs/msg/MultiArrayLayout"](dim=[], data_offset=0)
    return T[FLOAT64_MULTI_ARRAY](layout=layout, data=_float_array(data, "data"))


def write_inputs(
    path: str | Path,
    events: Sequence[InputEvent],
    storage: str = "sqlite3",
    joint_states_topic: str = "/joint_states",
    goal_topic: str = "/goal",
    camera_prefix: str = "/camera",
) -> None:
    """Write a joint_states (+ goal, if any event is one; + each camera's
    ``<camera_prefix>/<name>/image_raw``, if any event is an image) bag in the given order.

    Refuses an existing path (ValueError).
    """
    ts = typestore()
    rows = []
    for e in events:
        if e.kind == "joint_states":
            rows.append(("js", _check_stamp(e.stamp_ns), _joint_state_msg(e)))
        elif e.kind == "goal":
            rows.append(("goal", _check_stamp(e.stamp_ns), _float64_multi_array_msg(e.data)))
        elif e.kind == "image":
            rows.append((f"cam:{e.camera}", _check_stamp(e.stamp_ns), _image_msg(e)))
        else:
            raise ValueError(f"unknown event kind {e.kind!r}")

    def fill(w: Writer) -> None:
        conns = {
            "js": (w.add_connection(joint_states_topic, JOINT_STATE, typestore=ts), JOINT_STATE)
        }
        for which, _, _ in rows:
            if which in conns:
                continue
            if which == "goal":
                topic, typ = goal_topic, FLOAT64_MULTI_ARRAY
            else:
                topic, typ = f"{_norm(camera_prefix).rstrip('/')}/{which[4:]}/image_raw", IMAGE
            conns[which] = (w.add_connection(topic, typ, typestore=ts), typ)
        for which, stamp, msg in rows:
            conn, typ = conns[which]
            w.write(conn, stamp, ts.serialize_cdr(msg, typ))

    _write(path, storage, fill)


# ---------------------------------------------------------------------------------------------
# commands


def write_commands(
    path: str | Path,
    commands: Sequence[tuple[int, np.ndarray]],
    storage: str = "sqlite3",
    topic: str = "/commands",
) -> None:
    """Write ``(receive_time_ns, values)`` pairs as std_msgs/Float64MultiArray.

    Refuses an existing path (ValueError).
    """
    ts = typestore()
    rows = [
        (_check_stamp(s), ts.serialize_cdr(_float64_multi_array_msg(v), FLOAT64_MULTI_ARRAY))
        for s, v in commands
    ]

    def fill(w: Writer) -> None:
        conn = w.add_connection(topic, FLOAT64_MULTI_ARRAY, typestore=ts)
        for stamp, raw in rows:
            w.write(conn, stamp, raw)

    _write(path, storage, fill)


def write_recording(
    path: str | Path,
    events: Sequence[InputEvent],
    commands: Sequence[tuple[int, np.ndarray]],
    storage: str = "sqlite3",
    joint_states_topic: str = "/joint_states",
    goal_topic: str = "/goal",
    commands_topic: str = "/commands",
) -> None:
    """One bag of a live run: its inputs (joint_states, goals) and the commands the node sent,
    each at its receive time, as ``ros2 bag record`` would keep them. Refuses an existing path."""
    ts = typestore()
    rows = []
    for e in events:
        if e.kind == "joint_states":
            rows.append((_check_stamp(e.stamp_ns), 0, _joint_state_msg(e)))
        elif e.kind == "goal":
            rows.append((_check_stamp(e.stamp_ns), 1, _float64_multi_array_msg(e.data)))
        else:
            raise ValueError(f"unknown event kind {e.kind!r}")
    rows += [(_check_stamp(s), 2, _float64_multi_array_msg(v)) for s, v in commands]
    rows.sort(key=lambda r: r[0])  # stable: ties keep their order
    types = (JOINT_STATE, FLOAT64_MULTI_ARRAY, FLOAT64_MULTI_ARRAY)

    def fill(w: Writer) -> None:
        conns = [
            w.add_connection(joint_states_topic, JOINT_STATE, typestore=ts),
            w.add_connection(goal_topic, FLOAT64_MULTI_ARRAY, typestore=ts),
            w.add_connection(commands_topic, FLOAT64_MULTI_ARRAY, typestore=ts),
        ]
        for stamp, which, msg in rows:
            w.write(conns[which], stamp, ts.serialize_cdr(msg, types[which]))

    _write(path, storage, fill)


def read_commands(path: str | Path, topic: str = "/commands") -> list[tuple[int, np.ndarray]]:
    """``(receive_time_ns, values)`` of the Float64MultiArray messages on ``topic``, by time.

    ValueError when the bag lacks the topic (the message lists the bag's topics) or it has
    another type.
    """
    reader = _open(path)
    try:
        conns = _connections(reader, topic, FLOAT64_MULTI_ARRAY, path)
        if not conns:
            raise ValueError(
                f"{path}: no {topic!r} topic ({FLOAT64_MULTI_ARRAY}); "
                f"the bag has: {_topics_text(reader)}"
            )
        out = []
        for _conn, stamp, raw in _messages(reader, conns, path):
            m = _deserialize(raw, FLOAT64_MULTI_ARRAY, path, stamp)
            out.append((int(stamp), np.array(m.data, dtype=np.float64)))
    finally:
        reader.close()
    out.sort(key=lambda c: c[0])
    return out
