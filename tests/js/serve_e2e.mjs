// The official `openai` npm SDK against `fluxion serve` (docs/CLUSTER.md, "fluxion serve"): the
// flags a vLLM user passes take effect. Run by tests/cluster_serve_test.cc, which starts
// `fluxion serve` and passes:
//   FLUXION_HTTP          the API's base URL, e.g. http://127.0.0.1:8000/v1
//   FLUXION_MODEL         --served-model-name
//   FLUXION_API_KEY_E2E   --api-key
//   FLUXION_MAX_MODEL_LEN --max-model-len
// Exits 0 when every check passed; prints each failure.
import assert from 'node:assert/strict';
import OpenAI from 'openai';
import { check, env, runChecks } from './checks.mjs';
const base = env('FLUXION_HTTP');
const model = env('FLUXION_MODEL');
const apiKey = env('FLUXION_API_KEY_E2E');
const maxModelLen = Number(env('FLUXION_MAX_MODEL_LEN'));
const client = new OpenAI({ baseURL: base, apiKey, maxRetries: 0, timeout: 30000 });

// First: after a node was restarted the router takes it back on its next health checks, so the
// first completion may wait for that (bounded: 60 s).
check('a completion is served (waiting for a restarted node at most 60 s)', async () => {
  const deadline = Date.now() + 60000;
  for (;;) {
    try {
      const r = await client.completions.create({ model, prompt: 'The key is', max_tokens: 8,
                                                  temperature: 0 });
      assert.equal(r.model, model);
      assert.equal(r.usage.completion_tokens, 8);
      return;
    } catch (e) {
      if (Date.now() > deadline || e.status === 400 || e.status === 401) throw e;
      await new Promise((resolve) => setTimeout(resolve, 500));
    }
  }
});

check('--served-model-name is the one model listed, with --max-model-len', async () => {
  const models = await client.models.list();
  assert.deepEqual(models.data.map((m) => m.id), [model]);
  assert.equal(models.data[0].max_model_len, maxModelLen);  // vLLM's field
});

check('--api-key: a wrong key gets 401', async () => {
  const wrong = new OpenAI({ baseURL: base, apiKey: 'not-the-key', maxRetries: 0 });
  await assert.rejects(wrong.models.list(), (e) => e.status === 401);
});

check('--max-model-len bounds prompt plus max_tokens (400 context_length_exceeded)', async () => {
  await assert.rejects(
    client.completions.create({ model, prompt: 'The key is', max_tokens: maxModelLen }),
    (e) => e.status === 400 && e.code === 'context_length_exceeded' &&
      e.message.includes(`maximum context length is ${maxModelLen} tokens`));
});

check('/version answers without the key', async () => {
  const res = await fetch(base.replace(/\/v1$/, '') + '/version');
  assert.equal(res.status, 200);
  assert.match((await res.json()).version, /^\d+\.\d+\.\d+/);
});

await runChecks();
