// The official `openai` npm SDK against Fluxion's OpenAI-compatible HTTP API (docs/PROTOCOL.md),
// unchanged: completions and chat, streaming and not, a stop string, a cancelled stream and an
// aborted whole completion whose KV pages come back, a bad field -> 400, a request beyond the
// context -> 400 context_length_exceeded, overload -> 429 and 503. Run by tests/openai_e2e_test.cc,
// which starts the processes and passes their addresses:
//   FLUXION_HTTP        the router's HTTP API, e.g. http://127.0.0.1:8000/v1
//   FLUXION_SHED_HTTP   a router that sheds every request (RESOURCE_EXHAUSTED -> 429)
//   FLUXION_DOWN_HTTP   a router with no healthy decode node (UNAVAILABLE -> 503)
//   FLUXION_DECODE_METRICS  the decode node's /metrics URL
//   FLUXION_MODEL       the served model name
//   FLUXION_API_KEY_E2E the key FLUXION_HTTP's router requires (--api-key)
//   FLUXION_CHAT        "1" when the router has a chat template
// Exits 0 when every check passed; prints each failure.
import assert from 'node:assert/strict';
import http from 'node:http';
import OpenAI from 'openai';
import { check, env, runChecks } from './checks.mjs';
const model = env('FLUXION_MODEL');
// The serving router requires this key (--api-key); the SDK sends it as a bearer token.
const apiKey = env('FLUXION_API_KEY_E2E');
const auth = { authorization: `Bearer ${apiKey}` };
const client = new OpenAI({ baseURL: env('FLUXION_HTTP'), apiKey, maxRetries: 0,
                            timeout: 30000 });
const prompt = 'The key is 42. Remember the key. The key is';

async function metric(series) {
  const text = await (await fetch(env('FLUXION_DECODE_METRICS'))).text();
  for (const line of text.split('\n')) {
    if (line.startsWith(series + ' ')) return Number(line.slice(series.length + 1));
  }
  return 0;  // a labelled counter not yet incremented is absent
}

async function streamText(params) {
  const stream = await client.completions.create({ ...params, stream: true,
                                                    stream_options: { include_usage: true } });
  let text = '', finish = null, usage = null;
  for await (const chunk of stream) {
    if (chunk.usage) usage = chunk.usage;
    for (const c of chunk.choices) {
      text += c.text;
      if (c.finish_reason) finish = c.finish_reason;
    }
  }
  return { text, finish, usage };
}

let greedy;  // the greedy answer of `prompt`, 48 tokens, reused by later checks
check('models lists the served model', async () => {
  const models = await client.models.list();
  assert.deepEqual(models.data.map((m) => m.id), [model]);
});

check('completion, not streamed', async () => {
  const r = await client.completions.create({ model, prompt, max_tokens: 48, temperature: 0 });
  assert.equal(r.object, 'text_completion');
  assert.equal(r.choices.length, 1);
  // 48 tokens of the byte-level model without EOS: the cancelled-stream check relies on it.
  assert.equal(r.choices[0].finish_reason, 'length', 'pick a prompt the tiny model does not end');
  assert.equal(r.usage.completion_tokens, 48);
  assert.equal(r.usage.prompt_tokens, Buffer.byteLength(prompt));
  greedy = r.choices[0].text;
  assert.ok(greedy.length > 8, `answer too short: ${JSON.stringify(greedy)}`);
});

check('completion, streamed, equals the whole one', async () => {
  const s = await streamText({ model, prompt, max_tokens: 48, temperature: 0 });
  assert.equal(s.text, greedy);
  assert.equal(s.finish, 'length');
  assert.equal(s.usage.completion_tokens, 48);
});

check('prompt as token ids', async () => {
  const ids = [...Buffer.from(prompt)];
  const r = await client.completions.create({ model, prompt: ids, max_tokens: 48, temperature: 0 });
  assert.equal(r.choices[0].text, greedy);
});

check('stop string: the text before it, nothing after, both modes', async () => {
  const stop = greedy.slice(4, 7);
  const want = greedy.slice(0, greedy.indexOf(stop));
  const r = await client.completions.create({ model, prompt, max_tokens: 48, temperature: 0, stop });
  assert.equal(r.choices[0].text, want);
  assert.equal(r.choices[0].finish_reason, 'stop');
  const s = await streamText({ model, prompt, max_tokens: 48, temperature: 0, stop: [stop] });
  assert.equal(s.text, want);
  assert.equal(s.finish, 'stop');
});

check('n and a list of prompts: one choice each, in vLLM\'s order, usage counting each prompt once',
      async () => {
  const r = await client.completions.create({ model, prompt, max_tokens: 48, temperature: 0,
                                              n: 3 });
  assert.deepEqual(r.choices.map((c) => c.index), [0, 1, 2]);
  for (const c of r.choices) assert.equal(c.text, greedy);
  assert.equal(r.usage.prompt_tokens, Buffer.byteLength(prompt));
  assert.equal(r.usage.completion_tokens, 3 * 48);
  const other = 'The river flows to the sea. The river';
  const list = await client.completions.create({ model, prompt: [prompt, other], max_tokens: 8,
                                                 temperature: 0, n: 2 });
  assert.equal(list.choices.length, 4);
  assert.equal(list.choices[0].text, greedy.slice(0, list.choices[0].text.length));
  assert.equal(list.choices[1].text, list.choices[0].text);
  assert.equal(list.choices[2].text, list.choices[3].text);
  assert.equal(list.usage.prompt_tokens,
               Buffer.byteLength(prompt) + Buffer.byteLength(other));
  // Streamed: every choice's chunks carry its index; the texts equal the whole answer's.
  const s = await client.completions.create({ model, prompt: [prompt, other], max_tokens: 8,
                                              temperature: 0, n: 2, stream: true,
                                              stream_options: { include_usage: true } });
  const texts = ['', '', '', ''], finished = [];
  let usage = null;
  for await (const chunk of s) {
    if (chunk.usage) usage = chunk.usage;
    for (const c of chunk.choices) {
      texts[c.index] += c.text;
      if (c.finish_reason) finished.push(c.index);
    }
  }
  assert.deepEqual(texts, list.choices.map((c) => c.text));
  assert.deepEqual(finished.sort(), [0, 1, 2, 3]);
  assert.equal(usage.completion_tokens, list.usage.completion_tokens);
  // Seeded sampling stays reproducible with n > 1.
  const seeded = () => client.completions.create({ model, prompt, max_tokens: 8, n: 2, seed: 5 });
  const [a, b] = [await seeded(), await seeded()];
  assert.deepEqual(a.choices.map((c) => c.text), b.choices.map((c) => c.text));
});

check('stop_reason names the stop string; include_stop_str_in_output keeps it', async () => {
  const stop = greedy.slice(4, 7);
  const before = greedy.slice(0, greedy.indexOf(stop));
  const r = await client.completions.create({ model, prompt, max_tokens: 48, temperature: 0, stop,
                                              include_stop_str_in_output: true });
  assert.equal(r.choices[0].text, before + stop);
  assert.equal(r.choices[0].stop_reason, stop);
  const s = await client.completions.create({ model, prompt, max_tokens: 48, temperature: 0,
                                              stream: true, stop: [stop] });
  let reason;
  for await (const chunk of s) for (const c of chunk.choices) if (c.finish_reason) reason = c;
  assert.equal(reason.stop_reason, stop);
  const length = await client.completions.create({ model, prompt, max_tokens: 4, ignore_eos: true });
  assert.equal(length.choices[0].stop_reason, null);
  assert.equal(length.usage.completion_tokens, 4);
});

check('the fluxion field picks the attention policy, and the answer names it', async () => {
  const byDefault = await client.completions.create({ model, prompt, max_tokens: 8,
                                                      temperature: 0 });
  assert.match(byDefault.fluxion.policy, /^fluxion@/);  // the decode node's default
  assert.ok(byDefault.fluxion.read_fraction > 0 && byDefault.fluxion.read_fraction <= 1);
  const full = await client.completions.create({ model, prompt, max_tokens: 8, temperature: 0,
                                                 fluxion: { policy: 'full' } });
  assert.equal(full.fluxion.policy, 'full');
  assert.equal(full.fluxion.read_fraction, 1);  // full attention reads every row
  const lfps = await client.completions.create({ model, prompt, max_tokens: 8, temperature: 0,
                                                 fluxion: { policy: 'lfps', budget: 0.5 } });
  assert.equal(lfps.fluxion.policy, 'lfps@0.5');
  await assert.rejects(
    client.completions.create({ model, prompt, max_tokens: 4, fluxion: { policy: 'nope' } }),
    (e) => e.status === 400 && /nope/.test(e.message));
});

check('/tokenize counts as a completion does; /detokenize inverts it; both need the key',
      async () => {
  const root = env('FLUXION_HTTP').replace(/\/v1$/, '');
  const post = (path, body, headers = auth) => fetch(root + path, {
    method: 'POST', headers: { 'content-type': 'application/json', ...headers },
    body: JSON.stringify(body) });
  const t = await (await post('/tokenize', { model, prompt })).json();
  assert.equal(t.count, Buffer.byteLength(prompt));  // the byte-level model: a token per byte
  const done = await client.completions.create({ model, prompt, max_tokens: 1 });
  assert.equal(t.count, done.usage.prompt_tokens);
  const d = await (await post('/detokenize', { model, tokens: t.tokens })).json();
  assert.equal(d.prompt, prompt);
  assert.equal((await post('/tokenize', { model, prompt }, {})).status, 401);
  const bad = await post('/tokenize', { model, prompt, add_special_tokens: true });
  assert.equal(bad.status, 400);
  assert.equal((await bad.json()).error.param, 'add_special_tokens');
});

check('a bad field is 400 naming it', async () => {
  await assert.rejects(
    client.completions.create({ model, prompt, max_tokens: 4, bogus_field: 1 }),
    (e) => e instanceof OpenAI.BadRequestError && e.status === 400 && e.param === 'bogus_field');
  await assert.rejects(client.completions.create({ model, prompt, max_tokens: 4, logprobs: 21 }),
                       (e) => e.status === 400 && e.param === 'logprobs');
  await assert.rejects(client.completions.create({ model: 'nope', prompt, max_tokens: 4 }),
                       (e) => e instanceof OpenAI.NotFoundError);
});

// logprobs of the generated tokens: the greedy one is each position's most likely; streamed
// entries equal the whole answer's. Then lm-eval's loglikelihood request (its local-completions
// backend): token ids, echo, logprobs 1, one generated token, the continuation's numbers read
// from the echoed positions; they equal what generation reported for those tokens. `full`
// attention, so that both read the same context.
check('logprobs: generated tokens, streamed, and echoed prompts as lm-eval reads them', async () => {
  const full = { policy: 'full' };
  const r = await client.completions.create({ model, prompt, max_tokens: 4, temperature: 0,
                                              logprobs: 3, fluxion: full });
  const text = r.choices[0].text, lp = r.choices[0].logprobs;
  assert.ok(/^[\x20-\x7e]{4}$/.test(text), `4 printable bytes expected: ${JSON.stringify(text)}`);
  assert.deepEqual(lp.tokens, [...text]);
  assert.deepEqual(lp.text_offset, [0, 1, 2, 3]);
  for (let i = 0; i < 4; ++i) {
    const alternatives = Object.values(lp.top_logprobs[i]);
    assert.ok(alternatives.length >= 3 && alternatives.length <= 4);
    assert.ok(lp.token_logprobs[i] <= 0);
    assert.equal(lp.token_logprobs[i], Math.max(...alternatives), 'greedy: the top token');
    assert.equal(lp.top_logprobs[i][lp.tokens[i]], lp.token_logprobs[i]);
  }
  const stream = await client.completions.create({ model, prompt, max_tokens: 4, temperature: 0,
                                                   logprobs: 3, fluxion: full, stream: true });
  const streamed = [];
  for await (const chunk of stream) {
    for (const c of chunk.choices) if (c.logprobs) streamed.push(...c.logprobs.token_logprobs);
  }
  assert.deepEqual(streamed, lp.token_logprobs);

  const ids = [...Buffer.from(prompt)], cont = [...Buffer.from(text.slice(0, 2))];
  const e = await client.completions.create({ model, prompt: ids.concat(cont), max_tokens: 1,
                                              temperature: 0, logprobs: 1, echo: true,
                                              fluxion: full });
  const el = e.choices[0].logprobs;
  assert.ok(e.choices[0].text.startsWith(prompt + text.slice(0, 2)));
  assert.equal(el.tokens.length, ids.length + 3);
  assert.equal(el.token_logprobs[0], null);
  assert.equal(el.top_logprobs[0], null);
  // The first continuation token's number comes from the prefill node both times (the last
  // prompt row, then an echoed row); the second's from a decode step over bf16 pages, then from
  // the prefill's fp32 forward.
  assert.ok(Math.abs(el.token_logprobs[ids.length] - lp.token_logprobs[0]) < 1e-3,
            `${el.token_logprobs[ids.length]} vs ${lp.token_logprobs[0]}`);
  assert.ok(Math.abs(el.token_logprobs[ids.length + 1] - lp.token_logprobs[1]) < 0.05,
            `${el.token_logprobs[ids.length + 1]} vs ${lp.token_logprobs[1]}`);
  // lm-eval's is_greedy: each continuation token's logprob is the largest of its position's.
  for (const k of [ids.length, ids.length + 1]) {
    assert.equal(el.token_logprobs[k], Math.max(...Object.values(el.top_logprobs[k])));
  }
});

// Penalties change what greedy decoding picks, the same way each time; min_tokens holds a stop
// token back, on the prefill node's first draw too (the byte model: the first greedy token is
// the answer's first byte).
check('penalties and min_tokens', async () => {
  const base = { model, prompt, max_tokens: 48, temperature: 0 };
  for (const penalty of [{ repetition_penalty: 1.5 }, { frequency_penalty: 2 },
                         { presence_penalty: 2 }]) {
    const a = await client.completions.create({ ...base, ...penalty });
    const b = await client.completions.create({ ...base, ...penalty });
    assert.notEqual(a.choices[0].text, greedy, JSON.stringify(penalty));
    assert.equal(a.choices[0].text, b.choices[0].text, JSON.stringify(penalty));
  }
  const first = Buffer.from(greedy)[0];
  const stopped = await client.completions.create({ ...base, max_tokens: 8,
                                                    stop_token_ids: [first] });
  assert.equal(stopped.usage.completion_tokens, 1);
  assert.equal(stopped.choices[0].finish_reason, 'stop');
  const held = await client.completions.create({ ...base, max_tokens: 8, stop_token_ids: [first],
                                                 min_tokens: 3 });
  assert.ok(held.usage.completion_tokens >= 3, `${held.usage.completion_tokens} tokens`);
  assert.notEqual(Buffer.from(held.choices[0].text)[0], first);
  await assert.rejects(client.completions.create({ ...base, presence_penalty: 3 }),
                       (e) => e.status === 400 && e.param === 'presence_penalty');
});

// The context check in the words clients match (OpenAI's, e.g. LangChain's and LiteLLM's
// "maximum context length" handling), with its code and field, naming no internal address.
check('a request beyond the context is 400 context_length_exceeded in OpenAI\'s words', async () => {
  await assert.rejects(
    client.completions.create({ model, prompt, max_tokens: 1000000 }),
    (e) => e instanceof OpenAI.BadRequestError && e.code === 'context_length_exceeded' &&
           e.param === 'prompt' &&
           /^This model's maximum context length is \d+ tokens\. However, you requested \d+ tokens \(\d+ in the prompt, 1000000 in the completion\)/.test(e.error.message) &&
           !/\d+\.\d+\.\d+\.\d+:\d+/.test(e.error.message));
});

// The status a server answers to a POST whose headers declare `bytes` of body and ask
// `Expect: 100-continue`, with no body ever sent; rejects if the server asks for the body.
function statusOfHeadersOnly(url, bytes) {
  return new Promise((resolve, reject) => {
    const u = new URL(url);
    let settled = false;
    const settle = (f, v) => { if (!settled) { settled = true; f(v); } req.destroy(); };
    const req = http.request({ host: u.hostname, port: u.port, path: u.pathname, method: 'POST',
                               headers: { 'content-type': 'application/json',
                                          'content-length': String(bytes),
                                          expect: '100-continue', ...auth } });
    req.on('response', (res) => { res.resume(); settle(resolve, res.statusCode); });
    req.on('continue', () => settle(reject, new Error('the server asked for the body')));
    req.on('error', (e) => settle(reject, e));
    req.setTimeout(60000, () => settle(reject, new Error('no answer within 60 s')));
    req.flushHeaders();
  });
}

check('HTTP-level refusals: bad JSON, bad UTF-8, too large, unknown path, wrong method',
      async () => {
  const base = env('FLUXION_HTTP');  // ends in /v1
  const post = (path, body) => fetch(base + path, { method: 'POST', body,
                                                    headers: { 'content-type': 'application/json',
                                                               ...auth } });
  const bad = await post('/completions', '{"model":');
  assert.equal(bad.status, 400);
  assert.equal((await bad.json()).error.type, 'invalid_request_error');
  const utf8 = await post('/completions',
                          Buffer.concat([Buffer.from(`{"model":"${model}","prompt":"`),
                                         Buffer.from([0xff, 0xfe]), Buffer.from('"}')]));
  assert.equal(utf8.status, 400);
  // Too large: the server answers 413 from the declared Content-Length, before any body. A
  // client that streams the body anyway races the server's close (fetch then fails with a reset
  // about one run in ten on a loaded box), so this one sends the headers with
  // `Expect: 100-continue` and waits, as a careful client does.
  assert.equal(await statusOfHeadersOnly(base + '/completions', 2 << 20), 413);
  assert.equal((await fetch(base + '/nothing', { headers: auth })).status, 404);
  assert.equal((await fetch(base + '/completions', { headers: auth })).status, 405);
  const health = await fetch(base.replace(/\/v1$/, '') + '/health');
  assert.equal(health.status, 200);
});

check('--api-key: a wrong or missing key is 401 invalid_api_key; probes need none', async () => {
  const wrong = new OpenAI({ baseURL: env('FLUXION_HTTP'), apiKey: 'not-the-key', maxRetries: 0 });
  await assert.rejects(wrong.completions.create({ model, prompt, max_tokens: 4 }),
                       (e) => e instanceof OpenAI.AuthenticationError && e.status === 401 &&
                              e.code === 'invalid_api_key');
  await assert.rejects(wrong.models.list(), (e) => e instanceof OpenAI.AuthenticationError);
  const base = env('FLUXION_HTTP');
  assert.equal((await fetch(base + '/models')).status, 401);
  assert.equal((await fetch(base.replace(/\/v1$/, '') + '/health')).status, 200);
  assert.equal((await fetch(base.replace(/\/v1$/, '') + '/version')).status, 200);
});

check('X-Request-Id: the client\'s is echoed and names the completion; without, ours', async () => {
  const mine = await client.completions
    .create({ model, prompt, max_tokens: 2, temperature: 0 }, { headers: { 'X-Request-Id': 'e2e-req.1' } })
    .withResponse();
  assert.equal(mine.response.headers.get('x-request-id'), 'e2e-req.1');
  assert.match(mine.data.id, /^cmpl-e2e-req\.1-\d+$/);
  const ours = await client.completions.create({ model, prompt, max_tokens: 2 }).withResponse();
  assert.equal(ours.response.headers.get('x-request-id'), ours.data.id);
  const streamed = await client.completions
    .create({ model, prompt, max_tokens: 2, stream: true }, { headers: { 'X-Request-Id': 'e2e-stream' } })
    .withResponse();
  assert.equal(streamed.response.headers.get('x-request-id'), 'e2e-stream');
  for await (const _ of streamed.data) { /* drain */ }
  await assert.rejects(
    client.completions.create({ model, prompt, max_tokens: 2 },
                              { headers: { 'X-Request-Id': 'not ok: spaces' } }),
    (e) => e instanceof OpenAI.BadRequestError && /X-Request-Id/.test(e.error.message));
});

check('GET /version names the build (vLLM\'s shape)', async () => {
  const res = await fetch(env('FLUXION_HTTP').replace(/\/v1$/, '') + '/version');
  assert.equal(res.status, 200);
  assert.match((await res.json()).version, /^\d+\.\d+\.\d+(\+[0-9a-f]+)?$/);
});

check('overload: 429 and 503 with Retry-After', async () => {
  const shed = new OpenAI({ baseURL: env('FLUXION_SHED_HTTP'), apiKey: 'x', maxRetries: 0 });
  await assert.rejects(shed.completions.create({ model, prompt, max_tokens: 4 }),
                       (e) => e instanceof OpenAI.RateLimitError &&
                              e.headers.get('retry-after') === '1');
  const down = new OpenAI({ baseURL: env('FLUXION_DOWN_HTTP'), apiKey: 'x', maxRetries: 0 });
  await assert.rejects(down.completions.create({ model, prompt, max_tokens: 4, stream: true }),
                       (e) => e instanceof OpenAI.InternalServerError && e.status === 503 &&
                              e.headers.get('retry-after') === '1');
});

check('a cancelled stream ends on the decode node and its pages come back', async () => {
  const total = await metric('fluxion_kv_pages_capacity');
  const naturalEnds = async () => (await metric('fluxion_decode_finished_total{reason="stop"}')) +
                                  (await metric('fluxion_decode_finished_total{reason="length"}'));
  const endedBefore = await naturalEnds();
  const stream = await client.completions.create({ model, prompt, max_tokens: 20000,
                                                   temperature: 0, stream: true });
  let chunks = 0;
  for await (const chunk of stream) {
    if (++chunks === 2) break;  // leaving the loop aborts the HTTP request
  }
  // Bounded (generously) wait for the cancellation to travel router -> decode node; whether it
  // was the cancellation that freed the pages is checked below, not by how fast they came back.
  const deadline = Date.now() + 60000;
  while (await metric('fluxion_kv_pages_free') !== total && Date.now() < deadline) {
    await new Promise((r) => setTimeout(r, 50));
  }
  assert.equal(await metric('fluxion_kv_pages_free'), total, 'pages still held');
  assert.equal(await naturalEnds(), endedBefore,
               'the request ended by itself (stop/length), not by the cancellation');
});

check('an aborted whole completion ends on the decode node and its pages come back', async () => {
  // Not streamed: the connection waits for the whole answer with nothing to send, so only the
  // router's hang-up watcher can notice the client going away.
  const total = await metric('fluxion_kv_pages_capacity');
  const naturalEnds = async () => (await metric('fluxion_decode_finished_total{reason="stop"}')) +
                                  (await metric('fluxion_decode_finished_total{reason="length"}'));
  const endedBefore = await naturalEnds();
  const abort = new AbortController();
  const answer = client.completions.create({ model, prompt, max_tokens: 20000, temperature: 0 },
                                           { signal: abort.signal });
  const deadline = Date.now() + 20000;
  while (await metric('fluxion_decode_requests_running') < 1 && Date.now() < deadline) {
    await new Promise((r) => setTimeout(r, 20));
  }
  assert.equal(await metric('fluxion_decode_requests_running'), 1, 'the request never ran');
  abort.abort();
  await assert.rejects(answer, (e) => e instanceof OpenAI.APIUserAbortError);
  while (await metric('fluxion_kv_pages_free') !== total && Date.now() < deadline) {
    await new Promise((r) => setTimeout(r, 50));
  }
  assert.equal(await metric('fluxion_kv_pages_free'), total, 'pages still held');
  assert.equal(await naturalEnds(), endedBefore,
               'the request ended by itself (stop/length), not by the cancellation');
});

if (process.env.FLUXION_CHAT === '1') {
  const messages = [{ role: 'user', content: 'What is the key? The key is 42.' }];
  check('chat, not streamed and streamed', async () => {
    const r = await client.chat.completions.create({ model, messages, max_completion_tokens: 24,
                                                     temperature: 0 });
    assert.equal(r.object, 'chat.completion');
    assert.equal(r.choices[0].message.role, 'assistant');
    const whole = r.choices[0].message.content;
    const stream = await client.chat.completions.create({ model, messages, max_tokens: 24,
                                                          temperature: 0, stream: true });
    let text = '', role = null;
    for await (const chunk of stream) {
      for (const c of chunk.choices) {
        if (c.delta.role) role = c.delta.role;
        text += c.delta.content ?? '';
      }
    }
    assert.equal(role, 'assistant');
    assert.equal(text, whole);
  });
  check('chat: logprobs with top_logprobs, whole and streamed alike', async () => {
    const params = { model, messages, max_tokens: 6, temperature: 0, logprobs: true,
                     top_logprobs: 2 };
    const r = await client.chat.completions.create(params);
    const content = r.choices[0].logprobs.content;
    assert.equal(content.length, r.usage.completion_tokens);
    for (const c of content) {
      assert.equal(c.top_logprobs.length, 2);
      assert.ok(c.logprob <= 0);
      assert.equal(c.logprob, c.top_logprobs[0].logprob, 'greedy: the top token');
      assert.deepEqual(c.bytes, c.top_logprobs[0].bytes);
      assert.ok(Array.isArray(c.bytes) && c.bytes.length >= 1);
    }
    const stream = await client.chat.completions.create({ ...params, stream: true });
    const streamed = [];
    for await (const chunk of stream) {
      for (const c of chunk.choices) if (c.logprobs) streamed.push(...c.logprobs.content);
    }
    assert.deepEqual(streamed, content);
  });
  check('chat: a developer message and a named user message', async () => {
    const r = await client.chat.completions.create({
      model, max_completion_tokens: 4, temperature: 0,
      messages: [{ role: 'developer', content: 'Answer briefly.' },
                 { role: 'user', name: 'ann', content: 'What is the key? The key is 42.' }] });
    assert.equal(r.choices[0].message.role, 'assistant');
    assert.equal(r.usage.completion_tokens, 4);
  });
}

await runChecks();
