"""Text in pictures (sample grids): every character drawn in a font that has it, never as a box.

Pillow's built-in font covers ASCII only, so "â", Cyrillic, CJK and emoji came out as boxes.
:class:`TextFont` draws a string run by run, each run in the first font of this chain that has
its characters (read from the font's ``cmap`` with fontTools):

1. DejaVu Sans, shipped inside matplotlib (a dependency): all of Latin-1 and the rest of Latin,
   Greek, Cyrillic, Armenian, Georgian, many symbols and monochrome emoji;
2. fonts of this system that fontconfig (``fc-list :charset=…``) lists for a character DejaVu
   lacks: CJK, Hangul, Thai, … when such a font is installed (``fonts-noto-cjk`` on Debian or
   Ubuntu); colour bitmap fonts that cannot be drawn at the size asked are skipped;
3. Last Resort, shipped inside matplotlib: a character no font on the machine has is drawn as
   the sign of its Unicode block (a framed glyph naming the script), not as an anonymous box.

Without matplotlib's font files (not expected: matplotlib is a dependency) the chain is the
system's DejaVu Sans, then Pillow's built-in font.
"""

from __future__ import annotations

import functools
import importlib.util
import pathlib
import subprocess
import unicodedata

from PIL import ImageFont

__all__ = ["TextFont", "text_font"]

FontFile = tuple[str, int]
"""A font file and the index of the face in it (a ``.ttc`` collection holds several)."""

SYSTEM_DEJAVU = "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf"


def _bundled(name: str) -> str | None:
    """``name`` in matplotlib's ``mpl-data/fonts/ttf`` (found without importing matplotlib)."""
    spec = importlib.util.find_spec("matplotlib")
    roots = list(spec.submodule_search_locations or []) if spec is not None else []
    for root in roots:
        path = pathlib.Path(root) / "mpl-data" / "fonts" / "ttf" / name
        if path.is_file():
            return str(path)
    return None


@functools.lru_cache(maxsize=None)
def _primary() -> FontFile | None:
    path = _bundled("DejaVuSans.ttf") or (SYSTEM_DEJAVU if pathlib.Path(SYSTEM_DEJAVU).is_file() else None)
    return (path, 0) if path else None


@functools.lru_cache(maxsize=None)
def _last_resort() -> FontFile | None:
    path = _bundled("LastResortHE-Regular.ttf")
    return (path, 0) if path else None


@functools.lru_cache(maxsize=None)
def _cmap(face: FontFile) -> frozenset[int]:
    """The code points ``face`` has glyphs for (empty if it cannot be read)."""
    from fontTools.ttLib import TTFont

    try:
        with TTFont(face[0], fontNumber=face[1], lazy=True) as tt:
            return frozenset(tt.getBestCmap() or ())
    except Exception:  # an unreadable or unusual font file is one font less, not a failed grid
        return frozenset()


@functools.lru_cache(maxsize=None)
def _system_faces(code_point: int) -> tuple[FontFile, ...]:
    """Faces fontconfig lists for ``code_point``, regular sans faces first (none without fontconfig)."""
    try:
        out = subprocess.run(
            ["fc-list", "--format", "%{file}\t%{index}\n", f":charset={code_point:x}"],
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return ()
    faces = []
    for line in out.splitlines():
        path, _, index = line.partition("\t")
        if path and index.isdigit():
            faces.append((path, int(index)))

    def rank(face: FontFile) -> tuple:
        name = pathlib.Path(face[0]).name.lower()
        styled = any(s in name for s in ("bold", "italic", "oblique", "light", "thin", "black", "medium"))
        return ("sans" not in name, "mono" in name or "serif" in name, styled, face)

    return tuple(sorted(set(faces), key=rank))


@functools.lru_cache(maxsize=None)
def _loaded(face: FontFile, size: int) -> ImageFont.FreeTypeFont | None:
    try:
        return ImageFont.truetype(face[0], size, index=face[1])
    except OSError:  # e.g. a colour bitmap emoji font, which has a few fixed sizes only
        return None


def _invisible(ch: str) -> bool:
    """A format character or variation selector (ZWJ, U+FE0F, …): drawn by the font of its
    run if it has it, else dropped, so it never shows as a glyph of its own."""
    cp = ord(ch)
    return unicodedata.category(ch) == "Cf" or 0xFE00 <= cp <= 0xFE0F or 0xE0100 <= cp <= 0xE01EF


class TextFont:
    """One text size in the font chain of the module docstring.

    Args:
        size: pixel size (what ``ImageFont.truetype`` takes).
    """

    def __init__(self, size: int):
        self.size = size
        self._faces: list[FontFile] = [f for f in (_primary(),) if f is not None]
        self._fallback = ImageFont.load_default(size=size) if not self._faces else None
        self._by_char: dict[str, ImageFont.FreeTypeFont | ImageFont.ImageFont] = {}

    @property
    def primary(self) -> ImageFont.FreeTypeFont | ImageFont.ImageFont:
        """The chain's first font (its ascent sets the baseline of a line)."""
        return self._fallback if self._fallback is not None else _loaded(self._faces[0], self.size)

    def font_for(self, ch: str) -> ImageFont.FreeTypeFont | ImageFont.ImageFont:
        """The first font of the chain with a glyph for ``ch``."""
        if ch in self._by_char:
            return self._by_char[ch]
        font = self._find(ord(ch))
        self._by_char[ch] = font
        return font

    def _find(self, cp: int):
        if self._fallback is not None:
            return self._fallback
        for face in self._faces:  # fonts already in use first: fontconfig is asked once per script
            if cp in _cmap(face) and (font := _loaded(face, self.size)) is not None:
                return font
        for face in (*_system_faces(cp), _last_resort()):
            if face is not None and cp in _cmap(face) and (font := _loaded(face, self.size)) is not None:
                if face != _last_resort():
                    self._faces.append(face)
                return font
        return self.primary

    def runs(self, text: str) -> list[tuple[str, ImageFont.FreeTypeFont | ImageFont.ImageFont]]:
        """``text`` cut into ``(run, font)`` pieces, each drawn in one font."""
        out: list[tuple[str, object]] = []
        for ch in text:
            if _invisible(ch):
                if out and ord(ch) in _font_cmap(out[-1][1]):
                    out[-1] = (out[-1][0] + ch, out[-1][1])
                continue
            font = self.font_for(ch)
            if out and out[-1][1] is font:
                out[-1] = (out[-1][0] + ch, font)
            else:
                out.append((ch, font))
        return out

    def width(self, text: str) -> float:
        """``text``'s advance width in pixels."""
        return sum(font.getlength(run) for run, font in self.runs(text))

    def draw(self, draw, xy: tuple[float, float], text: str, fill) -> None:
        """Draw ``text`` with its top-left corner at ``xy`` (runs on one baseline) on ``draw``
        (a ``PIL.ImageDraw.ImageDraw``)."""
        x, y = xy
        primary = self.primary
        if not isinstance(primary, ImageFont.FreeTypeFont):
            draw.text((x, y), text, fill=fill, font=primary)
            return
        baseline = y + primary.getmetrics()[0]
        for run, font in self.runs(text):
            draw.text((x, baseline), run, fill=fill, font=font, anchor="ls")
            x += font.getlength(run)


def _font_cmap(font) -> frozenset[int]:
    path = getattr(font, "path", None)
    return _cmap((path, getattr(font, "index", 0))) if isinstance(path, str) else frozenset()


@functools.lru_cache(maxsize=None)
def text_font(size: int) -> TextFont:
    """The shared :class:`TextFont` of ``size`` pixels."""
    return TextFont(size)
