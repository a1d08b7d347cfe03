#include "common/grpc/utf8_fields.h"

#include <grpc/byte_buffer.h>
#include <grpc/byte_buffer_reader.h>
#include <grpc/slice.h>

namespace infinigen {

void* Utf8CheckedHandler::Deserialize(grpc_call* call, grpc_byte_buffer* req, grpc::Status* status,
                                      void** handler_data) {
  if (req != nullptr) {
    std::string bytes;
    grpc_byte_buffer_reader reader;
    if (grpc_byte_buffer_reader_init(&reader, req) != 0) {
      grpc_slice all = grpc_byte_buffer_reader_readall(&reader);
      bytes.assign(reinterpret_cast<const char*>(GRPC_SLICE_START_PTR(all)),
                   GRPC_SLICE_LENGTH(all));
      grpc_slice_unref(all);
      grpc_byte_buffer_reader_destroy(&reader);
    }
    const std::string field = FirstInvalidUtf8Field(type_, bytes);
    if (!field.empty()) {
      grpc_byte_buffer_destroy(req);  // Deserialize owns the payload
      *status = grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                             field + " is not valid UTF-8: send string fields as UTF-8 text");
      return nullptr;
    }
  }
  return inner_->Deserialize(call, req, status, handler_data);
}

}  // namespace infinigen
