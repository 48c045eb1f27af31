// How an ensemble answered, drawn from its trace (the response's `ensemble` object). One function per
// strategy; every number shown is the trace's own, also kept in a data-value attribute.

export function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (v === undefined || v === null || v === false) continue;
    if (k === "class") node.className = v;
    else if (k === "style") node.style.cssText = v;  // CSSOM: allowed by the page's CSP (style attributes are not)
    else if (k === "text") node.textContent = v;
    else node.setAttribute(k, v === true ? "" : String(v));
  }
  for (const c of children.flat()) if (c !== null && c !== undefined) node.append(c);
  return node;
}

const fmt = (x, d = 3) => (typeof x === "number" ? x.toFixed(d) : String(x ?? "-"));

function section(title, ...children) {
  return el("section", { class: "trace-part" }, el("h3", { text: title }), ...children);
}

function reason(trace) {
  const bits = [];
  if (trace.winner && trace.winner.member) bits.push(`winner: ${trace.winner.member}`);
  if (trace.reason) bits.push(trace.reason);
  return bits.length ? el("p", { class: "reason", text: bits.join(" - ") }) : null;
}

// Exchange-of-Thought: a timeline of rounds, each member's message and extracted answer.
function exchangeOfThought(t) {
  const rounds = (t.rounds || []).map((r) =>
    el("li", { "data-round": r.round },
      el("strong", { text: r.round === 0 ? "Round 0 (alone)" : `Round ${r.round}` }),
      el("div", { class: "agents" }, (r.agents || []).map((a) =>
        el("div", { class: "agent", "data-member": a.member },
          el("div", {}, el("strong", { text: a.member }),
            a.sees && a.sees.length ? el("span", { class: "help", text: ` sees ${a.sees.join(", ")}` }) : null),
          el("div", { class: "answer", "data-answer": a.answer ?? "",
                      text: `answer: ${a.answer === "" || a.answer == null ? "(none)" : a.answer}` +
                            (a.extracted !== undefined && a.extracted !== a.answer ? ` (said: ${a.extracted})` : "") }),
          el("div", { class: "text", text: a.text || "" }))))));
  return section(`Exchange-of-Thought: ${t.topology || "custom"}, ${(t.rounds || []).length} round(s)`,
    t.answer_type ? el("p", { class: "answer-type", "data-type": t.answer_type },
                       `answers compared as ${t.answer_type}` + (t.answer_rule ? ` (${t.answer_rule})` : "")) : null,
    el("ol", { class: "timeline" }, rounds),
    el("p", {}, "final answer: ", el("strong", { class: "final-answer", text: t.answer === "" ? "(none)" : t.answer })),
    reason(t));
}

// Crowd voting: the similarity matrix as a heatmap, the winner's row marked.
function crowdVote(t) {
  const cands = t.candidates || [];
  const sim = t.similarity || [];
  const win = t.winner ? t.winner.index : -1;
  const max = Math.max(1e-9, ...sim.flatMap((row, i) => row.filter((_, j) => j !== i)));
  const head = el("tr", {}, el("th", { text: "candidate" }),
    cands.map((c, j) => el("th", { scope: "col", text: `${j}` })), el("th", { text: "score" }));
  const rows = cands.map((c, i) => el("tr", { class: i === win ? "winner" : null, "data-index": i },
    el("td", { class: "name", text: `${i === win ? "\u2605 " : ""}${i}: ${c.member ?? "given"}` }),
    (sim[i] || []).map((v, j) => {
      const shade = i === j ? "transparent" : `rgba(36, 81, 179, ${(0.08 + 0.8 * v / max).toFixed(3)})`;
      return el("td", { class: "cell", "data-value": v, "data-row": i, "data-col": j,
                        style: `background:${shade};color:${v / max > 0.6 && i !== j ? "#fff" : "inherit"}`,
                        title: `similarity(${i}, ${j}) = ${v}`, text: i === j ? "-" : fmt(v, 2) });
    }),
    el("td", { class: "score", "data-value": t.scores ? t.scores[i] : "", text: fmt(t.scores ? t.scores[i] : null) })));
  const metric = Object.entries(t.metric || {}).map(([m, w]) => `${w} x ${m}`).join(" + ");
  return section(`Crowd vote (${metric})`,
    el("div", { class: "scroll" }, el("table", { class: "heatmap" }, el("thead", {}, head), el("tbody", {}, rows))),
    el("ol", { start: 0, class: "candidates" }, cands.map((c, i) =>
      el("li", { class: i === win ? "winner-mark" : null, text: `${c.member ?? "given"}: ${c.text}` }))),
    reason(t));
}

// Agreement 0 (red) .. 1 (green): the share of members whose own top-1 token was the chosen one.
export function agreementColour(a) {
  const hue = Math.round(120 * Math.max(0, Math.min(1, a)));
  return `hsl(${hue}, 70%, 85%)`;
}

function tokenDetail(tok) {
  return Object.keys(tok.p).map((m) =>
    `${m}: p=${fmt(tok.p[m])}; top ${tok.top[m].map(([s, p]) => `${JSON.stringify(s)} ${fmt(p)}`).join(", ")}`)
    .join("\n");
}

// Logit averaging: the answer's tokens coloured by member agreement; each member's top tokens on hover/focus.
function logitAverage(t) {
  const te = t.token_ensemble || {};
  const parts = [];
  const stats = `mode ${te.mode ?? t.align}; weights ${JSON.stringify(t.weights)}; ${te.positions ?? "?"} positions, ` +
                `${fmt((te.ensembled_share ?? 0) * 100, 0)}% ensembled`;
  parts.push(el("p", { class: "reason", text: stats }));
  if (te.tokens && te.tokens.length) {
    const detail = el("div", { class: "tok-detail", "aria-live": "polite" });
    const box = el("div", { class: "tokens" }, te.tokens.map((tok, i) => {
      const span = el("span", { class: "tok", tabindex: 0, "data-index": i, "data-agreement": tok.agreement,
                                style: `background:${agreementColour(tok.agreement)}`, title: tokenDetail(tok),
                                text: tok.text });
      const show = () => { detail.textContent = `${JSON.stringify(tok.text)} agreement ${tok.agreement}\n${tokenDetail(tok)}`; };
      span.addEventListener("mouseenter", show);
      span.addEventListener("focus", show);
      return span;
    }));
    parts.push(el("p", { class: "legend" }, "member agreement: ",
      el("span", { style: `background:${agreementColour(1)}`, text: "all top-1" }), " ",
      el("span", { style: `background:${agreementColour(0.5)}`, text: "some" }), " ",
      el("span", { style: `background:${agreementColour(0)}`, text: "none" })), box, detail);
  } else if (t.note) {
    parts.push(el("p", { class: "reason", text: t.note }));
  }
  return section(`Logit averaging (${t.align === "topk_union" ? "top-k union" : t.space})`, parts);
}

function memberScores(t) {
  const rows = [];
  const members = (t.members || []).map((m) => m.label);
  const scoreOf = {};
  if (t.predicted_correct) Object.assign(scoreOf, t.predicted_correct);
  else if (t.votes) Object.assign(scoreOf, t.votes);
  else if (t.weights && t.router === "random") members.forEach((m, i) => { scoreOf[m] = t.weights[i]; });
  const what = t.predicted_correct ? "predicted correct" : t.votes ? "similarity votes" :
               t.router === "random" ? "weight" : null;
  for (const m of members) {
    const won = t.winner && t.winner.member === m;
    rows.push(el("tr", { class: won ? "winner" : null, "data-member": m },
      el("td", { class: "name", text: `${won ? "\u2605 " : ""}${m}` }),
      what ? el("td", { class: "score", "data-value": scoreOf[m] ?? "", text: fmt(scoreOf[m]) }) : null));
  }
  return el("div", { class: "scroll" }, el("table", { class: "members" },
    el("thead", {}, el("tr", {}, el("th", { text: "member" }), what ? el("th", { text: what }) : null)),
    el("tbody", {}, rows)));
}

// Routers: the decision with each member's score.
function route(t) {
  const extra = t.router === "cost" ? el("p", { class: "reason",
    text: `difficulty ${fmt(t.score, 4)}; thresholds ${JSON.stringify(t.thresholds)}` }) : null;
  return section(`Router: ${t.router}`, memberScores(t), extra,
    t.fallback ? el("p", { class: "reason", text: `fallback: ${t.fallback}` }) : null, reason(t));
}

// Mixture-of-agents: each layer's proposals, then the aggregate.
function mixtureOfAgents(t, answer) {
  const quorum = (t.quorum && t.quorum.layers) || [];
  const layers = (t.layers || []).map((layer, i) => {
    const q = quorum[i];
    const late = q ? q.late.map((m) => el("div", { class: "proposal late", "data-member": m },
      el("strong", { text: m }), el("div", { class: "text", text: `late: cancelled after ${fmt(q.seconds[m], 2)} s` })))
      : [];
    return el("div", { class: "layer", "data-layer": i },
      el("strong", { text: `Layer ${i + 1}: proposals` + (q ? ` (quorum ${t.quorum.k} of ${t.quorum.of})` : "") }),
      el("div", { class: "agents" }, layer.map((p) => el("div", { class: "proposal", "data-member": p.member },
        el("strong", { text: p.member + (q && q.seconds[p.member] !== undefined ? ` (${fmt(q.seconds[p.member], 2)} s)`
                                                                               : "") }),
        el("div", { class: "text", text: p.text }))), ...late));
  });
  const judge = t.judge || {};
  const agg = judge.label || (t.aggregator ? t.aggregator.label : "aggregator");
  const head = judge.skipped ? `Judge skipped (${agg}): the proposals agree` : `Aggregate (${agg})`;
  return section("Mixture-of-agents", layers,
    judge.rationale ? el("div", { class: "rationale" }, el("strong", { text: "Judge's assessment" }),
                         el("div", { class: "text", text: judge.rationale })) : null,
    el("div", { class: "aggregate", "data-skipped": judge.skipped ? "true" : null }, el("strong", { text: head }),
      el("div", { class: "text", text: answer || "" })), reason(t));
}

// Cascades: the escalation path, each step's confidence against its threshold.
function cascade(t) {
  const items = [];
  (t.steps || []).forEach((s, i) => {
    if (i) items.push(el("li", { class: "arrow", "aria-hidden": "true", text: "\u2192" }));
    const accepted = (s.decision || "").startsWith("accepted");
    items.push(el("li", { class: `step${accepted ? " accepted" : ""}`, "data-member": s.member },
      el("strong", { text: s.member }),
      el("div", { "data-value": s.confidence, text: `${t.confidence}: ${fmt(s.confidence, 4)}` +
                                                    (s.threshold !== undefined ? ` vs ${s.threshold}` : "") }),
      el("div", { class: accepted ? "winner-mark" : "", text: s.decision || "" })));
  });
  return section("Cascade", el("ol", { class: "path" }, items), reason(t));
}

function usageTable(t) {
  const by = t.usage_by_member || {};
  const names = Object.keys(by);
  if (!names.length) return null;
  return el("details", {}, el("summary", { text: `usage by member (${names.length})` }),
    el("div", { class: "scroll" }, el("table", {},
      el("thead", {}, el("tr", {}, ["member", "calls", "prompt", "completion"].map((h) => el("th", { text: h })))),
      el("tbody", {}, names.map((n) => el("tr", {}, el("td", { class: "name", text: n }),
        el("td", { text: by[n].calls }), el("td", { text: by[n].prompt_tokens }),
        el("td", { text: by[n].completion_tokens })))))));
}

const VIEWS = {
  exchange_of_thought: exchangeOfThought, crowd_vote: crowdVote, logit_average: logitAverage, route,
  mixture_of_agents: mixtureOfAgents, cascade,
};

export function renderTrace(trace, answer) {
  const view = VIEWS[trace.strategy];
  const out = el("div", { class: "trace", "data-strategy": trace.strategy });
  if (view) out.append(view(trace, answer));
  else out.append(section(`Strategy: ${trace.strategy}`, reason(trace)));
  if (trace.errors && trace.errors.length) {
    out.append(el("ul", { class: "member-errors" },
      trace.errors.map((e) => el("li", { class: "error-box", text: `${e.member}: ${e.error}` }))));
  }
  out.append(usageTable(trace) || "");
  out.append(el("details", {}, el("summary", { text: "trace (JSON)" }),
    el("pre", { class: "raw", text: JSON.stringify(trace, null, 2) })));
  return out;
}

// Multiple choice: each choice's probability for the answer and for each member (from the trace).
export function renderChoices(body, choices, norm) {
  const trace = body.ensemble || null;
  const members = trace && Array.isArray(trace.scores) ? trace.scores : [];
  const chosen = body.chosen ? body.chosen[norm] : -1;
  const head = el("tr", {}, el("th", { text: "choice" }), el("th", { text: body.model }),
    members.map((m) => el("th", { text: m.asked_alone ? `${m.member} (alone)` : m.member })));
  const rows = choices.map((c, i) => {
    const p = body.choices[i].probabilities[norm];
    return el("tr", { class: i === chosen ? "winner" : null, "data-index": i },
      el("td", { class: "name", text: `${i === chosen ? "\u2605 " : ""}${c}` }),
      el("td", { class: "prob", "data-value": p },
        el("span", { class: "bar", style: `width:${(p * 4).toFixed(2)}em` }), fmt(p)),
      members.map((m) => {
        const q = m.probabilities && m.probabilities[norm] ? m.probabilities[norm][i] : null;
        return el("td", { class: "member-prob", "data-member": m.member, "data-value": q ?? "", text: fmt(q) });
      }));
  });
  const out = el("div", { class: "trace", "data-strategy": trace ? trace.strategy || "choices" : "choices" },
    el("div", { class: "scroll" }, el("table", { class: "choices" }, el("thead", {}, head), el("tbody", {}, rows))));
  if (trace) {
    if (trace.selector) out.append(el("p", { class: "reason", text: `selector ${trace.selector}` +
      (trace.fallback ? `: fell back to ${trace.fallback} (${trace.fallback_reason})` : "") }));
    if (trace.router) out.append(route(trace));
    out.append(el("details", {}, el("summary", { text: "trace (JSON)" }),
      el("pre", { class: "raw", text: JSON.stringify(trace, null, 2) })));
  }
  return out;
}
