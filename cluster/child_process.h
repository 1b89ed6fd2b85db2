// A `fluxion` server started as a child process by `fluxion local`: its own process group (so a
// terminal's Ctrl-C reaches only the parent, which then shuts children down in order), killed by
// the kernel if the parent dies (PR_SET_PDEATHSIG), output to a log file.
//
// Thread-compatible: one owner drives Start/Stop.
#ifndef FLUXION_CLUSTER_CHILD_PROCESS_H_
#define FLUXION_CLUSTER_CHILD_PROCESS_H_

#include <sys/types.h>

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace fluxion::cluster {

class ChildProcess {
 public:
  // Runs `argv` (argv[0] is the executable path) with stdout and stderr appended to `log_path`.
  // INTERNAL if fork fails.
  static absl::StatusOr<std::unique_ptr<ChildProcess>> Start(std::string name,
                                                             std::vector<std::string> argv,
                                                             std::string log_path);
  // Stops the process (Stop with a 10 s grace) if still running.
  ~ChildProcess();
  ChildProcess(const ChildProcess&) = delete;
  ChildProcess& operator=(const ChildProcess&) = delete;

  // Waits until `port_file` holds a port (the server writes it once serving), up to `timeout`
  // (zero: looks once).
  // UNAVAILABLE, with the log's tail, if the process exits first; DEADLINE_EXCEEDED on timeout.
  absl::StatusOr<int> WaitForPortFile(const std::string& port_file, absl::Duration timeout);

  // SIGTERM, then SIGKILL if it has not exited after `grace`; reaps it. Returns a description of
  // how it ended ("exited 0", "killed after 10 s", ...).
  std::string Stop(absl::Duration grace);

  bool Running();
  const std::string& name() const { return name_; }
  pid_t pid() const { return pid_; }
  const std::string& log_path() const { return log_path_; }
  // The last `bytes` of the log.
  std::string LogTail(size_t bytes = 2000) const;

 private:
  ChildProcess() = default;
  std::string name_;
  std::string log_path_;
  pid_t pid_ = -1;
  int exit_status_ = 0;
  bool reaped_ = false;
};

}  // namespace fluxion::cluster

#endif  // FLUXION_CLUSTER_CHILD_PROCESS_H_
