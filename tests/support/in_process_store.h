// A KV store in this process and its in-process client, for tests of the code over the store
// (StoreKvCache, the decode step). Null members after recording a test failure.
#pragma once

#include <gtest/gtest.h>

#include <memory>

#include "absl/time/time.h"
#include "kv_store/client/kv_store_client.h"
#include "kv_store/kv_store.h"

namespace infinigen::testing {

struct InProcessStore {
  explicit InProcessStore(size_t capacity_bytes = size_t{64} << 20)
      : InProcessStore(Config(capacity_bytes)) {}
  // A store made as `sc` says (its blocks' size, say).
  explicit InProcessStore(const KvStoreConfig& sc) {
    auto s = KvStore::Create(sc);
    EXPECT_TRUE(s.ok()) << s.status();
    if (!s.ok()) return;
    store = std::move(*s);
    KvClientConfig cc;
    cc.transport = KvClientConfig::Transport::kInProcess;
    cc.store = store.get();
    cc.renew_every = absl::ZeroDuration();
    auto c = MakeKvStoreClient(cc);
    EXPECT_TRUE(c.ok()) << c.status();
    if (c.ok()) client = std::move(*c);
  }
  // The config the first constructor makes: in private memory, without huge pages.
  static KvStoreConfig Config(size_t capacity_bytes) {
    KvStoreConfig sc;
    sc.capacity_bytes = capacity_bytes;
    sc.huge_pages = false;
    sc.shared_memory = false;
    return sc;
  }
  std::unique_ptr<KvStore> store;
  std::unique_ptr<KvStoreClient> client;
};

}  // namespace infinigen::testing
