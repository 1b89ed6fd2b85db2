// The processes of a cluster on one machine, for `fluxion local` (a short replay) and `fluxion
// serve` (serving until stopped): prefill nodes, decode nodes and a router with the OpenAI HTTP
// API, each a child process of this one (real gRPC, real UCX over loopback), sharing one fresh
// transfer secret. Started in order (prefill, decode, router), stopped in reverse.
//
// Thread-compatible: one owner drives it.
#ifndef FLUXION_CLUSTER_LOCAL_CLUSTER_H_
#define FLUXION_CLUSTER_LOCAL_CLUSTER_H_

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "cluster/child_process.h"
#include "common/flag_set.h"

namespace fluxion::cluster {

// The checkout the binary belongs to, for the bundled model and trace: FLUXION_SOURCE_DIR, else
// the parent of the binary's folder (build/fluxion) when it holds models/, else ".".
std::string RepoRoot();

// Every setting of a local cluster; defaults sized for a 2-core machine and the tiny model.
struct LocalClusterOptions {
  std::string model;  // model directory of every node (and the router's tokenizer)
  std::string ucx_tls = "tcp";
  std::string decode_device = "cpu", prefill_device = "cpu";
  int64_t decode_nodes = 1, prefill_nodes = 1, kv_pages = 16384;
  // 1 by default, not each node's own default (the CPUs minus one): the nodes and the router share
  // this machine, and two nodes each taking all but one core would fight over them.
  int64_t cpu_threads = 1;
  double startup_timeout_s = 120;
  // The router's HTTP API, host:port (port 0 picks a free one).
  std::string http_listen = "127.0.0.1:0";
  // More flags for every decode node, and for the router (e.g. --default-policy,
  // --served-model-name, --max-model-len).
  std::vector<std::string> decode_args, router_args;
};

// The flags of every setting above but the extra arguments, as `fluxion local` and `fluxion
// serve` take them.
void RegisterLocalClusterFlags(FlagSet& flags, LocalClusterOptions* o);

// InvalidArgument naming the flag (the flags are those of `fluxion local` and `fluxion serve`).
absl::Status CheckLocalClusterOptions(const LocalClusterOptions& o);

class LocalCluster {
 public:
  // `logs`: the folder for each child's log, port files and the transfer secret (must exist).
  LocalCluster(LocalClusterOptions options, std::string logs);
  ~LocalCluster() { Shutdown(); }
  LocalCluster(const LocalCluster&) = delete;
  LocalCluster& operator=(const LocalCluster&) = delete;

  // Writes the run's transfer secret, starts every node and the router, and waits until the
  // router sees a healthy decode node. Cancelled after SIGINT/SIGTERM (InterruptScope).
  absl::Status Start();

  // Starts again, on the ports it first bound, every child that has exited since (a crash, an
  // OOM kill), at most once per `backoff` each, doubling up to a minute while it keeps exiting.
  // Never waits: a restarted child is checked for its ports on later calls (a model load can
  // take minutes, and meanwhile other children may die or a signal may arrive), and one that
  // exits or does not serve within the startup timeout counts as exited again. Returns one line
  // per child restarted, serving again or failing, for the caller to print.
  std::vector<std::string> RestartExited();

  // Stops the children in reverse start order, printing how each ended.
  void Shutdown();

  const std::string& router_address() const { return router_address_; }
  int http_port() const { return http_port_; }
  const std::vector<std::string>& prefill_addresses() const { return prefill_addresses_; }
  const std::vector<std::string>& decode_addresses() const { return decode_addresses_; }
  // Every process's Prometheus endpoint, "name http://127.0.0.1:port/metrics", router first.
  const std::vector<std::string>& metrics_urls() const { return metrics_urls_; }

 private:
  // One child: how to start it again, and what it runs as now.
  struct Child {
    std::string name, command;
    std::vector<std::string> args;
    std::vector<std::string> port_files;  // each written by the child once it serves
    std::unique_ptr<ChildProcess> process;
    absl::Time started_at;
    absl::Duration backoff = absl::Seconds(1);  // the wait before its next restart, doubling
    absl::Time next_restart = absl::InfinitePast();
    // Restarted and not yet serving: its ports are checked until `serving_deadline`.
    bool starting = false;
    absl::Time serving_deadline;
  };

  absl::Status StartChild(Child& child);
  // Waits for `children`'s port files (in order), or fails on the first that exits, times out,
  // or on SIGINT/SIGTERM.
  absl::StatusOr<std::vector<int>> WaitForPorts(const std::vector<Child*>& children);
  std::vector<std::string> NodeArgs(const std::string& name) const;
  std::vector<std::string> DecodeNodeArgs(int64_t i) const;
  // Starts `count` nodes of `command` and waits until all serve; appends their gRPC addresses.
  absl::Status StartNodes(const std::string& command, int64_t count,
                          std::vector<std::string>* addresses);
  absl::Status StartRouter();
  absl::Status WaitForHealthyDecode(Child& router);
  // Restarts one exited child on its pinned ports, without waiting for them; a line saying so.
  std::string Restart(Child& child);
  // A restarted child's ports, checked without waiting: a line once it serves or has failed,
  // nothing while it is still starting.
  std::optional<std::string> CheckRestarted(Child& child);

  const LocalClusterOptions o_;
  const std::string logs_;
  const std::string self_;
  std::vector<std::string> ucx_;  // the nodes' UCX flags
  std::string transfer_secret_;
  std::vector<std::unique_ptr<Child>> children_;
  std::vector<std::string> prefill_addresses_, decode_addresses_, metrics_urls_;
  std::string router_address_;
  int http_port_ = 0;
};

}  // namespace fluxion::cluster

#endif  // FLUXION_CLUSTER_LOCAL_CLUSTER_H_
