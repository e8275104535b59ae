#include "coordinator/scheduling/pending_reasons.h"

#include "absl/strings/ascii.h"

namespace tessera::coordinator {

std::string ReasonShape(absl::string_view reason) {
  std::string shape;
  shape.reserve(reason.size());
  for (size_t i = 0; i < reason.size();) {
    if (!absl::ascii_isdigit(reason[i])) {
      shape.push_back(reason[i++]);
      continue;
    }
    while (i < reason.size() &&
           (absl::ascii_isdigit(reason[i]) ||
            (reason[i] == '.' && i + 1 < reason.size() && absl::ascii_isdigit(reason[i + 1])))) {
      ++i;
    }
    shape.push_back('#');
  }
  return shape;
}

std::vector<std::pair<std::string, std::string>> PendingReasons::ToWrite(
    const std::map<std::string, std::string>& reasons, const std::vector<v1::Job>& listed,
    absl::Time now) {
  std::map<std::string_view, const v1::Job*> by_id;
  for (const v1::Job& job : listed) by_id[job.job_id()] = &job;
  std::vector<std::pair<std::string, std::string>> out;
  for (const auto& [job_id, reason] : reasons) {
    auto found = by_id.find(job_id);
    if (found == by_id.end()) continue;
    const v1::Job& job = *found->second;
    if (job.state() != v1::JOB_STATE_PENDING || job.reason() == reason) continue;
    auto written = written_.find(job_id);
    if (written != written_.end() && now - written->second < kRefresh &&
        ReasonShape(job.reason()) == ReasonShape(reason)) {
      continue;
    }
    written_[job_id] = now;
    out.emplace_back(job_id, reason);
  }
  return out;
}

void PendingReasons::Keep(const std::set<std::string>& waiting) {
  std::erase_if(written_, [&](const auto& entry) { return !waiting.contains(entry.first); });
}

}  // namespace tessera::coordinator
