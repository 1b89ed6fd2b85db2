// A small metrics registry: counters, gauges and histograms, rendered in the Prometheus text
// exposition format (version 0.0.4). Served over HTTP by common/metrics_http.h; metric names and
// what each server exports are in docs/METRICS.md.
//
// Why hand-written: Debian 12 ships no prometheus-cpp, and the text format is a few dozen lines.
//
// Usage (a service creates its metrics once, keeps the pointers, updates them on the hot path):
//
//   metrics::Registry& registry = metrics::Registry::Default();
//   metrics::Counter* requests = registry.AddCounter(
//       "fluxion_decode_requests_total", "Generate calls finished, by status code.",
//       {{"code", "OK"}});
//   metrics::Gauge* running = registry.AddGauge("fluxion_decode_requests_running", "...");
//   metrics::Histogram* ttft = registry.AddHistogram(
//       "fluxion_decode_time_to_first_token_seconds", "...", metrics::LatencyBuckets());
//   requests->Increment(); running->Set(n); ttft->Observe(0.042);
//   registry.AddGaugeCallback("fluxion_kv_pages_free", "...", {}, [&] { return pool.free(); });
//
// Add* returns the existing metric when called again with the same name and labels, so callers
// need not coordinate who creates it. Names and labels are compile-time constants in practice, so
// a malformed name, a counter not ending in `_total`, or one name used with two types is a bug:
// it CHECK-fails at registration, never at scrape time.
//
// Thread-safety: everything is thread-safe. Counter, Gauge and Histogram updates are lock-free
// (atomics); registration and Render() take the registry's mutex. A gauge callback runs inside
// Render() on the scraping thread and must not call back into the registry.
#ifndef FLUXION_COMMON_METRICS_H_
#define FLUXION_COMMON_METRICS_H_

#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"

namespace fluxion::metrics {

// Label name/value pairs of one series, e.g. {{"code", "OK"}}. Order does not matter.
using Labels = std::vector<std::pair<std::string, std::string>>;

// A monotonically increasing value (requests, bytes, seconds of CPU).
class Counter {
 public:
  // REQUIRES: delta >= 0 (a negative delta is ignored: counters never go down).
  void Increment(double delta = 1.0);
  double value() const { return value_.load(std::memory_order_relaxed); }

 private:
  std::atomic<double> value_{0.0};
};

// A value that goes up and down (running requests, free pages).
class Gauge {
 public:
  void Set(double value) { value_.store(value, std::memory_order_relaxed); }
  void Add(double delta);
  double value() const { return value_.load(std::memory_order_relaxed); }

 private:
  std::atomic<double> value_{0.0};
};

// A distribution in fixed buckets (Prometheus cumulative `le` buckets are computed at render time).
class Histogram {
 public:
  // `upper_bounds` ascending and finite; the +Inf bucket is implicit.
  explicit Histogram(std::vector<double> upper_bounds);
  void Observe(double value);

  struct Snapshot {
    std::vector<double> upper_bounds;   // [buckets], without +Inf
    std::vector<uint64_t> cumulative;   // [buckets + 1], the last one is +Inf (== count)
    double sum = 0.0;
  };
  Snapshot Read() const;

 private:
  const std::vector<double> upper_bounds_;
  std::unique_ptr<std::atomic<uint64_t>[]> counts_;  // [buckets + 1], not cumulative
  std::atomic<double> sum_{0.0};
};

// Bucket bounds for latencies in seconds, 1 ms to 60 s.
std::vector<double> LatencyBuckets();
// `count` bounds start, start*factor, start*factor^2, ...  REQUIRES: start > 0, factor > 1.
std::vector<double> ExponentialBuckets(double start, double factor, int count);

// Formats a value the way Prometheus expects: shortest round-trip decimal, "+Inf", "-Inf", "NaN".
std::string FormatValue(double value);

class Registry {
 public:
  Registry() = default;
  Registry(const Registry&) = delete;
  Registry& operator=(const Registry&) = delete;

  // The process-wide registry that `fluxion` servers expose at /metrics.
  static Registry& Default();

  // Each returns the metric for (name, labels), creating it on first use. The pointer stays valid
  // for the registry's lifetime. `help` is taken from the first registration of a name.
  // REQUIRES: name matches [a-zA-Z_:][a-zA-Z0-9_:]*; counters end in "_total"; label names match
  // [a-zA-Z_][a-zA-Z0-9_]* and do not start with "__"; a name keeps one type (and for histograms
  // one set of bounds).
  Counter* AddCounter(const std::string& name, const std::string& help, const Labels& labels = {});
  Gauge* AddGauge(const std::string& name, const std::string& help, const Labels& labels = {});
  Histogram* AddHistogram(const std::string& name, const std::string& help,
                          std::vector<double> upper_bounds, const Labels& labels = {});
  // A gauge whose value is computed at scrape time by `read` (e.g. free pages read from a pool
  // that already counts them). Registering the same name and labels again replaces the callback.
  void AddGaugeCallback(const std::string& name, const std::string& help, const Labels& labels,
                        std::function<double()> read);
  // A counter read at scrape time from a count something else already keeps (a service's plain
  // metrics struct). `read` must never decrease. Same replacement rule as AddGaugeCallback.
  void AddCounterCallback(const std::string& name, const std::string& help, const Labels& labels,
                          std::function<double()> read);
  // Removes the series (name, labels), if any; a family left without series is no longer
  // rendered. For callbacks whose objects are about to be destroyed (a service shutting down).
  void Remove(const std::string& name, const Labels& labels = {});

  // The whole registry in the Prometheus text format, families sorted by name.
  std::string Render() const;

 private:
  enum class Type { kCounter, kGauge, kHistogram };
  struct Series {
    Labels labels;  // sorted by name
    std::unique_ptr<Counter> counter;
    std::unique_ptr<Gauge> gauge;
    std::unique_ptr<Histogram> histogram;
    std::function<double()> callback;
  };
  struct Family {
    Type type;
    std::string help;
    std::vector<double> upper_bounds;          // histograms only
    std::map<std::string, Series> series;      // keyed by the rendered label set
  };
  Series& GetSeries(const std::string& name, const std::string& help, Type type,
                    const Labels& labels, const std::vector<double>* upper_bounds)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  mutable absl::Mutex mu_;
  std::map<std::string, Family> families_ ABSL_GUARDED_BY(mu_);
};

}  // namespace fluxion::metrics

#endif  // FLUXION_COMMON_METRICS_H_
