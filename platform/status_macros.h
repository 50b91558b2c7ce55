#pragma once

// Debian's abseil (20220623) has no status macros; these carry abseil's names
// so they can be dropped once a newer abseil is available.

#include "absl/status/status.h"
#include "absl/status/statusor.h"

#define LAYERCAST_STATUS_CONCAT_INNER_(a, b) a##b
#define LAYERCAST_STATUS_CONCAT_(a, b) LAYERCAST_STATUS_CONCAT_INNER_(a, b)

// Returns `expr` from the enclosing function if it is not OK.
#define RETURN_IF_ERROR(expr)                              \
  do {                                                     \
    ::absl::Status _layercast_status = (expr);             \
    if (!_layercast_status.ok()) return _layercast_status; \
  } while (0)

// `ASSIGN_OR_RETURN(auto x, Make());` declares/assigns `x` from an
// absl::StatusOr, or returns its status from the enclosing function.
#define ASSIGN_OR_RETURN(lhs, expr) \
  ASSIGN_OR_RETURN_IMPL_(LAYERCAST_STATUS_CONCAT_(_layercast_statusor_, __LINE__), lhs, expr)
#define ASSIGN_OR_RETURN_IMPL_(statusor, lhs, expr)        \
  auto statusor = (expr);                                  \
  if (!statusor.ok()) return std::move(statusor).status(); \
  lhs = *std::move(statusor)
