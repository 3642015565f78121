"""Your own data: MemAgent-style and plain records -> agent rows (fields, chunking, refusals, CLI).

Fixtures are written here and in ``fixtures/longqa.py`` (nothing is downloaded); chunks are measured
with the tiny models' tokenizer (``python -m verl_memopd.bench.tiny``, the ``tiny_models`` fixture).
"""

import json
import re

import pytest
from fixtures.longqa import (
    DOCS,
    context,
    memagent_eval_records,
    memagent_train_records,
    picks,
    plain_records,
    ruler_records,
    write_jsonl,
)

from verl_memopd.tasks import __main__ as cli
from verl_memopd.tasks.convert import (
    REFUSALS,
    SOURCE_PREFIX,
    chunk_text,
    convert_records,
    extract,
    join_documents,
    read_records,
    split_units,
)
from verl_memopd.tasks.dataset import AGENT_NAME, parse_row, read_rows, write_rows
from verl_memopd.tasks.prompts import MemoryPrompts


@pytest.fixture(scope="module")
def tokenizer(tiny_models):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_models.student)


def _n(tokenizer, text):
    return len(tokenizer.encode(text, add_special_tokens=False))


def _squash(text):
    return re.sub(r"\s", "", text)


# --- source formats --------------------------------------------------------------------------
def _write(records, path):
    if path.suffix == ".parquet":
        write_rows(records, path)
    elif path.suffix == ".json":
        path.write_text(json.dumps(records))  # MemAgent's eval_*.json: one JSON array
    else:
        write_jsonl(records, path)
    return path


@pytest.mark.parametrize(
    "source_format,make,name,question_doc",
    [
        ("eval json (convert_to_eval.py)", memagent_eval_records, "eval_50.json", -1),
        ("RULER jsonl (ruler_data_prepare.py)", ruler_records, "ruler.jsonl", 1),
        ("training parquet (processing.py)", memagent_train_records, "hotpotqa_train.parquet", 0),
    ],
)
def test_memagent_formats_convert_as_memagent_writes_them(tmp_path, tokenizer, source_format, make, name, question_doc):
    records = make(4)
    path = _write(records, tmp_path / name)
    for fmt in ("auto", "memagent"):
        result = convert_records(read_records(path), tokenizer, 48, fmt, split="val", source=path.stem)
        assert not result.refusals and len(result.rows) == 4, source_format
        for i, (record, row, docs) in enumerate(zip(records, result.rows, picks(4))):
            _, _, question, aliases = DOCS[docs[question_doc]]
            info = row["extra_info"]
            assert info["source_row"] == i and info["episode_id"] == f"val-{i}" and info["split"] == "val"
            assert row["data_source"] == f"{SOURCE_PREFIX}/{path.stem}" and row["agent_name"] == AGENT_NAME
            assert _squash("".join(info["chunks"])) == _squash(record["context"])
            assert info["questions"] == [question] and row["reward_model"]["ground_truth"] == [aliases]
            assert row["prompt"] == [{"role": "user", "content": MemoryPrompts().question_text([question])}]
            parse_row(info, row["reward_model"])


def test_plain_jsonl_documents_multi_question_and_aliases(tmp_path, tokenizer):
    records = plain_records(3) + [{"context": "One. Two.", "question": ["A?", "B?"], "answers": ["x", ["y", "z"]]}]
    result = convert_records(read_records(write_jsonl(records, tmp_path / "mine.jsonl")), tokenizer, 64, "jsonl")
    assert not result.refusals
    first = result.rows[0]
    docs = records[0]["context"]
    assert _squash("".join(first["extra_info"]["chunks"])) == _squash(join_documents(docs))
    assert first["extra_info"]["chunks"][0].startswith("Document 1:\n" + docs[0].split("\n")[0])
    assert first["extra_info"]["questions"] == records[0]["question"]
    assert first["reward_model"]["ground_truth"] == records[0]["answers"]
    assert first["prompt"][0]["content"].endswith(f"1. {records[0]['question'][0]}\n2. {records[0]['question'][1]}")
    assert result.rows[-1]["reward_model"]["ground_truth"] == [["x"], ["y", "z"]]  # a string = one alias
    assert join_documents(["a", " b "]) == "Document 1:\na\n\nDocument 2:\nb"  # MemAgent's DOCUMENT_PROMPT


def test_format_option_restricts_the_field_names(tokenizer):
    plain, memagent = plain_records(1)[0], ruler_records(1)[0]
    with pytest.raises(ValueError, match=r"missing_field: no question \(question\), no answers \(answers\) \[--f"):
        extract(memagent, "jsonl")
    with pytest.raises(ValueError, match=r"missing_field: no question \(input \| extra_info.question \| prompt\)"):
        extract(plain, "memagent")
    assert extract(memagent, "auto") == extract(memagent, "memagent")
    assert extract(plain, "auto") == extract(plain, "jsonl")
    with pytest.raises(
        KeyError,
        match="valid: \\['auto', 'dataset_process', 'hotpotqa', 'jsonl', 'longbench_v2', 'memagent', 'ruler'\\]",
    ):
        extract(plain, "csv")


# --- chunking -------------------------------------------------------------------------------
def test_units_cut_at_sentence_ends_and_before_documents():
    text = context([0, 1])
    units = split_units(text)
    assert "".join(units) == text
    assert units[0] == "Document 1:\nVelora\nVelora is a harbour town on the northern coast."  # header stays
    assert units[3].startswith("\n\nDocument 2:\nZentek Labs\nZentek Labs is")
    assert " Its founder, Mara Tovin, studied physics in Sarnia!" in units  # "!" ends a sentence
    assert split_units("2.5 million. Dr.Who") == ["2.5 million.", " Dr.Who"]  # no cut without whitespace


@pytest.mark.parametrize("max_tokens", [8, 24, 64, 200])
def test_chunks_fit_the_models_tokenizer_and_are_packed_greedily(tokenizer, max_tokens):
    text = context([0, 1, 2, 3, 4, 5])
    chunks = chunk_text(text, tokenizer, max_tokens)
    assert all(0 < _n(tokenizer, c) <= max_tokens for c in chunks)
    assert _squash("".join(chunks)) == _squash(text)
    units = split_units(text)
    if max(_n(tokenizer, u.strip()) for u in units) > max_tokens:
        assert max_tokens < 64  # some sentence had to be cut between tokens
        return
    start = 0
    for chunk in chunks:  # each chunk is whole units, and the longest run of them that fits
        end = next(e for e in range(start + 1, len(units) + 1) if "".join(units[start:e]).strip() == chunk)
        assert end == len(units) or _n(tokenizer, "".join(units[start : end + 1]).strip()) > max_tokens
        start = end
    assert start == len(units) and (max_tokens < 200 or len(chunks) < len(units) / 4)


@pytest.mark.parametrize("max_tokens", [3, 5, 16])
def test_a_sentence_longer_than_a_chunk_is_cut_between_tokens(tokenizer, max_tokens):
    sentence = "Zürich café naïve “quoted” 日本語テキスト and a very long list of rivers hills roads bridges birds"
    chunks = chunk_text(sentence, tokenizer, max_tokens)
    assert len(chunks) > 1 and all(_n(tokenizer, c) <= max_tokens for c in chunks)
    assert _squash("".join(chunks)) == _squash(sentence)  # no character lost or split (valid text)
    offsets = tokenizer(sentence, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
    token_starts = {s for s, _ in offsets}
    position = 0
    for chunk in chunks[1:]:  # every cut is at the start of a token of the sentence
        position = sentence.index(chunk, position + 1)
        assert position in token_starts or sentence[position - 1].isspace() and position - 1 in token_starts
    with pytest.raises(ValueError, match="--chunk-tokens 1 is too small"):
        chunk_text("日本", tokenizer, 1)  # a character is several byte tokens: it cannot be split


# --- refusals -------------------------------------------------------------------------------
GOOD = {"context": "Velora has a lighthouse.", "question": "What has a lighthouse?", "answers": ["Velora"]}
BAD = [
    ("bad_record", "not json", "expected a JSON object"),
    ("missing_field", {"question": "q", "answers": ["a"]}, r"no context \(context\)"),
    ("missing_field", {**GOOD, "answers": None}, "no answers"),
    (
        "missing_field",
        {"context": "x.", "prompt": [{"role": "system", "content": "s"}], "answers": ["a"]},
        "prompt has no user message",
    ),
    ("non_string", {**GOOD, "context": 42}, "context must be a string or a list"),
    ("non_string", {**GOOD, "context": ["fine", {"text": "x"}]}, r"document 2 of the context is not a string \(dict"),
    ("non_string", {**GOOD, "question": ["ok?", 7]}, r"question 2 \(question\) is not a string"),
    ("non_string", {**GOOD, "answers": [1990]}, "an answer of question 1 is not a string"),
    ("empty_context", {**GOOD, "context": " \n "}, "context is empty"),
    ("empty_context", {**GOOD, "context": []}, "empty list of documents"),
    ("empty_context", {**GOOD, "context": ["a", "  "]}, "document 2 of the context is empty"),
    ("empty_question", {**GOOD, "question": "  "}, r"question 1 \(question\) is empty"),
    ("no_answers", {**GOOD, "answers": []}, "question 1 has no answers"),
    ("no_answers", {**GOOD, "answers": [" "]}, "empty answer alias"),
    ("no_answers", {**GOOD, "question": ["a?", "b?"], "answers": [["x"]]}, "question 2 has no answers"),
    ("extra_answers", {**GOOD, "question": ["a?"], "answers": ["x", "y"]}, "2 answer lists in answers for 1"),
    ("needs_corpus", {**GOOD, "context": [3, 1]}, r"list of 2 document indices .* pass --corpus FILE"),
    ("bad_answer_mode", {**GOOD, "answer_mode": "some"}, r"answer_mode 'some': expected one of \('any', 'all'\)"),
    (
        "bad_choice",
        {**GOOD, "choice_A": "x", "choice_B": "y", "answer": "C"},
        r"answer 'C' is not one of the "
        r"letters .*\['A', 'B'\]",
    ),
    ("too_many_chunks", {**GOOD, "context": "One. " * 40}, "more than 4 chunks of <= 8 tokens .*cutting stopped at 5"),
]


def test_every_refusal_class_is_exercised():
    assert {kind for kind, _, _ in BAD} == set(REFUSALS)


@pytest.mark.parametrize("kind,record,match", BAD, ids=[f"{k}-{i}" for i, (k, _, _) in enumerate(BAD)])
def test_bad_rows_are_refused_with_row_and_reason(tokenizer, kind, record, match):
    result = convert_records([GOOD, record, GOOD], tokenizer, 8, max_chunks=4)
    assert len(result.rows) == 2 and [r["extra_info"]["source_row"] for r in result.rows] == [0, 2]
    [refusal] = result.refusals
    assert (refusal.index, refusal.kind, refusal.where) == (1, kind, "row 1") and re.search(match, refusal.message), (
        refusal.message
    )
    assert f"refused row 1: {kind}: " in "\n".join(result.summary(8))


# --- CLI ------------------------------------------------------------------------------------
def _cli(capsys, *args):
    rc = cli.main(["convert", *map(str, args)])
    return rc, capsys.readouterr().out.strip().splitlines()


def test_cli_convert_summary_last_line_and_rows(tmp_path, capsys, tiny_models, tokenizer):
    records = memagent_eval_records(5) + ["{broken", {"context": "x.", "input": "q"}]
    path = write_jsonl(records, tmp_path / "mixed.jsonl")
    rc, out = _cli(
        capsys,
        path,
        "--out",
        tmp_path / "out",
        "--tokenizer",
        tiny_models.student,
        "--chunk-tokens",
        64,
        "--split",
        "val",
        "--task",
        "Read and remember.",
    )
    rows = read_rows(tmp_path / "out" / "val.parquet")
    chunks = [_n(tokenizer, c) for r in rows for c in r["extra_info"]["chunks"]]
    counts = [len(r["extra_info"]["chunks"]) for r in rows]
    assert rc == 0 and len(rows) == 5
    assert out[-1] == (f"converted rows=5 refused=2 chunks_mean={sum(counts) / 5:.2f} chunk_tokens_max={max(chunks)}")
    assert "refused mixed.jsonl line 6: bad_record: expected a JSON object, got str '{broken'" in out
    assert any(line.startswith("refused mixed.jsonl line 7: missing_field: no answers") for line in out)
    assert f"chunks per episode: min {min(counts)} mean {sum(counts) / 5:.2f} max {max(counts)}" in out
    assert any(line.startswith("tokens per chunk: ") and line.endswith("(limit 64)") for line in out)
    assert rows[0]["prompt"][0]["content"].startswith("Read and remember.\n\nQuestions:\n1. ")
    for row in rows:
        parse_row(row["extra_info"], row["reward_model"])


def test_cli_strict_and_nothing_converted_exit_nonzero(tmp_path, capsys, tiny_models):
    records = memagent_eval_records(2) + [{"context": "", "input": "q", "answers": ["a"]}]
    path = write_jsonl(records, tmp_path / "in.jsonl")
    common = ["--tokenizer", tiny_models.student, "--chunk-tokens", 32]
    rc, out = _cli(capsys, path, "--out", tmp_path / "strict", "--strict", *common)
    assert rc == 1 and out[-1].startswith("converted rows=2 refused=1 ") and not (tmp_path / "strict").exists()
    rc, out = _cli(capsys, path, "--out", tmp_path / "few", "--max-chunks", 1, *common)
    assert rc == 1 and out[-1] == "converted rows=0 refused=3 chunks_mean=0.00 chunk_tokens_max=0"
    assert sum("too_many_chunks" in line for line in out) == 3 and not (tmp_path / "few").exists()
    rc, out = _cli(capsys, path, "--out", tmp_path / "ok", *common)
    assert rc == 0 and out[-1].startswith("converted rows=2 refused=1 ") and (tmp_path / "ok/train.parquet").exists()


def test_readme_example_records_convert(tmp_path, tokenizer):
    from pathlib import Path

    readme = (Path(__file__).parents[1] / "README.md").read_text()
    block = readme.split("## Your own data", 1)[1].split("```jsonl\n", 1)[1].split("```", 1)[0]
    records = read_records(write_jsonl(block.strip().splitlines(), tmp_path / "readme.jsonl"))
    result = convert_records(records, tokenizer, 16)
    assert len(records) == 3 and not result.refusals
    assert [r["reward_model"]["ground_truth"] for r in result.rows] == [
        [["Velora", "Velora town"]],
        [["seven", "7"], ["salt and timber"]],
        [["salt and timber", "timber and salt"]],
    ]
