#include "router/worker_pool.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <sys/socket.h>

#include <algorithm>
#include <map>
#include <set>

#include "absl/hash/hash.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/blocking_counter.h"
#include "common/grpc/channel_args.h"
#include "common/grpc/tls.h"

namespace infinigen {
namespace {

constexpr absl::string_view kDnsPrefix = "dns:///";

// `tls_name`, when not empty, is the name a worker's certificate must carry: workers found through
// dns:///name:port are dialled by IP address, and a pod's IP is not known when its certificate
// is issued, so certificates name the (headless) service instead.
std::shared_ptr<grpc::Channel> MakeChannel(const std::string& address,
                                           std::shared_ptr<grpc::ChannelCredentials> credentials,
                                           const std::string& tls_name) {
  grpc::ChannelArguments args = InternalChannelArgs(64 << 20);
  // Each worker keeps its own connection (not shared by channels to the same address).
  args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
  if (!tls_name.empty()) args.SetSslTargetNameOverride(tls_name);
  return grpc::CreateCustomChannel(address, std::move(credentials), args);
}

// Splits "host:port" / "[v6]:port".
bool SplitHostPort(absl::string_view target, std::string& host, std::string& port) {
  const size_t colon = target.rfind(':');
  if (colon == absl::string_view::npos || colon == 0 || colon + 1 == target.size()) return false;
  host = std::string(target.substr(0, colon));
  port = std::string(target.substr(colon + 1));
  if (host.size() > 2 && host.front() == '[' && host.back() == ']') {
    host = host.substr(1, host.size() - 2);
  }
  return std::all_of(port.begin(), port.end(), [](char c) { return c >= '0' && c <= '9'; });
}

}  // namespace

PooledWorker::PooledWorker(std::string address, std::shared_ptr<grpc::Channel> channel)
    : address_(std::move(address)),
      channel_(std::move(channel)),
      stub_(worker::v1::Worker::NewStub(channel_)),
      health_(grpc::health::v1::Health::NewStub(channel_)) {}

absl::Status WorkerPoolConfig::Validate() const {
  if (targets.empty() && channels.empty()) {
    return absl::InvalidArgumentError(
        "--workers: give at least one worker (host:port, or dns:///name:port for every address "
        "of a name)");
  }
  for (const std::string& t : targets) {
    std::string host, port;
    absl::string_view rest = t;
    if (absl::StartsWith(rest, kDnsPrefix)) rest.remove_prefix(kDnsPrefix.size());
    if (!SplitHostPort(rest, host, port)) {
      return absl::InvalidArgumentError(
          absl::StrCat("--workers: '", t, "' is not host:port or dns:///name:port"));
    }
  }
  if (health_interval <= absl::ZeroDuration() || health_timeout <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError("health check interval and timeout must be > 0");
  }
  if (health_misses < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--health_misses must be >= 0 (0: never down by timeouts), got ", health_misses));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::vector<std::string>> ResolveAll(const std::string& host,
                                                    const std::string& port) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* res = nullptr;
  const int rc = getaddrinfo(host.c_str(), port.c_str(), &hints, &res);
  if (rc != 0) {
    return absl::NotFoundError(absl::StrCat("cannot resolve ", host, ": ", gai_strerror(rc)));
  }
  std::set<std::string> out;
  for (addrinfo* a = res; a != nullptr; a = a->ai_next) {
    char ip[INET6_ADDRSTRLEN] = {};
    if (a->ai_family == AF_INET) {
      inet_ntop(AF_INET, &reinterpret_cast<sockaddr_in*>(a->ai_addr)->sin_addr, ip, sizeof(ip));
      out.insert(absl::StrCat(ip, ":", port));
    } else if (a->ai_family == AF_INET6) {
      inet_ntop(AF_INET6, &reinterpret_cast<sockaddr_in6*>(a->ai_addr)->sin6_addr, ip, sizeof(ip));
      out.insert(absl::StrCat("[", ip, "]:", port));
    }
  }
  freeaddrinfo(res);
  if (out.empty()) return absl::NotFoundError(absl::StrCat(host, " has no addresses"));
  return std::vector<std::string>(out.begin(), out.end());
}

WorkerPool::WorkerPool(WorkerPoolConfig config) : config_(std::move(config)) {}

absl::StatusOr<std::unique_ptr<WorkerPool>> WorkerPool::Create(WorkerPoolConfig config) {
  if (auto st = config.Validate(); !st.ok()) return st;
  auto credentials = MakeChannelCredentials(config.tls, "--worker_tls_");
  if (!credentials.ok()) return credentials.status();
  std::unique_ptr<WorkerPool> pool(new WorkerPool(std::move(config)));
  pool->credentials_ = *credentials;
  {
    absl::MutexLock l(&pool->mu_);
    for (const auto& [name, channel] : pool->config_.channels) {
      pool->workers_[name] = std::make_shared<PooledWorker>(name, channel);
    }
  }
  pool->Refresh();
  pool->thread_ = std::thread([p = pool.get()] { p->Loop(); });
  return pool;
}

WorkerPool::~WorkerPool() {
  stop_.Notify();
  if (thread_.joinable()) thread_.join();
}

void WorkerPool::Loop() {
  while (!stop_.WaitForNotificationWithTimeout(config_.health_interval)) Refresh();
}

void WorkerPool::Refresh() {
  // Addresses wanted now: static ones, and whatever the names resolve to. A name that does not
  // resolve keeps its last addresses (a DNS hiccup must not empty the pool).
  // Each with the name its TLS certificate must carry (empty: the address itself).
  std::map<std::string, std::string> wanted;
  for (const auto& [name, channel] : config_.channels) wanted[name];
  for (const std::string& t : config_.targets) {
    if (!absl::StartsWith(t, kDnsPrefix)) {
      wanted[t];
      continue;
    }
    std::string host, port;
    SplitHostPort(absl::string_view(t).substr(kDnsPrefix.size()), host, port);
    const std::string tls_name = config_.tls.ca.empty() ? "" : host;
    auto addresses = ResolveAll(host, port);
    if (addresses.ok()) {
      for (const std::string& a : *addresses) wanted[a] = tls_name;
    } else {
      absl::MutexLock l(&mu_);
      for (const auto& [address, w] : workers_) {
        if (absl::EndsWith(address, ":" + port)) wanted[address] = tls_name;
      }
    }
  }
  std::vector<std::shared_ptr<PooledWorker>> probe;
  {
    absl::MutexLock l(&mu_);
    for (auto it = workers_.begin(); it != workers_.end();) {
      it = wanted.count(it->first) ? std::next(it) : workers_.erase(it);
    }
    for (const auto& [a, tls_name] : wanted) {
      if (!workers_.count(a))
        workers_[a] = std::make_shared<PooledWorker>(a, MakeChannel(a, credentials_, tls_name));
    }
    for (const auto& [a, w] : workers_) probe.push_back(w);
  }
  // Probe every worker at once; each answers within the timeout.
  absl::BlockingCounter done(static_cast<int>(probe.size()));
  struct Probe {
    grpc::ClientContext context;
    grpc::health::v1::HealthCheckRequest request;
    grpc::health::v1::HealthCheckResponse response;
    grpc::ClientContext info_context;  // a worker that turned SERVING: its Info
    worker::v1::InfoRequest info_request;
    std::shared_ptr<worker::v1::InfoResponse> info;
  };
  std::vector<std::unique_ptr<Probe>> probes;
  for (const auto& w : probe) {
    auto p = std::make_unique<Probe>();
    p->context.set_deadline(absl::ToChronoTime(absl::Now() + config_.health_timeout));
    Probe* raw = p.get();
    probes.push_back(std::move(p));
    const absl::Duration timeout = config_.health_timeout;
    const int misses = config_.health_misses;
    w->health().async()->Check(
        &raw->context, &raw->request, &raw->response,
        [w, raw, timeout, misses, &done](grpc::Status status) {
          using S = grpc::health::v1::HealthCheckResponse;
          const bool was_serving = w->available();
          if (status.ok()) w->CheckAnswered();
          if (!status.ok()) {
            // Late (a worker whose cores are all busy may answer after the timeout and still
            // serve): down after `misses` in a row. Refused or broken: down now.
            const bool late = status.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED;
            if (!late || (misses > 0 && w->CountMissedCheck() >= misses)) {
              w->set_state(PooledWorker::State::kDown);
            }
          } else if (raw->response.status() == S::SERVING) {
            w->set_state(PooledWorker::State::kServing);
            if (!was_serving || w->info() == nullptr) {  // new, or back (maybe another model)
              raw->info = std::make_shared<worker::v1::InfoResponse>();
              raw->info_context.set_deadline(absl::ToChronoTime(absl::Now() + timeout));
              w->stub().async()->Info(&raw->info_context, &raw->info_request, raw->info.get(),
                                      [w, raw, &done](grpc::Status s) {
                                        if (s.ok()) w->set_info(std::move(raw->info));
                                        done.DecrementCount();
                                      });
              return;
            }
          } else {
            w->set_state(PooledWorker::State::kDraining);
          }
          done.DecrementCount();
        });
  }
  done.Wait();
}

std::shared_ptr<PooledWorker> WorkerPool::Pick(
    absl::string_view session_id, const std::vector<const PooledWorker*>& exclude) const {
  std::vector<std::shared_ptr<PooledWorker>> candidates;
  {
    absl::MutexLock l(&mu_);
    for (const auto& [a, w] : workers_) {
      if (w->available() && std::find(exclude.begin(), exclude.end(), w.get()) == exclude.end()) {
        candidates.push_back(w);
      }
    }
  }
  if (candidates.empty()) return nullptr;
  if (!session_id.empty()) {
    // Rendezvous hashing: the session's highest-scoring worker; when it leaves, only its
    // sessions move.
    auto score = [&](const PooledWorker& w) { return absl::HashOf(session_id, w.address()); };
    return *std::max_element(candidates.begin(), candidates.end(),
                             [&](const auto& a, const auto& b) { return score(*a) < score(*b); });
  }
  // Least outstanding tokens; ties go round-robin so idle workers share the first requests.
  static std::atomic<uint64_t> turn{0};
  const size_t start = turn.fetch_add(1, std::memory_order_relaxed) % candidates.size();
  std::shared_ptr<PooledWorker> best;
  for (size_t i = 0; i < candidates.size(); ++i) {
    const auto& w = candidates[(start + i) % candidates.size()];
    if (best == nullptr || w->outstanding() < best->outstanding()) best = w;
  }
  return best;
}

void WorkerPool::ReportFailure(PooledWorker& w) { w.MarkFailed(); }

std::vector<std::shared_ptr<PooledWorker>> WorkerPool::Workers() const {
  absl::MutexLock l(&mu_);
  std::vector<std::shared_ptr<PooledWorker>> out;
  for (const auto& [a, w] : workers_) out.push_back(w);
  return out;
}

int WorkerPool::available() const {
  int n = 0;
  for (const auto& w : Workers()) n += w->available() ? 1 : 0;
  return n;
}

}  // namespace infinigen
