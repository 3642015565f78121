"""Your own data: the sources' own files, answer modes, reading errors, outputs.

Every source file is a small synthetic one in the source's exact schema (``tests/fixtures/sources/``,
written by ``tests/fixtures/sources.py``); chunks are measured with the tiny models' tokenizer.
"""

import gzip
import json
import re
import shutil
from pathlib import Path

import pytest
from fixtures import sources as src

from verl_memopd.tasks import __main__ as cli
from verl_memopd.tasks.convert import Options, chunk_text, convert_records, extract, split_units
from verl_memopd.tasks.dataset import parse_row, read_rows
from verl_memopd.tasks.readers import InputError, read_corpus, read_located
from verl_memopd.tasks.reward import compute_score, score_answers

FIX = Path(__file__).parent / "fixtures" / "sources"


@pytest.fixture(scope="module")
def tokenizer(tiny_models):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_models.student)


def _one(name, fmt="auto", options=Options()):
    [record] = [r.value for r in read_located(FIX / name)][:1]
    return extract(record, fmt, options)


def _cli(capsys, *args):
    rc = cli.main(["convert", *map(str, args)])
    return rc, capsys.readouterr().out.strip().splitlines()


def test_fixture_files_are_what_the_script_writes(tmp_path):
    for path in src.write_all(tmp_path):  # committed files = the generator's output (regenerate after edits)
        assert path.read_bytes() == (FIX / path.name).read_bytes() or path.suffix == ".parquet", path.name
        if path.suffix == ".parquet":
            assert read_rows(path) == read_rows(FIX / path.name), path.name


# --- 1. answer modes ------------------------------------------------------------------------
def test_multi_value_row_scores_as_ruler_does_not_as_aliases():
    values = [src.NIAH_VALUES]
    one, every = ["4417021"], [", ".join(src.NIAH_VALUES)]
    # before (values read as aliases): one value scores 1.0, all four 0.4
    assert score_answers(one, values).f1 == 1.0 and score_answers(every, values).f1 == pytest.approx(0.4)
    # after (mode all; RULER's string_match_all): 0.25 and 1.0; EM only when every value is given
    assert score_answers(one, values, ["all"]).f1 == 0.25 and score_answers(one, values, ["all"]).em == 0.0
    assert score_answers(every, values, ["all"]).f1 == 1.0 and score_answers(every, values, ["all"]).em == 1.0
    assert score_answers(["44170210"], values, ["all"]).f1 == 0.0  # whole words: no credit for a longer number
    info, response = {"index": 0, "answer_modes": ["all"]}, "1: 4417021, 2210987, 9035512"  # verl's reward hook
    assert compute_score("memopd_convert/x", response, values, info)["score"] == 0.75
    assert compute_score("memopd_convert/x", response, values, {"index": 0})["score"] == 0.5  # aliases: F1 vs one


@pytest.mark.parametrize(
    "name,template,mode",
    [
        ("nvidia_ruler_niah_multivalue.jsonl", "niah", "all"),
        ("memagent_ruler_niah_multivalue.json", "niah", "all"),
        ("nvidia_ruler_vt.jsonl", "variable_tracking", "all"),
        ("nvidia_ruler_cwe.jsonl", "common_words_extraction", "all"),
        ("nvidia_ruler_qa.jsonl", "qa", "any"),
        ("longbench.jsonl", None, "any"),
        ("hotpotqa_distractor.json", None, "any"),
    ],
)
def test_answer_mode_is_detected_from_the_source(name, template, mode):
    record = _one(name)
    assert (record.template, record.answer_modes) == (template, (mode,))
    assert _one(name, options=Options(answer_mode="any")).answer_modes == ("any",)  # the flag overrides
    assert _one(name, options=Options(answer_mode="all")).answer_modes == ("all",)


def test_answer_modes_reach_the_rows_and_the_agents_gate(tmp_path, capsys, tiny_models):
    plain = tmp_path / "mine.jsonl"
    plain.write_text(
        json.dumps(
            {
                "context": "A. B.",
                "question": ["Q1?", "Q2?"],
                "answers": [["x", "y"], ["u", "v"]],
                "answer_mode": ["any", "all"],
            }
        )
        + "\n"
    )
    rc, out = _cli(
        capsys,
        FIX / "nvidia_ruler_niah_multivalue.jsonl",
        plain,
        "--out",
        tmp_path / "o",
        "--tokenizer",
        tiny_models.student,
        "--chunk-tokens",
        64,
    )
    rows = read_rows(tmp_path / "o" / "train.parquet")
    assert rc == 0 and [r["extra_info"]["answer_modes"] for r in rows] == [["all"], ["any", "all"]]
    assert "answer modes: any=1 (aliases, max over them) all=2 (values, share found)" in out
    task = parse_row(rows[0]["extra_info"], rows[0]["reward_model"])  # what the agent loop scores with
    assert task.answer_modes == ("all",) and score_answers(["4417021"], task.answer_sets, task.answer_modes).f1 == 0.25
    with pytest.raises(ValueError, match="answer mode of question 1 is 'each'"):
        parse_row({**rows[0]["extra_info"], "answer_modes": ["each"]}, rows[0]["reward_model"], where="r")


# --- 2. RULER's instructions ----------------------------------------------------------------
def test_ruler_instructions_are_stripped_from_the_question_or_kept_on_request():
    assert _one("nvidia_ruler_niah_multivalue.jsonl").questions == (src.NIAH_Q,)
    assert _one("memagent_ruler_niah_multivalue.json").questions == (src.NIAH_Q,)
    assert _one("nvidia_ruler_qa.jsonl").questions == (src.DOCS[2][2],)
    assert _one("nvidia_ruler_vt.jsonl").questions == (
        "Find all variables that are assigned the value 64319 in the text above.",
    )
    assert _one("nvidia_ruler_cwe.jsonl").questions == ("What are the 2 most common words in the above list?",)
    assert _one("memagent_ruler_qa_indices.json", options=Options(corpus=tuple(src.corpus_order()))).questions == (
        src.DOCS[1][2],
    )
    kept = _one("nvidia_ruler_niah_multivalue.jsonl", options=Options(keep_instructions=True)).questions[0]
    assert kept.startswith(
        "Some special magic numbers are hidden within the following text. Make sure to memorize "
        "it. I will quiz you about the numbers afterwards."
    ) and kept.endswith(src.NIAH_Q)
    assert "4417021" not in kept  # the documents are never part of the question


def test_nvidia_ruler_documents_come_out_of_input():
    [raw] = src.nvidia_ruler_niah()
    assert _one("nvidia_ruler_niah_multivalue.jsonl").context == src._niah_haystack().strip()
    assert _one("nvidia_ruler_qa.jsonl").context == src._memagent_context(src.DOCS)
    assert "context" not in raw and raw["input"].count("4417021") == 1


def test_an_unknown_ruler_template_keeps_the_input_whole():
    record = extract(
        {"index": 3, "input": "Name the capital.", "context": "Paris is the capital.", "outputs": ["Paris"]}
    )
    assert (record.questions, record.template, record.answer_modes, record.source_format) == (
        ("Name the capital.",),
        "unknown",
        ("any",),
        "ruler",
    )


# --- 3. formats -----------------------------------------------------------------------------
def test_hotpotqa_json_pairs_and_parquet_struct_become_documents():
    pairs, struct = _one("hotpotqa_distractor.json"), _one("hotpotqa.parquet")
    expected = src._memagent_context(src.DOCS)  # "title\n" + "".join(sentences), MemAgent's read_hotpotqa
    assert pairs.context == struct.context == expected
    assert (pairs.questions, pairs.answer_sets, pairs.source_id) == (
        (src.DOCS[1][2],),
        (("Mara Tovin",),),
        "5a8b57f25542995d1e6f1371",
    )
    assert (struct.source_format, struct.source_id, struct.answer_sets) == (
        "hotpotqa",
        "5a8c7595554299585d9e36b6",
        (("seven",),),
    )


def test_longbench_v2_options_go_into_the_question_and_the_gold_is_the_option_text():
    record = _one("longbench_v2.json")
    assert record.questions == (
        "What do barges on the Lusk carry? Options: (A) Coal and iron; (B) Salt and timber; "
        "(C) Fish; (D) Nothing. Answer with the text of the correct option.",
    )
    assert record.answer_sets == (("Salt and timber",),) and record.source_id == "66f36490821e116aacb2cc22"
    assert score_answers(["Salt and timber"], record.answer_sets).f1 == 1.0


def test_index_contexts_read_the_corpus_in_memagents_order(tmp_path):
    corpus = read_corpus(FIX / "hotpotqa_corpus.json")
    assert list(corpus) == src.corpus_order()
    record = _one("memagent_ruler_qa_indices.json", options=Options(corpus=corpus))
    assert record.context == src._memagent_context([src.DOCS[1], src.DOCS[3]])
    squad = tmp_path / "squad.json"
    squad.write_text(json.dumps({"data": [{"paragraphs": [{"context": "B text."}, {"context": "A text."}]}]}))
    assert read_corpus(squad) == ("A text.", "B text.")
    with pytest.raises(ValueError, match="needs_corpus: context is a list of 2 document indices"):
        _one("memagent_ruler_qa_indices.json")
    with pytest.raises(ValueError, match=r"needs_corpus: document indices \[9\] are outside --corpus \(4"):
        extract({"input": "q?", "context": [9], "outputs": ["a"]}, options=Options(corpus=corpus))


def test_dataset_process_rows_and_longbench_and_memagent_files():
    dp = _one("memagent_dataset_process.parquet")
    assert (dp.source_format, dp.questions, dp.answer_sets) == ("dataset_process", (src.DOCS[2][2],), (("seven",),))
    lb = _one("longbench.jsonl")
    assert (lb.source_format, lb.source_id, lb.answer_sets) == ("longbench", "lb-hotpot-0001", (("Velora",),))
    assert _one("memagent_eval.json").source_id == "0" and _one("memagent_train.parquet").source_format == "memagent"


def test_a_refused_format_names_the_fields_the_record_has_and_answer_is_read():
    with pytest.raises(
        ValueError,
        match=r"missing_field: no context \(context\), no question \(question \| input \| "
        r"extra_info.question \| prompt\) \[--format auto\]; the record has "
        r"fields \['answers', 'prompt_text'\]: rename them",
    ):
        extract({"prompt_text": "q", "answers": ["a"]})
    plain = extract({"question": "q?", "answer": "Velora", "context": "plain text"})  # `answer`: one string
    assert (plain.source_format, plain.answer_sets) == ("jsonl", (("Velora",),))


def test_several_files_in_one_call_keep_their_names_and_ids(tmp_path, capsys, tiny_models):
    rc, out = _cli(
        capsys,
        FIX / "longbench.jsonl",
        FIX / "hotpotqa.parquet",
        "--out",
        tmp_path,
        "--tokenizer",
        tiny_models.student,
        "--chunk-tokens",
        48,
    )
    rows = read_rows(tmp_path / "train.parquet")
    assert rc == 0 and [
        (r["data_source"], r["extra_info"]["source_row"], r["extra_info"]["source_id"]) for r in rows
    ] == [
        ("memopd_convert/longbench", 0, "lb-hotpot-0001"),
        ("memopd_convert/longbench", 1, "lb-mfqa-zh-0001"),
        ("memopd_convert/hotpotqa", 0, "5a8c7595554299585d9e36b6"),
    ]
    assert [r["extra_info"]["index"] for r in rows] == [0, 1, 2] and out[-1].startswith("converted rows=3 refused=0 ")


# --- 4, 6, 7, 8. reading --------------------------------------------------------------------
def test_byte_order_mark_and_crlf_lose_no_row(tmp_path):
    records = src.memagent_eval()
    lines = "\r\n".join(json.dumps(r) for r in records) + "\r\n"
    (tmp_path / "bom.jsonl").write_bytes(b"\xef\xbb\xbf" + lines.encode())
    (tmp_path / "bom.json").write_bytes(b"\xef\xbb\xbf" + json.dumps(records, indent=4).replace("\n", "\r\n").encode())
    for name in ("bom.jsonl", "bom.json"):
        assert [r.value for r in read_located(tmp_path / name)] == records, name


def test_the_kind_of_a_file_is_read_from_its_content(tmp_path, capsys, tiny_models):
    shutil.copy(FIX / "hotpotqa.parquet", tmp_path / "parquet_named.jsonl")
    shutil.copy(FIX / "longbench.jsonl", tmp_path / "jsonl_named.parquet")
    (tmp_path / "zipped.jsonl.gz").write_bytes(gzip.compress((FIX / "longbench.jsonl").read_bytes()))
    (tmp_path / "zipped_parquet.gz").write_bytes(gzip.compress((FIX / "hotpotqa.parquet").read_bytes()))
    for name, n in (
        ("parquet_named.jsonl", 1),
        ("jsonl_named.parquet", 2),
        ("zipped.jsonl.gz", 2),
        ("zipped_parquet.gz", 1),
    ):
        located = read_located(tmp_path / name)
        assert len(located) == n and extract(located[0].value).questions, name
    assert read_located(tmp_path / "zipped.jsonl.gz")[1].where == "zipped.jsonl.gz line 2"
    (tmp_path / "data.csv").write_text("context,question,answers\nsome text,q?,a\n")
    (tmp_path / "bin.dat").write_bytes(b"\x00\xff\xfe garbage")
    with pytest.raises(
        InputError,
        match=r"data.csv: does not parse as JSON \(line 1 column 1: Expecting value\) nor "
        r"as JSON lines .*accepted: JSON lines, a JSON array",
    ):
        read_located(tmp_path / "data.csv")
    with pytest.raises(InputError, match=r"bin.dat: not UTF-8 text \(byte 1"):
        read_located(tmp_path / "bin.dat")
    rc, out = _cli(
        capsys, tmp_path / "data.csv", "--out", tmp_path / "o", "--tokenizer", tiny_models.student, "--chunk-tokens", 32
    )
    assert rc == 2 and len(out) == 1 and out[0].startswith(f"error: {tmp_path / 'data.csv'}: does not parse as JSON")


def test_a_cut_off_json_array_is_one_error_with_its_position(tmp_path):
    text = json.dumps(src.memagent_eval(), indent=4)
    cut = text[: len(text) // 2]
    (tmp_path / "cut.json").write_text(cut)
    with pytest.raises(InputError) as e:
        read_located(tmp_path / "cut.json")
    assert re.fullmatch(
        rf".*cut.json: a JSON array that does not parse: line {cut.count(chr(10)) + 1} column \d+: .* "
        r"\(the file ends before the array does: cut off\?\)",
        str(e.value),
    )
    (tmp_path / "obj.json").write_text(json.dumps(src.memagent_eval()[0], indent=4)[:-40])
    with pytest.raises(InputError, match="obj.json: does not parse as JSON .* nor as JSON lines"):
        read_located(tmp_path / "obj.json")


def test_places_are_file_lines_and_array_indices(tmp_path, tokenizer):
    good = json.dumps(src.memagent_eval()[0])
    (tmp_path / "gaps.jsonl").write_text(f"\n{good}\n\n\n{{broken\n{good}\n")
    located = read_located(tmp_path / "gaps.jsonl")
    assert [r.where for r in located] == ["gaps.jsonl line 2", "gaps.jsonl line 5", "gaps.jsonl line 6"]
    result = convert_records(located, tokenizer, 64)
    assert [r.where for r in result.refusals] == ["gaps.jsonl line 5"]
    assert "refused gaps.jsonl line 5: bad_record: expected a JSON object, got str '{broken'" in result.summary(64)
    (tmp_path / "arr.json").write_text(json.dumps([src.memagent_eval()[0], {"context": "x"}], indent=4))
    result = convert_records(read_located(tmp_path / "arr.json"), tokenizer, 64)
    assert [r.where for r in result.refusals] == ["arr.json [1]"]


# --- 5. outputs -----------------------------------------------------------------------------
def test_an_existing_output_is_refused_unless_overwrite_and_never_left_stale(tmp_path, capsys, tiny_models):
    common = ["--out", tmp_path / "o", "--tokenizer", tiny_models.student, "--chunk-tokens", 64]
    assert _cli(capsys, FIX / "longbench.jsonl", *common)[0] == 0
    out_file = tmp_path / "o" / "train.parquet"
    before = out_file.read_bytes()
    rc, out = _cli(capsys, FIX / "memagent_eval.json", *common)
    assert (
        rc == 1
        and out_file.read_bytes() == before
        and out
        == [
            f"{out_file} already exists (2 rows): nothing converted; pass --overwrite to replace it, or choose another "
            "--out / --split"
        ]
    )
    rc, out = _cli(capsys, FIX / "memagent_eval.json", *common, "--overwrite")
    assert rc == 0 and [r["extra_info"]["source_file"] for r in read_rows(out_file)] == ["memagent_eval"] * 2
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(src.memagent_eval()[0]) + "\n" + json.dumps({"context": "x"}) + "\n")
    rc, out = _cli(capsys, bad, *common, "--overwrite", "--strict")
    assert (
        rc == 1
        and not out_file.exists()
        and f"removed the old {out_file} (--overwrite): it no longer matches the input" in out
    )
    assert sorted(p.name for p in (tmp_path / "o").iterdir()) == []  # no temporary file left behind


# --- 9. huge contexts -----------------------------------------------------------------------
def test_a_huge_context_is_announced_and_max_chunks_stops_cutting(tokenizer, monkeypatch):
    from verl_memopd.tasks import convert

    monkeypatch.setattr(convert, "LARGE_CONTEXT_CHARS", 2000)
    monkeypatch.setattr(convert, "MANY_CHUNKS", 20)
    record = {"context": "The harbour was quiet. " * 200, "question": "q?", "answers": ["a"]}
    heard = []
    result = convert_records([record], tokenizer, 16, on_warning=heard.append)
    assert len(heard) == 1 and re.fullmatch(
        r"warning: row 0: a context of 0.00 M characters, about \d+ chunks of 16 "
        r"tokens = \d+ memory calls per episode; cutting it takes a while; "
        r"--max-chunks M would refuse rows with more than M chunks .*",
        heard[0],
    )
    assert any(line.startswith("warning: 1 row(s) have more than 20 chunks") for line in result.summary(16))
    capped = convert_records([record], tokenizer, 16, max_chunks=5)
    [refusal] = capped.refusals
    assert refusal.kind == "too_many_chunks" and "cutting stopped at 6" in refusal.message
    assert len(chunk_text(record["context"], tokenizer, 16, limit=5)) == 6


# --- 10. rollout needs ----------------------------------------------------------------------
def test_recorded_needs_bound_the_packed_episode_and_the_recipe_checks_them(tmp_path, capsys, tiny_models, tokenizer):
    from omegaconf import OmegaConf

    from verl_memopd.agent.context import CallContext
    from verl_memopd.packing import pack_episode
    from verl_memopd.records import Episode, Invocation
    from verl_memopd.tasks.needs import read_needs
    from verl_memopd.tasks.prompts import MemoryPrompts
    from verl_memopd.trainer.config import MemopdConfigError, _check_data_needs, from_config

    def check_config(cfg):
        try:
            _check_data_needs(cfg)
        except MemopdConfigError as e:
            return str(e).split("; ")
        return []

    rc, out = _cli(
        capsys,
        FIX / "memagent_eval.json",
        "--out",
        tmp_path,
        "--tokenizer",
        tiny_models.student,
        "--chunk-tokens",
        40,
        "--memory-tokens",
        24,
        "--answer-tokens",
        8,
    )
    path = tmp_path / "train.parquet"
    needs = read_needs(path)
    need = needs.response_length(24, 8)
    assert rc == 0 and any(
        line.startswith(
            f"packed response: data.max_response_length (actor_rollout_ref.rollout."
            f"response_length) must be >= {need} with memopd.agent.memory_tokens=24 "
            f"answer_tokens=8"
        )
        for line in out
    )
    worst = 0
    for row in read_rows(path):  # every memory call writes its whole budget: the packed response is the bound
        ctx, chunks = CallContext(tokenizer, row["prompt"], MemoryPrompts()), row["extra_info"]["chunks"]
        memory, calls = (), []
        for t, chunk in enumerate(chunks):
            x = ctx.memory_call(memory, chunk, t, len(chunks))
            memory = tuple(range(5, 5 + 24))
            calls.append(
                Invocation(ctx.prefix_ids + x, memory, (-0.1,) * 24, memory_span=(0, 24), finish_reason="length")
            )
        x = ctx.answer_call(memory)
        calls.append(Invocation(ctx.prefix_ids + x, tuple(range(5, 13)), (-0.1,) * 8, finish_reason="length"))
        worst = max(worst, len(pack_episode(Episode("e", "u", ctx.prefix_ids, tuple(calls))).response_ids))
    assert needs.empty_memory_tokens < 24 and worst == need  # the bound is attained

    def config(response_length, prompt_length=4096):
        return OmegaConf.create(
            {
                "memopd": {"distill": {"coef": 0}, "agent": {"memory_tokens": 24, "answer_tokens": 8}},
                "data": {"train_files": [str(path)], "val_files": str(path), "max_response_length": response_length},
                "actor_rollout_ref": {
                    "rollout": {"response_length": "${data.max_response_length}", "prompt_length": prompt_length}
                },
            }
        )

    assert check_config(config(need)) == [] and from_config(config(need)).distill.coef == 0
    with pytest.raises(
        MemopdConfigError,
        match=rf"data.train_files {path}: a packed episode can take {need} response "
        rf"tokens .* actor_rollout_ref.rollout.response_length={need - 1}: set "
        rf"data.max_response_length >= {need}",
    ):
        from_config(config(need - 1))
    assert "q takes up to" in check_config(config(need, prompt_length=10))[0]
    changed = config(need - 1)
    changed.memopd.agent.prompts = {"write_instruction": "Update the memory."}
    assert check_config(changed) == []  # measured with the default per-call texts: not checked under others


# --- 11. sentence ends ----------------------------------------------------------------------
def test_cuts_respect_abbreviations_other_scripts_and_words(tokenizer):
    units = split_units(
        "He joined the U.S. Geological Survey in 1990. Dr. Smith met J. R. R. Tolkien. It weighs "
        "approx. three tons. Mr. Lee left!"
    )
    assert units == [
        "He joined the U.S. Geological Survey in 1990.",
        " Dr. Smith met J. R. R. Tolkien.",
        " It weighs approx. three tons.",
        " Mr. Lee left!",
    ]
    zh = [r.value for r in read_located(FIX / "longbench.jsonl")][1]["context"]
    assert split_units(zh) == [
        "青河镇位于北部海岸。",
        "它建于一二零四年，由渔民建立。",
        "镇上以盐市场闻名！",
        "灯塔很高吗？",
        "是的，灯塔很高。",
        "每年春天，学生们会走到山上。",
    ]
    words = "harbour lighthouse fishermen " * 12
    chunks = chunk_text(words, tokenizer, 10)
    assert all(c.split() and set(c.split()) <= {"harbour", "lighthouse", "fishermen"} for c in chunks)
    assert " ".join(chunks).split() == words.split()  # every cut between words, nothing lost
