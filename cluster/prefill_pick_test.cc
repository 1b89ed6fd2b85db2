#include "cluster/prefill_pick.h"

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace fluxion::cluster {
namespace {

using ::testing::HasSubstr;

std::vector<BackendState> Nodes(std::vector<std::string> addresses) {
  std::vector<BackendState> out;
  for (auto& a : addresses) {
    BackendState s;
    s.address = a;
    s.role = Role::kPrefill;
    out.push_back(s);
  }
  return out;
}

TEST(PrefillPickTest, ExactAddressOrTheOneNodeOnThatHost) {
  auto nodes = Nodes({"10.0.0.5:7001", "10.0.0.6:7001"});
  EXPECT_EQ(*MapPrefillerPick(kPrefillerHostPortHeader, "10.0.0.6:7001", nodes), "10.0.0.6:7001");
  // The picker names the pod's InferencePool target port, not the gRPC port.
  EXPECT_EQ(*MapPrefillerPick(kPrefillerHostPortHeader, "10.0.0.5:8000", nodes), "10.0.0.5:7001");
  EXPECT_EQ(*MapPrefillerPick(kPrefillerHostPortHeader, " 10.0.0.5 ", nodes), "10.0.0.5:7001");
  EXPECT_EQ(*MapPrefillerPick(kPrefillerUrlHeader, "http://10.0.0.6:8000/", nodes),
            "10.0.0.6:7001");
}

TEST(PrefillPickTest, AnythingElseIsInvalidArgumentNamingTheHeaderAndTheKnownNodes) {
  auto nodes = Nodes({"10.0.0.5:7001", "10.0.0.5:7011"});
  auto unknown = MapPrefillerPick(kPrefillerHostPortHeader, "10.9.9.9:8000", nodes);
  EXPECT_EQ(unknown.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(unknown.status().message(), HasSubstr("x-prefiller-host-port '10.9.9.9:8000'"));
  EXPECT_THAT(unknown.status().message(), HasSubstr("10.0.0.5:7001, 10.0.0.5:7011"));
  auto ambiguous = MapPrefillerPick(kPrefillerHostPortHeader, "10.0.0.5:8000", nodes);
  EXPECT_EQ(ambiguous.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(ambiguous.status().message(), HasSubstr("several prefill nodes"));
  EXPECT_EQ(*MapPrefillerPick(kPrefillerHostPortHeader, "10.0.0.5:7011", nodes), "10.0.0.5:7011");
  for (const char* bad : {"", ":", "10.0.0.5:", "10.0.0.5:x", "10.0.0.5:99999"}) {
    EXPECT_EQ(MapPrefillerPick(kPrefillerHostPortHeader, bad, nodes).status().code(),
              absl::StatusCode::kInvalidArgument)
        << bad;
  }
  EXPECT_THAT(MapPrefillerPick(kPrefillerHostPortHeader, "a:1", {}).status().message(),
              HasSubstr("none known yet"));
}

}  // namespace
}  // namespace fluxion::cluster
