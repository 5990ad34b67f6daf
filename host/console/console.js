// The Bulkhead operator console: a client of the admin API (/admin/v1/) and
// nothing else.
//
// 1. The admin token lives in session storage (gone when the tab closes) and
//    goes out only as `Authorization: Bearer`, to this origin, never in a URL.
// 2. Every value from the API is put on the page as text (`h()` makes text
//    nodes; nothing here assigns HTML), so a name or audit field crafted as
//    markup shows as the characters it is.
// 3. Errors are explained in words with what to do (`explain()`), never shown
//    as raw JSON.
// 4. Pages are hash routes (#/tenants/alpha); the overview refreshes itself
//    every two seconds, other pages on their own buttons.
'use strict';

const TOKEN_KEY = 'bulkhead.admin_token';
const REFRESH_MS = 2000;
const NEWEST = '18446744073709551615';

// ----------------------------------------------------------------- helpers

/** An element with attributes and children; strings become text nodes. */
function h(tag, attrs, ...children) {
  const el = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs || {})) {
    if (value === null || value === undefined || value === false) continue;
    if (key.startsWith('on')) el.addEventListener(key.slice(2), value);
    else if (key === 'class') el.className = value;
    else el.setAttribute(key, value === true ? '' : String(value));
  }
  append(el, children);
  return el;
}

function append(el, children) {
  for (const child of children.flat(Infinity)) {
    if (child === null || child === undefined || child === false) continue;
    el.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return el;
}

const SVG = 'http://www.w3.org/2000/svg';
function svg(tag, attrs, ...children) {
  const el = document.createElementNS(SVG, tag);
  for (const [key, value] of Object.entries(attrs || {})) el.setAttribute(key, String(value));
  return append(el, children);
}

function fmtTime(ms) {
  if (!ms) return '';
  return new Date(Number(ms)).toISOString().replace('T', ' ').replace(/\.\d+Z$/, ' UTC');
}
function fmtInt(n) { return Number(n || 0).toLocaleString('en-US'); }
function fmtBytes(n) {
  const mib = Number(n || 0) / (1 << 20);
  if (mib < 1) return (Number(n || 0) / 1024).toFixed(1) + ' KiB';
  return mib >= 1024 ? (mib / 1024).toFixed(2) + ' GiB' : mib.toFixed(1) + ' MiB';
}
function fmtMs(ms) { return ms >= 1000 ? (ms / 1000).toFixed(2) + ' s' : ms.toFixed(0) + ' ms'; }
function route(...parts) { return '#/' + parts.map(encodeURIComponent).join('/'); }
function num(form, name) {
  const raw = form.elements[name].value.trim();
  return raw === '' ? undefined : Number(raw);
}
function modelsOf(text) {
  const list = text.split(',').map((s) => s.trim()).filter(Boolean);
  return list.length ? list : ['*'];
}

// ----------------------------------------------------------------- the API

class ConsoleError extends Error {
  constructor(message, status, limits) {
    super(message);
    this.status = status;
    this.limits = limits || null;
  }
}

/** `text` ending as a sentence: the API's messages may or may not. */
function sentence(text) {
  const t = text.trim();
  return t === '' || /[.!?]$/.test(t) ? t : t + '.';
}

/** Words for an error answer: what happened and what to do. */
function explain(status, body, what) {
  const e = (body && body.error) || {};
  const said = e.message ? sentence(String(e.message)) : '';
  const field = e.param ? ` (${e.param})` : '';
  const doing = what ? `Could not ${what}: ` : '';
  switch (true) {
    case status === 401:
      return 'The server did not accept the admin token. Sign in again with the admin token; a tenant key cannot open the console.';
    case status === 404:
      return `${doing}${said || 'Not found.'} It may have been deleted meanwhile: reload the list.`;
    case e.code === 'capacity_contract_violated':
      return `${doing}the capacity contract would break. ${said} Every stage is listed below; the ones that would not hold are marked.`;
    case e.code === 'memory_budget_exceeded':
      return `${doing}the memory budget would be exceeded. ${said} Remove a model or use a smaller pool.`;
    case e.code === 'already_exists':
      return `${doing}${said} Pick another name.`;
    case status === 413:
      return `${doing}it is too large for the server. ${said}`;
    case status === 429:
      return `${doing}too many requests for now. ${said} Wait a moment and try again.`;
    case status === 503:
      return `${doing}the server cannot do it now. ${said} If an engine is restarting, wait and try again.`;
    case status >= 500:
      return `${doing}the server failed (${status}). Its log says why; try again, and if it keeps failing, check the server.`;
    case status >= 400:
      return `${doing}the server refused the value${field}: ${said} Correct it and try again.`;
    default:
      return `${doing}unexpected answer ${status}.`;
  }
}

function token() { return sessionStorage.getItem(TOKEN_KEY); }

/**
 * Like Promise.all, but when several fail the error reported is the first
 * in the list's order, not whichever answer came back first, so a page
 * shows the same error every time.
 */
async function settledInOrder(promises) {
  const results = await Promise.allSettled(promises);
  return results.map((r) => {
    if (r.status === 'rejected') throw r.reason;
    return r.value;
  });
}

/**
 * Calls the admin API. `body`: a plain object (sent as JSON) or an
 * ArrayBuffer (sent as a WebAssembly component). `what` names the action
 * for error messages ("create the tenant").
 */
async function api(method, path, body, what) {
  const headers = { Authorization: 'Bearer ' + (token() || '') };
  let payload;
  if (body instanceof ArrayBuffer) {
    headers['Content-Type'] = 'application/wasm';
    payload = body;
  } else if (body !== undefined) {
    headers['Content-Type'] = 'application/json';
    payload = JSON.stringify(body);
  }
  let response;
  try {
    response = await fetch(path, {
      method, headers, body: payload, credentials: 'omit', cache: 'no-store',
      redirect: 'error', referrerPolicy: 'no-referrer',
    });
  } catch (_) {
    throw new ConsoleError('The server did not answer. Check that it is running and reachable, then try again.', 0);
  }
  const text = await response.text();
  let json = null;
  try { json = text ? JSON.parse(text) : null; } catch (_) { json = null; }
  if (!response.ok) {
    if (response.status === 401) signOut();
    const limits = json && json.error && json.error.limits;
    throw new ConsoleError(explain(response.status, json, what), response.status, limits);
  }
  return json;
}

const A = '/admin/v1';
const enc = encodeURIComponent;

// ------------------------------------------------------------ page frame

const main = () => document.getElementById('main');
let timer = null;
let generation = 0;

let noticeKept = false;

/** A message above the page; it survives the navigation that follows it. */
function notice(message, kind) {
  noticeKept = !!message;
  const box = document.getElementById('notice');
  box.replaceChildren();
  if (!message) return;
  box.append(h('p', { class: kind || 'ok', 'data-testid': 'notice' }, message));
}

/** An error in words, with the table of limits a capacity refusal carries. */
function errorBox(error) {
  const box = h('div', { class: 'error', role: 'alert', 'data-testid': 'error' },
    h('p', {}, error.message || String(error)));
  if (error.limits && error.limits.length) {
    box.append(limitsTable(error.limits));
  }
  return box;
}

function showError(slot, error) {
  slot.replaceChildren(errorBox(error));
}

function section(title, ...children) {
  return h('section', {}, h('h2', {}, title), ...children);
}

/** A table in its own scroller: a wide one never widens the page. */
function table(headers, rows, attrs) {
  return h('div', { class: 'scroll' }, h('table', attrs || {},
    h('thead', {}, h('tr', {}, headers.map((t) => h('th', { scope: 'col' }, t)))),
    h('tbody', {}, rows)));
}

/** Pages in use (dark), cached (light) and the reservation (a mark) against `max`. */
function bar(used, reserved, max, label, cached) {
  const pct = (v) => (max > 0 ? Math.min(100, (100 * v) / max) : 0);
  const cache = h('span', { class: 'cached' });
  const fill = h('span', { class: 'fill' });
  const mark = h('span', { class: 'reserved' });
  // Sizes through the CSSOM: the policy allows no inline style attributes.
  cache.style.width = pct(used + (cached || 0)) + '%';
  fill.style.width = pct(used) + '%';
  mark.style.left = pct(reserved) + '%';
  return h('div', { class: 'bar', role: 'img', 'aria-label': label }, cache, fill, reserved > 0 ? mark : null);
}

function confirmPanel(text, button, onConfirm, extra) {
  const slot = h('div', { class: 'confirm', role: 'alertdialog', 'data-testid': 'confirm' });
  slot.append(h('p', {}, text));
  if (extra) slot.append(extra);
  slot.append(h('button', { type: 'button', class: 'danger', onclick: onConfirm }, button),
    ' ', h('button', { type: 'button', onclick: () => slot.remove() }, 'Cancel'));
  return slot;
}

// ------------------------------------------------------------ sign in/out

function signOut() {
  sessionStorage.removeItem(TOKEN_KEY);
  document.getElementById('nav').hidden = true;
  document.getElementById('sign-out').hidden = true;
}

function signInPage(message) {
  const error = h('div', { 'data-testid': 'sign-in-error' });
  if (message) error.append(errorBox(new ConsoleError(message)));
  const form = h('form', { class: 'card narrow', 'data-testid': 'sign-in' },
    h('h1', {}, 'Sign in'),
    h('p', {}, 'Paste the admin token. It stays in this tab\'s session storage and is sent only to this server.'),
    h('label', {}, 'Admin token', h('input', { name: 'token', type: 'password', autocomplete: 'off', required: true })),
    h('button', { type: 'submit' }, 'Sign in'),
    error);
  form.addEventListener('submit', async (event) => {
    event.preventDefault();
    // A refusal from an earlier try must not stand for this one's.
    error.replaceChildren();
    sessionStorage.setItem(TOKEN_KEY, form.elements.token.value.trim());
    try {
      await api('GET', `${A}/stats`, undefined, 'sign in');
      location.hash = '#/overview';
      render();
    } catch (e) {
      signOut();
      showError(error, e);
    }
  });
  main().replaceChildren(form);
}

// ----------------------------------------------------------------- charts

/** Bars of `values` (one per bucket), with the largest labelled. */
function barChart(title, values, unit, testid) {
  const width = 600, height = 130, top = 22;
  const max = Math.max(...values, 0);
  const step = width / Math.max(values.length, 1);
  const chart = svg('svg', { viewBox: `0 0 ${width} ${height}`, class: 'chart', role: 'img', 'aria-label': title });
  values.forEach((v, i) => {
    if (v <= 0) return;
    const bh = Math.max(1, ((height - top) * v) / max);
    chart.append(svg('rect', { x: (i * step).toFixed(1), y: (height - bh).toFixed(1), width: Math.max(1, step - 1).toFixed(1), height: bh.toFixed(1) }));
  });
  chart.append(svg('line', { x1: 0, x2: width, y1: height - 0.5, y2: height - 0.5, class: 'axis' }));
  chart.append(svg('text', { x: 2, y: 16 }, max > 0 ? `max ${unit(max)}` : 'nothing yet'));
  return h('figure', { class: 'chart-box', 'data-testid': testid }, h('figcaption', {}, title), chart);
}

/** Per-bucket values over the window ending now, zero where no bucket. */
function buckets(points, nowMs, bucketMs, count, value) {
  const end = nowMs - (nowMs % bucketMs);
  const out = new Array(count).fill(0);
  for (const p of points) {
    const i = count - 1 - Math.round((end - p.at_ms) / bucketMs);
    if (i >= 0 && i < count) out[i] = value(p);
  }
  return out;
}

// ---------------------------------------------------------------- overview

const ALARMS = {
  canary: 'canary blocked',
  engine_fault: 'engine panic',
  plugin_disabled: 'plugin disabled',
  plugin_tripped: 'operator plugin tripped',
};

async function overviewPage(slot) {
  const [stats, partitions] = await settledInOrder([
    api('GET', `${A}/stats`, undefined, 'read the live state'),
    api('GET', `${A}/partitions`, undefined, 'read the partitions'),
  ]);
  const now = stats.now_ms, width = stats.bucket_ms;
  const secs = width / 1000;
  const models = stats.models.map((m) => {
    const recent = (ms) => m.recent.filter((p) => p.at_ms >= now - ms);
    const last30 = recent(30000).reduce((a, p) => a + p.generated_tokens, 0) / 30;
    const lastMin = recent(60000);
    const firsts = lastMin.reduce((a, p) => a + p.first_tokens, 0);
    const ttft = firsts ? lastMin.reduce((a, p) => a + p.ttft_ms_sum, 0) / firsts : null;
    const tokens10 = m.recent.reduce((a, p) => a + p.generated_tokens, 0);
    const requests10 = m.recent.reduce((a, p) => a + p.requests, 0);
    const used = m.pages_count - m.pages_free;
    return { m, last30, ttft, tokens10, requests10, used };
  });
  const rows = models.map(({ m, last30, ttft, tokens10, requests10, used }) => h('tr', { 'data-model': m.model },
    h('td', {}, m.model),
    h('td', {}, h('span', { class: m.ready ? 'badge ok' : 'badge bad' }, m.ready ? 'ready' : 'not ready')),
    h('td', { class: m.engine_restarts || m.engine_panics ? 'warn num' : 'num' }, `${m.engine_restarts} / ${m.engine_panics}`),
    h('td', { class: 'num' }, fmtInt(m.queued)),
    h('td', { class: 'num' }, fmtInt(m.running)),
    h('td', {}, bar(used, 0, m.pages_count, `${used} of ${m.pages_count} pages in use`), `${fmtInt(used)} of ${fmtInt(m.pages_count)}`),
    h('td', { class: 'num', 'data-testid': 'tokens-per-second' }, last30.toFixed(1)),
    h('td', { class: 'num', 'data-testid': 'tokens-10min' }, fmtInt(tokens10)),
    h('td', { class: 'num', 'data-testid': 'requests-10min' }, fmtInt(requests10)),
    h('td', { class: 'num', 'data-testid': 'ttft' }, ttft === null ? '–' : fmtMs(ttft))));
  const charts = models.map(({ m }) => h('div', { class: 'charts' },
    h('h3', {}, m.model),
    barChart(`Generated tokens per second, last 10 minutes (${secs}-second buckets, counted as requests end)`,
      buckets(m.recent, now, width, 120, (p) => p.generated_tokens / secs), (v) => `${v.toFixed(1)} tok/s`, `chart-tokens-${m.model}`),
    barChart('Mean time to first token, last 10 minutes',
      buckets(m.recent, now, width, 120, (p) => (p.first_tokens ? p.ttft_ms_sum / p.first_tokens : 0)), fmtMs, `chart-ttft-${m.model}`)));
  const partRows = partitions.data.map((p) => {
    const used = p.pages_owned + p.pages_booked;
    return h('tr', {},
      h('td', {}, h('a', { href: route('tenants', p.tenant) }, p.tenant)),
      h('td', {}, p.model),
      h('td', { class: 'wide' }, bar(used, p.pages_reserved, p.pages_max, `${used} of at most ${p.pages_max} pages, ${p.pages_reserved} reserved`, p.pages_cached),
        `${fmtInt(used)} in use · ${fmtInt(p.pages_reserved)} reserved · ${fmtInt(p.pages_max)} max · ${fmtInt(p.pages_cached)} cached`),
      h('td', { class: 'num' }, fmtInt(p.queued)),
      h('td', { class: 'num' }, fmtInt(p.running)));
  });
  // The newest ten, and the newest of each kind they leave out: a flood of
  // one kind (a plugin tripping again and again) hides no blocked canary.
  const shownAlarms = stats.alarms.slice(0, 10);
  for (const a of stats.alarms) {
    if (!shownAlarms.some((s) => s.kind === a.kind)) shownAlarms.push(a);
  }
  const alarmRows = shownAlarms.map((a) => h('tr', { class: 'alarm' },
    h('td', { class: 'when' }, fmtTime(a.at_ms)), h('td', {}, ALARMS[a.kind] || a.kind), h('td', {}, a.subject), h('td', { class: 'detail' }, a.detail)));
  const alarms = section('Isolation alarms',
    alarmRows.length
      ? [h('p', { class: 'error' }, `${fmtInt(stats.alarms_total)} since this server started; the newest, and the newest of each kind:`),
        table(['When', 'What', 'Concerning', 'Details'], alarmRows, { 'data-testid': 'alarms' })]
      : h('p', { class: 'muted', 'data-testid': 'alarms' }, 'None since this server started: no canary blocked, no engine panic, no plugin disabled or tripped by its faults.'),
    h('p', { class: 'muted' }, 'The audit log keeps every one: ',
      h('a', { href: '#/audit?action=request.output_blocked' }, 'blocked canaries'), ' · ',
      h('a', { href: '#/audit?action=engine.fault' }, 'engine faults'), ' · ',
      h('a', { href: '#/audit?action=plugin.' }, 'plugin events'), '.'));
  slot.replaceChildren(
    h('h1', {}, 'Overview'),
    h('p', { class: 'muted' }, `Live: refreshed every ${REFRESH_MS / 1000} s · read at ${fmtTime(now)}`),
    alarms,
    section('Models', table(['Model', 'Readiness', 'Restarts / panics', 'Queued', 'Running', 'KV pages in use', 'Tokens/s (30 s)', 'Tokens (10 min)', 'Requests (10 min)', 'TTFT (1 min)'], rows, { 'data-testid': 'models' })),
    section('Tenants\' KV pages', h('p', { class: 'muted' }, 'Each bar is a tenant\'s pages in use (dark) and in its prefix cache (light) against its maximum; the mark is its reservation.'),
      table(['Tenant', 'Model', 'KV pages', 'Queued', 'Running'], partRows, { 'data-testid': 'partitions' })),
    section('Throughput and latency', charts));
}

// ----------------------------------------------------------------- tenants

function quotaFields(t) {
  const q = (t && t.quota) || {};
  const field = (name, label, value, hint) => h('label', {}, label,
    h('input', { name, type: 'number', min: 0, value: value === undefined ? '' : value, title: hint || null }));
  return [
    field('weight', 'Weight', q.weight === undefined ? 1 : q.weight, 'Share of the engine under contention (1-1000)'),
    field('pages_reserved', 'KV pages reserved', q.pages_reserved === undefined ? 0 : q.pages_reserved),
    field('pages_max', 'KV pages maximum', q.pages_max === undefined ? 64 : q.pages_max),
    field('queue_depth_max', 'Queue depth', q.queue_depth_max),
    field('running_max', 'Running at most', q.running_max),
    field('pending_max', 'Pending at most', q.pending_max),
    h('label', { class: 'check' }, h('input', { name: 'prefix_cache', type: 'checkbox', checked: q.prefix_cache !== false }), 'Prefix cache'),
    h('label', {}, 'Models (comma-separated ids, * for all)', h('input', { name: 'models', value: t ? t.models.join(', ') : '*' })),
  ];
}

function quotaOf(form) {
  const out = {};
  for (const name of ['weight', 'pages_reserved', 'pages_max', 'queue_depth_max', 'running_max', 'pending_max']) {
    const v = num(form, name);
    if (v !== undefined) out[name] = v;
  }
  out.prefix_cache = form.elements.prefix_cache.checked;
  out.models = modelsOf(form.elements.models.value);
  return out;
}

async function inFlight() {
  const partitions = await api('GET', `${A}/partitions`, undefined, 'read the partitions');
  const counts = {};
  for (const p of partitions.data) counts[p.tenant] = (counts[p.tenant] || 0) + p.queued + p.running;
  return counts;
}

async function tenantsPage(slot) {
  const [tenants, flying] = await settledInOrder([api('GET', `${A}/tenants`, undefined, 'list the tenants'), inFlight()]);
  const rows = tenants.data.map((t) => h('tr', {},
    h('td', {}, h('a', { href: route('tenants', t.name) }, t.name)),
    h('td', { class: 'num' }, t.id),
    h('td', {}, t.models.join(', ')),
    h('td', { class: 'num' }, t.quota.weight),
    h('td', { class: 'num' }, `${fmtInt(t.quota.pages_reserved)} / ${fmtInt(t.quota.pages_max)}`),
    h('td', { class: 'num' }, fmtInt(flying[t.name] || 0)),
    h('td', {}, fmtTime(t.created_ms))));
  const result = h('div');
  const form = h('form', { class: 'card', 'data-testid': 'create-tenant' },
    h('h2', {}, 'New tenant'),
    h('label', {}, 'Name', h('input', { name: 'name', required: true, autocomplete: 'off', placeholder: 'letters, digits, - and _' })),
    quotaFields(null),
    h('button', { type: 'submit' }, 'Create tenant'),
    result);
  form.addEventListener('submit', async (event) => {
    event.preventDefault();
    const name = form.elements.name.value.trim();
    try {
      await api('POST', `${A}/tenants`, { name, ...quotaOf(form) }, `create the tenant “${name}”`);
      notice(`Tenant “${name}” created.`);
      location.hash = route('tenants', name);
    } catch (e) { showError(result, e); }
  });
  slot.replaceChildren(h('h1', {}, 'Tenants'),
    table(['Name', 'Id', 'Models', 'Weight', 'KV pages reserved / max', 'In flight', 'Created'], rows, { 'data-testid': 'tenants' }),
    form);
}

async function tenantPage(slot, name) {
  // Both asked at once, but a failure is reported in this order (the
  // tenant's own before its keys'), not in whichever answer came first.
  const [t, keys] = await settledInOrder([
    api('GET', `${A}/tenants/${enc(name)}`, undefined, `open the tenant “${name}”`),
    api('GET', `${A}/tenants/${enc(name)}/keys`, undefined, 'list its keys'),
  ]);
  const result = h('div');
  const form = h('form', { class: 'card', 'data-testid': 'quota' },
    h('h2', {}, 'Quota and models'), quotaFields(t),
    h('button', { type: 'submit' }, 'Save'), result);
  form.addEventListener('submit', async (event) => {
    event.preventDefault();
    try {
      await api('PATCH', `${A}/tenants/${enc(name)}`, quotaOf(form), `change “${name}”`);
      notice(`Saved “${name}”.`);
      render();
    } catch (e) { showError(result, e); }
  });

  const secret = h('div', { 'data-testid': 'secret' });
  const keyRows = keys.data.map((k) => {
    const cell = h('td');
    if (!k.revoked_ms) {
      cell.append(h('button', {
        type: 'button', class: 'danger', 'data-testid': `revoke-${k.id}`,
        onclick: () => cell.append(confirmPanel(`Revoke key ${k.id} (${k.prefix}…)? Requests with it are refused from now on.`, 'Revoke', async () => {
          try {
            await api('DELETE', `${A}/tenants/${enc(name)}/keys/${enc(k.id)}`, undefined, 'revoke the key');
            notice(`Key ${k.id} revoked.`);
            render();
          } catch (e) { showError(cell, e); }
        })),
      }, 'Revoke…'));
    }
    return h('tr', { 'data-key': k.id },
      h('td', {}, k.id), h('td', {}, `${k.prefix}…`), h('td', {}, k.source),
      h('td', {}, fmtTime(k.created_ms)),
      h('td', {}, k.revoked_ms ? `revoked ${fmtTime(k.revoked_ms)}` : 'works'), cell);
  });
  const issue = h('button', {
    type: 'button', 'data-testid': 'issue-key',
    onclick: async () => {
      try {
        const issued = await api('POST', `${A}/tenants/${enc(name)}/keys`, undefined, 'issue a key');
        await render();
        const box = document.querySelector('[data-testid="secret"]');
        box.replaceChildren(h('div', { class: 'secret' },
          h('p', {}, `Key ${issued.key.id}: copy the secret now. It is shown once; the server keeps only its hash.`),
          h('code', { 'data-testid': 'secret-value' }, issued.secret)));
      } catch (e) { showError(secret, e); }
    },
  }, 'Issue a key');

  const deleting = h('div');
  const del = h('button', {
    type: 'button', class: 'danger', 'data-testid': 'delete-tenant',
    onclick: async () => {
      try {
        const flying = (await inFlight())[name] || 0;
        deleting.replaceChildren(confirmPanel(
          `Delete “${name}”? ${flying} of its requests are in flight (queued or running); they end with tenant_removed. Its keys stop working and its plugins are deleted.`,
          'Delete tenant', async () => {
            try {
              const done = await api('DELETE', `${A}/tenants/${enc(name)}`, undefined, `delete “${name}”`);
              notice(`Tenant “${name}” deleted; ${done.requests_ended} requests ended.`);
              location.hash = '#/tenants';
            } catch (e) { showError(deleting, e); }
          }));
      } catch (e) { showError(deleting, e); }
    },
  }, 'Delete tenant…');

  slot.replaceChildren(
    h('h1', {}, `Tenant “${t.name}”`),
    h('p', { class: 'muted' }, `Id ${t.id} · created ${fmtTime(t.created_ms)} · changed ${fmtTime(t.updated_ms)} · `,
      h('a', { href: route('usage', t.name) }, 'usage'), ' · ',
      h('a', { href: route('plugins', t.name) }, 'plugins'), ' · ',
      h('a', { href: route('audit', t.name) }, 'audit log')),
    form,
    section('Keys', table(['Id', 'Prefix', 'Source', 'Created', 'State', ''], keyRows, { 'data-testid': 'keys' }), issue, secret),
    section('Delete', del, deleting));
}

// ---------------------------------------------------------------- capacity

function limitsTable(limits) {
  const binding = Math.min(...limits.map((l) => l.tokens));
  const rows = limits.map((l) => h('tr', { class: [l.holds ? '' : 'broken', l.tokens === binding ? 'binding' : ''].join(' ').trim() || null },
    h('td', {}, l.stage), h('td', {}, h('code', {}, l.field)),
    h('td', { class: 'num' }, fmtInt(l.tokens)),
    h('td', {}, l.holds ? 'holds' : 'does not hold', l.tokens === binding ? ' · binds' : '')));
  return table(['Stage', 'Setting', 'Tokens of one sequence', 'Promise'], rows, { class: 'limits', 'data-testid': 'limits' });
}

async function capacityPage(slot) {
  const capacity = await api('GET', `${A}/capacity`, undefined, 'read the capacity contract');
  slot.replaceChildren(h('h1', {}, 'Capacity'),
    h('p', { class: 'muted' }, 'Each model promises a context to clients; every stage below must hold it. The highlighted row is the limit that binds.'),
    ...capacity.data.map((c) => section(c.model,
      h('p', {}, h('span', { class: c.ok ? 'badge ok' : 'badge bad' }, c.ok ? 'holds' : 'broken'),
        ` promises ${fmtInt(c.promised_tokens)} tokens · prefill chunks of ${fmtInt(c.prefill_chunk_tokens)}`),
      limitsTable(c.limits))));
}

// ------------------------------------------------------------------ models

async function modelsPage(slot) {
  const models = await api('GET', `${A}/models`, undefined, 'list the models');
  const rows = models.data.map((m) => {
    const id = m.spec.id;
    const out = h('td', { class: 'actions' });
    out.append(
      h('button', {
        type: 'button', 'data-testid': `audit-${id}`,
        onclick: async () => {
          const shown = h('div', { class: 'card' }, 'Auditing…');
          out.append(shown);
          try {
            const a = await api('GET', `${A}/models/${enc(id)}/pool`, undefined, 'audit the pool');
            shown.replaceChildren(
              h('p', {}, h('span', { class: a.at_baseline ? 'badge ok' : 'badge warn' }, a.at_baseline ? 'at baseline' : 'in use'),
                ` invariants: ${a.invariants} · ${fmtInt(a.free_pages_dirty)} dirty of ${fmtInt(a.free_pages_checked)} free pages checked`),
              h('p', {}, `pool ${a.pool_id}: ${fmtInt(a.pages_count)} pages, ${fmtInt(a.pages_free)} free, ${fmtInt(a.pages_owned)} leased, ${fmtInt(a.pages_booked)} booked, ${fmtInt(a.pages_shared)} cached, ${fmtInt(a.pages_released)} awaiting scrub · ${fmtInt(a.in_flight)} requests in flight · ${fmtInt(a.pages_scrubbed_total)} scrubbed`));
          } catch (e) { showError(shown, e); }
        },
      }, 'Audit pool'),
      ' ',
      h('button', {
        type: 'button', class: 'danger', 'data-testid': `remove-${id}`,
        onclick: () => {
          const drain = h('input', { name: 'drain', type: 'number', min: 0, value: 30 });
          out.append(confirmPanel(`Remove ${id}? It stops taking requests; those in flight may finish within the drain, then end with model_removed.`, 'Remove model', async () => {
            try {
              const r = await api('DELETE', `${A}/models/${enc(id)}?drain_ms=${Math.round(Number(drain.value || 0) * 1000)}`, undefined, `remove ${id}`);
              notice(`Model ${id} removed after ${r.drain_ms} ms; ${r.requests_ended} requests ended.`);
              render();
            } catch (e) { showError(out, e); }
          }, h('label', {}, 'Drain, seconds', drain)));
        },
      }, 'Remove…'));
    return h('tr', {},
      h('td', {}, id), h('td', {}, h('span', { class: m.ready ? 'badge ok' : 'badge bad' }, m.ready ? 'ready' : 'not ready')),
      h('td', { class: 'path' }, m.spec.path), h('td', { class: 'num' }, fmtInt(m.spec.context_tokens)),
      h('td', { class: 'num' }, fmtBytes(m.weights_bytes)), h('td', { class: 'num' }, fmtBytes(m.kv_bytes)),
      h('td', {}, m.source), out);
  });
  const result = h('div');
  const form = h('form', { class: 'card', 'data-testid': 'add-model' },
    h('h2', {}, 'Add a model'),
    h('label', {}, 'Id', h('input', { name: 'id', required: true })),
    h('label', {}, 'GGUF file (absolute path on the server)', h('input', { name: 'path', required: true })),
    h('label', {}, 'Context promised, tokens', h('input', { name: 'context_tokens', type: 'number', min: 1, required: true, value: 2048 })),
    h('label', {}, 'KV pool pages (empty: default)', h('input', { name: 'pool_pages', type: 'number', min: 1 })),
    h('label', {}, 'Threads (empty: every core)', h('input', { name: 'threads', type: 'number', min: 1 })),
    h('button', { type: 'submit' }, 'Load model'), result);
  form.addEventListener('submit', async (event) => {
    event.preventDefault();
    const spec = { id: form.elements.id.value.trim(), path: form.elements.path.value.trim(), context_tokens: num(form, 'context_tokens') };
    for (const k of ['pool_pages', 'threads']) if (num(form, k) !== undefined) spec[k] = num(form, k);
    result.replaceChildren(h('p', { class: 'muted' }, 'Loading…'));
    try {
      await api('POST', `${A}/models`, spec, `load ${spec.id}`);
      notice(`Model ${spec.id} loaded and serving.`);
      render();
    } catch (e) { showError(result, e); }
  });
  slot.replaceChildren(h('h1', {}, 'Models'),
    table(['Id', 'Readiness', 'File', 'Context', 'Weights', 'KV pool', 'Source', ''], rows, { 'data-testid': 'models' }), form);
}

// ----------------------------------------------------------------- plugins

async function tenantPicker(current, base) {
  const tenants = await api('GET', `${A}/tenants`, undefined, 'list the tenants');
  const select = h('select', { name: 'tenant', 'data-testid': 'tenant-picker', onchange: (e) => { location.hash = route(base, e.target.value); } },
    h('option', { value: '' }, 'Choose a tenant…'),
    tenants.data.map((t) => h('option', { value: t.name, selected: t.name === current }, t.name)));
  return h('label', { class: 'picker' }, 'Tenant ', select);
}

function detailText(detail) {
  return Object.entries(detail || {}).map(([k, v]) => `${k}=${typeof v === 'string' ? v : JSON.stringify(v)}`).join(' ');
}

async function pluginsPage(slot, tenant) {
  const picker = await tenantPicker(tenant, 'plugins');
  if (!tenant) {
    slot.replaceChildren(h('h1', {}, 'Plugins'), picker);
    return;
  }
  const [plugins, events] = await settledInOrder([
    api('GET', `${A}/tenants/${enc(tenant)}/plugins`, undefined, `list the plugins of “${tenant}”`),
    api('GET', `${A}/audit?before=${NEWEST}&limit=20&tenant=${enc(tenant)}&action=plugin.`, undefined, 'read its plugin events'),
  ]);
  const act = (name, verb) => async () => {
    try {
      const method = verb === 'delete' ? 'DELETE' : 'POST';
      const path = `${A}/tenants/${enc(tenant)}/plugins/${enc(name)}` + (verb === 'delete' ? '' : `/${verb}`);
      await api(method, path, undefined, `${verb} the plugin ${name}`);
      notice(`Plugin ${name}: ${verb}d.`);
      render();
    } catch (e) { showError(document.getElementById('plugin-result'), e); }
  };
  const rows = plugins.data.map((p) => h('tr', { 'data-plugin': p.name },
    h('td', { class: 'num' }, p.order), h('td', {}, p.name), h('td', { class: 'num' }, p.version),
    h('td', {}, h('span', { class: p.unloadable ? 'badge bad' : p.enabled ? 'badge ok' : 'badge' }, p.unloadable ? 'fails closed' : p.enabled ? 'enabled' : 'disabled')),
    h('td', {}, p.unloadable || ''),
    h('td', { class: p.faults_recent ? 'warn num' : 'num', 'data-testid': 'faults' }, p.faults_recent, p.last_fault ? ` (last: ${p.last_fault})` : ''),
    h('td', { class: 'num' }, fmtBytes(p.size_bytes)), h('td', {}, h('code', { title: p.sha256 }, p.sha256.slice(0, 12))),
    h('td', {}, fmtTime(p.uploaded_ms)),
    h('td', { class: 'actions' },
      p.enabled ? h('button', { type: 'button', 'data-testid': `disable-${p.name}`, onclick: act(p.name, 'disable') }, 'Disable')
        : h('button', { type: 'button', 'data-testid': `enable-${p.name}`, onclick: act(p.name, 'enable') }, 'Enable'),
      ' ', h('button', { type: 'button', class: 'danger', onclick: act(p.name, 'delete') }, 'Delete'))));
  const eventRows = events.data.map((r) => h('tr', {},
    h('td', { class: 'when' }, fmtTime(r.at_ms)), h('td', {}, r.actor), h('td', {}, r.action), h('td', { class: 'detail' }, detailText(r.detail))));
  const result = h('div', { id: 'plugin-result' });
  const form = h('form', { class: 'card', 'data-testid': 'upload-plugin' },
    h('h2', {}, 'Upload a plugin'),
    h('p', { class: 'muted' }, 'A WebAssembly component built against the policy WIT; uploading under an existing name makes a new version.'),
    h('label', {}, 'Name', h('input', { name: 'name', required: true, autocomplete: 'off' })),
    h('label', {}, 'Component (.wasm)', h('input', { name: 'file', type: 'file', accept: '.wasm,application/wasm', required: true })),
    h('button', { type: 'submit' }, 'Upload'), result);
  form.addEventListener('submit', async (event) => {
    event.preventDefault();
    const name = form.elements.name.value.trim();
    const file = form.elements.file.files[0];
    if (!file) return;
    try {
      const bytes = await file.arrayBuffer();
      const view = await api('PUT', `${A}/tenants/${enc(tenant)}/plugins/${enc(name)}`, bytes, `upload the plugin ${name}`);
      notice(`Plugin ${view.name} version ${view.version} stored${view.enabled ? ' and enabled' : ''}.`);
      render();
    } catch (e) { showError(result, e); }
  });
  slot.replaceChildren(h('h1', {}, `Plugins of “${tenant}”`), picker,
    table(['Order', 'Name', 'Version', 'State', 'Why it fails', 'Recent faults', 'Size', 'SHA-256', 'Uploaded', ''], rows, { 'data-testid': 'plugins' }),
    form,
    section('Recent plugin events (faults, trips, disables)', eventRows.length
      ? table(['When', 'Who', 'What', 'Details'], eventRows, { 'data-testid': 'plugin-events' })
      : h('p', { class: 'muted' }, 'None kept.')));
}

// ------------------------------------------------------------------- usage

const WINDOWS = { hour: 3600e3, day: 86400e3, week: 7 * 86400e3 };

async function usagePage(slot, tenant, windowName) {
  const picker = await tenantPicker(tenant, 'usage');
  if (!tenant) {
    slot.replaceChildren(h('h1', {}, 'Usage'), picker);
    return;
  }
  const name = WINDOWS[windowName] ? windowName : 'hour';
  const span = WINDOWS[name];
  const from = Date.now() - span;
  const u = await api('GET', `${A}/usage?tenant=${enc(tenant)}&from_ms=${Math.floor(from)}`, undefined, `read the usage of “${tenant}”`);
  const bucketMs = Math.max(60e3, Math.ceil(span / 120 / 60e3) * 60e3);
  const values = new Array(Math.ceil((u.to_ms - u.from_ms) / bucketMs)).fill(0);
  for (const m of u.minutes) {
    const i = Math.floor((m.at_ms - u.from_ms) / bucketMs);
    if (i >= 0 && i < values.length) values[i] += m.prompt_tokens + m.completion_tokens;
  }
  const csv = () => {
    const outcomes = [...new Set(u.minutes.flatMap((m) => Object.keys(m.outcomes || {})))].sort();
    const lines = [['minute_utc', 'requests', 'prompt_tokens', 'completion_tokens', ...outcomes].join(',')];
    for (const m of u.minutes) {
      lines.push([new Date(m.at_ms).toISOString(), m.requests, m.prompt_tokens, m.completion_tokens,
        ...outcomes.map((o) => (m.outcomes || {})[o] || 0)].join(','));
    }
    const blob = new Blob([lines.join('\n') + '\n'], { type: 'text/csv' });
    const link = h('a', { href: URL.createObjectURL(blob), download: `usage-${tenant}-${name}.csv` });
    document.body.append(link);
    link.click();
    link.remove();
  };
  const windows = Object.keys(WINDOWS).map((w) => h('a', { href: route('usage', tenant, w), class: w === name ? 'current' : null }, `last ${w}`));
  const t = u.total;
  slot.replaceChildren(h('h1', {}, `Usage of “${tenant}”`), picker,
    h('p', {}, windows.flatMap((a) => [a, ' '])),
    table(['Requests', 'Prompt tokens', 'Completion tokens', 'Outcomes'], [h('tr', {},
      h('td', { class: 'num', 'data-testid': 'usage-requests' }, fmtInt(t.requests)),
      h('td', { class: 'num' }, fmtInt(t.prompt_tokens)),
      h('td', { class: 'num', 'data-testid': 'usage-completion' }, fmtInt(t.completion_tokens)),
      h('td', {}, detailText(t.outcomes)))], { 'data-testid': 'usage-total' }),
    barChart(`Tokens (prompt and completion) per ${bucketMs / 60e3} minute(s), ${fmtTime(u.from_ms)} to ${fmtTime(u.to_ms)}`, values, (v) => `${fmtInt(v)} tokens`, 'chart-usage'),
    h('button', { type: 'button', 'data-testid': 'csv', onclick: csv }, 'Download CSV (per minute)'));
}

// ------------------------------------------------------------------- audit

async function auditPage(slot, tenant, query) {
  const params = new URLSearchParams(query || '');
  const filters = { tenant: tenant || params.get('tenant') || '', action: params.get('action') || '', from: params.get('from') || '', to: params.get('to') || '' };
  const before = params.get('before') || NEWEST;
  const q = new URLSearchParams({ before, limit: '50' });
  if (filters.tenant) q.set('tenant', filters.tenant);
  if (filters.action) q.set('action', filters.action);
  if (filters.from) q.set('from_ms', String(Date.parse(filters.from + 'Z')));
  if (filters.to) q.set('to_ms', String(Date.parse(filters.to + 'Z')));
  const page = await api('GET', `${A}/audit?${q}`, undefined, 'read the audit log');
  const form = h('form', { class: 'card filters', 'data-testid': 'audit-filters' },
    h('label', {}, 'Tenant', h('input', { name: 'tenant', value: filters.tenant })),
    h('label', {}, 'Action starts with', h('input', { name: 'action', value: filters.action, placeholder: 'plugin.' })),
    h('label', {}, 'From (UTC)', h('input', { name: 'from', type: 'datetime-local', value: filters.from })),
    h('label', {}, 'To (UTC)', h('input', { name: 'to', type: 'datetime-local', value: filters.to })),
    h('button', { type: 'submit' }, 'Filter'));
  const link = (extra) => {
    const p = new URLSearchParams();
    for (const k of ['tenant', 'action', 'from', 'to']) if (filters[k]) p.set(k, filters[k]);
    for (const [k, v] of Object.entries(extra)) p.set(k, v);
    return '#/audit?' + p.toString();
  };
  form.addEventListener('submit', (event) => {
    event.preventDefault();
    for (const k of ['tenant', 'action', 'from', 'to']) filters[k] = form.elements[k].value.trim();
    location.hash = link({});
  });
  const rows = page.data.map((r) => h('tr', {},
    h('td', { class: 'num' }, r.seq), h('td', { class: 'when' }, fmtTime(r.at_ms)), h('td', {}, r.actor),
    h('td', {}, r.action), h('td', {}, r.target), h('td', { class: 'detail' }, detailText(r.detail))));
  // Older pages are links; newer is the way back through them.
  const paged = before !== NEWEST;
  const nav = h('p', { class: 'paging' },
    paged ? h('a', { href: link({}) }, 'Newest') : '', ' ',
    paged ? h('button', { type: 'button', onclick: () => history.back() }, '← Newer') : '', ' ',
    page.next_before !== undefined && page.data.length ? h('a', { href: link({ before: String(page.next_before) }), 'data-testid': 'older' }, 'Older →') : '');
  slot.replaceChildren(h('h1', {}, 'Audit log'), form,
    rows.length ? table(['#', 'When', 'Who', 'What', 'On', 'Details'], rows, { 'data-testid': 'audit' }) : h('p', { class: 'muted' }, 'No records match.'),
    nav);
}

// ------------------------------------------------------------------ router

async function render() {
  clearInterval(timer);
  timer = null;
  const mine = ++generation;
  const signedIn = !!token();
  document.getElementById('nav').hidden = !signedIn;
  document.getElementById('sign-out').hidden = !signedIn;
  if (!signedIn) {
    signInPage();
    return;
  }
  const raw = location.hash.replace(/^#\/?/, '');
  const cut = raw.indexOf('?');
  const query = cut < 0 ? '' : raw.slice(cut + 1);
  let parts;
  try {
    parts = (cut < 0 ? raw : raw.slice(0, cut) || 'overview').split('/').map(decodeURIComponent);
  } catch (_) {
    parts = ['?'];
  }
  if (!parts[0]) parts[0] = 'overview';
  for (const a of document.querySelectorAll('#nav a')) {
    a.classList.toggle('current', a.getAttribute('href') === '#/' + parts[0]);
  }
  const slot = h('div', { class: 'page' });
  const show = async () => {
    switch (parts[0]) {
      case 'overview': return overviewPage(slot);
      case 'tenants': return parts[1] ? tenantPage(slot, parts[1]) : tenantsPage(slot);
      case 'capacity': return capacityPage(slot);
      case 'models': return modelsPage(slot);
      case 'plugins': return pluginsPage(slot, parts[1]);
      case 'usage': return usagePage(slot, parts[1], parts[2]);
      case 'audit': return auditPage(slot, parts[1], query);
      default: slot.replaceChildren(errorBox(new ConsoleError(`There is no page “${parts[0]}”. Pick one from the menu.`)));
    }
  };
  try {
    await show();
  } catch (e) {
    if (!token()) { signInPage(e.message); return; }
    slot.replaceChildren(errorBox(e));
  }
  if (mine !== generation) return;
  main().replaceChildren(slot);
  if (parts[0] === 'overview') {
    timer = setInterval(async () => {
      if (mine !== generation) return;
      const next = h('div', { class: 'page' });
      try {
        await overviewPage(next);
      } catch (e) {
        if (!token()) { render(); return; }
        next.replaceChildren(errorBox(e));
      }
      if (mine === generation) main().replaceChildren(next);
    }, REFRESH_MS);
  }
}

window.addEventListener('hashchange', () => {
  if (noticeKept) noticeKept = false;
  else notice('');
  render();
});
document.addEventListener('DOMContentLoaded', () => {
  document.getElementById('sign-out').addEventListener('click', () => { signOut(); notice('Signed out.'); render(); });
  render();
});
