/* RLCharts: a small SVG line-chart library written for the rlgate dashboard.
 *
 *   RLCharts.line(container, points, {x: "step" | "time", label})
 *     points: [{x: number (step or epoch ms), y: number | null}], drawn in x order;
 *     nulls are skipped. Draws axes with min/max/mid ticks, a path and point markers.
 *   RLCharts.sparkline(container, values, {width, height})
 */
(function () {
  "use strict";
  const NS = "http://www.w3.org/2000/svg";

  function el(name, attrs, parent) {
    const node = document.createElementNS(NS, name);
    for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, String(v));
    if (parent) parent.appendChild(node);
    return node;
  }

  function extent(values) {
    let lo = Infinity, hi = -Infinity;
    for (const v of values) { if (v < lo) lo = v; if (v > hi) hi = v; }
    if (lo === hi) { const pad = Math.abs(lo) * 0.1 || 1; lo -= pad; hi += pad; }
    return [lo, hi];
  }

  function fmtNumber(v) {
    const a = Math.abs(v);
    if (a !== 0 && (a < 1e-3 || a >= 1e5)) return v.toExponential(1);
    if (a >= 100) return v.toFixed(0);
    if (a >= 1) return v.toFixed(2);
    return v.toFixed(3);
  }

  function fmtTime(ms) {
    const d = new Date(ms);
    return d.toISOString().slice(11, 19);
  }

  function scale(d0, d1, r0, r1) {
    return (v) => r0 + ((v - d0) / (d1 - d0)) * (r1 - r0);
  }

  function line(container, points, opts) {
    const o = Object.assign({ width: 330, height: 170, x: "step" }, opts || {});
    const pts = points.filter((p) => p.y !== null && p.y !== undefined && isFinite(p.y))
      .sort((a, b) => a.x - b.x);
    container.textContent = "";
    const svg = el("svg", {
      class: "rl-chart", width: o.width, height: o.height,
      viewBox: `0 0 ${o.width} ${o.height}`, role: "img",
      "aria-label": o.label || "chart", "data-points": pts.length,
    }, container);
    const m = { left: 48, right: 10, top: 8, bottom: 24 };
    const x0 = m.left, x1 = o.width - m.right, y0 = o.height - m.bottom, y1 = m.top;
    el("line", { class: "axis", x1: x0, y1: y0, x2: x1, y2: y0 }, svg);
    el("line", { class: "axis", x1: x0, y1: y0, x2: x0, y2: y1 }, svg);
    if (pts.length === 0) {
      const t = el("text", { class: "empty", x: (x0 + x1) / 2, y: (y0 + y1) / 2,
        "text-anchor": "middle" }, svg);
      t.textContent = "no data yet";
      return svg;
    }
    const [xa, xb] = extent(pts.map((p) => p.x));
    const [ya, yb] = extent(pts.map((p) => p.y));
    const sx = scale(xa, xb, x0, x1), sy = scale(ya, yb, y0, y1);
    const fx = o.x === "time" ? fmtTime : (v) => String(Math.round(v));
    for (const v of [ya, (ya + yb) / 2, yb]) {
      const t = el("text", { x: x0 - 4, y: sy(v) + 3, "text-anchor": "end" }, svg);
      t.textContent = fmtNumber(v);
      el("line", { class: "axis", x1: x0 - 2, y1: sy(v), x2: x0, y2: sy(v) }, svg);
    }
    const mid = o.x === "step" && xb - xa >= 4 ? [Math.round((xa + xb) / 2)] : [];
    const xticks = [xa, ...mid, xb];
    xticks.forEach((v, i) => {
      const anchor = i === 0 ? "start" : i === xticks.length - 1 ? "end" : "middle";
      const t = el("text", { x: sx(v), y: y0 + 14, "text-anchor": anchor }, svg);
      t.textContent = fx(v);
    });
    const d = pts.map((p, i) => `${i ? "L" : "M"}${sx(p.x).toFixed(1)},${sy(p.y).toFixed(1)}`);
    el("path", { class: "series", d: d.join(" ") }, svg);
    for (const p of pts) {
      const c = el("circle", { class: "pt", cx: sx(p.x).toFixed(1), cy: sy(p.y).toFixed(1),
        r: pts.length > 60 ? 1.2 : 2.4 }, svg);
      const title = el("title", {}, c);
      title.textContent = `${o.x === "time" ? fmtTime(p.x) : "step " + p.x}: ${fmtNumber(p.y)}`;
    }
    return svg;
  }

  function sparkline(container, values, opts) {
    const o = Object.assign({ width: 90, height: 22 }, opts || {});
    const ys = values.filter((v) => v !== null && isFinite(v));
    container.textContent = "";
    const svg = el("svg", { width: o.width, height: o.height, "data-points": ys.length },
      container);
    if (ys.length === 0) return svg;
    const [lo, hi] = extent(ys);
    const sx = scale(0, Math.max(ys.length - 1, 1), 1, o.width - 1);
    const sy = scale(lo, hi, o.height - 2, 2);
    const d = ys.map((v, i) => `${i ? "L" : "M"}${sx(i).toFixed(1)},${sy(v).toFixed(1)}`);
    el("path", { d: d.join(" ") }, svg);
    return svg;
  }

  window.RLCharts = { line, sparkline };
})();
