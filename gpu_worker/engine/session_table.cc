#include "gpu_worker/engine/session_table.h"

#include <algorithm>
#include <utility>

namespace infinigen {

void SessionTable::Keep(const std::string& id, SequenceId seq, std::vector<int32_t> tokens,
                        absl::Time now) {
  Close(id);
  Session& s = sessions_[id];
  s.seq = seq;
  s.tokens = std::move(tokens);
  s.last_used = now;
  Expire(now);
}

SessionTable::Kept SessionTable::Take(const std::string& id) {
  auto it = sessions_.find(id);
  if (it == sessions_.end()) return {};
  Kept k{it->second.seq, std::move(it->second.tokens)};
  sessions_.erase(it);
  return k;
}

bool SessionTable::CloseLeastRecent() {
  auto lru = std::min_element(sessions_.begin(), sessions_.end(), [](const auto& x, const auto& y) {
    return x.second.last_used < y.second.last_used;
  });
  if (lru == sessions_.end()) return false;
  cache_.Close(lru->second.seq);
  sessions_.erase(lru);
  return true;
}

void SessionTable::Expire(absl::Time now) {
  std::vector<std::string> expired;
  for (const auto& [id, s] : sessions_) {
    if (now - s.last_used >= ttl_) expired.push_back(id);
  }
  for (const std::string& id : expired) Close(id);
  while (static_cast<int>(sessions_.size()) > max_sessions_ && CloseLeastRecent()) {
  }
}

void SessionTable::CloseAll() {
  for (const auto& [id, s] : sessions_) cache_.Close(s.seq);
  sessions_.clear();
}

void SessionTable::Close(const std::string& id) {
  auto it = sessions_.find(id);
  if (it == sessions_.end()) return;
  cache_.Close(it->second.seq);
  sessions_.erase(it);
}

}  // namespace infinigen
