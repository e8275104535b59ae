// The prepare step: tokenizes raw text (.txt documents or JSONL records) into the token shards a
// training job reads, split into train and validation shards. Runs once per corpus, before
// training, on one machine.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace tessera::trainer {

struct PrepareOptions {
  // .txt files (a whole file is one document) or .jsonl files (one JSON object per line).
  std::vector<std::string> inputs;
  // "text", "jsonl", or "auto": by extension, .jsonl and .ndjson are JSONL and anything else text.
  // A JSONL record is a document made of its "text" field, or "<instruction>\n\n<response>" from
  // its instruction and response fields (also prompt / completion). Every document is followed by
  // eos.
  std::string format = "auto";
  // Where train-00000.bin, train-00001.bin, ..., val-00000.bin, ... are written (created if
  // missing). Shards of an earlier run numbered past this run's are removed.
  std::string output_dir;
  // "byte", or the path of a SentencePiece .model.
  std::string tokenizer = "byte";
  // Fraction of the tokens, taken from the end, written to val shards; in [0, 1).
  double val_fraction = 0.05;
  // Tokens per shard file (the last shard of each split may hold fewer).
  uint64_t tokens_per_shard = 1 << 24;
};

struct PrepareResult {
  std::vector<std::string> train_shards;
  std::vector<std::string> val_shards;
  uint64_t train_tokens = 0;
  uint64_t val_tokens = 0;
  uint32_t vocab_size = 0;
};

// Tokenizes options.inputs in the order given and writes the shards. The whole corpus is held in
// memory as 4-byte tokens while it is split. Errors name the option or input file at fault, and
// the line for malformed JSONL ("in.jsonl:3: ...").
absl::StatusOr<PrepareResult> PrepareData(const PrepareOptions& options);

}  // namespace tessera::trainer
