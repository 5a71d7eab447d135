// The web UI's entry point: hash routing between the three pages, and the token prompt.
//   #/                 studies
//   #/studies/<id>     one study
//   #/trials/<id>[,<id>...]   one trial, or 2-4 side by side

import {AuthError, endSession, forgetToken, get, setToken, token} from './api.js';
import {disposeAll} from './charts.js';
import {fill, h} from './dom.js';
import {studiesPage} from './studies.js';
import {studyPage} from './study.js';
import {trialsPage} from './trial.js';

const view = document.getElementById('view');
const forget = document.getElementById('forget-token');
let leave = () => {};  // stops the current page's polling
let config = null;

/** Mark a page's first data on screen (the benchmark reads these). */
export function ready(page) {
  if (!document.documentElement.dataset[`ready${page}`]) {
    performance.mark(`qk:data:${page}`);
    document.documentElement.dataset[`ready${page}`] = '1';
  }
}

function tokenForm(message) {
  const input = h('input', {type: 'password', id: 'token', autocomplete: 'off', placeholder: 'API token', size: 40});
  const form = h('form', {class: 'token-form', onsubmit: (e) => {
    e.preventDefault();
    if (!input.value.trim()) return;
    setToken(input.value);
    route();
  }},
  h('h2', {}, 'API token needed'),
  h('p', {id: 'auth-message', class: 'error'}, message),
  h('p', {class: 'muted'},
    'This qkscope server has API tokens configured (QKSCOPE_API_TOKENS). Paste one; ',
    'it is kept in this tab only (sessionStorage) and sent as an Authorization header.'),
  input, ' ', h('button', {type: 'submit'}, 'use token'));
  return form;
}

/** Show the token prompt and nothing else: no data without a valid token. */
export function needToken(err) {
  config = null;
  leave();
  leave = () => {};
  disposeAll();
  fill(view, tokenForm(err.hadToken ? 'The token was not accepted: no data is shown.' : 'No token given: no data is shown.'));
  document.getElementById('token')?.focus();
  if (err.hadToken) forgetToken();
  forget.hidden = true;
}

export function showError(el, err) {
  if (err instanceof AuthError) { needToken(err); return; }
  fill(el, h('p', {class: 'error'}, err.message || String(err)));
}

async function route() {
  leave();
  leave = () => {};
  const hash = location.hash.replace(/^#\/?/, '');
  const [kind, arg] = hash.split('/');
  try {
    config ??= await get('/v1/ui/config');
  } catch (e) {
    if (e instanceof AuthError) { needToken(e); return; }
    fill(view, h('p', {class: 'error'}, `The API did not answer: ${e.message}`));
    return;
  }
  forget.hidden = !token();
  fill(view);
  disposeAll();
  const ctx = {view, config, ready, onError: (err) => showError(view, err)};
  try {
    if (kind === 'studies' && arg) leave = await studyPage(ctx, Number(arg));
    else if (kind === 'trials' && arg) leave = await trialsPage(ctx, arg.split(',').map(Number).filter(Boolean).slice(0, 4));
    else leave = await studiesPage(ctx);
  } catch (e) {
    if (e instanceof AuthError) needToken(e);
    else fill(view, h('p', {class: 'error'}, e.message || String(e)));
  }
}

forget.addEventListener('click', async () => { await endSession(); forgetToken(); config = null; route(); });
window.addEventListener('hashchange', route);
window.addEventListener('unhandledrejection', (e) => {
  if (e.reason instanceof AuthError) { e.preventDefault(); needToken(e.reason); }
});
route();
