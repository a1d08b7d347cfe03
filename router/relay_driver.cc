#include "router/relay_driver.h"

#include <cstdio>
#include <string>
#include <utility>

#include "absl/time/clock.h"
#include "router/router_metrics.h"

namespace infinigen {

RelayAction RunRelay(Relay& relay, WorkerClient& workers, ClientStream& client,
                     absl::string_view session_id, RouterMetrics* metrics,
                     absl::string_view request_id) {
  const absl::Time start = absl::Now();
  RelayAction a = relay.Start();
  for (;;) {
    if (!a.failed.empty()) workers.ReportFailure(a.failed);
    if (a.stalled) {
      std::fprintf(stderr, "request %s: worker %s stalled after %zu tokens; moving the stream\n",
                   std::string(request_id).c_str(), a.failed.c_str(), relay.sent().size());
    }
    if (a.failover && metrics != nullptr) metrics->Failover();
    switch (a.kind) {
      case RelayAction::Kind::kFinish:
        return a;
      case RelayAction::Kind::kWait:
        absl::SleepFor(a.wait);
        a = client.Cancelled() ? relay.ClientGone() : relay.Waited();
        break;
      case RelayAction::Kind::kPick:
        a = relay.Picked(workers.Pick(session_id, relay.excluded()), absl::Now());
        break;
      case RelayAction::Kind::kCall: {
        std::unique_ptr<WorkerCall> call =
            workers.Call(a.worker, relay.request(), relay.expected_tokens());
        if (call == nullptr) {
          a = relay.Ended(absl::InternalError("the worker could not be called"), false,
                          absl::Now());
          break;
        }
        worker::v1::GenerateResponse m;
        bool gone = false;
        while (call->Read(&m)) {
          RelayForward f = relay.Received(std::move(m));
          m.Clear();
          if (metrics != nullptr) {
            if (f.resumed) metrics->Resume();
            if (f.first_tokens) metrics->FirstToken(absl::ToDoubleSeconds(absl::Now() - start));
            metrics->Tokens(f.message.token_ids_size());
          }
          // A resumed prompt-only stream's first message carries nothing the client lacks.
          const v1::GenerateResponse& out = f.message;
          const bool nothing = out.token_ids_size() == 0 && out.text().empty() &&
                               out.prompt_logprobs_size() == 0 && out.request_id().empty() &&
                               out.finish_reason() == v1::FINISH_REASON_UNSPECIFIED;
          if (!nothing && !client.Write(f.message)) {
            call->Cancel();
            gone = true;
            break;
          }
        }
        const absl::Status s = call->Finish();
        const bool stalled = call->stalled();
        call.reset();
        a = gone || client.Cancelled() ? relay.ClientGone() : relay.Ended(s, stalled, absl::Now());
        break;
      }
    }
  }
}

}  // namespace infinigen
