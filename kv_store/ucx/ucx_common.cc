#include "kv_store/ucx/ucx_common.h"

#include "absl/strings/str_cat.h"

namespace infinigen {

absl::Status UcsError(const char* what, ucs_status_t s) {
  return absl::UnavailableError(absl::StrCat("UCX ", what, ": ", ucs_status_string(s)));
}

absl::Status InitUcxWorker(ucp_context_h* context, ucp_worker_h* worker) {
  ucp_params_t params{};
  params.field_mask = UCP_PARAM_FIELD_FEATURES;
  params.features = UCP_FEATURE_AM | UCP_FEATURE_WAKEUP;
  ucp_config_t* config = nullptr;
  ucs_status_t s = ucp_config_read(nullptr, nullptr, &config);
  if (s != UCS_OK) return UcsError("config", s);
  s = ucp_init(&params, config, context);
  ucp_config_release(config);
  if (s != UCS_OK) return UcsError("init", s);
  ucp_worker_params_t wp{};
  wp.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
  wp.thread_mode = UCS_THREAD_MODE_SINGLE;
  s = ucp_worker_create(*context, &wp, worker);
  if (s != UCS_OK) {
    ucp_cleanup(*context);
    return UcsError("worker", s);
  }
  return absl::OkStatus();
}

absl::Status SetUcxAmHandler(ucp_worker_h worker, unsigned id, ucp_am_recv_callback_t cb,
                             void* arg) {
  ucp_am_handler_param_t hp{};
  hp.field_mask = UCP_AM_HANDLER_PARAM_FIELD_ID | UCP_AM_HANDLER_PARAM_FIELD_CB |
                  UCP_AM_HANDLER_PARAM_FIELD_ARG;
  hp.id = id;
  hp.cb = cb;
  hp.arg = arg;
  const ucs_status_t s = ucp_worker_set_am_recv_handler(worker, &hp);
  return s == UCS_OK ? absl::OkStatus() : UcsError("AM handler", s);
}

void CloseUcxEndpoint(ucp_worker_h worker, ucp_ep_h ep) {
  ucp_request_param_t rp{};
  rp.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
  rp.flags = UCP_EP_CLOSE_FLAG_FORCE;
  ucs_status_ptr_t r = ucp_ep_close_nbx(ep, &rp);
  while (r != nullptr && !UCS_PTR_IS_ERR(r) && ucp_request_check_status(r) == UCS_INPROGRESS) {
    ucp_worker_progress(worker);
  }
  if (r != nullptr && !UCS_PTR_IS_ERR(r)) ucp_request_free(r);
}

}  // namespace infinigen
