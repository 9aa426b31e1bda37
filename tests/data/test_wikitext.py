"""MediaWiki markup -> prose: each construct the Wikipedia sample uses."""

import pytest

from ropekit.data.wikitext import strip_wikitext


@pytest.mark.parametrize(
    ("markup", "prose"),
    [
        ("'''Albedo''' is ''diffuse'' reflection.", "Albedo is diffuse reflection."),
        ("See [[Light]] and [[Sun|the Sun]].", "See Light and the Sun."),
        ("A{{Infobox|a={{nested|b}}|c=d}}B", "AB"),
        ('Fact.<ref name="x">Cite {{web}}</ref> More.<ref name="y"/>', "Fact. More."),
        ("Text [[File:A.jpg|thumb|A [[Moon|moon]] photo]] end.", "Text  end."),
        ("Prose.\n[[Category:Physics]]\n[[de:Albedo]]", "Prose."),
        ("Intro.\n\n== History ==\nOld.", "Intro.\n\nHistory\nOld."),
        ("A\n{| class=wikitable\n|-\n| 1 || {{x}}\n|}\nB", "A\n\nB"),
        ("An [https://example.org external site] link.", "An external site link."),
        ("* one\n* two\n# three", "one\ntwo\nthree"),
        ("a&nbsp;b &amp; c<!-- hidden --> <br/>d __NOTOC__", "a b & c d"),
        ("Body.\n\n== References ==\n* a citation\n== External links ==\n* x", "Body."),
        ("x = <math>\\frac{1}{2}</math>.", "x = ."),
    ],
)
def test_markup_becomes_prose(markup: str, prose: str):
    assert strip_wikitext(markup) == prose


def test_blank_lines_collapse():
    assert strip_wikitext("a\n\n\n\n{{t}}\n\n\nb  \n") == "a\n\nb"
