// The normalised-entropy heatmap (layer x head rows, evaluation steps as columns), drawn as
// one image: an offscreen canvas holds one pixel per stored (layer, head, step) row, and the
// chart scales it onto the plot with nearest-neighbour sampling. ECharts drew one rectangle
// per cell (~0.6 s for the 32 x 725 cells of a 100,000-row trial); building the image takes
// milliseconds. The tooltip finds its cell from the mouse position; the wheel zooms the
// steps (double-click: all of them).
//
// Registered in window.qkCharts like the ECharts charts (resize, dispose, getDom), and
// cells() / pixelAt() let the browser tests read back what was drawn.

import {h} from './dom.js';

export const COLLAPSED = '#d62728';
// Healthy entropy, low to high (a sequential blue ramp); collapsed cells are COLLAPSED.
export const RAMP = ['#deebf7', '#9ecae1', '#6baed6', '#3182bd', '#08519c'];
const MISSING = '#c8c8c8';  // a stored row whose value is null
const GRID = {left: 64, right: 150, top: 12, bottom: 40};
const FONT = '11px system-ui, -apple-system, "Segoe UI", Roboto, sans-serif';

const rgb = (hex) => [1, 3, 5].map((i) => parseInt(hex.slice(i, i + 2), 16));
const hex = (r, g, b) => `#${[r, g, b].map((v) => v.toString(16).padStart(2, '0')).join('')}`;

/** The legend's pieces: below the threshold, then RAMP.length equal bands up to 1. */
export function pieces(threshold) {
  const span = (1 - threshold) / RAMP.length;
  return [
    {color: COLLAPSED, label: `collapsed (< ${threshold})`},
    ...RAMP.map((c, i) => ({color: c, label: `${(threshold + i * span).toFixed(2)}-${(threshold + (i + 1) * span).toFixed(2)}`})),
  ];
}

/** The colour of a cell's value (null: MISSING). */
export function colorOf(v, threshold) {
  if (v === null || v === undefined || Number.isNaN(v)) return MISSING;
  if (v < threshold) return COLLAPSED;
  const span = (1 - threshold) / RAMP.length;
  return RAMP[Math.max(0, Math.min(RAMP.length - 1, Math.floor((v - threshold) / span)))];
}

// The legend and colours of the entropy heatmap (values in [0, 1], a collapse threshold).
export const ENTROPY_SCALE = {pieces, colorOf, empty: 'no attention-entropy rows stored'};

// A sequential orange ramp for unbounded non-negative values (the attention logit maximum).
export const HEAT_RAMP = ['#fee6ce', '#fdae6b', '#fd8d3c', '#e6550d', '#a63603'];

/** A colour scale of `bands` equal bands from 0 to `top` (above `top`: the last band), for a
 * metric with no natural upper bound (attn_logit_max: `top` is the largest value stored, or
 * the trial's constraint bound when that is larger, so the bands say where the bound is). */
export function linearScale(top, empty) {
  const hi = top > 0 && Number.isFinite(top) ? top : 1;
  const span = hi / HEAT_RAMP.length;
  const label = (x) => (hi >= 10 ? x.toFixed(0) : x.toFixed(2));
  return {
    empty,
    pieces: () => HEAT_RAMP.map((c, i) => ({color: c, label: `${label(i * span)}-${label((i + 1) * span)}`})),
    colorOf: (v) => {
      if (v === null || v === undefined || Number.isNaN(v)) return MISSING;
      return HEAT_RAMP[Math.max(0, Math.min(HEAT_RAMP.length - 1, Math.floor(v / span)))];
    },
  };
}

export class Heatmap {
  /** rows = [{layer, head, steps, values}] in display order (top to bottom); `scale` (default:
   * the entropy's) gives the colours, the legend and the text shown with no rows. */
  constructor(el, rows, threshold, scale = ENTROPY_SCALE) {
    this.el = el;
    this.disposed = false;
    this.canvas = h('canvas', {style: {display: 'block'}});
    this.tip = h('div', {class: 'heat-tip', hidden: true});
    el.style.position = 'relative';
    el.replaceChildren(this.canvas, this.tip);
    this.onMove = (e) => this.hover(e);
    this.onLeave = () => { this.tip.hidden = true; };
    this.onWheel = (e) => this.zoom(e);
    this.onReset = () => { this.zoomed = false; this.view = [0, this.steps.length]; this.paint(); };
    this.canvas.addEventListener('mousemove', this.onMove);
    this.canvas.addEventListener('mouseleave', this.onLeave);
    this.canvas.addEventListener('wheel', this.onWheel, {passive: false});
    this.canvas.addEventListener('dblclick', this.onReset);
    this.setData(rows, threshold, scale);
  }

  /** New rows (a running trial's next evaluations): rebuild the image, keep the zoom if it fits. */
  setData(rows, threshold, scale = this.scale || ENTROPY_SCALE) {
    const t0 = performance.now();
    this.rows = rows;
    this.threshold = threshold;
    this.scale = scale;
    const all = new Set();
    for (const r of rows) for (const s of r.steps) all.add(s);
    this.steps = [...all].sort((a, b) => a - b);
    const col = new Map(this.steps.map((s, i) => [s, i]));
    const w = Math.max(1, this.steps.length), ht = Math.max(1, rows.length);
    this.values = new Float64Array(w * ht).fill(NaN);
    this.stored = new Uint8Array(w * ht);
    this.image = document.createElement('canvas');
    this.image.width = w;
    this.image.height = ht;
    const ctx = this.image.getContext('2d', {willReadFrequently: true});
    const img = ctx.createImageData(w, ht);
    const colours = new Map();
    rows.forEach((r, y) => {
      r.steps.forEach((st, k) => {
        const x = col.get(st);
        const v = r.values[k];
        const i = y * w + x;
        this.stored[i] = 1;
        if (v !== null) this.values[i] = v;
        const c = scale.colorOf(v, threshold);
        let px = colours.get(c);
        if (!px) { px = rgb(c); colours.set(c, px); }
        img.data[4 * i] = px[0];
        img.data[4 * i + 1] = px[1];
        img.data[4 * i + 2] = px[2];
        img.data[4 * i + 3] = 255;
      });
    });
    ctx.putImageData(img, 0, 0);
    const [a, b] = this.view || [0, 0];
    this.view = this.zoomed && b <= this.steps.length ? [a, b] : [0, this.steps.length];
    this.labels = rows.map((r) => `L${r.layer} H${r.head}`);
    this.resize();
    performance.measure(`qk:draw:${this.el.id}`, {start: t0});
  }

  getDom() { return this.el; }
  isDisposed() { return this.disposed; }
  dispose() {
    this.disposed = true;
    this.canvas.removeEventListener('mousemove', this.onMove);
    this.canvas.removeEventListener('mouseleave', this.onLeave);
    this.canvas.removeEventListener('wheel', this.onWheel);
    this.canvas.removeEventListener('dblclick', this.onReset);
    this.el.replaceChildren();
  }

  resize() {
    if (this.disposed) return;
    const dpr = window.devicePixelRatio || 1;
    this.width = this.el.clientWidth || 600;
    this.height = this.el.clientHeight || 300;
    this.canvas.style.width = `${this.width}px`;
    this.canvas.style.height = `${this.height}px`;
    this.canvas.width = Math.round(this.width * dpr);
    this.canvas.height = Math.round(this.height * dpr);
    this.dpr = dpr;
    this.paint();
  }

  /** The plot area in CSS pixels. */
  plot() {
    return {x: GRID.left, y: GRID.top, w: Math.max(10, this.width - GRID.left - GRID.right), h: Math.max(10, this.height - GRID.top - GRID.bottom)};
  }

  paint() {
    const ctx = this.canvas.getContext('2d');
    ctx.setTransform(this.dpr, 0, 0, this.dpr, 0, 0);
    ctx.clearRect(0, 0, this.width, this.height);
    ctx.font = FONT;
    ctx.fillStyle = '#333';
    const p = this.plot();
    const n = this.rows.length;
    if (!n || !this.steps.length) {
      ctx.textAlign = 'center';
      ctx.fillText(this.scale.empty, this.width / 2, this.height / 2);
      return;
    }
    const [a, b] = this.view;
    ctx.imageSmoothingEnabled = false;
    ctx.drawImage(this.image, a, 0, b - a, n, p.x, p.y, p.w, p.h);
    ctx.strokeStyle = '#999';
    ctx.lineWidth = 1;
    ctx.strokeRect(p.x - 0.5, p.y - 0.5, p.w + 1, p.h + 1);
    // Rows: a label every `stride` rows (no overlaps); a white line between layers.
    const rowH = p.h / n;
    const stride = Math.max(1, Math.ceil(12 / rowH));
    ctx.textAlign = 'right';
    ctx.textBaseline = 'middle';
    for (let r = 0; r < n; r += stride) ctx.fillText(this.labels[r], p.x - 6, p.y + (r + 0.5) * rowH);
    if (rowH >= 3) {
      ctx.strokeStyle = '#fff';
      ctx.beginPath();
      for (let r = 1; r < n; r++) {
        if (this.rows[r].layer !== this.rows[r - 1].layer) {
          const y = Math.round(p.y + r * rowH) + 0.5;
          ctx.moveTo(p.x, y);
          ctx.lineTo(p.x + p.w, y);
        }
      }
      ctx.stroke();
    }
    // Steps: about one tick per 90 px.
    const cols = b - a;
    const colW = p.w / cols;
    const ticks = Math.max(2, Math.min(cols, Math.floor(p.w / 90)));
    ctx.textAlign = 'center';
    ctx.textBaseline = 'top';
    ctx.strokeStyle = '#999';
    ctx.beginPath();
    for (let k = 0; k < ticks; k++) {
      const c = a + Math.round((k * (cols - 1)) / Math.max(1, ticks - 1));
      const x = p.x + (c - a + 0.5) * colW;
      ctx.moveTo(x, p.y + p.h);
      ctx.lineTo(x, p.y + p.h + 4);
      ctx.fillText(String(this.steps[c]), x, p.y + p.h + 6);
    }
    ctx.stroke();
    ctx.fillText('step', p.x + p.w / 2, p.y + p.h + 22);
    // Legend: the pieces, top to bottom, beside the plot.
    const items = this.scale.pieces(this.threshold);
    const top = p.y + Math.max(0, (p.h - items.length * 16) / 2);
    ctx.textAlign = 'left';
    ctx.textBaseline = 'middle';
    items.forEach((it, i) => {
      const y = top + i * 16;
      ctx.fillStyle = it.color;
      ctx.fillRect(p.x + p.w + 14, y, 14, 10);
      ctx.fillStyle = '#333';
      ctx.fillText(it.label, p.x + p.w + 34, y + 5);
    });
  }

  /** The (row, column) under CSS pixel (x, y) of the canvas, or null. */
  cellAt(x, y) {
    const p = this.plot();
    if (x < p.x || y < p.y || x >= p.x + p.w || y >= p.y + p.h || !this.rows.length) return null;
    const [a, b] = this.view;
    const row = Math.floor(((y - p.y) / p.h) * this.rows.length);
    const col = a + Math.floor(((x - p.x) / p.w) * (b - a));
    return {row, col};
  }

  /** The centre of a cell in CSS pixels of the canvas (null when zoomed out of view). */
  centre(row, col) {
    const p = this.plot();
    const [a, b] = this.view;
    if (col < a || col >= b) return null;
    return {x: p.x + ((col - a + 0.5) / (b - a)) * p.w, y: p.y + ((row + 0.5) / this.rows.length) * p.h};
  }

  hover(e) {
    const box = this.canvas.getBoundingClientRect();
    const x = e.clientX - box.left, y = e.clientY - box.top;
    const c = this.cellAt(x, y);
    const i = c ? c.row * this.steps.length + c.col : -1;
    if (!c || !this.stored[i]) { this.tip.hidden = true; return; }
    const v = this.values[i];
    this.tip.textContent = `${this.labels[c.row]}, step ${this.steps[c.col]}: ${Number.isNaN(v) ? 'n/a' : v.toFixed(4)}`;
    this.tip.hidden = false;
    const right = x > this.width / 2;
    this.tip.style.left = right ? '' : `${x + 12}px`;
    this.tip.style.right = right ? `${this.width - x + 12}px` : '';
    this.tip.style.top = `${Math.max(0, y - 28)}px`;
  }

  zoom(e) {
    const c = this.cellAt(e.offsetX, e.offsetY);
    if (!c) return;
    e.preventDefault();
    const [a, b] = this.view;
    const span = b - a;
    const next = Math.max(Math.min(8, this.steps.length), Math.min(this.steps.length, Math.round(span * (e.deltaY > 0 ? 1.25 : 0.8))));
    if (next === span) return;
    const f = (c.col - a) / span;
    let na = Math.round(c.col - f * next);
    na = Math.max(0, Math.min(this.steps.length - next, na));
    this.view = [na, na + next];
    this.zoomed = true;
    this.paint();
  }

  /** Every stored cell as drawn: [label, step, value, colour of its pixel in the image]. */
  cells() {
    const w = this.steps.length;
    const data = this.image.getContext('2d', {willReadFrequently: true}).getImageData(0, 0, w, Math.max(1, this.rows.length)).data;
    const out = [];
    for (let i = 0; i < this.stored.length; i++) {
      if (!this.stored[i]) continue;
      const row = Math.floor(i / w), col = i % w;
      const v = this.values[i];
      out.push([this.labels[row], this.steps[col], Number.isNaN(v) ? null : v, hex(data[4 * i], data[4 * i + 1], data[4 * i + 2])]);
    }
    return out;
  }

  /** The colour on the visible canvas at the centre of the cell of (label, step). */
  pixelAt(label, step) {
    const c = this.centre(this.labels.indexOf(label), this.steps.indexOf(step));
    if (!c) return null;
    const d = this.canvas.getContext('2d').getImageData(Math.floor(c.x * this.dpr), Math.floor(c.y * this.dpr), 1, 1).data;
    return hex(d[0], d[1], d[2]);
  }
}
