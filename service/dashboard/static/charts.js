// Pipette dashboard charts: plain SVG built with the DOM (no library, nothing fetched).
// Every mark carries a class and data-* attributes naming what it shows, so the browser
// tests can check the drawn elements against the API's data, and <title> tooltips for people.

const SVGNS = 'http://www.w3.org/2000/svg';

function build(node, attrs, children) {
  for (const [key, value] of Object.entries(attrs || {})) {
    if (value === undefined || value === null || value === false) continue;
    if (key === 'text') node.textContent = String(value);
    else if (key.startsWith('on') && typeof value === 'function') node.addEventListener(key.slice(2), value);
    else node.setAttribute(key, value === true ? '' : String(value));
  }
  for (const child of children.flat(Infinity)) {
    if (child === null || child === undefined || child === false) continue;
    node.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return node;
}

/** An HTML element: h('td', {class: 'num', text: '3'}). Text is always set as text, never HTML. */
export function h(tag, attrs = {}, ...children) { return build(document.createElement(tag), attrs, children); }
/** An SVG element. */
export function s(tag, attrs = {}, ...children) { return build(document.createElementNS(SVGNS, tag), attrs, children); }

// ---- formatting (the CLI's units) ------------------------------------------------------
export const fmt = {
  bytes(n) {
    if (n === null || n === undefined) return '–';
    let v = Number(n);
    for (const unit of ['B', 'KiB', 'MiB', 'GiB', 'TiB']) {
      if (Math.abs(v) < 1024 || unit === 'TiB') return unit === 'B' ? `${v.toFixed(0)} B` : `${v.toFixed(1)} ${unit}`;
      v /= 1024;
    }
    return `${v.toFixed(1)} TiB`;
  },
  seconds(t) {
    if (t === null || t === undefined) return '–';
    if (t < 1) return `${(t * 1000).toFixed(1)} ms`;
    if (t < 120) return `${t.toFixed(2)} s`;
    if (t < 7200) return `${(t / 60).toFixed(1)} min`;
    return `${(t / 3600).toFixed(1)} h`;
  },
  rate(v) {
    if (v === null || v === undefined) return '–';
    if (v >= 1e6) return `${(v / 1e6).toFixed(2)}M`;
    if (v >= 1e4) return `${(v / 1e3).toFixed(1)}k`;
    return v.toFixed(0);
  },
  pct(f) { return f === null || f === undefined ? '–' : `${f >= 0 ? '+' : ''}${(f * 100).toFixed(0)}%`; },
  gbs(bw) { return `${(bw / 1e9).toFixed(2)} GB/s`; },
};

/** Short tick labels: the unit chosen once for the whole axis, at most 3 significant digits. */
export const ticks = {
  seconds: (v) => (v < 1 ? `${+(v * 1000).toPrecision(3)} ms` : `${+v.toPrecision(3)} s`),
  bytes(max) {
    const units = [['TiB', 1024 ** 4], ['GiB', 1024 ** 3], ['MiB', 1024 ** 2], ['KiB', 1024], ['B', 1]];
    const [name, size] = units.find(([, u]) => max >= u * 2) || units[units.length - 1];
    const format = (v) => `${+(v / size).toPrecision(3)} ${name}`;
    format.unit = size; // ticks fall on round numbers of this unit
    return format;
  },
  flops: (v) => `${+(v / 1e12).toPrecision(3)}`,
};

// ---- scales and axes -----------------------------------------------------------------
function linear(d0, d1, r0, r1) {
  const k = d1 === d0 ? 0 : (r1 - r0) / (d1 - d0);
  const f = (v) => r0 + (v - d0) * k;
  f.domain = [d0, d1];
  f.ticks = (n = 5) => niceTicks(d0, d1, n);
  return f;
}

function logScale(d0, d1, r0, r1) {
  const l0 = Math.log10(d0), l1 = Math.log10(d1);
  const k = l1 === l0 ? 0 : (r1 - r0) / (l1 - l0);
  const f = (v) => r0 + (Math.log10(Math.max(v, 1e-300)) - l0) * k;
  f.domain = [d0, d1];
  f.ticks = () => logTicks(d0, d1);
  return f;
}

export function niceTicks(min, max, n = 5) {
  if (!(max > min)) return [min];
  let step = 10 ** Math.floor(Math.log10((max - min) / n));
  const err = (n / (max - min)) * step;
  if (err <= 0.15) step *= 10; else if (err <= 0.35) step *= 5; else if (err <= 0.75) step *= 2;
  const out = [];
  for (let v = Math.ceil(min / step) * step; v <= max + step * 1e-9; v += step) out.push(+v.toPrecision(12));
  return out;
}

function logTicks(min, max) {
  const out = [];
  // 1-2-5 per decade while they fit; over more than two decades their labels would overlap
  const mantissas = Math.log10(max / min) > 2 ? [1] : [1, 2, 5];
  for (let e = Math.floor(Math.log10(min)); e <= Math.ceil(Math.log10(max)); e++) {
    for (const m of mantissas) {
      const v = m * 10 ** e;
      if (v >= min * 0.999 && v <= max * 1.001) out.push(v);
    }
  }
  return out.length >= 2 ? out : [min, max];
}

/** A plot frame: grid, axes with ticks and labels; returns the scales and the plot group. */
function frame(opts) {
  const width = opts.width || 560, height = opts.height || 280;
  const m = Object.assign({ l: 62, r: 18, t: 14, b: 42 }, opts.margin || {});
  const svg = s('svg', { width, height, viewBox: `0 0 ${width} ${height}`, class: `chart ${opts.cls || ''}`,
    role: 'img', 'aria-label': opts.label || '' });
  const make = (axis, r0, r1) => (axis.log ? logScale : linear)(axis.min, axis.max, r0, r1);
  const sx = make(opts.x, m.l, width - m.r);
  const sy = make(opts.y, height - m.b, m.t);
  const grid = s('g', { class: 'grid' });
  const axes = s('g', { class: 'axis' });
  const fx = opts.x.format || ((v) => String(v)), fy = opts.y.format || ((v) => String(v));
  const unit = (opts.x.format && opts.x.format.unit) || 0;
  const xticks = opts.x.tickValues ||
    (unit ? niceTicks(opts.x.min / unit, opts.x.max / unit, opts.x.count || 6).map((v) => v * unit) : sx.ticks(opts.x.count || 6));
  for (const v of xticks) {
    grid.append(s('line', { class: 'gridline', x1: sx(v), x2: sx(v), y1: m.t, y2: height - m.b }));
    axes.append(s('text', { x: sx(v), y: height - m.b + 15, 'text-anchor': 'middle', text: fx(v) }));
  }
  for (const v of opts.y.tickValues || sy.ticks(5)) {
    grid.append(s('line', { class: 'gridline', x1: m.l, x2: width - m.r, y1: sy(v), y2: sy(v) }));
    axes.append(s('text', { x: m.l - 6, y: sy(v) + 4, 'text-anchor': 'end', text: fy(v) }));
  }
  axes.append(s('line', { x1: m.l, x2: width - m.r, y1: height - m.b, y2: height - m.b }));
  axes.append(s('line', { x1: m.l, x2: m.l, y1: m.t, y2: height - m.b }));
  axes.append(s('text', { class: 'title', x: (m.l + width - m.r) / 2, y: height - 6, 'text-anchor': 'middle',
    text: opts.x.label || '' }));
  axes.append(s('text', { class: 'title', x: 12, y: (m.t + height - m.b) / 2, 'text-anchor': 'middle',
    transform: `rotate(-90 12 ${(m.t + height - m.b) / 2})`, text: opts.y.label || '' }));
  const plot = s('g', { class: 'plot' });
  svg.append(grid, axes, plot);
  return { svg, plot, sx, sy, width, height, m };
}

const BAD = new Set(['oom', 'failed', 'timeout']);

/** The measured throughput of a trial (tokens/s), or null. */
function measured(t) { return t.tokens_per_s || null; }

// ---- the model's error: one convention everywhere ---------------------------------------------
/** The API's prediction_error and the CLI's ERROR %: the same rule for the table, the MAPE and the plot. */
export const ERROR_RULE = '(measured − predicted) / predicted: + when the trial ran slower than predicted';
export function predictionError(t) {
  return t.predicted_step_time > 0 && t.measured_step_time > 0
    ? (t.measured_step_time - t.predicted_step_time) / t.predicted_step_time : null;
}
/** Mean |prediction error| over the ok trials, or null. */
export function mape(trials) {
  const errs = trials.filter((t) => t.state === 'ok').map(predictionError).filter((e) => e !== null);
  return errs.length ? errs.reduce((a, e) => a + Math.abs(e), 0) / errs.length : null;
}

// ---- convergence ----------------------------------------------------------------------
/**
 * Measured throughput of each trial and the best so far, against trial number; the
 * predicted throughput of each trial in grey; the stop point marked when the job has ended.
 */
export function convergence(trials, { tokensPerStep, final, stopReason }) {
  const ended = trials.filter((t) => t.state !== 'running' || t.tokens_per_s);
  const numbers = trials.map((t) => t.number);
  const lastNumber = numbers.length ? Math.max(...numbers) : 0;
  // the trials that ran, not the budget's every allowed trial
  const xmax = Math.max(lastNumber, 1);
  const predicted = (t) => (t.predicted_step_time ? tokensPerStep / t.predicted_step_time : null);
  // The scale follows the measurements: a prediction far above them (the analytic model on
  // CPUs) is pinned to the top edge instead of flattening every measured point.
  const seen = ended.map(measured).filter((v) => v > 0);
  const values = seen.length ? seen : ended.map(predicted).filter((v) => v > 0);
  const ymax = values.length ? Math.max(...values) * 1.25 : 1;
  const f = frame({ cls: 'convergence', label: 'throughput per trial', margin: { t: 20 },
    x: { min: -0.5, max: xmax + 1, label: 'trial', tickValues: niceTicks(0, xmax, Math.min(xmax, 8)).filter(Number.isInteger) },
    y: { min: 0, max: ymax, label: 'tokens/s', format: fmt.rate } });
  // best so far: a step line through the running maximum of ok trials
  let best = null;
  const pts = [];
  for (const t of [...trials].sort((a, b) => a.number - b.number)) {
    if (t.state === 'ok' && t.tokens_per_s && (best === null || t.tokens_per_s > best)) best = t.tokens_per_s;
    if (best !== null) pts.push([t.number, best]);
  }
  if (pts.length) {
    let d = `M${f.sx(pts[0][0])},${f.sy(pts[0][1])}`;
    for (let i = 1; i < pts.length; i++) d += ` H${f.sx(pts[i][0])} V${f.sy(pts[i][1])}`;
    d += ` H${f.sx(pts[pts.length - 1][0] + 0.4)}`;
    f.plot.append(s('path', { class: 'best-line', d, 'data-best': best }, s('title', { text: `best so far: ${fmt.rate(best)} tokens/s` })));
  }
  for (const t of trials) {
    const p = predicted(t);
    if (p) {
      const clipped = p > ymax;
      const y = clipped ? f.m.t : f.sy(p);
      f.plot.append(s('rect', { class: `predicted${clipped ? ' clipped' : ''}`, x: f.sx(t.number) - 3, y: y - 3, width: 6, height: 6,
        'data-trial': t.number, 'data-value': p }, s('title', { text: `trial ${t.number} predicted ${fmt.rate(p)} tokens/s` })));
    }
    const v = measured(t);
    const tip = `trial ${t.number} ${t.label}\n${t.state}${v ? `: ${fmt.rate(v)} tokens/s (${fmt.seconds(t.measured_step_time)}/step)` : ''}` +
      (t.error ? `\n${t.error.split('\n')[0]}` : '');
    if (BAD.has(t.state)) {
      const x = f.sx(t.number), y = f.sy(0) - 6;
      f.plot.append(s('path', { class: `point bad ${t.state}`, d: `M${x - 5},${y - 5} L${x + 5},${y + 5} M${x - 5},${y + 5} L${x + 5},${y - 5}`,
        'data-trial': t.number, 'data-state': t.state }, s('title', { text: tip })));
    } else if (v) {
      f.plot.append(s('circle', { class: `point ${t.state === 'ok' ? 'ok' : 'pruned'}`, cx: f.sx(t.number), cy: f.sy(v), r: 5,
        'data-trial': t.number, 'data-state': t.state, 'data-value': v }, s('title', { text: tip })));
    }
  }
  // Predictions above the scale, pinned to its top edge, are labelled in a row above the plot:
  // one label per run of neighbours whose labels would overlap ("pred 25.1k–31.0k ↑").
  const runs = [];
  const label = (run) => {
    const vs = run.trials.map(predicted), lo = fmt.rate(Math.min(...vs)), hi = fmt.rate(Math.max(...vs));
    const text = `pred ${lo}${hi === lo ? '' : `–${hi}`} ↑`, width = text.length * 6; // 9px text: under 6px a character
    const x = Math.min(f.sx(run.trials[0].number) - 3, f.width - width);
    return { trials: run.trials, text, x, end: x + width };
  };
  for (const t of trials.filter((u) => predicted(u) > ymax).sort((a, b) => a.number - b.number)) {
    runs.push(label({ trials: [t] }));
    while (runs.length > 1 && runs[runs.length - 1].x < runs[runs.length - 2].end + 6) {
      const b = runs.pop(), a = runs.pop();
      runs.push(label({ trials: [...a.trials, ...b.trials] }));
    }
  }
  for (const run of runs) {
    f.plot.append(s('text', { class: 'above-scale', x: run.x, y: f.m.t - 6, 'font-size': 9, text: run.text,
      'data-trials': run.trials.map((t) => t.number).join(' ') },
    s('title', { text: run.trials.map((t) => `trial ${t.number} predicted ${fmt.rate(predicted(t))} tokens/s`).join('\n') })));
  }
  if (final && trials.length) {
    const x = f.sx(lastNumber + 0.5);
    f.plot.append(s('g', { class: 'stop-marker', 'data-trial': lastNumber },
      s('line', { x1: x, x2: x, y1: f.m.t, y2: f.height - f.m.b }),
      s('text', { x: x - 4, y: f.m.t + 10, 'text-anchor': 'end', text: `stop: ${stopReason || 'ended'}` })));
  }
  return f.svg;
}

// ---- predicted against measured ----------------------------------------------------------
/** Step time predicted (by the learned model when the trial was proposed) against measured. */
export function predictedVsMeasured(trials) {
  const pts = trials.filter((t) => t.predicted_step_time > 0 && t.measured_step_time > 0 && !BAD.has(t.state));
  const ok = pts.filter((t) => t.state === 'ok');
  const error = mape(ok);
  const all = pts.flatMap((t) => [t.predicted_step_time, t.measured_step_time]);
  const lo = all.length ? Math.min(...all) / 1.6 : 0.001, hi = all.length ? Math.max(...all) * 1.6 : 1;
  const f = frame({ cls: 'scatter', label: 'predicted against measured step time', width: 440, height: 320,
    margin: { l: 70 },
    x: { min: lo, max: hi, log: true, label: 'predicted step time', format: ticks.seconds },
    y: { min: lo, max: hi, log: true, label: 'measured step time', format: ticks.seconds } });
  // the +-25% band, cut where it leaves the plot (both axes run lo..hi), and the y = x line:
  // on the line the model is exact
  const band = [[lo, lo * 1.25], [hi / 1.25, hi], [hi, hi], [hi, hi * 0.75], [lo / 0.75, lo], [lo, lo]];
  f.plot.append(s('polygon', { class: 'band', points: band.map(([x, y]) => `${f.sx(x)},${f.sy(y)}`).join(' ') },
    s('title', { text: 'within 25% of the prediction' })));
  f.plot.append(s('line', { class: 'diagonal', x1: f.sx(lo), y1: f.sy(lo), x2: f.sx(hi), y2: f.sy(hi) }));
  for (const t of pts) {
    const err = predictionError(t);
    f.plot.append(s('circle', { class: `point ${t.state === 'ok' ? 'ok' : 'pruned'}`, cx: f.sx(t.predicted_step_time),
      cy: f.sy(t.measured_step_time), r: 5, 'data-trial': t.number, 'data-predicted': t.predicted_step_time,
      'data-measured': t.measured_step_time },
    s('title', { text: `trial ${t.number} ${t.label}\npredicted ${fmt.seconds(t.predicted_step_time)}, measured ` +
      `${fmt.seconds(t.measured_step_time)} (${fmt.pct(err)})` })));
  }
  f.svg.dataset.mape = error === null ? '' : String(error);
  f.svg.dataset.points = String(pts.length);
  return { svg: f.svg, mape: error, n: ok.length };
}

// ---- colour ramps -------------------------------------------------------------------
function mix(a, b, t) {
  const pa = a.match(/\w\w/g).map((x) => parseInt(x, 16)), pb = b.match(/\w\w/g).map((x) => parseInt(x, 16));
  return '#' + pa.map((v, i) => Math.round(v + (pb[i] - v) * t).toString(16).padStart(2, '0')).join('');
}
export function ramp(stops, t) {
  const x = Math.min(1, Math.max(0, Number.isFinite(t) ? t : 0)) * (stops.length - 1);
  const i = Math.min(stops.length - 2, Math.floor(x));
  return mix(stops[i], stops[i + 1], x - i);
}
const GOOD = ['#e6eefb', '#8fb3ee', '#2f6fde', '#153f8a'];
const LINKS = ['#b3261e', '#ef8a3c', '#f5d77a', '#cfe6c6', '#6bb58c'];

function hatch() {
  return s('defs', {}, s('pattern', { id: 'hatch', width: 6, height: 6, patternUnits: 'userSpaceOnUse',
    patternTransform: 'rotate(45)' }, s('rect', { width: 6, height: 6, fill: '#f6e2e2' }),
  s('line', { x1: 0, y1: 0, x2: 0, y2: 6, stroke: '#d98c8c', 'stroke-width': 2 })));
}

// ---- the tp x pp candidate map ------------------------------------------------------------
/**
 * One cell per (tp, pp): the best measured throughput of its ok trials; else, where trials ran
 * but none ended ok, the learned model's prediction they were proposed with ("pred", learned).
 * A cell no trial tried shows no figure: the plan's analytic estimate, not corrected by what
 * the trials measured (several times too fast on CPUs), is only in its tooltip. "OOM
 * (predicted)" when every candidate of the cell was predicted not to fit; a red corner when a
 * trial ran out of memory.
 */
export function candidateMap(plan, trials, tokensPerStep) {
  const cells = new Map();
  const cell = (c) => {
    const key = `${c.tp}x${c.pp}`;
    if (!cells.has(key)) cells.set(key, { tp: c.tp, pp: c.pp, analytic: null, candidates: 0, oomPred: 0, measured: null, learned: null, trials: 0, oomMeasured: 0, notSure: 0, leastChance: 1 });
    return cells.get(key);
  };
  const better = (a, b) => (b && (a === null || b > a) ? b : a);
  for (const p of (plan && plan.ranked) || []) {
    const c = cell(p.config);
    c.candidates++;
    c.analytic = better(c.analytic, p.perf.tokens_per_s);
    // the plan keeps a candidate next to the memory limit with its chance to fit (pipette.fits)
    if (p.sure_to_fit === false) { c.notSure++; c.leastChance = Math.min(c.leastChance, p.chance_to_fit); }
  }
  for (const d of (plan && plan.out_of_memory) || []) cell(d.config).oomPred++;
  for (const t of trials) {
    const c = cell(t.config);
    c.trials++;
    if (t.state === 'oom') c.oomMeasured++;
    if (t.state === 'ok') c.measured = better(c.measured, t.tokens_per_s);
    if (t.predicted_step_time) c.learned = better(c.learned, tokensPerStep / t.predicted_step_time);
  }
  const tps = [...new Set([...cells.values()].map((c) => c.tp))].sort((a, b) => a - b);
  const pps = [...new Set([...cells.values()].map((c) => c.pp))].sort((a, b) => a - b);
  const maxMeasured = Math.max(0, ...[...cells.values()].map((c) => c.measured || 0));
  const maxLearned = Math.max(0, ...[...cells.values()].map((c) => c.learned || 0));
  const cw = Math.max(70, Math.min(110, 640 / Math.max(tps.length, 1))), ch = 46;
  const m = { l: 56, t: 26 };
  const width = m.l + cw * tps.length + 10, height = m.t + ch * pps.length + 34;
  const svg = s('svg', { width, height, viewBox: `0 0 ${width} ${height}`, class: 'chart heatmap', role: 'img',
    'aria-label': 'best throughput per tp x pp' }, hatch());
  tps.forEach((tp, i) => svg.append(s('text', { class: 'title', x: m.l + cw * i + cw / 2, y: m.t - 8, 'text-anchor': 'middle', text: `tp ${tp}` })));
  pps.forEach((pp, j) => svg.append(s('text', { class: 'title', x: m.l - 8, y: m.t + ch * j + ch / 2 + 4, 'text-anchor': 'end', text: `pp ${pp}` })));
  for (const c of cells.values()) {
    const x = m.l + cw * tps.indexOf(c.tp), y = m.t + ch * pps.indexOf(c.pp);
    let kind, fill = null, line1, line2;
    const plural = (n, what) => `${n} ${what}${n === 1 ? '' : 's'}`;
    if (c.measured !== null) {
      kind = 'measured'; fill = ramp(GOOD, 0.25 + 0.75 * (c.measured / maxMeasured));
      line1 = `${fmt.rate(c.measured)} tok/s`; line2 = `measured, ${plural(c.trials, 'trial')}`;
    } else if (c.learned !== null) {
      kind = 'learned'; fill = mix('#f3f5f8', '#c9d6ee', c.learned / maxLearned);
      line1 = `pred ${fmt.rate(c.learned)}`; line2 = 'learned, none ok';
    } else if (c.trials) {
      kind = 'no-result'; line1 = 'no result'; line2 = `${plural(c.trials, 'trial')}, none ok`;
    } else if (c.candidates) {
      kind = 'untried'; line1 = 'not tried';
      line2 = plural(c.candidates, 'candidate') + (c.notSure ? `, ${c.notSure} may not fit` : '');
    } else if (c.oomPred) {
      kind = 'oom-pred'; line1 = 'OOM'; line2 = `predicted (${c.oomPred})`;
    } else {
      kind = 'empty'; line1 = '–'; line2 = '';
    }
    const dark = kind === 'measured' && c.measured / maxMeasured > 0.55;
    const tip = `tp ${c.tp} x pp ${c.pp}: ${c.candidates} candidates may fit` +
      (c.notSure ? ` (${c.notSure} not sure to fit, the least likely ${Math.round(c.leastChance * 100)}%)` : '') +
      `, ${c.oomPred} predicted OOM, ${c.trials} trials` +
      (c.measured !== null ? `, best measured ${fmt.rate(c.measured)} tokens/s` : '') +
      (c.learned !== null ? `, best learned prediction of its trials ${fmt.rate(c.learned)} tokens/s` : '') +
      (c.analytic !== null ? `, best analytic estimate ${fmt.rate(c.analytic)} tokens/s (not corrected by the trials)` : '') +
      (c.oomMeasured ? `, ${c.oomMeasured} ran out of memory` : '');
    const g = s('g', { class: `cell ${kind}${c.oomMeasured ? ' oom-measured' : ''}`, 'data-tp': c.tp, 'data-pp': c.pp,
      'data-value': c.measured ?? c.learned ?? '', 'data-analytic': c.analytic ?? '', 'data-kind': kind },
    s('title', { text: tip }),
    s('rect', { class: 'bg', x: x + 1, y: y + 1, width: cw - 2, height: ch - 2, rx: 4, fill: fill || undefined,
      stroke: '#dde1e8' }),
    s('text', { x: x + cw / 2, y: y + ch / 2 - 2, 'text-anchor': 'middle', class: dark ? 'light' : undefined, text: line1 }),
    s('text', { x: x + cw / 2, y: y + ch / 2 + 12, 'text-anchor': 'middle', 'font-size': 9, class: dark ? 'light' : undefined, text: line2 }));
    if (c.oomMeasured) {
      g.append(s('path', { class: 'oom-measured-mark', d: `M${x + cw - 15},${y + 1} H${x + cw - 1} V${y + 15} Z` },
        s('title', { text: `${c.oomMeasured} trial(s) ran out of memory` })));
    }
    svg.append(g);
  }
  return svg;
}

// ---- memory of the best configuration ----------------------------------------------------
export const MEMORY_PARTS = ['weights', 'gradients', 'optimizer', 'activations', 'logits', 'buffers', 'overhead'];
const PART_COLOURS = { weights: '#2f6fde', gradients: '#8e5bd6', optimizer: '#d6845b', activations: '#1f9d55',
  logits: '#2b8fb3', buffers: '#c9a227', overhead: '#9aa3b2' };

/** The parts of the estimate that are tensors: all but the fixed overhead of the process. */
export const TENSOR_PARTS = MEMORY_PARTS.filter((p) => p !== 'overhead');

/**
 * Like with like (the CLI's rule): the estimator's tensor bytes for its heaviest rank (its
 * breakdown less the fixed overhead, stacked) against the tensor bytes each rank held at its
 * peak (the allocator's count on a GPU, live tensors on a CPU), and the capacity it planned
 * with; a capacity far off the tensors' scale (a CPU host's RAM) is named at the top right.
 */
export function memoryChart(record, placement) {
  const mem = record.memory || {}, breakdown = mem.breakdown || {};
  const measurement = record.measurement || {};
  const peaks = measurement.peak_memory || [];
  const rss = (measurement.extra && measurement.extra.peak_rss_bytes) || [];
  const capacity = mem.capacity_bytes || 0;
  // the estimate's live figure (records before it was stored: its breakdown less the overhead)
  const tensors = mem.live_bytes ?? ((mem.peak_bytes || 0) - (breakdown.overhead || 0));
  const rows = [{ label: `predicted tensors, stage ${mem.stage ?? 0}`, parts: breakdown, total: tensors }];
  peaks.forEach((b, rank) => rows.push({ label: `device ${placement ? placement[rank] : rank} (rank ${rank}) measured`, value: b, rank }));
  const top = Math.max(tensors, ...peaks, 1);
  const capacityOnScale = capacity > 0 && capacity <= 4 * top;
  const max = Math.max(top, capacityOnScale ? capacity : 0) * 1.08;
  const width = 620, rowH = 24, m = { l: 220, r: 70, t: 20, b: 34 };
  const height = m.t + rowH * rows.length + m.b;
  const f = frame({ cls: 'memory', label: 'tensor memory per device', width, height, margin: m,
    x: { min: 0, max, label: 'tensor memory', format: ticks.bytes(max), count: 5 }, y: { min: 0, max: rows.length, tickValues: [] } });
  rows.forEach((row, i) => {
    const y = m.t + rowH * i + 4, hgt = rowH - 8;
    f.plot.append(s('text', { x: m.l - 8, y: y + hgt / 2 + 4, 'text-anchor': 'end', text: row.label }));
    if (row.parts) {
      let x0 = 0;
      for (const part of TENSOR_PARTS) {
        const v = row.parts[part] || 0;
        if (v <= 0) continue;
        f.plot.append(s('rect', { class: 'mem-seg', 'data-part': part, 'data-bytes': v, x: f.sx(x0), y,
          width: Math.max(f.sx(x0 + v) - f.sx(x0), 0.5), height: hgt, fill: PART_COLOURS[part] },
        s('title', { text: `${part}: ${fmt.bytes(v)}` })));
        x0 += v;
      }
      f.plot.append(s('text', { class: 'mem-total', 'data-bytes': row.total, x: f.sx(x0) + 5, y: y + hgt / 2 + 4,
        text: fmt.bytes(row.total) }, s('title', { text: `and ${fmt.bytes(breakdown.overhead || 0)} of fixed process ` +
        'overhead, left out: the measured peaks count tensors only' })));
    } else {
      const rssNote = rss[row.rank] ? `; the process's peak RSS: ${fmt.bytes(rss[row.rank])}` : '';
      f.plot.append(s('rect', { class: 'mem-bar measured', 'data-rank': row.rank, 'data-bytes': row.value, x: f.sx(0), y,
        width: Math.max(f.sx(row.value) - f.sx(0), 1), height: hgt, fill: '#56627a' },
      s('title', { text: `${row.label}: ${fmt.bytes(row.value)} of tensors at the peak${rssNote}` })));
      f.plot.append(s('text', { x: f.sx(row.value) + 5, y: y + hgt / 2 + 4, text: fmt.bytes(row.value) }));
    }
  });
  if (capacityOnScale) {
    const x = f.sx(capacity);
    f.plot.append(s('g', { class: 'capacity', 'data-bytes': capacity },
      s('line', { x1: x, x2: x, y1: m.t, y2: height - m.b }),
      s('text', { x: x + 4, y: height - m.b - 4, text: `capacity ${fmt.bytes(capacity)}` })));
  } else if (capacity) {
    f.plot.append(s('g', { class: 'capacity off-scale', 'data-bytes': capacity },
      s('text', { x: width - m.r, y: m.t - 6, 'text-anchor': 'end', text: `capacity ${fmt.bytes(capacity)}, off the scale →` })));
  }
  return f.svg;
}

export function memoryLegend() {
  return TENSOR_PARTS.map((p) => {
    const swatch = document.createElement('i');
    swatch.style.background = PART_COLOURS[p];
    return h('span', {}, swatch, p);
  });
}

// ---- cluster: link matrix and per-device bars ----------------------------------------------
/** Links slower than half the median of their kind (within a node, across nodes): the CLI's rule. */
export function slowLinks(profile) {
  const bw = profile.links.bandwidth, node = profile.devices.map((d) => d.node), n = bw.length;
  const kinds = { true: [], false: [] };
  for (let i = 0; i < n; i++) for (let j = 0; j < n; j++) if (i !== j && bw[i][j] > 0) kinds[node[i] === node[j]].push(bw[i][j]);
  const median = (a) => { const b = [...a].sort((x, y) => x - y); return b.length ? (b.length % 2 ? b[(b.length - 1) / 2] : (b[b.length / 2 - 1] + b[b.length / 2]) / 2) : null; };
  const med = { true: median(kinds.true), false: median(kinds.false) };
  const slow = new Set();
  for (let i = 0; i < n; i++) for (let j = 0; j < n; j++) {
    const m = med[node[i] === node[j]];
    if (i !== j && m && bw[i][j] < 0.5 * m) slow.add(`${i},${j}`);
  }
  return { slow, median: med };
}

export function linkMatrix(profile) {
  const bw = profile.links.bandwidth, lat = profile.links.latency, n = bw.length;
  const { slow } = slowLinks(profile);
  const off = [];
  for (let i = 0; i < n; i++) for (let j = 0; j < n; j++) if (i !== j && bw[i][j] > 0) off.push(bw[i][j]);
  const lo = off.length ? Math.min(...off) : 1, hi = off.length ? Math.max(...off) : 1;
  const size = Math.max(8, Math.min(44, Math.floor(560 / Math.max(n, 1))));
  const m = { l: 34, t: 28 };
  const width = m.l + size * n + 10, height = m.t + size * n + 10;
  const svg = s('svg', { width, height, viewBox: `0 0 ${width} ${height}`, class: 'chart links', role: 'img',
    'aria-label': 'link bandwidth matrix' });
  const label = n <= 32 ? 1 : Math.ceil(n / 16);
  for (let i = 0; i < n; i += label) {
    svg.append(s('text', { x: m.l + size * i + size / 2, y: m.t - 6, 'text-anchor': 'middle', text: i }));
    svg.append(s('text', { x: m.l - 6, y: m.t + size * i + size / 2 + 4, 'text-anchor': 'end', text: i }));
  }
  const t = (v) => (hi > lo ? (Math.log(v) - Math.log(lo)) / (Math.log(hi) - Math.log(lo)) : 1);
  for (let i = 0; i < n; i++) {
    for (let j = 0; j < n; j++) {
      const x = m.l + size * j, y = m.t + size * i;
      if (i === j) { svg.append(s('rect', { x, y, width: size, height: size, fill: '#fff', stroke: '#eef0f4' })); continue; }
      const isSlow = slow.has(`${i},${j}`);
      const g = s('g', { class: `link-cell${isSlow ? ' slow' : ''}`, 'data-i': i, 'data-j': j, 'data-bw': bw[i][j] },
        s('title', { text: `${i} → ${j}: ${fmt.gbs(bw[i][j])}, ${(lat[i][j] * 1e6).toFixed(1)} us${isSlow ? ' (slow)' : ''}` }),
        s('rect', { x: x + 0.5, y: y + 0.5, width: size - 1, height: size - 1, fill: bw[i][j] > 0 ? ramp(LINKS, t(bw[i][j])) : '#333' }));
      if (size >= 34) g.append(s('text', { x: x + size / 2, y: y + size / 2 + 4, 'text-anchor': 'middle', 'font-size': 9, fill: '#1d2330', text: (bw[i][j] / 1e9).toFixed(bw[i][j] < 1e10 ? 1 : 0) }));
      svg.append(g);
    }
  }
  // node boundaries
  const node = profile.devices.map((d) => d.node);
  for (let i = 1; i < n; i++) {
    if (node[i] !== node[i - 1]) {
      const p = m.l + size * i;
      svg.append(s('line', { x1: p, x2: p, y1: m.t, y2: m.t + size * n, stroke: '#1d2330', 'stroke-width': 1.5 }));
      svg.append(s('line', { x1: m.l, x2: m.l + size * n, y1: m.t + size * i, y2: m.t + size * i, stroke: '#1d2330', 'stroke-width': 1.5 }));
    }
  }
  return { svg, lo, hi, slow: slow.size };
}

export function linkLegend(lo, hi) {
  const stops = hi > lo * 1.001 ? [0, 0.25, 0.5, 0.75, 1] : [1];
  return stops.map((q) => {
    const swatch = document.createElement('i');
    swatch.style.background = ramp(LINKS, q);
    return h('span', {}, swatch, fmt.gbs(Math.exp(Math.log(lo) + q * (Math.log(hi) - Math.log(lo)))));
  });
}

/** Horizontal bars, one group per device: [{label, values: [{name, value, cls}]}]. */
export function deviceBars(rows, { format, tickFormat, label, cls }) {
  const names = rows.length ? rows[0].values.length : 1;
  const bar = 12, gap = 8, rowH = names * bar + gap;
  const max = Math.max(1, ...rows.flatMap((r) => r.values.map((v) => v.value || 0))) * 1.12;
  const m = { l: 80, r: 80, t: 6, b: 34 };
  const width = 520, height = m.t + rowH * rows.length + m.b;
  const f = frame({ cls, label, width, height, margin: m, x: { min: 0, max, label, format: tickFormat(max), count: 5 },
    y: { min: 0, max: 1, tickValues: [] } });
  rows.forEach((r, i) => {
    const y0 = m.t + rowH * i + gap / 2;
    f.plot.append(s('text', { x: m.l - 8, y: y0 + (names * bar) / 2 + 4, 'text-anchor': 'end', text: r.label }));
    r.values.forEach((v, k) => {
      const y = y0 + k * bar;
      f.plot.append(s('rect', { class: `bar ${v.cls}`, 'data-device': r.device, 'data-value': v.value, x: f.sx(0), y,
        width: Math.max(f.sx(v.value || 0) - f.sx(0), 0.5), height: bar - 2, fill: v.colour },
      s('title', { text: `${r.label} ${v.name}: ${format(v.value)}` })));
      f.plot.append(s('text', { x: f.sx(v.value || 0) + 4, y: y + bar - 3, 'font-size': 10, text: `${v.name} ${format(v.value)}` }));
    });
  });
  return f.svg;
}
