// The LR-sensitivity panel of a study's page (Wortsman et al. 2024, Figure 1; METRICS.md
// section 9): the final validation loss against the learning rate on a log axis, one line per
// group (the median over seeds, whiskers from the lowest to the highest seed), the untrained
// model's loss l_0 of each group dashed in its colour, and each group's LR sensitivity with its
// t interval in the legend. Shown only for a study that searches optim.lr; the numbers are
// GET /v1/studies/{id}/lr-sensitivity's, drawn as they come.
//
// What is drawn is what the definition uses, min(l, l_0) per seed (the route's clipped_*): a
// run that blew up to hundreds of nats without going non-finite sits at l_0, marked with a
// hollow triangle (charts.js CLIPPED_SYMBOL) and its raw loss in the tooltip, and the y axis
// follows the loss-axis rule of every loss plot (charts.js lossAxis; docs/ui.md).

import {ApiError, get} from './api.js';
import {CLIPPED_SIZE, CLIPPED_SYMBOL, PALETTE, chartBox, draw, lossAxis} from './charts.js';
import {fill, fmt, h} from './dom.js';

export const LR_PARAM = 'optim.lr';

/** `model.qk_norm=none` (or `all` when nothing else varies). */
export function groupLabel(g) {
  const parts = Object.entries(g.params).map(([k, v]) => `${k}=${v}`);
  return parts.length ? parts.join(', ') : 'all';
}

function legendName(g) {
  const ci = g.ci_low === null ? '' : ` [${fmt(g.ci_low, 3)}, ${fmt(g.ci_high, 3)}]`;
  return `${groupLabel(g)}: LR sensitivity ${fmt(g.sensitivity, 3)}${ci} (${g.n_seeds} seeds)`;
}

/** Whiskers from the lowest to the highest seed at each learning rate. */
function whiskers(color) {
  return (params, api) => {
    const x = api.value(0);
    const a = api.coord([x, api.value(1)]);
    const b = api.coord([x, api.value(2)]);
    const style = {stroke: color, lineWidth: 1, opacity: 0.7};
    return {type: 'group', children: [
      {type: 'line', shape: {x1: a[0], y1: a[1], x2: b[0], y2: b[1]}, style},
      {type: 'line', shape: {x1: a[0] - 4, y1: a[1], x2: a[0] + 4, y2: a[1]}, style},
      {type: 'line', shape: {x1: b[0] - 4, y1: b[1], x2: b[0] + 4, y2: b[1]}, style},
    ]};
  };
}

/** The ECharts option for an /lr-sensitivity answer. */
export function lrOption(d) {
  const series = [];
  d.groups.forEach((g, i) => {
    const color = PALETTE[i % PALETTE.length];
    const name = legendName(g);
    const pts = g.curve.filter((p) => p.median !== null);
    series.push({
      name, type: 'line', color, symbol: 'circle', symbolSize: 7, lineStyle: {width: 2},
      data: pts.map((p) => {
        // The median itself clipped: some seeds' l(eta) above their l_0 moved it.
        const clipped = p.clipped_median < p.median;
        return {
          value: [p.lr, p.clipped_median], n: p.n, diverged: p.diverged, above: p.above_l0,
          raw: p.median, rawMax: p.max, clipped,
          ...(clipped ? {symbol: CLIPPED_SYMBOL, symbolSize: CLIPPED_SIZE} : {}),
        };
      }),
      // Dashed: l_0. Dotted: the unigram floor of the group's data (METRICS.md 9): a curve
      // whose best point is not below it learned token frequencies, not attention.
      markLine: g.l0 === null && g.unigram_floor == null ? undefined : {
        symbol: 'none', silent: true,
        lineStyle: {type: 'dashed', color, width: 1.5},
        label: {formatter: 'l\u2080', position: 'insideStartTop', color},
        data: [
          ...(g.l0 === null ? [] : [{yAxis: g.l0, name: 'l0'}]),
          ...(g.unigram_floor == null ? [] : [{yAxis: g.unigram_floor, name: 'unigram floor',
            lineStyle: {type: 'dotted', color, width: 1.5},
            label: {formatter: 'unigram floor', position: 'insideEndBottom', color}}]),
        ],
      },
    });
    series.push({
      name, type: 'custom', color, silent: true, z: 1,
      renderItem: whiskers(color),
      encode: {x: 0, y: [1, 2]},
      data: pts.filter((p) => p.n > 1).map((p) => [p.lr, p.clipped_min, p.clipped_max]),
    });
  });
  // The loss-axis ceiling: the highest l_0 (a group's mean over seeds) or clipped point drawn.
  const tops = d.groups.flatMap((g) => [g.l0, ...g.curve.map((p) => p.clipped_max)]).filter((v) => v !== null && Number.isFinite(v));
  const ceiling = tops.length ? Math.max(...tops) : null;
  return {
    grid: {left: 64, right: 28, top: 28 + 22 * d.groups.length, bottom: 48},
    legend: {top: 0, left: 0, orient: 'vertical', data: d.groups.map(legendName)},
    tooltip: {trigger: 'item', confine: true, formatter: (p) => {
      if (p.seriesType !== 'line') return '';
      const [lr, loss] = p.value.value || p.value;
      const q = p.data;
      const div = q.diverged ? `, ${q.diverged} diverged (counted as l\u2080)` : '';
      const above = q.above ? `<br>${q.above} of ${q.n} above l\u2080 (drawn at l\u2080); raw final loss: median ${fmt(q.raw)}, highest ${fmt(q.rawMax)}` : '';
      return `${p.seriesName.split(':')[0]}<br>lr ${fmt(lr)}: min(l, l\u2080) ${fmt(loss)} (median of ${q.n} seeds${div})${above}`;
    }},
    xAxis: {type: 'log', name: 'learning rate', nameLocation: 'middle', nameGap: 28, logBase: 10,
      min: d.grid[0] / 1.5, max: d.grid[d.grid.length - 1] * 1.5,
      axisLabel: {showMinLabel: false, showMaxLabel: false, formatter: (v) => (v < 1e-3 ? v.toExponential(0) : String(Number(v.toPrecision(2))))}},
    yAxis: ceiling === null
      ? {type: 'value', name: 'min(final validation loss, l\u2080)', nameLocation: 'middle', nameGap: 44, scale: true}
      : lossAxis(ceiling, {name: 'min(final validation loss, l\u2080)', nameLocation: 'middle', nameGap: 44}),
    series,
  };
}

/** The panel (null when the study does not search optim.lr): {box, load}. */
export function lrSensitivityPanel(studyId, spec) {
  const space = spec.search_space || {};
  if (!space[LR_PARAM] || space[LR_PARAM].type === 'fixed') return null;
  const note = h('div', {class: 'muted small', id: `lrsens-note-${studyId}`});
  const {box, el} = chartBox(`lrsens-${studyId}`, 'Learning-rate sensitivity', {height: 380, note});
  box.id = `lrsens-panel-${studyId}`;
  box.classList.add('wide');

  async function load() {
    let d;
    try {
      d = await get(`/v1/studies/${studyId}/lr-sensitivity`);
    } catch (e) {
      if (!(e instanceof ApiError)) throw e;
      fill(note);
      await draw(el, {title: {text: e.message, left: 'center', top: 'middle', textStyle: {fontSize: 12, fontWeight: 'normal', color: '#666', width: 560, overflow: 'break'}}});
      return;
    }
    const out = d.groups.flatMap((g) => g.left_out.map((o) => `${groupLabel(g)}, seed ${o.seed}: ${o.reason}`));
    const floorNotes = d.groups.filter((g) => g.note && g.unigram_floor != null).map((g) => h('div', {class: 'warn floor-note'}, `${groupLabel(g)}: ${g.note}`));
    fill(note,
      h('div', {}, `Final validation loss l against the learning rate, as the sensitivity uses it, min(l, l\u2080) per seed: median over seeds, whiskers from the lowest to the highest seed, dashed: l\u2080 (the untrained model), \u25b3: a median above l\u2080 drawn at it (its raw value in the tooltip). `,
        `LR sensitivity = mean over the ${d.grid.length} learning rates of [min(l, l\u2080) \u2212 l*] per seed (a diverged run counts as l\u2080), then the mean over seeds with its ${Math.round(100 * d.confidence)} % t interval.`,
        ' Dotted: the unigram floor of the data (the loss of a model that knows only token frequencies).',
        d.log_spaced ? '' : ' The grid is not equally spaced in log lr.'),
      ...floorNotes,
      out.length ? h('details', {}, h('summary', {}, `${out.length} seed(s) left out until their grid is complete`), h('ul', {}, out.map((t) => h('li', {}, t)))) : null);
    if (!d.groups.length) {
      await draw(el, {title: {text: 'No finished trials yet.', left: 'center', top: 'middle', textStyle: {fontSize: 12, fontWeight: 'normal', color: '#666'}}});
      return;
    }
    await draw(el, lrOption(d));
  }

  return {box, load};
}
