// The spectral-monitor tab: a health summary per run, then per diagnosis the charts it is judged on, one
// coloured line per layer with the watch and collapsed levels drawn as bands. Plain DOM and SVG, no
// dependency: nothing is fetched but this plugin's own routes.

const SVG = "http://www.w3.org/2000/svg";
const COLOURS = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f",
  "#bcbd22", "#17becf"];
const VERDICT_CLASS = {
  healthy: "healthy", watch: "watch", collapsed: "collapsed", "not measured": "unmeasured",
  "no finite reading": "unmeasured",
};
const HEATMAP_ABOVE_LAYERS = 12;

function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs)) {
    if (key === "class") node.className = value;
    else if (key.startsWith("on")) node.addEventListener(key.slice(2), value);
    else node.setAttribute(key, value);
  }
  for (const child of children) {
    if (child !== null && child !== undefined) node.append(child);
  }
  return node;
}

function svg(tag, attrs = {}) {
  const node = document.createElementNS(SVG, tag);
  for (const [key, value] of Object.entries(attrs)) node.setAttribute(key, value);
  return node;
}

function colour(index, count) {
  if (count <= COLOURS.length) return COLOURS[index];
  return `hsl(${Math.round((300 * index) / Math.max(count - 1, 1))}, 70%, 45%)`;
}

function number(value) {
  if (typeof value !== "number") return String(value);
  if (value !== 0 && (Math.abs(value) >= 1000 || Math.abs(value) < 0.001)) return value.toPrecision(3);
  return value.toFixed(3);
}

async function getJson(path) {
  const response = await fetch(path);
  if (!response.ok) throw new Error(`${path}: HTTP ${response.status}`);
  return response.json();
}

function verdictBadge(verdict) {
  return el("span", {class: `badge ${VERDICT_CLASS[verdict] || "unmeasured"}`}, verdict);
}

function verdictTable(verdicts) {
  const rows = verdicts.map((v) => {
    const layers = v.layers.length ? v.layers.join(", ") : v.layer ? `nearest: ${v.layer}` : "";
    const reading = v.verdict === "not measured" ? v.how_to_measure : v.reading;
    // A remedy once, under the last alert that gives it: a rule firing in 13 layers says the same 13 times.
    const alerts = v.alerts.length
      ? el("ul", {class: "alerts"}, ...v.alerts.map((a, k) => el("li", {},
          `fired at step ${a.fired_at}${a.where ? ` in ${a.where}` : ""}`,
          a.remedy && !v.alerts.slice(k + 1).some((b) => b.remedy === a.remedy)
            ? el("div", {class: "remedy"}, `Remedy: ${a.remedy}`) : null)))
      : null;
    return el("tr", {class: `verdict-row ${VERDICT_CLASS[v.verdict]}`, "data-rule": v.rule},
      el("td", {}, el("b", {}, v.title), el("div", {class: "meaning"}, v.meaning)),
      el("td", {class: "verdict"}, verdictBadge(v.verdict)),
      el("td", {class: "layers"}, layers),
      el("td", {class: "reading"}, reading, alerts));
  });
  return el("table", {class: "verdicts"},
    el("thead", {}, el("tr", {}, ...["diagnosis", "verdict", "layers", "reading / alerts"].map((h) => el("th", {}, h)))),
    el("tbody", {}, ...rows));
}

// The smallest and largest value of the lines and levels: [0, 1] for none.
function range(lines, thresholds) {
  let low = Infinity;
  let high = -Infinity;
  for (const line of lines) {
    for (const value of line.values) {
      if (typeof value === "number") { low = Math.min(low, value); high = Math.max(high, value); }
    }
  }
  for (const t of thresholds.filter(onItsOwnScale)) {
    for (const level of [t.collapsed, t.watch]) { low = Math.min(low, level); high = Math.max(high, level); }
  }
  return Number.isFinite(low) ? [low, high] : [0, 1];
}

// A level on the metric's own scale (a band); else relative to each line's own first value, running median
// or first layer (a dashed line per layer, which does not stretch the axis: 20 times a first value would).
function onItsOwnScale(t) {
  return (t.relative_to || "value") === "value";
}

const RELATIVE_WORDS = {first: "× its first value", median: "× its running median", depth: "+ the first layer's"};

// A chart's value axis: the range, padded by 5% each side.
function extent(lines, thresholds) {
  const [low, high] = range(lines, thresholds);
  if (low === high) return [low - 0.5, high + 0.5];
  const pad = 0.05 * (high - low);
  return [low - pad, high + pad];
}

// Round values inside [low, high], 1, 2, 2.5 or 5 times a power of ten apart, at most `most` intervals of
// the range (at least `least` apart: 1 for steps), with the decimals that step needs.
function roundTicks(low, high, most, least = 0) {
  const raw = Math.max((high - low) / most, least);
  const power = 10 ** Math.floor(Math.log10(raw));
  const step = [1, 2, 2.5, 5, 10].map((m) => m * power).find((s) => s >= raw * (1 - 1e-9));
  const ticks = [];
  for (let i = Math.ceil(low / step - 1e-9); i * step <= high + step * 1e-9; i++) ticks.push(i * step);
  let decimals = 0;  // as many as the step has: 0.25 apart, 2; 250 apart, none
  while (decimals < 9 && Math.abs(Math.round(step * 10 ** decimals) - step * 10 ** decimals) > 1e-6) decimals++;
  // Exponents for values too small or too large to read in fixed notation; a narrow range around 12.5 keeps
  // its decimals (12.5001, 12.5002, ...), which exponents of two digits would print alike.
  const largest = Math.max(Math.abs(low), Math.abs(high));
  const exponential = largest < 1e-3 || largest >= 1e6;
  const label = (value) => (exponential ? (value === 0 ? "0" : value.toExponential(1)) : value.toFixed(decimals));
  return ticks.map((value) => [value, label(value)]);
}

function lineChart(chart) {
  const width = 560, height = 260, left = 56, right = 12, top = 10, bottom = 28;
  const lines = chart.lines;
  const steps = lines.flatMap((line) => line.steps);
  const x0 = Math.min(...steps), x1 = Math.max(...steps, x0 + 1);
  const [y0, y1] = extent(lines, chart.thresholds);
  const x = (step) => left + ((step - x0) / (x1 - x0)) * (width - left - right);
  const y = (value) => top + (1 - (value - y0) / (y1 - y0)) * (height - top - bottom);
  const root = svg("svg", {viewBox: `0 0 ${width} ${height}`, class: "chart"});
  const labels = [];  // drawn last, over the lines, on a halo: a line through a label hid its words
  for (const t of chart.thresholds.filter(onItsOwnScale)) {
    // The collapsed side beyond the threshold in red, the watch band between it and the clear level in amber.
    const edge = t.op === "<=" ? y0 : y1;
    const band = (from, to, cls) => {
      const a = y(Math.max(Math.min(from, y1), y0)), b = y(Math.max(Math.min(to, y1), y0));
      root.append(svg("rect", {x: left, width: width - left - right, y: Math.min(a, b),
        height: Math.abs(a - b), class: cls}));
    };
    band(edge, t.collapsed, "band-collapsed");
    band(t.collapsed, t.watch, "band-watch");
    const label = svg("text", {x: width - right - 4, y: y(t.collapsed) - 3, class: "band-label",
      "text-anchor": "end"});
    const op = {"<=": "at or below", ">=": "at or above"}[t.op];
    label.textContent = `${t.rule}: collapsed ${op} ${t.collapsed}, watch ${op} ${t.watch}`;
    labels.push(label);
  }
  for (const [value, text] of roundTicks(y0, y1, 5)) {
    root.append(svg("line", {x1: left, x2: width - right, y1: y(value), y2: y(value), class: "grid"}));
    const tick = svg("text", {x: left - 4, y: y(value) + 4, "text-anchor": "end", class: "tick"});
    tick.textContent = text;
    root.append(tick);
  }
  for (const [step, text] of roundTicks(x0, x1, 5, 1)) {
    const tick = svg("text", {x: x(step), y: height - 8, "text-anchor": "middle", class: "tick"});
    tick.textContent = text;
    root.append(tick);
  }
  const pathOf = (steps, values) => steps.map((step, k) => [step, values[k]])
    .filter(([, v]) => typeof v === "number")
    .map(([s, v], k) => `${k ? "L" : "M"}${x(s).toFixed(1)},${y(v).toFixed(1)}`).join("");
  const relative = chart.thresholds.filter((t) => !onItsOwnScale(t));
  lines.forEach((line, index) => {
    const points = line.steps.map((step, k) => [step, line.values[k]]).filter(([, v]) => typeof v === "number");
    const stroke = colour(index, lines.length);
    root.append(svg("path", {d: pathOf(line.steps, line.values), stroke, class: "line", "data-layer": line.name}));
    if (points.length < 60) {
      for (const [s, v] of points) root.append(svg("circle", {cx: x(s), cy: y(v), r: 2, fill: stroke}));
    }
    // The layer's own collapsed level, where it lies on the chart: its line crosses it where it collapses.
    for (const t of relative) {
      const levels = (t.levels || {})[line.name];
      if (!levels) continue;
      const clipped = levels.map((v) => (typeof v === "number" && v >= y0 && v <= y1 ? v : null));
      root.append(svg("path", {d: pathOf(line.steps, clipped), stroke, class: "level",
        "data-layer": line.name, "data-rule": t.rule}));
    }
  });
  root.append(...labels);
  if (!relative.length) return root;
  // Said under the chart, not over it: a label inside would cross the lines it explains.
  const said = relative.map((t) => {
    const op = {"<=": "at or below", ">=": "at or above"}[t.op];
    return `${t.rule}: dashed, each line's collapsed level (${op} ${t.collapsed} ${RELATIVE_WORDS[t.relative_to]})`;
  });
  return el("div", {}, root, el("div", {class: "level-caption"}, said.join("; ")));
}

function heatmap(chart) {
  const width = 560, left = 150, right = 12, top = 6, rowHeight = 12;
  const lines = chart.lines;
  const steps = [...new Set(lines.flatMap((line) => line.steps))].sort((a, b) => a - b);
  const column = new Map(steps.map((step, index) => [step, index]));
  const [low, high] = range(lines, []);  // unpadded: the caption names the darkest and lightest readings
  const height = top + rowHeight * lines.length + 24;
  const root = svg("svg", {viewBox: `0 0 ${width} ${height}`, class: "chart"});
  const cell = (width - left - right) / Math.max(steps.length, 1);
  lines.forEach((line, row) => {
    const label = svg("text", {x: left - 4, y: top + rowHeight * (row + 0.8), "text-anchor": "end", class: "tick"});
    label.textContent = line.name;
    root.append(label);
    line.steps.forEach((step, k) => {
      const value = line.values[k];
      const shade = typeof value === "number" ? (value - low) / (high - low || 1) : null;
      root.append(svg("rect", {x: left + cell * column.get(step), y: top + rowHeight * row, width: cell + 0.5,
        height: rowHeight, fill: shade === null ? "#ccc" : `hsl(${Math.round(260 - 200 * shade)}, 65%, ${30 + 35 * shade}%)`}));
    });
  });
  const caption = svg("text", {x: left, y: height - 6, class: "tick"});
  caption.textContent = `step ${steps[0]} to ${steps[steps.length - 1]}; dark = ${number(low)}, light = ${number(high)}`;
  root.append(caption);
  return root;
}

// A button per layer (its heads on click), with the layer's line colour where lines are drawn.
function legend(chart, onLayer, swatches = true) {
  return el("div", {class: "legend"}, ...chart.lines.map((line, index) => el("button", {
    class: "legend-item", title: "per head", onclick: () => onLayer(line.name)},
    swatches ? el("span", {class: "swatch", style: `background:${colour(index, chart.lines.length)}`}) : null,
    line.name)));
}

async function chartCard(run, metric, judgedRules) {
  const card = el("div", {class: "card", "data-metric": metric}, el("h4", {}, metric), el("div", {class: "loading"}, "loading…"));
  const draw = async () => {
    const chart = await getJson(`./chart?run=${encodeURIComponent(run)}&metric=${encodeURIComponent(metric)}`);
    // Only the levels of rules this run is judged on: a causal model's entropy near 1 is not uniform attention.
    chart.thresholds = chart.thresholds.filter((t) => judgedRules.has(t.rule));
    const body = el("div", {});
    let asHeatmap = chart.lines.length > HEATMAP_ABOVE_LAYERS;
    const heads = el("div", {class: "heads"});
    const showHeads = async (layer) => {
      const perHead = await getJson(`./chart?run=${encodeURIComponent(run)}&metric=${encodeURIComponent(metric)}&layer=${encodeURIComponent(layer)}`);
      perHead.thresholds = perHead.thresholds.filter((t) => judgedRules.has(t.rule));
      // replaceChildren, unlike el(), writes a null child as the text "null".
      heads.replaceChildren(...[el("h5", {}, `${layer}, per head`),
        perHead.lines.length ? lineChart(perHead) : el("p", {class: "meaning"},
          "no per-head scalars: SpectralMonitor(per_head=True) writes them (the histograms hold them otherwise)"),
        perHead.lines.length ? legend(perHead, () => {}) : null].filter((child) => child !== null));
    };
    const redraw = () => body.replaceChildren(asHeatmap ? heatmap(chart) : lineChart(chart),
      legend(chart, showHeads, !asHeatmap));
    const toggle = el("button", {class: "toggle", onclick: () => { asHeatmap = !asHeatmap; redraw(); }}, "lines / heatmap");
    redraw();
    card.replaceChildren(el("h4", {}, metric, " ", toggle), el("div", {class: "meaning"}, chart.meaning), body, heads);
  };
  draw().catch((error) => card.replaceChildren(el("h4", {}, metric), el("div", {class: "error"}, String(error))));
  return card;
}

async function runSection(run, summary) {
  const judgedRules = new Set(summary.verdicts.filter((v) => v.verdict !== "not measured").map((v) => v.rule));
  const section = el("section", {class: `run ${VERDICT_CLASS[summary.worst]}`, "data-run": run},
    el("h2", {}, run),
    el("p", {class: `overall ${VERDICT_CLASS[summary.worst]}`}, summary.overall),
    verdictTable(summary.verdicts));
  for (const group of summary.charts) {
    const verdict = summary.verdicts.find((v) => v.rule === group.rule);
    const cards = el("div", {class: "cards"});
    section.append(el("h3", {}, group.title, " ", verdictBadge(verdict.verdict)), cards);
    for (const metric of group.metrics) cards.append(await chartCard(run, metric, judgedRules));
  }
  if (summary.more.length) {
    const more = el("div", {class: "cards"});
    const picker = el("select", {onchange: async () => {
      if (picker.value) more.prepend(await chartCard(run, picker.value, judgedRules));
    }}, el("option", {value: ""}, "another metric…"), ...summary.more.map((m) => el("option", {value: m}, m)));
    section.append(el("h3", {}, "Other metrics ", picker), more);
  }
  return section;
}

export async function render() {
  document.head.append(el("link", {rel: "stylesheet", href: "./style.css"}));
  const main = el("main", {}, el("p", {class: "loading"}, "reading the runs…"));
  document.body.append(main);
  try {
    const summary = await getJson("./summary");
    const rank = {collapsed: 0, watch: 1, healthy: 2, "not measured": 3};
    const runs = Object.keys(summary).sort((a, b) => rank[summary[a].worst] - rank[summary[b].worst] || a.localeCompare(b));
    if (!runs.length) {
      main.replaceChildren(el("p", {}, "No run in this log directory holds spectral-monitor scalars."));
      return;
    }
    const picker = el("select", {id: "run-picker", onchange: () => {
      for (const section of main.querySelectorAll("section.run")) {
        section.hidden = picker.value !== "" && section.dataset.run !== picker.value;
      }
    }}, el("option", {value: ""}, "all runs"), ...runs.map((run) => el("option", {value: run}, run)));
    const overview = el("table", {class: "overview"}, el("tbody", {}, ...runs.map((run) => el("tr", {},
      el("td", {}, verdictBadge(summary[run].worst)), el("td", {}, run), el("td", {}, summary[run].overall)))));
    main.replaceChildren(el("header", {}, el("h1", {}, "Spectral monitor"), el("label", {}, "run ", picker)), overview);
    // ?run=NAME in the page's address shows that run alone (a link to one run's diagnosis).
    const chosen = new URLSearchParams(window.location.search).get("run");
    for (const run of runs) {
      if (chosen === null || chosen === run) main.append(await runSection(run, summary[run]));
    }
    if (chosen !== null && runs.includes(chosen)) picker.value = chosen;
  } catch (error) {
    main.replaceChildren(el("p", {class: "error"}, `Could not read the runs: ${error}`));
  }
}
