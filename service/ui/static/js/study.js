// Page 2: one study. Its summary; the trial table (sort, the `where=` filters, server-side
// pages); the optimisation history; the phase map of two chosen parameters coloured by a
// chosen field (click a point: its trial); the Pareto front (several objectives); parameter
// importance. Live while the study runs: the summary is polled and the rest redrawn when
// a trial changes state.

import {ApiError, get} from './api.js';
import {CLASS_COLOR, CLIPPED_SIZE, CLIPPED_SYMBOL, PALETTE, chartBox, clipLoss, draw, loadECharts, lossAxis} from './charts.js';
import {badge, duration, every, fill, fmt, h, pct} from './dom.js';
import {stabilityBoundaryPanel} from './boundary.js';
import {lrSensitivityPanel} from './lrsens.js';

const POLL_MS = 2500;
const PAGE = 50;
const OPEN = new Set(['PENDING', 'RUNNING']);
const STATES = ['QUEUED', 'RUNNING', 'COMPLETE', 'PRUNED', 'DIVERGED', 'FAILED', 'CANCELLED'];
const COLUMNS = [  // [sort key, header, value of a trial]
  ['number', '#', (t) => t.number],
  [null, 'state', (t) => h('span', {title: t.stop_reason || ''}, badge(t.state), t.stop_reason ? h('div', {class: 'muted small stop-reason'}, t.stop_reason) : null)],
  ['value', 'value', (t) => fmt(t.value)],
  ['final_val_loss', 'val loss', (t) => fmt(t.final_val_loss)],
  ['min_norm_entropy', 'min norm. entropy', (t) => fmt(t.min_norm_entropy)],
  ['final_rank_ratio', 'rank ratio', (t) => fmt(t.final_rank_ratio)],
  ['qk_eig_var', 'QK eig var', (t) => fmt(t.qk_eig_var)],
  ['plateau_steps', 'plateau steps', (t) => fmt(t.plateau_steps)],
  ['entropy_collapse', 'entropy collapse', (t) => flag(t.entropy_collapse)],
  ['rank_collapse', 'rank collapse', (t) => flag(t.rank_collapse)],
  ['trapped', 'trapped', (t) => flag(t.trapped)],
];
const TAIL = [
  ['penalty_version', 'penalty', (t) => `v${t.penalty_version}`],
  [null, 'attempts', (t) => t.attempts],
  [null, 'node', (t) => t.node || '-'],
  ['duration_s', 'duration', (t) => duration(t.duration_s)],
];
// Importance: fANOVA (the API's default) past this many COMPLETE trials costs the server
// seconds to minutes (2 cores: ~5 s at 400 trials, ~30 s at 1,600); PED-ANOVA answers in ~2 s
// at 8,000, so the page asks for it there and offers fANOVA on a click.
const FANOVA_AUTO = 200;
// A scatter series past this many points is drawn in ECharts' large mode (one path for all
// symbols; hover and click still find the point): 10,000 trials draw in a fraction.
const LARGE = 500;
// A field that is a loss (final_val_loss, best_val_loss, ...): its axis follows the loss rule.
const LOSS = /loss/;
const NUMERIC = ['value', 'final_val_loss', 'min_norm_entropy', 'final_rank_ratio', 'qk_eig_var', 'plateau_steps', 'duration_s', 'number'];

/** The running best as a step line needs only the trials where it improved, and the last. */
function improvements(best) {
  const out = [];
  best.forEach((b, i) => {
    if (i === 0 || i === best.length - 1 || b.value !== best[i - 1].value) out.push([b.trial, b.value]);
  });
  return out;
}

function flag(v) {
  if (v === null || v === undefined) return '-';
  return v ? h('span', {class: 'flag-on'}, 'yes') : 'no';
}

/** The trial id of a study's trial number (plots name trials by number). */
async function trialId(studyId, number) {
  const page = await get(`/v1/studies/${studyId}/trials`, {where: `number=${number}`, limit: 1});
  return page.items[0]?.id;
}

export async function studyPage(ctx, id) {
  const {view} = ctx;
  const state = {sort: 'number', where: '', states: [], penalty: '', offset: 0, selected: new Set()};
  const tableQuery = () => ({
    sort: state.sort, where: state.where.split(/[;\n]/).map((s) => s.trim()).filter(Boolean),
    state: state.states, penalty_version: state.penalty || null, limit: PAGE, offset: state.offset,
  });
  // The first screen's three calls at once (the table's first page does not need the study).
  const firstPage = get(`/v1/studies/${id}/trials`, tableQuery());
  const firstSummary = get(`/v1/studies/${id}/summary`);
  for (const pending of [firstPage, firstSummary]) pending.catch(() => {});  // awaited below
  const study = await get(`/v1/studies/${id}`);
  const params = Object.keys(study.spec.search_space || {});
  const objectives = study.spec.objectives || [{metric: 'final_val_loss', direction: 'minimize'}];

  const title = h('h1', {}, `Study ${study.id}: ${study.name} `, h('span', {id: 'study-status'}));
  const summaryEl = h('div', {id: 'summary', class: 'cards'});
  const tableBody = h('tbody', {id: 'trials-body'});
  const tableHead = h('thead', {});
  const tableInfo = h('span', {id: 'trials-info', class: 'muted'});
  const tableError = h('p', {id: 'trials-error', class: 'error'});
  const pager = h('div', {class: 'pager'});
  const compare = h('button', {id: 'compare', disabled: true, onclick: () => {
    location.hash = `#/trials/${[...state.selected].join(',')}`;
  }}, 'compare selected (2-4)');
  const whereInput = h('input', {id: 'where', type: 'text', size: 48, placeholder: 'min_norm_entropy>=0.1; params.regularizer.lambda<0.01; trapped=1'});
  const penaltySelect = h('select', {id: 'penalty'}, h('option', {value: ''}, 'any'), h('option', {value: '1'}, 'v1'), h('option', {value: '2'}, 'v2'));
  const stateBoxes = STATES.map((s) => h('label', {class: 'chk'}, h('input', {type: 'checkbox', value: s, name: 'state'}), s.toLowerCase()));
  const filters = h('form', {id: 'filters', class: 'filters', onsubmit: (e) => {
    e.preventDefault();
    state.where = whereInput.value;
    state.states = stateBoxes.map((l) => l.firstChild).filter((c) => c.checked).map((c) => c.value);
    state.penalty = penaltySelect.value;
    state.offset = 0;
    loadTable().catch(ctx.onError);
  }},
  h('label', {}, 'where ', whereInput), ' ',
  h('span', {class: 'states'}, stateBoxes), ' ',
  h('label', {}, 'penalty ', penaltySelect), ' ',
  h('button', {type: 'submit'}, 'apply'));

  const history = chartBox(`history-${id}`, 'Optimisation history', {height: 300});
  const axisSel = (sel, value) => h('select', {id: sel}, fieldOptions(params, value));
  // Default axes: numeric parameters only (a categorical one is refused as an axis: a 422).
  const numeric = params.filter((p) => ['float', 'int'].includes(study.spec.search_space[p].type));
  const xSel = axisSel('phase-x', numeric[0] ? `params.${numeric[0]}` : 'number');
  const ySel = axisSel('phase-y', numeric[1] ? `params.${numeric[1]}` : objectives[0].metric);
  const cSel = h('select', {id: 'phase-color'},
    ['collapse_class', 'state', ...NUMERIC, 'min_norm_entropy_ever', 'best_val_loss', ...params.map((p) => `params.${p}`)]
      .map((f) => h('option', {value: f}, f)));
  const phase = chartBox(`phase-${id}`, 'Phase map', {height: 340,
    note: h('div', {class: 'controls'}, h('label', {}, 'x ', xSel), ' ', h('label', {}, 'y ', ySel), ' ', h('label', {}, 'colour ', cSel))});
  for (const s of [xSel, ySel, cSel]) s.addEventListener('change', () => loadPhase().catch(ctx.onError));
  const pareto = objectives.length > 1 ? chartBox(`pareto-${id}`, 'Pareto front', {height: 300}) : null;
  const importanceNote = h('div', {class: 'controls small', id: `importance-note-${id}`});
  const importance = chartBox(`importance-${id}`, 'Parameter importance', {height: 220, note: importanceNote});
  let evaluator = null;  // null: chosen by size (FANOVA_AUTO); 'fanova' once asked for
  const lrsens = lrSensitivityPanel(id, study.spec);  // null unless the study searches optim.lr
  const boundary = stabilityBoundaryPanel(id, study.spec);  // null unless lr and a width

  // Through h's rule (absent parts skipped): Element.append would write a null or an
  // undefined part (no description, no LR panel) as the text "null" or "undefined".
  view.append(...[
    title,
    study.spec.description ? h('p', {class: 'muted', id: 'study-description'}, study.spec.description) : null,
    summaryEl,
    h('section', {class: 'panel'},
      h('h3', {}, 'Trials ', tableInfo, ' ', compare),
      filters, tableError,
      h('div', {class: 'scroll'}, h('table', {class: 'grid', id: 'trials'}, tableHead, tableBody)),
      pager),
    lrsens?.box,
    boundary?.box,
    h('div', {class: 'charts'}, history.box, phase.box, pareto?.box, importance.box),
  ].filter((c) => c !== null && c !== undefined));

  function header() {
    const cols = [...COLUMNS, ...params.map((p) => [`params.${p}`, p, (t) => fmt(t.params[p])]), ...TAIL];
    const arrow = (key) => (state.sort === key ? ' \u25b2' : state.sort === `-${key}` ? ' \u25bc' : '');
    fill(tableHead, h('tr', {}, h('th', {}, ''), cols.map(([key, label]) => h('th', {
      class: key ? 'sortable' : null, dataset: key ? {sort: key} : {},
      onclick: key ? () => {
        state.sort = state.sort === key ? `-${key}` : key;
        state.offset = 0;
        loadTable().catch(ctx.onError);
      } : null,
    }, label, arrow(key)))));
    return cols;
  }

  async function loadTable(prefetched = null) {
    let page;
    try {
      page = await (prefetched || get(`/v1/studies/${id}/trials`, tableQuery()));
    } catch (e) {
      if (e instanceof ApiError) { fill(tableError, e.message); return; }
      throw e;
    }
    fill(tableError);
    const cols = header();
    fill(tableBody, page.items.map((t) => h('tr', {dataset: {trial: t.id, number: t.number}},
      h('td', {}, h('input', {type: 'checkbox', class: 'pick', checked: state.selected.has(t.id), onchange: (e) => {
        if (e.target.checked) state.selected.add(t.id); else state.selected.delete(t.id);
        compare.disabled = state.selected.size < 2 || state.selected.size > 4;
      }})),
      cols.map(([key, , get], i) => h('td', {class: i === 0 ? '' : 'num'}, i === 0 ? h('a', {href: `#/trials/${t.id}`}, t.number) : get(t))))));
    if (!page.items.length) fill(tableBody, h('tr', {}, h('td', {colspan: cols.length + 1, class: 'muted'}, 'no trials match')));
    const last = Math.min(page.total, state.offset + page.items.length);
    fill(tableInfo, page.total ? `${state.offset + 1}-${last} of ${page.total}` : '0 of 0');
    fill(pager,
      h('button', {disabled: state.offset === 0, onclick: () => { state.offset = Math.max(0, state.offset - PAGE); loadTable().catch(ctx.onError); }}, 'previous'),
      ' ',
      h('button', {disabled: last >= page.total, onclick: () => { state.offset += PAGE; loadTable().catch(ctx.onError); }}, 'next'));
  }

  function renderSummary(s) {
    fill(document.getElementById('study-status') || title, badge(s.status));
    const byState = Object.entries(s.trials_by_state).filter(([, n]) => n > 0).map(([k, n]) => `${n} ${k.toLowerCase()}`).join(', ');
    const card = (label, value, id = null) => h('div', {class: 'card', id}, h('div', {class: 'label'}, label), h('div', {class: 'value'}, value));
    fill(summaryEl,
      card('progress', [h('progress', {max: 1, value: s.progress}), ` ${s.finished}/${s.n_trials}`], 'card-progress'),
      card('trials', byState || 'none yet', 'card-states'),
      card(`best ${objectives[0].metric} (${objectives[0].direction})`, s.best_trial_id ? h('a', {href: `#/trials/${s.best_trial_id}`}, fmt(s.best_value)) : '-'),
      card('entropy collapse', pct(s.entropy_collapse_rate)),
      card('rank collapse', pct(s.rank_collapse_rate)),
      card('trapped', pct(s.trapped_rate)),
      card('ETA', s.eta_s === null ? '-' : duration(s.eta_s)),
      card('Ray job', study.ray_job_id && ctx.config.ray_dashboard_url
        ? h('a', {href: `${ctx.config.ray_dashboard_url}/#/jobs/${encodeURIComponent(study.ray_job_id)}`, target: '_blank', rel: 'noopener noreferrer', class: 'mono small'}, study.ray_job_id)
        : h('span', {class: 'mono small'}, study.ray_job_id || '-')),
    );
  }

  const openTrial = async (number) => {
    const tid = await trialId(id, number);
    if (tid) location.hash = `#/trials/${tid}`;
  };

  // The loss-axis ceiling of every loss plot of this page: the history route's l0 (the
  // largest first-evaluation, i.e. step-0, validation loss of the study's trials).
  let l0 = null;
  const isLoss = (field) => LOSS.test(field) || (field === 'value' && LOSS.test(objectives[0].metric));
  const fetchHistory = () => get(`/v1/studies/${id}/plots/history`, {format: 'json'});

  /** Scatter points [x, y, ...rest] with the loss rule on the axes that are losses: those
   *  above the ceiling at it, in `above` (their raw values kept), the rest in `kept`. */
  function clipPoints(points, xLoss, yLoss) {
    const kept = [];
    const above = [];
    for (const [x, y, ...rest] of points) {
      const cx = clipLoss(x, xLoss ? l0 : null);
      const cy = clipLoss(y, yLoss ? l0 : null);
      if (cx.raw === null && cy.raw === null) kept.push([x, y, ...rest]);
      else above.push({value: [cx.y, cy.y, ...rest], raw: [x, y]});
    }
    return {kept, above};
  }
  const aboveSeries = (data, extra = {}) => (data.length ? [{
    name: 'above l\u2080 (drawn at l\u2080)', type: 'scatter', symbol: CLIPPED_SYMBOL,
    symbolSize: CLIPPED_SIZE, z: 5, data, color: '#444', ...extra}] : []);
  const rawNote = (p) => (p.data?.raw ? ` (raw ${p.data.raw.map((v) => fmt(v)).join(', ')}; above l\u2080 ${fmt(l0)}, drawn at l\u2080)` : '');
  const axisOf = (loss, {type, ...base}) => (loss && l0 !== null ? lossAxis(l0, base) : {type, ...base});

  async function loadHistory(pending = null) {
    const d = await (pending || fetchHistory());
    l0 = d.l0 ?? null;
    // A loss objective follows the loss-axis rule (charts.js lossAxis): its ceiling is the
    // route's l0, the largest first-evaluation (step-0) validation loss of the study's trials.
    const ceiling = LOSS.test(d.objective.metric) && d.l0 !== null && d.l0 !== undefined ? d.l0 : null;
    const groups = {};
    const above = [];
    for (const p of d.points) {
      const {y, raw} = clipLoss(p.value, ceiling);
      if (raw === null) (groups[p.state] ??= []).push([p.trial, y]);
      else above.push({value: [p.trial, y], raw, state: p.state});
    }
    const best = improvements(d.best).map(([t, v]) => [t, clipLoss(v, ceiling).y]);
    history.el.dataset.ceiling = ceiling === null ? '' : String(ceiling);
    await draw(history.el, {
      grid: {left: 60, right: 20, top: 40, bottom: 40},
      tooltip: {trigger: 'item', formatter: (p) => (p.data.raw === undefined
        ? `trial ${p.value[0]}: ${fmt(p.value[1])}`
        : `trial ${p.value[0]} (${p.data.state.toLowerCase()}): ${fmt(p.data.raw)}, above l\u2080 ${fmt(ceiling)}: drawn at l\u2080`)},
      legend: {top: 0},
      xAxis: {type: 'value', name: 'trial', nameLocation: 'middle', nameGap: 24},
      yAxis: ceiling === null ? {type: 'value', name: d.y_label, scale: true} : lossAxis(ceiling, {name: d.y_label}),
      series: [
        ...Object.entries(groups).map(([st, pts], i) => ({name: st.toLowerCase(), type: 'scatter', symbolSize: 6, large: true, largeThreshold: LARGE, data: pts, color: PALETTE[i % PALETTE.length]})),
        ...(above.length ? [{name: 'above l\u2080 (drawn at l\u2080)', type: 'scatter', symbol: CLIPPED_SYMBOL, symbolSize: CLIPPED_SIZE, data: above, color: '#444'}] : []),
        {name: 'best so far', type: 'line', step: 'end', showSymbol: false, data: best, color: '#d62728'},
      ],
    }, {onClick: (p) => p.seriesType === 'scatter' && openTrial(p.value[0])});
  }

  async function loadPhase(pending = null) {
    if (pending) l0 = (await pending).l0 ?? null;
    let d;
    try {
      d = await get(`/v1/studies/${id}/plots/scatter`, {format: 'json', x: xSel.value, y: ySel.value, color: cSel.value});
    } catch (e) {
      if (e instanceof ApiError) { await draw(phase.el, {title: {text: e.message, left: 'center', top: 'middle', textStyle: {fontSize: 12, color: '#c00'}}}); return; }
      throw e;
    }
    const numericColor = d.points.some((p) => typeof p.color === 'number');
    const axis = (log, name) => ({type: log ? 'log' : (d.points.some((p) => typeof p[name] === 'string') ? 'category' : 'value'), name: d[`${name}_label`], nameLocation: 'middle', nameGap: 26, scale: true});
    const [xLoss, yLoss] = [!d.x_log && isLoss(d.x), !d.y_log && isLoss(d.y)];
    const point = (p) => [p.x, p.y, p.color, p.trial];
    // A trial without a collapse class (no attention metrics stored) is "unclassified".
    const label = (c) => (c === null || c === undefined ? 'unclassified' : String(c));
    const {kept, above} = clipPoints(d.points.map(point), xLoss, yLoss);
    let series;
    let visualMap;
    if (numericColor) {
      const vals = d.points.map((p) => p.color).filter((v) => typeof v === 'number');
      series = [{type: 'scatter', symbolSize: 9, data: kept, large: true, largeThreshold: LARGE}, ...aboveSeries(above, {color: undefined})];
      visualMap = {type: 'continuous', dimension: 2, min: Math.min(...vals), max: Math.max(...vals), calculable: true, right: 0, top: 'middle', text: [d.color, ''], inRange: {color: ['#440154', '#3b528b', '#21918c', '#5ec962', '#fde725']}};
    } else {
      const groups = {};
      for (const q of kept) (groups[label(q[2])] ??= []).push(q);
      series = [...Object.entries(groups).map(([k, pts], i) => ({name: k, type: 'scatter', symbolSize: 9, data: pts, large: true, largeThreshold: LARGE, color: CLASS_COLOR[k] || PALETTE[i % PALETTE.length]})), ...aboveSeries(above)];
    }
    phase.el.dataset.ceiling = (xLoss || yLoss) && l0 !== null ? String(l0) : '';
    await draw(phase.el, {
      grid: {left: 70, right: numericColor ? 90 : 20, top: 40, bottom: 44},
      legend: numericColor ? undefined : {top: 0},
      tooltip: {trigger: 'item', formatter: (p) => `trial ${p.value[3]}<br>${d.x}: ${fmt(p.value[0])}<br>${d.y}: ${fmt(p.value[1])}<br>${d.color}: ${fmt(p.value[2])}${rawNote(p)}`},
      xAxis: axisOf(xLoss, axis(d.x_log, 'x')), yAxis: axisOf(yLoss, axis(d.y_log, 'y')), visualMap, series,
    }, {onClick: (p) => openTrial(p.value[3])});
  }

  async function loadPareto(pending = null) {
    if (!pareto) return;
    if (pending) l0 = (await pending).l0 ?? null;
    const d = await get(`/v1/studies/${id}/plots/pareto`, {format: 'json'});
    const xi = d.x_objective, yi = d.y_objective;
    const [xLoss, yLoss] = [isLoss(d.x_label), isLoss(d.y_label)];
    const pt = (p) => [p.values[xi], p.values[yi], p.trial];
    const front = d.points.filter((p) => p.on_front).sort((a, b) => a.values[xi] - b.values[xi]);
    // The front is drawn as computed (its line clipped like any loss); dominated points
    // above the ceiling are marked.
    const {kept, above} = clipPoints(d.points.filter((p) => !p.on_front).map(pt), xLoss, yLoss);
    const clip = (q) => [clipLoss(q[0], xLoss ? l0 : null).y, clipLoss(q[1], yLoss ? l0 : null).y, q[2]];
    await draw(pareto.el, {
      grid: {left: 70, right: 20, top: 40, bottom: 44},
      legend: {top: 0},
      tooltip: {trigger: 'item', formatter: (p) => `trial ${p.value[2]}: ${fmt(p.value[0])}, ${fmt(p.value[1])}${rawNote(p)}`},
      xAxis: axisOf(xLoss, {type: 'value', name: d.x_label, nameLocation: 'middle', nameGap: 26, scale: true}),
      yAxis: axisOf(yLoss, {type: 'value', name: d.y_label, scale: true}),
      series: [
        {name: 'dominated', type: 'scatter', data: kept, color: '#999'},
        ...aboveSeries(above),
        {name: 'Pareto front', type: 'line', step: 'end', symbolSize: 9, data: front.map(pt).map(clip), color: '#d62728'},
      ],
    }, {onClick: (p) => openTrial(p.value[2])});
  }

  async function loadImportance() {
    const need = ctx.config.importance_min_trials;
    const complete = last.trials_by_state.COMPLETE || 0;
    if (complete < need) {
      await draw(importance.el, {title: {text: `Importance ranks the parameters once ${need} trials are COMPLETE (${complete} so far).`, left: 'center', top: 'middle', textStyle: {fontSize: 12, fontWeight: 'normal', color: '#666'}}});
      return;
    }
    const ev = evaluator || (complete > FANOVA_AUTO ? 'ped_anova' : 'fanova');
    let d;
    try {
      d = await get(`/v1/studies/${id}/importance`, {evaluator: ev});
    } catch (e) {
      if (e instanceof ApiError) { await draw(importance.el, {title: {text: e.message, left: 'center', top: 'middle', textStyle: {fontSize: 12, fontWeight: 'normal', color: '#666', width: 500, overflow: 'break'}}}); return; }
      throw e;
    }
    const items = Object.entries(d.importances).reverse();
    await draw(importance.el, {
      grid: {left: 170, right: 30, top: 30, bottom: 30},
      title: {text: `${d.target} (${d.evaluator}, ${d.n_trials} trials)`, textStyle: {fontSize: 12, fontWeight: 'normal'}},
      tooltip: {trigger: 'item'},
      xAxis: {type: 'value', max: 1},
      yAxis: {type: 'category', data: items.map(([k]) => k)},
      series: [{type: 'bar', data: items.map(([, v]) => v), color: '#3182bd', label: {show: true, position: 'right', formatter: (p) => p.value.toFixed(3)}}],
    });
    fill(importanceNote, ev === 'fanova' ? null : [
      `PED-ANOVA: fANOVA takes minutes at ${complete} trials. `,
      h('button', {type: 'button', id: `importance-fanova-${id}`, onclick: (e) => {
        evaluator = 'fanova';
        e.target.disabled = true;
        fill(importanceNote, 'computing fANOVA\u2026');
        loadImportance().catch(ctx.onError);
      }}, 'compute fANOVA'),
    ]);
    ctx.ready('importance');
  }

  let last = await firstSummary;
  renderSummary(last);
  await loadTable(firstPage);
  ctx.ready('study');
  // ECharts (1.1 MB) only now: compiling it earlier would hold the table back. The charts'
  // data is fetched while it compiles.
  loadECharts();
  const loadLrSensitivity = async () => {
    if (!lrsens) return;
    await lrsens.load();
    ctx.ready('lrsens');
  };
  const loadBoundary = async () => {
    if (!boundary) return;
    await boundary.load();
    ctx.ready('boundary');
  };
  const charts = () => {
    const hist = fetchHistory();  // its l0 is the ceiling of the phase map's and Pareto's losses
    hist.catch(() => {});  // awaited by each
    return Promise.all([loadHistory(hist), loadPhase(hist), loadPareto(hist), loadLrSensitivity(), loadBoundary()]);
  };
  await charts();
  ctx.ready('studycharts');
  loadImportance().catch(ctx.onError);
  let importanceAt = Date.now();

  return every(POLL_MS, async () => {
    if (!OPEN.has(last.status)) return;
    const s = await get(`/v1/studies/${id}/summary`);
    const changed = JSON.stringify(s.trials_by_state) !== JSON.stringify(last.trials_by_state) || s.status !== last.status;
    const finishedMore = s.finished !== last.finished;
    last = s;
    renderSummary(s);
    if (changed) {
      await loadTable();
      await charts();
    } else if (s.trials_by_state.RUNNING) {
      await loadTable();  // running trials' last_step moves
    }
    if (finishedMore && Date.now() - importanceAt > 20000) {
      importanceAt = Date.now();
      loadImportance().catch(ctx.onError);
    }
  }, ctx.onError);
}

function fieldOptions(params, selected) {
  return [...params.map((p) => `params.${p}`), ...NUMERIC, 'min_norm_entropy_ever', 'best_val_loss', 'qk_eig_mean']
    .map((f) => h('option', {value: f, selected: f === selected}, f));
}
