#include "common/metrics.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "glog/logging.h"

namespace fluxion::metrics {
namespace {

// C++17 has no fetch_add for atomic<double>; a CAS loop is lock-free on x86-64.
void AtomicAdd(std::atomic<double>& target, double delta) {
  double old = target.load(std::memory_order_relaxed);
  while (!target.compare_exchange_weak(old, old + delta, std::memory_order_relaxed)) {
  }
}

bool ValidName(const std::string& name, bool allow_colon) {
  if (name.empty()) return false;
  for (size_t i = 0; i < name.size(); ++i) {
    char c = name[i];
    bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_' ||
              (allow_colon && c == ':') || (i > 0 && c >= '0' && c <= '9');
    if (!ok) return false;
  }
  return true;
}

std::string EscapeLabelValue(const std::string& value) {
  std::string out;
  for (char c : value) {
    if (c == '\\') out += "\\\\";
    else if (c == '"') out += "\\\"";
    else if (c == '\n') out += "\\n";
    else out += c;
  }
  return out;
}

std::string EscapeHelp(const std::string& help) {
  std::string out;
  for (char c : help) {
    if (c == '\\') out += "\\\\";
    else if (c == '\n') out += "\\n";
    else out += c;
  }
  return out;
}

// `{a="1",b="2"}` (empty string for no labels), with an optional extra label appended last (`le`).
std::string RenderLabels(const Labels& labels, const std::string& extra_name = "",
                         const std::string& extra_value = "") {
  if (labels.empty() && extra_name.empty()) return "";
  std::string out = "{";
  bool first = true;
  for (const auto& [name, value] : labels) {
    absl::StrAppend(&out, first ? "" : ",", name, "=\"", EscapeLabelValue(value), "\"");
    first = false;
  }
  if (!extra_name.empty()) {
    absl::StrAppend(&out, first ? "" : ",", extra_name, "=\"", extra_value, "\"");
  }
  out += "}";
  return out;
}

const char* TypeName(int type) {
  switch (type) {
    case 0: return "counter";
    case 1: return "gauge";
    default: return "histogram";
  }
}

}  // namespace

void Counter::Increment(double delta) {
  if (!(delta >= 0)) return;
  AtomicAdd(value_, delta);
}

void Gauge::Add(double delta) { AtomicAdd(value_, delta); }

Histogram::Histogram(std::vector<double> upper_bounds)
    : upper_bounds_(std::move(upper_bounds)),
      counts_(new std::atomic<uint64_t>[upper_bounds_.size() + 1]) {
  for (size_t i = 0; i + 1 < upper_bounds_.size(); ++i) {
    CHECK_LT(upper_bounds_[i], upper_bounds_[i + 1]) << "histogram bounds must ascend";
  }
  for (double b : upper_bounds_) CHECK(std::isfinite(b)) << "histogram bounds must be finite";
  for (size_t i = 0; i <= upper_bounds_.size(); ++i) counts_[i].store(0);
}

void Histogram::Observe(double value) {
  // Prometheus buckets are `le` (less than or equal): the first bound >= value.
  size_t i = std::lower_bound(upper_bounds_.begin(), upper_bounds_.end(), value) -
             upper_bounds_.begin();
  counts_[i].fetch_add(1, std::memory_order_relaxed);
  AtomicAdd(sum_, value);
}

Histogram::Snapshot Histogram::Read() const {
  Snapshot s;
  s.upper_bounds = upper_bounds_;
  s.cumulative.resize(upper_bounds_.size() + 1);
  uint64_t running = 0;
  for (size_t i = 0; i <= upper_bounds_.size(); ++i) {
    running += counts_[i].load(std::memory_order_relaxed);
    s.cumulative[i] = running;
  }
  s.sum = sum_.load(std::memory_order_relaxed);
  return s;
}

std::vector<double> LatencyBuckets() {
  return {0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 30, 60};
}

std::vector<double> ExponentialBuckets(double start, double factor, int count) {
  CHECK_GT(start, 0);
  CHECK_GT(factor, 1);
  std::vector<double> out;
  double v = start;
  for (int i = 0; i < count; ++i, v *= factor) out.push_back(v);
  return out;
}

std::string FormatValue(double value) {
  if (std::isnan(value)) return "NaN";
  if (std::isinf(value)) return value > 0 ? "+Inf" : "-Inf";
  char buf[32];
  if (value == std::floor(value) && std::fabs(value) < 1e15) {
    std::snprintf(buf, sizeof(buf), "%.0f", value);  // integers as integers: "10", not "1e+01"
    return buf;
  }
  // Shortest precision that reads back to the same double, so 0.005 prints as "0.005".
  for (int precision = 1; precision <= 17; ++precision) {
    std::snprintf(buf, sizeof(buf), "%.*g", precision, value);
    if (std::strtod(buf, nullptr) == value) break;
  }
  return buf;
}

Registry& Registry::Default() {
  static Registry* registry = new Registry();
  return *registry;
}

Registry::Series& Registry::GetSeries(const std::string& name, const std::string& help, Type type,
                                      const Labels& labels,
                                      const std::vector<double>* upper_bounds) {
  CHECK(ValidName(name, /*allow_colon=*/true)) << "bad metric name '" << name << "'";
  if (type == Type::kCounter) {
    CHECK(absl::EndsWith(name, "_total")) << "counter '" << name << "' must end in _total";
  }
  Labels sorted = labels;
  std::sort(sorted.begin(), sorted.end());
  for (size_t i = 0; i < sorted.size(); ++i) {
    CHECK(ValidName(sorted[i].first, /*allow_colon=*/false) &&
          !absl::StartsWith(sorted[i].first, "__") && sorted[i].first != "le")
        << "bad label name '" << sorted[i].first << "' on " << name;
    CHECK(i == 0 || sorted[i - 1].first != sorted[i].first)
        << "label '" << sorted[i].first << "' repeated on " << name;
  }
  auto [it, inserted] = families_.try_emplace(name);
  Family& family = it->second;
  if (inserted) {
    family.type = type;
    family.help = help;
    if (upper_bounds != nullptr) family.upper_bounds = *upper_bounds;
  } else {
    CHECK(family.type == type) << "metric '" << name << "' registered with two types";
    CHECK(upper_bounds == nullptr || family.upper_bounds == *upper_bounds)
        << "histogram '" << name << "' registered with two sets of buckets";
  }
  std::string key = RenderLabels(sorted);
  auto [series_it, new_series] = family.series.try_emplace(key);
  if (new_series) series_it->second.labels = std::move(sorted);
  return series_it->second;
}

Counter* Registry::AddCounter(const std::string& name, const std::string& help,
                              const Labels& labels) {
  absl::MutexLock lock(&mu_);
  Series& s = GetSeries(name, help, Type::kCounter, labels, nullptr);
  CHECK(!s.callback) << "counter '" << name << "' is already a callback counter";
  if (s.counter == nullptr) s.counter = std::make_unique<Counter>();
  return s.counter.get();
}

Gauge* Registry::AddGauge(const std::string& name, const std::string& help, const Labels& labels) {
  absl::MutexLock lock(&mu_);
  Series& s = GetSeries(name, help, Type::kGauge, labels, nullptr);
  CHECK(!s.callback) << "gauge '" << name << "' is already a callback gauge";
  if (s.gauge == nullptr) s.gauge = std::make_unique<Gauge>();
  return s.gauge.get();
}

Histogram* Registry::AddHistogram(const std::string& name, const std::string& help,
                                  std::vector<double> upper_bounds, const Labels& labels) {
  absl::MutexLock lock(&mu_);
  Series& s = GetSeries(name, help, Type::kHistogram, labels, &upper_bounds);
  if (s.histogram == nullptr) s.histogram = std::make_unique<Histogram>(std::move(upper_bounds));
  return s.histogram.get();
}

void Registry::AddGaugeCallback(const std::string& name, const std::string& help,
                                const Labels& labels, std::function<double()> read) {
  absl::MutexLock lock(&mu_);
  Series& s = GetSeries(name, help, Type::kGauge, labels, nullptr);
  CHECK(s.gauge == nullptr) << "gauge '" << name << "' is already a plain gauge";
  s.callback = std::move(read);
}

void Registry::AddCounterCallback(const std::string& name, const std::string& help,
                                  const Labels& labels, std::function<double()> read) {
  absl::MutexLock lock(&mu_);
  Series& s = GetSeries(name, help, Type::kCounter, labels, nullptr);
  CHECK(s.counter == nullptr) << "counter '" << name << "' is already a plain counter";
  s.callback = std::move(read);
}

void Registry::Remove(const std::string& name, const Labels& labels) {
  absl::MutexLock lock(&mu_);
  auto it = families_.find(name);
  if (it == families_.end()) return;
  Labels sorted = labels;
  std::sort(sorted.begin(), sorted.end());
  it->second.series.erase(RenderLabels(sorted));
  if (it->second.series.empty()) families_.erase(it);
}

std::string Registry::Render() const {
  absl::MutexLock lock(&mu_);
  std::string out;
  for (const auto& [name, family] : families_) {
    absl::StrAppend(&out, "# HELP ", name, " ", EscapeHelp(family.help), "\n");
    absl::StrAppend(&out, "# TYPE ", name, " ", TypeName(static_cast<int>(family.type)), "\n");
    for (const auto& [key, s] : family.series) {
      switch (family.type) {
        case Type::kCounter:
          absl::StrAppend(&out, name, key, " ",
                          FormatValue(s.callback ? s.callback() : s.counter->value()), "\n");
          break;
        case Type::kGauge: {
          double v = s.callback ? s.callback() : s.gauge->value();
          absl::StrAppend(&out, name, key, " ", FormatValue(v), "\n");
          break;
        }
        case Type::kHistogram: {
          Histogram::Snapshot snap = s.histogram->Read();
          for (size_t i = 0; i <= snap.upper_bounds.size(); ++i) {
            std::string le = i < snap.upper_bounds.size() ? FormatValue(snap.upper_bounds[i])
                                                          : std::string("+Inf");
            absl::StrAppend(&out, name, "_bucket", RenderLabels(s.labels, "le", le), " ",
                            snap.cumulative[i], "\n");
          }
          // _count is the +Inf bucket of the same snapshot, so the two always agree even while
          // other threads observe.
          absl::StrAppend(&out, name, "_sum", key, " ", FormatValue(snap.sum), "\n");
          absl::StrAppend(&out, name, "_count", key, " ", snap.cumulative.back(), "\n");
          break;
        }
      }
    }
  }
  return out;
}

}  // namespace fluxion::metrics
