// goodput's dashboard: the snapshot the server pushes on /events, drawn into the page; a chosen job's
// explanation from /api/jobs/ID. Everything from the server is text put in with textContent, never
// parsed as HTML. No framework, no build step.
//
// The token: the URL the command printed carries it in its fragment (#token=...), which no request
// sends. The page takes it from there into this tab's sessionStorage (of this origin only), clears
// it from the address bar, and sends it in an `Authorization` header with each of its own requests.
// The browser adds nothing by itself (no cookie), so a page of another origin cannot lend it.
"use strict";

const STATES = ["running", "profiling", "queued", "unschedulable", "finished", "failed", "cancelled", "rejected"];
const ACTIVE = new Set(["running", "profiling", "queued", "unschedulable"]);
const ENDED_SHOWN = 40;
const ROUNDS_SHOWN = 12;
const EXPLAIN_EVERY_MS = 2000;
// Jobs' colours, each far from the others; a running job keeps its colour, an ended one frees it.
const PALETTE = [
  "#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#17becf",
  "#bcbd22", "#393b79", "#e7ba52", "#843c39", "#637939", "#7b4173", "#6baed6", "#fd8d3c",
];
const TYPE_COLOURS = ["#0ea5e9", "#f97316", "#8b5cf6", "#10b981", "#e11d48", "#eab308"];
const SVG = "http://www.w3.org/2000/svg";
const TOKEN_KEY = "goodput-dashboard-token";
const NO_TOKEN = "no token: open the URL the command printed";
const RETRY_MS = 2000; // the stream cut: asked again after this long (or as the server's `retry:` says)

const view = {
  snapshot: null,
  chosen: null, // the job shown in the detail panel
  explanation: null,
  explainedAt: 0,
  explaining: false,
  colours: new Map(), // running job -> its colour
  seen: new Map(), // job -> the states this page saw it in, in order
  typeColours: new Map(),
  token: null,
};

// The token of the URL's fragment, kept for this tab; else the one kept before (a reload).
function takeToken() {
  const match = /^#token=([^&]+)$/.exec(location.hash);
  if (match) {
    sessionStorage.setItem(TOKEN_KEY, decodeURIComponent(match[1]));
    history.replaceState(null, "", `${location.pathname}${location.search}`);
  }
  return sessionStorage.getItem(TOKEN_KEY);
}

// A request of the page's own, with its token; the browser adds no credential of its own.
function ask(path) {
  return fetch(path, {
    headers: { Authorization: `Bearer ${view.token}` },
    credentials: "omit",
    cache: "no-store",
  });
}

// ---- small helpers ---------------------------------------------------------------------------

function el(tag, attributes, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(attributes || {})) {
    if (value === null || value === undefined || value === false) continue;
    if (key === "class") node.className = value;
    else if (key === "dataset") Object.assign(node.dataset, value);
    else if (key.startsWith("on")) node.addEventListener(key.slice(2), value);
    else node.setAttribute(key, value === true ? "" : String(value));
  }
  for (const child of children.flat()) {
    if (child === null || child === undefined || child === false) continue;
    node.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return node;
}

function svg(tag, attributes, ...children) {
  const node = document.createElementNS(SVG, tag);
  for (const [key, value] of Object.entries(attributes || {})) {
    if (value !== null && value !== undefined) node.setAttribute(key, String(value));
  }
  for (const child of children.flat()) {
    if (child === null || child === undefined) continue;
    node.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return node;
}

function $(id) { return document.getElementById(id); }

function jobColour(id) {
  if (!view.colours.has(id)) {
    const taken = new Set(view.colours.values());
    let colour = PALETTE.find((c) => !taken.has(c));
    for (let n = 0; !colour; n++) {
      const hue = `hsl(${Math.round((n * 137.508) % 360)} 60% 45%)`;
      if (!taken.has(hue)) colour = hue;
    }
    view.colours.set(id, colour);
  }
  return view.colours.get(id);
}

// Free the colours of the jobs no longer running.
function releaseColours(jobs) {
  const running = new Set(jobs.filter((job) => job.state === "running").map((job) => job.id));
  for (const id of [...view.colours.keys()]) if (!running.has(id)) view.colours.delete(id);
}

function typeColour(type) {
  if (!view.typeColours.has(type)) view.typeColours.set(type, TYPE_COLOURS[view.typeColours.size % TYPE_COLOURS.length]);
  return view.typeColours.get(type);
}

// The run's clock (seconds since its start, on the simulated cluster when it is one).
function clock(seconds) {
  if (seconds === null || seconds === undefined || !isFinite(seconds)) return "–";
  const s = Math.max(0, Math.round(seconds));
  const d = Math.floor(s / 86400), h = Math.floor((s % 86400) / 3600), m = Math.floor((s % 3600) / 60);
  const hm = `${h}:${String(m).padStart(2, "0")}:${String(s % 60).padStart(2, "0")}`;
  return d ? `${d}d ${hm}` : hm;
}

function duration(seconds) {
  if (seconds === null || seconds === undefined) return "";
  if (seconds < 90) return `${Math.round(seconds)} s`;
  if (seconds < 5400) return `${Math.round(seconds / 60)} min`;
  return `${(seconds / 3600).toFixed(1)} h`;
}

function number(value, digits = 3) {
  if (value === null || value === undefined || !isFinite(value)) return "–";
  const abs = Math.abs(value);
  if (abs >= 1e6) return `${(value / 1e6).toPrecision(digits)}M`;
  if (abs >= 1e4) return `${(value / 1e3).toPrecision(digits)}k`;
  if (abs >= 100) return value.toFixed(0);
  return value.toPrecision(digits);
}

function plural(n, word) { return `${n} ${word}${n === 1 ? "" : "s"}`; }

function pill(state) { return el("span", { class: `pill s-${state}` }, state); }

function gpusText(job) {
  if (!job.gpus) return "";
  return `${job.gpus} × ${job.gpu_type || "GPU"}`;
}

function where(job) {
  if (job.state === "running") {
    const spots = job.placement.map(([node, gpus]) => (job.placement.length > 1 ? `${node} (${gpus})` : node));
    const borrowed = job.borrowed ? `; ${job.borrowed} borrowed` : "";
    return `on ${spots.join(", ")}${borrowed}`;
  }
  if (job.state === "finished") return `finished in ${duration(job.jct_s)}${job.restarts ? `, ${plural(job.restarts, "restart")}` : ""}`;
  return job.reason || "";
}

// ---- what the page saw ------------------------------------------------------------------------

function remember(jobs) {
  for (const job of jobs) {
    const seen = view.seen.get(job.id) || [];
    if (seen[seen.length - 1] !== job.state) seen.push(job.state);
    view.seen.set(job.id, seen);
  }
}

// ---- the header -------------------------------------------------------------------------------

function drawHeader(snapshot) {
  const counts = $("counts");
  counts.replaceChildren(
    ...STATES.filter((state) => snapshot.counts[state]).map((state) =>
      el("span", { class: "chip", title: `${snapshot.counts[state]} ${state}` },
        el("i", { class: `dot s-${state}` }), state, " ", el("b", {}, snapshot.counts[state]))),
  );
  if (!snapshot.jobs.length) counts.append(el("span", { class: "chip" }, "no jobs yet"));
  const newest = snapshot.rounds && snapshot.rounds[0];
  $("clock").textContent = newest ? `round ${newest.round} · run clock ${clock(newest.at_s)}` : "";
  const banner = $("banner");
  banner.hidden = !snapshot.error;
  banner.textContent = snapshot.error || "";
}

// ---- nodes and GPUs ---------------------------------------------------------------------------

function drawNodes(snapshot) {
  const jobs = new Map(snapshot.jobs.map((job) => [job.id, job]));
  const nodes = $("nodes");
  let busy = 0, total = 0;
  nodes.replaceChildren(...snapshot.nodes.map((node) => {
    const used = node.gpus.filter(Boolean).length;
    busy += used;
    total += node.gpus.length;
    const cells = node.gpus.map((id, i) => {
      if (!id) return el("div", { class: "gpu", title: `${node.name} GPU ${i}: idle` });
      const job = jobs.get(id);
      const cell = el("div", {
        class: `gpu busy${view.chosen === id ? " chosen" : ""}`,
        title: `${node.name} GPU ${i}: ${id}${job && job.batch ? ` (batch ${job.batch})` : ""}`,
        dataset: { job: id },
        onclick: () => choose(id),
      });
      cell.style.backgroundColor = jobColour(id);
      return cell;
    });
    return el("div", { class: `node${node.gpus.length > 4 ? " wide" : ""}`, dataset: { node: node.name } },
      el("header", {}, el("b", { title: node.name }, node.name),
        el("span", {}, `${used}/${node.gpus.length} · ${node.hardware || "?"}`)),
      el("div", { class: "gpus" }, cells));
  }));
  if (!snapshot.nodes.length) nodes.append(el("div", { class: "empty" }, "no node to show yet"));
  $("gpu-summary").textContent = total ? `${busy} of ${total} GPUs busy${snapshot.nodes_complete ? "" : " (of the nodes shown)"}` : "";
  const note = $("nodes-note");
  note.hidden = snapshot.nodes_complete;
  note.textContent = snapshot.nodes_complete ? "" :
    "The cluster's nodes come with the rounds, which are not available: shown are the nodes your running jobs hold.";

  const running = snapshot.jobs.filter((job) => job.state === "running");
  $("legend").replaceChildren(
    ...running.map((job) => el("span", {
      class: `item${view.chosen === job.id ? " chosen" : ""}`, dataset: { job: job.id }, onclick: () => choose(job.id),
    }, colourSwatch(job.id), job.id, el("span", { class: "muted" }, gpusText(job)))),
    el("span", { class: "item idle" }, el("span", { class: "swatch" }), el("span", { class: "muted" }, "idle")),
  );
}

function colourSwatch(id) {
  const swatch = el("span", { class: "swatch" });
  swatch.style.backgroundColor = jobColour(id);
  return swatch;
}

// ---- the queue --------------------------------------------------------------------------------

function drawQueue(snapshot) {
  const active = snapshot.jobs.filter((job) => ACTIVE.has(job.state));
  const order = ["running", "profiling", "queued", "unschedulable"];
  active.sort((a, b) => order.indexOf(a.state) - order.indexOf(b.state));
  const ended = snapshot.jobs.filter((job) => !ACTIVE.has(job.state))
    .sort((a, b) => (b.finish_s ?? b.submit_s ?? 0) - (a.finish_s ?? a.submit_s ?? 0));
  const row = (job) => el("tr", {
    class: `${ACTIVE.has(job.state) ? "" : "ended"}${view.chosen === job.id ? " chosen" : ""}`,
    dataset: { job: job.id, state: job.state, seen: (view.seen.get(job.id) || []).join(" ") },
    tabindex: 0,
    onclick: () => choose(job.id),
    onkeydown: (event) => { if (event.key === "Enter") choose(job.id); },
  },
  el("td", { class: "id" }, job.state === "running" ? colourSwatch(job.id) : null, job.id),
  el("td", {}, pill(job.state)),
  el("td", {}, job.application || ""),
  el("td", { class: "num nowrap" }, gpusText(job)),
  el("td", { class: "num" }, job.batch ?? ""),
  el("td", { class: "why" }, where(job)));
  const group = (text) => el("tr", { class: "group" }, el("td", { colspan: 6 }, text));
  const rows = [];
  if (active.length) rows.push(group(`active · ${active.length}`), ...active.map(row));
  if (ended.length) rows.push(group(`ended · ${ended.length}`), ...ended.slice(0, ENDED_SHOWN).map(row));
  if (!rows.length) rows.push(el("tr", {}, el("td", { colspan: 6, class: "empty" }, "no jobs: `goodput submit JOB.yaml` sends one")));
  $("queue").tBodies[0].replaceChildren(...rows);
  const waiting = active.filter((job) => job.state !== "running").length;
  $("queue-summary").textContent = `${active.length - waiting} running, ${waiting} waiting`;
  const more = $("queue-more");
  more.hidden = ended.length <= ENDED_SHOWN;
  more.textContent = `and ${ended.length - ENDED_SHOWN} more ended jobs (goodput status lists them all)`;
}

// ---- rounds -----------------------------------------------------------------------------------

function drawRounds(snapshot) {
  const note = $("rounds-note");
  const body = $("rounds").tBodies[0];
  if (!snapshot.rounds) {
    note.hidden = false;
    note.textContent = snapshot.rounds_note || "The rounds are not available.";
    body.replaceChildren();
    $("rounds-chart").replaceChildren();
    $("rounds-summary").textContent = "";
    return;
  }
  note.hidden = true;
  const rounds = snapshot.rounds;
  body.replaceChildren(...rounds.slice(0, ROUNDS_SHOWN).map((r) => el("tr", { title: r.events.join("\n") || null },
    el("td", { class: "num" }, r.round),
    el("td", {}, clock(r.at_s)),
    el("td", { class: "num", title: `${r.waiting} waiting` }, `${r.allocated} of ${r.jobs}`),
    el("td", { class: "num" }, r.restarts),
    el("td", { class: "num" }, `${r.gpus_allocated}/${r.gpus_total}`),
    el("td", { class: "num" }, number(r.goodput)),
    el("td", { class: "num" }, `${(r.duration_s * 1000).toFixed(0)} ms`))));
  if (!rounds.length) body.append(el("tr", {}, el("td", { colspan: 7, class: "empty" }, "no round decided yet")));
  $("rounds-summary").textContent = rounds.length ? `the last ${rounds.length}, policy ${rounds[0].policy}` : "";
  $("rounds-chart").replaceChildren(roundsChart(rounds.slice().reverse()));
}

// GPUs allocated (area) against the cluster's (dashed), and the predicted goodput (line), per round.
function roundsChart(rounds) {
  const width = 560, height = 120, left = 34, right = 40, top = 8, bottom = 18;
  const chart = svg("svg", { viewBox: `0 0 ${width} ${height}`, role: "img", "aria-label": "GPUs allocated and goodput per round" });
  if (rounds.length < 2) return chart;
  const x = (i) => left + (i / (rounds.length - 1)) * (width - left - right);
  const gpuMax = Math.max(1, ...rounds.map((r) => r.gpus_total));
  const goodMax = Math.max(1e-9, ...rounds.map((r) => r.goodput));
  const yg = (v) => top + (1 - v / gpuMax) * (height - top - bottom);
  const yp = (v) => top + (1 - v / goodMax) * (height - top - bottom);
  const area = rounds.map((r, i) => `${i ? "L" : "M"}${x(i)},${yg(r.gpus_allocated)}`).join("") +
    `L${x(rounds.length - 1)},${yg(0)}L${x(0)},${yg(0)}Z`;
  chart.append(
    svg("line", { class: "axis", x1: left, x2: width - right, y1: yg(0), y2: yg(0) }),
    svg("path", { class: "allocated", d: area }),
    svg("path", { class: "total", d: rounds.map((r, i) => `${i ? "L" : "M"}${x(i)},${yg(r.gpus_total)}`).join("") }),
    svg("path", { class: "goodput", d: rounds.map((r, i) => `${i ? "L" : "M"}${x(i)},${yp(r.goodput)}`).join("") }),
    svg("text", { x: left - 4, y: yg(gpuMax) + 4, "text-anchor": "end" }, gpuMax),
    svg("text", { x: left - 4, y: yg(0), "text-anchor": "end" }, "0"),
    svg("text", { x: width - right + 4, y: yp(goodMax) + 4 }, number(goodMax, 2)),
    svg("text", { x: left, y: height - 4 }, `round ${rounds[0].round}`),
    svg("text", { x: width - right, y: height - 4, "text-anchor": "end" }, `round ${rounds[rounds.length - 1].round}`),
    svg("text", { x: (left + width - right) / 2, y: height - 4, "text-anchor": "middle" }, "GPUs allocated (green) · goodput (blue)"),
  );
  return chart;
}

// ---- teams ------------------------------------------------------------------------------------

function drawTeams(snapshot) {
  const panel = $("teams-panel");
  panel.hidden = !snapshot.teams;
  if (!snapshot.teams) return;
  $("teams").replaceChildren(...snapshot.teams.map((team) => el("div", { class: "team" },
    el("b", {}, team.team),
    el("div", { class: "usage" }, team.gpus.map((g) => {
      const meter = el("span", { class: "meter" }, el("i"));
      meter.firstChild.style.width = `${Math.min(100, g.quota ? (100 * g.used) / g.quota : (g.used ? 100 : 0))}%`;
      const extra = [g.borrowed ? `${g.borrowed} borrowed` : "", g.lent ? `${g.lent} lent` : ""].filter(Boolean).join(", ");
      return el("span", {}, meter, `${g.gpu_type}: ${g.used} of ${g.quota}${extra ? ` (${extra})` : ""}`);
    })))));
}

// ---- one job ----------------------------------------------------------------------------------

function choose(id) {
  if (view.chosen !== id) {
    view.chosen = id;
    view.explanation = null;
    view.explainedAt = 0;
    history.replaceState(null, "", `${location.pathname}${location.search}#job=${encodeURIComponent(id)}`);
  }
  if (view.snapshot) draw(view.snapshot);
  explain();
}

async function explain() {
  const id = view.chosen;
  if (!id || view.explaining) return;
  view.explaining = true;
  view.explainedAt = Date.now();
  try {
    const answer = await ask(`api/jobs/${encodeURIComponent(id)}`);
    const body = answer.status === 401 ? { error: NO_TOKEN } : await answer.json();
    if (view.chosen === id) view.explanation = answer.ok ? body : { error: body.error || `error ${answer.status}` };
  } catch (error) {
    if (view.chosen === id) view.explanation = { error: `the dashboard does not answer (${error.message})` };
  } finally {
    view.explaining = false;
  }
  if (view.chosen === id) drawJob(view.snapshot);
}

function drawJob(snapshot) {
  const box = $("job");
  const id = view.chosen;
  $("job-hint").hidden = Boolean(id);
  if (!id) {
    box.replaceChildren(el("div", { class: "empty" }, "No job chosen."));
    return;
  }
  const job = snapshot && snapshot.jobs.find((j) => j.id === id);
  if (!job) {
    box.replaceChildren(el("div", { class: "empty" }, `No job ${id} of yours is listed.`));
    return;
  }
  const now = job.state === "running"
    ? `${gpusText(job)} ${where(job)}${job.batch ? `, batch ${job.batch}` : ""}`
    : where(job) || job.state;
  const parts = [
    el("div", { class: "title" }, job.state === "running" ? colourSwatch(job.id) : null, el("b", {}, job.id), pill(job.state)),
    el("div", { class: "meta" }, [job.application, job.team !== "default" ? `team ${job.team}` : null,
      job.submit_s !== null ? `submitted at ${clock(job.submit_s)}` : null,
      job.restarts ? plural(job.restarts, "restart") : null].filter(Boolean).join(" · ")),
    el("div", { class: "now" }, now),
  ];
  const explanation = view.explanation;
  if (!explanation) parts.push(el("div", { class: "note" }, "reading its decisions …"));
  else if (explanation.error) parts.push(el("div", { class: "note" }, explanation.error));
  else {
    parts.push(el("h3", {}, "GPUs, type and batch over the run's clock"));
    parts.push(el("div", { class: "chart" }, historyChart(explanation.decisions)));
    const types = [...new Set(explanation.decisions.map((d) => d.gpu_type).filter(Boolean))];
    parts.push(el("div", { class: "types" }, types.map((t) => {
      const swatch = el("span", { class: "swatch" });
      swatch.style.backgroundColor = typeColour(t);
      return el("span", {}, swatch, t);
    }), explanation.decisions.some((d) => d.batch) ? el("span", {}, "— batch") : null));
    parts.push(el("h3", {}, "Why"));
    parts.push(explanation.sentences.length
      ? el("ol", { class: "why" }, explanation.sentences.map((s) => el("li", {}, s)))
      : el("div", { class: "note" }, "nothing decided about it yet"));
  }
  box.replaceChildren(...parts);
}

// A step chart: its GPUs as bars coloured by type, one step per decision, and its batch as a line
// on its own scale.
function historyChart(decisions) {
  const width = 460, height = 170, left = 30, right = 46, top = 10, bottom = 22;
  const chart = svg("svg", { viewBox: `0 0 ${width} ${height}`, role: "img", "aria-label": "GPUs, type and batch over time" });
  const empty = !decisions.length ? "no decision recorded yet" : !decisions.some((d) => d.gpus) ? "no GPU given yet" : "";
  if (empty) {
    chart.setAttribute("viewBox", `0 0 ${width} 40`);
    chart.append(svg("text", { x: width / 2, y: 24, "text-anchor": "middle" }, empty));
    return chart;
  }
  const start = decisions[0].at_s;
  const last = decisions[decisions.length - 1].at_s;
  const end = last + Math.max(1, (last - start) / Math.max(1, decisions.length - 1));
  const x = (t) => left + ((t - start) / (end - start)) * (width - left - right);
  const gpuMax = Math.max(1, ...decisions.map((d) => d.gpus));
  const batchMax = Math.max(1, ...decisions.map((d) => d.batch || 0));
  const yg = (v) => top + (1 - v / gpuMax) * (height - top - bottom);
  const yb = (v) => top + (1 - v / batchMax) * (height - top - bottom);
  chart.append(svg("line", { class: "axis", x1: left, x2: width - right, y1: yg(0), y2: yg(0) }));
  decisions.forEach((d, i) => {
    const next = i + 1 < decisions.length ? decisions[i + 1].at_s : end;
    if (!d.gpus) return;
    chart.append(svg("rect", {
      x: x(d.at_s), y: yg(d.gpus), width: Math.max(0.5, x(next) - x(d.at_s)), height: yg(0) - yg(d.gpus),
      fill: typeColour(d.gpu_type || "?"), opacity: 0.85,
    }, svg("title", {}, `round ${d.round} at ${clock(d.at_s)}: ${d.gpus} × ${d.gpu_type}, batch ${d.batch ?? "–"} (${d.change})`)));
  });
  let path = "";
  decisions.forEach((d, i) => {
    const next = i + 1 < decisions.length ? decisions[i + 1].at_s : end;
    if (d.batch) path += `M${x(d.at_s)},${yb(d.batch)}H${x(next)}`;
  });
  if (path) chart.append(svg("path", { class: "batch", d: path }));
  chart.append(
    svg("text", { x: left - 4, y: yg(gpuMax) + 4, "text-anchor": "end" }, gpuMax),
    svg("text", { x: left - 4, y: yg(0), "text-anchor": "end" }, "0"),
    svg("text", { x: width - right + 4, y: yb(batchMax) + 4 }, batchMax > 1 ? number(batchMax, 3) : ""),
    svg("text", { x: left, y: height - 5 }, clock(start)),
    svg("text", { x: width - right, y: height - 5, "text-anchor": "end" }, clock(last)),
    svg("text", { x: (left + width - right) / 2, y: height - 5, "text-anchor": "middle" }, "GPUs (left) · batch (right)"),
  );
  return chart;
}

// ---- the stream -------------------------------------------------------------------------------

function draw(snapshot) {
  drawHeader(snapshot);
  drawNodes(snapshot);
  drawQueue(snapshot);
  drawRounds(snapshot);
  drawTeams(snapshot);
  drawJob(snapshot);
}

function setLive(state, text) {
  const live = $("live");
  live.dataset.live = state;
  live.lastChild.textContent = text;
}

function onSnapshot(data) {
  const snapshot = JSON.parse(data);
  view.snapshot = snapshot;
  remember(snapshot.jobs);
  releaseColours(snapshot.jobs);
  setLive("live", `live · ${new Date().toLocaleTimeString()}`);
  draw(snapshot);
  if (view.chosen && Date.now() - view.explainedAt >= EXPLAIN_EVERY_MS) explain();
}

// The server-sent events of /events, read from a fetch (an EventSource sends no header): each
// event is its lines up to a blank one; `event: snapshot` with its `data:`, `retry:` the wait
// before asking again. A refused token ends it (the dashboard stopped, or started with another).
async function connect() {
  let retry = RETRY_MS;
  for (;;) {
    try {
      const answer = await ask("events");
      if (answer.status === 401 || answer.status === 403) {
        setLive("closed", "disconnected: open the URL the command printed");
        return;
      }
      if (!answer.ok) throw new Error(`error ${answer.status}`);
      setLive("live", "live");
      const reader = answer.body.pipeThrough(new TextDecoderStream()).getReader();
      let buffer = "";
      for (;;) {
        const { value, done } = await reader.read();
        if (done) break;
        buffer += value;
        let end;
        while ((end = buffer.indexOf("\n\n")) >= 0) {
          const lines = buffer.slice(0, end).split("\n");
          buffer = buffer.slice(end + 2);
          const field = (name) => lines.filter((l) => l.startsWith(`${name}:`)).map((l) => l.slice(name.length + 1).replace(/^ /, ""));
          const wait = Number(field("retry")[0]);
          if (wait > 0) retry = wait;
          if (field("event")[0] === "snapshot") onSnapshot(field("data").join("\n"));
        }
      }
    } catch (error) {
      // cut, or the server is gone for now: asked again below
    }
    setLive("reconnecting", "reconnecting …");
    await new Promise((resolve) => setTimeout(resolve, retry));
  }
}

function fromHash() {
  if (location.hash.startsWith("#token=")) {
    location.reload(); // a new URL pasted into this tab: its token from now on (takeToken, at load)
    return;
  }
  const match = /^#job=(.+)$/.exec(location.hash);
  if (match) choose(decodeURIComponent(match[1]));
}

view.token = takeToken();
window.addEventListener("hashchange", fromHash);
drawJob(null);
if (view.token) {
  fromHash();
  connect();
} else {
  setLive("closed", NO_TOKEN);
}
