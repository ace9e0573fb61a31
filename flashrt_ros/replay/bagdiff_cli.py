"""flashrt-bagdiff: compare the command streams of two rosbag2 bags (sqlite3 or MCAP, any mix).

Exit status: 0 equal (bit-identical, or within --atol), 1 divergence (the first one is printed),
2 error (missing or foreign bag, missing topic, a --skip-a/-b past a bag's commands, or no
command in either bag: two empty recordings prove nothing, so they are not called equal).
"""

from __future__ import annotations

import argparse
import sys

import numpy as np

__all__ = ["main", "compare_commands"]


def _same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    return a.shape == b.shape and a.tobytes() == b.tobytes()


def compare_commands(a: list, b: list, atol: float = 0.0) -> tuple[str | None, float]:
    """First divergence between two ``[(stamp_ns, values)]`` streams as printable text, else None.

    Values are equal when numerically equal (NaN equals NaN) or within ``atol``. Also returns the
    largest absolute difference seen over the compared prefix.
    """
    max_diff = 0.0
    for i, ((sa, va), (sb, vb)) in enumerate(zip(a, b, strict=False)):
        if va.shape != vb.shape:
            return (
                f"divergence at command {i}: A stamp {sa} ns, B stamp {sb} ns: "
                f"A has {va.size} values, B has {vb.size}",
                max_diff,
            )
        both_nan = np.isnan(va) & np.isnan(vb)
        with np.errstate(invalid="ignore"):
            diff = np.where(both_nan, 0.0, np.abs(vb - va))
        bad = ~(both_nan | (va == vb) | (diff <= atol))
        if bad.any():
            j = int(np.flatnonzero(bad)[0])
            d = float(vb[j] - va[j])
            return (
                f"divergence at command {i}: A stamp {sa} ns, B stamp {sb} ns\n"
                f"  joint {j}: A = {float(va[j])!r}, B = {float(vb[j])!r}, "
                f"B - A = {d!r} (atol {atol!r})",
                max_diff,
            )
        finite = np.isfinite(diff)
        if finite.any():
            max_diff = max(max_diff, float(diff[finite].max()))
    if len(a) != len(b):
        n = min(len(a), len(b))
        longer, stream = ("A", a) if len(a) > len(b) else ("B", b)
        return (
            f"divergence at command {n}: length mismatch: A has {len(a)} commands, B has {len(b)}; "
            f"the first {n} agree; command {n} (stamp {stream[n][0]} ns) exists only in {longer}",
            max_diff,
        )
    return None, max_diff


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="flashrt-bagdiff",
        description=(
            "Compare the command streams (std_msgs/Float64MultiArray) of two rosbag2 bags, "
            "sqlite3 or MCAP in any mix, message by message in receive-time order. Receive "
            "stamps are printed but not compared."
        ),
        epilog=(
            "exit status: 0 the streams are equal (bit-identical, or every value within --atol); "
            "1 they diverge, the first divergence is printed (command index, both stamps, joint "
            "index, both values, difference; a different number of commands also diverges); "
            "2 a bag is missing or not a rosbag2 bag, it lacks the topic, a --skip leaves "
            "nothing of its bag, or neither bag has a "
            "command on it (nothing to compare: a recording that caught no command is a failed "
            "recording, not a pass)."
        ),
    )
    p.add_argument(
        "bag_a", metavar="A", help="first bag (directory with metadata.yaml, or a .db3/.mcap file)"
    )
    p.add_argument("bag_b", metavar="B", help="second bag")
    p.add_argument(
        "--atol",
        type=float,
        default=0.0,
        help="absolute tolerance per value (default 0.0: values must be exactly equal)",
    )
    p.add_argument(
        "--topic", default="/commands", help="command topic in both bags (default /commands)"
    )
    for side in ("a", "b"):
        p.add_argument(
            f"--skip-{side}",
            type=int,
            default=0,
            metavar="N",
            help=f"leave out the first N commands of {side.upper()} (e.g. the node's commands "
            "before the tick an offline replay --from-capsule starts from; default 0)",
        )
    return p


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``flashrt-bagdiff``; returns the exit status."""
    args = _parser().parse_args(argv)
    if not (np.isfinite(args.atol) and args.atol >= 0):
        print(
            f"flashrt-bagdiff: error: --atol must be a finite non-negative number, got {args.atol}",
            file=sys.stderr,
        )
        return 2
    if args.skip_a < 0 or args.skip_b < 0:
        print("flashrt-bagdiff: error: --skip-a and --skip-b must be >= 0", file=sys.stderr)
        return 2
    from flashrt_ros.replay.bags import read_commands

    try:
        a = read_commands(args.bag_a, topic=args.topic)
        b = read_commands(args.bag_b, topic=args.topic)
    except ValueError as exc:
        print(f"flashrt-bagdiff: error: {exc}", file=sys.stderr)
        return 2
    for side, stream, n in (("A", a, args.skip_a), ("B", b, args.skip_b)):
        if n and n >= len(stream):
            print(
                f"flashrt-bagdiff: error: --skip-{side.lower()} {n}, but {side} has only "
                f"{len(stream)} commands on {args.topic}",
                file=sys.stderr,
            )
            return 2
    if args.skip_a or args.skip_b:
        a, b = a[args.skip_a :], b[args.skip_b :]
        print(f"comparing A from command {args.skip_a} and B from command {args.skip_b}")
    if not a and not b:
        print(
            f"flashrt-bagdiff: error: neither bag has a command on {args.topic}: nothing to "
            "compare (did the recording or the replay catch no command?)",
            file=sys.stderr,
        )
        return 2
    text, max_diff = compare_commands(a, b, args.atol)
    if text is not None:
        print(text)
        return 1
    if all(_same_bits(va, vb) for (_, va), (_, vb) in zip(a, b, strict=True)):
        print(f"identical: {len(a)} commands")
    else:
        print(f"equal within atol {args.atol!r}: {len(a)} commands, max |B - A| = {max_diff!r}")
    return 0


def _entry() -> None:
    sys.exit(main())


if __name__ == "__main__":
    _entry()
