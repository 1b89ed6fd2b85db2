// Validates Kubernetes objects offline: each against its API schema (kubernetes-models, the
// OpenAPI schemas of the Kubernetes API and of the prometheus-operator's CRDs, checked with ajv),
// then against the rules the Fluxion pods must keep (docs/DEPLOY.md): non-root, read-only root
// filesystem, no privilege escalation, every capability dropped and only IPC_LOCK added back,
// memory requests and limits, probes, and a termination grace period that covers the drain.
//
//   kubectl kustomize k8s/overlays/dev | node validate.mjs NAME
// Prints one line per object; exits 1 with every problem listed when any object fails.
import { readFileSync } from "node:fs";
import { parseAllDocuments } from "yaml";

// apiVersion/kind -> the module whose class validates it.
const MODELS = {
  "v1/Service": "kubernetes-models/v1/Service",
  "v1/Namespace": "kubernetes-models/v1/Namespace",
  "v1/Secret": "kubernetes-models/v1/Secret",
  "v1/ConfigMap": "kubernetes-models/v1/ConfigMap",
  "apps/v1/Deployment": "kubernetes-models/apps/v1/Deployment",
  "apps/v1/StatefulSet": "kubernetes-models/apps/v1/StatefulSet",
  "policy/v1/PodDisruptionBudget": "kubernetes-models/policy/v1/PodDisruptionBudget",
  "networking.k8s.io/v1/NetworkPolicy": "kubernetes-models/networking.k8s.io/v1/NetworkPolicy",
  "monitoring.coreos.com/v1/ServiceMonitor":
    "@kubernetes-models/prometheus-operator/monitoring.coreos.com/v1/ServiceMonitor",
};

// The drain bound of a container's command (common/server_main.h, DrainPlan): the drain timeout
// plus what each command takes after it, in seconds, and the preStop sleep before it.
function drainSeconds(container) {
  const args = container.args ?? [];
  const flag = (name, fallback) => {
    const arg = args.find((a) => a.startsWith(`--${name}=`));
    return arg === undefined ? fallback : Number(arg.slice(name.length + 3));
  };
  const drain = flag("drain-timeout-ms", 30000) / 1000;
  const after = { router: 3, prefill: 1, decode: flag("abort-wait-ms", 2000) / 1000 + 2 };
  const preStop = container.lifecycle?.preStop?.sleep?.seconds ?? 0;
  return preStop + drain + (after[args[0]] ?? 0);
}

function checkPod(name, spec, problems) {
  const pod = spec.securityContext ?? {};
  if (pod.runAsNonRoot !== true) problems.push(`${name}: pod securityContext.runAsNonRoot is not true`);
  if (pod.seccompProfile?.type !== "RuntimeDefault") {
    problems.push(`${name}: pod seccompProfile is not RuntimeDefault`);
  }
  let longestDrain = 0;
  for (const c of spec.containers) {
    const where = `${name}/${c.name}`;
    const sc = c.securityContext ?? {};
    if (sc.readOnlyRootFilesystem !== true) problems.push(`${where}: root filesystem not read-only`);
    if (sc.allowPrivilegeEscalation !== false) problems.push(`${where}: privilege escalation allowed`);
    if (!(sc.capabilities?.drop ?? []).includes("ALL")) problems.push(`${where}: capabilities not dropped`);
    for (const cap of sc.capabilities?.add ?? []) {
      if (cap !== "IPC_LOCK") problems.push(`${where}: adds capability ${cap} (only IPC_LOCK, for RDMA)`);
    }
    if (sc.privileged) problems.push(`${where}: privileged`);
    if (!c.resources?.requests?.memory || !c.resources?.limits?.memory) {
      problems.push(`${where}: memory request and limit required`);
    }
    if (!c.resources?.requests?.cpu) problems.push(`${where}: cpu request required`);
    for (const probe of ["livenessProbe", "readinessProbe"]) {
      if (!c[probe]) problems.push(`${where}: no ${probe}`);
    }
    longestDrain = Math.max(longestDrain, drainSeconds(c));
  }
  const grace = spec.terminationGracePeriodSeconds ?? 30;
  if (grace < longestDrain) {
    problems.push(`${name}: terminationGracePeriodSeconds ${grace} < the drain's bound ${longestDrain} s`);
  }
}

const label = process.argv[2] ?? "stdin";
const docs = parseAllDocuments(readFileSync(0, "utf8"));
const problems = [];
let count = 0;
for (const doc of docs) {
  if (doc.errors.length > 0) {
    problems.push(`YAML: ${doc.errors.map((e) => e.message).join("; ")}`);
    continue;
  }
  const obj = doc.toJS();
  if (obj === null) continue;
  ++count;
  const key = `${obj.apiVersion}/${obj.kind}`;
  const name = `${obj.kind}/${obj.metadata?.name}`;
  const modulePath = MODELS[key];
  if (modulePath === undefined) {
    problems.push(`${name}: no schema known for ${key} (add it to validate.mjs)`);
    continue;
  }
  const Model = Object.values(await import(modulePath))[0];
  try {
    new Model(obj).validate();
  } catch (e) {
    problems.push(`${name}: ${e.message}`);
    continue;
  }
  if (obj.kind === "Deployment" || obj.kind === "StatefulSet") {
    checkPod(name, obj.spec.template.spec, problems);
  }
  console.log(`${label}: ${name} valid`);
}
if (count === 0) problems.push("no objects");
if (problems.length > 0) {
  for (const p of problems) console.error(`${label}: ${p}`);
  process.exit(1);
}
console.log(`${label}: ${count} objects valid`);
