#include "cluster/backends.h"

#include <netdb.h>
#include <arpa/inet.h>
#include <sys/socket.h>

#include <algorithm>
#include <set>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/blocking_counter.h"
#include "absl/synchronization/notification.h"
#include "common/metrics_names.h"
#include "grpcpp/generic/generic_stub.h"

namespace fluxion::cluster {
namespace {

constexpr char kDecodeService[] = "fluxion.v1.DecodeService";
constexpr char kPrefillService[] = "fluxion.v1.PrefillService";
constexpr char kHealthCheckMethod[] = "/grpc.health.v1.Health/Check";

// grpc.health.v1.HealthCheckRequest{service = name}, encoded by hand: gRPC C++ serves the health
// service built in but ships no client stub, and the message is one string field.
grpc::ByteBuffer HealthCheckRequest(const std::string& service) {
  std::string bytes;
  bytes.push_back(0x0a);  // field 1, length-delimited
  size_t n = service.size();
  while (n >= 0x80) {
    bytes.push_back(static_cast<char>((n & 0x7f) | 0x80));
    n >>= 7;
  }
  bytes.push_back(static_cast<char>(n));
  bytes += service;
  grpc::Slice slice(bytes);
  return grpc::ByteBuffer(&slice, 1);
}

// True when a HealthCheckResponse says SERVING (field 1, varint, value 1).
bool IsServing(const grpc::ByteBuffer& response) {
  grpc::Slice slice;
  if (!response.DumpToSingleSlice(&slice).ok()) return false;
  const uint8_t* p = slice.begin();
  size_t size = slice.size();
  for (size_t i = 0; i + 1 < size; ++i) {
    if (p[i] == 0x08) return p[i + 1] == 1;
  }
  return false;  // empty message: status UNKNOWN
}

std::chrono::system_clock::time_point DeadlineAfter(absl::Duration d) {
  return std::chrono::system_clock::now() + absl::ToChronoMilliseconds(d);
}

}  // namespace

bool HealthServing(const std::shared_ptr<grpc::Channel>& channel, const std::string& service,
                   absl::Duration timeout) {
  grpc::GenericStub stub(channel);
  grpc::ClientContext context;
  context.set_deadline(DeadlineAfter(timeout));
  grpc::ByteBuffer request = HealthCheckRequest(service), response;
  grpc::Status status;
  absl::Notification done;
  stub.UnaryCall(&context, kHealthCheckMethod, grpc::StubOptions(), &request, &response,
                 [&](grpc::Status s) {
                   status = std::move(s);
                   done.Notify();
                 });
  done.WaitForNotification();  // bounded: the call has a deadline
  return status.ok() && IsServing(response);
}

const char* RoleName(Role role) { return role == Role::kDecode ? "decode" : "prefill"; }

absl::StatusOr<std::pair<std::string, int>> SplitHostPort(const std::string& address) {
  size_t colon = address.rfind(':');
  int port = 0;
  if (colon == std::string::npos || colon == 0 ||
      !absl::SimpleAtoi(address.substr(colon + 1), &port) || port <= 0 || port > 65535) {
    return absl::InvalidArgumentError(
        absl::StrCat("'", address, "' is not host:port (e.g. decode-0:7100)"));
  }
  return std::make_pair(address.substr(0, colon), port);
}

absl::StatusOr<std::vector<std::string>> ResolveAll(const std::string& host, int port) {
  addrinfo hints{};
  hints.ai_family = AF_INET;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* result = nullptr;
  int rc = getaddrinfo(host.c_str(), nullptr, &hints, &result);
  if (rc != 0) {
    return absl::UnavailableError(
        absl::StrCat("cannot resolve '", host, "': ", gai_strerror(rc)));
  }
  std::set<std::string> addresses;
  for (addrinfo* a = result; a != nullptr; a = a->ai_next) {
    char ip[INET_ADDRSTRLEN];
    auto* in = reinterpret_cast<sockaddr_in*>(a->ai_addr);
    if (inet_ntop(AF_INET, &in->sin_addr, ip, sizeof(ip)) != nullptr) {
      addresses.insert(absl::StrCat(ip, ":", port));
    }
  }
  freeaddrinfo(result);
  return std::vector<std::string>(addresses.begin(), addresses.end());
}

absl::StatusOr<std::unique_ptr<Backends>> Backends::Create(Options options) {
  for (const auto* list : {&options.decode_addresses, &options.prefill_addresses,
                           &options.decode_dns, &options.prefill_dns}) {
    for (const std::string& a : *list) {
      auto split = SplitHostPort(a);
      if (!split.ok()) return split.status();
    }
  }
  if (absl::Status valid = ValidateHealthHysteresis(options.health); !valid.ok()) return valid;
  if (options.decode_addresses.empty() && options.decode_dns.empty()) {
    return absl::InvalidArgumentError("no decode nodes: give --decode host:port or --decode-dns");
  }
  std::unique_ptr<Backends> backends(new Backends(std::move(options)));
  {
    absl::MutexLock lock(&backends->mu_);
    for (const std::string& a : backends->options_.decode_addresses) {
      backends->AddNode(a, Role::kDecode);
    }
    for (const std::string& a : backends->options_.prefill_addresses) {
      backends->AddNode(a, Role::kPrefill);
    }
  }
  backends->PollOnce();
  if (backends->options_.start_poller) {
    backends->poller_ = std::thread([b = backends.get()] { b->PollerLoop(); });
  }
  return backends;
}

Backends::~Backends() {
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
  }
  if (poller_.joinable()) poller_.join();
}

void Backends::AddNode(const std::string& address, Role role) {
  if (nodes_.count(address) > 0) return;
  Node node;
  node.health = HealthHysteresis(options_.health);
  node.state.address = address;
  node.state.role = role;
  node.state.last_error = "not checked yet";
  node.channel = serving::CreateChannel(address, options_.channel);
  if (role == Role::kDecode) {
    node.decode_stub = v1::DecodeService::NewStub(node.channel);
  } else {
    node.prefill_stub = v1::PrefillService::NewStub(node.channel);
  }
  nodes_.emplace(address, std::move(node));
}

void Backends::Resolve() {
  // Resolution blocks on DNS, so it runs without the lock; only the merge takes it.
  std::vector<std::pair<Role, std::vector<std::string>>> found;
  std::set<std::string> failed_names;
  for (Role role : {Role::kDecode, Role::kPrefill}) {
    for (const std::string& name :
         role == Role::kDecode ? options_.decode_dns : options_.prefill_dns) {
      auto split = SplitHostPort(name);
      auto addresses = ResolveAll(split->first, split->second);
      if (addresses.ok()) {
        found.emplace_back(role, std::move(*addresses));
      } else {
        failed_names.insert(name);
      }
    }
  }
  absl::MutexLock lock(&mu_);
  last_resolve_ = absl::Now();
  // Nodes named only through DNS disappear when their pod leaves the service; a name that failed
  // to resolve this time keeps its old nodes (a DNS hiccup is not a pod leaving).
  std::set<std::string> keep(options_.decode_addresses.begin(), options_.decode_addresses.end());
  keep.insert(options_.prefill_addresses.begin(), options_.prefill_addresses.end());
  for (const auto& [role, addresses] : found) {
    for (const std::string& a : addresses) {
      AddNode(a, role);
      keep.insert(a);
    }
  }
  if (failed_names.empty()) {
    for (auto it = nodes_.begin(); it != nodes_.end();) {
      if (keep.count(it->first)) {
        ++it;
      } else {
        retired_channels_.push_back(it->second.channel);
        retired_series_.emplace_back(it->first, it->second.state.role);
        it = nodes_.erase(it);
      }
    }
  }
}

void Backends::PollOnce() {
  bool resolve_due;
  {
    absl::MutexLock lock(&mu_);
    resolve_due = (!options_.decode_dns.empty() || !options_.prefill_dns.empty()) &&
                  absl::Now() - last_resolve_ >= options_.resolve_interval;
  }
  if (resolve_due) Resolve();

  struct Probe {
    std::string address;
    Role role;
    std::unique_ptr<grpc::GenericStub> generic;
    std::shared_ptr<v1::DecodeService::Stub> decode_stub;
    std::shared_ptr<v1::PrefillService::Stub> prefill_stub;
    grpc::ClientContext health_context, load_context;
    grpc::ByteBuffer health_request, health_response;
    grpc::Status health_status, load_status;
    v1::GetLoadRequest load_request;
    v1::DecodeLoad decode_load;
    v1::PrefillLoad prefill_load;
  };
  std::vector<std::unique_ptr<Probe>> probes;
  {
    absl::MutexLock lock(&mu_);
    for (auto& [address, node] : nodes_) {
      auto p = std::make_unique<Probe>();
      p->address = address;
      p->role = node.state.role;
      p->generic = std::make_unique<grpc::GenericStub>(node.channel);
      p->decode_stub = node.decode_stub;
      p->prefill_stub = node.prefill_stub;
      probes.push_back(std::move(p));
    }
  }
  // Two calls per node, all in flight at once; each has a deadline, so every callback runs.
  // Health is asked for the node's service name only (docs/PROTOCOL.md: every Fluxion server
  // registers it once it can serve). No fallback to "" (the whole server): a server answering
  // NOT_FOUND for the name is not ready (still loading) or not a node of that role, and is
  // unhealthy either way.
  absl::BlockingCounter pending(static_cast<int>(2 * probes.size()));
  for (auto& p : probes) {
    Probe* probe = p.get();
    probe->health_context.set_deadline(DeadlineAfter(options_.rpc_timeout));
    probe->load_context.set_deadline(DeadlineAfter(options_.rpc_timeout));
    probe->health_request =
        HealthCheckRequest(probe->role == Role::kDecode ? kDecodeService : kPrefillService);
    probe->generic->UnaryCall(&probe->health_context, kHealthCheckMethod, grpc::StubOptions(),
                              &probe->health_request, &probe->health_response,
                              [probe, &pending](grpc::Status s) {
                                probe->health_status = std::move(s);
                                pending.DecrementCount();
                              });
    auto done = [probe, &pending](grpc::Status s) {
      probe->load_status = std::move(s);
      pending.DecrementCount();
    };
    if (probe->role == Role::kDecode) {
      probe->decode_stub->async()->GetLoad(&probe->load_context, &probe->load_request,
                                           &probe->decode_load, done);
    } else {
      probe->prefill_stub->async()->GetLoad(&probe->load_context, &probe->load_request,
                                            &probe->prefill_load, done);
    }
  }
  pending.Wait();

  {
    absl::MutexLock lock(&mu_);
    for (const auto& p : probes) {
      auto it = nodes_.find(p->address);
      if (it == nodes_.end()) continue;  // removed by a re-resolve meanwhile
      Node& node = it->second;
      BackendState& s = node.state;
      const grpc::Status& health = p->health_status;
      bool serving = health.ok() && IsServing(p->health_response);
      bool draining =
          p->role == Role::kDecode ? p->decode_load.draining() : p->prefill_load.draining();
      if (p->load_status.ok()) {
        s.has_load = true;
        s.decode_load = p->decode_load;
        s.prefill_load = p->prefill_load;
        s.pending_requests = 0;
        s.pending_prompt_tokens = 0;
      }
      // A node that answered NOT_SERVING or draining said itself that it takes no work (loading,
      // shutting down): dropped at once. Only a check without an answer (an RPC error, a
      // deadline) is a miss counted towards --health-failures.
      if (health.ok() && (!serving || (p->load_status.ok() && draining))) {
        node.health.Eject();
      } else {
        node.health.Observe(health.ok() && p->load_status.ok());
      }
      SyncHealth(node);
      if (!health.ok()) {
        s.last_error = absl::StrCat("health check: ", health.error_message());
      } else if (!serving) {
        s.last_error = "health check: NOT_SERVING";
      } else if (!p->load_status.ok()) {
        s.last_error = absl::StrCat("GetLoad: ", p->load_status.error_message());
      } else if (draining) {
        s.last_error = "draining";
      } else if (!s.healthy) {
        s.last_error = absl::StrCat("recovering: ", node.health.consecutive_successes(), " of ",
                                    options_.health.successes_to_admit,
                                    " passing checks in a row needed to take it back");
      } else {
        s.last_error.clear();
      }
    }
  }
  PublishHealth();
}

void Backends::SyncHealth(Node& node) {
  node.state.healthy = node.health.routable();
  node.state.health_state = node.health.state();
  node.state.consecutive_failures = node.health.consecutive_failures();
}

void Backends::PublishHealth() {
  if (options_.registry == nullptr) return;
  struct Row {
    std::string address;
    Role role;
    HealthState state;
    int64_t new_ejections;
  };
  std::vector<Row> rows;
  std::vector<std::pair<std::string, Role>> gone;
  {
    absl::MutexLock lock(&mu_);
    for (auto& [address, node] : nodes_) {
      rows.push_back({address, node.state.role, node.health.state(),
                      node.health.ejections() - node.ejections_published});
      node.ejections_published = node.health.ejections();
    }
    gone.swap(retired_series_);
  }
  namespace n = metrics::names;
  metrics::Registry& r = *options_.registry;
  for (const auto& [address, role] : gone) {
    for (HealthState state : kAllHealthStates) {
      r.Remove(n::kRouterBackendState,
               {{"role", RoleName(role)}, {"address", address}, {"state", HealthStateName(state)}});
    }
    r.Remove(n::kRouterBackendEjectionsTotal, {{"role", RoleName(role)}, {"address", address}});
  }
  for (const Row& row : rows) {
    for (HealthState state : kAllHealthStates) {
      r.AddGauge(n::kRouterBackendState,
                 "Each backend's health state (1 for its current state, 0 for the others): new, "
                 "healthy, suspect (routed to, missing checks), ejected, recovering (passing "
                 "checks, not routed to yet).",
                 {{"role", RoleName(row.role)}, {"address", row.address},
                  {"state", HealthStateName(state)}})
          ->Set(state == row.state ? 1 : 0);
    }
    r.AddCounter(n::kRouterBackendEjectionsTotal,
                 "Times a backend went from routed to ejected (missed checks in a row, "
                 "NOT_SERVING, draining, or unreachable on the request path).",
                 {{"role", RoleName(row.role)}, {"address", row.address}})
        ->Increment(static_cast<double>(row.new_ejections));
  }
}

void Backends::PollerLoop() {
  while (true) {
    {
      absl::MutexLock lock(&mu_);
      // Sleeps one interval, waking at once on stop.
      mu_.AwaitWithTimeout(absl::Condition(&stop_), options_.poll_interval);
      if (stop_) return;
    }
    PollOnce();
  }
}

std::vector<BackendState> Backends::Snapshot(Role role) const {
  absl::MutexLock lock(&mu_);
  std::vector<BackendState> out;
  for (const auto& [address, node] : nodes_) {
    if (node.state.role == role) out.push_back(node.state);
  }
  return out;
}

bool Backends::has_prefill_nodes() const {
  if (!options_.prefill_dns.empty()) return true;
  return !options_.prefill_addresses.empty();
}

int Backends::HealthyCount(Role role) const {
  absl::MutexLock lock(&mu_);
  int n = 0;
  for (const auto& [address, node] : nodes_) n += node.state.role == role && node.state.healthy;
  return n;
}

void Backends::NoteDispatch(const std::string& address, int64_t prompt_tokens) {
  absl::MutexLock lock(&mu_);
  auto it = nodes_.find(address);
  if (it == nodes_.end()) return;
  ++it->second.state.pending_requests;
  it->second.state.pending_prompt_tokens += prompt_tokens;
}

void Backends::MarkFailed(const std::string& address, const std::string& why) {
  absl::MutexLock lock(&mu_);
  auto it = nodes_.find(address);
  if (it == nodes_.end()) return;
  it->second.health.Eject();
  SyncHealth(it->second);
  it->second.state.last_error = why;
}

std::shared_ptr<v1::DecodeService::Stub> Backends::DecodeStub(const std::string& address) const {
  absl::MutexLock lock(&mu_);
  auto it = nodes_.find(address);
  return it == nodes_.end() ? nullptr : it->second.decode_stub;
}

}  // namespace fluxion::cluster
