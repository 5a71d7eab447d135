// Page 1: every study with its status, progress, best value and collapse/trapped rates, and
// its Ray job (linked to the Ray dashboard's job page). Live: polled while any study runs.

import {get} from './api.js';
import {ago, badge, every, fill, fmt, h, pct} from './dom.js';

const POLL_MS = 3000;
const PAGE = 100;
const OPEN = new Set(['PENDING', 'RUNNING']);

export async function studiesPage(ctx) {
  const {view, config} = ctx;
  const body = h('tbody', {id: 'studies-body'});
  const count = h('span', {class: 'muted', id: 'studies-count'});
  const pager = h('div', {class: 'pager'});
  view.append(
    h('h1', {}, 'Studies ', count),
    h('table', {class: 'grid', id: 'studies'},
      h('thead', {}, h('tr', {},
        ['id', 'name', 'status', 'progress', 'best value', 'entropy collapse', 'rank collapse', 'trapped', 'created', 'Ray job']
          .map((c) => h('th', {}, c)))),
      body),
    pager,
  );
  let offset = 0;
  const summaries = new Map();  // study id -> summary (kept for finished studies)

  async function load() {
    const page = await get('/v1/studies', {limit: PAGE, offset});
    const need = page.items.filter((s) => OPEN.has(s.status) || !summaries.has(s.id) || summaries.get(s.id).status !== s.status);
    await Promise.all(need.map(async (s) => summaries.set(s.id, await get(`/v1/studies/${s.id}/summary`))));
    fill(count, `(${page.total})`);
    fill(body, page.items.length ? page.items.map((s) => row(s, summaries.get(s.id), config)) :
      h('tr', {}, h('td', {colspan: 10, class: 'muted'}, 'No studies yet: submit one with `qkscope submit FILE` or POST /v1/studies.')));
    fill(pager,
      offset > 0 ? h('button', {onclick: () => { offset = Math.max(0, offset - PAGE); load().catch(ctx.onError); }}, 'newer') : null,
      page.total > offset + PAGE ? h('button', {onclick: () => { offset += PAGE; load().catch(ctx.onError); }}, 'older') : null);
    ctx.ready('studies');
    return page.items.some((s) => OPEN.has(s.status));
  }

  await load();
  return every(POLL_MS, load, ctx.onError);
}

function row(s, sum, config) {
  const progress = sum ? sum.progress : 0;
  const dash = config.ray_dashboard_url;
  const job = s.ray_job_id
    ? (dash ? h('a', {href: `${dash}/#/jobs/${encodeURIComponent(s.ray_job_id)}`, target: '_blank', rel: 'noopener noreferrer'}, s.ray_job_id) : s.ray_job_id)
    : '-';
  return h('tr', {dataset: {study: s.id}},
    h('td', {}, s.id),
    h('td', {}, h('a', {href: `#/studies/${s.id}`}, s.name)),
    h('td', {}, badge(s.status), s.waiting_reason ? h('div', {class: 'muted small'}, s.waiting_reason) : null),
    h('td', {}, h('progress', {max: 1, value: progress}), ' ', sum ? `${sum.finished}/${sum.n_trials}` : ''),
    h('td', {class: 'num'}, sum && sum.best_trial_id ? h('a', {href: `#/trials/${sum.best_trial_id}`}, fmt(sum.best_value)) : '-'),
    h('td', {class: 'num'}, pct(sum?.entropy_collapse_rate)),
    h('td', {class: 'num'}, pct(sum?.rank_collapse_rate)),
    h('td', {class: 'num'}, pct(sum?.trapped_rate)),
    h('td', {title: s.created_at}, ago(s.created_at)),
    h('td', {class: 'mono small'}, job),
  );
}
