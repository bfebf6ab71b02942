// The approval page: a thin client of the JSON API (same endpoints, same operator token).
// Every value from the server is inserted as text, never as HTML.
"use strict";

const API = "/api/v1";
const REFRESH_MS = 5000;
const GROUPS = [
  ["Needs a decision", ["awaiting_approval"]],
  ["Failed: a person must look", ["failed"]],
  ["Refused: not the job's own nodes, or the job could not be checked; nothing was done", ["refused"]],
  ["In progress", ["detected", "cordoned", "triaging", "approved", "replacing", "replaced", "dismissed"]],
  ["Closed", ["resumed", "joined", "uncordoned"]],
];
let pending = null;   // the decision awaiting confirmation: {decision, expect}
let current = null;   // the incident shown

function $(id) { return document.getElementById(id); }

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, v);
  for (const c of children) node.append(c instanceof Node ? c : String(c ?? ""));
  return node;
}

function svg(tag, attrs, text) {
  const node = document.createElementNS("http://www.w3.org/2000/svg", tag);
  for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, v);
  if (text !== undefined) node.textContent = text;
  return node;
}

function token() { return sessionStorage.getItem("replicheck.token") || ""; }

function say(text, ok) {
  const m = $("message");
  m.textContent = text;
  m.className = ok ? "ok" : "";
  m.hidden = !text;
}

async function api(method, path, body) {
  const headers = {"Authorization": "Bearer " + token()};
  if (body !== undefined) headers["Content-Type"] = "application/json";
  const res = await fetch(API + path, {method, headers, body: body === undefined ? undefined : JSON.stringify(body)});
  const data = await res.json().catch(() => ({}));
  if (!res.ok) {
    const msg = (data.error && data.error.message) || res.statusText;
    throw new Error(res.status + ": " + msg);
  }
  return data;
}

function table(id, head, rows) {
  const t = $(id);
  t.replaceChildren();
  if (!rows.length) { t.append(el("tr", {}, el("td", {class: "muted"}, "none"))); return; }
  t.append(el("tr", {}, ...head.map(h => el("th", {}, h))));
  for (const r of rows) t.append(el("tr", {}, ...r.map(c => el("td", c && c.cls ? {class: c.cls} : {}, c && c.cls ? c.text : text(c)))));
}

function kv(id, pairs) {
  const t = $(id);
  t.replaceChildren(...pairs.map(([k, v]) => el("tr", {}, el("th", {}, k), el("td", {}, v))));
}

async function signIn(ev) {
  if (ev) ev.preventDefault();
  const value = $("token").value.trim();
  if (value) sessionStorage.setItem("replicheck.token", value);
  if (!token()) return;
  try {
    const me = await api("GET", "/whoami");
    $("identity").textContent = me.shared ? "shared operator token" : "signed in as " + me.name;
    $("who-label").hidden = !me.shared;
    $("who").required = me.shared;
    $("who").value = $("who").value || sessionStorage.getItem("replicheck.who") || "";
    sessionStorage.setItem("replicheck.shared", me.shared ? "1" : "");
    say("");
    await refresh();
  } catch (err) {
    $("identity").textContent = "";
    say("Token refused: " + err.message);
  }
}

async function refresh() {
  if (!token()) return;
  const data = await api("GET", "/incidents");
  const list = $("list");
  list.replaceChildren();
  for (const [title, states] of GROUPS) {
    const items = data.incidents.filter(i => states.includes(i.state));
    if (!items.length) continue;
    const ul = el("ul");
    for (const i of items) {
      const a = el("a", {href: "#/incident/" + encodeURIComponent(i.id), "data-incident": i.id}, i.id);
      ul.append(el("li", {}, a, " ", el("span", {class: "badge " + i.state}, i.state), " ",
                   `job ${i.job_id}, ${i.classification}, node(s) ${i.nodes.join(", ") || "-"}: ${i.reason}`));
    }
    list.append(el("div", {class: "group"}, el("h3", {}, `${title} (${items.length})`), ul));
  }
  if (!data.incidents.length) list.append(el("p", {class: "muted"}, "No incidents."));
  if (data.rejected_inputs) list.append(el("p", {class: "bad"}, `${data.rejected_inputs} rejected input(s): replicheck incidents list --rejected`));
  const m = location.hash.match(/^#\/incident\/(.+)$/);
  if (m) await show(decodeURIComponent(m[1])); else $("detail").hidden = true;
}

// Every field of the detail view, emptied before another incident is drawn: a drawing that
// fails half way (odd evidence) must never leave the previous incident's tables, or its
// enabled Approve button, under the new heading.
function resetDetail() {
  current = null;
  $("decision").hidden = true;
  $("late-dismiss").hidden = true;
  $("confirm-row").hidden = true;
  for (const id of ["incident-id", "state", "status-line", "approve-text", "dismiss-text",
                    "late-dismiss-text", "evidence"]) $(id).textContent = "";
  for (const id of ["facts", "suspects", "pairs", "triage", "audit", "actions", "timeline"]) $(id).replaceChildren();
}

// Evidence is whatever the job sent: shown as text only, objects as their JSON.
function text(v) {
  if (v === null || v === undefined) return "";
  return typeof v === "object" ? JSON.stringify(v) : String(v);
}

function pairsOf(evidence) {
  const pairs = [];
  if (!evidence || typeof evidence !== "object") return pairs;
  for (const [check, ev] of Object.entries(evidence)) {
    if (!ev || typeof ev !== "object" || !Array.isArray(ev.pairs)) continue;
    for (const p of ev.pairs) if (p && typeof p === "object") pairs.push([check, p]);
  }
  return pairs;
}

async function show(id) {
  const d = await api("GET", "/incidents/" + encodeURIComponent(id));
  if (!pending) resetDetail();
  const inc = d.incident, rec = d.record;
  $("detail").hidden = false;
  $("incident-id").textContent = inc.id;
  $("state").textContent = rec.state;
  $("state").className = "badge " + rec.state;
  $("status-line").textContent = d.consequences.status;
  $("approve-text").textContent = d.consequences.approve;
  $("dismiss-text").textContent = d.consequences.dismiss;
  $("late-dismiss-text").textContent = d.consequences.dismiss;
  const ck = rec.checkpoint || inc.recommended_checkpoint;
  kv("facts", [
    ["Check that fired", inc.check + (inc.checks_failed.length > 1 ? ` (all failing: ${inc.checks_failed.join(", ")})` : "")],
    ["Classification", inc.classification],
    ["Job / step", `${inc.job_id}, update of step ${inc.step} withheld`],
    ["Last passing verification", inc.last_verified_step ?? "none"],
    ["Recommended checkpoint", ck ? `step ${ck.step} at ${ck.path}` : "none named"],
    ["Nodes acted on", rec.targets.join(", ") || "none"],
    ["Cordoned by this incident", rec.cordoned.join(", ") || "none"],
    ...rec.cordon_skipped.map(([n, why]) => ["Not cordoned: " + n, why]),
    ["Detected (job clock)", inc.time],
    ["Received", `${d.first_seen} from ${d.source} (${d.deliveries} delivery/ies)`],
  ]);
  const people = (inc.suspects.length ? inc.suspects : inc.candidates);
  table("suspects", ["rank", "role", "node", "hostname", "Slurm node", "Kubernetes node", "instance"],
        people.map(s => [s.rank, inc.suspects.length ? "suspect" : "candidate (ambiguous)", s.node.name,
                         s.node.hostname ?? "", s.node.slurm_node ?? "", s.node.k8s_node ?? "", s.node.instance_id ?? ""]));
  table("pairs", ["check", "source rank (node)", "verifier rank (node)", "distance", "outcome"],
        pairsOf(inc.evidence).map(([check, p]) => [
          check, `${text(p.source)} (${text(p.source_node) || "?"})`, `${text(p.verifier)} (${text(p.verifier_node) || "?"})`,
          text(p.distance), p.agree === true ? {text: "agree", cls: "good"} : {text: "DISAGREE", cls: "bad"}]));
  table("triage", ["node", "result", "detail"],
        rec.triage.map(t => [t.node, t.passed ? {text: "passed", cls: "good"} : {text: "FAILED", cls: "bad"}, t.detail]));
  table("audit", ["when (UTC)", "who", "what", "outcome"], d.audit.map(a => [a.at, a.actor, a.what, a.outcome]));
  table("actions", ["kind", "node", "status", "attempts", "note"],
        d.actions.map(a => [a.kind, a.node ?? "-", a.status, a.attempts, a.last_error ?? ""]));
  $("evidence").textContent = JSON.stringify(inc.evidence, null, 2);
  drawTimeline(inc, d.audit);
  // Only a view drawn to the end offers the decision.
  current = d;
  $("decision").hidden = !d.decision_pending;
  $("late-dismiss").hidden = d.decision_pending || !d.can_dismiss;
}

function drawTimeline(inc, audit) {
  // Events in order, evenly spaced (controller steps often land milliseconds apart), each
  // labelled with its time since detection.
  const s = $("timeline");
  s.replaceChildren();
  const events = [{t: Date.parse(inc.time), label: "detected", kind: "detect"}];
  for (const a of audit) {
    if (a.what.includes("->")) events.push({t: Date.parse(a.at), label: a.what.split("->")[1].trim(), kind: a.what.includes("failed") ? "bad" : "step"});
    else if (a.what.endsWith("requested")) events.push({t: Date.parse(a.at), label: a.what.replace(" requested", "") + " by " + a.actor, kind: "person"});
  }
  const W = 900, left = 50, right = W - 50;
  const gap = events.length > 1 ? (right - left) / (events.length - 1) : 0;
  s.append(svg("line", {x1: left, x2: right, y1: 45, y2: 45, stroke: "#888"}));
  const colour = {detect: "#e53935", step: "#1e88e5", person: "#ffb300", bad: "#e53935"};
  events.forEach((e, i) => {
    const x = left + gap * i, up = i % 2 === 0;
    s.append(svg("circle", {cx: x, cy: 45, r: 6, fill: colour[e.kind]}));
    s.append(svg("text", {x: x, y: up ? 18 : 80, "text-anchor": "middle"}, e.label));
    s.append(svg("text", {x: x, y: up ? 31 : 67, "text-anchor": "middle", fill: "#666"},
                 i === 0 ? inc.time.slice(11, 19) + " UTC" : "+" + formatSpan(e.t - events[0].t)));
  });
}

function formatSpan(ms) {
  const s = ms / 1000;
  if (s < 120) return s.toFixed(s < 10 ? 1 : 0) + " s";
  if (s < 7200) return (s / 60).toFixed(0) + " min";
  return (s / 3600).toFixed(1) + " h";
}

function ask(decision) {
  if (!current) return;
  const rec = current.record;
  pending = {decision, expect: rec.state};
  $("confirm-text").textContent = (decision === "approve" ? current.consequences.approve : current.consequences.dismiss);
  $("confirm").textContent = decision === "approve"
    ? `Yes, replace ${rec.targets.join(", ") || "nothing"}` : `Yes, dismiss ${rec.incident_id}`;
  $("confirm-row").hidden = false;
}

async function confirmDecision() {
  if (!pending || !current) return;
  const {decision, expect} = pending;
  const body = {expect_state: expect};
  if (sessionStorage.getItem("replicheck.shared")) {
    const who = $("who").value.trim();
    if (!who) { say("This is a shared token: enter your name first."); return; }
    sessionStorage.setItem("replicheck.who", who);
    body.by = who;
  }
  pending = null;
  $("confirm-row").hidden = true;
  try {
    const d = await api("POST", `/incidents/${encodeURIComponent(current.incident.id)}/${decision}`, body);
    say(`${decision === "approve" ? "Approved" : "Dismissed"}: ${d.record.incident_id} is now ${d.record.state}.`, true);
  } catch (err) {
    say(`Not ${decision}d: ${err.message}`);
  }
  await refresh();
}

function tick() { if (!pending) refresh().catch(err => say(err.message)); }

document.addEventListener("DOMContentLoaded", () => {
  $("signin").addEventListener("submit", signIn);
  $("approve").addEventListener("click", () => ask("approve"));
  $("dismiss").addEventListener("click", () => ask("dismiss"));
  $("dismiss-late").addEventListener("click", () => ask("dismiss"));
  $("confirm").addEventListener("click", confirmDecision);
  $("cancel").addEventListener("click", () => { pending = null; $("confirm-row").hidden = true; refresh(); });
  window.addEventListener("hashchange", () => { pending = null; tick(); });
  if (token()) signIn();
  setInterval(tick, REFRESH_MS);
});
