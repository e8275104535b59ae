#include "common/errno_status.h"

#include <cerrno>
#include <cstring>
#include <string>

#include "absl/strings/str_cat.h"

namespace tessera {

absl::Status ErrnoToStatus(int error, absl::string_view what) {
  std::string message = absl::StrCat(what, ": ", std::strerror(error));
  switch (error) {
    case ENOENT:
      return absl::NotFoundError(message);
    case EACCES:
    case EPERM:
      return absl::PermissionDeniedError(message);
    case ENOSPC:
    case EDQUOT:
      return absl::ResourceExhaustedError(message);
    case EISDIR:
    case ENOTDIR:
      return absl::FailedPreconditionError(message);
    default:
      return absl::InternalError(message);
  }
}

}  // namespace tessera
