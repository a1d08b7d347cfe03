// KvStoreClient: the worker's side of the KV store, whatever carries the bytes (KvTransport in
// ARCHITECTURE.md). Appends are write-behind and gathers asynchronous, and a gather sees every
// append made before it. A background thread renews the owner's lease.
//
// Transports: in-process (the all-in-one server: direct calls into a KvStore, on the caller's
// thread), gRPC (bytes in the messages; the always-available fallback), shm (a collocated store:
// gRPC for control, rows copied straight out of the store's shared arena), UCX (gRPC for
// control; each gather one UCX request and one reply, over RDMA where the fabric has it). The
// last three share one ordered queue (QueuedKvClient).
#pragma once

#include <cstdint>
#include <initializer_list>
#include <memory>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/tls_files.h"
#include "kv_store/kv_store.h"

namespace infinigen {

// Rows to gather into caller-owned buffers (they must outlive the ticket).
struct ClientGatherItem {
  StoreSequenceId seq = 0;
  int layer = 0;
  int64_t count = 0;
  std::vector<int32_t> slots;  // [num_kv_heads, count]
  uint8_t* k_out = nullptr;    // [num_kv_heads, count, head_dim]
  uint8_t* v_out = nullptr;
  // In place (clients that reads_in_place()): each row's address in this process is written
  // here ([num_kv_heads, count]) instead of its bytes to k_out / v_out; see GatherItem.
  const void** k_rows = nullptr;
  const void** v_rows = nullptr;
  // In place by block table instead (clients that reads_in_place(); every KV head): the
  // layer's block ids, as kv_store/row_copy.h BlockTableOut says, for a device that reads the
  // mapped arena itself (Backend::GatherBlockRows). Nothing is copied and no address written.
  BlockTableOut block_table{};
  bool in_place() const {
    return (k_rows != nullptr && v_rows != nullptr) || block_table.requested();
  }
};

class GatherTicket {
 public:
  virtual ~GatherTicket() = default;
  // The gather's result; DEADLINE_EXCEEDED if `deadline` passes first (the copy may still land
  // later, so the buffers must stay alive until the ticket is destroyed).
  virtual absl::Status Wait(absl::Time deadline) = 0;
  // Whether the gather is over (its buffers no longer written), without waiting.
  virtual bool Done() = 0;
};

// A ticket whose gather is over before GatherAsync returns (a transport that gathers on the
// caller's thread, or a gather refused before it started).
class DoneTicket final : public GatherTicket {
 public:
  explicit DoneTicket(absl::Status status) : status_(std::move(status)) {}
  absl::Status Wait(absl::Time) override { return status_; }
  bool Done() override { return true; }

 private:
  absl::Status status_;
};

class KvStoreClient {
 public:
  virtual ~KvStoreClient() = default;
  virtual std::string transport() const = 0;

  // Synchronous control calls (they also wait for queued appends).
  virtual absl::Status Open(StoreSequenceId seq, const SequenceSpec& spec) = 0;
  virtual absl::Status Close(StoreSequenceId seq) = 0;
  // Gives `seq` up without freeing it (after the appends queued before): no owner renews it, and
  // it lives until its lease ends for another worker to Attach (KvStore::Release). A Release
  // that fails (the store unreachable) is retried in the background until it goes through or
  // finds the sequence gone.
  virtual absl::Status Release(StoreSequenceId seq) = 0;
  // Takes over sequence `from` (another worker's) as `to`, stored as `spec` describes (owner
  // empty: this client's); returns the tokens kept. See KvStore::Attach.
  virtual absl::StatusOr<int64_t> Attach(StoreSequenceId from, StoreSequenceId to,
                                         const SequenceSpec& spec, int64_t max_length) = 0;
  // A copy of the first `length` tokens of sequence `from` (any owner's, which keeps it) as
  // `to`, after the appends queued before; returns the tokens copied. See KvStore::Fork.
  virtual absl::StatusOr<int64_t> Fork(StoreSequenceId from, StoreSequenceId to,
                                       const SequenceSpec& spec, int64_t length) = 0;
  // Queues rows [start, start + n) of `layer` (k, v: [n, num_kv_heads, head_dim]). In a KV pool
  // sequence `slots` ([n, num_kv_heads]) says where each row goes (KvStore::Append's at_slots);
  // empty: the store places them. The rows are taken (written to the store, or copied into the
  // queue) before it returns: the caller may reuse its buffers at once, and a caller that
  // reuses them allocates nothing per append on the in-process transport.
  virtual void AppendAsync(StoreSequenceId seq, int layer, int64_t start, int64_t n,
                           std::span<const uint8_t> k, std::span<const uint8_t> v,
                           std::span<const int32_t> slots) = 0;
  void AppendAsync(StoreSequenceId seq, int layer, int64_t start, int64_t n,
                   std::span<const uint8_t> k, std::span<const uint8_t> v) {
    AppendAsync(seq, layer, start, n, k, v, {});
  }
  // Waits for queued appends; returns the first append error since the last Flush.
  virtual absl::Status Flush(absl::Time deadline) = 0;
  // Starts gathering `items` (taken before it returns: the caller may change them; their
  // buffers must outlive the ticket). A transport that gathers on the caller's thread
  // (in-process) answers a shared ticket and allocates nothing when the gather succeeds.
  virtual std::shared_ptr<GatherTicket> GatherAsync(std::span<const ClientGatherItem> items) = 0;
  std::shared_ptr<GatherTicket> GatherAsync(std::initializer_list<ClientGatherItem> items) {
    return GatherAsync(std::span<const ClientGatherItem>(items.begin(), items.size()));
  }
  // Whether gathers can answer with the rows' addresses (ClientGatherItem::k_rows) because the
  // store's memory is mapped in this process: the in-process and shm transports. The rows are
  // then read where they lie, by the caller, once the ticket is done.
  virtual bool reads_in_place() const { return false; }
  // Where in this process the rows answered in place lie (the store's arena, mapped here), for
  // a GPU to register and read them directly; {nullptr, 0} for transports that copy. shm: it
  // changes when a restarted store's arena is mapped (at an Open).
  struct Span {
    const void* data = nullptr;
    size_t bytes = 0;
    size_t block_bytes = 0;  // the arena's blocks: block id b starts at data + b * block_bytes
    // Changes whenever the mapping does (a restarted store's arena, mapped at an Open), even to
    // the same address: what a GPU registered of the old one is void.
    uint64_t generation = 0;
  };
  virtual Span mapped_memory() const { return {}; }
  virtual absl::StatusOr<KvStoreStats> Stats() = 0;
};

struct KvClientConfig {
  enum class Transport { kInProcess, kGrpc, kShm, kUcx };
  Transport transport = Transport::kGrpc;
  std::string address = "127.0.0.1:50061";            // gRPC and shm
  std::string owner = "worker";                       // lease holder name
  absl::Duration call_timeout = absl::Seconds(2);     // per RPC: a dead store fails fast
  absl::Duration connect_timeout = absl::Seconds(5);  // discovering the shm / UCX data plane
  absl::Duration renew_every = absl::Seconds(5);      // lease renewal period (0: never)
  // Queued transports: appends wait up to this long to travel together in one call, unless a
  // gather or call needs them first (a decode step appends one row per layer; sending each on
  // its own costs a round trip and a wakeup of the store per layer). 0: each goes at once.
  absl::Duration append_linger = absl::Milliseconds(5);
  // shm: threads (the queue thread included) copying the rows of gathers of 2 MiB and more.
  int gather_threads = 2;
  // shm: appends' rows staged in a file of this size beside the store's arena, which the store
  // copies from, instead of sent in the call (kv_store/staging_file.h); an append larger than
  // it is sent. 0: every append is sent.
  size_t append_staging_bytes = size_t{64} << 20;
  // gRPC: the most K + V bytes one Gather reply carries (the channel allows 256 MiB). A larger
  // gather (a dense layer's full read at long context) is split into several calls by rows.
  size_t max_gather_reply_bytes = size_t{128} << 20;
  KvStore* store = nullptr;  // in-process
  TlsFiles tls;  // the gRPC control plane: TLS when tls.ca is set, mTLS with tls.cert/key
};
absl::StatusOr<KvClientConfig::Transport> ParseTransport(absl::string_view name);

absl::StatusOr<std::unique_ptr<KvStoreClient>> MakeKvStoreClient(const KvClientConfig& config);

}  // namespace infinigen
