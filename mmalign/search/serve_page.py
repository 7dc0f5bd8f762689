"""What a user of ``mmalign serve`` reads: the routes (``--help``) and the search page on ``/``.

The page is one self-contained HTML document: script and style are inline and it
loads nothing from elsewhere (no CDN: the server is local and may run offline; the
server's Content-Security-Policy forbids any other origin).  It only talks to the
server's own JSON endpoints: ``/health`` once (which indexes exist), ``/search`` per
query, ``/thumb`` per result row.  Text from the index (captions, keys, paths) is
inserted with ``textContent``, never as HTML; a hit's ``url`` (its source, e.g. img2dataset's)
becomes a link only when it is http(s), opened without a referrer.  ``/?index=NAME`` searches
the served index NAME (every request the page makes carries it).

A search lives in the page's URL, so it can be linked, reloaded and gone back to:
``/?q=TEXT`` (a text query) or ``/?key=KEY`` (an indexed item's image: each hit's "more
like this"), with ``&k=N&mode=image|text[&dedupe=false]`` (``mode`` is the JSON route's
``against``).  The page runs the URL's search on load, and each new search adds a history
entry.  An image file chosen in the form is posted to ``POST /search`` (it cannot live in
the URL) and shown above its results.  Thumbnails are shown at 128 CSS pixels, small dataset
images upscaled.
"""

from __future__ import annotations

# `mmalign serve --help`'s description (kept here, free of heavy imports, for the parser)
ROUTES_HELP = """Answer search queries over HTTP (a fixed pool of worker threads; a request must arrive
within 10 s, else 408), local only by default.

routes:
  GET  /                     a search page: type a query or pick an image, see rows with thumbnails
                             (/?q=TEXT or /?key=KEY, &k=N&mode=image|text: a search as a link)
  GET  /health               {"ok": true, "dim": D, "indexes": ["image", "text"], "index", "indices"}
  GET  /search?text=...&k=10[&against=image|text][&dedupe=false][&index=NAME]
                             JSON {"query", "hits": [{rank, key, caption, score, row, source_path,
                             url, meta}]}
  GET  /search?key=KEY&k=10[&against=...][&dedupe=...]
                             "more like this": the indexed item KEY's image is the query
  POST /search?k=10[&against=image|text][&dedupe=false]   body = the image file's bytes
                             an image query, e.g.
                             curl --data-binary @query.jpg 'http://127.0.0.1:8765/search?k=5'
  GET  /thumb?row=N[&size=128]   a JPEG thumbnail of a hit's image, read from its shard
                             (loopback clients only; size <= 256)

clip-retrieval's back-end routes (its ClipClient and clip-front work against this server):
  GET  /indices-list         ["NAME", ...]: the --index names, the first is the default
  POST /knn-service          {"text" | "image" (base64) | "image_url" | "embedding_input",
                             "modality": "image"|"text", "num_images", "num_result_ids",
                             "indice_name", "deduplicate"} -> [{id, similarity, caption, url, ...}]
                             (counts over --max-k are clamped: header X-Mmalign-Clamped; options
                             not implemented are ignored: header X-Mmalign-Ignored)
  POST /metadata             {"ids": [...], "indice_name"} -> [{id, metadata: {caption, url, ...}}]

Our routes (the page too: /?index=NAME) take &index=NAME, clip-retrieval's indice_name
(default: the first --index).

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
  body { font: 15px/1.4 system-ui, sans-serif; margin: 1.5rem auto; max-width: 64rem; padding: 0 1rem; color: #222; }
  h1 { font-size: 1.3rem; margin: 0 0 1rem; }
  form { display: flex; gap: .5rem; flex-wrap: wrap; align-items: center; }
  #q { flex: 1 1 20rem; font-size: 1rem; padding: .4rem .6rem; }
  #k { width: 4rem; }
  #status { color: #555; min-height: 1.4em; }
  #status.error { color: #b00020; }
  table { border-collapse: collapse; width: 100%; }
  td, th { padding: .3rem .5rem; border-bottom: 1px solid #ddd; text-align: left; vertical-align: middle; }
  td.num { text-align: right; font-variant-numeric: tabular-nums; }
  td.thumb { width: 136px; height: 136px; text-align: center; }
  /* dataset images are often small: shown at 128 px whatever their size (upscaled, aspect kept) */
  td.thumb img { width: 128px; height: 128px; object-fit: contain; background: #f4f4f4; }
  td.source { color: #555; font-size: .9em; word-break: break-all; }
  td.more a { white-space: nowrap; }
  #query { display: flex; gap: .6rem; align-items: center; margin: .4rem 0; color: #555; }
  #query[hidden] { display: none; }
  #query img { width: 128px; height: 128px; object-fit: contain; background: #f4f4f4; }
</style>
</head>
<body>
<h1>mmalign search</h1>
<form id="form" autocomplete="off">
  <input id="q" name="q" type="search" placeholder="describe an image, then press Enter" autofocus
         maxlength="1000">
  <select id="mode" name="mode" title="search the image index or the caption index">
    <option value="image">images</option>
    <option value="text">captions</option>
  </select>
  <label title="fold identical captions into their best-scoring copy">
    <input id="dedupe" type="checkbox" checked> distinct captions</label>
  <label>k <input id="k" name="k" type="number" value="12" min="1" max="100"></label>
  <button type="submit">Search</button>
  <label title="search with an image file instead of text">or an image:
    <input id="image" type="file" accept="image/*"></label>
</form>
<p id="status"></p>
<figure id="query" hidden><img id="query-image" alt="the uploaded query image">
  <figcaption id="query-name"></figcaption></figure>
<table>
  <thead><tr><th>#</th><th>image</th><th>score</th><th>caption</th><th>source</th><th></th></tr></thead>
  <tbody id="results"></tbody>
</table>
<script>
"use strict";
// A search lives in the page's URL: ?q=TEXT or ?key=KEY (an indexed item: "more like this"),
// with &k=N&mode=image|text[&dedupe=false]; loading such a URL runs its search.
const $ = (id) => document.getElementById(id);
const status = $("status"), results = $("results");
let latest = 0;  // the newest search: an older reply arriving late is dropped
let queryUrl = null;  // the object URL of the uploaded query image shown above the results
// the served index this page searches (`?index=NAME`; none: the server's first), kept in every URL
const INDEX = new URLSearchParams(location.search).get("index") || "";

// the uploaded image a search is for, shown beside its results (null: a text or key search)
function showQuery(file) {
  if (queryUrl) URL.revokeObjectURL(queryUrl);
  queryUrl = file ? URL.createObjectURL(file) : null;
  $("query").hidden = !file;
  if (file) {
    $("query-image").src = queryUrl;
    $("query-name").textContent = "query: " + file.name;
  } else {
    $("query-image").removeAttribute("src");
  }
}

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

function settings() {
  return {k: $("k").value || "12", mode: $("mode").value, dedupe: $("dedupe").checked};
}

function pageUrl(state) {  // the address bar's form of a search
  const params = new URLSearchParams();
  if (state.key) params.set("key", state.key); else if (state.q) params.set("q", state.q);
  params.set("k", state.k);
  params.set("mode", state.mode);
  if (!state.dedupe) params.set("dedupe", "false");
  if (INDEX) params.set("index", INDEX);
  return "/?" + params.toString();
}

function fromUrl() {
  const p = new URLSearchParams(location.search);
  const state = {q: p.get("q") || "", key: p.get("key") || "", k: p.get("k") || "12",
                 mode: p.get("mode") === "text" ? "text" : "image", dedupe: p.get("dedupe") !== "false"};
  $("q").value = state.q;
  $("k").value = state.k;
  $("mode").value = state.mode;
  $("dedupe").checked = state.dedupe;
  return state;
}

function row(hit, state) {
  const tr = document.createElement("tr");
  tr.className = "hit";
  tr.dataset.key = hit.key;
  const thumb = document.createElement("td");
  thumb.className = "thumb";
  const img = document.createElement("img");
  img.loading = "lazy";
  img.alt = hit.key;
  img.src = "/thumb?row=" + encodeURIComponent(hit.row) + "&size=256" +  // 128 CSS px, sharp at 2x
    (INDEX ? "&index=" + encodeURIComponent(INDEX) : "");
  img.onerror = () => { thumb.textContent = "-"; };  // an index without image locations
  thumb.appendChild(img);
  const more = document.createElement("td");
  more.className = "more";
  const link = document.createElement("a");
  link.textContent = "more like this";
  link.href = pageUrl({key: hit.key, k: state.k, mode: "image", dedupe: state.dedupe});
  link.addEventListener("click", (event) => {
    if (event.button !== 0 || event.ctrlKey || event.metaKey || event.shiftKey) return;  // a new tab
    event.preventDefault();
    $("q").value = "";
    $("mode").value = "image";
    run({...settings(), key: hit.key, q: ""}, true);
  });
  more.appendChild(link);
  tr.append(cell(String(hit.rank), "num"), thumb, cell(hit.score.toFixed(4), "num"),
            cell(hit.caption, "caption"), sourceCell(hit), more);
  return tr;
}

// where the hit came from: its source URL as a link when it has one (http/https only), else its path
function sourceCell(hit) {
  const td = cell(hit.source_path || hit.key, "source");
  const url = typeof hit.url === "string" ? hit.url : "";
  if (url.toLowerCase().startsWith("http://") || url.toLowerCase().startsWith("https://")) {
    const link = document.createElement("a");
    link.href = url;
    link.textContent = url;
    link.target = "_blank";
    link.rel = "noopener noreferrer";  // the source page gets neither this page nor its URL
    td.replaceChildren(link);
  }
  return td;
}

// one search: the request, then the rows; `what` names the query in the status line
async function fetchHits(url, init, what, state) {
  const mine = ++latest;
  say("searching...");
  let reply, body;
  try {
    reply = await fetch(url, init);
    body = await reply.json();
  } catch (err) {
    if (mine === latest) say("the server did not answer (" + err + ")", true);
    return;
  }
  if (mine !== latest) return;
  if (!reply.ok) {
    say(body.error || ("error " + reply.status), true);
    return;
  }
  results.replaceChildren(...body.hits.map((hit) => row(hit, state)));
  say(body.hits.length + " result(s) " + what);
}

function query(state) {
  const params = new URLSearchParams({k: state.k, against: state.mode, dedupe: String(state.dedupe)});
  if (INDEX) params.set("index", INDEX);
  return params;
}

// run a text or key search; `push`: a new history entry (a search typed or clicked), else the
// current one is rewritten (a loaded or reloaded URL, back and forward)
function run(state, push) {
  if (!state.q && !state.key) return;
  showQuery(null);
  const url = pageUrl(state), same = url === location.pathname + location.search;
  history[push && !same ? "pushState" : "replaceState"](null, "", url);
  const params = query(state);
  if (state.key) {
    params.set("key", state.key);
    return fetchHits("/search?" + params.toString(), {}, "like \\u201c" + state.key + "\\u201d", state);
  }
  params.set("text", state.q);
  return fetchHits("/search?" + params.toString(), {}, "for \\u201c" + state.q + "\\u201d", state);
}

function upload(file) {
  const state = {...settings(), q: "", key: ""};
  $("q").value = "";
  history.pushState(null, "", pageUrl(state));  // an uploaded image cannot live in the URL
  showQuery(file);
  return fetchHits("/search?" + query(state).toString(), {method: "POST", body: file},
                   "like the image " + file.name, state);
}

$("form").addEventListener("submit", (event) => {
  event.preventDefault();
  run({...settings(), q: $("q").value.trim(), key: ""}, true);
});
$("image").addEventListener("change", () => {
  const file = $("image").files[0];
  if (file) upload(file);
  $("image").value = "";  // choosing the same file again is a new search
});
window.addEventListener("popstate", () => {
  const state = fromUrl();
  if (state.q || state.key) run(state, false); else { results.replaceChildren(); say(""); showQuery(null); }
});

fetch("/health" + (INDEX ? "?index=" + encodeURIComponent(INDEX) : "")).then((r) => r.json()).then((health) => {
  if (!health.indexes.includes("text")) {
    $("mode").querySelector("option[value=text]").disabled = true;
  }
  document.body.dataset.ready = "1";
}).catch(() => say("the server did not answer /health", true));
run(fromUrl(), false);
</script>
</body>
</html>
"""
