/* RLCharts: the dashboard's charts, drawn by uPlot (vendor/uplot, MIT).
 *
 *   RLCharts.plot(container, spec) -> uPlot
 *     spec: {name, title, x: "step" | "time" | "elapsed", log: bool, smooth: 0..0.99,
 *            series: [{label, color?, points: [{x, y, version?}]}]}
 *     One line per entry of `series` (several runs overlaid share one x scale).
 *     Hover: the legend shows each series' value at the cursor (cursors synced
 *     across charts); drag: zoom on x; double-click: back to the full range.
 *     `smooth` is TensorBoard's debiased EMA weight; the legend then shows
 *     "smoothed (raw)". `log` is a log10 y axis, or asinh (a log that passes
 *     through zero) when a value is <= 0, as a GRPO loss or approximate KL can be;
 *     a chart whose values are all zero stays linear.
 *   RLCharts.sparkline(container, values) -> uPlot
 *   window.rlCharts[name]: the live uPlot instances, for tests and the console.
 */
(function () {
  "use strict";
  const STEP_INCRS = [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000];
  const PALETTE = ["#2f6fed", "#e8590c", "#2b8a3e", "#ae3ec9", "#c92a2a", "#1098ad", "#5c940d", "#862e9c"];
  const SYNC = uPlot.sync("rlgate");
  const registry = (window.rlCharts = window.rlCharts || {});

  function fmt(v) {
    if (v === null || v === undefined || !isFinite(v)) return "–";
    const a = Math.abs(v);
    if (a !== 0 && (a < 1e-3 || a >= 1e5)) return v.toExponential(2);
    if (a >= 100) return v.toFixed(1);
    return v.toFixed(4);
  }

  function fmtElapsed(s) {
    const h = Math.floor(s / 3600), m = Math.floor((s % 3600) / 60), sec = Math.round(s % 60);
    return h ? `${h}h${String(m).padStart(2, "0")}m` : m ? `${m}m${String(sec).padStart(2, "0")}s` : `${sec}s`;
  }

  /* Tick labels: as many decimals as the tick step needs (linear), exponents for tiny or huge
   * values (log and asinh axes, whose steps are not even). */
  function yTicks(u, ticks, axisIdx, space, incr) {
    const linear = u.scales.y.distr === 1;
    const decimals = linear && incr > 0 ? Math.min(Math.max(0, -Math.floor(Math.log10(incr))), 8) : null;
    return ticks.map((v) => {
      if (v === null) return null;  // log axes leave some ticks unlabelled
      const a = Math.abs(v);
      if (v === 0) return "0";
      if (a < 1e-3 || a >= 1e6) return v.toExponential(linear ? 1 : 0);
      if (decimals !== null) return v.toFixed(decimals);
      return String(Number(v.toPrecision(2)));
    });
  }

  /* Debiased EMA (TensorBoard's "smoothing"): nulls stay null and do not move the average. */
  function ema(values, weight) {
    if (!weight) return values.slice();
    let last = 0, n = 0;
    return values.map((v) => {
      if (v === null || v === undefined || !isFinite(v)) return null;
      last = last * weight + (1 - weight) * v;
      n += 1;
      return last / (1 - Math.pow(weight, n));
    });
  }

  /* uPlot wants one shared, sorted x array; uPlot.join aligns the series and fills gaps with null. */
  function align(series) {
    const tables = series.map((s) => {
      const pts = s.points.filter((p) => p.x !== null && isFinite(p.x)).sort((a, b) => a.x - b.x);
      return [pts.map((p) => p.x), pts.map((p) => (p.y === null || p.y === undefined ? null : p.y))];
    });
    if (tables.length === 0) return [[]];
    return tables.length === 1 ? tables[0] : uPlot.join(tables);
  }

  /* Log where it can draw: log10 for positive values, asinh across zero, linear for all zeros. */
  function yScale(log, ys) {
    const finite = ys.flat().filter((v) => v !== null && isFinite(v));
    const nonzero = finite.filter((v) => v !== 0).map(Math.abs);
    if (!log || nonzero.length === 0) return { auto: true };
    if (finite.every((v) => v > 0)) return { distr: 3, log: 10 };
    return { distr: 4, asinh: Math.min(...nonzero) };
  }

  function xAxis(mode) {
    if (mode === "time") return { time: true };
    return { time: false };
  }

  function xValue(mode, versions) {
    return (u, v, si, idx) => {
      if (v === null || v === undefined) return "–";
      if (mode === "time") return new Date(v * 1000).toISOString().slice(11, 19);
      if (mode === "elapsed") return fmtElapsed(v);
      const version = versions[idx];
      return version === undefined ? `step ${v}` : `step ${v} (v${version})`;
    };
  }

  /* uPlot adds window listeners per chart: a redraw destroys the old one, not only its DOM. */
  function clear(container) {
    if (container.rlChart) container.rlChart.destroy();
    container.rlChart = null;
    container.textContent = "";
  }

  function plot(container, spec) {
    const mode = spec.x || "step";
    const raw = align(spec.series);
    const xs = raw[0];
    const smoothed = [xs, ...raw.slice(1).map((ys) => ema(ys, spec.smooth || 0))];
    const versions = {};
    if (spec.series.length === 1) {
      for (const p of spec.series[0].points) versions[p.x] = p.version;
    }
    const versionAt = xs.map((x) => versions[x]);
    const width = Math.max(260, container.clientWidth || 330);
    const opts = {
      title: spec.title,
      width,
      height: spec.height || 190,
      cursor: { sync: { key: SYNC.key, setSeries: true }, drag: { x: true, y: false }, points: { size: 6 } },
      scales: { x: xAxis(mode), y: yScale(spec.log, raw.slice(1)) },
      legend: { live: true },
      axes: [
        mode === "elapsed"
          ? { values: (u, ticks) => ticks.map(fmtElapsed), size: 32 }
          : mode === "step"
            ? { size: 32, incrs: STEP_INCRS }  // whole steps only: no tick at step 0.2
            : { size: 32 },
        { size: 62, values: yTicks },
      ],
      series: [
        { label: mode === "step" ? "step" : mode === "time" ? "time (UTC)" : "elapsed", value: xValue(mode, versionAt) },
        ...spec.series.map((s, i) => ({
          label: s.label,
          stroke: s.color || PALETTE[i % PALETTE.length],
          width: 1.6,
          spanGaps: true,
          points: { show: xs.length <= 60, size: 5 },
          value: (u, v, si, idx) => {
            if (idx === null || idx === undefined) return "–";
            const r = raw[si][idx];
            return spec.smooth ? `${fmt(v)} (${fmt(r)})` : fmt(v);
          },
        })),
      ],
    };
    clear(container);
    const u = (container.rlChart = new uPlot(opts, smoothed, container));
    u.rl = { spec, raw };
    container.dataset.points = String(raw.slice(1).flat().filter((v) => v !== null).length);
    if (spec.name) registry[spec.name] = u;
    return u;
  }

  function sparkline(container, values) {
    const ys = values.filter((v) => v !== null && isFinite(v));
    clear(container);
    container.dataset.points = String(ys.length);
    const opts = {
      width: 90, height: 22, pxAlign: 0,
      cursor: { show: false }, legend: { show: false }, select: { show: false },
      scales: { x: { time: false } },
      axes: [{ show: false }, { show: false }],
      series: [{}, { stroke: PALETTE[0], width: 1.3, points: { show: false } }],
    };
    return (container.rlChart = new uPlot(opts, [ys.map((_, i) => i), ys], container));
  }

  /* Keep charts as wide as their boxes. */
  window.addEventListener("resize", () => {
    for (const u of Object.values(registry)) {
      const box = u.root.parentElement;
      if (box && box.clientWidth) u.setSize({ width: box.clientWidth, height: u.height });
    }
  });

  window.RLCharts = { plot, sparkline, ema, fmt, PALETTE };
})();
