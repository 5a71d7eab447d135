// The one way the pages read the API: JSON over fetch, the token (if any) as a bearer header.
// The token lives in sessionStorage only (this tab, until it closes): never in a URL, never logged.

const TOKEN_KEY = 'qkscope.token';
const BASE = new URL('../', document.baseURI);  // the API root: /ui/ is served beside /v1/

export class AuthError extends Error {
  constructor(message, hadToken) { super(message); this.hadToken = hadToken; }
}

export class ApiError extends Error {
  constructor(status, body) {
    super(body && body.message ? body.message : `HTTP ${status}`);
    this.status = status;
    this.body = body;
  }
}

export function token() { return sessionStorage.getItem(TOKEN_KEY); }
export function setToken(t) { sessionStorage.setItem(TOKEN_KEY, t.trim()); }
export function forgetToken() { sessionStorage.removeItem(TOKEN_KEY); }

/** The "forget token" button: this browser's UI cookie goes too (service/ui/__init__.py). */
export async function endSession() {
  const t = token();
  if (!t) return;
  try {
    await fetch(new URL('v1/ui/session', BASE), {method: 'DELETE', headers: {Authorization: `Bearer ${t}`}, cache: 'no-store'});
  } catch { /* the cookie then lasts until the browser closes: it opens no data */ }
}

/** Query string from an object; arrays repeat the key (where=a&where=b); nulls are left out. */
export function qs(params = {}) {
  const p = new URLSearchParams();
  for (const [k, v] of Object.entries(params)) {
    if (v === null || v === undefined || v === '') continue;
    for (const x of Array.isArray(v) ? v : [v]) p.append(k, String(x));
  }
  const s = p.toString();
  return s ? `?${s}` : '';
}

/** GET a JSON route (`/v1/...`); throws AuthError on 401, ApiError on other non-2xx. */
export async function get(path, params = {}, {signal} = {}) {
  const headers = {Accept: 'application/json'};
  const t = token();
  if (t) headers.Authorization = `Bearer ${t}`;
  const url = new URL(path.replace(/^\//, '') + qs(params), BASE);
  const r = await fetch(url, {headers, signal, cache: 'no-store', credentials: 'omit'});
  if (r.status === 401) {
    throw new AuthError(t ? 'The token was not accepted.' : 'This API needs a token.', Boolean(t));
  }
  let body = null;
  try { body = await r.json(); } catch { body = null; }
  if (!r.ok) throw new ApiError(r.status, body);
  return body;
}

/** All of a trial's /series, page by page (the route answers at most 200,000 rows a call and
 * a `next_cursor` while more follow): one {trial_id, rows, series} as if from one call, a
 * series that continues on the next page joined to its start. */
export async function getSeries(trialId, params = {}, opts = {}) {
  let out = null;
  let cursor = null;
  do {
    const page = await get(`/v1/trials/${trialId}/series`, {...params, cursor}, opts);
    if (out === null) {
      out = {trial_id: page.trial_id, rows: 0, truncated: false, next_cursor: null, series: []};
    }
    out.rows += page.rows;
    for (const s of page.series) {
      const last = out.series[out.series.length - 1];
      if (last && last.name === s.name && last.layer === s.layer && last.head === s.head) {
        for (let i = 0; i < s.steps.length; i++) { last.steps.push(s.steps[i]); last.values.push(s.values[i]); }
      } else {
        out.series.push(s);
      }
    }
    cursor = page.next_cursor;
  } while (cursor);
  return out;
}

