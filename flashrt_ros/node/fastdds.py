"""Which Fast DDS profile a launched node gets (launch/flashrt.launch.py's fastdds_profile).

config/fastdds_images.xml lets camera images above 512 KiB travel whole through shared memory
(the file says why). It is the default for the node unless the environment already names a
profile: a robot's own DDS tuning is never silently replaced.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from xml.etree import ElementTree

PROFILE_VAR = "FASTDDS_DEFAULT_PROFILES_FILE"
PROFILE_FILE = "fastdds_images.xml"  # in the package's share/flashrt_ros/config
SHM_SEGMENT_BYTES = 512 * 1024  # Fast DDS's built-in shared-memory segment per participant


def fastdds_env(choice: str, environ: Mapping[str, str], default: str) -> dict[str, str]:
    """The variables to add to the node's environment: `choice` "auto" gives `default` unless
    `environ` already sets PROFILE_VAR; a path gives that file (FileNotFoundError when it is
    none); "" gives nothing (the environment decides)."""
    if choice == "auto":
        return {} if environ.get(PROFILE_VAR) else {PROFILE_VAR: default}
    if choice and not os.path.isfile(choice):
        raise FileNotFoundError(f"fastdds_profile:={choice}: no such file")
    if choice:
        try:  # Fast DDS itself only prints a parse error and runs on its defaults
            ElementTree.parse(choice)
        except ElementTree.ParseError as e:
            raise ValueError(f"fastdds_profile:={choice} is not an XML profile ({e})") from None
    return {PROFILE_VAR: choice} if choice else {}


def installed_profile() -> str:
    """The profile file as installed (share/flashrt_ros/config), for messages to the user."""
    try:
        from ament_index_python.packages import get_package_share_directory

        return os.path.join(get_package_share_directory("flashrt_ros"), "config", PROFILE_FILE)
    except Exception:  # noqa: BLE001 - not installed (a source tree): name the file alone
        return f"<share/flashrt_ros>/config/{PROFILE_FILE}"


def large_image_hint(
    frame_bytes: Mapping[str, int], environ: Mapping[str, str], rmw: str, profile: str
) -> str | None:
    """A warning for the node's log when raw camera frames cannot travel whole through Fast
    DDS's default shared-memory segment and no profile is set: such frames took 12-14 ms to
    arrive instead of ~2 ms, which a user would otherwise only see as a slow policy. None when
    nothing is wrong: another RMW, a profile already named, or every frame small enough."""
    if not rmw.startswith("rmw_fastrtps") or environ.get(PROFILE_VAR):
        return None
    big = {name: n for name, n in frame_bytes.items() if n > SHM_SEGMENT_BYTES}
    if not big:
        return None
    names = ", ".join(f"{name} ({n} B)" for name, n in big.items())
    return (
        f"camera frames larger than Fast DDS's default {SHM_SEGMENT_BYTES // 1024} KiB "
        f"shared-memory segment: {names}, and {PROFILE_VAR} is not set; such frames took "
        f"12-14 ms to arrive on our machines instead of ~2 ms. Export {PROFILE_VAR}={profile} "
        "for this node and the camera drivers (flashrt.launch.py does it for the node; README: "
        "Large images and Fast DDS)"
    )
