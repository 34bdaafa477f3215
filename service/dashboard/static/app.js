// Pipette dashboard: jobs, a job's trials and best configuration, clusters. Everything comes
// from the REST API with the token typed on the login page (sessionStorage, sent as Bearer).
// A job page follows the job's server-sent events through fetch (EventSource cannot send the
// Authorization header) and refreshes what an event changes; the jobs list polls.

import {
  h, fmt, ticks, convergence, predictedVsMeasured, candidateMap, memoryChart, memoryLegend,
  linkMatrix, linkLegend, deviceBars, slowLinks, ERROR_RULE, mape,
} from './charts.js';

const TOKEN = 'pipette.token';
const NEXT = 'pipette.next';
const FINAL = new Set(['succeeded', 'failed', 'cancelled']);
const STATES = ['queued', 'profiling', 'planning', 'running', 'succeeded', 'failed', 'cancelled'];
const main = document.getElementById('main');
const live = document.getElementById('live');
let page = null;

// ---- API -------------------------------------------------------------------------------
class ApiError extends Error {
  constructor(status, detail) {
    const where = detail.field ? `${detail.field}: ` : '';
    super(`${where}${detail.message}${detail.fix ? ` (fix: ${detail.fix})` : ''}`);
    this.status = status;
    this.detail = detail;
  }
}

function token() { return sessionStorage.getItem(TOKEN); }

async function api(path, options = {}) {
  const headers = { Accept: 'application/json', Authorization: `Bearer ${token()}`, ...(options.headers || {}) };
  let body;
  if (options.body !== undefined) { body = JSON.stringify(options.body); headers['Content-Type'] = 'application/json'; }
  let r;
  try {
    r = await fetch(path, { method: options.method || 'GET', headers, body, signal: options.signal });
  } catch (e) {
    if (e.name === 'AbortError') throw e;
    throw new ApiError(0, { message: 'the service does not answer', field: null, fix: 'check that `pipette serve` runs' });
  }
  if (!r.ok) {
    const detail = (await r.json().catch(() => ({}))).error || { message: `HTTP ${r.status}` };
    if (r.status === 401 && !options.login) {
      sessionStorage.removeItem(TOKEN);
      sessionStorage.setItem(NEXT, location.hash);
      location.hash = '#/login';
    }
    throw new ApiError(r.status, detail);
  }
  return options.raw ? r : r.json();
}

/**
 * Follow a server-sent event stream with fetch (so it can carry the token); reconnect with
 * Last-Event-ID after a drop. Resolves when the service ends the stream (the job is final).
 */
async function follow(path, onEvent, signal) {
  let last = 0;
  for (let attempt = 0; !signal.aborted; attempt++) {
    try {
      const headers = last ? { 'Last-Event-ID': String(last), Accept: 'text/event-stream' } : { Accept: 'text/event-stream' };
      const r = await api(path, { raw: true, headers, signal });
      setLive(true);
      const reader = r.body.pipeThrough(new TextDecoderStream()).getReader();
      let buffer = '';
      for (;;) {
        const { value, done } = await reader.read();
        if (done) return;
        buffer += value.replace(/\r\n/g, '\n');
        let cut;
        while ((cut = buffer.indexOf('\n\n')) >= 0) {
          const block = buffer.slice(0, cut);
          buffer = buffer.slice(cut + 2);
          const data = block.split('\n').filter((l) => l.startsWith('data:')).map((l) => l.slice(5).trimStart()).join('\n');
          if (!data) continue;
          const event = JSON.parse(data);
          last = event.id;
          attempt = 0;
          onEvent(event);
        }
      }
    } catch (e) {
      if (signal.aborted || (e instanceof ApiError && e.status >= 400 && e.status < 500)) return;
      setLive(false);
      await sleep(Math.min(2000 * (attempt + 1), 10000));
    } finally {
      setLive(false);
    }
  }
}

/** replaceChildren without the nulls of optional parts (which it would print as "null"). */
function fill(node, ...children) { node.replaceChildren(...children.flat().filter((c) => c !== null && c !== undefined && c !== false)); }
function sleep(ms) { return new Promise((resolve) => setTimeout(resolve, ms)); }
function setLive(on) { live.classList.toggle('on', on); live.textContent = on ? 'live' : ''; }

// ---- small helpers -----------------------------------------------------------------------
function badge(state) { return h('span', { class: `badge ${state}`, 'data-state': state, text: state }); }
function short(id) { return id.slice(0, 8); }
function age(iso) {
  if (!iso) return '–';
  const s = (Date.now() - Date.parse(iso)) / 1000;
  if (s < 60) return `${Math.max(0, s).toFixed(0)}s ago`;
  if (s < 3600) return `${(s / 60).toFixed(0)}m ago`;
  if (s < 172800) return `${(s / 3600).toFixed(0)}h ago`;
  return `${(s / 86400).toFixed(0)}d ago`;
}
function when(iso) { return iso ? h('span', { title: new Date(iso).toLocaleString(), text: age(iso) }) : '–'; }
function panel(id, title, ...children) { return h('section', { class: 'panel', id }, title ? h('h2', { text: title }) : null, ...children); }
function errorBox(e) { return h('p', { class: 'error', role: 'alert', text: e instanceof Error ? e.message : String(e) }); }
function toast(text) {
  const t = h('div', { class: 'toast', role: 'status', text });
  document.body.append(t);
  setTimeout(() => t.remove(), 1800);
}
function progress(done, total) {
  const bar = h('span', { class: 'progress' }, h('span'));
  bar.firstChild.style.width = `${Math.min(100, (100 * done) / Math.max(total, 1))}%`;
  return bar;
}

async function copyText(text, what) {
  try {
    await navigator.clipboard.writeText(text);
  } catch {
    const area = h('textarea');
    area.value = text;
    document.body.append(area);
    area.select();
    document.execCommand('copy');
    area.remove();
  }
  toast(`Copied ${what}`);
}

async function download(url, name) {
  const r = await api(url, { raw: true, headers: { Accept: '*/*' } });
  // octet-stream: a browser would add ".txt" to "hostfile" if told it is text/plain
  const type = name.endsWith('.json') ? 'application/json' : 'application/octet-stream';
  const href = URL.createObjectURL(new Blob([await r.arrayBuffer()], { type }));
  const a = h('a', { href, download: name });
  document.body.append(a);
  a.click();
  a.remove();
  setTimeout(() => URL.revokeObjectURL(href), 30000);
}

/** What a page holds while it is shown: timers and streams, stopped when it goes. */
class Page {
  constructor() { this.timers = []; this.controller = new AbortController(); }
  get signal() { return this.controller.signal; }
  get gone() { return this.controller.signal.aborted; }
  every(ms, fn) {
    const tick = async () => {
      if (this.gone) return;
      try { await fn(); } catch (e) { if (e.name !== 'AbortError') console.warn(e); }
      if (!this.gone) this.timers.push(setTimeout(tick, ms));
    };
    this.timers.push(setTimeout(tick, ms));
  }
  stop() { this.controller.abort(); this.timers.forEach(clearTimeout); setLive(false); }
}

// ---- login -------------------------------------------------------------------------------
async function loginPage() {
  document.getElementById('logout').hidden = true;
  const input = h('input', { type: 'password', id: 'token', name: 'token', autocomplete: 'off', placeholder: 'pip_…', required: true });
  const message = h('div');
  const form = h('form', { class: 'panel login', id: 'login' },
    h('h1', { text: 'Log in to Pipette' }),
    h('p', { class: 'muted', text: 'Paste an API token. An admin makes one with `pipette token create --tenant NAME`. ' +
      'It is kept in this tab only (sessionStorage) and sent as a Bearer token.' }),
    h('label', { for: 'token', text: 'Token' }), input, message,
    h('button', { class: 'primary', type: 'submit', text: 'Log in' }));
  form.addEventListener('submit', async (ev) => {
    ev.preventDefault();
    message.replaceChildren();
    sessionStorage.setItem(TOKEN, input.value.trim());
    try {
      await api('/v1/clusters', { login: true });
    } catch (e) {
      sessionStorage.removeItem(TOKEN);
      message.replaceChildren(errorBox(e));
      return;
    }
    const next = sessionStorage.getItem(NEXT);
    sessionStorage.removeItem(NEXT);
    location.hash = next && next !== '#/login' ? next : '#/';
  });
  fill(main, form);
  input.focus();
}

// ---- jobs --------------------------------------------------------------------------------
async function jobsPage(pg) {
  const filter = h('select', { id: 'state-filter', 'aria-label': 'state' }, h('option', { value: '', text: 'every state' }),
    ...STATES.map((st) => h('option', { value: st, text: st })));
  const tbody = h('tbody');
  const empty = h('p', { class: 'muted', hidden: true, text: 'No jobs yet. Submit one: pipette submit examples/jobs/tiny-cpu.yaml --watch' });
  const columns = [['Job'], ['State'], ['Model'], ['Cluster'], ['Trials'], ['Best tokens/s', 'num'], ['Best config'], ['Started']];
  fill(main, 
    h('div', { class: 'toolbar' }, h('h1', { text: 'Jobs' }), h('span', { class: 'spacer' }), filter),
    h('section', { class: 'panel' }, h('table', { id: 'jobs' },
      h('thead', {}, h('tr', {}, columns.map(([c, cls]) => h('th', { class: cls, text: c })))), tbody), empty));
  const clusters = new Map();
  const refresh = async () => {
    const query = filter.value ? `&state=${encodeURIComponent(filter.value)}` : '';
    const list = await api(`/v1/jobs?limit=100${query}`, { signal: pg.signal });
    if (list.items.some((j) => !clusters.has(j.cluster_id))) {
      for (const c of (await api('/v1/clusters', { signal: pg.signal })).items) clusters.set(c.id, c);
    }
    tbody.replaceChildren(...list.items.map((j) => jobRow(j, clusters.get(j.cluster_id))));
    empty.hidden = list.items.length > 0;
    setLive(true);
  };
  filter.addEventListener('change', refresh);
  await refresh();
  pg.every(2000, refresh);
}

function jobRow(j, cluster) {
  const p = j.progress, best = j.best || {};
  const open = () => { location.hash = `#/jobs/${j.id}`; };
  return h('tr', { class: 'clickable', 'data-job-id': j.id, 'data-state': j.state, onclick: open },
    h('td', {}, h('a', { href: `#/jobs/${j.id}`, text: j.name || short(j.id) }), j.name ? h('div', { class: 'muted small mono', text: short(j.id) }) : null),
    h('td', { 'data-col': 'state' }, badge(j.state)),
    h('td', { 'data-col': 'model', text: `${j.model.name || '?'} ${j.training.method || ''}` }),
    h('td', { 'data-col': 'cluster' }, cluster ? h('a', { href: `#/clusters/${cluster.id}`, text: cluster.name, onclick: (e) => e.stopPropagation() }) : short(j.cluster_id)),
    h('td', { 'data-col': 'trials' }, progress(p.trials_done, p.max_trials), h('span', { class: 'trials-count', text: `${p.trials_done}/${p.max_trials}` }),
      p.running_trial !== null && p.running_trial !== undefined ? h('span', { class: 'muted small', text: ` (trial ${p.running_trial} running)` }) : null),
    h('td', { class: 'num', 'data-col': 'best', text: fmt.rate(best.tokens_per_s) }),
    h('td', { class: 'mono small', 'data-col': 'best-config', text: best.label || '–' }),
    h('td', { 'data-col': 'started' }, when(j.started_at)));
}

// ---- one job ------------------------------------------------------------------------------
const TRIAL_COLUMNS = [
  ['number', '#', 'num'], ['label', 'Config'], ['state', 'Status'], ['predicted_step_time', 'Predicted', 'num'],
  ['measured_step_time', 'Measured', 'num'], ['tokens_per_s', 'Tokens/s', 'num'], ['prediction_error', 'Error %', 'num', ERROR_RULE],
  ['peak_memory_bytes', 'Peak memory', 'num'], ['duration_s', 'Duration', 'num'], ['error', 'Error text'],
];

async function jobPage(pg, id) {
  const st = { job: null, trials: [], plan: null, best: null, detail: null, cluster: null, steps: {}, sort: ['number', 1], final: false };
  const header = h('div', { id: 'job-header' });
  const cards = h('div', { class: 'cards', id: 'cards' });
  const conv = panel('convergence', 'Convergence: throughput per trial and best so far');
  const scatter = panel('scatter', 'Predicted against measured step time');
  const heat = panel('heatmap', 'Candidate map: best throughput per tp × pp');
  const memory = panel('memory', 'Memory per device of the best configuration');
  const filter = h('input', { type: 'text', id: 'trial-filter', placeholder: 'filter: config, status, error…', 'aria-label': 'filter trials' });
  const stateFilter = h('select', { id: 'trial-state', 'aria-label': 'status' }, h('option', { value: '', text: 'every status' }),
    ...['running', 'ok', 'oom', 'failed', 'timeout', 'pruned', 'interrupted'].map((x) => h('option', { value: x, text: x })));
  const thead = h('tr', {}, TRIAL_COLUMNS.map(([key, label, cls, title]) => h('th', {
    class: `sortable ${cls || ''}`, 'data-key': key, text: label, title, tabindex: 0,
    onclick: () => { st.sort = [key, st.sort[0] === key ? -st.sort[1] : (key === 'tokens_per_s' ? -1 : 1)]; renderTrials(); },
  })));
  const tbody = h('tbody');
  const trialsPanel = panel('trials', 'Trials', h('div', { class: 'toolbar' }, filter, stateFilter, h('span', { class: 'muted small', id: 'trial-count' })),
    h('table', { id: 'trials-table' }, h('thead', {}, thead), tbody));
  const bestPanel = panel('best', 'Best configuration');
  fill(main, header, cards, h('div', { class: 'grid' }, conv, scatter, heat, memory), trialsPanel, bestPanel);
  filter.addEventListener('input', () => renderTrials());
  stateFilter.addEventListener('change', () => renderTrials());

  function renderHeader() {
    const j = st.job, t = j.training;
    const cancel = FINAL.has(j.state) ? null : h('button', { class: 'danger', id: 'cancel', type: 'button', text: j.cancel_requested ? 'Cancel requested' : 'Cancel job',
      disabled: j.cancel_requested, onclick: async () => {
        if (!confirm('Cancel this job? The running trial stops within a step.')) return;
        try { await api(`/v1/jobs/${id}/cancel`, { method: 'POST' }); schedule(); } catch (e) { toast(e.message); }
      } });
    fill(header, 
      h('div', { class: 'toolbar' }, h('h1', { text: j.name || `Job ${short(j.id)}` }), badge(j.state), h('span', { class: 'spacer' }), cancel),
      h('p', { class: 'muted' }, `${j.model.name} · ${t.method} · ${t.dtype} · global batch ${t.global_batch} × ${t.seq_len} tokens · cluster `,
        st.cluster ? h('a', { href: `#/clusters/${st.cluster.id}`, text: st.cluster.name }) : short(j.cluster_id),
        ` · id `, h('span', { class: 'mono', text: j.id }), ' · created ', when(j.created_at)),
      j.stop_reason ? h('p', { id: 'stop-reason' }, h('b', { text: 'Stopped: ' }), j.stop_reason) : null,
      j.notice ? h('p', { id: 'job-notice', class: 'error', role: 'status' }, h('b', { text: 'Queued: ' }), j.notice) : null,
      j.progress.waiting_for_nodes ? h('p', { id: 'waiting-for-nodes', class: 'error', role: 'status' },
        h('b', { text: 'Waiting for lost Ray node(s): ' }), j.progress.waiting_for_nodes.join(', '),
        ' (the trial that ran on them failed and runs again once they are back)') : null,
      j.error ? errorBox(`${j.error.field ? `${j.error.field}: ` : ''}${j.error.message}${j.error.fix ? ` (fix: ${j.error.fix})` : ''}`) : null);
  }

  function renderCards() {
    const j = st.job, p = j.progress, b = j.best;
    const error = mape(st.trials);
    const card = (key, k, v, title) => h('div', { class: 'card', id: `card-${key}`, title }, h('div', { class: 'k', text: k }), h('div', { class: 'v', text: v }));
    fill(cards, 
      card('trials', 'Trials', `${p.trials_done} / ${p.max_trials}${p.running_trial !== null && p.running_trial !== undefined ? ` (trial ${p.running_trial} running)` : ''}`),
      card('best', 'Best throughput', b ? `${fmt.rate(b.tokens_per_s)} tokens/s` : '–'),
      card('step', 'Best step time', b ? `${fmt.seconds(b.measured_step_time)} (predicted ${fmt.seconds(b.predicted_step_time)})` : '–'),
      card('error', 'Model error (MAPE, ok trials)', error === null ? '–' : `${(error * 100).toFixed(1)}%`,
        `mean |error| over the ok trials; error = ${ERROR_RULE}`),
      card('time', 'Time in trials', fmt.seconds(p.tuning_s)));
  }

  function renderCharts() {
    const j = st.job;
    const tokensPerStep = j.training.global_batch * j.training.seq_len;
    fill(conv, conv.firstChild, st.trials.length
      ? convergence(st.trials, { tokensPerStep, final: FINAL.has(j.state), stopReason: j.stop_reason })
      : h('p', { class: 'muted', text: `No trial yet (the job is ${j.state}).` }),
    h('div', { class: 'legend' }, h('span', { text: '● measured (ok)' }), h('span', { text: '○ pruned (partial)' }),
      h('span', { text: '✕ out of memory / failed' }), h('span', { text: '■ predicted' }), h('span', { text: '— best so far' })));
    const sc = predictedVsMeasured(st.trials);
    fill(scatter, scatter.firstChild, h('p', { class: 'small', id: 'model-error' },
      sc.mape === null ? 'No measured trial yet.' : `Model error: MAPE ${(sc.mape * 100).toFixed(1)}% over ${sc.n} ok trial${sc.n === 1 ? '' : 's'} (|measured − predicted| / predicted); dashed: exact, band: ±25% of the prediction.`),
    sc.svg);
    fill(heat, heat.firstChild, st.plan || st.trials.length ? candidateMap(st.plan, st.trials, tokensPerStep) : h('p', { class: 'muted', text: 'No plan yet.' }),
      h('div', { class: 'legend' }, h('span', { text: 'blue: best measured tokens/s' }),
        h('span', { text: 'pale: learned prediction of trials that did not end ok' }),
        h('span', { text: 'grey: not tried (the analytic estimate, uncorrected, in the tooltip)' }),
        h('span', { text: 'hatched: every candidate predicted OOM' }), h('span', { text: 'red corner: a trial ran out of memory' })));
    if (st.detail && st.detail.record) {
      const overhead = ((st.detail.record.memory || {}).breakdown || {}).overhead || 0;
      fill(memory, memory.firstChild, h('p', { class: 'small muted', text: `${st.detail.label}, tensors against tensors: ` +
        `the estimator's breakdown for its heaviest rank, less its ${fmt.bytes(overhead)} of fixed process overhead, and ` +
        "each device's measured tensor peak (hover a bar for the process's resident size)." }),
        memoryChart(st.detail.record, st.detail.config.placement), h('div', { class: 'legend' }, memoryLegend()));
    } else {
      fill(memory, memory.firstChild, h('p', { class: 'muted', text: 'No successful trial yet.' }));
    }
  }

  function renderTrials() {
    const text = filter.value.trim().toLowerCase(), only = stateFilter.value;
    const [key, dir] = st.sort;
    const rows = st.trials.filter((t) => (!only || t.state === only) &&
      (!text || `${t.number} ${t.label} ${t.state} ${t.error || ''}`.toLowerCase().includes(text)));
    rows.sort((a, b) => {
      const va = a[key], vb = b[key];
      if (va === null || va === undefined) return (vb === null || vb === undefined) ? a.number - b.number : 1;
      if (vb === null || vb === undefined) return -1;
      return (va < vb ? -1 : va > vb ? 1 : a.number - b.number) * dir;
    });
    for (const th of thead.children) th.setAttribute('aria-sort', th.dataset.key === key ? (dir > 0 ? 'ascending' : 'descending') : 'none');
    tbody.replaceChildren(...rows.map((t) => {
      const step = t.state === 'running' ? st.steps[t.number] : null;
      return h('tr', { 'data-trial': t.number, 'data-state': t.state, class: t.state === 'running' ? 'running' : '' },
        h('td', { class: 'num', text: t.number }), h('td', { class: 'mono small', text: t.label }), h('td', {}, badge(t.state)),
        h('td', { class: 'num', 'data-col': 'predicted', text: fmt.seconds(t.predicted_step_time) }),
        h('td', { class: 'num', 'data-col': 'measured', text: step ? `step ${step.step}: ${fmt.seconds(step.time)}` : fmt.seconds(t.measured_step_time) }),
        h('td', { class: 'num', 'data-col': 'tokens', text: fmt.rate(t.tokens_per_s) }),
        h('td', { class: 'num', 'data-col': 'error', 'data-error': t.prediction_error ?? '', title: ERROR_RULE, text: fmt.pct(t.prediction_error) }),
        h('td', { class: 'num', 'data-col': 'peak', text: fmt.bytes(t.peak_memory_bytes) }),
        h('td', { class: 'num', 'data-col': 'duration', text: fmt.seconds(t.duration_s) }),
        h('td', { class: 'err', text: t.error ? t.error.split('\n')[0] : '' }));
    }));
    document.getElementById('trial-count').textContent = `${rows.length} of ${st.trials.length} trials`;
  }

  // tp × pp × dp, with cp and ep where the config has them (its dict writes them only when not 1)
  function degreeRow(c) {
    const names = ['tp', 'pp', 'dp', ...['cp', 'ep'].filter((k) => (c[k] ?? 1) !== 1)];
    return [names.join(' × '), names.map((k) => c[k]).join(' × ')];
  }

  function renderBest() {
    const b = st.best;
    if (!b) { fill(bestPanel, bestPanel.firstChild, h('p', { class: 'muted', text: 'No successful trial yet.' })); return; }
    const c = b.config, ds = b.ds_config ? JSON.stringify(b.ds_config, null, 2) : null;
    fill(bestPanel, bestPanel.firstChild,
      h('p', {}, h('b', { class: 'mono', id: 'best-label', text: b.trial.label }),
        ` — trial ${b.trial.number}: ${fmt.seconds(b.trial.measured_step_time)}/step, ${fmt.rate(b.trial.tokens_per_s)} tokens/s`),
      h('div', { class: 'kv' }, ...[degreeRow(c), ['micro-batch × grad accum', `${c.mbs} × ${c.grad_accum}`],
        ['ZeRO stage', c.zero_stage], ['recompute', c.recompute], ['schedule', c.virtual_stages > 1 ? `${c.schedule} (v=${c.virtual_stages})` : c.schedule],
        ['placement (rank → device)', JSON.stringify(c.placement)]].flatMap(([k, v]) => [h('span', { class: 'k', text: k }), h('span', { class: 'mono', text: String(v) })])),
      ...(ds ? [h('h2', { text: 'ds_config.json' }), h('pre', { class: 'code', id: 'best-ds', text: ds })] : []),
      h('h2', { text: 'Launch command' }), h('pre', { class: 'code', id: 'best-launch', text: b.launch_command }),
      h('h2', { text: 'hostfile' }), h('pre', { class: 'code', id: 'best-hostfile', text: b.hostfile }),
      h('div', { class: 'buttons' },
        ...(ds ? [h('button', { type: 'button', id: 'copy-ds', text: 'Copy ds_config.json', onclick: () => copyText(ds, 'ds_config.json') })] : []),
        h('button', { type: 'button', id: 'copy-launch', text: 'Copy launch command', onclick: () => copyText(b.launch_command, 'the launch command') }),
        ...Object.entries(b.files).map(([name, url]) => h('button', { type: 'button', class: 'download', 'data-file': name, text: `Download ${name}`,
          onclick: () => download(url, name).catch((e) => toast(e.message)) }))));
  }

  async function load() {
    const [job, trials] = await Promise.all([api(`/v1/jobs/${id}`, { signal: pg.signal }), api(`/v1/jobs/${id}/trials`, { signal: pg.signal })]);
    st.job = job;
    st.trials = trials.items;
    if (!st.cluster) st.cluster = await api(`/v1/clusters/${job.cluster_id}`, { signal: pg.signal }).catch(() => null);
    if (!st.plan && ['running', ...FINAL].includes(job.state)) {
      st.plan = await api(`/v1/jobs/${id}/plan`, { signal: pg.signal }).catch((e) => (e.status === 404 ? null : Promise.reject(e)));
    }
    if (job.best && (!st.best || st.best.trial.number !== job.best.trial)) {
      [st.best, st.detail] = await Promise.all([api(`/v1/jobs/${id}/best`, { signal: pg.signal }),
        api(`/v1/jobs/${id}/trials/${job.best.trial}`, { signal: pg.signal })]);
    }
    if (pg.gone) return;
    renderHeader(); renderCards(); renderCharts(); renderTrials(); renderBest();
    main.dataset.jobState = job.state;
    main.dataset.trials = String(st.trials.length);
  }

  let pending = null;
  function schedule() {
    if (pending) return;
    pending = setTimeout(async () => {
      pending = null;
      try { await load(); } catch (e) { if (e.name !== 'AbortError') toast(e.message); }
    }, 250);
  }

  await load();
  const onEvent = (ev) => {
    if (ev.kind === 'trial_step') {
      st.steps[ev.trial] = ev.data;
      const cell = tbody.querySelector(`tr[data-trial="${ev.trial}"][data-state="running"] td[data-col="measured"]`);
      if (cell) cell.textContent = `step ${ev.data.step}: ${fmt.seconds(ev.data.time)}`;
      else schedule();
    } else {
      schedule();
    }
  };
  // Follow the stream until the job ends; a poll covers anything a broken stream missed.
  follow(`/v1/jobs/${id}/events`, onEvent, pg.signal).then(() => { if (!pg.gone) schedule(); });
  pg.every(5000, async () => { if (!FINAL.has(st.job.state)) await load(); });
}

// ---- clusters ------------------------------------------------------------------------------
async function clustersPage(pg) {
  const tbody = h('tbody');
  fill(main, h('h1', { text: 'Clusters' }), h('section', { class: 'panel' }, h('table', { id: 'clusters' },
    h('thead', {}, h('tr', {}, ['Name', 'Kind', 'Address', 'Devices', 'Lease', 'Profile', 'Measured'].map((c) => h('th', { text: c })))), tbody)),
  h('p', { class: 'muted small', text: 'Register one with `pipette cluster add NAME --devices N`.' }));
  const refresh = async () => {
    const list = await api('/v1/clusters', { signal: pg.signal });
    tbody.replaceChildren(...list.items.map((c) => {
      const p = c.latest_profile;
      return h('tr', { class: 'clickable', 'data-cluster-id': c.id, onclick: () => { location.hash = `#/clusters/${c.id}`; } },
        h('td', {}, h('a', { href: `#/clusters/${c.id}`, text: c.name })), h('td', { text: c.kind }), h('td', { class: 'mono', text: c.address }),
        h('td', { class: 'num', text: (c.nodes.length || 1) * c.devices_per_node }),
        h('td', { text: c.lease.busy ? `busy${c.lease.job_id ? ` (job ${short(c.lease.job_id)})` : ''}` : 'free' }),
        h('td', {}, p ? badge(p.state) : 'never'), h('td', {}, when(p && p.profile ? p.profile.measured_at : null)));
    }));
  };
  await refresh();
  pg.every(5000, refresh);
}

async function clusterPage(pg, ref) {
  const c = await api(`/v1/clusters/${encodeURIComponent(ref)}`, { signal: pg.signal });
  const latest = c.latest_profile, profile = latest && latest.profile;
  const waitFor = (profileId) => pg.every(3000, async () => {
    const n = await api(`/v1/clusters/${c.id}`, { signal: pg.signal });
    const p = n.latest_profile;
    if (p && (!profileId || p.id === profileId) && (p.state === 'succeeded' || p.state === 'failed')) route();
  });
  const measure = h('button', { type: 'button', id: 'profile-now', text: 'Measure again', onclick: async () => {
    try { const p = await api(`/v1/clusters/${c.id}/profile`, { method: 'POST' }); toast('Profile queued'); waitFor(p.id); } catch (e) { toast(e.message); }
  } });
  const head = [h('div', { class: 'toolbar' }, h('h1', { text: `Cluster ${c.name}` }), h('span', { class: 'spacer' }), measure),
    h('p', { class: 'muted' }, `${c.kind} · address ${c.address} · ${c.devices_per_node} devices per node · lease `,
      c.lease.busy ? `busy${c.lease.job_id ? ` with job ${short(c.lease.job_id)}` : ''}` : 'free')];
  if (!profile) {
    fill(main, ...head, panel('no-profile', 'Not measured yet', h('p', { class: 'muted',
      text: latest ? `The latest profile is ${latest.state}.${latest.error ? ` ${latest.error.message}` : ''}` : 'The first job measures it, or press "Measure again".' })));
    if (latest && (latest.state === 'queued' || latest.state === 'running')) waitFor(latest.id);
    return;
  }
  const links = linkMatrix(profile);
  const { slow } = slowLinks(profile);
  const nodes = profile.nodes || [];
  const devices = profile.devices.map((d, i) => ({ i, d, node: nodes[d.node] ? nodes[d.node].name : String(d.node) }));
  // CPU devices are worker processes sharing their host's RAM (each plans with an equal share):
  // one pair of bars per host, not the same memory again for every device.
  const pools = new Map();
  for (const { i, d } of devices) {
    const key = d.spec.kind === 'cpu' ? `host ${d.node}` : `device ${i}`;
    if (!pools.has(key)) pools.set(key, { ids: [], shared: d.spec.kind === 'cpu', total: 0, free: 0 });
    const pool = pools.get(key);
    pool.ids.push(i);
    pool.total += d.spec.memory_bytes;
    pool.free += d.free_memory ?? d.spec.memory_bytes;
  }
  const span = (ids) => (ids.length > 1 && ids[ids.length - 1] - ids[0] === ids.length - 1 ? `${ids[0]}–${ids[ids.length - 1]}` : ids.join(', '));
  const memRows = [...pools.values()].map((p) => ({ device: p.ids.join(','),
    label: p.shared ? `devices ${span(p.ids)}` : `device ${p.ids[0]}`, values: [
      { name: p.shared ? 'host total' : 'total', value: p.total, cls: 'memory-total', colour: '#c9d6ee' },
      { name: p.shared ? 'host free' : 'free', value: p.free, cls: 'memory-free', colour: '#2f6fde' }] }));
  const sharedNote = [...pools.values()].some((p) => p.shared)
    ? h('p', { class: 'small muted', id: 'shared-memory', text: "CPU devices share their host's RAM: one pair of bars per host, for all its devices." }) : null;
  const dtypes = ['fp32', 'tf32', 'bf16', 'fp16'].filter((k) => profile.devices.some((d) => d.spec.peak_flops && d.spec.peak_flops[k]));
  const colours = { fp32: '#2f6fde', tf32: '#7a4fd6', bf16: '#1f9d55', fp16: '#d6845b' };
  const flopRows = devices.map(({ i, d }) => ({ device: i, label: `device ${i}`, values: dtypes.map((k) => ({
    name: k, value: d.spec.peak_flops[k] || 0, cls: `compute-${k}`, colour: colours[k] })) }));
  const tflops = (v) => `${(v / 1e12).toFixed(v < 1e12 ? 3 : 1)} TFLOPS`;
  const slowList = [...slow].map((k) => k.split(',').map(Number)).filter(([i, j]) => i < j);
  fill(main, ...head,
    h('p', { id: 'measured-at' }, h('b', { text: 'Measured ' }), when(profile.measured_at), ` (${new Date(profile.measured_at).toLocaleString()}, ${profile.method}) · `,
      `${nodes.length} node${nodes.length === 1 ? '' : 's'}, ${profile.devices.length} devices (${[...new Set(profile.devices.map((d) => d.spec.name))].join(', ')})`),
    h('div', { class: 'grid' },
      panel('links', 'Link bandwidth (row: from, column: to)', h('p', { class: 'small muted', text:
        `${fmt.gbs(links.lo)} – ${fmt.gbs(links.hi)} per direction; outlined red: under half the median of its kind (same node / across nodes). Hover for latency.` }),
      links.svg, h('div', { class: 'legend' }, linkLegend(links.lo, links.hi)),
      h('p', { class: 'small', id: 'slow-links', text: slowList.length ? `Slow links: ${slowList.slice(0, 12).map(([i, j]) => `${i}↔${j}`).join(', ')}${slowList.length > 12 ? ` and ${slowList.length - 12} more` : ''}` : 'No slow links.' })),
      h('div', {},
        panel('device-memory', 'Memory per device', sharedNote, deviceBars(memRows, { format: fmt.bytes, tickFormat: ticks.bytes, label: 'memory', cls: 'device-memory' })),
        panel('device-compute', 'Compute per device (measured matmul peak)', deviceBars(flopRows, { format: tflops, tickFormat: () => ticks.flops, label: 'TFLOPS', cls: 'device-compute' })))),
    panel('devices', 'Devices', h('table', {}, h('thead', {}, h('tr', {}, ['Device', 'Node', 'Local', 'Kind', 'Memory', 'Free', ...dtypes.map((k) => `${k} TFLOPS`)].map((x) => h('th', { text: x })))),
      h('tbody', {}, devices.map(({ i, d, node }) => h('tr', {}, h('td', { text: i }), h('td', { text: node }), h('td', { text: d.local_index }), h('td', { text: d.spec.name }),
        h('td', { text: fmt.bytes(d.spec.memory_bytes) }), h('td', { text: fmt.bytes(d.free_memory) }),
        ...dtypes.map((k) => h('td', { class: 'num', text: d.spec.peak_flops[k] ? (d.spec.peak_flops[k] / 1e12).toFixed(3) : '–' }))))))));
}

// ---- routing ------------------------------------------------------------------------------
const ROUTES = [
  [/^#\/login$/, loginPage, null],
  [/^#\/?$/, jobsPage, 'jobs'],
  [/^#\/jobs\/([0-9a-fA-F-]{36})$/, jobPage, 'jobs'],
  [/^#\/clusters$/, clustersPage, 'clusters'],
  [/^#\/clusters\/([A-Za-z0-9._-]+)$/, clusterPage, 'clusters'],
];

async function route() {
  if (page) page.stop();
  page = null;
  const hash = location.hash || '#/';
  if (!token() && hash !== '#/login') {
    sessionStorage.setItem(NEXT, hash);
    location.hash = '#/login';
    return;
  }
  document.getElementById('logout').hidden = !token();
  for (const [pattern, render, nav] of ROUTES) {
    const m = hash.match(pattern);
    if (!m) continue;
    for (const a of document.querySelectorAll('#nav a')) a.classList.toggle('active', a.dataset.nav === nav);
    const pg = new Page();
    page = pg;
    try {
      await render(pg, ...m.slice(1));
    } catch (e) {
      if (e.name !== 'AbortError' && !pg.gone) fill(main, errorBox(e));
    }
    return;
  }
  fill(main, h('p', { text: 'No such page. ' }, h('a', { href: '#/', text: 'Jobs' })));
}

document.getElementById('logout').addEventListener('click', () => {
  sessionStorage.removeItem(TOKEN);
  location.hash = '#/login';
});
window.addEventListener('hashchange', route);
route();
