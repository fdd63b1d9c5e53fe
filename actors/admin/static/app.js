// The console's page: hash routes, a poll every 2 s, confirmations before actions.
// Plain JavaScript, no library, nothing from a CDN (actors/admin/admin.py).
"use strict";
const BASE = document.body.dataset.base;
const INTERVAL = 2000;
const history = {};  // key -> [message counts, one per poll] for the rate sparklines
let timer = null;

function esc(v) {
  return String(v === undefined || v === null ? "" : v).replace(/[&<>"']/g,
    c => ({"&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;"}[c]));
}
function num(v) { return (v || 0).toLocaleString("en-US"); }
function enc(v) { return encodeURIComponent(v); }
function ago(ts) {
  if (!ts) return "";
  const s = Math.max(0, Math.floor(Date.now() / 1000 - ts));
  if (s < 120) return s + "s";
  if (s < 7200) return Math.floor(s / 60) + "m";
  return Math.floor(s / 3600) + "h";
}
function duration(ns) {
  if (ns > 1e9) return (ns / 1e9).toFixed(1) + "s";
  if (ns > 1e6) return (ns / 1e6).toFixed(1) + "ms";
  if (ns > 1e3) return (ns / 1e3).toFixed(1) + "us";
  return (ns || 0).toFixed(1) + "ns";
}

async function api(path) {
  const r = await fetch(BASE + "api/" + path);
  const body = await r.json().catch(() => ({message: r.statusText}));
  if (!r.ok) throw new Error(body.message || r.statusText);
  return body;
}

// A rate sparkline from the message counts seen at each poll of `key`.
function spark(key, count) {
  const h = history[key] = (history[key] || []);
  h.push(count || 0);
  if (h.length > 31) h.shift();
  const rates = h.slice(1).map((v, i) => Math.max(0, (v - h[i]) / (INTERVAL / 1000)));
  const last = rates.length ? rates[rates.length - 1] : 0;
  if (rates.length < 2) return `<span class="rate" data-rate="${last}">${num(Math.round(last))}/s</span>`;
  const max = Math.max(...rates, 1);
  const pts = rates.map((r, i) => `${i * 4},${20 - (r / max) * 18}`).join(" ");
  return `<svg class="spark" width="120" height="20"><polyline fill="none" stroke="#23395d" points="${pts}"/></svg>` +
    ` <span class="rate" data-rate="${last}">${num(Math.round(last))}/s</span>`;
}

function button(action, label, data, danger) {
  const attrs = Object.entries(data).map(([k, v]) => `data-${k}="${esc(v)}"`).join(" ");
  return `<button class="${danger ? "danger" : ""}" data-action="${action}" ${attrs}>${label}</button>`;
}

function badges(row) {
  return (row.paused ? ' <span class="paused">paused</span>' : "") +
    (row.backlog_alarm ? ' <span class="alarm">backlog alarm</span>' : "");
}

// -- pages -------------------------------------------------------------------------

async function overview() {
  const o = await api("overview");
  let html = `<h1>Topics</h1>
    <form id="create-topic"><input name="topic" placeholder="new topic" required>
    <button type="submit">Create topic</button></form>
    <table id="topics"><tr><th class="name">topic</th><th>depth</th><th>messages</th><th>rate</th><th>channels</th><th>brokers</th></tr>`;
  for (const t of o.topics) {
    html += `<tr data-topic="${esc(t.topic)}"><td class="name"><a href="#/topic/${enc(t.topic)}">${esc(t.topic)}</a>${badges(t)}</td>
      <td class="depth">${num(t.depth)}</td><td>${num(t.message_count)}</td><td>${spark("t:" + t.topic, t.message_count)}</td>
      <td>${num(t.channels)}</td><td>${num(t.brokers)}</td></tr>`;
  }
  if (!o.topics.length) html += `<tr><td class="name muted" colspan="6">no topics</td></tr>`;
  html += `</table>` + brokersTable(o.brokers);
  if (o.lookupds.length) {
    html += `<h2>Lookup daemons</h2><table><tr><th class="name">address</th><th>brokers</th></tr>`;
    for (const l of o.lookupds) {
      html += `<tr><td class="name">${esc(l.address)}</td><td>${l.error ? `<span class="error">${esc(l.error)}</span>` : num(l.nodes)}</td></tr>`;
    }
    html += `</table>`;
  }
  return html;
}

function brokersTable(brokers) {
  let html = `<h2>Brokers</h2><table id="brokers"><tr><th class="name">broker</th><th class="name">version</th><th>uptime</th><th>topics</th><th class="name">health</th></tr>`;
  for (const b of brokers) {
    html += `<tr><td class="name"><a href="#/broker/${enc(b.address)}">${esc(b.address)}</a></td>` +
      (b.error ? `<td class="name error" colspan="4">${esc(b.error)}</td>` :
        `<td class="name">${esc(b.version)}</td><td>${ago(b.start_time)}</td><td>${num(b.topics)}</td><td class="name">${esc(b.health)}</td>`) + `</tr>`;
  }
  return html + `</table>`;
}

async function brokers() { return brokersTable((await api("overview")).brokers); }

async function topicPage(topic) {
  const t = await api("topic?topic=" + enc(topic));
  let html = `<h1>Topic ${esc(topic)}</h1>`;
  if (!t.found) html += `<p class="muted">No broker has this topic.</p>`;
  const paused = t.brokers.some(b => b.paused);
  html += `<p>${button(paused ? "unpause" : "pause", paused ? "Unpause" : "Pause", {topic})}
    ${button("empty", "Empty", {topic}, true)} ${button("delete", "Delete", {topic}, true)}</p>
    <table id="topic-brokers"><tr><th class="name">broker</th><th>depth</th><th>memory</th><th>disk</th><th>messages</th><th>rate</th></tr>`;
  for (const b of t.brokers) {
    html += `<tr><td class="name"><a href="#/broker/${enc(b.address)}">${esc(b.address)}</a>${badges(b)}</td><td>${num(b.depth)}</td>
      <td>${num(b.memory_depth)}</td><td>${num(b.backend_depth)}</td><td>${num(b.message_count)}</td>
      <td>${spark("tb:" + topic + "@" + b.address, b.message_count)}</td></tr>`;
  }
  const s = t.totals;
  html += `<tr><th class="name">total</th><th>${num(s.depth)}</th><th>${num(s.memory_depth)}</th><th>${num(s.backend_depth)}</th><th>${num(s.message_count)}</th><th>${spark("t:" + topic, s.message_count)}</th></tr></table>`;
  for (const e of t.errors) html += `<p class="error">${esc(e.error)}</p>`;
  html += `<h2>Channels</h2><form id="create-channel" data-topic="${esc(topic)}"><input name="channel" placeholder="new channel" required>
    <button type="submit">Create channel</button></form>
    <table id="channels"><tr><th class="name">channel</th><th>depth</th><th>in flight</th><th>deferred</th><th>requeued</th><th>timed out</th><th>messages</th><th>rate</th><th>clients</th></tr>`;
  for (const c of t.channels) {
    html += `<tr data-channel="${esc(c.channel)}"><td class="name"><a href="#/topic/${enc(topic)}/${enc(c.channel)}">${esc(c.channel)}</a>${badges(c)}</td>
      <td class="depth">${num(c.depth)}</td><td>${num(c.in_flight_count)}</td><td>${num(c.deferred_count)}</td><td>${num(c.requeue_count)}</td>
      <td>${num(c.timeout_count)}</td><td>${num(c.message_count)}</td><td>${spark("c:" + topic + "/" + c.channel, c.message_count)}</td><td>${num(c.client_count)}</td></tr>`;
  }
  return html + `</table>`;
}

async function channelPage(topic, channel) {
  const c = await api("channel?topic=" + enc(topic) + "&channel=" + enc(channel));
  const s = c.totals;
  let html = `<h1>Channel <a href="#/topic/${enc(topic)}">${esc(topic)}</a> / ${esc(channel)}${badges(s)}</h1>`;
  if (!c.found) return html + `<p class="muted">No broker has this channel.</p>`;
  html += `<p>${button(s.paused ? "unpause" : "pause", s.paused ? "Unpause" : "Pause", {topic, channel})}
    ${button("empty", "Empty", {topic, channel}, true)} ${button("delete", "Delete", {topic, channel}, true)}</p>
    <table id="channel"><tr><th class="name">broker</th><th>depth</th><th>disk</th><th>in flight</th><th>deferred</th><th>requeued</th><th>timed out</th><th>messages</th><th>rate</th><th>clients</th><th class="name">e2e latency</th></tr>`;
  for (const b of c.brokers) {
    const e2e = (b.e2e && b.e2e.percentiles || []).map(p => `p${(p.quantile * 100).toFixed(1).replace(/\.0$/, "")} ${duration(p.value)}`).join(", ");
    html += `<tr><td class="name">${esc(b.address)}${badges(b)}</td><td class="depth">${num(b.depth)}</td><td>${num(b.backend_depth)}</td><td>${num(b.in_flight_count)}</td>
      <td>${num(b.deferred_count)}</td><td>${num(b.requeue_count)}</td><td>${num(b.timeout_count)}</td><td>${num(b.message_count)}</td>
      <td>${spark("cb:" + topic + "/" + channel + "@" + b.address, b.message_count)}</td><td>${num(b.client_count)}</td><td class="name">${esc(e2e) || '<span class="muted">off</span>'}</td></tr>`;
  }
  html += `</table><h2>Clients</h2><table id="clients"><tr><th class="name">address</th><th class="name">client</th><th class="name">user agent</th><th class="name">broker</th><th>RDY</th><th>in flight</th><th>finished</th><th>requeued</th><th>connected</th></tr>`;
  for (const cl of c.clients) {
    html += `<tr><td class="name">${esc(cl.address)}</td><td class="name">${esc(cl.client_id)}</td><td class="name">${esc(cl.user_agent)}</td><td class="name">${esc(cl.broker)}</td>
      <td>${num(cl.rdy)}</td><td>${num(cl.in_flight)}</td><td>${num(cl.finished)}</td><td>${num(cl.requeued)}</td><td>${ago(cl.connected)}</td></tr>`;
  }
  if (!c.clients.length) html += `<tr><td class="name muted" colspan="9">no clients</td></tr>`;
  return html + `</table>`;
}

async function brokerPage(address) {
  const b = await api("broker?address=" + enc(address));
  let html = `<h1>Broker ${esc(address)}</h1>`;
  if (b.error) return html + `<p class="error">${esc(b.error)}</p>`;
  html += `<p>${esc(b.version)} &middot; up ${ago(b.start_time)} &middot; ${esc(b.health)}</p>
    <h2>Topics</h2><table><tr><th class="name">topic</th><th>depth</th><th>messages</th><th>channels</th></tr>`;
  for (const t of b.topics) {
    html += `<tr><td class="name"><a href="#/topic/${enc(t.topic)}">${esc(t.topic)}</a>${badges(t)}</td><td>${num(t.depth)}</td><td>${num(t.message_count)}</td><td>${num(t.channels)}</td></tr>`;
  }
  html += `</table>`;
  if (b.processes.length) {
    html += `<h2>Processes</h2><table id="processes"><tr><th class="name">process</th><th>pid</th><th>alive</th><th>restarts</th><th>RSS MiB</th><th>CPU s</th><th>threads</th><th>fds</th></tr>`;
    for (const p of b.processes) {
      html += `<tr><td class="name">${esc(p.name)}</td><td>${esc(p.pid)}</td><td>${p.alive ? "yes" : '<span class="error">no</span>'}</td><td>${num(p.restarts)}</td>
        <td>${((p.rss_bytes || 0) / 1048576).toFixed(1)}</td><td>${(p.cpu_seconds || 0).toFixed(1)}</td><td>${esc(p.num_threads)}</td><td>${esc(p.open_fds)}</td></tr>`;
    }
    html += `</table>`;
  }
  if (b.queues.length) {
    html += `<h2>Disk queues</h2><table id="queues"><tr><th class="name">queue</th><th>depth</th><th>cache hits</th><th>cache misses</th>
      <th class="name">chunk: messages, reads, writes (cached)</th></tr>`;
    for (const q of b.queues) {
      const chunks = q.closed ? '<span class="muted">files closed (idle or never written)</span>' : q.chunks.map(c =>
        `#${c.chunk}: ${num(c.messages)}, ${num(c.reads)}, ${num(c.writes)}${c.cached ? " (cached)" : ""}`).join("<br>");
      html += `<tr><td class="name">${esc(q.queue)}</td><td>${num(q.depth)}</td><td>${num(q.cache_hits)}</td><td>${num(q.cache_misses)}</td><td class="name">${chunks}</td></tr>`;
    }
    html += `</table>`;
  }
  if (b.actors.length) {
    const keys = Object.keys(b.actors[0]);
    html += `<h2>Actors</h2><table id="actors"><tr>${keys.map(k => `<th class="name">${esc(k)}</th>`).join("")}</tr>`;
    for (const a of b.actors) html += `<tr>${keys.map(k => `<td class="name">${esc(a[k])}</td>`).join("")}</tr>`;
    html += `</table>`;
  }
  return html;
}

async function lookupdsPage() {
  const ls = await api("lookupds");
  let html = `<h1>Lookup daemons</h1>`;
  if (!ls.length) html += `<p class="muted">The console reads brokers directly (--nsqd-http-address).</p>`;
  for (const l of ls) {
    html += `<h2>${esc(l.address)}</h2>`;
    if (l.error) { html += `<p class="error">${esc(l.error)}</p>`; continue; }
    html += `<table><tr><th class="name">broker</th><th class="name">version</th><th class="name">topics</th><th class="name">tombstoned</th></tr>`;
    for (const n of l.nodes) {
      const topics = n.topics.map(t => `${esc(t)} ${button("tombstone", "tombstone", {topic: t, node: n.node}, true)}`).join(" ");
      html += `<tr><td class="name">${esc(n.node)}</td><td class="name">${esc(n.version)}</td><td class="name">${topics}</td><td class="name">${esc(n.tombstones.join(", "))}</td></tr>`;
    }
    html += `</table>`;
  }
  return html;
}

// -- routing, polling, actions -------------------------------------------------------------

function route() {
  const parts = location.hash.replace(/^#\/?/, "").split("/").filter(p => p).map(decodeURIComponent);
  if (parts[0] === "topic" && parts.length === 2) return () => topicPage(parts[1]);
  if (parts[0] === "topic" && parts.length === 3) return () => channelPage(parts[1], parts[2]);
  if (parts[0] === "broker" && parts.length === 2) return () => brokerPage(parts[1]);
  if (parts[0] === "brokers") return brokers;
  if (parts[0] === "lookupds") return lookupdsPage;
  return overview;
}

async function refresh() {
  clearTimeout(timer);
  const main = document.getElementById("main");
  const focused = document.activeElement && document.activeElement.tagName === "INPUT";
  try {
    const html = await route()();
    if (!focused) main.innerHTML = html;  // (never under a user's typing)
    document.getElementById("status").textContent = "updated " + new Date().toLocaleTimeString();
  } catch (e) {
    main.innerHTML = `<p class="error">${esc(e.message)}</p>`;
  }
  timer = setTimeout(refresh, INTERVAL);
}

async function act(data) {
  const what = data.channel ? `channel ${data.channel} of topic ${data.topic}` : `topic ${data.topic}`;
  const where = data.action === "tombstone" ? ` at broker ${data.node} on every lookup daemon`
    : data.action === "create" ? "" : " on every broker that has it";
  if (!confirm(`${data.action} ${what}${where}?`)) return;
  const r = await fetch(BASE + "api/action", {method: "POST", headers: {"Content-Type": "application/json"}, body: JSON.stringify(data)});
  const body = await r.json().catch(() => ({}));
  const failed = (body.results || []).filter(x => !x.ok);
  if (!r.ok || failed.length) alert("Failed: " + (failed.map(f => f.error).join("; ") || r.statusText));
  if (data.action === "delete") location.hash = data.channel ? "#/topic/" + enc(data.topic) : "#/";
  refresh();
}

document.addEventListener("click", e => {
  const b = e.target.closest("button[data-action]");
  if (b) { e.preventDefault(); act({...b.dataset}); }
});
document.addEventListener("submit", e => {
  e.preventDefault();
  const f = e.target;
  if (f.id === "create-topic") act({action: "create", topic: f.topic.value.trim()});
  if (f.id === "create-channel") act({action: "create", topic: f.dataset.topic, channel: f.channel.value.trim()});
  f.reset();
  document.activeElement.blur();
});
window.addEventListener("hashchange", refresh);
refresh();
