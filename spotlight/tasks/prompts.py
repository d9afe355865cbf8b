"""Prompt sets as benchmarks publish them.

:func:`load_prompt_set` reads one prompt file and says exactly what it read:

* ``.jsonl`` — GenEval-style metadata, one JSON object per line; the prompt is under
  ``prompt`` (else ``text``, else ``caption``, else the key ``prompt_column`` names);
* ``.json`` — one JSON array: of prompt strings, or of objects with the key a JSONL record
  would have (anything else is refused with a hint to use ``.jsonl``);
* ``.csv`` / ``.tsv`` — a header row, then one record per prompt; the prompt column is the
  one named ``prompt``, ``text`` or ``caption`` (any case) or the one ``prompt_column``
  names. CSV is read by the ``csv`` module (RFC 4180: quoted fields with commas, quotes and
  line breaks); TSV as IANA text/tab-separated-values defines it: one record per line,
  fields split at tabs, no quoting (a field may begin or end with ``"``, kept as it is);
  both drop a UTF-8 byte-order mark;
* anything else — plain text, one prompt per line.

Every prompt keeps its record's other fields as its metadata (:attr:`PromptSet.metadata`:
a JSONL/JSON object's other keys, a CSV/TSV row's other columns as text; ``{}`` for plain
text), which travels with the prompt's requests to the reward (GenEval's ``tag`` /
``include`` / ``exclude``, an OCR target), and its line in the file (:attr:`PromptSet.lines`).

An optional filter keeps the prompts whose ``category_column`` value is one of
``categories`` (CSV, TSV and JSONL). Empty prompts are skipped and counted. Anything
ambiguous — two prompt columns, none, an unknown column, a category nothing has, a text
file that starts with a CSV header — is a :class:`~spotlight.config.ConfigError` naming
the file, the line and what is there. Nothing here touches torch.
"""

from __future__ import annotations

import csv
import dataclasses
import hashlib
import io
import json
import pathlib
from collections.abc import Sequence

from spotlight.config import DEFAULT_CONFIG_PATH, EXAMPLES_DIR, ConfigError, DataConfig, resolve_path

PROMPT_COLUMN_NAMES = ("prompt", "text", "caption")
"""Column (CSV/TSV, any case) or key (JSONL, in this order of preference) that holds the prompt."""

DEFAULT_PROMPTS_PATH = EXAMPLES_DIR / "prompts" / "geneval" / "train_metadata.jsonl"
"""The prompt file of an empty ``data.prompts_path``: the GenEval-style *training* set (3,400
records, disjoint from GenEval's 553 evaluation prompts; ``examples/prompts/SOURCES.md``). An
empty path never trains on an evaluation set."""


@dataclasses.dataclass(frozen=True)
class PromptSet:
    """The prompts of one file, and how they were read.

    Attributes:
        prompts: the prompt texts in file order (stripped, none empty).
        path: the file read.
        sha256: hex SHA-256 of the file's bytes.
        format: ``"jsonl"``, ``"csv"``, ``"tsv"`` or ``"text"``.
        prompt_column: the column or key the prompts came from ("" for text files).
        category_column: the column or key filtered on ("" = no filter).
        categories: the values of ``category_column`` kept.
        num_skipped_empty: records (or lines) whose prompt was empty.
        num_filtered_out: records the category filter dropped.
        metadata: per prompt (same order), its record's other fields (``{}`` for plain text).
        lines: per prompt, its line in the file (1-based; a JSON array's: the line its item starts on).
    """

    prompts: list[str]
    path: pathlib.Path
    sha256: str
    format: str
    prompt_column: str = ""
    category_column: str = ""
    categories: tuple[str, ...] = ()
    num_skipped_empty: int = 0
    num_filtered_out: int = 0
    metadata: list[dict] = dataclasses.field(default_factory=list)
    lines: list[int] = dataclasses.field(default_factory=list)

    def __post_init__(self):
        if not self.metadata:
            object.__setattr__(self, "metadata", [{} for _ in self.prompts])
        if not self.lines:
            object.__setattr__(self, "lines", list(range(1, len(self.prompts) + 1)))

    def to_json(self) -> dict:
        """What a run directory records (``prompts.json``): a JSON-ready dict."""
        return {
            "path": str(self.path),
            "sha256": self.sha256,
            "format": self.format,
            "num_prompts": len(self.prompts),
            "prompt_column": self.prompt_column,
            "category_column": self.category_column,
            "categories": list(self.categories),
            "num_skipped_empty": self.num_skipped_empty,
            "num_filtered_out": self.num_filtered_out,
        }

    def summary(self) -> str:
        """One line for the console: ``N prompts loaded from FILE (format, sha256 prefix)``."""
        extra = []
        if self.prompt_column:
            extra.append(f"column {self.prompt_column!r}")
        if self.category_column:
            extra.append(f"{self.category_column} in {list(self.categories)}, {self.num_filtered_out} filtered out")
        if self.num_skipped_empty:
            extra.append(f"{self.num_skipped_empty} empty skipped")
        details = ", ".join([self.format, *extra, f"sha256 {self.sha256[:12]}"])
        from spotlight.errors import plural

        return f"{plural(len(self.prompts), 'prompt')} loaded from {self.path} ({details})"


def file_format(path: str | pathlib.Path) -> str:
    """``"jsonl"``, ``"json"``, ``"csv"``, ``"tsv"`` or ``"text"``, from the file name's suffix (any case)."""
    formats = {".jsonl": "jsonl", ".json": "json", ".csv": "csv", ".tsv": "tsv"}
    return formats.get(pathlib.Path(path).suffix.lower(), "text")


def load_prompt_set(
    path: str | pathlib.Path,
    *,
    prompt_column: str = "",
    category_column: str = "",
    categories: Sequence[str] = (),
    source: str = "data.prompts_path",
) -> PromptSet:
    """Read the prompts of ``path`` (format from its suffix, see the module docstring).

    Args:
        path: the prompt file.
        source: where ``path`` came from, named by a missing-file error (a config key or a flag).
        prompt_column: CSV/TSV column or JSONL key of the prompts ("" = found by name).
        category_column: CSV/TSV column or JSONL key to filter on ("" = no filter).
        categories: values of ``category_column`` to keep (compared as text).

    Returns:
        :class:`PromptSet` with at least one prompt.

    Raises:
        ConfigError: missing or unreadable file, not UTF-8, a malformed record, no or two
            prompt columns, an unknown column, a category no record has, or no prompts;
            the message names the file (and line).
    """
    p = pathlib.Path(path)
    raw, text = _read_utf8(p, source)
    fmt = file_format(p)
    cats = tuple(str(c) for c in categories)
    if bool(cats) != bool(category_column):
        raise ConfigError(
            "data.categories: set data.category_column and data.categories together "
            "(the column, and its values to keep)"
        )
    if fmt == "text":
        if prompt_column or category_column:
            raise ConfigError(
                f"{p}: a plain-text prompt file (one prompt per line) has no columns; data.prompt_column and "
                "data.category_column need a .csv, .tsv or .jsonl file"
            )
        rows = _text_rows(p, text)
        used_column = ""
    elif fmt == "jsonl":
        rows, used_column = _jsonl_rows(p, text, prompt_column, category_column)
    elif fmt == "json":
        rows, used_column = _json_rows(p, text, prompt_column, category_column)
    elif fmt == "tsv":
        rows, used_column = _tsv_rows(p, text, prompt_column, category_column)
    else:
        rows, used_column = _table_rows(p, text, prompt_column, category_column)
    kept, filtered, empty = _keep_prompts(p, rows, category_column, cats)
    if not kept:
        raise ConfigError(f"{p}: no prompts" + (f" ({empty} empty)" if empty else ""))
    return PromptSet(
        prompts=[r.prompt for r in kept],
        metadata=[r.metadata for r in kept],
        lines=[r.line for r in kept],
        path=p,
        sha256=hashlib.sha256(raw).hexdigest(),
        format=fmt,
        prompt_column=used_column,
        category_column=category_column,
        categories=cats,
        num_skipped_empty=empty,
        num_filtered_out=filtered,
    )


def _read_utf8(p: pathlib.Path, source: str) -> tuple[bytes, str]:
    """The file's bytes and their UTF-8 text (a byte-order mark dropped)."""
    try:
        raw = p.read_bytes()
    except FileNotFoundError:
        raise ConfigError(f"{source}: file not found: {p}") from None
    except OSError as exc:
        raise ConfigError(f"{source}: cannot read {p}: {exc.strerror or exc}") from None
    from spotlight.util.text import decode_utf8

    try:
        return raw, decode_utf8(raw, str(p))
    except ValueError as exc:
        raise ConfigError(f"{exc}; save the prompt file as UTF-8") from None


@dataclasses.dataclass(frozen=True)
class _Row:
    """One record of a prompt file: its line, prompt, category (None: no filter) and other fields."""

    line: int
    prompt: str
    category: str | None = None
    metadata: dict = dataclasses.field(default_factory=dict)


def _keep_prompts(
    p: pathlib.Path, rows: list[_Row], category_column: str, cats: tuple[str, ...]
) -> tuple[list[_Row], int, int]:
    """Apply the category filter and drop empty prompts: ``(kept, num filtered out, num empty)``.
    Every one of ``cats`` must occur in ``category_column``."""
    kept, filtered, empty = [], 0, 0
    seen_categories: dict[str, int] = {}
    for row in rows:
        if category_column:
            category = row.category
            seen_categories[category] = seen_categories.get(category, 0) + 1
            if category not in cats:
                filtered += 1
                continue
        if not row.prompt:
            empty += 1
            continue
        kept.append(row)
    if category_column:
        missing = [c for c in cats if c not in seen_categories]
        if missing:
            present = sorted(seen_categories)
            shown = ", ".join(repr(c) for c in present[:12]) + (
                f", … ({len(present)} values)" if len(present) > 12 else ""
            )
            raise ConfigError(
                f"{p}: data.categories {missing} occur nowhere in column {category_column!r}; "
                f"its values: {shown or '(none)'}"
            )
    return kept, filtered, empty


def prompt_set_from_config(data: DataConfig, config_path: str | pathlib.Path | None = None) -> PromptSet:
    """:func:`load_prompt_set` of ``data.prompts_path`` (resolved with
    :func:`~spotlight.config.resolve_path`; "" = :data:`DEFAULT_PROMPTS_PATH`) with the
    section's column and category settings. ``config_path``: the config file the section
    came from (None: the embedded default), named by a missing-file error like every other
    config error.

    Raises:
        ConfigError: as :func:`load_prompt_set`.
    """
    path = resolve_path(data.prompts_path) if data.prompts_path else DEFAULT_PROMPTS_PATH
    source = f"{config_path if config_path is not None else DEFAULT_CONFIG_PATH}: data.prompts_path"
    return load_prompt_set(
        path,
        prompt_column=data.prompt_column,
        category_column=data.category_column,
        categories=data.categories,
        source=source,
    )


def truncation_report(lengths: Sequence[int], max_tokens: int) -> tuple[int, str]:
    """How many prompts the text encoder cut, and one line that says so.

    Args:
        lengths: tokens of each prompt as the family's encoder counts them (template included).
        max_tokens: ``model.max_text_tokens``.

    Returns:
        ``(num_cut, message)``; the message is "" when nothing was cut.
    """
    cut = [n for n in lengths if n > max_tokens]
    if not cut:
        return 0, ""
    return len(cut), (
        f"{len(cut)} of {len(lengths)} prompts are longer than model.max_text_tokens = {max_tokens} tokens "
        f"(longest {max(cut)}) and were cut; raise model.max_text_tokens to keep them whole"
    )


def empty_encoding_report(prompt_set: PromptSet, lengths: Sequence[int], family: str) -> str:
    """One line naming the first prompt the text encoder sees as no tokens at all, or "".

    Args:
        lengths: tokens of each prompt of ``prompt_set`` as the family's encoder counts them
            (:meth:`~spotlight.models.families.base.ModelFamily.prompt_token_counts`, the template's
            dropped prefix not counted): 0 or less means the pipeline would get an empty sequence.
        family: ``model.family``, named by the message.
    """
    empty = [i for i, n in enumerate(lengths) if n <= 0]
    if not empty:
        return ""
    i = empty[0]
    more = f" ({len(empty) - 1} more prompts likewise)" if len(empty) > 1 else ""
    return (
        f"{prompt_set.path}:{prompt_set.lines[i]}: prompt {prompt_set.prompts[i][:80]!r} encodes to no tokens with "
        f"the {family} checkpoint's tokenizer{more}; reword it or remove it"
    )


def _text_rows(p: pathlib.Path, text: str) -> list[_Row]:
    lines = text.splitlines()
    first = next(((n, line) for n, line in enumerate(lines, 1) if line.strip()), None)
    if first is not None:
        for delim, kind in (("\t", "TSV"), (",", "CSV")):
            fields = [f.strip().strip('"').strip().lower() for f in first[1].split(delim)]
            named = [f for f in fields if f in PROMPT_COLUMN_NAMES]
            if len(fields) >= 2 and named:
                raise ConfigError(
                    f"{p}:{first[0]}: this looks like a {kind} header (a {named[0]!r} column), "
                    f"but a {p.suffix or 'suffix-less'} file is read as "
                    f"plain text, one prompt per line; rename it to .{kind.lower()} to read it as a table"
                )
    return [_Row(n, line.strip()) for n, line in enumerate(lines, 1)]


def _pick_column(p: pathlib.Path, where: str, names: list[str], wanted: str, setting: str) -> str:
    """The one of ``names`` that ``wanted`` names (exactly, else in any case)."""
    if wanted in names:
        return wanted
    folded = [n for n in names if n.lower() == wanted.lower()]
    if len(folded) == 1:
        return folded[0]
    raise ConfigError(
        f"{p}:{where}: {setting} = {wanted!r} is not a column; columns: {', '.join(repr(n) for n in names)}"
    )


def _header_columns(
    p: pathlib.Path, kind: str, hline: int, names: list[str], prompt_column: str, category_column: str
) -> tuple[str, str]:
    """The prompt column and the category column ("" = none) of a CSV/TSV header."""
    if prompt_column:
        col = _pick_column(p, str(hline), names, prompt_column, "data.prompt_column")
    else:
        matches = [n for n in names if n.lower() in PROMPT_COLUMN_NAMES]
        if not matches:
            raise ConfigError(
                f"{p}:{hline}: no prompt column in the header "
                f"(looked for {', '.join(PROMPT_COLUMN_NAMES)}, any case); "
                f"columns: {', '.join(repr(n) for n in names)}; name one with data.prompt_column"
            )
        if len(matches) > 1:
            raise ConfigError(
                f"{p}:{hline}: more than one prompt column ({', '.join(repr(n) for n in matches)}); "
                "choose one with data.prompt_column"
            )
        col = matches[0]
    cat = _pick_column(p, str(hline), names, category_column, "data.category_column") if category_column else ""
    if names.count(col) > 1 or (cat and names.count(cat) > 1):
        raise ConfigError(f"{p}:{hline}: column {col if names.count(col) > 1 else cat!r} appears twice in the header")
    return col, cat


def _record_row(line: int, names: list[str], record: list[str], col: str, cat: str) -> _Row:
    """A CSV/TSV record as a row: the prompt column's text, the category's, the other columns as metadata."""
    i_prompt = names.index(col)
    meta = {n: v.strip() for j, (n, v) in enumerate(zip(names, record)) if j != i_prompt and n}
    return _Row(line, record[i_prompt].strip(), record[names.index(cat)].strip() if cat else None, meta)


def _empty_table(p: pathlib.Path, kind: str) -> ConfigError:
    return ConfigError(
        f"{p}: empty {kind} file; expected a header row with a prompt column ({', '.join(PROMPT_COLUMN_NAMES)})"
    )


def _tsv_rows(p: pathlib.Path, text: str, prompt_column: str, category_column: str) -> tuple[list[_Row], str]:
    """IANA text/tab-separated-values: one record per line, fields split at tabs, no quoting."""
    lines = [(n, line) for n, line in enumerate(text.splitlines(), 1) if line.strip()]
    if not lines:
        raise _empty_table(p, "TSV")
    hline, header = lines[0]
    names = [h.strip() for h in header.split("\t")]
    col, cat = _header_columns(p, "TSV", hline, names, prompt_column, category_column)
    rows = []
    for n, line in lines[1:]:
        record = line.split("\t")
        if len(record) != len(names):
            raise ConfigError(
                f"{p}:{n}: {len(record)} fields but the header has {len(names)}; "
                "a TSV field cannot hold a tab (TSV has no quoting: use .csv for that)"
            )
        rows.append(_record_row(n, names, record, col, cat))
    return rows, col


def _table_rows(p: pathlib.Path, text: str, prompt_column: str, category_column: str) -> tuple[list[_Row], str]:
    """CSV (RFC 4180, through the ``csv`` module: quoting, embedded commas and line breaks)."""
    reader = csv.reader(io.StringIO(text, newline=""), strict=True)
    try:
        header = next(reader, None)
        while header is not None and not any(h.strip() for h in header):
            header = next(reader, None)
        if header is None:
            raise _empty_table(p, "CSV")
        names = [h.strip() for h in header]
        col, cat = _header_columns(p, "CSV", reader.line_num, names, prompt_column, category_column)
        rows = []
        start = reader.line_num + 1
        for record in reader:
            if not record or (len(record) == 1 and not record[0].strip()):
                start = reader.line_num + 1
                continue  # a blank line
            if len(record) != len(names):
                raise ConfigError(
                    f"{p}:{reader.line_num}: {len(record)} fields but the header has {len(names)}; "
                    "quote fields that contain commas"
                )
            rows.append(_record_row(start, names, record, col, cat))
            start = reader.line_num + 1
    except csv.Error as exc:
        raise ConfigError(f"{p}:{reader.line_num}: not valid CSV: {exc}") from None
    return rows, col


def _object_row(p: pathlib.Path, line: int, where: str, obj, key: str, category_column: str) -> tuple[_Row, str]:
    """A JSON object's row (``key`` found on the first object when ""); returns ``(row, key)``.
    ``where`` is what errors name after the file (its line, and for a JSON array the item)."""
    if not isinstance(obj, dict):
        raise ConfigError(f"{p}:{where}: expected a JSON object with a 'prompt' key, got {type(obj).__name__}")
    if not key:
        key = next((k for k in PROMPT_COLUMN_NAMES if k in obj), "")
        if not key:
            raise ConfigError(
                f"{p}:{where}: no prompt key (looked for {', '.join(PROMPT_COLUMN_NAMES)}); "
                f"keys: {', '.join(repr(k) for k in obj)}; name one with data.prompt_column"
            )
    if key not in obj:
        raise ConfigError(f"{p}:{where}: no {key!r} key; keys: {', '.join(repr(k) for k in obj)}")
    if category_column and category_column not in obj:
        raise ConfigError(
            f"{p}:{where}: no {category_column!r} key (data.category_column); keys: {', '.join(repr(k) for k in obj)}"
        )
    value = obj[key]
    if not isinstance(value, str):
        raise ConfigError(f"{p}:{where}: {key!r} is a {type(value).__name__}, not text")
    meta = {k: v for k, v in obj.items() if k != key}
    return _Row(line, value.strip(), str(obj[category_column]) if category_column else None, meta), key


def _json_rows(p: pathlib.Path, text: str, prompt_column: str, category_column: str) -> tuple[list[_Row], str]:
    """A ``.json`` file: one array of prompt strings or of prompt objects."""
    hint = "for one JSON object per line, name the file .jsonl"
    try:
        data = json.loads(text)
    except ValueError as exc:
        raise ConfigError(f"{p}:{exc.lineno}: not one JSON array ({exc.msg}); {hint}") from None
    if not isinstance(data, list):
        raise ConfigError(
            f"{p}:1: a .json prompt file is one JSON array (of strings, or of objects with a 'prompt' key), "
            f"got a {type(data).__name__}; {hint}"
        )
    starts = _array_item_lines(text, len(data))
    rows, key = [], prompt_column
    kinds = {type(x) for x in data}
    if kinds == {str} and not prompt_column and not category_column:
        return [_Row(starts[i], x.strip()) for i, x in enumerate(data)], ""
    for i, obj in enumerate(data):
        if isinstance(obj, str):
            raise ConfigError(f"{p}:{starts[i]}: item {i} is a string among objects; use one kind of item")
        row, key = _object_row(p, starts[i], f"{starts[i]}: item {i}", obj, key, category_column)
        rows.append(row)
    return rows, key


def _array_item_lines(text: str, count: int) -> list[int]:
    """The 1-based line each top-level item of a JSON array starts on (for error messages)."""
    dec = json.JSONDecoder()
    out, i = [], text.index("[") + 1
    ws = " \t\r\n,"
    for _ in range(count):
        while text[i] in ws:
            i += 1
        out.append(text.count("\n", 0, i) + 1)
        _, i = dec.raw_decode(text, i)
    return out


def _jsonl_rows(p: pathlib.Path, text: str, prompt_column: str, category_column: str) -> tuple[list[_Row], str]:
    rows = []
    key = prompt_column
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except ValueError as exc:
            raise ConfigError(f"{p}:{n}: not a JSON object: {exc}") from None
        row, key = _object_row(p, n, str(n), obj, key, category_column)
        rows.append(row)
    return rows, key
