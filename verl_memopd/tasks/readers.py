"""Input files of ``tasks convert`` -> records, each with the place a user would look it up.

A file's kind is read from its content, not its name: gzip (``1f 8b``) is decompressed first, then
parquet (``PAR1``), else UTF-8 text (a byte-order mark is dropped; CRLF line ends are fine) that is
one JSON value (an array of records, or one record) or JSON lines (one record per line, blank lines
skipped). Places: ``FILE line L`` (JSON lines: the file's own line number, 1-based), ``FILE [i]``
(the index in a JSON array), ``FILE row i`` (parquet, 0-based).

A file that is none of these raises :class:`InputError` with one line naming the file, what was
wrong (for JSON that does not parse: the line and column) and the formats accepted. A JSON-lines
file keeps a line that does not parse as its raw text (refused later as ``bad_record``) -- unless no
line at all is a JSON object, which is one file error (a pretty-printed JSON cut off mid-file, a CSV).
"""

from __future__ import annotations

import gzip
import io
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["ACCEPTED", "InputError", "Located", "read_located", "read_corpus", "file_stem"]

#: What ``convert`` reads (printed in file errors).
ACCEPTED = (
    "JSON lines, a JSON array of records or one JSON record, or parquet; "
    "each may be gzip-compressed (the kind is read from the content, not the file name)"
)


class InputError(ValueError):
    """A whole input file cannot be read (message: one line naming the file)."""


@dataclass(frozen=True)
class Located:
    """One input record and where it is: ``where`` = ``FILE line L`` | ``FILE [i]`` | ``FILE row i``;
    ``file`` = the file's name without ``.gz`` / ``.jsonl`` / ``.json`` / ``.parquet``; ``index`` = its
    position among the file's records (0-based)."""

    value: Any
    where: str
    file: str = ""
    index: int = 0


def file_stem(path: str | Path) -> str:
    """``data/ruler.jsonl.gz`` -> ``ruler``."""
    name = Path(path).name
    for suffix in (".gz", ".jsonl", ".json", ".parquet"):
        name = name[: -len(suffix)] if name.endswith(suffix) and len(name) > len(suffix) else name
    return name


def read_located(path: str | Path) -> list[Located]:
    """All records of ``path`` in order (see module docstring); raises :class:`InputError`."""
    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as e:
        raise InputError(f"{path}: cannot read ({e.strerror or e})") from None
    name = path.name
    if data[:2] == b"\x1f\x8b":
        try:
            data = gzip.decompress(data)
        except (OSError, EOFError) as e:
            raise InputError(f"{path}: gzip data that does not decompress ({e})") from None
    if data[:4] == b"PAR1":
        return _parquet(data, path, name)
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise InputError(
            f"{path}: not UTF-8 text (byte {e.start}: {data[e.start : e.start + 4]!r}) and not "
            f"parquet; accepted: {ACCEPTED}"
        ) from None
    return _json_text(text, path, name)


def _parquet(data: bytes, path: Path, name: str) -> list[Located]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        rows = pq.read_table(io.BytesIO(data)).to_pylist()
    except (pa.ArrowException, OSError) as e:
        raise InputError(f"{path}: starts like parquet but does not read as parquet ({e})") from None
    return [Located(row, f"{name} row {i}", file_stem(path), i) for i, row in enumerate(rows)]


def _json_text(text: str, path: Path, name: str) -> list[Located]:
    if not text.strip():
        raise InputError(f"{path}: empty file; accepted: {ACCEPTED}")
    try:
        whole = json.loads(text)
    except json.JSONDecodeError as e:
        whole_error = e
    else:
        if isinstance(whole, list):
            return [Located(value, f"{name} [{i}]", file_stem(path), i) for i, value in enumerate(whole)]
        return [Located(whole, f"{name} line 1", file_stem(path), 0)]
    if text.lstrip().startswith("["):
        cut = " (the file ends before the array does: cut off?)" if whole_error.pos >= len(text.rstrip()) else ""
        raise InputError(f"{path}: a JSON array that does not parse: {_position(whole_error)}{cut}")
    lines = [(n, line) for n, line in enumerate(text.splitlines(), 1) if line.strip()]
    values = [(n, _json_line(line)) for n, line in lines]
    if not any(parsed and isinstance(value, dict) for _, (value, parsed) in values):
        raise InputError(
            f"{path}: does not parse as JSON ({_position(whole_error)}) nor as JSON lines (no line is "
            f"a JSON object); accepted: {ACCEPTED}"
        )
    return [Located(value, f"{name} line {n}", file_stem(path), i) for i, (n, (value, _)) in enumerate(values)]


def _json_line(line: str) -> tuple[Any, bool]:
    """(value, parsed): the line's JSON value, or its raw text when it does not parse."""
    try:
        return json.loads(line), True
    except json.JSONDecodeError:
        return line, False


def _position(error: json.JSONDecodeError) -> str:
    return f"line {error.lineno} column {error.colno}: {error.msg}"


def read_corpus(path: str | Path) -> tuple[str, ...]:
    """The documents that MemAgent's index contexts point into, in MemAgent's order.

    ``path`` holds SQuAD (``{"data": [{"paragraphs": [{"context": ...}]}]}``: the distinct paragraph
    contexts, sorted -- ``read_squad`` in MemAgent's ``synthetic/qa.py``), HotpotQA (records with
    ``context`` = ``[[title, [sentence, ...]], ...]``: the distinct ``"title\\n" + "".join(sentences)``,
    sorted -- its ``read_hotpotqa``), or a JSON array of document strings (taken as is).
    """
    records = read_located(path)
    values = [r.value for r in records]
    if len(values) == 1 and isinstance(values[0], dict) and isinstance(values[0].get("data"), list):
        docs = {p["context"] for d in values[0]["data"] for p in d.get("paragraphs", []) if "context" in p}
        return tuple(sorted(docs))
    if values and all(isinstance(v, str) for v in values):
        return tuple(values)
    if values and all(isinstance(v, dict) and isinstance(v.get("context"), list) for v in values):
        try:
            return tuple(sorted({f"{t}\n{''.join(p)}" for v in values for t, p in v["context"]}))
        except (TypeError, ValueError):
            pass
    raise InputError(
        f"{path}: not a corpus: expected SQuAD JSON (data/paragraphs/context), HotpotQA records "
        f"(context = [title, sentences] pairs) or a JSON array of document strings"
    )
