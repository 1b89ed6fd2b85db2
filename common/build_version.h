// What this build is: the project's version and the git commit it was configured from
// ("0.1.0+3fa2c1d9e0b7"; the version alone outside a git checkout). Servers report it in
// ServerInfo.build_version, the router's HTTP API at GET /version, the CLI at `fluxion --version`.
// CMake writes the definition (common/build_version.cc.in) when it configures, and configures again
// when the checkout's HEAD moves, so the commit is the one built.
#ifndef FLUXION_COMMON_BUILD_VERSION_H_
#define FLUXION_COMMON_BUILD_VERSION_H_

namespace fluxion {

const char* BuildVersion();

}  // namespace fluxion

#endif  // FLUXION_COMMON_BUILD_VERSION_H_
