"""A tiny synthetic camera for the simulated arm: numpy only, deterministic, batched.

It looks down on the arm drawn as a planar kinematic chain: link i (of n) leaves the end of link
i-1 at the absolute angle q_0 + ... + q_i (measured from "up", counter-clockwise), starting at the
image centre, so the picture is a function of the joint positions alone. The goal configuration
is drawn over it as a ghost chain whose links each have their own hue (so a network can tell
them apart and read every joint angle), with a marker at its tip. The arm itself is drawn in
grey shades. Lines are anti-aliased (coverage from the pixel centre's distance to the segment),
so sub-pixel motion changes the picture; the result is a uint8 (H, W, 3) rgb8 image.
"""

from __future__ import annotations

import numpy as np

__all__ = ["ArmCamera", "render"]

BACKGROUND = np.array([24.0, 26.0, 32.0], dtype=np.float32)
MARKER = np.array([255.0, 255.0, 255.0], dtype=np.float32)
# one hue per ghost link (red, orange, yellow, green, cyan, violet); more links cycle
GHOST = np.array(
    [
        [230.0, 40.0, 40.0],
        [240.0, 150.0, 30.0],
        [220.0, 220.0, 40.0],
        [50.0, 200.0, 60.0],
        [40.0, 200.0, 220.0],
        [170.0, 80.0, 240.0],
    ],
    dtype=np.float32,
)


class ArmCamera:
    """Renders (q, goal) into rgb8 images of ``height`` x ``width`` (see the module docstring).

    ``reach`` is the stretched chain's length as a fraction of half the smaller image side; link
    lengths decrease from base to tip (ratio 1.0 .. 0.5) so the whole chain stays in view.
    """

    def __init__(self, height: int = 64, width: int = 64, n_joints: int = 6, reach: float = 0.92):
        if int(height) < 8 or int(width) < 8:
            raise ValueError(f"image must be at least 8x8 pixels, got {height}x{width}")
        if int(n_joints) < 1:
            raise ValueError(f"n_joints must be >= 1, got {n_joints}")
        self.height, self.width, self.n = int(height), int(width), int(n_joints)
        half = 0.5 * min(self.height, self.width)
        raw = np.linspace(1.0, 0.6, self.n)
        self.lengths = raw / raw.sum() * reach * half  # pixels
        self.base = np.array([(self.width - 1) / 2.0, (self.height - 1) / 2.0])
        s = max(1.0, min(self.height, self.width) / 64.0)  # line widths scale with the image
        self.arm_half_width = 1.3 * s
        self.ghost_half_width = 0.9 * s
        self.marker_radius = 1.7 * s
        # Each segment is drawn in a square window around it (a few pixels, not the whole image),
        # on a canvas padded by one window so windows never leave it.
        self._win = int(np.ceil(self.lengths.max() + 2 * self.arm_half_width + 4))
        self._pad = self._win + 1
        self._cw = self.width + 2 * self._pad
        self._ch = self.height + 2 * self._pad
        v, u = np.mgrid[0 : self._win, 0 : self._win]
        self._u = u.ravel().astype(np.int64)  # (K*K,)
        self._v = v.ravel().astype(np.int64)

    def joints_xy(self, q: np.ndarray) -> np.ndarray:
        """Pixel positions (x right, y down) of the base and every link end: (B, n + 1, 2)."""
        theta = np.cumsum(q, axis=-1)
        # angle 0 points up (towards row 0); positive angles turn counter-clockwise on screen
        step = np.stack([-np.sin(theta), -np.cos(theta)], -1) * self.lengths[:, None]
        ends = self.base + np.cumsum(step, axis=-2)
        base = np.broadcast_to(self.base, ends.shape[:-2] + (1, 2))
        return np.concatenate([base, ends], -2)

    def _blend(self, img, a, b, hw: float, color, opacity: float = 1.0) -> None:
        """Alpha-blend the segments a -> b ((B, 2) canvas pixels, a == b: a disc) into ``img``
        (B, canvas pixels, 3): ``color`` at ``opacity`` x coverage (anti-aliased distance < hw)."""
        lo = np.floor(np.minimum(a, b) - hw - 1.0).astype(np.int64)  # window corner (B, 2)
        px = (lo[:, 0, None] + self._u).astype(np.float32)  # (B, K*K)
        py = (lo[:, 1, None] + self._v).astype(np.float32)
        a32, d = a.astype(np.float32), (b - a).astype(np.float32)
        rx, ry = px - a32[:, 0, None], py - a32[:, 1, None]
        dx, dy = d[:, 0, None], d[:, 1, None]
        t = np.clip((rx * dx + ry * dy) / np.maximum(dx * dx + dy * dy, 1e-12), 0.0, 1.0)
        dist = np.hypot(rx - t * dx, ry - t * dy)
        cov = np.clip(np.float32(hw + 0.5) - dist, 0.0, 1.0)[..., None] * np.float32(opacity)
        idx = (lo[:, 1, None] + self._v) * self._cw + (lo[:, 0, None] + self._u)
        rows = np.arange(img.shape[0])[:, None]
        img[rows, idx] = img[rows, idx] * (1.0 - cov) + color * cov

    def render_batch(self, q: np.ndarray, goal: np.ndarray | None = None) -> np.ndarray:
        """Images of B arms (q: (B, n)) and their goals (B, n), or no ghost when goal is None:
        uint8 (B, H, W, 3)."""
        q = np.asarray(q, dtype=np.float64)
        if q.ndim != 2 or q.shape[1] != self.n:
            raise ValueError(f"q must have shape (B, {self.n}), got {q.shape}")
        if not np.all(np.isfinite(q)):
            raise ValueError("q contains NaN or Inf")
        b = q.shape[0]
        img = np.broadcast_to(BACKGROUND, (b, self._ch * self._cw, 3)).copy()
        pts = self.joints_xy(q) + self._pad
        for i in range(self.n):
            shade = np.float32(235.0 - 110.0 * i / max(1, self.n - 1))  # light base, darker tip
            self._blend(img, pts[:, i], pts[:, i + 1], self.arm_half_width, shade)
        if goal is not None:
            goal = np.asarray(goal, dtype=np.float64)
            if goal.shape != q.shape or not np.all(np.isfinite(goal)):
                raise ValueError(f"goal must be finite with shape {q.shape}, got {goal.shape}")
            pts = self.joints_xy(goal) + self._pad
            for i in range(self.n):
                color = GHOST[i % len(GHOST)]
                self._blend(img, pts[:, i], pts[:, i + 1], self.ghost_half_width, color, 0.9)
            self._blend(img, pts[:, -1], pts[:, -1], self.marker_radius, MARKER)
        img = img.reshape(b, self._ch, self._cw, 3)
        p = self._pad
        img = img[:, p : p + self.height, p : p + self.width]
        return np.clip(np.rint(img), 0, 255).astype(np.uint8)

    def render(self, q: np.ndarray, goal: np.ndarray | None = None) -> np.ndarray:
        """One image (H, W, 3) uint8 of the arm at ``q`` (n,) and, if given, the ghost ``goal``."""
        q = np.asarray(q, dtype=np.float64)[None]
        g = None if goal is None else np.asarray(goal, dtype=np.float64)[None]
        return self.render_batch(q, g)[0]


def render(
    q: np.ndarray, goal: np.ndarray | None = None, height: int = 64, width: int = 64
) -> np.ndarray:
    """One rgb8 image of the arm at ``q`` with its goal ghost (see ArmCamera)."""
    return ArmCamera(height, width, len(np.atleast_1d(q))).render(q, goal)
