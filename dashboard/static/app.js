// The gpunode dashboard. Everything it shows comes from the daemon's read-only JSON API
// (/v1/..., documented in docs/api.md); /events says which part changed. Text from the
// API is put into the page with textContent only, never as HTML: provider ids, model
// names, reasons and job logs come from other machines.
"use strict";

const state = { range: "hour", jobsSelected: null, logFrom: 0, logJob: null, verify: null,
                providers: [], ready: {} };

// ---------- small helpers ----------
function el(tag, attrs, ...children) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v === undefined || v === null || v === false) continue;
    if (k === "class") e.className = v;
    else if (k === "style") e.style.cssText = v; // CSSOM: allowed by the page's CSP
    else if (k.startsWith("on")) e.addEventListener(k.slice(2), v);
    else e.setAttribute(k, String(v));
  }
  for (const c of children.flat()) {
    if (c === undefined || c === null) continue;
    e.append(c instanceof Node ? c : document.createTextNode(String(c)));
  }
  return e;
}
const $ = (sel) => document.querySelector(sel);
function chip(text, cls) { return el("span", { class: "chip " + (cls || "") }, text); }
function shortId(id) { return id && id.length > 16 ? id.slice(0, 8) + "…" + id.slice(-6) : (id || "—"); }
function gib(bytes) { return (bytes / 2 ** 30).toFixed(bytes >= 10 * 2 ** 30 ? 0 : 1) + " GiB"; }
function ago(ms) {
  const s = Math.max(0, (Date.now() - ms) / 1000);
  if (s < 90) return Math.round(s) + " s ago";
  if (s < 5400) return Math.round(s / 60) + " min ago";
  if (s < 172800) return Math.round(s / 3600) + " h ago";
  return Math.round(s / 86400) + " d ago";
}
function when(ms) { return ms ? new Date(ms).toLocaleString() : "—"; }
function fixed(x, n) { return (typeof x === "number") ? x.toFixed(n) : "—"; }
function fillBody(table, rows, empty) {
  const body = $(table + " tbody");
  body.replaceChildren(...rows);
  if (!rows.length) body.append(el("tr", { class: "empty" }, el("td", { colspan: 12, class: "muted" }, empty)));
}

async function api(path) {
  const r = await fetch(path, { credentials: "same-origin", cache: "no-store" });
  if (r.status === 401) throw new Error("not signed in: open the link `gpunode dashboard` prints");
  if (!r.ok) throw new Error(path + ": " + r.status + " " + (await r.text()));
  const type = r.headers.get("content-type") || "";
  return type.includes("json") ? r.json() : r.text();
}
function showError(e) {
  const box = $("#error");
  if (e) { box.textContent = String(e.message || e); box.hidden = false; } else box.hidden = true;
}

// ---------- plots (SVG, no library) ----------
const SVG = "http://www.w3.org/2000/svg";
function svg(tag, attrs) {
  const e = document.createElementNS(SVG, tag);
  for (const [k, v] of Object.entries(attrs || {})) e.setAttribute(k, String(v));
  return e;
}
// points: [[t, y], ...]; yMax: top of the axis (null: from the data). Returns the plot
// under a one-line caption (text outside the SVG, so stretching does not distort it).
function plot(points, yMax, unit) {
  const W = 300, H = 110, P = 4;
  const s = svg("svg", { class: "plot", viewBox: `0 0 ${W} ${H}`, preserveAspectRatio: "none",
                         "data-samples": points.length });
  const ys = points.map((p) => p[1]).filter((y) => y !== null && y !== undefined);
  if (!ys.length) return el("div", {}, el("div", { class: "plot-caption muted" }, "no samples yet"), s);
  const t0 = points[0][0], t1 = Math.max(points[points.length - 1][0], t0 + 1);
  const top = yMax || Math.max(1, ...ys) * 1.1;
  const x = (t) => P + (W - 2 * P) * (t - t0) / (t1 - t0);
  const y = (v) => H - P - (H - 2 * P) * Math.min(Math.max(v, 0), top) / top;
  let d = "";
  for (const [t, v] of points) {
    if (v === null || v === undefined) continue;
    d += (d ? "L" : "M") + x(t).toFixed(1) + "," + y(v).toFixed(1);
  }
  if (ys.length === 1) d += "h2";
  s.append(svg("path", { class: "area", d: d + `L${x(t1).toFixed(1)},${H - P}L${x(t0).toFixed(1)},${H - P}Z` }));
  s.append(svg("path", { class: "line", d }));
  const span = (t1 - t0) / 60000;
  const caption = `last ${ys[ys.length - 1]}${unit || ""} · max ${Math.max(...ys)}${unit || ""} · ` +
    (span >= 90 ? `${(span / 60).toFixed(1)} h` : `${Math.max(1, Math.round(span))} min`);
  return el("div", {}, el("div", { class: "plot-caption muted" }, caption), s);
}

// ---------- views ----------
async function loadStatus() {
  const s = await api("/v1/status");
  $("#node-id").textContent = shortId(s.peer_id);
  $("#node-id").title = s.peer_id;
  state.inTeam = !!s.team;
  const r = $("#reachability");
  r.textContent = s.reachability || "";
  r.hidden = !s.reachability;
}

async function loadNetwork() {
  const n = await api("/v1/network");
  state.providers = n.providers;
  $("#providers-count").textContent = `(${n.total})`;
  const models = [...new Set(n.providers.flatMap((p) => p.gpus.map((g) => g.model)))].sort();
  const select = $("#filter-model");
  const chosen = select.value;
  select.replaceChildren(el("option", { value: "" }, "any"),
    ...models.map((m) => el("option", { value: m, selected: m === chosen }, m)));
  renderNetwork();
}
function renderNetwork() {
  const model = $("#filter-model").value;
  const minMem = Number($("#filter-mem").value || 0) * 2 ** 30;
  const idleOnly = $("#filter-idle").checked;
  const rows = [];
  for (const p of state.providers) {
    const gpus = p.gpus.filter((g) => (!model || g.model === model) && g.memory_bytes >= minMem
                                     && (!idleOnly || g.state === "idle"));
    if (!gpus.length && (model || minMem || idleOnly)) continue;
    const byModel = {};
    for (const g of gpus) byModel[`${g.model} ${gib(g.memory_bytes)}`] = (byModel[`${g.model} ${gib(g.memory_bytes)}`] || 0) + 1;
    const states = {};
    for (const g of gpus) states[g.state] = (states[g.state] || 0) + 1;
    rows.push(el("tr", { "data-peer": p.peer_id },
      el("td", { title: p.peer_id }, shortId(p.peer_id), " ", p.in_team ? chip("team", "ok") : null,
         p.simulated ? chip("simulated", "sim") : null),
      el("td", {}, Object.entries(byModel).map(([m, c]) => el("div", {}, `${c} × ${m}`))),
      el("td", {}, Object.entries(states).map(([s, c]) => chip(`${c} ${s.replace("_", "-")}`, s.replace("_", "-")))),
      el("td", {}, fixed(p.price_per_gpu_hour, 2)),
      el("td", {}, fixed(p.reputation, 2)),
      el("td", {}, p.link ? chip(p.link, p.link) : chip("not connected")),
      el("td", {}, p.rtt_ms != null ? fixed(p.rtt_ms, 1) + " ms" : "—"),
      el("td", {}, ago(p.issued_at_ms))));
  }
  fillBody("#providers", rows, "No provider known yet: adverts arrive as the network forms.");
}

async function loadMachine() {
  const m = await api("/v1/machine?range=" + state.range);
  const cards = m.plots.map((g) => {
    const now = m.inventory.gpus.find((x) => x.uuid === g.uuid);
    const col = (i) => g.samples.map((s) => [s[0], s[i]]);
    const temps = col(3).some((p) => p[1] !== null), power = col(4).some((p) => p[1] !== null);
    return el("div", { class: "gpu", "data-uuid": g.uuid },
      el("div", {}, el("strong", {}, g.name), " ", chip(gib(g.memory_total_bytes)),
         g.simulated ? chip("simulated", "sim") : null,
         now ? chip(now.state.replace("_", "-"), now.state.replace("_", "-")) : chip("gone", "bad"),
         el("span", { class: "muted" }, ` ${g.samples.length} samples`)),
      el("div", { class: "plots" },
        el("div", {}, el("div", { class: "plot-title" }, "utilization %"), plot(col(1), 100, "%")),
        el("div", {}, el("div", { class: "plot-title" }, "memory used MiB"),
           plot(col(2), g.memory_total_bytes / 2 ** 20, "")),
        temps ? el("div", {}, el("div", { class: "plot-title" }, "temperature °C"), plot(col(3), null, "°")) : null,
        power ? el("div", {}, el("div", { class: "plot-title" }, "power W"), plot(col(4), null, " W")) : null));
  });
  $("#gpus").replaceChildren(...cards);
  if (!cards.length) $("#gpus").append(el("p", { class: "muted" }, "No GPU on this machine."));
  fillBody("#running", m.running_jobs.map((j) => el("tr", {},
    el("td", {}, j.job), el("td", {}, shortId(j.lease_id)), el("td", {}, j.gpus.join(", ")),
    el("td", {}, j.gpu ? JSON.stringify(j.gpu) : "—"), el("td", {}, j.paused ? chip("paused", "busy") : chip("running", "ok")))),
    "No job runs here for a peer.");
  $("#alerts").replaceChildren(...m.alerts.map((a) => el("li", {}, chip(a.kind, "bad"), ` ${when(a.at_ms)}: ${a.message}`)));
  if (!m.alerts.length) $("#alerts").append(el("li", { class: "muted" }, "No alert."));
  const p = m.policy;
  $("#policy").replaceChildren(
    el("dt", {}, "Lending hours"), el("dd", {}, p.lend.length ? `${p.lend.join(", ")} (UTC${p.lend_utc_offset})` : "always"),
    el("dt", {}, "GPU memory lent"), el("dd", {}, p.lend_gpu_memory || "all"),
    el("dt", {}, "When the owner comes back"), el("dd", {}, `${p.owner_policy} (grace ${p.owner_grace_s} s)`),
    el("dt", {}, "Price"), el("dd", {}, `${p.price_per_gpu_hour} credits per GPU-hour`));
}

function waitingText(job) {
  const w = job.waiting;
  if (!w) return "";
  return w.reasons.map(([who, why]) => (who === "-" ? why : `${shortId(who)}: ${why}`)).join("; ");
}
async function loadJobs() {
  const jobs = await api("/v1/jobs");
  jobs.sort((a, b) => b.submitted_ms - a.submitted_ms);
  fillBody("#my-jobs", jobs.map((j) => {
    const place = j.waiting && j.waiting.queue ? j.waiting.queue[1] : null;
    return el("tr", { class: "clickable" + (j.job_id === state.logJob ? " selected" : ""), "data-job": j.job_id,
                      "data-state": j.state, onclick: () => selectJob(j.job_id) },
      el("td", { title: j.job_id }, j.job_id.slice(0, 8)),
      el("td", {}, String(j.module).split("/").pop()),
      el("td", {}, chip(j.state, j.state)),
      el("td", { title: j.provider || "" }, shortId(j.provider)),
      el("td", {}, ago(j.submitted_ms)),
      el("td", {}, place ? `${place.position} of ${place.of}` + (place.estimated_start_ms ? `, starts ~${when(place.estimated_start_ms)}` : "") : "—"),
      el("td", { class: "why" }, j.error || waitingText(j)));
  }), "No job yet: `gpunode run task.wasm` submits one.");
  const q = await api("/v1/queue");
  fillBody("#queue", q.map((r) => el("tr", {},
    el("td", {}, `${r.position} of ${r.of}`), el("td", { title: r.requester }, shortId(r.requester)),
    el("td", {}, r.gpus), el("td", {}, Math.round(r.duration_ms / 1000) + " s"),
    el("td", {}, ago(r.waiting_since_ms)), el("td", {}, when(r.estimated_start_ms)), el("td", {}, r.reason))),
    "Nobody waits for this machine's GPUs.");
}
function selectJob(id) {
  state.logJob = id; state.logFrom = 0;
  $("#log").textContent = "";
  $("#log-job").textContent = id.slice(0, 8);
  for (const tr of document.querySelectorAll("#my-jobs tr")) tr.classList.toggle("selected", tr.dataset.job === id);
  followLog(id);
}
function decode(b64) {
  try { return new TextDecoder().decode(Uint8Array.from(atob(b64), (c) => c.charCodeAt(0))); } catch (e) { return ""; }
}
async function followLog(id) {
  while (state.logJob === id) {
    let page;
    try { page = await api(`/v1/jobs/${encodeURIComponent(id)}/events?from=${state.logFrom}&wait_ms=1000`); }
    catch (e) { return; }
    if (state.logJob !== id) return;
    let text = "";
    for (const ev of page.events) {
      if (ev.type === "stdout" || ev.type === "stderr") text += decode(ev.data);
      else if (ev.type === "waiting") text += `[waiting] ${ev.reasons.map((r) => r[1]).join("; ")}\n`;
      else if (ev.type === "finished") text += `[finished] exit ${ev.summary.exit_code}, ${ev.summary.cost} credits\n`;
      else if (ev.type === "failed") text += `[failed] ${ev.error}\n`;
      else if (ev.type === "leased") text += `[leased] from ${ev.provider}\n`;
      else if (ev.type === "started") text += `[started]\n`;
      else if (ev.type === "retrying") text += `[retrying] ${ev.reason}\n`;
    }
    const log = $("#log");
    log.append(document.createTextNode(text));
    if (log.textContent.length > 200000) log.textContent = log.textContent.slice(-150000);
    log.scrollTop = log.scrollHeight;
    state.logFrom = page.next;
    if (page.done) return;
  }
}

async function loadCredits() {
  const l = await api("/v1/ledger?recent=50");
  $("#balance").textContent = fixed(l.balance, 3);
  $("#earned").textContent = fixed(l.earned, 3);
  $("#spent").textContent = fixed(l.spent, 3);
  fillBody("#peer-balances", l.peers.map((p) => el("tr", {},
    el("td", { title: p.peer_id }, shortId(p.peer_id)), el("td", {}, fixed(p.earned, 3)),
    el("td", {}, fixed(p.spent, 3)), el("td", {}, fixed(p.balance, 3)))), "No credit moved yet.");
  const verified = state.verify && !state.verify.first_bad;
  fillBody("#receipts", l.recent.map((e) => el("tr", { "data-lease": e.lease_id },
    el("td", {}, e.seq), el("td", { title: e.lease_id }, shortId(e.lease_id)),
    el("td", {}, chip(e.direction, e.direction === "earned" ? "ok" : "")),
    el("td", { title: e.peer }, shortId(e.peer)), el("td", {}, fixed(e.amount, 3)),
    el("td", {}, fixed(e.gpu_seconds, 1)), el("td", {}, when(e.end_ms)),
    el("td", { class: "sigs" }, state.verify ? (verified || e.seq < state.verify.first_bad.seq
      ? chip("provider ✓ requester ✓", "ok") : chip("check failed", "bad")) : chip("not checked")))),
    "No receipt yet: one is written when a lease ends and both sides have signed.");
  const h = await api("/v1/ledger/history?points=400");
  $("#balance-plot").replaceChildren(plot(h.points, null, ""));
}
// At load the last check of an unchanged chain is reused; "verify again" checks anew.
async function loadVerify(again) {
  $("#verify").textContent = "checking…";
  const v = await api(again ? "/v1/ledger/verify" : "/v1/ledger/verify?reuse=true");
  state.verify = v;
  $("#verify").replaceChildren(v.first_bad
    ? chip(`entry ${v.first_bad.seq}: ${v.first_bad.reason}`, "bad")
    : chip(`${v.entries} entries, ${v.signatures} signatures verified`, "ok"));
}

function quotaText(used, limit) {
  return used.toFixed(2) + (limit != null ? ` of ${limit}` : "") + " GPU-h";
}
async function loadTeam() {
  if (!state.inTeam) {
    $("#no-team").hidden = false; $("#members").hidden = true; $("#team-name").textContent = ""; return;
  }
  const t = await api("/v1/team");
  $("#no-team").hidden = true; $("#members").hidden = false;
  $("#team-name").textContent = `${t.name} (${shortId(t.team_id)}), you are ${t.role}`;
  fillBody("#members", t.members.map((m) => el("tr", {},
    el("td", { title: m.peer_id }, shortId(m.peer_id)), el("td", {}, m.role),
    el("td", {}, m.connected ? chip("connected", "ok") : chip("not connected")),
    el("td", {}, when(m.expires_ms)), el("td", {}, m.revoked ? chip("revoked", "bad") : ""),
    el("td", {}, quotaText(m.quota.today_gpu_hours, m.quota.per_day)),
    el("td", {}, quotaText(m.quota.week_gpu_hours, m.quota.per_week)))), "No member.");
  try { $("#team-policy").textContent = (await api("/v1/team/policy")) || "(no policy: everyone equal)"; } catch (e) { /* none */ }
}

async function loadUtilization() {
  const u = await api("/v1/utilization");
  const h = u.headline;
  $("#headline").textContent = h
    ? `${u.team.length ? "Team" : "This machine's"} GPUs busy from ${h.from_percent}% to ${h.to_percent}% (mean of the first ${h.days_each} day(s) recorded against the last)`
    : "Not enough days recorded yet for a trend.";
  const dates = u.machine.map((d) => d.date);
  $("#util-days thead").replaceChildren(el("tr", {}, el("th", {}, "GPU"), ...dates.map((d) => el("th", {}, d.slice(5)))));
  const cell = (d) => {
    if (!d) return el("td", { class: "heat muted" }, "—");
    const a = Math.min(1, d.busy_percent / 100);
    return el("td", { class: "heat", title: `busy ${d.busy_percent}%, lent ${d.lent_percent}%, ${d.hours_sampled.toFixed(1)} h sampled`,
                      style: `background: rgba(42,111,219,${(0.1 + 0.8 * a).toFixed(2)})` }, d.busy_percent + "%");
  };
  const rows = u.gpus.map((g) => el("tr", {},
    el("td", {}, g.name, " ", g.simulated ? chip("simulated", "sim") : null),
    ...dates.map((date) => cell(g.days.find((d) => d.date === date)))));
  rows.push(el("tr", {}, el("th", {}, "this machine"), ...u.machine.map(cell)));
  if (u.team.length) {
    rows.push(el("tr", {}, el("th", {}, "whole team"), ...dates.map((date) => cell(u.team.find((d) => d.date === date)))));
  }
  $("#util-days tbody").replaceChildren(...rows);
}

const loaders = { status: loadStatus, network: loadNetwork, machine: loadMachine, jobs: loadJobs,
                  queue: loadJobs, credits: loadCredits, team: loadTeam, utilization: loadUtilization };
async function load(name) {
  try { await loaders[name](); state.ready[name] = true; document.body.dataset.loaded = Object.keys(state.ready).join(" "); showError(null); }
  catch (e) { showError(e); }
}

// ---------- tabs and live updates ----------
function showTab() {
  const tab = (location.hash || "#network").slice(1);
  for (const s of document.querySelectorAll(".tab")) s.classList.toggle("active", s.id === tab);
  for (const a of document.querySelectorAll("nav a")) a.classList.toggle("active", a.dataset.tab === tab);
}
function connect() {
  const live = $("#live");
  const source = new EventSource("/events");
  source.addEventListener("open", () => { live.textContent = "live"; live.className = "chip on"; });
  source.addEventListener("error", () => { live.textContent = "reconnecting"; live.className = "chip off"; });
  for (const section of ["jobs", "machine", "credits", "queue", "network", "team"]) {
    source.addEventListener(section, () => {
      document.body.dataset.lastEvent = section;
      load(section === "credits" ? "credits" : section);
      if (section === "machine") load("utilization");
    });
  }
}

window.gpunodeDashboard = { loadedAt: Date.now() };
window.addEventListener("hashchange", showTab);
document.addEventListener("DOMContentLoaded", async () => {
  showTab();
  for (const input of ["#filter-model", "#filter-mem", "#filter-idle"]) $(input).addEventListener("input", renderNetwork);
  for (const r of document.querySelectorAll("input[name=range]")) {
    r.addEventListener("change", () => { state.range = r.value; load("machine"); });
  }
  $("#verify-again").addEventListener("click", async () => { await loadVerify(true).catch(showError); load("credits"); });
  await load("status");
  await Promise.all(["network", "machine", "jobs", "team", "utilization"].map(load));
  await loadVerify().catch(showError);
  await load("credits");
  connect();
});
