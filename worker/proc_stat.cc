#include "worker/proc_stat.h"

#include <cerrno>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"

namespace tessera::worker {

absl::StatusOr<ProcStat> ParseProcStat(const std::string& line) {
  // The command name (field 2) is in parentheses and may contain anything, ")" included: the
  // fields that follow start after the last ")".
  const size_t close = line.rfind(')');
  if (close == std::string::npos) {
    return absl::InternalError(absl::StrCat("unparsable /proc stat line: ", line));
  }
  std::vector<std::string> fields =
      absl::StrSplit(line.substr(close + 1), ' ', absl::SkipWhitespace());
  // fields[0] is field 3 (state), fields[19] is field 22 (starttime).
  ProcStat stat;
  int64_t group = 0;
  if (fields.size() < 20 || fields[0].size() != 1 || !absl::SimpleAtoi(fields[2], &group) ||
      !absl::SimpleAtoi(fields[19], &stat.start_time)) {
    return absl::InternalError(absl::StrCat("unparsable /proc stat line: ", line));
  }
  stat.state = fields[0][0];
  stat.process_group = static_cast<pid_t>(group);
  return stat;
}

absl::StatusOr<ProcStat> ReadProcStat(pid_t pid) {
  const std::string path = absl::StrCat("/proc/", pid, "/stat");
  std::ifstream in(path);
  std::string line;
  if (!in || !std::getline(in, line)) {
    return absl::NotFoundError(absl::StrCat("no process ", pid, " (", path, ")"));
  }
  return ParseProcStat(line);
}

std::string DescribeProcessState(char state) {
  switch (state) {
    case 'R':
      return "running";
    case 'S':
      return "sleeping";
    case 'D':
      return "uninterruptible I/O wait";
    case 'Z':
      return "zombie";
    case 'T':
      return "stopped";
    case 't':
      return "stopped by a tracer";
    case 'X':
      return "dead";
    case 'I':
      return "idle";
    default:
      return absl::StrCat("state ", std::string(1, state));
  }
}

}  // namespace tessera::worker
