// Hugging Face tokenizers (a tokenizer.json, as Llama 3, Qwen3 and most models on the Hub ship
// them) for the prepare step. They run in the maintained `tokenizers` Python package, so that the
// ids are exactly the ones transformers produces: one long-lived Python child process per
// tokenizer runs trainer/data/hf_tokenizer_server.py and answers encode and decode requests over a
// pipe (a Unix socket pair), in batches.
#pragma once

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "trainer/data/tokenizer.h"

namespace tessera::trainer {

// The Python interpreter that runs the tokenizer, when set and not empty: one that can
// `import tokenizers` (scripts/bootstrap.sh's torch venv has it, as a dependency of
// transformers).
inline constexpr char kTesseraPythonEnv[] = "TESSERA_PYTHON";
// The path of hf_tokenizer_server.py, when set and not empty (an installation that moved it).
inline constexpr char kHfTokenizerServerEnv[] = "TESSERA_HF_TOKENIZER_SERVER";

// How long the child may take to start and load the tokenizer (importing tokenizers and parsing
// a 10 MB tokenizer.json take about a second).
inline constexpr absl::Duration kDefaultHfStartTimeout = absl::Seconds(120);
// How long one request may go without an answer before the tokenizer counts as failed.
inline constexpr absl::Duration kDefaultHfRequestTimeout = absl::Seconds(600);

struct HfTokenizerOptions {
  // The interpreter. Empty: $TESSERA_PYTHON, else the python this build found torch in, else
  // python3 on PATH.
  std::string python;
  // hf_tokenizer_server.py. Empty: $TESSERA_HF_TOKENIZER_SERVER, else ../lib/ beside the running
  // binary's directory (where the build copies it), else the source tree's copy.
  std::string server_script;
  // The added token that ends documents. Empty: the first of <|end_of_text|> (Llama 3),
  // <|endoftext|> (Qwen, GPT-2), </s> (Llama 2, Mistral), <eos> (Gemma), <|im_end|>, <|eot_id|>
  // that the tokenizer has.
  std::string eos_token;
  absl::Duration start_timeout = kDefaultHfStartTimeout;
  absl::Duration request_timeout = kDefaultHfRequestTimeout;
};

// Whether `tokenizer` names a Hugging Face tokenizer: a path whose file name is
// "tokenizer.json", or a directory that holds one.
bool IsHfTokenizerPath(const std::string& tokenizer);

// Starts the tokenizer's process and loads `tokenizer_json` (a tokenizer.json, or a directory
// holding one). Encode adds no special tokens (add_special_tokens=False); Decode skips them;
// vocab_size counts the added tokens. Text that holds an added token's content verbatim (e.g.
// "<|endoftext|>") encodes to that token, as in transformers.
//
// Errors: NOT_FOUND when the path does not exist; INVALID_ARGUMENT when it is not a
// tokenizer.json (with Python's message), or has no eos token (see eos_token); FAILED_PRECONDITION
// when the interpreter cannot be started or cannot import `tokenizers` (the message says to run
// scripts/bootstrap.sh or set TESSERA_PYTHON); DEADLINE_EXCEEDED past start_timeout.
//
// The tokenizer is thread-safe (requests are serialized). When the process fails later (it died,
// a request timed out, text is not UTF-8), status() says why and from then on Encode and Decode
// return nothing. The destructor ends the process.
absl::StatusOr<std::unique_ptr<Tokenizer>> LoadHfTokenizer(const std::string& tokenizer_json,
                                                           const HfTokenizerOptions& options = {});

}  // namespace tessera::trainer
