/* The node page: /api/node and /api/node/history (this node), plus /api/swarm for where it sits
   in the swarm, polled every 2 s (docs/dashboard.md). */
(function () {
  "use strict";
  const D = window.Dash;
  const el = D.el;

  const lossChart = new D.LiveChart(D.byId("loss-chart"), {
    yFmt: (v) => D.fmtFixed(v, 3), axisFmt: (v) => D.fmtNum(v, 3), legend: false, empty: "No loss yet (later stages have none of their own)…"});
  const tokensChart = new D.LiveChart(D.byId("tokens-chart"), {
    yFmt: (v) => D.fmtSI(v), yMinZero: true, legend: false, empty: "Waiting for two samples…"});

  function setField(name, text, title) {
    const node = document.querySelector('#contribution [data-field="' + name + '"]');
    if (!node) return;
    node.textContent = text;
    if (title) node.title = title; else node.removeAttribute("title");
  }

  // Only a same-origin path: the link comes from JSON, so never a javascript: or foreign URL.
  function safePath(p) {
    const s = D.str(p);
    return s.startsWith("/") && !s.startsWith("//") && !s.includes("\\") ? s : "/swarm";
  }

  function renderHeader(n, mine, swarm) {
    const pid = D.str(n.peer_id);
    D.byId("node-title").textContent = "…" + D.shortId(pid);
    D.byId("node-title").title = pid;
    document.title = "noloco node · " + (D.shortId(pid) || "?");
    const run = swarm && swarm.run && typeof swarm.run === "object" ? swarm.run : {};
    D.fillFacts(D.byId("node-facts"), [
      ["peer", el("span", {class: "mono", text: pid || "–"})],
      ["stage", D.isNum(n.stage) ? String(n.stage) + (D.isNum(swarm && swarm.stages) ? " (of " + swarm.stages + ")" : "") : "–"],
      ["status", D.statusTag(n.status)],
      ["run", D.str(n.run_id) || "–"],
      ["manifest", D.shortHash(n.manifest_hash) || "–", D.str(n.manifest_hash)],
      ["method", D.str(n.method) || "–"],
      D.isNum(run.inner_steps_per_outer) ? ["H", String(run.inner_steps_per_outer), "inner steps per outer round"] : null,
      mine ? ["inner step", D.fmtInt(mine.inner_step)] : null,
      mine ? ["outer round", D.fmtInt(mine.outer_round)] : null,
      ["version", D.str(n.version) || "–"],
    ]);
    D.byId("swarm-link").setAttribute("href", safePath(n.swarm_page));
  }

  function renderContribution(c) {
    c = c && typeof c === "object" ? c : {};
    setField("tokens", D.fmtSI(c.tokens), D.isNum(c.tokens) ? D.fmtInt(c.tokens) + " tokens" : null);
    setField("flops", D.fmtSI(c.flops, "FLOP"), D.isNum(c.flops) ? c.flops.toExponential(3) + " FLOP" : null);
    setField("hours_online", D.isNum(c.hours_online) ? D.fmtDuration(c.hours_online * 3600) : "–",
             D.isNum(c.hours_online) ? D.fmtNum(c.hours_online, 3) + " hours" : null);
    setField("inner_steps", D.fmtInt(c.inner_steps));
    setField("microbatches_served", D.fmtInt(c.microbatches_served), "forward passes this node computed for others");
    setField("microbatches_driven", D.fmtInt(c.microbatches_driven),
             "microbatches of this node's data that went through the whole pipeline (stage 0)");
    setField("outer_rounds", D.fmtInt(c.outer_paired) + " / " + D.fmtInt(c.outer_rounds),
             "paired with a partner / all outer rounds");
    setField("bytes_sent", D.fmtBytes(c.bytes_sent), D.isNum(c.bytes_sent) ? D.fmtInt(c.bytes_sent) + " bytes" : null);
    setField("bytes_received", D.fmtBytes(c.bytes_received),
             D.isNum(c.bytes_received) ? D.fmtInt(c.bytes_received) + " bytes" : null);

    const partners = c.partners && typeof c.partners === "object" ? Object.entries(c.partners) : [];
    partners.sort((a, b) => (D.isNum(b[1]) ? b[1] : 0) - (D.isNum(a[1]) ? a[1] : 0) || a[0].localeCompare(b[0]));
    const items = partners.map(([pid, n]) => el("li", null,
      el("span", {class: "mono", title: pid, text: "…" + D.shortId(pid)}),
      " × " + D.fmtInt(n)));
    if (!items.length) items.push(el("li", {class: "muted", text: "none yet"}));
    D.byId("partners").replaceChildren(...items);
  }

  function renderHealth(h, generatedAt) {
    h = h && typeof h === "object" ? h : {};
    const stat = (label, value, cls) => el("div", null, el("dt", {text: label}), el("dd", {class: cls}, value));
    D.byId("health").replaceChildren(
      stat("Reach", D.reachTag(h.reach)),
      stat("Link", D.isNum(h.link_mbit_s) ? D.fmtNum(h.link_mbit_s, 1) + " Mbit/s" : "–"),
      stat("Memory estimate / peak", D.fmtGiB(h.memory_estimate_bytes).replace(" GiB", "") + " / " +
           D.fmtGiB(h.memory_peak_bytes)),
      stat("Microbatches in flight", D.fmtInt(h.in_flight)),
      stat("Tokens/s", D.fmtSI(h.tokens_per_s)),
      stat("Loss", D.isNum(h.loss) ? D.fmtFixed(h.loss, 3) : "none (no loss of its own yet)",
           D.isNum(h.loss) ? null : "text"));
    D.byId("node-tps").textContent = D.fmtSI(h.tokens_per_s);

    const box = D.byId("last-error");
    const e = h.last_error;
    if (e && typeof e === "object") {
      const level = D.str(e.level) || "?";
      const ago = D.isNum(e.at) && D.isNum(generatedAt) ? " (" + D.fmtDuration(generatedAt - e.at) + " ago)" : "";
      box.replaceChildren(
        el("span", {class: "tag level " + (level === "WARNING" ? "warn" : "bad"), text: level}),
        el("span", {class: "muted", text: D.fmtDateTime(e.at) + ago + ": "}),
        el("span", {text: D.str(e.message)}));
    } else {
      box.replaceChildren(el("span", {class: "muted", text: "none"}));
    }

    const notes = (Array.isArray(h.attention) ? h.attention : []).map((n) => el("li", {class: "note", text: D.str(n)}));
    if (!notes.length) notes.push(el("li", {class: "all-well", text: "All is well: nothing needs attention."}));
    D.byId("attention").replaceChildren(...notes);
  }

  function renderCharts(hist) {
    hist = hist && typeof hist === "object" ? hist : {};
    const loss = (Array.isArray(hist.loss) ? hist.loss : []).map((p) => (Array.isArray(p) ? [p[0], p[2]] : null));
    lossChart.update([{key: "loss", label: "loss", color: "#e8710a", points: loss}]);
    tokensChart.update([{key: "tokens", label: "tokens/s", color: "#2f6fde",
                         points: Array.isArray(hist.tokens_per_s) ? hist.tokens_per_s : []}]);
  }

  async function refresh() {
    const [node, hist, swarm] = await Promise.all([
      D.getJSON("/api/node"), D.getJSON("/api/node/history"),
      D.getJSON("/api/swarm").catch(() => null),  // only context: the node's own numbers come first
    ]);
    const replicas = swarm && Array.isArray(swarm.replicas) ? swarm.replicas : [];
    const mine = replicas.find((r) => r && r.peer_id === node.peer_id) || null;
    renderHeader(node, mine, swarm);
    renderContribution(node.contribution);
    renderHealth(node.health, node.generated_at);
    renderCharts(hist);
    D.byId("generated").textContent = "Data generated at " + D.fmtDateTime(node.generated_at) + ".";
  }

  D.poll(refresh, 2000);
})();
