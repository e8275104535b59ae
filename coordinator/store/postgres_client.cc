#include "coordinator/store/postgres_client.h"

#include <cctype>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"

namespace tessera::coordinator {

std::string PgMessage(const char* message) {
  std::string text = message != nullptr ? message : "";
  while (!text.empty() && std::isspace(static_cast<unsigned char>(text.back()))) text.pop_back();
  return text;
}

absl::Status StatusFromSqlState(absl::string_view state, std::string message) {
  auto klass = [&](absl::string_view prefix) { return absl::StartsWith(state, prefix); };
  if (state.empty() || klass("08") || klass("57") || state == "40001" || state == "40P01" ||
      state == "55P03" || state == "53300") {
    return absl::UnavailableError(std::move(message));
  }
  if (state == "23505") return absl::AlreadyExistsError(std::move(message));
  if (klass("53")) return absl::ResourceExhaustedError(std::move(message));
  if (klass("28")) return absl::PermissionDeniedError(std::move(message));
  if (state == "XX001" || state == "XX002") return absl::DataLossError(std::move(message));
  if (state == "3D000" || state == "42P01" || state == "42703") {
    return absl::FailedPreconditionError(std::move(message));
  }
  return absl::InternalError(std::move(message));
}

absl::Status PgFailure(PGconn* conn, const PGresult* result, absl::string_view prefix) {
  const char* state = result != nullptr ? PQresultErrorField(result, PG_DIAG_SQLSTATE) : nullptr;
  const std::string detail =
      PgMessage(result != nullptr ? PQresultErrorMessage(result) : PQerrorMessage(conn));
  std::string message =
      absl::StrCat(prefix, ": ", detail.empty() ? PgMessage(PQerrorMessage(conn)) : detail);
  if (state == nullptr && PQstatus(conn) == CONNECTION_OK && result != nullptr) {
    return absl::InternalError(std::move(message));
  }
  return StatusFromSqlState(state != nullptr ? state : "", std::move(message));
}

bool PgReconnectIfBroken(PGconn* conn) {
  const PGTransactionStatusType transaction = PQtransactionStatus(conn);
  const bool in_transaction = transaction == PQTRANS_INTRANS || transaction == PQTRANS_INERROR;
  if (PQstatus(conn) == CONNECTION_OK && !in_transaction) {
    for (int i = 0; i < 2 && PQconsumeInput(conn) == 1; ++i) {
    }
  }
  if (PQstatus(conn) == CONNECTION_OK) return false;
  PQreset(conn);
  return true;
}

}  // namespace tessera::coordinator
