/* The swarm page: /api/swarm and /api/history, polled every 2 s (docs/dashboard.md). */
(function () {
  "use strict";
  const D = window.Dash;
  const el = D.el;

  const tokensChart = new D.LiveChart(D.byId("tokens-chart"), {
    yFmt: (v) => D.fmtSI(v), yMinZero: true, legend: false, empty: "Waiting for two samples…"});
  const lossChart = new D.LiveChart(D.byId("loss-chart"), {
    yFmt: (v) => D.fmtFixed(v, 3), axisFmt: (v) => D.fmtNum(v, 3), empty: "No loss reported yet…"});

  function modelShape(m) {
    if (!m || typeof m !== "object") return "–";
    const parts = [];
    if (D.isNum(m.num_layers)) parts.push(m.num_layers + " layers");
    if (D.isNum(m.hidden_size)) parts.push("hidden " + m.hidden_size);
    if (D.isNum(m.intermediate_size)) parts.push("ffn " + m.intermediate_size);
    if (D.isNum(m.num_heads)) parts.push(m.num_heads + " heads");
    if (D.isNum(m.seq_len)) parts.push("seq " + m.seq_len);
    return parts.length ? parts.join(" · ") : "–";
  }

  function versionsSeen(replicas) {
    const counts = new Map();
    for (const r of replicas) {
      const v = D.str(r.version) || "?";
      counts.set(v, (counts.get(v) || 0) + 1);
    }
    if (!counts.size) return "–";
    return Array.from(counts.entries()).sort()
      .map(([v, n]) => (counts.size > 1 ? v + " (" + n + ")" : v)).join(", ");
  }

  function renderHeader(s, replicas) {
    const run = s.run && typeof s.run === "object" ? s.run : {};
    const runId = D.str(run.run_id || s.run_id) || "–";
    D.byId("run-title").textContent = runId;
    document.title = "noloco swarm · " + runId;
    const H = run.inner_steps_per_outer;
    D.fillFacts(D.byId("run-facts"), [
      ["manifest", D.shortHash(run.manifest_hash) || "–", D.str(run.manifest_hash)],
      ["model", modelShape(run.model)],
      ["method", D.str(run.method) || "–"],
      ["H", D.isNum(H) ? String(H) : "–", "inner steps per outer round"],
      ["stages", D.isNum(s.stages) ? String(s.stages) : "–"],
      ["versions", versionsSeen(replicas)],
    ]);
    D.byId("swarm-tps").textContent = D.fmtSI(s.tokens_per_s);
    D.byId("swarm-summary").textContent = replicas.length + (replicas.length === 1 ? " replica" : " replicas") +
      " · updated " + D.fmtTime(s.generated_at);
  }

  function renderAttention(notes) {
    const list = D.byId("attention");
    const items = (Array.isArray(notes) ? notes : []).map((n) => el("li", {class: "note", text: D.str(n)}));
    if (!items.length) items.push(el("li", {class: "all-well", text: "All is well: nothing needs attention."}));
    list.replaceChildren(...items);
  }

  function busyBar(busy) {
    if (!D.isNum(busy)) return "–";
    const share = Math.min(1, Math.max(0, busy));
    const fill = el("span");
    fill.style.width = (share * 100).toFixed(1) + "%";
    return el("span", null,
      el("span", {class: "bar" + (share > 0.9 ? " hot" : ""), role: "img",
                  "aria-label": "busy " + Math.round(share * 100) + " percent"}, fill),
      Math.round(share * 100) + " %");
  }

  function replicaCard(r, swarmHash) {
    const rows = [
      ["inner step", D.fmtInt(r.inner_step)],
      ["outer round", D.fmtInt(r.outer_round)],
      ["reach", D.reachTag(r.reach)],
      ["link", D.isNum(r.link_mbit_s) ? D.fmtNum(r.link_mbit_s, 1) + " Mbit/s" : "–"],
      ["capacity", D.isNum(r.capacity) ? D.fmtNum(r.capacity, 1) + " seq/s" : "–"],
      ["busy", busyBar(r.busy)],
      ["memory est / peak", D.fmtGiB(r.memory_estimate_bytes).replace(" GiB", "") + " / " + D.fmtGiB(r.memory_peak_bytes)],
      ["version", el("span", null, D.str(r.version) || "–",
        swarmHash && r.manifest_hash && r.manifest_hash !== swarmHash
          ? el("span", {class: "tag bad", text: "other manifest", title: D.str(r.manifest_hash)}) : null)],
      ["seen", D.isNum(r.seen_s_ago) ? D.fmtDuration(r.seen_s_ago) + " ago" : "–"],
    ];
    if (D.isNum(r.loss)) rows.push(["loss", D.fmtFixed(r.loss, 3)]);
    const dl = el("dl");
    for (const [label, value] of rows) dl.append(el("dt", {text: label}), el("dd", null, value));
    const notes = Array.isArray(r.attention) && r.attention.length
      ? el("ul", {class: "notes"}, r.attention.map((n) => el("li", {text: D.str(n)}))) : null;
    const pid = D.str(r.peer_id);
    return el("article", {class: "replica", "data-peer-id": pid, "data-stage": D.str(r.stage),
                          "aria-label": "replica " + D.shortId(pid) + ", " + D.str(r.status)},
      el("div", {class: "replica-head"},
        el("span", {class: "mono", title: pid, text: "…" + D.shortId(pid)}),
        D.statusTag(r.status)),
      dl, notes);
  }

  function renderMap(s, replicas) {
    const byStage = new Map();
    let count = D.isNum(s.stages) ? s.stages : D.isNum(s.run && s.run.stages) ? s.run.stages : 0;
    for (const r of replicas) {
      if (!Number.isInteger(r.stage) || r.stage < 0) continue;
      count = Math.max(count, r.stage + 1);
      if (!byStage.has(r.stage)) byStage.set(r.stage, []);
      byStage.get(r.stage).push(r);
    }
    const caps = s.stage_capacity && typeof s.stage_capacity === "object" ? s.stage_capacity : {};
    const limiting = Number.isInteger(s.limiting_stage) ? s.limiting_stage : null;
    const swarmHash = s.run && s.run.manifest_hash;
    const cols = [];
    for (let st = 0; st < count; st++) {
      const reps = (byStage.get(st) || []).sort((a, b) => D.str(a.peer_id).localeCompare(D.str(b.peer_id)));
      const isLimiting = st === limiting;
      const cap = caps[String(st)];
      const head = el("div", {class: "stage-head"},
        el("h3", {text: "Stage " + st}),
        isLimiting ? el("span", {class: "tag limit", text: "limiting stage"}) : null,
        el("span", {class: "cap",
          text: (D.isNum(cap) ? D.fmtNum(cap, 1) + " seq/s" : "capacity –") + " · " +
                reps.length + (reps.length === 1 ? " replica" : " replicas")}));
      const body = reps.length ? reps.map((r) => replicaCard(r, swarmHash))
        : [el("div", {class: "empty-stage", "data-stage": st, text: "No replica: nobody serves stage " + st})];
      cols.push(el("section", {class: "stage" + (isLimiting ? " limiting" : ""), "data-stage-column": st,
                               "aria-label": "stage " + st}, head, body));
    }
    if (!cols.length) cols.push(el("p", {class: "muted", text: "No stages known yet."}));
    D.byId("map").replaceChildren(...cols);

    const line = D.byId("limiting");
    line.replaceChildren();
    if (limiting !== null) line.append(el("strong", {text: "Limiting: stage " + limiting + ". "}));
    line.append(D.str(s.limiting_reason));
  }

  function renderCharts(h) {
    const tps = Array.isArray(h.tokens_per_s) ? h.tokens_per_s : [];
    tokensChart.update([{key: "tokens", label: "tokens/s", color: "#2f6fde", points: tps}]);
    const loss = h.loss && typeof h.loss === "object" ? h.loss : {};
    const peers = Object.keys(loss).sort();
    lossChart.update(peers.map((pid) => ({
      key: pid,
      label: D.shortId(pid),
      color: D.colorFor(pid),
      points: (Array.isArray(loss[pid]) ? loss[pid] : []).map((p) => (Array.isArray(p) ? [p[0], p[2]] : null)),
    })));
  }

  async function refresh() {
    const [swarm, history] = await Promise.all([D.getJSON("/api/swarm"), D.getJSON("/api/history")]);
    const replicas = Array.isArray(swarm.replicas) ? swarm.replicas.filter((r) => r && typeof r === "object") : [];
    renderHeader(swarm, replicas);
    renderAttention(swarm.attention);
    renderMap(swarm, replicas);
    renderCharts(history || {});
    D.byId("generated").textContent = "Data generated at " + D.fmtDateTime(swarm.generated_at) + ".";
  }

  D.poll(refresh, 2000);
})();
