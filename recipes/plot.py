"""A line chart as a PNG, in numpy and the standard library: what OUT/loss.png is drawn with.

``chart(series)`` draws lines (and, where asked, round markers) of (x, y) points on a white canvas with a
framed plot area, grid lines at round ticks, tick labels, axis labels and a legend; ``png(rgb)`` encodes
an ``(H, W, 3)`` uint8 array as an 8-bit RGB PNG (zlib + CRC-32, no filtering). Lines are anti-aliased
by each pixel's distance to its nearest segment; text is a 5x7 bitmap font (lowercase, digits, some
punctuation) drawn at twice its size. Cost: O(points) Python work plus numpy work over the pixels each
segment's box covers; a series with more than two points per pixel column is drawn through each column's
first, lowest, highest and last point (the same picture), so a run of any length costs a few thousand
segments at most.
"""
from __future__ import annotations

import math
import struct
import zlib
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

Color = tuple[int, int, int]
BLUE, ORANGE = (31, 119, 180), (255, 127, 14)  # train and val, as matplotlib's first two colours
INK, GRID, WHITE = (60, 60, 60), (225, 225, 225), (255, 255, 255)
SCALE = 2  # pixels per glyph dot: a character is 12 px wide, capitals 14 px tall, descenders 4 more
LEFT, RIGHT, TOP, BOTTOM = 44, 32, 20, 56  # the plot area's margins (left: plus its tick labels' width)

# 5x7 glyphs (9 rows with a descender), one hex byte per row from the top, bit 4 the leftmost dot;
# a character not here draws as '?'
FONT = {c: bytes.fromhex(h) for c, h in {
    "0": "0e11131519110e", "1": "040c040404040e", "2": "0e11010204081f",
    "3": "1f02040201110e", "4": "02060a121f0202", "5": "1f101e0101110e",
    "6": "0608101e11110e", "7": "1f010204080808", "8": "0e11110e11110e", "9": "0e11110f01020c",
    ".": "000000000c0c00", ",": "00000000000c0c0408", "-": "0000001f000000",
    "+": "0004041f040400", "/": "00010204081000", ":": "000c0c000c0c00", "%": "18190204081303",
    "(": "02040808080402", ")": "08040202020408", "_": "0000000000001f", " ": "00000000000000",
    "?": "0e110102040004", "M": "111b1515111111",
    "a": "00000e010f110f", "b": "1010161911111e", "c": "00000e1010110e",
    "d": "01010d1311110f", "e": "00000e111f100e", "f": "0609081c080808", "g": "00000f1111110f010e",
    "h": "10101619111111", "i": "04000c0404040e", "j": "02000602020202120c",
    "k": "10101214181412", "l": "0c04040404040e", "m": "00001a15151111", "n": "00001619111111",
    "o": "00000e1111110e", "p": "00001e1111111e1010", "q": "00000f1111110f0101", "r": "00001619101010",
    "s": "00000e100e011e", "t": "08081c08080906", "u": "0000111111130d",
    "v": "00001111110a04", "w": "0000111115150a", "x": "0000110a040a11",
    "y": "0000111111110f010e", "z": "00001f0204081f",
}.items()}


@dataclass(frozen=True)
class Series:
    """One line: its points, legend label, colour, width in pixels and marker radius (0: none)."""
    points: Sequence[tuple[float, float]]
    label: str
    color: Color
    width: float = 1.5
    marker: float = 0.0


@dataclass(frozen=True)
class Frame:
    """Where data lands: the plot area's pixel box and the data ranges it spans (y grows upwards)."""
    box: tuple[int, int, int, int]  # left, top, right, bottom pixel columns/rows of the frame lines
    xlim: tuple[float, float]
    ylim: tuple[float, float]

    def px(self, x: float, y: float) -> tuple[float, float]:
        """(column, row) of the data point (x, y)."""
        (l, t, r, b), (x0, x1), (y0, y1) = self.box, self.xlim, self.ylim
        return l + (x - x0) / (x1 - x0) * (r - l), b - (y - y0) / (y1 - y0) * (b - t)


def ticks(lo: float, hi: float, target: int = 8) -> list[float]:
    """Round values (1, 2, 2.5 or 5 times a power of ten apart) in [lo, hi], about ``target`` of them."""
    raw = (hi - lo) / max(target, 1)
    power = 10 ** math.floor(math.log10(raw))
    step = next(m * power for m in (1, 2, 2.5, 5, 10) if m * power >= raw)
    first = math.ceil(lo / step - 1e-9)
    return [round(k * step, 12) for k in range(first, math.floor(hi / step + 1e-9) + 1)]


def tick_labels(values: list[float]) -> list[str]:
    """Labels with the fewest decimals (up to 4, else 4 significant digits) that show each value exactly;
    whole numbers from 10,000 up as ``25k``, from 10 million up as ``10M``."""
    top = max((abs(v) for v in values), default=0)
    if top >= 10_000 and all(v == int(v) for v in values):
        div, suffix = (1e6, "M") if top >= 1e7 else (1e3, "k")
        return [f"{v / div:g}{suffix}" if v else "0" for v in values]
    decimals = next((d for d in range(5) if all(abs(round(v, d) - v) < 1e-9 * max(top, 1) for v in values)), None)
    return [f"{v:.{decimals}f}" for v in values] if decimals is not None else [f"{v:.4g}" for v in values]


def frame(series: Sequence[Series], width: int, height: int) -> Frame:
    """The plot area of a ``width`` x ``height`` chart and data limits that hold every point with a margin."""
    xs = [x for s in series for x, _ in s.points]
    ys = [y for s in series for _, y in s.points]

    def limits(v: list[float], pad: float) -> tuple[float, float]:
        lo, hi = (min(v), max(v)) if v else (0.0, 1.0)
        span = hi - lo or max(abs(hi), 1.0)  # one value: a range around it
        return lo - pad * span, hi + pad * span

    ylim = limits(ys, 0.05)
    widest = max(map(len, tick_labels(ticks(*ylim))), default=1)
    left = LEFT + 6 * SCALE * widest  # the y label, a gap, the widest tick label and a tick
    return Frame((left, TOP, width - RIGHT, height - BOTTOM), limits(xs, 0.02), ylim)


def _envelope(pts: np.ndarray, frame_: Frame) -> np.ndarray:
    """``pts`` (n, 2 in pixels) thinned to each pixel column's first, lowest, highest and last point, in order,
    when there are more than two a column: the same picture from fewer segments."""
    l, _, r, _ = frame_.box
    if len(pts) <= 2 * (r - l):
        return pts
    cols = np.floor(pts[:, 0]).astype(np.int64)
    keep = np.zeros(len(pts), bool)
    starts = np.flatnonzero(np.r_[True, cols[1:] != cols[:-1]])
    for a, b in zip(starts, np.r_[starts[1:], len(pts)]):
        keep[[a, b - 1, a + np.argmin(pts[a:b, 1]), a + np.argmax(pts[a:b, 1])]] = True
    return pts[keep]


def _stroke(cover: np.ndarray, pts: np.ndarray, width: float) -> None:
    """Raise ``cover`` (H, W in [0, 1]) to each pixel's coverage by the polyline ``pts`` of ``width`` pixels."""
    half, (h, w) = width / 2, cover.shape
    for (ax, ay), (bx, by) in zip(pts[:-1], pts[1:]) if len(pts) > 1 else [(pts[0], pts[0])]:
        x0, x1 = max(int(min(ax, bx) - half - 1), 0), min(int(max(ax, bx) + half + 2), w)
        y0, y1 = max(int(min(ay, by) - half - 1), 0), min(int(max(ay, by) + half + 2), h)
        if x0 >= x1 or y0 >= y1:
            continue
        yy, xx = np.mgrid[y0:y1, x0:x1]
        dx, dy = bx - ax, by - ay
        t = np.clip(((xx - ax) * dx + (yy - ay) * dy) / (dx * dx + dy * dy or 1.0), 0, 1)
        dist = np.hypot(xx - ax - t * dx, yy - ay - t * dy)
        np.maximum(cover[y0:y1, x0:x1], np.clip(half + 0.5 - dist, 0, 1), out=cover[y0:y1, x0:x1])


def _dots(cover: np.ndarray, pts: np.ndarray, radius: float) -> None:
    """Raise ``cover`` to each pixel's coverage by filled discs of ``radius`` at ``pts``."""
    for x, y in pts:
        _stroke(cover, np.array([[x, y]]), 2 * radius)


def _paint(img: np.ndarray, cover: np.ndarray, color: Color) -> None:
    """Blend ``color`` into ``img`` by ``cover``, only where it covers something."""
    on = cover > 0
    c = cover[on][:, None]
    img[on] = img[on] * (1 - c) + np.asarray(color, np.float32) * c


def text_mask(text: str) -> np.ndarray:
    """The bitmap (bool, 18 rows, 12 columns a character; the baseline under row 14) of one line of ``text``."""
    glyphs = [FONT.get(c, FONT["?"]) for c in text]
    bits = np.zeros((9, 6 * len(glyphs)), bool)
    for i, rows in enumerate(glyphs):
        for r, byte in enumerate(rows):
            bits[r, 6 * i:6 * i + 5] = [(byte >> (4 - k)) & 1 for k in range(5)]
    return bits.repeat(SCALE, 0).repeat(SCALE, 1)


def _text(img: np.ndarray, text: str, x: float, y: float, color: Color = INK, anchor: str = "lt",
          vertical: bool = False) -> None:
    """Draw ``text`` with its ``anchor`` at (x, y): l/c/r across; t/m/b the top, middle or baseline of its
    capitals (descenders hang below); ``vertical`` reads bottom-up, anchored by its whole box."""
    mask = np.rot90(text_mask(text)) if vertical else text_mask(text)
    h, w = mask.shape
    body = h if vertical else 7 * SCALE
    x0 = int(round(x - {"l": 0, "c": w / 2, "r": w}[anchor[0]]))
    y0 = int(round(y - {"t": 0, "m": body / 2, "b": body}[anchor[1]]))
    sub = img[max(y0, 0):y0 + h, max(x0, 0):x0 + w]
    sub[mask[max(-y0, 0):, max(-x0, 0):][:sub.shape[0], :sub.shape[1]]] = color


def _axes(img: np.ndarray, f: Frame, xlabel: str, ylabel: str) -> None:
    """The frame, grid lines and ticks at round values, their labels, and the axis labels."""
    (l, t, r, b), (x0, x1), (y0, y1) = f.box, f.xlim, f.ylim
    xt, yt = ticks(x0, x1), ticks(y0, y1)
    for v, label in zip(xt, tick_labels(xt)):
        c = int(round(f.px(v, y0)[0]))
        img[t:b, c], img[b:b + 5, c] = GRID, INK
        _text(img, label, c, b + 8, anchor="ct")
    for v, label in zip(yt, tick_labels(yt)):
        row = int(round(f.px(x0, v)[1]))
        img[row, l:r], img[row, l - 5:l] = GRID, INK
        _text(img, label, l - 9, row, anchor="rm")
    img[t:b + 1, [l, r]], img[[t, b], l:r + 1] = INK, INK
    _text(img, xlabel, (l + r) / 2, img.shape[0] - 6, anchor="cb")
    _text(img, ylabel, 6, (t + b) / 2, anchor="lm", vertical=True)


def _legend(img: np.ndarray, named: Sequence[Series], f: Frame, drawn: np.ndarray) -> None:
    """A box of each series' sample line and label, in the frame's corner that hides the fewest
    ``drawn`` (n, 2) pixels, the top right first."""
    (l, t, r, b), h, w = f.box, 24 * len(named) + 10, 12 * max(len(s.label) for s in named) + 58
    corners = [(r - 10 - w, t + 10), (l + 10, t + 10), (r - 10 - w, b - 10 - h), (l + 10, b - 10 - h)]
    x, y = min(corners, key=lambda c: int(((drawn >= c) & (drawn <= (c[0] + w, c[1] + h))).all(1).sum()))
    img[y:y + h + 1, x:x + w + 1] = (200, 200, 200)
    img[y + 1:y + h, x + 1:x + w] = WHITE
    for i, s in enumerate(named):
        row = y + 17 + 24 * i
        cover = np.zeros(img.shape[:2], np.float32)
        _stroke(cover, np.array([[x + 10.0, row], [x + 38.0, row]]), s.width)
        if s.marker:
            _dots(cover, np.array([[x + 24.0, row]]), s.marker)
        _paint(img, cover, s.color)
        _text(img, s.label, x + 48, row, anchor="lm")


def chart(series: Sequence[Series], *, width: int = 720, height: int = 450, xlabel: str = "",
          ylabel: str = "") -> np.ndarray:
    """An ``(height, width, 3)`` uint8 picture of ``series`` against shared axes, with a legend of the
    labelled ones; lines are clipped to the frame."""
    f = frame(series, width, height)
    img = np.full((height, width, 3), WHITE, np.float32)
    _axes(img, f, xlabel, ylabel)
    l, t, r, b = f.box
    inside = np.zeros((height, width), bool)
    inside[t + 1:b, l + 1:r] = True
    drawn = [np.zeros((0, 2))]
    for s in series:
        if not s.points:
            continue
        pts = np.array([f.px(x, y) for x, y in s.points], np.float64)
        cover = np.zeros((height, width), np.float32)
        _stroke(cover, _envelope(pts, f), s.width)
        if s.marker or len(pts) == 1:  # a lone point without a marker shows as a dot
            _dots(cover, pts, s.marker or s.width)
        _paint(img, cover * inside, s.color)
        drawn.append(pts)
    named = [s for s in series if s.label]
    if named:
        _legend(img, named, f, np.concatenate(drawn))
    return np.clip(np.rint(img), 0, 255).astype(np.uint8)


def png(rgb: np.ndarray) -> bytes:
    """The PNG file of an ``(H, W, 3)`` uint8 array: 8-bit RGB, each row unfiltered, zlib-compressed."""
    if rgb.ndim != 3 or rgb.shape[2] != 3 or rgb.dtype != np.uint8:
        raise ValueError(f"rgb: got shape {rgb.shape} {rgb.dtype}, expected (H, W, 3) uint8")
    h, w, _ = rgb.shape

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    rows = np.concatenate([np.zeros((h, 1), np.uint8), rgb.reshape(h, 3 * w)], axis=1)  # filter byte 0: none
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(rows.tobytes(), 6)) + chunk(b"IEND", b""))
