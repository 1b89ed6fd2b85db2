#include "cluster/replay_report.h"

#include <sys/stat.h>

#include <algorithm>
#include <cstdlib>
#include <fstream>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"

namespace fluxion::cluster {
namespace {

nlohmann::json DistributionJson(const Distribution& d) {
  return {{"count", d.count}, {"mean", d.mean}, {"std", d.std}, {"min", d.min},
          {"max", d.max},     {"p50", d.p50},   {"p90", d.p90}, {"p99", d.p99}};
}

absl::Status OpenError(const std::string& path) {
  return absl::PermissionDeniedError(absl::StrCat("cannot write '", path, "'"));
}

// CSV field: quoted when it holds a comma, quote or newline.
std::string CsvField(const std::string& s) {
  if (s.find_first_of(",\"\n") == std::string::npos) return s;
  std::string out = "\"";
  for (char c : s) out += c == '"' ? std::string("\"\"") : std::string(1, c);
  return out + "\"";
}

// Gnuplot string literal in single quotes (only '' needs escaping).
std::string GpString(const std::string& s) {
  std::string out = "'";
  for (char c : s) out += c == '\'' ? std::string("''") : std::string(1, c);
  return out + "'";
}

absl::Status WriteCdf(const std::string& path, std::vector<double> values) {
  std::ofstream out(path);
  if (!out) return OpenError(path);
  std::sort(values.begin(), values.end());
  for (size_t i = 0; i < values.size(); ++i) {
    out << values[i] << " " << static_cast<double>(i + 1) / values.size() << "\n";
  }
  if (values.empty()) out << "0 0\n";  // gnuplot refuses an empty file
  return absl::OkStatus();
}

}  // namespace

nlohmann::json StatsToJson(const ReplayStats& s, const RunDescription& run) {
  nlohmann::json errors = nlohmann::json::object();
  for (const auto& [code, n] : s.errors_by_code) errors[code] = n;
  nlohmann::json timeline = nlohmann::json::array();
  for (const TimelinePoint& p : s.timeline) {
    timeline.push_back({{"t_s", p.t_s},
                        {"output_tokens_per_s", p.output_tokens_per_s},
                        {"completed_per_s", p.completed_per_s},
                        {"inflight", p.inflight}});
  }
  const TransformReport& t = run.transform;
  return {
      {"config", run.config},
      {"transform",
       {{"requests_in", t.requests_in},
        {"requests_out", t.requests_out},
        {"inputs_capped", t.inputs_capped},
        {"outputs_capped", t.outputs_capped},
        {"span_in_s", t.span_in_s},
        {"span_out_s", t.span_out_s}}},
      {"requests", s.requests},
      {"succeeded", s.succeeded},
      {"failed", s.failed},
      {"cancelled", s.cancelled},
      {"errors_by_code", errors},
      {"duration_s", s.duration_s},
      {"ttft_ms", DistributionJson(s.ttft_ms)},
      {"tpot_ms", DistributionJson(s.tpot_ms)},
      {"itl_ms", DistributionJson(s.itl_ms)},
      {"e2e_ms", DistributionJson(s.e2e_ms)},
      {"input_tokens", s.input_tokens},
      {"output_tokens", s.output_tokens},
      {"requests_per_s", s.request_throughput},
      {"tokens_per_s", s.output_token_throughput},
      {"total_tokens_per_s", s.total_token_throughput},
      {"slo", {{"ttft_ms", s.slo.ttft_ms}, {"tpot_ms", s.slo.tpot_ms}, {"e2e_ms", s.slo.e2e_ms}}},
      {"good_requests", s.good_requests},
      {"goodput_requests_per_s", s.goodput},
      {"slo_attainment", s.slo_attainment},
      {"timeline_bucket_s", s.timeline_bucket_s},
      {"timeline", timeline},
  };
}

std::string FormatSummary(const ReplayStats& s, const RunDescription& run) {
  std::string out = "==================== fluxion replay ====================\n";
  auto row = [&](const std::string& name, const std::string& value) {
    absl::StrAppend(&out, absl::StrFormat("%-22s %s\n", name, value));
  };
  for (const char* key : {"target", "source", "mode", "transforms", "cancellation"}) {
    if (run.config.contains(key)) row(key, run.config[key].get<std::string>());
  }
  const TransformReport& t = run.transform;
  if (t.requests_in != t.requests_out || t.inputs_capped > 0 || t.outputs_capped > 0) {
    row("schedule", absl::StrFormat("%lld of %lld requests, span %.1f s -> %.1f s, %lld inputs "
                                    "and %lld outputs capped",
                                    static_cast<long long>(t.requests_out),
                                    static_cast<long long>(t.requests_in), t.span_in_s,
                                    t.span_out_s, static_cast<long long>(t.inputs_capped),
                                    static_cast<long long>(t.outputs_capped)));
  }
  std::string failures;
  for (const auto& [code, n] : s.errors_by_code) {
    absl::StrAppend(&failures, failures.empty() ? " (" : ", ", code, " ", n);
  }
  if (!failures.empty()) failures += ")";
  row("requests", absl::StrFormat("%lld sent, %lld succeeded, %lld failed%s%s",
                                  static_cast<long long>(s.requests),
                                  static_cast<long long>(s.succeeded),
                                  static_cast<long long>(s.failed), failures,
                                  s.cancelled > 0 ? absl::StrFormat(", %lld cancelled on purpose",
                                                                    static_cast<long long>(s.cancelled))
                                                  : std::string()));
  row("duration", absl::StrFormat("%.2f s", s.duration_s));
  row("tokens", absl::StrFormat("%lld in, %lld out (succeeded requests)",
                                static_cast<long long>(s.input_tokens),
                                static_cast<long long>(s.output_tokens)));
  row("throughput", absl::StrFormat("%.2f req/s, %.1f output tok/s, %.1f total tok/s",
                                    s.request_throughput, s.output_token_throughput,
                                    s.total_token_throughput));
  if (s.slo.any()) {
    std::vector<std::string> parts;
    if (s.slo.ttft_ms > 0) parts.push_back(absl::StrFormat("TTFT <= %g ms", s.slo.ttft_ms));
    if (s.slo.tpot_ms > 0) parts.push_back(absl::StrFormat("TPOT <= %g ms", s.slo.tpot_ms));
    if (s.slo.e2e_ms > 0) parts.push_back(absl::StrFormat("E2E <= %g ms", s.slo.e2e_ms));
    row("goodput", absl::StrFormat("%.2f req/s (%lld requests, %.1f%% attainment; %s)", s.goodput,
                                   static_cast<long long>(s.good_requests),
                                   100 * s.slo_attainment, absl::StrJoin(parts, ", ")));
  }
  absl::StrAppend(&out, absl::StrFormat("\n%-8s %8s %10s %10s %10s %10s %10s\n", "(ms)", "count",
                                        "mean", "p50", "p90", "p99", "max"));
  auto dist = [&](const char* name, const Distribution& d) {
    absl::StrAppend(&out, absl::StrFormat("%-8s %8lld %10.2f %10.2f %10.2f %10.2f %10.2f\n", name,
                                          static_cast<long long>(d.count), d.mean, d.p50, d.p90,
                                          d.p99, d.max));
  };
  dist("TTFT", s.ttft_ms);
  dist("TPOT", s.tpot_ms);
  dist("ITL", s.itl_ms);
  dist("E2E", s.e2e_ms);
  out += "========================================================\n";
  return out;
}

absl::Status WriteRequestsCsv(const std::string& path, const std::vector<RequestRecord>& records) {
  std::ofstream out(path);
  if (!out) return OpenError(path);
  out << "index,request_id,scheduled_s,start_s,end_s,input_tokens,requested_output_tokens,"
         "output_tokens,ttft_ms,tpot_ms,e2e_ms,status,cancelled_by_client,message\n";
  for (const RequestRecord& r : records) {
    out << r.index << "," << CsvField(r.request_id) << "," << r.scheduled_s << "," << r.start_s
        << "," << r.end_s << "," << r.input_tokens << "," << r.requested_output_tokens << ","
        << r.output_tokens << "," << TtftMs(r) << "," << TpotMs(r) << "," << E2eMs(r) << ","
        << StatusCodeName(r.status_code) << "," << (r.cancelled_by_client ? 1 : 0) << ","
        << CsvField(r.status_message) << "\n";
  }
  return out ? absl::OkStatus() : OpenError(path);
}

absl::Status WriteTimelineCsv(const std::string& path, const ReplayStats& s) {
  std::ofstream out(path);
  if (!out) return OpenError(path);
  out << "t_s,output_tokens_per_s,completed_per_s,inflight\n";
  for (const TimelinePoint& p : s.timeline) {
    out << p.t_s << "," << p.output_tokens_per_s << "," << p.completed_per_s << "," << p.inflight
        << "\n";
  }
  return out ? absl::OkStatus() : OpenError(path);
}

absl::Status WriteJson(const std::string& path, const nlohmann::json& json) {
  std::ofstream out(path);
  if (!out) return OpenError(path);
  out << json.dump(2) << "\n";
  return out ? absl::OkStatus() : OpenError(path);
}

absl::StatusOr<std::vector<std::string>> RenderPlots(const std::string& dir,
                                                     const std::string& format,
                                                     const std::vector<RequestRecord>& records,
                                                     const ReplayStats& stats,
                                                     const std::string& title) {
  if (format != "png" && format != "svg") {
    return absl::InvalidArgumentError(absl::StrCat("plot format '", format, "': use png or svg"));
  }
  mkdir(dir.c_str(), 0755);
  std::vector<double> ttft, tpot, itl, e2e;
  for (const RequestRecord& r : records) {
    if (!r.ok()) continue;
    if (TtftMs(r) >= 0) ttft.push_back(TtftMs(r));
    if (TpotMs(r) >= 0) tpot.push_back(TpotMs(r));
    for (double g : ItlMs(r)) itl.push_back(g);
    e2e.push_back(E2eMs(r));
  }
  for (auto& [name, values] : std::vector<std::pair<std::string, std::vector<double>*>>{
           {"ttft", &ttft}, {"tpot", &tpot}, {"itl", &itl}, {"e2e", &e2e}}) {
    absl::Status st = WriteCdf(absl::StrCat(dir, "/cdf_", name, ".dat"), *values);
    if (!st.ok()) return st;
  }
  absl::Status st = WriteTimelineCsv(absl::StrCat(dir, "/timeline.csv"), stats);
  if (!st.ok()) return st;

  const std::string terminal = format == "png" ? "pngcairo size 1200,800 font ',10'"
                                               : "svg size 1200,800 dynamic font 'sans,10'";
  const std::string cdf_image = absl::StrCat(dir, "/latency_cdf.", format);
  const std::string timeline_image = absl::StrCat(dir, "/timeline.", format);
  const std::string script_path = absl::StrCat(dir, "/plots.gp");
  {
    std::ofstream gp(script_path);
    if (!gp) return OpenError(script_path);
    gp << "# Made by fluxion replay; rerun with: gnuplot " << script_path << "\n"
       << "set terminal " << terminal << "\n"
       << "set termoption noenhanced\n"  // file names hold '_', which would become subscripts
       << "set datafile separator whitespace\n"
       << "set output " << GpString(cdf_image) << "\n"
       << "set multiplot layout 2,2 title " << GpString("Latency CDFs: " + title) << "\n"
       << "set grid\nset key off\nset ylabel 'cumulative fraction'\nset yrange [0:1]\n";
    for (const auto& [name, label] : std::vector<std::pair<std::string, std::string>>{
             {"ttft", "TTFT (ms)"}, {"tpot", "TPOT (ms)"}, {"itl", "ITL, gaps between chunks (ms)"},
             {"e2e", "E2E latency (ms)"}}) {
      gp << "set xlabel " << GpString(label) << "\n"
         << "plot " << GpString(absl::StrCat(dir, "/cdf_", name, ".dat"))
         << " using 1:2 with steps lw 2\n";
    }
    gp << "unset multiplot\n"
       << "set output " << GpString(timeline_image) << "\n"
       << "set datafile separator ','\n"
       << "set multiplot layout 2,1 title " << GpString("Over time: " + title) << "\n"
       << "set yrange [0:*]\nset xlabel 'time since start (s)'\nset key top left\n"
       << "set ylabel 'output tokens/s'\nset y2label 'completed requests/s'\n"
       << "set ytics nomirror\nset y2tics\nset y2range [0:*]\n"
       << "plot " << GpString(dir + "/timeline.csv")
       << " every ::1 using 1:2 with lines lw 2 title 'output tokens/s', '' every ::1 using 1:3 "
          "axes x1y2 with lines title 'completed requests/s'\n"
       << "unset y2tics\nunset y2label\nset ylabel 'requests in flight'\n"
       << "plot " << GpString(dir + "/timeline.csv")
       << " every ::1 using 1:4 with lines lw 2 title 'in flight (time-averaged)'\n"
       << "unset multiplot\n";
  }
  if (std::system("command -v gnuplot >/dev/null 2>&1") != 0) {
    return absl::FailedPreconditionError(absl::StrCat(
        "gnuplot is not installed (Debian package gnuplot-nox); data and script are in ", dir));
  }
  std::string command = absl::StrCat("gnuplot '", script_path, "' 2>'", dir, "/gnuplot.log'");
  if (std::system(command.c_str()) != 0) {
    return absl::InternalError(absl::StrCat("gnuplot failed; see ", dir, "/gnuplot.log"));
  }
  return std::vector<std::string>{cdf_image, timeline_image};
}

}  // namespace fluxion::cluster
