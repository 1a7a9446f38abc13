/* RLEvals: the held-out reward chart, mean reward by policy version (uPlot, vendor/uplot).
 *
 *   RLEvals.draw(figure, runs)
 *     figure: a `figure.evals` holding a `.plot` box and a `.eval-note` paragraph;
 *     runs: [{label, color?, evals: {data: [{version, episodes, mean_reward, stderr}], spanning}}]
 *       (the `evals` of the run feed, shaped as the admin API's /evals; one entry per run).
 *   One line per run through its per-version means, each with an error bar of one standard
 *   error (none where a version has fewer than two episodes); the legend shows
 *   "mean ± stderr (n=episodes)" at the cursor. The x axis is the version, not the step: a
 *   version's held-out rewards arrive after the step that made it, so this chart is not
 *   cursor-synced with the step charts. Episodes that spanned a swap belong to no version:
 *   the note under the chart gives their figures. With no scored evaluation episode the box
 *   says so instead of drawing.
 *   window.rlCharts.evals: the uPlot instance (absent while empty); `figure.dataset.points`:
 *   how many means are drawn.
 */
(function () {
  "use strict";
  const registry = (window.rlCharts = window.rlCharts || {});
  const EMPTY = "No held-out evaluation yet. Send held-out tasks to the run's base_url " +
    "under /eval (…/eval/v1) and post their rewards: each version's mean reward shows here.";

  /* One shared, sorted x array of versions; per run, its row at each version or null. */
  function align(runs) {
    const versions = [...new Set(runs.flatMap((r) => r.evals.data.map((d) => d.version)))];
    versions.sort((a, b) => a - b);
    const rows = runs.map((r) => {
      const at = new Map(r.evals.data.map((d) => [d.version, d]));
      return versions.map((v) => at.get(v) || null);
    });
    return { versions, rows };
  }

  /* The y range holds every error bar, with a margin (a single value gets one too). */
  function yRange(rows) {
    const ends = rows.flat().filter(Boolean).flatMap((d) => {
      const se = d.stderr || 0;
      return [d.mean_reward - se, d.mean_reward + se];
    });
    let lo = Math.min(...ends), hi = Math.max(...ends);
    const pad = hi > lo ? (hi - lo) * 0.12 : Math.max(Math.abs(hi) * 0.1, 0.5);
    return [lo - pad, hi + pad];
  }

  function errorBars(versions, rows, colors) {
    return (u) => {
      const ctx = u.ctx, px = uPlot.pxRatio, cap = 4 * px;
      ctx.save();
      ctx.beginPath();
      ctx.rect(u.bbox.left, u.bbox.top, u.bbox.width, u.bbox.height);
      ctx.clip();
      ctx.lineWidth = 1.3 * px;
      rows.forEach((row, i) => {
        if (!u.series[i + 1].show) return;
        ctx.strokeStyle = colors[i];
        ctx.beginPath();
        row.forEach((d, j) => {
          if (!d || d.stderr === null || d.stderr === undefined) return;
          const x = u.valToPos(versions[j], "x", true);
          const lo = u.valToPos(d.mean_reward - d.stderr, "y", true);
          const hi = u.valToPos(d.mean_reward + d.stderr, "y", true);
          ctx.moveTo(x, lo); ctx.lineTo(x, hi);
          ctx.moveTo(x - cap, lo); ctx.lineTo(x + cap, lo);
          ctx.moveTo(x - cap, hi); ctx.lineTo(x + cap, hi);
        });
        ctx.stroke();
      });
      ctx.restore();
    };
  }

  function legendValue(d) {
    if (!d) return "–";
    const se = d.stderr === null || d.stderr === undefined ? "" : ` ± ${RLCharts.fmt(d.stderr)}`;
    return `${RLCharts.fmt(d.mean_reward)}${se} (n=${d.episodes})`;
  }

  function spanningNote(runs) {
    const parts = runs.filter((r) => r.evals.spanning).map((r) => {
      const s = r.evals.spanning;
      const who = runs.length > 1 ? `${r.label}: ` : "";
      return `${who}${s.episodes} episode(s) spanned a swap (${legendValue(s)}), not charted`;
    });
    return parts.length ? parts.join("; ") + ": their tokens came from more than one version." : "";
  }

  function clear(box) {
    if (box.rlChart) box.rlChart.destroy();
    box.rlChart = null;
    box.textContent = "";
  }

  function draw(figure, runs) {
    const signature = JSON.stringify(runs.map((r) => [r.label, r.evals]));
    if (!figure || figure.dataset.signature === signature) return;  // polled: redraw on change only
    figure.dataset.signature = signature;
    const box = figure.querySelector(".plot");
    const note = figure.querySelector(".eval-note");
    note.textContent = spanningNote(runs);
    note.hidden = note.textContent === "";
    const { versions, rows } = align(runs);
    clear(box);
    figure.dataset.points = String(rows.flat().filter(Boolean).length);
    if (versions.length === 0) {
      delete registry.evals;
      const empty = document.createElement("p");
      empty.className = "empty dim";
      empty.textContent = EMPTY;
      box.appendChild(empty);
      return;
    }
    const colors = runs.map((r, i) => r.color || RLCharts.PALETTE[i % RLCharts.PALETTE.length]);
    const opts = {
      width: Math.max(260, box.clientWidth || 330),
      height: 190,
      cursor: { drag: { x: false, y: false }, points: { size: 7 } },
      scales: {
        x: { time: false, range: (u, lo, hi) => [lo - 0.5, hi + 0.5] },
        y: { range: () => yRange(rows) },
      },
      legend: { live: true },
      axes: [
        { size: 32, incrs: [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000], values: (u, ticks) => ticks.map((v) => `v${v}`) },
        { size: 62 },
      ],
      series: [
        { label: "version", value: (u, v) => (v === null || v === undefined ? "–" : `v${v}`) },
        ...runs.map((r, i) => ({
          label: r.label,
          stroke: colors[i],
          width: 1.6,
          spanGaps: true,
          points: { show: true, size: 6 },
          value: (u, v, si, idx) => (idx === null || idx === undefined ? "–" : legendValue(rows[i][idx])),
        })),
      ],
      hooks: { draw: [errorBars(versions, rows, colors)] },
    };
    const data = [versions, ...rows.map((row) => row.map((d) => (d ? d.mean_reward : null)))];
    const u = (box.rlChart = new uPlot(opts, data, box));
    u.rl = { runs, rows };
    registry.evals = u;
  }

  window.RLEvals = { draw };
})();
