"""Capsule and session names, validated so a name can never leave capsule_dir or pass for an id."""

from __future__ import annotations

import re

from flashrt_ros.errors import BadName, shown

CAPSULE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
SESSION_NAME = re.compile(r"[A-Za-z0-9_]{1,32}")
# Capsule ids are "c" + digits. Names of that form (either case: some file systems fold case)
# are reserved, so a name never equals an id and `name.fcap` never meets an id's file.
CAPSULE_ID = re.compile(r"[cC][0-9]+")


ISSUED_ID = re.compile(r"c[0-9]{1,15}")  # the ids a pool issues (c0001, ...)


def is_issued_id(s: object) -> bool:
    """Whether `s` is an id a pool could have issued: a loaded file keeps only such an id (an
    upper-case or 60-digit one would dodge or overflow the pool's counter)."""
    return isinstance(s, str) and ISSUED_ID.fullmatch(s) is not None


def check_capsule_name(name: str) -> str:
    """The name, or BadName saying which rule it breaks."""
    if not isinstance(name, str) or not CAPSULE_NAME.fullmatch(name):
        raise BadName(
            f"bad capsule name {shown(name)}: use 1-64 of [A-Za-z0-9_.-], "
            "starting with a letter or digit"
        )
    if CAPSULE_ID.fullmatch(name):
        raise BadName(
            f"capsule name {name!r} is reserved: names of the form c<digits> (or C<digits>) "
            "are capsule ids"
        )
    return name


def check_session_name(name: str) -> str:
    if not isinstance(name, str) or not SESSION_NAME.fullmatch(name):
        raise BadName(f"bad session name {shown(name)}: use 1-32 of [A-Za-z0-9_]")
    return name
