"""Capsule and session names, validated so a name can never leave capsule_dir."""

from __future__ import annotations

import re

CAPSULE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
SESSION_NAME = re.compile(r"[A-Za-z0-9_]{1,32}")


def check_capsule_name(name: str) -> str:
    if not isinstance(name, str) or not CAPSULE_NAME.fullmatch(name):
        raise ValueError(
            f"bad capsule name {name!r}: use 1-64 of [A-Za-z0-9_.-], "
            "starting with a letter or digit"
        )
    return name


def check_session_name(name: str) -> str:
    if not isinstance(name, str) or not SESSION_NAME.fullmatch(name):
        raise ValueError(f"bad session name {name!r}: use 1-32 of [A-Za-z0-9_]")
    return name
