#include "tests/support/netns.h"

#include <unistd.h>

#include <cstdlib>

#include "absl/strings/str_cat.h"

namespace infinigen::testing {
namespace {

absl::Status Run(const std::string& command) {
  const int rc = std::system((command + " >/dev/null 2>&1").c_str());
  if (rc != 0) return absl::FailedPreconditionError(absl::StrCat("`", command, "` failed"));
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::unique_ptr<NetnsLab>> NetnsLab::Create(int namespaces) {
  if (::geteuid() != 0) {
    return absl::FailedPreconditionError("network namespaces need root (CAP_NET_ADMIN)");
  }
  if (Run("ip -V").code() != absl::StatusCode::kOk) {
    return absl::FailedPreconditionError("iproute2 (`ip`) is not installed");
  }
  const int pid = static_cast<int>(::getpid());
  std::unique_ptr<NetnsLab> lab(new NetnsLab());
  lab->subnet_ = absl::StrCat("10.", 100 + pid % 100, ".", (pid / 100) % 250, ".");
  lab->bridge_ = absl::StrCat("igbr", pid);
  if (absl::Status st = Run(absl::StrCat("ip link add ", lab->bridge_, " type bridge")); !st.ok()) {
    lab->bridge_.clear();
    return st;
  }
  absl::Status st = Run(absl::StrCat("ip addr add ", lab->subnet_, "1/24 dev ", lab->bridge_));
  if (st.ok()) st = Run(absl::StrCat("ip link set ", lab->bridge_, " up"));
  for (int i = 0; i < namespaces && st.ok(); ++i) {
    const std::string ns = absl::StrCat("ig", pid, "n", i);
    const std::string outer = absl::StrCat("ig", pid, "o", i);
    const std::string inner = absl::StrCat("ig", pid, "i", i);
    st = Run("ip netns add " + ns);
    if (!st.ok()) break;
    lab->names_.push_back(ns);
    st = Run(absl::StrCat("ip link add ", outer, " type veth peer name ", inner));
    if (!st.ok()) break;
    lab->outer_.push_back(outer);
    for (const std::string& c :
         {absl::StrCat("ip link set ", inner, " netns ", ns),
          absl::StrCat("ip -n ", ns, " link set ", inner, " name ", kDevice),
          absl::StrCat("ip -n ", ns, " addr add ", lab->host(i), "/24 dev ", kDevice),
          absl::StrCat("ip -n ", ns, " link set ", kDevice, " up"),
          absl::StrCat("ip -n ", ns, " link set lo up"),
          absl::StrCat("ip link set ", outer, " master ", lab->bridge_),
          absl::StrCat("ip link set ", outer, " up")}) {
      st = Run(c);
      if (!st.ok()) break;
    }
  }
  if (!st.ok()) return st;  // the destructor removes what was made
  return lab;
}

NetnsLab::~NetnsLab() {
  for (const std::string& ns : names_) Run("ip netns del " + ns).IgnoreError();
  for (const std::string& outer : outer_) Run("ip link del " + outer).IgnoreError();
  if (!bridge_.empty()) Run("ip link del " + bridge_).IgnoreError();
}

std::string NetnsLab::host(int i) const { return absl::StrCat(subnet_, i + 2); }

absl::Status NetnsLab::Cut(int i) { return Run(absl::StrCat("ip link set ", outer_[i], " down")); }

absl::Status NetnsLab::Restore(int i) {
  return Run(absl::StrCat("ip link set ", outer_[i], " up"));
}

}  // namespace infinigen::testing
