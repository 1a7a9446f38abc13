/* Dashboard pages: the runs table (sort, select to compare), a run's charts (training and
 * held-out), the compare view. */
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

  const feedUrl = (runId) => `/dashboard/api/runs/${encodeURIComponent(runId)}/live`;

  function asRun(feed, label) {
    return { label: label || feed.run.name, created_at: feed.run.created_at, points: feed.metrics.points };
  }

  /* Failed metric-sink writes (W&B, MLflow, ...) summed over the run's steps: a warning, not an error. */
  function showSinkErrors(versions) {
    const badge = document.getElementById("sink-errors");
    if (!badge) return;
    const n = versions.reduce((sum, v) => sum + ((v.metrics && v.metrics.sink_errors) || 0), 0);
    badge.hidden = n === 0;
    badge.querySelector(".count").textContent = String(n);
  }

  function runPage(section) {
    RLPanel.start(section, async () => {
      const feed = await fetchJSON(section.dataset.feed);
      setText("run-status", feed.run.status);
      const badge = document.getElementById("run-status");
      if (badge) badge.className = "status " + feed.run.status;
      setText("run-version", feed.run.current_version);
      setText("run-served", feed.run.served_version);
      showSinkErrors(feed.versions);
      RLEvals.draw(section.querySelector("figure.evals"), [{ label: feed.run.name, evals: feed.evals }]);
      return [asRun(feed, null)];
    });
  }

  function comparePage(section) {
    const runs = JSON.parse(section.dataset.runs || "[]");  // [{run_id, label, color}]
    RLPanel.start(section, async () => {
      const feeds = await Promise.all(runs.map((r) => fetchJSON(feedUrl(r.run_id))));
      RLEvals.draw(section.querySelector("figure.evals"), feeds.map((feed, i) => (
        { label: runs[i].label, color: runs[i].color, evals: feed.evals })));
      return feeds.map((feed, i) => ({ ...asRun(feed, runs[i].label), color: runs[i].color }));
    });
  }

  /* Runs table: click a header to sort (again to reverse); the order is kept in the URL (?sort=-key). */
  function sortable(table) {
    const body = table.tBodies[0];
    const headers = [...table.querySelectorAll("th[data-sort]")];
    let key = null, desc = false;

    function value(row, k) {
      const raw = row.dataset[k] === undefined ? "" : row.dataset[k];
      const num = parseFloat(raw);
      return raw !== "" && isFinite(num) && /^-?[\d.e+-]+$/i.test(raw) ? num : raw.toLowerCase();
    }

    function apply() {
      if (!key) return;
      const rows = [...body.querySelectorAll("tr[data-run]")];
      rows.sort((a, b) => {
        const x = value(a, key), y = value(b, key);
        if (x === "" && y !== "") return 1;  // missing values last, either direction
        if (y === "" && x !== "") return -1;
        const c = typeof x === typeof y ? (x < y ? -1 : x > y ? 1 : 0) : String(x).localeCompare(String(y));
        return desc ? -c : c;
      });
      for (const row of rows) body.appendChild(row);
      for (const th of headers) {
        th.setAttribute("aria-sort", th.dataset.sort === key ? (desc ? "descending" : "ascending") : "none");
      }
    }

    function setSort(k, d) {
      key = k;
      desc = d;
      const q = new URLSearchParams(location.search);
      q.set("sort", (desc ? "-" : "") + key);
      history.replaceState(null, "", `${location.pathname}?${q}`);
      apply();
    }

    for (const th of headers) {
      th.addEventListener("click", () => setSort(th.dataset.sort, key === th.dataset.sort ? !desc : false));
    }
    const wanted = new URLSearchParams(location.search).get("sort");
    if (wanted) {
      const k = wanted.replace(/^-/, "");
      if (headers.some((th) => th.dataset.sort === k)) setSort(k, wanted.startsWith("-"));
    }
    return apply;
  }

  function compareSelection(form) {
    const boxes = () => [...document.querySelectorAll(`input[name=run][form=${form.id}]`)];
    const button = form.querySelector("button[type=submit]");
    const update = () => {
      const n = boxes().filter((b) => b.checked).length;
      button.disabled = n < 2;
      button.textContent = n < 2 ? "Compare (pick two or more)" : `Compare ${n} runs`;
    };
    for (const b of boxes()) b.addEventListener("change", update);
    update();
  }

  function runsPage(table) {
    const resort = sortable(table);
    const form = document.getElementById("compare-form");
    if (form) compareSelection(form);
    for (const span of table.querySelectorAll(".spark")) {
      RLCharts.sparkline(span, JSON.parse(span.dataset.values || "[]"));
    }
    async function poll() {
      try {
        const data = await fetchJSON(table.dataset.feed);
        for (const run of data.runs) {
          const row = table.querySelector(`tr[data-run="${CSS.escape(run.run_id)}"]`);
          if (!row) continue;
          for (const cell of row.querySelectorAll("[data-field]")) {
            const v = run[cell.dataset.field];
            cell.textContent = v === null ? "–" :
              cell.dataset.field === "tokens_per_s" ? Math.round(v) :
              cell.dataset.field === "last_reward" ? RLCharts.fmt(v) : v;
            if (cell.dataset.field === "status") cell.className = "status " + v;
          }
          row.dataset.status = run.status;
          row.dataset.version = String(run.current_version);
          row.dataset.lastReward = run.last_reward === null ? "" : String(run.last_reward);
          const spark = row.querySelector(".spark");
          if (spark) RLCharts.sparkline(spark, run.rewards);
        }
        resort();
      } catch (err) {
        console.warn(err);
      }
    }
    setInterval(poll, POLL_MS);
  }

  document.addEventListener("DOMContentLoaded", () => {
    const charts = document.getElementById("charts");
    if (charts && charts.dataset.feed) runPage(charts);
    const compare = document.getElementById("compare");
    if (compare) comparePage(compare);
    const runs = document.getElementById("runs");
    if (runs && runs.dataset.feed) runsPage(runs);
  });
})();
