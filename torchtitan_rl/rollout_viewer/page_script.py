"""The JavaScript of the rollout page (inlined into it: the page loads nothing).

It reads the records from the page's ``rollout-data`` JSON and draws everything from them: the
steps of the selected kind with their means, the step's histogram (reward; for evaluations the
number of correct samples of a prompt), the step's records as a table sorted by a clicked header
and narrowed by the search box, and the record a click opens. The view's state lives in the
location's hash (``#kind=rollouts&step=3&q=text&sort=reward&dir=desc&open=5``, ``open`` being the
record's index in its step file), so a link reopens the same view. Text goes into the page as
text (``textContent``), never as HTML.
"""

SCRIPT = r"""
"use strict";
const DATA = JSON.parse(document.getElementById("rollout-data").textContent);
const MAX_BARS = 12;       // distinct values up to this many get a bar each, else equal-width bins
const PROMPT_CHARS = 80;   // the end of a prompt shown in a table cell
const CELL_CHARS = 160;    // the start of a completion shown in a table cell
const HIDDEN_FIELDS = new Set(["kind", "prompt", "completion", "turns", "images", "greedy", "samples"]);

function num(x) {
  if (typeof x === "boolean") return x ? 1 : 0;
  return typeof x === "number" && Number.isFinite(x) ? x : null;
}
function fmt(x, digits = 3) {
  if (x === null || x === undefined) return "\u2013";
  if (typeof x === "boolean") return x ? "yes" : "no";
  if (typeof x === "number") return Number.isInteger(x) ? String(x) : x.toFixed(digits);
  return String(x);
}
function mean(values) {
  const v = values.map(num).filter((x) => x !== null);
  return v.length ? v.reduce((a, b) => a + b, 0) / v.length : null;
}
function oneLine(text) { return String(text ?? "").split(/\r?\n/).join("\u23ce"); }
function head(text, n) { const t = oneLine(text); return t.length > n ? t.slice(0, n - 1) + "\u2026" : t; }
function tail(text, n) { const t = oneLine(text); return t.length > n ? "\u2026" + t.slice(t.length - n + 1) : t; }
function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs)) {
    if (key === "class") node.className = value;
    else if (key === "text") node.textContent = value;
    else if (key.startsWith("on")) node.addEventListener(key.slice(2), value);
    else node.setAttribute(key, value);
  }
  for (const child of children) if (child !== null && child !== undefined) node.append(child);
  return node;
}
function svg(tag, attrs = {}, text = null) {
  const node = document.createElementNS("http://www.w3.org/2000/svg", tag);
  for (const [key, value] of Object.entries(attrs)) node.setAttribute(key, value);
  if (text !== null) node.textContent = text;
  return node;
}
function question(prompt) {
  // The last ChatML message not from the assistant (as the terminal table shows it), else the prompt.
  const text = String(prompt ?? "");
  let found = null;
  for (const m of text.matchAll(/<\|im_start\|>(\w+)\n([\s\S]*?)(?:<\|im_end\|>|$)/g)) {
    if (m[1] !== "assistant" && m[2].trim()) found = m[2].trim();
  }
  return found ?? text;
}
function correctMark(value) {
  if (value === null || value === undefined) return el("span", {text: "\u2013"});
  return el("span", {class: value ? "ok" : "no", text: value ? "\u2713" : "\u2717"});
}

const KINDS = {
  rollouts: {
    label: "Rollouts",
    histogram: {label: "reward", value: (r) => r.reward},
    steps: [
      {label: "rollouts", attr: "count", value: (rs) => rs.length},
      {label: "mean reward", attr: "mean-reward", value: (rs) => mean(rs.map((r) => r.reward))},
      {label: "mean adv.", attr: "mean-advantage", value: (rs) => mean(rs.map((r) => r.advantage))},
      {label: "correct", attr: "correct", value: (rs) => mean(rs.map((r) => r.correct))},
    ],
    columns: [
      {key: "index", label: "group/sample", value: (r, i) => i, text: (r) => `${r.group}/${r.sample}`},
      {key: "reward", label: "reward", value: (r) => num(r.reward)},
      {key: "advantage", label: "advantage", value: (r) => num(r.advantage)},
      {key: "length", label: "length", value: (r) => num(r.num_completion_tokens)},
      {key: "correct", label: "correct", value: (r) => num(r.correct), node: (r) => correctMark(r.correct)},
      {key: "turns", label: "turns", value: (r) => num(r.num_turns)},
      {key: "stop", label: "stop", value: (r) => r.end_reason || r.stop_reason || "", text: (r) => r.end_reason || r.stop_reason || ""},
      {key: "prompt", label: "prompt", value: (r) => r.prompt || "", text: (r) => tail(question(r.prompt), PROMPT_CHARS), cls: "text"},
      {key: "completion", label: "completion", value: (r) => r.completion || "", text: (r) => head(r.completion, CELL_CHARS), cls: "text"},
    ],
    texts: (r) => [r.prompt, r.completion],
    describe: (r) => `group ${r.group}, sample ${r.sample}`,
  },
  evals: {
    label: "Evaluations",
    histogram: {label: "correct samples", value: (r) => r.num_correct},
    steps: [
      {label: "prompts", attr: "count", value: (rs) => rs.length},
      {label: "pass@1", attr: "pass-1", value: (rs) => mean(rs.map((r) => r["pass@1"]))},
      {label: "pass@k", attr: "pass-k", value: (rs) => mean(rs.map((r) => r["pass@k"]))},
    ],
    columns: [
      {key: "index", label: "prompt #", value: (r, i) => i, text: (r) => String(r.prompt_index)},
      {key: "pass1", label: "pass@1", value: (r) => num(r["pass@1"])},
      {key: "passk", label: "pass@k", value: (r) => num(r["pass@k"])},
      {key: "correct", label: "correct of k", value: (r) => num(r.num_correct), text: (r) => `${r.num_correct}/${r.k}`},
      {key: "length", label: "length", value: (r) => num((r.greedy || {}).num_completion_tokens)},
      {key: "prompt", label: "prompt", value: (r) => r.prompt || "", text: (r) => tail(question(r.prompt), PROMPT_CHARS), cls: "text"},
      {key: "answer", label: "answer", value: (r) => String(r.answer ?? ""), text: (r) => head(r.answer ?? "", 40), cls: "text"},
      {key: "greedy", label: "greedy completion", value: (r) => (r.greedy || {}).completion || "", text: (r) => head((r.greedy || {}).completion, CELL_CHARS), cls: "text"},
    ],
    texts: (r) => [r.prompt, r.answer, (r.greedy || {}).completion, ...(r.samples || []).map((s) => s.completion)],
    describe: (r) => `prompt ${r.prompt_index}`,
  },
};

const state = {kind: "rollouts", step: null, q: "", sort: "index", dir: "asc", open: null};

function stepsOf(kind) { return DATA.kinds[kind] || []; }
function currentStep() { return stepsOf(state.kind).find((s) => s.step === state.step) || null; }

function readHash() {
  const params = new URLSearchParams(location.hash.slice(1));
  const kind = params.get("kind");
  if (kind in KINDS && stepsOf(kind).length) state.kind = kind;
  else if (!stepsOf(state.kind).length && stepsOf("evals").length) state.kind = "evals";
  const steps = stepsOf(state.kind);
  const step = Number(params.get("step"));
  state.step = params.has("step") && steps.some((s) => s.step === step) ? step : (steps.length ? steps[steps.length - 1].step : null);
  state.q = params.get("q") || "";
  const sort = params.get("sort");
  state.sort = KINDS[state.kind].columns.some((c) => c.key === sort) ? sort : "index";
  state.dir = params.get("dir") === "desc" ? "desc" : "asc";
  const open = Number(params.get("open"));
  const records = (currentStep() || {records: []}).records;
  state.open = params.has("open") && Number.isInteger(open) && open >= 0 && open < records.length ? open : null;
}

function writeHash() {
  const params = new URLSearchParams({kind: state.kind});
  if (state.step !== null) params.set("step", state.step);
  if (state.q) params.set("q", state.q);
  if (state.sort !== "index" || state.dir !== "asc") { params.set("sort", state.sort); params.set("dir", state.dir); }
  if (state.open !== null) params.set("open", state.open);
  try { history.replaceState(null, "", "#" + params.toString()); } catch (err) { /* some file:// setups refuse it */ }
}

function renderTabs() {
  const tabs = document.getElementById("tabs");
  tabs.replaceChildren();
  for (const [kind, spec] of Object.entries(KINDS)) {
    const steps = stepsOf(kind);
    const button = el("button", {class: "tab" + (kind === state.kind ? " active" : ""), "data-kind": kind,
      text: `${spec.label} (${steps.length} steps)`, onclick: () => selectKind(kind)});
    button.disabled = !steps.length;
    tabs.append(button);
  }
}

function renderSteps() {
  const spec = KINDS[state.kind];
  const table = document.getElementById("steps");
  table.replaceChildren(el("thead", {}, el("tr", {}, el("th", {text: "step"}), ...spec.steps.map((c) => el("th", {text: c.label})))));
  const body = el("tbody");
  for (const {step, records} of stepsOf(state.kind)) {
    const row = el("tr", {class: "step-row" + (step === state.step ? " selected" : ""), "data-step": step,
      onclick: () => selectStep(step)}, el("td", {class: "num", text: String(step)}));
    for (const column of spec.steps) {
      const value = column.value(records);
      row.setAttribute("data-" + column.attr, value === null ? "" : String(value));
      row.append(el("td", {class: "num", text: fmt(value)}));
    }
    body.append(row);
  }
  table.append(body);
}

function histogramBins(values) {
  const finite = values.map(num).filter((x) => x !== null);
  const distinct = [...new Set(finite)].sort((a, b) => a - b);
  if (distinct.length <= MAX_BARS) {
    return distinct.map((v) => ({lo: v, hi: v, count: finite.filter((x) => x === v).length}));
  }
  const lo = distinct[0], hi = distinct[distinct.length - 1];
  const edges = Array.from({length: MAX_BARS + 1}, (_, i) => (i === MAX_BARS ? hi : lo + ((hi - lo) * i) / MAX_BARS));
  // Bin i holds edges[i] <= x < edges[i + 1]; the last one holds its upper edge too.
  const bins = edges.slice(0, -1).map((edge, i) => ({lo: edge, hi: edges[i + 1], count: 0}));
  for (const x of finite) {
    const i = bins.findIndex((b) => x < b.hi);
    bins[i < 0 ? bins.length - 1 : i].count += 1;
  }
  return bins;
}

function renderHistogram(records) {
  const spec = KINDS[state.kind].histogram;
  const values = records.map(spec.value);
  const bins = histogramBins(values);
  const box = document.getElementById("histogram");
  box.replaceChildren();
  if (!bins.length) { box.append(el("p", {class: "empty", text: `no ${spec.label} values`})); return; }
  const width = 520, height = 150, left = 8, bottom = 30, top = 16;
  const slot = Math.min(64, (width - 2 * left) / bins.length);
  const tallest = Math.max(...bins.map((b) => b.count));
  const chart = svg("svg", {width, height, viewBox: `0 0 ${width} ${height}`, role: "img", "aria-label": `${spec.label} histogram`});
  bins.forEach((b, i) => {
    const h = ((height - bottom - top) * b.count) / tallest;
    const x = left + i * slot + 2, y = height - bottom - h;
    const range = b.lo === b.hi ? fmt(b.lo) : `${fmt(b.lo)}\u2013${fmt(b.hi)}`;
    const rect = svg("rect", {class: "bar", x, y, width: Math.max(1, slot - 4), height: h,
      "data-lo": String(b.lo), "data-hi": String(b.hi), "data-count": String(b.count)});
    rect.append(svg("title", {}, `${spec.label} ${range}: ${b.count}`));
    chart.append(rect);
    chart.append(svg("text", {x: x + (slot - 4) / 2, y: y - 3, "text-anchor": "middle"}, String(b.count)));
    chart.append(svg("text", {x: x + (slot - 4) / 2, y: height - bottom + 14, "text-anchor": "middle"}, fmt(b.lo, 2)));
  });
  chart.append(svg("text", {x: left + (slot * bins.length) / 2, y: height - 4, "text-anchor": "middle"}, spec.label));
  box.append(chart);
  const missing = values.length - bins.reduce((a, b) => a + b.count, 0);
  if (missing) box.append(el("p", {class: "summary", text: `${missing} without a value`}));
}

function visibleRows(records) {
  const spec = KINDS[state.kind];
  const q = state.q.toLowerCase();
  const rows = records.map((r, i) => ({r, i})).filter(({r}) => !q || spec.texts(r).some((t) => typeof t === "string" && t.toLowerCase().includes(q)));
  const column = spec.columns.find((c) => c.key === state.sort);
  const sign = state.dir === "desc" ? -1 : 1;
  rows.sort((a, b) => {
    const x = column.value(a.r, a.i), y = column.value(b.r, b.i);
    if (x === null || y === null) return (x === null) - (y === null) || a.i - b.i;  // no value: last
    const order = typeof x === "string" ? x.localeCompare(y) : x - y;
    return sign * order || a.i - b.i;
  });
  return rows;
}

function renderTable() {
  const spec = KINDS[state.kind];
  const step = currentStep();
  const records = step ? step.records : [];
  const table = document.getElementById("records");
  const headRow = el("tr");
  for (const column of spec.columns) {
    const sorted = column.key === state.sort ? " sorted-" + state.dir : "";
    headRow.append(el("th", {"data-sort": column.key, class: sorted.trim(), text: column.label, onclick: () => sortBy(column.key)}));
  }
  const body = el("tbody");
  const rows = visibleRows(records);
  for (const {r, i} of rows) {
    const row = el("tr", {class: "record" + (i === state.open ? " selected" : ""), "data-index": i, onclick: () => openRecord(i)});
    for (const column of spec.columns) {
      const cell = el("td", {class: column.cls || "num"});
      if (column.node) cell.append(column.node(r));
      else cell.textContent = column.text ? column.text(r) : fmt(column.value(r, i));
      if (column.cls === "text") cell.title = head(column.value(r, i), 400);
      row.append(cell);
    }
    body.append(row);
  }
  table.replaceChildren(el("thead", {}, headRow), body);
  document.getElementById("shown").textContent = `${rows.length} of ${records.length}`;
}

function renderStep() {
  const spec = KINDS[state.kind];
  const step = currentStep();
  const records = step ? step.records : [];
  document.getElementById("step-title").textContent = step ? `${spec.label}, step ${step.step}` : `no ${spec.label.toLowerCase()}`;
  document.getElementById("step-summary").textContent = spec.steps.map((c) => `${c.label}: ${fmt(c.value(records))}`).join(" \u00b7 ");
  renderHistogram(records);
  const search = document.getElementById("search");
  if (search.value !== state.q) search.value = state.q;
  renderTable();
}

function fieldList(record) {
  const list = el("dl", {class: "fields"});
  const add = (name, value) => list.append(el("dt", {text: name}), el("dd", {text: fmt(value, 4)}));
  for (const [key, value] of Object.entries(record)) {
    if (HIDDEN_FIELDS.has(key)) continue;
    if (value !== null && typeof value === "object" && !Array.isArray(value)) {
      for (const [inner, v] of Object.entries(value)) add(`${key}.${inner}`, v);
    } else add(key, Array.isArray(value) ? JSON.stringify(value) : value);
  }
  for (const image of record.images || []) add("image", `${image.source} (${image.where}, grid ${JSON.stringify(image.grid)})`);
  return list;
}

function turnList(turns) {
  const box = el("div", {class: "turns"});
  for (const [n, turn] of turns.entries()) {
    const tokens = turn.num_tokens;  // the page holds a turn's token count, not its ids
    box.append(el("div", {class: "turn " + (turn.trained ? "trained" : "untrained"), "data-role": turn.role, "data-turn": n},
      el("div", {class: "turn-head"}, el("span", {class: "role", text: turn.role}),
        el("span", {class: "badge", text: turn.trained ? "trained" : "not trained"}),
        el("span", {class: "summary", text: tokens === undefined ? "" : `${tokens} tokens`})),
      el("pre", {class: "turn-text", text: turn.text ?? ""})));
  }
  return box;
}

function evalAnswer(answer, label) {
  const kind = answer.correct ? "correct" : "wrong";
  return el("div", {class: `eval-answer ${kind}`, "data-which": label},
    el("div", {class: "turn-head"}, el("span", {class: "role", text: label}), correctMark(answer.correct),
      el("span", {text: `reward ${fmt(answer.reward)}`}), el("span", {text: `${fmt(answer.num_completion_tokens)} tokens`}),
      el("span", {text: answer.stop_reason || ""})),
    answer.turns ? turnList(answer.turns) : el("pre", {class: "completion", text: answer.completion ?? ""}));
}

function renderDetail() {
  const box = document.getElementById("detail");
  const step = currentStep();
  box.replaceChildren();
  document.querySelector("main").classList.toggle("with-detail", Boolean(step) && state.open !== null);
  if (!step || state.open === null) return;
  const record = step.records[state.open];
  box.append(el("button", {class: "close", text: "close", onclick: () => openRecord(null)}),
    el("h2", {text: `Step ${step.step}, ${KINDS[state.kind].describe(record)}`}), fieldList(record),
    el("h2", {text: "Prompt"}), el("pre", {id: "detail-prompt", text: record.prompt ?? ""}));
  if (state.kind === "evals") {
    box.append(el("h2", {text: "Greedy"}), evalAnswer(record.greedy || {}, "greedy"),
      el("h2", {text: `Samples (${(record.samples || []).length})`}),
      ...(record.samples || []).map((s, i) => evalAnswer(s, `sample ${i}`)));
  } else if (record.turns) {
    box.append(el("h2", {text: `Episode (${record.turns.length} turns)`}), turnList(record.turns));
  } else {
    box.append(el("h2", {text: "Completion"}), el("pre", {id: "detail-completion", text: record.completion ?? ""}));
  }
}

function render() { renderTabs(); renderSteps(); renderStep(); renderDetail(); writeHash(); }
function selectKind(kind) { state.kind = kind; state.sort = "index"; state.dir = "asc"; state.open = null;
  const steps = stepsOf(kind); state.step = steps.length ? steps[steps.length - 1].step : null; render(); }
function selectStep(step) { state.step = step; state.open = null; render(); }
function sortBy(key) {
  if (state.sort === key) state.dir = state.dir === "asc" ? "desc" : "asc";
  else { state.sort = key; state.dir = key === "index" ? "asc" : "desc"; }
  renderTable(); writeHash();
}
function openRecord(index) { state.open = index; renderTable(); renderDetail(); writeHash(); }

document.getElementById("title").textContent = DATA.title;
document.getElementById("search").addEventListener("input", (event) => { state.q = event.target.value; renderTable(); writeHash(); });
readHash();
render();
document.body.setAttribute("data-ready", "true");
"""
