#include "coordinator/queues/queue_file.h"

#include <iostream>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/read_file.h"
#include "common/status_macros.h"

namespace tessera::coordinator {

absl::StatusOr<std::unique_ptr<QueueFile>> QueueFile::Create(QueueFileOptions options) {
  std::unique_ptr<QueueFile> file(new QueueFile(std::move(options)));
  absl::MutexLock lock(&file->mu_);
  file->last_check_ = file->options_.clock->Now();
  if (file->options_.path.empty()) {
    file->config_ = std::make_shared<const QueueConfig>();
    return file;
  }
  ASSIGN_OR_RETURN(std::string identity, FileIdentity(file->options_.path));
  RETURN_IF_ERROR(file->LoadLocked(identity));
  return file;
}

absl::Status QueueFile::LoadLocked(const std::string& identity) {
  ASSIGN_OR_RETURN(std::string text, ReadWholeFile(options_.path));
  auto config = ParseQueueConfig(text);
  if (!config.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("--queue_file ", options_.path, ": ", config.status().message()));
  }
  config_ = std::make_shared<const QueueConfig>(*std::move(config));
  identity_ = identity;
  ++reloads_;
  return absl::OkStatus();
}

absl::Status QueueFile::ReloadIfChanged() {
  if (options_.path.empty()) return absl::OkStatus();
  absl::MutexLock lock(&mu_);
  last_check_ = options_.clock->Now();
  ASSIGN_OR_RETURN(std::string identity, FileIdentity(options_.path));
  if (identity == identity_) return absl::OkStatus();
  absl::Status status = LoadLocked(identity);
  if (!status.ok()) {
    // The previous configuration stays; the same bad version is not read again on every check.
    identity_ = identity;
    if (last_error_ != status.message()) {
      last_error_ = std::string(status.message());
      std::cerr << "tessera-coordinator: keeping the previous queues: " << status << "\n";
    }
    return status;
  }
  last_error_.clear();
  std::cerr << "tessera-coordinator: reloaded " << options_.path << " (" << config_->queues.size()
            << " queues)\n";
  return absl::OkStatus();
}

std::shared_ptr<const QueueConfig> QueueFile::Current() {
  bool check = false;
  {
    absl::MutexLock lock(&mu_);
    check = !options_.path.empty() &&
            options_.clock->Now() - last_check_ >= options_.reload_check_interval;
  }
  if (check) ReloadIfChanged().IgnoreError();  // logged inside; the previous queues stay
  absl::MutexLock lock(&mu_);
  return config_;
}

int QueueFile::reloads() const {
  absl::MutexLock lock(&mu_);
  return reloads_;
}

}  // namespace tessera::coordinator
