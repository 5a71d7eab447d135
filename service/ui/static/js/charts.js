// Charts, drawn with Apache ECharts (vendored, loaded on first use so the studies list never
// pays for it), except the entropy heatmap (heatmap.js: one canvas image). Every chart
// registers itself in window.qkCharts by its element id, so the browser tests and the
// benchmark can read what was really drawn.

import {h} from './dom.js';
import {COLLAPSED} from './heatmap.js';

export {COLLAPSED};

let echartsPromise = null;
export function loadECharts() {
  echartsPromise ??= import('../vendor/echarts.esm.min.js');
  return echartsPromise;
}

window.qkCharts = window.qkCharts || new Map();
const resizeObserver = new ResizeObserver((entries) => {
  for (const e of entries) window.qkCharts.get(e.target.id)?.resize();
});

export const PALETTE = ['#1f77b4', '#ff7f0e', '#2ca02c', '#9467bd', '#8c564b', '#e377c2', '#7f7f7f', '#bcbd22', '#17becf'];
export const CLASS_COLOR = {
  healthy: '#2ca02c', entropy_collapse: '#ff7f0e', rank_collapse: '#9467bd', both: '#d62728',
  diverged: '#000000', trapped: '#bcbd22',
};

/** A chart container: a titled box holding a div the chart draws into. */
export function chartBox(id, title, {height = 260, note = null} = {}) {
  const el = h('div', {id, class: 'chart', style: {height: `${height}px`}});
  return {box: h('section', {class: 'panel'}, h('h3', {}, title), note, el), el};
}

/** Draw `option` into `el` (creating or reusing its chart); returns the chart. */
export async function draw(el, option, {onClick = null, merge = false} = {}) {
  const echarts = await loadECharts();
  let chart = window.qkCharts.get(el.id);
  if (!chart || chart.isDisposed() || chart.getDom() !== el) {
    chart = echarts.init(el, null, {renderer: 'canvas'});
    window.qkCharts.set(el.id, chart);
    resizeObserver.observe(el);
    if (onClick) chart.on('click', onClick);
  }
  const t0 = performance.now();
  chart.setOption({animation: false, ...option}, {notMerge: !merge, lazyUpdate: false});
  performance.measure(`qk:draw:${el.id}`, {start: t0});  // what each chart costs (bench/ui.py)
  return chart;
}

/** Register a chart drawn without ECharts (an object with resize, dispose, isDisposed and
 *  getDom, like the heatmap): resized with the others, found by the tests by its id. */
export function register(el, chart) {
  const old = window.qkCharts.get(el.id);
  if (old && old !== chart && !old.isDisposed()) old.dispose();
  window.qkCharts.set(el.id, chart);
  resizeObserver.observe(el);
  return chart;
}

/** Forget the charts of a page being left (their elements are gone). */
export function disposeAll() {
  for (const [id, chart] of window.qkCharts) {
    if (!document.getElementById(id)) {
      chart.dispose();
      window.qkCharts.delete(id);
    }
  }
}

const GRID = {left: 60, right: 24, top: 36, bottom: 40, containLabel: false};

// Loss axes, one rule for every plot of a loss (docs/ui.md, "Loss axes"): the axis ends at a
// ceiling, l_0 (the untrained model's validation loss, the step-0 evaluation; without one the
// first evaluation's), plus LOSS_MARGIN of the span drawn. A loss above the ceiling is drawn
// at it as a hollow triangle (CLIPPED_SYMBOL), its raw value in the tooltip: a run that blew
// up to hundreds of nats without going non-finite does not flatten the curves that matter.
export const LOSS_MARGIN = 0.05;
export const CLIPPED_SYMBOL = 'emptyTriangle';
export const CLIPPED_SIZE = 11;

/** min(v, ceiling), the raw value kept when it was clipped: {y, raw} (raw null if not). */
export function clipLoss(v, ceiling) {
  if (ceiling === null || ceiling === undefined || v === null || v === undefined) return {y: v, raw: null};
  return v > ceiling ? {y: ceiling, raw: v} : {y: v, raw: null};
}

/** The y axis of a loss plot: from the lowest value drawn to the ceiling, each end padded by
 *  LOSS_MARGIN of the span; `min`/`max` as ECharts calls them (with the data's extent). */
export function lossAxis(ceiling, extra = {}) {
  const span = (e) => Math.max(ceiling - Math.min(e.min, ceiling), 1e-9 + Math.abs(ceiling) * 1e-3);
  return {
    type: 'value', scale: true, ...extra,
    min: (e) => Math.min(e.min, ceiling) - LOSS_MARGIN * span(e),
    max: (e) => ceiling + LOSS_MARGIN * span(e),
    // The padded ends are not round numbers: no labels there, the ticks between carry them.
    axisLabel: {showMinLabel: false, showMaxLabel: false, formatter: (v) => String(Number(v.toPrecision(3)))},
  };
}

/** Lines over steps: series = [{name, steps, values}]; markLines = [{y, label}]. With
 *  `ceiling` (a number: the series are losses) the loss-axis rule above: values above it are
 *  drawn at it, marked, their raw value in the tooltip. */
export function lineOption(series, {yName = '', log = false, markLines = [], markAreas = [], legend = true, ceiling = null} = {}) {
  const clipped = [];  // one marker series per line that has points above the ceiling
  const s = series.map((x, i) => {
    const color = x.color || PALETTE[i % PALETTE.length];
    const marks = [];
    const data = x.steps.map((st, k) => {
      const {y, raw} = clipLoss(x.values[k], ceiling);
      if (raw === null) return [st, y];
      marks.push({value: [st, y], raw});
      return {value: [st, y], raw};
    });
    if (marks.length) {
      clipped.push({
        name: `${x.name} above l\u2080`, type: 'scatter', color, symbol: CLIPPED_SYMBOL,
        symbolSize: CLIPPED_SIZE, z: 5, data: marks,
      });
    }
    return {
      name: x.name,
      type: 'line',
      showSymbol: x.steps.length < 60,
      symbolSize: 4,
      sampling: 'lttb',
      large: true,
      data,
      lineStyle: {width: 1.5},
      color,
    };
  });
  if (s.length && (markLines.length || markAreas.length)) {
    s[0].markLine = markLines.length ? {
      symbol: 'none', silent: true,
      lineStyle: {type: 'dashed', color: COLLAPSED},
      label: {formatter: (p) => p.name, position: 'insideEndTop'},
      data: markLines.map((m) => ({yAxis: m.y, name: m.label, lineStyle: m.color ? {color: m.color} : undefined})),
    } : undefined;
    s[0].markArea = markAreas.length ? {
      silent: true,
      label: {position: 'insideTop', fontSize: 10},
      data: markAreas.map((a) => [
        {xAxis: a.from, name: a.label, itemStyle: {color: a.color || 'rgba(188,189,34,0.18)'}},
        {xAxis: a.to},
      ]),
    } : undefined;
  }
  const num = (v) => (typeof v === 'number' ? v.toPrecision(4) : v);
  const tooltip = ceiling === null
    ? {trigger: 'axis', confine: true, valueFormatter: num}
    : {trigger: 'axis', confine: true, formatter: (ps) => [
      `step ${ps[0]?.value?.[0] ?? ps[0]?.data?.value?.[0]}`,
      ...ps.filter((p) => p.seriesType === 'line').map((p) => {
        const raw = p.data?.raw;
        const v = p.data?.value ? p.data.value[1] : p.value[1];
        return `${p.marker}${p.seriesName}: ${raw === undefined || raw === null ? num(v) : `${num(raw)} (above l\u2080, drawn at ${num(v)})`}`;
      })].join('<br>')};
  return {
    grid: {...GRID, top: legend ? 44 : 24},
    tooltip,
    legend: legend ? {type: 'scroll', top: 0} : undefined,
    xAxis: {type: 'value', name: 'step', nameLocation: 'middle', nameGap: 24, min: 'dataMin', max: 'dataMax'},
    yAxis: ceiling === null ? {type: log ? 'log' : 'value', name: yName, scale: true} : lossAxis(ceiling, {name: yName}),
    dataZoom: [{type: 'inside', xAxisIndex: 0}],
    series: [...s, ...clipped],
  };
}
