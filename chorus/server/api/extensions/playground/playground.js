// chorus playground: pick 1 to 4 models or ensembles, run one prompt on each side by side (streamed), and
// see how each ensemble reached its answer. It calls this server's own OpenAI-compatible API.
import { el, renderChoices, renderTrace } from "./traces.js";

const MAX_COLUMNS = 4;
const FIRST_VIEW = ["qwen2.5-coder-0.5b-instruct", "sc-default", "route-default"];  // checked on first load
const $ = (id) => document.getElementById(id);
const keyInput = $("api-key");
let cards = [];        // /v1/models data
let running = [];      // AbortControllers of the requests in flight
const histories = {};  // model -> messages so far (when "continue the chat" is on)

keyInput.value = sessionStorage.getItem("chorus-api-key") || "";
function saveKey() {
  sessionStorage.setItem("chorus-api-key", keyInput.value.trim());
  loadModels();
}
keyInput.addEventListener("change", saveKey);
$("key-form").addEventListener("submit", (ev) => { ev.preventDefault(); saveKey(); });

function headers() {
  const h = { "Content-Type": "application/json" };
  const key = keyInput.value.trim();
  if (key) h.Authorization = `Bearer ${key}`;
  return h;
}

function setStatus(text, isError = false) {
  const s = $("status");
  s.textContent = text;
  s.classList.toggle("error", isError);
}

// The API's error envelope as one line: "message (code, param)".
function errorText(body, status) {
  const e = body && body.error ? body.error : null;
  if (!e) return `HTTP ${status}`;
  const extra = [e.code, e.param && `param: ${e.param}`].filter(Boolean).join(", ");
  return `${status ? `${status}: ` : ""}${e.message}${extra ? ` (${extra})` : ""}`;
}

async function readError(resp) {
  try { return errorText(await resp.json(), resp.status); } catch { return `HTTP ${resp.status}`; }
}

async function loadModels() {
  const list = $("model-list");
  let resp;
  try {
    resp = await fetch("/v1/models", { headers: headers() });
  } catch (e) {
    setStatus(`Cannot reach the server: ${e.message}`, true);
    return;
  }
  if (!resp.ok) {
    list.replaceChildren();
    setStatus(await readError(resp) + (resp.status === 401 ? " - enter the API key above." : ""), true);
    return;
  }
  const body = await resp.json();
  const first = cards.length === 0;
  // the first view opens on ids that answer the newcomer questions well (docs/quickstart.md), where served
  const checked = new Set(first ? FIRST_VIEW : selected());
  cards = body.data.filter((c) => c.kind === "language_model" || c.kind === "ensemble" || c.kind === "scorer");
  list.replaceChildren(...cards.map((c) => el("label", { title: (c.ensemble ? c.ensemble.description : c.description) || "" },
    el("input", { type: "checkbox", value: c.id, checked: checked.has(c.id), "data-kind": c.kind }),
    ` ${c.id}`, el("span", { class: "kind", text: c.kind === "ensemble" ? c.ensemble.strategy : c.kind }))));
  list.querySelectorAll("input").forEach((box) => box.addEventListener("change", limitChecks));
  limitChecks();
  setStatus(`${cards.length} models and ensembles`);
}

function selected() {
  return [...document.querySelectorAll("#model-list input:checked")].map((b) => b.value);
}

function limitChecks() {
  const full = selected().length >= MAX_COLUMNS;
  document.querySelectorAll("#model-list input").forEach((b) => { b.disabled = full && !b.checked; });
}

const card = (id) => cards.find((c) => c.id === id) || { id, kind: "language_model" };

// Cost from the config's prices (per million tokens) as /v1/models reports them: a model's own usage, or
// each member call of an ensemble priced by its member's model. null when a model has no price.
function cost(id, usage, trace) {
  const price = (model) => card(model).pricing;
  const of = (model, u) => {
    const p = price(model);
    return p ? (u.prompt_tokens * p.prompt + u.completion_tokens * p.completion) / p.per_tokens : null;
  };
  if (!trace) return usage ? of(id, usage) : null;
  const modelOf = {};
  for (const m of trace.members || []) modelOf[m.label] = m.model;
  if (trace.aggregator) modelOf[trace.aggregator.label] = trace.aggregator.model;
  let total = 0;
  for (const [label, u] of Object.entries(trace.usage_by_member || {})) {
    const c = of(modelOf[label] || label, u);
    if (c === null) return null;
    total += c;
  }
  return total;
}

function column(id) {
  const c = card(id);
  const kind = c.kind === "ensemble" ? `ensemble: ${c.ensemble.strategy}` : c.kind;
  const col = el("article", { class: "column", "data-model": id, "aria-label": id },
    el("h2", {}, id, el("span", { class: "kind", text: kind })),
    el("div", { class: "history" }),
    el("div", { class: "output", "aria-live": "off" }),
    el("div", { class: "stats" }),
    el("div", { class: "error-box", role: "alert" }),
    el("div", { class: "trace-slot" }));
  return col;
}

function stat(col, name, value) {
  const stats = col.querySelector(".stats");
  let s = stats.querySelector(`[data-stat="${name}"]`);
  if (!s) { s = el("span", { "data-stat": name }); stats.append(s); }
  s.textContent = value;
}

function showUsage(col, id, usage, trace, t0, tFirst) {
  const now = performance.now();
  if (tFirst !== null) stat(col, "ttft", `first token ${Math.round(tFirst - t0)} ms`);
  stat(col, "latency", `total ${Math.round(now - t0)} ms`);
  if (usage) stat(col, "tokens", `${usage.prompt_tokens} + ${usage.completion_tokens} tokens`);
  const c = cost(id, usage, trace);
  stat(col, "cost", c === null ? "cost: no price" : `cost ${c.toFixed(6)}`);
}

// Server-sent events from a fetch body: yields each `data:` payload (the JSON chunks, then [DONE]).
async function* sse(resp) {
  const reader = resp.body.getReader();
  const decoder = new TextDecoder();
  let buf = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buf += decoder.decode(value, { stream: true });
    let cut;
    while ((cut = buf.indexOf("\n\n")) >= 0) {
      const event = buf.slice(0, cut);
      buf = buf.slice(cut + 2);
      const data = event.split("\n").filter((l) => l.startsWith("data:")).map((l) => l.slice(5).trim()).join("\n");
      if (data) yield data;
    }
  }
}

// A column is marked done (data-done) however its request ended: answered, refused, stopped or broken.
async function runChat(id, col, messages, opts, signal) {
  try { return await chat(id, col, messages, opts, signal); } finally { col.dataset.done = "true"; }
}

async function runChoices(id, col, question, choices, norm, signal) {
  try { await score(id, col, question, choices, norm, signal); } finally { col.dataset.done = "true"; }
}

async function chat(id, col, messages, opts, signal) {
  const c = card(id);
  const body = { model: id, messages, stream: true, stream_options: { include_usage: true },
                 max_tokens: opts.maxTokens, temperature: opts.temperature };
  if (c.kind === "ensemble") body.ensemble = { trace: true };
  const out = col.querySelector(".output");
  const t0 = performance.now();
  let tFirst = null, usage = null, trace = null, text = "";
  let resp;
  try {
    resp = await fetch("/v1/chat/completions", { method: "POST", headers: headers(), body: JSON.stringify(body), signal });
  } catch (e) {
    col.querySelector(".error-box").textContent = e.name === "AbortError" ? "stopped" : `network error: ${e.message}`;
    return null;
  }
  if (!resp.ok) {
    col.querySelector(".error-box").textContent = await readError(resp);
    showUsage(col, id, null, null, t0, null);
    return null;
  }
  try {
    for await (const data of sse(resp)) {
      if (data === "[DONE]") break;
      const chunk = JSON.parse(data);
      if (chunk.error) { col.querySelector(".error-box").textContent = errorText(chunk, ""); break; }
      for (const ch of chunk.choices || []) {
        const piece = ch.delta && ch.delta.content;
        if (piece) {
          if (tFirst === null) tFirst = performance.now();
          text += piece;
          out.textContent = text;
        }
      }
      if (chunk.usage) usage = chunk.usage;
      if (chunk.ensemble) trace = chunk.ensemble;
    }
  } catch (e) {
    col.querySelector(".error-box").textContent = e.name === "AbortError" ? "stopped" : `stream broke: ${e.message}`;
  }
  showUsage(col, id, usage, trace, t0, tFirst);
  if (trace) col.querySelector(".trace-slot").replaceChildren(renderTrace(trace, text));
  return text;
}

async function score(id, col, question, choices, norm, signal) {
  const c = card(id);
  const body = { model: id, prompt: question, choices };
  if (c.kind === "ensemble") body.trace = true;
  const t0 = performance.now();
  let resp;
  try {
    resp = await fetch("/v1/choices", { method: "POST", headers: headers(), body: JSON.stringify(body), signal });
  } catch (e) {
    col.querySelector(".error-box").textContent = `network error: ${e.message}`;
    return;
  }
  if (!resp.ok) {
    col.querySelector(".error-box").textContent = await readError(resp);
    return;
  }
  const result = await resp.json();
  const trace = result.ensemble || null;
  if (trace && !Array.isArray(trace.scores) && trace.members) {
    // combined per token (logit_average): the members' own distributions come from asking each of them
    trace.scores = await Promise.all(trace.members.map(async (m) => {
      const r = await fetch("/v1/choices", { method: "POST", headers: headers(), signal,
                                             body: JSON.stringify({ model: m.model, prompt: question, choices }) });
      const b = r.ok ? await r.json() : null;
      return { member: m.label, asked_alone: true,
               probabilities: b ? Object.fromEntries(Object.keys(b.choices[0].probabilities).map(
                 (n) => [n, b.choices.map((c) => c.probabilities[n])])) : null };
    }));
  }
  showUsage(col, id, result.usage, trace, t0, null);
  const draw = () => col.querySelector(".trace-slot").replaceChildren(renderChoices(result, choices, $("normalisation").value));
  draw();
  col.redraw = draw;
}

function prepareColumns(ids) {
  const area = $("columns");
  const same = [...area.children].map((c) => c.dataset.model).join("\n") === ids.join("\n");
  if (!same) area.replaceChildren(...ids.map(column));
  for (const col of area.children) {
    col.querySelector(".output").textContent = "";
    col.querySelector(".error-box").textContent = "";
    col.querySelector(".stats").replaceChildren();
    col.querySelector(".trace-slot").replaceChildren();
    delete col.dataset.done;
  }
  return [...area.children];
}

function pickOrComplain() {
  const ids = selected();
  if (!ids.length) { setStatus("Pick at least one model or ensemble.", true); return null; }
  return ids;
}

function finish(started) {
  running = [];
  $("stop").disabled = true;
  setStatus(`done in ${Math.round(performance.now() - started)} ms`);
}

$("chat-form").addEventListener("submit", async (ev) => {
  ev.preventDefault();
  const ids = pickOrComplain();
  if (!ids) return;
  const prompt = $("prompt").value;
  if (!prompt.trim()) { setStatus("Write a prompt first.", true); return; }
  const system = $("system").value.trim();
  const keep = $("keep-chat").checked;
  const opts = { maxTokens: Number($("max-tokens").value) || undefined, temperature: Number($("temperature").value) };
  const cols = prepareColumns(ids);
  setStatus(`running ${ids.length}...`);
  $("stop").disabled = false;
  const started = performance.now();
  running = ids.map(() => new AbortController());
  await Promise.all(ids.map(async (id, i) => {
    const past = keep ? histories[id] || [] : [];
    const messages = [...(system && !past.length ? [{ role: "system", content: system }] : []), ...past,
                      { role: "user", content: prompt }];
    cols[i].querySelector(".history").textContent = past.filter((m) => m.role !== "system")
      .map((m) => `${m.role}: ${m.content}`).join("\n");
    const answer = await runChat(id, cols[i], messages, opts, running[i].signal);
    histories[id] = answer === null ? messages.slice(0, -1) : [...messages, { role: "assistant", content: answer }];
  }));
  finish(started);
});

$("choices-form").addEventListener("submit", async (ev) => {
  ev.preventDefault();
  const ids = pickOrComplain();
  if (!ids) return;
  const choices = $("choice-lines").value.split("\n").map((s) => s.trim()).filter(Boolean);
  const question = $("question").value;
  if (!question.trim() || !choices.length) { setStatus("Write a question and at least one choice.", true); return; }
  const cols = prepareColumns(ids);
  setStatus(`scoring on ${ids.length}...`);
  const started = performance.now();
  running = ids.map(() => new AbortController());
  await Promise.all(ids.map((id, i) => runChoices(id, cols[i], question, choices, $("normalisation").value,
                                                  running[i].signal)));
  finish(started);
});

$("normalisation").addEventListener("change", () => {
  for (const col of $("columns").children) if (col.redraw) col.redraw();
});

$("stop").addEventListener("click", () => running.forEach((c) => c.abort()));

// Ctrl/Cmd+Enter in a text box runs its form.
for (const id of ["prompt", "system", "question", "choice-lines"]) {
  $(id).addEventListener("keydown", (ev) => {
    if (ev.key === "Enter" && (ev.ctrlKey || ev.metaKey)) { ev.preventDefault(); ev.target.form.requestSubmit(); }
  });
}

// Tabs: click or arrow keys.
const tabs = [$("tab-chat"), $("tab-choices")];
function selectTab(tab) {
  for (const t of tabs) {
    const on = t === tab;
    t.setAttribute("aria-selected", String(on));
    t.tabIndex = on ? 0 : -1;
    $(t.getAttribute("aria-controls")).hidden = !on;
  }
  tab.focus();
}
tabs.forEach((t, i) => {
  t.addEventListener("click", () => selectTab(t));
  t.addEventListener("keydown", (ev) => {
    if (ev.key === "ArrowRight" || ev.key === "ArrowLeft") {
      ev.preventDefault();
      selectTab(tabs[(i + (ev.key === "ArrowRight" ? 1 : tabs.length - 1)) % tabs.length]);
    }
  });
});

loadModels();
