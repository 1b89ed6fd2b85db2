// link_delay: a fixed added latency on a host's link for the multi-host fault suite, which this
// kernel cannot get from `tc qdisc ... netem delay` (no sch_netem; docs/FAULTS.md). The host's
// iptables rules hand every packet it sends or receives on eth0 to an NFQUEUE (the kernel has the
// xt NFQUEUE target, though not nft's `queue`); this program, running in the host's namespace,
// reads each packet's id from the queue (metadata only, no payload copied), holds it for
// --delay-ms and then accepts it, in arrival order, so the link behaves like one with that much
// more latency in each direction. tests/netns_lab.h starts and stops it (NetnsLab::Delay).
//
//   link_delay --queue N --delay-ms D --ready-file FILE
//
// FILE is written once the queue is bound (add the rules after that: packets queued with no
// reader are dropped). On SIGTERM or SIGINT it accepts whatever it still holds, prints how many
// packets it delayed and how many the kernel could not queue to it, and exits 0.
#include <arpa/inet.h>
#include <errno.h>
#include <linux/netfilter.h>
#include <poll.h>
#include <signal.h>
#include <sys/socket.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <fstream>
#include <string>

extern "C" {
#include <libnetfilter_queue/libnetfilter_queue.h>
}

namespace {

using Clock = std::chrono::steady_clock;

volatile sig_atomic_t g_stop = 0;
void OnSignal(int) { g_stop = 1; }

struct Held {
  uint32_t id;
  Clock::time_point release;
};

struct State {
  nfq_q_handle* queue = nullptr;
  Clock::duration delay{};
  std::deque<Held> held;  // arrival order = release order (one fixed delay)
  int64_t delayed = 0;
};

int OnPacket(nfq_q_handle*, nfgenmsg*, nfq_data* packet, void* data) {
  auto* state = static_cast<State*>(data);
  const nfqnl_msg_packet_hdr* header = nfq_get_msg_packet_hdr(packet);
  if (header == nullptr) return 0;
  state->held.push_back({ntohl(header->packet_id), Clock::now() + state->delay});
  return 0;
}

// Accepts every held packet due by `now` (all of them when `everything`).
void Release(State& state, bool everything) {
  const Clock::time_point now = Clock::now();
  while (!state.held.empty() && (everything || state.held.front().release <= now)) {
    nfq_set_verdict(state.queue, state.held.front().id, NF_ACCEPT, 0, nullptr);
    state.held.pop_front();
    ++state.delayed;
  }
}

int Usage(const char* why) {
  std::fprintf(stderr, "link_delay: %s\nusage: link_delay --queue N --delay-ms D --ready-file FILE\n",
               why);
  return 2;
}

}  // namespace

int main(int argc, char** argv) {
  long queue_num = -1, delay_ms = -1;
  std::string ready_file;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string flag = argv[i];
    if (flag == "--queue") {
      queue_num = std::strtol(argv[i + 1], nullptr, 10);
    } else if (flag == "--delay-ms") {
      delay_ms = std::strtol(argv[i + 1], nullptr, 10);
    } else if (flag == "--ready-file") {
      ready_file = argv[i + 1];
    } else {
      return Usage(("unknown flag " + flag).c_str());
    }
  }
  if (argc % 2 != 1) return Usage("every flag takes a value");
  if (queue_num < 0 || queue_num > 65535) return Usage("--queue must be in [0, 65535]");
  if (delay_ms < 0 || delay_ms > 10000) return Usage("--delay-ms must be in [0, 10000]");
  if (ready_file.empty()) return Usage("--ready-file is required");

  nfq_handle* handle = nfq_open();
  if (handle == nullptr) return Usage("nfq_open failed (needs CAP_NET_ADMIN)");
  State state;
  state.delay = std::chrono::milliseconds(delay_ms);
  state.queue = nfq_create_queue(handle, static_cast<uint16_t>(queue_num), &OnPacket, &state);
  if (state.queue == nullptr) {
    nfq_close(handle);
    return Usage("nfq_create_queue failed (queue number taken?)");
  }
  // Metadata only: the verdict needs the id, not the bytes. Room for a second's worth of packets
  // of a fast link in the kernel's queue and the socket, so a burst is delayed, not dropped.
  if (nfq_set_mode(state.queue, NFQNL_COPY_META, 0) < 0 ||
      nfq_set_queue_maxlen(state.queue, 65536) < 0) {
    nfq_destroy_queue(state.queue);
    nfq_close(handle);
    return Usage("configuring the queue failed");
  }
  nfnl_rcvbufsiz(nfq_nfnlh(handle), 32u << 20);
  signal(SIGTERM, OnSignal);
  signal(SIGINT, OnSignal);
  std::ofstream(ready_file) << "ready\n";

  const int fd = nfq_fd(handle);
  int64_t overflows = 0;
  alignas(8) char buffer[1 << 16];
  while (!g_stop) {
    int timeout_ms = 50;
    if (!state.held.empty()) {
      const auto wait = state.held.front().release - Clock::now();
      timeout_ms = static_cast<int>(std::max<int64_t>(
          0, std::chrono::ceil<std::chrono::milliseconds>(wait).count()));
    }
    pollfd p{fd, POLLIN, 0};
    if (poll(&p, 1, timeout_ms) > 0 && (p.revents & POLLIN)) {
      for (;;) {  // drain what is there
        const ssize_t n = recv(fd, buffer, sizeof(buffer), MSG_DONTWAIT);
        if (n >= 0) {
          nfq_handle_packet(handle, buffer, static_cast<int>(n));
          continue;
        }
        if (errno == ENOBUFS) {  // the kernel could not hand us some packets: it dropped them
          ++overflows;
          continue;
        }
        break;  // EAGAIN, or EINTR from the stop signal
      }
    }
    Release(state, /*everything=*/false);
  }
  Release(state, /*everything=*/true);
  std::fprintf(stderr, "link_delay: queue %ld, %ld ms: %lld packets delayed, %lld overflows\n",
               queue_num, delay_ms, static_cast<long long>(state.delayed),
               static_cast<long long>(overflows));
  nfq_destroy_queue(state.queue);
  nfq_close(handle);
  return 0;
}
