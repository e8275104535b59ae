#include "coordinator/queues/queue_config.h"

#include <algorithm>
#include <cmath>
#include <set>
#include <utility>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/status_macros.h"
#include "yaml-cpp/yaml.h"

namespace tessera::coordinator {
namespace {

constexpr absl::string_view kFile = "queue file: ";

absl::Status Invalid(absl::string_view where, absl::string_view what) {
  return absl::InvalidArgumentError(absl::StrCat(kFile, where, ": ", what));
}

bool ValidName(absl::string_view name) {
  if (name.empty() || name.size() > 63) return false;
  return std::all_of(name.begin(), name.end(), [](char c) {
    return absl::ascii_islower(c) || absl::ascii_isdigit(c) || c == '-';
  });
}

std::string Describe(const YAML::Node& node) {
  if (node.IsScalar()) return absl::StrCat("'", node.Scalar(), "'");
  if (node.IsSequence()) return "a list";
  if (node.IsMap()) return "a map";
  return "nothing";
}

// Keys of `node` must be among `allowed`.
absl::Status CheckKeys(const YAML::Node& node, absl::string_view where,
                       const std::vector<absl::string_view>& allowed) {
  if (!node.IsMap()) return Invalid(where, absl::StrCat("expected a map, got ", Describe(node)));
  for (const auto& entry : node) {
    const std::string key = entry.first.Scalar();
    if (std::find(allowed.begin(), allowed.end(), key) == allowed.end()) {
      return Invalid(where,
                     absl::StrCat("unknown key '", key, "' (", absl::StrJoin(allowed, ", "), ")"));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<std::string> ReadString(const YAML::Node& node, absl::string_view where) {
  if (!node.IsScalar())
    return Invalid(where, absl::StrCat("expected a string, got ", Describe(node)));
  return node.Scalar();
}

absl::StatusOr<int64_t> ReadCount(const YAML::Node& node, absl::string_view where) {
  int64_t value = 0;
  if (!node.IsScalar() || !absl::SimpleAtoi(node.Scalar(), &value)) {
    return Invalid(where, absl::StrCat("expected a whole number, got ", Describe(node)));
  }
  if (value < 0) return Invalid(where, absl::StrCat("must be >= 0, got ", value));
  return value;
}

absl::StatusOr<std::vector<std::string>> ReadNames(const YAML::Node& node,
                                                   absl::string_view where) {
  if (!node.IsSequence())
    return Invalid(where, absl::StrCat("expected a list, got ", Describe(node)));
  std::vector<std::string> names;
  for (size_t i = 0; i < node.size(); ++i) {
    ASSIGN_OR_RETURN(std::string name, ReadString(node[i], absl::StrCat(where, "[", i, "]")));
    if (name.empty()) return Invalid(absl::StrCat(where, "[", i, "]"), "must not be empty");
    names.push_back(std::move(name));
  }
  return names;
}

absl::StatusOr<std::map<std::string, std::string>> ReadLabels(const YAML::Node& node,
                                                              absl::string_view where) {
  if (!node.IsMap()) return Invalid(where, absl::StrCat("expected a map, got ", Describe(node)));
  std::map<std::string, std::string> labels;
  for (const auto& entry : node) {
    const std::string key = entry.first.Scalar();
    ASSIGN_OR_RETURN(labels[key], ReadString(entry.second, absl::StrCat(where, ".", key)));
  }
  return labels;
}

// nominal / borrowing_limit: {gpus, cpu_slots}, each optional.
absl::Status ReadResources(const YAML::Node& node, absl::string_view where,
                           std::optional<int64_t>* gpus, std::optional<int64_t>* cpu_slots) {
  RETURN_IF_ERROR(CheckKeys(node, where, {"gpus", "cpu_slots"}));
  if (node["gpus"]) {
    ASSIGN_OR_RETURN(*gpus, ReadCount(node["gpus"], absl::StrCat(where, ".gpus")));
  }
  if (node["cpu_slots"]) {
    ASSIGN_OR_RETURN(*cpu_slots, ReadCount(node["cpu_slots"], absl::StrCat(where, ".cpu_slots")));
  }
  return absl::OkStatus();
}

absl::StatusOr<QueueSpec> ReadQueue(const YAML::Node& node, absl::string_view where) {
  RETURN_IF_ERROR(CheckKeys(
      node, where,
      {"name", "cohort", "nominal", "borrowing_limit", "weight", "submitters", "default_for"}));
  QueueSpec queue;
  if (node["name"]) {
    ASSIGN_OR_RETURN(queue.name, ReadString(node["name"], absl::StrCat(where, ".name")));
  }
  // Later messages name the queue too, so a person finds it without counting entries.
  const std::string at =
      queue.name.empty() ? std::string(where) : absl::StrCat(where, " (", queue.name, ")");
  if (node["cohort"]) {
    ASSIGN_OR_RETURN(queue.cohort, ReadString(node["cohort"], absl::StrCat(at, ".cohort")));
  }
  if (node["nominal"]) {
    std::optional<int64_t> gpus, cpu_slots;
    RETURN_IF_ERROR(
        ReadResources(node["nominal"], absl::StrCat(at, ".nominal"), &gpus, &cpu_slots));
    queue.nominal = Resources{.gpus = gpus.value_or(0), .cpu_slots = cpu_slots.value_or(0)};
  }
  if (node["borrowing_limit"]) {
    RETURN_IF_ERROR(ReadResources(node["borrowing_limit"], absl::StrCat(at, ".borrowing_limit"),
                                  &queue.borrowing_limit_gpus, &queue.borrowing_limit_cpu_slots));
  }
  if (node["weight"]) {
    const YAML::Node weight = node["weight"];
    if (!weight.IsScalar() || !absl::SimpleAtod(weight.Scalar(), &queue.weight)) {
      return Invalid(absl::StrCat(at, ".weight"),
                     absl::StrCat("expected a number, got ", Describe(weight)));
    }
  }
  if (node["submitters"]) {
    const std::string field = absl::StrCat(at, ".submitters");
    RETURN_IF_ERROR(CheckKeys(node["submitters"], field, {"users", "groups"}));
    if (node["submitters"]["users"]) {
      ASSIGN_OR_RETURN(queue.submitters.users,
                       ReadNames(node["submitters"]["users"], absl::StrCat(field, ".users")));
    }
    if (node["submitters"]["groups"]) {
      ASSIGN_OR_RETURN(queue.submitters.groups,
                       ReadNames(node["submitters"]["groups"], absl::StrCat(field, ".groups")));
    }
  }
  if (node["default_for"]) {
    const std::string field = absl::StrCat(at, ".default_for");
    const YAML::Node rule = node["default_for"];
    RETURN_IF_ERROR(CheckKeys(rule, field, {"users", "groups", "labels"}));
    if (rule["users"]) {
      ASSIGN_OR_RETURN(queue.default_for.users,
                       ReadNames(rule["users"], absl::StrCat(field, ".users")));
    }
    if (rule["groups"]) {
      ASSIGN_OR_RETURN(queue.default_for.groups,
                       ReadNames(rule["groups"], absl::StrCat(field, ".groups")));
    }
    if (rule["labels"]) {
      ASSIGN_OR_RETURN(queue.default_for.labels,
                       ReadLabels(rule["labels"], absl::StrCat(field, ".labels")));
    }
  }
  return queue;
}

bool Contains(const std::vector<std::string>& names, absl::string_view name) {
  return std::find(names.begin(), names.end(), name) != names.end();
}

bool MaySubmit(const QueueSpec& queue, const Submission& submission) {
  if (queue.submitters.users.empty() && queue.submitters.groups.empty()) return true;
  if (Contains(queue.submitters.users, submission.owner)) return true;
  return std::any_of(
      submission.groups.begin(), submission.groups.end(),
      [&](const std::string& group) { return Contains(queue.submitters.groups, group); });
}

bool LabelsMatch(const std::map<std::string, std::string>& wanted,
                 const std::map<std::string, std::string>& carried) {
  if (wanted.empty()) return false;
  for (const auto& [key, value] : wanted) {
    auto it = carried.find(key);
    if (it == carried.end() || it->second != value) return false;
  }
  return true;
}

}  // namespace

absl::string_view ResourceName(ResourceKind kind) {
  return kind == ResourceKind::kGpus ? "GPUs" : "CPU slots";
}

const QueueSpec* QueueConfig::Find(absl::string_view queue) const {
  for (const QueueSpec& spec : queues) {
    if (spec.name == queue) return &spec;
  }
  return nullptr;
}

std::string CountingQueue(const std::string& job_queue, const QueueConfig& config) {
  if ((job_queue.empty() || job_queue == kImplicitQueue) &&
      config.Find(kImplicitQueue) == nullptr && !config.default_queue.empty()) {
    return config.default_queue;
  }
  return job_queue.empty() ? std::string(kImplicitQueue) : job_queue;
}

Resources QueueConfig::CohortNominal(const QueueSpec& queue) const {
  if (queue.cohort.empty()) return queue.nominal;
  Resources total;
  for (const QueueSpec& spec : queues) {
    if (spec.cohort == queue.cohort) total += spec.nominal;
  }
  return total;
}

absl::StatusOr<absl::Duration> ParseConfigDuration(absl::string_view text) {
  text = absl::StripAsciiWhitespace(text);
  const absl::Status invalid = absl::InvalidArgumentError(absl::StrCat(
      "expected a positive duration with a unit s, m, h or d (e.g. 7d), got '", text, "'"));
  if (text.size() < 2) return invalid;
  absl::Duration unit;
  switch (text.back()) {
    case 's':
      unit = absl::Seconds(1);
      break;
    case 'm':
      unit = absl::Minutes(1);
      break;
    case 'h':
      unit = absl::Hours(1);
      break;
    case 'd':
      unit = absl::Hours(24);
      break;
    default:
      return invalid;
  }
  double amount = 0;
  if (!absl::SimpleAtod(text.substr(0, text.size() - 1), &amount) || !std::isfinite(amount) ||
      amount <= 0) {
    return invalid;
  }
  return amount * unit;
}

absl::StatusOr<QueueConfig> ParseQueueConfig(absl::string_view yaml) {
  YAML::Node root;
  try {
    root = YAML::Load(std::string(yaml));
  } catch (const YAML::Exception& error) {
    return absl::InvalidArgumentError(absl::StrCat(kFile, "not YAML: ", error.what()));
  }
  QueueConfig config;
  // An empty file: no queues, the implicit one.
  if (root.IsNull()) return config;
  try {
    RETURN_IF_ERROR(CheckKeys(root, "top level",
                              {"cohorts", "queues", "default_queue", "fair_share", "preemption"}));
    if (root["cohorts"]) {
      const YAML::Node list = root["cohorts"];
      if (!list.IsSequence()) return Invalid("cohorts", "expected a list");
      for (size_t i = 0; i < list.size(); ++i) {
        const std::string where = absl::StrCat("cohorts[", i, "]");
        RETURN_IF_ERROR(CheckKeys(list[i], where, {"name"}));
        if (!list[i]["name"]) return Invalid(absl::StrCat(where, ".name"), "required");
        ASSIGN_OR_RETURN(std::string name,
                         ReadString(list[i]["name"], absl::StrCat(where, ".name")));
        config.cohorts.push_back(std::move(name));
      }
    }
    if (root["queues"]) {
      const YAML::Node list = root["queues"];
      if (!list.IsSequence()) return Invalid("queues", "expected a list");
      for (size_t i = 0; i < list.size(); ++i) {
        ASSIGN_OR_RETURN(QueueSpec queue, ReadQueue(list[i], absl::StrCat("queues[", i, "]")));
        config.queues.push_back(std::move(queue));
      }
    }
    if (root["default_queue"]) {
      ASSIGN_OR_RETURN(config.default_queue, ReadString(root["default_queue"], "default_queue"));
    }
    if (root["fair_share"]) {
      const YAML::Node fair_share = root["fair_share"];
      RETURN_IF_ERROR(CheckKeys(fair_share, "fair_share", {"half_life"}));
      if (fair_share["half_life"]) {
        ASSIGN_OR_RETURN(std::string text,
                         ReadString(fair_share["half_life"], "fair_share.half_life"));
        auto half_life = ParseConfigDuration(text);
        if (!half_life.ok()) return Invalid("fair_share.half_life", half_life.status().message());
        config.fair_share_half_life = *half_life;
      }
    }
    if (root["preemption"]) {
      const YAML::Node preemption = root["preemption"];
      RETURN_IF_ERROR(CheckKeys(preemption, "preemption", {"checkpoint_deadline"}));
      if (preemption["checkpoint_deadline"]) {
        ASSIGN_OR_RETURN(std::string text, ReadString(preemption["checkpoint_deadline"],
                                                      "preemption.checkpoint_deadline"));
        auto deadline = ParseConfigDuration(text);
        if (!deadline.ok()) {
          return Invalid("preemption.checkpoint_deadline", deadline.status().message());
        }
        config.preemption_checkpoint_deadline = *deadline;
      }
    }
  } catch (const YAML::Exception& error) {
    return absl::InvalidArgumentError(absl::StrCat(kFile, error.what()));
  }
  RETURN_IF_ERROR(ValidateQueueConfig(config));
  return config;
}

absl::Status ValidateQueueConfig(const QueueConfig& config) {
  std::set<std::string> cohorts;
  for (size_t i = 0; i < config.cohorts.size(); ++i) {
    const std::string where = absl::StrCat("cohorts[", i, "].name");
    const std::string& name = config.cohorts[i];
    if (!ValidName(name)) {
      return Invalid(where, absl::StrCat("'", name, "' must be 1-63 characters of a-z, 0-9 and -"));
    }
    if (!cohorts.insert(name).second) {
      return Invalid(where, absl::StrCat("cohort '", name, "' is listed twice"));
    }
  }
  // Who is defaulted where, to refuse a user, group or label sent to two queues.
  absl::flat_hash_map<std::string, std::string> default_user, default_group, default_label;
  std::set<std::string> names;
  std::set<std::string> used_cohorts;
  for (size_t i = 0; i < config.queues.size(); ++i) {
    const QueueSpec& queue = config.queues[i];
    const std::string entry = absl::StrCat("queues[", i, "]");
    if (queue.name.empty()) return Invalid(absl::StrCat(entry, ".name"), "required");
    if (!ValidName(queue.name)) {
      return Invalid(absl::StrCat(entry, ".name"),
                     absl::StrCat("'", queue.name, "' must be 1-63 characters of a-z, 0-9 and -"));
    }
    const std::string at = absl::StrCat(entry, " (", queue.name, ")");
    if (!names.insert(queue.name).second) {
      return Invalid(absl::StrCat(entry, ".name"),
                     absl::StrCat("queue '", queue.name, "' is listed twice"));
    }
    if (!queue.cohort.empty() && !cohorts.contains(queue.cohort)) {
      return Invalid(absl::StrCat(at, ".cohort"),
                     absl::StrCat("unknown cohort '", queue.cohort, "' (not under cohorts)"));
    }
    if (!queue.cohort.empty()) used_cohorts.insert(queue.cohort);
    for (ResourceKind kind : {ResourceKind::kGpus, ResourceKind::kCpuSlots}) {
      const absl::string_view field = kind == ResourceKind::kGpus ? "gpus" : "cpu_slots";
      const int64_t nominal = Get(queue.nominal, kind);
      if (nominal < 0) {
        return Invalid(absl::StrCat(at, ".nominal.", field),
                       absl::StrCat("must be >= 0, got ", nominal));
      }
      const std::optional<int64_t> limit = queue.BorrowingLimit(kind);
      if (limit.has_value() && *limit < 0) {
        return Invalid(absl::StrCat(at, ".borrowing_limit.", field),
                       absl::StrCat("must be >= 0, got ", *limit));
      }
    }
    if ((queue.borrowing_limit_gpus.has_value() || queue.borrowing_limit_cpu_slots.has_value()) &&
        queue.cohort.empty()) {
      return Invalid(absl::StrCat(at, ".borrowing_limit"),
                     "set without a cohort (a queue borrows only from its cohort)");
    }
    if (!(queue.weight > 0) || !std::isfinite(queue.weight)) {
      return Invalid(absl::StrCat(at, ".weight"), absl::StrCat("must be > 0, got ", queue.weight));
    }
    for (const std::string& user : queue.default_for.users) {
      auto [it, inserted] = default_user.emplace(user, queue.name);
      if (!inserted) {
        return Invalid(
            absl::StrCat(at, ".default_for.users"),
            absl::StrCat("user '", user, "' is already defaulted to queue ", it->second));
      }
      // With submitter groups the user may be a member: only the daemon knows groups.
      if (!queue.submitters.users.empty() && queue.submitters.groups.empty() &&
          !Contains(queue.submitters.users, user)) {
        return Invalid(
            absl::StrCat(at, ".default_for.users"),
            absl::StrCat("user '", user, "' is defaulted here but not listed in submitters.users"));
      }
    }
    for (const std::string& group : queue.default_for.groups) {
      auto [it, inserted] = default_group.emplace(group, queue.name);
      if (!inserted) {
        return Invalid(
            absl::StrCat(at, ".default_for.groups"),
            absl::StrCat("group '", group, "' is already defaulted to queue ", it->second));
      }
    }
    if (!queue.default_for.labels.empty()) {
      std::vector<std::string> pairs;
      for (const auto& [key, value] : queue.default_for.labels) pairs.push_back(key + "=" + value);
      const std::string key = absl::StrJoin(pairs, ",");
      auto [it, inserted] = default_label.emplace(key, queue.name);
      if (!inserted) {
        return Invalid(absl::StrCat(at, ".default_for.labels"),
                       absl::StrCat("labels {", key, "} already default to queue ", it->second));
      }
    }
  }
  if (!config.default_queue.empty() && !names.contains(config.default_queue)) {
    return Invalid("default_queue", absl::StrCat("unknown queue '", config.default_queue, "'"));
  }
  for (const std::string& cohort : config.cohorts) {
    if (!used_cohorts.contains(cohort)) {
      return Invalid("cohorts", absl::StrCat("cohort '", cohort, "' has no queue"));
    }
  }
  if (config.fair_share_half_life <= absl::ZeroDuration()) {
    return Invalid("fair_share.half_life", "must be > 0");
  }
  if (config.preemption_checkpoint_deadline <= absl::ZeroDuration()) {
    return Invalid("preemption.checkpoint_deadline", "must be > 0");
  }
  return absl::OkStatus();
}

absl::StatusOr<std::string> QueueFor(const QueueConfig& config, const Submission& submission) {
  if (config.implicit()) {
    if (submission.requested_queue.empty() || submission.requested_queue == kImplicitQueue) {
      return std::string(kImplicitQueue);
    }
    return absl::NotFoundError(absl::StrCat("queue '", submission.requested_queue,
                                            "' does not exist (no queues are configured)"));
  }
  const QueueSpec* chosen = nullptr;
  std::string how;
  if (!submission.requested_queue.empty()) {
    chosen = config.Find(submission.requested_queue);
    if (chosen == nullptr) {
      std::vector<std::string> names;
      for (const QueueSpec& queue : config.queues) names.push_back(queue.name);
      return absl::NotFoundError(
          absl::StrCat("queue '", submission.requested_queue,
                       "' does not exist (queues: ", absl::StrJoin(names, ", "), ")"));
    }
    how = "named";
  }
  for (const QueueSpec& queue : config.queues) {
    if (chosen != nullptr) break;
    if (Contains(queue.default_for.users, submission.owner)) {
      chosen = &queue;
      how = absl::StrCat("the default queue of user ", submission.owner);
    }
  }
  for (const QueueSpec& queue : config.queues) {
    if (chosen != nullptr) break;
    for (const std::string& group : submission.groups) {
      if (Contains(queue.default_for.groups, group)) {
        chosen = &queue;
        how = absl::StrCat("the default queue of group ", group);
        break;
      }
    }
  }
  for (const QueueSpec& queue : config.queues) {
    if (chosen != nullptr) break;
    if (LabelsMatch(queue.default_for.labels, submission.labels)) {
      chosen = &queue;
      how = "the default queue for the job's labels";
    }
  }
  if (chosen == nullptr && !config.default_queue.empty()) {
    chosen = config.Find(config.default_queue);
    how = "the default_queue";
  }
  if (chosen == nullptr) {
    return absl::FailedPreconditionError(
        absl::StrCat("the job names no queue and none is the default for user ", submission.owner,
                     "; name one"));
  }
  if (!MaySubmit(*chosen, submission)) {
    std::vector<std::string> allowed;
    if (!chosen->submitters.users.empty()) {
      allowed.push_back(absl::StrCat("users ", absl::StrJoin(chosen->submitters.users, ", ")));
    }
    if (!chosen->submitters.groups.empty()) {
      allowed.push_back(absl::StrCat("groups ", absl::StrJoin(chosen->submitters.groups, ", ")));
    }
    return absl::PermissionDeniedError(
        absl::StrCat("user ", submission.owner, " may not submit to queue ", chosen->name, " (",
                     how, "; open to ", absl::StrJoin(allowed, " and "), ")"));
  }
  return chosen->name;
}

}  // namespace tessera::coordinator
