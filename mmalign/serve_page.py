"""What a user of ``mmalign serve`` reads: the routes (``--help``) and the search page on ``/``.

The page is one self-contained HTML document: script and style are inline and it
loads nothing from elsewhere (no CDN: the server is local and may run offline; the
server's Content-Security-Policy forbids any other origin).  It only talks to the
server's own JSON endpoints: ``/health`` once (which indexes exist), ``/search`` per
query, ``/thumb`` per result row.  Text from the index (captions, keys, paths) is
inserted with ``textContent``, never as HTML.
"""

from __future__ import annotations

# `mmalign serve --help`'s description (kept here, free of heavy imports, for the parser)
ROUTES_HELP = """Answer search queries over HTTP, one thread per connection, local only by default.

routes:
  GET  /                     a search page: type a query, see rows with thumbnails
  GET  /health               {"ok": true, "dim": D, "indexes": ["image", "text"]}
  GET  /search?text=...&k=10[&against=image|text][&dedupe=false]
                             JSON {"query", "hits": [{rank, key, caption, score, row, source_path}]}
  POST /search?k=10[&against=image|text][&dedupe=false]   body = the image file's bytes
                             an image query, e.g.
                             curl --data-binary @query.jpg 'http://127.0.0.1:8765/search?k=5'
  GET  /thumb?row=N[&size=128]   a JPEG thumbnail of a hit's image, read from its shard
                             (loopback clients only; size <= 256)

against=image (default) searches the images, against=text the captions; identical
captions are folded into their best-scoring copy unless dedupe=false. Each request
writes one access-log line (client, method, path, status, ms) to stderr."""

PAGE = """<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>mmalign search</title>
<style>
  body { font: 15px/1.4 system-ui, sans-serif; margin: 1.5rem auto; max-width: 60rem; padding: 0 1rem; color: #222; }
  h1 { font-size: 1.3rem; margin: 0 0 1rem; }
  form { display: flex; gap: .5rem; flex-wrap: wrap; align-items: center; }
  #q { flex: 1 1 20rem; font-size: 1rem; padding: .4rem .6rem; }
  #k { width: 4rem; }
  #status { color: #555; min-height: 1.4em; }
  #status.error { color: #b00020; }
  table { border-collapse: collapse; width: 100%; }
  td, th { padding: .3rem .5rem; border-bottom: 1px solid #ddd; text-align: left; vertical-align: middle; }
  td.num { text-align: right; font-variant-numeric: tabular-nums; }
  td.thumb { width: 100px; height: 100px; text-align: center; }
  td.thumb img { max-width: 96px; max-height: 96px; }
  td.source { color: #555; font-size: .9em; word-break: break-all; }
</style>
</head>
<body>
<h1>mmalign search</h1>
<form id="form" autocomplete="off">
  <input id="q" name="text" type="search" placeholder="describe an image, then press Enter" autofocus required
         maxlength="1000">
  <select id="against" title="search the image index or the caption index">
    <option value="image">images</option>
    <option value="text">captions</option>
  </select>
  <label title="fold identical captions into their best-scoring copy">
    <input id="dedupe" type="checkbox" checked> distinct captions</label>
  <label>k <input id="k" type="number" value="12" min="1" max="100"></label>
  <button type="submit">Search</button>
</form>
<p id="status"></p>
<table>
  <thead><tr><th>#</th><th>image</th><th>score</th><th>caption</th><th>source</th></tr></thead>
  <tbody id="results"></tbody>
</table>
<script>
"use strict";
const $ = (id) => document.getElementById(id);
const status = $("status"), results = $("results");

function say(text, error) {
  status.textContent = text;
  status.className = error ? "error" : "";
}

function cell(text, cls) {
  const td = document.createElement("td");
  td.textContent = text;
  if (cls) td.className = cls;
  return td;
}

function row(hit) {
  const tr = document.createElement("tr");
  tr.className = "hit";
  const thumb = document.createElement("td");
  thumb.className = "thumb";
  const img = document.createElement("img");
  img.loading = "lazy";
  img.alt = hit.key;
  img.src = "/thumb?row=" + encodeURIComponent(hit.row) + "&size=96";
  img.onerror = () => { thumb.textContent = "-"; };  // an index without image locations
  thumb.appendChild(img);
  tr.append(cell(String(hit.rank), "num"), thumb, cell(hit.score.toFixed(4), "num"),
            cell(hit.caption, "caption"), cell(hit.source_path || hit.key, "source"));
  return tr;
}

async function search() {
  const text = $("q").value.trim();
  if (!text) return;
  const params = new URLSearchParams({text: text, k: $("k").value, against: $("against").value,
                                      dedupe: String($("dedupe").checked)});
  say("searching...");
  let reply, body;
  try {
    reply = await fetch("/search?" + params.toString());
    body = await reply.json();
  } catch (err) {
    say("the server did not answer (" + err + ")", true);
    return;
  }
  if (!reply.ok) {
    say(body.error || ("error " + reply.status), true);
    return;
  }
  results.replaceChildren(...body.hits.map(row));
  say(body.hits.length + " result(s) for \\u201c" + text + "\\u201d");
}

$("form").addEventListener("submit", (event) => { event.preventDefault(); search(); });

fetch("/health").then((r) => r.json()).then((health) => {
  if (!health.indexes.includes("text")) {
    $("against").querySelector("option[value=text]").disabled = true;
  }
  document.body.dataset.ready = "1";
}).catch(() => say("the server did not answer /health", true));
</script>
</body>
</html>
"""
