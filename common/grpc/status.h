// The one place where absl::Status becomes grpc::Status and back.
#pragma once

#include <grpcpp/support/status.h>

#include "absl/status/status.h"

namespace infinigen {

grpc::Status ToGrpcStatus(const absl::Status& status);
absl::Status FromGrpcStatus(const grpc::Status& status);

}  // namespace infinigen
