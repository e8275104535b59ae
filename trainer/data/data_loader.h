// The training samples and the order the ranks consume them in. TokenDataset cuts token shards
// into fixed windows; BatchLoader deals them out, step by step, to the data-parallel ranks in an
// order every rank computes alone from (seed, epoch), and records where it is as a
// v1::DataPosition so that a resumed run continues exactly where the checkpoint left off.
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "tessera/v1/checkpoint.pb.h"
#include "trainer/data/token_shard.h"

namespace tessera::trainer {

// The target value of a position whose loss is not taken (a prompt or padding token): the
// losses (CausalLM::Loss, VocabParallelCrossEntropy) skip it. Torch's cross_entropy default.
inline constexpr int64_t kIgnoreTarget = -100;

// A shard whose body holds a token id that is not below its vocabulary size (a corrupt or
// hand-made file): thrown by TokenDataset's reads, which run once per sample on the training
// loop's hot path, and caught at the trainer's boundary as a DATA_ERROR failure.
class CorruptTokenError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// The training samples: every shard cut into non-overlapping windows of seq_len + 1 tokens
// (inputs = window[0..seq_len), targets = window[1..seq_len]); a shard's tail shorter than a
// window is dropped. Sample i of shard k comes after every sample of shards 0..k-1. A target
// whose token the shard's loss mask marks 0 becomes kIgnoreTarget (see token_shard.h).
// Movable; reads are const and safe from several threads.
class TokenDataset {
 public:
  // `patterns`: paths or glob(3) patterns; the files they name are sorted and deduplicated.
  // A pattern with wildcards that matches nothing is INVALID_ARGUMENT
  // ("<field>: pattern 'x*' matches no file"); a plain path that does not exist is the shard's
  // NOT_FOUND. Shard errors are passed on as TokenShard::Open gives them. All shards must have the
  // same vocab_size, and together hold at least one sample; a shard written in fixed samples
  // (sample_tokens) must have samples of seq_len + 1 tokens. `field` names the configuration
  // field the patterns came from, for messages.
  static absl::StatusOr<TokenDataset> Open(const std::vector<std::string>& patterns, int seq_len,
                                           std::string_view field = "data.train_shards");

  int64_t num_samples() const { return sample_offsets_.back(); }
  int seq_len() const { return seq_len_; }
  uint32_t vocab_size() const { return vocab_size_; }
  const std::vector<TokenShard>& shards() const { return shards_; }
  // Whether some targets may be kIgnoreTarget: some shard has a loss mask, or record starts (a
  // record's first token is no target).
  bool has_loss_mask() const { return has_loss_mask_; }
  // Whether some shard marks where its records begin (prepare --pack): samples then hold several
  // records, which ReadExample's positions keep apart.
  bool has_record_starts() const { return has_record_starts_; }

  // Writes the seq_len + 1 tokens of sample `index` (< num_samples()) to `out`.
  // CorruptTokenError naming the shard and token when an id is >= vocab_size().
  void ReadSample(int64_t index, int64_t* out) const;
  // Writes the seq_len inputs and seq_len targets of sample `index`, masked targets as
  // kIgnoreTarget; returns how many targets count. With `positions`, also each input's position
  // in its record (0 where a record begins, and at the sample's first token). CorruptTokenError
  // as ReadSample.
  int64_t ReadExample(int64_t index, int64_t* inputs, int64_t* targets,
                      int64_t* positions = nullptr) const;
  // How many of sample `index`'s seq_len targets count (seq_len without a mask).
  int64_t CountLossTargets(int64_t index) const;

 private:
  TokenDataset() = default;
  // The shard of sample `index` and the sample's first token there.
  std::pair<size_t, uint64_t> Locate(int64_t index) const;

  std::vector<TokenShard> shards_;
  // sample_offsets_[k] = samples in shards 0..k-1; size shards_.size() + 1.
  std::vector<int64_t> sample_offsets_{0};
  int seq_len_ = 0;
  uint32_t vocab_size_ = 0;
  bool has_loss_mask_ = false;
  bool has_record_starts_ = false;
};

// The order of epoch `epoch`: a permutation of 0..num_samples-1, by an explicit Fisher-Yates
// shuffle over std::mt19937_64 seeded from (seed, epoch), with its own unbiased bounded draw
// (std::shuffle and std::uniform_int_distribution are implementation-defined), so that every
// rank, compiler and run computes the same order.
std::vector<int64_t> EpochPermutation(int64_t num_samples, uint64_t seed, int64_t epoch);

// One micro-batch, row-major [batch_size, seq_len].
struct MicroBatch {
  std::vector<int64_t> inputs;
  // kIgnoreTarget where the loss is not taken.
  std::vector<int64_t> targets;
  // Empty unless the data marks records (TokenDataset::has_record_starts): each input's position
  // in its record, row-major like inputs. The model then keeps records apart (see
  // SequenceLayout in model.h).
  std::vector<int64_t> positions;
  int batch_size = 0;
  int seq_len = 0;
  // Targets of this micro-batch that count (not kIgnoreTarget).
  int64_t loss_tokens = 0;
  // Targets that count in the whole optimizer step: every micro-batch of every dp rank. The loss
  // of the step is the sum of the counted targets' losses divided by this, so a micro-batch's
  // mean loss weighs loss_tokens / step_loss_tokens (see LossWeight()).
  int64_t step_loss_tokens = 0;
};

// The weight of a micro-batch's mean loss in its step's loss: loss_tokens / step_loss_tokens, or
// 0 when the whole step has no counted target.
double LossWeight(const MicroBatch& batch);

struct BatchLoaderOptions {
  // Samples per optimizer step across all data-parallel ranks.
  int64_t global_batch_size = 0;
  // Samples per forward/backward pass on one rank.
  int micro_batch_size = 0;
  int dp_rank = 0;
  int dp_size = 1;
  // Seed of the epoch permutations.
  uint64_t seed = 0;
};

// Deals the samples of a TokenDataset to one data-parallel rank. Epoch e visits every sample in
// the order EpochPermutation(num_samples, seed, e). Each optimizer step consumes
// global_batch_size consecutive samples of that order (the step slice); rank r of dp gets the
// contiguous part [r * global / dp, (r + 1) * global / dp) of the slice, cut into micro-batches of
// micro_batch_size. A run with dp = 1 and gradient accumulation therefore sees exactly the same
// samples per step as one with dp = N. When fewer than global_batch_size samples remain in an
// epoch, they are skipped and the next epoch starts.
// Not thread-safe; the dataset must outlive the loader.
class BatchLoader {
 public:
  // INVALID_ARGUMENT naming the field (batch.global_batch_size, batch.micro_batch_size,
  // dp_rank/dp_size) when a size is not positive, global_batch_size is not divisible by
  // micro_batch_size * dp_size, or the dataset has fewer samples than one global batch; also
  // when `start` lies outside the dataset or was recorded with another seed. `start` is where to
  // begin: a default DataPosition for a new run (its seed is then ignored), or a checkpoint's.
  static absl::StatusOr<BatchLoader> Create(const TokenDataset* dataset,
                                            const BatchLoaderOptions& options,
                                            const v1::DataPosition& start);

  // global_batch_size / (micro_batch_size * dp_size): micro-batches per step on each rank.
  int accumulation_steps() const { return accumulation_steps_; }

  // The micro-batches of the next optimizer step for this rank (accumulation_steps() of them), in
  // order. Advances the position by one step.
  std::vector<MicroBatch> NextStep();

  // Position at the current step boundary (what a checkpoint stores); Create(..., position())
  // continues identically.
  v1::DataPosition position() const;

 private:
  BatchLoader(const TokenDataset* dataset, const BatchLoaderOptions& options);
  // Starts the next epoch when the current one cannot fill a whole step.
  void SkipPartialStep();
  const std::vector<int64_t>& Permutation();

  const TokenDataset* dataset_;
  BatchLoaderOptions options_;
  int accumulation_steps_ = 0;
  int64_t epoch_ = 0;
  int64_t samples_in_epoch_ = 0;
  // The permutation of permutation_epoch_, computed once per epoch.
  std::vector<int64_t> permutation_;
  int64_t permutation_epoch_ = -1;
};

}  // namespace tessera::trainer
