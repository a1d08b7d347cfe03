// SessionTable: conversations (EngineRequest::session_id) whose KV stays open in the cache (the
// KV store) after their request, so that the session's next request whose prompt begins with the
// same tokens prefills only the rest. A session is kept at most `ttl` after its last request, at
// most `max_sessions` of them; the least recently used goes first, and gives way whenever a
// running sequence needs the room (BatchEngine::OpenSequence). Engine thread only.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/time/time.h"
#include "gpu_worker/kv/kv_cache.h"

namespace infinigen {

class SessionTable {
 public:
  SessionTable(KvCache& cache, int max_sessions, absl::Duration ttl)
      : cache_(cache), max_sessions_(max_sessions), ttl_(ttl) {}

  bool empty() const { return sessions_.empty(); }
  size_t size() const { return sessions_.size(); }
  absl::Duration ttl() const { return ttl_; }

  // Keeps `seq`, whose cache holds the K/V of `tokens` in order, as session `id`'s (closing the
  // one it had), then closes what expired (Expire).
  void Keep(const std::string& id, SequenceId seq, std::vector<int32_t> tokens, absl::Time now);
  // Takes session `id`'s sequence out of the table: the caller attaches or closes it. seq 0 when
  // the session has none.
  struct Kept {
    SequenceId seq = 0;
    std::vector<int32_t> tokens;
  };
  Kept Take(const std::string& id);
  // Closes the least recently used session's sequence; false when none is kept.
  bool CloseLeastRecent();
  // Closes sessions past their TTL, then the least recently used beyond max_sessions.
  void Expire(absl::Time now);
  void CloseAll();

 private:
  struct Session {
    SequenceId seq = 0;
    std::vector<int32_t> tokens;
    absl::Time last_used;
  };
  void Close(const std::string& id);

  KvCache& cache_;
  const int max_sessions_;
  const absl::Duration ttl_;
  absl::flat_hash_map<std::string, Session> sessions_;
};

}  // namespace infinigen
