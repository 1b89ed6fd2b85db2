// Status propagation macros. Debian 12's abseil (20220623) has no ABSL_RETURN_IF_ERROR, so we
// define our own, with the same meaning as abseil's later ones.
#ifndef FLUXION_COMMON_STATUS_MACROS_H_
#define FLUXION_COMMON_STATUS_MACROS_H_

#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

// Evaluates `expr` (an absl::Status) and returns it from the enclosing function if not OK.
#define FLUXION_RETURN_IF_ERROR(expr)                  \
  do {                                                 \
    ::absl::Status _fluxion_status = (expr);           \
    if (!_fluxion_status.ok()) return _fluxion_status; \
  } while (0)

#define FLUXION_STATUS_CONCAT_INNER_(a, b) a##b
#define FLUXION_STATUS_CONCAT_(a, b) FLUXION_STATUS_CONCAT_INNER_(a, b)

// `FLUXION_ASSIGN_OR_RETURN(auto x, StatusOrExpr());` assigns the value or returns the error.
#define FLUXION_ASSIGN_OR_RETURN(lhs, expr) \
  FLUXION_ASSIGN_OR_RETURN_IMPL_(FLUXION_STATUS_CONCAT_(_fluxion_statusor_, __LINE__), lhs, expr)

#define FLUXION_ASSIGN_OR_RETURN_IMPL_(statusor, lhs, expr) \
  auto statusor = (expr);                                   \
  if (!statusor.ok()) return std::move(statusor).status();  \
  lhs = std::move(statusor).value()

#endif  // FLUXION_COMMON_STATUS_MACROS_H_
