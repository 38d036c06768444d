"""recipes/plot.py: the PNG it writes decodes (zlib, CRCs) to the picture it drew, and the lines' pixels sit
where their data says, inside the frame, over round ticks; a long series keeps its extremes."""
import struct
import zlib

import numpy as np
import pytest

from recipes import plot


def read_png(data: bytes) -> np.ndarray:
    """The (H, W, 3) uint8 pixels of an 8-bit RGB PNG with unfiltered rows (what ``plot.png`` writes),
    each chunk's CRC checked."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos, chunks = 8, {}
    while pos < len(data):
        (n,), kind = struct.unpack(">I", data[pos:pos + 4]), data[pos + 4:pos + 8]
        body, (crc,) = data[pos + 8:pos + 8 + n], struct.unpack(">I", data[pos + 8 + n:pos + 12 + n])
        assert zlib.crc32(kind + body) == crc, kind
        chunks[kind] = chunks.get(kind, b"") + body
        pos += 12 + n
    w, h, depth, color, _, _, interlace = struct.unpack(">IIBBBBB", chunks[b"IHDR"])
    assert (depth, color, interlace) == (8, 2, 0) and b"IEND" in chunks
    rows = np.frombuffer(zlib.decompress(chunks[b"IDAT"]), np.uint8).reshape(h, 1 + 3 * w)
    assert not rows[:, 0].any()  # filter type 0 on every row
    return rows[:, 1:].reshape(h, w, 3)


def near(img: np.ndarray, color) -> np.ndarray:
    """Where ``img`` is within a few levels of ``color``."""
    return (np.abs(img.astype(int) - color) <= 8).all(-1)


def test_png_decodes_to_the_array_it_was_given():
    rgb = np.random.default_rng(0).integers(0, 256, (7, 13, 3), dtype=np.uint8)
    assert np.array_equal(read_png(plot.png(rgb)), rgb)
    with pytest.raises(ValueError, match=r"rgb: got shape \(7, 13\) uint8, expected \(H, W, 3\) uint8"):
        plot.png(rgb[..., 0])


TRAIN = [(s, 4.0 - 3.0 * s / 600) for s in range(0, 601, 10)]  # a straight descent 4 -> 1
VAL = [(100, 1.5), (300, 1.5), (500, 1.5)]


def test_the_curves_pixels_are_where_the_data_says():
    series = [plot.Series(TRAIN, "train loss", plot.BLUE, width=2.0), plot.Series(VAL, "val loss", plot.ORANGE,
                                                                                  width=2.0, marker=3.5)]
    img = read_png(plot.png(plot.chart(series, width=640, height=400, xlabel="step", ylabel="loss")))
    assert img.shape == (400, 640, 3)
    f = plot.frame(series, 640, 400)
    (left, top, right, bottom), (x0, x1), (y0, y1) = f.box, f.xlim, f.ylim
    assert x0 < 0 and x1 > 600 and y0 < 1 and y1 > 4  # every point inside the frame, with a margin
    assert f.px(x0, y0) == (left, bottom) and f.px(x1, y1) == (right, top)
    blue, orange = near(img, plot.BLUE), near(img, plot.ORANGE)
    legend = np.s_[top:top + 70, right - 200:right]  # the legend's box, top right, holds both colours
    assert blue[legend].any() and orange[legend].any()
    blue[legend] = orange[legend] = False
    for x, y in VAL:  # each marker's centre
        col, row = map(round, f.px(x, y))
        assert orange[row - 1:row + 2, col - 1:col + 2].all(), (x, y)
    for x, y in TRAIN[2:-2]:
        if abs(y - 1.5) > 0.3:  # clear of the val line drawn over it
            col, row = f.px(x, y)
            rows = np.flatnonzero(blue[:, round(col)])
            assert len(rows) and abs(rows.mean() - row) <= 1, (x, y, rows)
    assert not blue[:, :left].any() and not blue[bottom:].any() and not blue[:, right:].any()  # clipped to the frame


def test_ticks_are_round_and_labelled_with_the_decimals_they_need():
    assert plot.ticks(1.3, 5.2) == [1.5, 2.0, 2.5, 3.0, 3.5, 4.0, 4.5, 5.0]
    assert plot.ticks(-12, 612) == [0, 100, 200, 300, 400, 500, 600]
    assert plot.tick_labels([1.5, 2.0, 2.5]) == ["1.5", "2.0", "2.5"]
    assert plot.tick_labels([0.25, 0.5]) == ["0.25", "0.50"]
    assert plot.tick_labels([0, 100, 200]) == ["0", "100", "200"]
    assert plot.tick_labels([0, 25_000, 50_000]) == ["0", "25k", "50k"]
    assert plot.tick_labels([1e-5, 1.25e-5]) == ["1e-05", "1.25e-05"]


def test_a_long_series_keeps_its_extremes_and_a_lone_point_shows():
    points = [(s, 2.0) for s in range(100_000)]
    points[54_321] = (54_321, 3.0)  # one spike among 100k points, far more than the chart has columns
    series = [plot.Series(points, "train loss", plot.BLUE)]
    img, f = plot.chart(series), plot.frame(series, 720, 450)
    col, row = map(round, f.px(54_321, 3.0))
    assert near(img, plot.BLUE)[row - 1:row + 2, col - 1:col + 2].any()
    lone = [plot.Series([(7, 2.5)], "val loss", plot.ORANGE)]
    col, row = map(round, plot.frame(lone, 720, 450).px(7, 2.5))
    assert near(plot.chart(lone), plot.ORANGE)[row, col]


def test_every_glyph_is_five_dots_wide_and_seven_or_nine_rows_tall():
    for char, rows in plot.FONT.items():
        assert len(rows) in (7, 9) and max(rows) < 32, char
    assert plot.text_mask("loss 1.5k?").shape == (9 * plot.SCALE, 10 * 6 * plot.SCALE)
