"""Plain prose from MediaWiki markup.

Holds `strip_wikitext`, a small regex cleaner that turns the wikitext of a Wikipedia article
into readable paragraphs: it keeps link labels, headings and list items, and drops templates
(infoboxes, citations), tables, references, files, categories and the trailing reference
sections. It is not a MediaWiki parser; it aims at text a language model should learn from.
"""

import html
import re

# Sections after which an article holds only lists of citations and links.
_TRAILING_SECTIONS = re.compile(
    r"^==+\s*(?:references|notes|footnotes|citations|sources|bibliography|see also"
    r"|further reading|external links)\s*==+\s*$",
    re.M | re.I,
)
_COMMENT = re.compile(r"<!--.*?-->", re.S)
_REF = re.compile(r"<ref[^>]*?/>|<ref[^>]*>.*?</ref>", re.S | re.I)
# Elements whose content is markup of its own (formulae, image lists), not prose.
_OPAQUE = re.compile(
    r"<(math|gallery|timeline|score|syntaxhighlight|source|imagemap)\b[^>]*>.*?</\1>", re.S | re.I
)
# Templates and tables nest, so the innermost one is removed until none is left.
_TEMPLATE = re.compile(r"\{\{[^{}]*\}\}")
_TABLE = re.compile(r"\{\|(?:(?!\{\|).)*?\|\}", re.S)
_LINK = re.compile(r"\[\[([^\[\]]*)\]\]")
_EXTERNAL = re.compile(r"\[(?:https?:)?//[^\s\]]+ ?([^\]]*)\]")
_HEADING = re.compile(r"^(=+)\s*(.*?)\s*\1\s*$", re.M)
_EMPHASIS = re.compile(r"'{2,}")
_TAG = re.compile(r"</?[a-zA-Z][^>]*>")
_MAGIC_WORD = re.compile(r"__[A-Z]+__")
_LIST_MARK = re.compile(r"^[*#:;]+ *", re.M)
_TRAILING_SPACE = re.compile(r"[ \t]+$", re.M)
_BLANK_LINES = re.compile(r"\n{3,}")

_DROPPED_NAMESPACES = {"file", "image", "media", "category"}
_LANGUAGE_PREFIX = re.compile(r"^[a-z]{2,3}(?:-[a-z]+)?$")


def _link_label(match: re.Match[str]) -> str:
    """`[[target|label]]` -> label, `[[target]]` -> target; files, categories and
    interlanguage links -> nothing (they are not part of the prose)."""
    target, _, label = match.group(1).partition("|")
    prefix, colon, _ = target.lstrip(":").partition(":")
    if colon and prefix.strip().lower() in _DROPPED_NAMESPACES:
        return ""
    if colon and not label and _LANGUAGE_PREFIX.match(prefix):
        return ""
    return (label.rpartition("|")[2] if label else target).strip()


def _remove_nested(pattern: re.Pattern[str], text: str) -> str:
    while True:
        text, n = pattern.subn("", text)
        if n == 0:
            return text


def strip_wikitext(markup: str) -> str:
    """Return the prose of one article's wikitext (paragraphs separated by blank lines)."""
    trailing = _TRAILING_SECTIONS.search(markup)
    text = markup[: trailing.start()] if trailing else markup
    text = _COMMENT.sub("", text)
    text = _REF.sub("", text)
    text = _OPAQUE.sub("", text)
    text = _remove_nested(_TEMPLATE, text)
    text = _remove_nested(_TABLE, text)
    # Links nest too (a link inside a file caption): resolve innermost first.
    while True:
        text, n = _LINK.subn(_link_label, text)
        if n == 0:
            break
    text = _EXTERNAL.sub(r"\1", text)
    text = _HEADING.sub(r"\2", text)
    text = _EMPHASIS.sub("", text)
    text = _TAG.sub("", text)
    text = _MAGIC_WORD.sub("", text)
    text = _LIST_MARK.sub("", text)
    # Entities such as &nbsp; survive XML parsing as text; decode them last.
    text = html.unescape(text).replace("\xa0", " ")
    text = _TRAILING_SPACE.sub("", text)
    return _BLANK_LINES.sub("\n\n", text).strip()
