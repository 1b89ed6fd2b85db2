// Notices HTTP clients that hang up while their connection waits for the router. libmicrohttpd
// does not poll a suspended connection, so without this a client that goes away is noticed only
// when the connection is next resumed: a whole answer's generation, or a prefill before the first
// token, would run to its end for nobody.
//
// One thread waits (epoll) for the peer of each watched socket to close or reset the connection
// (EPOLLRDHUP, EPOLLHUP, EPOLLERR) and then runs that socket's callback, once. Sockets are
// watched by id: the caller must Unwatch a socket before it is closed (libmicrohttpd closes it
// after its request-completed callback, where the HTTP server unwatches), so that a reused
// descriptor number is never confused with the old connection.
//
// Thread-safe.
#ifndef FLUXION_CLUSTER_HTTP_HANGUP_WATCHER_H_
#define FLUXION_CLUSTER_HTTP_HANGUP_WATCHER_H_

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"

namespace fluxion::cluster {

class HangupWatcher {
 public:
  // UNAVAILABLE when the kernel refuses an epoll set or an eventfd (out of descriptors).
  static absl::StatusOr<std::unique_ptr<HangupWatcher>> Start();
  // Stops the thread; no callback runs after it returns.
  ~HangupWatcher();
  HangupWatcher(const HangupWatcher&) = delete;
  HangupWatcher& operator=(const HangupWatcher&) = delete;

  // Runs `hung_up` once, on the watcher's thread, when the peer of `fd` closes (or shuts down
  // its sending side: HTTP clients do not, before they have read the answer) or resets the
  // connection. `hung_up` must not call Watch or Unwatch. Returns the id for Unwatch; 0 when the
  // socket cannot be watched (the connection is then noticed late, as without a watcher).
  uint64_t Watch(int fd, std::function<void()> hung_up);
  // Forgets `id` (0: nothing). After it returns the watcher no longer touches the socket; a
  // callback already running may still finish (it must own what it uses).
  void Unwatch(uint64_t id);

  // Sockets watched now (for tests).
  size_t watched() const;

 private:
  HangupWatcher(int epoll_fd, int wake_fd);
  void Run();

  struct Entry {
    int fd;
    std::function<void()> hung_up;  // empty once run
  };

  const int epoll_fd_;
  const int wake_fd_;  // eventfd: written to stop the thread
  mutable absl::Mutex mu_;
  uint64_t next_id_ ABSL_GUARDED_BY(mu_) = 1;
  std::map<uint64_t, Entry> entries_ ABSL_GUARDED_BY(mu_);
  std::thread thread_;
};

}  // namespace fluxion::cluster

#endif  // FLUXION_CLUSTER_HTTP_HANGUP_WATCHER_H_
