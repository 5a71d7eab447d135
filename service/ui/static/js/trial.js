// Page 3: one trial, or 2-4 side by side (one column each). Per trial: train/val loss with
// the plateaus (and `trapped`) marked; normalised attention entropy as a layer x head heatmap
// over steps with the collapse threshold, and beside it the largest attention logit per head
// (attn_logit_max, METRICS.md 9) as a second heatmap; rank-collapse ratio per layer; QK eigenspectrum
// mean and variance per head; the regularizer's penalty; config, summary, state, attempts
// and node. Every series a chart draws comes from one route (/v1/trials/{id}/series?name=...),
// in one call up to 200,000 rows, page by page beyond (api.js getSeries).
//
// Sizes: a 4-layer 8-head model evaluated 725 times stores 100,000 rows. The heatmap is one
// canvas image (heatmap.js); the per-head QK curves show one layer at a time (a picker) when
// there are more than MAX_HEAD_LINES heads, and ECharts thins each line (LTTB) to the pixels.

import {get, getSeries} from './api.js';
import {COLLAPSED, chartBox, draw, lineOption, loadECharts, register} from './charts.js';
import {badge, duration, every, fill, fmt, h, kvTable} from './dom.js';
import {Heatmap, linearScale} from './heatmap.js';

const POLL_MS = 3000;
const OPEN = new Set(['QUEUED', 'RUNNING']);
const MAX_HEAD_LINES = 16;  // per-head curves drawn at once; more: one layer at a time
// The series the page draws (attn_entropy, grad_norm and lr are not drawn: not fetched).
const DRAWN = ['train_loss', 'val_loss', 'attn_entropy_norm', 'attn_logit_max', 'rank_ratio', 'qk_eig_mean', 'qk_eig_var', 'reg_penalty'];

/** A threshold from the trial's params (if searched) else the study's base config. */
function threshold(trial, study, name, fallback) {
  if (trial.params && typeof trial.params[name] === 'number') return trial.params[name];
  const v = study.spec?.base?.[name];
  return typeof v === 'number' ? v : fallback;
}

function byName(series) {
  const out = {};
  for (const s of series) (out[s.name] ??= []).push(s);
  return out;
}

/** Heads whose normalised entropy fell below the threshold at some evaluation. */
export function collapsedHeads(rows, thr) {
  const out = [];
  for (const r of rows) {
    let first = null;
    let min = Infinity;
    r.values.forEach((v, k) => {
      if (v !== null && v < thr) { if (first === null) first = r.steps[k]; }
      if (v !== null && v < min) min = v;
    });
    if (first !== null) out.push({layer: r.layer, head: r.head, first, min});
  }
  return out;
}

export async function trialsPage(ctx, ids) {
  const {view} = ctx;
  if (!ids.length) throw new Error('no trial ids in the address');
  loadECharts();  // fetched and compiled while the data is on its way
  const studies = new Map();
  const cols = h('div', {class: `trial-cols n${ids.length}`});
  view.append(h('h1', {}, ids.length === 1 ? `Trial ${ids[0]}` : `Trials ${ids.join(', ')} side by side`), cols);
  const panes = ids.map((id) => {
    const pane = h('div', {class: 'trial-col', id: `trial-${id}`});
    cols.append(pane);
    return {id, pane, parts: null};
  });

  async function load(p) {
    // The series (the big one) and the trial in parallel; its study (once per study) as soon
    // as the trial names it, while the series is still on its way.
    const series = getSeries(p.id, {name: DRAWN});
    series.catch(() => {});  // awaited below
    const trial = await get(`/v1/trials/${p.id}`);
    if (!studies.has(trial.study_id)) studies.set(trial.study_id, get(`/v1/studies/${trial.study_id}`));
    const [data, study] = await Promise.all([series, studies.get(trial.study_id)]);
    p.parts ??= layout(p, trial, study, ids.length);
    await render(p, trial, study, data);
    return trial;
  }

  const trials = await Promise.all(panes.map(load));
  ctx.ready('trial');
  const open = () => trials.some((t) => OPEN.has(t.state));
  return every(POLL_MS, async () => {
    if (!open()) return;
    for (let i = 0; i < panes.length; i++) {
      if (OPEN.has(trials[i].state)) trials[i] = await load(panes[i]);
    }
  }, ctx.onError);
}

function layout(p, trial, study, n) {
  const id = p.id;
  const height = n > 2 ? 220 : 260;
  const parts = {
    head: h('div', {class: 'trial-head'}),
    loss: chartBox(`loss-${id}`, 'Loss (plateaus shaded; \u25b3: above l\u2080, drawn at it)', {height}),
    heat: chartBox(`heatmap-${id}`, 'Normalised attention entropy, layer x head over steps', {height: height + 40,
      note: h('p', {class: 'small', id: `collapsed-${id}`})}),
    logits: chartBox(`logitmap-${id}`, 'Largest |attention logit|, layer x head over steps', {height: height + 40,
      note: h('p', {class: 'small', id: `logitmax-${id}`})}),
    rank: chartBox(`rank-${id}`, 'Rank-collapse ratio per layer (0: embeddings)', {height}),
    layerPick: h('select', {id: `heads-layer-${id}`, class: 'small'}),
    eigMean: null,
    eigVar: null,
    penalty: chartBox(`penalty-${id}`, 'Regularizer penalty', {height: 200}),
    tables: h('div', {class: 'trial-tables'}),
  };
  const pick = h('div', {class: 'controls'}, h('label', {}, 'heads of ', parts.layerPick));
  parts.eigMean = chartBox(`eigmean-${id}`, 'QK eigenspectrum mean per head', {height, note: pick});
  parts.eigVar = chartBox(`eigvar-${id}`, 'QK eigenspectrum variance per head', {height});
  parts.layerPick.addEventListener('change', () => {
    p.layer = parts.layerPick.value;
    drawHeads(p).catch((e) => console.warn(e));
  });
  const heats = h('div', {class: 'heat-pair'}, parts.heat.box, parts.logits.box);
  p.pane.append(parts.head, parts.loss.box, heats, parts.rank.box, parts.eigMean.box, parts.eigVar.box, parts.penalty.box, parts.tables);
  return parts;
}

const headLabel = (s) => `L${s.layer} H${s.head}`;

/** The per-head QK charts for the layer picked (p.layer: 'all' or a layer number). */
async function drawHeads(p) {
  const perHead = (n) => (p.series[n] || [])
    .filter((s) => p.layer === 'all' || String(s.layer) === p.layer)
    .map((s) => ({...s, name: headLabel(s)}));
  await draw(p.parts.eigMean.el, lineOption(perHead('qk_eig_mean')));
  await draw(p.parts.eigVar.el, lineOption(perHead('qk_eig_var')));
}

/** The ceiling of the loss plot (charts.js, the loss-axis rule): l_0, the trial's step-0
 *  validation loss (its val_loss row at step 0, else the summary's init_val_loss); without
 *  one, the larger of its first stored val_loss and train_loss (the first train loss is that
 *  of a model that has taken one step, so the early descent stays on the axis).
 *  {y, label}, or null when no loss is stored. */
export function lossCeiling(series, summary) {
  const val = (series.val_loss || [])[0];
  if (val && val.steps[0] === 0 && Number.isFinite(val.values[0])) return {y: val.values[0], label: 'l\u2080 (step 0)'};
  if (Number.isFinite(summary?.init_val_loss)) return {y: summary.init_val_loss, label: 'l\u2080 (step 0)'};
  const firsts = ['val_loss', 'train_loss'].map((n) => {
    const s = (series[n] || [])[0];
    const k = s ? s.values.findIndex((v) => Number.isFinite(v)) : -1;
    return k < 0 ? null : {y: s.values[k], step: s.steps[k]};
  }).filter(Boolean);
  if (!firsts.length) return null;
  const top = firsts.reduce((a, b) => (b.y > a.y ? b : a));
  return {y: top.y, label: `no step 0: first loss (step ${top.step})`};
}

/** A `<=` bound of the study's constraints on the logit summaries, or null. */
function logitBound(study) {
  const cons = (study.spec?.constraints || []).filter(
    (c) => (c.metric === 'max_attn_logit_ever' || c.metric === 'max_attn_logit') && c.op === '<=' && typeof c.value === 'number');
  return cons.length ? Math.min(...cons.map((c) => c.value)) : null;
}

/** The attn_logit_max heatmap, beside the entropy's: the same rows (layer x head) and steps. */
function drawLogitMap(p, trial, study, series) {
  const el = p.parts.logits.el;
  const rows = (series.attn_logit_max || []).slice().sort((a, b) => a.layer - b.layer || a.head - b.head);
  let top = 0;
  for (const r of rows) for (const v of r.values) if (v !== null && Number.isFinite(v)) top = Math.max(top, v);
  const bound = logitBound(study);
  const scale = linearScale(Math.max(top, bound ?? 0), 'no attention-logit rows stored (trained before the probe existed)');
  el.style.height = `${Math.min(640, Math.max(p.logitHeight ??= el.clientHeight, 12 * rows.length + 52))}px`;
  const heat = window.qkCharts.get(el.id);
  if (heat instanceof Heatmap && !heat.isDisposed() && heat.getDom() === el) heat.setData(rows, 0, scale);
  else register(el, new Heatmap(el, rows, 0, scale));
  el.dataset.cells = String(rows.reduce((n, s) => n + s.steps.length, 0));
  el.dataset.max = String(top);
  const summary = trial.summary || {};
  fill(document.getElementById(`logitmax-${p.id}`),
    rows.length === 0 ? h('span', {class: 'muted'}, 'no attention-logit rows stored') :
      `Largest |logit| ever ${fmt(summary.max_attn_logit_ever ?? top)}, at the last evaluation ${fmt(summary.max_attn_logit)}` +
      (bound === null ? '.' : `; the study's bound is ${bound}.`));
}

async function render(p, trial, study, data) {
  const {parts} = p;
  const series = byName(data.series);
  const entThr = threshold(trial, study, 'entropy_collapse_threshold', 0.1);
  const rankThr = threshold(trial, study, 'rank_collapse_threshold', 0.05);
  const summary = trial.summary || {};
  const plateaus = summary.plateaus || [];

  fill(parts.head,
    h('div', {class: 'trial-title'},
      h('a', {href: `#/studies/${trial.study_id}`}, `study ${trial.study_id}: ${study.name}`), ' / trial ', h('b', {}, trial.number), ' ',
      badge(trial.state),
      trial.trapped ? h('span', {class: 'badge trapped'}, 'trapped') : null,
      trial.entropy_collapse ? h('span', {class: 'badge collapse'}, 'entropy collapse') : null,
      trial.rank_collapse ? h('span', {class: 'badge collapse'}, 'rank collapse') : null,
      trial.penalty_version === 1 ? h('span', {class: 'badge v1'}, 'penalty v1') : null),
    h('div', {class: 'muted small'},
      `attempts ${trial.attempts} \u00b7 node ${trial.node || '-'} \u00b7 seed ${trial.seed} \u00b7 step ${trial.last_step} \u00b7 `,
      `duration ${duration(trial.duration_s)} \u00b7 value ${fmt(trial.value)} \u00b7 ${data.rows} metric rows drawn`,
      data.truncated ? h('b', {class: 'error'}, ' (truncated)') : null),
    trial.error ? h('pre', {class: 'error small'}, trial.error) : null,
    trial.stop_reason ? h('p', {class: 'small stop-reason'}, `stopped: ${trial.stop_reason}`) : null,
    trial.waiting_reason ? h('p', {class: 'muted small'}, trial.waiting_reason) : null);

  // Loss with the plateaus; the last one is `trapped` when the trial is.
  const loss = ['train_loss', 'val_loss'].flatMap((n) => (series[n] || []).map((s) => ({...s, name: n})));
  const areas = plateaus.map(([a, b], i) => ({
    from: a, to: b,
    label: trial.trapped && i === plateaus.length - 1 ? 'trapped' : 'plateau',
    color: trial.trapped && i === plateaus.length - 1 ? 'rgba(214,39,40,0.15)' : 'rgba(188,189,34,0.2)',
  }));

  // The heatmap: one cell per stored (layer, head, step) row of attn_entropy_norm. Drawn
  // first: it needs no ECharts.
  const ent = (series.attn_entropy_norm || []).slice().sort((a, b) => a.layer - b.layer || a.head - b.head);
  const cells = ent.reduce((n, s) => n + s.steps.length, 0);
  parts.heat.el.style.height = `${Math.min(640, Math.max(p.heatHeight ??= parts.heat.el.clientHeight, 12 * ent.length + 52))}px`;
  const heat = window.qkCharts.get(parts.heat.el.id);
  if (heat instanceof Heatmap && !heat.isDisposed() && heat.getDom() === parts.heat.el) heat.setData(ent, entThr);
  else register(parts.heat.el, new Heatmap(parts.heat.el, ent, entThr));
  parts.heat.el.dataset.cells = String(cells);
  parts.heat.el.dataset.threshold = String(entThr);
  const collapsed = collapsedHeads(ent, entThr);
  fill(document.getElementById(`collapsed-${p.id}`),
    ent.length === 0 ? h('span', {class: 'muted'}, 'no attention-entropy rows stored') :
      collapsed.length === 0 ? `No head below the collapse threshold ${entThr}.` :
        [h('span', {style: {color: COLLAPSED, fontWeight: 'bold'}}, `Below the collapse threshold ${entThr}: `),
          collapsed.map((c) => `${headLabel(c)} (from step ${c.first}, min ${fmt(c.min)})`).join('; ')]);
  parts.heat.el.dataset.collapsed = collapsed.map(headLabel).join(',');
  drawLogitMap(p, trial, study, series);

  const top = lossCeiling(series, summary);
  parts.loss.el.dataset.ceiling = top === null ? '' : String(top.y);
  await draw(parts.loss.el, lineOption(loss, {yName: 'nats', markAreas: areas, ceiling: top?.y ?? null,
    markLines: top === null ? [] : [{y: top.y, label: top.label, color: '#666'}]}));
  const layers = (series.rank_ratio || []).map((s) => ({...s, name: `layer ${s.layer}`}));
  await draw(parts.rank.el, lineOption(layers, {markLines: [{y: rankThr, label: `collapse < ${rankThr}`}]}));
  // Per-head QK curves: all heads when few, else the layer picked (first: a collapsed
  // head's layer, else the first layer).
  p.series = series;
  const heads = (series.qk_eig_mean || series.qk_eig_var || []);
  const layerIds = [...new Set(heads.map((s) => s.layer))].sort((a, b) => a - b);
  const many = heads.length > MAX_HEAD_LINES;
  const choices = [...(many ? [] : ['all']), ...layerIds.map(String)];
  if (!choices.includes(p.layer)) p.layer = many ? String(collapsed[0]?.layer ?? layerIds[0]) : 'all';
  fill(parts.layerPick, choices.map((c) => h('option', {value: c, selected: c === p.layer}, c === 'all' ? 'every layer' : `layer ${c}`)));
  parts.layerPick.disabled = choices.length < 2;
  await drawHeads(p);
  const pen = (series.reg_penalty || []).map((s) => ({...s, name: 'penalty'}));
  await draw(parts.penalty.el, pen.length ? lineOption(pen, {legend: false}) :
    {title: {text: 'no regularizer penalty stored (no regularizer, or lambda = 0)', left: 'center', top: 'middle', textStyle: {fontSize: 12, fontWeight: 'normal', color: '#666'}}});

  const config = {...(study.spec.base || {})};
  fill(parts.tables,
    h('section', {class: 'panel'}, h('h3', {}, 'Parameters (searched)'), kvTable(trial.params)),
    h('section', {class: 'panel'}, h('h3', {}, 'Summary'), kvTable(summary, {skip: ['eval_steps', 'val_losses']})),
    h('section', {class: 'panel'}, h('h3', {}, 'Study base config'), kvTable(config)));
}
