// Invalid UTF-8 in a proto3 string field makes protobuf refuse the whole message, and a gRPC
// server then answers INTERNAL with an empty message: the client cannot tell which field to fix.
// Utf8CheckedHandler wraps a method's handler so that such a request is answered
// INVALID_ARGUMENT naming the field (e.g. "messages.messages[1].content is not valid UTF-8")
// before the usual parse runs.
#pragma once

#include <google/protobuf/descriptor.h>
#include <grpcpp/support/method_handler.h>

#include <memory>
#include <string>
#include <string_view>

#include "common/grpc/utf8_scan.h"

namespace infinigen {

// A method handler that checks a request's strings before `inner` deserializes it.
class Utf8CheckedHandler final : public grpc::internal::MethodHandler {
 public:
  Utf8CheckedHandler(const google::protobuf::Descriptor& request_type,
                     std::unique_ptr<grpc::internal::MethodHandler> inner)
      : type_(request_type), inner_(std::move(inner)) {}

  void RunHandler(const HandlerParameter& param) override { inner_->RunHandler(param); }
  void* Deserialize(grpc_call* call, grpc_byte_buffer* req, grpc::Status* status,
                    void** handler_data) override;

 private:
  const google::protobuf::Descriptor& type_;
  std::unique_ptr<grpc::internal::MethodHandler> inner_;
};

}  // namespace infinigen
