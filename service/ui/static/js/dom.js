// Small DOM and formatting helpers shared by every page (no framework: the pages are small).

import {AuthError} from './api.js';

/** Create an element: h('a', {href: '#/'}, 'text', child, ...). Attributes starting with
 *  "on" are listeners; `dataset` and `style` objects are merged; null children are skipped. */
export function h(tag, attrs = {}, ...children) {
  const el = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v === null || v === undefined || v === false) continue;
    if (k.startsWith('on') && typeof v === 'function') el.addEventListener(k.slice(2), v);
    else if (k === 'dataset') Object.assign(el.dataset, v);
    else if (k === 'style' && typeof v === 'object') Object.assign(el.style, v);
    else if (k === 'class') el.className = v;
    else if (v === true) el.setAttribute(k, '');
    else el.setAttribute(k, String(v));
  }
  for (const c of children.flat(Infinity)) {
    if (c === null || c === undefined || c === false) continue;
    el.append(c instanceof Node ? c : document.createTextNode(String(c)));
  }
  return el;
}

/** A number for a table cell: 4 significant digits, '-' for null, booleans as yes/no. */
export function fmt(v, digits = 4) {
  if (v === null || v === undefined) return '-';
  if (typeof v === 'boolean') return v ? 'yes' : 'no';
  if (typeof v === 'number') {
    if (!Number.isFinite(v)) return String(v);
    if (Number.isInteger(v) && Math.abs(v) < 1e6) return String(v);
    const a = Math.abs(v);
    if (a !== 0 && (a < 1e-3 || a >= 1e6)) return v.toExponential(digits - 1);
    return String(Number(v.toPrecision(digits)));
  }
  return String(v);
}

export function pct(v) {
  return v === null || v === undefined ? '-' : `${(100 * v).toFixed(0)}%`;
}

export function ago(iso) {
  if (!iso) return '-';
  const s = (Date.now() - Date.parse(iso)) / 1000;
  if (s < 90) return `${Math.max(0, Math.round(s))} s ago`;
  if (s < 5400) return `${Math.round(s / 60)} min ago`;
  if (s < 172800) return `${Math.round(s / 3600)} h ago`;
  return new Date(iso).toISOString().slice(0, 10);
}

export function duration(s) {
  if (s === null || s === undefined) return '-';
  if (s < 90) return `${s.toFixed(1)} s`;
  if (s < 5400) return `${(s / 60).toFixed(1)} min`;
  return `${(s / 3600).toFixed(1)} h`;
}

/** A status badge, coloured by state (CSS classes state-<STATE>). */
export function badge(state) {
  return h('span', {class: `badge state-${state}`}, state);
}

/** Key/value table of a flat or nested object (nested keys joined with '.'). */
export function kvTable(obj, {skip = []} = {}) {
  const rows = [];
  const walk = (o, prefix) => {
    for (const [k, v] of Object.entries(o || {})) {
      const key = prefix ? `${prefix}.${k}` : k;
      if (skip.includes(key)) continue;
      if (v && typeof v === 'object' && !Array.isArray(v)) walk(v, key);
      else rows.push(h('tr', {}, h('th', {}, key), h('td', {}, Array.isArray(v) ? JSON.stringify(v) : fmt(v))));
    }
  };
  walk(obj, '');
  return h('table', {class: 'kv'}, h('tbody', {}, rows));
}

/** Replace the children of `el`. */
export function fill(el, ...children) {
  el.replaceChildren(...children.flat(Infinity).filter((c) => c !== null && c !== undefined && c !== false));
  return el;
}

/** Run `fn` every `ms` until the returned stop() is called; never two runs at once. A failed
 *  run is logged and retried at the next tick, except a refused token (the API's 401: a
 *  token revoked while the page is open): polling stops and `onAuthError` gets it, so the
 *  page shows the token prompt instead of data that no longer updates. */
export function every(ms, fn, onAuthError = null) {
  let stopped = false;
  let timer = null;
  const tick = async () => {
    if (stopped) return;
    try {
      await fn();
    } catch (e) {
      if (stopped) return;
      if (e instanceof AuthError) {
        stopped = true;
        if (onAuthError) onAuthError(e); else throw e;  // app.js turns it into the prompt
        return;
      }
      console.warn('poll failed:', e.message || e);
    }
    if (!stopped) timer = setTimeout(tick, ms);
  };
  timer = setTimeout(tick, ms);
  return () => { stopped = true; clearTimeout(timer); };
}
