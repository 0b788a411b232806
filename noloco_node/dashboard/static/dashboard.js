/* Shared helpers for the noloco-node dashboards: JSON polling, number formatting, DOM building
   (text only: every string from the JSON goes through textContent, never markup) and uPlot charts
   that update in place. No build step, no dependencies besides the vendored uPlot. */
(function () {
  "use strict";
  const D = {};

  /* ---------- DOM ---------- */

  // el("div", {class: "x", text: "...", "data-stage": 1}, child, "text", ...): strings become text nodes.
  D.el = function (tag, props, ...kids) {
    const node = document.createElement(tag);
    if (props) {
      for (const [key, value] of Object.entries(props)) {
        if (value === null || value === undefined || value === false) continue;
        if (key === "text") node.textContent = String(value);
        else if (key === "class") node.className = value;
        else node.setAttribute(key, String(value));
      }
    }
    for (const kid of kids.flat()) {
      if (kid === null || kid === undefined || kid === false) continue;
      node.append(kid instanceof Node ? kid : String(kid));
    }
    return node;
  };

  D.byId = (id) => document.getElementById(id);

  // Fills a <dl> with [label, value] pairs; value is a string or a Node (null pairs are skipped).
  D.fillFacts = function (dl, pairs) {
    dl.replaceChildren(...pairs.filter(Boolean).map(([label, value, title]) =>
      D.el("div", null, D.el("dt", {text: label}), D.el("dd", {title: title}, value))));
  };

  /* ---------- numbers ---------- */

  D.isNum = (v) => typeof v === "number" && Number.isFinite(v);
  const DASH = "–";

  D.fmtNum = function (v, digits = 1) {
    if (!D.isNum(v)) return DASH;
    return v.toLocaleString("en-US", {maximumFractionDigits: digits, minimumFractionDigits: 0});
  };
  D.fmtFixed = (v, digits) => (D.isNum(v) ? v.toFixed(digits) : DASH);
  D.fmtInt = (v) => (D.isNum(v) ? Math.round(v).toLocaleString("en-US") : DASH);

  // 9.1e12, "FLOP" -> "9.1 TFLOP"; 123456, "" -> "123.5 k"
  D.fmtSI = function (v, unit = "", digits = 1) {
    if (!D.isNum(v)) return DASH;
    const prefixes = ["", "k", "M", "G", "T", "P", "E", "Z"];
    let i = 0, x = Math.abs(v);
    while (x >= 999.95 && i < prefixes.length - 1) { x /= 1000; i++; }
    const num = i === 0 ? D.fmtNum(x, digits) : x.toFixed(digits);
    const suffix = (prefixes[i] + unit);
    return (v < 0 ? "-" : "") + num + (suffix ? " " + suffix : "");
  };

  // Decimal bytes: "123.5 MB", "1.02 GB".
  D.fmtBytes = function (v) {
    if (!D.isNum(v)) return DASH;
    const units = ["B", "kB", "MB", "GB", "TB", "PB"];
    let i = 0, x = v;
    while (x >= 1000 && i < units.length - 1) { x /= 1000; i++; }
    return (i === 0 ? String(Math.round(x)) : x.toFixed(x >= 100 ? 0 : x >= 10 ? 1 : 2)) + " " + units[i];
  };

  D.fmtGiB = function (v) {
    if (!D.isNum(v)) return DASH;
    const g = v / 1073741824;
    return g.toFixed(g >= 10 ? 1 : g >= 0.1 ? 2 : 3) + " GiB";
  };

  // Seconds -> "0.4 s", "42 s", "5 min", "2 h 05 min", "3 d 4 h".
  D.fmtDuration = function (s) {
    if (!D.isNum(s)) return DASH;
    s = Math.max(0, s);
    if (s < 10) return s.toFixed(1) + " s";
    if (s < 60) return Math.round(s) + " s";
    if (s < 3600) return Math.floor(s / 60) + " min " + String(Math.floor(s % 60)).padStart(2, "0") + " s";
    if (s < 86400) return Math.floor(s / 3600) + " h " + String(Math.floor((s % 3600) / 60)).padStart(2, "0") + " min";
    return Math.floor(s / 86400) + " d " + Math.floor((s % 86400) / 3600) + " h";
  };

  D.fmtTime = function (unix) {
    if (!D.isNum(unix)) return DASH;
    return new Date(unix * 1000).toLocaleTimeString("en-GB", {hour12: false});
  };
  D.fmtDateTime = function (unix) {
    if (!D.isNum(unix)) return DASH;
    const d = new Date(unix * 1000);
    return d.toLocaleDateString("en-CA") + " " + d.toLocaleTimeString("en-GB", {hour12: false});
  };

  D.str = (v) => (v === null || v === undefined ? "" : String(v));
  D.shortId = (id) => { const s = D.str(id); return s.length > 8 ? s.slice(-8) : s; };
  D.shortHash = (h) => { const s = D.str(h); return s.length > 10 ? s.slice(0, 10) + "…" : s; };

  /* ---------- pills ---------- */

  const STATUSES = ["joining", "serving", "matching", "leaving"];
  const REACHES = ["direct", "holepunched", "relayed"];
  D.statusTag = function (status) {
    const s = D.str(status) || "unknown";
    return D.el("span", {class: "tag" + (STATUSES.includes(s) ? " status-" + s : ""), text: s, title: "status: " + s});
  };
  D.reachTag = function (reach) {
    const r = D.str(reach) || "unknown";
    const text = r === "relayed" ? "⚠ relayed" : r;
    return D.el("span", {class: "tag" + (REACHES.includes(r) ? " reach-" + r : ""), text: text,
      title: r === "relayed" ? "reached only through a relay: forward its port (see noloco-node doctor)" : "reach: " + r});
  };

  /* ---------- colours: stable per key, in order of first appearance ---------- */

  const PALETTE = ["#2f6fde", "#e8710a", "#1b9e77", "#d62728", "#7b3fb8", "#8c564b",
                   "#d63fa8", "#0f9bb0", "#6b7a12", "#555f6b"];
  const colours = new Map();
  D.colorFor = function (key) {
    if (!colours.has(key)) {
      const i = colours.size;
      colours.set(key, i < PALETTE.length ? PALETTE[i] : "hsl(" + Math.round((i * 137.508) % 360) + ", 65%, 42%)");
    }
    return colours.get(key);
  };

  /* ---------- fetching and the poll loop ---------- */

  D.getJSON = async function (path, timeoutMs = 8000) {
    const ctl = new AbortController();
    const timer = setTimeout(() => ctl.abort(), timeoutMs);
    let resp;
    try {
      resp = await fetch(path, {cache: "no-store", signal: ctl.signal, headers: {Accept: "application/json"}});
    } catch (e) {
      const err = new Error("connection lost");
      err.kind = "network";
      throw err;
    } finally {
      clearTimeout(timer);
    }
    if (!resp.ok) {
      const err = new Error(path + " answered " + resp.status);
      err.kind = "http";
      throw err;
    }
    return resp.json();
  };

  // Calls refresh() now and every intervalMs after it settles; a failure shows the banner and the
  // loop goes on. The page never reloads.
  D.poll = function (refresh, intervalMs = 2000) {
    const banner = D.byId("banner");
    let failures = 0;
    async function tick() {
      try {
        await refresh();
        failures = 0;
        if (banner) banner.hidden = true;
        document.body.setAttribute("data-updated", new Date().toISOString());
      } catch (e) {
        failures++;
        if (banner) {
          const why = e && e.kind === "http" ? " (" + e.message + ")"
            : e && e.kind === "network" ? "" : " (could not show the data: " + D.str(e && e.message) + ")";
          banner.textContent = "Connection lost, retrying every " + intervalMs / 1000 + " s" + why +
            (failures > 1 ? " · " + failures + " tries" : "");
          banner.hidden = false;
        }
      } finally {
        setTimeout(tick, intervalMs);
      }
    }
    tick();
  };

  /* ---------- charts ---------- */

  const charts = new Set();
  let resizeTimer = null;
  window.addEventListener("resize", () => {
    clearTimeout(resizeTimer);
    resizeTimer = setTimeout(() => charts.forEach((c) => c.resize()), 150);
  });

  // A uPlot chart in `container` fed with series [{key, label, color, points: [[x, y], ...]}].
  // Points with a missing x or y are dropped; until there are two distinct x values the chart shows
  // a line of text instead of a plot (uPlot wants a range). The plot is updated in place with
  // setData while the set of series stays the same, and rebuilt when it changes.
  class LiveChart {
    constructor(container, opts = {}) {
      this.container = container;
      this.opts = Object.assign({height: 220, yFmt: (v) => D.fmtNum(v, 2), yMinZero: false,
                                 legend: true, empty: "Waiting for data…"}, opts);
      this.plot = null;
      this.key = null;
      this.placeholder = null;
      charts.add(this);
      this.showEmpty(0);
    }

    width() {
      return Math.max(200, Math.floor(this.container.clientWidth || this.container.getBoundingClientRect().width || 600));
    }

    resize() {
      if (this.plot) this.plot.setSize({width: this.width(), height: this.opts.height});
    }

    showEmpty(count) {
      if (this.plot) { this.plot.destroy(); this.plot = null; this.key = null; }
      if (!this.placeholder || !this.container.contains(this.placeholder)) {
        this.placeholder = D.el("div", {class: "placeholder"});
        this.container.replaceChildren(this.placeholder);
      }
      this.placeholder.textContent = this.opts.empty + (count === 1 ? " (1 point so far)" : "");
      this.container.setAttribute("data-points", "0");
    }

    update(series) {
      const clean = [];
      for (const s of series) {
        const pts = (Array.isArray(s.points) ? s.points : [])
          .filter((p) => Array.isArray(p) && D.isNum(p[0]) && D.isNum(p[1]))
          .sort((a, b) => a[0] - b[0]);
        if (pts.length) clean.push(Object.assign({}, s, {points: pts}));
      }
      const xsSet = new Set();
      let total = 0;
      for (const s of clean) { total += s.points.length; for (const p of s.points) xsSet.add(p[0]); }
      const xs = Array.from(xsSet).sort((a, b) => a - b);
      if (xs.length < 2) { this.showEmpty(total); return; }

      const index = new Map(xs.map((x, i) => [x, i]));
      const data = [xs];
      for (const s of clean) {
        const ys = new Array(xs.length).fill(null);
        for (const [x, y] of s.points) ys[index.get(x)] = y;
        data.push(ys);
      }
      const key = clean.map((s) => s.key + "\u0000" + s.color).join("\u0001");
      if (this.plot && key === this.key) {
        this.plot.setData(data);
      } else {
        if (this.plot) this.plot.destroy();
        this.container.replaceChildren();
        this.placeholder = null;
        this.plot = new uPlot(this.options(clean), data, this.container);
        this.key = key;
      }
      this.container.setAttribute("data-points", String(total));
    }

    options(clean) {
      const yFmt = this.opts.yFmt;
      const axisFmt = this.opts.axisFmt || yFmt;
      const grid = {stroke: "#eceff3", width: 1};
      const axis = {stroke: "#5d6875", grid: grid, ticks: {stroke: "#dde1e6", width: 1}};
      const yScale = {};
      if (this.opts.yMinZero) yScale.range = (u, min, max) => [0, D.isNum(max) && max > 0 ? max * 1.1 : 1];
      return {
        width: this.width(),
        height: this.opts.height,
        cursor: {drag: {x: false, y: false}, points: {size: 6}},
        legend: {show: this.opts.legend, live: true},
        scales: {x: {time: true}, y: yScale},
        series: [{label: "time", value: (u, v) => D.fmtTime(v)}].concat(clean.map((s) => ({
          label: s.label,
          stroke: s.color,
          width: 2,
          spanGaps: true,
          points: {size: 4},
          value: (u, v) => (v === null || v === undefined ? "–" : yFmt(v)),
        }))),
        // Plain times (HH:MM, with seconds when ticks are under a minute apart), at least 70 px
        // apart: uPlot's default drew the date over the first label (a NAT audit's screenshots).
        axes: [Object.assign({}, axis, {
                 space: 70,
                 values: (u, vals, i, space, incr) => vals.map((v, k) => {
                   const text = D.fmtTime(v).slice(0, incr < 60 ? 8 : 5);
                   return k > 0 && text === D.fmtTime(vals[k - 1]).slice(0, incr < 60 ? 8 : 5) ? "" : text;
                 }),
               }),
               Object.assign({}, axis, {size: 64, values: (u, vals) => vals.map((v) => axisFmt(v))})],
      };
    }
  }
  D.LiveChart = LiveChart;

  window.Dash = D;
})();
