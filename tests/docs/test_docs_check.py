"""The docs check (.ci/docs_check.py) fails on what a reader would see broken.

The judge is tested on sample DOMs and needs nothing; the end-to-end tests open small pages in
headless Chromium and skip where there is none.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _load() -> ModuleType:
    spec = importlib.util.spec_from_file_location("docs_check", ROOT / ".ci" / "docs_check.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


docs_check = _load()


def _dom(findings: object, rest: str = "") -> str:
    payload = json.dumps(findings).replace("<", "\\u003c")
    return (
        f"<html><head></head><body>{rest}</body>"
        f'<script type="application/json" id="{docs_check.RESULT_ID}">{payload}</script></html>'
    )


RENDERED = {"tag": "div", "svg": True, "width": 640, "height": 300, "error": False, "text": ""}
RAW = {
    "tag": "pre",
    "svg": False,
    "width": 0,
    "height": 0,
    "error": False,
    "text": "sequenceDiagram participant A",
}
FITS = {"visible": True, "overflow": 0, "width": 688, "longest": "x = 1", "chars": 5}
WIDE = {
    "visible": True,
    "overflow": 89,
    "width": 688,
    "longest": "allocator.free(buf)  # or just drop it",
    "chars": 91,
}


def test_a_page_with_rendered_diagrams_and_fitting_code_passes() -> None:
    dom = _dom({"final": True, "diagrams": [RENDERED, RENDERED], "code": [FITS], "errors": []})
    assert docs_check.judge("concepts/streams/index.html", 2, dom) == []


def test_a_page_without_diagrams_or_code_passes() -> None:
    assert (
        docs_check.judge("index.html", 0, _dom({"final": True, "diagrams": [], "code": []})) == []
    )


def test_an_unrendered_diagram_fails_naming_page_and_diagram() -> None:
    dom = _dom(
        {"final": True, "diagrams": [RENDERED, RAW], "code": [], "errors": []},
        '<pre class="mermaid"><code>sequenceDiagram</code></pre>',
    )
    problems = docs_check.judge("concepts/streams/index.html", 2, dom)
    assert any(
        "concepts/streams/index.html: diagram 2 is not rendered" in p and "sequenceDiagram" in p
        for p in problems
    ), problems
    assert any("2 diagram(s) in the page, 1 rendered" in p for p in problems), problems


def test_raw_mermaid_left_in_the_dom_fails_even_if_the_probe_missed_it() -> None:
    dom = _dom(
        {"final": True, "diagrams": [], "code": [], "errors": []},
        '<pre class="mermaid"><code>flowchart TB\n a --> b</code></pre>',
    )
    assert docs_check.judge("a/index.html", 1, dom)


def test_fewer_diagrams_than_the_page_holds_fails() -> None:
    dom = _dom({"final": False, "diagrams": [RENDERED], "code": [], "errors": []})
    problems = docs_check.judge("a/index.html", 2, dom)
    assert problems == [
        "a/index.html: 2 diagram(s) in the page, 1 rendered (the page had not settled)"
    ]


@pytest.mark.parametrize(
    ("diagram", "message"),
    [
        ({**RENDERED, "error": True}, "syntax-error picture"),
        ({**RENDERED, "width": 0}, "empty SVG"),
    ],
)
def test_a_broken_diagram_fails(diagram: dict[str, object], message: str) -> None:
    dom = _dom({"final": True, "diagrams": [diagram], "code": [], "errors": []})
    problems = docs_check.judge("a/index.html", 1, dom)
    assert any(message in p for p in problems), problems


def test_a_code_block_wider_than_the_column_fails_naming_its_line() -> None:
    dom = _dom({"final": True, "diagrams": [], "code": [FITS, WIDE], "errors": []})
    (problem,) = docs_check.judge("concepts/allocators/index.html", 0, dom)
    assert problem.startswith("concepts/allocators/index.html: code block 2 is 89 px wider")
    assert "allocator.free(buf)" in problem


def test_a_hidden_code_block_is_not_judged() -> None:
    hidden = {**WIDE, "visible": False}
    dom = _dom({"final": True, "diagrams": [], "code": [hidden], "errors": []})
    assert docs_check.judge("a/index.html", 0, dom) == []


@pytest.mark.parametrize("dom", ["<html><body>nothing</body></html>", ""])
def test_a_page_the_probe_did_not_report_on_fails(dom: str) -> None:
    (problem,) = docs_check.judge("a/index.html", 0, dom)
    assert "the probe left no findings" in problem


def test_the_diagrams_of_a_built_page_are_counted() -> None:
    page = '<pre class="mermaid"><code>a</code></pre><p>x</p><pre class="mermaid"><code>b'
    assert docs_check.expected_diagrams(page) == 2
    assert docs_check.expected_diagrams('<pre class="highlight"><code>') == 0


# -- raw reStructuredText roles, in the built HTML (no browser needed) -------------------------

# What mkdocstrings makes of a docstring holding a class role around "Buffer" (a reST role, as
# ROLE_IN_DOCSTRING's text shows): Markdown turns the backquoted target into a code span and
# the role's name stays as text.
ROLE_IN_DOCSTRING = "<p>Returns a :class:<code>Buffer</code> of the memory.</p>"


@pytest.mark.parametrize(
    ("html", "role"),
    [
        (ROLE_IN_DOCSTRING, ":class:`Buffer`"),
        (
            "<p>See :meth:<code>~aioep.Environment.open</code>.</p>",
            ":meth:`~aioep.Environment.open`",
        ),
        ("<pre><code>:py:func:`copy_tensors`</code></pre>", ":py:func:`copy_tensors`"),
        ("<td>:exc:<code>InvalidArgument</code></td>", ":exc:`InvalidArgument`"),
    ],
)
def test_a_raw_role_in_a_page_is_a_problem_naming_page_line_and_role(html: str, role: str) -> None:
    (problem,) = docs_check.raw_roles("reference/aioep/index.html", "<html>\n" + html)
    assert problem.startswith("reference/aioep/index.html:2: raw reStructuredText role ")
    assert role in problem, problem


def test_cross_references_and_code_are_not_raw_roles() -> None:
    html = (
        '<p>Returns a <a class="autorefs" href="#aioep.Buffer"><code>Buffer</code></a>;'
        " the time is 12:30:<code>x</code>, a dict is {<code>'a:b'</code>: 1}.</p>"
    )
    assert docs_check.raw_roles("a/index.html", html) == []


def test_the_check_fails_on_a_raw_role_even_without_chromium(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("CHROMIUM", str(tmp_path / "no-such-chromium"))
    monkeypatch.delenv("CI", raising=False)
    site = tmp_path / "site"
    (site / "reference").mkdir(parents=True)
    (site / "index.html").write_text("<html><body><p>fine</p></body></html>")
    assert docs_check.main([str(site)]) == 0, capsys.readouterr().err
    (site / "reference" / "index.html").write_text(f"<html><body>{ROLE_IN_DOCSTRING}</body></html>")
    assert docs_check.main([str(site)]) == 1
    err = capsys.readouterr().err
    assert "reference/index.html:1: raw reStructuredText role :class:`Buffer`" in err, err


# -- end to end, in headless Chromium ----------------------------------------------------------

needs_chromium = pytest.mark.skipif(
    docs_check.find_chromium() is None, reason="no Chromium (Debian package `chromium`)"
)

# What Material does with a diagram, minus mermaid: the code block becomes a div whose SVG sits
# in a closed shadow root, which the probe can only see by keeping the root when it is made.
FAKE_RENDER = """<script>
document.querySelectorAll("pre.mermaid").forEach(function (pre) {
  var host = document.createElement("div");
  host.className = "mermaid";
  var root = host.attachShadow({mode: "closed"});
  root.innerHTML = '<svg width="300" height="120"><rect width="300" height="120"/></svg>';
  pre.replaceWith(host);
});
</script>"""


def _page(body: str) -> str:
    return f"<!doctype html><html><head><title>t</title></head><body>{body}</body></html>"


@needs_chromium
def test_the_check_fails_on_a_raw_diagram_and_a_wide_code_block(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    site = tmp_path / "site"
    (site / "raw").mkdir(parents=True)
    (site / "wide").mkdir()
    (site / "index.html").write_text(
        _page('<pre class="mermaid"><code>flowchart TB\n  a</code></pre>' + FAKE_RENDER)
    )
    (site / "raw" / "index.html").write_text(
        _page('<pre class="mermaid"><code>sequenceDiagram\n  A->>B: hi</code></pre>')
    )
    (site / "wide" / "index.html").write_text(
        _page('<div style="width: 300px"><pre><code>' + "x" * 200 + "</code></pre></div>")
    )
    assert docs_check.main([str(site), "--jobs", "3"]) == 1
    err = capsys.readouterr().err
    assert "raw/index.html: diagram 1 is not rendered" in err
    assert "sequenceDiagram" in err
    assert "wide/index.html: code block 1 is" in err
    assert "index.html: diagram" not in err.replace("raw/index.html", "")


@needs_chromium
def test_the_check_passes_a_page_whose_diagram_became_an_svg(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    site = tmp_path / "site"
    site.mkdir()
    (site / "index.html").write_text(
        _page('<pre class="mermaid"><code>flowchart TB\n  a</code></pre>' + FAKE_RENDER)
    )
    assert docs_check.main([str(site)]) == 0, capsys.readouterr().err
