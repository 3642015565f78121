"""Memory benchmark: generator determinism and knobs, F1/EM, oracle, row validation, CLI."""

import re
from dataclasses import replace

import pytest

from verl_memopd.tasks import __main__ as cli
from verl_memopd.tasks.dataset import AGENT_NAME, parse_row, read_rows, to_row, write_rows
from verl_memopd.tasks.generator import HORIZONS, PRESETS, TaskConfig, corpus, generate, get_preset
from verl_memopd.tasks.oracle import run_oracle
from verl_memopd.tasks.prompts import MemoryPrompts, format_answers, parse_answers
from verl_memopd.tasks.reward import (
    answer_recall,
    compute_score,
    exact_match,
    normalize_answer,
    score_answers,
    token_f1,
)
from verl_memopd.tasks.world import (
    QUESTION_KINDS,
    RELATIONS,
    get_vocabulary,
    looks_alike,
    parse_fact,
    parse_question,
)

TINY = get_preset("tiny").config


def _sentences(chunk):
    return re.split(r"(?<=\.)\s+", chunk.strip())


def _facts(task):
    return [f for c in task.chunks for s in _sentences(c) if (f := parse_fact(s)) is not None]


# --- generator ------------------------------------------------------------------------------
def test_generate_is_deterministic_and_depends_on_seed_split_index():
    a = generate(TINY, 0, "train", 3)
    assert a == generate(TINY, 0, "train", 3)
    others = [generate(TINY, 1, "train", 3), generate(TINY, 0, "val", 3), generate(TINY, 0, "train", 4)]
    assert all(o.chunks != a.chunks for o in others)


def test_corpus_yields_n_deterministic_samples_with_benchmark_text():
    texts = list(corpus(6, seed=2))
    assert len(texts) == 6 and texts == list(corpus(6, seed=2)) and texts != list(corpus(6, seed=3))
    prompts = MemoryPrompts()
    for text in texts:
        assert prompts.questions_header in text and prompts.memory_header in text
        assert prompts.write_instruction in text and prompts.answer_instruction in text


def test_corpus_is_identical_across_processes_and_hash_seeds():
    import subprocess
    import sys

    code = (
        "import hashlib; from verl_memopd.tasks.generator import corpus; "
        "print(hashlib.sha256(''.join(corpus(8, 0, presets=('tiny', 'small'))).encode()).hexdigest())"
    )
    digests = {
        subprocess.run(
            [sys.executable, "-c", code], env={"PYTHONHASHSEED": seed}, capture_output=True, text=True, check=True
        ).stdout
        for seed in ("1", "2")
    }
    assert len(digests) == 1


@pytest.mark.parametrize("n_chunks,n_questions", [(1, 1), (5, 3)])
def test_knobs_n_chunks_and_n_questions(n_chunks, n_questions):
    cfg = replace(TINY, n_chunks=n_chunks, n_questions=n_questions)
    for i in range(10):
        task = generate(cfg, 0, "train", i)
        assert len(task.chunks) == n_chunks and len(task.questions) == n_questions
        assert len({q.text for q in task.questions}) == n_questions


@pytest.mark.parametrize("hops", [(1,), (2,)])
def test_knob_hops(hops):
    cfg = replace(TINY, hops=hops)
    for i in range(10):
        for q in generate(cfg, 0, "train", i).questions:
            assert len(q.support) == hops[0]
            assert parse_question(q.text)[0].hops == hops[0]


@pytest.mark.parametrize("chunk_words", [5, 40])
def test_knob_chunk_words_is_a_minimum(chunk_words):
    cfg = replace(TINY, chunk_words=chunk_words)
    for i in range(10):
        assert all(len(c.split()) >= chunk_words for c in generate(cfg, 0, "train", i).chunks)


def test_knob_distractor_rate():
    n_support = lambda t: len({f for q in t.questions for f in q.support})  # noqa: E731
    zero = [generate(replace(TINY, distractor_rate=0.0), 0, "train", i) for i in range(20)]
    assert all(len(_facts(t)) == n_support(t) for t in zero)
    two = [generate(replace(TINY, distractor_rate=2.0), 0, "train", i) for i in range(20)]
    extra = sum(len(_facts(t)) - n_support(t) for t in two)
    assert extra > sum(n_support(t) for t in two)  # about 2 per supporting fact (tiny worlds cap a few)


def _support_chunk(task) -> int:
    """Index of the last chunk holding a supporting fact."""
    support = [f.sentence for q in task.questions for f in q.support]
    return max(c for c, chunk in enumerate(task.chunks) for s in support if s in chunk)


def test_knob_support_chunks_keeps_the_answer_facts_early():
    cfg = replace(TINY, n_chunks=8, support_chunks=2, distractor_rate=2.0)
    tasks = [generate(cfg, 0, "train", i) for i in range(40)]
    assert all(_support_chunk(t) <= 1 for t in tasks)
    distractor_chunks = {
        c
        for t in tasks
        for c, chunk in enumerate(t.chunks)
        if c >= 2 and any(parse_fact(x) is not None for x in _sentences(chunk))
    }
    assert len(distractor_chunks) > 3  # distractors still spread over the later chunks
    assert max(_support_chunk(generate(replace(cfg, support_chunks=None), 0, "train", i)) for i in range(40)) > 1


def test_horizon_presets_differ_only_in_the_number_of_calls():
    configs = [get_preset(f"h{t}").config for t in HORIZONS]
    assert [c.n_chunks for c in configs] == list(HORIZONS)
    same = {(c.n_questions, c.chunk_words, c.vocabulary, c.hops, c.support_chunks) for c in configs}
    assert len(same) == 1
    assert [c.distractor_rate * 6 for c in configs] == list(HORIZONS)  # look-alikes per chunk about constant
    assert all(get_preset(f"h{t}").sizes["test"] >= 128 for t in HORIZONS)
    assert all(_support_chunk(generate(configs[-1], 0, "test", i)) <= 1 for i in range(20))


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_episode_contracts(preset):
    cfg = get_preset(preset).config
    vocab = get_vocabulary(cfg.vocabulary)
    for i in range(3 if preset in ("3b", "7b") else 15):
        task = generate(cfg, 0, "train", i)
        sentences = [s for c in task.chunks for s in _sentences(c)]
        facts = _facts(task)
        assert all(parse_fact(s) is not None or s in vocab.filler for s in sentences)
        support = {f for q in task.questions for f in q.support}
        position = {f: facts.index(f) for f in support}
        assert all(facts.count(f) == 1 for f in support)  # every supporting fact exactly once
        for q in task.questions:  # bridge facts come after the fact naming the bridge
            assert all(position[a] < position[b] for a, b in zip(q.support, q.support[1:]))
            assert q.answers[0] == q.support[-1].object
        subjects = {f.subject for f in support}
        for f in set(facts) - support:  # distractors: look-alike subject or same subject
            assert f.subject in subjects or any(looks_alike(f.subject, s) for s in subjects)
        objects = {}
        for f in facts:  # one world: no contradictions
            assert objects.setdefault((f.subject, f.relation), f.object) == f.object


def test_config_validation_and_registries_list_valid_names():
    with pytest.raises(ValueError, match="hops"):
        TaskConfig(n_chunks=2, n_questions=1, hops=(3,))
    with pytest.raises(ValueError, match="n_chunks"):
        TaskConfig(n_chunks=0, n_questions=1)
    with pytest.raises(ValueError, match="distractor_rate"):
        TaskConfig(n_chunks=1, n_questions=1, distractor_rate=-1)
    with pytest.raises(KeyError, match="tiny"):
        TaskConfig(n_chunks=1, n_questions=1, vocabulary="huge")
    with pytest.raises(ValueError, match="support_chunks"):
        TaskConfig(n_chunks=3, n_questions=1, support_chunks=4)
    with pytest.raises(KeyError, match="small"):
        get_preset("medium")


# --- world: sentences and questions parse back ----------------------------------------------
def test_fact_sentences_and_questions_round_trip():
    vocab = get_vocabulary("full")
    for rel in RELATIONS.values():
        s, o = vocab.pools[rel.subject_type][5], vocab.pools[rel.object_type][7]
        fact = parse_fact(rel.sentence(s, o))
        assert (fact.subject, fact.relation, fact.object) == (s, rel.name, o)
    for kind in QUESTION_KINDS.values():
        subject = vocab.pools[RELATIONS[kind.relations[0]].subject_type][3]
        assert parse_question(kind.template.format(s=subject)) == (kind, subject)
    assert parse_fact(vocab.filler[0]) is None and parse_question("Where is it?") is None


# --- reward ---------------------------------------------------------------------------------
def test_squad_normalisation_f1_and_em():
    assert normalize_answer("  The Zentek-Labs, Inc.! ") == "zenteklabs inc"
    assert token_f1("Zentek Labs", "Zentek") == pytest.approx(2 / 3)
    assert token_f1("the Velora", "Velora") == 1.0 and exact_match("the Velora.", "velora") == 1.0
    assert token_f1("", "Velora") == 0.0 and token_f1("Orin", "Velora") == 0.0
    assert exact_match("Zentek Labs", "Zentek") == 0.0


def test_score_max_over_aliases_mean_over_questions():
    s = score_answers(["Zentek", "Orla"], [("Zentek Labs", "Zentek"), ("Orin",)])
    assert (s.f1, s.em, s.per_question_f1) == (0.5, 0.5, (1.0, 0.0))
    s = score_answers(["Zentek Labs Group", "Orin"], [("Zentek Labs",), ("Orin",)])
    assert s.f1 == pytest.approx((0.8 + 1.0) / 2) and s.em == 0.5
    with pytest.raises(ValueError, match="2 predictions for 1 questions"):
        score_answers(["a", "b"], [("a",)])


def test_answer_recall_counts_answers_present_as_whole_words():
    answer_sets = [("Zentek Labs", "Zentek"), ("Orin",), ("Mara Tovin",)]
    assert answer_recall("Mara Tovin works at the Zentek-Labs. Orinda is far.", answer_sets) == pytest.approx(1 / 3)
    assert answer_recall("orin; mara tovin; zentek", answer_sets) == 1.0 and answer_recall("", answer_sets) == 0.0
    with pytest.raises(ValueError, match="no questions"):
        answer_recall("x", [])


def test_aliases_normalised_as_squad_and_hotpotqa():
    """Multi-question rows with several aliases each: per question the best alias, then the mean."""
    answer_sets = [("Mara Tovin", "Tovin"), ("the oldest map of the coast", "oldest map"), ("seven", "7"), ("no",)]
    s = score_answers(["Dr. Tovin", "An OLDEST map!", "7", "no idea"], answer_sets)
    assert s.per_question_f1 == pytest.approx((2 / 3, 1.0, 1.0, 0.0))  # "no idea" vs "no": HotpotQA gives 0
    assert s.em == 0.5 and s.f1 == pytest.approx((2 / 3 + 2) / 4)
    assert token_f1("yes", "yes.") == 1.0 and token_f1("no", "no way") == 0.0 and token_f1("nope", "no") == 0.0
    assert token_f1("salt, timber", "timber and salt") == pytest.approx(0.8)
    out = compute_score("memopd_convert/x", "1: Tovin\n2: the Oldest Map", [list(a) for a in answer_sets[:2]])
    assert out == {"score": 1.0, "f1": 1.0, "em": 1.0}
    with pytest.raises(ValueError, match=r"question 1's answers are the string 'Velora', not a list of aliases"):
        compute_score("x", "1: Velora", ["Velora", "Velora town"])  # MemAgent's flat list is for one question


def test_parse_answers_and_compute_score():
    assert parse_answers(format_answers(["Velora", "Zentek Labs"]), 2) == ["Velora", "Zentek Labs"]
    assert parse_answers("2) Orin\nnoise\n1. Velora\n3: ignored", 2) == ["Velora", "Orin"]
    assert parse_answers("1: Orin\n1: Velora", 2) == ["Velora", ""]  # last line wins; missing -> ""
    out = compute_score("memopd_memory/tiny", "1: Orin\n2: Sarnia\n1: Velora", [["Velora"], ["Sarnia"]], {"index": 4})
    assert out == {"score": 1.0, "f1": 1.0, "em": 1.0}
    with pytest.raises(ValueError, match=r"row 4 .*question 2 has no answers"):
        compute_score("memopd_memory/tiny", "1: x", [["x"], []], {"index": 4})


# --- oracle ---------------------------------------------------------------------------------
@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_oracle_scores_one_on_every_preset(preset):
    cfg = get_preset(preset).config
    for i in range(3 if preset in ("3b", "7b") else 25):
        row = to_row(generate(cfg, 7, "val", i), preset, "val", i)
        episode = run_oracle(parse_row(row["extra_info"], row["reward_model"]))
        assert episode.score.f1 == 1.0 and episode.score.em == 1.0, episode.where
        assert len(episode.calls) == cfg.n_chunks + 1


def test_oracle_memory_is_what_it_answers_from():
    cfg = replace(TINY, hops=(2,), distractor_rate=2.0)
    row = to_row(generate(cfg, 0, "val", 1), "tiny", "val", 1)
    task = parse_row(row["extra_info"], row["reward_model"])
    episode = run_oracle(task)
    final_memory = episode.calls[-2].reply
    support = [s for q in row["extra_info"]["support"] for s in q]
    assert sorted(final_memory.split("\n")) == sorted(set(support))  # exactly the needed facts
    chats = episode.messages(row["prompt"])
    assert [m["role"] for m in chats[0]] == ["user", "user", "assistant"]
    assert chats[-1][-1]["content"] == format_answers([a[0] for a in task.answer_sets])
    # a row whose chunks lost a supporting fact is not solved
    broken = dict(row["extra_info"], chunks=[c.replace(support[0], "") or "x" for c in row["extra_info"]["chunks"]])
    assert run_oracle(parse_row(broken, row["reward_model"])).score.f1 < 1.0


# --- rows -----------------------------------------------------------------------------------
def _row():
    return to_row(generate(TINY, 0, "train", 7), "tiny", "train", 7)


@pytest.mark.parametrize(
    "mutate,match",
    [
        (lambda r: r["reward_model"].pop("ground_truth"), "ground_truth is missing"),
        (lambda r: r["reward_model"]["ground_truth"].__setitem__(1, []), "question 2 has no answers"),
        (lambda r: r["reward_model"]["ground_truth"].__setitem__(0, [" "]), "question 1 has an empty"),
        (lambda r: r["extra_info"]["chunks"].__setitem__(1, "  "), r"chunks\[1\] is empty"),
        (lambda r: r["extra_info"].__setitem__("chunks", []), "chunks is empty"),
        (lambda r: r["extra_info"]["questions"].pop(), "1 questions but 2 answer sets"),
        (lambda r: r["extra_info"].pop("questions"), "questions must be a list"),
    ],
)
def test_malformed_rows_fail_naming_the_row(mutate, match):
    row = _row()
    mutate(row)
    with pytest.raises(ValueError, match=match) as err:
        parse_row(row["extra_info"], row["reward_model"])
    assert "row 7 (train-7)" in str(err.value)


def test_rows_round_trip_through_parquet(tmp_path):
    rows = [to_row(generate(TINY, 0, "val", i), "tiny", "val", i) for i in range(3)]
    assert write_rows(rows, tmp_path / "val.parquet") == 3
    assert read_rows(tmp_path / "val.parquet") == rows
    assert rows[0]["agent_name"] == AGENT_NAME and rows[0]["reward_model"]["style"] == "rule"
    assert rows[0]["prompt"][0]["content"].endswith(rows[0]["extra_info"]["questions"][-1])


# --- CLI ------------------------------------------------------------------------------------
def test_cli_build_then_oracle(tmp_path, capsys):
    cli.main(
        [
            "build",
            "--out",
            str(tmp_path),
            "--seed",
            "0",
            "--preset",
            "small",
            "--n-train",
            "4",
            "--n-val",
            "3",
            "--n-test",
            "2",
        ]
    )
    out = capsys.readouterr().out.strip().splitlines()
    assert out[-1] == f"built preset=small seed=0 train=4 val=3 test=2 out={tmp_path}"
    assert [len(read_rows(tmp_path / f"{s}.parquet")) for s in ("train", "val", "test")] == [4, 3, 2]
    cli.main(["oracle", str(tmp_path / "val.parquet"), "--traces", str(tmp_path / "traces.parquet")])
    out = capsys.readouterr().out.strip().splitlines()
    assert out[-1] == "oracle F1=1.0000 EM=1.0000 episodes=3"
    traces = read_rows(tmp_path / "traces.parquet")
    assert len(traces) == 3 * (get_preset("small").config.n_chunks + 1)
    assert traces[0]["messages"][-1]["role"] == "assistant"
