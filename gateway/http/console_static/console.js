// Tandem ops console: signs in with the admin token, polls the admin API every POLL_MS and steers the gateway
// through it (the calls `tandem ctl` makes). The token lives in this tab's sessionStorage and travels only as a
// bearer header to this origin.
"use strict";

(() => {
  const {h, fmt, pct, clock, weightChart, gatesChart, shareBar} = Tandem;
  const POLL_MS = 2000;
  const TOKEN_KEY = "tandem-admin-token";
  const $ = (id) => document.getElementById(id);
  const ui = {token: sessionStorage.getItem(TOKEN_KEY), paused: false, timer: null, seq: 0, data: {},
              edits: {}, canary: {}, routeCards: {}, rolloutCards: {}};

  class ApiError extends Error {
    constructor(status, message, code) { super(message); this.status = status; this.code = code; }
  }

  // One admin API call; the gateway's error JSON becomes an ApiError with its message and status.
  async function api(method, path, body) {
    const init = {method, headers: {authorization: `Bearer ${ui.token}`}, cache: "no-store"};
    if (body !== undefined) {
      init.headers["content-type"] = "application/json";
      init.body = JSON.stringify(body);
    }
    const r = await fetch(path, init);
    const text = await r.text();
    let data = null;
    try { data = text ? JSON.parse(text) : null; } catch { data = text; }
    if (!r.ok) {
      const msg = data && data.error ? data.error.message : `${r.status} ${r.statusText}`;
      throw new ApiError(r.status, msg, data && data.error ? data.error.code : undefined);
    }
    return data;
  }
  const optional = (p) => p.catch((e) => (e.status === 404 || e.status === 405 ? null : Promise.reject(e)));
  // the rollouts and parity live in Redis: while it is unreachable (503) their panel says so, the rest renders
  const shared = (p) => optional(p).catch((e) => (e.status === 503 ? {unavailable: e.message} : Promise.reject(e)));

  // An action's outcome, fixed at the bottom of the view (console.css); a refusal is an alert (read at once by
  // a screen reader), an outcome a status. It stays until the next action or its close button.
  function notice(text, kind = "info") {
    const n = $("notice");
    n.setAttribute("role", kind === "bad" ? "alert" : "status");
    n.replaceChildren(text, h("button", {type: "button", class: "close", "aria-label": "Dismiss",
                                         onclick: () => n.replaceChildren()}, "×"));
    n.className = `notice ${kind}`;
  }

  // ---- sign in / out -------------------------------------------------------------------------------------
  async function signIn(token) {
    ui.token = token;
    try {
      await api("GET", "/admin/config");
    } catch (e) {
      ui.token = null;
      sessionStorage.removeItem(TOKEN_KEY);
      $("login-error").textContent = e.status === 401 ? `Refused: ${e.message}.` : `Cannot sign in: ${e.message}`;
      $("token").focus();
      return;
    }
    sessionStorage.setItem(TOKEN_KEY, token);
    $("login-error").textContent = "";
    $("login").hidden = true;
    $("main").hidden = false;
    $("signout").hidden = $("pause").hidden = false;
    $("main").focus({preventScroll: true});
    refresh();
  }

  function signOut(message) {
    clearTimeout(ui.timer);
    ui.token = null;
    sessionStorage.removeItem(TOKEN_KEY);
    $("main").hidden = true;
    $("signout").hidden = $("pause").hidden = true;
    $("login").hidden = false;
    liveState("signed out", "");
    $("updated").textContent = "";
    $("login-error").textContent = message || "";
    $("token").value = "";
    $("token").focus();
  }

  // ---- polling -------------------------------------------------------------------------------------------
  // the connection state, announced only when it changes (the time of the last read is not announced)
  function liveState(text, cls) {
    if ($("live").textContent !== text) $("live").textContent = text;
    $("live").className = `pill ${cls}`;
  }

  async function refresh() {
    clearTimeout(ui.timer);
    const seq = ++ui.seq;
    if (!ui.token) return;
    try {
      const [config, usage, limits, rollouts, parity] = await Promise.all([
        api("GET", "/admin/config"), api("GET", "/admin/usage"), optional(api("GET", "/admin/limits")),
        shared(api("GET", "/admin/rollouts")), shared(api("GET", "/admin/parity"))]);
      if (seq !== ui.seq || !ui.token) return;     // a newer read (after an action) supersedes this one
      ui.data = {config, usage, limits, rollouts, parity};
      render();
      liveState(ui.paused ? "paused" : "live", ui.paused ? "paused" : "ok");
      $("updated").textContent = `updated ${clock(Date.now() / 1000)}`;
    } catch (e) {
      if (seq !== ui.seq) return;
      if (e.status === 401) return signOut(`Signed out: ${e.message}.`);
      liveState(`unreachable: ${e.message}`, "bad");
    }
    if (!ui.paused) ui.timer = setTimeout(refresh, POLL_MS);
  }

  // An action through the admin API: a notice with its outcome, then a fresh read.
  async function act(label, method, path, body) {
    try {
      const before = new Set(ui.data ? ui.data.config.warnings : []);
      const out = await api(method, path, body);
      // applied, with what the operator should know: the warnings this change brought (a down backend); those
      // that stood before it are listed under the routes, not repeated with every change
      const all = (out && out.warnings) || [], warnings = all.filter((w) => !before.has(w));
      const standing = all.length - warnings.length;
      notice(`${label}: done${out && out.version !== undefined ? `, config version ${out.version}` : ""}.` +
             warnings.map((w) => ` Warning: ${w}`).join("") +
             (standing ? ` (${standing} standing config warning${standing === 1 ? "" : "s"}: under Routes.)` : ""),
             warnings.length ? "warn" : "ok");
      return out;
    } catch (e) {
      const hint = e.code === "version_conflict"
        ? " (the config moved on meanwhile: the page now shows the current one)" : "";
      notice(`${label} refused: ${e.message}${hint}`, "bad");
      return null;
    } finally {
      await refresh();
    }
  }

  function render() {
    const {config} = ui.data;
    $("version").textContent = `config v${config.version} · ${config.source}` +
      (config.redis_degraded ? " · Redis unreachable" : "") + (config.draining ? " · draining" : "") +
      (config.routes_serving && !config.routes_serving.length ? " · degraded: no route can serve" : "");
    // the config file against the running version (a refused edit, a rollback running another text), as
    // tandem ctl status's header says it; nothing while they agree
    const file = config.file || {}, box = $("file-status");
    const said = file.differs ? `Config file ${file.path || ""}: ${file.status}` : "";
    if (box.dataset.said !== said) {   // changed only when it changes: a live region announces each change
      box.dataset.said = said;
      box.replaceChildren(...(said ? [h("p", {class: file.refused ? "error" : "steer"},
                                        said)] : []));
    }
    const warned = JSON.stringify(config.warnings), list = $("config-warnings");
    if (list.dataset.said !== warned) {   // kept while the same: an operator's open list stays open
      list.dataset.said = warned;
      list.replaceChildren(...(config.warnings.length ? [h("details", {class: "small"},
        h("summary", {}, `${config.warnings.length} config warning${config.warnings.length === 1 ? "" : "s"}`),
        h("ul", {}, ...config.warnings.map((w) => h("li", {}, w))))] : []));
    }
    renderRoutes(config);
    renderHealth(config);
    renderRollouts(ui.data.rollouts, ui.data.parity);
    $("start-rollout").hidden = ui.data.rollouts === null || Boolean(ui.data.rollouts.unavailable);
    syncRolloutForm(config);
    renderTenants(ui.data.usage, ui.data.limits);
    const req = $("explain-request");
    if (!req.value && config.public_models.length) {
      req.value = JSON.stringify({model: config.public_models[0], messages: [{role: "user", content: "Hello"}]}, null, 2);
    }
  }

  // ---- routes: live weights, a canary slider, promote / roll back ----------------------------------------
  function badge(state) {
    return h("span", {class: `badge b-${String(state).replace(/[^a-z_]/g, "")}`}, String(state).replace("_", " "));
  }

  // weights with `target` at `pct` %, the rest shared by the others in their current proportions
  function canaryWeights(route, target, value) {
    const others = route.targets.filter((t) => t.id !== target);
    const total = others.reduce((a, t) => a + t.share_pct, 0);
    const w = {[target]: value};
    for (const t of others) {
      const share = total > 0 ? t.share_pct / total : 1 / others.length;
      w[t.id] = Math.round((100 - value) * share * 100) / 100;
    }
    return w;
  }

  function routeCard(name) {
    const id = name.replace(/[^A-Za-z0-9_-]/g, "_");
    const c = {el: h("article", {class: "route", "aria-labelledby": `route-${id}`}),
               head: h("h3", {id: `route-${id}`}), bar: h("div"), body: h("tbody"), note: h("div"),
               controls: h("div", {class: "canary"})};
    c.select = h("select", {id: `canary-target-${id}`, onchange: () => {
      ui.canary[name] = c.select.value;
      delete ui.edits[name];
      syncSlider(name);
    }});
    c.slider = h("input", {id: `canary-${id}`, type: "range", min: 0, max: 100, step: 1, class: "slider",
                           oninput: () => { ui.edits[name] = Number(c.slider.value); showValue(c); }});
    c.out = h("output", {for: `canary-${id}`, class: "slider-value"});
    const weightsOf = () => ui.data.config.routes[name];
    c.apply = h("button", {type: "button", "aria-label": `Apply canary weight to route ${name}`, onclick: async () => {
      const target = c.select.value, value = Number(c.slider.value);
      delete ui.edits[name];
      await act(`Route ${name}: ${target} to ${value} %`, "POST", "/admin/weights",
                {route: name, weights: canaryWeights(weightsOf(), target, value), base_version: ui.data.config.version});
    }}, "Apply");
    c.promote = h("button", {type: "button", class: "primary", "aria-label": `Promote canary of route ${name}`,
                             onclick: async () => {
      const target = c.select.value;
      if (!window.confirm(`Send all of route ${name}'s traffic to ${target} (100 %)?`)) return;
      delete ui.edits[name];
      await act(`Route ${name}: promote ${target} to 100 %`, "POST", "/admin/weights",
                {route: name, weights: canaryWeights(weightsOf(), target, 100), base_version: ui.data.config.version});
    }}, "Promote");
    c.reset = h("button", {type: "button", class: "ghost", "aria-label": `Reset canary of route ${name}`,
                           onclick: () => { delete ui.edits[name]; syncSlider(name); }}, "Reset");
    append(c.controls, [
      h("div", {class: "field"}, h("label", {for: `canary-target-${id}`}, "Canary target"), c.select),
      h("div", {class: "field grow"}, h("label", {for: `canary-${id}`}, "Canary weight"),
        h("div", {class: "slider-row"}, c.slider, c.out)),
      h("div", {class: "buttons"}, c.apply, c.promote, c.reset)]);
    append(c.el, [h("div", {class: "route-head"}, c.head), c.bar,
      h("div", {class: "scroll"}, h("table", {class: "grid compact", "aria-label": `Targets of route ${name}`},
        h("thead", {}, h("tr", {}, ["Target", "Backend", "Weight", "Share", "Gets now", "Breaker"].map(
          (t, i) => h("th", {scope: "col", class: i > 1 && i < 4 ? "num" : null}, t)))), c.body)),
      c.note, c.controls]);
    return c;
  }

  function append(node, kids) { for (const k of kids) node.appendChild(k); }

  function showValue(c) {
    c.out.textContent = `${c.slider.value} %`;
    c.slider.setAttribute("aria-valuetext", `${c.slider.value} percent to ${c.select.value}`);
  }

  function syncSlider(name) {
    const c = ui.routeCards[name], route = ui.data.config.routes[name];
    const t = route.targets.find((x) => x.id === c.select.value);
    if (name in ui.edits) c.slider.value = ui.edits[name];
    else if (t && document.activeElement !== c.slider) c.slider.value = Math.round(t.share_pct);
    showValue(c);
  }

  function renderRoutes(config) {
    const box = $("routes");
    for (const [name, route] of Object.entries(config.routes)) {
      let c = ui.routeCards[name];
      if (!c) { c = ui.routeCards[name] = routeCard(name); box.appendChild(c.el); }
      c.head.replaceChildren(name, " ", h("span", {class: "muted small"}, `select: ${route.select}`),
        route.fallbacks.length ? h("span", {class: "muted small"}, ` · fallbacks: ${route.fallbacks.join(", ")}`) : "");
      c.bar.replaceChildren(...(route.weights_steer ? [shareBar(route.targets)] : []));   // shares only where weights set them
      const steering = ((ui.data.rollouts && ui.data.rollouts.rollouts) || []).filter(
        (r) => r.route === name && (r.state === "running" || r.state === "paused"));
      const notes = steering.map((r) => h("p", {class: "steer"}, r.state === "running"
        ? `Rollout ${r.name} (running) sets ${r.candidate}'s weight here: pause it before moving the slider.`
        : `Rollout ${r.name} is paused: the weights are yours until it resumes (then its step's weight again).`));
      if (!route.weights_steer) {
        notes.push(h("p", {class: "steer"}, `This route picks ${route.select === "cheapest" ? "the cheapest" :
          "by its SLO, the cheapest predicted in time"} among its targets: a weight only makes a target a ` +
          "choice (above 0) or a spare (0: tried once those fail, before the fallbacks), so there is no " +
          "canary slider."));
      }
      // which layer decides the weights (desired-state.md), as tandem ctl status says it, where not the file alone
      const layer = (config.layers || {})[name];
      if (layer && (layer.decided_by !== "file" || layer.note)) {
        notes.push(h("p", {class: "muted small layer"}, `Weights decided by ${layer.decided_by}` +
          (layer.note ? `: ${layer.note}` : "") + "."));
      }
      c.note.replaceChildren(...notes);
      c.body.replaceChildren(...route.targets.map((t, i) => {
        const br = config.targets[t.id] || {};
        return h("tr", {}, h("th", {scope: "row"}, h("span", {class: `swatch c${i % 6}`, "aria-hidden": "true"}), t.id),
          h("td", {}, t.backend), h("td", {class: "num"}, fmt(t.weight)), h("td", {class: "num"}, route.weights_steer ? `${fmt(t.share_pct)} %` : (t.weight > 0 ? "choice" : "spare")),
          h("td", {class: "num", title: t.out || "serving"}, route.weights_steer ? `${fmt(t.effective_pct)} %` : "–",
            t.out ? h("span", {class: "muted small"}, ` (${t.out})`) : ""),
          h("td", {}, badge(t.out.startsWith("backend unavailable") ? "unavailable" : (br.breaker || "unknown"))));
      }));
      const ids = route.targets.map((t) => t.id);
      c.controls.hidden = ids.length < 2 || !route.weights_steer;
      if (!ids.includes(ui.canary[name])) {   // default canary: the smallest share (the last on a tie)
        ui.canary[name] = route.targets.reduce((a, t) => (t.share_pct <= a.share_pct ? t : a)).id;
      }
      if (c.select.options.length !== ids.length || [...c.select.options].some((o, i) => o.value !== ids[i])) {
        c.select.replaceChildren(...ids.map((i) => h("option", {value: i}, i)));
      }
      c.select.value = ui.canary[name];
      syncSlider(name);
    }
    for (const name of Object.keys(ui.routeCards)) {
      if (!(name in config.routes)) { ui.routeCards[name].el.remove(); delete ui.routeCards[name]; }
    }
    $("history").replaceChildren(...[...config.history].reverse().map((v) => h("tr", {},
      h("td", {class: "num"}, v.version), h("td", {}, v.source),
      h("td", {}, new Date(v.created * 1000).toLocaleString("en-GB", {timeZoneName: "short"})),
      h("td", {}, Object.entries(v.overrides || {}).map(([r, w]) =>
        `${r}: ${Object.entries(w).map(([t, x]) => `${t}=${fmt(x)}`).join(", ")}`).join("; ") || "–"))));
    $("rollback").disabled = config.history.length < 2;
  }

  // ---- health --------------------------------------------------------------------------------------------
  function renderHealth(config) {
    $("backends").replaceChildren(...Object.entries(config.backends).map(([n, b]) => h("tr", {},
      h("th", {scope: "row"}, n), h("td", {}, b.type), h("td", {}, badge(b.available ? "available" : "unavailable")),
      h("td", {class: "why"}, b.reason || ""))));
    $("breakers").replaceChildren(...Object.entries(config.targets).map(([id, t]) => h("tr", {},
      h("th", {scope: "row"}, id), h("td", {}, badge(t.breaker), t.reason ? h("span", {class: "why"}, ` ${t.reason}`) : ""),
      h("td", {class: "num"}, t.breaker === "open" ? `${fmt(t.retry_after_s)} s` : "–"),
      h("td", {}, t.last_probe ? `${t.last_probe.ok ? "ok" : "failed"} ${t.last_probe.at || ""}` : "–"))));
  }

  // ---- rollouts and shadows --------------------------------------------------------------------------------

  function parityTable(p) {
    if (!p) return h("p", {class: "muted"}, "No parity report yet.");
    const side = (k) => p[k] || {};
    const stats = [
      ["Compared", `${fmt(p.compared)} of ${fmt(p.requests)} (${p.kind})`],
      ["Exact match", pct(p.exact_share)], ["Token agreement", pct(p.token_agreement)],
      ["First divergence p50 / p90", `${fmt(p.first_divergence?.p50)} / ${fmt(p.first_divergence?.p90)}`],
      ["Logprob Δ p50", fmt(p.logprob_delta_p50)], ["Mean KL", fmt(p.mean_kl)], ["Length ratio", fmt(p.length_ratio)],
      ["Shadow dropped", fmt(p.shadow_dropped)]];
    return h("div", {class: "parity"},
      h("dl", {}, stats.map(([k, v]) => [h("dt", {}, k), h("dd", {}, v)])),
      h("table", {class: "grid compact", "aria-label": "Primary against candidate"},
        h("thead", {}, h("tr", {}, h("th", {scope: "col"}, ""), h("th", {scope: "col", class: "num"}, "Errors"),
          h("th", {scope: "col", class: "num"}, "TTFT p50"), h("th", {scope: "col", class: "num"}, "TTFT p95"),
          h("th", {scope: "col", class: "num"}, "TPOT p50"))),
        h("tbody", {}, ["primary", "candidate"].map((k) => h("tr", {}, h("th", {scope: "row"}, k),
          h("td", {class: "num"}, pct(side(k).error_rate)), h("td", {class: "num"}, `${fmt(side(k).ttft_p50_ms)} ms`),
          h("td", {class: "num"}, `${fmt(side(k).ttft_p95_ms)} ms`),
          h("td", {class: "num"}, `${fmt(side(k).tpot_p50_ms)} ms`))))));
  }

  function rolloutCard(name) {
    const c = {el: h("article", {class: "rollout", "aria-label": `Rollout ${name}`}),
               head: h("div", {class: "rollout-head"}),
               body: h("div", {class: "rollout-body"}), buttons: {}};
    const bar = h("div", {class: "buttons"});
    // release: a promoted rollout hands its route back to the file and the operators (desired-state.md)
    for (const action of ["pause", "resume", "promote", "abort", "release"]) {
      const label = action[0].toUpperCase() + action.slice(1);
      c.buttons[action] = h("button", {type: "button", "aria-label": `${label} rollout ${name}`,
        class: action === "abort" ? "danger" : action === "promote" ? "primary" : "",
        onclick: () => {   // the three that end it ask first; pause and resume are undone by each other
          if (["promote", "abort", "release"].includes(action) &&
              !window.confirm(`${label} rollout ${name}? It ends the rollout` + (action === "release"
                ? "; its split stays, and the route's weights are yours and the file's again." : "."))) {
            return;
          }
          act(`Rollout ${name}: ${action}`, "POST", `/admin/rollouts/${encodeURIComponent(name)}/${action}`);
        }},
        label);
      bar.appendChild(c.buttons[action]);
    }
    c.el.append(c.head, c.body, bar);
    return c;
  }

  function renderRollouts(rollouts, parity) {
    const box = $("rollouts");
    if (rollouts === null || rollouts.unavailable) {
      box.replaceChildren(h("p", {class: rollouts ? "reason" : "muted"}, rollouts
        ? `Rollouts cannot be read now: ${rollouts.unavailable}`
        : "This gateway has no rollout controller."));
      ui.rolloutCards = {};
      return;
    }
    const list = rollouts.rollouts || [];
    if (!list.length) {
      box.replaceChildren(h("p", {class: "muted"},
        "No rollouts. Declare one under rollouts: in the config, or start one with tandem ctl rollout start."));
      ui.rolloutCards = {};
    } else {
      box.querySelector(":scope > p")?.remove();
    }
    const now = Date.now() / 1000;
    for (const r of list) {
      let c = ui.rolloutCards[r.name];
      if (!c) { c = ui.rolloutCards[r.name] = rolloutCard(r.name); box.appendChild(c.el); }
      // the step the candidate is at (none after a rollback below the first step)
      const at = r.steps[r.step_index] === r.weight ? r.step_index : -1;
      const ladder = h("ol", {class: "ladder", "aria-label": "Steps"}, r.steps.map((w, i) => h("li", {
        class: i < r.step_index && r.steps[i] <= r.weight ? "done" : i === at ? "current" : "",
        "aria-current": i === at ? "step" : null}, `${fmt(w)} %`)));
      // the hold counts from the first check at which every gate was judged and held (held_since), not the step
      const held = r.state !== "running" ? "" : r.held_since === null || r.held_since === undefined
        ? ` · gates not all judged and held yet (step for ${fmt(Math.max(0, now - r.step_since), 2)} s)`
        : ` · held ${fmt(Math.max(0, now - r.held_since), 2)} s of ${fmt(r.hold_s)} s`;
      // paused, the route's weights are the operators': say what the candidate gets now where it is not the step's
      const live = (((ui.data.config.routes || {})[r.route] || {}).targets || []).find((t) => t.id === r.candidate);
      const now_gets = r.state === "paused" && live && live.weight !== r.weight
        ? ` · the route gives it ${fmt(live.weight)} now (paused: the weights are yours)` : "";
      c.head.replaceChildren(h("h3", {}, r.name), badge(r.state),
        h("span", {class: "muted"}, `route ${r.route}: ${r.baseline} → ${r.candidate} at `,
          h("strong", {class: "rollout-weight"}, `${fmt(r.weight)} %`), held, now_gets), ladder,
        r.reason ? h("p", {class: "reason"}, r.reason) : "");
      c.body.replaceChildren(
        h("figure", {}, h("figcaption", {}, "Candidate weight"), weightChart(r.history || [], r.steps, r.weight, now)),
        h("figure", {}, h("figcaption", {}, "Gates"), gatesChart(r.gates)),
        h("figure", {class: "wide"}, h("figcaption", {}, "Parity"), parityTable(r.parity)));
      for (const [a, b] of Object.entries(c.buttons)) b.disabled = !(r.actions || []).includes(a);   // the server's
    }
    const names = new Set(list.map((r) => r.name));
    for (const name of Object.keys(ui.rolloutCards)) {
      if (!names.has(name)) { ui.rolloutCards[name].el.remove(); delete ui.rolloutCards[name]; }
    }
    const shadows = Object.entries((parity && parity.reports) || {}).filter(([n]) => !names.has(n));
    $("shadows").replaceChildren(...shadows.map(([n, p]) => h("article", {class: "rollout", "aria-label": `Shadow ${n}`},
      h("div", {class: "rollout-head"}, h("h3", {}, n), badge("shadow")), parityTable(p))));
  }

  // The start form's route and candidate choices follow the live config (left alone while being used).
  function syncRolloutForm(config) {
    const fill = (sel, values) => {
      if (document.activeElement === sel) return;
      const keep = sel.value;
      if ([...sel.options].map((o) => o.value).join("\n") !== values.join("\n")) {
        sel.replaceChildren(...values.map((v) => h("option", {value: v}, v)));
      }
      if (values.includes(keep)) sel.value = keep;
    };
    fill($("ro-route"), Object.keys(config.routes));
    const route = config.routes[$("ro-route").value];
    fill($("ro-candidate"), route ? route.targets.map((t) => t.id) : []);
  }

  async function startRollout(ev) {
    ev.preventDefault();
    const num = (id) => ($(id).value === "" ? null : Number($(id).value));
    const steps = $("ro-steps").value.split(/[,\s]+/).filter(Boolean).map(Number);
    const gates = {parity_min: num("ro-parity"), error_rate_max: num("ro-errors"), ttft_p95_max_ms: num("ro-ttft"),
                   ttft_p50_ratio_max: num("ro-ttft-ratio"),
                   min_compared: num("ro-min")};
    for (const k of Object.keys(gates)) if (gates[k] === null) delete gates[k];
    const name = $("ro-name").value.trim();
    const out = await act(`Start rollout ${name}`, "POST", "/admin/rollouts", {
      name, route: $("ro-route").value, candidate: $("ro-candidate").value, steps, hold_s: num("ro-hold"), gates});
    if (out) $("start-rollout").open = false;
  }

  // ---- tenants -------------------------------------------------------------------------------------------
  function renderTenants(usage, limits) {
    const lim = (limits && limits.tenants) || {}, budgets = usage.budgets || {};
    const names = [...new Set([...Object.keys(usage.tenants), ...Object.keys(budgets), ...Object.keys(lim)])].sort();
    $("usage-span").textContent = (usage.since === usage.until ? `today (${usage.until}, UTC)`
      : `${usage.since} – ${usage.until}`) + (usage.partial ? ` — partial: ${usage.partial}` : "");
    const per = (l) => [l.rpm ? `${fmt(l.rpm)} rpm` : "", l.tpm ? `${fmt(l.tpm)} tpm` : ""].filter(Boolean).join(" · ");
    $("tenants").replaceChildren(...names.map((t) => {
      const u = usage.tenants[t] || {}, b = budgets[t], l = lim[t];
      let budget = h("span", {class: "muted"}, "none");
      if (b) {
        const used = b.budget_usd > 0 ? Math.min(1, (b.spent_usd + b.reserved_usd) / b.budget_usd) : 1;
        budget = h("div", {class: "budget"},
          h("div", {class: `meter ${used >= 1 ? "bad" : used >= 0.8 ? "warn" : "ok"}`, role: "meter", "aria-valuemin": 0,
                    "aria-valuemax": b.budget_usd, "aria-valuenow": b.spent_usd, "aria-label": `Budget of ${t}`,
                    "aria-valuetext": `$${fmt(b.spent_usd)} spent of $${fmt(b.budget_usd)} per ${b.period}`},
            h("span", {style: `width:${(100 * used).toFixed(1)}%`})),
          h("span", {class: "small"}, `$${fmt(b.spent_usd, 4)} of $${fmt(b.budget_usd)} / ${b.period}` +
            (b.reserved_usd ? ` (+$${fmt(b.reserved_usd, 3)} reserved)` : "")));
      }
      const keys = l ? l.keys.filter((k) => k.rpm || k.tpm).map(per) : [];
      const limitText = l ? [per(l) || "no tenant limit", keys.length ? `per key: ${keys.join("; ")}` : "",
                             `${l.keys.length} key${l.keys.length === 1 ? "" : "s"}`].filter(Boolean).join(" · ") : "–";
      const windowText = l && (l.rpm || l.tpm || keys.length) ? ` (${fmt(limits.window_s)} s window)` : "";
      const failed = u.failed_requests ? ` (${fmt(u.failed_requests)} failed)` : "";
      return h("tr", {}, h("th", {scope: "row"}, t), h("td", {class: "num"}, fmt(u.requests || 0) + failed),
        h("td", {class: "num"}, `${fmt(u.prompt_tokens || 0)} / ${fmt(u.completion_tokens || 0)}`),
        h("td", {class: "num"}, `$${fmt(u.cost_usd || 0, 4)}`), h("td", {}, budget),
        h("td", {class: "small"}, limitText + windowText));
    }));
    if (!names.length) $("tenants").replaceChildren(h("tr", {}, h("td", {colspan: 6, class: "muted"}, "No usage yet.")));
  }

  // ---- route explain -------------------------------------------------------------------------------------
  async function explain(ev) {
    ev.preventDefault();
    const out = $("explain-result");
    let request, headers;
    try {
      request = JSON.parse($("explain-request").value);
      headers = JSON.parse($("explain-headers").value || "{}");
    } catch (e) {
      out.replaceChildren(h("p", {class: "error", role: "alert"}, `Not valid JSON: ${e.message}`));
      return;
    }
    try {
      const d = await api("POST", "/admin/explain", {request, headers, tenant: $("explain-tenant").value});
      const order = (d.decision.attempts || []).map((a) => a.id);
      out.replaceChildren(
        h("p", {class: "decision"}, "Goes to ", h("strong", {class: "chosen"}, d.decision.chosen || "nothing"),
          order.length > 1 ? ` then ${order.slice(1).join(", ")}` : "",
          ` (route ${d.decision.route}); model ${d.model} → ${d.public_model}, priority ${d.priority}, ` +
          `${d.prompt_tokens} prompt tokens, tenant ${d.tenant || "anonymous"}, config v${d.config_version}`),
        h("pre", {class: "explanation"}, d.explanation),
        Object.keys(d.breakers).length ? h("p", {class: "small"}, "Breakers: ",
          Object.entries(d.breakers).map(([t, st], i) => [i ? " · " : "", `${t} `, badge(st)])) : "",
        ...Object.entries(d.unavailable).map(([b, why]) => h("p", {class: "small"}, `Unavailable ${b}: ${why}`)));
    } catch (e) {
      // a 401 is the pasted request's own (its client key) unless the admin token itself is now refused
      if (e.status === 401 && !(await api("GET", "/admin/config").then(() => true, () => false))) {
        return signOut(`Signed out: ${e.message}.`);
      }
      const hint = e.status === 401 && !$("explain-tenant").value
        ? " Fill in Tenant to explain it as that tenant's request, or add its key to Headers." : "";
      const said = e.message.replace(/\.$/, "");
      out.replaceChildren(h("p", {class: "error", role: "alert"}, `Refused (${e.status}): ${said}.${hint}`));
    }
  }

  // ---- wiring --------------------------------------------------------------------------------------------
  document.addEventListener("DOMContentLoaded", () => {
    $("login-form").addEventListener("submit", (ev) => { ev.preventDefault(); signIn($("token").value); });
    $("signout").addEventListener("click", () => signOut("Signed out."));
    $("pause").addEventListener("click", () => {
      ui.paused = !ui.paused;
      $("pause").setAttribute("aria-pressed", String(ui.paused));
      $("pause").textContent = ui.paused ? "Resume updates" : "Pause updates";
      refresh();
    });
    $("rollback").addEventListener("click", () => {
      const v = ui.data.config.version;
      if (window.confirm(`Roll config version ${v} back to the version before it, on every replica?`)) {
        act("Roll back", "POST", "/admin/rollback", {base_version: v});
      }
    });
    $("explain-form").addEventListener("submit", explain);
    $("rollout-form").addEventListener("submit", startRollout);
    $("ro-route").addEventListener("change", () => syncRolloutForm(ui.data.config));
    if (ui.token) signIn(ui.token); else $("token").focus();
  });
})();
