// Tandem ops console: DOM and inline-SVG helpers (no library). Loaded before console.js; exposes `Tandem`.
"use strict";

const Tandem = (() => {
  const SVG_NS = "http://www.w3.org/2000/svg";

  function append(node, kids) {
    for (const k of kids.flat(Infinity)) {
      if (k === null || k === undefined || k === false) continue;
      node.appendChild(typeof k === "object" ? k : document.createTextNode(String(k)));
    }
    return node;
  }

  function setAttrs(node, attrs) {
    for (const [k, v] of Object.entries(attrs || {})) {
      if (v === null || v === undefined || v === false) continue;
      if (k.startsWith("on")) node.addEventListener(k.slice(2), v);
      else if (k === "text") node.textContent = v;
      else if (k === "style") node.style.cssText = v;   // CSSOM: allowed by the page's CSP, unlike the attribute
      else node.setAttribute(k, v === true ? "" : String(v));
    }
    return node;
  }

  // h("td", {class: "num"}, "12"): an element; text is always set as text, never parsed as HTML
  const h = (tag, attrs, ...kids) => append(setAttrs(document.createElement(tag), attrs), kids);
  const s = (tag, attrs, ...kids) => append(setAttrs(document.createElementNS(SVG_NS, tag), attrs), kids);

  function fmt(v, digits = 3) {
    if (v === null || v === undefined || Number.isNaN(v)) return "–";
    if (typeof v !== "number") return String(v);
    if (Number.isInteger(v)) return v.toLocaleString("en-US");
    return Number(v.toPrecision(digits)).toLocaleString("en-US", {maximumFractionDigits: 6});
  }
  const pct = (v) => (v === null || v === undefined ? "–" : `${fmt(100 * v, 4)} %`);
  // the browser's local time, its zone named (an operator elsewhere read "10:12:54" as UTC)
  const clock = (unixS) => new Date(unixS * 1000).toLocaleTimeString("en-GB", {hour12: false, timeZoneName: "short"});

  // Candidate weight over time as a step line: one point per history entry, then now. steps: dashed guides.
  function weightChart(history, steps, nowWeight, nowS) {
    const W = 420, H = 150, L = 38, R = 10, T = 10, B = 24;
    const pts = history.map((e) => [e.at, e.weight, e.state]);
    if (!pts.length) pts.push([nowS, nowWeight, "running"]);
    const t0 = pts[0][0], t1 = Math.max(nowS, t0 + 10);
    const x = (t) => L + ((t - t0) / (t1 - t0)) * (W - L - R);
    const y = (w) => T + (1 - w / 100) * (H - T - B);
    let d = `M${x(pts[0][0]).toFixed(1)},${y(pts[0][1]).toFixed(1)}`;
    for (let i = 1; i < pts.length; i++) d += `H${x(pts[i][0]).toFixed(1)}V${y(pts[i][1]).toFixed(1)}`;
    d += `H${x(t1).toFixed(1)}V${y(nowWeight).toFixed(1)}`;
    const label = "Candidate weight over time: " + pts.map((p) => `${fmt(p[1])} %`).join(" → ") +
      `, now ${fmt(nowWeight)} %`;
    return s("svg", {class: "chart", viewBox: `0 0 ${W} ${H}`, role: "img", "aria-label": label},
      s("title", {}, label),
      [0, 50, 100].map((w) => s("g", {},
        s("line", {x1: L, x2: W - R, y1: y(w), y2: y(w), class: "axis"}),
        s("text", {x: L - 6, y: y(w) + 4, class: "tick", "text-anchor": "end"}, `${w}%`))),
      (steps || []).filter((w) => w > 0 && w < 100 && w !== 50).map((w) => s("g", {},
        s("line", {x1: L, x2: W - R, y1: y(w), y2: y(w), class: "guide"}),
        // a step's label, unless it would overlap the 0 / 50 / 100 % ones
        Math.min(w, Math.abs(w - 50), 100 - w) >= 8 ?
          s("text", {x: L - 6, y: y(w) + 4, class: "tick", "text-anchor": "end"}, `${w}%`) : null)),
      s("path", {d, class: "line"}),
      pts.map((p) => s("circle", {cx: x(p[0]), cy: y(p[1]), r: 3.5, class: `dot state-${p[2]}`},
        s("title", {}, `${clock(p[0])}: ${fmt(p[1])} % (${p[2]})`))),
      s("text", {x: L, y: H - 6, class: "tick"}, clock(t0)),
      s("text", {x: W - R, y: H - 6, class: "tick", "text-anchor": "end"}, "now"));
  }

  // One horizontal bar per gate: the measured value against its limit (the tick); green held, red failed,
  // grey not measured yet. A *_min gate holds at or above its limit, any other at or below.
  function gatesChart(gates) {
    const names = Object.keys(gates || {});
    const W = 420, row = 30, L = 150, R = 96, H = Math.max(1, names.length) * row + 6;
    const label = "Gates: " + names.map((n) => {
      const g = gates[n];
      const judged = g.ok !== null && g.ok !== undefined;
      return `${n} ${judged ? fmt(g.value) : "not judged yet"} against ${fmt(g.limit)}` +
        (judged ? `, ${g.ok ? "held" : "failed"}` : "");
    }).join("; ");
    const rows = names.map((n, i) => {
      const g = gates[n], top = 4 + i * row;
      const scale = Math.max(g.limit || 0, g.value || 0) * 1.25 || 1;
      const cls = g.ok === null || g.ok === undefined ? "unknown" : g.ok ? "ok" : "bad";
      // a gate not judged yet (too few pairs) has no value to show: its placeholder 0 read as "0 <= 0.05"
      const value = cls === "unknown" ? null : g.value;
      const bw = value === null || value === undefined ? 0 : (value / scale) * (W - L - R);
      const lx = L + ((g.limit || 0) / scale) * (W - L - R);
      const op = n.endsWith("_min") ? "≥" : "≤";
      return s("g", {},
        s("text", {x: L - 8, y: top + 16, class: "gate-name", "text-anchor": "end"}, n.replace(/_(min|max)(_ms)?$/, "")),
        s("rect", {x: L, y: top + 4, width: W - L - R, height: 16, rx: 3, class: "track"}),
        s("rect", {x: L, y: top + 4, width: Math.max(0, bw), height: 16, rx: 3, class: `bar ${cls}`}),
        s("line", {x1: lx, x2: lx, y1: top, y2: top + 24, class: "limit"}),
        s("text", {x: W - R + 8, y: top + 16, class: `gate-val ${cls}`}, `${fmt(value)} ${op} ${fmt(g.limit)}`));
    });
    return s("svg", {class: "chart gates", viewBox: `0 0 ${W} ${H}`, role: "img", "aria-label": label},
      s("title", {}, label), names.length ? rows : s("text", {x: 8, y: 20, class: "tick"}, "no gates"));
  }

  // A route's shares as one stacked bar (the same colour per target position everywhere on the page).
  function shareBar(targets) {
    return h("div", {class: "stack", role: "img",
                     "aria-label": "Shares: " + targets.map((t) => `${t.id} ${fmt(t.share_pct)} %`).join(", ")},
      targets.map((t, i) => h("span", {class: `seg c${i % 6}`, style: `width:${t.share_pct}%`,
                                       title: `${t.id}: ${fmt(t.share_pct)} %`})));
  }

  return {h, s, fmt, pct, clock, weightChart, gatesChart, shareBar};
})();
