// A VllmEngine client as SMG-style gateways are: the real @grpc/grpc-js and @grpc/proto-loader
// loading our committed proto/vllm/grpc/engine/vllm_engine.proto, against the Fluxion router.
// Driven by tests/vllm_engine_e2e_test.cc:
//   node vllm_engine_client.cjs ROUTER_ADDRESS PROTO_ROOT BARE_ROUTER_ADDRESS
// (the bare router runs without --model-dir).
// Prints one line per check and exits non-zero on the first failure.
'use strict';
const assert = require('node:assert/strict');
const grpc = require('@grpc/grpc-js');
const protoLoader = require('@grpc/proto-loader');

const [address, protoRoot, bareAddress] = process.argv.slice(2);
const definition = protoLoader.loadSync('vllm/grpc/engine/vllm_engine.proto', {
  includeDirs: [protoRoot], keepCase: true, longs: String, enums: String, defaults: true,
  oneofs: true,
});
const { VllmEngine } = grpc.loadPackageDefinition(definition).vllm.grpc.engine;
const client = new VllmEngine(address, grpc.credentials.createInsecure());
const bare = new VllmEngine(bareAddress, grpc.credentials.createInsecure());

const deadline = (s) => new Date(Date.now() + s * 1000);
const unary = (method, request) => new Promise((resolve, reject) => {
  client[method](request, { deadline: deadline(30) },
    (err, res) => (err ? reject(err) : resolve(res)));
});

// Reads a Generate stream to its end: chunks, the complete message and the final status.
// `onChunk(call, chunk, index)` may act mid-stream.
function generate(request, onChunk, on = client) {
  return new Promise((resolve) => {
    const call = on.Generate(request, { deadline: deadline(60) });
    const result = { chunks: [], complete: null, status: null };
    call.on('data', (msg) => {
      if (msg.response === 'chunk') {
        result.chunks.push(msg.chunk);
        if (onChunk) onChunk(call, msg.chunk, result.chunks.length - 1);
      } else if (msg.response === 'complete') {
        result.complete = msg.complete;
      }
    });
    call.on('error', (err) => { result.status = err; });
    call.on('status', (st) => { if (!result.status) result.status = st; });
    call.on('end', () => setImmediate(() => resolve(result)));
  });
}

const prompt = Array.from({ length: 48 }, (_, i) => 32 + ((i * 7) % 90));
const greedy = (id, maxTokens, extra = {}) => ({
  request_id: id,
  tokenized: { input_ids: prompt },
  sampling_params: { temperature: 0, max_tokens: maxTokens, ignore_eos: true,
                     // What SMG's client always sends (crates/grpc_client/src/vllm_engine.rs).
                     top_p: 1, repetition_penalty: 1, n: 1, skip_special_tokens: true,
                     spaces_between_special_tokens: true },
  ...extra,
});

// Conditions are polled with a generous deadline: reaching it means the condition never held,
// not that the machine was busy.
const kGenerousMs = 60000;

async function waitIdle() {
  const end = Date.now() + kGenerousMs;
  for (;;) {
    const loads = await unary('GetLoads', {});
    const l = loads.loads[0];
    if (l.num_running_reqs === 0 && l.num_waiting_reqs === 0 && l.num_used_tokens === 0) return l;
    if (Date.now() > end) throw new Error(`router did not become idle within ${kGenerousMs} ms`);
    await new Promise((r) => setTimeout(r, 50));
  }
}

async function main() {
  // HealthCheck: a gateway's backend detection. Healthy once the router sees a decode node.
  let health;
  const healthyBy = Date.now() + kGenerousMs;
  for (;;) {
    health = await unary('HealthCheck', {});
    if (health.healthy || Date.now() > healthyBy) break;
    await new Promise((r) => setTimeout(r, 100));
  }
  assert.equal(health.healthy, true, `HealthCheck: ${JSON.stringify(health)}`);
  console.log('ok HealthCheck', JSON.stringify(health));

  const info = await unary('GetModelInfo', {});
  assert.ok(info.max_context_length > prompt.length, JSON.stringify(info));
  assert.equal(info.is_generation, true);
  assert.equal(info.vocab_size, 264);  // the byte tokenizer of models/fluxion-tiny-retrieval
  assert.equal(info.served_model_name, 'fluxion-tiny-retrieval');  // as GET /v1/models lists it
  assert.equal(info.pad_token_id, 258);  // config.json's
  console.log('ok GetModelInfo', info.max_context_length, info.model_type, info.architectures);

  const server = await unary('GetServerInfo', {});
  assert.equal(server.server_type, 'fluxion-router');
  assert.equal(server.data_parallel_size, 1);
  console.log('ok GetServerInfo', server.block_size, server.kv_cache_dtype);

  // Streaming Generate from token ids: chunks carry their own tokens, complete the totals.
  const streamed = await generate({ ...greedy('js-stream', 12), stream: true });
  assert.equal(streamed.status.code, grpc.status.OK, JSON.stringify(streamed.status));
  const ids = streamed.chunks.flatMap((c) => c.token_ids);
  assert.equal(ids.length, 12);
  for (const c of streamed.chunks) {
    assert.equal(c.completion_tokens, c.token_ids.length);
    assert.equal(c.prompt_tokens, prompt.length);
  }
  assert.equal(streamed.complete.finish_reason, 'length');
  assert.equal(streamed.complete.completion_tokens, 12);
  assert.equal(streamed.complete.prompt_tokens, prompt.length);
  console.log('ok Generate stream', JSON.stringify(ids));

  // Not streaming: one complete with every id, the same greedy tokens.
  const whole = await generate({ ...greedy('js-whole', 12), stream: false });
  assert.equal(whole.status.code, grpc.status.OK);
  assert.equal(whole.chunks.length, 0);
  assert.deepEqual(whole.complete.output_ids, ids);
  console.log('ok Generate non-streaming');

  // A stop string, matched by the router on the detokenized output (byte tokenizer: an id below
  // 128 is that ASCII character): the output ends with the token that completed it.
  assert.ok(ids.every((t) => t < 128), `greedy output not ASCII: ${ids}`);
  const stop = String.fromCharCode(ids[2], ids[3]);
  let seen = '';
  let cut = 0;
  while (!seen.includes(stop)) seen += String.fromCharCode(ids[cut++]);
  for (const stream of [true, false]) {
    const r = await generate({ ...greedy(`js-stop-${stream}`, 12), stream,
      sampling_params: { ...greedy('x', 12).sampling_params, stop: [stop] } });
    assert.equal(r.status.code, grpc.status.OK, JSON.stringify(r.status));
    const got = stream ? r.chunks.flatMap((c) => c.token_ids) : r.complete.output_ids;
    assert.deepEqual(got, ids.slice(0, cut), `stop ${JSON.stringify(stop)}`);
    assert.equal(r.complete.finish_reason, 'stop');
    assert.equal(r.complete.matched_stop_str, stop);
    assert.equal(r.complete.completion_tokens, cut);
  }
  console.log('ok stop string', JSON.stringify(stop), 'after', cut, 'tokens');

  // logprobs and prompt_logprobs in vLLM's shapes: per output token its value, id and top ids
  // (greedy: the top one is the token), every prompt token with the first valueless; streamed in
  // the chunks, or whole in complete.
  const lpParams = { ...greedy('x', 12).sampling_params, logprobs: 2, prompt_logprobs: 1 };
  const lpStream = await generate({ ...greedy('js-lp-s', 12), stream: true,
                                    sampling_params: lpParams });
  const lpWhole = await generate({ ...greedy('js-lp-w', 12), stream: false,
                                   sampling_params: lpParams });
  for (const r of [lpStream, lpWhole]) assert.equal(r.status.code, grpc.status.OK);
  const out = lpWhole.complete.output_logprobs;
  assert.deepEqual(out.token_ids, ids);
  assert.deepEqual(lpStream.chunks.flatMap((c) => c.output_logprobs.token_ids), ids);
  assert.deepEqual(lpStream.chunks.flatMap((c) => c.output_logprobs.token_logprobs),
                   out.token_logprobs);
  out.top_logprobs.forEach((top, i) => {
    assert.equal(top.token_ids.length, 2);
    assert.equal(top.token_ids[0], ids[i]);
    assert.equal(top.values[0], out.token_logprobs[i]);
  });
  const input = lpWhole.complete.input_logprobs;
  assert.deepEqual(input.token_ids, prompt);
  assert.ok(!input.token_logprobs[0].value, 'the first prompt token has no logprob');
  assert.ok(input.token_logprobs.slice(1).every((l) => l.value <= 0));
  assert.deepEqual(lpStream.chunks[0].input_logprobs.token_ids, prompt);
  console.log('ok logprobs and prompt_logprobs');

  // Text input through the router's tokenizer (--model-dir): 11 bytes, 11 byte tokens.
  const text = await generate({ request_id: 'js-text', text: 'hello world',
                                sampling_params: { temperature: 0, max_tokens: 4 } });
  assert.equal(text.status.code, grpc.status.OK, JSON.stringify(text.status));
  assert.equal(text.complete.prompt_tokens, 11);
  assert.ok(text.complete.output_ids.length >= 1 && text.complete.output_ids.length <= 4);
  console.log('ok Generate text', JSON.stringify(text.complete.output_ids));

  // A router without --model-dir has no tokenizer: text is FAILED_PRECONDITION naming the flag.
  const noTokenizer = await generate({ request_id: 'js-bare', text: 'hello',
                                       sampling_params: { max_tokens: 2 } }, null, bare);
  assert.equal(noTokenizer.status.code, grpc.status.FAILED_PRECONDITION);
  assert.match(noTokenizer.status.details, /--model-dir/);
  console.log('ok text without a tokenizer:', noTokenizer.status.details);

  // An unsupported field is INVALID_ARGUMENT naming it, never silently dropped.
  const bad = await generate({ ...greedy('js-bad', 4),
    sampling_params: { ...greedy('x', 4).sampling_params, min_p: 0.5, logprobs: -1 } });
  assert.equal(bad.status.code, grpc.status.INVALID_ARGUMENT);
  assert.match(bad.status.details, /sampling_params\.min_p/);
  assert.match(bad.status.details, /sampling_params\.logprobs/);
  console.log('ok unsupported fields:', bad.status.details);

  // Abort mid-stream by request id: the stream completes with "abort" and status OK, well
  // before the (context-long) max_tokens, and the router's nodes go idle again. The client stops
  // reading while the Abort is in flight, so the request cannot run to the end meanwhile beyond
  // what flow control lets through.
  const longMax = info.max_context_length - prompt.length;
  const aborted = await generate({ ...greedy('js-abort', longMax), stream: true },
    (call, chunk, index) => {
      if (index !== 0) return;
      call.pause();
      unary('Abort', { request_ids: ['js-abort'] }).then(() => call.resume());
    });
  assert.equal(aborted.status.code, grpc.status.OK, JSON.stringify(aborted.status));
  assert.equal(aborted.complete.finish_reason, 'abort');
  const got = aborted.chunks.reduce((n, c) => n + c.token_ids.length, 0);
  assert.ok(got < longMax, `aborted after ${got} of ${longMax} tokens`);
  console.log('ok Abort mid-stream after', got, 'of', longMax, 'tokens');
  await waitIdle();

  // Cancelling the call cancels the request downstream: the nodes go idle.
  const cancelled = await generate({ ...greedy('js-cancel', longMax), stream: true },
    (call, chunk, index) => { if (index === 0) call.cancel(); });
  assert.equal(cancelled.status.code, grpc.status.CANCELLED);
  console.log('ok cancel');

  // GetLoads after the work: one rank, idle.
  const idle = await waitIdle();
  const loads = await unary('GetLoads', { include: ['core'] });
  assert.equal(loads.dp_rank_count, 1);
  assert.equal(loads.loads.length, 1);
  assert.ok(loads.loads[0].max_total_num_tokens > 0, JSON.stringify(loads));
  assert.ok(loads.timestamp.length > 0);
  console.log('ok GetLoads', JSON.stringify(idle));
  client.close();
  bare.close();
}

main().then(() => { console.log('all VllmEngine checks passed'); },
  (err) => { console.error('FAILED:', err && err.stack ? err.stack : err); process.exit(1); });
