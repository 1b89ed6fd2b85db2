// gRPC server reflection against a Fluxion server, as grpcurl and Postman use it: the
// grpc-js-reflection-client package (npm) lists the services and resolves one service's methods
// from the descriptors the server sends. Run by tests/vllm_engine_e2e_test.cc:
//   node reflection_client.cjs HOST:PORT SERVICE [SERVICE...]
// Exits 0 when every SERVICE is listed and the first one's methods resolve; prints why not.
const grpc = require('@grpc/grpc-js');
const { GrpcReflection } = require('grpc-js-reflection-client');

async function main() {
  const [address, ...want] = process.argv.slice(2);
  if (!address || want.length === 0) throw new Error('usage: reflection_client.cjs HOST:PORT SERVICE...');
  const reflection = new GrpcReflection(address, grpc.credentials.createInsecure());
  const services = await reflection.listServices();
  for (const service of want) {
    if (!services.includes(service)) {
      throw new Error(`${address} does not list ${service} (lists: ${services.join(', ')})`);
    }
  }
  const methods = await reflection.listMethods(want[0]);
  if (methods.length === 0) throw new Error(`${want[0]}: no methods resolved`);
  console.log(`reflection on ${address}: ${want[0]} has ${methods.map((m) => m.name).join(', ')}`);
}

main().catch((e) => {
  console.error(`reflection check failed: ${e?.stack ?? e}`);
  process.exit(1);
});
