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
