// capyctl console: reads and drives the gateway through its management API, with the key kept
// in this tab's session storage and sent as a bearer header. No framework, no build step.
"use strict";

const KEY = "capyctl-key";
const API = "/management/v1";
const REFRESH_MS = 5000;
const EVENTS_SHOWN = 200;
const CHANGES_SHOWN = 5;
const $ = (id) => document.getElementById(id);

let deploymentsDoc = null;
let recentDoc = null;
const statusDocs = new Map();
const answers = new Map(); // deployment -> {text, bad}
const logs = new Map(); // "name/index" -> lines or an error
const changes = new Map(); // deployment -> its last lifecycle events, newest first
let streamAbort = null;
let refreshTimer = null;
const pending = new Set();

// -- the key --------------------------------------------------------------------------------
// `capyctl console` prints the page's address with a one-time ticket in its fragment (#ticket=):
// the page trades it for the key once, so the address the browser's history keeps opens
// nothing. A key in the fragment (#key=) is taken as well; either way the fragment is dropped.
async function takeKeyFromFragment() {
  const hash = location.hash;
  if (!hash) return;
  history.replaceState(null, "", location.pathname + location.search);
  const ticket = /(?:^#|&)ticket=([^&]*)/.exec(hash);
  const given = /(?:^#|&)key=([^&]*)/.exec(hash);
  if (ticket) {
    let resp = null;
    try {
      resp = await fetch(API + "/console/redeem", {
        method: "POST",
        headers: { "Content-Type": "application/json" },
        body: JSON.stringify({ ticket: ticket[1] }),
        cache: "no-store",
      });
    } catch (e) {
      ticketProblem = "Could not reach the gateway to open this link: " + e.message;
      return;
    }
    if (resp.ok) {
      sessionStorage.setItem(KEY, (await resp.json()).key);
    } else {
      sessionStorage.removeItem(KEY);
      ticketProblem = "This link's ticket was used already or has expired (a ticket opens the " +
        "console once, within 60 s): run capyctl console again, or enter the API key.";
    }
  } else if (given) {
    try {
      sessionStorage.setItem(KEY, decodeURIComponent(given[1]));
    } catch (e) { // a malformed %-escape: ask for the key rather than stop on a blank page
      sessionStorage.removeItem(KEY);
      ticketProblem = "The key in the link could not be read. Enter the gateway's API key.";
    }
  }
}

let ticketProblem = "";

function key() {
  return sessionStorage.getItem(KEY);
}

function askForKey(message) {
  sessionStorage.removeItem(KEY);
  if (streamAbort) streamAbort.abort();
  clearTimeout(refreshTimer);
  $("main").hidden = true;
  $("forget").hidden = true;
  $("keyform").hidden = false;
  $("keymsg").textContent = message || "";
  $("live").textContent = "not connected";
  $("key").value = "";
  $("key").focus();
}

class Unauthorized extends Error {}

async function call(method, path) {
  const resp = await fetch(API + path, {
    method,
    headers: { Authorization: "Bearer " + key() },
    cache: "no-store",
  });
  if (resp.status === 401) throw new Unauthorized();
  let body = null;
  try {
    body = await resp.json();
  } catch (e) {
    body = { message: resp.statusText };
  }
  if (!resp.ok) {
    const err = new Error(`${resp.status} ${body.code || ""}: ${body.message || ""}`);
    err.status = resp.status;
    throw err;
  }
  return body;
}

function refused() {
  askForKey("The gateway refused this key (401 unauthorized). Enter its API key again.");
}

// -- reading ---------------------------------------------------------------------------------
async function refreshAll() {
  clearTimeout(refreshTimer);
  try {
    deploymentsDoc = await call("GET", "/deployments");
    const names = deploymentsDoc.deployments.map((d) => d.name);
    const [docs, recent] = await Promise.all([
      Promise.all(names.map((n) => call("GET", "/deployments/" + encodeURIComponent(n)))),
      call("GET", "/recent"),
    ]);
    names.forEach((n, i) => statusDocs.set(n, docs[i]));
    recentDoc = recent;
    $("problem").textContent = "";
    render();
  } catch (e) {
    if (e instanceof Unauthorized) return refused();
    $("problem").textContent = "Could not read the gateway: " + e.message;
  }
  refreshTimer = setTimeout(refreshAll, REFRESH_MS);
}

async function refreshOne(name) {
  if (pending.has(name)) return;
  pending.add(name);
  try {
    const [list, doc] = await Promise.all([
      call("GET", "/deployments"),
      call("GET", "/deployments/" + encodeURIComponent(name)),
    ]);
    deploymentsDoc = list;
    statusDocs.set(name, doc);
    render();
  } catch (e) {
    if (e instanceof Unauthorized) return refused();
  } finally {
    pending.delete(name);
  }
}

// -- acting ----------------------------------------------------------------------------------
async function act(name, action) {
  answers.set(name, { text: `${action}: waiting for the gateway…`, bad: false, busy: true });
  render();
  try {
    const doc = await call("POST", `/deployments/${encodeURIComponent(name)}/${action}`);
    statusDocs.set(name, doc);
    const d = doc.deployment;
    answers.set(name, { text: `${action}: done, ${d.lifecycle || d.state}`, bad: false });
  } catch (e) {
    if (e instanceof Unauthorized) return refused();
    answers.set(name, { text: `${action}: ${e.message}`, bad: true });
  }
  await refreshOne(name);
  render();
}

async function showLog(name, index) {
  const id = `${name}/${index}`;
  if (logs.has(id)) {
    logs.delete(id);
    return render();
  }
  try {
    const doc = await call("GET", `/deployments/${encodeURIComponent(name)}/instances/${index}/log?lines=200`);
    logs.set(id, doc.never_ran ? ["(the engine has not run yet)"] : doc.lines);
  } catch (e) {
    if (e instanceof Unauthorized) return refused();
    logs.set(id, [e.message]);
  }
  render();
}

// -- drawing ---------------------------------------------------------------------------------
function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v === undefined || v === null) continue;
    if (k === "class") node.className = v;
    else if (k.startsWith("on")) node.addEventListener(k.slice(2), v);
    else node.setAttribute(k, v);
  }
  for (const c of children) {
    if (c === null || c === undefined) continue;
    node.append(c instanceof Node ? c : String(c));
  }
  return node;
}

// Bytes as an operator writes sizes in the configuration (4 GiB, 1.5 GiB, 512 MiB): the CLI's
// own size() (render.py), to the same digits, halves rounded to even as Python does.
function size(n) {
  if (n === null || n === undefined) return "—";
  for (const [unit, scale] of [["TiB", 2 ** 40], ["GiB", 2 ** 30], ["MiB", 2 ** 20], ["KiB", 2 ** 10]]) {
    if (n < scale) continue;
    const x = (n * 100) / scale;
    let r = Math.round(x);
    if (r - x === 0.5 && r % 2 === 1) r -= 1;
    return `${(r / 100).toFixed(2).replace(/0+$/, "").replace(/\.$/, "")} ${unit}`;
  }
  return `${n} B`;
}

const shown = (v, unit = "") => (v === null || v === undefined ? "—" : `${v}${unit}`);

function spark(values, bad) {
  const svg = document.createElementNS("http://www.w3.org/2000/svg", "svg");
  svg.setAttribute("class", bad ? "spark bad" : "spark");
  svg.setAttribute("viewBox", "0 0 120 24");
  svg.setAttribute("preserveAspectRatio", "none");
  const known = values.filter((v) => v !== null);
  if (known.length > 1) {
    const top = Math.max(...known) || 1;
    const step = 120 / (values.length - 1);
    const points = values
      .map((v, i) => (v === null ? null : `${(i * step).toFixed(1)},${(22 - (v / top) * 20).toFixed(1)}`))
      .filter((p) => p !== null);
    const line = document.createElementNS("http://www.w3.org/2000/svg", "polyline");
    line.setAttribute("points", points.join(" "));
    svg.append(line);
  }
  return svg;
}

// A duration in seconds as the answers' figures read: tenths of a millisecond below 10 ms,
// whole milliseconds below 10 s, seconds above.
function duration(s) {
  if (s === null || s === undefined) return "—";
  const ms = s * 1000;
  if (ms < 10) return `${ms.toFixed(1)} ms`;
  return ms < 10000 ? `${Math.round(ms)} ms` : `${s.toFixed(1)} s`;
}

function figures(name) {
  const slots = recentDoc && recentDoc.deployments[name];
  const all = recentDoc && recentDoc.totals && recentDoc.totals[name];
  if (!slots || !slots.length || !all) return null;
  const rps = slots.map((s) => (s.s > 0 ? s.requests / s.s : null));
  const errs = slots.map((s) => s.errors);
  const timed = (key) => slots.map((s) => (s[key] === undefined ? null : s[key] * 1000));
  const span = all.s >= 90 ? `${Math.round(all.s / 60)} min` : `${Math.round(all.s)} s`;
  const fig = (label, key, value, series, bad, title) =>
    el("div", { class: "figure", "data-figure": key, title },
      el("span", { class: "muted" }, label),
      el("span", { class: "value" }, value), spark(series, bad));
  return el("div", { class: "figures", "data-figures": name },
    fig("req/s", "rps", all.s > 0 ? (all.requests / all.s).toFixed(2) : "—", rps, false),
    fig("TTFT", "ttft", duration(all.ttft_s), timed("ttft_s"), false,
      `the answers' own ttft_ms, over the ${all.ttft_n || 0} that reported one`),
    fig("start/wake", "wake", all.wake_n ? `${duration(all.wake_s)} (${all.wake_n})` : "—",
      timed("wake_s"), false, "the wait of requests that came while it started or woke"),
    fig("errors", "errors", String(all.errors), errs, all.errors > 0),
    el("span", { class: "muted" }, `last ${span}, ${recentDoc.slot_s} s slots`));
}

function instanceRows(name, doc, launched) {
  const engine = `${doc.deployment.engine} ${doc.deployment.engine_version || ""}`.trim();
  const rows = [];
  const table = el("table", {},
    el("thead", {}, el("tr", {}, ...["#", "engine", "machine", "state", "running", "waiting",
      "cache/slots", "prefix hits", "sample age", "in flight", ""].map((h) => el("th", {}, h)))));
  const body = el("tbody");
  for (const inst of doc.instances) {
    const state = (inst.lifecycle && inst.lifecycle !== inst.state
      ? `${inst.state} (${inst.lifecycle})` : inst.state) + (inst.spare ? ", a spare" : "");
    const usage = inst.usage === undefined ? "—" : `${(inst.usage * 100).toFixed(1)}%`;
    const age = inst.sample_age_s === undefined ? inst.snapshot_age_s : inst.sample_age_s;
    const pc = inst.prefix_cache;
    const hits = pc && pc.queried_tokens ? `${(pc.hit_tokens / pc.queried_tokens * 100).toFixed(1)}%` : "—";
    body.append(el("tr", { "data-instance": inst.index },
      el("td", {}, inst.index), el("td", {}, engine), el("td", {}, shown(inst.machine || inst.host)),
      el("td", {}, el("span", { class: "state " + inst.state }, state)),
      el("td", {}, shown(inst.running)), el("td", {}, shown(inst.waiting)),
      el("td", {}, usage), el("td", { title: "prompt tokens the engine found in its prefix cache, since it started" }, hits),
      el("td", {}, age === null || age === undefined ? "—" : `${age.toFixed(1)} s`),
      el("td", {}, shown(inst.router_running)),
      el("td", {}, launched ? el("button", { type: "button", "data-log": inst.index,
        onclick: () => showLog(name, inst.index) }, logs.has(`${name}/${inst.index}`) ? "Hide log" : "Log") : "")));
    for (const line of inst.shown || []) {  // what its runner shows of it: a pod, its node
      body.append(el("tr", { [`data-${line.name.replaceAll("_", "-")}-of`]: inst.index }, el("td", {}),
        el("td", { class: line.alarm ? "failure" : "muted", colspan: 10 }, line.text)));
    }
    if (inst.failure) {
      body.append(el("tr", {}, el("td", {}), el("td", { class: "failure", colspan: 10 },
        `failed: ${inst.failure}` + (inst.restart_backoff_s ? ` (next try in ${inst.restart_backoff_s} s)` : ""))));
    }
  }
  table.append(body);
  rows.push(table);
  for (const inst of doc.instances) {
    if (inst.cancelled && inst.cancelled.length) {
      rows.push(el("div", { class: "cut" },
        el("div", {}, `instance ${inst.index}: ${inst.cancelled.length} cut request(s) still counted`),
        ...inst.cancelled.map((c) => el("div", { class: "mono" },
          `${c.capyctl_request_id} (${c.reason}, ${c.age_s.toFixed(0)} s ago): settles ${c.settles.replaceAll("_", " ")}`))));
    }
    const lines = logs.get(`${name}/${inst.index}`);
    if (lines) rows.push(el("pre", { class: "log", "data-log-of": inst.index }, lines.join("\n")));
  }
  return rows;
}

function meaning(action, d) {
  if (action === "start") return "start it, and wait until it is ready";
  if (action === "stop") return "stop it and keep it stopped: requests get 409 until a start";
  return d.park === "stop"
    ? "stop it until the next request (it cannot sleep here), which starts it again"
    : "park it: the next request wakes it";
}

function card(row) {
  const name = row.name;
  const doc = statusDocs.get(name);
  const launched = row.run_by.startsWith("the gateway ");  // processes or pods: its log is here
  const d = doc ? doc.deployment : {};
  const id = row.id || d.id;
  const answer = answers.get(name);
  const state = row.state;
  const top = el("div", { class: "top" },
    el("span", { class: "name" }, name),
    id ? el("span", { class: "muted mono", "data-id": id }, id) : null,
    el("span", { class: "state " + String(state).split(" ")[0], "data-state": name }, state),
    d.lifecycle && d.lifecycle !== state ? el("span", { class: "muted" }, `lifecycle ${d.lifecycle}`) : null,
    d.why ? el("span", { class: "why" }, d.why) : null,
    el("span", { class: "actions" },
      answer ? el("span", { class: "answer" + (answer.bad ? " bad" : ""), "data-answer": name }, answer.text) : null,
      ...(launched ? ["start", "stop", "park"].map((a) => el("button", {
        type: "button", "data-action": a, onclick: () => act(name, a), title: meaning(a, d),
        // Only what would change something now (the gateway says which: deployment.actions),
        // and nothing while a command is under way.
        disabled: (d.actions || []).includes(a) && !(answer && answer.busy) ? null : "",
      }, a)) : [])));
  const facts = [
    `${row.api}`, `${d.engine || row.engine} ${d.engine_version || ""}`.trim(),
    d.served_model ? `model ${d.served_model}` : null, row.run_by,
    `${row.ready}/${row.instances} ready`,
    d.running !== undefined ? `gateway running ${d.running}, waiting ${d.waiting}` : null,
    row.memory_held !== undefined ? `memory ${size(row.memory_held)}` +
      (deploymentsDoc.memory_budget ? ` of ${size(deploymentsDoc.memory_budget)} budget` : "") : null,
    d.park ? `park: ${d.park}` : null,
    d.routing ? `routing: ${d.routing === "prefix" ? "by prefix" : "least load"}` : null,
    d.prefix_cache_hit_ratio !== undefined
      ? `prefix cache hits ${(d.prefix_cache_hit_ratio * 100).toFixed(1)}% of prompt tokens` : null,
  ].filter(Boolean);
  return el("section", { class: "card", "data-deployment": name }, top,
    el("div", { class: "muted" }, facts.join(" · ")),
    recentChanges(name, row.instances > 1),
    figures(name), ...(doc ? instanceRows(name, doc, launched) : []));
}

// Its last transitions and why each happened (a switch names the deployment it made room for;
// an idle park or stop names its timeout; an operator's command says so), newest first.
function recentChanges(name, several) {
  const seen = changes.get(name);
  if (!seen || !seen.length) return null;
  return el("div", { class: "changes", "data-changes": name },
    ...seen.map((ev) => el("div", { "data-change": ev.to },
      el("span", { class: "muted" }, new Date(ev.ts * 1000).toLocaleTimeString()), " ",
      several ? `instance ${ev.instance} ` : "", `${ev.from} → ${ev.to}: `,
      el("span", { class: "why" }, ev.reason))));
}

function render() {
  if (!deploymentsDoc) return;
  const box = $("deployments");
  const scroll = new Map([...box.querySelectorAll("pre.log")].map((p) => [p.closest(".card").dataset.deployment + "/" + p.dataset.logOf, p.scrollTop]));
  box.replaceChildren(...deploymentsDoc.deployments.map(card));
  for (const p of box.querySelectorAll("pre.log")) {
    const k = p.closest(".card").dataset.deployment + "/" + p.dataset.logOf;
    p.scrollTop = scroll.has(k) ? scroll.get(k) : p.scrollHeight;
  }
  $("pools").replaceChildren(...(deploymentsDoc.pools || []).map(pool));
}

// One memory pool (this machine, a host, the cluster's pods): what it holds of the budget,
// which every pool has whole, and each deployment's share.
function pool(p) {
  const total = p.budget === null || p.budget === undefined ? null : p.budget;
  const meter = total ? el("meter", { min: 0, max: total, value: Math.min(p.held, total) }) : null;
  return el("div", { class: "pool", "data-pool": p.pool },
    el("span", { class: "name" }, p.pool),
    el("span", { class: p.over_budget ? "value bad" : "value", "data-held": p.pool },
      total ? `${size(p.held)} of ${size(total)}` : `${size(p.held)} (no budget)`),
    meter,
    poolHistory(p),
    el("span", { class: "muted", "data-shares": p.pool },
      p.deployments.map((d) => `${d.name} ${size(d.held)}`).join(" · ")),
    p.over_budget ? el("span", { class: "bad" }, "over budget: a stop was not confirmed") : null,
    ...(p.waiting || []).map((w) => el("span", { class: "muted", "data-waits": w.name },
      `${w.name} waits to be switched in: ${w.requests} requests, the oldest ${w.oldest_s.toFixed(1)} s`)),
    p.next_switch ? el("span", { class: "muted", "data-next-switch": p.pool },
      `next switch: ${p.next_switch.out} out, ${p.next_switch.in} in`
      + (p.next_switch.in_s === null ? " once it is idle" : ` within ${p.next_switch.in_s.toFixed(1)} s`)
      + ` (${p.next_switch.why})`) : null);
}

// The pool over the last ten minutes (`pools[].history`, a record at each change): time left to
// right, now at the right edge; each deployment's share a band stacked from the bottom, scaled
// to the budget (to the most held where there is none), its colour its name's.
const HISTORY_S = 600;
const SVG = "http://www.w3.org/2000/svg";
function poolHistory(p) {
  const rows = p.history || [];
  if (!rows.length) return null;
  const svg = document.createElementNS(SVG, "svg");
  svg.setAttribute("class", "history");
  svg.setAttribute("viewBox", `0 0 ${HISTORY_S} 24`);
  svg.setAttribute("preserveAspectRatio", "none");
  svg.setAttribute("data-history", p.pool);
  const total = (r) => Object.values(r.held).reduce((a, b) => a + b, 0);
  const top = p.budget || Math.max(1, ...rows.map(total));
  rows.forEach((r, i) => {
    const from = Math.max(0, HISTORY_S - r.ago_s);
    const to = i + 1 < rows.length ? HISTORY_S - rows[i + 1].ago_s : HISTORY_S;
    if (to <= from) return;
    let y = 24;
    for (const [name, held] of Object.entries(r.held)) {
      if (!held) continue;
      const h = (24 * Math.min(held, top)) / top;
      y -= h;
      const band = document.createElementNS(SVG, "rect");
      for (const [k, v] of Object.entries({ x: from, width: to - from, y, height: h, fill: colour(name), "data-deployment": name })) band.setAttribute(k, v);
      const title = document.createElementNS(SVG, "title");
      title.textContent = `${name} ${size(held)}, from ${Math.round(r.ago_s)} s ago`;
      band.append(title);
      svg.append(band);
    }
  });
  return svg;
}

function colour(name) {
  let h = 0;
  for (const c of name) h = (h * 31 + c.charCodeAt(0)) % 360;
  return `hsl(${h} 55% 55%)`;
}

// -- the live stream -------------------------------------------------------------------------
function describe(ev) {
  const f = { ...ev };
  delete f.ts; delete f.event;
  return Object.entries(f).map(([k, v]) => `${k}=${typeof v === "object" ? JSON.stringify(v) : v}`).join(" ");
}

function showEvent(ev) {
  if (ev.event === "lifecycle" && ev.deployment) {
    const seen = changes.get(ev.deployment) || [];
    seen.unshift(ev);
    changes.set(ev.deployment, seen.slice(0, CHANGES_SHOWN));
  }
  const list = $("events");
  const at = new Date((ev.ts || Date.now() / 1000) * 1000).toLocaleTimeString();
  list.prepend(el("li", { "data-event": ev.event }, el("span", { class: "muted" }, at),
    el("span", { class: "ev" }, ev.event), el("span", { class: "mono" }, describe(ev))));
  while (list.children.length > EVENTS_SHOWN) list.lastChild.remove();
  if (ev.deployment && statusDocs.has(ev.deployment)) soon(ev.deployment);
}

const scheduled = new Set();
function soon(name) {
  // Under load every request is an event: refresh a deployment at most every 300 ms.
  if (scheduled.has(name)) return;
  scheduled.add(name);
  setTimeout(() => { scheduled.delete(name); refreshOne(name); }, 300);
}

async function stream() {
  let wait = 1000;
  while (key()) {
    streamAbort = new AbortController();
    try {
      // ?recent=1: the stream begins with the gateway's recent events, so the panel is never
      // empty when opened; each (re)connection shows them afresh.
      const resp = await fetch(API + "/events?recent=1", {
        headers: { Authorization: "Bearer " + key() },
        signal: streamAbort.signal, cache: "no-store",
      });
      if (resp.status === 401) return refused();
      if (!resp.ok) {
        const body = await resp.json().catch(() => ({}));
        throw new Error(`${resp.status} ${body.code || ""}: ${body.message || ""}`);
      }
      $("eventstate").textContent = "live";
      $("live").textContent = "live";
      $("events").replaceChildren();
      changes.clear(); // the stream begins with the recent events again
      wait = 1000;
      const reader = resp.body.getReader();
      const decoder = new TextDecoder();
      let buffer = "";
      for (;;) {
        const { value, done } = await reader.read();
        if (done) break;
        buffer += decoder.decode(value, { stream: true });
        let cut;
        while ((cut = buffer.indexOf("\n\n")) >= 0) {
          const block = buffer.slice(0, cut);
          buffer = buffer.slice(cut + 2);
          const data = block.split("\n").filter((l) => l.startsWith("data: ")).map((l) => l.slice(6)).join("\n");
          if (!data) continue;
          const ev = JSON.parse(data);
          if (block.startsWith("event: end")) $("eventstate").textContent = `ended: ${ev.reason}`;
          else showEvent(ev);
        }
      }
    } catch (e) {
      if (e.name === "AbortError") return;
      $("eventstate").textContent = `not connected (${e.message}); retrying`;
    }
    $("live").textContent = "reconnecting";
    await new Promise((r) => setTimeout(r, wait));
    wait = Math.min(wait * 2, 30000);
    refreshAll();
  }
}

// -- start -----------------------------------------------------------------------------------
function open() {
  $("keyform").hidden = true;
  $("main").hidden = false;
  $("forget").hidden = false;
  $("keymsg").textContent = "";
  refreshAll();
  stream();
}

document.addEventListener("DOMContentLoaded", async () => {
  await takeKeyFromFragment();
  $("keyf").addEventListener("submit", (e) => {
    e.preventDefault();
    const k = $("key").value.trim();
    if (!k) return;
    sessionStorage.setItem(KEY, k);
    open();
  });
  $("forget").addEventListener("click", () => askForKey(""));
  if (key()) open(); else askForKey(ticketProblem);
});
