"""Which Fast DDS profile a launched node gets (launch/flashrt.launch.py's fastdds_profile).

config/fastdds_images.xml lets camera images above 512 KiB travel whole through shared memory
(the file says why). It is the default for the node unless the environment already names a
profile: a robot's own DDS tuning is never silently replaced.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

PROFILE_VAR = "FASTDDS_DEFAULT_PROFILES_FILE"
PROFILE_FILE = "fastdds_images.xml"  # in the package's share/flashrt_ros/config


def fastdds_env(choice: str, environ: Mapping[str, str], default: str) -> dict[str, str]:
    """The variables to add to the node's environment: `choice` "auto" gives `default` unless
    `environ` already sets PROFILE_VAR; a path gives that file (FileNotFoundError when it is
    none); "" gives nothing (the environment decides)."""
    if choice == "auto":
        return {} if environ.get(PROFILE_VAR) else {PROFILE_VAR: default}
    if choice and not os.path.isfile(choice):
        raise FileNotFoundError(f"fastdds_profile:={choice}: no such file")
    return {PROFILE_VAR: choice} if choice else {}
