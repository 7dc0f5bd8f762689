"""The search page shows the uploaded query image (issue 39, point 6), checked on the page's
source where no browser is installed (tests/search/test_serve_page.py checks it in Chromium)."""

import re

import pytest

from mmalign.search.serve_page import PAGE


def _function(name: str) -> str:
    body = re.search(r"\nfunction " + name + r"\(.*?\n}\n", PAGE, re.S)
    assert body, name
    return body.group(0)


def test_the_page_has_a_place_for_the_query_image_and_fills_it_on_upload():
    assert re.search(r'<figure id="query" hidden><img id="query-image"', PAGE)
    assert "showQuery(file);" in _function("upload")  # the uploaded file itself, as an object URL
    show = _function("showQuery")
    assert "URL.createObjectURL(file)" in show and "URL.revokeObjectURL" in show
    assert "showQuery(null);" in _function("run")  # a text or key search hides it
    # displayed like the result thumbnails: 128 CSS px
    assert re.search(r"#query img \{ width: 128px; height: 128px;", PAGE)


# The page's script under node with a minimal stand-in for the DOM, fetch and history: an upload
# shows the file (as an object URL) above its results; a text search afterwards hides it.
HARNESS = r"""
const vm = require("vm");
const fs = require("fs");
const script = fs.readFileSync(process.argv[2], "utf8");
const elements = {};
function element(tag) {
  return {tag, children: [], dataset: {}, listeners: {}, value: "", checked: false, hidden: false,
          textContent: "", className: "", files: [],
          addEventListener(type, fn) { this.listeners[type] = fn; },
          appendChild(c) { this.children.push(c); }, append(...cs) { this.children.push(...cs); },
          replaceChildren(...cs) { this.children = cs; }, removeAttribute(name) { delete this[name]; },
          querySelector() { return element("option"); }};
}
const page = {
  elements, revoked: [],
  document: {getElementById: (id) => (elements[id] = elements[id] || element(id)),
             createElement: element, body: {dataset: {}}},
  location: {search: "", pathname: "/"},
  history: {length: 1, pushState() { this.length++; }, replaceState() {}},
  window: {addEventListener() {}},
  URL: {createObjectURL: (f) => "blob:page/" + f.name, revokeObjectURL: (u) => page.revoked.push(u)},
  URLSearchParams,
  fetch: async (url) => ({ok: true, status: 200, json: async () => url === "/health" ?
    {indexes: ["image", "text"]} : {hits: [{rank: 1, key: "k1", row: 0, score: 0.5, caption: "c"}]}}),
};
elements.query = Object.assign(element("figure"), {hidden: true});
vm.createContext(page);
vm.runInContext(script, page);
(async () => {
  const $ = page.document.getElementById;
  $("image").files = [{name: "cat.png"}];
  const settle = () => new Promise((done) => setTimeout(done, 50));  // the listeners' fetches resolve
  $("image").listeners.change();
  await settle();
  const afterUpload = {hidden: $("query").hidden, src: $("query-image").src, name: $("query-name").textContent,
                       rows: $("results").children.length, status: $("status").textContent};
  $("q").value = "a dog";
  $("form").listeners.submit({preventDefault() {}});
  await settle();
  const afterText = {hidden: $("query").hidden, src: $("query-image").src || null, revoked: page.revoked};
  console.log(JSON.stringify({afterUpload, afterText}));
})();
"""


@pytest.mark.integration  # runs the page's script in node
def test_an_upload_shows_the_file_and_a_text_search_hides_it(tmp_path):
    import json
    import shutil
    import subprocess

    import pytest

    node = shutil.which("node")
    if node is None:
        pytest.skip(
            "no node on PATH to run the page's script (tests/search/test_serve_page.py runs it in Chromium)"
        )
    script = re.search(r"<script>\n(.*)</script>", PAGE, re.S).group(1)
    (tmp_path / "page.js").write_text(script)
    (tmp_path / "harness.js").write_text(HARNESS)
    res = subprocess.run(
        [node, str(tmp_path / "harness.js"), str(tmp_path / "page.js")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.returncode == 0, res.stderr
    got = json.loads(res.stdout.strip().splitlines()[-1])
    assert got["afterUpload"] == {
        "hidden": False,
        "src": "blob:page/cat.png",
        "name": "query: cat.png",
        "rows": 1,
        "status": "1 result(s) like the image cat.png",
    }
    assert got["afterText"] == {"hidden": True, "src": None, "revoked": ["blob:page/cat.png"]}
