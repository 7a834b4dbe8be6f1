// The pool view: every slot from /slots and the totals from /metrics,
// refreshed once a second while the page is visible.

import { apiFetch, errorOf, requestKey } from "./api.js";

const $ = (id) => document.getElementById(id);
const SVG = "http://www.w3.org/2000/svg";

export const REFRESH_MS = 1000;
//: Tokens/s samples kept for the sparkline: five minutes at one a second.
const HISTORY = 300;

/** Prometheus text exposition -> {name: summed value} (labels summed over). */
export function parseMetrics(text) {
  const totals = {};
  for (const line of text.split("\n")) {
    if (!line || line.startsWith("#")) continue;
    const m = /^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)/.exec(line);
    if (!m) continue;
    const value = Number.parseFloat(m[3]);
    if (Number.isFinite(value)) totals[m[1]] = (totals[m[1]] || 0) + value;
  }
  return totals;
}

function cell(text, className) {
  const td = document.createElement("td");
  td.textContent = text;
  if (className) td.className = className;
  return td;
}

function age(seconds) {
  if (seconds == null) return "—";
  if (seconds < 60) return `${seconds.toFixed(1)} s`;
  if (seconds < 3600) return `${Math.floor(seconds / 60)} m ${Math.floor(seconds % 60)} s`;
  return `${(seconds / 3600).toFixed(1)} h`;
}

/** Any conversation-cache figures a slot reports (fields named *cache*). */
function cacheFigures(slot) {
  return Object.entries(slot)
    .filter(([k, v]) => /cache/.test(k) && k !== "kv_cache_tokens" && v != null)
    .map(([k, v]) => `${k.replace(/_/g, " ")}: ${typeof v === "object" ? JSON.stringify(v) : v}`)
    .join(", ");
}

export class PoolView {
  constructor() {
    this.rates = []; // pool tokens/s, one sample per refresh
    this.visible = false;
    this.needKey = false;
    this.timer = null;
    document.addEventListener("visibilitychange", () => this.schedule(0));
  }

  show(visible) {
    this.visible = visible;
  }

  start() {
    this.schedule(0);
  }

  schedule(delayMs) {
    clearTimeout(this.timer);
    if (document.visibilityState === "hidden") return;
    this.timer = setTimeout(() => this.refresh(), delayMs);
  }

  async refresh() {
    try {
      const [slots, metrics] = await Promise.all([
        this.get("/slots", (r) => r.json()),
        this.get("/metrics", (r) => r.text()),
      ]);
      $("pool-error").textContent = "";
      this.renderSlots(slots);
      this.renderTotals(parseMetrics(metrics), this.sample(slots));
    } catch (err) {
      if (err.status === 401) {
        $("pool-error").textContent = "The pool view needs an API key.";
        $("pool-summary").textContent = "";
        await requestKey();
        this.schedule(0);
        return;
      } else {
        $("pool-error").textContent = `Pool unavailable: ${err.message}`;
      }
    }
    this.schedule(REFRESH_MS);
  }

  async get(path, read) {
    const response = await apiFetch(path);
    if (!response.ok) throw await errorOf(response);
    return read(response);
  }

  renderSlots(slots) {
    const busy = slots.filter((s) => s.is_processing).length;
    $("pool-summary").textContent =
      `${slots.length} slot${slots.length === 1 ? "" : "s"}, ${busy} busy`;
    // Grouped by model (slot order within each), with a heading row per
    // model when the pool serves several.
    const ordered = [...slots].sort((a, b) =>
      (a.model < b.model ? -1 : a.model > b.model ? 1 : a.id - b.id));
    const models = [...new Set(ordered.map((s) => s.model))];
    const rows = [];
    for (const s of ordered) {
      if (models.length > 1 && (rows.length === 0 || rows.at(-1).dataset.model !== s.model)) {
        const group = ordered.filter((o) => o.model === s.model);
        const heading = document.createElement("tr");
        heading.className = "model-group";
        heading.dataset.model = s.model;
        const th = document.createElement("th");
        th.colSpan = 11;
        th.scope = "rowgroup";
        th.textContent = `${s.model}: ${group.length} slot${group.length === 1 ? "" : "s"}, ` +
          `${group.filter((o) => o.is_processing).length} busy`;
        heading.append(th);
        rows.push(heading);
      }
      rows.push(this.slotRow(s));
    }
    $("slots").tBodies[0].replaceChildren(...rows);
  }

  /** One slot's row. */
  slotRow(s) {
    const tr = document.createElement("tr");
    tr.dataset.model = s.model;
    tr.dataset.slot = s.id;
    tr.dataset.state = s.state;
    const kv = document.createElement("td");
    if (s.n_ctx) {
      const meter = document.createElement("meter");
      meter.min = 0;
      meter.max = s.n_ctx;
      meter.value = s.kv_cache_tokens || 0;
      kv.append(meter, ` ${s.kv_cache_tokens || 0}/${s.n_ctx}`);
    }
    tr.append(
      cell(String(s.id)),
      // Paused: its client is not reading; the stall timeout ends it then.
      // Failing: it died and restarts, or is held; the failure says how.
      cell(s.failure ? `${s.state}: ${s.failure}`
        : s.pause_ends_in_s == null ? s.state
        : `${s.state}, paused (${Math.ceil(s.pause_ends_in_s)} s left)`,
      `state ${s.state}${s.failure ? " failing" : ""}`),
      cell(s.host),
      cell(String(s.pid)),
      cell(s.model),
      cell(s.is_processing ? (s.tokens_per_second || 0).toFixed(1) : "—", "num"),
      cell(s.is_processing ? `${s.n_prompt_tokens} / ${s.n_decoded}` : "—", "num"),
      kv,
      cell(cacheFigures(s) || "—"),
      cell(age(s.lease_age_s), "num"),
      cell(String(s.jobs_served), "num"),
    );
    return tr;
  }

  /** Live pool tokens/s: the busy slots' own speeds, from their heartbeats
   * (the /metrics token counter only moves when a job ends). */
  sample(slots) {
    const rate = slots
      .filter((s) => s.is_processing && s.pause_ends_in_s == null)
      .reduce((sum, s) => sum + (s.tokens_per_second || 0), 0);
    this.rates.push(rate);
    if (this.rates.length > HISTORY) this.rates.shift();
    return rate;
  }

  renderTotals(m, rate) {
    const tokens = m.llama_tokens_generated_total || 0;
    const requests = (m.llama_request_success_total || 0) +
      (m.llama_request_fail_total || 0) + (m.llamapool_requests_cancelled_total || 0);
    const figures = [
      ["requests", requests],
      ["failed", m.llama_request_fail_total || 0],
      ["cancelled", m.llamapool_requests_cancelled_total || 0],
      ["prompt tokens", m.llama_prompt_tokens_total || 0],
      ["tokens generated", tokens],
      ["503 no slot", m.llamapool_broker_no_slot_total || 0],
      ["busy slots", `${m.llamapool_slots_busy || 0} / ${m.llamapool_slots_registered || 0}`],
      ["KV use (busy)", `${Math.round((m.llama_kv_cache_usage_level || 0) * 100)} %`],
      ["tokens/s now", rate.toFixed(1)],
    ];
    const dl = $("totals");
    dl.replaceChildren();
    for (const [name, value] of figures) {
      const dt = document.createElement("dt");
      dt.textContent = name;
      const dd = document.createElement("dd");
      dd.textContent = typeof value === "number" ? Math.round(value).toLocaleString() : value;
      dd.dataset.name = name;
      dl.append(dt, dd);
    }
    this.renderSparkline();
  }

  renderSparkline() {
    const svg = $("sparkline");
    const peak = Math.max(1, ...this.rates);
    const n = this.rates.length;
    // The newest sample at the right edge; the width spans the last minute,
    // growing to the whole history (five minutes) as samples come in.
    const span = Math.max(60, n) - 1;
    const points = this.rates.map((r, i) => {
      const x = 300 - ((n - 1 - i) / span) * 300;
      return `${x.toFixed(1)},${(39 - (r / peak) * 38).toFixed(1)}`;
    });
    const line = document.createElementNS(SVG, "polyline");
    line.setAttribute("points", points.join(" "));
    line.setAttribute("class", "spark-line");
    svg.replaceChildren(line);
    const minutes = Math.max(1, Math.round(n / 60));
    $("spark-caption").textContent =
      `tokens/s, last ${n < 60 ? `${n} s` : `${minutes} min`} (peak ${peak.toFixed(1)})`;
  }
}
