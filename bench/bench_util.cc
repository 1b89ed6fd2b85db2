#include "bench/bench_util.h"

#include <omp.h>
#include <sys/utsname.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <ctime>
#include <fstream>
#include <memory>
#include <thread>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/strip.h"
#include "kernels/cpu/cpu_features.h"
#include "kernels/cpu/cpu_ops.h"

namespace fluxion::bench {
namespace {

std::string FirstLineWith(const std::string& path, const std::string& key) {
  std::ifstream in(path);
  std::string line;
  while (std::getline(in, line)) {
    if (absl::StartsWith(line, key)) {
      auto colon = line.find_first_of(":=");
      std::string value = colon == std::string::npos ? line : line.substr(colon + 1);
      return std::string(absl::StripAsciiWhitespace(absl::StripSuffix(
          absl::StripPrefix(absl::StripAsciiWhitespace(value), "\""), "\"")));
    }
  }
  return "";
}

std::string RunAndRead(const char* cmd) {
  std::unique_ptr<FILE, int (*)(FILE*)> pipe(popen(cmd, "r"), pclose);
  if (!pipe) return "";
  char buf[256];
  std::string out;
  while (fgets(buf, sizeof(buf), pipe.get()) != nullptr) out += buf;
  return std::string(absl::StripAsciiWhitespace(out));
}

}  // namespace

std::string MachineDescription() {
  const std::string cpu = FirstLineWith("/proc/cpuinfo", "model name");
  const std::string mem_kb = FirstLineWith("/proc/meminfo", "MemTotal");
  const std::string os = FirstLineWith("/etc/os-release", "PRETTY_NAME");
  double gib = 0;
  std::sscanf(mem_kb.c_str(), "%lf", &gib);
  gib /= 1024.0 * 1024.0;
  char mem[32];
  std::snprintf(mem, sizeof(mem), "%.0f GiB", gib);
  return absl::StrCat(cpu.empty() ? "unknown CPU" : cpu, ", ", std::thread::hardware_concurrency(),
                      " cores, ", mem, ", ", os);
}

Stats Summarize(std::vector<double> v) {
  Stats s;
  if (v.empty()) return s;
  std::sort(v.begin(), v.end());
  auto at = [&](double q) { return v[static_cast<size_t>(q * (v.size() - 1) + 0.5)]; };
  s.median = at(0.5);
  s.p10 = at(0.1);
  s.p90 = at(0.9);
  s.min = v.front();
  s.max = v.back();
  return s;
}

nlohmann::json ResultEnvelope(const std::string& command, const nlohmann::json& limits,
                              const nlohmann::json& results) {
  char date[16];
  std::time_t now = std::time(nullptr);
  std::strftime(date, sizeof(date), "%Y-%m-%d", std::gmtime(&now));
  std::string git = RunAndRead("git rev-parse --short HEAD 2>/dev/null");
  if (!git.empty() && !RunAndRead("git status --porcelain --untracked-files=no 2>/dev/null").empty())
    git += "-dirty";
  return nlohmann::json{{"command", command},
                        {"machine", MachineDescription()},
                        {"cpu_kernels", kernels::cpu::CpuIsaName(kernels::cpu::ActiveCpuIsa())},
                        {"blas_core", kernels::cpu::BlasCoreName()},
                        {"date", date},
                        {"git", git.empty() ? "unknown" : git},
                        {"limits", limits},
                        {"results", results}};
}

absl::Status WriteJson(const std::string& path, const nlohmann::json& doc) {
  std::ofstream out(path);
  out << doc.dump(2) << "\n";
  out.close();
  if (!out) return absl::InternalError(absl::StrCat("cannot write ", path));
  return absl::OkStatus();
}

std::string JoinCommand(const std::string& prefix, const std::vector<std::string>& args) {
  return absl::StrCat(prefix, args.empty() ? "" : " ", absl::StrJoin(args, " "));
}

}  // namespace fluxion::bench
