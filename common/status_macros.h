// Status propagation helpers. Errors are values (absl::Status); these keep call sites short.
#pragma once

#include "absl/status/status.h"
#include "absl/status/statusor.h"

#define IG_STATUS_CONCAT_INNER(a, b) a##b
#define IG_STATUS_CONCAT(a, b) IG_STATUS_CONCAT_INNER(a, b)

// Returns from the enclosing function if `expr` (an absl::Status) is not OK.
#define IG_RETURN_IF_ERROR(expr)                        \
  do {                                                  \
    if (::absl::Status _ig_st = (expr); !_ig_st.ok()) { \
      return _ig_st;                                    \
    }                                                   \
  } while (0)

// `lhs` = value of `expr` (an absl::StatusOr<T>), or returns its error.
#define IG_ASSIGN_OR_RETURN(lhs, expr) \
  IG_ASSIGN_OR_RETURN_IMPL(IG_STATUS_CONCAT(_ig_statusor_, __LINE__), lhs, expr)
#define IG_ASSIGN_OR_RETURN_IMPL(tmp, lhs, expr) \
  auto tmp = (expr);                             \
  if (!tmp.ok()) return std::move(tmp).status(); \
  lhs = std::move(tmp).value()
