// A small load measurement of the router's HTTP API (bench/results/README.md records its runs):
// requests/s and latency of GET /v1/models (a tiny non-streaming endpoint: the HTTP server's own
// cost) and of streamed completions (SSE: time to first event and whole-stream time), with
// `concurrency` keep-alive connections for `seconds`. Node's own http module only.
//   node tests/js/http_load.mjs http://127.0.0.1:PORT MODEL [concurrency] [seconds]
import http from 'node:http';

const [base, model, conc = '16', secs = '3'] = process.argv.slice(2);
const concurrency = Number(conc), seconds = Number(secs);
const agent = new http.Agent({ keepAlive: true, maxSockets: concurrency });
const url = new URL(base);

function request(method, path, body) {
  return new Promise((resolve, reject) => {
    const start = process.hrtime.bigint();
    let first = null;
    const req = http.request({ host: url.hostname, port: url.port, method, path, agent,
                               headers: body ? { 'content-type': 'application/json' } : {} },
                             (res) => {
      res.on('data', () => { if (first === null) first = process.hrtime.bigint(); });
      res.on('end', () => {
        const end = process.hrtime.bigint();
        if (res.statusCode !== 200) return reject(new Error(`HTTP ${res.statusCode}`));
        resolve({ total: Number(end - start) / 1e6, first: Number(first - start) / 1e6 });
      });
    });
    req.on('error', reject);
    if (body) req.write(body);
    req.end();
  });
}

const pct = (xs, p) => xs[Math.min(xs.length - 1, Math.floor(p * xs.length))].toFixed(2);

async function run(name, make) {
  const lat = [], first = [];
  const end = Date.now() + seconds * 1000;
  await Promise.all(Array.from({ length: concurrency }, async () => {
    while (Date.now() < end) {
      const r = await make();
      lat.push(r.total);
      first.push(r.first);
    }
  }));
  lat.sort((a, b) => a - b);
  first.sort((a, b) => a - b);
  console.log(`${name}: ${lat.length} requests, ${(lat.length / seconds).toFixed(0)} req/s, ` +
              `latency ms p50 ${pct(lat, 0.5)} p99 ${pct(lat, 0.99)}, first byte ms p50 ` +
              `${pct(first, 0.5)} p99 ${pct(first, 0.99)}`);
}

await run('GET /v1/models', () => request('GET', '/v1/models'));
const body = JSON.stringify({ model, prompt: 'The key is 42. The key is', max_tokens: 16,
                              temperature: 0, stream: true });
await run('POST /v1/completions stream (16 tokens)',
          () => request('POST', '/v1/completions', body));
