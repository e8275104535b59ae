// Tokenizers that turn text into the token ids of the shards and back: a byte tokenizer (every
// UTF-8 byte is a token, needs no model) and SentencePiece models (libsentencepiece); Hugging
// Face tokenizer.json files are in hf_tokenizer.h. The prepare step encodes with them; a trainer
// decodes samples with them for logs.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace tessera::trainer {

// Thread-compatible: const methods may be called from several threads at once.
class Tokenizer {
 public:
  virtual ~Tokenizer() = default;
  // The tokens of `text`; no eos is appended.
  virtual std::vector<uint32_t> Encode(std::string_view text) const = 0;
  // Encode of each text; faster than one call per text where a call has a fixed cost (the
  // Hugging Face tokenizer's round trip to its process).
  virtual std::vector<std::vector<uint32_t>> EncodeBatch(
      std::span<const std::string_view> texts) const {
    std::vector<std::vector<uint32_t>> tokens;
    tokens.reserve(texts.size());
    for (std::string_view text : texts) tokens.push_back(Encode(text));
    return tokens;
  }
  // The text of `tokens`. Control tokens such as eos, and ids outside the vocabulary, decode to
  // nothing.
  virtual std::string Decode(std::span<const uint32_t> tokens) const = 0;
  // Every id is < vocab_size().
  virtual uint32_t vocab_size() const = 0;
  // The end-of-document token the prepare step puts between documents.
  virtual uint32_t eos_id() const = 0;
  // OK, or why the tokenizer stopped working (a tokenizer that runs in another process: that
  // process died or did not answer). From the first failure on, Encode and Decode return
  // nothing, so callers check this after encoding.
  virtual absl::Status status() const { return absl::OkStatus(); }
};

// Bytes 0..255 are tokens 0..255; eos is 256; vocab_size is 257. Round-trips any byte string.
std::unique_ptr<Tokenizer> MakeByteTokenizer();

// Loads a SentencePiece model (a .model file). Text is normalized as the model was trained to:
// SentencePiece's default (nmt_nfkc, remove_extra_whitespaces) folds runs of whitespace and
// newlines into one space; train with --normalization_rule_name=identity
// --remove_extra_whitespaces=false --byte_fallback=true to keep text byte-exact. NOT_FOUND when
// `model_path` does not exist, INVALID_ARGUMENT when it is not a model or the model has no eos
// piece; messages name the path. FAILED_PRECONDITION when libtessera_sentencepiece.so cannot be
// loaded (see sentencepiece_shim.h for why SentencePiece is reached through it).
absl::StatusOr<std::unique_ptr<Tokenizer>> LoadSentencePieceTokenizer(
    const std::string& model_path);

// Trains a SentencePiece model: SentencePieceTrainer::Train with spm_train's flags, e.g.
// "--input=corpus.txt --model_prefix=out/spm --vocab_size=8000". Call this rather than
// libsentencepiece directly, which cannot share a process with our protobuf (sentencepiece_shim.h).
absl::Status TrainSentencePieceModel(const std::string& args);

}  // namespace tessera::trainer
