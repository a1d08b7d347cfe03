// Channel arguments of the services' internal clients (worker -> KV store, router -> worker).
#pragma once

#include <grpcpp/support/channel_arguments.h>

namespace infinigen {

// Messages up to `max_message_bytes` both ways, and reconnection within 0.1-1 s, so a restarted
// server is found again quickly.
grpc::ChannelArguments InternalChannelArgs(int max_message_bytes);

}  // namespace infinigen
