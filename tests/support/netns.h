// NetnsLab: network namespaces on one bridge, for tests that run the services on separate
// addresses with real links between them (and cut those links). Namespace i has one veth link,
// named "ig0" inside, at 10.<a>.<b>.<i + 2>/24; the bridge (this process's namespace) is
// 10.<a>.<b>.1, so the test reaches every namespace. Names and the subnet derive from the pid,
// so that tests running at once do not meet. Needs root (CAP_NET_ADMIN) and iproute2; Create
// says why it cannot, for the test to skip with.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace infinigen::testing {

class NetnsLab {
 public:
  static absl::StatusOr<std::unique_ptr<NetnsLab>> Create(int namespaces);
  ~NetnsLab();  // deletes the namespaces, their links and the bridge

  const std::string& ns(int i) const { return names_[i]; }
  std::string host(int i) const;                 // namespace i's address
  static constexpr const char* kDevice = "ig0";  // the link's name inside each namespace

  // Takes namespace i's link down (its traffic is dropped, as when a cable is pulled) or up.
  absl::Status Cut(int i);
  absl::Status Restore(int i);

 private:
  NetnsLab() = default;
  std::string subnet_;  // "10.a.b."
  std::string bridge_;
  std::vector<std::string> names_;  // namespaces
  std::vector<std::string> outer_;  // each link's end on the bridge
};

}  // namespace infinigen::testing
