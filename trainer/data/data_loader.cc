#include "trainer/data/data_loader.h"

#include <glob.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "common/status_macros.h"

namespace tessera::trainer {
namespace {

bool HasGlobMagic(const std::string& pattern) {
  return pattern.find_first_of("*?[") != std::string::npos;
}

absl::StatusOr<std::vector<std::string>> ExpandPatterns(const std::vector<std::string>& patterns,
                                                        const std::string& field) {
  if (patterns.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(field, ": no shard file given"));
  }
  std::vector<std::string> paths;
  for (const std::string& pattern : patterns) {
    if (!HasGlobMagic(pattern)) {
      paths.push_back(pattern);
      continue;
    }
    glob_t matches{};
    const int rc = glob(pattern.c_str(), GLOB_ERR, nullptr, &matches);
    if (rc == 0) {
      for (size_t i = 0; i < matches.gl_pathc; ++i) paths.emplace_back(matches.gl_pathv[i]);
    }
    globfree(&matches);
    if (rc == GLOB_NOMATCH) {
      return absl::InvalidArgumentError(
          absl::StrCat(field, ": pattern '", pattern, "' matches no file"));
    }
    if (rc != 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          field, ": pattern '", pattern, "' could not be expanded (glob error ", rc, ")"));
    }
  }
  std::sort(paths.begin(), paths.end());
  paths.erase(std::unique(paths.begin(), paths.end()), paths.end());
  return paths;
}

// SplitMix64's finalizer: spreads (seed, epoch) over the whole 64-bit seed space, so that nearby
// seeds and epochs give unrelated generators.
uint64_t Mix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

// Uniform in [0, bound), bound > 0, by rejection (unbiased; defined here rather than by
// std::uniform_int_distribution, whose algorithm differs between standard libraries).
uint64_t UniformBelow(std::mt19937_64& generator, uint64_t bound) {
  const uint64_t threshold = (0 - bound) % bound;  // 2^64 mod bound
  while (true) {
    const uint64_t r = generator();
    if (r >= threshold) return r % bound;
  }
}

}  // namespace

absl::StatusOr<TokenDataset> TokenDataset::Open(const std::vector<std::string>& patterns,
                                                int seq_len, std::string_view field_view) {
  // absl::StrCat takes absl::string_view, which is not std::string_view in Debian's Abseil.
  const std::string field(field_view);
  if (seq_len <= 0) {
    return absl::InvalidArgumentError(absl::StrCat("seq_len must be positive (got ", seq_len, ")"));
  }
  ASSIGN_OR_RETURN(const std::vector<std::string> paths, ExpandPatterns(patterns, field));
  TokenDataset dataset;
  dataset.seq_len_ = seq_len;
  const uint64_t window = static_cast<uint64_t>(seq_len) + 1;
  uint64_t total_tokens = 0;
  for (const std::string& path : paths) {
    ASSIGN_OR_RETURN(TokenShard shard, TokenShard::Open(path));
    if (shard.sample_tokens() != 0 && shard.sample_tokens() != window) {
      return absl::InvalidArgumentError(absl::StrCat(
          field, ": ", path, " holds samples of ", shard.sample_tokens(),
          " tokens (prepared with --seq_len=", shard.sample_tokens() - 1, ") but seq_len is ",
          seq_len, "; prepare the data again with --seq_len=", seq_len));
    }
    dataset.has_loss_mask_ =
        dataset.has_loss_mask_ || shard.has_loss_mask() || shard.has_record_starts();
    dataset.has_record_starts_ = dataset.has_record_starts_ || shard.has_record_starts();
    if (dataset.shards_.empty()) {
      dataset.vocab_size_ = shard.vocab_size();
    } else if (shard.vocab_size() != dataset.vocab_size_) {
      return absl::InvalidArgumentError(
          absl::StrCat(field, ": ", path, " has vocab_size ", shard.vocab_size(), " but ",
                       dataset.shards_.front().path(), " has ", dataset.vocab_size_));
    }
    total_tokens += shard.size();
    dataset.sample_offsets_.push_back(dataset.sample_offsets_.back() +
                                      static_cast<int64_t>(shard.size() / window));
    dataset.shards_.push_back(std::move(shard));
  }
  if (dataset.num_samples() == 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        field, ": the ", paths.size(), " shard(s) hold no sample of seq_len + 1 = ", window,
        " tokens (", total_tokens, " tokens in all; no sample crosses a shard boundary)"));
  }
  return dataset;
}

std::pair<size_t, uint64_t> TokenDataset::Locate(int64_t index) const {
  if (index < 0 || index >= num_samples()) {
    std::fprintf(stderr, "TokenDataset: sample %lld outside [0, %lld)\n",
                 static_cast<long long>(index), static_cast<long long>(num_samples()));
    std::abort();
  }
  // The shard k with sample_offsets_[k] <= index < sample_offsets_[k + 1].
  const auto next = std::upper_bound(sample_offsets_.begin(), sample_offsets_.end(), index);
  const size_t shard = static_cast<size_t>(next - sample_offsets_.begin()) - 1;
  const uint64_t window = static_cast<uint64_t>(seq_len_) + 1;
  return {shard, static_cast<uint64_t>(index - sample_offsets_[shard]) * window};
}

namespace {

// CorruptTokenError for the first of `count` tokens read from `file` at token `offset` that is not
// below `vocab_size`.
void CheckTokens(const TokenShard& file, uint64_t offset, const int64_t* tokens, uint64_t count,
                 uint32_t vocab_size) {
  int64_t largest = 0;
  for (uint64_t i = 0; i < count; ++i) largest = std::max(largest, tokens[i]);
  if (largest < vocab_size) return;
  for (uint64_t i = 0; i < count; ++i) {
    if (tokens[i] >= vocab_size) {
      throw CorruptTokenError(absl::StrCat(file.path(), ": token ", offset + i, " is ", tokens[i],
                                           ", not below the vocabulary size ", vocab_size,
                                           " the shard declares (a corrupt shard)"));
    }
  }
}

}  // namespace

void TokenDataset::ReadSample(int64_t index, int64_t* out) const {
  const auto [shard, offset] = Locate(index);
  const uint64_t count = static_cast<uint64_t>(seq_len_) + 1;
  shards_[shard].Read(offset, count, out);
  CheckTokens(shards_[shard], offset, out, count, vocab_size_);
}

namespace {

// Which of the seq_len targets of the sample at `offset` count: the loss mask's, less the first
// tokens of records (nothing before them in their record predicts them). Empty when all count.
std::vector<uint8_t> CountedTargets(const TokenShard& file, uint64_t offset, int seq_len) {
  if (!file.has_loss_mask() && !file.has_record_starts()) return {};
  std::vector<uint8_t> counted(static_cast<size_t>(seq_len));
  file.ReadLossMask(offset + 1, counted.size(), counted.data());
  if (file.has_record_starts()) {
    std::vector<uint8_t> starts(counted.size());
    file.ReadRecordStarts(offset + 1, starts.size(), starts.data());
    for (size_t i = 0; i < counted.size(); ++i) {
      if (starts[i] != 0) counted[i] = 0;
    }
  }
  return counted;
}

}  // namespace

int64_t TokenDataset::ReadExample(int64_t index, int64_t* inputs, int64_t* targets,
                                  int64_t* positions) const {
  const auto [shard, offset] = Locate(index);
  const TokenShard& file = shards_[shard];
  file.Read(offset, static_cast<uint64_t>(seq_len_), inputs);
  file.Read(offset + 1, static_cast<uint64_t>(seq_len_), targets);
  CheckTokens(file, offset, inputs, static_cast<uint64_t>(seq_len_), vocab_size_);
  CheckTokens(file, offset + 1, targets, static_cast<uint64_t>(seq_len_), vocab_size_);
  if (positions != nullptr) {
    std::vector<uint8_t> starts(static_cast<size_t>(seq_len_));
    file.ReadRecordStarts(offset, starts.size(), starts.data());
    for (size_t i = 0; i < starts.size(); ++i) {
      positions[i] = i == 0 || starts[i] != 0 ? 0 : positions[i - 1] + 1;
    }
  }
  const std::vector<uint8_t> counted = CountedTargets(file, offset, seq_len_);
  if (counted.empty()) return seq_len_;
  int64_t count = 0;
  for (size_t i = 0; i < counted.size(); ++i) {
    if (counted[i] != 0) {
      ++count;
    } else {
      targets[i] = kIgnoreTarget;
    }
  }
  return count;
}

int64_t TokenDataset::CountLossTargets(int64_t index) const {
  const auto [shard, offset] = Locate(index);
  const std::vector<uint8_t> counted = CountedTargets(shards_[shard], offset, seq_len_);
  if (counted.empty()) return seq_len_;
  return std::count_if(counted.begin(), counted.end(), [](uint8_t m) { return m != 0; });
}

double LossWeight(const MicroBatch& batch) {
  if (batch.step_loss_tokens <= 0) return 0.0;
  return static_cast<double>(batch.loss_tokens) / static_cast<double>(batch.step_loss_tokens);
}

std::vector<int64_t> EpochPermutation(int64_t num_samples, uint64_t seed, int64_t epoch) {
  std::vector<int64_t> order(static_cast<size_t>(std::max<int64_t>(num_samples, 0)));
  for (size_t i = 0; i < order.size(); ++i) order[i] = static_cast<int64_t>(i);
  std::mt19937_64 generator(Mix64(seed ^ Mix64(static_cast<uint64_t>(epoch))));
  for (size_t i = order.size(); i > 1; --i) {
    const size_t j = static_cast<size_t>(UniformBelow(generator, i));
    std::swap(order[i - 1], order[j]);
  }
  return order;
}

BatchLoader::BatchLoader(const TokenDataset* dataset, const BatchLoaderOptions& options)
    : dataset_(dataset),
      options_(options),
      accumulation_steps_(static_cast<int>(
          options.global_batch_size / (int64_t{options.micro_batch_size} * options.dp_size))) {}

absl::StatusOr<BatchLoader> BatchLoader::Create(const TokenDataset* dataset,
                                                const BatchLoaderOptions& options,
                                                const v1::DataPosition& start) {
  if (dataset == nullptr) return absl::InvalidArgumentError("BatchLoader needs a dataset");
  if (options.global_batch_size <= 0) {
    return absl::InvalidArgumentError(absl::StrCat("batch.global_batch_size must be positive (got ",
                                                   options.global_batch_size, ")"));
  }
  if (options.micro_batch_size <= 0) {
    return absl::InvalidArgumentError(absl::StrCat("batch.micro_batch_size must be positive (got ",
                                                   options.micro_batch_size, ")"));
  }
  if (options.dp_size <= 0 || options.dp_rank < 0 || options.dp_rank >= options.dp_size) {
    return absl::InvalidArgumentError(
        absl::StrCat("dp_rank ", options.dp_rank, " is not a rank of dp_size ", options.dp_size));
  }
  const int64_t per_pass = int64_t{options.micro_batch_size} * options.dp_size;
  if (options.global_batch_size % per_pass != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("batch.global_batch_size (", options.global_batch_size,
                     ") must be divisible by batch.micro_batch_size (", options.micro_batch_size,
                     ") * data-parallel size (", options.dp_size, ") = ", per_pass));
  }
  if (options.global_batch_size > dataset->num_samples()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "batch.global_batch_size (", options.global_batch_size, ") is larger than the ",
        dataset->num_samples(), " samples of the dataset (seq_len ", dataset->seq_len(), ")"));
  }
  const bool fresh = start.epoch() == 0 && start.samples_in_epoch() == 0;
  if (!fresh && start.seed() != options.seed) {
    return absl::InvalidArgumentError(absl::StrCat(
        "data position was recorded with seed ", start.seed(), " but the loader's seed is ",
        options.seed, "; resuming with another seed would repeat and skip samples"));
  }
  if (start.epoch() < 0 || start.samples_in_epoch() < 0 ||
      start.samples_in_epoch() > dataset->num_samples()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "data position (epoch ", start.epoch(), ", samples_in_epoch ", start.samples_in_epoch(),
        ") lies outside the dataset's ", dataset->num_samples(), " samples"));
  }
  BatchLoader loader(dataset, options);
  loader.epoch_ = start.epoch();
  loader.samples_in_epoch_ = start.samples_in_epoch();
  loader.SkipPartialStep();
  return loader;
}

void BatchLoader::SkipPartialStep() {
  if (samples_in_epoch_ + options_.global_batch_size > dataset_->num_samples()) {
    ++epoch_;
    samples_in_epoch_ = 0;
  }
}

const std::vector<int64_t>& BatchLoader::Permutation() {
  if (permutation_epoch_ != epoch_) {
    permutation_ = EpochPermutation(dataset_->num_samples(), options_.seed, epoch_);
    permutation_epoch_ = epoch_;
  }
  return permutation_;
}

std::vector<MicroBatch> BatchLoader::NextStep() {
  const std::vector<int64_t>& order = Permutation();
  const int seq_len = dataset_->seq_len();
  const int micro = options_.micro_batch_size;
  const int64_t rank_begin =
      samples_in_epoch_ + options_.dp_rank * (options_.global_batch_size / options_.dp_size);
  // Every rank counts the whole step's targets itself (reading only masks), so that no
  // collective is needed to weigh its micro-batches.
  int64_t step_loss_tokens = 0;
  if (dataset_->has_loss_mask()) {
    for (int64_t i = 0; i < options_.global_batch_size; ++i) {
      step_loss_tokens +=
          dataset_->CountLossTargets(order[static_cast<size_t>(samples_in_epoch_ + i)]);
    }
  } else {
    step_loss_tokens = options_.global_batch_size * seq_len;
  }
  std::vector<MicroBatch> batches(static_cast<size_t>(accumulation_steps_));
  for (int m = 0; m < accumulation_steps_; ++m) {
    MicroBatch& batch = batches[static_cast<size_t>(m)];
    batch.batch_size = micro;
    batch.seq_len = seq_len;
    batch.inputs.resize(static_cast<size_t>(micro) * seq_len);
    batch.targets.resize(static_cast<size_t>(micro) * seq_len);
    if (dataset_->has_record_starts()) batch.positions.resize(batch.inputs.size());
    batch.step_loss_tokens = step_loss_tokens;
    for (int row = 0; row < micro; ++row) {
      const int64_t sample = order[static_cast<size_t>(rank_begin + int64_t{m} * micro + row)];
      const size_t offset = static_cast<size_t>(row) * seq_len;
      batch.loss_tokens += dataset_->ReadExample(
          sample, batch.inputs.data() + offset, batch.targets.data() + offset,
          batch.positions.empty() ? nullptr : batch.positions.data() + offset);
    }
  }
  samples_in_epoch_ += options_.global_batch_size;
  SkipPartialStep();
  return batches;
}

v1::DataPosition BatchLoader::position() const {
  v1::DataPosition position;
  position.set_epoch(epoch_);
  position.set_samples_in_epoch(samples_in_epoch_);
  position.set_seed(options_.seed);
  return position;
}

}  // namespace tessera::trainer
