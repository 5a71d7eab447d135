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

/** Lines over steps: series = [{name, steps, values}]; markLines = [{y, label}]. */
export function lineOption(series, {yName = '', log = false, markLines = [], markAreas = [], legend = true} = {}) {
  const s = series.map((x, i) => ({
    name: x.name,
    type: 'line',
    showSymbol: x.steps.length < 60,
    symbolSize: 4,
    sampling: 'lttb',
    large: true,
    data: x.steps.map((st, k) => [st, x.values[k]]),
    lineStyle: {width: 1.5},
    color: x.color || PALETTE[i % PALETTE.length],
  }));
  if (s.length && (markLines.length || markAreas.length)) {
    s[0].markLine = markLines.length ? {
      symbol: 'none', silent: true,
      lineStyle: {type: 'dashed', color: COLLAPSED},
      label: {formatter: (p) => p.name, position: 'insideEndTop'},
      data: markLines.map((m) => ({yAxis: m.y, name: m.label})),
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
  return {
    grid: {...GRID, top: legend ? 44 : 24},
    tooltip: {trigger: 'axis', confine: true, valueFormatter: (v) => (typeof v === 'number' ? v.toPrecision(4) : v)},
    legend: legend ? {type: 'scroll', top: 0} : undefined,
    xAxis: {type: 'value', name: 'step', nameLocation: 'middle', nameGap: 24, min: 'dataMin', max: 'dataMax'},
    yAxis: {type: log ? 'log' : 'value', name: yName, scale: true},
    dataZoom: [{type: 'inside', xAxisIndex: 0}],
    series: s,
  };
}
