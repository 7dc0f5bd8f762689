"""The search page in a real browser (headless Chromium): a query typed into the text box,
one given in the URL (``/?q=...&k=...&mode=...``, a link or a reload), "more like this" on a
hit (``/?key=KEY``), and an uploaded image file each show one row per hit, the same rows as
the JSON endpoint answers, with thumbnails displayed at a readable size.

Chromium is driven over the DevTools protocol on a pipe (``tests/harness/chromium.py``).
The tests skip, saying so, when no Chromium or Chrome binary is found.
"""

from __future__ import annotations

import json
import urllib.parse
import urllib.request

import pytest

from tests.harness.chromium import browser_fixture
from tests.harness.searchdata import build_corpus, serve_corpus

pytestmark = pytest.mark.integration  # real processes, a browser or a supervisor's timeouts

QUERY = "a photo of a cat"


@pytest.fixture
def browser(tmp_path):
    yield from browser_fixture(tmp_path)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return build_corpus(tmp_path_factory.mktemp("page") / "corpus")


@pytest.fixture(scope="module")
def served(corpus):
    yield from serve_corpus(corpus)


OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # local server: never via a proxy


def _json(url: str) -> dict:
    with OPENER.open(url, timeout=10) as r:
        return json.loads(r.read())


# the result rows as JSON once every row's thumbnail has loaded, else null; `want` rows when given
ROWS_LOADED = """((want) => {
  const rows = [...document.querySelectorAll('#results tr.hit')].map(tr => ({
    cells: [...tr.cells].map(td => td.textContent), key: tr.dataset.key,
    more: (a => a && a.getAttribute('href'))(tr.querySelector('td.more a')),
    thumb: (img => img !== null && img.complete && img.naturalWidth > 0)(tr.querySelector('img')),
    shown: (img => img ? [img.getBoundingClientRect().width, img.getBoundingClientRect().height,
                          img.naturalWidth] : null)(tr.querySelector('img'))}));
  const ok = rows.length > 0 && rows.every(r => r.thumb) && (want === null || rows.length === want);
  return ok ? JSON.stringify({rows, status: document.getElementById('status').textContent,
                              search: location.search}) : null;
})"""


def _rows(browser, session, want: int | None = None, status: str = "") -> dict:
    """Wait (bounded) until ``want`` rows with loaded thumbnails show and the status line holds ``status``."""
    expr = (
        f"(() => document.getElementById('status').textContent.includes({json.dumps(status)}) ? "
        f"{ROWS_LOADED}({json.dumps(want)}) : null)()"
    )
    return json.loads(browser.wait_for(session, expr))


def _open(browser, url: str) -> str:
    target = browser.call("Target.createTarget", {"url": "about:blank"})["targetId"]
    session = browser.call("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]
    browser.call("Page.enable", {}, session)
    # tall enough for 12 rows: thumbnails load lazily, and nobody scrolls here
    browser.call(
        "Emulation.setDeviceMetricsOverride",
        {"width": 1200, "height": 2400, "deviceScaleFactor": 1, "mobile": False},
        session,
    )
    browser.call("Page.navigate", {"url": url}, session)
    browser.wait_for(session, "document.readyState === 'complete' && document.body.dataset.ready === '1'")
    return session


def _same_hits(rows: list, hits: list) -> None:
    assert len(rows) == len(hits)
    for row, hit in zip(rows, hits):
        rank, _, score, caption, source, more = row["cells"]
        assert (int(rank), caption, source, row["key"]) == (
            hit["rank"],
            hit["caption"],
            hit["source_path"],
            hit["key"],
        )
        assert float(score) == pytest.approx(hit["score"], abs=1e-4)
        assert more == "more like this"


def test_typing_a_query_shows_result_rows_with_thumbnails(browser, served):
    session = _open(browser, served.base + "/")
    assert browser.evaluate(session, "document.querySelectorAll('#results tr.hit').length") == 0
    entries = browser.evaluate(session, "history.length")
    # type as a user does: focus the box, insert the text, press Enter (the form submits)
    browser.evaluate(session, "document.getElementById('q').focus()")
    browser.call("Input.insertText", {"text": QUERY}, session)
    for kind in ("keyDown", "keyUp"):
        browser.call(
            "Input.dispatchKeyEvent",
            {
                "type": kind,
                "key": "Enter",
                "code": "Enter",
                "windowsVirtualKeyCode": 13,
                "nativeVirtualKeyCode": 13,
                **({"text": "\r"} if kind == "keyDown" else {}),
            },
            session,
        )
    assert browser.evaluate(session, "document.getElementById('q').value") == QUERY
    shown = _rows(browser, session, status="result(s) for")
    # the rows are what the JSON endpoint answers for the same query (12 = the page's default k)
    hits = _json(f"{served.base}/search?text={QUERY.replace(' ', '+')}&k=12")["hits"]
    assert len(hits) == 12
    _same_hits(shown["rows"], hits)
    # the search went into the URL, as a new history entry
    assert shown["search"] == "?q=a+photo+of+a+cat&k=12&mode=image"
    assert browser.evaluate(session, "history.length") == entries + 1
    # the page went through the server's own endpoints: the search, and one thumbnail per row
    requested = [line.split()[2] for line in served.lines]
    assert any(
        p.startswith("/search?k=12&against=image&dedupe=true&text=a+photo+of+a+cat") for p in requested
    )
    assert sum(p.startswith("/thumb?row=") for p in requested) >= 12
    # thumbnails are readable: the 32 px corpus images are displayed upscaled to at least 96 px
    for width, height, natural in (row["shown"] for row in shown["rows"]):
        assert width >= 96 and height >= 96 and natural < width
    # a reload runs the URL's search again
    browser.call("Page.reload", {}, session)
    browser.wait_for(session, "document.readyState === 'complete' && document.body.dataset.ready === '1'")
    again = _rows(browser, session, 12, status="result(s) for")
    assert [r["cells"] for r in again["rows"]] == [r["cells"] for r in shown["rows"]]
    assert browser.evaluate(session, "document.getElementById('q').value") == QUERY


def test_a_url_with_a_query_shows_its_hits(browser, served):
    session = _open(browser, served.base + "/?q=a+photo+of+a+dog&k=5&mode=text&dedupe=false")
    shown = _rows(browser, session, 5, status="result(s) for")
    _same_hits(
        shown["rows"],
        _json(f"{served.base}/search?text=a+photo+of+a+dog&k=5&against=text&dedupe=false")["hits"],
    )
    # the form shows the URL's search
    form = browser.evaluate(
        session,
        "JSON.stringify(['q', 'k', 'mode'].map(id => document.getElementById(id)"
        ".value).concat([document.getElementById('dedupe').checked]))",
    )
    assert json.loads(form) == ["a photo of a dog", "5", "text", False]
    assert shown["search"] == "?q=a+photo+of+a+dog&k=5&mode=text&dedupe=false"


def test_more_like_this_queries_by_the_hits_key_and_back_returns(browser, served):
    session = _open(browser, served.base + "/?q=a+photo+of+a+bird&k=4")
    first = _rows(browser, session, 4, status="result(s) for")
    key = first["rows"][1]["key"]
    link = f"/?key={urllib.parse.quote_plus(key)}&k=4&mode=image"
    assert first["rows"][1]["more"] == link  # a real link: it opens in a new tab too
    browser.evaluate(
        session, "document.querySelectorAll('#results tr.hit')[1].querySelector('td.more a').click()"
    )
    like = _rows(browser, session, 4, status=f"like \u201c{key}\u201d")
    assert like["search"] == link[1:]
    hits = _json(f"{served.base}/search?key={urllib.parse.quote_plus(key)}&k=4")["hits"]
    _same_hits(like["rows"], hits)
    assert hits[0]["key"] == key and hits[0]["score"] == pytest.approx(1.0, abs=1e-3)  # the item itself first
    # back: the text search again
    browser.evaluate(session, "history.back()")
    back = _rows(browser, session, 4, status="result(s) for \u201ca photo of a bird\u201d")
    assert [r["cells"] for r in back["rows"]] == [r["cells"] for r in first["rows"]]
    # the "more like this" URL loaded directly shows the same rows
    direct = _rows(browser, _open(browser, served.base + link), 4, status="like")
    assert [r["cells"] for r in direct["rows"]] == [r["cells"] for r in like["rows"]]


def test_an_image_file_chosen_in_the_form_is_the_query(browser, served, corpus):
    session = _open(browser, served.base + "/?k=3")
    picked = corpus["root"] / "src" / "dog" / "0002.png"
    document = browser.call("DOM.getDocument", {}, session)["root"]["nodeId"]
    node = browser.call("DOM.querySelector", {"nodeId": document, "selector": "#image"}, session)["nodeId"]
    browser.call("DOM.setFileInputFiles", {"files": [str(picked)], "nodeId": node}, session)
    shown = _rows(browser, session, 3, status="like the image 0002.png")
    assert shown["rows"][0]["cells"][4] == "dog/0002.png"  # its own indexed copy is the nearest
    assert float(shown["rows"][0]["cells"][2]) == pytest.approx(1.0, abs=1e-3)
    assert any(
        line.split()[1:3] == ["POST", "/search?k=3&against=image&dedupe=true"] for line in served.lines
    )


def test_the_uploaded_query_image_is_shown_beside_its_results(browser, served, corpus):
    """Issue 39, point 6: the image searched by is shown (a thumbnail of the file itself, not
    a server round trip) above its results, and a text search hides it again."""
    session = _open(browser, served.base + "/?k=3")
    hidden = "document.getElementById('query').hidden"
    assert browser.evaluate(session, hidden) is True
    picked = corpus["root"] / "src" / "cat" / "0001.png"
    document = browser.call("DOM.getDocument", {}, session)["root"]["nodeId"]
    node = browser.call("DOM.querySelector", {"nodeId": document, "selector": "#image"}, session)["nodeId"]
    browser.call("DOM.setFileInputFiles", {"files": [str(picked)], "nodeId": node}, session)
    _rows(browser, session, 3, status="like the image 0001.png")
    shown = json.loads(
        browser.wait_for(
            session,
            """(() => { const img = document.getElementById('query-image');
      const box = img.getBoundingClientRect();
      return !document.getElementById('query').hidden && img.complete && img.naturalWidth > 0 ?
        JSON.stringify({src: img.src, w: box.width, h: box.height, natural: img.naturalWidth,
                        name: document.getElementById('query-name').textContent}) : null; })()""",
        )
    )
    assert shown["src"].startswith("blob:") and shown["name"] == "query: 0001.png"
    assert shown["w"] >= 96 and shown["h"] >= 96 and shown["natural"] == 32  # the 32 px file, upscaled
    browser.evaluate(
        session,
        "document.getElementById('q').value = 'a photo of a dog'; "
        "document.getElementById('form').requestSubmit()",
    )
    _rows(browser, session, 3, status="result(s) for")
    assert browser.evaluate(session, hidden) is True
