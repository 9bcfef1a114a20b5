// molt view's own JavaScript (no build step): the charts (Plotly) with their click-through, and the token colouring.
const molt = (() => {
  const layout = (title, unit) => ({
    title: { text: title, font: { size: 14 } }, margin: { l: 56, r: 12, t: 36, b: 40 }, hovermode: "closest",
    xaxis: { title: { text: "step" } }, yaxis: { title: { text: unit || "" } }, legend: { orientation: "h", y: -0.25 },
  });
  const config = { displaylogo: false, responsive: true };

  function lines(chart) {
    const traces = chart.series.map((s) => ({ type: "scatter", mode: "lines+markers", name: s.name, x: s.x, y: s.y,
                                              marker: { size: 5 }, line: { width: 1.5 } }));
    const bySource = {};
    for (const r of chart.heldout || []) (bySource[r.source + " " + r.name] ||= []).push(r);
    for (const [name, rs] of Object.entries(bySource)) {
      traces.push({ type: "scatter", mode: "markers", name: "held-out " + name, x: rs.map((r) => r.step),
                    y: rs.map((r) => r.value), marker: { size: 9, symbol: "diamond" },
                    error_y: { type: "data", symmetric: false, array: rs.map((r) => r.hi - r.value),
                               arrayminus: rs.map((r) => r.value - r.lo) } });
    }
    return traces;
  }

  function draw(div, chart, i, clickable) {
    Plotly.react(div, lines(chart), layout(chart.title, chart.unit), config);
    if (clickable && !div.dataset.bound) {
      div.dataset.bound = "1";
      div.on("plotly_click", (ev) => { window.location = `/run/${i}/step/${Math.round(ev.points[0].x)}`; });
    }
  }

  function overview(i, data) {
    const root = document.getElementById("charts");
    const render = (d) => {
      d.charts.forEach((chart, k) => {
        let div = document.getElementById("chart-" + k);
        if (!div) {
          div = document.createElement("div");
          div.id = "chart-" + k; div.className = "chart"; div.dataset.title = chart.title;
          root.appendChild(div);
        }
        draw(div, chart, i, d.clickable);
      });
    };
    render(data);
    const pick = document.getElementById("metric-pick");
    const extra = () => pick.value && fetch(`/api/run/${i}/curves?metric=${encodeURIComponent(pick.value)}`)
      .then((r) => r.json()).then((c) => draw(document.getElementById("chart-extra"), c, i, data.clickable));
    pick.addEventListener("change", extra);
    if (data.live) setInterval(() => fetch(`/api/run/${i}/curves`).then((r) => r.json()).then((d) => {
      render(d); extra();
    }), 5000);
  }

  // ----- the sample view: every token coloured by the chosen field -----
  const num = (v) => (v === "" || v === undefined ? null : Number(v));
  const mix = (a, b, t) => `rgb(${a.map((x, k) => Math.round(x + (b[k] - x) * Math.max(0, Math.min(1, t)))).join(",")})`;
  const WHITE = [255, 255, 255], RED = [235, 90, 80], BLUE = [70, 130, 230], PURPLE = [150, 90, 200];
  const STALE = ["#bfe8bf", "#ffe08a", "#ffb36b", "#ff7b7b"];
  const VERSIONS = ["#cfe3ff", "#ffd9b3", "#d5f0c8", "#f3ccf0", "#fff2a8", "#c9f0ee", "#e8d5c4", "#dcd0ff"];

  function colourer(field, toks) {
    const vals = toks.map((t) => num(t.dataset[field])).filter((v) => v !== null && !Number.isNaN(v));
    const maxAbs = Math.max(1e-6, ...vals.map(Math.abs));
    switch (field) {
      case "staleness": return [(v) => STALE[Math.min(v, 3)], STALE.map((c, k) => [k === 3 ? "3+" : String(k), c])];
      case "version": return [(v) => VERSIONS[v % VERSIONS.length], [...new Set(vals)].sort((a, b) => a - b)
        .map((v) => ["v" + v, VERSIONS[v % VERSIONS.length]])];
      case "trained": return [(v, t) => (t.dataset.trained === "True" ? "#b9e6b9" : "#f7b2b2"),
        [["trained", "#b9e6b9"], ["left out (token selection)", "#f7b2b2"]]];
      case "is_weight": return [(v) => (v >= 1 ? mix(WHITE, BLUE, Math.log(v) / Math.log(2)) : mix(WHITE, RED, -Math.log(v) / Math.log(2))),
        [["< 1", mix(WHITE, RED, 0.8)], ["1", "#fff"], ["> 1", mix(WHITE, BLUE, 0.8)]]];
      case "entropy": return [(v) => mix(WHITE, PURPLE, v / maxAbs), [["0", "#fff"], [maxAbs.toPrecision(3), mix(WHITE, PURPLE, 1)]]];
      default: return [(v) => (v >= 0 ? mix(WHITE, BLUE, v / maxAbs) : mix(WHITE, RED, -v / maxAbs)),
        [["-" + maxAbs.toPrecision(3), mix(WHITE, RED, 1)], ["0", "#fff"], ["+" + maxAbs.toPrecision(3), mix(WHITE, BLUE, 1)]]];
    }
  }

  function describe(t) {
    const d = t.dataset, parts = [`token ${d.i} (id ${d.id})`, ["prompt", "policy", "environment / tool"][d.kind]];
    if (d.kind === "1") {
      parts.push(`version ${d.version} (staleness ${d.staleness})`, `advantage ${d.adv}`, `engine logprob ${d.engine_lp}`,
                 `trainer logprob ${d.trainer_lp}`, `gap ${d.gap}`, `importance weight ${d.is_weight || "-"}`,
                 `entropy ${d.entropy}`, d.trained === "True" ? "trained" : "not trained: left out by token selection");
    } else {
      parts.push("context: never trained on");
    }
    return parts.join(" · ");
  }

  function sample() {
    const toks = [...document.querySelectorAll("#conversation .tok")], pick = document.getElementById("color-by");
    const info = document.getElementById("tok-info");
    const paint = () => {
      const [colour, legend] = colourer(pick.value, toks);
      for (const t of toks) {
        const v = num(t.dataset[pick.value]);
        t.style.background = t.dataset.kind === "1" && (v !== null || pick.value === "trained") ? colour(v, t) : "";
      }
      document.getElementById("legend").innerHTML = legend.map(([name, c]) => `<span style="background:${c}">${name}</span>`).join("");
    };
    for (const t of toks) {
      t.title = describe(t);
      t.addEventListener("mouseenter", () => { info.textContent = describe(t); });
      t.addEventListener("click", () => {
        toks.forEach((x) => x.classList.remove("sel")); t.classList.add("sel"); info.textContent = describe(t);
      });
    }
    pick.addEventListener("change", paint);
    paint();
  }

  function timeline(i, data) {
    const lanes = [...new Set(data.bars.map((b) => b.lane))];
    const colour = (lane) => (lane.startsWith("generation") ? "#7aa7e0" : lane === "evaluation" ? "#c79be0"
      : lane.includes("train") && !lane.includes("wait") ? "#e08a5a" : lane.includes("sync") ? "#5ab87a" : "#cfcfcf");
    const traces = lanes.map((lane) => {
      const bs = data.bars.filter((b) => b.lane === lane);
      return { type: "bar", orientation: "h", name: lane, y: bs.map(() => lane), x: bs.map((b) => b.length),
               base: bs.map((b) => b.start), hovertext: bs.map((b) => b.what), hoverinfo: "text",
               customdata: bs.map((b) => b.step), marker: { color: colour(lane) } };
    });
    const div = document.getElementById("timeline");
    const lay = layout("wall time (s from the first step shown)", "");
    lay.xaxis.title.text = "seconds"; lay.barmode = "overlay"; lay.showlegend = false;
    lay.yaxis = { categoryorder: "array", categoryarray: lanes.slice().reverse(), automargin: true };
    Plotly.newPlot(div, traces, lay, config);
    div.on("plotly_click", (ev) => { window.location = `/run/${i}/step/${ev.points[0].customdata}`; });
  }

  function compare(data) {
    Plotly.newPlot("compare-chart", lines({ series: data.series }), layout(data.title, data.title), config);
  }

  return { overview, sample, timeline, compare };
})();
