// The distbelief dashboard: plain JavaScript, no libraries, no CDN (it works offline).
// Data comes from the REST API with the bearer token the user enters (kept in sessionStorage); live curves
// come from the job's server-sent events, read with fetch() so the token travels in a header, not the URL.
// Everything the server sends is put on the page with textContent, never parsed as HTML.
"use strict";

const TOKEN_KEY = "distbelief-token";
const FINAL = new Set(["succeeded", "failed", "cancelled"]);
const DEFAULT_OPTIONS = {
  "sandblaster-lbfgs": { maxiter: 100, l2: 0.001 },
  "sandblaster-cg": { maxiter: 100, l2: 0.001 },
  "sandblaster-gd": { maxiter: 100, l2: 0.001 },
  "sandblaster-owlqn": { maxiter: 100, l1: 0.001 },
  "downpour-sgd": { rule: "adagrad", lr: 0.1, replicas: 2, epochs: 5, l2: 0.001 },
};

const state = {
  token: sessionStorage.getItem(TOKEN_KEY) || "",
  models: [],
  datasets: [],
  timers: [],
  stream: null, // AbortController of the open event stream
  job: null, // {id, record, dim, columns, rows}
};

// ---------------------------------------------------------------------------------------------- helpers

function $(id) {
  return document.getElementById(id);
}

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v === null || v === undefined || v === false) continue;
    if (k === "class") node.className = v;
    else if (k.startsWith("on")) node.addEventListener(k.slice(2), v);
    else node.setAttribute(k, v === true ? "" : String(v));
  }
  for (const child of children) {
    if (child === null || child === undefined) continue;
    node.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return node;
}

function svgEl(tag, attrs, text) {
  const node = document.createElementNS("http://www.w3.org/2000/svg", tag);
  for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, String(v));
  if (text !== undefined) node.textContent = text;
  return node;
}

function fmt(value) {
  if (value === null || value === undefined) return "";
  if (typeof value === "number") {
    if (Number.isInteger(value)) return String(value);
    const a = Math.abs(value);
    return a !== 0 && (a < 1e-3 || a >= 1e6) ? value.toExponential(4) : value.toPrecision(6);
  }
  if (typeof value === "object") return JSON.stringify(value);
  return String(value);
}

function showBanner(text) {
  const banner = $("banner");
  banner.textContent = text || "";
  banner.hidden = !text;
}

class ApiError extends Error {
  constructor(status, detail) {
    super(detail);
    this.status = status;
  }
}

function headers(extra) {
  const h = Object.assign({}, extra || {});
  if (state.token) h.Authorization = "Bearer " + state.token;
  return h;
}

async function api(path, options) {
  const opts = Object.assign({}, options || {});
  opts.headers = headers(opts.headers);
  const response = await fetch(path, opts);
  if (!response.ok) {
    let detail = response.statusText;
    try {
      const body = await response.json();
      if (body && body.detail) detail = typeof body.detail === "string" ? body.detail : JSON.stringify(body.detail);
    } catch (_) {
      /* not JSON */
    }
    if (response.status === 401) {
      showBanner("The API needs a token: enter DISTBELIEF_API_TOKEN at the top right. (" + detail + ")");
    }
    throw new ApiError(response.status, detail);
  }
  showBanner("");
  const type = response.headers.get("content-type") || "";
  return type.includes("application/json") ? response.json() : response;
}

function every(ms, fn) {
  fn();
  state.timers.push(setInterval(fn, ms));
}

function stopTimers() {
  for (const t of state.timers) clearInterval(t);
  state.timers = [];
  if (state.stream) state.stream.abort();
  state.stream = null;
}

function setRows(tbody, rows) {
  tbody.replaceChildren(...rows);
}

// What the numbers are, where the name alone could mislead. The same name means another thing by algorithm
// and by place: in Downpour's progress rows train_loss is the loss of its recent mini-batches; in a job's
// result (every algorithm) it is the mean data loss of the final parameters on every training row; Sandblaster
// records no train_loss while it runs (its objective is F(w) on every row at each iterate).
const LABELS = {
  common: {
    objective: "F(w) train",
    grad_norm: "gradient norm max|∇F|",
  },
  sandblaster: {
    fun: "F(w) as the optimizer computed it",
    step: "line-search step",
    nfev: "objective evaluations",
  },
  downpour: {
    train_loss: "running mini-batch loss",
    test_loss: "held-out loss",
    test_accuracy: "held-out accuracy",
    staleness_mean: "mean staleness of the pushes (versions)",
    staleness_max: "largest staleness of the pushes (versions)",
  },
  result: {
    objective: "F(w) train at the final parameters",
    train_loss: "mean data loss on the training rows (no penalty)",
    train_accuracy: "training accuracy",
    eval_loss: "held-out loss",
    eval_accuracy: "held-out accuracy",
  },
};

// The labels of the job on the page: "result" for its result table, else its algorithm's progress rows.
function labelsFor(where) {
  const record = state.job && state.job.record;
  const family = record && record.algorithm.startsWith("downpour") ? "downpour" : "sandblaster";
  return Object.assign({}, LABELS.common, LABELS[family], where === "result" ? LABELS.result : {});
}

function label(name, where) {
  const text = labelsFor(where)[name];
  return text ? `${text} (${name})` : name;
}

// A value as a node: a nested object as a table of its own (a mapping of records, such as per-replica
// counters, or a list of them as rows of a grid), a list of numbers as one line; never one raw JSON string.
function valueNode(value) {
  if (value === null || typeof value !== "object") return document.createTextNode(fmt(value));
  const isRecord = (v) => v !== null && typeof v === "object" && !Array.isArray(v);
  const entries = Array.isArray(value) ? value.map((v, i) => [String(i), v]) : Object.entries(value);
  if (!entries.length) return document.createTextNode(Array.isArray(value) ? "none" : "");
  if (entries.every(([, v]) => !isRecord(v) && !Array.isArray(v))) {
    if (Array.isArray(value)) return document.createTextNode(value.map(fmt).join(", "));
  } else if (entries.every(([, v]) => isRecord(v))) {
    const columns = [...new Set(entries.flatMap(([, v]) => Object.keys(v)))];
    return el(
      "table",
      { class: "grid nested" },
      el("thead", null, el("tr", null, el("th", null, ""), ...columns.map((c) => el("th", null, c)))),
      el("tbody", null, ...entries.map(([k, v]) => el("tr", { "data-key": k }, el("th", null, k), ...columns.map((c) => el("td", null, valueNode(v[c])))))),
    );
  }
  return el("table", { class: "kv nested" }, el("tbody", null, ...entries.map(([k, v]) => el("tr", { "data-key": k }, el("td", null, k), el("td", null, valueNode(v))))));
}

// A progress row without the held-out columns of a job that has no held-out data (they stay empty).
function latestOf(obj) {
  const record = state.job && state.job.record;
  if (!obj || (record && record.eval_dataset)) return obj;
  return Object.fromEntries(Object.entries(obj).filter(([k]) => !/^(test|eval|heldout)_/.test(k)));
}

function kvRows(obj, where) {
  return Object.entries(obj || {}).map(([k, v]) => el("tr", { "data-key": k }, el("td", null, label(k, where)), el("td", null, valueNode(v))));
}

async function download(path, filename) {
  let response;
  try {
    response = await api(path);
  } catch (e) {
    $("job-message").textContent = e.message; // e.g. a job that failed before it had parameters
    return;
  }
  const blob = await response.blob();
  const url = URL.createObjectURL(blob);
  const a = el("a", { href: url, download: filename });
  document.body.append(a);
  a.click();
  a.remove();
  setTimeout(() => URL.revokeObjectURL(url), 10000);
}

// ---------------------------------------------------------------------------------------------- charts

function tickLabel(t) {
  const v = Number(t.toPrecision(6));
  const a = Math.abs(v);
  return a !== 0 && (a < 1e-3 || a >= 1e6) ? v.toExponential(1) : String(v);
}

// A log scale where the values are positive and span more than a factor of 20 (a loss falling fast).
function wantsLog(series) {
  const ys = series.flatMap((s) => s.ys).filter((y) => y !== null && Number.isFinite(y));
  return ys.length > 1 && Math.min(...ys) > 0 && Math.max(...ys) / Math.min(...ys) > 20;
}

function niceTicks(lo, hi, count) {
  if (!(hi > lo)) {
    const pad = Math.abs(lo) * 0.1 || 1;
    lo -= pad;
    hi += pad;
  }
  const raw = (hi - lo) / count;
  const mag = Math.pow(10, Math.floor(Math.log10(raw)));
  const step = [1, 2, 5, 10].map((m) => m * mag).find((s) => s >= raw) || raw;
  const ticks = [];
  for (let t = Math.ceil(lo / step) * step; t <= hi + step * 1e-9; t += step) ticks.push(t);
  return { lo: Math.min(lo, ticks[0]), hi: Math.max(hi, ticks[ticks.length - 1]), ticks };
}

// series: [{name, xs, ys}] drawn as polylines; log: plot log10(y) (only positive values).
function drawChart(svg, legend, series, log) {
  const width = Math.max(320, Math.round(svg.clientWidth || 640));
  const height = Math.max(200, Math.round(svg.clientHeight || 280));
  svg.setAttribute("viewBox", `0 0 ${width} ${height}`);
  const m = { left: 64, right: 14, top: 12, bottom: 34 };
  const pts = series.map((s) => {
    const out = [];
    for (let i = 0; i < s.xs.length; i++) {
      let y = s.ys[i];
      if (y === null || y === undefined || !Number.isFinite(y)) continue;
      if (log) {
        if (y <= 0) continue;
        y = Math.log10(y);
      }
      out.push([s.xs[i], y]);
    }
    return out;
  });
  const all = pts.flat();
  const nodes = [];
  if (!all.length) {
    // "waiting" only while the job can still record something.
    const waiting = !(state.job && state.job.record && FINAL.has(state.job.record.status));
    nodes.push(svgEl("text", { x: width / 2, y: height / 2, "text-anchor": "middle", class: "empty" }, waiting ? "waiting for data…" : "nothing was recorded"));
    svg.replaceChildren(...nodes);
    legend.replaceChildren();
    return;
  }
  const xs = all.map((p) => p[0]);
  const ys = all.map((p) => p[1]);
  const xt = niceTicks(Math.min(...xs), Math.max(...xs), 6);
  const yt = log
    ? niceTicks(Math.floor(Math.min(...ys)), Math.ceil(Math.max(...ys)), 5)
    : niceTicks(Math.min(...ys), Math.max(...ys), 5);
  const X = (x) => m.left + ((x - xt.lo) / (xt.hi - xt.lo || 1)) * (width - m.left - m.right);
  const Y = (y) => height - m.bottom - ((y - yt.lo) / (yt.hi - yt.lo || 1)) * (height - m.top - m.bottom);
  for (const t of yt.ticks) {
    nodes.push(svgEl("line", { class: "grid", x1: m.left, x2: width - m.right, y1: Y(t), y2: Y(t) }));
    const label = log ? "1e" + Math.round(t) : tickLabel(t);
    nodes.push(svgEl("text", { x: m.left - 6, y: Y(t) + 4, "text-anchor": "end" }, label));
  }
  for (const t of xt.ticks) {
    nodes.push(svgEl("line", { class: "grid", x1: X(t), x2: X(t), y1: m.top, y2: height - m.bottom }));
    nodes.push(svgEl("text", { x: X(t), y: height - m.bottom + 16, "text-anchor": "middle" }, tickLabel(t)));
  }
  nodes.push(svgEl("line", { class: "axis", x1: m.left, x2: width - m.right, y1: height - m.bottom, y2: height - m.bottom }));
  nodes.push(svgEl("line", { class: "axis", x1: m.left, x2: m.left, y1: m.top, y2: height - m.bottom }));
  nodes.push(svgEl("text", { x: width - m.right, y: height - 4, "text-anchor": "end" }, state.job ? state.job.dim : ""));
  pts.forEach((p, i) => {
    const points = p.map(([x, y]) => `${X(x).toFixed(1)},${Y(y).toFixed(1)}`).join(" ");
    nodes.push(svgEl("polyline", { class: `series s${i}`, points, "data-name": series[i].name, "data-n": p.length }));
  });
  svg.replaceChildren(...nodes);
  legend.replaceChildren(...series.map((s, i) => el("span", { class: `s${i}`, "data-name": s.name }, label(s.name) + (log ? " (log)" : ""))));
}

function column(name) {
  const job = state.job;
  const j = job.columns.indexOf(name);
  return j < 0 ? null : job.rows.map((r) => r[j]);
}

// Whether the job has held-out rows to show: it names a held-out dataset, and its rows carry a held-out
// value (Sandblaster and partitioned runs evaluate it once, at the end: their result has it).
function hasHeldOut(name) {
  const job = state.job;
  if (!job.record || !job.record.eval_dataset) return false;
  const values = column(name) || [];
  return values.some((v) => v !== null && Number.isFinite(v)) || !FINAL.has(job.record.status);
}

function drawJobCharts() {
  const job = state.job;
  if (!job) return;
  const xs = job.rows.map((r) => r[0]);
  const has = (n) => job.columns.includes(n);
  const heldOut = (n) => !/^(test|eval|heldout)_/.test(n) || hasHeldOut(n);
  const lossNames = ["objective", "loss", "train_loss", "training_loss", "eval_loss", "heldout_loss", "test_loss"].filter(has).filter(heldOut);
  const a = lossNames.map((n) => ({ name: n, xs, ys: column(n) }));
  $("chart-a-title").textContent = lossNames.includes("objective") ? "Objective F(w) on the training data" : "Loss";
  drawChart($("chart-a"), $("chart-a-legend"), a, wantsLog(a));
  const accNames = job.columns.filter((n) => n.includes("accuracy")).filter(heldOut);
  let title, series, log;
  if (accNames.length) {
    title = accNames.every((n) => /^(test|eval|heldout)_/.test(n)) ? "Held-out accuracy" : "Accuracy";
    series = accNames.map((n) => ({ name: n, xs, ys: column(n) }));
  } else if (has("grad_norm")) {
    title = "Gradient norm max|∇F|";
    series = [{ name: "grad_norm", xs, ys: column("grad_norm") }];
    log = true;
  } else {
    const names = ["staleness_mean", "staleness_max", "staleness"].filter(has);
    title = names.length ? "Staleness of the pushes (parameter versions)" : "";
    series = names.map((n) => ({ name: n, xs, ys: column(n) }));
  }
  $("chart-b-title").textContent = title;
  $("chart-b").closest("figure").hidden = !series.length;
  drawChart($("chart-b"), $("chart-b-legend"), series, Boolean(log));
}

// ---------------------------------------------------------------------------------------------- jobs list

function badge(status) {
  return el("span", { class: "badge " + status }, status);
}

async function refreshJobs() {
  const status = $("status-filter").value;
  let body;
  try {
    body = await api("/api/jobs?limit=200" + (status ? "&status=" + encodeURIComponent(status) : ""));
  } catch (_) {
    return;
  }
  $("job-count").textContent = `(${body.count})`;
  $("jobs-empty").hidden = body.count > 0;
  const rows = body.data.map((j) => {
    const latest = j.latest || {};
    const value = (j.result || {}).objective ?? latest.objective;
    const tr = el(
      "tr",
      { "data-id": j.id, "data-status": j.status },
      el("td", null, el("a", { href: "#/jobs/" + j.id }, j.name || j.id)),
      el("td", null, j.algorithm),
      el("td", null, j.model.kind),
      el("td", null, j.dataset),
      el("td", null, badge(j.status)),
      el("td", { class: "num" }, j.iterations),
      el("td", { class: "num" }, fmt(value)),
      el("td", null, (j.created_at || "").replace("T", " ").slice(0, 19)),
    );
    tr.addEventListener("click", (ev) => {
      if (ev.target.tagName !== "A") location.hash = "#/jobs/" + j.id;
    });
    return tr;
  });
  setRows($("jobs-table").tBodies[0], rows);
}

// ---------------------------------------------------------------------------------------------- submit form

function datasetOptions(select, allowNone) {
  const current = select.value;
  const opts = state.datasets.map((d) =>
    el("option", { value: d.name }, `${d.name} (${d.n_rows}×${d.n_features}${d.n_classes ? ", " + d.n_classes + " classes" : ""})`),
  );
  if (allowNone) opts.unshift(el("option", { value: "" }, "none"));
  select.replaceChildren(...opts);
  if ([...select.options].some((o) => o.value === current)) select.value = current;
}

async function loadCatalogues() {
  try {
    const [models, datasets] = await Promise.all([api("/api/models"), api("/api/datasets")]);
    state.models = models.data;
    state.datasets = datasets.data;
  } catch (_) {
    return;
  }
  const kind = $("f-kind");
  if (!kind.options.length) {
    kind.replaceChildren(...state.models.map((m) => el("option", { value: m.kind }, m.kind)));
    kind.value = state.models.some((m) => m.kind === "softmax") ? "softmax" : kind.value;
  }
  datasetOptions($("f-dataset"), false);
  datasetOptions($("f-eval"), true);
  // Re-rendered only when empty: a refresh must not undo what the user typed.
  if (!$("f-model-fields").querySelector("[data-type]")) renderModelFields();
}

function selectedDataset() {
  return state.datasets.find((d) => d.name === $("f-dataset").value);
}

// One input per field of the model kind's JSON schema (integers, booleans, enums, lists of integers).
function renderModelFields() {
  const model = state.models.find((m) => m.kind === $("f-kind").value);
  const box = $("f-model-fields");
  if (!model) return box.replaceChildren();
  const ds = selectedDataset();
  const fields = [];
  for (const [name, prop] of Object.entries(model.schema.properties || {})) {
    if (name === "kind") continue;
    let guess = prop.default;
    if (name === "n_features" && ds) guess = ds.n_features;
    if (name === "n_classes" && ds && ds.n_classes) guess = ds.n_classes;
    if (name === "layer_sizes" && ds) guess = [ds.n_features, 32, ds.n_classes || 2];
    let input;
    if (prop.type === "boolean") {
      input = el("input", { type: "checkbox", name, "data-type": "boolean" });
      input.checked = guess !== false;
      fields.push(el("label", { class: "check", title: prop.description || "" }, input, name));
      continue;
    }
    if (prop.enum) {
      input = el("select", { name, "data-type": "string" }, ...prop.enum.map((v) => el("option", { value: v }, v)));
      if (guess !== undefined) input.value = guess;
    } else if (prop.type === "array") {
      input = el("input", { name, "data-type": "int-list", value: (guess || []).join(", "), placeholder: "64, 32, 10" });
    } else {
      input = el("input", { name, type: "number", step: "1", "data-type": "integer", value: guess ?? "" });
    }
    fields.push(el("label", { title: prop.description || "" }, name, input));
  }
  box.replaceChildren(el("legend", null, model.kind), ...fields);
}

function modelSpec() {
  const spec = { kind: $("f-kind").value };
  for (const input of $("f-model-fields").querySelectorAll("[data-type]")) {
    const type = input.getAttribute("data-type");
    if (type === "boolean") spec[input.name] = input.checked;
    else if (type === "integer") spec[input.name] = input.value === "" ? undefined : Number(input.value);
    else if (type === "int-list") {
      const values = input.value.split(",").map((s) => s.trim()).filter(Boolean).map(Number);
      spec[input.name] = values.length ? values : undefined; // empty: the field's default
    }
    else spec[input.name] = input.value;
  }
  return spec;
}

function resetOptions() {
  $("f-options").value = JSON.stringify(DEFAULT_OPTIONS[$("f-algorithm").value] || {});
}

async function submitJob(ev) {
  ev.preventDefault();
  const error = $("submit-error");
  error.hidden = true;
  let options;
  try {
    options = JSON.parse($("f-options").value || "{}");
  } catch (e) {
    error.textContent = "Options must be a JSON object: " + e.message;
    error.hidden = false;
    return;
  }
  const form = ev.target;
  const body = {
    algorithm: $("f-algorithm").value,
    dataset: $("f-dataset").value,
    model: modelSpec(),
    options,
  };
  if ($("f-eval").value) body.eval_dataset = $("f-eval").value;
  if (form.elements.name.value.trim()) body.name = form.elements.name.value.trim();
  $("f-submit").disabled = true;
  try {
    const job = await api("/api/jobs", {
      method: "POST",
      headers: { "Content-Type": "application/json" },
      body: JSON.stringify(body),
    });
    location.hash = "#/jobs/" + job.id;
  } catch (e) {
    error.textContent = e.message;
    error.hidden = false;
  } finally {
    $("f-submit").disabled = false;
  }
}

// ---------------------------------------------------------------------------------------------- job page

function renderJob(record) {
  const job = state.job;
  job.record = record;
  $("job-title").textContent = record.name || "Job " + record.id;
  const status = $("job-status");
  status.className = "badge " + record.status;
  status.textContent = record.status;
  const limit = record.max_iterations ? " / " + record.max_iterations : "";
  $("job-progress").textContent = `${job.dim} ${record.iterations}${limit}`;
  $("job-message").textContent = record.message || "";
  $("job-cancel").hidden = FINAL.has(record.status);
  // A failed job keeps the parameters it reached (a diverged run's, say): the service serves them too.
  $("job-params").hidden = !FINAL.has(record.status);
  setRows(
    $("spec-table").tBodies[0],
    kvRows({
      id: record.id,
      algorithm: record.algorithm,
      model: record.model,
      dataset: record.dataset,
      "held-out dataset": record.eval_dataset || "none",
      created: record.created_at,
      started: record.started_at,
      finished: record.finished_at,
      "last checkpoint": record.checkpoint_iteration,
      restarts: record.restarts,
    }),
  );
  setRows($("options-table").tBodies[0], kvRows(record.options));
  const result = Object.assign({}, record.result || {});
  const stats = result.stats;
  delete result.stats;
  setRows($("result-table").tBodies[0], kvRows(result, "result"));
  // The run's statistics: a table of their own, nested ones as tables (was one raw JSON string).
  $("stats").hidden = !stats;
  setRows($("stats-table").tBodies[0], kvRows(stats || {}));
  setRows($("latest-table").tBodies[0], kvRows(latestOf(record.latest)));
  drawJobCharts(); // the held-out panel and the labels depend on the record
  renderPlacement(record.placement);
}

// Model parallelism: every replica as its group of partitions, with the worker each runs on (and, once the
// job has finished, what each did).
function renderPlacement(placement) {
  $("placement").hidden = !(placement && placement.length);
  if (!placement) return;
  const rows = [];
  for (const group of placement) {
    group.partitions.forEach((p, i) => {
      const cells = [];
      if (i === 0) cells.push(el("td", { rowspan: group.partitions.length }, "replica " + group.replica));
      cells.push(
        el("td", null, "partition " + p.partition),
        el("td", null, p.worker || ""),
        el("td", { class: "num" }, fmt(p.steps)),
        el("td", { class: "num" }, fmt(p.messages)),
        el("td", { class: "num" }, fmt(p.bytes)),
        el("td", { class: "num" }, p.param_bytes == null ? "" : fmt(p.param_bytes / 8)),
      );
      rows.push(el("tr", { class: i === 0 ? "replica-start" : "", "data-replica": group.replica, "data-partition": p.partition }, ...cells));
    });
  }
  setRows($("placement-table").tBodies[0], rows);
}

async function refreshActors() {
  const job = state.job;
  if (!job) return;
  let cluster;
  try {
    cluster = await api("/api/cluster");
  } catch (_) {
    return;
  }
  setDaskLink(cluster.dashboard_url);
  const mine = cluster.actors.filter((a) => a.job_id === job.id);
  $("actors-empty").hidden = mine.length > 0;
  setRows(
    $("actors-table").tBodies[0],
    mine.map((a) => el("tr", { "data-kind": a.kind }, el("td", null, a.kind), el("td", null, a.key), el("td", null, a.worker || ""), el("td", null, a.state))),
  );
}

function applyMetrics(data) {
  const job = state.job;
  if (data.reset) job.rows = [];
  job.dim = data.dim;
  job.columns = data.columns;
  for (const row of data.rows) job.rows.push(row);
  const last = job.rows[job.rows.length - 1];
  if (last && job.record) {
    const latest = Object.fromEntries(job.columns.map((c, i) => [c, last[i]]));
    const limit = job.record.max_iterations ? " / " + job.record.max_iterations : "";
    $("job-progress").textContent = `${job.dim} ${last[0]}${limit}`;
    setRows($("latest-table").tBodies[0], kvRows(latestOf(latest)));
  }
  drawJobCharts();
}

// Reads the text/event-stream body with fetch (EventSource cannot send the Authorization header).
async function followEvents(jobId) {
  const controller = new AbortController();
  state.stream = controller;
  let response;
  try {
    response = await fetch(`/api/jobs/${jobId}/events`, { headers: headers(), signal: controller.signal });
  } catch (_) {
    return;
  }
  if (!response.ok) {
    showBanner(`cannot follow job ${jobId}: HTTP ${response.status}`);
    return;
  }
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    let chunk;
    try {
      chunk = await reader.read();
    } catch (_) {
      return; // aborted: the page changed
    }
    if (chunk.done) break;
    buffer += decoder.decode(chunk.value, { stream: true });
    let cut;
    while ((cut = buffer.indexOf("\n\n")) >= 0) {
      const frame = buffer.slice(0, cut);
      buffer = buffer.slice(cut + 2);
      let event = "message";
      const data = [];
      for (const line of frame.split("\n")) {
        if (line.startsWith("event:")) event = line.slice(6).trim();
        else if (line.startsWith("data:")) data.push(line.slice(5).trim());
      }
      if (!data.length || state.job === null || state.job.id !== jobId) continue;
      const payload = JSON.parse(data.join("\n"));
      if (event === "metrics") applyMetrics(payload);
      else if (event === "status") renderJob(payload);
      else if (event === "end") refreshActors();
    }
  }
}

async function showJob(jobId) {
  state.job = { id: jobId, record: null, dim: "iteration", columns: [], rows: [] };
  drawJobCharts();
  try {
    renderJob(await api("/api/jobs/" + jobId));
  } catch (e) {
    $("job-title").textContent = "Job " + jobId;
    $("job-message").textContent = e.message;
    return;
  }
  followEvents(jobId);
  every(2000, () => {
    if (state.job && state.job.record && !FINAL.has(state.job.record.status)) refreshActors();
  });
  refreshActors();
}

// ---------------------------------------------------------------------------------------------- cluster page

function setDaskLink(url) {
  const link = $("dask-link");
  link.hidden = !url;
  if (url) link.href = url;
}

async function refreshCluster() {
  let c;
  try {
    c = await api("/api/cluster");
  } catch (_) {
    return;
  }
  setDaskLink(c.dashboard_url);
  setRows(
    $("cluster-summary").tBodies[0],
    kvRows({
      scheduler: c.scheduler,
      embedded: c.embedded ? "yes (LocalCluster)" : "no",
      "Dask dashboard": c.dashboard_url || "not available",
      "running jobs": c.running_jobs.join(", ") || "none",
      "queued jobs": c.queued_jobs,
      "jobs at once": c.max_concurrent_jobs,
    }),
  );
  setRows(
    $("workers-table").tBodies[0],
    c.workers.map((w) =>
      el("tr", null, el("td", null, w.address), el("td", null, w.name), el("td", { class: "num" }, w.nthreads),
        el("td", { class: "num" }, w.memory_limit ? (w.memory_limit / 2 ** 30).toFixed(1) + " GiB" : ""), el("td", { class: "num" }, w.actors)),
    ),
  );
  setRows(
    $("cluster-actors").tBodies[0],
    c.actors.map((a) =>
      el("tr", null, el("td", null, a.job_id ? el("a", { href: "#/jobs/" + a.job_id }, a.job_id) : ""), el("td", null, a.kind),
        el("td", null, a.key), el("td", null, a.worker || ""), el("td", null, a.state)),
    ),
  );
}

// ---------------------------------------------------------------------------------------------- routing

function route() {
  stopTimers();
  state.job = null;
  const hash = location.hash || "#/";
  const match = hash.match(/^#\/jobs\/([0-9a-f]+)$/);
  const view = match ? "job" : hash === "#/cluster" ? "cluster" : "jobs";
  for (const id of ["jobs", "job", "cluster"]) $("view-" + id).hidden = id !== view;
  for (const a of document.querySelectorAll("[data-nav]")) a.classList.toggle("active", a.getAttribute("data-nav") === view);
  if (view === "job") showJob(match[1]);
  else if (view === "cluster") every(2000, refreshCluster);
  else {
    every(1500, refreshJobs);
    loadCatalogues();
    every(10000, loadCatalogues);
  }
}

function init() {
  $("token-input").value = state.token;
  $("token-form").addEventListener("submit", (ev) => {
    ev.preventDefault();
    state.token = $("token-input").value.trim();
    sessionStorage.setItem(TOKEN_KEY, state.token);
    showBanner("");
    route();
  });
  $("status-filter").addEventListener("change", refreshJobs);
  $("f-algorithm").addEventListener("change", resetOptions);
  $("f-kind").addEventListener("change", renderModelFields);
  $("f-dataset").addEventListener("change", renderModelFields);
  $("submit-form").addEventListener("submit", submitJob);
  $("job-cancel").addEventListener("click", async () => {
    try {
      renderJob(await api(`/api/jobs/${state.job.id}/cancel`, { method: "POST" }));
    } catch (e) {
      $("job-message").textContent = e.message;
    }
  });
  $("job-params").addEventListener("click", () => download(`/api/jobs/${state.job.id}/params`, state.job.id + "-params.npy"));
  $("job-csv").addEventListener("click", () => download(`/api/jobs/${state.job.id}/metrics?format=csv`, state.job.id + "-metrics.csv"));
  window.addEventListener("hashchange", route);
  window.addEventListener("resize", drawJobCharts);
  resetOptions();
  route();
}

document.addEventListener("DOMContentLoaded", init);
