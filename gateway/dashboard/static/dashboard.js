/* Dashboard pages: draw charts and sparklines, and poll the JSON feeds for live updates. */
(function () {
  "use strict";
  const POLL_MS = 3000;

  async function fetchJSON(url) {
    const r = await fetch(url, { credentials: "same-origin", headers: { Accept: "application/json" } });
    if (!r.ok) throw new Error(`${url}: ${r.status}`);
    return r.json();
  }

  function setText(id, value) {
    const node = document.getElementById(id);
    if (node && value !== undefined) node.textContent = value === null ? "–" : String(value);
  }

  function drawSparks(root) {
    for (const span of root.querySelectorAll(".spark")) {
      RLCharts.sparkline(span, JSON.parse(span.dataset.values || "[]"));
    }
  }

  function runPage(section) {
    let last = null;
    const axis = () => section.querySelector("input[name=xaxis]:checked").value;
    function draw() {
      if (!last) return;
      const mode = axis();
      for (const fig of section.querySelectorAll("figure.chart")) {
        const name = fig.dataset.series;
        const pts = last.metrics.points.map((p) => ({
          x: mode === "time" ? Date.parse(p.time) : p.step,
          y: p.values[name],
        }));
        RLCharts.line(fig.querySelector(".plot"), pts, { x: mode, label: name });
      }
    }
    async function poll() {
      try {
        last = await fetchJSON(section.dataset.feed);
        setText("run-status", last.run.status);
        const badge = document.getElementById("run-status");
        if (badge) badge.className = "status " + last.run.status;
        setText("run-version", last.run.current_version);
        setText("run-served", last.run.served_version);
        draw();
      } catch (err) {
        console.warn(err);
      }
    }
    for (const radio of section.querySelectorAll("input[name=xaxis]")) {
      radio.addEventListener("change", draw);
    }
    poll();
    setInterval(poll, POLL_MS);
  }

  function runsPage(table) {
    async function poll() {
      try {
        const data = await fetchJSON(table.dataset.feed);
        for (const run of data.runs) {
          const row = table.querySelector(`tr[data-run="${run.run_id}"]`);
          if (!row) continue;
          for (const cell of row.querySelectorAll("[data-field]")) {
            const v = run[cell.dataset.field];
            cell.textContent = v === null ? "–" :
              cell.dataset.field === "tokens_per_s" ? Math.round(v) : v;
            if (cell.dataset.field === "status") cell.className = "status " + v;
          }
          const spark = row.querySelector(".spark");
          if (spark) RLCharts.sparkline(spark, run.rewards);
        }
      } catch (err) {
        console.warn(err);
      }
    }
    setInterval(poll, POLL_MS);
  }

  document.addEventListener("DOMContentLoaded", () => {
    drawSparks(document);
    const charts = document.getElementById("charts");
    if (charts) runPage(charts);
    const runs = document.getElementById("runs");
    if (runs && runs.dataset.feed) runsPage(runs);
  });
})();
