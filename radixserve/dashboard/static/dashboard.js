// The radixserve dashboard: polls /dashboard/state about once a second and redraws.
//
// The same page runs on a server (state.kind "server": one column per data-parallel rank's
// scheduler) and on a router (state.kind "router": the router's queue, then one column per worker
// holding that worker's own /dashboard/state). Rates (steps/s, tokens/s, the recent cache hit
// rate) are differences between two polls, so the server keeps counters only.
//
// With --api-key, the key comes from the page's URL: /dashboard#api_key=KEY (a fragment never
// reaches the server's or a proxy's logs) or ?api_key=KEY, else from the box the page shows after
// a 401; it is sent as "Authorization: Bearer KEY". With --admin-api-key the policy switch wants
// the admin key, which also opens /dashboard/state: open the page with that key to switch.
//
// Every figure is drawn into an element with a data-k attribute (data-k="running" ...), which
// is also what the browser test reads.
"use strict";

(() => {
  const POLL_MS = 1000;
  const STEPS_DRAWN = 60; // bars in the step-composition chart (the server keeps a few more)
  const KEY_STORE = "radixserve.dashboard.api_key";

  const $ = (id) => document.getElementById(id);
  let prev = new Map(); // column id -> {time, counters, cache} of the previous poll
  let polls = 0;
  let policyTouched = false; // the admin picked a value that is not applied yet: do not overwrite it

  // --- the API key -----------------------------------------------------------------------------
  function apiKey() {
    const fromHash = new URLSearchParams(location.hash.slice(1)).get("api_key");
    const fromQuery = new URLSearchParams(location.search).get("api_key");
    return fromHash || fromQuery || sessionStorage.getItem(KEY_STORE) || "";
  }

  function headers(extra) {
    const h = Object.assign({}, extra || {});
    const key = apiKey();
    if (key) h.Authorization = "Bearer " + key;
    return h;
  }

  // --- formatting ------------------------------------------------------------------------------
  const esc = (v) => String(v).replace(/[&<>"']/g, (c) =>
    ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" })[c]);
  const int = (n) => (n === null || n === undefined ? "–" : Math.round(n).toLocaleString("en-US"));
  const pct = (x) => (x === null || x === undefined || !isFinite(x) ? "–" : (100 * x).toFixed(1) + "%");
  const ms = (s) => (s === null || s === undefined ? "–" : (1000 * s).toFixed(s < 0.1 ? 1 : 0) + " ms");
  const num = (x, d) => (x === null || x === undefined || !isFinite(x) ? "–" : x.toFixed(d));

  function fig(label, value, key, title) {
    return `<div class="fig"${title ? ` title="${esc(title)}"` : ""}><div class="label">${esc(label)}</div>` +
      `<div class="value" data-k="${key}">${value}</div></div>`;
  }

  function card(title, body, extraClass) {
    return `<div class="card${extraClass ? " " + extraClass : ""}"><h3>${esc(title)}</h3>${body}</div>`;
  }

  function classTable(rows, what, tokens) {
    if (!rows.length) return `<div class="muted">by ${esc(what)}: none</div>`;
    const body = rows.map(([k, n, t]) =>
      `<tr><td>${esc(k === null || k === "" ? (what === "priority" ? "(none)" : "(no tenant)") : k)}</td>` +
      `<td>${int(n)}</td><td>${int(t)}</td></tr>`).join("");
    return `<table><tr><th>${esc(what)}</th><th>requests</th><th>${esc(tokens)}</th></tr>${body}</table>`;
  }

  // --- charts (inline SVG, nothing fetched) --------------------------------------------------------
  function stepsChart(steps) {
    const shown = steps.slice(-STEPS_DRAWN);
    if (!shown.length) return `<div class="muted">no step yet</div>`;
    const W = 300, H = 70, bw = W / STEPS_DRAWN;
    const top = Math.max(1, ...shown.map((s) => s[2] + s[3]));
    const bars = shown.map(([mode, reqs, pre, dec, sec], i) => {
      const x = (i + STEPS_DRAWN - shown.length) * bw;
      const hp = (H * pre) / top, hd = (H * dec) / top;
      const tip = `${mode}: ${reqs} requests, ${pre} prefill + ${dec} decode tokens, ${(1000 * sec).toFixed(1)} ms`;
      return `<g><title>${esc(tip)}</title>` +
        `<rect x="${x.toFixed(1)}" y="${(H - hd).toFixed(1)}" width="${(bw * 0.85).toFixed(1)}" height="${hd.toFixed(1)}" fill="var(--decode)"/>` +
        `<rect x="${x.toFixed(1)}" y="${(H - hd - hp).toFixed(1)}" width="${(bw * 0.85).toFixed(1)}" height="${hp.toFixed(1)}" fill="var(--prefill)"/></g>`;
    }).join("");
    return `<svg viewBox="0 0 ${W} ${H}" preserveAspectRatio="none">${bars}</svg>`;
  }

  function latencyChart(recent) {
    if (!recent.length) return `<div class="muted">no finished request yet</div>`;
    const W = 300, H = 70, n = 100, bw = W / n;
    const top = Math.max(1e-6, ...recent.map((r) => r[1]));
    const bars = recent.slice(-n).map((r, i) => {
      const h = (H * r[1]) / top;
      const tip = `TTFT ${ms(r[1])}, TPOT ${ms(r[2])}, ${r[3]} prompt / ${r[4]} output tokens`;
      return `<rect x="${(i * bw).toFixed(1)}" y="${(H - h).toFixed(1)}" width="${(bw * 0.8).toFixed(1)}" ` +
        `height="${h.toFixed(1)}" fill="var(--decode)"><title>${esc(tip)}</title></rect>`;
    }).join("");
    return `<svg viewBox="0 0 ${W} ${H}" preserveAspectRatio="none">${bars}</svg>`;
  }

  // --- one rank's scheduler ----------------------------------------------------------------------
  function rate(now, before, dt) {
    return before === undefined || dt <= 0 ? null : Math.max(0, now - before) / dt;
  }

  function renderRank(id, r, time) {
    const c = r.counters, kv = r.kv, cache = r.cache, load = r.load;
    const p = prev.get(id);
    const dt = p ? time - p.time : 0;
    const recentHit = p && cache.prompt_tokens > p.cache.prompt_tokens
      ? (cache.cached_tokens - p.cache.cached_tokens) / (cache.prompt_tokens - p.cache.prompt_tokens) : null;
    prev.set(id, { time, counters: c, cache, spec: r.spec });

    const steps = r.steps;
    const modes = { EXTEND: 0, DECODE: 0, MIXED: 0 };
    let pre = 0, dec = 0;
    for (const s of steps) { modes[s[0]] = (modes[s[0]] || 0) + 1; pre += s[2]; dec += s[3]; }
    const last = steps.length ? steps[steps.length - 1] : null;

    const queue = card("Waiting queue",
      `<div class="figs">${fig("waiting", int(r.waiting.requests), "waiting")}` +
      fig("tokens waiting", int(load.num_waiting_tokens), "waiting-tokens") + `</div>` +
      classTable(r.waiting.by_priority, "priority", "tokens to prefill") +
      classTable(r.waiting.by_tenant, "tenant", "tokens to prefill"));

    const running = card("Running batch",
      `<div class="figs">${fig("running", int(r.running.requests), "running")}` +
      fig("max running", int(r.running.max), "running-max") +
      fig("chunked prefill", r.running.chunked ? "yes" : "no", "chunked") + `</div>` +
      classTable(r.running.by_priority, "priority", "KV tokens, shared prefix incl.") +
      classTable(r.running.by_tenant, "tenant", "KV tokens, shared prefix incl."));

    const stepsCard = card(`Last ${steps.length} steps`,
      stepsChart(steps) +
      `<div class="legend"><span><i class="sw prefill"></i>prefill tokens</span><span><i class="sw decode"></i>decode tokens</span></div>` +
      `<div class="figs">${fig("steps/s", num(rate(c.forward_steps, p && p.counters.forward_steps, dt), 1), "steps-rate")}` +
      fig("gen tokens/s", num(rate(c.generated_tokens, p && p.counters.generated_tokens, dt), 1), "gen-rate") +
      fig("prefill / decode / mixed", `${modes.EXTEND} / ${modes.DECODE} / ${modes.MIXED}`, "step-modes") +
      fig("avg prefill tok/step", num(steps.length ? pre / steps.length : null, 1), "avg-prefill") +
      fig("avg decode tok/step", num(steps.length ? dec / steps.length : null, 1), "avg-decode") +
      fig("last step", last ? `${last[0]} ${last[2]}+${last[3]} tok, ${(1000 * last[4]).toFixed(1)} ms` : "–", "last-step") +
      `</div>`);

    const w = (x) => (100 * x / Math.max(1, kv.total)).toFixed(2) + "%";
    const kvCard = card("KV pool",
      `<div class="big" data-k="kv-usage">${pct(kv.usage)}</div>` +
      `<div class="bar"><span class="used" style="width:${w(kv.used)}"></span>` +
      `<span class="evictable" style="width:${w(kv.evictable)}"></span></div>` +
      `<div class="legend"><span><i class="sw used"></i>held by requests</span><span><i class="sw evictable"></i>cached, evictable</span><span><i class="sw free"></i>free</span></div>` +
      `<div class="figs">${fig("used tokens", int(kv.used), "kv-used")}${fig("evictable", int(kv.evictable), "kv-evictable")}` +
      fig("free", int(kv.free), "kv-free") + fig("total", int(kv.total), "kv-total") +
      fig("request slots free", `${int(kv.req_slots_free)} / ${int(kv.req_slots_total)}`, "req-slots") + `</div>`);

    const cacheCard = card(cache.radix ? "Radix cache" : "Prefix cache (off: --disable-radix-cache)",
      `<div class="figs">${fig("size (tokens)", int(cache.size), "tree-size")}` +
      fig("protected", int(cache.protected), "tree-protected") +
      fig("hit rate (since start)", pct(cache.hit_rate), "hit-rate", "cached / prompt tokens of admitted requests") +
      fig("hit rate (last poll)", pct(recentHit), "hit-rate-recent") +
      fig("evicted tokens", int(cache.evicted_tokens), "evicted-tokens") +
      fig("evicted nodes", int(cache.evicted_nodes), "evicted-nodes") + `</div>`);

    const countersCard = card("Preemption and retraction",
      `<div class="figs">${fig("preemptions", int(c.preemptions), "preemptions", "running requests preempted by more important ones")}` +
      fig("retractions", int(c.retractions), "retractions", "decoding requests sent back to the queue for lack of KV") +
      fig("starved", int(c.starved), "starved", "first admitted after --starvation-threshold") +
      fig("deadline rejected", int(c.deadline_rejected), "deadline-rejected") +
      fig("finished", int(c.finished), "finished") + fig("aborted", int(c.aborted), "aborted") + `</div>`);

    return `<div class="grid">${running}${queue}${stepsCard}${kvCard}${cacheCard}${countersCard}${specCard(r.spec, p, dt)}${tierCard(r.tier)}</div>`;
  }

  // the KV tier behind the radix cache, where it is on (--enable-hierarchical-cache)
  function tierCard(t) {
    if (!t) return "";
    const mib = (b) => (b / 1048576).toFixed(1) + " MiB";
    return card(`KV tier (${t.backend}, ${t.write_policy})`,
      `<div class="figs">${fig("held", `${mib(t.used_bytes)} / ${mib(t.capacity_bytes)}`, "tier-used")}` +
      fig("blocks", int(t.blocks), "tier-blocks", `${t.block_tokens} tokens each`) +
      fig("tokens loaded back", int(t.hit_tokens), "tier-hit-tokens", "prompt tokens not computed again") +
      fig("loads", `${int(t.loads)} (${int(t.loading)} now)`, "tier-loads") +
      fig("load p50", t.load_seconds_p50 === null ? "–" : `${(1000 * t.load_seconds_p50).toFixed(1)} ms`, "tier-load-p50") +
      fig("written / loaded", `${mib(t.bytes_written)} / ${mib(t.bytes_loaded)}`, "tier-bytes") +
      fig("failed writes", int(t.write_errors), "tier-write-errors") +
      fig("bad blocks skipped", int(t.corrupt_blocks), "tier-corrupt") + `</div>`);
  }

  // speculative decoding, where it is on: acceptance since start and since the last poll
  function specCard(sp, p, dt) {
    if (!sp) return "";
    const before = p && p.spec;
    const recent = before && sp.draft_tokens > before.draft_tokens
      ? (sp.accepted_tokens - before.accepted_tokens) / (sp.draft_tokens - before.draft_tokens) : null;
    const classes = sp.class_acceptance
      ? fig("learned acceptance, match short / medium / long", sp.class_acceptance.map((a) => pct(a)).join(" / "),
        "spec-classes", "chance a draft is kept, by the length of the n-gram match it came from") : "";
    return card(`Speculative decoding (${esc(sp.algorithm)})`,
      `<div class="figs">${fig("accept rate (since start)", pct(sp.accept_rate), "spec-accept-rate", "accepted / drafted tokens")}` +
      fig("accept rate (last poll)", pct(recent), "spec-accept-recent") +
      fig("tokens per verify", num(sp.accept_length, 2), "spec-accept-length", "accepted drafts + the target's own token, per request and verify step") +
      fig("drafted tokens/s", num(rate(sp.draft_tokens, before && before.draft_tokens, dt), 1), "spec-draft-rate") +
      fig("verify steps", int(sp.verify_steps), "spec-verify-steps") +
      fig("drafted / accepted", `${int(sp.draft_tokens)} / ${int(sp.accepted_tokens)}`, "spec-tokens") +
      fig("most drafts per request / drafting batch", `${int(sp.num_draft_tokens)} / ${int(sp.max_batch_size)}`, "spec-settings") +
      classes + `</div>`);
  }

  // --- one server ----------------------------------------------------------------------------------
  function renderRequests(req) {
    const row = (name, q) => `<tr><td>${name}</td><td>${ms(q.p50)}</td><td>${ms(q.p90)}</td><td>${ms(q.p99)}</td><td>${ms(q.max)}</td></tr>`;
    return card(`Last ${req.count} finished requests`,
      `<table><tr><th></th><th>p50</th><th>p90</th><th>p99</th><th>max</th></tr>` +
      row("TTFT", req.ttft) + row("TPOT", req.tpot) + `</table>` +
      `<div class="muted">TTFT per request, oldest first (aborted since start: <span data-k="req-aborted">${int(req.aborted)}</span>)</div>` +
      latencyChart(req.recent));
  }

  function renderServer(prefix, s) {
    const ranks = s.ranks.map((r) => (s.ranks.length > 1 ? `<h2>rank ${r.dp_rank}</h2>` : "") +
      renderRank(`${prefix}#${r.dp_rank}`, r, s.time)).join("");
    return `<div class="muted">${esc(s.model)} · policy <b data-k="policy">${esc(s.schedule_policy)}</b> · ` +
      `${esc(s.ranks[0].scheduler)} scheduler · up ${int(s.uptime_s)} s</div>` + renderRequests(s.requests) + ranks;
  }

  function renderRouter(s) {
    const rt = s.router;
    const classes = rt.classes.map(([p, t, n]) => [p === null ? "(none)" : p, t || "(no tenant)", n]);
    const classRows = classes.length
      ? `<table><tr><th>priority</th><th>tenant</th><th>waiting</th></tr>` +
        classes.map((c) => `<tr><td>${esc(c[0])}</td><td>${esc(c[1])}</td><td>${int(c[2])}</td></tr>`).join("") + `</table>`
      : `<div class="muted">nobody waits</div>`;
    const routerCard = card(`Router (${s.routing_policy})`,
      `<div class="figs">${fig("waiting in the router", int(rt.waiting), "router-waiting")}` +
      fig("in flight", int(rt.in_flight), "router-in-flight") +
      fig("limit", rt.limit < 0 ? "none" : int(rt.limit), "router-limit") +
      fig("rejected (429)", int(rt.rejected), "router-rejected") + fig("timed out", int(rt.timed_out), "router-timed-out") +
      `</div>` + classRows);
    const cols = s.workers.map((w) => {
      const head = `<h2>${esc(w.url)} <span class="${w.healthy ? "ok" : "bad"}">${w.healthy ? "healthy" : "unhealthy"}</span>` +
        ` <span class="muted">${w.role ? esc(w.role) + " · " : ""}${int(w.in_flight)} in flight from the router</span></h2>`;
      const body = w.state ? renderServer(w.url, w.state) : card("unreachable", esc(w.error || "no answer"), "error");
      return `<div class="column" data-worker="${esc(w.url)}">${head}${body}</div>`;
    }).join("");
    return routerCard + `<div class="columns">${cols}</div>`;
  }

  // --- the policy switch -------------------------------------------------------------------------
  function updatePolicySelect(s) {
    const sel = $("policy-select");
    const names = s.policies || [];
    if (sel.dataset.names !== names.join(",")) {
      sel.innerHTML = names.map((n) => `<option value="${esc(n)}">${esc(n)}</option>`).join("");
      sel.dataset.names = names.join(",");
    }
    if (!policyTouched && s.schedule_policy) sel.value = s.schedule_policy;
  }

  async function switchPolicy(ev) {
    ev.preventDefault();
    const status = $("policy-status");
    const policy = $("policy-select").value;
    status.textContent = `switching to ${policy}…`;
    try {
      const r = await fetch("/set_schedule_policy", {
        method: "POST", headers: headers({ "Content-Type": "application/json" }),
        body: JSON.stringify({ schedule_policy: policy }),
      });
      const body = await r.json().catch(() => ({}));
      if (r.ok && body.success !== false) {
        status.textContent = `now ${policy}`;
        status.className = "ok";
        policyTouched = false;
      } else {
        status.textContent = (body.error && body.error.message) || `failed (HTTP ${r.status})`;
        status.className = "bad";
        if (r.status === 401) $("auth").hidden = false; // --admin-api-key: the admin key opens the switch
      }
    } catch (e) {
      status.textContent = `failed: ${e.message}`;
      status.className = "bad";
    }
    poll(false);
  }

  // --- the loop ------------------------------------------------------------------------------------
  function setStatus(text, bad) {
    const el = $("status");
    el.textContent = text;
    el.className = bad ? "status bad" : "status";
  }

  function render(s) {
    $("kind").textContent = s.kind === "router" ? `router · ${s.workers.length} workers` : "server";
    $("model").textContent = s.kind === "router" ? "" : s.model;
    updatePolicySelect(s);
    $("main").innerHTML = s.kind === "router" ? renderRouter(s) : renderServer("", s);
  }

  let timer = null;
  async function poll(again = true) {
    if (again) timer = null;
    try {
      const r = await fetch("/dashboard/state", { headers: headers(), cache: "no-store" });
      if (r.status === 401) {
        $("auth").hidden = false;
        setStatus("API key needed", true);
      } else if (!r.ok) {
        setStatus(`HTTP ${r.status}`, true);
      } else {
        const s = await r.json();
        $("auth").hidden = true;
        render(s);
        polls += 1;
        document.body.dataset.polls = String(polls);
        setStatus(`updated ${new Date(s.time * 1000).toLocaleTimeString()}`, false);
      }
    } catch (e) {
      setStatus(`unreachable: ${e.message}`, true);
    }
    if (again && timer === null) timer = setTimeout(poll, POLL_MS);
  }

  $("policy-select").addEventListener("change", () => { policyTouched = true; });
  $("policy-form").addEventListener("submit", switchPolicy);
  $("auth").addEventListener("submit", (ev) => {
    ev.preventDefault();
    sessionStorage.setItem(KEY_STORE, $("auth-key").value);
    poll(false);
  });
  poll();
})();
