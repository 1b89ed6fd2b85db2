// The run-time ISA choice: the pure rule on made-up CPUs, detection against what the OS reports,
// and the process-wide choice, including FLUXION_CPU_ISA (set in child processes only).
#include "kernels/cpu/cpu_features.h"

#include <cstdlib>
#include <fstream>
#include <set>
#include <sstream>
#include <string>

#include "gtest/gtest.h"
#include "kernels/cpu/paged_attention_impl.h"

namespace fluxion::kernels::cpu {
namespace {

CpuFeatures Avx2Cpu() {
  CpuFeatures f;
  f.avx2 = f.fma = true;
  return f;
}

CpuFeatures Avx512Cpu() {  // Skylake-SP .. Ice Lake: no BF16
  CpuFeatures f = Avx2Cpu();
  f.avx512f = f.avx512bw = f.avx512vl = f.avx512dq = true;
  return f;
}

CpuFeatures Avx512Bf16Cpu() {  // Cooper Lake, Sapphire Rapids and later, Zen 4
  CpuFeatures f = Avx512Cpu();
  f.avx512bf16 = true;
  return f;
}

TEST(ChooseCpuIsaTest, DefaultIsAvx2OnACpuWithoutAvx512) {
  std::string note = "stale";
  EXPECT_EQ(ChooseCpuIsa(Avx2Cpu(), true, nullptr, &note), CpuIsa::kAvx2);
  EXPECT_EQ(note, "");
}

TEST(ChooseCpuIsaTest, DefaultIsFp32Avx512EvenWhenBf16IsAvailable) {
  EXPECT_EQ(ChooseCpuIsa(Avx512Cpu(), true, nullptr, nullptr), CpuIsa::kAvx512);
  EXPECT_EQ(ChooseCpuIsa(Avx512Bf16Cpu(), true, nullptr, nullptr), CpuIsa::kAvx512);
  EXPECT_EQ(ChooseCpuIsa(Avx512Bf16Cpu(), true, "", nullptr), CpuIsa::kAvx512);
}

TEST(ChooseCpuIsaTest, Avx512FoundationAloneIsNotEnough) {
  CpuFeatures knights_landing = Avx2Cpu();  // F (and CD/ER/PF) but no BW/VL/DQ
  knights_landing.avx512f = true;
  EXPECT_EQ(ChooseCpuIsa(knights_landing, true, "avx512", nullptr), CpuIsa::kAvx2);
}

TEST(ChooseCpuIsaTest, ForcedAvx2IsHonouredOnAnAvx512Cpu) {
  std::string note;
  EXPECT_EQ(ChooseCpuIsa(Avx512Bf16Cpu(), true, "avx2", &note), CpuIsa::kAvx2);
  EXPECT_EQ(note, "");
}

TEST(ChooseCpuIsaTest, ForcedAvx512Bf16IsHonouredWhereTheCpuHasIt) {
  EXPECT_EQ(ChooseCpuIsa(Avx512Bf16Cpu(), true, "avx512bf16", nullptr), CpuIsa::kAvx512Bf16);
}

TEST(ChooseCpuIsaTest, ForcedAvx512FallsBackToAvx2OnACpuWithoutItAndSaysSo) {
  std::string note;
  EXPECT_EQ(ChooseCpuIsa(Avx2Cpu(), true, "avx512", &note), CpuIsa::kAvx2);
  EXPECT_NE(note.find("this CPU lacks it"), std::string::npos) << note;
  EXPECT_NE(note.find("using avx2"), std::string::npos) << note;
}

TEST(ChooseCpuIsaTest, ForcedAvx512Bf16FallsBackToAvx512WithoutBf16) {
  std::string note;
  EXPECT_EQ(ChooseCpuIsa(Avx512Cpu(), true, "avx512bf16", &note), CpuIsa::kAvx512);
  EXPECT_NE(note.find("using avx512"), std::string::npos) << note;
}

TEST(ChooseCpuIsaTest, OnlyAvx2WhenTheBuildLacksTheAvx512Kernels) {
  std::string note;
  EXPECT_EQ(ChooseCpuIsa(Avx512Bf16Cpu(), false, nullptr, &note), CpuIsa::kAvx2);
  EXPECT_EQ(note, "");  // the default asked for nothing in particular
  EXPECT_EQ(ChooseCpuIsa(Avx512Bf16Cpu(), false, "avx512bf16", &note), CpuIsa::kAvx2);
  EXPECT_NE(note.find("FLUXION_ENABLE_AVX512"), std::string::npos) << note;
}

TEST(ChooseCpuIsaTest, UnknownNameKeepsTheDefaultAndSaysSo) {
  std::string note;
  EXPECT_EQ(ChooseCpuIsa(Avx512Bf16Cpu(), true, "AVX-512", &note), CpuIsa::kAvx512);
  EXPECT_NE(note.find("not one of avx2, avx512, avx512bf16"), std::string::npos) << note;
  EXPECT_EQ(ChooseCpuIsa(Avx2Cpu(), true, "sse4", &note), CpuIsa::kAvx2);
}

TEST(ChooseCpuIsaTest, NeverChoosesAnIsaTheCpuOrBuildCannotRun) {
  // Every combination of the seven features, both builds, every request.
  for (int bits = 0; bits < (1 << 7); ++bits) {
    CpuFeatures f;
    f.avx2 = bits & 1;
    f.fma = bits & 2;
    f.avx512f = bits & 4;
    f.avx512bw = bits & 8;
    f.avx512vl = bits & 16;
    f.avx512dq = bits & 32;
    f.avx512bf16 = bits & 64;
    for (bool compiled : {false, true}) {
      for (const char* requested :
           {static_cast<const char*>(nullptr), "avx2", "avx512", "avx512bf16", "bogus"}) {
        const CpuIsa isa = ChooseCpuIsa(f, compiled, requested, nullptr);
        // AVX2 is the baseline the build assumes of every machine; anything above needs both.
        if (isa != CpuIsa::kAvx2) {
          EXPECT_TRUE(compiled && CpuCanRun(isa, f))
              << "features " << bits << " request " << (requested ? requested : "(none)");
        }
      }
    }
  }
}

TEST(CpuFeaturesTest, DetectionAgreesWithTheFlagsTheKernelReports) {
  std::ifstream cpuinfo("/proc/cpuinfo");
  std::string line;
  std::set<std::string> flags;
  while (std::getline(cpuinfo, line)) {
    if (line.rfind("flags", 0) != 0) continue;
    std::istringstream words(line.substr(line.find(':') + 1));
    for (std::string w; words >> w;) flags.insert(w);
    break;
  }
  if (flags.empty()) GTEST_SKIP() << "no /proc/cpuinfo flags line";
  const CpuFeatures f = DetectCpuFeatures();
  EXPECT_EQ(f.avx2, flags.count("avx2") == 1);
  EXPECT_EQ(f.fma, flags.count("fma") == 1);
  EXPECT_EQ(f.avx512f, flags.count("avx512f") == 1);
  EXPECT_EQ(f.avx512bw, flags.count("avx512bw") == 1);
  EXPECT_EQ(f.avx512vl, flags.count("avx512vl") == 1);
  EXPECT_EQ(f.avx512dq, flags.count("avx512dq") == 1);
  EXPECT_EQ(f.avx512bf16, flags.count("avx512_bf16") == 1);  // Linux spells this one with a _
}

TEST(ActiveCpuIsaTest, IsTheChoiceForThisCpuBuildAndEnvironment) {
  const CpuIsa expected = ChooseCpuIsa(DetectCpuFeatures(), Avx512KernelsCompiled(),
                                       std::getenv("FLUXION_CPU_ISA"), nullptr);
  EXPECT_EQ(ActiveCpuIsa(), expected);
  EXPECT_EQ(internal::ActiveKernels().isa, expected);
  if (!CpuCanRun(CpuIsa::kAvx512, DetectCpuFeatures())) {
    EXPECT_EQ(ActiveCpuIsa(), CpuIsa::kAvx2) << "this CPU has no AVX-512";
  }
  RecordProperty("active_cpu_isa", CpuIsaName(ActiveCpuIsa()));
}

TEST(RunnableKernelsTest, Avx2IsAlwaysRunnableAndOthersExactlyWhenBuildAndCpuAllow) {
  const CpuFeatures f = DetectCpuFeatures();
  for (CpuIsa isa : {CpuIsa::kAvx2, CpuIsa::kAvx512, CpuIsa::kAvx512Bf16}) {
    std::string why;
    const internal::CpuKernels* k = internal::RunnableKernels(isa, &why);
    const bool expected = isa == CpuIsa::kAvx2 || (Avx512KernelsCompiled() && CpuCanRun(isa, f));
    EXPECT_EQ(k != nullptr, expected) << CpuIsaName(isa) << ": " << why;
    if (k != nullptr) {
      EXPECT_EQ(k->isa, isa);
    }
  }
}

// The choice is cached for the process, so FLUXION_CPU_ISA is exercised in a fresh child process:
// the "threadsafe" death-test style re-executes this binary for the statement.
TEST(ActiveCpuIsaDeathTest, HonoursFluxionCpuIsaAvx2) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(
      {
        setenv("FLUXION_CPU_ISA", "avx2", 1);
        const bool ok = ActiveCpuIsa() == CpuIsa::kAvx2 &&
                        internal::ActiveKernels().paged_attention ==
                            internal::RunnableKernels(CpuIsa::kAvx2, nullptr)->paged_attention;
        std::exit(ok ? 0 : 1);
      },
      ::testing::ExitedWithCode(0), "");
}

TEST(ActiveCpuIsaDeathTest, HonoursFluxionCpuIsaAvx512AsFarAsCpuAndBuildAllow) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  for (const char* name : {"avx512", "avx512bf16"}) {
    EXPECT_EXIT(
        {
          setenv("FLUXION_CPU_ISA", name, 1);
          const CpuIsa want =
              ChooseCpuIsa(DetectCpuFeatures(), Avx512KernelsCompiled(), name, nullptr);
          const bool ok = ActiveCpuIsa() == want &&
                          internal::ActiveKernels().paged_attention ==
                              internal::RunnableKernels(want, nullptr)->paged_attention;
          std::exit(ok ? 0 : 1);
        },
        ::testing::ExitedWithCode(0), "")
        << name;
  }
}

TEST(ActiveCpuIsaDeathTest, MisspeltFluxionCpuIsaIsReportedOnStderr) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(
      {
        setenv("FLUXION_CPU_ISA", "avx-512", 1);
        ActiveCpuIsa();
        std::exit(0);
      },
      ::testing::ExitedWithCode(0), "FLUXION_CPU_ISA=avx-512 is not one of");
}

}  // namespace
}  // namespace fluxion::kernels::cpu
