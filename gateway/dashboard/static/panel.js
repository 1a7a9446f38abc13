/* RLPanel: a grid of metric charts over one or more runs, with its controls kept in the URL.
 *
 *   RLPanel.start(section, load)
 *     section: holds `.chart-controls` (x axis radios, smoothing slider) and
 *       `figure.chart[data-series]` boxes (each with a `.plot` and a log checkbox);
 *     load: async () -> [{label, color?, created_at, points: [{step, version, time, values}]}]
 *       (one entry per run; polled every three seconds, charts redrawn when a step lands).
 *   URL parameters: x=step|time|elapsed, smooth=0..0.99, log=name,name; the other
 *   parameters (the compare page's run=...) are kept, so the address is a shareable view.
 */
(function () {
  "use strict";
  const POLL_MS = 3000;

  function readState() {
    const q = new URLSearchParams(location.search);
    const x = ["step", "time", "elapsed"].includes(q.get("x")) ? q.get("x") : "step";
    const smooth = Math.min(Math.max(parseFloat(q.get("smooth")) || 0, 0), 0.99);
    const log = q.has("log") ? new Set(q.get("log").split(",").filter(Boolean)) : null;
    return { x, smooth, log };
  }

  function writeState(state) {
    const q = new URLSearchParams(location.search);
    q.set("x", state.x);
    state.smooth ? q.set("smooth", state.smooth.toFixed(2)) : q.delete("smooth");
    q.set("log", [...state.log].join(","));
    history.replaceState(null, "", `${location.pathname}?${q}`);
  }

  function xOf(mode, p, run) {
    if (mode === "step") return p.step;
    const t = Date.parse(p.time) / 1000;
    return mode === "time" ? t : t - Date.parse(run.created_at) / 1000;
  }

  function start(section, load) {
    const figures = [...section.querySelectorAll("figure.chart[data-series]")];
    const state = readState();
    if (state.log === null) {  // first visit: the charts' defaults (loss, KL)
      state.log = new Set(figures.filter((f) => f.dataset.logDefault === "1").map((f) => f.dataset.series));
    }
    let runs = [], signature = "";

    /* A chart the user zoomed keeps its range when new steps land (not when the x axis changes). */
    function zoomOf(u) {
      const xs = u ? u.data[0] : [];
      if (!xs.length) return null;
      const { min, max } = u.scales.x;
      return min > xs[0] || max < xs[xs.length - 1] ? [min, max] : null;
    }

    function draw(keepZoom) {
      for (const fig of figures) {
        const name = fig.dataset.series;
        const old = window.rlCharts && window.rlCharts[name];
        const zoom = keepZoom ? zoomOf(old) : null;
        const u = RLCharts.plot(fig.querySelector(".plot"), {
          name,
          x: state.x,
          log: state.log.has(name),
          smooth: state.smooth,
          series: runs.map((run) => ({
            label: run.label,
            color: run.color,
            points: run.points.map((p) => ({ x: xOf(state.x, p, run), y: p.values[name], version: p.version })),
          })),
        });
        if (zoom) u.setScale("x", { min: zoom[0], max: zoom[1] });
      }
    }

    function syncControls() {
      for (const radio of section.querySelectorAll("input[name=xaxis]")) radio.checked = radio.value === state.x;
      const slider = section.querySelector("input[name=smooth]");
      if (slider) slider.value = String(state.smooth);
      const shown = section.querySelector(".smooth-value");
      if (shown) shown.textContent = state.smooth ? state.smooth.toFixed(2) : "off";
      for (const fig of figures) {
        const box = fig.querySelector("input.log");
        if (box) box.checked = state.log.has(fig.dataset.series);
      }
    }

    function changed() {
      writeState(state);
      syncControls();
      draw(false);
    }

    for (const radio of section.querySelectorAll("input[name=xaxis]")) {
      radio.addEventListener("change", () => { state.x = radio.value; changed(); });
    }
    const slider = section.querySelector("input[name=smooth]");
    if (slider) slider.addEventListener("input", () => { state.smooth = parseFloat(slider.value) || 0; changed(); });
    for (const fig of figures) {
      const box = fig.querySelector("input.log");
      if (!box) continue;
      box.addEventListener("change", () => {
        box.checked ? state.log.add(fig.dataset.series) : state.log.delete(fig.dataset.series);
        changed();
      });
    }

    async function poll() {
      try {
        const fresh = await load();
        const sig = JSON.stringify(fresh.map((r) => [r.label, r.points.length]));
        if (sig !== signature) {
          runs = fresh;
          signature = sig;
          draw(true);
          section.dataset.drawn = String(runs.reduce((n, r) => n + r.points.length, 0));
        }
      } catch (err) {
        console.warn(err);
      }
    }
    syncControls();
    poll();
    setInterval(poll, POLL_MS);
  }

  window.RLPanel = { start };
})();
