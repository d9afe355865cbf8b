"""Prompts and captions in sample grids are drawn in fonts that have their characters: Latin-1,
Cyrillic, Greek and emoji never come out as boxes (Pillow's built-in font drew "â", "Ж" and
"😀" all as the same box), CJK is drawn with a system font when there is one, and a character
no font has is drawn as the sign of its Unicode block (Last Resort), not as a box."""

from __future__ import annotations

import numpy as np
import pytest
from PIL import Image

from spotlight.util import fonts
from spotlight.util.plots import sample_grid

pytestmark = pytest.mark.procs  # font lookup runs fc-list (fontconfig) for characters the shipped fonts lack

LATIN_1 = [chr(c) for c in range(0xA1, 0x100) if c != 0xAD]  # printable Latin-1 (0xAD: the soft hyphen)
OTHER_SCRIPTS = list("ЖжДдЯяЁёΩωλ€—…✓✗") + ["😀", "🐱", "🚀", "❤"]


def _is_box(font, ch: str) -> bool:
    """``ch`` is drawn as ``font``'s missing-glyph box (U+10FFFD is a private-use code point no
    text font has)."""
    notdef = font.getmask("\U0010ffff")
    mask = font.getmask(ch)
    return mask.size == notdef.size and bytes(mask) == bytes(notdef)


@pytest.mark.parametrize("size", [11, 13])
def test_latin_1_cyrillic_greek_and_emoji_have_glyphs(size):
    tf = fonts.TextFont(size)
    boxes = [ch for ch in LATIN_1 + OTHER_SCRIPTS if _is_box(tf.font_for(ch), ch)]
    assert not boxes, f"drawn as boxes: {''.join(boxes)}"


def _grid(tmp_path, label: str) -> np.ndarray:
    tile = np.full((3, 8, 8), 128, dtype=np.uint8)
    path = tmp_path / f"{ord(label[0]):x}.png"
    sample_grid([tile], [0], [0.5], path, title="iteration 1", labels={0: label})
    return np.asarray(Image.open(path).convert("RGB"))


@pytest.mark.parametrize("pair", ["âé", "ЖД", "😀🐱", "ñß"])
def test_different_characters_look_different_in_a_grid(tmp_path, pair):
    a, b = (_grid(tmp_path, f"a photo of {ch} {ch}") for ch in pair)
    assert a.shape == b.shape and (a != b).any(), f"{pair[0]} and {pair[1]} are drawn alike (as boxes)"


def test_cjk_uses_a_system_font_or_the_sign_of_its_block():
    tf = fonts.TextFont(13)
    font = tf.font_for("中")
    assert not _is_box(font, "中")
    system = [f for f in fonts._system_faces(ord("中")) if fonts._loaded(f, 13) is not None]
    if system:
        assert font.path == system[0][0], "a CJK font is installed but not used"
    else:  # no CJK font on this machine: Last Resort's sign for "CJK Unified Ideographs"
        assert font.path == fonts._last_resort()[0]


def test_variation_selectors_and_joiners_draw_nothing_of_their_own():
    tf = fonts.TextFont(13)
    assert tf.width("❤\ufe0f") == tf.width("❤")
    assert [run for run, _ in tf.runs("a\u200db")] in (["a\u200db"], ["ab"])
