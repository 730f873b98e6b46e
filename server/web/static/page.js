// The live page: polls GET v1/status once a second and draws it; uploads an image to POST v1/predict.
// Only the public JSON routes are read, with URLs relative to the page, so it works on any replica and
// behind a path prefix. No dependencies, no build step: plain DOM and a hand-drawn SVG plot.
"use strict";

const POLL_MS = 1000;
const IDLE_AFTER_S = 5; // no sample learned for this long: the stream is idle, not live
const RATE_WINDOW_MS = 10000;
const TOP_K = 5;
const SVG_NS = "http://www.w3.org/2000/svg";
const PLOT = { width: 960, height: 300, left: 44, right: 16, top: 12, bottom: 38 };

const $ = (id) => document.getElementById(id);

/** A number for display, or an em dash for null/undefined: fmt(0.61234, 3) -> "0.612", fmt(null) -> "—". */
function fmt(x, digits = 0) {
  if (x === null || x === undefined || Number.isNaN(x)) return "—";
  return Number(x).toLocaleString("en-US", { minimumFractionDigits: digits, maximumFractionDigits: digits });
}

/** Element helper, so small trees read as one expression: el("li", {class: "x"}, "text") -> <li class="x">text</li>;
 *  content is a string or an array of child nodes; ns is the SVG namespace for plot elements. */
function el(tag, attrs = {}, content = null, ns = null) {
  const node = ns ? document.createElementNS(ns, tag) : document.createElement(tag);
  for (const [key, value] of Object.entries(attrs)) node.setAttribute(key, value);
  if (Array.isArray(content)) node.append(...content);
  else if (content !== null) node.textContent = content;
  return node;
}

/** Samples per second from successive samples_seen values, over the last RATE_WINDOW_MS (why: the API has no
 *  rate, and a one-poll difference is noisy). rate.push(now, 400) -> 12.5 once two polls exist, else null. */
const rate = {
  history: [],
  push(now, samples) {
    const last = this.history[this.history.length - 1];
    if (last && samples < last.samples) this.history = [];  // the learner restarted from an earlier checkpoint
    this.history.push({ now, samples });
    while (this.history.length > 2 && now - this.history[0].now > RATE_WINDOW_MS) this.history.shift();
    const first = this.history[0];
    return now > first.now ? (1000 * (samples - first.samples)) / (now - first.now) : null;
  },
};

/** The numbers row: every field tolerates null (nothing evaluated or predicted yet). */
function renderStats(s, samplesPerSecond) {
  const any = s.anytime_accuracy || {};
  const preq = s.prequential_accuracy || {};
  $("samples").textContent = fmt(s.samples_seen);
  $("rate").textContent = fmt(samplesPerSecond, 1);
  $("classes").textContent = fmt(s.classes_seen);
  $("a-auc").textContent = fmt(any.a_auc, 3);
  $("a-last").textContent = fmt(s.a_last, 3);
  $("novelty-auroc").textContent = fmt(any.novelty_auroc_mean, 3);  // telling classes not learned yet, so far
  $("novelty-threshold").textContent = fmt((s.novelty || {}).threshold, 1);
  $("prequential").textContent = fmt(preq.cumulative, 3);
  $("rolling").textContent = fmt(preq.rolling, 3);
  $("dead-letters").textContent = fmt(s.dead_lettered);
  $("drift-count").textContent = fmt((s.drift_events || []).length);
  $("model-version").textContent = fmt(s.model_version);
}

/** Whole-number ticks with a round step (1, 2 or 5 times a power of ten), about `count` of them over [0, max]:
 *  ticks(200) -> [0, 50, 100, 150, 200]. */
function ticks(max, count = 5) {
  const raw = Math.max(1, max / count);
  const power = 10 ** Math.floor(Math.log10(raw));
  const step = [1, 2, 5, 10].map((m) => m * power).find((s) => s >= raw);
  const out = [];
  for (let t = 0; t <= max + 1e-9; t += step) out.push(t);
  return out;
}

/** Axes and grid of the curve: x in samples learned, y in accuracy [0, 1]. Returns the data-to-pixel maps. */
function drawAxes(svg, xMax) {
  const w = PLOT.width - PLOT.left - PLOT.right;
  const h = PLOT.height - PLOT.top - PLOT.bottom;
  const x = (v) => PLOT.left + (w * v) / xMax;
  const y = (v) => PLOT.top + h * (1 - v);
  for (const v of [0, 0.25, 0.5, 0.75, 1]) {
    svg.append(el("line", { x1: x(0), x2: x(xMax), y1: y(v), y2: y(v), class: "grid" }, null, SVG_NS));
    svg.append(el("text", { x: PLOT.left - 6, y: y(v) + 4, class: "tick", "text-anchor": "end" }, fmt(v, 2), SVG_NS));
  }
  for (const v of ticks(xMax)) {
    svg.append(el("text", { x: x(v), y: y(0) + 16, class: "tick", "text-anchor": "middle" }, fmt(v), SVG_NS));
  }
  svg.append(el("text", { x: x(xMax / 2), y: PLOT.height - 4, class: "axis", "text-anchor": "middle" },
    "samples learned", SVG_NS));
  return { x, y };
}

/** A horizontal reference line across the plot (A_AUC, A_last); the legend under the plot names it. */
function drawLevel(svg, map, xMax, value, cls) {
  if (value === null || value === undefined) return;
  svg.append(el("line", { x1: map.x(0), x2: map.x(xMax), y1: map.y(value), y2: map.y(value), class: cls }, null, SVG_NS));
}

/** The any-time accuracy curve with its A_AUC (mean of the points) and A_last (accuracy when the stream went
 *  idle) as reference lines. svg.dataset.points tells tests and readers how many points are drawn. */
function renderCurve(s) {
  const any = s.anytime_accuracy || {};
  const xs = any.samples || [];
  const ys = any.accuracy || [];
  const svg = $("curve");
  svg.replaceChildren();
  svg.dataset.points = String(ys.length);
  $("curve-note").hidden = ys.length > 0;
  const xMax = Math.max(10, s.samples_seen || 0, ...xs);
  const map = drawAxes(svg, xMax);
  drawLevel(svg, map, xMax, any.a_auc, "auc");
  drawLevel(svg, map, xMax, s.a_last, "last");
  const points = xs.map((v, i) => `${map.x(v)},${map.y(ys[i])}`).join(" ");
  svg.append(el("polyline", { points, class: "curve" }, null, SVG_NS));
  xs.forEach((v, i) => {
    const dot = el("circle", { cx: map.x(v), cy: map.y(ys[i]), r: 4, class: "point" }, null, SVG_NS);
    dot.append(el("title", {}, `${fmt(v)} samples: ${fmt(ys[i], 3)}`, SVG_NS));
    svg.append(dot);
  });
}

/** The most recent drift events, newest first. */
function renderDrift(events) {
  const list = $("drift-list");
  if (!events || events.length === 0) {
    list.replaceChildren(el("li", { class: "note" }, "none so far"));
    return;
  }
  list.replaceChildren(...events.slice(-8).reverse().map((e) =>
    el("li", {}, `${e.detector || "detector"} at ${fmt(e.samples_seen)} samples (rolling accuracy ${fmt(e.rolling_accuracy, 3)})`)));
}

/** A table cell's text for any JSON value: null -> "—", objects as JSON. */
function cellText(v) {
  if (v === null || v === undefined) return "—";
  return typeof v === "object" ? JSON.stringify(v) : String(v);
}

/** A name -> object map (or a list) of /v1/status, `replicas` or `learners` (a learner in a group: its partitions,
 *  rate and lag), as a table in its panel, shown only when the field is there; the columns are the union of the
 *  objects' keys, so new fields show without a change here. */
function renderTable(id, name, entries) {
  $(`${id}-panel`).hidden = entries === undefined;
  if (entries === undefined) return;
  const rows = Array.isArray(entries) ? entries.map((r, i) => [String(i), r]) : Object.entries(entries || {});
  const isObject = (r) => r !== null && typeof r === "object";
  const keys = [...new Set(rows.flatMap(([, r]) => (isObject(r) ? Object.keys(r) : ["value"])))];
  const value = (r, k) => (isObject(r) ? r[k] : r);
  const header = el("tr", {}, [el("th", {}, name), ...keys.map((k) => el("th", {}, k))]);
  const body = rows.map(([key, r]) => el("tr", {}, [el("td", {}, key),
    ...keys.map((k) => el("td", {}, cellText(value(r, k))))]));
  $(id).replaceChildren(rows.length ? el("table", {}, [header, ...body]) : el("p", { class: "note" }, "none"));
}

/** Labels that come later (null: they come with their images): the accuracy of the predictions made on arrival,
 *  the label delay and the join's backlog. */
function renderLabels(join) {
  $("labels-panel").hidden = !join;
  if (!join) return;
  $("delayed-accuracy").textContent = fmt(join.delayed_accuracy, 3);
  $("delay-p50").textContent = fmt(join.delay_p50_s, 1);
  $("delay-p99").textContent = fmt(join.delay_p99_s, 1);
  $("images-waiting").textContent = fmt(join.images.waiting);
  $("labels-waiting").textContent = fmt(join.labels.waiting);
  $("images-expired").textContent = fmt(join.images.expired);
  $("labels-refused").textContent = fmt(join.labels.refused);
}

/** Corrections and deletions (null: not enabled): what was applied and refused, and the ids still correctable. */
function renderCorrections(c) {
  $("corrections-panel").hidden = !c;
  if (!c) return;
  for (const id of ["corrections-applied", "corrections-refused", "deletions-applied", "deletions-refused"]) {
    $(id).textContent = fmt(c[id.replace("-", "_")]);
  }
  $("correctable-ids").textContent = fmt(c.ids);
}

/** The header pill: live, idle (nothing learned for IDLE_AFTER_S), paused, disconnected from Kafka, or the
 *  learner's error. */
function renderConnection(s) {
  const pill = $("connection");
  const problem = s.learner_error ? `learner error: ${s.learner_error}`
    : s.follower_error ? `snapshot follower error: ${s.follower_error}`
    : s.kafka_connected === false ? "not connected to Kafka" : null;
  const idle = !s.paused && s.idle_seconds !== null && s.idle_seconds !== undefined && s.idle_seconds > IDLE_AFTER_S;
  pill.className = `pill ${problem ? "bad" : s.paused ? "warn" : idle ? "idle" : "ok"}`;
  pill.textContent = problem || (s.paused ? "learning paused"
    : idle ? `idle · nothing learned for ${fmt(s.idle_seconds, 0)} s` : "live");
  const age = s.checkpoint_age_seconds;
  $("status-detail").textContent = `updated ${new Date().toLocaleTimeString()}` +
    (age === null || age === undefined ? "" : ` · last checkpoint ${fmt(age, 0)} s ago`);
}

/** One poll of v1/status; the next is scheduled whatever happens, so the page recovers when the server does. */
async function poll() {
  try {
    const response = await fetch("v1/status", { cache: "no-store" });
    if (!response.ok) throw new Error(`HTTP ${response.status}`);
    const s = await response.json();
    renderStats(s, rate.push(performance.now(), s.samples_seen || 0));
    renderCurve(s);
    renderDrift(s.drift_events);
    renderTable("replicas", "replica", s.replicas);
    renderTable("learners", "learner", s.learners);
    renderLabels(s.label_join);
    renderCorrections(s.corrections);
    renderConnection(s);
  } catch (err) {
    $("connection").className = "pill bad";
    $("connection").textContent = `status unavailable (${err.message})`;
  } finally {
    setTimeout(poll, POLL_MS);
  }
}

/** One image's top-k as rows of name, a probability bar and the percentage. */
function topKList(topK) {
  return el("ol", { class: "top-k" }, topK.map((row) => {
    const bar = el("span", { class: "bar" });
    bar.style.width = `${Math.round(100 * row.probability)}%`;
    return el("li", {}, [el("span", { class: "name" }, row.name), el("span", { class: "track" }, [bar]),
      el("span", { class: "prob" }, `${fmt(100 * row.probability, 1)} %`)]);
  }));
}

/** The answer of a successful prediction: the image, its top-k, and which model answered. */
function renderAnswer(file, body) {
  const prediction = body.predictions[0];
  const image = el("img", { alt: file.name, class: "preview" });
  image.src = URL.createObjectURL(file);
  const meta = el("p", { class: "note" },
    `${prediction.filename} · model version ${fmt(body.model_version)} after ${fmt(body.samples_seen)} samples`);
  $("answer").replaceChildren(image, el("div", { id: "top-k" }, [meta, topKList(prediction.top_k)]));
}

/** A refused upload, readably: the API's 4xx/5xx JSON is {"error": message, "reason": code}. */
function renderError(status, body) {
  const reason = body && body.reason ? ` (${body.reason})` : "";
  const message = body && body.error ? body.error : "the server gave no explanation";
  $("answer").replaceChildren(el("p", { id: "upload-error", class: "error" },
    `Could not predict: HTTP ${status}${reason}: ${message}`));
}

/** POST one file as multipart `files` to v1/predict and show the answer or the error. */
async function upload(file) {
  $("answer").replaceChildren(el("p", { class: "note" }, `predicting ${file.name}…`));
  const form = new FormData();
  form.append("files", file, file.name);
  try {
    const response = await fetch(`v1/predict?top_k=${TOP_K}`, { method: "POST", body: form });
    const body = await response.json().catch(() => null);
    if (response.ok) renderAnswer(file, body);
    else renderError(response.status, body);
  } catch (err) {
    renderError("unreachable", { error: err.message });
  }
}

/** Drop zone and file input both end in upload(); dragging highlights the zone. */
function wireUpload() {
  const zone = $("drop-zone");
  const input = $("file-input");
  input.addEventListener("change", () => input.files.length && upload(input.files[0]));
  zone.addEventListener("dragover", (e) => { e.preventDefault(); zone.classList.add("over"); });
  zone.addEventListener("dragleave", () => zone.classList.remove("over"));
  zone.addEventListener("drop", (e) => {
    e.preventDefault();
    zone.classList.remove("over");
    if (e.dataTransfer.files.length) upload(e.dataTransfer.files[0]);
  });
}

wireUpload();
poll();
