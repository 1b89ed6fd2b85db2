#include "cluster/child_process.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <fstream>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

namespace fluxion::cluster {

absl::StatusOr<std::unique_ptr<ChildProcess>> ChildProcess::Start(std::string name,
                                                                  std::vector<std::string> argv,
                                                                  std::string log_path) {
  std::unique_ptr<ChildProcess> child(new ChildProcess());
  child->name_ = std::move(name);
  child->log_path_ = std::move(log_path);
  std::vector<char*> cargv;
  for (std::string& a : argv) cargv.push_back(a.data());
  cargv.push_back(nullptr);
  const pid_t parent = getpid();
  const pid_t pid = fork();
  if (pid < 0) return absl::InternalError(absl::StrCat("fork for ", child->name_, " failed"));
  if (pid == 0) {
    // Only async-signal-safe calls between fork and exec.
    setpgid(0, 0);
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (getppid() != parent) _exit(127);  // the parent died before prctl took effect
    sigset_t none;
    sigemptyset(&none);
    sigprocmask(SIG_SETMASK, &none, nullptr);  // the parent may block SIGINT/SIGTERM
    int fd = open(child->log_path_.c_str(), O_WRONLY | O_CREAT | O_APPEND, 0644);
    if (fd >= 0) {
      dup2(fd, 1);
      dup2(fd, 2);
      close(fd);
    }
    execv(cargv[0], cargv.data());
    _exit(127);
  }
  setpgid(pid, pid);  // also from the parent, so it holds before either side runs on
  child->pid_ = pid;
  return child;
}

ChildProcess::~ChildProcess() {
  if (pid_ > 0 && !reaped_) Stop(absl::Seconds(10));
}

bool ChildProcess::Running() {
  if (pid_ <= 0 || reaped_) return false;
  int status = 0;
  if (waitpid(pid_, &status, WNOHANG) == pid_) {
    reaped_ = true;
    exit_status_ = status;
    return false;
  }
  return true;
}

absl::StatusOr<int> ChildProcess::WaitForPortFile(const std::string& port_file,
                                                  absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  while (true) {  // looked at once even with a zero timeout: a poll
    std::ifstream in(port_file);
    int port = 0;
    if (in >> port && port > 0) return port;
    if (!Running()) {
      return absl::UnavailableError(absl::StrCat(name_, " exited before serving (see ", log_path_,
                                                 "):\n", LogTail()));
    }
    if (absl::Now() >= deadline) break;
    absl::SleepFor(absl::Milliseconds(20));
  }
  return absl::DeadlineExceededError(absl::StrCat(name_, " did not start serving within ",
                                                  absl::FormatDuration(timeout), " (see ",
                                                  log_path_, ")"));
}

std::string ChildProcess::Stop(absl::Duration grace) {
  auto describe = [this](const std::string& how) {
    if (WIFEXITED(exit_status_)) return absl::StrCat(how, "exited ", WEXITSTATUS(exit_status_));
    if (WIFSIGNALED(exit_status_)) {
      return absl::StrCat(how, "ended by signal ", WTERMSIG(exit_status_));
    }
    return how + "ended";
  };
  if (!Running()) return describe("had already ");
  kill(pid_, SIGTERM);
  const absl::Time deadline = absl::Now() + grace;
  while (absl::Now() < deadline) {
    if (!Running()) return describe("");
    absl::SleepFor(absl::Milliseconds(20));
  }
  kill(pid_, SIGKILL);
  waitpid(pid_, &exit_status_, 0);
  reaped_ = true;
  return absl::StrCat("killed after ", absl::FormatDuration(grace), " without exiting");
}

std::string ChildProcess::LogTail(size_t bytes) const {
  std::ifstream in(log_path_);
  std::stringstream ss;
  ss << in.rdbuf();
  std::string all = ss.str();
  return all.size() > bytes ? all.substr(all.size() - bytes) : all;
}

}  // namespace fluxion::cluster
