// The stability-boundary panel of a study's page (METRICS.md section 11; Wortsman et al.
// 2024): per width and seed the largest stable learning rate eta_max (filled circles) and the
// optimal one eta_opt (hollow diamonds) against width, both axes log; each group's fit of
// eta_max extended to the target width with its t band (shaded), and the fit of eta_opt
// dashed. One colour per group. Shown only for a study that searches optim.lr and a width;
// the numbers are GET /v1/studies/{id}/stability-boundary's, drawn as they come.

import {ApiError, get} from './api.js';
import {PALETTE, chartBox, draw} from './charts.js';
import {fill, fmt, h} from './dom.js';
import {LR_PARAM, groupLabel} from './lrsens.js';

export const WIDTH_PARAMS = ['model.d_model', 'model.hf.config.hidden_size'];

function legendName(g) {
  const f = g.eta_max_fit;
  const ci = f.b_low === null ? '' : ` [${fmt(f.b_low, 3)}, ${fmt(f.b_high, 3)}]`;
  return `${groupLabel(g)}: b ${fmt(f.b, 3)}${ci} (${f.n_seeds} seeds)`;
}

/** The band between `low` and `high` of a fit, one polygon in the grid's coordinates. */
function bandPolygon(color, pts) {
  return (params, api) => {
    if (params.dataIndex !== 0) return null;
    const top = pts.map((p) => api.coord([p.width, p.high]));
    const bottom = pts.map((p) => api.coord([p.width, p.low])).reverse();
    return {type: 'polygon', shape: {points: [...top, ...bottom]}, style: {fill: color, opacity: 0.15}};
  };
}

/** The ECharts option for a /stability-boundary answer. */
export function boundaryOption(d) {
  const series = [];
  d.groups.forEach((g, i) => {
    const color = PALETTE[i % PALETTE.length];
    const name = legendName(g);
    const maxPts = g.points.filter((p) => p.eta_max !== null);
    const optPts = g.points.filter((p) => p.eta_opt !== null);
    series.push({
      name, type: 'scatter', color, symbol: 'circle', symbolSize: 8,
      data: maxPts.map((p) => ({value: [p.width, p.eta_max], seed: p.seed, kind: 'eta_max', ratio: p.ratio})),
    });
    series.push({
      name, type: 'scatter', color, symbol: 'emptyDiamond', symbolSize: 9,
      data: optPts.map((p) => ({value: [p.width, p.eta_opt], seed: p.seed, kind: 'eta_opt'})),
    });
    const fm = g.eta_max_fit.band;
    if (fm.length) {
      series.push({name, type: 'line', color, showSymbol: false, lineStyle: {width: 2}, data: fm.map((p) => [p.width, p.eta])});
      const banded = fm.filter((p) => p.low !== null);
      if (banded.length) {
        series.push({name, type: 'custom', color, silent: true, z: 1,
          renderItem: bandPolygon(color, banded), data: banded.map((p) => [p.width, p.low, p.high])});
      }
    }
    const fo = g.eta_opt_fit.band;
    if (fo.length) {
      series.push({name, type: 'line', color, showSymbol: false, lineStyle: {width: 1.5, type: 'dashed'}, data: fo.map((p) => [p.width, p.eta])});
    }
  });
  const widths = d.groups.flatMap((g) => g.widths);
  const lo = Math.min(...widths);
  const hi = Math.max(d.target_width, ...widths);
  return {
    grid: {left: 72, right: 28, top: 28 + 22 * d.groups.length, bottom: 48},
    legend: {top: 0, left: 0, orient: 'vertical', data: d.groups.map(legendName)},
    tooltip: {trigger: 'item', confine: true, formatter: (p) => {
      if (p.seriesType !== 'scatter') return '';
      const [w, eta] = p.value;
      const r = p.data.ratio ? ` (bracket ratio ${fmt(p.data.ratio, 3)})` : '';
      return `${p.seriesName.split(':')[0]}<br>width ${fmt(w)}, seed ${p.data.seed}: ${p.data.kind} ${fmt(eta)}${r}`;
    }},
    xAxis: {type: 'log', name: `width (${d.width})`, nameLocation: 'middle', nameGap: 28, logBase: 2, min: lo / 1.2, max: hi * 1.2,
      axisLabel: {showMinLabel: false, showMaxLabel: false}},
    yAxis: {type: 'log', name: 'learning rate', nameLocation: 'middle', nameGap: 52, logBase: 10,
      axisLabel: {formatter: (v) => (v < 1e-3 ? v.toExponential(0) : String(Number(v.toPrecision(2))))}},
    series,
  };
}

/** The panel (null unless the study searches optim.lr and a width): {box, load}. */
export function stabilityBoundaryPanel(studyId, spec) {
  const space = spec.search_space || {};
  const searched = (k) => space[k] && space[k].type !== 'fixed';
  const width = (spec.stability && spec.stability.width) || WIDTH_PARAMS.find(searched);
  if (!searched(LR_PARAM) || !width || !searched(width)) return null;
  const note = h('div', {class: 'muted small', id: `boundary-note-${studyId}`});
  const {box, el} = chartBox(`boundary-${studyId}`, 'Stability boundary across widths', {height: 400, note});
  box.id = `boundary-panel-${studyId}`;
  box.classList.add('wide');

  async function load() {
    let d;
    try {
      d = await get(`/v1/studies/${studyId}/stability-boundary`);
    } catch (e) {
      if (!(e instanceof ApiError)) throw e;
      fill(note);
      await draw(el, {title: {text: e.message, left: 'center', top: 'middle', textStyle: {fontSize: 12, fontWeight: 'normal', color: '#666', width: 560, overflow: 'break'}}});
      return;
    }
    const held = d.groups.filter((g) => g.holdout && g.holdout.ratio !== null).map((g) => {
      const x = g.holdout;
      const ci = x.ratio_low === null ? '' : ` [${fmt(x.ratio_low, 3)}, ${fmt(x.ratio_high, 3)}]`;
      return `${groupLabel(g)}: predicted / measured eta_max at width ${fmt(x.width)} = ${fmt(x.ratio, 3)}${ci} (${x.n_seeds} seeds)`;
    });
    const undef = d.groups.flatMap((g) => g.points.filter((p) => p.reason).map((p) => `${groupLabel(g)}, width ${fmt(p.width)}, seed ${p.seed}: ${p.reason}`));
    fill(note,
      h('div', {}, `eta_max (filled) and eta_opt (hollow) per width and seed; solid: the fit log eta_max = a + b log w extended to width ${fmt(d.target_width)} with its ${Math.round(100 * d.confidence)} % t band over seeds; dashed: the fit of eta_opt. Unstable: diverged, an instability constraint, or a final loss above l* + ${d.tau} (l\u2080 \u2212 l*).`),
      held.length ? h('div', {id: `boundary-holdout-${studyId}`}, 'Held out: ', held.join('; ')) : null,
      undef.length ? h('details', {}, h('summary', {}, `${undef.length} point(s) undefined`), h('ul', {}, undef.map((t) => h('li', {}, t)))) : null);
    if (!d.groups.length) {
      await draw(el, {title: {text: 'No finished trials yet.', left: 'center', top: 'middle', textStyle: {fontSize: 12, fontWeight: 'normal', color: '#666'}}});
      return;
    }
    await draw(el, boundaryOption(d));
  }

  return {box, load};
}
