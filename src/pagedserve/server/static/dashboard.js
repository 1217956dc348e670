// pagedserve dashboard: polls /debug/kv and draws the block map, the block tables and small charts.
// No libraries and nothing from the internet. With --api-key the browser holds the key as an HttpOnly cookie
// set by /dashboard/login; this script never sees it.
"use strict";

const params = new URLSearchParams(location.search);
const INTERVAL_MS = Math.max(100, Number(params.get("interval_ms")) || 500);
const HISTORY = 120;             // chart points (one minute at two polls per second)
const HIT_RATE_WINDOW_S = 10;    // the hit-rate chart covers lookups of the last few seconds
const MAX_TABLE_ROWS = 64;

const $ = (id) => document.getElementById(id);
const grid = $("grid"), swappedGrid = $("swapped-grid"), info = $("info"), statusEl = $("status");
let cells = [];                  // one div per physical block, index = block id
let swappedCells = [];           // one div per occupied host block
let history_ = [];
let numUpdates = 0;

function setStatus(text, isError) {
  statusEl.textContent = text;
  statusEl.className = isError ? "error" : "";
}

function describe(b) {
  const holders = b.holders.length ? b.holders.join(", ") : "none";
  return `block ${b.id}: ${b.state}, ref_count ${b.ref_count}, holders: ${holders}` +
    (b.hash ? `, hash ${b.hash}` : "");
}

function renderBlocks(container, blocks, known) {
  if (known.length !== blocks.length) {
    container.textContent = "";
    known.length = 0;
    for (let i = 0; i < blocks.length; i++) {
      const cell = document.createElement("div");
      cell.className = "blk";
      container.appendChild(cell);
      known.push(cell);
    }
  }
  for (let i = 0; i < blocks.length; i++) {
    const b = blocks[i], cell = known[i];
    const holders = b.holders.join(",");
    const key = `${b.id}|${b.state}|${b.ref_count}|${holders}|${b.hash}`;
    if (cell.dataset.key === key) continue;
    cell.dataset.key = key;
    cell.dataset.id = b.id;
    cell.dataset.state = b.state;
    cell.dataset.ref = b.ref_count;
    cell.dataset.holders = holders;
    cell.dataset.hash = b.hash || "";
    cell.className = "blk " + b.state + (b.ref_count > 1 ? " shared" : "");
    cell.title = describe(b);
  }
}

for (const container of [grid, swappedGrid]) {
  container.addEventListener("mouseover", (ev) => {
    const cell = ev.target.closest(".blk");
    if (!cell || !cell.title) return;
    for (const old of document.querySelectorAll(".blk.hover")) old.classList.remove("hover");
    cell.classList.add("hover");
    info.textContent = cell.title;
  });
}

function renderSummary(snap) {
  const c = snap.counters, e = snap.engine;
  const pct = (x) => (100 * x).toFixed(1) + "%";
  const hitRate = c.prefix_cache_queries ? pct(c.prefix_cache_hits / c.prefix_cache_queries) : "n/a";
  const items = [
    ["running", c.num_running], ["waiting", c.num_waiting], ["KV usage", pct(c.kv_cache_usage)],
    ["in use", c.num_in_use_blocks], ["shared", c.num_shared_blocks], ["cached", c.num_cached_blocks],
    ["free (incl. cached)", c.num_free_blocks], ["prefix hits", `${c.prefix_cache_hits} / ` +
      `${c.prefix_cache_queries} tokens (${hitRate})`], ["evictions", c.num_evictions],
    ["preemptions", `${c.num_preemptions_total} (${c.num_preemptions_swap_total} swap)`],
    ["CoW copies", c.num_cow_copies_total],
    ["swapped out / in", `${c.num_swapped_out_blocks_total} / ${c.num_swapped_in_blocks_total} blocks`],
    ["generated", `${e.generation_tokens_total} tokens`],
  ];
  const box = $("summary");
  box.textContent = "";
  for (const [label, value] of items) {
    const span = document.createElement("span");
    span.append(label + ": ");
    const b = document.createElement("b");
    b.textContent = value;
    span.appendChild(b);
    box.appendChild(span);
  }
  $("poolinfo").textContent = `${snap.num_blocks} blocks x ${snap.block_size} tokens` +
    (snap.prefix_caching ? ", prefix caching on" : ", prefix caching off");
  $("model").textContent = snap.model || "";
}

function renderRequests(snap) {
  const body = document.querySelector("#requests tbody");
  body.textContent = "";
  const ids = Object.keys(snap.requests);
  for (const id of ids.slice(0, MAX_TABLE_ROWS)) {
    const r = snap.requests[id];
    const row = body.insertRow();
    const blocks = r.block_ids.join(" ") + (r.swapped_block_ids.length ?
      `  (host: ${r.swapped_block_ids.join(" ")})` : "");
    const tokens = r.num_tokens === null ? "" : `${r.num_tokens} (${r.num_computed_tokens})`;
    for (const [text, cls] of [[id, ""], [r.status || "", ""], [tokens, ""], [blocks, "ids"]]) {
      const cell = row.insertCell();
      cell.textContent = text;
      if (cls) cell.className = cls;
    }
  }
  if (ids.length > MAX_TABLE_ROWS) {
    body.insertRow().insertCell().textContent = `... and ${ids.length - MAX_TABLE_ROWS} more`;
  }
}

function record(snap) {
  const c = snap.counters, e = snap.engine, prev = history_[history_.length - 1];
  const point = {t: snap.time, running: c.num_running, waiting: c.num_waiting, usage: 100 * c.kv_cache_usage,
                 hits: c.prefix_cache_hits, queries: c.prefix_cache_queries, gen: e.generation_tokens_total,
                 p50: e.ttft_p50_s, p99: e.ttft_p99_s, throughput: null, hitRate: null};
  if (prev && point.t > prev.t && point.gen >= prev.gen) {
    point.throughput = (point.gen - prev.gen) / (point.t - prev.t);
  }
  // Hit rate over the last few seconds of lookups; carried over while nothing is looked up.
  let base = prev;
  for (let i = history_.length - 1; i >= 0 && point.t - history_[i].t <= HIT_RATE_WINDOW_S; i--) base = history_[i];
  if (base && point.queries > base.queries) {
    point.hitRate = 100 * (point.hits - base.hits) / (point.queries - base.queries);
  } else {
    point.hitRate = prev ? prev.hitRate : (point.queries ? 100 * point.hits / point.queries : null);
  }
  history_.push(point);
  if (history_.length > HISTORY) history_.shift();
}

function drawChart(id, keys, fixedMax) {
  const canvas = $(id), ctx = canvas.getContext("2d");
  const w = canvas.width, h = canvas.height, top = 14, bottom = h - 4;
  const colors = ["#2a7ab0", "#d35400"];
  ctx.clearRect(0, 0, w, h);
  let max = fixedMax || 0;
  if (!fixedMax) {
    for (const p of history_) for (const k of keys) if (p[k] !== null && p[k] > max) max = p[k];
    max = max > 0 ? max * 1.15 : 1;
  }
  ctx.strokeStyle = "#eee";
  ctx.beginPath(); ctx.moveTo(0, top); ctx.lineTo(w, top); ctx.moveTo(0, bottom); ctx.lineTo(w, bottom); ctx.stroke();
  const step = w / (HISTORY - 1), offset = HISTORY - history_.length;
  keys.forEach((k, j) => {
    ctx.strokeStyle = colors[j];
    ctx.lineWidth = 1.5;
    ctx.beginPath();
    let pen = false;
    history_.forEach((p, i) => {
      if (p[k] === null || p[k] === undefined) { pen = false; return; }
      const x = (offset + i) * step, y = bottom - (bottom - top) * Math.min(p[k] / max, 1);
      if (pen) ctx.lineTo(x, y); else ctx.moveTo(x, y);
      pen = true;
    });
    ctx.stroke();
  });
  ctx.fillStyle = "#777";
  ctx.font = "10px sans-serif";
  ctx.fillText(fmt(max), 2, 10);
  const last = history_[history_.length - 1];
  if (last) {
    const text = keys.map((k) => fmt(last[k])).join(" / ");
    ctx.fillStyle = "#222";
    ctx.fillText(text, w - ctx.measureText(text).width - 2, 10);
  }
}

function fmt(x) {
  if (x === null || x === undefined) return "-";
  if (Math.abs(x) >= 100) return x.toFixed(0);
  if (Math.abs(x) >= 1) return x.toFixed(1);
  return x.toPrecision(2);
}

function render(snap) {
  renderBlocks(grid, snap.blocks, cells);
  renderBlocks(swappedGrid, snap.swapped, swappedCells);
  $("swapped-title").hidden = snap.swapped.length === 0;
  renderSummary(snap);
  renderRequests(snap);
  record(snap);
  drawChart("chart-requests", ["running", "waiting"]);
  drawChart("chart-usage", ["usage"], 100);
  drawChart("chart-hits", ["hitRate"], 100);
  drawChart("chart-throughput", ["throughput"]);
  drawChart("chart-ttft", ["p50", "p99"]);
  numUpdates += 1;
  // For tests and scripts: which snapshot the DOM shows.
  document.body.dataset.seq = snap.seq;
  document.body.dataset.updates = numUpdates;
  document.body.dataset.numBlocks = snap.num_blocks;
}

async function poll() {
  try {
    const resp = await fetch("/debug/kv", {cache: "no-store", credentials: "same-origin"});
    if (resp.status === 401) {  // the key changed (server restarted): log in again
      location.assign("/dashboard/login");
      return;
    }
    if (!resp.ok) throw new Error(`HTTP ${resp.status}`);
    const snap = await resp.json();
    // Pages polling faster than the server renews its snapshot get the same one again: draw it once.
    if (String(snap.seq) !== document.body.dataset.seq) render(snap);
    setStatus(`live, snapshot ${document.body.dataset.seq}, ${new Date().toLocaleTimeString()}`, false);
  } catch (err) {
    setStatus(`no snapshot: ${err.message}`, true);
  }
  setTimeout(poll, INTERVAL_MS);
}

poll();
