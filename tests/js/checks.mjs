// What the end-to-end scripts share: required environment variables, and named checks run in
// order, each printed ok / FAIL, the process exiting 1 when any failed.
export const env = (name) => {
  const v = process.env[name];
  if (!v) throw new Error(`${name} is not set`);
  return v;
};

const checks = [];
export const check = (name, fn) => checks.push({ name, fn });

export async function runChecks() {
  let failed = 0;
  for (const { name, fn } of checks) {
    try {
      await fn();
      console.log(`ok   ${name}`);
    } catch (e) {
      failed++;
      console.log(`FAIL ${name}: ${e?.stack ?? e}`);
    }
  }
  console.log(`${checks.length - failed}/${checks.length} passed`);
  process.exit(failed ? 1 : 0);
}
