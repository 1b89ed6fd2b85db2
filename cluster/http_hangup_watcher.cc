#include "cluster/http_hangup_watcher.h"

#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"

namespace fluxion::cluster {
namespace {

constexpr uint64_t kWakeId = 0;  // the eventfd's epoll data; watch ids start at 1

}  // namespace

absl::StatusOr<std::unique_ptr<HangupWatcher>> HangupWatcher::Start() {
  const int epoll_fd = epoll_create1(EPOLL_CLOEXEC);
  if (epoll_fd < 0) {
    return absl::UnavailableError(absl::StrCat("http: epoll_create1: ", std::strerror(errno)));
  }
  const int wake_fd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  epoll_event event{};
  event.events = EPOLLIN;
  event.data.u64 = kWakeId;
  if (wake_fd < 0 || epoll_ctl(epoll_fd, EPOLL_CTL_ADD, wake_fd, &event) != 0) {
    const std::string why = std::strerror(errno);
    if (wake_fd >= 0) close(wake_fd);
    close(epoll_fd);
    return absl::UnavailableError(absl::StrCat("http: hang-up watcher: ", why));
  }
  std::unique_ptr<HangupWatcher> watcher(new HangupWatcher(epoll_fd, wake_fd));
  watcher->thread_ = std::thread([w = watcher.get()] { w->Run(); });
  return watcher;
}

HangupWatcher::HangupWatcher(int epoll_fd, int wake_fd) : epoll_fd_(epoll_fd), wake_fd_(wake_fd) {}

HangupWatcher::~HangupWatcher() {
  const uint64_t one = 1;
  (void)!write(wake_fd_, &one, sizeof(one));
  thread_.join();
  close(wake_fd_);
  close(epoll_fd_);
}

uint64_t HangupWatcher::Watch(int fd, std::function<void()> hung_up) {
  absl::MutexLock lock(&mu_);
  const uint64_t id = next_id_++;
  epoll_event event{};
  // One-shot: a hang-up stays readable (level-triggered), and one report is all that is wanted.
  event.events = EPOLLRDHUP | EPOLLONESHOT;
  event.data.u64 = id;
  if (fd < 0 || epoll_ctl(epoll_fd_, EPOLL_CTL_ADD, fd, &event) != 0) return 0;
  entries_.emplace(id, Entry{fd, std::move(hung_up)});
  return id;
}

void HangupWatcher::Unwatch(uint64_t id) {
  std::function<void()> dropped;  // destroyed outside the lock: it may own the last references
  absl::MutexLock lock(&mu_);
  auto it = entries_.find(id);
  if (it == entries_.end()) return;
  // The socket is still open (the caller's contract), so this cannot hit a reused descriptor.
  epoll_ctl(epoll_fd_, EPOLL_CTL_DEL, it->second.fd, nullptr);
  dropped = std::move(it->second.hung_up);
  entries_.erase(it);
}

size_t HangupWatcher::watched() const {
  absl::MutexLock lock(&mu_);
  return entries_.size();
}

void HangupWatcher::Run() {
  epoll_event events[64];
  while (true) {
    const int n = epoll_wait(epoll_fd_, events, 64, -1);
    if (n < 0) {
      if (errno == EINTR) continue;
      return;  // EBADF/EINVAL: a bug; the server then notices hang-ups late, as without us
    }
    for (int i = 0; i < n; ++i) {
      if (events[i].data.u64 == kWakeId) return;
      std::function<void()> hung_up;
      {
        absl::MutexLock lock(&mu_);
        auto it = entries_.find(events[i].data.u64);
        if (it == entries_.end()) continue;       // unwatched meanwhile
        hung_up = std::move(it->second.hung_up);  // the entry stays until Unwatch
      }
      if (hung_up) hung_up();
    }
  }
}

}  // namespace fluxion::cluster
