#include "tests/support/router_streams.h"

#include <gtest/gtest.h>

#include <atomic>
#include <thread>

namespace infinigen::testing {
namespace {

// `started` (if not null) counts the stream once it has `started_after` tokens.
PublicStreamResult Stream(v1::Generation::Stub& stub, const v1::GenerateRequest& request,
                          std::chrono::seconds deadline, int started_after,
                          std::atomic<int>* started) {
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + deadline);
  PublicStreamResult r;
  auto reader = stub.Generate(&context, request);
  v1::GenerateResponse m;
  bool counted = false;
  while (reader->Read(&m)) {
    r.tokens.insert(r.tokens.end(), m.token_ids().begin(), m.token_ids().end());
    if (started != nullptr && !counted && static_cast<int>(r.tokens.size()) >= started_after) {
      counted = true;
      started->fetch_add(1);
    }
    r.last = m;
  }
  r.status = reader->Finish();
  return r;
}

}  // namespace

PublicStreamResult StreamOne(v1::Generation::Stub& stub, const v1::GenerateRequest& request,
                             std::chrono::seconds deadline) {
  return Stream(stub, request, deadline, 0, nullptr);
}

std::vector<PublicStreamResult> StreamAll(v1::Generation::Stub& stub,
                                          const std::vector<v1::GenerateRequest>& requests,
                                          const std::function<void()>& fault,
                                          const StreamAllOptions& options) {
  std::vector<PublicStreamResult> got(requests.size());
  std::atomic<int> started{0};
  std::vector<std::thread> threads;
  for (size_t i = 0; i < requests.size(); ++i) {
    threads.emplace_back([&, i] {
      got[i] = Stream(stub, requests[i], options.deadline, options.started_after, &started);
    });
  }
  const auto until = std::chrono::steady_clock::now() + options.wait_for_start;
  while (started.load() < static_cast<int>(requests.size()) &&
         std::chrono::steady_clock::now() < until) {
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  EXPECT_EQ(started.load(), static_cast<int>(requests.size()))
      << "streams should all be under way when the fault comes";
  fault();
  for (auto& t : threads) t.join();
  return got;
}

}  // namespace infinigen::testing
